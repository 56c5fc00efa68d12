//! Which VMs are orphans: pure decisions over what a provider listed and
//! what the Machine cache holds, with the time passed in. Nothing here
//! calls a provider or the API server.
//!
//! A VM is collected only when every one of these holds, checked in this
//! order (the first that fails is the [`Verdict`]):
//!
//! 1. its tags name the Machine it was created for ([`Verdict::Untagged`]:
//!    a VM without them is never touched, whatever else it carries);
//! 2. that Machine's namespace is one this controller watches
//!    ([`Verdict::OutOfScope`]: with `--namespace`, the cache holds no
//!    other namespace's Machines, so it cannot tell);
//! 3. no Machine has `spec.providerID` equal to the VM's
//!    ([`Verdict::Referenced`]);
//! 4. no Machine has the UID its tags name ([`Verdict::MachineExists`]: a
//!    Machine whose create returned but whose providerID is not written
//!    yet keeps its VM);
//! 5. the provider is not already deleting it ([`Verdict::Deleting`]);
//! 6. the provider says when it was created ([`Verdict::AgeUnknown`]);
//! 7. it is at least the grace period old ([`Verdict::Young`]).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use crate::api::Machine;
use crate::providers::{Vm, VmState};

/// What the Machine cache says, indexed the three ways a VM is matched.
#[derive(Debug, Default)]
pub(crate) struct Machines {
    provider_ids: HashSet<String>,
    uids: HashSet<String>,
    /// (namespace, name) → UID.
    names: HashMap<(String, String), String>,
}

impl Machines {
    /// The index of these Machines.
    pub(crate) fn of<'a>(machines: impl IntoIterator<Item = &'a Machine>) -> Self {
        let mut out = Self::default();
        for m in machines {
            out.insert(
                &m.namespace().unwrap_or_default(),
                &m.name_any(),
                m.metadata.uid.as_deref().unwrap_or_default(),
                m.spec.provider_id.as_deref(),
            );
        }
        out
    }

    pub(crate) fn insert(
        &mut self,
        namespace: &str,
        name: &str,
        uid: &str,
        provider_id: Option<&str>,
    ) {
        if let Some(id) = provider_id.filter(|id| !id.is_empty()) {
            self.provider_ids.insert(id.to_string());
        }
        if !uid.is_empty() {
            self.uids.insert(uid.to_string());
        }
        self.names
            .insert((namespace.to_string(), name.to_string()), uid.to_string());
    }

    /// The UID of the Machine called `namespace/name`, if there is one.
    fn uid_of(&self, namespace: &str, name: &str) -> Option<&str> {
        self.names
            .get(&(namespace.to_string(), name.to_string()))
            .map(String::as_str)
    }
}

/// What makes a VM old enough and ours to judge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rules {
    /// How old a VM must be before it is collected.
    pub grace: Duration,
    /// The only namespace whose Machines the cache holds (`--namespace`);
    /// `None`: every namespace.
    pub namespace: Option<String>,
}

/// What orphan collection makes of one VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Its tags name no Machine: never touched.
    Untagged,
    /// Tagged for a Machine in a namespace this controller does not watch.
    OutOfScope,
    /// A Machine's `spec.providerID` is this VM's.
    Referenced,
    /// The Machine its tags name (by UID) exists.
    MachineExists,
    /// The provider is already deleting it.
    Deleting,
    /// The provider does not say when it was created: never collected.
    AgeUnknown,
    /// An orphan younger than the grace period: collected once
    /// `collect_in` has passed, if it still is one then.
    Young { collect_in: Duration },
    /// An orphan: collect it. `namesake` is the UID of the Machine that now
    /// has the name the VM's tags give (the Machine was deleted and made
    /// again), which is told about it.
    Orphan {
        age: Duration,
        namesake: Option<String>,
    },
}

/// Orphans one round may collect at least, whatever the size of the fleet.
pub(crate) const MIN_ORPHANS_PER_ROUND: usize = 5;

/// The most orphans (young ones included) one round may find among the
/// `fleet` VMs it judged (those of this controller's Machines or tagged
/// for them) and still collect: a tenth of the fleet, at least
/// [`MIN_ORPHANS_PER_ROUND`]. More is not a leak but a sign that the
/// Machine cache or the cloud's tags are wrong (Machines restored without
/// their UIDs, a namespace filter changed): the round collects none, and
/// says so.
pub(crate) fn round_bound(fleet: usize) -> usize {
    (fleet / 10).max(MIN_ORPHANS_PER_ROUND)
}

