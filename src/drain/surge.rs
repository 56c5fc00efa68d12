//! Surge before evict (pure): whether a pod that a PodDisruptionBudget will
//! not let go can have its replacement made first, and how.
//!
//! A pod whose budget allows no disruption while every pod it expects is
//! healthy (a one-replica Deployment behind `minAvailable: 1`, a
//! Deployment behind `maxUnavailable: 0`) can never be evicted; every drainer waits for its deadline and then bypasses
//! the budget, and the service is down for the pod's grace period and its
//! replacement's start. The Deployment controller can do what a drainer
//! cannot: bring a new pod up before it removes the old one. berth asks it
//! to, the way that changes least:
//!
//! - a **roll** ([`Surge::Roll`]) when every pod of the Deployment runs on
//!   Nodes of Machines being deleted (they all have to move anyway), or when
//!   a HorizontalPodAutoscaler owns its replica count (berth never writes
//!   `spec.replicas` under one): one annotation on its pod template, the
//!   same value for the whole drain, so one new revision, which the
//!   Deployment controller rolls out within its own `maxSurge`. Only a
//!   rolling update that takes nothing down (`maxUnavailable` 0) is rolled:
//!   one that may take pods down would do what the budget forbids;
//! - a **scale-up** ([`Surge::ScaleUp`]) otherwise: `spec.replicas` one
//!   more, the old pod marked as the cheapest to delete, then one less once
//!   the new pod is available, so that its ReplicaSet removes exactly the
//!   old pod. Each write tests the value it replaces, so a restart never
//!   scales twice and a replica count changed by someone else is left as
//!   it is.
//!
//! It cannot for a StatefulSet (a pod keeps its name and its claims), for a
//! pod with a ReadWriteOnce or ReadWriteOncePod claim (unless its volume
//! attaches nowhere) or a node-local volume, for a Deployment whose
//! strategy allows no surge, and for one that opts out
//! ([`SURGE_ANNOTATION`] `"false"`): [`Surge::Impossible`] says why, and the
//! pod is evicted as before.

use std::collections::BTreeSet;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::drain::pdb::{PdbFinding, PdbVerdict};
use crate::drain::rules::RuleTerms;
use crate::drain::volume_kind::VolumeKind;

/// On a Deployment: `"false"` opts it out of surges.
pub const SURGE_ANNOTATION: &str = "berth.dev/surge";
pub use crate::api::SURGED_FOR_ANNOTATION;
/// The ReplicaSet controller removes the pods with the lowest cost first.
pub const DELETION_COST_ANNOTATION: &str = "controller.kubernetes.io/pod-deletion-cost";
/// The lowest cost there is: the old pod goes first on the scale-back.
pub const LOWEST_DELETION_COST: &str = "-2147483648";

/// What a surge of a pod's Deployment would be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Surge {
    /// Its Deployment `deployment` rolled: its template annotated
    /// [`SURGED_FOR_ANNOTATION`] `value`. `under_way`: it is already (by
    /// this drain before a restart, or another drain), nothing to write.
    Roll {
        deployment: String,
        value: String,
        under_way: bool,
        why: &'static str,
    },
    /// Its Deployment `deployment` scaled from `from` to `to` replicas,
    /// then back.
    ScaleUp {
        deployment: String,
        from: i32,
        to: i32,
    },
    /// No surge, and why.
    Impossible { reason: String },
}

impl Surge {
    /// The surge in words, for `berth plan`, `status.drain` and Events.
    pub fn words(&self, ns: &str) -> String {
        match self {
            Self::Roll {
                deployment,
                under_way: true,
                ..
            } => format!(
                "surge: Deployment {ns}/{deployment} is rolling out a new revision; its new pod comes up before this one goes"
            ),
            Self::Roll {
                deployment, why, ..
            } => format!(
                "surge: roll Deployment {ns}/{deployment} (one new revision, within its maxSurge): {why}"
            ),
            Self::ScaleUp {
                deployment,
                from,
                to,
            } => format!(
                "surge: scale Deployment {ns}/{deployment} from {from} to {to} replicas until a new pod is available, then back to {from}, removing this pod"
            ),
            Self::Impossible { reason } => format!("no surge: {reason}"),
        }
    }
}

