//! What a MachineDeployment's reconcile does, from facts: the template's
//! hash, the pace of a rollout (how many Machines the new set gets, how
//! many old Machines may go now, and what holds the rest), and the status
//! that says so. Pure; `reconcile` gathers the facts and acts.
//!
//! The pace of a `RollingUpdate`, with `surge` and `unavailable` resolved
//! from the spec ([`Pace::of`]):
//!
//! - **VMs**: every Machine of every set counts, those being deleted too
//!   (they are VMs until their drain and their VM are done), so the
//!   deployment never has more than `replicas + surge` of them. This is
//!   stricter than a Deployment's pods, and it is what a quota or a
//!   `maxSurge: 0` means for Machines.
//! - **Landing** (when `surge > 0`): an old Machine goes only when a new
//!   Machine is Running with its Node Ready for it, and that Node takes
//!   pods (none of the taints of a Node still starting): `new ready + old
//!   active > replicas`. Its pods then have somewhere new to land.
//! - **Availability**: at least `replicas - unavailable` Machines stay
//!   available; an old Machine that is not ready costs nothing to remove.
//! - **Drains at once**: at most `max(unavailable, 1)` old Machines of the
//!   deployment are being deleted at a time, and at most the controller's
//!   global cap across all deployments.
//!
//! A new Machine that is failing (phase Failed, or its Ready condition
//! False for a reason other than the steps of creation) holds its place:
//! it is not ready, so no old Machine goes for it, and it fills the surge,
//! so no other new Machine is created. The rollout stalls and says so.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use sha2::{Digest, Sha256};

use crate::api::machinedeployment::conditions::{AVAILABLE, PROGRESSING};
use crate::api::{MachineDeploymentStatus, MachineTemplate, StrategyType};
use crate::machine::status::{Cond, set_condition, set_condition_status};

/// The default `maxSurge` and `maxUnavailable`.
const DEFAULT_SURGE: i32 = 1;
const DEFAULT_UNAVAILABLE: i32 = 0;
/// The default `progressDeadlineSeconds`.
pub(crate) const DEFAULT_PROGRESS_DEADLINE: i64 = 600;
/// The default `revisionHistoryLimit`.
pub(crate) const DEFAULT_HISTORY: i32 = 1;

/// The hash of a template: 10 hex digits of the SHA-256 of its JSON. Maps
/// serialize with sorted keys, so the same template always gives the same
/// hash, on any version of berth that reads it the same way.
pub(crate) fn template_hash(t: &MachineTemplate) -> String {
    json_hash(serde_json::to_value(t).unwrap_or_default())
}

/// 10 hex digits of the SHA-256 of `v` as JSON with sorted keys.
fn json_hash(v: serde_json::Value) -> String {
    short_hash(&serde_json::to_vec(&sorted(v)).unwrap_or_default())
}

/// 10 hex digits of the SHA-256 of `bytes`.
fn short_hash(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().take(5).map(|b| format!("{b:02x}")).collect()
}

/// The hash of what a MachineClass makes a VM from: its provider,
/// `providerSpec` and `secretRef`. Its drain settings and timeouts are not
/// in it: they apply to the Machines as they are, without a new VM.
pub(crate) fn class_hash(c: &crate::api::MachineClassSpec) -> String {
    let what = serde_json::json!({
        "provider": c.provider,
        "providerSpec": c.provider_spec,
        "secretRef": c.secret_ref,
    });
    json_hash(what)
}

