//! The deletion's last step: the VM deleted (asked of the provider at its
//! pace, a VM not found waited on), the volumes still attached said once,
//! the Node tainted out of service and deleted, the Machine let go.

use std::borrow::Cow;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};

use super::{DetachState, Observed, await_change, warn};
use crate::api::Machine;
use crate::api::conditions::VM_REQUESTED;
use crate::machine::Context;
use crate::machine::commit::{Next, Recorded, Write, elapsed_since, event, record};
use crate::machine::decide::{self, DeletionStep};
use crate::machine::error::{Error, Step, at};
use crate::machine::lookup::{Resolved, VmOwner};
use crate::machine::node;
use crate::machine::record::{
    DeletionOutcome, OUT_OF_SERVICE_TAINT, StepRecord, deletion_record, volumes_left_message,
};
use crate::machine::status::condition;
use crate::providers::ProviderError;

/// How long berth waits, once the VM is gone and its Node tainted out of
/// service, for the attach-detach controller to release the volumes left
/// before it deletes the Node anyway: that controller's own force-detach
/// wait (`maxWaitForUnmountDuration`, 6 minutes), beyond which waiting
/// gains nothing.
const RELEASE_BOUND: Duration = Duration::from_secs(360);

/// A step that may go on (`None`) or stop the deletion here.
type Then = Option<Next>;

/// Deletes the VM, then the Node, then lets the Machine go. The VM is
/// never forgotten: a class that cannot be resolved keeps the finalizer.
pub(super) async fn await_instance_termination(
    ctx: &Context,
    m: &Machine,
    o: Observed,
    step: &DeletionStep,
) -> Result<Next, Error> {
    let mut m = Cow::Borrowed(m);
    let had_node = m
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .is_some();
    if o.node.is_none() && !had_node && !o.facts.force {
        let rec = deletion_record(step, &DeletionOutcome::DrainSkipped);
        if let Some(next) = rerecord(ctx, &mut m, &rec).await? {
            return Ok(next);
        }
    }
    if let VmOwner::Foreign(why) = &o.owner {
        warn(
            ctx,
            &m,
            "ForeignVm",
            format!("{why}: its Node and VM are left alone, and the Machine goes"),
        );
        let rec = deletion_record(step, &DeletionOutcome::NoVm);
        return Ok(match record(ctx, &m, &rec, Write::IfChanged).await? {
            Recorded::Stale => Next::Stale,
            _ => Next::Finished,
        });
    }
    let vm_requested =
        m.spec.provider_id.is_some() || condition(m.status.as_ref(), VM_REQUESTED).is_some();
    let r = match &o.resolved {
        Ok(r) => r,
        Err(_) if !vm_requested => {
            let rec = deletion_record(step, &DeletionOutcome::NoVm);
            return Ok(match record(ctx, &m, &rec, Write::IfChanged).await? {
                Recorded::Stale => Next::Stale,
                _ => Next::Finished,
            });
        }
        Err(why) => {
            let rec = deletion_record(step, &DeletionOutcome::Unresolved(why));
            // Keep the finalizer: never forget a VM. A fixed class wakes us.
            return await_change(ctx, &m, &rec).await;
        }
    };
    if let Some(next) = report_volumes_left(ctx, &mut m, &o, step).await? {
        return Ok(next);
    }
    // Read again: the records above may have changed the condition.
    let detach = DetachState::of(&m);
    if let Some(next) = delete_vm(ctx, &m, r, step).await? {
        return Ok(next);
    }
    if let Some(n) = &o.node
        && let Some(next) = release_and_delete_node(ctx, &m, &o.volumes, detach, n, step).await?
    {
        return Ok(next);
    }
    // The VM and the Node are gone: the Machine goes, even if this last
    // record meets a newer Machine (a conflict): retrying would only find a
    // Machine whose Node and VM are gone.
    let rec = deletion_record(step, &DeletionOutcome::AsDecided);
    if let Recorded::Stale = record(ctx, &m, &rec, Write::IfChanged).await? {
        // Not written, but taken: said all the same.
        event(ctx, &m, &rec.report);
    }
    Ok(Next::Finished)
}

/// Records `rec` and goes on from the Machine as written; stops on a
/// refused write.
async fn rerecord(
    ctx: &Context,
    m: &mut Cow<'_, Machine>,
    rec: &StepRecord,
) -> Result<Then, Error> {
    match record(ctx, m, rec, Write::IfChanged).await? {
        Recorded::Stale => return Ok(Some(Next::Stale)),
        Recorded::Written(w) => *m = Cow::Owned(*w),
        Recorded::Unchanged => {}
    }
    Ok(None)
}

/// The volumes still attached as the VM goes, and why: said once, before
/// it goes (a condition, a Warning, the metric).
async fn report_volumes_left(
    ctx: &Context,
    m: &mut Cow<'_, Machine>,
    o: &Observed,
    step: &DeletionStep,
) -> Result<Then, Error> {
    if o.volumes.is_empty() || DetachState::of(m).left_reported {
        return Ok(None);
    }
    let why = if o.facts.force {
        "the deletion is forced".to_string()
    } else {
        format!(
            "not detached within volumeDetachTimeout, {}",
            humantime::format_duration(o.settings.volume_detach_timeout)
        )
    };
    let outcome = DeletionOutcome::VolumesLeft {
        volumes: &o.volumes,
        why: &why,
        node_exists: o.node.is_some(),
    };
    if let Some(next) = rerecord(ctx, m, &deletion_record(step, &outcome)).await? {
        return Ok(Some(next));
    }
    ctx.metrics
        .volumes_left_attached
        .inc_by(o.volumes.len() as u64);
    let node_name = o.node.as_ref().map(|n| n.name_any());
    warn(
        ctx,
        m,
        "VolumesLeftAttached",
        volumes_left_message(
            node_name.as_deref().unwrap_or("(gone)"),
            &o.volumes,
            &why,
            o.node.is_some(),
        ),
    );
    Ok(None)
}

