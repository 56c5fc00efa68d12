//! The DrainRule controller: says on each rule whether the drain applies
//! it (`Accepted` True), or why not (`Accepted` False, `InvalidSelector` or
//! `InvalidTerms`, and a Warning Event once per generation). The drain reads the rules
//! from the caches and applies the accepted ones (see
//! `drain::cluster_rules`); this controller only tells the operator.
//!
//! No work queue: each rule the watch delivers (a change, or a re-list)
//! is compared with what its status says, and written only when they
//! differ, so a rule's own status write is the last event it causes. A
//! write that fails is tried again by the next event of the rule or the
//! watch's next re-list.

use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};

use crate::api::drainrule::{ACCEPTED, DrainRule, DrainRuleStatus};
use crate::drain::cluster_rules::validate;
use crate::telemetry::events::EventSink;

/// The `Accepted` condition `rule` should have: its status, reason and
/// message.
pub(crate) fn accepted(rule: &DrainRule) -> (bool, &'static str, String) {
    match validate(&rule.spec) {
        Ok(()) => (
            true,
            "Valid",
            "the drain applies this rule to the pods and Machines it picks".into(),
        ),
        Err(why) => (
            false,
            if why.contains("selector") {
                "InvalidSelector"
            } else {
                "InvalidTerms"
            },
            format!("{why}: the rule applies to nothing until it is fixed"),
        ),
    }
}

/// Whether `rule`'s status already says `want` for its generation.
fn says(rule: &DrainRule, want: &(bool, &'static str, String)) -> bool {
    let status = rule.status.as_ref();
    let generation = rule.metadata.generation;
    status.is_some_and(|s| s.observed_generation == generation)
        && status
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == ACCEPTED))
            .is_some_and(|c| {
                c.status == if want.0 { "True" } else { "False" }
                    && c.reason == want.1
                    && c.message == want.2
            })
}

/// Runs until `rules` ends: each rule's `Accepted` condition kept true to
/// its spec.
pub(crate) async fn run(
    client: Client,
    rules: impl Stream<Item = Result<DrainRule, watcher::Error>> + Send,
    events: EventSink,
) {
    let api: Api<DrainRule> = Api::all(client);
    tracing::info!("saying whether each DrainRule applies");
    let mut rules = std::pin::pin!(rules);
    while let Some(rule) = rules.next().await {
        let Ok(rule) = rule else { continue };
        let want = accepted(&rule);
        if says(&rule, &want) {
            continue;
        }
        let (ok, reason, message) = want;
        let condition = Condition {
            type_: ACCEPTED.into(),
            status: if ok { "True" } else { "False" }.into(),
            reason: reason.into(),
            message: message.clone(),
            last_transition_time: Time(Timestamp::now()),
            observed_generation: rule.metadata.generation,
        };
        let status = DrainRuleStatus {
            conditions: vec![condition],
            observed_generation: rule.metadata.generation,
        };
        let patch = serde_json::json!({"status": status});
        match api
            .patch_status(
                &rule.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) if !ok => events.warning(rule.object_ref(&()), "Validate", reason, message, None),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(rule = %rule.name_any(), error = %e, "DrainRule status not written")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(spec: serde_json::Value, status: serde_json::Value) -> DrainRule {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "berth.dev/v1alpha1",
            "kind": "DrainRule",
            "metadata": {"name": "r", "generation": 2},
            "spec": spec,
            "status": status,
        }))
        .expect("a rule")
    }

    #[test]
    fn a_rule_is_written_only_when_its_status_says_otherwise() {
        let good = serde_json::json!({"drain": {"behavior": "Skip"}});
        let fresh = rule(good.clone(), serde_json::json!({}));
        let want = accepted(&fresh);
        assert!(want.0);
        assert!(!says(&fresh, &want));
        let said = rule(
            good.clone(),
            serde_json::json!({"observedGeneration": 2, "conditions": [{
                "type": "Accepted", "status": "True", "reason": "Valid",
                "message": want.2, "lastTransitionTime": "2026-11-27T00:00:00Z"}]}),
        );
        assert!(says(&said, &want));
        // An older generation is said again.
        let mut old = said.clone();
        old.metadata.generation = Some(3);
        assert!(!says(&old, &accepted(&old)));
        let bad = rule(
            serde_json::json!({"drain": {"behavior": "Skip"}, "machines": [
                {"selector": {"matchExpressions": [{"key": "pool", "operator": "In"}]}}]}),
            serde_json::json!({}),
        );
        let (ok, reason, message) = accepted(&bad);
        assert!(!ok);
        assert_eq!(reason, "InvalidSelector");
        assert!(
            message.starts_with(
                "machines[0].selector.matchExpressions[0] (pool) operator In needs values"
            ),
            "{message}"
        );
        let terms = rule(
            serde_json::json!({"drain": {"behavior": "Drain"}, "moves": {"minHealthyTime": "a while"}}),
            serde_json::json!({}),
        );
        let (ok, reason, message) = accepted(&terms);
        assert!(!ok);
        assert_eq!(reason, "InvalidTerms");
        assert!(message.starts_with("moves.minHealthyTime"), "{message}");
    }
}
