//! A fault-injecting HTTP proxy in front of moto, for the error classes
//! moto cannot produce: throttling (`RequestLimitExceeded`), EC2's 5xx
//! errors, a load balancer's empty or HTML 5xx, a slow answer, a connection
//! closed without an answer (before or after the upstream acted on it).
//!
//! [`FaultProxy::start`] listens on a loopback port and forwards every
//! request to the upstream (moto) unchanged — method, path, headers
//! (`Host` and the signature included), body — over HTTP/1.1, and serves
//! its clients with keep-alive, as EC2's endpoint does (moto itself closes
//! every connection). [`FaultProxy::inject`] arms a [`Fault`] for an EC2
//! Action, read from the form body (`Action=RunInstances&…`) or the query
//! string: the next `times` requests for that Action get the fault's
//! answer instead of moto's, and the requests after them pass again. Every
//! request is counted by Action, faulted or not, so that a test can assert
//! "retried 3 times, then succeeded" and "no request loop".
//!
//! Test infrastructure: it trusts its clients and keeps every request it
//! saw in memory.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use super::ec2::action_param;
use super::xml::escape;

/// How many requests a fault answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Times {
    Count(u32),
    Forever,
}

/// What a fault answers instead of the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// EC2's error document with this status, code and message (and a
    /// fresh `RequestID`), `Content-Type: text/xml;charset=UTF-8`.
    Ec2Error {
        status: u16,
        code: String,
        message: String,
    },
    /// This status and body as they are: a load balancer's error page, an
    /// empty body.
    Raw {
        status: u16,
        content_type: Option<String>,
        body: String,
    },
    /// Waits this long, then forwards the request (a slow EC2; longer than
    /// the client's timeout, one that never answers).
    Delay(Duration),
    /// Closes the connection without answering (a reset between a load
    /// balancer and its client): the request never reaches the upstream.
    Close,
    /// Forwards the request, then closes the connection without passing
    /// the answer on: the call happened (an instance was launched) but the
    /// client cannot know.
    LoseAnswer,
    /// Forwards the request and passes the answer on with every `from` in
    /// its body replaced by `to`: a cloud that says something else of the
    /// same state (an instance EC2 keeps `shutting-down`, which moto
    /// terminates at once).
    Rewrite { from: String, to: String },
}

/// A fault armed for one EC2 Action (`"*"`: any request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub action: String,
    pub times: Times,
    pub answer: Answer,
}

impl Fault {
    /// EC2's error document, once (see [`Fault::times`]).
    pub fn ec2_error(action: &str, status: u16, code: &str, message: &str) -> Self {
        Fault {
            action: action.into(),
            times: Times::Count(1),
            answer: Answer::Ec2Error {
                status,
                code: code.into(),
                message: message.into(),
            },
        }
    }

    /// EC2's throttling answer: 503 `RequestLimitExceeded`.
    pub fn throttled(action: &str) -> Self {
        Self::ec2_error(
            action,
            503,
            "RequestLimitExceeded",
            "Request limit exceeded.",
        )
    }

    /// EC2's 500 `InternalError`.
    pub fn internal_error(action: &str) -> Self {
        Self::ec2_error(
            action,
            500,
            "InternalError",
            "An internal error has occurred.",
        )
    }

    /// EC2's 503 `Unavailable`.
    pub fn unavailable(action: &str) -> Self {
        Self::ec2_error(
            action,
            503,
            "Unavailable",
            "The server is overloaded and can't handle the request.",
        )
    }

    /// `status` with an empty body (and no `Content-Type`).
    pub fn empty(action: &str, status: u16) -> Self {
        Fault {
            action: action.into(),
            times: Times::Count(1),
            answer: Answer::Raw {
                status,
                content_type: None,
                body: String::new(),
            },
        }
    }

    /// `status` with a load balancer's HTML error page.
    pub fn html(action: &str, status: u16) -> Self {
        let reason = StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("Error");
        Fault {
            action: action.into(),
            times: Times::Count(1),
            answer: Answer::Raw {
                status,
                content_type: Some("text/html".into()),
                body: format!(
                    "<html>\r\n<head><title>{status} {reason}</title></head>\r\n<body>\r\n\
                     <center><h1>{status} {reason}</h1></center>\r\n</body>\r\n</html>\r\n"
                ),
            },
        }
    }

    /// Forwards after `delay`.
    pub fn delay(action: &str, delay: Duration) -> Self {
        Fault {
            action: action.into(),
            times: Times::Count(1),
            answer: Answer::Delay(delay),
        }
    }

    /// Closes the connection without an answer.
    pub fn close(action: &str) -> Self {
        Fault {
            action: action.into(),
            times: Times::Count(1),
            answer: Answer::Close,
        }
    }

