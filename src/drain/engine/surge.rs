//! One pod's surge before its eviction (see [`crate::drain::surge`]): a
//! pod whose PodDisruptionBudget lets none go has its replacement made
//! first by its Deployment, and is removed by its own controller once the
//! replacement is available, instead of an eviction refused until the
//! drain's deadline.
//!
//! A surge is a move of its workload: it holds a permit of the move ledger
//! (one at a time for a workload that sets no budget), and the permit
//! records what berth wrote before it writes it (`spec.surge`), so that a
//! restart goes on with the same surge: a roll is never written twice (its
//! value is the Machine's), a scale-up never made twice (each replica
//! write tests the value it replaces) and put back exactly once (here, or
//! by the keeper for a move no drain watches any more).
//!
//! Every wait is bounded: a replacement that is not available within the
//! workload's healthy deadline (else the reattach timeout, cut at the
//! drain's deadline) ends the surge with a Warning, a scale-up is put
//! back (its ReplicaSet removes the new pod first, not Ready), and the pod
//! is evicted as before.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;

use super::eviction::{Eviction, PodEviction};
use super::node_drain::NodeDrain;
use super::permits::DrainPermits;
use super::reports::pod_ref_key;
use super::waits::Health;
use crate::api::PermitSurge;
use crate::drain::ledger::Workload;
use crate::drain::ledger::workload::replacement_ready_since;
use crate::drain::plan::PlannedPod;
use crate::drain::select::fmt_key;
use crate::drain::surge::{
    DELETION_COST_ANNOTATION, LOWEST_DELETION_COST, Surge, SurgeFacts, decide, forbidding, needed,
    replicas_patch, roll_patch,
};

/// How long after its grace period the old pod is waited for once its
/// replacement is available: its controller removes it at once.
const REMOVAL_SLACK: Duration = Duration::from_secs(30);

/// What became of a surge.
enum Surged {
    /// The old pod is gone, removed by its controller after its
    /// replacement became available.
    Gone,
    /// No surge (impossible, failed, or not needed): evict it as before.
    Evict,
    /// Its workload's permit is not free now: what it waits for (a later
    /// pass asks again).
    Wait(String),
}

/// One pod evicted, or surged first: when its budget lets none go (by
/// the plan, or once the Eviction API refuses it) and its Deployment can
/// run one more pod for a while, its replacement is made first and its
/// controller removes it (see [`Surging`]); else, and when the surge
/// fails, it is evicted as before. `moving`: a stateful pod's move, whose
/// permit the surge uses.
pub(super) async fn evict_or_surge(d: &NodeDrain, p: &PlannedPod, moving: bool) -> Eviction {
    let surging = Surging { d, p, moving };
    let surge = match surging.judge(false).await {
        Some(surge) => surge,
        None => match PodEviction::new(d, p).surging_on_refusal().run().await {
            Eviction::Refused => match surging.judge(true).await {
                Some(surge) => surge,
                None => return PodEviction::new(d, p).run().await,
            },
            other => return other,
        },
    };
    match surging.run(surge).await {
        Surged::Gone => Eviction::Gone,
        Surged::Wait(why) => Eviction::Waits(why),
        Surged::Evict => PodEviction::new(d, p).run().await,
    }
}

/// One pod's surge.
struct Surging<'d> {
    d: &'d NodeDrain,
    p: &'d PlannedPod,
    /// A stateful pod's move: its permit is the move's, asked and ended
    /// by the move.
    moving: bool,
}

