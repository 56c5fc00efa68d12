//! Leader election on a `coordination.k8s.io/v1` Lease, so that only one
//! replica of berth reconciles and drains at a time.
//!
//! Built on [`kube_lease_manager`]: its `LeaseManager::changed()` acquires
//! the Lease when it is free or expired and renews it while held. Around it,
//! this module adds what a controller needs to be safe:
//!
//! * **Evidence before claiming.** `changed()` reporting "held" is not enough
//!   to announce leadership: a watchdog reads the Lease and announces
//!   leadership (the [`watch::Receiver<bool>`] turns `true`) only after it
//!   saw this identity as holder with a `renewTime` that is still valid.
//! * **A local deadline.** kube's client has no response timeout by default,
//!   so a renewal can hang forever while the library still believes it is
//!   the holder. The watchdog therefore keeps its own deadline: leadership
//!   is valid until `renewTime + leaseDuration - margin` of the last renewal
//!   it *observed* (`margin` is half the renew grace period and covers clock
//!   skew between replicas). The watchdog re-reads the Lease shortly after
//!   each expected renewal; if it cannot confirm one before the deadline,
//!   this replica steps down on its own. Other replicas take over only after
//!   `renewTime + leaseDuration`, so the two never overlap as long as clocks
//!   are within `margin` of each other.
//! * **Leadership is one-shot.** Once held, losing it for any reason (another
//!   holder, the deadline, the Lease deleted, the background task dying)
//!   ends the election: the channel turns `false`, the background task ends,
//!   and [`LeaderElection::lost`] resolves with the reason. The caller is
//!   expected to stop leader work and exit; a restarted process starts a
//!   fresh election. Nothing is retried silently while holding.
//! * **The background task cannot die silently.** If it ends or panics,
//!   its sender is dropped, which wakes [`LeaderElection::acquired`] and
//!   [`LeaderElection::lost`] (they never hang on a dead task), and the
//!   task's error is reported.
//! * **Graceful hand-over.** [`LeaderElection::release`] (or dropping the
//!   [`LeaderElection`]) first publishes `false`, then clears the Lease's
//!   holder, so the other replica takes over within one lease duration
//!   instead of waiting for expiry. Stop leader work *before* releasing.
//!
//! While not leader, API errors are retried with backoff forever, except a
//! deleted Lease, which ends the election with [`LeaderError::LeaseDeleted`]
//! (a restart recreates it).
//!
//! Timing, for a lease duration of `d` whole seconds (at least 2): renewals
//! start `g = max(1, d/3)` seconds before expiry; this replica stops
//! claiming `g/2` before expiry; the watchdog polls every `g/8` around
//! renewals, with reads timing out after `g/2`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until, timeout};

use super::fence::Fence;

/// The library names its field manager `kube-lease-manager-<identity>`, and
/// field manager names are limited to 128 bytes.
const MAX_IDENTITY_LEN: usize = 128 - "kube-lease-manager-".len();
/// Shortest lease duration: the renew grace period needs a whole second and
/// must be shorter than the lease.
const MIN_LEASE_SECONDS: u64 = 2;

/// Why leader election failed, stopped, or was lost.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LeaderError {
    /// The arguments to [`LeaderElection::start`] are unusable.
    #[error("invalid leader election settings: {0}")]
    InvalidConfig(String),
    /// A Kubernetes API call about the Lease failed for good.
    #[error("Kubernetes API error on Lease {lease}: {source}")]
    Kube {
        lease: String,
        #[source]
        source: Arc<kube::Error>,
    },
    /// The Lease object disappeared.
    #[error("Lease {lease} was deleted")]
    LeaseDeleted { lease: String },
    /// The lease library reported an internal inconsistency.
    #[error("Lease {lease}: inconsistent lease manager state: {detail}")]
    Inconsistent { lease: String, detail: String },
    /// Another identity holds the Lease now (`holder` is `None` when the
    /// library noticed the loss without naming the new holder).
    #[error("lost Lease {lease} (holder now: {})", .holder.as_deref().unwrap_or("unknown"))]
    Lost {
        lease: String,
        holder: Option<String>,
    },
    /// No renewal could be confirmed in time, so this replica stepped down
    /// before the Lease could expire under it.
    #[error("could not confirm a renewal of Lease {lease} in time; stepped down")]
    RenewDeadline { lease: String },
    /// The background election task panicked.
    #[error("leader election task for Lease {lease} panicked")]
    TaskPanicked { lease: String },
    /// The background election task ended without saying why (cancelled,
    /// or its result was already reported).
    #[error("leader election task for Lease {lease} ended")]
    TaskEnded { lease: String },
}

