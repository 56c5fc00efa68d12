//! A workload's budget, read: what its annotations ask (on the workload
//! object, else on its pod template), the move group it names, and when
//! the replacements of a move are healthy. Pure.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::{
    Availability, BadAnnotation, Budget, HEALTHY_DEADLINE_ANNOTATION, MAX_MOVING_ANNOTATION,
    MIN_HEALTHY_ANNOTATION, MOVE_GROUP_ANNOTATION, MOVE_GROUP_KIND, Workload, WorkloadTerms,
};

/// The budget a workload asks for, over the default: each of its
/// annotations on the workload object, else on its pod template; the
/// minimum healthy time at least the workload's `minReadySeconds`. What
/// could not be read is returned, and its default holds.
///
/// The default for pods with volumes that move is one at a time, or, for
/// a StatefulSet whose owner lets its rolling update take more than one
/// replica down at once (`rollingUpdate.maxUnavailable` above 1, see
/// [`WorkloadTerms::max_unavailable`]), that many: the owner already said
/// how many replicas may be down together. `berth.dev/max-moving` still
/// wins. A workload without volumes stays unbounded unless it asks.
pub fn budget_of(
    template: Option<&BTreeMap<String, String>>,
    workload: &WorkloadTerms,
    moves_volumes: bool,
) -> (Budget, Vec<BadAnnotation>) {
    let mut budget = Budget::default_for(moves_volumes);
    if moves_volumes && let Some(n) = workload.max_unavailable.filter(|n| *n > 1) {
        budget.max_moving = Some(n);
    }
    let mut bad = Vec::new();
    let get = |key: &str| {
        workload
            .annotations
            .get(key)
            .or_else(|| template.and_then(|a| a.get(key)))
    };
    let mut refuse = |key: &'static str, value: &str, why: String| {
        bad.push(BadAnnotation {
            key,
            value: value.to_string(),
            why,
        });
    };
    if let Some(v) = get(MAX_MOVING_ANNOTATION) {
        match v.trim() {
            "unbounded" => budget.max_moving = None,
            n => match n.parse::<u32>() {
                Ok(n) if n >= 1 => budget.max_moving = Some(n),
                _ => refuse(
                    MAX_MOVING_ANNOTATION,
                    v,
                    "not a whole number from 1, nor \"unbounded\"".into(),
                ),
            },
        }
    }
    if let Some(v) = get(MIN_HEALTHY_ANNOTATION) {
        match humantime::parse_duration(v.trim()) {
            Ok(d) => budget.min_healthy = d,
            Err(e) => refuse(MIN_HEALTHY_ANNOTATION, v, format!("not a duration: {e}")),
        }
    }
    if let Some(v) = get(HEALTHY_DEADLINE_ANNOTATION) {
        match humantime::parse_duration(v.trim()) {
            Ok(d) if !d.is_zero() => budget.healthy_deadline = Some(d),
            Ok(_) => refuse(HEALTHY_DEADLINE_ANNOTATION, v, "zero".into()),
            Err(e) => refuse(
                HEALTHY_DEADLINE_ANNOTATION,
                v,
                format!("not a duration: {e}"),
            ),
        }
    }
    budget.min_healthy = budget.min_healthy.max(workload.min_ready);
    (budget, bad)
}

/// The workload whose budget a move of `member`'s pod counts against, and
/// what it says: `member` itself, or the move group its object names
/// ([`MOVE_GROUP_ANNOTATION`], in its namespace), whose availability is
/// that of every member together (`members`: the terms of every workload
/// object of the namespace that names the group) and whose other terms are
/// `member`'s own. A group name that cannot name an object is named back
/// (the member then stands alone).
pub fn grouped(
    member: Workload,
    terms: WorkloadTerms,
    members: impl FnOnce(&str) -> Vec<WorkloadTerms>,
) -> (Workload, WorkloadTerms, Option<BadAnnotation>) {
    let Some(group) = terms
        .annotations
        .get(MOVE_GROUP_ANNOTATION)
        .map(|g| g.trim())
    else {
        return (member, terms, None);
    };
    let valid = !group.is_empty()
        && group.len() <= 63
        && group
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !group.starts_with('-')
        && !group.ends_with('-');
    if !valid {
        let bad = BadAnnotation {
            key: MOVE_GROUP_ANNOTATION,
            value: group.to_string(),
            why: "not a name of lower-case letters, digits and '-' of at most 63".into(),
        };
        return (member, terms, Some(bad));
    }
    let workload = Workload::new(MOVE_GROUP_KIND, &member.namespace, group);
    (
        workload,
        WorkloadTerms {
            availability: availability_of(&members(group)),
            ..terms
        },
        None,
    )
}

/// The availability of several workloads together: their replicas and
/// those unavailable, summed; `None` when none of them says.
pub fn availability_of(members: &[WorkloadTerms]) -> Option<Availability> {
    let mut sum: Option<Availability> = None;
    for a in members.iter().filter_map(|t| t.availability) {
        let s = sum.get_or_insert_default();
        s.replicas += a.replicas;
        s.unavailable += a.unavailable;
    }
    sum
}

