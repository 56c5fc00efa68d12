//! One pod's eviction through the Eviction API, retried while a
//! PodDisruptionBudget refuses it: with exponential backoff and jitter, and
//! at once when a budget in the pod's namespace changes. After
//! `maxEvictRetries` refusals, or at once for a misconfigured budget, the
//! pod is reported as blocked, naming the budget. A budget is bypassed only
//! at the deadline, with `forceAfterDeadline`: the pod is then deleted with
//! its own grace period, at the deadline minus that grace period.

use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::runtime::events::EventType;
use tokio::time::Instant;

use super::node_drain::NodeDrain;
use super::reports::pod_ref;
use crate::drain::pdb::{PdbVerdict, findings_for};
use crate::drain::plan::PlannedPod;
use crate::drain::pod_writes::{self, Evicted};
use crate::drain::select::fmt_key;
use crate::telemetry::EvictionResult;

/// Longest pause between two eviction attempts of a refused pod.
const MAX_EVICT_BACKOFF: Duration = Duration::from_secs(30);

/// What became of one pod's eviction.
#[derive(Debug)]
pub(super) enum Eviction {
    /// The API server accepted it (perhaps after refusals).
    Accepted(ObjectReference),
    /// The deadline came first: the pod was deleted, its budget bypassed,
    /// with its own grace period (and a Warning says so).
    Forced,
    /// The pod was gone already, or replaced by one of the same name.
    Gone,
    /// The drain's deadline passed first.
    Expired,
    /// A PodDisruptionBudget refused it, and the pod counts as stuck
    /// (its budget can never let it go as it is, or `maxEvictRetries`
    /// refusals): the caller asks for a surge instead (see `surge`).
    Refused,
    /// Its surge waits for its workload's permit: what it waits for.
    Waits(String),
}

/// What one attempt's answer means.
enum Answered {
    /// Try again after this pause (or when a budget changes).
    Retry(Duration),
    /// The eviction is over.
    Done(Eviction),
}

/// One pod's eviction, with its retry state.
pub(super) struct PodEviction<'d> {
    d: &'d NodeDrain,
    planned: &'d PlannedPod,
    /// Refusals by a PodDisruptionBudget so far.
    refusals: u32,
    /// Failures in a row that are neither a budget nor throttling.
    failures: u32,
    /// Failures after the deadline, where nothing else ends the retries.
    failures_after_deadline: u32,
    backoff: backon::ExponentialBackoff,
    /// A refusal by a budget that makes the pod stuck ends the eviction
    /// with [`Eviction::Refused`], for a surge to be asked for.
    surge_on_refusal: bool,
}

impl<'d> PodEviction<'d> {
    pub(super) fn new(d: &'d NodeDrain, planned: &'d PlannedPod) -> Self {
        Self {
            d,
            planned,
            refusals: 0,
            failures: 0,
            failures_after_deadline: 0,
            backoff: evict_backoff(),
            surge_on_refusal: false,
        }
    }

    /// A refusal that makes the pod stuck ends the eviction (see
    /// [`Eviction::Refused`]).
    pub(super) fn surging_on_refusal(self) -> Self {
        Self {
            surge_on_refusal: true,
            ..self
        }
    }

