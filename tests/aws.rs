//! The aws provider end to end, against moto's EC2 server (a real emulator,
//! not a mock of ours) and the real control plane: the `berth run` process
//! creates, adopts and terminates instances; the test bed plays the kubelet
//! that joins a running instance to the cluster.
//!
//! moto runs instances at once and ignores client tokens; nothing here
//! depends on either.

mod support;

use std::time::Duration;

use berth::api::Machine;
use berth_devkit::moto::proxy::Fault;
use berth_devkit::testbed::fixtures::{csi_pv, stateful_set};
use berth_devkit::testbed::wait;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use support::aws::{CHAIN_CREDENTIALS, Cloud, CredentialsEndpoint};
use support::pool::{POOL, create, delete_machine, gone, on_node};
use support::{Case, LONG, bed, condition, last_operation, machine, phase, wait_machine};

fn provider_id(m: &Machine) -> Option<String> {
    m.spec.provider_id.clone()
}

async fn create_machine(client: &Client, ns: &str, name: &str, class: &str) -> Machine {
    Api::<Machine>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &machine(name, class))
        .await
        .expect("create machine")
}

async fn running_on(client: &Client, ns: &str, name: &str) -> (Machine, String) {
    let m = wait_machine(client, ns, name, "Running", |m| phase(m) == Some("Running")).await;
    let pid = provider_id(&m).expect("a providerID");
    let nodes: Api<Node> = Api::all(client.clone());
    let node = nodes
        .list(&Default::default())
        .await
        .expect("nodes")
        .items
        .into_iter()
        .find(|n| n.spec.as_ref().and_then(|s| s.provider_id.as_deref()) == Some(pid.as_str()))
        .expect("the Node of the instance")
        .name_any();
    (m, node)
}

/// A case of its own: namespace `ns`, a cloud (behind the fault proxy when
/// `proxied`) with a class named `ns`, and `berth run` with `flags`, the
/// case's controller; an admin client.
async fn aws_case(ns: &str, proxied: bool, flags: &[&str]) -> (Case, Client, Cloud) {
    let mut case = Case::builder(ns).build().await;
    let client = case.client();
    let cloud = Cloud::start(&client, ns, proxied).await;
    cloud
        .class(&client, ns, ns, cloud.spec(serde_json::json!({})))
        .await;
    let kubeconfig = case.kubeconfig().await;
    case.adopt(cloud.berth(&kubeconfig, ns, flags));
    (case, client, cloud)
}

/// A case of its own whose class has no secretRef (berth signs with the
/// AWS chain of its own environment), on moto without the proxy; `berth
/// run` is the case's to start, with the chain's environment.
async fn chain_case(ns: &str) -> (Case, Client, Cloud) {
    let case = Case::builder(ns).build().await;
    let client = case.client();
    let cloud = Cloud::start(&client, ns, false).await;
    cloud
        .class_with(&client, ns, ns, cloud.spec(serde_json::json!({})), false)
        .await;
    (case, client, cloud)
}

