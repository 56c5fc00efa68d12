//! A destination before every stateful eviction (issue 38): a pod whose
//! volumes must attach again is evicted only once a Node can take its
//! replacement (in the volume's zone, with the CSI driver registered, a
//! free attach slot); until then it stays, named, and the drain goes on
//! with the rest. The truth is the audit log (when the evictions came),
//! watches of pods and VolumeAttachments (where the replacements went and
//! how long they waited), and the scheduler's Events (never a
//! FailedScheduling for a pod berth evicted).

mod support;

use std::time::Duration;

use berth::api::Machine;
use berth_devkit::bench::audit::Request;
use berth_devkit::testbed::fixtures::csi_pv;
use berth_devkit::testbed::stages::CSI_DRIVER;
use k8s_openapi::api::core::v1::{Event, PersistentVolume, Pod};
use k8s_openapi::api::storage::v1::CSINode;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use support::oracle::{self, Seen, Watches, accepted_evictions_of};
use support::pool::{
    Bed, POOL, create, delete_machine, gone, json, running_machine, running_pods, stateful,
};
use support::{Case, LONG, wait_machine};

const BED: Bed = Bed {
    attach: Duration::from_secs(1),
    detach: Duration::from_secs(1),
};

const ZONE: &str = "topology.kubernetes.io/zone";

/// A fake class `name` of pool `ns` whose Nodes are in zone `zone`, run
/// `drivers` (`None`: the test bed's driver, no limit), with `drain`.
async fn zonal_class(
    client: &Client,
    ns: &str,
    name: &str,
    zone: &str,
    drivers: Option<serde_json::Value>,
) {
    let mut spec = serde_json::json!({"nodeLabels": {POOL: ns, ZONE: zone}});
    if let Some(d) = drivers {
        spec["csiDrivers"] = d;
    }
    let mut c = support::class(name, "fake", spec);
    c.spec.drain = Some(json(serde_json::json!({"timeout": "5m"})));
    create(Api::all(client.clone()), c).await;
}

/// A case in `ns` with a fake class per `(suffix, zone, drivers)` (named
/// `<ns>-<suffix>`, see [`zonal_class`]), its controller started.
async fn zonal_case(
    ns: &str,
    classes: &[(&str, &str, Option<serde_json::Value>)],
) -> (Case, Client) {
    let mut case = Case::builder(ns).on(BED).build().await;
    let client = case.client();
    for (suffix, zone, drivers) in classes {
        let name = format!("{ns}-{suffix}");
        zonal_class(&client, ns, &name, zone, drivers.clone()).await;
    }
    case.start().await;
    (case, client)
}

/// Asserts that the scheduler refused no pod of `ns` named `prefix*`
/// since `since` (see [`failed_scheduling`]).
async fn assert_never_refused(client: &Client, ns: &str, prefix: &str, since: Timestamp) {
    let refused = failed_scheduling(client, ns, prefix, since).await;
    assert!(
        refused.is_empty(),
        "the scheduler refused a replica: {refused:?}"
    );
}

/// The request that created Node `node`'s CSINode (the fake VM's kubelet
/// registering it, audited as the controller's).
fn csi_node_created<'a>(all: &'a [Request], node: &str, log: &str) -> &'a Request {
    all.iter()
        .find(|r| r.resource == "csinodes" && r.verb == "create" && r.name.as_deref() == Some(node))
        .unwrap_or_else(|| panic!("{node}'s CSINode registered: {log}"))
}

