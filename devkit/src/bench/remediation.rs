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
//! The StatefulSet is `remedy-db`, its claims `data-remedy-db-<i>`: names
//! of its own, as the scenarios share one namespace on one test bed (the
//! stateful scenario's StatefulSet is `stateful-db`). Each is created, not
//! kept: an object of that name already there is an error.
//!
//! Goal: the health timeout, the stop and one move (detach plus attach),
//! each the bed's. Without berth the cluster's own path is the pod
//! stuck Terminating (no kubelet confirms it) and, for a deleted pod,
//! six minutes before the attach-detach controller force-detaches its
//! volume: the replica does not come back at all.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::PostParams;

use super::*;
use crate::testbed::stages::DEAD_ANNOTATION;

const POOL: &str = "bench-remedy";
const SET: &str = "bench-remedy";
/// The StatefulSet, one replica on each Machine of the set.
const STS: &str = "remedy-db";
const REPLICAS: u32 = 3;
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

    // One replica per Machine of the set, each on a claim bound before
    // the StatefulSet comes; then the spare that takes one.
    bound_claims(admin).await?;
    let mut sts = fixtures::stateful_set_in_pool(
        STS,
        i32::try_from(REPLICAS)?,
        i64::from(args.grace),
        POOL,
        None,
    );
    if let Some(spec) = sts.spec.template.spec.as_mut() {
        spec.affinity = Some(serde_json::from_value(
            serde_json::json!({"podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {"matchLabels": {"app": STS}},
                "topologyKey": "kubernetes.io/hostname"}]}}),
        )?);
    }
    Api::<StatefulSet>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &sts)
        .await
        .with_context(|| format!("creating StatefulSet {NS}/{STS} (one of that name left?)"))?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let names: Vec<String> = (0..REPLICAS).map(pod_of).collect();
    wait::until(
        pods.clone(),
        LONG,
        &format!("set-up: {} Running", names.join(", ")),
        |ps| {
            names.iter().all(|n| {
                ps.iter().any(|p| {
                    p.name_any() == *n
                        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                })
            })
        },
    )
    .await?;
    super::machine(admin, "bench-remedy-spare", POOL).await?;
    // Each replica's PV, by its pod.
    let volumes: BTreeMap<String, String> = (0..REPLICAS).map(|i| (pod_of(i), pv_of(i))).collect();
    // Where the replicas run right before the kill, each volume attached
    // there.
    let now =
        workloads::attached_where_pods_run(admin, "set-up: volumes attached", &volumes).await?;
    let first = pod_of(0);
    let victim = now
        .iter()
        .find(|p| p.name_any() == first)
        .with_context(|| format!("{first} runs"))?;
    let dead = victim
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .with_context(|| format!("{first} runs on a Node"))?;
    let old_uid = victim.metadata.uid.clone().unwrap_or_default();

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
    let back = wait::for_one(
        pods.clone(),
        LONG,
        &format!("{first} back elsewhere"),
        |p| {
            p.name_any() == first
                && p.metadata.uid.as_deref() != Some(old_uid.as_str())
                && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(dead.as_str())
                && is_ready(p)
        },
    )
    .await?;
    let there = back
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    workloads::attached_where_pods_run(
        admin,
        "after the kill: volumes attached where the replacements run",
        &volumes,
    )
    .await?;
    let va = attachments_on(admin, &there)
        .await?
        .remove(&pv_of(0))
        .with_context(|| format!("{first}'s volume attached where it runs"))?;
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

/// The pod of replica `i`.
fn pod_of(i: u32) -> String {
    format!("{STS}-{i}")
}

/// The pre-bound PV of replica `i` (named as `stateful_on` names them).
fn pv_of(i: u32) -> String {
    format!("{POOL}-{STS}-{i}")
}

/// The claim of replica `i` (the StatefulSet's claim template `data`).
fn claim_of(i: u32) -> String {
    format!("data-{STS}-{i}")
}

/// Each replica's CSI PV and its claim, pre-bound to each other (the PV's
/// `claimRef`, the claim's `volumeName`, as the tests pre-bind a claim),
/// created rather than kept, and waited for until every claim is Bound:
/// the StatefulSet then takes claims that exist and are bound, so its pods
/// never reach the attach-detach controller with a claim not yet Bound.
async fn bound_claims(admin: &Client) -> anyhow::Result<()> {
    let pvs: Api<PersistentVolume> = Api::all(admin.clone());
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), NS);
    for i in 0..REPLICAS {
        let (pv, claim) = (pv_of(i), claim_of(i));
        pvs.create(
            &PostParams::default(),
            &fixtures::csi_pv(&pv, &format!("vol-{pv}"), NS, &claim),
        )
        .await
        .with_context(|| format!("creating PersistentVolume {pv} (one of that name left?)"))?;
        let c: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}}
            }
        }))?;
        claims
            .create(&PostParams::default(), &c)
            .await
            .with_context(|| {
                format!("creating PersistentVolumeClaim {NS}/{claim} (one of that name left?)")
            })?;
    }
    let names: Vec<String> = (0..REPLICAS).map(claim_of).collect();
    wait::until(
        claims,
        LONG,
        &format!("set-up: claims {} Bound", names.join(", ")),
        |cs| {
            names.iter().all(|n| {
                cs.iter().any(|c| {
                    c.name_any() == *n
                        && c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
                })
            })
        },
    )
    .await?;
    Ok(())
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
    /// The VolumeAttachment of the first replica's PV where its
    /// replacement runs.
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
    let pod = pod_of(0);
    let deleted = log
        .iter()
        .filter(after)
        .find(|r| r.user == user && r.verb == "delete" && named(r, "pods", None, &pod))
        .with_context(|| format!("{pod} deleted"))?
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
