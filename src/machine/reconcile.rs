//! Observe, decide, act, record. Every step here is idempotent and safe to
//! cancel at any await point (the contract of kube-runtime's `finalizer`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod, Taint};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::finalizer::{self, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};

use super::Context;
use super::decide::{
    self, CreationFacts, CreationStep, DeletionFacts, DeletionStep, NodeFacts, next_creation_step,
    next_deletion_step,
};
use super::status::{Cond, Report, State, condition, next_status};
use crate::api::conditions::{DRAINED, NODE_HEALTHY, READY, VM_REQUESTED, VOLUMES_DETACHED};
use crate::api::settings::{ResolvedSettings, resolve};
use crate::api::{
    CORDON_TAINT_KEY, DrainStatus, FINALIZER, FORCE_DELETION_LABEL, Machine, MachinePhase,
    MachineStatus, NodeReference, PRE_DRAIN_HOOK_PREFIX, PRE_TERMINATE_HOOK_PREFIX,
};
use crate::drain::deadline::Deadline;
use crate::drain::engine::{Job, Outcome, Progress, RETRY_FAILED_AFTER};
use crate::providers::{MachineRequest, Provider, ProviderError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("provider {provider}: {source}")]
    Provider {
        provider: String,
        #[source]
        source: ProviderError,
    },
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<finalizer::Error<Error>>),
    #[error("Machine has no namespace")]
    NoNamespace,
    #[error("encoding status: {0}")]
    Encode(#[from] serde_json::Error),
    /// Not a failure: a deletion step is under way. Never leaves `reconcile`.
    #[error("deletion step in progress")]
    Pending(Action),
}

impl Error {
    /// A short, bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Provider { source, .. } => source.metric_label(),
            Error::Finalizer(e) => match e.as_ref() {
                finalizer::Error::ApplyFailed(inner) | finalizer::Error::CleanupFailed(inner) => {
                    inner.metric_label()
                }
                _ => "finalizer",
            },
            Error::NoNamespace => "no_namespace",
            Error::Encode(_) => "encode",
            Error::Pending(_) => "pending",
        }
    }
}

pub(super) async fn reconcile(machine: Arc<Machine>, ctx: Arc<Context>) -> Result<Action, Error> {
    // Decisions read the caches: an empty cache would look like a Node with
    // no pods, or no Node at all. Until every cache has synced, nothing is
    // done; the end of the sync reconciles every Machine again.
    if !ctx.synced.load(std::sync::atomic::Ordering::Acquire) {
        return Ok(Action::await_change());
    }
    let machine = ctx.provider_ids.fill_in(machine);
    let mut timer = ctx.metrics.reconcile_timer();
    let result = reconcile_inner(&machine, &ctx).await;
    timer.record(&result, Error::metric_label);
    result
}

async fn reconcile_inner(machine: &Arc<Machine>, ctx: &Context) -> Result<Action, Error> {
    let ns = machine.namespace().ok_or(Error::NoNamespace)?;
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), &ns);
    let action = finalizer(&api, FINALIZER, machine.clone(), |event| async {
        match event {
            finalizer::Event::Apply(m) => apply(&m, ctx).await,
            // kube's finalizer helper removes the finalizer when cleanup
            // returns Ok, so a step that is not done yet leaves as Pending.
            finalizer::Event::Cleanup(m) => match cleanup(&m, ctx).await? {
                Some(action) => Err(Error::Pending(action)),
                None => {
                    ctx.drainer.forget(&ObjectRef::from_obj(&*m));
                    ctx.provider_ids.forget(&m);
                    Ok(Action::await_change())
                }
            },
        }
    })
    .await;
    let action = match action {
        Ok(a) | Err(finalizer::Error::CleanupFailed(Error::Pending(a))) => a,
        Err(e) if is_not_found(&e) && machine_is_gone(&api, machine).await => {
            // A wake-up that raced the removal of the finalizer: the cached
            // copy still showed it, the Machine is gone. Nothing to do.
            tracing::debug!(machine = %machine.name_any(), "Machine already gone");
            return Ok(Action::await_change());
        }
        Err(e) => return Err(Error::Finalizer(Box::new(e))),
    };
    ctx.reset_backoff(machine);
    Ok(action)
}

