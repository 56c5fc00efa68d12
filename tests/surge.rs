//! Surge before evict, end to end on the test bed: a pod of a Deployment
//! whose PodDisruptionBudget allows no disruption is replaced before it
//! goes, by the Deployment's own controllers, instead of waiting for the
//! drain's deadline. A singleton, or a Deployment whose every pod drains,
//! or one a HorizontalPodAutoscaler scales, is rolled (one template
//! annotation, one new ReplicaSet); any other is scaled up by one and back,
//! its old pod the cheapest to delete; a restart between the two writes
//! neither scales twice nor forgets to scale back. A StatefulSet, or a
//! Deployment whose pod has a ReadWriteOnce claim, cannot surge: berth says
//! so and writes nothing to it.
//!
//! The truth of every assertion is the cluster's: watches of the
//! Deployment's pods and of the Deployment itself (each change in the order
//! the API server committed it), and the API server's audit log (berth's
//! writes, and who deleted a pod). berth's Events and `berth plan` are
//! checked apart, as what operators are told.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth::api::MovePermit;
use berth_devkit::bench::audit::Request;
use berth_devkit::testbed::fixtures::{csi_pv, deployment};
use berth_devkit::testbed::stages::READY_AFTER_ANNOTATION;
use berth_devkit::testbed::{TestBed, wait};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use support::audit::{controller_user, requests};
use support::oracle::{self, cluster_requests};
use support::pool::{
    ATTACH_FREE_DRIVER, Bed, Ev, attach_free_driver, create, csi_pv_on, delete_machine,
    events as drain_events, first, gone, json, log_of, on_node, running_machine, stateful,
};
use support::{Case, LONG, events_of};

const BED: Bed = Bed {
    attach: Duration::from_secs(1),
    detach: Duration::from_secs(1),
};

/// On a Deployment's pod template: the Machine whose drain rolled it.
const SURGED_FOR: &str = "berth.dev/surged-for";
/// The ReplicaSet controller removes the pods of the lowest cost first.
const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
/// What berth puts there on the pod a scale-up replaces.
const LOWEST_COST: &str = "-2147483648";
/// A drain that surges ends long before its 10-minute deadline.
const GONE_WITHIN: Duration = Duration::from_secs(90);
/// A drain says why a pod cannot surge on its first pass, before its
/// deadline (the 40 s of the cases that check it): an Event's time is when
/// berth's queue published it, a loaded machine's lag after the pass that
/// decided, so the bound is the deadline's, not a guess at that lag.
const TOLD_WITHIN: SignedDuration = SignedDuration::from_secs(40);

/// The label selector of `name`'s pods (the fixtures label them `app`).
fn selector(name: &str) -> String {
    format!("app={name}")
}

fn of(p: &Pod, name: &str) -> bool {
    p.labels().get("app").map(String::as_str) == Some(name)
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Ready and not being deleted: a pod that serves and that the
/// disruption controller counts healthy.
fn serving(p: &Pod) -> bool {
    is_ready(p) && p.metadata.deletion_timestamp.is_none()
}

/// A `RollingUpdate` of `surge` and `unavailable` on `d`.
fn rolling(d: &mut Deployment, surge: i32, unavailable: i32) {
    d.spec.strategy = Some(json(serde_json::json!({
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}
    })));
}

/// Cordons Node `node` by hand (`spec.unschedulable` only, not berth's
/// cordon), or lifts that.
async fn cordon(client: &Client, node: &str, on: bool) {
    Api::<Node>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"unschedulable": on}})),
        )
        .await
        .unwrap_or_else(|e| panic!("cordon {node} ({on}): {e}"));
}

/// Waits until `ok` holds over the pods of `name` (`what` names the wait);
/// returns them.
async fn pods_of(
    client: &Client,
    ns: &str,
    name: &str,
    what: &str,
    ok: impl Fn(&[&Pod]) -> bool,
) -> Vec<Pod> {
    let all = wait::until(
        Api::<Pod>::namespaced(client.clone(), ns),
        LONG,
        &format!("{name}: {what}"),
        |ps| {
            ok(&ps
                .iter()
                .map(|p| &**p)
                .filter(|p| of(p, name))
                .collect::<Vec<_>>())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    all.iter()
        .filter(|p| of(p, name))
        .map(|p| (**p).clone())
        .collect()
}

/// Creates Deployment `d` (of the fixtures: kept to pool `ns`, its pods
/// labelled `app: <name>`) with `on_a` of its pods on `node_a` and the
/// others on `node_b`, without pinning any pod: the Node that must not get
/// a pod is cordoned by hand while the pods are placed, and every Node is
/// schedulable again at the end. Returns the pods once all are Ready.
async fn place(
    client: &Client,
    ns: &str,
    d: Deployment,
    on_a: usize,
    a: &str,
    b: &str,
) -> Vec<Pod> {
    let name = d.name_any();
    let total = usize::try_from(d.spec.replicas.unwrap_or(1)).expect("replicas");
    let elsewhere = total - on_a;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let bound = |node: &str, n: usize| {
        let node = node.to_string();
        move |ps: &[&Pod]| ps.iter().filter(|p| on_node(p, &node)).count() == n
    };
    if elsewhere > 0 {
        let mut first = d;
        first.spec.replicas = Some(i32::try_from(elsewhere).expect("replicas"));
        cordon(client, a, true).await;
        create(deployments.clone(), first).await;
        pods_of(client, ns, &name, "placed on B", bound(b, elsewhere)).await;
        cordon(client, b, true).await;
        cordon(client, a, false).await;
        deployments
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"replicas": total}})),
            )
            .await
            .expect("scale the Deployment up to its size");
    } else {
        cordon(client, b, true).await;
        create(deployments, d).await;
    }
    pods_of(client, ns, &name, "placed on A", bound(a, on_a)).await;
    cordon(client, b, false).await;
    pods_of(client, ns, &name, "all Ready where placed", |ps| {
        ps.len() == total
            && ps.iter().all(|p| serving(p))
            && ps.iter().filter(|p| on_node(p, a)).count() == on_a
    })
    .await
}