/// The hash naming the set of template `template` (its [`template_hash`])
/// made from a class whose [`class_hash`] is `class` (`None`: the class is
/// not known), given the deployment's sets as (their template-hash label,
/// their class-hash annotation). The template's own hash while a set of it
/// was made from this class, or from a class not recorded (a set made
/// before berth recorded classes: taken as made from this one, so an
/// upgrade rolls nothing), or no set of it exists yet; once the class was
/// edited since its set was made, a hash of both, so that the pool rolls
/// to a new set (and back, if the class is edited back).
pub(crate) fn wanted_hash(
    template: &str,
    class: Option<&str>,
    sets: &[(Option<&str>, Option<&str>)],
) -> String {
    let Some(class) = class else {
        return template.to_string();
    };
    let of_template: Vec<Option<&str>> = sets
        .iter()
        .filter(|(label, _)| *label == Some(template))
        .map(|(_, c)| *c)
        .collect();
    if of_template.is_empty() || of_template.iter().any(|c| c.is_none_or(|c| c == class)) {
        return template.to_string();
    }
    short_hash(format!("{template}/{class}").as_bytes())
}

/// `v` with every object's keys in order (whatever map serde_json uses).
fn sorted(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            let mut entries: Vec<_> = m.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        serde_json::Value::Array(a) => {
            serde_json::Value::Array(a.into_iter().map(sorted).collect())
        }
        other => other,
    }
}

/// `maxSurge` and `maxUnavailable` as numbers of Machines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pace {
    pub(crate) surge: usize,
    pub(crate) unavailable: usize,
}

impl Pace {
    /// Percentages of `replicas`: the surge rounded up, the unavailable
    /// rounded down (so that 25% of 3 is one more Machine and none less);
    /// when both come to zero, one may be unavailable, or nothing could
    /// ever move.
    pub(crate) fn of(
        replicas: i32,
        surge: Option<&IntOrString>,
        unavailable: Option<&IntOrString>,
    ) -> Self {
        let replicas = usize::try_from(replicas).unwrap_or(0);
        let resolve = |v: Option<&IntOrString>, default: i32, up: bool| -> usize {
            match v {
                None => usize::try_from(default).unwrap_or(0),
                Some(IntOrString::Int(n)) => usize::try_from(*n).unwrap_or(0),
                Some(IntOrString::String(s)) => {
                    let pct: usize = s.trim_end_matches('%').trim().parse().unwrap_or(0);
                    let scaled = pct * replicas;
                    if up {
                        scaled.div_ceil(100)
                    } else {
                        scaled / 100
                    }
                }
            }
        };
        let surge = resolve(surge, DEFAULT_SURGE, true);
        let mut unavailable = resolve(unavailable, DEFAULT_UNAVAILABLE, false);
        if surge == 0 && unavailable == 0 {
            unavailable = 1;
        }
        Self { surge, unavailable }
    }

    /// Old Machines of one deployment being deleted at once, at most.
    pub(crate) fn drains_at_once(&self) -> usize {
        self.unavailable.max(1)
    }
}

/// The counts of one MachineSet's Machines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SetCounts {
    /// `spec.replicas` as last written (by us, if the cache is behind).
    pub(crate) replicas: usize,
    /// Not being deleted.
    pub(crate) active: usize,
    /// Being deleted: draining, detaching, terminating.
    pub(crate) deleting: usize,
    /// Of the active, Running with the Node Ready.
    pub(crate) ready: usize,
    /// Of the ready, ready for `minReadySeconds`.
    pub(crate) available: usize,
}

impl SetCounts {
    /// Active Machines the set has been asked to delete and has not yet.
    pub(crate) fn asked_to_delete(&self) -> usize {
        self.active.saturating_sub(self.replicas)
    }

    /// Machines the set will have or has as VMs: what it was asked for or
    /// holds, whichever is more, and those being deleted.
    fn vms(&self) -> usize {
        self.replicas.max(self.active) + self.deleting
    }
}

/// What the pace is decided from.
#[derive(Debug, Clone)]
pub(crate) struct Facts {
    pub(crate) replicas: usize,
    pub(crate) strategy: StrategyType,
    pub(crate) pace: Pace,
    pub(crate) new: SetCounts,
    /// The old sets together.
    pub(crate) old: SetCounts,
    /// Old Machines being deleted by rollouts of every deployment (asked
    /// for included), and the controller's cap on them.
    pub(crate) drains_everywhere: usize,
    pub(crate) drain_cap: usize,
}

