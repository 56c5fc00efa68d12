//! What berth knows of the workloads of the pods it moves, wherever it
//! reads it: [`WorkloadFacts`], which [`pod_ask`](super::pod_ask) reads a
//! pod's workload, budget and ask through, and its answers from the
//! controller's caches, for the drains and a forced deletion. `berth plan`
//! answers from the objects it lists (see
//! [`KnownWorkloads`](crate::cli::plan::KnownWorkloads)).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;

use super::{
    Availability, MOVE_GROUP_ANNOTATION, MOVE_GROUP_KIND, Workload, WorkloadTerms, availability_of,
};
use crate::cache::Caches;

/// What is known of the workloads of pods: the controller's caches, or the
/// objects `berth plan` listed.
pub trait WorkloadFacts {
    /// The owner references of ReplicaSet `name` of namespace `ns`; `None`
    /// when it is not known (the ReplicaSet is then the workload).
    fn replica_set_owners(&self, ns: &str, name: &str) -> Option<Vec<OwnerReference>>;

    /// What the object of workload `w` says of its moves; the default when
    /// it is not known.
    fn terms(&self, w: &Workload) -> WorkloadTerms;

    /// The terms of every workload object of namespace `ns` that names
    /// move group `group`.
    fn group_members(&self, ns: &str, group: &str) -> Vec<WorkloadTerms>;

    /// `terms` of workload `w` with its replicas down counted from its
    /// pods where they are known (the controller's caches), else as they
    /// are (its owner's status).
    fn counted(&self, w: &Workload, terms: WorkloadTerms) -> WorkloadTerms;

    /// The PVs of `claims` (of namespace `ns`) attached to a Node now, by
    /// their VolumeAttachments.
    fn attached(&self, ns: &str, claims: &[String]) -> Vec<String>;

    /// Whether `pod` is on a Node that serves (see
    /// [`node_serves`](super::workload::node_serves)); `true` where the
    /// Nodes are not known.
    fn on_serving_node(&self, _pod: &k8s_openapi::api::core::v1::Pod) -> bool {
        true
    }
}

impl WorkloadFacts for Caches {
    fn on_serving_node(&self, pod: &k8s_openapi::api::core::v1::Pod) -> bool {
        serves(self, pod)
    }

    fn replica_set_owners(&self, ns: &str, name: &str) -> Option<Vec<OwnerReference>> {
        self.replica_sets
            .get(&ObjectRef::new(name).within(ns))
            .map(|m| m.metadata.owner_references.clone().unwrap_or_default())
    }

    fn terms(&self, w: &Workload) -> WorkloadTerms {
        terms_in(self, w)
    }

    fn group_members(&self, ns: &str, group: &str) -> Vec<WorkloadTerms> {
        group_members(self, ns, group)
    }

    fn counted(&self, w: &Workload, terms: WorkloadTerms) -> WorkloadTerms {
        counted(self, w, terms)
    }

    fn attached(&self, ns: &str, claims: &[String]) -> Vec<String> {
        attached_now(self, ns, claims)
    }
}

/// What the object of workload `w` says of its moves (see
/// [`WorkloadTerms`]), from `caches`: a StatefulSet's or a Deployment's
/// annotations, `minReadySeconds` and availability by its status (see
/// [`counted`] for the pods' count), a ReplicaSet's annotations; a move
/// group's members' availability; nothing for other kinds (their pod
/// template alone speaks).
fn terms_in(caches: &Caches, w: &Workload) -> WorkloadTerms {
    let (name, ns) = (w.name.as_str(), w.namespace.as_str());
    let terms = match w.kind.as_str() {
        "StatefulSet" => caches
            .stateful_sets
            .get(&ObjectRef::new(name).within(ns))
            .map(|s| super::workload::stateful_set_terms(&s)),
        "Deployment" => caches
            .deployments
            .get(&ObjectRef::new(name).within(ns))
            .map(|d| super::workload::deployment_terms(&d)),
        "ReplicaSet" => caches
            .replica_sets
            .get(&ObjectRef::new(name).within(ns))
            .map(|r| super::workload::terms(&r.metadata, None)),
        MOVE_GROUP_KIND => Some(WorkloadTerms {
            availability: availability_of(&group_members(caches, ns, name)),
            ..WorkloadTerms::default()
        }),
        _ => None,
    };
    terms.unwrap_or_default()
}