/// Whether the API server answered 404 somewhere in `e`.
fn is_not_found(e: &finalizer::Error<Error>) -> bool {
    let kube_404 = |k: &kube::Error| matches!(k, kube::Error::Api(s) if s.code == 404);
    match e {
        finalizer::Error::ApplyFailed(Error::Kube(k))
        | finalizer::Error::CleanupFailed(Error::Kube(k))
        | finalizer::Error::AddFinalizer(k)
        | finalizer::Error::RemoveFinalizer(k) => kube_404(k),
        _ => false,
    }
}

/// Asks the API server (not the cache) whether this Machine, by UID, is
/// gone.
async fn machine_is_gone(api: &Api<Machine>, machine: &Machine) -> bool {
    match api.get_opt(&machine.name_any()).await {
        Ok(None) => true,
        Ok(Some(live)) => live.metadata.uid != machine.metadata.uid,
        Err(_) => false,
    }
}

/// A Machine's class, driver and settings, or why they cannot be had.
struct Resolved {
    provider: Arc<dyn Provider>,
    settings: ResolvedSettings,
    request: MachineRequest,
}

struct Invalid {
    reason: &'static str,
    message: String,
}

fn resolve_machine(m: &Machine, ctx: &Context) -> Result<Resolved, Invalid> {
    let class_name = &m.spec.class_ref.name;
    let class = ctx
        .stores
        .classes
        .get(&kube::runtime::reflector::ObjectRef::new(class_name))
        .ok_or_else(|| Invalid {
            reason: "ClassNotFound",
            message: format!("MachineClass {class_name:?} does not exist"),
        })?;
    let provider = ctx
        .providers
        .get(&class.spec.provider)
        .ok_or_else(|| Invalid {
            reason: "UnknownProvider",
            message: format!(
                "MachineClass {class_name:?} names provider {:?}; this controller knows {:?}",
                class.spec.provider,
                ctx.providers.names()
            ),
        })?;
    let settings = resolve(
        m.spec.drain.as_ref(),
        class.spec.drain.as_ref(),
        class.spec.creation_timeout.as_deref(),
        class.spec.health_timeout.as_deref(),
    )
    .map_err(|e| Invalid {
        reason: "InvalidSettings",
        message: e.to_string(),
    })?;
    let provider_spec = class
        .spec
        .provider_spec
        .clone()
        .unwrap_or(serde_json::Value::Null);
    provider.validate(&provider_spec).map_err(|e| Invalid {
        reason: "InvalidProviderSpec",
        message: format!("MachineClass {class_name:?}: {e}"),
    })?;
    Ok(Resolved {
        provider,
        settings,
        request: MachineRequest {
            namespace: m.namespace().unwrap_or_default(),
            name: m.name_any(),
            class: class_name.clone(),
            provider_spec,
            provider_id: m.spec.provider_id.clone(),
        },
    })
}

/// Writes the status the step implies (only if it differs) and, when the
/// report is new, an Event. Returns the Machine as written, if it was.
async fn record(
    ctx: &Context,
    m: &Machine,
    phase: Option<MachinePhase>,
    conds: &[Cond],
    report: Report,
    extra: impl FnOnce(&mut MachineStatus),
) -> Result<Option<Machine>, Error> {
    let current = m.status.clone().unwrap_or_default();
    let mut next = next_status(
        &current,
        phase,
        conds,
        &report,
        m.metadata.generation,
        Timestamp::now(),
    );
    extra(&mut next);
    let mut written = None;
    if next != current {
        let mut body = serde_json::to_value(&next)?;
        // While the drain engine runs, it owns `status.drain`: a merge patch
        // of this (cached, possibly older) copy would undo its progress.
        if next.drain == current.drain
            && let Some(obj) = body.as_object_mut()
        {
            obj.remove("drain");
        }
        let api: Api<Machine> =
            Api::namespaced(ctx.client.clone(), &m.namespace().unwrap_or_default());
        written = Some(
            api.patch_status(
                &m.name_any(),
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "status": body })),
            )
            .await?,
        );
    }
    if !report.recorded_in(current.last_operation.as_ref()) {
        let type_ = if report.state == State::Failed {
            EventType::Warning
        } else {
            EventType::Normal
        };
        tracing::info!(
            machine = %m.name_any(),
            op = report.op,
            step = report.step,
            state = report.state.as_str(),
            "{}",
            report.description
        );
        let ev = Event {
            type_,
            reason: report.step.to_string(),
            note: Some(truncate(&report.description, 1000)),
            action: report.op.to_string(),
            secondary: None,
        };
        // An Event is best effort and published in the background: it must
        // neither stop nor slow the lifecycle.
        ctx.events.publish(ev, m.object_ref(&()));
    }
    Ok(written)
}

