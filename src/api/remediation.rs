//! The remediation of a Machine whose Node dies: the API shape (a class's
//! and a pool's `remediation`, a Machine's `status.remediation`) and its
//! resolution pool → class → default into plain values. Pure.
//!
//! A remediation fences the VM through its provider (stopped, or
//! terminated), only then taints the Node `node.kubernetes.io/out-of-service`
//! so that its pods and volumes are freed at once, and replaces the
//! Machine. `machine::remediation` runs it; `machine::health` decides it.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use super::settings::{duration_rule, parse_duration};

/// What berth does with a Running Machine whose Node stays unhealthy. Set
/// on a MachineClass for its Machines; a MachineSet's (or a
/// MachineDeployment's, copied to its sets) wins field by field.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Remediation {
    /// `Off` (the default): an unhealthy Machine is named (`NodeHealthy`
    /// False, `berth_node_not_ready_machines`) and left as it is.
    /// `Replace`: its VM is fenced, its Node's pods and volumes freed,
    /// and the Machine replaced by its pool (one outside a pool is marked
    /// Failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<RemediationPolicy>,
    /// How the VM is fenced before anything on its Node is freed: `Stop`
    /// (the default; its disks are kept) or `Terminate`. Nothing is freed
    /// until the provider says the VM is stopped (or gone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<Fence>,
    /// How long the provider may take to say the VM is fenced (a duration
    /// such as `10m`, the default). Past it, a `Stop` in a pool turns into
    /// a `Terminate` (the Machine is replaced, so its disks go anyway);
    /// a `Terminate`, or a `Stop` outside a pool, is named
    /// `FenceTimedOut` and still asked, with backoff: nothing on the Node
    /// is freed before the VM is known to be off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = duration_rule())]
    pub fence_timeout: Option<String>,
    /// Node conditions besides `Ready` that make a Machine unhealthy, each
    /// once it has lasted its `after` (as Karpenter's node repair reads
    /// them). `Ready` False or Unknown always counts, after the class's
    /// `healthTimeout`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub conditions: Vec<UnhealthyCondition>,
    /// The most Machines of the pool (the Machine's MachineSet) that may be
    /// unhealthy for one to be remediated: a count, or a percentage of the
    /// pool (rounded down, at least 1). More than that looks like a
    /// network partition, not dead VMs: nothing is remediated and
    /// `RemediationHeld` says why. Default `100%`; the cluster-wide bound
    /// is `berth run --max-unhealthy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = max_unhealthy_rule())]
    pub max_unhealthy: Option<IntOrString>,
}

fn max_unhealthy_rule() -> kube::core::Rule {
    kube::core::Rule::new(
        "type(self) == int ? self >= 0 : self.matches('^[0-9]+%$') && int(self.replace('%', '')) <= 100",
    )
    .message("maxUnhealthy must be a count (0 or more) or a percentage such as 40%")
}

/// Whether an unhealthy Machine is remediated.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum RemediationPolicy {
    /// Named, left as it is.
    #[default]
    Off,
    /// Fenced, freed and replaced.
    Replace,
}

/// How a VM is fenced.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum Fence {
    /// Stopped (powered off, disks kept) and waited for until the provider
    /// says it is stopped.
    #[default]
    Stop,
    /// Terminated and waited for until the provider says it is gone.
    Terminate,
}

/// A Node condition that makes a Machine unhealthy once it has had
/// `status` for `after`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct UnhealthyCondition {
    /// The condition's type, e.g. `KernelDeadlock`.
    #[serde(rename = "type")]
    #[schemars(length(min = 1, max = 316))]
    pub type_: String,
    /// The status that is unhealthy: `True`, `False` or `Unknown`.
    pub status: ConditionStatus,
    /// How long it must have had that status (a duration such as `5m`).
    #[schemars(length(max = 32))]
    #[x_kube(validation = duration_rule())]
    pub after: String,
}

/// A condition's status.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

impl ConditionStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        }
    }
}

/// Where a remediation is: each step is recorded before it is taken, so
/// that a restarted controller resumes it and never takes one twice.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RemediationStep {
    /// The provider is asked to stop (or terminate) the VM, until it says
    /// it has. A Node that comes back before then ends the remediation.
    Fence,
    /// The VM is fenced: the Node is tainted out of service and its pods
    /// deleted once the move ledger lets each stateful workload move.
    Free,
    /// Freed: the Machine is deleted (its pool makes a new one), or marked
    /// Failed outside a pool.
    Replace,
}

