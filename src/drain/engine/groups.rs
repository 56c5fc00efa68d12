//! The drain rules and order groups ([`crate::drain::rules`]) as a drain
//! follows them: each pass works on one order group (the lowest with a pod
//! left); pods a rule skips, and rules not understood, are named once; pods
//! a rule says to wait on are waited on until they complete, bounded by the
//! deadline, and never evicted before it.

use kube::runtime::events::EventType;

use super::reports::{Reports, pod_ref_key};
use crate::drain::plan::DrainPlan;
use crate::drain::rules::enter_group;
use crate::drain::select::{PodClass, fmt_key};

/// The order groups one drain entered: the first, and the last.
#[derive(Debug, Default)]
pub(super) struct Groups {
    seen: std::sync::Mutex<Option<(i32, i32)>>,
}

impl Groups {
    /// Says once per pod what its drain rule makes of it: skipped (a
    /// Normal Event), or an annotation not understood (a Warning, the
    /// default used).
    pub(super) fn announce_rules(&self, reports: &Reports, plan: &DrainPlan) {
        let skipped = plan
            .skipped
            .iter()
            .filter(|p| matches!(p.class, PodClass::Skipped { .. }));
        for p in skipped {
            let uid = p.uid.clone().unwrap_or_else(|| fmt_key(&p.pod));
            if reports.first(format!("skip/{uid}")) {
                reports.event(
                    EventType::Normal,
                    "PodSkipped",
                    format!("pod {} is not evicted: {}", fmt_key(&p.pod), p.class),
                    Some(pod_ref_key(&p.pod)),
                );
            }
        }
        for (pod, problem) in &plan.rule_problems {
            if reports.first(format!("rule/{}/{problem}", fmt_key(pod))) {
                reports.event(
                    EventType::Warning,
                    "DrainRuleInvalid",
                    format!("pod {}: {problem}", fmt_key(pod)),
                    Some(pod_ref_key(pod)),
                );
            }
        }
    }

    /// A pass works on order group `order` of `plan`: says whether nothing
    /// of it is evicted before the volumes of the pods that left are off
    /// the Node (see [`enter_group`]), and announces a group later than the
    /// last one, once.
    pub(super) fn enter(&self, reports: &Reports, plan: &DrainPlan, order: i32) -> bool {
        let Ok(mut groups) = self.seen.lock() else {
            return false;
        };
        let step = enter_group(*groups, order);
        *groups = Some(step.seen);
        drop(groups);
        if let Some(last) = step.after {
            let group = plan.groups().into_iter().find(|g| g.order == order);
            let why = group
                .as_ref()
                .filter(|g| !g.why.is_empty())
                .map(|g| {
                    let why: Vec<&str> = g.why.iter().map(String::as_str).collect();
                    format!(" ({})", why.join("; "))
                })
                .unwrap_or_default();
            let pods = match group.map_or(0, |g| g.stateless + g.stateful + g.waiting) {
                1 => "1 pod".to_string(),
                n => format!("{n} pods"),
            };
            reports.event(
                EventType::Normal,
                "OrderGroupStarted",
                format!(
                    "order group {order}{why}: {pods}, now that every pod of order {last} and below is gone and their volumes have moved"
                ),
                None,
            );
        }
        step.after_volumes
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use k8s_openapi::api::core::v1::ObjectReference;

    use super::*;
    use crate::api::settings::ResolvedSettings;
    use crate::drain::cluster_rules::RuleBook;
    use crate::drain::plan::plan;
    use crate::drain::volume_kind::VolumeContext;
    use crate::telemetry::events::EventSink;

    fn empty() -> DrainPlan {
        let settings = ResolvedSettings::default();
        plan(
            "n1",
            &[],
            &[],
            &[],
            &[],
            &[],
            &VolumeContext::default(),
            &settings,
            &RuleBook::default(),
        )
    }

    #[test]
    fn a_later_group_waits_for_volumes_and_is_announced_once() {
        let (sink, mut rx) = EventSink::captured(8);
        let reports = Reports::new(sink, ObjectReference::default(), Arc::default());
        let groups = Groups::default();
        let plan = empty();
        assert!(
            !groups.enter(&reports, &plan, 0),
            "the first, default group"
        );
        assert!(rx.try_recv().is_err());
        assert!(groups.enter(&reports, &plan, 1000), "after the first group");
        let (ev, _) = rx.try_recv().expect("the group's Event");
        assert_eq!(ev.reason, "OrderGroupStarted");
        assert!(
            ev.note
                .as_deref()
                .unwrap_or_default()
                .contains("order 0 and below")
        );
        assert!(groups.enter(&reports, &plan, 1000), "still after the first");
        assert!(rx.try_recv().is_err(), "announced once");
    }

    #[test]
    fn a_rule_not_understood_is_named_once() {
        let (sink, mut rx) = EventSink::captured(8);
        let reports = Reports::new(sink, ObjectReference::default(), Arc::default());
        let mut plan = empty();
        plan.rule_problems.push((
            ("ns".into(), "a".into()),
            "order \"x\" is not a number".into(),
        ));
        let groups = Groups::default();
        groups.announce_rules(&reports, &plan);
        groups.announce_rules(&reports, &plan);
        let (ev, _) = rx.try_recv().expect("a Warning");
        assert_eq!(ev.reason, "DrainRuleInvalid");
        assert!(rx.try_recv().is_err());
    }
}
