//! The move ledger: a workload's move budget across every drain of the
//! cluster, and everything that reads, decides or keeps it.
//!
//! A drain protects a workload inside its own Node; the ledger protects it
//! across all of them, as Nomad's drainer keeps each job's migrations
//! within `max_parallel` across every draining node. Every eviction or
//! forced deletion of a pod whose move the ledger counts (a pod with
//! volumes that move, or one whose workload bounds its moves) asks for a
//! permit for the pod's [`Workload`]; a permit is held for the whole move
//! (evicted, gone, volumes detached, attached where the replacement runs,
//! the replacement healthy) and counts against the workload's [`Budget`].
//! Asks of one workload that cannot all go are answered in one order:
//! higher pod priority first, then the Machine whose deletion was requested
//! first, then the Machine's and the pod's names. A drain past its deadline
//! is granted a permit beyond the budget (the VM must go in time), counted
//! like any other, and named.
//!
//! Where the permits are: a permit of a workload whose budget is bounded is
//! a [`MovePermit`](crate::api::MovePermit) object beside the workload,
//! taken by creating it (the API server grants a name to one creator only)
//! and ended by deleting it, so every berth process (two releases, one per
//! tenant, a new leader) reads back and counts the same permits before each
//! ask. A parked ask (its drain's pass is over and it waits for a permit)
//! is a [`MoveAsk`](crate::api::MoveAsk) beside the workload, so that a
//! process grants its own ask only when no better ordered ask of any
//! process waits in line. The moves of workloads without a bound and the
//! cap on moves in flight stay in the process. The moves every
//! Machine recorded in `status.drain.moves` are read once, before the first
//! drain of a process asks (a move of a workload without a bound, or one
//! that an older release kept in its process only). A permit outlives its
//! drain and its Machine: the engine's keeper ends it once its workload is
//! whole again, or at its healthy deadline ([`permit_expires`]).
//!
//! | module | what it holds |
//! | --- | --- |
//! | this one | the types: [`Workload`], [`Budget`], [`WorkloadTerms`], [`Permit`], [`Ask`], [`Answer`], and the annotations service owners set |
//! | `decide` | the [`Ledger`]: which pod of a workload may begin to move now (pure) |
//! | `budget` | a workload's budget from its annotations, its move group, when its replacements are healthy (pure) |
//! | `records` | a permit as a `MovePermit` and as a Machine's move record say it, and when it expires (pure) |
//! | `workload` | a pod's workload from its owner references, and what a workload object says of its moves (pure) |
//! | `facts` | [`WorkloadFacts`]: what is known of pods' workloads, answered from the controller's caches (`berth plan` answers from its lists) |
//! | `ask` | [`pod_ask`]: a pod turned into its ask (workload, budget, terms, permit owner, bad annotations), one way for the engine, a forced deletion and `berth plan`; [`planned_ask`] for a planned pod, the engine's and `berth plan`'s |
//! | `permits` | the ledger of this process, shared by its drains, and its permits in the API server (`Permits`, `PermitStore`) |
//! | `line` | this process's parked asks in the API server, renewed while they wait, and the other processes' read (`AskStore`) |

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use crate::drain::select::fmt_key;

mod ask;
mod budget;
mod decide;
mod facts;
mod line;
mod permits;
mod records;
mod store;
pub mod workload;

pub use self::ask::{PodAsk, PodToMove, moves_in, planned_ask, pod_ask};
pub use self::budget::{availability_of, budget_of, grouped, healthy, ready_since};
pub use self::decide::{Ledger, Lined};
pub use self::facts::WorkloadFacts;
pub(crate) use self::facts::serves;
pub(crate) use self::line::AskStore;
pub(crate) use self::permits::{Held, PermitStore, Permits, earliest, kind_label, workload_name};
pub(crate) use self::records::ledger_meta;
pub use self::records::{
    held_permit, lined_ask, permit_expires, recorded_moves, workload_of_record,
};

