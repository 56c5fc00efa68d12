//! One pass of a drain.
//!
//! Each pass plans the Node from the caches and does what the plan says, in
//! the plan's order: it deletes the finished pods; evicts the pods without
//! volumes, at most `maxConcurrentEvictions` at a time; and, at the same
//! time, waits for the terminating pods with volumes and for the volumes
//! still detaching, then moves the stateful pods in the plan's order, at
//! most `maxParallelVolumeMigrations` at a time. The drain
//! ([`NodeDrain`]) repeats passes until one finds nothing to do, or the
//! deadline passes.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::events::EventType;
use tokio::sync::watch;
use tokio::time::Instant;

use super::batch::Batch;
use super::completion::WaitCompleted;
use super::destination::Destination;
use super::eviction::Eviction;
use super::migration::Migration;
use super::node_drain::NodeDrain;
use super::permits::DrainPermits;
use super::records::MoveRecords;
use super::reports::pv_ref;
use super::surge::evict_or_surge;
use super::terminating::Terminating;
use super::waits::Awaited;
use crate::drain::ledger::{Workload, moves_in};
use crate::drain::plan::{DetachingVolume, DrainPlan, PlannedPod};
use crate::drain::pod_writes::{self, Evicted};
use crate::drain::select::{NamespacedName, fmt_key};
use crate::drain::volume_kind::VolumeKind;
use crate::telemetry::EvictionResult;
use crate::volumes::{Interest, Registration};

/// One pass of a drain over its Node.
pub(super) struct Pass<'d> {
    d: &'d NodeDrain,
}

/// The longest the stateless evictions of a pass wait for the head of its
/// stateful chain (see `evict_and_move`).
const HEAD_FIRST: Duration = Duration::from_secs(1);

/// How long after its grace period a pod evicted in a pass is waited for
/// there, before the next pass takes it as a pod being deleted.
const LEFT_TO_NEXT_PASS: Duration = Duration::from_secs(5);

/// The pods of a pass that wait for their workload's permit or for a
/// destination, each as (`uid`, what it waits for), those that wait for a
/// destination, and whether a stateful move stalled (the chain halted for
/// this pass).
#[derive(Default)]
struct PermitWaits {
    pods: Vec<(String, String)>,
    nowhere: Vec<PlannedPod>,
    halted: bool,
}

/// What wakes a pass that waits for a permit, each subscribed before the
/// pass asked: a permit of this process freed, a Machine gone, a
/// workload's availability changed, a permit changed in the API server.
struct PermitWakes {
    freed: watch::Receiver<u64>,
    gone: watch::Receiver<u64>,
    workloads: watch::Receiver<u64>,
    permits: watch::Receiver<u64>,
}

impl From<(PermitWaits, PermitWaits)> for PermitWaits {
    fn from((a, b): (PermitWaits, PermitWaits)) -> Self {
        let (mut pods, mut nowhere) = (a.pods, a.nowhere);
        pods.extend(b.pods);
        nowhere.extend(b.nowhere);
        Self {
            pods,
            nowhere,
            halted: a.halted || b.halted,
        }
    }
}

/// What a pass found and did.
pub(super) enum PassEnd {
    /// Nothing was left to do.
    Done,
    /// Work was done, or waited for; plan again.
    Again,
}

impl<'d> Pass<'d> {
    pub(super) fn new(d: &'d NodeDrain) -> Self {
        Self { d }
    }

