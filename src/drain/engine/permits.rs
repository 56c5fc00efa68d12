//! How one drain uses the move [ledger](crate::drain::ledger): its asks for
//! permits (each pod turned into its ask by the ledger's
//! [`pod_ask`](crate::drain::ledger::pod_ask), with this drain's Events,
//! `status.drain` words and its permits' expiry from its deadline), the
//! gate of a pod without volumes whose workload bounds its moves, the
//! permits it gives back when a move never began or the drain ends, and
//! whether a move no drain watches any more is over.

use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;

use super::node_drain::NodeDrain;
use super::reports::pod_ref_key;
use super::waits::Health;
use crate::cache::Caches;
use crate::drain::ledger::{
    Answer, Asker, Budget, Permit, PodAsk, PodToMove, Workload, WorkloadFacts, WorkloadTerms,
    moving_names, permit_expires, planned_ask, pod_ask, ready_since, serves,
};
use crate::drain::plan::PlannedPod;
use crate::drain::select::fmt_key;

/// One drain's asks of the move ledger.
#[derive(Clone, Copy)]
pub(super) struct DrainPermits<'d> {
    d: &'d NodeDrain,
}

impl<'d> DrainPermits<'d> {
    pub(super) fn new(d: &'d NodeDrain) -> Self {
        Self { d }
    }

    /// Ends the permit of `p`, of `workload`, unless its move is recorded
    /// (a move that never began: not allowed, not evicted, or nothing to
    /// wait for; or one that ended), by [`DrainPermits::end`].
    pub(super) fn end_unrecorded(self, p: &PlannedPod, workload: &Workload) {
        let key = fmt_key(&p.pod);
        if self.d.progress.move_of(&key).is_none() {
            self.end(workload, p.uid.as_deref().unwrap_or(&key));
        }
    }

    /// Ends the permit of the move of pod `uid`, of `workload`, that this
    /// drain is done with. For a workload whose availability berth does
    /// not read (see [`replaced`]), only once the move is over: until then
    /// the permit is kept and the keeper judges it, as a workload whose
    /// availability berth reads keeps its budget by its replicas down.
    pub(super) fn end(self, workload: &Workload, uid: &str) {
        let caches = &self.d.deps.caches;
        let lingers = workload.kind != "Pod"
            && self
                .d
                .deps
                .permits
                .held_for(workload, uid)
                .is_some_and(|p| {
                    caches.terms(workload).availability.is_none()
                        && !move_done(caches, workload, &p)
                });
        if lingers {
            tracing::debug!(%workload, uid, "the move's replacement is not healthy yet: its permit is left to the keeper");
            self.d.deps.permits.linger(uid);
        } else {
            self.d.deps.permits.end(workload, uid);
        }
    }

    /// Ends the permits of this Machine that its move records do not hold
    /// and whose move is over (see [`move_done`]): a permit granted to an
    /// earlier run that stopped before it evicted, or a gated move that
    /// ended. A move handed over (see `MoveRecords::hand_over_held`), or
    /// one an earlier run began without recording (a pod without volumes),
    /// keeps its permit until its workload is whole again.
    pub(super) fn release_unrecorded(self) {
        let recorded: Vec<String> = self
            .d
            .progress
            .moves()
            .iter()
            .map(|m| m.uid.clone().unwrap_or_else(|| m.pod.clone()))
            .collect();
        let caches = &self.d.deps.caches;
        self.d
            .deps
            .permits
            .release_done(&self.machine_key(), |w, p| {
                !recorded.contains(&p.uid) && move_done(caches, w, p)
            });
    }

    /// This drain as the ledger knows an asker.
    fn asker(self) -> Asker {
        Asker {
            machine: self.machine_key(),
            requested: self.d.job.deadline.started,
            past_deadline: self.d.clock.expired(),
            moves_left: self.d.moves_left.load(std::sync::atomic::Ordering::Acquire),
        }
    }

