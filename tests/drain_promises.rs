//! The drain's promises in the cases a review found open, each a failure
//! class, end to end on the real control plane. The truth of every
//! assertion about order and counts is what the cluster did: the API
//! server's audit log of the controller's requests and watches of Pods and
//! VolumeAttachments (`support::oracle`). What berth tells operators
//! (`status.drain`, Events) is checked apart, as what an operator sees.

mod support;

use std::time::Duration;

use berth::api::Machine;
use berth_devkit::testbed::fixtures::{csi_pv, deployment, stateful_set};
use berth_devkit::testbed::{TestBed, wait};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, PodSpec};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use support::audit;
use support::oracle::{self, Seen, Watches, accepted_evictions_of, evictions, requests_once};
use support::pool::{
    Bed, POOL, create, delete_machine, gone, json, on_node, pod_running, pool_class,
    running_machine,
};
use support::{Case, LONG};

const ATTACH_DELAY: Duration = Duration::from_millis(1000);
const DETACH_DELAY: Duration = Duration::from_millis(1000);
const BED: Bed = Bed {
    attach: ATTACH_DELAY,
    detach: DETACH_DELAY,
};

/// How a StatefulSet makes its pods: `OrderedReady` (the Kubernetes
/// default: a later replica only once the earlier ones are available) or
/// `Parallel`.
#[derive(Clone, Copy)]
enum Policy {
    OrderedReady,
    Parallel,
}

/// StatefulSet `name` of `replicas` pods kept to pool `ns`, each with a
/// pre-bound CSI PV `<ns>-<name>-<i>`, made by `policy`; `spec` adjusts its
/// pod template.
async fn stateful(
    client: &Client,
    ns: &str,
    name: &str,
    replicas: i32,
    policy: Policy,
    spec: impl FnOnce(&mut PodSpec),
) {
    support::pool::stateful(client, ns, name, replicas, |sts| {
        {
            let s = &mut sts.spec;
            s.pod_management_policy = Some(
                match policy {
                    Policy::OrderedReady => "OrderedReady",
                    Policy::Parallel => "Parallel",
                }
                .into(),
            );
        }
        if let Some(s) = sts.spec.template.spec.as_mut() {
            spec(s);
        }
    })
    .await;
}

/// Waits until `n` volumes are attached to `node`.
async fn attached_to(client: &Client, node: &str, n: usize) {
    wait::until(
        Api::<VolumeAttachment>::all(client.clone()),
        LONG,
        &format!("{n} volumes attached to {node}"),
        |all| {
            all.iter()
                .filter(|va| {
                    va.spec.node_name == node && va.status.as_ref().is_some_and(|s| s.attached)
                })
                .count()
                == n
        },
    )
    .await
    .expect("the volumes attach");
}

/// Waits until Machine `name`'s `status.drain.blockedBy` contains `needle`
/// (what an operator is told); returns it.
async fn blocked_by(
    client: &Client,
    ns: &str,
    name: &str,
    needle: &str,
    within: Duration,
) -> String {
    let m = wait::for_one(
        Api::<Machine>::namespaced(client.clone(), ns),
        within,
        &format!("{name}: blockedBy names {needle:?}"),
        |m| {
            m.name_any() == name
                && m.status
                    .as_ref()
                    .and_then(|s| s.drain.as_ref())
                    .and_then(|d| d.blocked_by.as_deref())
                    .is_some_and(|b| b.contains(needle))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    m.status
        .as_ref()
        .and_then(|s| s.drain.as_ref())
        .and_then(|d| d.blocked_by.clone())
        .unwrap_or_default()
}

/// A case whose volumes are on CSI driver `driver`, which attaches nothing
/// (`attachRequired: false`); its deadline (10 min) and reattach timeout
/// (5 min) are far beyond what a test waits, so that a volume taken for an
/// attachable one shows as a Machine never gone.
async fn attach_free_case(ns: &str, driver: &str) -> Case {
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m", "volumeReattachTimeout": "5m"}))
        .build()
        .await;
    support::pool::attach_free_driver(&case.client, driver).await;
    case
}

/// StatefulSet `share` of two pods kept to pool `ns`, each with a PV on
/// CSI driver `driver`; `template` adjusts its pod template.
async fn share(
    client: &Client,
    ns: &str,
    driver: &str,
    template: impl FnOnce(&mut k8s_openapi::api::core::v1::PodTemplateSpec),
) {
    for i in 0..2 {
        let pv = support::pool::csi_pv_on(
            driver,
            &format!("{ns}-share-{i}"),
            &format!("share-{i}"),
            ns,
            &format!("data-share-{i}"),
        );
        create(Api::all(client.clone()), pv).await;
    }
    let mut sts: StatefulSet = stateful_set("share", 2, 1);
    {
        let spec = &mut sts.spec;
        if let Some(s) = spec.template.spec.as_mut() {
            s.node_selector = Some([(POOL.to_string(), ns.to_string())].into());
        }
        template(&mut spec.template);
    }
    create(Api::namespaced(client.clone(), ns), sts).await;
}

async fn annotate_pod(client: &Client, ns: &str, pod: &str, key: &str, value: &str) {
    Api::<Pod>::namespaced(client.clone(), ns)
        .patch(
            pod,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {key: value}}})),
        )
        .await
        .expect("annotate the pod");
}

/// The controller's deletion of Node `node`, once it is in the audit log.
async fn node_deleted(bed: &TestBed, ns: &str, node: &str) -> Timestamp {
    let is_it = |r: &berth_devkit::bench::audit::Request| {
        r.verb == "delete" && r.resource == "nodes" && r.name.as_deref() == Some(node)
    };
    let all = requests_once(bed, ns, |rs| rs.iter().any(is_it)).await;
    all.iter()
        .find(|r| is_it(r))
        .map(|r| r.received)
        .unwrap_or_else(|| panic!("no delete of Node {node}:\n{}", oracle::log_of(&all)))
}