impl LeaderError {
    /// A short, fixed label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            LeaderError::InvalidConfig(_) => "invalid_config",
            LeaderError::Kube { .. } => "kube",
            LeaderError::LeaseDeleted { .. } => "lease_deleted",
            LeaderError::Inconsistent { .. } => "inconsistent_state",
            LeaderError::Lost { .. } => "lost",
            LeaderError::RenewDeadline { .. } => "renew_deadline",
            LeaderError::TaskPanicked { .. } => "task_panicked",
            LeaderError::TaskEnded { .. } => "task_ended",
        }
    }

    fn from_manager(lease: &str, e: LeaseManagerError) -> Self {
        let lease = lease.to_string();
        match e {
            LeaseManagerError::KubeError(source) => LeaderError::Kube {
                lease,
                source: Arc::new(source),
            },
            LeaseManagerError::NonexistentLease(_) => LeaderError::LeaseDeleted { lease },
            other => LeaderError::Inconsistent {
                lease,
                detail: other.to_string(),
            },
        }
    }
}

/// One replica's participation in the election for one Lease.
///
/// Dropping it stops the election and releases the Lease in the background
/// (best effort); prefer [`LeaderElection::release`] on shutdown.
#[derive(Debug)]
pub struct LeaderElection {
    lease: String,
    identity: String,
    lease_duration: Duration,
    is_leader: watch::Receiver<bool>,
    /// Dropping or firing it asks the task to release and stop.
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), LeaderError>>>,
    /// The task's result, once collected.
    outcome: Option<LeaderError>,
    /// Leadership was announced at some point.
    held: bool,
}

impl LeaderElection {
    /// Makes sure the Lease exists (creating it if needed) and starts
    /// competing for it in a background task.
    ///
    /// `identity` must be unique per replica (the pod name is a good
    /// choice). `lease_duration` must be whole seconds, at least 2.
    ///
    /// # Errors
    /// [`LeaderError::InvalidConfig`] for bad arguments, or the error of
    /// reading or creating the Lease.
    pub async fn start(
        client: kube::Client,
        namespace: &str,
        lease_name: &str,
        identity: &str,
        lease_duration: Duration,
    ) -> Result<Self, LeaderError> {
        Self::start_fenced(
            client,
            namespace,
            lease_name,
            identity,
            lease_duration,
            Fence::closed(),
        )
        .await
    }

