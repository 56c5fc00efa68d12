//! MachineSets end to end: real kube-apiserver, controller-manager (its
//! garbage collector, PV and attach-detach controllers), scheduler and
//! kwok, Machines of the fake provider. Which Machine went on a scale-down,
//! and why, is read from the Events berth recorded.

mod support;

use std::time::{Duration, Instant};

use berth::api::{Machine, MachineDeployment, MachineSet};
use berth_devkit::testbed::wait;
use k8s_openapi::api::autoscaling::v1::Scale;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use support::pool::{Bed, assert_scale_down_reasons, mark_for_scale_down};
use support::{Case, LONG, phase};

const BED: Bed = Bed {
    attach: Duration::from_millis(500),
    detach: Duration::from_millis(500),
};

/// A MachineSet `name` of `replicas` Machines of class `class`, labelled
/// `set: <name>`.
fn machine_set(name: &str, class: &str, replicas: i32) -> MachineSet {
    let mut s = berth_devkit::testbed::fixtures::machine_set(name, class, replicas);
    s.spec
        .template
        .metadata
        .annotations
        .insert("team".into(), "storage".into());
    s
}

/// Waits until the set's Machines that are not being deleted are `n`, all
/// Running; returns them by name.
async fn running_machines(client: &Client, ns: &str, set: &str, n: usize) -> Vec<Machine> {
    let owned = |m: &Machine| {
        m.owner_references()
            .iter()
            .any(|o| o.name == set && o.controller == Some(true))
    };
    let mut ms: Vec<Machine> = wait::until(
        Api::<Machine>::namespaced(client.clone(), ns),
        LONG,
        &format!("{n} Machines of {set} Running"),
        |ms| {
            let live: Vec<_> = ms
                .iter()
                .filter(|m| owned(m) && m.metadata.deletion_timestamp.is_none())
                .collect();
            live.len() == n && live.iter().all(|m| phase(m) == Some("Running"))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .iter()
    .filter(|m| owned(m) && m.metadata.deletion_timestamp.is_none())
    .map(|m| (**m).clone())
    .collect();
    ms.sort_by_key(|m| m.name_any());
    ms
}

/// Waits until the set's status says `replicas` and `ready` for its
/// current generation.
async fn status_is(client: &Client, ns: &str, set: &str, replicas: i32, ready: i32) -> MachineSet {
    let s = wait::for_one(
        Api::<MachineSet>::namespaced(client.clone(), ns),
        LONG,
        &format!("{set}: {replicas} replicas, {ready} ready"),
        |s| {
            s.name_any() == set
                && s.status.as_ref().is_some_and(|st| {
                    st.replicas == replicas
                        && st.ready_replicas == ready
                        && st.observed_generation == s.metadata.generation
                })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    (*s).clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machineset_scales_up_and_down_deleting_the_cheapest_machines_first() {
    let ns = "mset-scale";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let sets: Api<MachineSet> = Api::namespaced(client.clone(), ns);

    // From 0 to 3.
    let t = Instant::now();
    sets.create(&PostParams::default(), &machine_set("pool", ns, 0))
        .await
        .expect("create the MachineSet");
    let s = status_is(&client, ns, "pool", 0, 0).await;
    assert_eq!(
        status_reason(&s, "Ready"),
        ("True".into(), "AllReplicasReady".into())
    );
    sets.patch_scale(
        "pool",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"replicas": 3}})),
    )
    .await
    .expect("scale to 3 through the scale subresource");
    let machines = running_machines(&client, ns, "pool", 3).await;
    eprintln!("scale-up 0 -> 3: {:?}", t.elapsed());
    for m in &machines {
        assert!(m.name_any().starts_with("pool-"), "{}", m.name_any());
        assert_eq!(m.labels().get("set").map(String::as_str), Some("pool"));
        assert_eq!(
            m.annotations().get("team").map(String::as_str),
            Some("storage")
        );
    }
    let s = status_is(&client, ns, "pool", 3, 3).await;
    let st = s.status.as_ref().expect("status");
    assert_eq!(st.available_replicas, 3);
    assert_eq!(st.selector.as_deref(), Some("set=pool"));
    assert_eq!(
        status_reason(&s, "Ready"),
        ("True".into(), "AllReplicasReady".into())
    );
    assert_eq!(status_reason(&s, "ReplicaFailure").0, "False");
    let scale: Scale = sets.get_scale("pool").await.expect("the scale subresource");
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(3));
    let scale_status = scale.status.expect("scale status");
    assert_eq!(scale_status.replicas, 3);
    assert_eq!(scale_status.selector.as_deref(), Some("set=pool"));
    let created = support::notes(&support::events_of(&client, ns, "pool", "ScaledUp", 3).await);
    assert!(
        created.iter().any(|n| n.contains("(3 of 3 replicas)")),
        "{created:?}"
    );

    // The order is observable: `marked` carries the operator's priority,
    // `stateful` runs a pod with an attached volume, `plain` runs nothing.
    let (marked, stateful, plain) = (&machines[0], &machines[1], &machines[2]);
    mark_for_scale_down(&client, ns, &machines).await;

    // Down to 1: `marked` for its priority, `plain` for its cheaper drain.
    let t = Instant::now();
    sets.patch_scale(
        "pool",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"replicas": 1}})),
    )
    .await
    .expect("scale to 1");
    let left = running_machines(&client, ns, "pool", 1).await;
    assert_eq!(
        left[0].name_any(),
        stateful.name_any(),
        "the stateful Machine stays"
    );
    let notes = support::notes(&support::events_of(&client, ns, "pool", "ScaledDown", 2).await);
    assert_scale_down_reasons(&notes, &machines);
    // And on each Machine chosen.
    for m in [marked, plain] {
        let on_machine = support::notes(
            &support::events_of(&client, ns, &m.name_any(), "DeletedByMachineSet", 1).await,
        );
        assert!(
            on_machine[0].contains("scaled from 3 to 1"),
            "{on_machine:?}"
        );
    }
    let s = status_is(&client, ns, "pool", 1, 1).await;
    assert_eq!(s.status.as_ref().map(|s| s.available_replicas), Some(1));
    // The deleted Machines go all the way (drained, VM and Node deleted).
    for m in [marked, plain] {
        support::pool::gone(&client, ns, &m.name_any(), LONG).await;
    }
    assert_eq!(
        support::audit::deleted(BED.bed().await, ns, "machines"),
        support::sorted_names(&[marked.clone(), plain.clone()]),
        "never more than needed, each once"
    );
    eprintln!("scale-down 3 -> 1: {:?}", t.elapsed());
    let s = status_is(&client, ns, "pool", 1, 1).await;
    assert_eq!(
        status_reason(&s, "Ready"),
        ("True".into(), "AllReplicasReady".into())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_machineset_deletes_its_machines_and_no_other() {
    let ns = "mset-delete";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    // A Machine the set's selector matches but that it does not own.
    let mut foreign = support::machine("foreign", ns);
    foreign.metadata.labels = Some([("set".to_string(), "pool".to_string())].into());
    machines
        .create(&PostParams::default(), &foreign)
        .await
        .expect("create the foreign Machine");

    let sets: Api<MachineSet> = Api::namespaced(client.clone(), ns);
    sets.create(&PostParams::default(), &machine_set("pool", ns, 2))
        .await
        .expect("create the MachineSet");
    let owned = running_machines(&client, ns, "pool", 2).await;
    status_is(&client, ns, "pool", 2, 2).await;
    assert!(
        owned.iter().all(|m| m.name_any() != "foreign"),
        "no adoption"
    );

    let t = Instant::now();
    sets.delete("pool", &DeleteParams::default())
        .await
        .expect("delete the MachineSet");
    for m in &owned {
        support::pool::gone(&client, ns, &m.name_any(), LONG).await;
    }
    eprintln!(
        "MachineSet deletion: its Machines gone in {:?}",
        t.elapsed()
    );
    let f = machines
        .get("foreign")
        .await
        .expect("the foreign Machine stays");
    assert!(f.metadata.deletion_timestamp.is_none());
}

/// An admission policy refuses new Machines in the namespace (as a
/// webhook or a ResourceQuota would): the set's creates are refused
/// (403). The set says so (`ReplicaFailure` True, `CreateFailed`, in its
/// status) and tries again with backoff, so that once the policy lets
/// Machines through, with nothing else changed, it creates those it lacks
/// and the failure clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_create_is_said_and_tried_again_until_it_is_let_through() {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    use k8s_openapi::api::core::v1::Namespace;
    let ns = "mset-refused";
    let label = "test.berth.dev/refuse-machines";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .build()
        .await;
    let client = case.client();
    let policies: Api<ValidatingAdmissionPolicy> = Api::all(client.clone());
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(client.clone());
    let name = "mset-refused-machines";
    let _ = policies.delete(name, &DeleteParams::default()).await;
    let _ = bindings.delete(name, &DeleteParams::default()).await;
    policies
        .create(
            &PostParams::default(),
            &support::pool::json(serde_json::json!({
                "metadata": {"name": name},
                "spec": {
                    "failurePolicy": "Fail",
                    "matchConstraints": {"resourceRules": [{
                        "apiGroups": ["berth.dev"], "apiVersions": ["*"],
                        "operations": ["CREATE"], "resources": ["machines"]}]},
                    "validations": [{
                        "expression": format!("!has(namespaceObject.metadata.labels) || !('{label}' in namespaceObject.metadata.labels)"),
                        "message": "this namespace refuses new Machines (a test's admission policy)"
                    }]
                }
            })),
        )
        .await
        .expect("create the policy");
    bindings
        .create(
            &PostParams::default(),
            &support::pool::json(serde_json::json!({
                "metadata": {"name": name},
                "spec": {
                    "policyName": name,
                    "validationActions": ["Deny"],
                    "matchResources": {"namespaceSelector": {"matchLabels": {
                        "kubernetes.io/metadata.name": ns}}}
                }
            })),
        )
        .await
        .expect("bind the policy");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let refuse = |on: bool| {
        let value = if on {
            serde_json::json!("true")
        } else {
            serde_json::Value::Null
        };
        serde_json::json!({"metadata": {"labels": {label: value}}})
    };
    namespaces
        .patch(ns, &PatchParams::default(), &Patch::Merge(refuse(true)))
        .await
        .expect("label the namespace");
    // The policy is in force once a Machine is refused.
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let until = Instant::now() + LONG;
    loop {
        match machines
            .create(&PostParams::default(), &support::machine("probe", ns))
            .await
        {
            Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => break,
            Ok(_) => {
                machines
                    .delete("probe", &DeleteParams::default())
                    .await
                    .expect("delete the probe");
                support::pool::gone(&client, ns, "probe", LONG).await;
            }
            Err(e) => panic!("creating the probe: {e}"),
        }
        assert!(Instant::now() < until, "the policy never refused a Machine");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    case.start().await;
    let sets: Api<MachineSet> = Api::namespaced(client.clone(), ns);
    sets.create(&PostParams::default(), &machine_set("pool", ns, 2))
        .await
        .expect("create the MachineSet");
    let refused = wait::for_one(sets.clone(), LONG, "ReplicaFailure said", |s| {
        support::condition(s, "ReplicaFailure").is_some_and(|c| c.status == "True")
    })
    .await
    .expect("the set says its creates are refused");
    assert_eq!(
        status_reason(&refused, "ReplicaFailure"),
        ("True".to_string(), "CreateFailed".to_string())
    );
    // While refused, the creates are tried again with backoff, not in a
    // loop: a refusal that named the generated Machine changed the status
    // at every attempt, and the status write woke the set at once. Tried
    // again: more than one create in all (the second comes within a second
    // of the first). Not in a loop: at most eight in the next 4 s. (How
    // many fall in a window that opens when the refusal is seen depends on
    // how late a loaded machine sees it: the backoff, doubling from half a
    // second, may be past 4 s by then.)
    let from = k8s_openapi::jiff::Timestamp::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let to = k8s_openapi::jiff::Timestamp::now();
    let creates: Vec<_> = support::audit::requests(BED.bed().await, ns)
        .into_iter()
        .filter(|r| r.verb == "create" && r.resource == "machines")
        .filter(|r| r.received <= to)
        .collect();
    let attempts = creates.iter().filter(|r| r.received >= from).count();
    assert!(
        creates.len() > 1 && attempts <= 8,
        "{} creates while refused, {attempts} in the last 4 s",
        creates.len()
    );

    namespaces
        .patch(ns, &PatchParams::default(), &Patch::Merge(refuse(false)))
        .await
        .expect("let Machines through");
    running_machines(&client, ns, "pool", 2).await;
    wait::for_one(sets.clone(), LONG, "ReplicaFailure cleared", |s| {
        support::condition(s, "ReplicaFailure").is_none_or(|c| c.status == "False")
    })
    .await
    .expect("the failure clears");
    // The clean-up below is not the case's work.
    case.finish().await;
    let _ = bindings.delete(name, &DeleteParams::default()).await;
    let _ = policies.delete(name, &DeleteParams::default()).await;
}

/// The apiserver refuses what CEL can check: negative replicas, an empty
/// selector, a change of selector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_apiserver_refuses_an_invalid_machineset() {
    let ns = "mset-invalid";
    let case = Case::builder(ns).on(BED).build().await;
    let client = case.client();
    let sets: Api<MachineSet> = Api::namespaced(client.clone(), ns);
    let mut negative = machine_set("negative", "c", 1);
    negative.spec.replicas = -1;
    let mut empty = machine_set("empty", "c", 1);
    empty.spec.selector = Default::default();
    for (set, message) in [
        (negative, "replicas must not be negative"),
        (empty, "selector must not be empty"),
    ] {
        let err = sets
            .create(&PostParams::default(), &set)
            .await
            .expect_err("refused");
        assert!(err.to_string().contains(message), "{err}");
    }
    // The selector cannot change.
    sets.create(&PostParams::default(), &machine_set("fixed", "c", 0))
        .await
        .expect("create");
    let err = sets
        .patch(
            "fixed",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"selector": {"matchLabels": {"set": "x"}}, "template": {"metadata": {"labels": {"set": "x"}}}}})),
        )
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("selector is immutable"), "{err}");
}

