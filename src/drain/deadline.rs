//! The drain's deadline and the bound on each of its waits.
//!
//! The deadline starts at the Machine's `deletionTimestamp` and is never
//! reset: a retry or a controller restart resumes against the same instant.
//! Time is passed in, never read here.
//!
//! Each wait of a stateful pod has its own bound, and is cut short by the
//! deadline ([`Deadline::bound`]):
//!
//! - pod gone: its grace period plus [`POD_GONE_SLACK`];
//! - volumes detached: its grace period plus `volumeDetachTimeout`;
//! - volumes reattached elsewhere: `volumeReattachTimeout`.
//!
//! The grace period is `spec.terminationGracePeriodSeconds`, or
//! [`DEFAULT_GRACE_PERIOD`] when unset (the API default).

use std::fmt;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::api::settings::ResolvedSettings;

/// Grace period of a pod that does not set one (the API default).
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(30);

/// Time allowed beyond a pod's grace period for the kubelet to report it
/// gone and the API server to delete it.
pub const POD_GONE_SLACK: Duration = Duration::from_secs(30);

/// The drain deadline: `timeout` after `started`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    /// The Machine's `deletionTimestamp`.
    pub started: Timestamp,
    /// `drain.timeout`.
    pub timeout: Duration,
}

impl Deadline {
    pub fn new(started: Timestamp, timeout: Duration) -> Self {
        Self { started, timeout }
    }

    /// Time since the start; zero when `now` is before it (clock skew).
    pub fn elapsed(&self, now: Timestamp) -> Duration {
        Duration::try_from(now.duration_since(self.started)).unwrap_or(Duration::ZERO)
    }

    /// Time left until the deadline; zero once it has passed.
    pub fn remaining(&self, now: Timestamp) -> Duration {
        self.timeout.saturating_sub(self.elapsed(now))
    }

    /// Whether the deadline has been reached.
    pub fn expired(&self, now: Timestamp) -> bool {
        self.remaining(now).is_zero()
    }

    /// How long a step may wait: the smaller of its own bound and the time
    /// left.
    pub fn bound(&self, now: Timestamp, step_bound: Duration) -> Duration {
        step_bound.min(self.remaining(now))
    }

    /// Whether a pod that cannot go (held by a finalizer after its grace
    /// period) stops holding the drain at `now`: from the deadline plus the
    /// pod's own grace period on, the time a pod deleted at the deadline
    /// would have had.
    pub fn releases(&self, grace: Duration, now: Timestamp) -> bool {
        self.elapsed(now) >= self.timeout.saturating_add(grace)
    }

    /// How long until [`Deadline::releases`] holds for a pod of `grace`;
    /// zero once it does.
    pub fn until_release(&self, grace: Duration, now: Timestamp) -> Duration {
        self.timeout
            .saturating_add(grace)
            .saturating_sub(self.elapsed(now))
    }

    /// The instant of the deadline, when it is representable.
    pub fn expires_at(&self) -> Option<Timestamp> {
        let timeout = SignedDuration::try_from(self.timeout).ok()?;
        self.started.checked_add(timeout).ok()
    }
}

/// Whether `pod`, being deleted, no longer holds the drain of `deadline`
/// at `now` ([`Deadline::releases`] for its grace period): a pod that a
/// finalizer (or a kubelet that stopped answering) keeps from going does
/// not keep the Machine forever. A pod not being deleted always holds it.
pub fn released(pod: &Pod, deadline: &Deadline, now: Timestamp) -> bool {
    pod.metadata.deletion_timestamp.is_some() && deadline.releases(grace_period(pod), now)
}

/// A pod's termination grace period; a negative value counts as zero.
pub fn grace_period(pod: &Pod) -> Duration {
    pod.spec
        .as_ref()
        .and_then(|s| s.termination_grace_period_seconds)
        .map_or(DEFAULT_GRACE_PERIOD, |s| {
            Duration::from_secs(u64::try_from(s).unwrap_or(0))
        })
}

/// Bound on waiting for an evicted pod to disappear.
pub fn pod_gone_bound(grace: Duration) -> Duration {
    grace.saturating_add(POD_GONE_SLACK)
}

/// Bound on waiting for a pod's volumes to detach from the Node.
pub fn detach_bound(grace: Duration, settings: &ResolvedSettings) -> Duration {
    grace.saturating_add(settings.volume_detach_timeout)
}

/// Bound on waiting for a volume to attach to another Node.
pub fn reattach_bound(settings: &ResolvedSettings) -> Duration {
    settings.volume_reattach_timeout
}

/// The bounds of the waits of one stateful pod; a wait the pod does not
/// have (no volume it is the last user of) is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepBounds {
    pub pod_gone: Duration,
    pub detach: Option<Duration>,
    pub reattach: Option<Duration>,
}

impl StepBounds {
    /// The worst case of the pod's waits, one after the other.
    pub fn total(&self) -> Duration {
        self.pod_gone
            .saturating_add(self.detach.unwrap_or_default())
            .saturating_add(self.reattach.unwrap_or_default())
    }
}

