//! `berth plan`: the drain that would happen now, read from a live cluster
//! without changing anything. It lists what the engine reads from its
//! caches and feeds the same pure `plan` function, so the plan printed and
//! the drain performed cannot disagree.

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::{CSIDriver, VolumeAttachment};
use kube::Client;
use kube::api::{Api, ListParams};

use super::class::{VolumeContext, allows_data_loss};
use super::plan::{DrainPlan, plan};
use crate::api::settings::resolve;
use crate::api::{Machine, MachineClass};

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("Machine {0} not found")]
    MachineNotFound(String),
    #[error("Machine {0} has no Node (status.nodeRef is empty): there is nothing to drain")]
    NoNode(String),
    #[error("MachineClass {0:?} not found")]
    ClassNotFound(String),
    #[error("invalid drain settings: {0}")]
    Settings(String),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// What `berth plan` prints: the Machine's plan and its Node.
pub struct LivePlan {
    pub machine: Machine,
    pub plan: DrainPlan,
}

/// Plans the drain of Machine `namespace/name` from fresh lists.
///
/// # Errors
/// A missing Machine, Node reference or class; invalid settings; API errors.
pub async fn plan_machine(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<LivePlan, PlanError> {
    let machine = Api::<Machine>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await?
        .ok_or_else(|| PlanError::MachineNotFound(format!("{namespace}/{name}")))?;
    let node = machine
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| r.name.clone())
        .ok_or_else(|| PlanError::NoNode(format!("{namespace}/{name}")))?;
    let class_name = &machine.spec.class_ref.name;
    let class = Api::<MachineClass>::all(client.clone())
        .get_opt(class_name)
        .await?
        .ok_or_else(|| PlanError::ClassNotFound(class_name.clone()))?;
    let settings = resolve(
        machine.spec.drain.as_ref(),
        class.spec.drain.as_ref(),
        class.spec.creation_timeout.as_deref(),
        class.spec.health_timeout.as_deref(),
    )
    .map_err(|e| PlanError::Settings(e.to_string()))?;

    let lp = ListParams::default();
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?
        .items;
    let pvcs = Api::<PersistentVolumeClaim>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let pvs = Api::<PersistentVolume>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let pdbs = Api::<PodDisruptionBudget>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let vas = Api::<VolumeAttachment>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let drivers = Api::<CSIDriver>::all(client.clone()).list(&lp).await?.items;
    let node_obj = Api::<Node>::all(client.clone()).get_opt(&node).await?;
    let volumes = VolumeContext::new(&node, node_obj.as_ref(), &drivers)
        .allowing_data_loss(allows_data_loss(machine.metadata.annotations.as_ref()));
    let plan = plan(&node, &pods, &pvcs, &pvs, &pdbs, &vas, &volumes, &settings);
    Ok(LivePlan { machine, plan })
}
