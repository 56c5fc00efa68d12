//! Whether a Machine's Node is unhealthy, whether the cluster lets it be
//! remediated, and the remediation's next step: decided from plain facts
//! (pure; `remediation` observes and acts).

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;

use crate::api::remediation::{
    ConditionRule, Fence, MaxUnhealthy, RemediationPolicy, RemediationStep,
};

/// A Node's health against its class's rules.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Judged {
    /// A check fails now (Ready not True, a listed condition has its
    /// status), however long it has.
    pub(crate) failing: bool,
    /// The check that has failed past its duration, in words.
    pub(crate) unhealthy: Option<String>,
    /// When the soonest failing check will have lasted its duration.
    pub(crate) recheck_in: Option<Duration>,
}

/// Judges `node` at `now`: `Ready` False or Unknown (or missing) for
/// `health_timeout`, or a condition of `rules` with its status for its
/// `after`.
pub(crate) fn judge(
    node: &Node,
    now: Timestamp,
    health_timeout: Duration,
    rules: &[ConditionRule],
) -> Judged {
    let conditions = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let since = |t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>| {
        t.or(node.metadata.creation_timestamp.as_ref())
            .and_then(|t| Duration::try_from(now.duration_since(t.0)).ok())
            .unwrap_or_default()
    };
    let mut checks = Vec::new();
    let ready = conditions.iter().find(|c| c.type_ == "Ready");
    if ready.is_none_or(|c| c.status != "True") {
        let status = ready.map_or("missing", |c| c.status.as_str());
        let lasted = since(ready.and_then(|c| c.last_transition_time.as_ref()));
        checks.push((format!("Ready {status}"), lasted, health_timeout));
    }
    for rule in rules {
        if let Some(c) = conditions
            .iter()
            .find(|c| c.type_ == rule.type_ && c.status == rule.status)
        {
            let lasted = since(c.last_transition_time.as_ref());
            checks.push((format!("{} {}", c.type_, c.status), lasted, rule.after));
        }
    }
    let mut judged = Judged {
        failing: !checks.is_empty(),
        ..Judged::default()
    };
    for (what, lasted, after) in checks {
        if lasted >= after {
            judged.unhealthy.get_or_insert_with(|| {
                format!(
                    "Node {} has been {what} for {} (limit {})",
                    node.metadata.name.as_deref().unwrap_or_default(),
                    humantime::format_duration(round(lasted)),
                    humantime::format_duration(after)
                )
            });
        } else {
            let left = after - lasted + Duration::from_millis(100);
            judged.recheck_in = Some(judged.recheck_in.map_or(left, |r| r.min(left)));
        }
    }
    judged
}

fn round(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs())
}

/// How many Machines of a group (a pool, or the cluster) are unhealthy
/// and how many it has, against its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Share {
    pub(crate) unhealthy: usize,
    pub(crate) total: usize,
    pub(crate) max: MaxUnhealthy,
}

impl Share {
    /// Whether remediation may go on: no more unhealthy Machines than the
    /// bound allows (this one included).
    pub(crate) fn allows(&self) -> bool {
        self.unhealthy <= self.max.of(self.total)
    }

    fn words(&self, group: &str) -> String {
        format!(
            "{} of {} Machines {group} are unhealthy, more than maxUnhealthy {} ({}) allows",
            self.unhealthy,
            self.total,
            self.max,
            self.max.of(self.total)
        )
    }
}

/// What is known when a Running Machine's remediation is decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RemediationFacts {
    pub(crate) policy: RemediationPolicy,
    /// The Node's health; `None` when the Machine has no Node.
    pub(crate) health: Option<Judged>,
    /// The step recorded in `status.remediation`, if one is under way.
    pub(crate) recorded: Option<RemediationStep>,
    /// The Machine's pool (its MachineSet), if it has one.
    pub(crate) pool: Option<Share>,
    pub(crate) cluster: Share,
}

/// A remediation's next step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Remediate {
    /// Healthy, or not yet unhealthy for long enough.
    Nothing,
    /// Unhealthy, and its class and pool say to leave it.
    Off {
        why: String,
    },
    /// Unhealthy, but too many Machines are: a partition is not
    /// remediated.
    Held {
        why: String,
        unhealthy: String,
    },
    /// Unhealthy: record the remediation before anything is done.
    Begin {
        why: String,
    },
    /// The Node came back before the VM was fenced.
    Cancel,
    Fence,
    Free,
    /// Delete the Machine: its pool makes a new one.
    Replace,
    /// Outside a pool: mark it Failed.
    Fail,
}