/// PodDisruptionBudget `name` of `spec` over the pods of `name`, once the
/// disruption controller counts `healthy` of them and allows no
/// disruption.
async fn budget(client: &Client, ns: &str, name: &str, spec: serde_json::Value, healthy: i32) {
    let mut spec = spec;
    spec["selector"] = serde_json::json!({"matchLabels": {"app": name}});
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), ns);
    create(
        pdbs.clone(),
        json(serde_json::json!({"metadata": {"name": name}, "spec": spec})),
    )
    .await;
    wait::for_one(pdbs, LONG, &format!("PDB {name} allows nothing"), |p| {
        p.name_any() == name
            && p.status.as_ref().is_some_and(|s| {
                s.current_healthy == Some(healthy) && s.disruptions_allowed == Some(0)
            })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The ReplicaSets of Deployment `name`.
async fn replica_sets(client: &Client, ns: &str, name: &str) -> Vec<ReplicaSet> {
    Api::<ReplicaSet>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&selector(name)))
        .await
        .expect("list ReplicaSets")
        .items
        .into_iter()
        .filter(|rs| rs.owner_references().iter().any(|o| o.name == name))
        .collect()
}

/// Deployment `name`'s pod template annotation `key`, now.
async fn template_annotation(client: &Client, ns: &str, name: &str, key: &str) -> Option<String> {
    let d = Api::<Deployment>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .expect("get the Deployment");
    d.spec
        .template
        .metadata
        .and_then(|m| m.annotations)
        .and_then(|a| a.get(key).cloned())
}

/// A case of namespace `ns` with Machines `a` and `b` Running in a pool
/// whose drain times out after `timeout`: the case, its client, and the
/// Nodes of `a` and `b`.
async fn two_machines(ns: &str, timeout: &str) -> (Case, Client, String, String) {
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": timeout}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, ns, "b", ns).await;
    (case, client, node_a, node_b)
}

/// What `berth plan` prints for Machine `machine` of `ns`: its plan, then
/// its section of surges.
async fn plan_and_surges(client: &Client, ns: &str, machine: &str) -> String {
    let live = berth::cli::plan::plan_machine(client, ns, machine)
        .await
        .expect("plan");
    format!("{}{}", live.plan, live.surges())
}

/// `berth plan` says, in its section of surges, that a pod of Deployment
/// `ns/name` gets the surge `how` (`roll` or `scale`).
fn assert_plans_surge(plan: &str, how: &str, ns: &str, name: &str) {
    let (_, surges) = plan
        .split_once("Surges before evict")
        .unwrap_or_else(|| panic!("no section of surges:\n{plan}"));
    let said = format!("surge: {how} Deployment {ns}/{name}");
    assert!(
        surges.lines().any(|l| l.contains(&said)),
        "the plan says {said:?}:\n{plan}"
    );
}

/// berth's writes to Deployment `name` (any subresource, any answer),
/// oldest first.
fn deployment_writes(all: &[Request], name: &str) -> Vec<Request> {
    all.iter()
        .filter(|r| r.is_write() && r.resource == "deployments")
        .filter(|r| r.name.as_deref() == Some(name))
        .cloned()
        .collect()
}

fn accepted(rs: &[Request]) -> Vec<&Request> {
    rs.iter().filter(|r| oracle::accepted(r)).collect()
}

