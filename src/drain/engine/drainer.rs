//! The registry of running drains: one task per draining Machine, started,
//! restarted, forgotten and stopped here. What a drain does is in
//! [`pass`](super::pass); this module only decides whether one runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::runtime::reflector::ObjectRef;
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use super::reports::Memory;
use super::run::run;
use super::{Deps, Job, Outcome, Progress};
use crate::api::Machine;

/// How long after a failed drain the reconciler may start it again.
pub(crate) const RETRY_FAILED_AFTER: Duration = Duration::from_secs(30);

/// How long after a drain that ended (drained or forced) it may start
/// again for pods that came back: pods that keep coming back cost one
/// drain each this often, never a loop on the API server.
pub(crate) const RESTART_ENDED_AFTER: Duration = Duration::from_secs(5);

pub(super) struct Running {
    pub(super) progress: watch::Receiver<Progress>,
    /// The Machine as the drain's last `status.drain` write returned it.
    written: watch::Receiver<Option<Machine>>,
    /// The Machine's permission to lose node-local data, as last seen.
    data_loss_allowed: watch::Sender<bool>,
    /// What its runs reported and judged, passed on to the next run.
    memory: Arc<Mutex<Memory>>,
    task: tokio::task::JoinHandle<()>,
}

/// The drains of this replica, by Machine. Public only because the
/// reconciler's `Context` holds it in a public field.
pub struct Drainer {
    pub(super) deps: Arc<Deps>,
    pub(super) running: Mutex<HashMap<ObjectRef<Machine>, Running>>,
    /// Wakes the reconciler of a Machine whose drain finished.
    done: mpsc::UnboundedSender<ObjectRef<Machine>>,
    /// Bumped when a drain ends: the moves it leaves in flight are the
    /// keeper's (see [`keeper`](super::keeper)).
    pub(super) drains_ended: Arc<watch::Sender<u64>>,
    /// The Machines (`namespace/name`) whose pods a forced deletion is
    /// deleting now: their permits are not judged before the pods go.
    pub(super) forcing: Mutex<std::collections::BTreeSet<String>>,
}

/// A forced deletion under way (see [`Drainer::forcing`]); dropped when
/// its deletes are sent, or it failed.
pub(crate) struct Forcing<'d> {
    drainer: &'d Drainer,
    machine: String,
}

impl Drop for Forcing<'_> {
    fn drop(&mut self) {
        if let Ok(mut f) = self.drainer.forcing.lock() {
            f.remove(&self.machine);
        }
        self.drainer.drains_ended.send_modify(|n| *n += 1);
    }
}

impl Drainer {
    /// A drainer and the stream of Machines whose drain finished (feed it to
    /// the controller's `reconcile_on`).
    pub(crate) fn new(deps: Deps) -> (Self, mpsc::UnboundedReceiver<ObjectRef<Machine>>) {
        let (done, finished) = mpsc::unbounded_channel();
        let drainer = Self {
            deps: Arc::new(deps),
            running: Mutex::new(HashMap::new()),
            done,
            drains_ended: Arc::new(watch::channel(0).0),
            forcing: Mutex::default(),
        };
        (drainer, finished)
    }

    /// The progress of `job`'s drain, starting it if it is not running: the
    /// first time, after a controller restart, or when it failed at least
    /// [`RETRY_FAILED_AFTER`] ago. A drain that ended is started again
    /// only when `pods_left` says pods came back, and no sooner than
    /// [`RESTART_ENDED_AFTER`] after it ended.
    pub(crate) fn ensure(&self, job: Job, pods_left: bool) -> Progress {
        let Ok(mut running) = self.running.lock() else {
            return Progress::default();
        };
        // A reconcile that read its Machine just before it left the cache
        // (its finalizer removed by hand) starts nothing: the Machine
        // leaves the cache before `stop_vanished` runs, and this is read
        // under the same lock, so no drain of a Machine gone is left.
        if self.deps.caches.machines.get(&job.machine).is_none() {
            return running
                .get(&job.machine)
                .map(|r| r.progress.borrow().clone())
                .unwrap_or_default();
        }
        if let Some(r) = running.get(&job.machine) {
            r.data_loss_allowed.send_if_modified(|a| {
                let changed = *a != job.data_loss_allowed;
                *a = job.data_loss_allowed;
                changed
            });
            let p = r.progress.borrow().clone();
            let restart = match (&p.outcome, p.finished_at) {
                (None, _) => false,
                (Some(Outcome::Failed { .. }), Some(at)) => at.elapsed() >= RETRY_FAILED_AFTER,
                (Some(_), Some(at)) => pods_left && at.elapsed() >= RESTART_ENDED_AFTER,
                (Some(_), None) => pods_left,
            };
            if !restart {
                return p;
            }
        }
        // Before the first drain of this process asks for a permit: the
        // moves in flight every Machine recorded (a restart, a new leader).
        let machines = self.deps.caches.machines.state();
        self.deps
            .permits
            .rebuild_once(machines.iter().map(|m| &**m));
        let memory = running
            .get(&job.machine)
            .map_or_else(Arc::default, |r| Arc::clone(&r.memory));
        let (tx, rx) = watch::channel(Progress::default());
        let (written_tx, written) = watch::channel(None);
        let (allowed_tx, allowed) = watch::channel(job.data_loss_allowed);
        let key = job.machine.clone();
        let deps = Arc::clone(&self.deps);
        let done = self.done.clone();
        let span = tracing::info_span!(
            "drain",
            machine = %job.machine.name,
            namespace = job.machine.namespace.as_deref().unwrap_or(""),
            node = %job.node
        );
        let kept = Arc::clone(&memory);
        let ended = Arc::clone(&self.drains_ended);
        let task = tokio::spawn(
            async move {
                let key = job.machine.clone();
                run(deps, job, tx, written_tx, allowed, kept, done.clone()).await;
                ended.send_modify(|n| *n += 1);
                let _ = done.send(key);
            }
            .instrument(span),
        );
        let progress = rx.borrow().clone();
        if let Some(old) = running.insert(
            key,
            Running {
                progress: rx,
                written,
                data_loss_allowed: allowed_tx,
                memory,
                task,
            },
        ) {
            old.task.abort();
        }
        progress
    }