/// A Machine gets exactly one instance, tagged (instance and volumes) for
/// this cluster and this Machine, with the providerID the Node registers
/// with; deleting it drains its Node in a volume-aware order (the stateful
/// pod's volume attached where its replacement runs) before the instance
/// is terminated and the Node and Machine go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_runs_on_one_tagged_instance_and_leaves_after_a_volume_aware_drain() {
    let ns = "aws-life";
    let (case, client, cloud) = aws_case(ns, false, &[]).await;
    let berth = case.berth();

    create_machine(&client, ns, "a", ns).await;
    let (a, node_a) = running_on(&client, ns, "a").await;
    let instances = cloud.instances_of(&a).await;
    assert_eq!(instances.len(), 1, "{instances:?}");
    let i = &instances[0];
    assert_eq!(provider_id(&a), i.provider_id(), "aws:///<zone>/<id>");
    let uid = a.metadata.uid.clone().expect("uid");
    for (k, v) in [
        ("berth.dev/cluster", ns),
        ("berth.dev/machine-uid", uid.as_str()),
        ("berth.dev/machine-namespace", ns),
        ("berth.dev/machine-name", "a"),
        ("Name", "a"),
        ("team", "storage"),
    ] {
        assert_eq!(i.tags.get(k).map(String::as_str), Some(v), "tag {k}");
    }
    // IMDSv2 only, out of pods' reach, as the class did not ask otherwise.
    let described = cloud
        .ec2
        .call("DescribeInstances", &[("InstanceId.1", i.id.as_str())])
        .await
        .expect("describe");
    let metadata = described.descendants("metadataOptions").first().map(|m| {
        (
            m.text_at(&["httpTokens"]),
            m.text_at(&["httpPutResponseHopLimit"]),
        )
    });
    assert_eq!(
        metadata,
        Some((Some("required".into()), Some("1".into()))),
        "instance metadata options"
    );
    let volumes = cloud.ec2.volumes_of(&i.id).await.expect("volumes");
    assert!(!volumes.is_empty(), "the instance has its root volume");
    for v in &volumes {
        assert_eq!(
            v.tags.get("berth.dev/machine-uid").map(String::as_str),
            Some(uid.as_str()),
            "volume {v:?} is tagged"
        );
    }

    // A stateful pod with a CSI volume on a's Node, and a second Machine
    // for its replacement.
    let pv = format!("{ns}-db-0");
    create(
        Api::all(client.clone()),
        csi_pv(&pv, &format!("vol-{pv}"), ns, "data-db-0"),
    )
    .await;
    let mut sts = stateful_set("db", 1, 1);
    if let Some(spec) = sts.spec.template.spec.as_mut() {
        spec.node_selector = Some([(POOL.to_string(), ns.to_string())].into());
    }
    create(Api::namespaced(client.clone(), ns), sts).await;
    let attached_on = |node: String| {
        let pv = pv.clone();
        move |all: &[std::sync::Arc<VolumeAttachment>]| {
            all.iter().any(|va| {
                va.spec.node_name == node
                    && va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
                    && va.status.as_ref().is_some_and(|s| s.attached)
            })
        }
    };
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    wait::until(
        vas.clone(),
        LONG,
        "db-0's volume on a",
        attached_on(node_a.clone()),
    )
    .await
    .expect("attached on a");
    create_machine(&client, ns, "b", ns).await;
    let (_, node_b) = running_on(&client, ns, "b").await;

    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(180)).await;
    cloud.wait_state(&i.id, "terminated").await;
    let nodes: Api<Node> = Api::all(client.clone());
    assert!(nodes.get_opt(&node_a).await.expect("get").is_none());
    wait::until(vas, LONG, "db-0's volume on b", attached_on(node_b.clone()))
        .await
        .expect("attached on b");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let db0 = pods.get("db-0").await.expect("db-0");
    assert!(on_node(&db0, &node_b));
    let evs = support::events_until(&client, ns, "a", &["DeleteVmAndNode"]).await;
    let reasons: Vec<&str> = evs.iter().filter_map(|e| e.reason.as_deref()).collect();
    assert!(reasons.contains(&"Drained"), "{reasons:?}");
    assert_eq!(
        cloud.instances_of(&a).await.len(),
        1,
        "one instance was ever made for a"
    );
    berth
        .wait_metrics(&[
            r#"berth_provider_requests_total{driver="aws",op="RunInstances",result="ok"} 2"#,
            r#"berth_provider_requests_total{driver="aws",op="TerminateInstances",result="ok"} 1"#,
        ])
        .await;
    assert!(
        !berth.logs_contain("berth-test-secret-key"),
        "no secret in logs"
    );
}

