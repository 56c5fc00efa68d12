//! A drain's waits on pods and volumes, woken by the caches' change
//! signals and the volume tracker, never by polling: a pod gone, a
//! condition over the pods, replacements healthy, and the wait for volumes
//! to move with the pod that now uses their claims:
//! an attachable volume attached on the Node where that pod runs (attached
//! on some other Node is not enough: a ReadWriteMany volume can be attached
//! elsewhere all along), an attach-free one with that pod Running and Ready
//! on another Node.
//!
//! One wait for every path that needs it, so that each applies the same
//! rules: a stateful pod moved in this run, a move resumed after a restart
//! or held for its replacement (`migration`), and the
//! volumes of pods that left before this run (`Pass::wait_detaching`).
//! Woken by the tracker (VolumeAttachment and Node events) and by pod
//! events; bounded by the reattach timeout; a Warning when not in time,
//! or at once when the attacher refuses the attach for lack of a resource
//! (an attach error of gRPC code 8: the Node is at its attach limit).

use std::collections::BTreeSet;

use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use tokio::time::Instant;

use super::progress::ProgressTx;
use super::reports::{Reports, pod_ref_key, pv_ref};
use super::view::View;
use crate::cache::Caches;
use crate::drain::ledger::{healthy, ready_since};
use crate::drain::select::{NamespacedName, fmt_key};
use crate::drain::volume::Moved;
use crate::drain::volume_kind::VolumeKind;
use crate::telemetry::Metrics;
use crate::volumes::{AttachRefused, RESOURCE_EXHAUSTED, Registration, Signal, WaitError};

/// How a wait for healthy replacements ended.
pub(super) enum Health {
    Healthy,
    /// The bound came first.
    TimedOut,
    /// The pod watch went away (the process is stopping).
    Closed,
}

/// One volume waited for to move.
pub(super) struct Awaited<'v> {
    pub(super) pv: &'v str,
    /// The claim it moves with.
    pub(super) claim: &'v NamespacedName,
    pub(super) kind: VolumeKind,
    /// The pods that used the claim on other Nodes before the move began:
    /// none of them is the replacement.
    pub(super) users_before: &'v BTreeSet<String>,
}

/// How a reattach wait ended, once announced.
pub(super) enum Reattach {
    /// Every volume moved: the pods that now use them.
    Moved(Vec<NamespacedName>),
    /// The wait timed out (warned).
    TimedOut,
    /// The attacher refused to attach a volume where its replacement runs
    /// for lack of a resource (a VolumeAttachment's attach error of code
    /// 8, see [`attach_exhausted`](crate::volumes::attach_exhausted)):
    /// warned, at once, and otherwise as [`Reattach::TimedOut`].
    Exhausted,
    /// The scheduler says the replacement (this pod) cannot be placed,
    /// with its message: nothing was announced, the caller holds the move.
    Unplaceable(NamespacedName, String),
}

/// The waits of one drain, for its Node: what they read (the caches),
/// and what they tell (the drain's progress, its Events, the metrics).
#[derive(Clone, Copy)]
pub(super) struct Waits<'d> {
    pub(super) caches: &'d Caches,
    pub(super) node: &'d str,
    pub(super) progress: &'d ProgressTx,
    pub(super) reports: &'d Reports,
    pub(super) metrics: &'d Metrics,
}

