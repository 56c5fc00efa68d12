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

use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::watch;
use tokio::time::Instant;

use super::batch::{Batch, pv_ref};
use super::eviction::Eviction;
use super::progress::write_status;
use super::run::Run;
use super::{Deps, Job, Outcome, Progress};
use crate::api::Machine;
use crate::drain::deadline::{grace_period, pod_gone_bound};
use crate::drain::evict::{self, Evicted};
use crate::drain::pdb::PdbVerdict;
use crate::drain::plan::{DetachingVolume, DrainPlan};
use crate::drain::select::{NamespacedName, fmt_key};
use crate::telemetry::EvictionResult;
use crate::volumes::Interest;

pub(super) async fn run(
    deps: Arc<Deps>,
    job: Job,
    progress: watch::Sender<Progress>,
    written: watch::Sender<Option<Machine>>,
    data_loss_allowed: watch::Receiver<bool>,
) {
    let writer = tokio::spawn(write_status(
        deps.client.clone(),
        job.machine.clone(),
        job.deadline.started,
        progress.subscribe(),
        written,
    ));
    deps.metrics.drains_in_progress.inc();
    let started = std::time::Instant::now();
    let r = Run::new(Arc::clone(&deps), job, progress, data_loss_allowed);
    let outcome = r.passes().await;
    deps.metrics.drains_in_progress.dec();
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
            format!("drain deadline passed: force-deleted {}", pods.join(", ")),
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
        if let Outcome::Failed { message } = &outcome {
            p.blocked_by = Some(message.clone());
        } else {
            p.blocked_by = None;
        }
    });
    // The writer flushes the final state on its own; the reconciler learns
    // the outcome from memory and does not wait for it.
    drop(r);
    drop(writer);
}

/// What a pass found and did.
enum Pass {
    /// Nothing was left to do.
    Done,
    /// Work was done; plan again.
    Again,
    /// The deadline passed.
    Deadline,
}

impl Run {
    async fn passes(&self) -> Outcome {
        loop {
            match self.pass().await {
                Pass::Done => return Outcome::Drained,
                Pass::Again => continue,
                Pass::Deadline => return self.at_deadline().await,
            }
        }
    }

