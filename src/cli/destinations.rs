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
use crate::drain::ledger::held_permit;
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
    moving: Vec<Holding>,
}

/// Every `K` of the cluster.
async fn all<K>(client: &Client) -> Result<Vec<K>, kube::Error>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(Api::<K>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items)
}

/// `objs` by the key `key` gives each.
fn by<K, T: Ord>(objs: Vec<K>, key: impl Fn(&K) -> T) -> BTreeMap<T, Arc<K>> {
    objs.into_iter().map(|o| (key(&o), Arc::new(o))).collect()
}

impl Listed {
    /// The cluster as `berth plan` sees it: what the plan already listed
    /// (`volumes`: its claims, PVs and CSIDrivers), and the rest listed
    /// here.
    async fn list(client: &Client, volumes: &Volumes<'_>) -> Result<Self, kube::Error> {
        let mut pods: BTreeMap<String, Vec<Arc<Pod>>> = BTreeMap::new();
        for p in all::<Pod>(client).await? {
            if let Some(n) = p.spec.as_ref().and_then(|s| s.node_name.clone()) {
                pods.entry(n).or_default().push(Arc::new(p));
            }
        }
        let deleting = all::<Machine>(client)
            .await?
            .into_iter()
            .filter(|m| m.metadata.deletion_timestamp.is_some())
            .filter_map(|m| Some(m.status?.node_ref?.name))
            .collect();
        let templates = all::<StatefulSet>(client)
            .await?
            .into_iter()
            .filter_map(|s| {
                let key = (s.namespace().unwrap_or_default(), s.name_any());
                Some((key, s.spec.template.spec?))
            })
            .collect();
        let moving = all::<MovePermit>(client)
            .await?
            .iter()
            .filter_map(held_permit)
            .filter_map(|(_, p)| p.holding())
            .collect();
        Ok(Self {
            nodes: all::<Node>(client)
                .await?
                .into_iter()
                .map(Arc::new)
                .collect(),
            csi_nodes: by(all::<CSINode>(client).await?, |o| o.name_any()),
            pods,
            pvs: by(volumes.pvs.to_vec(), |o| o.name_any()),
            pvcs: by(volumes.pvcs.to_vec(), |c| {
                (c.namespace().unwrap_or_default(), c.name_any())
            }),
            drivers: by(volumes.drivers.to_vec(), |o| o.name_any()),
            deleting,
            templates,
            moving,
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
        self.moving.clone()
    }
}

/// What `berth plan` listed for its plan, which the destinations read too.
pub(super) struct Volumes<'a> {
    pub(super) pvcs: &'a [PersistentVolumeClaim],
    pub(super) pvs: &'a [PersistentVolume],
    pub(super) drivers: &'a [CSIDriver],
}

/// One line per stateful pod of `plan` that must find a destination
/// first: the Node its replacement can run on now, or why none can.
pub(super) async fn destination_lines(
    client: &Client,
    plan: &DrainPlan,
    pods: &[Pod],
    settings: &ResolvedSettings,
    volumes: &Volumes<'_>,
) -> Result<Vec<String>, kube::Error> {
    if plan.stateful.is_empty() {
        return Ok(Vec::new());
    }
    let listed = Listed::list(client, volumes).await?;
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