/// Asserts that the ReplicaSet controller removed pod `pod`, not berth:
/// the first DELETE of it in the audit log (which records everyone's pod
/// deletions; the test bed's kube-controller-manager sends each
/// controller's requests under its own user agent) is the ReplicaSet
/// controller's, berth sent none, and no eviction of it was accepted.
async fn assert_removed_by_its_replica_set(bed: &TestBed, ns: &str, pod: &str) {
    let is_delete = |r: &Request| {
        r.verb == "delete"
            && r.resource == "pods"
            && r.subresource.is_none()
            && r.namespace.as_deref() == Some(ns)
            && r.name.as_deref() == Some(pod)
    };
    // A request is in the audit log once its response is written, a
    // moment after its effect.
    let until = std::time::Instant::now() + Duration::from_secs(15);
    let deletes = loop {
        let found: Vec<Request> = cluster_requests(bed)
            .into_iter()
            .filter(|r| is_delete(r))
            .collect();
        if !found.is_empty() || std::time::Instant::now() >= until {
            break found;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let who = deletes
        .iter()
        .map(|r| format!("{} {} ({}) -> {}", r.received, r.user, r.user_agent, r.code))
        .collect::<Vec<_>>()
        .join("\n");
    let first = deletes
        .first()
        .unwrap_or_else(|| panic!("no DELETE of {pod} in the audit log"));
    assert!(
        first.user_agent.contains("replicaset-controller"),
        "{pod} deleted first by its ReplicaSet controller:\n{who}"
    );
    let berth = controller_user();
    assert!(
        deletes.iter().all(|r| r.user != berth),
        "berth deleted {pod}:\n{who}"
    );
    let evictions = oracle::evictions(bed, ns);
    assert!(
        oracle::accepted_evictions_of(&evictions, pod).is_empty(),
        "berth evicted {pod}: {}",
        oracle::log_of(&evictions)
    );
}

/// Of berth's requests `all`, none deleted pod `pod` (bypassing its PDB),
/// and at most `refused` evictions of it were refused.
fn assert_not_bypassed(all: &[Request], pod: &str, refused: usize) {
    let about: Vec<Request> = all
        .iter()
        .filter(|r| r.resource == "pods" && r.name.as_deref() == Some(pod))
        .cloned()
        .collect();
    let log = oracle::log_of(&about);
    assert!(
        !about
            .iter()
            .any(|r| r.verb == "delete" && r.subresource.is_none()),
        "berth deleted {pod}, bypassing its PDB:\n{log}"
    );
    let evictions = about
        .iter()
        .filter(|r| r.subresource.as_deref() == Some("eviction"))
        .filter(|r| r.code == 429)
        .count();
    assert!(
        evictions <= refused,
        "at most {refused} refused eviction(s) of {pod}, then a surge:\n{log}"
    );
}

/// What operators are told of a surge: a `Surging` Event that names
/// Deployment `name`, and no `SurgeFailed`.
fn assert_told_surging(evs: &[Ev], ns: &str, name: &str) {
    let log = log_of(evs);
    assert!(
        first(evs, "Surging", &format!("Deployment {ns}/{name}")).is_some(),
        "a Surging Event names Deployment {name}:\n{log}"
    );
    assert!(first(evs, "SurgeFailed", "").is_none(), "{log}");
}

/// One state of the Deployment, as its watch saw it.
#[derive(Debug, Clone, PartialEq)]
struct Version {
    generation: i64,
    replicas: i32,
    surged_for: Option<String>,
}

/// What [`Fleet`] saw.
#[derive(Default)]
struct Seen {
    /// A (re)list is under way: the pods are not all known yet.
    listing: bool,
    /// The pods now, by UID.
    pods: BTreeMap<String, Pod>,
    /// Every pod UID seen.
    uids: BTreeSet<String>,
    /// The pods seen with the lowest deletion cost.
    cheapest: BTreeSet<String>,
    min_serving: Option<usize>,
    max_live: usize,
    max_existing: usize,
    last: Option<(usize, usize, usize)>,
    timeline: Vec<String>,
    versions: Vec<Version>,
}

impl Seen {
    /// The counts after a change seen at `at`.
    fn count(&mut self, at: Timestamp) {
        let up = self.pods.values().filter(|p| serving(p)).count();
        let live = self
            .pods
            .values()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .count();
        let existing = self.pods.len();
        self.min_serving = Some(self.min_serving.map_or(up, |m| m.min(up)));
        self.max_live = self.max_live.max(live);
        self.max_existing = self.max_existing.max(existing);
        if self.last != Some((up, live, existing)) {
            self.last = Some((up, live, existing));
            self.timeline.push(format!(
                "{at} ready {up}, not terminating {live}, existing {existing}"
            ));
        }
    }
}

/// Watches of one Deployment's pods and of the Deployment: every change
/// in the order the API server committed it, so that "at no moment" is
/// checked over every state the pods went through (counted once a list
/// is complete, never mid-list).
struct Fleet {
    seen: Arc<Mutex<Seen>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Fleet {
    /// Starts watching Deployment `name` and its pods; returns once both
    /// watches have listed.
    async fn watch(client: &Client, ns: &str, name: &str) -> Self {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (tx, mut listed) = tokio::sync::mpsc::channel::<()>(4);
        let pods = {
            let (seen, tx) = (Arc::clone(&seen), tx.clone());
            let api: Api<Pod> = Api::namespaced(client.clone(), ns);
            let config = watcher::Config::default().labels(&selector(name));
            tokio::spawn(async move {
                let mut stream = watcher::watcher(api, config).boxed();
                while let Some(ev) = stream.next().await {
                    let now = Timestamp::now();
                    let done = matches!(ev, Ok(watcher::Event::InitDone));
                    {
                        let mut s = seen.lock().expect("lock");
                        match ev {
                            Ok(watcher::Event::Init) => {
                                s.listing = true;
                                s.pods.clear();
                            }
                            Ok(watcher::Event::InitApply(p) | watcher::Event::Apply(p)) => {
                                let uid = p.uid().unwrap_or_default();
                                if p.annotations().get(DELETION_COST).map(String::as_str)
                                    == Some(LOWEST_COST)
                                {
                                    s.cheapest.insert(p.name_any());
                                }
                                s.uids.insert(uid.clone());
                                s.pods.insert(uid, p);
                            }
                            Ok(watcher::Event::Delete(p)) => {
                                s.pods.remove(&p.uid().unwrap_or_default());
                            }
                            Ok(watcher::Event::InitDone) => s.listing = false,
                            Err(_) => {}
                        }
                        if !s.listing {
                            s.count(now);
                        }
                    }
                    if done {
                        let _ = tx.try_send(());
                    }
                }
            })
        };
        let deployment = {
            let seen = Arc::clone(&seen);
            let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
            let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
            tokio::spawn(async move {
                let mut stream = watcher::watcher(api, config).boxed();
                while let Some(ev) = stream.next().await {
                    match ev {
                        Ok(watcher::Event::InitApply(d) | watcher::Event::Apply(d)) => {
                            let v = Version {
                                generation: d.metadata.generation.unwrap_or_default(),
                                replicas: d.spec.replicas.unwrap_or(1),
                                surged_for: d
                                    .spec
                                    .template
                                    .metadata
                                    .as_ref()
                                    .and_then(|m| m.annotations.as_ref())
                                    .and_then(|a| a.get(SURGED_FOR).cloned()),
                            };
                            let mut s = seen.lock().expect("lock");
                            if s.versions.last() != Some(&v) {
                                s.versions.push(v);
                            }
                        }
                        Ok(watcher::Event::InitDone) => {
                            let _ = tx.try_send(());
                        }
                        _ => {}
                    }
                }
            })
        };
        for _ in 0..2 {
            tokio::time::timeout(LONG, listed.recv())
                .await
                .expect("the watches list");
        }
        Self {
            seen,
            tasks: vec![pods, deployment],
        }
    }

    fn with<T>(&self, f: impl FnOnce(&Seen) -> T) -> T {
        f(&self.seen.lock().expect("lock"))
    }

    /// The fewest pods Ready and not terminating at any moment.
    fn min_serving(&self) -> usize {
        self.with(|s| s.min_serving.unwrap_or_default())
    }

    /// The most pods not terminating at any moment.
    fn max_live(&self) -> usize {
        self.with(|s| s.max_live)
    }

    /// The most pods (terminating ones too) at any moment.
    fn max_existing(&self) -> usize {
        self.with(|s| s.max_existing)
    }

    /// How many pods there were in all.
    fn pods_ever(&self) -> usize {
        self.with(|s| s.uids.len())
    }

    /// The pods seen with the lowest deletion cost, by name.
    fn cheapest(&self) -> Vec<String> {
        self.with(|s| s.cheapest.iter().cloned().collect())
    }

    fn versions(&self) -> Vec<Version> {
        self.with(|s| s.versions.clone())
    }

    /// Each `spec.replicas` the Deployment had, in order.
    fn replicas_seen(&self) -> Vec<i32> {
        let mut r: Vec<i32> = self.versions().iter().map(|v| v.replicas).collect();
        r.dedup();
        r
    }

    /// How many times the Deployment's spec changed, by its generation.
    fn spec_changes(&self) -> i64 {
        let v = self.versions();
        match (v.first(), v.last()) {
            (Some(a), Some(b)) => b.generation - a.generation,
            _ => 0,
        }
    }

    /// What was seen, as lines, for assertion messages.
    fn log(&self) -> String {
        self.with(|s| {
            let versions = s
                .versions
                .iter()
                .map(|v| format!("{v:?}"))
                .collect::<Vec<_>>()
                .join("\n");
            format!("{}\n{versions}", s.timeline.join("\n"))
        })
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The roll's promises, after Machine `a` of `ns` is gone: Deployment
/// `name` was rolled once, for `a` (its template annotated with the
/// Machine, one new ReplicaSet beside the old one, one write of berth's
/// to it), and never had fewer than one pod serving or more than
/// `most` not terminating.
async fn assert_rolled_once(client: &Client, ns: &str, name: &str, fleet: &Fleet, most: usize) {
    let truth = fleet.log();
    assert!(
        fleet.min_serving() >= 1,
        "{name} had no pod Ready at some moment:\n{truth}"
    );
    assert!(
        fleet.max_live() <= most,
        "{name} ran more than {most} pods not terminating at some moment:\n{truth}"
    );
    assert_eq!(
        template_annotation(client, ns, name, SURGED_FOR)
            .await
            .as_deref(),
        Some(format!("{ns}/a").as_str()),
        "the template names the Machine whose drain rolled it"
    );
    assert_eq!(
        replica_sets(client, ns, name).await.len(),
        2,
        "one new ReplicaSet beside the old one:\n{truth}"
    );
    let bed = BED.bed().await;
    let writes = deployment_writes(&requests(bed, ns), name);
    assert_eq!(
        accepted(&writes).len(),
        1,
        "berth rolled {name} with one write: {}",
        oracle::log_of(&writes)
    );
    assert_eq!(fleet.spec_changes(), 1, "one new revision:\n{truth}");
}

/// A singleton Deployment behind `minAvailable: 1`, its pod on Machine A
/// and another Node free: deleting A rolls it (its only pod runs on a
/// Machine being deleted), so that by a watch of its pods one is Ready at
/// every moment, berth never deletes the pod nor retries a refused
/// eviction, one new ReplicaSet is made, and the Machine goes long before
/// its 10-minute deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_singleton_behind_min_available_one_is_rolled_before_its_pod_goes() {
    let ns = "surge-singleton";
    let name = "solo";
    let (_case, client, node_a, node_b) = two_machines(ns, "10m").await;
    // The default strategy: maxSurge 25% of 1 rounds up to 1,
    // maxUnavailable down to 0.
    let pods = place(&client, ns, deployment(name, 1, 1, ns), 1, &node_a, &node_b).await;
    let old = pods[0].name_any();
    budget(&client, ns, name, serde_json::json!({"minAvailable": 1}), 1).await;
    assert_eq!(replica_sets(&client, ns, name).await.len(), 1);
    assert_plans_surge(&plan_and_surges(&client, ns, "a").await, "roll", ns, name);

    let fleet = Fleet::watch(&client, ns, name).await;
    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", GONE_WITHIN).await;

    assert_rolled_once(&client, ns, name, &fleet, 2).await;
    assert_not_bypassed(&requests(BED.bed().await, ns), &old, 1);
    assert_told_surging(&drain_events(&client, ns, "a").await, ns, name);
}

/// Three replicas, all on Machine A, behind `maxUnavailable: 0`, rolled
/// with `maxSurge: 1, maxUnavailable: 0`: by a watch of the pods, never
/// none Ready and never more than 3 + 1 not terminating; berth deletes
/// none of them; the Machine goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_all_on_the_machine_are_rolled_within_max_surge() {
    let ns = "surge-three";
    let name = "trio";
    let (_case, client, node_a, node_b) = two_machines(ns, "10m").await;
    let mut d = deployment(name, 3, 1, ns);
    rolling(&mut d, 1, 0);
    let pods = place(&client, ns, d, 3, &node_a, &node_b).await;
    budget(
        &client,
        ns,
        name,
        serde_json::json!({"maxUnavailable": 0}),
        3,
    )
    .await;
    assert_plans_surge(&plan_and_surges(&client, ns, "a").await, "roll", ns, name);

    let fleet = Fleet::watch(&client, ns, name).await;
    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", GONE_WITHIN).await;

    assert_rolled_once(&client, ns, name, &fleet, 4).await;
    let all = requests(BED.bed().await, ns);
    for p in &pods {
        assert_not_bypassed(&all, &p.name_any(), 1);
    }
    assert_told_surging(&drain_events(&client, ns, "a").await, ns, name);
}

const FLEET: &str = "fleet";

/// Ten replicas of Deployment `fleet`, one on Machine A and nine on B,
/// behind `maxUnavailable: 0`; A is deleted. With `restart`, berth is a
/// `berth run` process killed (SIGKILL) once the Deployment is scaled up
/// and started again, the new pod held unready for 8 s so that the kill
/// comes before the scale back.
///
/// By the Deployment's watch: `spec.replicas` went 10, 11, 10 and nothing
/// else changed in its spec (no template write: its generation grew by
/// two, it has one ReplicaSet). By the audit log: berth wrote it twice
/// (after a kill, once before and once after it), the old pod was
/// deleted by its ReplicaSet controller and never by berth. By the pods'
/// watch: the old pod, and only it, was marked the cheapest to delete;
/// 11 pods in all, never more than 11 at once.
async fn one_of_ten(ns: &str, restart: bool) {
    let flags = ["--namespace", ns, "--leader-elect=false"];
    let builder = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}));
    let mut case = if restart {
        builder.spawn(&flags).await
    } else {
        builder.start().await
    };
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, ns, "b", ns).await;
    let mut d = deployment(FLEET, 10, 1, ns);
    if restart {
        d.spec
            .template
            .metadata
            .get_or_insert_default()
            .annotations
            .get_or_insert_default()
            .insert(READY_AFTER_ANNOTATION.into(), "8s".into());
    }
    let pods = place(&client, ns, d, 1, &node_a, &node_b).await;
    let old = pods
        .iter()
        .find(|p| on_node(p, &node_a))
        .map(ResourceExt::name_any)
        .expect("a pod on A");
    budget(
        &client,
        ns,
        FLEET,
        serde_json::json!({"maxUnavailable": 0}),
        10,
    )
    .await;
    assert_plans_surge(&plan_and_surges(&client, ns, "a").await, "scale", ns, FLEET);

    let fleet = Fleet::watch(&client, ns, FLEET).await;
    delete_machine(&client, ns, "a").await;
    let killed = if restart {
        wait::for_one(
            Api::<Deployment>::namespaced(client.clone(), ns),
            LONG,
            "fleet scaled up to 11",
            |d| d.name_any() == FLEET && d.spec.replicas == Some(11),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        case.kill().await;
        let at = Timestamp::now();
        let p = Api::<Pod>::namespaced(client.clone(), ns)
            .get(&old)
            .await
            .expect("the old pod is still there at the kill");
        assert!(
            p.metadata.deletion_timestamp.is_none(),
            "killed before the old pod went:\n{}",
            fleet.log()
        );
        assert_permit_records_scale_up(&client, ns, FLEET, 10, 11).await;
        case.spawn(&flags).await;
        Some(at)
    } else {
        None
    };
    gone(&client, ns, "a", GONE_WITHIN).await;

    let bed = BED.bed().await;
    let truth = fleet.log();
    assert_eq!(
        fleet.replicas_seen(),
        [10, 11, 10],
        "scaled up by one, then back:\n{truth}"
    );
    assert_eq!(
        fleet.spec_changes(),
        2,
        "two spec changes, the scale-up and the scale back:\n{truth}"
    );
    assert!(
        fleet.versions().iter().all(|v| v.surged_for.is_none()),
        "no template change:\n{truth}"
    );
    assert_eq!(
        replica_sets(&client, ns, FLEET).await.len(),
        1,
        "no new revision"
    );
    let all = oracle::requests_once(bed, ns, |rs| {
        accepted(&deployment_writes(rs, FLEET)).len() >= 2
    })
    .await;
    let writes = deployment_writes(&all, FLEET);
    let done = accepted(&writes);
    let log = oracle::log_of(&writes);
    assert_eq!(done.len(), 2, "one scale-up, one scale back: {log}");
    if let Some(at) = killed {
        assert!(
            done[0].received < at && at < done[1].received,
            "scaled up before the kill ({at}), back after it: {log}"
        );
    }
    assert_removed_by_its_replica_set(bed, ns, &old).await;
    assert_eq!(
        fleet.cheapest(),
        [old],
        "only the old pod marked the cheapest to delete"
    );
    assert!(
        fleet.max_live() <= 11 && fleet.max_existing() <= 11,
        "never more than 11 pods at once:\n{truth}"
    );
    assert_eq!(fleet.pods_ever(), 11, "one new pod:\n{truth}");
    let evs = drain_events(&client, ns, "a").await;
    if restart {
        // The first process may not have published its Surging Event
        // before it was killed.
        assert!(first(&evs, "SurgeFailed", "").is_none(), "{}", log_of(&evs));
    } else {
        assert_told_surging(&evs, ns, FLEET);
    }
}

