//! The joining kubelet for moto, against a real moto and a real test bed:
//! a running instance of the cluster becomes a Node that kwok brings to
//! Ready, once per boot, and nothing else does.
//!
//! The tests share one test bed; each has its own moto server, in a region
//! of its own, so that their Node names (the instances' `privateDnsName`s,
//! which name the region) never collide.

use std::time::Duration;

use berth_devkit::moto::kubelet::{CLUSTER_TAG, KubeletError, Registration};
use berth_devkit::moto::{Ec2, Fault, FaultProxy, KubeletOptions, Launch, Moto, MotoKubelet};
use berth_devkit::testbed::{Options, TestBed, fixtures, wait};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, PostParams};
use tokio::sync::OnceCell;

const LONG: Duration = Duration::from_secs(60);

async fn bed() -> &'static TestBed {
    static BED: OnceCell<TestBed> = OnceCell::const_new();
    BED.get_or_init(|| async {
        TestBed::start(Options::end_to_end())
            .await
            .expect("the end-to-end test bed starts")
    })
    .await
}

async fn nodes() -> Api<Node> {
    Api::all(bed().await.client().await.expect("client"))
}

async fn start(region: &str) -> (Moto, Ec2, kube::Client) {
    let (moto, bed) = tokio::join!(Moto::start(), bed());
    let moto = moto.expect("moto starts");
    let ec2 = moto.client(region);
    (moto, ec2, bed.client().await.expect("client"))
}

fn ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn provider_id(node: &Node) -> Option<&str> {
    node.spec.as_ref()?.provider_id.as_deref()
}

