//! A pod turned into its ask of the ledger, one way for every asker: the
//! drain engine, a forced deletion and `berth plan`. [`pod_ask`] reads the
//! pod's workload (its move group, if its object names one), its budget,
//! what its workload says of its moves, the object its permit is owned by
//! and the annotations berth cannot read, from any source of
//! [`WorkloadFacts`]; each caller adds only its own: the engine its Events
//! and its permits' expiry from its deadline, a forced deletion its
//! Warnings, `berth plan` its verdicts.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use super::workload::{workload_of, workload_owner};
use super::{
    Ask, Asker, BadAnnotation, Budget, MOVE_GROUP_KIND, Workload, WorkloadFacts, WorkloadTerms,
    budget_of, grouped, ready_since,
};
use crate::drain::plan::{DrainPlan, PlannedPod};
use crate::drain::rules::RuleTerms;
use crate::drain::select::{NamespacedName, pod_key};
use crate::drain::volume_kind::VolumeKind;

/// A pod whose move is asked for, as its asker knows it.
#[derive(Debug, Clone)]
pub struct PodToMove<'a> {
    /// Its namespace and name.
    pub key: NamespacedName,
    pub uid: Option<String>,
    /// `spec.priority`, 0 when unset.
    pub priority: i32,
    /// The pod as it is now; `None` once it is gone (a drain's pod that
    /// left since it was planned).
    pub pod: Option<&'a Pod>,
    /// Its controller as planned (`Kind/name`): its workload once it is
    /// gone.
    pub controller: Option<String>,
    /// Once it is gone, a pod that uses one of its claims now: its pod
    /// template's annotations speak for the budget.
    pub replacement: Option<&'a Pod>,
    /// It has volumes that move (see [`Permit::volumes`](super::Permit::volumes)).
    pub volumes: bool,
    /// Its attachable PVs (see [`Permit::attach`](super::Permit::attach)).
    pub attach: Vec<String>,
    /// Its move is a surge (see [`crate::drain::surge`]): it counts as a
    /// move of its workload even when nothing bounds them, one at a time
    /// then.
    pub surge: bool,
    /// The terms of the DrainRule that picks it, under its own annotations.
    pub rule_terms: Option<RuleTerms>,
}

impl<'a> PodToMove<'a> {
    /// Planned pod `p`, and the pod as it is now (`None`: gone): its
    /// volumes are the plan's, its attachable PVs those of kind
    /// attachable in the plan.
    pub fn planned(p: &PlannedPod, pod: Option<&'a Pod>) -> Self {
        Self {
            key: p.pod.clone(),
            uid: p.uid.clone(),
            priority: p.priority,
            pod,
            controller: p.controller.clone(),
            replacement: None,
            volumes: !p.volumes.is_empty(),
            attach: p
                .volumes
                .iter()
                .filter(|v| v.kind == VolumeKind::Attachable)
                .map(|v| v.volume.pv.clone())
                .collect(),
            surge: false,
            rule_terms: p.rule_terms.clone(),
        }
    }

    /// Its move is a surge (see [`PodToMove::surge`]).
    pub fn surging(self) -> Self {
        Self {
            surge: true,
            ..self
        }
    }

    /// Once the pod is gone, `replacement` speaks for its pod template
    /// (see [`PodToMove::replacement`]).
    pub fn replaced_by(self, replacement: Option<&'a Pod>) -> Self {
        Self {
            replacement,
            ..self
        }
    }

    /// `pod` as it is, not planned (a forced deletion's): its volumes are
    /// its claims (those it names and its generic ephemeral volumes',
    /// `<pod>-<volume>`), its attachable PVs those of its claims attached
    /// now (see [`WorkloadFacts::attached`]).
    pub fn live(pod: &'a Pod, facts: &(impl WorkloadFacts + ?Sized)) -> Self {
        let key = pod_key(pod);
        let claims: Vec<String> = pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|v| {
                let ephemeral = v
                    .ephemeral
                    .as_ref()
                    .map(|_| format!("{}-{}", key.1, v.name));
                v.persistent_volume_claim
                    .as_ref()
                    .map(|c| c.claim_name.clone())
                    .or(ephemeral)
            })
            .collect();
        Self {
            uid: pod.metadata.uid.clone(),
            priority: pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
            pod: Some(pod),
            controller: crate::drain::plan::controller_of(pod),
            replacement: None,
            volumes: !claims.is_empty(),
            attach: facts.attached(&key.0, &claims),
            surge: false,
            rule_terms: None,
            key,
        }
    }
}

