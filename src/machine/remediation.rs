//! The remediation of a Running Machine whose Node died, decided by
//! `health` (pure) and taken here, one step a reconcile. Each step is
//! recorded in `status.remediation` before the next is taken, so that a
//! restarted controller resumes it and never takes one twice:
//!
//! 1. *Begin*: the Node has been unhealthy past its duration, the class
//!    or pool asks for `Replace`, and no more Machines of the pool or the
//!    cluster are unhealthy than `maxUnhealthy` allows (else
//!    `RemediationHeld`, and nothing is done).
//! 2. *Fence*: the provider stops (or terminates) the VM, asked again
//!    until it says it has. A Node back before then cancels it; a provider
//!    that cannot stop a VM holds it (`FenceUnsupported`).
//! 3. *Free*: once the move ledger lets every stateful workload on the
//!    Node move (all or none), the Node is tainted
//!    `node.kubernetes.io/out-of-service`, so that its volumes detach at
//!    once, and its pods are deleted (grace 0, each pinned to its UID):
//!    the VM is off, nothing of them runs.
//! 4. *Replace*: the Machine is deleted, its deletion takes the forced
//!    path, and its pool makes a new one; a Machine outside a pool is
//!    marked Failed instead.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;

use super::Context;
use super::commit::{Next, Write, record};
use super::error::{Error, Step, at};
use super::health::{
    FenceTurn, Remediate, RemediationFacts, Share, fence_turn, judge, next_remediation,
};
use super::lookup::Resolved;
use super::record::StepRecord;
use super::status::{Cond, State, condition};
use crate::api::conditions::{NODE_HEALTHY, READY, REMEDIATION};
use crate::api::remediation::{
    ConditionRule, Fence, MaxUnhealthy, RemediationPolicy, RemediationStatus, RemediationStep,
};
use crate::api::{Machine, MachinePhase, owner_ref};
use crate::drain::engine::Freeing;
use crate::drain::pod_writes::Evicted;
use crate::providers::ProviderError;

/// What the remediation made of a reconcile.
pub(super) enum Handled {
    /// Not the remediation's: the creation flow goes on, adding `cond` to
    /// its record and looking again in `recheck_in` at the latest.
    Continue {
        cond: Option<Cond>,
        recheck_in: Option<Duration>,
    },
    /// Taken here.
    Done(Next),
}

impl Handled {
    fn go_on() -> Self {
        Handled::Continue {
            cond: None,
            recheck_in: None,
        }
    }
}

/// A remediation's next step, as judged.
struct Judgement {
    step: Remediate,
    fence: Fence,
    fence_timeout: Duration,
    recorded: Option<RemediationStatus>,
    /// When a failing check will have lasted its duration.
    recheck_in: Option<Duration>,
}

/// Judges the remediation of `m` from the caches: `Err` names an invalid
/// setting; `None` when a remediation is none of its business (a Machine
/// not Running, or Failed).
fn judged(
    m: &Machine,
    ctx: &Context,
    r: &Resolved,
    node: Option<&Node>,
) -> Result<Option<Judgement>, String> {
    let status = m.status.as_ref();
    let recorded = status.and_then(|s| s.remediation.clone());
    let phase = status.and_then(|s| s.phase);
    if phase == Some(MachinePhase::Failed)
        || (recorded.is_none() && phase != Some(MachinePhase::Running))
    {
        return Ok(None);
    }
    let set = owner_ref(m).and_then(|k| ctx.caches.sets.get(&k));
    let settings = crate::api::remediation::resolve(
        set.as_ref().and_then(|s| s.spec.remediation.as_ref()),
        r.class_remediation.as_ref(),
    )?;
    let now = Timestamp::now();
    let health = node.map(|n| judge(n, now, r.settings.health_timeout, &settings.conditions));
    let recheck_in = health.as_ref().and_then(|h| h.recheck_in);
    // The shares are counted only when they decide: a remediation would
    // begin (every Machine of the cluster is read then).
    let counts = recorded.is_none()
        && settings.policy == RemediationPolicy::Replace
        && health.as_ref().is_some_and(|h| h.unhealthy.is_some());
    let rules = &settings.conditions;
    let count = |machines: &[Arc<Machine>], max| match counts {
        true => share(ctx, machines, max, rules, now),
        false => Share {
            unhealthy: 0,
            total: 0,
            max: MaxUnhealthy::Percent(100),
        },
    };
    let facts = RemediationFacts {
        policy: settings.policy,
        health,
        recorded: recorded.as_ref().map(|r| r.step),
        pool: set.map(|s| {
            let uid = s.metadata.uid.clone().unwrap_or_default();
            count(&ctx.caches.machines_of_set(&uid), settings.max_unhealthy)
        }),
        cluster: count(&ctx.caches.machines.state(), ctx.max_unhealthy),
    };
    let step = next_remediation(&facts);
    if counts {
        tracing::debug!(
            machine = %m.name_any(),
            pool = ?facts.pool,
            cluster = ?facts.cluster,
            ?step,
            "remediation judged"
        );
    }
    Ok(Some(Judgement {
        step,
        fence: settings.fence,
        fence_timeout: settings.fence_timeout,
        recorded,
        recheck_in,
    }))
}

