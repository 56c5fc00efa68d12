//! The move ledger, end to end on the real control plane: a workload's
//! move budget holds across every drain. The truth of each assertion is
//! what the cluster did: the API server's audit log of evictions and a
//! watch of VolumeAttachments (`support::oracle`).

mod support;

use std::time::Duration;

use berth_devkit::testbed::wait;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::Api;
use kube::{Client, ResourceExt};
use support::oracle::{self, Watches, accepted_evictions_of, evicted_once, evictions, in_order};
use support::pool::{Bed, delete_machine, gone, json, running_machine};
use support::{Case, LONG};

const ATTACH_DELAY: Duration = Duration::from_millis(1000);
const DETACH_DELAY: Duration = Duration::from_millis(1000);
const BED: Bed = Bed {
    attach: ATTACH_DELAY,
    detach: DETACH_DELAY,
};

/// StatefulSet `name` of `replicas` pods kept to pool `ns`, each with a
/// pre-bound CSI PV `<ns>-<name>-<i>`; with `spread`, no two of its pods
/// on one Node.
async fn stateful(client: &Client, ns: &str, name: &str, replicas: i32, spread: bool) {
    stateful_with(client, ns, name, replicas, spread, |_| {}).await;
}

/// As [`stateful`], `template` adjusting its pod template.
async fn stateful_with(
    client: &Client,
    ns: &str,
    name: &str,
    replicas: i32,
    spread: bool,
    template: impl FnOnce(&mut k8s_openapi::api::core::v1::PodTemplateSpec),
) {
    stateful_set_with(client, ns, name, replicas, spread, |sts| {
        let spec = &mut sts.spec;
        template(&mut spec.template);
    })
    .await;
}

/// As [`stateful`], `adjust` changing the StatefulSet itself.
async fn stateful_set_with(
    client: &Client,
    ns: &str,
    name: &str,
    replicas: i32,
    spread: bool,
    adjust: impl FnOnce(&mut StatefulSet),
) {
    support::pool::stateful(client, ns, name, replicas, |sts| {
        if let Some(s) = sts.spec.template.spec.as_mut()
            && spread
        {
            s.affinity = Some(spread_out(name));
        }
        adjust(sts);
    })
    .await;
}

/// Keeps a pod template off the Nodes that run a blocker pod (see
/// `support::pool::refusing_spare`).
fn shun_blocker(t: &mut k8s_openapi::api::core::v1::PodTemplateSpec) {
    if let Some(spec) = t.spec.as_mut() {
        support::pool::shuns_blocker(spec);
    }
}

/// No two pods labelled `app: <name>` on one Node.
fn spread_out(name: &str) -> k8s_openapi::api::core::v1::Affinity {
    json(serde_json::json!({"podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {"app": name}},
            "topologyKey": "kubernetes.io/hostname"
        }]
    }}))
}

/// Deletes the Machines `names` one right after the other, then waits
/// until each is gone.
async fn delete_at_once(client: &Client, ns: &str, names: &[&str]) {
    for name in names {
        delete_machine(client, ns, name).await;
    }
    for name in names {
        gone(client, ns, name, Duration::from_secs(120)).await;
    }
}

/// Two more Machines (`c`, `d`) for the replacements, a watch of the
/// case's pods and attachments, then Machines `a` and `b` deleted at once
/// and gone.
async fn replace_a_and_b(client: &Client, ns: &str) -> Watches {
    running_machine(client, ns, "c", ns).await;
    running_machine(client, ns, "d", ns).await;
    let watches = Watches::start(client, ns).await;
    delete_at_once(client, ns, &["a", "b"]).await;
    watches
}

/// Waits until `n` volumes are attached in namespace `ns`'s PVs.
async fn attached(client: &Client, ns: &str, n: usize) {
    wait::until(
        Api::<VolumeAttachment>::all(client.clone()),
        LONG,
        &format!("{n} volumes of {ns} attached"),
        |all| {
            all.iter()
                .filter(|va| {
                    va.spec
                        .source
                        .persistent_volume_name
                        .as_deref()
                        .is_some_and(|pv| pv.starts_with(&format!("{ns}-")))
                        && va.status.as_ref().is_some_and(|s| s.attached)
                })
                .count()
                == n
        },
    )
    .await
    .expect("the volumes attach");
}

/// Two Machines deleted at once, each running one replica of a
/// two-replica StatefulSet without a PodDisruptionBudget: the second
/// replica is evicted only after the first one's volume is attached where
/// its replacement runs (by the audit log and the VolumeAttachments),
/// never both at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_machines_deleted_at_once_move_one_replica_at_a_time() {
    let ns = "ledger-two";
    let (_case, client, node_a, node_b) = db_on_a_and_b(ns).await;
    // Where the replacements go.
    let watches = replace_a_and_b(&client, ns).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    // Which went first is the ledger's order; the other waited for it.
    let ((name, _), (_, second)) = in_order(&all, ("db-0", "db-1"), &log);
    let first_pv = format!("{ns}-{name}");
    let first_node = node_of(&watches, &first_pv, &node_a, &node_b);
    watches
        .assert_after_moved(BED.bed().await, second, &first_pv, &first_node, &log)
        .await;
}

/// A case in `ns` (drain timeout 5 m) whose Machines `a` and `b` run one
/// replica each of StatefulSet db (two, spread out), both volumes
/// attached; with an admin client and the Nodes of `a` and `b`.
async fn db_on_a_and_b(ns: &str) -> (Case, Client, String, String) {
    db_on_a_and_b_with(ns, |_| {}).await
}

/// As [`db_on_a_and_b`], `adjust` changing the StatefulSet.
async fn db_on_a_and_b_with(
    ns: &str,
    adjust: impl FnOnce(&mut StatefulSet),
) -> (Case, Client, String, String) {
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, ns, "b", ns).await;
    stateful_set_with(&client, ns, "db", 2, true, adjust).await;
    attached(&client, ns, 2).await;
    (case, client, node_a, node_b)
}

/// The Node a PV was first seen attached to, of `a` and `b`.
fn node_of(watches: &Watches, pv: &str, a: &str, b: &str) -> String {
    if watches.detached_from(pv, a).is_some() {
        a.to_string()
    } else {
        b.to_string()
    }
}

/// `maxParallelVolumeMigrations: 2` on a Node with two replicas of one
/// StatefulSet and one pod of another: the independent pod moves beside
/// the first replica, and the second replica only after the first one's
/// volume is attached where its replacement runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_moves_overlap_across_workloads_never_within_one() {
    let ns = "ledger-parallel";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m", "maxParallelVolumeMigrations": 2}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    stateful(&client, ns, "db", 2, false).await;
    stateful(&client, ns, "solo", 1, false).await;
    attached(&client, ns, 3).await;
    running_machine(&client, ns, "b", ns).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let solo = [evicted_once(&all, "solo-0", &log)];
    let ((name, first), (_, second)) = in_order(&all, ("db-0", "db-1"), &log);
    let first_pv = format!("{ns}-{name}");
    let moved = watches
        .assert_after_moved(BED.bed().await, second, &first_pv, &node_a, &log)
        .await;
    assert!(
        solo[0].received < moved,
        "the independent pod moves beside the first replica ({} evicted at {}), not behind it: {log}",
        first.received,
        solo[0].received
    );
}

/// A permit outlives the process. Machine `a`'s move of db-0 is held (its
/// replacement has no Node to go to: the pool's other Node runs a pod
/// db's pods shun) while Machine `b` waits to move db-1;
/// `berth run` is killed (SIGKILL) and started again, and only then do
/// Nodes for the replacements come. The new process rebuilds the ledger
/// from `a`'s record before any drain acts: db-1 is evicted once, after
/// db-0's volume is attached where its replacement runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_survives_a_killed_controller() {
    let ns = "ledger-restart";
    let flags = ["--namespace", ns, "--leader-elect=false"];
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .spawn(&flags)
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, ns, "b", ns).await;
    stateful_with(&client, ns, "db", 2, true, shun_blocker).await;
    attached(&client, ns, 2).await;
    support::pool::refusing_spare(&client, ns, "spare", ns).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    delete_machine(&client, ns, "b").await;
    // One replica was evicted and its replacement cannot be placed: its
    // move holds the workload's permit.
    let first = oracle::requests_once(BED.bed().await, ns, |rs| {
        !accepted_evictions_of(rs, "db-*").is_empty()
    })
    .await;
    let evicted: Vec<_> = accepted_evictions_of(&first, "db-*")
        .iter()
        .filter_map(|r| r.name.clone())
        .collect();
    assert_eq!(
        evicted.len(),
        1,
        "one replica moves: {}",
        oracle::log_of(&first)
    );
    case.kill().await;
    case.spawn(&flags).await;
    running_machine(&client, ns, "c", ns).await;
    running_machine(&client, ns, "d", ns).await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;
    gone(&client, ns, "b", Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let (held, other) = if evicted[0] == "db-0" {
        ("db-0", "db-1")
    } else {
        ("db-1", "db-0")
    };
    evicted_once(&all, held, &log);
    let later = evicted_once(&all, other, &log);
    // Its replacement went to C or D, whichever the scheduler chose.
    let pv = format!("{ns}-{held}");
    let from = node_of(&watches, &pv, &node_a, &node_b);
    watches
        .assert_after_moved(BED.bed().await, later, &pv, &from, &log)
        .await;
}

/// A leader hand-over while a permit is held across two Machines. Two
/// leader-elected `berth run` processes (a 3 s Lease); Machines `a` and
/// `b` each run one replica of db, whose replacements are held unready for
/// 20 s. Both are deleted; once the first replica is evicted, the leader
/// is killed (SIGKILL). The standby takes the Lease and reads the permit
/// back from the API server: the second replica is evicted once, and
/// only after the first one's replacement is Ready (by the audit log of
/// both identities and the pod's Ready condition).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_holds_the_permit_the_killed_one_took() {
    use k8s_openapi::api::core::v1::Pod;
    use support::process::Berth;
    let ns = "ledger-leader";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .build()
        .await;
    let client = case.client();
    let flags = |id: &'static str| {
        [
            "--identity",
            id,
            "--lease-namespace",
            ns,
            "--lease-duration=3s",
            "--namespace",
            ns,
        ]
    };
    let standby = BED
        .bed()
        .await
        .identity(&client, "kube-system", "berth-standby")
        .await
        .expect("a second identity");
    // The leader is the audited identity's: the case's controller.
    case.spawn(&flags("replica-a"))
        .await
        .wait_log("caches synced")
        .await;
    let other = Berth::spawn(&standby.kubeconfig, &flags("replica-b"));
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, ns, "b", ns).await;
    stateful_set_with(&client, ns, "db", 2, true, on_delete).await;
    attached(&client, ns, 2).await;
    running_machine(&client, ns, "c", ns).await;
    running_machine(&client, ns, "d", ns).await;
    hold_replacements_unready(&client, ns, "db", "20s").await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    delete_machine(&client, ns, "b").await;
    let first = oracle::requests_once(BED.bed().await, ns, |rs| {
        !accepted_evictions_of(rs, "db-*").is_empty()
    })
    .await;
    let moved: Vec<String> = accepted_evictions_of(&first, "db-*")
        .iter()
        .filter_map(|r| r.name.clone())
        .collect();
    assert_eq!(
        moved.len(),
        1,
        "one replica moves: {}",
        oracle::log_of(&first)
    );
    case.kill().await;
    gone(&client, ns, "a", Duration::from_secs(180)).await;
    gone(&client, ns, "b", Duration::from_secs(180)).await;

    // The standby's requests are not audited: when the next replica went
    // is when the watch saw its pod start terminating (its eviction a
    // moment before).
    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let held = moved[0].as_str();
    let next = if held == "db-0" { "db-1" } else { "db-0" };
    evicted_once(&all, held, &log);
    let old = watches_uid(&watches, next).expect("the next replica's first pod");
    let went = watches
        .first(
            |s| matches!(s, oracle::Seen::PodDeleting { name, uid } if name == next && *uid == old),
        )
        .unwrap_or_else(|| panic!("{next} evicted by the new leader: {log}"));
    let replacement = Api::<Pod>::namespaced(client.clone(), ns)
        .get(held)
        .await
        .expect("the replacement");
    let ready =
        ready_at(&replacement).unwrap_or_else(|| panic!("{held}'s replacement Ready: {log}"));
    assert!(
        went >= ready,
        "{next} went at {went} before {held}'s replacement was Ready at {ready}, across the hand-over: {log}"
    );
    let pv = format!("{ns}-{held}");
    let from = node_of(&watches, &pv, &node_a, &node_b);
    let moved_at = watches
        .attached_elsewhere(BED.bed().await, &pv, &from)
        .await
        .unwrap_or_else(|| panic!("{pv} attached elsewhere than {from}: {log}"));
    assert!(
        went > moved_at,
        "{next} went at {went} before {pv} was attached where its replacement runs ({moved_at}): {log}"
    );
    other.terminate().await;
}

