//! The drain engine: executes the [`plan`](super::plan) of a Node against
//! the cluster.
//!
//! One task per draining Machine, started by the reconciler's Drain step
//! and owned by the [`Drainer`]. The task works in passes: each pass plans
//! from the informer caches, then
//!
//! 1. deletes terminal pods;
//! 2. evicts the pods without persistent volumes, at most
//!    `maxConcurrentEvictions` at a time, and waits for each to be gone;
//! 3. at the same time moves the stateful pods in priority order, at most
//!    `maxParallelVolumeMigrations` at a time: register with the volume
//!    tracker → evict → pod gone → its volumes detached from this Node →
//!    attached on another Node (a warning if not in time, and not waited
//!    for at all when no pod still references the claim). Before the first
//!    stateful eviction it waits for volumes still detaching from pods that
//!    left earlier (a restart mid-drain resumes exactly here);
//! 4. waits for pods that were already terminating.
//!
//! and repeats until a pass finds nothing left to do. Nothing polls: pod
//! and PodDisruptionBudget waits wake on the informers' change signals,
//! volume waits on the tracker, and the only timers are bounds, backoff
//! ceilings and the drain deadline.
//!
//! A PodDisruptionBudget is never bypassed before the deadline: a refused
//! eviction (429) is retried with exponential backoff and jitter, and sooner
//! when a PDB in the pod's namespace changes. After `maxEvictRetries`
//! refusals, or at once for a misconfigured PDB, the pod is reported as
//! blocked, naming the PDB, and retried only when a PDB changes or the
//! backoff ceiling passes. When the deadline passes, the pods left are
//! force-deleted if `forceAfterDeadline`, otherwise the drain fails with
//! the list of pods and why; the reconciler retries it later, with the same
//! deadline.
//!
//! Progress goes to `Machine.status.drain` through one writer task that
//! coalesces updates; Events record each stateful pod's eviction, each
//! volume move, and each batch of other pods evicted together.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    Node, ObjectReference, PersistentVolume, PersistentVolumeClaim, Pod,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::Instrument;

use super::deadline::Deadline;
use super::evict::{self, Evicted};
use super::pdb::PdbVerdict;
use super::plan::{DrainPlan, PlannedPod, PlannedVolume, VolumeWait, plan};
use super::select::{NamespacedName, fmt_key};
use super::volume::replacement_expected;
use crate::api::Machine;
use crate::api::settings::ResolvedSettings;
use crate::cache::{Indexes, claim_key};
use crate::telemetry::events::EventSink;
use crate::telemetry::{EvictionResult, Metrics};
use crate::volumes::{Interest, Tracker, WaitError};

/// Longest pause between two eviction attempts of a refused pod.
const MAX_EVICT_BACKOFF: Duration = Duration::from_secs(30);
/// Shortest time between two writes of a drain's progress, unless a step
/// of a volume migration completed (see [`Progress::steps_done`]).
const STATUS_WRITE_INTERVAL: Duration = Duration::from_secs(1);
/// How long a drain waits, after a controlled stateful pod's volumes have
/// detached, for its controller to create the pod that will use them again
/// (at most the reattach timeout). A StatefulSet recreates its pod at once;
/// none after this long means it was scaled down meanwhile.
const REPLACEMENT_WAIT: Duration = Duration::from_secs(30);
/// How long after a failed drain the reconciler may start it again.
pub const RETRY_FAILED_AFTER: Duration = Duration::from_secs(30);

/// What the engine reads and writes through.
pub struct Deps {
    pub client: Client,
    pub pods: Store<Pod>,
    pub pvcs: Store<PersistentVolumeClaim>,
    pub pvs: Store<PersistentVolume>,
    pub pdbs: Store<PodDisruptionBudget>,
    pub attachments: Store<VolumeAttachment>,
    pub nodes: Store<Node>,
    pub indexes: Indexes,
    pub tracker: Tracker,
    /// Bumped after every pod event, once the pod store has applied it.
    pub pod_changes: watch::Receiver<u64>,
    /// Bumped after every PodDisruptionBudget event.
    pub pdb_changes: watch::Receiver<u64>,
    pub metrics: Arc<Metrics>,
    pub events: EventSink,
}

/// How a drain ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every pod that had to go is gone and its volumes have moved.
    Drained,
    /// The deadline passed and the pods left were force-deleted.
    Forced { pods: Vec<String> },
    /// The deadline passed and forcing is not allowed: these pods are left.
    Failed { message: String },
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Drained => "drained",
            Outcome::Forced { .. } => "forced",
            Outcome::Failed { .. } => "failed",
        }
    }
}

/// A drain's progress, mirrored into `Machine.status.drain`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    pub pods_total: u32,
    pub pods_evicted: u32,
    pub pods_remaining: u32,
    pub current_pod: Option<String>,
    pub current_volume: Option<String>,
    pub waiting_for: Option<String>,
    pub blocked_by: Option<String>,
    pub outcome: Option<Outcome>,
    /// When the outcome was reached.
    pub finished_at: Option<Instant>,
    /// The same moment on the wall clock, for `status.drain.finishedAt`.
    pub finished_on: Option<Timestamp>,
    /// Steps of volume migrations completed so far (a stateful pod
    /// evicted, gone, its volumes detached). Not written itself: a change
    /// of it makes the status writer write at once instead of at its pace,
    /// so that `status.drain` names what the drain waits for now, not
    /// what it waited for a second ago.
    pub steps_done: u64,
}

impl Progress {
    fn status_patch(&self) -> serde_json::Value {
        let done = self.pods_total.saturating_sub(self.pods_remaining);
        serde_json::json!({"status": {"drain": {
            "podsTotal": self.pods_total,
            "podsEvicted": self.pods_evicted,
            "podsRemaining": self.pods_remaining,
            "progress": format!("{done}/{}", self.pods_total),
            "currentPod": self.current_pod,
            "currentVolume": self.current_volume,
            "waitingFor": self.waiting_for,
            "blockedBy": self.blocked_by,
            "finishedAt": self.finished_on.map(MicroTime),
        }}})
    }
}

