//! The drain per kind of volume, end to end on the test bed: an attach-free
//! CSI driver, a node-local PV with `nodeLocalVolumes` Evict and Block, a
//! ReadWriteMany volume used on two Nodes, a migrated in-tree PV as far as
//! the test bed allows (its plan; the test bed has no attacher for migrated
//! drivers), and in-tree and inline iSCSI volumes, which the real
//! attach-detach controller attaches on kwok Nodes. Order and counts are
//! the cluster's (`support::oracle`, and a watch of the Nodes' lists of
//! attached volumes); each also checks what `berth plan` and the Events
//! say.

mod support;

use std::time::Duration;

use berth::api::Machine;
use berth_devkit::testbed::fixtures::{csi_pv, stateful_set};
use berth_devkit::testbed::wait;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use support::pool::{
    Bed, HOOK, POOL, assert_contains, create, delete_machine, events, first, gone, json, log_of,
    on_node, plan_text, pod_running, pool_class, running_held, running_pods,
};
use support::{Case, LONG, condition};

const ATTACH_DELAY: Duration = Duration::from_secs(3);
const DETACH_DELAY: Duration = Duration::from_secs(1);
const BED: Bed = Bed {
    attach: ATTACH_DELAY,
    detach: DETACH_DELAY,
};
use support::pool::{ATTACH_FREE_DRIVER, attach_free_driver, csi_pv_on};
const ALLOW: &str = "berth.dev/allow-node-local-data-loss";

/// A PV pinned to `node` (`spec.local` and node affinity), pre-bound to
/// claim `claim`, and the claim.
async fn local_volume(client: &Client, ns: &str, pv: &str, claim: &str, node: &str) {
    create(
        Api::<PersistentVolume>::all(client.clone()),
        json(serde_json::json!({
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "claimRef": {"namespace": ns, "name": claim},
                "local": {"path": "/mnt/disks/a"},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
                ]}]}}
            }
        })),
    )
    .await;
    create(
        Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns),
        json(serde_json::json!({
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}}
            }
        })),
    )
    .await;
}

/// A bare pod on `node` that mounts `claim`.
fn claim_pod(name: &str, node: &str, claim: &str) -> Pod {
    json(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 1,
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
            "containers": [{"name": "main", "image": "registry.invalid/app:1",
                "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]
        }
    }))
}