impl Surging<'_> {
    fn uid(&self) -> String {
        self.p.uid.clone().unwrap_or_else(|| fmt_key(&self.p.pod))
    }

    /// What a surge of the pod would be now, when one is worth asking
    /// for: its budgets let no disruption go (by the plan, or `refused`: the
    /// Eviction API said so) or one was made before a restart, and no
    /// earlier surge of it failed in this Machine's drains.
    async fn judge(&self, refused: bool) -> Option<Surge> {
        // A surge made before a restart goes on, whatever its budget says
        // now (the new pod may be what lets one go).
        let recorded = DrainPermits::new(self.d).surge_recorded(self.p);
        if !refused && !recorded && !needed(&self.p.pdbs) {
            return None;
        }
        if self
            .d
            .reports
            .reported(&format!("surge/{}/failed", self.uid()))
        {
            return None;
        }
        let pod = self.d.view().pod(&self.p.pod, self.p.uid.as_deref())?;
        if pod.metadata.deletion_timestamp.is_some() {
            return None;
        }
        let deployment = self.deployment_of(&pod);
        let autoscaler = match &deployment {
            Some(d) => self.autoscaler_of(d).await,
            None => None,
        };
        let pods = deployment
            .as_ref()
            .map(|d| self.pods_of(d))
            .unwrap_or_default();
        let pods_on: Vec<Option<&str>> = pods
            .iter()
            .map(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()))
            .collect();
        let draining = self.draining_nodes();
        let forbidding = self.forbidding();
        let machine = self.machine();
        let pod_surged_for = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::drain::surge::SURGED_FOR_ANNOTATION))
            .cloned();
        let controller = crate::drain::plan::controller_of(&pod);
        Some(decide(&SurgeFacts {
            controller: controller.as_deref(),
            deployment: deployment.as_deref(),
            autoscaler: autoscaler.as_deref(),
            pods_on: &pods_on,
            draining: &draining,
            forbidding: &forbidding,
            machine: &machine,
            pod_surged_for: pod_surged_for.as_deref(),
            rule_terms: self.p.rule_terms.as_ref(),
        }))
    }

    /// This drain's Machine, `namespace/name`: a roll's value.
    fn machine(&self) -> String {
        DrainPermits::new(self.d).machine_key()
    }

    /// The pod's Deployment, through its ReplicaSet, from the caches.
    fn deployment_of(&self, pod: &Pod) -> Option<std::sync::Arc<Deployment>> {
        let caches = &self.d.deps.caches;
        let ns = pod.metadata.namespace.as_deref()?;
        let rs =
            crate::drain::ledger::workload::controller(pod.metadata.owner_references.as_deref())
                .filter(|o| o.kind == "ReplicaSet")?;
        let rs = caches
            .replica_sets
            .get(&ObjectRef::new(&rs.name).within(ns))?;
        let owner =
            crate::drain::ledger::workload::controller(rs.metadata.owner_references.as_deref())
                .filter(|o| o.kind == "Deployment")?;
        caches
            .deployments
            .get(&ObjectRef::new(&owner.name).within(ns))
            .filter(|d| d.metadata.uid.as_deref() == Some(owner.uid.as_str()))
    }

    /// Every pod of Deployment `d` that is not being deleted: those of each
    /// of its ReplicaSets.
    fn pods_of(&self, d: &Deployment) -> Vec<std::sync::Arc<Pod>> {
        let caches = &self.d.deps.caches;
        let Some(uid) = d.metadata.uid.as_deref() else {
            return Vec::new();
        };
        let ns = d.metadata.namespace.as_deref();
        caches
            .replica_sets
            .state()
            .iter()
            .filter(|rs| rs.metadata.namespace.as_deref() == ns)
            .filter(|rs| {
                crate::drain::ledger::workload::controller(rs.metadata.owner_references.as_deref())
                    .is_some_and(|o| o.uid == uid)
            })
            .filter_map(|rs| rs.metadata.uid.clone())
            .flat_map(|rs| caches.indexes.pods_by_controller.get(&caches.pods, &rs))
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect()
    }

    /// The Nodes of the Machines being deleted, this one's included.
    fn draining_nodes(&self) -> BTreeSet<String> {
        let caches = &self.d.deps.caches;
        let mut nodes: BTreeSet<String> = caches
            .machines
            .state()
            .iter()
            .filter(|m| m.metadata.deletion_timestamp.is_some())
            .filter_map(|m| caches.node_of(m))
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        nodes.insert(self.d.job.node.clone());
        nodes
    }

    /// Why each of the pod's volumes that forbids a second pod does.
    fn forbidding(&self) -> Vec<String> {
        let caches = &self.d.deps.caches;
        forbidding(self.p, |ns, name| {
            caches
                .pvcs
                .get(&ObjectRef::new(name).within(ns))
                .and_then(|c| c.spec.as_ref()?.access_modes.clone())
                .unwrap_or_default()
        })
    }

    /// The HorizontalPodAutoscaler that scales `d`, if one does, listed
    /// from the API server (a surge is rare; no cache is kept). One that
    /// cannot be listed counts as one: berth never writes the replicas of
    /// a Deployment it cannot tell is not autoscaled.
    async fn autoscaler_of(&self, d: &Deployment) -> Option<String> {
        let ns = d.metadata.namespace.as_deref()?;
        let name = d.metadata.name.as_deref()?;
        let api: Api<HorizontalPodAutoscaler> = Api::namespaced(self.d.clients.rest.clone(), ns);
        match api.list(&ListParams::default()).await {
            Ok(list) => list
                .items
                .iter()
                .find(|h| {
                    let t = &h.spec.scale_target_ref;
                    t.kind == "Deployment" && t.name == name
                })
                .and_then(|h| h.metadata.name.clone()),
            Err(e) => Some(format!(
                "(unknown: cannot list HorizontalPodAutoscalers: {e})"
            )),
        }
    }

    /// Makes `surge` and waits for its outcome (see the module).
    async fn run(&self, surge: Surge) -> Surged {
        let key = fmt_key(&self.p.pod);
        let deployment = match &surge {
            Surge::Impossible { reason } => {
                if self
                    .d
                    .reports
                    .first(format!("surge/{}/impossible", self.uid()))
                {
                    self.count("impossible");
                    self.d.reports.event(
                        EventType::Normal,
                        "SurgeImpossible",
                        format!("pod {key}: its PodDisruptionBudget lets none go, and no new pod can be made first: {reason}; it is evicted when its budget allows"),
                        Some(pod_ref_key(&self.p.pod)),
                    );
                }
                return Surged::Evict;
            }
            Surge::Roll { deployment, .. } | Surge::ScaleUp { deployment, .. } => {
                deployment.clone()
            }
        };
        let workload = match DrainPermits::new(self.d)
            .surge_permit(self.p, self.moving)
            .await
        {
            Ok(w) => w,
            Err(why) => return Surged::Wait(why),
        };
        let ns = self.p.pod.0.clone();
        // The Deployment's pods before this surge is made, as this process
        // sees them: none of them is the new pod, whenever it was created
        // (a pod made in the same second as the surge's permit is not new
        // for that). After a restart the surge may be made already: the
        // new pod is then told by its creation time, as before.
        let known = (self
            .d
            .deps
            .permits
            .surge_of(&workload, &self.uid())
            .is_none())
        .then(|| self.pod_uids(&ns, &deployment));
        let outcome = match self.make(&surge, &workload, &deployment).await {
            Ok(record) => {
                self.complete(&workload, &ns, &deployment, record, known.as_ref())
                    .await
            }
            Err(why) => {
                self.failed(&deployment, &why);
                Surged::Evict
            }
        };
        if !self.moving {
            DrainPermits::new(self.d).end_surge(&workload, &self.uid());
        }
        outcome
    }

    /// Records `surge` on its permit, then writes it to the Deployment
    /// (unless a restart finds it written): what was recorded, or why no
    /// surge was made.
    async fn make(
        &self,
        surge: &Surge,
        workload: &Workload,
        deployment: &str,
    ) -> Result<PermitSurge, String> {
        let key = fmt_key(&self.p.pod);
        let uid = self.uid();
        let permits = &self.d.deps.permits;
        let api: Api<Deployment> = Api::namespaced(self.d.clients.rest.clone(), &self.p.pod.0);
        if let Some(recorded) = permits.surge_of(workload, &uid) {
            // A restart: the surge is written (or about to be); it is not
            // made again.
            if recorded.method == "ScaleUp"
                && let (Some(from), Some(to)) = (recorded.from, recorded.to)
            {
                self.scale(&api, deployment, from, to).await?;
            }
            return Ok(recorded);
        }
        let record = match surge {
            Surge::Roll {
                value, under_way, ..
            } => PermitSurge {
                method: "Roll".into(),
                deployment: deployment.to_string(),
                from: None,
                to: None,
                revision: (!under_way).then(|| value.clone()),
                restored: None,
            },
            Surge::ScaleUp { from, to, .. } => PermitSurge {
                method: "ScaleUp".into(),
                deployment: deployment.to_string(),
                from: Some(*from),
                to: Some(*to),
                revision: None,
                restored: None,
            },
            Surge::Impossible { reason } => return Err(reason.clone()),
        };
        permits
            .record_surge(workload, &uid, &record)
            .await
            .map_err(|e| format!("the surge cannot be recorded on its permit: {e}"))?;
        match surge {
            Surge::Roll {
                value,
                under_way: false,
                why,
                ..
            } => {
                api.patch(deployment, &PatchParams::default(), &Patch::Merge(roll_patch(value)))
                    .await
                    .map_err(|e| format!("Deployment {deployment} cannot be rolled: {e}"))?;
                self.count("rolled");
                self.started(format!(
                    "pod {key}: its PodDisruptionBudget lets none go; Deployment {}/{deployment} rolled (one new revision) because {why}: its new pod comes up before this one goes",
                    self.p.pod.0
                ));
            }
            Surge::Roll { .. } => self.started(format!(
                "pod {key}: its PodDisruptionBudget lets none go; Deployment {}/{deployment} is rolling out: its new pod comes up before this one goes",
                self.p.pod.0
            )),
            Surge::ScaleUp { from, to, .. } => {
                self.mark_cheapest().await?;
                self.scale(&api, deployment, *from, *to).await?;
                self.count("scaled");
                self.started(format!(
                    "pod {key}: its PodDisruptionBudget lets none go; Deployment {}/{deployment} scaled from {from} to {to} replicas until a new pod is available, then back to {from}, removing this pod",
                    self.p.pod.0
                ));
            }
            Surge::Impossible { .. } => {}
        }
        Ok(record)
    }

    /// Deployment `deployment`'s replicas from `from` to `to`, unless they
    /// are `to` already (a restart); refused when they are neither
    /// (someone else scaled it: their count stands).
    async fn scale(
        &self,
        api: &Api<Deployment>,
        deployment: &str,
        from: i32,
        to: i32,
    ) -> Result<(), String> {
        match api
            .patch(
                deployment,
                &PatchParams::default(),
                &Patch::Json::<()>(
                    serde_json::from_value(replicas_patch(from, to)).map_err(|e| e.to_string())?,
                ),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 422 => {
                let now = api
                    .get(deployment)
                    .await
                    .map_err(|e| e.to_string())?
                    .spec
                    .replicas;
                if now == Some(to) {
                    Ok(())
                } else {
                    Err(format!(
                        "Deployment {deployment} has {} replicas, not {from}: someone else scaled it",
                        now.map_or_else(|| "no".to_string(), |n| n.to_string())
                    ))
                }
            }
            Err(e) => Err(format!("Deployment {deployment} cannot be scaled: {e}")),
        }
    }

    /// The old pod marked the cheapest of its ReplicaSet to delete, pinned
    /// to its UID: the scale-back removes it, not another.
    async fn mark_cheapest(&self) -> Result<(), String> {
        let (ns, name) = &self.p.pod;
        let api: Api<Pod> = Api::namespaced(self.d.clients.rest.clone(), ns);
        let mut patch = serde_json::json!({"metadata": {"annotations": {
            DELETION_COST_ANNOTATION: LOWEST_DELETION_COST
        }}});
        if let Some(uid) = &self.p.uid {
            patch["metadata"]["uid"] = serde_json::json!(uid);
        }
        api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map(|_| ())
            .map_err(|e| format!("pod {ns}/{name} cannot be marked for removal: {e}"))
    }

    /// One surge's `outcome` in `berth_surges_total`.
    fn count(&self, outcome: &str) {
        self.d
            .deps
            .metrics
            .surges
            .with_label_values(&[outcome])
            .inc();
    }

    /// A surge started (or went on after a restart), said once per pod.
    fn started(&self, note: String) {
        if self
            .d
            .reports
            .first(format!("surge/{}/started", self.uid()))
        {
            self.d.reports.event(
                EventType::Normal,
                "Surging",
                note,
                Some(pod_ref_key(&self.p.pod)),
            );
        }
    }

    /// The surge of `deployment` failed (`why`): a Warning, and no other
    /// surge of this pod in this Machine's drains.
    fn failed(&self, deployment: &str, why: &str) {
        let key = fmt_key(&self.p.pod);
        self.d.reports.first(format!("surge/{}/failed", self.uid()));
        self.count("failed");
        self.d.reports.event(
            EventType::Warning,
            "SurgeFailed",
            format!(
                "pod {key}: no surge of Deployment {}/{deployment}: {why}; it is evicted when its PodDisruptionBudget allows",
                self.p.pod.0
            ),
            Some(pod_ref_key(&self.p.pod)),
        );
    }

    /// The surge made (`record`): the new pod available, the scale-up put
    /// back, the old pod gone; or, when no new pod is available in time, a
    /// Warning, the scale-up put back, and the eviction as before.
    async fn complete(
        &self,
        workload: &Workload,
        ns: &str,
        deployment: &str,
        record: PermitSurge,
        known: Option<&BTreeSet<String>>,
    ) -> Surged {
        let uid = self.uid();
        let available = self.await_available(workload, ns, deployment, known).await;
        if record.method == "ScaleUp"
            && record.restored.is_none()
            && !self.restore(workload, &record).await
        {
            self.d.deps.permits.linger(&uid);
        }
        if !available {
            return Surged::Evict;
        }
        let until = self
            .d
            .clock
            .bounded(self.p.grace.saturating_add(REMOVAL_SLACK));
        self.d.progress.update(|pr| {
            pr.waiting_for = Some(format!(
                "pod {} to be removed by Deployment {ns}/{deployment}, its new pod available",
                fmt_key(&self.p.pod)
            ));
        });
        if self
            .d
            .waits()
            .gone(&self.p.pod, Some(uid.as_str()), until)
            .await
        {
            self.count("replaced");
            self.d.count_evicted(&self.p.pod);
            return Surged::Gone;
        }
        // Its controller did not remove it (a roll paused, a count changed
        // meanwhile): the budget now counts the new pod; evict it.
        Surged::Evict
    }

    /// The UIDs of Deployment `ns/deployment`'s pods now, by the cache.
    fn pod_uids(&self, ns: &str, deployment: &str) -> BTreeSet<String> {
        let caches = &self.d.deps.caches;
        caches
            .deployments
            .get(&ObjectRef::new(deployment).within(ns))
            .map(|d| self.pods_of(&d))
            .unwrap_or_default()
            .iter()
            .filter_map(|p| p.metadata.uid.clone())
            .collect()
    }

    /// Waits until a new pod of the Deployment (not one of the `known`
    /// pods it had before the surge, where they are known; else made since
    /// the surge's permit; not on this Node) has been Ready for its `minReadySeconds`
    /// (or the workload's minimum healthy time, if longer): true; false at
    /// the bound (its healthy deadline, else the reattach timeout, cut at
    /// the drain's deadline), then said.
    async fn await_available(
        &self,
        workload: &Workload,
        ns: &str,
        deployment: &str,
        known: Option<&BTreeSet<String>>,
    ) -> bool {
        let caches = &self.d.deps.caches;
        let uid = self.uid();
        let asked = DrainPermits::new(self.d).pod_ask(self.p);
        let min = asked.budget.min_healthy.max(asked.terms.min_ready);
        let bound = asked
            .budget
            .healthy_deadline
            .unwrap_or(self.d.job.settings.volume_reattach_timeout);
        let since = self
            .d
            .deps
            .permits
            .held_for(workload, &uid)
            .map_or_else(Timestamp::now, |p| p.since);
        let d = caches
            .deployments
            .get(&ObjectRef::new(deployment).within(ns));
        let ready = || {
            let pods = d.as_deref().map(|d| self.pods_of(d)).unwrap_or_default();
            let new = |p: &&Pod| {
                known.is_none_or(|k| p.metadata.uid.as_ref().is_none_or(|u| !k.contains(u)))
            };
            vec![replacement_ready_since(
                pods.iter().map(AsRef::as_ref).filter(new),
                &uid,
                Some(&self.d.job.node),
                since,
            )]
        };
        let waiting = || {
            self.d.progress.update(|pr| {
                pr.waiting_for = Some(format!(
                    "a new pod of Deployment {ns}/{deployment} to be available (Ready for {}) before pod {} goes",
                    humantime::format_duration(min),
                    fmt_key(&self.p.pod)
                ));
            });
        };
        let until = self.d.clock.bounded(bound);
        match self
            .d
            .waits()
            .wait_healthy(min, until, ready, waiting)
            .await
        {
            Health::TimedOut => {
                self.failed(
                    deployment,
                    &format!(
                        "no new pod was available within {}",
                        humantime::format_duration(bound)
                    ),
                );
                false
            }
            _ => true,
        }
    }

    /// A scale-up put back (see [`restore`]), tried a few times, and
    /// recorded on its permit: true. False when it could not be written:
    /// the permit is then left to the keeper, which puts it back once the
    /// API server takes it.
    async fn restore(&self, workload: &Workload, record: &PermitSurge) -> bool {
        let api: Api<Deployment> = Api::namespaced(self.d.clients.rest.clone(), &self.p.pod.0);
        let warn = |reason: &str, note: String| {
            self.d.reports.event(
                EventType::Warning,
                reason,
                note,
                Some(pod_ref_key(&self.p.pod)),
            );
        };
        let mut tries = 0;
        loop {
            match restore(&api, record).await {
                Restored::Back => break,
                Restored::Stands(note) => {
                    warn("SurgeNotRestored", note);
                    break;
                }
                Restored::Failed(e) if tries >= RESTORE_TRIES => {
                    warn(
                        "SurgeNotRestored",
                        format!("{e}; berth puts it back once the API server takes the write"),
                    );
                    return false;
                }
                Restored::Failed(_) => {
                    tries += 1;
                    tokio::time::sleep(RESTORE_PAUSE * tries).await;
                }
            }
        }
        let done = PermitSurge {
            restored: Some(Time(Timestamp::now())),
            ..record.clone()
        };
        if let Err(e) = self
            .d
            .deps
            .permits
            .record_surge(workload, &self.uid(), &done)
            .await
        {
            tracing::warn!(error = %e, "the put-back of a surge cannot be recorded on its permit; the replica count's test keeps it from being put back twice");
        }
        true
    }
}

