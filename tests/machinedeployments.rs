//! MachineDeployments end to end: real kube-apiserver, controller-manager
//! (StatefulSet, PV, attach-detach and garbage collector controllers),
//! scheduler and kwok with simulated CSI attach and detach delays, Machines
//! of the fake provider. The pace of a rollout and the moves of its pods are
//! read from a timeline that watches record while it runs
//! (`berth_devkit::testbed::timeline`), the reasons from the Events berth recorded.

mod support;

use berth_devkit::testbed::fixtures::{machine_deployment, rolling};

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use berth::api::{
    Machine, MachineClass, MachineDeployment, MachineDeploymentStatus, MachineSet,
    ROLLOUT_TAINT_KEY, SUPERSEDED_ANNOTATION, TEMPLATE_HASH_LABEL,
};
use berth::providers::fake::FakeProvider;
use berth_devkit::testbed::timeline::{Pace, Seen, Timeline, log_of};
use berth_devkit::testbed::wait;
use k8s_openapi::api::autoscaling::v1::Scale;
use k8s_openapi::api::core::v1::{Node, Pod, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use support::pool::{
    Bed, POOL, assert_scale_down_reasons, create, gone, json, mark_for_scale_down, pod_running,
    stateful_in_pool,
};
use support::{Case, LONG, condition, events_of, notes, phase};

const ATTACH: Duration = Duration::from_millis(500);
const DETACH: Duration = Duration::from_millis(500);
const BED: Bed = Bed {
    attach: ATTACH,
    detach: DETACH,
};
/// How long a test watches for something that must not happen.
const QUIET: Duration = Duration::from_secs(5);

fn deployments(client: &Client, ns: &str) -> Api<MachineDeployment> {
    Api::namespaced(client.clone(), ns)
}

/// A fake class `name` whose Nodes join pool `pool`, with more of the fake
/// driver's `providerSpec` (`deleteDelay`, or a field it refuses).
async fn class_in_pool(client: &Client, name: &str, pool: &str, more: serde_json::Value) {
    let mut provider_spec = serde_json::json!({"nodeLabels": {POOL: pool}});
    if let (Some(spec), Some(more)) = (provider_spec.as_object_mut(), more.as_object()) {
        spec.extend(more.clone());
    }
    let mut c = support::class(name, "fake", provider_spec);
    c.spec.drain = Some(json(serde_json::json!({"timeout": "5m"})));
    create(Api::all(client.clone()), c).await;
}

fn progressing(d: &MachineDeployment) -> Option<&Condition> {
    condition(d, "Progressing")
}

/// Waits until the deployment's status describes its current generation
/// and `f` holds of it.
async fn status_until(
    client: &Client,
    ns: &str,
    name: &str,
    what: &str,
    f: impl Fn(&MachineDeployment, &MachineDeploymentStatus) -> bool,
) -> MachineDeployment {
    let d = wait::for_one(
        deployments(client, ns),
        LONG,
        &format!("{name}: {what}"),
        |d| {
            d.name_any() == name
                && d.status
                    .as_ref()
                    .is_some_and(|s| s.observed_generation == d.metadata.generation && f(d, s))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    (*d).clone()
}

/// Waits for Progressing to have `reason`, with `updated` Machines of the
/// current template.
async fn rollout_is(
    client: &Client,
    ns: &str,
    name: &str,
    reason: &str,
    updated: i32,
) -> MachineDeployment {
    status_until(
        client,
        ns,
        name,
        &format!("Progressing {reason}, {updated} updated"),
        |d, s| s.updated_replicas == updated && progressing(d).is_some_and(|c| c.reason == reason),
    )
    .await
}

fn hash(d: &MachineDeployment) -> String {
    d.status
        .as_ref()
        .and_then(|s| s.template_hash.clone())
        .expect("the status names the template's hash")
}

/// Waits until the Machines of template `hash` that are not being deleted
/// are `n`, all Running; returns them by name.
async fn running_of(client: &Client, ns: &str, hash: &str, n: usize) -> Vec<Machine> {
    let of = |m: &Machine| {
        m.labels().get(TEMPLATE_HASH_LABEL).map(String::as_str) == Some(hash)
            && m.metadata.deletion_timestamp.is_none()
    };
    let all = wait::until(
        Api::<Machine>::namespaced(client.clone(), ns),
        LONG,
        &format!("{n} Machines of template {hash} Running"),
        |ms| {
            let live: Vec<_> = ms.iter().filter(|m| of(m)).collect();
            live.len() == n && live.iter().all(|m| phase(m) == Some("Running"))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut ms: Vec<Machine> = all
        .iter()
        .filter(|m| of(m))
        .map(|m| (**m).clone())
        .collect();
    ms.sort_by_key(|m| m.name_any());
    ms
}

fn nodes_of(ns: &str, machines: &[Machine]) -> BTreeSet<String> {
    machines
        .iter()
        .map(|m| FakeProvider::node_name(ns, &m.name_any()))
        .collect()
}

/// Waits until each of the pods `names` runs on one of `nodes`.
async fn pods_running_on(client: &Client, ns: &str, names: &[String], nodes: &BTreeSet<String>) {
    wait::until(
        Api::<Pod>::namespaced(client.clone(), ns),
        LONG,
        &format!("pods {names:?} Running on {nodes:?}"),
        |ps| {
            names.iter().all(|n| {
                ps.iter().any(|p| {
                    p.name_any() == *n
                        && p.metadata.deletion_timestamp.is_none()
                        && pod_running(p)
                        && p.spec
                            .as_ref()
                            .and_then(|s| s.node_name.as_ref())
                            .is_some_and(|node| nodes.contains(node))
                })
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Each pod of `names` had exactly two incarnations: one on an old Node,
/// then one on a new Node.
fn assert_moved_once(
    timeline: &Timeline,
    names: &[String],
    old_nodes: &BTreeSet<String>,
    new_nodes: &BTreeSet<String>,
) {
    let lives = timeline.incarnations();
    let report = format!("{lives:#?}\nold Nodes {old_nodes:?}\nnew Nodes {new_nodes:?}");
    for name in names {
        let l = lives
            .get(name)
            .unwrap_or_else(|| panic!("{name} never seen:\n{report}"));
        assert_eq!(l.len(), 2, "{name} moved exactly once:\n{report}");
        assert!(
            old_nodes.contains(&l[0].1) && new_nodes.contains(&l[1].1),
            "{name} moved from an old Node to a new one:\n{report}"
        );
    }
}

/// Patches `spec` of deployment `name` (a merge patch).
async fn patch_spec(client: &Client, ns: &str, name: &str, spec: serde_json::Value) {
    deployments(client, ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": spec })),
        )
        .await
        .unwrap_or_else(|e| panic!("patch {name}: {e}"));
}

fn image(v: &str) -> serde_json::Value {
    serde_json::json!({"template": {"metadata": {"annotations": {"image": v}}}})
}

/// Waits until the pool's status says it is paused (`Progressing`
/// Unknown, `Paused`): the reconcile that saw the pause is over.
async fn paused(client: &Client, ns: &str) -> MachineDeployment {
    status_until(client, ns, "pool", "Progressing Unknown, Paused", |d, _| {
        progressing(d).is_some_and(|c| c.status == "Unknown" && c.reason == "Paused")
    })
    .await
}

/// The pace of a pool of two rolled one Machine at a time.
const TWO_ONE_AT_A_TIME: Pace = Pace {
    replicas: 2,
    surge: 1,
    drains_at_once: 1,
};

/// A MachineDeployment `pool` of two Machines with `strategy`, rolled out:
/// its template's hash and Machines, and a timeline started after.
async fn pool_of_two(
    client: &Client,
    ns: &str,
    strategy: serde_json::Value,
) -> (String, Vec<Machine>, Timeline) {
    deployments(client, ns)
        .create(
            &PostParams::default(),
            &machine_deployment("pool", ns, 2, "md", strategy),
        )
        .await
        .expect("create the MachineDeployment");
    let d = rollout_is(client, ns, "pool", "RolloutComplete", 2).await;
    let first_hash = hash(&d);
    let old = running_of(client, ns, &first_hash, 2).await;
    let timeline = Timeline::start(client, ns)
        .await
        .expect("the timeline records");
    (first_hash, old, timeline)
}

/// Points the pool's template at the class `name`.
async fn use_class(client: &Client, ns: &str, name: &str) {
    patch_spec(
        client,
        ns,
        "pool",
        serde_json::json!({"template": {"spec": {"classRef": {"name": name}}}}),
    )
    .await;
}

/// The apiserver refuses what CEL checks of a strategy: a `maxSurge` or
/// `maxUnavailable` that is not a non-negative integer or a percentage,
/// both zero, `rollingUpdate` with `OnDelete`; and takes a percentage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_apiserver_refuses_an_invalid_strategy() {
    let ns = "mdep-invalid";
    let case = Case::builder(ns).on(BED).build().await;
    let client = case.client();
    let api = deployments(&client, ns);
    let not_a_number = "must be a non-negative integer or a percentage";
    let cases = [
        ("abc", rolling("abc".into(), 0.into()), not_a_number),
        ("negative", rolling((-1).into(), 0.into()), not_a_number),
        (
            "negative-unavailable",
            rolling(1.into(), (-2).into()),
            not_a_number,
        ),
        ("fraction", rolling("1.5%".into(), 0.into()), not_a_number),
        (
            "over-everything",
            rolling(1.into(), "150%".into()),
            "must be a non-negative integer or a percentage from 0% to 100%",
        ),
        (
            "both-zero",
            rolling(0.into(), 0.into()),
            "maxSurge and maxUnavailable must not both be zero",
        ),
        (
            "both-zero-percent",
            rolling("0%".into(), 0.into()),
            "maxSurge and maxUnavailable must not both be zero",
        ),
        (
            "on-delete",
            serde_json::json!({"type": "OnDelete", "rollingUpdate": {"maxSurge": 1}}),
            "rollingUpdate is only allowed with type RollingUpdate",
        ),
    ];
    for (name, strategy, message) in cases {
        let err = api
            .create(
                &PostParams::default(),
                &machine_deployment(name, "c", 1, "md", strategy.clone()),
            )
            .await
            .expect_err(&format!("{name} ({strategy}) is refused"));
        assert!(err.to_string().contains(message), "{name}: {err}");
    }
    // A percentage, an integer, and OnDelete without rollingUpdate are taken.
    let quarter = api
        .create(
            &PostParams::default(),
            &machine_deployment("quarter", "c", 4, "md", rolling("25%".into(), 1.into())),
        )
        .await
        .expect("25% is taken");
    api.create(
        &PostParams::default(),
        &machine_deployment(
            "all-at-once",
            "c",
            4,
            "md",
            rolling(1.into(), "100%".into()),
        ),
    )
    .await
    .expect("maxUnavailable 100% is taken");
    let r = quarter
        .spec
        .strategy
        .rolling_update
        .as_ref()
        .expect("rollingUpdate");
    assert_eq!(serde_json::to_value(&r.max_surge).ok(), Some("25%".into()));
    api.create(
        &PostParams::default(),
        &machine_deployment(
            "on-delete-ok",
            "c",
            1,
            "md",
            serde_json::json!({"type": "OnDelete"}),
        ),
    )
    .await
    .expect("OnDelete without rollingUpdate is taken");
    // The same rules hold for an update.
    let err = api
        .patch(
            "quarter",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"strategy": {"rollingUpdate": {"maxUnavailable": "x"}}}})),
        )
        .await
        .expect_err("an update to an invalid maxUnavailable is refused");
    assert!(err.to_string().contains(not_a_number), "{err}");
}

/// Four Machines carrying two StatefulSets with a volume per replica roll
/// to a new template one Machine at a time: a new Machine Running with its
/// Node Ready before each old one goes, one old Machine drained at a time,
/// the old Nodes tainted so that each stateful pod moves once, to a new
/// Machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_moves_each_stateful_pod_once_at_the_pace_of_its_strategy() {
    let ns = "mdep-stateful";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    deployments(&client, ns)
        .create(
            &PostParams::default(),
            &machine_deployment("pool", ns, 4, "md", rolling(1.into(), 0.into())),
        )
        .await
        .expect("create the MachineDeployment");
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 4).await;
    let old_hash = hash(&d);
    let old = running_of(&client, ns, &old_hash, 4).await;
    let old_nodes = nodes_of(ns, &old);
    stateful_in_pool(&client, ns, "db", 4, None).await;
    stateful_in_pool(&client, ns, "cache", 2, None).await;
    let pods: Vec<String> = (0..4)
        .map(|i| format!("db-{i}"))
        .chain((0..2).map(|i| format!("cache-{i}")))
        .collect();
    pods_running_on(&client, ns, &pods, &old_nodes).await;
    let timeline = Timeline::start(&client, ns)
        .await
        .expect("the timeline records");

    let t = Instant::now();
    patch_spec(&client, ns, "pool", image("v2")).await;
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 4).await;
    for m in &old {
        gone(&client, ns, &m.name_any(), LONG).await;
    }
    eprintln!("rollout of 4 Machines, 6 stateful pods: {:?}", t.elapsed());
    let new_hash = hash(&d);
    assert_ne!(new_hash, old_hash);
    let new = running_of(&client, ns, &new_hash, 4).await;
    let new_nodes = nodes_of(ns, &new);
    pods_running_on(&client, ns, &pods, &new_nodes).await;

    // The pace, from the timeline.
    let peak = timeline.assert_paced(
        &new_hash,
        Pace {
            replicas: 4,
            surge: 1,
            drains_at_once: 1,
        },
    );
    eprintln!("timeline ({peak:?}):\n{}", timeline.log());
    assert_eq!(peak.machines, 5, "the surge was used:\n{}", timeline.log());
    assert_eq!(peak.old_draining, 1);
    // Each stateful pod moved once: off an old Node, onto a new one.
    assert_moved_once(&timeline, &pods, &old_nodes, &new_nodes);
    // The old Nodes carried the rollout taint, the new ones never did.
    let tainted = timeline.tainted();
    assert_eq!(
        tainted, old_nodes,
        "{ROLLOUT_TAINT_KEY} on the old Nodes only"
    );

    // The final status.
    let st = d.status.as_ref().expect("status");
    assert_eq!(
        (
            st.replicas,
            st.updated_replicas,
            st.ready_replicas,
            st.available_replicas,
            st.draining_replicas
        ),
        (4, 4, 4, 4, 0),
        "{st:?}"
    );
    assert_eq!(st.selector.as_deref(), Some("md=pool"));
    let available = condition(&d, "Available").expect("Available");
    assert_eq!(
        (available.status.as_str(), available.reason.as_str()),
        ("True", "MinimumReplicasAvailable")
    );
    assert_eq!(progressing(&d).map(|c| c.status.as_str()), Some("True"));
    let sets = Api::<MachineSet>::namespaced(client.clone(), ns);
    let old_set = sets
        .get(&format!("pool-{old_hash}"))
        .await
        .expect("the old set is kept for a rollback");
    assert_eq!(old_set.spec.replicas, 0);
    assert_eq!(
        old_set.annotations().get(SUPERSEDED_ANNOTATION),
        Some(&format!("pool-{new_hash}"))
    );
    let new_set = sets
        .get(&format!("pool-{new_hash}"))
        .await
        .expect("the new set");
    assert_eq!(new_set.spec.replicas, 4);
    assert_eq!(
        new_set
            .annotations()
            .get("berth.dev/revision")
            .map(String::as_str),
        Some("2")
    );
    // What the controller did: each old Machine deleted once, and no other.
    assert_eq!(
        support::audit::deleted(BED.bed().await, ns, "machines"),
        support::sorted_names(&old)
    );
    // What operators are told: a ScaledOldMachineSet naming each.
    let scaled = notes(&events_of(&client, ns, "pool", "ScaledOldMachineSet", 4).await);
    for m in &old {
        assert!(
            scaled
                .iter()
                .any(|n| n.contains(&format!("Machine {} goes", m.name_any()))),
            "{}: {scaled:?}",
            m.name_any()
        );
    }
    events_of(&client, ns, "pool", "RolloutComplete", 1).await;
}

/// A paused rollout lets the drain in progress finish and then creates and
/// deletes nothing, scales no set; resumed, it completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_rollout_finishes_its_drain_then_starts_nothing_until_resumed() {
    let ns = "mdep-pause";
    let mut case = Case::builder(ns).on(BED).build().await;
    let client = case.client();
    // Each VM takes 3 s to delete: time to pause while one goes.
    class_in_pool(&client, ns, ns, serde_json::json!({"deleteDelay": "3s"})).await;
    case.start().await;
    deployments(&client, ns)
        .create(
            &PostParams::default(),
            &machine_deployment("pool", ns, 3, "md", serde_json::Value::Null),
        )
        .await
        .expect("create the MachineDeployment");
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 3).await;
    let old_hash = hash(&d);
    let old = running_of(&client, ns, &old_hash, 3).await;
    let timeline = Timeline::start(&client, ns)
        .await
        .expect("the timeline records");
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);

    patch_spec(&client, ns, "pool", image("v2")).await;
    let first = wait::for_one(
        machines.clone(),
        LONG,
        "an old Machine being deleted",
        |m| {
            m.labels().get(TEMPLATE_HASH_LABEL) == Some(&old_hash)
                && m.metadata.deletion_timestamp.is_some()
        },
    )
    .await
    .expect("the rollout deletes an old Machine");
    patch_spec(&client, ns, "pool", serde_json::json!({"paused": true})).await;
    let d = paused(&client, ns).await;
    let st = d.status.as_ref().expect("status");
    assert!(st.updated_replicas < 3, "paused mid-rollout: {st:?}");
    let sets: Api<MachineSet> = Api::namespaced(client.clone(), ns);
    let replicas_of = |all: Vec<MachineSet>| -> BTreeMap<String, (i32, Option<i64>)> {
        all.into_iter()
            .map(|s| (s.name_any(), (s.spec.replicas, s.metadata.generation)))
            .collect()
    };
    let when_paused = replicas_of(sets.list(&Default::default()).await.expect("sets").items);

    // The drain in progress finishes; the sets' Machines settle.
    gone(&client, ns, &first.name_any(), LONG).await;
    wait::until(machines.clone(), LONG, "no Machine being deleted", |ms| {
        ms.iter().all(|m| m.metadata.deletion_timestamp.is_none())
    })
    .await
    .expect("the deletions in progress end");
    let mark = timeline.mark();
    tokio::time::sleep(QUIET).await;
    let during = timeline.since(mark);
    assert!(
        during.is_empty(),
        "nothing created or deleted while paused:\n{}\nwhole timeline:\n{}",
        log_of(&during),
        timeline.log()
    );
    let after = replicas_of(sets.list(&Default::default()).await.expect("sets").items);
    assert_eq!(after, when_paused, "no set scaled while paused");
    let d = deployments(&client, ns).get("pool").await.expect("get");
    assert_eq!(
        progressing(&d).map(|c| c.reason.as_str()),
        Some("Paused"),
        "still paused"
    );

    // Resumed, it completes.
    let t = Instant::now();
    patch_spec(&client, ns, "pool", serde_json::json!({"paused": false})).await;
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 3).await;
    for m in &old {
        gone(&client, ns, &m.name_any(), LONG).await;
    }
    eprintln!("resumed rollout completed in {:?}", t.elapsed());
    let new_hash = hash(&d);
    running_of(&client, ns, &new_hash, 3).await;
    timeline.assert_paced(
        &new_hash,
        Pace {
            replicas: 3,
            surge: 1,
            drains_at_once: 1,
        },
    );
    eprintln!("timeline:\n{}", timeline.log());
}

