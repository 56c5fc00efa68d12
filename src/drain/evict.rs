//! The writes of a drain: evicting a pod through the `policy/v1` Eviction
//! subresource and deleting one outright, each pinned to the pod's UID so
//! that a replacement that took the same name (a StatefulSet pod) is never
//! touched.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, EvictParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};

/// What one eviction request did.
#[derive(Debug)]
pub enum Evicted {
    /// The API server accepted the eviction: the pod is terminating.
    Accepted,
    /// The pod (this UID) no longer exists: 404, or 409 because the name
    /// now belongs to a replacement.
    Gone,
    /// 429: a PodDisruptionBudget refuses the disruption now.
    Refused { message: String },
    /// Anything else (network, 5xx, 403...). Retried with backoff.
    Failed(kube::Error),
}

impl Evicted {
    fn from_error(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) if s.code == 404 || s.code == 409 => Evicted::Gone,
            kube::Error::Api(s) if s.code == 429 => Evicted::Refused { message: s.message },
            other => Evicted::Failed(other),
        }
    }
}

fn uid_only(pod: &Pod, grace_seconds: Option<u32>) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            uid: pod.uid(),
            resource_version: None,
        }),
        grace_period_seconds: grace_seconds,
        ..DeleteParams::default()
    }
}

/// Asks the API server to evict `pod`, honouring PodDisruptionBudgets and
/// the pod's own grace period.
pub async fn evict(client: &Client, pod: &Pod) -> Evicted {
    let Some(ns) = pod.namespace() else {
        return Evicted::Gone;
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let params = EvictParams {
        delete_options: Some(uid_only(pod, None)),
        post_options: PostParams::default(),
    };
    match api.evict(&pod.name_any(), &params).await {
        Ok(_) => Evicted::Accepted,
        Err(e) => Evicted::from_error(e),
    }
}

/// Deletes `pod` without asking its PodDisruptionBudgets: with the pod's
/// grace period (`grace = None`) or at once (`Some(0)`, a force delete).
pub async fn delete(client: &Client, pod: &Pod, grace: Option<u32>) -> Evicted {
    let Some(ns) = pod.namespace() else {
        return Evicted::Gone;
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    match api.delete(&pod.name_any(), &uid_only(pod, grace)).await {
        Ok(_) => Evicted::Accepted,
        Err(e) => Evicted::from_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            message: format!("status {code}"),
            ..Default::default()
        }))
    }

    #[test]
    fn responses_are_classified() {
        assert!(matches!(Evicted::from_error(api_error(404)), Evicted::Gone));
        assert!(
            matches!(Evicted::from_error(api_error(409)), Evicted::Gone),
            "a UID precondition failure means our pod is gone"
        );
        match Evicted::from_error(api_error(429)) {
            Evicted::Refused { message } => assert_eq!(message, "status 429"),
            other => panic!("429 is a refusal, got {other:?}"),
        }
        assert!(matches!(
            Evicted::from_error(api_error(500)),
            Evicted::Failed(_)
        ));
        assert!(matches!(
            Evicted::from_error(api_error(403)),
            Evicted::Failed(_)
        ));
    }

    #[test]
    fn writes_are_pinned_to_the_uid() {
        let mut pod = Pod::default();
        pod.metadata.uid = Some("u-1".into());
        let p = uid_only(&pod, Some(0));
        assert_eq!(p.preconditions.and_then(|p| p.uid).as_deref(), Some("u-1"));
        assert_eq!(p.grace_period_seconds, Some(0));
    }
}
