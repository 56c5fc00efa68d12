//! Observe, decide, act, record. Every step here is idempotent and safe to
//! cancel at any await point (the contract of kube-runtime's `finalizer`).
//!
//! What a step records comes from `record` (pure); this module only reads
//! the caches, calls the API server and the provider, and writes the record
//! with the compare-and-swap of `write`.

use std::borrow::Cow;
use std::convert::Infallible;
use std::sync::Arc;
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
use super::record::{
    CreationContext, DeletionOutcome, DrainView, OUT_OF_SERVICE_TAINT, StepRecord, Unresolved,
    VOLUMES_LEFT_REASONS, VmAnswer, creation_record, deletion_record, settings_message,
    unresolved_record, vm_answer_record, volumes_left_message, with_settings_condition,
};
use super::status::{Report, State, condition, next_status};
use super::write::{StatusWrite, write_status};
use crate::api::conditions::{DRAIN_SETTINGS, VM_REQUESTED, VOLUMES_DETACHED};
use crate::api::settings::{ResolvedSettings, resolve};
use crate::api::{
    CORDON_TAINT_KEY, CORDONED_AT_ANNOTATION, FINALIZER, FORCE_DELETION_LABEL, Machine,
    MachineStatus, NodeReference, PRE_DRAIN_HOOK_PREFIX, PRE_TERMINATE_HOOK_PREFIX, cordoned_at,
};
use crate::drain::deadline::{Deadline, released};
use crate::drain::engine::{Job, Outcome, Progress, RESTART_ENDED_AFTER, RETRY_FAILED_AFTER};
use crate::drain::evict::Evicted;
use crate::drain::select::{Arrivals, came_back};
use crate::providers::{MachineRequest, Provider, ProviderError};
use crate::telemetry::RESULT_CONFLICT;

/// The call a reconcile failed at. [`Step::metric_label`] is the `result`
/// label of `berth_reconcile_total` for a reconcile that failed there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Writing the Machine's status.
    Status,
    /// Recording the VM's providerID in the Machine's spec.
    ProviderId,
    /// Adding or removing the Machine's finalizer.
    Finalizer,
    /// Reading the Node from the API server (the cache did not have it).
    NodeGet,
    /// Cordoning the Node.
    Cordon,
    /// Force-deleting a pod (forced deletion).
    PodDelete,
    /// Deleting the Node object.
    NodeDelete,
    /// Tainting the Node out of service once its VM is gone.
    OutOfService,
    /// Asking the provider for the VM.
    ProviderCreate,
    /// Asking the provider to delete the VM.
    ProviderDelete,
}

impl Step {
    /// `error_` and the step: a short, bounded label for metrics.
    pub(crate) fn metric_label(self) -> &'static str {
        match self {
            Step::Status => "error_status",
            Step::ProviderId => "error_provider_id",
            Step::Finalizer => "error_finalizer",
            Step::NodeGet => "error_node_get",
            Step::Cordon => "error_cordon",
            Step::PodDelete => "error_pod_delete",
            Step::NodeDelete => "error_node_delete",
            Step::OutOfService => "error_out_of_service",
            Step::ProviderCreate => "error_provider_create",
            Step::ProviderDelete => "error_provider_delete",
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Step::Status => "status write",
            Step::ProviderId => "providerID write",
            Step::Finalizer => "finalizer",
            Step::NodeGet => "Node read",
            Step::Cordon => "cordon",
            Step::PodDelete => "pod deletion",
            Step::NodeDelete => "Node deletion",
            Step::OutOfService => "out-of-service taint",
            Step::ProviderCreate => "VM creation",
            Step::ProviderDelete => "VM deletion",
        }
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a reconcile failed. A step that is not done yet is not an error:
/// it is a [`Next`].
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("{step}: Kubernetes API: {source}")]
    Kube {
        step: Step,
        #[source]
        source: kube::Error,
    },
    #[error("{step}: provider {provider}: {source}")]
    Provider {
        step: Step,
        provider: String,
        #[source]
        source: ProviderError,
    },
    /// kube's finalizer helper refused the object (no name, a finalizer
    /// name that is not a JSON pointer).
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<finalizer::Error<Infallible>>),
    #[error("Machine has no namespace")]
    NoNamespace,
}

impl Error {
    /// A short, bounded label for metrics: `error_` and the step it failed
    /// at.
    pub(crate) fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube { step, .. } | Error::Provider { step, .. } => step.metric_label(),
            Error::Finalizer(_) => Step::Finalizer.metric_label(),
            Error::NoNamespace => "error_no_namespace",
        }
    }

    /// The API server answered 404.
    fn is_not_found(&self) -> bool {
        matches!(self, Error::Kube { source: kube::Error::Api(s), .. } if s.code == 404)
    }
}

/// Tags a `kube::Error` with the step it came from.
fn at(step: Step) -> impl FnOnce(kube::Error) -> Error {
    move |source| Error::Kube { step, source }
}

