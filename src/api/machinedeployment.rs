//! `MachineDeployment`: a pool of Machines whose template changes roll out
//! through MachineSets, one per template (its hash).
//!
//! What the apiserver checks (CEL): `replicas` is not negative, the
//! selector is not empty and does not change, `maxSurge` and
//! `maxUnavailable` are non-negative integers or percentages and not both
//! zero, and `rollingUpdate` is given only with the `RollingUpdate`
//! strategy. Whether the selector matches the template's labels is
//! checked by the controller (see [`super::machineset`]).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::machineset::MachineTemplate;

/// The label every MachineSet of a deployment and each of its Machines
/// carry: the hash of the template they were made from.
pub const TEMPLATE_HASH_LABEL: &str = "berth.dev/template-hash";
/// The revision of a deployment's MachineSet: 1 for the first template,
/// one more for each template rolled out since (a rollback to an earlier
/// template gives its set the next revision again).
pub const REVISION_ANNOTATION: &str = "berth.dev/revision";
/// On a deployment's MachineSet: the hash of what its MachineClass made
/// VMs from when the set was made (provider, providerSpec, secretRef).
/// When the class is edited in place, the hash differs, and the pool rolls
/// to a new set as for a new template.
pub const CLASS_HASH_ANNOTATION: &str = "berth.dev/class-hash";
/// Put by a MachineDeployment on its old MachineSets (the value names the
/// new one): such a set only scales down. A Machine of it that is deleted
/// is replaced, if at all, by the new template.
pub const SUPERSEDED_ANNOTATION: &str = "berth.dev/superseded-by";
/// The taint berth puts (`PreferNoSchedule`) on the Nodes of a
/// deployment's old Machines when a rollout starts, so that the pods
/// evicted from the first old Machines land on new ones, not on old ones
/// about to be drained in turn.
pub const ROLLOUT_TAINT_KEY: &str = "berth.dev/rolling-out";

/// The types of the conditions berth sets on a MachineDeployment.
pub mod conditions {
    /// True when at least `replicas - maxUnavailable` Machines are
    /// available (`MinimumReplicasAvailable`), else False
    /// (`MinimumReplicasUnavailable`).
    pub const AVAILABLE: &str = "Available";
    /// True while the rollout progresses (`NewMachineSetCreated`,
    /// `RollingOut`, `ScalingUp`, `ScalingDown`) and once it is complete
    /// (`RolloutComplete`); Unknown while paused (`Paused`); False when a
    /// new Machine failed (`NewMachineFailed`), when the template does not
    /// match the selector (`SelectorMismatch`) or when nothing progressed
    /// for `progressDeadlineSeconds` (`ProgressDeadlineExceeded`).
    pub const PROGRESSING: &str = "Progressing";
}

/// A pool of Machines made from one template. A change of the template
/// rolls out through a new MachineSet: new Machines are created and old
/// ones drained and deleted, paced by the strategy.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "berth.dev",
    version = "v1alpha1",
    kind = "MachineDeployment",
    namespaced,
    status = "MachineDeploymentStatus",
    shortname = "md",
    category = "berth",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn = r#"{"name":"Desired","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Current","type":"integer","jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"Updated","type":"integer","jsonPath":".status.updatedReplicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Available","type":"integer","jsonPath":".status.availableReplicas"}"#,
    printcolumn = r#"{"name":"Draining","type":"integer","jsonPath":".status.drainingReplicas"}"#,
    printcolumn = r#"{"name":"Rollout","type":"string","jsonPath":".status.conditions[?(@.type==\"Progressing\")].reason"}"#,
    printcolumn = r#"{"name":"Paused","type":"boolean","jsonPath":".spec.paused","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new(
    "(has(self.selector.matchLabels) && size(self.selector.matchLabels) > 0) || (has(self.selector.matchExpressions) && size(self.selector.matchExpressions) > 0)"
).message("selector must not be empty: it would select every Machine of the namespace"))]
#[serde(rename_all = "camelCase")]
pub struct MachineDeploymentSpec {
    /// How many Machines the deployment keeps (default 1).
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new("self >= 0").message("replicas must not be negative"))]
    pub replicas: i32,
    /// Selects the deployment's MachineSets and Machines; must match the
    /// template's labels; cannot change.
    #[x_kube(validation = Rule::new("self == oldSelf").message("selector is immutable"))]
    pub selector: LabelSelector,
    /// The Machines to make. A change rolls out.
    pub template: MachineTemplate,
    /// How old Machines are replaced by new ones (default `RollingUpdate`
    /// with `maxSurge: 1`, `maxUnavailable: 0`).
    #[serde(default)]
    pub strategy: Strategy,
    /// A paused deployment starts no new step of a rollout: no Machine is
    /// created or deleted for it. Drains in progress finish.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// How long a Machine must have been ready before it counts as
    /// available (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0").message("minReadySeconds must not be negative"))]
    pub min_ready_seconds: Option<i32>,
    /// How many old MachineSets without Machines are kept for a rollback
    /// (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0").message("revisionHistoryLimit must not be negative"))]
    pub revision_history_limit: Option<i32>,
    /// How long a rollout may go without progress (a new Machine ready, an
    /// old one gone) before `Progressing` turns False with
    /// `ProgressDeadlineExceeded` (default 600). The rollout goes on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0").message("progressDeadlineSeconds must be positive"))]
    pub progress_deadline_seconds: Option<i32>,
    /// The remediation of the deployment's Machines whose Nodes die,
    /// copied to each of its MachineSets (a change does not roll out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remediation: Option<super::Remediation>,
}

