//! The test bed itself: a real control plane whose volume chain works
//! (eviction → pod gone → detach → replacement scheduled → attach), whose
//! PodDisruptionBudgets are enforced from status the disruption controller
//! computed, and which leaves no process behind.

use std::path::Path;
use std::time::{Duration, Instant};

use berth_devkit::testbed::fixtures::{csi_pv, csi_unique_name, namespace, node, stateful_set};
use berth_devkit::testbed::stages::{
    ATTACHER_FINALIZER, CSI_DRIVER, NEVER_START_ANNOTATION, READY_AFTER_ANNOTATION,
};
use berth_devkit::testbed::{Options, TestBed, wait};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Namespace, Node, PersistentVolume, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, EvictParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::OnceCell;

const ATTACH: Duration = Duration::from_millis(1500);
const DETACH: Duration = Duration::from_millis(1500);
const LONG: Duration = Duration::from_secs(60);

/// One end-to-end control plane for the tests of this file.
async fn bed() -> &'static TestBed {
    static BED: OnceCell<TestBed> = OnceCell::const_new();
    BED.get_or_init(|| async {
        TestBed::start(
            Options::end_to_end()
                .attach_delay(ATTACH)
                .detach_delay(DETACH),
        )
        .await
        .expect("the end-to-end test bed starts")
    })
    .await
}

async fn setup(ns: &str, nodes: &[&str]) -> Client {
    let client = bed().await.client().await.expect("admin client");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace(ns))
        .await
        .expect("create namespace");
    // The ServiceAccount admission plugin refuses pods until the
    // service-account controller has created `default`.
    wait::for_one(
        Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(client.clone(), ns),
        LONG,
        "the default ServiceAccount",
        |sa| sa.name_any() == "default",
    )
    .await
    .expect("default service account");
    for n in nodes {
        create_node(&client, n, ns).await;
    }
    for n in nodes {
        wait::for_one(Api::<Node>::all(client.clone()), LONG, "node Ready", |o| {
            o.name_any() == *n && is_ready(o)
        })
        .await
        .expect("kwok makes the node Ready");
    }
    client
}

async fn create_node(client: &Client, name: &str, pool: &str) {
    let mut n = node(name);
    n.labels_mut().insert(
        berth_devkit::testbed::fixtures::POOL_LABEL.into(),
        pool.into(),
    );
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &n)
        .await
        .expect("create node");
}

fn is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn va_for<'a>(pv: &'a str, node: &'a str) -> impl Fn(&VolumeAttachment) -> bool + 'a {
    move |va| {
        va.spec.node_name == node && va.spec.source.persistent_volume_name.as_deref() == Some(pv)
    }
}

fn attached(va: &VolumeAttachment) -> bool {
    va.status.as_ref().is_some_and(|s| s.attached)
}

