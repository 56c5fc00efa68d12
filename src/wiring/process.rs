//! `berth run`: the controller process.
//!
//! Start-up order, and why:
//!
//! 1. Logs, metrics and the HTTP port first, so that `/healthz` answers and
//!    every later problem is visible.
//! 2. The Kubernetes client: retries inside the client are off (a 429 from a
//!    PodDisruptionBudget must reach the drain, not hide in the client for
//!    minutes) and requests are rate-limited to `--kube-qps`/`--kube-burst`.
//! 3. The CRDs: while any of the six (`machines`, `machineclasses`,
//!    `machinesets`, `machinedeployments`, `movepermits`, `moveasks`, all
//!    `.berth.dev`) is missing
//!    (or RBAC forbids reading them), the process says so in one
//!    clear log line, how to fix it, and tries again with backoff instead of
//!    exiting into a crash loop. `/readyz` stays 503 meanwhile.
//! 4. Leader election on a Lease (unless disabled): a standby replica is
//!    ready but does nothing. The leader starts the controller; if it ever
//!    loses the Lease it stops acting at once and the process exits with an
//!    error, so the replica restarts as a fresh candidate.
//! 5. SIGTERM or Ctrl-C: the controller stops taking new work, lets the
//!    reconciles in flight finish (bounded by `--shutdown-timeout`), the
//!    Lease is released so another replica takes over without waiting for
//!    expiry, and the HTTP server stops last.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use tokio::sync::{oneshot, watch};

use super::fence::{Fence, FenceLayer, FencedExecutor};
use super::leader::LeaderElection;
use super::ratelimit::TokenBucketLayer;
use crate::api::{Machine, MachineClass};
use crate::providers::Registry;
use crate::providers::aws::{AwsProvider, AwsSettings};
use crate::providers::fake::FakeProvider;
use crate::telemetry::{HttpState, Metrics};

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

