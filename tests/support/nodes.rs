//! Nodes that die and live again as their VMs would, on the test bed:
//! kwok's `node-dead` Stage turns a Node annotated
//! [`DEAD_ANNOTATION`] NotReady at once and beats its heart no more.

use std::time::Duration;

use berth_devkit::testbed::stages::DEAD_ANNOTATION;
use berth_devkit::testbed::wait;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};

use super::LONG;

/// Node `node` dies as its VM would: see [`kill_all`].
pub async fn kill(client: &Client, node: &str) {
    kill_all(client, &[node.to_string()]).await;
}

/// Nodes `nodes` die together as their VMs would: the test bed's kwok
/// turns each NotReady and beats its heart no more (see
/// [`DEAD_ANNOTATION`]); returns once each says so.
pub async fn kill_all(client: &Client, nodes: &[String]) {
    let api: Api<Node> = Api::all(client.clone());
    for node in nodes {
        api.patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"annotations": {DEAD_ANNOTATION: "true"}}}),
            ),
        )
        .await
        .expect("the Node dies");
    }
    for node in nodes {
        wait::for_one(api.clone(), LONG, &format!("{node} NotReady"), |n| {
            n.name_any() == *node && !is_ready(n)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

pub fn is_ready(n: &Node) -> bool {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Node `node` lives again: kwok initialises it (Ready) and beats its
/// heart again; returns once it has said Ready for 3 s in a row.
pub async fn revive(client: &Client, node: &str) {
    Api::<Node>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"annotations": {DEAD_ANNOTATION: null}}}),
            ),
        )
        .await
        .expect("the Node lives again");
    stays_ready(client, node).await;
}

/// Waits until Node `node` has said Ready for 3 s in a row.
pub async fn stays_ready(client: &Client, node: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    let until = std::time::Instant::now() + LONG;
    let mut since: Option<std::time::Instant> = None;
    while std::time::Instant::now() < until {
        let n = nodes.get(node).await.expect("the Node");
        match (is_ready(&n), since) {
            (true, Some(t)) if t.elapsed() >= Duration::from_secs(3) => return,
            (true, None) => since = Some(std::time::Instant::now()),
            (false, _) => since = None,
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!("Node {node} did not stay Ready");
}
