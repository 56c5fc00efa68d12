//! One drain (`NodeDrain`): the parts it owns, and what it reads of its
//! Node. It decides nothing and takes no step itself; the steps (in the
//! modules above it: a pass, a pod's eviction, a stateful move, its
//! records, its permits, the waits) borrow it and use the parts they need.
//!
//! | field | what it keeps (no I/O, unit-tested in its module) |
//! | --- | --- |
//! | `clock` | the deadline as instants: a step's bound, a volume wait's bound, when a pod is forced, expired, the last try |
//! | `progress` | the drain's side of `status.drain`: changes go to its writer, what was written comes back |
//! | `reports` | Events about the Machine, what was reported once (across runs), eviction batches |
//! | `tally` | what this run evicted, forced, or found on the Node first |
//! | `held` | workloads held for an unplaceable replacement, volumes given up on |
//! | `groups` | the order groups this run entered |
//!
//! What the drain reads of the cluster comes through the read-only
//! [`View`]; the orders come from the pure [`plan`](crate::drain::plan).

use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::{mpsc, watch};

use super::clock::Clock;
use super::groups::Groups;
use super::held::HeldMoves;
use super::progress::ProgressTx;
use super::reports::{Memory, Reports, pod_ref_key};
use super::tally::Tally;
use super::view::{View, pvs_of};
use super::waits::Waits;
use super::{Deps, DrainClients, Job};
use crate::api::Machine;
use crate::drain::plan::{
    DetachingVolume, DrainPlan, controller_of, detaching_volumes, plan, still_to_wait_for,
};
use crate::drain::select::{Arrivals, NamespacedName, came_back, fmt_key, pod_key};
use crate::drain::volume_kind::VolumeContext;

/// One drain, from its first pass to its outcome.
pub(super) struct NodeDrain {
    pub(super) deps: Arc<Deps>,
    /// This drain's own clients (see [`Deps::drain_client`]): `moves`, its
    /// urgent line, for the steps of its stateful moves.
    pub(super) clients: DrainClients,
    pub(super) job: Job,
    pub(super) clock: Clock,
    pub(super) progress: ProgressTx,
    pub(super) reports: Reports,
    pub(super) tally: Tally,
    pub(super) held: HeldMoves,
    pub(super) groups: Groups,
    /// The volume moves this drain has left: its stateful pods at its
    /// pass's start, less the moves begun since. Its asks carry it (see
    /// [`Ask::moves_left`](crate::drain::ledger::Ask::moves_left)).
    pub(super) moves_left: AtomicU32,
    /// Whether the Machine allows losing node-local data (its annotation),
    /// as the reconciler last saw it.
    pub(super) data_loss_allowed: watch::Receiver<bool>,
    /// Asks for a reconcile of the Machine: for news its reconciler would
    /// otherwise learn only from the Machine's own changes.
    pub(super) wake: mpsc::UnboundedSender<ObjectRef<Machine>>,
}

impl NodeDrain {
    pub(super) fn new(
        deps: Arc<Deps>,
        job: Job,
        progress: ProgressTx,
        data_loss_allowed: watch::Receiver<bool>,
        memory: Arc<Mutex<Memory>>,
        wake: mpsc::UnboundedSender<ObjectRef<Machine>>,
    ) -> Self {
        // The moves a previous run recorded stay recorded until resumed.
        progress.send_modify(|p| {
            p.moves = job
                .moves
                .iter()
                .map(|m| (m.pod.clone(), m.clone()))
                .collect();
        });
        Self {
            clients: (deps.drain_client)(),
            reports: Reports::new(deps.events.clone(), job.machine_ref.clone(), memory),
            clock: Clock::new(job.deadline, job.settings.force_after_deadline),
            deps,
            job,
            progress,
            tally: Tally::default(),
            held: HeldMoves::default(),
            groups: Groups::default(),
            moves_left: AtomicU32::new(0),
            data_loss_allowed,
            wake,
        }
    }

