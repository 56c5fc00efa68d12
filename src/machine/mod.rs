//! The Machine reconciler: creation, health, and the ordered, resumable
//! deletion of a Machine.
//!
//! It watches Machines and, through shared caches, the objects its decisions
//! depend on: MachineClasses, Nodes, Pods and VolumeAttachments. An event on
//! any of them wakes the Machines it concerns, so no step polls the API
//! server; the only timers are deadlines (creation timeout, health timeout,
//! a provider's "ask again in N seconds").
//!
//! `crate::wiring::manager` starts it, with the MachineSet and
//! MachineDeployment controllers, on caches they share.
//!
//! `decide` chooses the next step from facts, `record` what a step records,
//! `status` folds that into the status, `write` writes it without undoing a
//! newer write. `reconcile` is the entry: `creation` and `deletion` (with
//! its last step, the VM, the volumes left and the Node, in
//! `deletion::termination`) observe, act and record (through `commit`,
//! which also says where a reconcile leaves the Machine), each step in a
//! function of its own; `lookup` finds the class, driver, settings and
//! Node they act on, `node` holds every write to a Node, and `error` says
//! which call a failed reconcile failed at.

mod commit;
mod creation;
pub(crate) mod decide;
mod deletion;
mod error;
pub(crate) mod health;
mod lifecycle;
mod lookup;
pub(crate) mod node;
mod reconcile;
pub(crate) mod record;
mod remediation;
pub(crate) mod status;
pub mod write;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};

use crate::api::{Machine, MachineClass};
use crate::cache::Caches;
use crate::controller::AbortOnDrop;
use crate::drain::engine::Drainer;
use crate::providers::Registry;
use crate::telemetry::Metrics;
use crate::telemetry::events::EventSink;

use error::Error;

pub(crate) struct Context {
    pub(crate) client: Client,
    pub(crate) providers: Registry,
    pub(crate) events: EventSink,
    pub(crate) caches: Caches,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) drainer: Drainer,
    /// Every auxiliary cache has synced; reconciles act only after that.
    pub(crate) synced: std::sync::atomic::AtomicBool,
    /// Per-Machine exponential backoff for transient errors, reset by a
    /// successful reconcile.
    backoff: crate::controller::Backoffs<Machine>,
    /// When the provider may next be asked for a Machine's VM, after it
    /// failed or asked to be asked later. The reconcile's own status writes
    /// wake it at once; without this, each failure's record would start the
    /// next attempt, and the backoff would never apply.
    provider_retry: Mutex<HashMap<ObjectRef<Machine>, tokio::time::Instant>>,
    /// Since when the provider has answered "not found" for a deleted
    /// Machine's VM, by Machine; cleared by any other answer. Kept in
    /// memory: a restart starts the wait again, which only delays.
    vm_not_found: Mutex<HashMap<ObjectRef<Machine>, tokio::time::Instant>>,
    /// How long that may last before the VM counts as gone.
    pub(crate) vm_not_found_grace: std::time::Duration,
    /// The UIDs of Machines whose hand-written providerID the provider
    /// said is theirs (see `lookup::vm_owner`): a VM's tags do not change,
    /// so each deletion asks once, not at every step. Forgotten when the
    /// deletion ends; a restart asks again.
    vm_owned: Mutex<HashSet<String>>,
    /// The cluster's bound on unhealthy Machines for remediation.
    pub(crate) max_unhealthy: crate::api::remediation::MaxUnhealthy,
    /// Machines whose remediation waits on others: held by a
    /// `maxUnhealthy` (woken when another Machine's Node is healthy again
    /// or a Machine goes), or for the move ledger (woken when permits
    /// change).
    remediation_waits: Mutex<HashSet<ObjectRef<Machine>>>,
}

/// The watches that wake the Machine controller
/// (`crate::wiring::watches` builds them).
pub(crate) struct Feeds {
    /// Every Machine (the controller's own watch).
    pub(crate) machines: BoxStream<'static, Result<Machine, watcher::Error>>,
    pub(crate) classes: BoxStream<'static, Result<MachineClass, watcher::Error>>,
    /// Only the Node events that can change a decision.
    pub(crate) nodes: BoxStream<'static, Result<Node, watcher::Error>>,
    pub(crate) pods: BoxStream<'static, Result<Pod, watcher::Error>>,
    pub(crate) attachments: BoxStream<'static, Result<VolumeAttachment, watcher::Error>>,
}