/// Everything `berth run` can be told. Each flag has an environment
/// variable fallback (shown by `berth run --help`).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RunArgs {
    /// Path to a kubeconfig file. Unset: in-cluster configuration, else
    /// `$KUBECONFIG`, else `~/.kube/config`.
    #[arg(long, env = "BERTH_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Context to use from the kubeconfig (its current context when unset).
    #[arg(long, env = "BERTH_KUBE_CONTEXT")]
    pub kube_context: Option<String>,
    /// Watch Machines in this namespace only (all namespaces when unset).
    #[arg(long, env = "BERTH_NAMESPACE")]
    pub namespace: Option<String>,
    /// Address of the HTTP server for /metrics, /healthz and /readyz.
    #[arg(long, env = "BERTH_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// Log format.
    #[arg(long, env = "BERTH_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Log filter, in `tracing` env-filter syntax (e.g. `info,berth=debug`).
    #[arg(long, env = "BERTH_LOG", default_value = "info")]
    pub log: String,
    /// Sustained requests per second to the API server.
    #[arg(long, env = "BERTH_KUBE_QPS", default_value_t = 100)]
    pub kube_qps: u32,
    /// Requests that may be sent at once above the sustained rate.
    #[arg(long, env = "BERTH_KUBE_BURST", default_value_t = 200)]
    pub kube_burst: u32,
    /// Sustained Events per second. Events have a rate limit of their own,
    /// so that they never hold up evictions and status writes.
    #[arg(long, env = "BERTH_KUBE_EVENTS_QPS", default_value_t = 25)]
    pub kube_events_qps: u32,
    /// Events that may be sent at once above their sustained rate.
    #[arg(long, env = "BERTH_KUBE_EVENTS_BURST", default_value_t = 100)]
    pub kube_events_burst: u32,
    /// Elect a leader on a Lease so that only one replica acts. Turn it off
    /// only when a single replica can ever run.
    #[arg(long, env = "BERTH_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// Name of the leader election Lease.
    #[arg(long, env = "BERTH_LEASE_NAME", default_value = "berth-controller")]
    pub lease_name: String,
    /// Namespace of the Lease (the pod's namespace in-cluster, else the
    /// kubeconfig context's namespace).
    #[arg(long, env = "BERTH_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// Lease duration: how long a dead leader blocks a successor.
    #[arg(long, env = "BERTH_LEASE_DURATION", default_value = "15s", value_parser = humantime::parse_duration)]
    pub lease_duration: Duration,
    /// This replica's identity in the Lease and on Events (the pod name is
    /// a good choice; default `<hostname>-<pid>`).
    #[arg(long, env = "BERTH_IDENTITY")]
    pub identity: Option<String>,
    /// Machines reconciled at the same time.
    #[arg(long, env = "BERTH_CONCURRENCY", default_value_t = super::manager::DEFAULT_CONCURRENCY)]
    pub concurrency: u16,
    /// Old Machines that MachineDeployment rollouts delete (drain) at once,
    /// across every deployment: each deployment's `maxUnavailable` applies
    /// within this.
    #[arg(long, env = "BERTH_MAX_CONCURRENT_DRAINS", default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..))]
    pub max_concurrent_drains: u16,
    /// Volume moves in flight at once across every drain, for the cloud's
    /// attach API limits (0: no cap): a stateful pod waits for a place
    /// before its eviction. Each workload's own budget applies within it.
    #[arg(long, env = "BERTH_MAX_VOLUME_MOVES", default_value_t = 50)]
    pub max_volume_moves: u16,
    /// The most Machines of the cluster that may be unhealthy for one to
    /// be remediated (its class or pool asking for it): a count, or a
    /// percentage (rounded down, at least 1). More looks like a network
    /// partition: nothing is remediated, and each says `RemediationHeld`.
    #[arg(long, env = "BERTH_MAX_UNHEALTHY", default_value = "40%", value_parser = crate::api::remediation::MaxUnhealthy::parse_str)]
    pub max_unhealthy: crate::api::remediation::MaxUnhealthy,
    /// How long the provider may keep answering "not found" for a deleted
    /// Machine's VM before berth takes it for gone (and deletes its Node):
    /// clouds are eventually consistent, and EC2 can answer
    /// `InvalidInstanceID.NotFound` for an instance that runs. Only the
    /// cloud's "terminated" is gone at once.
    #[arg(long, env = "BERTH_VM_NOT_FOUND_GRACE", default_value = "3m", value_parser = humantime::parse_duration)]
    pub vm_not_found_grace: Duration,
    /// How long SIGTERM waits for reconciles in flight before exiting.
    #[arg(long, env = "BERTH_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub shutdown_timeout: Duration,
    /// Provider drivers to enable, comma-separated (known: aws, fake). Required,
    /// with no default: a controller that runs real machines must never
    /// start with a simulated cloud because a flag was forgotten. Empty
    /// (`--providers=`) enables none: every Machine then says that its
    /// class's provider is not enabled.
    #[arg(long, env = "BERTH_PROVIDERS", value_delimiter = ',', required = true)]
    pub providers: Vec<String>,
    /// This cluster's id, unique among the clusters that share a cloud
    /// account: berth tags every VM it makes with it (`berth.dev/cluster`)
    /// and never touches a VM without it. Required by the aws provider.
    #[arg(long, env = "BERTH_CLUSTER_ID")]
    pub cluster_id: Option<String>,
    /// The EC2 endpoint to use instead of each region's own (a VPC
    /// endpoint, a FIPS endpoint, or an emulator such as moto).
    #[arg(long, env = "BERTH_AWS_ENDPOINT_URL")]
    pub aws_endpoint_url: Option<String>,
    #[command(flatten)]
    pub orphans: crate::orphans::OrphanArgs,
}

/// The configuration reference of docs/operations.md: a Markdown table of every
/// `berth run` flag, its environment variable and default, generated from
/// the flag definitions so the documentation cannot drift from the code.
pub fn config_reference_markdown() -> String {
    use clap::Args as _;
    let cmd = RunArgs::augment_args(clap::Command::new("run"));
    let mut out =
        String::from("| Flag | Environment | Default | Meaning |\n| --- | --- | --- | --- |\n");
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else {
            continue;
        };
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let default = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(",");
        let default = if arg.is_required_set() {
            "(required)".to_string()
        } else if default.is_empty() {
            String::new()
        } else {
            format!("`{default}`")
        };
        let help = arg
            .get_long_help()
            .or_else(|| arg.get_help())
            .map(|h| h.to_string().replace('\n', " "))
            .unwrap_or_default();
        out.push_str(&format!("| `--{long}` | {env} | {default} | {help} |\n"));
    }
    out
}

