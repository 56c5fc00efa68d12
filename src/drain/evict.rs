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
    /// The pod (this UID) no longer exists: 404, or 409 and a read shows
    /// the name gone or taken by a replacement.
    Gone,
    /// 429: a PodDisruptionBudget refuses the disruption now.
    Refused { message: String },
    /// Anything else (network, 5xx, 403, a 409 while the pod is still
    /// there...). Retried with backoff.
    Failed(kube::Error),
}

impl Evicted {
    /// What an error answer means, before any read: a 409 stays an error,
    /// to be settled by [`Evicted::after_conflict`].
    fn from_error(e: kube::Error) -> Result<Self, kube::Error> {
        Ok(match e {
            kube::Error::Api(s) if s.code == 409 => return Err(kube::Error::Api(s)),
            kube::Error::Api(s) if s.code == 404 => Evicted::Gone,
            kube::Error::Api(s) if s.code == 429 => Evicted::Refused { message: s.message },
            other => Evicted::Failed(other),
        })
    }

    /// A 409 Conflict means the UID precondition failed (the pod is gone
    /// and its name perhaps taken by a replacement), or that the write
    /// raced another (a PodDisruptionBudget's status updated by two
    /// evictions at once): `current`, the pod read after it, tells which.
    fn after_conflict(pod: &Pod, current: Option<&Pod>, conflict: kube::Error) -> Self {
        match current {
            Some(c) if c.metadata.uid == pod.metadata.uid => Evicted::Failed(conflict),
            _ => Evicted::Gone,
        }
    }
}

/// Settles an error answer about `pod`: a 409 by reading the pod once.
async fn settle(api: &Api<Pod>, pod: &Pod, e: kube::Error) -> Evicted {
    let conflict = match Evicted::from_error(e) {
        Ok(settled) => return settled,
        Err(conflict) => conflict,
    };
    match api.get_opt(&pod.name_any()).await {
        Ok(current) => Evicted::after_conflict(pod, current.as_ref(), conflict),
        Err(read) => Evicted::Failed(read),
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
        Err(e) => settle(&api, pod, e).await,
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
        Err(e) => settle(&api, pod, e).await,
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
        assert!(matches!(
            Evicted::from_error(api_error(404)),
            Ok(Evicted::Gone)
        ));
        assert!(
            Evicted::from_error(api_error(409)).is_err(),
            "a 409 is settled by reading the pod"
        );
        match Evicted::from_error(api_error(429)) {
            Ok(Evicted::Refused { message }) => assert_eq!(message, "status 429"),
            other => panic!("429 is a refusal, got {other:?}"),
        }
        assert!(matches!(
            Evicted::from_error(api_error(500)),
            Ok(Evicted::Failed(_))
        ));
        assert!(matches!(
            Evicted::from_error(api_error(403)),
            Ok(Evicted::Failed(_))
        ));
    }

    #[test]
    fn a_conflict_means_gone_only_when_the_pod_is() {
        let with_uid = |uid: &str| {
            let mut p = Pod::default();
            p.metadata.uid = Some(uid.into());
            p
        };
        let ours = with_uid("u-1");
        let cases = [
            (None, true, "the pod is gone"),
            (Some(with_uid("u-2")), true, "a replacement took the name"),
            (Some(with_uid("u-1")), false, "our pod is still there"),
        ];
        for (current, gone, what) in cases {
            let e = Evicted::after_conflict(&ours, current.as_ref(), api_error(409));
            assert_eq!(matches!(e, Evicted::Gone), gone, "{what}: {e:?}");
            assert_eq!(matches!(e, Evicted::Failed(_)), !gone, "{what}: {e:?}");
        }
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
