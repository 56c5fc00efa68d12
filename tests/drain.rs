//! The volume-aware drain end to end: real kube-apiserver, controller-
//! manager (StatefulSet, ReplicaSet, DaemonSet, disruption, attach-detach
//! and PV controllers), scheduler and kwok, with simulated CSI attach and
//! detach delays. The truth of every assertion about what was done, in
//! what order and how often is the cluster's: the API server's audit log
//! and watches of Pods and VolumeAttachments (`support::oracle`). berth's
//! Events are checked apart, as what operators are told.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use berth::api::Machine;
use berth::providers::fake::FakeProvider;
use berth_devkit::testbed::fixtures::csi_pv;
use berth_devkit::testbed::stages::COMPLETE_AFTER_ANNOTATION;
use berth_devkit::testbed::wait;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use support::oracle::{self, Watches, accepted_evictions_of, evictions};
use support::pool::{
    Bed, POOL, create, delete_machine, events, first, gone, json, log_of, on_node, pod_running,
    pool_class, release_hook, running_held, running_machine, stateful, stateful_in_pool,
};
use support::{Case, LONG, machine, phase};

const ATTACH_DELAY: Duration = Duration::from_millis(1500);
const DETACH_DELAY: Duration = Duration::from_millis(1500);

/// One control plane for this file, with slow enough attach/detach that an
/// overlap would show.
const BED: Bed = Bed {
    attach: ATTACH_DELAY,
    detach: DETACH_DELAY,
};

async fn priority_classes(client: &Client) {
    for (name, value) in [("berth-e2e-high", 1000), ("berth-e2e-low", 100)] {
        create(
            Api::all(client.clone()),
            json::<PriorityClass>(serde_json::json!({
                "metadata": {"name": name}, "value": value
            })),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_drained_in_volume_aware_order() {
    let ns = "drain-main";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .build()
        .await;
    let client = case.client();
    priority_classes(&client).await;
    case.start_as("drain-main").await;
    let node_a = running_machine(&client, ns, "a", ns).await;

    // Stateful: `cache` (high priority) and `db` (3 replicas, low priority).
    stateful_in_pool(&client, ns, "cache", 1, Some("berth-e2e-high")).await;
    stateful_in_pool(&client, ns, "db", 3, Some("berth-e2e-low")).await;
    // Stateless: 5 replicas behind a PDB that allows 3 disruptions.
    create(
        Api::namespaced(client.clone(), ns),
        json::<Deployment>(serde_json::json!({
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 5,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "nodeSelector": {POOL: ns},
                        "terminationGracePeriodSeconds": 1,
                        "containers": [{"name": "main", "image": "registry.invalid/web:1"}]
                    }
                }
            }
        })),
    )
    .await;
    create(
        Api::namespaced(client.clone(), ns),
        json::<PodDisruptionBudget>(serde_json::json!({
            "metadata": {"name": "web"},
            "spec": {"maxUnavailable": 3, "selector": {"matchLabels": {"app": "web"}}}
        })),
    )
    .await;
    // A DaemonSet pod, which stays until the VM goes.
    create(
        Api::namespaced(client.clone(), ns),
        json::<DaemonSet>(serde_json::json!({
            "metadata": {"name": "agent"},
            "spec": {
                "selector": {"matchLabels": {"app": "agent"}},
                "template": {
                    "metadata": {"labels": {"app": "agent"}},
                    "spec": {
                        "nodeSelector": {POOL: ns},
                        "containers": [{"name": "main", "image": "registry.invalid/agent:1"}]
                    }
                }
            }
        })),
    )
    .await;
    // A finished pod, which is deleted outright.
    create(
        Api::namespaced(client.clone(), ns),
        json::<Pod>(serde_json::json!({
            "metadata": {"name": "job", "annotations": {COMPLETE_AFTER_ANNOTATION: "0s"}},
            "spec": {
                "nodeName": node_a,
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "registry.invalid/job:1"}]
            }
        })),
    )
    .await;

    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::until(pods.clone(), LONG, "all pods running on A", |ps| {
        let count = |prefix: &str| {
            ps.iter()
                .filter(|p| {
                    p.name_any().starts_with(prefix) && on_node(p, &node_a) && pod_running(p)
                })
                .count()
        };
        count("cache-") == 1
            && count("db-") == 3
            && count("web-") == 5
            && count("agent-") == 1
            && ps.iter().any(|p| {
                p.name_any() == "job"
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded")
            })
    })
    .await
    .expect("the workloads run on A");
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    wait::until(vas.clone(), LONG, "4 volumes attached to A", |all| {
        all.iter()
            .filter(|va| {
                va.spec.node_name == node_a && va.status.as_ref().is_some_and(|s| s.attached)
            })
            .count()
            == 4
    })
    .await
    .expect("the volumes attach");
    wait::for_one(
        Api::<PodDisruptionBudget>::namespaced(client.clone(), ns),
        LONG,
        "the web PDB observed",
        |p| {
            p.status
                .as_ref()
                .is_some_and(|s| s.current_healthy.unwrap_or(0) == 5)
        },
    )
    .await
    .expect("the disruption controller computes the PDB");

    // The replacement Node, then the plan, then the deletion.
    let node_b = running_machine(&client, ns, "b", ns).await;
    let live = berth::cli::plan::plan_machine(&client, ns, "a")
        .await
        .expect("plan");
    let planned: Vec<String> = live
        .plan
        .stateful_order()
        .iter()
        .map(|(_, n)| n.clone())
        .collect();
    assert_eq!(
        planned,
        ["cache-0", "db-0", "db-1", "db-2"],
        "priority first, then name:\n{}",
        live.plan
    );
    assert_eq!(live.plan.stateless.len(), 5, "{}", live.plan);
    assert_eq!(live.plan.to_delete.len(), 1, "{}", live.plan);
    assert_eq!(
        live.plan.skipped.len(),
        1,
        "the DaemonSet pod: {}",
        live.plan
    );

    let watches = Watches::start(&client, ns).await;
    let started = std::time::Instant::now();
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete a");
    wait::for_none(machines.clone(), Duration::from_secs(240), "a gone", |m| {
        m.name_any() == "a"
    })
    .await
    .expect("the deletion completes");
    let took = started.elapsed();
    let evs = events(&client, ns, "a").await;
    let log = log_of(&evs);
    eprintln!("drain of a took {took:?}; events:\n{log}");

    // Stateful pods, by the audit log and the watches: each evicted once,
    // in the planned order, and each one's volume detached from A and
    // attached on B (the attacher's write received) before the next
    // eviction was received.
    let all = evictions(BED.bed().await, ns);
    let truth = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let received = |pod: &str| {
        let accepted = accepted_evictions_of(&all, pod);
        assert_eq!(accepted.len(), 1, "{pod} evicted once: {truth}");
        accepted[0].received
    };
    let mut in_order: Vec<&String> = planned.iter().collect();
    in_order.sort_by_key(|p| received(p));
    assert_eq!(in_order, planned.iter().collect::<Vec<_>>(), "{truth}");
    for pair in planned.windows(2) {
        let (pod, next) = (&pair[0], &pair[1]);
        let pv = format!("{ns}-{pod}");
        let next_evicted = received(next);
        let detached = watches
            .detached_from(&pv, &node_a)
            .unwrap_or_else(|| panic!("{pv} detached from A: {truth}"));
        let attached = watches
            .attached_on(BED.bed().await, &pv, &node_b)
            .await
            .unwrap_or_else(|| panic!("{pv} attached on B: {truth}"));
        assert!(
            detached < next_evicted && attached < next_evicted,
            "{pv} must detach from A and attach on B before {next} is evicted:\n{truth}"
        );
        // What operators are told.
        let told =
            first(&evs, "VolumeAttached", &pv).unwrap_or_else(|| panic!("{pv} attached: {log}"));
        assert!(told.2.contains(&node_b), "{pv} moved to B: {}", told.2);
    }
    // Stateless pods: each evicted once, none queued behind the stateful
    // sequence (every one received before db-1's eviction).
    let db1 = received("db-1");
    let web_accepted = accepted_evictions_of(&all, "web-*");
    assert_eq!(web_accepted.len(), 5, "{truth}");
    assert!(
        web_accepted.iter().all(|r| r.received < db1),
        "stateless pods do not queue behind the stateful sequence: {truth}"
    );

    // The first three were one batch: the PDB allowed three at once, and
    // the API server received the third before the first of them had gone
    // (the bed's removal of it, received once its 1 s grace period ran
    // out after its eviction; the audit log). A drain that waited for each
    // pod to go before the next eviction sends the third after that; how
    // close together concurrent requests arrive is the machine's speed.
    let batch = &web_accepted[..3];
    let first_gone = oracle::cluster_requests(BED.bed().await)
        .into_iter()
        .find(|r| {
            r.verb == "delete"
                && r.resource == "pods"
                && r.subresource.is_none()
                && r.namespace.as_deref() == Some(ns)
                && r.name == batch[0].name
                && oracle::accepted(r)
        })
        .unwrap_or_else(|| panic!("{:?} removed: {truth}", batch[0].name));
    assert!(
        batch[2].received < first_gone.received,
        "the first three web evictions were concurrent (one batch), the third before {:?} went at {}: {truth}",
        batch[0].name,
        first_gone.received
    );

    // What operators are told of them: every evicted web pod named, in
    // exactly one Evicted Event. Which Event names which pod follows the
    // time berth read each answer, not the order the API server received
    // the requests (on a loaded machine the two differ), so it is not
    // bound to the audit log; the batching itself is unit-tested
    // (`engine::batch`).
    let web: Vec<BTreeSet<&str>> = evs
        .iter()
        .filter(|(_, r, n)| r == "Evicted" && n.contains("/web-"))
        .map(|(_, _, n)| {
            n.split([' ', ','])
                .filter(|w| w.starts_with(&format!("{ns}/web-")))
                .collect()
        })
        .collect();
    let named: BTreeSet<&str> = web.iter().flatten().copied().collect();
    let mentions: usize = web.iter().map(BTreeSet::len).sum();
    let accepted_names: BTreeSet<String> = web_accepted
        .iter()
        .map(|r| format!("{ns}/{}", r.name.as_deref().unwrap_or_default()))
        .collect();
    assert!(
        named.len() == 5 && mentions == 5,
        "every web pod evicted, each named in one Event: {log}"
    );
    assert_eq!(
        named.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>(),
        accepted_names,
        "the pods named are those the API server evicted: {log}\n{truth}"
    );

    // The finished pod was deleted, the VM and the Node are gone, and every
    // volume is attached on B.
    assert!(
        pods.get_opt("job").await.expect("get").is_none(),
        "job deleted"
    );
    support::assert_vm_and_node_gone(&client, ns, "a", &node_a).await;
    let on_b: BTreeMap<String, String> = vas
        .list(&Default::default())
        .await
        .expect("list VAs")
        .items
        .into_iter()
        .filter(|va| va.status.as_ref().is_some_and(|s| s.attached))
        .filter_map(|va| Some((va.spec.source.persistent_volume_name?, va.spec.node_name)))
        .filter(|(pv, _)| pv.starts_with(ns))
        .collect();
    assert_eq!(on_b.len(), 4, "{on_b:?}");
    assert!(on_b.values().all(|n| *n == node_b), "{on_b:?}");
}

