//! The watches: one per kind the controllers read, each feeding its cache
//! ([`Caches`]), the indexes over it, the volume tracker, and the wake
//! streams that reach the controllers.
//!
//! A watch's stream is driven by the controller it wakes (kube's
//! `Controller` polls it), so every event reaches the store, the indexes and
//! the tracker before any reconcile it wakes; the watches that wake nothing
//! (PodDisruptionBudgets, claims, PersistentVolumes, CSIDrivers) run on a
//! task of their own. Pods and Nodes are trimmed as they arrive
//! (`crate::cache::trim`), so the caches hold what decisions read.

use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::api::{
    DrainRule, Machine, MachineClass, MachineDeployment, MachineSet, MoveAsk, MovePermit,
    controlling_set,
};
use crate::cache::machines::MachinesByNode;
use crate::cache::wakes::{NodeChanges, WakeStream, Wakes};
use crate::cache::{Caches, Index, Indexes, trim};
use crate::machine::Feeds;
use crate::telemetry::Metrics;
use crate::volumes::Tracker;

/// What the watches feed: the caches, the volume tracker, and the streams
/// each controller is woken by.
pub(crate) struct Watches {
    pub(crate) caches: Caches,
    pub(crate) tracker: Tracker,
    /// The Machine controller's.
    pub(crate) machine: Feeds,
    /// The MachineSet watch, which fills `caches.sets`.
    pub(crate) sets: BoxStream<'static, Result<MachineSet, watcher::Error>>,
    /// The sets to reconcile because one of their Machines (or its Node)
    /// changed.
    pub(crate) set_wakes: WakeStream<MachineSet>,
    /// The deployments to reconcile because one of their sets or Machines
    /// changed.
    pub(crate) deployment_wakes: WakeStream<MachineDeployment>,
    /// The DrainRule watch, which fills `caches.drain_rules` and feeds the
    /// rules' status (see [`crate::drainrule`]).
    pub(crate) drain_rules: Objects<DrainRule>,
    /// The watches that wake nothing, and the sync signal.
    pub(crate) background: BoxStream<'static, ()>,
}

/// An API of every namespace, or of `namespace` only.
fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// A watch of every `K` whose store fills on its own task (nothing is
/// woken by it).
fn quiet<K>(
    writer: reflector::store::Writer<K>,
    api: Api<K>,
    trim: fn(&mut K),
) -> impl futures::Stream<Item = ()> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
{
    observed(writer, api, trim, |_| {}).map(|_| ())
}

/// A boxed stream of one kind's objects, as a controller is woken by.
type Objects<K> = BoxStream<'static, Result<K, watcher::Error>>;

