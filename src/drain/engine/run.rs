//! One drain's state, what it reads from the caches, and its waits on pods.
//!
//! Every read copies the few objects a decision needs out of the informer
//! stores (through the indexes) and hands them to a pure function of the
//! [`plan`](crate::drain::plan); nothing here decides an order.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::{CSIDriver, VolumeAttachment};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use tokio::sync::watch;
use tokio::time::Instant;

use super::batch::pv_ref;
use super::{Deps, Job, Progress};
use crate::cache::{claim_key, claim_names};
use crate::drain::class::{VolumeClass, VolumeContext};
use crate::drain::plan::{DetachingVolume, DrainPlan, detaching_volumes, plan, still_to_wait_for};
use crate::drain::select::{NamespacedName, fmt_key};
use crate::drain::volume::{
    Moved, replacement_expected, replacements, users_elsewhere, volume_moved,
};
use crate::volumes::WaitError;

/// One drain, from its first pass to its outcome.
pub(super) struct Run {
    pub(super) deps: Arc<Deps>,
    pub(super) job: Job,
    pub(super) progress: watch::Sender<Progress>,
    /// Pods this run has evicted or deleted, to count progress once each.
    evicted: Mutex<BTreeSet<String>>,
    /// Volumes whose detach wait timed out: warned about once, not waited
    /// for again (the reconciler's own volume step still guards the VM).
    abandoned: Mutex<BTreeSet<String>>,
    /// Whether the Machine allows losing node-local data (its annotation),
    /// as the reconciler last saw it.
    pub(super) data_loss_allowed: watch::Receiver<bool>,
}

impl Run {
    pub(super) fn new(
        deps: Arc<Deps>,
        job: Job,
        progress: watch::Sender<Progress>,
        data_loss_allowed: watch::Receiver<bool>,
    ) -> Self {
        Self {
            deps,
            job,
            progress,
            evicted: Mutex::new(BTreeSet::new()),
            abandoned: Mutex::new(BTreeSet::new()),
            data_loss_allowed,
        }
    }

    fn now_instant_of(&self, deadline_left: Duration) -> Instant {
        Instant::now() + deadline_left
    }

    /// The deadline as a monotonic instant.
    pub(super) fn deadline(&self) -> Instant {
        self.now_instant_of(self.job.deadline.remaining(Timestamp::now()))
    }

    /// A step's own bound, cut to the deadline.
    pub(super) fn bounded(&self, step: Duration) -> Instant {
        self.now_instant_of(self.job.deadline.bound(Timestamp::now(), step))
    }

    pub(super) fn expired(&self) -> bool {
        self.job.deadline.expired(Timestamp::now())
    }

    /// The plan of this Node from the caches as they are now.
    pub(super) fn plan(&self) -> DrainPlan {
        let pods = self.pods_on_node();
        let attached = pvs_of(&self.attachments_on_node());
        let (pvcs, pvs) = self.volume_objects(&pods, &attached);
        let pdbs = self.pdbs_for(&pods);
        let vas = self.attachments_of(&pvs);
        plan(
            &self.job.node,
            &pods,
            &pvcs,
            &pvs,
            &pdbs,
            &vas,
            &self.volume_context(),
            &self.job.settings,
        )
    }

    /// What classifying this Node's volumes needs: its Node object, the
    /// CSIDrivers, and the Machine's permission to lose node-local data.
    fn volume_context(&self) -> VolumeContext {
        let node = self.deps.nodes.get(&ObjectRef::new(&self.job.node));
        let drivers: Vec<CSIDriver> = self
            .deps
            .csi_drivers
            .state()
            .iter()
            .map(|d| (**d).clone())
            .collect();
        VolumeContext::new(&self.job.node, node.as_deref(), &drivers)
            .allowing_data_loss(*self.data_loss_allowed.borrow())
    }

    /// The pods that use `claim` on other Nodes now (see
    /// [`users_elsewhere`]).
    pub(super) fn users_elsewhere(&self, claim: &NamespacedName) -> BTreeSet<String> {
        let users = self.claim_users(claim);
        users_elsewhere(claim, users.iter().map(|p| &**p), &self.job.node)
    }

    /// Whether the volume of `claim` has moved with the pod that replaced
    /// `evicted_uid` (see [`volume_moved`]).
    pub(super) fn volume_moved(
        &self,
        pv: &str,
        claim: &NamespacedName,
        class: VolumeClass,
        evicted_uid: &str,
        users_before: &BTreeSet<String>,
    ) -> Result<Moved, String> {
        let users = self.claim_users(claim);
        let new = replacements(claim, users.iter().map(|p| &**p), evicted_uid, users_before);
        let vas: Vec<VolumeAttachment> = self
            .deps
            .indexes
            .attachments_by_pv
            .get(&self.deps.attachments, pv)
            .iter()
            .map(|va| (**va).clone())
            .collect();
        volume_moved(pv, class, &self.job.node, &new, &vas)
    }