/// A bare pod on `node` guarded by a PDB that can never allow its eviction
/// (minAvailable 1 of 1: "misconfigured").
async fn guarded_pod(client: &Client, ns: &str, node: &str) {
    guarded_pod_with_grace(client, ns, node, 1).await;
}

/// A pod on `node` whose PodDisruptionBudget allows no disruption.
async fn guarded_pod_with_grace(client: &Client, ns: &str, node: &str, grace: i64) {
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), ns);
    create(
        pdbs.clone(),
        json(serde_json::json!({
            "metadata": {"name": "guard"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}
        })),
    )
    .await;
    create(
        Api::namespaced(client.clone(), ns),
        json::<Pod>(serde_json::json!({
            "metadata": {"name": "guarded", "labels": {"app": "guarded"}},
            "spec": {
                "nodeName": node,
                "terminationGracePeriodSeconds": grace,
                "containers": [{"name": "main", "image": "registry.invalid/app:1"}]
            }
        })),
    )
    .await;
    wait::for_one(pdbs, LONG, "the PDB counts the pod", |p| {
        p.status.as_ref().is_some_and(|s| {
            s.current_healthy.unwrap_or(0) == 1 && s.disruptions_allowed.unwrap_or(0) == 0
        })
    })
    .await
    .expect("the disruption controller computes the PDB");
}

/// The misconfiguration rule read against what the real Eviction API and
/// disruption controller write: a budget just spent by an eviction shows
/// every pod healthy and no disruption allowed until the controller
/// recounts, and that is a budget at work, not a misconfigured one. Every
/// state of the PDB, from before the eviction to the recount, is read
/// through a watch (each write is one event, so the Eviction API's own
/// write is always seen).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_spent_by_an_eviction_is_waiting_not_misconfigured() {
    use berth::drain::pdb::{PdbVerdict, classify_pdb};
    use futures::TryStreamExt;
    use kube::api::{EvictParams, WatchEvent, WatchParams};

    let ns = "drain-pdb-in-flight";
    let case = Case::builder(ns).on(BED).build().await;
    let client = case.client();
    let node = format!("{ns}-n");
    create(
        Api::all(client.clone()),
        berth_devkit::testbed::fixtures::node(&node),
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    for i in 0..6 {
        create(
            pods.clone(),
            json(serde_json::json!({
                "metadata": {"name": format!("web-{i}"), "labels": {"app": "web"}},
                "spec": {
                    "nodeName": node,
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{"name": "main", "image": "registry.invalid/web:1"}]
                }
            })),
        )
        .await;
    }
    // Six healthy of six, at least five available: one disruption allowed.
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), ns);
    create(
        pdbs.clone(),
        json(serde_json::json!({
            "metadata": {"name": "web"},
            "spec": {"minAvailable": 5, "selector": {"matchLabels": {"app": "web"}}}
        })),
    )
    .await;
    wait::for_one(pdbs.clone(), LONG, "the PDB counts 6 healthy", |p| {
        p.status
            .as_ref()
            .is_some_and(|s| s.current_healthy == Some(6) && s.disruptions_allowed == Some(1))
    })
    .await
    .expect("the disruption controller computes the PDB");
    let before = pdbs.get("web").await.expect("get the PDB");
    assert_eq!(classify_pdb(&before).verdict, PdbVerdict::Allows);

    let rv = before.metadata.resource_version.clone().expect("a version");
    let stream = pdbs
        .watch(&WatchParams::default().fields("metadata.name=web"), &rv)
        .await
        .expect("watch the PDB");
    pods.evict("web-0", &EvictParams::default())
        .await
        .expect("the budget allows one eviction");
    // A second is refused (429) while the first is in flight.
    let refused = pods.evict("web-1", &EvictParams::default()).await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 429),
        "the spent budget refuses the next eviction: {refused:?}"
    );

    let mut states = Vec::new();
    let mut stream = std::pin::pin!(stream);
    let recounted = tokio::time::timeout(LONG, async {
        while let Some(e) = stream.try_next().await.expect("the watch") {
            if let WatchEvent::Modified(p) = e {
                let s = p.status.clone().unwrap_or_default();
                let recounted = s.current_healthy == Some(5);
                states.push(p);
                if recounted {
                    return;
                }
            }
        }
    })
    .await;
    let described: Vec<String> = states
        .iter()
        .map(|p| {
            let s = p.status.as_ref();
            format!(
                "{} (disrupted {:?})",
                classify_pdb(p),
                s.and_then(|s| s.disrupted_pods.as_ref())
                    .map(|d| d.keys().cloned().collect::<Vec<_>>())
            )
        })
        .collect();
    assert!(
        recounted.is_ok(),
        "the disruption controller recounts: {described:#?}"
    );
    // The Eviction API's own write: every pod still healthy, none allowed,
    // web-0 in flight. It waits; it is not misconfigured.
    let spent = states
        .iter()
        .find(|p| {
            p.status.as_ref().is_some_and(|s| {
                s.current_healthy == Some(6)
                    && s.disruptions_allowed == Some(0)
                    && s.disrupted_pods
                        .as_ref()
                        .is_some_and(|d| d.contains_key("web-0"))
            })
        })
        .unwrap_or_else(|| panic!("the Eviction API's write was watched: {described:#?}"));
    let finding = classify_pdb(spent);
    assert_eq!(finding.verdict, PdbVerdict::Blocking, "{finding}");
    assert!(
        finding.description.contains("1 disruption in flight"),
        "{finding}"
    );
    assert!(
        states
            .iter()
            .all(|p| classify_pdb(p).verdict != PdbVerdict::Misconfigured),
        "no state of a working budget is misconfigured: {described:#?}"
    );
    // Still a misconfiguration where it is one: once web-0 is gone and
    // counted, minAvailable 5 of the 5 left allows nothing, with nothing
    // in flight.
    wait::until(pods.clone(), LONG, "web-0 gone", |ps| {
        ps.iter().all(|p| p.name_any() != "web-0")
    })
    .await
    .expect("the evicted pod goes after its grace period");
    let misconfigured = wait::for_one(pdbs, LONG, "5 of 5 required", |p| {
        classify_pdb(p).verdict == PdbVerdict::Misconfigured
    })
    .await;
    assert!(
        misconfigured.is_ok(),
        "minAvailable equal to the healthy pods, nothing in flight: misconfigured"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_deadline_force_deletes_what_a_pdb_holds() {
    let ns = "drain-force";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "12s", "forceAfterDeadline": true}))
        .start_as("drain-force")
        .await;
    let client = case.client();
    let node = running_machine(&client, ns, "f", ns).await;
    guarded_pod(&client, ns, &node).await;

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let started = std::time::Instant::now();
    machines
        .delete("f", &DeleteParams::default())
        .await
        .expect("delete");
    wait::for_none(machines, LONG, "f gone", |m| m.name_any() == "f")
        .await
        .expect("the deadline forces the drain through");
    assert!(
        started.elapsed() >= Duration::from_secs(11),
        "nothing was forced before the deadline ({:?})",
        started.elapsed()
    );
    let evs = events(&client, ns, "f").await;
    let log = log_of(&evs);
    let blocked = first(&evs, "EvictionBlocked", "guarded").unwrap_or_else(|| panic!("{log}"));
    assert!(
        blocked.2.contains("misconfigured") && blocked.2.contains(&format!("{ns}/guard")),
        "names the PDB and why: {log}"
    );
    assert!(
        first(&evs, "DrainForced", &format!("{ns}/guarded")).is_some(),
        "{log}"
    );
    assert!(
        Api::<Pod>::namespaced(client.clone(), ns)
            .get_opt("guarded")
            .await
            .expect("get")
            .is_none()
    );
}

