//! What a MachineSet's reconcile does, from facts: how many Machines to
//! create or delete, whether a Machine counts as ready or available, and
//! the status that says so. Pure; `reconcile` gathers the facts and acts.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::api::machineset::conditions::{READY, REPLICA_FAILURE};
use crate::api::{MachinePhase, MachineSetStatus};
use crate::machine::status::{Cond, set_condition};

/// What to do about the number of Machines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scale {
    Create(usize),
    Delete(usize),
    Hold,
}

/// `wanted` replicas with `active` Machines (owned, not being deleted).
/// Machines being deleted are going already: they are neither replicas nor
/// deleted again.
pub(crate) fn scale(wanted: i32, active: usize) -> Scale {
    let wanted = usize::try_from(wanted).unwrap_or(0);
    match wanted.cmp(&active) {
        std::cmp::Ordering::Greater => Scale::Create(wanted - active),
        std::cmp::Ordering::Less => Scale::Delete(active - wanted),
        std::cmp::Ordering::Equal => Scale::Hold,
    }
}

/// Whether `labels` match `selector` (`matchLabels` and every
/// `matchExpressions` requirement). An empty selector matches nothing: a
/// set never owns "every Machine".
pub(crate) fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let exprs = selector.match_expressions.as_deref().unwrap_or_default();
    let match_labels = selector.match_labels.as_ref();
    if exprs.is_empty() && match_labels.is_none_or(|m| m.is_empty()) {
        return false;
    }
    match_labels
        .into_iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v))
        && exprs.iter().all(|e| requirement(e, labels))
}

fn requirement(e: &LabelSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let values = e.values.as_deref().unwrap_or_default();
    let value = labels.get(&e.key);
    match e.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        _ => false,
    }
}

/// The selector as `kubectl` writes it (`a=b,c in (d,e)`), for
/// `status.selector`, which the scale subresource hands to its readers.
pub(crate) fn selector_string(selector: &LabelSelector) -> String {
    let mut parts: Vec<String> = selector
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in selector.match_expressions.iter().flatten() {
        let values = e.values.clone().unwrap_or_default().join(",");
        parts.push(match e.operator.as_str() {
            "In" => format!("{} in ({values})", e.key),
            "NotIn" => format!("{} notin ({values})", e.key),
            "Exists" => e.key.clone(),
            "DoesNotExist" => format!("!{}", e.key),
            other => format!("{} {other} ({values})", e.key),
        });
    }
    parts.join(",")
}

/// What the status counts of one Machine of the set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MachineFacts {
    pub(crate) phase: Option<MachinePhase>,
    /// Its Node takes pods now: Ready, and none of the taints of a Node
    /// still starting ([`crate::machine::decide::node_takes_pods`]).
    pub(crate) node_ready: bool,
    /// Since when the Machine has been Ready (its `Ready` condition's
    /// transition), if it is.
    pub(crate) ready_since: Option<Timestamp>,
}

impl MachineFacts {
    /// Running with its Node Ready and taking pods.
    pub(crate) fn ready(&self) -> bool {
        self.phase == Some(MachinePhase::Running) && self.node_ready
    }

    /// Ready for at least `min_ready`; `None` when it is not ready.
    /// `Some(left)` with `left > 0` when it will be in `left`.
    fn available_in(&self, min_ready: SignedDuration, now: Timestamp) -> Option<SignedDuration> {
        if !self.ready() {
            return None;
        }
        if min_ready.is_zero() {
            return Some(SignedDuration::ZERO);
        }
        let since = self.ready_since.unwrap_or(now);
        Some((min_ready - now.duration_since(since)).max(SignedDuration::ZERO))
    }

    /// Ready for at least `min_ready` now.
    pub(crate) fn available(&self, min_ready: SignedDuration, now: Timestamp) -> bool {
        self.available_in(min_ready, now)
            .is_some_and(|left| left.is_zero())
    }
}

/// A failure to report in `ReplicaFailure`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

/// What the status is built from.
pub(crate) struct Observed<'a> {
    pub(crate) wanted: i32,
    /// The set's Machines that are not being deleted.
    pub(crate) active: &'a [MachineFacts],
    /// Being deleted (going, not counted).
    pub(crate) deleting: usize,
    pub(crate) min_ready: SignedDuration,
    pub(crate) selector: String,
    pub(crate) generation: Option<i64>,
    pub(crate) failure: Option<Failure>,
}