    async fn pass(&self) -> Pass {
        if self.expired() {
            return Pass::Deadline;
        }
        let plan = self.plan();
        let leftover = self.not_abandoned(&plan.detaching);
        let remaining = plan.stateless.len()
            + plan.stateful.len()
            + plan.terminating.len()
            + plan.to_delete.len();
        self.update(|p| {
            p.pods_remaining = u32::try_from(remaining).unwrap_or(u32::MAX);
            p.pods_total = p.pods_total.max(p.pods_evicted + p.pods_remaining);
        });
        if remaining == 0 && leftover.is_empty() {
            return Pass::Done;
        }
        tracing::info!(
            stateless = plan.stateless.len(),
            stateful = plan.stateful.len(),
            terminating = plan.terminating.len(),
            terminal = plan.to_delete.len(),
            detaching = leftover.len(),
            "drain pass"
        );

        self.delete_finished(&plan).await;

        // The futures are collected first: a lazy `map` closure inside a
        // spawned future trips the compiler's higher-ranked lifetime check.
        let evictions: Vec<_> = plan
            .stateless
            .iter()
            .map(|p| async move { (p, self.evict(p).await) })
            .collect();
        let migrations: Vec<_> = plan
            .stateful
            .iter()
            .map(|p| self.migrate(&plan, p))
            .collect();
        let terminating: Vec<_> = plan
            .terminating
            .iter()
            .map(|t| self.wait_gone(&t.pod, t.uid.as_deref(), self.deadline()))
            .collect();
        // The bound is on eviction requests in flight; waiting for the
        // evicted pods to go costs nothing but a watch receiver each, so
        // every evicted pod is waited for at once. Evictions accepted
        // together are announced in one Event (see `batch`).
        let stateless = async {
            let mut results = futures::stream::iter(evictions)
                .buffer_unordered(self.job.settings.max_concurrent_evictions.max(1) as usize);
            let mut batch = Batch::default();
            let mut leaving = Vec::new();
            loop {
                let due = batch.due();
                tokio::select! {
                    next = results.next() => match next {
                        Some((p, Eviction::Accepted(pod))) => {
                            batch.push(pod, Instant::now());
                            leaving.push(p);
                        }
                        Some((p, Eviction::Gone)) => leaving.push(p),
                        Some((_, Eviction::Expired)) => {}
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
                .map(|p| self.wait_gone(&p.pod, p.uid.as_deref(), self.deadline()))
                .collect();
            futures::future::join_all(gone).await;
        };
        let stateful = async {
            // Stateful pods that were already terminating (evicted before a
            // restart, or by someone else) come first: their volumes must be
            // gone from this Node before the next stateful eviction.
            let going: Vec<_> = plan.terminating_with_volumes().collect();
            for t in &going {
                self.update(|p| {
                    p.current_pod = Some(fmt_key(&t.pod));
                    p.waiting_for = Some(format!("pod {} to terminate", fmt_key(&t.pod)));
                });
                self.wait_gone(&t.pod, t.uid.as_deref(), self.deadline())
                    .await;
            }
            let leftover = if going.is_empty() {
                leftover
            } else {
                self.detaching()
            };
            if !leftover.is_empty() {
                self.wait_detaching(&leftover).await;
            }
            futures::stream::iter(migrations)
                .buffered(self.job.settings.max_parallel_volume_migrations.max(1) as usize)
                .collect::<Vec<()>>()
                .await;
        };
        let terminating = futures::future::join_all(terminating);
        // The stateful chain is the drain's critical path and the stateless
        // pods have slack: polled first, its eviction is sent ahead of theirs
        // when many drains start at once and every request queues.
        tokio::join!(stateful, stateless, terminating);
        if self.expired() {
            Pass::Deadline
        } else {
            Pass::Again
        }
    }

    /// Deletes the pods that finished (Succeeded or Failed).
    async fn delete_finished(&self, plan: &DrainPlan) {
        for p in &plan.to_delete {
            let Some(pod) = self.pod(&p.pod, p.uid.as_deref()) else {
                continue;
            };
            match evict::delete(&self.deps.client, &pod, None).await {
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
            i.volume(v.pv.clone(), v.csi_unique_name.clone())
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
            .wait_detached(self.bounded(self.job.settings.volume_detach_timeout))
            .await
        {
            Ok(()) => {
                self.deps
                    .metrics
                    .volume_detach_wait
                    .observe(started.elapsed().as_secs_f64());
                self.event(
                    EventType::Normal,
                    "VolumeDetached",
                    format!("{} detached from Node {}", names.join(", "), self.job.node),
                    leftover.first().map(|v| pv_ref(&v.pv)),
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
        // And attached where a pod still needs them.
        let needed: BTreeSet<String> = names
            .iter()
            .filter_map(|n| self.deps.pvs.get(&ObjectRef::new(n)))
            .filter_map(|pv| {
                let claim = pv.spec.as_ref()?.claim_ref.as_ref()?;
                let key = (claim.namespace.clone()?, claim.name.clone()?);
                self.replacement_expected(&key, "")
                    .then(|| pv.metadata.name.clone())?
            })
            .collect();
        if needed.is_empty() {
            return;
        }
        reg.retain_volumes(|pv| needed.contains(pv));
        let detached_at = std::time::Instant::now();
        match reg
            .wait_attached_elsewhere(self.bounded(self.job.settings.volume_reattach_timeout))
            .await
        {
            Ok(moved) => {
                self.deps
                    .metrics
                    .volume_reattach_wait
                    .observe(detached_at.elapsed().as_secs_f64());
                for (pv, node) in moved {
                    self.event(
                        EventType::Normal,
                        "VolumeAttached",
                        format!(
                            "{pv} attached on Node {node} (moved from {})",
                            self.job.node
                        ),
                        Some(pv_ref(&pv)),
                    );
                }
            }
            Err(e) => self.warn_volume(
                "VolumeReattachTimeout",
                &e,
                needed.first().map(String::as_str),
            ),
        }
    }

    /// The deadline passed: force what is left, or fail saying what.
    async fn at_deadline(&self) -> Outcome {
        let plan = self.plan();
        let left: Vec<(NamespacedName, Option<String>, String)> = plan
            .stateless
            .iter()
            .chain(plan.stateful.iter())
            .map(|p| {
                let pdb = p.pdbs.iter().find(|f| f.verdict != PdbVerdict::Allows);
                let why = p
                    .held
                    .clone()
                    .or_else(|| pdb.map(|f| f.description.clone()))
                    .unwrap_or_else(|| "not evicted in time".into());
                (p.pod.clone(), p.uid.clone(), why)
            })
            .chain(
                plan.terminating
                    .iter()
                    .map(|t| (t.pod.clone(), t.uid.clone(), "still terminating".into())),
            )
            .chain(plan.to_delete.iter().map(|t| {
                (
                    t.pod.clone(),
                    t.uid.clone(),
                    "finished, not yet deleted".into(),
                )
            }))
            .collect();
        if left.is_empty() {
            return Outcome::Drained;
        }
        if !self.job.settings.force_after_deadline {
            // No forcing: one more polite attempt per pod (a budget may have
            // been relaxed since), then fail with what is left. The
            // reconciler runs the drain again later.
            let mut still = Vec::new();
            for (k, uid, why) in left {
                let terminating = plan.terminating.iter().any(|t| t.pod == k);
                // `nodeLocalVolumes: Block` holds a pod until an operator
                // allows it; only forcing at the deadline overrides that.
                let held = plan.stateful.iter().any(|p| p.pod == k && p.held.is_some());
                let Some(pod) = self.pod(&k, uid.as_deref()) else {
                    continue;
                };
                let leaving = terminating
                    || !held
                        && match evict::evict(&self.deps.client, &pod).await {
                            Evicted::Accepted | Evicted::Gone => {
                                self.deps.metrics.record_eviction(EvictionResult::Evicted);
                                self.count_evicted(&k);
                                true
                            }
                            _ => false,
                        };
                // A pod on its way out gets its grace period to finish.
                let bound = pod_gone_bound(grace_period(&pod));
                let gone = leaving
                    && self
                        .wait_gone(&k, uid.as_deref(), Instant::now() + bound)
                        .await;
                if !gone {
                    still.push((k, uid, why));
                }
            }
            let left = still;
            if left.is_empty() {
                return Outcome::Drained;
            }
            let list: Vec<String> = left
                .iter()
                .map(|(k, _, why)| format!("{} ({why})", fmt_key(k)))
                .collect();
            return Outcome::Failed {
                message: format!(
                    "drain deadline of {} passed with {} pods left and forceAfterDeadline=false: {}",
                    humantime::format_duration(self.job.deadline.timeout),
                    left.len(),
                    list.join(", ")
                ),
            };
        }
        let mut forced = Vec::new();
        for (k, uid, _) in &left {
            if let Some(pod) = self.pod(k, uid.as_deref()) {
                match evict::delete(&self.deps.client, &pod, Some(0)).await {
                    Evicted::Accepted | Evicted::Gone => {
                        self.deps.metrics.record_eviction(EvictionResult::Forced);
                        self.count_evicted(k);
                        forced.push(fmt_key(k));
                    }
                    other => {
                        tracing::warn!(pod = %fmt_key(k), result = ?other, "force delete failed")
                    }
                }
            }
        }
        Outcome::Forced { pods: forced }
    }
}
