//! One stateful pod's move off the Node, as named steps:
//!
//! 0. while `nodeLocalVolumes: Block` [holds](Migration::allowed) it, wait
//!    for an operator's permission (or the deadline);
//! 1. [`evict`](Migration::evict) it (registered with the volume tracker
//!    first, so that no volume event can slip in between);
//! 2. wait for the [pod to be gone](Migration::pod_gone), and name any
//!    node-local volume whose data is now lost;
//! 3. wait for its attachable volumes to be [detached](Migration::detached)
//!    from this Node, once the pods the plan says must be gone first are
//!    gone;
//! 4. wait for the [replacement](Migration::replacement) pod that needs them
//!    again, if its controller makes one;
//! 5. wait for the volumes to have [moved](Migration::moved) with it: an
//!    attachable volume attached on the Node where the replacement runs, an
//!    attach-free one's replacement Running and Ready on another Node (a
//!    warning if not in time).
//!
//! Each step returns whether the next one is due; the first that is not
//! ends the move.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kube::runtime::events::EventType;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

use super::eviction::Eviction;
use super::node_drain::NodeDrain;
use super::permits::DrainPermits;
use super::records::MoveRecords;
use super::reports::{pod_ref_key, pv_ref};
use super::surge::evict_or_surge;
use super::waits::{Awaited, Reattach};
use crate::api::VolumeMove;
use crate::drain::ledger::workload::wants_ordinal;
use crate::drain::plan::{DrainPlan, PlannedPod, PlannedVolume};
use crate::drain::resume::resumed_pod;
use crate::drain::select::fmt_key;
use crate::drain::volume_kind::{VolumeKind, allows_data_loss};
use crate::volumes::{Interest, Registration};

/// How long a drain waits, after a controlled stateful pod's volumes have
/// detached, for a controller other than a StatefulSet to create the pod
/// that will use them again (at most the reattach timeout): none after
/// this long means it was scaled down meanwhile. A StatefulSet says
/// whether it wants the pod back (its replicas and ordinals); while it
/// does, the wait is the reattach timeout.
const REPLACEMENT_WAIT: Duration = Duration::from_secs(30);

/// One stateful pod being moved.
pub(super) struct Migration<'a> {
    d: &'a NodeDrain,
    /// The plan the pod was moved by (what must be gone before its volumes
    /// detach); none for a move resumed after a restart.
    plan: Option<&'a DrainPlan>,
    pod: &'a PlannedPod,
    /// The pod's `namespace/name`.
    key: String,
    /// The PVs it waits for to detach (those it is the last user of).
    pvs: Vec<String>,
    /// The tracker's registration for `pvs`, made before the eviction.
    reg: Registration,
    /// The UIDs of the pods that used each claim this pod's volumes move
    /// with on other Nodes before the eviction: they are not its
    /// replacement (a ReadWriteMany volume already attached elsewhere).
    users_before: BTreeMap<String, BTreeSet<String>>,
    /// Told once this move's eviction is answered (or it will not be sent
    /// soon), for the head of a drain's chain (see `evict_and_move`).
    head: Option<&'a watch::Sender<bool>>,
}

