//! `berth-dev bench` (`make bench`): drain scenarios on the local control plane, measured by
//! the API server's audit log (what each client sent, and when) rather than
//! by the controller itself.
//!
//! Scenarios, each on its own pool of Nodes of one test bed with the
//! configured CSI attach/detach delays:
//!
//! - **stateful**: a StatefulSet of N pods, each with its own CSI volume,
//!   on a Machine that is deleted; a second Machine receives the pods.
//!   Reported: drain wall time against its floor, N times (grace period plus
//!   detach delay plus attach delay), the critical path of a one-at-a-time
//!   volume-aware drain; and the controller-added latency: for each step
//!   that completes on a watch event (pod gone, volume detached, volume
//!   attached on the new Node) the gap until the controller's next API write.
//! - **stateless**: a Deployment of M pods without volumes: wall time
//!   against the grace period.
//! - **API cost**: every request the controller (its own ServiceAccount)
//!   sent during each drain, by verb and resource, per drained pod.
//! - **peers**: the stateful scenario again with `kubectl drain` (the test
//!   bed's kubectl, built from the same Kubernetes release) and, when its
//!   driver is built, Gardener machine-controller-manager's drain package.
//! - **rollout** (see [`rollout`]): a MachineDeployment of N Machines with
//!   stateful and other pods on each, rolled to a new template with the
//!   given `maxSurge` and `maxUnavailable`: wall time against its floor,
//!   stateful pod moves against one each, requests per Machine.
//! - **independent** (see [`ledger`]): N single-replica StatefulSets, each
//!   with its own CSI volume, on one Machine whose class allows N volume
//!   moves at once (`maxParallelVolumeMigrations`); the Machine is deleted
//!   and a second one receives the pods. The move ledger lets independent
//!   workloads move together: wall time against one move (grace period
//!   plus detach delay plus attach delay), and the most moves seen at once.
//! - **shared** (see [`ledger`]): W StatefulSets of M replicas each, one
//!   replica of each on every one of M Machines, all M deleted at once; M
//!   new Machines receive the pods. The move ledger lets one replica of a
//!   workload move at a time across every drain: wall time against the
//!   longest chain (max(M, W) moves one after the other), and the most
//!   replicas of one workload seen moving at once, from the audit log
//!   (must be 1).
//! - **remediation** (see [`remediation`]): a Node that dies with one
//!   replica of a three-replica StatefulSet on it, its Machine in a pool
//!   that remediates: the time until the replica is Ready elsewhere with
//!   its volume, step by step, against the health timeout, the VM's stop
//!   and one move; and the requests it took.
//! - **surge** (see [`surge`]): a singleton Deployment behind a
//!   PodDisruptionBudget of `minAvailable: 1` on a Machine that is deleted,
//!   its class's drain timeout 60 s, a second Machine for the replacement,
//!   whose pods turn Ready `--surge-start` (5 s) after they run. From a
//!   watch of the pods and the audit log: how long the service had no pod
//!   Ready (goal 0 s, where a drain that waits for its deadline and then
//!   deletes the pod has none until the replacement is Ready), the drain's
//!   wall time against that timeout, who removed the old pod, and the
//!   requests it took.
//! - **scale** (see [`scale`]): on a test bed of its own, after the others,
//!   so that its load does not disturb them: 1,000 Machines, 20,000 pods and
//!   5,000 VolumeAttachments in the caches and 20 concurrent drains, with
//!   the controller as a separate process: its peak memory and CPU time by
//!   phase, and each drain's wall time against its floor.
//!
//! `--scenarios` picks which run, e.g. `--scenarios scale` alone.

pub mod audit;
pub mod compare;
pub mod ledger;
mod measure;
mod peers;
pub mod remediation;
pub mod rollout;
pub mod scale;
mod stateful;
mod stateless;
pub mod surge;
mod workloads;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams};
use kube::{Client, ResourceExt};
use serde::Serialize;

use self::audit::Request;
use self::measure::{cost_into, drained_event, gaps, steps};
pub(crate) use self::measure::{pod_gone, pod_ready};
use self::peers::{stateful_kubectl, stateful_mcm};
use self::stateful::stateful_berth;
use self::stateless::stateless_berth;
use self::workloads::{running_on, stateful_on};
use crate::testbed::{Options, TestBed, fixtures, wait};
use berth::api::{Machine, MachineClass};
use berth::providers::Registry;
use berth::providers::fake::FakeProvider;
use berth::telemetry::Metrics;