impl Context {
    pub(crate) fn new(
        client: Client,
        providers: Registry,
        events: EventSink,
        caches: Caches,
        metrics: Arc<Metrics>,
        drainer: Drainer,
        vm_not_found_grace: std::time::Duration,
    ) -> Self {
        Self {
            vm_not_found: Mutex::new(HashMap::new()),
            vm_not_found_grace,
            vm_owned: Mutex::new(HashSet::new()),
            max_unhealthy: crate::api::remediation::MaxUnhealthy::Percent(40),
            remediation_waits: Mutex::new(HashSet::new()),
            client,
            providers,
            events,
            caches,
            metrics,
            drainer,
            synced: std::sync::atomic::AtomicBool::new(false),
            backoff: crate::controller::Backoffs::default(),
            provider_retry: Mutex::new(HashMap::new()),
        }
    }
}

/// Runs the Machine controller until `shutdown` resolves, woken by `feeds`
/// and by the drains that end (`drains_done`). It acts once every cache
/// has synced. Provider calls, reconciles and Machine phases are recorded
/// in the context's metrics.
pub(crate) async fn run(
    ctx: Arc<Context>,
    feeds: Feeds,
    drains_done: tokio::sync::mpsc::UnboundedReceiver<ObjectRef<Machine>>,
    concurrency: u16,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let caches = ctx.caches.clone();
    let Feeds {
        machines,
        classes,
        nodes,
        pods,
        attachments,
    } = feeds;
    let (by_class, by_node, by_pod, by_va) = (
        caches.machines.clone(),
        caches.machines_by_node.clone(),
        caches.clone(),
        caches.clone(),
    );
    let controller = Controller::for_stream(machines, caches.machines.clone())
        .with_config(kube::runtime::controller::Config::default().concurrency(concurrency))
        .watches_stream(classes, move |class: MachineClass| {
            let name = class.name_any();
            by_class
                .state()
                .into_iter()
                .filter(|m| m.spec.class_ref.name == name)
                .map(|m| ObjectRef::from_obj(&*m))
                .collect::<Vec<_>>()
        })
        .watches_stream(nodes, move |node: Node| {
            by_node.of_node(
                &node.name_any(),
                node.spec.as_ref().and_then(|s| s.provider_id.as_deref()),
            )
        })
        // Pods and VolumeAttachments matter only to a Machine being
        // deleted (its drain and its wait for detach): a Running Machine
        // is not woken by the churn of its Node's pods.
        .watches_stream(pods, move |pod: Pod| {
            match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
                Some(node) => by_pod
                    .machines_by_node
                    .deleting_of_node(&by_pod.machines, node),
                None => Vec::new(),
            }
        })
        .watches_stream(attachments, move |va: VolumeAttachment| {
            by_va
                .machines_by_node
                .deleting_of_node(&by_va.machines, &va.spec.node_name)
        })
        .reconcile_on(futures::stream::unfold(drains_done, |mut rx| async move {
            rx.recv().await.map(|m| (m, rx))
        }));

    let readiness = {
        let ctx = Arc::clone(&ctx);
        async move {
            let mut synced = ctx.caches.synced.clone();
            if synced.wait_for(|s| *s).await.is_err() {
                return;
            }
            ctx.synced.store(true, std::sync::atomic::Ordering::Release);
            // Machines seen before the sync did nothing: look at them again.
            for m in ctx.caches.machines.state() {
                ctx.drainer.wake(ObjectRef::from_obj(&*m));
            }
        }
    };
    let readiness = AbortOnDrop(tokio::spawn(readiness));
    // A Machine that left the cache while its drain ran (its finalizer
    // removed by hand): its drain stops at once.
    let vanished = {
        let ctx = Arc::clone(&ctx);
        let mut gone = ctx.caches.machines_gone.clone();
        async move {
            while gone.changed().await.is_ok() {
                ctx.drainer.stop_vanished();
            }
        }
    };
    let vanished = AbortOnDrop(tokio::spawn(vanished));
    // The permits of moves whose drain ended or whose Machine went: kept
    // until their workload is whole or their healthy deadline.
    let keeper = {
        let ctx = Arc::clone(&ctx);
        async move { ctx.drainer.keep_permits().await }
    };
    let keeper = AbortOnDrop(tokio::spawn(keeper));
    // This scope's asks parked in line, kept in the API server.
    let line = {
        let ctx = Arc::clone(&ctx);
        async move { ctx.drainer.keep_line().await }
    };
    let line = AbortOnDrop(tokio::spawn(line));
    let remediations = AbortOnDrop(tokio::spawn(wake_remediations(Arc::clone(&ctx))));

    let metrics = Arc::clone(&ctx.metrics);
    crate::controller::skeleton::run(
        controller,
        reconcile::reconcile,
        Arc::clone(&ctx),
        shutdown,
        // Every reconcile may have moved a phase: recount from the cache.
        || status::Gauges::count(caches.machines.state().iter().map(|m| &**m)).publish(&metrics),
    )
    .await;
    drop(readiness);
    drop(vanished);
    drop(keeper);
    drop(line);
    drop(remediations);
    // Drains stop at a resumable point: the next leader re-plans from the
    // cluster's state.
    ctx.drainer.stop_all();
}