/// A new template whose Machine fails stalls the rollout: Progressing
/// False NewMachineFailed, a Warning Event, no old Machine deleted for it
/// and no other new Machine made. A fixed template goes on, the failed
/// Machine first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_new_machine_stalls_the_rollout_until_the_template_is_fixed() {
    let ns = "mdep-failing";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .build()
        .await;
    let client = case.client();
    let bad = format!("{ns}-bad");
    let fixed = format!("{ns}-v2");
    // A field the fake driver does not know: it refuses the providerSpec.
    class_in_pool(&client, &bad, ns, serde_json::json!({"bootImage": "v2"})).await;
    class_in_pool(&client, &fixed, ns, serde_json::json!({})).await;
    case.start().await;
    let (first_hash, old, timeline) = pool_of_two(&client, ns, serde_json::Value::Null).await;

    use_class(&client, ns, &bad).await;
    let d = status_until(
        &client,
        ns,
        "pool",
        "Progressing False NewMachineFailed",
        |d, _| {
            progressing(d).is_some_and(|c| c.status == "False" && c.reason == "NewMachineFailed")
        },
    )
    .await;
    let bad_hash = hash(&d);
    let failed = wait::for_one(
        Api::<Machine>::namespaced(client.clone(), ns),
        LONG,
        "the new Machine refused",
        |m| {
            // Refused for good: its Ready condition False with the
            // provider's error, never Running.
            m.labels().get(TEMPLATE_HASH_LABEL) == Some(&bad_hash)
                && phase(m) != Some("Running")
                && support::condition(m, "Ready")
                    .is_some_and(|c| c.status == "False" && c.message.contains("bootImage"))
        },
    )
    .await
    .expect("the new Machine fails")
    .name_any();
    let message = progressing(&d)
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        message.contains(&failed) && message.contains("bootImage"),
        "the condition names the Machine and its error: {message}"
    );
    let warnings = events_of(&client, ns, "pool", "NewMachineFailed", 1).await;
    assert_eq!(warnings[0].type_.as_deref(), Some("Warning"));
    assert!(
        notes(&warnings)[0].contains(&failed),
        "{:?}",
        notes(&warnings)
    );
    // Over a while: no old Machine deleted, no other new one made.
    tokio::time::sleep(QUIET).await;
    let steps = timeline.steps();
    let log = log_of(&steps);
    assert!(
        !steps.iter().any(|s| s.seen == Seen::Deleting),
        "no Machine deleted for a failing one:\n{log}"
    );
    let created: Vec<_> = steps
        .iter()
        .filter(|s| s.seen == Seen::Created && s.hash == bad_hash)
        .collect();
    assert_eq!(
        created.len(),
        1,
        "the failed Machine fills the surge:\n{log}"
    );
    let d = deployments(&client, ns).get("pool").await.expect("get");
    assert_eq!(
        progressing(&d).map(|c| c.reason.as_str()),
        Some("NewMachineFailed")
    );
    assert_eq!(
        d.status.as_ref().map(|s| s.available_replicas),
        Some(2),
        "both old Machines serve"
    );

    // Fixed: the rollout completes, the failed Machine goes first.
    let t = Instant::now();
    use_class(&client, ns, &fixed).await;
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 2).await;
    gone(&client, ns, &failed, LONG).await;
    for m in &old {
        gone(&client, ns, &m.name_any(), LONG).await;
    }
    eprintln!("fixed rollout completed in {:?}", t.elapsed());
    let fixed_hash = hash(&d);
    assert!(fixed_hash != bad_hash && fixed_hash != first_hash);
    running_of(&client, ns, &fixed_hash, 2).await;
    timeline.assert_paced(&fixed_hash, TWO_ONE_AT_A_TIME);
    let steps = timeline.steps();
    let deleted: Vec<&str> = steps
        .iter()
        .filter(|s| s.seen == Seen::Deleting)
        .map(|s| s.machine.as_str())
        .collect();
    assert_eq!(
        deleted.first().copied(),
        Some(failed.as_str()),
        "the failed Machine goes first:\n{}",
        log_of(&steps)
    );
    assert_eq!(progressing(&d).map(|c| c.status.as_str()), Some("True"));
}

