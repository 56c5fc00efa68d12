//! The Node lifecycle conditions of KEP-5683 that a Machine's drain
//! writes on its Node, `DrainInProgress` and `Drained`, so that tools that
//! read Nodes (not Machines) see the drain. They mirror the Machine's own
//! `Drained` condition, reasons included: while it is False (`Draining`,
//! `EvictionBlocked`, `PodHeldByFinalizer`, `PodsReturned`,
//! `DrainFailed`) the Node is `DrainInProgress=True, Drained=False`; once
//! it is True (`Drained`), `DrainInProgress=False, Drained=True`. A
//! Machine's deletion is never called off and berth never uncordons a
//! Node: the conditions go with the Node, deleted with its VM.
//!
//! Pure: what the Node should say and the patch that makes it say it; the
//! write is `node::lifecycle_conditions`, a strategic merge patch of
//! `status.conditions`, which merges by `type`, so the kubelet's
//! conditions (`Ready`, the pressures) are never touched.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;

use super::status::Cond;
use crate::api::conditions::DRAINED;

/// The Node is being drained (KEP-5683).
pub(crate) const DRAIN_IN_PROGRESS: &str = "DrainInProgress";
/// The Node reached the drain's criteria (KEP-5683): no pod left to drain.
pub(crate) const NODE_DRAINED: &str = "Drained";

/// What a Node's lifecycle conditions say while the Machine's own
/// `Drained` condition is `drained`; `None` for another condition.
pub(crate) fn node_conditions(drained: &Cond) -> Option<[Cond; 2]> {
    if drained.type_ != DRAINED {
        return None;
    }
    let (reason, message) = (drained.reason, drained.message.clone());
    Some([
        Cond::new(DRAIN_IN_PROGRESS, !drained.status, reason, message.clone()),
        Cond::new(NODE_DRAINED, drained.status, reason, message),
    ])
}

/// What the Node says once its drain is done, in the steps after it (the
/// pre-terminate hooks, the VM's deletion), whose records no longer carry
/// the Machine's `Drained` condition: the drain's own words when it ended.
pub(crate) fn drained(node: &str) -> [Cond; 2] {
    let message = format!("no pod left to drain on Node {node}");
    [
        Cond::new(DRAIN_IN_PROGRESS, false, "Drained", message.clone()),
        Cond::new(NODE_DRAINED, true, "Drained", message),
    ]
}

/// The body of a strategic merge patch of `node`'s status that sets
/// `want`, or `None` when the Node says each already (status, reason and
/// message). A condition keeps its `lastTransitionTime` unless its status
/// flips; its `lastHeartbeatTime` is when it was last written.
pub(crate) fn patch(node: &Node, want: &[Cond], now: Timestamp) -> Option<serde_json::Value> {
    let have = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let status = |b: bool| if b { "True" } else { "False" };
    let mut changed = false;
    let conditions: Vec<serde_json::Value> = want
        .iter()
        .map(|c| {
            let old = have.iter().find(|h| h.type_ == c.type_);
            let same_status = old.is_some_and(|o| o.status == status(c.status));
            let said = same_status
                && old.is_some_and(|o| {
                    o.reason.as_deref() == Some(c.reason)
                        && o.message.as_deref() == Some(c.message.as_str())
                });
            changed |= !said;
            let since = old
                .filter(|_| same_status)
                .and_then(|o| o.last_transition_time.as_ref())
                .map_or(now, |t| t.0);
            serde_json::json!({
                "type": c.type_,
                "status": status(c.status),
                "reason": c.reason,
                "message": c.message,
                "lastTransitionTime": since.to_string(),
                "lastHeartbeatTime": now.to_string(),
            })
        })
        .collect();
    changed.then(|| serde_json::json!({"status": {"conditions": conditions}}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(conditions: serde_json::Value) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n"},
            "status": {"conditions": conditions}
        }))
        .expect("a Node")
    }

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).expect("a time")
    }

    #[test]
    fn the_node_mirrors_the_machines_drained_condition() {
        let draining = Cond::new(DRAINED, false, "EvictionBlocked", "blocked: a PDB");
        let [in_progress, drained] = node_conditions(&draining).expect("the drain's");
        assert_eq!(
            (in_progress.type_, in_progress.status, in_progress.reason),
            (DRAIN_IN_PROGRESS, true, "EvictionBlocked")
        );
        assert_eq!(
            (drained.type_, drained.status, drained.message.as_str()),
            (NODE_DRAINED, false, "blocked: a PDB")
        );
        let done = Cond::new(DRAINED, true, "Drained", "no pod left to drain on Node n");
        let [in_progress, drained] = node_conditions(&done).expect("the drain's");
        assert_eq!((in_progress.status, drained.status), (false, true));
        assert_eq!((in_progress.reason, drained.reason), ("Drained", "Drained"));
        let other = Cond::new("Ready", false, "Deleting", "");
        assert!(node_conditions(&other).is_none());
        // The steps after the drain say what the Machine said when it ended
        // (see `record`'s WaitVolumesDetached): no churn between them.
        let after = Cond::new(DRAINED, true, "Drained", "no pod left to drain on Node n");
        assert_eq!(Some(super::drained("n")), node_conditions(&after));
    }

    #[test]
    fn a_patch_only_when_the_node_does_not_say_it_keeping_transition_times() {
        let ready =
            serde_json::json!({"type": "Ready", "status": "True", "reason": "KubeletReady"});
        let want = node_conditions(&Cond::new(DRAINED, false, "Draining", "draining Node n"))
            .expect("the drain's");
        // A Node that says nothing of it yet: both, from now; the kubelet's
        // Ready is not in the patch (strategic merge keeps it).
        let fresh = patch(&node(serde_json::json!([ready])), &want, at(10)).expect("a patch");
        let conditions = fresh["status"]["conditions"].as_array().expect("a list");
        assert_eq!(conditions.len(), 2);
        assert_eq!(conditions[0]["type"], DRAIN_IN_PROGRESS);
        assert_eq!(conditions[0]["status"], "True");
        assert_eq!(conditions[1]["status"], "False");
        assert_eq!(conditions[0]["lastTransitionTime"], at(10).to_string());

        // Said already: nothing to write.
        let said = node(serde_json::json!([ready, conditions[0], conditions[1]]));
        assert_eq!(patch(&said, &want, at(20)), None);

        // Blocked: the reason changes, not the status: its transition time
        // stays.
        let blocked = node_conditions(&Cond::new(
            DRAINED,
            false,
            "EvictionBlocked",
            "blocked: a PDB",
        ))
        .expect("the drain's");
        let p = patch(&said, &blocked, at(30)).expect("a patch");
        assert_eq!(
            p["status"]["conditions"][0]["lastTransitionTime"],
            at(10).to_string()
        );
        assert_eq!(p["status"]["conditions"][0]["reason"], "EvictionBlocked");
        assert_eq!(
            p["status"]["conditions"][0]["lastHeartbeatTime"],
            at(30).to_string()
        );

        // Drained: both flip, from now.
        let done = node_conditions(&Cond::new(DRAINED, true, "Drained", "no pod left"))
            .expect("the drain's");
        let p = patch(&said, &done, at(40)).expect("a patch");
        let c = &p["status"]["conditions"];
        assert_eq!(
            (c[0]["status"].as_str(), c[1]["status"].as_str()),
            (Some("False"), Some("True"))
        );
        assert_eq!(c[0]["lastTransitionTime"], at(40).to_string());
        assert_eq!(c[1]["lastTransitionTime"], at(40).to_string());
    }
}