/// After a refused status write, come back this soon at the latest. The
/// newer copy is already on its way through the watch, which usually wakes
/// the Machine sooner; no backoff, since nothing failed.
const STALE_RETRY: Duration = Duration::from_millis(500);

/// Where a reconcile leaves a Machine: a normal value, whether a step is
/// done or not.
#[derive(Debug)]
enum Next {
    /// Come back on this action.
    Wait(Action),
    /// A status write was refused: the Machine changed since the copy this
    /// reconcile read. Come back on the newer copy.
    Stale,
    /// Deletion only: every step is done, the finalizer can go.
    Finished,
    /// Woken (by a status write of its own, say) before the provider may be
    /// asked again: come back then, keeping the backoff as it is.
    ProviderRetry(Duration),
}

pub(super) async fn reconcile(machine: Arc<Machine>, ctx: Arc<Context>) -> Result<Action, Error> {
    // Decisions read the caches: an empty cache would look like a Node with
    // no pods, or no Node at all. Until every cache has synced, nothing is
    // done; the end of the sync reconciles every Machine again.
    if !ctx.synced.load(std::sync::atomic::Ordering::Acquire) {
        return Ok(Action::await_change());
    }
    let mut timer = ctx.metrics.reconcile_timer();
    let result = reconcile_inner(&machine, &ctx).await;
    timer.record(&result, Error::metric_label);
    match result? {
        Next::Wait(action) => {
            ctx.reset_backoff(&machine);
            Ok(action)
        }
        Next::Stale => {
            timer.set_result(RESULT_CONFLICT);
            Ok(Action::requeue(STALE_RETRY))
        }
        // `reconcile_inner` removes the finalizer and waits.
        Next::Finished => Ok(Action::await_change()),
        Next::ProviderRetry(after) => Ok(Action::requeue(after)),
    }
}

async fn reconcile_inner(machine: &Arc<Machine>, ctx: &Context) -> Result<Next, Error> {
    let ns = machine.namespace().ok_or(Error::NoNamespace)?;
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), &ns);
    let ours = machine.finalizers().iter().any(|f| f == FINALIZER);
    let deleting = machine.metadata.deletion_timestamp.is_some();
    let result = match (ours, deleting) {
        (true, false) => apply(machine, ctx).await,
        (true, true) => match cleanup(machine, ctx).await {
            Ok(Next::Finished) => {
                ctx.drainer.forget(&ObjectRef::from_obj(&**machine));
                ctx.provider_answered(machine);
                // Every step is done: kube's helper removes the finalizer.
                kube_finalizer(&api, machine).await.map(Next::Wait)
            }
            other => other,
        },
        // kube's helper adds the finalizer before anything else is done
        // (or does nothing for a Machine deleted before it had one).
        (false, _) => kube_finalizer(&api, machine).await.map(Next::Wait),
    };
    match result {
        Err(e) if e.is_not_found() && machine_is_gone(&api, machine).await => {
            // A wake-up that raced the removal of the finalizer: the cached
            // copy still showed it, the Machine is gone. Nothing to do.
            tracing::debug!(machine = %machine.name_any(), "Machine already gone");
            Ok(Next::Wait(Action::await_change()))
        }
        other => other,
    }
}

