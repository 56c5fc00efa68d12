//! A drain from its first pass to its outcome.
//!
//! Each pass plans the Node from the caches and does what the plan says, in
//! the plan's order: it deletes the finished pods; evicts the pods without
//! volumes, at most `maxConcurrentEvictions` at a time; and, at the same
//! time, waits for the terminating pods with volumes and for the volumes
//! still detaching, then moves the stateful pods in the plan's order, at
//! most `maxParallelVolumeMigrations` at a time. Passes repeat until one
//! finds nothing to do, or the deadline passes: then the pods left are
//! forced, or the drain fails saying which are left and why.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::watch;
use tokio::time::Instant;

use super::batch::Batch;
use super::eviction::Eviction;
use super::node_drain::NodeDrain;
use super::progress::write_status;
use super::reattach::Awaited;
use super::refs::pv_ref;
use super::{Deps, Job, Outcome, Progress};
use crate::api::Machine;
use crate::controller::AbortOnDrop;
use crate::drain::pdb::PdbVerdict;
use crate::drain::plan::{DetachingVolume, DrainPlan};
use crate::drain::pod_writes::{self, Evicted};
use crate::drain::select::{NamespacedName, fmt_key};
use crate::drain::volume_kind::VolumeKind;
use crate::telemetry::{EvictionResult, GaugeHold};
use crate::volumes::Interest;

pub(super) async fn run(
    deps: Arc<Deps>,
    job: Job,
    progress: watch::Sender<Progress>,
    written: watch::Sender<Option<Machine>>,
    data_loss_allowed: watch::Receiver<bool>,
    memory: Arc<std::sync::Mutex<super::node_drain::Memory>>,
    wake: tokio::sync::mpsc::UnboundedSender<ObjectRef<Machine>>,
) {
    let (steps_written, flushed) = watch::channel(super::progress::Flushed::default());
    let in_progress = GaugeHold::new(&deps.metrics.drains_in_progress);
    let started = std::time::Instant::now();
    let r = NodeDrain::new(
        Arc::clone(&deps),
        job,
        progress,
        flushed,
        data_loss_allowed,
        memory,
        wake,
    );
    // The writer lives exactly as long as this drain: a drain stopped from
    // outside (restarted, forgotten, leadership lost) takes its writer
    // with it (dropped before it, declared after), so no final write of a
    // stale `status.drain` can land after a newer drain's (it would erase
    // that drain's move records: both apply under one field manager).
    let mut writer = AbortOnDrop(tokio::spawn(write_status(
        [r.client.clone(), r.moves.clone()],
        r.job.machine.clone(),
        r.job.deadline.started,
        r.progress.subscribe(),
        written,
        steps_written,
    )));
    let _reporter = AbortOnDrop(tokio::spawn(super::progress::wake_on_block(
        r.progress.subscribe(),
        r.job.machine.clone(),
        r.wake.clone(),
    )));
    // Permits an earlier run of this Machine's drain was granted and did
    // not record (it stopped in between) are free; those it recorded are
    // its moves in flight, resumed below.
    r.release_unrecorded_permits();
    r.announce_resumed();
    let outcome = r.passes().await;
    r.release_unrecorded_permits();
    drop(in_progress);
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
            format!(
                "drain deadline passed: deleted {} with their PodDisruptionBudgets bypassed",
                pods.join(", ")
            ),
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
        p.waiting_for_budget = None;
        p.blocked_pod = None;
        if let Outcome::Failed { message } = &outcome {
            p.blocked_by = Some(message.clone());
        } else {
            p.blocked_by = None;
        }
    });
    // The writer writes the final state once the drain lets go of it; the
    // reconciler is woken (by the caller) once it is written, or given up.
    drop(r);
    if tokio::time::timeout(FINAL_WRITE_BOUND, &mut writer.0)
        .await
        .is_err()
    {
        tracing::warn!("the drain's final status was not written in time");
    }
}

/// Longest wait for a finished drain's last `status.drain` write.
const FINAL_WRITE_BOUND: Duration = Duration::from_secs(10);

/// The longest the stateless evictions of a pass wait for the head of its
/// stateful chain (see `evict_and_move`).
const HEAD_FIRST: Duration = Duration::from_secs(1);

/// How long after its grace period a pod evicted in a pass is waited for
/// there, before the next pass takes it as a pod being deleted.
const LEFT_TO_NEXT_PASS: Duration = Duration::from_secs(5);