impl Migration<'_> {
    /// Moves one stateful pod of `plan`: evict → gone → detached →
    /// replacement → attached elsewhere. Says whether its volumes left this
    /// Node (the pod went and they detached); if not, no other stateful pod
    /// may go in this pass.
    /// `head`, for the head of the drain's chain, is told once its eviction
    /// is answered, or once none will be sent soon.
    pub(super) async fn start(
        d: &NodeDrain,
        plan: &DrainPlan,
        pod: &PlannedPod,
        head: Option<&watch::Sender<bool>>,
    ) -> bool {
        let mut m = Migration::register(d, Some(plan), pod, None);
        m.head = head;
        let key = m.key.clone();
        let span = tracing::info_span!("migrate", pod = %key, pvs = %m.pvs.join(","));
        let moved = m.steps().instrument(span).await;
        d.progress.update(|p| {
            if p.current_pod.as_deref() == Some(key.as_str()) {
                p.current_pod = None;
                p.current_volume = None;
                p.waiting_for = None;
            }
        });
        moved
    }

    /// Resumes move `m`, which an earlier d recorded and whose pod is
    /// gone, by the rules of a first d (see
    /// [`resumed_pod`](crate::drain::resume::resumed_pod)): its attachable
    /// volumes detached from this Node, the replacement its controller
    /// makes, and each volume moved to it (an attach-free one when the
    /// replacement is Ready). Ends the move.
    pub(super) async fn resume(d: &NodeDrain, m: &VolumeMove) {
        let pvs: Vec<_> = m
            .volumes
            .iter()
            .filter_map(|pv| d.view().pv(pv))
            .map(|pv| (*pv).clone())
            .collect();
        let planned = resumed_pod(m, &pvs, &d.volume_context(), &d.job.settings);
        let Some(planned) = planned else {
            MoveRecords::new(d).end(&m.pod);
            return;
        };
        let since = m.since.as_ref().map(|t| t.0);
        let mut mig = Migration::register(d, None, &planned, since);
        let span = tracing::info_span!("resume", pod = %m.pod, pvs = %m.volumes.join(","));
        mig.after_gone(std::time::Instant::now())
            .instrument(span)
            .await;
        d.progress.update(|p| {
            if p.current_pod.as_deref() == Some(m.pod.as_str()) {
                p.current_pod = None;
                p.current_volume = None;
                p.waiting_for = None;
            }
        });
    }
}

impl<'a> Migration<'a> {
    /// Registers interest in the volumes `pod` waits for to detach. The
    /// pods that use its claims elsewhere now are not its replacement; for
    /// a move resumed after a restart (`since`: when it began), those that
    /// did before it began.
    fn register(
        d: &'a NodeDrain,
        plan: Option<&'a DrainPlan>,
        pod: &'a PlannedPod,
        since: Option<k8s_openapi::jiff::Timestamp>,
    ) -> Self {
        let detach: Vec<&PlannedVolume> = pod
            .volumes
            .iter()
            .filter(|v| v.wait.waits_for_detach())
            .collect();
        let interest = detach.iter().fold(Interest::new(&d.job.node), |i, v| {
            i.volume(v.volume.pv.clone(), v.volume.unique_name.clone())
        });
        let users_before = pod
            .volumes
            .iter()
            .filter(|v| v.wait.waits_for_reattach())
            .map(|v| {
                let users = d.view().users_elsewhere(&v.volume.claim, since);
                (v.volume.pv.clone(), users)
            })
            .collect();
        Self {
            d,
            plan,
            pod,
            key: fmt_key(&pod.pod),
            pvs: detach.iter().map(|v| v.volume.pv.clone()).collect(),
            reg: d.deps.tracker.register(interest),
            users_before,
            head: None,
        }
    }

    /// The steps, in order; false when the volumes did not leave the Node
    /// (held, not evicted, not gone, or not detached in time).
    ///
    /// A move with volumes to wait for is recorded in `status.drain.moves`
    /// before the eviction and stays recorded while the pod may still be
    /// going (a restart resumes it); it ends once the volumes moved, or
    /// when nothing is left to wait for.
    async fn steps(&mut self) -> bool {
        let (d, key) = (self.d, self.key.clone());
        if self.pod.held.is_some() {
            self.head_done();
        }
        if !self.allowed().await {
            return false;
        }
        let recorded = !self.pvs.is_empty() || !self.pod.volumes.is_empty();
        if recorded {
            let pvs: Vec<String> = self
                .pod
                .volumes
                .iter()
                .map(|v| v.volume.pv.clone())
                .collect();
            if !MoveRecords::new(d).begin(&key, self.pod, &pvs).await {
                return false;
            }
        }
        let evicted = self.evict().await;
        self.head_done();
        if !evicted {
            MoveRecords::new(d).end(&key);
            return false;
        }
        let evicted_at = std::time::Instant::now();
        if !self.pod_gone().await {
            return false;
        }
        self.data_lost();
        self.after_gone(evicted_at).await
    }