/// An `OrderedReady` StatefulSet (its controller makes a replica only once
/// the ones below it are Ready) with `minReadySeconds: 5` (and no
/// annotation): a replacement is available only once Ready that long, so
/// the next replica is evicted only then (by the audit log and the
/// replacement's Ready condition, whose time has whole seconds, hence a
/// second's tolerance). The annotation `berth.dev/min-healthy-time` asks
/// the same of the pod template, checked with the deadline case below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workloads_min_ready_seconds_holds_the_next_move() {
    let ns = "ledger-healthy";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    running_machine(&client, ns, "a", ns).await;
    stateful_set_with(&client, ns, "db", 2, false, |sts| {
        let spec = &mut sts.spec;
        spec.min_ready_seconds = Some(5);
        spec.pod_management_policy = Some("OrderedReady".into());
    })
    .await;
    attached(&client, ns, 2).await;
    running_machine(&client, ns, "b", ns).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let ((first, _), (_, second)) = in_order(&all, ("db-0", "db-1"), &log);
    // The replacement's Ready condition (the cluster's word, whole seconds,
    // which berth counts from): not when this process's watch saw it, which
    // a loaded machine can make later than the controller's.
    let replacement = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), ns)
        .get(first)
        .await
        .expect("the replacement");
    let ready =
        ready_at(&replacement).unwrap_or_else(|| panic!("{first}'s replacement Ready: {log}"));
    let held = second.received.duration_since(ready);
    assert!(
        held >= k8s_openapi::jiff::SignedDuration::from_secs(4),
        "the next replica went {held} after {first}'s replacement was Ready, not 5 s: {log}"
    );
}

/// The finalizer with which a test keeps a VolumeAttachment from going: a
/// cloud disk whose detach hangs.
const HOLD: &str = "test.berth.dev/hold";

/// Adds (`hold`) or removes the test's finalizer on the VolumeAttachment of
/// `pv` to Node `node`, which is there (attached) when holding.
async fn hold_attachment(client: &Client, pv: &str, node: &str, hold: bool) {
    let api: Api<VolumeAttachment> = Api::all(client.clone());
    for _ in 0..10 {
        let all = api
            .list(&Default::default())
            .await
            .expect("list attachments");
        let found = all.items.into_iter().find(|va| {
            va.spec.node_name == node
                && va.spec.source.persistent_volume_name.as_deref() == Some(pv)
        });
        let Some(mut va) = found else {
            assert!(!hold, "{pv} is attached to {node}");
            return;
        };
        let finalizers = va.metadata.finalizers.get_or_insert_default();
        finalizers.retain(|f| f != HOLD);
        if hold {
            finalizers.push(HOLD.to_string());
        }
        let name = va.metadata.name.clone().expect("a name");
        match api.replace(&name, &Default::default(), &va).await {
            Ok(_) => return,
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => panic!("changing the finalizers of {name}: {e}"),
        }
    }
    panic!("the finalizers of {pv}'s attachment kept changing");
}

/// A detach that times out keeps its workload's permit. db-0's volume
/// cannot leave Node A (the test holds its VolumeAttachment): its detach
/// wait ends after `volumeDetachTimeout` (2 s), and the drain goes on with
/// `solo`, an independent workload, but not with db-1 while db-0's volume
/// is still on A. Once the attachment is let go, db-0's move goes on where
/// it stopped, and db-1 is evicted only after db-0's volume is attached
/// where its replacement runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detach_that_times_out_keeps_its_workload_permit() {
    let ns = "ledger-stuck";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m", "volumeDetachTimeout": "2s"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    stateful(&client, ns, "db", 2, false).await;
    stateful(&client, ns, "solo", 1, false).await;
    attached(&client, ns, 3).await;
    running_machine(&client, ns, "b", ns).await;
    let db0 = format!("{ns}-db-0");
    hold_attachment(&client, &db0, &node_a, true).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    // db-0 goes first (the plan's order); solo only once db-0's detach
    // wait ended without it.
    let solo = format!("{ns}-solo-0");
    wait::for_one(
        Api::<VolumeAttachment>::all(client.clone()),
        LONG,
        "solo-0's volume attached on another Node",
        |va| {
            va.spec.source.persistent_volume_name.as_deref() == Some(solo.as_str())
                && va.spec.node_name != node_a
                && va.status.as_ref().is_some_and(|s| s.attached)
        },
    )
    .await
    .expect("solo moves while db-0's volume is held");
    let now = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&now), watches.log());
    evicted_once(&now, "db-0", &log);
    assert!(
        accepted_evictions_of(&now, "db-1").is_empty(),
        "db-1 is not evicted while db-0's volume is still on A: {log}"
    );
    hold_attachment(&client, &db0, &node_a, false).await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let later = evicted_once(&all, "db-1", &log);
    watches
        .assert_after_moved(BED.bed().await, later, &db0, &node_a, &log)
        .await;
}

/// A detach that stalls to the end (case 5 of issue 36): Machine `a` runs
/// only db-0, whose VolumeAttachment the test holds. Its detach wait ends
/// after `volumeDetachTimeout` (2 s), nothing else is left, and `a`'s
/// drain ends and its VM goes (its Node tainted out of service, the
/// Machine kept until the volume is released); its move keeps db's permit, the replacement running
/// elsewhere (Ready, as the test bed's pods are, before any attach) but
/// its volume still held on `a`'s Node. Machine `b`, deleted then, does
/// not evict db-1 while the volume is held; once it is let go, db-1 goes
/// only after db-0's volume is attached where its replacement runs (the
/// audit log, the VolumeAttachments). Before, the permit went with `a`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detach_stalled_past_its_machine_keeps_the_permit_until_the_volume_moved() {
    let ns = "ledger-stalled";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m", "volumeDetachTimeout": "2s"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    running_machine(&client, ns, "b", ns).await;
    stateful(&client, ns, "db", 2, true).await;
    attached(&client, ns, 2).await;
    running_machine(&client, ns, "c", ns).await;
    running_machine(&client, ns, "d", ns).await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    let first = pods
        .list(&Default::default())
        .await
        .expect("pods")
        .items
        .into_iter()
        .find(|p| support::pool::on_node(p, &node_a))
        .map(|p| p.name_any())
        .expect("a replica of db on a");
    let second = if first == "db-0" { "db-1" } else { "db-0" };
    let pv = format!("{ns}-{first}");
    hold_attachment(&client, &pv, &node_a, true).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    // a's drain ended and its VM is gone: its Node is tainted out of
    // service so that the volume is released (a itself goes once it is).
    wait::for_one(
        Api::<k8s_openapi::api::core::v1::Node>::all(client.clone()),
        LONG,
        "a's Node out of service",
        |n| {
            n.name_any() == node_a
                && n.spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|t| {
                        t.iter()
                            .any(|t| t.key == "node.kubernetes.io/out-of-service")
                    })
        },
    )
    .await
    .expect("a's VM goes with the volume still held");
    delete_machine(&client, ns, "b").await;
    // b's drain has asked for db (what it reports is only the moment to
    // look); the volume is still held on a's Node.
    let machines: Api<berth::api::Machine> = Api::namespaced(client.clone(), ns);
    wait::for_one(machines, LONG, "b waits for db", |m| {
        m.name_any() == "b"
            && support::waiting_for_budget(m).contains("StatefulSet ledger-stalled/db")
    })
    .await
    .expect("b's drain asks for db");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let now = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&now), watches.log());
    assert!(
        accepted_evictions_of(&now, second).is_empty(),
        "{second} is not evicted while {first}'s volume is held on a's Node: {log}"
    );
    hold_attachment(&client, &pv, &node_a, false).await;
    gone(&client, ns, "a", LONG).await;
    gone(&client, ns, "b", Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let later = evicted_once(&all, second, &log);
    watches
        .assert_after_moved(BED.bed().await, later, &pv, &node_a, &log)
        .await;
}