    /// This drain's Machine as the ledger names it, `namespace/name`.
    pub(super) fn machine_key(self) -> String {
        format!(
            "{}/{}",
            self.d.job.machine.namespace.as_deref().unwrap_or_default(),
            self.d.job.machine.name
        )
    }

    /// What the ledger makes of `p` for this drain now (see [`planned_ask`]):
    /// its workload, its budget and its ask; each value berth cannot read
    /// warned about once.
    pub(super) fn pod_ask(self, p: &PlannedPod) -> PodAsk {
        let pod = self.d.view().pod(&p.pod, p.uid.as_deref());
        // The budget is on the pod template: the pod's, or once it is gone
        // its replacement's (a pod that uses one of its claims now).
        let replacement = match pod {
            Some(_) => None,
            None => p
                .volumes
                .iter()
                .flat_map(|v| self.d.view().claim_users(&v.volume.claim))
                .find(|u| u.metadata.uid != p.uid),
        };
        let asked = planned_ask(
            &self.d.deps.caches,
            p,
            pod.as_deref(),
            replacement.as_deref(),
            &self.asker(),
        );
        for b in &asked.bad {
            let workload = &asked.workload;
            if self.d.reports.first(format!("budget/{workload}/{}", b.key)) {
                self.d.reports.event(
                    EventType::Warning,
                    "InvalidMoveBudget",
                    format!("{workload}: {b}; the default holds"),
                    Some(pod_ref_key(&p.pod)),
                );
            }
        }
        asked
    }

    /// Asks the move ledger for a permit to surge `p` now (see
    /// [`PodToMove::surge`]): its workload, or what it waits for. A
    /// stateful pod's move (`moving`) holds its permit already.
    pub(super) async fn surge_permit(
        self,
        p: &PlannedPod,
        moving: bool,
    ) -> Result<Workload, String> {
        let pod = self.d.view().pod(&p.pod, p.uid.as_deref());
        let asked = pod_ask(
            &self.d.deps.caches,
            PodToMove::planned(p, pod.as_deref()).surging(),
            &self.asker(),
        );
        if !moving {
            self.permit_for(p, &asked).await?;
        }
        Ok(asked.workload)
    }

    /// Whether a permit records a surge of `p` (made before a restart).
    pub(super) fn surge_recorded(self, p: &PlannedPod) -> bool {
        let asked = self.pod_ask(p);
        let uid = p.uid.clone().unwrap_or_else(|| fmt_key(&p.pod));
        self.d
            .deps
            .permits
            .surge_of(&asked.workload, &uid)
            .is_some()
    }

    /// Ends the permit of pod `uid`'s surge, of `workload`; one whose
    /// scale-up is not put back yet is left to the keeper, which puts it
    /// back.
    pub(super) fn end_surge(self, workload: &Workload, uid: &str) {
        let permits = &self.d.deps.permits;
        let unrestored = permits
            .surge_of(workload, uid)
            .is_some_and(|s| s.method == "ScaleUp" && s.restored.is_none());
        if unrestored {
            permits.linger(uid);
        } else {
            permits.end(workload, uid);
        }
    }

    /// Asks the move ledger for a permit to move `p` now, for its workload
    /// (returned), holding `destination`'s attach slots for it. `Ok`: it may (granted, or beyond the budget or the cap
    /// past the deadline, which is warned); `Err`: what it waits for, which
    /// `status.drain` and an Event (once per pod and what it waits for)
    /// say.
    pub(super) async fn permit(
        self,
        p: &PlannedPod,
        destination: Option<String>,
    ) -> Result<Workload, String> {
        let mut asked = self.pod_ask(p);
        if let Some(ask) = asked.ask.as_mut() {
            ask.destination = destination;
        }
        self.permit_for(p, &asked).await?;
        Ok(asked.workload)
    }