/// The remediation of `m` (see the module), whose class `r` resolved and
/// whose Node is `node`, if it has one.
pub(super) async fn apply(
    m: &Machine,
    ctx: &Context,
    r: &Resolved,
    node: Option<&Node>,
) -> Result<Handled, Error> {
    let j = match judged(m, ctx, r, node) {
        Ok(Some(j)) => j,
        Ok(None) => return Ok(Handled::go_on()),
        Err(why) => {
            return Ok(Handled::Continue {
                cond: Some(Cond::new(REMEDIATION, false, "InvalidRemediation", why)),
                recheck_in: None,
            });
        }
    };
    if !matches!(j.step, Remediate::Held { .. } | Remediate::Free) {
        ctx.remediation_waits(m, false);
    }
    take(ctx, m, r, node, j).await
}

/// Takes step `j` of `m`'s remediation.
async fn take(
    ctx: &Context,
    m: &Machine,
    r: &Resolved,
    node: Option<&Node>,
    j: Judgement,
) -> Result<Handled, Error> {
    let (status, recheck_in, recorded) = (m.status.as_ref(), j.recheck_in, j.recorded);
    let named = |reason: &'static str, message: String| {
        Ok(Handled::Continue {
            cond: Some(Cond::new(REMEDIATION, false, reason, message)),
            recheck_in,
        })
    };
    match j.step {
        Remediate::Nothing => {
            // A Node healthy again lets the remediations held go on.
            ctx.wake_remediations();
            // What held or named an unhealthy Node is over; a canceled
            // remediation stays said.
            let stale = ["RemediationHeld", "RemediationOff", "InvalidRemediation"];
            match condition(status, REMEDIATION) {
                Some(c) if stale.contains(&c.reason.as_str()) => named(
                    "NodeHealthy",
                    "the Node is healthy: nothing to remediate".into(),
                ),
                _ => Ok(Handled::Continue {
                    cond: None,
                    recheck_in,
                }),
            }
        }
        Remediate::Off { why } => named(
            "RemediationOff",
            format!(
                "{why}; remediation is off: with remediation.policy Replace on its MachineClass or MachineSet, berth fences the VM, frees the Node and replaces the Machine"
            ),
        ),
        Remediate::Held { why, unhealthy } => {
            ctx.remediation_waits(m, true);
            let rec = StepRecord::report(
                "Health",
                "RemediationHeld",
                State::Failed,
                format!("{unhealthy}; not remediated: {why}"),
            )
            .with(Cond::new(
                NODE_HEALTHY,
                false,
                "NodeNotReady",
                unhealthy.clone(),
            ))
            .with(Cond::new(REMEDIATION, false, "RemediationHeld", why));
            done(ctx, m, &rec, Action::await_change()).await
        }
        Remediate::Begin { why } => begin(ctx, m, node, &why, j.fence).await,
        Remediate::Cancel => {
            let rec = StepRecord::report(
                "Health",
                "RemediationCanceled",
                State::Succeeded,
                "the Node is healthy again before its VM was fenced: remediation canceled",
            )
            .with(Cond::new(
                REMEDIATION,
                false,
                "RemediationCanceled",
                "the Node came back before its VM was fenced",
            ))
            .remediation(None);
            counted(ctx, m, &rec, "canceled").await
        }
        Remediate::Fence => match recorded {
            Some(rem) => fence(ctx, m, r, &rem, j.fence_timeout).await,
            None => Ok(Handled::go_on()),
        },
        Remediate::Free => match recorded {
            Some(rem) => free(ctx, m, r, node, &rem).await,
            None => Ok(Handled::go_on()),
        },
        Remediate::Replace => replace(ctx, m).await,
        Remediate::Fail => {
            let node = recorded.map(|r| r.node).unwrap_or_default();
            let msg = format!(
                "its VM is fenced and Node {node} freed; the Machine belongs to no MachineSet, so nothing replaces it: delete it"
            );
            let rec = StepRecord::report("Health", "Remediated", State::Failed, msg.clone())
                .phase(MachinePhase::Failed)
                .with(Cond::new(READY, false, "Remediated", msg.clone()))
                .with(Cond::new(REMEDIATION, true, "Failed", msg));
            counted(ctx, m, &rec, "failed").await
        }
    }
}