/// `berth.dev/healthy-deadline: 4s` on a StatefulSet whose pods never turn
/// Ready: the next replica waits for the first one's replacement to be
/// healthy, and goes once the deadline passed (not at the reattach timeout,
/// five minutes), with a Warning that names the replacement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_deadline_ends_a_move_whose_replacement_never_turns_ready() {
    use berth::drain::ledger::{HEALTHY_DEADLINE_ANNOTATION, MIN_HEALTHY_ANNOTATION};
    use berth_devkit::testbed::stages::READY_AFTER_ANNOTATION;
    let ns = "ledger-deadline";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    support::pool::stateful(&client, ns, "db", 2, |sts| {
        let spec = &mut sts.spec;
        // Not OrderedReady: its pods are never Ready.
        spec.pod_management_policy = Some("Parallel".into());
        spec.template.metadata.get_or_insert_default().annotations = Some(
            [
                (READY_AFTER_ANNOTATION, "10m"),
                (MIN_HEALTHY_ANNOTATION, "1s"),
                (HEALTHY_DEADLINE_ANNOTATION, "4s"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into(),
        );
    })
    .await;
    attached(&client, ns, 2).await;
    running_machine(&client, ns, "b", ns).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let ((first, _), (_, second)) = in_order(&all, ("db-0", "db-1"), &log);
    let moved = watches
        .attached_elsewhere(BED.bed().await, &format!("{ns}-{first}"), &node_a)
        .await
        .unwrap_or_else(|| panic!("{first}'s volume attached elsewhere: {log}"));
    let held = second.received.duration_since(moved);
    assert!(
        held >= k8s_openapi::jiff::SignedDuration::from_secs(3)
            && held < k8s_openapi::jiff::SignedDuration::from_secs(60),
        "the next replica went {held} after {first}'s volume moved: the 4 s healthy deadline, not the reattach timeout: {log}"
    );
    assert!(
        !watches
            .seen()
            .iter()
            .any(|(_, s)| matches!(s, oracle::Seen::PodReady { .. })),
        "no pod was ever Ready: {log}"
    );
    // What operators are told: the replacement, by name.
    let notes =
        support::notes(&support::events_of(&client, ns, "a", "ReplacementNotHealthy", 1).await);
    assert!(
        notes.iter().any(|n| n.contains(&format!("{ns}/{first}"))),
        "a ReplacementNotHealthy Warning names {first}: {notes:?}"
    );
}

/// A drain past its deadline moves beyond its workload's budget, and says
/// so. Machine `a`'s move of db-0 holds the workload's permit for 30 s
/// after its replacement is Ready (`berth.dev/min-healthy-time`); Machine
/// `b`, whose own deadline is 20 s, waits for it until then, and only then
/// evicts db-1, while db-0's move is still in flight: the VM goes in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_deadline_a_drain_moves_beyond_the_budget() {
    use berth::drain::ledger::MIN_HEALTHY_ANNOTATION;
    let ns = "ledger-bypass";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    let mut b = berth_devkit::testbed::fixtures::machine("b", ns);
    b.spec.drain = Some(json(serde_json::json!({"timeout": "20s"})));
    support::pool::running(&client, ns, b).await;
    stateful_with(&client, ns, "db", 2, true, |t| {
        t.metadata.get_or_insert_default().annotations =
            Some([(MIN_HEALTHY_ANNOTATION.to_string(), "30s".to_string())].into());
    })
    .await;
    attached(&client, ns, 2).await;
    // Where the replacements go.
    running_machine(&client, ns, "c", ns).await;
    running_machine(&client, ns, "d", ns).await;
    let watches = Watches::start(&client, ns).await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    let db0 = pods.get("db-0").await.expect("db-0");
    let on_a = db0.spec.and_then(|s| s.node_name) == Some(node_a.clone());
    let (first, second) = if on_a {
        ("db-0", "db-1")
    } else {
        ("db-1", "db-0")
    };
    let old_uid = pods.get(first).await.expect("the first").metadata.uid;

    delete_machine(&client, ns, "a").await;
    // A second later (a deletion's time has whole seconds): a asks first.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    delete_machine(&client, ns, "b").await;
    let machines: Api<berth::api::Machine> = Api::namespaced(client.clone(), ns);
    let deleted_b = machines
        .get("b")
        .await
        .expect("b")
        .metadata
        .deletion_timestamp
        .expect("being deleted")
        .0;
    gone(&client, ns, "b", Duration::from_secs(120)).await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    evicted_once(&all, first, &log);
    // Past its deadline b deletes its pod (budgets bypassed): when it
    // began to go, by the watch.
    let went = watches
        .first(|s| matches!(s, oracle::Seen::PodDeleting { name, .. } if name == second))
        .unwrap_or_else(|| panic!("{second} went: {log}"));
    let waited = went.duration_since(deleted_b);
    assert!(
        waited >= k8s_openapi::jiff::SignedDuration::from_secs(19),
        "{second} waited for the budget until b's deadline (20 s), not {waited}: {log}"
    );
    // Beyond the budget: the first move had not ended (its replacement
    // Ready for 30 s).
    let ready = watches
        .seen()
        .into_iter()
        .find_map(|(t, s)| match s {
            oracle::Seen::PodReady { name, uid }
                if name == first && Some(&uid) != old_uid.as_ref() =>
            {
                Some(t)
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("{first}'s replacement Ready: {log}"));
    assert!(
        went < ready
            .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(30))
            .expect("a time"),
        "{second} went while {first}'s move was in flight (its replacement Ready at {ready}, healthy 30 s later): {log}"
    );
    // What operators are told: the bypass, naming the workload.
    let notes =
        support::notes(&support::events_of(&client, ns, "b", "MoveBudgetBypassed", 1).await);
    assert!(
        notes
            .iter()
            .any(|n| n.contains(&format!("{ns}/{second}")) && n.contains("StatefulSet")),
        "{notes:?}"
    );
}

/// A move held for a replacement the scheduler cannot place does not pin
/// its Machine (case 3 of issue 36: with `maxSurge: 0` each old Machine
/// waited its whole drain deadline). Machines `a` and `b` each run one
/// replica of db, and the pool's only other Node runs a pod db's pods shun
/// (a pod anti-affinity, which berth's destination check does not read):
/// the first replica goes,
/// its replacement cannot be placed, and with nothing else on its Node its
/// Machine is gone well before its 10-minute deadline, while its move's
/// `MovePermit` stays and the other replica stays too. Once Nodes come,
/// the first replica's volume attaches where its replacement runs, only
/// then does the second go, and no permit is left at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_held_for_placement_lets_its_machine_go_and_keeps_its_permit() {
    use berth::api::MovePermit;
    let ns = "ledger-held";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, ns, "b", ns).await;
    stateful_with(&client, ns, "db", 2, true, shun_blocker).await;
    attached(&client, ns, 2).await;
    support::pool::refusing_spare(&client, ns, "spare", ns).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    delete_machine(&client, ns, "b").await;
    // The Machine whose replica moved first goes, its move held.
    let machines: Api<berth::api::Machine> = Api::namespaced(client.clone(), ns);
    let drained = |m: &berth::api::Machine| m.name_any() == "a" || m.name_any() == "b";
    let left = wait::until(machines.clone(), LONG, "one of a and b gone", |ms| {
        ms.iter().filter(|m| drained(m)).count() == 1
    })
    .await
    .expect("the Machine of the held move goes before its deadline");
    let stays = left
        .iter()
        .find(|m| drained(m))
        .map(|m| m.name_any())
        .expect("the other stays");
    let went = if stays == "a" { "b" } else { "a" };
    let now = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&now), watches.log());
    let moved = accepted_evictions_of(&now, "db-*");
    assert_eq!(
        moved.len(),
        1,
        "one replica moves while its replacement cannot be placed: {log}"
    );
    let first = moved[0].name.clone().unwrap_or_default();
    let permits: Api<MovePermit> = Api::namespaced(client.clone(), ns);
    let permit = permits
        .get_opt("statefulset.db.0")
        .await
        .expect("read the permit");
    assert!(
        permit
            .as_ref()
            .is_some_and(|p| p.spec.pod == first && p.spec.machine == format!("{ns}/{went}")),
        "the held move keeps its permit after its Machine {went} is gone: {permit:?}"
    );
    running_machine(&client, ns, "c", ns).await;
    running_machine(&client, ns, "d", ns).await;
    gone(&client, ns, &stays, Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let ((earlier, _), (_, later)) = in_order(&all, ("db-0", "db-1"), &log);
    assert_eq!(earlier, first, "{log}");
    let first_pv = format!("{ns}-{first}");
    let first_node = node_of(&watches, &first_pv, &node_a, &node_b);
    watches
        .assert_after_moved(BED.bed().await, later, &first_pv, &first_node, &log)
        .await;
    wait::for_none(permits, LONG, "no permit left", |_| true)
        .await
        .expect("every move ended and freed its permit");
}

/// `berth.dev/max-moving: 2` on a StatefulSet (the object, not its pod
/// template) lets two of its replicas move at once, and no third: three
/// Machines deleted at once, one replica each; the second replica is
/// evicted before the first one's volume has moved, the third only after
/// one of the first two has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_of_two_lets_two_replicas_move_at_once() {
    use berth::drain::ledger::MAX_MOVING_ANNOTATION;
    two_of_three_move_at_once("ledger-pair", |sts| {
        sts.metadata.annotations =
            Some([(MAX_MOVING_ANNOTATION.to_string(), "2".to_string())].into());
    })
    .await;
}

/// A StatefulSet without berth's annotation whose owner lets its rolling
/// update take `maxUnavailable: 67%` of its 3 replicas down at once (2, as
/// the StatefulSet controller rounds it: down) has a default move budget
/// of 2: two of its replicas, on Machines deleted at once, move at the
/// same time, the third only after one of them moved (the audit log, the
/// VolumeAttachments).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stateful_sets_max_unavailable_is_its_default_move_budget() {
    let case = two_of_three_move_at_once("ledger-rolling", |sts| {
        sts.spec.update_strategy = Some(json(serde_json::json!({
            "type": "RollingUpdate",
            "rollingUpdate": {"maxUnavailable": "67%"}
        })));
    })
    .await;
    let sts = Api::<StatefulSet>::namespaced(case.client(), "ledger-rolling")
        .get("db")
        .await
        .expect("the StatefulSet");
    let kept = sts
        .spec
        .update_strategy
        .and_then(|u| u.rolling_update)
        .and_then(|r| r.max_unavailable);
    assert!(
        kept.is_some(),
        "the API server kept maxUnavailable (MaxUnavailableStatefulSet on by default in 1.37)"
    );
}

/// Three Machines, each running one replica of StatefulSet `db` (changed
/// by `adjust`, which gives it a move budget of 2), deleted at once, with
/// three more for the replacements: the second replica is evicted before
/// the first one's volume moved, the third only after one of the first
/// two had. Returns the case, for what its caller reads back.
async fn two_of_three_move_at_once(ns: &str, adjust: impl FnOnce(&mut StatefulSet)) -> Case {
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let olds = [
        running_machine(&client, ns, "a", ns).await,
        running_machine(&client, ns, "b", ns).await,
        running_machine(&client, ns, "c", ns).await,
    ];
    stateful_set_with(&client, ns, "db", 3, true, adjust).await;
    attached(&client, ns, 3).await;
    for new in ["d", "e", "f"] {
        running_machine(&client, ns, new, ns).await;
    }
    let watches = Watches::start(&client, ns).await;

    delete_at_once(&client, ns, &["a", "b", "c"]).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let mut went: Vec<&berth_devkit::bench::audit::Request> = ["db-0", "db-1", "db-2"]
        .iter()
        .map(|p| evicted_once(&all, p, &log))
        .collect();
    went.sort_by_key(|r| r.received);
    // Where each replica's volume attached after it left its old Node.
    let mut moved = Vec::new();
    for r in &went {
        let pv = format!("{ns}-{}", r.name.as_deref().unwrap_or_default());
        let from = olds
            .iter()
            .find(|n| watches.detached_from(&pv, n).is_some())
            .unwrap_or_else(|| panic!("{pv} left an old Node: {log}"));
        moved.push(
            watches
                .attached_elsewhere(BED.bed().await, &pv, from)
                .await
                .unwrap_or_else(|| panic!("{pv} attached elsewhere: {log}")),
        );
    }
    assert!(
        went[1].received < moved[0],
        "two replicas move at once: the second went ({}) before the first one's volume moved ({}): {log}",
        went[1].received,
        moved[0]
    );
    let first_done = moved[0].min(moved[1]);
    assert!(
        went[2].received > first_done,
        "no third: it went ({}) only after one of the first two had moved ({first_done}): {log}",
        went[2].received
    );
    // Six Machines and three drains within seconds: a rollout's burst.
    case
}