/// Class 1. A replica that tolerates berth's cordon and ran on the Node
/// from the start is a replica, not a pod that came back, whatever else of
/// its workload the drain evicted: planned in a later pass (a later order
/// group here; a restart or a held workload does the same), it is evicted,
/// its volume leaves the Node before the VM goes, and no `PodReturned` is
/// said of it. The StatefulSet is `OrderedReady`, the Kubernetes default
/// (the frozen-leader case below uses `Parallel`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_tolerates_the_cordon_is_evicted_in_a_later_pass() {
    let ns = "promise-tolerant";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    // It tolerates berth's cordon taint, not the unschedulable one: the
    // scheduler never puts a replacement back on A.
    stateful(&client, ns, "db", 2, Policy::OrderedReady, |s| {
        s.tolerations = Some(vec![json(serde_json::json!({
            "key": berth::api::CORDON_TAINT_KEY, "operator": "Exists"
        }))]);
    })
    .await;
    attached_to(&client, &node_a, 2).await;
    annotate_pod(
        &client,
        ns,
        "db-1",
        berth::drain::rules::ORDER_ANNOTATION,
        "1",
    )
    .await;
    running_machine(&client, ns, "b", ns).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(180)).await;

    let deleted = node_deleted(BED.bed().await, ns, &node_a).await;
    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    oracle::evicted_once(&all, "db-0", &log);
    let db1 = [oracle::evicted_once(&all, "db-1", &log)];
    let pv0 = format!("{ns}-db-0");
    let pv1 = format!("{ns}-db-1");
    let moved0 = watches
        .attached_elsewhere(BED.bed().await, &pv0, &node_a)
        .await
        .unwrap_or_else(|| panic!("db-0's volume attached elsewhere: {log}"));
    assert!(db1[0].received > moved0, "db-1 after db-0 moved: {log}");
    // The detach as the attacher wrote it (the controller deletes the Node
    // as soon as it sees it: this process's watch may see it later).
    let off1 = watches
        .detached_write(BED.bed().await, &pv1, &node_a)
        .await
        .unwrap_or_else(|| panic!("db-1's volume detached from A: {log}"));
    assert!(off1 < deleted, "db-1's volume left A before A went: {log}");
    // What operators are told: nothing came back.
    let evs = support::pool::events(&client, ns, "a").await;
    assert!(
        !evs.iter().any(|(_, r, _)| r == "PodReturned"),
        "{}",
        support::pool::log_of(&evs)
    );
}

/// Class 3. A controller that is not a DaemonSet recreates its per-node
/// pod bound to the Node by `spec.nodeName` (a storage system's instance
/// manager): the recreated pod came back, bypassing the cordon. It is not
/// evicted again (one eviction in all, by the audit log), and the Machine
/// goes long before its 10 minute deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_recreated_by_name_on_the_node_is_not_evicted_for_ever() {
    let ns = "promise-byname";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    let owner: ConfigMap = Api::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &json(serde_json::json!({"metadata": {"name": "mgr"}})),
        )
        .await
        .expect("the owner");
    let manager = tokio::spawn(per_node_controller(
        client.clone(),
        ns.to_string(),
        node_a.clone(),
        owner,
    ));
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::until(pods, LONG, "mgr running on A", |ps| {
        ps.iter()
            .any(|p| p.name_any().starts_with("mgr-") && on_node(p, &node_a) && pod_running(p))
    })
    .await
    .expect("the per-node pod runs");

    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(90)).await;
    manager.abort();

    let all = requests_once(BED.bed().await, ns, |rs| {
        rs.iter()
            .any(|r| r.resource == "nodes" && r.verb == "delete")
    })
    .await;
    let evicted: Vec<_> = all
        .iter()
        .filter(|r| r.subresource.as_deref() == Some("eviction"))
        .cloned()
        .collect();
    assert_eq!(
        accepted_evictions_of(&evicted, "mgr-*").len(),
        1,
        "the first mgr pod only: {}",
        oracle::log_of(&evicted)
    );
    let evs = support::pool::events(&client, ns, "a").await;
    let returned: Vec<_> = evs.iter().filter(|(_, r, _)| r == "PodReturned").collect();
    assert_eq!(returned.len(), 1, "{}", support::pool::log_of(&evs));
    assert!(returned[0].2.contains("spec.nodeName"), "{:?}", returned[0]);
}

/// Keeps one pod `mgr-<n>` bound to `node` by name, owned by `owner` (a
/// controller that is not a DaemonSet), as long as the Node is there.
async fn per_node_controller(client: Client, ns: String, node: String, owner: ConfigMap) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let nodes: Api<Node> = Api::all(client);
    for n in 0.. {
        match nodes.get_opt(&node).await {
            Ok(Some(_)) => {}
            _ => return,
        }
        let running = pods
            .list(&Default::default())
            .await
            .map(|l| {
                l.items.iter().any(|p| {
                    p.name_any().starts_with("mgr-") && p.metadata.deletion_timestamp.is_none()
                })
            })
            .unwrap_or(true);
        if !running {
            let pod: Pod = json(serde_json::json!({
                "metadata": {
                    "name": format!("mgr-{n}"),
                    "labels": {"app": "mgr"},
                    "ownerReferences": [{
                        "apiVersion": "v1", "kind": "ConfigMap", "name": owner.name_any(),
                        "uid": owner.metadata.uid, "controller": true
                    }]
                },
                "spec": {
                    "nodeName": node,
                    // Long enough for the drain to see the next one come
                    // (deletion times have whole seconds: a grace of 1 s
                    // can end within 0.1 s, the drain with it).
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{"name": "main", "image": "registry.invalid/mgr:1"}]
                }
            }));
            let _ = pods.create(&PostParams::default(), &pod).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Class 6. A volume move is recorded in `status.drain.moves` before its
/// eviction, or there is no eviction: while an admission policy refuses
/// every status write that records a move, the pod is not evicted (the
/// audit log has no eviction and the refused writes), and the operator is
/// told why; once the writes go through, the eviction follows a status
/// write the API server accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_eviction_until_its_move_is_recorded() {
    let ns = "promise-record";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    stateful(&client, ns, "db", 1, Policy::OrderedReady, |_| {}).await;
    attached_to(&client, &node_a, 1).await;
    running_machine(&client, ns, "b", ns).await;
    let label = "test.berth.dev/refuse-moves";
    refuse_recorded_moves(&client, ns, label).await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {label: "true"}}})),
        )
        .await
        .expect("label a");
    policy_in_force(&machines, "a").await;

    delete_machine(&client, ns, "a").await;
    // Told by a Warning (`status.drain` itself cannot be written while the
    // policy refuses it).
    let evs = support::events_until(&client, ns, "a", &["MoveNotRecorded"]).await;
    let told = evs
        .iter()
        .find(|e| e.reason.as_deref() == Some("MoveNotRecorded"))
        .and_then(|e| e.note.clone())
        .unwrap_or_default();
    assert!(
        told.contains(&format!("{ns}/db-0")) && told.contains("refuses to record"),
        "names the pod and the API server's answer: {told}"
    );
    // And in a condition, which the reconciler writes apart.
    wait::for_one(
        Api::<Machine>::namespaced(client.clone(), ns),
        LONG,
        "a condition names the unrecorded move",
        |m| {
            m.name_any() == "a"
                && m.status.as_ref().is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.message.contains("could not be recorded"))
                })
        },
    )
    .await
    .expect("the Drained condition says why nothing is evicted");
    let before = requests_once(BED.bed().await, ns, |rs| {
        rs.iter()
            .any(|r| r.subresource.as_deref() == Some("status") && r.code >= 400)
    })
    .await;
    let log = oracle::log_of(&before);
    assert!(
        !before
            .iter()
            .any(|r| r.subresource.as_deref() == Some("eviction")),
        "no eviction while its move cannot be recorded: {log}"
    );
    assert!(
        before.iter().any(|r| r.resource == "machines"
            && r.subresource.as_deref() == Some("status")
            && r.code >= 400),
        "the refused writes: {log}"
    );

    let allowed_at = Timestamp::now();
    machines
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {label: null}}})),
        )
        .await
        .expect("unlabel a");
    gone(&client, ns, "a", Duration::from_secs(120)).await;
    let all = requests_once(BED.bed().await, ns, |rs| {
        rs.iter()
            .any(|r| r.subresource.as_deref() == Some("eviction") && oracle::accepted(r))
    })
    .await;
    let log = oracle::log_of(&all);
    let evicted = accepted_evictions_of(&all, "db-0");
    assert_eq!(evicted.len(), 1, "{log}");
    let recorded = all.iter().find(|r| {
        r.resource == "machines"
            && r.subresource.as_deref() == Some("status")
            && oracle::accepted(r)
            && r.received > allowed_at
    });
    assert!(
        recorded.is_some_and(|w| w.completed <= evicted[0].received),
        "a status write landed before the eviction: {log}"
    );
}

