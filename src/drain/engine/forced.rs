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
use k8s_openapi::jiff::Timestamp;
use kube::Resource;

use super::drainer::Drainer;
use crate::api::Machine;
use crate::drain::ledger::{Answer, PodToMove, moving_names, permit_expires, pod_ask};

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
            // A forced deletion does not wait in line.
            moves_left: 0,
        };
        for pod in pods {
            // The pod as it is: its claims are its volumes, and its
            // attachable PVs those attached now (a drain's are the plan's).
            // A forced deletion does not warn of what berth cannot read of
            // its annotations (`asked.bad`): the default holds.
            let caches = &self.deps.caches;
            let asked = pod_ask(caches, PodToMove::live(pod, caches), &drain);
            let (Some(ask), budget, owner) = (asked.ask, asked.budget, asked.owner) else {
                // Its workload bounds none of its moves, and it has no
                // volumes.
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
