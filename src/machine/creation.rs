//! The creation of a Machine: its VM asked for once, its Node waited for,
//! its health watched.

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;

use super::Context;
use super::commit::{Next, Recorded, Write, elapsed_since, record};
use super::decide::{self, CreationFacts, CreationStep, NodeFacts, next_creation_step};
use super::error::{Error, Step, at};
use super::lookup::{Resolved, find_node, resolve_machine};
use super::record::{
    CreationContext, VmAnswer, creation_record, unresolved_record, vm_answer_record,
};
use super::remediation::{Handled, apply as apply_remediation};
use crate::api::Machine;
use crate::providers::ProviderError;

pub(super) async fn apply(m: &Machine, ctx: &Context) -> Result<Next, Error> {
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
    let (named, recheck_in) = match apply_remediation(m, ctx, &r, node.as_deref()).await? {
        Handled::Done(next) => return Ok(next),
        Handled::Continue { cond, recheck_in } => (cond, recheck_in),
    };
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
            last_operation: m
                .status
                .as_ref()
                .and_then(|s| s.last_operation.as_ref())
                .map_or("", |o| o.description.as_str()),
        },
    ) else {
        // Failed: stays so until the Machine is deleted.
        return Ok(Next::Wait(Action::await_change()));
    };
    let rec = match named {
        Some(c) => rec.with(c),
        None => rec,
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
                (r.settings.health_timeout.saturating_sub(ready_for) + Duration::from_millis(100))
                    .min(recheck_in.unwrap_or(Duration::MAX)),
            ),
            // A condition its class lists, not failing for long enough yet.
            _ => recheck_in.map_or_else(Action::await_change, Action::requeue),
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
