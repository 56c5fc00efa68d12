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
use berth_devkit::testbed::{Options, TestBed, wait};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use serde_json::Value;
use support::audit::requests;
use support::process::Berth;
use support::{Case, LONG, class, events_until, machine};
use tokio::sync::OnceCell;

const GRACE: Duration = Duration::from_secs(20);

/// An API server and etcd: orphan collection needs no scheduler, kubelet or
/// controller-manager.
async fn bed() -> &'static TestBed {
    static BED: OnceCell<TestBed> = OnceCell::const_new();
    BED.get_or_init(|| support::start_bed(Options::integration()))
        .await
}

/// A case of its own in `ns` (the bed runs no controller-manager, so
/// nothing else is in its namespace); berth is the case's to start.
async fn bare_case(ns: &str) -> Case {
    Case::builder(ns)
        .on(bed().await)
        .without_service_account()
        .build()
        .await
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

/// `berth run` for `case`, as the audited identity, with JSON logs, once
/// its orphan collection has started.
async fn start<'c>(case: &'c mut Case, extra: &[&str]) -> &'c Berth {
    let ns = case.ns.clone();
    let mut flags = vec![
        "--namespace",
        &ns,
        "--leader-elect=false",
        "--log-format=json",
        "--orphan-interval=2s",
        "--orphan-grace=20s",
    ];
    flags.extend_from_slice(extra);
    let berth = case.spawn(&flags).await;
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

/// Waits until `berth`'s count of collected orphans reads `n`, never more:
/// the metric is what operators are told, counted once the deletion has
/// returned, a moment after the cluster has seen the VM go (what the case
/// waited for).
async fn collected(berth: &Berth, n: u64) {
    let until = tokio::time::Instant::now() + LONG;
    loop {
        let now = orphans_counted(berth, "collected").await;
        assert!(now <= n, "{now} orphans counted collected, {n} expected");
        if now == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{n} orphans counted collected within {LONG:?}: {now}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// [`bare_case`] and its classes (no extra providerSpec).
async fn case(ns: &str) -> Case {
    let case = bare_case(ns).await;
    classes(&case.client, ns, serde_json::json!({})).await;
    case
}

/// A VM whose Machine is gone is kept while it is younger than the grace
/// period, then deleted; when a new Machine has taken the old one's name,
/// it is told in an Event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tagged_orphan_is_kept_while_young_then_collected() {
    let ns = "orphans-collect";
    let mut case = case(ns).await;
    let client = case.client();
    let again = machine_without_vm(&client, ns, "again").await;
    let berth = start(&mut case, &[]).await;

    // No Machine named ghost; "again" exists, made after the Machine its
    // VM's tags name.
    let ghost = fake_vm(&client, ns, "ghost", Some("uid-ghost-gone")).await;
    let earlier = fake_vm(&client, ns, "again", Some("uid-again-earlier")).await;
    for id in [provider_id(ns, "ghost"), provider_id(ns, "again")] {
        wait_record(berth, "younger than --orphan-grace", &id).await;
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

    let log = wait_record(berth, "orphan VM collected", &provider_id(ns, "ghost")).await;
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
    collected(berth, 2).await;
    assert_eq!(orphans_counted(berth, "would_collect").await, 0);
}

/// A VM with the cluster's mark and no Machine tags is never touched and
/// reported once; a tagged orphan of a namespace this controller does not
/// watch is not its to judge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untagged_vms_and_other_namespaces_vms_are_never_touched() {
    let ns = "orphans-untagged";
    let elsewhere = "orphans-untagged-unwatched";
    let mut case = bare_case(ns).await;
    let client = case.client();
    let _elsewhere = bare_case(elsewhere).await;
    classes(&client, ns, serde_json::json!({})).await;
    fake_vm(&client, ns, "bare", None).await;
    fake_vm(&client, elsewhere, "ghost", Some("uid-unwatched")).await;
    let berth = start(&mut case, &[]).await;
    wait_record(berth, "carries no Machine tags", &provider_id(ns, "bare")).await;

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
    collected(berth, 1).await;
}

/// The VM of a Machine whose create returned but whose providerID was
/// never written (here the fake provider made the VM, then refused the
/// create for good) is kept: its Machine exists by UID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_whose_machine_exists_by_uid_is_kept() {
    let ns = "orphans-kept";
    let mut case = bare_case(ns).await;
    let client = case.client();
    classes(
        &client,
        ns,
        serde_json::json!({"failCreatePermanently": true}),
    )
    .await;
    let berth = start(&mut case, &[]).await;
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
    collected(berth, 1).await;
}

