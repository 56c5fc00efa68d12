//! The drain rules and order groups ([`crate::drain::rules`]) as a drain
//! follows them: each pass works on one order group (the lowest with a pod
//! left); pods a rule skips, and rules not understood, are named once; pods
//! a rule says to wait on are waited on until they complete, bounded by the
//! deadline, and never evicted before it.

use futures::future::join_all;
use kube::runtime::events::EventType;
use tokio::time::Instant;

use super::node_drain::NodeDrain;
use super::refs::{pod_ref, pod_ref_key};
use crate::drain::plan::{DrainPlan, PlannedPod};
use crate::drain::pod_writes::{self, Evicted};
use crate::drain::rules::{DRAIN_ANNOTATION, enter_group};
use crate::drain::select::{PodClass, finished, fmt_key};
use crate::telemetry::EvictionResult;

impl NodeDrain {
    /// Says once per pod what its drain rule makes of it: skipped (a
    /// Normal Event), or an annotation not understood (a Warning, the
    /// default used).
    pub(super) fn announce_rules(&self, plan: &DrainPlan) {
        for p in plan.skipped.iter().filter(|p| p.class == PodClass::Skipped) {
            let uid = p.uid.clone().unwrap_or_else(|| fmt_key(&p.pod));
            if self.first_report(format!("skip/{uid}")) {
                self.event(
                    EventType::Normal,
                    "PodSkipped",
                    format!(
                        "pod {} is not evicted: {}",
                        fmt_key(&p.pod),
                        PodClass::Skipped
                    ),
                    Some(pod_ref_key(&p.pod)),
                );
            }
        }
        for (pod, problem) in &plan.rule_problems {
            if self.first_report(format!("rule/{}/{problem}", fmt_key(pod))) {
                self.event(
                    EventType::Warning,
                    "DrainRuleInvalid",
                    format!("pod {}: {problem}", fmt_key(pod)),
                    Some(pod_ref_key(pod)),
                );
            }
        }
    }

    /// A pass works on order group `order` of `plan`: says whether nothing
    /// of it is evicted before the volumes of the pods that left are off
    /// the Node (see [`enter_group`]), and announces a group later than the
    /// last one, once.
    pub(super) fn enter_group(&self, plan: &DrainPlan, order: i32) -> bool {
        let Ok(mut groups) = self.groups.lock() else {
            return false;
        };
        let step = enter_group(*groups, order);
        *groups = Some(step.seen);
        drop(groups);
        if let Some(last) = step.after {
            let group = plan.groups().into_iter().find(|g| g.order == order);
            let why = group
                .as_ref()
                .filter(|g| !g.why.is_empty())
                .map(|g| {
                    let why: Vec<&str> = g.why.iter().map(String::as_str).collect();
                    format!(" ({})", why.join("; "))
                })
                .unwrap_or_default();
            let pods = match group.map_or(0, |g| g.stateless + g.stateful + g.waiting) {
                1 => "1 pod".to_string(),
                n => format!("{n} pods"),
            };
            self.event(
                EventType::Normal,
                "OrderGroupStarted",
                format!(
                    "order group {order}{why}: {pods}, now that every pod of order {last} and below is gone and their volumes have moved"
                ),
                None,
            );
        }
        step.after_volumes
    }

    /// Waits for the pods a drain rule says to wait on (never evicted)
    /// until each succeeds, fails or is gone, naming them in
    /// `status.drain.waitingFor`. Bounded by the deadline: with
    /// `forceAfterDeadline` a pod still running at the deadline minus its
    /// grace period is deleted with its grace period (a Warning says so);
    /// without it the wait ends at the deadline and the drain fails naming
    /// it.
    pub(super) async fn wait_completed(&self, pods: &[PlannedPod]) {
        let Some(first) = pods.first() else {
            return;
        };
        let names: Vec<String> = pods.iter().map(|p| fmt_key(&p.pod)).collect();
        let at_deadline = if self.job.settings.force_after_deadline {
            "at the drain deadline minus its grace period it is deleted with its grace period"
        } else {
            "at the drain deadline the drain fails naming it (forceAfterDeadline is false)"
        };
        for p in pods {
            let uid = p.uid.clone().unwrap_or_else(|| fmt_key(&p.pod));
            if self.first_report(format!("wait-completed/{uid}")) {
                self.event(
                    EventType::Normal,
                    "WaitingForCompletion",
                    format!(
                        "pod {} is not evicted (drain rule {DRAIN_ANNOTATION}=wait-completed): the drain waits until it succeeds, fails or is gone; {at_deadline}",
                        fmt_key(&p.pod)
                    ),
                    Some(pod_ref_key(&p.pod)),
                );
            }
        }
        let waiting = format!(
            "pod {} to complete (drain rule {DRAIN_ANNOTATION}=wait-completed, never evicted)",
            names.join(", ")
        );
        self.update(|p| {
            p.current_pod = Some(fmt_key(&first.pod));
            p.waiting_for = Some(waiting.clone());
        });
        join_all(pods.iter().map(|p| self.wait_one_completed(p))).await;
        self.update(|p| {
            if p.waiting_for.as_deref() == Some(waiting.as_str()) {
                p.current_pod = None;
                p.waiting_for = None;
            }
        });
    }

    /// One pod of [`NodeDrain::wait_completed`].
    async fn wait_one_completed(&self, p: &PlannedPod) {
        let uid = p.uid.as_deref();
        let done = || {
            self.view()
                .pod(&p.pod, uid)
                .is_none_or(|pod| finished(&pod) || pod.metadata.deletion_timestamp.is_some())
        };
        let force_at = self.force_at(p.grace);
        let until = force_at.unwrap_or_else(|| self.deadline());
        if self.wait_pods_until(until, done).await {
            return;
        }
        if force_at.is_none_or(|at| Instant::now() < at) {
            return;
        }
        let Some(pod) = self.view().pod(&p.pod, uid) else {
            return;
        };
        let key = fmt_key(&p.pod);
        match pod_writes::delete(&self.client, &pod, None).await {
            Evicted::Accepted => {
                self.deps.metrics.record_eviction(EvictionResult::Forced);
                self.count_evicted(&p.pod);
                self.forced(&p.pod);
                self.event(
                    EventType::Warning,
                    "ForcedAtDeadline",
                    format!(
                        "deleted pod {key}, which its drain rule {DRAIN_ANNOTATION}=wait-completed said to wait on, with its grace period of {}s: it had not completed and the drain deadline is at {}",
                        p.grace.as_secs(),
                        self.job
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
