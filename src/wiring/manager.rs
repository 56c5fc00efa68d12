//! The controller manager: one set of watches and caches
//! (`crate::wiring::watches`), and on them the Machine, MachineSet and
//! MachineDeployment controllers, the drain engine and orphan collection.
//!
//! Everything here runs on the leader only, in one task that
//! `crate::wiring::process` aborts when leadership is lost: the controllers
//! stop where they are (every step resumes), and no watch, drain or
//! orphan round outlives them.

use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use kube::Client;
use kube::runtime::events::{Recorder, Reporter};

use super::watches::{Watches, watches};
use crate::controller::AbortOnDrop;
use crate::drain::engine::{Deps as DrainDeps, Drainer};
use crate::drain::ledger::{AskStore, PermitStore, Permits};
use crate::providers::Registry;
use crate::telemetry::Metrics;
use crate::telemetry::events::EventSink;

/// How the controllers run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Watch Machines, MachineSets and MachineDeployments in this namespace
    /// only (all namespaces when `None`).
    pub namespace: Option<String>,
    /// Name reported on Events (`reportingInstance`).
    pub instance: String,
    /// Machines reconciled at the same time.
    pub concurrency: u16,
    /// Old Machines being deleted by MachineDeployment rollouts at once,
    /// across every deployment.
    pub max_concurrent_drains: usize,
    /// Volume moves in flight at once across every drain (`None`: no
    /// cap).
    pub max_volume_moves: Option<usize>,
    /// How long a deleted Machine's VM may be "not found" before it counts
    /// as gone (only "terminated" is gone at once).
    pub vm_not_found_grace: Duration,
    /// The cluster's bound on unhealthy Machines for remediation (see
    /// `berth run --max-unhealthy`).
    pub max_unhealthy: crate::api::remediation::MaxUnhealthy,
    /// Orphan collection (none by default).
    pub orphans: crate::orphans::Settings,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            namespace: None,
            instance: "berth".into(),
            concurrency: DEFAULT_CONCURRENCY,
            max_concurrent_drains: DEFAULT_MAX_CONCURRENT_DRAINS,
            max_volume_moves: Some(DEFAULT_MAX_VOLUME_MOVES),
            vm_not_found_grace: DEFAULT_VM_NOT_FOUND_GRACE,
            max_unhealthy: crate::api::remediation::MaxUnhealthy::Percent(40),
            orphans: crate::orphans::Settings::default(),
        }
    }
}

/// The cap on volume moves in flight across every drain unless told
/// otherwise (`berth run --max-volume-moves`, whose default is the same).
pub const DEFAULT_MAX_VOLUME_MOVES: usize = 50;

/// How long a deleted Machine's VM may be "not found" before it counts as
/// gone, unless told otherwise (`berth run --vm-not-found-grace`, whose
/// default is the same).
pub const DEFAULT_VM_NOT_FOUND_GRACE: Duration = Duration::from_secs(180);

/// The cap on rollout drains across deployments unless told otherwise
/// (`berth run --max-concurrent-drains`, whose default is the same).
pub const DEFAULT_MAX_CONCURRENT_DRAINS: usize = 10;

/// Machines reconciled at the same time unless told otherwise. A reconcile
/// is short (the drain runs beside it, not in it) and its requests go
/// through the client's rate limit, so this bounds only how many Machines
/// wait for a turn: too few turns, and the last of many Machines deleted
/// together start their drains late.
pub const DEFAULT_CONCURRENCY: u16 = 32;

/// The API clients the controllers use.
#[derive(Clone)]
pub struct Clients {
    /// Watches, Machine and Node writes, evictions.
    pub api: Client,
    /// Events only. A client of its own (its own rate limit) keeps a burst
    /// of Events, when many drains start at once, from queueing evictions
    /// behind it in a shared limiter. client-go throttles Events apart from
    /// other requests for the same reason.
    pub events: Client,
    /// Makes each drain's own client, on `api`'s rate limit: a queue of
    /// its own for the limiter's tokens (see `process::LimitedClients`).
    pub per_drain: crate::drain::engine::ClientPerDrain,
}

impl From<Client> for Clients {
    /// One client for everything (tests, the demo, the benchmark).
    fn from(client: Client) -> Self {
        let shared = client.clone();
        Self {
            api: client.clone(),
            events: client,
            per_drain: Arc::new(move || shared.clone().into()),
        }
    }
}

/// The move ledger every drain of this process asks: its permits of
/// bounded budgets written on an urgent line of their own (a stateful
/// move's first step, never queued behind the reconcilers' writes; see
/// `per_drain`) and read from the cache of every process's, for the
/// Machines of `settings.namespace`.
fn move_ledger(
    per_drain: &crate::drain::engine::ClientPerDrain,
    caches: &crate::cache::Caches,
    settings: &Settings,
    metrics: &Arc<Metrics>,
) -> Permits {
    let store = PermitStore::new(
        per_drain().moves,
        caches.move_permits.clone(),
        settings.namespace.clone(),
    );
    let line = AskStore::new(
        per_drain().moves,
        caches.move_asks.clone(),
        caches.ask_changes.clone(),
        settings.namespace.clone(),
    );
    Permits::new(settings.max_volume_moves, Arc::clone(metrics), store, line)
}