/// Starts nothing: builds every watch for `client` (Machines and
/// MachineSets in `namespace` only, if given), to be driven by the
/// controllers and by [`Watches::background`].
pub(crate) fn watches(client: &Client, namespace: Option<&str>, metrics: &Metrics) -> Watches {
    let (sets, sets_w) = reflector::store::<MachineSet>();
    let (wakes, set_wakes, deployment_wakes) = Wakes::new(sets.clone());
    let (machines, machines_w) = reflector::store();
    let (nodes, nodes_w) = reflector::store();
    let (attachments, vas_w) = reflector::store();
    let (pods, pods_w) = reflector::store();
    let (classes, classes_w) = reflector::store();
    let (pdbs, pdbs_w) = reflector::store();
    let (pvcs, pvcs_w) = reflector::store();
    let (pvs, pvs_w) = reflector::store();
    // CSIDrivers say which drivers attach (the drain's volume classes): the
    // sync waits for them, else attach-free CSI volumes look attachable.
    let (csi_drivers, csi_drivers_w) = reflector::store();
    // CSINodes: where a moving pod's volumes can attach.
    let (csi_nodes, csi_nodes_w) = reflector::store();
    let (placement_tx, placement_changes) = tokio::sync::watch::channel(0u64);
    // A ReplicaSet's metadata says whose Deployment (the ledger's workload).
    let (replica_sets, replica_sets_w) = reflector::store();
    // A workload object's annotations and minReadySeconds say how its pods
    // move; a StatefulSet's replicas whether an evicted pod comes back.
    let (stateful_sets, stateful_sets_w) = reflector::store();
    let (deployments, deployments_w) = reflector::store();
    let (pod_changes_tx, pod_changes) = tokio::sync::watch::channel(0u64);
    let (pdb_changes_tx, pdb_changes) = tokio::sync::watch::channel(0u64);
    let (workload_changes_tx, workload_changes) = tokio::sync::watch::channel(0u64);
    let (attachment_changes_tx, attachment_changes) = tokio::sync::watch::channel(0u64);
    // The move ledger's permits and asks in line, of every process.
    let (permit_changes_tx, permit_changes) = tokio::sync::watch::channel(0u64);
    let (move_permits, move_permits_w) = reflector::store();
    let (ask_changes_tx, ask_changes) = tokio::sync::watch::channel(0u64);
    let (move_asks, move_asks_w) = reflector::store();
    let (drain_rules, namespaces, drain_rule_feed, namespace_feed) = rule_watches(client);
    let (listed_tx, machines_listed) = tokio::sync::watch::channel(false);
    let (gone_tx, machines_gone) = tokio::sync::watch::channel(0u64);
    let (synced_tx, synced) = tokio::sync::watch::channel(false);
    let caches = Caches {
        machines,
        classes,
        sets,
        nodes,
        pods,
        attachments,
        pvcs,
        pvs,
        pdbs,
        csi_drivers,
        csi_nodes,
        replica_sets,
        stateful_sets,
        deployments,
        move_permits,
        move_asks,
        drain_rules,
        namespaces,
        indexes: Indexes::default(),
        machines_by_node: MachinesByNode::default(),
        machines_by_set: Index::new(controlling_set),
        pod_changes,
        pdb_changes,
        workload_changes,
        attachment_changes,
        placement_changes,
        permit_changes,
        ask_changes,
        machines_gone,
        machines_listed,
        synced,
    };
    let tracker = tracker(&caches, metrics);
    let placement = placement_tx.clone();
    let machine = Feeds {
        machines: machine_watch(
            machines_w,
            api(client, namespace),
            &caches,
            &wakes,
            listed_tx,
            gone_tx,
        ),
        classes: class_watch(classes_w, client, &wakes),
        nodes: node_watch(nodes_w, client, (&caches, &tracker, &wakes), placement),
        pods: pod_watch(pods_w, Api::all(client.clone()), &caches, pod_changes_tx),
        attachments: attachment_watch(
            vas_w,
            Api::all(client.clone()),
            &caches,
            &tracker,
            attachment_changes_tx,
        ),
    };
    let sets = set_watch(sets_w, api(client, namespace), &wakes);
    let background = futures::stream::select_all([
        counted(pdbs_w, client, trim::metadata, pdb_changes_tx),
        quiet(pvcs_w, Api::all(client.clone()), trim::metadata).boxed(),
        quiet(pvs_w, Api::all(client.clone()), trim::metadata).boxed(),
        quiet(csi_drivers_w, Api::all(client.clone()), trim::csi_driver).boxed(),
        namespace_feed,
        counted(csi_nodes_w, client, trim::metadata, placement_tx),
        workloads(
            client,
            (replica_sets_w, stateful_sets_w, deployments_w),
            workload_changes_tx,
            (move_permits_w, permit_changes_tx),
            (move_asks_w, ask_changes_tx),
        ),
        sync(caches.clone(), synced_tx).into_stream().boxed(),
    ])
    .boxed();
    Watches {
        caches,
        tracker,
        machine,
        sets,
        set_wakes,
        deployment_wakes,
        drain_rules: drain_rule_feed,
        background,
    }
}

/// The cluster's drain rules, whose watch feeds their status (see
/// [`crate::drainrule`]), and the namespaces, whose labels the rules
/// select by (a watch that wakes nothing): their stores and their watches.
fn rule_watches(
    client: &Client,
) -> (
    Store<DrainRule>,
    Store<Namespace>,
    Objects<DrainRule>,
    BoxStream<'static, ()>,
) {
    let (rules, rules_w) = reflector::store();
    let (namespaces, namespaces_w) = reflector::store();
    (
        rules,
        namespaces,
        woken_by(rules_w, Api::all(client.clone()), trim::metadata).boxed(),
        quiet(namespaces_w, Api::all(client.clone()), trim::metadata).boxed(),
    )
}

/// The volume tracker over the caches: Nodes and VolumeAttachments feed
/// it, with the raw watch events (re-lists included) once the store has
/// applied them.
fn tracker(caches: &Caches, metrics: &Metrics) -> Tracker {
    Tracker::new(
        caches.attachments.clone(),
        caches.indexes.attachments_by_pv.clone(),
        caches.nodes.clone(),
        crate::volumes::DEFAULT_CHANNEL_CAPACITY,
        Some(metrics),
    )
}

/// [`quiet`], each event bumping `changes` once the store applied it.
fn counted<K>(
    writer: reflector::store::Writer<K>,
    client: &Client,
    trim: fn(&mut K),
    changes: tokio::sync::watch::Sender<u64>,
) -> BoxStream<'static, ()>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
{
    quiet(writer, Api::all(client.clone()), trim)
        .inspect(move |_| changes.send_modify(|n| *n = n.wrapping_add(1)))
        .boxed()
}

