//! What a lifecycle step records: the phase, the conditions, `status.nodeRef`
//! and the report (`status.lastOperation` and, when it is new, an Event).
//!
//! Pure: the reconciler takes a step, says what came of it (an outcome
//! below), and writes what these functions return; `status::next_status`
//! then folds it into the current status. Nothing here reads a cache or
//! calls the API server.

use std::time::Duration;

use super::decide::{CreationStep, DeletionStep};
use super::status::{Cond, Report, State};
use crate::api::MachinePhase;
use crate::api::conditions::{
    DRAIN_SETTINGS, DRAINED, NODE_HEALTHY, NODE_LOCAL_VOLUMES, READY, VM_REQUESTED,
    VOLUMES_DETACHED,
};

/// What one step writes into a Machine's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StepRecord {
    /// The phase to set; `None` keeps the current one.
    pub(crate) phase: Option<MachinePhase>,
    /// The conditions to set; the others are kept.
    pub(crate) conditions: Vec<Cond>,
    pub(crate) report: Report,
    /// The Node to record in `status.nodeRef`; `None` keeps the current one.
    pub(crate) node_ref: Option<String>,
    /// `status.remediation` to set (`Some(None)` clears it); `None` keeps
    /// it.
    pub(crate) remediation: Option<Option<crate::api::RemediationStatus>>,
}

impl StepRecord {
    /// A record that sets no phase and no condition, only the report.
    pub(crate) fn report(
        op: &'static str,
        step: &'static str,
        state: State,
        what: impl Into<String>,
    ) -> Self {
        Self {
            phase: None,
            conditions: Vec::new(),
            report: Report::new(op, step, state, what),
            node_ref: None,
            remediation: None,
        }
    }

    /// Sets (or, with `None`, clears) `status.remediation`.
    pub(crate) fn remediation(mut self, r: Option<crate::api::RemediationStatus>) -> Self {
        self.remediation = Some(r);
        self
    }

    /// Adds a condition.
    pub(crate) fn with(self, c: Cond) -> Self {
        let mut s = self;
        s.conditions.push(c);
        s
    }

    pub(crate) fn phase(mut self, phase: MachinePhase) -> Self {
        self.phase = Some(phase);
        self
    }

    /// Adds the `NodeLocalVolumes` condition of a drain: False while
    /// `held` says why a pod with node-local volumes is not evicted, True
    /// once pods were evicted with node-local volumes (`lost`, one entry
    /// per PV); nothing when neither.
    pub(crate) fn node_local(self, lost: &[String], held: Option<&str>) -> Self {
        match (held, lost) {
            (Some(why), _) => self.condition(NODE_LOCAL_VOLUMES, false, "EvictionHeld", why),
            (None, []) => self,
            (None, lost) => self.condition(
                NODE_LOCAL_VOLUMES,
                true,
                "DataLost",
                format!(
                    "evicted with node-local volumes (nodeLocalVolumes: Evict); their data stays on the Node and is lost with the VM: {}",
                    lost.join(", ")
                ),
            ),
        }
    }

    fn condition(
        mut self,
        type_: &'static str,
        status: bool,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        self.conditions
            .push(Cond::new(type_, status, reason, message));
        self
    }
}

/// Adds to a deletion step's record what the drain's settings come from:
/// `DrainSettings` False when the class cannot be resolved (`unresolved`),
/// naming why and the settings used instead (`uses`); True again once it
/// can, if the condition said otherwise (`was_false`). A Machine whose
/// class always resolved never gets the condition.
pub(crate) fn with_settings_condition(
    rec: StepRecord,
    unresolved: Option<&Unresolved>,
    was_false: bool,
    uses: &str,
) -> StepRecord {
    match unresolved {
        Some(why) => rec.condition(
            DRAIN_SETTINGS,
            false,
            why.reason,
            settings_message(why, uses),
        ),
        None if was_false => rec.condition(
            DRAIN_SETTINGS,
            true,
            "ClassResolved",
            "the drain uses the MachineClass's settings under the Machine's own",
        ),
        None => rec,
    }
}

/// What the drain of a Machine whose class cannot be resolved (`why`)
/// uses instead (`uses`), for the condition and the Warning.
pub(crate) fn settings_message(why: &Unresolved, uses: &str) -> String {
    format!(
        "{}: the drain uses the Machine's own spec.drain and built-in defaults for the rest ({uses})",
        why.message
    )
}

/// Why a Machine's class, provider or settings cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unresolved {
    /// The condition reason, also the report's step (`ClassNotFound`, ...).
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