impl fmt::Display for StepBounds {
    /// E.g. `pod gone ≤ 1m, detach ≤ 2m 30s, reattach ≤ 1m 30s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pod gone ≤ {}",
            humantime::format_duration(self.pod_gone)
        )?;
        if let Some(d) = self.detach {
            write!(f, ", detach ≤ {}", humantime::format_duration(d))?;
        }
        if let Some(d) = self.reattach {
            write!(f, ", reattach ≤ {}", humantime::format_duration(d))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::fixtures::{PodFixture, pod, ts};

    const fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_pod_that_cannot_go_holds_the_drain_until_the_deadline_plus_its_grace() {
        let d = Deadline::new(ts(1_000), Duration::from_secs(600));
        let grace = Duration::from_secs(30);
        assert!(!d.releases(grace, ts(1_600)), "at the deadline");
        assert_eq!(d.until_release(grace, ts(1_600)), grace);
        assert!(!d.releases(grace, ts(1_629)));
        assert!(d.releases(grace, ts(1_630)), "deadline plus grace");
        assert_eq!(d.until_release(grace, ts(1_700)), Duration::ZERO);
        assert!(d.releases(Duration::ZERO, ts(1_600)), "no grace");
        assert!(!d.releases(grace, ts(0)), "clock before the start");
    }

    #[test]
    fn only_a_pod_being_deleted_is_released() {
        let d = Deadline::new(ts(1_000), Duration::from_secs(600));
        let going = pod("a", "p").grace(10).deleting(ts(1_100));
        assert!(!released(&going, &d, ts(1_609)));
        assert!(released(&going, &d, ts(1_610)));
        assert!(!released(&pod("a", "q").grace(10), &d, ts(9_999)));
    }

    #[test]
    fn deadline_arithmetic() {
        let d = Deadline::new(ts(1_000), secs(600));
        // (now, elapsed, remaining, expired)
        let cases = [
            (900, 0, 600, false),
            (1_000, 0, 600, false),
            (1_001, 1, 599, false),
            (1_300, 300, 300, false),
            (1_599, 599, 1, false),
            (1_600, 600, 0, true),
            (5_000, 4_000, 0, true),
        ];
        for (now, elapsed, remaining, expired) in cases {
            assert_eq!(d.elapsed(ts(now)), secs(elapsed), "elapsed at {now}");
            assert_eq!(d.remaining(ts(now)), secs(remaining), "remaining at {now}");
            assert_eq!(d.expired(ts(now)), expired, "expired at {now}");
        }
        let sub_second = ts(1_000)
            .checked_add(SignedDuration::from_millis(599_500))
            .expect("in range");
        assert_eq!(d.remaining(sub_second), Duration::from_millis(500));
        assert!(!d.expired(sub_second));
    }

    #[test]
    fn bound_clamps_to_what_is_left() {
        let d = Deadline::new(ts(0), secs(600));
        // (now, step bound, want)
        let cases = [
            (0, 60, 60),
            (0, 600, 600),
            (0, 900, 600),
            (550, 60, 50),
            (540, 60, 60),
            (600, 60, 0),
            (700, 60, 0),
        ];
        for (now, step, want) in cases {
            assert_eq!(
                d.bound(ts(now), secs(step)),
                secs(want),
                "at {now}, step {step}"
            );
        }
    }

    #[test]
    fn deadline_instant() {
        let d = Deadline::new(ts(1_000), secs(7_200));
        assert_eq!(d.expires_at(), Some(ts(8_200)));
        assert_eq!(Deadline::new(ts(0), Duration::MAX).expires_at(), None);
    }

    #[test]
    fn step_bounds_follow_grace_and_settings() {
        let settings = ResolvedSettings {
            volume_detach_timeout: secs(120),
            volume_reattach_timeout: secs(90),
            ..Default::default()
        };
        // (pod, grace, pod gone, detach)
        let cases = [
            (pod("a", "default"), 30, 60, 150),
            (pod("a", "long").grace(300), 300, 330, 420),
            (pod("a", "zero").grace(0), 0, 30, 120),
            (pod("a", "negative").grace(-5), 0, 30, 120),
            (Pod::default(), 30, 60, 150),
        ];
        for (pod, grace, gone, detach) in cases {
            let g = grace_period(&pod);
            assert_eq!(g, secs(grace), "{:?}", pod.metadata.name);
            assert_eq!(pod_gone_bound(g), secs(gone));
            assert_eq!(detach_bound(g, &settings), secs(detach));
        }
        assert_eq!(reattach_bound(&settings), secs(90));
    }

    #[test]
    fn step_bounds_add_up_and_print() {
        let all = StepBounds {
            pod_gone: secs(60),
            detach: Some(secs(150)),
            reattach: Some(secs(90)),
        };
        assert_eq!(all.total(), secs(300));
        assert_eq!(
            all.to_string(),
            "pod gone ≤ 1m, detach ≤ 2m 30s, reattach ≤ 1m 30s"
        );
        let gone_only = StepBounds {
            pod_gone: secs(60),
            detach: None,
            reattach: None,
        };
        assert_eq!(gone_only.total(), secs(60));
        assert_eq!(gone_only.to_string(), "pod gone ≤ 1m");
        let saturating = StepBounds {
            pod_gone: Duration::MAX,
            detach: Some(secs(1)),
            reattach: None,
        };
        assert_eq!(saturating.total(), Duration::MAX);
    }
}