/// How many times a drain tries again to put a scale-up back before it
/// leaves it to the keeper, and the pause before the first try again
/// (longer each time).
const RESTORE_TRIES: u32 = 3;
const RESTORE_PAUSE: Duration = Duration::from_secs(2);

/// What became of putting a scale-up back.
pub(super) enum Restored {
    /// Its replicas are back (or were already, or its Deployment is gone).
    Back,
    /// Someone else changed them since: their count stands (in words).
    Stands(String),
    /// The write failed; to be tried again.
    Failed(String),
}

/// Puts a scale-up's replicas back, from its `to` to its `from`, unless
/// someone else changed them since (its test fails then, and their count
/// stands); a replica count already back counts as done. The one way
/// back, for a drain and for the keeper.
pub(super) async fn restore(api: &Api<Deployment>, record: &PermitSurge) -> Restored {
    let (Some(from), Some(to)) = (record.from, record.to) else {
        return Restored::Back;
    };
    let deployment = &record.deployment;
    let patch = match serde_json::from_value(replicas_patch(to, from)) {
        Ok(p) => p,
        Err(e) => return Restored::Failed(e.to_string()),
    };
    match api
        .patch(
            deployment,
            &PatchParams::default(),
            &Patch::Json::<()>(patch),
        )
        .await
    {
        Ok(_) => Restored::Back,
        Err(kube::Error::Api(s)) if s.code == 404 => Restored::Back,
        Err(kube::Error::Api(s)) if s.code == 422 => {
            match api.get(deployment).await.map(|d| d.spec.replicas) {
                Ok(Some(n)) if n == from => Restored::Back,
                Ok(now) => Restored::Stands(format!(
                    "Deployment {deployment} has {} replicas, not the {to} of berth's surge: someone else scaled it, and their count stands (berth would have put it back to {from})",
                    now.map_or_else(|| "no".to_string(), |n| n.to_string())
                )),
                Err(kube::Error::Api(s)) if s.code == 404 => Restored::Back,
                Err(e) => Restored::Failed(e.to_string()),
            }
        }
        Err(e) => Restored::Failed(format!(
            "Deployment {deployment} cannot be put back from {to} to {from} replicas: {e}"
        )),
    }
}