fn volumes_attached(node: &Node) -> Vec<String> {
    node.status
        .as_ref()
        .and_then(|s| s.volumes_attached.as_ref())
        .map(|v| v.iter().map(|a| a.name.clone()).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_follows_its_pod_to_another_node() {
    let ns = "smoke-volume";
    let (a, b) = ("smoke-node-a", "smoke-node-b");
    let client = setup(ns, &[a]).await;
    let pv = "smoke-pv-0";
    let handle = "vol-smoke-0";
    Api::<PersistentVolume>::all(client.clone())
        .create(&PostParams::default(), &csi_pv(pv, handle, ns, "data-db-0"))
        .await
        .expect("create PV");
    let mut sts = stateful_set("db", 1, 1);
    if let Some(spec) = sts.spec.template.spec.as_mut() {
        spec.node_selector = Some(
            [(
                berth_devkit::testbed::fixtures::POOL_LABEL.to_string(),
                ns.to_string(),
            )]
            .into(),
        );
    }
    Api::<StatefulSet>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &sts)
        .await
        .expect("create StatefulSet");

    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let first = wait::for_one(pods.clone(), LONG, "db-0 running on node A", |p| {
        p.name_any() == "db-0"
            && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(a)
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    })
    .await
    .expect("the pod runs on A");

    // The attach-detach controller creates the VolumeAttachment; the
    // simulated attacher marks it attached only after the attach delay:
    // from its creation (the API server's clock, whole seconds, so no
    // later than it was made), not from when this process's watch first
    // saw it, which on a loaded machine can be most of the delay later.
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    let on_a = wait::until(vas.clone(), LONG, "the VA on A attached", |all| {
        all.iter()
            .find(|v| va_for(pv, a)(v))
            .is_some_and(|v| attached(v))
    })
    .await
    .expect("the volume attaches on A");
    let attached_at = k8s_openapi::jiff::Timestamp::now();
    let va_a = on_a
        .iter()
        .find(|v| va_for(pv, a)(v))
        .expect("VA on A")
        .clone();
    assert_eq!(va_a.spec.attacher, CSI_DRIVER);
    assert!(va_a.finalizers().iter().any(|f| f == ATTACHER_FINALIZER));
    let created = va_a
        .metadata
        .creation_timestamp
        .as_ref()
        .expect("created")
        .0;
    let took = attached_at.duration_since(created);
    assert!(
        took >= k8s_openapi::jiff::SignedDuration::try_from(ATTACH).expect("a duration"),
        "attach took {took:#}, configured {ATTACH:?}"
    );
    let unique = csi_unique_name(CSI_DRIVER, handle);
    wait::for_one(
        Api::<Node>::all(client.clone()),
        LONG,
        "A reports the volume",
        |n| n.name_any() == a && volumes_attached(n).contains(&unique),
    )
    .await
    .expect("node A lists the volume in status.volumesAttached");

    // Make room elsewhere, cordon A and evict through policy/v1.
    create_node(&client, b, ns).await;
    wait::for_one(
        Api::<Node>::all(client.clone()),
        LONG,
        "node B Ready",
        |n| n.name_any() == b && is_ready(n),
    )
    .await
    .expect("B becomes Ready");
    Api::<Node>::all(client.clone())
        .patch(
            a,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"unschedulable": true}})),
        )
        .await
        .expect("cordon A");
    let evict = EvictParams {
        delete_options: Some(kube::api::DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                uid: first.uid(),
                resource_version: None,
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let evicted_at = Instant::now();
    pods.evict("db-0", &evict).await.expect("eviction accepted");

    // Pod gone → detach (the VA for A disappears once the attacher let go).
    let first_uid = first.uid();
    wait::for_none(pods.clone(), LONG, "the evicted pod gone", |p| {
        p.uid() == first_uid
    })
    .await
    .expect("the evicted pod goes away");
    wait::for_none(vas.clone(), LONG, "the VA on A deleted", va_for(pv, a))
        .await
        .expect("the volume detaches from A");
    let detached_after = evicted_at.elapsed();
    assert!(
        detached_after >= DETACH,
        "detached {detached_after:?} after the eviction, detach delay is {DETACH:?}"
    );
    wait::for_one(
        Api::<Node>::all(client.clone()),
        LONG,
        "A no longer reports the volume",
        |n| n.name_any() == a && !volumes_attached(n).contains(&unique),
    )
    .await
    .expect("node A drops the volume from status.volumesAttached");

    // The replacement lands on B and its volume attaches there.
    let second = wait::for_one(pods.clone(), LONG, "the replacement running on B", |p| {
        p.name_any() == "db-0"
            && p.uid() != first_uid
            && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(b)
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    })
    .await
    .expect("the replacement runs on B");
    assert_ne!(second.uid(), first_uid);
    wait::for_one(vas, LONG, "the VA on B attached", |v| {
        va_for(pv, b)(v) && attached(v)
    })
    .await
    .expect("the volume attaches on B");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pdb_at_its_limit_refuses_eviction_with_429() {
    let ns = "smoke-pdb";
    let client = setup(ns, &["smoke-pdb-node"]).await;
    let deploy: Deployment = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "nodeSelector": {berth_devkit::testbed::fixtures::POOL_LABEL: ns},
                    "containers": [{"name": "main", "image": "registry.invalid/web:1"}]
                }
            }
        }
    }))
    .expect("deployment");
    Api::<Deployment>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &deploy)
        .await
        .expect("create deployment");
    let pdb: PodDisruptionBudget = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "web"}}}
    }))
    .expect("pdb");
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), ns);
    pdbs.create(&PostParams::default(), &pdb)
        .await
        .expect("create PDB");

    // The disruption controller computes the status the eviction API uses.
    let pdb = wait::for_one(pdbs, LONG, "the PDB status computed", |p| {
        let Some(s) = p.status.as_ref() else {
            return false;
        };
        s.observed_generation == p.metadata.generation
            && s.expected_pods == Some(2)
            && s.current_healthy == Some(2)
            && s.disruptions_allowed == Some(0)
    })
    .await
    .expect("the disruption controller fills the PDB status");
    assert_eq!(pdb.status.as_ref().and_then(|s| s.desired_healthy), Some(2));

    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let running = wait::until(pods.clone(), LONG, "two web pods", |all| all.len() == 2)
        .await
        .expect("two pods");
    let victim = running[0].name_any();
    match pods.evict(&victim, &EvictParams::default()).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 429, "refused as too many requests: {status:?}");
            assert!(
                status.message.contains("disruption budget"),
                "message names the budget: {}",
                status.message
            );
        }
        other => panic!("eviction must be refused by the PDB, got {other:?}"),
    }
    // Nothing was evicted.
    let still = pods.get(&victim).await.expect("the pod is still there");
    assert!(still.metadata.deletion_timestamp.is_none());
}