/// At the deadline a pod a PodDisruptionBudget still holds is deleted with
/// its own grace period, at the deadline minus that grace: it gets all of
/// it, and is gone by the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_deadline_a_pod_is_deleted_with_its_whole_grace_period() {
    let ns = "drain-grace";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "14s", "forceAfterDeadline": true}))
        .start_as("drain-grace")
        .await;
    let client = case.client();
    let node = running_machine(&client, ns, "g", ns).await;
    const GRACE: i64 = 6;
    guarded_pod_with_grace(&client, ns, &node, GRACE).await;

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("g", &DeleteParams::default())
        .await
        .expect("delete");
    let deadline = machines
        .get("g")
        .await
        .expect("get")
        .metadata
        .deletion_timestamp
        .expect("being deleted")
        .0
        + k8s_openapi::jiff::SignedDuration::from_secs(14);
    let pod = wait::for_one(
        Api::<Pod>::namespaced(client.clone(), ns),
        LONG,
        "the guarded pod deleted",
        |p| p.name_any() == "guarded" && p.metadata.deletion_timestamp.is_some(),
    )
    .await
    .expect("the pod is deleted before the deadline");
    assert_eq!(
        pod.metadata.deletion_grace_period_seconds,
        Some(GRACE),
        "its own grace period"
    );
    // The API server sets deletionTimestamp to the request plus the grace
    // period: the request came at the deadline minus the grace period
    // (within a second of the deadline's whole-second resolution before
    // it; after it, the controller's reaction too, up to half the grace
    // period: a deletion at the deadline itself is the whole grace late).
    let ends = pod
        .metadata
        .deletion_timestamp
        .as_ref()
        .expect("deleting")
        .0;
    let off = ends.duration_since(deadline).as_secs_f64();
    assert!(
        (-2.0..=GRACE as f64 / 2.0).contains(&off),
        "the pod's grace ends at the deadline, {off:.1}s off"
    );
    wait::for_none(machines, LONG, "g gone", |m| m.name_any() == "g")
        .await
        .expect("the Machine goes");
    let evs = events(&client, ns, "g").await;
    assert!(
        first(&evs, "DrainForced", &format!("{ns}/guarded"))
            .is_some_and(|e| e.2.contains("PodDisruptionBudgets bypassed")),
        "{evs:?}"
    );
    assert!(
        first(&evs, "ForcedAtDeadline", &format!("{ns}/guarded")).is_some(),
        "{evs:?}"
    );
}

/// After the deadline budgets are bypassed but volumes are not: stateful
/// pods held by a budget are deleted one at a time, the next only once the
/// volume of the one before has left the Node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_deadline_stateful_pods_still_move_one_at_a_time() {
    let ns = "drain-after";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "8s", "forceAfterDeadline": true}))
        .start_as("drain-after")
        .await;
    let client = case.client();
    let node = running_machine(&client, ns, "s", ns).await;
    stateful_in_pool(&client, ns, "db", 2, None).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::until(pods.clone(), LONG, "db running on s", |ps| {
        ps.iter()
            .filter(|p| p.name_any().starts_with("db-") && on_node(p, &node) && pod_running(p))
            .count()
            == 2
    })
    .await
    .expect("the StatefulSet runs");
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    wait::until(vas, LONG, "2 volumes attached to s", |all| {
        all.iter()
            .filter(|va| {
                va.spec.node_name == node && va.status.as_ref().is_some_and(|s| s.attached)
            })
            .count()
            == 2
    })
    .await
    .expect("the volumes attach");
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), ns);
    create(
        pdbs.clone(),
        json(serde_json::json!({
            "metadata": {"name": "db"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "db"}}}
        })),
    )
    .await;
    wait::for_one(pdbs, LONG, "the PDB observed", |p| {
        p.status
            .as_ref()
            .is_some_and(|s| s.current_healthy.unwrap_or(0) == 2)
    })
    .await
    .expect("the disruption controller computes the PDB");
    running_machine(&client, ns, "t", ns).await;
    let watches = Watches::start(&client, ns).await;

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("s", &DeleteParams::default())
        .await
        .expect("delete");
    wait::for_none(machines, Duration::from_secs(120), "s gone", |m| {
        m.name_any() == "s"
    })
    .await
    .expect("the deletion completes");
    // By the audit log and the watches: the budget holds both pods, so
    // each is deleted past the deadline; db-1's deletion was received only
    // once db-0's volume had detached from the Node, and db-1's own volume
    // had detached before the Node's deletion was received.
    let all = oracle::requests_once(BED.bed().await, ns, |rs| {
        rs.iter()
            .any(|r| r.verb == "delete" && r.resource == "nodes")
    })
    .await;
    let truth = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let deleted = |what: &str, name: &str| {
        all.iter()
            .filter(|r| {
                r.verb == "delete"
                    && r.resource == what
                    && r.subresource.is_none()
                    && r.name.as_deref() == Some(name)
                    && oracle::accepted(r)
            })
            .map(|r| r.received)
            .min()
            .unwrap_or_else(|| panic!("{what} {name} deleted: {truth}"))
    };
    let db1 = deleted("pods", "db-1");
    // Each detach is the attacher's write that let the VolumeAttachment go
    // (the controller acts on it as soon as it sees it: this process's
    // watch may see it later).
    let off0 = watches
        .detached_write(BED.bed().await, &format!("{ns}-db-0"), &node)
        .await
        .unwrap_or_else(|| panic!("db-0's volume detached: {truth}"));
    assert!(
        deleted("pods", "db-0") < off0 && off0 < db1,
        "db-1 goes only once db-0's volume left the Node:\n{truth}"
    );
    let off1 = watches
        .detached_write(BED.bed().await, &format!("{ns}-db-1"), &node)
        .await
        .unwrap_or_else(|| panic!("db-1's volume detached: {truth}"));
    assert!(
        off1 < deleted("nodes", &node),
        "the last volume's detach is waited for before the Node goes:\n{truth}"
    );
    // What operators are told.
    let evs = events(&client, ns, "s").await;
    let log = log_of(&evs);
    for pod in ["db-0", "db-1"] {
        assert!(
            first(&evs, "ForcedAtDeadline", &format!("{ns}/{pod}")).is_some(),
            "{pod} forced: {log}"
        );
    }
}