/// `berth run` killed right after EC2 accepted `RunInstances`, before the
/// providerID was written (a crash point of the tests' build): the next
/// process finds the instance by the Machine's UID tag and adopts it. One
/// instance, never two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_killed_right_after_run_instances_adopts_the_instance_on_restart() {
    let ns = "aws-crash";
    // No secretRef: these processes sign with the standard chain's
    // credentials, from their environment.
    let (mut case, client, cloud) = chain_case(ns).await;
    let kubeconfig = &case.kubeconfig().await;
    let mut crash_env = CHAIN_CREDENTIALS.to_vec();
    crash_env.push(("BERTH_FAULT_ABORT_AFTER_RUN_INSTANCES", "1"));
    let crashing = cloud.berth_with(kubeconfig, ns, &[], &crash_env);
    let m = create_machine(&client, ns, "m", ns).await;
    let status = crashing.exited().await;
    assert!(!status.success(), "aborted: {status:?}");
    let made = cloud.instances_of(&m).await;
    assert_eq!(made.len(), 1, "{made:?}");
    let api: Api<Machine> = Api::namespaced(client.clone(), ns);
    assert_eq!(
        provider_id(&api.get("m").await.expect("m")),
        None,
        "killed before the providerID was written"
    );

    let berth = case.adopt(cloud.berth_with(kubeconfig, ns, &[], CHAIN_CREDENTIALS));
    let (m, _) = running_on(&client, ns, "m").await;
    assert_eq!(
        provider_id(&m),
        made[0].provider_id(),
        "the instance is adopted"
    );
    let after = cloud.instances_of(&m).await;
    assert_eq!(after.len(), 1, "no second instance: {after:?}");
    berth
        .wait_metrics(&[
            r#"berth_provider_requests_total{driver="aws",op="DescribeInstances",result="ok"}"#,
        ])
        .await;
    let (_, metrics) = berth.get("/metrics").await.expect("metrics");
    assert!(
        !metrics.contains(r#"op="RunInstances""#),
        "the restarted controller never called RunInstances"
    );
    assert!(berth.logs_contain("adopting the instance"));
    assert!(
        !berth.logs_contain("berth-chain-secret-key"),
        "no secret in logs"
    );
}

