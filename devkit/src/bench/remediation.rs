//! The remediation scenario: a Node that dies with one replica of a
//! three-replica StatefulSet on it. Its Machine belongs to a MachineSet of
//! three whose class remediates (`policy: Replace`, a 10 s health timeout,
//! a fake cloud whose stop takes 2 s); a spare Machine of the pool can
//! take the replica. The test bed's kwok kills the Node (its
//! `testbed.berth.dev/dead` annotation): from its NotReady write on, the
//! audit log gives each step as the API server received it: the VM
//! stopped (the fake cloud's record written), the Node tainted out of
//! service, the pod deleted, its volume attached on another Node, the
//! replica Ready there.
//!
//! Goal: the health timeout, the stop and one move (detach plus attach),
//! each the bed's. Without berth the cluster's own path is the pod
//! stuck Terminating (no kubelet confirms it) and, for a deleted pod,
//! six minutes before the attach-detach controller force-detaches its
//! volume: the replica does not come back at all.

use std::collections::BTreeSet;

use super::*;
use crate::testbed::stages::DEAD_ANNOTATION;

const POOL: &str = "bench-remedy";
const SET: &str = "bench-remedy";
const HEALTH: Duration = Duration::from_secs(10);
const STOP: Duration = Duration::from_secs(2);

/// What the scenario measured.
#[derive(Debug, Serialize, Default)]
pub struct Remediation {
    pub health_timeout_seconds: f64,
    pub stop_seconds: f64,
    /// Health timeout, stop, detach and attach delays.
    pub goal_seconds: f64,
    /// From the Node's NotReady to the replica Ready on another Node with
    /// its volume attached there.
    pub wall_seconds: Option<f64>,
    /// Each step, seconds after the Node's NotReady.
    pub steps_seconds: BTreeMap<String, f64>,
    /// The controller's requests from the Node's death to the replica
    /// back, by verb and resource.
    pub api_requests: BTreeMap<String, u32>,
    pub api_requests_total: u32,
    pub note: Option<String>,
}

/// A run that failed, with the failure as its note.
pub(super) fn or_failed(r: anyhow::Result<Remediation>) -> Remediation {
    r.unwrap_or_else(|e| Remediation {
        note: Some(format!("failed: {e:#}")),
        ..Default::default()
    })
}

/// Runs the scenario (see the module) with the controller `user` running.
pub(super) async fn run(
    admin: &Client,
    args: &BenchArgs,
    audit_log: &std::path::Path,
    user: &str,
) -> anyhow::Result<Remediation> {
    let mut class = fixtures::pool_class(POOL, POOL, serde_json::json!({"timeout": "30m"}));
    class.spec.health_timeout = Some(format!("{}s", HEALTH.as_secs()));
    class.spec.remediation = Some(serde_json::from_value(
        serde_json::json!({"policy": "Replace"}),
    )?);
    if let Some(spec) = class.spec.provider_spec.as_mut() {
        spec["stopDelay"] = format!("{}s", STOP.as_secs()).into();
    }
    crate::testbed::create_or_keep(Api::<MachineClass>::all(admin.clone()), class).await?;
    let mut set = fixtures::machine_set(SET, POOL, 3);
    set.metadata.namespace = Some(NS.into());
    crate::testbed::create_or_keep(Api::namespaced(admin.clone(), NS), set).await?;
    let machines: Api<Machine> = Api::namespaced(admin.clone(), NS);
    let of_set = |m: &Machine| berth::api::set_owner(m).is_some_and(|(s, _)| s == SET);
    wait::until(machines.clone(), LONG, "the set's Machines run", |ms| {
        ms.iter()
            .filter(|m| {
                of_set(m)
                    && m.status.as_ref().and_then(|s| s.phase)
                        == Some(berth::api::MachinePhase::Running)
            })
            .count()
            == 3
    })
    .await?;

    // One replica per Machine of the set, then the spare that takes one.
    workloads::volumes_for(admin, POOL, "db", 3).await?;
    let mut sts = fixtures::stateful_set_in_pool("db", 3, i64::from(args.grace), POOL, None);
    if let Some(spec) = sts.spec.template.spec.as_mut() {
        spec.affinity = Some(serde_json::from_value(
            serde_json::json!({"podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {"matchLabels": {"app": "db"}},
                "topologyKey": "kubernetes.io/hostname"}]}}),
        )?);
    }
    crate::testbed::create_or_keep(Api::namespaced(admin.clone(), NS), sts).await?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let running = wait::until(pods.clone(), LONG, "db runs", |ps| {
        ps.iter()
            .filter(|p| {
                p.name_any().starts_with("db-")
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            })
            .count()
            == 3
    })
    .await?;
    let dead = running
        .iter()
        .find(|p| p.name_any() == "db-0")
        .and_then(|p| p.spec.as_ref()?.node_name.clone())
        .context("db-0 runs on a Node")?;
    let nodes: BTreeSet<String> = running
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();
    workloads::attached_on(admin, &nodes, 3).await?;
    super::machine(admin, "bench-remedy-spare", POOL).await?;
    let old_uid = running
        .iter()
        .find(|p| p.name_any() == "db-0")
        .and_then(|p| p.metadata.uid.clone())
        .unwrap_or_default();

    let killed = Timestamp::now();
    Api::<Node>::all(admin.clone())
        .patch(
            &dead,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                serde_json::json!({"metadata": {"annotations": {DEAD_ANNOTATION: "true"}}}),
            ),
        )
        .await?;
    let back = wait::for_one(pods.clone(), LONG, "db-0 back elsewhere", |p| {
        p.name_any() == "db-0"
            && p.metadata.uid.as_deref() != Some(old_uid.as_str())
            && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(dead.as_str())
            && is_ready(p)
    })
    .await?;
    let there = back
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let pv = format!("{POOL}-db-0");
    workloads::attached_on(admin, &BTreeSet::from([there.clone()]), 1).await?;
    let va = attachments_on(admin, &there)
        .await?
        .remove(&pv)
        .context("db-0's volume attached where it runs")?;
    // The audit log is written as requests complete: let the last land.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let log = read_audit(audit_log)?;
    let k = Killed {
        at: killed,
        node: &dead,
        va: &va,
        back: &back,
        one_move: args.detach_delay + args.attach_delay,
        vm: FakeProvider::vm_name(
            dead.strip_prefix(&format!("{NS}-"))
                .context("a fake Machine's Node")?,
        ),
    };
    measured(&log, user, &k)
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// What the scenario did, to read the audit log by.
struct Killed<'a> {
    at: Timestamp,
    node: &'a str,
    /// The VolumeAttachment of db-0's PV where its replacement runs.
    va: &'a str,
    /// The replacement, Ready.
    back: &'a Pod,
    /// The bed's detach and attach delays.
    one_move: Duration,
    /// The fake VM (its ConfigMap) of the dead Node's Machine.
    vm: String,
}