/// The Nodes (by providerID) of these instances.
async fn nodes_of(ids: &[&str]) -> Vec<String> {
    let all = nodes()
        .await
        .list(&Default::default())
        .await
        .expect("Nodes");
    all.items
        .iter()
        .filter_map(|n| provider_id(n))
        .filter(|p| ids.iter().any(|id| p.ends_with(&format!("/{id}"))))
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn a_running_instance_of_the_cluster_becomes_a_ready_kwok_node() {
    let (_moto, ec2, client) = start("eu-west-1").await;
    let instance = ec2
        .launch(
            &Launch::tagged(&[(CLUSTER_TAG, "c-ready"), ("Name", "m1")])
                .zone("eu-west-1b")
                .instance_type("m5.large"),
        )
        .await
        .expect("launched");
    let kubelet = MotoKubelet::start(client, ec2.clone(), "c-ready");

    let reg = kubelet
        .registered(&instance.id, LONG)
        .await
        .expect("registered");
    let dns = ec2
        .instance(&instance.id)
        .await
        .expect("described")
        .and_then(|i| i.private_dns_name)
        .expect("moto gives a privateDnsName");
    assert_eq!(
        reg,
        Registration {
            instance_id: instance.id.clone(),
            node: dns.clone(),
            provider_id: format!("aws:///eu-west-1b/{}", instance.id),
            adopted: false,
        }
    );

    let node = wait::for_one(
        nodes().await,
        LONG,
        "the instance's Node Ready",
        |n: &Node| n.metadata.name.as_deref() == Some(dns.as_str()) && ready(n),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(provider_id(&node), Some(reg.provider_id.as_str()));
    let labels = node.metadata.labels.clone().unwrap_or_default();
    for (k, v) in [
        ("kubernetes.io/hostname", dns.as_str()),
        ("kubernetes.io/os", "linux"),
        ("topology.kubernetes.io/zone", "eu-west-1b"),
        ("topology.kubernetes.io/region", "eu-west-1"),
        ("node.kubernetes.io/instance-type", "m5.large"),
    ] {
        assert_eq!(
            labels.get(k).map(String::as_str),
            Some(v),
            "{k}: {labels:?}"
        );
    }
    assert_eq!(kubelet.registrations().len(), 1);
}

#[tokio::test]
async fn only_running_instances_of_the_cluster_get_a_node() {
    let (_moto, ec2, client) = start("us-west-2").await;
    let launch = async |tags: &[(&str, &str)]| ec2.launch(&Launch::tagged(tags)).await;
    let untagged = launch(&[("Name", "no-cluster")]).await.expect("launched");
    let other = launch(&[(CLUSTER_TAG, "c-other")]).await.expect("launched");
    let terminated = launch(&[(CLUSTER_TAG, "c-only")]).await.expect("launched");
    let stopped = launch(&[(CLUSTER_TAG, "c-only")]).await.expect("launched");
    ec2.terminate(&[&terminated.id]).await.expect("terminated");
    ec2.stop(&[&stopped.id]).await.expect("stopped");
    let running = launch(&[(CLUSTER_TAG, "c-only")]).await.expect("launched");

    let kubelet = MotoKubelet::start(client, ec2.clone(), "c-only");
    kubelet
        .registered(&running.id, LONG)
        .await
        .expect("the running instance registers");
    kubelet.polled(3, LONG).await.expect("three more polls");
    let ids: Vec<String> = kubelet
        .registrations()
        .into_iter()
        .map(|r| r.instance_id)
        .collect();
    assert_eq!(ids, std::slice::from_ref(&running.id));
    let others = [&untagged.id, &other.id, &terminated.id, &stopped.id].map(String::as_str);
    assert_eq!(nodes_of(&others).await, Vec::<String>::new());
    assert_eq!(nodes_of(&[&running.id]).await.len(), 1);
}

#[tokio::test]
async fn an_instance_registers_once_per_boot() {
    let (_moto, ec2, client) = start("ap-southeast-2").await;
    let instance = ec2
        .launch(&Launch::tagged(&[(CLUSTER_TAG, "c-boot")]))
        .await
        .expect("launched");
    let kubelet = MotoKubelet::start(client, ec2.clone(), "c-boot");
    let first = kubelet
        .registered(&instance.id, LONG)
        .await
        .expect("registered");

    // berth deletes the Node of a running instance: its kubelet does not
    // come back.
    let nodes = nodes().await;
    nodes
        .delete(&first.node, &DeleteParams::default())
        .await
        .expect("Node deleted");
    wait::for_none(nodes.clone(), LONG, "the Node gone", |n: &Node| {
        n.metadata.name.as_deref() == Some(first.node.as_str())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    kubelet.polled(3, LONG).await.expect("polls");
    assert_eq!(nodes_of(&[&instance.id]).await, Vec::<String>::new());
    assert_eq!(kubelet.registrations().len(), 1);

    // Stopped and started again, it boots again and registers.
    ec2.stop(&[&instance.id]).await.expect("stopped");
    kubelet.polled(2, LONG).await.expect("polls");
    ec2.start(&[&instance.id]).await.expect("started");
    let mut regs = kubelet.registrations();
    let deadline = tokio::time::Instant::now() + LONG;
    while regs.len() < 2 && tokio::time::Instant::now() < deadline {
        kubelet.polled(1, LONG).await.expect("polls");
        regs = kubelet.registrations();
    }
    assert_eq!(regs.len(), 2, "{regs:?}");
    assert_eq!(regs[1].node, first.node);
    assert!(!regs[1].adopted, "{regs:?}");
    assert_eq!(nodes_of(&[&instance.id]).await.len(), 1);

    // Terminated, and its Node deleted: never again.
    ec2.terminate(&[&instance.id]).await.expect("terminated");
    nodes
        .delete(&first.node, &DeleteParams::default())
        .await
        .expect("Node deleted");
    kubelet.polled(3, LONG).await.expect("polls");
    assert_eq!(kubelet.registrations().len(), 2);
    assert_eq!(nodes_of(&[&instance.id]).await, Vec::<String>::new());
}

#[tokio::test]
async fn a_node_already_there_is_adopted_or_a_conflict_never_overwritten() {
    let (_moto, ec2, client) = start("eu-central-1").await;
    let launch = async || {
        ec2.launch(&Launch::tagged(&[(CLUSTER_TAG, "c-taken")]))
            .await
    };
    let (mine, taken) = (
        launch().await.expect("launched"),
        launch().await.expect("launched"),
    );
    let dns = |i: &berth_devkit::moto::Instance| i.private_dns_name.clone().expect("a name");
    let nodes = nodes().await;
    // Its own Node, from an earlier boot.
    let mut own = fixtures::node(&dns(&mine));
    own.spec.get_or_insert_default().provider_id = mine.provider_id();
    nodes
        .create(&PostParams::default(), &own)
        .await
        .expect("created");
    // Another machine's Node under the name the instance would take.
    let mut squatter = fixtures::node(&dns(&taken));
    squatter.spec.get_or_insert_default().provider_id = Some("aws:///elsewhere/i-other".into());
    nodes
        .create(&PostParams::default(), &squatter)
        .await
        .expect("created");

    let kubelet = MotoKubelet::start(client, ec2.clone(), "c-taken");
    let adopted = kubelet.registered(&mine.id, LONG).await.expect("adopted");
    assert!(adopted.adopted, "{adopted:?}");
    match kubelet.registered(&taken.id, LONG).await {
        Err(KubeletError::Conflict { conflict, .. }) => {
            assert_eq!(
                conflict.existing_provider_id.as_deref(),
                Some("aws:///elsewhere/i-other")
            );
        }
        other => panic!("a conflict, not {other:?}"),
    }
    let still = nodes.get(&dns(&taken)).await.expect("the Node");
    assert_eq!(provider_id(&still), Some("aws:///elsewhere/i-other"));
}

/// The kubelet waits for an instance to boot, rides out moto's errors (it
/// polls again), and stops polling when dropped.
#[tokio::test]
async fn the_kubelet_survives_errors_and_stops_when_dropped() {
    let (moto, ec2, client) = start("sa-east-1").await;
    let proxy = FaultProxy::start(&moto.endpoint())
        .await
        .expect("proxy starts");
    let through_proxy = Ec2::new(&proxy.endpoint(), "sa-east-1");
    proxy.inject(Fault::throttled("DescribeInstances").times(3));
    let instance = ec2
        .launch(&Launch::tagged(&[(CLUSTER_TAG, "c-drop")]))
        .await
        .expect("launched");
    let started = std::time::Instant::now();
    let kubelet = MotoKubelet::start_with(
        client,
        through_proxy,
        KubeletOptions::new("c-drop").boot_time(Duration::from_secs(1)),
    );
    kubelet
        .registered(&instance.id, LONG)
        .await
        .expect("registered after the faults");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "registered only once the instance had booted"
    );
    assert_eq!(proxy.faulted("DescribeInstances"), 3);
    assert!(
        kubelet
            .last_error()
            .is_some_and(|e| e.contains("RequestLimitExceeded")),
        "{:?}",
        kubelet.last_error()
    );

    kubelet.polled(1, LONG).await.expect("polls");
    drop(kubelet);
    let late = ec2
        .launch(&Launch::tagged(&[(CLUSTER_TAG, "c-drop")]))
        .await
        .expect("launched");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let polls = proxy.requests("DescribeInstances");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(proxy.requests("DescribeInstances"), polls, "still polling");
    assert_eq!(nodes_of(&[&late.id]).await, Vec::<String>::new());
}