/// kube's finalizer helper, for what it does best: adding the finalizer to
/// a Machine that lacks it, and removing it (a JSON patch that first tests
/// it is still there) once the deletion is done. The steps themselves run
/// outside it, so that a step not done yet is a value, not the error the
/// helper would need to keep the finalizer.
async fn kube_finalizer(api: &Api<Machine>, machine: &Arc<Machine>) -> Result<Action, Error> {
    finalizer(api, FINALIZER, Arc::clone(machine), |_| {
        futures::future::ready(Ok::<_, Infallible>(Action::await_change()))
    })
    .await
    .map_err(|e| match e {
        finalizer::Error::AddFinalizer(source) | finalizer::Error::RemoveFinalizer(source) => {
            Error::Kube {
                step: Step::Finalizer,
                source,
            }
        }
        e => Error::Finalizer(Box::new(e)),
    })
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

fn resolve_machine(m: &Machine, ctx: &Context) -> Result<Resolved, Unresolved> {
    let class_name = &m.spec.class_ref.name;
    let class = ctx
        .caches
        .classes
        .get(&ObjectRef::new(class_name))
        .ok_or_else(|| Unresolved {
            reason: "ClassNotFound",
            message: format!("MachineClass {class_name:?} does not exist"),
        })?;
    let provider = ctx
        .providers
        .get(&class.spec.provider)
        .ok_or_else(|| Unresolved {
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
    .map_err(|e| Unresolved {
        reason: "InvalidSettings",
        message: e.to_string(),
    })?;
    let provider_spec = class
        .spec
        .provider_spec
        .clone()
        .unwrap_or(serde_json::Value::Null);
    provider.validate(&provider_spec).map_err(|e| Unresolved {
        reason: "InvalidProviderSpec",
        message: format!("MachineClass {class_name:?}: {e}"),
    })?;
    Ok(Resolved {
        provider,
        settings,
        request: MachineRequest {
            namespace: m.namespace().unwrap_or_default(),
            name: m.name_any(),
            uid: m.metadata.uid.clone().unwrap_or_default(),
            class: class_name.clone(),
            secret_ref: class.spec.secret_ref.clone(),
            provider_spec,
            provider_id: m.spec.provider_id.clone(),
        },
    })
}

/// Whether a record is written when it changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Write {
    IfChanged,
    /// Written anyway: a write that changes nothing still checks the
    /// Machine's resourceVersion, and so proves the copy read is current.
    Always,
}

/// What recording a step came to.
enum Recorded {
    /// Nothing to write: the status already says it.
    Unchanged,
    /// Written: the Machine as the API server now has it.
    Written(Box<Machine>),
    /// Refused: the Machine changed since the copy the record was built on.
    Stale,
}

impl Recorded {
    /// Come back on `action`, unless the write was refused.
    fn then(self, action: Action) -> Next {
        match self {
            Recorded::Stale => Next::Stale,
            Recorded::Unchanged | Recorded::Written(_) => Next::Wait(action),
        }
    }
}

/// Writes the status `rec` implies on `m` (only if it differs, unless
/// `write` says always), on condition that `m` is the Machine's current
/// version, and, when the report is new and the write was not refused, an
/// Event.
async fn record(
    ctx: &Context,
    m: &Machine,
    rec: &StepRecord,
    write: Write,
) -> Result<Recorded, Error> {
    let current = m.status.clone().unwrap_or_default();
    let next = status_after(&current, rec, m.metadata.generation, Timestamp::now());
    let recorded = if next != current || write == Write::Always {
        let key = ObjectRef::from_obj(m);
        match write_status(ctx.client.clone(), m, &next, || {
            ctx.drainer.last_written(&key)
        })
        .await
        .map_err(at(Step::Status))?
        {
            StatusWrite::Written(w) => Recorded::Written(w),
            StatusWrite::Conflict => {
                // The step is taken again on the newer copy, and reported
                // then.
                tracing::debug!(
                    machine = %m.name_any(),
                    step = rec.report.step,
                    "status write refused: the Machine changed since it was read"
                );
                return Ok(Recorded::Stale);
            }
        }
    } else {
        Recorded::Unchanged
    };
    if !rec.report.recorded_in(current.last_operation.as_ref()) {
        announce(ctx, m, &rec.report);
    }
    Ok(recorded)
}

/// Logs a step's report and publishes it as an Event on the Machine.
fn announce(ctx: &Context, m: &Machine, report: &Report) {
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

/// `current` with `rec` applied.
fn status_after(
    current: &MachineStatus,
    rec: &StepRecord,
    generation: Option<i64>,
    now: Timestamp,
) -> MachineStatus {
    let mut next = next_status(
        current,
        rec.phase,
        &rec.conditions,
        &rec.report,
        generation,
        now,
    );
    if let Some(name) = &rec.node_ref {
        next.node_ref = Some(NodeReference { name: name.clone() });
    }
    next
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
    let node = Api::<Node>::all(ctx.client.clone())
        .get_opt(name)
        .await
        .map_err(at(Step::NodeGet))?;
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
        && let Some(n) = ctx.caches.nodes.get(&ObjectRef::new(name))
    {
        return Some(n);
    }
    let id = m.spec.provider_id.as_deref()?;
    ctx.caches
        .indexes
        .nodes_by_provider_id
        .get(&ctx.caches.nodes, id)
        .into_iter()
        .next()
}

async fn apply(m: &Machine, ctx: &Context) -> Result<Next, Error> {
    let r = match resolve_machine(m, ctx) {
        Ok(r) => r,
        Err(why) => {
            let rec = unresolved_record(m.status.as_ref().and_then(|s| s.phase), &why);
            // Nothing will change until the Machine or its class does.
            return Ok(record(ctx, m, &rec, Write::IfChanged)
                .await?
                .then(Action::await_change()));
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
    let step = next_creation_step(&facts);
    let Some(rec) = creation_record(
        &step,
        &CreationContext {
            provider: r.provider.name(),
            provider_id: m.spec.provider_id.as_deref().unwrap_or_default(),
            creation_timeout: r.settings.creation_timeout,
            health_timeout: r.settings.health_timeout,
        },
    ) else {
        // Failed: stays so until the Machine is deleted.
        return Ok(Next::Wait(Action::await_change()));
    };
    if step == CreationStep::CreateVm {
        if let Some(after) = ctx.provider_retry_in(m) {
            return Ok(Next::ProviderRetry(after));
        }
        // The VM request is recorded before the provider is asked, so that
        // a deletion knows a VM may exist. The write is also the guard of
        // "one create per Machine": it succeeds only on the Machine's
        // current version, so a reconcile woken by that very write but
        // reading a copy from before the providerID was recorded is
        // refused here instead of asking for a second VM.
        return match record(ctx, m, &rec, Write::Always).await? {
            Recorded::Stale => Ok(Next::Stale),
            Recorded::Written(w) => create_vm(&w, ctx, &r).await,
            Recorded::Unchanged => create_vm(m, ctx, &r).await,
        };
    }
    let action = match step {
        // The Node watch wakes us earlier; this is the creation deadline.
        CreationStep::WaitForNode { retry_in } => {
            Action::requeue(retry_in + Duration::from_millis(100))
        }
        // NotReady but within the health timeout: look again when it would
        // pass (a Node event wakes us earlier).
        CreationStep::Running { .. } => match facts.node {
            Some(NodeFacts {
                ready: false,
                ready_for,
                ..
            }) => Action::requeue(
                r.settings.health_timeout.saturating_sub(ready_for) + Duration::from_millis(100),
            ),
            _ => Action::await_change(),
        },
        _ => Action::await_change(),
    };
    Ok(record(ctx, m, &rec, Write::IfChanged).await?.then(action))
}

/// Asks the provider for the VM and records its providerID. `m` is the
/// Machine as the VM request was written.
async fn create_vm(m: &Machine, ctx: &Context, r: &Resolved) -> Result<Next, Error> {
    let provider = r.provider.name();
    let answer = match r.provider.create(&r.request).await {
        Ok(vm) => {
            ctx.provider_answered(m);
            // A plain merge patch: the field is set once, by this
            // controller only, and the CRD refuses to change it, so there
            // is no newer write it could undo.
            let api: Api<Machine> = Api::namespaced(ctx.client.clone(), &r.request.namespace);
            api.patch(
                &m.name_any(),
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"providerID": vm.provider_id}})),
            )
            .await
            .map_err(at(Step::ProviderId))?;
            // The spec change wakes the next step.
            return Ok(Next::Wait(Action::await_change()));
        }
        Err(e) => e,
    };
    match answer {
        ProviderError::InProgress { what, retry_after } => {
            ctx.provider_retry_after(m, retry_after);
            let rec = vm_answer_record(provider, &VmAnswer::InProgress(&what));
            Ok(record(ctx, m, &rec, Write::IfChanged)
                .await?
                .then(Action::requeue(retry_after)))
        }
        ProviderError::Unauthorized(why) => {
            let after =
                Duration::from_secs(60 * crate::machine::record::UNAUTHORIZED_RETRY_MINUTES);
            ctx.provider_retry_after(m, after);
            let rec = vm_answer_record(provider, &VmAnswer::Unauthorized(&why));
            Ok(record(ctx, m, &rec, Write::IfChanged)
                .await?
                .then(Action::requeue(after)))
        }
        e @ (ProviderError::Permanent(_) | ProviderError::InvalidSpec(_)) => {
            let rec = vm_answer_record(provider, &VmAnswer::Refused(&e.to_string()));
            Ok(record(ctx, m, &rec, Write::IfChanged)
                .await?
                .then(Action::await_change()))
        }
        e => {
            let rec = vm_answer_record(provider, &VmAnswer::Failed(&e.to_string()));
            record(ctx, m, &rec, Write::IfChanged).await?;
            Err(Error::Provider {
                step: Step::ProviderCreate,
                provider: provider.into(),
                source: e,
            })
        }
    }
}

fn pods_on(ctx: &Context, node: &str) -> Vec<Arc<Pod>> {
    ctx.caches.indexes.pods_by_node.get(&ctx.caches.pods, node)
}

fn key(p: &Pod) -> String {
    format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any())
}

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
async fn cleanup(m: &Machine, ctx: &Context) -> Result<Next, Error> {
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
    let resolved = resolve_machine(m, ctx);
    // A class that cannot be resolved never silently drops the Machine's own
    // drain settings: they apply over the built-in defaults, and the
    // DrainSettings condition says so.
    let settings = match &resolved {
        Ok(r) => r.settings.clone(),
        Err(_) => resolve(m.spec.drain.as_ref(), None, None, None).unwrap_or_default(),
    };
    let now = Timestamp::now();
    let node = match known_node.or_else(|| find_node(m, ctx)) {
        Some(n) => Some(n),
        // Deleting needs certainty: a Node missing from the cache is asked
        // for once more before the deletion acts as if it were gone.
        None => node_from_api(m, ctx).await?,
    };
    let node_facts = node.as_deref().map(|n| decide::node_facts(n, now));
    // The Node object deleted by hand while the VM may still run: its name
    // still finds the pods and attachments (by spec.nodeName).
    let vm_requested =
        m.spec.provider_id.is_some() || condition(m.status.as_ref(), VM_REQUESTED).is_some();
    let mut node_gone = match (&node_facts, vm_requested) {
        (None, true) => m
            .status
            .as_ref()
            .and_then(|s| s.node_ref.as_ref())
            .map(|r| r.name.clone()),
        _ => None,
    };
    // A Node object gone *with* its VM has nothing left to drain: berth
    // deleted both and was stopped, or its last status write conflicted,
    // before it let the Machine go. The provider is asked once, before a
    // drain starts: the pods still bound to that name are the pod garbage
    // collector's, and evicting them would only disturb their
    // replacements.
    if node_gone.is_some()
        && !ctx.drainer.knows(&ObjectRef::from_obj(m))
        && let Ok(r) = &resolved
        && matches!(
            r.provider.get(&r.request).await,
            Err(ProviderError::NotFound(_))
        )
    {
        node_gone = None;
    }
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
        Some(n) => {
            let pods = pods_on(ctx, n);
            // A pod being deleted that cannot go (a finalizer) no longer
            // holds the Machine from the deadline plus its grace period on.
            // Nor does a pod that came back after the cordon: it ends with
            // the VM (the drain reports it). The drain judges those created
            // within the clock skew of the cordon; the reconciler counts
            // only those surely after it, and those the drain judged.
            let cordoned = node
                .as_deref()
                .and_then(cordoned_at)
                .or(deadline.map(|d| d.started));
            let machine = ObjectRef::from_obj(m);
            let pods: Vec<_> = pods
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
            // static pod nor a DaemonSet's pod (its controller would only
            // recreate it; it ends with the VM), nor a pod force-deleted
            // already (a finalizer holds it: deleting it again would be a
            // request loop).
            let on_node: Vec<String> = pods
                .iter()
                .filter(|p| {
                    !matches!(
                        decide::drain_skip_reason(p),
                        Some("mirror pod" | "DaemonSet pod")
                    )
                })
                .filter(|p| p.metadata.deletion_grace_period_seconds != Some(0))
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
    let on_node = match &node_name {
        Some(n) => ctx
            .caches
            .indexes
            .attachments_by_node
            .get(&ctx.caches.attachments, n),
        None => vec![],
    };
    let attachments: Vec<String> = on_node.iter().map(|va| va.name_any()).collect();
    // The same, as an operator knows them: the PV, or the attachment of an
    // inline volume.
    let volumes: Vec<String> = on_node
        .iter()
        .map(|va| {
            va.spec
                .source
                .persistent_volume_name
                .clone()
                .unwrap_or_else(|| format!("VolumeAttachment {}", va.name_any()))
        })
        .collect();
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
        node_gone: node_gone.clone(),
        pods_to_drain,
        pods_on_node,
        drain_pending: !ctx.drainer.finished(&ObjectRef::from_obj(m)),
        volume_attachments: attachments,
        volume_detach_timed_out: detach_wait.is_some_and(|w| w >= settings.volume_detach_timeout),
    };
    let step = next_deletion_step(&facts);
    // What the drain found about node-local volumes outlives its step.
    let drained = ctx.drainer.progress(&ObjectRef::from_obj(m));
    let as_decided = match &drained {
        Some(p) => deletion_record(&step, &DeletionOutcome::AsDecided)
            .node_local(&p.node_local_lost, p.local_held.as_deref()),
        None => deletion_record(&step, &DeletionOutcome::AsDecided),
    };
    Ok(match &step {
        DeletionStep::MarkTerminating => match record(ctx, m, &as_decided, Write::IfChanged).await?
        {
            Recorded::Written(w) => Stepped::Advanced {
                machine: Some(w),
                node,
            },
            Recorded::Unchanged => Next::Wait(Action::await_change()).into(),
            Recorded::Stale => Next::Stale.into(),
        },
        DeletionStep::WaitPreDrainHooks(_) | DeletionStep::WaitPreTerminateHooks(_) => {
            record(ctx, m, &as_decided, Write::IfChanged)
                .await?
                .then(Action::await_change())
                .into()
        }
        DeletionStep::Cordon { .. } => {
            let cordoned = match node {
                Some(n) => Some(Arc::new(cordon(ctx, &n).await?)),
                None => None,
            };
            match (
                record(ctx, m, &as_decided, Write::IfChanged).await?,
                cordoned,
            ) {
                (Recorded::Stale, _) => Next::Stale.into(),
                (Recorded::Written(w), Some(n)) => Stepped::Advanced {
                    machine: Some(w),
                    node: Some(n),
                },
                (Recorded::Unchanged, Some(n)) => Stepped::Advanced {
                    machine: None,
                    node: Some(n),
                },
                (_, None) => Next::Wait(Action::await_change()).into(),
            }
        }
        DeletionStep::ForceDeletePods { pods, .. } => {
            ctx.drainer.forget(&ObjectRef::from_obj(m));
            // Each delete is pinned to the UID the cache shows: a pod that
            // took the same name elsewhere is never touched.
            for p in pods {
                let Some((ns, name)) = p.split_once('/') else {
                    continue;
                };
                let Some(pod) = ctx.caches.pods.get(&ObjectRef::new(name).within(ns)) else {
                    continue;
                };
                match crate::drain::evict::delete(&ctx.client, &pod, Some(0)).await {
                    Evicted::Accepted | Evicted::Gone => {}
                    Evicted::Refused { message }
                    | Evicted::Throttled { message, .. }
                    | Evicted::MultipleBudgets { message } => {
                        tracing::warn!(pod = %p, %message, "force delete refused");
                    }
                    Evicted::Failed(e) => return Err(at(Step::PodDelete)(e)),
                }
            }
            record(ctx, m, &as_decided, Write::IfChanged)
                .await?
                .then(Action::await_change())
                .into()
        }
        DeletionStep::Drain { node, pods } => {
            let Some(deadline) = deadline else {
                return Ok(Next::Wait(Action::await_change()).into());
            };
            let job = Job {
                machine: ObjectRef::from_obj(m),
                machine_ref: m.object_ref(&()),
                node: node.clone(),
                settings: settings.clone(),
                deadline,
                moves: m
                    .status
                    .as_ref()
                    .and_then(|s| s.drain.as_ref())
                    .map(|d| d.moves.clone())
                    .unwrap_or_default(),
                data_loss_allowed: crate::drain::class::allows_data_loss(
                    m.metadata.annotations.as_ref(),
                ),
            };
            if let Some(gone) = &node_gone
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
            let progress = ctx.drainer.ensure(job, !pods.is_empty());
            let rec = deletion_record(&step, &DeletionOutcome::Drain(drain_view(&progress)))
                .node_local(
                    progress.node_local_lost.as_slice(),
                    progress.local_held.as_deref(),
                );
            let was_false =
                condition(m.status.as_ref(), DRAIN_SETTINGS).is_some_and(|c| c.status == "False");
            let unresolved = resolved.as_ref().err();
            let rec = with_settings_condition(rec, unresolved, was_false, &describe(&settings));
            if let Some(why) = unresolved
                && !was_false
            {
                warn(
                    ctx,
                    m,
                    "DrainSettingsFromMachine",
                    settings_message(why, &describe(&settings)),
                );
            }
            // The engine's progress writes and its end wake this Machine;
            // a failed drain is retried after a pause.
            let action = match progress.outcome {
                Some(Outcome::Failed { .. }) => Action::requeue(RETRY_FAILED_AFTER),
                Some(_) if !pods.is_empty() => Action::requeue(RESTART_ENDED_AFTER),
                _ => Action::await_change(),
            };
            record(ctx, m, &rec, Write::IfChanged)
                .await?
                .then(action)
                .into()
        }
        DeletionStep::WaitVolumesDetached { .. } => {
            // VolumeAttachment events wake us; this is the detach deadline.
            let waited = detach_wait.unwrap_or_default();
            let action = Action::requeue(
                settings.volume_detach_timeout.saturating_sub(waited) + Duration::from_millis(100),
            );
            record(ctx, m, &as_decided, Write::IfChanged)
                .await?
                .then(action)
                .into()
        }
        DeletionStep::DeleteVmAndNode { .. } => {
            let left = Left {
                volumes: &volumes,
                why: if facts.force {
                    "the deletion is forced".to_string()
                } else {
                    format!(
                        "not detached within volumeDetachTimeout, {}",
                        humantime::format_duration(settings.volume_detach_timeout)
                    )
                },
            };
            delete_vm_and_node(m, ctx, resolved, &facts, &step, node, left)
                .await?
                .into()
        }
    })
}

