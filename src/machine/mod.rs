//! The Machine reconciler: creation, health, and the ordered, resumable
//! deletion of a Machine.
//!
//! It watches Machines and, through shared caches, the objects its decisions
//! depend on: MachineClasses, Nodes, Pods and VolumeAttachments. An event on
//! any of them wakes the Machines it concerns, so no step polls the API
//! server; the only timers are deadlines (creation timeout, health timeout,
//! a provider's "ask again in N seconds").
//!
//! `decide` chooses the next step from facts, `status` computes the status
//! to record, and `reconcile` observes, acts and records.

pub mod decide;
mod reconcile;
pub mod status;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

use crate::api::{Machine, MachineClass};
use crate::providers::Registry;
use crate::telemetry::Metrics;

pub use reconcile::Error;

/// The caches the reconciler reads instead of the API server.
#[derive(Clone)]
pub struct Stores {
    pub machines: Store<Machine>,
    pub classes: Store<MachineClass>,
    pub nodes: Store<Node>,
    pub pods: Store<Pod>,
    pub attachments: Store<VolumeAttachment>,
}

pub struct Context {
    pub client: Client,
    pub providers: Registry,
    pub recorder: Recorder,
    pub stores: Stores,
    pub metrics: Arc<Metrics>,
    /// Per-Machine exponential backoff for transient errors, reset by a
    /// successful reconcile.
    backoff: Mutex<HashMap<ObjectRef<Machine>, backon::ExponentialBackoff>>,
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
}

/// Runs the Machine controller until `shutdown` resolves. `ready` is called
/// once every cache has synced. Provider calls, reconciles and Machine
/// phases are recorded in `metrics`.
pub async fn run(
    client: Client,
    providers: Registry,
    settings: Settings,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
    ready: impl FnOnce() + Send + 'static,
) {
    let machines_api: Api<Machine> = match &settings.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let wc = watcher::Config::default();

    let (classes, classes_w) = reflector::store();
    let class_events = reflector::reflector(
        classes_w,
        watcher(Api::<MachineClass>::all(client.clone()), wc.clone()),
    )
    .default_backoff()
    .touched_objects();
    let (nodes, nodes_w) = reflector::store();
    let node_events = reflector::reflector(
        nodes_w,
        watcher(Api::<Node>::all(client.clone()), wc.clone()),
    )
    .default_backoff()
    .touched_objects();
    let (pods, pods_w) = reflector::store();
    let pod_events =
        reflector::reflector(pods_w, watcher(Api::<Pod>::all(client.clone()), wc.clone()))
            .default_backoff()
            .touched_objects();
    let (attachments, vas_w) = reflector::store();
    let va_events = reflector::reflector(
        vas_w,
        watcher(Api::<VolumeAttachment>::all(client.clone()), wc.clone()),
    )
    .default_backoff()
    .touched_objects();

    let controller = Controller::new(machines_api, wc).with_config(
        kube::runtime::controller::Config::default().concurrency(settings.concurrency),
    );
    let machines = controller.store();
    let stores = Stores {
        machines: machines.clone(),
        classes: classes.clone(),
        nodes: nodes.clone(),
        pods: pods.clone(),
        attachments: attachments.clone(),
    };

    let by_class = machines.clone();
    let by_node = machines.clone();
    let by_pod = machines.clone();
    let by_va = machines.clone();
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
            machines_of_node(
                &by_node,
                &node.name_any(),
                node.spec.as_ref().and_then(|s| s.provider_id.as_deref()),
            )
        })
        .watches_stream(pod_events, move |pod: Pod| {
            match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
                Some(node) => machines_of_node(&by_pod, node, None),
                None => Vec::new(),
            }
        })
        .watches_stream(va_events, move |va: VolumeAttachment| {
            machines_of_node(&by_va, &va.spec.node_name, None)
        });

    let providers = providers.instrumented(&metrics);
    let ctx = Arc::new(Context {
        client: client.clone(),
        providers,
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "berth".into(),
                instance: Some(settings.instance.clone()),
            },
        ),
        stores: stores.clone(),
        metrics: Arc::clone(&metrics),
        backoff: Mutex::new(HashMap::new()),
    });

    let readiness = {
        let stores = stores.clone();
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
            );
            ready();
        }
    };
    tokio::spawn(readiness);

    controller
        .graceful_shutdown_on(shutdown)
        .run(reconcile::reconcile, error_policy, ctx)
        .for_each(|result| {
            match result {
                Ok((obj, _)) => tracing::debug!(machine = %obj, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "reconcile failed"),
            }
            // Every reconcile may have moved a phase: recount from the cache.
            let gauges = status::Gauges::count(machines.state().iter().map(|m| &**m));
            gauges.publish(&metrics);
            futures::future::ready(())
        })
        .await;
}

/// The Machines whose Node this is: by `status.nodeRef`, or by providerID
/// for a Node that has just registered.
fn machines_of_node(
    machines: &Store<Machine>,
    node: &str,
    provider_id: Option<&str>,
) -> Vec<ObjectRef<Machine>> {
    machines
        .state()
        .into_iter()
        .filter(|m| {
            let by_ref = m
                .status
                .as_ref()
                .and_then(|s| s.node_ref.as_ref())
                .is_some_and(|r| r.name == node);
            let by_id = provider_id.is_some() && m.spec.provider_id.as_deref() == provider_id;
            by_ref || by_id
        })
        .map(|m| ObjectRef::from_obj(&*m))
        .collect()
}

fn error_policy(machine: Arc<Machine>, error: &Error, ctx: Arc<Context>) -> Action {
    let key = ObjectRef::from_obj(&*machine);
    let delay = ctx
        .backoff
        .lock()
        .ok()
        .and_then(|mut map| map.entry(key).or_insert_with(new_backoff).next())
        .unwrap_or(Duration::from_secs(300));
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

fn new_backoff() -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(300))
        .with_jitter()
        .without_max_times()
        .build()
}

impl Context {
    fn reset_backoff(&self, m: &Machine) {
        if let Ok(mut map) = self.backoff.lock() {
            map.remove(&ObjectRef::from_obj(m));
        }
    }
}