/// A ValidatingAdmissionPolicy (and its binding) that refuses any status
/// write of a Machine in `ns` carrying `label` that records a volume move.
async fn refuse_recorded_moves(client: &Client, ns: &str, label: &str) {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let name = format!("{ns}-refuse-moves");
    let expression = format!(
        "!(object.metadata.namespace == '{ns}' && has(object.metadata.labels) && '{label}' in object.metadata.labels \
         && has(object.status) && has(object.status.drain) && has(object.status.drain.moves) \
         && size(object.status.drain.moves) > 0)"
    );
    create(
        Api::<ValidatingAdmissionPolicy>::all(client.clone()),
        json(serde_json::json!({
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{
                    "apiGroups": ["berth.dev"], "apiVersions": ["*"],
                    "operations": ["UPDATE"], "resources": ["machines/status"]
                }]},
                "validations": [{"expression": expression, "message": "the test refuses to record volume moves"}]
            }
        })),
    )
    .await;
    create(
        Api::<ValidatingAdmissionPolicyBinding>::all(client.clone()),
        json(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"policyName": name, "validationActions": ["Deny"]}
        })),
    )
    .await;
}

/// Waits until the policy of [`refuse_recorded_moves`] refuses a write
/// (policies take effect a moment after they are created): a probe that
/// records a move on Machine `name`, taken back if it went through.
async fn policy_in_force(machines: &Api<Machine>, name: &str) {
    let probe = serde_json::json!({"status": {"drain": {"moves": [{"pod": "probe/probe", "volumes": []}]}}});
    let clear = serde_json::json!({"status": {"drain": null}});
    let params = PatchParams::default();
    for _ in 0..100 {
        match machines
            .patch_status(name, &params, &Patch::Merge(&probe))
            .await
        {
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 403 || s.code == 400 => return,
            _ => {
                let _ = machines
                    .patch_status(name, &params, &Patch::Merge(&clear))
                    .await;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("the admission policy never took effect");
}

/// Class 4. A pod that two PodDisruptionBudgets select cannot be evicted
/// (the Eviction API answers 500 until one budget goes): it is named at
/// once (`blockedBy` names both budgets), retried at a bounded pace rather
/// than silently, and evicted once a budget goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_two_budgets_select_is_named_and_evicted_once_one_goes() {
    let ns = "promise-budgets";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    create(
        Api::namespaced(client.clone(), ns),
        deployment("web", 1, 1, ns),
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::until(pods, LONG, "web running on A", |ps| {
        ps.iter()
            .any(|p| p.name_any().starts_with("web-") && on_node(p, &node_a) && pod_running(p))
    })
    .await
    .expect("web runs");
    for name in ["web-1", "web-2"] {
        create(
            Api::<PodDisruptionBudget>::namespaced(client.clone(), ns),
            json(serde_json::json!({
                "metadata": {"name": name},
                "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "web"}}}
            })),
        )
        .await;
    }
    running_machine(&client, ns, "b", ns).await;

    delete_machine(&client, ns, "a").await;
    let told = blocked_by(
        &client,
        ns,
        "a",
        "more than one PodDisruptionBudget",
        Duration::from_secs(30),
    )
    .await;
    assert!(
        told.contains(&format!("{ns}/web-1")) && told.contains(&format!("{ns}/web-2")),
        "both budgets named: {told}"
    );
    let refused = evictions(BED.bed().await, ns);
    assert!(
        refused.iter().all(|r| r.code == 500) && !refused.is_empty(),
        "{}",
        oracle::log_of(&refused)
    );

    Api::<PodDisruptionBudget>::namespaced(client.clone(), ns)
        .delete("web-2", &DeleteParams::default())
        .await
        .expect("delete a budget");
    gone(&client, ns, "a", Duration::from_secs(90)).await;
    let all = evictions(BED.bed().await, ns);
    let log = oracle::log_of(&all);
    assert_eq!(accepted_evictions_of(&all, "web-*").len(), 1, "{log}");
    // Retried at the backoff's ceiling (or when a budget changed), not in
    // a loop: a handful of refusals.
    let refusals = all.iter().filter(|r| r.code == 500).count();
    assert!((1..=6).contains(&refusals), "{refusals} refusals: {log}");
}

/// Class 2. The scheduler cannot place the replacement of the last pod of
/// a workload in an order group: the next group (here a pod of order 5, as
/// DNS or a CSI controller would be) is not evicted while that volume is
/// attached nowhere; once a Node comes and the replacement runs there with
/// the volume, it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unplaceable_replacement_holds_the_next_order_group() {
    let ns = "promise-groups";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m", "volumeReattachTimeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    stateful(
        &client,
        ns,
        "db",
        1,
        Policy::OrderedReady,
        support::pool::shuns_blocker,
    )
    .await;
    let mut dns = deployment("dns", 1, 1, ns);
    {
        let t = &mut dns.spec.template;
        t.metadata
            .get_or_insert_default()
            .annotations
            .get_or_insert_default()
            .insert(berth::drain::rules::ORDER_ANNOTATION.into(), "5".into());
    }
    create(Api::namespaced(client.clone(), ns), dns).await;
    attached_to(&client, &node_a, 1).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::until(pods, LONG, "dns running on A", |ps| {
        ps.iter()
            .any(|p| p.name_any().starts_with("dns-") && on_node(p, &node_a) && pod_running(p))
    })
    .await
    .expect("dns runs");
    // The pool's other Node passes berth's destination check, and the
    // scheduler refuses db-0's replacement there (a pod anti-affinity).
    support::pool::refusing_spare(&client, ns, "spare", ns).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    blocked_by(&client, ns, "a", "cannot be scheduled", LONG).await;
    // Without the gate the next group's eviction follows the unplaceable
    // verdict within milliseconds; a few seconds show that it does not.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let early = evictions(BED.bed().await, ns);
    assert!(
        accepted_evictions_of(&early, "dns-*").is_empty(),
        "dns not evicted while db-0's volume is attached nowhere: {}",
        oracle::log_of(&early)
    );

    running_machine(&client, ns, "b", ns).await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;
    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let dns = accepted_evictions_of(&all, "dns-*");
    assert_eq!(dns.len(), 1, "{log}");
    watches
        .assert_after_moved(
            BED.bed().await,
            dns[0],
            &format!("{ns}-db-0"),
            &node_a,
            &log,
        )
        .await;
}

/// Class 9. A drain that fails at its deadline and is retried every 30 s
/// says its once-per-drain things once: a pod skipped by its rule, and a
/// rule it cannot read, are each named in one Event however often the
/// drain is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_drain_does_not_repeat_its_reports() {
    let ns = "promise-retried";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5s", "forceAfterDeadline": false}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_machine(&client, ns, "a", ns).await;
    // A pod a budget keeps (the drain fails at each deadline), with an
    // order the drain cannot read.
    let mut guarded = deployment("guarded", 1, 1, ns);
    {
        let t = &mut guarded.spec.template;
        t.metadata
            .get_or_insert_default()
            .annotations
            .get_or_insert_default()
            .insert(berth::drain::rules::ORDER_ANNOTATION.into(), "soon".into());
    }
    create(Api::namespaced(client.clone(), ns), guarded).await;
    create(
        Api::<PodDisruptionBudget>::namespaced(client.clone(), ns),
        json(serde_json::json!({
            "metadata": {"name": "guarded"},
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "guarded"}}}
        })),
    )
    .await;
    let mut skipped = deployment("skipped", 1, 1, ns);
    {
        let t = &mut skipped.spec.template;
        t.metadata
            .get_or_insert_default()
            .annotations
            .get_or_insert_default()
            .insert(berth::drain::rules::DRAIN_ANNOTATION.into(), "skip".into());
    }
    create(Api::namespaced(client.clone(), ns), skipped).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::until(pods, LONG, "both running on A", |ps| {
        ps.iter()
            .filter(|p| on_node(p, &node_a) && pod_running(p))
            .count()
            == 2
    })
    .await
    .expect("the pods run");

    delete_machine(&client, ns, "a").await;
    let failed = |n: usize| {
        let client = client.clone();
        async move {
            wait::until(
                Api::<k8s_openapi::api::events::v1::Event>::namespaced(client, ns),
                Duration::from_secs(90),
                &format!("{n} DrainFailed"),
                |evs| {
                    evs.iter()
                        .filter(|e| e.reason.as_deref() == Some("DrainFailed"))
                        .map(|e| e.series.as_ref().map_or(1, |s| s.count))
                        .sum::<i32>()
                        >= i32::try_from(n).unwrap_or(i32::MAX)
                },
            )
            .await
            .expect("the drain fails and is retried")
        }
    };
    let evs = failed(2).await;
    let count = |reason: &str| {
        evs.iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .map(|e| e.series.as_ref().map_or(1, |s| s.count))
            .sum::<i32>()
    };
    assert_eq!(count("PodSkipped"), 1, "{evs:?}");
    assert_eq!(count("DrainRuleInvalid"), 1, "{evs:?}");
    case.assert_no_request_loop();
    // Let the Machine go: the budget goes.
    Api::<PodDisruptionBudget>::namespaced(client.clone(), ns)
        .delete("guarded", &DeleteParams::default())
        .await
        .expect("delete the budget");
}

