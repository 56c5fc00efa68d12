//! The `berth run` process, as an operator runs it: the real binary against
//! a real kube-apiserver, observed through its logs, its HTTP port and the
//! cluster.

mod support;

use berth_devkit::testbed::fixtures::machine;

use berth::api::{Machine, MachineClass};
use berth_devkit::testbed::{Options, TestBed, fixtures, wait};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use support::process::Berth;

use support::LONG;

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("berth=info")
        .with_test_writer()
        .try_init();
}

fn class(name: &str) -> MachineClass {
    let mut c = fixtures::machine_class(name, "fake", serde_json::json!({}));
    c.spec.creation_timeout = Some("10m".into());
    c
}

/// The `reportingInstance` of every Event about Machine `name`, once there
/// is at least one.
async fn reporters(client: &Client, ns: &str, name: &str) -> Vec<String> {
    let events = wait::until(
        Api::<Event>::namespaced(client.clone(), ns),
        LONG,
        &format!("events about {name}"),
        |evs| {
            evs.iter()
                .any(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        },
    )
    .await
    .expect("the controller records Events");
    events
        .iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| e.reporting_instance.clone().unwrap_or_default())
        .collect()
}

async fn holder(client: &Client, ns: &str) -> String {
    let lease = wait::for_one(
        Api::<Lease>::namespaced(client.clone(), ns),
        LONG,
        "a held Lease",
        |l: &Lease| {
            l.name_any() == "berth-controller"
                && l.spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.as_deref())
                    .is_some_and(|h| !h.is_empty())
        },
    )
    .await
    .expect("someone holds the Lease");
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_crds_get_a_clear_message_then_berth_starts_by_itself() {
    init_logs();
    let bed = TestBed::start(Options::integration()).await.expect("bed");
    let client = bed.client().await.expect("client");

    let berth = Berth::spawn(bed.kubeconfig_path(), &["--leader-elect=false"]);
    berth.wait_log("machines.berth.dev is not installed").await;
    assert!(berth.logs_contain("berth crd | kubectl apply"));
    berth.wait_http("/healthz", 200).await;
    assert_eq!(
        berth.get("/readyz").await.map(|(s, _)| s),
        Some(503),
        "not ready without CRDs"
    );
    assert!(
        !berth.logs_contain("panicked") && !berth.logs_contain("stack backtrace"),
        "a clear message, not a crash"
    );

    // Two of the four: still not ready, and the next missing one named.
    {
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
        use kube::CustomResourceExt;
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        for crd in [MachineClass::crd(), Machine::crd()] {
            crds.create(&PostParams::default(), &crd)
                .await
                .expect("a CRD created");
        }
    }
    berth
        .wait_log("machinesets.berth.dev is not installed")
        .await;
    assert_eq!(
        berth.get("/readyz").await.map(|(s, _)| s),
        Some(503),
        "not ready with two CRDs of four"
    );

    berth::api::install_crds(client.clone(), LONG)
        .await
        .expect("CRDs installed");
    berth.wait_log("caches synced").await;
    berth.wait_http("/readyz", 200).await;

    let status = berth.terminate().await;
    assert!(status.success(), "SIGTERM is a clean exit: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_only_the_leader_acts_and_sigterm_hands_over() {
    init_logs();
    let bed = TestBed::start(Options::integration()).await.expect("bed");
    let client = bed.client().await.expect("client");
    berth::api::install_crds(client.clone(), LONG)
        .await
        .expect("CRDs installed");
    let ns = "replicas";
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &fixtures::namespace(ns))
        .await
        .expect("namespace");
    Api::<MachineClass>::all(client.clone())
        .create(&PostParams::default(), &class("fake-small"))
        .await
        .expect("class");

    let flags = |id: &'static str| {
        [
            "--identity",
            id,
            "--lease-namespace",
            ns,
            "--lease-duration=4s",
            "--namespace",
            ns,
        ]
    };
    let a = Berth::spawn(bed.kubeconfig_path(), &flags("replica-a"));
    let b = Berth::spawn(bed.kubeconfig_path(), &flags("replica-b"));
    let first = holder(&client, ns).await;
    let (leader, standby) = if first == "replica-a" { (a, b) } else { (b, a) };
    let second = if first == "replica-a" {
        "replica-b"
    } else {
        "replica-a"
    };
    leader.wait_log("caches synced").await;
    standby.wait_log("waiting to become leader").await;
    standby.wait_http("/readyz", 200).await;

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .create(&PostParams::default(), &machine("m1", "fake-small"))
        .await
        .expect("m1");
    let by = reporters(&client, ns, "m1").await;
    assert!(
        by.iter().all(|r| *r == first),
        "only the leader {first} acts on m1: {by:?}"
    );
    let (_, metrics) = standby.get("/metrics").await.expect("standby metrics");
    assert!(metrics.contains("berth_leader 0"), "{metrics}");
    let (_, metrics) = leader.get("/metrics").await.expect("leader metrics");
    assert!(metrics.contains("berth_leader 1"), "{metrics}");
    // The provider call and the phase it leads to land a moment after the
    // first Event. (That create happens once per Machine is measured by the
    // benchmark's scale scenario and tested in machine_lifecycle.)
    leader
        .wait_metrics(&[
            r#"berth_provider_requests_total{driver="fake",op="create",result="ok"} "#,
            r#"berth_machines{phase="Creating"} 1"#,
            r#"berth_reconcile_total{result="ok"}"#,
        ])
        .await;

    // SIGTERM: the leader finishes, releases the Lease, and the standby takes
    // over well before the Lease would have expired on its own... or at the
    // latest one lease duration later.
    let status = leader.terminate().await;
    assert!(status.success(), "clean exit on SIGTERM: {status:?}");
    standby.wait_log("became leader").await;
    assert_eq!(holder(&client, ns).await, second);
    machines
        .create(&PostParams::default(), &machine("m2", "fake-small"))
        .await
        .expect("m2");
    let by = reporters(&client, ns, "m2").await;
    assert!(
        by.iter().all(|r| r == second),
        "the new leader {second} acts on m2: {by:?}"
    );
    let m1 = machines.get("m1").await.expect("m1");
    assert!(
        m1.finalizers().iter().any(|f| f == berth::api::FINALIZER),
        "m1 is still owned"
    );
    let status = standby.terminate().await;
    assert!(status.success());
}