/// One drain to run.
#[derive(Debug, Clone)]
pub struct Job {
    pub machine: ObjectRef<Machine>,
    /// The Machine, for Events.
    pub machine_ref: ObjectReference,
    pub node: String,
    pub settings: ResolvedSettings,
    pub deadline: Deadline,
}

struct Running {
    progress: watch::Receiver<Progress>,
    task: tokio::task::JoinHandle<()>,
}

/// The drains of this replica, by Machine.
pub struct Drainer {
    deps: Arc<Deps>,
    running: Mutex<HashMap<ObjectRef<Machine>, Running>>,
    /// Wakes the reconciler of a Machine whose drain finished.
    done: mpsc::UnboundedSender<ObjectRef<Machine>>,
}

impl Drainer {
    /// A drainer and the stream of Machines whose drain finished (feed it to
    /// the controller's `reconcile_on`).
    pub fn new(deps: Deps) -> (Self, mpsc::UnboundedReceiver<ObjectRef<Machine>>) {
        let (done, finished) = mpsc::unbounded_channel();
        let drainer = Self {
            deps: Arc::new(deps),
            running: Mutex::new(HashMap::new()),
            done,
        };
        (drainer, finished)
    }

    /// The progress of `job`'s drain, starting it if it is not running: the
    /// first time, after a controller restart, or when it failed at least
    /// [`RETRY_FAILED_AFTER`] ago. A finished drain is not started again
    /// unless `pods_left` says pods came back.
    pub fn ensure(&self, job: Job, pods_left: bool) -> Progress {
        let Ok(mut running) = self.running.lock() else {
            return Progress::default();
        };
        if let Some(r) = running.get(&job.machine) {
            let p = r.progress.borrow().clone();
            let restart = match (&p.outcome, p.finished_at) {
                (None, _) => false,
                (Some(Outcome::Failed { .. }), Some(at)) => at.elapsed() >= RETRY_FAILED_AFTER,
                (Some(_), _) => pods_left,
            };
            if !restart {
                return p;
            }
        }
        let (tx, rx) = watch::channel(Progress::default());
        let key = job.machine.clone();
        let deps = Arc::clone(&self.deps);
        let done = self.done.clone();
        let span = tracing::info_span!("drain", machine = %job.machine.name, namespace = job.machine.namespace.as_deref().unwrap_or(""), node = %job.node);
        let task = tokio::spawn(
            async move {
                let key = job.machine.clone();
                run(deps, job, tx).await;
                let _ = done.send(key);
            }
            .instrument(span),
        );
        let progress = rx.borrow().clone();
        if let Some(old) = running.insert(key, Running { progress: rx, task }) {
            old.task.abort();
        }
        progress
    }

    /// Asks for a reconcile of `machine` (through the same trigger stream
    /// as finished drains).
    pub fn wake(&self, machine: ObjectRef<Machine>) {
        let _ = self.done.send(machine);
    }

    /// Whether this Machine's drain ran here and ended drained or forced.
    /// After a restart nothing has run yet, so the drain runs again: it
    /// finds the pods gone and only waits for volumes still detaching.
    pub fn finished(&self, machine: &ObjectRef<Machine>) -> bool {
        self.running.lock().is_ok_and(|running| {
            running.get(machine).is_some_and(|r| {
                matches!(
                    r.progress.borrow().outcome,
                    Some(Outcome::Drained | Outcome::Forced { .. })
                )
            })
        })
    }

    /// Forgets a Machine's drain (it was deleted, or its deletion no longer
    /// needs one), stopping it if it still runs.
    pub fn forget(&self, machine: &ObjectRef<Machine>) {
        if let Ok(mut running) = self.running.lock()
            && let Some(r) = running.remove(machine)
        {
            r.task.abort();
        }
    }

    /// Stops every drain (shutdown or lost leadership). Every step resumes
    /// from the cluster's state in the next leader.
    pub fn stop_all(&self) {
        if let Ok(mut running) = self.running.lock() {
            for (_, r) in running.drain() {
                r.task.abort();
            }
        }
        self.deps.tracker.close();
    }
}

