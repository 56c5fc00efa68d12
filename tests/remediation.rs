//! A Machine that dies (issue 39): past its health timeout its VM is
//! fenced by its provider, only then is its Node tainted out of service
//! and its pods freed, their moves through the move ledger, and the
//! Machine replaced; never while too many Machines are unhealthy, never
//! after its Node came back. The truth is the cluster: the fake VM's
//! record (its ConfigMap), the Node, the pods and VolumeAttachments as
//! watches see them, the audit log of berth's writes.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth::api::{Machine, MachineSet};
use berth::providers::fake::FakeProvider;
use berth_devkit::testbed::fixtures::machine_set;
use berth_devkit::testbed::wait;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use support::nodes::{is_ready, kill, kill_all, revive};
use support::oracle::{self, Seen, Watches};
use support::pool::{Bed, POOL, create, gone, json, running_machine, running_pods, stateful};
use support::{Case, LONG, condition};

const BED: Bed = Bed {
    attach: Duration::from_secs(1),
    detach: Duration::from_secs(1),
};

/// The health timeout of the cases' classes.
const HEALTH: Duration = Duration::from_secs(5);

const OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service";

/// The fake class `name` of pool `ns`: its Nodes carry the pool label, a
/// 5 s health timeout, `remediation` (`null`: none) and `extra` in its
/// `providerSpec`.
async fn class(
    client: &Client,
    ns: &str,
    name: &str,
    remediation: serde_json::Value,
    extra: serde_json::Value,
) {
    let mut spec = serde_json::json!({"nodeLabels": {POOL: ns}});
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    let mut c = support::class(name, "fake", spec);
    c.spec.health_timeout = Some("5s".into());
    c.spec.drain = Some(json(serde_json::json!({"timeout": "5m"})));
    if !remediation.is_null() {
        c.spec.remediation = Some(json(remediation));
    }
    create(Api::all(client.clone()), c).await;
}

/// A case in `ns` on the file's bed, its pool's class made (see
/// [`class`]); its controller is the test's to start.
async fn remedy_case(
    ns: &str,
    remediation: serde_json::Value,
    extra: serde_json::Value,
) -> (Case, Client) {
    let case = Case::builder(ns).on(BED).build().await;
    let client = case.client();
    class(&client, ns, ns, remediation, extra).await;
    (case, client)
}

/// Every version of one object a watch saw, with its resourceVersion (an
/// etcd revision: ordered across kinds, so two objects' changes can be
/// put in the order the API server committed them).
struct Versions<K> {
    seen: Arc<Mutex<Vec<(u64, K)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl<K> Versions<K>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    /// Watches `name` of `api`; returns once the watch has listed.
    async fn start(api: Api<K>, name: &str) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let task = {
            let seen = Arc::clone(&seen);
            tokio::spawn(async move {
                let mut tx = Some(tx);
                let mut events = watcher(api, config).boxed();
                while let Some(ev) = events.next().await {
                    match ev {
                        Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                            let rv = o.meta().resource_version.clone().unwrap_or_default();
                            if let (Ok(rv), Ok(mut s)) = (rv.parse::<u64>(), seen.lock()) {
                                s.push((rv, o));
                            }
                        }
                        Ok(watcher::Event::InitDone) => {
                            if let Some(tx) = tx.take() {
                                let _ = tx.send(());
                            }
                        }
                        _ => {}
                    }
                }
            })
        };
        let _ = tokio::time::timeout(LONG, rx).await;
        Self { seen, task }
    }

    /// The first version seen for which `pred` holds.
    fn first(&self, pred: impl Fn(&K) -> bool) -> Option<u64> {
        self.seen
            .lock()
            .ok()?
            .iter()
            .find(|(_, o)| pred(o))
            .map(|(rv, _)| *rv)
    }
}