    fn claim_users(&self, claim: &NamespacedName) -> Vec<Arc<Pod>> {
        self.deps
            .indexes
            .pods_by_claim
            .get(&self.deps.pods, &claim_key(&claim.0, &claim.1))
    }

    /// The plan's volumes still detaching (see
    /// [`detaching_volumes`]), from the caches as they are now, less those
    /// already given up on.
    pub(super) fn detaching(&self) -> Vec<DetachingVolume> {
        let pods = self.pods_on_node();
        let vas = self.attachments_on_node();
        let (pvcs, pvs) = self.volume_objects(&pods, &pvs_of(&vas));
        let detaching = detaching_volumes(&self.job.node, &pods, &pvcs, &pvs, &vas);
        self.not_abandoned(&detaching)
    }

    /// `detaching` less the volumes whose detach wait already timed out.
    pub(super) fn not_abandoned(&self, detaching: &[DetachingVolume]) -> Vec<DetachingVolume> {
        let abandoned = self.abandoned.lock().map(|a| a.clone()).unwrap_or_default();
        still_to_wait_for(detaching, &abandoned)
    }

    /// Copies of the pods bound to this Node.
    fn pods_on_node(&self) -> Vec<Pod> {
        self.deps
            .indexes
            .pods_by_node
            .get(&self.deps.pods, &self.job.node)
            .into_iter()
            .map(|p| (*p).clone())
            .collect()
    }

    /// Copies of the VolumeAttachments to this Node.
    fn attachments_on_node(&self) -> Vec<VolumeAttachment> {
        self.deps
            .indexes
            .attachments_by_node
            .get(&self.deps.attachments, &self.job.node)
            .into_iter()
            .map(|va| (*va).clone())
            .collect()
    }

    /// Copies of the claims `pods` name and of the volumes bound to them,
    /// plus the volumes named in `more_pvs`: the part of the PVC and PV
    /// caches a plan of these pods reads.
    fn volume_objects(
        &self,
        pods: &[Pod],
        more_pvs: &[String],
    ) -> (Vec<PersistentVolumeClaim>, Vec<PersistentVolume>) {
        let mut pvcs: BTreeMap<String, PersistentVolumeClaim> = BTreeMap::new();
        for pod in pods {
            let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
            for claim in claim_names(pod) {
                if let Some(pvc) = self.deps.pvcs.get(&ObjectRef::new(&claim).within(ns)) {
                    pvcs.insert(claim_key(ns, &claim), (*pvc).clone());
                }
            }
        }
        let names: BTreeSet<&str> = pvcs
            .values()
            .filter_map(|c| c.spec.as_ref()?.volume_name.as_deref())
            .chain(more_pvs.iter().map(String::as_str))
            .collect();
        let pvs = names
            .into_iter()
            .filter_map(|n| self.deps.pvs.get(&ObjectRef::new(n)))
            .map(|pv| (*pv).clone())
            .collect();
        (pvcs.into_values().collect(), pvs)
    }

    /// Copies of the PodDisruptionBudgets in the namespaces of `pods`.
    pub(super) fn pdbs_for(&self, pods: &[Pod]) -> Vec<PodDisruptionBudget> {
        let namespaces: BTreeSet<&str> = pods
            .iter()
            .filter_map(|p| p.metadata.namespace.as_deref())
            .collect();
        self.deps
            .pdbs
            .state_filter(|pdb| {
                pdb.metadata
                    .namespace
                    .as_deref()
                    .is_some_and(|ns| namespaces.contains(ns))
            })
            .iter()
            .map(|pdb| (**pdb).clone())
            .collect()
    }

    /// Copies of the VolumeAttachments to this Node and of those of `pvs`
    /// anywhere.
    fn attachments_of(&self, pvs: &[PersistentVolume]) -> Vec<VolumeAttachment> {
        let ix = &self.deps.indexes;
        let store = &self.deps.attachments;
        let mut vas: BTreeMap<String, VolumeAttachment> = BTreeMap::new();
        let on_node = ix.attachments_by_node.get(store, &self.job.node);
        let of_pvs = pvs
            .iter()
            .filter_map(|pv| pv.metadata.name.as_deref())
            .flat_map(|n| ix.attachments_by_pv.get(store, n));
        for va in on_node.into_iter().chain(of_pvs) {
            vas.entry(va.metadata.name.clone().unwrap_or_default())
                .or_insert_with(|| (*va).clone());
        }
        vas.into_values().collect()
    }