const NS: &str = "bench";
const SA: &str = "berth-bench";
const LONG: Duration = Duration::from_secs(300);
const PEER_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Stateful pods (each with its own volume) in the stateful scenario.
    #[arg(long, default_value_t = 10)]
    pub stateful: u32,
    /// Pods without volumes in the stateless scenario.
    #[arg(long, default_value_t = 100)]
    pub stateless: u32,
    /// Termination grace period of every pod, in seconds.
    #[arg(long, default_value_t = 1)]
    pub grace: u32,
    /// Simulated CSI attach latency.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub attach_delay: Duration,
    /// Simulated CSI detach latency.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub detach_delay: Duration,
    /// Also run the peers (kubectl drain; MCM's drain when built).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub peers: bool,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/latest.json")]
    pub out: PathBuf,
    /// Scenarios to run, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values_t = [
            Scenario::Stateful,
            Scenario::Stateless,
            Scenario::Peers,
            Scenario::Rollout,
            Scenario::Independent,
            Scenario::Shared,
            Scenario::Remediation,
            Scenario::Surge,
            Scenario::Scale
        ]
    )]
    pub scenarios: Vec<Scenario>,
    /// Machines of the MachineDeployment in the rollout scenario.
    #[arg(long, default_value_t = 10)]
    pub rollout_machines: u32,
    /// Stateful pods (a volume each) on each of its Machines.
    #[arg(long, default_value_t = 2)]
    pub rollout_stateful: u32,
    /// Pods without volumes on each of its Machines.
    #[arg(long, default_value_t = 10)]
    pub rollout_stateless: u32,
    /// The rollout's `maxSurge`, in Machines.
    #[arg(long, default_value_t = 1)]
    pub max_surge: u32,
    /// The rollout's `maxUnavailable`, in Machines.
    #[arg(long, default_value_t = 0)]
    pub max_unavailable: u32,
    /// Single-replica StatefulSets (a volume each) on the one drained
    /// Machine of the independent scenario; its class allows as many
    /// volume moves at once.
    #[arg(long, default_value_t = 10)]
    pub independent_workloads: u32,
    /// Machines drained at once in the shared scenario, and the replicas of
    /// each of its StatefulSets (one on each Machine).
    #[arg(long, default_value_t = 5)]
    pub shared_machines: u32,
    /// StatefulSets (a volume per replica) spread over the Machines of the
    /// shared scenario.
    #[arg(long, default_value_t = 3)]
    pub shared_workloads: u32,
    /// How long a pod of the surge scenario's Deployment takes to turn
    /// Ready once it runs (the test bed's `ready-after` annotation): its
    /// replacement's start (0: Ready at once, as kwok starts pods).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub surge_start: Duration,
    /// Machines (and so Nodes) in the scale scenario.
    #[arg(long, default_value_t = 1000)]
    pub scale_machines: u32,
    /// Pods in the scale scenario.
    #[arg(long, default_value_t = 20_000)]
    pub scale_pods: u32,
    /// VolumeAttachments in the scale scenario.
    #[arg(long, default_value_t = 5000)]
    pub scale_attachments: u32,
    /// Machines drained at once in the scale scenario.
    #[arg(long, default_value_t = 20)]
    pub scale_drains: u32,
}

/// The benchmark's scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// berth drains a StatefulSet, one volume at a time.
    Stateful,
    /// berth drains a Deployment without volumes.
    Stateless,
    /// `kubectl drain` and MCM's drain on the stateful workload (also needs
    /// `--peers`).
    Peers,
    /// A MachineDeployment rolled to a new template.
    Rollout,
    /// The move ledger lets independent workloads on one Machine move
    /// their volumes at once.
    Independent,
    /// The move ledger moves one replica of a workload at a time across
    /// Machines drained at once.
    Shared,
    /// A Node that dies: its Machine fenced, freed and replaced.
    Remediation,
    /// A singleton Deployment behind `minAvailable: 1`, drained: its
    /// replacement Ready before its pod goes.
    Surge,
    /// Many Machines, pods and VolumeAttachments; concurrent drains;
    /// the controller's memory and CPU.
    Scale,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub when: String,
    pub hardware: String,
    pub settings: Settings,
    pub runs: Vec<Run>,
    /// Each peer against berth in the same scenario.
    pub ratios: Vec<compare::Ratio>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollout: Option<rollout::Rollout>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remediation: Option<remediation::Remediation>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub surge: Option<surge::Surge>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale: Option<scale::Scale>,
}