/// What decides a pod's surge, as its asker knows it.
#[derive(Debug, Clone, Copy)]
pub struct SurgeFacts<'a> {
    /// The pod's controller (`Kind/name`), if it has one.
    pub controller: Option<&'a str>,
    /// Its Deployment, when its controller is a ReplicaSet that one owns.
    pub deployment: Option<&'a Deployment>,
    /// The HorizontalPodAutoscaler that scales the Deployment, if one does.
    pub autoscaler: Option<&'a str>,
    /// The Nodes of the Deployment's pods that are not being deleted (one
    /// entry a pod; `None`: not scheduled yet).
    pub pods_on: &'a [Option<&'a str>],
    /// The Nodes of the Machines being deleted.
    pub draining: &'a BTreeSet<String>,
    /// Why each of the pod's volumes that forbids a second pod does (see
    /// [`forbids`]).
    pub forbidding: &'a [String],
    /// The Machine that drains it, `namespace/name`.
    pub machine: &'a str,
    /// The pod's own [`SURGED_FOR_ANNOTATION`] (from its template).
    pub pod_surged_for: Option<&'a str>,
    /// The terms of the DrainRule that picks the pod (its `surge`), under
    /// the Deployment's own [`SURGE_ANNOTATION`].
    pub rule_terms: Option<&'a RuleTerms>,
}

/// Whether a pod's PodDisruptionBudgets will not let it go however long
/// the drain waits: one of them lets no disruption go while every pod it
/// expects is healthy (see [`PdbVerdict::Misconfigured`]: a singleton
/// behind `minAvailable: 1`, any Deployment behind `maxUnavailable: 0`).
/// Then a surge is asked for before the first eviction. A budget that
/// blocks only for now (a disruption in flight, a pod not healthy yet) is
/// waited for as before, and a surge is asked for once the drain counts
/// the pod stuck (see `maxEvictRetries`).
pub fn needed(findings: &[PdbFinding]) -> bool {
    findings
        .iter()
        .any(|f| f.verdict == PdbVerdict::Misconfigured)
}

/// Why a volume of kind `kind` whose claim `claim` has `modes` forbids a
/// second pod beside the one it is used by: a ReadWriteOncePod claim
/// always, a ReadWriteOnce one unless the volume attaches nowhere (the
/// access mode is enforced by the attach), a node-local volume always (its
/// data stays on its Node). `None`: a second pod can use it.
pub fn forbids(kind: VolumeKind, modes: &[String], claim: &str) -> Option<String> {
    let has = |m: &str| modes.iter().any(|x| x == m);
    if has("ReadWriteOncePod") {
        return Some(format!("claim {claim} is ReadWriteOncePod"));
    }
    match kind {
        VolumeKind::NodeLocal => Some(format!("claim {claim}'s volume is node-local")),
        VolumeKind::Attachable if has("ReadWriteOnce") => Some(format!(
            "claim {claim} is ReadWriteOnce and its volume attaches to one Node at a time"
        )),
        _ => None,
    }
}

/// Why each volume of planned pod `p` that forbids a second pod does (see
/// [`forbids`]), its claims' access modes read by `modes_of` (namespace,
/// name).
pub fn forbidding(
    p: &crate::drain::plan::PlannedPod,
    modes_of: impl Fn(&str, &str) -> Vec<String>,
) -> Vec<String> {
    p.volumes
        .iter()
        .filter_map(|v| {
            let (ns, name) = &v.volume.claim;
            forbids(v.kind, &modes_of(ns, name), name)
        })
        .collect()
}

