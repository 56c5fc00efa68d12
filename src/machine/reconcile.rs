//! Observe, decide, act, record. Every step here is idempotent and safe to
//! cancel at any await point (the contract of kube-runtime's `finalizer`).
//!
//! What a step records comes from `record` (pure); this module only reads
//! the caches, calls the API server and the provider, and writes the record
//! with the compare-and-swap of `write`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{self, finalizer};
use kube::runtime::reflector::ObjectRef;

use super::Context;
use super::commit::Next;
use super::error::{Error, Step};
use crate::api::{FINALIZER, Machine};
use crate::telemetry::RESULT_CONFLICT;

/// After a refused status write, come back this soon at the latest. The
/// newer copy is already on its way through the watch, which usually wakes
/// the Machine sooner; no backoff, since nothing failed.
const STALE_RETRY: Duration = Duration::from_millis(500);

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
        (true, false) => super::creation::apply(machine, ctx).await,
        (true, true) => match super::deletion::cleanup(machine, ctx).await {
            Ok(Next::Finished) => {
                ctx.drainer.forget(&ObjectRef::from_obj(&**machine));
                ctx.provider_answered(machine);
                ctx.set_vm_owned(machine, false);
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