/// Since when `pod` has been Ready (its Ready condition's last
/// transition), if it is.
pub fn ready_since(pod: &Pod) -> Option<Timestamp> {
    let c = pod
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")?;
    if c.status != "True" {
        return None;
    }
    Some(
        c.last_transition_time
            .as_ref()
            .map_or(Timestamp::UNIX_EPOCH, |t| t.0),
    )
}

/// Whether replacements Ready since `ready` (`None`: not Ready) are
/// healthy at `now` for a move to end: each Ready for `min_healthy`.
/// `Err(Some(t))`: not yet, all will be at `t` if they stay Ready;
/// `Err(None)`: one is not Ready.
pub fn healthy(
    ready: &[Option<Timestamp>],
    min_healthy: Duration,
    now: Timestamp,
) -> Result<(), Option<Timestamp>> {
    let min = SignedDuration::try_from(min_healthy).unwrap_or(SignedDuration::MAX);
    let mut latest = None;
    for since in ready {
        let Some(since) = since else {
            return Err(None);
        };
        let at = since.checked_add(min).unwrap_or(Timestamp::MAX);
        latest = latest.max(Some(at));
    }
    match latest {
        Some(at) if at > now => Err(Some(at)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::ledger::tests::{ask, granted, t};
    use crate::drain::ledger::{Ask, Ledger};

    #[test]
    fn a_move_group_shares_one_budget_and_counts_every_members_replicas() {
        let with = |pairs: &[(&str, &str)], replicas: u32, unavailable: u32| WorkloadTerms {
            annotations: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            min_ready: Duration::from_secs(5),
            availability: Some(Availability {
                replicas,
                unavailable,
            }),
            max_unavailable: None,
        };
        let es_a = Workload::new("StatefulSet", "search", "es-a");
        let member = with(&[(MOVE_GROUP_ANNOTATION, "es")], 3, 0);
        let others = vec![member.clone(), with(&[(MOVE_GROUP_ANNOTATION, "es")], 3, 1)];
        let (w, terms, bad) = grouped(es_a.clone(), member.clone(), |g| {
            assert_eq!(g, "es");
            others.clone()
        });
        assert_eq!(w, Workload::new(MOVE_GROUP_KIND, "search", "es"));
        assert!(bad.is_none());
        assert_eq!(
            terms.availability,
            Some(Availability {
                replicas: 6,
                unavailable: 1
            }),
            "every member's replicas"
        );
        assert_eq!(
            terms.min_ready,
            Duration::from_secs(5),
            "the member's own terms"
        );
        // Without a group, the member stands alone.
        let alone = with(&[], 3, 0);
        let (w, terms, bad) = grouped(es_a.clone(), alone.clone(), |_| panic!("no group"));
        assert_eq!((w, terms, bad), (es_a.clone(), alone, None));
        // A name that cannot name an object is named back.
        let odd = with(&[(MOVE_GROUP_ANNOTATION, "Elastic Search")], 3, 0);
        let (w, _, bad) = grouped(es_a.clone(), odd, |_| panic!("not a group"));
        assert_eq!(w, es_a);
        assert_eq!(bad.map(|b| b.key), Some(MOVE_GROUP_ANNOTATION));
        // Two members of one group wait for each other's moves.
        let mut l = Ledger::default();
        let group = Workload::new(MOVE_GROUP_KIND, "search", "es");
        let one = Budget::default_for(true);
        let a = Ask {
            workload: group.clone(),
            ..ask("es-a-0", "a", 0)
        };
        let b = Ask {
            workload: group,
            ..ask("es-b-0", "b", 0)
        };
        assert!(granted(&l.ask(&a, &one, t(1))));
        assert!(!granted(&l.ask(&b, &one, t(1))));
    }

    #[test]
    fn a_move_ends_once_every_replacement_has_been_ready_long_enough() {
        let ten = Duration::from_secs(10);
        assert_eq!(healthy(&[Some(t(0)), Some(t(5))], ten, t(20)), Ok(()));
        assert_eq!(
            healthy(&[Some(t(0)), Some(t(5))], ten, t(12)),
            Err(Some(t(15)))
        );
        assert_eq!(healthy(&[Some(t(0)), None], ten, t(100)), Err(None));
        assert_eq!(healthy(&[Some(t(3))], Duration::ZERO, t(3)), Ok(()));
        let mut pod = Pod::default();
        assert_eq!(ready_since(&pod), None);
        pod.status = Some(
            serde_json::from_value(serde_json::json!({
                "conditions": [{"type": "Ready", "status": "True",
                    "lastTransitionTime": "2023-11-14T22:13:20Z"}]
            }))
            .expect("status"),
        );
        assert_eq!(ready_since(&pod), Some(t(0)));
    }

    #[test]
    fn budgets_come_from_annotations_and_a_bad_value_keeps_the_default() {
        let a = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let none = WorkloadTerms::default();
        let (b, bad) = budget_of(None, &none, true);
        assert_eq!(b, Budget::default_for(true));
        assert!(bad.is_empty());
        assert_eq!(budget_of(None, &none, false).0.max_moving, None);
        let (b, bad) = budget_of(
            Some(&a(&[
                (MAX_MOVING_ANNOTATION, "2"),
                (MIN_HEALTHY_ANNOTATION, "10s"),
                (HEALTHY_DEADLINE_ANNOTATION, "3m"),
            ])),
            &none,
            true,
        );
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(b.max_moving, Some(2));
        assert_eq!(b.min_healthy, Duration::from_secs(10));
        assert_eq!(b.healthy_deadline, Some(Duration::from_secs(180)));
        assert_eq!(
            budget_of(
                Some(&a(&[(MAX_MOVING_ANNOTATION, "unbounded")])),
                &none,
                true
            )
            .0
            .max_moving,
            None
        );
        let (b, bad) = budget_of(
            Some(&a(&[
                (MAX_MOVING_ANNOTATION, "0"),
                (MIN_HEALTHY_ANNOTATION, "soon"),
                (HEALTHY_DEADLINE_ANNOTATION, "0s"),
            ])),
            &none,
            true,
        );
        assert_eq!(b, Budget::default_for(true));
        let keys: Vec<_> = bad.iter().map(|b| b.key).collect();
        assert_eq!(
            keys,
            vec![
                MAX_MOVING_ANNOTATION,
                MIN_HEALTHY_ANNOTATION,
                HEALTHY_DEADLINE_ANNOTATION
            ]
        );
    }

    #[test]
    fn the_workload_object_wins_over_its_template_and_min_ready_seconds_is_a_floor() {
        let a = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let template = a(&[(MAX_MOVING_ANNOTATION, "3"), (MIN_HEALTHY_ANNOTATION, "5s")]);
        let workload = WorkloadTerms {
            annotations: a(&[(MAX_MOVING_ANNOTATION, "2")]),
            min_ready: Duration::from_secs(20),
            availability: None,
            max_unavailable: None,
        };
        let (b, bad) = budget_of(Some(&template), &workload, true);
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(b.max_moving, Some(2), "the workload's annotation wins");
        assert_eq!(
            b.min_healthy,
            Duration::from_secs(20),
            "available only after minReadySeconds, longer than the 5s asked"
        );
        let longer = a(&[(MIN_HEALTHY_ANNOTATION, "1m")]);
        assert_eq!(
            budget_of(Some(&longer), &workload, true).0.min_healthy,
            Duration::from_secs(60)
        );
        // A bad value on the workload is not replaced by the template's:
        // the default holds, and it is named.
        let bad_workload = WorkloadTerms {
            annotations: a(&[(MAX_MOVING_ANNOTATION, "many")]),
            min_ready: Duration::ZERO,
            availability: None,
            max_unavailable: None,
        };
        let (b, bad) = budget_of(Some(&template), &bad_workload, true);
        assert_eq!(b.max_moving, Some(1));
        assert_eq!(bad.len(), 1);
        // A workload without volumes keeps its unbounded default unless it
        // asks.
        assert_eq!(budget_of(None, &workload, false).0.max_moving, Some(2));
    }

    #[test]
    fn a_stateful_sets_max_unavailable_above_one_is_its_default_budget() {
        let rolling = |n: u32| WorkloadTerms {
            max_unavailable: Some(n),
            ..WorkloadTerms::default()
        };
        assert_eq!(budget_of(None, &rolling(3), true).0.max_moving, Some(3));
        assert_eq!(
            budget_of(None, &rolling(1), true).0,
            Budget::default_for(true),
            "one at a time, as without it"
        );
        assert_eq!(
            budget_of(None, &rolling(3), false).0.max_moving,
            None,
            "without volumes, unbounded as before: it only raises the default of one"
        );
        // Its own annotation still wins, on the object or its template, and
        // either way.
        let mut asks = rolling(3);
        asks.annotations
            .insert(MAX_MOVING_ANNOTATION.into(), "1".into());
        assert_eq!(budget_of(None, &asks, true).0.max_moving, Some(1));
        let template = BTreeMap::from([(MAX_MOVING_ANNOTATION.to_string(), "5".to_string())]);
        assert_eq!(
            budget_of(Some(&template), &rolling(3), true).0.max_moving,
            Some(5)
        );
        let unbounded =
            BTreeMap::from([(MAX_MOVING_ANNOTATION.to_string(), "unbounded".to_string())]);
        assert_eq!(
            budget_of(Some(&unbounded), &rolling(3), true).0.max_moving,
            None
        );
        // An annotation berth cannot read keeps the default, which is now
        // the owner's.
        let bad = BTreeMap::from([(MAX_MOVING_ANNOTATION.to_string(), "0".to_string())]);
        let (b, bad) = budget_of(Some(&bad), &rolling(3), true);
        assert_eq!((b.max_moving, bad.len()), (Some(3), 1));
        // A move group's terms are its member's: the member's owner speaks.
        let mut member = rolling(2);
        member
            .annotations
            .insert(MOVE_GROUP_ANNOTATION.into(), "es".into());
        let (_, terms, _) = grouped(
            Workload::new("StatefulSet", "ns", "es-a"),
            member,
            |_| vec![],
        );
        assert_eq!(budget_of(None, &terms, true).0.max_moving, Some(2));
    }
}