#[derive(Debug, Serialize)]
pub struct Settings {
    pub stateful_pods: u32,
    pub stateless_pods: u32,
    pub grace_seconds: u32,
    pub attach_delay_seconds: f64,
    pub detach_delay_seconds: f64,
}

#[derive(Debug, Serialize, Default)]
pub struct Run {
    pub scenario: String,
    pub drainer: String,
    pub pods: u32,
    pub wall_seconds: Option<f64>,
    pub floor_seconds: f64,
    /// Controller-added latency, milliseconds, by step.
    pub gaps_ms: BTreeMap<String, Gaps>,
    /// Requests by `verb resource`, during the drain.
    pub api_requests: BTreeMap<String, u32>,
    pub api_requests_per_pod: f64,
    pub reads_during_drain: u32,
    /// The move ledger's scenarios: the most replicas of one workload
    /// moving at once (accepted eviction to volume attached where the
    /// replacement runs), from the audit log.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_moving_per_workload: Option<u32>,
    /// The move ledger's scenarios: the most moves of any workloads at
    /// once, measured the same way.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_moving_at_once: Option<u32>,
    pub note: Option<String>,
}

#[derive(Debug, Serialize, Default)]
pub struct Gaps {
    pub n: usize,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Gaps {
    fn of(values: &[f64]) -> Self {
        Self {
            n: values.len(),
            p50: audit::percentile(values, 50.0),
            p99: audit::percentile(values, 99.0),
            max: values.iter().copied().reduce(f64::max),
        }
    }
}

/// Runs the chosen scenarios and writes the report.
///
/// # Errors
/// A scenario that cannot be set up or does not finish (the scale scenario
/// reports its failure in the report instead).
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let wants = |s: Scenario| args.scenarios.contains(&s);
    let (runs, rollout, remediation, surge) = if wants(Scenario::Stateful)
        || wants(Scenario::Stateless)
        || (args.peers && wants(Scenario::Peers))
        || wants(Scenario::Rollout)
        || wants(Scenario::Independent)
        || wants(Scenario::Shared)
        || wants(Scenario::Remediation)
        || wants(Scenario::Surge)
    {
        drains(&args).await?
    } else {
        (Vec::new(), None, None, None)
    };
    // After the others, on a test bed of its own.
    let scale = if wants(Scenario::Scale) {
        Some(scale::run(&args).await)
    } else {
        None
    };

    let report = Report {
        when: Timestamp::now().to_string(),
        hardware: hardware(),
        settings: Settings {
            stateful_pods: args.stateful,
            stateless_pods: args.stateless,
            grace_seconds: args.grace,
            attach_delay_seconds: args.attach_delay.as_secs_f64(),
            detach_delay_seconds: args.detach_delay.as_secs_f64(),
        },
        ratios: compare::ratios(&runs),
        runs,
        rollout,
        remediation,
        surge,
        scale,
    };
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)? + "\n")?;
    print!("{}", table(&report));
    println!("written to {}", args.out.display());
    Ok(())
}

/// What the scenarios on the drains' test bed measured.
type Drains = (
    Vec<Run>,
    Option<rollout::Rollout>,
    Option<remediation::Remediation>,
    Option<surge::Surge>,
);