    /// Evicts one pod, retrying refusals, and says what became of it. The
    /// caller announces an accepted eviction (refusals are announced here).
    ///
    /// With `forceAfterDeadline`, a pod still not evicted at the deadline
    /// minus its grace period is deleted instead, the PodDisruptionBudget
    /// bypassed, so that it still gets its whole grace period by the
    /// deadline. Without it, after the deadline one eviction is tried (the
    /// drain's last try) and a refusal ends it.
    pub(super) async fn run(mut self) -> Eviction {
        let planned = self.planned;
        let key = fmt_key(&planned.pod);
        let Some(pod) = self.d.view().pod(&planned.pod, planned.uid.as_deref()) else {
            return Eviction::Gone;
        };
        let force_at = self.d.clock.force_at(planned.grace);
        loop {
            let forcing = force_at.is_some_and(|at| Instant::now() >= at);
            if !forcing && self.d.clock.expired() && (!self.d.clock.last_try() || self.refusals > 0)
            {
                return Eviction::Expired;
            }
            let mut pdb_changes = self.d.deps.caches.pdb_changes.clone();
            pdb_changes.borrow_and_update();
            // The pod's own budgets as they are before this attempt: a
            // change of one of them from now on ends the pause at once.
            let own = |caches: &crate::cache::Caches| {
                let pdbs = caches.pdbs.state();
                crate::drain::pdb::covering(&pod, pdbs.iter().map(AsRef::as_ref))
            };
            let budgets = own(&self.d.deps.caches);
            // A stateful move's eviction is a step the next replica waits
            // for.
            let client = if planned.volumes.is_empty() {
                &self.d.clients.rest
            } else {
                &self.d.clients.moves
            };
            let answer = if forcing {
                pod_writes::delete(client, &pod, None).await
            } else {
                pod_writes::evict(client, &pod).await
            };
            let pause = match self.answered(answer, &pod, &key, forcing) {
                Answered::Retry(pause) => pause,
                Answered::Done(done) => return done,
            };
            // Retry after the pause, or as soon as one of the pod's own
            // PodDisruptionBudgets changes (not any budget of the cluster:
            // the disruption controller rewrites every budget's status as
            // its pods come and go), or when the pod is due to be deleted,
            // or give up at the deadline.
            let until = Instant::now() + pause;
            let stop =
                force_at.map_or_else(|| self.d.clock.deadline(), |at| at.max(Instant::now()));
            let pause = tokio::time::sleep_until(until.min(stop));
            tokio::pin!(pause);
            loop {
                tokio::select! {
                    _ = &mut pause => break,
                    changed = pdb_changes.changed() => {
                        if changed.is_err() || own(&self.d.deps.caches) != budgets {
                            break;
                        }
                    }
                }
            }
            if self
                .d
                .view()
                .pod(&planned.pod, planned.uid.as_deref())
                .is_none()
            {
                return Eviction::Gone;
            }
        }
    }

    /// What an answer to the eviction of `pod` means: the pause before the
    /// next attempt, or what became of the eviction.
    fn answered(&mut self, answer: Evicted, pod: &Pod, key: &str, forcing: bool) -> Answered {
        let pause = match answer {
            Evicted::Accepted => return Answered::Done(self.accepted(pod, forcing)),
            Evicted::Gone => return Answered::Done(Eviction::Gone),
            Evicted::Refused { message } => {
                self.refusals += 1;
                let stuck = self.refused(pod, key, self.refusals, &message);
                if stuck && self.surge_on_refusal && !forcing {
                    return Answered::Done(Eviction::Refused);
                }
                if stuck {
                    MAX_EVICT_BACKOFF
                } else {
                    self.backoff.next().unwrap_or(MAX_EVICT_BACKOFF)
                }
            }
            Evicted::Throttled {
                message,
                retry_after,
            } => {
                // Not a budget: nothing to report as a block, and it
                // counts as no refusal.
                self.d
                    .deps
                    .metrics
                    .record_eviction(EvictionResult::Throttled);
                tracing::info!(pod = %key, %message, ?retry_after, "eviction throttled by the API server");
                retry_after
                    .map(|d| d.min(MAX_EVICT_BACKOFF))
                    .or_else(|| self.backoff.next())
                    .unwrap_or(MAX_EVICT_BACKOFF)
            }
            Evicted::MultipleBudgets { message } => {
                self.refusals += 1;
                self.budgets_conflict(pod, key, self.refusals, &message);
                MAX_EVICT_BACKOFF
            }
            Evicted::Failed(e) => {
                self.d.deps.metrics.record_eviction(EvictionResult::Error);
                self.failures += 1;
                self.failing(pod, key, self.failures, &e);
                tracing::warn!(pod = %key, forcing, error = %e, "eviction failed");
                if self.d.clock.expired() {
                    // After the deadline nothing else ends the retries.
                    self.failures_after_deadline += 1;
                    if self.failures_after_deadline >= self.d.job.settings.max_evict_retries.max(1)
                    {
                        return Answered::Done(Eviction::Expired);
                    }
                }
                self.backoff.next().unwrap_or(MAX_EVICT_BACKOFF)
            }
        };
        Answered::Retry(pause)
    }