impl Waits<'_> {
    fn view(&self) -> View<'_> {
        View::new(self.caches, self.node)
    }

    /// Waits until the pod (this UID) is gone from the cache, woken by pod
    /// events; false if `until` passed first.
    pub(super) async fn gone(
        self,
        key: &NamespacedName,
        uid: Option<&str>,
        until: Instant,
    ) -> bool {
        self.pods_until(until, || self.view().pod(key, uid).is_none())
            .await
    }

    /// Waits until `done` holds over the pod cache, checked after every pod
    /// event, or `until`. Returns whether it held.
    pub(super) async fn pods_until(self, until: Instant, done: impl Fn() -> bool) -> bool {
        let mut changes = self.caches.pod_changes.clone();
        loop {
            changes.borrow_and_update();
            if done() {
                return true;
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return false },
                _ = tokio::time::sleep_until(until) => return done(),
            }
        }
    }

    /// Waits, until `until`, for every volume of `volumes` to have moved
    /// with the pod that replaced `evicted_uid` (`""`: any pod that uses
    /// the claim on another Node and is not a user from before). `reg`
    /// carries the tracker's events for the attachable ones. With
    /// `watch_scheduler`, ends at once when the scheduler says a
    /// replacement cannot be placed. `left_at`: when the volumes left this
    /// Node, for the metric and the Events.
    pub(super) async fn reattach(
        self,
        reg: &mut Registration,
        volumes: &[Awaited<'_>],
        evicted_uid: &str,
        watch_scheduler: bool,
        left_at: std::time::Instant,
        until: Instant,
    ) -> Reattach {
        let attachable: BTreeSet<&str> = volumes
            .iter()
            .filter(|v| v.kind == VolumeKind::Attachable)
            .map(|v| v.pv)
            .collect();
        reg.retain_volumes(|pv| attachable.contains(pv));
        let check = || -> Result<Vec<(&Awaited, Moved)>, Vec<String>> {
            let (mut moved, mut pending) = (Vec::new(), Vec::new());
            for v in volumes {
                match self
                    .view()
                    .volume_moved(v.pv, v.claim, v.kind, evicted_uid, v.users_before)
                {
                    Ok(m) => moved.push((v, m)),
                    Err(why) => pending.push(why),
                }
            }
            if pending.is_empty() {
                Ok(moved)
            } else {
                Err(pending)
            }
        };
        let unplaceable = || {
            volumes
                .iter()
                .find_map(|v| self.view().unschedulable_replacement(v.claim, evicted_uid))
        };
        let refused = || {
            volumes
                .iter()
                .filter(|v| v.kind == VolumeKind::Attachable)
                .find_map(|v| Some((v.pv, self.view().attach_refused(v.pv)?)))
        };
        let mut pods = self.caches.pod_changes.clone();
        let mut tracker_open = !attachable.is_empty();
        let outcome = loop {
            pods.borrow_and_update();
            if let Ok(moved) = check() {
                break Ok(moved);
            }
            // The scheduler may say at once that the replacement cannot be
            // placed: no need to sit out the timeout to know.
            if watch_scheduler && let Some((pod, message)) = unplaceable() {
                return Reattach::Unplaceable(pod, message);
            }
            // Nor when the attacher says the Node has no room for the
            // volume: it retries in vain until a slot frees, which the
            // timeout would only wait out.
            if let Some((pv, refused)) = refused() {
                self.attach_exhausted(pv, &refused);
                return Reattach::Exhausted;
            }
            tokio::select! {
                signal = reg.next_signal(), if tracker_open => {
                    if signal == Signal::Closed {
                        tracker_open = false;
                    }
                }
                r = pods.changed() => if r.is_err() { break check() },
                () = tokio::time::sleep_until(until) => break check(),
            }
        };
        match outcome {
            Ok(moved) => {
                self.announce_moved(&moved, left_at);
                let mut pods: Vec<NamespacedName> = moved.into_iter().map(|(_, m)| m.pod).collect();
                pods.sort();
                pods.dedup();
                Reattach::Moved(pods)
            }
            Err(waiting_for) => {
                self.reports.volume_wait_failed(
                    "VolumeReattachTimeout",
                    &WaitError::Timeout { waiting_for },
                    volumes.first().map(|v| v.pv),
                );
                Reattach::TimedOut
            }
        }
    }

    /// The Warning that ends a reattach wait early: the attacher refused
    /// to attach `pv` where its replacement runs for lack of a resource.
    fn attach_exhausted(self, pv: &str, refused: &AttachRefused) {
        tracing::warn!(pv, node = %refused.node, attachment = %refused.name, "attach refused for lack of a resource: not waiting for the volume to move");
        self.reports.event(
            EventType::Warning,
            "VolumeAttachExhausted",
            format!(
                "PV {pv} cannot attach on Node {}: VolumeAttachment {} says resource exhausted (code {RESOURCE_EXHAUSTED}): {}; not waiting for the reattach timeout, the move ends now",
                refused.node, refused.name, refused.message
            ),
            pv_ref(pv),
        );
    }

    /// Waits, until `until`, for the replacements `pods` to have been
    /// Ready for `min_healthy` (at once when they are Ready and it is
    /// zero): a replica whose volume is attached but whose database has not
    /// started is still down. A Warning naming them when not in time; the
    /// move ends either way.
    pub(super) async fn healthy(
        self,
        pods: &[NamespacedName],
        min_healthy: std::time::Duration,
        until: Instant,
    ) {
        let names = pods.iter().map(fmt_key).collect::<Vec<_>>().join(", ");
        let ready = || {
            pods.iter()
                .map(|p| self.view().pod(p, None).and_then(|p| ready_since(&p)))
                .collect()
        };
        let waiting = || {
            let waiting = if min_healthy.is_zero() {
                format!("replacement {names} to be Ready")
            } else {
                format!(
                    "replacement {names} to be Ready for {}",
                    humantime::format_duration(min_healthy)
                )
            };
            self.progress.update(|p| p.waiting_for = Some(waiting));
        };
        if let Health::TimedOut = self.wait_healthy(min_healthy, until, ready, waiting).await {
            self.reports.event(
                EventType::Warning,
                "ReplacementNotHealthy",
                format!(
                    "replacement {names} not Ready{} in time: this drain goes on, and the next pod of its workload goes only while its workload's replicas down stay within its move budget",
                    if min_healthy.is_zero() { String::new() } else { format!(" for {}", humantime::format_duration(min_healthy)) }
                ),
                pods.first().map(pod_ref_key),
            );
        }
    }

    /// Waits, until `until`, for the replacements `ready` reports (since
    /// when each has been Ready, read again after every pod event; `None`:
    /// not Ready) to have been Ready for `min_healthy`. Woken by pod
    /// events, and by a timer for the moment they will have been Ready long
    /// enough. `waiting` is called once, when a look finds them not
    /// healthy yet.
    pub(super) async fn wait_healthy(
        self,
        min_healthy: std::time::Duration,
        until: Instant,
        ready: impl Fn() -> Vec<Option<Timestamp>>,
        waiting: impl FnOnce(),
    ) -> Health {
        let mut changes = self.caches.pod_changes.clone();
        let mut waiting = Some(waiting);
        loop {
            changes.borrow_and_update();
            let now = Timestamp::now();
            let due = match healthy(&ready(), min_healthy, now) {
                Ok(()) => return Health::Healthy,
                Err(due) => due,
            };
            if let Some(w) = waiting.take() {
                w();
            }
            // When they will have been Ready long enough, if they stay so.
            let wake = due
                .and_then(|t| std::time::Duration::try_from(t.duration_since(now)).ok())
                .map_or(until, |d| (Instant::now() + d).min(until));
            tokio::select! {
                r = changes.changed() => if r.is_err() { return Health::Closed },
                () = tokio::time::sleep_until(wake) => if wake >= until {
                    return Health::TimedOut;
                },
            }
        }
    }

    /// Each volume moved, in the metric and an Event of its own.
    fn announce_moved(self, moved: &[(&Awaited, Moved)], left_at: std::time::Instant) {
        let took = left_at.elapsed().as_secs_f64();
        self.metrics.volume_reattach_wait.observe(took);
        for (v, m) in moved {
            let (reason, how) = match v.kind {
                VolumeKind::AttachFree => (
                    "VolumeMoved",
                    format!(
                        "moved with pod {}, Running and Ready on Node {} (nothing to detach or attach)",
                        fmt_key(&m.pod),
                        m.node
                    ),
                ),
                _ => (
                    "VolumeAttached",
                    format!(
                        "attached on Node {}, where pod {} runs",
                        m.node,
                        fmt_key(&m.pod)
                    ),
                ),
            };
            self.reports.event(
                EventType::Normal,
                reason,
                format!(
                    "{} PV {} {how}, {took:.1}s after it left Node {}",
                    v.kind, v.pv, self.node
                ),
                pv_ref(v.pv),
            );
        }
    }
}