/// A report that changes no phase or condition. Returns the Machine as
/// written, if it was.
async fn note(ctx: &Context, m: &Machine, report: Report) -> Result<Option<Machine>, Error> {
    record(ctx, m, None, &[], report, |_| {}).await
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

fn elapsed_since(t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>) -> Duration {
    t.and_then(|t| Duration::try_from(Timestamp::now().duration_since(t.0)).ok())
        .unwrap_or_default()
}

/// The Machine's Node: by `status.nodeRef`, else by providerID.
async fn node_from_api(m: &Machine, ctx: &Context) -> Result<Option<Arc<Node>>, Error> {
    let Some(name) = m
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| &r.name)
    else {
        return Ok(None);
    };
    let node = Api::<Node>::all(ctx.client.clone()).get_opt(name).await?;
    if node.is_some() {
        tracing::warn!(node = %name, "Node missing from the cache but present in the API server");
    }
    Ok(node.map(Arc::new))
}

fn find_node(m: &Machine, ctx: &Context) -> Option<Arc<Node>> {
    if let Some(name) = m
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| &r.name)
        && let Some(n) = ctx
            .stores
            .nodes
            .get(&kube::runtime::reflector::ObjectRef::new(name))
    {
        return Some(n);
    }
    let id = m.spec.provider_id.as_deref()?;
    ctx.stores
        .indexes
        .nodes_by_provider_id
        .get(&ctx.stores.nodes, id)
        .into_iter()
        .next()
}

async fn apply(m: &Machine, ctx: &Context) -> Result<Action, Error> {
    let r = match resolve_machine(m, ctx) {
        Ok(r) => r,
        Err(inv) => {
            let phase = m
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .unwrap_or(MachinePhase::Pending);
            record(
                ctx,
                m,
                Some(phase),
                &[Cond::new(READY, false, inv.reason, inv.message.clone())],
                Report::new("Create", inv.reason, State::Failed, inv.message),
                |_| {},
            )
            .await?;
            // Nothing will change until the Machine or its class does.
            return Ok(Action::await_change());
        }
    };
    let now = Timestamp::now();
    let node = find_node(m, ctx);
    let facts = CreationFacts {
        phase: m.status.as_ref().and_then(|s| s.phase),
        provider_id: m.spec.provider_id.clone(),
        node: node.as_deref().map(|n| decide::node_facts(n, now)),
        age: elapsed_since(m.metadata.creation_timestamp.as_ref()),
        creation_timeout: r.settings.creation_timeout,
        health_timeout: r.settings.health_timeout,
    };
    match next_creation_step(&facts) {
        CreationStep::CreateVm => create_vm(m, ctx, &r).await,
        CreationStep::WaitForNode { retry_in } => {
            let id = m.spec.provider_id.clone().unwrap_or_default();
            record(
                ctx,
                m,
                Some(MachinePhase::Creating),
                &[Cond::new(
                    READY,
                    false,
                    "WaitingForNode",
                    format!(
                        "waiting for the Node with providerID {id} to register and become Ready"
                    ),
                )],
                Report::new(
                    "Create",
                    "WaitForNode",
                    State::Waiting,
                    format!("VM {id} exists; waiting for its Node to register and become Ready"),
                ),
                |_| {},
            )
            .await?;
            // The Node watch wakes us earlier; this is the creation deadline.
            Ok(Action::requeue(retry_in + Duration::from_millis(100)))
        }
        CreationStep::FailCreation { .. } => {
            let msg = format!(
                "the Node did not register and become Ready within the creation timeout ({})",
                humantime::format_duration(r.settings.creation_timeout)
            );
            record(
                ctx,
                m,
                Some(MachinePhase::Failed),
                &[Cond::new(READY, false, "CreationTimeout", msg.clone())],
                Report::new("Create", "WaitForNode", State::Failed, msg),
                |_| {},
            )
            .await?;
            Ok(Action::await_change())
        }
        CreationStep::Running { node: name } => {
            let facts = facts.node.clone();
            let ready = facts.as_ref().is_some_and(|n| n.ready);
            record(
                ctx,
                m,
                Some(MachinePhase::Running),
                &[
                    Cond::new(READY, true, "NodeReady", format!("Node {name} is Ready")),
                    Cond::new(
                        NODE_HEALTHY,
                        true,
                        "NodeReady",
                        format!("Node {name} is Ready"),
                    ),
                ],
                Report::new(
                    "Create",
                    "Running",
                    State::Succeeded,
                    format!("Node {name} is Ready"),
                ),
                |s| {
                    s.node_ref = Some(NodeReference { name: name.clone() });
                },
            )
            .await?;
            match facts {
                // NotReady but within the health timeout: look again when
                // it would pass (a Node event wakes us earlier).
                Some(NodeFacts { ready_for, .. }) if !ready => Ok(Action::requeue(
                    r.settings.health_timeout.saturating_sub(ready_for)
                        + Duration::from_millis(100),
                )),
                _ => Ok(Action::await_change()),
            }
        }
        CreationStep::Unhealthy { node, .. } => {
            let msg = format!(
                "Node {node} has been NotReady for longer than the health timeout ({})",
                humantime::format_duration(r.settings.health_timeout)
            );
            record(
                ctx,
                m,
                None,
                &[Cond::new(NODE_HEALTHY, false, "NodeNotReady", msg.clone())],
                Report::new("Health", "NodeNotReady", State::Failed, msg),
                |_| {},
            )
            .await?;
            Ok(Action::await_change())
        }
        CreationStep::StayFailed => Ok(Action::await_change()),
    }
}