/// Whether a pod on an orphan's Node holds its collection: one that would
/// be drained (not a DaemonSet's, a mirror, finished, or skipped by its
/// drain rule). Such a VM is held, never terminated without a drain.
pub(crate) fn holds_vm(pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    use crate::drain::select::{PodClass, classify};
    !matches!(
        classify(pod),
        PodClass::Mirror
            | PodClass::DaemonSet { .. }
            | PodClass::Terminal { .. }
            | PodClass::Skipped { .. }
    )
}

/// The [`Verdict`] on `vm` at `now` (see the module documentation for the
/// rules and their order).
pub(crate) fn judge(vm: &Vm, machines: &Machines, rules: &Rules, now: Timestamp) -> Verdict {
    let Some(tag) = &vm.machine else {
        return Verdict::Untagged;
    };
    if rules
        .namespace
        .as_deref()
        .is_some_and(|ns| ns != tag.namespace)
    {
        return Verdict::OutOfScope;
    }
    if machines.provider_ids.contains(&vm.provider_id) {
        return Verdict::Referenced;
    }
    // An empty UID tag matches nothing, and proves nothing either: such a
    // VM was not made by berth's create.
    if tag.uid.is_empty() {
        return Verdict::Untagged;
    }
    if machines.uids.contains(&tag.uid) {
        return Verdict::MachineExists;
    }
    if vm.state == VmState::Deleting {
        return Verdict::Deleting;
    }
    let Some(created) = vm.created_at else {
        return Verdict::AgeUnknown;
    };
    // A creation time ahead of this clock (skew) counts as age zero.
    let age = Duration::try_from(now.duration_since(created)).unwrap_or_default();
    if age < rules.grace {
        return Verdict::Young {
            collect_in: rules.grace - age,
        };
    }
    Verdict::Orphan {
        age,
        namesake: machines
            .uid_of(&tag.namespace, &tag.name)
            .map(str::to_string),
    }
}

/// VMs listed for several classes, each once, by providerID: classes that
/// point to the same place list the same VMs. Each keeps the first class
/// (by position in `listed`) that listed it, which is the class its delete
/// is asked with.
pub(crate) fn dedupe<C: Clone>(listed: Vec<(C, Vec<Vm>)>) -> Vec<(C, Vm)> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (class, vms) in listed {
        for vm in vms {
            if seen.insert(vm.provider_id.clone()) {
                out.push((class.clone(), vm));
            }
        }
    }
    out
}

/// Things to report once, not every round: a key is new the first time it
/// is seen, and forgotten after a complete round that did not see it (so
/// that it is reported again if it comes back, and the set stays as small
/// as what exists).
#[derive(Debug, Default)]
pub(crate) struct Once {
    reported: HashSet<String>,
    this_round: HashSet<String>,
}

impl Once {
    /// Whether `key` is to be reported now: true the first time.
    pub(crate) fn first(&mut self, key: &str) -> bool {
        self.this_round.insert(key.to_string());
        self.reported.insert(key.to_string())
    }

    /// Ends a round. After a `complete` one (every list answered) the keys
    /// it did not see are forgotten; after an incomplete one nothing is,
    /// since what a failed list would have returned is unknown.
    pub(crate) fn end_round(&mut self, complete: bool) {
        let seen = std::mem::take(&mut self.this_round);
        if complete {
            self.reported.retain(|k| seen.contains(k));
        }
    }
}

/// How many VMs got each verdict in one round, for its log line.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Tally {
    pub listed: usize,
    pub untagged: usize,
    pub out_of_scope: usize,
    pub in_use: usize,
    pub deleting: usize,
    pub age_unknown: usize,
    pub young: usize,
    pub orphans: usize,
}

