//! The Machine reconciler: creation, health, and the ordered, resumable
//! deletion of a Machine.
//!
//! It watches Machines and, through shared caches, the objects its decisions
//! depend on: MachineClasses, Nodes, Pods and VolumeAttachments. An event on
//! any of them wakes the Machines it concerns, so no step polls the API
//! server; the only timers are deadlines (creation timeout, health timeout,
//! a provider's "ask again in N seconds").
//!
//! The MachineSet controller (`crate::machineset`) runs beside it in the
//! same task, on these caches: the Machine watch also files Machines by
//! their set and wakes the set, and a Node event wakes the sets of its
//! Machines.
//!
//! `decide` chooses the next step from facts, `record` what a step records,
//! `status` folds that into the status, `write` writes it without undoing a
//! newer write, and `reconcile` observes, acts and records.

pub(crate) mod backoff;
pub(crate) mod decide;
mod reconcile;
pub(crate) mod record;
pub(crate) mod status;
pub mod write;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::{CSIDriver, VolumeAttachment};
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

use crate::api::{Machine, MachineClass};
use crate::cache::{Index, Indexes, trim};
use crate::drain::engine::{Deps as DrainDeps, Drainer};
use crate::providers::Registry;
use crate::telemetry::Metrics;
use crate::telemetry::events::EventSink;
use crate::volumes::Tracker;

use reconcile::Error;

/// The caches the reconciler reads instead of the API server.
#[derive(Clone)]
pub(crate) struct Stores {
    pub(crate) machines: Store<Machine>,
    pub(crate) classes: Store<MachineClass>,
    pub(crate) nodes: Store<Node>,
    pub(crate) pods: Store<Pod>,
    pub(crate) attachments: Store<VolumeAttachment>,
    pub(crate) pvcs: Store<PersistentVolumeClaim>,
    pub(crate) pvs: Store<PersistentVolume>,
    pub(crate) pdbs: Store<PodDisruptionBudget>,
    /// Lookups by Node, claim, PV and providerID over those caches.
    pub(crate) indexes: Indexes,
}

pub(crate) struct Context {
    pub(crate) client: Client,
    pub(crate) providers: Registry,
    pub(crate) events: EventSink,
    pub(crate) stores: Stores,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) drainer: Drainer,
    /// Every auxiliary cache has synced; reconciles act only after that.
    pub(crate) synced: std::sync::atomic::AtomicBool,
    /// Per-Machine exponential backoff for transient errors, reset by a
    /// successful reconcile.
    backoff: backoff::Backoffs<Machine>,
    /// When the provider may next be asked for a Machine's VM, after it
    /// failed or asked to be asked later. The reconcile's own status writes
    /// wake it at once; without this, each failure's record would start the
    /// next attempt, and the backoff would never apply.
    provider_retry: Mutex<HashMap<ObjectRef<Machine>, tokio::time::Instant>>,
}

/// Machines filed by their Node: by `status.nodeRef` and by
/// `spec.providerID` (the Node that has just registered with it), fed by the
/// Machine watch, so that a Node, pod or VolumeAttachment event finds its
/// Machine without a scan of every Machine.
#[derive(Clone)]
pub(crate) struct MachinesByNode {
    by_node_ref: Index<Machine>,
    by_provider_id: Index<Machine>,
}

impl Default for MachinesByNode {
    fn default() -> Self {
        Self {
            by_node_ref: Index::new(node_ref_of),
            by_provider_id: Index::new(provider_id_of),
        }
    }
}

fn node_ref_of(m: &Machine) -> Vec<String> {
    m.status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| r.name.clone())
        .into_iter()
        .collect()
}

fn provider_id_of(m: &Machine) -> Vec<String> {
    m.spec.provider_id.clone().into_iter().collect()
}

impl MachinesByNode {
    /// Applies one Machine watch event, after the store has.
    fn observe(&self, ev: &watcher::Event<Machine>) {
        self.by_node_ref.observe(ev);
        self.by_provider_id.observe(ev);
    }

    /// The Machines whose Node this is: by `status.nodeRef`, or by
    /// providerID for a Node that has just registered.
    fn of_node(&self, node: &str, provider_id: Option<&str>) -> Vec<ObjectRef<Machine>> {
        let mut refs = self.by_node_ref.refs(node);
        for r in provider_id
            .map(|id| self.by_provider_id.refs(id))
            .unwrap_or_default()
        {
            if !refs.contains(&r) {
                refs.push(r);
            }
        }
        refs
    }

