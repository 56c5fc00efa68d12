//! One drain's state: what it has done and judged (pods evicted, forced,
//! come back; volumes given up on; workloads held), its move records in
//! `status.drain.moves`, and its waits on pods.
//!
//! What it reads of the cluster comes through the read-only
//! [`View`](super::view::View); the orders come from the pure
//! [`plan`](crate::drain::plan); nothing here decides an order.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::watch;
use tokio::time::Instant;

use super::progress::Flushed;
use super::refs::{pod_ref_key, pv_ref};
use super::view::{View, pvs_of};
use super::{Deps, Job, Progress};
use crate::api::VolumeMove;
use crate::drain::ledger::workload_of_record;
use crate::drain::plan::{
    DetachingVolume, DrainPlan, TerminatingPod, controller_of, detaching_volumes, plan,
    still_to_wait_for,
};
use crate::drain::pod_writes::{self, Evicted};
use crate::drain::select::{
    Arrivals, NamespacedName, came_back, fmt_key, held_by_finalizers, pod_key,
};
use crate::drain::volume_kind::VolumeContext;
use crate::telemetry::EvictionResult;
use crate::volumes::{Interest, WaitError, pv_of};

/// What one Machine's drains said and judged, kept by the
/// [`Drainer`](super::Drainer) across the runs of its drain (a failed drain
/// retried, a drain started again for pods that came back), so that a retry
/// neither reports again what was reported nor counts again a pod that came
/// back.
#[derive(Debug, Default)]
pub(crate) struct Memory {
    /// What was reported once (a topic and a pod's UID).
    pub(crate) reported: BTreeSet<String>,
    /// The pods (by UID) judged to have come back after the cordon.
    pub(crate) returned: BTreeSet<String>,
}

/// One drain, from its first pass to its outcome.
pub(super) struct NodeDrain {
    pub(super) deps: Arc<Deps>,
    /// This drain's own client (see [`Deps::drain_client`]).
    pub(super) client: kube::Client,
    /// Its urgent line, for the steps of its stateful moves (see
    /// [`super::DrainClients::moves`]).
    pub(super) moves: kube::Client,
    pub(super) job: Job,
    pub(super) progress: watch::Sender<Progress>,
    /// Pods this run has evicted or deleted, to count progress once each.
    evicted: Mutex<BTreeSet<String>>,
    /// Their UIDs, and their controllers.
    evicted_uids: Mutex<BTreeSet<String>>,
    evicted_controllers: Mutex<BTreeSet<String>>,
    /// Volumes whose detach wait timed out: warned about once, not waited
    /// for again (the reconciler's own volume step still guards the VM).
    abandoned: Mutex<BTreeSet<String>>,
    /// What this Machine's drains said and judged so far: kept across its
    /// runs (a failed drain retried), so that each report is made once.
    memory: Arc<Mutex<Memory>>,
    /// The pods (by UID) on the Node when this run first planned, before
    /// it evicted anything: none of them came back.
    seen_first: OnceLock<BTreeSet<String>>,
    /// Pods deleted with their PodDisruptionBudget bypassed (the deadline).
    forced: Mutex<Vec<String>>,
    /// What the status writer has written.
    pub(super) flushed: watch::Receiver<Flushed>,
    /// Workloads (by controller) whose last evicted pod's replacement the
    /// scheduler cannot place, with that pod's move: none of their other
    /// pods is evicted until it is placed (before the deadline).
    stuck: Mutex<BTreeMap<String, (VolumeMove, i32)>>,
    /// Set for the drain's last pass after the deadline without forcing:
    /// each pod gets one more eviction attempt.
    last_try: AtomicBool,
    /// The volume moves this drain has left: its stateful pods at its
    /// pass's start, less the moves begun since. Its asks carry it (see
    /// [`Ask::moves_left`](crate::drain::ledger::Ask::moves_left)).
    pub(super) moves_left: AtomicU32,
    /// Whether the Machine allows losing node-local data (its annotation),
    /// as the reconciler last saw it.
    pub(super) data_loss_allowed: watch::Receiver<bool>,
    /// The order groups this run has worked on: the first, and the last.
    pub(super) groups: Mutex<Option<(i32, i32)>>,
    /// Asks for a reconcile of the Machine: for news its reconciler would
    /// otherwise learn only from the Machine's own changes.
    pub(super) wake: tokio::sync::mpsc::UnboundedSender<ObjectRef<crate::api::Machine>>,
}