impl Tally {
    pub(crate) fn count(&mut self, verdict: &Verdict) {
        self.listed += 1;
        match verdict {
            Verdict::Untagged => self.untagged += 1,
            Verdict::OutOfScope => self.out_of_scope += 1,
            Verdict::Referenced | Verdict::MachineExists => self.in_use += 1,
            Verdict::Deleting => self.deleting += 1,
            Verdict::AgeUnknown => self.age_unknown += 1,
            Verdict::Young { .. } => self.young += 1,
            Verdict::Orphan { .. } => self.orphans += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_round_takes_at_most_a_tenth_of_the_fleet_and_always_a_few() {
        assert_eq!(super::round_bound(0), super::MIN_ORPHANS_PER_ROUND);
        assert_eq!(super::round_bound(49), super::MIN_ORPHANS_PER_ROUND);
        assert_eq!(super::round_bound(1000), 100);
    }

    use super::*;
    use crate::providers::MachineRef;

    const NOW: &str = "2026-11-21T12:00:00Z";

    fn at(t: &str) -> Timestamp {
        t.parse().expect("timestamp")
    }

    fn vm(id: &str, tag: Option<(&str, &str, &str)>, state: VmState, created: Option<&str>) -> Vm {
        Vm {
            provider_id: id.to_string(),
            state,
            machine: tag.map(|(namespace, name, uid)| MachineRef {
                namespace: namespace.into(),
                name: name.into(),
                uid: uid.into(),
            }),
            created_at: created.map(at),
        }
    }

    /// ns/web (uid-web) runs fake:///ns/web; ns/db (uid-db) has no
    /// providerID yet; ns/again (uid-again-2) was made again after
    /// uid-again-1 went.
    fn cache() -> Machines {
        let mut m = Machines::default();
        m.insert("ns", "web", "uid-web", Some("fake:///ns/web"));
        m.insert("ns", "db", "uid-db", None);
        m.insert("ns", "again", "uid-again-2", None);
        m
    }

    fn rules(namespace: Option<&str>) -> Rules {
        Rules {
            grace: Duration::from_secs(30 * 60),
            namespace: namespace.map(String::from),
        }
    }

    #[test]
    fn each_rule_keeps_its_vms_and_only_true_orphans_are_collected() {
        use VmState::*;
        let old = Some("2026-11-21T11:00:00Z");
        let young = Some("2026-11-21T11:50:00Z");
        let ghost = Some(("ns", "ghost", "uid-ghost"));
        let cases: Vec<(&str, Vm, Option<&str>, Verdict)> = vec![
            (
                "no Machine tags, old and unreferenced",
                vm("fake:///ns/x", None, Running, old),
                None,
                Verdict::Untagged,
            ),
            (
                "tags with an empty UID",
                vm("fake:///ns/x", Some(("ns", "x", "")), Running, old),
                None,
                Verdict::Untagged,
            ),
            (
                "a namespace this controller does not watch",
                vm(
                    "fake:///other/ghost",
                    Some(("other", "ghost", "u")),
                    Running,
                    old,
                ),
                Some("ns"),
                Verdict::OutOfScope,
            ),
            (
                "referenced by providerID, whatever its tags",
                vm(
                    "fake:///ns/web",
                    Some(("ns", "old-web", "uid-gone")),
                    Running,
                    old,
                ),
                None,
                Verdict::Referenced,
            ),
            (
                "its Machine exists by UID, providerID not written yet",
                vm("fake:///ns/db", Some(("ns", "db", "uid-db")), Creating, old),
                None,
                Verdict::MachineExists,
            ),
            (
                "its Machine exists by UID under another name",
                vm(
                    "fake:///ns/db",
                    Some(("ns", "renamed", "uid-db")),
                    Running,
                    old,
                ),
                Some("ns"),
                Verdict::MachineExists,
            ),
            (
                "already being deleted",
                vm("fake:///ns/ghost", ghost, Deleting, old),
                None,
                Verdict::Deleting,
            ),
            (
                "no creation time",
                vm("fake:///ns/ghost", ghost, Running, None),
                None,
                Verdict::AgeUnknown,
            ),
            (
                "ten minutes old",
                vm("fake:///ns/ghost", ghost, Running, young),
                None,
                Verdict::Young {
                    collect_in: Duration::from_secs(20 * 60),
                },
            ),
            (
                "created ahead of this clock",
                vm(
                    "fake:///ns/ghost",
                    ghost,
                    Running,
                    Some("2026-11-21T12:05:00Z"),
                ),
                None,
                Verdict::Young {
                    collect_in: Duration::from_secs(30 * 60),
                },
            ),
            (
                "exactly the grace period old",
                vm(
                    "fake:///ns/ghost",
                    ghost,
                    Running,
                    Some("2026-11-21T11:30:00Z"),
                ),
                None,
                Verdict::Orphan {
                    age: Duration::from_secs(30 * 60),
                    namesake: None,
                },
            ),
            (
                "an hour old, no Machine of that name",
                vm("fake:///ns/ghost", ghost, Creating, old),
                Some("ns"),
                Verdict::Orphan {
                    age: Duration::from_secs(3600),
                    namesake: None,
                },
            ),
            (
                "an hour old, its Machine made again under the same name",
                vm(
                    "fake:///ns/again",
                    Some(("ns", "again", "uid-again-1")),
                    Running,
                    old,
                ),
                None,
                Verdict::Orphan {
                    age: Duration::from_secs(3600),
                    namesake: Some("uid-again-2".into()),
                },
            ),
        ];
        let machines = cache();
        for (what, vm, namespace, want) in cases {
            assert_eq!(
                judge(&vm, &machines, &rules(namespace), at(NOW)),
                want,
                "{what}"
            );
        }
    }

    #[test]
    fn an_empty_cache_still_never_collects_young_untagged_or_undated_vms() {
        let none = Machines::default();
        let r = rules(None);
        let untagged = vm("a", None, VmState::Running, Some("2020-01-01T00:00:00Z"));
        let undated = vm("b", Some(("ns", "b", "u")), VmState::Running, None);
        let young = vm("c", Some(("ns", "c", "u")), VmState::Running, Some(NOW));
        for v in [untagged, undated, young] {
            assert!(
                !matches!(judge(&v, &none, &r, at(NOW)), Verdict::Orphan { .. }),
                "{v:?}"
            );
        }
    }

    #[test]
    fn machines_are_indexed_from_the_cache_objects() {
        let m: Machine = serde_json::from_value(serde_json::json!({
            "apiVersion": "berth.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": "web", "namespace": "ns", "uid": "uid-web"},
            "spec": {"classRef": {"name": "c"}, "providerID": "fake:///ns/web"}
        }))
        .expect("machine");
        let idx = Machines::of([&m]);
        assert!(idx.provider_ids.contains("fake:///ns/web"));
        assert!(idx.uids.contains("uid-web"));
        assert_eq!(idx.uid_of("ns", "web"), Some("uid-web"));
        assert_eq!(idx.uid_of("ns", "db"), None);
    }

    #[test]
    fn a_vm_listed_by_several_classes_is_judged_once_with_the_first() {
        let a = |id: &str| vm(id, None, VmState::Running, None);
        let out = dedupe(vec![
            ("c1", vec![a("i-1"), a("i-2")]),
            ("c2", vec![a("i-2"), a("i-3")]),
            ("c3", vec![]),
        ]);
        let got: Vec<(&str, &str)> = out
            .iter()
            .map(|(c, v)| (*c, v.provider_id.as_str()))
            .collect();
        assert_eq!(got, [("c1", "i-1"), ("c1", "i-2"), ("c2", "i-3")]);
    }

    #[test]
    fn a_report_is_made_once_until_what_it_reports_goes_away() {
        let mut once = Once::default();
        assert!(once.first("i-1"));
        assert!(!once.first("i-1"), "twice in one round");
        once.end_round(true);
        assert!(!once.first("i-1"), "seen again next round");
        once.end_round(true);
        // A round whose lists failed did not see it: not forgotten.
        once.end_round(false);
        assert!(!once.first("i-1"));
        once.end_round(true);
        // A complete round without it forgets it: back later, reported.
        once.end_round(true);
        assert!(once.first("i-1"));
    }

    #[test]
    fn a_round_is_tallied_by_verdict() {
        let mut t = Tally::default();
        for v in [
            Verdict::Referenced,
            Verdict::MachineExists,
            Verdict::Untagged,
            Verdict::Young {
                collect_in: Duration::ZERO,
            },
            Verdict::Orphan {
                age: Duration::ZERO,
                namesake: None,
            },
        ] {
            t.count(&v);
        }
        assert_eq!(
            t,
            Tally {
                listed: 5,
                untagged: 1,
                in_use: 2,
                young: 1,
                orphans: 1,
                ..Tally::default()
            }
        );
    }
}