impl<K> Drop for Versions<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The revision at which the Node was tainted, once it is known that the
/// VM's record said Stopped at an earlier one (etcd's order).
fn stopped_before_tainted(vm: &Versions<ConfigMap>, node: &Versions<Node>) -> u64 {
    let stopped_at = vm.first(stopped).expect("the VM was stopped");
    let tainted_at = node.first(tainted).expect("the Node was tainted");
    assert!(
        stopped_at < tainted_at,
        "tainted at revision {tainted_at}, before the VM was stopped at {stopped_at}"
    );
    tainted_at
}

/// The audit log of a fenced Machine's remediation, up to its Node's
/// taint.
struct Fenced {
    all: Vec<berth_devkit::bench::audit::Request>,
    log: String,
    node: String,
    vm: String,
}

impl Fenced {
    /// Reads the requests of `ns` until Node `node` of Machine `machine`
    /// was tainted.
    async fn read(
        bed: &berth_devkit::testbed::TestBed,
        ns: &str,
        node: &str,
        machine: &str,
    ) -> Self {
        let node = node.to_string();
        let all = oracle::requests_once(bed, ns, |rs| rs.iter().any(|r| is_taint(r, &node))).await;
        let log = oracle::log_of(&all);
        let vm = FakeProvider::vm_name(machine);
        Self { all, log, node, vm }
    }

    /// The accepted `verb` on the VM's record.
    fn on_vm(&self, verb: &str) -> Option<&berth_devkit::bench::audit::Request> {
        self.all.iter().find(|r| {
            r.verb == verb
                && r.resource == "configmaps"
                && r.name.as_deref() == Some(self.vm.as_str())
                && oracle::accepted(r)
        })
    }

    /// The VM's deletion, which ended before the taint was received.
    fn deleted_before_the_taint(&self) -> &berth_devkit::bench::audit::Request {
        let terminated = self
            .on_vm("delete")
            .unwrap_or_else(|| panic!("the VM deleted: {}", self.log));
        let taint = self
            .all
            .iter()
            .find(|r| is_taint(r, &self.node))
            .expect("the taint");
        assert!(
            terminated.completed < taint.received,
            "tainted before the VM was gone: {}",
            self.log
        );
        terminated
    }
}

/// An accepted write of Node `node` itself (not its status): the taint.
fn is_taint(r: &berth_devkit::bench::audit::Request, node: &str) -> bool {
    r.verb == "patch"
        && r.resource == "nodes"
        && r.subresource.is_none()
        && r.name.as_deref() == Some(node)
        && oracle::accepted(r)
}

fn tainted(n: &Node) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == OUT_OF_SERVICE))
}

fn stopped(cm: &ConfigMap) -> bool {
    cm.data
        .as_ref()
        .and_then(|d| d.get("state"))
        .is_some_and(|s| s == "Stopped")
}

fn uid_of(p: &Pod) -> String {
    p.metadata.uid.clone().unwrap_or_default()
}

/// The Machine MachineSet `set` of `ns` has, once it has a Node (and
/// none named `not`).
async fn machine_of_set(client: &Client, ns: &str, set: &str, not: &[String]) -> Machine {
    let of_set = |m: &Machine| berth::api::set_owner(m).is_some_and(|(s, _)| s == set);
    wait::for_one(
        Api::<Machine>::namespaced(client.clone(), ns),
        Duration::from_secs(120),
        "the set's Machine runs",
        |m| {
            of_set(m)
                && !not.contains(&m.name_any())
                && support::phase(m) == Some("Running")
                && m.metadata.deletion_timestamp.is_none()
        },
    )
    .await
    .map(|m| (*m).clone())
    .expect("the set's Machine")
}

fn node_of(m: &Machine) -> String {
    m.status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| r.name.clone())
        .expect("a Node")
}

