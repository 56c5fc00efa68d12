//! The deletion of a Machine, in the shape of Karpenter's termination:
//! [`observe`] gathers once every fact a step needs (the caches, the
//! drain's progress, what the Machine's conditions say), `decide` chooses
//! the [`DeletionStep`], and one function per step acts and records it.
//! Every step is idempotent: a reconcile cut short anywhere takes it again.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};

use super::Context;
use super::commit::{Next, Recorded, Write, elapsed_since, event, record, truncate};
use super::decide::{self, DeletionFacts, DeletionStep, NodeFacts, next_deletion_step};
use super::error::{Error, Step, at};
use super::lookup::{
    Resolved, VmOwner, find_node, node_from_api, node_name_taken, resolve_machine, vm_owner,
};
use super::node;
use super::record::{
    DeletionOutcome, DrainView, StepRecord, Unresolved, VOLUMES_LEFT_REASONS, deletion_record,
    owner_unknown_record, settings_message, with_settings_condition,
};
use super::status::condition;
use crate::api::conditions::{DRAIN_SETTINGS, VM_REQUESTED, VOLUMES_DETACHED};
use crate::api::settings::{ResolvedSettings, resolve};
use crate::api::{FORCE_DELETION_LABEL, Machine, PRE_DRAIN_HOOK_PREFIX, PRE_TERMINATE_HOOK_PREFIX};
use crate::api::{VolumeMove, cordoned_at};
use crate::drain::deadline::{Deadline, released};
use crate::drain::engine::{Job, Outcome, Progress, RESTART_ENDED_AFTER, RETRY_FAILED_AFTER};
use crate::drain::pod_writes::Evicted;
use crate::drain::select::{Arrivals, came_back};
use crate::providers::ProviderError;

mod termination;
use termination::await_instance_termination;

/// Steps of a deletion taken in one reconcile at most: marking the Machine
/// Terminating, cordoning its Node, starting the drain.
const STEPS_PER_RECONCILE: usize = 3;

/// What one deletion step left to do.
enum Stepped {
    /// Stop here.
    Stop(Next),
    /// The step wrote what the next one reads: go on from these copies
    /// rather than wait for the watches to bring them back.
    Advanced {
        machine: Option<Box<Machine>>,
        node: Option<Arc<Node>>,
    },
}

impl From<Next> for Stepped {
    fn from(next: Next) -> Self {
        Stepped::Stop(next)
    }
}

/// The deletion, one step after another. The first steps (marking the
/// Machine Terminating, cordoning its Node) are each followed at once by
/// the next, on the objects the API server answered with: with many
/// Machines deleted together, a wait for each write's watch event and a
/// turn in the work queue between steps would delay every drain's first
/// eviction by seconds.
pub(super) async fn cleanup(m: &Machine, ctx: &Context) -> Result<Next, Error> {
    let mut machine = Cow::Borrowed(m);
    let mut node = None;
    for _ in 0..STEPS_PER_RECONCILE {
        match cleanup_step(&machine, node.take(), ctx).await? {
            Stepped::Stop(next) => return Ok(next),
            Stepped::Advanced {
                machine: written,
                node: n,
            } => {
                if let Some(w) = written {
                    machine = Cow::Owned(*w);
                }
                node = n;
            }
        }
    }
    // The writes above wake this Machine again.
    Ok(Next::Wait(Action::await_change()))
}

