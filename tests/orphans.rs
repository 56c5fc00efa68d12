//! Orphan-VM collection against a real API server, with the `fake`
//! provider (a VM is a ConfigMap `fake-vm-<machine>` labelled
//! `fake.berth.dev/vm=true`, its Machine tags two annotations) and `berth
//! run` as a process of its own, running as its audited identity.
//!
//! Each case has a namespace and a controller (`--namespace`) of its own;
//! the controllers of the cases running at the same time see each other's
//! VMs (the fake provider lists every namespace) and must leave them alone.
//! Times: rounds every 2 s, a grace period of 20 s. Every "not before"
//! is read from the API server's audit log (when the delete arrived against
//! the VM's creationTimestamp) and every "not at all" is asserted after an
//! orphan created later than the VM in question was collected, so that no
//! assertion depends on how fast this machine is.

mod support;

use std::time::Duration;

use berth::api::{Machine, MachineClass};
use berth_devkit::testbed::{Options, TestBed, fixtures, wait};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use serde_json::Value;
use support::audit::{assert_no_request_loop, controller, requests};
use support::process::Berth;
use support::{LONG, class, events_until, machine};
use tokio::sync::OnceCell;

const GRACE: Duration = Duration::from_secs(20);

/// An API server and etcd: orphan collection needs no scheduler, kubelet or
/// controller-manager.
async fn bed() -> &'static TestBed {
    static BED: OnceCell<TestBed> = OnceCell::const_new();
    BED.get_or_init(|| support::start_bed(Options::integration()))
        .await
}

async fn client() -> Client {
    support::init_logs();
    bed().await.client().await.expect("admin client")
}

/// A namespace (the bed runs no controller-manager, so nothing else is in
/// it).
async fn namespace(client: &Client, ns: &str) {
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &fixtures::namespace(ns))
        .await
        .expect("create namespace");
}

async fn create<K>(api: Api<K>, obj: K) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    api.create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| panic!("create {obj:?}: {e}"))
}

/// A fake class named after the case, `spec` its providerSpec, and a class
/// of a driver this controller does not run (`<ns>-elsewhere`), for
/// Machines that must exist without a VM.
async fn classes(client: &Client, ns: &str, spec: Value) {
    let api: Api<MachineClass> = Api::all(client.clone());
    create(api.clone(), class(ns, "fake", spec)).await;
    create(
        api,
        class(&format!("{ns}-elsewhere"), "elsewhere", Value::Null),
    )
    .await;
}

fn provider_id(ns: &str, machine: &str) -> String {
    format!("fake:///{ns}/{machine}")
}

/// A fake VM in `ns`, as the fake provider makes one, for `machine` with
/// Machine tags naming `uid`, or without any tags.
async fn fake_vm(client: &Client, ns: &str, machine: &str, uid: Option<&str>) -> ConfigMap {
    let annotations = uid.map(|uid| {
        serde_json::json!({"fake.berth.dev/machine": machine, "fake.berth.dev/machine-uid": uid})
    });
    let cm: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": format!("fake-vm-{machine}"),
            "labels": {"fake.berth.dev/vm": "true"},
            "annotations": annotations,
        },
        "data": {"providerID": provider_id(ns, machine), "state": "Running"}
    }))
    .expect("configmap");
    create(Api::namespaced(client.clone(), ns), cm).await
}

/// A Machine of the class whose driver is not enabled: it exists, with a
/// UID, and never gets a VM.
async fn machine_without_vm(client: &Client, ns: &str, name: &str) -> Machine {
    create(
        Api::namespaced(client.clone(), ns),
        machine(name, &format!("{ns}-elsewhere")),
    )
    .await
}

/// `berth run` for the case in `ns`, as the audited identity, with JSON
/// logs, once its orphan collection has started.
async fn start(ns: &str, extra: &[&str]) -> Berth {
    let mut flags = vec![
        "--namespace",
        ns,
        "--leader-elect=false",
        "--log-format=json",
        "--orphan-interval=2s",
        "--orphan-grace=20s",
    ];
    flags.extend_from_slice(extra);
    let berth = Berth::spawn(&controller(bed().await).await.kubeconfig, &flags);
    berth
        .unforbidden(
            "starting orphan collection",
            berth.wait_log("collecting orphan VMs"),
        )
        .await;
    berth
}

/// A JSON log line's fields, if it is one with this message.
fn record(line: &str, message: &str) -> Option<Value> {
    let v: Value = serde_json::from_str(line).ok()?;
    v["message"]
        .as_str()
        .is_some_and(|m| m.contains(message))
        .then_some(v)
}

/// Whether `line` has this message and says `provider_id`.
fn about(line: &str, message: &str, provider_id: &str) -> bool {
    record(line, message).is_some_and(|v| v["provider_id"] == provider_id)
}

async fn wait_record(berth: &Berth, message: &str, provider_id: &str) -> Value {
    let line = berth
        .wait_log_line(&format!("{message:?} about {provider_id}"), |l| {
            about(l, message, provider_id)
        })
        .await;
    record(&line, message).expect("the line matched")
}