/// The move's MovePermit in `ns` records the scale-up of Deployment
/// `name` from `from` to `to` replicas, not restored yet.
async fn assert_permit_records_scale_up(client: &Client, ns: &str, name: &str, from: i64, to: i64) {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &ApiResource::erase::<MovePermit>(&()));
    let permits = api
        .list(&ListParams::default())
        .await
        .expect("list MovePermits")
        .items;
    let surges: Vec<&serde_json::Value> = permits
        .iter()
        .filter_map(|p| p.data.get("spec")?.get("surge"))
        .collect();
    let [s] = surges.as_slice() else {
        panic!("one MovePermit records the surge: {surges:?}");
    };
    assert_eq!(s["method"], "ScaleUp", "{s}");
    assert_eq!(
        (s["from"].as_i64(), s["to"].as_i64()),
        (Some(from), Some(to)),
        "{s}"
    );
    assert!(
        s["deployment"].as_str().is_some_and(|d| d.contains(name)),
        "{s}"
    );
    assert_ne!(s["restored"], true, "{s}");
}

/// One of ten replicas on Machine A (nine elsewhere) behind
/// `maxUnavailable: 0`: the Deployment is scaled from 10 to 11 and back,
/// never rolled (see [`one_of_ten`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_ten_replicas_is_replaced_by_a_scale_up_and_back() {
    one_of_ten("surge-scale", false).await;
}