/// Takes the next deletion step. `known_node` is a fresher copy of the
/// Machine's Node than the cache's, when a previous step wrote it.
async fn cleanup_step(
    m: &Machine,
    known_node: Option<Arc<Node>>,
    ctx: &Context,
) -> Result<Stepped, Error> {
    let o = observe(m, known_node, ctx).await?;
    let step = next_deletion_step(&o.facts);
    // What the drain found about node-local volumes outlives its step.
    let as_decided = match &o.progress {
        Some(p) => deletion_record(&step, &DeletionOutcome::AsDecided)
            .node_local(&p.node_local_lost, p.local_held.as_deref()),
        None => deletion_record(&step, &DeletionOutcome::AsDecided),
    };
    if let VmOwner::Unknown { why, ask_again } = &o.owner
        && step.touches_node_or_vm()
    {
        return Ok(hold_unknown_owner(ctx, m, &step, why, *ask_again)
            .await?
            .into());
    }
    // Past its drain, the Node says it is drained (KEP-5683), whatever
    // the step's own record says.
    if let DeletionStep::WaitPreTerminateHooks(_) | DeletionStep::DeleteVmAndNode { .. } = &step
        && let Some(node) = &o.node
        && o.progress.is_some()
    {
        let want = super::lifecycle::drained(&node.name_any());
        super::commit::write_node_lifecycle(ctx, node, &want).await?;
    }
    match &step {
        DeletionStep::MarkTerminating => mark_terminating(ctx, m, &as_decided, o.node).await,
        DeletionStep::WaitPreDrainHooks(_) | DeletionStep::WaitPreTerminateHooks(_) => {
            Ok(await_change(ctx, m, &as_decided).await?.into())
        }
        DeletionStep::Cordon { .. } => cordon(ctx, m, &as_decided, o.node).await,
        DeletionStep::ForceDeletePods { pods, .. } => {
            force_delete_pods(
                ctx,
                m,
                pods,
                &as_decided,
                o.settings.volume_reattach_timeout,
            )
            .await
        }
        DeletionStep::Drain { node, pods } => {
            Ok(await_drain(ctx, m, &o, &step, node, !pods.is_empty())
                .await?
                .into())
        }
        DeletionStep::WaitVolumesDetached { .. } => {
            Ok(await_volume_detachment(ctx, m, &o, &as_decided)
                .await?
                .into())
        }
        DeletionStep::DeleteVmAndNode { .. } => {
            Ok(await_instance_termination(ctx, m, o, &step).await?.into())
        }
    }
}

/// Every fact a deletion step reads, gathered once per step.
struct Observed {
    /// Whose VM `spec.providerID` names (see [`VmOwner`]): another's, and
    /// its Node and VM are left alone; unknown, and the deletion waits
    /// before it touches either.
    owner: VmOwner,
    /// The Machine's class, driver and settings, or why they cannot be had.
    resolved: Result<Resolved, Unresolved>,
    /// The drain settings that apply (the Machine's own over the defaults
    /// when its class cannot be resolved: they are never silently dropped).
    settings: ResolvedSettings,
    /// The Machine's Node, if it exists.
    node: Option<Arc<Node>>,
    /// Its name, when the Node object is gone while the VM may still run:
    /// the name still finds the pods and attachments (by spec.nodeName).
    node_gone: Option<String>,
    /// From the deletion request on.
    deadline: Option<Deadline>,
    /// The volumes attached to the Node, as an operator knows them: the PV,
    /// or the attachment of an inline volume.
    volumes: Vec<String>,
    /// The Machine's `VolumesDetached` condition, read once.
    detach: DetachState,
    /// The drain's progress, if it ran or runs.
    progress: Option<Progress>,
    facts: DeletionFacts,
}

/// What the `VolumesDetached` condition says.
#[derive(Debug, Clone, Copy, Default)]
struct DetachState {
    /// How long the volumes have been waited for (the condition is False).
    waited: Option<Duration>,
    /// Since when they have been, if ever.
    since: Option<Timestamp>,
    /// The volumes left attached as the VM goes were reported already.
    left_reported: bool,
    /// They were left to be released by the out-of-service taint.
    releasing: bool,
}

impl DetachState {
    fn of(m: &Machine) -> Self {
        let Some(c) = condition(m.status.as_ref(), VOLUMES_DETACHED) else {
            return Self::default();
        };
        let waiting = c.status == "False";
        Self {
            waited: waiting.then(|| elapsed_since(Some(&c.last_transition_time))),
            since: Some(c.last_transition_time.0),
            left_reported: waiting && VOLUMES_LEFT_REASONS.contains(&c.reason.as_str()),
            releasing: c.reason == VOLUMES_LEFT_REASONS[1],
        }
    }
}