/// Waits until none of `names` is a ConfigMap in `ns`.
async fn wait_gone(client: &Client, ns: &str, names: &[&str]) {
    wait::for_none(
        Api::<ConfigMap>::namespaced(client.clone(), ns),
        LONG,
        &format!("{names:?} deleted"),
        |cm| names.contains(&cm.name_any().as_str()),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

async fn exists(client: &Client, ns: &str, name: &str) -> bool {
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .expect("get configmap")
        .is_some()
}

/// When the controller's deletes of ConfigMaps in `ns` arrived, by name.
fn deletes(ns: &str, bed: &TestBed) -> Vec<(String, Timestamp)> {
    requests(bed, ns)
        .into_iter()
        .filter(|r| r.verb == "delete" && r.resource == "configmaps")
        .map(|r| (r.name.unwrap_or_default(), r.received))
        .collect()
}

/// `berth_orphan_vms_total{driver="fake",outcome}` on the controller's
/// `/metrics`.
async fn orphans_counted(berth: &Berth, outcome: &str) -> u64 {
    let (_, body) = berth.get("/metrics").await.expect("/metrics answers");
    let series = format!("berth_orphan_vms_total{{driver=\"fake\",outcome=\"{outcome}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in /metrics:\n{body}"))
}

/// A VM whose Machine is gone is kept while it is younger than the grace
/// period, then deleted; when a new Machine has taken the old one's name,
/// it is told in an Event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tagged_orphan_is_kept_while_young_then_collected() {
    let client = client().await;
    let ns = "orphans-collect";
    namespace(&client, ns).await;
    classes(&client, ns, serde_json::json!({})).await;
    let again = machine_without_vm(&client, ns, "again").await;
    let berth = start(ns, &[]).await;

    // No Machine named ghost; "again" exists, made after the Machine its
    // VM's tags name.
    let ghost = fake_vm(&client, ns, "ghost", Some("uid-ghost-gone")).await;
    let earlier = fake_vm(&client, ns, "again", Some("uid-again-earlier")).await;
    for id in [provider_id(ns, "ghost"), provider_id(ns, "again")] {
        wait_record(&berth, "younger than --orphan-grace", &id).await;
    }
    wait_gone(&client, ns, &["fake-vm-ghost", "fake-vm-again"]).await;

    // Not before the grace period, by the API server's clock. The audit
    // line of a delete is written once its response is complete, which can
    // be after the watch has told the deletion: read until both are there.
    let mut deleted = deletes(ns, bed().await);
    for _ in 0..50 {
        if [&ghost, &earlier]
            .iter()
            .all(|cm| deleted.iter().any(|(n, _)| *n == cm.name_any()))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        deleted = deletes(ns, bed().await);
    }
    for cm in [&ghost, &earlier] {
        let created = cm.metadata.creation_timestamp.as_ref().expect("created").0;
        let at: Vec<Timestamp> = deleted
            .iter()
            .filter(|(n, _)| *n == cm.name_any())
            .map(|(_, t)| *t)
            .collect();
        assert_eq!(at.len(), 1, "{} deleted once: {deleted:?}", cm.name_any());
        assert!(
            at[0] >= created + SignedDuration::try_from(GRACE).expect("grace"),
            "{} deleted at {} though created at {created}",
            cm.name_any(),
            at[0]
        );
    }

    let log = wait_record(&berth, "orphan VM collected", &provider_id(ns, "ghost")).await;
    for (field, want) in [
        ("driver", "fake"),
        ("machine_namespace", ns),
        ("machine_name", "ghost"),
        ("machine_uid", "uid-ghost-gone"),
        ("outcome", "collected"),
    ] {
        assert_eq!(log[field], want, "{field} in {log}");
    }
    assert!(log["age"].as_str().is_some_and(|a| !a.is_empty()), "{log}");

    // The Machine that has the name now is told, with the earlier one as
    // the related object; nothing is said about ghost, which has none.
    let events = events_until(&client, ns, "again", &["OrphanVmCollected"]).await;
    let event = events
        .iter()
        .find(|e| e.reason.as_deref() == Some("OrphanVmCollected"))
        .expect("the Event");
    assert_eq!(
        event.regarding.as_ref().and_then(|r| r.uid.as_deref()),
        again.metadata.uid.as_deref()
    );
    assert_eq!(
        event.related.as_ref().and_then(|r| r.uid.as_deref()),
        Some("uid-again-earlier")
    );
    assert!(
        event
            .note
            .as_deref()
            .is_some_and(|n| n.contains(&provider_id(ns, "again"))),
        "{:?}",
        event.note
    );
    assert_eq!(orphans_counted(&berth, "collected").await, 2);
    assert_eq!(orphans_counted(&berth, "would_collect").await, 0);
    assert_no_request_loop(
        bed().await,
        "a_tagged_orphan_is_kept_while_young_then_collected",
        ns,
    );
    berth.terminate().await;
}

