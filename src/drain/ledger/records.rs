//! A permit as it is kept outside the process: a `MovePermit` object in
//! the API server (read back by every process), or a move a Machine
//! recorded in `status.drain.moves` (read once, before a process's first
//! drain asks); and when a permit expires once no drain watches its move.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::{Ask, Lined, Permit, Workload};
use crate::api::{Machine, MoveAsk, MovePermit, VolumeMove};

/// The metadata of the ledger's object `name` (a permit, an ask) of
/// `workload`: in its namespace, managed by berth, and owned by the
/// workload's object `owner` when it is known, neither as its controller
/// nor blocking its deletion (that would need the right to update its
/// finalizers), so that the object goes with its workload.
pub(crate) fn ledger_meta(
    workload: &Workload,
    name: String,
    owner: Option<&OwnerReference>,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(workload.namespace.clone()),
        labels: Some(BTreeMap::from([(
            "app.kubernetes.io/managed-by".to_string(),
            "berth".to_string(),
        )])),
        owner_references: owner.map(|o| {
            vec![OwnerReference {
                controller: None,
                block_owner_deletion: None,
                ..o.clone()
            }]
        }),
        ..ObjectMeta::default()
    }
}

/// The moves every Machine records in `status.drain.moves`, each with its
/// workload and as the permit it holds: what a ledger is
/// [rebuilt](super::Ledger::rebuild) from.
pub fn recorded_moves<'m>(
    machines: impl IntoIterator<Item = &'m Machine>,
) -> Vec<(Workload, Permit)> {
    machines
        .into_iter()
        .flat_map(|m| {
            let machine = format!(
                "{}/{}",
                m.metadata.namespace.as_deref().unwrap_or_default(),
                m.metadata.name.as_deref().unwrap_or_default()
            );
            let moves = m
                .status
                .as_ref()
                .and_then(|s| s.drain.as_ref())
                .map(|d| d.moves.clone())
                .unwrap_or_default();
            moves
                .into_iter()
                .filter_map(move |mv| recorded(&machine, &mv))
        })
        .collect()
}

/// The workload and permit of a move `machine` recorded.
fn recorded(machine: &str, mv: &VolumeMove) -> Option<(Workload, Permit)> {
    let (ns, _) = mv.pod.split_once('/')?;
    let workload = workload_of_record(ns, mv)?;
    Some((
        workload,
        Permit {
            pod: mv.pod.clone(),
            uid: mv.uid.clone().unwrap_or_else(|| mv.pod.clone()),
            machine: machine.to_string(),
            since: mv.since.as_ref().map_or_else(Timestamp::now, |t| t.0),
            past_budget: false,
            volumes: true,
            // Its drain watches the move to its end.
            attach: Vec::new(),
            destination: None,
        },
    ))
}

/// What a `MovePermit` in the API server says, as the ledger counts it:
/// its workload and the permit; `None` for one that does not name its
/// workload as `Kind/name`.
pub fn held_permit(o: &MovePermit) -> Option<(Workload, Permit)> {
    let ns = o.metadata.namespace.as_deref().unwrap_or_default();
    let (kind, name) = o.spec.workload.split_once('/')?;
    Some((
        Workload::new(kind, ns, name),
        Permit {
            pod: format!("{ns}/{}", o.spec.pod),
            uid: o.spec.pod_uid.clone(),
            machine: o.spec.machine.clone(),
            since: o.spec.since.0,
            past_budget: o.spec.past_budget,
            volumes: o.spec.volumes,
            attach: o.spec.attach.clone(),
            destination: o.spec.destination.clone(),
        },
    ))
}

/// What a `MoveAsk` in the API server says, as the ledger orders it: its
/// workload and the ask in line; `None` for one that does not name its
/// workload as `Kind/name`. Only what orders it is read (its pod, UID,
/// Machine, priority and deletion time).
pub fn lined_ask(o: &MoveAsk) -> Option<(Workload, Lined)> {
    let ns = o.metadata.namespace.as_deref().unwrap_or_default();
    let (kind, name) = o.spec.workload.split_once('/')?;
    let workload = Workload::new(kind, ns, name);
    let ask = Ask {
        workload: workload.clone(),
        pod: format!("{ns}/{}", o.spec.pod),
        uid: o.spec.pod_uid.clone(),
        machine: o.spec.machine.clone(),
        priority: o.spec.priority,
        requested: o.spec.requested.0,
        past_deadline: false,
        moves_left: o.spec.moves_left,
        volumes: false,
        unavailable: 0,
        // Not recorded: an ask of another process counts as one of a pod
        // that serves (ahead of no ask of a pod that is down).
        down: false,
        attach: Vec::new(),
        destination: None,
    };
    Some((
        workload,
        Lined {
            ask,
            expires: o.spec.expires.0,
        },
    ))
}