/// Installs the global log subscriber.
///
/// # Errors
/// An invalid filter.
pub(crate) fn init_logs(format: LogFormat, filter: &str) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .with_context(|| format!("invalid log filter {filter:?}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    installed.map_err(|e| anyhow::anyhow!("cannot install the log subscriber: {e}"))
}

/// Runs the controller process until SIGTERM/Ctrl-C (Ok) or until the
/// leader Lease is lost (Err).
///
/// # Errors
/// Start-up failures (bad flags, port in use, unusable kubeconfig) and the
/// loss of leadership.
pub(crate) async fn run(args: RunArgs) -> anyhow::Result<()> {
    init_logs(args.log_format, &args.log)?;
    let metrics = Arc::new(Metrics::new().context("creating metrics")?);
    let http = HttpState::new(Arc::clone(&metrics));
    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("cannot listen on {}", args.metrics_addr))?;

    // `stop` turns true on SIGTERM/Ctrl-C; everything that must stop
    // watches it.
    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(signals(stop_tx));
    let (http_stop_tx, http_stop) = oneshot::channel::<()>();
    let server = tokio::spawn(crate::telemetry::serve(
        listener,
        http.clone(),
        async move {
            let _ = http_stop.await;
        },
    ));

    let result = lead_and_control(&args, &metrics, &http, stop).await;

    let _ = http_stop_tx.send(());
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "metrics server failed"),
        Err(e) => tracing::warn!(error = %e, "metrics server task failed"),
    }
    match &result {
        Ok(()) => tracing::info!("stopped"),
        Err(e) => tracing::error!(error = format!("{e:#}"), "exiting"),
    }
    result
}

/// The process's connections: the Lease's own client, and the fenced
/// clients and providers every other request goes through.
struct Connections {
    lease: Client,
    fence: Fence,
    api: Client,
    events: Client,
    per_drain: crate::drain::engine::ClientPerDrain,
    providers: Registry,
}

async fn connect(args: &RunArgs, metrics: &Arc<Metrics>) -> anyhow::Result<Connections> {
    let config = kube_config(args).await?;
    // The Lease has its own client: renewals must never queue behind the
    // controller's requests in the rate limiter.
    let lease = Client::try_from(config.clone()).context("building the Lease client")?;
    // Every other request that changes the cluster, and every VM created or
    // deleted, goes out only while leadership is valid by the clock.
    let fence = if args.leader_elect {
        Fence::closed()
    } else {
        Fence::open()
    };
    let events = LimitedClients::new(
        config.clone(),
        args.kube_events_qps,
        args.kube_events_burst,
        &fence,
    )?
    .client();
    let limited = LimitedClients::new(config, args.kube_qps, args.kube_burst, &fence)?;
    let api = limited.client();
    let per_drain = limited.per_drain();
    let may_act: crate::providers::gated::MayAct = {
        let fence = fence.clone();
        Arc::new(move || fence.allows())
    };
    let providers = providers(args, &api, metrics)?.gated(&may_act);
    if providers.names().is_empty() {
        tracing::warn!(
            "no provider is enabled (--providers is empty): no VM will be created or deleted, \
             and every Machine will say that its class's provider is not enabled"
        );
    }
    Ok(Connections {
        lease,
        fence,
        api,
        events,
        per_drain,
        providers,
    })
}

/// How the wait for leadership ended.
enum Leadership {
    /// This replica holds the Lease.
    Elected(LeaderElection),
    /// `--leader-elect=false`: the only replica.
    Alone,
    /// Asked to stop while waiting.
    Stopped,
}

async fn lead(
    args: &RunArgs,
    conn: &Connections,
    identity: &str,
    metrics: &Arc<Metrics>,
    http: &HttpState,
    stop: &mut watch::Receiver<bool>,
) -> anyhow::Result<Leadership> {
    if !args.leader_elect {
        metrics.leader.set(1);
        return Ok(Leadership::Alone);
    }
    let lease_namespace = args
        .lease_namespace
        .clone()
        .unwrap_or_else(|| conn.lease.default_namespace().to_string());
    let mut election = LeaderElection::start_fenced(
        conn.lease.clone(),
        &lease_namespace,
        &args.lease_name,
        identity,
        args.lease_duration,
        conn.fence.clone(),
    )
    .await
    .context("starting leader election")?;
    tokio::spawn(metrics.follow_leader(election.subscribe()));
    // A standby replica is healthy and ready; it just waits.
    http.set_ready(true);
    tracing::info!(lease = election.lease(), %identity, "waiting to become leader");
    tokio::select! {
        acquired = election.acquired() => acquired.context("leader election ended")?,
        _ = stop.wait_for(|s| *s) => {
            release(election).await;
            return Ok(Leadership::Stopped);
        }
    }
    tracing::info!(lease = election.lease(), %identity, "became leader");
    Ok(Leadership::Elected(election))
}

