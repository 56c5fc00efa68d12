//! A drain from its first pass to its outcome: the passes, until one finds
//! nothing left or the deadline passes; then the pods left are forced, or
//! the drain fails saying which are left and why.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::node_drain::NodeDrain;
use super::pass::{Pass, PassEnd};
use super::permits::DrainPermits;
use super::progress::{Flushed, ProgressTx, wake_on_block, write_status};
use super::records::MoveRecords;
use super::reports::Memory;
use super::{Deps, Job, Outcome, Progress};
use crate::api::Machine;
use crate::controller::AbortOnDrop;
use crate::drain::pdb::PdbVerdict;
use crate::drain::select::fmt_key;
use crate::telemetry::GaugeHold;

/// Longest wait for a finished drain's last `status.drain` write.
const FINAL_WRITE_BOUND: Duration = Duration::from_secs(10);

/// Runs the drain of `job` to its outcome, which `progress` carries at the
/// end (and its writer writes to `status.drain`).
pub(super) async fn run(
    deps: Arc<Deps>,
    job: Job,
    progress: watch::Sender<Progress>,
    written: watch::Sender<Option<Machine>>,
    data_loss_allowed: watch::Receiver<bool>,
    memory: Arc<Mutex<Memory>>,
    wake: mpsc::UnboundedSender<ObjectRef<Machine>>,
) {
    let (steps_written, flushed) = watch::channel(Flushed::default());
    let in_progress = GaugeHold::new(&deps.metrics.drains_in_progress);
    let started = std::time::Instant::now();
    let d = NodeDrain::new(
        Arc::clone(&deps),
        job,
        ProgressTx::new(progress, flushed),
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
        [d.clients.rest.clone(), d.clients.moves.clone()],
        d.job.machine.clone(),
        d.job.deadline.started,
        d.progress.subscribe(),
        written,
        steps_written,
    )));
    let _reporter = AbortOnDrop(tokio::spawn(wake_on_block(
        d.progress.subscribe(),
        d.job.machine.clone(),
        d.wake.clone(),
    )));
    // Permits an earlier run of this Machine's drain was granted and did
    // not record (it stopped in between) are free; those it recorded are
    // its moves in flight, resumed below.
    DrainPermits::new(&d).release_unrecorded();
    MoveRecords::new(&d).announce_resumed();
    let outcome = Passes { d: &d }.run().await;
    DrainPermits::new(&d).release_unrecorded();
    drop(in_progress);
    deps.metrics
        .record_drain(outcome.label(), started.elapsed());
    tracing::info!(outcome = outcome.label(), took = ?started.elapsed(), "drain finished");
    Passes { d: &d }.end(outcome);
    // The writer writes the final state once the drain lets go of it; the
    // reconciler is woken (by the caller) once it is written, or given up.
    drop(d);
    if tokio::time::timeout(FINAL_WRITE_BOUND, &mut writer.0)
        .await
        .is_err()
    {
        tracing::warn!("the drain's final status was not written in time");
    }
}

/// The passes of one drain, and its outcome.
struct Passes<'d> {
    d: &'d NodeDrain,
}

impl Passes<'_> {
    /// The drain's one Event for its outcome, and the outcome in its
    /// progress.
    fn end(&self, outcome: Outcome) {
        match &outcome {
            Outcome::Drained => self.d.reports.event(
                EventType::Normal,
                "Drained",
                format!("Node {} drained", self.d.job.node),
                None,
            ),
            Outcome::Forced { pods } => self.d.reports.event(
                EventType::Warning,
                "DrainForced",
                format!(
                    "drain deadline passed: deleted {} with their PodDisruptionBudgets bypassed",
                    pods.join(", ")
                ),
                None,
            ),
            Outcome::Failed { message } => {
                self.d
                    .reports
                    .event(EventType::Warning, "DrainFailed", message.clone(), None);
            }
        }
        self.d.progress.send_modify(|p| {
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
    }

    /// Passes until nothing is left. Before the deadline a pass honours
    /// every PodDisruptionBudget. After it, with `forceAfterDeadline`, the
    /// passes go on with budgets bypassed (see
    /// [`PodEviction`](super::eviction::PodEviction)) and volumes still
    /// honoured, until a pass moves nothing; without it, one last pass
    /// tries each pod once more and the drain fails with what is left.
    async fn run(&self) -> Outcome {
        loop {
            if self.d.clock.expired() && !self.d.clock.forces() {
                return self.at_deadline().await;
            }
            let expired = self.d.clock.expired();
            let before = self.d.progress.work_done();
            match Pass::new(self.d).run().await {
                PassEnd::Done => return self.ended(),
                PassEnd::Again if expired && self.d.progress.work_done() == before => {
                    return self.stalled();
                }
                PassEnd::Again => {}
            }
        }
    }

    /// The deadline passed without `forceAfterDeadline`: one last pass
    /// tries each pod once more (a budget may have been relaxed since),
    /// stateful pods still one at a time with their volume waits; then the
    /// drain fails with what is left, and the reconciler runs it again
    /// later.
    async fn at_deadline(&self) -> Outcome {
        self.d.clock.start_last_try();
        if let PassEnd::Done = Pass::new(self.d).run().await {
            return self.ended();
        }
        self.unless_drained("are left and forceAfterDeadline=false")
    }

    /// Nothing is left: drained, or forced if budgets were bypassed.
    fn ended(&self) -> Outcome {
        let pods = self.d.tally.forced_pods();
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
                humantime::format_duration(self.d.job.deadline.timeout),
                left.len(),
                left.join(", ")
            ),
        }
    }

    /// The pods that still hold the drain, each with why.
    fn left(&self) -> Vec<String> {
        let plan = self.d.plan();
        let group = plan.current_group(|t| !self.d.clock.released(t.grace));
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
            .filter(|t| !self.d.clock.released(t.grace))
            .map(|t| format!("{} (still terminating)", fmt_key(&t.pod)));
        let finished = plan
            .to_delete
            .iter()
            .map(|t| format!("{} (finished, not yet deleted)", fmt_key(&t.pod)));
        let waiting = plan.waiting.iter().map(|p| {
            format!(
                "{} (not completed; drain rule {})",
                fmt_key(&p.pod),
                p.rule_words()
            )
        });
        evictable
            .chain(waiting)
            .chain(terminating)
            .chain(finished)
            .collect()
    }
}
