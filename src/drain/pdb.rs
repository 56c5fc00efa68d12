//! Which PodDisruptionBudgets cover a pod, and what each means for its
//! eviction.
//!
//! A PDB covers a pod when both are in the same namespace and the PDB's
//! `spec.selector` matches the pod's labels. Per `policy/v1`, an empty
//! selector (`{}`) matches every pod in the namespace and a null selector
//! matches none. Label selectors follow the API: every `matchLabels` pair and
//! every `matchExpressions` requirement must hold (`In`, `NotIn`, `Exists`,
//! `DoesNotExist`; `NotIn` and `DoesNotExist` hold when the key is absent).
//! An unknown operator, which API validation rejects, matches nothing.
//!
//! Each covering PDB gets a [`PdbVerdict`]:
//!
//! - **Misconfigured** (the rule of Gardener MCM): the disruption controller
//!   has observed the current generation, `expectedPods > 0`,
//!   `currentHealthy >= expectedPods` and yet `disruptionsAllowed == 0`,
//!   with no disruption in flight (`status.disruptedPods` empty).
//!   Every expected pod is healthy and still nothing may go (for example
//!   `minAvailable` equal to the replica count), so retrying an eviction can
//!   never succeed; the drain reports it instead of retrying forever.
//!   A PDB with disruptions in flight only looks so: the Eviction API
//!   lowers `disruptionsAllowed` and records the pod in `disruptedPods` at
//!   once, and the disruption controller recounts `currentHealthy` only
//!   later, so right after evictions up to the budget every pod still
//!   counts as healthy. That budget is waiting, not misconfigured.
//! - **Blocking**: no disruption is allowed now, but may be later (pods not
//!   yet healthy, or disruptions in flight not yet counted). Also when the controller has not yet observed the
//!   current generation (`status.observedGeneration < metadata.generation`):
//!   the Eviction API refuses every eviction under such a PDB until it has.
//! - **Allows**: `disruptionsAllowed > 0` on an observed generation.
//!
//! Missing numbers count as 0, as the API server reads them.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

use crate::drain::select::{NamespacedName, fmt_key};

/// Whether `selector` matches `labels`. `None` (a null selector) matches
/// nothing; an empty selector matches everything.
pub fn selector_matches(
    selector: Option<&LabelSelector>,
    labels: &BTreeMap<String, String>,
) -> bool {
    let Some(selector) = selector else {
        return false;
    };
    let pairs_hold = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    pairs_hold
        && selector
            .match_expressions
            .iter()
            .flatten()
            .all(|r| requirement_holds(r, labels))
}

fn requirement_holds(req: &LabelSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(&req.key);
    let listed = |v: &String| req.values.iter().flatten().any(|x| x == v);
    match req.operator.as_str() {
        "In" => value.is_some_and(listed),
        "NotIn" => !value.is_some_and(listed),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        _ => false,
    }
}

/// What a PDB means for evicting a pod it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdbVerdict {
    /// At least one disruption is allowed now.
    Allows,
    /// No disruption now; an eviction is retried with backoff.
    Blocking,
    /// No disruption can ever be allowed as configured; reported as an error.
    Misconfigured,
}

impl fmt::Display for PdbVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Allows => "allows",
            Self::Blocking => "blocking",
            Self::Misconfigured => "misconfigured",
        })
    }
}

/// A PDB covering a pod, its verdict and a sentence saying why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdbFinding {
    pub pdb: NamespacedName,
    pub verdict: PdbVerdict,
    /// E.g. `PDB db/pg allows 0 disruptions with 3/3 healthy (misconfigured:
    /// ...)`.
    pub description: String,
}

impl fmt::Display for PdbFinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.description)
    }
}

/// MCM's misconfiguration rule; see the module documentation.
pub fn is_misconfigured(pdb: &PodDisruptionBudget) -> bool {
    let n = Numbers::of(pdb);
    n.observed() && n.expected > 0 && n.healthy >= n.expected && n.allowed == 0 && n.in_flight == 0
}