async fn annotate<K>(api: Api<K>, name: &str)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"annotations": {ALLOW: "true"}}})),
    )
    .await
    .expect("annotate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_free_stateful_set_drains_without_waiting_for_a_timeout() {
    let ns = "kinds-free";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"volumeReattachTimeout": "5m"}))
        .build()
        .await;
    let client = case.client();
    attach_free_driver(&client, ATTACH_FREE_DRIVER).await;
    let reattach_timeout = Duration::from_secs(300);
    case.start().await;
    let node_a = running_held(&client, ns, "a", ns, false).await;
    for i in 0..2 {
        let pv = csi_pv_on(
            ATTACH_FREE_DRIVER,
            &format!("{ns}-{i}"),
            &format!("share-{i}"),
            ns,
            &format!("data-share-{i}"),
        );
        create(Api::all(client.clone()), pv).await;
    }
    let mut sts = stateful_set("share", 2, 1);
    if let Some(spec) = sts.spec.template.spec.as_mut() {
        spec.node_selector = Some([(POOL.to_string(), ns.to_string())].into());
    }
    create(Api::<StatefulSet>::namespaced(client.clone(), ns), sts).await;
    running_pods(&client, ns, &["share-0", "share-1"]).await;
    let node_b = running_held(&client, ns, "b", ns, false).await;

    let plan = plan_text(&client, ns, "a").await;
    eprintln!("{plan}");
    assert_contains(
        &plan,
        &[
            &format!(
                "PV {ns}-0 (claim {ns}/data-share-0), attach-free: CSIDriver {ATTACH_FREE_DRIVER} has attachRequired: false"
            ),
            "no detach or attach: waits for the pod that uses the claim next to be Running and Ready on another Node",
        ],
    );
    assert!(!plan.contains("detach ≤"), "nothing detaches: {plan}");

    let started = std::time::Instant::now();
    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", reattach_timeout / 2).await;
    let took = started.elapsed();
    let evs = events(&client, ns, "a").await;
    let log = log_of(&evs);
    eprintln!("drain of {node_a} took {took:?}:\n{log}");
    // Two moves, one at a time, each a replacement made Ready: seconds,
    // more on a loaded machine; a drain that waited for a reattach would
    // take the timeout for each.
    assert!(
        took < reattach_timeout / 2,
        "took {took:?}, far under the reattach timeout: {log}"
    );
    for i in 0..2 {
        let pv = format!("{ns}-{i}");
        let moved = first(&evs, "VolumeMoved", &pv).unwrap_or_else(|| panic!("{pv}: {log}"));
        assert!(
            moved.2.contains("attach-free PV") && moved.2.contains(&node_b),
            "{pv} followed its pod to {node_b}: {}",
            moved.2
        );
    }
    assert!(first(&evs, "VolumeReattachTimeout", "").is_none(), "{log}");
    assert!(first(&evs, "VolumeDetached", "").is_none(), "{log}");
    // What the cluster did: both pods run on B, and nothing was attached.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    for name in ["share-0", "share-1"] {
        let p = pods.get(name).await.expect("the replacement");
        assert!(
            on_node(&p, &node_b) && pod_running(&p),
            "{name} runs on {node_b}: {:?}",
            p.spec.and_then(|s| s.node_name)
        );
    }
    let vas = Api::<VolumeAttachment>::all(client.clone())
        .list(&Default::default())
        .await
        .expect("list");
    assert!(
        !vas.items
            .iter()
            .any(|va| va.spec.attacher == ATTACH_FREE_DRIVER),
        "never attached"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_volume_is_evicted_and_its_loss_named() {
    let ns = "kinds-evict";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"volumeReattachTimeout": "5m"}))
        .start()
        .await;
    let reattach_timeout = Duration::from_secs(300);
    let client = case.client();
    let node = running_held(&client, ns, "a", ns, true).await;
    let pv = format!("{ns}-local");
    local_volume(&client, ns, &pv, "data", &node).await;
    create(
        Api::<Pod>::namespaced(client.clone(), ns),
        claim_pod("db", &node, "data"),
    )
    .await;
    running_pods(&client, ns, &["db"]).await;

    let plan = plan_text(&client, ns, "a").await;
    assert_contains(
        &plan,
        &[
            "Node-local volumes: nodeLocalVolumes Evict",
            &format!("PV {pv} (claim {ns}/data), node-local: local volume (spec.local)"),
            "its data stays on this Node and is lost with the VM; evicted without any reattach wait",
        ],
    );

    let started = std::time::Instant::now();
    delete_machine(&client, ns, "a").await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let held = wait::for_one(
        machines.clone(),
        reattach_timeout / 5,
        "the data loss named",
        |m| {
            m.name_any() == "a"
                && condition(m, "NodeLocalVolumes")
                    .is_some_and(|c| c.status == "True" && c.reason == "DataLost")
        },
    )
    .await
    .expect("the NodeLocalVolumes condition");
    let took = started.elapsed();
    let cond = condition(&held, "NodeLocalVolumes").expect("condition");
    assert!(
        cond.message.contains(&format!("PV {pv} (pod {ns}/db)"))
            && cond.message.contains("lost with the VM"),
        "{}",
        cond.message
    );
    // Named on the first pass, not after a reattach wait: a fifth of the
    // timeout, whatever the machine's speed.
    assert!(took < reattach_timeout / 5, "no reattach wait: {took:?}");
    let evs = events(&client, ns, "a").await;
    let log = log_of(&evs);
    let lost = first(&evs, "NodeLocalDataLost", &pv).unwrap_or_else(|| panic!("{log}"));
    assert!(lost.2.contains("lost with the VM"), "{}", lost.2);
    assert!(first(&evs, "VolumeReattachTimeout", "").is_none(), "{log}");
    Api::<Machine>::namespaced(client.clone(), ns)
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {HOOK: null}}})),
        )
        .await
        .expect("release the hook");
    gone(&client, ns, "a", LONG).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_holds_a_local_volume_until_an_operator_allows_it() {
    let ns = "kinds-block";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"nodeLocalVolumes": "Block", "timeout": "10m"}))
        .start()
        .await;
    let client = case.client();
    let node = running_held(&client, ns, "a", ns, false).await;
    for (p, claim) in [("x", "data-x"), ("y", "data-y")] {
        local_volume(&client, ns, &format!("{ns}-{p}"), claim, &node).await;
        create(
            Api::<Pod>::namespaced(client.clone(), ns),
            claim_pod(p, &node, claim),
        )
        .await;
    }
    running_pods(&client, ns, &["x", "y"]).await;
    let plan = plan_text(&client, ns, "a").await;
    assert_contains(
        &plan,
        &[
            "Node-local volumes: nodeLocalVolumes Block",
            &format!("HELD: pod {ns}/x uses node-local PV {ns}-x"),
            &format!("kubectl annotate pod -n {ns} x {ALLOW}=true"),
        ],
    );

    delete_machine(&client, ns, "a").await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let held = |pod: &'static str| {
        move |m: &Machine| {
            condition(m, "NodeLocalVolumes").is_some_and(|c| {
                c.status == "False"
                    && c.reason == "EvictionHeld"
                    && c.message
                        .contains(&format!("pod {ns}/{pod} uses node-local PV"))
            })
        }
    };
    let blocked_by = |m: &Machine| {
        m.status
            .as_ref()
            .and_then(|s| s.drain.as_ref())
            .and_then(|d| d.blocked_by.clone())
            .unwrap_or_default()
    };
    let m = wait::for_one(machines.clone(), LONG, "x held", |m| {
        held("x")(m) && !blocked_by(m).is_empty()
    })
    .await
    .expect("the hold is a condition and in status.drain");
    let blocked = blocked_by(&m);
    assert!(blocked.contains(&format!("{ALLOW}=true")), "{blocked}");
    let drained = condition(&m, "Drained").expect("Drained");
    assert_eq!(drained.reason, "EvictionBlocked", "{drained:?}");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);

    // The pod's annotation lets x go; y is then held. (The audit log says
    // below that neither went before it was allowed.)
    let x_allowed = k8s_openapi::jiff::Timestamp::now();
    annotate(pods.clone(), "x").await;
    wait::for_one(machines.clone(), LONG, "y held", held("y"))
        .await
        .expect("y held next");
    wait::for_none(pods.clone(), LONG, "x evicted", |p| p.name_any() == "x")
        .await
        .expect("x evicted");
    assert!(pods.get_opt("y").await.expect("get").is_some());
    // The Machine's annotation lets every pod go.
    let y_allowed = k8s_openapi::jiff::Timestamp::now();
    annotate(machines.clone(), "a").await;
    gone(&client, ns, "a", LONG).await;
    // By the audit log: each pod evicted once, only after it was allowed.
    let bed = BED.bed().await;
    let all = support::oracle::evictions(bed, ns);
    let truth = support::oracle::log_of(&all);
    for (p, allowed) in [("x", x_allowed), ("y", y_allowed)] {
        let evicted = support::oracle::accepted_evictions_of(&all, p);
        assert_eq!(evicted.len(), 1, "{p}: {truth}");
        assert!(
            evicted[0].received > allowed,
            "{p} held until allowed: {truth}"
        );
    }
    // What operators are told.
    let evs = events(&client, ns, "a").await;
    let log = log_of(&evs);
    for p in ["x", "y"] {
        assert!(
            first(&evs, "NodeLocalEvictionHeld", &format!("{ns}/{p}")).is_some(),
            "{log}"
        );
        assert!(
            first(&evs, "NodeLocalEvictionAllowed", &format!("{ns}/{p}")).is_some(),
            "{log}"
        );
        assert!(
            first(&evs, "NodeLocalDataLost", &format!("{ns}-{p}")).is_some(),
            "{log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_volume_has_moved_only_once_attached_where_the_replacement_runs() {
    let ns = "kinds-rwx";
    let peers = "kinds-rwx-peers";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"volumeReattachTimeout": "5m"}))
        .build()
        .await;
    let client = case.client();
    pool_class(&client, peers, serde_json::json!({})).await;
    case.start().await;
    let node_a = running_held(&client, ns, "a", ns, false).await;
    let node_c = running_held(&client, ns, "c", peers, false).await;
    let pv = format!("{ns}-shared");
    let mut volume = csi_pv(&pv, "vol-shared", ns, "shared");
    if let Some(spec) = volume.spec.as_mut() {
        spec.access_modes = Some(vec!["ReadWriteMany".into()]);
    }
    create(Api::all(client.clone()), volume).await;
    create(
        Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns),
        json(serde_json::json!({
            "metadata": {"name": "shared"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}}
            }
        })),
    )
    .await;
    // A peer on C uses the volume all along; the StatefulSet's pod on A
    // moves.
    create(
        Api::<Pod>::namespaced(client.clone(), ns),
        claim_pod("peer", &node_c, "shared"),
    )
    .await;
    let mut sts = stateful_set("app", 1, 1);
    {
        let spec = &mut sts.spec;
        spec.volume_claim_templates = None;
        if let Some(pod) = spec.template.spec.as_mut() {
            pod.node_selector = Some([(POOL.to_string(), ns.to_string())].into());
            pod.volumes = Some(vec![json(serde_json::json!({
                "name": "data", "persistentVolumeClaim": {"claimName": "shared"}
            }))]);
        }
    }
    create(Api::<StatefulSet>::namespaced(client.clone(), ns), sts).await;
    running_pods(&client, ns, &["peer", "app-0"]).await;
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    wait::until(vas.clone(), LONG, "attached on A and C", |all| {
        [&node_a, &node_c].iter().all(|n| {
            all.iter().any(|va| {
                va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
                    && va.spec.node_name == **n
                    && va.status.as_ref().is_some_and(|s| s.attached)
            })
        })
    })
    .await
    .expect("the volume attaches on both Nodes");
    let node_b = running_held(&client, ns, "b", ns, false).await;
    let plan = plan_text(&client, ns, "a").await;
    assert_contains(
        &plan,
        &[
            &format!(
                "PV {pv} (claim {ns}/shared), attachable: csi.testbed.berth.dev has no CSIDriver object, so attach is required"
            ),
            &format!("attached to {node_a}, {node_c}"),
            "last user: waits for detach, then for attach to another Node",
        ],
    );

    let watches = support::oracle::Watches::start(&client, ns).await;
    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(90)).await;
    // By the audit log and the watches: A's Node was deleted only after the
    // attacher wrote the volume attached on B, where the replacement runs
    // (C had it all along), and after the watch saw it detach from A.
    let bed = BED.bed().await;
    let all = support::oracle::requests_once(bed, ns, |rs| {
        rs.iter()
            .any(|r| r.verb == "delete" && r.resource == "nodes")
    })
    .await;
    let truth = format!("{}\n{}", support::oracle::log_of(&all), watches.log());
    let node_deleted = all
        .iter()
        .find(|r| {
            r.verb == "delete"
                && r.resource == "nodes"
                && r.name.as_deref() == Some(node_a.as_str())
        })
        .map(|r| r.received)
        .unwrap_or_else(|| panic!("A's Node deleted: {truth}"));
    let on_b = watches
        .attached_on(bed, &pv, &node_b)
        .await
        .unwrap_or_else(|| panic!("attached on B: {truth}"));
    let off_a = watches
        .detached_from(&pv, &node_a)
        .unwrap_or_else(|| panic!("detached from A: {truth}"));
    assert!(on_b < node_deleted && off_a < node_deleted, "{truth}");
    // What operators are told.
    let evs = events(&client, ns, "a").await;
    let log = log_of(&evs);
    assert!(first(&evs, "VolumeDetached", &pv).is_some(), "{log}");
    let attached = first(&evs, "VolumeAttached", &pv).unwrap_or_else(|| panic!("{log}"));
    assert!(
        attached.2.contains(&format!(
            "attached on Node {node_b}, where pod {ns}/app-0 runs"
        )),
        "the wait ends where the replacement runs, not on {node_c}: {}",
        attached.2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_tree_volume_is_planned_under_its_migrated_csi_name() {
    let ns = "kinds-intree";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({}))
        .start()
        .await;
    let client = case.client();
    let node = running_held(&client, ns, "a", ns, false).await;
    let pv = format!("{ns}-ebs");
    create(
        Api::<PersistentVolume>::all(client.clone()),
        json(serde_json::json!({
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "claimRef": {"namespace": ns, "name": "data"},
                "awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-0123456789abcdef0"}
            }
        })),
    )
    .await;
    create(
        Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns),
        json(serde_json::json!({
            "metadata": {"name": "data"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}}
            }
        })),
    )
    .await;
    create(
        Api::<Pod>::namespaced(client.clone(), ns),
        claim_pod("db", &node, "data"),
    )
    .await;
    running_pods(&client, ns, &["db"]).await;
    let plan = plan_text(&client, ns, "a").await;
    assert_contains(
        &plan,
        &[&format!(
            "PV {pv} (claim {ns}/data), attachable: in-tree awsElasticBlockStore migrated to CSI, ebs.csi.aws.com has no CSIDriver object, so attach is required; on the Node as kubernetes.io/csi/ebs.csi.aws.com^vol-0123456789abcdef0"
        )],
    );
}

