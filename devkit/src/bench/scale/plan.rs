//! The scenario's shape and its floors, pure: how the requested numbers are
//! split over the drained Machines, and the shortest drain each could have.

use super::*;

/// How the requested numbers are split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub drains: Vec<DrainPlan>,
    pub background_machines: u32,
    pub background_pods: u32,
    pub background_attachments: u32,
}

/// The workload on one drained Machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainPlan {
    pub stateful: u32,
    pub stateless: u32,
}

impl Plan {
    /// Each drain needs its Machine and a receiving one; the rest of the
    /// Machines, pods and attachments are background.
    ///
    /// # Errors
    /// Numbers that leave no background Machine, or fewer pods or
    /// attachments than the drained Machines carry.
    pub fn new(machines: u32, pods: u32, attachments: u32, drains: u32) -> Result<Self, String> {
        if drains == 0 {
            return Err("--scale-drains must be at least 1".into());
        }
        let drains: Vec<DrainPlan> = (0..drains)
            .map(|i| DrainPlan {
                stateful: i % (STATEFUL_MAX + 1),
                stateless: STATELESS_PER_DRAIN,
            })
            .collect();
        let paired = 2 * drains.len() as u32;
        let background_machines = machines
            .checked_sub(paired)
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                format!(
                    "--scale-machines {machines}: at least {} needed (a drained and a receiving Machine per drain, and one background Machine)",
                    paired + 1
                )
            })?;
        let drain_pods: u32 = drains.iter().map(|d| d.stateful + d.stateless).sum();
        let stateful: u32 = drains.iter().map(|d| d.stateful).sum();
        let background_pods = pods.checked_sub(drain_pods).ok_or_else(|| {
            format!("--scale-pods {pods}: the drained Machines alone carry {drain_pods}")
        })?;
        let background_attachments = attachments.checked_sub(stateful).ok_or_else(|| {
            format!("--scale-attachments {attachments}: the drained Machines alone have {stateful} volumes")
        })?;
        Ok(Self {
            drains,
            background_machines,
            background_pods,
            background_attachments,
        })
    }

    pub(super) fn pods(&self) -> u32 {
        self.background_pods
            + self
                .drains
                .iter()
                .map(|d| d.stateful + d.stateless)
                .sum::<u32>()
    }

    pub(super) fn attachments(&self) -> u32 {
        self.background_attachments + self.drains.iter().map(|d| d.stateful).sum::<u32>()
    }
}

/// What a pod on a drained Node contributes to the drain's floor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PodFacts {
    /// It mounts a PersistentVolumeClaim.
    pub stateful: bool,
    pub grace_seconds: f64,
}

impl PodFacts {
    pub fn of(pod: &Pod) -> Self {
        let spec = pod.spec.as_ref();
        Self {
            stateful: spec
                .and_then(|s| s.volumes.as_ref())
                .is_some_and(|vs| vs.iter().any(|v| v.persistent_volume_claim.is_some())),
            grace_seconds: spec
                .and_then(|s| s.termination_grace_period_seconds)
                .unwrap_or(30) as f64,
        }
    }
}

/// The shortest possible drain of these pods: stateful pods one at a time,
/// each its grace period plus the detach and the attach of its volume; with
/// no stateful pod, the longest grace period (stateless pods go at once).
pub fn floor_seconds(pods: &[PodFacts], detach: f64, attach: f64) -> f64 {
    if pods.iter().any(|p| p.stateful) {
        pods.iter()
            .filter(|p| p.stateful)
            .map(|p| p.grace_seconds + detach + attach)
            .sum()
    } else {
        pods.iter().map(|p| p.grace_seconds).fold(0.0, f64::max)
    }
}

/// The cluster's part of a drain: its stateless pods go at once, so theirs
/// is the slowest one's `evicted → gone`; its stateful pods go one after
/// the other, so theirs is the sum of each one's `evicted → gone → detached
/// → attached elsewhere`. The longer of the two; `None` if a step of the
/// chain is missing from the log, or there are no pods.
pub fn critical_path(stateless: &[f64], chain: &[Option<f64>]) -> Option<f64> {
    if stateless.is_empty() && chain.is_empty() {
        return None;
    }
    let serial: f64 = chain.iter().copied().sum::<Option<f64>>()?;
    Some(stateless.iter().copied().fold(serial, f64::max))
}