/// A new Machine whose Node is Ready but still carries a taint of a Node
/// that is starting (here the cloud's `uninitialized`, as a cloud controller
/// manager leaves it until it has set the Node up) cannot take pods: no old
/// Machine goes for it until the taint leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_machine_goes_only_once_the_new_node_takes_pods() {
    old_goes_once_new_takes_pods(
        "mdep-startup-taint",
        "node.cloudprovider.kubernetes.io/uninitialized",
    )
    .await;
}

/// The same with the taint a CSI driver's node plugin keeps on a Node until
/// it has started (`<driver>/agent-not-ready`): its volumes could not
/// attach there yet, so no old Machine goes for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_machine_waits_for_the_new_nodes_csi_agent() {
    old_goes_once_new_takes_pods("mdep-csi-taint", "ebs.csi.aws.com/agent-not-ready").await;
}

/// A rollout of two Machines one at a time onto a class whose Nodes
/// register with `taint`: no old Machine goes until it leaves the new Node.
async fn old_goes_once_new_takes_pods(ns: &str, taint: &str) {
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .build()
        .await;
    let client = case.client();
    let uninitialized = format!("{ns}-v2");
    class_in_pool(
        &client,
        &uninitialized,
        ns,
        serde_json::json!({"nodeTaints": [{"key": taint, "value": "true", "effect": "NoSchedule"}]}),
    )
    .await;
    case.start().await;
    let (first_hash, old, timeline) = pool_of_two(&client, ns, rolling(1.into(), 0.into())).await;

    use_class(&client, ns, &uninitialized).await;
    let d = status_until(&client, ns, "pool", "a new template", |_, s| {
        s.template_hash.as_deref().is_some_and(|h| h != first_hash)
    })
    .await;
    let new_hash = hash(&d);
    // The new Machine is Running, its Node Ready, the taint still on it.
    let new = running_of(&client, ns, &new_hash, 1).await;
    let node = nodes_of(ns, &new).into_iter().next().expect("its Node");
    let nodes: Api<Node> = Api::all(client.clone());
    let n = nodes.get(&node).await.expect("the new Node");
    assert!(
        n.spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|ts| ts.iter().any(|t| t.key == taint)),
        "the new Node registered with {taint}"
    );
    tokio::time::sleep(QUIET).await;
    let log = timeline.log();
    assert!(
        !timeline.steps().iter().any(|s| s.seen == Seen::Deleting),
        "no old Machine goes while the new Node takes no pods:\n{log}"
    );
    let d = status_until(&client, ns, "pool", "held for landing", |d, _| {
        progressing(d).is_some_and(|c| c.message.contains("taking pods"))
    })
    .await;
    assert_eq!(
        d.status
            .as_ref()
            .map(|s| (s.updated_replicas, s.ready_replicas)),
        Some((1, 2)),
        "the new Machine is not counted ready"
    );

    // The cloud has set the Node up; the next new Machines register
    // without the taint. The rollout completes.
    Api::<MachineClass>::all(client.clone())
        .patch(
            &uninitialized,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"providerSpec": {"nodeTaints": []}}})),
        )
        .await
        .expect("the class without the taint");
    let released = timeline.elapsed();
    let keep: Vec<Taint> = n
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.key != taint)
        .collect();
    nodes
        .patch(
            &node,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"taints": keep}})),
        )
        .await
        .expect("untaint the new Node");
    rollout_is(&client, ns, "pool", "RolloutComplete", 2).await;
    for m in &old {
        gone(&client, ns, &m.name_any(), LONG).await;
    }
    let steps = timeline.steps();
    let first_deletion = steps
        .iter()
        .find(|s| s.seen == Seen::Deleting)
        .expect("old Machines deleted");
    assert!(
        first_deletion.at >= released,
        "the first old Machine went after the taint left:\n{}",
        log_of(&steps)
    );
    timeline.assert_paced(&new_hash, TWO_ONE_AT_A_TIME);
}