/// What a watch of the Nodes saw: when, which Node, the names it listed in
/// `status.volumesAttached`.
type NodeLists =
    std::sync::Arc<std::sync::Mutex<Vec<(k8s_openapi::jiff::Timestamp, String, Vec<String>)>>>;

/// Watches the Nodes' `status.volumesAttached` (see [`NodeLists`]).
fn watch_node_lists(client: &Client) -> (NodeLists, tokio::task::JoinHandle<()>) {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Node;
    use kube::runtime::watcher::{self, Event};
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let api: Api<Node> = Api::all(client.clone());
    let into = std::sync::Arc::clone(&seen);
    let task = tokio::spawn(async move {
        let mut stream = watcher::watcher(api, watcher::Config::default()).boxed();
        while let Some(ev) = stream.next().await {
            let now = k8s_openapi::jiff::Timestamp::now();
            if let Ok(Event::Apply(n) | Event::InitApply(n)) = ev {
                let names = n
                    .status
                    .iter()
                    .flat_map(|s| s.volumes_attached.iter().flatten())
                    .map(|v| v.name.clone())
                    .collect();
                into.lock().expect("lock").push((now, n.name_any(), names));
            }
        }
    });
    (seen, task)
}

/// An in-tree iSCSI PV has no VolumeAttachment: the attach-detach
/// controller attaches it itself and lists it in the Node's
/// `status.volumesAttached` as `kubernetes.io/iscsi/<portal>:<iqn>:<lun>`.
/// The drain classes it attachable, waits for the old Node to stop listing
/// it and for the Node where the replacement runs to list it: db-1 is
/// evicted only after the attach-detach controller's status write that
/// listed db-0's volume on B (audit log, found through a watch of the
/// Nodes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_tree_iscsi_volume_moves_as_the_node_lists_it() {
    let ns = "kinds-iscsi";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"volumeReattachTimeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_held(&client, ns, "a", ns, false).await;
    let unique =
        |i: usize| format!("kubernetes.io/iscsi/10.0.0.9:3260:iqn.2026-11.dev.berth:{ns}:{i}");
    for i in 0..2 {
        let mut pv = csi_pv(
            &format!("{ns}-db-{i}"),
            "unused",
            ns,
            &format!("data-db-{i}"),
        );
        if let Some(spec) = pv.spec.as_mut() {
            spec.csi = None;
            spec.iscsi = Some(json(serde_json::json!({
                "targetPortal": "10.0.0.9:3260",
                "iqn": format!("iqn.2026-11.dev.berth:{ns}"),
                "lun": i
            })));
        }
        create(Api::all(client.clone()), pv).await;
    }
    let mut sts = stateful_set("db", 2, 1);
    if let Some(pod) = sts.spec.template.spec.as_mut() {
        pod.node_selector = Some([(POOL.to_string(), ns.to_string())].into());
    }
    create(Api::<StatefulSet>::namespaced(client.clone(), ns), sts).await;
    running_pods(&client, ns, &["db-0", "db-1"]).await;
    let (lists, watch) = watch_node_lists(&client);
    iscsi_listed(&client, &node_a, 2).await;
    let node_b = running_held(&client, ns, "b", ns, false).await;
    let plan = plan_text(&client, ns, "a").await;
    assert_contains(
        &plan,
        &[&format!(
            "PV {ns}-db-0 (claim {ns}/data-db-0), attachable: in-tree iscsi the attach-detach controller attached (no VolumeAttachment is made for it); on the Node as {}",
            unique(0)
        )],
    );

    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;
    watch.abort();

    let bed = BED.bed().await;
    let write = listing_write(bed, &lists, &node_b, &unique(0));
    let all = support::oracle::evictions(bed, ns);
    let log = support::oracle::log_of(&all);
    let db1 = support::oracle::accepted_evictions_of(&all, "db-1");
    assert_eq!(db1.len(), 1, "{log}");
    assert!(
        db1[0].received > write,
        "db-1 evicted at {} only after B listed db-0's volume (write received {write}): {log}",
        db1[0].received
    );
}