/// Each class of EC2 failure, injected by a proxy in front of moto (moto
/// cannot throttle or run out of capacity) or real (an image moto does not
/// know): throttling is retried with backoff and makes one instance;
/// missing capacity is retried, said in lastOperation, and bounded; a
/// missing permission is a condition that names it, retried slowly; an
/// unknown image fails the Machine with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_class_of_ec2_failure_is_named_retried_or_refused_as_it_should() {
    let ns = "aws-errors";
    let (case, client, cloud) = aws_case(ns, true, &[]).await;
    let berth = case.berth();
    let proxy = cloud.proxy();

    // A load balancer's 502 page on the look-up by tag: retried at once
    // (DescribeInstances is safe to repeat). Throttled twice: the
    // reconcile's backoff retries RunInstances, which looks again first.
    // One instance.
    proxy.inject(Fault::html("DescribeInstances", 502));
    proxy.inject(Fault::throttled("RunInstances").times(2));
    let m1 = create_machine(&client, ns, "throttled", ns).await;
    wait_machine(&client, ns, "throttled", "a providerID", |m| {
        provider_id(m).is_some()
    })
    .await;
    assert_eq!(proxy.faulted("DescribeInstances"), 1);
    assert_eq!(proxy.faulted("RunInstances"), 2);
    assert_eq!(proxy.passed("RunInstances"), 1);
    assert_eq!(cloud.instances_of(&m1).await.len(), 1);
    berth
        .wait_metrics(&[
            r#"berth_provider_requests_total{driver="aws",op="RunInstances",result="throttled"} 2"#,
        ])
        .await;

    // No capacity: retried with backoff, said, bounded; then it comes.
    proxy.reset_counts();
    proxy.inject(
        Fault::ec2_error(
            "RunInstances",
            500,
            "InsufficientInstanceCapacity",
            "We currently do not have sufficient t3.micro capacity in the Availability Zone you requested.",
        )
        .forever(),
    );
    create_machine(&client, ns, "no-capacity", ns).await;
    wait_machine(&client, ns, "no-capacity", "capacity said", |m| {
        last_operation(m).contains("InsufficientInstanceCapacity")
            && last_operation(m).contains("retrying")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(15)).await;
    let tries = proxy.requests("RunInstances");
    assert!(
        (2..=8).contains(&tries),
        "{tries} RunInstances in about 15 s: retried with backoff, not in a loop"
    );
    proxy.clear();
    wait_machine(&client, ns, "no-capacity", "a providerID", |m| {
        provider_id(m).is_some()
    })
    .await;

    // A limit of the account (vCPUs): not a refusal of the class, said and
    // tried again with backoff; once the limit allows, the instance comes.
    proxy.reset_counts();
    proxy.inject(
        Fault::ec2_error(
            "RunInstances",
            400,
            "VcpuLimitExceeded",
            "You have requested more vCPU capacity than your current vCPU limit of 32 allows.",
        )
        .times(2),
    );
    create_machine(&client, ns, "quota", ns).await;
    wait_machine(&client, ns, "quota", "a providerID", |m| {
        provider_id(m).is_some()
    })
    .await;
    assert_eq!(proxy.faulted("RunInstances"), 2);

    // A create that keeps failing ends at the class's creationTimeout: the
    // Machine fails, naming the last answer, and is not asked again.
    cloud
        .class(&client, ns, "short", cloud.spec(serde_json::json!({})))
        .await;
    Api::<berth::api::MachineClass>::all(client.clone())
        .patch(
            "short",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"creationTimeout": "20s"}})),
        )
        .await
        .expect("a short creation timeout");
    proxy.inject(
        Fault::ec2_error(
            "RunInstances",
            400,
            "InstanceLimitExceeded",
            "Your quota allows for 0 more running instance(s).",
        )
        .forever(),
    );
    create_machine(&client, ns, "never", "short").await;
    let never = wait_machine(&client, ns, "never", "Failed", |m| {
        phase(m) == Some("Failed")
    })
    .await;
    let ready = condition(&never, "Ready").expect("Ready");
    assert_eq!(ready.reason, "CreationTimeout");
    assert!(
        ready.message.contains("InstanceLimitExceeded"),
        "{}",
        ready.message
    );
    let tried = proxy.requests("RunInstances");
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        proxy.requests("RunInstances"),
        tried,
        "a failed Machine is not asked for again"
    );
    proxy.clear();

    // No permission: a condition that names it, retried every 5 minutes.
    proxy.reset_counts();
    proxy.inject(
        Fault::ec2_error(
            "RunInstances",
            403,
            "UnauthorizedOperation",
            "You are not authorized to perform this operation.",
        )
        .forever(),
    );
    create_machine(&client, ns, "denied", ns).await;
    let denied = wait_machine(&client, ns, "denied", "ProviderUnauthorized", |m| {
        condition(m, "Ready").is_some_and(|c| c.reason == "ProviderUnauthorized")
    })
    .await;
    let ready = condition(&denied, "Ready").expect("Ready");
    assert!(
        ready.message.contains("ec2:RunInstances"),
        "{}",
        ready.message
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        proxy.requests("RunInstances"),
        1,
        "a refused permission is not asked again at once"
    );
    assert_ne!(
        phase(&denied),
        Some("Failed"),
        "not failed: the fix is outside"
    );
    proxy.clear();

    // An image EC2 does not have (a well-formed id): the Machine fails,
    // and says why.
    cloud
        .class(
            &client,
            ns,
            "unknown-image",
            cloud.spec(serde_json::json!({
                "imageId": "ami-0123456789abcdef0",
                "rootVolume": {"sizeGiB": 20, "type": "gp3"}
            })),
        )
        .await;
    create_machine(&client, ns, "bad-image", "unknown-image").await;
    let failed = wait_machine(&client, ns, "bad-image", "Failed", |m| {
        phase(m) == Some("Failed")
    })
    .await;
    let ready = condition(&failed, "Ready").expect("Ready");
    assert!(ready.message.contains("InvalidAMIID"), "{}", ready.message);

    // A providerSpec berth can tell is wrong never reaches EC2.
    proxy.reset_counts();
    cloud
        .class(
            &client,
            ns,
            "bad-region",
            cloud.spec(serde_json::json!({"region": "Europe"})),
        )
        .await;
    create_machine(&client, ns, "bad-spec", "bad-region").await;
    let bad = wait_machine(&client, ns, "bad-spec", "InvalidProviderSpec", |m| {
        condition(m, "Ready").is_some_and(|c| c.reason == "InvalidProviderSpec")
    })
    .await;
    assert!(
        condition(&bad, "Ready").is_some_and(|c| c.message.contains("region")),
        "{:?}",
        condition(&bad, "Ready")
    );
    assert_eq!(proxy.requests("RunInstances"), 0, "{:?}", proxy.counts());
}