/// Publishes a Warning Event about the Machine, in the background (an
/// Event never holds up a step).
fn warn(ctx: &Context, m: &Machine, reason: &str, note: String) {
    ctx.events.publish(
        Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(truncate(&note, 1000)),
            action: "Drain".into(),
            secondary: None,
        },
        m.object_ref(&()),
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

/// `spec.unschedulable` plus berth's NoSchedule taint. The resourceVersion
/// in the patch makes it a compare-and-swap, so a taint another writer
/// added in between is never lost. Returns the Node as written.
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
    // When it was cordoned, once: a pod created on the Node after this came
    // back (see `came_back`); one created before is drained.
    let annotations = match cordoned_at(node) {
        Some(_) => serde_json::json!({}),
        None => serde_json::json!({CORDONED_AT_ANNOTATION: Timestamp::now().to_string()}),
    };
    patch_node_with(
        ctx,
        node,
        serde_json::json!({"unschedulable": true, "taints": taints}),
        annotations,
        Step::Cordon,
    )
    .await
}

/// Merges `spec` into Node `node`'s spec, on the condition that the Node
/// is still the version read (its resourceVersion): a taint another writer
/// added in between is never lost. Returns the Node as written.
async fn patch_node(
    ctx: &Context,
    node: &Node,
    spec: serde_json::Value,
    step: Step,
) -> Result<Node, Error> {
    patch_node_with(ctx, node, spec, serde_json::json!({}), step).await
}