/// When the write that made Node `node` list `unique` in
/// `status.volumesAttached` reached the API server: the attach-detach
/// controller's last status write of that Node received before the watch
/// (`lists`) saw the Node list it (no earlier write can have listed it;
/// the audit log does not keep the bodies).
fn listing_write(
    bed: &berth_devkit::testbed::TestBed,
    lists: &NodeLists,
    node: &str,
    unique: &str,
) -> k8s_openapi::jiff::Timestamp {
    let seen = lists.lock().expect("lock").clone();
    let listed = seen
        .iter()
        .find(|(_, n, names)| n == node && names.iter().any(|u| u == unique))
        .map(|(t, _, _)| *t)
        .unwrap_or_else(|| panic!("{node} never listed {unique}: {seen:?}"));
    let writes: Vec<_> = support::oracle::cluster_requests(bed)
        .into_iter()
        .filter(|r| {
            r.resource == "nodes"
                && r.subresource.as_deref() == Some("status")
                && r.name.as_deref() == Some(node)
                && r.is_write()
        })
        .collect();
    writes
        .iter()
        .filter(|r| r.user_agent.contains("attachdetach") && r.received < listed)
        .map(|r| r.received)
        .max()
        .unwrap_or_else(|| {
            panic!(
                "no status write of Node {node} by the attach-detach controller before {listed}: {:?}",
                writes
                    .iter()
                    .map(|r| (&r.user_agent, r.received))
                    .collect::<Vec<_>>()
            )
        })
}

