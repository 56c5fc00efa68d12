//! `MoveAsk`: a drain's ask for a permit of a workload that waits in line,
//! kept in the API server so that every berth process (two `--namespace`
//! scopes, two releases) orders its own asks behind those of the others.
//!
//! Only a parked ask has one: its drain's pass is over and it waits for a
//! permit to free. It is named `<kind>.<name>.<pod>` in the workload's
//! namespace (`statefulset.db.db-1`), written once when the ask parks and
//! deleted once it leaves the line (granted, withdrawn, its drain ended).
//! Its process renews `expires` while it waits; another process takes an
//! ask past its expiry for one of a process that died, and passes it by.
//! Its owner reference is the workload, as a permit's.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// One ask that waits in line for a permit of a workload's move budget.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[kube(
    group = "berth.dev",
    version = "v1alpha1",
    kind = "MoveAsk",
    namespaced,
    shortname = "mva",
    category = "berth",
    printcolumn = r#"{"name":"Workload","type":"string","jsonPath":".spec.workload"}"#,
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".spec.pod"}"#,
    printcolumn = r#"{"name":"Machine","type":"string","jsonPath":".spec.machine"}"#,
    printcolumn = r#"{"name":"Priority","type":"integer","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Requested","type":"date","jsonPath":".spec.requested"}"#,
    printcolumn = r#"{"name":"Left","type":"integer","jsonPath":".spec.movesLeft"}"#,
    printcolumn = r#"{"name":"Expires","type":"date","jsonPath":".spec.expires"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MoveAskSpec {
    /// The workload whose permit the ask waits for, `Kind/name` in this
    /// namespace.
    pub workload: String,
    /// The pod that asks to move (its name, in this namespace).
    pub pod: String,
    /// That pod's UID.
    pub pod_uid: String,
    /// The Machine whose drain asks, `namespace/name`.
    pub machine: String,
    /// The pod's priority: a higher one goes first.
    #[serde(default)]
    pub priority: i32,
    /// When the Machine's deletion was requested: of equal priorities, the
    /// earlier goes first (then `movesLeft`, then the Machine's and the
    /// pod's names).
    pub requested: Time,
    /// The volume moves the Machine's drain had left when it asked, this
    /// one included: of equal priorities and requests, the drain with more
    /// left goes first.
    #[serde(default)]
    pub moves_left: u32,
    /// Until when the ask holds its place: its process renews it while it
    /// waits; past it, every process passes it by.
    pub expires: Time,
}

/// The name of the ask of pod `pod` for a permit of workload
/// `kind`/`name`: `<kind>.<name>.<pod>`, lower-case, or shortened to a
/// hash as a permit's name is (see [`super::permit_name`]).
pub fn ask_name(kind: &str, name: &str, pod: &str) -> String {
    super::permit::object_name(kind, name, pod)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ask_is_named_by_its_workload_and_pod() {
        assert_eq!(ask_name("StatefulSet", "db", "db-1"), "statefulset.db.db-1");
        let long = ask_name("StatefulSet", &"x".repeat(200), &"x-1".repeat(30));
        assert!(
            long.len() <= 253 && long.starts_with("statefulset."),
            "{long}"
        );
        assert_ne!(long, ask_name("StatefulSet", &"x".repeat(200), "x-2"));
    }
}
