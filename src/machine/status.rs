//! Building a Machine's next status from its current one. Pure: the
//! reconciler writes the result only when it differs, so a reconcile that
//! changes nothing writes nothing (and wakes nothing).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::api::RemediationStep;
use crate::api::conditions::{NODE_HEALTHY, REMEDIATION};
use crate::api::{LastOperation, MachinePhase, MachineStatus};

/// What a step reports: it becomes `status.lastOperation` and, when it
/// changes, an Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Report {
    pub(crate) op: &'static str,
    pub(crate) step: &'static str,
    pub(crate) state: State,
    pub(crate) description: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    Processing,
    Waiting,
    Succeeded,
    Failed,
}

impl State {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            State::Processing => "Processing",
            State::Waiting => "Waiting",
            State::Succeeded => "Succeeded",
            State::Failed => "Failed",
        }
    }
}

impl Report {
    pub(crate) fn new(
        op: &'static str,
        step: &'static str,
        state: State,
        description: impl Into<String>,
    ) -> Self {
        Self {
            op,
            step,
            state,
            description: description.into(),
        }
    }

    /// Whether `last` already records this report (time aside).
    pub(crate) fn recorded_in(&self, last: Option<&LastOperation>) -> bool {
        last.is_some_and(|l| {
            l.type_ == self.op
                && l.step == self.step
                && l.state == self.state.as_str()
                && l.description == self.description
        })
    }
}

/// A condition to set: type, status, reason, message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cond {
    pub(crate) type_: &'static str,
    pub(crate) status: bool,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

impl Cond {
    pub(crate) fn new(
        type_: &'static str,
        status: bool,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_,
            status,
            reason,
            message: message.into(),
        }
    }
}

/// The next status: `current` with the phase, conditions and report applied.
/// A condition keeps its `lastTransitionTime` unless its status flips, and
/// `lastOperation.lastUpdateTime` only moves when the report changes.
pub(crate) fn next_status(
    current: &MachineStatus,
    phase: Option<MachinePhase>,
    conditions: &[Cond],
    report: &Report,
    generation: Option<i64>,
    now: Timestamp,
) -> MachineStatus {
    let mut s = current.clone();
    if let Some(p) = phase {
        s.phase = Some(p);
    }
    for c in conditions {
        set_condition(&mut s.conditions, c, generation, now);
    }
    if !report.recorded_in(s.last_operation.as_ref()) {
        s.last_operation = Some(LastOperation {
            type_: report.op.to_string(),
            step: report.step.to_string(),
            state: report.state.as_str().to_string(),
            description: report.description.clone(),
            last_update_time: Time(now),
        });
    }
    s.observed_generation = generation;
    s
}

pub(crate) fn set_condition(
    conds: &mut Vec<Condition>,
    c: &Cond,
    generation: Option<i64>,
    now: Timestamp,
) {
    let status = if c.status { "True" } else { "False" };
    set_condition_status(conds, c, status, generation, now);
}

/// [`set_condition`] with the status as written: `"Unknown"` too.
pub(crate) fn set_condition_status(
    conds: &mut Vec<Condition>,
    c: &Cond,
    status: &str,
    generation: Option<i64>,
    now: Timestamp,
) {
    match conds.iter_mut().find(|x| x.type_ == c.type_) {
        Some(x) => {
            if x.status != status {
                x.last_transition_time = Time(now);
            }
            x.status = status.into();
            x.reason = c.reason.into();
            x.message = c.message.clone();
            x.observed_generation = generation;
        }
        None => conds.push(Condition {
            type_: c.type_.into(),
            status: status.into(),
            reason: c.reason.into(),
            message: c.message.clone(),
            last_transition_time: Time(now),
            observed_generation: generation,
        }),
    }
}

/// The condition of that type, if set.
pub(crate) fn condition<'a>(s: Option<&'a MachineStatus>, type_: &str) -> Option<&'a Condition> {
    s?.conditions.iter().find(|c| c.type_ == type_)
}

/// What the `berth_machines{phase}` and `berth_node_not_ready_machines`
/// gauges show, counted from the Machine cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Gauges {
    /// Machines per phase, in the order of [`MachinePhase::ALL`]; a Machine
    /// without a phase yet counts as `Pending`.
    pub(crate) by_phase: [i64; MachinePhase::ALL.len()],
    /// Running Machines whose `NodeHealthy` condition is `False`.
    pub(crate) node_not_ready: i64,
    /// Machines held from remediation (`RemediationHeld`), then under
    /// remediation by step (Fence, Free, Replace).
    pub(crate) remediation: [i64; 4],
}

/// The states of `berth_remediations`, in the order of
/// [`Gauges::remediation`].
const REMEDIATION_STATES: [&str; 4] = ["held", "fence", "free", "replace"];