/// A pod that a finalizer keeps after its grace period is reported once
/// (a Warning and the Drained condition name the finalizer) and holds the
/// Machine only until the deadline plus its grace period; berth never
/// removes someone else's finalizer, and does not delete the pod again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_held_by_a_finalizer_is_reported_once_and_lets_the_machine_go() {
    const FINALIZER: &str = "example.com/keep";
    let ns = "drain-held";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10s", "forceAfterDeadline": true}))
        .start_as("drain-held")
        .await;
    let client = case.client();
    let node = running_machine(&client, ns, "h", ns).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    create(
        pods.clone(),
        json::<Pod>(serde_json::json!({
            "metadata": {"name": "held", "finalizers": [FINALIZER]},
            "spec": {
                "nodeName": node,
                "terminationGracePeriodSeconds": 2,
                "containers": [{"name": "main", "image": "registry.invalid/app:1"}]
            }
        })),
    )
    .await;
    // And a finished pod a finalizer holds: deleted once, not every pass.
    create(
        pods.clone(),
        json::<Pod>(serde_json::json!({
            "metadata": {"name": "done", "finalizers": [FINALIZER],
                "annotations": {COMPLETE_AFTER_ANNOTATION: "0s"}},
            "spec": {
                "nodeName": node,
                "terminationGracePeriodSeconds": 2,
                "containers": [{"name": "main", "image": "registry.invalid/app:1"}]
            }
        })),
    )
    .await;
    wait::for_one(pods.clone(), LONG, "held running", |p| {
        p.name_any() == "held" && pod_running(p)
    })
    .await
    .expect("the pod runs");
    wait::for_one(pods.clone(), LONG, "done finished", |p| {
        p.name_any() == "done"
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded")
    })
    .await
    .expect("the pod finishes");

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let started = std::time::Instant::now();
    machines
        .delete("h", &DeleteParams::default())
        .await
        .expect("delete");
    let m = wait::for_one(machines.clone(), LONG, "the hold named", |m| {
        m.name_any() == "h"
            && support::condition(m, "Drained").is_some_and(|c| c.reason == "PodHeldByFinalizer")
    })
    .await
    .expect("the Drained condition names the hold");
    let msg = support::condition(&m, "Drained")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    // Either pod the finalizer holds: the condition names the hold the
    // drain met first, and the one current when its reconciler looks next.
    assert!(
        (msg.contains(&format!("{ns}/held")) || msg.contains(&format!("{ns}/done")))
            && msg.contains(FINALIZER),
        "{msg}"
    );
    wait::for_none(machines, LONG, "h gone", |m| m.name_any() == "h")
        .await
        .expect("the Machine goes once the hold is released");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(11),
        "held until the deadline plus the grace period: {took:?}"
    );
    let evs = events(&client, ns, "h").await;
    let held: Vec<_> = evs
        .iter()
        .filter(|(_, r, n)| r == "PodHeldByFinalizer" && n.contains(&format!("{ns}/held")))
        .collect();
    assert_eq!(held.len(), 1, "reported once: {evs:?}");
    assert!(held[0].2.contains(FINALIZER), "{held:?}");
    for name in ["held", "done"] {
        let pod = pods.get(name).await.expect("the pod is still there");
        assert_eq!(
            pod.metadata.finalizers.as_deref(),
            Some(&[FINALIZER.to_string()][..]),
            "berth leaves other controllers' finalizers alone"
        );
        assert!(pod.metadata.deletion_timestamp.is_some(), "{name} deleted");
        pods.patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("release the pod");
    }
    let deletes = support::audit::requests(BED.bed().await, ns)
        .iter()
        .filter(|r| r.verb == "delete" && r.resource == "pods" && r.name.as_deref() == Some("done"))
        .count();
    assert_eq!(deletes, 1, "the finished pod is deleted once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_forcing_a_passed_deadline_fails_the_drain_until_the_pdb_is_relaxed() {
    let ns = "drain-noforce";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "8s", "forceAfterDeadline": false}))
        .start_as("drain-noforce")
        .await;
    let client = case.client();
    let node = running_machine(&client, ns, "n", ns).await;
    guarded_pod(&client, ns, &node).await;

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("n", &DeleteParams::default())
        .await
        .expect("delete");
    let m = wait::for_one(machines.clone(), LONG, "drain failed", |m| {
        m.name_any() == "n"
            && support::condition(m, "Drained").is_some_and(|c| c.reason == "DrainFailed")
    })
    .await
    .expect("the drain fails at its deadline");
    let msg = support::condition(&m, "Drained")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        msg.contains(&format!("{ns}/guarded")) && msg.contains("forceAfterDeadline=false"),
        "says which pods are left and why: {msg}"
    );
    assert!(
        Api::<Node>::all(client.clone())
            .get_opt(&node)
            .await
            .expect("get node")
            .is_some(),
        "nothing is deleted while the drain has failed"
    );
    assert!(
        Api::<Pod>::namespaced(client.clone(), ns)
            .get_opt("guarded")
            .await
            .expect("get pod")
            .is_some(),
        "the pod was not forced"
    );

    // Relaxing the budget lets the retried drain evict it, and the deletion
    // completes.
    Api::<PodDisruptionBudget>::namespaced(client.clone(), ns)
        .delete("guard", &DeleteParams::default())
        .await
        .expect("delete pdb");
    wait::for_none(machines, Duration::from_secs(120), "n gone", |m| {
        m.name_any() == "n"
    })
    .await
    .expect("the retried drain completes");
}

/// The Node's lifecycle conditions (KEP-5683), read from the Node: while
/// a PodDisruptionBudget blocks the drain, `DrainInProgress=True` and
/// `Drained=False` with the Machine's own reason (`EvictionBlocked`);
/// once the budget is relaxed and the drain done, `DrainInProgress=False`
/// and `Drained=True` (reason `Drained`), the kubelet's `Ready` kept
/// beside them, and still there after kwok (the kubelet here) refreshed
/// the Node's status. A pre-terminate hook keeps the Node to be read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_says_its_drain_in_lifecycle_conditions() {
    let ns = "drain-node-conditions";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node = running_held(&client, ns, "n", ns, true).await;
    guarded_pod(&client, ns, &node).await;
    let nodes: Api<Node> = Api::all(client.clone());
    let said = |n: &Node, type_: &str| -> Option<(String, String)> {
        let c = n
            .status
            .as_ref()?
            .conditions
            .as_ref()?
            .iter()
            .find(|c| c.type_ == type_)?;
        Some((c.status.clone(), c.reason.clone().unwrap_or_default()))
    };
    let pair = |status: &str, reason: &str| Some((status.to_string(), reason.to_string()));

    delete_machine(&client, ns, "n").await;
    let blocked = wait::for_one(
        nodes.clone(),
        LONG,
        "the Node says its drain is blocked",
        |n| n.name_any() == node && said(n, "DrainInProgress") == pair("True", "EvictionBlocked"),
    )
    .await
    .expect("DrainInProgress while the PDB blocks the drain");
    assert_eq!(said(&blocked, "Drained"), pair("False", "EvictionBlocked"));
    assert_eq!(
        said(&blocked, "Ready").map(|s| s.0).as_deref(),
        Some("True")
    );

    Api::<PodDisruptionBudget>::namespaced(client.clone(), ns)
        .delete("guard", &DeleteParams::default())
        .await
        .expect("delete pdb");
    let drained = wait::for_one(nodes.clone(), LONG, "the Node says it is drained", |n| {
        n.name_any() == node && said(n, "Drained") == pair("True", "Drained")
    })
    .await
    .expect("Drained once the drain is done");
    assert_eq!(said(&drained, "DrainInProgress"), pair("False", "Drained"));
    assert_eq!(
        said(&drained, "Ready").map(|s| s.0).as_deref(),
        Some("True")
    );
    // kwok refreshes the Node's conditions (every 20 s on average): berth's
    // stay.
    let beat = |n: &Node| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
            .and_then(|c| c.last_heartbeat_time.as_ref())
            .map(|t| t.0)
    };
    let before = beat(&drained);
    let refreshed = wait::for_one(nodes, LONG, "kwok refreshes the Node's status", |n| {
        n.name_any() == node && beat(n) > before
    })
    .await
    .expect("a heartbeat");
    assert_eq!(
        (
            said(&refreshed, "DrainInProgress"),
            said(&refreshed, "Drained")
        ),
        (pair("False", "Drained"), pair("True", "Drained")),
        "kept through the kubelet's refresh"
    );
    release_hook(&client, ns, "n").await;
    gone(&client, ns, "n", Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_no_pod_needs_any_more_is_not_waited_for() {
    let ns = "drain-orphan";
    // The reattach timeout the drain must not wait out.
    const REATTACH: Duration = Duration::from_secs(300);
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"volumeReattachTimeout": "5m"}))
        .start_as("drain-orphan")
        .await;
    let client = case.client();
    let node = running_machine(&client, ns, "o", ns).await;
    let pv = format!("{ns}-pv");
    claim_and_volume(&client, ns, &pv).await;
    // A pod no controller will recreate: once evicted, nothing needs the
    // claim (what a scaled-down StatefulSet leaves behind).
    create(
        Api::namespaced(client.clone(), ns),
        json::<Pod>(serde_json::json!({
            "metadata": {"name": "lonely"},
            "spec": {
                "nodeName": node,
                "terminationGracePeriodSeconds": 1,
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
                "containers": [{"name": "main", "image": "registry.invalid/app:1",
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]
            }
        })),
    )
    .await;
    wait::for_one(
        Api::<VolumeAttachment>::all(client.clone()),
        LONG,
        "the volume attached",
        |va| {
            va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
                && va.status.as_ref().is_some_and(|s| s.attached)
        },
    )
    .await
    .expect("the volume attaches");

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let started = std::time::Instant::now();
    machines
        .delete("o", &DeleteParams::default())
        .await
        .expect("delete");
    wait::for_none(machines, REATTACH / 2, "o gone", |m| m.name_any() == "o")
        .await
        .expect("the drain does not wait 5m for a reattach nobody needs");
    let took = started.elapsed();
    let evs = events(&client, ns, "o").await;
    let log = log_of(&evs);
    assert!(first(&evs, "VolumeDetached", &pv).is_some(), "{log}");
    assert!(first(&evs, "NoReplacement", &pv).is_some(), "{log}");
    assert!(
        first(&evs, "VolumeReattachTimeout", "").is_none(),
        "no reattach wait: {log}"
    );
    // Bounded by the timeout it must not wait out, not by how fast a
    // loaded machine drains: half of it.
    assert!(took < REATTACH / 2, "took {took:?}: {log}");
}

