//! The reconciler's status write: a compare-and-swap on the Machine's
//! `resourceVersion`.
//!
//! The status the reconciler records is computed whole from the copy of the
//! Machine it read (conditions keep their transition times, the last
//! operation is replaced only when the report changes, the conditions array
//! is written whole). Written blindly, a status computed from an older copy
//! would undo a newer write. With the copy's `resourceVersion` in the patch,
//! the API server refuses such a write with 409 Conflict instead; the
//! reconciler then comes back on the newer copy, which its watch brings.
//!
//! `status.drain` is never written here: the drain engine owns it, and
//! writes it up to once a second while a drain runs. A conflict caused by
//! that field alone does not make the copy stale for this write (it leaves
//! the field alone), so the write is made again on the newer version instead
//! of being refused: otherwise nearly every drain's start, which the engine
//! writes as the reconciler records it, would cost a refused write and a
//! second reconcile.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde::Serialize;

use crate::api::{Machine, MachineSpec, MachineStatus};

/// Writes tried when every conflict comes from `status.drain` alone.
const ATTEMPTS: usize = 3;

/// What a status write came to.
#[derive(Debug)]
pub enum StatusWrite {
    /// Written (or already so): the Machine as the API server now has it.
    Written(Box<Machine>),
    /// Refused: the Machine changed since the copy the status was computed
    /// from.
    Conflict,
}

/// The merge patch: the copy's resourceVersion as a precondition, and the
/// status.
#[derive(Debug, Serialize)]
struct StatusPatch<'a> {
    metadata: Precondition<'a>,
    status: MachineStatus,
}

impl<'a> StatusPatch<'a> {
    /// The patch of `status` without `status.drain` (absent from a merge
    /// patch, it is left as it is).
    fn new(resource_version: &'a str, status: &MachineStatus) -> Self {
        Self {
            metadata: Precondition { resource_version },
            status: MachineStatus {
                drain: None,
                ..status.clone()
            },
        }
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Precondition<'a> {
    resource_version: &'a str,
}

/// Writes `status` on Machine `read` as a merge patch of the status
/// subresource, on condition that the Machine is still at the
/// `resourceVersion` of `read` (the copy `status` was computed from).
/// `status.drain` is left out whatever it holds.
///
/// On a conflict, the newer version to try is first asked of `known` (the
/// drain engine keeps the Machine its last `status.drain` write returned,
/// which is the usual cause of the conflict), and read from the API server
/// only when that copy does not do.
///
/// A write that changes nothing still checks the precondition, without
/// bumping the resourceVersion: [`StatusWrite::Written`] then proves that
/// `read` is current, which the reconciler relies on before it asks a
/// provider for a VM. (A newer version that differs from `read` in
/// `status.drain` only counts as `read`: the write is made on it.)
///
/// Public for the integration test that shows a stale copy cannot
/// overwrite a newer status.
pub async fn write_status(
    client: Client,
    read: &Machine,
    status: &MachineStatus,
    known: impl Fn() -> Option<Machine>,
) -> Result<StatusWrite, kube::Error> {
    let api: Api<Machine> = Api::namespaced(client, &read.namespace().unwrap_or_default());
    let name = read.name_any();
    let mut base = Cow::Borrowed(read);
    for _ in 0..ATTEMPTS {
        // A copy without a resourceVersion cannot prove it is current.
        let Some(resource_version) = base.metadata.resource_version.as_deref() else {
            return Ok(StatusWrite::Conflict);
        };
        let patch = StatusPatch::new(resource_version, status);
        match api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(m) => return Ok(StatusWrite::Written(Box::new(m))),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
        let tried = base.metadata.resource_version.clone();
        let newer = match known().filter(|k| k.metadata.resource_version != tried) {
            Some(k) if same_but_drain(read, &k) => Some(k),
            _ => api.get_opt(&name).await?,
        };
        match newer {
            Some(newer) if same_but_drain(read, &newer) => base = Cow::Owned(newer),
            _ => return Ok(StatusWrite::Conflict),
        }
    }
    Ok(StatusWrite::Conflict)
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
        let status = MachineStatus {
            drain: None,
            ..m.status.clone().unwrap_or_default()
        };
        (meta, &m.spec, status)
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
    fn the_patch_carries_the_precondition_and_never_the_drain() {
        let status = MachineStatus {
            phase: Some(MachinePhase::Terminating),
            drain: Some(DrainStatus::default()),
            ..Default::default()
        };
        let body = serde_json::to_value(StatusPatch::new("42", &status)).expect("serializes");
        assert_eq!(
            body,
            serde_json::json!({
                "metadata": {"resourceVersion": "42"},
                "status": {"phase": "Terminating"}
            })
        );
    }
}