    /// Whether a pod other than `evicted_uid` still needs `claim` (see
    /// [`replacement_expected`]), read from the claim index.
    pub(super) fn replacement_expected(&self, claim: &NamespacedName, evicted_uid: &str) -> bool {
        let users = self.claim_users(claim);
        replacement_expected(claim, users.iter().map(|p| &**p), evicted_uid)
    }

    /// Whether a pod other than `evicted_uid` and `users_before` uses
    /// `claim` (see [`replacements`]).
    pub(super) fn replaced(
        &self,
        claim: &NamespacedName,
        evicted_uid: &str,
        users_before: &BTreeSet<String>,
    ) -> bool {
        let users = self.claim_users(claim);
        !replacements(claim, users.iter().map(|p| &**p), evicted_uid, users_before).is_empty()
    }

    /// The pod `key` from the cache, if it is still the one with `uid`.
    pub(super) fn pod(&self, key: &NamespacedName, uid: Option<&str>) -> Option<Arc<Pod>> {
        let pod = self.deps.pods.get(&ObjectRef::new(&key.1).within(&key.0))?;
        (uid.is_none() || pod.metadata.uid.as_deref() == uid).then_some(pod)
    }

    pub(super) fn update(&self, f: impl FnOnce(&mut Progress)) {
        self.progress.send_if_modified(|p| {
            let before = p.clone();
            f(p);
            *p != before
        });
    }

    /// A step of a volume migration completed: the change is written at
    /// once (see [`Progress::steps_done`]).
    pub(super) fn step(&self, f: impl FnOnce(&mut Progress)) {
        self.progress.send_modify(|p| {
            f(p);
            p.steps_done += 1;
        });
    }

    /// Counts a pod evicted or deleted, once per pod.
    pub(super) fn count_evicted(&self, key: &NamespacedName) {
        let first = self
            .evicted
            .lock()
            .map(|mut e| e.insert(fmt_key(key)))
            .unwrap_or(false);
        if first {
            self.update(|p| {
                p.pods_evicted += 1;
                p.pods_remaining = p.pods_remaining.saturating_sub(1);
            });
        }
    }

    /// Publishes an Event about the Machine. `related` (the pod or volume
    /// concerned) also keeps Events about different objects apart: the
    /// recorder folds Events with the same reason and related object into
    /// one series.
    pub(super) fn event(
        &self,
        type_: EventType,
        reason: &str,
        note: String,
        related: Option<ObjectReference>,
    ) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "Drain".into(),
            secondary: related,
        };
        self.deps.events.publish(ev, self.job.machine_ref.clone());
    }

    /// Gives up waiting for these volumes to detach in this drain.
    pub(super) fn abandon(&self, pvs: impl IntoIterator<Item = String>) {
        if let Ok(mut a) = self.abandoned.lock() {
            a.extend(pvs);
        }
    }

    /// A volume wait that ended without success. The Event's related
    /// object is the first volume waited for: kube's `Recorder` folds Events
    /// with the same reason and objects into one series whatever their
    /// notes, so two volumes' timeouts with none would show as one.
    pub(super) fn warn_volume(&self, reason: &str, e: &WaitError, pv: Option<&str>) {
        tracing::warn!(reason, error = %e, "volume wait ended without success");
        self.event(EventType::Warning, reason, e.to_string(), pv.map(pv_ref));
    }

    /// Waits until the pod (this UID) is gone from the cache, woken by pod
    /// events; false if `until` passed first.
    pub(super) async fn wait_gone(
        &self,
        key: &NamespacedName,
        uid: Option<&str>,
        until: Instant,
    ) -> bool {
        self.wait_pods_until(until, || self.pod(key, uid).is_none())
            .await
    }

    /// Waits until `done` holds over the pod cache, checked after every pod
    /// event, or `until`. Returns whether it held.
    pub(super) async fn wait_pods_until(&self, until: Instant, done: impl Fn() -> bool) -> bool {
        let mut changes = self.deps.pod_changes.clone();
        loop {
            changes.borrow_and_update();
            if done() {
                return true;
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return false },
                _ = tokio::time::sleep_until(until) => return done(),
            }
        }
    }
}

/// The PVs these VolumeAttachments attach.
fn pvs_of(vas: &[VolumeAttachment]) -> Vec<String> {
    vas.iter()
        .filter_map(|va| va.spec.source.persistent_volume_name.clone())
        .collect()
}