impl Gauges {
    pub(crate) fn count<'a>(machines: impl IntoIterator<Item = &'a crate::api::Machine>) -> Self {
        let mut g = Self::default();
        for m in machines {
            let status = m.status.as_ref();
            let phase = status
                .and_then(|s| s.phase)
                .unwrap_or(MachinePhase::Pending);
            if let Some(i) = MachinePhase::ALL.iter().position(|p| *p == phase) {
                g.by_phase[i] += 1;
            }
            let unhealthy = status
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == NODE_HEALTHY))
                .is_some_and(|c| c.status == "False");
            if phase == MachinePhase::Running && unhealthy {
                g.node_not_ready += 1;
            }
            let held = status
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == REMEDIATION))
                .is_some_and(|c| c.reason == "RemediationHeld");
            let state = match status.and_then(|s| s.remediation.as_ref()).map(|r| r.step) {
                _ if phase == MachinePhase::Failed => None,
                Some(RemediationStep::Fence) => Some(1),
                Some(RemediationStep::Free) => Some(2),
                Some(RemediationStep::Replace) => Some(3),
                None if held => Some(0),
                None => None,
            };
            if let Some(i) = state {
                g.remediation[i] += 1;
            }
        }
        g
    }

    pub(crate) fn publish(&self, metrics: &crate::telemetry::Metrics) {
        for (phase, n) in MachinePhase::ALL.iter().zip(self.by_phase) {
            metrics.machines.with_label_values(&[phase.as_str()]).set(n);
        }
        metrics.node_not_ready_machines.set(self.node_not_ready);
        for (state, n) in REMEDIATION_STATES.iter().zip(self.remediation) {
            metrics.remediations_now.with_label_values(&[state]).set(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::SignedDuration;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_000_000 + secs).expect("valid")
    }

    #[test]
    fn an_unchanged_report_and_condition_yield_an_identical_status() {
        let r = Report::new("Create", "WaitForNode", State::Waiting, "waiting");
        let c = [Cond::new(
            crate::api::conditions::READY,
            false,
            "NodeNotReady",
            "waiting",
        )];
        let first = next_status(
            &MachineStatus::default(),
            Some(MachinePhase::Creating),
            &c,
            &r,
            Some(1),
            t(0),
        );
        let again = next_status(&first, Some(MachinePhase::Creating), &c, &r, Some(1), t(30));
        assert_eq!(first, again, "nothing to write, nothing to wake");
    }

    #[test]
    fn transition_time_moves_only_when_the_status_flips() {
        let r = Report::new("Create", "x", State::Processing, "");
        let s1 = next_status(
            &MachineStatus::default(),
            None,
            &[Cond::new(crate::api::conditions::READY, false, "A", "a")],
            &r,
            None,
            t(0),
        );
        let s2 = next_status(
            &s1,
            None,
            &[Cond::new(crate::api::conditions::READY, false, "B", "b")],
            &r,
            None,
            t(10),
        );
        assert_eq!(s2.conditions[0].last_transition_time.0, t(0));
        assert_eq!(s2.conditions[0].reason, "B");
        let s3 = next_status(
            &s2,
            None,
            &[Cond::new(crate::api::conditions::READY, true, "C", "c")],
            &r,
            None,
            t(20),
        );
        assert_eq!(s3.conditions[0].last_transition_time.0, t(20));
        assert_eq!(s3.conditions.len(), 1);
        assert_eq!(t(20).duration_since(t(0)), SignedDuration::from_secs(20));
    }

    #[test]
    fn a_new_report_replaces_the_last_operation() {
        let s1 = next_status(
            &MachineStatus::default(),
            None,
            &[],
            &Report::new("Delete", "Cordon", State::Succeeded, "cordoned n1"),
            None,
            t(0),
        );
        let s2 = next_status(
            &s1,
            None,
            &[],
            &Report::new("Delete", "Drain", State::Waiting, "2 pods"),
            None,
            t(5),
        );
        let lo = s2.last_operation.expect("set");
        assert_eq!((lo.step.as_str(), lo.state.as_str()), ("Drain", "Waiting"));
        assert_eq!(lo.last_update_time.0, t(5));
    }

    #[test]
    fn gauges_count_phases_and_unhealthy_running_machines() {
        use crate::api::{Machine, MachineSpec};
        let machine = |phase: Option<MachinePhase>, healthy: Option<bool>| {
            let mut m = Machine::new("m", MachineSpec::default());
            let r = Report::new("x", "y", State::Processing, "");
            let conds: Vec<Cond> = healthy
                .map(|h| Cond::new(NODE_HEALTHY, h, "R", "m"))
                .into_iter()
                .collect();
            m.status = Some(next_status(
                &MachineStatus::default(),
                phase,
                &conds,
                &r,
                None,
                t(0),
            ));
            m
        };
        let ms = [
            Machine::new("no-status", MachineSpec::default()),
            machine(None, None),
            machine(Some(MachinePhase::Running), Some(true)),
            machine(Some(MachinePhase::Running), Some(false)),
            machine(Some(MachinePhase::Terminating), Some(false)),
            machine(Some(MachinePhase::Failed), None),
        ];
        let g = Gauges::count(ms.iter());
        // Pending, Creating, Running, Terminating, Failed
        assert_eq!(g.by_phase, [2, 0, 2, 1, 1]);
        assert_eq!(g.node_not_ready, 1, "only a Running Machine counts");
    }
}
