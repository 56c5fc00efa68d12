//! The metrics and probe endpoints:
//!
//! * `GET /metrics`: the [`Metrics`] registry in the Prometheus text format;
//! * `GET /healthz`: 200 `ok` as long as the process serves HTTP at all;
//! * `GET /readyz`: 200 once the readiness flag is set (the controller sets
//!   it when its caches have synced), 503 before.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{StatusCode, header};

use super::{CONTENT_TYPE, Metrics};

/// What the HTTP handlers read: the metrics and the readiness flag.
#[derive(Debug, Clone)]
pub struct HttpState {
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
}

impl HttpState {
    /// State with a fresh readiness flag that starts as "not ready".
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self::with_readiness(metrics, Arc::new(AtomicBool::new(false)))
    }

    /// State sharing an existing readiness flag.
    pub(crate) fn with_readiness(metrics: Arc<Metrics>, ready: Arc<AtomicBool>) -> Self {
        Self { metrics, ready }
    }

    /// The readiness flag.
    #[cfg(test)]
    fn readiness(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.ready)
    }

    /// Sets readiness: `/readyz` answers 200 while `true`, 503 while `false`.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// Current readiness.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// The metrics served on `/metrics`.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// The routes, for embedding in another server or testing without a socket.
pub(crate) fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// Serves `router` on `listener` until `shutdown` resolves, then stops
/// accepting connections and returns once in-flight requests are answered.
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: HttpState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await?;
    tracing::debug!("metrics server stopped");
    Ok(())
}

async fn metrics(State(state): State<HttpState>) -> Response {
    match state.metrics.try_encode() {
        Ok(body) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "encoding metrics failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("encoding metrics failed: {e}\n"),
            )
                .into_response()
        }
    }
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<HttpState>) -> (StatusCode, &'static str) {
    if state.is_ready() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    struct Reply {
        status: u16,
        head: String,
        body: String,
    }

    /// One HTTP/1.0 request (the server closes the connection after the
    /// response, so reading to the end reads exactly one response).
    async fn get(addr: SocketAddr, path: &str) -> Reply {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .expect("send request");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read response");
        let text = String::from_utf8(raw).expect("utf-8 response");
        let (head, body) = text.split_once("\r\n\r\n").expect("header/body split");
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("status code");
        Reply {
            status,
            head: head.to_ascii_lowercase(),
            body: body.to_string(),
        }
    }

    #[tokio::test]
    async fn serves_metrics_and_probes_until_shutdown() {
        let metrics = Arc::new(Metrics::new().expect("metrics register"));
        let state = HttpState::new(Arc::clone(&metrics));
        let ready = state.readiness();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, state, async {
            let _ = stopped.await;
        }));

        drop(metrics.reconcile_timer());
        let r = get(addr, "/metrics").await;
        assert_eq!(r.status, 200);
        assert!(
            r.head.contains("content-type: text/plain; version=0.0.4"),
            "{}",
            r.head
        );
        assert!(
            r.body.contains("berth_reconcile_total{result=\"ok\"} 1"),
            "{}",
            r.body
        );
        assert!(r.body.contains("# HELP berth_reconcile_duration_seconds "));

        let r = get(addr, "/healthz").await;
        assert_eq!((r.status, r.body.as_str()), (200, "ok"));

        let r = get(addr, "/readyz").await;
        assert_eq!(r.status, 503);
        ready.store(true, Ordering::Release);
        let r = get(addr, "/readyz").await;
        assert_eq!((r.status, r.body.as_str()), (200, "ok"));

        assert_eq!(get(addr, "/nope").await.status, 404);

        stop.send(()).expect("server still waits for shutdown");
        let result = tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("server exits after shutdown")
            .expect("server task did not panic");
        assert!(result.is_ok(), "{result:?}");
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "listener closed after shutdown"
        );
    }
}
