//! The permits of moves that no drain watches any more: a drain that
//! ended with a move still in flight (its replacement not placed yet, a
//! volume that did not detach in time, a replacement not healthy yet), or
//! a Machine gone with its drain (its finalizer removed by hand, forced
//! away). The move goes on without its Machine, and its permit with it,
//! until its workload is whole again or its healthy deadline passes
//! (`MovePermit.spec.expires`); then the permit ends, the second time with
//! a Warning on the workload and `berth_move_permits_expired_total`.
//!
//! A permit deleted by someone else (by hand) while its move was not over
//! is named too: a Warning on the workload, `MovePermitDeleted`.
//!
//! A running drain may leave it a move too: for a workload whose
//! availability berth does not read (an operator's custom resource, a
//! Job), a move whose replacement is not healthy when the drain is done
//! with it keeps its permit until it is (see `DrainPermits::end`).
//!
//! Nothing polls: the keeper judges again when a permit, a workload's
//! availability, a VolumeAttachment, a Machine or a drain's end changes, a
//! drain leaves it a move, a pod changes while a move waits for its
//! replacement by its pods, at the first expiry of the permits it keeps,
//! and when a replacement Ready now will have been so for its minimum
//! healthy time.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;

use super::drainer::Drainer;
use super::permits::{move_done, replaced};
use super::surge::{Restored, restore};
use crate::api::PermitSurge;
use crate::drain::ledger::{Held, WorkloadFacts, earliest, kind_label, workload_name};

/// Where a Machine's drain stands in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DrainHere {
    /// The Machine is gone.
    Gone,
    /// None was started here (yet).
    NotStarted,
    Running,
    Ended,
}

/// The least time between two judgements: the changes that wake the
/// keeper come in bursts (a rollout's pods and StatefulSet statuses).
const SETTLE: Duration = Duration::from_secs(1);

impl Drainer {
    /// Where the drain of Machine `machine` (`namespace/name`) stands in
    /// this process.
    fn drain_of(&self, machine: &str) -> DrainHere {
        let Some((ns, name)) = machine.split_once('/') else {
            return DrainHere::Gone;
        };
        let key = ObjectRef::new(name).within(ns);
        if self.deps.caches.machines.get(&key).is_none() {
            return DrainHere::Gone;
        }
        let Ok(running) = self.running.lock() else {
            return DrainHere::Running;
        };
        match running.get(&key) {
            None => DrainHere::NotStarted,
            Some(r) if r.progress.borrow().outcome.is_some() => DrainHere::Ended,
            Some(_) => DrainHere::Running,
        }
    }

    /// Whether no drain of this process watches the moves of Machine
    /// `machine` (`namespace/name`): none runs for it (none was started
    /// here, or it ended), or the Machine is gone; and no forced deletion
    /// is deleting its pods now.
    fn idle(&self, machine: &str) -> bool {
        if self.forcing.lock().is_ok_and(|f| f.contains(machine)) {
            return false;
        }
        self.drain_of(machine) != DrainHere::Running
    }

    /// Whether no drain will go on with the moves of Machine `machine`:
    /// it is gone, or its drain here ended. Stricter than
    /// [`Drainer::idle`]: a Machine whose drain has not started in this
    /// process yet (a restart) will go on with its surges itself.
    fn abandoned(&self, machine: &str) -> bool {
        matches!(self.drain_of(machine), DrainHere::Gone | DrainHere::Ended)
    }

    /// Keeps the permits of moves no drain watches (see the module), for
    /// as long as this process leads: judged once the caches are synced,
    /// then on every change that may end one.
    pub(crate) async fn keep_permits(&self) {
        let caches = &self.deps.caches;
        let mut synced = caches.synced.clone();
        let mut listed = caches.machines_listed.clone();
        if synced.wait_for(|s| *s).await.is_err() || listed.wait_for(|l| *l).await.is_err() {
            return;
        }
        let mut permits = caches.permit_changes.clone();
        let mut workloads = caches.workload_changes.clone();
        let mut attachments = caches.attachment_changes.clone();
        let mut gone = caches.machines_gone.clone();
        let mut ended = self.drains_ended.subscribe();
        let mut lingered = self.deps.permits.lingered();
        let mut pods = caches.pod_changes.clone();
        loop {
            lingered.borrow_and_update();
            pods.borrow_and_update();
            permits.borrow_and_update();
            workloads.borrow_and_update();
            attachments.borrow_and_update();
            gone.borrow_and_update();
            ended.borrow_and_update();
            let unrestored = self.restore_surges().await;
            let swept = self.deps.permits.sweep(
                |m| self.idle(m),
                |w, p| !unrestored.contains(&p.uid) && move_done(caches, w, p),
                Timestamp::now(),
            );
            for held in &swept.expired {
                self.expired(held);
            }
            for held in self.deps.permits.vanished() {
                if !move_done(caches, held.workload(), held.permit()) {
                    self.deleted_elsewhere(&held);
                }
            }
            self.deps.permits.refresh();
            let (by_pods, healthy_at) = self.replacements_awaited();
            let next = earliest(swept.next, healthy_at);
            let next = next.map_or(Duration::MAX, |at| {
                Duration::try_from(at.duration_since(Timestamp::now())).unwrap_or(Duration::ZERO)
            });
            let expiry = tokio::time::sleep(next.min(Duration::from_secs(86_400)));
            tokio::select! {
                r = permits.changed() => if r.is_err() { return },
                r = workloads.changed() => if r.is_err() { return },
                r = attachments.changed() => if r.is_err() { return },
                r = gone.changed() => if r.is_err() { return },
                r = ended.changed() => if r.is_err() { return },
                r = lingered.changed() => if r.is_err() { return },
                r = pods.changed(), if by_pods => if r.is_err() { return },
                () = expiry => {}
            }
            tokio::time::sleep(SETTLE).await;
        }
    }

