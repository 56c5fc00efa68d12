//! `berth plan`'s surges: for each pod of the plan whose
//! PodDisruptionBudget lets none go now, whether the drain would surge its
//! Deployment before it goes, how, or why not (see
//! [`crate::drain::surge`]), judged from fresh lists as the engine judges
//! from its caches.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::Client;
use kube::api::{Api, ListParams};

use crate::api::Machine;
use crate::drain::ledger::workload::controller;
use crate::drain::plan::{DrainPlan, PlannedPod, controller_of};
use crate::drain::select::fmt_key;
use crate::drain::surge::{SURGED_FOR_ANNOTATION, SurgeFacts, decide, forbidding, needed};

/// What one namespace says of its Deployments, as listed once.
struct Namespace {
    deployments: Vec<Deployment>,
    replica_sets: Vec<ReplicaSet>,
    pods: Vec<Pod>,
    /// The HorizontalPodAutoscalers' targets, `Kind/name` to the
    /// autoscaler; `Err`: they cannot be listed (counted as autoscaled).
    autoscalers: Result<BTreeMap<String, String>, String>,
}

/// One line per pod of `plan` whose budgets let none go now: what its
/// surge would be.
///
/// # Errors
/// API errors.
pub(super) async fn surge_lines(
    client: &Client,
    machine: &Machine,
    node: &str,
    plan: &DrainPlan,
    pods: &[Pod],
    pvcs: &[PersistentVolumeClaim],
) -> kube::Result<Vec<String>> {
    let held: Vec<&PlannedPod> = plan
        .stateless
        .iter()
        .chain(&plan.stateful)
        .filter(|p| needed(&p.pdbs))
        .collect();
    if held.is_empty() {
        return Ok(Vec::new());
    }
    let machines = Api::<Machine>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let mut draining: BTreeSet<String> = machines
        .iter()
        .filter(|m| m.metadata.deletion_timestamp.is_some())
        .filter_map(|m| Some(m.status.as_ref()?.node_ref.as_ref()?.name.clone()))
        .collect();
    // The plan is the drain that would happen now: this Machine's Node
    // drains.
    draining.insert(node.to_string());
    let machine_key = format!(
        "{}/{}",
        machine.metadata.namespace.as_deref().unwrap_or_default(),
        machine.metadata.name.as_deref().unwrap_or_default()
    );
    let mut namespaces: BTreeMap<String, Namespace> = BTreeMap::new();
    let mut lines = Vec::new();
    for p in held {
        let ns = &p.pod.0;
        if !namespaces.contains_key(ns) {
            namespaces.insert(ns.clone(), listed(client, ns).await?);
        }
        let Some(listed) = namespaces.get(ns) else {
            continue;
        };
        let Some(pod) = pods.iter().find(|o| o.metadata.uid == p.uid) else {
            continue;
        };
        let surge = judge(listed, p, pod, pvcs, &draining, &machine_key);
        lines.push(format!("{}: {}", fmt_key(&p.pod), surge.words(ns)));
    }
    Ok(lines)
}

/// The Deployments, ReplicaSets, pods and autoscalers of namespace `ns`.
async fn listed(client: &Client, ns: &str) -> kube::Result<Namespace> {
    let lp = ListParams::default();
    let autoscalers = match Api::<HorizontalPodAutoscaler>::namespaced(client.clone(), ns)
        .list(&lp)
        .await
    {
        Ok(l) => Ok(l
            .items
            .into_iter()
            .filter_map(|h| {
                let t = &h.spec.scale_target_ref;
                Some((format!("{}/{}", t.kind, t.name), h.metadata.name?))
            })
            .collect()),
        Err(e) => Err(e.to_string()),
    };
    Ok(Namespace {
        deployments: Api::<Deployment>::namespaced(client.clone(), ns)
            .list(&lp)
            .await?
            .items,
        replica_sets: Api::<ReplicaSet>::namespaced(client.clone(), ns)
            .list(&lp)
            .await?
            .items,
        pods: Api::<Pod>::namespaced(client.clone(), ns)
            .list(&lp)
            .await?
            .items,
        autoscalers,
    })
}

/// The surge of planned pod `p` (`pod`) from what its namespace lists.
fn judge(
    listed: &Namespace,
    p: &PlannedPod,
    pod: &Pod,
    pvcs: &[PersistentVolumeClaim],
    draining: &BTreeSet<String>,
    machine: &str,
) -> crate::drain::surge::Surge {
    let deployment = controller(pod.metadata.owner_references.as_deref())
        .filter(|o| o.kind == "ReplicaSet")
        .and_then(|o| {
            listed
                .replica_sets
                .iter()
                .find(|rs| rs.metadata.uid.as_deref() == Some(o.uid.as_str()))
        })
        .and_then(|rs| controller(rs.metadata.owner_references.as_deref()))
        .filter(|o| o.kind == "Deployment")
        .and_then(|o| {
            listed
                .deployments
                .iter()
                .find(|d| d.metadata.uid.as_deref() == Some(o.uid.as_str()))
        });
    let autoscaler = deployment.and_then(|d| match &listed.autoscalers {
        Ok(targets) => targets
            .get(&format!(
                "Deployment/{}",
                d.metadata.name.as_deref().unwrap_or_default()
            ))
            .cloned(),
        Err(e) => Some(format!(
            "(unknown: cannot list HorizontalPodAutoscalers: {e})"
        )),
    });
    let sets: BTreeSet<&str> = deployment
        .and_then(|d| d.metadata.uid.as_deref())
        .map(|uid| {
            listed
                .replica_sets
                .iter()
                .filter(|rs| {
                    controller(rs.metadata.owner_references.as_deref())
                        .is_some_and(|o| o.uid == uid)
                })
                .filter_map(|rs| rs.metadata.uid.as_deref())
                .collect()
        })
        .unwrap_or_default();
    let pods_on: Vec<Option<&str>> = listed
        .pods
        .iter()
        .filter(|o| o.metadata.deletion_timestamp.is_none())
        .filter(|o| {
            controller(o.metadata.owner_references.as_deref())
                .is_some_and(|c| sets.contains(c.uid.as_str()))
        })
        .map(|o| o.spec.as_ref().and_then(|s| s.node_name.as_deref()))
        .collect();
    let forbidding = forbidding(p, |ns, name| {
        pvcs.iter()
            .find(|c| {
                c.metadata.namespace.as_deref() == Some(ns)
                    && c.metadata.name.as_deref() == Some(name)
            })
            .and_then(|c| c.spec.as_ref()?.access_modes.clone())
            .unwrap_or_default()
    });
    let controller = controller_of(pod);
    let pod_surged_for = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SURGED_FOR_ANNOTATION));
    decide(&SurgeFacts {
        controller: controller.as_deref(),
        deployment,
        autoscaler: autoscaler.as_deref(),
        pods_on: &pods_on,
        draining,
        forbidding: &forbidding,
        machine,
        pod_surged_for: pod_surged_for.map(String::as_str),
        rule_terms: p.rule_terms.as_ref(),
    })
}
