//! Drains on a pool of fake Machines, shared by the drain test files: a test
//! bed with slow attach and detach, a class per pool, Running Machines, and
//! the Machine's Events read back as a timeline.

use std::time::Duration;

use berth::api::Machine;
use berth::providers::fake::FakeProvider;
use berth_devkit::testbed::{Options, TestBed, wait};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::OnceCell;

use super::{LONG, class, machine, phase};

/// The label a pool's Nodes carry (`testbed.berth.dev/pool: <pool>`).
pub const POOL: &str = "testbed.berth.dev/pool";

/// One control plane for the test file, with simulated CSI attach and
/// detach taking `attach` and `detach` (the first call's values hold), and
/// an audit log of the controller's requests (see `support::audit`).
pub async fn delayed_bed(attach: Duration, detach: Duration) -> &'static TestBed {
    static BED: OnceCell<TestBed> = OnceCell::const_new();
    super::init_logs();
    BED.get_or_init(|| async {
        let user = super::audit::controller_user();
        let bed = TestBed::start(
            Options::end_to_end()
                .attach_delay(attach)
                .detach_delay(detach)
                .audit_only(&[&user]),
        )
        .await
        .expect("the end-to-end test bed starts");
        let client = bed.client().await.expect("client");
        berth::api::install_crds(client, LONG)
            .await
            .expect("CRDs installed");
        bed
    })
    .await
}

pub fn json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("valid object")
}

/// Creates `obj`, or keeps the one of that name.
pub async fn create<K>(api: Api<K>, obj: K)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let name = obj.name_any();
    berth_devkit::testbed::create_or_keep(api, obj)
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"));
}

/// A pool of fake Machines: class `pool` whose Nodes carry the pool label.
pub async fn pool_class(client: &Client, pool: &str, drain: serde_json::Value) {
    let mut c = class(
        pool,
        "fake",
        serde_json::json!({"nodeLabels": {POOL: pool}}),
    );
    c.spec.drain = Some(serde_json::from_value(drain).expect("drain settings"));
    create(Api::all(client.clone()), c).await;
}

/// A Machine `name` of `class`, once Running; returns its Node's name.
pub async fn running_machine(client: &Client, ns: &str, name: &str, class: &str) -> String {
    running(client, ns, machine(name, class)).await
}

/// Creates `m` and waits until it runs; returns its Node's name.
pub async fn running(client: &Client, ns: &str, m: Machine) -> String {
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let name = m.name_any();
    machines
        .create(&PostParams::default(), &m)
        .await
        .expect("create machine");
    wait::for_one(machines, LONG, "Machine Running", |m| {
        m.name_any() == name && phase(m) == Some("Running")
    })
    .await
    .expect("the Machine runs");
    FakeProvider::node_name(ns, &name)
}

pub fn on_node(p: &Pod, node: &str) -> bool {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
}

pub fn pod_running(p: &Pod) -> bool {
    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// One Event: when, reason, note.
pub type Ev = (k8s_openapi::jiff::Timestamp, String, String);

/// Berth's Events about a Machine, oldest first, once its drain's last one
/// is in.
pub async fn events(client: &Client, ns: &str, machine: &str) -> Vec<Ev> {
    super::events_until(
        client,
        ns,
        machine,
        &["Drained", "DrainForced", "DrainFailed"],
    )
    .await
    .iter()
    .filter_map(|e| {
        let t = e.event_time.as_ref().map(|t| t.0)?;
        Some((
            t,
            e.reason.clone().unwrap_or_default(),
            e.note.clone().unwrap_or_default(),
        ))
    })
    .collect()
}

/// The first Event of `reason` whose note contains `needle`.
pub fn first<'a>(evs: &'a [Ev], reason: &str, needle: &str) -> Option<&'a Ev> {
    evs.iter()
        .find(|(_, r, n)| r == reason && n.contains(needle))
}

/// The Events as lines, for assertion messages.
pub fn log_of(evs: &[Ev]) -> String {
    evs.iter()
        .map(|(t, r, n)| format!("{t} {r}: {n}"))
        .collect::<Vec<_>>()
        .join("\n")
}
