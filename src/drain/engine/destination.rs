//! A destination before a stateful eviction: the drain's side of
//! [`crate::placement`]. Before a pod whose volumes must attach again (or
//! are pinned to a zone) is evicted, a Node that can take its replacement
//! is found from the caches; without one the pod stays, named
//! (`DestinationUnavailable`, `status.drain.blockedBy`), and the drain
//! goes on with other workloads until a Node, CSINode or pod event shows
//! one. The Node found goes into the move's permit, which reserves its
//! attach slots until the replacement is placed.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, PersistentVolume, Pod};
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode};
use kube::ResourceExt;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

use super::node_drain::NodeDrain;
use super::reports::pod_ref_key;
use crate::api::set_owner;
use crate::cache::{Caches, claim_key};
use crate::drain::plan::PlannedPod;
use crate::drain::select::fmt_key;
use crate::drain::volume_kind::VolumeKind;
use crate::placement::{Holding, Needs, Rules, Sight, choose, made_from};

/// How long a pod goes without a destination before a
/// `DestinationUnavailable` Warning says so (`status.drain` says it at
/// once).
pub(super) const WARN_AFTER: Duration = Duration::from_secs(10);

/// How long a change of Nodes, CSINodes or pods is let settle before the
/// pods waiting for a destination are judged again: a burst of pod events
/// is judged once.
const SETTLE: Duration = Duration::from_millis(200);

/// The caches, as the placement check sees the cluster, with the moves in
/// flight that hold a destination.
pub(crate) struct CacheSight<'a> {
    caches: &'a Caches,
    moving: Vec<Holding>,
}

impl<'a> CacheSight<'a> {
    pub(crate) fn new(caches: &'a Caches, moving: Vec<Holding>) -> Self {
        Self { caches, moving }
    }

    /// The caches, with the moves in flight their MovePermits (of every
    /// process) say hold a destination.
    pub(crate) fn from_caches(caches: &'a Caches) -> Self {
        let moving = caches
            .move_permits
            .state()
            .iter()
            .filter_map(|p| crate::drain::ledger::held_permit(p))
            .filter_map(|(_, p)| p.holding())
            .collect();
        Self { caches, moving }
    }
}

impl Sight for CacheSight<'_> {
    fn nodes(&self) -> Vec<Arc<Node>> {
        self.caches.nodes.state()
    }

    fn csi_node(&self, node: &str) -> Option<Arc<CSINode>> {
        self.caches.csi_nodes.get(&ObjectRef::new(node))
    }

    fn pods_on(&self, node: &str) -> Vec<Arc<Pod>> {
        self.caches
            .indexes
            .pods_by_node
            .get(&self.caches.pods, node)
    }

    fn pv(&self, name: &str) -> Option<Arc<PersistentVolume>> {
        self.caches.pvs.get(&ObjectRef::new(name))
    }

    fn pv_of_claim(&self, namespace: &str, claim: &str) -> Option<Arc<PersistentVolume>> {
        let pvc = self
            .caches
            .pvcs
            .get(&ObjectRef::new(claim).within(namespace))?;
        let name = pvc.spec.as_ref()?.volume_name.as_deref()?;
        self.pv(name)
    }

    fn driver(&self, name: &str) -> Option<Arc<CSIDriver>> {
        self.caches.csi_drivers.get(&ObjectRef::new(name))
    }

    fn draining(&self, node: &Node) -> bool {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        crate::api::cordoned_at(node).is_some()
            || !self
                .caches
                .machines_by_node
                .deleting_of_node(&self.caches.machines, name)
                .is_empty()
    }

    fn claim_users(&self, namespace: &str, claim: &str) -> Vec<Arc<Pod>> {
        self.caches
            .indexes
            .pods_by_claim
            .get(&self.caches.pods, &claim_key(namespace, claim))
    }

    fn holdings(&self) -> Vec<Holding> {
        self.moving.clone()
    }
}

/// One drain's destination checks.
#[derive(Clone, Copy)]
pub(super) struct Destination<'d> {
    d: &'d NodeDrain,
}