/// The StatefulSet `db` of `replicas` in pool `ns`, each replica's PV in
/// zone `zone` (node affinity), one second of grace.
async fn zonal_db(client: &Client, ns: &str, replicas: i32, zone: &str) {
    for i in 0..replicas {
        let pv = format!("{ns}-db-{i}");
        let mut p = csi_pv(&pv, &format!("vol-{pv}"), ns, &format!("data-db-{i}"));
        if let Some(spec) = p.spec.as_mut() {
            spec.node_affinity = Some(json(serde_json::json!({"required": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": ZONE, "operator": "In", "values": [zone]}]}]}})));
        }
        create(Api::<PersistentVolume>::all(client.clone()), p).await;
    }
    stateful(client, ns, "db", replicas, |_| {}).await;
    let names: Vec<String> = (0..replicas).map(|i| format!("db-{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    running_pods(client, ns, &names).await;
}

/// The scheduler's FailedScheduling Events about pods of `ns` named
/// `prefix*` since `since` (the deletion: none may exist for a pod berth
/// evicted; the first placement of a StatefulSet's pods, before their
/// claims bind, has some).
async fn failed_scheduling(
    client: &Client,
    ns: &str,
    prefix: &str,
    since: Timestamp,
) -> Vec<String> {
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| {
            let at = e
                .event_time
                .as_ref()
                .map(|t| t.0)
                .or(e.last_timestamp.as_ref().map(|t| t.0));
            e.reason.as_deref() == Some("FailedScheduling")
                && at.is_some_and(|t| t >= since)
                && e.involved_object
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with(prefix))
        })
        .map(|e| e.message.unwrap_or_default())
        .collect()
}

/// The drain's `status.drain.blockedBy` of Machine `name`, once it
/// contains `needle`.
async fn blocked_by(client: &Client, ns: &str, name: &str, needle: &str) -> String {
    let m = wait_machine(
        client,
        ns,
        name,
        &format!("blockedBy names {needle:?}"),
        |m| blocked(m).is_some_and(|b| b.contains(needle)),
    )
    .await;
    blocked(&m).unwrap_or_default()
}

fn blocked(m: &Machine) -> Option<String> {
    m.status.as_ref()?.drain.as_ref()?.blocked_by.clone()
}

/// The only Node of zone a holds three replicas with zone-a volumes, and
/// the only other Node is in zone b. Deleted, the Machine's pods without
/// volumes go at once; not one replica is evicted (audit log) while no
/// Node of zone a can take it, and `status.drain.blockedBy` names zone a.
/// Once a zone-a Machine runs, they move one at a time, each after its
/// CSINode was registered, each replacement bound within 10 s of its
/// predecessor gone, and the scheduler never refused one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_waits_for_a_node_in_its_volumes_zone() {
    let ns = "dest-zone";
    let (za, zb) = (format!("{ns}-a"), format!("{ns}-b"));
    let (case, client) = zonal_case(ns, &[("a", &za, None), ("b", &zb, None)]).await;
    let node_a = running_machine(&client, ns, "a", &za).await;
    zonal_db(&client, ns, 3, &za).await;
    // Pods without volumes on a, free to go anywhere in the pool.
    for i in 0..2 {
        create(
            Api::<Pod>::namespaced(client.clone(), ns),
            json(serde_json::json!({
                "metadata": {"name": format!("web-{i}")},
                "spec": {"nodeName": node_a, "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "web", "image": "registry.invalid/web:1"}]}
            })),
        )
        .await;
    }
    running_pods(&client, ns, &["web-0", "web-1"]).await;
    running_machine(&client, ns, "b", &zb).await;
    let watches = Watches::start(&client, ns).await;

    let deleted = Timestamp::now();
    delete_machine(&client, ns, "a").await;
    let why = blocked_by(&client, ns, "a", &format!("zone {za}")).await;
    assert!(
        why.contains("berth makes no Node for it (the Machine belongs to no MachineSet)")
            && why.contains("no Node can take the replacement of pod dest-zone/db-")
            && why.contains(&format!("zone {zb}: {ns}-b outside PV {ns}-db-")),
        "{why}"
    );
    // berth plan says the same, from its own lists.
    let plan = berth::cli::plan::plan_machine(&client, ns, "a")
        .await
        .expect("berth plan")
        .destinations();
    assert!(
        plan.contains(&format!("{ns}/db-0: no Node can take its replacement"))
            && plan.contains(&format!("zone {zb}: {ns}-b outside PV {ns}-db-")),
        "{plan}"
    );
    // The pods without volumes went; no replica did, for 10 s.
    let bed = BED.bed().await;
    let web =
        oracle::requests_once(bed, ns, |rs| accepted_evictions_of(rs, "web-*").len() == 2).await;
    assert_eq!(
        accepted_evictions_of(&web, "web-*").len(),
        2,
        "{}",
        oracle::log_of(&web)
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    let before = oracle::evictions(bed, ns);
    assert!(
        accepted_evictions_of(&before, "db-*").is_empty()
            && before
                .iter()
                .all(|r| !r.name.as_deref().unwrap_or_default().starts_with("db-")),
        "no replica evicted without a destination: {}",
        oracle::log_of(&before)
    );

    // A Node in zone a: each replica moves there, one at a time.
    let node_a2 = running_machine(&client, ns, "a2", &za).await;
    gone(&client, ns, "a", Duration::from_secs(180)).await;
    let all =
        oracle::requests_once(bed, ns, |rs| accepted_evictions_of(rs, "db-*").len() == 3).await;
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let registered = csi_node_created(&all, &node_a2, &log);
    let mut evicted: Vec<_> = accepted_evictions_of(&all, "db-*");
    assert_eq!(evicted.len(), 3, "{log}");
    evicted.sort_by_key(|r| r.received);
    for e in &evicted {
        assert!(
            e.received > registered.received,
            "evicted before a2 could take it: {log}"
        );
    }
    let seen = watches.seen();
    for pair in evicted.windows(2) {
        let pod = pair[0].name.clone().unwrap_or_default();
        let pv = format!("{ns}-{pod}");
        let attached = watches
            .attached_on(bed, &pv, &node_a2)
            .await
            .unwrap_or_else(|| panic!("{pv} attached on {node_a2}: {log}"));
        assert!(
            pair[1].received > attached,
            "{} evicted before {pv} attached: {log}",
            pair[1].name.clone().unwrap_or_default()
        );
    }
    // Each replacement was bound within 10 s of its predecessor gone (both
    // seen by one watch of the pods): not left Pending for want of a Node
    // that can take it (a refusal is `assert_never_refused`'s). The bound
    // is the StatefulSet controller's and the scheduler's reaction on a
    // loaded machine, not the 2 s they take on an idle one.
    for e in &evicted {
        let name = e.name.clone().unwrap_or_default();
        let gone_at = seen
            .iter()
            .find_map(|(t, s)| {
                matches!(s, Seen::PodGone { name: n, .. } if *n == name).then_some(*t)
            })
            .unwrap_or_else(|| panic!("{name} gone: {log}"));
        let bound_at = seen
            .iter()
            .find_map(|(t, s)| match s {
                Seen::PodOn { name: n, node, .. }
                    if *n == name && *node == node_a2 && *t >= gone_at =>
                {
                    Some(*t)
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("{name}'s replacement bound on {node_a2}: {log}"));
        let pending = bound_at.duration_since(gone_at);
        assert!(
            pending <= k8s_openapi::jiff::SignedDuration::from_secs(10),
            "{name}'s replacement Pending {pending:?}: {log}"
        );
    }
    assert_never_refused(&client, ns, "db-", deleted).await;
    case.finish().await;
}

/// The destination runs no CSI node plugin yet: its CSINode lists no
/// driver. The replica is evicted only after the driver is registered
/// there, 20 s after the deletion (audit order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_waits_for_its_driver_on_the_destination() {
    let ns = "dest-driver";
    let (with, without) = (format!("{ns}-with"), format!("{ns}-without"));
    let (case, client) = zonal_case(
        ns,
        &[
            ("with", ns, None),
            ("without", ns, Some(serde_json::json!([]))),
        ],
    )
    .await;
    running_machine(&client, ns, "a", &with).await;
    zonal_db(&client, ns, 1, ns).await;
    let node_b = running_machine(&client, ns, "b", &without).await;

    let deleted = Timestamp::now();
    delete_machine(&client, ns, "a").await;
    let why = blocked_by(&client, ns, "a", "no CSINode entry").await;
    assert!(
        why.contains(&format!("{node_b} no CSINode entry for {CSI_DRIVER}")),
        "{why}"
    );
    tokio::time::sleep(Duration::from_secs(20)).await;
    let bed = BED.bed().await;
    assert!(
        accepted_evictions_of(&oracle::evictions(bed, ns), "db-0").is_empty(),
        "evicted before the driver was registered"
    );
    // The node plugin registers, as it would on a real Node.
    let registered = Timestamp::now();
    Api::<CSINode>::all(client.clone())
        .patch(
            &node_b,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"drivers": [
                {"name": CSI_DRIVER, "nodeID": node_b}]}})),
        )
        .await
        .expect("register the driver");
    gone(&client, ns, "a", Duration::from_secs(120)).await;
    let all =
        oracle::requests_once(bed, ns, |rs| accepted_evictions_of(rs, "db-0").len() == 1).await;
    let evicted = accepted_evictions_of(&all, "db-0");
    assert_eq!(evicted.len(), 1, "{}", oracle::log_of(&all));
    assert!(
        evicted[0].received > registered,
        "evicted at {} before the driver was registered at {registered}",
        evicted[0].received
    );
    assert_never_refused(&client, ns, "db-", deleted).await;
    case.finish().await;
}

/// A StatefulSet `set` of one replica in pool `ns`, its PV attachable.
async fn one_replica(client: &Client, ns: &str, set: &str) {
    let pv = format!("{ns}-{set}-0");
    create(
        Api::all(client.clone()),
        csi_pv(&pv, &format!("vol-{pv}"), ns, &format!("data-{set}-0")),
    )
    .await;
    stateful(client, ns, set, 1, |_| {}).await;
}

/// Two Machines deleted at once, each with a replica of its own
/// StatefulSet, and one destination with one free attach slot: exactly
/// one replica is evicted, the other waits naming the slots; once the
/// destination has a second slot (its CSINode's count raised), the other
/// goes too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_drains_never_take_the_last_slot_twice() {
    let ns = "dest-slots";
    let (old, dest) = (format!("{ns}-old"), format!("{ns}-dest"));
    let one_slot = serde_json::json!([{"name": CSI_DRIVER, "count": 1}]);
    let (case, client) = zonal_case(ns, &[("old", ns, None), ("dest", ns, Some(one_slot))]).await;
    // db1-0 on one, then db2-0 on two (one cordoned meanwhile).
    let node_1 = running_machine(&client, ns, "one", &old).await;
    one_replica(&client, ns, "db1").await;
    running_pods(&client, ns, &["db1-0"]).await;
    let unschedulable = |on: bool| serde_json::json!({"spec": {"unschedulable": on}});
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    nodes
        .patch(
            &node_1,
            &PatchParams::default(),
            &Patch::Merge(unschedulable(true)),
        )
        .await
        .expect("cordon one");
    running_machine(&client, ns, "two", &old).await;
    one_replica(&client, ns, "db2").await;
    running_pods(&client, ns, &["db2-0"]).await;
    nodes
        .patch(
            &node_1,
            &PatchParams::default(),
            &Patch::Merge(unschedulable(false)),
        )
        .await
        .expect("uncordon one");
    let node_d = running_machine(&client, ns, "d", &dest).await;

    let deleted = Timestamp::now();
    for m in ["one", "two"] {
        delete_machine(&client, ns, m).await;
    }
    let bed = BED.bed().await;
    let first =
        oracle::requests_once(bed, ns, |rs| !accepted_evictions_of(rs, "db*").is_empty()).await;
    let slots = |m: &Machine| blocked(m).is_some_and(|b| b.contains("attach slots of"));
    let machines = berth_devkit::testbed::wait::until(
        Api::<Machine>::namespaced(client.clone(), ns),
        LONG,
        "a drain waits for an attach slot",
        |ms| ms.iter().any(|m| slots(m)),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", oracle::log_of(&first)));
    let waiting = machines
        .iter()
        .find(|m| slots(m))
        .map(|m| m.name_any())
        .expect("the waiting drain");
    let why = blocked_by(&client, ns, &waiting, "attach slots of").await;
    assert!(
        why.contains(&format!("{node_d} 1/1 attach slots of {CSI_DRIVER}")),
        "{why}"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let evicted = accepted_evictions_of(&oracle::evictions(bed, ns), "db*").len();
    assert_eq!(
        evicted,
        1,
        "exactly one replica evicted: {}",
        oracle::log_of(&first)
    );
    // A second slot on the destination.
    let raised = Timestamp::now();
    Api::<CSINode>::all(client.clone())
        .patch(
            &node_d,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"drivers": [
                {"name": CSI_DRIVER, "nodeID": node_d, "allocatable": {"count": 2}}]}})),
        )
        .await
        .expect("raise the limit");
    gone(&client, ns, &waiting, LONG * 2).await;
    let all =
        oracle::requests_once(bed, ns, |rs| accepted_evictions_of(rs, "db*").len() == 2).await;
    let mut both = accepted_evictions_of(&all, "db*");
    assert_eq!(both.len(), 2, "{}", oracle::log_of(&all));
    both.sort_by_key(|r| r.received);
    assert!(
        both[1].received > raised,
        "the second went before a slot was free: {}",
        oracle::log_of(&all)
    );
    assert_never_refused(&client, ns, "db", deleted).await;
    case.finish().await;
}