/// The steps, from the audit log.
fn measured(log: &[Request], user: &str, k: &Killed<'_>) -> anyhow::Result<Remediation> {
    let after = |r: &&Request| r.received >= k.at && (200..300).contains(&r.code);
    let named = |r: &Request, resource: &str, sub: Option<&str>, name: &str| {
        r.resource == resource && r.subresource.as_deref() == sub && r.name.as_deref() == Some(name)
    };
    let not_ready = log
        .iter()
        .filter(after)
        .find(|r| r.user != user && named(r, "nodes", Some("status"), k.node))
        .context("kwok's NotReady write")?
        .received;
    let vm = log
        .iter()
        .filter(after)
        // The fake cloud's own write (the bench gives it a client of its
        // own, not the controller's).
        .filter(|r| r.resource == "configmaps" && r.verb == "patch")
        .filter(|r| r.name.as_deref() == Some(k.vm.as_str()))
        .map(|r| r.received)
        .max()
        .context("the VM's stop")?;
    let tainted = log
        .iter()
        .filter(after)
        .filter(|r| r.received > vm && r.user == user && r.verb == "patch")
        .find(|r| named(r, "nodes", None, k.node))
        .context("the taint")?
        .received;
    let deleted = log
        .iter()
        .filter(after)
        .find(|r| r.user == user && r.verb == "delete" && named(r, "pods", None, "db-0"))
        .context("db-0 deleted")?
        .received;
    let attached = log
        .iter()
        .filter(after)
        .find(|r| named(r, "volumeattachments", Some("status"), k.va))
        .context("the attach where it runs")?
        .received;
    let ready = k
        .back
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready" && c.status == "True"))
        .and_then(|c| c.last_transition_time.as_ref())
        .map_or(attached, |t| t.0.max(attached));
    let since = |t: Timestamp| t.duration_since(not_ready).as_secs_f64();
    let steps = BTreeMap::from([
        ("1 VM stopped".to_string(), since(vm)),
        ("2 Node tainted out of service".to_string(), since(tainted)),
        ("3 pod deleted".to_string(), since(deleted)),
        ("4 volume attached elsewhere".to_string(), since(attached)),
        ("5 replica Ready".to_string(), since(ready)),
    ]);
    let api_requests = audit::cost(log, user, k.at, ready.max(attached));
    Ok(Remediation {
        health_timeout_seconds: HEALTH.as_secs_f64(),
        stop_seconds: STOP.as_secs_f64(),
        goal_seconds: (HEALTH + STOP + k.one_move).as_secs_f64(),
        wall_seconds: Some(since(ready.max(attached))),
        steps_seconds: steps,
        api_requests_total: api_requests.values().sum(),
        api_requests,
        note: None,
    })
}

/// The scenario's lines of the report table.
pub(super) fn lines(r: &Remediation) -> String {
    if let Some(note) = &r.note {
        return format!("remediation: {note}\n");
    }
    let mut out = format!(
        "remediation: replica back {} s after its Node went NotReady (goal {:.1} s: health timeout {:.0} s + stop {:.0} s + one move); {} requests\n",
        r.wall_seconds.map_or("-".into(), |w| format!("{w:.1}")),
        r.goal_seconds,
        r.health_timeout_seconds,
        r.stop_seconds,
        r.api_requests_total,
    );
    for (step, s) in &r.steps_seconds {
        out.push_str(&format!("    {step:<32} {s:>6.1} s\n"));
    }
    let requests: Vec<String> = r
        .api_requests
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    out.push_str(&format!("    requests: {}\n", requests.join(", ")));
    out
}