/// Class 5. A leader frozen (SIGSTOP) past its Lease loses it to another
/// replica; when it thaws, it sends nothing that changes the cluster: no
/// write of its identity reaches the API server after the other replica
/// acquired the Lease (by the audit log), and it exits; the new leader
/// finishes the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_wakes_after_losing_its_lease_changes_nothing() {
    use support::process::Berth;
    let ns = "promise-fence";
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
    // The audited identity's: the case's controller.
    let a = case.spawn(&flags("replica-a")).await;
    a.wait_log("caches synced").await;
    let node_a = running_machine(&client, ns, "a", ns).await;
    // db-0 and db-1 take 4 s to stop: the drain is mid-move when frozen.
    stateful(&client, ns, "db", 2, Policy::Parallel, |s| {
        s.termination_grace_period_seconds = Some(4);
    })
    .await;
    attached_to(&client, &node_a, 2).await;
    running_machine(&client, ns, "b", ns).await;

    delete_machine(&client, ns, "a").await;
    wait::for_one(
        Api::<Pod>::namespaced(client.clone(), ns),
        LONG,
        "db-0 evicted",
        |p| p.name_any() == "db-0" && p.metadata.deletion_timestamp.is_some(),
    )
    .await
    .expect("the first eviction");
    case.berth().freeze();
    let b = Berth::spawn(&standby.kubeconfig, &flags("replica-b"));
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let lease = wait::for_one(leases, LONG, "replica-b holds the Lease", |l| {
        l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) == Some("replica-b")
    })
    .await
    .expect("the standby takes over");
    let acquired = lease
        .spec
        .as_ref()
        .and_then(|s| s.acquire_time.as_ref())
        .map(|t| t.0)
        .expect("acquireTime");
    let a = case.take_berth();
    a.resume();
    let status = a.exited().await;
    assert!(!status.success(), "the old leader exits: {status:?}");
    gone(&client, ns, "a", Duration::from_secs(180)).await;

    // The old leader's identity is the audited one. Its election may still
    // try to renew the Lease it lost, and be refused: that changes nothing.
    let after: Vec<_> = oracle::writes(BED.bed().await, ns)
        .into_iter()
        .filter(|r| r.received >= acquired)
        .filter(|r| !(r.resource == "leases" && r.code >= 400))
        .collect();
    assert!(
        after.is_empty(),
        "writes of the old leader after replica-b acquired the Lease at {acquired}:\n{}",
        oracle::log_of(&after)
    );
    drop(b);
}