impl NodeDrain {
    pub(super) fn new(
        deps: Arc<Deps>,
        job: Job,
        progress: watch::Sender<Progress>,
        flushed: watch::Receiver<Flushed>,
        data_loss_allowed: watch::Receiver<bool>,
        memory: Arc<Mutex<Memory>>,
        wake: tokio::sync::mpsc::UnboundedSender<ObjectRef<crate::api::Machine>>,
    ) -> Self {
        // The moves a previous run recorded stay recorded until resumed.
        progress.send_modify(|p| {
            p.moves = job
                .moves
                .iter()
                .map(|m| (m.pod.clone(), m.clone()))
                .collect();
        });
        let clients = (deps.drain_client)();
        Self {
            client: clients.rest,
            moves: clients.moves,
            deps,
            job,
            progress,
            flushed,
            evicted: Mutex::new(BTreeSet::new()),
            evicted_uids: Mutex::new(BTreeSet::new()),
            evicted_controllers: Mutex::new(BTreeSet::new()),
            abandoned: Mutex::new(BTreeSet::new()),
            memory,
            seen_first: OnceLock::new(),
            forced: Mutex::new(Vec::new()),
            stuck: Mutex::new(BTreeMap::new()),
            last_try: AtomicBool::new(false),
            moves_left: AtomicU32::new(0),
            data_loss_allowed,
            groups: Mutex::new(None),
            wake,
        }
    }

    /// With `forceAfterDeadline`, when a pod of grace period `grace` that
    /// is still not evicted gets deleted instead, bypassing its budget: at
    /// the deadline minus its grace period, so that it is gone by the
    /// deadline. `None` without forcing.
    pub(super) fn force_at(&self, grace: Duration) -> Option<Instant> {
        self.job.settings.force_after_deadline.then(|| {
            let deadline = self.deadline();
            deadline.checked_sub(grace).unwrap_or(deadline)
        })
    }

    /// Records a pod deleted with its budget bypassed.
    pub(super) fn forced(&self, key: &NamespacedName) {
        if let Ok(mut f) = self.forced.lock() {
            f.push(fmt_key(key));
        }
    }

    /// The pods deleted with their budget bypassed so far.
    pub(super) fn forced_pods(&self) -> Vec<String> {
        self.forced.lock().map(|f| f.clone()).unwrap_or_default()
    }

    /// Whether this is the last pass after the deadline without forcing.
    pub(super) fn last_try(&self) -> bool {
        self.last_try.load(Ordering::Relaxed)
    }

    pub(super) fn start_last_try(&self) {
        self.last_try.store(true, Ordering::Relaxed);
    }

    /// Pods evicted or deleted and migration steps completed so far: a pass
    /// after the deadline that changes neither made no progress.
    pub(super) fn work_done(&self) -> (u32, u64) {
        let p = self.progress.borrow();
        (p.pods_evicted, p.steps_done)
    }

    /// When a pod being deleted, with grace period `grace`, stops holding
    /// this drain (see [`Deadline::releases`](crate::drain::deadline::Deadline::releases)).
    pub(super) fn release_of(&self, grace: Duration) -> Instant {
        Instant::now() + self.job.deadline.until_release(grace, Timestamp::now())
    }

    /// Whether a pod already being deleted no longer holds this drain.
    pub(super) fn released(&self, t: &TerminatingPod) -> bool {
        self.job.deadline.releases(t.grace, Timestamp::now())
    }