impl Drop for Drainer {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// Writes progress to the Machine's status. Bursts are coalesced (at most
/// one write per [`STATUS_WRITE_INTERVAL`], always of the latest value),
/// except that a completed migration step is written at once. Ends when
/// the drain drops its sender, after writing the final state.
async fn write_status(
    client: Client,
    machine: ObjectRef<Machine>,
    mut rx: watch::Receiver<Progress>,
) {
    let api: Api<Machine> =
        Api::namespaced(client, machine.namespace.as_deref().unwrap_or_default());
    let mut written: Option<serde_json::Value> = None;
    let mut last_write: Option<Instant> = None;
    'writing: loop {
        let (patch, steps) = {
            let p = rx.borrow_and_update();
            (p.status_patch(), p.steps_done)
        };
        if written.as_ref() != Some(&patch) {
            match api
                .patch_status(
                    &machine.name,
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
            {
                Ok(_) => {
                    written = Some(patch);
                    last_write = Some(Instant::now());
                }
                Err(kube::Error::Api(s)) if s.code == 404 => return,
                Err(e) => tracing::warn!(error = %e, "could not record drain progress"),
            }
        }
        // The next change: a step goes out at once, anything else once the
        // interval since the last write has passed.
        if rx.changed().await.is_err() {
            break;
        }
        loop {
            let step = rx.borrow().steps_done != steps;
            let Some(due) = hold_until(last_write, step, Instant::now()) else {
                break;
            };
            tokio::select! {
                () = tokio::time::sleep_until(due) => break,
                changed = rx.changed() => if changed.is_err() { break 'writing },
            }
        }
    }
    // The drain ended; write its final state if it changed since.
    let last = rx.borrow().status_patch();
    if written.as_ref() != Some(&last) {
        let _ = api
            .patch_status(&machine.name, &PatchParams::default(), &Patch::Merge(&last))
            .await;
    }
}

/// Until when the status writer holds a change back: never for a step or
/// before the first write, otherwise until the interval since the last
/// write has passed.
fn hold_until(last_write: Option<Instant>, step: bool, now: Instant) -> Option<Instant> {
    last_write
        .map(|t| t + STATUS_WRITE_INTERVAL)
        .filter(|due| !step && *due > now)
}

/// One drain, from its first pass to its outcome.
struct Run {
    deps: Arc<Deps>,
    job: Job,
    progress: watch::Sender<Progress>,
    /// Pods this run has evicted or deleted, to count progress once each.
    evicted: Mutex<BTreeSet<String>>,
    /// Volumes whose detach wait timed out: warned about once, not waited
    /// for again (the reconciler's own volume step still guards the VM).
    abandoned: Mutex<BTreeSet<String>>,
}

async fn run(deps: Arc<Deps>, job: Job, progress: watch::Sender<Progress>) {
    let writer = tokio::spawn(write_status(
        deps.client.clone(),
        job.machine.clone(),
        progress.subscribe(),
    ));
    deps.metrics.drains_in_progress.inc();
    let started = std::time::Instant::now();
    let r = Run {
        deps: Arc::clone(&deps),
        job,
        progress,
        evicted: Mutex::new(BTreeSet::new()),
        abandoned: Mutex::new(BTreeSet::new()),
    };
    let outcome = r.passes().await;
    deps.metrics.drains_in_progress.dec();
    deps.metrics
        .record_drain(outcome.label(), started.elapsed());
    match &outcome {
        Outcome::Drained => r.event(
            EventType::Normal,
            "Drained",
            format!("Node {} drained", r.job.node),
            None,
        ),
        Outcome::Forced { pods } => r.event(
            EventType::Warning,
            "DrainForced",
            format!("drain deadline passed: force-deleted {}", pods.join(", ")),
            None,
        ),
        Outcome::Failed { message } => {
            r.event(EventType::Warning, "DrainFailed", message.clone(), None)
        }
    }
    tracing::info!(outcome = outcome.label(), took = ?started.elapsed(), "drain finished");
    r.progress.send_modify(|p| {
        p.outcome = Some(outcome.clone());
        p.finished_at = Some(Instant::now());
        p.finished_on = Some(Timestamp::now());
        p.current_pod = None;
        p.current_volume = None;
        p.waiting_for = None;
        if let Outcome::Failed { message } = &outcome {
            p.blocked_by = Some(message.clone());
        } else {
            p.blocked_by = None;
        }
    });
    // The writer flushes the final state on its own; the reconciler learns
    // the outcome from memory and does not wait for it.
    drop(r);
    drop(writer);
}

/// What a pass found and did.
enum Pass {
    /// Nothing was left to do.
    Done,
    /// Work was done; plan again.
    Again,
    /// The deadline passed.
    Deadline,
}

impl Run {
    fn now_instant_of(&self, deadline_left: Duration) -> Instant {
        Instant::now() + deadline_left
    }

    /// The deadline as a monotonic instant.
    fn deadline(&self) -> Instant {
        self.now_instant_of(self.job.deadline.remaining(Timestamp::now()))
    }

    /// A step's own bound, cut to the deadline.
    fn bounded(&self, step: Duration) -> Instant {
        self.now_instant_of(self.job.deadline.bound(Timestamp::now(), step))
    }

    fn expired(&self) -> bool {
        self.job.deadline.expired(Timestamp::now())
    }

    fn plan(&self) -> DrainPlan {
        let pods: Vec<Pod> = self
            .pods_on_node()
            .into_iter()
            .map(|p| (*p).clone())
            .collect();
        let (pvcs, pvs) = self.volume_objects(&pods, &[]);
        let pdbs = self.pdbs_for(&pods);
        let vas = self.attachments_of(&pvs);
        plan(
            &self.job.node,
            &pods,
            &pvcs,
            &pvs,
            &pdbs,
            &vas,
            &self.job.settings,
        )
    }

    fn pods_on_node(&self) -> Vec<Arc<Pod>> {
        self.deps
            .indexes
            .pods_by_node
            .get(&self.deps.pods, &self.job.node)
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
            for claim in crate::cache::claim_names(pod) {
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
    fn pdbs_for(&self, pods: &[Pod]) -> Vec<PodDisruptionBudget> {
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
    fn replacement_expected(&self, claim: &NamespacedName, evicted_uid: &str) -> bool {
        let users = self
            .deps
            .indexes
            .pods_by_claim
            .get(&self.deps.pods, &claim_key(&claim.0, &claim.1));
        replacement_expected(claim, users.iter().map(|p| &**p), evicted_uid)
    }

    fn update(&self, f: impl FnOnce(&mut Progress)) {
        self.progress.send_if_modified(|p| {
            let before = p.clone();
            f(p);
            *p != before
        });
    }

    /// A step of a volume migration completed: the change is written at
    /// once (see [`Progress::steps_done`]).
    fn step(&self, f: impl FnOnce(&mut Progress)) {
        self.progress.send_modify(|p| {
            f(p);
            p.steps_done += 1;
        });
    }

    /// Publishes an Event about the Machine. `related` (the pod or volume
    /// concerned) also keeps Events about different objects apart: the
    /// recorder folds Events with the same reason and related object into
    /// one series.
    fn event(
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

    async fn passes(&self) -> Outcome {
        loop {
            match self.pass().await {
                Pass::Done => return Outcome::Drained,
                Pass::Again => continue,
                Pass::Deadline => return self.at_deadline().await,
            }
        }
    }

    async fn pass(&self) -> Pass {
        if self.expired() {
            return Pass::Deadline;
        }
        let plan = self.plan();
        let leftover = self.volumes_still_detaching(&plan);
        let remaining = plan.stateless.len()
            + plan.stateful.len()
            + plan.terminating.len()
            + plan.to_delete.len();
        self.update(|p| {
            p.pods_remaining = u32::try_from(remaining).unwrap_or(u32::MAX);
            p.pods_total = p.pods_total.max(p.pods_evicted + p.pods_remaining);
        });
        if remaining == 0 && leftover.is_empty() {
            return Pass::Done;
        }
        tracing::info!(
            stateless = plan.stateless.len(),
            stateful = plan.stateful.len(),
            terminating = plan.terminating.len(),
            terminal = plan.to_delete.len(),
            detaching = leftover.len(),
            "drain pass"
        );

        for p in &plan.to_delete {
            if let Some(pod) = self.pod(&p.pod, p.uid.as_deref()) {
                match evict::delete(&self.deps.client, &pod, None).await {
                    Evicted::Accepted | Evicted::Gone => {
                        self.deps.metrics.record_eviction(EvictionResult::Deleted);
                        self.count_evicted(&p.pod);
                    }
                    other => {
                        tracing::warn!(pod = %fmt_key(&p.pod), result = ?other, "could not delete a finished pod")
                    }
                }
            }
        }

        // The futures are collected first: a lazy `map` closure inside a
        // spawned future trips the compiler's higher-ranked lifetime check.
        let evictions: Vec<_> = plan
            .stateless
            .iter()
            .map(|p| async move { (p, self.evict(p).await) })
            .collect();
        let migrations: Vec<_> = plan.stateful.iter().map(|p| self.migrate(p)).collect();
        let terminating: Vec<_> = plan
            .terminating
            .iter()
            .map(|t| self.wait_gone(&t.pod, t.uid.as_deref(), self.deadline()))
            .collect();
        // The bound is on eviction requests in flight; waiting for the
        // evicted pods to go costs nothing but a watch receiver each, so
        // every evicted pod is waited for at once. Evictions accepted
        // together are announced in one Event (see [`EVICTED_BATCH`]).
        let stateless = async {
            let mut results = futures::stream::iter(evictions)
                .buffer_unordered(self.job.settings.max_concurrent_evictions.max(1) as usize);
            let mut batch = Batch::default();
            let mut leaving = Vec::new();
            loop {
                let due = batch.due();
                tokio::select! {
                    next = results.next() => match next {
                        Some((p, Eviction::Accepted(pod))) => {
                            batch.push(pod, Instant::now());
                            leaving.push(p);
                        }
                        Some((p, Eviction::Gone)) => leaving.push(p),
                        Some((_, Eviction::Expired)) => {}
                        None => break,
                    },
                    _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                        self.announce_evicted(batch.take());
                    }
                }
            }
            self.announce_evicted(batch.take());
            let gone: Vec<_> = leaving
                .into_iter()
                .map(|p| self.wait_gone(&p.pod, p.uid.as_deref(), self.deadline()))
                .collect();
            futures::future::join_all(gone).await;
        };
        let stateful = async {
            // Stateful pods that were already terminating (evicted before a
            // restart, or by someone else) come first: their volumes must be
            // gone from this Node before the next stateful eviction.
            let going: Vec<_> = plan
                .terminating
                .iter()
                .filter(|t| !t.pvs.is_empty())
                .collect();
            for t in &going {
                self.update(|p| {
                    p.current_pod = Some(fmt_key(&t.pod));
                    p.waiting_for = Some(format!("pod {} to terminate", fmt_key(&t.pod)));
                });
                self.wait_gone(&t.pod, t.uid.as_deref(), self.deadline())
                    .await;
            }
            let leftover = if going.is_empty() {
                leftover
            } else {
                self.volumes_still_detaching(&plan)
            };
            if !leftover.is_empty() {
                self.wait_leftover(&leftover).await;
            }
            futures::stream::iter(migrations)
                .buffered(self.job.settings.max_parallel_volume_migrations.max(1) as usize)
                .collect::<Vec<()>>()
                .await;
        };
        let terminating = futures::future::join_all(terminating);
        // The stateful chain is the drain's critical path and the stateless
        // pods have slack: polled first, its eviction is sent ahead of theirs
        // when many drains start at once and every request queues.
        tokio::join!(stateful, stateless, terminating);
        if self.expired() {
            Pass::Deadline
        } else {
            Pass::Again
        }
    }

    fn pod(&self, key: &NamespacedName, uid: Option<&str>) -> Option<Arc<Pod>> {
        let pod = self.deps.pods.get(&ObjectRef::new(&key.1).within(&key.0))?;
        (uid.is_none() || pod.metadata.uid.as_deref() == uid).then_some(pod)
    }

    fn count_evicted(&self, key: &NamespacedName) {
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

    /// Volumes attached to this Node that no pod on it uses any more: pods
    /// that left (perhaps before a restart) and whose volumes are still
    /// detaching. No stateful pod is evicted before they are gone.
    fn volumes_still_detaching(&self, plan: &DrainPlan) -> Vec<(String, Option<String>)> {
        let pods: Vec<Pod> = self
            .pods_on_node()
            .into_iter()
            .map(|p| (*p).clone())
            .collect();
        let attached: Vec<String> = self
            .deps
            .indexes
            .attachments_by_node
            .get(&self.deps.attachments, &plan.node)
            .iter()
            .filter_map(|va| va.spec.source.persistent_volume_name.clone())
            .collect();
        let (pvcs, pvs) = self.volume_objects(&pods, &attached);
        let index = super::volume::VolumeIndex::new(&pvcs, &pvs);
        let in_use: BTreeSet<String> = pods
            .iter()
            .flat_map(|p| index.pod_volumes(p).refs.into_iter().map(|v| v.pv))
            .collect();
        let by_pv: BTreeMap<&str, &PersistentVolume> = pvs
            .iter()
            .filter_map(|pv| pv.metadata.name.as_deref().map(|n| (n, pv)))
            .collect();
        let abandoned = self.abandoned.lock().map(|a| a.clone()).unwrap_or_default();
        leftover_volumes(&attached, &in_use)
            .into_iter()
            .filter(|pv| !abandoned.contains(pv))
            .map(|pv| {
                let unique = by_pv
                    .get(pv.as_str())
                    .and_then(|p| crate::volumes::unique_name_of(p));
                (pv, unique)
            })
            .collect()
    }

    async fn wait_leftover(&self, leftover: &[(String, Option<String>)]) {
        let interest = leftover
            .iter()
            .fold(Interest::new(&self.job.node), |i, (pv, u)| {
                i.volume(pv.clone(), u.clone())
            });
        let names: Vec<&str> = leftover.iter().map(|(pv, _)| pv.as_str()).collect();
        self.update(|p| {
            p.current_volume = Some(names.join(", "));
            p.waiting_for = Some(format!(
                "volumes of pods that already left to detach from Node {}",
                self.job.node
            ));
        });
        let mut reg = self.deps.tracker.register(interest);
        let started = std::time::Instant::now();
        match reg
            .wait_detached(self.bounded(self.job.settings.volume_detach_timeout))
            .await
        {
            Ok(()) => {
                self.deps
                    .metrics
                    .volume_detach_wait
                    .observe(started.elapsed().as_secs_f64());
                self.event(
                    EventType::Normal,
                    "VolumeDetached",
                    format!("{} detached from Node {}", names.join(", "), self.job.node),
                    leftover.first().map(|(pv, _)| pv_ref(pv)),
                );
            }
            Err(e) => {
                self.abandon(leftover.iter().map(|(pv, _)| pv.clone()));
                self.warn_volume(
                    "VolumeDetachTimeout",
                    &e,
                    leftover.first().map(|(pv, _)| pv.as_str()),
                );
                return;
            }
        }
        // And attached where a pod still needs them.
        let needed: BTreeSet<String> = names
            .iter()
            .filter_map(|n| self.deps.pvs.get(&ObjectRef::new(n)))
            .filter_map(|pv| {
                let claim = pv.spec.as_ref()?.claim_ref.as_ref()?;
                let key = (claim.namespace.clone()?, claim.name.clone()?);
                self.replacement_expected(&key, "")
                    .then(|| pv.metadata.name.clone())?
            })
            .collect();
        if needed.is_empty() {
            return;
        }
        reg.retain_volumes(|pv| needed.contains(pv));
        let detached_at = std::time::Instant::now();
        match reg
            .wait_attached_elsewhere(self.bounded(self.job.settings.volume_reattach_timeout))
            .await
        {
            Ok(moved) => {
                self.deps
                    .metrics
                    .volume_reattach_wait
                    .observe(detached_at.elapsed().as_secs_f64());
                for (pv, node) in moved {
                    self.event(
                        EventType::Normal,
                        "VolumeAttached",
                        format!(
                            "{pv} attached on Node {node} (moved from {})",
                            self.job.node
                        ),
                        Some(pv_ref(&pv)),
                    );
                }
            }
            Err(e) => self.warn_volume(
                "VolumeReattachTimeout",
                &e,
                needed.first().map(String::as_str),
            ),
        }
    }

    fn abandon(&self, pvs: impl IntoIterator<Item = String>) {
        if let Ok(mut a) = self.abandoned.lock() {
            a.extend(pvs);
        }
    }

    /// A volume wait that ended without success. The Event's related
    /// object is the first volume waited for: kube's `Recorder` folds Events
    /// with the same reason and objects into one series whatever their
    /// notes, so two volumes' timeouts with none would show as one.
    fn warn_volume(&self, reason: &str, e: &WaitError, pv: Option<&str>) {
        tracing::warn!(reason, error = %e, "volume wait ended without success");
        self.event(EventType::Warning, reason, e.to_string(), pv.map(pv_ref));
    }

    /// Evicts one pod, retrying refusals, and says what became of it. The
    /// caller announces an accepted eviction (refusals are announced here).
    async fn evict(&self, planned: &PlannedPod) -> Eviction {
        let key = fmt_key(&planned.pod);
        let Some(pod) = self.pod(&planned.pod, planned.uid.as_deref()) else {
            return Eviction::Gone;
        };
        let mut backoff = evict_backoff();
        let mut refusals = 0u32;
        loop {
            if self.expired() {
                return Eviction::Expired;
            }
            let mut pdb_changes = self.deps.pdb_changes.clone();
            pdb_changes.borrow_and_update();
            let pause = match evict::evict(&self.deps.client, &pod).await {
                Evicted::Accepted => {
                    self.deps.metrics.record_eviction(EvictionResult::Evicted);
                    self.count_evicted(&planned.pod);
                    self.update(|p| {
                        if p.blocked_by.as_deref().is_some_and(|b| b.contains(&key)) {
                            p.blocked_by = None;
                        }
                    });
                    return Eviction::Accepted(pod_ref(&pod));
                }
                Evicted::Gone => return Eviction::Gone,
                Evicted::Refused { message } => {
                    refusals += 1;
                    let pdbs = self.pdbs_for(std::slice::from_ref(&*pod));
                    let findings = super::pdb::findings_for(&pod, &pdbs);
                    let misconfigured = findings
                        .iter()
                        .find(|f| f.verdict == PdbVerdict::Misconfigured);
                    let blocking = misconfigured
                        .or_else(|| findings.iter().find(|f| f.verdict != PdbVerdict::Allows))
                        .map(|f| f.description.clone())
                        .unwrap_or_else(|| message.clone());
                    let stuck =
                        misconfigured.is_some() || refusals >= self.job.settings.max_evict_retries;
                    self.deps
                        .metrics
                        .record_eviction(if misconfigured.is_some() {
                            EvictionResult::MisconfiguredPdb
                        } else {
                            EvictionResult::PdbBlocked
                        });
                    let why = if misconfigured.is_some() {
                        format!(
                            "pod {key}: misconfigured PodDisruptionBudget, eviction can never succeed: {blocking}"
                        )
                    } else if stuck {
                        format!("pod {key}: eviction refused {refusals} times: {blocking}")
                    } else {
                        format!("pod {key}: eviction refused: {blocking}")
                    };
                    if (stuck && refusals == self.job.settings.max_evict_retries.max(1))
                        || (misconfigured.is_some() && refusals == 1)
                    {
                        self.event(
                            EventType::Warning,
                            "EvictionBlocked",
                            why.clone(),
                            Some(pod_ref(&pod)),
                        );
                    }
                    self.update(|p| p.blocked_by = Some(why));
                    if stuck {
                        MAX_EVICT_BACKOFF
                    } else {
                        backoff.next().unwrap_or(MAX_EVICT_BACKOFF)
                    }
                }
                Evicted::Failed(e) => {
                    self.deps.metrics.record_eviction(EvictionResult::Error);
                    tracing::warn!(pod = %key, error = %e, "eviction failed");
                    backoff.next().unwrap_or(MAX_EVICT_BACKOFF)
                }
            };
            // Retry after the pause, or as soon as a PodDisruptionBudget
            // changes, or give up at the deadline.
            let until = Instant::now() + pause;
            tokio::select! {
                _ = tokio::time::sleep_until(until.min(self.deadline())) => {}
                _ = pdb_changes.changed() => {}
            }
            if self.pod(&planned.pod, planned.uid.as_deref()).is_none() {
                return Eviction::Gone;
            }
        }
    }

    /// One Event for pods evicted together: the pod's own `Evicted` Event
    /// when there is one, else one that names them all.
    fn announce_evicted(&self, mut batch: Vec<ObjectReference>) {
        match batch.len() {
            0 => {}
            1 => {
                let pod = batch.pop();
                let key = pod.as_ref().map(ref_key).unwrap_or_default();
                self.event(
                    EventType::Normal,
                    "Evicted",
                    format!("evicted pod {key}"),
                    pod,
                );
            }
            _ => {
                // The first pod is the related object: it says which batch
                // this is, and kube's `Recorder` (which folds Events by
                // reason and objects, not by note) would otherwise take a
                // second batch for a repeat of the first and drop its names.
                let names: Vec<String> = batch.iter().map(ref_key).collect();
                let first = batch.into_iter().next();
                self.event(EventType::Normal, "Evicted", evicted_note(&names), first);
            }
        }
    }

    /// Waits until the pod (this UID) is gone from the cache, woken by pod
    /// events; false if `until` passed first.
    async fn wait_gone(&self, key: &NamespacedName, uid: Option<&str>, until: Instant) -> bool {
        self.wait_pods_until(until, || self.pod(key, uid).is_none())
            .await
    }

    /// Waits until `done` holds over the pod cache, checked after every pod
    /// event, or `until`. Returns whether it held.
    async fn wait_pods_until(&self, until: Instant, done: impl Fn() -> bool) -> bool {
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

    /// Moves one stateful pod: register → evict → gone → detached →
    /// attached elsewhere.
    async fn migrate(&self, planned: &PlannedPod) {
        let key = fmt_key(&planned.pod);
        let detach: Vec<_> = planned
            .volumes
            .iter()
            .filter(|v| v.wait.waits_for_detach())
            .collect();
        let interest = detach.iter().fold(Interest::new(&self.job.node), |i, v| {
            i.volume(v.volume.pv.clone(), v.volume.csi_unique_name.clone())
        });
        let pvs: Vec<String> = detach.iter().map(|v| v.volume.pv.clone()).collect();
        // Registered before the eviction: no event can slip between them.
        let mut reg = self.deps.tracker.register(interest);
        let span = tracing::info_span!("migrate", pod = %key, pvs = %pvs.join(","));
        async {
            self.update(|p| {
                p.current_pod = Some(key.clone());
                p.current_volume = (!pvs.is_empty()).then(|| pvs.join(", "));
                p.waiting_for = Some(format!("eviction of {key}"));
            });
            match self.evict(planned).await {
                Eviction::Expired => return,
                Eviction::Accepted(pod) => self.announce_evicted(vec![pod]),
                Eviction::Gone => {}
            }
            self.step(|p| p.waiting_for = Some(format!("pod {key} to terminate")));
            let evicted_at = std::time::Instant::now();
            if !self.wait_gone(&planned.pod, planned.uid.as_deref(), self.bounded(planned.bounds.pod_gone)).await {
                self.event(
                    EventType::Warning,
                    "PodTerminationSlow",
                    format!("pod {key} is still terminating after its grace period and slack; waiting until the drain deadline"), Some(pod_ref_key(&planned.pod))
                );
                if !self.wait_gone(&planned.pod, planned.uid.as_deref(), self.deadline()).await {
                    return;
                }
            }
            if pvs.is_empty() {
                return;
            }
            self.step(|p| p.waiting_for = Some(format!("{} to detach from Node {}", pvs.join(", "), self.job.node)));
            let detach_bound = planned.bounds.detach.unwrap_or(self.job.settings.volume_detach_timeout);
            match reg.wait_detached(self.bounded(detach_bound)).await {
                Ok(()) => {
                    let took = evicted_at.elapsed();
                    self.deps.metrics.volume_detach_wait.observe(took.as_secs_f64());
                    self.event(
                        EventType::Normal,
                        "VolumeDetached",
                        format!("{} detached from Node {} {:.1}s after pod {key} was evicted", pvs.join(", "), self.job.node, took.as_secs_f64()), pvs.first().map(|pv| pv_ref(pv))
                    );
                }
                Err(e) => {
                    self.abandon(pvs.iter().cloned());
                    self.warn_volume("VolumeDetachTimeout", &e, pvs.first().map(String::as_str));
                    return;
                }
            }
            // Reattach: only for claims some pod still needs. A pod with a
            // controller gets a replacement, but the controller may not have
            // created it yet (a busy kube-controller-manager takes seconds):
            // wait for it, on pod events, before concluding none is coming.
            let uid = planned.uid.clone().unwrap_or_default();
            let reattach: Vec<&PlannedVolume> = planned
                .volumes
                .iter()
                .filter(|v| matches!(v.wait, VolumeWait::Detach { reattach: true, .. }))
                .collect();
            let missing = |v: &&PlannedVolume| !self.replacement_expected(&v.volume.claim, &uid);
            let replacement_wait = REPLACEMENT_WAIT.min(self.job.settings.volume_reattach_timeout);
            if let Some(controller) = &planned.controller
                && reattach.iter().any(missing)
            {
                self.update(|p| p.waiting_for = Some(format!("{controller} to create the replacement of pod {key}")));
                self.wait_pods_until(self.bounded(replacement_wait), || !reattach.iter().any(missing)).await;
            }
            let (expected, orphaned): (Vec<_>, Vec<_>) =
                reattach.into_iter().partition(|v| !missing(v));
            for v in &orphaned {
                let why = match &planned.controller {
                    Some(c) => format!("{c} created no pod for it within {}s (scaled down?)", replacement_wait.as_secs()),
                    None => "scaled down?".to_string(),
                };
                self.event(
                    EventType::Normal,
                    "NoReplacement",
                    format!(
                        "no pod references claim {} any more ({why}): not waiting for {} to attach elsewhere",
                        fmt_key(&v.volume.claim),
                        v.volume.pv
                    ), Some(pv_ref(&v.volume.pv))
                );
            }
            if expected.is_empty() {
                return;
            }
            let keep: BTreeSet<&str> = expected.iter().map(|v| v.volume.pv.as_str()).collect();
            reg.retain_volumes(|pv| keep.contains(pv));
            let names: Vec<&str> = keep.iter().copied().collect();
            self.step(|p| p.waiting_for = Some(format!("{} to attach on another Node", names.join(", "))));
            let detached_at = std::time::Instant::now();
            match reg.wait_attached_elsewhere(self.bounded(self.job.settings.volume_reattach_timeout)).await {
                Ok(moved) => {
                    self.deps.metrics.volume_reattach_wait.observe(detached_at.elapsed().as_secs_f64());
                    for (pv, node) in moved {
                        self.event(
                            EventType::Normal,
                            "VolumeAttached",
                            format!("{pv} attached on Node {node} after {:.1}s (moved from {})", detached_at.elapsed().as_secs_f64(), self.job.node), Some(pv_ref(&pv))
                        );
                    }
                }
                Err(e) => self.warn_volume("VolumeReattachTimeout", &e, names.first().copied()),
            }
        }
        .instrument(span)
        .await;
        self.update(|p| {
            if p.current_pod.as_deref() == Some(key.as_str()) {
                p.current_pod = None;
                p.current_volume = None;
                p.waiting_for = None;
            }
        });
    }

    /// The deadline passed: force what is left, or fail saying what.
    async fn at_deadline(&self) -> Outcome {
        let plan = self.plan();
        let left: Vec<(NamespacedName, Option<String>, String)> = plan
            .stateless
            .iter()
            .chain(plan.stateful.iter())
            .map(|p| {
                let why = p
                    .pdbs
                    .iter()
                    .find(|f| f.verdict != PdbVerdict::Allows)
                    .map(|f| f.description.clone())
                    .unwrap_or_else(|| "not evicted in time".into());
                (p.pod.clone(), p.uid.clone(), why)
            })
            .chain(
                plan.terminating
                    .iter()
                    .map(|t| (t.pod.clone(), t.uid.clone(), "still terminating".into())),
            )
            .chain(plan.to_delete.iter().map(|t| {
                (
                    t.pod.clone(),
                    t.uid.clone(),
                    "finished, not yet deleted".into(),
                )
            }))
            .collect();
        if left.is_empty() {
            return Outcome::Drained;
        }
        if !self.job.settings.force_after_deadline {
            // No forcing: one more polite attempt per pod (a budget may have
            // been relaxed since), then fail with what is left. The
            // reconciler runs the drain again later.
            let mut still = Vec::new();
            for (k, uid, why) in left {
                let terminating = plan.terminating.iter().any(|t| t.pod == k);
                let Some(pod) = self.pod(&k, uid.as_deref()) else {
                    continue;
                };
                let leaving = terminating
                    || match evict::evict(&self.deps.client, &pod).await {
                        Evicted::Accepted | Evicted::Gone => {
                            self.deps.metrics.record_eviction(EvictionResult::Evicted);
                            self.count_evicted(&k);
                            true
                        }
                        _ => false,
                    };
                // A pod on its way out gets its grace period to finish.
                let bound = super::deadline::pod_gone_bound(super::deadline::grace_period(&pod));
                let gone = leaving
                    && self
                        .wait_gone(&k, uid.as_deref(), Instant::now() + bound)
                        .await;
                if !gone {
                    still.push((k, uid, why));
                }
            }
            let left = still;
            if left.is_empty() {
                return Outcome::Drained;
            }
            let list: Vec<String> = left
                .iter()
                .map(|(k, _, why)| format!("{} ({why})", fmt_key(k)))
                .collect();
            return Outcome::Failed {
                message: format!(
                    "drain deadline of {} passed with {} pods left and forceAfterDeadline=false: {}",
                    humantime::format_duration(self.job.deadline.timeout),
                    left.len(),
                    list.join(", ")
                ),
            };
        }
        let mut forced = Vec::new();
        for (k, uid, _) in &left {
            if let Some(pod) = self.pod(k, uid.as_deref()) {
                match evict::delete(&self.deps.client, &pod, Some(0)).await {
                    Evicted::Accepted | Evicted::Gone => {
                        self.deps.metrics.record_eviction(EvictionResult::Forced);
                        self.count_evicted(k);
                        forced.push(fmt_key(k));
                    }
                    other => {
                        tracing::warn!(pod = %fmt_key(k), result = ?other, "force delete failed")
                    }
                }
            }
        }
        Outcome::Forced { pods: forced }
    }
}

/// What became of one pod's eviction.
#[derive(Debug)]
enum Eviction {
    /// The API server accepted it (perhaps after refusals).
    Accepted(ObjectReference),
    /// The pod was gone already, or replaced by one of the same name.
    Gone,
    /// The drain's deadline passed first.
    Expired,
}

/// Evictions of pods without volumes accepted within this long of one
/// another share one Event. A pod per Event put 200 Events into the API
/// server's busiest second when 20 drains started together in the scale
/// benchmark, and gives a Machine with 100 pods 100 one-line Events; the
/// log still names each pod, and an eviction refused by a
/// PodDisruptionBudget still gets an Event of its own.
const EVICTED_BATCH: Duration = Duration::from_secs(1);

/// Pods evicted and not yet announced, and when the oldest was.
#[derive(Debug, Default)]
struct Batch {
    pods: Vec<ObjectReference>,
    since: Option<Instant>,
}

impl Batch {
    fn push(&mut self, pod: ObjectReference, now: Instant) {
        self.since.get_or_insert(now);
        self.pods.push(pod);
    }

    /// When the batch must be announced: [`EVICTED_BATCH`] after its
    /// oldest pod; `None` while empty.
    fn due(&self) -> Option<Instant> {
        self.since.map(|s| s + EVICTED_BATCH)
    }

    fn take(&mut self) -> Vec<ObjectReference> {
        self.since = None;
        std::mem::take(&mut self.pods)
    }
}

/// An Event's note may hold 1 kB; the names past this many characters are
/// counted instead.
const NOTE_NAMES_CHARS: usize = 800;

/// The note of one Event for several evicted pods: how many, then their
/// `namespace/name`s, as many as fit in [`NOTE_NAMES_CHARS`].
pub fn evicted_note(names: &[String]) -> String {
    let mut listed = String::new();
    let mut shown = 0;
    for name in names {
        let sep = if shown == 0 { "" } else { ", " };
        if listed.len() + sep.len() + name.len() > NOTE_NAMES_CHARS {
            break;
        }
        listed.push_str(sep);
        listed.push_str(name);
        shown += 1;
    }
    let more = names.len() - shown;
    let tail = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    format!(
        "evicted {} pods without persistent volumes: {listed}{tail}",
        names.len()
    )
}

fn ref_key(r: &ObjectReference) -> String {
    fmt_key(&(
        r.namespace.clone().unwrap_or_default(),
        r.name.clone().unwrap_or_default(),
    ))
}

fn pod_ref(pod: &Pod) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: pod.metadata.namespace.clone(),
        name: pod.metadata.name.clone(),
        uid: pod.metadata.uid.clone(),
        ..Default::default()
    }
}

fn pod_ref_key(key: &NamespacedName) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(key.0.clone()),
        name: Some(key.1.clone()),
        ..Default::default()
    }
}

fn pv_ref(pv: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolume".into()),
        name: Some(pv.to_string()),
        ..Default::default()
    }
}

/// PVs attached to the Node that no pod on it uses any more, each once.
pub fn leftover_volumes(attached: &[String], in_use: &BTreeSet<String>) -> Vec<String> {
    let mut out: Vec<String> = attached
        .iter()
        .filter(|pv| !in_use.contains(*pv))
        .cloned()
        .collect();
    out.sort();
    out.dedup();
    out
}

fn evict_backoff() -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(MAX_EVICT_BACKOFF)
        .with_jitter()
        .without_max_times()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_waits_for_the_interval_but_a_step_does_not() {
        let t0 = Instant::now();
        let soon = t0 + Duration::from_millis(300);
        // Nothing written yet: write now.
        assert_eq!(hold_until(None, false, t0), None);
        // A count changed 300 ms after a write: held until a second after it.
        assert_eq!(
            hold_until(Some(t0), false, soon),
            Some(t0 + STATUS_WRITE_INTERVAL)
        );
        // A step (pod gone, volume detached) goes out at once.
        assert_eq!(hold_until(Some(t0), true, soon), None);
        // Past the interval nothing is held.
        assert_eq!(
            hold_until(Some(t0), false, t0 + STATUS_WRITE_INTERVAL),
            None
        );
    }

    #[test]
    fn evictions_are_announced_a_batch_at_a_time() {
        let now = Instant::now();
        let pod = |name: &str| ObjectReference {
            namespace: Some("web".into()),
            name: Some(name.into()),
            ..Default::default()
        };
        let mut batch = Batch::default();
        assert_eq!(batch.due(), None, "nothing to announce");
        batch.push(pod("a"), now);
        batch.push(pod("b"), now + Duration::from_millis(700));
        assert_eq!(
            batch.due(),
            Some(now + EVICTED_BATCH),
            "due after the oldest"
        );
        let taken: Vec<String> = batch.take().iter().map(ref_key).collect();
        assert_eq!(taken, ["web/a", "web/b"]);
        assert_eq!(batch.due(), None);
        batch.push(pod("c"), now + Duration::from_secs(5));
        assert_eq!(
            batch.due(),
            Some(now + Duration::from_secs(5) + EVICTED_BATCH)
        );
    }

    #[test]
    fn one_event_names_the_pods_evicted_together_within_an_events_size() {
        let few = ["web/a".to_string(), "web/b".to_string()];
        assert_eq!(
            evicted_note(&few),
            "evicted 2 pods without persistent volumes: web/a, web/b"
        );
        let many: Vec<String> = (0..200).map(|i| format!("web/frontend-{i:03}")).collect();
        let note = evicted_note(&many);
        assert!(
            note.starts_with("evicted 200 pods without persistent volumes: web/frontend-000, ")
        );
        assert!(
            note.len() <= 1024,
            "an Event note holds 1 kB: {}",
            note.len()
        );
        let shown = note.matches("web/frontend-").count();
        assert!(
            note.ends_with(&format!(" and {} more", 200 - shown)),
            "{note}"
        );
    }

    #[test]
    fn leftover_volumes_are_those_no_pod_uses() {
        let attached = vec![
            "pv-b".to_string(),
            "pv-a".into(),
            "pv-b".into(),
            "pv-c".into(),
        ];
        let in_use: BTreeSet<String> = ["pv-c".to_string()].into();
        assert_eq!(leftover_volumes(&attached, &in_use), vec!["pv-a", "pv-b"]);
        assert!(leftover_volumes(&[], &in_use).is_empty());
    }

    #[test]
    fn progress_patch_names_the_fields_of_the_drain_status() {
        let p = Progress {
            pods_total: 9,
            pods_evicted: 4,
            pods_remaining: 5,
            current_pod: Some("db/pg-0".into()),
            current_volume: Some("pv-0".into()),
            waiting_for: Some("pv-0 to detach".into()),
            blocked_by: None,
            outcome: None,
            finished_at: None,
            finished_on: Some(Timestamp::from_second(1_700_000_000).expect("valid")),
            steps_done: 3,
        };
        let patch = p.status_patch();
        let d = &patch["status"]["drain"];
        assert_eq!(d["progress"], "4/9");
        assert_eq!(d["currentPod"], "db/pg-0");
        assert!(
            d["blockedBy"].is_null(),
            "a cleared block is removed by the merge patch"
        );
        let parsed: crate::api::DrainStatus =
            serde_json::from_value(d.clone()).expect("the API type reads it");
        assert_eq!(parsed.pods_remaining, 5);
        assert_eq!(d["finishedAt"], "2023-11-14T22:13:20.000000Z");
        // The step count only paces the writer; it is not status.
        assert!(d.get("stepsDone").is_none() && d.get("steps_done").is_none());
    }

    #[test]
    fn outcomes_have_metric_labels() {
        assert_eq!(Outcome::Drained.label(), "drained");
        assert_eq!(Outcome::Forced { pods: vec![] }.label(), "forced");
        assert_eq!(
            Outcome::Failed {
                message: String::new()
            }
            .label(),
            "failed"
        );
    }
}