/// [`one_of_ten`] with the controller killed between the scale-up and the
/// scale back: the restarted one neither scales up again nor forgets to
/// scale back, and scales back once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_killed_mid_scale_up_scales_back_exactly_once() {
    one_of_ten("surge-scale-kill", true).await;
}

/// A Deployment a HorizontalPodAutoscaler targets (CPU; the test bed has
/// no metrics server, so it never scales), one pod on Machine A and one on
/// B, behind `minAvailable: 2`: berth rolls it and never writes its
/// `spec.replicas` (the Deployment's watch saw 2 throughout; berth wrote
/// it once, the template's annotation: one spec change).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_autoscaled_deployment_is_rolled_and_its_replicas_never_written() {
    let ns = "surge-hpa";
    let name = "scaled";
    let (_case, client, node_a, node_b) = two_machines(ns, "10m").await;
    let mut d = deployment(name, 2, 1, ns);
    rolling(&mut d, 1, 0);
    place(&client, ns, d, 1, &node_a, &node_b).await;
    create(
        Api::<HorizontalPodAutoscaler>::namespaced(client.clone(), ns),
        json(serde_json::json!({
            "metadata": {"name": name},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                "minReplicas": 1,
                "maxReplicas": 3,
                "metrics": [{"type": "Resource", "resource": {
                    "name": "cpu",
                    "target": {"type": "Utilization", "averageUtilization": 80}
                }}]
            }
        })),
    )
    .await;
    budget(&client, ns, name, serde_json::json!({"minAvailable": 2}), 2).await;
    assert_plans_surge(&plan_and_surges(&client, ns, "a").await, "roll", ns, name);

    let fleet = Fleet::watch(&client, ns, name).await;
    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", GONE_WITHIN).await;

    assert_eq!(
        fleet.replicas_seen(),
        [2],
        "nobody wrote spec.replicas:\n{}",
        fleet.log()
    );
    let writes = deployment_writes(&requests(BED.bed().await, ns), name);
    assert!(
        writes
            .iter()
            .all(|r| r.subresource.as_deref() != Some("scale")),
        "berth wrote the Deployment's scale: {}",
        oracle::log_of(&writes)
    );
    assert_rolled_once(&client, ns, name, &fleet, 3).await;
    assert_told_surging(&drain_events(&client, ns, "a").await, ns, name);
}