/// The stateful, stateless, peer, rollout, move ledger, remediation and
/// surge scenarios that were chosen, on one test bed with the audit log on and
/// the controller in this process. The test bed is gone when this returns.
async fn drains(args: &BenchArgs) -> anyhow::Result<Drains> {
    let wants = |s: Scenario| args.scenarios.contains(&s);
    let bed = TestBed::start(
        Options::end_to_end()
            .attach_delay(args.attach_delay)
            .detach_delay(args.detach_delay)
            .audit(true),
    )
    .await?;
    let admin = admin_client(&bed).await?;
    let id = controller_client(&bed, &admin).await?;
    let (controller, user) = (id.client().await?, id.user);

    let metrics = Arc::new(Metrics::new()?);
    // The fake provider stands for the cloud and the kubelet registering
    // its Node: a client of its own, so that its writes are not counted
    // as the controller's.
    let mut controller = berth::wiring::manager::spawn(
        controller.clone(),
        Registry::default().with(Arc::new(FakeProvider::new(admin.clone()))),
        berth::wiring::manager::Settings {
            namespace: Some(NS.into()),
            instance: "berth-bench".into(),
            ..Default::default()
        },
        Arc::clone(&metrics),
    );
    (&mut controller.ready)
        .await
        .context("the controller did not start")?;

    let mut runs = Vec::new();
    let audit_log = bed.dir().join("audit.log");
    if wants(Scenario::Stateful) {
        runs.push(stateful_berth(&admin, args, &audit_log, &user).await?);
    }
    if wants(Scenario::Stateless) {
        runs.push(stateless_berth(&admin, args, &audit_log, &user).await?);
    }
    if args.peers && wants(Scenario::Peers) {
        runs.push(
            stateful_kubectl(&admin, &bed, args, &audit_log)
                .await
                .unwrap_or_else(|e| Run {
                    scenario: "stateful".into(),
                    drainer: "kubectl drain".into(),
                    pods: args.stateful,
                    note: Some(format!("failed: {e:#}")),
                    ..Default::default()
                }),
        );
        runs.push(stateful_mcm(&admin, &bed, args, &audit_log).await);
    }
    let rollout = if wants(Scenario::Rollout) {
        Some(
            rollout::run(&admin, args, &audit_log, &user)
                .await
                .unwrap_or_else(|e| rollout::Rollout {
                    note: Some(format!("failed: {e:#}")),
                    ..Default::default()
                }),
        )
    } else {
        None
    };
    if wants(Scenario::Independent) {
        runs.push(ledger::or_failed(
            "independent",
            args.independent_workloads,
            ledger::independent(&admin, args, &audit_log, &user).await,
        ));
    }
    if wants(Scenario::Shared) {
        runs.push(ledger::or_failed(
            "shared",
            args.shared_machines * args.shared_workloads,
            ledger::shared(&admin, args, &audit_log, &user).await,
        ));
    }
    let remediation = if wants(Scenario::Remediation) {
        Some(remediation::or_failed(
            remediation::run(&admin, args, &audit_log, &user).await,
        ))
    } else {
        None
    };
    let surge = if wants(Scenario::Surge) {
        Some(surge::or_failed(
            surge::run(&admin, args, &audit_log, &user).await,
        ))
    } else {
        None
    };
    controller.stop(Duration::from_secs(30)).await;
    Ok((runs, rollout, remediation, surge))
}

/// The controller's user name on the API server.
fn controller_user() -> String {
    crate::testbed::service_account_user(NS, SA)
}

/// The admin client of a fresh bench test bed, with the CRDs installed and
/// the bench namespace created.
async fn admin_client(bed: &TestBed) -> anyhow::Result<Client> {
    let admin = bed.client().await?;
    berth::api::install_crds(admin.clone(), LONG).await?;
    crate::testbed::create_or_keep(
        Api::<Namespace>::all(admin.clone()),
        fixtures::namespace(NS),
    )
    .await?;
    Ok(admin)
}

/// A client for the controller with an identity of its own (a
/// ServiceAccount token), so the audit log tells its requests apart; and
/// its kubeconfig, for a controller process.
async fn controller_client(
    bed: &TestBed,
    admin: &Client,
) -> anyhow::Result<crate::testbed::Identity> {
    bed.identity(admin, NS, SA).await
}

async fn pool_class(admin: &Client, pool: &str) -> anyhow::Result<()> {
    pool_class_with(admin, pool, serde_json::json!({"timeout": "30m"})).await
}

/// The class of `pool`, with drain settings `drain` (the MachineClass's
/// `spec.drain`, camelCase).
async fn pool_class_with(
    admin: &Client,
    pool: &str,
    drain: serde_json::Value,
) -> anyhow::Result<()> {
    crate::testbed::create_or_keep(
        Api::<MachineClass>::all(admin.clone()),
        fixtures::pool_class(pool, pool, drain),
    )
    .await?;
    Ok(())
}

