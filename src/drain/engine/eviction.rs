//! One pod's eviction through the Eviction API, retried while a
//! PodDisruptionBudget refuses it: with exponential backoff and jitter, and
//! at once when a budget in the pod's namespace changes. After
//! `maxEvictRetries` refusals, or at once for a misconfigured budget, the
//! pod is reported as blocked, naming the budget. A budget is never
//! bypassed here; only the deadline ends the retries.

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::EventType;
use tokio::time::Instant;

use super::batch::pod_ref;
use super::run::Run;
use crate::drain::evict::{self, Evicted};
use crate::drain::pdb::{PdbVerdict, findings_for};
use crate::drain::plan::PlannedPod;
use crate::drain::select::fmt_key;
use crate::telemetry::EvictionResult;

/// Longest pause between two eviction attempts of a refused pod.
const MAX_EVICT_BACKOFF: Duration = Duration::from_secs(30);

/// What became of one pod's eviction.
#[derive(Debug)]
pub(super) enum Eviction {
    /// The API server accepted it (perhaps after refusals).
    Accepted(ObjectReference),
    /// The pod was gone already, or replaced by one of the same name.
    Gone,
    /// The drain's deadline passed first.
    Expired,
}

impl Run {
    /// Evicts one pod, retrying refusals, and says what became of it. The
    /// caller announces an accepted eviction (refusals are announced here).
    pub(super) async fn evict(&self, planned: &PlannedPod) -> Eviction {
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
                    let findings = findings_for(&pod, &pdbs);
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
