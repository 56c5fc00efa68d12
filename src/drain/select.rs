//! Which pods on a Node the drain handles, and how.
//!
//! Every pod bound to the Node falls into exactly one [`PodClass`]. The rules
//! are tried in this order and the first that applies wins:
//!
//! 1. **Mirror**: the annotation [`MIRROR_ANNOTATION`] is present. The kubelet
//!    runs the static pod from a file and the API object only mirrors it, so
//!    it can be neither evicted nor meaningfully deleted. Skipped.
//! 2. **DaemonSet**: the controller ownerReference has kind `DaemonSet`. Its
//!    controller would put it back (DaemonSet pods tolerate the cordon), so it
//!    is left alone and ends with the VM. Only the kind is compared, as
//!    `kubectl drain` does, which also covers DaemonSet-like controllers of
//!    other API groups.
//! 3. **Skipped by rule**: the pod's drain rule
//!    ([`DRAIN_ANNOTATION`](super::rules::DRAIN_ANNOTATION) `skip`) says
//!    never to evict it: left alone, it ends with the VM, as a DaemonSet's
//!    pods do.
//! 4. **Terminal**: phase `Succeeded` or `Failed`, and not being deleted yet.
//!    The pod runs no containers and the attach/detach controller no longer
//!    counts it as using its volumes: it is deleted outright, once.
//! 5. **Terminating**: `metadata.deletionTimestamp` is set (finished pods
//!    included: deleting one again would change nothing, and doing so each
//!    pass was a request loop when a finalizer held it). Waited on, not
//!    evicted or deleted again. A pod that a finalizer holds after its grace
//!    period cannot go until someone removes the finalizer
//!    ([`held_by_finalizers`]): it is reported, and holds the drain only
//!    until the deadline plus its grace period
//!    ([`Deadline::releases`](super::deadline::Deadline::releases)).
//! 6. **Waited on to complete**: the drain rule says `wait-completed`: not
//!    evicted; the drain waits until it is terminal (then rule 4 deletes
//!    it) or gone, bounded by the deadline.
//! 7. **Evictable**: everything else; evicted through the Eviction API.
//!
//! Rules 3 and 6 and the pod's order group come from [`super::rules`].

use std::collections::BTreeSet;
use std::fmt;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;

use super::rules::Behavior;

/// The annotation the kubelet puts on the API mirror of a static pod.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// `(namespace, name)` of a namespaced object.
pub type NamespacedName = (String, String);

/// The `(namespace, name)` of a pod; a missing field (never the case for a
/// pod read from the API) is empty.
pub fn pod_key(pod: &Pod) -> NamespacedName {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// `namespace/name`, the way the report and conditions name an object.
pub fn fmt_key((namespace, name): &NamespacedName) -> String {
    format!("{namespace}/{name}")
}

/// How the drain treats one pod; see the module documentation for the rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodClass {
    /// The API mirror of a static pod: skipped.
    Mirror,
    /// Controlled by the named DaemonSet: left to end with the VM.
    DaemonSet { owner: String },
    /// Finished (`Succeeded` or `Failed`): deleted outright.
    Terminal { phase: String },
    /// Already being deleted since the given time: waited on.
    Terminating { since: Timestamp },
    /// Its drain rule says `skip`: left to end with the VM. `by`: what
    /// said so (`berth.dev/drain=skip`, `DrainRule <name>`).
    Skipped { by: String },
    /// Its drain rule says `wait-completed`: waited on until it completes.
    WaitCompleted { by: String },
    /// Evicted through the Eviction API.
    Evictable,
}

impl fmt::Display for PodClass {
    /// The human reason for the pod's treatment.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Mirror => {
                f.write_str("mirror of a static pod run by the kubelet; cannot be evicted, skipped")
            }
            Self::DaemonSet { owner } => write!(
                f,
                "managed by DaemonSet {owner}, which would recreate it; ends with the VM"
            ),
            Self::Terminal { phase } => {
                write!(f, "phase {phase}, runs no containers; deleted outright")
            }
            Self::Terminating { since } => {
                write!(
                    f,
                    "being deleted since {since}; waited on, not evicted again"
                )
            }
            Self::Skipped { by } => write!(f, "drain rule {by}: never evicted; ends with the VM"),
            Self::WaitCompleted { by } => write!(
                f,
                "drain rule {by}: never evicted; waited on until it succeeds, fails or is gone"
            ),
            Self::Evictable => f.write_str("evicted through the Eviction API"),
        }
    }
}

/// Classifies a pod by the first rule of the module documentation that
/// applies.
pub fn classify(pod: &Pod) -> PodClass {
    classify_as(pod, &super::rules::rule(pod))
}