/// Orphan collection against EC2: an instance tagged for this cluster and
/// a Machine that no longer has it (here: a Machine of the same name made
/// again, with another UID) is terminated once older than the grace, with
/// an Event on that Machine; a younger one waits its turn; an instance
/// without this cluster's tag, one of another cluster, one with the
/// cluster's tag but no Machine tags, and the Machine's own instance are
/// never touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphan_instances_are_terminated_after_their_grace_and_no_other() {
    use berth_devkit::moto::ec2::Launch;
    let ns = "aws-orphans";
    let mut case = Case::builder(ns).build().await;
    let client = case.client();
    let cloud = Cloud::start(&client, ns, false).await;
    cloud
        .class(&client, ns, ns, cloud.spec(serde_json::json!({})))
        .await;
    let launch = |l: Launch| {
        let ec2 = cloud.ec2.clone();
        async move { ec2.launch(&l).await.expect("launch").id }
    };
    let machine_tags = |name: &str, uid: &str| {
        Launch::tagged(&[
            ("berth.dev/machine-uid", uid),
            ("berth.dev/machine-namespace", ns),
            ("berth.dev/machine-name", name),
        ])
    };
    let older = launch(
        machine_tags("kept", "0b5c3a52-0000-4000-8000-000000000001").tag("berth.dev/cluster", ns),
    )
    .await;
    let untagged = launch(machine_tags("x", "0b5c3a52-0000-4000-8000-000000000002")).await;
    let other_cluster = launch(
        machine_tags("x", "0b5c3a52-0000-4000-8000-000000000003").tag("berth.dev/cluster", "other"),
    )
    .await;
    let cluster_only = launch(Launch::tagged(&[("berth.dev/cluster", ns)])).await;

    let kubeconfig = &case.kubeconfig().await;
    let berth = case.adopt(cloud.berth(
        kubeconfig,
        ns,
        &["--orphan-interval=2s", "--orphan-grace=20s"],
    ));
    create_machine(&client, ns, "kept", ns).await;
    let (kept, _) = running_on(&client, ns, "kept").await;
    let own = cloud.instances_of(&kept).await;
    assert_eq!(own.len(), 1);
    // 8 s younger than the first orphan.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let younger = launch(
        machine_tags("gone", "0b5c3a52-0000-4000-8000-000000000004").tag("berth.dev/cluster", ns),
    )
    .await;

    cloud
        .wait_state_within(&older, "terminated", Duration::from_secs(60))
        .await;
    assert_eq!(
        cloud
            .ec2
            .instance_state(&younger)
            .await
            .expect("describe")
            .as_deref(),
        Some("running"),
        "the younger orphan is still within its grace"
    );
    cloud
        .wait_state_within(&younger, "terminated", Duration::from_secs(60))
        .await;
    for (id, what) in [
        (&untagged, "without the cluster tag"),
        (&other_cluster, "of another cluster"),
        (&cluster_only, "without Machine tags"),
        (&own[0].id, "the Machine's own"),
    ] {
        assert_eq!(
            cloud
                .ec2
                .instance_state(id)
                .await
                .expect("describe")
                .as_deref(),
            Some("running"),
            "the instance {what} is never touched"
        );
    }
    let evs = support::events_until(&client, ns, "kept", &["OrphanVmCollected"]).await;
    let note = evs
        .iter()
        .find(|e| e.reason.as_deref() == Some("OrphanVmCollected"))
        .and_then(|e| e.note.clone())
        .unwrap_or_default();
    assert!(note.contains(&older), "{note}");
    berth
        .wait_metrics(&[r#"berth_orphan_vms_total{driver="aws",outcome="collected"} 2"#])
        .await;
}

/// EC2 is eventually consistent: it can answer `InvalidInstanceID.NotFound`
/// for an instance that runs. A Machine deleted while DescribeInstances
/// says so twice is not taken for gone: berth asks again, finds the
/// instance, terminates it, and only then deletes the Node and lets the
/// Machine go (the truth: moto's state of the instance when the Machine is
/// gone, and the proxy's count of EC2 calls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_ec2_does_not_find_for_a_while_is_not_taken_for_gone() {
    let ns = "aws-notfound";
    let (_case, client, cloud) = aws_case(ns, true, &["--vm-not-found-grace=2m"]).await;
    let proxy = cloud.proxy();

    create_machine(&client, ns, "a", ns).await;
    let (a, node_a) = running_on(&client, ns, "a").await;
    let id = cloud.instances_of(&a).await[0].id.clone();
    proxy.reset_counts();
    proxy.inject(
        Fault::ec2_error(
            "DescribeInstances",
            400,
            "InvalidInstanceID.NotFound",
            &format!("The instance ID '{id}' does not exist"),
        )
        .times(2),
    );
    delete_machine(&client, ns, "a").await;
    gone(&client, ns, "a", Duration::from_secs(120)).await;

    let state = cloud
        .ec2
        .instance_state(&id)
        .await
        .expect("describe")
        .unwrap_or_default();
    assert!(
        state == "terminated" || state == "shutting-down",
        "the Machine went while its instance was {state}"
    );
    assert_eq!(proxy.faulted("DescribeInstances"), 2);
    assert_eq!(proxy.passed("TerminateInstances"), 1, "terminated once");
    let nodes: Api<Node> = Api::all(client.clone());
    assert!(nodes.get_opt(&node_a).await.expect("get").is_none());
}