    /// Marks Machine `machine` as being forced until the guard is dropped:
    /// the moves it asked for are judged only once its pods' deletions are
    /// sent (before, their pods still there would read as moves that never
    /// began).
    pub(crate) fn forcing(&self, machine: &ObjectRef<Machine>) -> Forcing<'_> {
        let key = format!(
            "{}/{}",
            machine.namespace.as_deref().unwrap_or_default(),
            machine.name
        );
        if let Ok(mut f) = self.forcing.lock() {
            f.insert(key.clone());
        }
        Forcing {
            drainer: self,
            machine: key,
        }
    }

    /// Changes whenever a move permit frees (here or, as the line says,
    /// in another process).
    pub(crate) fn permits_freed(&self) -> tokio::sync::watch::Receiver<u64> {
        self.deps.permits.freed()
    }

    /// Asks for a reconcile of `machine` (through the same trigger stream
    /// as finished drains).
    pub(crate) fn wake(&self, machine: ObjectRef<Machine>) {
        let _ = self.done.send(machine);
    }

    /// The Machine as its drain's last write of `status.drain` returned it:
    /// the version a status write of the reconciler's that this write made
    /// conflict can be made again on (see [`crate::machine::write`]).
    pub(crate) fn last_written(&self, machine: &ObjectRef<Machine>) -> Option<Machine> {
        let running = self.running.lock().ok()?;
        running.get(machine)?.written.borrow().clone()
    }

    /// Whether a drain of this Machine was started here (running or
    /// ended).
    pub(crate) fn knows(&self, machine: &ObjectRef<Machine>) -> bool {
        self.running
            .lock()
            .is_ok_and(|running| running.contains_key(machine))
    }

    /// The progress of this Machine's drain, if one ran here.
    pub(crate) fn progress(&self, machine: &ObjectRef<Machine>) -> Option<Progress> {
        let running = self.running.lock().ok()?;
        Some(running.get(machine)?.progress.borrow().clone())
    }

    /// Whether a drain of this Machine judged `pod` to have come back after
    /// the cordon: it ends with the VM and holds nothing.
    pub(crate) fn returned(
        &self,
        machine: &ObjectRef<Machine>,
        pod: &k8s_openapi::api::core::v1::Pod,
    ) -> bool {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return false;
        };
        self.running.lock().is_ok_and(|running| {
            running
                .get(machine)
                .is_some_and(|r| r.memory.lock().is_ok_and(|m| m.returned.contains(uid)))
        })
    }

    /// Whether this Machine's drain ran here and ended drained or forced.
    /// After a restart nothing has run yet, so the drain runs again: it
    /// finds the pods gone and only waits for volumes still detaching.
    pub(crate) fn finished(&self, machine: &ObjectRef<Machine>) -> bool {
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
    pub(crate) fn forget(&self, machine: &ObjectRef<Machine>) {
        if let Ok(mut running) = self.running.lock()
            && let Some(r) = running.remove(machine)
        {
            r.task.abort();
        }
        // Its moves that never began, or whose workload is whole again,
        // end with it; the others keep their permits until their workload
        // is whole (see `Permits::release_done` in the ledger, and the
        // keeper).
        let key = format!(
            "{}/{}",
            machine.namespace.as_deref().unwrap_or_default(),
            machine.name
        );
        let caches = &self.deps.caches;
        self.deps
            .permits
            .release_done(&key, |w, p| super::permits::move_done(caches, w, p));
    }

    /// Stops the drains of Machines that left the cache (their finalizer
    /// removed by hand, or deleted while this process was away): nothing
    /// of theirs is written any more. Their moves keep their permits until
    /// their workload is whole.
    pub(crate) fn stop_vanished(&self) {
        let Ok(mut running) = self.running.lock() else {
            return;
        };
        let machines = &self.deps.caches.machines;
        running.retain(|key, r| {
            let exists = machines.get(key).is_some();
            if !exists {
                tracing::info!(machine = %key.name, namespace = key.namespace.as_deref().unwrap_or(""), "the Machine is gone: its drain stops");
                r.task.abort();
            }
            exists
        });
    }

    /// Stops every drain (shutdown or lost leadership). Every step resumes
    /// from the cluster's state in the next leader.
    pub(crate) fn stop_all(&self) {
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