/// Editing the pool's MachineClass in place rolls the pool when what a VM
/// is made of changes (its providerSpec: here the Node's labels, as an image
/// would be), one Machine at a time, as a new template does; editing its
/// drain settings first rolls nothing. By the audit log: the controller
/// created exactly two MachineSets, the first and the rolled one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_edited_in_place_rolls_the_pool() {
    let ns = "mdep-class-edit";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let (first_hash, old, timeline) = pool_of_two(&client, ns, rolling(1.into(), 0.into())).await;
    let classes: Api<MachineClass> = Api::all(client.clone());
    classes
        .patch(
            ns,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"drain": {"timeout": "6m"}}})),
        )
        .await
        .expect("new drain settings");
    let mut spec = classes
        .get(ns)
        .await
        .expect("the class")
        .spec
        .provider_spec
        .unwrap_or_default();
    spec["nodeLabels"]["image"] = serde_json::json!("v2");
    classes
        .patch(
            ns,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"providerSpec": spec}})),
        )
        .await
        .expect("a new image");
    let d = status_until(&client, ns, "pool", "a new hash", |_, s| {
        s.template_hash.as_deref().is_some_and(|h| h != first_hash)
    })
    .await;
    let new_hash = hash(&d);
    rollout_is(&client, ns, "pool", "RolloutComplete", 2).await;
    for m in &old {
        gone(&client, ns, &m.name_any(), LONG).await;
    }
    let new = running_of(&client, ns, &new_hash, 2).await;
    assert!(
        new.iter()
            .all(|m| !old.iter().any(|o| o.name_any() == m.name_any()))
    );
    timeline.assert_paced(&new_hash, TWO_ONE_AT_A_TIME);
    // Sets made: accepted creates. A create from a cache that had not yet
    // seen the set it made is refused by its name (409) and makes nothing.
    let creates: Vec<String> = support::audit::requests(BED.bed().await, ns)
        .iter()
        .filter(|r| r.verb == "create" && r.resource == "machinesets")
        .map(|r| format!("{} {}", r.code, r.name.as_deref().unwrap_or("?")))
        .collect();
    let made = creates.iter().filter(|c| c.starts_with('2')).count();
    assert_eq!(
        made, 2,
        "the first set and the rolled one, no other: {creates:?}"
    );
}