/// What a Machine that is not being deleted records when its class cannot
/// be resolved: `Ready` false with the reason, in its current phase
/// (`Pending` if it has none yet).
pub(crate) fn unresolved_record(phase: Option<MachinePhase>, why: &Unresolved) -> StepRecord {
    StepRecord::report("Create", why.reason, State::Failed, why.message.clone())
        .phase(phase.unwrap_or(MachinePhase::Pending))
        .condition(READY, false, why.reason, why.message.clone())
}

/// What a deletion held before `step` records when it cannot tell whose
/// VM `spec.providerID` names (`why`), asked again after `ask_again` or
/// when the class is fixed.
pub(crate) fn owner_unknown_record(
    step: &DeletionStep,
    why: &str,
    ask_again: Option<std::time::Duration>,
) -> StepRecord {
    let again = match ask_again {
        Some(d) => format!("asked again every {}s", d.as_secs()),
        None => "asked again when the class is fixed".to_string(),
    };
    let msg = format!(
        "{why}; berth did not request this VM, so its Node is not cordoned or drained and the VM is not deleted until the provider says it is this Machine's ({again}; remove the finalizer by hand to let the Machine go without them): held before {}",
        step.name()
    );
    StepRecord::report("Delete", "VmOwnerUnknown", State::Waiting, msg)
}

/// What is known, beyond the step, when a creation step is recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CreationContext<'a> {
    /// The provider driver's name.
    pub(crate) provider: &'a str,
    /// `spec.providerID`, empty until the VM exists.
    pub(crate) provider_id: &'a str,
    pub(crate) creation_timeout: Duration,
    pub(crate) health_timeout: Duration,
    /// What the Machine's last operation said (the provider's last answer
    /// while the VM is requested).
    pub(crate) last_operation: &'a str,
}

/// A creation that did not end within the creation timeout, at `step`:
/// the Machine fails, and `Ready` says why.
fn creation_timed_out(step: &'static str, msg: String) -> StepRecord {
    StepRecord::report("Create", step, State::Failed, msg.clone())
        .phase(MachinePhase::Failed)
        .condition(READY, false, "CreationTimeout", msg)
}

/// What a creation step records, before its action (for `CreateVm`: the VM
/// is about to be requested). `StayFailed` records nothing.
pub(crate) fn creation_record(step: &CreationStep, c: &CreationContext<'_>) -> Option<StepRecord> {
    let provider = c.provider;
    let id = c.provider_id;
    Some(match step {
        CreationStep::CreateVm => StepRecord::report(
            "Create",
            "CreateVm",
            State::Processing,
            format!("creating the VM with provider {provider}"),
        )
        .phase(MachinePhase::Creating)
        .condition(READY, false, "Creating", "creating the VM")
        .condition(
            VM_REQUESTED,
            true,
            "Requested",
            format!("the VM was requested from provider {provider}"),
        ),
        CreationStep::WaitForNode { .. } => StepRecord::report(
            "Create",
            "WaitForNode",
            State::Waiting,
            format!("VM {id} exists; waiting for its Node to register and become Ready"),
        )
        .phase(MachinePhase::Creating)
        .condition(
            READY,
            false,
            "WaitingForNode",
            format!("waiting for the Node with providerID {id} to register and become Ready"),
        ),
        CreationStep::FailCreation { .. } => {
            let msg = format!(
                "the Node did not register and become Ready within the creation timeout ({})",
                humantime::format_duration(c.creation_timeout)
            );
            creation_timed_out("WaitForNode", msg)
        }
        CreationStep::VmNotCreated { .. } => {
            let msg = format!(
                "provider {} did not create the VM within the creation timeout ({}); its last answer: {}",
                c.provider,
                humantime::format_duration(c.creation_timeout),
                c.last_operation
            );
            creation_timed_out("CreateVm", msg)
        }
        CreationStep::Running { node } => {
            let msg = format!("Node {node} is Ready");
            let mut r = StepRecord::report("Create", "Running", State::Succeeded, msg.clone())
                .phase(MachinePhase::Running)
                .condition(READY, true, "NodeReady", msg.clone())
                .condition(NODE_HEALTHY, true, "NodeReady", msg);
            r.node_ref = Some(node.clone());
            r
        }
        CreationStep::Unhealthy { node, .. } => {
            let msg = format!(
                "Node {node} has been NotReady for longer than the health timeout ({})",
                humantime::format_duration(c.health_timeout)
            );
            StepRecord::report("Health", "NodeNotReady", State::Failed, msg.clone()).condition(
                NODE_HEALTHY,
                false,
                "NodeNotReady",
                msg,
            )
        }
        CreationStep::StayFailed => return None,
    })
}