    /// Waits for a pod that was already being deleted to be gone, until it
    /// no longer holds the drain. If a finalizer still holds it once its
    /// grace period is over, says so once (a Warning, and `blockedBy` while
    /// it holds the drain).
    pub(super) async fn wait_terminating(&self, t: &TerminatingPod) {
        let uid = t.uid.as_deref();
        let release = self.release_of(t.grace);
        let grace_ends = Instant::now()
            + Duration::try_from(t.since.duration_since(Timestamp::now())).unwrap_or_default();
        if self.wait_gone(&t.pod, uid, grace_ends.min(release)).await {
            return;
        }
        let key = fmt_key(&t.pod);
        if let Some(pod) = self.view().pod(&t.pod, uid)
            && let Some(finalizers) = held_by_finalizers(&pod, Timestamp::now())
        {
            let first = self.first_report(t.uid.clone().unwrap_or_else(|| key.clone()));
            let until = self
                .job
                .deadline
                .expires_at()
                .and_then(|d| {
                    let grace = k8s_openapi::jiff::SignedDuration::try_from(t.grace).ok()?;
                    d.checked_add(grace).ok()
                })
                .map_or_else(|| "the deadline".to_string(), |t| t.to_string());
            let why = format!(
                "pod {key} is held by finalizer {} after its grace period; the drain waits for it until {until} (the deadline plus its grace period), then goes on without it",
                finalizers.join(", ")
            );
            if first {
                self.event(
                    EventType::Warning,
                    "PodHeldByFinalizer",
                    why.clone(),
                    Some(pod_ref_key(&t.pod)),
                );
            }
            self.update(|p| p.hold(&key, why));
        } else if self.job.settings.force_after_deadline {
            // Its grace period is over and no finalizer holds it: the kubelet
            // did not confirm it stopped. At the deadline, and only then,
            // such a pod is deleted at once (grace 0).
            if self.wait_gone(&t.pod, uid, self.deadline()).await {
                return;
            }
            if let Some(pod) = self.view().pod(&t.pod, uid)
                && held_by_finalizers(&pod, Timestamp::now()).is_none()
            {
                self.force_gone(&t.pod, &pod).await;
            }
        }
        self.wait_gone(&t.pod, uid, release).await;
        self.update(|p| p.unblock(&key));
    }

    /// Whether `what` (a pod's UID and a topic) is reported for the first
    /// time in this drain: each report is made once.
    pub(super) fn first_report(&self, what: String) -> bool {
        self.memory
            .lock()
            .map(|mut m| m.reported.insert(what))
            .unwrap_or(false)
    }

    /// Deletes with grace 0 a pod whose grace period already passed.
    async fn force_gone(&self, key: &NamespacedName, pod: &Pod) {
        match pod_writes::delete(&self.client, pod, Some(0)).await {
            Evicted::Accepted => {
                self.deps.metrics.record_eviction(EvictionResult::Forced);
                self.forced(key);
            }
            Evicted::Gone => {}
            other => {
                tracing::warn!(pod = %fmt_key(key), result = ?other, "force delete failed");
            }
        }
    }

    fn now_instant_of(&self, deadline_left: Duration) -> Instant {
        Instant::now() + deadline_left
    }

    /// The deadline as a monotonic instant.
    pub(super) fn deadline(&self) -> Instant {
        self.now_instant_of(self.job.deadline.remaining(Timestamp::now()))
    }

    /// The bound of a wait that keeps data safe (a pod gone, its volumes
    /// detached): with `forceAfterDeadline` the step's own bound, never cut
    /// at the deadline, since budgets are what the deadline gives up, not
    /// volumes; without it, as [`NodeDrain::bounded`].
    pub(super) fn volume_bound(&self, step: Duration) -> Instant {
        if self.job.settings.force_after_deadline {
            return self.now_instant_of(step);
        }
        self.bounded(step)
    }

    /// A step's own bound, cut to the deadline; after the deadline (the
    /// last try without forcing), the step's own bound.
    pub(super) fn bounded(&self, step: Duration) -> Instant {
        let now = Timestamp::now();
        if self.job.deadline.expired(now) {
            return self.now_instant_of(step);
        }
        self.now_instant_of(self.job.deadline.bound(now, step))
    }

    pub(super) fn expired(&self) -> bool {
        self.job.deadline.expired(Timestamp::now())
    }