async fn lead_and_control(
    args: &RunArgs,
    metrics: &Arc<Metrics>,
    http: &HttpState,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let conn = connect(args, metrics).await?;
    let identity = args.identity.clone().unwrap_or_else(default_identity);
    tokio::select! {
        found = wait_for_crds(&conn.api, args.namespace.as_deref()) => found,
        _ = stop.wait_for(|s| *s) => return Ok(()),
    }
    let mut election = match lead(args, &conn, &identity, metrics, http, &mut stop).await? {
        Leadership::Elected(e) => Some(e),
        Leadership::Alone => None,
        Leadership::Stopped => return Ok(()),
    };

    let settings = super::manager::Settings {
        namespace: args.namespace.clone(),
        instance: identity.clone(),
        concurrency: args.concurrency,
        max_concurrent_drains: usize::from(args.max_concurrent_drains),
        max_volume_moves: (args.max_volume_moves > 0).then(|| usize::from(args.max_volume_moves)),
        vm_not_found_grace: args.vm_not_found_grace,
        max_unhealthy: args.max_unhealthy,
        orphans: crate::orphans::Settings::new(&args.orphans, args.namespace.clone()),
    };
    let (controller_stop_tx, controller_stop) = oneshot::channel::<()>();
    let ready = http.clone();
    let mut controller = tokio::spawn(super::manager::run(
        super::manager::Clients {
            api: conn.api,
            events: conn.events,
            per_drain: conn.per_drain,
        },
        conn.providers,
        settings,
        Arc::clone(metrics),
        async move {
            let _ = controller_stop.await;
        },
        move || ready.set_ready(true),
    ));

    let lost = async {
        match election.as_mut() {
            Some(e) => e.lost().await,
            None => std::future::pending().await,
        }
    };
    let outcome = tokio::select! {
        lost = lost => Err(lost),
        _ = stop.wait_for(|s| *s) => Ok(()),
        ended = &mut controller => {
            return Err(anyhow::anyhow!("the controller stopped unexpectedly: {ended:?}"));
        }
    };
    if let Err(lost) = outcome {
        // Another replica may act as soon as the Lease expires: stop now,
        // without waiting for reconciles in flight (every step resumes).
        controller.abort();
        metrics.leader.set(0);
        return Err(anyhow::anyhow!(
            "lost leadership ({lost}); exiting so that this replica restarts as a candidate"
        ));
    }
    tracing::info!(timeout = ?args.shutdown_timeout, "shutting down: finishing reconciles in flight");
    let _ = controller_stop_tx.send(());
    if tokio::time::timeout(args.shutdown_timeout, &mut controller)
        .await
        .is_err()
    {
        tracing::warn!("reconciles still running at the shutdown timeout; stopping them");
        controller.abort();
    }
    http.set_ready(false);
    if let Some(e) = election {
        release(e).await;
    }
    Ok(())
}

async fn release(election: LeaderElection) {
    if let Err(e) = election.release().await {
        tracing::warn!(error = %e, "releasing the Lease failed; it will expire");
    }
}

/// Resolves once SIGTERM or Ctrl-C arrives, after setting `stop`.
async fn signals(stop: watch::Sender<bool>) {
    let term = async {
        #[cfg(unix)]
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
        #[cfg(not(unix))]
        std::future::pending::<()>().await;
    };
    tokio::select! {
        _ = term => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupt received"),
    }
    let _ = stop.send(true);
}

async fn kube_config(args: &RunArgs) -> anyhow::Result<kube::Config> {
    let options = KubeConfigOptions {
        context: args.kube_context.clone(),
        ..KubeConfigOptions::default()
    };
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &options)
                .await
                .with_context(|| format!("unusable kubeconfig {}", path.display()))?
        }
        None if args.kube_context.is_some() => kube::Config::from_kubeconfig(&options)
            .await
            .context("unusable kubeconfig")?,
        None => kube::Config::infer().await.context(
            "no Kubernetes configuration: not in a cluster, no $KUBECONFIG, no ~/.kube/config",
        )?,
    };
    // A 429 from a PodDisruptionBudget must reach the drain engine: kube's
    // default would retry it inside the client for minutes.
    config.default_retry = false;
    Ok(config)
}