/// What the check found for a pod.
pub(super) enum Found {
    /// No destination is needed (no volume pins it, it has no controller
    /// to replace it, or the deadline passed).
    Unneeded,
    /// Its replacement can run on this Node.
    On(String),
    /// Nowhere, and why.
    Nowhere(String),
}

impl<'d> Destination<'d> {
    pub(super) fn new(d: &'d NodeDrain) -> Self {
        Self { d }
    }

    /// What `p`'s replacement needs, when a destination must be found
    /// before it goes: it has a controller to replace it, the deadline has
    /// not passed, and one of the volumes that move with it attaches or is
    /// pinned by its node affinity.
    fn needs(self, p: &PlannedPod) -> Option<Needs> {
        if p.controller.is_none() || self.d.clock.expired() {
            return None;
        }
        let pvs = p.moving_pvs();
        if pvs.is_empty() {
            return None;
        }
        let pod = self.d.view().pod(&p.pod, p.uid.as_deref())?;
        let pod = self.as_replaced(p, pod);
        let rules = Rules {
            require_csi_node: self.d.job.settings.require_csi_node,
        };
        let sight = self.sight();
        let needs = Needs::of(&sight, &pod, &pvs, rules);
        needs.pinned().then_some(needs)
    }

    /// [`Destination::find`], and the destination found held for `p`'s move
    /// at once, when its move reserves attach slots: looking and holding
    /// are one critical section of the process (see
    /// `Permits::hold_destination`), so
    /// two drains never count on the same free slot. The hold ends with
    /// the permit's answer (`Permits::unhold`).
    pub(super) fn find_and_hold(self, p: &PlannedPod) -> Result<Option<String>, String> {
        if !self.reserves(p) {
            return self.find(p);
        }
        self.d.deps.permits.hold_destination(|| {
            let found = self.find(p);
            let hold = found.as_ref().ok().cloned().flatten().map(|node| Holding {
                pod: fmt_key(&p.pod),
                uid: p.uid.clone().unwrap_or_else(|| fmt_key(&p.pod)),
                node,
                pvs: p
                    .volumes
                    .iter()
                    .filter(|v| v.kind == VolumeKind::Attachable && !v.volume.ephemeral)
                    .map(|v| v.volume.pv.clone())
                    .collect(),
            });
            (found, hold)
        })
    }

    /// Whether `p`'s move may reserve attach slots on its destination (a
    /// volume of its attaches), so that looking for it and asking for
    /// its permit must not interleave with another drain's.
    fn reserves(self, p: &PlannedPod) -> bool {
        p.controller.is_some()
            && !self.d.clock.expired()
            && p.volumes
                .iter()
                .any(|v| v.kind == VolumeKind::Attachable && !v.volume.ephemeral)
    }

    /// `pod` as its replacement will be: made from its StatefulSet's
    /// template now (see [`made_from`]), or as it is.
    fn as_replaced(self, p: &PlannedPod, pod: Arc<Pod>) -> Arc<Pod> {
        let Some(("StatefulSet", name)) = p.controller.as_deref().and_then(|c| c.split_once('/'))
        else {
            return pod;
        };
        let key = ObjectRef::new(name).within(&p.pod.0);
        match self.d.deps.caches.stateful_sets.get(&key) {
            Some(sts) => match sts.spec.template.spec.as_ref() {
                Some(template) => Arc::new(made_from(&pod, template)),
                None => pod,
            },
            None => pod,
        }
    }

