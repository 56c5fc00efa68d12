//! The fence: no request that changes the cluster leaves this process
//! unless it holds leadership at the instant the request is sent.
//!
//! Losing the Lease is noticed by a task (the election's watchdog), and
//! tasks can be late: after a long stop (SIGSTOP, a VM paused, a starved
//! node) every timer that expired during the stop fires at once, and a
//! drain's eviction or status write may run before the watchdog does. The
//! fence does not wait for that task: the election gives it the instant
//! until which leadership is valid (the last renewal it observed, plus the
//! lease duration, less a margin; see [`leader`](super::leader)), and the
//! fence compares that instant with the monotonic clock, which runs on
//! while the process is stopped, at the moment each request goes out (in
//! the client's stack, after the rate limiter has let it through). A write
//! refused there fails like any request that did not reach the API server;
//! the process is on its way out (leadership is one-shot), and the next
//! leader resumes every step from the cluster's state.
//!
//! Reads (GET, which also carries lists and watches) are never fenced: a
//! standby replica keeps its caches warm.
//!
//! A request that passed that check can still be in the process's own
//! buffers when the process is stopped: its bytes are written to the socket
//! by the connection's task, later. So the connections run on a
//! `FencedExecutor`, which drops a connection instead of polling it once
//! leadership is lost: what a stopped leader had not handed to the kernel
//! is never sent. (The end-to-end test that freezes a leader mid-drain saw
//! exactly that: a status write and an Event received 7 ms after the new
//! leader took the Lease, before the connections were fenced too.)
//!
//! What it cannot close: bytes already in the kernel, or on the network,
//! that take longer than the margin to arrive. Kubernetes has no fencing
//! token to reject them at the API server; the margin (half the renew
//! grace period) is the bound, as it is for client-go's leader election.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::time::Instant;
use tower::{BoxError, Layer, Service};

/// Whether this process may change the cluster now. Cheap to clone; every
/// clone sees the same state.
#[derive(Clone, Debug)]
pub struct Fence(Option<Arc<State>>);

#[derive(Debug)]
struct State {
    /// The origin of `open_until`.
    base: Instant,
    /// Nanoseconds after `base` until which writes are let through; 0 while
    /// not (yet) leader.
    open_until: AtomicU64,
    /// Set once leadership is lost: it never opens again.
    closed: AtomicBool,
    /// Set once leadership was held.
    held: AtomicBool,
}

impl Fence {
    /// A fence that is always open: the process runs without leader
    /// election (one replica by the operator's word).
    pub fn open() -> Self {
        Self(None)
    }

    /// A fence closed until `Fence::hold_until` opens it: leadership is
    /// to be won first.
    pub fn closed() -> Self {
        Self(Some(Arc::new(State {
            base: Instant::now(),
            open_until: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            held: AtomicBool::new(false),
        })))
    }

    /// Whether a write may go out now.
    pub fn allows(&self) -> bool {
        self.allows_at(Instant::now())
    }

    /// Whether a write may go out at `now`.
    fn allows_at(&self, now: Instant) -> bool {
        let Some(s) = &self.0 else {
            return true;
        };
        if s.closed.load(Ordering::Acquire) {
            return false;
        }
        let until = s.open_until.load(Ordering::Acquire);
        let now =
            u64::try_from(now.saturating_duration_since(s.base).as_nanos()).unwrap_or(u64::MAX);
        now < until
    }

    /// Leadership is valid until `until` (never shortened: the election
    /// only extends it, and ends it with [`Fence::close`]).
    pub(crate) fn hold_until(&self, until: Instant) {
        if let Some(s) = &self.0 {
            s.held.store(true, Ordering::Release);
            let nanos = u64::try_from(until.saturating_duration_since(s.base).as_nanos())
                .unwrap_or(u64::MAX);
            s.open_until.fetch_max(nanos, Ordering::AcqRel);
        }
    }

    /// Whether leadership was held and is no longer valid now: a
    /// connection of this process must not send another byte. (A standby
    /// that never held it reads freely.)
    pub fn lost(&self) -> bool {
        self.lost_at(Instant::now())
    }

    fn lost_at(&self, now: Instant) -> bool {
        self.0
            .as_ref()
            .is_some_and(|s| s.held.load(Ordering::Acquire))
            && !self.allows_at(now)
    }

    /// Leadership is lost, for good.
    pub(crate) fn close(&self) {
        if let Some(s) = &self.0 {
            s.closed.store(true, Ordering::Release);
        }
    }
}

/// The executor the client's HTTP connections run on: a connection's task
/// is where a request's bytes are written to the socket, which may be a
/// while after the request passed [`FenceService`] (a process stopped in
/// between wakes with the request still in its buffers). Each poll of a
/// connection first asks the fence; once leadership is [lost](Fence::lost)
/// the connection is dropped instead, and nothing it holds is sent.
#[derive(Clone)]
pub(crate) struct FencedExecutor(pub(crate) Fence);

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

impl hyper::rt::Executor<Task> for FencedExecutor {
    fn execute(&self, mut task: Task) {
        let fence = self.0.clone();
        tokio::spawn(std::future::poll_fn(move |cx| {
            if fence.lost() {
                return Poll::Ready(());
            }
            task.as_mut().poll(cx)
        }));
    }
}