/// The next step of a Running Machine's remediation. A remediation under
/// way goes on by its recorded step: only before the fence does a Node
/// that is back end it; once the VM is fenced, nothing on the Node can run
/// again, so it is freed and replaced whatever its Node says.
pub(crate) fn next_remediation(f: &RemediationFacts) -> Remediate {
    // Only a Node that says it is healthy again cancels a fence: a Node
    // object gone (deleted by hand) is not one that came back.
    let back = f.health.as_ref().is_some_and(|h| !h.failing);
    match f.recorded {
        Some(RemediationStep::Fence) if back => return Remediate::Cancel,
        Some(RemediationStep::Fence) => return Remediate::Fence,
        Some(RemediationStep::Free) => return Remediate::Free,
        Some(RemediationStep::Replace) if f.pool.is_some() => return Remediate::Replace,
        Some(RemediationStep::Replace) => return Remediate::Fail,
        None => {}
    }
    let Some(why) = f.health.as_ref().and_then(|h| h.unhealthy.clone()) else {
        return Remediate::Nothing;
    };
    if f.policy == RemediationPolicy::Off {
        return Remediate::Off { why };
    }
    let held = [(f.pool, "in its pool"), (Some(f.cluster), "in the cluster")]
        .into_iter()
        .find_map(|(share, group)| share.filter(|s| !s.allows()).map(|s| s.words(group)));
    match held {
        Some(held) => Remediate::Held {
            why: held,
            unhealthy: why,
        },
        None => Remediate::Begin { why },
    }
}

/// What a fence under way does on this reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FenceTurn {
    /// Ask the provider (again); `overdue` when the fence has outlasted
    /// its timeout and nothing else is left to try.
    Ask { overdue: bool },
    /// A `Stop` past its timeout, in a pool: turn it into a `Terminate`.
    /// The Machine is replaced, so its disks go anyway, and a VM that does
    /// not stop must not pin its Node's volumes.
    Escalate,
}