    /// The Machines being deleted whose Node (by `status.nodeRef`) this is.
    fn deleting_of_node(&self, machines: &Store<Machine>, node: &str) -> Vec<ObjectRef<Machine>> {
        self.by_node_ref
            .get(machines, node)
            .iter()
            .filter(|m| m.metadata.deletion_timestamp.is_some())
            .map(|m| ObjectRef::from_obj(&**m))
            .collect()
    }
}

/// What the controller shares with the work that runs beside it on the
/// leader (orphan collection, `crate::orphans`): its caches, its drivers
/// (counted in the metrics) and its Events queue, so that such work reads
/// no API object the controller does not already watch.
#[derive(Clone)]
pub struct Shared {
    pub(crate) machines: Store<Machine>,
    pub(crate) classes: Store<MachineClass>,
    /// Turns true once the first complete list of Machines is in
    /// `machines` (and stays true: a re-list swaps the store whole).
    ///
    /// Not `machines.wait_until_ready()`: kube-runtime's store readiness
    /// (a `DelayedInit` over a oneshot channel) keeps one waker, and the
    /// controller already waits on it for this store, so a second waiter
    /// may never be woken (what the comment on `readiness` below saw).
    pub(crate) machines_listed: tokio::sync::watch::Receiver<bool>,
    pub(crate) providers: Registry,
    pub(crate) events: EventSink,
}

/// How the controller runs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Watch Machines in this namespace only (all namespaces when `None`).
    pub namespace: Option<String>,
    /// Name reported on Events (`reportingInstance`).
    pub instance: String,
    /// Machines reconciled at the same time.
    pub concurrency: u16,
    /// Old Machines being deleted by MachineDeployment rollouts at once,
    /// across every deployment.
    pub max_concurrent_drains: usize,
}

/// The cap on rollout drains across deployments unless told otherwise
/// (`berth run --max-concurrent-drains`, whose default is the same).
pub const DEFAULT_MAX_CONCURRENT_DRAINS: usize = 10;

/// Machines reconciled at the same time unless told otherwise. A reconcile
/// is short (the drain runs beside it, not in it) and its requests go
/// through the client's rate limit, so this bounds only how many Machines
/// wait for a turn: with 20 Machines deleted together and 8 turns, the last
/// ones' drains started up to 4.6 s late in the scale benchmark.
pub const DEFAULT_CONCURRENCY: u16 = 32;

/// The API clients the controller uses.
#[derive(Clone)]
pub struct Clients {
    /// Watches, Machine and Node writes, evictions.
    pub api: Client,
    /// Events only. A client of its own (its own rate limit) keeps a burst
    /// of Events from queueing evictions behind it: with 20 drains starting
    /// at once the benchmark saw evictions wait 6-12 s behind Events in a
    /// shared limiter. client-go throttles Events apart from other requests
    /// for the same reason.
    pub events: Client,
}

impl From<Client> for Clients {
    /// One client for everything (tests, the demo, the benchmark).
    fn from(client: Client) -> Self {
        Self {
            api: client.clone(),
            events: client,
        }
    }
}