/// A MachineSet's Machine with a StatefulSet replica and its volume dies:
/// past the health timeout its VM is stopped (the fake cloud's record),
/// only then is its Node tainted out of service (etcd's order), the
/// replica is made again on the pool's other Node with its volume
/// attached there, and the set replaces the Machine; all within the
/// health timeout and a minute. Nothing is evicted: the pod is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_machine_is_fenced_then_freed_and_replaced() {
    let ns = "remedy-set";
    let (mut case, client) = remedy_case(
        ns,
        serde_json::json!({"policy": "Replace"}),
        serde_json::json!({}),
    )
    .await;
    case.start().await;
    let sets: Api<MachineSet> = Api::namespaced(client.clone(), ns);
    create(sets, machine_set("db-set", ns, 1)).await;
    let first = machine_of_set(&client, ns, "db-set", &[]).await;
    let node = node_of(&first);
    stateful(&client, ns, "db", 1, |_| {}).await;
    running_pods(&client, ns, &["db-0"]).await;
    let spare = running_machine(&client, ns, "spare", ns).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let old = uid_of(&pods.get("db-0").await.expect("db-0"));

    let watches = Watches::start(&client, ns).await;
    let node_versions = Versions::start(Api::<Node>::all(client.clone()), &node).await;
    let vm = FakeProvider::vm_name(&first.name_any());
    let vm_versions = Versions::start(Api::<ConfigMap>::namespaced(client.clone(), ns), &vm).await;
    let died = Timestamp::now();
    kill(&client, &node).await;

    gone(&client, ns, &first.name_any(), Duration::from_secs(120)).await;
    let back = wait::for_one(pods.clone(), Duration::from_secs(120), "db-0 back", |p| {
        p.name_any() == "db-0"
            && uid_of(p) != old
            && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(node.as_str())
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    })
    .await
    .expect("db-0 made again elsewhere");
    // The spare, or the set's new Machine if it came up first.
    let there = back
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let _ = &spare;
    let pv = format!("{ns}-db-0");
    let attached = wait_until(|| watches.attachment_elsewhere(&pv, &node).is_some()).await;
    assert!(attached, "{pv} attached elsewhere: {}", watches.log());
    let at = watches
        .first(|s| matches!(s, Seen::Attached { pv: p, node: n, .. } if *p == pv && *n == there))
        .expect("attached where the replica runs");
    let ready = watches
        .first(|s| matches!(s, Seen::PodReady { name, uid } if name == "db-0" && *uid == uid_of(&back)))
        .unwrap_or(at);
    let took = ready.max(at).duration_since(died);
    assert!(
        took.as_secs_f64() <= (HEALTH + Duration::from_secs(60)).as_secs_f64(),
        "the replica was back {took:?} after its Node died: {}",
        watches.log()
    );

    // Fenced first: the VM's record said Stopped before the taint.
    stopped_before_tainted(&vm_versions, &node_versions);
    // The set made a new Machine.
    machine_of_set(&client, ns, "db-set", &[first.name_any()]).await;
    // Nothing evicted: a dead Node's pods are deleted.
    let bed = BED.bed().await;
    assert!(
        oracle::evictions(bed, ns).is_empty(),
        "{}",
        oracle::log_of(&oracle::evictions(bed, ns))
    );
    case.finish().await;
}