/// How often a call the cloud refused for lack of a permission is tried
/// again: the fix (a policy, a Secret) is made outside berth, and no event
/// of berth's says when.
pub(crate) const UNAUTHORIZED_RETRY_MINUTES: u64 = 5;

/// What asking the provider for a VM came to, when it did not give one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum VmAnswer<'a> {
    /// The provider is still at it: what it says.
    InProgress(&'a str),
    /// Refused for good (a permanent error, an invalid providerSpec).
    Refused(&'a str),
    /// Failed for now; the reconcile fails and is retried.
    Failed(&'a str),
    /// The cloud refuses berth's credentials or a permission: retried
    /// slowly, since the fix is made outside berth.
    Unauthorized(&'a str),
}

/// What the `CreateVm` step records after the provider answered without a
/// VM.
pub(crate) fn vm_answer_record(provider: &str, answer: &VmAnswer<'_>) -> StepRecord {
    match answer {
        VmAnswer::InProgress(what) => {
            StepRecord::report("Create", "CreateVm", State::Waiting, *what)
        }
        VmAnswer::Refused(error) => {
            let msg = format!("provider {provider} cannot create the VM: {error}");
            StepRecord::report("Create", "CreateVm", State::Failed, msg.clone())
                .phase(MachinePhase::Failed)
                .condition(READY, false, "CreateFailed", msg)
        }
        VmAnswer::Failed(error) => StepRecord::report(
            "Create",
            "CreateVm",
            State::Failed,
            format!("provider {provider}: {error}; retrying"),
        ),
        VmAnswer::Unauthorized(error) => {
            let msg = format!(
                "provider {provider}: {error}; retrying every {UNAUTHORIZED_RETRY_MINUTES} minutes"
            );
            StepRecord::report("Create", "CreateVm", State::Failed, msg.clone()).condition(
                READY,
                false,
                "ProviderUnauthorized",
                msg,
            )
        }
    }
}

/// Where the drain engine is with a Machine's drain, as the `Drain` step
/// reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DrainView<'a> {
    /// Running and not blocked.
    Running,
    /// Running, blocked by this (a PDB, a pod that will not go).
    Blocked(&'a str),
    /// A pod being deleted is held by a finalizer.
    Held(&'a str),
    /// Ended (drained or forced), yet the step's pods are on the Node:
    /// they came back, and a new drain starts.
    Ended,
    /// Failed: the deadline passed and forcing is not allowed.
    Failed(&'a str),
}

/// What taking a deletion step came to, beyond the step itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DeletionOutcome<'a> {
    /// Taken, or still awaited, as decided.
    AsDecided,
    /// `Drain`: the drain engine's view of it.
    Drain(DrainView<'a>),
    /// `DeleteVmAndNode`, first: the Node never registered, so nothing
    /// was drained.
    DrainSkipped,
    /// `DeleteVmAndNode`: no VM was ever requested, so none is deleted.
    NoVm,
    /// `DeleteVmAndNode`: a VM may exist but the class cannot be resolved;
    /// the finalizer stays.
    Unresolved(&'a Unresolved),
    /// `DeleteVmAndNode`: the provider is still deleting the VM.
    VmDeleteInProgress(&'a str),
    /// `DeleteVmAndNode`: the provider refuses to delete the VM.
    VmDeleteRefused { provider: &'a str, error: &'a str },
    /// `DeleteVmAndNode`, before the VM is deleted: these volumes are still
    /// attached to its Node, for the reason `why`.
    VolumesLeft {
        volumes: &'a [String],
        why: &'a str,
        /// Whether the Node object exists to be tainted out of service.
        node_exists: bool,
    },
    /// `DeleteVmAndNode`, the VM gone: its Node is tainted out of service
    /// and these volumes are waited for, until `until`.
    ReleasingVolumes {
        volumes: &'a [String],
        until: &'a str,
    },
}

/// The reasons of the `VolumesDetached` condition while volumes left at
/// the VM's deletion are reported and released: each is reported once.
pub(crate) const VOLUMES_LEFT_REASONS: [&str; 2] = ["VolumesLeftAttached", "ReleasingVolumes"];

/// The taint of non-graceful node shutdown (GA in Kubernetes 1.28): on a
/// Node whose machine is known to be off, the attach-detach controller
/// detaches its volumes at once instead of after its 6-minute force-detach
/// wait, and the pod garbage collector deletes its terminating pods.
pub(crate) const OUT_OF_SERVICE_TAINT: &str = "node.kubernetes.io/out-of-service";

/// The Warning, and the condition message, for volumes still attached to
/// Node `node` when its VM is deleted.
pub(crate) fn volumes_left_message(
    node: &str,
    volumes: &[String],
    why: &str,
    node_exists: bool,
) -> String {
    let then = if node_exists {
        format!(
            "once the VM is gone, berth taints the Node {OUT_OF_SERVICE_TAINT} so that they are released at once, and deletes the Node after"
        )
    } else {
        "the Node object is gone, so there is no Node to taint out of service: the attach-detach controller releases them after its own force-detach wait (about 6 minutes)".to_string()
    };
    format!(
        "{} still attached to Node {node} as its VM is deleted ({why}): {}; whatever their pods did not flush is lost with the VM; {then}",
        plural(volumes.len(), "volume"),
        volumes.join(", ")
    )
}

fn plural(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// What a deletion step records. An outcome that does not belong to the
/// step records the step as decided.
pub(crate) fn deletion_record(step: &DeletionStep, outcome: &DeletionOutcome<'_>) -> StepRecord {
    let name = step.name();
    match step {
        DeletionStep::MarkTerminating => {
            StepRecord::report("Delete", name, State::Processing, "deletion requested")
                .phase(MachinePhase::Terminating)
        }
        DeletionStep::WaitPreDrainHooks(hooks) | DeletionStep::WaitPreTerminateHooks(hooks) => {
            StepRecord::report(
                "Delete",
                name,
                State::Waiting,
                format!(
                    "waiting for the lifecycle hooks to be removed: {}",
                    hooks.join(", ")
                ),
            )
        }
        DeletionStep::Cordon { node } => StepRecord::report(
            "Delete",
            name,
            State::Succeeded,
            format!("cordoned Node {node}"),
        ),
        DeletionStep::ForceDeletePods { node, pods } => StepRecord::report(
            "Delete",
            name,
            State::Processing,
            format!(
                "force-deleting {} pods on Node {node} (forced deletion)",
                pods.len()
            ),
        ),
        DeletionStep::Drain { node, pods } => drain_record(name, node, pods, outcome),
        DeletionStep::WaitVolumesDetached { node, attachments } => {
            let msg = format!(
                "waiting for {} VolumeAttachments to leave Node {node}: {}",
                attachments.len(),
                attachments.join(", ")
            );
            StepRecord::report("Delete", name, State::Waiting, msg.clone())
                .condition(
                    DRAINED,
                    true,
                    "Drained",
                    format!("no pod left to drain on Node {node}"),
                )
                .condition(VOLUMES_DETACHED, false, "Detaching", msg)
        }
        DeletionStep::DeleteVmAndNode { node } => {
            vm_and_node_record(name, node.as_deref(), outcome)
        }
    }
}

/// The drain step: its report changes only when the drain gets blocked,
/// held, fails or ends (its progress is the engine's `status.drain`).
fn drain_record(
    name: &'static str,
    node: &str,
    pods: &[String],
    outcome: &DeletionOutcome<'_>,
) -> StepRecord {
    let view = match outcome {
        DeletionOutcome::Drain(v) => v,
        _ => &DrainView::Running,
    };
    let (reason, state, msg) = match view {
        DrainView::Failed(message) => ("DrainFailed", State::Failed, message.to_string()),
        DrainView::Ended => (
            "PodsReturned",
            State::Processing,
            format!(
                "pods came back to Node {node}: {}; draining again",
                pods.join(", ")
            ),
        ),
        // The running drain's details live in `status.drain`,
        // written by the engine; the step's report changes only
        // when the drain gets blocked or unblocked, so progress
        // costs no Event and no second status write.
        DrainView::Blocked(by) => (
            "EvictionBlocked",
            State::Waiting,
            format!("draining Node {node}: blocked: {by}"),
        ),
        DrainView::Held(by) => (
            "PodHeldByFinalizer",
            State::Waiting,
            format!("draining Node {node}: {by}"),
        ),
        DrainView::Running => (
            "Draining",
            State::Processing,
            format!("draining Node {node} (progress in status.drain)"),
        ),
    };
    StepRecord::report("Delete", name, state, msg.clone()).condition(DRAINED, false, reason, msg)
}

/// The last step, by what came of it: the VM and the Node deleted, or
/// what keeps them.
fn vm_and_node_record(
    name: &'static str,
    node: Option<&str>,
    outcome: &DeletionOutcome<'_>,
) -> StepRecord {
    match outcome {
        DeletionOutcome::DrainSkipped => StepRecord::report(
            "Delete",
            "SkipDrain",
            State::Succeeded,
            "the Node never registered: no drain",
        )
        .condition(
            DRAINED,
            true,
            "NoNode",
            "the Node never registered: nothing to drain",
        ),
        DeletionOutcome::NoVm => StepRecord::report(
            "Delete",
            "DeleteVmAndNode",
            State::Succeeded,
            "no VM was ever requested: nothing to delete",
        ),
        DeletionOutcome::Unresolved(why) => StepRecord::report(
            "Delete",
            name,
            State::Failed,
            format!("cannot delete the VM: {}", why.message),
        )
        .condition(READY, false, why.reason, why.message.clone()),
        DeletionOutcome::VmDeleteInProgress(what) => {
            StepRecord::report("Delete", name, State::Waiting, *what)
        }
        DeletionOutcome::VmDeleteRefused { provider, error } => StepRecord::report(
            "Delete",
            name,
            State::Failed,
            format!("provider {provider} cannot delete the VM: {error}"),
        ),
        DeletionOutcome::VolumesLeft {
            volumes,
            why,
            node_exists,
        } => {
            let node = node.unwrap_or("(gone)");
            let msg = volumes_left_message(node, volumes, why, *node_exists);
            StepRecord::report("Delete", name, State::Processing, msg.clone()).condition(
                VOLUMES_DETACHED,
                false,
                VOLUMES_LEFT_REASONS[0],
                msg,
            )
        }
        DeletionOutcome::ReleasingVolumes { volumes, until } => {
            let node = node.unwrap_or("(gone)");
            let msg = format!(
                "the VM is gone; Node {node} is tainted {OUT_OF_SERVICE_TAINT}, so that the attach-detach controller releases {} still attached: {}; the Node is deleted once they are released, or at {until}",
                volumes.len(),
                volumes.join(", ")
            );
            StepRecord::report("Delete", name, State::Waiting, msg.clone()).condition(
                VOLUMES_DETACHED,
                false,
                VOLUMES_LEFT_REASONS[1],
                msg,
            )
        }
        DeletionOutcome::AsDecided | DeletionOutcome::Drain(_) => StepRecord::report(
            "Delete",
            "DeleteVmAndNode",
            State::Succeeded,
            match node {
                Some(n) => format!("VM deleted, Node {n} deleted"),
                None => "VM deleted".to_string(),
            },
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unresolved_class_is_named_with_the_settings_the_drain_uses() {
        let base = || StepRecord::report("Delete", "Drain", State::Processing, "draining");
        let why = Unresolved {
            reason: "ClassNotFound",
            message: "MachineClass \"gone\" does not exist".into(),
        };
        let r = with_settings_condition(base(), Some(&why), false, "timeout 2h");
        assert_eq!(r.conditions.len(), 1);
        let c = &r.conditions[0];
        assert_eq!(
            (c.type_, c.status, c.reason),
            (DRAIN_SETTINGS, false, "ClassNotFound")
        );
        assert!(
            c.message.contains("Machine's own spec.drain"),
            "{}",
            c.message
        );
        assert!(c.message.contains("timeout 2h"), "{}", c.message);
        let fixed = with_settings_condition(base(), None, true, "");
        assert_eq!(
            (fixed.conditions[0].status, fixed.conditions[0].reason),
            (true, "ClassResolved")
        );
        assert!(
            with_settings_condition(base(), None, false, "")
                .conditions
                .is_empty(),
            "a class that always resolved adds nothing"
        );
    }

    const MIN: Duration = Duration::from_secs(60);

    /// A record as a tuple that reads in a table: phase, conditions as
    /// `(type, status, reason)`, `(op, step, state)`, description.
    type Row = (
        Option<MachinePhase>,
        Vec<(&'static str, bool, &'static str)>,
        (&'static str, &'static str, &'static str),
        String,
    );

    fn row(r: &StepRecord) -> Row {
        (
            r.phase,
            r.conditions
                .iter()
                .map(|c| (c.type_, c.status, c.reason))
                .collect(),
            (r.report.op, r.report.step, r.report.state.as_str()),
            r.report.description.clone(),
        )
    }

    fn ctx() -> CreationContext<'static> {
        CreationContext {
            provider: "fake",
            provider_id: "fake:///ns/m",
            creation_timeout: 20 * MIN,
            health_timeout: 10 * MIN,
            last_operation: "provider fake: quota; retrying",
        }
    }

    #[test]
    fn every_creation_step_records_its_phase_conditions_and_report() {
        use MachinePhase::{Creating, Failed, Running};
        let cases: Vec<(CreationStep, Option<Row>)> =
            vec![
            (
                CreationStep::CreateVm,
                Some((
                    Some(Creating),
                    vec![(READY, false, "Creating"), (VM_REQUESTED, true, "Requested")],
                    ("Create", "CreateVm", "Processing"),
                    "creating the VM with provider fake".into(),
                )),
            ),
            (
                CreationStep::WaitForNode { retry_in: MIN },
                Some((
                    Some(Creating),
                    vec![(READY, false, "WaitingForNode")],
                    ("Create", "WaitForNode", "Waiting"),
                    "VM fake:///ns/m exists; waiting for its Node to register and become Ready"
                        .into(),
                )),
            ),
            (
                CreationStep::FailCreation { waited: 20 * MIN },
                Some((
                    Some(Failed),
                    vec![(READY, false, "CreationTimeout")],
                    ("Create", "WaitForNode", "Failed"),
                    "the Node did not register and become Ready within the creation timeout (20m)"
                        .into(),
                )),
            ),
            (
                CreationStep::VmNotCreated { waited: 20 * MIN },
                Some((
                    Some(Failed),
                    vec![(READY, false, "CreationTimeout")],
                    ("Create", "CreateVm", "Failed"),
                    "provider fake did not create the VM within the creation timeout (20m); its last answer: provider fake: quota; retrying"
                        .into(),
                )),
            ),
            (
                CreationStep::Running { node: "n1".into() },
                Some((
                    Some(Running),
                    vec![(READY, true, "NodeReady"), (NODE_HEALTHY, true, "NodeReady")],
                    ("Create", "Running", "Succeeded"),
                    "Node n1 is Ready".into(),
                )),
            ),
            (
                CreationStep::Unhealthy {
                    node: "n1".into(),
                    not_ready_for: 11 * MIN,
                },
                Some((
                    None,
                    vec![(NODE_HEALTHY, false, "NodeNotReady")],
                    ("Health", "NodeNotReady", "Failed"),
                    "Node n1 has been NotReady for longer than the health timeout (10m)".into(),
                )),
            ),
            (CreationStep::StayFailed, None),
        ];
        for (step, want) in cases {
            let got = creation_record(&step, &ctx());
            assert_eq!(got.as_ref().map(row), want, "{step:?}");
        }
    }

    #[test]
    fn only_a_running_machine_records_its_node() {
        let running = creation_record(&CreationStep::Running { node: "n1".into() }, &ctx());
        assert_eq!(running.and_then(|r| r.node_ref).as_deref(), Some("n1"));
        let waiting = creation_record(&CreationStep::WaitForNode { retry_in: MIN }, &ctx());
        assert_eq!(waiting.and_then(|r| r.node_ref), None);
    }

    #[test]
    fn the_providers_answers_without_a_vm() {
        let cases = [
            (
                VmAnswer::InProgress("VM i-1 is pending"),
                (
                    None,
                    vec![],
                    ("Create", "CreateVm", "Waiting"),
                    "VM i-1 is pending".to_string(),
                ),
            ),
            (
                VmAnswer::Refused("no such image"),
                (
                    Some(MachinePhase::Failed),
                    vec![(READY, false, "CreateFailed")],
                    ("Create", "CreateVm", "Failed"),
                    "provider fake cannot create the VM: no such image".into(),
                ),
            ),
            (
                VmAnswer::Failed("timed out"),
                (
                    None,
                    vec![],
                    ("Create", "CreateVm", "Failed"),
                    "provider fake: timed out; retrying".into(),
                ),
            ),
        ];
        for (answer, want) in cases {
            assert_eq!(row(&vm_answer_record("fake", &answer)), want, "{answer:?}");
        }
    }

    #[test]
    fn an_unresolved_class_keeps_the_phase_and_says_why() {
        let why = Unresolved {
            reason: "ClassNotFound",
            message: "MachineClass \"x\" does not exist".into(),
        };
        let want = |phase| {
            (
                Some(phase),
                vec![(READY, false, "ClassNotFound")],
                ("Create", "ClassNotFound", "Failed"),
                "MachineClass \"x\" does not exist".to_string(),
            )
        };
        assert_eq!(
            row(&unresolved_record(None, &why)),
            want(MachinePhase::Pending)
        );
        assert_eq!(
            row(&unresolved_record(Some(MachinePhase::Running), &why)),
            want(MachinePhase::Running)
        );
    }

    #[test]
    fn volumes_left_at_the_vms_deletion_are_named_then_released() {
        let step = DeletionStep::DeleteVmAndNode {
            node: Some("n1".into()),
        };
        let volumes = ["pv-a".to_string(), "pv-b".to_string()];
        let left = deletion_record(
            &step,
            &DeletionOutcome::VolumesLeft {
                volumes: &volumes,
                why: "not detached within volumeDetachTimeout, 5m",
                node_exists: true,
            },
        );
        let c = &left.conditions[0];
        assert_eq!(
            (c.type_, c.status, c.reason),
            (VOLUMES_DETACHED, false, VOLUMES_LEFT_REASONS[0])
        );
        for needle in [
            "2 volumes",
            "pv-a, pv-b",
            "Node n1",
            "volumeDetachTimeout",
            OUT_OF_SERVICE_TAINT,
        ] {
            assert!(c.message.contains(needle), "{needle}: {}", c.message);
        }
        let gone = volumes_left_message("n1", &volumes[..1], "the deletion is forced", false);
        assert!(gone.starts_with("1 volume still attached"), "{gone}");
        assert!(gone.contains("no Node to taint"), "{gone}");

        let releasing = deletion_record(
            &step,
            &DeletionOutcome::ReleasingVolumes {
                volumes: &volumes,
                until: "2026-11-23T10:00:00Z",
            },
        );
        let c = &releasing.conditions[0];
        assert_eq!(
            (c.type_, c.status, c.reason),
            (VOLUMES_DETACHED, false, VOLUMES_LEFT_REASONS[1])
        );
        assert!(c.message.contains("2026-11-23T10:00:00Z"), "{}", c.message);
        assert_eq!(releasing.report.state, State::Waiting);
    }

    #[test]
    fn node_local_volumes_are_named_in_a_condition() {
        let base = || StepRecord::report("Delete", "Drain", State::Processing, "x");
        let lost = [
            "PV pv-a (pod db/a)".to_string(),
            "PV pv-b (pod db/b)".to_string(),
        ];
        let cases = [
            (base().node_local(&[], None), None),
            (
                base().node_local(&lost, None),
                Some((
                    true,
                    "DataLost",
                    "lost with the VM: PV pv-a (pod db/a), PV pv-b (pod db/b)",
                )),
            ),
            (
                base().node_local(&lost, Some("annotate it")),
                Some((false, "EvictionHeld", "annotate it")),
            ),
        ];
        for (rec, want) in cases {
            let got = rec
                .conditions
                .iter()
                .find(|c| c.type_ == NODE_LOCAL_VOLUMES)
                .map(|c| (c.status, c.reason, c.message.clone()));
            match (got, want) {
                (None, None) => {}
                (Some((status, reason, message)), Some((s, r, m))) => {
                    assert_eq!((status, reason), (s, r));
                    assert!(message.contains(m), "{message:?} lacks {m:?}");
                }
                (got, want) => panic!("{got:?} vs {want:?}"),
            }
        }
    }

    #[test]
    fn every_deletion_step_records_its_phase_conditions_and_report() {
        use DeletionOutcome as O;
        let why = Unresolved {
            reason: "UnknownProvider",
            message: "no provider aws".into(),
        };
        let drain = || DeletionStep::Drain {
            node: "n1".into(),
            pods: vec!["ns/a".into(), "ns/b".into()],
        };
        let delete = |node: Option<&str>| DeletionStep::DeleteVmAndNode {
            node: node.map(str::to_string),
        };
        let hooks = vec!["pre-drain.delete.hook.berth.dev/x".to_string()];
        let cases: Vec<(DeletionStep, DeletionOutcome<'_>, Row)> = vec![
            (
                DeletionStep::MarkTerminating,
                O::AsDecided,
                (
                    Some(MachinePhase::Terminating),
                    vec![],
                    ("Delete", "MarkTerminating", "Processing"),
                    "deletion requested".into(),
                ),
            ),
            (
                DeletionStep::WaitPreDrainHooks(hooks.clone()),
                O::AsDecided,
                (
                    None,
                    vec![],
                    ("Delete", "WaitPreDrainHooks", "Waiting"),
                    "waiting for the lifecycle hooks to be removed: \
                     pre-drain.delete.hook.berth.dev/x"
                        .into(),
                ),
            ),
            (
                DeletionStep::Cordon { node: "n1".into() },
                O::AsDecided,
                (
                    None,
                    vec![],
                    ("Delete", "Cordon", "Succeeded"),
                    "cordoned Node n1".into(),
                ),
            ),
            (
                DeletionStep::ForceDeletePods {
                    node: "n1".into(),
                    pods: vec!["ns/a".into()],
                },
                O::AsDecided,
                (
                    None,
                    vec![],
                    ("Delete", "ForceDeletePods", "Processing"),
                    "force-deleting 1 pods on Node n1 (forced deletion)".into(),
                ),
            ),
            (
                drain(),
                O::Drain(DrainView::Running),
                (
                    None,
                    vec![(DRAINED, false, "Draining")],
                    ("Delete", "Drain", "Processing"),
                    "draining Node n1 (progress in status.drain)".into(),
                ),
            ),
            (
                drain(),
                O::Drain(DrainView::Blocked("PDB ns/db allows no disruption")),
                (
                    None,
                    vec![(DRAINED, false, "EvictionBlocked")],
                    ("Delete", "Drain", "Waiting"),
                    "draining Node n1: blocked: PDB ns/db allows no disruption".into(),
                ),
            ),
            (
                drain(),
                O::Drain(DrainView::Held("pod ns/x is held by finalizer f")),
                (
                    None,
                    vec![(DRAINED, false, "PodHeldByFinalizer")],
                    ("Delete", "Drain", "Waiting"),
                    "draining Node n1: pod ns/x is held by finalizer f".into(),
                ),
            ),
            (
                drain(),
                O::Drain(DrainView::Ended),
                (
                    None,
                    vec![(DRAINED, false, "PodsReturned")],
                    ("Delete", "Drain", "Processing"),
                    "pods came back to Node n1: ns/a, ns/b; draining again".into(),
                ),
            ),
            (
                drain(),
                O::Drain(DrainView::Failed("deadline passed; 1 pod left")),
                (
                    None,
                    vec![(DRAINED, false, "DrainFailed")],
                    ("Delete", "Drain", "Failed"),
                    "deadline passed; 1 pod left".into(),
                ),
            ),
            (
                DeletionStep::WaitVolumesDetached {
                    node: "n1".into(),
                    attachments: vec!["csi-1".into(), "csi-2".into()],
                },
                O::AsDecided,
                (
                    None,
                    vec![
                        (DRAINED, true, "Drained"),
                        (VOLUMES_DETACHED, false, "Detaching"),
                    ],
                    ("Delete", "WaitVolumesDetached", "Waiting"),
                    "waiting for 2 VolumeAttachments to leave Node n1: csi-1, csi-2".into(),
                ),
            ),
            (
                DeletionStep::WaitPreTerminateHooks(vec![
                    "pre-terminate.delete.hook.berth.dev/y".into(),
                ]),
                O::AsDecided,
                (
                    None,
                    vec![],
                    ("Delete", "WaitPreTerminateHooks", "Waiting"),
                    "waiting for the lifecycle hooks to be removed: \
                     pre-terminate.delete.hook.berth.dev/y"
                        .into(),
                ),
            ),
            (
                delete(None),
                O::DrainSkipped,
                (
                    None,
                    vec![(DRAINED, true, "NoNode")],
                    ("Delete", "SkipDrain", "Succeeded"),
                    "the Node never registered: no drain".into(),
                ),
            ),
            (
                delete(None),
                O::NoVm,
                (
                    None,
                    vec![],
                    ("Delete", "DeleteVmAndNode", "Succeeded"),
                    "no VM was ever requested: nothing to delete".into(),
                ),
            ),
            (
                delete(Some("n1")),
                O::Unresolved(&why),
                (
                    None,
                    vec![(READY, false, "UnknownProvider")],
                    ("Delete", "DeleteVm", "Failed"),
                    "cannot delete the VM: no provider aws".into(),
                ),
            ),
            (
                delete(Some("n1")),
                O::VmDeleteInProgress("VM i-1 is shutting down"),
                (
                    None,
                    vec![],
                    ("Delete", "DeleteVm", "Waiting"),
                    "VM i-1 is shutting down".into(),
                ),
            ),
            (
                delete(Some("n1")),
                O::VmDeleteRefused {
                    provider: "aws",
                    error: "permission denied",
                },
                (
                    None,
                    vec![],
                    ("Delete", "DeleteVm", "Failed"),
                    "provider aws cannot delete the VM: permission denied".into(),
                ),
            ),
            (
                delete(Some("n1")),
                O::AsDecided,
                (
                    None,
                    vec![],
                    ("Delete", "DeleteVmAndNode", "Succeeded"),
                    "VM deleted, Node n1 deleted".into(),
                ),
            ),
            (
                delete(None),
                O::AsDecided,
                (
                    None,
                    vec![],
                    ("Delete", "DeleteVmAndNode", "Succeeded"),
                    "VM deleted".into(),
                ),
            ),
        ];
        for (step, outcome, want) in cases {
            assert_eq!(
                row(&deletion_record(&step, &outcome)),
                want,
                "{step:?} {outcome:?}"
            );
        }
    }

    #[test]
    fn a_drain_without_the_engines_view_reads_as_running() {
        let step = DeletionStep::Drain {
            node: "n1".into(),
            pods: vec![],
        };
        assert_eq!(
            deletion_record(&step, &DeletionOutcome::AsDecided),
            deletion_record(&step, &DeletionOutcome::Drain(DrainView::Running))
        );
    }
}
