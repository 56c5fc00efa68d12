//! `MachineSet`: a number of Machines made from one template.
//!
//! What the apiserver checks (CEL): `replicas` is not negative, the
//! selector is not empty and does not change. Whether the selector matches
//! the template's labels is checked by the controller, which then reports
//! it in the `ReplicaFailure` condition and creates nothing: a CEL rule
//! over two label maps of unbounded size exceeds the apiserver's cost
//! budget (measured: refused at more than 100 times the budget).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::MachineSpec;

/// The annotation an operator puts on a Machine of a MachineSet to choose
/// the order of scale-down: an integer, higher goes first; a Machine without
/// it counts as `0`, so a negative value keeps a Machine longer than the
/// rest. A value that is not an integer is ignored (counts as `0`).
pub const DELETE_PRIORITY_ANNOTATION: &str = "berth.dev/delete-priority";

/// The types of the conditions berth sets on a MachineSet.
pub mod conditions {
    /// Every wanted replica exists and is ready (reason `AllReplicasReady`),
    /// or why not (`ScalingUp`, `ScalingDown`, `WaitingForReady`).
    pub const READY: &str = "Ready";
    /// A Machine could not be created (`CreateFailed`) or the template does
    /// not match the selector (`SelectorMismatch`); False once the last
    /// attempt went well.
    pub const REPLICA_FAILURE: &str = "ReplicaFailure";
}

/// A set of Machines made from one template, `replicas` of them. Scaling
/// down deletes first the Machines an operator marked, then the failed or
/// unhealthy ones, then those whose drain costs least, then the oldest.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "berth.dev",
    version = "v1alpha1",
    kind = "MachineSet",
    namespaced,
    status = "MachineSetStatus",
    shortname = "ms",
    category = "berth",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn = r#"{"name":"Desired","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Current","type":"integer","jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Available","type":"integer","jsonPath":".status.availableReplicas","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new(
    "(has(self.selector.matchLabels) && size(self.selector.matchLabels) > 0) || (has(self.selector.matchExpressions) && size(self.selector.matchExpressions) > 0)"
).message("selector must not be empty: it would select every Machine of the namespace"))]
#[serde(rename_all = "camelCase")]
pub struct MachineSetSpec {
    /// How many Machines the set keeps (default 1). Machines being deleted
    /// do not count.
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new("self >= 0").message("replicas must not be negative"))]
    pub replicas: i32,
    /// Selects the set's Machines among those it owns; must match the
    /// template's labels; cannot change. The set never adopts a Machine it
    /// does not own.
    #[x_kube(validation = Rule::new("self == oldSelf").message("selector is immutable"))]
    pub selector: LabelSelector,
    /// How long a Machine must have been ready before it counts as
    /// available (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0").message("minReadySeconds must not be negative"))]
    pub min_ready_seconds: Option<i32>,
    /// The Machines to make.
    pub template: MachineTemplate,
    /// The remediation of the set's Machines whose Nodes die, over their
    /// class's field by field (see `MachineClass.spec.remediation`); the
    /// set is the pool `maxUnhealthy` counts. A MachineDeployment's sets
    /// carry the deployment's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remediation: Option<super::Remediation>,
}

fn one() -> i32 {
    1
}

/// What each Machine of a set is made from.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MachineTemplate {
    /// Labels and annotations of each Machine.
    #[serde(default)]
    pub metadata: TemplateMetadata,
    /// The spec of each Machine.
    pub spec: MachineSpec,
}

/// The metadata a template gives its Machines.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct TemplateMetadata {
    /// Labels of each Machine; the selector must match them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations of each Machine.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// Observed state of a MachineSet.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MachineSetStatus {
    /// Machines the set owns that are not being deleted.
    #[serde(default)]
    pub replicas: i32,
    /// Of those, the Running ones whose Node is Ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Of the ready ones, those ready for at least `minReadySeconds`.
    #[serde(default)]
    pub available_replicas: i32,
    /// The selector as a string (`kubectl scale` and HPAs read it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready and ReplicaFailure.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}