impl RemediationStep {
    pub fn as_str(self) -> &'static str {
        match self {
            RemediationStep::Fence => "Fence",
            RemediationStep::Free => "Free",
            RemediationStep::Replace => "Replace",
        }
    }
}

/// A remediation under way, in a Machine's status.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RemediationStatus {
    /// The step under way.
    pub step: RemediationStep,
    /// The Node found unhealthy.
    pub node: String,
    /// Why, in words (its condition and for how long).
    pub reason: String,
    /// `Stop` or `Terminate`, as resolved when it began.
    pub fence: Fence,
    /// When it began.
    pub started_at: Time,
    /// When a `Stop` that outlasted `fenceTimeout` turned into a
    /// `Terminate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalated_at: Option<Time>,
    /// When the provider said the VM is stopped (or gone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced_at: Option<Time>,
    /// When the Node was tainted out of service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freed_at: Option<Time>,
}

/// A bound on unhealthy Machines: a count, or a percentage of a total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxUnhealthy {
    Count(u32),
    Percent(u32),
}

impl MaxUnhealthy {
    /// Parses a count (`3`, as a number or a string) or a percentage
    /// (`40%`, 0 to 100).
    pub fn parse(v: &IntOrString) -> Result<Self, String> {
        match v {
            IntOrString::Int(n) => u32::try_from(*n)
                .map(MaxUnhealthy::Count)
                .map_err(|_| format!("maxUnhealthy: {n} is negative")),
            IntOrString::String(s) => Self::parse_str(s),
        }
    }

    pub fn parse_str(s: &str) -> Result<Self, String> {
        let bad = || format!("maxUnhealthy: {s:?} is not a count or a percentage such as 40%");
        match s.strip_suffix('%') {
            Some(p) => match p.parse::<u32>() {
                Ok(p) if p <= 100 => Ok(MaxUnhealthy::Percent(p)),
                _ => Err(bad()),
            },
            None => s.parse().map(MaxUnhealthy::Count).map_err(|_| bad()),
        }
    }

    /// How many of `total` Machines may be unhealthy: a percentage rounded
    /// down but at least 1 (a percentage above 0 always lets one dead VM be
    /// remediated), a count as it is.
    pub fn of(self, total: usize) -> usize {
        match self {
            MaxUnhealthy::Count(n) => n as usize,
            MaxUnhealthy::Percent(0) => 0,
            MaxUnhealthy::Percent(p) => (total * p as usize / 100).max(1),
        }
    }
}

impl std::fmt::Display for MaxUnhealthy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MaxUnhealthy::Count(n) => write!(f, "{n}"),
            MaxUnhealthy::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// A condition rule resolved: its type, its unhealthy status, its
/// duration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConditionRule {
    pub type_: String,
    pub status: String,
    pub after: Duration,
}

/// How long a fence may take unless `fenceTimeout` says otherwise.
pub const DEFAULT_FENCE_TIMEOUT: Duration = Duration::from_secs(600);

/// A remediation setting with every default applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedRemediation {
    pub policy: RemediationPolicy,
    pub fence: Fence,
    pub fence_timeout: Duration,
    pub conditions: Vec<ConditionRule>,
    /// The pool's bound.
    pub max_unhealthy: MaxUnhealthy,
}

impl Default for ResolvedRemediation {
    fn default() -> Self {
        Self {
            policy: RemediationPolicy::Off,
            fence: Fence::Stop,
            fence_timeout: DEFAULT_FENCE_TIMEOUT,
            conditions: Vec::new(),
            max_unhealthy: MaxUnhealthy::Percent(100),
        }
    }
}