/// Clients whose requests share one rate limit (`qps` on average, bursts
/// of up to `burst`: a token bucket, [`TokenBucketLayer`]), one fence and
/// one pool of connections.
///
/// Each client has its own queue in front of the bucket (kube's request
/// buffer, a single line), and the clients' queues take the bucket's
/// tokens in turn. So each drain has a client of its own: when many drains
/// start at once and their requests exceed the burst, a drain that started
/// a little later gets its first eviction out between the others' next
/// ones, instead of behind every eviction they queued first (its first
/// eviction came up to 1.3 s after its deletion with 20 drains in the
/// scale benchmark, all of it in the queue). Behind the bucket every client
/// sends through one `base` client: its connections (new ones for each
/// drain would cost the API server a TLS handshake per request at the very
/// moment many drains start) and its fence.
#[derive(Clone)]
struct LimitedClients {
    base: Client,
    bucket: TokenBucketLayer,
}

impl LimitedClients {
    fn new(config: kube::Config, qps: u32, burst: u32, fence: &Fence) -> anyhow::Result<Self> {
        let (Some(qps), Some(burst)) = (NonZeroU32::new(qps), NonZeroU32::new(burst)) else {
            anyhow::bail!(
                "--kube-qps, --kube-burst, --kube-events-qps and --kube-events-burst must each be at least 1"
            );
        };
        // The fence inside the rate limit: a write is checked when it
        // leaves, not when it starts to wait for its token.
        let executor = FencedExecutor(fence.clone());
        let base = kube::client::ClientBuilder::try_from((config, executor))
            .context("building the Kubernetes client")?
            .with_layer(&FenceLayer(fence.clone()))
            .build();
        Ok(Self {
            base,
            bucket: TokenBucketLayer::new(qps, burst),
        })
    }

    /// A client on the shared bucket, with its own queue.
    fn client(&self) -> Client {
        Client::new(
            tower::Layer::layer(&self.bucket, Through(self.base.clone())),
            self.base.default_namespace().to_string(),
        )
    }

    /// An urgent client on the shared bucket, with its own queue: while it
    /// waits for a token, no other client takes one.
    fn urgent_client(&self) -> Client {
        Client::new(
            tower::Layer::layer(&self.bucket.urgent(), Through(self.base.clone())),
            self.base.default_namespace().to_string(),
        )
    }

    /// Makes a drain's clients.
    fn per_drain(self) -> crate::drain::engine::ClientPerDrain {
        Arc::new(move || crate::drain::engine::DrainClients {
            moves: self.urgent_client(),
            rest: self.client(),
        })
    }
}

/// A [`Service`](tower::Service) that sends each request through a
/// client (its connections and the layers it was built with).
#[derive(Clone)]
struct Through(Client);

impl tower::Service<http::Request<kube::client::Body>> for Through {
    type Response = http::Response<kube::client::Body>;
    type Error = kube::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<kube::client::Body>) -> Self::Future {
        let client = self.0.clone();
        Box::pin(async move { client.send(request).await })
    }
}

fn providers(args: &RunArgs, client: &Client, metrics: &Arc<Metrics>) -> anyhow::Result<Registry> {
    let mut registry = Registry::default();
    for name in &args.providers {
        match name.trim() {
            "fake" => registry = registry.with(Arc::new(FakeProvider::new(client.clone()))),
            "aws" => {
                let cluster_id = args
                    .cluster_id
                    .clone()
                    .filter(|id| valid_cluster_id(id))
                    .context(
                        "the aws provider needs --cluster-id: 1 to 128 letters, digits, \
                         '.', '_', ':', '/', '=', '+', '-' or '@' (it becomes the value of \
                         the berth.dev/cluster tag)",
                    )?;
                let aws = AwsProvider::new(
                    client.clone(),
                    AwsSettings {
                        cluster_id,
                        endpoint: args.aws_endpoint_url.clone(),
                    },
                    Arc::clone(metrics),
                )
                .context("the aws provider's HTTPS client (the system's trust roots)")?;
                registry = registry.with(Arc::new(aws));
            }
            "" => {}
            other => anyhow::bail!("unknown provider {other:?} in --providers (known: aws, fake)"),
        }
    }
    Ok(registry)
}