/// The verdict on one PDB, with its description.
pub fn classify_pdb(pdb: &PodDisruptionBudget) -> PdbFinding {
    let key = (
        pdb.metadata.namespace.clone().unwrap_or_default(),
        pdb.metadata.name.clone().unwrap_or_default(),
    );
    let n = Numbers::of(pdb);
    let plural = if n.allowed == 1 { "" } else { "s" };
    let head = format!(
        "PDB {} allows {} disruption{plural} with {}/{} healthy",
        fmt_key(&key),
        n.allowed,
        n.healthy,
        n.expected
    );
    let (verdict, why) = if !n.observed() {
        (
            PdbVerdict::Blocking,
            Some(format!(
                "blocking: generation {} not yet observed by the disruption controller (observed {}); \
                 the Eviction API refuses evictions until it is",
                n.generation, n.observed_generation
            )),
        )
    } else if is_misconfigured(pdb) {
        (
            PdbVerdict::Misconfigured,
            Some(
                "misconfigured: every expected pod is healthy yet no disruption is allowed, \
                 so no eviction can ever succeed; check minAvailable/maxUnavailable"
                    .to_string(),
            ),
        )
    } else if n.allowed <= 0 {
        let in_flight;
        let why = if n.in_flight > 0 {
            in_flight = format!(
                "blocking: {} disruption{} in flight, not yet counted by the disruption controller",
                n.in_flight,
                if n.in_flight == 1 { "" } else { "s" }
            );
            in_flight.as_str()
        } else if n.expected > 0 {
            "blocking: waits until more covered pods are healthy"
        } else {
            "blocking: no covered pod is counted yet"
        };
        (PdbVerdict::Blocking, Some(why.to_string()))
    } else {
        (PdbVerdict::Allows, None)
    };
    let description = match why {
        Some(why) => format!("{head} ({why})"),
        None => head,
    };
    PdbFinding {
        pdb: key,
        verdict,
        description,
    }
}

/// The PDBs among `pdbs` that cover `pod` (same namespace, matching
/// selector), classified, in (namespace, name) order.
pub fn findings_for(pod: &Pod, pdbs: &[PodDisruptionBudget]) -> Vec<PdbFinding> {
    let empty = BTreeMap::new();
    let labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
    let mut found: Vec<PdbFinding> = pdbs
        .iter()
        .filter(|pdb| pdb.metadata.namespace == pod.metadata.namespace)
        .filter(|pdb| selector_matches(pdb.spec.as_ref().and_then(|s| s.selector.as_ref()), labels))
        .map(classify_pdb)
        .collect();
    found.sort_by(|a, b| a.pdb.cmp(&b.pdb));
    found
}

/// The PodDisruptionBudgets among `pdbs` that cover `pod` (same namespace,
/// matching selector), each as its name and resourceVersion, sorted: what a
/// refused eviction of `pod` waits on. Two readings differ when one of the
/// pod's own budgets changed (its status after a pod of its came or went,
/// its spec), and only then: a budget of another workload, which the
/// disruption controller rewrites as its pods change, does not concern it.
pub fn covering<'a>(
    pod: &Pod,
    pdbs: impl IntoIterator<Item = &'a PodDisruptionBudget>,
) -> Vec<(String, Option<String>)> {
    let empty = BTreeMap::new();
    let labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
    let mut found: Vec<(String, Option<String>)> = pdbs
        .into_iter()
        .filter(|pdb| pdb.metadata.namespace == pod.metadata.namespace)
        .filter(|pdb| selector_matches(pdb.spec.as_ref().and_then(|s| s.selector.as_ref()), labels))
        .map(|pdb| {
            (
                pdb.metadata.name.clone().unwrap_or_default(),
                pdb.metadata.resource_version.clone(),
            )
        })
        .collect();
    found.sort();
    found
}

/// The status numbers of a PDB, missing ones as 0.
struct Numbers {
    generation: i64,
    observed_generation: i64,
    expected: i32,
    healthy: i32,
    allowed: i32,
    /// Pods the Eviction API let go that the disruption controller has not
    /// yet seen deleted (`status.disruptedPods`).
    in_flight: usize,
}

impl Numbers {
    fn of(pdb: &PodDisruptionBudget) -> Self {
        let status = pdb.status.as_ref();
        Self {
            generation: pdb.metadata.generation.unwrap_or(0),
            observed_generation: status.and_then(|s| s.observed_generation).unwrap_or(0),
            expected: status.and_then(|s| s.expected_pods).unwrap_or(0),
            healthy: status.and_then(|s| s.current_healthy).unwrap_or(0),
            allowed: status.and_then(|s| s.disruptions_allowed).unwrap_or(0),
            in_flight: status
                .and_then(|s| s.disrupted_pods.as_ref())
                .map_or(0, BTreeMap::len),
        }
    }