/// A VM with the cluster's mark and no Machine tags is never touched and
/// reported once; a tagged orphan of a namespace this controller does not
/// watch is not its to judge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untagged_vms_and_other_namespaces_vms_are_never_touched() {
    let client = client().await;
    let ns = "orphans-untagged";
    let elsewhere = "orphans-untagged-unwatched";
    namespace(&client, ns).await;
    namespace(&client, elsewhere).await;
    classes(&client, ns, serde_json::json!({})).await;
    fake_vm(&client, ns, "bare", None).await;
    fake_vm(&client, elsewhere, "ghost", Some("uid-unwatched")).await;
    let berth = start(ns, &[]).await;
    wait_record(&berth, "carries no Machine tags", &provider_id(ns, "bare")).await;

    // An orphan made after both: once it is collected, both were older
    // than the grace period in that round.
    fake_vm(&client, ns, "ghost", Some("uid-ghost-gone")).await;
    wait_gone(&client, ns, &["fake-vm-ghost"]).await;
    assert!(exists(&client, ns, "fake-vm-bare").await);
    assert!(exists(&client, elsewhere, "fake-vm-ghost").await);
    assert_eq!(
        deletes(ns, bed().await)
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        ["fake-vm-ghost"]
    );
    assert!(deletes(elsewhere, bed().await).is_empty());

    // Reported once over the ten or so rounds.
    let bare = provider_id(ns, "bare");
    let reports = berth.log_lines_where(|l| about(l, "carries no Machine tags", &bare));
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert_eq!(orphans_counted(&berth, "collected").await, 1);
    assert_no_request_loop(
        bed().await,
        "untagged_vms_and_other_namespaces_vms_are_never_touched",
        ns,
    );
    berth.terminate().await;
}

/// The VM of a Machine whose create returned but whose providerID was
/// never written (here the fake provider made the VM, then refused the
/// create for good) is kept: its Machine exists by UID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_whose_machine_exists_by_uid_is_kept() {
    let client = client().await;
    let ns = "orphans-kept";
    namespace(&client, ns).await;
    classes(
        &client,
        ns,
        serde_json::json!({"failCreatePermanently": true}),
    )
    .await;
    let berth = start(ns, &[]).await;
    let m = create(
        Api::<Machine>::namespaced(client.clone(), ns),
        machine("m", ns),
    )
    .await;
    let vm = wait::for_one(
        Api::<ConfigMap>::namespaced(client.clone(), ns),
        LONG,
        "the VM of m",
        |cm| cm.name_any() == "fake-vm-m",
    )
    .await
    .expect("the fake provider makes the VM");
    assert_eq!(
        vm.annotations()
            .get("fake.berth.dev/machine-uid")
            .map(String::as_str),
        m.metadata.uid.as_deref()
    );

    fake_vm(&client, ns, "ghost", Some("uid-ghost-gone")).await;
    wait_gone(&client, ns, &["fake-vm-ghost"]).await;
    assert!(exists(&client, ns, "fake-vm-m").await);
    let m = Api::<Machine>::namespaced(client.clone(), ns)
        .get("m")
        .await
        .expect("m");
    assert_eq!(m.spec.provider_id, None, "the providerID was never written");
    assert!(
        !deletes(ns, bed().await)
            .iter()
            .any(|(n, _)| n == "fake-vm-m"),
        "the VM of m was never deleted"
    );
    assert_eq!(orphans_counted(&berth, "collected").await, 1);
    assert_no_request_loop(bed().await, "a_vm_whose_machine_exists_by_uid_is_kept", ns);
    berth.terminate().await;
}

/// `--orphan-dry-run` reports each orphan (log, metric, Event where a
/// Machine has its name) and deletes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_reports_orphans_and_deletes_nothing() {
    let client = client().await;
    let ns = "orphans-dry";
    namespace(&client, ns).await;
    classes(&client, ns, serde_json::json!({})).await;
    machine_without_vm(&client, ns, "again").await;
    fake_vm(&client, ns, "ghost", Some("uid-ghost-gone")).await;
    fake_vm(&client, ns, "again", Some("uid-again-earlier")).await;
    let berth = start(ns, &["--orphan-dry-run"]).await;

    for id in [provider_id(ns, "ghost"), provider_id(ns, "again")] {
        let log = wait_record(&berth, "not deleted (--orphan-dry-run)", &id).await;
        assert_eq!(log["outcome"], "would_collect", "{log}");
    }
    let events = events_until(&client, ns, "again", &["OrphanVmFound"]).await;
    assert!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("OrphanVmFound")
                && e.type_.as_deref() == Some("Warning")),
        "{events:?}"
    );
    assert!(orphans_counted(&berth, "would_collect").await >= 2);
    assert_eq!(orphans_counted(&berth, "collected").await, 0);
    assert!(exists(&client, ns, "fake-vm-ghost").await);
    assert!(exists(&client, ns, "fake-vm-again").await);
    assert!(deletes(ns, bed().await).is_empty());
    assert_no_request_loop(
        bed().await,
        "a_dry_run_reports_orphans_and_deletes_nothing",
        ns,
    );
    berth.terminate().await;
}