async fn observe(
    m: &Machine,
    known_node: Option<Arc<Node>>,
    ctx: &Context,
) -> Result<Observed, Error> {
    let resolved = resolve_machine(m, ctx);
    let settings = match &resolved {
        Ok(r) => r.settings.clone(),
        Err(_) => resolve(m.spec.drain.as_ref(), None, None, None).unwrap_or_default(),
    };
    let now = Timestamp::now();
    let owner = vm_owner(m, &resolved, ctx).await;
    let foreign = matches!(owner, VmOwner::Foreign(_));
    let node = match known_node.or_else(|| find_node(m, ctx)) {
        _ if foreign => None,
        Some(n) => Some(n),
        // Deleting needs certainty: a Node missing from the cache is asked
        // for once more before the deletion acts as if it were gone.
        None => node_from_api(m, ctx).await?,
    };
    let node_facts = node.as_deref().map(|n| decide::node_facts(n, now));
    let node_gone = match foreign {
        true => None,
        false => node_gone(m, ctx, &resolved, node_facts.as_ref()).await,
    };
    let node_name = node_facts
        .as_ref()
        .map(|n| n.name.clone())
        .or_else(|| node_gone.clone());
    let deadline = m
        .metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| Deadline::new(t.0, settings.drain_timeout));
    let (pods_to_drain, pods_on_node) = match &node_name {
        Some(n) => pods_that_hold(m, ctx, n, node.as_deref(), deadline, now),
        None => (vec![], vec![]),
    };
    let (attachments, volumes) = attached(ctx, node_name.as_deref());
    let detach = DetachState::of(m);
    let annotations = m.annotations();
    let facts = DeletionFacts {
        phase: m.status.as_ref().and_then(|s| s.phase),
        // A remediation fenced its VM: nothing on the Node runs.
        force: m
            .labels()
            .get(FORCE_DELETION_LABEL)
            .is_some_and(|v| v == "true")
            || super::remediation::fenced(m),
        pre_drain_hooks: decide::hooks(annotations.keys(), PRE_DRAIN_HOOK_PREFIX),
        pre_terminate_hooks: decide::hooks(annotations.keys(), PRE_TERMINATE_HOOK_PREFIX),
        node: node_facts,
        node_gone: node_gone.clone(),
        pods_to_drain,
        pods_on_node,
        drain_pending: !ctx.drainer.finished(&ObjectRef::from_obj(m)),
        volume_attachments: attachments,
        volume_detach_timed_out: detach
            .waited
            .is_some_and(|w| w >= settings.volume_detach_timeout),
    };
    Ok(Observed {
        owner,
        progress: ctx.drainer.progress(&ObjectRef::from_obj(m)),
        resolved,
        settings,
        node,
        node_gone,
        deadline,
        volumes,
        detach,
        facts,
    })
}

/// The name of the Machine's Node when the Node object is gone while its
/// VM may still run. A Node object gone *with* its VM has nothing left to
/// drain: berth deleted both and was stopped, or its last status write
/// conflicted, before it let the Machine go. The provider is asked once,
/// before a drain starts: the pods still bound to that name are the pod
/// garbage collector's, and evicting them would only disturb their
/// replacements.
async fn node_gone(
    m: &Machine,
    ctx: &Context,
    resolved: &Result<Resolved, Unresolved>,
    node: Option<&NodeFacts>,
) -> Option<String> {
    let vm_requested =
        m.spec.provider_id.is_some() || condition(m.status.as_ref(), VM_REQUESTED).is_some();
    if node.is_some() || !vm_requested {
        return None;
    }
    let name = m.status.as_ref()?.node_ref.as_ref()?.name.clone();
    // Another VM's Node holds the name now: the pods bound to it are its,
    // not this Machine's.
    if let Some(other) = node_name_taken(m, ctx) {
        tracing::warn!(
            node = %name,
            provider_id = ?other.spec.as_ref().and_then(|s| s.provider_id.as_deref()),
            "the Machine's Node is gone and another VM's Node took its name: left alone"
        );
        return None;
    }
    if !ctx.drainer.knows(&ObjectRef::from_obj(m))
        && let Ok(r) = resolved
        && matches!(
            r.provider.get(&r.request).await,
            Err(ProviderError::NotFound(_))
        )
    {
        return None;
    }
    Some(name)
}

