//! A drain's progress and the task that writes it to `status.drain`.
//!
//! This writer is the only writer of `status.drain`: it applies the whole
//! field with server-side apply under its own field manager
//! ([`FIELD_MANAGER`]), so a field it leaves out (a cleared block, a pod no
//! longer waited on) is removed, and no other writer's cached copy of the
//! Machine can undo its progress. It writes `startedAt` itself, from the
//! drain's deadline (the Machine's `deletionTimestamp`).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource};
use tokio::sync::watch;
use tokio::time::Instant;

use super::Outcome;
use crate::api::{DrainStatus, Machine, VolumeMove};

/// Shortest time between two writes of a drain's progress, unless its
/// volume moves' records changed (see [`Progress::moves`]).
const STATUS_WRITE_INTERVAL: Duration = Duration::from_secs(1);

/// The field manager that owns `status.drain`.
const FIELD_MANAGER: &str = "berth-drain";

/// A drain's progress, mirrored into `Machine.status.drain`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Progress {
    pub(crate) pods_total: u32,
    pub(crate) pods_evicted: u32,
    pub(crate) pods_remaining: u32,
    pub(crate) current_pod: Option<String>,
    pub(crate) current_volume: Option<String>,
    pub(crate) waiting_for: Option<String>,
    pub(crate) blocked_by: Option<String>,
    /// What the stateful pods that wait for a move permit wait for.
    pub(crate) waiting_for_budget: Option<String>,
    /// The pod (`namespace/name`) `blocked_by` is about, if one: the
    /// block is cleared when that pod, and no other, is evicted.
    pub(crate) blocked_pod: Option<String>,
    /// Whether the block is a finalizer holding a pod being deleted (not
    /// a refused eviction).
    pub(crate) held: bool,
    pub(crate) outcome: Option<Outcome>,
    /// When the outcome was reached.
    pub(crate) finished_at: Option<Instant>,
    /// The same moment on the wall clock, for `status.drain.finishedAt`.
    pub(crate) finished_on: Option<Timestamp>,
    /// Steps of volume migrations completed so far (a stateful pod
    /// evicted, gone, its volumes detached): the drain's progress after
    /// its deadline, and what a wait for a write (see [`Flushed`]) counts.
    /// Not written itself, and written at the writer's pace like every
    /// field but [`Self::moves`]: with many drains at once, a write per
    /// step of every move took the shared rate limit's tokens from the
    /// moves' own requests (the permit, the eviction).
    pub(crate) steps_done: u64,
    /// Volume moves in flight, by pod (`namespace/name`): written to
    /// `status.drain.moves`, so that a restart resumes them.
    pub(crate) moves: BTreeMap<String, VolumeMove>,
    /// Node-local PVs whose pods were evicted (`PV <name> (pod <ns/name>)`),
    /// for the `NodeLocalVolumes` condition: their data is lost with the VM.
    pub(crate) node_local_lost: Vec<String>,
    /// Why a pod with node-local volumes is held (`nodeLocalVolumes:
    /// Block`), for the `NodeLocalVolumes` condition.
    pub(crate) local_held: Option<String>,
}

impl Progress {
    /// Records that pod `key`'s eviction is blocked, and why.
    pub(crate) fn block(&mut self, key: &str, why: String) {
        self.blocked_by = Some(why);
        self.blocked_pod = Some(key.to_string());
        self.held = false;
    }

    /// Records that a finalizer holds pod `key`, being deleted, and what
    /// the drain does about it.
    pub(crate) fn hold(&mut self, key: &str, why: String) {
        self.block(key, why);
        self.held = true;
    }

    /// Clears the block if it is about pod `key`.
    pub(crate) fn unblock(&mut self, key: &str) {
        if self.blocked_pod.as_deref() == Some(key) {
            self.blocked_by = None;
            self.blocked_pod = None;
            self.held = false;
        }
    }

    /// `status.drain` as this progress records it, for a drain that
    /// started at `started`.
    fn drain_status(&self, started: Timestamp) -> DrainStatus {
        let done = self.pods_total.saturating_sub(self.pods_remaining);
        DrainStatus {
            started_at: Some(Time(started)),
            pods_total: self.pods_total,
            pods_evicted: self.pods_evicted,
            pods_remaining: self.pods_remaining,
            progress: Some(format!("{done}/{}", self.pods_total)),
            current_pod: self.current_pod.clone(),
            current_volume: self.current_volume.clone(),
            waiting_for: self.waiting_for.clone(),
            blocked_by: self.blocked_by.clone(),
            waiting_for_budget: self.waiting_for_budget.clone(),
            finished_at: self.finished_on.map(MicroTime),
            moves: self.moves.values().cloned().collect(),
        }
    }

