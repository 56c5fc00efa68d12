//! The Machine lifecycle against a real control plane: creation, deletion,
//! resumption after a controller restart, and bad input.

mod support;

use berth::api::{Machine, MachineClass, PRE_TERMINATE_HOOK_PREFIX};
use berth::providers::fake::FakeProvider;
use berth_devkit::testbed::wait;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use support::*;

async fn create_class(client: &Client, name: &str, provider: &str, spec: serde_json::Value) {
    let classes: Api<MachineClass> = Api::all(client.clone());
    classes
        .create(&PostParams::default(), &class(name, provider, spec))
        .await
        .expect("create class");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_is_created_then_deleted_with_its_vm_and_node() {
    let ns = "lifecycle-basic";
    let mut case = Case::builder(ns).run_as_admin().build().await;
    let client = case.client();
    create_class(
        &client,
        "basic",
        "fake",
        serde_json::json!({"failCreateTimes": 1}),
    )
    .await;
    case.start_as("basic").await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .create(&PostParams::default(), &machine("m1", "basic"))
        .await
        .expect("create machine");

    // One injected transient create failure, then the VM, the Node, Running.
    let m = wait_machine(&client, ns, "m1", "m1 Running", |m| {
        phase(m) == Some("Running")
    })
    .await;
    let node_name = FakeProvider::node_name(ns, "m1");
    assert_eq!(
        m.spec.provider_id.as_deref(),
        Some(FakeProvider::provider_id(ns, "m1").as_str())
    );
    assert_eq!(
        m.status
            .as_ref()
            .and_then(|s| s.node_ref.as_ref())
            .map(|r| r.name.as_str()),
        Some(node_name.as_str())
    );
    assert_eq!(
        condition(&m, "Ready").map(|c| c.status.as_str()),
        Some("True")
    );
    assert!(m.finalizers().iter().any(|f| f == berth::api::FINALIZER));
    let node = Api::<Node>::all(client.clone())
        .get(&node_name)
        .await
        .expect("node registered");
    assert_eq!(
        node.spec.as_ref().and_then(|s| s.provider_id.clone()),
        m.spec.provider_id
    );
    let vms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let vm = vms.get("fake-vm-m1").await.expect("the fake VM exists");
    assert_eq!(
        vm.data
            .as_ref()
            .and_then(|d| d.get("failedCreates"))
            .map(String::as_str),
        Some("1")
    );

    // Deletion of a Machine whose Node runs nothing: cordon, no drain,
    // VM and Node deleted, finalizer removed.
    machines
        .delete("m1", &DeleteParams::default())
        .await
        .expect("delete");
    wait::for_none(machines.clone(), LONG, "m1 gone", |m| m.name_any() == "m1")
        .await
        .expect("the Machine goes away once its finalizer is removed");
    assert_vm_and_node_gone(&client, ns, "m1", &node_name).await;
    let reasons: Vec<String> =
        reasons(&events_until(&client, ns, "m1", &["DeleteVmAndNode"]).await);
    for step in [
        "CreateVm",
        "Running",
        "MarkTerminating",
        "Cordon",
        "DeleteVmAndNode",
    ] {
        assert!(
            reasons.iter().any(|r| r == step),
            "an Event for {step}: {reasons:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletion_waits_for_pods_and_resumes_after_a_restart() {
    let ns = "lifecycle-resume";
    let mut case = Case::builder(ns).run_as_admin().build().await;
    let client = case.client();
    create_class(
        &client,
        "resume",
        "fake",
        serde_json::json!({"nodeLabels": {"pool": "resume"}}),
    )
    .await;
    case.start_as("resume-1").await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let mut m = machine("m2", "resume");
    m.annotations_mut().insert(
        format!("{PRE_TERMINATE_HOOK_PREFIX}backup"),
        "pending".into(),
    );
    machines
        .create(&PostParams::default(), &m)
        .await
        .expect("create");
    wait_machine(&client, ns, "m2", "m2 Running", |m| {
        phase(m) == Some("Running")
    })
    .await;
    let node_name = FakeProvider::node_name(ns, "m2");

    // A pod on the Machine's Node, guarded by a PodDisruptionBudget that
    // allows no disruption: it holds the drain step.
    let pdb: PodDisruptionBudget = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "app-pdb"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "resume"}}}
    }))
    .expect("pdb");
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), ns);
    pdbs.create(&PostParams::default(), &pdb)
        .await
        .expect("create pdb");
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "app", "labels": {"app": "resume"}},
        "spec": {
            "nodeName": node_name,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "registry.invalid/app:1"}]
        }
    }))
    .expect("pod");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
    wait::for_one(pdbs.clone(), LONG, "the PDB counts the pod", |p| {
        p.status.as_ref().is_some_and(|s| {
            s.current_healthy.unwrap_or(0) == 1
                && s.expected_pods.unwrap_or(0) == 1
                && s.disruptions_allowed.unwrap_or(0) == 0
        })
    })
    .await
    .expect("the disruption controller computes the PDB");
    machines
        .delete("m2", &DeleteParams::default())
        .await
        .expect("delete");
    // The step's report and the engine's progress (written at most once a
    // second) both say so.
    let m = wait_machine(&client, ns, "m2", "held at Drain", |m| {
        last_step(m) == Some(("Drain".into(), "Waiting".into()))
            && m.status
                .as_ref()
                .and_then(|s| s.drain.as_ref())
                .is_some_and(|d| d.blocked_by.is_some() && d.pods_remaining == 1)
    })
    .await;
    let desc = m
        .status
        .as_ref()
        .and_then(|s| s.last_operation.as_ref())
        .map(|o| o.description.clone());
    assert!(
        desc.as_deref().unwrap_or("").contains(&format!("{ns}/app")),
        "says which pod: {desc:?}"
    );
    assert_eq!(
        m.status
            .as_ref()
            .and_then(|s| s.drain.as_ref())
            .map(|d| d.pods_remaining),
        Some(1)
    );
    let node = Api::<Node>::all(client.clone())
        .get(&node_name)
        .await
        .expect("node");
    assert_eq!(
        node.spec.as_ref().and_then(|s| s.unschedulable),
        Some(true),
        "cordoned"
    );
    assert!(
        node.spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|ts| ts.iter().any(|t| t.key == berth::api::CORDON_TAINT_KEY)),
        "berth's taint is on the Node"
    );

    let blocked_by = m
        .status
        .as_ref()
        .and_then(|s| s.drain.as_ref())
        .and_then(|d| d.blocked_by.clone())
        .unwrap_or_default();
    assert!(
        blocked_by.contains("app-pdb") && blocked_by.contains("misconfigured"),
        "names the PDB and why it can never allow the eviction: {blocked_by}"
    );
    // status.drain has one writer, the engine's, by server-side apply on
    // the status subresource, and it records when the drain started.
    let fresh = Api::<Machine>::namespaced(client.clone(), ns)
        .get("m2")
        .await
        .expect("get m2");
    let applied = fresh.metadata.managed_fields.iter().flatten().any(|f| {
        f.manager.as_deref() == Some("berth-drain")
            && f.operation.as_deref() == Some("Apply")
            && f.subresource.as_deref() == Some("status")
    });
    assert!(
        applied,
        "berth-drain applies status.drain: {:?}",
        fresh.metadata.managed_fields
    );
    let started = fresh
        .status
        .as_ref()
        .and_then(|s| s.drain.as_ref())
        .and_then(|d| d.started_at.clone());
    assert_eq!(started, fresh.metadata.deletion_timestamp);

    // Restart the controller in the middle of the drain: the new instance
    // is blocked by the same PDB and evicts nothing else.
    case.stop().await;
    case.start_as("resume-mid").await;
    wait_machine(&client, ns, "m2", "still held at Drain", |m| {
        last_step(m) == Some(("Drain".into(), "Waiting".into()))
    })
    .await;
    assert!(pods.get_opt("app").await.expect("get pod").is_some());

    // Relax the budget: the PDB change wakes the eviction, the pod goes,
    // and the deletion moves on to the pre-terminate hook.
    pdbs.delete("app-pdb", &DeleteParams::default())
        .await
        .expect("delete pdb");
    wait_machine(&client, ns, "m2", "held by the hook", |m| {
        last_step(m) == Some(("WaitPreTerminateHooks".into(), "Waiting".into()))
    })
    .await;

    // Restart the controller in the middle of the deletion.
    case.stop().await;
    case.start_as("resume-2").await;
    // The new instance resumes at the same step: it does not start over.
    let m = wait_machine(&client, ns, "m2", "still held by the hook", |m| {
        last_step(m) == Some(("WaitPreTerminateHooks".into(), "Waiting".into()))
    })
    .await;
    assert_eq!(phase(&m), Some("Terminating"));
    assert!(
        Api::<Node>::all(client.clone())
            .get_opt(&node_name)
            .await
            .expect("get")
            .is_some()
    );

    // Remove the hook: the VM and Node go, then the Machine.
    let hook = format!("{PRE_TERMINATE_HOOK_PREFIX}backup");
    machines
        .patch(
            "m2",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {hook: null}}})),
        )
        .await
        .expect("remove hook");
    wait::for_none(machines.clone(), LONG, "m2 gone", |m| m.name_any() == "m2")
        .await
        .expect("deletion completes after the restart");
    assert!(
        Api::<Node>::all(client.clone())
            .get_opt(&node_name)
            .await
            .expect("get")
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_becomes_a_condition_and_an_event_and_nothing_is_deleted() {
    let ns = "lifecycle-bad";
    let mut case = Case::builder(ns).run_as_admin().build().await;
    let client = case.client();
    create_class(&client, "unknown-provider", "nimbus", serde_json::json!({})).await;
    create_class(
        &client,
        "typo",
        "fake",
        serde_json::json!({"failCreateTime": 1}),
    )
    .await;
    case.start_as("bad").await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);

    let mut zero = machine("zero-timeout", "typo");
    zero.spec.drain = Some(berth::api::DrainSettings {
        timeout: Some("0s".into()),
        ..Default::default()
    });
    // Fix the class reference of `zero` so that the settings are what fails.
    create_class(&client, "good", "fake", serde_json::json!({})).await;
    zero.spec.class_ref.name = "good".into();
    let cases = [
        (
            machine("no-class", "missing"),
            "ClassNotFound",
            "does not exist",
        ),
        (
            machine("no-provider", "unknown-provider"),
            "UnknownProvider",
            "nimbus",
        ),
        (
            machine("bad-spec", "typo"),
            "InvalidProviderSpec",
            "failCreateTime",
        ),
        (zero, "InvalidSettings", "drain.timeout"),
    ];
    for (m, _, _) in &cases {
        machines
            .create(&PostParams::default(), m)
            .await
            .expect("create");
    }
    for (m, reason, needle) in &cases {
        let name = m.name_any();
        let got = wait_machine(&client, ns, &name, reason, |m| {
            condition(m, "Ready").is_some_and(|c| c.reason == *reason)
        })
        .await;
        let c = condition(&got, "Ready").expect("condition");
        assert_eq!(c.status, "False");
        assert!(
            c.message.contains(needle),
            "{name}: {:?} mentions {needle}",
            c.message
        );
        assert!(got.spec.provider_id.is_none(), "{name}: no VM was created");
        // The Event is published just after the status is written.
        wait::until(
            Api::<Event>::namespaced(client.clone(), ns),
            LONG,
            &format!("{name}: a Warning Event {reason}"),
            |evs| {
                evs.iter().any(|e| {
                    e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())
                        && e.reason.as_deref() == Some(*reason)
                        && e.type_.as_deref() == Some("Warning")
                })
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
    let nodes = Api::<Node>::all(client.clone())
        .list(&Default::default())
        .await
        .expect("list");
    assert!(
        !nodes
            .items
            .iter()
            .any(|n| n.name_any().starts_with(&format!("{ns}-"))),
        "no Node was registered for an invalid Machine"
    );

    // Syntax the apiserver can check is refused at the door, with the reason.
    let mut bad = machine("bad-duration", "good");
    bad.spec.drain = Some(berth::api::DrainSettings {
        volume_detach_timeout: Some("two minutes".into()),
        ..Default::default()
    });
    match machines.create(&PostParams::default(), &bad).await {
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 422);
            assert!(e.message.contains("must be a duration"), "{}", e.message);
        }
        other => panic!("the apiserver must refuse a bad duration, got {other:?}"),
    }

    // A Machine with invalid input can still be deleted; nothing else is.
    machines
        .delete("no-class", &DeleteParams::default())
        .await
        .expect("delete");
    wait::for_none(machines.clone(), LONG, "no-class gone", |m| {
        m.name_any() == "no-class"
    })
    .await
    .expect("a Machine that never had a VM is released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_force_deletion_label_skips_hooks_and_drain_and_force_deletes_pods() {
    let ns = "lifecycle-force";
    let mut case = Case::builder(ns).build().await;
    let client = case.client();
    create_class(
        &client,
        "force",
        "fake",
        serde_json::json!({"nodeLabels": {"pool": "force"}}),
    )
    .await;
    // As its own identity: the audit log shows its requests.
    case.start_as("force-1").await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let mut m = machine("m4", "force");
    // A pre-drain hook would hold a normal deletion forever.
    m.annotations_mut().insert(
        format!("{}backup", berth::api::PRE_DRAIN_HOOK_PREFIX),
        "pending".into(),
    );
    machines
        .create(&PostParams::default(), &m)
        .await
        .expect("create");
    wait_machine(&client, ns, "m4", "m4 Running", |m| {
        phase(m) == Some("Running")
    })
    .await;
    let node_name = FakeProvider::node_name(ns, "m4");

    // A pod that would take ten minutes to stop gracefully.
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "slow"},
        "spec": {
            "nodeName": node_name,
            "terminationGracePeriodSeconds": 600,
            "containers": [{"name": "main", "image": "registry.invalid/app:1"}]
        }
    }))
    .expect("pod");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
    // A DaemonSet's pod (its controller would recreate it: left to the
    // VM's end), and a pod a finalizer holds (deleted once, not in a loop).
    let extra: [Pod; 2] = [
        serde_json::from_value(serde_json::json!({
            // A DaemonSet of another API group (OpenKruise's), which the
            // test bed does not serve: the garbage collector leaves the pod
            // alone, and berth goes by the kind, as kubectl drain does.
            "metadata": {"name": "agent", "ownerReferences": [{
                "apiVersion": "apps.kruise.io/v1alpha1", "kind": "DaemonSet", "name": "agent",
                "uid": "00000000-0000-0000-0000-000000000001", "controller": true
            }]},
            "spec": {
                "nodeName": node_name,
                "containers": [{"name": "main", "image": "registry.invalid/agent:1"}]
            }
        }))
        .expect("pod"),
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "kept", "finalizers": ["example.com/keep"]},
            "spec": {
                "nodeName": node_name,
                "containers": [{"name": "main", "image": "registry.invalid/app:1"}]
            }
        }))
        .expect("pod"),
    ];
    for p in &extra {
        pods.create(&PostParams::default(), p)
            .await
            .expect("create pod");
    }
    machines
        .patch(
            "m4",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": {"labels": {berth::api::FORCE_DELETION_LABEL: "true"}}
            })),
        )
        .await
        .expect("label");
    let started = std::time::Instant::now();
    machines
        .delete("m4", &DeleteParams::default())
        .await
        .expect("delete");
    wait::for_none(machines.clone(), LONG, "m4 gone", |m| m.name_any() == "m4")
        .await
        .expect("forced deletion completes despite the hook and the pod");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "the pod's 600s grace period was not honoured"
    );
    assert!(
        pods.get_opt("slow").await.expect("get pod").is_none(),
        "the pod was force-deleted"
    );
    let agent = pods.get("agent").await.expect("the DaemonSet's pod stays");
    assert_eq!(
        agent.metadata.deletion_timestamp, None,
        "a DaemonSet's pod is left to the VM's end"
    );
    let kept = pods.get("kept").await.expect("the finalizer holds it");
    assert_eq!(
        kept.metadata.deletion_grace_period_seconds,
        Some(0),
        "force-deleted once"
    );
    pods.patch(
        "kept",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
    )
    .await
    .expect("release the pod");
    support::assert_vm_and_node_gone(&client, ns, "m4", &node_name).await;
    // What the controller did: no cordon (no change to the Node it made)
    // and no eviction, by the audit log.
    let done: Vec<String> = audit::requests(bed().await, ns)
        .iter()
        .filter(|r| {
            (r.resource == "nodes" && matches!(r.verb.as_str(), "patch" | "update"))
                || r.subresource.as_deref() == Some("eviction")
        })
        .map(|r| format!("{} {:?}", r.kind(), r.name))
        .collect();
    assert!(done.is_empty(), "no cordon, no eviction: {done:?}");
    // What operators are told.
    let reasons: Vec<String> =
        reasons(&events_until(&client, ns, "m4", &["DeleteVmAndNode"]).await);
    assert!(
        !reasons
            .iter()
            .any(|r| r.contains("PreDrain") || r.contains("Cordon")),
        "no hook wait, no cordon: {reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("ForceDeletePods")),
        "the forced pod deletion is on record: {reasons:?}"
    );
}