/// The pods on Node `node_name` that hold the Machine: those the drain
/// must move, and those the force-deletion label deletes (`namespace/name`).
fn pods_that_hold(
    m: &Machine,
    ctx: &Context,
    node_name: &str,
    node: Option<&Node>,
    deadline: Option<Deadline>,
    now: Timestamp,
) -> (Vec<String>, Vec<String>) {
    // A pod being deleted that cannot go (a finalizer) no longer holds the
    // Machine from the deadline plus its grace period on. Nor does a pod
    // that came back after the cordon: it ends with the VM (the drain
    // reports it). The drain judges those created within the clock skew of
    // the cordon; the reconciler counts only those surely after it, and
    // those the drain judged.
    let cordoned = node.and_then(cordoned_at).or(deadline.map(|d| d.started));
    let machine = ObjectRef::from_obj(m);
    let rules = crate::drain::engine::rule_book(&ctx.caches, &machine);
    let pods: Vec<Arc<Pod>> = ctx
        .caches
        .indexes
        .pods_by_node
        .get(&ctx.caches.pods, node_name)
        .into_iter()
        .filter(|p| !deadline.is_some_and(|d| released(p, &d, now)))
        .filter(|p| {
            let arrivals = cordoned.map(|cordoned_at| Arrivals {
                cordoned_at,
                known: None,
            });
            arrivals.is_none_or(|a| came_back(p, None, &a).is_none())
                && !ctx.drainer.returned(&machine, p)
        })
        .collect();
    // What the force-deletion label deletes: neither the mirror of a
    // static pod nor a DaemonSet's pod (its controller would only recreate
    // it; it ends with the VM), nor a pod force-deleted already (a
    // finalizer holds it: deleting it again would be a request loop).
    let on_node = pods
        .iter()
        .filter(|p| {
            !matches!(
                decide::drain_skip_reason(p, &rules),
                Some("mirror pod" | "DaemonSet pod")
            )
        })
        .filter(|p| p.metadata.deletion_grace_period_seconds != Some(0))
        .map(|p| key(p))
        .collect();
    let to_drain = pods
        .iter()
        .filter(|p| decide::drain_skip_reason(p, &rules).is_none())
        .map(|p| key(p))
        .collect();
    (to_drain, on_node)
}

fn key(p: &Pod) -> String {
    format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any())
}

/// The VolumeAttachments to Node `node_name`, and the same as an operator
/// knows them: the PV, or the attachment of an inline volume.
fn attached(ctx: &Context, node_name: Option<&str>) -> (Vec<String>, Vec<String>) {
    let Some(n) = node_name else {
        return (vec![], vec![]);
    };
    ctx.caches
        .indexes
        .attachments_by_node
        .get(&ctx.caches.attachments, n)
        .iter()
        .map(|va| {
            let volume = va
                .spec
                .source
                .persistent_volume_name
                .clone()
                .unwrap_or_else(|| format!("VolumeAttachment {}", va.name_any()));
            (va.name_any(), volume)
        })
        .unzip()
}

/// Records the step and waits for a change (a hook removed, say).
/// Holds a deletion that cannot tell whose VM `spec.providerID` names
/// before `step`, which would touch its Node or VM: said in the status and
/// a Warning, asked again after `ask_again`, or when the Machine or its
/// class changes.
async fn hold_unknown_owner(
    ctx: &Context,
    m: &Machine,
    step: &DeletionStep,
    why: &str,
    ask_again: Option<Duration>,
) -> Result<Next, Error> {
    let rec = owner_unknown_record(step, why, ask_again);
    let recorded = record(ctx, m, &rec, Write::IfChanged).await?;
    if matches!(recorded, Recorded::Written(_)) {
        warn(ctx, m, "VmOwnerUnknown", rec.report.description.clone());
    }
    Ok(recorded.then(match ask_again {
        Some(d) => Action::requeue(d),
        None => Action::await_change(),
    }))
}