/// A template changed and the deployment paused in the same edit: the
/// rollout does not start, and no old Node is tainted for it. By the time
/// the status says Paused the reconcile that saw the edit is over, and the
/// old Nodes carry no rollout taint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_deployment_taints_no_node() {
    let ns = "mdep-paused-taint";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let (_, old, _timeline) = pool_of_two(&client, ns, rolling(1.into(), 0.into())).await;
    let mut edit = image("v2");
    edit["paused"] = serde_json::json!(true);
    patch_spec(&client, ns, "pool", edit).await;
    paused(&client, ns).await;
    let nodes: Api<Node> = Api::all(client.clone());
    for node in nodes_of(ns, &old) {
        let n = nodes.get(&node).await.expect("an old Node");
        assert!(
            !n.spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|ts| ts.iter().any(|t| t.key == ROLLOUT_TAINT_KEY)),
            "{node} tainted by a paused deployment"
        );
    }
}

/// A MachineDeployment deleted with its sets orphaned (what `--cascade=orphan`
/// leaves) and made again adopts its set: its Machines stay (none created,
/// none deleted, by the audit log) and the rollout is complete with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_made_again_adopts_its_orphaned_set() {
    let ns = "mdep-adopt";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let (first_hash, old, _timeline) = pool_of_two(&client, ns, rolling(1.into(), 0.into())).await;
    // The set orphaned by hand and the deployment deleted while berth is
    // stopped: the state `--cascade=orphan` ends in. Through the garbage
    // collector itself, the case raced it: a collector whose graph had not
    // caught up let the deployment go first and then took the set, still
    // owned by a deployment gone, for garbage.
    case.stop().await;
    let sets: Api<MachineSet> = Api::namespaced(client.clone(), ns);
    sets.patch(
        &format!("pool-{first_hash}"),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"ownerReferences": null}})),
    )
    .await
    .expect("the set orphaned");
    let api = deployments(&client, ns);
    api.delete("pool", &Default::default())
        .await
        .expect("delete the deployment");
    wait::for_none(api.clone(), LONG, "the deployment gone", |d| {
        d.name_any() == "pool"
    })
    .await
    .expect("the deployment goes");
    case.start().await;
    let since = k8s_openapi::jiff::Timestamp::now();

    api.create(
        &PostParams::default(),
        &machine_deployment("pool", ns, 2, "md", rolling(1.into(), 0.into())),
    )
    .await
    .expect("make the deployment again");
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 2).await;
    assert_eq!(hash(&d), first_hash);
    let set = sets
        .get(&format!("pool-{first_hash}"))
        .await
        .expect("the set");
    assert!(
        set.owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && Some(&o.uid) == d.metadata.uid.as_ref()),
        "adopted: {:?}",
        set.owner_references()
    );
    let running = running_of(&client, ns, &first_hash, 2).await;
    let names = |ms: &[Machine]| ms.iter().map(|m| m.name_any()).collect::<BTreeSet<_>>();
    assert_eq!(names(&running), names(&old), "the same Machines");
    let churn: Vec<String> = support::audit::requests(BED.bed().await, ns)
        .iter()
        .filter(|r| r.received > since && r.resource == "machines")
        .filter(|r| r.verb == "create" || r.verb == "delete")
        .map(|r| format!("{} {:?}", r.verb, r.name))
        .collect();
    assert!(churn.is_empty(), "no Machine made or deleted: {churn:?}");
}