    /// Forwards, then closes the connection instead of answering.
    pub fn lose_answer(action: &str) -> Self {
        Fault {
            action: action.into(),
            times: Times::Count(1),
            answer: Answer::LoseAnswer,
        }
    }

    /// Forwards, then replaces `from` with `to` in the answer's body.
    pub fn rewrite(action: &str, from: &str, to: &str) -> Self {
        Fault {
            action: action.into(),
            times: Times::Count(1),
            answer: Answer::Rewrite {
                from: from.into(),
                to: to.into(),
            },
        }
    }

    /// Answers the next `n` requests for its Action.
    pub fn times(mut self, n: u32) -> Self {
        self.times = Times::Count(n);
        self
    }

    /// Answers every request for its Action until [`FaultProxy::clear`].
    pub fn forever(mut self) -> Self {
        self.times = Times::Forever;
        self
    }

    fn matches(&self, action: &str) -> bool {
        self.action == "*" || self.action == action
    }
}

/// A request the proxy saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub at: Instant,
    /// The EC2 Action, `""` when the request named none.
    pub action: String,
    /// Which client connection it came on (numbered from 1 in accept
    /// order).
    pub connection: u64,
    /// The fault that answered it, if one did.
    pub fault: Option<Answer>,
    /// The status the client got (`None`: the connection was closed, or
    /// the client went away first).
    pub status: Option<u16>,
}

impl Seen {
    /// Whether the request went on to the upstream (no fault, a delay, or
    /// an answer lost).
    fn passes(&self) -> bool {
        matches!(
            self.fault,
            None | Some(Answer::Delay(_) | Answer::LoseAnswer | Answer::Rewrite { .. })
        )
    }
}

/// A running proxy. Dropping it closes its port and every connection.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

struct Shared {
    upstream: String,
    client: Client<HttpConnector, Full<Bytes>>,
    faults: Mutex<Vec<Fault>>,
    seen: Mutex<Vec<Seen>>,
    connections: AtomicU64,
    request_ids: AtomicU64,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream`
    /// (`http://127.0.0.1:<port>`).
    pub async fn start(upstream: &str) -> std::io::Result<FaultProxy> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream: upstream.trim_end_matches('/').to_string(),
            client: Client::builder(TokioExecutor::new()).build_http(),
            faults: Mutex::default(),
            seen: Mutex::default(),
            connections: AtomicU64::new(0),
            request_ids: AtomicU64::new(0),
        });
        let task = tokio::spawn(serve(listener, shared.clone()));
        Ok(FaultProxy { addr, shared, task })
    }

    /// The endpoint URL to point an EC2 client at.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Arms `fault`, after the faults already armed: a request is answered
    /// by the first armed fault for its Action that has requests left.
    pub fn inject(&self, fault: Fault) {
        lock(&self.shared.faults).push(fault);
    }

    /// Disarms every fault.
    pub fn clear(&self) {
        lock(&self.shared.faults).clear();
    }

    /// The faults still armed, each with the requests it has left.
    pub fn armed(&self) -> Vec<Fault> {
        lock(&self.shared.faults).clone()
    }

    /// How many requests for `action` the proxy saw, faulted or passed.
    pub fn requests(&self, action: &str) -> usize {
        lock(&self.shared.seen)
            .iter()
            .filter(|s| s.action == action)
            .count()
    }

    /// How many requests for `action` a fault kept from the upstream (a
    /// delay, or an answer lost, does not: the request passes).
    pub fn faulted(&self, action: &str) -> usize {
        lock(&self.shared.seen)
            .iter()
            .filter(|s| s.action == action && !s.passes())
            .count()
    }

    /// How many requests for `action` reached the upstream.
    pub fn passed(&self, action: &str) -> usize {
        lock(&self.shared.seen)
            .iter()
            .filter(|s| s.action == action && s.passes())
            .count()
    }

    /// Requests seen, by Action.
    pub fn counts(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for s in lock(&self.shared.seen).iter() {
            *out.entry(s.action.clone()).or_default() += 1;
        }
        out
    }

    /// Every request seen so far, in arrival order.
    pub fn seen(&self) -> Vec<Seen> {
        lock(&self.shared.seen).clone()
    }

    /// Forgets the requests seen (the faults stay armed).
    pub fn reset_counts(&self) {
        lock(&self.shared.seen).clear();
    }

    /// How many client connections the proxy accepted.
    pub fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // The accept loop owns the connections' tasks: aborting it drops
        // them all.
        self.task.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let id = shared.connections.fetch_add(1, Ordering::Relaxed) + 1;
                let shared = shared.clone();
                connections.spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let shared = shared.clone();
                        async move { shared.handle(req, id).await }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Closes the connection without an answer (hyper does so when a service
/// fails).
#[derive(Debug, thiserror::Error)]
#[error("fault: connection closed without an answer")]
struct CloseConnection;

/// Headers that concern one connection, not the request: never forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    let mut out = headers.clone();
    for h in HOP_BY_HOP {
        out.remove(h);
    }
    out
}