/// [`classify`] with the pod's drain rule as the caller found it (with
/// the cluster's `DrainRule`s, see [`super::rules::rule_in`]).
pub fn classify_as(pod: &Pod, rule: &super::rules::Rule) -> PodClass {
    let meta = &pod.metadata;
    if meta
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(MIRROR_ANNOTATION))
    {
        return PodClass::Mirror;
    }
    if let Some(owner) = meta
        .owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true) && r.kind == "DaemonSet")
    {
        return PodClass::DaemonSet {
            owner: owner.name.clone(),
        };
    }
    let by = || rule.behavior_source.clone().unwrap_or_default();
    let behavior = rule.behavior;
    if behavior == Behavior::Skip {
        return PodClass::Skipped { by: by() };
    }
    if let Some(since) = &meta.deletion_timestamp {
        return PodClass::Terminating { since: since.0 };
    }
    if let Some(phase @ ("Succeeded" | "Failed")) =
        pod.status.as_ref().and_then(|s| s.phase.as_deref())
    {
        return PodClass::Terminal {
            phase: phase.to_string(),
        };
    }
    if behavior == Behavior::WaitCompleted {
        return PodClass::WaitCompleted { by: by() };
    }
    PodClass::Evictable
}

/// Whether a pod runs no containers any more (phase `Succeeded` or
/// `Failed`): the attach/detach controller no longer counts it as using
/// its volumes.
pub fn finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// The finalizers of a pod being deleted whose grace period ended by `now`
/// (its `deletionTimestamp`, which the API server sets to the deletion
/// request plus the grace period, has passed): the pod cannot go until they
/// are removed. `None` for a pod not being deleted, still within its
/// grace, or without finalizers.
pub fn held_by_finalizers(pod: &Pod, now: Timestamp) -> Option<&[String]> {
    let ends = pod.metadata.deletion_timestamp.as_ref()?.0;
    let finalizers = pod.metadata.finalizers.as_deref()?;
    (ends <= now && !finalizers.is_empty()).then_some(finalizers)
}

/// How far the controller's clock may be from the API server's: a pod's
/// `creationTimestamp` is the API server's, the cordon's time
/// ([`CORDONED_AT_ANNOTATION`](crate::api::CORDONED_AT_ANNOTATION)) the
/// controller's. The Lease makes the same assumption of synchronised clocks.
pub const CLOCK_SKEW: k8s_openapi::jiff::SignedDuration =
    k8s_openapi::jiff::SignedDuration::from_secs(1);

/// What a drain knows when it asks whether a pod on its Node came back.
#[derive(Debug, Clone, Copy)]
pub struct Arrivals<'a> {
    /// When the Node was cordoned.
    pub cordoned_at: Timestamp,
    /// The pods (by UID) the drain found on the Node before its first
    /// eviction, and the controllers of the pods it has evicted since:
    /// what settles a pod created within [`CLOCK_SKEW`] of the cordon.
    /// `None` where no drain ran (the reconciler's own count).
    pub known: Option<(&'a BTreeSet<String>, &'a BTreeSet<String>)>,
}

/// How a pod came back to a cordoned Node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Returned {
    /// The scheduler put it there: it tolerates the cordon.
    Tolerating,
    /// It was created bound to the Node (`spec.nodeName`), which bypasses
    /// the scheduler and so the cordon: a per-node controller that is not a
    /// DaemonSet (storage instance managers, operators' agents).
    BoundByName,
}

impl Returned {
    /// Why it came back, for Events.
    pub fn why(self) -> &'static str {
        match self {
            Returned::Tolerating => "it tolerates the cordon (berth.dev/terminating:NoSchedule)",
            Returned::BoundByName => {
                "it was created bound to the Node (spec.nodeName), which bypasses the scheduler and the cordon"
            }
        }
    }
}

/// Whether `pod` (whose controller is `controller`) came back to the Node
/// after it was cordoned, and how. Only a pod created after the cordon can
/// have: one created before it, however it tolerates the cordon, was there
/// all along and is evicted like any other (a replica that tolerates every
/// taint is still a replica). A pod created more than [`CLOCK_SKEW`] after
/// the cordon came back; one created within it (creation times have whole
/// seconds) came back only if the drain did not find it before its first
/// eviction and evicted a pod of the same controller since. Evicting a pod
/// that came back would only bring it back, so the drain leaves it to end
/// with the VM, as it does a DaemonSet's pods, and says so once.
pub fn came_back(pod: &Pod, controller: Option<&str>, arrivals: &Arrivals) -> Option<Returned> {
    let created = pod.metadata.creation_timestamp.as_ref()?.0;
    let surely_after = arrivals
        .cordoned_at
        .checked_add(CLOCK_SKEW)
        .is_ok_and(|t| created > t);
    let around = arrivals
        .cordoned_at
        .checked_sub(CLOCK_SKEW)
        .is_ok_and(|t| created >= t);
    let returned = surely_after
        || (around
            && arrivals.known.is_some_and(|(seen, evicted)| {
                let uid = pod.metadata.uid.as_deref().unwrap_or_default();
                !seen.contains(uid) && controller.is_some_and(|c| evicted.contains(c))
            }));
    returned.then(|| {
        if tolerates_any_cordon(pod) {
            Returned::Tolerating
        } else {
            Returned::BoundByName
        }
    })
}