/// EC2 may keep an instance `shutting-down` for a long while (moto
/// terminates at once: the proxy answers `shutting-down` where moto says
/// `terminated`). The Machine and its Node stay while it shuts down, the
/// Machine says so, and EC2 is asked at the provider's pace (every 5 s at
/// first), not in a loop; once EC2 says `terminated`, the Node goes and the
/// Machine with it. The truth: the proxy's count of EC2 calls, moto's
/// state of the instance, and the Node object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_stays_shutting_down_keeps_its_machine_and_node_until_terminated() {
    let ns = "aws-shutting-down";
    let (_case, client, cloud) = aws_case(ns, true, &[]).await;
    let proxy = cloud.proxy();

    create_machine(&client, ns, "a", ns).await;
    let (a, node_a) = running_on(&client, ns, "a").await;
    let id = cloud.instances_of(&a).await[0].id.clone();
    proxy.inject(
        Fault::rewrite("*", "<name>terminated</name>", "<name>shutting-down</name>").forever(),
    );
    delete_machine(&client, ns, "a").await;
    wait_machine(&client, ns, "a", "shutting down said", |m| {
        last_operation(m).contains("shutting down")
    })
    .await;
    cloud.wait_state_within(&id, "terminated", LONG).await;

    proxy.reset_counts();
    let window = Duration::from_secs(30);
    tokio::time::sleep(window).await;
    let asks = proxy.requests("DescribeInstances");
    eprintln!("DescribeInstances while shutting down: {asks} in {window:?}");
    assert!(
        (3..=9).contains(&asks),
        "{asks} DescribeInstances in {window:?} while shutting down: asked at the provider's pace, not in a loop"
    );
    assert_eq!(
        proxy.requests("TerminateInstances"),
        0,
        "not terminated again"
    );
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    assert!(machines.get_opt("a").await.expect("get").is_some());
    let nodes: Api<Node> = Api::all(client.clone());
    assert!(
        nodes.get_opt(&node_a).await.expect("get").is_some(),
        "the Node stays while its instance shuts down"
    );

    proxy.clear();
    gone(&client, ns, "a", LONG).await;
    assert!(nodes.get_opt(&node_a).await.expect("get").is_none());
}