/// The turn of a `fence` that has lasted `lasted` (since it began, or
/// since it was escalated) against `timeout`. Outside a pool a stopped VM
/// is kept for the operator to look at, so a `Stop` is never escalated
/// there.
pub(crate) fn fence_turn(
    fence: Fence,
    lasted: Duration,
    timeout: Duration,
    pooled: bool,
) -> FenceTurn {
    match (lasted >= timeout, fence) {
        (false, _) => FenceTurn::Ask { overdue: false },
        (true, Fence::Stop) if pooled => FenceTurn::Escalate,
        (true, _) => FenceTurn::Ask { overdue: true },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(conditions: serde_json::Value) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"conditions": conditions},
        }))
        .expect("node")
    }

    const NOW: &str = "2026-01-01T01:00:00Z";

    fn at(s: &str) -> Timestamp {
        s.parse().expect("time")
    }

    #[test]
    fn ready_false_or_unknown_is_unhealthy_after_the_timeout() {
        let ten = Duration::from_secs(600);
        let n = node(serde_json::json!([
            {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-01-01T00:55:00Z"}
        ]));
        let j = judge(&n, at(NOW), ten, &[]);
        assert!(j.failing && j.unhealthy.is_none());
        assert_eq!(j.recheck_in, Some(Duration::from_millis(300_100)));
        let j = judge(&n, at("2026-01-01T01:05:00Z"), ten, &[]);
        assert_eq!(
            j.unhealthy.as_deref(),
            Some("Node n1 has been Ready Unknown for 10m (limit 10m)")
        );
        let ok = node(serde_json::json!([
            {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
        ]));
        assert_eq!(judge(&ok, at(NOW), ten, &[]), Judged::default());
        // No Ready condition at all counts from the Node's creation.
        let none = node(serde_json::json!([]));
        assert!(judge(&none, at(NOW), ten, &[]).unhealthy.is_some());
    }

    #[test]
    fn a_listed_condition_counts_after_its_own_duration() {
        let rule = ConditionRule {
            type_: "KernelDeadlock".into(),
            status: "True".into(),
            after: Duration::from_secs(120),
        };
        let n = node(serde_json::json!([
            {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            {"type": "KernelDeadlock", "status": "True", "lastTransitionTime": "2026-01-01T00:59:00Z"}
        ]));
        let j = judge(
            &n,
            at(NOW),
            Duration::from_secs(600),
            std::slice::from_ref(&rule),
        );
        assert!(j.failing && j.unhealthy.is_none());
        assert_eq!(j.recheck_in, Some(Duration::from_millis(60_100)));
        let j = judge(
            &n,
            at("2026-01-01T01:01:00Z"),
            Duration::from_secs(600),
            &[rule],
        );
        assert!(
            j.unhealthy
                .is_some_and(|w| w.contains("KernelDeadlock True"))
        );
        // Not listed: not judged.
        assert!(!judge(&n, at(NOW), Duration::from_secs(600), &[]).failing);
    }

    #[test]
    fn a_fence_past_its_timeout_terminates_in_a_pool_and_is_named_elsewhere() {
        let (min, ten) = (Duration::from_secs(60), Duration::from_secs(600));
        assert_eq!(
            fence_turn(Fence::Stop, min, ten, true),
            FenceTurn::Ask { overdue: false }
        );
        assert_eq!(fence_turn(Fence::Stop, ten, ten, true), FenceTurn::Escalate);
        // Outside a pool the stopped VM is the operator's to look at.
        assert_eq!(
            fence_turn(Fence::Stop, ten, ten, false),
            FenceTurn::Ask { overdue: true }
        );
        // Nothing is left past a Terminate but to keep asking, named.
        assert_eq!(
            fence_turn(Fence::Terminate, ten, ten, true),
            FenceTurn::Ask { overdue: true }
        );
        assert_eq!(
            fence_turn(Fence::Terminate, min, ten, true),
            FenceTurn::Ask { overdue: false }
        );
    }

    fn facts(unhealthy: bool, recorded: Option<RemediationStep>) -> RemediationFacts {
        RemediationFacts {
            policy: RemediationPolicy::Replace,
            health: Some(Judged {
                failing: unhealthy,
                unhealthy: unhealthy.then(|| "Node n1 has been Ready False".into()),
                recheck_in: None,
            }),
            recorded,
            pool: Some(Share {
                unhealthy: 1,
                total: 5,
                max: MaxUnhealthy::Percent(40),
            }),
            cluster: Share {
                unhealthy: 1,
                total: 5,
                max: MaxUnhealthy::Percent(100),
            },
        }
    }

    #[test]
    fn an_unhealthy_machine_is_remediated_only_when_asked_and_within_the_bounds() {
        assert_eq!(next_remediation(&facts(false, None)), Remediate::Nothing);
        assert!(matches!(
            next_remediation(&facts(true, None)),
            Remediate::Begin { .. }
        ));
        let off = RemediationFacts {
            policy: RemediationPolicy::Off,
            ..facts(true, None)
        };
        assert!(matches!(next_remediation(&off), Remediate::Off { .. }));
        // Three of five at 40%: held, named.
        let mut partition = facts(true, None);
        partition.pool = Some(Share {
            unhealthy: 3,
            total: 5,
            max: MaxUnhealthy::Percent(40),
        });
        match next_remediation(&partition) {
            Remediate::Held { why, .. } => assert_eq!(
                why,
                "3 of 5 Machines in its pool are unhealthy, more than maxUnhealthy 40% (2) allows"
            ),
            other => panic!("{other:?}"),
        }
        // The cluster's bound holds too.
        let mut cluster = facts(true, None);
        cluster.cluster = Share {
            unhealthy: 4,
            total: 10,
            max: MaxUnhealthy::Count(3),
        };
        assert!(matches!(
            next_remediation(&cluster),
            Remediate::Held { why, .. } if why.contains("in the cluster")
        ));
    }

    #[test]
    fn a_remediation_under_way_goes_on_by_its_recorded_step() {
        use RemediationStep::*;
        assert_eq!(
            next_remediation(&facts(true, Some(Fence))),
            Remediate::Fence
        );
        // Back before the fence: canceled; after it, freed regardless.
        assert_eq!(
            next_remediation(&facts(false, Some(Fence))),
            Remediate::Cancel
        );
        assert_eq!(next_remediation(&facts(false, Some(Free))), Remediate::Free);
        assert_eq!(
            next_remediation(&facts(false, Some(Replace))),
            Remediate::Replace
        );
        let unpooled = RemediationFacts {
            pool: None,
            ..facts(true, Some(Replace))
        };
        assert_eq!(next_remediation(&unpooled), Remediate::Fail);
        // A partition that begins after the fence does not stop it.
        let mut late = facts(true, Some(Free));
        late.cluster.unhealthy = 5;
        assert_eq!(next_remediation(&late), Remediate::Free);
        // A Node object that vanished mid-fence is not a Node back.
        let vanished = RemediationFacts {
            health: None,
            ..facts(true, Some(Fence))
        };
        assert_eq!(next_remediation(&vanished), Remediate::Fence);
    }
}