async fn create_vm(m: &Machine, ctx: &Context, r: &Resolved) -> Result<Action, Error> {
    let provider = r.provider.name();
    record(
        ctx,
        m,
        Some(MachinePhase::Creating),
        &[
            Cond::new(READY, false, "Creating", "creating the VM"),
            Cond::new(
                VM_REQUESTED,
                true,
                "Requested",
                format!("the VM was requested from provider {provider}"),
            ),
        ],
        Report::new(
            "Create",
            "CreateVm",
            State::Processing,
            format!("creating the VM with provider {provider}"),
        ),
        |_| {},
    )
    .await?;
    match r.provider.create(&r.request).await {
        Ok(vm) => {
            let api: Api<Machine> = Api::namespaced(ctx.client.clone(), &r.request.namespace);
            api.patch(
                &m.name_any(),
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"providerID": vm.provider_id}})),
            )
            .await?;
            ctx.provider_ids.written(m, &vm.provider_id);
            // The spec change wakes the next step.
            Ok(Action::await_change())
        }
        Err(ProviderError::InProgress { what, retry_after }) => {
            note(
                ctx,
                m,
                Report::new("Create", "CreateVm", State::Waiting, what),
            )
            .await?;
            Ok(Action::requeue(retry_after))
        }
        Err(e @ (ProviderError::Permanent(_) | ProviderError::InvalidSpec(_))) => {
            let msg = format!("provider {provider} cannot create the VM: {e}");
            record(
                ctx,
                m,
                Some(MachinePhase::Failed),
                &[Cond::new(READY, false, "CreateFailed", msg.clone())],
                Report::new("Create", "CreateVm", State::Failed, msg),
                |_| {},
            )
            .await?;
            Ok(Action::await_change())
        }
        Err(e) => {
            note(
                ctx,
                m,
                Report::new(
                    "Create",
                    "CreateVm",
                    State::Failed,
                    format!("provider {provider}: {e}; retrying"),
                ),
            )
            .await?;
            Err(Error::Provider {
                provider: provider.into(),
                source: e,
            })
        }
    }
}

fn pods_on(ctx: &Context, node: &str) -> Vec<Arc<Pod>> {
    ctx.stores.indexes.pods_by_node.get(&ctx.stores.pods, node)
}

fn key(p: &Pod) -> String {
    format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any())
}

