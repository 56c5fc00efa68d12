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
//!
//! A remediation's moves (a dead Node's pods, its VM fenced) go through
//! the ledger too, but wait for it: see [`Drainer::remediation_permits`].

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::Resource;

use super::drainer::Drainer;
use crate::api::Machine;
use crate::drain::ledger::{
    Answer, Ask, Asker, Budget, PodToMove, moving_names, permit_expires, pod_ask,
};

/// What the ledger answered a remediation for the moves of a dead Node's
/// pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Freeing {
    /// Each move has its permit: the Node may be freed.
    Granted,
    /// Not now (none was kept): the moves in the way, in words.
    Waiting(String),
}

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

impl Drainer {
    /// Takes the ledger's permits for the moves of `pods`, the pods of a
    /// dead Node whose VM `machine`'s remediation fenced (begun at
    /// `started`), all or none: freeing the Node frees every pod on it at
    /// once, so it waits until each of their workloads may move one
    /// replica, as a drain's ask waits, and takes nothing while it waits
    /// (holding one workload's permit while waiting for another's could
    /// hold two dead Nodes each waiting for the other). A second replica
    /// of a workload on the same dead Node is down already: it is taken
    /// beyond the budget, with a Warning.
    pub(crate) async fn remediation_permits(
        &self,
        machine: &Machine,
        pods: &[Arc<Pod>],
        reattach: std::time::Duration,
        started: Timestamp,
    ) -> Freeing {
        let ns = machine.metadata.namespace.as_deref().unwrap_or_default();
        let name = machine.metadata.name.as_deref().unwrap_or_default();
        let asker = Asker {
            machine: format!("{ns}/{name}"),
            requested: started,
            past_deadline: false,
            moves_left: 0,
        };
        let caches = &self.deps.caches;
        let mut firsts: Vec<(Ask, Budget, _)> = Vec::new();
        let mut extras = Vec::new();
        let mut seen = BTreeSet::new();
        for pod in pods {
            let asked = pod_ask(caches, PodToMove::live(pod, caches), &asker);
            let (Some(ask), budget, owner) = (asked.ask, asked.budget, asked.owner) else {
                continue;
            };
            if seen.insert(ask.workload.clone()) {
                firsts.push((ask, budget, owner));
            } else {
                extras.push((ask, budget, owner));
            }
        }
        let permits = &self.deps.permits;
        let held = |a: &Ask| permits.held_for(&a.workload, &a.uid).is_some();
        let blocked: Vec<String> = firsts
            .iter()
            .filter(|(a, b, _)| !held(a) && !permits.would_grant(a, b))
            .map(|(a, _, _)| format!("{} of {}", a.pod, a.workload))
            .collect();
        if !blocked.is_empty() {
            return Freeing::Waiting(format!(
                "the move budget of each of these is taken by a move in flight: {}",
                blocked.join(", ")
            ));
        }
        let now = Timestamp::now();
        let mut taken = Vec::new();
        for (ask, budget, owner) in &firsts {
            let before = held(ask);
            let expires = permit_expires(now, budget.healthy_deadline, now, reattach);
            match permits.ask(ask, budget, owner.as_ref(), expires).await {
                Answer::Granted(_) | Answer::Bypassed { .. } => {
                    if !before {
                        taken.push(ask);
                    }
                }
                Answer::Wait { .. } | Answer::Capped { .. } | Answer::Contended { .. } => {
                    // Taken elsewhere since: none is kept, nobody waits.
                    for a in &taken {
                        permits.end(&a.workload, &a.uid);
                    }
                    permits.keep_waiting(&asker.machine, &[]);
                    return Freeing::Waiting(format!(
                        "the move budget of {} of {} was taken at the same moment",
                        ask.pod, ask.workload
                    ));
                }
            }
        }
        let beyond = Asker {
            past_deadline: true,
            ..asker
        };
        for (ask, budget, owner) in extras {
            let ask = Ask {
                past_deadline: beyond.past_deadline,
                ..ask
            };
            let expires = permit_expires(now, budget.healthy_deadline, now, reattach);
            if let Answer::Bypassed { moving, .. } =
                permits.ask(&ask, &budget, owner.as_ref(), expires).await
            {
                self.deps.events.warning(
                    machine.object_ref(&()),
                    "Remediation",
                    "MoveBudgetBypassed",
                    format!(
                        "remediation: the dead Node carried another replica of {}: pod {} is freed with it, beyond its move budget, while {} move",
                        ask.workload,
                        ask.pod,
                        moving_names(&moving)
                    ),
                    None,
                );
            }
        }
        Freeing::Granted
    }
}