/// A claim and its CSI volume, for the tests that place pods by hand.
async fn claim_and_volume(client: &Client, ns: &str, pv: &str) {
    create(
        Api::all(client.clone()),
        csi_pv(pv, &format!("vol-{pv}"), ns, "data"),
    )
    .await;
    create(
        Api::namespaced(client.clone(), ns),
        json::<k8s_openapi::api::core::v1::PersistentVolumeClaim>(serde_json::json!({
            "metadata": {"name": "data"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}}
            }
        })),
    )
    .await;
}

/// A pod on `node` that mounts claim `data`, controlled by `owner`.
fn claim_user(name: &str, node: &str, owner: &ConfigMap) -> Pod {
    json(serde_json::json!({
        "metadata": {"name": name, "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": owner.name_any(),
            "uid": owner.uid().expect("created"), "controller": true
        }]},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 1,
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
            "containers": [{"name": "main", "image": "registry.invalid/app:1",
                "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]
        }
    }))
}

/// The volume of a claim (PV `<ns>-pv`) used by pod `first` on Node
/// `old`, once attached there. The pod's controller is played by the
/// test: a ConfigMap owns the pods (the garbage collector only needs the
/// owner to exist), and the test makes the replacement when it wants, as a
/// busy kube-controller-manager would. Returns the PV's name and the owner.
async fn first_claim_user(client: &Client, ns: &str, old: &str) -> (String, ConfigMap) {
    let pv = format!("{ns}-pv");
    claim_and_volume(client, ns, &pv).await;
    let owner = Api::<ConfigMap>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &json(serde_json::json!({"metadata": {"name": "controller"}})),
        )
        .await
        .expect("owner");
    create(
        Api::namespaced(client.clone(), ns),
        claim_user("first", old, &owner),
    )
    .await;
    wait::for_one(
        Api::<VolumeAttachment>::all(client.clone()),
        LONG,
        "attached to the old Node",
        |va| {
            va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
                && va.spec.node_name == old
                && va.status.as_ref().is_some_and(|s| s.attached)
        },
    )
    .await
    .expect("the volume attaches");
    (pv, owner)
}

/// By the audit log: Node `old` was deleted only after the attacher wrote
/// volume `pv` attached on Node `new`.
async fn node_went_after_attach(ns: &str, pv: &str, old: &str, new: &str, watches: &Watches) {
    let all = oracle::requests_once(BED.bed().await, ns, |rs| {
        rs.iter()
            .any(|r| r.verb == "delete" && r.resource == "nodes")
    })
    .await;
    let truth = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let node_deleted = all
        .iter()
        .find(|r| r.verb == "delete" && r.resource == "nodes" && r.name.as_deref() == Some(old))
        .map(|r| r.received)
        .unwrap_or_else(|| panic!("the old Node deleted: {truth}"));
    let attached_new = watches
        .attached_on(BED.bed().await, pv, new)
        .await
        .unwrap_or_else(|| panic!("attached on the new Node: {truth}"));
    assert!(
        attached_new < node_deleted,
        "the Node went only once the replacement had the volume: {truth}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controlled_pod_whose_replacement_comes_late_is_still_waited_for() {
    let ns = "drain-late";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start_as("drain-late")
        .await;
    let client = case.client();
    let old = running_machine(&client, ns, "old", ns).await;
    let new = running_machine(&client, ns, "new", ns).await;
    let (pv, owner) = first_claim_user(&client, ns, &old).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let vas = Api::<VolumeAttachment>::all(client.clone());

    let watches = Watches::start(&client, ns).await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("old", &DeleteParams::default())
        .await
        .expect("delete");
    let on_old = {
        let (pv, old) = (pv.clone(), old.clone());
        move |va: &VolumeAttachment| {
            va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
                && va.spec.node_name == old
        }
    };
    wait::for_none(vas.clone(), LONG, "detached from the old Node", on_old)
        .await
        .expect("the volume detaches");
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        machines.get_opt("old").await.expect("get").is_some(),
        "the Machine must wait for the replacement, not leave before it"
    );
    create(pods.clone(), claim_user("second", &new, &owner)).await;
    wait::for_none(machines, LONG, "old gone", |m| m.name_any() == "old")
        .await
        .expect("the drain ends once the volume attached on the new Node");
    node_went_after_attach(ns, &pv, &old, &new, &watches).await;
    // What operators are told.
    let evs = events(&client, ns, "old").await;
    let log = log_of(&evs);
    assert!(first(&evs, "NoReplacement", "").is_none(), "{log}");
    let attached = first(&evs, "VolumeAttached", &pv).expect("a VolumeAttached Event");
    assert!(attached.2.contains(&new), "{log}");
}

/// Class 7 of the drain's promises: a move resumed after a restart waits
/// for a replacement not created yet, as a first run does. The controller
/// (a real `berth run`) is killed (SIGKILL) once the volume detached from
/// the old Node; the replacement comes 4 s after the restart. By the audit
/// log the old Node is deleted only after the attacher wrote the volume
/// attached on the new Node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_that_comes_late_after_a_restart_is_still_waited_for() {
    let ns = "drain-late-restart";
    let flags = ["--namespace", ns, "--leader-elect=false"];
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .spawn(&flags)
        .await;
    let client = case.client();
    let old = running_machine(&client, ns, "old", ns).await;
    let new = running_machine(&client, ns, "new", ns).await;
    let (pv, owner) = first_claim_user(&client, ns, &old).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let vas = Api::<VolumeAttachment>::all(client.clone());
    let on = |node: String| {
        let pv = pv.clone();
        move |va: &VolumeAttachment| {
            va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
                && va.spec.node_name == node
        }
    };
    let watches = Watches::start(&client, ns).await;

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("old", &DeleteParams::default())
        .await
        .expect("delete");
    wait::for_none(
        vas.clone(),
        LONG,
        "detached from the old Node",
        on(old.clone()),
    )
    .await
    .expect("the volume detaches");
    case.kill().await;
    case.spawn(&flags).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    create(pods.clone(), claim_user("second", &new, &owner)).await;
    wait::for_none(machines, LONG, "old gone", |m| m.name_any() == "old")
        .await
        .expect("the resumed drain ends once the volume attached on the new Node");

    node_went_after_attach(ns, &pv, &old, &new, &watches).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_mid_drain_never_evicts_while_a_volume_is_detaching() {
    let ns = "drain-restart";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start_as("restart-1")
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    // Two replicas that take 6 s to stop: the first is still terminating
    // (its volume still attached) when the controller restarts.
    two_replicas_on(&client, ns, &node_a, 6).await;
    let watches = Watches::start(&client, ns).await;

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete a");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::for_one(pods.clone(), LONG, "db-0 evicted", |p| {
        p.name_any() == "db-0" && on_node(p, &node_a) && p.metadata.deletion_timestamp.is_some()
    })
    .await
    .expect("the first eviction");
    // Restart while db-0 terminates and its volume is attached to A.
    case.stop().await;
    case.start_as("restart-2").await;
    wait::for_none(machines, Duration::from_secs(180), "a gone", |m| {
        m.name_any() == "a"
    })
    .await
    .expect("the resumed drain completes");

    each_evicted_once_and_db_1_after_db_0_moved(&client, ns, &node_a, &watches).await;
}

/// A controller killed with SIGKILL at each point of a volume move (after
/// the eviction, after the pod is gone, after its volume detached) resumes
/// the move from `status.drain.moves`: no other stateful pod is evicted
/// before the first one's volume is attached where its replacement runs,
/// and the Machine goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_controller_resumes_a_volume_move_wherever_it_stopped() {
    let ns = "drain-killed";
    let flags = ["--namespace", ns, "--leader-elect=false"];
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .spawn(&flags)
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    // Two replicas that take 4 s to stop: time to kill the controller after
    // the eviction and before the pod is gone.
    two_replicas_on(&client, ns, &node_a, 4).await;
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    let watches = Watches::start(&client, ns).await;

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete a");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let old = wait::for_one(pods.clone(), LONG, "db-0 evicted", |p| {
        p.name_any() == "db-0" && on_node(p, &node_a) && p.metadata.deletion_timestamp.is_some()
    })
    .await
    .expect("the first eviction");
    let moves = machines
        .get("a")
        .await
        .expect("get a")
        .status
        .and_then(|s| s.drain)
        .map(|d| d.moves)
        .unwrap_or_default();
    assert_eq!(
        moves.iter().map(|m| m.pod.as_str()).collect::<Vec<_>>(),
        [format!("{ns}/db-0")],
        "the move is recorded before its eviction"
    );
    // 1. Killed right after the eviction.
    case.kill().await;
    case.spawn(&flags).await;
    // 2. Killed right after the pod is gone.
    let old_uid = old.metadata.uid.clone();
    wait::until(pods.clone(), LONG, "the old db-0 gone", |ps| {
        !ps.iter().any(|p| p.metadata.uid == old_uid)
    })
    .await
    .expect("db-0 goes");
    case.kill().await;
    case.spawn(&flags).await;
    // 3. Killed right after its volume detached from A.
    let pv0 = format!("{ns}-db-0");
    wait::until(vas, LONG, "db-0's volume detached from A", |all| {
        !all.iter().any(|va| {
            va.spec.node_name == node_a
                && va.spec.source.persistent_volume_name.as_deref() == Some(pv0.as_str())
        })
    })
    .await
    .expect("the volume detaches");
    case.kill().await;
    case.spawn(&flags).await;

    wait::for_none(machines, Duration::from_secs(180), "a gone", |m| {
        m.name_any() == "a"
    })
    .await
    .expect("the resumed drain completes");
    each_evicted_once_and_db_1_after_db_0_moved(&client, ns, &node_a, &watches).await;
}

