//! What the drain engine reads from the caches, as a read-only view of
//! them for one Node.
//!
//! Every read copies (or shares) the few objects a decision needs out of
//! the informer stores, through the indexes, and hands them to a pure
//! function of the [`plan`](crate::drain::plan) or
//! [`volume`](crate::drain::volume) modules. Nothing here writes, waits or
//! remembers: what one drain has done and judged is in
//! [`NodeDrain`](super::node_drain::NodeDrain).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::{CSIDriver, VolumeAttachment};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;

use crate::api::Machine;
use crate::cache::{Caches, claim_key, claim_names};
use crate::drain::cluster_rules::{RuleBook, namespace_labels};
use crate::drain::select::NamespacedName;
use crate::drain::volume::{
    Moved, inline_unique_name, is_inline, replacement_expected, replacements,
    unschedulable_replacement, users_elsewhere, users_elsewhere_before, volume_moved,
};
use crate::drain::volume_kind::{VolumeContext, VolumeKind};
use crate::volumes::{AttachRefused, attach_exhausted, listed_on, unique_name_of};

/// The cluster's DrainRules that apply to the drain of Machine `machine`
/// (by its labels as cached now), with the namespaces' labels they select
/// by.
pub(crate) fn rule_book(caches: &Caches, machine: &ObjectRef<Machine>) -> RuleBook {
    let rules = caches.drain_rules.state();
    if rules.is_empty() {
        return RuleBook::default();
    }
    let labels = caches
        .machines
        .get(machine)
        .and_then(|m| m.metadata.labels.clone())
        .unwrap_or_default();
    let namespaces = namespace_labels(caches.namespaces.state().iter().map(AsRef::as_ref));
    RuleBook::new(rules.iter().map(AsRef::as_ref), &labels, namespaces)
}

/// The caches as one drain of `node` reads them.
#[derive(Clone, Copy)]
pub(super) struct View<'a> {
    caches: &'a Caches,
    node: &'a str,
}

impl<'a> View<'a> {
    pub(super) fn new(caches: &'a Caches, node: &'a str) -> Self {
        Self { caches, node }
    }

    /// The pods bound to the Node.
    pub(super) fn pods_on_node(&self) -> Vec<Arc<Pod>> {
        self.caches
            .indexes
            .pods_by_node
            .get(&self.caches.pods, self.node)
    }

    /// When the Node was cordoned, by its annotation.
    pub(super) fn cordoned_at(&self) -> Option<Timestamp> {
        self.caches
            .nodes
            .get(&ObjectRef::new(self.node))
            .and_then(|n| crate::api::cordoned_at(&n))
    }

    /// The PV `name`.
    pub(super) fn pv(&self, name: &str) -> Option<Arc<PersistentVolume>> {
        self.caches.pvs.get(&ObjectRef::new(name))
    }

    /// The claim the PV `name` is bound to, by its `claimRef`.
    pub(super) fn claim_of(&self, name: &str) -> Option<NamespacedName> {
        let pv = self.pv(name)?;
        let c = pv.spec.as_ref()?.claim_ref.as_ref()?;
        Some((c.namespace.clone()?, c.name.clone()?))
    }

    /// The pods that use `claim` on other Nodes now (see
    /// [`users_elsewhere`]), or, for a move that began at `since` (resumed
    /// after a restart), those created before it began.
    pub(super) fn users_elsewhere(
        &self,
        claim: &NamespacedName,
        since: Option<Timestamp>,
    ) -> BTreeSet<String> {
        let users = self.claim_users(claim);
        let pods = users.iter().map(|p| &**p);
        match since {
            Some(t) => users_elsewhere_before(claim, pods, self.node, t),
            None => users_elsewhere(claim, pods, self.node),
        }
    }

    /// Whether the volume of `claim` has moved with the pod that replaced
    /// `evicted_uid` (see [`volume_moved`]).
    pub(super) fn volume_moved(
        &self,
        pv: &str,
        claim: &NamespacedName,
        class: VolumeKind,
        evicted_uid: &str,
        users_before: &BTreeSet<String>,
    ) -> Result<Moved, String> {
        let users = self.claim_users(claim);
        let new = replacements(claim, users.iter().map(|p| &**p), evicted_uid, users_before);
        let vas: Vec<VolumeAttachment> = self
            .caches
            .indexes
            .attachments_by_pv
            .get(&self.caches.attachments, pv)
            .iter()
            .map(|va| (**va).clone())
            .collect();
        let unique = if is_inline(pv) {
            inline_unique_name(pv)
        } else {
            self.caches
                .pvs
                .get(&ObjectRef::new(pv))
                .and_then(|p| unique_name_of(&p))
        };
        let listed_on = |node: &str| {
            unique.as_deref().is_some_and(|name| {
                self.caches
                    .nodes
                    .get(&ObjectRef::new(node))
                    .is_some_and(|n| listed_on(&n, name))
            })
        };
        volume_moved(pv, class, self.node, &new, &vas, &listed_on)
    }