/// How many `machines` (not being deleted) are unhealthy: their Node not
/// Ready or with a condition of `rules` (this Machine's: a pool shares
/// them, and across the cluster they are what this Machine is judged by),
/// however long; or a remediation under way.
fn share(
    ctx: &Context,
    machines: &[Arc<Machine>],
    max: MaxUnhealthy,
    rules: &[ConditionRule],
    now: Timestamp,
) -> Share {
    let live = machines
        .iter()
        .filter(|m| m.metadata.deletion_timestamp.is_none());
    let mut s = Share {
        unhealthy: 0,
        total: 0,
        max,
    };
    for m in live {
        s.total += 1;
        let status = m.status.as_ref();
        let remediating = status.is_some_and(|s| s.remediation.is_some());
        let running = status.and_then(|s| s.phase) == Some(MachinePhase::Running);
        let down = running
            && ctx
                .caches
                .node_of(m)
                .is_some_and(|n| judge(&n, now, Duration::ZERO, rules).failing);
        if remediating || down {
            s.unhealthy += 1;
        }
    }
    s
}

/// Records `rec` and comes back on `action`.
async fn done(
    ctx: &Context,
    m: &Machine,
    rec: &StepRecord,
    action: Action,
) -> Result<Handled, Error> {
    Ok(Handled::Done(
        record(ctx, m, rec, Write::IfChanged).await?.then(action),
    ))
}

/// Records `rec`, counting `outcome` in `berth_remediations_total` when
/// the write took (a write refused on a stale copy is taken again).
async fn counted(
    ctx: &Context,
    m: &Machine,
    rec: &StepRecord,
    outcome: &str,
) -> Result<Handled, Error> {
    let recorded = record(ctx, m, rec, Write::IfChanged).await?;
    if matches!(recorded, super::commit::Recorded::Written(_)) {
        ctx.metrics.remediations.with_label_values(&[outcome]).inc();
    }
    Ok(Handled::Done(recorded.then(Action::await_change())))
}

/// Step 1: the remediation recorded before anything is asked of the
/// provider. Its write wakes the Machine for the fence.
async fn begin(
    ctx: &Context,
    m: &Machine,
    node: Option<&Node>,
    why: &str,
    fence: Fence,
) -> Result<Handled, Error> {
    let node = node.map(ResourceExt::name_any).unwrap_or_default();
    let how = fence_words(fence);
    let rec = StepRecord::report(
        "Health",
        "RemediationStarted",
        State::Processing,
        format!("{why}: its VM is {how} before anything on the Node is freed"),
    )
    .with(Cond::new(NODE_HEALTHY, false, "NodeNotReady", why))
    .with(Cond::new(
        REMEDIATION,
        true,
        "Fencing",
        format!("the VM is being {how}"),
    ))
    .remediation(Some(RemediationStatus {
        step: RemediationStep::Fence,
        node,
        reason: why.to_string(),
        fence,
        started_at: Time(Timestamp::now()),
        escalated_at: None,
        fenced_at: None,
        freed_at: None,
    }));
    counted(ctx, m, &rec, "started").await
}

fn fence_words(fence: Fence) -> &'static str {
    match fence {
        Fence::Stop => "stopped",
        Fence::Terminate => "terminated",
    }
}