/// What holds the next step of a rollout, for the condition's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// No new Machine is ready (its Node Ready and taking pods) for the
    /// next old one to go.
    Landing,
    /// Removing one more would leave fewer than `replicas - unavailable`.
    Availability,
    /// `max(maxUnavailable, 1)` old Machines are being deleted.
    DrainsAtOnce,
    /// The controller's cap on drains across deployments is reached.
    GlobalCap,
    /// `max(maxUnavailable, 1)` old Machines are being deleted, and their
    /// drains wait for a workload's move budget: a replica of it is moving
    /// (from another Machine), so the rollout is held by the workload, not
    /// by its own pace.
    MoveBudget,
}

impl Hold {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Hold::Landing => {
                "waiting for a new Machine to be Running with its Node Ready and taking pods"
            }
            Hold::Availability => "waiting to keep replicas - maxUnavailable Machines available",
            Hold::DrainsAtOnce => "waiting for the old Machines being drained (maxUnavailable)",
            Hold::GlobalCap => "waiting for a slot under berth's cap on concurrent drains",
            Hold::MoveBudget => {
                "waiting for the old Machines being drained, held by a workload's move budget (another replica of it is moving; see their status.drain.waitingForBudget)"
            }
        }
    }
}

/// The next step: the new set's replicas and how many more old Machines
/// go now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Step {
    pub(crate) new_replicas: usize,
    pub(crate) delete_old: usize,
    /// Why not more old Machines go, when some are left.
    pub(crate) held: Option<Hold>,
}

/// The next step of a rollout (or of a scale when there are no old sets).
pub(crate) fn step(f: &Facts) -> Step {
    match f.strategy {
        StrategyType::OnDelete => on_delete(f),
        StrategyType::RollingUpdate => rolling(f),
    }
}

/// Old Machines go only when an operator deletes them; the new set makes
/// up the difference.
fn on_delete(f: &Facts) -> Step {
    let old_kept = f.old.active.min(f.old.replicas);
    Step {
        new_replicas: f.replicas.saturating_sub(old_kept),
        delete_old: f.old.active.saturating_sub(f.replicas),
        held: None,
    }
}

fn rolling(f: &Facts) -> Step {
    let old_active = f.old.active.saturating_sub(f.old.asked_to_delete());
    let in_flight = f.old.deleting + f.old.asked_to_delete();

    // The new set: up to `replicas`, as far as the VM budget allows. A
    // scale-down of the deployment lowers it at once (old Machines first).
    let vms = f.new.vms() + f.old.vms();
    let budget = f.replicas + f.pace.surge;
    let new_replicas = if f.new.replicas >= f.replicas {
        f.replicas
    } else {
        let room = budget.saturating_sub(vms);
        f.replicas.min(f.new.replicas + room)
    };

    if old_active == 0 {
        return Step {
            new_replicas,
            delete_old: 0,
            held: None,
        };
    }
    let old_unready =
        old_active.saturating_sub(f.old.ready.saturating_sub(f.old.asked_to_delete()));
    let available = (f.new.available + f.old.available).saturating_sub(f.old.asked_to_delete());
    let min_available = f.replicas.saturating_sub(f.pace.unavailable);
    let limits = [
        (
            Hold::Landing,
            if f.pace.surge > 0 {
                (f.new.ready + old_active).saturating_sub(f.replicas)
            } else {
                usize::MAX
            },
        ),
        (
            Hold::Availability,
            available.saturating_sub(min_available) + old_unready,
        ),
        (
            Hold::DrainsAtOnce,
            f.pace.drains_at_once().saturating_sub(in_flight),
        ),
        (
            Hold::GlobalCap,
            f.drain_cap.saturating_sub(f.drains_everywhere),
        ),
    ];
    let (hold, allowed) = limits
        .iter()
        .copied()
        .min_by_key(|(_, n)| *n)
        .unwrap_or((Hold::Landing, 0));
    let delete_old = allowed.min(old_active);
    Step {
        new_replicas,
        delete_old,
        held: (delete_old < old_active).then_some(hold),
    }
}