/// Wakes the Machines whose remediation waits when what they wait on may
/// have changed: a move permit freed (here, or as another process's line
/// says), a permit changed, or a Machine gone (which the Machine watch
/// alone does not tell the others).
async fn wake_remediations(ctx: Arc<Context>) {
    let mut freed = ctx.drainer.permits_freed();
    let mut permits = ctx.caches.permit_changes.clone();
    let mut gone = ctx.caches.machines_gone.clone();
    loop {
        tokio::select! {
            r = freed.changed() => if r.is_err() { return },
            r = permits.changed() => if r.is_err() { return },
            r = gone.changed() => if r.is_err() { return },
        }
        ctx.wake_remediations();
    }
}

impl crate::controller::Reconciler for Context {
    type Object = Machine;
    type Error = Error;
    const KIND: &'static str = "Machine";

    fn backoff(&self) -> &crate::controller::Backoffs<Machine> {
        &self.backoff
    }

    /// A provider that failed is not asked again for this Machine before
    /// the retry: the reconcile's own status write would otherwise wake it
    /// at once.
    fn failed(&self, machine: &Machine, error: &Error, delay: Duration) {
        if matches!(error, Error::Provider { .. }) {
            self.provider_retry_after(machine, delay);
        }
    }

    fn class(error: &Error) -> &'static str {
        error.metric_label()
    }
}

impl Context {
    /// The cluster's bound on unhealthy Machines for remediation.
    pub(crate) fn with_max_unhealthy(mut self, max: crate::api::remediation::MaxUnhealthy) -> Self {
        self.max_unhealthy = max;
        self
    }

    /// `m`'s remediation waits on other Machines or on the move ledger
    /// (`waits`), or no longer does.
    pub(crate) fn remediation_waits(&self, m: &Machine, waits: bool) {
        if let Ok(mut set) = self.remediation_waits.lock() {
            if waits {
                set.insert(ObjectRef::from_obj(m));
            } else {
                set.remove(&ObjectRef::from_obj(m));
            }
        }
    }

    /// Wakes every Machine whose remediation waits.
    pub(crate) fn wake_remediations(&self) {
        let waiting: Vec<_> = self
            .remediation_waits
            .lock()
            .map(|set| set.iter().cloned().collect())
            .unwrap_or_default();
        for m in waiting {
            self.drainer.wake(m);
        }
    }

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

    /// The provider does not find `m`'s VM: how long it has not, counted
    /// from the first such answer since any other.
    pub(crate) fn vm_not_found_for(&self, m: &Machine) -> std::time::Duration {
        self.vm_not_found
            .lock()
            .map(|mut map| {
                map.entry(ObjectRef::from_obj(m))
                    .or_insert_with(tokio::time::Instant::now)
                    .elapsed()
            })
            .unwrap_or_default()
    }

    /// The provider answered anything but "not found" for `m`'s VM (or the
    /// wait is over).
    pub(crate) fn vm_not_found_cleared(&self, m: &Machine) {
        if let Ok(mut map) = self.vm_not_found.lock() {
            map.remove(&ObjectRef::from_obj(m));
        }
    }

    /// Whether the provider said `m`'s VM is `m`'s during this deletion.
    pub(crate) fn vm_owned(&self, m: &Machine) -> bool {
        let uid = m.metadata.uid.as_deref().unwrap_or_default();
        self.vm_owned.lock().is_ok_and(|set| set.contains(uid))
    }

    /// Remembers that the provider said `m`'s VM is `m`'s (`owned`), or
    /// forgets it, the deletion over.
    pub(crate) fn set_vm_owned(&self, m: &Machine, owned: bool) {
        let uid = m.metadata.uid.clone().unwrap_or_default();
        if let Ok(mut set) = self.vm_owned.lock() {
            if owned {
                set.insert(uid);
            } else {
                set.remove(&uid);
            }
        }
    }

    fn reset_backoff(&self, m: &Machine) {
        self.backoff.reset(m);
    }
}