/// The next status, and when it will change on its own (a Machine becoming
/// available after `minReadySeconds`), for a timer. Conditions keep their
/// transition time unless their status flips, so the same facts give the
/// same status and the reconcile writes nothing.
pub(crate) fn next_status(
    current: &MachineSetStatus,
    o: &Observed<'_>,
    now: Timestamp,
) -> (MachineSetStatus, Option<SignedDuration>) {
    let replicas = i32::try_from(o.active.len()).unwrap_or(i32::MAX);
    let ready = o.active.iter().filter(|m| m.ready()).count();
    let mut available = 0usize;
    let mut next_change: Option<SignedDuration> = None;
    for left in o
        .active
        .iter()
        .filter_map(|m| m.available_in(o.min_ready, now))
    {
        if left.is_zero() {
            available += 1;
        } else {
            next_change = Some(next_change.map_or(left, |n| n.min(left)));
        }
    }
    let ready = i32::try_from(ready).unwrap_or(i32::MAX);
    let mut s = current.clone();
    s.replicas = replicas;
    s.ready_replicas = ready;
    s.available_replicas = i32::try_from(available).unwrap_or(i32::MAX);
    s.selector = Some(o.selector.clone());
    s.observed_generation = o.generation;
    let ready_cond = if replicas < o.wanted {
        Cond::new(
            READY,
            false,
            "ScalingUp",
            format!("{replicas} of {} Machines exist", o.wanted),
        )
    } else if replicas > o.wanted {
        Cond::new(
            READY,
            false,
            "ScalingDown",
            format!("{replicas} Machines for {} wanted", o.wanted),
        )
    } else if ready < o.wanted {
        Cond::new(
            READY,
            false,
            "WaitingForReady",
            format!("{ready} of {} Machines ready", o.wanted),
        )
    } else {
        Cond::new(
            READY,
            true,
            "AllReplicasReady",
            format!("{ready} of {} Machines ready", o.wanted),
        )
    };
    let ready_cond = if o.deleting > 0 {
        Cond {
            message: format!("{}; {} being deleted", ready_cond.message, o.deleting),
            ..ready_cond
        }
    } else {
        ready_cond
    };
    set_condition(&mut s.conditions, &ready_cond, o.generation, now);
    let failure = match &o.failure {
        Some(f) => Cond::new(REPLICA_FAILURE, true, f.reason, f.message.clone()),
        None => Cond::new(REPLICA_FAILURE, false, "NoFailure", ""),
    };
    set_condition(&mut s.conditions, &failure, o.generation, now);
    (s, next_change)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).expect("valid")
    }

    #[test]
    fn scale_counts_active_machines_only() {
        for (wanted, active, want) in [
            (3, 0, Scale::Create(3)),
            (3, 3, Scale::Hold),
            (1, 3, Scale::Delete(2)),
            (0, 2, Scale::Delete(2)),
            (0, 0, Scale::Hold),
            (-1, 1, Scale::Delete(1)),
        ] {
            assert_eq!(
                scale(wanted, active),
                want,
                "{wanted} wanted, {active} active"
            );
        }
    }

    fn selector(labels: &[(&str, &str)], exprs: serde_json::Value) -> LabelSelector {
        serde_json::from_value(serde_json::json!({
            "matchLabels": labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
            "matchExpressions": exprs,
        }))
        .expect("selector")
    }

    #[test]
    fn selectors_match_labels_and_expressions() {
        let labels: BTreeMap<String, String> = [("pool", "a"), ("tier", "db")]
            .map(|(k, v)| (k.into(), v.into()))
            .into();
        let none = serde_json::json!([]);
        let cases = [
            (
                "matchLabels",
                selector(&[("pool", "a")], none.clone()),
                true,
            ),
            (
                "other value",
                selector(&[("pool", "b")], none.clone()),
                false,
            ),
            ("empty selects nothing", selector(&[], none.clone()), false),
            (
                "In",
                selector(
                    &[],
                    serde_json::json!([{"key": "tier", "operator": "In", "values": ["db", "web"]}]),
                ),
                true,
            ),
            (
                "NotIn",
                selector(
                    &[("pool", "a")],
                    serde_json::json!([{"key": "tier", "operator": "NotIn", "values": ["db"]}]),
                ),
                false,
            ),
            (
                "Exists and DoesNotExist",
                selector(
                    &[],
                    serde_json::json!([
                        {"key": "pool", "operator": "Exists"},
                        {"key": "gpu", "operator": "DoesNotExist"}
                    ]),
                ),
                true,
            ),
            (
                "unknown operator",
                selector(
                    &[],
                    serde_json::json!([{"key": "pool", "operator": "Gt", "values": ["1"]}]),
                ),
                false,
            ),
        ];
        for (case, sel, want) in cases {
            assert_eq!(selects(&sel, &labels), want, "{case}");
        }
        let sel = selector(
            &[("pool", "a")],
            serde_json::json!([{"key": "tier", "operator": "In", "values": ["db", "web"]}, {"key": "gpu", "operator": "DoesNotExist"}]),
        );
        assert_eq!(selector_string(&sel), "pool=a,tier in (db,web),!gpu");
    }

    fn facts(phase: MachinePhase, node_ready: bool, ready_since: Option<i64>) -> MachineFacts {
        MachineFacts {
            phase: Some(phase),
            node_ready,
            ready_since: ready_since.map(t),
        }
    }

    #[test]
    fn a_machine_is_available_once_ready_for_min_ready_seconds() {
        let min = SignedDuration::from_secs(30);
        let now = t(100);
        assert!(facts(MachinePhase::Running, true, Some(70)).available(min, now));
        assert!(!facts(MachinePhase::Running, true, Some(71)).available(min, now));
        assert!(!facts(MachinePhase::Running, false, Some(0)).available(min, now));
        assert!(facts(MachinePhase::Running, true, None).available(SignedDuration::ZERO, now));
    }

    fn observed(wanted: i32, active: &[MachineFacts], min_ready: i64) -> Observed<'_> {
        Observed {
            wanted,
            active,
            deleting: 0,
            min_ready: SignedDuration::from_secs(min_ready),
            selector: "pool=a".into(),
            generation: Some(2),
            failure: None,
        }
    }

    fn cond<'a>(s: &'a MachineSetStatus, type_: &str) -> (&'a str, &'a str) {
        let c = s
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .expect("condition");
        (c.status.as_str(), c.reason.as_str())
    }

    #[test]
    fn status_counts_ready_and_available_and_says_why_not_ready() {
        use MachinePhase::*;
        let machines = [
            facts(Running, true, Some(0)),
            facts(Running, true, Some(90)),
            facts(Running, false, Some(0)),
            facts(Creating, false, None),
        ];
        // (case, wanted, min ready, replicas, ready, available, Ready condition, next change)
        let cases = [
            ("scaling up", 5, 0, (4, 2, 2), ("False", "ScalingUp"), None),
            (
                "scaling down",
                2,
                0,
                (4, 2, 2),
                ("False", "ScalingDown"),
                None,
            ),
            (
                "waiting",
                4,
                0,
                (4, 2, 2),
                ("False", "WaitingForReady"),
                None,
            ),
            (
                "min ready",
                4,
                60,
                (4, 2, 1),
                ("False", "WaitingForReady"),
                Some(50),
            ),
        ];
        for (case, wanted, min_ready, counts, ready_cond, next) in cases {
            let (s, change) = next_status(
                &MachineSetStatus::default(),
                &observed(wanted, &machines, min_ready),
                t(100),
            );
            assert_eq!(
                (s.replicas, s.ready_replicas, s.available_replicas),
                counts,
                "{case}"
            );
            assert_eq!(cond(&s, READY), ready_cond, "{case}");
            assert_eq!(change, next.map(SignedDuration::from_secs), "{case}");
            assert_eq!(s.observed_generation, Some(2));
            assert_eq!(s.selector.as_deref(), Some("pool=a"));
        }
        let all = [facts(Running, true, Some(0))];
        let (s, _) = next_status(&MachineSetStatus::default(), &observed(1, &all, 0), t(100));
        assert_eq!(cond(&s, READY), ("True", "AllReplicasReady"));
        assert_eq!(cond(&s, REPLICA_FAILURE), ("False", "NoFailure"));
    }

    #[test]
    fn the_same_facts_later_give_the_same_status() {
        let machines = [facts(MachinePhase::Running, true, Some(0))];
        let o = observed(1, &machines, 0);
        let (first, _) = next_status(&MachineSetStatus::default(), &o, t(10));
        let (again, _) = next_status(&first, &o, t(500));
        assert_eq!(first, again, "no write, no wake-up, no loop");
        let failed = Observed {
            failure: Some(Failure {
                reason: "CreateFailed",
                message: "forbidden".into(),
            }),
            ..o
        };
        let (s, _) = next_status(&first, &failed, t(600));
        assert_eq!(cond(&s, REPLICA_FAILURE), ("True", "CreateFailed"));
    }
}
