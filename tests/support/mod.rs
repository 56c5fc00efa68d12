//! Shared set-up for tests that run the controller against the test bed.
#![allow(dead_code)]

pub mod audit;
pub mod aws;
pub mod case;
pub mod nodes;
pub mod oracle;
pub mod pool;
pub mod process;

#[allow(unused_imports)]
pub use case::Case;

use std::sync::Arc;
use std::time::Duration;

use berth::api::{Machine, MachineClass, MachineDeployment, MachineSet};
use berth::providers::fake::FakeProvider;
use berth_devkit::testbed::{Options, TestBed, fixtures, wait};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::OnceCell;

pub const LONG: Duration = Duration::from_secs(60);

/// Berth's Events about `regarding` in `ns`, oldest first, once `ready`
/// holds over them (`what` names the wait). The controller publishes
/// Events from a queue, in order, after the step they record: a Machine
/// can be gone before its last Events are in, so a test waits for the
/// Event it needs rather than listing once.
pub async fn events(
    client: &Client,
    ns: &str,
    regarding: &str,
    what: &str,
    ready: impl Fn(&[&Event]) -> bool,
) -> Vec<Event> {
    let about = |e: &Event| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(regarding);
    let all = wait::until(
        Api::<Event>::namespaced(client.clone(), ns),
        LONG,
        &format!("{regarding}: {what}"),
        |evs| {
            ready(
                &evs.iter()
                    .map(|e| &**e)
                    .filter(|e| about(e))
                    .collect::<Vec<_>>(),
            )
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut out: Vec<Event> = all
        .iter()
        .filter(|e| about(e))
        .map(|e| (**e).clone())
        .collect();
    out.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
    out
}

/// [`events`] about a Machine once one of them has one of the `last`
/// reasons (a drain's `Drained`, a deletion's `DeleteVmAndNode`).
pub async fn events_until(client: &Client, ns: &str, machine: &str, last: &[&str]) -> Vec<Event> {
    events(client, ns, machine, &format!("an Event {last:?}"), |evs| {
        evs.iter()
            .any(|e| e.reason.as_deref().is_some_and(|r| last.contains(&r)))
    })
    .await
}

/// [`events`] of `reason` about `regarding`, once there are `n`.
pub async fn events_of(
    client: &Client,
    ns: &str,
    regarding: &str,
    reason: &str,
    n: usize,
) -> Vec<Event> {
    let of = |e: &Event| e.reason.as_deref() == Some(reason);
    events(
        client,
        ns,
        regarding,
        &format!("{n} {reason} Events"),
        |evs| evs.iter().filter(|e| of(e)).count() >= n,
    )
    .await
    .into_iter()
    .filter(|e| of(e))
    .collect()
}

/// The names of `objs`, sorted (to compare with [`audit::deleted`]).
pub fn sorted_names<K: kube::Resource>(objs: &[K]) -> Vec<String> {
    let mut names: Vec<String> = objs.iter().map(|o| o.name_any()).collect();
    names.sort();
    names
}

/// The notes of `evs`.
pub fn notes(evs: &[Event]) -> Vec<String> {
    evs.iter()
        .map(|e| e.note.clone().unwrap_or_default())
        .collect()
}

/// The reasons of `evs`, each with its note.
pub fn reason_notes(evs: &[Event]) -> Vec<(String, String)> {
    reasons(evs).into_iter().zip(notes(evs)).collect()
}

/// The reasons of `evs`.
pub fn reasons(evs: &[Event]) -> Vec<String> {
    evs.iter()
        .map(|e| e.reason.clone().unwrap_or_default())
        .collect()
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

pub use berth_devkit::testbed::fixtures::machine;

/// A MachineClass of the tests: a Machine not Running within 2 minutes has
/// failed.
pub fn class(name: &str, provider: &str, provider_spec: serde_json::Value) -> MachineClass {
    let mut c = fixtures::machine_class(name, provider, provider_spec);
    c.spec.creation_timeout = Some("2m".into());
    c
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

/// What `m`'s `status.lastOperation` says, in words (empty without one).
pub fn last_operation(m: &Machine) -> String {
    m.status
        .as_ref()
        .and_then(|s| s.last_operation.as_ref())
        .map(|o| o.description.clone())
        .unwrap_or_default()
}

/// The step of `m`'s `status.lastOperation`, if it has one.
pub fn last_operation_step(m: &Machine) -> Option<&str> {
    m.status
        .as_ref()
        .and_then(|s| s.last_operation.as_ref())
        .map(|o| o.step.as_str())
}

/// Asserts that Machine `machine`'s VM (the fake provider's) and its Node
/// `node` are gone.
pub async fn assert_vm_and_node_gone(client: &Client, ns: &str, machine: &str, node: &str) {
    let vm = FakeProvider::vm_name(machine);
    let vm_left = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client.clone(), ns)
        .get_opt(&vm)
        .await
        .expect("get the VM");
    assert!(vm_left.is_none(), "{machine}'s VM {vm} is gone");
    let node_left = Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
        .get_opt(node)
        .await
        .expect("get the Node");
    assert!(node_left.is_none(), "{machine}'s Node {node} is gone");
}

/// What `m`'s drain says it waits for in its workload's move budget
/// (`status.drain.waitingForBudget`; empty without one).
pub fn waiting_for_budget(m: &Machine) -> &str {
    m.status
        .as_ref()
        .and_then(|s| s.drain.as_ref())
        .and_then(|d| d.waiting_for_budget.as_deref())
        .unwrap_or_default()
}

/// One of berth's kinds, whose status has conditions.
pub trait Conditioned {
    fn conditions(&self) -> &[Condition];
}

impl Conditioned for Machine {
    fn conditions(&self) -> &[Condition] {
        self.status.as_ref().map_or(&[], |s| &s.conditions)
    }
}

impl Conditioned for MachineSet {
    fn conditions(&self) -> &[Condition] {
        self.status.as_ref().map_or(&[], |s| &s.conditions)
    }
}

impl<T: Conditioned> Conditioned for Arc<T> {
    fn conditions(&self) -> &[Condition] {
        (**self).conditions()
    }
}

impl Conditioned for MachineDeployment {
    fn conditions(&self) -> &[Condition] {
        self.status.as_ref().map_or(&[], |s| &s.conditions)
    }
}

/// The condition `type_` of `obj`, if it has one.
pub fn condition<'a>(obj: &'a impl Conditioned, type_: &str) -> Option<&'a Condition> {
    obj.conditions().iter().find(|c| c.type_ == type_)
}

pub fn last_step(m: &Machine) -> Option<(String, String)> {
    m.status
        .as_ref()?
        .last_operation
        .as_ref()
        .map(|o| (o.step.clone(), o.state.clone()))
}