    /// The steps once the pod is gone, for a first d and a resumed move
    /// alike: its attachable volumes detached, the replacement that needs
    /// them again, and their move to it. Ends the move; says whether its
    /// volumes left the Node.
    async fn after_gone(&mut self, evicted_at: std::time::Instant) -> bool {
        let (d, key) = (self.d, self.key.clone());
        let detached = self.pvs.is_empty() || self.detached(evicted_at).await;
        let mut held = false;
        if detached && d.clock.expired() {
            // Past the deadline availability is given up, data is not: the
            // volumes left this Node, the next pod may go.
            tracing::info!(pvs = %self.pvs.join(","), "deadline passed: not waiting for the volumes to move");
        } else if detached {
            // Off this Node: the pod is gone and its attachable volumes
            // detached.
            let left_at = std::time::Instant::now();
            let expected = self.replacement().await;
            if !expected.is_empty() {
                held = self.moved(&expected, left_at).await;
            }
        }
        // A move held for an unplaceable replacement stays recorded: it
        // goes on, by these same steps, once the replacement is placed
        // (`Migration::resume`), in this d or the next. So does one whose
        // volumes did not detach in time, with its workload's permit: no
        // other pod of the workload goes while a volume of this one is
        // still on the Node. It goes on once they are off (see
        // `MoveRecords::stalled`), or ends with the Machine.
        if !held && detached {
            MoveRecords::new(d).end(&key);
        }
        detached
    }

