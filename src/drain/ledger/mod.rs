//! The move ledger's decisions: which pod of a workload may begin to move,
//! across every drain of the cluster.
//!
//! A drain protects a workload inside its own Node; the ledger protects it
//! across all of them, as Nomad's drainer keeps each job's migrations
//! within `max_parallel` across every draining node. Every eviction or
//! forced deletion asks for a permit for the pod's [`Workload`]; a permit
//! is held for the whole move (evicted, gone, volumes detached, attached
//! where the replacement runs, the replacement healthy) and counts against
//! the workload's [`Budget`]. Asks of one workload that cannot all go are
//! answered in one order: higher pod priority first, then the Machine whose
//! deletion was requested first, then the Machine's and the pod's names. A
//! drain past its deadline is granted a permit beyond the budget (the VM
//! must go in time), counted like any other, and named.
//!
//! Everything here is pure: the engine keeps one [`Ledger`] per controller
//! process, asks it, and wakes the drains that wait when a move ends. After
//! a restart or a change of leader the ledger is
//! [rebuilt](Ledger::rebuild) from the moves every Machine recorded in
//! `status.drain.moves` before any drain acts.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::api::{Machine, MovePermit, VolumeMove};
use crate::drain::plan::PlannedPod;
use crate::drain::select::fmt_key;

mod permits;
pub mod workload;

pub(crate) use self::permits::{Held, PermitStore, Permits, kind_label, workload_name};

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
/// is available, and so healthy, only once Ready that long), and how many
/// of its replicas its owner counts unavailable now, whatever took them
/// down.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkloadTerms {
    pub annotations: BTreeMap<String, String>,
    pub min_ready: Duration,
    /// The replicas it wants and those of them not available, as its
    /// owner's status says (`spec.replicas` less `status.availableReplicas`);
    /// `None` when its owner does not say (no status yet, or a kind berth
    /// does not read).
    pub availability: Option<Availability>,
}

/// How many replicas a workload wants, and how many of them are not
/// available now, by its owner's status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Availability {
    pub replicas: u32,
    pub unavailable: u32,
}

/// The budget a workload asks for, over the default: each of its
/// annotations on the workload object, else on its pod template; the
/// minimum healthy time at least the workload's `minReadySeconds`. What
/// could not be read is returned, and its default holds.
pub fn budget_of(
    template: Option<&BTreeMap<String, String>>,
    workload: &WorkloadTerms,
    moves_volumes: bool,
) -> (Budget, Vec<BadAnnotation>) {
    let mut budget = Budget::default_for(moves_volumes);
    let mut bad = Vec::new();
    let get = |key: &str| {
        workload
            .annotations
            .get(key)
            .or_else(|| template.and_then(|a| a.get(key)))
    };
    let mut refuse = |key: &'static str, value: &str, why: String| {
        bad.push(BadAnnotation {
            key,
            value: value.to_string(),
            why,
        });
    };
    if let Some(v) = get(MAX_MOVING_ANNOTATION) {
        match v.trim() {
            "unbounded" => budget.max_moving = None,
            n => match n.parse::<u32>() {
                Ok(n) if n >= 1 => budget.max_moving = Some(n),
                _ => refuse(
                    MAX_MOVING_ANNOTATION,
                    v,
                    "not a whole number from 1, nor \"unbounded\"".into(),
                ),
            },
        }
    }
    if let Some(v) = get(MIN_HEALTHY_ANNOTATION) {
        match humantime::parse_duration(v.trim()) {
            Ok(d) => budget.min_healthy = d,
            Err(e) => refuse(MIN_HEALTHY_ANNOTATION, v, format!("not a duration: {e}")),
        }
    }
    if let Some(v) = get(HEALTHY_DEADLINE_ANNOTATION) {
        match humantime::parse_duration(v.trim()) {
            Ok(d) if !d.is_zero() => budget.healthy_deadline = Some(d),
            Ok(_) => refuse(HEALTHY_DEADLINE_ANNOTATION, v, "zero".into()),
            Err(e) => refuse(
                HEALTHY_DEADLINE_ANNOTATION,
                v,
                format!("not a duration: {e}"),
            ),
        }
    }
    budget.min_healthy = budget.min_healthy.max(workload.min_ready);
    (budget, bad)
}

/// The workload whose budget a move of `member`'s pod counts against, and
/// what it says: `member` itself, or the move group its object names
/// ([`MOVE_GROUP_ANNOTATION`], in its namespace), whose availability is
/// that of every member together (`members`: the terms of every workload
/// object of the namespace that names the group) and whose other terms are
/// `member`'s own. A group name that cannot name an object is named back
/// (the member then stands alone).
pub fn grouped(
    member: Workload,
    terms: WorkloadTerms,
    members: impl FnOnce(&str) -> Vec<WorkloadTerms>,
) -> (Workload, WorkloadTerms, Option<BadAnnotation>) {
    let Some(group) = terms
        .annotations
        .get(MOVE_GROUP_ANNOTATION)
        .map(|g| g.trim())
    else {
        return (member, terms, None);
    };
    let valid = !group.is_empty()
        && group.len() <= 63
        && group
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !group.starts_with('-')
        && !group.ends_with('-');
    if !valid {
        let bad = BadAnnotation {
            key: MOVE_GROUP_ANNOTATION,
            value: group.to_string(),
            why: "not a name of lower-case letters, digits and '-' of at most 63".into(),
        };
        return (member, terms, Some(bad));
    }
    let workload = Workload::new(MOVE_GROUP_KIND, &member.namespace, group);
    (
        workload,
        WorkloadTerms {
            availability: availability_of(&members(group)),
            ..terms
        },
        None,
    )
}

/// The availability of several workloads together: their replicas and
/// those unavailable, summed; `None` when none of them says.
pub fn availability_of(members: &[WorkloadTerms]) -> Option<Availability> {
    let mut sum: Option<Availability> = None;
    for a in members.iter().filter_map(|t| t.availability) {
        let s = sum.get_or_insert_default();
        s.replicas += a.replicas;
        s.unavailable += a.unavailable;
    }
    sum
}

