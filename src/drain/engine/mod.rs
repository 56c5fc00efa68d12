//! The drain engine: executes the [`plan`](super::plan) of a Node against
//! the cluster.
//!
//! One task per draining Machine, started by the reconciler's Drain step
//! and owned by the [`Drainer`]. The task works in passes: each pass plans
//! from the informer caches, takes the lowest order group with a pod left
//! (critical pods last; see [`rules`](super::rules)), then
//!
//! 1. deletes finished pods;
//! 2. evicts the pods without persistent volumes, at most
//!    `maxConcurrentEvictions` at a time, each after a permit of the move
//!    [ledger](super::ledger) when its workload bounds its moves, and waits
//!    for each to be gone;
//! 3. at the same time moves the stateful pods in priority order, at most
//!    `maxParallelVolumeMigrations` at a time: a permit of the ledger for
//!    its workload (a pod that must wait is left to a later pass, and its
//!    Machine waits in the ledger's line) → the move recorded in
//!    `status.drain.moves` → register with the volume tracker → evict → pod
//!    gone → its volumes detached from this Node → attached on another Node
//!    where the replacement runs, and the replacement healthy (a warning if
//!    not in time; not waited for when no pod still references the claim)
//!    → the record and the permit end. Before the first stateful eviction
//!    it waits for the moves an earlier run recorded (a restart mid-drain
//!    resumes exactly here) and for volumes still detaching from pods that
//!    left earlier;
//! 4. waits for pods that were already terminating, and for the group's
//!    pods that a drain rule says to wait on until they complete;
//! 5. waits, when pods wait for a permit, until one frees (or the
//!    deadline).
//!
//! and repeats until a pass finds nothing left to do. Nothing polls: pod
//! and PodDisruptionBudget waits wake on the informers' change signals,
//! volume waits on the tracker, permit waits on the ledger, and the only
//! timers are bounds, backoff ceilings and the drain deadline.
//!
//! A PodDisruptionBudget is never bypassed before the deadline: a refused
//! eviction (429) is retried with exponential backoff and jitter, and sooner
//! when a PDB in the pod's namespace changes. After `maxEvictRetries`
//! refusals, or at once for a misconfigured PDB, the pod is reported as
//! blocked, naming the PDB, and retried only when a PDB changes or the
//! backoff ceiling passes. The deadline gives up budgets, never volumes:
//! with `forceAfterDeadline`, a pod still not evicted is deleted with its
//! own grace period at the deadline minus that grace period, and the passes
//! go on after the deadline, stateful pods still one at a time with their
//! pod-gone and detach waits (never cut at the deadline), until a pass
//! moves nothing; without it, one last pass tries each pod once more and
//! the drain fails with the list of pods and why; the reconciler retries it
//! later, with the same deadline. A pod that a finalizer holds after its
//! grace period is reported once and holds the drain until the deadline
//! plus its grace period.
//!
//! Progress goes to `Machine.status.drain` through one writer task that
//! coalesces updates and is the only writer of that field; Events record
//! each stateful pod's eviction, each volume move, and each batch of other
//! pods evicted together.
//!
//! The order of every step comes from the fields of the
//! [`DrainPlan`](super::plan::DrainPlan): what `berth plan` prints is what a
//! pass does.
//!
//! The modules, from the bottom: the drain's parts, which do no I/O; the
//! drain, which owns them; the steps, each a type that borrows the drain;
//! the run; the registry.
//!
//! | module | what it holds |
//! | --- | --- |
//! | `clock` | `Clock`: the deadline as instants (a step's bound, a volume wait's bound, force-at, expired, the last try) |
//! | `tally` | `Tally`: what this run evicted, forced, or found first |
//! | `held` | `HeldMoves`: workloads held for an unplaceable replacement, volumes given up on |
//! | `groups` | `Groups`: the order groups entered, and the rules named once |
//! | `batch` | `Batch`: pods evicted together, announced in one Event |
//! | `reports` | `Reports`: Events about the Machine, what was reported once (`Memory`, kept across runs), the objects Events relate to |
//! | `progress` | `Progress` and its writer, the only writer of `status.drain`; `ProgressTx`, the drain's side of it |
//! | `view` | `View`: the read-only queries of the caches, for one Node |
//! | `waits` | `Waits`: a pod gone, a condition over the pods, replacements healthy, volumes moved with their pod |
//! | `node_drain` | `NodeDrain`: one drain's parts, its plan and its pods |
//! | `permits` | `DrainPermits`: the drain's asks of the [ledger](crate::drain::ledger), with their Events and words, gated pods without volumes, and whether a move no drain watches is over |
//! | `records` | `MoveRecords`: the moves in `status.drain.moves` (written before the eviction, resumed after a restart, stalled, held, handed over) |
//! | `eviction` | `PodEviction`: one pod's eviction with its retry state |
//! | `terminating` | `Terminating`: a pod that was already being deleted |
//! | `completion` | `WaitCompleted`: pods a drain rule says to wait on |
//! | `migration` | `Migration`: one stateful pod's move, step by step |
//! | `pass` | `Pass`: one pass, in named stages |
//! | `run` | a drain from its first pass to its outcome |
//! | `drainer` | `Drainer`: the registry of running drains, one task per Machine |
//! | `keeper` | the permits of moves no drain watches any more, until their workload is whole or they expire |
//! | `forced` | a forced deletion's moves, asked of the ledger and recorded before its pods go |

