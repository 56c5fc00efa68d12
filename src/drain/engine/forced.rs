//! A forced deletion's moves through the ledger. The force-deletion label
//! skips PodDisruptionBudgets and the drain's deadline, as documented, but
//! not the ledger: before its pods are deleted, each pod whose workload
//! bounds its moves (a pod with volumes, by default) asks for a permit as
//! a drain past its deadline would. Within the budget it is granted; past
//! it, it is taken beyond the budget with a Warning that names the moves
//! it joins. Either way the move is recorded as a `MovePermit` that names
//! the Machine and the pod, and the next pod of that workload on any other
//! Machine waits for it: the keeper (see [`keeper`](super::keeper)) ends it
//! once the workload is whole again, or at its healthy deadline. Another
//! drain's permits are never touched.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::runtime::reflector::ObjectRef;

use super::drainer::Drainer;
use crate::api::Machine;
use crate::cache::Caches;
use crate::drain::ledger::{
    Answer, Ask, Budget, MOVE_GROUP_KIND, WorkloadFacts, budget_of, grouped, moving_names,
    permit_expires, ready_since,
};

impl Drainer {
    /// Asks the ledger for the move of each of `pods`, which a forced
    /// deletion of `machine` is about to delete (see the module). Never
    /// holds a pod back: a permit that cannot be written is warned about.
    /// `reattach`: the Machine's reattach timeout, the least a permit
    /// taken here lives (see [`permit_expires`]).
    pub(crate) async fn force_permits(
        &self,
        machine: &Machine,
        pods: &[Arc<Pod>],
        reattach: std::time::Duration,
    ) {
        let ns = machine.metadata.namespace.as_deref().unwrap_or_default();
        let name = machine.metadata.name.as_deref().unwrap_or_default();
        let drain = crate::drain::ledger::Asker {
            machine: format!("{ns}/{name}"),
            requested: machine
                .metadata
                .deletion_timestamp
                .as_ref()
                .map_or_else(Timestamp::now, |t| t.0),
            past_deadline: true,
        };
        for pod in pods {
            let Some((ask, budget, owner)) = forced_ask(&self.deps.caches, pod, &drain) else {
                continue;
            };
            let now = Timestamp::now();
            let expires = permit_expires(now, budget.healthy_deadline, now, reattach);
            let answer = self
                .deps
                .permits
                .ask(&ask, &budget, owner.as_ref(), expires)
                .await;
            let (pod, workload) = (&ask.pod, &ask.workload);
            let (reason, note) = match answer {
                Answer::Granted(_) | Answer::Wait { .. } | Answer::Capped { .. } => continue,
                Answer::Bypassed { moving, .. } => (
                    "MoveBudgetBypassed",
                    format!(
                        "forced deletion (the force-deletion label): pod {pod} of {workload} is deleted beyond its move budget while {} move",
                        moving_names(&moving)
                    ),
                ),
                Answer::Contended { error } => (
                    "MovePermitUnrecorded",
                    format!(
                        "forced deletion (the force-deletion label): pod {pod} of {workload} is deleted without a move permit ({}): another Machine's drain may move a replica of it at the same time",
                        error.unwrap_or_else(|| "its permit was taken at the same moment".into())
                    ),
                ),
            };
            self.deps
                .events
                .warning(machine.object_ref(&()), "Drain", reason, note, None);
        }
    }
}

/// The ask of a forced deletion (`drain`, past its deadline) for `pod`, its
/// workload's budget and the object its permit is owned by; `None` when
/// its workload does not bound its moves (a pod without volumes, by
/// default).
fn forced_ask(
    caches: &Caches,
    pod: &Pod,
    drain: &crate::drain::ledger::Asker,
) -> Option<(Ask, Budget, Option<OwnerReference>)> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    let key = format!("{ns}/{}", pod.metadata.name.as_deref().unwrap_or_default());
    let owners_of = |rs: &str| {
        caches
            .replica_sets
            .get(&ObjectRef::new(rs).within(ns))
            .map(|m| m.metadata.owner_references.clone().unwrap_or_default())
    };
    // Its claims: those it names, and its generic ephemeral volumes'
    // (`<pod>-<volume>`).
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let claims: Vec<String> = pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|v| {
            let ephemeral = v.ephemeral.as_ref().map(|_| format!("{name}-{}", v.name));
            v.persistent_volume_claim
                .as_ref()
                .map(|c| c.claim_name.clone())
                .or(ephemeral)
        })
        .collect();
    let volumes = !claims.is_empty();
    let workload = crate::drain::ledger::workload::workload_of(pod, owners_of);
    let terms = caches.terms(&workload);
    let (budget, _) = budget_of(pod.metadata.annotations.as_ref(), &terms, volumes);
    if budget.max_moving.is_none() && !volumes {
        return None;
    }
    let (workload, terms, _) = grouped(workload, terms, |g| caches.group_members(ns, g));
    let terms = caches.counted(&workload, terms);
    let ready = ready_since(pod).is_some();
    let owner = (workload.kind != MOVE_GROUP_KIND)
        .then(|| crate::drain::ledger::workload::workload_owner(pod, owners_of))
        .flatten();
    let ask = Ask {
        workload,
        uid: pod.metadata.uid.clone().unwrap_or_else(|| key.clone()),
        pod: key,
        machine: drain.machine.clone(),
        priority: pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
        requested: drain.requested,
        past_deadline: drain.past_deadline,
        volumes,
        // A pod already down takes nothing more down (see `Ask::new`).
        unavailable: if ready {
            terms.availability.map_or(0, |a| a.unavailable)
        } else {
            0
        },
        attach: caches.attached(ns, &claims),
    };
    Some((ask, budget, owner))
}