impl Shared {
    async fn handle(
        &self,
        req: Request<Incoming>,
        connection: u64,
    ) -> Result<Response<Full<Bytes>>, CloseConnection> {
        let (parts, body) = req.into_parts();
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => return Err(CloseConnection),
        };
        let action = action_param(&String::from_utf8_lossy(&body))
            .or_else(|| parts.uri.query().and_then(action_param))
            .unwrap_or_default();
        let fault = self.take_fault(&action);
        let index = {
            let mut seen = lock(&self.seen);
            seen.push(Seen {
                at: Instant::now(),
                action: action.clone(),
                connection,
                fault: fault.clone(),
                status: None,
            });
            seen.len() - 1
        };
        let answer = match fault {
            None => Ok(self.forward(parts, body).await),
            Some(Answer::Delay(d)) => {
                tokio::time::sleep(d).await;
                Ok(self.forward(parts, body).await)
            }
            Some(Answer::Close) => Err(CloseConnection),
            Some(Answer::Rewrite { from, to }) => {
                let resp = self.forward(parts, body).await;
                let (head, body) = resp.into_parts();
                let body = match body.collect().await {
                    Ok(b) => String::from_utf8_lossy(&b.to_bytes()).replace(&from, &to),
                    Err(_) => return Err(CloseConnection),
                };
                Ok(Response::from_parts(head, Full::new(Bytes::from(body))))
            }
            Some(Answer::LoseAnswer) => {
                let _ = self.forward(parts, body).await;
                Err(CloseConnection)
            }
            Some(Answer::Ec2Error {
                status,
                code,
                message,
            }) => {
                let id = self.request_id();
                let doc = format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error>\
                     <Code>{}</Code><Message>{}</Message></Error></Errors>\
                     <RequestID>{id}</RequestID></Response>",
                    escape(&code),
                    escape(&message)
                );
                Ok(respond(
                    status,
                    Some("text/xml;charset=UTF-8"),
                    Some(&id),
                    doc,
                ))
            }
            Some(Answer::Raw {
                status,
                content_type,
                body,
            }) => Ok(respond(status, content_type.as_deref(), None, body)),
        };
        if let Ok(resp) = &answer
            && let Some(s) = lock(&self.seen).get_mut(index)
        {
            s.status = Some(resp.status().as_u16());
        }
        answer
    }

    /// The answer of the first armed fault for `action` with requests left,
    /// one request spent.
    fn take_fault(&self, action: &str) -> Option<Answer> {
        let mut faults = lock(&self.faults);
        let i = faults.iter().position(|f| f.matches(action))?;
        let answer = faults[i].answer.clone();
        match &mut faults[i].times {
            Times::Forever => {}
            Times::Count(n) if *n <= 1 => {
                faults.remove(i);
            }
            Times::Count(n) => *n -= 1,
        }
        Some(answer)
    }

    async fn forward(&self, parts: http::request::Parts, body: Bytes) -> Response<Full<Bytes>> {
        let path = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/");
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = parts.method;
        *req.headers_mut() = end_to_end(&parts.headers);
        match format!("{}{path}", self.upstream).parse() {
            Ok(uri) => *req.uri_mut() = uri,
            Err(_) => return respond(502, None, None, String::new()),
        }
        let Ok(resp) = self.client.request(req).await else {
            // The upstream is gone: what a load balancer says then.
            return respond(502, None, None, String::new());
        };
        let (parts, body) = resp.into_parts();
        let Ok(body) = body.collect().await else {
            return respond(502, None, None, String::new());
        };
        let mut out = Response::new(Full::new(body.to_bytes()));
        *out.status_mut() = parts.status;
        *out.headers_mut() = end_to_end(&parts.headers);
        out
    }

    fn request_id(&self) -> String {
        let n = self.request_ids.fetch_add(1, Ordering::Relaxed);
        let pid = u64::from(std::process::id());
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            pid & 0xffff_ffff,
            (n >> 24) & 0xffff,
            (n >> 12) & 0xfff,
            n & 0xfff,
            n
        )
    }
}

fn respond(
    status: u16,
    content_type: Option<&str>,
    request_id: Option<&str>,
    body: String,
) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    let headers = resp.headers_mut();
    if let Some(ct) = content_type.and_then(|c| HeaderValue::from_str(c).ok()) {
        headers.insert(header::CONTENT_TYPE, ct);
    }
    if let Some(id) = request_id.and_then(|i| HeaderValue::from_str(i).ok()) {
        headers.insert("x-amzn-requestid", id);
    }
    resp
}
