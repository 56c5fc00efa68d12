//! A pod's workload: the object operators think in, that the move
//! [ledger](super) keeps a budget for.
//!
//! The pod's controller, followed up while the owner is known: a
//! ReplicaSet's controlling Deployment (the ReplicaSet is an implementation
//! detail of a rollout: two ReplicaSets of one Deployment are one
//! workload). A StatefulSet, a Job, a DaemonSet or any other controller is
//! the workload itself; a pod without a controller is its own workload.

use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::{Availability, Workload, WorkloadTerms};

/// The controller reference among `owners`.
pub fn controller(owners: Option<&[OwnerReference]>) -> Option<&OwnerReference> {
    owners?.iter().find(|o| o.controller == Some(true))
}

/// The workload of `pod`. `owners_of_replica_set` gives the owner
/// references of a ReplicaSet of the pod's namespace by name (from a cache
/// of ReplicaSets' metadata), `None` when it is not known: the ReplicaSet
/// is then the workload.
pub fn workload_of<'a>(
    pod: &Pod,
    owners_of_replica_set: impl Fn(&str) -> Option<Vec<OwnerReference>> + 'a,
) -> Workload {
    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    let Some(c) = controller(pod.metadata.owner_references.as_deref()) else {
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        return Workload::new("Pod", ns, name);
    };
    if c.kind == "ReplicaSet"
        && c.api_version.starts_with("apps/")
        && let Some(owners) = owners_of_replica_set(&c.name)
        && let Some(d) = controller(Some(&owners))
    {
        return Workload::new(&d.kind, ns, &d.name);
    }
    Workload::new(&c.kind, ns, &c.name)
}

/// The owner reference of the workload of `pod` (see [`workload_of`]):
/// its controller, or a ReplicaSet's controlling Deployment; `None` for a
/// pod without a controller (it is its own workload).
pub fn workload_owner(
    pod: &Pod,
    owners_of_replica_set: impl Fn(&str) -> Option<Vec<OwnerReference>>,
) -> Option<OwnerReference> {
    let c = controller(pod.metadata.owner_references.as_deref())?;
    if c.kind == "ReplicaSet"
        && c.api_version.starts_with("apps/")
        && let Some(owners) = owners_of_replica_set(&c.name)
        && let Some(d) = controller(Some(&owners))
    {
        return Some(d.clone());
    }
    Some(c.clone())
}

/// How many of a workload's replicas are unavailable by its `pods` (those
/// of its controllers) as the drain's own cache sees them: of the
/// `replicas` it wants, those without a pod that is Ready for at least
/// `min_ready` at `now`, not being deleted, and on a Node that `serves`
/// (see [`node_serves`]). The owner's status says the same a moment later:
/// read from the pods, the count agrees with the drain's own view of a
/// move that just ended.
pub fn unavailable_by_pods<'p>(
    replicas: u32,
    pods: impl IntoIterator<Item = &'p Pod>,
    min_ready: Duration,
    now: k8s_openapi::jiff::Timestamp,
    serves: impl Fn(&Pod) -> bool,
) -> u32 {
    let min = k8s_openapi::jiff::SignedDuration::try_from(min_ready)
        .unwrap_or(k8s_openapi::jiff::SignedDuration::MAX);
    let available = pods
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| serves(p))
        .filter_map(super::ready_since)
        .filter(|since| since.checked_add(min).is_ok_and(|at| at <= now))
        .count();
    replicas.saturating_sub(u32::try_from(available).unwrap_or(u32::MAX))
}

/// Whether a pod on `node` (`None`: no such Node, or none named) can be
/// serving, whatever its own Ready condition still says: the Node is there,
/// its Ready condition is `True`, and it is not tainted out of service or
/// unreachable. A kubelet that stopped answering leaves its pods Ready
/// until the node lifecycle controller marks them (tens of seconds), while
/// nothing serves: a replica there is down already, and the ledger must
/// count it so before it lets another replica of the workload go.
pub fn node_serves(node: Option<&Node>) -> bool {
    let Some(node) = node else {
        return false;
    };
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True");
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| NODE_DOWN_TAINTS.contains(&t.key.as_str())));
    ready && !tainted
}

