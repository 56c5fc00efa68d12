//! Which Machine of a set goes first on scale-down. Pure: the controller
//! gathers a [`Candidate`] per Machine from its caches and asks [`choose`].
//!
//! The order, each key breaking the ties of the one before:
//!
//! 1. **Operator priority**: the `berth.dev/delete-priority` annotation, an
//!    integer, higher first; none (or not an integer) counts as 0, so a
//!    negative value protects a Machine.
//! 2. **Unhealthy first**: Failed, not Running yet, `NodeHealthy` False, or
//!    its Node NotReady (or gone). Removing these costs no capacity.
//! 3. **Not blocked by a PodDisruptionBudget now**: a Machine one of whose
//!    pods a PDB would refuse to evict right now (no disruption allowed)
//!    is passed over for one whose drain can start at once; the blocked
//!    one may be free by the time its turn comes.
//! 4. **A destination for every stateful pod**: a Machine one of whose
//!    stateful pods would find no Node for its replacement now (no other
//!    Node in its volume's zone, no attach slot; see [`crate::placement`])
//!    is passed over for one whose stateful pods all have one: its drain
//!    would wait, and the Machine with it. Choosing it anyway (every
//!    Machine goes, or a key above decided) is named in the Event.
//! 5. **Cheapest drain**, as berth's drain plan measures it: fewest
//!    stateful pods (evictable pods with a bound PersistentVolumeClaim),
//!    then fewest volumes attached to its Node. Each stateful pod is a
//!    sequential detach and reattach; a cheap Machine frees its place soon
//!    and moves no data.
//! 6. **Oldest first** (creation time), then by name, so that the order is
//!    total and the same Machines always give the same choice.
//!
//! It never chooses a Machine already being deleted: the controller leaves
//! those out (they are going already and do not count as replicas).

use std::cmp::{Ordering, Reverse};
use std::fmt;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;

use crate::api::DELETE_PRIORITY_ANNOTATION;
use crate::drain::select::{PodClass, classify};

/// What the order knows of one Machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) name: String,
    /// From [`DELETE_PRIORITY_ANNOTATION`]; 0 when absent or invalid.
    pub(crate) priority: i64,
    pub(crate) health: Health,
    /// Why its drain would be blocked now (a PDB covering one of its pods
    /// allows no disruption), if it would.
    pub(crate) pdb_blocked: Option<String>,
    /// Why one of its stateful pods would have no destination now, if
    /// one would not.
    pub(crate) stranded: Option<String>,
    pub(crate) cost: DrainCost,
    pub(crate) created: Option<Timestamp>,
}

/// Whether a Machine serves, and if not why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Health {
    Healthy,
    Unhealthy(String),
}

/// What draining a Machine would move.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct DrainCost {
    pub(crate) stateful_pods: u32,
    pub(crate) attached_volumes: u32,
}

impl fmt::Display for DrainCost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural = |n: u32, what: &str| {
            if n == 1 {
                format!("{n} {what}")
            } else {
                format!("{n} {what}s")
            }
        };
        write!(
            f,
            "{}, {}",
            plural(self.stateful_pods, "stateful pod"),
            plural(self.attached_volumes, "attached volume")
        )
    }
}

/// Which key of the order decided that a Machine goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    /// Every Machine of the set goes.
    All,
    Priority,
    Unhealthy,
    NotBlocked,
    Destination,
    CheapestDrain,
    Oldest,
    Name,
}

impl Why {
    /// A short label, for Events and tests.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Why::All => "AllGo",
            Why::Priority => "DeletePriority",
            Why::Unhealthy => "Unhealthy",
            Why::NotBlocked => "NotBlockedByPDB",
            Why::Destination => "DestinationReady",
            Why::CheapestDrain => "CheapestDrain",
            Why::Oldest => "Oldest",
            Why::Name => "Name",
        }
    }
}

/// A Machine chosen to go, and why, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chosen {
    pub(crate) name: String,
    pub(crate) why: Why,
    pub(crate) reason: String,
}

