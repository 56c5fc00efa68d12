//! The one way berth's controllers write an object's status: a merge patch
//! of the status subresource with a compare-and-swap on the
//! `resourceVersion` of the copy the status was computed from.
//!
//! A controller computes a status whole from the copy it read (conditions
//! keep their transition times, arrays are written whole). Written blindly,
//! a status computed from an older copy would undo a newer write, by
//! another writer or by an earlier reconcile whose watch event has not come
//! yet. With the copy's `resourceVersion` in the patch, the API server
//! refuses such a write with 409 Conflict instead, and the controller comes
//! back on the newer copy, which its watch brings.
//!
//! A writer that shares the status with another (the Machine: the drain
//! engine owns `status.drain`, see [`crate::machine::write`]) may say which
//! newer copies it can write over: those that differ from its own only in
//! the other writer's fields. The write is then made again on the newer
//! copy instead of being refused.

use std::borrow::Cow;

use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Writes tried while every conflict comes from a newer copy the writer
/// may write over.
const ATTEMPTS: usize = 3;

/// What a status write came to.
#[derive(Debug)]
pub enum StatusWrite<K> {
    /// Written (or already so): the object as the API server now has it.
    Written(Box<K>),
    /// Refused: the object changed since the copy the status was computed
    /// from (or has no `resourceVersion` to prove it did not).
    Conflict,
}

/// The merge patch: the copy's resourceVersion as a precondition, and the
/// status.
#[derive(Debug, Serialize)]
struct StatusPatch<'a, S> {
    metadata: Precondition<'a>,
    status: &'a S,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Precondition<'a> {
    resource_version: &'a str,
}

/// Writes `status` on `read` (the copy it was computed from) as a merge
/// patch of the status subresource, on condition that the object is still
/// at `read`'s `resourceVersion`, for a writer that shares the status with
/// another.
///
/// On a conflict, a newer copy is first asked of `known` (a copy the caller
/// already holds, e.g. what another writer's last write returned), then
/// read from the API server; when `may_write_over` says the writer may
/// write over it, the write is made again on it, up to three times.
///
/// A write that changes nothing still checks the precondition without
/// bumping the `resourceVersion`: [`StatusWrite::Written`] then proves that
/// `read` is current.
pub async fn write_status_over<K, S>(
    api: &Api<K>,
    read: &K,
    status: &S,
    known: impl Fn() -> Option<K>,
    may_write_over: impl Fn(&K) -> bool,
) -> Result<StatusWrite<K>, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    S: Serialize + std::fmt::Debug,
{
    write(api, read, status, known, may_write_over, true).await
}

/// Writes `status` on `read` as [`write_status_over`] does, for a writer
/// that is the status's only one: a conflict is the answer (the watch
/// brings the newer copy), with no read of the object.
pub async fn write_status<K, S>(
    api: &Api<K>,
    read: &K,
    status: &S,
) -> Result<StatusWrite<K>, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    S: Serialize + std::fmt::Debug,
{
    write(api, read, status, || None, |_| false, false).await
}

async fn write<K, S>(
    api: &Api<K>,
    read: &K,
    status: &S,
    known: impl Fn() -> Option<K>,
    may_write_over: impl Fn(&K) -> bool,
    over_others: bool,
) -> Result<StatusWrite<K>, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    S: Serialize + std::fmt::Debug,
{
    let name = read.name_any();
    let mut base = Cow::Borrowed(read);
    for _ in 0..ATTEMPTS {
        let Some(resource_version) = base.meta().resource_version.as_deref() else {
            return Ok(StatusWrite::Conflict);
        };
        let patch = StatusPatch {
            metadata: Precondition { resource_version },
            status,
        };
        match api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(written) => return Ok(StatusWrite::Written(Box::new(written))),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
        // A writer that may write over nothing has its answer: no read.
        if !over_others {
            return Ok(StatusWrite::Conflict);
        }
        let tried = base.meta().resource_version.clone();
        let newer = match known().filter(|k| k.meta().resource_version != tried) {
            Some(k) if may_write_over(&k) => Some(k),
            _ => api.get_opt(&name).await?,
        };
        match newer {
            Some(newer) if may_write_over(&newer) => base = Cow::Owned(newer),
            _ => return Ok(StatusWrite::Conflict),
        }
    }
    Ok(StatusWrite::Conflict)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_patch_carries_the_precondition_and_the_status() {
        let status = serde_json::json!({"replicas": 3});
        let body = serde_json::to_value(StatusPatch {
            metadata: Precondition {
                resource_version: "42",
            },
            status: &status,
        })
        .expect("serializes");
        assert_eq!(
            body,
            serde_json::json!({
                "metadata": {"resourceVersion": "42"},
                "status": {"replicas": 3}
            })
        );
    }
}