/// Taints that say a Node's pods are not serving: its VM is gone or fenced
/// (`out-of-service`), or the node lifecycle controller lost its kubelet
/// (`unreachable`, `not-ready`).
const NODE_DOWN_TAINTS: [&str; 3] = [
    "node.kubernetes.io/out-of-service",
    "node.kubernetes.io/unreachable",
    "node.kubernetes.io/not-ready",
];

/// Whether StatefulSet `sts` still wants pod `pod` (a name of its,
/// `<sts>-<ordinal>`): its ordinal is within the replicas it wants now
/// (from `spec.ordinals.start`, 0 by default). `None` when the name is not
/// one of its pods'.
///
/// An `OrderedReady` StatefulSet (the default) recreates a pod only once
/// every pod before it is Ready, which can take longer than any fixed
/// wait: what it wants, not how soon it acts, says whether a replacement
/// is coming.
pub fn wants_ordinal(sts: &StatefulSet, pod: &str) -> Option<bool> {
    let name = sts.metadata.name.as_deref()?;
    let ordinal: i64 = pod.strip_prefix(name)?.strip_prefix('-')?.parse().ok()?;
    let spec = &sts.spec;
    let start = spec
        .ordinals
        .as_ref()
        .and_then(|o| o.start)
        .map_or(0, i64::from);
    let replicas = spec.replicas.map_or(1, i64::from);
    Some(ordinal >= start && ordinal < start + replicas)
}

/// What a workload object's `meta` and `minReadySeconds` say of its
/// moves (see [`WorkloadTerms`]).
pub fn terms(meta: &ObjectMeta, min_ready_seconds: Option<i32>) -> WorkloadTerms {
    WorkloadTerms {
        annotations: meta.annotations.clone().unwrap_or_default(),
        min_ready: Duration::from_secs(
            min_ready_seconds.map_or(0, |s| u64::try_from(s).unwrap_or(0)),
        ),
        availability: None,
        max_unavailable: None,
    }
}

/// The replicas a workload wants (`spec.replicas`, 1 when unset) and how
/// many of them are not available by its status (`availableReplicas`);
/// `None` without a status, which its controller has not written yet.
fn availability(replicas: Option<i32>, available: Option<Option<i32>>) -> Option<Availability> {
    let available = available?;
    let replicas = u32::try_from(replicas.unwrap_or(1)).unwrap_or(0);
    let available = u32::try_from(available.unwrap_or(0)).unwrap_or(0);
    Some(Availability {
        replicas,
        unavailable: replicas.saturating_sub(available),
    })
}

/// The terms of a StatefulSet.
pub fn stateful_set_terms(sts: &StatefulSet) -> WorkloadTerms {
    WorkloadTerms {
        availability: availability(
            sts.spec.replicas,
            sts.status.as_ref().map(|s| s.available_replicas),
        ),
        max_unavailable: stateful_set_max_unavailable(sts),
        ..terms(&sts.metadata, sts.spec.min_ready_seconds)
    }
}

/// How many of its replicas StatefulSet `sts` lets its rolling update take
/// down at once, when its owner set `rollingUpdate.maxUnavailable`: a
/// whole number, or a percentage of `spec.replicas` (1 when unset) rounded
/// down and at least 1, as the StatefulSet controller reckons it
/// (`getStatefulSetMaxUnavailable`). `None` when it is not set, or is not
/// a number nor a percentage (the API server refuses both, and the
/// controller then takes one at a time).
pub fn stateful_set_max_unavailable(sts: &StatefulSet) -> Option<u32> {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let value = sts
        .spec
        .update_strategy
        .as_ref()?
        .rolling_update
        .as_ref()?
        .max_unavailable
        .as_ref()?;
    let n = match value {
        IntOrString::Int(n) => i64::from(*n),
        IntOrString::String(s) => {
            let percent: i64 = s.strip_suffix('%')?.parse().ok()?;
            let replicas = i64::from(sts.spec.replicas.unwrap_or(1));
            // Floor, in integers: the controller's float floor of
            // percent × replicas / 100 for the sizes a StatefulSet has.
            (percent * replicas).div_euclid(100)
        }
    };
    Some(u32::try_from(n.max(1)).unwrap_or(u32::MAX))
}