/// Resolves a pool's remediation over its class's over the defaults.
/// `conditions` are the pool's when it lists any, else the class's.
pub fn resolve(
    pool: Option<&Remediation>,
    class: Option<&Remediation>,
) -> Result<ResolvedRemediation, String> {
    let d = ResolvedRemediation::default();
    let conditions = match pool.filter(|p| !p.conditions.is_empty()) {
        Some(p) => &p.conditions,
        None => class.map_or(&[][..], |c| &c.conditions[..]),
    };
    let conditions = conditions
        .iter()
        .map(|c| {
            let after = parse_duration(&c.after).ok_or_else(|| {
                format!(
                    "remediation.conditions: {:?} of {} is not a duration such as 5m",
                    c.after, c.type_
                )
            })?;
            Ok(ConditionRule {
                type_: c.type_.clone(),
                status: c.status.as_str().to_string(),
                after,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let max_unhealthy = match pool
        .and_then(|p| p.max_unhealthy.as_ref())
        .or_else(|| class.and_then(|c| c.max_unhealthy.as_ref()))
    {
        Some(v) => MaxUnhealthy::parse(v)?,
        None => d.max_unhealthy,
    };
    let fence_timeout = match pool
        .and_then(|p| p.fence_timeout.as_deref())
        .or_else(|| class.and_then(|c| c.fence_timeout.as_deref()))
    {
        Some(s) => parse_duration(s).ok_or_else(|| {
            format!("remediation.fenceTimeout: {s:?} is not a duration such as 10m")
        })?,
        None => d.fence_timeout,
    };
    Ok(ResolvedRemediation {
        fence_timeout,
        policy: pool
            .and_then(|p| p.policy)
            .or_else(|| class.and_then(|c| c.policy))
            .unwrap_or(d.policy),
        fence: pool
            .and_then(|p| p.fence)
            .or_else(|| class.and_then(|c| c.fence))
            .unwrap_or(d.fence),
        conditions,
        max_unhealthy,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_unhealthy_is_a_count_or_a_percentage_at_least_one() {
        let p = |s: &str| MaxUnhealthy::parse_str(s);
        assert_eq!(p("40%"), Ok(MaxUnhealthy::Percent(40)));
        assert_eq!(p("3"), Ok(MaxUnhealthy::Count(3)));
        assert!(p("140%").is_err() && p("-1").is_err() && p("x%").is_err());
        assert_eq!(
            MaxUnhealthy::parse(&IntOrString::Int(2)),
            Ok(MaxUnhealthy::Count(2))
        );
        assert!(MaxUnhealthy::parse(&IntOrString::Int(-2)).is_err());
        // Two of five at 40%; one of two (rounded down to 0, raised to 1).
        assert_eq!(MaxUnhealthy::Percent(40).of(5), 2);
        assert_eq!(MaxUnhealthy::Percent(40).of(2), 1);
        assert_eq!(MaxUnhealthy::Percent(0).of(10), 0);
        assert_eq!(MaxUnhealthy::Count(0).of(10), 0);
        assert_eq!(MaxUnhealthy::Percent(100).of(7), 7);
    }

    #[test]
    fn the_pool_wins_field_by_field_over_the_class() {
        let class = Remediation {
            policy: Some(RemediationPolicy::Replace),
            fence: Some(Fence::Terminate),
            conditions: vec![UnhealthyCondition {
                type_: "KernelDeadlock".into(),
                status: ConditionStatus::True,
                after: "5m".into(),
            }],
            max_unhealthy: Some(IntOrString::String("40%".into())),
            fence_timeout: Some("2m".into()),
        };
        let pool = Remediation {
            policy: Some(RemediationPolicy::Off),
            max_unhealthy: Some(IntOrString::Int(1)),
            ..Default::default()
        };
        let r = resolve(Some(&pool), Some(&class)).expect("valid");
        assert_eq!(r.policy, RemediationPolicy::Off);
        assert_eq!(r.fence, Fence::Terminate);
        assert_eq!(r.max_unhealthy, MaxUnhealthy::Count(1));
        assert_eq!(r.conditions.len(), 1);
        assert_eq!(r.conditions[0].after, Duration::from_secs(300));
        assert_eq!(r.fence_timeout, Duration::from_secs(120));
        assert_eq!(resolve(None, None), Ok(ResolvedRemediation::default()));
        let bad = Remediation {
            max_unhealthy: Some(IntOrString::String("lots".into())),
            ..Default::default()
        };
        assert!(resolve(None, Some(&bad)).is_err());
        let slow = Remediation {
            fence_timeout: Some("soon".into()),
            ..Default::default()
        };
        assert!(resolve(Some(&slow), None).is_err_and(|e| e.contains("fenceTimeout")));
    }
}