/// A Machine whose providerID was written by hand for another Machine's
/// instance, deleted while EC2 fails: whose instance that is cannot be
/// asked, so its Node is not cordoned and nothing is terminated, and the
/// Machine says why. Once EC2 answers, the instance is the other Machine's:
/// the Machine goes, leaving the instance and its Node alone. The truth:
/// the audit log's writes to that Node, moto's state of the instance, the
/// proxy's counts of DescribeInstances (no loop while held) and
/// TerminateInstances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_written_provider_id_is_left_alone_while_ec2_cannot_say_whose_it_is() {
    let ns = "aws-owner";
    let (_case, client, cloud) = aws_case(ns, true, &[]).await;
    let proxy = cloud.proxy();
    create_machine(&client, ns, "a", ns).await;
    let (a, node_a) = running_on(&client, ns, "a").await;
    let id = cloud.instances_of(&a).await[0].id.clone();
    let mut b = machine("b", ns);
    b.spec.provider_id = provider_id(&a);
    Api::<Machine>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &b)
        .await
        .expect("create b");
    let b = wait_machine(&client, ns, "b", "Running", |m| phase(m) == Some("Running")).await;
    let on = b.status.and_then(|s| s.node_ref).map(|n| n.name);
    assert_eq!(on, Some(node_a.clone()), "b runs on a's Node");
    let since = k8s_openapi::jiff::Timestamp::now();

    proxy.inject(Fault::unavailable("DescribeInstances").forever());
    delete_machine(&client, ns, "b").await;
    let held = wait_machine(&client, ns, "b", "held: owner unknown", |m| {
        support::last_operation_step(m) == Some("VmOwnerUnknown")
    })
    .await;
    assert!(
        last_operation(&held).contains("Unavailable"),
        "{}",
        last_operation(&held)
    );
    // Held, EC2 is asked again at the hold's pace, not at each status write.
    proxy.reset_counts();
    let window = Duration::from_secs(20);
    tokio::time::sleep(window).await;
    let asks = proxy.requests("DescribeInstances");
    assert!(
        asks <= 6,
        "{asks} DescribeInstances in {window:?} while held: asked every 30 s (each ask retried by the client), not in a loop"
    );
    proxy.clear();
    gone(&client, ns, "b", LONG).await;

    let user = support::audit::controller_user();
    let touched: Vec<String> = support::oracle::cluster_requests(bed().await)
        .into_iter()
        .filter(|r| r.user == user && r.received > since && r.is_write())
        .filter(|r| r.resource == "nodes" && r.name.as_deref() == Some(node_a.as_str()))
        .map(|r| r.kind())
        .collect();
    assert!(touched.is_empty(), "a's Node left alone: {touched:?}");
    assert_eq!(proxy.requests("TerminateInstances"), 0);
    let state = cloud.ec2.instance_state(&id).await.expect("describe");
    assert_eq!(state.as_deref(), Some("running"));
    let a = wait_machine(&client, ns, "a", "a", |_| true).await;
    assert_eq!(phase(&a), Some("Running"));
}

/// A class without a secretRef signs with the AWS chain. A chain whose
/// provider fails for a while (the container credentials endpoint answers
/// 500, as an overloaded metadata service or STS can) is not taken for
/// missing credentials: the Machine says it is retried with backoff (not a
/// ProviderUnauthorized condition and its 5-minute retry), and gets its
/// instance soon after the endpoint serves credentials. The truth: the
/// endpoint's count of requests and moto's instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credentials_chain_that_fails_for_a_while_is_retried_not_taken_for_unauthorized() {
    let ns = "aws-chain";
    let (mut case, client, cloud) = chain_case(ns).await;
    let endpoint = CredentialsEndpoint::start().await;
    let kubeconfig = &case.kubeconfig().await;
    let berth = case.adopt(cloud.berth_with(kubeconfig, ns, &[], &endpoint.env()));

    create_machine(&client, ns, "m", ns).await;
    let failing = wait_machine(&client, ns, "m", "the chain's failure said", |m| {
        last_operation(m).contains("AWS credentials")
    })
    .await;
    assert!(
        condition(&failing, "Ready").is_none_or(|c| c.reason != "ProviderUnauthorized"),
        "{:?}",
        condition(&failing, "Ready")
    );
    let said = last_operation(&failing);
    assert!(
        said.contains("tried again with backoff") && said.contains("500"),
        "{said}"
    );
    assert!(endpoint.asked() >= 1, "the chain asked the endpoint");

    endpoint.serve();
    let served = std::time::Instant::now();
    let (m, _) = running_on(&client, ns, "m").await;
    eprintln!("Running {:?} after the endpoint served", served.elapsed());
    assert_eq!(cloud.instances_of(&m).await.len(), 1);
    assert!(
        !berth.logs_contain("berth-container-secret-key")
            && !berth.logs_contain("berth-container-token"),
        "no secret in logs"
    );
}