    fn observed(&self) -> bool {
        self.observed_generation >= self.generation
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::fixtures::{PodFixture, expression, match_labels, pdb, pod};

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn exprs(reqs: Vec<LabelSelectorRequirement>) -> LabelSelector {
        LabelSelector {
            match_labels: None,
            match_expressions: Some(reqs),
        }
    }

    #[test]
    fn label_selectors_follow_the_api() {
        let web = labels(&[("app", "web"), ("tier", "front")]);
        let bare = labels(&[]);
        let cases = [
            ("null selector", None, &web, false),
            ("empty selector", Some(LabelSelector::default()), &web, true),
            (
                "empty selector, no labels",
                Some(LabelSelector::default()),
                &bare,
                true,
            ),
            (
                "matchLabels equal",
                Some(match_labels(&[("app", "web")])),
                &web,
                true,
            ),
            (
                "matchLabels all pairs",
                Some(match_labels(&[("app", "web"), ("tier", "front")])),
                &web,
                true,
            ),
            (
                "matchLabels other value",
                Some(match_labels(&[("app", "db")])),
                &web,
                false,
            ),
            (
                "matchLabels missing key",
                Some(match_labels(&[("zone", "a")])),
                &web,
                false,
            ),
            (
                "In listed",
                Some(exprs(vec![expression("app", "In", &["db", "web"])])),
                &web,
                true,
            ),
            (
                "In not listed",
                Some(exprs(vec![expression("app", "In", &["db"])])),
                &web,
                false,
            ),
            (
                "In absent key",
                Some(exprs(vec![expression("zone", "In", &["a"])])),
                &web,
                false,
            ),
            (
                "In no values",
                Some(exprs(vec![expression("app", "In", &[])])),
                &web,
                false,
            ),
            (
                "NotIn listed",
                Some(exprs(vec![expression("app", "NotIn", &["web"])])),
                &web,
                false,
            ),
            (
                "NotIn not listed",
                Some(exprs(vec![expression("app", "NotIn", &["db"])])),
                &web,
                true,
            ),
            (
                "NotIn absent key",
                Some(exprs(vec![expression("zone", "NotIn", &["a"])])),
                &web,
                true,
            ),
            (
                "Exists",
                Some(exprs(vec![expression("tier", "Exists", &[])])),
                &web,
                true,
            ),
            (
                "Exists absent",
                Some(exprs(vec![expression("zone", "Exists", &[])])),
                &web,
                false,
            ),
            (
                "DoesNotExist",
                Some(exprs(vec![expression("zone", "DoesNotExist", &[])])),
                &web,
                true,
            ),
            (
                "DoesNotExist present",
                Some(exprs(vec![expression("app", "DoesNotExist", &[])])),
                &web,
                false,
            ),
            (
                "unknown operator",
                Some(exprs(vec![expression("app", "Gt", &["1"])])),
                &web,
                false,
            ),
            (
                "operators are case-sensitive",
                Some(exprs(vec![expression("app", "in", &["web"])])),
                &web,
                false,
            ),
            (
                "values are exact",
                Some(match_labels(&[("app", "we")])),
                &web,
                false,
            ),
            (
                "all expressions must hold",
                Some(exprs(vec![
                    expression("app", "In", &["web"]),
                    expression("tier", "NotIn", &["front"]),
                ])),
                &web,
                false,
            ),
            (
                "labels and expressions together",
                Some(LabelSelector {
                    match_labels: Some(labels(&[("app", "web")])),
                    match_expressions: Some(vec![expression("zone", "DoesNotExist", &[])]),
                }),
                &web,
                true,
            ),
        ];
        for (what, selector, labels, want) in cases {
            assert_eq!(selector_matches(selector.as_ref(), labels), want, "{what}");
        }
    }

    #[test]
    fn verdicts_and_their_reasons() {
        let sel = Some(LabelSelector::default());
        // (generation, observedGeneration, expectedPods, currentHealthy, disruptionsAllowed)
        let cases = [
            (
                "misconfigured",
                (2, 2, 3, 3, 0),
                PdbVerdict::Misconfigured,
                "PDB db/pg allows 0 disruptions with 3/3 healthy (misconfigured: every expected pod is healthy",
            ),
            (
                "misconfigured, observed a newer generation",
                (2, 3, 3, 4, 0),
                PdbVerdict::Misconfigured,
                "4/3 healthy (misconfigured",
            ),
            (
                "blocking while pods are unhealthy",
                (2, 2, 3, 2, 0),
                PdbVerdict::Blocking,
                "PDB db/pg allows 0 disruptions with 2/3 healthy (blocking: waits until more",
            ),
            (
                "blocking with nothing expected",
                (1, 1, 0, 0, 0),
                PdbVerdict::Blocking,
                "0/0 healthy (blocking: no covered pod is counted yet)",
            ),
            (
                "not yet observed is not misconfigured",
                (3, 2, 3, 3, 0),
                PdbVerdict::Blocking,
                "(blocking: generation 3 not yet observed by the disruption controller (observed 2)",
            ),
            (
                "not yet observed blocks even when it allowed",
                (3, 2, 3, 3, 1),
                PdbVerdict::Blocking,
                "allows 1 disruption with 3/3 healthy (blocking: generation 3 not yet observed",
            ),
            (
                "allows",
                (1, 1, 3, 3, 1),
                PdbVerdict::Allows,
                "PDB db/pg allows 1 disruption with 3/3 healthy",
            ),
            (
                "allows several",
                (1, 1, 5, 5, 2),
                PdbVerdict::Allows,
                "PDB db/pg allows 2 disruptions with 5/5 healthy",
            ),
        ];
        for (what, numbers, verdict, want) in cases {
            let p = pdb("db", "pg", sel.clone(), numbers);
            let got = classify_pdb(&p);
            assert_eq!(got.pdb, ("db".to_string(), "pg".to_string()), "{what}");
            assert_eq!(got.verdict, verdict, "{what}");
            assert_eq!(
                is_misconfigured(&p),
                verdict == PdbVerdict::Misconfigured,
                "{what}"
            );
            assert!(got.description.starts_with("PDB db/pg allows "), "{what}");
            assert!(
                got.description.contains(want),
                "{what}: {:?}",
                got.description
            );
            assert_eq!(got.to_string(), got.description, "{what}");
        }
        let allows = classify_pdb(&pdb("db", "pg", sel, (1, 1, 3, 3, 1)));
        assert_eq!(
            allows.description,
            "PDB db/pg allows 1 disruption with 3/3 healthy"
        );
    }

    #[test]
    fn a_budget_spent_by_evictions_in_flight_waits_and_is_not_misconfigured() {
        // 6/6 healthy, maxUnavailable 2, just after two evictions: the
        // Eviction API lowered disruptionsAllowed and recorded both pods,
        // the disruption controller has not recounted yet.
        let mut p = pdb(
            "demo",
            "web",
            Some(LabelSelector::default()),
            (1, 1, 6, 6, 0),
        );
        let at = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        );
        p.status.as_mut().expect("status").disrupted_pods = Some(
            [("web-1".to_string(), at.clone()), ("web-2".to_string(), at)]
                .into_iter()
                .collect(),
        );
        assert!(!is_misconfigured(&p));
        let got = classify_pdb(&p);
        assert_eq!(got.verdict, PdbVerdict::Blocking);
        assert_eq!(
            got.description,
            "PDB demo/web allows 0 disruptions with 6/6 healthy (blocking: 2 disruptions in flight, \
             not yet counted by the disruption controller)"
        );
        // Once the controller has seen them go (no disruption in flight),
        // the same numbers are a misconfiguration again.
        p.status.as_mut().expect("status").disrupted_pods = Some(BTreeMap::new());
        assert!(is_misconfigured(&p));
    }

