//! The cluster's `DrainRule`s as one Machine's drain reads them: the
//! accepted rules whose `machines` pick the Machine ([`RuleBook`]), and
//! for a pod the rule that wins among those whose `pods` pick it
//! ([`Matched`]). Pure: the caller hands in the rules and the namespaces'
//! labels from its caches.
//!
//! Among several rules that pick one pod, the one with the lowest order
//! wins (a `Skip` or `WaitCompleted` counts as order 0), by name on a tie;
//! when they disagree, the pod's rule names the conflict (the plan prints
//! it and a Warning Event says it once).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::pdb::selector_matches;
use super::rules::{Behavior, Matched};
use crate::api::drainrule::{DrainRule, DrainRuleSpec, PodSelector, RuleBehavior};

/// The label the API server sets on every namespace: its name.
const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// One accepted rule that applies to the Machine.
#[derive(Debug, Clone)]
struct Entry {
    name: String,
    behavior: Behavior,
    order: Option<i32>,
    pods: Vec<PodSelector>,
    /// Its terms for the pods' moves, as annotations.
    terms: BTreeMap<String, String>,
}

impl Entry {
    fn rank(&self) -> (i32, &str) {
        (self.order.unwrap_or(0), self.name.as_str())
    }

    fn words(&self) -> String {
        match (self.behavior, self.order) {
            (Behavior::Drain, Some(o)) => format!("{} (Drain, order {o})", self.name),
            (Behavior::Drain, None) => format!("{} (Drain)", self.name),
            (Behavior::Skip, _) => format!("{} (Skip)", self.name),
            (Behavior::WaitCompleted, _) => format!("{} (WaitCompleted)", self.name),
        }
    }

    fn picks(
        &self,
        pod_labels: &BTreeMap<String, String>,
        ns_labels: &BTreeMap<String, String>,
    ) -> bool {
        self.pods.is_empty()
            || self.pods.iter().any(|s| {
                all_or(s.selector.as_ref(), pod_labels)
                    && all_or(s.namespace_selector.as_ref(), ns_labels)
            })
    }
}

/// An absent selector picks everything; an empty one too.
fn all_or(selector: Option<&LabelSelector>, labels: &BTreeMap<String, String>) -> bool {
    selector.is_none_or(|s| selector_matches(Some(s), labels))
}

/// Each namespace's labels, by name, as [`RuleBook::new`] takes them.
pub fn namespace_labels<'a>(
    namespaces: impl IntoIterator<Item = &'a Namespace>,
) -> BTreeMap<String, BTreeMap<String, String>> {
    namespaces
        .into_iter()
        .map(|n| {
            let labels = n.metadata.labels.clone().unwrap_or_default();
            (n.metadata.name.clone().unwrap_or_default(), labels)
        })
        .collect()
}

/// The accepted rules that apply to one Machine's drain, and the labels of
/// the namespaces its pods are in.
#[derive(Debug, Clone, Default)]
pub struct RuleBook {
    /// By rank: the lowest order first, then by name.
    entries: Vec<Entry>,
    namespaces: BTreeMap<String, BTreeMap<String, String>>,
}

impl RuleBook {
    /// The rules of `rules` that are valid (see [`validate`]) and whose
    /// `machines` pick a Machine labelled `machine`; `namespaces`: each
    /// namespace's labels.
    pub fn new<'a>(
        rules: impl IntoIterator<Item = &'a DrainRule>,
        machine: &BTreeMap<String, String>,
        mut namespaces: BTreeMap<String, BTreeMap<String, String>>,
    ) -> Self {
        // The API server labels every namespace with its name.
        for (name, labels) in &mut namespaces {
            labels.insert(NAMESPACE_NAME_LABEL.to_string(), name.clone());
        }
        let mut entries: Vec<Entry> = rules
            .into_iter()
            .filter(|r| validate(&r.spec).is_ok())
            .filter(|r| {
                r.spec.machines.is_empty()
                    || r.spec
                        .machines
                        .iter()
                        .any(|m| all_or(m.selector.as_ref(), machine))
            })
            .map(|r| Entry {
                name: r.metadata.name.clone().unwrap_or_default(),
                behavior: match r.spec.drain.behavior {
                    RuleBehavior::Drain => Behavior::Drain,
                    RuleBehavior::Skip => Behavior::Skip,
                    RuleBehavior::WaitCompleted => Behavior::WaitCompleted,
                },
                order: r
                    .spec
                    .drain
                    .order
                    .filter(|_| r.spec.drain.behavior == RuleBehavior::Drain),
                pods: r.spec.pods.clone(),
                terms: r
                    .spec
                    .moves
                    .as_ref()
                    .map(|m| m.annotations())
                    .unwrap_or_default(),
            })
            .collect();
        entries.sort_by(|a, b| a.rank().cmp(&b.rank()));
        Self {
            entries,
            namespaces,
        }
    }

    /// Whether no rule applies to the Machine.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The rule that wins for `pod`, if any picks it.
    pub fn matched(&self, pod: &Pod) -> Option<Matched> {
        if self.entries.is_empty() {
            return None;
        }
        let empty = BTreeMap::new();
        let pod_labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        // A namespace not (yet) cached still has its name label.
        let uncached;
        let ns_labels = match self.namespaces.get(&ns) {
            Some(labels) => labels,
            None => {
                uncached = BTreeMap::from([(NAMESPACE_NAME_LABEL.to_string(), ns)]);
                &uncached
            }
        };
        let mut picking = self
            .entries
            .iter()
            .filter(|e| e.picks(pod_labels, ns_labels));
        let winner = picking.next()?;
        let others: Vec<String> = picking
            .filter(|e| {
                (e.behavior, e.order.unwrap_or(0)) != (winner.behavior, winner.order.unwrap_or(0))
            })
            .map(Entry::words)
            .collect();
        let conflict = (!others.is_empty()).then(|| {
            format!(
                "DrainRules {} and {} pick this pod and disagree: {} is used (the lowest order, then the first by name)",
                winner.words(),
                others.join(", "),
                winner.name
            )
        });
        Some(Matched {
            name: winner.name.clone(),
            behavior: winner.behavior,
            order: winner.order,
            conflict,
            terms: winner.terms.clone(),
        })
    }
}