/// Polls `done` for up to a minute.
async fn wait_until(done: impl Fn() -> bool) -> bool {
    let until = std::time::Instant::now() + LONG;
    while std::time::Instant::now() < until {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    done()
}

/// The Remediation condition of Machine `name`, once its reason is
/// `reason`.
async fn remediation_reason(client: &Client, ns: &str, name: &str, reason: &str) -> String {
    let m = wait::for_one(
        Api::<Machine>::namespaced(client.clone(), ns),
        Duration::from_secs(90),
        &format!("{name}'s Remediation says {reason}"),
        |m| m.name_any() == name && condition(m, "Remediation").is_some_and(|c| c.reason == reason),
    )
    .await;
    let m = match m {
        Ok(m) => m,
        Err(e) => {
            let now = Api::<Machine>::namespaced(client.clone(), ns)
                .get(name)
                .await;
            panic!("{e}: {:?}", now.map(|m| m.status));
        }
    };
    condition(&m, "Remediation")
        .map(|c| c.message.clone())
        .unwrap_or_default()
}

/// The controller's writes in `ns` since `since` other than statuses
/// (its Machines', its sets') and Events: what a remediation would write.
fn acts_since(bed: &berth_devkit::testbed::TestBed, ns: &str, since: Timestamp) -> Vec<String> {
    oracle::writes(bed, ns)
        .into_iter()
        .filter(|r| r.received > since)
        .filter(|r| r.resource != "events")
        // A Machine's finalizer and providerID, as it comes up.
        .filter(|r| !(r.resource == "machines" && r.verb == "patch"))
        .filter(|r| r.subresource.as_deref() != Some("status"))
        .map(|r| {
            format!(
                "{} {} ({} at {})",
                r.kind(),
                r.name.clone().unwrap_or_default(),
                r.user_agent,
                r.received
            )
        })
        .collect()
}

/// Remediation off (the default): the dead Machine is named, in status
/// only; nothing is stopped, tainted or deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_remediation_off_a_dead_machine_is_only_named() {
    let ns = "remedy-off";
    let (mut case, client) = remedy_case(ns, serde_json::Value::Null, serde_json::json!({})).await;
    case.start().await;
    let node = running_machine(&client, ns, "m", ns).await;
    let died = Timestamp::now();
    kill(&client, &node).await;
    let why = remediation_reason(&client, ns, "m", "RemediationOff").await;
    assert!(why.contains("remediation is off"), "{why}");
    // Twice the health timeout more: still nothing.
    tokio::time::sleep(2 * HEALTH).await;
    let acts = acts_since(BED.bed().await, ns, died);
    assert!(acts.is_empty(), "berth acted: {acts:?}");
    let n = Api::<Node>::all(client.clone())
        .get(&node)
        .await
        .expect("the Node");
    assert!(!tainted(&n));
    case.finish().await;
}

/// `maxUnhealthy: 40%` and three of five Machines dead: a partition, not
/// dead VMs. Nothing is stopped, tainted or deleted, each names it
/// (`RemediationHeld`); two come back, and the third is remediated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_is_not_remediated() {
    let ns = "remedy-held";
    // Five Machines, then a replacement, come up in it.
    let (mut case, client) = remedy_case(
        ns,
        serde_json::json!({"policy": "Replace", "maxUnhealthy": "40%"}),
        serde_json::json!({}),
    )
    .await;
    case.start().await;
    let sets: Api<MachineSet> = Api::namespaced(client.clone(), ns);
    create(sets, machine_set("pool", ns, 5)).await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let all = wait::until(
        machines.clone(),
        Duration::from_secs(120),
        "five run",
        |ms| {
            ms.iter()
                .filter(|m| support::phase(m) == Some("Running"))
                .count()
                == 5
        },
    )
    .await
    .expect("five Machines");
    let mut names: Vec<String> = all.iter().map(|m| m.name_any()).collect();
    names.sort();
    let dead: Vec<String> = names[..3].to_vec();
    let nodes: Vec<String> = dead
        .iter()
        .map(|n| {
            let m = all.iter().find(|m| m.name_any() == *n).expect("machine");
            node_of(m)
        })
        .collect();
    let died = Timestamp::now();
    kill_all(&client, &nodes).await;
    for m in &dead {
        let why = remediation_reason(&client, ns, m, "RemediationHeld").await;
        assert!(
            why.contains(
                "3 of 5 Machines in its pool are unhealthy, more than maxUnhealthy 40% (2) allows"
            ),
            "{why}"
        );
    }
    tokio::time::sleep(2 * HEALTH).await;
    let bed = BED.bed().await;
    let acts = acts_since(bed, ns, died);
    assert!(acts.is_empty(), "berth acted on a partition: {acts:?}");

    // Two come back: one unhealthy of five is within 40%. (With one back,
    // two of five would be too, and the other two would be remediated:
    // berth is stopped while the two come back, so that it sees them back
    // together.)
    case.stop().await;
    let revived = Timestamp::now();
    revive(&client, &nodes[0]).await;
    revive(&client, &nodes[1]).await;
    case.start().await;
    gone(&client, ns, &dead[2], Duration::from_secs(120)).await;
    let acts = acts_since(bed, ns, revived);
    assert!(
        acts.iter()
            .any(|a| a.starts_with(&format!("delete machines {} ", dead[2]))),
        "{acts:?}"
    );
    for m in &dead[..2] {
        assert!(
            !acts.iter().any(|a| a.contains(&format!(" {m} "))),
            "{m} came back and was remediated anyway: {acts:?}"
        );
    }
    case.finish().await;
}