/// A Machine of `class` in the bench namespace.
fn machine_object(name: &str, class: &str) -> anyhow::Result<Machine> {
    let mut m = fixtures::machine(name, class);
    m.metadata.namespace = Some(NS.into());
    Ok(m)
}

async fn machine(admin: &Client, name: &str, class: &str) -> anyhow::Result<String> {
    let machines: Api<Machine> = Api::namespaced(admin.clone(), NS);
    crate::testbed::create_or_keep(machines.clone(), machine_object(name, class)?).await?;
    wait::for_one(machines, LONG, "Machine Running", |m| {
        m.name_any() == name
            && m.status.as_ref().and_then(|s| s.phase) == Some(berth::api::MachinePhase::Running)
    })
    .await?;
    Ok(FakeProvider::node_name(NS, name))
}

/// VolumeAttachment names by PV, on `node`.
async fn attachments_on(admin: &Client, node: &str) -> anyhow::Result<BTreeMap<String, String>> {
    Ok(Api::<VolumeAttachment>::all(admin.clone())
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|va| va.spec.node_name == node)
        .filter_map(|va| {
            Some((
                va.spec.source.persistent_volume_name.clone()?,
                va.name_any(),
            ))
        })
        .collect())
}

fn read_audit(path: &std::path::Path) -> anyhow::Result<Vec<Request>> {
    Ok(audit::parse(&std::fs::read_to_string(path).with_context(
        || format!("reading the audit log {}", path.display()),
    )?))
}

/// The object's last write by a client whose user agent contains `agent`
/// (by completion).
fn last_write_by<'a>(
    log: &'a [Request],
    agent: &str,
    resource: &str,
    name: &str,
) -> Option<&'a Request> {
    log.iter()
        .filter(|r| r.user_agent.contains(agent) && r.is_write())
        .filter(|r| r.resource == resource && r.name.as_deref() == Some(name))
        .max_by_key(|r| r.completed)
}

/// The object's first write to `subresource` by a client whose user agent
/// contains `agent` (by completion).
fn first_write_by<'a>(
    log: &'a [Request],
    agent: &str,
    resource: &str,
    name: &str,
    subresource: &str,
) -> Option<&'a Request> {
    log.iter()
        .filter(|r| r.user_agent.contains(agent) && r.is_write())
        .filter(|r| r.resource == resource && r.name.as_deref() == Some(name))
        .filter(|r| r.subresource.as_deref() == Some(subresource))
        .min_by_key(|r| r.completed)
}

fn secs(from: Timestamp, to: Timestamp) -> f64 {
    to.duration_since(from).as_secs_f64()
}

/// The admin's `delete machines/<name>` in the audit log.
fn deleted_at(log: &[Request], resource: &str, name: &str) -> Option<Timestamp> {
    log.iter()
        .filter(|r| r.verb == "delete" && r.resource == resource && r.name.as_deref() == Some(name))
        .map(|r| r.received)
        .min()
}

fn hardware() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("0").to_string())
        })
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| format!("{} GiB", kb / 1024 / 1024))
        .unwrap_or_default();
    format!("{cpu}, {cores} cores, {mem}")
}