/// Runs the controllers until `shutdown` resolves, then lets reconciles in
/// flight finish (orphan collection stops at once). `ready` is called once
/// every cache has synced. Provider calls, reconciles, drains and Machine
/// phases are recorded in `metrics`.
pub async fn run(
    clients: impl Into<Clients>,
    providers: Registry,
    settings: Settings,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
    ready: impl FnOnce() + Send + 'static,
) {
    let Clients {
        api: client,
        events: events_client,
        per_drain,
    } = clients.into();
    let Watches {
        caches,
        tracker,
        machine: machine_feeds,
        sets,
        set_wakes,
        deployment_wakes,
        drain_rules,
        background,
    } = watches(&client, settings.namespace.as_deref(), &metrics);
    let background = AbortOnDrop(tokio::spawn(background.for_each(|_| async {})));

    let providers = providers.instrumented(&metrics);
    let (events, _publisher) = event_sink(events_client, &settings.instance, &metrics);
    let (drainer, drains_done) =
        drain_engine(per_drain, &caches, tracker, &events, &settings, &metrics);

    // One shutdown for every controller.
    let shutdown = shutdown.shared();
    let machines = crate::machine::run(
        Arc::new(
            crate::machine::Context::new(
                client.clone(),
                providers.clone(),
                events.clone(),
                caches.clone(),
                Arc::clone(&metrics),
                drainer,
                settings.vm_not_found_grace,
            )
            .with_max_unhealthy(settings.max_unhealthy),
        ),
        machine_feeds,
        drains_done,
        settings.concurrency,
        shutdown.clone(),
    );
    let machinesets = crate::machineset::run(
        client.clone(),
        caches.clone(),
        sets,
        events.clone(),
        set_wakes,
        shutdown.clone(),
    );
    let machinedeployments = crate::machinedeployment::run(
        client.clone(),
        settings.namespace,
        caches.clone(),
        events.clone(),
        settings.max_concurrent_drains,
        Arc::clone(&metrics),
        deployment_wakes,
        shutdown.clone(),
    );
    let drain_rules = crate::drainrule::run(client.clone(), drain_rules, events.clone());
    let orphans = orphan_collection(
        settings.orphans,
        crate::orphans::Shared {
            client,
            caches: caches.clone(),
            providers,
            events,
        },
        &metrics,
        shutdown,
    );
    let controllers = async {
        tokio::join!(machines, machinesets, machinedeployments);
    };
    let beside = async {
        tokio::join!(orphans, drain_rules, when_synced(&caches, ready));
        std::future::pending::<()>().await;
    };
    tokio::select! {
        _ = controllers => {},
        _ = beside => {},
    }
    drop(background);
}

/// The drain engine, on its move ledger (see [`move_ledger`]), and the
/// stream of the Machines whose drain ended, which wakes their controller.
fn drain_engine(
    per_drain: crate::drain::engine::ClientPerDrain,
    caches: &crate::cache::Caches,
    tracker: crate::volumes::Tracker,
    events: &EventSink,
    settings: &Settings,
    metrics: &Arc<Metrics>,
) -> (
    Drainer,
    tokio::sync::mpsc::UnboundedReceiver<kube::runtime::reflector::ObjectRef<crate::api::Machine>>,
) {
    let permits = move_ledger(&per_drain, caches, settings, metrics);
    Drainer::new(DrainDeps {
        drain_client: per_drain,
        caches: caches.clone(),
        tracker,
        metrics: Arc::clone(metrics),
        events: events.clone(),
        permits,
    })
}

/// Where the controllers' Events go: a queue, published in the background
/// on the Events' own client as controller `berth`, instance `instance`.
fn event_sink(
    client: Client,
    instance: &str,
    metrics: &Arc<Metrics>,
) -> (EventSink, tokio::task::JoinHandle<()>) {
    EventSink::new(
        Recorder::new(
            client,
            Reporter {
                controller: "berth".into(),
                instance: Some(instance.to_string()),
            },
        ),
        Arc::clone(metrics),
        crate::telemetry::events::QUEUE,
    )
}

/// Orphan collection, which acts only for a leader that is not stopping:
/// it ends at the shutdown, before the reconciles in flight do. A delete
/// cut short is asked again by the next leader.
async fn orphan_collection(
    settings: crate::orphans::Settings,
    shared: crate::orphans::Shared,
    metrics: &Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Unpin,
) {
    let round = crate::orphans::run(settings, shared, Arc::clone(metrics));
    futures::future::select(Box::pin(round), shutdown).await;
}

/// Calls `ready` once every cache has synced.
async fn when_synced(caches: &crate::cache::Caches, ready: impl FnOnce()) {
    let mut synced = caches.synced.clone();
    if synced.wait_for(|s| *s).await.is_ok() {
        tracing::info!("caches synced; reconciling Machines");
        ready();
    }
}

/// Controllers started by [`spawn`]: stop them with [`Spawned::stop`].
pub struct Spawned {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    /// Resolves once every cache has synced.
    pub ready: tokio::sync::oneshot::Receiver<()>,
}

impl Spawned {
    /// Graceful shutdown, waiting at most `grace` for reconciles in flight.
    pub async fn stop(mut self, grace: Duration) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if tokio::time::timeout(grace, &mut self.task).await.is_err() {
            self.task.abort();
        }
    }
}

/// [`run`] on its own task, for the processes that embed the controllers
/// (the development kit's demo and benchmark, tests).
pub fn spawn(
    clients: impl Into<Clients>,
    providers: Registry,
    settings: Settings,
    metrics: Arc<Metrics>,
) -> Spawned {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready) = tokio::sync::oneshot::channel::<()>();
    let clients: Clients = clients.into();
    let task = tokio::spawn(run(
        clients,
        providers,
        settings,
        metrics,
        async move {
            let _ = stopped.await;
        },
        move || {
            let _ = ready_tx.send(());
        },
    ));
    Spawned {
        stop: Some(stop),
        task,
        ready,
    }
}