    fn sight(self) -> CacheSight<'d> {
        CacheSight::new(&self.d.deps.caches, self.d.deps.permits.holdings())
    }

    /// Looks for `p`'s destination, quietly.
    pub(super) fn look(self, p: &PlannedPod) -> Found {
        let Some(needs) = self.needs(p) else {
            return Found::Unneeded;
        };
        let verdict = choose(&self.sight(), &needs);
        match verdict.node {
            Some(node) => Found::On(node),
            None => Found::Nowhere(verdict.why()),
        }
    }

    /// Looks for `p`'s destination and says what it found: without one,
    /// `status.drain.blockedBy` and a `DestinationUnavailable` Warning
    /// (once per pod and reason) name every Node and why, and the `Err`
    /// is what the pod waits for; with one, a block it named is lifted.
    pub(super) fn find(self, p: &PlannedPod) -> Result<Option<String>, String> {
        let key = fmt_key(&p.pod);
        match self.look(p) {
            Found::Unneeded => Ok(None),
            Found::On(node) => {
                self.d.held.somewhere(&key);
                self.d.progress.update(|s| s.unblock(&key));
                Ok(Some(node))
            }
            Found::Nowhere(nodes) => {
                let why = format!(
                    "no Node can take the replacement of pod {key} (its volumes must attach \
                     there): {nodes}; {}; it is evicted once one can",
                    self.coming()
                );
                // Said at once in the status; warned about once it has
                // lasted (a Node that has just registered is not-ready
                // tainted for a moment).
                let now = Instant::now();
                self.d.held.nowhere_since(&key, now);
                if self.d.held.warn_nowhere(&key, now, WARN_AFTER) {
                    self.d.reports.event(
                        EventType::Warning,
                        "DestinationUnavailable",
                        why.clone(),
                        Some(pod_ref_key(&p.pod)),
                    );
                }
                self.d.progress.update(|s| s.block(&key, why.clone()));
                Err(why)
            }
        }
    }

    /// Whether berth is making a Node that may take it, in words: the
    /// Machines the drained Machine's MachineSet is bringing up (no Node
    /// yet), or that nothing of berth's will make one.
    fn coming(self) -> String {
        let caches = &self.d.deps.caches;
        let set = caches
            .machines
            .get(&self.d.job.machine)
            .and_then(|m| set_owner(&m));
        let Some((set, uid)) = set else {
            return "berth makes no Node for it (the Machine belongs to no MachineSet): \
                    add one, or the deadline's rules apply"
                .into();
        };
        let mut coming: Vec<String> = caches
            .machines_of_set(&uid)
            .iter()
            .filter(|m| {
                m.metadata.deletion_timestamp.is_none()
                    && m.status
                        .as_ref()
                        .and_then(|s| s.node_ref.as_ref())
                        .is_none()
            })
            .map(|m| m.name_any())
            .collect();
        coming.sort();
        let deployment = caches
            .sets
            .get(
                &ObjectRef::new(&set)
                    .within(&self.d.job.machine.namespace.clone().unwrap_or_default()),
            )
            .and_then(|s| crate::api::owner_of(&s));
        if let (true, Some(d)) = (coming.is_empty(), deployment) {
            format!(
                "MachineDeployment {} is making no Machine that could (with maxSurge 0 a \
                 rollout makes the new Machine only once this one's VM is gone)",
                d.name
            )
        } else if coming.is_empty() {
            format!("MachineSet {set} is making no Machine that could")
        } else {
            format!("MachineSet {set} is bringing up {}", coming.join(", "))
        }
    }

    /// Waits until one of `waiting` has a destination (judged again after
    /// each Node, CSINode or pod change, let settle), or a wait is due its
    /// Warning, or for ever.
    pub(super) async fn appears(self, waiting: &[PlannedPod]) {
        if waiting.is_empty() {
            return std::future::pending().await;
        }
        let keys: Vec<String> = waiting.iter().map(|p| fmt_key(&p.pod)).collect();
        let warn = self.d.held.nowhere_warning_due(&keys, WARN_AFTER);
        let caches = &self.d.deps.caches;
        let (mut placement, mut pods) =
            (caches.placement_changes.clone(), caches.pod_changes.clone());
        placement.borrow_and_update();
        pods.borrow_and_update();
        loop {
            tokio::select! {
                r = placement.changed() => if r.is_err() { return std::future::pending().await },
                r = pods.changed() => if r.is_err() { return std::future::pending().await },
                () = tokio::time::sleep_until(warn.unwrap_or_else(Instant::now)), if warn.is_some() => return,
            }
            tokio::time::sleep(SETTLE).await;
            placement.borrow_and_update();
            pods.borrow_and_update();
            if waiting
                .iter()
                .any(|p| !matches!(self.look(p), Found::Nowhere(_)))
            {
                return;
            }
        }
    }
}