/// What a surge of the pod `facts` describe would be (see the module).
pub fn decide(facts: &SurgeFacts<'_>) -> Surge {
    let impossible = |reason: String| Surge::Impossible { reason };
    let Some(d) = facts.deployment else {
        return impossible(match facts.controller.and_then(|c| c.split_once('/')) {
            Some(("StatefulSet", name)) => format!(
                "StatefulSet {name} keeps each pod's name and claims, so a second pod cannot run beside this one"
            ),
            Some(("ReplicaSet", name)) => format!("ReplicaSet {name} belongs to no Deployment"),
            Some((kind, name)) => format!("its controller {kind} {name} is not a Deployment"),
            None => "it has no controller to make a second pod".to_string(),
        });
    };
    let name = d.metadata.name.clone().unwrap_or_default();
    let own = d
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SURGE_ANNOTATION));
    let ruled = facts
        .rule_terms
        .and_then(|t| Some((t.rule.as_str(), t.annotations.get(SURGE_ANNOTATION)?)));
    let off = |v: &str| v.trim().eq_ignore_ascii_case("false");
    match (own, ruled) {
        (Some(v), _) if off(v) => {
            return impossible(format!(
                "Deployment {name} opts out ({SURGE_ANNOTATION}: \"false\")"
            ));
        }
        (None, Some((rule, v))) if off(v) => {
            return impossible(format!(
                "DrainRule {rule} turns surges off for it (moves.surge: false)"
            ));
        }
        _ => {}
    }
    if !facts.forbidding.is_empty() {
        return impossible(facts.forbidding.join("; "));
    }
    let replicas = d.spec.replicas.unwrap_or(1);
    if replicas < 1 {
        return impossible(format!("Deployment {name} is scaled to zero"));
    }
    let Some((surge, unavailable)) = rolling(d, replicas) else {
        return impossible(format!(
            "Deployment {name}'s strategy is Recreate: it never runs a new pod beside an old one"
        ));
    };
    if surge < 1 {
        return impossible(format!(
            "Deployment {name}'s rolling update allows no surge (maxSurge resolves to 0)"
        ));
    }
    let template = d
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.as_ref())
        .and_then(|a| a.get(SURGED_FOR_ANNOTATION));
    // A roll of berth's under way: the template says another revision than
    // the pod's, or this drain wrote it before a restart.
    if let Some(v) = template
        && facts.pod_surged_for != Some(v.as_str())
    {
        return Surge::Roll {
            deployment: name,
            value: v.clone(),
            under_way: true,
            why: "a roll is under way",
        };
    }
    let all_draining = facts
        .pods_on
        .iter()
        .all(|n| n.is_some_and(|n| facts.draining.contains(n)));
    if facts.autoscaler.is_none() && !all_draining {
        return Surge::ScaleUp {
            deployment: name,
            from: replicas,
            to: replicas.saturating_add(1),
        };
    }
    if unavailable > 0 {
        return match facts.autoscaler {
            Some(hpa) => impossible(format!(
                "HorizontalPodAutoscaler {hpa} owns Deployment {name}'s replicas, and its rolling update may take {unavailable} pod(s) down at once (maxUnavailable)"
            )),
            // Every pod moves anyway: one more each, then back.
            None => Surge::ScaleUp {
                deployment: name,
                from: replicas,
                to: replicas.saturating_add(1),
            },
        };
    }
    Surge::Roll {
        deployment: name,
        value: facts.machine.to_string(),
        under_way: false,
        why: if facts.autoscaler.is_some() {
            "a HorizontalPodAutoscaler owns its replicas"
        } else {
            "every pod of it runs on Machines being deleted"
        },
    }
}

/// A Deployment's rolling update as its controller resolves it for
/// `replicas`: how many pods above and below `replicas` it may run (a
/// percentage of `maxSurge` rounds up, of `maxUnavailable` down; both
/// default to 25%; both 0 makes `maxUnavailable` 1). `None`: `Recreate`.
pub fn rolling(d: &Deployment, replicas: i32) -> Option<(i32, i32)> {
    let strategy = d.spec.strategy.as_ref();
    if strategy.and_then(|s| s.type_.as_deref()) == Some("Recreate") {
        return None;
    }
    let ru = strategy.and_then(|s| s.rolling_update.as_ref());
    let quarter = IntOrString::String("25%".into());
    let surge = resolve(
        ru.and_then(|r| r.max_surge.as_ref()).unwrap_or(&quarter),
        replicas,
        true,
    );
    let unavailable = resolve(
        ru.and_then(|r| r.max_unavailable.as_ref())
            .unwrap_or(&quarter),
        replicas,
        false,
    );
    if surge == 0 && unavailable == 0 {
        return Some((0, 1));
    }
    Some((surge, unavailable))
}

/// An `IntOrString` of a rolling update for `replicas`: a percentage
/// rounded `up` or down; an invalid one counts as 0.
fn resolve(v: &IntOrString, replicas: i32, up: bool) -> i32 {
    match v {
        IntOrString::Int(n) => (*n).max(0),
        IntOrString::String(s) => {
            let Some(p) = s
                .trim()
                .strip_suffix('%')
                .and_then(|p| p.parse::<i64>().ok())
            else {
                return 0;
            };
            let scaled = i64::from(replicas.max(0)) * p.max(0);
            let n = if up {
                (scaled + 99) / 100
            } else {
                scaled / 100
            };
            i32::try_from(n).unwrap_or(i32::MAX)
        }
    }
}

/// The JSON patch that sets a Deployment's `spec.replicas` from `from` to
/// `to`, refused by the API server (422) when it is not `from` any more.
pub fn replicas_patch(from: i32, to: i32) -> serde_json::Value {
    serde_json::json!([
        {"op": "test", "path": "/spec/replicas", "value": from},
        {"op": "replace", "path": "/spec/replicas", "value": to},
    ])
}

