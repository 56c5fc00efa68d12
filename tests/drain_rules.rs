//! Drain tiers and drain rules, end to end on the test bed: critical pods
//! leave after every other pod has gone and its volumes have moved; a pod
//! its owner marks `skip` is left to the VM; a pod marked `wait-completed`
//! is waited on until it completes, and at the deadline when it does not.
//! Each also checks what `berth plan` says.

mod support;

use std::time::Duration;

use berth::api::Machine;
use berth_devkit::testbed::fixtures::{csi_pv, stateful_set_in_pool};
use berth_devkit::testbed::stages::COMPLETE_AFTER_ANNOTATION;
use berth_devkit::testbed::wait;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::Api;
use support::oracle::{self, Seen, Watches, accepted_evictions_of, evictions};
use support::pool::{
    Bed, Ev, assert_contains, create, delete_machine, events, first, gone, json, log_of, plan_text,
    release_hook, running_held, running_pods,
};
use support::{Case, LONG};

const ATTACH_DELAY: Duration = Duration::from_secs(3);
const DETACH_DELAY: Duration = Duration::from_secs(1);
const BED: Bed = Bed {
    attach: ATTACH_DELAY,
    detach: DETACH_DELAY,
};
const DRAIN: &str = "berth.dev/drain";
const ORDER: &str = "berth.dev/drain-order";

/// A bare pod on `node` without volumes, with `annotations` and, if given,
/// a priority class.
fn bare_pod(name: &str, node: &str, class: Option<&str>, annotations: &[(&str, &str)]) -> Pod {
    let annotations: serde_json::Map<String, serde_json::Value> = annotations
        .iter()
        .map(|(k, v)| ((*k).to_string(), serde_json::Value::from(*v)))
        .collect();
    let mut pod = labelled_pod(name, node, serde_json::json!({}), annotations.into());
    if let Some(spec) = pod.spec.as_mut() {
        spec.priority_class_name = class.map(str::to_string);
    }
    pod
}

fn at<'a>(evs: &'a [Ev], reason: &str, needle: &str) -> &'a Ev {
    first(evs, reason, needle)
        .unwrap_or_else(|| panic!("no {reason} about {needle}:\n{}", log_of(evs)))
}