/// A Machine whose Node dies, in a class that remediates it, while EC2
/// refuses StopInstances (500): nothing on the Node is freed (no
/// out-of-service taint), the Machine says `FenceFailed`, and EC2 is asked
/// again with backoff, not in a loop. Once EC2 answers, the instance is
/// stopped (moto's state) before the Node is tainted, and the Machine,
/// outside a pool, is marked Failed. The truth: the proxy's counts, moto's
/// instance state, the Node object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_instance_is_stopped_before_its_node_is_freed() {
    use berth_devkit::testbed::stages::DEAD_ANNOTATION;
    use kube::api::{Patch, PatchParams};
    let ns = "aws-remedy";
    let (_case, client, cloud) = aws_case(ns, true, &[]).await;
    let proxy = cloud.proxy();
    Api::<berth::api::MachineClass>::all(client.clone())
        .patch(
            ns,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {
                "healthTimeout": "5s", "remediation": {"policy": "Replace"}}})),
        )
        .await
        .expect("the class remediates");
    create_machine(&client, ns, "a", ns).await;
    let (a, node) = running_on(&client, ns, "a").await;
    let id = cloud.instances_of(&a).await[0].id.clone();
    proxy.inject(Fault::internal_error("StopInstances").forever());
    proxy.reset_counts();
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            &node,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"annotations": {DEAD_ANNOTATION: "true"}}}),
            ),
        )
        .await
        .expect("the Node dies");
    wait_machine(&client, ns, "a", "FenceFailed", |m| {
        condition(m, "Remediation").is_some_and(|c| c.reason == "FenceFailed")
    })
    .await;

    // Each attempt is a request and the client's two quick retries; the
    // attempts back off from half a second, doubling. Asked again: more
    // than one attempt in all (the second comes a second after the
    // first). Not in a loop: at most six attempts in the next 20 s. (How
    // many fall in a window that opens when the failure is seen depends on
    // how late a loaded machine sees it: the backoff may be past 20 s.)
    let before = proxy.requests("StopInstances");
    let window = Duration::from_secs(20);
    tokio::time::sleep(window).await;
    let all = proxy.requests("StopInstances");
    let asks = all - before;
    assert!(
        all > 3 && asks <= 18,
        "{all} StopInstances, {asks} in the last {window:?}: asked again with backoff, not in a loop"
    );
    let out_of_service = |n: &Node| {
        n.spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|ts| {
                ts.iter()
                    .any(|t| t.key == "node.kubernetes.io/out-of-service")
            })
    };
    let n = nodes.get(&node).await.expect("the Node");
    assert!(!out_of_service(&n), "freed before the VM was stopped");
    assert_eq!(
        cloud
            .ec2
            .instance_state(&id)
            .await
            .expect("describe")
            .as_deref(),
        Some("running"),
        "not stopped while EC2 refuses"
    );

    proxy.clear();
    let m = wait_machine(&client, ns, "a", "Failed, remediated", |m| {
        phase(m) == Some("Failed")
    })
    .await;
    assert_eq!(
        cloud
            .ec2
            .instance_state(&id)
            .await
            .expect("describe")
            .as_deref(),
        Some("stopped"),
        "{:?}",
        m.status
    );
    let n = nodes.get(&node).await.expect("the Node stays");
    assert!(
        out_of_service(&n),
        "the Node is freed once the VM is stopped"
    );
}