/// Step 2: the provider asked to stop (or terminate) the VM, until it
/// says it has; only then is the next step recorded. A `Stop` that
/// outlasts `timeout` in a pool is turned into a `Terminate` (see
/// `fence_turn`).
async fn fence(
    ctx: &Context,
    m: &Machine,
    r: &Resolved,
    rem: &RemediationStatus,
    timeout: Duration,
) -> Result<Handled, Error> {
    let since = rem.escalated_at.as_ref().unwrap_or(&rem.started_at).0;
    let lasted = Duration::try_from(Timestamp::now().duration_since(since)).unwrap_or_default();
    // Before the provider's own retry gate: a provider that asks to be
    // asked again in an hour does not hold the escalation.
    let overdue = match fence_turn(rem.fence, lasted, timeout, owner_ref(m).is_some()) {
        FenceTurn::Escalate => return escalate(ctx, m, rem, timeout).await,
        FenceTurn::Ask { overdue } => overdue,
    };
    if let Some(after) = ctx.provider_retry_in(m) {
        return Ok(Handled::Done(Next::ProviderRetry(after)));
    }
    let provider = r.provider.name();
    let how = fence_words(rem.fence);
    let answer = match rem.fence {
        Fence::Stop => r.provider.stop(&r.request).await,
        Fence::Terminate => r.provider.delete(&r.request).await,
    };
    let vm = r.request.provider_id.as_deref().unwrap_or_default();
    let fencing = |state, reason, msg: String| {
        StepRecord::report("Health", reason, state, msg.clone()).with(Cond::new(
            REMEDIATION,
            true,
            reason,
            msg,
        ))
    };
    match answer {
        Ok(()) => {
            ctx.provider_answered(m);
            let msg = format!(
                "provider {provider} says VM {vm} is {how}: nothing on Node {} runs any more",
                rem.node
            );
            let rec = StepRecord::report("Health", "VmFenced", State::Succeeded, msg)
                .with(Cond::new(
                    REMEDIATION,
                    true,
                    "Freeing",
                    "the VM is fenced: freeing its Node",
                ))
                .remediation(Some(RemediationStatus {
                    step: RemediationStep::Free,
                    fenced_at: Some(Time(Timestamp::now())),
                    ..rem.clone()
                }));
            counted(ctx, m, &rec, "fenced").await
        }
        Err(ProviderError::InProgress { what, retry_after }) => {
            // Looked at again by the fence's timeout at the latest.
            let retry_after = match overdue {
                false => {
                    retry_after.min(timeout.saturating_sub(lasted) + Duration::from_millis(100))
                }
                true => retry_after,
            };
            ctx.provider_retry_after(m, retry_after);
            let rec = match overdue {
                false => fencing(
                    State::Waiting,
                    "Fencing",
                    format!(
                        "provider {provider}: {what}; nothing on the Node is freed before it is {how}"
                    ),
                ),
                true => fencing(
                    State::Failed,
                    "FenceTimedOut",
                    format!(
                        "provider {provider} has not said VM {vm} is {how} within fenceTimeout {} ({what}); still asked, and nothing on Node {} is freed until it is; if the VM is known to be off, delete the Machine with the berth.dev/force-deletion label",
                        humantime::format_duration(timeout),
                        rem.node
                    ),
                ),
            };
            done(ctx, m, &rec, Action::requeue(retry_after)).await
        }
        Err(ProviderError::Unsupported(why)) => {
            let rec = fencing(
                State::Failed,
                "FenceUnsupported",
                format!(
                    "{why}: nothing on Node {} is freed until its VM is known to be off; once it is, delete the Machine with the berth.dev/force-deletion label",
                    rem.node
                ),
            );
            done(ctx, m, &rec, Action::await_change()).await
        }
        Err(e) => {
            let rec = fencing(
                State::Failed,
                "FenceFailed",
                format!(
                    "provider {provider} did not say VM {vm} is {how}: {e}; nothing on the Node is freed; asked again with backoff"
                ),
            );
            record(ctx, m, &rec, Write::IfChanged).await?;
            Err(Error::Provider {
                step: Step::ProviderFence,
                provider: provider.into(),
                source: e,
            })
        }
    }
}

/// A `Stop` past its timeout turned into a `Terminate`, recorded before
/// the provider is asked.
async fn escalate(
    ctx: &Context,
    m: &Machine,
    rem: &RemediationStatus,
    timeout: Duration,
) -> Result<Handled, Error> {
    // The stop's retry gate does not hold the terminate.
    ctx.provider_answered(m);
    let msg = format!(
        "the VM was not stopped within fenceTimeout {}: it is terminated instead (the Machine is replaced, so its disks go anyway); nothing on Node {} is freed before it is gone",
        humantime::format_duration(timeout),
        rem.node
    );
    let rec = StepRecord::report("Health", "FenceEscalated", State::Failed, &msg)
        .with(Cond::new(REMEDIATION, true, "Fencing", msg))
        .remediation(Some(RemediationStatus {
            fence: Fence::Terminate,
            escalated_at: Some(Time(Timestamp::now())),
            ..rem.clone()
        }));
    counted(ctx, m, &rec, "escalated").await
}