/// Whether a rule's selectors can be read: each requirement's operator is
/// one of `In`, `NotIn`, `Exists`, `DoesNotExist`, with values for the
/// first two and none for the others, and a key. `Err` says which is not.
pub fn validate(spec: &DrainRuleSpec) -> Result<(), String> {
    let machines = spec
        .machines
        .iter()
        .enumerate()
        .map(|(i, m)| (format!("machines[{i}].selector"), m.selector.as_ref()));
    let pods = spec.pods.iter().enumerate().flat_map(|(i, p)| {
        [
            (format!("pods[{i}].selector"), p.selector.as_ref()),
            (
                format!("pods[{i}].namespaceSelector"),
                p.namespace_selector.as_ref(),
            ),
        ]
    });
    let mut problems = Vec::new();
    for (field, selector) in machines.chain(pods) {
        let requirements = selector
            .and_then(|s| s.match_expressions.as_deref())
            .unwrap_or_default();
        for (j, r) in requirements.iter().enumerate() {
            let values = r.values.as_deref().unwrap_or_default();
            let bad = match r.operator.as_str() {
                _ if r.key.is_empty() => Some("has no key".to_string()),
                "In" | "NotIn" if values.is_empty() => {
                    Some(format!("operator {} needs values", r.operator))
                }
                "Exists" | "DoesNotExist" if !values.is_empty() => {
                    Some(format!("operator {} takes no values", r.operator))
                }
                "In" | "NotIn" | "Exists" | "DoesNotExist" => None,
                other => Some(format!(
                    "operator {other:?} is not one of In, NotIn, Exists, DoesNotExist"
                )),
            };
            if let Some(bad) = bad {
                problems.push(format!("{field}.matchExpressions[{j}] ({}) {bad}", r.key));
            }
        }
    }
    problems.extend(terms_problems(spec));
    match problems.is_empty() {
        true => Ok(()),
        false => Err(problems.join("; ")),
    }
}

