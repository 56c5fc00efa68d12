//! What the MachineSet and MachineDeployment controllers read of a
//! Machine from the caches, for their pure decisions: its [`facts`] (the
//! counts of `decide`) and its deletion [`candidate`] (the order of
//! `order`). Both controllers' reconciles read it here, neither from the
//! other's reconcile. It lives in this folder, not in `cache/` or
//! `controller/`: it builds this folder's pure types and reads the drain's
//! PodDisruptionBudget verdicts and the Machine controller's Node
//! readiness, all above those folders in the layers.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use super::Caches;
use super::decide::MachineFacts;
use super::order::{self, Candidate, Health};
use crate::api::conditions::{NODE_HEALTHY, READY};
use crate::api::{Machine, MachinePhase};
use crate::drain::engine::CacheSight;
use crate::drain::pdb::{PdbVerdict, findings_for};
use crate::drain::plan::controller_of;
use crate::drain::select::{PodClass, classify};
use crate::machine::decide::{node_ready, node_takes_pods};
use crate::machine::status::condition;
use crate::placement::{Draining, Needs, Rules, choose, moving_pvs};

/// What the set's status and a rollout's pace count of `m`: its phase,
/// whether its Node takes pods, since when it is Ready.
pub(crate) fn facts(m: &Machine, caches: &Caches) -> MachineFacts {
    let ready = condition(m.status.as_ref(), READY).filter(|c| c.status == "True");
    MachineFacts {
        phase: m.status.as_ref().and_then(|s| s.phase),
        node_ready: caches.node_of(m).is_some_and(|n| node_takes_pods(&n)),
        ready_since: ready.map(|c| c.last_transition_time.0),
    }
}

/// What the deletion order knows of `m`, from the caches: its Node's pods
/// by the pods-by-Node index and its attachments by the
/// VolumeAttachments-by-Node index; no request.
pub(crate) fn candidate(m: &Machine, caches: &Caches) -> Candidate {
    let phase = m.status.as_ref().and_then(|s| s.phase);
    let node = caches.node_of(m);
    let health = match phase {
        Some(MachinePhase::Running) => {
            if let Some(c) =
                condition(m.status.as_ref(), NODE_HEALTHY).filter(|c| c.status == "False")
            {
                Health::Unhealthy(format!("NodeHealthy False ({})", c.reason))
            } else {
                match &node {
                    Some(n) if node_ready(n) => Health::Healthy,
                    Some(n) => Health::Unhealthy(format!("Node {} NotReady", n.name_any())),
                    None => Health::Unhealthy("its Node is gone".into()),
                }
            }
        }
        Some(p) => Health::Unhealthy(format!("phase {}", p.as_str())),
        None => Health::Unhealthy("phase Pending".into()),
    };
    let (cost, pdb_blocked, stranded) = match &node {
        Some(n) => {
            let name = n.name_any();
            let pods = caches.indexes.pods_by_node.get(&caches.pods, &name);
            let attached = caches.indexes.attachments_by_node.refs(&name).len();
            let cost = order::drain_cost(pods.iter().map(|p| &**p), attached, |ns, claim| {
                caches
                    .pvcs
                    .get(&ObjectRef::new(claim).within(ns))
                    .and_then(|c| c.spec.as_ref()?.volume_name.clone())
                    .is_some()
            });
            let stranded = (cost.stateful_pods > 0)
                .then(|| stranded(pods.iter().map(|p| &**p), &name, caches))
                .flatten();
            (
                cost,
                pdb_blocked(pods.iter().map(|p| &**p), caches),
                stranded,
            )
        }
        None => (order::DrainCost::default(), None, None),
    };
    Candidate {
        name: m.name_any(),
        priority: order::priority(m.metadata.annotations.as_ref()),
        health,
        pdb_blocked,
        stranded,
        cost,
        created: m.metadata.creation_timestamp.as_ref().map(|t| t.0),
    }
}

/// Why a stateful pod of `pods`, on Node `node`, would find no Node for
/// its replacement if `node` were drained now, in words (see
/// [`crate::placement`]): the first such pod.
fn stranded<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    node: &str,
    caches: &Caches,
) -> Option<String> {
    let sight = CacheSight::from_caches(caches);
    let without = Draining {
        sight: &sight,
        node,
    };
    pods.into_iter()
        .filter(|p| classify(p) == PodClass::Evictable && controller_of(p).is_some())
        .find_map(|p| {
            let pvs = moving_pvs(&without, p);
            let needs = Needs::of(&without, p, &pvs, Rules::default());
            if pvs.is_empty() || !needs.pinned() {
                return None;
            }
            let verdict = choose(&without, &needs);
            verdict.node.is_none().then(|| {
                format!(
                    "stateful pod {} would have no destination: {}",
                    needs.pod,
                    verdict.why()
                )
            })
        })
}

/// Why a drain of `pods` would be blocked now: the first evictable pod a
/// PodDisruptionBudget covers that allows no disruption (or is
/// misconfigured), in words.
fn pdb_blocked<'a>(pods: impl IntoIterator<Item = &'a Pod>, caches: &Caches) -> Option<String> {
    let pdbs = caches.pdbs.state();
    if pdbs.is_empty() {
        return None;
    }
    pods.into_iter()
        .filter(|p| classify(p) == PodClass::Evictable)
        .find_map(|p| {
            let ns = p.metadata.namespace.as_deref();
            let local: Vec<PodDisruptionBudget> = pdbs
                .iter()
                .filter(|b| b.metadata.namespace.as_deref() == ns)
                .map(|b| (**b).clone())
                .collect();
            findings_for(p, &local)
                .into_iter()
                .find(|f| f.verdict != PdbVerdict::Allows)
                .map(|f| format!("pod {}/{}: {f}", ns.unwrap_or_default(), p.name_any()))
        })
}