/// The pods a remediation frees: every pod bound to the Node but the
/// mirror of a static pod, a DaemonSet's (they end with the Node) and a
/// pod deleted with grace 0 already.
fn pods_to_free(ctx: &Context, node: &str) -> Vec<Arc<Pod>> {
    use crate::drain::select::{PodClass, classify};
    ctx.caches
        .indexes
        .pods_by_node
        .get(&ctx.caches.pods, node)
        .into_iter()
        .filter(|p| !matches!(classify(p), PodClass::Mirror | PodClass::DaemonSet { .. }))
        .filter(|p| p.metadata.deletion_grace_period_seconds != Some(0))
        .collect()
}

/// Step 3: once the ledger lets each stateful workload on the Node move,
/// the out-of-service taint and the pods deleted.
async fn free(
    ctx: &Context,
    m: &Machine,
    r: &Resolved,
    node: Option<&Node>,
    rem: &RemediationStatus,
) -> Result<Handled, Error> {
    let pods = pods_to_free(ctx, &rem.node);
    // The keeper judges the moves asked here only once their pods'
    // deletions are sent.
    let _forcing = ctx.drainer.forcing(&ObjectRef::from_obj(m));
    let reattach = r.settings.volume_reattach_timeout;
    if let Freeing::Waiting(words) = ctx
        .drainer
        .remediation_permits(m, &pods, reattach, rem.started_at.0)
        .await
    {
        ctx.remediation_waits(m, true);
        let msg = format!(
            "the VM is fenced; Node {} is freed once the move ledger lets each of its stateful workloads move: {words}",
            rem.node
        );
        let rec = StepRecord::report("Health", "WaitingForMovePermits", State::Waiting, &msg)
            .with(Cond::new(REMEDIATION, true, "WaitingForMovePermits", msg));
        return done(ctx, m, &rec, Action::await_change()).await;
    }
    ctx.remediation_waits(m, false);
    if let Some(node) = node {
        super::node::out_of_service(&ctx.client, node, Timestamp::now())
            .await
            .map_err(at(Step::OutOfService))?;
    }
    for pod in &pods {
        match crate::drain::pod_writes::delete(&ctx.client, pod, Some(0)).await {
            Evicted::Accepted | Evicted::Gone => {}
            Evicted::Refused { message }
            | Evicted::Throttled { message, .. }
            | Evicted::MultipleBudgets { message } => {
                tracing::warn!(pod = %pod.name_any(), %message, "remediation: pod deletion refused");
            }
            Evicted::Failed(e) => return Err(at(Step::PodDelete)(e)),
        }
    }
    let msg = format!(
        "Node {} tainted out of service and its {} pods deleted: their volumes detach at once and their controllers make them again elsewhere",
        rem.node,
        pods.len()
    );
    let rec = StepRecord::report("Health", "NodeFreed", State::Succeeded, &msg)
        .with(Cond::new(REMEDIATION, true, "Replacing", msg))
        .remediation(Some(RemediationStatus {
            step: RemediationStep::Replace,
            freed_at: Some(Time(Timestamp::now())),
            ..rem.clone()
        }));
    counted(ctx, m, &rec, "freed").await
}

/// Step 4, in a pool: the Machine deleted (pinned to its UID), for its
/// MachineSet to replace it; its deletion takes the forced path (see
/// `deletion::observe`).
async fn replace(ctx: &Context, m: &Machine) -> Result<Handled, Error> {
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), &m.namespace().unwrap_or_default());
    let pinned = DeleteParams {
        preconditions: Some(Preconditions {
            uid: m.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(&m.name_any(), &pinned).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
        Err(e) => return Err(at(Step::MachineDelete)(e)),
    }
    tracing::info!(machine = %m.name_any(), "remediation: Machine deleted for its MachineSet to replace it");
    Ok(Handled::Done(Next::Wait(Action::await_change())))
}

/// Whether `m`'s deletion takes the forced path because a remediation
/// fenced its VM: nothing on its Node runs, so nothing is drained.
pub(super) fn fenced(m: &Machine) -> bool {
    m.status
        .as_ref()
        .and_then(|s| s.remediation.as_ref())
        .is_some_and(|r| r.fenced_at.is_some())
}