/// Runs the Machine controller until `shutdown` resolves. `ready` is called
/// once every cache has synced, with what the controller [`Shared`]s.
/// Provider calls, reconciles and Machine phases are recorded in `metrics`.
pub async fn run(
    clients: impl Into<Clients>,
    providers: Registry,
    settings: Settings,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
    ready: impl FnOnce(Shared) + Send + 'static,
) {
    let Clients {
        api: client,
        events: events_client,
    } = clients.into();
    let machines_api: Api<Machine> = match &settings.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let wc = watcher::Config::default();
    // One shutdown for the Machine and the MachineSet controllers.
    let shutdown = futures::FutureExt::shared(shutdown);
    // The MachineSet controller runs on these caches: it is woken by the
    // events of the Machines its sets own (and of their Nodes), and reads
    // each set's Machines from an index by owner.
    let machines_by_set = Index::new(crate::machineset::controlling_set);
    // MachineSets: one watch, whose store both the set controller and the
    // deployment controller read; a set event wakes its deployment.
    let (sets, sets_w) = reflector::store::<crate::api::MachineSet>();
    let (set_wakes, set_wake_stream, deployment_wakes) =
        crate::machineset::Wakes::new(sets.clone());
    let sets_api: Api<crate::api::MachineSet> = match &settings.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let set_events = {
        let wakes = set_wakes.clone();
        reflector::reflector(sets_w, watcher(sets_api, wc.clone()))
            .inspect(move |ev| {
                if let Ok(ev) = ev {
                    wakes.set_event(ev);
                }
            })
            .applied_objects()
    };

    let (classes, classes_w) = reflector::store();
    let class_events = reflector::reflector(
        classes_w,
        watcher(Api::<MachineClass>::all(client.clone()), wc.clone()).modify(trim::metadata),
    )
    .default_backoff()
    .touched_objects();
    let (machines, machines_w) = reflector::store();
    let machines_by_node = MachinesByNode::default();
    let (node_machines, node_machines_by_node) = (machines.clone(), machines_by_node.clone());
    // Nodes and VolumeAttachments also feed the volume tracker, with the raw
    // watch events (re-lists included) once the store has applied them.
    let (nodes, nodes_w) = reflector::store();
    let (attachments, vas_w) = reflector::store();
    let indexes = Indexes::default();
    let tracker = Tracker::new(
        attachments.clone(),
        indexes.attachments_by_pv.clone(),
        nodes.clone(),
        crate::volumes::DEFAULT_CHANNEL_CAPACITY,
        Some(&metrics),
    );
    let node_tracker = tracker.clone();
    let node_index = indexes.clone();
    let node_events = reflector::reflector(
        nodes_w,
        watcher(Api::<Node>::all(client.clone()), wc.clone()).modify(trim::node),
    )
    .inspect(move |ev| {
        if let Ok(ev) = ev {
            node_index.observe_node(ev);
            node_tracker.observe_node_event(ev);
        }
    })
    .default_backoff()
    .filter({
        let mut changes = NodeChanges::default();
        move |ev| futures::future::ready(ev.as_ref().map_or(true, |ev| changes.wakes(ev)))
    })
    .touched_objects();
    let node_events = {
        let (by_node, machines, wakes) = (
            node_machines_by_node.clone(),
            node_machines.clone(),
            set_wakes.clone(),
        );
        // A Node that turns Ready or NotReady changes its set's counts.
        node_events.inspect(move |node| {
            if let Ok(node) = node {
                let provider_id = node.spec.as_ref().and_then(|s| s.provider_id.as_deref());
                for r in by_node.of_node(&node.name_any(), provider_id) {
                    if let Some(m) = machines.get(&r) {
                        wakes.machine(&m);
                    }
                }
            }
        })
    };
    let va_tracker = tracker.clone();
    let va_index = indexes.clone();
    let va_events = reflector::reflector(
        vas_w,
        watcher(Api::<VolumeAttachment>::all(client.clone()), wc.clone()).modify(trim::metadata),
    )
    .inspect(move |ev| {
        if let Ok(ev) = ev {
            va_index.observe_attachment(ev);
            va_tracker.observe_attachment_event(ev);
        }
    })
    .default_backoff()
    .touched_objects();
    // Pod and PodDisruptionBudget events bump a counter the drain's waits
    // watch: a waiter re-reads the store after each bump, so none is missed.
    let (pod_changes_tx, pod_changes) = tokio::sync::watch::channel(0u64);
    let (pods, pods_w) = reflector::store();
    let pod_index = indexes.clone();
    let pod_events = reflector::reflector(
        pods_w,
        watcher(Api::<Pod>::all(client.clone()), wc.clone()).modify(trim::pod),
    )
    .inspect(move |ev| {
        if let Ok(ev) = ev {
            pod_index.observe_pod(ev);
        }
        pod_changes_tx.send_modify(|n| *n = n.wrapping_add(1));
    })
    .default_backoff()
    .touched_objects();
    let (pdb_changes_tx, pdb_changes) = tokio::sync::watch::channel(0u64);
    let (pdbs, pdbs_w) = reflector::store();
    let pdb_events = reflector::reflector(
        pdbs_w,
        watcher(Api::<PodDisruptionBudget>::all(client.clone()), wc.clone()).modify(trim::metadata),
    )
    .inspect(move |_| pdb_changes_tx.send_modify(|n| *n = n.wrapping_add(1)));
    let (pvcs, pvcs_w) = reflector::store();
    let pvc_events = reflector::reflector(
        pvcs_w,
        watcher(
            Api::<PersistentVolumeClaim>::all(client.clone()),
            wc.clone(),
        )
        .modify(trim::metadata),
    );
    let (pvs, pvs_w) = reflector::store();
    let pv_events = reflector::reflector(
        pvs_w,
        watcher(Api::<PersistentVolume>::all(client.clone()), wc.clone()).modify(trim::metadata),
    );
    // CSIDrivers say which drivers attach: the drain's volume classes. A
    // drain planned before they are listed would take every attach-free
    // CSI volume for an attachable one, so the sync waits for them too.
    let (csi_drivers, csi_drivers_w) = reflector::store();
    let csi_drivers_listed = csi_drivers.clone();
    let csi_driver_events = reflector::reflector(
        csi_drivers_w,
        watcher(Api::<CSIDriver>::all(client.clone()), wc.clone()).modify(trim::csi_driver),
    );
    // These only fill caches; nothing is woken by them directly.
    let side_caches = tokio::spawn(async move {
        tokio::join!(
            pdb_events.default_backoff().for_each(|_| async {}),
            pvc_events.default_backoff().for_each(|_| async {}),
            pv_events.default_backoff().for_each(|_| async {}),
            csi_driver_events.default_backoff().for_each(|_| async {}),
        );
    });

    // The Machine watch, as `Controller::new` runs it, plus the indexes of
    // Machines by Node and by MachineSet that it feeds.
    let machine_index = machines_by_node.clone();
    let (set_index, machine_wakes) = (machines_by_set.clone(), set_wakes.clone());
    let (listed_tx, machines_listed) = tokio::sync::watch::channel(false);
    let machine_events = reflector::reflector(machines_w, watcher(machines_api, wc.clone()))
        .inspect(move |ev| {
            if let Ok(ev) = ev {
                machine_index.observe(ev);
                set_index.observe(ev);
                machine_wakes.machine_event(ev);
                // The reflector has swapped the whole list into the store.
                if matches!(ev, watcher::Event::InitDone) {
                    listed_tx.send_if_modified(|l| !std::mem::replace(l, true));
                }
            }
        })
        .applied_objects();
    let controller = Controller::for_stream(machine_events, machines.clone()).with_config(
        kube::runtime::controller::Config::default().concurrency(settings.concurrency),
    );
    let stores = Stores {
        machines: machines.clone(),
        classes: classes.clone(),
        nodes: nodes.clone(),
        pods: pods.clone(),
        attachments: attachments.clone(),
        pvcs: pvcs.clone(),
        pvs: pvs.clone(),
        pdbs: pdbs.clone(),
        indexes: indexes.clone(),
    };

    let by_class = machines.clone();
    let by_node = machines_by_node.clone();
    let (by_pod, pod_machines) = (machines_by_node.clone(), machines.clone());
    let (by_va, va_machines) = (machines_by_node, machines.clone());
    let controller = controller
        .watches_stream(class_events, move |class: MachineClass| {
            let name = class.name_any();
            by_class
                .state()
                .into_iter()
                .filter(|m| m.spec.class_ref.name == name)
                .map(|m| ObjectRef::from_obj(&*m))
                .collect::<Vec<_>>()
        })
        .watches_stream(node_events, move |node: Node| {
            by_node.of_node(
                &node.name_any(),
                node.spec.as_ref().and_then(|s| s.provider_id.as_deref()),
            )
        })
        // Pods and VolumeAttachments matter only to a Machine being
        // deleted (its drain and its wait for detach): a Running Machine
        // is not woken by the churn of its Node's pods.
        .watches_stream(pod_events, move |pod: Pod| {
            match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
                Some(node) => by_pod.deleting_of_node(&pod_machines, node),
                None => Vec::new(),
            }
        })
        .watches_stream(va_events, move |va: VolumeAttachment| {
            by_va.deleting_of_node(&va_machines, &va.spec.node_name)
        });

    let providers = providers.instrumented(&metrics);
    let (events, _publisher) = EventSink::new(
        Recorder::new(
            events_client,
            Reporter {
                controller: "berth".into(),
                instance: Some(settings.instance.clone()),
            },
        ),
        Arc::clone(&metrics),
        crate::telemetry::events::QUEUE,
    );
    let (drainer, drains_done) = Drainer::new(DrainDeps {
        client: client.clone(),
        pods: pods.clone(),
        pvcs: pvcs.clone(),
        pvs: pvs.clone(),
        pdbs: pdbs.clone(),
        attachments: attachments.clone(),
        nodes: nodes.clone(),
        csi_drivers,
        indexes,
        tracker,
        pod_changes,
        pdb_changes,
        metrics: Arc::clone(&metrics),
        events: events.clone(),
    });
    let controller = controller
        .reconcile_on(futures::stream::unfold(drains_done, |mut rx| async move {
            rx.recv().await.map(|m| (m, rx))
        }));
    let shared = Shared {
        machines: machines.clone(),
        classes: classes.clone(),
        machines_listed,
        providers: providers.clone(),
        events: events.clone(),
    };
    let ctx = Arc::new(Context {
        client: client.clone(),
        providers,
        events,
        drainer,
        synced: std::sync::atomic::AtomicBool::new(false),
        stores: stores.clone(),
        metrics: Arc::clone(&metrics),
        backoff: backoff::Backoffs::default(),
        provider_retry: Mutex::new(HashMap::new()),
    });

    let (synced_tx, synced) = tokio::sync::watch::channel(false);
    let set_caches = crate::machineset::Caches {
        machines: machines.clone(),
        machines_by_set,
        nodes: nodes.clone(),
        pods: pods.clone(),
        pvcs: pvcs.clone(),
        pdbs: pdbs.clone(),
        indexes: stores.indexes.clone(),
    };
    let machinesets = crate::machineset::run(
        client.clone(),
        set_caches.clone(),
        set_events,
        sets.clone(),
        ctx.events.clone(),
        synced.clone(),
        shared.machines_listed.clone(),
        set_wake_stream,
        shutdown.clone(),
    );
    let machinedeployments = crate::machinedeployment::run(
        client.clone(),
        settings.namespace.clone(),
        set_caches,
        sets,
        ctx.events.clone(),
        settings.max_concurrent_drains,
        Arc::clone(&metrics),
        synced,
        deployment_wakes,
        shutdown.clone(),
    );
    let readiness = {
        let stores = stores.clone();
        let ctx = Arc::clone(&ctx);
        async move {
            // The controller's own Machine store is not awaited: after a
            // restart with existing Machines its readiness was observed not
            // to fire (kube-runtime 5), although it lists, watches and
            // reconciles normally. The controller waits for it internally.
            let _ = tokio::join!(
                stores.classes.wait_until_ready(),
                stores.nodes.wait_until_ready(),
                stores.pods.wait_until_ready(),
                stores.attachments.wait_until_ready(),
                stores.pvcs.wait_until_ready(),
                stores.pvs.wait_until_ready(),
                stores.pdbs.wait_until_ready(),
                csi_drivers_listed.wait_until_ready(),
            );
            ctx.synced.store(true, std::sync::atomic::Ordering::Release);
            let _ = synced_tx.send(true);
            // Machines seen before the sync did nothing: look at them again.
            for m in stores.machines.state() {
                ctx.drainer.wake(ObjectRef::from_obj(&*m));
            }
            ready(shared);
        }
    };
    tokio::spawn(readiness);

    let machines_controller = controller
        .graceful_shutdown_on(shutdown)
        .run(reconcile::reconcile, error_policy, Arc::clone(&ctx))
        .for_each(|result| {
            match result {
                Ok((obj, _)) => tracing::debug!(machine = %obj, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "reconcile failed"),
            }
            // Every reconcile may have moved a phase: recount from the cache.
            let gauges = status::Gauges::count(machines.state().iter().map(|m| &**m));
            gauges.publish(&metrics);
            futures::future::ready(())
        });
    tokio::join!(machines_controller, machinesets, machinedeployments);
    // Drains stop at a resumable point: the next leader re-plans from the
    // cluster's state.
    ctx.drainer.stop_all();
    side_caches.abort();
}