    /// [`LeaderElection::start`], keeping `fence` open exactly while
    /// leadership is valid by the clock (see [`fence`](super::fence)).
    ///
    /// # Errors
    /// As [`LeaderElection::start`].
    pub async fn start_fenced(
        client: kube::Client,
        namespace: &str,
        lease_name: &str,
        identity: &str,
        lease_duration: Duration,
        fence: Fence,
    ) -> Result<Self, LeaderError> {
        let timing = Timing::new(lease_duration)?;
        for (what, value) in [
            ("namespace", namespace),
            ("lease name", lease_name),
            ("identity", identity),
        ] {
            if value.is_empty() {
                return Err(LeaderError::InvalidConfig(format!("empty {what}")));
            }
        }
        if identity.len() > MAX_IDENTITY_LEN {
            return Err(LeaderError::InvalidConfig(format!(
                "identity is longer than {MAX_IDENTITY_LEN} bytes"
            )));
        }
        let lease = format!("{namespace}/{lease_name}");

        let manager = LeaseManagerBuilder::new(client.clone(), lease_name)
            .with_namespace(namespace)
            .with_identity(identity)
            .with_duration(timing.seconds)
            .with_grace(timing.grace_seconds)
            .build()
            .await
            .map_err(|e| LeaderError::from_manager(&lease, e))?;

        let (tx, is_leader) = watch::channel(false);
        let (stop, stop_rx) = oneshot::channel();
        let elector = Elector {
            manager,
            api: Api::namespaced(client, namespace),
            lease: lease.clone(),
            name: lease_name.to_string(),
            identity: identity.to_string(),
            timing,
            tx,
            fence,
        };
        let task = tokio::spawn(elector.run(stop_rx));
        tracing::info!(%lease, %identity, ?lease_duration, "started leader election");

        Ok(Self {
            lease,
            identity: identity.to_string(),
            lease_duration,
            is_leader,
            stop: Some(stop),
            task: Some(task),
            outcome: None,
            held: false,
        })
    }

    /// This replica's identity in the Lease.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// `namespace/name` of the Lease.
    pub fn lease(&self) -> &str {
        &self.lease
    }

    /// Whether this replica is leader right now.
    pub fn is_leader(&self) -> bool {
        *self.is_leader.borrow()
    }

    /// A channel that is `true` exactly while this replica may act as
    /// leader. Its sender is dropped when the election ends.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.is_leader.clone()
    }

    /// Waits until this replica is leader. Cancel-safe.
    ///
    /// # Errors
    /// Why the election ended if it ended before (or after) leadership was
    /// acquired.
    pub async fn acquired(&mut self) -> Result<(), LeaderError> {
        loop {
            if *self.is_leader.borrow_and_update() {
                self.held = true;
                return Ok(());
            }
            if self.held || self.is_leader.changed().await.is_err() {
                return Err(self.outcome().await);
            }
        }
    }

    /// Resolves when leadership, once held, is lost, or when the election
    /// ends for any reason (even if never held); returns why. Never
    /// resolves while this replica keeps waiting for or holding the Lease.
    /// Cancel-safe.
    pub async fn lost(&mut self) -> LeaderError {
        loop {
            if *self.is_leader.borrow_and_update() {
                self.held = true;
            } else if self.held {
                break;
            }
            if self.is_leader.changed().await.is_err() {
                break;
            }
        }
        self.outcome().await
    }

    /// Stops competing and, if this replica holds the Lease, clears its
    /// holder so another replica can take over at once. Stop all leader
    /// work before calling this.
    ///
    /// # Errors
    /// The error of the release call, or the error that had already ended
    /// the election and was not reported yet.
    pub async fn release(mut self) -> Result<(), LeaderError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let Some(task) = self.task.take() else {
            return Ok(());
        };
        let result = join(&self.lease, task).await;
        tracing::info!(lease = %self.lease, identity = %self.identity, ?result, "left leader election");
        result
    }

    /// Collects the result of the background task, which has ended or is
    /// about to: leadership was lost or the watch sender is gone.
    async fn outcome(&mut self) -> LeaderError {
        if let Some(e) = &self.outcome {
            return e.clone();
        }
        let lease = self.lease.clone();
        let err = match self.task.as_mut() {
            None => LeaderError::TaskEnded { lease },
            Some(task) => {
                // Every loss path ends the task right after publishing
                // `false`; the bound only guards against a bug here.
                match timeout(self.lease_duration, &mut *task).await {
                    Ok(joined) => match joined_result(&lease, joined) {
                        Ok(()) => LeaderError::TaskEnded { lease },
                        Err(e) => e,
                    },
                    Err(_) => {
                        task.abort();
                        LeaderError::TaskEnded { lease }
                    }
                }
            }
        };
        self.task = None;
        tracing::warn!(lease = %self.lease, identity = %self.identity, error = %err, "leader election ended");
        self.outcome = Some(err.clone());
        err
    }
}

