//! A deployment's MachineSets as its reconcile reads them from the
//! caches: each set with its Machines and their counts ([`Member`]), and
//! the old Machines being deleted by every deployment's rollout.

use std::sync::Arc;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;

use super::Context;
use super::decide::SetCounts;
use crate::api::{
    Machine, MachineDeployment, MachineSet, REVISION_ANNOTATION, SUPERSEDED_ANNOTATION,
};
use crate::machineset::observe::facts;

/// One of the deployment's sets, with its Machines.
pub(super) struct Member {
    pub(super) set: Arc<MachineSet>,
    pub(super) machines: Vec<Arc<Machine>>,
    pub(super) counts: SetCounts,
    pub(super) revision: i64,
}

impl Member {
    pub(super) fn name(&self) -> String {
        self.set.name_any()
    }

    pub(super) fn active(&self) -> impl Iterator<Item = &Arc<Machine>> {
        self.machines
            .iter()
            .filter(|m| m.metadata.deletion_timestamp.is_none())
    }
}

/// The deployment's sets from the cache, each with its Machines and counts.
pub(super) fn members(
    md: &MachineDeployment,
    ns: &str,
    uid: &str,
    ctx: &Context,
    expectations: &mut super::Expectations,
    now: Timestamp,
) -> Vec<Member> {
    let min_ready = SignedDuration::from_secs(md.spec.min_ready_seconds.unwrap_or(0).into());
    ctx.caches
        .sets
        .state()
        .into_iter()
        .filter(|s| s.namespace().as_deref() == Some(ns))
        .filter(|s| {
            s.owner_references()
                .iter()
                .any(|o| o.controller == Some(true) && o.uid == uid)
        })
        .map(|set| {
            let machines: Vec<Arc<Machine>> = set
                .uid()
                .map(|u| ctx.caches.machines_of_set(&u))
                .unwrap_or_default();
            let mut counts = SetCounts {
                replicas: expectations.replicas(&set),
                ..SetCounts::default()
            };
            for m in &machines {
                if m.metadata.deletion_timestamp.is_some() {
                    counts.deleting += 1;
                    continue;
                }
                counts.active += 1;
                let f = facts(m, &ctx.caches);
                counts.ready += usize::from(f.ready());
                counts.available += usize::from(f.available(min_ready, now));
            }
            let revision = set
                .annotations()
                .get(REVISION_ANNOTATION)
                .and_then(|r| r.parse().ok())
                .unwrap_or(0);
            Member {
                set,
                machines,
                counts,
                revision,
            }
        })
        .collect()
}

pub(super) fn sum(counts: impl Iterator<Item = SetCounts>) -> SetCounts {
    counts.fold(SetCounts::default(), |a, c| SetCounts {
        replicas: a.replicas + c.replicas,
        active: a.active + c.active,
        deleting: a.deleting + c.deleting,
        ready: a.ready + c.ready,
        available: a.available + c.available,
    })
}

/// Old Machines being deleted by the rollouts of every deployment, the
/// deletions asked of their sets and not yet begun included.
pub(super) fn drains_everywhere(ctx: &Context, expectations: &mut super::Expectations) -> usize {
    ctx.caches
        .sets
        .state()
        .iter()
        .filter(|s| s.annotations().contains_key(SUPERSEDED_ANNOTATION))
        .map(|s| {
            let machines = s
                .uid()
                .map(|u| ctx.caches.machines_of_set(&u))
                .unwrap_or_default();
            let deleting = machines
                .iter()
                .filter(|m| m.metadata.deletion_timestamp.is_some())
                .count();
            let active = machines.len() - deleting;
            deleting + active.saturating_sub(expectations.replicas(s))
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counts_of_several_sets_add_up_field_by_field() {
        let a = SetCounts {
            replicas: 3,
            active: 3,
            deleting: 1,
            ready: 2,
            available: 1,
        };
        let b = SetCounts {
            replicas: 2,
            active: 1,
            deleting: 0,
            ready: 1,
            available: 1,
        };
        assert_eq!(
            sum([a, b].into_iter()),
            SetCounts {
                replicas: 5,
                active: 4,
                deleting: 1,
                ready: 3,
                available: 2,
            }
        );
        assert_eq!(sum(std::iter::empty()), SetCounts::default());
    }
}