/// The operator's priority on a Machine (0 when absent or not an integer).
pub(crate) fn priority(annotations: Option<&std::collections::BTreeMap<String, String>>) -> i64 {
    annotations
        .and_then(|a| a.get(DELETE_PRIORITY_ANNOTATION))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// What draining a Node with `pods` and `attached_volumes` would move:
/// the pods the drain would evict ([`classify`] says `Evictable`) that use
/// a claim `bound` says is bound to a PersistentVolume.
pub(crate) fn drain_cost<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    attached_volumes: usize,
    bound: impl Fn(&str, &str) -> bool,
) -> DrainCost {
    let stateful = pods
        .into_iter()
        .filter(|p| classify(p) == PodClass::Evictable)
        .filter(|p| {
            let ns = p.metadata.namespace.as_deref().unwrap_or_default();
            crate::cache::claim_names(p).iter().any(|claim| {
                claim.starts_with(crate::cache::inline::INLINE_PREFIX) || bound(ns, claim)
            })
        })
        .count();
    DrainCost {
        stateful_pods: u32::try_from(stateful).unwrap_or(u32::MAX),
        attached_volumes: u32::try_from(attached_volumes).unwrap_or(u32::MAX),
    }
}

/// The order of the module documentation: `Less` goes first.
fn goes_before(a: &Candidate, b: &Candidate) -> Ordering {
    key(a).cmp(&key(b)).then_with(|| a.name.cmp(&b.name))
}

type Key = (Reverse<i64>, bool, bool, bool, DrainCost, Option<Timestamp>);

fn key(c: &Candidate) -> Key {
    (
        Reverse(c.priority),
        c.health == Health::Healthy,
        c.pdb_blocked.is_some(),
        c.stranded.is_some(),
        c.cost,
        // A Machine without a creation time (never seen in practice) goes
        // last among equals: `None` sorts first, so invert it.
        c.created.or(Some(Timestamp::MAX)),
    )
}

/// The `n` Machines to delete from `candidates`, first first, each with the
/// key that put it before the first Machine kept.
pub(crate) fn choose(mut candidates: Vec<Candidate>, n: usize) -> Vec<Chosen> {
    candidates.sort_by(goes_before);
    let kept = candidates.get(n).cloned();
    candidates
        .into_iter()
        .take(n)
        .map(|c| {
            let (why, reason) = match &kept {
                None => (
                    Why::All,
                    format!("every Machine of the set goes; {}", own(&c)),
                ),
                Some(k) => explain(&c, k),
            };
            // Chosen although its drain will wait for a destination: said.
            let reason = match &c.stranded {
                Some(s) if why != Why::Destination => format!("{reason}; {s}"),
                _ => reason,
            };
            Chosen {
                name: c.name,
                why,
                reason,
            }
        })
        .collect()
}

/// What `c` is, for the case where no Machine is kept.
fn own(c: &Candidate) -> String {
    match &c.health {
        Health::Unhealthy(why) => format!("unhealthy ({why})"),
        Health::Healthy => format!("drain moves {}", c.cost),
    }
}