    /// The pod's own classes of volume, for status and Events: e.g.
    /// `attachable PV a, attach-free PV b`.
    fn named(vs: &[&PlannedVolume]) -> String {
        vs.iter()
            .map(|v| format!("{} PV {}", v.kind, v.volume.pv))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// While `nodeLocalVolumes: Block` holds the pod, waits for the pod or
    /// the Machine to allow losing its node-local data, woken by pod events
    /// and the reconciler; false when the deadline passed first (the
    /// deadline rules then apply).
    async fn allowed(&self) -> bool {
        let (d, key) = (self.d, &self.key);
        let Some(why) = &self.pod.held else {
            return true;
        };
        // At the deadline, with forcing, the deadline rules apply to it too.
        let forced = || d.clock.expired() && d.job.settings.force_after_deadline;
        if forced() {
            return true;
        }
        let held = why.clone();
        d.progress.update(|p| {
            p.current_pod = Some(key.clone());
            p.current_volume = Some(self.pod.node_local().join(", "));
            p.waiting_for = Some(format!(
                "an operator to allow losing the node-local data of pod {key}"
            ));
            p.blocked_by = Some(held.clone());
            p.local_held = Some(held);
        });
        d.reports.event(
            EventType::Warning,
            "NodeLocalEvictionHeld",
            why.clone(),
            Some(pod_ref_key(&self.pod.pod)),
        );
        let uid = self.pod.uid.as_deref();
        let permitted = || {
            *d.data_loss_allowed.borrow()
                || d.view()
                    .pod(&self.pod.pod, uid)
                    .is_none_or(|p| allows_data_loss(p.metadata.annotations.as_ref()))
        };
        let mut machine = d.data_loss_allowed.clone();
        let mut pods = d.deps.caches.pod_changes.clone();
        let until = d.clock.deadline();
        let allowed = loop {
            machine.borrow_and_update();
            pods.borrow_and_update();
            if permitted() {
                break true;
            }
            tokio::select! {
                r = machine.changed() => if r.is_err() { break permitted() },
                r = pods.changed() => if r.is_err() { break permitted() },
                () = tokio::time::sleep_until(until) => break permitted(),
            }
        };
        d.progress.update(|p| {
            p.blocked_by = None;
            p.local_held = None;
        });
        if !allowed && forced() {
            return true;
        }
        if allowed {
            d.reports.event(
                EventType::Normal,
                "NodeLocalEvictionAllowed",
                format!(
                    "losing the node-local data of pod {key} was allowed ({}=true): evicting it",
                    crate::api::ALLOW_NODE_LOCAL_DATA_LOSS
                ),
                Some(pod_ref_key(&self.pod.pod)),
            );
        }
        allowed
    }

    /// The pod is gone: names each node-local volume it used, whose data
    /// stays on this Node and is lost with the VM.
    fn data_lost(&self) {
        let d = self.d;
        let local: Vec<&PlannedVolume> = self
            .pod
            .volumes
            .iter()
            .filter(|v| v.kind == VolumeKind::NodeLocal)
            .collect();
        if local.is_empty() {
            return;
        }
        let which: Vec<String> = local
            .iter()
            .map(|v| format!("{} ({})", v.volume.pv, v.kind_why))
            .collect();
        d.reports.event(
            EventType::Warning,
            "NodeLocalDataLost",
            format!(
                "pod {} left Node {} without its node-local PV {}: the data cannot follow the pod and is lost with the VM",
                self.key,
                d.job.node,
                which.join(", ")
            ),
            local.first().and_then(|v| pv_ref(&v.volume.pv)),
        );
        d.progress.update(|p| {
            for v in &local {
                let entry = format!("PV {} (pod {})", v.volume.pv, self.key);
                if !p.node_local_lost.contains(&entry) {
                    p.node_local_lost.push(entry);
                }
            }
        });
    }

    /// Evicts the pod; false when the deadline passed first.
    async fn evict(&self) -> bool {
        let (d, key) = (self.d, &self.key);
        let volumes = (!self.pvs.is_empty()).then(|| self.pvs.join(", "));
        d.progress.update(|p| {
            p.current_pod = Some(key.clone());
            p.current_volume = volumes;
            p.waiting_for = Some(format!("eviction of {key}"));
        });
        match evict_or_surge(d, self.pod, true).await {
            Eviction::Expired | Eviction::Refused | Eviction::Waits(_) => false,
            Eviction::Accepted(pod) => {
                d.reports.evicted(vec![pod]);
                true
            }
            Eviction::Gone | Eviction::Forced => true,
        }
    }

    /// Tells the drain that the head of its chain is done with its first
    /// round trips (see `evict_and_move`).
    fn head_done(&self) {
        if let Some(h) = self.head {
            h.send_replace(true);
        }
    }

    /// Waits for the pod to be gone: within its grace period and slack,
    /// then, with a warning, until the deadline. False if it is still there.
    async fn pod_gone(&self) -> bool {
        let (d, key, planned) = (self.d, &self.key, self.pod);
        d.progress
            .step(|p| p.waiting_for = Some(format!("pod {key} to terminate")));
        let uid = planned.uid.as_deref();
        let bound = d.clock.volume_bound(planned.bounds.pod_gone);
        if d.waits().gone(&planned.pod, uid, bound).await {
            return true;
        }
        d.reports.event(
            EventType::Warning,
            "PodTerminationSlow",
            format!(
                "pod {key} is still terminating after its grace period and slack; waiting until the drain deadline"
            ),
            Some(pod_ref_key(&planned.pod)),
        );
        d.waits().gone(&planned.pod, uid, d.clock.deadline()).await
    }

    /// Waits for the volumes to detach from this Node, within the detach
    /// bound; false (and the volumes given up on) when they did not.
    async fn detached(&mut self, evicted_at: std::time::Instant) -> bool {
        let d = self.d;
        let pvs = self.pvs.join(", ");
        let bound = self
            .pod
            .bounds
            .detach
            .unwrap_or(d.job.settings.volume_detach_timeout);
        let until = d.clock.volume_bound(bound);
        self.others_gone(&pvs, until).await;
        let node = &d.job.node;
        d.progress.step(|p| {
            p.waiting_for = Some(format!("attachable PV {pvs} to detach from Node {node}"));
        });
        match self.reg.wait_detached(until).await {
            Ok(()) => {
                let took = evicted_at.elapsed();
                d.deps
                    .metrics
                    .volume_detach_wait
                    .observe(took.as_secs_f64());
                d.reports.event(
                    EventType::Normal,
                    "VolumeDetached",
                    format!(
                        "{pvs} detached from Node {node} {:.1}s after pod {} was evicted",
                        took.as_secs_f64(),
                        self.key
                    ),
                    self.pvs.first().and_then(|pv| pv_ref(pv)),
                );
                true
            }
            Err(e) => {
                d.held.give_up(self.pvs.iter().cloned());
                let first = self.pvs.first().map(String::as_str);
                d.reports
                    .volume_wait_failed("VolumeDetachTimeout", &e, first);
                false
            }
        }
    }

    /// Waits, until `until`, for the pods the plan says must be gone before
    /// the volumes can detach (earlier users, pods already terminating).
    /// With one migration at a time they are gone already.
    async fn others_gone(&self, pvs: &str, until: Instant) {
        let d = self.d;
        let first = self
            .plan
            .map(|p| p.gone_first(self.pod))
            .unwrap_or_default();
        let all_gone = || {
            first
                .iter()
                .all(|(k, uid)| d.view().pod(k, uid.as_deref()).is_none())
        };
        if all_gone() {
            return;
        }
        let names: Vec<String> = first.iter().map(|(k, _)| fmt_key(k)).collect();
        let waiting = format!("{} to be gone before {pvs} can detach", names.join(", "));
        d.progress.update(|p| p.waiting_for = Some(waiting));
        d.waits().pods_until(until, all_gone).await;
    }

    /// The volumes to wait for on another Node: those whose claim some pod
    /// still needs. A pod with a controller gets a replacement, but the
    /// controller may not have created it yet (a busy
    /// kube-controller-manager takes seconds): wait for it, on pod events,
    /// before concluding none is coming. Says so for each volume nobody
    /// needs any more.
    async fn replacement(&self) -> Vec<&'a PlannedVolume> {
        let (d, planned, key) = (self.d, self.pod, &self.key);
        let uid = planned.uid.clone().unwrap_or_default();
        let reattach: Vec<&PlannedVolume> = planned
            .volumes
            .iter()
            .filter(|v| v.wait.waits_for_reattach())
            .collect();
        let none = BTreeSet::new();
        let before = |v: &PlannedVolume| self.users_before.get(&v.volume.pv).unwrap_or(&none);
        let missing = |v: &&PlannedVolume| !d.view().replaced(&v.volume.claim, &uid, before(v));
        let reattach_bound = d.job.settings.volume_reattach_timeout;
        let mut replacement_wait = REPLACEMENT_WAIT.min(reattach_bound);
        let mut scaled_down = None;
        if let Some(controller) = &planned.controller
            && reattach.iter().any(missing)
        {
            // A StatefulSet says whether it wants the pod back; only
            // another controller's silence is read from a timer.
            match self.stateful_set_wants() {
                Some(true) => replacement_wait = reattach_bound,
                Some(false) => scaled_down = Some(controller.clone()),
                None => {}
            }
        }
        if let Some(controller) = &planned.controller
            && scaled_down.is_none()
            && reattach.iter().any(missing)
        {
            let waiting = format!("{controller} to create the replacement of pod {key}");
            d.progress.update(|p| p.waiting_for = Some(waiting));
            let until = d.clock.bounded(replacement_wait);
            d.waits()
                .pods_until(until, || !reattach.iter().any(missing))
                .await;
        }
        let (expected, orphaned): (Vec<_>, Vec<_>) =
            reattach.into_iter().partition(|v| !missing(v));
        for v in &orphaned {
            let why = match (&planned.controller, &scaled_down) {
                (_, Some(c)) => format!("{c} no longer wants pod {key}: scaled down"),
                (Some(c), None) => format!(
                    "{c} created no pod for it within {}s (scaled down?)",
                    replacement_wait.as_secs()
                ),
                (None, None) => "scaled down?".to_string(),
            };
            d.reports.event(
                EventType::Normal,
                "NoReplacement",
                format!(
                    "no new pod references claim {} ({why}): not waiting for {} PV {} to move",
                    fmt_key(&v.volume.claim),
                    v.kind,
                    v.volume.pv
                ),
                pv_ref(&v.volume.pv),
            );
        }
        expected
    }