async fn join(lease: &str, task: JoinHandle<Result<(), LeaderError>>) -> Result<(), LeaderError> {
    joined_result(lease, task.await)
}

fn joined_result(
    lease: &str,
    joined: Result<Result<(), LeaderError>, tokio::task::JoinError>,
) -> Result<(), LeaderError> {
    match joined {
        Ok(result) => result,
        Err(e) if e.is_panic() => Err(LeaderError::TaskPanicked {
            lease: lease.to_string(),
        }),
        Err(_) => Err(LeaderError::TaskEnded {
            lease: lease.to_string(),
        }),
    }
}

/// Durations derived from the lease duration; see the module docs.
#[derive(Debug, Clone, Copy)]
struct Timing {
    seconds: u64,
    grace_seconds: u64,
    duration: Duration,
    grace: Duration,
    /// Stop claiming this long before the Lease expires.
    margin: Duration,
    /// Watchdog poll interval around renewals, and retry delay while
    /// leader.
    poll: Duration,
    /// Timeout of one watchdog read.
    read_timeout: Duration,
}

impl Timing {
    fn new(lease_duration: Duration) -> Result<Self, LeaderError> {
        let seconds = lease_duration.as_secs();
        if lease_duration.subsec_nanos() != 0 || seconds < MIN_LEASE_SECONDS {
            return Err(LeaderError::InvalidConfig(format!(
                "lease duration must be whole seconds, at least {MIN_LEASE_SECONDS}s (got {lease_duration:?})"
            )));
        }
        if i32::try_from(seconds).is_err() {
            return Err(LeaderError::InvalidConfig(format!(
                "lease duration {lease_duration:?} is too long"
            )));
        }
        let grace_seconds = (seconds / 3).max(1);
        let grace = Duration::from_secs(grace_seconds);
        Ok(Self {
            seconds,
            grace_seconds,
            duration: lease_duration,
            grace,
            margin: grace / 2,
            poll: grace / 8,
            read_timeout: grace / 2,
        })
    }
}

/// A read of a Lease this identity holds: when the read started, on the
/// monotonic and on the wall clock, and the `renewTime` it found.
#[derive(Debug, Clone, Copy)]
struct Read {
    at: Instant,
    wall: SystemTime,
    renewed: SystemTime,
}

impl Timing {
    /// Until when a read lets this identity call itself leader: the Lease's
    /// expiry less the margin, and never more than one lease duration less
    /// the margin from the read, whatever `renewTime` says (a clock ahead of
    /// ours must not extend leadership). Pure: `now` is the caller's.
    fn valid_until(&self, r: Read) -> Instant {
        (r.at + until(r.wall, r.renewed + self.duration - self.margin))
            .min(r.at + self.duration - self.margin)
    }

    /// When to read the Lease again after a read that saw a new renewal:
    /// a poll after the next renewal is due (the library renews a grace
    /// before expiry), or a poll from `now` if that is already past.
    fn next_check(&self, r: Read, now: Instant) -> Instant {
        let renewal = r.at + until(r.wall, r.renewed + self.duration - self.grace);
        renewal.max(now) + self.poll
    }
}

/// What one watchdog read of the Lease found.
enum Observed {
    /// This identity holds it, renewed at `renewed` (by our own clock, since
    /// we wrote it); `at`/`wall` are when the read started.
    Held {
        renewed: SystemTime,
        at: Instant,
        wall: SystemTime,
    },
    /// Someone else (or nobody) holds it.
    NotHeld(Option<String>),
    Deleted,
    /// The read failed or timed out.
    Unknown(String),
}