/// The merge patch that rolls a Deployment for the drain of `machine`.
pub fn roll_patch(machine: &str) -> serde_json::Value {
    serde_json::json!({"spec": {"template": {"metadata": {"annotations": {
        SURGED_FOR_ANNOTATION: machine
    }}}}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deployment(replicas: i32, strategy: serde_json::Value) -> Deployment {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": "web"}},
                "strategy": strategy,
                "template": {"metadata": {"labels": {"app": "web"}}},
            }
        }))
        .expect("a Deployment")
    }

    fn facts<'a>(
        d: Option<&'a Deployment>,
        pods_on: &'a [Option<&'a str>],
        draining: &'a BTreeSet<String>,
    ) -> SurgeFacts<'a> {
        SurgeFacts {
            controller: Some("ReplicaSet/web-5d8"),
            deployment: d,
            autoscaler: None,
            pods_on,
            draining,
            forbidding: &[],
            machine: "pool/m-a",
            pod_surged_for: None,
            rule_terms: None,
        }
    }

    fn draining() -> BTreeSet<String> {
        BTreeSet::from(["node-a".to_string()])
    }

    #[test]
    fn a_singleton_whose_every_pod_drains_is_rolled_once() {
        let d = deployment(1, serde_json::json!({}));
        let draining = draining();
        let on = [Some("node-a")];
        let s = decide(&facts(Some(&d), &on, &draining));
        assert_eq!(
            s,
            Surge::Roll {
                deployment: "web".into(),
                value: "pool/m-a".into(),
                under_way: false,
                why: "every pod of it runs on Machines being deleted",
            }
        );
        // Rolled: the template says this Machine, the old pod does not.
        let mut rolled = d.clone();
        rolled
            .spec
            .template
            .metadata
            .get_or_insert_default()
            .annotations =
            Some([(SURGED_FOR_ANNOTATION.to_string(), "pool/m-a".to_string())].into());
        assert!(matches!(
            decide(&facts(Some(&rolled), &on, &draining)),
            Surge::Roll {
                under_way: true,
                ..
            }
        ));
        // A pod of the new revision is not waited on as an old one: a
        // later drain rolls it again.
        let mut f = facts(Some(&rolled), &on, &draining);
        f.pod_surged_for = Some("pool/m-a");
        f.machine = "pool/m-b";
        assert!(matches!(
            decide(&f),
            Surge::Roll {
                under_way: false,
                ..
            }
        ));
    }

    #[test]
    fn a_deployment_with_pods_elsewhere_is_scaled_up_by_one() {
        let d = deployment(
            10,
            serde_json::json!({"rollingUpdate": {"maxUnavailable": 0}}),
        );
        let draining = draining();
        let mut on = vec![Some("node-a")];
        on.extend(std::iter::repeat_n(Some("node-b"), 9));
        assert_eq!(
            decide(&facts(Some(&d), &on, &draining)),
            Surge::ScaleUp {
                deployment: "web".into(),
                from: 10,
                to: 11
            }
        );
    }

    #[test]
    fn an_autoscaled_deployment_is_rolled_never_scaled() {
        let d = deployment(
            4,
            serde_json::json!({"rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}),
        );
        let draining = draining();
        let on = [Some("node-a"), Some("node-b")];
        let mut f = facts(Some(&d), &on, &draining);
        f.autoscaler = Some("web");
        assert!(matches!(
            decide(&f),
            Surge::Roll {
                under_way: false,
                ..
            }
        ));
        // One whose roll may take pods down is not rolled.
        let d = deployment(4, serde_json::json!({}));
        let mut f = facts(Some(&d), &on, &draining);
        f.autoscaler = Some("web");
        let Surge::Impossible { reason } = decide(&f) else {
            panic!("rolled an autoscaled Deployment that may take a pod down")
        };
        assert!(reason.contains("HorizontalPodAutoscaler web"), "{reason}");
    }

    #[test]
    fn what_cannot_surge_says_why() {
        let draining = draining();
        let on = [Some("node-a")];
        let why = |f: SurgeFacts<'_>| match decide(&f) {
            Surge::Impossible { reason } => reason,
            other => panic!("surged: {other:?}"),
        };
        let mut f = facts(None, &on, &draining);
        f.controller = Some("StatefulSet/db");
        assert!(why(f).contains("StatefulSet db"));
        f.controller = None;
        assert!(why(f).contains("no controller"));
        let d = deployment(1, serde_json::json!({"type": "Recreate"}));
        assert!(why(facts(Some(&d), &on, &draining)).contains("Recreate"));
        let d = deployment(
            2,
            serde_json::json!({"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}),
        );
        assert!(why(facts(Some(&d), &on, &draining)).contains("no surge"));
        let mut d = deployment(1, serde_json::json!({}));
        d.metadata.annotations = Some([(SURGE_ANNOTATION.into(), "false".into())].into());
        assert!(why(facts(Some(&d), &on, &draining)).contains("opts out"));
        // A DrainRule turns it off, unless the Deployment says otherwise.
        let terms = RuleTerms {
            rule: "no-surge".into(),
            annotations: [(SURGE_ANNOTATION.to_string(), "false".to_string())].into(),
        };
        let plain = deployment(1, serde_json::json!({}));
        let mut f = facts(Some(&plain), &on, &draining);
        f.rule_terms = Some(&terms);
        assert!(why(f).contains("DrainRule no-surge"));
        let mut own = deployment(1, serde_json::json!({}));
        own.metadata.annotations = Some([(SURGE_ANNOTATION.into(), "true".into())].into());
        let mut f = facts(Some(&own), &on, &draining);
        f.rule_terms = Some(&terms);
        assert!(matches!(decide(&f), Surge::Roll { .. }));
        let d = deployment(1, serde_json::json!({}));
        let forbidding = [
            forbids(VolumeKind::Attachable, &["ReadWriteOnce".into()], "data")
                .expect("RWO forbids"),
        ];
        let mut f = facts(Some(&d), &on, &draining);
        f.forbidding = &forbidding;
        assert!(why(f).contains("ReadWriteOnce"));
    }

    #[test]
    fn only_volumes_a_second_pod_cannot_use_forbid_it() {
        let rwo = ["ReadWriteOnce".to_string()];
        let rwx = ["ReadWriteMany".to_string()];
        let rwop = ["ReadWriteOncePod".to_string()];
        assert!(forbids(VolumeKind::Attachable, &rwo, "c").is_some());
        assert!(forbids(VolumeKind::AttachFree, &rwo, "c").is_none());
        assert!(forbids(VolumeKind::Attachable, &rwx, "c").is_none());
        assert!(forbids(VolumeKind::AttachFree, &rwop, "c").is_some());
        assert!(forbids(VolumeKind::NodeLocal, &rwx, "c").is_some());
    }

    #[test]
    fn a_rolling_update_resolves_as_its_controller_does() {
        let d = deployment(1, serde_json::json!({}));
        assert_eq!(rolling(&d, 1), Some((1, 0)), "25% of 1: surge up, down");
        assert_eq!(rolling(&d, 10), Some((3, 2)));
        let d = deployment(
            3,
            serde_json::json!({"rollingUpdate": {"maxSurge": "0%", "maxUnavailable": "0%"}}),
        );
        assert_eq!(rolling(&d, 3), Some((0, 1)));
        let d = deployment(3, serde_json::json!({"type": "Recreate"}));
        assert_eq!(rolling(&d, 3), None);
    }

    #[test]
    fn a_pdb_that_allows_nothing_asks_for_a_surge() {
        use crate::drain::fixtures::{match_labels, pdb, pod};
        use crate::drain::pdb::findings_for;
        let selector = || Some(match_labels(&[("app", "web")]));
        let allows = pdb("shop", "ok", selector(), (1, 1, 2, 2, 1));
        let blocks = pdb("shop", "no", selector(), (1, 1, 1, 1, 0));
        let waits = pdb("shop", "later", selector(), (1, 1, 2, 1, 0));
        let mut p = pod("shop", "web-1");
        p.metadata.labels = Some([("app".to_string(), "web".to_string())].into());
        assert!(!needed(&findings_for(&p, &[allows])));
        assert!(needed(&findings_for(&p, &[blocks])));
        // A budget short of a healthy pod lets one go once it is back.
        assert!(!needed(&findings_for(&p, &[waits])));
    }

    #[test]
    fn every_write_tests_what_it_replaces() {
        assert_eq!(
            replicas_patch(10, 11),
            serde_json::json!([
                {"op": "test", "path": "/spec/replicas", "value": 10},
                {"op": "replace", "path": "/spec/replicas", "value": 11},
            ])
        );
        assert_eq!(
            roll_patch("pool/m-a")["spec"]["template"]["metadata"]["annotations"]
                [SURGED_FOR_ANNOTATION],
            "pool/m-a"
        );
    }
}