/// The Node comes back while its VM is being stopped (the fake cloud
/// takes 30 s): the remediation ends, no taint, no deletion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_during_the_fence_cancels_it() {
    let ns = "remedy-back";
    let (mut case, client) = remedy_case(
        ns,
        serde_json::json!({"policy": "Replace"}),
        serde_json::json!({"stopDelay": "30s"}),
    )
    .await;
    case.start().await;
    let node = running_machine(&client, ns, "m", ns).await;
    kill(&client, &node).await;
    remediation_reason(&client, ns, "m", "Fencing").await;
    let back = Timestamp::now();
    revive(&client, &node).await;
    remediation_reason(&client, ns, "m", "RemediationCanceled").await;
    // Past the fake cloud's 30 s: nothing more happened.
    let n = Api::<Node>::all(client.clone())
        .get(&node)
        .await
        .expect("the Node");
    assert!(!tainted(&n));
    let acts = acts_since(BED.bed().await, ns, back);
    assert!(
        acts.iter()
            .all(|a| !a.starts_with("delete") && !a.starts_with("patch nodes")),
        "{acts:?}"
    );
    let m = Api::<Machine>::namespaced(client.clone(), ns)
        .get("m")
        .await
        .expect("m stays");
    assert!(m.metadata.deletion_timestamp.is_none());
    assert!(m.status.and_then(|s| s.remediation).is_none());
    case.finish().await;
}