async fn await_change(ctx: &Context, m: &Machine, rec: &StepRecord) -> Result<Next, Error> {
    Ok(record(ctx, m, rec, Write::IfChanged)
        .await?
        .then(Action::await_change()))
}

async fn mark_terminating(
    ctx: &Context,
    m: &Machine,
    rec: &StepRecord,
    node: Option<Arc<Node>>,
) -> Result<Stepped, Error> {
    Ok(match record(ctx, m, rec, Write::IfChanged).await? {
        Recorded::Written(w) => Stepped::Advanced {
            machine: Some(w),
            node,
        },
        Recorded::Unchanged => Next::Wait(Action::await_change()).into(),
        Recorded::Stale => Next::Stale.into(),
    })
}

/// Cordons the Node, and goes on to the next step (starting the drain) at
/// once: the cordon is told by its Event but not written on its own,
/// the next step's record says where the deletion is. Under a saturated
/// API server each write before the drain takes up to a second (the scale
/// benchmark: 0.6 to 1.0 s), and every drain's first eviction waited for
/// this one. Without a Node there is nothing to cordon: recorded, and
/// the Machine waits for a change.
async fn cordon(
    ctx: &Context,
    m: &Machine,
    rec: &StepRecord,
    node: Option<Arc<Node>>,
) -> Result<Stepped, Error> {
    let Some(n) = node else {
        return Ok(await_change(ctx, m, rec).await?.into());
    };
    let cordoned = node::cordon(&ctx.client, &n)
        .await
        .map_err(at(Step::Cordon))?;
    let last = m.status.as_ref().and_then(|s| s.last_operation.as_ref());
    if !rec.report.recorded_in(last) {
        event(ctx, m, &rec.report);
    }
    Ok(Stepped::Advanced {
        machine: None,
        node: Some(Arc::new(cordoned)),
    })
}

/// Deletes `pods` with no grace period (the force-deletion label). Each
/// delete is pinned to the UID the cache shows: a pod that took the same
/// name elsewhere is never touched.
async fn force_delete_pods(
    ctx: &Context,
    m: &Machine,
    pods: &[String],
    rec: &StepRecord,
    reattach: Duration,
) -> Result<Stepped, Error> {
    ctx.drainer.forget(&ObjectRef::from_obj(m));
    let _forcing = ctx.drainer.forcing(&ObjectRef::from_obj(m));
    // Every deletion path goes through the move ledger: each move is
    // asked for (taken past the budget with a Warning) and recorded
    // before its pod goes.
    let forced: Vec<Arc<Pod>> = pods
        .iter()
        .filter_map(|p| p.split_once('/'))
        .filter_map(|(ns, name)| ctx.caches.pods.get(&ObjectRef::new(name).within(ns)))
        .collect();
    ctx.drainer.force_permits(m, &forced, reattach).await;
    for p in pods {
        let Some((ns, name)) = p.split_once('/') else {
            continue;
        };
        let Some(pod) = ctx.caches.pods.get(&ObjectRef::new(name).within(ns)) else {
            continue;
        };
        match crate::drain::pod_writes::delete(&ctx.client, &pod, Some(0)).await {
            Evicted::Accepted | Evicted::Gone => {}
            Evicted::Refused { message }
            | Evicted::Throttled { message, .. }
            | Evicted::MultipleBudgets { message } => {
                tracing::warn!(pod = %p, %message, "force delete refused");
            }
            Evicted::Failed(e) => return Err(at(Step::PodDelete)(e)),
        }
    }
    Ok(await_change(ctx, m, rec).await?.into())
}

