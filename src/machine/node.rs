//! Every write berth makes to a Node: the cordon, the out-of-service taint
//! once its VM is gone, the rollout taint of a MachineDeployment's old
//! Nodes, the drain's lifecycle conditions, and the deletion of a Node
//! whose VM is gone. Each write of its spec is a merge patch with the
//! Node's resourceVersion in it, a compare-and-swap: a taint another
//! writer added in between is never lost, the write is refused (409) and
//! taken again on the newer copy. The lifecycle conditions are berth's
//! own entries of a list merged by `type`: no one else's is written.

use k8s_openapi::api::core::v1::{Node, Taint};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::{Client, ResourceExt};

use super::record::OUT_OF_SERVICE_TAINT;
use crate::api::{CORDON_TAINT_KEY, CORDONED_AT_ANNOTATION, ROLLOUT_TAINT_KEY, cordoned_at};

fn taints_of(node: &Node) -> Vec<Taint> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
}

/// `spec.unschedulable` plus berth's NoSchedule taint, and when it was
/// cordoned (once: a pod created on the Node after that came back, see
/// `crate::drain::select::came_back`; one created before is drained).
/// Returns the Node as written.
pub(crate) async fn cordon(client: &Client, node: &Node) -> Result<Node, kube::Error> {
    let mut taints = taints_of(node);
    if !taints
        .iter()
        .any(|t| t.key == CORDON_TAINT_KEY && t.effect == "NoSchedule")
    {
        taints.push(Taint {
            key: CORDON_TAINT_KEY.into(),
            effect: "NoSchedule".into(),
            value: Some("true".into()),
            ..Default::default()
        });
    }
    let annotations = match cordoned_at(node) {
        Some(_) => serde_json::json!({}),
        None => serde_json::json!({CORDONED_AT_ANNOTATION: Timestamp::now().to_string()}),
    };
    patch(
        client,
        node,
        serde_json::json!({"unschedulable": true, "taints": taints}),
        annotations,
    )
    .await
}

/// Puts the out-of-service taint on `node` (its VM is gone), unless it is
/// there; returns when it was added (`otherwise` for a taint that does not
/// say).
pub(crate) async fn out_of_service(
    client: &Client,
    node: &Node,
    otherwise: Timestamp,
) -> Result<Timestamp, kube::Error> {
    let mut taints = taints_of(node);
    if let Some(t) = taints
        .iter()
        .find(|t| t.key == OUT_OF_SERVICE_TAINT && t.effect == "NoExecute")
    {
        return Ok(t.time_added.as_ref().map_or(otherwise, |t| t.0));
    }
    let now = Timestamp::now();
    taints.push(Taint {
        key: OUT_OF_SERVICE_TAINT.into(),
        value: Some("nodeshutdown".into()),
        effect: "NoExecute".into(),
        time_added: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now)),
    });
    patch_taints(client, node, taints).await?;
    tracing::info!(node = %node.name_any(), "VM gone: Node tainted out of service");
    Ok(now)
}

/// Puts the rollout's `PreferNoSchedule` taint on `node` (`tainted`) or
/// takes it off; false when the Node already was so and nothing was
/// written.
pub(crate) async fn rollout_taint(
    client: &Client,
    node: &Node,
    tainted: bool,
) -> Result<bool, kube::Error> {
    let mut taints = taints_of(node);
    if taints.iter().any(|t| t.key == ROLLOUT_TAINT_KEY) == tainted {
        return Ok(false);
    }
    if tainted {
        taints.push(Taint {
            key: ROLLOUT_TAINT_KEY.into(),
            value: Some("old".into()),
            effect: "PreferNoSchedule".into(),
            ..Taint::default()
        });
    } else {
        taints.retain(|t| t.key != ROLLOUT_TAINT_KEY);
    }
    patch_taints(client, node, taints).await?;
    Ok(true)
}

/// Sets `node`'s taints to `taints`, on the condition that the Node is still
/// the version read.
async fn patch_taints(
    client: &Client,
    node: &Node,
    taints: Vec<Taint>,
) -> Result<Node, kube::Error> {
    patch(
        client,
        node,
        serde_json::json!({"taints": taints}),
        serde_json::json!({}),
    )
    .await
}

/// Merges `spec` and `annotations` into `node`, on the condition that the
/// Node is still the version read. Returns the Node as written.
async fn patch(
    client: &Client,
    node: &Node,
    spec: serde_json::Value,
    annotations: serde_json::Value,
) -> Result<Node, kube::Error> {
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": node.resource_version(), "annotations": annotations},
        "spec": spec,
    });
    Api::<Node>::all(client.clone())
        .patch(
            &node.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
}

/// Writes `node`'s lifecycle conditions (see `super::lifecycle`): a
/// strategic merge patch of its status, whose `conditions` merge by
/// `type`, so that only berth's own conditions change.
pub(crate) async fn lifecycle_conditions(
    client: &Client,
    node: &str,
    patch: &serde_json::Value,
) -> Result<Node, kube::Error> {
    Api::<Node>::all(client.clone())
        .patch_status(node, &PatchParams::default(), &Patch::Strategic(patch))
        .await
}

/// Deletes `node`, pinned to its UID: a Node that took its name since it
/// was read (a reused IP or hostname) is never deleted in its place. False
/// when that happened (the API server answered 409) and the Node was left;
/// true when it was deleted, or was gone already.
pub(crate) async fn delete_pinned(client: &Client, node: &Node) -> Result<bool, kube::Error> {
    let pinned = DeleteParams {
        preconditions: Some(Preconditions {
            uid: node.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match Api::<Node>::all(client.clone())
        .delete(&node.name_any(), &pinned)
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}