    /// One pass, in named stages: count what is left (done when nothing
    /// is); wait for a workload of an earlier group held for its
    /// replacement; enter the lowest order group with a pod left; delete
    /// the finished pods; then evict and move the group's pods
    /// ([`Pass::evict_and_move`]).
    pub(super) async fn run(&self) -> PassEnd {
        let full = self.d.plan();
        self.d.moves_left.store(moves_in(&full), Ordering::Release);
        let leftover = self.d.not_given_up(&full.detaching);
        // A move an earlier run recorded whose pod is gone is resumed
        // (its volumes waited for) even when nothing else is left: a
        // restart during the last pod's reattach wait must not end the
        // drain with the move still recorded.
        if self.count_left(&full) == 0
            && leftover.is_empty()
            && !MoveRecords::new(self.d).any_resumable()
        {
            MoveRecords::new(self.d).hand_over_held();
            return PassEnd::Done;
        }
        self.d.groups.announce_rules(&self.d.reports, &full);
        // One order group a pass: the lowest with a pod left. A later group,
        // and any after the default one, evicts nothing before the volumes
        // of the pods that left are off the Node (`gated`).
        let group = full.current_group(|t| !self.d.clock.released(t.grace));
        if self.held_before(group).await {
            return PassEnd::Again;
        }
        let gated = group.is_some_and(|g| self.d.groups.enter(&self.d.reports, &full, g));
        let plan = match group {
            Some(g) => full.only_group(g),
            None => full,
        };
        tracing::info!(
            group,
            waiting = plan.waiting.len(),
            stateless = plan.stateless.len(),
            stateful = plan.stateful.len(),
            terminating = plan.terminating.len(),
            terminal = plan.to_delete.len(),
            detaching = leftover.len(),
            "drain pass"
        );
        self.delete_finished(&plan).await;
        self.evict_and_move(&plan, leftover, gated).await;
        // After the deadline a pass that moved nothing ends the drain: an
        // order group whose last pods went (waited for, not evicted, in
        // this pass) is progress, the next group is due.
        if self.d.clock.expired()
            && group.is_some()
            && self
                .d
                .plan()
                .current_group(|t| !self.d.clock.released(t.grace))
                != group
        {
            self.d.progress.step(|_| {});
        }
        PassEnd::Again
    }

    /// The pods `plan` still has to remove, in the progress: how many.
    fn count_left(&self, plan: &DrainPlan) -> usize {
        let holding = plan
            .terminating
            .iter()
            .filter(|t| !self.d.clock.released(t.grace))
            .count();
        let remaining = plan.stateless.len()
            + plan.stateful.len()
            + plan.waiting.len()
            + holding
            + plan.to_delete.len();
        self.d.progress.update(|p| {
            p.pods_remaining = u32::try_from(remaining).unwrap_or(u32::MAX);
            p.pods_total = p.pods_total.max(p.pods_evicted + p.pods_remaining);
        });
        remaining
    }

    /// A workload held back because the scheduler cannot place its last
    /// evicted pod's replacement holds every later group too: its volume
    /// is attached nowhere, and the pods of later groups (CSI controllers,
    /// DNS) may be what it needs to move. Waits for it to be placed (or
    /// the deadline), then for its volumes to attach there; true when it
    /// held `group`.
    async fn held_before(&self, group: Option<i32>) -> bool {
        let (Some(g), Some(h)) = (group, MoveRecords::new(self.d).held_order()) else {
            return false;
        };
        if h >= g {
            return false;
        }
        self.await_placement(format!(
            "a replacement of order group {h} to be placed before order group {g} starts"
        ))
        .await;
        true
    }

    /// Says `why` the drain waits, waits (on pod events) for a held
    /// move's replacement to be placed, or the deadline, then goes on with
    /// the placed ones' moves.
    async fn await_placement(&self, why: String) {
        self.d.progress.update(|p| p.waiting_for = Some(why));
        self.d
            .waits()
            .pods_until(self.d.clock.deadline(), || {
                MoveRecords::new(self.d).any_placed()
            })
            .await;
        self.resume_placed().await;
    }