/// The pods of a pass that wait for their workload's permit, each as
/// (`uid`, what it waits for), and whether a stateful move stalled (the
/// chain halted for this pass).
#[derive(Default)]
struct BudgetWaits {
    pods: Vec<(String, String)>,
    halted: bool,
}

/// What wakes a pass that waits for a permit, each subscribed before the
/// pass asked: a permit of this process freed, a Machine gone, a
/// workload's availability changed, a permit changed in the API server.
struct BudgetWakes {
    freed: watch::Receiver<u64>,
    gone: watch::Receiver<u64>,
    workloads: watch::Receiver<u64>,
    permits: watch::Receiver<u64>,
}

impl From<(BudgetWaits, BudgetWaits)> for BudgetWaits {
    fn from((a, b): (BudgetWaits, BudgetWaits)) -> Self {
        let mut pods = a.pods;
        pods.extend(b.pods);
        Self {
            pods,
            halted: a.halted || b.halted,
        }
    }
}

/// What a pass found and did.
enum Pass {
    /// Nothing was left to do.
    Done,
    /// Work was done, or waited for; plan again.
    Again,
}

impl NodeDrain {
    /// Passes until nothing is left. Before the deadline a pass honours
    /// every PodDisruptionBudget. After it, with `forceAfterDeadline`, the
    /// passes go on with budgets bypassed (see [`NodeDrain::evict`]) and volumes
    /// still honoured, until a pass moves nothing; without it, one last
    /// pass tries each pod once more and the drain fails with what is left.
    async fn passes(&self) -> Outcome {
        loop {
            if self.expired() && !self.job.settings.force_after_deadline {
                return self.at_deadline().await;
            }
            let expired = self.expired();
            let before = self.work_done();
            match self.pass().await {
                Pass::Done => return self.ended(),
                Pass::Again if expired && self.work_done() == before => return self.stalled(),
                Pass::Again => {}
            }
        }
    }

    /// Nothing is left: drained, or forced if budgets were bypassed.
    fn ended(&self) -> Outcome {
        let pods = self.forced_pods();
        if pods.is_empty() {
            Outcome::Drained
        } else {
            Outcome::Forced { pods }
        }
    }

    /// After the deadline, a pass moved nothing: the pods left cannot be
    /// removed now. The drain fails naming them, and is retried later.
    fn stalled(&self) -> Outcome {
        self.unless_drained("could not be removed")
    }

    /// Drained (or forced) if no pod holds the drain any more; otherwise
    /// failed, naming the pods left and why, after the deadline.
    fn unless_drained(&self, why: &str) -> Outcome {
        let left = self.left();
        if left.is_empty() {
            return self.ended();
        }
        Outcome::Failed {
            message: format!(
                "drain deadline of {} passed and {} pods {why}: {}",
                humantime::format_duration(self.job.deadline.timeout),
                left.len(),
                left.join(", ")
            ),
        }
    }

    /// The pods that still hold the drain, each with why.
    fn left(&self) -> Vec<String> {
        let plan = self.plan();
        let group = plan.current_group(|t| !self.released(t));
        let evictable = plan.stateless.iter().chain(plan.stateful.iter()).map(|p| {
            let pdb = p.pdbs.iter().find(|f| f.verdict != PdbVerdict::Allows);
            let after = group
                .filter(|g| p.order > *g)
                .map(|g| format!("order group {}, after order group {g}", p.order));
            let why = p
                .held
                .as_deref()
                .or(after.as_deref())
                .or_else(|| pdb.map(|f| f.description.as_str()))
                .unwrap_or("not evicted in time");
            format!("{} ({why})", fmt_key(&p.pod))
        });
        let terminating = plan
            .terminating
            .iter()
            .filter(|t| !self.released(t))
            .map(|t| format!("{} (still terminating)", fmt_key(&t.pod)));
        let finished = plan
            .to_delete
            .iter()
            .map(|t| format!("{} (finished, not yet deleted)", fmt_key(&t.pod)));
        let waiting = plan.waiting.iter().map(|p| {
            format!(
                "{} (not completed; drain rule {}=wait-completed)",
                fmt_key(&p.pod),
                crate::drain::rules::DRAIN_ANNOTATION
            )
        });
        evictable
            .chain(waiting)
            .chain(terminating)
            .chain(finished)
            .collect()
    }