/// `berth run` killed (SIGKILL) twice in the middle of a rollout, each
/// time while an old Machine drains: the next process picks the rollout up
/// from the API, keeps its pace and each stateful pod still moves once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_resumes_after_berth_is_killed_and_moves_each_stateful_pod_once() {
    let ns = "mdep-killed";
    let flags = ["--namespace", ns, "--leader-elect=false"];
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .spawn(&flags)
        .await;
    let client = case.client();
    deployments(&client, ns)
        .create(
            &PostParams::default(),
            &machine_deployment("pool", ns, 3, "md", serde_json::Value::Null),
        )
        .await
        .expect("create the MachineDeployment");
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 3).await;
    let old_hash = hash(&d);
    let old = running_of(&client, ns, &old_hash, 3).await;
    let old_nodes = nodes_of(ns, &old);
    stateful_in_pool(&client, ns, "db", 3, None).await;
    let pods: Vec<String> = (0..3).map(|i| format!("db-{i}")).collect();
    pods_running_on(&client, ns, &pods, &old_nodes).await;
    let timeline = Timeline::start(&client, ns)
        .await
        .expect("the timeline records");
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);

    let t = Instant::now();
    patch_spec(&client, ns, "pool", image("v2")).await;
    for n in 1..=2 {
        wait::until(
            machines.clone(),
            LONG,
            &format!("old Machine #{n} being deleted"),
            |ms| {
                ms.iter()
                    .filter(|m| {
                        m.labels().get(TEMPLATE_HASH_LABEL) == Some(&old_hash)
                            && m.metadata.deletion_timestamp.is_some()
                    })
                    .count()
                    >= 1
                    && ms
                        .iter()
                        .filter(|m| m.labels().get(TEMPLATE_HASH_LABEL) == Some(&old_hash))
                        .count()
                        == 4 - n
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", timeline.log()));
        eprintln!(
            "SIGKILL while old Machine #{n} drains, at {:?}",
            t.elapsed()
        );
        case.kill().await;
        case.spawn(&flags).await;
    }
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 3).await;
    for m in &old {
        gone(&client, ns, &m.name_any(), LONG).await;
    }
    eprintln!("rollout of 3 with two SIGKILLs: {:?}", t.elapsed());
    let new_hash = hash(&d);
    let new = running_of(&client, ns, &new_hash, 3).await;
    let new_nodes = nodes_of(ns, &new);
    pods_running_on(&client, ns, &pods, &new_nodes).await;
    timeline.assert_paced(
        &new_hash,
        Pace {
            replicas: 3,
            surge: 1,
            drains_at_once: 1,
        },
    );
    eprintln!("timeline:\n{}", timeline.log());
    assert_moved_once(&timeline, &pods, &old_nodes, &new_nodes);
    assert_eq!(
        support::audit::deleted(BED.bed().await, ns, "machines"),
        support::sorted_names(&old),
        "each old Machine deleted once, and no other"
    );

    let status = case.take_berth().terminate().await;
    assert!(status.success(), "{status:?}");
}