/// Asks the provider to delete the VM; goes on once it is gone.
async fn delete_vm(
    ctx: &Context,
    m: &Machine,
    r: &Resolved,
    step: &DeletionStep,
) -> Result<Then, Error> {
    if let Some(after) = ctx.provider_retry_in(m) {
        return Ok(Some(Next::ProviderRetry(after)));
    }
    let provider = r.provider.name();
    let answer = r.provider.delete(&r.request).await;
    if !matches!(answer, Err(ProviderError::NotFound(_))) {
        ctx.vm_not_found_cleared(m);
    }
    let not_found;
    let (rec, after) = match answer {
        Ok(()) => {
            ctx.provider_answered(m);
            return Ok(None);
        }
        // Not found is not gone: an eventually consistent cloud does not
        // find a VM that runs, for a while. Gone once that lasted the
        // grace; asked again meanwhile, and said.
        Err(ProviderError::NotFound(what)) => {
            ctx.provider_answered(m);
            let waited = ctx.vm_not_found_for(m);
            let Some(again) = decide::ask_again_for_vm(waited, ctx.vm_not_found_grace) else {
                ctx.vm_not_found_cleared(m);
                return Ok(None);
            };
            not_found = format!(
                "provider {provider} does not find the VM ({what}): it counts as gone (and its Node is deleted) once that has lasted {} (--vm-not-found-grace), as a cloud may not find a VM that runs for a while; asked again every {}s",
                humantime::format_duration(ctx.vm_not_found_grace),
                decide::NOT_FOUND_ASK_EVERY.as_secs()
            );
            (
                deletion_record(step, &DeletionOutcome::VmDeleteInProgress(&not_found)),
                again,
            )
        }
        Err(ProviderError::InProgress { what, retry_after }) => (
            deletion_record(step, &DeletionOutcome::VmDeleteInProgress(&what)),
            decide::ask_again_in(
                retry_after,
                elapsed_since(m.metadata.deletion_timestamp.as_ref()),
            ),
        ),
        Err(
            e @ (ProviderError::Permanent(_)
            | ProviderError::InvalidSpec(_)
            | ProviderError::Unauthorized(_)),
        ) => {
            let error = e.to_string();
            let outcome = DeletionOutcome::VmDeleteRefused {
                provider,
                error: &error,
            };
            (deletion_record(step, &outcome), Duration::from_secs(600))
        }
        Err(e) => {
            return Err(Error::Provider {
                step: Step::ProviderDelete,
                provider: provider.into(),
                source: e,
            });
        }
    };
    ctx.provider_retry_after(m, after);
    Ok(Some(
        record(ctx, m, &rec, Write::IfChanged)
            .await?
            .then(Action::requeue(after)),
    ))
}

/// The VM is gone (the provider said so): its Node is declared out of
/// service, so that the volumes left on it are released at once, waited
/// for up to [`RELEASE_BOUND`], and the Node deleted.
async fn release_and_delete_node(
    ctx: &Context,
    m: &Machine,
    volumes: &[String],
    detach: DetachState,
    n: &Node,
    step: &DeletionStep,
) -> Result<Then, Error> {
    let name = n.name_any();
    if !volumes.is_empty() {
        // A taint put by someone else without a time counts from when the
        // volumes were first waited for.
        let waited_since = detach.since.unwrap_or_else(Timestamp::now);
        let since = node::out_of_service(&ctx.client, n, waited_since)
            .await
            .map_err(at(Step::OutOfService))?;
        let until = since + RELEASE_BOUND;
        let now = Timestamp::now();
        if now < until {
            // VolumeAttachment events wake this Machine; this is the bound.
            let wait = Duration::try_from(until.duration_since(now)).unwrap_or_default();
            let until = until.to_string();
            let outcome = DeletionOutcome::ReleasingVolumes {
                volumes,
                until: &until,
            };
            return Ok(Some(
                record(ctx, m, &deletion_record(step, &outcome), Write::IfChanged)
                    .await?
                    .then(Action::requeue(wait + Duration::from_millis(100))),
            ));
        }
        warn(
            ctx,
            m,
            "VolumesNotReleased",
            format!(
                "{} still attached to Node {name} {} after it was tainted {OUT_OF_SERVICE_TAINT}: deleting the Node; the attach-detach controller detaches them when it sees it gone",
                volumes.join(", "),
                humantime::format_duration(RELEASE_BOUND)
            ),
        );
    } else if detach.releasing {
        ctx.events.normal(m.object_ref(&()), "Delete", "VolumesReleased", format!(
                    "the volumes left on Node {name} were released after it was tainted {OUT_OF_SERVICE_TAINT}"
                ), None);
    }
    // Pinned to the UID of the Node found to be this Machine's: a Node
    // that took its name meanwhile is never deleted for it.
    match node::delete_pinned(&ctx.client, n).await {
        Ok(true) => Ok(None),
        Ok(false) => {
            tracing::warn!(node = %name, "the Node was replaced by one of the same name before its deletion: left alone");
            Ok(None)
        }
        Err(e) => Err(at(Step::NodeDelete)(e)),
    }
}