/// The next deletion step. `Some(action)`: not done, come back on `action`;
/// `None`: every step is done and the finalizer can go.
/// Steps of a deletion taken in one reconcile at most: marking the Machine
/// Terminating, cordoning its Node, starting the drain.
const STEPS_PER_RECONCILE: usize = 3;

/// What one deletion step left to do.
enum Stepped {
    /// Wait (or not: `None` means the Machine may go).
    Done(Option<Action>),
    /// The step wrote what the next one reads: go on from these copies
    /// rather than wait for the watches to bring them back.
    Advanced {
        machine: Option<Box<Machine>>,
        node: Option<Arc<Node>>,
    },
}

/// The deletion, one step after another. The first steps (marking the
/// Machine Terminating, cordoning its Node) are each followed at once by
/// the next, on the objects the API server answered with: with many
/// Machines deleted together, a wait for each write's watch event and a
/// turn in the work queue between steps would delay every drain's first
/// eviction by seconds.
async fn cleanup(m: &Machine, ctx: &Context) -> Result<Option<Action>, Error> {
    let mut machine = std::borrow::Cow::Borrowed(m);
    let mut node = None;
    for _ in 0..STEPS_PER_RECONCILE {
        match cleanup_step(&machine, node.take(), ctx).await? {
            Stepped::Done(action) => return Ok(action),
            Stepped::Advanced {
                machine: written,
                node: n,
            } => {
                if let Some(w) = written {
                    machine = std::borrow::Cow::Owned(*w);
                }
                node = n;
            }
        }
    }
    // The writes above wake this Machine again.
    Ok(Some(Action::await_change()))
}