/// The scale subresource scales the deployment's one set; a scale-down
/// takes the Machines the set's order puts first, and the Events say which
/// and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machinedeployment_scales_through_its_scale_subresource() {
    let ns = "mdep-scale";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let api = deployments(&client, ns);
    let mut pool = machine_deployment("pool", ns, 1, "md", serde_json::Value::Null);
    let remediation = serde_json::json!({"policy": "Replace", "maxUnhealthy": 1});
    pool.spec.remediation = Some(json(remediation.clone()));
    api.create(&PostParams::default(), &pool)
        .await
        .expect("create the MachineDeployment");
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 1).await;
    let h = hash(&d);
    let set = format!("pool-{h}");
    let sets_api: Api<MachineSet> = Api::namespaced(client.clone(), ns);
    let set_remediation = |s: &MachineSet| serde_json::to_value(&s.spec.remediation).ok();
    let made = sets_api.get(&set).await.expect("the set");
    assert_eq!(
        set_remediation(&made),
        Some(remediation),
        "copied to its set"
    );
    // Changed on the deployment: changed on its set in place, no rollout.
    patch_spec(
        &client,
        ns,
        "pool",
        serde_json::json!({"remediation": {"policy": "Off"}}),
    )
    .await;
    wait::for_one(sets_api.clone(), LONG, "the set's remediation Off", |s| {
        // A merge patch: maxUnhealthy stays.
        s.name_any() == set
            && set_remediation(s) == Some(serde_json::json!({"policy": "Off", "maxUnhealthy": 1}))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // Up from 1 to 3.
    let t = Instant::now();
    api.patch_scale(
        "pool",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"replicas": 3}})),
    )
    .await
    .expect("scale to 3 through the scale subresource");
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 3).await;
    let machines = running_of(&client, ns, &h, 3).await;
    eprintln!("scale-up 1 -> 3: {:?}", t.elapsed());
    assert_eq!(hash(&d), h, "a scale is no new template");
    let st = d.status.as_ref().expect("status");
    assert_eq!(
        (st.replicas, st.ready_replicas, st.available_replicas),
        (3, 3, 3)
    );
    let scale: Scale = api.get_scale("pool").await.expect("the scale subresource");
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(3));
    let scale_status = scale.status.expect("scale status");
    assert_eq!(scale_status.replicas, 3);
    assert_eq!(scale_status.selector.as_deref(), Some("md=pool"));
    let up = notes(&events_of(&client, ns, "pool", "ScaledNewMachineSet", 1).await);
    assert!(
        up.iter()
            .any(|n| n.contains(&format!("scaled MachineSet {set} from 1 to 3"))),
        "{up:?}"
    );
    let sets = Api::<MachineSet>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await
        .expect("sets");
    assert_eq!(
        sets.items.iter().map(|s| s.name_any()).collect::<Vec<_>>(),
        std::slice::from_ref(&set),
        "one set"
    );

    // Down to 1: `marked` for the operator's priority, `plain` for its
    // cheaper drain; `stateful` keeps its pod.
    let (marked, stateful, plain) = (&machines[0], &machines[1], &machines[2]);
    mark_for_scale_down(&client, ns, &machines).await;
    let t = Instant::now();
    api.patch_scale(
        "pool",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"replicas": 1}})),
    )
    .await
    .expect("scale to 1");
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 1).await;
    let left = running_of(&client, ns, &h, 1).await;
    eprintln!("scale-down 3 -> 1: {:?}", t.elapsed());
    assert_eq!(
        left[0].name_any(),
        stateful.name_any(),
        "the stateful Machine stays"
    );
    let down = notes(&events_of(&client, ns, "pool", "ScaledNewMachineSet", 2).await);
    assert!(
        down.iter()
            .any(|n| n.contains(&format!("scaled MachineSet {set} from 3 to 1"))),
        "{down:?}"
    );
    let why = notes(&events_of(&client, ns, &set, "ScaledDown", 2).await);
    assert_scale_down_reasons(&why, &machines);
    for m in [marked, plain] {
        gone(&client, ns, &m.name_any(), LONG).await;
    }
    assert_eq!(
        support::audit::deleted(BED.bed().await, ns, "machines"),
        support::sorted_names(&[marked.clone(), plain.clone()]),
        "never more than needed, each once"
    );
    let st = d.status.as_ref().expect("status");
    assert_eq!(
        (st.replicas, st.available_replicas, st.draining_replicas),
        (1, 1, 0)
    );
    let scale: Scale = api.get_scale("pool").await.expect("the scale subresource");
    assert_eq!(scale.status.map(|s| s.replicas), Some(1));
}