    #[test]
    fn a_pdb_without_status_blocks() {
        let mut p = pdb("db", "pg", None, (1, 0, 0, 0, 0));
        p.status = None;
        let got = classify_pdb(&p);
        assert_eq!(got.verdict, PdbVerdict::Blocking);
        assert!(got.description.contains("generation 1 not yet observed"));
        assert!(!is_misconfigured(&p));
    }

    #[test]
    fn findings_cover_matching_pdbs_of_the_namespace() {
        let pdbs = [
            pdb(
                "db",
                "z-all",
                Some(LabelSelector::default()),
                (1, 1, 3, 3, 1),
            ),
            pdb(
                "db",
                "pg",
                Some(match_labels(&[("app", "pg")])),
                (1, 1, 3, 3, 0),
            ),
            pdb(
                "db",
                "redis",
                Some(match_labels(&[("app", "redis")])),
                (1, 1, 3, 3, 0),
            ),
            pdb("db", "nothing", None, (1, 1, 3, 3, 0)),
            pdb(
                "web",
                "everything",
                Some(LabelSelector::default()),
                (1, 1, 3, 3, 0),
            ),
        ];
        let cases = [
            (
                pod("db", "pg-0").labels(&[("app", "pg")]),
                vec!["pg", "z-all"],
            ),
            (pod("db", "other"), vec!["z-all"]),
            (pod("cache", "r-0").labels(&[("app", "redis")]), vec![]),
        ];
        for (pod, want) in cases {
            let got: Vec<String> = findings_for(&pod, &pdbs)
                .into_iter()
                .map(|f| f.pdb.1)
                .collect();
            assert_eq!(got, want, "{:?}", pod.metadata.name);
        }
        let pg = findings_for(&pod("db", "pg-0").labels(&[("app", "pg")]), &pdbs);
        assert_eq!(
            pg.iter().map(|f| f.verdict).collect::<Vec<_>>(),
            vec![PdbVerdict::Misconfigured, PdbVerdict::Allows]
        );
    }
}