/// The most pods of the workload moving at once, across every Machine: a
/// whole number from 1 (`unbounded` lifts the limit).
pub const MAX_MOVING_ANNOTATION: &str = "berth.dev/max-moving";
/// How long a replacement must have been Ready before its move ends (a
/// duration, e.g. `30s`), as Nomad's `min_healthy_time`.
pub const MIN_HEALTHY_ANNOTATION: &str = "berth.dev/min-healthy-time";
/// How long after its volumes moved a replacement may take to become
/// healthy before the move ends anyway, with a Warning that names it, as
/// Nomad's `healthy_deadline`.
pub const HEALTHY_DEADLINE_ANNOTATION: &str = "berth.dev/healthy-deadline";
/// On a workload object: the name of a group of workloads of its namespace
/// that share one move budget (one application split over several
/// controllers: a StatefulSet per zone, Kafka node pools).
pub const MOVE_GROUP_ANNOTATION: &str = "berth.dev/move-group";
/// The kind of a move group's [`Workload`].
pub const MOVE_GROUP_KIND: &str = "MoveGroup";

/// The object operators think in that a pod belongs to: its controller
/// followed up (a ReplicaSet's Deployment), or the pod itself when it has
/// no controller.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Workload {
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

impl Workload {
    pub fn new(kind: &str, namespace: &str, name: &str) -> Self {
        Self {
            kind: kind.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
    }
}

/// How many of a workload's pods may move at once, and when a move of one
/// ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    /// `None`: unbounded (PodDisruptionBudgets alone govern).
    pub max_moving: Option<u32>,
    /// How long the replacement must have been Ready.
    pub min_healthy: Duration,
    /// How long the replacement may take to become healthy once its
    /// volumes moved; `None`: the reattach timeout bounds it.
    pub healthy_deadline: Option<Duration>,
}

impl Budget {
    /// The default: one move at a time for a workload whose pods have
    /// volumes that move, unbounded for one without.
    pub fn default_for(moves_volumes: bool) -> Self {
        Self {
            max_moving: moves_volumes.then_some(1),
            min_healthy: Duration::ZERO,
            healthy_deadline: None,
        }
    }
}

/// An annotation berth cannot read: the default holds, and a Warning says
/// so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadAnnotation {
    pub key: &'static str,
    pub value: String,
    pub why: String,
}

impl fmt::Display for BadAnnotation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={:?}: {}", self.key, self.value, self.why)
    }
}

/// What a workload object says of its moves: its own annotations (which
/// win over its pod template's), its `minReadySeconds` (a replacement
/// is available, and so healthy, only once Ready that long), how many
/// of its replicas its owner counts unavailable now, whatever took them
/// down, and how many its owner lets its rolling update take down.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkloadTerms {
    pub annotations: BTreeMap<String, String>,
    pub min_ready: Duration,
    /// The replicas it wants and those of them not available, as its
    /// owner's status says (`spec.replicas` less `status.availableReplicas`);
    /// `None` when its owner does not say (no status yet, or a kind berth
    /// does not read).
    pub availability: Option<Availability>,
    /// How many of its replicas its owner lets its own rolling update take
    /// down at once (a StatefulSet's `rollingUpdate.maxUnavailable`, as
    /// its controller reckons it); `None` when not set. Above 1, its
    /// default move budget (see [`budget_of`]).
    pub max_unavailable: Option<u32>,
}

/// How many replicas a workload wants, and how many of them are not
/// available now, by its owner's status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Availability {
    pub replicas: u32,
    pub unavailable: u32,
}

/// A move the ledger counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permit {
    /// The pod's `namespace/name`.
    pub pod: String,
    pub uid: String,
    /// The Machine whose drain moves it, `namespace/name`.
    pub machine: String,
    /// When the move began.
    pub since: Timestamp,
    /// Granted beyond the budget, to a drain past its deadline.
    pub past_budget: bool,
    /// The pod has volumes that move: the move counts against the cap on
    /// moves in flight (the cloud's attach API). A pod without volumes
    /// holds a permit only when its workload bounds its moves.
    pub volumes: bool,
    /// The attachable PVs that move with it: once its drain no longer
    /// watches the move, it is over only when each is attached where a pod
    /// that replaced this one runs.
    pub attach: Vec<String>,
    /// The Node found for its replacement before the eviction, whose
    /// attach slots the move holds until the replacement is placed (see
    /// [`crate::placement`]).
    pub destination: Option<String>,
}