/// Two Machines of a set that remediates (the set says so, not its
/// class) die at once, each with a replica of one StatefulSet: one
/// replica moves at a time (the move ledger). The
/// second dead Node's pod is deleted only once the first replica is back
/// with its volume attached where it runs; both come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dead_machines_free_one_replica_at_a_time() {
    let ns = "remedy-two";
    // Two replacement Machines come up in the same seconds as the
    // remediations: about 170 requests in the busiest 10 s.
    // The pool opts in, not its class (whose spares are left alone).
    let (mut case, client) = remedy_case(ns, serde_json::Value::Null, serde_json::json!({})).await;
    case.start().await;
    let sets: Api<MachineSet> = Api::namespaced(client.clone(), ns);
    let mut set = machine_set("db-set", ns, 2);
    set.spec.remediation = Some(json(serde_json::json!({"policy": "Replace"})));
    create(sets, set).await;
    let a = machine_of_set(&client, ns, "db-set", &[]).await;
    let b = machine_of_set(&client, ns, "db-set", &[a.name_any()]).await;
    stateful(&client, ns, "db", 2, |sts| {
        if let Some(spec) = sts.spec.template.spec.as_mut() {
            spec.affinity = Some(json(serde_json::json!({"podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [{
                    "labelSelector": {"matchLabels": {"app": "db"}},
                    "topologyKey": "kubernetes.io/hostname"}]}})));
        }
    })
    .await;
    running_pods(&client, ns, &["db-0", "db-1"]).await;
    // Three spares: two dead of five is within the cluster's 40%.
    for spare in ["spare-1", "spare-2", "spare-3"] {
        running_machine(&client, ns, spare, ns).await;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut old = Vec::new();
    for p in ["db-0", "db-1"] {
        let pod = pods.get(p).await.expect("replica");
        let on = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .expect("bound");
        old.push((p.to_string(), uid_of(&pod), on));
    }
    let watches = Watches::start(&client, ns).await;
    kill_all(&client, &[node_of(&a), node_of(&b)]).await;
    gone(&client, ns, &a.name_any(), Duration::from_secs(180)).await;
    gone(&client, ns, &b.name_any(), Duration::from_secs(180)).await;
    for (p, uid, _) in &old {
        wait::for_one(pods.clone(), LONG, &format!("{p} back"), |q| {
            q.name_any() == *p
                && uid_of(q) != *uid
                && q.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
    let bed = BED.bed().await;
    let all = oracle::requests_once(bed, ns, |rs| {
        rs.iter()
            .filter(|r| r.resource == "pods" && r.verb == "delete")
            .count()
            >= 2
    })
    .await;
    let log = oracle::log_of(&all);
    let deletes: Vec<_> = all
        .iter()
        .filter(|r| r.resource == "pods" && r.verb == "delete" && oracle::accepted(r))
        .collect();
    assert_eq!(deletes.len(), 2, "each replica deleted once: {log}");
    let first = deletes[0].name.clone().unwrap_or_default();
    let (_, _, first_node) = old.iter().find(|(p, _, _)| *p == first).expect("known");
    let pv = format!("{ns}-{first}");
    watches
        .assert_after_moved(bed, deletes[1], &pv, first_node, &log)
        .await;
    case.finish().await;
}

/// berth killed (SIGKILL) after the VM was stopped and before the Node
/// was freed (an admission policy refuses the taint until the test lifts
/// it): the new process resumes at the recorded step. The VM is stopped
/// once, the Node tainted once, the pod deleted once, the Machine deleted
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remediation_killed_between_the_stop_and_the_taint_resumes() {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let ns = "remedy-kill";
    let (mut case, client) = remedy_case(
        ns,
        serde_json::json!({"policy": "Replace"}),
        serde_json::json!({}),
    )
    .await;
    case.spawn(&["--namespace", ns, "--leader-elect=false"])
        .await;
    let sets: Api<MachineSet> = Api::namespaced(client.clone(), ns);
    create(sets, machine_set("db-set", ns, 1)).await;
    let dead = machine_of_set(&client, ns, "db-set", &[]).await;
    let node = node_of(&dead);
    stateful(&client, ns, "db", 1, |_| {}).await;
    running_pods(&client, ns, &["db-0"]).await;
    running_machine(&client, ns, "spare", ns).await;
    running_machine(&client, ns, "spare-2", ns).await;
    // The taint refused for now.
    let policy = format!("{ns}-no-taint");
    create(
        Api::<ValidatingAdmissionPolicy>::all(client.clone()),
        json(serde_json::json!({
            "metadata": {"name": policy},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                    "operations": ["UPDATE"], "resources": ["nodes"]}]},
                "validations": [{"expression": format!(
                    "object.metadata.name != '{node}' || !has(object.spec.taints) || !object.spec.taints.exists(t, t.key == '{OUT_OF_SERVICE}')"),
                    "message": "the test holds the taint"}]
            }
        })),
    )
    .await;
    let bindings = Api::<ValidatingAdmissionPolicyBinding>::all(client.clone());
    create(
        bindings.clone(),
        json(serde_json::json!({
            "metadata": {"name": policy},
            "spec": {"policyName": policy, "validationActions": ["Deny"]}
        })),
    )
    .await;
    // The policy takes a moment to be enforced.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let died = Timestamp::now();
    kill(&client, &node).await;
    let bed = BED.bed().await;
    let refused = |rs: &[berth_devkit::bench::audit::Request]| {
        rs.iter().any(|r| {
            r.resource == "nodes"
                && r.verb == "patch"
                && r.subresource.is_none()
                && r.name.as_deref() == Some(node.as_str())
                && !oracle::accepted(r)
        })
    };
    let all = oracle::requests_once(bed, ns, refused).await;
    let log = oracle::log_of(&all);
    assert!(refused(&all), "the taint was tried: {log}");
    case.kill().await;
    bindings
        .delete(&policy, &Default::default())
        .await
        .expect("the taint is let through");
    tokio::time::sleep(Duration::from_secs(2)).await;
    case.spawn(&["--namespace", ns, "--leader-elect=false"])
        .await;
    gone(&client, ns, &dead.name_any(), Duration::from_secs(120)).await;
    let vm = FakeProvider::vm_name(&dead.name_any());
    let all = oracle::requests_once(bed, ns, |rs| {
        rs.iter()
            .any(|r| r.resource == "machines" && r.verb == "delete")
    })
    .await;
    let log = oracle::log_of(&all);
    let since: Vec<_> = all
        .iter()
        .filter(|r| r.received > died && oracle::accepted(r))
        .collect();
    let count = |verb: &str, resource: &str, name: &str| {
        since
            .iter()
            .filter(|r| {
                r.verb == verb
                    && r.resource == resource
                    && r.subresource.is_none()
                    && r.name.as_deref() == Some(name)
            })
            .count()
    };
    // The stop wrote the VM's record once; the VM's deletion removed it.
    assert_eq!(count("patch", "configmaps", &vm), 1, "one stop: {log}");
    // Stopping let kwok go of the Node (one patch), the taint (one more).
    assert_eq!(count("patch", "nodes", &node), 2, "one taint: {log}");
    assert_eq!(count("delete", "pods", "db-0"), 1, "{log}");
    assert_eq!(count("delete", "machines", &dead.name_any()), 1, "{log}");
    Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .delete(&policy, &Default::default())
        .await
        .expect("policy removed");
    case.finish().await;
}