/// The short table printed after a run.
pub fn table(r: &Report) -> String {
    let mut out = format!("berth-dev bench — {} — {}\n", r.when, r.hardware);
    if !r.runs.is_empty() {
        out.push_str("scenario    drainer                           pods  wall(s)  floor(s)  gap p50/p99/max ms (reattached)  req/pod  reads\n");
    }
    for run in &r.runs {
        let g = run.gaps_ms.get("reattached");
        let gap = g
            .map(|g| {
                format!(
                    "{:.0}/{:.0}/{:.0}",
                    g.p50.unwrap_or(f64::NAN),
                    g.p99.unwrap_or(f64::NAN),
                    g.max.unwrap_or(f64::NAN)
                )
            })
            .unwrap_or_else(|| "-".into());
        out.push_str(&format!(
            "{:<11} {:<33} {:>4}  {:>7}  {:>8.1}  {:>31}  {:>7.1}  {:>5}\n",
            run.scenario,
            run.drainer,
            run.pods,
            run.wall_seconds
                .map(|w| format!("{w:.1}"))
                .unwrap_or_else(|| "-".into()),
            run.floor_seconds,
            gap,
            run.api_requests_per_pod,
            run.reads_during_drain,
        ));
        if let (Some(one), Some(all)) = (run.max_moving_per_workload, run.max_moving_at_once) {
            out.push_str(&format!(
                "            moving at once: at most {one} of one workload, {all} in all\n"
            ));
        }
        if let Some(n) = &run.note {
            out.push_str(&format!("            note: {n}\n"));
        }
    }
    for ratio in &r.ratios {
        let x = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.2} ×"));
        out.push_str(&format!(
            "{:<11} {:<33} vs berth: wall {}, requests per pod {}, {:+} reads\n",
            ratio.scenario,
            ratio.drainer,
            x(ratio.wall),
            x(ratio.api_requests_per_pod),
            ratio.extra_reads_during_drain,
        ));
    }
    if let Some(ro) = &r.rollout {
        out.push_str(&rollout::table(ro));
    }
    if let Some(rm) = &r.remediation {
        out.push_str(&remediation::lines(rm));
    }
    if let Some(s) = &r.surge {
        out.push_str(&surge::lines(s));
    }
    if let Some(s) = &r.scale {
        out.push_str(&scale::table(s));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn every_scenario_runs_by_default_and_one_can_run_alone() {
        let all = Cli::try_parse_from(["bench"]).expect("defaults").bench;
        assert_eq!(
            all.scenarios,
            [
                Scenario::Stateful,
                Scenario::Stateless,
                Scenario::Peers,
                Scenario::Rollout,
                Scenario::Independent,
                Scenario::Shared,
                Scenario::Remediation,
                Scenario::Surge,
                Scenario::Scale
            ]
        );
        assert_eq!(
            (
                all.independent_workloads,
                all.shared_machines,
                all.shared_workloads
            ),
            (10, 5, 3)
        );
        assert_eq!(
            (
                all.rollout_machines,
                all.rollout_stateful,
                all.rollout_stateless,
                all.max_surge,
                all.max_unavailable
            ),
            (10, 2, 10, 1, 0)
        );
        assert_eq!(
            (
                all.scale_machines,
                all.scale_pods,
                all.scale_attachments,
                all.scale_drains
            ),
            (1000, 20_000, 5000, 20)
        );
        let one = Cli::try_parse_from(["bench", "--scenarios", "scale", "--scale-drains", "4"])
            .expect("valid flags")
            .bench;
        assert_eq!(one.scenarios, [Scenario::Scale]);
        assert_eq!(one.scale_drains, 4);
        let two = Cli::try_parse_from(["bench", "--scenarios=stateful,peers"])
            .expect("a list")
            .bench;
        assert_eq!(two.scenarios, [Scenario::Stateful, Scenario::Peers]);
        let ledger = Cli::try_parse_from(["bench", "--scenarios=independent,shared"])
            .expect("kebab-case names")
            .bench;
        assert_eq!(ledger.scenarios, [Scenario::Independent, Scenario::Shared]);
        assert_eq!(all.surge_start, Duration::from_secs(5));
        let surge = Cli::try_parse_from(["bench", "--scenarios", "surge", "--surge-start", "0s"])
            .expect("the surge scenario")
            .bench;
        assert_eq!(surge.scenarios, [Scenario::Surge]);
        assert_eq!(surge.surge_start, Duration::ZERO);
        assert!(Cli::try_parse_from(["bench", "--scenarios=huge"]).is_err());
    }

    #[test]
    fn a_report_without_the_scale_scenario_keeps_its_shape() {
        let report = Report {
            when: "now".into(),
            hardware: "hw".into(),
            settings: Settings {
                stateful_pods: 1,
                stateless_pods: 1,
                grace_seconds: 1,
                attach_delay_seconds: 1.0,
                detach_delay_seconds: 1.0,
            },
            runs: vec![],
            ratios: vec![],
            rollout: None,
            remediation: None,
            surge: None,
            scale: None,
        };
        let json = serde_json::to_value(&report).expect("JSON");
        assert!(json.get("scale").is_none());
        assert!(json.get("rollout").is_none());
        assert!(json.get("surge").is_none());
        assert!(json.get("runs").is_some());
    }
}