/// A MachineSet of zone a with one Machine, which holds a replica with a
/// zone-a volume; the pool's only other Node is in zone b. The Machine
/// deleted by hand: its set brings up a replacement, and the replica is
/// evicted only once that Machine's Node could take it (its CSINode
/// registered, audit order). The set scaled to zero: nothing will make a
/// zone-a Node, which the drain names at once, and nothing stateful is
/// evicted (the deadline, 5 minutes, is far).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_set_replacement_is_the_destination() {
    let ns = "dest-set";
    let (za, zb) = (format!("{ns}-a"), format!("{ns}-b"));
    let (case, client) = zonal_case(ns, &[("a", &za, None), ("b", &zb, None)]).await;
    running_machine(&client, ns, "b", &zb).await;
    let sets: Api<berth::api::MachineSet> = Api::namespaced(client.clone(), ns);
    create(
        sets.clone(),
        berth_devkit::testbed::fixtures::machine_set("db-set", &za, 1),
    )
    .await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let of_set = |m: &Machine| berth::api::set_owner(m).is_some_and(|(s, _)| s == "db-set");
    let first = berth_devkit::testbed::wait::for_one(
        machines.clone(),
        LONG,
        "the set's Machine runs",
        |m| {
            of_set(m)
                && m.status
                    .as_ref()
                    .and_then(|s| s.node_ref.as_ref())
                    .is_some()
        },
    )
    .await
    .expect("the set's Machine");
    let old = first.name_any();
    zonal_db(&client, ns, 1, &za).await;

    delete_machine(&client, ns, &old).await;
    gone(&client, ns, &old, Duration::from_secs(180)).await;
    let bed = BED.bed().await;
    let all =
        oracle::requests_once(bed, ns, |rs| accepted_evictions_of(rs, "db-0").len() == 1).await;
    let log = oracle::log_of(&all);
    let evicted = accepted_evictions_of(&all, "db-0");
    assert_eq!(evicted.len(), 1, "{log}");
    let replacement = machines
        .list(&Default::default())
        .await
        .expect("machines")
        .items
        .into_iter()
        .find(|m| of_set(m) && m.name_any() != old)
        .expect("the set's replacement");
    let node = replacement
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| r.name.clone())
        .expect("its Node");
    let registered = csi_node_created(&all, &node, &log);
    assert!(
        evicted[0].received > registered.received,
        "db-0 evicted before its destination could take it: {log}"
    );

    // Scaled to zero: no Node of zone a will come.
    sets.patch(
        "db-set",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"replicas": 0}})),
    )
    .await
    .expect("scale to zero");
    let why = blocked_by(&client, ns, &replacement.name_any(), &format!("zone {za}")).await;
    assert!(
        why.contains("MachineSet db-set is making no Machine that could"),
        "{why}"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let all = oracle::evictions(bed, ns);
    assert_eq!(
        accepted_evictions_of(&all, "db-0").len(),
        1,
        "nothing stateful evicted without a destination: {}",
        oracle::log_of(&all)
    );
    case.finish().await;
}