/// Leadership as the library reported it, with the watchdog's view.
struct Holding {
    /// Leadership was published to the channel.
    announced: bool,
    /// Step down (or give up acquiring) at this instant.
    deadline: Instant,
    /// The last `renewTime` the watchdog saw.
    renewed: Option<SystemTime>,
    /// When the watchdog reads the Lease next.
    next_check: Instant,
}

enum Event {
    Stop,
    Deadline,
    Changed(Result<bool, LeaseManagerError>),
    Observed(Observed),
}

/// The background task's state.
struct Elector {
    manager: LeaseManager,
    api: Api<Lease>,
    lease: String,
    name: String,
    identity: String,
    timing: Timing,
    tx: watch::Sender<bool>,
    /// Open while leadership is valid by the clock.
    fence: Fence,
}

impl Elector {
    fn publish(&self, leader: bool) {
        if !leader {
            self.fence.close();
        }
        self.tx.send_if_modified(|current| {
            let modified = *current != leader;
            *current = leader;
            modified
        });
    }

    async fn run(self, mut stop: oneshot::Receiver<()>) -> Result<(), LeaderError> {
        let t = self.timing;
        let mut changed = Box::pin(changed_after(&self.manager, Duration::ZERO));
        let mut holding: Option<Holding> = None;
        let first_backoff = t.poll.max(Duration::from_millis(100));
        let mut backoff = first_backoff;
        let mut last_error: Option<Instant> = None;
        let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);