/// Whether a cluster id can be an EC2 tag value that names one cluster.
fn valid_cluster_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._:/=+-@".contains(c))
}

fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "berth".into());
    format!("{host}-{}", std::process::id())
}

/// What stops the controller from starting when its CRDs cannot be read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum CrdProblem {
    Missing(String),
    Forbidden(String, String),
    Other(String, String),
}

impl std::fmt::Display for CrdProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CrdProblem::Missing(crd) => write!(
                f,
                "the CustomResourceDefinition {crd} is not installed. Install the CRDs with \
                 `berth crd | kubectl apply --server-side -f -` (or `kubectl apply -f deploy/crds.yaml`, \
                 or the Helm chart, which ships them); berth starts by itself once they exist"
            ),
            CrdProblem::Forbidden(crd, msg) => write!(
                f,
                "not allowed to list {crd}: {msg}. Grant this ServiceAccount get/list/watch on it \
                 (see deploy/rbac.yaml or the Helm chart)"
            ),
            CrdProblem::Other(crd, msg) => write!(f, "cannot list {crd}: {msg}"),
        }
    }
}

/// Classifies the error of listing a CRD's objects.
pub(crate) fn crd_problem(crd: String, e: &kube::Error) -> CrdProblem {
    match e {
        kube::Error::Api(s) if s.code == 404 => CrdProblem::Missing(crd),
        kube::Error::Api(s) if s.code == 403 => CrdProblem::Forbidden(crd, s.message.clone()),
        other => CrdProblem::Other(crd, other.to_string()),
    }
}