    /// One pass, in named stages: count what is left (done when nothing
    /// is); wait for a workload of an earlier group held for its
    /// replacement; enter the lowest order group with a pod left; delete
    /// the finished pods; then evict and move the group's pods
    /// ([`NodeDrain::evict_and_move`]).
    async fn pass(&self) -> Pass {
        let full = self.plan();
        self.moves_left.store(
            u32::try_from(full.stateful.len()).unwrap_or(u32::MAX),
            Ordering::Release,
        );
        let leftover = self.not_abandoned(&full.detaching);
        // A move an earlier run recorded whose pod is gone is resumed
        // (its volumes waited for) even when nothing else is left: a
        // restart during the last pod's reattach wait must not end the
        // drain with the move still recorded.
        if self.count_left(&full) == 0 && leftover.is_empty() && !self.any_resumable() {
            self.hand_over_held();
            return Pass::Done;
        }
        self.announce_rules(&full);
        // One order group a pass: the lowest with a pod left. A later group,
        // and any after the default one, evicts nothing before the volumes
        // of the pods that left are off the Node (`gated`).
        let group = full.current_group(|t| !self.released(t));
        if self.held_before(group).await {
            return Pass::Again;
        }
        let gated = group.is_some_and(|g| self.enter_group(&full, g));
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
        if self.expired()
            && group.is_some()
            && self.plan().current_group(|t| !self.released(t)) != group
        {
            self.step(|_| {});
        }
        Pass::Again
    }