fn one() -> i32 {
    1
}

/// How a template change replaces Machines.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = Rule::new("self.type == 'RollingUpdate' || !has(self.rollingUpdate)").message("rollingUpdate is only allowed with type RollingUpdate"))]
#[serde(rename_all = "camelCase")]
pub struct Strategy {
    /// `RollingUpdate` (default) or `OnDelete`.
    #[serde(default, rename = "type")]
    pub type_: StrategyType,
    /// The pace of a `RollingUpdate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolling_update: Option<RollingUpdate>,
}

/// The kinds of strategy.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum StrategyType {
    /// New Machines are created and old ones deleted by berth, paced by
    /// `maxSurge` and `maxUnavailable`.
    #[default]
    RollingUpdate,
    /// Old Machines are replaced only when an operator deletes them.
    OnDelete,
}

/// The pace of a rolling update.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = Rule::new("!(has(self.maxSurge) && has(self.maxUnavailable) && (self.maxSurge == 0 || self.maxSurge == '0%') && (self.maxUnavailable == 0 || self.maxUnavailable == '0%'))").message("maxSurge and maxUnavailable must not both be zero"))]
#[serde(rename_all = "camelCase")]
pub struct RollingUpdate {
    /// How many Machines beyond `replicas` may exist during a rollout, an
    /// integer or a percentage of `replicas` rounded up (default 1).
    /// Machines being deleted count: they are VMs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "int_or_percent")]
    #[x_kube(validation = Rule::new("type(self) == int ? self >= 0 : self.matches('^[0-9]+%$')").message("must be a non-negative integer or a percentage such as '25%'"))]
    pub max_surge: Option<IntOrString>,
    /// How many of `replicas` may be unavailable during a rollout, an
    /// integer or a percentage of `replicas` rounded down (default 0); it
    /// is also how many old Machines are drained at once (at least one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "int_or_percent")]
    #[x_kube(validation = Rule::new("type(self) == int ? self >= 0 : self.matches('^([0-9]|[1-9][0-9]|100)%$')").message("must be a non-negative integer or a percentage from 0% to 100%"))]
    pub max_unavailable: Option<IntOrString>,
}

fn int_or_percent(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "x-kubernetes-int-or-string": true,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
    })
}

/// Observed state of a MachineDeployment.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MachineDeploymentStatus {
    /// Machines of all its sets that are not being deleted.
    #[serde(default)]
    pub replicas: i32,
    /// Of those, the ones made from the current template.
    #[serde(default)]
    pub updated_replicas: i32,
    /// Of all, the Running ones whose Node is Ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Of the ready ones, those ready for at least `minReadySeconds`.
    #[serde(default)]
    pub available_replicas: i32,
    /// Machines being deleted (draining, detaching, terminating).
    #[serde(default)]
    pub draining_replicas: i32,
    /// The selector as a string (`kubectl scale` and autoscalers read it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The hash of the current template (`berth.dev/template-hash`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_hash: Option<String>,
    /// When the rollout last made progress: a set created, a new Machine
    /// ready, an old Machine gone. `progressDeadlineSeconds` runs from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress_time: Option<Time>,
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Available and Progressing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}