/// A controller started by [`spawn`]: stop it with [`Spawned::stop`].
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

/// [`run`] on its own task, for the processes that embed the controller
/// (the development kit's demo and benchmark, tests).
pub fn spawn(
    client: Client,
    providers: Registry,
    settings: Settings,
    metrics: Arc<Metrics>,
) -> Spawned {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(
        client,
        providers,
        settings,
        metrics,
        async move {
            let _ = stopped.await;
        },
        move |_| {
            let _ = ready_tx.send(());
        },
    ));
    Spawned {
        stop: Some(stop),
        task,
        ready,
    }
}

/// Passes the Node events that can change a decision about a Machine, by
/// remembering a hash of [`node_relevance`] per Node.
///
/// Nodes refresh their status on a timer (a kubelet every 10 s to 5 min, the
/// test bed's kwok every 20-45 s); with 1,000 Nodes the benchmark counted 46
/// reconciles a second that could change nothing. The volume tracker and
/// the Node cache still see every event: this filters only what wakes a
/// Machine.
#[derive(Default)]
struct NodeChanges {
    seen: HashMap<String, u64>,
}

impl NodeChanges {
    fn wakes(&mut self, ev: &watcher::Event<Node>) -> bool {
        match ev {
            watcher::Event::Apply(n) | watcher::Event::InitApply(n) => {
                let name = n.name_any();
                let hash = node_relevance(n);
                self.seen.insert(name, hash) != Some(hash)
            }
            watcher::Event::Delete(n) => {
                self.seen.remove(&n.name_any());
                true
            }
            watcher::Event::Init | watcher::Event::InitDone => true,
        }
    }
}

