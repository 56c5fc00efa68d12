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

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
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
}

impl TokenBucketLayer {
    /// `qps` tokens a second, at most `burst` at once.
    pub fn new(qps: NonZeroU32, burst: NonZeroU32) -> Self {
        let quota = Quota::per_second(qps).allow_burst(burst);
        Self {
            bucket: Arc::new(RateLimiter::direct(quota)),
            jitter: Duration::from_secs(1) / qps.get(),
        }
    }
}

impl<S> Layer<S> for TokenBucketLayer {
    type Service = TokenBucket<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TokenBucket {
            inner,
            bucket: self.bucket.clone(),
            jitter: self.jitter,
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
    bucket: Arc<DefaultDirectRateLimiter>,
    jitter: Duration,
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
            let bucket = &self.bucket;
            let jitter = self.jitter;
            let waiting = self
                .waiting
                .get_or_insert_with(|| Box::pin(take_token(bucket.clone(), jitter)));
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

/// Waits for a token of `bucket` and takes it: each retry at the next
/// token's time plus a random part of `jitter`.
async fn take_token(bucket: Arc<DefaultDirectRateLimiter>, jitter: Duration) {
    loop {
        match bucket.check() {
            Ok(()) => return,
            Err(not_until) => {
                let wait = not_until.wait_time_from(bucket.clock().now());
                tokio::time::sleep(wait + random_part(jitter)).await;
            }
        }
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
}