mod batch;
mod clock;
mod completion;
mod destination;
pub(crate) use destination::CacheSight;
mod drainer;
mod eviction;
mod forced;
mod groups;
mod held;
mod keeper;
mod migration;
mod node_drain;
mod pass;
mod permits;
mod progress;
mod records;
mod reports;
mod run;
mod surge;
mod tally;
mod terminating;
mod view;
mod waits;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::reflector::ObjectRef;
use std::sync::Arc;

pub use self::batch::evicted_note;
pub use self::drainer::Drainer;
pub(crate) use self::drainer::{RESTART_ENDED_AFTER, RETRY_FAILED_AFTER};
pub(crate) use self::forced::Freeing;
pub(crate) use self::progress::Progress;
pub(crate) use self::view::rule_book;
use super::deadline::Deadline;
use crate::api::Machine;
use crate::api::settings::ResolvedSettings;
use crate::cache::Caches;
use crate::drain::ledger::Permits;
use crate::telemetry::Metrics;
use crate::telemetry::events::EventSink;
use crate::volumes::Tracker;

/// Makes the API clients of one drain (see `Deps::drain_client`).
pub type ClientPerDrain = Arc<dyn Fn() -> DrainClients + Send + Sync>;

/// The API clients of one drain, each a line of its own on the process's
/// one rate limit.
#[derive(Clone)]
pub struct DrainClients {
    /// The steps of its stateful moves that the next replica of a
    /// workload waits for (a move's record, its eviction): an urgent
    /// line, ahead of every other request while it waits for a token, so
    /// that when many drains start at once the hundreds of other requests
    /// they send never hold them up (see `wiring::ratelimit`).
    pub moves: Client,
    /// Everything else: evictions of pods without volumes, progress.
    pub rest: Client,
}

impl From<Client> for DrainClients {
    /// One client for both (no rate limit of berth's own).
    fn from(client: Client) -> Self {
        Self {
            moves: client.clone(),
            rest: client,
        }
    }
}

/// What the engine reads and writes through.
pub(crate) struct Deps {
    /// Each drain's own client, on the process's one rate limit: with many
    /// drains at once, each has its own queue for the limiter's tokens, so
    /// one drain's burst of evictions does not hold another's first one
    /// behind it (see `wiring::process::LimitedClients`).
    pub(crate) drain_client: ClientPerDrain,
    pub(crate) caches: Caches,
    pub(crate) tracker: Tracker,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) events: EventSink,
    /// The move ledger every drain of this process asks.
    pub(crate) permits: Permits,
}

/// How a drain ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Every pod that had to go is gone and its volumes have moved.
    Drained,
    /// The deadline passed and the pods left were force-deleted.
    Forced { pods: Vec<String> },
    /// The deadline passed and forcing is not allowed: these pods are left.
    Failed { message: String },
}

impl Outcome {
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Outcome::Drained => "drained",
            Outcome::Forced { .. } => "forced",
            Outcome::Failed { .. } => "failed",
        }
    }
}

/// One drain to run.
#[derive(Debug, Clone)]
pub(crate) struct Job {
    pub(crate) machine: ObjectRef<Machine>,
    /// The Machine, for Events.
    pub(crate) machine_ref: ObjectReference,
    pub(crate) node: String,
    pub(crate) settings: ResolvedSettings,
    /// Starts at the Machine's `deletionTimestamp`, which is also
    /// `status.drain.startedAt`.
    pub(crate) deadline: Deadline,
    /// The volume moves in flight that `status.drain` records (a previous
    /// run's, if the controller restarted): resumed before any other
    /// stateful pod is evicted.
    pub(crate) moves: Vec<crate::api::VolumeMove>,
    /// The Machine is annotated `berth.dev/allow-node-local-data-loss:
    /// "true"`: `nodeLocalVolumes: Block` holds none of its pods. A
    /// running drain learns a change of it from the next reconcile.
    pub(crate) data_loss_allowed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_have_metric_labels() {
        assert_eq!(Outcome::Drained.label(), "drained");
        assert_eq!(Outcome::Forced { pods: vec![] }.label(), "forced");
        assert_eq!(
            Outcome::Failed {
                message: String::new()
            }
            .label(),
            "failed"
        );
    }
}
