//! Drain rules: what a pod's owner asks of the drain, and the drain's own
//! tiers. Pure functions from a pod to its [`Rule`]; the plan groups pods by
//! it and the engine follows the groups.
//!
//! A pod says, with annotations (the service owner's own objects; in the
//! spirit of Cluster API's MachineDrainRule, without a new object):
//!
//! - [`DRAIN_ANNOTATION`] `skip`: never evicted; left to end with the VM,
//!   as a DaemonSet's pods are. `wait-completed`: never evicted; the drain
//!   waits until the pod completes (`Succeeded` or `Failed`, then deleted
//!   outright) or is gone, bounded by the drain deadline. `drain` (or
//!   absent): evicted as usual.
//! - [`ORDER_ANNOTATION`] an integer: the pod's **order group**. Groups go
//!   in ascending order; a group starts once every pod of the groups before
//!   it is gone (evicted, completed, or deleted) and their volumes have
//!   moved. Within a group the pods without persistent volumes go
//!   concurrently and the stateful ones in priority order, as always.
//!
//! Without an order annotation a pod's order is [`DEFAULT_ORDER`], unless
//! it is **critical** ([`critical`]: priority class
//! `system-cluster-critical` or `system-node-critical`, or `spec.priority`
//! at or above [`SYSTEM_CRITICAL_PRIORITY`]): then [`CRITICAL_ORDER`], so
//! that DNS, CSI controllers and the like leave after the workloads that
//! need them. An explicit order wins over the critical default.
//!
//! For pods whose templates the operator does not own, the same two
//! settings come from the cluster's `DrainRule`s ([`cluster_rules`]), and
//! Cluster API's pod label [`CAPI_DRAIN_LABEL`] (`skip`,
//! `wait-completed`) is read too, so that pods labelled for Cluster API's
//! drain behave the same under berth's. A pod's own annotations win, then
//! the label, then the rule that picks it:
//!
//! | | behaviour | order |
//! | --- | --- | --- |
//! | 1 | `berth.dev/drain` | `berth.dev/drain-order` |
//! | 2 | `cluster.x-k8s.io/drain` | the rule's `order` |
//! | 3 | the rule's `behavior` | the critical default |
//! | 4 | `Drain` | `0` |
//!
//! A value the drain does not understand is reported (the plan names it,
//! a Warning Event says it once) and the default is used; it never fails
//! the drain. So is a disagreement between rules.
//!
//! [`cluster_rules`]: super::cluster_rules

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;

/// The annotation that sets a pod's drain behaviour.
pub const DRAIN_ANNOTATION: &str = "berth.dev/drain";
/// The annotation that sets a pod's order group.
pub const ORDER_ANNOTATION: &str = "berth.dev/drain-order";
/// Cluster API's pod label: `skip` or `wait-completed` (its drain's only
/// values).
pub const CAPI_DRAIN_LABEL: &str = "cluster.x-k8s.io/drain";
/// The order group of a pod that is not critical and says nothing.
pub const DEFAULT_ORDER: i32 = 0;
/// The order group of a critical pod that says nothing.
pub const CRITICAL_ORDER: i32 = 1000;
/// Kubernetes' `SystemCriticalPriority`: user-defined priority classes stop
/// at one billion, the two system classes are at or above this.
pub const SYSTEM_CRITICAL_PRIORITY: i32 = 2_000_000_000;
/// The priority classes Kubernetes reserves for critical pods.
const CRITICAL_CLASSES: [&str; 2] = ["system-cluster-critical", "system-node-critical"];

/// What the drain does with a pod, per its [`DRAIN_ANNOTATION`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behavior {
    /// Evicted (the default).
    Drain,
    /// Never evicted; ends with the VM.
    Skip,
    /// Never evicted; waited for until it completes or is gone.
    WaitCompleted,
}

