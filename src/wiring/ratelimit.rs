//! The client-side rate limit on requests to the API server: a token
//! bucket, as client-go's `--kube-api-qps`/`--kube-api-burst`. Up to
//! `burst` requests go at once; after that they go at `qps` a second,
//! each as soon as its token is there.
//!
//! tower's own `RateLimit` counts fixed windows instead (`burst` requests
//! per `burst / qps` seconds), so a request that finds the window spent
//! waits for the whole window to end, up to `burst / qps` seconds (2 s at
//! the defaults), however lightly loaded the limiter was on average.
//! The bucket itself is `governor`'s.
//!
//! Several clients may share one bucket (each drain has a client of its
//! own, see `process::LimitedClients`). Each client sends its requests in
//! order, one line; the lines take the tokens in turn: a waiting line
//! retries at the next token's time plus a random part of one token's
//! interval, so no line that is always first to retry (the one that just
//! took a token) keeps the others waiting.
//!
//! A line is urgent ([`TokenBucketLayer::urgent`]) or not. Other lines
//! take no token while an urgent line waits for one. The steps of stateful
//! moves are urgent (a permit, a move's record, the eviction the next
//! replica of a workload waits for): when many drains start at once, the
//! hundreds of other requests they send (evictions of pods without
//! volumes, progress, the Machines' steps) never hold them up.

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use std::time::Duration;

use governor::clock::Clock;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use tower::{Layer, Service};

/// A [`Layer`] that holds requests until the shared bucket has a token.
#[derive(Clone)]
pub(crate) struct TokenBucketLayer {
    bucket: Arc<DefaultDirectRateLimiter>,
    /// Up to one token's interval, added at random to each retry.
    jitter: Duration,
    /// How many urgent lines wait for a token now.
    urgent_waiting: Arc<AtomicUsize>,
    /// Whether the lines of this layer are urgent.
    urgent: bool,
}

impl TokenBucketLayer {
    /// `qps` tokens a second, at most `burst` at once.
    pub fn new(qps: NonZeroU32, burst: NonZeroU32) -> Self {
        let quota = Quota::per_second(qps).allow_burst(burst);
        Self {
            bucket: Arc::new(RateLimiter::direct(quota)),
            jitter: Duration::from_secs(1) / qps.get(),
            urgent_waiting: Arc::default(),
            urgent: false,
        }
    }

    /// The same bucket for urgent lines: while one waits for a token, no
    /// other line takes one.
    pub fn urgent(&self) -> Self {
        Self {
            urgent: true,
            ..self.clone()
        }
    }
}

impl<S> Layer<S> for TokenBucketLayer {
    type Service = TokenBucket<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TokenBucket {
            inner,
            line: Line {
                bucket: self.bucket.clone(),
                jitter: self.jitter,
                urgent_waiting: self.urgent_waiting.clone(),
                urgent: self.urgent,
            },
            waiting: None,
            has_token: false,
        }
    }
}

/// The service [`TokenBucketLayer`] wraps around the client's stack. It is
/// ready once it holds a token and the inner service is ready; each call
/// spends the token.
pub(crate) struct TokenBucket<S> {
    inner: S,
    line: Line,
    waiting: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    has_token: bool,
}

impl<S, R> Service<R> for TokenBucket<S>
where
    S: Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if !self.has_token {
            let line = &self.line;
            let waiting = self
                .waiting
                .get_or_insert_with(|| Box::pin(line.clone().take_token()));
            std::task::ready!(waiting.as_mut().poll(cx));
            self.waiting = None;
            self.has_token = true;
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> Self::Future {
        self.has_token = false;
        self.inner.call(req)
    }
}

/// What a line needs to take its tokens.
#[derive(Clone)]
struct Line {
    bucket: Arc<DefaultDirectRateLimiter>,
    jitter: Duration,
    urgent_waiting: Arc<AtomicUsize>,
    urgent: bool,
}

impl Line {
    /// Waits for a token of the bucket and takes it: each retry at the next
    /// token's time plus a random part of `jitter`. A line that is not
    /// urgent also waits while an urgent one does; an urgent one is counted
    /// while it waits (until this future is done or dropped).
    async fn take_token(self) {
        let mut counted = None;
        loop {
            if !self.urgent && self.urgent_waiting.load(Ordering::Acquire) > 0 {
                tokio::time::sleep(self.jitter + random_part(self.jitter)).await;
                continue;
            }
            match self.bucket.check() {
                Ok(()) => return,
                Err(not_until) => {
                    if self.urgent && counted.is_none() {
                        counted = Some(Waiting::new(&self.urgent_waiting));
                    }
                    let wait = not_until.wait_time_from(self.bucket.clock().now());
                    tokio::time::sleep(wait + random_part(self.jitter)).await;
                }
            }
        }
    }
}

/// An urgent line counted as waiting, for as long as this lives.
struct Waiting(Arc<AtomicUsize>);

