//! A drain's deadline as the instants its waits need: when the deadline
//! is, a step's bound cut to it, a volume wait's bound (never cut, with
//! forcing), when a pod still there is forced, when a pod being deleted
//! stops holding the drain, and whether this is the last try after it.
//!
//! No I/O: the wall clock and the monotonic clock are read here (or passed
//! in, by the `_at` forms the tests use), nothing else.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

use crate::drain::deadline::Deadline;

/// The deadline of one drain and whether it forces pods at it.
#[derive(Debug)]
pub(super) struct Clock {
    deadline: Deadline,
    /// `forceAfterDeadline`.
    force: bool,
    /// Set for the drain's last pass after the deadline without forcing:
    /// each pod gets one more eviction attempt.
    last_try: AtomicBool,
}

/// The two clocks read at one moment.
#[derive(Debug, Clone, Copy)]
pub(super) struct Now {
    pub(super) wall: Timestamp,
    pub(super) mono: Instant,
}

impl Now {
    pub(super) fn read() -> Self {
        Self {
            wall: Timestamp::now(),
            mono: Instant::now(),
        }
    }
}

impl Clock {
    pub(super) fn new(deadline: Deadline, force: bool) -> Self {
        Self {
            deadline,
            force,
            last_try: AtomicBool::new(false),
        }
    }

    /// Whether pods still there at the deadline are forced.
    pub(super) fn forces(&self) -> bool {
        self.force
    }

    /// The deadline as a monotonic instant.
    pub(super) fn deadline(&self) -> Instant {
        self.deadline_at(Now::read())
    }

    pub(super) fn deadline_at(&self, now: Now) -> Instant {
        now.mono + self.deadline.remaining(now.wall)
    }

    pub(super) fn expired(&self) -> bool {
        self.deadline.expired(Timestamp::now())
    }

    /// A step's own bound, cut to the deadline; after the deadline (the
    /// last try without forcing, or the passes with forcing), the step's
    /// own bound.
    pub(super) fn bounded(&self, step: Duration) -> Instant {
        self.bounded_at(step, Now::read())
    }

    pub(super) fn bounded_at(&self, step: Duration, now: Now) -> Instant {
        if self.deadline.expired(now.wall) {
            return now.mono + step;
        }
        now.mono + self.deadline.bound(now.wall, step)
    }

    /// The bound of a wait that keeps data safe (a pod gone, its volumes
    /// detached): with `forceAfterDeadline` the step's own bound, never cut
    /// at the deadline, since budgets are what the deadline gives up, not
    /// volumes; without it, as [`Clock::bounded`].
    pub(super) fn volume_bound(&self, step: Duration) -> Instant {
        self.volume_bound_at(step, Now::read())
    }

    pub(super) fn volume_bound_at(&self, step: Duration, now: Now) -> Instant {
        if self.force {
            return now.mono + step;
        }
        self.bounded_at(step, now)
    }

    /// With `forceAfterDeadline`, when a pod of grace period `grace` that
    /// is still not evicted gets deleted instead, bypassing its budget: at
    /// the deadline minus its grace period, so that it is gone by the
    /// deadline. `None` without forcing.
    pub(super) fn force_at(&self, grace: Duration) -> Option<Instant> {
        self.force_at_now(grace, Now::read())
    }

    pub(super) fn force_at_now(&self, grace: Duration, now: Now) -> Option<Instant> {
        self.force.then(|| {
            let deadline = self.deadline_at(now);
            deadline.checked_sub(grace).unwrap_or(deadline)
        })
    }

    /// When a pod being deleted, with grace period `grace`, stops holding
    /// this drain (see [`Deadline::releases`]).
    pub(super) fn release_of(&self, grace: Duration) -> Instant {
        let now = Now::read();
        now.mono + self.deadline.until_release(grace, now.wall)
    }

    /// Whether a pod being deleted with grace period `grace` no longer
    /// holds this drain.
    pub(super) fn released(&self, grace: Duration) -> bool {
        self.deadline.releases(grace, Timestamp::now())
    }

    /// Whether this is the last pass after the deadline without forcing.
    pub(super) fn last_try(&self) -> bool {
        self.last_try.load(Ordering::Relaxed)
    }

    pub(super) fn start_last_try(&self) {
        self.last_try.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    /// A clock whose deadline of `timeout` started `ago` before `now`.
    fn clock(ago: Duration, timeout: Duration, force: bool) -> (Clock, Now) {
        let now = Now::read();
        let started = now.wall - k8s_openapi::jiff::SignedDuration::try_from(ago).unwrap();
        (Clock::new(Deadline::new(started, timeout), force), now)
    }

    #[test]
    fn a_step_is_cut_to_the_deadline_before_it_and_not_after() {
        let (c, now) = clock(MIN, 3 * MIN, false);
        assert_eq!(c.deadline_at(now), now.mono + 2 * MIN);
        assert_eq!(c.bounded_at(MIN, now), now.mono + MIN);
        assert_eq!(c.bounded_at(5 * MIN, now), now.mono + 2 * MIN);
        let (late, now) = clock(4 * MIN, 3 * MIN, false);
        assert_eq!(late.deadline_at(now), now.mono);
        assert_eq!(late.bounded_at(MIN, now), now.mono + MIN);
    }

    #[test]
    fn a_volume_wait_is_never_cut_when_the_drain_forces() {
        let (forcing, now) = clock(MIN, 3 * MIN, true);
        assert_eq!(forcing.volume_bound_at(10 * MIN, now), now.mono + 10 * MIN);
        let (honest, now) = clock(MIN, 3 * MIN, false);
        assert_eq!(honest.volume_bound_at(10 * MIN, now), now.mono + 2 * MIN);
    }

    #[test]
    fn a_pod_is_forced_its_grace_period_before_the_deadline_and_only_when_forcing() {
        let (c, now) = clock(MIN, 3 * MIN, true);
        assert_eq!(
            c.force_at_now(Duration::from_secs(30), now),
            Some(now.mono + 2 * MIN - Duration::from_secs(30))
        );
        let (c, now) = clock(MIN, 3 * MIN, false);
        assert_eq!(c.force_at_now(Duration::from_secs(30), now), None);
    }

    #[test]
    fn a_terminating_pod_holds_until_the_deadline_plus_its_grace() {
        let (c, _) = clock(MIN, MIN / 2, false);
        assert!(c.released(Duration::from_secs(10)));
        assert!(!c.released(MIN));
        assert!(c.expired());
        let (c, _) = clock(Duration::ZERO, MIN, false);
        assert!(!c.expired());
        assert!(!c.last_try());
        c.start_last_try();
        assert!(c.last_try());
    }
}
