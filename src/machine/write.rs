//! The Machine's status has two writers; this is their protocol.
//!
//! - **The drain engine owns `status.drain`.** One task per running drain
//!   (`crate::drain::engine`'s progress writer) writes the whole field by
//!   server-side apply under its own field manager, `berth-drain`: a field
//!   it leaves out is removed, and no other writer's copy of the Machine
//!   can undo its progress or its move records. It writes up to once a
//!   second, and a move's record at once, before that move's eviction. The task lives exactly as long as its
//!   drain, so a drain stopped from outside (restarted, leadership lost)
//!   makes no stale final write.
//! - **The reconciler owns the rest of the status** (phase, conditions,
//!   last operation, node reference), written here: a merge patch with a
//!   compare-and-swap on the `resourceVersion` of the copy it computed the
//!   status from ([`crate::controller::status`], the discipline of every
//!   controller of berth). `status.drain` is never part of it.
//! - **A conflict caused by `status.drain` alone** does not make the
//!   reconciler's copy stale: the newer version is asked first of the
//!   engine (the Machine its last write returned, the usual cause) and
//!   read from the API server only when that copy does not do; when it
//!   differs from the copy in nothing but `status.drain`, the write is made
//!   on it. Otherwise nearly every drain's start, which the engine writes
//!   as the reconciler records it, would cost a refused write and a second
//!   reconcile. Any other change refuses the write, and the reconciler
//!   comes back on the newer copy.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use kube::api::Api;
use kube::{Client, ResourceExt};

use crate::api::{Machine, MachineSpec, MachineStatus};

/// What a status write of a Machine came to.
pub type StatusWrite = crate::controller::status::StatusWrite<Machine>;

/// Writes `status` on Machine `read` by the reconciler's side of the
/// protocol above: on condition that the Machine is still at the
/// `resourceVersion` of `read` (the copy `status` was computed from), or at
/// a newer one that differs only in `status.drain` (asked first of
/// `known`). `status.drain` is left out whatever it holds.
///
/// A write that changes nothing still checks the precondition:
/// [`StatusWrite::Written`] then proves that `read` is current, which the
/// reconciler relies on before it asks a provider for a VM.
///
/// Public for the integration test that shows, against the API server,
/// that a stale copy cannot overwrite a newer status and that the engine's
/// writes do not refuse the reconciler's.
pub async fn write_status(
    client: Client,
    read: &Machine,
    status: &MachineStatus,
    known: impl Fn() -> Option<Machine>,
) -> Result<StatusWrite, kube::Error> {
    let api: Api<Machine> = Api::namespaced(client, &read.namespace().unwrap_or_default());
    // A remediation ended or canceled is taken out: absent from a merge
    // patch, it would be left as it was.
    let mut body = serde_json::to_value(without_drain(status)).map_err(kube::Error::SerdeError)?;
    if status.remediation.is_none()
        && let Some(o) = body.as_object_mut()
    {
        o.insert("remediation".into(), serde_json::Value::Null);
    }
    crate::controller::status::write_status_over(&api, read, &body, known, |newer| {
        same_but_drain(read, newer)
    })
    .await
}

/// `status` without `status.drain` (absent from a merge patch, it is left
/// as it is).
fn without_drain(status: &MachineStatus) -> MachineStatus {
    MachineStatus {
        drain: None,
        ..status.clone()
    }
}

/// Whether `a` and `b` differ in nothing but `status.drain` (and the
/// bookkeeping of any write: resourceVersion, managedFields).
fn same_but_drain(a: &Machine, b: &Machine) -> bool {
    fn key(m: &Machine) -> (ObjectMeta, &MachineSpec, MachineStatus) {
        let meta = ObjectMeta {
            resource_version: None,
            managed_fields: None,
            ..m.metadata.clone()
        };
        (
            meta,
            &m.spec,
            without_drain(&m.status.clone().unwrap_or_default()),
        )
    }
    key(a) == key(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{DrainStatus, MachinePhase};

    fn machine(rv: &str, phase: MachinePhase, pods_total: Option<u32>) -> Machine {
        let mut m = Machine::new("m", MachineSpec::default());
        m.metadata.namespace = Some("ns".into());
        m.metadata.resource_version = Some(rv.into());
        m.status = Some(MachineStatus {
            phase: Some(phase),
            drain: pods_total.map(|n| DrainStatus {
                pods_total: n,
                ..Default::default()
            }),
            ..Default::default()
        });
        m
    }

    #[test]
    fn only_the_drain_engines_field_does_not_make_a_copy_stale() {
        use MachinePhase::{Running, Terminating};
        let read = machine("1", Terminating, None);
        let cases = [
            (machine("2", Terminating, Some(3)), true, "the engine wrote"),
            (machine("3", Terminating, None), true, "a write of nothing"),
            (machine("4", Running, None), false, "the phase changed"),
            (machine("5", Running, Some(3)), false, "both changed"),
        ];
        for (newer, same, what) in cases {
            assert_eq!(same_but_drain(&read, &newer), same, "{what}");
        }
        let mut labelled = machine("6", Terminating, None);
        labelled.metadata.labels = Some([("a".to_string(), "b".to_string())].into());
        assert!(!same_but_drain(&read, &labelled), "metadata counts");
        let mut no_status = read.clone();
        no_status.status = None;
        assert!(
            !same_but_drain(&no_status, &machine("7", Terminating, Some(1))),
            "a phase appeared"
        );
        let mut drain_only = no_status.clone();
        drain_only.status = Some(MachineStatus {
            drain: Some(DrainStatus::default()),
            ..Default::default()
        });
        assert!(
            same_but_drain(&no_status, &drain_only),
            "a first drain write"
        );
    }

    #[test]
    fn the_drain_is_never_written() {
        let status = MachineStatus {
            phase: Some(MachinePhase::Terminating),
            drain: Some(DrainStatus::default()),
            ..Default::default()
        };
        let body = serde_json::to_value(without_drain(&status)).expect("serializes");
        assert_eq!(body, serde_json::json!({"phase": "Terminating"}));
    }
}