/// `fence: Terminate`, a Machine outside a pool: its VM is deleted (the
/// fake cloud no longer has it) before its Node is tainted (audit order),
/// and the Machine is marked Failed, its Node freed and left for an
/// operator; nothing is deleted but the VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_vm_outside_a_pool_leaves_a_failed_machine() {
    let ns = "remedy-terminate";
    let (mut case, client) = remedy_case(
        ns,
        serde_json::json!({"policy": "Replace", "fence": "Terminate"}),
        serde_json::json!({}),
    )
    .await;
    case.start().await;
    let node = running_machine(&client, ns, "m", ns).await;
    let died = Timestamp::now();
    kill(&client, &node).await;
    let why = remediation_reason(&client, ns, "m", "Failed").await;
    assert!(why.contains("belongs to no MachineSet"), "{why}");
    let m = Api::<Machine>::namespaced(client.clone(), ns)
        .get("m")
        .await
        .expect("m stays");
    assert_eq!(support::phase(&m), Some("Failed"));
    let bed = BED.bed().await;
    let fence = Fenced::read(bed, ns, &node, "m").await;
    fence.deleted_before_the_taint();
    let n = Api::<Node>::all(client.clone())
        .get(&node)
        .await
        .expect("the Node is left");
    assert!(tainted(&n));
    let acts = acts_since(bed, ns, died);
    assert!(
        !acts
            .iter()
            .any(|a| a.starts_with("delete machines") || a.starts_with("delete nodes")),
        "{acts:?}"
    );
    case.finish().await;
}

/// Node `node` gets condition `type_` True, as node-problem-detector
/// writes one (a strategic merge of the status: kwok's heartbeats keep
/// it, as the kubelet's do).
async fn node_condition(client: &Client, node: &str, type_: &str) {
    let now = Timestamp::now().to_string();
    Api::<Node>::all(client.clone())
        .patch_status(
            node,
            &PatchParams::default(),
            &Patch::Strategic(serde_json::json!({"status": {"conditions": [{
                "type": type_, "status": "True", "reason": "KernelHasDeadlock",
                "message": "task docker:7 blocked for more than 300 seconds",
                "lastTransitionTime": now, "lastHeartbeatTime": now}]}})),
        )
        .await
        .expect("the condition is set");
}