/// The MachineSet watch, which wakes the sets' controller and the
/// deployments of the sets it changes.
fn set_watch(
    writer: reflector::store::Writer<MachineSet>,
    api: Api<MachineSet>,
    wakes: &Wakes,
) -> Objects<MachineSet> {
    let wakes = wakes.clone();
    reflector::reflector(writer, watcher(api, watcher::Config::default()))
        .inspect(move |ev| {
            if let Ok(ev) = ev {
                wakes.set_event(ev);
            }
        })
        .applied_objects()
        .boxed()
}

/// The watches the move ledger reads: ReplicaSets' metadata (whose
/// Deployment a pod's ReplicaSet is), StatefulSets and Deployments (their
/// budgets, `minReadySeconds`, wanted and available replicas; each event
/// bumps `changes`), and the permits in the API server (each event bumps
/// their own signal).
fn workloads(
    client: &Client,
    (replica_sets, stateful_sets, deployments): (
        reflector::store::Writer<PartialObjectMeta<ReplicaSet>>,
        reflector::store::Writer<StatefulSet>,
        reflector::store::Writer<Deployment>,
    ),
    changes: tokio::sync::watch::Sender<u64>,
    (permits, permit_changes): (
        reflector::store::Writer<MovePermit>,
        tokio::sync::watch::Sender<u64>,
    ),
    (asks, ask_changes): (
        reflector::store::Writer<MoveAsk>,
        tokio::sync::watch::Sender<u64>,
    ),
) -> BoxStream<'static, ()> {
    let changes = std::sync::Arc::new(changes);
    let bump = move || {
        let changes = std::sync::Arc::clone(&changes);
        move |_: &()| changes.send_modify(|n| *n = n.wrapping_add(1))
    };
    futures::stream::select_all([
        quiet(stateful_sets, Api::all(client.clone()), trim::stateful_set)
            .inspect(bump())
            .boxed(),
        quiet(deployments, Api::all(client.clone()), trim::deployment)
            .inspect(bump())
            .boxed(),
        quiet(permits, Api::all(client.clone()), trim::metadata)
            .inspect(move |_| permit_changes.send_modify(|n| *n = n.wrapping_add(1)))
            .boxed(),
        quiet(asks, Api::all(client.clone()), trim::metadata)
            .inspect(move |_| ask_changes.send_modify(|n| *n = n.wrapping_add(1)))
            .boxed(),
        reflector::reflector(
            replica_sets,
            watcher(
                Api::<PartialObjectMeta<ReplicaSet>>::all(client.clone()),
                watcher::Config::default(),
            )
            .modify(|rs| rs.metadata.managed_fields = None),
        )
        .default_backoff()
        .map(|_| ())
        .boxed(),
    ])
    .boxed()
}

/// The MachineClasses, which wake the Machines of each (the Machine
/// controller's feed) and the deployments made from each: a class edited in
/// place rolls its pools.
fn class_watch(
    writer: reflector::store::Writer<MachineClass>,
    client: &Client,
    wakes: &Wakes,
) -> Objects<MachineClass> {
    let wakes = wakes.clone();
    woken_by(writer, Api::all(client.clone()), trim::metadata)
        .inspect(move |c| {
            if let Ok(c) = c {
                wakes.class(c);
            }
        })
        .boxed()
}