/// A Deployment without volumes whose object asks `berth.dev/max-moving:
/// 1` and `berth.dev/min-healthy-time: 3s`, one replica on each of two
/// Machines deleted at once: its pods go through the ledger like stateful
/// ones, so the second is evicted only once a new pod of the Deployment
/// has been Ready for 3 s elsewhere (by the audit log and a watch of the
/// pods), never both at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_that_asks_for_a_budget_moves_one_pod_at_a_time() {
    use berth::drain::ledger::{MAX_MOVING_ANNOTATION, MIN_HEALTHY_ANNOTATION};
    let ns = "ledger-web";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    running_machine(&client, ns, "a", ns).await;
    running_machine(&client, ns, "b", ns).await;
    let mut web: Deployment = json(serde_json::json!({
        "metadata": {"name": "web", "annotations": {
            (MAX_MOVING_ANNOTATION): "1", (MIN_HEALTHY_ANNOTATION): "3s"}},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "web", "image": "nginx"}]}}}
    }));
    if let Some(s) = web.spec.template.spec.as_mut() {
        s.affinity = Some(spread_out("web"));
        s.node_selector = Some([(support::pool::POOL.to_string(), ns.to_string())].into());
    }
    support::pool::create(Api::namespaced(client.clone(), ns), web).await;
    wait::until(
        Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), ns),
        LONG,
        "both web pods Running",
        |pods| {
            pods.iter()
                .filter(|p| support::pool::pod_running(p))
                .count()
                == 2
        },
    )
    .await
    .expect("the Deployment runs");
    let watches = replace_a_and_b(&client, ns).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let mut went: Vec<_> = all
        .iter()
        .filter(|r| r.code < 300 && r.name.as_deref().is_some_and(|n| n.starts_with("web-")))
        .collect();
    went.sort_by_key(|r| r.received);
    assert_eq!(went.len(), 2, "each web pod evicted once: {log}");
    let first = went[0].name.clone().unwrap_or_default();
    // The first Ready web pod that is neither of the two evicted, after the
    // first eviction: its replacement.
    let evicted: Vec<String> = went.iter().filter_map(|r| r.name.clone()).collect();
    let replacement = watches
        .seen()
        .into_iter()
        .find_map(|(t, s)| match s {
            oracle::Seen::PodReady { name, .. }
                if name.starts_with("web-") && !evicted.contains(&name) && t > went[0].received =>
            {
                Some(name)
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("a replacement of {first} Ready: {log}"));
    // When it turned Ready by its Ready condition (whole seconds, what
    // berth counts from), not when this process's watch saw it.
    let pod = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), ns)
        .get(&replacement)
        .await
        .expect("the replacement");
    let ready = ready_at(&pod).unwrap_or_else(|| panic!("{replacement} Ready: {log}"));
    let held = went[1].received.duration_since(ready);
    assert!(
        held >= k8s_openapi::jiff::SignedDuration::from_secs(2),
        "the second web pod went {held} after {first}'s replacement was Ready, not 3 s: {log}"
    );
}

/// A workload already degraded before the drain: a StatefulSet of three
/// spread over Machines `a`, `b` and `c`, whose `db-2` is recreated held
/// unready for 25 s (the test bed's readiness hold, `OnDelete` so that
/// nothing else rolls). Machine `a` is deleted meanwhile: `db-0` is not
/// evicted while `db-2` is down (its owner counts one of three
/// unavailable, the whole budget of one), and is once `db-2` is Ready (by
/// the audit log and the pod's Ready condition); the drain says what it
/// waits for, naming the replica that is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_already_degraded_moves_nothing_until_it_is_whole() {
    use k8s_openapi::api::core::v1::Pod;
    let ns = "ledger-degraded";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    for m in ["a", "b", "c"] {
        running_machine(&client, ns, m, ns).await;
    }
    stateful_set_with(&client, ns, "db", 3, true, on_delete).await;
    attached(&client, ns, 3).await;
    // The Node db-0's replacement goes to.
    running_machine(&client, ns, "d", ns).await;

    // db-2 crashes: recreated from a template that holds it unready.
    hold_replacements_unready(&client, ns, "db", "25s").await;
    let sts: Api<StatefulSet> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let old = pods.get("db-2").await.expect("db-2").metadata.uid;
    pods.delete("db-2", &Default::default())
        .await
        .expect("delete db-2");
    wait::for_one(sts.clone(), LONG, "db counts one unavailable", |s| {
        s.status
            .as_ref()
            .is_some_and(|s| s.available_replicas == Some(2))
    })
    .await
    .expect("the StatefulSet counts db-2 down");
    wait::until(pods.clone(), LONG, "the new db-2 Running", |ps| {
        ps.iter().any(|p| {
            p.name_any() == "db-2" && p.metadata.uid != old && support::pool::pod_running(p)
        })
    })
    .await
    .expect("db-2 comes back, not Ready");

    let watches = Watches::start(&client, ns).await;
    delete_machine(&client, ns, "a").await;
    // What operators are told while it waits: the workload, how many of
    // how many are down, and which.
    let machines: Api<berth::api::Machine> = Api::namespaced(client.clone(), ns);
    let told = wait::for_one(machines, LONG, "a waits for db to be whole", |m| {
        support::waiting_for_budget(m).contains("db-2 not Ready")
    })
    .await
    .expect("the drain names what it waits for");
    let why = support::waiting_for_budget(&told).to_string();
    assert!(
        why.contains(&format!(
            "pod {ns}/db-0 waits: StatefulSet {ns}/db has 1 of 3 replicas unavailable"
        )),
        "{why}"
    );
    gone(&client, ns, "a", Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let evicted = evicted_once(&all, "db-0", &log);
    assert!(
        accepted_evictions_of(&all, "db-1").is_empty()
            && accepted_evictions_of(&all, "db-2").is_empty(),
        "only a's replica moved: {log}"
    );
    // The cluster's word for when db-2 turned Ready (whole seconds).
    let db2 = pods.get("db-2").await.expect("db-2");
    let ready = ready_at(&db2).unwrap_or_else(|| panic!("db-2 Ready: {log}"));
    assert_eq!(db2.metadata.uid, watches_uid(&watches, "db-2"), "{log}");
    assert!(
        evicted.received >= ready,
        "db-0 was evicted at {} while db-2 was down (Ready at {ready}): {log}",
        evicted.received
    );
}

/// The UID of the pod `name` the watches saw Ready.
fn watches_uid(watches: &Watches, name: &str) -> Option<String> {
    watches.seen().into_iter().find_map(|(_, s)| match s {
        oracle::Seen::PodReady { name: n, uid } if n == name => Some(uid),
        _ => None,
    })
}

/// Two `berth run` processes of different scopes (`--namespace a`,
/// `--namespace b`, as two releases or one per tenant), and a StatefulSet
/// whose two replicas run on a Machine of each scope: both Machines
/// deleted at once, one replica moves at a time (by the audit log and the
/// VolumeAttachments: the second is evicted only once the first one's
/// volume is attached where its replacement runs). The permit is in the
/// API server, where both processes take it: a watch of the MovePermits
/// sees at most one at a time, named by its workload's slot, naming the
/// pod and its Machine; none is left at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_different_scopes_share_a_workloads_permit() {
    use berth::api::MovePermit;
    use futures::StreamExt;
    use kube::runtime::watcher;
    use support::process::Berth;
    let (ns, other) = ("ledger-scope-a", "ledger-scope-b");
    // The pool is ns's class; Machines of both namespaces are of it.
    // The case is ns's, and its controller the first process; the
    // second, of scope `other` (a namespace with no case's controller), is
    // the test's own.
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .spawn(&["--namespace", ns, "--leader-elect=false"])
        .await;
    let client = case.client();
    let _other = Case::builder(other).on(BED).build().await;
    let kubeconfig = &case.kubeconfig().await;
    let second = Berth::spawn(kubeconfig, &["--namespace", other, "--leader-elect=false"]);
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, other, "b", ns).await;
    stateful(&client, ns, "db", 2, true).await;
    attached(&client, ns, 2).await;
    // Where the replacements go, one Machine in each scope.
    running_machine(&client, ns, "c", ns).await;
    running_machine(&client, other, "d", ns).await;
    let watches = Watches::start(&client, ns).await;
    // Every permit seen, and how many at once.
    let seen: std::sync::Arc<std::sync::Mutex<(Vec<MovePermit>, usize)>> = Default::default();
    let permits = {
        let seen = std::sync::Arc::clone(&seen);
        let api: Api<MovePermit> = Api::namespaced(client.clone(), ns);
        tokio::spawn(async move {
            let mut live = std::collections::BTreeSet::new();
            let mut stream = watcher::watcher(api, watcher::Config::default()).boxed();
            while let Some(ev) = stream.next().await {
                let mut s = seen.lock().expect("lock");
                match ev {
                    Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                        live.insert(p.name_any());
                        s.1 = s.1.max(live.len());
                        s.0.push(p);
                    }
                    Ok(watcher::Event::Delete(p)) => {
                        live.remove(&p.name_any());
                    }
                    _ => {}
                }
            }
        })
    };

    delete_machine(&client, ns, "a").await;
    delete_machine(&client, other, "b").await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;
    gone(&client, other, "b", Duration::from_secs(120)).await;
    permits.abort();

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let ((name, _), (_, later)) = in_order(&all, ("db-0", "db-1"), &log);
    let pv = format!("{ns}-{name}");
    let from = node_of(&watches, &pv, &node_a, &node_b);
    watches
        .assert_after_moved(BED.bed().await, later, &pv, &from, &log)
        .await;
    let (permits_seen, most) = seen.lock().expect("lock").clone();
    let named: Vec<(String, String, String)> = permits_seen
        .iter()
        .map(|p| (p.name_any(), p.spec.pod.clone(), p.spec.machine.clone()))
        .collect();
    assert_eq!(most, 1, "one permit of db at a time: {named:?}\n{log}");
    let machine_of = |pod: &str| {
        if node_of(&watches, &format!("{ns}-{pod}"), &node_a, &node_b) == node_a {
            format!("{ns}/a")
        } else {
            format!("{other}/b")
        }
    };
    for pod in ["db-0", "db-1"] {
        let want = (
            "statefulset.db.0".to_string(),
            pod.to_string(),
            machine_of(pod),
        );
        assert!(named.contains(&want), "{want:?} among {named:?}");
    }
    assert!(
        permits_seen
            .iter()
            .all(|p| p.spec.workload == "StatefulSet/db"
                && p.metadata
                    .owner_references
                    .as_ref()
                    .is_some_and(|o| o[0].name == "db")),
        "each permit names and is owned by its workload: {permits_seen:?}"
    );
    let left = wait::until(
        Api::<MovePermit>::namespaced(client.clone(), ns),
        Duration::from_secs(30),
        "no permit left",
        |ps| ps.is_empty(),
    )
    .await;
    assert!(left.is_ok(), "no permit is left once both moves ended");
    second.terminate().await;
}