    /// A VolumeAttachment of `pv` on another Node whose attacher refused
    /// the attach for lack of a resource (see [`attach_exhausted`]).
    pub(super) fn attach_refused(&self, pv: &str) -> Option<AttachRefused> {
        let vas = self
            .caches
            .indexes
            .attachments_by_pv
            .get(&self.caches.attachments, pv);
        attach_exhausted(pv, self.node, vas.iter().map(|va| &**va))
    }

    pub(super) fn claim_users(&self, claim: &NamespacedName) -> Vec<Arc<Pod>> {
        self.caches
            .indexes
            .pods_by_claim
            .get(&self.caches.pods, &claim_key(&claim.0, &claim.1))
    }

    /// Copies of the VolumeAttachments to this Node.
    pub(super) fn attachments_on_node(&self) -> Vec<VolumeAttachment> {
        self.caches
            .indexes
            .attachments_by_node
            .get(&self.caches.attachments, self.node)
            .into_iter()
            .map(|va| (*va).clone())
            .collect()
    }

    /// Copies of the claims `pods` name and of the volumes bound to them,
    /// plus the volumes named in `more_pvs`: the part of the PVC and PV
    /// caches a plan of these pods reads.
    pub(super) fn volume_objects(
        &self,
        pods: &[Pod],
        more_pvs: &[String],
    ) -> (Vec<PersistentVolumeClaim>, Vec<PersistentVolume>) {
        let mut pvcs: BTreeMap<String, PersistentVolumeClaim> = BTreeMap::new();
        for pod in pods {
            let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
            for claim in claim_names(pod) {
                if let Some(pvc) = self.caches.pvcs.get(&ObjectRef::new(&claim).within(ns)) {
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
            .filter_map(|n| self.caches.pvs.get(&ObjectRef::new(n)))
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
        self.caches
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
    pub(super) fn attachments_of(&self, pvs: &[PersistentVolume]) -> Vec<VolumeAttachment> {
        let ix = &self.caches.indexes;
        let store = &self.caches.attachments;
        let mut vas: BTreeMap<String, VolumeAttachment> = BTreeMap::new();
        let on_node = ix.attachments_by_node.get(store, self.node);
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
        let pod = self
            .caches
            .pods
            .get(&ObjectRef::new(&key.1).within(&key.0))?;
        (uid.is_none() || pod.metadata.uid.as_deref() == uid).then_some(pod)
    }

    /// The replacement of the pod evicted as `evicted_uid`, among the users
    /// of `claim`, if the scheduler cannot place it: its key and the
    /// scheduler's message.
    pub(super) fn unschedulable_replacement(
        &self,
        claim: &NamespacedName,
        evicted_uid: &str,
    ) -> Option<(NamespacedName, String)> {
        let users = self
            .caches
            .indexes
            .pods_by_claim
            .get(&self.caches.pods, &claim_key(&claim.0, &claim.1));
        unschedulable_replacement(claim, users.iter().map(|p| &**p), evicted_uid)
    }

    /// What classifying this Node's volumes needs: its Node object, the
    /// CSIDrivers, and whether the Machine allows losing node-local data.
    pub(super) fn volume_context(&self, data_loss_allowed: bool) -> VolumeContext {
        let node = self.caches.nodes.get(&ObjectRef::new(self.node));
        let drivers: Vec<CSIDriver> = self
            .caches
            .csi_drivers
            .state()
            .iter()
            .map(|d| (**d).clone())
            .collect();
        VolumeContext::new(self.node, node.as_deref(), &drivers)
            .allowing_data_loss(data_loss_allowed)
    }
}

/// The PVs of `vas`.
pub(super) fn pvs_of(vas: &[VolumeAttachment]) -> Vec<String> {
    vas.iter()
        .filter_map(|va| va.spec.source.persistent_volume_name.clone())
        .collect()
}