/// Waits until claim `claim` is Bound.
async fn claim_bound(client: &Client, ns: &str, claim: &str) {
    wait::for_one(
        Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns),
        LONG,
        &format!("claim {claim} Bound"),
        |c| {
            c.name_any() == claim
                && c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// After Machine `a` of `ns` was deleted at `at`: on its first pass the
/// drain said (a `SurgeImpossible` Event, within [`TOLD_WITHIN`]) that
/// `pod` of `workload` cannot surge, the Event's note containing `why`;
/// and by the audit log it went on as before a surge existed: its
/// evictions of `pod` refused by the PDB, no DELETE of it. Returns
/// berth's requests.
async fn assert_cannot_surge(
    client: &Client,
    ns: &str,
    pod: &str,
    workload: &str,
    why: &str,
    at: Timestamp,
) -> Vec<Request> {
    let evs = events_of(client, ns, "a", "SurgeImpossible", 1).await;
    let told: Vec<(Option<Timestamp>, String)> = evs
        .iter()
        .map(|e| {
            (
                e.event_time.as_ref().map(|t| t.0),
                e.note.clone().unwrap_or_default(),
            )
        })
        .collect();
    let (when, _) = told
        .iter()
        .find(|(_, n)| n.contains(workload) && n.contains(why))
        .unwrap_or_else(|| {
            panic!("a SurgeImpossible Event names {workload} and says {why:?}: {told:?}")
        });
    let when = when.unwrap_or_else(|| panic!("the Event has its time: {told:?}"));
    assert!(
        when.duration_since(at) < TOLD_WITHIN,
        "told at {when}, more than {TOLD_WITHIN} after the deletion ({at}): {told:?}"
    );
    let bed = BED.bed().await;
    let refused = |r: &Request| {
        r.subresource.as_deref() == Some("eviction")
            && r.name.as_deref() == Some(pod)
            && r.code == 429
    };
    let all = oracle::requests_once(bed, ns, |rs| rs.iter().any(refused)).await;
    let about: Vec<Request> = all
        .iter()
        .filter(|r| r.resource == "pods" && r.name.as_deref() == Some(pod))
        .cloned()
        .collect();
    let log = oracle::log_of(&about);
    assert!(
        about.iter().any(refused),
        "{pod} still evicted through the Eviction API, refused by its PDB:\n{log}"
    );
    assert!(
        !about
            .iter()
            .any(|r| r.verb == "delete" && r.subresource.is_none()),
        "berth deleted {pod}:\n{log}"
    );
    assert!(
        oracle::accepted_evictions_of(&oracle::evictions(bed, ns), pod).is_empty(),
        "{pod} evicted past its PDB:\n{log}"
    );
    all
}

/// A one-replica Deployment `name` whose pod mounts claim `name` of
/// access mode `mode`, bound to PV `volume` (created here, with the claim).
async fn with_claim(
    client: &Client,
    ns: &str,
    name: &str,
    volume: k8s_openapi::api::core::v1::PersistentVolume,
    mode: &str,
) -> Deployment {
    let pv = volume.name_any();
    create(Api::all(client.clone()), volume).await;
    create(
        Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns),
        json(serde_json::json!({
            "metadata": {"name": name},
            "spec": {
                "accessModes": [mode], "storageClassName": "", "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}}
            }
        })),
    )
    .await;
    claim_bound(client, ns, name).await;
    let mut d = deployment(name, 1, 1, ns);
    if let Some(spec) = d.spec.template.spec.as_mut() {
        spec.volumes = Some(vec![json(serde_json::json!({
            "name": "data", "persistentVolumeClaim": {"claimName": name}
        }))]);
        spec.containers[0].volume_mounts = Some(vec![json(serde_json::json!({
            "name": "data", "mountPath": "/data"
        }))]);
    }
    d
}

/// A one-replica StatefulSet whose pod has a ReadWriteOnce claim, behind
/// `minAvailable: 1`, on Machine A (deadline 40 s): a StatefulSet cannot
/// run a second pod beside its pod, so the drain says `SurgeImpossible`
/// (naming the StatefulSet) on its first pass, keeps evicting through the
/// Eviction API, and writes nothing to the StatefulSet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stateful_set_cannot_surge_and_is_left_alone() {
    let ns = "surge-sts";
    let name = "vault";
    let (_case, client, node_a, node_b) = two_machines(ns, "40s").await;
    cordon(&client, &node_b, true).await;
    stateful(&client, ns, name, 1, |_| {}).await;
    pods_of(&client, ns, name, "vault-0 Ready on A", |ps| {
        ps.len() == 1 && on_node(ps[0], &node_a) && serving(ps[0])
    })
    .await;
    cordon(&client, &node_b, false).await;
    claim_bound(&client, ns, &format!("data-{name}-0")).await;
    budget(&client, ns, name, serde_json::json!({"minAvailable": 1}), 1).await;

    let at = Timestamp::now();
    delete_machine(&client, ns, "a").await;
    let all = assert_cannot_surge(&client, ns, "vault-0", name, "StatefulSet", at).await;
    let sts_writes: Vec<Request> = all
        .into_iter()
        .filter(|r| r.is_write() && r.resource == "statefulsets")
        .collect();
    assert!(
        sts_writes.is_empty(),
        "berth wrote the StatefulSet: {}",
        oracle::log_of(&sts_writes)
    );
}