/// Whether one of the pod's tolerations tolerates the cordon.
pub fn tolerates_any_cordon(pod: &Pod) -> bool {
    pod.spec
        .iter()
        .flat_map(|s| s.tolerations.iter().flatten())
        .any(crate::api::tolerates_cordon)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::fixtures::{PodFixture, pod, ts};

    fn skipped() -> PodClass {
        PodClass::Skipped {
            by: "berth.dev/drain=skip".into(),
        }
    }

    fn rule(mut p: Pod, behavior: &str) -> Pod {
        p.metadata.annotations.get_or_insert_default().insert(
            crate::drain::rules::DRAIN_ANNOTATION.into(),
            behavior.into(),
        );
        p
    }

    #[test]
    fn every_pod_falls_into_exactly_one_class() {
        let since = ts(1_000);
        let cases = [
            ("plain running pod", pod("a", "p"), PodClass::Evictable),
            ("mirror", pod("a", "p").mirror(), PodClass::Mirror),
            (
                "mirror wins over terminal",
                pod("a", "p").mirror().phase("Failed"),
                PodClass::Mirror,
            ),
            (
                "daemonset controller",
                pod("a", "p").owned_by("DaemonSet", "fluentd", true),
                PodClass::DaemonSet {
                    owner: "fluentd".into(),
                },
            ),
            (
                "daemonset wins over terminating",
                pod("a", "p")
                    .owned_by("DaemonSet", "fluentd", true)
                    .deleting(since),
                PodClass::DaemonSet {
                    owner: "fluentd".into(),
                },
            ),
            (
                "daemonset owner that is not the controller",
                pod("a", "p").owned_by("DaemonSet", "fluentd", false),
                PodClass::Evictable,
            ),
            (
                "replicaset controller",
                pod("a", "p").owned_by("ReplicaSet", "web-5d9", true),
                PodClass::Evictable,
            ),
            (
                "succeeded",
                pod("a", "p").phase("Succeeded"),
                PodClass::Terminal {
                    phase: "Succeeded".into(),
                },
            ),
            (
                "failed",
                pod("a", "p").phase("Failed"),
                PodClass::Terminal {
                    phase: "Failed".into(),
                },
            ),
            (
                "a finished pod being deleted is not deleted again",
                pod("a", "p").phase("Succeeded").deleting(since),
                PodClass::Terminating { since },
            ),
            (
                "pending pod",
                pod("a", "p").phase("Pending"),
                PodClass::Evictable,
            ),
            (
                "terminating",
                pod("a", "p").deleting(since),
                PodClass::Terminating { since },
            ),
            ("skip rule", rule(pod("a", "p"), "skip"), skipped()),
            (
                "skip rule wins over terminal and terminating",
                rule(pod("a", "p"), "skip").phase("Failed").deleting(since),
                skipped(),
            ),
            (
                "daemonset wins over a skip rule",
                rule(pod("a", "p"), "skip").owned_by("DaemonSet", "fluentd", true),
                PodClass::DaemonSet {
                    owner: "fluentd".into(),
                },
            ),
            (
                "wait-completed rule",
                rule(pod("a", "p"), "wait-completed"),
                PodClass::WaitCompleted {
                    by: "berth.dev/drain=wait-completed".into(),
                },
            ),
            (
                "a pod waited on that completed is deleted outright",
                rule(pod("a", "p"), "wait-completed").phase("Succeeded"),
                PodClass::Terminal {
                    phase: "Succeeded".into(),
                },
            ),
            (
                "a pod waited on that is being deleted is waited on as such",
                rule(pod("a", "p"), "wait-completed").deleting(since),
                PodClass::Terminating { since },
            ),
            (
                "a rule not understood is the default",
                rule(pod("a", "p"), "maybe"),
                PodClass::Evictable,
            ),
        ];
        for (what, pod, want) in cases {
            assert_eq!(classify(&pod), want, "{what}");
        }
    }

    #[test]
    fn a_pod_is_held_by_its_finalizers_only_after_its_grace_period() {
        let held = |p: &Pod, now| held_by_finalizers(p, ts(now)).map(<[String]>::to_vec);
        let mut p = pod("a", "p").deleting(ts(100));
        assert_eq!(held(&p, 200), None, "no finalizers: it goes");
        p.metadata.finalizers = Some(vec!["example.com/keep".into()]);
        assert_eq!(held(&p, 99), None, "still within its grace");
        assert_eq!(held(&p, 100), Some(vec!["example.com/keep".to_string()]));
        let mut running = pod("a", "q");
        running.metadata.finalizers = Some(vec!["example.com/keep".into()]);
        assert_eq!(held(&running, 200), None, "not being deleted");
        assert!(finished(&pod("a", "p").phase("Failed")));
        assert!(!finished(&pod("a", "p").phase("Running")));
    }

    #[test]
    fn only_a_pod_created_after_the_cordon_came_back() {
        let tolerating = k8s_openapi::api::core::v1::Toleration {
            operator: Some("Exists".into()),
            ..Default::default()
        };
        let at = |secs: i64, uid: &str| {
            let mut p = pod("a", "db-1").uid(uid);
            p.metadata.creation_timestamp = Some(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(ts(secs)),
            );
            p
        };
        let tolerant = |mut p: Pod| {
            p.spec.get_or_insert_default().tolerations = Some(vec![tolerating.clone()]);
            p
        };
        let cordon = ts(100);
        let none = Arrivals {
            cordoned_at: cordon,
            known: None,
        };
        // A replica that tolerates every taint and ran there all along is
        // evicted like any other, whatever else the drain evicted.
        let seen: BTreeSet<String> = ["u-old".to_string()].into();
        let evicted: BTreeSet<String> = ["StatefulSet/db".to_string()].into();
        let known = Arrivals {
            cordoned_at: cordon,
            known: Some((&seen, &evicted)),
        };
        let sts = Some("StatefulSet/db");
        assert_eq!(came_back(&tolerant(at(50, "u-old")), sts, &known), None);
        assert_eq!(came_back(&tolerant(at(50, "u-x")), sts, &known), None);
        // Created after the cordon (beyond the clock skew): it came back,
        // by the scheduler or bound by name.
        assert_eq!(
            came_back(&tolerant(at(102, "u-new")), sts, &none),
            Some(Returned::Tolerating)
        );
        assert_eq!(
            came_back(&at(102, "u-new"), Some("ConfigMap/mgr"), &none),
            Some(Returned::BoundByName)
        );
        // Within the skew of the cordon: only a pod the drain did not find
        // before its first eviction, of a controller it evicted from.
        assert_eq!(came_back(&tolerant(at(100, "u-new")), sts, &none), None);
        assert_eq!(
            came_back(&tolerant(at(100, "u-new")), sts, &known),
            Some(Returned::Tolerating)
        );
        assert_eq!(
            came_back(&tolerant(at(101, "u-old")), sts, &known),
            None,
            "found before the first eviction"
        );
        assert_eq!(
            came_back(
                &tolerant(at(100, "u-new")),
                Some("StatefulSet/other"),
                &known
            ),
            None,
            "nothing of its controller was evicted"
        );
        assert_eq!(
            came_back(&tolerant(at(98, "u-new")), sts, &known),
            None,
            "created before the cordon and its skew"
        );
    }

    #[test]
    fn reasons_say_what_happens() {
        let cases = [
            (PodClass::Mirror, "static pod"),
            (
                PodClass::DaemonSet {
                    owner: "fluentd".into(),
                },
                "DaemonSet fluentd",
            ),
            (
                PodClass::Terminal {
                    phase: "Failed".into(),
                },
                "phase Failed, runs no containers; deleted outright",
            ),
            (
                PodClass::Terminating { since: ts(0) },
                "being deleted since 1970-01-01T00:00:00Z; waited on",
            ),
            (PodClass::Evictable, "Eviction API"),
            (
                skipped(),
                "drain rule berth.dev/drain=skip: never evicted; ends with the VM",
            ),
            (
                PodClass::WaitCompleted {
                    by: "DrainRule batch (WaitCompleted)".into(),
                },
                "drain rule DrainRule batch (WaitCompleted): never evicted; waited on until it succeeds, fails or is gone",
            ),
        ];
        for (class, want) in cases {
            let got = class.to_string();
            assert!(got.contains(want), "{got:?} should contain {want:?}");
        }
    }

    #[test]
    fn keys_name_namespace_then_pod() {
        let key = pod_key(&pod("db", "pg-0"));
        assert_eq!(key, ("db".to_string(), "pg-0".to_string()));
        assert_eq!(fmt_key(&key), "db/pg-0");
        assert_eq!(pod_key(&Pod::default()), (String::new(), String::new()));
    }
}