/// [`patch_node`], also merging `annotations` into the Node's.
async fn patch_node_with(
    ctx: &Context,
    node: &Node,
    spec: serde_json::Value,
    annotations: serde_json::Value,
    step: Step,
) -> Result<Node, Error> {
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": node.resource_version(), "annotations": annotations},
        "spec": spec,
    });
    Api::<Node>::all(ctx.client.clone())
        .patch(
            &node.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
        .map_err(at(step))
}

/// The volumes still attached to the Machine's Node when its VM is to be
/// deleted, and why.
struct Left<'a> {
    volumes: &'a [String],
    why: String,
}

/// How long berth waits, once the VM is gone and its Node tainted out of
/// service, for the attach-detach controller to release the volumes left
/// before it deletes the Node anyway: that controller's own force-detach
/// wait (`maxWaitForUnmountDuration`, 6 minutes), beyond which waiting
/// gains nothing.
const RELEASE_BOUND: Duration = Duration::from_secs(360);

async fn delete_vm_and_node(
    m: &Machine,
    ctx: &Context,
    resolved: Result<Resolved, Unresolved>,
    facts: &DeletionFacts,
    step: &DeletionStep,
    node: Option<Arc<Node>>,
    left: Left<'_>,
) -> Result<Next, Error> {
    let mut m = Cow::Borrowed(m);
    let node_name = node.as_ref().map(|n| n.name_any());
    let had_node = m
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .is_some();
    if node.is_none() && !had_node && !facts.force {
        let rec = deletion_record(step, &DeletionOutcome::DrainSkipped);
        match record(ctx, &m, &rec, Write::IfChanged).await? {
            Recorded::Stale => return Ok(Next::Stale),
            Recorded::Written(w) => m = Cow::Owned(*w),
            Recorded::Unchanged => {}
        }
    }
    let vm_requested =
        m.spec.provider_id.is_some() || condition(m.status.as_ref(), VM_REQUESTED).is_some();
    let r = match resolved {
        Ok(r) => r,
        Err(_) if !vm_requested => {
            let rec = deletion_record(step, &DeletionOutcome::NoVm);
            return Ok(match record(ctx, &m, &rec, Write::IfChanged).await? {
                Recorded::Stale => Next::Stale,
                _ => Next::Finished,
            });
        }
        Err(why) => {
            let rec = deletion_record(step, &DeletionOutcome::Unresolved(&why));
            // Keep the finalizer: never forget a VM. A fixed class wakes us.
            return Ok(record(ctx, &m, &rec, Write::IfChanged)
                .await?
                .then(Action::await_change()));
        }
    };
    // Volumes still attached as the VM goes are said once, before it goes.
    let left_reported = condition(m.status.as_ref(), VOLUMES_DETACHED)
        .is_some_and(|c| c.status == "False" && VOLUMES_LEFT_REASONS.contains(&c.reason.as_str()));
    if !left.volumes.is_empty() && !left_reported {
        let outcome = DeletionOutcome::VolumesLeft {
            volumes: left.volumes,
            why: &left.why,
            node_exists: node.is_some(),
        };
        match record(ctx, &m, &deletion_record(step, &outcome), Write::IfChanged).await? {
            Recorded::Stale => return Ok(Next::Stale),
            Recorded::Written(w) => m = Cow::Owned(*w),
            Recorded::Unchanged => {}
        }
        ctx.metrics
            .volumes_left_attached
            .inc_by(left.volumes.len() as u64);
        warn(
            ctx,
            &m,
            "VolumesLeftAttached",
            volumes_left_message(
                node_name.as_deref().unwrap_or("(gone)"),
                left.volumes,
                &left.why,
                node.is_some(),
            ),
        );
    }
    if let Some(after) = ctx.provider_retry_in(&m) {
        return Ok(Next::ProviderRetry(after));
    }
    let provider = r.provider.name();
    match r.provider.delete(&r.request).await {
        Ok(()) | Err(ProviderError::NotFound(_)) => ctx.provider_answered(&m),
        Err(ProviderError::InProgress { what, retry_after }) => {
            ctx.provider_retry_after(&m, retry_after);
            let rec = deletion_record(step, &DeletionOutcome::VmDeleteInProgress(&what));
            return Ok(record(ctx, &m, &rec, Write::IfChanged)
                .await?
                .then(Action::requeue(retry_after)));
        }
        Err(
            e @ (ProviderError::Permanent(_)
            | ProviderError::InvalidSpec(_)
            | ProviderError::Unauthorized(_)),
        ) => {
            let error = e.to_string();
            let rec = deletion_record(
                step,
                &DeletionOutcome::VmDeleteRefused {
                    provider,
                    error: &error,
                },
            );
            let after = Duration::from_secs(600);
            ctx.provider_retry_after(&m, after);
            return Ok(record(ctx, &m, &rec, Write::IfChanged)
                .await?
                .then(Action::requeue(after)));
        }
        Err(e) => {
            return Err(Error::Provider {
                step: Step::ProviderDelete,
                provider: provider.into(),
                source: e,
            });
        }
    }
    // The VM is gone (the provider said so): its Node may be declared out
    // of service, and the volumes left on it released at once.
    if let Some(n) = &node {
        let name = n.name_any();
        if !left.volumes.is_empty() {
            // A taint put by someone else without a time counts from when
            // the volumes were first waited for.
            let waited_since = condition(m.status.as_ref(), VOLUMES_DETACHED)
                .map_or_else(Timestamp::now, |c| c.last_transition_time.0);
            let since = out_of_service(ctx, n, waited_since).await?;
            let until = since + RELEASE_BOUND;
            let now = Timestamp::now();
            if now < until {
                // VolumeAttachment events wake this Machine; this is the bound.
                let wait = Duration::try_from(until.duration_since(now)).unwrap_or_default();
                let until = until.to_string();
                let outcome = DeletionOutcome::ReleasingVolumes {
                    volumes: left.volumes,
                    until: &until,
                };
                return Ok(
                    record(ctx, &m, &deletion_record(step, &outcome), Write::IfChanged)
                        .await?
                        .then(Action::requeue(wait + Duration::from_millis(100))),
                );
            }
            warn(
                ctx,
                &m,
                "VolumesNotReleased",
                format!(
                    "{} still attached to Node {name} {} after it was tainted {OUT_OF_SERVICE_TAINT}: deleting the Node; the attach-detach controller detaches them when it sees it gone",
                    left.volumes.join(", "),
                    humantime::format_duration(RELEASE_BOUND)
                ),
            );
        } else if condition(m.status.as_ref(), VOLUMES_DETACHED)
            .is_some_and(|c| c.reason == VOLUMES_LEFT_REASONS[1])
        {
            ctx.events.publish(
                Event {
                    type_: EventType::Normal,
                    reason: "VolumesReleased".into(),
                    note: Some(format!(
                        "the volumes left on Node {name} were released after it was tainted {OUT_OF_SERVICE_TAINT}"
                    )),
                    action: "Delete".into(),
                    secondary: None,
                },
                m.object_ref(&()),
            );
        }
        match Api::<Node>::all(ctx.client.clone())
            .delete(&name, &DeleteParams::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(at(Step::NodeDelete)(e)),
        }
    }
    // The VM and the Node are gone: the Machine goes, even if this last
    // record meets a newer Machine (a conflict): retrying would only find a
    // Machine whose Node and VM are gone.
    let rec = deletion_record(step, &DeletionOutcome::AsDecided);
    if let Recorded::Stale = record(ctx, &m, &rec, Write::IfChanged).await? {
        // Not written, but taken: said all the same.
        announce(ctx, &m, &rec.report);
    }
    Ok(Next::Finished)
}

