//! The pods a drain rule says to wait on (`wait-completed`): never
//! evicted, waited on until each succeeds, fails or is gone, bounded by
//! the deadline.

use futures::future::join_all;
use kube::runtime::events::EventType;
use tokio::time::Instant;

use super::node_drain::NodeDrain;
use super::reports::{pod_ref, pod_ref_key};
use crate::drain::plan::PlannedPod;
use crate::drain::pod_writes::{self, Evicted};
use crate::drain::select::{finished, fmt_key};
use crate::telemetry::EvictionResult;

/// One order group's pods waited on to complete.
#[derive(Clone, Copy)]
pub(super) struct WaitCompleted<'d> {
    d: &'d NodeDrain,
}

impl<'d> WaitCompleted<'d> {
    pub(super) fn new(d: &'d NodeDrain) -> Self {
        Self { d }
    }

    /// Waits for the pods a drain rule says to wait on (never evicted)
    /// until each succeeds, fails or is gone, naming them in
    /// `status.drain.waitingFor`. Bounded by the deadline: with
    /// `forceAfterDeadline` a pod still running at the deadline minus its
    /// grace period is deleted with its grace period (a Warning says so);
    /// without it the wait ends at the deadline and the drain fails naming
    /// it.
    pub(super) async fn run(self, pods: &[PlannedPod]) {
        let Some(first) = pods.first() else {
            return;
        };
        let names: Vec<String> = pods.iter().map(|p| fmt_key(&p.pod)).collect();
        let mut rules: Vec<String> = pods.iter().map(PlannedPod::rule_words).collect();
        rules.sort();
        rules.dedup();
        let at_deadline = if self.d.job.settings.force_after_deadline {
            "at the drain deadline minus its grace period it is deleted with its grace period"
        } else {
            "at the drain deadline the drain fails naming it (forceAfterDeadline is false)"
        };
        for p in pods {
            let uid = p.uid.clone().unwrap_or_else(|| fmt_key(&p.pod));
            if self.d.reports.first(format!("wait-completed/{uid}")) {
                self.d.reports.event(
                    EventType::Normal,
                    "WaitingForCompletion",
                    format!(
                        "pod {} is not evicted (drain rule {}): the drain waits until it succeeds, fails or is gone; {at_deadline}",
                        fmt_key(&p.pod),
                        p.rule_words()
                    ),
                    Some(pod_ref_key(&p.pod)),
                );
            }
        }
        let waiting = format!(
            "pod {} to complete (drain rule {}, never evicted)",
            names.join(", "),
            rules.join(", ")
        );
        self.d.progress.update(|p| {
            p.current_pod = Some(fmt_key(&first.pod));
            p.waiting_for = Some(waiting.clone());
        });
        join_all(pods.iter().map(|p| self.one(p))).await;
        self.d.progress.update(|p| {
            if p.waiting_for.as_deref() == Some(waiting.as_str()) {
                p.current_pod = None;
                p.waiting_for = None;
            }
        });
    }

    /// One pod of [`WaitCompleted::run`].
    async fn one(self, p: &PlannedPod) {
        let uid = p.uid.as_deref();
        let done = || {
            self.d
                .view()
                .pod(&p.pod, uid)
                .is_none_or(|pod| finished(&pod) || pod.metadata.deletion_timestamp.is_some())
        };
        let force_at = self.d.clock.force_at(p.grace);
        let until = force_at.unwrap_or_else(|| self.d.clock.deadline());
        if self.d.waits().pods_until(until, done).await {
            return;
        }
        if force_at.is_none_or(|at| Instant::now() < at) {
            return;
        }
        let Some(pod) = self.d.view().pod(&p.pod, uid) else {
            return;
        };
        let key = fmt_key(&p.pod);
        match pod_writes::delete(&self.d.clients.rest, &pod, None).await {
            Evicted::Accepted => {
                self.d.deps.metrics.record_eviction(EvictionResult::Forced);
                self.d.count_evicted(&p.pod);
                self.d.tally.forced(&p.pod);
                self.d.reports.event(
                    EventType::Warning,
                    "ForcedAtDeadline",
                    format!(
                        "deleted pod {key}, which its drain rule {} said to wait on, with its grace period of {}s: it had not completed and the drain deadline is at {}",
                        p.rule_words(),
                        p.grace.as_secs(),
                        self.d.job
                            .deadline
                            .expires_at()
                            .map_or_else(String::new, |t| t.to_string())
                    ),
                    Some(pod_ref(&pod)),
                );
            }
            Evicted::Gone => {}
            other => {
                tracing::warn!(pod = %key, result = ?other, "could not delete a pod waited on to complete");
            }
        }
    }
}