    /// The server-side apply body that sets `status.drain` of the Machine
    /// `name` and nothing else. A field left out (`None`) is removed by the
    /// apply, since this writer owned it.
    fn status_patch(&self, name: &str, started: Timestamp) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": Machine::api_version(&()),
            "kind": Machine::kind(&()),
            "metadata": {"name": name},
            "status": {"drain": self.drain_status(started)},
        })
    }
}

/// What the status writer has written: the `steps_done` of its last
/// write that landed, and the error of the last one that did not, if the
/// latest attempt failed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Flushed {
    pub(crate) steps: u64,
    pub(crate) error: Option<String>,
}

/// The drain's side of its progress: every change goes through here to
/// the writer, and what the writer wrote comes back.
pub(super) struct ProgressTx {
    tx: watch::Sender<Progress>,
    flushed: watch::Receiver<Flushed>,
}

impl ProgressTx {
    pub(super) fn new(tx: watch::Sender<Progress>, flushed: watch::Receiver<Flushed>) -> Self {
        Self { tx, flushed }
    }

    /// Changes the progress; the writer hears of it only if it changed.
    pub(super) fn update(&self, f: impl FnOnce(&mut Progress)) {
        self.tx.send_if_modified(|p| {
            let before = p.clone();
            f(p);
            *p != before
        });
    }

    /// A step of a volume migration completed: counted (see
    /// [`Progress::steps_done`]), and written at the writer's pace unless
    /// it changes a move's record. Returns the step's number.
    pub(super) fn step(&self, f: impl FnOnce(&mut Progress)) -> u64 {
        let mut n = 0;
        self.tx.send_modify(|p| {
            f(p);
            p.steps_done += 1;
            n = p.steps_done;
        });
        n
    }

    /// Changes the progress and tells the writer, changed or not.
    pub(super) fn send_modify(&self, f: impl FnOnce(&mut Progress)) {
        self.tx.send_modify(f);
    }

    /// One more pod evicted or deleted, one fewer left.
    pub(super) fn one_evicted(&self) {
        self.update(|p| {
            p.pods_evicted += 1;
            p.pods_remaining = p.pods_remaining.saturating_sub(1);
        });
    }

    /// Pods evicted or deleted and migration steps completed so far: a pass
    /// after the deadline that changes neither made no progress.
    pub(super) fn work_done(&self) -> (u32, u64) {
        let p = self.tx.borrow();
        (p.pods_evicted, p.steps_done)
    }

    /// The moves recorded now.
    pub(super) fn moves(&self) -> Vec<VolumeMove> {
        self.tx.borrow().moves.values().cloned().collect()
    }

    /// The recorded move of pod `key`.
    pub(super) fn move_of(&self, key: &str) -> Option<VolumeMove> {
        self.tx.borrow().moves.get(key).cloned()
    }

    pub(super) fn subscribe(&self) -> watch::Receiver<Progress> {
        self.tx.subscribe()
    }

    /// What the writer has written.
    pub(super) fn flushed(&self) -> watch::Receiver<Flushed> {
        self.flushed.clone()
    }

    /// Waits until the writer wrote step `target`, or `bound` passed; true
    /// once written.
    pub(super) async fn written_within(&self, target: u64, bound: Duration) -> bool {
        let mut flushed = self.flushed();
        let written = tokio::time::timeout(bound, flushed.wait_for(|f| f.steps >= target));
        matches!(written.await, Ok(Ok(_)))
    }
}

