//! Shared set-up for tests that run the controller against the test bed.
#![allow(dead_code)]

pub mod audit;
pub mod aws;
pub mod oracle;
pub mod pool;
pub mod process;

use std::sync::Arc;
use std::time::Duration;

use berth::api::{Machine, MachineClass};
use berth::providers::Registry;
use berth::providers::fake::FakeProvider;
use berth_devkit::testbed::{Options, TestBed, fixtures, wait};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::OnceCell;

pub const LONG: Duration = Duration::from_secs(60);

/// A Machine's Events, oldest first, once one of them has one of the
/// `last` reasons (a drain's `Drained`, a deletion's `DeleteVmAndNode`).
/// The controller publishes Events from a queue, in order, after the step
/// they record: a Machine can be gone before its last Events are in, and a
/// fresh CI run once listed them 25 ms too early.
pub async fn events_until(
    client: &Client,
    ns: &str,
    machine: &str,
    last: &[&str],
) -> Vec<Arc<Event>> {
    let about = |e: &Event| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(machine);
    let all = wait::until(
        Api::<Event>::namespaced(client.clone(), ns),
        LONG,
        &format!("{machine}: an Event {last:?}"),
        |evs| {
            evs.iter()
                .any(|e| about(e) && e.reason.as_deref().is_some_and(|r| last.contains(&r)))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut out: Vec<Arc<Event>> = all.into_iter().filter(|e| about(e)).collect();
    out.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
    out
}

/// One end-to-end control plane per test binary, with the CRDs installed.
pub async fn bed() -> &'static TestBed {
    static BED: OnceCell<TestBed> = OnceCell::const_new();
    BED.get_or_init(|| start_bed(Options::end_to_end())).await
}

/// A control plane of `options` that audits the controller's requests (see
/// `audit`, both of its identities), with the CRDs installed.
pub async fn start_bed(options: Options) -> TestBed {
    let bed =
        TestBed::start(options.audit_only(&[&audit::controller_user(), &audit::restricted_user()]))
            .await
            .expect("the end-to-end test bed starts");
    let client = bed.client().await.expect("client");
    berth::api::install_crds(client, LONG)
        .await
        .expect("CRDs installed");
    bed
}

/// Logs of the controller under test, shown for failing tests
/// (`RUST_LOG=berth=debug` for more).
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "berth=info".into()),
        )
        .with_test_writer()
        .try_init();
}

pub async fn client() -> Client {
    init_logs();
    bed().await.client().await.expect("admin client")
}

/// A fresh namespace whose `default` ServiceAccount exists.
pub async fn namespace(client: &Client, ns: &str) {
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &fixtures::namespace(ns))
        .await
        .expect("create namespace");
    wait::for_one(
        Api::<ServiceAccount>::namespaced(client.clone(), ns),
        LONG,
        "default SA",
        |sa| sa.name_any() == "default",
    )
    .await
    .expect("default service account");
}

/// The controller, scoped to one namespace, running in this process, and
/// its metrics.
pub struct Running(
    berth::wiring::manager::Spawned,
    Arc<berth::telemetry::Metrics>,
);

impl Running {
    /// Graceful shutdown; waits for the controller to finish.
    pub async fn stop(self) {
        self.0.stop(LONG).await;
    }

    /// What the controller's metrics endpoint would show.
    pub fn metrics(&self) -> &berth::telemetry::Metrics {
        &self.1
    }
}

pub async fn start_controller(client: &Client, ns: &str, instance: &str) -> Running {
    let providers = Registry::default().with(Arc::new(FakeProvider::new(client.clone())));
    let settings = berth::wiring::manager::Settings {
        namespace: Some(ns.to_string()),
        instance: instance.to_string(),
        concurrency: 4,
        ..Default::default()
    };
    let metrics = Arc::new(berth::telemetry::Metrics::new().expect("metrics"));
    let mut spawned =
        berth::wiring::manager::spawn(client.clone(), providers, settings, Arc::clone(&metrics));
    tokio::time::timeout(LONG, &mut spawned.ready)
        .await
        .expect("caches sync in time")
        .expect("controller reports ready");
    Running(spawned, metrics)
}

pub fn class(name: &str, provider: &str, provider_spec: serde_json::Value) -> MachineClass {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "berth.dev/v1alpha1",
        "kind": "MachineClass",
        "metadata": {"name": name},
        "spec": {"provider": provider, "providerSpec": provider_spec, "creationTimeout": "2m"}
    }))
    .expect("class")
}

pub fn machine(name: &str, class: &str) -> Machine {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "berth.dev/v1alpha1",
        "kind": "Machine",
        "metadata": {"name": name},
        "spec": {"classRef": {"name": class}}
    }))
    .expect("machine")
}

/// Waits for Machine `name` of `ns` to match `f`; returns it.
pub async fn wait_machine(
    client: &Client,
    ns: &str,
    name: &str,
    what: &str,
    f: impl Fn(&Machine) -> bool,
) -> Machine {
    let m = wait::for_one(
        Api::<Machine>::namespaced(client.clone(), ns),
        LONG,
        &format!("{name}: {what}"),
        |m| m.name_any() == name && f(m),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    (*m).clone()
}

pub fn phase(m: &Machine) -> Option<&'static str> {
    m.status.as_ref().and_then(|s| s.phase).map(|p| p.as_str())
}

pub fn condition<'a>(
    m: &'a Machine,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    m.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
}

pub fn last_step(m: &Machine) -> Option<(String, String)> {
    m.status
        .as_ref()?
        .last_operation
        .as_ref()
        .map(|o| (o.step.clone(), o.state.clone()))
}