/// Takes the next deletion step. `known_node` is a fresher copy of the
/// Machine's Node than the cache's, when a previous step wrote it.
async fn cleanup_step(
    m: &Machine,
    known_node: Option<Arc<Node>>,
    ctx: &Context,
) -> Result<Stepped, Error> {
    let resolved = resolve_machine(m, ctx);
    let settings = resolved
        .as_ref()
        .map(|r| r.settings.clone())
        .unwrap_or_default();
    let now = Timestamp::now();
    let node = match known_node.or_else(|| find_node(m, ctx)) {
        Some(n) => Some(n),
        // Deleting needs certainty: a Node missing from the cache is asked
        // for once more before the deletion acts as if it were gone.
        None => node_from_api(m, ctx).await?,
    };
    let node_facts = node.as_deref().map(|n| decide::node_facts(n, now));
    let (pods_to_drain, pods_on_node) = match &node_facts {
        Some(n) => {
            let pods = pods_on(ctx, &n.name);
            let on_node: Vec<String> = pods
                .iter()
                .filter(|p| decide::drain_skip_reason(p) != Some("mirror pod"))
                .map(|p| key(p))
                .collect();
            let to_drain = pods
                .iter()
                .filter(|p| decide::drain_skip_reason(p).is_none())
                .map(|p| key(p))
                .collect();
            (to_drain, on_node)
        }
        None => (vec![], vec![]),
    };
    let attachments: Vec<String> = match &node_facts {
        Some(n) => ctx
            .stores
            .indexes
            .attachments_by_node
            .get(&ctx.stores.attachments, &n.name)
            .iter()
            .map(|va| va.name_any())
            .collect(),
        None => vec![],
    };
    let detach_wait = condition(m.status.as_ref(), VOLUMES_DETACHED)
        .filter(|c| c.status == "False")
        .map(|c| elapsed_since(Some(&c.last_transition_time)));
    let annotations = m.annotations();
    let facts = DeletionFacts {
        phase: m.status.as_ref().and_then(|s| s.phase),
        force: m
            .labels()
            .get(FORCE_DELETION_LABEL)
            .is_some_and(|v| v == "true"),
        pre_drain_hooks: decide::hooks(annotations.keys(), PRE_DRAIN_HOOK_PREFIX),
        pre_terminate_hooks: decide::hooks(annotations.keys(), PRE_TERMINATE_HOOK_PREFIX),
        node: node_facts.clone(),
        pods_to_drain,
        pods_on_node,
        drain_pending: !ctx.drainer.finished(&ObjectRef::from_obj(m)),
        volume_attachments: attachments,
        volume_detach_timed_out: detach_wait.is_some_and(|w| w >= settings.volume_detach_timeout),
    };
    let step = next_deletion_step(&facts);
    let name = step.name();
    let action: Result<Option<Action>, Error> = match step {
        DeletionStep::MarkTerminating => {
            let started = m.metadata.deletion_timestamp.clone();
            let written = record(
                ctx,
                m,
                Some(MachinePhase::Terminating),
                &[],
                Report::new("Delete", name, State::Processing, "deletion requested"),
                |s| {
                    s.drain.get_or_insert_with(DrainStatus::default).started_at = started;
                },
            )
            .await?;
            match written {
                Some(w) => {
                    return Ok(Stepped::Advanced {
                        machine: Some(Box::new(w)),
                        node,
                    });
                }
                None => Ok(Some(Action::await_change())),
            }
        }
        DeletionStep::WaitPreDrainHooks(hooks) | DeletionStep::WaitPreTerminateHooks(hooks) => {
            let msg = format!(
                "waiting for the lifecycle hooks to be removed: {}",
                hooks.join(", ")
            );
            note(ctx, m, Report::new("Delete", name, State::Waiting, msg)).await?;
            Ok(Some(Action::await_change()))
        }
        DeletionStep::Cordon { node: node_name } => {
            let cordoned = match node {
                Some(n) => Some(Arc::new(cordon(ctx, &n).await?)),
                None => None,
            };
            let written = note(
                ctx,
                m,
                Report::new(
                    "Delete",
                    name,
                    State::Succeeded,
                    format!("cordoned Node {node_name}"),
                ),
            )
            .await?;
            match cordoned {
                Some(n) => {
                    return Ok(Stepped::Advanced {
                        machine: written.map(Box::new),
                        node: Some(n),
                    });
                }
                None => Ok(Some(Action::await_change())),
            }
        }
        DeletionStep::ForceDeletePods { node, pods } => {
            ctx.drainer.forget(&ObjectRef::from_obj(m));
            for p in &pods {
                let Some((ns, pod)) = p.split_once('/') else {
                    continue;
                };
                let api: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
                match api
                    .delete(pod, &DeleteParams::default().grace_period(0))
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
            let msg = format!(
                "force-deleting {} pods on Node {node} (forced deletion)",
                pods.len()
            );
            note(ctx, m, Report::new("Delete", name, State::Processing, msg)).await?;
            Ok(Some(Action::await_change()))
        }
        DeletionStep::Drain { node, pods } => {
            let Some(started) = m.metadata.deletion_timestamp.as_ref().map(|t| t.0) else {
                return Ok(Stepped::Done(Some(Action::await_change())));
            };
            let job = Job {
                machine: ObjectRef::from_obj(m),
                machine_ref: m.object_ref(&()),
                node: node.clone(),
                settings: settings.clone(),
                deadline: Deadline::new(started, settings.drain_timeout),
            };
            let progress = ctx.drainer.ensure(job, !pods.is_empty());
            let (reason, state, msg) = drain_report(&node, &pods, &progress);
            record(
                ctx,
                m,
                None,
                &[Cond::new(DRAINED, false, reason, msg.clone())],
                Report::new("Delete", name, state, msg),
                |_| {},
            )
            .await?;
            // The engine's progress writes and its end wake this Machine;
            // a failed drain is retried after a pause.
            Ok(Some(match progress.outcome {
                Some(Outcome::Failed { .. }) => Action::requeue(RETRY_FAILED_AFTER),
                _ => Action::await_change(),
            }))
        }
        DeletionStep::WaitVolumesDetached { node, attachments } => {
            let msg = format!(
                "waiting for {} VolumeAttachments to leave Node {node}: {}",
                attachments.len(),
                attachments.join(", ")
            );
            record(
                ctx,
                m,
                None,
                &[
                    Cond::new(
                        DRAINED,
                        true,
                        "Drained",
                        format!("no pod left to drain on Node {node}"),
                    ),
                    Cond::new(VOLUMES_DETACHED, false, "Detaching", msg.clone()),
                ],
                Report::new("Delete", name, State::Waiting, msg),
                |s| {
                    if let Some(d) = s.drain.as_mut() {
                        d.pods_remaining = 0;
                        d.progress = Some(format!("{}/{}", d.pods_total, d.pods_total));
                        d.waiting_for = Some("volumes to detach".into());
                    }
                },
            )
            .await?;
            // VolumeAttachment events wake us; this is the detach deadline.
            let waited = detach_wait.unwrap_or_default();
            Ok(Some(Action::requeue(
                settings.volume_detach_timeout.saturating_sub(waited) + Duration::from_millis(100),
            )))
        }
        DeletionStep::DeleteVmAndNode { node } => {
            delete_vm_and_node(m, ctx, resolved, facts, node).await
        }
    };
    action.map(Stepped::Done)
}

/// What the Drain step says: the condition reason, the report state and a
/// sentence, from the engine's progress.
fn drain_report(node: &str, pods: &[String], p: &Progress) -> (&'static str, State, String) {
    match &p.outcome {
        Some(Outcome::Failed { message }) => ("DrainFailed", State::Failed, message.clone()),
        Some(Outcome::Drained | Outcome::Forced { .. }) => (
            "PodsReturned",
            State::Processing,
            format!(
                "pods came back to Node {node}: {}; draining again",
                pods.join(", ")
            ),
        ),
        // The running drain's details live in `status.drain`, written by
        // the engine; the step's report changes only when the drain gets
        // blocked or unblocked, so progress costs no Event and no second
        // status write.
        None => match &p.blocked_by {
            Some(b) => (
                "EvictionBlocked",
                State::Waiting,
                format!("draining Node {node}: blocked: {b}"),
            ),
            None => (
                "Draining",
                State::Processing,
                format!("draining Node {node} (progress in status.drain)"),
            ),
        },
    }
}

/// `spec.unschedulable` plus berth's NoSchedule taint. The resourceVersion
/// in the patch makes it a compare-and-swap, so a taint another writer
/// added in between is never lost.
/// Marks the Node unschedulable and taints it; returns it as written.
async fn cordon(ctx: &Context, node: &Node) -> Result<Node, Error> {
    let mut taints: Vec<Taint> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    if !taints
        .iter()
        .any(|t| t.key == CORDON_TAINT_KEY && t.effect == "NoSchedule")
    {
        taints.push(Taint {
            key: CORDON_TAINT_KEY.into(),
            effect: "NoSchedule".into(),
            value: Some("true".into()),
            ..Default::default()
        });
    }
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": node.resource_version()},
        "spec": {"unschedulable": true, "taints": taints},
    });
    Ok(Api::<Node>::all(ctx.client.clone())
        .patch(
            &node.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await?)
}