/// StatefulSet `db`, 2 replicas with a PV each and grace period `grace`, on
/// the pool's Node `node`, their volumes attached; then a second Machine,
/// `b`, for them to move to.
async fn two_replicas_on(client: &Client, ns: &str, node: &str, grace: i64) {
    stateful(client, ns, "db", 2, |sts| {
        if let Some(spec) = sts.spec.template.spec.as_mut() {
            spec.termination_grace_period_seconds = Some(grace);
        }
    })
    .await;
    wait::until(
        Api::<VolumeAttachment>::all(client.clone()),
        LONG,
        "2 volumes attached",
        |all| {
            all.iter()
                .filter(|va| {
                    va.spec.node_name == node && va.status.as_ref().is_some_and(|s| s.attached)
                })
                .count()
                == 2
        },
    )
    .await
    .expect("the volumes attach");
    running_machine(client, ns, "b", ns).await;
}

/// By the audit log and the watches: db-0 and db-1 each evicted once (and
/// nothing else), and db-1's eviction received only after db-0's volume
/// was seen detached from A and its attach elsewhere was written. What
/// operators are told: a controller stopped while db-0's eviction was in
/// flight never announced it, and the resumed drain's `MoveResumed` then
/// stands for it.
async fn each_evicted_once_and_db_1_after_db_0_moved(
    client: &Client,
    ns: &str,
    node_a: &str,
    watches: &Watches,
) {
    let all = evictions(BED.bed().await, ns);
    let truth = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let db0 = accepted_evictions_of(&all, "db-0");
    let db1 = accepted_evictions_of(&all, "db-1");
    assert_eq!(db0.len(), 1, "db-0 evicted once: {truth}");
    assert_eq!(db1.len(), 1, "db-1 evicted once: {truth}");
    assert_eq!(
        all.iter().filter(|r| oracle::accepted(r)).count(),
        2,
        "no other eviction: {truth}"
    );
    let pv0 = format!("{ns}-db-0");
    let detached = watches
        .detached_from(&pv0, node_a)
        .unwrap_or_else(|| panic!("db-0's volume detached from A: {truth}"));
    let attached = watches
        .attached_elsewhere(BED.bed().await, &pv0, node_a)
        .await
        .unwrap_or_else(|| panic!("db-0's volume attached elsewhere: {truth}"));
    assert!(
        detached < db1[0].received && attached < db1[0].received,
        "db-1 waited for db-0's volume to detach and attach elsewhere: {truth}"
    );
    let evs = events(client, ns, "a").await;
    let log = log_of(&evs);
    let told = |pod: &str| {
        let note = format!("evicted pod {ns}/{pod}");
        evs.iter()
            .filter(|(_, r, n)| r == "Evicted" && *n == note)
            .count()
    };
    assert_eq!(told("db-1"), 1, "db-1's eviction told once: {log}");
    let resumed = first(&evs, "MoveResumed", &format!("pod {ns}/db-0's"));
    assert!(
        told("db-0") == 1 || resumed.is_some(),
        "db-0's eviction is on record, as Evicted or as the move resumed: {log}"
    );
}

/// A replacement the scheduler cannot place is reported at once, with the
/// scheduler's own message, not after the reattach timeout; no second pod
/// of its workload is evicted until it is placed, and other workloads are
/// not held up by it. The only other Node of the pool passes berth's
/// destination check but runs a pod db's pods may not run beside (a pod
/// anti-affinity, which berth does not read): the scheduler refuses db-0's
/// replacement there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_that_cannot_be_placed_holds_back_its_workload_only() {
    let ns = "drain-unplaced";
    // The reattach timeout the report must come well before.
    const REATTACH: Duration = Duration::from_secs(300);
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m", "volumeReattachTimeout": "5m"}))
        .start_as("drain-unplaced")
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    support::pool::stateful(&client, ns, "db", 2, |sts| {
        if let Some(spec) = sts.spec.template.spec.as_mut() {
            support::pool::shuns_blocker(spec);
        }
    })
    .await;
    stateful_in_pool(&client, ns, "solo", 1, None).await;
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    wait::until(vas, LONG, "3 volumes attached to A", |all| {
        all.iter()
            .filter(|va| {
                va.spec.node_name == node_a && va.status.as_ref().is_some_and(|s| s.attached)
            })
            .count()
            == 3
    })
    .await
    .expect("the volumes attach");

    // No other Node in the pool db's replacement can be placed on.
    support::pool::refusing_spare(&client, ns, "spare", ns).await;
    let watches = Watches::start(&client, ns).await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let started = std::time::Instant::now();
    machines
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete a");
    let m = wait::for_one(
        machines.clone(),
        REATTACH / 2,
        "the replacement reported",
        |m| {
            m.name_any() == "a"
                && m.status
                    .as_ref()
                    .and_then(|s| s.drain.as_ref())
                    .and_then(|d| d.blocked_by.as_deref())
                    .is_some_and(|b| b.contains("cannot be scheduled"))
        },
    )
    .await
    .expect("reported while the reattach timeout (5m) is far");
    let took = started.elapsed();
    assert!(took < REATTACH / 2, "reported after {took:?}");
    let blocked = m
        .status
        .as_ref()
        .and_then(|s| s.drain.as_ref())
        .and_then(|d| d.blocked_by.clone())
        .unwrap_or_default();
    assert!(
        blocked.contains("nodes are available") && blocked.contains("StatefulSet/"),
        "the scheduler's message and the workload held back: {blocked}"
    );
    // The other workload is not held up by it.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::until(pods.clone(), LONG, "solo-0 evicted from A", |ps| {
        !ps.iter()
            .any(|p| p.name_any() == "solo-0" && on_node(p, &node_a))
    })
    .await
    .expect("solo-0 is evicted although db is held back");
    let on_a: Vec<String> = pods
        .list(&Default::default())
        .await
        .expect("list pods")
        .iter()
        .filter(|p| on_node(p, &node_a) && p.metadata.deletion_timestamp.is_none())
        .map(|p| p.name_any())
        .collect();
    assert_eq!(
        on_a,
        ["db-1"],
        "db's second pod stays while db-0's replacement cannot be placed"
    );

    // A Node for the replacements: they land, and the drain completes.
    running_machine(&client, ns, "b", ns).await;
    wait::for_none(machines, Duration::from_secs(180), "a gone", |m| {
        m.name_any() == "a"
    })
    .await
    .expect("the drain completes once the replacements are placed");
    // By the audit log: db-1 evicted once, after the attacher wrote db-0's
    // volume attached on B, where its replacement runs.
    let all = evictions(BED.bed().await, ns);
    let truth = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let next = accepted_evictions_of(&all, "db-1");
    assert_eq!(next.len(), 1, "{truth}");
    watches
        .assert_after_moved(
            BED.bed().await,
            next[0],
            &format!("{ns}-db-0"),
            &node_a,
            &truth,
        )
        .await;
    // What operators are told.
    let evs = events(&client, ns, "a").await;
    assert!(
        first(&evs, "ReplacementUnschedulable", &format!("{ns}/db-0")).is_some(),
        "{}",
        log_of(&evs)
    );
}

/// A replacement that tolerates the cordon and is scheduled back onto the
/// draining Node is reported once and not evicted again: no eviction loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_scheduled_back_onto_the_draining_node_is_not_evicted_in_a_loop() {
    let ns = "drain-back";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start_as("drain-back")
        .await;
    let client = case.client();
    let node = running_machine(&client, ns, "a", ns).await;
    create(
        Api::namespaced(client.clone(), ns),
        json::<Deployment>(serde_json::json!({
            "metadata": {"name": "sticky"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "sticky"}},
                "template": {
                    "metadata": {"labels": {"app": "sticky"}},
                    "spec": {
                        "nodeSelector": {POOL: ns},
                        "tolerations": [{"operator": "Exists"}],
                        // Long enough for the replacement to be scheduled
                        // back before the evicted pod is gone.
                        "terminationGracePeriodSeconds": 5,
                        "containers": [{"name": "main", "image": "registry.invalid/sticky:1"}]
                    }
                }
            }
        })),
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::until(pods.clone(), LONG, "sticky running on a", |ps| {
        ps.iter()
            .any(|p| p.name_any().starts_with("sticky-") && on_node(p, &node) && pod_running(p))
    })
    .await
    .expect("the pod runs");

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete a");
    wait::for_none(machines, Duration::from_secs(120), "a gone", |m| {
        m.name_any() == "a"
    })
    .await
    .expect("the drain ends although the pod came back");
    let evs = events(&client, ns, "a").await;
    let log = log_of(&evs);
    let evicted = evs
        .iter()
        .filter(|(_, r, n)| r == "Evicted" && n.contains("sticky-"))
        .count();
    assert_eq!(evicted, 1, "evicted once: {log}");
    let returned: Vec<_> = evs.iter().filter(|(_, r, _)| r == "PodReturned").collect();
    assert_eq!(returned.len(), 1, "reported once: {log}");
    assert!(returned[0].2.contains("tolerates the cordon"), "{log}");
}