/// The line across processes (issue 36): two `berth run` processes of
/// different scopes share StatefulSet `db` (three replicas, on Machines
/// `a` and `e` of scope A and `b` of scope B). `a` is deleted first and A
/// takes db's one permit; its replacement is held unready for 20 s. Then
/// `b` is deleted, and B's ask parks first in line; then `e`, whose ask
/// parks in A behind it. When A's move ends, A frees the permit and would
/// take it again at once for `e` (a move ends 10 s after its replacement
/// is Ready, when nothing else wakes B): B's replica must go first (the
/// audit log's evictions), as the line orders asks across every process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freed_permit_goes_to_the_first_in_line_of_any_process() {
    use berth::api::MovePermit;
    use k8s_openapi::api::core::v1::Pod;
    use support::process::Berth;
    let (ns, other) = ("ledger-across-a", "ledger-across-b");
    // The case is ns's, and its controller the first process; the
    // second, of scope `other` (a namespace with no case's controller), is
    // the test's own.
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .spawn(&["--namespace", ns, "--leader-elect=false"])
        .await;
    let client = case.client();
    let _other = Case::builder(other).on(BED).build().await;
    let kubeconfig = &case.kubeconfig().await;
    let second = Berth::spawn(kubeconfig, &["--namespace", other, "--leader-elect=false"]);
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, other, "b", ns).await;
    let node_e = running_machine(&client, ns, "e", ns).await;
    // A move ends 10 s after its replacement turned Ready: nothing else
    // wakes A's waiting drain then, and it asks again at once.
    stateful_set_with(&client, ns, "db", 3, true, |sts| {
        on_delete(sts);
        sts.metadata.annotations =
            Some([("berth.dev/min-healthy-time".to_string(), "10s".to_string())].into());
    })
    .await;
    attached(&client, ns, 3).await;
    hold_replacements_unready(&client, ns, "db", "20s").await;
    // Where the replacements go.
    running_machine(&client, ns, "c", ns).await;
    running_machine(&client, other, "d", ns).await;
    running_machine(&client, ns, "f", ns).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let listed = pods.list(&Default::default()).await.expect("pods").items;
    let on = |node: &str| {
        listed
            .iter()
            .find(|p| support::pool::on_node(p, node) && p.name_any().starts_with("db-"))
            .map(|p| p.name_any())
            .expect("a replica of db on each Machine")
    };
    let (on_a, on_b, on_e) = (on(&node_a), on(&node_b), on(&node_e));
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    let held = wait::until(
        Api::<MovePermit>::namespaced(client.clone(), ns),
        Duration::from_secs(60),
        "A holds db's permit",
        |ps| !ps.is_empty(),
    )
    .await;
    assert!(held.is_ok(), "A takes db's permit for {on_a}");
    delete_machine(&client, other, "b").await;
    // B's pass ends and its ask parks; e is deleted after b.
    tokio::time::sleep(Duration::from_secs(3)).await;
    delete_machine(&client, ns, "e").await;
    for (n, m) in [(ns, "a"), (other, "b"), (ns, "e")] {
        gone(&client, n, m, Duration::from_secs(180)).await;
    }
    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let from_a = evicted_once(&all, &on_a, &log);
    let from_b = evicted_once(&all, &on_b, &log);
    let from_e = evicted_once(&all, &on_e, &log);
    assert!(
        from_a.received < from_b.received,
        "{on_a} went first, under A's permit: {log}"
    );
    assert!(
        from_b.received < from_e.received,
        "the freed permit went to B's replica {on_b} (first in line), not to A's {on_e}: {log}"
    );
    // The line's cost: each parked ask written once and taken out once,
    // renewed every 15 s while it waits (how long the asks wait is the
    // replacements' and a loaded machine's: the renewals are counted
    // against the time the line was in use, not a fixed number); none
    // left.
    let asked: Vec<_> = support::audit::requests(BED.bed().await, ns)
        .into_iter()
        .filter(|r| r.resource == "moveasks" && r.is_write())
        .collect();
    let writes: Vec<String> = asked
        .iter()
        .map(|r| format!("{} {} {:?} -> {}", r.received, r.verb, r.name, r.code))
        .collect();
    let count = |verb: &str| asked.iter().filter(|r| r.verb == verb).count();
    let in_use = match (asked.first(), asked.last()) {
        (Some(a), Some(b)) => b.received.duration_since(a.received).as_secs_f64(),
        _ => 0.0,
    };
    // berth renews a parked ask every 15 s (`ledger::line::RENEW`).
    let renewals = count("create") as f64 * (1.0 + in_use / 15.0);
    assert!(
        (1..=4).contains(&count("create"))
            && count("delete") == count("create")
            && count("patch") as f64 <= renewals,
        "MoveAsk writes in {in_use:.0} s: {writes:#?}\n{log}"
    );
    let left = wait::until(
        Api::<berth::api::MoveAsk>::namespaced(client.clone(), ns),
        Duration::from_secs(30),
        "no ask left in line",
        |asks| asks.is_empty(),
    )
    .await;
    assert!(
        left.is_ok(),
        "no ask is left once every drain ended: {writes:#?}"
    );
    eprintln!("MoveAsk writes: {writes:#?}");
    second.terminate().await;
}

/// The line outlives no process (issue 36): B's ask parks first in line,
/// then B is killed. Its ask is renewed no more, and A's replica waits
/// behind it only until it expires (45 s after its last renewal), not for
/// ever: A evicts it then (the audit log). B started again, its leader
/// takes its dead ask out of line, its drain asks anew and ends; no ask is
/// left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ask_of_a_process_that_died_holds_the_line_until_it_expires() {
    use berth::api::{MoveAsk, MovePermit};
    use k8s_openapi::api::core::v1::Pod;
    use support::process::Berth;
    let (ns, other) = ("ledger-dead-a", "ledger-dead-b");
    // The case is ns's, and its controller the first process; the
    // second, of scope `other` (a namespace with no case's controller), is
    // the test's own.
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .spawn(&["--namespace", ns, "--leader-elect=false"])
        .await;
    let client = case.client();
    let _other = Case::builder(other).on(BED).build().await;
    let kubeconfig = &case.kubeconfig().await;
    let second = Berth::spawn(kubeconfig, &["--namespace", other, "--leader-elect=false"]);
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, other, "b", ns).await;
    let node_e = running_machine(&client, ns, "e", ns).await;
    stateful_set_with(&client, ns, "db", 3, true, on_delete).await;
    attached(&client, ns, 3).await;
    hold_replacements_unready(&client, ns, "db", "20s").await;
    running_machine(&client, ns, "c", ns).await;
    running_machine(&client, other, "d", ns).await;
    running_machine(&client, ns, "f", ns).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let listed = pods.list(&Default::default()).await.expect("pods").items;
    let on = |node: &str| {
        listed
            .iter()
            .find(|p| support::pool::on_node(p, node) && p.name_any().starts_with("db-"))
            .map(|p| p.name_any())
            .expect("a replica of db on each Machine")
    };
    let (on_a, on_b, on_e) = (on(&node_a), on(&node_b), on(&node_e));
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    let held = wait::until(
        Api::<MovePermit>::namespaced(client.clone(), ns),
        Duration::from_secs(60),
        "A holds db's permit",
        |ps| !ps.is_empty(),
    )
    .await;
    assert!(held.is_ok(), "A takes db's permit for {on_a}");
    delete_machine(&client, other, "b").await;
    let asks: Api<MoveAsk> = Api::namespaced(client.clone(), ns);
    let machine_b = format!("{other}/b");
    let parked = wait::until(
        asks.clone(),
        Duration::from_secs(30),
        "B's ask parks",
        |l| l.iter().any(|a| a.spec.machine == machine_b),
    )
    .await;
    assert!(parked.is_ok(), "B's ask for {on_b} parks in line");
    second.kill().await;
    // A deletion's time is in whole seconds: e's comes after b's (in the
    // same second, the Machines' names would order them).
    tokio::time::sleep(Duration::from_secs(2)).await;
    delete_machine(&client, ns, "e").await;
    gone(&client, ns, "e", Duration::from_secs(180)).await;
    let dead = asks
        .list(&Default::default())
        .await
        .expect("asks")
        .items
        .into_iter()
        .find(|a| a.spec.machine == machine_b)
        .expect("B's ask is still there: nobody of its scope leads");
    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let from_e = evicted_once(&all, &on_e, &log);
    let expired = dead.spec.expires.0;
    let after = from_e.received.duration_since(expired).as_secs_f64();
    assert!(
        (-1.0..15.0).contains(&after),
        "{on_e} went once B's ask expired at {expired} ({after:.1} s after), not before, and without waiting for a poll: {log}"
    );
    eprintln!("{on_e} evicted {after:.1} s after B's dead ask expired");
    assert!(
        accepted_evictions_of(&all, &on_b).is_empty(),
        "B is dead: {log}"
    );
    // B again: its leader takes its dead ask out of line, and its drain
    // asks anew.
    let again = Berth::spawn(kubeconfig, &["--namespace", other, "--leader-elect=false"]);
    gone(&client, other, "b", Duration::from_secs(180)).await;
    let left = wait::until(asks, Duration::from_secs(30), "no ask left in line", |l| {
        l.is_empty()
    })
    .await;
    assert!(left.is_ok(), "no ask is left once every drain ended");
    again.terminate().await;
}

/// A replica that takes longer to turn Ready than any of the drain's
/// bounds (a database replaying its log): the replacement of the first
/// replica is held unready for 150 s (the test bed's readiness hold, on
/// the template once the originals run, `OnDelete`), past the default
/// reattach timeout (90 s) that ends the drain's own wait for it. The next
/// replica is evicted only once that replacement is Ready (the audit log,
/// the pod's Ready condition): its StatefulSet counts it unavailable until
/// then, and that holds the workload's budget of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_slower_than_every_timeout_still_holds_the_next_replica() {
    let ns = "ledger-slow-replica";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start()
        .await;
    let client = case.client();
    running_machine(&client, ns, "a", ns).await;
    stateful_set_with(&client, ns, "db", 2, false, on_delete).await;
    attached(&client, ns, 2).await;
    running_machine(&client, ns, "b", ns).await;
    hold_replacements_unready(&client, ns, "db", "150s").await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    // Both replicas evicted (the second once the first is whole again),
    // read from the audit log for at most four minutes.
    let until = std::time::Instant::now() + Duration::from_secs(240);
    while accepted_evictions_of(&evictions(BED.bed().await, ns), "db-*").len() < 2
        && std::time::Instant::now() < until
    {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let (evicted, second, log) = next_after_replacement_ready(&client, ns, &watches).await;
    let held = second.received.duration_since(evicted.received);
    assert!(
        held >= k8s_openapi::jiff::SignedDuration::from_secs(140),
        "held {held}, not the 150 s the replacement took: {log}"
    );
}

/// Case 4: a move with nothing to reattach (an attach-free CSI volume,
/// which never detaches from the old Node nor attaches to the new one)
/// holds its workload's permit until its replacement is Ready, as a move
/// whose volume reattaches does. Both replicas of `db` run on Machine `a`;
/// its drain moves them to `b` one at a time, and the second is evicted
/// only once the first one's replacement (held unready for 30 s) is Ready,
/// by the audit log and the pods. Before, such a move ended when its pod
/// was gone, and the second replica went within a second or two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_free_move_holds_the_next_replica_until_its_replacement_is_ready() {
    use berth_devkit::testbed::fixtures::stateful_set;
    use k8s_openapi::api::core::v1::Pod;
    use support::pool::{ATTACH_FREE_DRIVER as DRIVER, attach_free_driver, csi_pv_on};
    let ns = "ledger-attach-free";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .build()
        .await;
    let client = case.client();
    attach_free_driver(&client, DRIVER).await;
    case.start().await;
    running_machine(&client, ns, "a", ns).await;
    for i in 0..2 {
        let pv = csi_pv_on(
            DRIVER,
            &format!("{ns}-db-{i}"),
            &format!("share-{ns}-{i}"),
            ns,
            &format!("data-db-{i}"),
        );
        support::pool::create(Api::all(client.clone()), pv).await;
    }
    let mut sts = stateful_set("db", 2, 1);
    on_delete(&mut sts);
    if let Some(spec) = sts.spec.template.spec.as_mut() {
        spec.node_selector = Some([(support::pool::POOL.to_string(), ns.to_string())].into());
    }
    support::pool::create(Api::<StatefulSet>::namespaced(client.clone(), ns), sts).await;
    wait::until(
        Api::<Pod>::namespaced(client.clone(), ns),
        LONG,
        "db's two pods Ready",
        |pods| pods.iter().filter(|p| ready_at(p).is_some()).count() == 2,
    )
    .await
    .expect("db runs");
    running_machine(&client, ns, "b", ns).await;
    hold_replacements_unready(&client, ns, "db", "30s").await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(180)).await;
    next_after_replacement_ready(&client, ns, &watches).await;
    let vas = Api::<VolumeAttachment>::all(client.clone())
        .list(&Default::default())
        .await
        .expect("list");
    assert!(
        !vas.items.iter().any(|va| va.spec.attacher == DRIVER),
        "an attach-free volume is never attached"
    );
}