impl From<&PlannedPod> for PodToMove<'_> {
    fn from(p: &PlannedPod) -> Self {
        Self::planned(p, None)
    }
}

/// What the ledger makes of a pod to move: see [`pod_ask`].
#[derive(Debug, Clone, PartialEq)]
pub struct PodAsk {
    /// Its workload: its move group, if its workload object names one.
    pub workload: Workload,
    /// Its workload's budget: the default for a pod with or without
    /// volumes, over what its workload object's annotations, else its pod
    /// template's, ask.
    pub budget: Budget,
    /// What its workload says of its moves (a move group's: every
    /// member's replicas); with an ask, its replicas down counted (see
    /// [`WorkloadFacts::counted`]).
    pub terms: WorkloadTerms,
    /// What berth cannot read of its annotations (the default holds), for
    /// its asker to say.
    pub bad: Vec<BadAnnotation>,
    /// Its ask; `None` when the ledger does not count its move: it has no
    /// volumes that move and its workload bounds none of its moves
    /// (PodDisruptionBudgets alone govern).
    pub ask: Option<Ask>,
    /// What its `MovePermit` is owned by: its workload object, from the
    /// pod's owner references; `None` for a move group, a pod without a
    /// controller, a pod gone, or without an ask.
    pub owner: Option<OwnerReference>,
}

/// `pod`'s ask of the ledger for `drain`, read from `facts`: its workload
/// (a ReplicaSet's Deployment, or the planned controller of a pod that is
/// gone, or the pod itself) grouped into the move group its object names,
/// its budget (see [`budget_of`]: its workload object's annotations, else
/// its pod template's, or its replacement's once it is gone), its terms
/// counted (see [`WorkloadFacts::counted`]), the owner of its permit, and
/// the annotations berth cannot read. A pod that is not Ready asks with
/// none of its workload's other replicas down held against it (see
/// [`Ask::unavailable`]).
pub fn pod_ask(facts: &(impl WorkloadFacts + ?Sized), pod: PodToMove<'_>, drain: &Asker) -> PodAsk {
    let ns = pod.key.0.clone();
    let owners = |rs: &str| facts.replica_set_owners(&ns, rs);
    let workload = match pod.pod {
        Some(p) => workload_of(p, owners),
        None => match pod.controller.as_deref().and_then(|c| c.split_once('/')) {
            Some((kind, name)) => Workload::new(kind, &ns, name),
            None => Workload::new("Pod", &ns, &pod.key.1),
        },
    };
    let template = pod
        .pod
        .or(pod.replacement)
        .and_then(|p| p.metadata.annotations.as_ref());
    // A DrainRule's terms, under the pod template's own annotations.
    let ruled;
    let template = match &pod.rule_terms {
        Some(t) => {
            let mut merged = t.annotations.clone();
            merged.extend(
                template
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.clone())),
            );
            ruled = merged;
            Some(&ruled)
        }
        None => template,
    };
    let terms = facts.terms(&workload);
    let (mut budget, mut bad) = budget_of(template, &terms, pod.volumes);
    if pod.surge {
        budget.max_moving = budget.max_moving.or(Some(1));
    }
    // One application over several controllers: their move group.
    let (workload, terms, odd) = grouped(workload, terms, |group| facts.group_members(&ns, group));
    bad.extend(odd);
    if budget.max_moving.is_none() && !pod.volumes {
        return PodAsk {
            workload,
            budget,
            terms,
            bad,
            ask: None,
            owner: None,
        };
    }
    let terms = facts.counted(&workload, terms);
    // A group has no one object to be owned by.
    let owner = (workload.kind != MOVE_GROUP_KIND)
        .then(|| pod.pod.and_then(|p| workload_owner(p, owners)))
        .flatten();
    // A Ready pod on a Node that went down is down itself: moving it takes
    // nothing more down, and it is not held back by the others that are.
    let ready = pod
        .pod
        .is_some_and(|p| ready_since(p).is_some() && facts.on_serving_node(p));
    let ask = Ask::new(workload.clone(), &terms, pod, ready, drain);
    PodAsk {
        workload,
        budget,
        terms,
        bad,
        ask: Some(ask),
        owner,
    }
}

/// Planned pod `p`'s ask of the ledger for `drain`, read from `facts`:
/// [`pod_ask`] of `p` as it is now (`pod`; `None`: gone, and then
/// `replacement`, a pod that uses one of its claims now, speaks for its
/// pod template). The engine's drains and `berth plan` ask through it
/// alike.
pub fn planned_ask(
    facts: &(impl WorkloadFacts + ?Sized),
    p: &PlannedPod,
    pod: Option<&Pod>,
    replacement: Option<&Pod>,
    drain: &Asker,
) -> PodAsk {
    pod_ask(
        facts,
        PodToMove::planned(p, pod).replaced_by(replacement),
        drain,
    )
}