/// A hash of what about a Node a Machine's decisions read: deletion,
/// providerID, cordon and taints, each condition's type, status and reason,
/// and the volumes attached and in use. Heartbeat and transition times are
/// left out.
fn node_relevance(node: &Node) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| t.0.to_string())
        .hash(&mut h);
    if let Some(spec) = &node.spec {
        spec.provider_id.hash(&mut h);
        spec.unschedulable.hash(&mut h);
        for t in spec.taints.iter().flatten() {
            (&t.key, &t.value, &t.effect).hash(&mut h);
        }
    }
    if let Some(status) = &node.status {
        for c in status.conditions.iter().flatten() {
            (&c.type_, &c.status, &c.reason).hash(&mut h);
        }
        for v in status.volumes_attached.iter().flatten() {
            v.name.hash(&mut h);
        }
        status.volumes_in_use.hash(&mut h);
    }
    h.finish()
}

fn error_policy(machine: Arc<Machine>, error: &Error, ctx: Arc<Context>) -> Action {
    let delay = ctx.backoff.next(&machine);
    if matches!(error, Error::Provider { .. }) {
        ctx.provider_retry_after(&machine, delay);
    }
    tracing::warn!(
        machine = %machine.name_any(),
        namespace = machine.namespace().unwrap_or_default(),
        error = %error,
        kind = error.metric_label(),
        retry_in = ?delay,
        "reconcile failed"
    );
    Action::requeue(delay)
}

