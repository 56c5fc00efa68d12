//! A pod that was already being deleted when a pass found it (evicted
//! before a restart, or by someone else): waited for until it is gone or
//! no longer holds the drain (the deadline plus its grace period). A
//! finalizer that holds it past its grace period is named once; with
//! `forceAfterDeadline`, one that nothing holds is deleted at once at the
//! deadline (the kubelet did not confirm it stopped).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use tokio::time::Instant;

use super::node_drain::NodeDrain;
use super::reports::pod_ref_key;
use crate::drain::plan::TerminatingPod;
use crate::drain::pod_writes::{self, Evicted};
use crate::drain::select::{NamespacedName, fmt_key, held_by_finalizers};
use crate::telemetry::EvictionResult;

/// One pod being deleted, as a drain waits for it.
pub(super) struct Terminating<'d> {
    d: &'d NodeDrain,
    t: &'d TerminatingPod,
}

impl<'d> Terminating<'d> {
    pub(super) fn new(d: &'d NodeDrain, t: &'d TerminatingPod) -> Self {
        Self { d, t }
    }

    /// Waits for a pod that was already being deleted to be gone, until it
    /// no longer holds the drain. If a finalizer still holds it once its
    /// grace period is over, says so once (a Warning, and `blockedBy` while
    /// it holds the drain).
    pub(super) async fn wait(&self) {
        let t = self.t;
        let uid = t.uid.as_deref();
        let release = self.d.clock.release_of(t.grace);
        let grace_ends = Instant::now()
            + Duration::try_from(t.since.duration_since(Timestamp::now())).unwrap_or_default();
        if self
            .d
            .waits()
            .gone(&t.pod, uid, grace_ends.min(release))
            .await
        {
            return;
        }
        let key = fmt_key(&t.pod);
        if let Some(pod) = self.d.view().pod(&t.pod, uid)
            && let Some(finalizers) = held_by_finalizers(&pod, Timestamp::now())
        {
            let first = self
                .d
                .reports
                .first(t.uid.clone().unwrap_or_else(|| key.clone()));
            let until = self
                .d
                .job
                .deadline
                .expires_at()
                .and_then(|d| {
                    let grace = k8s_openapi::jiff::SignedDuration::try_from(t.grace).ok()?;
                    d.checked_add(grace).ok()
                })
                .map_or_else(|| "the deadline".to_string(), |t| t.to_string());
            let why = format!(
                "pod {key} is held by finalizer {} after its grace period; the drain waits for it until {until} (the deadline plus its grace period), then goes on without it",
                finalizers.join(", ")
            );
            if first {
                self.d.reports.event(
                    EventType::Warning,
                    "PodHeldByFinalizer",
                    why.clone(),
                    Some(pod_ref_key(&t.pod)),
                );
            }
            self.d.progress.update(|p| p.hold(&key, why));
        } else if self.d.job.settings.force_after_deadline {
            // Its grace period is over and no finalizer holds it: the kubelet
            // did not confirm it stopped. At the deadline, and only then,
            // such a pod is deleted at once (grace 0).
            if self
                .d
                .waits()
                .gone(&t.pod, uid, self.d.clock.deadline())
                .await
            {
                return;
            }
            if let Some(pod) = self.d.view().pod(&t.pod, uid)
                && held_by_finalizers(&pod, Timestamp::now()).is_none()
            {
                self.force_gone(&t.pod, &pod).await;
            }
        }
        self.d.waits().gone(&t.pod, uid, release).await;
        self.d.progress.update(|p| p.unblock(&key));
    }

    /// Deletes with grace 0 a pod whose grace period already passed.
    async fn force_gone(&self, key: &NamespacedName, pod: &Pod) {
        match pod_writes::delete(&self.d.clients.rest, pod, Some(0)).await {
            Evicted::Accepted => {
                self.d.deps.metrics.record_eviction(EvictionResult::Forced);
                self.d.tally.forced(key);
            }
            Evicted::Gone => {}
            other => {
                tracing::warn!(pod = %fmt_key(key), result = ?other, "force delete failed");
            }
        }
    }
}