/// An inline iSCSI volume (named in the pod spec, without a PV or a
/// claim) is a persistent volume for the drain: the cache keeps it, the
/// plan classes it as the PV it would be, and the next pod waits for it to
/// be listed where the replacement runs. Two Deployments with one inline
/// LUN each: `b-legacy`'s eviction is received only after the
/// attach-detach controller's status write that listed `a-legacy`'s LUN
/// on B (audit log, found through a watch of the Nodes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_iscsi_volume_moves_as_a_claim_would() {
    use berth_devkit::testbed::fixtures::deployment;
    let ns = "kinds-inline";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"volumeReattachTimeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_held(&client, ns, "a", ns, false).await;
    // One target each: the scheduler lets no two pods on a Node mount the
    // same IQN read-write.
    let iqn = |name: &str| format!("iqn.2026-11.dev.berth:{name}");
    let unique = |name: &str| format!("kubernetes.io/iscsi/10.0.0.9:3260:{}:0", iqn(name));
    for name in ["a-legacy", "b-legacy"] {
        let mut d = deployment(name, 1, 1, ns);
        if let Some(pod) = d.spec.template.spec.as_mut() {
            pod.volumes = Some(vec![json(serde_json::json!({
                "name": "disk",
                "iscsi": {"targetPortal": "10.0.0.9:3260", "iqn": iqn(name), "lun": 0}
            }))]);
        }
        create(
            Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(client.clone(), ns),
            d,
        )
        .await;
    }
    let (lists, watch) = watch_node_lists(&client);
    iscsi_listed(&client, &node_a, 2).await;
    let node_b = running_held(&client, ns, "b", ns, false).await;
    let plan = plan_text(&client, ns, "a").await;
    assert_contains(
        &plan,
        &[&format!(
            "inline:iscsi:10.0.0.9:3260 {} 0 (in the pod spec), attachable: inline volume of the pod, in-tree iscsi the attach-detach controller attached (no VolumeAttachment is made for it); on the Node as {}",
            iqn("a-legacy"),
            unique("a-legacy")
        )],
    );

    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;
    watch.abort();
    let bed = BED.bed().await;
    let write = listing_write(bed, &lists, &node_b, &unique("a-legacy"));
    let all = support::oracle::evictions(bed, ns);
    let log = support::oracle::log_of(&all);
    assert_eq!(
        support::oracle::accepted_evictions_of(&all, "a-legacy-*").len(),
        1,
        "{log}"
    );
    let next = support::oracle::accepted_evictions_of(&all, "b-legacy-*");
    assert_eq!(next.len(), 1, "{log}");
    assert!(
        next[0].received > write,
        "b-legacy evicted at {} only after B listed a-legacy's LUN (write received {write}): {log}",
        next[0].received
    );
}