/// The cluster DrainRule that picks a pod (see
/// [`RuleBook::matched`](super::cluster_rules::RuleBook::matched)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    /// The DrainRule's name.
    pub name: String,
    pub behavior: Behavior,
    /// The order it sets, if it sets one.
    pub order: Option<i32>,
    /// Other rules that pick the pod and say otherwise, in words.
    pub conflict: Option<String>,
    /// Its terms for the pod's moves, as annotations (see
    /// [`RuleMoves`](crate::api::drainrule::RuleMoves)); empty: none.
    pub terms: BTreeMap<String, String>,
}

/// A DrainRule's terms for a pod's moves: the rule's name, and the terms
/// as the annotations of the same meaning, under the pod's and its
/// workload's own (which win).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleTerms {
    pub rule: String,
    pub annotations: BTreeMap<String, String>,
}

/// A pod's drain rule, as its annotations and priority make it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub behavior: Behavior,
    /// What set the behaviour, when not the default: the annotation or
    /// the label with its value (`berth.dev/drain=skip`), or `DrainRule
    /// <name>`.
    pub behavior_source: Option<String>,
    /// Its order group.
    pub order: i32,
    /// Why it is critical, if it is (`priorityClassName …` or
    /// `priority …`).
    pub critical: Option<String>,
    /// Whether `order` was set by [`ORDER_ANNOTATION`].
    pub explicit_order: bool,
    /// The DrainRule that set `order`, if one did.
    pub order_rule: Option<String>,
    /// Annotation values not understood, each with the default used.
    pub problems: Vec<String>,
    /// The terms of the DrainRule that picks the pod, if it sets any.
    pub terms: Option<RuleTerms>,
}

impl Rule {
    /// Where its order comes from when not the default: `critical:
    /// priorityClassName system-node-critical`, or the annotation.
    pub fn order_source(&self) -> Option<String> {
        match (&self.critical, self.explicit_order, &self.order_rule) {
            (_, true, _) => Some(ORDER_ANNOTATION.to_string()),
            (_, false, Some(rule)) => Some(format!("DrainRule {rule}")),
            (Some(why), false, None) => Some(format!("critical: {why}")),
            (None, false, None) => None,
        }
    }
}

/// Why `pod` is critical, if it is.
pub fn critical(pod: &Pod) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    if let Some(class) = spec
        .priority_class_name
        .as_deref()
        .filter(|c| CRITICAL_CLASSES.contains(c))
    {
        return Some(format!("priorityClassName {class}"));
    }
    spec.priority
        .filter(|p| *p >= SYSTEM_CRITICAL_PRIORITY)
        .map(|p| format!("priority {p}"))
}

/// The drain rule of `pod`; see the module documentation.
pub fn rule(pod: &Pod) -> Rule {
    rule_in(pod, None)
}