/// Case 4 with a node-local volume: each replica of `db` keeps its data on
/// its Node (a generic ephemeral claim bound to a local PV there, as with
/// local NVMe), so its replacement needs new storage; the test plays the
/// local volume provisioner and offers a local PV on Machine `c`'s Node
/// for each replica once it is gone. Machines `a` and `b` each run one
/// replica and are deleted at once: the first replica is evicted without
/// a reattach wait (its data is lost with the VM, as `nodeLocalVolumes:
/// Evict` says), and the second only once the first one's replacement
/// (held unready for 20 s) is Ready, by the audit log and the pods.
/// Before the ledger counted availability, such a move ended when its pod
/// was gone, and the next replica went at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_local_move_holds_the_next_replica_until_its_replacement_is_ready() {
    use berth_devkit::testbed::fixtures::stateful_set;
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::{PersistentVolume, Pod};
    use kube::runtime::watcher::{self, Event};
    let ns = "ledger-node-local";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start()
        .await;
    let client = case.client();
    let local_pv = move |name: &str, claim: &str, node: &str| -> PersistentVolume {
        json(serde_json::json!({
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "claimRef": {"namespace": ns, "name": claim},
                "local": {"path": "/mnt/nvme0"},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
                ]}]}}
            }
        }))
    };
    let nodes = [
        running_machine(&client, ns, "a", ns).await,
        running_machine(&client, ns, "b", ns).await,
    ];
    for (i, node) in nodes.iter().enumerate() {
        let pv = local_pv(&format!("{ns}-db-{i}"), &format!("db-{i}-data"), node);
        support::pool::create(Api::all(client.clone()), pv).await;
    }
    let mut sts = stateful_set("db", 2, 1);
    on_delete(&mut sts);
    {
        let spec = &mut sts.spec;
        spec.volume_claim_templates = None;
        if let Some(pod) = spec.template.spec.as_mut() {
            pod.node_selector = Some([(support::pool::POOL.to_string(), ns.to_string())].into());
            pod.volumes = Some(vec![json(serde_json::json!({
                "name": "data",
                "ephemeral": {"volumeClaimTemplate": {"spec": {
                    "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                    "resources": {"requests": {"storage": "1Gi"}}
                }}}
            }))]);
        }
    }
    support::pool::create(Api::<StatefulSet>::namespaced(client.clone(), ns), sts).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let first = wait::until(pods.clone(), LONG, "db's two pods Ready", |pods| {
        pods.iter().filter(|p| ready_at(p).is_some()).count() == 2
    })
    .await
    .expect("db runs");
    let originals: std::collections::BTreeSet<String> =
        first.iter().filter_map(|p| p.uid()).collect();
    let to = running_machine(&client, ns, "c", ns).await;
    hold_replacements_unready(&client, ns, "db", "20s").await;
    // The provisioner: a replica gone, new local storage on `c`'s Node
    // for the claim its replacement will have.
    let provisioner = {
        let client = client.clone();
        tokio::spawn(async move {
            let mut events = watcher::watcher(pods, watcher::Config::default()).boxed();
            while let Some(Ok(event)) = events.next().await {
                if let Event::Delete(gone) = event
                    && gone.uid().is_some_and(|u| originals.contains(&u))
                {
                    let claim = format!("{}-data", gone.name_any());
                    let pv = local_pv(&format!("{ns}-{}-c", gone.name_any()), &claim, &to);
                    support::pool::create(Api::all(client.clone()), pv).await;
                }
            }
        })
    };
    let watches = Watches::start(&client, ns).await;

    delete_at_once(&client, ns, &["a", "b"]).await;
    let (evicted, second, log) = next_after_replacement_ready(&client, ns, &watches).await;
    let held = second.received.duration_since(evicted.received);
    assert!(
        held >= k8s_openapi::jiff::SignedDuration::from_secs(15),
        "held {held}, not the 20 s the replacement took: {log}"
    );
    provisioner.abort();
}

/// A workload of a kind berth reads no availability of: a database run
/// by an operator whose pods its own object controls (as CloudNativePG's
/// are; a ConfigMap stands for that object here, and the test plays the
/// operator: a pod gone is made again, with its claim, on Machine `c`'s
/// Node, held unready for 40 s). Machines `a` and `b` each run one of its
/// two replicas and are deleted at once. The drain's own wait for the
/// first replacement ends at the reattach timeout (10 s), with the
/// replacement still not Ready: the move keeps its permit, and the second
/// replica is evicted only once a new pod of the operator's object is
/// Ready (the audit log, the pods). Before, the permit went with the
/// drain's wait and the second replica went 10 s after the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_of_a_kind_berth_does_not_read_holds_until_its_replacement_is_ready() {
    use berth_devkit::testbed::stages::READY_AFTER_ANNOTATION;
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod};
    use kube::runtime::watcher::{self, Event};
    let ns = "ledger-operator";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m", "volumeReattachTimeout": "10s"}))
        .start()
        .await;
    let client = case.client();
    let nodes = [
        running_machine(&client, ns, "a", ns).await,
        running_machine(&client, ns, "b", ns).await,
    ];
    let owner = Api::<ConfigMap>::namespaced(client.clone(), ns)
        .create(
            &Default::default(),
            &json(serde_json::json!({"metadata": {"name": "pg"}})),
        )
        .await
        .expect("the operator's object");
    let owner = owner.uid().expect("a UID");
    let pod = move |i: usize, node: &str, hold: Option<&str>| -> Pod {
        json(serde_json::json!({
            "metadata": {"name": format!("pg-{i}"), "labels": {"app": "pg"},
                "annotations": hold.map(|h| serde_json::json!({(READY_AFTER_ANNOTATION): h})),
                "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "pg",
                    "uid": owner, "controller": true}]},
            "spec": {
                "nodeName": node,
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": "registry.invalid/pg:1",
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": format!("data-pg-{i}")}}]
            }
        }))
    };
    for (i, node) in nodes.iter().enumerate() {
        let pv = format!("{ns}-pg-{i}");
        support::pool::create(
            Api::all(client.clone()),
            berth_devkit::testbed::fixtures::csi_pv(
                &pv,
                &format!("vol-{pv}"),
                ns,
                &format!("data-pg-{i}"),
            ),
        )
        .await;
        support::pool::create(
            Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns),
            json(serde_json::json!({
                "metadata": {"name": format!("data-pg-{i}")},
                "spec": {
                    "accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": pv,
                    "resources": {"requests": {"storage": "1Gi"}}
                }
            })),
        )
        .await;
        support::pool::create(Api::namespaced(client.clone(), ns), pod(i, node, None)).await;
    }
    attached(&client, ns, 2).await;
    let to = running_machine(&client, ns, "c", ns).await;
    // The operator: a pod of pg gone is made again on `c`'s Node.
    let operator = {
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        tokio::spawn(async move {
            let config = watcher::Config::default().labels("app=pg");
            let mut events = watcher::watcher(pods.clone(), config).boxed();
            while let Some(Ok(event)) = events.next().await {
                if let Event::Delete(gone) = event {
                    let i: usize = gone.name_any()["pg-".len()..].parse().expect("an ordinal");
                    let again = pod(i, &to, Some("40s"));
                    pods.create(&Default::default(), &again)
                        .await
                        .expect("the operator makes the pod again");
                }
            }
        })
    };
    let watches = Watches::start(&client, ns).await;

    delete_at_once(&client, ns, &["a", "b"]).await;
    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let ((first, evicted), (_, second)) = in_order(&all, ("pg-0", "pg-1"), &log);
    let replacement = Api::<Pod>::namespaced(client.clone(), ns)
        .get(first)
        .await
        .expect("the replacement");
    let ready =
        ready_at(&replacement).unwrap_or_else(|| panic!("{first}'s replacement Ready: {log}"));
    assert!(
        second.received >= ready,
        "the next replica went at {} before {first}'s replacement was Ready at {ready}: {log}",
        second.received
    );
    let held = second.received.duration_since(evicted.received);
    assert!(
        held >= k8s_openapi::jiff::SignedDuration::from_secs(35),
        "held {held}, not the 40 s the replacement took: {log}"
    );
    operator.abort();
}

/// A Machine whose finalizer is removed by hand while its drain moves a
/// replica of `db` and another workload (`solo`, pinned to its Node)
/// waits behind it: its drain stops at once (no drain is left running in
/// the process, `solo-0` is never evicted and nothing is sent about the
/// Machine once it is gone; before, the drain spun on a move record it
/// could no longer write), and the move keeps its
/// permit (the MovePermit is still there once Machine `b`'s drain has
/// asked for `db`) until the workload is whole: `b`'s replica is evicted
/// only once the first one's replacement (held unready for 30 s) is Ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_removed_by_hand_stops_its_drain_and_its_move_keeps_the_permit() {
    use berth::api::MovePermit;
    use k8s_openapi::api::core::v1::Pod;
    let ns = "ledger-vanished";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    running_machine(&client, ns, "b", ns).await;
    stateful_set_with(&client, ns, "db", 2, true, on_delete).await;
    let pinned = node_a.clone();
    stateful_with(&client, ns, "solo", 1, false, move |t| {
        if let Some(spec) = t.spec.as_mut() {
            spec.node_selector = Some([("kubernetes.io/hostname".to_string(), pinned)].into());
        }
    })
    .await;
    attached(&client, ns, 3).await;
    running_machine(&client, ns, "c", ns).await;
    running_machine(&client, ns, "d", ns).await;
    hold_replacements_unready(&client, ns, "db", "30s").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let on_a = |ps: &[Pod]| {
        ps.iter()
            .find(|p| support::pool::on_node(p, &node_a) && p.name_any().starts_with("db-"))
            .map(|p| (p.name_any(), p.metadata.uid.clone()))
    };
    let (first, old) = on_a(&pods.list(&Default::default()).await.expect("pods").items)
        .expect("a replica of db on a");
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    // The replica of db on a was evicted and its replacement runs, not
    // Ready; solo-0 waits behind it.
    wait::until(pods.clone(), LONG, "the replacement runs", |ps| {
        ps.iter().any(|p| {
            p.name_any() == first && p.metadata.uid != old && support::pool::pod_running(p)
        })
    })
    .await
    .expect("the replacement is placed");
    let machines: Api<berth::api::Machine> = Api::namespaced(client.clone(), ns);
    machines
        .patch(
            "a",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("remove a's finalizer by hand");
    gone(&client, ns, "a", LONG).await;
    let vanished = k8s_openapi::jiff::Timestamp::now();

    // b's drain asks for db's permit while db is not whole: the permit of
    // a's move is still there.
    delete_machine(&client, ns, "b").await;
    wait::for_one(machines.clone(), LONG, "b waits for db", |m| {
        m.name_any() == "b"
            && support::waiting_for_budget(m).contains("StatefulSet ledger-vanished/db")
    })
    .await
    .expect("b's drain asks for db");
    let permit = Api::<MovePermit>::namespaced(client.clone(), ns)
        .get_opt("statefulset.db.0")
        .await
        .expect("read the permit");
    assert!(
        permit
            .as_ref()
            .is_some_and(|p| p.spec.pod == first && p.spec.machine == format!("{ns}/a")),
        "the move keeps its permit after its Machine is gone: {permit:?}"
    );
    gone(&client, ns, "b", Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let later = evicted_once(&all, if first == "db-0" { "db-1" } else { "db-0" }, &log);
    let replacement = pods.get(&first).await.expect("the replacement");
    let ready =
        ready_at(&replacement).unwrap_or_else(|| panic!("{first}'s replacement Ready: {log}"));
    assert!(
        later.received >= ready,
        "the next replica went at {} before {first}'s replacement was Ready at {ready}: {log}",
        later.received
    );
    // a's drain stopped: solo-0 was never evicted, and nothing more was
    // sent about Machine a once it was gone (a write in flight at that
    // moment aside, and whatever the controller sent before its own watch
    // told it, which a loaded machine can make seconds after this
    // process's: 10 s; a drain spinning on its record writes on through
    // b's drain, half a minute and more).
    assert!(
        accepted_evictions_of(&all, "solo-0").is_empty(),
        "a's drain went on after a was gone: {log}"
    );
    let after = vanished
        .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(10))
        .expect("a time");
    let about_a: Vec<String> = support::audit::requests(BED.bed().await, ns)
        .into_iter()
        .filter(|r| r.resource == "machines" && r.name.as_deref() == Some("a"))
        .filter(|r| r.received > after)
        .map(|r| {
            format!(
                "{} {} {:?} -> {}",
                r.received, r.verb, r.subresource, r.code
            )
        })
        .collect();
    assert!(about_a.is_empty(), "the drain of a stopped: {about_a:#?}");
    // And no drain is left running in the process (a's would spin on its
    // record, which it can no longer write).
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while case.running().metrics().drains_in_progress.get() > 0 && std::time::Instant::now() < until
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        case.running().metrics().drains_in_progress.get(),
        0,
        "a's drain still runs after a is gone"
    );
}