/// Class 7, the record of the last move. The controller is killed
/// (SIGKILL) during the last stateful pod's reattach wait, once its volume
/// left the Node: the restarted drain resumes that move instead of ending
/// at once with nothing left to evict, and its record goes once the volume
/// is attached where the replacement runs (a pre-terminate hook keeps the
/// Machine to look at `status.drain.moves`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_the_last_reattach_wait_resumes_it_and_clears_its_record() {
    use support::pool::{release_hook, running_held};
    let ns = "promise-lastmove";
    let flags = ["--namespace", ns, "--leader-elect=false"];
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .spawn(&flags)
        .await;
    let client = case.client();
    let node_a = running_held(&client, ns, "a", ns, true).await;
    stateful(&client, ns, "db", 1, Policy::OrderedReady, |_| {}).await;
    attached_to(&client, &node_a, 1).await;
    running_machine(&client, ns, "b", ns).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    let pv = format!("{ns}-db-0");
    wait::until(
        Api::<VolumeAttachment>::all(client.clone()),
        LONG,
        "db-0's volume detached from A",
        |all| {
            !all.iter().any(|va| {
                va.spec.node_name == node_a
                    && va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
            })
        },
    )
    .await
    .expect("the volume detaches");
    case.kill().await;
    case.spawn(&flags).await;

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let m = wait::for_one(machines, Duration::from_secs(120), "a drained", |m| {
        m.name_any() == "a"
            && m.status
                .as_ref()
                .and_then(|s| s.drain.as_ref())
                .is_some_and(|d| d.finished_at.is_some())
    })
    .await
    .expect("the resumed drain finishes");
    let drain = m
        .status
        .as_ref()
        .and_then(|s| s.drain.clone())
        .unwrap_or_default();
    assert!(
        drain.moves.is_empty(),
        "no move left recorded: {:?}\n{}",
        drain.moves,
        watches.log()
    );
    assert!(
        watches.attachment_elsewhere(&pv, &node_a).is_some(),
        "the volume attached where db-0 runs now: {}",
        watches.log()
    );
    release_hook(&client, ns, "a").await;
    gone(&client, ns, "a", LONG).await;
}

/// Class 7, a resumed move follows the rules of a first run. The
/// controller is killed (SIGKILL) while the first pod of a StatefulSet on
/// an attach-free CSI driver waits for its replacement to be Ready (the
/// replacement is held unready for 8 s): the restarted drain classes the
/// recorded volume attach-free too, so it waits for that readiness, not
/// for a VolumeAttachment that never comes (the 5 minute reattach
/// timeout), and the second pod is evicted only once the first one's
/// replacement is Ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_attach_free_move_waits_for_readiness_not_a_timeout() {
    use berth_devkit::testbed::stages::READY_AFTER_ANNOTATION;
    let ns = "promise-resume-free";
    let driver = "attach-free.promises.berth.dev";
    let mut case = attach_free_case(ns, driver).await;
    let client = case.client();
    let flags = ["--namespace", ns, "--leader-elect=false"];
    case.spawn(&flags).await;
    let node_a = running_machine(&client, ns, "a", ns).await;
    share(&client, ns, driver, |t| {
        t.metadata
            .get_or_insert_default()
            .annotations
            .get_or_insert_default()
            .insert(READY_AFTER_ANNOTATION.into(), "8s".into());
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let ready = |p: &Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    };
    let originals = wait::until(pods.clone(), LONG, "share-0 and share-1 Ready on A", |ps| {
        ps.iter()
            .filter(|p| on_node(p, &node_a) && ready(p))
            .count()
            == 2
    })
    .await
    .expect("the pods run");
    let old0 = originals
        .iter()
        .find(|p| p.name_any() == "share-0")
        .and_then(|p| p.metadata.uid.clone());
    running_machine(&client, ns, "b", ns).await;

    delete_machine(&client, ns, "a").await;
    wait::until(pods.clone(), LONG, "the first share-0 gone", |ps| {
        !ps.iter().any(|p| p.metadata.uid == old0)
    })
    .await
    .expect("share-0 goes");
    // Its replacement is not Ready for 8 s: the move waits for it.
    case.kill().await;
    case.spawn(&flags).await;
    gone(&client, ns, "a", Duration::from_secs(90)).await;

    let all = evictions(BED.bed().await, ns);
    let log = oracle::log_of(&all);
    let second = accepted_evictions_of(&all, "share-1");
    assert_eq!(second.len(), 1, "{log}");
    assert_eq!(accepted_evictions_of(&all, "share-0").len(), 1, "{log}");
    let replacement = pods.get("share-0").await.expect("share-0's replacement");
    let started = replacement
        .status
        .as_ref()
        .and_then(|s| s.start_time.as_ref())
        .map(|t| t.0)
        .expect("it started");
    // Ready 8 s after it started (whole seconds): share-1 went after that.
    let ready_at = started
        .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(7))
        .expect("a time");
    assert!(
        second[0].received > ready_at,
        "share-1 evicted at {} only once share-0's replacement (started {started}) was Ready: {log}",
        second[0].received
    );
}