async fn check_crds(client: &Client, namespace: Option<&str>) -> Result<(), CrdProblem> {
    use crate::api::{MachineDeployment, MachineSet};
    use kube::Resource;
    /// Lists at most one `K` (its metadata): whether the CRD is served and
    /// this identity may read it.
    async fn listable<K>(api: Api<K>) -> Result<(), CrdProblem>
    where
        K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
    {
        api.list_metadata(&kube::api::ListParams::default().limit(1))
            .await
            .map(|_| ())
            .map_err(|e| crd_problem(crd_name::<K>(), &e))
    }
    fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    {
        match namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    listable(scoped::<Machine>(client, namespace)).await?;
    listable(Api::<MachineClass>::all(client.clone())).await?;
    listable(scoped::<MachineSet>(client, namespace)).await?;
    listable(scoped::<MachineDeployment>(client, namespace)).await?;
    // The move ledger's permits are of every namespace: a workload's pods
    // run on Machines of any scope.
    listable(Api::<crate::api::MovePermit>::all(client.clone())).await?;
    listable(Api::<crate::api::MoveAsk>::all(client.clone())).await?;
    Ok(())
}

/// `<plural>.<group>`, the name of `K`'s CustomResourceDefinition.
fn crd_name<K: kube::Resource<DynamicType = ()>>() -> String {
    format!("{}.{}", K::plural(&()), K::group(&()))
}

/// Returns once all six CRDs can be listed, logging one clear line per
/// failed attempt (backoff 1s doubling to 1 minute).
async fn wait_for_crds(client: &Client, namespace: Option<&str>) {
    use backon::BackoffBuilder;
    let mut backoff = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_secs(1))
        .with_max_delay(Duration::from_secs(60))
        .with_jitter()
        .without_max_times()
        .build();
    loop {
        match check_crds(client, namespace).await {
            Ok(()) => return,
            Err(problem) => {
                let retry_in = backoff.next().unwrap_or(Duration::from_secs(60));
                tracing::error!(retry_in = ?retry_in, "{problem}");
                tokio::time::sleep(retry_in).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    #[test]
    fn flags_have_production_defaults() {
        let a = Cli::try_parse_from(["berth", "--providers=fake"])
            .expect("only --providers is required")
            .run;
        assert!(a.leader_elect);
        assert_eq!(a.metrics_addr, "0.0.0.0:8080".parse().expect("addr"));
        assert_eq!(a.lease_duration, Duration::from_secs(15));
        assert_eq!(a.providers, vec!["fake".to_string()]);
        assert_eq!(a.log_format, LogFormat::Text);
    }

    #[test]
    fn the_providers_are_never_chosen_by_default() {
        let err = Cli::try_parse_from(["berth"]).expect_err("--providers is required");
        assert!(err.to_string().contains("--providers"), "{err}");
        let none = Cli::try_parse_from(["berth", "--providers="])
            .expect("an explicit empty list")
            .run;
        assert_eq!(none.providers, vec![String::new()]);
    }

    #[test]
    fn flags_parse_and_reject_bad_values() {
        let a = Cli::try_parse_from([
            "berth",
            "--leader-elect=false",
            "--log-format=json",
            "--lease-duration=30s",
            "--providers=fake,fake",
            "--kube-qps=5",
        ])
        .expect("valid flags")
        .run;
        assert!(!a.leader_elect);
        assert_eq!(a.log_format, LogFormat::Json);
        assert_eq!(a.lease_duration, Duration::from_secs(30));
        assert_eq!(a.providers.len(), 2);
        assert_eq!(a.kube_qps, 5);
        assert!(Cli::try_parse_from(["berth", "--providers=fake", "--log-format=xml"]).is_err());
        assert!(
            Cli::try_parse_from(["berth", "--providers=fake", "--lease-duration=soon"]).is_err()
        );
        assert!(
            Cli::try_parse_from(["berth", "--providers=fake", "--metrics-addr=nowhere"]).is_err()
        );
    }

    fn run_args(flags: &[&str]) -> RunArgs {
        let mut argv = vec!["berth"];
        argv.extend_from_slice(flags);
        Cli::try_parse_from(argv).expect("valid flags").run
    }

    #[tokio::test]
    async fn unknown_providers_are_refused_by_name() {
        let metrics = Arc::new(Metrics::new().expect("metrics"));
        let err = providers(
            &run_args(&["--providers=fake,gcp"]),
            &dummy_client(),
            &metrics,
        )
        .err()
        .expect("gcp is unknown");
        assert!(err.to_string().contains("\"gcp\""), "{err}");
    }

    #[tokio::test]
    async fn the_aws_provider_needs_a_cluster_id_fit_for_a_tag() {
        let metrics = Arc::new(Metrics::new().expect("metrics"));
        for flags in [
            &["--providers=aws"][..],
            &["--providers=aws", "--cluster-id="][..],
            &["--providers=aws", "--cluster-id=has space"][..],
        ] {
            let err = providers(&run_args(flags), &dummy_client(), &metrics)
                .err()
                .expect("refused");
            assert!(err.to_string().contains("--cluster-id"), "{flags:?}: {err}");
        }
        let registry = providers(
            &run_args(&["--providers=aws,fake", "--cluster-id=prod-eu/1"]),
            &dummy_client(),
            &metrics,
        )
        .expect("valid");
        assert_eq!(registry.names(), vec!["aws", "fake"]);
    }

    #[test]
    fn crd_problems_say_what_to_do() {
        let status = |code: u16| {
            kube::Error::Api(Box::new(kube::core::Status {
                code,
                message: "nope".into(),
                ..Default::default()
            }))
        };
        let missing = crd_problem("machines.berth.dev".into(), &status(404));
        assert_eq!(missing, CrdProblem::Missing("machines.berth.dev".into()));
        assert!(missing.to_string().contains("berth crd | kubectl apply"));
        let forbidden = crd_problem("machines.berth.dev".into(), &status(403));
        assert!(matches!(forbidden, CrdProblem::Forbidden(_, _)));
        assert!(forbidden.to_string().contains("get/list/watch"));
        assert!(matches!(
            crd_problem("x".into(), &status(500)),
            CrdProblem::Other(c, _) if c == "x"
        ));
    }

    #[test]
    fn the_six_crds_are_named_as_kubectl_names_them() {
        use crate::api::{MachineDeployment, MachineSet};
        assert_eq!(crd_name::<Machine>(), "machines.berth.dev");
        assert_eq!(crd_name::<MachineClass>(), "machineclasses.berth.dev");
        assert_eq!(crd_name::<MachineSet>(), "machinesets.berth.dev");
        assert_eq!(
            crd_name::<MachineDeployment>(),
            "machinedeployments.berth.dev"
        );
        assert_eq!(
            crd_name::<crate::api::MovePermit>(),
            "movepermits.berth.dev"
        );
        assert_eq!(crd_name::<crate::api::MoveAsk>(), "moveasks.berth.dev");
    }

    fn dummy_client() -> Client {
        let config = kube::Config::new("https://127.0.0.1:1".parse().expect("uri"));
        Client::try_from(config).expect("client from a static config")
    }
}