    /// The caches, read for this drain's Node.
    pub(super) fn view(&self) -> View<'_> {
        View::new(&self.deps.caches, &self.job.node)
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
        self.not_abandoned(&detaching)
    }

    /// `detaching` less the volumes whose detach wait already timed out.
    pub(super) fn not_abandoned(&self, detaching: &[DetachingVolume]) -> Vec<DetachingVolume> {
        let abandoned = self.abandoned.lock().map(|a| a.clone()).unwrap_or_default();
        still_to_wait_for(detaching, &abandoned)
    }

    /// Copies of the pods bound to this Node, less those that came back
    /// after the cordon ([`came_back`]): each of those is reported once,
    /// and left to end with the VM.
    fn pods_on_node(&self) -> Vec<Pod> {
        let pods = self.view().pods_on_node();
        let seen = self
            .seen_first
            .get_or_init(|| pods.iter().filter_map(|p| p.metadata.uid.clone()).collect());
        let evicted_from = self.evicted_controllers();
        let arrivals = Arrivals {
            cordoned_at: self.cordoned_at(),
            known: Some((seen, &evicted_from)),
        };
        let mut staying = Vec::with_capacity(pods.len());
        for p in pods {
            let returned = if self.was_evicted(&p) {
                None
            } else {
                came_back(&p, controller_of(&p).as_deref(), &arrivals)
            };
            let Some(how) = returned else {
                staying.push((*p).clone());
                continue;
            };
            let uid = p.metadata.uid.clone().unwrap_or_default();
            let first = self
                .memory
                .lock()
                .map(|mut m| m.returned.insert(uid))
                .unwrap_or(false);
            if first {
                let key = fmt_key(&pod_key(&p));
                self.event(
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

    pub(super) fn update(&self, f: impl FnOnce(&mut Progress)) {
        self.progress.send_if_modified(|p| {
            let before = p.clone();
            f(p);
            *p != before
        });
    }

    /// A step of a volume migration completed: counted (see
    /// [`Progress::steps_done`]), and written at the writer's pace unless
    /// it changes a move's record.
    pub(super) fn step(&self, f: impl FnOnce(&mut Progress)) {
        self.progress.send_modify(|p| {
            f(p);
            p.steps_done += 1;
        });
    }

    /// The move of pod `key`'s volumes is over (moved, given up, or never
    /// started).
    pub(super) fn end_move(&self, key: &str) {
        let mut ended = None;
        self.update(|p| {
            ended = p.moves.remove(key);
        });
        if let Some(m) = ended
            && let Some((ns, _)) = m.pod.split_once('/')
            && let Some(w) = workload_of_record(ns, &m)
        {
            self.end_permit(&w, m.uid.as_deref().unwrap_or(&m.pod));
        }
    }

    /// The recorded moves whose pod is gone: the volumes of each are
    /// waited for (detached from this Node, attached where a pod needs them)
    /// before another stateful pod is evicted. A recorded pod still there
    /// and not being deleted was never evicted (the controller stopped in
    /// between): its record goes, its migration records it again.
    pub(super) fn resumed_moves(&self) -> Vec<VolumeMove> {
        let moves: Vec<VolumeMove> = self.progress.borrow().moves.values().cloned().collect();
        let mut resumed = Vec::new();
        for m in moves
            .into_iter()
            .filter(|m| !self.is_held(&m.pod) && !self.stalled_move(m))
        {
            let Some((ns, name)) = m.pod.split_once('/') else {
                self.end_move(&m.pod);
                continue;
            };
            let key = (ns.to_string(), name.to_string());
            match self.view().pod(&key, m.uid.as_deref()) {
                None => resumed.push(m),
                Some(p) if p.metadata.deletion_timestamp.is_none() => self.end_move(&m.pod),
                Some(_) => {}
            }
        }
        resumed
    }

    /// Whether a recorded move's pod is gone, so that
    /// [`NodeDrain::resumed_moves`] would resume it.
    pub(super) fn any_resumable(&self) -> bool {
        let p = self.progress.borrow();
        let moves = p.moves.values();
        moves
            .filter(|m| !self.is_held(&m.pod) && !self.stalled_move(m))
            .any(|m| {
                m.pod.split_once('/').is_some_and(|(ns, name)| {
                    self.view()
                        .pod(&(ns.to_string(), name.to_string()), m.uid.as_deref())
                        .is_none()
                })
            })
    }

    /// Names, once when a drain starts, each move an earlier run recorded
    /// whose pod already left or is leaving: a controller stopped between
    /// an eviction and its Event (killed, or stopped while the request was
    /// in flight) leaves no Evicted Event for that pod, and this says what
    /// the resumed drain found instead.
    pub(super) fn announce_resumed(&self) {
        let moves: Vec<VolumeMove> = self.progress.borrow().moves.values().cloned().collect();
        for m in moves {
            let Some((ns, name)) = m.pod.split_once('/') else {
                continue;
            };
            let key = (ns.to_string(), name.to_string());
            let state = match self.view().pod(&key, m.uid.as_deref()) {
                None => "gone",
                Some(p) if p.metadata.deletion_timestamp.is_some() => "terminating",
                Some(_) => continue,
            };
            self.event(
                EventType::Normal,
                "MoveResumed",
                format!(
                    "resuming the move of pod {}'s volumes ({}) recorded by an earlier run: the pod is {state}",
                    m.pod,
                    m.volumes.join(", ")
                ),
                Some(pod_ref_key(&key)),
            );
        }
    }

    /// Whether the move of pod `key` is held for its unplaceable
    /// replacement (see [`NodeDrain::hold_workload`]): it is resumed once the
    /// replacement is placed, not before.
    fn is_held(&self, key: &str) -> bool {
        self.stuck
            .lock()
            .is_ok_and(|s| s.values().any(|(m, _)| m.pod == key))
    }

    /// Whether move `m` stalled: a volume of it did not detach in time in
    /// this run and is still attached to the Node. It keeps its record and
    /// its workload's permit, and is not waited for again in every pass;
    /// once its volumes are off it is resumed (see
    /// [`NodeDrain::stalled_detached`]).
    pub(super) fn stalled_move(&self, m: &VolumeMove) -> bool {
        let Ok(abandoned) = self.abandoned.lock() else {
            return false;
        };
        let given_up: Vec<&String> = m
            .volumes
            .iter()
            .filter(|pv| abandoned.contains(*pv))
            .collect();
        if given_up.is_empty() {
            return false;
        }
        let on_node = self.view().attachments_on_node();
        given_up
            .iter()
            .any(|pv| on_node.iter().any(|va| pv_of(va) == Some(pv.as_str())))
    }

    /// The volumes of this drain's stalled moves (see
    /// [`NodeDrain::stalled_move`]), for a wait until they are off the Node.
    pub(super) fn stalled_volumes(&self) -> Vec<String> {
        let moves: Vec<VolumeMove> = self.progress.borrow().moves.values().cloned().collect();
        let abandoned = self.abandoned.lock().map(|a| a.clone()).unwrap_or_default();
        moves
            .iter()
            .filter(|m| self.stalled_move(m))
            .flat_map(|m| {
                m.volumes
                    .iter()
                    .filter(|pv| abandoned.contains(*pv))
                    .cloned()
            })
            .collect()
    }

    /// Resolves once the volumes of the stalled moves are off the Node
    /// (never, when there are none), or at `until`.
    pub(super) async fn stalled_detached(&self, until: Instant) {
        let pvs = self.stalled_volumes();
        if pvs.is_empty() {
            return std::future::pending().await;
        }
        let interest = pvs
            .into_iter()
            .fold(Interest::new(&self.job.node), |i, pv| i.volume(pv, None));
        let mut reg = self.deps.tracker.register(interest);
        let _ = reg.wait_detached(until).await;
    }

    /// The volumes of the moves held now, by PV name.
    pub(super) fn held_volumes(&self) -> BTreeSet<String> {
        self.stuck.lock().map_or_else(
            |_| BTreeSet::new(),
            |s| s.values().flat_map(|(m, _)| m.volumes.clone()).collect(),
        )
    }

    /// Nothing is left to drain but moves held for a replacement the
    /// scheduler cannot place: their pods are gone and their volumes off
    /// this Node, so the Machine (and its VM) need not wait for where the
    /// replacements land. Each move goes on without it, holding its
    /// workload's permit until the workload is whole again or the move's
    /// healthy deadline (see [`keeper`](super::keeper)); its record leaves
    /// the Machine's status, and an Event says so.
    pub(super) fn hand_over_held(&self) {
        let held: Vec<VolumeMove> = self
            .stuck
            .lock()
            .map(|mut s| {
                std::mem::take(&mut *s)
                    .into_values()
                    .map(|(m, _)| m)
                    .collect()
            })
            .unwrap_or_default();
        for m in held {
            self.update(|p| {
                p.unblock(&m.pod);
                p.moves.remove(&m.pod);
            });
            let workload = m
                .pod
                .split_once('/')
                .and_then(|(ns, _)| workload_of_record(ns, &m))
                .map_or_else(|| "its workload".to_string(), |w| w.to_string());
            let pod = m
                .pod
                .split_once('/')
                .map(|(ns, name)| pod_ref_key(&(ns.to_string(), name.to_string())));
            self.event(
                EventType::Normal,
                "MoveOutlivesDrain",
                format!(
                    "nothing else is left on Node {}: the move of pod {} ({}) goes on without this Machine while its replacement cannot be placed, holding the move permit of {workload} until the workload is whole again or the move's healthy deadline",
                    self.job.node,
                    m.pod,
                    m.volumes.join(", ")
                ),
                pod,
            );
        }
    }

    /// Holds back the other pods of `controller` until the replacement of
    /// the pod `moved` left is placed.
    /// The move was of a pod of order group `order`: no later group starts
    /// while it is held (see [`NodeDrain::held_order`]).
    pub(super) fn hold_workload(&self, controller: &str, moved: VolumeMove, order: i32) {
        if let Ok(mut s) = self.stuck.lock() {
            s.insert(controller.to_string(), (moved, order));
        }
    }

    /// The lowest order group of a held workload's move (never after the
    /// deadline): a later group waits for it, since a group starts only
    /// once the volumes of every pod before it have moved.
    pub(super) fn held_order(&self) -> Option<i32> {
        if self.expired() {
            return None;
        }
        let stuck = self.stuck.lock().ok()?;
        stuck.values().map(|(_, order)| *order).min()
    }

    /// Whether pods of `controller` are held back now (never after the
    /// deadline, when availability is what is given up).
    pub(super) fn workload_held(&self, controller: Option<&str>) -> bool {
        controller
            .is_some_and(|c| !self.expired() && self.stuck.lock().is_ok_and(|s| s.contains_key(c)))
    }

    /// Takes the held workloads whose replacement is no longer
    /// unschedulable (placed, or gone), with the moves they were held for.
    pub(super) fn placed_workloads(&self) -> Vec<VolumeMove> {
        let Ok(mut stuck) = self.stuck.lock() else {
            return Vec::new();
        };
        let expired = self.expired();
        let placed: Vec<String> = stuck
            .iter()
            .filter(|(_, (m, _))| expired || !self.unplaced(m))
            .map(|(c, _)| c.clone())
            .collect();
        placed
            .iter()
            .filter_map(|c| stuck.remove(c))
            .map(|(m, _)| m)
            .collect()
    }

    /// Whether any held workload's replacement was placed.
    pub(super) fn any_placed(&self) -> bool {
        self.stuck
            .lock()
            .is_ok_and(|s| s.values().any(|(m, _)| !self.unplaced(m)))
    }

    /// Whether the scheduler still cannot place the replacement of the pod
    /// `m` moved.
    fn unplaced(&self, m: &VolumeMove) -> bool {
        let uid = m.uid.as_deref().unwrap_or("");
        self.claims_of(m)
            .iter()
            .any(|c| self.view().unschedulable_replacement(c, uid).is_some())
    }

    /// The claims of the PVs of a move, from their `claimRef`.
    fn claims_of(&self, m: &VolumeMove) -> Vec<NamespacedName> {
        m.volumes
            .iter()
            .filter_map(|pv| self.view().claim_of(pv))
            .collect()
    }

    /// Records a pod this drain evicted, and its controller: a new pod of
    /// that controller on this Node that tolerates the cordon came back.
    pub(super) fn evicted_pod(&self, pod: &Pod, controller: Option<&str>) {
        if let (Some(uid), Ok(mut e)) = (pod.metadata.uid.clone(), self.evicted_uids.lock()) {
            e.insert(uid);
        }
        if let (Some(c), Ok(mut e)) = (controller, self.evicted_controllers.lock()) {
            e.insert(c.to_string());
        }
    }

    fn evicted_controllers(&self) -> BTreeSet<String> {
        self.evicted_controllers
            .lock()
            .map(|e| e.clone())
            .unwrap_or_default()
    }

    /// Whether this drain evicted or deleted this very pod (by UID).
    fn was_evicted(&self, pod: &Pod) -> bool {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        self.evicted_uids.lock().is_ok_and(|e| e.contains(uid))
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
        self.deps.events.event(
            type_,
            self.job.machine_ref.clone(),
            "Drain",
            reason,
            note,
            related,
        );
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
        self.event(
            EventType::Warning,
            reason,
            e.to_string(),
            pv.and_then(pv_ref),
        );
    }

    /// Waits until the pod (this UID) is gone from the cache, woken by pod
    /// events; false if `until` passed first.
    pub(super) async fn wait_gone(
        &self,
        key: &NamespacedName,
        uid: Option<&str>,
        until: Instant,
    ) -> bool {
        self.wait_pods_until(until, || self.view().pod(key, uid).is_none())
            .await
    }

    /// Waits until `done` holds over the pod cache, checked after every pod
    /// event, or `until`. Returns whether it held.
    pub(super) async fn wait_pods_until(&self, until: Instant, done: impl Fn() -> bool) -> bool {
        let mut changes = self.deps.caches.pod_changes.clone();
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