/// Starts the drain (or resumes it, or reads its progress) and records
/// where it is. The engine's progress writes and its end wake the Machine;
/// a failed drain is retried after a pause.
async fn await_drain(
    ctx: &Context,
    m: &Machine,
    o: &Observed,
    step: &DeletionStep,
    node: &str,
    pods_left: bool,
) -> Result<Next, Error> {
    let Some(deadline) = o.deadline else {
        return Ok(Next::Wait(Action::await_change()));
    };
    let job = Job {
        machine: ObjectRef::from_obj(m),
        machine_ref: m.object_ref(&()),
        node: node.to_string(),
        settings: o.settings.clone(),
        deadline,
        moves: recorded_moves(m),
        data_loss_allowed: crate::drain::volume_kind::allows_data_loss(
            m.metadata.annotations.as_ref(),
        ),
    };
    if let Some(gone) = &o.node_gone
        && !ctx.drainer.knows(&ObjectRef::from_obj(m))
    {
        warn(
            ctx,
            m,
            "NodeGone",
            format!(
                "the Node object {gone} is gone while its VM may still run: draining its pods by spec.nodeName; the VM is deleted after"
            ),
        );
    }
    let progress = ctx.drainer.ensure(job, pods_left);
    let rec = deletion_record(step, &DeletionOutcome::Drain(drain_view(&progress))).node_local(
        progress.node_local_lost.as_slice(),
        progress.local_held.as_deref(),
    );
    let was_false =
        condition(m.status.as_ref(), DRAIN_SETTINGS).is_some_and(|c| c.status == "False");
    let unresolved = o.resolved.as_ref().err();
    let rec = with_settings_condition(rec, unresolved, was_false, &describe(&o.settings));
    if let Some(why) = unresolved
        && !was_false
    {
        warn(
            ctx,
            m,
            "DrainSettingsFromMachine",
            settings_message(why, &describe(&o.settings)),
        );
    }
    let action = match progress.outcome {
        Some(Outcome::Failed { .. }) => Action::requeue(RETRY_FAILED_AFTER),
        Some(_) if pods_left => Action::requeue(RESTART_ENDED_AFTER),
        _ => Action::await_change(),
    };
    Ok(record(ctx, m, &rec, Write::IfChanged).await?.then(action))
}

/// The volume moves in flight that `status.drain` records.
fn recorded_moves(m: &Machine) -> Vec<VolumeMove> {
    m.status
        .as_ref()
        .and_then(|s| s.drain.as_ref())
        .map(|d| d.moves.clone())
        .unwrap_or_default()
}

/// Waits for the Node's volumes to detach: VolumeAttachment events wake
/// the Machine, and this is the detach deadline.
async fn await_volume_detachment(
    ctx: &Context,
    m: &Machine,
    o: &Observed,
    rec: &StepRecord,
) -> Result<Next, Error> {
    let waited = o.detach.waited.unwrap_or_default();
    let action = Action::requeue(
        o.settings.volume_detach_timeout.saturating_sub(waited) + Duration::from_millis(100),
    );
    Ok(record(ctx, m, rec, Write::IfChanged).await?.then(action))
}

/// Publishes a Warning Event about the Machine, in the background (an
/// Event never holds up a step).
fn warn(ctx: &Context, m: &Machine, reason: &str, note: String) {
    ctx.events.warning(
        m.object_ref(&()),
        "Drain",
        reason,
        truncate(&note, 1000),
        None,
    );
}

/// The drain settings an operator checks first, in words.
fn describe(s: &ResolvedSettings) -> String {
    format!(
        "timeout {}, forceAfterDeadline {}, volumeDetachTimeout {}, volumeReattachTimeout {}",
        humantime::format_duration(s.drain_timeout),
        s.force_after_deadline,
        humantime::format_duration(s.volume_detach_timeout),
        humantime::format_duration(s.volume_reattach_timeout)
    )
}

/// How the `Drain` step reports the engine's progress.
fn drain_view(p: &Progress) -> DrainView<'_> {
    match &p.outcome {
        Some(Outcome::Failed { message }) => DrainView::Failed(message),
        Some(Outcome::Drained | Outcome::Forced { .. }) => DrainView::Ended,
        None => match &p.blocked_by {
            Some(b) if p.held => DrainView::Held(b),
            Some(b) => DrainView::Blocked(b),
            None => DrainView::Running,
        },
    }
}