/// The reconciler's status write is a compare-and-swap on the Machine's
/// resourceVersion: a status computed from an older copy is refused rather
/// than laid over a newer one, and `status.drain` (the drain engine's) is
/// never written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_built_from_a_stale_copy_never_overwrites_a_newer_one() {
    use berth::api::MachineStatus;
    use berth::machine::write::{StatusWrite, write_status};

    let ns = "lifecycle-stale-write";
    let case = Case::builder(ns).build().await;
    let client = case.client();
    // No controller runs here: this test is the only writer.
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let a = machines
        .create(&PostParams::default(), &machine("m1", "no-such-class"))
        .await
        .expect("create machine");
    let status = |step: &str, cond: &str| -> MachineStatus {
        serde_json::from_value(serde_json::json!({
            "phase": "Terminating",
            "conditions": [{
                "type": cond, "status": "False", "reason": step, "message": step,
                "lastTransitionTime": "2026-11-21T06:00:00Z"
            }],
            "lastOperation": {
                "type": "Delete", "step": step, "state": "Waiting", "description": step,
                "lastUpdateTime": "2026-11-21T06:00:00Z"
            },
            "drain": {"podsTotal": 9}
        }))
        .expect("status")
    };
    let written = |w: StatusWrite| match w {
        StatusWrite::Written(m) => *m,
        StatusWrite::Conflict => panic!("refused a write from the current copy"),
    };

    // Copy A writes; the copy it gets back (B) writes a newer status.
    let b = written(
        write_status(client.clone(), &a, &status("Cordon", "Ready"), || None)
            .await
            .expect("write from A"),
    );
    let newer = status("Drain", "Drained");
    let c = written(
        write_status(client.clone(), &b, &newer, || None)
            .await
            .expect("write from B"),
    );

    // A write built from A (or B) now is refused, changed or not.
    for (stale, what) in [(&a, "A"), (&b, "B")] {
        let w = write_status(
            client.clone(),
            stale,
            &status("Stale", "VolumesDetached"),
            || None,
        )
        .await
        .expect("write from a stale copy");
        assert!(matches!(w, StatusWrite::Conflict), "{what}: {w:?}");
    }
    let unchanged = write_status(
        client.clone(),
        &b,
        b.status.as_ref().expect("status"),
        || None,
    )
    .await
    .expect("no-op write from B");
    assert!(
        matches!(unchanged, StatusWrite::Conflict),
        "even a write that changes nothing checks the copy: {unchanged:?}"
    );

    let now = machines.get("m1").await.expect("get");
    let s = now.status.as_ref().expect("status");
    assert_eq!(
        s.last_operation.as_ref().map(|o| o.step.as_str()),
        Some("Drain"),
        "the newer lastOperation survives"
    );
    assert_eq!(
        s.conditions
            .iter()
            .map(|c| (c.type_.as_str(), c.reason.as_str()))
            .collect::<Vec<_>>(),
        [("Drained", "Drain")],
        "the newer conditions survive"
    );
    assert_eq!(s.drain, None, "status.drain is never written");

    // From the current copy a write that changes nothing goes through
    // without a new resourceVersion: that is how the reconciler proves its
    // copy is current before it asks a provider for a VM.
    let same = written(
        write_status(client.clone(), &c, &newer, || None)
            .await
            .expect("no-op write from C"),
    );
    assert_eq!(same.resource_version(), c.resource_version());

    // The drain engine writes status.drain (up to once a second while a
    // drain runs). That alone does not make C stale: the write leaves the
    // field as it is and goes through on the newer version.
    machines
        .patch_status(
            "m1",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"drain": {"podsTotal": 3}}})),
        )
        .await
        .expect("the engine's write");
    let d = written(
        write_status(
            client.clone(),
            &c,
            &status("WaitVolumesDetached", "VolumesDetached"),
            || None,
        )
        .await
        .expect("write from C after the engine's"),
    );
    let s = d.status.as_ref().expect("status");
    assert_eq!(s.drain.as_ref().map(|d| d.pods_total), Some(3));
    assert_eq!(
        s.last_operation.as_ref().map(|o| o.step.as_str()),
        Some("WaitVolumesDetached")
    );
    // But C is stale now that its own kind of write came after it.
    let w = write_status(client.clone(), &c, &newer, || None)
        .await
        .expect("write from C");
    assert!(matches!(w, StatusWrite::Conflict), "{w:?}");

    // The engine keeps the Machine its last write returned and offers it
    // to the reconciler, which retries on it without reading the Machine
    // again.
    let e = machines
        .patch_status(
            "m1",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"drain": {"podsTotal": 2}}})),
        )
        .await
        .expect("the engine's second write");
    let asked = std::sync::atomic::AtomicUsize::new(0);
    let f = written(
        write_status(client.clone(), &d, &newer, || {
            asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(e.clone())
        })
        .await
        .expect("write from D after the engine's"),
    );
    assert_eq!(asked.into_inner(), 1, "the engine's copy was asked for");
    let s = f.status.as_ref().expect("status");
    assert_eq!(s.drain.as_ref().map(|d| d.pods_total), Some(2));
    assert_eq!(
        s.last_operation.as_ref().map(|o| o.step.as_str()),
        Some("Drain")
    );
}