/// Class 7, a held move follows the rules of a first run, across a
/// restart. The scheduler cannot place db-0's replacement (the pool's
/// other Node runs a pod db's pods shun), so the StatefulSet is held: db-1 stays. The
/// controller is killed (SIGKILL) while it is held; the restarted drain
/// still holds it (the move stays recorded). Once Node B comes, db-0's
/// ReadWriteMany volume, which a peer on Node C used all along, has moved
/// only when it is attached on B, where the replacement runs: db-1 is
/// evicted once, after that attach (audit log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_move_survives_a_restart_and_ends_where_its_replacement_runs() {
    let ns = "promise-held";
    let peers = "promise-held-peers";
    let mut case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m", "volumeReattachTimeout": "5m"}))
        .build()
        .await;
    let client = case.client();
    pool_class(&client, peers, serde_json::json!({})).await;
    let flags = ["--namespace", ns, "--leader-elect=false"];
    case.spawn(&flags).await;
    let node_a = running_machine(&client, ns, "a", ns).await;
    let node_c = running_machine(&client, ns, "c", peers).await;
    // db's volumes are ReadWriteMany; a peer on C shares db-0's.
    for i in 0..2 {
        let name = format!("{ns}-db-{i}");
        let mut pv = csi_pv(&name, &format!("vol-{name}"), ns, &format!("data-db-{i}"));
        if let Some(spec) = pv.spec.as_mut() {
            spec.access_modes = Some(vec!["ReadWriteMany".into()]);
        }
        create(Api::all(client.clone()), pv).await;
    }
    let mut sts: StatefulSet = stateful_set("db", 2, 1);
    {
        let spec = &mut sts.spec;
        spec.pod_management_policy = Some("OrderedReady".into());
        for t in spec.volume_claim_templates.iter_mut().flatten() {
            if let Some(s) = t.spec.as_mut() {
                s.access_modes = Some(vec!["ReadWriteMany".into()]);
            }
        }
        if let Some(s) = spec.template.spec.as_mut() {
            s.node_selector = Some([(POOL.to_string(), ns.to_string())].into());
            support::pool::shuns_blocker(s);
        }
    }
    create(Api::namespaced(client.clone(), ns), sts).await;
    attached_to(&client, &node_a, 2).await;
    // The pool's other Node passes berth's destination check, and the
    // scheduler refuses db's replacements there (a pod anti-affinity).
    support::pool::refusing_spare(&client, ns, "spare", ns).await;
    create(
        Api::<Pod>::namespaced(client.clone(), ns),
        json(serde_json::json!({
            "metadata": {"name": "peer"},
            "spec": {
                "nodeName": node_c,
                "containers": [{"name": "c", "image": "peer"}],
                "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "data-db-0"}}]
            }
        })),
    )
    .await;
    attached_to(&client, &node_c, 1).await;
    let watches = Watches::start(&client, ns).await;

    delete_machine(&client, ns, "a").await;
    blocked_by(&client, ns, "a", "cannot be scheduled", LONG).await;
    case.kill().await;
    let restarted = Timestamp::now();
    case.spawn(&flags).await;
    // B comes once the restarted drain has planned: it holds db again (a
    // ReplacementUnschedulable published after the restart: the killed
    // process may have died with its own still queued, so they are not
    // counted) or, without the record, has evicted db-1 (the audit log,
    // which the assertions below judge). The Event is only the moment to
    // go on, never the verdict.
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), ns);
    let until = std::time::Instant::now() + LONG;
    loop {
        let held_again = events
            .list(&Default::default())
            .await
            .expect("list Events")
            .items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("ReplacementUnschedulable")
                    && e.event_time.as_ref().is_some_and(|t| t.0 > restarted)
            });
        let all = evictions(BED.bed().await, ns);
        let db1_gone = !accepted_evictions_of(&all, "db-1").is_empty();
        if held_again || db1_gone {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "the restarted drain neither holds db nor evicts db-1"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let node_b = running_machine(&client, ns, "b", ns).await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;

    let all = evictions(BED.bed().await, ns);
    let log = format!("{}\n{}", oracle::log_of(&all), watches.log());
    oracle::evicted_once(&all, "db-0", &log);
    let db1 = [oracle::evicted_once(&all, "db-1", &log)];
    let on_b = watches
        .attached_on(BED.bed().await, &format!("{ns}-db-0"), &node_b)
        .await
        .unwrap_or_else(|| panic!("db-0's volume attached on B: {log}"));
    assert!(
        db1[0].received > on_b,
        "db-1 evicted only after db-0's volume attached on B, where its replacement runs (not because C had it): {log}"
    );
}