/// A new Machine that is failing, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failing {
    pub(crate) machine: String,
    pub(crate) why: String,
}

/// Whether a new Machine is failing: phase Failed, or Ready False for a
/// reason that is not a step of its creation (an invalid class or spec, a
/// refused credential).
pub(crate) fn failing(phase: Option<&str>, ready_reason: Option<&str>) -> bool {
    phase == Some("Failed")
        || (phase != Some("Running")
            && ready_reason.is_some_and(|r| !matches!(r, "Creating" | "WaitingForNode")))
}

/// What the status is built from.
#[derive(Debug, Clone)]
pub(crate) struct Observed {
    pub(crate) replicas: usize,
    pub(crate) paused: bool,
    pub(crate) hash: String,
    pub(crate) selector: String,
    pub(crate) generation: Option<i64>,
    pub(crate) pace: Pace,
    pub(crate) new: SetCounts,
    pub(crate) old: SetCounts,
    pub(crate) held: Option<Hold>,
    pub(crate) failing: Option<Failing>,
    /// The template does not match the selector: nothing is created.
    pub(crate) mismatch: Option<String>,
    pub(crate) deadline: SignedDuration,
}

impl Observed {
    /// Every Machine is new and ready and no old one is left.
    pub(crate) fn complete(&self) -> bool {
        self.old.active + self.old.deleting == 0
            && self.new.active == self.replicas
            && self.new.deleting == 0
            && self.new.available == self.replicas
    }
}

/// The next status, and when it changes on its own (the progress deadline
/// passing), for a timer. The counts that mark progress (a new Machine
/// ready, an old one gone) move `lastProgressTime`.
pub(crate) fn next_status(
    current: &MachineDeploymentStatus,
    o: &Observed,
    now: Timestamp,
) -> (MachineDeploymentStatus, Option<SignedDuration>) {
    let n = |v: usize| i32::try_from(v).unwrap_or(i32::MAX);
    let mut s = current.clone();
    s.replicas = n(o.new.active + o.old.active);
    s.updated_replicas = n(o.new.active);
    s.ready_replicas = n(o.new.ready + o.old.ready);
    s.available_replicas = n(o.new.available + o.old.available);
    s.draining_replicas = n(o.new.deleting + o.old.deleting);
    s.selector = Some(o.selector.clone());
    s.observed_generation = o.generation;
    let progressed = current.template_hash.as_deref() != Some(o.hash.as_str())
        || s.updated_replicas != current.updated_replicas
        || s.ready_replicas != current.ready_replicas
        || s.replicas != current.replicas
        || s.draining_replicas < current.draining_replicas
        || current.last_progress_time.is_none();
    s.template_hash = Some(o.hash.clone());
    if progressed {
        s.last_progress_time = Some(Time(now));
    }
    let since = s.last_progress_time.as_ref().map_or(now, |t| t.0);

    set_condition(&mut s.conditions, &available(o), o.generation, now);
    let (cond, status, next_change) = progressing(o, now, since);
    set_condition_status(&mut s.conditions, &cond, status, o.generation, now);
    (s, next_change)
}

/// `Available`: at least `replicas - maxUnavailable` Machines available.
fn available(o: &Observed) -> Cond {
    let min_available = o.replicas.saturating_sub(o.pace.unavailable);
    let available = o.new.available + o.old.available;
    if available >= min_available {
        Cond::new(
            AVAILABLE,
            true,
            "MinimumReplicasAvailable",
            format!(
                "{available} of {} Machines available (at least {min_available} wanted)",
                o.replicas
            ),
        )
    } else {
        Cond::new(
            AVAILABLE,
            false,
            "MinimumReplicasUnavailable",
            format!(
                "{available} of {} Machines available; at least {min_available} wanted",
                o.replicas
            ),
        )
    }
}