    /// Whether the pod's StatefulSet, if that is its controller, wants it
    /// back (see [`wants_ordinal`]), from the cache of StatefulSets (one
    /// not there is gone: nothing recreates the pod); `None` for another
    /// controller (the timer then decides).
    fn stateful_set_wants(&self) -> Option<bool> {
        let (kind, name) = self.pod.controller.as_deref()?.split_once("/")?;
        if kind != "StatefulSet" {
            return None;
        }
        let (ns, pod) = &self.pod.pod;
        let key = kube::runtime::reflector::ObjectRef::new(name).within(ns);
        match self.d.deps.caches.stateful_sets.get(&key) {
            Some(sts) => wants_ordinal(&sts, pod),
            // Gone: nothing recreates the pod.
            None => Some(false),
        }
    }

    /// The scheduler cannot place the replacement `pod` of this pod: says
    /// so at once, with its message, and holds back the other pods of the
    /// same workload until it is placed (other workloads go on). Says
    /// whether the move is held (the pod has a controller).
    fn unplaceable(&self, pod: &str, message: &str) -> bool {
        let d = self.d;
        let holds = match &self.pod.controller {
            Some(c) => format!("no other pod of {c} is evicted until it is placed"),
            None => "it has no controller; nothing else is held back".to_string(),
        };
        let why = format!(
            "replacement {pod} of evicted pod {} cannot be scheduled: {message}; {holds}",
            self.key
        );
        d.reports.event(
            EventType::Warning,
            "ReplacementUnschedulable",
            why.clone(),
            Some(pod_ref_key(&self.pod.pod)),
        );
        d.progress.update(|p| p.block(&self.key, why));
        let Some(c) = &self.pod.controller else {
            return false;
        };
        // The move as recorded (when it began tells a ReadWriteMany peer
        // from the replacement once it is placed).
        let recorded = d.progress.move_of(&self.key);
        let moved = recorded.unwrap_or_else(|| VolumeMove {
            pod: self.key.clone(),
            uid: self.pod.uid.clone(),
            volumes: self
                .pod
                .volumes
                .iter()
                .map(|v| v.volume.pv.clone())
                .collect(),
            controller: self.pod.controller.clone(),
            workload: None,
            since: None,
        });
        d.held.hold(c, moved, self.pod.order);
        true
    }