        loop {
            let deadline = holding.as_ref().map_or(far, |h| h.deadline);
            let next_check = holding.as_ref().map_or(far, |h| h.next_check);
            let event = tokio::select! {
                biased;
                _ = &mut stop => Event::Stop,
                () = sleep_until(deadline), if holding.is_some() => Event::Deadline,
                r = &mut changed => Event::Changed(r),
                o = self.observe(next_check), if holding.is_some() => Event::Observed(o),
            };

            match event {
                Event::Stop => {
                    drop(changed);
                    return self.release(holding.is_some()).await;
                }
                Event::Deadline => {
                    self.publish(false);
                    return Err(LeaderError::RenewDeadline {
                        lease: self.lease.clone(),
                    });
                }
                Event::Changed(Ok(true)) => {
                    if holding.is_none() {
                        tracing::debug!(lease = %self.lease, "lease manager holds the Lease; confirming");
                        let now = Instant::now();
                        holding = Some(Holding {
                            announced: false,
                            deadline: now + t.duration,
                            renewed: None,
                            next_check: now,
                        });
                    }
                    changed = Box::pin(changed_after(&self.manager, Duration::ZERO));
                }
                Event::Changed(Ok(false)) => {
                    if holding.as_ref().is_some_and(|h| h.announced) {
                        self.publish(false);
                        return Err(LeaderError::Lost {
                            lease: self.lease.clone(),
                            holder: None,
                        });
                    }
                    holding = None;
                    changed = Box::pin(changed_after(&self.manager, Duration::ZERO));
                }
                Event::Changed(Err(e)) => {
                    let err = LeaderError::from_manager(&self.lease, e);
                    if !matches!(err, LeaderError::Kube { .. }) {
                        self.publish(false);
                        return Err(err);
                    }
                    // Transient: while holding, the watchdog's deadline
                    // decides; otherwise back off.
                    let now = Instant::now();
                    if last_error.is_none_or(|at| now.duration_since(at) > t.duration * 2) {
                        backoff = first_backoff;
                    }
                    last_error = Some(now);
                    let delay = if holding.is_some() {
                        t.poll
                    } else {
                        let d = backoff;
                        backoff = (backoff * 2).min(t.duration);
                        d
                    };
                    tracing::warn!(lease = %self.lease, error = %err, retry_in = ?delay, "leader election API error");
                    changed = Box::pin(changed_after(&self.manager, delay));
                }
                Event::Observed(observed) => {
                    if let Some(h) = holding.as_mut() {
                        self.on_observed(h, observed)?;
                    }
                }
            }
        }
    }

    /// Updates `h` from a watchdog read. An error ends the election.
    fn on_observed(&self, h: &mut Holding, observed: Observed) -> Result<(), LeaderError> {
        let t = self.timing;
        let now = Instant::now();
        match observed {
            Observed::Held { renewed, at, wall } => {
                let read = Read { at, wall, renewed };
                let valid_until = t.valid_until(read);
                if valid_until > now {
                    if h.announced {
                        h.deadline = h.deadline.max(valid_until);
                        self.fence.hold_until(h.deadline);
                    } else {
                        h.announced = true;
                        h.deadline = valid_until;
                        tracing::info!(lease = %self.lease, identity = %self.identity, "became leader");
                        self.fence.hold_until(h.deadline);
                        self.publish(true);
                    }
                }
                if h.renewed == Some(renewed) {
                    // The renewal we expect has not happened yet.
                    h.next_check = now + t.poll;
                } else {
                    h.renewed = Some(renewed);
                    h.next_check = t.next_check(read, now);
                }
                Ok(())
            }
            Observed::NotHeld(holder) => {
                if h.announced {
                    self.publish(false);
                    return Err(LeaderError::Lost {
                        lease: self.lease.clone(),
                        holder,
                    });
                }
                // The library will notice too; keep looking until then.
                h.next_check = now + t.poll;
                Ok(())
            }
            Observed::Deleted => {
                self.publish(false);
                Err(LeaderError::LeaseDeleted {
                    lease: self.lease.clone(),
                })
            }
            Observed::Unknown(error) => {
                tracing::warn!(lease = %self.lease, %error, "could not read the Lease to confirm leadership");
                h.next_check = now + t.poll;
                Ok(())
            }
        }
    }

    async fn observe(&self, at: Instant) -> Observed {
        sleep_until(at).await;
        let at = Instant::now();
        let wall = SystemTime::now();
        let lease = match timeout(self.timing.read_timeout, self.api.get(&self.name)).await {
            Err(_) => return Observed::Unknown("timed out".into()),
            Ok(Err(kube::Error::Api(status))) if status.code == 404 => return Observed::Deleted,
            Ok(Err(e)) => return Observed::Unknown(e.to_string()),
            Ok(Ok(lease)) => lease,
        };
        let spec = lease.spec.unwrap_or_default();
        match (spec.holder_identity, spec.renew_time) {
            (Some(holder), Some(renewed)) if holder == self.identity => Observed::Held {
                renewed: SystemTime::from(renewed.0),
                at,
                wall,
            },
            (holder, _) => Observed::NotHeld(holder),
        }
    }

    async fn release(&self, holding: bool) -> Result<(), LeaderError> {
        self.publish(false);
        if !holding {
            return Ok(());
        }
        match timeout(self.timing.duration, self.manager.release()).await {
            Ok(Ok(())) => {
                tracing::info!(lease = %self.lease, identity = %self.identity, "released the Lease");
                Ok(())
            }
            Ok(Err(e)) => Err(LeaderError::from_manager(&self.lease, e)),
            Err(_) => Err(LeaderError::RenewDeadline {
                lease: self.lease.clone(),
            }),
        }
    }
}

/// `manager.changed()` after `delay`; one type for every retry.
async fn changed_after(manager: &LeaseManager, delay: Duration) -> Result<bool, LeaseManagerError> {
    if !delay.is_zero() {
        sleep(delay).await;
    }
    manager.changed().await
}