/// The first key on which `c` goes before `kept`, in words.
fn explain(c: &Candidate, kept: &Candidate) -> (Why, String) {
    if c.priority != kept.priority {
        return (
            Why::Priority,
            format!(
                "{DELETE_PRIORITY_ANNOTATION} {} (above {}'s {})",
                c.priority, kept.name, kept.priority
            ),
        );
    }
    if let (Health::Unhealthy(why), Health::Healthy) = (&c.health, &kept.health) {
        return (
            Why::Unhealthy,
            format!("unhealthy: {why} ({} is healthy)", kept.name),
        );
    }
    if let (None, Some(blocked)) = (&c.pdb_blocked, &kept.pdb_blocked) {
        return (
            Why::NotBlocked,
            format!(
                "its drain can start now; {}'s is blocked: {blocked}",
                kept.name
            ),
        );
    }
    if let (None, Some(stranded)) = (&c.stranded, &kept.stranded) {
        return (
            Why::Destination,
            format!(
                "its stateful pods have a destination; {}'s would not: {stranded}",
                kept.name
            ),
        );
    }
    if c.cost != kept.cost {
        return (
            Why::CheapestDrain,
            format!("cheapest drain: {} ({}: {})", c.cost, kept.name, kept.cost),
        );
    }
    if c.created != kept.created {
        let at = |t: Option<Timestamp>| t.map_or_else(|| "unknown".to_string(), |t| t.to_string());
        return (
            Why::Oldest,
            format!(
                "oldest of equal drain cost ({}): created {} ({}: {})",
                c.cost,
                at(c.created),
                kept.name,
                at(kept.created)
            ),
        );
    }
    (
        Why::Name,
        format!(
            "equal to {} in priority, health, drain cost and age: first by name",
            kept.name
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> Option<Timestamp> {
        Some(Timestamp::from_second(1_800_000_000 + secs).expect("valid"))
    }

    fn c(name: &str) -> Candidate {
        Candidate {
            name: name.into(),
            priority: 0,
            health: Health::Healthy,
            pdb_blocked: None,
            stranded: None,
            cost: DrainCost::default(),
            created: t(0),
        }
    }

    fn with(mut c: Candidate, f: impl FnOnce(&mut Candidate)) -> Candidate {
        f(&mut c);
        c
    }

    fn cost(stateful_pods: u32, attached_volumes: u32) -> DrainCost {
        DrainCost {
            stateful_pods,
            attached_volumes,
        }
    }

    fn unhealthy(why: &str) -> Health {
        Health::Unhealthy(why.into())
    }

    #[test]
    fn a_machine_chosen_without_a_destination_says_so() {
        let stranded = "stateful pod db/pg-0 would have no destination: zone a: n1 cordoned";
        let only = with(c("only"), |c| c.stranded = Some(stranded.into()));
        let chosen = choose(vec![only], 1);
        assert_eq!(chosen[0].why, Why::All);
        assert!(chosen[0].reason.ends_with(stranded), "{}", chosen[0].reason);
    }

    #[test]
    fn each_key_breaks_the_ties_of_the_one_before() {
        // (case, candidates, n, expected names in order, why of each)
        type Case = (
            &'static str,
            Vec<Candidate>,
            usize,
            Vec<&'static str>,
            Vec<Why>,
        );
        let cases: Vec<Case> = vec![
            (
                "a drain a PDB blocks now waits for one that can start, cheaper or not",
                vec![
                    with(c("blocked-cheap"), |c| {
                        c.pdb_blocked = Some("PDB db/pg allows 0 disruptions".into());
                    }),
                    with(c("free-costly"), |c| {
                        c.cost = cost(2, 2);
                        c.created = t(100);
                    }),
                    with(c("sick-blocked"), |c| {
                        c.health = unhealthy("phase Failed");
                        c.pdb_blocked = Some("PDB db/pg allows 0 disruptions".into());
                    }),
                ],
                2,
                vec!["sick-blocked", "free-costly"],
                vec![Why::Unhealthy, Why::NotBlocked],
            ),
            (
                "a Machine whose stateful pods have a destination goes first, costly or not",
                vec![
                    with(c("stranded-cheap"), |c| {
                        c.stranded = Some("stateful pod db/pg-0 would have no destination".into());
                        c.cost = cost(1, 1);
                    }),
                    with(c("placed-costly"), |c| c.cost = cost(2, 2)),
                    with(c("blocked"), |c| {
                        c.pdb_blocked = Some("PDB db/pg allows 0 disruptions".into());
                    }),
                ],
                1,
                vec!["placed-costly"],
                vec![Why::Destination],
            ),
            (
                "priority beats health, cost and age",
                vec![
                    with(c("sick"), |c| c.health = unhealthy("phase Failed")),
                    with(c("marked"), |c| {
                        c.priority = 5;
                        c.cost = cost(9, 9);
                        c.created = t(100);
                    }),
                ],
                1,
                vec!["marked"],
                vec![Why::Priority],
            ),
            (
                "higher priority first; negative protects",
                vec![
                    with(c("low"), |c| c.priority = 1),
                    with(c("high"), |c| c.priority = 10),
                    with(c("kept"), |c| {
                        c.priority = -1;
                        c.health = unhealthy("phase Failed");
                    }),
                    c("plain"),
                ],
                3,
                vec!["high", "low", "plain"],
                vec![Why::Priority, Why::Priority, Why::Priority],
            ),
            (
                "unhealthy beats a cheaper, older drain",
                vec![
                    with(c("old-cheap"), |c| c.created = t(-100)),
                    with(c("notready"), |c| {
                        c.health = unhealthy("Node n1 NotReady");
                        c.cost = cost(3, 3);
                    }),
                ],
                1,
                vec!["notready"],
                vec![Why::Unhealthy],
            ),
            (
                "fewest stateful pods before fewest volumes before age",
                vec![
                    with(c("old-stateful"), |c| {
                        c.cost = cost(1, 1);
                        c.created = t(-500);
                    }),
                    with(c("volumes-only"), |c| c.cost = cost(0, 2)),
                    with(c("empty"), |c| c.created = t(50)),
                ],
                2,
                vec!["empty", "volumes-only"],
                vec![Why::CheapestDrain, Why::CheapestDrain],
            ),
            (
                "oldest among equal costs",
                vec![
                    with(c("young"), |c| c.created = t(10)),
                    with(c("old"), |c| c.created = t(1)),
                ],
                1,
                vec!["old"],
                vec![Why::Oldest],
            ),
            (
                "name breaks a full tie",
                vec![c("b"), c("a")],
                1,
                vec!["a"],
                vec![Why::Name],
            ),
            ("nothing to delete", vec![c("a"), c("b")], 0, vec![], vec![]),
            (
                "everything goes",
                vec![c("b"), with(c("a"), |c| c.priority = 1)],
                5,
                vec!["a", "b"],
                vec![Why::All, Why::All],
            ),
        ];
        for (case, candidates, n, names, whys) in cases {
            let chosen = choose(candidates, n);
            let got: Vec<&str> = chosen.iter().map(|c| c.name.as_str()).collect();
            assert_eq!(got, names, "{case}");
            let got: Vec<Why> = chosen.iter().map(|c| c.why).collect();
            assert_eq!(got, whys, "{case}");
        }
    }

    #[test]
    fn the_reason_names_the_machine_kept_and_the_figures() {
        let chosen = choose(
            vec![with(c("m-stateful"), |c| c.cost = cost(1, 1)), c("m-empty")],
            1,
        );
        assert_eq!(
            chosen[0].reason,
            "cheapest drain: 0 stateful pods, 0 attached volumes (m-stateful: 1 stateful pod, 1 attached volume)"
        );
        let chosen = choose(vec![with(c("a"), |c| c.priority = 3), c("b")], 1);
        assert_eq!(
            chosen[0].reason,
            "berth.dev/delete-priority 3 (above b's 0)"
        );
    }

    #[test]
    fn priority_reads_integers_only() {
        let ann = |v: &str| {
            std::collections::BTreeMap::from([(DELETE_PRIORITY_ANNOTATION.to_string(), v.into())])
        };
        for (value, want) in [("10", 10), (" -3 ", -3), ("true", 0), ("", 0)] {
            assert_eq!(priority(Some(&ann(value))), want, "{value:?}");
        }
        assert_eq!(priority(None), 0);
    }

    fn pod(name: &str, claim: Option<&str>, daemonset: bool, phase: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "namespace": "ns", "name": name,
                "ownerReferences": if daemonset {
                    serde_json::json!([{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "u", "controller": true}])
                } else { serde_json::json!([]) },
            },
            "spec": {
                "nodeName": "n1",
                "containers": [],
                "volumes": claim.map(|c| vec![serde_json::json!({"name": "v", "persistentVolumeClaim": {"claimName": c}})]).unwrap_or_default(),
            },
            "status": {"phase": phase},
        }))
        .expect("pod")
    }

    #[test]
    fn drain_cost_counts_evictable_pods_with_a_bound_claim() {
        let pods = [
            pod("db-0", Some("data-db-0"), false, "Running"),
            pod("pending-claim", Some("unbound"), false, "Running"),
            pod("web", None, false, "Running"),
            pod("agent", Some("data-agent"), true, "Running"),
            pod("job", Some("data-job"), false, "Succeeded"),
        ];
        let bound = |ns: &str, claim: &str| ns == "ns" && claim != "unbound";
        assert_eq!(drain_cost(&pods, 2, bound), cost(1, 2));
        assert_eq!(drain_cost(&[], 0, bound), DrainCost::default());
    }
}
