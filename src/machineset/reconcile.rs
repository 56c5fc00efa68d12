//! One MachineSet's reconcile: read its Machines from the cache, create or
//! delete to match `replicas` (unless earlier requests are not yet in the
//! cache), and write the status when it changed.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};

use super::decide::{self, Failure, MachineFacts, Observed, Scale};
use super::observe::{candidate, facts};
use super::order::{self, Candidate};
use super::{Context, EXPECTATION_TTL};
use crate::api::{Machine, MachineSet, MachineSetStatus, SUPERSEDED_ANNOTATION};
use crate::controller::status::{StatusWrite, write_status};

#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("MachineSet has no namespace or UID")]
    Incomplete,
    #[error("writing the status: {0}")]
    Status(#[source] kube::Error),
    #[error("deleting Machine {machine}: {source}")]
    Delete {
        machine: String,
        #[source]
        source: kube::Error,
    },
}

pub(crate) async fn reconcile(set: Arc<MachineSet>, ctx: Arc<Context>) -> Result<Action, Error> {
    let (Some(ns), Some(uid)) = (set.namespace(), set.uid()) else {
        return Err(Error::Incomplete);
    };
    if set.metadata.deletion_timestamp.is_some() {
        // The garbage collector deletes its Machines (they are owned).
        ctx.expectations.forget(&uid);
        return Ok(Action::await_change());
    }
    let caches = &ctx.caches;
    let now = Timestamp::now();
    let owned: Vec<Arc<Machine>> = caches
        .machines_of_set(&uid)
        .into_iter()
        .filter(|m| m.namespace().as_deref() == Some(ns.as_str()))
        .collect();
    let (deleting, active): (Vec<_>, Vec<_>) = owned
        .iter()
        .partition(|m| m.metadata.deletion_timestamp.is_some());

    let settled = ctx.expectations.settled(&uid, |name, created| {
        let cached = caches.machines.get(&ObjectRef::new(name).within(&ns));
        match (cached, created) {
            (Some(_), true) => true,
            (None, true) => false,
            (Some(m), false) => m.metadata.deletion_timestamp.is_some(),
            (None, false) => true,
        }
    });

    let template_labels = &set.spec.template.metadata.labels;
    let mut failure = (!decide::selects(&set.spec.selector, template_labels)).then(|| Failure {
        reason: "SelectorMismatch",
        message: format!(
            "the selector ({}) does not match the template's labels: no Machine is created",
            decide::selector_string(&set.spec.selector)
        ),
    });
    let superseded = set.annotations().contains_key(SUPERSEDED_ANNOTATION);
    // A create the API server refused (a ResourceQuota, an admission
    // webhook) is tried again with backoff: nothing else wakes the set when
    // the quota is raised or the webhook mended.
    let mut refused = false;
    if settled {
        match decide::scale(set.spec.replicas, active.len()) {
            // An old set of a MachineDeployment only scales down: what it
            // lacks is made up by the new template's set.
            Scale::Create(n) if failure.is_none() && !superseded => {
                failure = create(&set, &ns, &uid, n, active.len(), &ctx).await;
                refused = failure.is_some();
            }
            Scale::Create(_) | Scale::Hold => {}
            Scale::Delete(n) => {
                scale_down(&set, &ns, &uid, &active, n, now, &ctx).await?;
            }
        }
    }

    let facts: Vec<MachineFacts> = active.iter().map(|m| facts(m, caches)).collect();
    let current = set.status.clone().unwrap_or_default();
    let (status, next_change) = decide::next_status(
        &current,
        &Observed {
            wanted: set.spec.replicas,
            active: &facts,
            deleting: deleting.len(),
            min_ready: SignedDuration::from_secs(set.spec.min_ready_seconds.unwrap_or(0).into()),
            selector: decide::selector_string(&set.spec.selector),
            generation: set.metadata.generation,
            failure,
        },
        now,
    );
    if status != current && !wrote_status(&ctx, &set, &ns, &status).await? {
        return Ok(Action::await_change());
    }
    let retry = if refused {
        Some(ctx.backoff.next(&set))
    } else {
        ctx.reset_backoff(&set);
        None
    };
    // Timers only: a Machine becoming available after minReadySeconds, a
    // refused create tried again, and a safety net for expectations whose
    // watch event never comes. Every other change arrives as a watch event.
    let after = [
        next_change.and_then(|d| Duration::try_from(d).ok()),
        (!settled).then_some(EXPECTATION_TTL),
        retry,
    ]
    .into_iter()
    .flatten()
    .min();
    Ok(after.map_or_else(Action::await_change, Action::requeue))
}

/// Writes `status` on `set`, computed from that copy, unless the set
/// changed since (compare-and-swap, see [`crate::controller::status`]).
/// False when refused: the watch brings the newer copy, and the set is
/// reconciled again on it.
async fn wrote_status(
    ctx: &Context,
    set: &MachineSet,
    ns: &str,
    status: &MachineSetStatus,
) -> Result<bool, Error> {
    let api = Api::<MachineSet>::namespaced(ctx.client.clone(), ns);
    let w = write_status(&api, set, status)
        .await
        .map_err(Error::Status)?;
    if matches!(w, StatusWrite::Conflict) {
        tracing::debug!(machineset = %set.name_any(), namespace = ns, "status write refused: the set changed since it was read");
    }
    Ok(matches!(w, StatusWrite::Written(_)))
}

