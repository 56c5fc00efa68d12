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
    /// What it asked for, as a digest, where the audit policy logs request
    /// bodies (the test beds log them for the controller's writes): two
    /// writes with the same digest said the same thing (see
    /// [`content_digest`] for what it leaves out).
    pub body: Option<u64>,
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
    #[serde(default)]
    request_object: Option<serde_json::Value>,
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
                body: e.request_object.map(|b| content_digest(&b)),
            })
        })
        .collect()
}

/// A digest of a request body's content: the same for two bodies that say
/// the same thing at another moment, that is, that differ only in
///
/// - times: a string that reads as an RFC 3339 timestamp (a heartbeat, a
///   transition time);
/// - the object's identity and version: `metadata`'s `name`,
///   `generateName`, `uid`, `creationTimestamp`, `resourceVersion` (a
///   precondition's version is new on every write, whatever it says) and
///   `managedFields`.
pub fn content_digest(body: &serde_json::Value) -> u64 {
    use std::hash::{Hash, Hasher};
    fn strip(v: &serde_json::Value, top: bool) -> serde_json::Value {
        match v {
            serde_json::Value::Object(m) => m
                .iter()
                .filter(|(k, _)| !matches!(k.as_str(), "resourceVersion" | "managedFields"))
                .map(|(k, v)| {
                    let v = match v {
                        serde_json::Value::Object(meta) if top && k == "metadata" => meta
                            .iter()
                            .filter(|(k, _)| {
                                !matches!(
                                    k.as_str(),
                                    "name"
                                        | "generateName"
                                        | "uid"
                                        | "creationTimestamp"
                                        | "resourceVersion"
                                        | "managedFields"
                                )
                            })
                            .map(|(k, v)| (k.clone(), strip(v, false)))
                            .collect(),
                        v => strip(v, false),
                    };
                    (k.clone(), v)
                })
                .collect(),
            serde_json::Value::Array(a) => a.iter().map(|v| strip(v, false)).collect(),
            serde_json::Value::String(s) if s.parse::<Timestamp>().is_ok() => {
                serde_json::Value::String(String::new())
            }
            other => other.clone(),
        }
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    strip(body, true).to_string().hash(&mut h);
    h.finish()
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
    fn a_digest_leaves_out_times_and_identity() {
        let a = serde_json::json!({
            "metadata": {"name": "m.18ec01", "resourceVersion": "7"},
            "status": {"at": "2026-11-28T12:00:00Z", "waiting": "db-0 not Ready for 1m 56s", "evicted": 1},
        });
        let b = serde_json::json!({
            "metadata": {"name": "m.18ec02", "resourceVersion": "9"},
            "status": {"at": "2026-11-28T12:00:02.5Z", "waiting": "db-0 not Ready for 1m 56s", "evicted": 1},
        });
        let c = serde_json::json!({
            "metadata": {"name": "m.18ec02", "resourceVersion": "9"},
            "status": {"at": "2026-11-28T12:00:02.5Z", "waiting": "db-0 not Ready for 1m 58s", "evicted": 1},
        });
        assert_eq!(content_digest(&a), content_digest(&b));
        // Words that say something else (here a count) are another body.
        assert_ne!(content_digest(&b), content_digest(&c));
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
            body: None,
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