    /// [`DrainPermits::permit`] for `p`, as the ledger made it (`asked`); a
    /// pod whose move the ledger does not count (no volumes, no bound: not
    /// a stateful pod) may go.
    async fn permit_for(self, p: &PlannedPod, asked: &PodAsk) -> Result<(), String> {
        let Some(ask) = &asked.ask else {
            return Ok(());
        };
        let key = fmt_key(&p.pod);
        let (workload, budget, terms) = (&asked.workload, &asked.budget, &asked.terms);
        let others = moving_names;
        let owner = asked.owner.as_ref();
        let now = Timestamp::now();
        let deadline = self
            .d
            .job
            .deadline
            .started
            .checked_add(self.d.job.deadline.timeout)
            .unwrap_or(Timestamp::MAX);
        let expires = permit_expires(
            now,
            budget.healthy_deadline,
            deadline,
            self.d.job.settings.volume_reattach_timeout,
        );
        let answer = self.d.deps.permits.ask(ask, budget, owner, expires);
        let (why, holders) = match answer.await {
            Answer::Granted(_) => return Ok(()),
            Answer::Bypassed { moving, .. } => {
                let beyond = match budget.max_moving {
                    Some(n) if moving.len() >= n as usize => {
                        format!("beyond its budget of {n} while {} move", others(&moving))
                    }
                    _ => format!(
                        "beyond berth's cap of {} volume moves in flight (--max-volume-moves)",
                        self.d.deps.permits.cap().unwrap_or(0)
                    ),
                };
                self.d.reports.event(
                    EventType::Warning,
                    "MoveBudgetBypassed",
                    format!("drain deadline passed: pod {key} of {workload} moves {beyond}"),
                    Some(pod_ref_key(&p.pod)),
                );
                return Ok(());
            }
            Answer::Wait {
                moving,
                ahead,
                degraded,
            } => {
                let mut why = if moving.is_empty() {
                    format!("pod {key} waits: {workload}")
                } else {
                    format!("pod {key} waits: {workload} is moving {}", others(&moving))
                };
                if degraded > 0 {
                    if !moving.is_empty() {
                        why.push(',');
                    }
                    why.push_str(&format!(" {}", self.degraded(workload, terms, degraded)));
                }
                if !ahead.is_empty() {
                    why.push_str(&format!(", and {} go first", ahead.join(", ")));
                }
                let mut holders: Vec<&str> = moving.iter().map(|m| m.uid.as_str()).collect();
                if degraded > 0 {
                    holders.push("degraded");
                }
                (why, holders.join(","))
            }
            Answer::Contended { error: None } => (
                format!(
                    "pod {key} waits: {workload}'s permit was taken at the same moment (by another drain or berth process)"
                ),
                "contended".to_string(),
            ),
            Answer::Contended { error: Some(e) } => (
                format!("pod {key} waits: its permit of {workload} cannot be written: {e}"),
                "unwritten".to_string(),
            ),
            Answer::Capped { in_flight, cap } => (
                format!(
                    "pod {key} waits: {in_flight} volume moves are in flight across every drain, berth's cap (--max-volume-moves {cap})"
                ),
                "cap".to_string(),
            ),
        };
        // Once per pod and what holds it: a new holder is news.
        if self.d.reports.first(format!("waits/{}/{holders}", ask.uid)) {
            self.d.reports.event(
                EventType::Normal,
                "WaitingForMoveBudget",
                why.clone(),
                Some(pod_ref_key(&p.pod)),
            );
        }
        Err(why)
    }