/// Puts the out-of-service taint on Node `node` (its VM is gone), unless
/// it is there; returns when it was added (`otherwise` for a taint that
/// does not say). Like the cordon, a compare-and-swap that never loses
/// another writer's taint.
async fn out_of_service(
    ctx: &Context,
    node: &Node,
    otherwise: Timestamp,
) -> Result<Timestamp, Error> {
    let mut taints: Vec<Taint> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    if let Some(t) = taints
        .iter()
        .find(|t| t.key == OUT_OF_SERVICE_TAINT && t.effect == "NoExecute")
    {
        return Ok(t.time_added.as_ref().map_or(otherwise, |t| t.0));
    }
    let now = Timestamp::now();
    taints.push(Taint {
        key: OUT_OF_SERVICE_TAINT.into(),
        value: Some("nodeshutdown".into()),
        effect: "NoExecute".into(),
        time_added: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now)),
    });
    patch_node(
        ctx,
        node,
        serde_json::json!({"taints": taints}),
        Step::OutOfService,
    )
    .await?;
    tracing::info!(node = %node.name_any(), "VM gone: Node tainted out of service");
    Ok(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_step_has_its_own_error_label() {
        let steps = [
            Step::Status,
            Step::ProviderId,
            Step::Finalizer,
            Step::NodeGet,
            Step::Cordon,
            Step::PodDelete,
            Step::NodeDelete,
            Step::OutOfService,
            Step::ProviderCreate,
            Step::ProviderDelete,
        ];
        let labels: std::collections::HashSet<_> = steps.iter().map(|s| s.metric_label()).collect();
        assert_eq!(labels.len(), steps.len());
        assert!(labels.iter().all(|l| l.starts_with("error_")));
        let e = Error::Kube {
            step: Step::Cordon,
            source: kube::Error::Api(Box::new(
                kube::core::Status::failure("boom", "InternalError").with_code(500),
            )),
        };
        assert_eq!(e.metric_label(), "error_cordon");
        assert!(e.to_string().starts_with("cordon: "), "{e}");
        assert!(!e.is_not_found());
    }

    #[test]
    fn a_record_sets_the_node_only_when_it_names_one() {
        let rec = |node: Option<&str>| StepRecord {
            phase: None,
            conditions: vec![],
            report: super::super::status::Report::new("Create", "Running", State::Succeeded, ""),
            node_ref: node.map(str::to_string),
        };
        let start = MachineStatus {
            node_ref: Some(NodeReference { name: "old".into() }),
            ..Default::default()
        };
        let now = Timestamp::from_second(1_000_000).expect("valid");
        let kept = status_after(&start, &rec(None), None, now);
        assert_eq!(kept.node_ref.map(|r| r.name).as_deref(), Some("old"));
        let set = status_after(&start, &rec(Some("n1")), None, now);
        assert_eq!(set.node_ref.map(|r| r.name).as_deref(), Some("n1"));
    }
}