/// `Progressing`, its status, and when it changes on its own (the progress
/// deadline, counted from `since`, the last progress).
fn progressing(
    o: &Observed,
    now: Timestamp,
    since: Timestamp,
) -> (Cond, &'static str, Option<SignedDuration>) {
    let old_left = o.old.active + o.old.deleting;
    let summary = format!(
        "{} of {} Machines updated, {} ready; {old_left} old left ({} draining)",
        o.new.active, o.replicas, o.new.ready, o.old.deleting
    );
    let mut next_change = None;
    let (cond, status) = if let Some(m) = &o.mismatch {
        (
            Cond::new(PROGRESSING, false, "SelectorMismatch", m.clone()),
            "False",
        )
    } else if o.paused {
        (
            Cond::new(PROGRESSING, false, "Paused", format!("paused: {summary}")),
            "Unknown",
        )
    } else if o.complete() {
        (
            Cond::new(
                PROGRESSING,
                true,
                "RolloutComplete",
                format!("{} Machines of template {} available", o.replicas, o.hash),
            ),
            "True",
        )
    } else if let Some(f) = &o.failing {
        (
            Cond::new(
                PROGRESSING,
                false,
                "NewMachineFailed",
                format!(
                    "new Machine {} is failing ({}); no old Machine goes for it: {summary}",
                    f.machine, f.why
                ),
            ),
            "False",
        )
    } else if now.duration_since(since) > o.deadline {
        (
            Cond::new(
                PROGRESSING,
                false,
                "ProgressDeadlineExceeded",
                format!(
                    "no progress for more than {}s: {summary}{}",
                    o.deadline.as_secs(),
                    o.held
                        .map(|h| format!("; {}", h.describe()))
                        .unwrap_or_default()
                ),
            ),
            "False",
        )
    } else {
        next_change = Some(o.deadline - now.duration_since(since));
        let reason = if old_left > 0 {
            "RollingOut"
        } else if o.new.active < o.replicas {
            "ScalingUp"
        } else if o.new.active > o.replicas || o.new.deleting > 0 {
            "ScalingDown"
        } else {
            "WaitingForAvailable"
        };
        let held = o
            .held
            .map(|h| format!("; {}", h.describe()))
            .unwrap_or_default();
        (
            Cond::new(PROGRESSING, true, reason, format!("{summary}{held}")),
            "True",
        )
    };
    (cond, status, next_change)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_class_edited_in_place_rolls_and_an_upgrade_does_not() {
        use super::wanted_hash;
        // No set yet, or the class not known: the template's hash.
        assert_eq!(wanted_hash("t1", Some("c1"), &[]), "t1");
        assert_eq!(wanted_hash("t1", None, &[(Some("t1"), Some("c0"))]), "t1");
        // The set of this template was made from this class, or before
        // classes were recorded (an upgrade): no roll.
        assert_eq!(
            wanted_hash("t1", Some("c1"), &[(Some("t1"), Some("c1"))]),
            "t1"
        );
        assert_eq!(wanted_hash("t1", Some("c1"), &[(Some("t1"), None)]), "t1");
        // The class was edited since: a new set, stable across reconciles.
        let rolled = wanted_hash("t1", Some("c2"), &[(Some("t1"), Some("c1"))]);
        assert_ne!(rolled, "t1");
        assert_eq!(
            rolled,
            wanted_hash(
                "t1",
                Some("c2"),
                &[
                    (Some("t1"), Some("c1")),
                    (Some(rolled.as_str()), Some("c2"))
                ]
            )
        );
        // Edited back: the first set is current again.
        assert_eq!(
            wanted_hash(
                "t1",
                Some("c1"),
                &[
                    (Some("t1"), Some("c1")),
                    (Some(rolled.as_str()), Some("c2"))
                ]
            ),
            "t1"
        );
        // A new template: its own hash, whatever the class did before.
        assert_eq!(
            wanted_hash("t2", Some("c2"), &[(Some("t1"), Some("c1"))]),
            "t2"
        );
    }

    #[test]
    fn only_what_makes_a_vm_is_in_the_class_hash() {
        let class = |spec: serde_json::Value| -> crate::api::MachineClassSpec {
            serde_json::from_value(spec).expect("a class spec")
        };
        let a = class(serde_json::json!({"provider": "aws", "providerSpec": {"imageId": "ami-1"}}));
        let b = class(serde_json::json!({"provider": "aws", "providerSpec": {"imageId": "ami-2"}}));
        let a_drain = class(
            serde_json::json!({"provider": "aws", "providerSpec": {"imageId": "ami-1"},
            "drain": {"timeout": "5m"}, "creationTimeout": "30m"}),
        );
        assert_ne!(super::class_hash(&a), super::class_hash(&b));
        assert_eq!(super::class_hash(&a), super::class_hash(&a_drain));
    }

    use super::*;

    fn pace(surge: usize, unavailable: usize) -> Pace {
        Pace { surge, unavailable }
    }

    fn set(replicas: usize, active: usize, deleting: usize, ready: usize) -> SetCounts {
        SetCounts {
            replicas,
            active,
            deleting,
            ready,
            available: ready,
        }
    }

    fn facts(p: Pace, new: SetCounts, old: SetCounts) -> Facts {
        Facts {
            replicas: 4,
            strategy: StrategyType::RollingUpdate,
            pace: p,
            new,
            old,
            drains_everywhere: old.deleting + old.asked_to_delete(),
            drain_cap: 10,
        }
    }

    #[test]
    fn percentages_round_surge_up_and_unavailable_down_and_never_both_zero() {
        let s = |v: &str| IntOrString::String(v.into());
        assert_eq!(Pace::of(3, Some(&s("25%")), Some(&s("25%"))), pace(1, 0));
        assert_eq!(Pace::of(10, Some(&s("25%")), Some(&s("25%"))), pace(3, 2));
        assert_eq!(Pace::of(4, None, None), pace(1, 0));
        assert_eq!(
            Pace::of(4, Some(&IntOrString::Int(0)), Some(&IntOrString::Int(0))),
            pace(0, 1)
        );
        assert_eq!(
            Pace::of(4, Some(&IntOrString::Int(2)), Some(&s("50%"))),
            pace(2, 2)
        );
    }

    #[test]
    fn a_surge_rollout_creates_first_and_deletes_only_for_a_ready_new_machine() {
        let p = pace(1, 0);
        // Start: 4 old, the new set at 0: one new Machine, no deletion.
        let s = step(&facts(p, set(0, 0, 0, 0), set(4, 4, 0, 4)));
        assert_eq!((s.new_replicas, s.delete_old), (1, 0));
        assert_eq!(s.held, Some(Hold::Landing));
        // The new Machine exists but is not ready: nothing goes.
        let s = step(&facts(p, set(1, 1, 0, 0), set(4, 4, 0, 4)));
        assert_eq!((s.new_replicas, s.delete_old), (1, 0));
        // Ready: one old Machine goes.
        let s = step(&facts(p, set(1, 1, 0, 1), set(4, 4, 0, 4)));
        assert_eq!((s.new_replicas, s.delete_old), (1, 1));
        // Asked (old set at 3, 4 active): nothing more, no second new yet
        // (the old one is still a VM).
        let s = step(&facts(p, set(1, 1, 0, 1), set(3, 4, 0, 4)));
        assert_eq!((s.new_replicas, s.delete_old), (1, 0));
        // Draining: still 5 VMs; nothing more.
        let s = step(&facts(p, set(1, 1, 0, 1), set(3, 3, 1, 3)));
        assert_eq!((s.new_replicas, s.delete_old), (1, 0));
        assert_eq!(s.held, Some(Hold::Landing));
        // Gone: the second new Machine.
        let s = step(&facts(p, set(1, 1, 0, 1), set(3, 3, 0, 3)));
        assert_eq!((s.new_replicas, s.delete_old), (2, 0));
        // Last old one, with every new ready.
        let s = step(&facts(p, set(4, 4, 0, 4), set(1, 1, 0, 1)));
        assert_eq!((s.new_replicas, s.delete_old), (4, 1));
        assert_eq!(s.held, None);
    }

    #[test]
    fn without_surge_an_old_machine_goes_first_and_the_new_one_follows_its_vm() {
        let p = pace(0, 1);
        let s = step(&facts(p, set(0, 0, 0, 0), set(4, 4, 0, 4)));
        assert_eq!((s.new_replicas, s.delete_old), (0, 1));
        // Draining: 4 VMs, no room for a new one (maxSurge 0 means it).
        let s = step(&facts(p, set(0, 0, 0, 0), set(3, 3, 1, 3)));
        assert_eq!((s.new_replicas, s.delete_old), (0, 0));
        assert_eq!(s.held, Some(Hold::Availability));
        let s = step(&facts(p, set(0, 0, 0, 0), set(3, 3, 0, 3)));
        assert_eq!((s.new_replicas, s.delete_old), (1, 0));
        // The new one not ready yet: availability holds the next.
        let s = step(&facts(p, set(1, 1, 0, 0), set(3, 3, 0, 3)));
        assert_eq!((s.new_replicas, s.delete_old), (1, 0));
        let s = step(&facts(p, set(1, 1, 0, 1), set(3, 3, 0, 3)));
        assert_eq!((s.new_replicas, s.delete_old), (1, 1));
    }

    #[test]
    fn drains_at_once_follow_max_unavailable_and_the_global_cap() {
        // Surge 4, unavailable 2: four new ready, two old go at a time.
        let p = pace(4, 2);
        let s = step(&facts(p, set(4, 4, 0, 4), set(4, 4, 0, 4)));
        assert_eq!(s.delete_old, 2);
        assert_eq!(s.held, Some(Hold::DrainsAtOnce));
        let s = step(&facts(p, set(4, 4, 0, 4), set(2, 2, 2, 2)));
        assert_eq!(s.delete_old, 0);
        let mut f = facts(p, set(4, 4, 0, 4), set(4, 4, 0, 4));
        f.drains_everywhere = 9;
        let s = step(&f);
        assert_eq!((s.delete_old, s.held), (1, Some(Hold::GlobalCap)));
    }

    #[test]
    fn a_failing_new_machine_holds_the_rollout() {
        // The new Machine never becomes ready: it fills the surge and no
        // old Machine goes, however long.
        let p = pace(1, 0);
        let s = step(&facts(p, set(1, 1, 0, 0), set(4, 4, 0, 4)));
        assert_eq!(
            (s.new_replicas, s.delete_old, s.held),
            (1, 0, Some(Hold::Landing))
        );
        assert!(failing(Some("Failed"), Some("CreationTimeout")));
        assert!(failing(Some("Pending"), Some("ClassNotFound")));
        assert!(failing(Some("Creating"), Some("ProviderUnauthorized")));
        assert!(!failing(Some("Creating"), Some("WaitingForNode")));
        assert!(!failing(Some("Pending"), None));
        assert!(!failing(Some("Running"), Some("NodeReady")));
    }

    #[test]
    fn on_delete_replaces_only_what_the_operator_deleted() {
        let mut f = facts(pace(1, 0), set(0, 0, 0, 0), set(4, 4, 0, 4));
        f.strategy = StrategyType::OnDelete;
        assert_eq!(step(&f).new_replicas, 0);
        f.old = set(3, 3, 1, 3);
        assert_eq!((step(&f).new_replicas, step(&f).delete_old), (1, 0));
    }

    #[test]
    fn scaling_down_lowers_the_new_set_without_old_ones() {
        let mut f = facts(pace(1, 0), set(4, 4, 0, 4), SetCounts::default());
        f.replicas = 2;
        assert_eq!(step(&f).new_replicas, 2);
        f.replicas = 6;
        assert_eq!(step(&f).new_replicas, 6, "a scale-up is not a rollout");
    }

    #[test]
    fn the_hash_is_stable_and_follows_the_template() {
        let t: MachineTemplate = serde_json::from_value(serde_json::json!({
            "metadata": {"labels": {"b": "2", "a": "1"}},
            "spec": {"classRef": {"name": "small"}, "providerSpec": {"z": 1, "y": {"q": 2, "p": 1}}}
        }))
        .expect("template");
        let h = template_hash(&t);
        assert_eq!(h.len(), 10);
        assert_eq!(h, template_hash(&t.clone()));
        let mut other = t.clone();
        other.spec.class_ref.name = "large".into();
        assert_ne!(h, template_hash(&other));
    }

    fn observed(new: SetCounts, old: SetCounts) -> Observed {
        Observed {
            replicas: 4,
            paused: false,
            hash: "abc".into(),
            selector: "pool=a".into(),
            generation: Some(2),
            pace: pace(1, 0),
            new,
            old,
            held: None,
            failing: None,
            mismatch: None,
            deadline: SignedDuration::from_secs(600),
        }
    }

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).expect("valid")
    }

    fn progressing(s: &MachineDeploymentStatus) -> (&str, &str) {
        let c = s
            .conditions
            .iter()
            .find(|c| c.type_ == PROGRESSING)
            .expect("Progressing");
        (c.status.as_str(), c.reason.as_str())
    }

    #[test]
    fn progress_moves_the_deadline_and_its_absence_trips_it() {
        let o = observed(set(1, 1, 0, 0), set(4, 4, 0, 4));
        let (s, next) = next_status(&MachineDeploymentStatus::default(), &o, t(0));
        assert_eq!(progressing(&s), ("True", "RollingOut"));
        assert_eq!(next, Some(SignedDuration::from_secs(600)));
        // Nothing changed for 10 minutes and 1 second.
        let (s2, next) = next_status(&s, &o, t(601));
        assert_eq!(progressing(&s2), ("False", "ProgressDeadlineExceeded"));
        assert_eq!(next, None);
        assert_eq!(s2.last_progress_time, s.last_progress_time);
        // The new Machine turns ready: progress again.
        let o3 = observed(set(1, 1, 0, 1), set(4, 4, 0, 4));
        let (s3, _) = next_status(&s2, &o3, t(602));
        assert_eq!(progressing(&s3), ("True", "RollingOut"));
        assert_eq!(s3.last_progress_time, Some(Time(t(602))));
        // The same facts write the same status: no write loop.
        let (s4, _) = next_status(&s3, &o3, t(603));
        assert_eq!(s4, s3);
    }

    #[test]
    fn the_rollout_reads_at_a_glance() {
        let mut o = observed(set(4, 4, 0, 4), SetCounts::default());
        let (s, _) = next_status(&MachineDeploymentStatus::default(), &o, t(0));
        assert_eq!(progressing(&s), ("True", "RolloutComplete"));
        assert_eq!(
            (s.replicas, s.updated_replicas, s.available_replicas),
            (4, 4, 4)
        );
        o.paused = true;
        let (s, _) = next_status(&s, &o, t(1));
        assert_eq!(progressing(&s), ("Unknown", "Paused"));
        o.paused = false;
        o.new = set(1, 1, 0, 0);
        o.old = set(4, 4, 0, 4);
        o.failing = Some(Failing {
            machine: "pool-x".into(),
            why: "CreationTimeout".into(),
        });
        let (s, _) = next_status(&s, &o, t(2));
        assert_eq!(progressing(&s), ("False", "NewMachineFailed"));
        let msg = &s
            .conditions
            .iter()
            .find(|c| c.type_ == PROGRESSING)
            .expect("c")
            .message;
        assert!(
            msg.contains("pool-x") && msg.contains("CreationTimeout"),
            "{msg}"
        );
    }
}