impl Waiting {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(count))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A random duration from zero to `max`. `RandomState` is seeded anew for
/// each call: enough to spread retries, without a random number crate.
fn random_part(max: Duration) -> Duration {
    use std::hash::BuildHasher;
    let r = std::collections::hash_map::RandomState::new().hash_one(0u8);
    max.mul_f64((r % 1024) as f64 / 1024.0)
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::time::{Duration, Instant};

    use tower::{ServiceExt, service_fn};

    use super::*;

    async fn send<S: Service<u32>>(svc: &mut S, n: u32) -> Result<S::Response, S::Error> {
        svc.ready().await?.call(n).await
    }

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).expect("non-zero")
    }

    #[tokio::test]
    async fn a_burst_goes_at_once_and_the_rest_at_the_rate() {
        let echo = service_fn(|n: u32| async move { Ok::<_, Infallible>(n) });
        let layer = TokenBucketLayer::new(nz(1), nz(5));
        let mut svc = layer.layer(echo);
        for n in 0..5 {
            assert_eq!(send(&mut svc, n).await, Ok(n));
        }
        // The five requests took the five tokens (the next comes back only
        // a second after the first was taken).
        assert!(layer.bucket.check().is_err());
        // So the sixth waits for one.
        let before = Instant::now();
        assert_eq!(send(&mut svc, 5).await, Ok(5));
        assert!(before.elapsed() >= Duration::from_millis(500));
    }

    #[tokio::test]
    async fn a_token_is_not_held_back_for_a_whole_window() {
        // A fixed window of burst 100 at 50 a second would hold the 101st
        // request for 2 s; the bucket lets it go one token later (20 ms).
        let echo = service_fn(|n: u32| async move { Ok::<_, Infallible>(n) });
        let mut svc = TokenBucketLayer::new(nz(50), nz(100)).layer(echo);
        for n in 0..100 {
            send(&mut svc, n).await.expect("infallible");
        }
        let before = Instant::now();
        send(&mut svc, 100).await.expect("infallible");
        let waited = before.elapsed();
        assert!(waited >= Duration::from_millis(5), "waited {waited:?}");
        assert!(waited < Duration::from_millis(1000), "waited {waited:?}");
    }

    #[tokio::test]
    async fn clients_on_one_bucket_take_its_tokens_in_turn() {
        // Two clients as kube builds them (each a buffer: one line of
        // requests) on one bucket with no burst to spare: a has 40
        // requests queued when b sends its first. b's must not wait behind
        // all of a's (0.4 s at 100 a second), only for a turn.
        let layer = TokenBucketLayer::new(nz(100), nz(1));
        let echo = || service_fn(|n: u32| async move { Ok::<_, Infallible>(n) });
        let a = tower::buffer::Buffer::new(layer.layer(echo()), 64);
        let b = tower::buffer::Buffer::new(layer.layer(echo()), 64);
        let done = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for n in 0..40 {
            let (mut a, done) = (a.clone(), Arc::clone(&done));
            tasks.push(tokio::spawn(async move {
                send(&mut a, n).await.expect("infallible");
                done.lock().expect("lock").push(n);
            }));
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        let mut b = b.clone();
        send(&mut b, 1000).await.expect("infallible");
        let before_b = done.lock().expect("lock").len();
        for t in tasks {
            t.await.expect("joined");
        }
        assert!(
            before_b < 15,
            "{before_b} of a's 40 requests went before b's one"
        );
    }

    #[tokio::test]
    async fn an_urgent_line_goes_before_the_others() {
        // Four lines with 20 requests queued each, on a bucket with no
        // burst to spare; an urgent line then sends five, one after the
        // other. Taken in turn among five lines, its five would wait for
        // about 25 tokens; ahead of the others, each waits for one.
        let layer = TokenBucketLayer::new(nz(100), nz(1));
        let echo = || service_fn(|n: u32| async move { Ok::<_, Infallible>(n) });
        let done = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for line in 0..4 {
            let bulk = tower::buffer::Buffer::new(layer.layer(echo()), 64);
            for n in 0..20 {
                let (mut bulk, done) = (bulk.clone(), Arc::clone(&done));
                tasks.push(tokio::spawn(async move {
                    send(&mut bulk, line * 100 + n).await.expect("infallible");
                    done.lock().expect("lock").push(n);
                }));
            }
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        let mut urgent = tower::buffer::Buffer::new(layer.urgent().layer(echo()), 64);
        let before = done.lock().expect("lock").len();
        for n in 0..5 {
            send(&mut urgent, 1000 + n).await.expect("infallible");
        }
        let during = done.lock().expect("lock").len() - before;
        for t in tasks {
            t.await.expect("joined");
        }
        assert_eq!(
            done.lock().expect("lock").len(),
            80,
            "every other request went"
        );
        assert!(
            during <= 6,
            "{during} other requests went while the urgent line sent its five"
        );
        assert_eq!(layer.urgent_waiting.load(Ordering::Acquire), 0);
    }
}
