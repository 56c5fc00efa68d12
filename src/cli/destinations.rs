//! `berth plan`'s destinations: for each stateful pod that must find a
//! Node for its replacement before it goes (see [`crate::placement`]),
//! the Node the drain would count on now, or every Node and why it
//! cannot, judged from fresh lists as the controller judges from its
//! caches (the moves in flight by the MovePermits of every process).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod, PodSpec};
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};

use crate::api::{Machine, MovePermit, settings::ResolvedSettings};
use crate::drain::ledger::{Permit, held_permit};
use crate::drain::plan::DrainPlan;
use crate::drain::select::fmt_key;
use crate::placement::{Holding, Needs, Rules, Sight, choose, made_from};

/// The cluster as listed for `berth plan`.
struct Listed {
    nodes: Vec<Arc<Node>>,
    csi_nodes: BTreeMap<String, Arc<CSINode>>,
    pods: BTreeMap<String, Vec<Arc<Pod>>>,
    pvs: BTreeMap<String, Arc<PersistentVolume>>,
    pvcs: BTreeMap<(String, String), Arc<PersistentVolumeClaim>>,
    drivers: BTreeMap<String, Arc<CSIDriver>>,
    /// The Nodes of Machines being deleted.
    deleting: Vec<String>,
    /// Each StatefulSet's pod template, by namespace and name: what its
    /// replacement pods are made from.
    templates: BTreeMap<(String, String), PodSpec>,
    moving: Vec<Permit>,
}

impl Listed {
    async fn list(client: &Client) -> Result<Self, kube::Error> {
        let lp = ListParams::default();
        let by_name = |objs: Vec<_>| -> BTreeMap<String, Arc<_>> {
            objs.into_iter()
                .map(|o: CSINode| (o.name_any(), Arc::new(o)))
                .collect()
        };
        let mut pods: BTreeMap<String, Vec<Arc<Pod>>> = BTreeMap::new();
        for p in Api::<Pod>::all(client.clone()).list(&lp).await?.items {
            if let Some(n) = p.spec.as_ref().and_then(|s| s.node_name.clone()) {
                pods.entry(n).or_default().push(Arc::new(p));
            }
        }
        let deleting = Api::<Machine>::all(client.clone())
            .list(&lp)
            .await?
            .items
            .into_iter()
            .filter(|m| m.metadata.deletion_timestamp.is_some())
            .filter_map(|m| Some(m.status?.node_ref?.name))
            .collect();
        Ok(Self {
            nodes: Api::<Node>::all(client.clone())
                .list(&lp)
                .await?
                .items
                .into_iter()
                .map(Arc::new)
                .collect(),
            csi_nodes: by_name(Api::<CSINode>::all(client.clone()).list(&lp).await?.items),
            pods,
            pvs: Api::<PersistentVolume>::all(client.clone())
                .list(&lp)
                .await?
                .items
                .into_iter()
                .map(|p| (p.name_any(), Arc::new(p)))
                .collect(),
            pvcs: Api::<PersistentVolumeClaim>::all(client.clone())
                .list(&lp)
                .await?
                .items
                .into_iter()
                .map(|c| {
                    (
                        (c.namespace().unwrap_or_default(), c.name_any()),
                        Arc::new(c),
                    )
                })
                .collect(),
            drivers: Api::<CSIDriver>::all(client.clone())
                .list(&lp)
                .await?
                .items
                .into_iter()
                .map(|d| (d.name_any(), Arc::new(d)))
                .collect(),
            deleting,
            templates: Api::<StatefulSet>::all(client.clone())
                .list(&lp)
                .await?
                .items
                .into_iter()
                .filter_map(|s| {
                    let key = (s.namespace().unwrap_or_default(), s.name_any());
                    Some((key, s.spec.template.spec?))
                })
                .collect(),
            moving: Api::<MovePermit>::all(client.clone())
                .list(&lp)
                .await?
                .items
                .iter()
                .filter_map(held_permit)
                .map(|(_, p)| p)
                .filter(|p| p.destination.is_some())
                .collect(),
        })
    }
}

impl Sight for Listed {
    fn nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.clone()
    }

    fn csi_node(&self, node: &str) -> Option<Arc<CSINode>> {
        self.csi_nodes.get(node).cloned()
    }

    fn pods_on(&self, node: &str) -> Vec<Arc<Pod>> {
        self.pods.get(node).cloned().unwrap_or_default()
    }

    fn pv(&self, name: &str) -> Option<Arc<PersistentVolume>> {
        self.pvs.get(name).cloned()
    }

    fn pv_of_claim(&self, namespace: &str, claim: &str) -> Option<Arc<PersistentVolume>> {
        let pvc = self.pvcs.get(&(namespace.to_string(), claim.to_string()))?;
        self.pv(pvc.spec.as_ref()?.volume_name.as_deref()?)
    }

    fn driver(&self, name: &str) -> Option<Arc<CSIDriver>> {
        self.drivers.get(name).cloned()
    }

    fn draining(&self, node: &Node) -> bool {
        crate::api::cordoned_at(node).is_some() || self.deleting.contains(&node.name_any())
    }

    fn claim_users(&self, namespace: &str, claim: &str) -> Vec<Arc<Pod>> {
        self.pods
            .values()
            .flatten()
            .filter(|p| {
                p.metadata.namespace.as_deref() == Some(namespace)
                    && crate::cache::claim_names(p).iter().any(|c| c == claim)
            })
            .cloned()
            .collect()
    }

    fn holdings(&self) -> Vec<Holding> {
        self.moving.iter().filter_map(Permit::holding).collect()
    }
}

/// One line per stateful pod of `plan` that must find a destination
/// first: the Node its replacement can run on now, or why none can.
pub(super) async fn destination_lines(
    client: &Client,
    plan: &DrainPlan,
    pods: &[Pod],
    settings: &ResolvedSettings,
) -> Result<Vec<String>, kube::Error> {
    if plan.stateful.is_empty() {
        return Ok(Vec::new());
    }
    let listed = Listed::list(client).await?;
    let rules = Rules {
        require_csi_node: settings.require_csi_node,
    };
    let mut lines = Vec::new();
    for p in &plan.stateful {
        let key = fmt_key(&p.pod);
        let pvs = p.moving_pvs();
        let Some(pod) = pods.iter().find(|o| o.metadata.uid == p.uid) else {
            continue;
        };
        let template = match p.controller.as_deref().and_then(|c| c.split_once('/')) {
            Some(("StatefulSet", name)) => listed.templates.get(&(p.pod.0.clone(), name.into())),
            _ => None,
        };
        let pod = template.map_or_else(|| pod.clone(), |t| made_from(pod, t));
        let needs = Needs::of(&listed, &pod, &pvs, rules);
        if p.controller.is_none() || pvs.is_empty() || !needs.pinned() {
            continue;
        }
        let verdict = choose(&listed, &needs);
        lines.push(match verdict.node {
            Some(node) => format!("{key}: its replacement can run on {node}"),
            None => format!(
                "{key}: no Node can take its replacement, it waits (DestinationUnavailable): {}",
                verdict.why()
            ),
        });
    }
    Ok(lines)
}
