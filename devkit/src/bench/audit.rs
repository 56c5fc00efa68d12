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
    /// When its response was complete. A write's watch event leaves at its
    /// commit, between `received` and this.
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

/// How long after `step` (a write that completed a drain step) `user`
/// wrote next, in milliseconds: the controller's reaction time.
///
/// The step's watch event leaves the API server when the step commits,
/// which is before the step's response completes, so a controller that
/// reacts at once can be heard before the step is logged complete. Every
/// write received after the step itself was received counts, and one that
/// came before the step's completion counts as 0 ms.
pub fn reaction_ms(log: &[Request], user: &str, step: &Request) -> Option<f64> {
    let next = log
        .iter()
        .filter(|r| r.user == user && r.is_write() && r.received > step.received)
        .min_by_key(|r| r.received)?;
    reaction_seconds(step, next.received).map(|s| s * 1000.0)
}

/// Seconds from `step` to a request received `at`, by the rule of
/// [`reaction_ms`]: `None` if it came before the step itself, 0 if it came
/// while the step's response was still being written.
pub fn reaction_seconds(step: &Request, at: Timestamp) -> Option<f64> {
    (at > step.received).then(|| at.duration_since(step.completed).as_secs_f64().max(0.0))
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

    fn request(user: &str, verb: &str, received: &str, completed: &str) -> Request {
        Request {
            user: user.into(),
            user_agent: "ua".into(),
            verb: verb.into(),
            resource: "pods".into(),
            subresource: None,
            namespace: Some("ns".into()),
            name: Some("p".into()),
            code: 200,
            received: received.parse().expect("ts"),
            completed: completed.parse().expect("ts"),
        }
    }

    #[test]
    fn the_reaction_is_the_users_next_write_after_the_step() {
        let step = request(
            "kwok",
            "delete",
            "2026-01-01T00:00:01.000Z",
            "2026-01-01T00:00:01.020Z",
        );
        let log = [
            step.clone(),
            // Before the step: not a reaction.
            request(
                "c",
                "patch",
                "2026-01-01T00:00:00.900Z",
                "2026-01-01T00:00:00.950Z",
            ),
            // Reads and other users' writes do not count.
            request(
                "c",
                "get",
                "2026-01-01T00:00:01.030Z",
                "2026-01-01T00:00:01.031Z",
            ),
            request(
                "other",
                "patch",
                "2026-01-01T00:00:01.040Z",
                "2026-01-01T00:00:01.041Z",
            ),
            request(
                "c",
                "create",
                "2026-01-01T00:00:01.070Z",
                "2026-01-01T00:00:01.080Z",
            ),
            request(
                "c",
                "patch",
                "2026-01-01T00:00:01.500Z",
                "2026-01-01T00:00:01.510Z",
            ),
        ];
        let ms = reaction_ms(&log, "c", &step).expect("a reaction");
        assert!((ms - 50.0).abs() < 1e-6, "{ms}");
        assert_eq!(reaction_ms(&log, "nobody", &step), None);
    }

    #[test]
    fn a_reaction_heard_before_the_step_completed_counts_as_no_delay() {
        // The watch event left at the commit; the controller's write
        // arrived while the step's own response was still being written.
        let step = request(
            "kwok",
            "delete",
            "2026-01-01T00:00:01.000Z",
            "2026-01-01T00:00:01.014Z",
        );
        let log = [
            step.clone(),
            request(
                "c",
                "patch",
                "2026-01-01T00:00:01.011Z",
                "2026-01-01T00:00:01.026Z",
            ),
            request(
                "c",
                "create",
                "2026-01-01T00:00:02.100Z",
                "2026-01-01T00:00:02.110Z",
            ),
        ];
        assert_eq!(reaction_ms(&log, "c", &step), Some(0.0));
    }

    #[test]
    fn requests_are_counted_by_kind_over_a_window() {
        let log = [
            request("c", "get", "2026-01-01T00:00:01Z", "2026-01-01T00:00:01Z"),
            request(
                "c",
                "create",
                "2026-01-01T00:00:03Z",
                "2026-01-01T00:00:03Z",
            ),
            request("c", "patch", "2026-01-01T00:00:04Z", "2026-01-01T00:00:04Z"),
            request(
                "other",
                "patch",
                "2026-01-01T00:00:04Z",
                "2026-01-01T00:00:04Z",
            ),
            request("c", "patch", "2026-01-01T00:00:09Z", "2026-01-01T00:00:09Z"),
        ];
        let c = cost(
            &log,
            "c",
            "2026-01-01T00:00:00Z".parse().expect("ts"),
            "2026-01-01T00:00:05Z".parse().expect("ts"),
        );
        assert_eq!(c.get("get pods"), Some(&1));
        assert_eq!(c.get("create pods"), Some(&1));
        assert_eq!(c.get("patch pods"), Some(&1));
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
