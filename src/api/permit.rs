//! `MovePermit`: one permit of a workload's move budget in use, kept in
//! the API server so that every berth process (two `--namespace` scopes,
//! two releases, a new leader) sees the same ones.
//!
//! A workload whose budget is `n` has `n` permits, named
//! `<kind>.<name>.<slot>` in its namespace for the slots `0` to `n - 1`
//! (`statefulset.db.0`): taking one is creating its object, which the API
//! server grants to one creator only, so two processes never hold the
//! same permit. A drain past its deadline takes a slot from `n` on (its
//! `pastBudget` is true), counted like any other. A permit is ended by
//! deleting its object; its owner reference is the workload, so a workload
//! deleted takes its permits with it.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// One permit of a workload's move budget, held by one pod's move.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[kube(
    group = "berth.dev",
    version = "v1alpha1",
    kind = "MovePermit",
    namespaced,
    shortname = "mvp",
    category = "berth",
    printcolumn = r#"{"name":"Workload","type":"string","jsonPath":".spec.workload"}"#,
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".spec.pod"}"#,
    printcolumn = r#"{"name":"Machine","type":"string","jsonPath":".spec.machine"}"#,
    printcolumn = r#"{"name":"Past-Budget","type":"boolean","jsonPath":".spec.pastBudget"}"#,
    printcolumn = r#"{"name":"Expires","type":"date","jsonPath":".spec.expires"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MovePermitSpec {
    /// The workload whose budget the permit is of, `Kind/name` in this
    /// namespace (a Deployment, a StatefulSet, any controller; a pod
    /// without one is its own workload).
    pub workload: String,
    /// The pod whose move holds it (its name, in this namespace).
    pub pod: String,
    /// That pod's UID: a pod of the same name with another UID is its
    /// replacement.
    pub pod_uid: String,
    /// The Machine whose drain moves the pod, `namespace/name`.
    pub machine: String,
    /// When the permit was granted, just before the eviction.
    pub since: Time,
    /// Granted beyond the budget, to a drain past its deadline.
    #[serde(default)]
    pub past_budget: bool,
    /// The pod has volumes that move with it.
    #[serde(default)]
    pub volumes: bool,
    /// The move's healthy deadline: once its drain no longer watches it
    /// (the drain ended, or its Machine is gone), the permit goes when its
    /// workload is whole again, or at this time, whichever comes first (a
    /// Warning names it then). Its workload's `berth.dev/healthy-deadline`
    /// after `since`, else the deadline of the drain that began the move
    /// (at least the reattach timeout after `since`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<Time>,
    /// The attachable PVs that move with the pod: once no drain watches
    /// the move, it is over only when each is attached where the pod that
    /// replaced it runs (and its workload has no replica down).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attach: Vec<String>,
    /// The Node berth found for the pod's replacement before it evicted
    /// the pod: until the replacement is placed, the move holds an attach
    /// slot there for each of `attach`, so that two drains never count
    /// on the last slot of a Node twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination: Option<String>,
    /// The surge made for the move, when its pod's budget let no
    /// disruption go (see `berth plan`): what berth wrote to the pod's
    /// Deployment, so that a restart neither writes it again nor forgets
    /// to undo it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub surge: Option<PermitSurge>,
}

/// On a Deployment's pod template: the Machine (`namespace/name`) whose
/// drain rolled it to surge its pods.
pub const SURGED_FOR_ANNOTATION: &str = "berth.dev/surged-for";

/// A surge of a pod's Deployment, made before its pod goes.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PermitSurge {
    /// `Roll` (its pod template annotated, one new revision) or `ScaleUp`
    /// (one replica more, then back).
    pub method: String,
    /// The Deployment, in the permit's namespace.
    pub deployment: String,
    /// A scale-up's replicas before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<i32>,
    /// A scale-up's replicas during it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<i32>,
    /// A roll's `berth.dev/surged-for` value on the pod template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// When a scale-up's replicas were put back (or found changed by
    /// someone else, and left as they were).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored: Option<Time>,
}

/// The name of permit `slot` of workload `kind`/`name`:
/// `<kind>.<name>.<slot>`, lower-case. A name that would be longer than an
/// object name may be keeps the kind and the slot and shortens the rest
/// to a hash of it.
pub fn permit_name(kind: &str, name: &str, slot: u32) -> String {
    object_name(kind, name, &slot.to_string())
}

/// `<kind>.<name>.<tail>`, lower-case, or, when that is no object name,
/// the kind and the tail with the rest shortened to a hash of it (the
/// tail too, when it is no label of an object name).
pub(crate) fn object_name(kind: &str, name: &str, tail: &str) -> String {
    let kind = kind.to_ascii_lowercase();
    let full = format!("{kind}.{name}.{tail}");
    if full.len() <= 253 && is_subdomain(&full) {
        return full;
    }
    // A stable hash: the same name in every process and every release.
    let hash = fnv1a(name.as_bytes());
    let kind: String = kind
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(63)
        .collect();
    if tail.len() <= 63 && is_subdomain(tail) && !tail.contains('.') {
        format!("{kind}.{hash:016x}.{tail}")
    } else {
        format!("{kind}.{hash:016x}.{:016x}", fnv1a(tail.as_bytes()))
    }
}

/// Whether `s` is a DNS subdomain as object names must be.
fn is_subdomain(s: &str) -> bool {
    s.split('.').all(|label| {
        !label.is_empty()
            && label.len() <= 63
            && label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    })
}

/// FNV-1a of `bytes`, written out: `std`'s hasher may change between
/// releases, and a permit's name must not.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_permit_is_named_by_its_workload_and_slot() {
        assert_eq!(permit_name("StatefulSet", "db", 0), "statefulset.db.0");
        assert_eq!(
            permit_name("Deployment", "web-api", 3),
            "deployment.web-api.3"
        );
        let long = "x".repeat(250);
        let name = permit_name("StatefulSet", &long, 1);
        assert!(name.len() <= 253 && is_subdomain(&name), "{name}");
        assert!(name.starts_with("statefulset.") && name.ends_with(".1"));
        assert_eq!(name, permit_name("StatefulSet", &long, 1), "stable");
        assert_ne!(name, permit_name("StatefulSet", &"y".repeat(250), 1));
        // A custom kind's name with a character a label may not hold.
        let odd = permit_name("CassandraDatacenter", "dc1_a", 0);
        assert!(is_subdomain(&odd), "{odd}");
    }
}