    /// The eviction (or, `forcing`, the deletion) of `pod` was accepted:
    /// counted, its block cleared, and a forced one said.
    fn accepted(&self, pod: &Pod, forcing: bool) -> Eviction {
        let planned = self.planned;
        let key = fmt_key(&planned.pod);
        self.d.deps.metrics.record_eviction(if forcing {
            EvictionResult::Forced
        } else {
            EvictionResult::Evicted
        });
        self.d.count_evicted(&planned.pod);
        self.d.tally.evicted(pod, planned.controller.as_deref());
        self.d.progress.update(|p| p.unblock(&key));
        if !forcing {
            return Eviction::Accepted(pod_ref(pod));
        }
        self.d.tally.forced(&planned.pod);
        self.d.reports.event(
            EventType::Warning,
            "ForcedAtDeadline",
            format!(
                "deleted pod {key} with its grace period of {}s, its PodDisruptionBudget bypassed: the drain deadline is at {}",
                planned.grace.as_secs(),
                self.d
                    .job
                    .deadline
                    .expires_at()
                    .map_or_else(String::new, |t| t.to_string())
            ),
            Some(pod_ref(pod)),
        );
        Eviction::Forced
    }

    /// Records a refusal (429) of pod `key`'s eviction, the `refusals`-th,
    /// and says whether the pod counts as stuck: after `maxEvictRetries`
    /// refusals, or at once for a misconfigured budget (a Warning says so
    /// once, naming the budget). Stuck, it is retried at the backoff's
    /// ceiling.
    fn refused(&self, pod: &Pod, key: &str, refusals: u32, message: &str) -> bool {
        let pdbs = self.d.view().pdbs_for(std::slice::from_ref(pod));
        let findings = findings_for(pod, &pdbs);
        let misconfigured = findings
            .iter()
            .find(|f| f.verdict == PdbVerdict::Misconfigured);
        let blocking = misconfigured
            .or_else(|| findings.iter().find(|f| f.verdict != PdbVerdict::Allows))
            .map_or_else(|| message.to_string(), |f| f.description.clone());
        let stuck = misconfigured.is_some() || refusals >= self.d.job.settings.max_evict_retries;
        self.d
            .deps
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
        let warn = (stuck && refusals == self.d.job.settings.max_evict_retries.max(1))
            || (misconfigured.is_some() && refusals == 1);
        self.blocked(pod, key, "EvictionBlocked", why, warn);
        stuck
    }

    /// Names pod `key` as what blocks the drain (`blockedBy`), with a
    /// Warning of `reason` when `warn` (each caller warns once).
    fn blocked(&self, pod: &Pod, key: &str, reason: &str, why: String, warn: bool) {
        if warn {
            self.d
                .reports
                .event(EventType::Warning, reason, why.clone(), Some(pod_ref(pod)));
        }
        self.d.progress.update(|p| p.block(key, why));
    }

    /// More than one PodDisruptionBudget selects the pod, and the Eviction
    /// API refuses such a pod (500) until someone fixes the budgets: named
    /// at once (a Warning, once, and `blockedBy`), and retried at the
    /// backoff's ceiling or when a budget changes.
    fn budgets_conflict(&self, pod: &Pod, key: &str, refusals: u32, message: &str) {
        self.d
            .deps
            .metrics
            .record_eviction(EvictionResult::MisconfiguredPdb);
        let pdbs = self.d.view().pdbs_for(std::slice::from_ref(pod));
        let names: Vec<String> = findings_for(pod, &pdbs)
            .iter()
            .map(|f| crate::drain::select::fmt_key(&f.pdb))
            .collect();
        let which = if names.is_empty() {
            String::new()
        } else {
            format!(" ({})", names.join(", "))
        };
        let why = format!(
            "pod {key}: more than one PodDisruptionBudget selects it{which}; the Eviction API refuses to evict it until only one does: {message}"
        );
        self.blocked(pod, key, "EvictionBlocked", why, refusals == 1);
    }

    /// The `failures`-th eviction of pod `key` failed with an answer that is
    /// neither a budget nor throttling (a webhook's refusal, a server
    /// error, the network): after `maxEvictRetries` in a row it is named (a
    /// Warning, once, and `blockedBy`) while the retries go on.
    fn failing(&self, pod: &Pod, key: &str, failures: u32, error: &kube::Error) {
        let after = self.d.job.settings.max_evict_retries.max(1);
        if failures < after {
            return;
        }
        let why = format!("pod {key}: eviction failed {failures} times: {error}");
        self.blocked(pod, key, "EvictionFailing", why, failures == after);
    }
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