    /// `workload` in words when `degraded` of its replicas are down for
    /// other reasons than berth's moves: how many of how many its owner
    /// counts unavailable, and for a StatefulSet which of its pods are not
    /// Ready and since when (e.g. `has 1 of 3 replicas unavailable (db-2
    /// not Ready since 2026-11-28T12:31:52Z)`).
    fn degraded(self, workload: &Workload, terms: &WorkloadTerms, degraded: u32) -> String {
        let a = terms.availability.unwrap_or_default();
        let mut words = format!(
            "has {} of {} replica{} unavailable, {degraded} down besides berth's moves",
            a.unavailable,
            a.replicas,
            if a.replicas == 1 { "" } else { "s" }
        );
        let caches = &self.d.deps.caches;
        let uid = (workload.kind == "StatefulSet")
            .then(|| {
                caches
                    .stateful_sets
                    .get(&ObjectRef::new(&workload.name).within(&workload.namespace))
            })
            .flatten()
            .and_then(|s| s.metadata.uid.clone());
        if let Some(uid) = uid {
            let mut down: Vec<String> = caches
                .indexes
                .pods_by_controller
                .get(&caches.pods, &uid)
                .iter()
                .filter(|p| ready_since(p).is_none() || !serves(caches, p))
                .map(|p| {
                    let name = p.metadata.name.clone().unwrap_or_default();
                    if ready_since(p).is_some() {
                        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
                        return format!(
                            "{name} on Node {}, which is down",
                            node.unwrap_or_default()
                        );
                    }
                    // Since a time, not for a duration: the words stay the
                    // same while the wait lasts, so the status that carries
                    // them is not rewritten each second to count it.
                    let since = p
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                        .and_then(|c| c.last_transition_time.as_ref())
                        .or(p.metadata.creation_timestamp.as_ref());
                    match since {
                        Some(t) => format!("{name} not Ready since {}", t.0),
                        None => format!("{name} not Ready"),
                    }
                })
                .collect();
            down.sort();
            if !down.is_empty() {
                words.push_str(&format!(" ({})", down.join(", ")));
            }
        }
        words
    }

    /// The gate of a pod without volumes: when its workload bounds how many
    /// of its pods move (its `berth.dev/max-moving`; unbounded by default
    /// for pods without volumes, where PodDisruptionBudgets alone govern),
    /// a permit of the ledger, as a stateful pod's. `Ok(None)`: no gate;
    /// `Err`: what it waits for (the pod is left to a later pass).
    pub(super) async fn stateless_gate(self, p: &PlannedPod) -> Result<Option<Gate>, String> {
        let asked = self.pod_ask(p);
        if asked.budget.max_moving.is_none() {
            return Ok(None);
        }
        let controller = self.d.view().pod(&p.pod, p.uid.as_deref()).and_then(|pod| {
            crate::drain::ledger::workload::controller(pod.metadata.owner_references.as_deref())
                .map(|c| c.uid.clone())
        });
        self.permit_for(p, &asked).await?;
        Ok(Some(Gate {
            workload: asked.workload,
            budget: asked.budget,
            controller,
            evicted_at: Timestamp::now(),
        }))
    }

    /// The move of a gated pod without volumes is over: gone, and, when
    /// its workload asks for a healthy replacement (a minimum healthy time,
    /// or its `minReadySeconds`), a new pod of its controller Ready that
    /// long elsewhere, within its healthy deadline (else the reattach
    /// timeout: then a Warning, and the move ends anyway). Its permit is
    /// free.
    pub(super) async fn end_stateless_move(self, p: &PlannedPod, gate: &Gate) {
        if !gate.budget.min_healthy.is_zero()
            && let Some(controller) = &gate.controller
        {
            self.await_replacement_healthy(p, gate, controller).await;
        }
        self.release_gate(p, gate);
    }

    /// The permit of a gated pod without volumes is free (its move ended,
    /// or it was never evicted).
    pub(super) fn release_gate(self, p: &PlannedPod, gate: &Gate) {
        let key = fmt_key(&p.pod);
        self.end(&gate.workload, p.uid.as_deref().unwrap_or(&key));
    }