/// A one-replica Deployment whose pod has a ReadWriteOnce claim on an
/// attachable volume, behind `minAvailable: 1`, on Machine A: a second pod
/// could not attach it, so the drain says `SurgeImpossible` (naming the
/// claim's access mode) on its first pass, keeps evicting through the
/// Eviction API, and writes nothing to the Deployment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_with_a_read_write_once_claim_cannot_surge() {
    let ns = "surge-rwo";
    let name = "files";
    let (_case, client, node_a, node_b) = two_machines(ns, "40s").await;
    let pv = format!("{ns}-{name}");
    let d = with_claim(
        &client,
        ns,
        name,
        csi_pv(&pv, &format!("vol-{pv}"), ns, name),
        "ReadWriteOnce",
    )
    .await;
    let pods = place(&client, ns, d, 1, &node_a, &node_b).await;
    let pod = pods[0].name_any();
    budget(&client, ns, name, serde_json::json!({"minAvailable": 1}), 1).await;

    let at = Timestamp::now();
    delete_machine(&client, ns, "a").await;
    let all = assert_cannot_surge(&client, ns, &pod, name, "ReadWriteOnce", at).await;
    let writes = deployment_writes(&all, name);
    assert!(
        writes.is_empty(),
        "berth wrote the Deployment: {}",
        oracle::log_of(&writes)
    );
    assert_eq!(replica_sets(&client, ns, name).await.len(), 1);
}