async fn delete_vm_and_node(
    m: &Machine,
    ctx: &Context,
    resolved: Result<Resolved, Invalid>,
    facts: DeletionFacts,
    node: Option<String>,
) -> Result<Option<Action>, Error> {
    let had_node = m
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .is_some();
    if node.is_none() && !had_node && !facts.force {
        record(
            ctx,
            m,
            None,
            &[Cond::new(
                DRAINED,
                true,
                "NoNode",
                "the Node never registered: nothing to drain",
            )],
            Report::new(
                "Delete",
                "SkipDrain",
                State::Succeeded,
                "the Node never registered: no drain",
            ),
            |_| {},
        )
        .await?;
    }
    let vm_requested =
        m.spec.provider_id.is_some() || condition(m.status.as_ref(), VM_REQUESTED).is_some();
    let r = match resolved {
        Ok(r) => r,
        Err(_) if !vm_requested => {
            note(
                ctx,
                m,
                Report::new(
                    "Delete",
                    "DeleteVmAndNode",
                    State::Succeeded,
                    "no VM was ever requested: nothing to delete",
                ),
            )
            .await?;
            return Ok(None);
        }
        Err(inv) => {
            let msg = format!("cannot delete the VM: {}", inv.message);
            record(
                ctx,
                m,
                None,
                &[Cond::new(READY, false, inv.reason, inv.message.clone())],
                Report::new("Delete", "DeleteVm", State::Failed, msg),
                |_| {},
            )
            .await?;
            // Keep the finalizer: never forget a VM. A fixed class wakes us.
            return Ok(Some(Action::await_change()));
        }
    };
    let provider = r.provider.name();
    match r.provider.delete(&r.request).await {
        Ok(()) | Err(ProviderError::NotFound(_)) => {}
        Err(ProviderError::InProgress { what, retry_after }) => {
            note(
                ctx,
                m,
                Report::new("Delete", "DeleteVm", State::Waiting, what),
            )
            .await?;
            return Ok(Some(Action::requeue(retry_after)));
        }
        Err(e @ (ProviderError::Permanent(_) | ProviderError::InvalidSpec(_))) => {
            let msg = format!("provider {provider} cannot delete the VM: {e}");
            note(
                ctx,
                m,
                Report::new("Delete", "DeleteVm", State::Failed, msg),
            )
            .await?;
            return Ok(Some(Action::requeue(Duration::from_secs(600))));
        }
        Err(e) => {
            return Err(Error::Provider {
                provider: provider.into(),
                source: e,
            });
        }
    }
    let what = match &node {
        Some(n) => {
            match Api::<Node>::all(ctx.client.clone())
                .delete(n, &DeleteParams::default())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
            format!("VM deleted, Node {n} deleted")
        }
        None => "VM deleted".to_string(),
    };
    note(
        ctx,
        m,
        Report::new("Delete", "DeleteVmAndNode", State::Succeeded, what),
    )
    .await?;
    Ok(None)
}