    async fn await_replacement_healthy(self, p: &PlannedPod, gate: &Gate, controller: &str) {
        let key = fmt_key(&p.pod);
        let min = gate.budget.min_healthy;
        let bound = gate
            .budget
            .healthy_deadline
            .unwrap_or(self.d.job.settings.volume_reattach_timeout);
        let uid = p.uid.clone().unwrap_or_default();
        let caches = &self.d.deps.caches;
        let ready = || {
            let pods = caches
                .indexes
                .pods_by_controller
                .get(&caches.pods, controller);
            vec![crate::drain::ledger::workload::replacement_ready_since(
                pods.iter().map(AsRef::as_ref),
                &uid,
                Some(&self.d.job.node),
                gate.evicted_at,
            )]
        };
        let waiting = || {
            self.d.progress.update(|pr| {
                pr.waiting_for = Some(format!(
                    "a replacement of pod {key} ({}) to be Ready for {}",
                    gate.workload,
                    humantime::format_duration(min)
                ));
            });
        };
        let until = self.d.clock.bounded(bound);
        if let Health::TimedOut = self
            .d
            .waits()
            .wait_healthy(min, until, ready, waiting)
            .await
        {
            self.d.reports.event(
                EventType::Warning,
                "ReplacementNotHealthy",
                format!(
                    "no replacement of pod {key} ({}) Ready for {} within {}: this drain goes on, and the next pod of its workload goes only while its workload's replicas down stay within its move budget",
                    gate.workload,
                    humantime::format_duration(min),
                    humantime::format_duration(bound)
                ),
                Some(pod_ref_key(&p.pod)),
            );
        }
    }
}

/// Whether the move that holds `p`, of workload `w`, is over for a Machine
/// whose drain no longer watches it (ended, or gone), or for a drain that
/// left it to the keeper (see [`Permits::linger`](crate::drain::ledger::Permits::linger)):
/// it never began (its pod is still there and not being deleted), or its
/// workload is whole again and its attachable volumes are attached where
/// the replacement runs. Whole is none of its replicas unavailable, for a
/// kind whose availability berth reads; for any other kind (an operator's
/// custom resource, a Job), the pod that replaced the moved one healthy
/// (see [`replaced`]).
pub(super) fn move_done(caches: &Caches, w: &Workload, p: &Permit) -> bool {
    if surging(caches, w, p) {
        return false;
    }
    let never_began = p.pod.split_once('/').is_some_and(|(ns, name)| {
        caches
            .pods
            .get(&ObjectRef::new(name).within(ns))
            .is_some_and(|pod| {
                pod.metadata.uid.as_deref() == Some(p.uid.as_str())
                    && pod.metadata.deletion_timestamp.is_none()
            })
    });
    if never_began {
        return true;
    }
    let terms = caches.counted(w, caches.terms(w));
    let whole = match &terms.availability {
        Some(a) => a.unavailable == 0,
        None => replaced(caches, w, p, &terms, Timestamp::now()).is_ok(),
    };
    whole && volumes_moved(caches, p)
}

/// Whether the permit of `p`, of `w`, records a surge that is not over
/// (as the API server's copy says): its pod is still there, or its
/// scale-up is not put back. Such a move began, though its pod is still
/// there, and is not over before its scale-up is put back.
fn surging(caches: &Caches, w: &Workload, p: &Permit) -> bool {
    let state = caches.move_permits.state();
    let Some(surge) = state
        .iter()
        .filter(|o| o.metadata.namespace.as_deref() == Some(w.namespace.as_str()))
        .find(|o| o.spec.pod_uid == p.uid)
        .and_then(|o| o.spec.surge.as_ref())
    else {
        return false;
    };
    let pod_there = p.pod.split_once('/').is_some_and(|(ns, name)| {
        caches
            .pods
            .get(&ObjectRef::new(name).within(ns))
            .is_some_and(|pod| pod.metadata.uid.as_deref() == Some(p.uid.as_str()))
    });
    pod_there || (surge.method == "ScaleUp" && surge.restored.is_none())
}