/// How long from wall-clock `now` until `then` (zero if already past).
fn until(now: SystemTime, then: SystemTime) -> Duration {
    then.duration_since(now).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_follows_the_lease_duration() {
        let t = Timing::new(Duration::from_secs(15)).expect("valid");
        assert_eq!((t.seconds, t.grace_seconds), (15, 5));
        assert_eq!(t.margin, Duration::from_millis(2500));
        assert_eq!(t.poll, Duration::from_millis(625));
        let t = Timing::new(Duration::from_secs(2)).expect("valid");
        assert_eq!((t.seconds, t.grace_seconds), (2, 1));
        assert!(t.margin < t.grace && t.poll < t.margin);
    }

    /// A read at `at`, with our wall clock at `wall`, of a Lease renewed
    /// `age` before `wall` (negative: a renewTime ahead of our clock).
    fn read(at: Instant, wall: SystemTime, age_ms: i64) -> Read {
        let renewed = if age_ms >= 0 {
            wall - Duration::from_millis(age_ms.unsigned_abs())
        } else {
            wall + Duration::from_millis(age_ms.unsigned_abs())
        };
        Read { at, wall, renewed }
    }

    #[test]
    fn leadership_lasts_until_expiry_less_the_margin_and_never_longer() {
        // Lease 15 s: margin 2.5 s, grace 5 s, poll 625 ms. The clocks are
        // arguments: nothing here waits.
        let t = Timing::new(Duration::from_secs(15)).expect("valid");
        let at = Instant::now();
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let ms = Duration::from_millis;
        for (age_ms, valid_for) in [
            // Just renewed: the whole duration less the margin.
            (0, ms(12_500)),
            // Renewed 10 s ago: 2.5 s left.
            (10_000, ms(2_500)),
            // Renewed 12.5 s ago or earlier: no longer leader.
            (12_500, ms(0)),
            (60_000, ms(0)),
            // renewTime 30 s ahead of our clock: still one duration at most.
            (-30_000, ms(12_500)),
        ] {
            assert_eq!(
                t.valid_until(read(at, wall, age_ms)),
                at + valid_for,
                "renewed {age_ms} ms before the read"
            );
        }
    }

    #[test]
    fn the_watchdog_looks_again_a_poll_after_the_next_renewal_is_due() {
        let t = Timing::new(Duration::from_secs(15)).expect("valid");
        let at = Instant::now();
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let ms = Duration::from_millis;
        // Just renewed: the next renewal is due 10 s on (duration - grace).
        assert_eq!(t.next_check(read(at, wall, 0), at), at + ms(10_000 + 625));
        // Renewed 4 s ago: due in 6 s.
        assert_eq!(
            t.next_check(read(at, wall, 4_000), at),
            at + ms(6_000 + 625)
        );
        // Overdue: one poll from now, not in the past.
        let now = at + ms(3_000);
        assert_eq!(t.next_check(read(at, wall, 20_000), now), now + ms(625));
    }

    #[test]
    fn timing_rejects_unusable_durations() {
        for d in [
            Duration::ZERO,
            Duration::from_secs(1),
            Duration::from_millis(2500),
            Duration::from_secs(u64::from(u32::MAX)),
        ] {
            let err = Timing::new(d).expect_err("invalid");
            assert_eq!(err.metric_label(), "invalid_config", "{d:?}");
        }
    }

    #[test]
    fn metric_labels_are_static_snake_case() {
        let lease = "ns/l".to_string();
        let all = [
            LeaderError::InvalidConfig("x".into()),
            LeaderError::LeaseDeleted {
                lease: lease.clone(),
            },
            LeaderError::Inconsistent {
                lease: lease.clone(),
                detail: "d".into(),
            },
            LeaderError::Lost {
                lease: lease.clone(),
                holder: Some("b".into()),
            },
            LeaderError::RenewDeadline {
                lease: lease.clone(),
            },
            LeaderError::TaskPanicked {
                lease: lease.clone(),
            },
            LeaderError::TaskEnded { lease },
        ];
        for e in all {
            let label = e.metric_label();
            assert!(
                label.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{label}"
            );
            assert!(!e.to_string().is_empty());
        }
    }
}