/// Recording the VM request wakes the Machine again, and that reconcile may
/// read a copy from before the providerID was recorded: its status write
/// is refused, so it does not ask the provider for a second VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_machine_asks_its_provider_for_one_vm() {
    const MACHINES: usize = 8;
    let ns = "lifecycle-one-create";
    let mut case = Case::builder(ns).run_as_admin().build().await;
    let client = case.client();
    create_class(&client, "one-create", "fake", serde_json::json!({})).await;
    case.start_as("one-create").await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    for i in 0..MACHINES {
        let mut m = machine(&format!("m{i}"), "one-create");
        // Deleted at the end without a drain.
        m.labels_mut()
            .insert(berth::api::FORCE_DELETION_LABEL.into(), "true".into());
        machines
            .create(&PostParams::default(), &m)
            .await
            .expect("create machine");
    }
    wait::until(machines.clone(), LONG, "every Machine Running", |ms| {
        ms.iter().filter(|m| phase(m) == Some("Running")).count() == MACHINES
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let creates = case
        .running()
        .metrics()
        .provider_requests
        .with_label_values(&["fake", "create", "ok"])
        .get();
    assert_eq!(creates, MACHINES as u64, "one provider create per Machine");

    for i in 0..MACHINES {
        machines
            .delete(&format!("m{i}"), &DeleteParams::default())
            .await
            .expect("delete");
    }
    wait::until(machines, LONG, "every Machine gone", |ms| ms.is_empty())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}