fn waiting_for(m: &Machine) -> String {
    m.status
        .as_ref()
        .and_then(|s| s.drain.as_ref())
        .and_then(|d| d.waiting_for.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn critical_pods_leave_after_every_other_pod_and_its_volumes() {
    let ns = "rules-tiers";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node_a = running_held(&client, ns, "a", ns, false).await;
    // A stateful workload and a critical stateful one (a CSI controller,
    // say), each with an attachable volume; a stateless pod and a
    // critical stateless one (DNS).
    for (sts, class) in [("db", None), ("ctl", Some("system-cluster-critical"))] {
        create(
            Api::all(client.clone()),
            csi_pv(
                &format!("{ns}-{sts}"),
                &format!("vol-{ns}-{sts}"),
                ns,
                &format!("data-{sts}-0"),
            ),
        )
        .await;
        create(
            Api::<StatefulSet>::namespaced(client.clone(), ns),
            stateful_set_in_pool(sts, 1, 1, ns, class),
        )
        .await;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    create(pods.clone(), bare_pod("web", &node_a, None, &[])).await;
    create(
        pods.clone(),
        bare_pod("dns", &node_a, Some("system-node-critical"), &[]),
    )
    .await;
    running_pods(&client, ns, &["db-0", "ctl-0", "web", "dns"]).await;
    let node_b = running_held(&client, ns, "b", ns, false).await;

    let plan = plan_text(&client, ns, "a").await;
    eprintln!("{plan}");
    assert_contains(
        &plan,
        &[
            "Order groups, lowest first; each starts once every pod of the groups before it is gone and their volumes have moved (2):",
            "  order 0: 1 without persistent volumes, 1 with persistent volumes\n",
            "  order 1000 (critical: priorityClassName system-cluster-critical; critical: priorityClassName system-node-critical): 1 without persistent volumes, 1 with persistent volumes\n",
            &format!(
                "  {ns}/web\n  {ns}/dns (order 1000, critical: priorityClassName system-node-critical)\n"
            ),
            &format!("  1. {ns}/db-0 (priority 0, grace 1s)"),
            &format!(
                "  2. {ns}/ctl-0 (priority 2000000000, grace 1s, order 1000, critical: priorityClassName system-cluster-critical)"
            ),
        ],
    );

    let watches = Watches::start(&client, ns).await;
    let started = std::time::Instant::now();
    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;
    let took = started.elapsed();
    let evs = events(&client, ns, "a").await;
    let log = log_of(&evs);
    eprintln!("drain of {node_a} took {took:?}:\n{log}");

    // By the audit log and the watches: every pod evicted once; the
    // critical ones (dns, ctl-0) only once web was seen gone and db's
    // volume was written attached on B; ctl-0's volume moved to B too.
    let bed = BED.bed().await;
    let all = evictions(bed, ns);
    let truth = format!("{}\n{}", oracle::log_of(&all), watches.log());
    let once = |pod: &str| {
        let accepted = accepted_evictions_of(&all, pod);
        assert_eq!(accepted.len(), 1, "{pod} evicted once: {truth}");
        accepted[0].received
    };
    let (web, db) = (once("web"), once("db-0"));
    let web_gone = watches
        .first(|s| matches!(s, Seen::PodGone { name, .. } if name == "web"))
        .unwrap_or_else(|| panic!("web gone: {truth}"));
    let db_moved = watches
        .attached_on(bed, &format!("{ns}-db"), &node_b)
        .await
        .unwrap_or_else(|| panic!("db's volume attached on B: {truth}"));
    assert!(web < web_gone && db < db_moved, "{truth}");
    for critical in ["dns", "ctl-0"] {
        let at = once(critical);
        assert!(
            web_gone < at && db_moved < at,
            "{critical} evicted only after web left and db's volume moved:\n{truth}"
        );
    }
    assert!(
        watches
            .attached_on(bed, &format!("{ns}-ctl"), &node_b)
            .await
            .is_some(),
        "the critical stateful pod's volume moved by the same rules: {truth}"
    );
    // What operators are told.
    let group = at(&evs, "OrderGroupStarted", "order group 1000");
    let db_told = at(&evs, "VolumeAttached", &format!("{ns}-db"));
    assert!(db_told.2.contains(&node_b), "{}", db_told.2);
    assert!(db_told.0 <= group.0, "{log}");
    assert!(first(&evs, "Drained", "").is_some(), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skip_rule_leaves_a_pod_to_the_vm_and_a_rule_not_understood_is_named() {
    let ns = "rules-skip";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node = running_held(&client, ns, "a", ns, true).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    create(
        pods.clone(),
        bare_pod("keep", &node, None, &[(DRAIN, "skip")]),
    )
    .await;
    create(
        pods.clone(),
        bare_pod("web", &node, None, &[(ORDER, "soon")]),
    )
    .await;
    running_pods(&client, ns, &["keep", "web"]).await;

    let plan = plan_text(&client, ns, "a").await;
    eprintln!("{plan}");
    assert_contains(
        &plan,
        &[
            &format!(
                "  {ns}/keep: drain rule berth.dev/drain=skip: never evicted; ends with the VM"
            ),
            &format!(
                "Drain rules not understood or in conflict, defaults or the winning rule used (1):\n  {ns}/web: berth.dev/drain-order=\"soon\" is not a 32-bit integer; order 0 used"
            ),
            "Without persistent volumes, evicted concurrently, up to 20 at a time (1):",
        ],
    );

    delete_machine(&client, ns, "a").await;
    let evs = events(&client, ns, "a").await;
    let log = log_of(&evs);
    eprintln!("{log}");
    assert!(first(&evs, "Drained", "").is_some(), "{log}");
    let skipped = at(&evs, "PodSkipped", &format!("{ns}/keep"));
    assert!(skipped.2.contains("berth.dev/drain=skip"), "{}", skipped.2);
    let invalid = at(&evs, "DrainRuleInvalid", &format!("{ns}/web"));
    assert!(invalid.2.contains("order 0 used"), "{}", invalid.2);
    assert!(
        first(&evs, "Evicted", &format!("{ns}/web")).is_some(),
        "{log}"
    );
    assert!(
        first(&evs, "Evicted", &format!("{ns}/keep")).is_none(),
        "{log}"
    );
    // Drained, and the skipped pod still runs on the Node until the VM goes:
    // never asked to go (the audit log), never going (its own state).
    let all = evictions(BED.bed().await, ns);
    assert!(
        all.iter().all(|r| r.name.as_deref() != Some("keep")),
        "keep never evicted: {}",
        oracle::log_of(&all)
    );
    let keep = pods.get("keep").await.expect("keep is still there");
    assert!(keep.metadata.deletion_timestamp.is_none(), "never evicted");
    assert!(
        wait::for_none(pods.clone(), LONG, "web gone", |p| p.name_any() == "web")
            .await
            .is_ok()
    );
    release_hook(&client, ns, "a").await;
    gone(&client, ns, "a", LONG).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_completed_rule_holds_the_critical_group_until_the_pod_completes() {
    let ns = "rules-wait";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node = running_held(&client, ns, "a", ns, false).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    create(
        pods.clone(),
        bare_pod(
            "report",
            &node,
            None,
            &[
                (DRAIN, "wait-completed"),
                (COMPLETE_AFTER_ANNOTATION, "15s"),
            ],
        ),
    )
    .await;
    create(pods.clone(), bare_pod("web", &node, None, &[])).await;
    create(
        pods.clone(),
        bare_pod("dns", &node, Some("system-cluster-critical"), &[]),
    )
    .await;
    running_pods(&client, ns, &["report", "web", "dns"]).await;

    let plan = plan_text(&client, ns, "a").await;
    eprintln!("{plan}");
    assert_contains(
        &plan,
        &[
            &format!(
                "Waited on to complete, never evicted (1):\n  {ns}/report: drain rule berth.dev/drain=wait-completed: the drain waits until it succeeds, fails or is gone; at the deadline minus its grace period it is deleted with its grace period"
            ),
            "  order 0: 1 without persistent volumes, 1 waited on to complete\n",
        ],
    );

    let watches = Watches::start(&client, ns).await;
    delete_machine(&client, ns, "a").await;
    // status.drain names the pod waited on while it runs, not evicted.
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let m = wait::for_one(machines, LONG, "waiting for report", |m| {
        waiting_for(m).contains(&format!("{ns}/report to complete"))
    })
    .await
    .expect("status.drain.waitingFor names the pod");
    assert!(
        waiting_for(&m).contains("berth.dev/drain=wait-completed"),
        "{}",
        waiting_for(&m)
    );
    let report = pods.get("report").await.expect("report runs");
    assert!(report.metadata.deletion_timestamp.is_none(), "not evicted");
    let dns = pods.get("dns").await.expect("dns runs");
    assert!(
        dns.metadata.deletion_timestamp.is_none(),
        "the critical group waits"
    );

    gone(&client, ns, "a", Duration::from_secs(90)).await;
    // By the audit log and the watch of the pods: report never evicted,
    // dns evicted once, after report finished. The controller evicts dns
    // as soon as it sees report finished, before this process's watch may
    // have said so: the order is the watch's own (one watch of the pods
    // tells their changes in the order the API server committed them),
    // report finished before dns began to go.
    let all = evictions(BED.bed().await, ns);
    let truth = format!("{}\n{}", oracle::log_of(&all), watches.log());
    assert!(accepted_evictions_of(&all, "report").is_empty(), "{truth}");
    let dns_evicted = accepted_evictions_of(&all, "dns");
    assert_eq!(dns_evicted.len(), 1, "{truth}");
    let seen = watches.seen();
    let finished = seen
        .iter()
        .position(|(_, s)| matches!(s, Seen::PodFinished { name, .. } if name == "report"))
        .unwrap_or_else(|| panic!("report finished: {truth}"));
    let dns_going = seen
        .iter()
        .position(|(_, s)| matches!(s, Seen::PodDeleting { name, .. } if name == "dns"))
        .unwrap_or_else(|| panic!("dns evicted: {truth}"));
    assert!(
        finished < dns_going,
        "dns evicted only once report completed: {truth}"
    );
    // What operators are told.
    let evs = events(&client, ns, "a").await;
    let log = log_of(&evs);
    eprintln!("{log}");
    let waiting = at(&evs, "WaitingForCompletion", &format!("{ns}/report"));
    let dns_told = at(&evs, "Evicted", &format!("{ns}/dns"));
    assert!(waiting.0 <= dns_told.0, "{log}");
    assert!(first(&evs, "ForcedAtDeadline", "").is_none(), "{log}");
    assert!(first(&evs, "Drained", "").is_some(), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_waited_on_that_never_completes_meets_the_deadline_rules() {
    // With forceAfterDeadline it is deleted with its grace period at the
    // deadline; without, the drain fails naming it.
    const DEADLINE: Duration = Duration::from_secs(10);
    for (ns, force) in [("rules-wait-forced", true), ("rules-wait-failed", false)] {
        let case = Case::builder(ns)
            .on(BED)
            .pool(serde_json::json!({"timeout": "10s", "forceAfterDeadline": force}))
            .start()
            .await;
        let client = case.client();
        let node = running_held(&client, ns, "a", ns, false).await;
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        create(
            pods.clone(),
            bare_pod("forever", &node, None, &[(DRAIN, "wait-completed")]),
        )
        .await;
        running_pods(&client, ns, &["forever"]).await;
        let started = std::time::Instant::now();
        delete_machine(&client, ns, "a").await;
        let evs = events(&client, ns, "a").await;
        let took = started.elapsed();
        let log = log_of(&evs);
        eprintln!("{ns}: {took:?}\n{log}");
        // Bounded by the deadline, not by the pod: the deadline and four
        // times it again for the forced deletion, the VM's end and the
        // Event's publication on a loaded machine (a drain that waited for
        // the pod would never end).
        assert!(took < DEADLINE * 5, "bounded: {took:?}");
        at(&evs, "WaitingForCompletion", &format!("{ns}/forever"));
        if force {
            let forced = at(&evs, "ForcedAtDeadline", &format!("{ns}/forever"));
            assert!(forced.2.contains("wait-completed"), "{}", forced.2);
            assert!(
                first(&evs, "DrainForced", &format!("{ns}/forever")).is_some(),
                "{log}"
            );
            gone(&client, ns, "a", LONG).await;
        } else {
            let failed = at(&evs, "DrainFailed", &format!("{ns}/forever"));
            assert!(
                failed
                    .2
                    .contains("(not completed; drain rule berth.dev/drain=wait-completed)"),
                "{}",
                failed.2
            );
            let pod = pods.get("forever").await.expect("still there");
            assert!(pod.metadata.deletion_timestamp.is_none(), "never evicted");
        }
    }
}

/// A pod without volumes on `node`, labelled `labels`.
fn labelled_pod(
    name: &str,
    node: &str,
    labels: serde_json::Value,
    annotations: serde_json::Value,
) -> Pod {
    json(serde_json::json!({
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "registry.invalid/app:1"}]
        }
    }))
}

/// A cluster DrainRule named `name` for the Machines labelled
/// `rules-case: <case>` (so that no other case's drain sees it), `drain`
/// its behaviour and order, `pods` its pod selectors.
fn drain_rule(
    name: &str,
    case: &str,
    drain: serde_json::Value,
    pods: serde_json::Value,
) -> berth::api::DrainRule {
    json(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "drain": drain,
            "machines": [{"selector": {"matchLabels": {"rules-case": case}}}],
            "pods": pods,
        }
    }))
}

/// Waits until DrainRule `name` says `Accepted` `status`; its reason.
async fn accepted_is(client: &kube::Client, name: &str, status: &str) -> String {
    let rule = wait::for_one(
        Api::<berth::api::DrainRule>::all(client.clone()),
        LONG,
        &format!("{name} Accepted {status}"),
        |r| {
            r.name_any() == name
                && r.status.as_ref().is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.type_ == "Accepted" && c.status == status)
                })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    rule.status
        .as_ref()
        .and_then(|s| s.conditions.first())
        .map(|c| c.reason.clone())
        .unwrap_or_default()
}

/// DrainRules, cluster objects, for pods whose templates the operator
/// does not own, and Cluster API's pod label: a rule's `Skip` leaves a
/// pod of its namespace to the VM, its `WaitCompleted` waits for a pod
/// until it completes, two rules that disagree on a pod are named and the
/// lower order wins (that pod is evicted, alone, before the rest), a rule
/// for another pool's Machines and an invalid rule (refused with a
/// condition) apply to nothing, and `cluster.x-k8s.io/drain: skip` is
/// honoured. By the audit log: never an eviction of a pod a rule or the
/// label keeps; the early pod's eviction before the others'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_drain_rules_and_cluster_apis_label_decide_what_a_drain_does() {
    let ns = "rules-cluster";
    let case = Case::builder(ns)
        .on(BED)
        .pool(serde_json::json!({"timeout": "5m"}))
        .start()
        .await;
    let client = case.client();
    let node = running_held(&client, ns, "a", ns, true).await;
    Api::<Machine>::namespaced(client.clone(), ns)
        .patch(
            "a",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                serde_json::json!({"metadata": {"labels": {"rules-case": ns}}}),
            ),
        )
        .await
        .expect("label the Machine");
    let this_ns = serde_json::json!({"kubernetes.io/metadata.name": ns});
    let app = |a: &str| serde_json::json!([{"selector": {"matchLabels": {"app": a}}, "namespaceSelector": {"matchLabels": this_ns.clone()}}]);
    let rules: Api<berth::api::DrainRule> = Api::all(client.clone());
    let names = ["skip", "wait", "late", "early", "bad", "other"].map(|r| format!("{ns}-{r}"));
    for rule in [
        drain_rule(
            &names[0],
            ns,
            serde_json::json!({"behavior": "Skip"}),
            app("agent"),
        ),
        drain_rule(
            &names[1],
            ns,
            serde_json::json!({"behavior": "WaitCompleted"}),
            app("batch"),
        ),
        drain_rule(
            &names[2],
            ns,
            serde_json::json!({"behavior": "Drain", "order": 10}),
            app("early"),
        ),
        drain_rule(
            &names[3],
            ns,
            serde_json::json!({"behavior": "Drain", "order": -5}),
            app("early"),
        ),
        // In without values: the API server takes it, berth refuses it.
        drain_rule(
            &names[4],
            ns,
            serde_json::json!({"behavior": "Skip"}),
            serde_json::json!([{"selector": {"matchExpressions": [{"key": "app", "operator": "In"}]}}]),
        ),
        // Another pool's Machines: every pod, skipped.
        drain_rule(
            &names[5],
            "another-case",
            serde_json::json!({"behavior": "Skip"}),
            serde_json::json!([]),
        ),
    ] {
        create(rules.clone(), rule).await;
    }
    assert_eq!(
        accepted_is(&client, &names[4], "False").await,
        "InvalidSelector"
    );
    assert_eq!(accepted_is(&client, &names[0], "True").await, "Valid");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let none = serde_json::json!({});
    for (name, labels, annotations) in [
        ("agent", serde_json::json!({"app": "agent"}), none.clone()),
        (
            "batch",
            serde_json::json!({"app": "batch"}),
            serde_json::json!({COMPLETE_AFTER_ANNOTATION: "15s"}),
        ),
        ("early", serde_json::json!({"app": "early"}), none.clone()),
        ("web", serde_json::json!({"app": "web"}), none.clone()),
        (
            "capi",
            serde_json::json!({"app": "capi", "cluster.x-k8s.io/drain": "skip"}),
            none.clone(),
        ),
    ] {
        create(pods.clone(), labelled_pod(name, &node, labels, annotations)).await;
    }
    running_pods(&client, ns, &["agent", "batch", "early", "web", "capi"]).await;
    let batch_started = pods
        .get("batch")
        .await
        .ok()
        .and_then(|p| p.status.and_then(|s| s.start_time))
        .expect("batch started")
        .0;

    let live = berth::cli::plan::plan_machine(&client, ns, "a")
        .await
        .expect("plan");
    let notes = live.notes();
    assert!(
        notes.contains(&format!("DrainRules: {} is invalid and applies to nothing: pods[0].selector.matchExpressions[0] (app) operator In needs values", names[4])),
        "{notes}"
    );
    let plan = live.plan.to_string();
    eprintln!("{plan}");
    assert_contains(
        &plan,
        &[
            &format!(
                "  {ns}/agent: drain rule DrainRule {ns}-skip (Skip): never evicted; ends with the VM"
            ),
            &format!(
                "  {ns}/capi: drain rule cluster.x-k8s.io/drain=skip: never evicted; ends with the VM"
            ),
            &format!(
                "  {ns}/batch: drain rule DrainRule {ns}-wait (WaitCompleted): the drain waits"
            ),
            &format!("order -5 (DrainRule {ns}-early): 1 without persistent volumes"),
            &format!(
                "  {ns}/early: DrainRules {ns}-early (Drain, order -5) and {ns}-late (Drain, order 10) pick this pod and disagree: {ns}-early is used"
            ),
        ],
    );

    delete_machine(&client, ns, "a").await;
    let evs = events(&client, ns, "a").await;
    let log = log_of(&evs);
    eprintln!("{log}");
    assert!(first(&evs, "Drained", "").is_some(), "{log}");
    let all = evictions(BED.bed().await, ns);
    let audit = oracle::log_of(&all);
    for kept in ["agent", "capi", "batch"] {
        assert!(
            all.iter().all(|r| r.name.as_deref() != Some(kept)),
            "{kept} never evicted: {audit}"
        );
    }
    let early = accepted_evictions_of(&all, "early");
    let web = accepted_evictions_of(&all, "web");
    assert_eq!((early.len(), web.len()), (1, 1), "{audit}");
    assert!(
        early[0].completed < web[0].received,
        "the early group first: {audit}"
    );
    // The pod waited on was deleted only once it had completed (a delete,
    // never an eviction; the bed completes it 15 s after it started).
    let writes = oracle::writes(BED.bed().await, ns);
    let deleted = writes
        .iter()
        .find(|r| r.verb == "delete" && r.resource == "pods" && r.name.as_deref() == Some("batch"))
        .unwrap_or_else(|| panic!("batch deleted once completed: {}", oracle::log_of(&writes)));
    assert!(
        deleted.received.duration_since(batch_started).as_secs_f64() >= 15.0,
        "deleted before it completed: {deleted:?}"
    );
    for kept in ["agent", "capi"] {
        let p = pods.get(kept).await.expect("still there");
        assert!(
            p.metadata.deletion_timestamp.is_none(),
            "{kept} never evicted"
        );
    }
    release_hook(&client, ns, "a").await;
    gone(&client, ns, "a", LONG).await;
    for name in &names {
        let _ = rules.delete(name, &Default::default()).await;
    }
}