/// Why a write was not sent.
#[derive(Debug, thiserror::Error)]
#[error("not leader: a {method} request was not sent (leadership lost or expired)")]
pub struct Fenced {
    method: http::Method,
}

/// The [`Layer`] that puts a [`Fence`] in a client's stack.
#[derive(Clone)]
pub(crate) struct FenceLayer(pub(crate) Fence);

impl<S> Layer<S> for FenceLayer {
    type Service = FenceService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        FenceService {
            inner,
            fence: self.0.clone(),
        }
    }
}

/// The service [`FenceLayer`] wraps: refuses every request but a read
/// while the fence is shut.
pub(crate) struct FenceService<S> {
    inner: S,
    fence: Fence,
}

impl<S, B> Service<http::Request<B>> for FenceService<S>
where
    S: Service<http::Request<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = req.method().clone();
        if !is_read(&method) && !self.fence.allows() {
            tracing::warn!(%method, uri = %req.uri().path(), "not leader: write not sent");
            return Box::pin(std::future::ready(Err(Fenced { method }.into())));
        }
        let fut = self.inner.call(req);
        Box::pin(async move { fut.await.map_err(Into::into) })
    }
}

/// GET (reads, lists, watches), HEAD and OPTIONS change nothing.
fn is_read(method: &http::Method) -> bool {
    matches!(
        *method,
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    )
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::time::Duration;

    use tower::{ServiceExt, service_fn};

    use super::*;

    fn request(method: http::Method) -> http::Request<()> {
        http::Request::builder()
            .method(method)
            .uri("/api/v1/namespaces/a/pods/p/eviction")
            .body(())
            .expect("request")
    }

    async fn send(fence: &Fence, method: http::Method) -> bool {
        let echo = service_fn(|_r: http::Request<()>| async { Ok::<_, Infallible>(()) });
        let svc = FenceLayer(fence.clone()).layer(echo);
        svc.oneshot(request(method)).await.is_ok()
    }

    #[test]
    fn leadership_is_valid_by_the_clock() {
        let fence = Fence::closed();
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        assert!(!fence.allows_at(at(0)), "not leader yet");
        fence.hold_until(at(10));
        assert!(fence.allows_at(at(1)));
        // The clock passes the deadline with no renewal observed (the
        // process was stopped, or the watchdog is late): shut, although
        // nobody told the fence.
        assert!(!fence.allows_at(at(11)));
        // A renewal observed opens it again; a shorter deadline never
        // shortens it.
        fence.hold_until(at(21));
        fence.hold_until(at(12));
        assert!(fence.allows_at(at(16)));
        // Lost: shut for good.
        fence.close();
        fence.hold_until(at(40));
        assert!(!fence.allows_at(at(16)));
        assert!(fence.lost_at(at(16)));
    }

    #[test]
    fn a_standby_that_never_led_has_lost_nothing() {
        let fence = Fence::closed();
        let t0 = Instant::now();
        assert!(!fence.lost_at(t0), "never held: its reads go on");
        fence.hold_until(t0 + Duration::from_secs(5));
        assert!(!fence.lost_at(t0 + Duration::from_secs(1)));
        assert!(
            fence.lost_at(t0 + Duration::from_secs(6)),
            "held, then expired"
        );
        assert!(!Fence::open().lost());
    }

    #[tokio::test]
    async fn a_connection_of_a_leader_that_lost_is_dropped_before_it_sends() {
        use hyper::rt::Executor;
        let fence = Fence::closed();
        fence.hold_until(Instant::now() + Duration::from_secs(60));
        let exec = FencedExecutor(fence.clone());
        let (sent_tx, mut sent) = tokio::sync::mpsc::unbounded_channel::<u32>();
        let (go_tx, go) = tokio::sync::watch::channel(0u32);
        let task = {
            let sent_tx = sent_tx.clone();
            let mut go = go.clone();
            async move {
                // A connection: sends what it is given, while alive.
                while go.changed().await.is_ok() {
                    let _ = sent_tx.send(*go.borrow());
                }
            }
        };
        exec.execute(Box::pin(task));
        go_tx.send_replace(1);
        assert_eq!(sent.recv().await, Some(1), "sent while leader");
        fence.close();
        go_tx.send_replace(2);
        drop(sent_tx);
        assert_eq!(sent.recv().await, None, "dropped, nothing more sent");
    }

    #[tokio::test]
    async fn writes_are_refused_while_shut_and_reads_always_go() {
        let fence = Fence::closed();
        assert!(!send(&fence, http::Method::POST).await);
        assert!(!send(&fence, http::Method::PATCH).await);
        assert!(!send(&fence, http::Method::DELETE).await);
        assert!(send(&fence, http::Method::GET).await);
        fence.hold_until(Instant::now() + Duration::from_secs(60));
        assert!(send(&fence, http::Method::POST).await);
        fence.close();
        assert!(!send(&fence, http::Method::PUT).await);
        assert!(send(&fence, http::Method::GET).await);
    }

    #[tokio::test]
    async fn without_election_the_fence_is_open() {
        assert!(send(&Fence::open(), http::Method::POST).await);
    }
}
