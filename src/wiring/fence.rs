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
//! What it cannot close: a request that passed the fence and is then held
//! in flight (by the network, or a stop in between) for longer than the
//! margin. Kubernetes has no fencing token to reject it at the API server;
//! the margin (half the renew grace period) is the bound, as it is for
//! client-go's leader election.

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
            let nanos = u64::try_from(until.saturating_duration_since(s.base).as_nanos())
                .unwrap_or(u64::MAX);
            s.open_until.fetch_max(nanos, Ordering::AcqRel);
        }
    }

    /// Leadership is lost, for good.
    pub(crate) fn close(&self) {
        if let Some(s) = &self.0 {
            s.closed.store(true, Ordering::Release);
        }
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