/// A forced deletion (case 2 of issue 36) skips PodDisruptionBudgets and
/// the deadline, not the move ledger. Machine `a`, labelled for forced
/// deletion, runs one replica of db (whose replacements are held unready
/// for 30 s) and is deleted: its replica is deleted at once, and its move
/// takes db's permit (a `MovePermit` naming `a`, read while it is
/// there). Machine `b`, deleted next the usual way, evicts the other
/// replica only once the first one's replacement is Ready (by the audit
/// log and the pod's Ready condition); the permit is gone at the end.
/// Without the ledger on the forced path, b's replica went at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_deletion_takes_its_workloads_permit_and_holds_the_next_replica() {
    use berth::api::MovePermit;
    use k8s_openapi::api::core::v1::Pod;
    let ns = "ledger-forced";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    running_machine(&client, ns, "b", ns).await;
    stateful_set_with(&client, ns, "db", 2, true, on_delete).await;
    attached(&client, ns, 2).await;
    running_machine(&client, ns, "c", ns).await;
    running_machine(&client, ns, "d", ns).await;
    hold_replacements_unready(&client, ns, "db", "30s").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let first = pods
        .list(&Default::default())
        .await
        .expect("pods")
        .items
        .into_iter()
        .find(|p| support::pool::on_node(p, &node_a))
        .map(|p| p.name_any())
        .expect("a replica of db on a");
    let watches = Watches::start(&client, ns).await;
    let machines: Api<berth::api::Machine> = Api::namespaced(client.clone(), ns);
    machines
        .patch(
            "a",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({
                "metadata": {"labels": {berth::api::FORCE_DELETION_LABEL: "true"}}
            })),
        )
        .await
        .expect("label a for forced deletion");
    delete_machine(&client, ns, "a").await;
    let permits: Api<MovePermit> = Api::namespaced(client.clone(), ns);
    let permit = wait::for_one(permits.clone(), LONG, "the forced move's permit", |p| {
        p.spec.machine == format!("{ns}/a")
    })
    .await
    .expect("the forced deletion takes db's permit");
    assert_eq!(permit.spec.pod, first, "{permit:?}");
    gone(&client, ns, "a", LONG).await;

    delete_machine(&client, ns, "b").await;
    gone(&client, ns, "b", Duration::from_secs(120)).await;
    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let later = evicted_once(&all, if first == "db-0" { "db-1" } else { "db-0" }, &log);
    let replacement = pods.get(&first).await.expect("the replacement");
    let ready =
        ready_at(&replacement).unwrap_or_else(|| panic!("{first}'s replacement Ready: {log}"));
    assert!(
        later.received >= ready,
        "the next replica went at {} before the forced {first}'s replacement was Ready at {ready}: {log}",
        later.received
    );
    wait::for_none(permits, LONG, "no permit left", |_| true)
        .await
        .expect("the forced move's permit ends once db is whole");
}

/// A drain busy elsewhere keeps no place in line (case 8 of issue 36).
/// Machines `a`, `b` and `c` each run one replica of db, and `b` also runs
/// `other-0`, whose replacement is held unready for 40 s; they are deleted
/// in that order (`b` and `c` once `a` holds db's permit), so `b` is ahead
/// of `c` in db's line. While `a`'s replica moves, `b`'s drain asks for
/// db, waits, and goes on moving `other-0`,
/// which keeps its pass busy for 40 s; `c`'s drain has nothing else to do
/// and waits. When `a`'s move ends, db's permit goes to `c` at once: its
/// replica is evicted before `b`'s, and before `other-0`'s replacement is
/// Ready (by the audit log and the pod's Ready condition). Before, `b`
/// kept its place until its pass ended, and db's permit sat idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_busy_elsewhere_keeps_no_place_in_line() {
    use berth_devkit::testbed::stages::READY_AFTER_ANNOTATION;
    use k8s_openapi::api::core::v1::Pod;
    let ns = "ledger-line";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, ns, "b", ns).await;
    let node_c = running_machine(&client, ns, "c", ns).await;
    stateful(&client, ns, "db", 3, true).await;
    let pinned = node_b.clone();
    stateful_set_with(&client, ns, "other", 1, false, move |sts| {
        on_delete(sts);
        if let Some(spec) = sts.spec.template.spec.as_mut() {
            spec.node_selector
                .get_or_insert_default()
                .insert("kubernetes.io/hostname".to_string(), pinned);
        }
    })
    .await;
    attached(&client, ns, 4).await;
    // Its replacement may go anywhere in the pool, and is Ready only after
    // 40 s.
    Api::<StatefulSet>::namespaced(client.clone(), ns)
        .patch(
            "other",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"template": {
                "metadata": {"annotations": {(READY_AFTER_ANNOTATION): "40s"}},
                "spec": {"nodeSelector": {"kubernetes.io/hostname": null}}}}})),
        )
        .await
        .expect("free other's replacement, held unready");
    for m in ["d", "e", "f"] {
        running_machine(&client, ns, m, ns).await;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let listed = pods.list(&Default::default()).await.expect("pods").items;
    let on = |node: &str| {
        listed
            .iter()
            .find(|p| support::pool::on_node(p, node) && p.name_any().starts_with("db-"))
            .map(|p| p.name_any())
            .expect("a replica of db on each Machine")
    };
    let (on_b, on_c) = (on(&node_b), on(&node_c));
    let first = on(&node_a);
    let watches = Watches::start(&client, ns).await;

    // a first, holding db's permit before b and c are deleted: deleted a
    // moment apart, the drain that asks first takes it, and b's drain can
    // start before a's.
    delete_machine(&client, ns, "a").await;
    let held = wait::until(
        Api::<berth::api::MovePermit>::namespaced(client.clone(), ns),
        Duration::from_secs(60),
        "a holds db's permit",
        |ps| !ps.is_empty(),
    )
    .await;
    assert!(held.is_ok(), "a takes db's permit for {first}");
    for m in ["b", "c"] {
        delete_machine(&client, ns, m).await;
    }
    for m in ["a", "b", "c"] {
        gone(&client, ns, m, Duration::from_secs(180)).await;
    }
    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let went_first = evicted_once(&all, &first, &log);
    let from_b = evicted_once(&all, &on_b, &log);
    let from_c = evicted_once(&all, &on_c, &log);
    evicted_once(&all, "other-0", &log);
    assert!(
        went_first.received < from_c.received && from_c.received < from_b.received,
        "the permit went to c's parked drain, not to b's busy one: {log}"
    );
    let other = pods.get("other-0").await.expect("other's replacement");
    let ready = ready_at(&other).unwrap_or_else(|| panic!("other-0's replacement Ready: {log}"));
    assert!(
        from_c.received < ready,
        "{on_c} went at {}, only once b's pass ended (other-0's replacement Ready at {ready}): {log}",
        from_c.received
    );
    // Six Machines and three drains within seconds: a rollout's burst.
}

/// A drain that begins a volume move gives up its place in line until its
/// pass is over (issue 36, the shared benchmark's lost slot). `g` runs a
/// replica of `other`, `a`, `b` and `c` one of `db` each, and `b` also the
/// other replica of `other`; every replacement is held unready (`other`'s
/// 20 s, `db`'s 30 s). `g` and `a` are deleted first and move, then `b`:
/// its pass finds both workloads' permits held and parks on both asks
/// (their `MoveAsk`s); then `c`, behind `b` in `db`'s line. When `g`'s
/// move ends, `b` begins its `other` move, which keeps it busy for 20 s,
/// and takes its `db` ask out of line (the `MoveAsk` deleted); when `a`'s
/// move ends meanwhile, `db`'s permit goes to `c`, whose replica is evicted
/// before `b`'s and before `b`'s `other` replacement is Ready (by the audit
/// log and the pod's Ready condition). The replacements go to `d`, `e`
/// and `f` only. Before, `b`'s parked ask kept its
/// place through that move, and `db`'s permit sat idle until `b` was done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_begins_another_move_gives_up_its_place_in_line() {
    use berth::api::MovePermit;
    use k8s_openapi::api::core::v1::Pod;
    let ns = "ledger-busy";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_b = running_machine(&client, ns, "b", ns).await;
    let node_c = running_machine(&client, ns, "c", ns).await;
    stateful_set_with(&client, ns, "db", 3, true, on_delete).await;
    attached(&client, ns, 3).await;
    let node_g = running_machine(&client, ns, "g", ns).await;
    let (b, g) = (node_b.clone(), node_g.clone());
    stateful_set_with(&client, ns, "other", 2, true, move |sts| {
        on_delete(sts);
        if let Some(spec) = sts.spec.template.spec.as_mut() {
            spec.affinity.get_or_insert_default().node_affinity = Some(json(serde_json::json!({
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
                    "matchExpressions": [{
                        "key": "kubernetes.io/hostname", "operator": "In", "values": [b, g]
                    }]
                }]}
            })));
        }
    })
    .await;
    attached(&client, ns, 5).await;
    // The replacements go to d, e or f only (a Node being drained next
    // would move them again), held unready.
    let mut receivers = Vec::new();
    for m in ["d", "e", "f"] {
        receivers.push(running_machine(&client, ns, m, ns).await);
    }
    let to_receivers = serde_json::json!({"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{
            "key": "kubernetes.io/hostname", "operator": "In", "values": receivers
        }]}]
    }});
    for (name, hold) in [("other", "20s"), ("db", "30s")] {
        Api::<StatefulSet>::namespaced(client.clone(), ns)
            .patch(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(serde_json::json!({"spec": {"template": {
                    "spec": {"affinity": {"nodeAffinity": to_receivers.clone()}}}}})),
            )
            .await
            .expect("send the replacements to the receivers");
        hold_replacements_unready(&client, ns, name, hold).await;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let listed = pods.list(&Default::default()).await.expect("pods").items;
    let on = |node: &str, app: &str| {
        listed
            .iter()
            .find(|p| support::pool::on_node(p, node) && p.name_any().starts_with(app))
            .map(|p| p.name_any())
            .unwrap_or_else(|| panic!("a replica of {app} on {node}"))
    };
    let (db_a, db_b, db_c) = (on(&node_a, "db-"), on(&node_b, "db-"), on(&node_c, "db-"));
    let (other_b, other_g) = (on(&node_b, "other-"), on(&node_g, "other-"));
    let watches = Watches::start(&client, ns).await;
    let permits = Api::<MovePermit>::namespaced(client.clone(), ns);
    let held = |n: usize, what: &'static str| {
        let permits = permits.clone();
        async move {
            wait::until(permits, Duration::from_secs(60), what, |ps| ps.len() >= n)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
        }
    };

    delete_machine(&client, ns, "g").await;
    held(1, "g holds other's permit").await;
    delete_machine(&client, ns, "a").await;
    held(2, "a holds db's permit").await;
    delete_machine(&client, ns, "b").await;
    // b's pass ends and parks on both asks; c is deleted after b.
    tokio::time::sleep(Duration::from_secs(3)).await;
    delete_machine(&client, ns, "c").await;
    for m in ["g", "a", "b", "c"] {
        gone(&client, ns, m, Duration::from_secs(240)).await;
    }
    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let from_g = evicted_once(&all, &other_g, &log);
    let other_from_b = evicted_once(&all, &other_b, &log);
    let db_from_a = evicted_once(&all, &db_a, &log);
    let db_from_b = evicted_once(&all, &db_b, &log);
    let db_from_c = evicted_once(&all, &db_c, &log);
    assert!(
        from_g.received < other_from_b.received && db_from_a.received < db_from_c.received,
        "g's and a's replicas went first: {log}"
    );
    assert!(
        db_from_c.received < db_from_b.received,
        "db's permit went to c's parked drain, not to b's busy one: {log}"
    );
    // How it came about, by the audit log: b parked on db's ask
    // before it began its other move, and took it out of line then.
    let ask = format!("statefulset.db.{db_b}");
    let writes: Vec<_> = support::audit::requests(BED.bed().await, ns)
        .into_iter()
        .filter(|r| r.resource == "moveasks" && r.name.as_deref() == Some(ask.as_str()))
        .filter(|r| r.is_write() && r.code < 300)
        .collect();
    let parked = writes
        .iter()
        .find(|r| r.verb == "create" && r.received < other_from_b.received)
        .unwrap_or_else(|| panic!("b parked on {ask} before its other move: {writes:?}\n{log}"));
    assert!(
        writes.iter().any(|r| r.verb == "delete"
            && r.received > parked.received
            && r.received < db_from_c.received),
        "b took {ask} out of line when it began its other move: {writes:?}\n{log}"
    );
    let replacement = pods.get(&other_b).await.expect("other's replacement");
    let ready =
        ready_at(&replacement).unwrap_or_else(|| panic!("{other_b}'s replacement Ready: {log}"));
    assert!(
        db_from_c.received < ready,
        "{db_c} went at {}, only once b's move was over ({other_b}'s replacement Ready at {ready}): {log}",
        db_from_c.received
    );
}