/// A cluster DrainRule whose terms turn surges off (`moves.surge: false`)
/// for the pods of one namespace, for pods whose templates the operator
/// does not own: a singleton behind `minAvailable: 1` there is not
/// surged. `berth plan` and a `SurgeImpossible` Event name the rule on
/// the first pass, the rule is `Accepted`, and by the audit log berth
/// writes nothing to the Deployment and keeps evicting through the
/// Eviction API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_rule_turns_surges_off_for_the_pods_it_picks() {
    let ns = "surge-ruled";
    let name = "ruled";
    let rule_name = format!("{ns}-off");
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "40s"}))
        .start()
        .await;
    let client = case.client();
    let rules: Api<berth::api::DrainRule> = Api::all(client.clone());
    create(
        rules.clone(),
        json(serde_json::json!({
            "metadata": {"name": rule_name},
            "spec": {
                "drain": {"behavior": "Drain"},
                "pods": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}],
                "moves": {"surge": false},
            }
        })),
    )
    .await;
    wait::for_one(rules.clone(), LONG, &format!("{rule_name} Accepted"), |r| {
        r.name_any() == rule_name
            && r.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "Accepted" && c.status == "True")
            })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, ns, "b", ns).await;
    let pods = place(&client, ns, deployment(name, 1, 1, ns), 1, &node_a, &node_b).await;
    let pod = pods[0].name_any();
    budget(&client, ns, name, serde_json::json!({"minAvailable": 1}), 1).await;
    let plan = plan_and_surges(&client, ns, "a").await;
    assert!(
        plan.lines()
            .any(|l| l.contains("no surge") && l.contains(&format!("DrainRule {rule_name}"))),
        "berth plan names the rule that turns surges off:\n{plan}"
    );

    let at = Timestamp::now();
    delete_machine(&client, ns, "a").await;
    let all = assert_cannot_surge(&client, ns, &pod, &rule_name, "surges off", at).await;
    let writes = deployment_writes(&all, name);
    assert!(
        writes.is_empty(),
        "berth wrote the Deployment: {}",
        oracle::log_of(&writes)
    );
    let _ = rules.delete(&rule_name, &Default::default()).await;
}

/// A one-replica Deployment whose pod shares a ReadWriteMany claim on a
/// volume that attaches nowhere (a CSI driver with `attachRequired:
/// false`, NFS-like), behind `minAvailable: 1`: a second pod can use the
/// volume, so the pod is surged inside its stateful move (the move's
/// permit records it). By the pods' watch, never none Ready; one new
/// revision; the old pod removed by its ReplicaSet, never by berth; the
/// Machine gone long before its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_claim_that_attaches_nowhere_is_surged_inside_its_move() {
    let ns = "surge-shared";
    let name = "share";
    let (_case, client, node_a, node_b) = two_machines(ns, "10m").await;
    attach_free_driver(&client, ATTACH_FREE_DRIVER).await;
    let pv = format!("{ns}-{name}");
    let mut volume = csi_pv_on(ATTACH_FREE_DRIVER, &pv, &format!("vol-{pv}"), ns, name);
    if let Some(spec) = volume.spec.as_mut() {
        spec.access_modes = Some(vec!["ReadWriteMany".into()]);
    }
    let d = with_claim(&client, ns, name, volume, "ReadWriteMany").await;
    let pods = place(&client, ns, d, 1, &node_a, &node_b).await;
    let old = pods[0].name_any();
    budget(&client, ns, name, serde_json::json!({"minAvailable": 1}), 1).await;
    assert_plans_surge(&plan_and_surges(&client, ns, "a").await, "roll", ns, name);

    let fleet = Fleet::watch(&client, ns, name).await;
    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", GONE_WITHIN).await;

    assert_rolled_once(&client, ns, name, &fleet, 2).await;
    assert_not_bypassed(&requests(BED.bed().await, ns), &old, 1);
    assert_removed_by_its_replica_set(BED.bed().await, ns, &old).await;
}