/// [`rule`], with `matched` the DrainRule that picks the pod, if any (see
/// [`RuleBook::matched`](super::cluster_rules::RuleBook::matched)).
pub fn rule_in(pod: &Pod, matched: Option<&Matched>) -> Rule {
    let annotations = pod.metadata.annotations.as_ref();
    let get = |k: &str| annotations.and_then(|a| a.get(k)).map(|v| v.trim());
    let label = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(CAPI_DRAIN_LABEL))
        .map(|v| v.trim());
    let mut problems = Vec::new();
    let annotated = match get(DRAIN_ANNOTATION) {
        None => None,
        Some(v @ "drain") => Some((Behavior::Drain, v)),
        Some(v @ "skip") => Some((Behavior::Skip, v)),
        Some(v @ "wait-completed") => Some((Behavior::WaitCompleted, v)),
        Some(other) => {
            problems.push(format!(
                "{DRAIN_ANNOTATION}={other:?} is not one of drain, skip, wait-completed; ignored"
            ));
            None
        }
    };
    let labelled = match label {
        None => None,
        Some(v @ "skip") => Some((Behavior::Skip, v)),
        Some(v @ "wait-completed") => Some((Behavior::WaitCompleted, v)),
        Some(other) => {
            problems.push(format!(
                "{CAPI_DRAIN_LABEL}={other:?} is not one of skip, wait-completed; ignored"
            ));
            None
        }
    };
    let (behavior, behavior_source) = match (annotated, labelled, matched) {
        (Some((b, v)), _, _) => (b, Some(format!("{DRAIN_ANNOTATION}={v}"))),
        (None, Some((b, v)), _) => (b, Some(format!("{CAPI_DRAIN_LABEL}={v}"))),
        (None, None, Some(m)) => (
            m.behavior,
            Some(format!("DrainRule {} ({:?})", m.name, m.behavior)),
        ),
        (None, None, None) => (Behavior::Drain, None),
    };
    if let Some(conflict) = matched.and_then(|m| m.conflict.clone()) {
        problems.push(conflict);
    }
    let critical = critical(pod);
    let default = if critical.is_some() {
        CRITICAL_ORDER
    } else {
        DEFAULT_ORDER
    };
    // A rule's order, when the pod's own annotation sets none.
    let ruled = matched.and_then(|m| m.order.map(|o| (o, m.name.clone())));
    let (fallback, order_rule) = match ruled {
        Some((o, name)) => (o, Some(name)),
        None => (default, None),
    };
    let (order, explicit_order) = match get(ORDER_ANNOTATION) {
        None => (fallback, false),
        Some(v) => match v.parse::<i32>() {
            Ok(o) => (o, true),
            Err(_) => {
                problems.push(format!(
                    "{ORDER_ANNOTATION}={v:?} is not a 32-bit integer; order {fallback} used"
                ));
                (fallback, false)
            }
        },
    };
    Rule {
        behavior,
        behavior_source,
        order,
        critical,
        explicit_order,
        order_rule: order_rule.filter(|_| !explicit_order),
        problems,
        terms: matched.filter(|m| !m.terms.is_empty()).map(|m| RuleTerms {
            rule: m.name.clone(),
            annotations: m.terms.clone(),
        }),
    }
}

/// What a drain does on entering order group `order` for a pass, given
/// the groups it worked on before (`seen`: the first and the last).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupStep {
    /// The first group and this one.
    pub seen: (i32, i32),
    /// Nothing of this group is evicted before the volumes of the pods that
    /// left are off the Node: a group before it was worked on in this
    /// drain, or it comes after the default group (a drain that restarted
    /// in the critical group finds the volumes of the pods that left
    /// before still moving).
    pub after_volumes: bool,
    /// This group comes after the last one worked on (given): say so.
    pub after: Option<i32>,
}