/// A Machine whose class is gone still drains with its own settings: its
/// `forceAfterDeadline: false` holds (the drain fails at the deadline, it
/// does not force), and the DrainSettings condition and a Warning say what
/// the drain uses instead of the class.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_whose_class_is_gone_keeps_its_own_drain_settings() {
    let ns = "drain-noclass";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start_as("drain-noclass")
        .await;
    let client = case.client();
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let mut m = machine("k", ns);
    m.spec.drain = Some(json(
        serde_json::json!({"timeout": "6s", "forceAfterDeadline": false}),
    ));
    machines
        .create(&PostParams::default(), &m)
        .await
        .expect("create machine");
    wait::for_one(machines.clone(), LONG, "k Running", |m| {
        m.name_any() == "k" && phase(m) == Some("Running")
    })
    .await
    .expect("the Machine runs");
    let node = FakeProvider::node_name(ns, "k");
    guarded_pod(&client, ns, &node).await;

    let classes: Api<berth::api::MachineClass> = Api::all(client.clone());
    classes
        .delete(ns, &DeleteParams::default())
        .await
        .expect("delete the class");
    wait::for_none(classes, LONG, "the class gone", |c| c.name_any() == ns)
        .await
        .expect("the class goes");
    machines
        .delete("k", &DeleteParams::default())
        .await
        .expect("delete k");
    let m = wait::for_one(machines.clone(), LONG, "the drain failed", |m| {
        m.name_any() == "k"
            && support::condition(m, "Drained").is_some_and(|c| c.reason == "DrainFailed")
    })
    .await
    .expect("the Machine's own forceAfterDeadline=false holds");
    let settings = support::condition(&m, "DrainSettings").expect("DrainSettings condition");
    assert_eq!(
        (settings.status.as_str(), settings.reason.as_str()),
        ("False", "ClassNotFound"),
        "{settings:?}"
    );
    assert!(
        settings.message.contains("forceAfterDeadline false")
            && settings.message.contains("timeout 6s"),
        "{}",
        settings.message
    );
    // `berth plan` plans with the settings the drain uses, says why, and
    // shows where the drain stands.
    let live = berth::cli::plan::plan_machine(&client, ns, "k")
        .await
        .expect("a plan without the class");
    let notes = live.notes();
    assert!(
        notes.contains("not found: the drain uses the Machine's own spec.drain"),
        "{notes}"
    );
    assert!(
        notes.contains("Drain started at") || notes.contains("Drain in progress since"),
        "{notes}"
    );
    assert!(
        Api::<Pod>::namespaced(client.clone(), ns)
            .get_opt("guarded")
            .await
            .expect("get pod")
            .is_some(),
        "the pod was not forced"
    );
    let warned = support::events_until(&client, ns, "k", &["DrainSettingsFromMachine"]).await;
    assert!(
        warned
            .iter()
            .any(|e| e.reason.as_deref() == Some("DrainSettingsFromMachine")),
        "a Warning says so"
    );

    // The class back and the budget gone, the deletion completes.
    pool_class(&client, ns, serde_json::json!({"timeout": "10m"})).await;
    Api::<PodDisruptionBudget>::namespaced(client.clone(), ns)
        .delete("guard", &DeleteParams::default())
        .await
        .expect("delete pdb");
    wait::for_none(machines, Duration::from_secs(120), "k gone", |m| {
        m.name_any() == "k"
    })
    .await
    .expect("the deletion completes");
}

/// The Node object deleted by hand while its VM runs: the deletion still
/// drains the pods (found by spec.nodeName), says the Node object is gone,
/// and deletes the VM only after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_whose_node_object_is_gone_is_still_drained_before_its_vm_goes() {
    let ns = "drain-nodegone";
    let (_case, client, node) = machine_a_with_app(ns).await;

    delete_node(&client, &node).await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete a");
    // kwok stops running the pods of a Node whose object is gone, so the
    // evicted pod is removed by the pod garbage collector's orphan sweep
    // (40 s quarantine, then its next round), where a real kubelet would
    // have confirmed it within its grace period.
    wait::for_none(machines, Duration::from_secs(180), "a gone", |m| {
        m.name_any() == "a"
    })
    .await
    .expect("the deletion completes");
    // By the audit log: the pod was evicted once, and the VM (the fake
    // provider's ConfigMap) deleted only after that.
    let is_vm_delete = |r: &berth_devkit::bench::audit::Request| {
        r.verb == "delete" && r.resource == "configmaps" && r.name.as_deref() == Some("fake-vm-a")
    };
    let all = oracle::requests_once(BED.bed().await, ns, |rs| rs.iter().any(is_vm_delete)).await;
    let truth = oracle::log_of(&all);
    let evicted = accepted_evictions_of(&all, "app");
    assert_eq!(evicted.len(), 1, "{truth}");
    let vm = all
        .iter()
        .find(|r| is_vm_delete(r))
        .unwrap_or_else(|| panic!("the VM deleted: {truth}"));
    assert!(
        evicted[0].received < vm.received,
        "drained, then the VM: {truth}"
    );
    // What operators are told: the Node's absence, before the drain.
    let evs = events(&client, ns, "a").await;
    let log = log_of(&evs);
    let gone = first(&evs, "NodeGone", &node).unwrap_or_else(|| panic!("{log}"));
    let told = first(&evs, "Evicted", &format!("{ns}/app")).unwrap_or_else(|| panic!("{log}"));
    assert!(gone.0 <= told.0, "said, then drained: {log}");
}

/// A volume still attached when the VM goes (here a DaemonSet's pod keeps
/// it: the drain leaves DaemonSet pods to the VM's end) is named before the
/// VM is deleted: a Warning, `VolumesDetached=False` naming it, and
/// `berth_volumes_left_attached_total`. Once the VM is gone, the Node is
/// tainted out of service, the attach-detach controller releases the
/// volume, and only then is the Node deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_left_attached_at_vm_deletion_is_named_and_released_out_of_service() {
    let ns = "drain-left";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m", "volumeDetachTimeout": "3s"}))
        .start_as("left")
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    let pv = format!("{ns}-data");
    claim_and_volume(&client, ns, &pv).await;
    create(
        Api::namespaced(client.clone(), ns),
        json::<DaemonSet>(serde_json::json!({
            "metadata": {"name": "keeper"},
            "spec": {
                "selector": {"matchLabels": {"app": "keeper"}},
                "template": {
                    "metadata": {"labels": {"app": "keeper"}},
                    "spec": {
                        "nodeSelector": {POOL: ns},
                        "terminationGracePeriodSeconds": 1,
                        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
                        "containers": [{"name": "main", "image": "registry.invalid/app:1",
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]
                    }
                }
            }
        })),
    )
    .await;
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    let on_a = |va: &VolumeAttachment| {
        va.spec.node_name == node_a && va.spec.source.persistent_volume_name.as_deref() == Some(&pv)
    };
    wait::for_one(vas.clone(), LONG, "the keeper's volume attached", |va| {
        on_a(va) && va.status.as_ref().is_some_and(|s| s.attached)
    })
    .await
    .expect("the volume attaches");

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete a");
    // Named before the VM goes.
    wait::for_one(
        machines.clone(),
        LONG,
        "VolumesDetached names the PV",
        |m| {
            m.status.as_ref().is_some_and(|s| {
                s.conditions.iter().any(|c| {
                    c.type_ == "VolumesDetached"
                        && c.status == "False"
                        && ["VolumesLeftAttached", "ReleasingVolumes"].contains(&c.reason.as_str())
                        && c.message.contains(&pv)
                })
            })
        },
    )
    .await
    .expect("the condition");
    // Once the VM is gone, the Node is declared out of service.
    let nodes: Api<Node> = Api::all(client.clone());
    wait::for_one(nodes, LONG, "Node a tainted out of service", |n| {
        n.name_any() == node_a
            && n.spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|ts| {
                    ts.iter().any(|t| {
                        t.key == "node.kubernetes.io/out-of-service" && t.effect == "NoExecute"
                    })
                })
    })
    .await
    .expect("the out-of-service taint");
    // The attach-detach controller lets the volume go well inside its own
    // 6-minute force-detach wait, and the Machine goes after.
    wait::until(
        vas,
        Duration::from_secs(120),
        "the volume released",
        |all| !all.iter().any(|va| on_a(va)),
    )
    .await
    .expect("the VolumeAttachment goes");
    wait::for_none(machines, LONG, "a gone", |m| m.name_any() == "a")
        .await
        .expect("the Machine goes");
    let evs: Vec<_> =
        support::reason_notes(&support::events_until(&client, ns, "a", &["VolumesReleased"]).await);
    let left: Vec<_> = evs
        .iter()
        .filter(|(r, _)| r == "VolumesLeftAttached")
        .collect();
    assert_eq!(left.len(), 1, "one Warning: {evs:?}");
    assert!(
        left[0].1.contains(&pv) && left[0].1.contains("volumeDetachTimeout"),
        "{evs:?}"
    );
    assert_eq!(
        case.running().metrics().volumes_left_attached.get(),
        1,
        "the volume counted once"
    );
}