/// The terms of a Deployment.
pub fn deployment_terms(d: &Deployment) -> WorkloadTerms {
    WorkloadTerms {
        availability: availability(
            d.spec.replicas,
            d.status.as_ref().map(|s| s.available_replicas),
        ),
        ..terms(&d.metadata, d.spec.min_ready_seconds)
    }
}

/// Since when the replacement of an evicted pod has been Ready, if one is:
/// the earliest Ready of the workload's `pods` (those of its controller)
/// that are not the evicted pod (`uid`), not on its Node `node` when it is
/// known (a pod that came back to a cordoned Node replaces nothing), not
/// being deleted, and created no sooner than the eviction (`evicted_at`;
/// creation timestamps have whole seconds).
pub fn replacement_ready_since<'p>(
    pods: impl IntoIterator<Item = &'p Pod>,
    uid: &str,
    node: Option<&str>,
    evicted_at: k8s_openapi::jiff::Timestamp,
) -> Option<k8s_openapi::jiff::Timestamp> {
    let from = evicted_at
        .round(k8s_openapi::jiff::Unit::Second)
        .ok()?
        .checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(1))
        .ok()?;
    pods.into_iter()
        .filter(|p| p.metadata.uid.as_deref() != Some(uid))
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| node.is_none() || p.spec.as_ref().and_then(|s| s.node_name.as_deref()) != node)
        .filter(|p| {
            p.metadata
                .creation_timestamp
                .as_ref()
                .is_some_and(|t| t.0 >= from)
        })
        .filter_map(super::ready_since)
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_are_available_once_ready_long_enough_and_not_going() {
        let now: k8s_openapi::jiff::Timestamp = "2026-11-26T12:00:30Z".parse().expect("time");
        let pod = |ready: Option<&str>, deleting: bool| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {
                    "name": "p",
                    "deletionTimestamp": deleting.then_some("2026-11-26T12:00:29Z"),
                },
                "status": {"conditions": [{
                    "type": "Ready",
                    "status": if ready.is_some() { "True" } else { "False" },
                    "lastTransitionTime": ready.unwrap_or("2026-11-26T12:00:00Z"),
                }]}
            }))
            .expect("a pod")
        };
        let pods = [
            pod(Some("2026-11-26T12:00:00Z"), false),
            pod(Some("2026-11-26T12:00:25Z"), false),
            pod(None, false),
            pod(Some("2026-11-26T12:00:00Z"), true),
        ];
        // Three wanted: two Ready and not going, one not Ready, one going.
        assert_eq!(
            unavailable_by_pods(3, &pods, Duration::ZERO, now, |_| true),
            1
        );
        // Ready for 10 s at least: the one Ready for 5 s is not yet.
        assert_eq!(
            unavailable_by_pods(3, &pods, Duration::from_secs(10), now, |_| true),
            2
        );
        // A replica with no pod at all is unavailable too.
        assert_eq!(
            unavailable_by_pods(4, &pods, Duration::ZERO, now, |_| true),
            2
        );
        assert_eq!(
            unavailable_by_pods(1, &pods, Duration::ZERO, now, |_| true),
            0
        );
        // A Ready pod on a Node that does not serve is down: here the
        // first (Ready since 12:00:00).
        let first = |p: &Pod| std::ptr::eq(p, &pods[0]);
        assert_eq!(
            unavailable_by_pods(3, &pods, Duration::ZERO, now, |p| !first(p)),
            2
        );
    }

    #[test]
    fn a_node_serves_only_ready_there_and_untainted() {
        let node = |ready: &str, taint: Option<&str>| -> Node {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "n"},
                "spec": {"taints": taint.map(|k| vec![serde_json::json!({"key": k, "effect": "NoExecute"})])},
                "status": {"conditions": [{"type": "Ready", "status": ready}]},
            }))
            .expect("a node")
        };
        assert!(node_serves(Some(&node("True", None))));
        assert!(node_serves(Some(&node("True", Some("dedicated")))));
        assert!(!node_serves(Some(&node("False", None))));
        assert!(!node_serves(Some(&node("Unknown", None))));
        assert!(!node_serves(Some(&node(
            "True",
            Some("node.kubernetes.io/out-of-service")
        ))));
        assert!(!node_serves(Some(&node(
            "True",
            Some("node.kubernetes.io/unreachable")
        ))));
        // A Node object gone (or never there): nothing serves on it.
        assert!(!node_serves(None));
    }

    fn owner(kind: &str, api_version: &str, name: &str) -> OwnerReference {
        OwnerReference {
            api_version: api_version.into(),
            kind: kind.into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            controller: Some(true),
            block_owner_deletion: None,
        }
    }

    fn pod(owners: Vec<OwnerReference>) -> Pod {
        let mut p = Pod::default();
        p.metadata.namespace = Some("ns".into());
        p.metadata.name = Some("p".into());
        p.metadata.owner_references = Some(owners);
        p
    }

    #[test]
    fn a_replica_set_is_followed_up_to_its_deployment() {
        let p = pod(vec![owner("ReplicaSet", "apps/v1", "web-7d9f")]);
        let known =
            |name: &str| (name == "web-7d9f").then(|| vec![owner("Deployment", "apps/v1", "web")]);
        assert_eq!(
            workload_of(&p, known),
            Workload::new("Deployment", "ns", "web")
        );
        // Not in the cache, or without a controller: the ReplicaSet.
        assert_eq!(
            workload_of(&p, |_| None),
            Workload::new("ReplicaSet", "ns", "web-7d9f")
        );
        assert_eq!(
            workload_of(&p, |_| Some(Vec::new())),
            Workload::new("ReplicaSet", "ns", "web-7d9f")
        );
    }

    #[test]
    fn a_stateful_set_wants_the_ordinals_within_its_replicas() {
        let sts = |replicas: Option<i32>, start: Option<i32>| -> StatefulSet {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "db"},
                "spec": {"replicas": replicas, "ordinals": {"start": start},
                    "selector": {}, "serviceName": "db", "template": {}}
            }))
            .expect("a StatefulSet")
        };
        assert_eq!(wants_ordinal(&sts(Some(3), None), "db-2"), Some(true));
        assert_eq!(
            wants_ordinal(&sts(Some(2), None), "db-2"),
            Some(false),
            "scaled down"
        );
        assert_eq!(
            wants_ordinal(&sts(None, None), "db-0"),
            Some(true),
            "replicas default to 1"
        );
        assert_eq!(wants_ordinal(&sts(Some(2), Some(5)), "db-6"), Some(true));
        assert_eq!(wants_ordinal(&sts(Some(2), Some(5)), "db-1"), Some(false));
        assert_eq!(
            wants_ordinal(&sts(Some(2), None), "dbx-1"),
            None,
            "not its pod"
        );
        assert_eq!(wants_ordinal(&sts(Some(2), None), "db-a"), None);
    }

    #[test]
    fn other_controllers_are_the_workload_and_a_bare_pod_is_its_own() {
        let sts = pod(vec![owner("StatefulSet", "apps/v1", "db")]);
        assert_eq!(
            workload_of(&sts, |_| panic!("only ReplicaSets are followed")),
            Workload::new("StatefulSet", "ns", "db")
        );
        let mut not_controller = owner("StatefulSet", "apps/v1", "db");
        not_controller.controller = None;
        assert_eq!(
            workload_of(&pod(vec![not_controller]), |_| None),
            Workload::new("Pod", "ns", "p")
        );
        let custom = pod(vec![owner("Cluster", "postgres.example/v1", "pg")]);
        assert_eq!(
            workload_of(&custom, |_| None),
            Workload::new("Cluster", "ns", "pg")
        );
    }

    #[test]
    fn a_stateful_sets_max_unavailable_is_reckoned_as_its_controller_does() {
        let sts = |replicas: Option<i32>, max: serde_json::Value| -> StatefulSet {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "db"},
                "spec": {"replicas": replicas, "selector": {}, "serviceName": "db", "template": {},
                    "updateStrategy": {"type": "RollingUpdate",
                        "rollingUpdate": {"maxUnavailable": max}}}
            }))
            .expect("a StatefulSet")
        };
        let cases: [(Option<i32>, serde_json::Value, Option<u32>); 10] = [
            (Some(5), serde_json::json!(2), Some(2)),
            (Some(5), serde_json::json!(1), Some(1)),
            // A percentage of the replicas, rounded down...
            (Some(5), serde_json::json!("50%"), Some(2)),
            (Some(3), serde_json::json!("67%"), Some(2)),
            (Some(10), serde_json::json!("25%"), Some(2)),
            // ... but never below one.
            (Some(3), serde_json::json!("10%"), Some(1)),
            (None, serde_json::json!("100%"), Some(1)),
            (Some(4), serde_json::json!("100%"), Some(4)),
            // Neither a number nor a percentage: not the controller's.
            (Some(4), serde_json::json!("2"), None),
            (Some(4), serde_json::json!(null), None),
        ];
        for (replicas, max, want) in cases {
            assert_eq!(
                stateful_set_max_unavailable(&sts(replicas, max.clone())),
                want,
                "replicas {replicas:?}, maxUnavailable {max}"
            );
        }
        let on_delete: StatefulSet = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "db"},
            "spec": {"replicas": 3, "selector": {}, "serviceName": "db", "template": {},
                "updateStrategy": {"type": "OnDelete"}}
        }))
        .expect("a StatefulSet");
        assert_eq!(stateful_set_max_unavailable(&on_delete), None);
        assert_eq!(
            stateful_set_terms(&sts(Some(6), serde_json::json!("50%"))).max_unavailable,
            Some(3)
        );
    }

    #[test]
    fn a_workload_object_gives_its_annotations_and_min_ready_seconds() {
        let sts: StatefulSet = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "db", "annotations": {"berth.dev/max-moving": "2"}},
            "spec": {"minReadySeconds": 30, "selector": {}, "serviceName": "db", "template": {}}
        }))
        .expect("a StatefulSet");
        let t = stateful_set_terms(&sts);
        assert_eq!(t.min_ready, Duration::from_secs(30));
        assert_eq!(
            t.annotations
                .get("berth.dev/max-moving")
                .map(String::as_str),
            Some("2")
        );
        let d: Deployment = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web"},
            "spec": {"minReadySeconds": -1, "selector": {}, "template": {}}
        }))
        .expect("a Deployment");
        assert_eq!(deployment_terms(&d), WorkloadTerms::default());
    }

    #[test]
    fn the_replacement_is_a_new_pod_of_the_workload_elsewhere() {
        use k8s_openapi::jiff::Timestamp;
        let at = |s: i64| Timestamp::from_second(1_700_000_000 + s).expect("a time");
        let p = |uid: &str, node: &str, created: i64, ready: Option<i64>, deleting: bool| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": uid, "uid": uid, "creationTimestamp": at(created).to_string(),
                    "deletionTimestamp": deleting.then(|| at(created + 1).to_string())},
                "spec": {"nodeName": node, "containers": []},
                "status": {"conditions": ready.map(|r| vec![serde_json::json!(
                    {"type": "Ready", "status": "True", "lastTransitionTime": at(r).to_string()})])}
            }))
            .expect("a pod")
        };
        let evicted = at(10);
        let pods = [
            p("old", "a", 0, Some(1), false),
            p("older-elsewhere", "b", 0, Some(2), false),
            p("back-on-a", "a", 11, Some(12), false),
            p("going", "c", 11, Some(12), true),
            p("new-not-ready", "c", 11, None, false),
        ];
        assert_eq!(
            replacement_ready_since(&pods, "old", Some("a"), evicted),
            None,
            "a pod from before, one back on the cordoned Node, one being deleted and one not Ready replace nothing"
        );
        let mut more = pods.to_vec();
        more.push(p("new", "c", 10, Some(14), false));
        more.push(p("newer", "d", 12, Some(13), false));
        assert_eq!(
            replacement_ready_since(&more, "old", Some("a"), evicted),
            Some(at(13)),
            "the earliest Ready of the new pods elsewhere"
        );
        assert_eq!(
            replacement_ready_since(&pods, "old", None, evicted),
            Some(at(12)),
            "with the Node gone, a new pod anywhere replaces it"
        );
    }
}
