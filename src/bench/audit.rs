//! Reading the API server's audit log: what each client sent and when. The
//! benchmark's latency and API-cost figures come from here, measured by the
//! API server itself rather than by the controller.

use std::collections::BTreeMap;

use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;

/// One completed request, as the audit log records it.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub user: String,
    pub user_agent: String,
    pub verb: String,
    pub resource: String,
    pub subresource: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub code: u16,
    /// When the API server received it.
    pub received: Timestamp,
    /// When it answered (the change is visible to watches from then on).
    pub completed: Timestamp,
}

impl Request {
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    }

    pub fn is_read(&self) -> bool {
        matches!(self.verb.as_str(), "get" | "list")
    }

    /// `verb resource[/subresource]`.
    pub fn kind(&self) -> String {
        match &self.subresource {
            Some(s) => format!("{} {}/{s}", self.verb, self.resource),
            None => format!("{} {}", self.verb, self.resource),
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawEvent {
    stage: String,
    verb: String,
    #[serde(default)]
    user: RawUser,
    #[serde(default)]
    user_agent: String,
    #[serde(default)]
    object_ref: Option<RawRef>,
    #[serde(default)]
    response_status: Option<RawStatus>,
    request_received_timestamp: Timestamp,
    stage_timestamp: Timestamp,
}

#[derive(Deserialize, Default)]
struct RawUser {
    #[serde(default)]
    username: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawRef {
    #[serde(default)]
    resource: String,
    #[serde(default)]
    subresource: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

#[derive(Deserialize)]
struct RawStatus {
    #[serde(default)]
    code: u16,
}

/// Parses the JSON-lines audit log, keeping completed resource requests.
/// Lines that are not audit events are skipped.
pub fn parse(log: &str) -> Vec<Request> {
    log.lines()
        .filter_map(|line| serde_json::from_str::<RawEvent>(line).ok())
        .filter(|e| e.stage == "ResponseComplete")
        .filter_map(|e| {
            let r = e.object_ref?;
            Some(Request {
                user: e.user.username,
                user_agent: e.user_agent,
                verb: e.verb,
                resource: r.resource,
                subresource: r.subresource,
                namespace: r.namespace,
                name: r.name,
                code: e.response_status.map(|s| s.code).unwrap_or(0),
                received: e.request_received_timestamp,
                completed: e.stage_timestamp,
            })
        })
        .collect()
}

/// The first write by `user` received after `after`.
pub fn next_write<'a>(log: &'a [Request], user: &str, after: Timestamp) -> Option<&'a Request> {
    log.iter()
        .filter(|r| r.user == user && r.is_write() && r.received > after)
        .min_by_key(|r| r.received)
}

/// Requests of `user` received in `[from, to]`, counted by `verb resource`.
pub fn cost(log: &[Request], user: &str, from: Timestamp, to: Timestamp) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    for r in log
        .iter()
        .filter(|r| r.user == user && r.received >= from && r.received <= to)
    {
        *out.entry(r.kind()).or_insert(0) += 1;
    }
    out
}

/// Nearest-rank percentile of `values` (sorted inside), `p` in 0..=100.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    v.get(rank.min(v.len()) - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(stage: &str, user: &str, verb: &str, resource: &str, name: &str, at: &str) -> String {
        serde_json::json!({
            "kind": "Event", "stage": stage, "verb": verb,
            "user": {"username": user}, "userAgent": "ua",
            "objectRef": {"resource": resource, "namespace": "ns", "name": name},
            "responseStatus": {"code": 200},
            "requestReceivedTimestamp": at, "stageTimestamp": at
        })
        .to_string()
    }

    #[test]
    fn only_completed_resource_requests_are_kept() {
        let log = [
            line("ResponseStarted", "c", "watch", "pods", "", "2026-01-01T00:00:00.1Z"),
            line("ResponseComplete", "c", "patch", "machines", "m", "2026-01-01T00:00:00.2Z"),
            "not json".to_string(),
            r#"{"stage":"ResponseComplete","verb":"get","requestReceivedTimestamp":"2026-01-01T00:00:00Z","stageTimestamp":"2026-01-01T00:00:00Z"}"#.to_string(),
        ]
        .join("\n");
        let reqs = parse(&log);
        assert_eq!(reqs.len(), 1, "{reqs:?}");
        assert_eq!(reqs[0].kind(), "patch machines");
        assert!(reqs[0].is_write());
    }

    #[test]
    fn the_next_write_of_a_user_after_an_instant() {
        let log = parse(
            &[
                line(
                    "ResponseComplete",
                    "c",
                    "get",
                    "pods",
                    "p",
                    "2026-01-01T00:00:01Z",
                ),
                line(
                    "ResponseComplete",
                    "other",
                    "patch",
                    "pods",
                    "p",
                    "2026-01-01T00:00:02Z",
                ),
                line(
                    "ResponseComplete",
                    "c",
                    "create",
                    "pods",
                    "p",
                    "2026-01-01T00:00:03Z",
                ),
                line(
                    "ResponseComplete",
                    "c",
                    "patch",
                    "machines",
                    "m",
                    "2026-01-01T00:00:04Z",
                ),
            ]
            .join("\n"),
        );
        let t: Timestamp = "2026-01-01T00:00:01.5Z".parse().expect("ts");
        let w = next_write(&log, "c", t).expect("a write");
        assert_eq!(w.kind(), "create pods");
        let late: Timestamp = "2026-01-01T00:00:05Z".parse().expect("ts");
        assert!(next_write(&log, "c", late).is_none());
        let c = cost(&log, "c", "2026-01-01T00:00:00Z".parse().expect("ts"), late);
        assert_eq!(c.get("get pods"), Some(&1));
        assert_eq!(c.get("create pods"), Some(&1));
        assert_eq!(c.values().sum::<u32>(), 3);
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.0), Some(1.0));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