/// `maxUnavailable: 2` drains two old Machines at once, and the move
/// ledger keeps their StatefulSet to one replica moving at a time across
/// them: three Machines carrying one replica of db each (required
/// anti-affinity, each pod Ready 5 s after it starts) roll with `maxSurge:
/// 3, maxUnavailable: 2`; by the audit log and a watch of the
/// VolumeAttachments, each replica is evicted only after the one before it
/// has its volume attached where its replacement runs. While one of the
/// two drains waits for db and the third old Machine waits its turn, the
/// MachineDeployment's `Progressing` message says the rollout is held by a
/// workload's move budget (read by a watch, as an operator would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_of_two_at_once_moves_one_replica_of_a_workload_at_a_time() {
    use support::oracle::{self, Watches, evicted_once, evictions};
    let ns = "mdep-ledger";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    deployments(&client, ns)
        .create(
            &PostParams::default(),
            &machine_deployment("pool", ns, 3, "md", rolling(3.into(), 2.into())),
        )
        .await
        .expect("create the MachineDeployment");
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 3).await;
    let old_nodes = nodes_of(ns, &running_of(&client, ns, &hash(&d), 3).await);
    support::pool::stateful(&client, ns, "db", 3, |sts| {
        {
            let spec = &mut sts.spec;
            // Each pod turns Ready 5 s after it starts: the old Machines'
            // drains wait for db's permit that long.
            spec.template
                .metadata
                .get_or_insert_default()
                .annotations
                .get_or_insert_default()
                .insert(
                    berth_devkit::testbed::stages::READY_AFTER_ANNOTATION.into(),
                    "5s".into(),
                );
        }
        if let Some(s) = sts.spec.template.spec.as_mut() {
            s.affinity = Some(json(serde_json::json!({"podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [{
                    "labelSelector": {"matchLabels": {"app": "db"}},
                    "topologyKey": "kubernetes.io/hostname"
                }]
            }})));
        }
    })
    .await;
    let pods: Vec<String> = (0..3).map(|i| format!("db-{i}")).collect();
    pods_running_on(&client, ns, &pods, &old_nodes).await;
    let watches = Watches::start(&client, ns).await;
    // What an operator reads on the MachineDeployment (`kubectl get
    // machinedeployment pool -o yaml`) while its old Machines wait for db.
    let told = tokio::spawn(wait::for_one(
        deployments(&client, ns),
        Duration::from_secs(120),
        "the rollout held by db's move budget",
        |d| progressing(d).is_some_and(|c| c.message.contains("held by a workload's move budget")),
    ));

    patch_spec(&client, ns, "pool", image("v2")).await;
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 3).await;
    told.await
        .expect("the watch ran")
        .expect("the Progressing condition names the move budget while drains wait for it");
    let new_nodes = nodes_of(ns, &running_of(&client, ns, &hash(&d), 3).await);
    pods_running_on(&client, ns, &pods, &new_nodes).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let mut went: Vec<_> = pods.iter().map(|p| evicted_once(&all, p, &log)).collect();
    went.sort_by_key(|r| r.received);
    for pair in went.windows(2) {
        let pv = format!("{ns}-{}", pair[0].name.as_deref().unwrap_or_default());
        let from = old_nodes
            .iter()
            .find(|n| watches.detached_from(&pv, n).is_some())
            .unwrap_or_else(|| panic!("{pv} left an old Node: {log}"));
        watches
            .assert_after_moved(BED.bed().await, pair[1], &pv, from, &log)
            .await;
    }
}