/// One application over two controllers (an Elasticsearch with a
/// StatefulSet per zone): `db` (two replicas) and `solo` name one move
/// group (`berth.dev/move-group: app`), all on Machine `a`, whose class
/// moves two volumes at once (`maxParallelVolumeMigrations: 2`). Without
/// the group, `solo-0` moves beside `db-0` (the case above); in it, the
/// group has one budget: `solo-0` is evicted only once the first replica's
/// volume is attached where its replacement runs (the audit log, the
/// VolumeAttachments).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_group_moves_one_replica_of_its_workloads_at_a_time() {
    use berth::drain::ledger::MOVE_GROUP_ANNOTATION;
    let ns = "ledger-group";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m", "maxParallelVolumeMigrations": 2}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    for (name, replicas) in [("db", 2), ("solo", 1)] {
        stateful_set_with(&client, ns, name, replicas, false, |sts| {
            sts.metadata.annotations =
                Some([(MOVE_GROUP_ANNOTATION.to_string(), "app".to_string())].into());
        })
        .await;
    }
    attached(&client, ns, 3).await;
    running_machine(&client, ns, "b", ns).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let first = all
        .iter()
        .filter(|r| r.code < 300)
        .min_by_key(|r| r.received)
        .and_then(|r| r.name.clone())
        .unwrap_or_else(|| panic!("an eviction: {log}"));
    for later in ["db-0", "db-1", "solo-0"]
        .into_iter()
        .filter(|p| *p != first)
    {
        let second = evicted_once(&all, later, &log);
        watches
            .assert_after_moved(
                BED.bed().await,
                second,
                &format!("{ns}-{first}"),
                &node_a,
                &log,
            )
            .await;
    }
}

/// A StatefulSet that its controller does not roll on a template change
/// (`OnDelete`): a change reaches only the pods made after it.
fn on_delete(sts: &mut StatefulSet) {
    {
        let spec = &mut sts.spec;
        spec.update_strategy = Some(json(serde_json::json!({"type": "OnDelete"})));
    }
}

/// The pods StatefulSet `name` makes from now on are held unready for
/// `hold` (the test bed's readiness hold on its template; with `OnDelete`
/// the pods it runs are left alone).
async fn hold_replacements_unready(client: &Client, ns: &str, name: &str, hold: &str) {
    use berth_devkit::testbed::stages::READY_AFTER_ANNOTATION;
    Api::<StatefulSet>::namespaced(client.clone(), ns)
        .patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"template": {"metadata": {
                "annotations": {(READY_AFTER_ANNOTATION): hold}}}}})),
        )
        .await
        .expect("hold the replacements unready");
}

/// The evictions of `db-0` and `db-1` in the order they came (by the
/// audit log), asserting that the second came only once the first one's
/// replacement was Ready (by its Ready condition, whole seconds): the
/// first's and the second's eviction, and what the case shows on failure.
async fn next_after_replacement_ready(
    client: &Client,
    ns: &str,
    watches: &Watches,
) -> (
    berth_devkit::bench::audit::Request,
    berth_devkit::bench::audit::Request,
    String,
) {
    use k8s_openapi::api::core::v1::Pod;
    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let ((first, evicted), (_, second)) = in_order(&all, ("db-0", "db-1"), &log);
    let replacement = Api::<Pod>::namespaced(client.clone(), ns)
        .get(first)
        .await
        .expect("the replacement");
    let ready =
        ready_at(&replacement).unwrap_or_else(|| panic!("{first}'s replacement Ready: {log}"));
    assert!(
        second.received >= ready,
        "the next replica went at {} before {first}'s replacement was Ready at {ready}: {log}",
        second.received
    );
    (evicted.clone(), second.clone(), log)
}

/// When `pod` turned Ready, by its Ready condition (whole seconds), if it
/// is.
fn ready_at(pod: &k8s_openapi::api::core::v1::Pod) -> Option<k8s_openapi::jiff::Timestamp> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready" && c.status == "True")?
        .last_transition_time
        .as_ref()
        .map(|t| t.0)
}

/// A replica on a Node that died is down, whatever its pod still says
/// (issue 53, item 0). db-0 and db-1 run on Machines of their own; db-0's
/// Node dies (its kubelet stops: the bed's dead stage turns it NotReady at
/// once, and its pod still says Ready until the node lifecycle controller
/// marks it), then db-1's Machine is deleted. db-1 is not evicted: the
/// ledger counts db-0 down from its Node, and db-1's drain waits, naming
/// db-0's Node. Before, db-1 was evicted 0.2 s after the Node went
/// NotReady, and for seconds no replica served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_on_a_dead_node_counts_as_down() {
    let ns = "ledger-dead-node";
    let (_case, client, node_a, node_b) = db_on_a_and_b(ns).await;
    // A Node for db-1's replacement.
    running_machine(&client, ns, "c", ns).await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    let db0 = pods.get("db-0").await.expect("db-0");
    let dead = db0.spec.and_then(|s| s.node_name).expect("db-0 runs");
    let (doomed, doomed_node) = if dead == node_a {
        ("b", node_b)
    } else {
        ("a", node_a)
    };
    support::nodes::kill(&client, &dead).await;
    delete_machine(&client, ns, doomed).await;
    // The moment to look: the drain says what it waits for (the truth is
    // the audit log below).
    let machines: Api<berth::api::Machine> = Api::namespaced(client.clone(), ns);
    let waiting = wait::for_one(machines, LONG, "the drain waits for db-0", |m| {
        m.name_any() == doomed && support::waiting_for_budget(m).contains("db-0")
    })
    .await;
    let all = evictions(BED.bed().await, ns);
    assert!(
        accepted_evictions_of(&all, "db-1").is_empty(),
        "db-1 (on {doomed_node}) is not evicted while db-0's Node {dead} is down: {}",
        oracle::log_of(&all)
    );
    let waiting = waiting.unwrap_or_else(|e| panic!("{e}: {}", oracle::log_of(&all)));
    let words = support::waiting_for_budget(&waiting).to_string();
    assert!(
        words.contains(&format!("db-0 on Node {dead}, which is down"))
            || words.contains("db-0 not Ready since"),
        "the wait names db-0 and why: {words}"
    );
}

/// No circular wait in the line (issue 53, item 1). db-0 is down (its pod
/// runs, held unready); Machine `b` is deleted first: db-1, Ready, asks
/// and waits for db to be whole, in line ahead. Then Machine `a`, db-0's:
/// its move is what makes db whole, so db-1's ask is not ahead of it. db-0
/// is evicted at once, its replacement turns Ready, then db-1 goes, and
/// both Machines are gone far before their 5-minute deadline (no bypass).
/// Before, db-0 waited behind db-1, and db-1 for db-0, until the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_down_itself_is_not_behind_the_asks_that_wait_for_it() {
    use k8s_openapi::api::core::v1::Pod;
    let ns = "ledger-circle";
    let (_case, client, node_a, node_b) = db_on_a_and_b_with(ns, on_delete).await;
    // db-0 made again, held unready: the replica that is down.
    hold_replacements_unready(&client, ns, "db", "1000h").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let old = pods.get("db-0").await.expect("db-0").metadata.uid;
    pods.delete("db-0", &Default::default())
        .await
        .expect("delete db-0");
    let db0 = wait::for_one(pods.clone(), LONG, "db-0 back, not Ready", |p| {
        p.name_any() == "db-0" && p.metadata.uid != old && support::pool::pod_running(p)
    })
    .await
    .expect("db-0 runs again");
    let on = db0.spec.as_ref().and_then(|s| s.node_name.clone());
    let (down_machine, up_machine) = if on.as_deref() == Some(node_a.as_str()) {
        ("a", "b")
    } else {
        assert_eq!(on.as_deref(), Some(node_b.as_str()), "db-0 on a or b");
        ("b", "a")
    };
    // Replacements from now on turn Ready; two Nodes for them.
    hold_replacements_unready(&client, ns, "db", "1s").await;
    running_machine(&client, ns, "c", ns).await;
    running_machine(&client, ns, "d", ns).await;
    let watches = Watches::start(&client, ns).await;
    delete_machine(&client, ns, up_machine).await;
    let machines: Api<berth::api::Machine> = Api::namespaced(client.clone(), ns);
    wait::for_one(machines, LONG, "db-1's drain waits for db", |m| {
        m.name_any() == up_machine && support::waiting_for_budget(m).contains("db-0")
    })
    .await
    .expect("db-1 waits for db to be whole");
    delete_machine(&client, ns, down_machine).await;
    gone(&client, ns, down_machine, Duration::from_secs(120)).await;
    gone(&client, ns, up_machine, Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let ((first, _), (_, second)) = in_order(&all, ("db-0", "db-1"), &log);
    assert_eq!(first, "db-0", "the replica that was down goes first: {log}");
    watches
        .assert_after_moved(
            BED.bed().await,
            second,
            &format!("{ns}-db-0"),
            &db0_node(&db0),
            &log,
        )
        .await;
}

/// The Node `pod` runs on.
fn db0_node(pod: &k8s_openapi::api::core::v1::Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}
