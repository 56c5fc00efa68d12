//! `berth plan`: the drain that would happen now, read from a live cluster
//! without changing anything. It lists what the engine reads from its
//! caches and feeds the same pure `plan` function, so the plan printed and
//! the drain performed cannot disagree.

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::{CSIDriver, VolumeAttachment};
use kube::Client;
use kube::api::{Api, ListParams};

use super::class::{VolumeContext, allows_data_loss};
use super::plan::{DrainPlan, plan};
use crate::api::settings::resolve;
use crate::api::{DrainStatus, Machine, MachineClass};

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("Machine {0} not found")]
    MachineNotFound(String),
    #[error("Machine {0} has no Node (status.nodeRef is empty): there is nothing to drain")]
    NoNode(String),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// What `berth plan` prints: the Machine's plan and its Node, and the
/// notes that go with it (see [`LivePlan::notes`]).
pub struct LivePlan {
    pub machine: Machine,
    pub plan: DrainPlan,
    /// Why the settings are not the class's, when they are not (the class
    /// is missing or invalid: the drain then uses the Machine's own
    /// `spec.drain` over the built-in defaults, as the controller does).
    pub settings_note: Option<String>,
}

impl LivePlan {
    /// The lines printed before the plan: where the settings come from
    /// when not from the class, and the drain in progress, if any, as
    /// `status.drain` records it.
    pub fn notes(&self) -> String {
        let mut out = String::new();
        if let Some(n) = &self.settings_note {
            out.push_str(&format!("Settings: {n}\n"));
        }
        if let Some(d) = self.machine.status.as_ref().and_then(|s| s.drain.as_ref()) {
            out.push_str(&in_progress(d));
        }
        out
    }
}

/// The drain `status.drain` records, in words: how far it got, what it
/// waits for or what blocks it, and the volume moves in flight (each
/// resumed by a restarted controller before any other stateful eviction).
pub fn in_progress(d: &DrainStatus) -> String {
    let mut out = String::new();
    let Some(started) = &d.started_at else {
        return out;
    };
    match &d.finished_at {
        Some(done) => out.push_str(&format!(
            "Drain started at {}, ended at {} ({} of {} pods evicted)\n",
            started.0, done.0, d.pods_evicted, d.pods_total
        )),
        None => out.push_str(&format!(
            "Drain in progress since {} ({} of {} pods evicted, {} left)\n",
            started.0, d.pods_evicted, d.pods_total, d.pods_remaining
        )),
    }
    if let Some(w) = &d.waiting_for {
        out.push_str(&format!("  waiting for: {w}\n"));
    }
    if let Some(b) = &d.blocked_by {
        out.push_str(&format!("  blocked by: {b}\n"));
    }
    if !d.moves.is_empty() {
        out.push_str(
            "  volume moves in flight (each waited for before the next stateful eviction):\n",
        );
        for m in &d.moves {
            out.push_str(&format!("    {}: {}\n", m.pod, m.volumes.join(", ")));
        }
    }
    out
}

/// Plans the drain of Machine `namespace/name` from fresh lists.
///
/// # Errors
/// A missing Machine, Node reference or class; invalid settings; API errors.
pub async fn plan_machine(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<LivePlan, PlanError> {
    let machine = Api::<Machine>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await?
        .ok_or_else(|| PlanError::MachineNotFound(format!("{namespace}/{name}")))?;
    let node = machine
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| r.name.clone())
        .ok_or_else(|| PlanError::NoNode(format!("{namespace}/{name}")))?;
    // As the controller does: a class that is missing or invalid never
    // drops the Machine's own settings.
    let class_name = &machine.spec.class_ref.name;
    let class = Api::<MachineClass>::all(client.clone())
        .get_opt(class_name)
        .await?;
    let own = || resolve(machine.spec.drain.as_ref(), None, None, None).unwrap_or_default();
    let (settings, settings_note) = match &class {
        None => (
            own(),
            Some(format!(
                "MachineClass {class_name:?} not found: the drain uses the Machine's own spec.drain over the built-in defaults"
            )),
        ),
        Some(c) => match resolve(
            machine.spec.drain.as_ref(),
            c.spec.drain.as_ref(),
            c.spec.creation_timeout.as_deref(),
            c.spec.health_timeout.as_deref(),
        ) {
            Ok(s) => (s, None),
            Err(e) => (
                own(),
                Some(format!(
                    "the drain settings of MachineClass {class_name:?} are invalid ({e}): the drain uses the Machine's own spec.drain over the built-in defaults"
                )),
            ),
        },
    };

    let lp = ListParams::default();
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?
        .items;
    let pvcs = Api::<PersistentVolumeClaim>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let pvs = Api::<PersistentVolume>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let pdbs = Api::<PodDisruptionBudget>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let vas = Api::<VolumeAttachment>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let drivers = Api::<CSIDriver>::all(client.clone()).list(&lp).await?.items;
    let node_obj = Api::<Node>::all(client.clone()).get_opt(&node).await?;
    let volumes = VolumeContext::new(&node, node_obj.as_ref(), &drivers)
        .allowing_data_loss(allows_data_loss(machine.metadata.annotations.as_ref()));
    let plan = plan(&node, &pods, &pvcs, &pvs, &pdbs, &vas, &volumes, &settings);
    Ok(LivePlan {
        machine,
        plan,
        settings_note,
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;
    use crate::api::VolumeMove;

    #[test]
    fn a_drain_in_progress_names_its_wait_its_block_and_its_moves() {
        assert_eq!(in_progress(&DrainStatus::default()), "", "never started");
        let started = "2026-11-23T09:00:00Z".parse().expect("time");
        let d = DrainStatus {
            started_at: Some(Time(started)),
            pods_total: 3,
            pods_evicted: 1,
            pods_remaining: 2,
            waiting_for: Some("pv-db-0 to detach from Node n1".into()),
            blocked_by: Some("PodDisruptionBudget web".into()),
            moves: vec![VolumeMove {
                pod: "db/db-0".into(),
                uid: Some("u0".into()),
                volumes: vec!["pv-db-0".into()],
                ..VolumeMove::default()
            }],
            ..DrainStatus::default()
        };
        let text = in_progress(&d);
        for needle in [
            "Drain in progress since 2026-11-23T09:00:00Z (1 of 3 pods evicted, 2 left)",
            "waiting for: pv-db-0 to detach from Node n1",
            "blocked by: PodDisruptionBudget web",
            "db/db-0: pv-db-0",
        ] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
    }
}