/// The bed can hold a pod's readiness and keep a pod from starting, so
/// that "the replacement is not Ready yet" and "the replacement never
/// starts" can be tested: a pod annotated `ready-after: 3s` runs at once,
/// unready, and turns Ready 3 s after it started; one annotated
/// `never-start` stays Pending on its Node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_can_be_held_unready_or_kept_from_starting() {
    let ns = "smoke-ready";
    let client = setup(ns, &["smoke-ready-node"]).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    for (name, annotation, value) in [
        ("late", READY_AFTER_ANNOTATION, "3s"),
        ("never", NEVER_START_ANNOTATION, "true"),
    ] {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "annotations": {annotation: value}},
            "spec": {
                "nodeSelector": {berth_devkit::testbed::fixtures::POOL_LABEL: ns},
                "containers": [{"name": "main", "image": "registry.invalid/app:1"}]
            }
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod)
            .await
            .expect("create pod");
    }
    let condition = |p: &Pod, t: &str| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == t).cloned())
    };
    let phase = |p: &Pod| p.status.as_ref().and_then(|s| s.phase.clone());
    let running = wait::for_one(pods.clone(), LONG, "late running", |p| {
        p.name_any() == "late" && phase(p).as_deref() == Some("Running")
    })
    .await
    .expect("late starts");
    assert_eq!(
        condition(&running, "Ready").map(|c| c.status).as_deref(),
        Some("False"),
        "running, not Ready: {running:?}"
    );
    let ready = wait::for_one(pods.clone(), LONG, "late Ready", |p| {
        p.name_any() == "late" && condition(p, "Ready").is_some_and(|c| c.status == "True")
    })
    .await
    .expect("late turns Ready");
    let started = ready
        .status
        .as_ref()
        .and_then(|s| s.start_time.as_ref())
        .map(|t| t.0)
        .expect("startTime");
    let became = condition(&ready, "Ready")
        .and_then(|c| c.last_transition_time)
        .map(|t| t.0)
        .expect("Ready's transition time");
    let after = became.duration_since(started).as_secs_f64();
    assert!(after >= 2.0, "Ready {after} s after it started");
    // By now (3 s on) a pod that could start would have.
    let never = pods.get("never").await.expect("never");
    assert_eq!(phase(&never).as_deref(), Some("Pending"), "{never:?}");
    assert!(
        never
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .is_some_and(|n| n == "smoke-ready-node"),
        "bound to its Node: {never:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_test_bed_leaves_no_process_or_directory() {
    let bed = TestBed::start(Options::integration())
        .await
        .expect("integration bed starts");
    let client = bed.client().await.expect("client");
    let version = client.apiserver_version().await.expect("version");
    assert_eq!(
        format!("v{}.{}", version.major, version.minor),
        "v1.37",
        "{version:?}"
    );
    assert!(
        version.git_version.starts_with("v1.37."),
        "stamped: {}",
        version.git_version
    );
    // The API answers writes, not only reads.
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace("integration-check"))
        .await
        .expect("create a namespace");

    let pids = bed.pids();
    let names: Vec<&str> = pids.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["etcd", "kube-apiserver"]);
    let dir = bed.dir().to_path_buf();
    assert!(dir.join("kubeconfig").exists());
    drop(bed);
    for (name, pid) in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "{name} (pid {pid}) outlived its test bed"
        );
    }
    assert!(!dir.exists(), "{} was removed", dir.display());
}