/// A watch whose objects wake a controller, trimmed as they arrive.
fn woken_by<K>(
    writer: reflector::store::Writer<K>,
    api: Api<K>,
    trim: fn(&mut K),
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
{
    observed(writer, api, trim, |_| {}).touched_objects()
}

/// A watch, trimmed as it arrives, whose every answer `observe` sees once
/// the store has applied it.
fn observed<K>(
    writer: reflector::store::Writer<K>,
    api: Api<K>,
    trim: fn(&mut K),
    observe: impl FnMut(&Result<watcher::Event<K>, watcher::Error>) + Send + 'static,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
{
    reflector::reflector(
        writer,
        watcher(api, watcher::Config::default()).modify(trim),
    )
    .inspect(observe)
    .default_backoff()
}

/// The Machine watch, as `Controller::new` runs it, plus the indexes of
/// Machines by Node and by MachineSet that it feeds and the sets it wakes.
fn machine_watch(
    writer: reflector::store::Writer<Machine>,
    api: Api<Machine>,
    caches: &Caches,
    wakes: &Wakes,
    listed: tokio::sync::watch::Sender<bool>,
    gone: tokio::sync::watch::Sender<u64>,
) -> Objects<Machine> {
    let (by_node, by_set, wakes) = (
        caches.machines_by_node.clone(),
        caches.machines_by_set.clone(),
        wakes.clone(),
    );
    reflector::reflector(writer, watcher(api, watcher::Config::default()))
        .inspect(move |ev| {
            if let Ok(ev) = ev {
                by_node.observe(ev);
                by_set.observe(ev);
                wakes.machine_event(ev);
                // The reflector has swapped the whole list into the store
                // (a Machine missing from a re-list is gone too).
                if matches!(ev, watcher::Event::InitDone) {
                    listed.send_if_modified(|l| !std::mem::replace(l, true));
                }
                if matches!(ev, watcher::Event::Delete(_) | watcher::Event::InitDone) {
                    gone.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
        })
        .applied_objects()
        .boxed()
}

/// The Node watch: every event feeds the index by providerID and the
/// volume tracker; only those that can change a decision wake a Machine,
/// and the sets of its Machines (a Node that turns Ready or NotReady
/// changes its set's counts).
fn node_watch(
    writer: reflector::store::Writer<Node>,
    client: &Client,
    (caches, tracker, wakes): (&Caches, &Tracker, &Wakes),
    placement: tokio::sync::watch::Sender<u64>,
) -> Objects<Node> {
    let (tracker, index) = (tracker.clone(), caches.indexes.clone());
    let (by_node, machines, wakes) = (
        caches.machines_by_node.clone(),
        caches.machines.clone(),
        wakes.clone(),
    );
    observed(writer, Api::all(client.clone()), trim::node, move |ev| {
        if let Ok(ev) = ev {
            index.observe_node(ev);
            tracker.observe_node_event(ev);
            placement.send_modify(|n| *n = n.wrapping_add(1));
        }
    })
    .filter({
        let mut changes = NodeChanges::default();
        move |ev| futures::future::ready(ev.as_ref().map_or(true, |ev| changes.wakes(ev)))
    })
    .touched_objects()
    .inspect(move |node| {
        if let Ok(node) = node {
            let provider_id = node.spec.as_ref().and_then(|s| s.provider_id.as_deref());
            for r in by_node.of_node(&node.name_any(), provider_id) {
                if let Some(m) = machines.get(&r) {
                    wakes.machine(&m);
                }
            }
        }
    })
    .boxed()
}

/// The VolumeAttachment watch, which feeds the index by PV and Node and
/// the volume tracker, and bumps `changes` (the moves no drain watches
/// any more end once their volumes are attached where they went).
fn attachment_watch(
    writer: reflector::store::Writer<VolumeAttachment>,
    api: Api<VolumeAttachment>,
    caches: &Caches,
    tracker: &Tracker,
    changes: tokio::sync::watch::Sender<u64>,
) -> Objects<VolumeAttachment> {
    let (tracker, index) = (tracker.clone(), caches.indexes.clone());
    observed(writer, api, trim::metadata, move |ev| {
        if let Ok(ev) = ev {
            index.observe_attachment(ev);
            tracker.observe_attachment_event(ev);
            changes.send_modify(|n| *n = n.wrapping_add(1));
        }
    })
    .touched_objects()
    .boxed()
}

/// The pod watch: it feeds the indexes by Node and by claim, and bumps
/// `changes`, which the drain's waits watch (a waiter re-reads the store
/// after each bump, so none is missed).
fn pod_watch(
    writer: reflector::store::Writer<Pod>,
    api: Api<Pod>,
    caches: &Caches,
    changes: tokio::sync::watch::Sender<u64>,
) -> Objects<Pod> {
    let index = caches.indexes.clone();
    observed(writer, api, trim::pod, move |ev| {
        if let Ok(ev) = ev {
            index.observe_pod(ev);
        }
        changes.send_modify(|n| *n = n.wrapping_add(1));
    })
    .touched_objects()
    .boxed()
}

/// Says `synced` once every cache but the Machines' has its first
/// complete list (the Machine store is not awaited: see
/// `Caches::machines_listed`).
async fn sync(c: Caches, synced: tokio::sync::watch::Sender<bool>) {
    let _ = tokio::join!(
        c.classes.wait_until_ready(),
        c.nodes.wait_until_ready(),
        c.pods.wait_until_ready(),
        c.attachments.wait_until_ready(),
        c.pvcs.wait_until_ready(),
        c.pvs.wait_until_ready(),
        c.pdbs.wait_until_ready(),
        c.csi_drivers.wait_until_ready(),
        c.csi_nodes.wait_until_ready(),
        c.replica_sets.wait_until_ready(),
        c.stateful_sets.wait_until_ready(),
        c.deployments.wait_until_ready(),
        c.move_permits.wait_until_ready(),
        c.move_asks.wait_until_ready(),
        c.drain_rules.wait_until_ready(),
        c.namespaces.wait_until_ready(),
    );
    let _ = synced.send(true);
    // Keeps the sender, so that `synced` never reads as closed.
    std::future::pending::<()>().await;
}
