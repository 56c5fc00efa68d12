//! A drain's volume moves as `status.drain.moves` records them, and the
//! moves it holds (see [`held`](super::held)): a move's record written
//! before its eviction (a controller killed right after it finds the move
//! on restart), ended when the move is over; the moves an earlier run
//! recorded, resumed; the moves whose volumes did not detach in time,
//! stalled until they are off; and the workloads held for a replacement
//! the scheduler cannot place, taken back once it is placed or handed over
//! when nothing else is left.

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use tokio::time::Instant;

use super::node_drain::NodeDrain;
use super::permits::DrainPermits;
use super::reports::pod_ref_key;
use crate::api::VolumeMove;
use crate::drain::ledger::{workload_name, workload_of_record};
use crate::drain::plan::PlannedPod;
use crate::drain::select::{NamespacedName, fmt_key};
use crate::volumes::{Interest, pv_of};

/// How long a volume move's record may take to be written before the
/// wait for it is named.
pub(super) const FLUSH_BOUND: Duration = Duration::from_secs(5);

/// The move records of one drain.
#[derive(Clone, Copy)]
pub(super) struct MoveRecords<'d> {
    d: &'d NodeDrain,
}

impl<'d> MoveRecords<'d> {
    pub(super) fn new(d: &'d NodeDrain) -> Self {
        Self { d }
    }

    /// The move of pod `key`'s volumes is over (moved, given up, or never
    /// started).
    pub(super) fn end(self, key: &str) {
        let mut ended = None;
        self.d.progress.update(|p| {
            ended = p.moves.remove(key);
        });
        if let Some(m) = ended
            && let Some((ns, _)) = m.pod.split_once('/')
            && let Some(w) = workload_of_record(ns, &m)
        {
            DrainPermits::new(self.d).end(&w, m.uid.as_deref().unwrap_or(&m.pod));
        }
    }

    /// The recorded moves whose pod is gone: the volumes of each are
    /// waited for (detached from this Node, attached where a pod needs them)
    /// before another stateful pod is evicted. A recorded pod still there
    /// and not being deleted was never evicted (the controller stopped in
    /// between): its record goes, its migration records it again.
    pub(super) fn resumed(self) -> Vec<VolumeMove> {
        let moves = self.d.progress.moves();
        let mut resumed = Vec::new();
        for m in moves
            .into_iter()
            .filter(|m| !self.d.held.is_held(&m.pod) && !self.stalled(m))
        {
            let Some((ns, name)) = m.pod.split_once('/') else {
                self.end(&m.pod);
                continue;
            };
            let key = (ns.to_string(), name.to_string());
            match self.d.view().pod(&key, m.uid.as_deref()) {
                None => resumed.push(m),
                Some(p) if p.metadata.deletion_timestamp.is_none() => self.end(&m.pod),
                Some(_) => {}
            }
        }
        resumed
    }