    /// The group's evictions and moves, at once: the pods without volumes
    /// evicted ([`Pass::evict_stateless`]); the volumes of pods that
    /// left waited for ([`Pass::volumes_off`]), then the stateful
    /// pods moved in order ([`Pass::move_stateful`]); the pods
    /// already terminating waited for; and the pods a drain rule says to
    /// wait on, once the evictions are done. When `gated`, nothing is
    /// evicted before the volumes are off.
    async fn evict_and_move(&self, plan: &DrainPlan, leftover: Vec<DetachingVolume>, gated: bool) {
        // Subscribed before any ask: a permit freed between an ask and the
        // wait for one is not missed.
        let mut freed = self.d.deps.permits.freed();
        freed.borrow_and_update();
        let mut gone = self.d.deps.caches.machines_gone.clone();
        gone.borrow_and_update();
        let mut workloads = self.d.deps.caches.workload_changes.clone();
        workloads.borrow_and_update();
        let mut permits = self.d.deps.caches.permit_changes.clone();
        permits.borrow_and_update();
        let terminating = futures::future::join_all(
            plan.terminating
                .iter()
                .filter(|t| t.pvs.is_empty() && !self.d.clock.released(t.grace))
                .map(|t| async move { Terminating::new(self.d, t).wait().await }),
        );
        // The head of the stateful chain goes first: its permit and record,
        // then its eviction, round trips each, met the stateless evictions
        // of every drain starting at once, and a saturated API server
        // answered each in up to a second (the scale benchmark's audit
        // log). The stateless evictions wait for the head's eviction to be
        // answered (or to be left for later), for at most `HEAD_FIRST`;
        // their own drain's critical path is rarely theirs.
        let (head, mut head_done) =
            tokio::sync::watch::channel(gated || !leftover.is_empty() || plan.stateful.is_empty());
        let stateless = async {
            let _ = tokio::time::timeout(HEAD_FIRST, head_done.wait_for(|done| *done)).await;
            self.evict_stateless(plan).await
        };
        let volumes_off = self.volumes_off(plan, leftover);
        let chain = self.move_stateful(plan, &head);
        // The pods waited on to complete are named once the group's
        // evictions are done: `status.drain` then says what the drain waits
        // for.
        let waiting = WaitCompleted::new(self.d).run(&plan.waiting);
        let waits = if gated {
            volumes_off.await;
            let evictions = async {
                let r = tokio::join!(chain, stateless);
                waiting.await;
                r
            };
            tokio::join!(evictions, terminating).0
        } else {
            let stateful = async {
                volumes_off.await;
                chain.await
            };
            let evictions = async {
                let r = tokio::join!(stateful, stateless);
                waiting.await;
                r
            };
            tokio::join!(evictions, terminating).0
        };
        let mut wakes = PermitWakes {
            freed,
            gone,
            workloads,
            permits,
        };
        self.wait_for_permits(waits.into(), &mut wakes).await;
    }

    /// The pods of this pass that wait for their workload's permit (`uid`,
    /// what each waits for): this Machine waits in the ledger's line for
    /// them only, `status.drain` names them, and unless a stateful move of
    /// this pass stalled (`halted`), the pass waits until a permit of this
    /// process frees or an ask is withdrawn (then the next pass asks
    /// again) or one of another process's permits changed, a Machine that
    /// may have held a permit is gone, a destination appeared for a pod
    /// that waits for one, a workload's
    /// availability may have changed (a replica down for another reason
    /// holds its budget too), a stalled move of this drain can go on (its
    /// volumes are off the Node), or the deadline.
    async fn wait_for_permits(&self, waits: PermitWaits, wakes: &mut PermitWakes) {
        let uids: Vec<String> = waits.pods.iter().map(|(uid, _)| uid.clone()).collect();
        self.d
            .deps
            .permits
            .keep_waiting(&DrainPermits::new(self.d).machine_key(), &uids);
        let why = (!waits.pods.is_empty()).then(|| {
            let why: Vec<&str> = waits.pods.iter().map(|(_, why)| why.as_str()).collect();
            why.join("; ")
        });
        self.d
            .progress
            .update(|p| p.waiting_for_budget = why.clone());
        let Some(why) = why else { return };
        if waits.halted {
            return;
        }
        self.d.progress.update(|p| p.waiting_for = Some(why));
        let records = MoveRecords::new(self.d);
        let stalled = records.stalled_detached(self.d.clock.deadline());
        // A workload's availability matters to a pod that waits for its
        // budget, not to one that waits for a destination only.
        let budget = waits.pods.len() > waits.nowhere.len();
        tokio::select! {
            () = Destination::new(self.d).appears(&waits.nowhere) => {}
            _ = wakes.freed.changed() => {}
            _ = wakes.gone.changed() => {}
            _ = wakes.workloads.changed(), if budget => {}
            _ = wakes.permits.changed() => {}
            () = stalled => {}
            () = tokio::time::sleep_until(self.d.clock.deadline()) => {}
        }
    }