/// Waits until the deployment's Progressing condition has `reason` for its
/// current generation, with `updated` Machines of the current template.
async fn rollout_is(
    client: &Client,
    ns: &str,
    name: &str,
    reason: &str,
    updated: i32,
) -> MachineDeployment {
    let d = wait::for_one(
        Api::<MachineDeployment>::namespaced(client.clone(), ns),
        LONG,
        &format!("{name}: Progressing {reason}, {updated} updated"),
        |d| {
            d.name_any() == name
                && d.status.as_ref().is_some_and(|s| {
                    s.observed_generation == d.metadata.generation
                        && s.updated_replicas == updated
                        && s.conditions
                            .iter()
                            .any(|c| c.type_ == "Progressing" && c.reason == reason)
                })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    (*d).clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machinedeployment_rolls_a_template_change_through_a_new_machineset() {
    let ns = "mdep-roll";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let mds: Api<MachineDeployment> = Api::namespaced(client.clone(), ns);
    let md: MachineDeployment = berth_devkit::testbed::fixtures::machine_deployment(
        "pool",
        ns,
        3,
        "pool",
        serde_json::Value::Null,
    );
    mds.create(&PostParams::default(), &md)
        .await
        .expect("create the MachineDeployment");
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 3).await;
    let first_hash = d
        .status
        .as_ref()
        .and_then(|s| s.template_hash.clone())
        .expect("hash");
    let first_set = format!("pool-{first_hash}");
    let old = running_machines(&client, ns, &first_set, 3).await;

    let t = Instant::now();
    mds.patch(
        "pool",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"template": {"metadata": {"annotations": {"image": "v2"}}}}})),
    )
    .await
    .expect("change the template");
    let d = rollout_is(&client, ns, "pool", "RolloutComplete", 3).await;
    eprintln!("rollout of 3: {:?}", t.elapsed());
    let st = d.status.as_ref().expect("status");
    let hash = st.template_hash.clone().expect("hash");
    assert_ne!(hash, first_hash);
    assert_eq!(
        (st.replicas, st.available_replicas, st.draining_replicas),
        (3, 3, 0)
    );
    let new = running_machines(&client, ns, &format!("pool-{hash}"), 3).await;
    for m in &new {
        assert_eq!(m.labels().get("berth.dev/template-hash"), Some(&hash));
        assert_eq!(m.annotations().get("image").map(String::as_str), Some("v2"));
    }
    for m in &old {
        support::pool::gone(&client, ns, &m.name_any(), LONG).await;
    }
    let old_set = Api::<MachineSet>::namespaced(client.clone(), ns)
        .get(&first_set)
        .await
        .expect("the old set is kept (revision history 1)");
    assert_eq!(old_set.spec.replicas, 0);
    assert_eq!(
        old_set.annotations().get("berth.dev/superseded-by"),
        Some(&format!("pool-{hash}"))
    );
    let started =
        support::notes(&support::events_of(&client, ns, "pool", "RolloutStarted", 2).await);
    assert!(
        started
            .iter()
            .any(|n| n.contains("3 old Machines to replace")),
        "{started:?}"
    );
    support::events_of(&client, ns, "pool", "ScaledOldMachineSet", 3).await;
    // One old Machine at a time: each deleted once, and each only once the
    // one before it was gone (its Node deleted, by the audit log).
    let bed = BED.bed().await;
    assert_eq!(
        support::audit::deleted(bed, ns, "machines"),
        support::sorted_names(&old)
    );
    let requests = support::audit::requests(bed, ns);
    let at = |resource: &str, name: &str| {
        requests
            .iter()
            .find(|r| {
                r.verb == "delete"
                    && r.resource == resource
                    && r.code < 400
                    && r.name.as_deref() == Some(name)
            })
            .map(|r| r.received)
            .unwrap_or_else(|| panic!("{resource} {name} deleted"))
    };
    let mut order: Vec<(k8s_openapi::jiff::Timestamp, &Machine)> = old
        .iter()
        .map(|m| (at("machines", &m.name_any()), m))
        .collect();
    order.sort_by_key(|(t, _)| *t);
    for pair in order.windows(2) {
        let (before, next) = (pair[0].1, pair[1]);
        let node = before
            .status
            .as_ref()
            .and_then(|s| s.node_ref.as_ref())
            .map(|n| n.name.clone())
            .expect("its Node");
        assert!(
            at("nodes", &node) < next.0,
            "{} deleted before {}'s Node {node} was gone",
            next.1.name_any(),
            before.name_any()
        );
    }
}

/// The status and reason of `s`'s condition `type_`.
fn status_reason(s: &MachineSet, type_: &str) -> (String, String) {
    let c = support::condition(s, type_).unwrap_or_else(|| panic!("{type_} condition"));
    (c.status.clone(), c.reason.clone())
}