/// A Machine whose Node object *and* VM are both gone (berth deleted them
/// and was stopped before it let the Machine go, or someone did by hand)
/// has nothing to drain: its deletion evicts nothing left bound to the old
/// Node's name and lets the Machine go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_whose_node_and_vm_are_both_gone_goes_without_a_drain() {
    let ns = "drain-allgone";
    let (_case, client, node) = machine_a_with_app(ns).await;
    // The fake provider's VM is a ConfigMap: both go, by hand.
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .delete("fake-vm-a", &DeleteParams::default())
        .await
        .expect("delete the VM");
    delete_node(&client, &node).await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete a");
    wait::for_none(machines, LONG, "a gone", |m| m.name_any() == "a")
        .await
        .expect("the Machine goes");
    let evs: Vec<String> = support::events_until(&client, ns, "a", &["DeleteVmAndNode"])
        .await
        .iter()
        .filter_map(|e| e.reason.clone())
        .collect();
    assert!(
        !evs.iter()
            .any(|r| r == "NodeGone" || r == "Evicted" || r == "Drain"),
        "no drain: {evs:?}"
    );
    let touched: Vec<String> = support::audit::requests(BED.bed().await, ns)
        .iter()
        .filter(|r| r.resource == "pods")
        .map(|r| r.kind())
        .collect();
    assert!(touched.is_empty(), "berth left the pods alone: {touched:?}");
}

/// A case of its own in `ns`: its pool class, the controller, Machine `a`
/// running with a bare pod `app` on its Node; the Node's name.
async fn machine_a_with_app(ns: &str) -> (Case, Client, String) {
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start()
        .await;
    let client = case.client();
    let node = running_machine(&client, ns, "a", ns).await;
    app_running_on(&client, ns, &node).await;
    (case, client, node)
}

/// A bare pod `app` on `node`, Running.
async fn app_running_on(client: &Client, ns: &str, node: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    create(
        pods.clone(),
        json::<Pod>(serde_json::json!({
            "metadata": {"name": "app"},
            "spec": {
                "nodeName": node,
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": "registry.invalid/app:1"}]
            }
        })),
    )
    .await;
    wait::for_one(pods.clone(), LONG, "app running", |p| {
        p.name_any() == "app" && pod_running(p)
    })
    .await
    .expect("the pod runs");
}

/// The Machine's Node goes and another VM's Node takes its name (a reused
/// IP or hostname: same name, another providerID), with a pod of its own:
/// deleting the Machine leaves that Node and its pod alone (no write to
/// the Node, no eviction or deletion of the pod, by the audit log; the
/// Node is still there with its own UID), and the Machine goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_took_the_name_of_the_machines_node_is_left_alone() {
    let ns = "drain-renamed";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start_as("drain-renamed")
        .await;
    let client = case.client();
    let node = running_machine(&client, ns, "a", ns).await;
    let nodes: Api<Node> = Api::all(client.clone());
    let mut other = nodes.get(&node).await.expect("the Machine's Node");
    delete_node(&client, &node).await;
    other.metadata = kube::api::ObjectMeta {
        name: other.metadata.name.clone(),
        labels: other.metadata.labels.clone(),
        annotations: other.metadata.annotations.clone(),
        ..Default::default()
    };
    other.status = None;
    if let Some(spec) = other.spec.as_mut() {
        spec.provider_id = Some(format!("fake:///{ns}/another-vm"));
        spec.taints = None;
        spec.unschedulable = None;
    }
    let other = nodes
        .create(&PostParams::default(), &other)
        .await
        .expect("another VM's Node takes the name");
    app_running_on(&client, ns, &node).await;
    let since = k8s_openapi::jiff::Timestamp::now();

    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", LONG).await;
    let touched = writes_since(ns, since, &node, &["pods"]).await;
    assert!(
        touched.is_empty(),
        "berth left the other Node and its pod alone: {touched:?}"
    );
    let now = nodes
        .get(&node)
        .await
        .expect("the other Node is still there");
    assert_eq!(now.metadata.uid, other.metadata.uid);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let app = pods.get("app").await.expect("its pod");
    assert!(app.metadata.deletion_timestamp.is_none());
    // The clean-up below is not the case's work.
    case.assert_no_request_loop();
    nodes
        .delete(&node, &DeleteParams::default())
        .await
        .expect("clean up the other Node");
}

/// A Machine created with the providerID of another Machine's VM (written
/// by hand: berth never requested a VM for it) runs on that Node, but
/// deleting it never cordons, drains or deletes that Node, nor deletes the
/// VM: the VM says it was made for the other Machine. By the audit log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_pointing_at_another_machines_vm_leaves_it_alone() {
    let ns = "drain-foreign";
    let (_case, client, node) = machine_a_with_app(ns).await;
    let mut b = support::machine("b", ns);
    b.spec.provider_id = Some(format!("fake:///{ns}/a"));
    support::pool::running(&client, ns, b).await;
    let since = k8s_openapi::jiff::Timestamp::now();

    delete_machine(&client, ns, "b").await;
    gone(&client, ns, "b", LONG).await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let touched = writes_since(ns, since, &node, &["pods", "configmaps"]).await;
    assert!(
        touched.is_empty(),
        "a's Node, pod and VM left alone: {touched:?}"
    );
    let a = machines.get("a").await.expect("a");
    assert!(a.metadata.deletion_timestamp.is_none());
    assert_eq!(support::phase(&a), Some("Running"));
}

/// A Machine whose providerID was written by hand, deleted while its class
/// cannot be resolved: whose VM that is cannot be asked, so the deletion
/// touches no Node, pod or VM and says why. Once the class is back the
/// provider says the VM is another Machine's, and the Machine goes leaving
/// it alone. By the audit log: no write to that Node or its pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_whose_vm_cannot_be_asked_about_touches_nothing_until_it_can() {
    let ns = "drain-owner-unknown";
    let (_case, client, node) = machine_a_with_app(ns).await;
    let own = format!("{ns}-b");
    let class = || berth_devkit::testbed::fixtures::pool_class(&own, ns, serde_json::json!({}));
    let classes: Api<berth::api::MachineClass> = Api::all(client.clone());
    create(classes.clone(), class()).await;
    let mut b = support::machine("b", &own);
    b.spec.provider_id = Some(format!("fake:///{ns}/a"));
    support::pool::running(&client, ns, b).await;
    classes
        .delete(&own, &DeleteParams::default())
        .await
        .expect("delete b's class");
    wait::for_none(classes.clone(), LONG, "b's class gone", |c| {
        c.name_any() == own
    })
    .await
    .expect("the class goes");
    let since = k8s_openapi::jiff::Timestamp::now();

    delete_machine(&client, ns, "b").await;
    let held = support::wait_machine(&client, ns, "b", "held: owner unknown", |m| {
        support::last_operation_step(m) == Some("VmOwnerUnknown")
    })
    .await;
    let said = support::last_operation(&held);
    assert!(said.contains("ClassNotFound"), "{said}");
    create(classes, class()).await;
    gone(&client, ns, "b", LONG).await;
    let touched = writes_since(ns, since, &node, &["pods", "configmaps"]).await;
    assert!(
        touched.is_empty(),
        "a's Node, pod and VM left alone: {touched:?}"
    );
    let a = Api::<Machine>::namespaced(client.clone(), ns)
        .get("a")
        .await
        .expect("a");
    assert_eq!(support::phase(&a), Some("Running"));
}

/// The controller's writes in `ns` received after `since` to Node `node`
/// or to objects of `resources`, as `verb resource name`.
async fn writes_since(
    ns: &str,
    since: k8s_openapi::jiff::Timestamp,
    node: &str,
    resources: &[&str],
) -> Vec<String> {
    support::audit::requests(BED.bed().await, ns)
        .iter()
        .filter(|r| r.received > since && r.is_write())
        .filter(|r| {
            (r.resource == "nodes" && r.name.as_deref() == Some(node))
                || resources.contains(&r.resource.as_str())
        })
        .map(|r| format!("{} {:?}", r.kind(), r.name))
        .collect()
}

/// Deletes the Node object `node` by hand and waits until it is gone.
async fn delete_node(client: &Client, node: &str) {
    Api::<Node>::all(client.clone())
        .delete(node, &DeleteParams::default())
        .await
        .expect("delete the Node object");
    wait::for_none(
        Api::<Node>::all(client.clone()),
        LONG,
        "the Node gone",
        |n| n.name_any() == node,
    )
    .await
    .expect("the Node object goes");
}