impl Context {
    /// The provider is not to be asked about `m` again before `delay`.
    pub(crate) fn provider_retry_after(&self, m: &Machine, delay: Duration) {
        if let Ok(mut map) = self.provider_retry.lock() {
            map.insert(ObjectRef::from_obj(m), tokio::time::Instant::now() + delay);
        }
    }

    /// How long until the provider may be asked about `m` again, if a
    /// retry is still due.
    pub(crate) fn provider_retry_in(&self, m: &Machine) -> Option<Duration> {
        let key = ObjectRef::from_obj(m);
        let mut map = self.provider_retry.lock().ok()?;
        let at = *map.get(&key)?;
        let left = at.checked_duration_since(tokio::time::Instant::now());
        if left.is_none_or(|d| d.is_zero()) {
            map.remove(&key);
        }
        left.filter(|d| !d.is_zero())
    }

    /// The provider answered: no retry is due any more.
    pub(crate) fn provider_answered(&self, m: &Machine) {
        if let Ok(mut map) = self.provider_retry.lock() {
            map.remove(&ObjectRef::from_obj(m));
        }
    }

    fn reset_backoff(&self, m: &Machine) {
        self.backoff.reset(m);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(ready: &str, heartbeat: &str, unschedulable: bool) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1"},
            "spec": {"providerID": "fake://n1", "unschedulable": unschedulable},
            "status": {"conditions": [{
                "type": "Ready", "status": ready, "reason": "KubeletReady",
                "lastHeartbeatTime": heartbeat, "lastTransitionTime": heartbeat
            }]}
        }))
        .expect("node")
    }

    #[test]
    fn a_heartbeat_wakes_nothing_but_a_change_does() {
        let mut changes = NodeChanges::default();
        let at = |t: &str| format!("2026-11-21T06:00:{t}Z");
        assert!(changes.wakes(&watcher::Event::InitApply(node("True", &at("00"), false))));
        assert!(changes.wakes(&watcher::Event::InitDone));
        assert!(
            !changes.wakes(&watcher::Event::Apply(node("True", &at("20"), false))),
            "only the heartbeat moved"
        );
        assert!(changes.wakes(&watcher::Event::Apply(node("False", &at("40"), false))));
        assert!(!changes.wakes(&watcher::Event::Apply(node("False", &at("50"), false))));
        assert!(
            changes.wakes(&watcher::Event::Apply(node("False", &at("55"), true))),
            "cordoned"
        );
        let gone = node("False", &at("59"), true);
        assert!(
            changes.wakes(&watcher::Event::Delete(gone.clone())),
            "a deletion always wakes"
        );
        assert!(
            changes.wakes(&watcher::Event::Apply(gone)),
            "and a Node that comes back is new"
        );
    }

    fn machine(
        name: &str,
        node: Option<&str>,
        provider_id: Option<&str>,
        deleting: bool,
    ) -> Machine {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "berth.dev/v1alpha1", "kind": "Machine",
            "metadata": {
                "name": name, "namespace": "ns",
                "deletionTimestamp": deleting.then_some("2026-11-21T06:00:00Z"),
            },
            "spec": {"classRef": {"name": "c"}, "providerID": provider_id},
            "status": {"nodeRef": node.map(|n| serde_json::json!({"name": n}))},
        }))
        .expect("machine")
    }

    fn names(mut refs: Vec<ObjectRef<Machine>>) -> Vec<String> {
        refs.sort_by(|a, b| a.name.cmp(&b.name));
        refs.into_iter().map(|r| r.name).collect()
    }

    #[test]
    fn node_pod_and_attachment_events_find_their_machines_by_node() {
        let mut writer = reflector::store::Writer::<Machine>::default();
        let store = writer.as_reader();
        let index = MachinesByNode::default();
        let mut feed = |ev: watcher::Event<Machine>| {
            writer.apply_watcher_event(&ev);
            index.observe(&ev);
        };
        feed(watcher::Event::Init);
        feed(watcher::Event::InitApply(machine(
            "m1",
            Some("n1"),
            Some("fake://n1"),
            true,
        )));
        feed(watcher::Event::InitApply(machine(
            "m2",
            Some("n1"),
            None,
            false,
        )));
        feed(watcher::Event::InitApply(machine(
            "m3",
            None,
            Some("fake://n2"),
            false,
        )));
        feed(watcher::Event::InitDone);

        // A Node event: by nodeRef, and by providerID for a new Node.
        assert_eq!(names(index.of_node("n1", None)), ["m1", "m2"]);
        assert_eq!(names(index.of_node("n2", Some("fake://n2"))), ["m3"]);
        assert_eq!(names(index.of_node("n1", Some("fake://n1"))), ["m1", "m2"]);
        assert!(index.of_node("n9", None).is_empty());
        // Pod and VolumeAttachment events wake only Machines being deleted.
        assert_eq!(names(index.deleting_of_node(&store, "n1")), ["m1"]);
        assert!(index.deleting_of_node(&store, "n2").is_empty());

        // A Machine whose Node changes moves in the index; a deleted one goes.
        feed(watcher::Event::Apply(machine("m2", Some("n3"), None, true)));
        assert_eq!(names(index.of_node("n1", None)), ["m1"]);
        assert_eq!(names(index.deleting_of_node(&store, "n3")), ["m2"]);
        feed(watcher::Event::Delete(machine(
            "m1",
            Some("n1"),
            Some("fake://n1"),
            true,
        )));
        assert!(index.deleting_of_node(&store, "n1").is_empty());
        assert!(index.of_node("n1", Some("fake://n1")).is_empty());
    }

    #[test]
    fn attached_volumes_are_relevant() {
        let before = node("True", "2026-11-21T06:00:00Z", true);
        let mut after = before.clone();
        after.status.as_mut().expect("status").volumes_attached = Some(vec![
            serde_json::from_value(
                serde_json::json!({"name": "kubernetes.io/csi/d^h", "devicePath": ""}),
            )
            .expect("volume"),
        ]);
        assert_ne!(node_relevance(&before), node_relevance(&after));
    }
}