impl Permit {
    /// The destination the move holds, as the placement check counts it.
    pub fn holding(&self) -> Option<crate::placement::Holding> {
        Some(crate::placement::Holding {
            pod: self.pod.clone(),
            uid: self.uid.clone(),
            node: self.destination.clone()?,
            pvs: self.attach.clone(),
        })
    }
}

/// The pods of `moving`, with their Machines, in words.
pub fn moving_names(moving: &[Permit]) -> String {
    moving
        .iter()
        .map(|m| format!("{} (from Machine {})", m.pod, m.machine))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The drain that asks: its Machine (`namespace/name`), when its deletion
/// was requested, whether it is past its deadline, and how many volume
/// moves it has left (see [`Ask::moves_left`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asker {
    pub machine: String,
    pub requested: Timestamp,
    pub past_deadline: bool,
    pub moves_left: u32,
}

/// A drain's ask for a permit to move one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub workload: Workload,
    /// The pod's `namespace/name`.
    pub pod: String,
    pub uid: String,
    /// The Machine whose drain asks, `namespace/name`.
    pub machine: String,
    /// The pod's priority (`spec.priority`).
    pub priority: i32,
    /// When the Machine's deletion was requested.
    pub requested: Timestamp,
    /// The drain is past its deadline: the VM must go in time.
    pub past_deadline: bool,
    /// The volume moves its drain has left, this one included, when it
    /// asked (0: not counted).
    pub moves_left: u32,
    /// The pod has volumes that move (see [`Permit::volumes`]).
    pub volumes: bool,
    /// The workload's replicas not available now, whatever took them down
    /// (its owner's status): each of berth's moves in flight takes at most
    /// one down, so at least this many less the moves in flight are down
    /// for another reason, and count against the budget as moves do. 0
    /// for a pod that is not Ready itself (see [`Ask::new`]).
    pub unavailable: u32,
    /// The pod is down itself (not Ready, or on a Node that does not
    /// serve): moving it takes nothing more down. Such an ask is never
    /// behind asks of pods that serve (see `Ledger::ask`): those may be
    /// waiting for their workload to be whole, which this move is what
    /// makes it.
    pub down: bool,
    /// Its attachable PVs (see [`Permit::attach`]).
    pub attach: Vec<String>,
    /// The Node found for its replacement (see [`Permit::destination`]).
    pub destination: Option<String>,
}

impl Ask {
    /// The ask of `drain` to move `pod` (a planned pod, or a pod as its
    /// asker knows it; `ready`: the pod is Ready now) of `workload`, whose
    /// object says `terms`. Every asker asks alike, through [`pod_ask`].
    pub fn new<'p>(
        workload: Workload,
        terms: &WorkloadTerms,
        pod: impl Into<PodToMove<'p>>,
        ready: bool,
        drain: &Asker,
    ) -> Self {
        let pod = pod.into();
        let key = fmt_key(&pod.key);
        let unavailable = terms.availability.map_or(0, |a| a.unavailable);
        Self {
            workload,
            uid: pod.uid.unwrap_or_else(|| key.clone()),
            pod: key,
            machine: drain.machine.clone(),
            priority: pod.priority,
            requested: drain.requested,
            past_deadline: drain.past_deadline,
            moves_left: drain.moves_left,
            volumes: pod.volumes,
            attach: pod.attach,
            destination: None,
            // A pod already down takes nothing more down when it moves:
            // the workload's other replicas down are not held against it,
            // only berth's moves in flight are.
            unavailable: if ready { unavailable } else { 0 },
            down: !ready,
        }
    }

    /// The order of asks for one workload: higher priority first, then the
    /// Machine whose deletion was requested first, then the drain with
    /// more volume moves left (of Machines deleted together, the one the
    /// rollout will wait for the longest: longest first keeps every
    /// workload moving and ends soonest), then names.
    fn order(&self) -> (Reverse<i32>, Timestamp, Reverse<u32>, &str, &str) {
        (
            Reverse(self.priority),
            self.requested,
            Reverse(self.moves_left),
            &self.machine,
            &self.pod,
        )
    }
}