/// A rollout of a zonal pool (`maxSurge: 1`): the replica with its zone-a
/// volume is evicted from the old Machine only once the new Machine's
/// Node could take it (its CSINode registered, audit order), and the
/// scheduler never refuses it. (With `maxSurge: 0` a deployment makes its
/// new Machine only once the old VM is gone, so the old drain has no
/// destination in a one-Machine zone until its deadline: the Warning
/// says so, and docs/drain.md tells to surge such pools.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_brings_the_new_machine_up_before_the_replica_goes() {
    use berth_devkit::testbed::fixtures::{machine_deployment, rolling};
    let ns = "dest-rollout";
    let (za, za2, zb) = (format!("{ns}-a"), format!("{ns}-a2"), format!("{ns}-b"));
    let (case, client) =
        zonal_case(ns, &[("a", &za, None), ("a2", &za, None), ("b", &zb, None)]).await;
    running_machine(&client, ns, "b", &zb).await;
    let deployments: Api<berth::api::MachineDeployment> = Api::namespaced(client.clone(), ns);
    create(
        deployments.clone(),
        machine_deployment("pool", &za, 1, "md", rolling(1.into(), 0.into())),
    )
    .await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let has_node = |m: &Machine| {
        m.status
            .as_ref()
            .and_then(|s| s.node_ref.as_ref())
            .is_some()
    };
    let old = berth_devkit::testbed::wait::for_one(
        machines.clone(),
        LONG,
        "the pool's Machine runs",
        |m| m.name_any() != "b" && has_node(m),
    )
    .await
    .expect("the pool's Machine")
    .name_any();
    zonal_db(&client, ns, 1, &za).await;

    let deleted = Timestamp::now();
    deployments
        .patch(
            "pool",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"template": {"spec": {
                "classRef": {"name": za2}}}}})),
        )
        .await
        .expect("roll the pool");
    gone(&client, ns, &old, Duration::from_secs(180)).await;
    let new =
        berth_devkit::testbed::wait::for_one(machines.clone(), LONG, "the new Machine runs", |m| {
            m.name_any() != "b" && m.name_any() != old && has_node(m)
        })
        .await
        .expect("the new Machine");
    let node = new
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| r.name.clone())
        .expect("its Node");
    let bed = BED.bed().await;
    let all =
        oracle::requests_once(bed, ns, |rs| accepted_evictions_of(rs, "db-0").len() == 1).await;
    let log = oracle::log_of(&all);
    let evicted = accepted_evictions_of(&all, "db-0");
    assert_eq!(evicted.len(), 1, "{log}");
    let registered = csi_node_created(&all, &node, &log);
    assert!(
        evicted[0].received > registered.received,
        "db-0 evicted before the new Machine could take it: {log}"
    );
    assert_never_refused(&client, ns, "db-", deleted).await;
    case.finish().await;
}