/// The volume moves a drain of `plan` has left before its first eviction:
/// one a stateful pod (see [`Asker::moves_left`]).
pub fn moves_in(plan: &DrainPlan) -> u32 {
    u32::try_from(plan.stateful.len()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::drain::fixtures::{PodFixture, planned, pod};
    use crate::drain::ledger::tests::t;
    use crate::drain::ledger::{
        Availability, MAX_MOVING_ANNOTATION, MIN_HEALTHY_ANNOTATION, MOVE_GROUP_ANNOTATION,
    };
    use crate::drain::plan::PlannedVolume;
    use crate::drain::volume::VolumeRef;

    /// What a test knows of the workloads: by kind and name.
    #[derive(Default)]
    struct Known {
        rs_owners: BTreeMap<String, Vec<OwnerReference>>,
        terms: BTreeMap<Workload, WorkloadTerms>,
        groups: BTreeMap<String, Vec<WorkloadTerms>>,
        attached: Vec<String>,
        /// Replicas down counted from the pods, which `counted` says.
        counted: Option<u32>,
    }

    impl WorkloadFacts for Known {
        fn replica_set_owners(&self, _: &str, name: &str) -> Option<Vec<OwnerReference>> {
            self.rs_owners.get(name).cloned()
        }
        fn terms(&self, w: &Workload) -> WorkloadTerms {
            self.terms.get(w).cloned().unwrap_or_default()
        }
        fn group_members(&self, _: &str, group: &str) -> Vec<WorkloadTerms> {
            self.groups.get(group).cloned().unwrap_or_default()
        }
        fn counted(&self, _: &Workload, mut terms: WorkloadTerms) -> WorkloadTerms {
            if let (Some(a), Some(n)) = (terms.availability.as_mut(), self.counted) {
                a.unavailable = n;
            }
            terms
        }
        fn attached(&self, _: &str, claims: &[String]) -> Vec<String> {
            if claims.is_empty() {
                Vec::new()
            } else {
                self.attached.clone()
            }
        }
    }

    fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn drain() -> Asker {
        Asker {
            machine: "ns/a".into(),
            requested: t(0),
            past_deadline: false,
            moves_left: 1,
        }
    }

    fn owner(kind: &str, name: &str) -> OwnerReference {
        OwnerReference {
            api_version: "apps/v1".into(),
            kind: kind.into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            controller: Some(true),
            block_owner_deletion: None,
        }
    }

    fn ready(mut p: Pod) -> Pod {
        p.status = Some(
            serde_json::from_value(serde_json::json!({
                "conditions": [{"type": "Ready", "status": "True",
                    "lastTransitionTime": "2023-11-14T22:13:20Z"}]
            }))
            .expect("status"),
        );
        p
    }

    /// The attachable volume of claim `claim` on PV `pv`.
    fn attachable(pv: &str, claim: &str) -> PlannedVolume {
        PlannedVolume {
            volume: VolumeRef {
                pv: pv.into(),
                claim: ("ns".into(), claim.into()),
                unique_name: None,
                ephemeral: false,
            },
            kind: VolumeKind::Attachable,
            kind_why: String::new(),
            attached_to: Vec::new(),
            wait: crate::drain::plan::VolumeWait::Detach {
                gone_first: Vec::new(),
                reattach: true,
            },
        }
    }

    #[test]
    fn a_pod_of_a_deployment_is_asked_for_through_its_replica_set() {
        let web = pod("ns", "web-1").owned_by("ReplicaSet", "web-5d8f", true);
        let facts = Known {
            rs_owners: BTreeMap::from([("web-5d8f".into(), vec![owner("Deployment", "web")])]),
            terms: BTreeMap::from([(
                Workload::new("Deployment", "ns", "web"),
                WorkloadTerms {
                    annotations: annotations(&[(MAX_MOVING_ANNOTATION, "2")]),
                    ..WorkloadTerms::default()
                },
            )]),
            ..Known::default()
        };
        let p = planned(5, "ns", "web-1");
        let asked = pod_ask(&facts, PodToMove::planned(&p, Some(&web)), &drain());
        assert_eq!(asked.workload, Workload::new("Deployment", "ns", "web"));
        assert_eq!(asked.budget.max_moving, Some(2), "its object's annotation");
        assert_eq!(asked.owner, Some(owner("Deployment", "web")));
        let ask = asked.ask.expect("a bounded workload asks");
        assert_eq!(
            (
                ask.pod.as_str(),
                ask.uid.as_str(),
                ask.priority,
                ask.volumes
            ),
            ("ns/web-1", "ns/web-1", 5, false),
            "a planned pod's UID, or its key"
        );
        assert!(asked.bad.is_empty());
    }

    #[test]
    fn a_drain_rules_terms_lie_under_the_pods_and_its_workloads_own() {
        use crate::drain::ledger::{HEALTHY_DEADLINE_ANNOTATION, MIN_HEALTHY_ANNOTATION};
        let mut web = pod("ns", "web-1").owned_by("ReplicaSet", "web-5d8f", true);
        web.metadata.annotations = Some(annotations(&[(MIN_HEALTHY_ANNOTATION, "5s")]));
        let facts = Known {
            rs_owners: BTreeMap::from([("web-5d8f".into(), vec![owner("Deployment", "web")])]),
            terms: BTreeMap::from([(
                Workload::new("Deployment", "ns", "web"),
                WorkloadTerms {
                    annotations: annotations(&[(HEALTHY_DEADLINE_ANNOTATION, "1m")]),
                    ..WorkloadTerms::default()
                },
            )]),
            ..Known::default()
        };
        let p = PlannedPod {
            rule_terms: Some(RuleTerms {
                rule: "platform".into(),
                annotations: annotations(&[
                    (MAX_MOVING_ANNOTATION, "2"),
                    (MIN_HEALTHY_ANNOTATION, "30s"),
                    (HEALTHY_DEADLINE_ANNOTATION, "10m"),
                ]),
            }),
            ..planned(0, "ns", "web-1")
        };
        let asked = pod_ask(&facts, PodToMove::planned(&p, Some(&web)), &drain());
        assert_eq!(
            asked.budget.max_moving,
            Some(2),
            "the rule's, none else says"
        );
        assert_eq!(
            asked.budget.min_healthy,
            std::time::Duration::from_secs(5),
            "the pod's own wins"
        );
        assert_eq!(
            asked.budget.healthy_deadline,
            Some(std::time::Duration::from_secs(60)),
            "the workload's own wins"
        );
        assert!(asked.ask.is_some(), "the rule bounds its moves");
        // A surge counts as a move even where nothing bounds them.
        let plain = planned(0, "ns", "web-1");
        let surged = pod_ask(
            &facts,
            PodToMove::planned(&plain, Some(&web)).surging(),
            &drain(),
        );
        assert_eq!(surged.budget.max_moving, Some(1));
        assert!(surged.ask.is_some());
    }

    #[test]
    fn a_stateful_set_pod_with_a_claim_asks_with_its_attachable_volume() {
        let sts = Workload::new("StatefulSet", "ns", "db");
        let db =
            ready(pod("ns", "db-0").owned_by("StatefulSet", "db", true)).claim("data", "data-db-0");
        let facts = Known {
            terms: BTreeMap::from([(
                sts.clone(),
                WorkloadTerms {
                    availability: Some(Availability {
                        replicas: 3,
                        unavailable: 0,
                    }),
                    ..WorkloadTerms::default()
                },
            )]),
            attached: vec!["pv-now".into()],
            counted: Some(1),
            ..Known::default()
        };
        let p = PlannedPod {
            uid: Some("uid-db-0".into()),
            volumes: vec![attachable("pv-db-0", "data-db-0")],
            ..planned(0, "ns", "db-0")
        };
        let asked = pod_ask(&facts, PodToMove::planned(&p, Some(&db)), &drain());
        assert_eq!(asked.workload, sts);
        assert_eq!(asked.budget, Budget::default_for(true), "one at a time");
        assert_eq!(asked.owner, Some(owner("StatefulSet", "db")));
        let ask = asked.ask.expect("its volumes move");
        assert!(ask.volumes);
        assert_eq!(ask.attach, ["pv-db-0"], "the plan's attachable volume");
        assert_eq!(ask.unavailable, 1, "counted from the pods, and it is Ready");
        assert_eq!(asked.terms.availability.map(|a| a.unavailable), Some(1));
        // The same pod as it is (a forced deletion): its claims, and their
        // PVs attached now.
        let live = pod_ask(&facts, PodToMove::live(&db, &facts), &drain());
        let ask = live.ask.expect("its claims move");
        assert_eq!((ask.uid.as_str(), ask.volumes), ("uid-db-0", true));
        assert_eq!(ask.attach, ["pv-now"]);
        // Once gone: its planned controller, and its replacement's template.
        let next = pod("ns", "db-0")
            .uid("uid-db-0-new")
            .owned_by("StatefulSet", "db", true);
        let mut next = next;
        next.metadata.annotations = Some(annotations(&[(MAX_MOVING_ANNOTATION, "3")]));
        let gone = PlannedPod {
            controller: Some("StatefulSet/db".into()),
            ..p.clone()
        };
        let asked = pod_ask(
            &facts,
            PodToMove::planned(&gone, None).replaced_by(Some(&next)),
            &drain(),
        );
        assert_eq!(
            planned_ask(&facts, &gone, None, Some(&next), &drain()),
            asked,
            "the engine's and berth plan's way to the same ask"
        );
        assert_eq!(asked.workload, sts);
        assert_eq!(
            asked.budget.max_moving,
            Some(3),
            "its replacement's template"
        );
        assert_eq!(asked.owner, None, "no pod to read its owner from");
        let ask = asked.ask.expect("asks");
        assert_eq!(ask.unavailable, 0, "a pod gone is not Ready");
    }

    #[test]
    fn a_grouped_workload_asks_for_its_group() {
        let es = pod("search", "es-a-0").owned_by("StatefulSet", "es-a", true);
        let member = |unavailable| WorkloadTerms {
            annotations: annotations(&[(MOVE_GROUP_ANNOTATION, "es")]),
            availability: Some(Availability {
                replicas: 3,
                unavailable,
            }),
            ..WorkloadTerms::default()
        };
        let facts = Known {
            terms: BTreeMap::from([(Workload::new("StatefulSet", "search", "es-a"), member(0))]),
            groups: BTreeMap::from([("es".into(), vec![member(0), member(1)])]),
            ..Known::default()
        };
        let p = PlannedPod {
            volumes: vec![attachable("pv-es-a-0", "data-es-a-0")],
            ..planned(0, "search", "es-a-0")
        };
        let asked = pod_ask(&facts, PodToMove::planned(&p, Some(&es)), &drain());
        let group = Workload::new(MOVE_GROUP_KIND, "search", "es");
        assert_eq!(asked.workload, group);
        assert_eq!(
            asked.terms.availability,
            Some(Availability {
                replicas: 6,
                unavailable: 1
            }),
            "every member's replicas"
        );
        assert_eq!(asked.owner, None, "a group has no one object");
        assert_eq!(asked.ask.map(|a| a.workload), Some(group));
    }

    #[test]
    fn a_pod_without_volumes_or_a_bound_asks_nothing() {
        let web = pod("ns", "web-1").owned_by("Deployment", "web", true);
        let p = planned(0, "ns", "web-1");
        let asked = pod_ask(
            &Known::default(),
            PodToMove::planned(&p, Some(&web)),
            &drain(),
        );
        assert_eq!(asked.budget.max_moving, None);
        assert_eq!((asked.ask, asked.owner), (None, None));
        let live = pod_ask(
            &Known::default(),
            PodToMove::live(&web, &Known::default()),
            &drain(),
        );
        assert_eq!(live.ask, None);
    }

    #[test]
    fn what_berth_cannot_read_is_said_and_the_default_holds() {
        let mut db = pod("ns", "db-0").owned_by("StatefulSet", "db", true);
        db.metadata.annotations = Some(annotations(&[
            (MAX_MOVING_ANNOTATION, "many"),
            (MIN_HEALTHY_ANNOTATION, "10s"),
        ]));
        let facts = Known {
            terms: BTreeMap::from([(
                Workload::new("StatefulSet", "ns", "db"),
                WorkloadTerms {
                    annotations: annotations(&[(MOVE_GROUP_ANNOTATION, "Not A Name")]),
                    ..WorkloadTerms::default()
                },
            )]),
            ..Known::default()
        };
        let p = PlannedPod {
            volumes: vec![attachable("pv-db-0", "data-db-0")],
            ..planned(0, "ns", "db-0")
        };
        let asked = pod_ask(&facts, PodToMove::planned(&p, Some(&db)), &drain());
        let keys: Vec<&str> = asked.bad.iter().map(|b| b.key).collect();
        assert_eq!(keys, [MAX_MOVING_ANNOTATION, MOVE_GROUP_ANNOTATION]);
        assert_eq!(asked.budget.max_moving, Some(1), "the default holds");
        assert_eq!(asked.budget.min_healthy, std::time::Duration::from_secs(10));
        assert_eq!(
            asked.workload,
            Workload::new("StatefulSet", "ns", "db"),
            "stands alone"
        );
    }
}