    /// Evicts the pods without volumes, at most `maxConcurrentEvictions`
    /// requests in flight, and waits for them to go. Waiting costs nothing
    /// but a watch receiver each, so every evicted pod is waited for at
    /// once. Evictions accepted together are announced in one Event (see
    /// `batch`).
    async fn evict_stateless(&self, plan: &DrainPlan) -> PermitWaits {
        // A pod of a workload that bounds its moves asks the ledger first;
        // one that must wait is left to a later pass.
        let mut waits = PermitWaits::default();
        let mut going = Vec::new();
        for p in &plan.stateless {
            match DrainPermits::new(self.d).stateless_gate(p).await {
                Ok(gate) => going.push((p, gate)),
                Err(why) => waits
                    .pods
                    .push((p.uid.clone().unwrap_or_else(|| fmt_key(&p.pod)), why)),
            }
        }
        // The futures are collected first: a lazy `map` closure inside a
        // spawned future trips the compiler's higher-ranked lifetime check.
        let evictions: Vec<_> = going
            .iter()
            .map(|(p, gate)| async move { (*p, gate, evict_or_surge(self.d, p, false).await) })
            .collect();
        let mut results = futures::stream::iter(evictions)
            .buffer_unordered(self.d.job.settings.max_concurrent_evictions.max(1) as usize);
        let mut batch = Batch::default();
        let mut leaving = Vec::new();
        loop {
            let due = batch.due();
            tokio::select! {
                next = results.next() => match next {
                    Some((p, gate, Eviction::Accepted(pod))) => {
                        batch.push(pod, Instant::now());
                        leaving.push((p, gate));
                    }
                    Some((p, gate, Eviction::Gone | Eviction::Forced)) => leaving.push((p, gate)),
                    Some((p, Some(gate), Eviction::Expired | Eviction::Refused)) => DrainPermits::new(self.d).release_gate(p, gate),
                    Some((_, None, Eviction::Expired | Eviction::Refused)) => {}
                    Some((p, gate, Eviction::Waits(why))) => {
                        if let Some(gate) = gate {
                            DrainPermits::new(self.d).release_gate(p, gate);
                        }
                        waits.pods.push((p.uid.clone().unwrap_or_else(|| fmt_key(&p.pod)), why));
                    }
                    None => break,
                },
                _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                    self.d.reports.evicted(batch.take());
                }
            }
        }
        self.d.reports.evicted(batch.take());
        let gone: Vec<_> = leaving
            .into_iter()
            .map(|(p, gate)| async move {
                // Until its grace period is over and a little more: one
                // still there then is left to the next pass, which names
                // what holds it (`wait_terminating`), and keeps its permit.
                let until = self
                    .d
                    .clock
                    .bounded(p.grace.saturating_add(LEFT_TO_NEXT_PASS));
                if self.d.waits().gone(&p.pod, p.uid.as_deref(), until).await
                    && let Some(gate) = gate
                {
                    DrainPermits::new(self.d).end_stateless_move(p, gate).await;
                }
            })
            .collect();
        futures::future::join_all(gone).await;
        waits
    }

    /// Before the first stateful eviction (and, when gated, before any
    /// eviction): the volumes of pods that left are off this Node. Stateful
    /// pods already terminating (evicted before a restart, or by someone
    /// else) first; then the moves an earlier run recorded, and the held
    /// workloads whose replacement is now placed, each by the rules of a
    /// first run; then the volumes still detaching.
    async fn volumes_off(&self, plan: &DrainPlan, leftover: Vec<DetachingVolume>) {
        let going: Vec<_> = plan.terminating_with_volumes().collect();
        for t in going.iter().filter(|t| !self.d.clock.released(t.grace)) {
            self.d.progress.update(|p| {
                p.current_pod = Some(fmt_key(&t.pod));
                p.waiting_for = Some(format!("pod {} to terminate", fmt_key(&t.pod)));
            });
            Terminating::new(self.d, t).wait().await;
        }
        let leftover = if going.is_empty() {
            leftover
        } else {
            self.d.detaching()
        };
        // Moves in flight that a previous run recorded (the controller
        // restarted after an eviction, a pod gone or a detach): each goes
        // on from its pod gone on, and ends before the next stateful
        // eviction.
        let resumed = MoveRecords::new(self.d).resumed();
        let mut recorded: BTreeSet<String> = resumed
            .iter()
            .flat_map(|m| m.volumes.iter().cloned())
            .collect();
        recorded.extend(self.d.held.volumes());
        futures::future::join_all(resumed.iter().map(|m| Migration::resume(self.d, m))).await;
        // Its volumes attach where the replacement runs before the
        // workload's next pod goes.
        self.resume_placed().await;
        let leftover: Vec<_> = leftover
            .into_iter()
            .filter(|v| !recorded.contains(&v.pv))
            .collect();
        if !leftover.is_empty() {
            self.wait_detaching(&leftover).await;
        }
    }

    /// Moves the group's stateful pods in the plan's order, at most
    /// `maxParallelVolumeMigrations` at a time. A pod whose volumes did not
    /// leave the Node in time stops the chain for this pass; its move keeps
    /// its workload's permit (see [`MoveRecords::stalled`]), so the next pass
    /// goes on with other workloads only. A pod of a workload whose last replacement the
    /// scheduler cannot place is held back; other workloads go on, and when
    /// only held-back pods are left, the chain waits (on pod events) for a
    /// replacement to be placed, or the deadline.
    /// `head` is told once the first pod's eviction is answered, or once
    /// it will not be sent soon.
    async fn move_stateful(
        &self,
        plan: &DrainPlan,
        head: &tokio::sync::watch::Sender<bool>,
    ) -> PermitWaits {
        let halted = AtomicBool::new(false);
        let held = AtomicBool::new(false);
        let waiting: std::sync::Mutex<Vec<(String, String)>> = Default::default();
        let nowhere: std::sync::Mutex<Vec<PlannedPod>> = Default::default();
        let migrations: Vec<_> = plan
            .stateful
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (halted, held, waiting, nowhere) = (&halted, &held, &waiting, &nowhere);
                let head = (i == 0).then_some(head);
                let head_done = move || {
                    if let Some(h) = head {
                        h.send_replace(true);
                    }
                };
                async move {
                    if halted.load(Ordering::Acquire) {
                        return;
                    }
                    if MoveRecords::new(self.d).workload_held(p.controller.as_deref()) {
                        held.store(true, Ordering::Release);
                        head_done();
                        return;
                    }
                    let uid = || p.uid.clone().unwrap_or_else(|| fmt_key(&p.pod));
                    // A Node for its replacement first, and the workload's
                    // budget across every drain: a pod that must wait for
                    // either is left to a later pass, and the chain goes on
                    // with other workloads. The destination found is held
                    // for the move at once, and by its permit once granted.
                    let found = match Destination::new(self.d).find_and_hold(p) {
                        Ok(found) => found,
                        Err(why) => {
                            if let (Ok(mut w), Ok(mut n)) = (waiting.lock(), nowhere.lock()) {
                                w.push((uid(), why));
                                n.push(p.clone());
                            }
                            head_done();
                            return;
                        }
                    };
                    let permit = self.permit_to_move(p, found).await;
                    self.d.deps.permits.unhold(&uid());
                    let workload = match permit {
                        Ok(workload) => workload,
                        Err(why) => {
                            if let Ok(mut w) = waiting.lock() {
                                w.push((uid(), why));
                            }
                            head_done();
                            return;
                        }
                    };
                    let moved = Migration::start(self.d, plan, p, head).await;
                    head_done();
                    DrainPermits::new(self.d).end_unrecorded(p, &workload);
                    if !moved {
                        halted.store(true, Ordering::Release);
                    }
                }
            })
            .collect();
        // Started in the plan's order; unordered, so that a move that ends
        // (or a pod that waits for its workload's permit) frees its place
        // at once rather than behind a longer move started before it.
        futures::stream::iter(migrations)
            .buffer_unordered(self.d.job.settings.max_parallel_volume_migrations.max(1) as usize)
            .collect::<Vec<()>>()
            .await;
        if held.load(Ordering::Acquire) {
            self.d
                .waits()
                .pods_until(self.d.clock.deadline(), || {
                    MoveRecords::new(self.d).any_placed()
                })
                .await;
        }
        PermitWaits {
            pods: waiting.into_inner().unwrap_or_default(),
            nowhere: nowhere.into_inner().unwrap_or_default(),
            halted: halted.load(Ordering::Acquire),
        }
    }

    /// The permit of the ledger for `p`'s move, asked while its record is
    /// written when the ledger would grant it (see
    /// [`MoveRecords::record_early`]): its workload, one move fewer left;
    /// or what it waits for, its early record withdrawn.
    async fn permit_to_move(
        &self,
        p: &PlannedPod,
        destination: Option<String>,
    ) -> Result<Workload, String> {
        let (workload, early) = tokio::join!(
            DrainPermits::new(self.d).permit(p, destination),
            MoveRecords::new(self.d).record_early(p)
        );
        match workload {
            Ok(workload) => {
                let _ = self
                    .d
                    .moves_left
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                        Some(n.saturating_sub(1))
                    });
                Ok(workload)
            }
            Err(why) => {
                if early {
                    MoveRecords::new(self.d).withdraw(p);
                }
                Err(why)
            }
        }
    }

    /// Resumes the moves held for a replacement the scheduler could not
    /// place, now placed (or past the deadline), by the rules of a first
    /// run ([`Migration::resume`]): the volumes attach where the replacement
    /// runs, a ReadWriteMany peer that used them elsewhere before the move
    /// is not taken for it.
    async fn resume_placed(&self) {
        let placed = MoveRecords::new(self.d).take_placed();
        for m in &placed {
            self.d.progress.update(|p| p.unblock(&m.pod));
        }
        futures::future::join_all(placed.iter().map(|m| Migration::resume(self.d, m))).await;
    }

    /// Deletes the pods that finished (Succeeded or Failed).
    async fn delete_finished(&self, plan: &DrainPlan) {
        for p in &plan.to_delete {
            let Some(pod) = self.d.view().pod(&p.pod, p.uid.as_deref()) else {
                continue;
            };
            match pod_writes::delete(&self.d.clients.rest, &pod, None).await {
                Evicted::Accepted | Evicted::Gone => {
                    self.d.deps.metrics.record_eviction(EvictionResult::Deleted);
                    self.d.count_evicted(&p.pod);
                }
                other => {
                    let pod = fmt_key(&p.pod);
                    tracing::warn!(%pod, result = ?other, "could not delete a finished pod");
                }
            }
        }
    }

    /// Waits for volumes of pods that already left to detach from this
    /// Node, then to attach where a pod still needs them.
    async fn wait_detaching(&self, leftover: &[DetachingVolume]) {
        let interest = leftover
            .iter()
            .fold(Interest::new(&self.d.job.node), |i, v| {
                i.volume(v.pv.clone(), v.unique_name.clone())
            });
        let names: Vec<&str> = leftover.iter().map(|v| v.pv.as_str()).collect();
        self.d.progress.update(|p| {
            p.current_volume = Some(names.join(", "));
            p.waiting_for = Some(format!(
                "volumes of pods that already left to detach from Node {}",
                self.d.job.node
            ));
        });
        let mut reg = self.d.deps.tracker.register(interest);
        let started = std::time::Instant::now();
        match reg
            .wait_detached(
                self.d
                    .clock
                    .volume_bound(self.d.job.settings.volume_detach_timeout),
            )
            .await
        {
            Ok(()) => {
                self.d
                    .deps
                    .metrics
                    .volume_detach_wait
                    .observe(started.elapsed().as_secs_f64());
                // A completed step: progress for a pass after the deadline.
                self.d.progress.step(|p| p.waiting_for = None);
                self.d.reports.event(
                    EventType::Normal,
                    "VolumeDetached",
                    format!(
                        "{} detached from Node {}",
                        names.join(", "),
                        self.d.job.node
                    ),
                    leftover.first().and_then(|v| pv_ref(&v.pv)),
                );
            }
            Err(e) => {
                self.d.held.give_up(leftover.iter().map(|v| v.pv.clone()));
                self.d.reports.volume_wait_failed(
                    "VolumeDetachTimeout",
                    &e,
                    leftover.first().map(|v| v.pv.as_str()),
                );
                return;
            }
        }
        // And attached where a pod still needs them, unless the deadline
        // passed (availability is what it gives up).
        if !self.d.clock.expired() {
            self.reattached(&names, &mut reg).await;
        }
    }

    /// The volumes `names` of pods that left before this run, now detached
    /// from this Node: waited for where a pod that uses their claim runs,
    /// for those whose claim a pod still needs.
    async fn reattached(&self, names: &[&str], reg: &mut Registration) {
        // Each volume whose claim a pod still needs, with that claim.
        let view = self.d.view();
        let needed: Vec<(&str, NamespacedName)> = names
            .iter()
            .filter_map(|pv| Some((*pv, view.claim_of(pv)?)))
            .filter(|(_, claim)| view.replacement_expected(claim, ""))
            .collect();
        if needed.is_empty() {
            return;
        }
        self.d.progress.update(|p| {
            p.waiting_for = Some(format!(
                "volumes {} to attach where the pods that now use their claims run",
                needed
                    .iter()
                    .map(|(pv, _)| *pv)
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        });
        let detached_at = std::time::Instant::now();
        let until = self
            .d
            .clock
            .bounded(self.d.job.settings.volume_reattach_timeout);
        // The pods gone are not known by UID here (they left before this
        // run): every pod that uses the claim on another Node counts.
        let none = BTreeSet::new();
        let volumes: Vec<Awaited> = needed
            .iter()
            .map(|(pv, claim)| Awaited {
                pv,
                claim,
                kind: VolumeKind::Attachable,
                users_before: &none,
            })
            .collect();
        self.d
            .waits()
            .reattach(reg, &volumes, "", false, detached_at, until)
            .await;
    }
}
