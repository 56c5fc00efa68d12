//! The controller's caches: one store per kind the controllers read
//! (`Caches`), the secondary indexes over them ([`Index`]; Machines by
//! Node and a Machine's Node in `machines`), the wake plumbing between
//! controllers (`wakes`), what is trimmed from objects before they are
//! cached (`trim`), and pods' inline volumes that attach (`inline`).
//! `crate::wiring::watches` fills them from one watch per kind; the
//! Machine, MachineSet and MachineDeployment controllers, the drain and
//! orphan collection only read them.
//!
//! kube's reflector stores answer "this object by name"; the drain and the
//! reconciler also ask "the pods on this Node", "the VolumeAttachments of
//! this PV", "the Node with this providerID". With 20,000 pods in a cache a
//! scan per question is the cost that grows with the cluster, not with the
//! work, so each question has an [`Index`] fed by the same watch events as
//! its store.
//!
//! An index holds object references only; the objects stay in the store and
//! are read from it on lookup, so an index costs a few strings per object
//! and can never hand out a version older than the store's.

mod index;
pub mod inline;
pub(crate) mod machines;
pub mod trim;
pub(crate) mod wakes;

pub use index::*;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::core::v1::{Namespace, Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode, VolumeAttachment};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::Store;
use tokio::sync::watch;

use crate::api::{DrainRule, Machine, MachineClass, MachineSet, MoveAsk, MovePermit};

/// Every cache the controllers read instead of the API server, with the
/// indexes over them and the signals of their progress. Cheap to clone:
/// every field is a handle onto the same data.
#[derive(Clone)]
pub(crate) struct Caches {
    pub(crate) machines: Store<Machine>,
    pub(crate) classes: Store<MachineClass>,
    pub(crate) sets: Store<MachineSet>,
    pub(crate) nodes: Store<Node>,
    pub(crate) pods: Store<Pod>,
    pub(crate) attachments: Store<VolumeAttachment>,
    pub(crate) pvcs: Store<PersistentVolumeClaim>,
    pub(crate) pvs: Store<PersistentVolume>,
    pub(crate) pdbs: Store<PodDisruptionBudget>,
    /// Which CSI drivers attach (the drain's volume classes), and which
    /// must be registered on a Node before a pod may land there.
    pub(crate) csi_drivers: Store<CSIDriver>,
    /// Each Node's CSI drivers and their attach limits: where a moving
    /// pod's volumes can attach (see [`crate::placement`]).
    pub(crate) csi_nodes: Store<CSINode>,
    /// ReplicaSets' metadata: whose Deployment a pod's ReplicaSet is, for
    /// the workload the move ledger keeps a budget for.
    pub(crate) replica_sets: Store<PartialObjectMeta<ReplicaSet>>,
    /// StatefulSets, trimmed to what a move reads of its workload: the
    /// budget's annotations, `minReadySeconds`, the replicas and ordinals
    /// it wants (see `trim::stateful_set`).
    pub(crate) stateful_sets: Store<StatefulSet>,
    /// Deployments, trimmed to the budget's annotations,
    /// `minReadySeconds` and their available replicas.
    pub(crate) deployments: Store<Deployment>,
    /// The move ledger's permits in use, of every namespace and every
    /// berth process (see [`MovePermit`]).
    pub(crate) move_permits: Store<MovePermit>,
    /// The move ledger's asks parked in line, of every namespace and every
    /// berth process (see [`MoveAsk`]).
    pub(crate) move_asks: Store<MoveAsk>,
    /// The cluster's drain rules, which the drain applies to the pods they
    /// pick (see [`crate::drain::cluster_rules`]).
    pub(crate) drain_rules: Store<DrainRule>,
    /// Namespaces, trimmed to their metadata: the labels a DrainRule's
    /// `namespaceSelector` reads.
    pub(crate) namespaces: Store<Namespace>,
    /// Lookups by Node, claim, PV and providerID.
    pub(crate) indexes: Indexes,
    /// Machines by `status.nodeRef` and by providerID.
    pub(crate) machines_by_node: machines::MachinesByNode,
    /// Machines by the UID of the MachineSet that controls them.
    pub(crate) machines_by_set: Index<Machine>,
    /// Bumped after every pod event, once the pod store has applied it: a
    /// waiter re-reads the store after each bump, so none is missed.
    pub(crate) pod_changes: watch::Receiver<u64>,
    /// Bumped after every PodDisruptionBudget event.
    pub(crate) pdb_changes: watch::Receiver<u64>,
    /// Bumped after every StatefulSet or Deployment event: how many of a
    /// workload's replicas are available changed, which a drain waiting
    /// for its move budget asks again on.
    pub(crate) workload_changes: watch::Receiver<u64>,
    /// Bumped after every VolumeAttachment event, once its store and
    /// indexes applied it.
    pub(crate) attachment_changes: watch::Receiver<u64>,
    /// Bumped after every Node and CSINode event: where a replacement can
    /// run may have changed (a drain waiting for a destination looks
    /// again).
    pub(crate) placement_changes: watch::Receiver<u64>,
    /// Bumped after every MovePermit event: a permit taken or ended, by
    /// this process or another.
    pub(crate) permit_changes: watch::Receiver<u64>,
    /// Bumped after every MoveAsk event: an ask parked, renewed or out of
    /// line, of this process or another.
    pub(crate) ask_changes: watch::Receiver<u64>,
    /// Bumped after a Machine left the store (deleted, its finalizer
    /// removed): what it held across Machines (its moves' permits) is free.
    pub(crate) machines_gone: watch::Receiver<u64>,
    /// Turns true once the first complete list of Machines is in
    /// `machines` (and stays true: a re-list swaps the store whole).
    ///
    /// Not `machines.wait_until_ready()`: kube-runtime's store readiness
    /// (a `DelayedInit` over a oneshot channel) keeps one waker, and the
    /// Machine controller already waits on it for this store, so a second
    /// waiter may never be woken.
    pub(crate) machines_listed: watch::Receiver<bool>,
    /// Turns true once every cache but the Machines' (see
    /// `machines_listed`) has its first complete list.
    pub(crate) synced: watch::Receiver<bool>,
}

impl Caches {
    /// Waits until every cache has synced and the Machines are listed;
    /// false if the watches went away first.
    pub(crate) async fn wait_until_synced(&self) -> bool {
        let (mut synced, mut listed) = (self.synced.clone(), self.machines_listed.clone());
        synced.wait_for(|s| *s).await.is_ok() && listed.wait_for(|l| *l).await.is_ok()
    }
}