/// `terms` of workload `w` (see [`terms_in`]) with its replicas down
/// counted from the pods (see [`by_pods`]): done only where a permit is
/// asked for or a move's end judged, not for every pod a pass plans (a
/// Deployment's count reads every ReplicaSet of the cache). A move group's
/// members are counted already.
fn counted(caches: &Caches, w: &Workload, terms: WorkloadTerms) -> WorkloadTerms {
    let (name, ns) = (w.name.as_str(), w.namespace.as_str());
    match w.kind.as_str() {
        "StatefulSet" => match caches.stateful_sets.get(&ObjectRef::new(name).within(ns)) {
            Some(s) => by_pods(caches, terms, &s.metadata, false),
            None => terms,
        },
        "Deployment" => match caches.deployments.get(&ObjectRef::new(name).within(ns)) {
            Some(d) => by_pods(caches, terms, &d.metadata, true),
            None => terms,
        },
        _ => terms,
    }
}

/// `terms` of the workload object `meta` with its availability counted
/// from the pod cache (see
/// [`unavailable_by_pods`](super::workload::unavailable_by_pods)):
/// the pods it controls, or, for a Deployment (`through_sets`), those of
/// the ReplicaSets it controls. Its owner's status lags the pods it counts
/// by a moment; the drain's own view of a move that just ended must not.
fn by_pods(
    caches: &Caches,
    mut terms: WorkloadTerms,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    through_sets: bool,
) -> WorkloadTerms {
    let (Some(a), Some(uid)) = (terms.availability, meta.uid.as_deref()) else {
        return terms;
    };
    let controllers: Vec<String> = if through_sets {
        caches
            .replica_sets
            .state()
            .iter()
            .filter(|rs| rs.metadata.namespace == meta.namespace)
            .filter(|rs| {
                super::workload::controller(rs.metadata.owner_references.as_deref())
                    .is_some_and(|o| o.uid == uid)
            })
            .filter_map(|rs| rs.metadata.uid.clone())
            .collect()
    } else {
        vec![uid.to_string()]
    };
    let pods: Vec<_> = controllers
        .iter()
        .flat_map(|c| caches.indexes.pods_by_controller.get(&caches.pods, c))
        .collect();
    let unavailable = super::workload::unavailable_by_pods(
        a.replicas,
        pods.iter().map(AsRef::as_ref),
        terms.min_ready,
        Timestamp::now(),
        |p| serves(caches, p),
    );
    terms.availability = Some(Availability {
        replicas: a.replicas,
        unavailable,
    });
    terms
}

/// Whether `pod` is on a Node that serves (see
/// [`node_serves`](super::workload::node_serves)), by the Node cache.
pub(crate) fn serves(caches: &Caches, pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .and_then(|n| caches.nodes.get(&ObjectRef::new(n)));
    super::workload::node_serves(node.as_deref())
}

/// The terms of every StatefulSet and Deployment of namespace `ns` whose
/// object names move group `group`.
fn group_members(caches: &Caches, ns: &str, group: &str) -> Vec<WorkloadTerms> {
    let of_group = |meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        meta.namespace.as_deref() == Some(ns)
            && meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(MOVE_GROUP_ANNOTATION))
                .is_some_and(|g| g.trim() == group)
    };
    let sets = caches
        .stateful_sets
        .state()
        .into_iter()
        .filter(|s| of_group(&s.metadata))
        .map(|s| {
            let terms = super::workload::stateful_set_terms(&s);
            by_pods(caches, terms, &s.metadata, false)
        });
    let deployments = caches
        .deployments
        .state()
        .into_iter()
        .filter(|d| of_group(&d.metadata))
        .map(|d| {
            let terms = super::workload::deployment_terms(&d);
            by_pods(caches, terms, &d.metadata, true)
        });
    sets.chain(deployments).collect()
}

/// The PVs of `claims` (of namespace `ns`) attached now, by their
/// VolumeAttachments: the attachable volumes a forced move waits for on
/// the replacement's Node.
fn attached_now(caches: &Caches, ns: &str, claims: &[String]) -> Vec<String> {
    claims
        .iter()
        .filter_map(|c| caches.pvcs.get(&ObjectRef::new(c).within(ns)))
        .filter_map(|c| c.spec.as_ref().and_then(|s| s.volume_name.clone()))
        .filter(|pv| {
            !caches
                .indexes
                .attachments_by_pv
                .get(&caches.attachments, pv)
                .is_empty()
        })
        .collect()
}