    /// Whether a recorded move's pod is gone, so that
    /// [`MoveRecords::resumed`] would resume it.
    pub(super) fn any_resumable(self) -> bool {
        let moves = self.d.progress.moves();
        moves
            .iter()
            .filter(|m| !self.d.held.is_held(&m.pod) && !self.stalled(m))
            .any(|m| {
                m.pod.split_once('/').is_some_and(|(ns, name)| {
                    self.d
                        .view()
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
    pub(super) fn announce_resumed(self) {
        for m in self.d.progress.moves() {
            let Some((ns, name)) = m.pod.split_once('/') else {
                continue;
            };
            let key = (ns.to_string(), name.to_string());
            let state = match self.d.view().pod(&key, m.uid.as_deref()) {
                None => "gone",
                Some(p) if p.metadata.deletion_timestamp.is_some() => "terminating",
                Some(_) => continue,
            };
            self.d.reports.event(
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

    /// Whether move `m` stalled: a volume of it did not detach in time in
    /// this run and is still attached to the Node. It keeps its record and
    /// its workload's permit, and is not waited for again in every pass;
    /// once its volumes are off it is resumed (see
    /// [`MoveRecords::stalled_detached`]).
    pub(super) fn stalled(self, m: &VolumeMove) -> bool {
        let given_up = self.d.held.given_up_of(m);
        if given_up.is_empty() {
            return false;
        }
        let on_node = self.d.view().attachments_on_node();
        given_up
            .iter()
            .any(|pv| on_node.iter().any(|va| pv_of(va) == Some(pv.as_str())))
    }

    /// The volumes of this drain's stalled moves (see
    /// [`MoveRecords::stalled`]), for a wait until they are off the Node.
    pub(super) fn stalled_volumes(self) -> Vec<String> {
        let moves = self.d.progress.moves();
        moves
            .iter()
            .filter(|m| self.stalled(m))
            .flat_map(|m| self.d.held.given_up_of(m))
            .collect()
    }

    /// Resolves once the volumes of the stalled moves are off the Node
    /// (never, when there are none), or at `until`.
    pub(super) async fn stalled_detached(self, until: Instant) {
        let pvs = self.stalled_volumes();
        if pvs.is_empty() {
            return std::future::pending().await;
        }
        let interest = pvs
            .into_iter()
            .fold(Interest::new(&self.d.job.node), |i, pv| i.volume(pv, None));
        let mut reg = self.d.deps.tracker.register(interest);
        let _ = reg.wait_detached(until).await;
    }

    /// Nothing is left to drain but moves held for a replacement the
    /// scheduler cannot place: their pods are gone and their volumes off
    /// this Node, so the Machine (and its VM) need not wait for where the
    /// replacements land. Each move goes on without it, holding its
    /// workload's permit until the workload is whole again or the move's
    /// healthy deadline (see [`keeper`](super::keeper)); its record leaves
    /// the Machine's status, and an Event says so.
    pub(super) fn hand_over_held(self) {
        for m in self.d.held.take(|_| true) {
            self.d.progress.update(|p| {
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
            self.d.reports.event(
                EventType::Normal,
                "MoveOutlivesDrain",
                format!(
                    "nothing else is left on Node {}: the move of pod {} ({}) goes on without this Machine while its replacement cannot be placed, holding the move permit of {workload} until the workload is whole again or the move's healthy deadline",
                    self.d.job.node,
                    m.pod,
                    m.volumes.join(", ")
                ),
                pod,
            );
        }
    }

    /// The lowest order group of a held workload's move (never after the
    /// deadline): a later group waits for it, since a group starts only
    /// once the volumes of every pod before it have moved.
    pub(super) fn held_order(self) -> Option<i32> {
        if self.d.clock.expired() {
            return None;
        }
        self.d.held.lowest_order()
    }

    /// Whether pods of `controller` are held back now (never after the
    /// deadline, when availability is what is given up).
    pub(super) fn workload_held(self, controller: Option<&str>) -> bool {
        controller.is_some_and(|c| !self.d.clock.expired() && self.d.held.holds(c))
    }

    /// Takes the held workloads whose replacement is no longer
    /// unschedulable (placed, or gone), with the moves they were held for.
    pub(super) fn take_placed(self) -> Vec<VolumeMove> {
        let expired = self.d.clock.expired();
        self.d.held.take(|m| expired || !self.unplaced(m))
    }

    /// Whether any held workload's replacement was placed.
    pub(super) fn any_placed(self) -> bool {
        self.d.held.any(|m| !self.unplaced(m))
    }

    /// Whether the scheduler still cannot place the replacement of the pod
    /// `m` moved.
    fn unplaced(self, m: &VolumeMove) -> bool {
        let uid = m.uid.as_deref().unwrap_or("");
        self.claims_of(m)
            .iter()
            .any(|c| self.d.view().unschedulable_replacement(c, uid).is_some())
    }

    /// The claims of the PVs of a move, from their `claimRef`.
    fn claims_of(self, m: &VolumeMove) -> Vec<NamespacedName> {
        m.volumes
            .iter()
            .filter_map(|pv| self.d.view().claim_of(pv))
            .collect()
    }

    /// Records a volume move in `status.drain.moves` and waits until it is
    /// written: no record, no eviction, so that a controller killed right
    /// after the eviction that follows always finds the move on restart
    /// (and the ledger of a new leader counts it). A record not written
    /// within [`FLUSH_BOUND`] is named (a Warning, once per pod, and
    /// `blockedBy`) while the writer tries again with backoff; the move is
    /// given up (false, the pod not evicted) at the drain's deadline, or
    /// after one more bound once it passed.
    pub(super) async fn begin(self, key: &str, pod: &PlannedPod, pvs: &[String]) -> bool {
        let uid = pod.uid.as_deref();
        // Written while its permit was asked (see `DrainPermits::record_early`).
        if self
            .d
            .progress
            .move_of(key)
            .is_some_and(|m| m.uid.as_deref() == uid)
        {
            return true;
        }
        let target = self.record(key, pod, pvs);
        if self.d.progress.written_within(target, FLUSH_BOUND).await {
            return true;
        }
        self.unrecorded(key, uid, target).await
    }

    /// Writes the record of `p`'s move while its permit is asked, when the
    /// ledger would grant it now: both must be in the API server before
    /// the eviction, and neither needs the other, so the first stateful
    /// eviction of a drain waits for one round trip instead of two (under
    /// twenty drains starting at once, each took up to a second). True
    /// once written. A drain that would wait for its permit writes
    /// nothing; a record whose permit is then refused is withdrawn (see
    /// [`MoveRecords::withdraw`](super::records::MoveRecords::withdraw)), and a restart in between finds its
    /// pod still there and drops it (see `MoveRecords::resumed`).
    pub(super) async fn record_early(self, p: &PlannedPod) -> bool {
        let key = fmt_key(&p.pod);
        if p.held.is_some() || p.volumes.is_empty() || self.d.progress.move_of(&key).is_some() {
            return false;
        }
        let asked = DrainPermits::new(self.d).pod_ask(p);
        let Some(ask) = &asked.ask else {
            return false;
        };
        if !self.d.deps.permits.would_grant(ask, &asked.budget) {
            return false;
        }
        let pvs: Vec<String> = p.volumes.iter().map(|v| v.volume.pv.clone()).collect();
        let target = self.record(&key, p, &pvs);
        if self.d.progress.written_within(target, FLUSH_BOUND).await {
            return true;
        }
        // Recorded the usual way, with its Warnings, once allowed.
        self.withdraw(p);
        false
    }

    /// Puts the move of `pod` (`key`) with its PVs `pvs` in the record the
    /// status writer writes next; the step at which it is written.
    pub(super) fn record(self, key: &str, pod: &PlannedPod, pvs: &[String]) -> u64 {
        let uid = pod.uid.as_deref();
        let workload = workload_name(&DrainPermits::new(self.d).pod_ask(pod).workload);
        self.d.progress.step(|p| {
            p.moves.insert(
                key.to_string(),
                VolumeMove {
                    pod: key.to_string(),
                    uid: uid.map(String::from),
                    volumes: pvs.to_vec(),
                    controller: pod.controller.clone(),
                    workload: Some(workload),
                    since: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                        Timestamp::now(),
                    )),
                },
            );
        })
    }

    /// A move's record not written within [`FLUSH_BOUND`]: named, and
    /// waited for until the deadline (see [`MoveRecords::begin`]).
    async fn unrecorded(self, key: &str, uid: Option<&str>, target: u64) -> bool {
        let mut flushed = self.d.progress.flushed();
        let error = flushed.borrow().error.clone();
        let why = format!(
            "the move of pod {key} could not be recorded in status.drain.moves{}: it is not evicted until it is (the write is retried with backoff)",
            error.map(|e| format!(" ({e})")).unwrap_or_default()
        );
        tracing::warn!(pod = key, "{why}");
        if self
            .d
            .reports
            .first(format!("unrecorded/{}", uid.unwrap_or(key)))
        {
            let (ns, name) = key.split_once('/').unwrap_or(("", key));
            self.d.reports.event(
                EventType::Warning,
                "MoveNotRecorded",
                why.clone(),
                Some(pod_ref_key(&(ns.to_string(), name.to_string()))),
            );
        }
        self.d.progress.update(|p| p.block(key, why));
        // `status.drain` cannot carry the block (its write is what fails),
        // and nothing else changes the Machine: the reconciler is woken to
        // say it in the `Drained` condition, which it writes apart.
        let _ = self.d.wake.send(self.d.job.machine.clone());
        let until = if self.d.clock.expired() {
            Instant::now() + FLUSH_BOUND
        } else {
            self.d.clock.deadline()
        };
        let recorded = tokio::select! {
            r = flushed.wait_for(|f| f.steps >= target) => r.is_ok(),
            () = tokio::time::sleep_until(until) => false,
        };
        self.d.progress.update(|p| p.unblock(key));
        if !recorded {
            self.end(key);
        }
        recorded
    }

    /// Withdraws the record of `p`'s move, written before its permit was
    /// granted (see [`MoveRecords::record_early`]).
    pub(super) fn withdraw(self, p: &PlannedPod) {
        let key = fmt_key(&p.pod);
        self.d.progress.update(|pr| {
            pr.moves.remove(&key);
        });
    }
}
