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
    /// 429 with a `DisruptionBudget` cause: a PodDisruptionBudget refuses
    /// the disruption now.
    Refused { message: String },
    /// 429 without one: the API server's own flow control (API Priority
    /// and Fairness) turned the request away; no budget is involved. Retry
    /// after `retry_after`, when it says.
    Throttled {
        message: String,
        retry_after: Option<std::time::Duration>,
    },
    /// 500 because more than one PodDisruptionBudget selects the pod: the
    /// Eviction API never evicts such a pod until the budgets are fixed.
    MultipleBudgets { message: String },
    /// Anything else (network, other 5xx, 403, a webhook's refusal, a 409
    /// while the pod is still there...). Retried with backoff, and named
    /// once it keeps failing.
    Failed(kube::Error),
}

/// The `reason` of the cause the Eviction API gives when a budget refuses
/// (`policy/v1` `DisruptionBudgetCause`).
const DISRUPTION_BUDGET_CAUSE: &str = "DisruptionBudget";

/// What the Eviction API says of a pod that more than one budget selects.
const MULTIPLE_BUDGETS: &str = "more than one PodDisruptionBudget";

impl Evicted {
    /// What an error answer means, before any read: a 409 stays an error,
    /// to be settled by [`Evicted::after_conflict`].
    fn from_error(e: kube::Error) -> Result<Self, kube::Error> {
        Ok(match e {
            kube::Error::Api(s) if s.code == 409 => return Err(kube::Error::Api(s)),
            kube::Error::Api(s) if s.code == 404 => Evicted::Gone,
            kube::Error::Api(s) if s.code == 429 => {
                let details = s.details.as_ref();
                let budget = details
                    .is_some_and(|d| d.causes.iter().any(|c| c.reason == DISRUPTION_BUDGET_CAUSE));
                if budget {
                    let causes: Vec<&str> = details
                        .into_iter()
                        .flat_map(|d| &d.causes)
                        .filter(|c| c.reason == DISRUPTION_BUDGET_CAUSE && !c.message.is_empty())
                        .map(|c| c.message.as_str())
                        .collect();
                    let message = if causes.is_empty() {
                        s.message
                    } else {
                        format!("{} ({})", s.message, causes.join("; "))
                    };
                    Evicted::Refused { message }
                } else {
                    let retry_after = details
                        .map(|d| d.retry_after_seconds)
                        .filter(|s| *s > 0)
                        .map(|s| std::time::Duration::from_secs(u64::from(s)));
                    Evicted::Throttled {
                        message: s.message,
                        retry_after,
                    }
                }
            }
            kube::Error::Api(s) if s.code == 500 && s.message.contains(MULTIPLE_BUDGETS) => {
                Evicted::MultipleBudgets { message: s.message }
            }
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
        let budget = |cause: &str| {
            let mut s = kube::core::Status {
                code: 429,
                message: "Cannot evict pod as it would violate the pod's disruption budget.".into(),
                ..Default::default()
            };
            s.details = Some(kube::core::response::StatusDetails {
                name: "db-0".into(),
                group: String::new(),
                kind: "pods".into(),
                uid: String::new(),
                causes: vec![kube::core::response::StatusCause {
                    reason: cause.into(),
                    message: "The disruption budget db needs 2 healthy pods and has 1 currently"
                        .into(),
                    field: String::new(),
                }],
                retry_after_seconds: 3,
            });
            kube::Error::Api(Box::new(s))
        };
        match Evicted::from_error(budget("DisruptionBudget")) {
            Ok(Evicted::Refused { message }) => {
                assert!(message.contains("needs 2 healthy pods"), "{message}")
            }
            other => panic!("a budget's 429 is a refusal, got {other:?}"),
        }
        // A 429 of the API server's flow control names no budget.
        match Evicted::from_error(api_error(429)) {
            Ok(Evicted::Throttled { retry_after, .. }) => assert_eq!(retry_after, None),
            other => panic!("a 429 without a budget is throttling, got {other:?}"),
        }
        match Evicted::from_error(budget("SomethingElse")) {
            Ok(Evicted::Throttled { retry_after, .. }) => {
                assert_eq!(retry_after, Some(std::time::Duration::from_secs(3)))
            }
            other => panic!("a 429 without a budget is throttling, got {other:?}"),
        }
        let two = kube::Error::Api(Box::new(kube::core::Status {
            code: 500,
            message: "Internal error occurred: This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.".into(),
            ..Default::default()
        }));
        assert!(matches!(
            Evicted::from_error(two),
            Ok(Evicted::MultipleBudgets { .. })
        ));
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