/// Writes progress to the Machine's status. Bursts are coalesced (at most
/// one write per [`STATUS_WRITE_INTERVAL`], always of the latest value),
/// except that a change of the volume moves' records is written at once. A write that
/// fails is tried again with backoff (up to [`MAX_RETRY`]) even when
/// nothing changes, since a volume move waits for its record before its
/// eviction. Ends when the drain drops its sender, after writing the final
/// state. Each write's answer (the Machine as the API server now has it)
/// goes to `written`. `clients`: the drain's own line, and its urgent one
/// for a write that changes a move's record (see
/// [`DrainClients`](super::DrainClients)).
pub(super) async fn write_status(
    clients: [Client; 2],
    machine: ObjectRef<Machine>,
    started: Timestamp,
    mut rx: watch::Receiver<Progress>,
    written_to: watch::Sender<Option<Machine>>,
    flushed: watch::Sender<Flushed>,
) {
    let ns = machine.namespace.as_deref().unwrap_or_default();
    let [rest, moves_api] = clients.map(|c| Api::<Machine>::namespaced(c, ns));
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let mut written: Option<serde_json::Value> = None;
    // The first write is held for an interval too, as if the drain's start
    // had been written: a drain that begins with a move writes its record
    // at once, as its first write. Twenty drains starting at once each
    // wrote their start first, and each first move's record waited behind
    // it for a saturated API server (up to 0.9 s in the scale benchmark);
    // the Machine reconciler's own write at the start of a drain met it
    // too, a conflict and a read each.
    let mut written_moves = Some(BTreeMap::new());
    let mut last_write = Some(Instant::now());
    let mut retry = retry_backoff();
    'writing: loop {
        loop {
            let record = written_moves.as_ref() != Some(&rx.borrow().moves);
            let Some(due) = hold_until(last_write, record, Instant::now()) else {
                break;
            };
            tokio::select! {
                () = tokio::time::sleep_until(due) => break,
                changed = rx.changed() => if changed.is_err() { break 'writing },
            }
        }
        let (patch, steps, moves) = {
            let p = rx.borrow_and_update();
            (
                p.status_patch(&machine.name, started),
                p.steps_done,
                p.moves.clone(),
            )
        };
        let mut retry_at = None;
        // A change of a move's record goes on the urgent line: a move's
        // eviction waits for its record, and the writer sends one write at
        // a time.
        let api = if written_moves.as_ref() == Some(&moves) {
            &rest
        } else {
            &moves_api
        };
        if written.as_ref() == Some(&patch) {
            flushed.send_replace(Flushed { steps, error: None });
        } else {
            match api
                .patch_status(&machine.name, &apply, &Patch::Apply(&patch))
                .await
            {
                Ok(m) => {
                    written_to.send_replace(Some(m));
                    flushed.send_replace(Flushed { steps, error: None });
                    written = Some(patch);
                    written_moves = Some(moves);
                    last_write = Some(Instant::now());
                    retry = retry_backoff();
                }
                Err(kube::Error::Api(s)) if s.code == 404 => return,
                Err(e) => {
                    tracing::warn!(error = %e, "could not record drain progress");
                    let error = match &e {
                        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
                        other => other.to_string(),
                    };
                    flushed.send_modify(|f| f.error = Some(error));
                    retry_at = Some(Instant::now() + retry.next().unwrap_or(MAX_RETRY));
                }
            }
        }
        // The next change, or the retry of a failed write: a move's record
        // goes out at once, anything else once the interval since the last
        // write has passed.
        if let Some(at) = retry_at {
            tokio::select! {
                () = tokio::time::sleep_until(at) => continue 'writing,
                changed = rx.changed() => if changed.is_err() { break 'writing },
            }
        } else if rx.changed().await.is_err() {
            break;
        }
    }
    // The drain ended; write its final state if it changed since.
    let last = rx.borrow().status_patch(&machine.name, started);
    if written.as_ref() != Some(&last)
        && let Ok(m) = rest
            .patch_status(&machine.name, &apply, &Patch::Apply(&last))
            .await
    {
        written_to.send_replace(Some(m));
    }
}

/// Longest pause between two attempts of a failed status write.
const MAX_RETRY: Duration = Duration::from_secs(30);

fn retry_backoff() -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(MAX_RETRY)
        .with_jitter()
        .without_max_times()
        .build()
}

/// Wakes the reconciler of `machine` (through `wake`) whenever its drain
/// gets blocked or held, or no longer is: the `Drain` step reports it
/// (`EvictionBlocked`, `PodHeldByFinalizer`), from the drain's progress.
/// The Machine's own change, `status.drain`'s write, is no sure wake: a
/// restarted process's drain blocked as the last one was writes what is
/// already there, the API server changes nothing, and no watch event
/// comes (the step then said `Draining` for as long as the block lasted).
/// A change of the block's words alone wakes nothing.
pub(super) async fn wake_on_block(
    mut rx: watch::Receiver<Progress>,
    machine: ObjectRef<Machine>,
    wake: tokio::sync::mpsc::UnboundedSender<ObjectRef<Machine>>,
) {
    let state = |p: &Progress| (p.blocked_by.is_some(), p.held);
    let mut last = state(&rx.borrow_and_update());
    while rx.changed().await.is_ok() {
        let now = state(&rx.borrow_and_update());
        if now != last {
            last = now;
            if wake.send(machine.clone()).is_err() {
                return;
            }
        }
    }
}