/// When a permit granted at `since` expires once its drain no longer
/// watches its move: the workload's healthy deadline after `since` if it
/// has one, else the deadline of the drain that began the move, and never
/// sooner than `reattach` after `since` (a drain past its deadline bypasses
/// the budget, but its move still holds its permit while its replacement
/// comes up).
pub fn permit_expires(
    since: Timestamp,
    healthy_deadline: Option<Duration>,
    drain_deadline: Timestamp,
    reattach: Duration,
) -> Timestamp {
    let after = |d: Duration| {
        SignedDuration::try_from(d)
            .ok()
            .and_then(|d| since.checked_add(d).ok())
            .unwrap_or(Timestamp::MAX)
    };
    match healthy_deadline {
        Some(d) => after(d),
        None => drain_deadline.max(after(reattach)),
    }
}

/// The workload a move record names (`Kind/name`, in the pod's
/// namespace): its `workload`, else its controller, else the pod itself.
pub fn workload_of_record(ns: &str, mv: &VolumeMove) -> Option<Workload> {
    let named = mv.workload.as_deref().or(mv.controller.as_deref());
    match named.and_then(|w| w.split_once('/')) {
        Some((kind, name)) => Some(Workload::new(kind, ns, name)),
        None => {
            let (_, pod) = mv.pod.split_once('/')?;
            Some(Workload::new("Pod", ns, pod))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::ledger::tests::t;

    #[test]
    fn a_permit_expires_at_its_healthy_deadline_else_its_drains_deadline() {
        let reattach = Duration::from_secs(90);
        // The workload's healthy deadline, from the move's start.
        assert_eq!(
            permit_expires(t(0), Some(Duration::from_secs(600)), t(7200), reattach),
            t(600)
        );
        // Else the drain's deadline...
        assert_eq!(permit_expires(t(0), None, t(7200), reattach), t(7200));
        // ...but a move begun past it still has the reattach timeout.
        assert_eq!(permit_expires(t(7300), None, t(7200), reattach), t(7390));
    }

    #[test]
    fn recorded_moves_name_their_workload_and_machine() {
        let mut m: Machine = serde_json::from_value(serde_json::json!({
            "apiVersion": "berth.dev/v1alpha1",
            "kind": "Machine",
            "metadata": {"namespace": "ns", "name": "a"},
            "spec": {"classRef": {"name": "pool"}}
        }))
        .expect("a Machine");
        let status: crate::api::MachineStatus = serde_json::from_value(serde_json::json!({
            "drain": {"moves": [
                {"pod": "ns/db-0", "uid": "u0", "volumes": ["pv-0"], "workload": "StatefulSet/db",
                 "since": "2023-11-14T22:13:20Z"},
                {"pod": "ns/old-0", "volumes": ["pv-1"], "controller": "ReplicaSet/old"},
                {"pod": "ns/bare", "volumes": ["pv-2"]}
            ]}
        }))
        .expect("status");
        m.status = Some(status);
        let moves = recorded_moves([&m]);
        let names: Vec<(String, &str, &str, &str)> = moves
            .iter()
            .map(|(w, p)| {
                (
                    w.to_string(),
                    p.pod.as_str(),
                    p.uid.as_str(),
                    p.machine.as_str(),
                )
            })
            .collect();
        assert_eq!(
            names,
            vec![
                ("StatefulSet ns/db".to_string(), "ns/db-0", "u0", "ns/a"),
                (
                    "ReplicaSet ns/old".to_string(),
                    "ns/old-0",
                    "ns/old-0",
                    "ns/a"
                ),
                ("Pod ns/bare".to_string(), "ns/bare", "ns/bare", "ns/a"),
            ]
        );
        assert_eq!(moves[0].1.since, t(0));
    }
}