/// Creates `n` Machines from the template; the failure to report, if one
/// create failed (the rest wait for the next reconcile).
async fn create(
    set: &MachineSet,
    ns: &str,
    uid: &str,
    n: usize,
    active: usize,
    ctx: &Context,
) -> Option<Failure> {
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), ns);
    let name = set.name_any();
    let template = &set.spec.template;
    for i in 0..n {
        let mut spec = template.spec.clone();
        spec.provider_id = None;
        let m = Machine {
            metadata: ObjectMeta {
                generate_name: Some(format!("{name}-")),
                namespace: Some(ns.to_string()),
                labels: Some(template.metadata.labels.clone()),
                annotations: (!template.metadata.annotations.is_empty())
                    .then(|| template.metadata.annotations.clone()),
                owner_references: set.controller_owner_ref(&()).map(|o| vec![o]),
                ..ObjectMeta::default()
            },
            spec,
            status: None,
        };
        match api.create(&PostParams::default(), &m).await {
            Ok(created) => {
                let machine = created.name_any();
                ctx.expectations.expect(uid, Some(machine.clone()), None);
                tracing::info!(machineset = %name, namespace = ns, %machine, "created Machine");
                ctx.events.normal(
                    set.object_ref(&()),
                    "CreateMachine",
                    "ScaledUp",
                    format!(
                        "created Machine {machine} ({} of {} replicas)",
                        active + i + 1,
                        set.spec.replicas
                    ),
                    Some(created.object_ref(&())),
                );
            }
            Err(e) => {
                let why = match &e {
                    kube::Error::Api(s) => format!(
                        "{} ({}, {})",
                        without_generated_name(&s.message),
                        s.reason,
                        s.code
                    ),
                    other => other.to_string(),
                };
                let message = format!("creating a Machine from the template: {why}");
                tracing::warn!(machineset = %name, namespace = ns, error = %e, "could not create a Machine");
                ctx.events.warning(
                    set.object_ref(&()),
                    "CreateMachine",
                    "CreateFailed",
                    message.clone(),
                    None,
                );
                return Some(Failure {
                    reason: "CreateFailed",
                    message,
                });
            }
        }
    }
    None
}

/// The API server's refusal of a create without the name it generated
/// for the Machine (`machines.berth.dev "pool-x7k2p" is forbidden: ...`):
/// the same refusal reads the same, so that the set's status does not
/// change, and wake the set, at every attempt.
fn without_generated_name(message: &str) -> String {
    let Some(end) = message.find("\" is ") else {
        return message.to_string();
    };
    match message[..end].rfind('"') {
        Some(start) => format!("{}\"…{}", &message[..start], &message[end..]),
        None => message.to_string(),
    }
}

/// Deletes the `n` Machines [`order::choose`] puts first, with an Event on
/// the set and on each Machine saying why it was chosen.
async fn scale_down(
    set: &MachineSet,
    ns: &str,
    uid: &str,
    active: &[&Arc<Machine>],
    n: usize,
    now: Timestamp,
    ctx: &Context,
) -> Result<(), Error> {
    let candidates: Vec<Candidate> = active.iter().map(|m| candidate(m, &ctx.caches)).collect();
    let chosen = order::choose(candidates, n);
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), ns);
    let from = active.len();
    let to = set.spec.replicas.max(0);
    for c in chosen {
        let Some(m) = active.iter().find(|m| m.name_any() == c.name) else {
            continue;
        };
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: m.uid(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(&c.name, &dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(source) => {
                return Err(Error::Delete {
                    machine: c.name.clone(),
                    source,
                });
            }
        }
        ctx.expectations.expect(uid, None, Some(c.name.clone()));
        let note = format!(
            "deleted Machine {} to scale from {from} to {to}: {}",
            c.name, c.reason
        );
        tracing::info!(machineset = %set.name_any(), namespace = ns, machine = %c.name, why = c.why.as_str(), %now, "{note}");
        ctx.events.normal(
            set.object_ref(&()),
            "DeleteMachine",
            "ScaledDown",
            note,
            Some(m.object_ref(&())),
        );
        ctx.events.normal(
            m.object_ref(&()),
            "DeleteMachine",
            "DeletedByMachineSet",
            format!(
                "MachineSet {} scaled from {from} to {to} and chose this Machine: {}",
                set.name_any(),
                c.reason
            ),
            Some(set.object_ref(&())),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_reads_the_same_whatever_name_was_generated() {
        let a = without_generated_name(
            "machines.berth.dev \"pool-x7k2p\" is forbidden: exceeded quota: machines",
        );
        let b = without_generated_name(
            "machines.berth.dev \"pool-q9w4z\" is forbidden: exceeded quota: machines",
        );
        assert_eq!(a, b);
        assert_eq!(
            a,
            "machines.berth.dev \"…\" is forbidden: exceeded quota: machines"
        );
        assert_eq!(
            without_generated_name("connection refused"),
            "connection refused"
        );
    }
}