/// A Node that stays Ready but has had a condition its class lists
/// (`KernelDeadlock` True for 2 s) is remediated as a dead one: its VM
/// stopped (the fake cloud's record), only then its Node tainted (etcd's
/// order); outside a pool the Machine is marked Failed. The Node said
/// Ready all along: the condition, not Ready, decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_node_condition_remediates_a_ready_node() {
    let ns = "remedy-condition";
    let (mut case, client) = remedy_case(
        ns,
        serde_json::json!({"policy": "Replace", "conditions": [
            {"type": "KernelDeadlock", "status": "True", "after": "2s"}]}),
        serde_json::json!({}),
    )
    .await;
    case.start().await;
    let node = running_machine(&client, ns, "m", ns).await;
    let node_versions = Versions::start(Api::<Node>::all(client.clone()), &node).await;
    let vm = FakeProvider::vm_name("m");
    let vm_versions = Versions::start(Api::<ConfigMap>::namespaced(client.clone(), ns), &vm).await;
    node_condition(&client, &node, "KernelDeadlock").await;
    remediation_reason(&client, ns, "m", "Failed").await;
    let m = Api::<Machine>::namespaced(client.clone(), ns)
        .get("m")
        .await
        .expect("m stays");
    let why = m
        .status
        .and_then(|s| s.remediation)
        .map(|r| r.reason)
        .unwrap_or_default();
    assert!(why.contains("KernelDeadlock True"), "{why}");
    let tainted_at = stopped_before_tainted(&vm_versions, &node_versions);
    // Ready in every version seen before the taint.
    let unready = node_versions.first(|n| !is_ready(n) && !tainted(n));
    assert!(
        unready.is_none_or(|rv| rv > tainted_at),
        "the Node was NotReady at {unready:?}"
    );
    case.finish().await;
}

/// A VM that never stops (the fake cloud takes an hour) in a pool whose
/// `fenceTimeout` is 3 s: past it, the stop turns into a terminate, the
/// VM is deleted (the fake cloud's record) before the Node is tainted
/// (audit order), and the Machine is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_that_does_not_stop_is_terminated_past_the_fence_timeout() {
    let ns = "remedy-escalate";
    let (mut case, client) = remedy_case(
        ns,
        serde_json::json!({"policy": "Replace", "fenceTimeout": "3s"}),
        serde_json::json!({"stopDelay": "1h"}),
    )
    .await;
    case.start().await;
    let sets: Api<MachineSet> = Api::namespaced(client.clone(), ns);
    create(sets, machine_set("db-set", ns, 1)).await;
    let dead = machine_of_set(&client, ns, "db-set", &[]).await;
    let node = node_of(&dead);
    kill(&client, &node).await;
    gone(&client, ns, &dead.name_any(), Duration::from_secs(120)).await;
    let fence = Fenced::read(BED.bed().await, ns, &node, &dead.name_any()).await;
    let terminated = fence.deleted_before_the_taint();
    let stop = fence
        .on_vm("patch")
        .unwrap_or_else(|| panic!("the VM asked to stop: {}", fence.log));
    assert!(stop.completed < terminated.received, "{}", fence.log);
    machine_of_set(&client, ns, "db-set", &[dead.name_any()]).await;
    case.finish().await;
}

/// `berth run --max-unhealthy 0`, the cluster-wide bound: one dead
/// Machine outside any pool is held (by default, 40 % of one Machine is
/// one, and it would be remediated), and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_wide_bound_of_berth_run_holds_a_remediation() {
    let ns = "remedy-cluster";
    let (mut case, client) = remedy_case(
        ns,
        serde_json::json!({"policy": "Replace"}),
        serde_json::json!({}),
    )
    .await;
    case.spawn(&[
        "--namespace",
        ns,
        "--leader-elect=false",
        "--max-unhealthy",
        "0",
    ])
    .await;
    let node = running_machine(&client, ns, "m", ns).await;
    let died = Timestamp::now();
    kill(&client, &node).await;
    let why = remediation_reason(&client, ns, "m", "RemediationHeld").await;
    assert!(
        why.contains(
            "1 of 1 Machines in the cluster are unhealthy, more than maxUnhealthy 0 (0) allows"
        ),
        "{why}"
    );
    tokio::time::sleep(2 * HEALTH).await;
    let acts = acts_since(BED.bed().await, ns, died);
    assert!(acts.is_empty(), "berth acted: {acts:?}");
    case.finish().await;
}