/// Since when `pod` has been Ready (its Ready condition's last
/// transition), if it is.
pub fn ready_since(pod: &Pod) -> Option<Timestamp> {
    let c = pod
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")?;
    if c.status != "True" {
        return None;
    }
    Some(
        c.last_transition_time
            .as_ref()
            .map_or(Timestamp::UNIX_EPOCH, |t| t.0),
    )
}

/// Whether replacements Ready since `ready` (`None`: not Ready) are
/// healthy at `now` for a move to end: each Ready for `min_healthy`.
/// `Err(Some(t))`: not yet, all will be at `t` if they stay Ready;
/// `Err(None)`: one is not Ready.
pub fn healthy(
    ready: &[Option<Timestamp>],
    min_healthy: Duration,
    now: Timestamp,
) -> Result<(), Option<Timestamp>> {
    let min = SignedDuration::try_from(min_healthy).unwrap_or(SignedDuration::MAX);
    let mut latest = None;
    for since in ready {
        let Some(since) = since else {
            return Err(None);
        };
        let at = since.checked_add(min).unwrap_or(Timestamp::MAX);
        latest = latest.max(Some(at));
    }
    match latest {
        Some(at) if at > now => Err(Some(at)),
        _ => Ok(()),
    }
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
}

/// The drain that asks: its Machine (`namespace/name`), when its deletion
/// was requested, and whether it is past its deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asker {
    pub machine: String,
    pub requested: Timestamp,
    pub past_deadline: bool,
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
    /// The pod has volumes that move (see [`Permit::volumes`]).
    pub volumes: bool,
    /// The workload's replicas not available now, whatever took them down
    /// (its owner's status): each of berth's moves in flight takes at most
    /// one down, so at least this many less the moves in flight are down
    /// for another reason, and count against the budget as moves do. 0
    /// for a pod that is not Ready itself (see [`Ask::new`]).
    pub unavailable: u32,
    /// Its attachable PVs (see [`Permit::attach`]).
    pub attach: Vec<String>,
}

impl Ask {
    /// The ask of `drain` to move `pod` (`ready`: the pod is Ready now)
    /// of `workload`, whose object says `terms`. The engine and `berth
    /// plan` ask alike.
    pub fn new(
        workload: Workload,
        terms: &WorkloadTerms,
        pod: &PlannedPod,
        ready: bool,
        drain: &Asker,
    ) -> Self {
        let key = fmt_key(&pod.pod);
        let unavailable = terms.availability.map_or(0, |a| a.unavailable);
        Self {
            workload,
            uid: pod.uid.clone().unwrap_or_else(|| key.clone()),
            pod: key,
            machine: drain.machine.clone(),
            priority: pod.priority,
            requested: drain.requested,
            past_deadline: drain.past_deadline,
            volumes: !pod.volumes.is_empty(),
            attach: pod
                .volumes
                .iter()
                .filter(|v| v.class == crate::drain::class::VolumeClass::Attachable)
                .map(|v| v.volume.pv.clone())
                .collect(),
            // A pod already down takes nothing more down when it moves:
            // the workload's other replicas down are not held against it,
            // only berth's moves in flight are.
            unavailable: if ready { unavailable } else { 0 },
        }
    }