    /// The pods `plan` still has to remove, in the progress: how many.
    fn count_left(&self, plan: &DrainPlan) -> usize {
        let holding = plan
            .terminating
            .iter()
            .filter(|t| !self.released(t))
            .count();
        let remaining = plan.stateless.len()
            + plan.stateful.len()
            + plan.waiting.len()
            + holding
            + plan.to_delete.len();
        self.update(|p| {
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
        let (Some(g), Some(h)) = (group, self.held_order()) else {
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
        self.update(|p| p.waiting_for = Some(why));
        self.wait_pods_until(self.deadline(), || self.any_placed())
            .await;
        self.resume_placed().await;
    }

    /// The group's evictions and moves, at once: the pods without volumes
    /// evicted ([`NodeDrain::evict_stateless`]); the volumes of pods that
    /// left waited for ([`NodeDrain::volumes_off`]), then the stateful
    /// pods moved in order ([`NodeDrain::move_stateful`]); the pods
    /// already terminating waited for; and the pods a drain rule says to
    /// wait on, once the evictions are done. When `gated`, nothing is
    /// evicted before the volumes are off.
    async fn evict_and_move(&self, plan: &DrainPlan, leftover: Vec<DetachingVolume>, gated: bool) {
        // Subscribed before any ask: a permit freed between an ask and the
        // wait for one is not missed.
        let mut freed = self.deps.permits.freed();
        freed.borrow_and_update();
        let mut gone = self.deps.caches.machines_gone.clone();
        gone.borrow_and_update();
        let mut workloads = self.deps.caches.workload_changes.clone();
        workloads.borrow_and_update();
        let mut permits = self.deps.caches.permit_changes.clone();
        permits.borrow_and_update();
        let terminating = futures::future::join_all(
            plan.terminating
                .iter()
                .filter(|t| t.pvs.is_empty() && !self.released(t))
                .map(|t| self.wait_terminating(t)),
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
        let waiting = self.wait_completed(&plan.waiting);
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
        let mut wakes = BudgetWakes {
            freed,
            gone,
            workloads,
            permits,
        };
        self.wait_for_budget(waits.into(), &mut wakes).await;
    }

    /// The pods of this pass that wait for their workload's permit (`uid`,
    /// what each waits for): this Machine waits in the ledger's line for
    /// them only, `status.drain` names them, and unless a stateful move of
    /// this pass stalled (`halted`), the pass waits until a permit of this
    /// process frees or an ask is withdrawn (then the next pass asks
    /// again) or one of another process's permits changed, a Machine that
    /// may have held a permit is gone, a workload's
    /// availability may have changed (a replica down for another reason
    /// holds its budget too), a stalled move of this drain can go on (its
    /// volumes are off the Node), or the deadline.
    async fn wait_for_budget(&self, waits: BudgetWaits, wakes: &mut BudgetWakes) {
        let uids: Vec<String> = waits.pods.iter().map(|(uid, _)| uid.clone()).collect();
        self.deps.permits.keep_waiting(&self.machine_key(), &uids);
        let why = (!waits.pods.is_empty()).then(|| {
            let why: Vec<&str> = waits.pods.iter().map(|(_, why)| why.as_str()).collect();
            why.join("; ")
        });
        self.update(|p| p.waiting_for_budget = why.clone());
        let Some(why) = why else { return };
        if waits.halted {
            return;
        }
        self.update(|p| p.waiting_for = Some(why));
        tokio::select! {
            _ = wakes.freed.changed() => {}
            _ = wakes.gone.changed() => {}
            _ = wakes.workloads.changed() => {}
            _ = wakes.permits.changed() => {}
            () = self.stalled_detached(self.deadline()) => {}
            () = tokio::time::sleep_until(self.deadline()) => {}
        }
    }

    /// Evicts the pods without volumes, at most `maxConcurrentEvictions`
    /// requests in flight, and waits for them to go. Waiting costs nothing
    /// but a watch receiver each, so every evicted pod is waited for at
    /// once. Evictions accepted together are announced in one Event (see
    /// `batch`).
    async fn evict_stateless(&self, plan: &DrainPlan) -> BudgetWaits {
        // A pod of a workload that bounds its moves asks the ledger first;
        // one that must wait is left to a later pass.
        let mut waits = BudgetWaits::default();
        let mut going = Vec::new();
        for p in &plan.stateless {
            match self.stateless_gate(p).await {
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
            .map(|(p, gate)| async move { (*p, gate, self.evict(p).await) })
            .collect();
        let mut results = futures::stream::iter(evictions)
            .buffer_unordered(self.job.settings.max_concurrent_evictions.max(1) as usize);
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
                    Some((p, Some(gate), Eviction::Expired)) => self.release_gate(p, gate),
                    Some((_, None, Eviction::Expired)) => {}
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
            .map(|(p, gate)| async move {
                // Until its grace period is over and a little more: one
                // still there then is left to the next pass, which names
                // what holds it (`wait_terminating`), and keeps its permit.
                let until = self.bounded(p.grace.saturating_add(LEFT_TO_NEXT_PASS));
                if self.wait_gone(&p.pod, p.uid.as_deref(), until).await
                    && let Some(gate) = gate
                {
                    self.end_stateless_move(p, gate).await;
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
        for t in going.iter().filter(|t| !self.released(t)) {
            self.update(|p| {
                p.current_pod = Some(fmt_key(&t.pod));
                p.waiting_for = Some(format!("pod {} to terminate", fmt_key(&t.pod)));
            });
            self.wait_terminating(t).await;
        }
        let leftover = if going.is_empty() {
            leftover
        } else {
            self.detaching()
        };
        // Moves in flight that a previous run recorded (the controller
        // restarted after an eviction, a pod gone or a detach): each goes
        // on from its pod gone on, and ends before the next stateful
        // eviction.
        let resumed = self.resumed_moves();
        let mut recorded: BTreeSet<String> = resumed
            .iter()
            .flat_map(|m| m.volumes.iter().cloned())
            .collect();
        recorded.extend(self.held_volumes());
        futures::future::join_all(resumed.iter().map(|m| self.resume(m))).await;
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
    /// its workload's permit (see [`NodeDrain::stalled_move`]), so the next pass
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
    ) -> BudgetWaits {
        let halted = AtomicBool::new(false);
        let held = AtomicBool::new(false);
        let waiting: std::sync::Mutex<Vec<(String, String)>> = Default::default();
        let migrations: Vec<_> = plan
            .stateful
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (halted, held, waiting) = (&halted, &held, &waiting);
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
                    if self.workload_held(p.controller.as_deref()) {
                        held.store(true, Ordering::Release);
                        head_done();
                        return;
                    }
                    // The workload's budget across every drain: a pod that
                    // must wait for it is left to a later pass, and the
                    // chain goes on with other workloads.
                    let (workload, early) = tokio::join!(self.permit(p), self.record_early(p));
                    let workload = match workload {
                        Ok(workload) => {
                            let _ = self.moves_left.fetch_update(
                                Ordering::AcqRel,
                                Ordering::Acquire,
                                |n| Some(n.saturating_sub(1)),
                            );
                            workload
                        }
                        Err(why) => {
                            if early {
                                self.withdraw_record(p);
                            }
                            if let Ok(mut w) = waiting.lock() {
                                w.push((p.uid.clone().unwrap_or_else(|| fmt_key(&p.pod)), why));
                            }
                            head_done();
                            return;
                        }
                    };
                    let moved = self.migrate(plan, p, head).await;
                    head_done();
                    self.end_unrecorded_permit(p, &workload);
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
            .buffer_unordered(self.job.settings.max_parallel_volume_migrations.max(1) as usize)
            .collect::<Vec<()>>()
            .await;
        if held.load(Ordering::Acquire) {
            self.wait_pods_until(self.deadline(), || self.any_placed())
                .await;
        }
        BudgetWaits {
            pods: waiting.into_inner().unwrap_or_default(),
            halted: halted.load(Ordering::Acquire),
        }
    }

    /// Resumes the moves held for a replacement the scheduler could not
    /// place, now placed (or past the deadline), by the rules of a first
    /// run ([`NodeDrain::resume`]): the volumes attach where the replacement
    /// runs, a ReadWriteMany peer that used them elsewhere before the move
    /// is not taken for it.
    async fn resume_placed(&self) {
        let placed = self.placed_workloads();
        for m in &placed {
            self.update(|p| p.unblock(&m.pod));
        }
        futures::future::join_all(placed.iter().map(|m| self.resume(m))).await;
    }

    /// Deletes the pods that finished (Succeeded or Failed).
    async fn delete_finished(&self, plan: &DrainPlan) {
        for p in &plan.to_delete {
            let Some(pod) = self.view().pod(&p.pod, p.uid.as_deref()) else {
                continue;
            };
            match pod_writes::delete(&self.client, &pod, None).await {
                Evicted::Accepted | Evicted::Gone => {
                    self.deps.metrics.record_eviction(EvictionResult::Deleted);
                    self.count_evicted(&p.pod);
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
        let interest = leftover.iter().fold(Interest::new(&self.job.node), |i, v| {
            i.volume(v.pv.clone(), v.unique_name.clone())
        });
        let names: Vec<&str> = leftover.iter().map(|v| v.pv.as_str()).collect();
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
            .wait_detached(self.volume_bound(self.job.settings.volume_detach_timeout))
            .await
        {
            Ok(()) => {
                self.deps
                    .metrics
                    .volume_detach_wait
                    .observe(started.elapsed().as_secs_f64());
                // A completed step: progress for a pass after the deadline.
                self.step(|p| p.waiting_for = None);
                self.event(
                    EventType::Normal,
                    "VolumeDetached",
                    format!("{} detached from Node {}", names.join(", "), self.job.node),
                    leftover.first().and_then(|v| pv_ref(&v.pv)),
                );
            }
            Err(e) => {
                self.abandon(leftover.iter().map(|v| v.pv.clone()));
                self.warn_volume(
                    "VolumeDetachTimeout",
                    &e,
                    leftover.first().map(|v| v.pv.as_str()),
                );
                return;
            }
        }
        // And attached where a pod still needs them, unless the deadline
        // passed (availability is what it gives up).
        if self.expired() {
            return;
        }
        // Each volume whose claim a pod still needs, with that claim.
        let view = self.view();
        let needed: Vec<(&str, NamespacedName)> = names
            .iter()
            .filter_map(|pv| Some((*pv, view.claim_of(pv)?)))
            .filter(|(_, claim)| view.replacement_expected(claim, ""))
            .collect();
        if needed.is_empty() {
            return;
        }
        self.update(|p| {
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
        let until = self.bounded(self.job.settings.volume_reattach_timeout);
        // The pods gone are not known by UID here (they left before this
        // run): every pod that uses the claim on another Node counts.
        let none = BTreeSet::new();
        let volumes: Vec<Awaited> = needed
            .iter()
            .map(|(pv, claim)| Awaited {
                pv,
                claim,
                class: VolumeKind::Attachable,
                users_before: &none,
            })
            .collect();
        self.await_reattach(&mut reg, &volumes, "", false, detached_at, until)
            .await;
    }

    /// The deadline passed without `forceAfterDeadline`: one last pass
    /// tries each pod once more (a budget may have been relaxed since),
    /// stateful pods still one at a time with their volume waits; then the
    /// drain fails with what is left, and the reconciler runs it again
    /// later.
    async fn at_deadline(&self) -> Outcome {
        self.start_last_try();
        if let Pass::Done = self.pass().await {
            return self.ended();
        }
        self.unless_drained("are left and forceAfterDeadline=false")
    }
}
