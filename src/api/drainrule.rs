//! `DrainRule` (cluster-scoped): what the drain does with pods whose
//! templates the operator does not own (a storage daemon, an operator's
//! pods), in the shape of Cluster API's `MachineDrainRule`: a behaviour
//! (`Drain`, `Skip`, `WaitCompleted`) and an order, for the pods its
//! `pods` selectors pick on the Machines its `machines` selectors pick.
//!
//! A pod's own `berth.dev/drain` and `berth.dev/drain-order` annotations,
//! and Cluster API's `cluster.x-k8s.io/drain` label, win over every rule
//! (`drain::rules`). Selectors the API server cannot check (an operator
//! not known, values where none belong) make the rule `Accepted` False:
//! it is named and applies to nothing.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// The condition that says whether a rule is applied.
pub const ACCEPTED: &str = "Accepted";

/// A cluster-wide drain rule.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "berth.dev",
    version = "v1alpha1",
    kind = "DrainRule",
    shortname = "dru",
    category = "berth",
    status = "DrainRuleStatus",
    printcolumn = r#"{"name":"Behavior","type":"string","jsonPath":".spec.drain.behavior"}"#,
    printcolumn = r#"{"name":"Order","type":"integer","jsonPath":".spec.drain.order"}"#,
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct DrainRuleSpec {
    /// What the drain does with the pods the rule picks.
    pub drain: RuleDrain,
    /// The Machines whose drains the rule applies to: any selector
    /// matching a Machine's labels (ORed). None: every Machine.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub machines: Vec<MachineSelector>,
    /// The pods the rule applies to: any selector matching (ORed); within
    /// one, its pod and namespace selectors both (ANDed). None: every pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub pods: Vec<PodSelector>,
    /// berth's own terms for the moves of the pods the rule picks, for
    /// pods whose templates the operator does not own. Their workload's
    /// and their own annotations win over each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moves: Option<RuleMoves>,
}

/// A rule's terms for the moves of its pods, each the value of the
/// annotation of the same meaning.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RuleMoves {
    /// The most pods of one workload moving at once across every drain
    /// (`berth.dev/max-moving`): a whole number from 1, or `unbounded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_moving: Option<IntOrString>,
    /// How long a replacement must have been Ready before its move ends
    /// (`berth.dev/min-healthy-time`), e.g. `30s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_healthy_time: Option<String>,
    /// How long a replacement may take to become healthy before its move
    /// ends anyway, with a Warning (`berth.dev/healthy-deadline`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthy_deadline: Option<String>,
    /// `false`: no surge before evict for these pods (`berth.dev/surge`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub surge: Option<bool>,
}

impl RuleMoves {
    /// The terms as the annotations of the same meaning.
    pub fn annotations(&self) -> std::collections::BTreeMap<String, String> {
        [
            (
                "berth.dev/max-moving",
                self.max_moving.as_ref().map(|m| match m {
                    IntOrString::Int(n) => n.to_string(),
                    IntOrString::String(s) => s.clone(),
                }),
            ),
            ("berth.dev/min-healthy-time", self.min_healthy_time.clone()),
            ("berth.dev/healthy-deadline", self.healthy_deadline.clone()),
            ("berth.dev/surge", self.surge.map(|s| s.to_string())),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_string(), v?)))
        .collect()
    }
}

/// A rule's behaviour and order.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = kube::core::Rule::new(
    "self.behavior == 'Drain' || !has(self.order) || self.order == 0"
).message("order can only be set with behavior Drain"))]
#[serde(rename_all = "camelCase")]
pub struct RuleDrain {
    /// `Drain` (evicted in `order`), `Skip` (never evicted; ends with the
    /// VM) or `WaitCompleted` (never evicted; the drain waits until it
    /// completes, bounded by the drain deadline).
    pub behavior: RuleBehavior,
    /// The pods' order group: groups drain in ascending order, each once
    /// the ones before are gone and their volumes moved. Default 0 (a
    /// critical pod's default, 1000, is not a rule's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<i32>,
}

/// What the drain does with a pod.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum RuleBehavior {
    #[default]
    Drain,
    Skip,
    WaitCompleted,
}

/// Machines by their labels.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MachineSelector {
    /// Absent or empty: every Machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
}

/// Pods by their labels and their namespace's labels.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodSelector {
    /// Absent or empty: every pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    /// Absent or empty: every namespace (`kubernetes.io/metadata.name`
    /// picks one by name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
}

/// What berth made of a rule.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DrainRuleStatus {
    /// `Accepted`: True when the rule applies; False with reason
    /// `InvalidSelector` when one of its selectors cannot be read, or
    /// `InvalidTerms` when one of its `moves` terms cannot (it applies to
    /// nothing, and the message says which).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The generation of the spec the conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}