/// See [`GroupStep`].
pub fn enter_group(seen: Option<(i32, i32)>, order: i32) -> GroupStep {
    let (first, last) = seen.unwrap_or((order, order));
    GroupStep {
        seen: (first, order),
        after_volumes: order > first || order > DEFAULT_ORDER,
        after: (order > last).then_some(last),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::fixtures::{PodFixture, pod};

    fn annotated(mut p: Pod, kvs: &[(&str, &str)]) -> Pod {
        let a = p.metadata.annotations.get_or_insert_default();
        for (k, v) in kvs {
            a.insert((*k).into(), (*v).into());
        }
        p
    }

    fn class(mut p: Pod, name: &str) -> Pod {
        p.spec.get_or_insert_default().priority_class_name = Some(name.into());
        p
    }

    #[test]
    fn a_later_group_waits_for_the_volumes_and_is_announced_once() {
        let first = enter_group(None, 0);
        assert_eq!(
            first,
            GroupStep {
                seen: (0, 0),
                after_volumes: false,
                after: None
            },
            "the first group goes as a drain always did"
        );
        let again = enter_group(Some(first.seen), 0);
        assert_eq!(again, first, "the same group in the next pass");
        let critical = enter_group(Some(again.seen), CRITICAL_ORDER);
        assert_eq!(
            critical,
            GroupStep {
                seen: (0, CRITICAL_ORDER),
                after_volumes: true,
                after: Some(0)
            }
        );
        let still = enter_group(Some(critical.seen), CRITICAL_ORDER);
        assert_eq!(still.after, None, "announced once");
        assert!(still.after_volumes);
        // A pod of a lower group appearing (an annotation changed) is worked
        // on next, without an announcement, still after the first group.
        let back = enter_group(Some(still.seen), 5);
        assert_eq!(
            back,
            GroupStep {
                seen: (0, 5),
                after_volumes: true,
                after: None
            }
        );
        // A drain that starts (or restarts) in the critical group waits for
        // the volumes of the pods that left too; one in a group before the
        // default one goes as a drain always did.
        assert!(enter_group(None, CRITICAL_ORDER).after_volumes);
        assert!(!enter_group(None, -3).after_volumes);
        assert!(enter_group(Some((-3, -3)), 0).after_volumes);
    }

    #[test]
    fn critical_pods_are_named_by_class_or_priority() {
        let cases = [
            (pod("a", "p"), None),
            (pod("a", "p").priority(1_000_000_000), None),
            (
                pod("a", "p").priority(SYSTEM_CRITICAL_PRIORITY),
                Some("priority 2000000000"),
            ),
            (
                pod("a", "p").priority(2_000_001_000),
                Some("priority 2000001000"),
            ),
            (
                class(pod("a", "p"), "system-node-critical").priority(2_000_001_000),
                Some("priorityClassName system-node-critical"),
            ),
            (
                class(pod("a", "p"), "system-cluster-critical"),
                Some("priorityClassName system-cluster-critical"),
            ),
            (class(pod("a", "p"), "high"), None),
        ];
        for (p, want) in cases {
            assert_eq!(critical(&p).as_deref(), want, "{:?}", p.spec);
        }
    }

    #[test]
    fn annotations_set_the_behaviour_and_the_order() {
        let node_critical = || class(pod("a", "p"), "system-node-critical");
        // (pod, behaviour, order, explicit, problems)
        let cases = [
            (pod("a", "p"), Behavior::Drain, 0, false, 0),
            (node_critical(), Behavior::Drain, CRITICAL_ORDER, false, 0),
            (
                annotated(pod("a", "p"), &[(DRAIN_ANNOTATION, "skip")]),
                Behavior::Skip,
                0,
                false,
                0,
            ),
            (
                annotated(pod("a", "p"), &[(DRAIN_ANNOTATION, " wait-completed ")]),
                Behavior::WaitCompleted,
                0,
                false,
                0,
            ),
            (
                annotated(pod("a", "p"), &[(DRAIN_ANNOTATION, "drain")]),
                Behavior::Drain,
                0,
                false,
                0,
            ),
            (
                annotated(pod("a", "p"), &[(ORDER_ANNOTATION, "-5")]),
                Behavior::Drain,
                -5,
                true,
                0,
            ),
            // An explicit order wins over the critical default.
            (
                annotated(node_critical(), &[(ORDER_ANNOTATION, "10")]),
                Behavior::Drain,
                10,
                true,
                0,
            ),
            // Values not understood: the defaults, and a problem each.
            (
                annotated(pod("a", "p"), &[(DRAIN_ANNOTATION, "Skip")]),
                Behavior::Drain,
                0,
                false,
                1,
            ),
            (
                annotated(
                    node_critical(),
                    &[(ORDER_ANNOTATION, "last"), (DRAIN_ANNOTATION, "never")],
                ),
                Behavior::Drain,
                CRITICAL_ORDER,
                false,
                2,
            ),
            (
                annotated(pod("a", "p"), &[(ORDER_ANNOTATION, "99999999999")]),
                Behavior::Drain,
                0,
                false,
                1,
            ),
        ];
        for (p, behavior, order, explicit, problems) in cases {
            let r = rule(&p);
            let what = format!("{:?}: {r:?}", p.metadata.annotations);
            assert_eq!(r.behavior, behavior, "{what}");
            assert_eq!(r.order, order, "{what}");
            assert_eq!(r.explicit_order, explicit, "{what}");
            assert_eq!(r.problems.len(), problems, "{what}");
        }
        let r = rule(&annotated(
            node_critical(),
            &[(ORDER_ANNOTATION, "last"), (DRAIN_ANNOTATION, "never")],
        ));
        assert_eq!(
            r.problems,
            [
                "berth.dev/drain=\"never\" is not one of drain, skip, wait-completed; ignored",
                "berth.dev/drain-order=\"last\" is not a 32-bit integer; order 1000 used",
            ]
        );
        assert_eq!(
            r.order_source().as_deref(),
            Some("critical: priorityClassName system-node-critical")
        );
        assert_eq!(
            rule(&annotated(node_critical(), &[(ORDER_ANNOTATION, "7")]))
                .order_source()
                .as_deref(),
            Some("berth.dev/drain-order")
        );
        assert_eq!(rule(&pod("a", "p")).order_source(), None);
    }

    fn labelled(mut p: Pod, v: &str) -> Pod {
        p.metadata
            .labels
            .get_or_insert_default()
            .insert(CAPI_DRAIN_LABEL.into(), v.into());
        p
    }

    fn matched(behavior: Behavior, order: Option<i32>) -> Matched {
        Matched {
            name: "storage".into(),
            behavior,
            order,
            conflict: None,
            terms: BTreeMap::new(),
        }
    }

    #[test]
    fn the_annotation_wins_over_cluster_apis_label_over_a_rule() {
        let skip_rule = matched(Behavior::Skip, None);
        let plain = pod("a", "p");
        let r = rule_in(&plain, Some(&skip_rule));
        assert_eq!(
            (r.behavior, r.behavior_source.as_deref()),
            (Behavior::Skip, Some("DrainRule storage (Skip)"))
        );
        let capi = labelled(pod("a", "p"), "wait-completed");
        let r = rule_in(&capi, Some(&skip_rule));
        assert_eq!(
            (r.behavior, r.behavior_source.as_deref()),
            (
                Behavior::WaitCompleted,
                Some("cluster.x-k8s.io/drain=wait-completed")
            )
        );
        let own = annotated(capi.clone(), &[(DRAIN_ANNOTATION, "drain")]);
        let r = rule_in(&own, Some(&skip_rule));
        assert_eq!(
            (r.behavior, r.behavior_source.as_deref()),
            (Behavior::Drain, Some("berth.dev/drain=drain"))
        );
        // A label value Cluster API does not have: named, ignored.
        let odd = labelled(pod("a", "p"), "Drain");
        let r = rule_in(&odd, None);
        assert_eq!((r.behavior, r.behavior_source), (Behavior::Drain, None));
        assert_eq!(
            r.problems,
            ["cluster.x-k8s.io/drain=\"Drain\" is not one of skip, wait-completed; ignored"]
        );
        // An annotation not understood falls through to the rule.
        let bad = annotated(pod("a", "p"), &[(DRAIN_ANNOTATION, "later")]);
        assert_eq!(rule_in(&bad, Some(&skip_rule)).behavior, Behavior::Skip);
    }

    #[test]
    fn a_rules_order_yields_to_the_annotation_and_wins_over_the_critical_default() {
        let ordered = matched(Behavior::Drain, Some(-10));
        let critical = class(pod("a", "p"), "system-node-critical");
        let r = rule_in(&critical, Some(&ordered));
        assert_eq!(r.order, -10);
        assert_eq!(r.order_source().as_deref(), Some("DrainRule storage"));
        let own = annotated(critical.clone(), &[(ORDER_ANNOTATION, "4")]);
        let r = rule_in(&own, Some(&ordered));
        assert_eq!(
            (r.order, r.order_source().as_deref()),
            (4, Some(ORDER_ANNOTATION))
        );
        // A rule without an order keeps the critical default.
        let r = rule_in(&critical, Some(&matched(Behavior::Drain, None)));
        assert_eq!(r.order, CRITICAL_ORDER);
        // A conflict is named with the pod's problems.
        let mut torn = matched(Behavior::Drain, Some(1));
        torn.conflict = Some("DrainRules disagree".into());
        assert_eq!(
            rule_in(&pod("a", "p"), Some(&torn)).problems,
            ["DrainRules disagree"]
        );
    }
}