/// Class 8, the CSIDriver cache. `berth run` starts while a Machine's
/// deletion waits, as its identity may not list the CSIDrivers yet (a
/// ClusterRole with all it needs but that): no drain is planned before it
/// knows which drivers attach, since an attach-free volume would be taken
/// for an attachable one and wait for a VolumeAttachment that never comes
/// (the 5 minute reattach timeout). By the audit log: the CSIDrivers'
/// lists refused until the grant, no eviction before it; by the pods'
/// watch, no pod of the workload going before it; then the drain by the
/// rules of the attach-free driver, long before the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_drain_is_planned_before_the_csi_drivers_are_known() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let ns = "promise-csidrivers";
    let driver = "attach-free.csidrivers.berth.dev";
    let mut case = attach_free_case(ns, driver).await;
    let client = case.client();
    // The Machines and the workload, with the usual controller.
    case.start().await;
    let node_a = running_machine(&client, ns, "a", ns).await;
    share(&client, ns, driver, |_| {}).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::until(pods, LONG, "share-0 and share-1 running on A", |ps| {
        ps.iter()
            .filter(|p| on_node(p, &node_a) && pod_running(p))
            .count()
            == 2
    })
    .await
    .expect("the pods run");
    running_machine(&client, ns, "b", ns).await;
    case.stop().await;

    // An identity with everything berth calls but the CSIDrivers.
    let role = format!("{ns}-all-but-csidrivers");
    create(
        Api::<ClusterRole>::all(client.clone()),
        json(serde_json::json!({
            "metadata": {"name": role},
            "rules": [
                {"apiGroups": ["", "apps", "policy", "coordination.k8s.io", "events.k8s.io",
                    "berth.dev", "apiextensions.k8s.io"], "resources": ["*"], "verbs": ["*"]},
                {"apiGroups": ["storage.k8s.io"], "resources": ["volumeattachments", "csinodes"],
                 "verbs": ["*"]},
                {"nonResourceURLs": ["*"], "verbs": ["*"]}
            ]
        })),
    )
    .await;
    let bed = BED.bed().await;
    let id = bed
        .identity_as(&client, "kube-system", audit::RESTRICTED_SA, &role)
        .await
        .expect("the identity");
    delete_machine(&client, ns, "a").await;
    let watches = Watches::start(&client, ns).await;
    // The case's request-loop check is of this identity's requests.
    case.audited_as(audit::restricted_user());
    case.spawn_with(
        &id.kubeconfig,
        &["--namespace", ns, "--leader-elect=false"],
        &[],
    );
    // Refused for a while: long enough that a drain planned without them
    // evicts share-0 (it would within a second of the start).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let granted = Timestamp::now();
    let grant = format!("{ns}-csidrivers");
    create(
        Api::<ClusterRole>::all(client.clone()),
        json(serde_json::json!({
            "metadata": {"name": grant},
            "rules": [{"apiGroups": ["storage.k8s.io"], "resources": ["csidrivers"],
                "verbs": ["list", "watch"]}]
        })),
    )
    .await;
    create(
        Api::<ClusterRoleBinding>::all(client.clone()),
        json(serde_json::json!({
            "metadata": {"name": grant},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": grant},
            "subjects": [{"kind": "ServiceAccount", "name": audit::RESTRICTED_SA, "namespace": "kube-system"}]
        })),
    )
    .await;
    gone(&client, ns, "a", Duration::from_secs(90)).await;

    // By the watch of the pods (the bed audits only the usual controller's
    // requests): no pod of share began to go before the grant (seen
    // before it, it certainly did), and both went after it.
    let seen = watches.seen();
    let going: Vec<_> = seen
        .iter()
        .filter_map(|(t, s)| match s {
            Seen::PodDeleting { name, .. } if name.starts_with("share-") => {
                Some((*t, name.clone()))
            }
            _ => None,
        })
        .collect();
    let log = watches.log();
    assert!(
        going.iter().all(|(t, _)| *t > granted),
        "nothing evicted before the CSIDrivers could be known (granted {granted}): {log}"
    );
    for pod in ["share-0", "share-1"] {
        assert!(going.iter().any(|(_, n)| n == pod), "{pod} evicted: {log}");
    }
    // By the audit log: the refusal was real (the controller asked, and
    // was refused, before the grant), and no eviction was sent before it.
    let user = audit::restricted_user();
    let all = berth_devkit::bench::audit::parse(
        &std::fs::read_to_string(bed.dir().join("audit.log")).expect("the audit log"),
    );
    let lists: Vec<_> = all
        .iter()
        .filter(|r| r.user == user && r.resource == "csidrivers" && r.verb == "list")
        .collect();
    // The grant takes effect when the API server's authorizer has seen it,
    // a moment after it was written: the first list it answers.
    let known = lists
        .iter()
        .find(|r| r.code == 200)
        .map(|r| r.received)
        .expect("the CSIDrivers listed once granted");
    assert!(
        known > granted
            && lists.iter().any(|r| r.code == 403)
            && lists
                .iter()
                .all(|r| (r.code == 403) == (r.received < known)),
        "the CSIDrivers refused before the grant took effect, and only then: {lists:?}"
    );
    let sent: Vec<_> = audit::requests_of(bed, ns, &user)
        .into_iter()
        .filter(|r| r.resource == "pods" && r.subresource.as_deref() == Some("eviction"))
        .collect();
    assert!(
        !sent.is_empty() && sent.iter().all(|r| r.received > known),
        "evictions only after the CSIDrivers were listed ({known}): {sent:?}"
    );
}