    /// The caches, read for this drain's Node.
    pub(super) fn view(&self) -> View<'_> {
        View::new(&self.deps.caches, &self.job.node)
    }

    /// The waits on pods and volumes, for this drain's Node.
    pub(super) fn waits(&self) -> Waits<'_> {
        Waits {
            caches: &self.deps.caches,
            node: &self.job.node,
            progress: &self.progress,
            reports: &self.reports,
            metrics: &self.deps.metrics,
        }
    }

    /// What classifying this Node's volumes needs (see
    /// [`View::volume_context`]), with the Machine's permission to lose
    /// node-local data as the reconciler last saw it.
    pub(super) fn volume_context(&self) -> VolumeContext {
        self.view().volume_context(*self.data_loss_allowed.borrow())
    }

    /// The plan of this Node from the caches as they are now.
    pub(super) fn plan(&self) -> DrainPlan {
        let pods = self.pods_on_node();
        let attached = pvs_of(&self.view().attachments_on_node());
        let (pvcs, pvs) = self.view().volume_objects(&pods, &attached);
        let pdbs = self.view().pdbs_for(&pods);
        let vas = self.view().attachments_of(&pvs);
        plan(
            &self.job.node,
            &pods,
            &pvcs,
            &pvs,
            &pdbs,
            &vas,
            &self.volume_context(),
            &self.job.settings,
            &super::view::rule_book(&self.deps.caches, &self.job.machine),
        )
    }

    /// The plan's volumes still detaching (see
    /// [`detaching_volumes`]), from the caches as they are now, less those
    /// already given up on.
    pub(super) fn detaching(&self) -> Vec<DetachingVolume> {
        let pods = self.pods_on_node();
        let vas = self.view().attachments_on_node();
        let (pvcs, pvs) = self.view().volume_objects(&pods, &pvs_of(&vas));
        let detaching = detaching_volumes(&self.job.node, &pods, &pvcs, &pvs, &vas);
        self.not_given_up(&detaching)
    }

    /// `detaching` less the volumes whose detach wait already timed out.
    pub(super) fn not_given_up(&self, detaching: &[DetachingVolume]) -> Vec<DetachingVolume> {
        still_to_wait_for(detaching, &self.held.given_up())
    }

    /// Copies of the pods bound to this Node, less those that came back
    /// after the cordon ([`came_back`]): each of those is reported once,
    /// and left to end with the VM.
    fn pods_on_node(&self) -> Vec<Pod> {
        let pods = self.view().pods_on_node();
        let seen = self.tally.seen_first(&pods);
        let evicted_from = self.tally.controllers();
        let arrivals = Arrivals {
            cordoned_at: self.cordoned_at(),
            known: Some((seen, &evicted_from)),
        };
        let mut staying = Vec::with_capacity(pods.len());
        for p in pods {
            let returned = if self.tally.was_evicted(&p) {
                None
            } else {
                came_back(&p, controller_of(&p).as_deref(), &arrivals)
            };
            let Some(how) = returned else {
                staying.push((*p).clone());
                continue;
            };
            let uid = p.metadata.uid.clone().unwrap_or_default();
            if self.reports.first_return(uid) {
                let key = fmt_key(&pod_key(&p));
                self.reports.event(
                    EventType::Warning,
                    "PodReturned",
                    format!(
                        "pod {key} came to Node {} after it was cordoned: {}; it is not evicted again, and ends with the VM",
                        self.job.node,
                        how.why()
                    ),
                    Some(pod_ref_key(&pod_key(&p))),
                );
            }
        }
        staying
    }

    /// When the Node was cordoned: its annotation, or without one (a Node
    /// cordoned by an earlier release) the deletion request.
    fn cordoned_at(&self) -> Timestamp {
        self.view()
            .cordoned_at()
            .unwrap_or(self.job.deadline.started)
    }

    /// Counts a pod evicted or deleted, once per pod.
    pub(super) fn count_evicted(&self, key: &NamespacedName) {
        if self.tally.count(key) {
            self.progress.one_evicted();
        }
    }
}