    /// Puts back the scale-ups of surges no drain will go on with (see
    /// `surge::restore`: a Machine gone while its drain was killed between
    /// the scale-up and its put-back, a put-back the API server refused
    /// for a while), each recorded on its permit once back: the pod UIDs of
    /// those still not back, whose permits stay until they are. A
    /// put-back that fails is tried again on the keeper's next judgement.
    async fn restore_surges(&self) -> BTreeSet<String> {
        let mut left = BTreeSet::new();
        let client = (self.deps.drain_client)().rest;
        for (held, record) in self.deps.permits.surges_here() {
            let uid = held.permit().uid.clone();
            let lingering = self.deps.permits.is_lingering(&uid);
            if !lingering && !self.abandoned(&held.permit().machine) {
                left.insert(uid);
                continue;
            }
            let ns = &held.workload().namespace;
            let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
            match restore(&api, &record).await {
                Restored::Back => {}
                Restored::Stands(note) => {
                    tracing::warn!(%note, "a surge's scale-up is not put back");
                }
                Restored::Failed(e) => {
                    tracing::warn!(error = %e, "a surge's scale-up cannot be put back yet");
                    left.insert(uid);
                    continue;
                }
            }
            let done = PermitSurge {
                restored: Some(Time(Timestamp::now())),
                ..record
            };
            if let Err(e) = self
                .deps
                .permits
                .record_surge(held.workload(), &uid, &done)
                .await
            {
                tracing::warn!(error = %e, "the put-back of a surge cannot be recorded on its permit");
            }
        }
        left
    }

    /// Whether a permit of this scope waits for a replacement judged by its
    /// pods (a workload whose availability berth does not read, see
    /// [`replaced`]), and when the first replacement Ready now will have
    /// been so for its minimum healthy time.
    fn replacements_awaited(&self) -> (bool, Option<Timestamp>) {
        let caches = &self.deps.caches;
        let now = Timestamp::now();
        let mut awaited = false;
        let mut due = None;
        for held in self.deps.permits.held_here() {
            let w = held.workload();
            let terms = caches.counted(w, caches.terms(w));
            if w.kind == "Pod" || terms.availability.is_some() {
                continue;
            }
            awaited = true;
            if let Err(Some(at)) = replaced(caches, w, held.permit(), &terms, now) {
                due = earliest(due, Some(at));
            }
        }
        (awaited, due)
    }

    /// Keeps this scope's asks parked in line in the API server, for as
    /// long as this process leads, once the caches are synced (see
    /// `ledger::line`): the asks of this scope no drain here waits on (a
    /// Machine whose drain ended or that is gone, a previous leader's)
    /// are taken out of line.
    pub(crate) async fn keep_line(&self) {
        let mut synced = self.deps.caches.synced.clone();
        if synced.wait_for(|s| *s).await.is_err() {
            return;
        }
        self.deps.permits.keep_line().await;
    }

    /// Names a permit deleted by someone else (by hand) while its move
    /// was not over: the budget it held is free, and the next pod of its
    /// workload may move while a replica is down.
    fn deleted_elsewhere(&self, held: &Held) {
        let (w, p) = (held.workload(), held.permit());
        tracing::warn!(workload = %w, pod = %p.pod, machine = %p.machine, "a move permit was deleted outside berth with its workload not whole");
        self.deps.events.warning(
            held.regarding(),
            "Move",
            "MovePermitDeleted",
            format!(
                "move permit {} of {} (the move of pod {} from Machine {}) was deleted, not by berth, while {} is not whole: the next pod of {} may move while a replica is down",
                held.name(),
                workload_name(w),
                p.pod,
                p.machine,
                workload_name(w),
                workload_name(w)
            ),
            None,
        );
    }

    /// Names a permit ended at its healthy deadline, its workload not whole.
    fn expired(&self, held: &Held) {
        let (w, p) = (held.workload(), held.permit());
        let expires = held
            .expires()
            .map_or_else(|| "its healthy deadline".to_string(), |t| t.to_string());
        tracing::warn!(workload = %w, pod = %p.pod, machine = %p.machine, "a move permit expired with its workload not whole");
        self.deps
            .metrics
            .move_permits_expired
            .with_label_values(&[kind_label(w)])
            .inc();
        self.deps.events.warning(
            held.regarding(),
            "Move",
            "MovePermitExpired",
            format!(
                "the move of pod {} (from Machine {}) held {}'s move permit {} until its healthy deadline ({expires}), and {} is still not whole: the permit is free, and the next pod of {} may move while a replica is down",
                p.pod,
                p.machine,
                workload_name(w),
                held.name(),
                workload_name(w),
                workload_name(w)
            ),
            None,
        );
    }
}