/// Class 4, its other half. The API server's own flow control (API
/// Priority and Fairness) turns the controller's evictions away with 429
/// while the pod's budget allows the eviction: that is no budget's refusal.
/// The case's evictions go to a priority level with no seat of its own and
/// none to borrow, whose one request at a time (the least APF runs) is
/// taken by a request whose body never comes; APF rejects every other with
/// a plain-text 429. By the audit log: the evictions refused 429 while the
/// seat is held, retried at a bounded pace, and the pod evicted once, after
/// the seat is freed. What operators are told: `blockedBy` never names the
/// pod, and no `EvictionBlocked` Warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_the_api_server_throttles_is_not_a_budget_refusal() {
    use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
    let ns = "promise-throttled";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "10m"}))
        .start()
        .await;
    let client = case.client();
    let bed = case.bed;
    let node_a = running_machine(&client, ns, "a", ns).await;
    create(
        Api::namespaced(client.clone(), ns),
        deployment("web", 1, 1, ns),
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::until(pods, LONG, "web running on A", |ps| {
        ps.iter()
            .any(|p| p.name_any().starts_with("web-") && on_node(p, &node_a) && pod_running(p))
    })
    .await
    .expect("web runs");
    create(
        Api::<PodDisruptionBudget>::namespaced(client.clone(), ns),
        json(serde_json::json!({
            "metadata": {"name": "web"},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "web"}}}
        })),
    )
    .await;
    running_machine(&client, ns, "b", ns).await;

    // The priority level, and the flow schema that sends the case's
    // evictions to it: the controller's and a holder's.
    let holder = bed
        .identity(&client, ns, "seat-holder")
        .await
        .expect("the holder's identity");
    create(
        Api::<PriorityLevelConfiguration>::all(client.clone()),
        json(serde_json::json!({
            "metadata": {"name": ns},
            "spec": {"type": "Limited", "limited": {
                "nominalConcurrencyShares": 0, "lendablePercent": 0, "borrowingLimitPercent": 0,
                "limitResponse": {"type": "Reject"}
            }}
        })),
    )
    .await;
    create(
        Api::<FlowSchema>::all(client.clone()),
        json(serde_json::json!({
            "metadata": {"name": ns},
            "spec": {
                "priorityLevelConfiguration": {"name": ns},
                "matchingPrecedence": 100,
                "rules": [{
                    "subjects": [
                        {"kind": "User", "user": {"name": audit::controller_user()}},
                        {"kind": "User", "user": {"name": holder.user}}
                    ],
                    "resourceRules": [{"verbs": ["create"], "apiGroups": [""],
                        "resources": ["pods/eviction"], "namespaces": [ns]}]
                }]
            }
        })),
    )
    .await;
    // The holder's eviction of a pod that does not exist, whose body never
    // comes: it holds the level's one seat until it is killed.
    let ca = bed.dir().join(format!("{ns}-ca.pem"));
    std::fs::write(&ca, bed.ca_pem().expect("the bed's CA")).expect("write the CA");
    let url = format!("{}/api/v1/namespaces/{ns}/pods/held/eviction", bed.server());
    let mut hold = tokio::process::Command::new("curl")
        .args(["-sS", "--cacert"])
        .arg(&ca)
        .args(["-H", "Content-Type: application/json", "-H", "Expect:"])
        .arg("-H")
        .arg(format!("Authorization: Bearer {}", holder.token))
        .args(["-X", "POST", "-T", "-", &url])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("curl runs");
    // In force once the holder's own probe is turned away.
    let probe: Api<Pod> = Api::namespaced(holder.client().await.expect("client"), ns);
    let until = std::time::Instant::now() + LONG;
    loop {
        match probe.evict("probe", &Default::default()).await {
            Err(kube::Error::Api(s)) if s.code == 429 => break,
            _ => {}
        }
        assert!(std::time::Instant::now() < until, "the seat is never held");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Everything Machine a's status says of blocks while it drains.
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let told = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let watching = {
        let told = told.clone();
        tokio::spawn(async move {
            use futures::StreamExt;
            let mut stream = kube::runtime::watcher(machines, Default::default()).boxed();
            while let Some(ev) = stream.next().await {
                if let Ok(kube::runtime::watcher::Event::Apply(m)) = ev
                    && m.name_any() == "a"
                    && let Some(b) = m
                        .status
                        .as_ref()
                        .and_then(|s| s.drain.as_ref())
                        .and_then(|d| d.blocked_by.clone())
                {
                    told.lock().expect("lock").push(b);
                }
            }
        })
    };
    delete_machine(&client, ns, "a").await;
    let throttled = |all: &[berth_devkit::bench::audit::Request]| {
        all.iter()
            .filter(|r| r.resource == "pods" && r.subresource.as_deref() == Some("eviction"))
            .filter(|r| r.code == 429)
            .count()
    };
    let until = std::time::Instant::now() + LONG;
    while throttled(&evictions(bed, ns)) < 3 {
        assert!(
            std::time::Instant::now() < until,
            "no three throttled evictions: {}",
            oracle::log_of(&evictions(bed, ns))
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let freed = Timestamp::now();
    hold.kill().await.expect("kill the holder");
    gone(&client, ns, "a", Duration::from_secs(90)).await;
    watching.abort();

    let all = evictions(bed, ns);
    let log = oracle::log_of(&all);
    let accepted = accepted_evictions_of(&all, "web-*");
    assert!(
        accepted.len() == 1 && accepted[0].received > freed,
        "web evicted once, after the seat was freed ({freed}): {log}"
    );
    assert!(
        all.iter().all(|r| r.code == 429 || oracle::accepted(r)),
        "nothing but throttled and accepted evictions: {log}"
    );
    // Retried at a bounded pace, not in a loop: after the Retry-After the
    // API server gives, or the backoff's pause, never less than half a
    // second. How many came before the seat was freed is the test's
    // reaction on a loaded machine: the pace is what is counted.
    let throttled_n = throttled(&all);
    let at: Vec<_> = all
        .iter()
        .filter(|r| r.code == 429)
        .map(|r| r.received)
        .collect();
    let span = match (at.first(), at.last()) {
        (Some(a), Some(b)) => b.duration_since(*a).as_secs_f64(),
        _ => 0.0,
    };
    assert!(
        throttled_n >= 3 && throttled_n as f64 <= 1.0 + span / 0.4,
        "{throttled_n} throttled in {span:.1} s: {log}"
    );
    let told = told.lock().expect("lock").clone();
    assert!(
        told.iter().all(|b| !b.contains("web-")),
        "a throttled eviction is no block of the pod: {told:?}"
    );
    let warned: Vec<_> = Api::<k8s_openapi::api::core::v1::Event>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await
        .expect("list Events")
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("EvictionBlocked"))
        .map(|e| e.message.unwrap_or_default())
        .collect();
    assert!(warned.is_empty(), "no EvictionBlocked Warning: {warned:?}");
    drop(hold);
}

/// An eviction is pinned to the UID of the pod the drain planned: when
/// that pod is gone and another took its name (a StatefulSet's replacement,
/// here a pod made again by the test), the eviction answers that the pod is
/// gone and the new pod is left alone, by the real API server's answer and
/// the new pod's own state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_never_takes_the_pod_that_took_the_name() {
    use berth::drain::pod_writes::{Evicted, evict};
    let ns = "promise-pinned";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({}))
        .build()
        .await;
    let client = case.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    // Kept Pending (no Node has the label): an eviction works the same.
    let pod = || -> Pod {
        json(serde_json::json!({
            "metadata": {"name": "db-0"},
            "spec": {
                "nodeSelector": {"pinned.berth.dev/nowhere": "true"},
                "containers": [{"name": "c", "image": "db"}]
            }
        }))
    };
    let old = pods
        .create(&PostParams::default(), &pod())
        .await
        .expect("the first db-0");
    pods.delete("db-0", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete it");
    let until = std::time::Instant::now() + LONG;
    while pods.get_opt("db-0").await.expect("read").is_some() {
        assert!(std::time::Instant::now() < until, "db-0 never goes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let new = pods
        .create(&PostParams::default(), &pod())
        .await
        .expect("the second db-0");
    assert_ne!(old.uid(), new.uid());

    let answer = evict(&client, &old).await;
    assert!(matches!(answer, Evicted::Gone), "{answer:?}");
    let now = pods.get("db-0").await.expect("db-0 is there");
    assert!(
        now.uid() == new.uid() && now.metadata.deletion_timestamp.is_none(),
        "the pod that took the name is untouched: {:?}",
        now.metadata
    );
    // And the pod itself is evicted.
    let answer = evict(&client, &new).await;
    assert!(matches!(answer, Evicted::Accepted), "{answer:?}");
}
