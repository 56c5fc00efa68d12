//! A pod's workload: the object operators think in, that the move
//! [ledger](super::ledger) keeps a budget for.
//!
//! The pod's controller, followed up while the owner is known: a
//! ReplicaSet's controlling Deployment (the ReplicaSet is an implementation
//! detail of a rollout: two ReplicaSets of one Deployment are one
//! workload). A StatefulSet, a Job, a DaemonSet or any other controller is
//! the workload itself; a pod without a controller is its own workload.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use super::ledger::Workload;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