    /// Waits, within the reattach timeout, for the `expected` volumes to
    /// have moved with the pod that replaces this one (see
    /// [`waits`](super::waits)). True when the move is held instead:
    /// the scheduler cannot place the replacement (see `unplaceable`).
    async fn moved(&mut self, expected: &[&PlannedVolume], left_at: std::time::Instant) -> bool {
        let d = self.d;
        let waiting = format!(
            "{} to move with the pod that replaces {}",
            Self::named(expected),
            self.key
        );
        d.progress.step(|p| p.waiting_for = Some(waiting));
        let until = d.clock.bounded(d.job.settings.volume_reattach_timeout);
        let uid = self.pod.uid.clone().unwrap_or_default();
        let none = BTreeSet::new();
        let volumes: Vec<Awaited> = expected
            .iter()
            .map(|v| Awaited {
                pv: &v.volume.pv,
                claim: &v.volume.claim,
                kind: v.kind,
                users_before: self.users_before.get(&v.volume.pv).unwrap_or(&none),
            })
            .collect();
        match d
            .waits()
            .reattach(&mut self.reg, &volumes, &uid, true, left_at, until)
            .await
        {
            Reattach::Moved(pods) => {
                // The replacements healthy: Ready (for the workload's
                // minimum healthy time), within its healthy deadline or
                // else what is left of the reattach timeout.
                let budget = DrainPermits::new(d).pod_ask(self.pod).budget;
                let until = match budget.healthy_deadline {
                    Some(bound) => d.clock.bounded(bound),
                    None => until,
                };
                d.waits().healthy(&pods, budget.min_healthy, until).await;
                false
            }
            Reattach::TimedOut | Reattach::Exhausted => false,
            Reattach::Unplaceable(pod, message) => self.unplaceable(&fmt_key(&pod), &message),
        }
    }
}