/// Until when the status writer holds a change back: never for a change
/// of the moves' records, otherwise until the interval since the last
/// write (or the drain's start) has passed.
fn hold_until(last_write: Option<Instant>, record: bool, now: Instant) -> Option<Instant> {
    last_write
        .map(|t| t + STATUS_WRITE_INTERVAL)
        .filter(|due| !record && *due > now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_drain_counts_steps_and_pods_and_waits_for_the_writer() {
        let (tx, rx) = watch::channel(Progress::default());
        let (done, flushed) = watch::channel(Flushed::default());
        let p = ProgressTx::new(tx, flushed);
        let mut seen = rx.clone();
        seen.borrow_and_update();
        p.update(|_| {});
        assert!(!seen.has_changed().unwrap(), "no change, no news");
        p.one_evicted();
        assert!(seen.has_changed().unwrap());
        let step = p.step(|p| p.waiting_for = Some("x".into()));
        assert_eq!(step, 1);
        assert_eq!(p.work_done(), (1, 1));
        assert!(!p.written_within(step, Duration::from_millis(10)).await);
        done.send_replace(Flushed {
            steps: 1,
            error: None,
        });
        assert!(p.written_within(step, Duration::from_millis(10)).await);
    }

    #[tokio::test]
    async fn the_reconciler_is_woken_when_the_drain_is_blocked_or_unblocked() {
        let (tx, rx) = watch::channel(Progress::default());
        let (wake, mut woken) = tokio::sync::mpsc::unbounded_channel();
        let machine = ObjectRef::<Machine>::new("m2").within("ns");
        let task = tokio::spawn(wake_on_block(rx, machine.clone(), wake));
        let steps: [fn(&mut Progress); 5] = [
            |p| p.pods_evicted += 1,
            |p| p.block("ns/app", "pod ns/app: PDB ns/app-pdb allows 0".into()),
            |p| {
                p.block(
                    "ns/app",
                    "pod ns/app: PDB ns/app-pdb allows 0 (again)".into(),
                )
            },
            |p| p.unblock("ns/app"),
            |p| {
                p.block("ns/app", "pod ns/app: held by a finalizer".into());
                p.held = true;
            },
        ];
        for step in steps {
            tx.send_modify(step);
            // The watcher sees each change (a watch keeps only the last).
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
        }
        drop(tx);
        task.await.expect("ends with the drain's progress");
        let mut wakes = Vec::new();
        while let Ok(m) = woken.try_recv() {
            wakes.push(m);
        }
        assert_eq!(
            wakes,
            vec![machine.clone(), machine.clone(), machine],
            "blocked, unblocked, held; not progress, not new words"
        );
    }

    #[test]
    fn evicting_a_pod_clears_its_own_block_and_no_other() {
        let mut p = Progress::default();
        p.block("db/pg-10", "pod db/pg-10: eviction refused".into());
        p.unblock("db/pg-1");
        assert_eq!(
            p.blocked_by.as_deref(),
            Some("pod db/pg-10: eviction refused"),
            "pg-1 is not pg-10"
        );
        p.unblock("db/pg-10");
        assert_eq!((p.blocked_by, p.blocked_pod), (None, None));
    }

    #[test]
    fn progress_waits_for_the_interval_but_a_moves_record_does_not() {
        let t0 = Instant::now();
        let soon = t0 + Duration::from_millis(300);
        // Nothing written yet: write now.
        assert_eq!(hold_until(None, false, t0), None);
        // A count changed 300 ms after a write: held until a second after it.
        assert_eq!(
            hold_until(Some(t0), false, soon),
            Some(t0 + STATUS_WRITE_INTERVAL)
        );
        // A move's record (begun, ended) goes out at once.
        assert_eq!(hold_until(Some(t0), true, soon), None);
        // Past the interval nothing is held.
        assert_eq!(
            hold_until(Some(t0), false, t0 + STATUS_WRITE_INTERVAL),
            None
        );
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
            blocked_pod: None,
            held: false,
            outcome: None,
            finished_at: None,
            finished_on: Some(Timestamp::from_second(1_700_000_000).expect("valid")),
            steps_done: 3,
            ..Default::default()
        };
        let started = Timestamp::from_second(1_699_999_000).expect("valid");
        let patch = p.status_patch("m-1", started);
        let d = &patch["status"]["drain"];
        assert_eq!(d["progress"], "4/9");
        assert_eq!(d["currentPod"], "db/pg-0");
        assert!(
            d["blockedBy"].is_null() && d.get("blockedBy").is_none(),
            "a cleared block is left out, and the apply removes it"
        );
        let parsed: crate::api::DrainStatus =
            serde_json::from_value(d.clone()).expect("the API type reads it");
        assert_eq!(parsed.pods_remaining, 5);
        assert_eq!(d["finishedAt"], "2023-11-14T22:13:20.000000Z");
        // The step count only paces the writer; it is not status.
        assert!(d.get("stepsDone").is_none() && d.get("steps_done").is_none());
        // The writer records when the drain started (the Machine's
        // deletionTimestamp) itself.
        assert_eq!(d["startedAt"], "2023-11-14T21:56:40Z");
        // An apply body names the object and sets nothing but status.drain.
        assert_eq!(patch["apiVersion"], "berth.dev/v1alpha1");
        assert_eq!(patch["kind"], "Machine");
        assert_eq!(patch["metadata"], serde_json::json!({"name": "m-1"}));
        let keys: Vec<&String> = patch["status"]
            .as_object()
            .expect("status")
            .keys()
            .collect();
        assert_eq!(keys, ["drain"]);
    }
}