/// For a workload whose availability berth does not read: whether the pod
/// that replaced the moved one is healthy at `now`: Ready for the minimum
/// healthy time its template asks (see
/// [`budget_of`](crate::drain::ledger::budget_of)), not the moved pod, not
/// being deleted. The pods that replaced it are those that use the claims
/// of its attachable volumes now; for a move without one, the workload's
/// controller's pods made since the move began (creation times have whole
/// seconds: a replica made a moment before the move cannot be told from
/// its replacement, which the claims can). `Err(Some(at))`: it will be
/// at `at` if it stays Ready; `Err(None)`: none is Ready.
///
/// `Ok(())` where nothing will replace it or berth cannot tell: a pod that
/// is its own workload, or a controller berth cannot name (the permit's
/// object, which names it, not read yet); the volumes alone decide then,
/// as they did before.
pub(super) fn replaced(
    caches: &Caches,
    w: &Workload,
    p: &Permit,
    terms: &WorkloadTerms,
    now: Timestamp,
) -> Result<(), Option<Timestamp>> {
    if w.kind == "Pod" || w.kind == crate::drain::ledger::MOVE_GROUP_KIND {
        return Ok(());
    }
    let pods = if p.attach.is_empty() {
        let controller = caches.move_permits.state().iter().find_map(|o| {
            (o.spec.pod_uid == p.uid && o.metadata.namespace.as_deref() == Some(&w.namespace))
                .then(|| Some(o.metadata.owner_references.as_ref()?.first()?.uid.clone()))
                .flatten()
        });
        let Some(controller) = controller else {
            return Ok(());
        };
        caches
            .indexes
            .pods_by_controller
            .get(&caches.pods, &controller)
    } else {
        p.attach
            .iter()
            .filter_map(|pv| {
                caches
                    .pvs
                    .get(&ObjectRef::new(pv))?
                    .spec
                    .as_ref()?
                    .claim_ref
                    .clone()
            })
            .filter_map(|c| Some(crate::cache::claim_key(&c.namespace?, &c.name?)))
            .flat_map(|claim| caches.indexes.pods_by_claim.get(&caches.pods, &claim))
            .collect()
    };
    let newest = pods
        .iter()
        .max_by_key(|pod| pod.metadata.creation_timestamp.as_ref().map(|t| t.0));
    let template = newest.and_then(|pod| pod.metadata.annotations.as_ref());
    let (budget, _) = crate::drain::ledger::budget_of(template, terms, p.volumes);
    let since = crate::drain::ledger::workload::replacement_ready_since(
        pods.iter().map(AsRef::as_ref),
        &p.uid,
        None,
        p.since,
    );
    crate::drain::ledger::healthy(&[since], budget.min_healthy, now)
}

/// Whether each attachable PV of the move that holds `p` is attached
/// where a pod that replaced it runs (see
/// [`volume_moved`](crate::drain::volume::volume_moved)): a pod can be
/// Ready before its volume is attached, on a node that does not mount it
/// first. A PV that is gone, or no longer bound, has nothing to wait for.
fn volumes_moved(caches: &Caches, p: &Permit) -> bool {
    let view = super::view::View::new(caches, "");
    let none = std::collections::BTreeSet::new();
    p.attach.iter().all(|pv| {
        let claim = caches
            .pvs
            .get(&ObjectRef::new(pv))
            .and_then(|v| v.spec.as_ref()?.claim_ref.clone())
            .and_then(|c| Some((c.namespace?, c.name?)));
        claim.is_none_or(|claim| {
            view.volume_moved(
                pv,
                &claim,
                crate::drain::volume_kind::VolumeKind::Attachable,
                &p.uid,
                &none,
            )
            .is_ok()
        })
    })
}

/// A pod without volumes that holds a permit of the move ledger.
pub(super) struct Gate {
    workload: Workload,
    budget: Budget,
    /// The UID of the pod's controller, whose new pod replaces it.
    controller: Option<String>,
    evicted_at: Timestamp,
}