/// `--orphan-dry-run` reports each orphan (log, metric, Event where a
/// Machine has its name) and deletes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_reports_orphans_and_deletes_nothing() {
    let ns = "orphans-dry";
    let mut case = case(ns).await;
    let client = case.client();
    machine_without_vm(&client, ns, "again").await;
    fake_vm(&client, ns, "ghost", Some("uid-ghost-gone")).await;
    fake_vm(&client, ns, "again", Some("uid-again-earlier")).await;
    let berth = start(&mut case, &["--orphan-dry-run"]).await;

    for id in [provider_id(ns, "ghost"), provider_id(ns, "again")] {
        let log = wait_record(berth, "not deleted (--orphan-dry-run)", &id).await;
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
    assert!(orphans_counted(berth, "would_collect").await >= 2);
    assert_eq!(orphans_counted(berth, "collected").await, 0);
    assert!(exists(&client, ns, "fake-vm-ghost").await);
    assert!(exists(&client, ns, "fake-vm-again").await);
    assert!(deletes(ns, bed().await).is_empty());
}

/// A Node of `vm` (its providerID), as a kubelet registers one.
async fn node_of_vm(client: &Client, name: &str, provider_id: &str) -> Node {
    create(
        Api::all(client.clone()),
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"providerID": provider_id}
        }))
        .expect("node"),
    )
    .await
}

/// An orphan VM whose Node still runs a pod is never terminated without a
/// drain: it is held and named (log, metric), its Node and pod untouched.
/// One whose Node runs nothing is collected, and its Node deleted with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_whose_node_runs_pods_is_held_and_an_empty_ones_node_goes_with_it() {
    let ns = "orphans-node";
    let mut case = case(ns).await;
    let client = case.client();
    let berth = start(&mut case, &[]).await;
    fake_vm(&client, ns, "busy", Some("uid-busy-gone")).await;
    let busy = node_of_vm(&client, &format!("{ns}-busy"), &provider_id(ns, "busy")).await;
    create(
        Api::<Pod>::namespaced(client.clone(), ns),
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "app"},
            "spec": {"nodeName": busy.name_any(),
                "containers": [{"name": "main", "image": "registry.invalid/app:1"}]}
        }))
        .expect("pod"),
    )
    .await;
    fake_vm(&client, ns, "empty", Some("uid-empty-gone")).await;
    let empty = node_of_vm(&client, &format!("{ns}-empty"), &provider_id(ns, "empty")).await;

    // An orphan made after both: once it is collected, both were older
    // than the grace period in that round.
    fake_vm(&client, ns, "ghost", Some("uid-ghost-gone")).await;
    wait_gone(&client, ns, &["fake-vm-empty", "fake-vm-ghost"]).await;
    let held = wait_record(berth, "orphan VM held", &provider_id(ns, "busy")).await;
    assert!(
        held["why"]
            .as_str()
            .is_some_and(|w| w.contains(&busy.name_any()) && w.contains(&format!("{ns}/app"))),
        "{held}"
    );
    assert!(exists(&client, ns, "fake-vm-busy").await);
    let nodes: Api<Node> = Api::all(client.clone());
    let still = nodes.get(&busy.name_any()).await.expect("the busy Node");
    assert_eq!(still.metadata.uid, busy.metadata.uid);
    assert!(
        Api::<Pod>::namespaced(client.clone(), ns)
            .get("app")
            .await
            .expect("its pod")
            .metadata
            .deletion_timestamp
            .is_none()
    );
    wait::for_none(nodes.clone(), LONG, "the empty Node deleted", |n| {
        n.name_any() == empty.name_any()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(orphans_counted(berth, "held").await >= 1);
    collected(berth, 2).await;
    // The clean-up below is not the case's work.
    case.finish().await;
    let _ = nodes.delete(&busy.name_any(), &Default::default()).await;
}

/// Six VMs without a Machine in a fleet of six: more than one round may
/// take (a tenth of the fleet, at least five). The rounds collect none and
/// say so, each holding the six; once two are gone by other hands, the
/// rest is collected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_that_finds_too_many_orphans_collects_none() {
    let ns = "orphans-bound";
    let mut case = case(ns).await;
    let client = case.client();
    let berth = start(&mut case, &[]).await;
    let names: Vec<String> = (0..6).map(|i| format!("lost-{i}")).collect();
    for n in &names {
        fake_vm(&client, ns, n, Some(&format!("uid-{n}"))).await;
    }
    berth
        .wait_log_line("orphan collection stopped", |l| {
            record(l, "orphan collection stopped").is_some_and(|v| v["orphaned"] == 6)
        })
        .await;
    // All six past the grace and held in one round: six held at least.
    let until = tokio::time::Instant::now() + LONG;
    while orphans_counted(berth, "held").await < 6 {
        assert!(
            tokio::time::Instant::now() < until,
            "six orphans held within {LONG:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for n in &names {
        assert!(exists(&client, ns, &format!("fake-vm-{n}")).await, "{n}");
    }
    assert!(deletes(ns, bed().await).is_empty());

    let vms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    for n in &names[..2] {
        vms.delete(&format!("fake-vm-{n}"), &Default::default())
            .await
            .expect("delete by hand");
    }
    let rest: Vec<String> = names[2..].iter().map(|n| format!("fake-vm-{n}")).collect();
    let rest: Vec<&str> = rest.iter().map(String::as_str).collect();
    wait_gone(&client, ns, &rest).await;
    collected(berth, 4).await;
}