/// Waits until Node `node` lists `n` iSCSI volumes in
/// `status.volumesAttached` (the attach-detach controller attached them).
async fn iscsi_listed(client: &Client, node: &str, n: usize) {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    wait::for_one(
        nodes,
        LONG,
        &format!("{node} lists {n} iSCSI volumes"),
        |o| {
            o.name_any() == node
                && o.status
                    .iter()
                    .flat_map(|s| s.volumes_attached.iter().flatten())
                    .filter(|v| v.name.starts_with("kubernetes.io/iscsi/"))
                    .count()
                    == n
        },
    )
    .await
    .unwrap_or_else(|e| panic!("the attach-detach controller attaches them: {e}"));
}

/// A CSI driver the test bed has no attacher for, and no CSIDriver object
/// (Kubernetes then assumes it attaches): the attach-detach controller
/// makes its VolumeAttachments and nothing ever attaches them, so a case
/// writes their status itself, unraced.
const UNATTACHED_DRIVER: &str = "unattached.testbed.berth.dev";

/// A replica moves to Node B, where the attacher refuses its volume for
/// lack of a slot: the test writes `attachError` with gRPC code 8
/// (RESOURCE_EXHAUSTED) to the new VolumeAttachment's status while the
/// drain waits for the volume to attach there (a reattach timeout of 5
/// minutes). The wait ends at once: by the audit log, the controller's
/// `VolumeAttachExhausted` Event is created after the status write, and
/// the move's permit deleted within 10 s of it; the Machine goes long
/// before the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_refused_for_lack_of_a_slot_ends_the_reattach_wait_at_once() {
    let ns = "kinds-exhausted";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m", "volumeReattachTimeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    // The pool's VMs run the driver's node plugin: a Node registers it in
    // its CSINode, so B is a destination for db-0.
    Api::<berth::api::MachineClass>::all(client.clone())
        .patch(
            ns,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"providerSpec": {"csiDrivers": [
                {"name": berth_devkit::testbed::stages::CSI_DRIVER},
                {"name": UNATTACHED_DRIVER}
            ]}}})),
        )
        .await
        .expect("the pool runs the driver");
    let node_a = running_held(&client, ns, "a", ns, false).await;
    let pv = format!("{ns}-db-0");
    let handle = format!("vol-{pv}");
    let volume = csi_pv_on(UNATTACHED_DRIVER, &pv, &handle, ns, "data-db-0");
    create(Api::all(client.clone()), volume).await;
    let mut sts = stateful_set("db", 1, 1);
    if let Some(spec) = sts.spec.template.spec.as_mut() {
        spec.node_selector = Some([(POOL.to_string(), ns.to_string())].into());
    }
    create(Api::<StatefulSet>::namespaced(client.clone(), ns), sts).await;
    running_pods(&client, ns, &["db-0"]).await;
    // The test is the attacher on A: the volume attaches there, and will
    // detach (no attacher's finalizer holds its VolumeAttachment).
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    let on_a = wait::for_one(vas.clone(), LONG, "db-0's volume asked for on A", |va| {
        va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
            && va.spec.node_name == node_a
    })
    .await
    .expect("the attach-detach controller asks for the volume on A");
    vas.patch_status(
        &on_a.name_any(),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"status": {"attached": true}})),
    )
    .await
    .expect("attached on A");
    let node_b = running_held(&client, ns, "b", ns, false).await;

    delete_machine(&client, ns, "a").await;
    // The drain waits for the volume where the replacement runs: its
    // VolumeAttachment there is made, and never attached.
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let waiting = format!("to move with the pod that replaces {ns}/db-0");
    wait::for_one(machines, LONG, "a's drain in its reattach wait", |m| {
        m.name_any() == "a"
            && m.status
                .as_ref()
                .and_then(|s| s.drain.as_ref())
                .and_then(|d| d.waiting_for.as_deref())
                .is_some_and(|w| w.contains(&waiting))
    })
    .await
    .expect("the drain waits for the volume to attach on B");
    let va = wait::for_one(vas.clone(), LONG, "db-0's volume asked for on B", |va| {
        va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
            && va.spec.node_name == node_b
    })
    .await
    .expect("the attach-detach controller asks for the volume on B");
    let va_name = va.name_any();
    let full = "attachdetach: node has no free attach slot (16/16 volumes)";
    let written = vas
        .patch_status(
            &va_name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"attached": false, "attachError": {
                "message": full,
                "errorCode": 8,
                "time": k8s_openapi::jiff::Timestamp::now().round(k8s_openapi::jiff::Unit::Second)
                    .expect("a time").to_string(),
            }}})),
        )
        .await
        .expect("the attach error written");
    let code = written
        .status
        .and_then(|s| s.attach_error)
        .and_then(|e| e.error_code);
    assert_eq!(code, Some(8), "the API server keeps the error's code");

    let said = support::events_of(&client, ns, "a", "VolumeAttachExhausted", 1).await;
    let note = said[0].note.clone().unwrap_or_default();
    assert_contains(&note, &[&pv, &node_b, &va_name, full, "code 8"]);
    gone(&client, ns, "a", Duration::from_secs(90)).await;

    // Timed by the audit log: the status write's arrival, and the
    // controller's Event and the end of the move's permit after it. The
    // Event's moment is its queue's (published off the drain's path): it
    // is only after the write. The permit's end is the drain's own reaction,
    // bounded well under the engine's shortest periodic look (30 s) and the
    // 5-minute reattach timeout, not by how fast a loaded machine reacts.
    let bed = BED.bed().await;
    let event_name = said[0].name_any();
    let theirs = support::oracle::requests_once(bed, ns, |rs| {
        rs.iter()
            .any(|r| r.resource == "events" && r.name.as_deref() == Some(event_name.as_str()))
    })
    .await;
    let write = support::oracle::cluster_requests(bed)
        .into_iter()
        .find(|r| {
            r.resource == "volumeattachments"
                && r.subresource.as_deref() == Some("status")
                && r.name.as_deref() == Some(va_name.as_str())
        })
        .expect("the status write in the audit log");
    let log = support::oracle::log_of(&theirs);
    let event = theirs
        .iter()
        .find(|r| r.verb == "create" && r.name.as_deref() == Some(event_name.as_str()))
        .unwrap_or_else(|| panic!("the Event's creation: {log}"));
    let permit_ended = theirs
        .iter()
        .find(|r| r.verb == "delete" && r.resource == "movepermits" && r.received > write.received)
        .unwrap_or_else(|| panic!("the move's permit ended: {log}"));
    for (what, r, within) in [
        ("the Event", event, None),
        ("the permit's end", permit_ended, Some(10)),
    ] {
        let after = r.received.duration_since(write.received);
        eprintln!("{what}: {after:#} after the attach error was written");
        assert!(
            after.is_positive()
                && within.is_none_or(|s| after < k8s_openapi::jiff::SignedDuration::from_secs(s)),
            "{what} after the attach error, within {within:?} s ({} then {}): {log}",
            write.received,
            r.received
        );
    }
}