/// What is wrong with a rule's terms for its pods' moves (`spec.moves`),
/// each in words: read as the annotations of the same meaning are.
fn terms_problems(spec: &DrainRuleSpec) -> Vec<String> {
    let Some(m) = &spec.moves else {
        return Vec::new();
    };
    let mut problems = Vec::new();
    let max_moving = m.annotations().remove("berth.dev/max-moving");
    if let Some(v) = &max_moving
        && v.trim() != "unbounded"
        && !v.trim().parse::<u32>().is_ok_and(|n| n >= 1)
    {
        problems.push(format!(
            "moves.maxMoving {v:?} is not a whole number from 1, nor \"unbounded\""
        ));
    }
    for (field, v) in [
        ("minHealthyTime", &m.min_healthy_time),
        ("healthyDeadline", &m.healthy_deadline),
    ] {
        if let Some(v) = v
            && let Err(e) = humantime::parse_duration(v.trim())
        {
            problems.push(format!("moves.{field} {v:?} is not a duration: {e}"));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::fixtures::pod;

    fn rule(name: &str, spec: serde_json::Value) -> DrainRule {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "berth.dev/v1alpha1",
            "kind": "DrainRule",
            "metadata": {"name": name},
            "spec": spec,
        }))
        .expect("a rule")
    }

    fn labels(kvs: &[(&str, &str)]) -> BTreeMap<String, String> {
        kvs.iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    }

    fn labelled(ns: &str, name: &str, kvs: &[(&str, &str)]) -> Pod {
        let mut p = pod(ns, name);
        p.metadata.labels = Some(labels(kvs));
        p
    }

    #[test]
    fn a_rules_move_terms_reach_the_pods_it_picks_and_bad_ones_refuse_it() {
        let terms = rule(
            "operators",
            serde_json::json!({
                "drain": {"behavior": "Drain"},
                "moves": {"maxMoving": 2, "minHealthyTime": "30s", "surge": false},
            }),
        );
        let book = RuleBook::new([&terms], &BTreeMap::new(), BTreeMap::new());
        let m = book.matched(&labelled("ns", "p", &[])).expect("picked");
        assert_eq!(
            m.terms,
            labels(&[
                ("berth.dev/max-moving", "2"),
                ("berth.dev/min-healthy-time", "30s"),
                ("berth.dev/surge", "false"),
            ])
        );
        let bad = rule(
            "bad",
            serde_json::json!({
                "drain": {"behavior": "Drain"},
                "moves": {"maxMoving": "0", "healthyDeadline": "soon"},
            }),
        );
        let why = validate(&bad.spec).expect_err("refused");
        assert!(why.contains("moves.maxMoving \"0\""), "{why}");
        assert!(why.contains("moves.healthyDeadline \"soon\""), "{why}");
        assert!(!why.contains("selector"), "{why}");
        let book = RuleBook::new([&bad], &BTreeMap::new(), BTreeMap::new());
        assert!(book.is_empty(), "an invalid rule applies to nothing");
    }

    #[test]
    fn a_rule_picks_by_machine_pod_and_namespace() {
        let storage = rule(
            "storage",
            serde_json::json!({
                "drain": {"behavior": "Skip"},
                "machines": [{"selector": {"matchLabels": {"pool": "db"}}}],
                "pods": [{"selector": {"matchLabels": {"app": "ceph"}},
                          "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rook"}}}],
            }),
        );
        let namespaces = BTreeMap::from([("rook".to_string(), labels(&[("team", "storage")]))]);
        let db = RuleBook::new([&storage], &labels(&[("pool", "db")]), namespaces.clone());
        let matched = db.matched(&labelled("rook", "osd-0", &[("app", "ceph")]));
        assert_eq!(
            matched.map(|m| (m.name, m.behavior)),
            Some(("storage".to_string(), Behavior::Skip))
        );
        // Another namespace, another app: not picked.
        assert_eq!(
            db.matched(&labelled("web", "osd-0", &[("app", "ceph")])),
            None
        );
        assert_eq!(
            db.matched(&labelled("rook", "x", &[("app", "other")])),
            None
        );
        // Another pool's Machine: the rule is not in its book.
        let web = RuleBook::new([&storage], &labels(&[("pool", "web")]), namespaces);
        assert!(web.is_empty());
        // No selectors at all: every pod of every Machine.
        let all = rule(
            "all",
            serde_json::json!({"drain": {"behavior": "Drain", "order": 3}}),
        );
        let book = RuleBook::new([&all], &BTreeMap::new(), BTreeMap::new());
        let m = book.matched(&labelled("any", "p", &[])).expect("picked");
        assert_eq!((m.behavior, m.order), (Behavior::Drain, Some(3)));
    }

    #[test]
    fn the_lowest_order_wins_and_a_disagreement_is_named() {
        let late = rule(
            "a-late",
            serde_json::json!({"drain": {"behavior": "Drain", "order": 10}}),
        );
        let skip = rule("b-skip", serde_json::json!({"drain": {"behavior": "Skip"}}));
        let early = rule(
            "c-early",
            serde_json::json!({"drain": {"behavior": "Drain", "order": -5}}),
        );
        let same = rule(
            "d-same",
            serde_json::json!({"drain": {"behavior": "Drain", "order": -5}}),
        );
        let book = RuleBook::new(
            [&late, &skip, &early, &same],
            &BTreeMap::new(),
            BTreeMap::new(),
        );
        let m = book.matched(&labelled("ns", "p", &[])).expect("picked");
        assert_eq!((m.name.as_str(), m.order), ("c-early", Some(-5)));
        assert_eq!(
            m.conflict.as_deref(),
            Some(
                "DrainRules c-early (Drain, order -5) and b-skip (Skip), a-late (Drain, order 10) pick this pod and disagree: c-early is used (the lowest order, then the first by name)"
            )
        );
        // Rules that agree are no conflict; on a tie the first by name.
        let book = RuleBook::new([&same, &early], &BTreeMap::new(), BTreeMap::new());
        let m = book.matched(&labelled("ns", "p", &[])).expect("picked");
        assert_eq!((m.name.as_str(), m.conflict), ("c-early", None));
    }

    #[test]
    fn a_selector_that_cannot_be_read_makes_the_rule_apply_to_nothing() {
        let bad = rule(
            "bad",
            serde_json::json!({
                "drain": {"behavior": "Skip"},
                "pods": [{"selector": {"matchExpressions": [
                    {"key": "app", "operator": "In"},
                    {"key": "tier", "operator": "Exists", "values": ["x"]},
                    {"key": "zone", "operator": "Near", "values": ["a"]}]}}],
            }),
        );
        assert_eq!(
            validate(&bad.spec),
            Err("pods[0].selector.matchExpressions[0] (app) operator In needs values; pods[0].selector.matchExpressions[1] (tier) operator Exists takes no values; pods[0].selector.matchExpressions[2] (zone) operator \"Near\" is not one of In, NotIn, Exists, DoesNotExist".into())
        );
        assert!(RuleBook::new([&bad], &BTreeMap::new(), BTreeMap::new()).is_empty());
    }
}