/// The ledger's answer to an ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The pod may move (or already does: the same permit).
    Granted(Permit),
    /// The drain is past its deadline and the budget is spent: the pod may
    /// move, counted beyond the budget; `moving` are the moves it joins.
    Bypassed { permit: Permit, moving: Vec<Permit> },
    /// Not now: `moving` hold the workload's budget, and `ahead` (pods, by
    /// `namespace/name`) come first when a permit frees. `degraded`: the
    /// workload's replicas down for other reasons than berth's moves
    /// (its unavailable replicas less its moves in flight), which hold the
    /// budget too. The ask is kept until it is granted or withdrawn.
    Wait {
        moving: Vec<Permit>,
        ahead: Vec<String>,
        degraded: u32,
    },
    /// Not now: the workload's budget has room, but `in_flight` moves of
    /// every workload fill the controller's cap. The ask is kept, as for
    /// [`Answer::Wait`].
    Capped { in_flight: usize, cap: usize },
    /// Not now: the permit was granted here but its `MovePermit` could not
    /// be taken in the API server: another berth process took that slot
    /// at the same moment (`error` is `None`), or the write failed. Said
    /// by the process's permit store, never by [`Ledger::ask`]; the pod
    /// asks again when permits change.
    Contended { error: Option<String> },
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::drain::plan::PlannedPod;

    // The helpers are shared with the tests of the ledger's other modules.

    pub(super) fn db() -> Workload {
        Workload::new("StatefulSet", "ns", "db")
    }

    pub(super) fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).expect("time")
    }

    pub(super) fn ask(pod: &str, machine: &str, requested: i64) -> Ask {
        Ask {
            workload: db(),
            pod: format!("ns/{pod}"),
            uid: format!("uid-{pod}"),
            machine: format!("ns/{machine}"),
            priority: 0,
            requested: t(requested),
            past_deadline: false,
            moves_left: 1,
            volumes: true,
            unavailable: 0,
            down: false,
            attach: vec![],
            destination: None,
        }
    }

    pub(super) fn granted(a: &Answer) -> bool {
        matches!(a, Answer::Granted(_))
    }

    #[test]
    fn an_ask_discounts_the_pods_own_unavailability() {
        let terms = WorkloadTerms {
            availability: Some(Availability {
                replicas: 3,
                unavailable: 1,
            }),
            ..WorkloadTerms::default()
        };
        let pod = PlannedPod {
            uid: Some("uid-db-2".into()),
            controller: Some("StatefulSet/db".into()),
            rule_terms: None,
            ..crate::drain::fixtures::planned(7, "ns", "db-2")
        };
        let drain = Asker {
            machine: "ns/a".into(),
            requested: t(5),
            past_deadline: false,
            moves_left: 1,
        };
        let ready = Ask::new(db(), &terms, &pod, true, &drain);
        assert_eq!(
            (
                ready.pod.as_str(),
                ready.uid.as_str(),
                ready.priority,
                ready.unavailable
            ),
            ("ns/db-2", "uid-db-2", 7, 1)
        );
        assert_eq!(ready.machine, "ns/a");
        assert!(!ready.volumes);
        // db-2 is a replica that is down: moving it takes nothing more
        // down, however many others are (a workload none of whose pods
        // turns Ready still moves, one at a time).
        let all_down = WorkloadTerms {
            availability: Some(Availability {
                replicas: 3,
                unavailable: 3,
            }),
            ..WorkloadTerms::default()
        };
        let down = Ask::new(db(), &all_down, &pod, false, &drain);
        assert_eq!(down.unavailable, 0);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&down, &Budget::default_for(true), t(6))));
    }
}
