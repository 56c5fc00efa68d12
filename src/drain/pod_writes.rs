//! The drain's writes to pods: evicting a pod through the `policy/v1`
//! Eviction subresource and deleting one outright, each pinned to the
//! pod's UID so that a replacement that took the same name (a StatefulSet
//! pod) is never touched.
//!
//! The eviction is sent by hand rather than by kube's `Api::evict`, for
//! two reasons. That call puts the delete options under the key
//! `delete_options`, which the API server does not know and drops (with a
//! warning), so the UID precondition would never apply and a replacement
//! that took the name would be evicted in its predecessor's place. And its
//! errors drop the response's headers, where the API server's own flow
//! control (API Priority and Fairness) puts its `Retry-After`: that 429 has
//! a plain-text body, not a `Status`.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Preconditions};
use kube::client::Body;
use kube::core::Status;
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
    /// to be settled by [`Evicted::after_conflict`]. `retry_after` is the
    /// response's `Retry-After` header, if it had one: the pause of a 429
    /// whose body does not give one.
    fn from_error(e: kube::Error, retry_after: Option<Duration>) -> Result<Self, kube::Error> {
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
                        .map(|s| Duration::from_secs(u64::from(s)))
                        .or(retry_after);
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
async fn settle(
    api: &Api<Pod>,
    pod: &Pod,
    e: kube::Error,
    retry_after: Option<Duration>,
) -> Evicted {
    let conflict = match Evicted::from_error(e, retry_after) {
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
/// the pod's own grace period; only this pod (this UID).
pub async fn evict(client: &Client, pod: &Pod) -> Evicted {
    let Some(ns) = pod.namespace() else {
        return Evicted::Gone;
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let request = match eviction_request(&ns, pod) {
        Ok(r) => r,
        Err(e) => return Evicted::Failed(e),
    };
    let response = match client.send(request.map(Body::from)).await {
        Ok(r) => r,
        Err(e) => return settle(&api, pod, e, None).await,
    };
    let code = response.status();
    if code.is_success() {
        return Evicted::Accepted;
    }
    let retry_after = response
        .headers()
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(retry_after_seconds);
    let body = match response.into_body().collect_bytes().await {
        Ok(b) => b,
        Err(e) => return Evicted::Failed(e),
    };
    settle(&api, pod, answer(code.as_u16(), &body), retry_after).await
}

/// The `policy/v1` Eviction of `pod` in namespace `ns`, its deletion
/// pinned to the pod's UID.
fn eviction_request(ns: &str, pod: &Pod) -> Result<http::Request<Vec<u8>>, kube::Error> {
    let name = pod.name_any();
    let body = serde_json::json!({
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": ns},
        "deleteOptions": uid_only(pod, None),
    });
    let body = serde_json::to_vec(&body).map_err(kube::Error::SerdeError)?;
    let path = format!(
        "/api/v1/namespaces/{}/pods/{}/eviction",
        encode(ns),
        encode(&name)
    );
    http::Request::post(path)
        .header(http::header::CONTENT_TYPE, "application/json")
        .extension("evict")
        .body(body)
        .map_err(kube::Error::HttpError)
}

/// A path segment: object names are DNS subdomains, but nothing is taken
/// on trust.
fn encode(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An error answer as kube's own calls give it: its `Status`, or one made
/// of its code and text when the body is not one (a 429 of flow control).
fn answer(code: u16, body: &[u8]) -> kube::Error {
    let status = serde_json::from_slice::<Status>(body).unwrap_or_else(|_| {
        Status::failure(String::from_utf8_lossy(body).trim(), "").with_code(code)
    });
    kube::Error::Api(Box::new(status))
}

/// `Retry-After` in seconds (the API server never sends an HTTP date).
fn retry_after_seconds(value: &str) -> Option<Duration> {
    value
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
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
        Err(e) => settle(&api, pod, e, None).await,
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
            Evicted::from_error(api_error(404), None),
            Ok(Evicted::Gone)
        ));
        assert!(
            Evicted::from_error(api_error(409), None).is_err(),
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
        match Evicted::from_error(budget("DisruptionBudget"), None) {
            Ok(Evicted::Refused { message }) => {
                assert!(message.contains("needs 2 healthy pods"), "{message}")
            }
            other => panic!("a budget's 429 is a refusal, got {other:?}"),
        }
        // A 429 of the API server's flow control names no budget.
        match Evicted::from_error(api_error(429), None) {
            Ok(Evicted::Throttled { retry_after, .. }) => assert_eq!(retry_after, None),
            other => panic!("a 429 without a budget is throttling, got {other:?}"),
        }
        match Evicted::from_error(budget("SomethingElse"), None) {
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
            Evicted::from_error(two, None),
            Ok(Evicted::MultipleBudgets { .. })
        ));
        assert!(matches!(
            Evicted::from_error(api_error(500), None),
            Ok(Evicted::Failed(_))
        ));
        assert!(matches!(
            Evicted::from_error(api_error(403), None),
            Ok(Evicted::Failed(_))
        ));
    }

    #[test]
    fn an_eviction_is_pinned_to_the_pods_uid() {
        let mut pod = Pod::default();
        pod.metadata.name = Some("db-0".into());
        pod.metadata.uid = Some("u-1".into());
        let r = eviction_request("data", &pod).expect("a request");
        assert_eq!(r.method(), http::Method::POST);
        assert_eq!(r.uri().path(), "/api/v1/namespaces/data/pods/db-0/eviction");
        let body: serde_json::Value = serde_json::from_slice(r.body()).expect("JSON");
        assert_eq!(
            body,
            serde_json::json!({
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": "db-0", "namespace": "data"},
                "deleteOptions": {"preconditions": {"uid": "u-1"}}
            })
        );
        assert_eq!(encode("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn a_plain_text_429_is_throttling_paced_by_its_header() {
        let text = b"Too many requests, please try again later.\n";
        match Evicted::from_error(answer(429, text), retry_after_seconds("3")) {
            Ok(Evicted::Throttled {
                message,
                retry_after,
            }) => {
                assert_eq!(message, "Too many requests, please try again later.");
                assert_eq!(retry_after, Some(Duration::from_secs(3)));
            }
            other => panic!("flow control's 429 is throttling, got {other:?}"),
        }
        assert_eq!(retry_after_seconds(" 1 "), Some(Duration::from_secs(1)));
        assert_eq!(retry_after_seconds("0"), None);
        assert_eq!(retry_after_seconds("Wed, 21 Oct 2026 07:28:00 GMT"), None);
        // A Status body is read as such.
        let status = serde_json::to_vec(&serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
            "message": "pods \"db-0\" not found", "reason": "NotFound"
        }))
        .expect("JSON");
        assert!(matches!(
            Evicted::from_error(answer(404, &status), None),
            Ok(Evicted::Gone)
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