    /// The order of asks for one workload: higher priority first, then the
    /// Machine whose deletion was requested first, then names.
    fn order(&self) -> (Reverse<i32>, Timestamp, &str, &str) {
        (
            Reverse(self.priority),
            self.requested,
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

/// An ask that waits, since when, and whether its drain is parked on it:
/// done with its pass and waiting for a permit to free (see
/// [`Ledger::keep_waiting`]). Only a parked ask holds its place in line: a
/// drain busy elsewhere (a PodDisruptionBudget, a long chain of moves)
/// would keep a freed permit idle until its pass ends.
#[derive(Debug, Clone)]
struct Waiting {
    ask: Ask,
    since: Timestamp,
    parked: bool,
}

/// Every move in flight and every ask waiting, by workload.
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    /// By workload, then by pod UID: the moves this process granted or
    /// rebuilt.
    moving: BTreeMap<Workload, BTreeMap<String, Permit>>,
    /// By workload, then by pod UID: the permits the API server holds, of
    /// every process, as last [set](Ledger::set_held). A move in both is
    /// counted once.
    held: BTreeMap<Workload, BTreeMap<String, Permit>>,
    /// By workload, then by pod UID.
    waiting: BTreeMap<Workload, BTreeMap<String, Waiting>>,
    /// The most moves in flight at once, of every workload together
    /// (`None`: no cap).
    cap: Option<usize>,
}

impl Ledger {
    /// A ledger whose moves in flight, of every workload together, are at
    /// most `cap` (`None`: no cap), but past a drain's deadline.
    pub fn with_cap(mut self, cap: Option<usize>) -> Self {
        self.cap = cap;
        self
    }

    /// The ledger of the moves recorded in the Machines' status (each with
    /// its workload), as a new leader finds them.
    pub fn rebuild(records: impl IntoIterator<Item = (Workload, Permit)>) -> Self {
        let mut ledger = Self::default();
        for (workload, permit) in records {
            ledger
                .moving
                .entry(workload)
                .or_default()
                .insert(permit.uid.clone(), permit);
        }
        ledger
    }

    /// Answers `ask` under `budget`, at `now`. A pod that already holds a
    /// permit gets it again; otherwise it is granted when a permit of the
    /// budget is free, no ask better ordered waits for it, and the cap on
    /// moves in flight has room.
    pub fn ask(&mut self, ask: &Ask, budget: &Budget, now: Timestamp) -> Answer {
        let mine = self.moving.get(&ask.workload).and_then(|m| m.get(&ask.uid));
        let held = self.held.get(&ask.workload).and_then(|m| m.get(&ask.uid));
        if let Some(p) = mine.or(held) {
            return Answer::Granted(p.clone());
        }
        let moving = self.moving_of(&ask.workload);
        // Replicas down whatever took them down: berth's moves, or more
        // when its owner counts more unavailable.
        let down = moving.len().max(ask.unavailable as usize);
        let degraded = u32::try_from(down - moving.len()).unwrap_or(u32::MAX);
        let free = budget
            .max_moving
            .map_or(usize::MAX, |n| (n as usize).saturating_sub(down));
        let ahead: Vec<&Ask> = self
            .waiting
            .get(&ask.workload)
            .into_iter()
            .flat_map(|w| w.values())
            .filter(|w| w.parked)
            .map(|w| &w.ask)
            .filter(|w| w.uid != ask.uid && w.order() < ask.order())
            .collect();
        let in_flight = self.in_flight();
        let capped = self.cap.filter(|cap| ask.volumes && in_flight >= *cap);
        let grant = |past_budget: bool| Permit {
            pod: ask.pod.clone(),
            uid: ask.uid.clone(),
            machine: ask.machine.clone(),
            since: now,
            past_budget,
            volumes: ask.volumes,
            attach: ask.attach.clone(),
        };
        let within_budget = ahead.len() < free;
        let answer = if within_budget && capped.is_none() {
            Answer::Granted(grant(false))
        } else if ask.past_deadline {
            Answer::Bypassed {
                permit: grant(!within_budget),
                moving,
            }
        } else {
            let mut ahead: Vec<&Ask> = ahead;
            ahead.sort_by(|a, b| a.order().cmp(&b.order()));
            let ahead = ahead.iter().map(|a| a.pod.clone()).collect();
            let line = self.waiting.entry(ask.workload.clone()).or_default();
            let since = line.get(&ask.uid).map_or(now, |w| w.since);
            line.insert(
                ask.uid.clone(),
                Waiting {
                    ask: ask.clone(),
                    since,
                    // Its drain goes on with its pass; it parks at the end.
                    parked: false,
                },
            );
            return match capped {
                Some(cap) if within_budget => Answer::Capped { in_flight, cap },
                _ => Answer::Wait {
                    moving,
                    ahead,
                    degraded,
                },
            };
        };
        let permit = match &answer {
            Answer::Granted(p) | Answer::Bypassed { permit: p, .. } => p.clone(),
            Answer::Wait { .. } | Answer::Capped { .. } | Answer::Contended { .. } => {
                unreachable!("returned above")
            }
        };
        self.withdraw(&ask.workload, &ask.uid);
        self.moving
            .entry(ask.workload.clone())
            .or_default()
            .insert(ask.uid.clone(), permit);
        answer
    }

    /// Since when the pod `uid` has waited for a permit, if it waits.
    pub fn waiting_since(&self, workload: &Workload, uid: &str) -> Option<Timestamp> {
        self.waiting.get(workload)?.get(uid).map(|w| w.since)
    }

    /// The pod `uid` no longer asks (its drain stopped, or it went another
    /// way).
    pub fn withdraw(&mut self, workload: &Workload, uid: &str) {
        if let Some(w) = self.waiting.get_mut(workload) {
            w.remove(uid);
            if w.is_empty() {
                self.waiting.remove(workload);
            }
        }
    }

    /// The move of pod `uid` ended; true when it was counted.
    pub fn end(&mut self, workload: &Workload, uid: &str) -> bool {
        let Some(m) = self.moving.get_mut(workload) else {
            return false;
        };
        let ended = m.remove(uid).is_some();
        if m.is_empty() {
            self.moving.remove(workload);
        }
        ended
    }

    /// Keeps of `machine`'s waiting asks only those of the pods `uids`:
    /// those its drain asked for again in its last pass (a pod gone, or
    /// moved another way, no longer holds the line), and parks them: its
    /// pass is over and it waits for a permit to free, so they hold their
    /// place in line until it asks again. How many were withdrawn.
    pub fn keep_waiting(&mut self, machine: &str, uids: &[String]) -> usize {
        let mut withdrawn = 0;
        self.waiting.retain(|_, w| {
            let before = w.len();
            w.retain(|uid, a| a.ask.machine != machine || uids.contains(uid));
            for (_, a) in w.iter_mut().filter(|(_, a)| a.ask.machine == machine) {
                a.parked = true;
            }
            withdrawn += before - w.len();
            !w.is_empty()
        });
        withdrawn
    }

    /// Ends the moves of `machine` but those of the pods `keep` (by UID):
    /// what its drain no longer records (a drain that ended, or stopped
    /// between a grant and its record), and withdraws its waiting asks. How
    /// many moves ended.
    pub fn release_machine(&mut self, machine: &str, keep: &[String]) -> usize {
        self.keep_waiting(machine, &[]);
        let mut ended = 0;
        self.moving.retain(|_, m| {
            let before = m.len();
            m.retain(|uid, p| p.machine != machine || keep.contains(uid));
            ended += before - m.len();
            !m.is_empty()
        });
        ended
    }

    /// The permits the API server holds now (of every process), each with
    /// its workload: they count as moves in flight until the next call.
    pub fn set_held(&mut self, held: impl IntoIterator<Item = (Workload, Permit)>) {
        self.held.clear();
        for (w, p) in held {
            self.held.entry(w).or_default().insert(p.uid.clone(), p);
        }
    }

    /// Every move in flight, this process's and those the API server
    /// holds, once each, by workload then pod UID.
    fn all_moving(&self) -> BTreeMap<&Workload, BTreeMap<&str, &Permit>> {
        let mut all: BTreeMap<&Workload, BTreeMap<&str, &Permit>> = BTreeMap::new();
        for (w, m) in self.held.iter().chain(&self.moving) {
            let of = all.entry(w).or_default();
            for (uid, p) in m {
                of.insert(uid.as_str(), p);
            }
        }
        all
    }

    /// The moves of `workload` in flight, oldest first.
    pub fn moving_of(&self, workload: &Workload) -> Vec<Permit> {
        let of = |m: Option<&BTreeMap<String, Permit>>| -> Vec<Permit> {
            m.into_iter().flat_map(|m| m.values().cloned()).collect()
        };
        let mut moving = of(self.held.get(workload));
        for p in of(self.moving.get(workload)) {
            if !moving.iter().any(|h| h.uid == p.uid) {
                moving.push(p);
            }
        }
        moving.sort_by(|a, b| (a.since, &a.pod).cmp(&(b.since, &b.pod)));
        moving
    }

    /// Every move in flight, by workload.
    pub fn moves(&self) -> Vec<(Workload, Permit)> {
        self.all_moving()
            .into_iter()
            .flat_map(|(w, m)| m.into_values().map(move |p| (w.clone(), p.clone())))
            .collect()
    }

    /// How many asks wait, for the metrics.
    pub fn waiting(&self) -> usize {
        self.waiting.values().map(BTreeMap::len).sum()
    }

    /// How many moves of volumes are in flight, of every workload.
    pub fn in_flight(&self) -> usize {
        self.all_moving()
            .values()
            .flat_map(BTreeMap::values)
            .filter(|p| p.volumes)
            .count()
    }

    /// The Machines that hold a permit or wait for one.
    pub fn machines(&self) -> BTreeSet<String> {
        let all = self.all_moving();
        let moving = all.values().flat_map(|m| m.values().map(|p| &p.machine));
        let waiting = self
            .waiting
            .values()
            .flat_map(|w| w.values().map(|w| &w.ask.machine));
        moving.chain(waiting).cloned().collect()
    }
}

/// The moves every Machine records in `status.drain.moves`, each with its
/// workload and as the permit it holds: what a ledger is
/// [rebuilt](Ledger::rebuild) from.
pub fn recorded_moves<'m>(
    machines: impl IntoIterator<Item = &'m Machine>,
) -> Vec<(Workload, Permit)> {
    machines
        .into_iter()
        .flat_map(|m| {
            let machine = format!(
                "{}/{}",
                m.metadata.namespace.as_deref().unwrap_or_default(),
                m.metadata.name.as_deref().unwrap_or_default()
            );
            let moves = m
                .status
                .as_ref()
                .and_then(|s| s.drain.as_ref())
                .map(|d| d.moves.clone())
                .unwrap_or_default();
            moves
                .into_iter()
                .filter_map(move |mv| recorded(&machine, &mv))
        })
        .collect()
}

/// The workload and permit of a move `machine` recorded.
fn recorded(machine: &str, mv: &VolumeMove) -> Option<(Workload, Permit)> {
    let (ns, _) = mv.pod.split_once('/')?;
    let workload = workload_of_record(ns, mv)?;
    Some((
        workload,
        Permit {
            pod: mv.pod.clone(),
            uid: mv.uid.clone().unwrap_or_else(|| mv.pod.clone()),
            machine: machine.to_string(),
            since: mv.since.as_ref().map_or_else(Timestamp::now, |t| t.0),
            past_budget: false,
            volumes: true,
            // Its drain watches the move to its end.
            attach: Vec::new(),
        },
    ))
}

/// What a `MovePermit` in the API server says, as the ledger counts it:
/// its workload and the permit; `None` for one that does not name its
/// workload as `Kind/name`.
pub fn held_permit(o: &MovePermit) -> Option<(Workload, Permit)> {
    let ns = o.metadata.namespace.as_deref().unwrap_or_default();
    let (kind, name) = o.spec.workload.split_once('/')?;
    Some((
        Workload::new(kind, ns, name),
        Permit {
            pod: format!("{ns}/{}", o.spec.pod),
            uid: o.spec.pod_uid.clone(),
            machine: o.spec.machine.clone(),
            since: o.spec.since.0,
            past_budget: o.spec.past_budget,
            volumes: o.spec.volumes,
            attach: o.spec.attach.clone(),
        },
    ))
}

/// When a permit granted at `since` expires once its drain no longer
/// watches its move: the workload's healthy deadline after `since` if it
/// has one, else the deadline of the drain that began the move, and never
/// sooner than `reattach` after `since` (a drain past its deadline bypasses
/// the budget, but its move still holds its permit while its replacement
/// comes up).
pub fn permit_expires(
    since: Timestamp,
    healthy_deadline: Option<Duration>,
    drain_deadline: Timestamp,
    reattach: Duration,
) -> Timestamp {
    let after = |d: Duration| {
        SignedDuration::try_from(d)
            .ok()
            .and_then(|d| since.checked_add(d).ok())
            .unwrap_or(Timestamp::MAX)
    };
    match healthy_deadline {
        Some(d) => after(d),
        None => drain_deadline.max(after(reattach)),
    }
}

/// The workload a move record names (`Kind/name`, in the pod's
/// namespace): its `workload`, else its controller, else the pod itself.
pub fn workload_of_record(ns: &str, mv: &VolumeMove) -> Option<Workload> {
    let named = mv.workload.as_deref().or(mv.controller.as_deref());
    match named.and_then(|w| w.split_once('/')) {
        Some((kind, name)) => Some(Workload::new(kind, ns, name)),
        None => {
            let (_, pod) = mv.pod.split_once('/')?;
            Some(Workload::new("Pod", ns, pod))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db() -> Workload {
        Workload::new("StatefulSet", "ns", "db")
    }

    #[test]
    fn a_permit_expires_at_its_healthy_deadline_else_its_drains_deadline() {
        let reattach = Duration::from_secs(90);
        // The workload's healthy deadline, from the move's start.
        assert_eq!(
            permit_expires(t(0), Some(Duration::from_secs(600)), t(7200), reattach),
            t(600)
        );
        // Else the drain's deadline...
        assert_eq!(permit_expires(t(0), None, t(7200), reattach), t(7200));
        // ...but a move begun past it still has the reattach timeout.
        assert_eq!(permit_expires(t(7300), None, t(7200), reattach), t(7390));
    }

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).expect("time")
    }

    fn ask(pod: &str, machine: &str, requested: i64) -> Ask {
        Ask {
            workload: db(),
            pod: format!("ns/{pod}"),
            uid: format!("uid-{pod}"),
            machine: format!("ns/{machine}"),
            priority: 0,
            requested: t(requested),
            past_deadline: false,
            volumes: true,
            unavailable: 0,
            attach: vec![],
        }
    }

    fn granted(a: &Answer) -> bool {
        matches!(a, Answer::Granted(_))
    }

    #[test]
    fn one_replica_of_a_workload_moves_at_a_time_across_machines() {
        let mut l = Ledger::default();
        let one = Budget::default_for(true);
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let b = l.ask(&ask("db-1", "b", 0), &one, t(2));
        let Answer::Wait { moving, ahead, .. } = b else {
            panic!("db-1 must wait: {b:?}")
        };
        assert_eq!(moving.len(), 1);
        assert_eq!(moving[0].pod, "ns/db-0");
        assert_eq!(moving[0].machine, "ns/a");
        assert!(ahead.is_empty());
        // Asked again (a retried pass): still the one permit, still waiting.
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(3))));
        assert!(!granted(&l.ask(&ask("db-1", "b", 0), &one, t(3))));
        assert!(l.end(&db(), "uid-db-0"));
        assert!(granted(&l.ask(&ask("db-1", "b", 0), &one, t(4))));
        assert_eq!(l.waiting(), 0);
    }

    #[test]
    fn a_replica_down_for_another_reason_holds_the_budget_as_a_move_does() {
        let mut l = Ledger::default();
        let one = Budget::default_for(true);
        let two = Budget {
            max_moving: Some(2),
            ..Budget::default_for(true)
        };
        // db-2 crash-loops (its owner counts one unavailable): with one
        // move at a time, nothing else of db moves while it is down.
        let degraded = Ask {
            unavailable: 1,
            ..ask("db-0", "a", 0)
        };
        let Answer::Wait {
            moving, degraded, ..
        } = l.ask(&degraded, &one, t(1))
        else {
            panic!("a degraded workload waits")
        };
        assert!(moving.is_empty());
        assert_eq!(degraded, 1);
        // With a budget of two, one more may go down.
        let mut l = Ledger::default();
        let first = Ask {
            unavailable: 1,
            ..ask("db-0", "a", 0)
        };
        assert!(granted(&l.ask(&first, &two, t(1))));
        // Right after: db-0 evicted, its owner now counts two down (db-0
        // and db-2), of which one is berth's move.
        let second = Ask {
            unavailable: 2,
            ..ask("db-1", "b", 0)
        };
        let Answer::Wait {
            moving, degraded, ..
        } = l.ask(&second, &two, t(2))
        else {
            panic!("two down of a budget of two")
        };
        assert_eq!((moving.len(), degraded), (1, 1));
        // An owner whose status lags (still none down) does not hide the
        // move in flight.
        let lagging = Ask {
            unavailable: 0,
            ..ask("db-1", "b", 0)
        };
        assert!(granted(&l.ask(&lagging, &two, t(3))));
        // Past its deadline a drain goes beyond, as for moves.
        let mut l = Ledger::default();
        let late = Ask {
            unavailable: 1,
            past_deadline: true,
            ..ask("db-0", "a", 0)
        };
        assert!(matches!(l.ask(&late, &one, t(1)), Answer::Bypassed { .. }));
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
            ..crate::drain::fixtures::planned(7, "ns", "db-2")
        };
        let drain = Asker {
            machine: "ns/a".into(),
            requested: t(5),
            past_deadline: false,
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

    #[test]
    fn a_move_group_shares_one_budget_and_counts_every_members_replicas() {
        let with = |pairs: &[(&str, &str)], replicas: u32, unavailable: u32| WorkloadTerms {
            annotations: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            min_ready: Duration::from_secs(5),
            availability: Some(Availability {
                replicas,
                unavailable,
            }),
        };
        let es_a = Workload::new("StatefulSet", "search", "es-a");
        let member = with(&[(MOVE_GROUP_ANNOTATION, "es")], 3, 0);
        let others = vec![member.clone(), with(&[(MOVE_GROUP_ANNOTATION, "es")], 3, 1)];
        let (w, terms, bad) = grouped(es_a.clone(), member.clone(), |g| {
            assert_eq!(g, "es");
            others.clone()
        });
        assert_eq!(w, Workload::new(MOVE_GROUP_KIND, "search", "es"));
        assert!(bad.is_none());
        assert_eq!(
            terms.availability,
            Some(Availability {
                replicas: 6,
                unavailable: 1
            }),
            "every member's replicas"
        );
        assert_eq!(
            terms.min_ready,
            Duration::from_secs(5),
            "the member's own terms"
        );
        // Without a group, the member stands alone.
        let alone = with(&[], 3, 0);
        let (w, terms, bad) = grouped(es_a.clone(), alone.clone(), |_| panic!("no group"));
        assert_eq!((w, terms, bad), (es_a.clone(), alone, None));
        // A name that cannot name an object is named back.
        let odd = with(&[(MOVE_GROUP_ANNOTATION, "Elastic Search")], 3, 0);
        let (w, _, bad) = grouped(es_a.clone(), odd, |_| panic!("not a group"));
        assert_eq!(w, es_a);
        assert_eq!(bad.map(|b| b.key), Some(MOVE_GROUP_ANNOTATION));
        // Two members of one group wait for each other's moves.
        let mut l = Ledger::default();
        let group = Workload::new(MOVE_GROUP_KIND, "search", "es");
        let one = Budget::default_for(true);
        let a = Ask {
            workload: group.clone(),
            ..ask("es-a-0", "a", 0)
        };
        let b = Ask {
            workload: group,
            ..ask("es-b-0", "b", 0)
        };
        assert!(granted(&l.ask(&a, &one, t(1))));
        assert!(!granted(&l.ask(&b, &one, t(1))));
    }

    #[test]
    fn other_workloads_and_workloads_without_volumes_are_not_held() {
        let mut l = Ledger::default();
        let one = Budget::default_for(true);
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let mut other = ask("cache-0", "a", 0);
        other.workload = Workload::new("StatefulSet", "ns", "cache");
        assert!(granted(&l.ask(&other, &one, t(1))));
        let unbounded = Budget::default_for(false);
        let mut web = ask("web-1", "a", 0);
        web.workload = Workload::new("Deployment", "ns", "web");
        for i in 0..5 {
            web.uid = format!("web-{i}");
            assert!(granted(&l.ask(&web, &unbounded, t(1))));
        }
    }

    #[test]
    fn a_budget_of_two_lets_two_go() {
        let mut l = Ledger::default();
        let two = Budget {
            max_moving: Some(2),
            ..Budget::default_for(true)
        };
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &two, t(1))));
        assert!(granted(&l.ask(&ask("db-1", "b", 0), &two, t(1))));
        assert!(!granted(&l.ask(&ask("db-2", "c", 0), &two, t(1))));
    }

    #[test]
    fn a_freed_permit_goes_by_priority_then_deletion_order_then_name() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        // b's Machine was deleted after c's; d's pod has a higher priority.
        let b = ask("db-1", "b", 20);
        let c = ask("db-2", "c", 10);
        let mut d = ask("db-3", "d", 30);
        d.priority = 100;
        for x in [&b, &c, &d] {
            assert!(!granted(&l.ask(x, &one, t(2))));
            // Each drain's pass ends, and it parks on its ask.
            l.keep_waiting(&x.machine, std::slice::from_ref(&x.uid));
        }
        l.end(&db(), "uid-db-0");
        // The first to ask again after the end is not the first in line.
        let Answer::Wait { ahead, .. } = l.ask(&b, &one, t(3)) else {
            panic!("b is behind d and c")
        };
        assert_eq!(ahead, vec!["ns/db-3".to_string(), "ns/db-2".to_string()]);
        assert!(!granted(&l.ask(&c, &one, t(3))), "c is behind d");
        assert!(granted(&l.ask(&d, &one, t(3))));
        l.end(&db(), "uid-db-3");
        assert!(granted(&l.ask(&c, &one, t(4))));
        l.end(&db(), "uid-db-2");
        assert!(granted(&l.ask(&b, &one, t(5))));
    }

    /// Case 8 of issue 36: a drain busy elsewhere (its pass not over) does
    /// not keep its place in line; once parked, it does, until it asks
    /// again.
    #[test]
    fn a_drain_busy_elsewhere_keeps_no_place_in_line() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        // b was deleted first, but its pass is still busy elsewhere.
        let busy = ask("db-1", "b", 0);
        let parked = ask("db-2", "c", 5);
        assert!(!granted(&l.ask(&busy, &one, t(2))));
        assert!(!granted(&l.ask(&parked, &one, t(2))));
        l.keep_waiting("ns/c", &["uid-db-2".to_string()]);
        l.end(&db(), "uid-db-0");
        assert!(
            granted(&l.ask(&parked, &one, t(3))),
            "the freed permit is not kept for b's busy drain"
        );
        l.end(&db(), "uid-db-2");
        // Parked first, b holds its place against c's later ask, even
        // though c asks before b does.
        l.keep_waiting("ns/b", &["uid-db-1".to_string()]);
        let again = ask("db-3", "c", 5);
        assert!(!granted(&l.ask(&again, &one, t(4))), "b is parked ahead");
        assert!(granted(&l.ask(&busy, &one, t(4))));
    }

    #[test]
    fn a_withdrawn_ask_no_longer_holds_the_line() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let first = ask("db-1", "b", 0);
        let second = ask("db-2", "c", 5);
        assert!(!granted(&l.ask(&first, &one, t(2))));
        assert!(!granted(&l.ask(&second, &one, t(2))));
        l.keep_waiting("ns/b", &["uid-db-1".to_string()]);
        l.end(&db(), "uid-db-0");
        l.withdraw(&db(), "uid-db-1");
        assert!(granted(&l.ask(&second, &one, t(3))));
    }

    #[test]
    fn a_drain_that_no_longer_asks_for_a_pod_takes_it_out_of_the_line() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let first = ask("db-1", "b", 0);
        let later = ask("db-2", "c", 5);
        assert!(!granted(&l.ask(&first, &one, t(2))));
        assert!(!granted(&l.ask(&later, &one, t(2))));
        l.end(&db(), "uid-db-0");
        // b's drain asked again for db-1 alone: nothing changes.
        assert_eq!(l.keep_waiting("ns/b", &["uid-db-1".to_string()]), 0);
        assert!(!granted(&l.ask(&later, &one, t(3))), "db-1 is first");
        // Its next pass no longer asks for db-1 (gone another way).
        assert_eq!(l.keep_waiting("ns/b", &[]), 1);
        assert!(granted(&l.ask(&later, &one, t(4))));
    }

    #[test]
    fn a_machine_releases_what_its_drain_no_longer_records() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let mut cache = ask("cache-0", "a", 0);
        cache.workload = Workload::new("StatefulSet", "ns", "cache");
        assert!(granted(&l.ask(&cache, &one, t(1))));
        assert_eq!(l.release_machine("ns/a", &["uid-db-0".to_string()]), 1);
        assert_eq!(l.release_machine("ns/b", &[]), 0);
        assert!(!granted(&l.ask(&ask("db-1", "b", 0), &one, t(2))));
        assert_eq!(l.release_machine("ns/a", &[]), 1);
        assert!(granted(&l.ask(&ask("db-1", "b", 0), &one, t(3))));
    }

    #[test]
    fn past_its_deadline_a_drain_moves_beyond_the_budget_and_is_counted() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let mut late = ask("db-1", "b", 0);
        late.past_deadline = true;
        let Answer::Bypassed { permit, moving } = l.ask(&late, &one, t(2)) else {
            panic!("bypassed")
        };
        assert!(permit.past_budget);
        assert_eq!(moving.len(), 1);
        // Counted: a third replica waits for both.
        let Answer::Wait { moving, .. } = l.ask(&ask("db-2", "c", 0), &one, t(3)) else {
            panic!("waits")
        };
        assert_eq!(moving.len(), 2);
        l.end(&db(), "uid-db-0");
        assert!(!granted(&l.ask(&ask("db-2", "c", 0), &one, t(4))));
        l.end(&db(), "uid-db-1");
        assert!(granted(&l.ask(&ask("db-2", "c", 0), &one, t(5))));
    }

    #[test]
    fn the_cap_bounds_moves_of_every_workload_together() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default().with_cap(Some(2));
        let of = |pod: &str, workload: &str, machine: &str| {
            let mut a = ask(pod, machine, 0);
            a.workload = Workload::new("StatefulSet", "ns", workload);
            a
        };
        assert!(granted(&l.ask(&of("db-0", "db", "a"), &one, t(1))));
        assert!(granted(&l.ask(&of("cache-0", "cache", "a"), &one, t(1))));
        let queue = of("queue-0", "queue", "b");
        assert_eq!(
            l.ask(&queue, &one, t(2)),
            Answer::Capped {
                in_flight: 2,
                cap: 2
            }
        );
        assert_eq!(l.waiting_since(&queue.workload, &queue.uid), Some(t(2)));
        // A workload's own budget still answers first.
        assert!(matches!(
            l.ask(&of("db-1", "db", "b"), &one, t(3)),
            Answer::Wait { .. }
        ));
        // Waiting since its first ask, not its last.
        assert!(!granted(&l.ask(&queue, &one, t(4))));
        assert_eq!(l.waiting_since(&queue.workload, &queue.uid), Some(t(2)));
        l.end(&Workload::new("StatefulSet", "ns", "cache"), "uid-cache-0");
        assert!(granted(&l.ask(&queue, &one, t(5))));
        assert_eq!(l.waiting_since(&queue.workload, &queue.uid), None);
        // Past its deadline a drain goes beyond the cap, within the budget
        // (not past it).
        let mut late = of("log-0", "log", "c");
        late.past_deadline = true;
        let Answer::Bypassed { permit, .. } = l.ask(&late, &one, t(6)) else {
            panic!("past the deadline, beyond the cap")
        };
        assert!(!permit.past_budget);
        assert_eq!(l.in_flight(), 3);
        assert_eq!(
            l.machines(),
            ["ns/a", "ns/b", "ns/c"].map(String::from).into()
        );
    }

    #[test]
    fn recorded_moves_name_their_workload_and_machine() {
        let mut m: Machine = serde_json::from_value(serde_json::json!({
            "apiVersion": "berth.dev/v1alpha1",
            "kind": "Machine",
            "metadata": {"namespace": "ns", "name": "a"},
            "spec": {"classRef": {"name": "pool"}}
        }))
        .expect("a Machine");
        let status: crate::api::MachineStatus = serde_json::from_value(serde_json::json!({
            "drain": {"moves": [
                {"pod": "ns/db-0", "uid": "u0", "volumes": ["pv-0"], "workload": "StatefulSet/db",
                 "since": "2023-11-14T22:13:20Z"},
                {"pod": "ns/old-0", "volumes": ["pv-1"], "controller": "ReplicaSet/old"},
                {"pod": "ns/bare", "volumes": ["pv-2"]}
            ]}
        }))
        .expect("status");
        m.status = Some(status);
        let moves = recorded_moves([&m]);
        let names: Vec<(String, &str, &str, &str)> = moves
            .iter()
            .map(|(w, p)| {
                (
                    w.to_string(),
                    p.pod.as_str(),
                    p.uid.as_str(),
                    p.machine.as_str(),
                )
            })
            .collect();
        assert_eq!(
            names,
            vec![
                ("StatefulSet ns/db".to_string(), "ns/db-0", "u0", "ns/a"),
                (
                    "ReplicaSet ns/old".to_string(),
                    "ns/old-0",
                    "ns/old-0",
                    "ns/a"
                ),
                ("Pod ns/bare".to_string(), "ns/bare", "ns/bare", "ns/a"),
            ]
        );
        assert_eq!(moves[0].1.since, t(0));
    }

    #[test]
    fn permits_the_api_server_holds_count_once_with_this_processs_own() {
        let one = Budget::default_for(true);
        let two = Budget {
            max_moving: Some(2),
            ..one.clone()
        };
        let theirs = Permit {
            pod: "ns/db-0".into(),
            uid: "uid-db-0".into(),
            machine: "other/x".into(),
            since: t(0),
            past_budget: false,
            volumes: true,
            attach: vec![],
        };
        let mut l = Ledger::default();
        // Another process's move holds db's one permit.
        l.set_held([(db(), theirs.clone())]);
        let Answer::Wait { moving, .. } = l.ask(&ask("db-1", "b", 0), &one, t(1)) else {
            panic!("held by the other process")
        };
        assert_eq!(moving, vec![theirs.clone()]);
        assert_eq!(l.machines(), ["ns/b", "other/x"].map(String::from).into());
        // This process's grant, also in the API server by the next ask:
        // counted once.
        let Answer::Granted(mine) = l.ask(&ask("db-1", "b", 0), &two, t(2)) else {
            panic!("a second permit of two")
        };
        l.set_held([(db(), theirs.clone()), (db(), mine.clone())]);
        assert_eq!(l.moving_of(&db()).len(), 2);
        assert_eq!(l.in_flight(), 2);
        assert_eq!(l.moves().len(), 2);
        assert!(!granted(&l.ask(&ask("db-2", "c", 0), &two, t(3))));
        // The other process ended its move: the next snapshot drops it.
        l.set_held([(db(), mine)]);
        assert!(granted(&l.ask(&ask("db-2", "c", 0), &two, t(4))));
        // A pod whose permit the API server holds gets it again.
        let mut resumed = Ledger::default();
        resumed.set_held([(db(), theirs.clone())]);
        let again = Ask {
            machine: "other/x".into(),
            ..ask("db-0", "x", 0)
        };
        assert_eq!(resumed.ask(&again, &one, t(5)), Answer::Granted(theirs));
    }

    #[test]
    fn a_rebuilt_ledger_holds_what_the_machines_recorded() {
        let one = Budget::default_for(true);
        let permit = Permit {
            pod: "ns/db-0".into(),
            uid: "uid-db-0".into(),
            machine: "ns/a".into(),
            since: t(0),
            past_budget: false,
            volumes: true,
            attach: vec![],
        };
        let mut l = Ledger::rebuild([(db(), permit.clone())]);
        assert_eq!(l.moves().len(), 1);
        assert!(!granted(&l.ask(&ask("db-1", "b", 0), &one, t(1))));
        // The recorded move resumes under its own permit.
        assert_eq!(
            l.ask(&ask("db-0", "a", 0), &one, t(2)),
            Answer::Granted(permit)
        );
    }

    #[test]
    fn a_move_ends_once_every_replacement_has_been_ready_long_enough() {
        let ten = Duration::from_secs(10);
        assert_eq!(healthy(&[Some(t(0)), Some(t(5))], ten, t(20)), Ok(()));
        assert_eq!(
            healthy(&[Some(t(0)), Some(t(5))], ten, t(12)),
            Err(Some(t(15)))
        );
        assert_eq!(healthy(&[Some(t(0)), None], ten, t(100)), Err(None));
        assert_eq!(healthy(&[Some(t(3))], Duration::ZERO, t(3)), Ok(()));
        let mut pod = Pod::default();
        assert_eq!(ready_since(&pod), None);
        pod.status = Some(
            serde_json::from_value(serde_json::json!({
                "conditions": [{"type": "Ready", "status": "True",
                    "lastTransitionTime": "2023-11-14T22:13:20Z"}]
            }))
            .expect("status"),
        );
        assert_eq!(ready_since(&pod), Some(t(0)));
    }

    #[test]
    fn budgets_come_from_annotations_and_a_bad_value_keeps_the_default() {
        let a = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let none = WorkloadTerms::default();
        let (b, bad) = budget_of(None, &none, true);
        assert_eq!(b, Budget::default_for(true));
        assert!(bad.is_empty());
        assert_eq!(budget_of(None, &none, false).0.max_moving, None);
        let (b, bad) = budget_of(
            Some(&a(&[
                (MAX_MOVING_ANNOTATION, "2"),
                (MIN_HEALTHY_ANNOTATION, "10s"),
                (HEALTHY_DEADLINE_ANNOTATION, "3m"),
            ])),
            &none,
            true,
        );
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(b.max_moving, Some(2));
        assert_eq!(b.min_healthy, Duration::from_secs(10));
        assert_eq!(b.healthy_deadline, Some(Duration::from_secs(180)));
        assert_eq!(
            budget_of(
                Some(&a(&[(MAX_MOVING_ANNOTATION, "unbounded")])),
                &none,
                true
            )
            .0
            .max_moving,
            None
        );
        let (b, bad) = budget_of(
            Some(&a(&[
                (MAX_MOVING_ANNOTATION, "0"),
                (MIN_HEALTHY_ANNOTATION, "soon"),
                (HEALTHY_DEADLINE_ANNOTATION, "0s"),
            ])),
            &none,
            true,
        );
        assert_eq!(b, Budget::default_for(true));
        let keys: Vec<_> = bad.iter().map(|b| b.key).collect();
        assert_eq!(
            keys,
            vec![
                MAX_MOVING_ANNOTATION,
                MIN_HEALTHY_ANNOTATION,
                HEALTHY_DEADLINE_ANNOTATION
            ]
        );
    }

    #[test]
    fn the_workload_object_wins_over_its_template_and_min_ready_seconds_is_a_floor() {
        let a = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let template = a(&[(MAX_MOVING_ANNOTATION, "3"), (MIN_HEALTHY_ANNOTATION, "5s")]);
        let workload = WorkloadTerms {
            annotations: a(&[(MAX_MOVING_ANNOTATION, "2")]),
            min_ready: Duration::from_secs(20),
            availability: None,
        };
        let (b, bad) = budget_of(Some(&template), &workload, true);
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(b.max_moving, Some(2), "the workload's annotation wins");
        assert_eq!(
            b.min_healthy,
            Duration::from_secs(20),
            "available only after minReadySeconds, longer than the 5s asked"
        );
        let longer = a(&[(MIN_HEALTHY_ANNOTATION, "1m")]);
        assert_eq!(
            budget_of(Some(&longer), &workload, true).0.min_healthy,
            Duration::from_secs(60)
        );
        // A bad value on the workload is not replaced by the template's:
        // the default holds, and it is named.
        let bad_workload = WorkloadTerms {
            annotations: a(&[(MAX_MOVING_ANNOTATION, "many")]),
            min_ready: Duration::ZERO,
            availability: None,
        };
        let (b, bad) = budget_of(Some(&template), &bad_workload, true);
        assert_eq!(b.max_moving, Some(1));
        assert_eq!(bad.len(), 1);
        // A workload without volumes keeps its unbounded default unless it
        // asks.
        assert_eq!(budget_of(None, &workload, false).0.max_moving, Some(2));
    }

    #[test]
    fn moves_without_volumes_keep_their_budget_and_leave_the_cap_alone() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default().with_cap(Some(1));
        let web = |pod: &str, machine: &str| Ask {
            workload: Workload::new("Deployment", "ns", "web"),
            volumes: false,
            ..ask(pod, machine, 0)
        };
        assert!(matches!(
            l.ask(&web("web-1", "a"), &one, t(1)),
            Answer::Granted(_)
        ));
        // Its budget of one holds for the workload's other pod ...
        assert!(matches!(
            l.ask(&web("web-2", "b"), &one, t(1)),
            Answer::Wait { .. }
        ));
        // ... but the cap on moves in flight counts moves of volumes only.
        assert_eq!(l.in_flight(), 0);
        assert!(matches!(
            l.ask(&ask("db-0", "a", 0), &one, t(1)),
            Answer::Granted(_)
        ));
        assert_eq!(l.in_flight(), 1);
        let other = Ask {
            workload: Workload::new("StatefulSet", "ns", "cache"),
            ..ask("cache-0", "b", 0)
        };
        assert!(matches!(l.ask(&other, &one, t(1)), Answer::Capped { .. }));
    }
}
