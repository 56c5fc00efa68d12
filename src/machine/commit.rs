//! A step committed: the status its record implies (see `record`, which
//! says what a step records), written with the compare-and-swap of
//! `write`, and the Event that tells it; and where a reconcile leaves the
//! Machine ([`Next`]).

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};

use super::Context;
use super::error::{Error, Step, at};
use super::lifecycle;
use super::lookup::find_node;
use super::record::StepRecord;
use super::status::{Report, State, next_status};
use super::write::{StatusWrite, write_status};
use crate::api::{Machine, MachineStatus, NodeReference};

/// Where a reconcile leaves a Machine: a normal value, whether a step is
/// done or not.
#[derive(Debug)]
pub(super) enum Next {
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

/// Whether a record is written when it changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Write {
    IfChanged,
    /// Written anyway: a write that changes nothing still checks the
    /// Machine's resourceVersion, and so proves the copy read is current.
    Always,
}

/// What recording a step came to.
pub(super) enum Recorded {
    /// Nothing to write: the status already says it.
    Unchanged,
    /// Written: the Machine as the API server now has it.
    Written(Box<Machine>),
    /// Refused: the Machine changed since the copy the record was built on.
    Stale,
}

impl Recorded {
    /// Come back on `action`, unless the write was refused.
    pub(super) fn then(self, action: Action) -> Next {
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
pub(super) async fn record(
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
        event(ctx, m, &rec.report);
    }
    if !matches!(recorded, Recorded::Stale) {
        node_lifecycle(ctx, m, rec).await?;
    }
    Ok(recorded)
}

/// The Node's lifecycle conditions (see `super::lifecycle`) as a step's
/// record of the Machine's `Drained` condition implies them, written when
/// the Node, by the cache, does not say them yet: every reconcile of the
/// drain checks them again, so a write that failed is taken again.
async fn node_lifecycle(ctx: &Context, m: &Machine, rec: &StepRecord) -> Result<(), Error> {
    let Some(want) = rec.conditions.iter().find_map(lifecycle::node_conditions) else {
        return Ok(());
    };
    let Some(node) = find_node(m, ctx) else {
        return Ok(());
    };
    write_node_lifecycle(ctx, &node, &want).await
}

/// Writes `want`, the lifecycle conditions of `node`, unless it says them
/// already.
pub(super) async fn write_node_lifecycle(
    ctx: &Context,
    node: &k8s_openapi::api::core::v1::Node,
    want: &[super::status::Cond],
) -> Result<(), Error> {
    let Some(patch) = lifecycle::patch(node, want, Timestamp::now()) else {
        return Ok(());
    };
    super::node::lifecycle_conditions(&ctx.client, &node.name_any(), &patch)
        .await
        .map_err(at(Step::NodeConditions))?;
    Ok(())
}

/// Logs a step's report and publishes it as an Event on the Machine.
pub(super) fn event(ctx: &Context, m: &Machine, report: &Report) {
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
    // An Event is best effort and published in the background: it must
    // neither stop nor slow the lifecycle.
    ctx.events.event(
        type_,
        m.object_ref(&()),
        report.op,
        report.step,
        truncate(&report.description, 1000),
        None,
    );
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
    if let Some(r) = &rec.remediation {
        next.remediation.clone_from(r);
    }
    next
}

pub(super) fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

pub(super) fn elapsed_since(
    t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
) -> Duration {
    t.and_then(|t| Duration::try_from(Timestamp::now().duration_since(t.0)).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_sets_the_node_only_when_it_names_one() {
        let rec = |node: Option<&str>| StepRecord {
            phase: None,
            conditions: vec![],
            report: Report::new("Create", "Running", State::Succeeded, ""),
            node_ref: node.map(str::to_string),
            remediation: None,
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
