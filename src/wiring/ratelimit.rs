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

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use tower::{Layer, Service};

/// A [`Layer`] that holds requests until the shared bucket has a token.
#[derive(Clone)]
pub(crate) struct TokenBucketLayer {
    bucket: Arc<DefaultDirectRateLimiter>,
}

impl TokenBucketLayer {
    /// `qps` tokens a second, at most `burst` at once.
    pub fn new(qps: NonZeroU32, burst: NonZeroU32) -> Self {
        let quota = Quota::per_second(qps).allow_burst(burst);
        Self {
            bucket: Arc::new(RateLimiter::direct(quota)),
        }
    }
}

impl<S> Layer<S> for TokenBucketLayer {
    type Service = TokenBucket<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TokenBucket {
            inner,
            bucket: self.bucket.clone(),
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
            let waiting = self.waiting.get_or_insert_with(|| {
                let bucket = bucket.clone();
                Box::pin(async move { bucket.until_ready().await })
            });
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
}