/// The providerIDs this controller wrote that its Machine cache may not show
/// yet, by Machine UID.
///
/// Writing the VM request into the status wakes the Machine again, and that
/// reconcile can read a cached copy from before the providerID was written:
/// without this it would ask the provider for a second VM (measured: 110
/// creates for 60 Machines). An entry lives until the cache shows the
/// providerID or the Machine is gone.
#[derive(Default)]
pub(super) struct WrittenProviderIds(Mutex<HashMap<String, String>>);

impl WrittenProviderIds {
    /// `m`, or a copy with the providerID this controller wrote for it.
    fn fill_in(&self, m: Arc<Machine>) -> Arc<Machine> {
        let Some(uid) = m.metadata.uid.as_deref() else {
            return m;
        };
        let mut ids = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if m.spec.provider_id.is_some() {
            ids.remove(uid);
            return m;
        }
        match ids.get(uid) {
            Some(id) => {
                let mut copy = (*m).clone();
                copy.spec.provider_id = Some(id.clone());
                Arc::new(copy)
            }
            None => m,
        }
    }

    fn written(&self, m: &Machine, provider_id: &str) {
        if let Some(uid) = m.metadata.uid.clone() {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(uid, provider_id.to_owned());
        }
    }

    fn forget(&self, m: &Machine) {
        if let Some(uid) = m.metadata.uid.as_deref() {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(uid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(uid: &str, provider_id: Option<&str>) -> Arc<Machine> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "apiVersion": "berth.dev/v1alpha1", "kind": "Machine",
                "metadata": {"name": "m", "namespace": "ns", "uid": uid},
                "spec": {"classRef": {"name": "c"}, "providerID": provider_id}
            }))
            .expect("machine"),
        )
    }

    #[test]
    fn a_written_provider_id_fills_in_a_stale_copy_until_the_cache_has_it() {
        let ids = WrittenProviderIds::default();
        let stale = machine("u1", None);
        assert_eq!(ids.fill_in(Arc::clone(&stale)).spec.provider_id, None);

        ids.written(&stale, "fake://ns/m");
        let filled = ids.fill_in(Arc::clone(&stale));
        assert_eq!(filled.spec.provider_id.as_deref(), Some("fake://ns/m"));
        // Another Machine of the same name (a new UID) is not confused with it.
        assert_eq!(ids.fill_in(machine("u2", None)).spec.provider_id, None);

        // The cache caught up: the entry goes, and the cached copy is used as is.
        let fresh = machine("u1", Some("fake://ns/m"));
        assert!(Arc::ptr_eq(&ids.fill_in(Arc::clone(&fresh)), &fresh));
        assert_eq!(ids.fill_in(stale).spec.provider_id, None, "entry dropped");
    }

    #[test]
    fn a_deleted_machine_is_forgotten() {
        let ids = WrittenProviderIds::default();
        let m = machine("u1", None);
        ids.written(&m, "fake://ns/m");
        ids.forget(&m);
        assert_eq!(ids.fill_in(m).spec.provider_id, None);
    }
}
