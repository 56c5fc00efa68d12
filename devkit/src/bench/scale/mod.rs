//! The scale scenario: many Machines, many pods and VolumeAttachments in
//! the controller's caches, and concurrent drains, with the controller as a
//! separate `berth run` process so that its memory and CPU are its own.
//!
//! On a fresh test bed of its own (end-to-end profile, the benchmark's
//! attach/detach delays; the audit log keeps only the controller's
//! requests):
//!
//! 1. **Populate**, through a first controller process: MachineClasses with
//!    the fake provider, all Machines (the provider registers their Nodes,
//!    which kwok brings to Ready), then the workloads: on each Machine to
//!    be drained, a StatefulSet of 0 to [`STATEFUL_MAX`] pods with a CSI
//!    volume each and a Deployment of [`STATELESS_PER_DRAIN`] pods, in a
//!    pool of its own; bare background pods (`spec.nodeName` set, no
//!    scheduler) spread over the other Nodes; background PersistentVolumes
//!    and VolumeAttachments (an attacher nobody serves, `status.attached`
//!    set through the status subresource) on those Nodes, so that the
//!    cluster holds the requested number of attachments. Last, a receiving
//!    Machine in each drain pool for the replacements. Then the bed is
//!    left to **settle**: until the API server serves fewer than
//!    [`SETTLED_WRITES_PER_SECOND`] writes, so that no backlog of the
//!    populate competes with the drains.
//! 2. **Sync**: the populate controller is stopped and a fresh one started,
//!    so that its caches are filled by one initial list of the whole
//!    cluster, as after a restart in production. The phase ends when it is
//!    ready and its pass over every Machine is over (its reconciles per
//!    second have fallen below [`settled_rate`]).
//! 3. **Idle** for [`IDLE`]: nothing changes but kwok's Node heartbeats.
//! 4. **Drains**: every drained Machine deleted at once. A drain's wall
//!    time runs from its delete request to its end, `status.drain.finishedAt`
//!    with outcome `Drained` (as in the stateless scenario; for stateful pods
//!    that follows the last volume attached on the new Node); its floor comes from the pods that were on
//!    its Node: each stateful pod's grace period plus detach and attach
//!    delays (one volume at a time), or the longest grace period when it
//!    had only stateless pods.
//!
//! The controller's CPU time and memory come from `/proc/<pid>`: `VmRSS`
//! sampled every [`SAMPLE_EVERY`], `VmHWM` (the peak) read just before it is
//! stopped, `utime + stime` at each phase boundary. Its reconciles come from
//! its `/metrics`, its API requests from the audit log. Each phase also
//! reports the CPU of each test bed process, from the same `/proc` fields.
//!
//! This module runs the phases and holds the result's types; `plan`
//! splits the requested numbers and computes floors (pure), `populate`
//! fills the bed, `controller` supervises the measured `berth run`,
//! `procfs` reads `/proc`, `apiserver` reads the API server's metrics,
//! `drains` deletes and times the drains, and `report` prints them.

mod apiserver;
mod controller;
mod drains;
mod plan;
mod populate;
mod procfs;
mod report;

/// The rollout scenario waits for a settled test bed too.
pub(super) use self::apiserver::settle;
use self::apiserver::*;
use self::controller::*;
pub use self::drains::*;
pub use self::plan::*;
use self::populate::*;
use self::procfs::*;
pub use self::report::table;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, PersistentVolume, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{BenchArgs, LONG, NS};
use crate::testbed::{Options, TestBed, fixtures};
use berth::api::{Machine, MachinePhase};
use berth::providers::fake::FakeProvider;

/// Every pod the scenario creates carries this label, valued `drain` (on a
/// Machine to be drained) or `background`.
const SCALE_LABEL: &str = "bench.berth.dev/scale";
/// The class of the background Machines (also their pool).
const BG_CLASS: &str = "scale-bg";
/// The attacher of the background VolumeAttachments: no CSI attacher serves
/// it, so neither kwok nor the attach-detach controller touches them.
const BG_ATTACHER: &str = "scale.bench.invalid";
/// The storage class of the background PersistentVolumes: no claim asks for
/// it, so the PersistentVolume controller never binds a StatefulSet's claim
/// to one of them instead of its own pre-bound volume.
const BG_STORAGE_CLASS: &str = "scale-bench-background";
/// Drained Machine `i` carries `i mod (STATEFUL_MAX + 1)` stateful pods, so
/// that floors differ and some drains have stateless pods only.
pub const STATEFUL_MAX: u32 = 5;
/// Deployment pods on each drained Machine.
pub const STATELESS_PER_DRAIN: u32 = 10;
/// Creations in flight at once while populating.
const CREATE_CONCURRENCY: usize = 32;
/// The steady phase between the sync and the drains.
pub const IDLE: Duration = Duration::from_secs(30);
/// How often the controller's resident memory is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Bound on each populate step and on the drains.
const STEP_TIMEOUT: Duration = Duration::from_secs(45 * 60);
/// The issue's memory target for the controller.
pub const RSS_TARGET_MIB: f64 = 256.0;
/// The issue's latency target: no drain slower than its floor plus this.
pub const OVER_FLOOR_TARGET_SECONDS: f64 = 5.0;
/// `/proc/<pid>/stat` counts CPU time in clock ticks (USER_HZ). `libc` is not
/// a dependency to ask `sysconf(_SC_CLK_TCK)`; USER_HZ is 100 on every Linux
/// architecture this runs on.
pub const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

/// The simulated kubelets' Node status refresh on the scale test bed: 5
/// minutes on average, a real kubelet's `nodeStatusReportFrequency` for
/// an unchanged status, against the small beds' 20 s. The whole control
/// plane and 1,000 simulated kubelets share 2 cores here: at 20 s their
/// status writes and Lease renewals kept the bed busy enough that pod
/// deletions lagged their grace period by 10-16 s; at a minute the idle bed
/// still used 0.6 of a core. That is the test bed's time, not the
/// controller's.
pub const NODE_HEARTBEAT: Duration = Duration::from_secs(300);
/// The API server's writes per second (Lease renewals left out) under
/// which the test bed counts as settled. Every pod is Running well before
/// kwok has finished with them: it plays the ready Stage of many pods a
/// second time, minutes later, which kept it and the API server busy (2
/// cores) through the idle phase and put the drains' pod deletions in its
/// queue behind thousands of those replays. Node status refreshes and the
/// controllers' own writes stay well under this.
pub const SETTLED_WRITES_PER_SECOND: f64 = 5.0;
/// Over how long the write rate is measured.
const SETTLE_WINDOW: Duration = Duration::from_secs(5);

/// The scale scenario's result (`scale` in the JSON report).
#[derive(Debug, Serialize, Default)]
pub struct Scale {
    /// What the flags asked for.
    pub requested: Requested,
    /// What the cluster held when the drains started.
    pub counted: Counted,
    /// How often the test bed's simulated kubelets refresh a Node's status
    /// (see [`NODE_HEARTBEAT`]).
    pub node_heartbeat_seconds: u64,
    /// From the populating controller's start to the last receiving Machine
    /// Running.
    pub populate_seconds: Option<f64>,
    /// From the end of populating to the test bed settled (see
    /// [`SETTLED_WRITES_PER_SECOND`]).
    pub settle_seconds: Option<f64>,
    /// From the fresh controller's start to ready (`/readyz`: every cache
    /// synced).
    pub ready_seconds: Option<f64>,
    /// From the fresh controller's start to its caches synced and its
    /// pass over every Machine done.
    pub sync_seconds: Option<f64>,
    /// Resident memory of the fresh controller once synced.
    pub rss_after_sync_mib: Option<f64>,
    /// Peak resident memory (`VmHWM`), the larger of both processes.
    pub peak_rss_mib: Option<f64>,
    /// `VmHWM` of the controller that populated (its caches grew with the
    /// cluster).
    pub populate_peak_rss_mib: Option<f64>,
    /// `VmHWM` of the fresh controller (initial list, idle, drains).
    pub measured_peak_rss_mib: Option<f64>,
    /// Per phase: duration, CPU seconds, memory, reconciles, API requests.
    pub phases: Vec<Phase>,
    /// Pods on the drained Nodes when the drains started.
    pub drained_pods: u32,
    pub drains: Vec<ScaleDrain>,
    /// Every client's writes that the API server served during the drains,
    /// by `VERB resource[/subresource]` (its `apiserver_request_total`):
    /// the load the drains put on the test bed, the controller's share and
    /// the cluster's reactions (replacement pods, bindings, Events, the
    /// simulated kubelets' and attacher's writes) together.
    pub bed_writes_during_drains: BTreeMap<String, u64>,
    /// The slowest drain's wall time minus its floor.
    pub max_over_floor_seconds: Option<f64>,
    /// The largest [`ScaleDrain::cluster_over_floor_seconds`]: how far over
    /// its floor the cluster's own steps took the slowest drain, before any
    /// turn of the controller. No controller could have removed this part
    /// without asking less of the cluster.
    pub max_cluster_over_floor_seconds: Option<f64>,
    /// The largest [`ScaleDrain::controller_seconds`]: the controller's part
    /// of the slowest drain.
    pub max_controller_seconds: Option<f64>,
    /// Where the drains' time went, step by step, from the audit log (API
    /// server times), over every drained pod: `evicted → gone` (grace
    /// period, then kwok deleting the pod), `gone → detached` (the
    /// attach-detach controller and the simulated detach delay), `detached →
    /// attached elsewhere` (scheduling, attach-detach controller, attach
    /// delay): the cluster's part; `attached → next eviction`: the
    /// controller's part on a volume-aware drain's critical path; and a
    /// stateful pod's whole move, `evicted → attached elsewhere`, for the
    /// first pod of each drain and for the later ones apart. Seconds.
    pub steps_seconds: BTreeMap<String, super::Gaps>,
    pub targets: Targets,
    pub clock_ticks_per_second: f64,
    /// Cores of the machine the run was measured on.
    pub machine_cores: Option<usize>,
    /// The fresh controller's counters at the end (histogram buckets left
    /// out).
    pub metrics_at_end: BTreeMap<String, f64>,
    pub note: Option<String>,
}

#[derive(Debug, Serialize, Default)]
pub struct Requested {
    pub machines: u32,
    pub pods: u32,
    pub attachments: u32,
    pub drains: u32,
}

#[derive(Debug, Serialize, Default)]
pub struct Counted {
    pub machines: u32,
    pub nodes: u32,
    pub pods: u32,
    pub volume_attachments: u32,
    pub persistent_volumes: u32,
}

/// One phase of the controller's life.
#[derive(Debug, Serialize, Default)]
pub struct Phase {
    pub name: String,
    pub seconds: f64,
    pub cpu_seconds: Option<f64>,
    /// Mean CPU use over the phase, in cores.
    pub cpu_cores: Option<f64>,
    /// Mean CPU use of the whole machine over the phase (every test bed
    /// component, the benchmark and the controller), in cores, of
    /// [`Scale::machine_cores`].
    pub machine_busy_cores: Option<f64>,
    /// Mean CPU use of each test bed process over the phase, in cores:
    /// where the machine's busy time went.
    pub bed_cores: BTreeMap<String, f64>,
    /// Resident memory at the end of the phase.
    pub rss_end_mib: Option<f64>,
    /// Largest sampled resident memory during the phase.
    pub rss_peak_sampled_mib: Option<f64>,
    /// Reconciles completed during the phase (`berth_reconcile_total`).
    pub reconciles: Option<f64>,
    /// The controller's requests during the phase, by `verb resource`.
    pub api_requests: BTreeMap<String, u32>,
    pub api_writes: u32,
    #[serde(skip)]
    from: Timestamp,
    #[serde(skip)]
    to: Timestamp,
    /// `/proc/stat` busy ticks at the start.
    #[serde(skip)]
    machine_busy_from: Option<u64>,
    /// Each test bed process's CPU ticks at the start.
    #[serde(skip)]
    bed_from: BTreeMap<String, u64>,
}

/// One drained Machine.
#[derive(Debug, Serialize, Default, Clone)]
pub struct ScaleDrain {
    pub machine: String,
    pub node: String,
    pub stateful_pods: u32,
    pub stateless_pods: u32,
    pub floor_seconds: f64,
    /// Delete request to the drain's end (`status.drain.finishedAt`, when
    /// its outcome is `Drained`).
    pub wall_seconds: Option<f64>,
    /// Delete request to the Machine gone (volumes detached, VM and Node
    /// deleted, finalizer removed).
    pub gone_seconds: Option<f64>,
    pub over_floor_seconds: Option<f64>,
    /// Delete request to the controller's first eviction (API server time).
    pub first_eviction_seconds: Option<f64>,
    /// The cluster's steps on the drain's critical path, from the audit log
    /// (see [`critical_path`]).
    pub cluster_seconds: Option<f64>,
    /// Wall time minus [`Self::cluster_seconds`]: the controller's turns (its
    /// start, its gaps between steps, its end) with the latency of its own
    /// requests, its client-side rate limit included.
    pub controller_seconds: Option<f64>,
    /// [`Self::cluster_seconds`] minus the floor: how much longer than
    /// configured the cluster's steps on the critical path took.
    pub cluster_over_floor_seconds: Option<f64>,
    /// The reason of the drain's last Event (`Drained`, `DrainForced`,
    /// `DrainFailed`), if any.
    pub outcome: Option<String>,
}

#[derive(Debug, Serialize, Default)]
pub struct Targets {
    pub peak_rss_mib: f64,
    pub peak_rss_pass: bool,
    pub over_floor_seconds: f64,
    /// The issue's form: every drain within its floor plus
    /// [`OVER_FLOOR_TARGET_SECONDS`].
    pub drains_pass: bool,
    /// The same bound on the controller's part of every drain (wall time
    /// less the cluster's critical path): what the target asks of the
    /// controller on a test bed whose own steps overrun their floors.
    pub controller_share_pass: bool,
}

/// Reconciles a second below which the pass over every Machine after a
/// sync is over.
pub fn settled_rate(machines: f64) -> f64 {
    machines / 10.0 + 1.0
}

/// The largest of one figure over the drains; `None` when a drain lacks it
/// or there are none.
pub fn max_over(drains: &[ScaleDrain], figure: impl Fn(&ScaleDrain) -> Option<f64>) -> Option<f64> {
    drains
        .iter()
        .map(figure)
        .collect::<Option<Vec<f64>>>()?
        .into_iter()
        .reduce(f64::max)
}

impl Scale {
    fn judge(&mut self) {
        self.max_over_floor_seconds = max_over(&self.drains, |d| d.over_floor_seconds);
        self.max_cluster_over_floor_seconds =
            max_over(&self.drains, |d| d.cluster_over_floor_seconds);
        self.max_controller_seconds = max_over(&self.drains, |d| d.controller_seconds);
        let within = |m: Option<f64>| {
            self.note.is_none()
                && !self.drains.is_empty()
                && m.is_some_and(|m| m <= OVER_FLOOR_TARGET_SECONDS)
        };
        self.peak_rss_mib = match (self.populate_peak_rss_mib, self.measured_peak_rss_mib) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.targets = Targets {
            peak_rss_mib: RSS_TARGET_MIB,
            peak_rss_pass: self.note.is_none()
                && self.peak_rss_mib.is_some_and(|p| p <= RSS_TARGET_MIB),
            over_floor_seconds: OVER_FLOOR_TARGET_SECONDS,
            drains_pass: within(self.max_over_floor_seconds),
            controller_share_pass: within(self.max_controller_seconds),
        };
    }
}

/// Runs the scenario on a test bed of its own. A failure is reported in
/// the result's `note`, with the figures measured until then.
pub async fn run(args: &BenchArgs) -> Scale {
    let mut s = Scale {
        requested: Requested {
            machines: args.scale_machines,
            pods: args.scale_pods,
            attachments: args.scale_attachments,
            drains: args.scale_drains,
        },
        clock_ticks_per_second: CLOCK_TICKS_PER_SECOND,
        machine_cores: std::thread::available_parallelism().ok().map(usize::from),
        node_heartbeat_seconds: NODE_HEARTBEAT.as_secs(),
        ..Default::default()
    };
    if let Err(e) = measure(args, &mut s).await {
        eprintln!("scale: failed: {e:#}");
        s.note = Some(format!("failed: {e:#}"));
    }
    s.judge();
    s
}

async fn measure(args: &BenchArgs, s: &mut Scale) -> anyhow::Result<()> {
    let plan = Plan::new(
        args.scale_machines,
        args.scale_pods,
        args.scale_attachments,
        args.scale_drains,
    )
    .map_err(anyhow::Error::msg)?;
    let user = super::controller_user();
    let bed = TestBed::start(
        Options::end_to_end()
            .attach_delay(args.attach_delay)
            .detach_delay(args.detach_delay)
            .node_heartbeat(NODE_HEARTBEAT)
            .audit_only(&[&user]),
    )
    .await?;
    eprintln!("scale: test bed ready at {}", bed.dir().display());
    let admin = super::admin_client(&bed).await?;
    let kubeconfig = super::controller_client(&bed, &admin).await?.kubeconfig;

    // 1. Populate, through a first controller.
    let populate_started = Instant::now();
    let mut populate = Phase::start("populate", &bed);
    let mut first = Controller::spawn(&kubeconfig, &bed.dir().join("logs/berth-populate.log"))?;
    first.wait_ready(LONG).await?;
    // A failed populate still reports what the controller used meanwhile.
    let populated = populate_cluster(&admin, args, &plan).await;
    s.populate_seconds = Some(populate_started.elapsed().as_secs_f64());
    first
        .end_phase(&mut populate, &bed, populate_started, 0.0, None)
        .await;
    s.populate_peak_rss_mib = first.status_mib("VmHWM");
    s.phases.push(populate);
    first.stop().await;
    let mut targets = populated?;
    eprintln!(
        "scale: populated in {:.0}s",
        s.populate_seconds.unwrap_or_default()
    );
    s.counted = count_cluster(&admin).await?;
    s.settle_seconds = Some(settle(&admin).await?);
    eprintln!(
        "scale: the test bed settled in {:.0}s",
        s.settle_seconds.unwrap_or_default()
    );
    s.drained_pods = targets
        .iter()
        .map(|t| t.stateful_pods + t.stateless_pods)
        .sum();

    // 2. Sync: a fresh controller lists the whole cluster.
    let mut sync = Phase::start("sync", &bed);
    let started = Instant::now();
    let mut c = Controller::spawn(&kubeconfig, &bed.dir().join("logs/berth.log"))?;
    c.wait_ready(LONG).await?;
    s.ready_seconds = Some(started.elapsed().as_secs_f64());
    c.wait_settled(f64::from(s.counted.machines), LONG).await?;
    s.sync_seconds = Some(started.elapsed().as_secs_f64());
    let mut cpu = c.end_phase(&mut sync, &bed, started, 0.0, Some(0.0)).await;
    s.rss_after_sync_mib = sync.rss_end_mib;
    let mut reconciles = c.reconciles().await;
    s.phases.push(sync);
    eprintln!(
        "scale: controller ready in {:.1}s, settled in {:.1}s, RSS {:.1} MiB",
        s.ready_seconds.unwrap_or_default(),
        s.sync_seconds.unwrap_or_default(),
        s.rss_after_sync_mib.unwrap_or(f64::NAN)
    );

    // 3. Idle.
    let mut idle = Phase::start("idle", &bed);
    let started = Instant::now();
    tokio::time::sleep(IDLE).await;
    cpu = c.end_phase(&mut idle, &bed, started, cpu, reconciles).await;
    reconciles = c.reconciles().await;
    s.phases.push(idle);

    // 4. The drains, all at once.
    let mut drains = Phase::start("drains", &bed);
    let started = Instant::now();
    eprintln!("scale: deleting {} Machines", targets.len());
    let served_before = apiserver_metrics(&admin).await.map(|b| writes_by_kind(&b));
    let drained = drain_all(&admin, &mut targets).await;
    if let (Ok(before), Ok(after)) = (
        served_before,
        apiserver_metrics(&admin).await.map(|b| writes_by_kind(&b)),
    ) {
        s.bed_writes_during_drains = served_between(&before, &after);
    }
    s.drains = targets;
    c.end_phase(&mut drains, &bed, started, cpu, reconciles)
        .await;
    s.phases.push(drains);
    if let Some(body) = c.get("/metrics").await.map(|(_, b)| b) {
        s.metrics_at_end = counters(&body);
    }
    s.measured_peak_rss_mib = c.status_mib("VmHWM");
    c.stop().await;

    let log = super::read_audit(&bed.dir().join("audit.log"))?;
    if let Ok(routes) = &drained {
        let (steps, per_route) = step_times(&log, &user, routes);
        s.steps_seconds = steps;
        for d in &mut s.drains {
            if let Some(t) = per_route.get(&d.machine) {
                d.first_eviction_seconds = t.first_eviction;
                d.cluster_seconds = t.cluster;
                d.controller_seconds = d.wall_seconds.zip(t.cluster).map(|(w, c)| w - c);
                d.cluster_over_floor_seconds = t.cluster.map(|c| c - d.floor_seconds);
            }
        }
    }
    for p in &mut s.phases {
        p.api_requests = super::audit::cost(&log, &user, p.from, p.to);
        p.api_writes = log
            .iter()
            .filter(|r| {
                r.user == user && r.is_write() && r.received >= p.from && r.received <= p.to
            })
            .count() as u32;
    }
    drained.map(|_| ())
}

impl Phase {
    fn start(name: &str, bed: &TestBed) -> Self {
        Self {
            name: name.into(),
            from: Timestamp::now(),
            machine_busy_from: machine_busy_ticks(),
            bed_from: process_ticks(&bed.pids()),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_splits_the_numbers_and_refuses_impossible_ones() {
        let p = Plan::new(1000, 20_000, 5000, 20).expect("the issue's numbers");
        assert_eq!(p.background_machines, 960);
        assert_eq!(p.drains.len(), 20);
        assert_eq!(p.drains[0].stateful, 0);
        assert_eq!(p.drains[5].stateful, 5);
        assert_eq!(p.drains[6].stateful, 0);
        let stateful: u32 = p.drains.iter().map(|d| d.stateful).sum();
        assert_eq!(stateful, 3 * 15 + 1);
        assert_eq!(p.background_attachments, 5000 - stateful);
        assert_eq!(
            p.background_pods,
            20_000 - stateful - 20 * STATELESS_PER_DRAIN
        );
        assert_eq!(p.pods(), 20_000);
        assert_eq!(p.attachments(), 5000);
        assert!(
            Plan::new(40, 20_000, 5000, 20).is_err(),
            "no background Machine"
        );
        assert!(Plan::new(1000, 100, 5000, 20).is_err(), "too few pods");
        assert!(
            Plan::new(1000, 20_000, 10, 20).is_err(),
            "too few attachments"
        );
        assert!(Plan::new(1000, 20_000, 5000, 0).is_err());
    }

    fn pod(stateful: bool, grace: f64) -> PodFacts {
        PodFacts {
            stateful,
            grace_seconds: grace,
        }
    }

    #[test]
    fn the_floor_is_the_stateful_chain_or_the_longest_grace() {
        let mixed = [pod(true, 1.0), pod(false, 1.0), pod(true, 2.0)];
        assert_eq!(floor_seconds(&mixed, 1.0, 1.0), 3.0 + 4.0);
        assert_eq!(
            floor_seconds(&[pod(false, 1.0), pod(false, 3.0)], 1.0, 1.0),
            3.0
        );
        assert_eq!(floor_seconds(&[], 1.0, 1.0), 0.0);
    }

    #[test]
    fn settling_is_well_above_the_heartbeat_rate() {
        // kwok heartbeats each Node every 20 to 45 s.
        let heartbeats = 1000.0 / 20.0;
        assert!(settled_rate(1000.0) > heartbeats);
        assert_eq!(settled_rate(0.0), 1.0);
    }

    #[test]
    fn pod_facts_come_from_claims_and_the_grace_period() {
        let sts = fixtures::stateful_set("db", 1, 7);
        let template = sts.spec.template;
        let mut spec = template.spec.expect("pod spec");
        spec.volumes = Some(vec![
            serde_json::from_value(serde_json::json!({
                "name": "data", "persistentVolumeClaim": {"claimName": "data-db-0"}
            }))
            .expect("volume"),
        ]);
        let p = Pod {
            spec: Some(spec),
            ..Default::default()
        };
        assert_eq!(PodFacts::of(&p), pod(true, 7.0));
        assert_eq!(PodFacts::of(&Pod::default()), pod(false, 30.0));
    }

    #[test]
    fn proc_status_fields_in_kib() {
        let status =
            "Name:\tberth\nVmPeak:\t  900000 kB\nVmHWM:\t  123456 kB\nVmRSS:\t   65536 kB\n";
        assert_eq!(status_kib(status, "VmHWM"), Some(123_456));
        assert_eq!(status_kib(status, "VmRSS"), Some(65_536));
        assert_eq!(status_kib(status, "VmSwap"), None);
    }

    #[test]
    fn each_process_gets_its_mean_cores_and_a_newcomer_none() {
        let from = BTreeMap::from([("etcd".to_string(), 100u64), ("kwok".to_string(), 50)]);
        let to = BTreeMap::from([
            ("etcd".to_string(), 300u64),
            ("kwok".to_string(), 50),
            ("late".to_string(), 10),
        ]);
        let cores = cores_between(&from, &to, 2.0);
        // 200 ticks over 2 s at 100 ticks a second.
        assert_eq!(cores.get("etcd"), Some(&1.0));
        assert_eq!(cores.get("kwok"), Some(&0.0));
        assert!(!cores.contains_key("late"));
    }

    #[test]
    fn writes_served_count_mutations_but_not_lease_renewals() {
        let body = r#"# HELP apiserver_request_total x
apiserver_request_total{code="200",resource="pods",subresource="status",verb="PATCH"} 10
apiserver_request_total{code="201",resource="pods",subresource="",verb="POST"} 5
apiserver_request_total{code="200",resource="leases",subresource="",verb="PUT"} 100
apiserver_request_total{code="200",resource="pods",subresource="",verb="LIST"} 7
apiserver_request_total{code="200",resource="pods",subresource="",verb="DELETE"} 2
apiserver_request_duration_seconds_count{resource="pods",verb="PATCH"} 99
"#;
        assert_eq!(writes_served(body), 17.0);
        let kinds = writes_by_kind(body);
        assert_eq!(kinds.get("PATCH pods/status"), Some(&10.0));
        assert_eq!(kinds.get("PUT leases"), Some(&100.0));
        assert!(!kinds.contains_key("LIST pods"), "{kinds:?}");
    }

    #[test]
    fn writes_between_two_readings_sum_over_codes_and_leave_out_the_unchanged() {
        let before = writes_by_kind(
            "apiserver_request_total{code=\"201\",resource=\"pods\",subresource=\"eviction\",verb=\"POST\"} 3\n\
             apiserver_request_total{code=\"200\",resource=\"nodes\",subresource=\"\",verb=\"PATCH\"} 4\n",
        );
        let after = writes_by_kind(
            "apiserver_request_total{code=\"201\",resource=\"pods\",subresource=\"eviction\",verb=\"POST\"} 10\n\
             apiserver_request_total{code=\"429\",resource=\"pods\",subresource=\"eviction\",verb=\"POST\"} 2\n\
             apiserver_request_total{code=\"200\",resource=\"nodes\",subresource=\"\",verb=\"PATCH\"} 4\n\
             apiserver_request_total{code=\"201\",resource=\"events\",subresource=\"\",verb=\"POST\"} 5\n",
        );
        let d = served_between(&before, &after);
        assert_eq!(d.get("POST pods/eviction"), Some(&9));
        assert_eq!(d.get("POST events"), Some(&5));
        assert!(!d.contains_key("PATCH nodes"), "{d:?}");
    }

    #[test]
    fn machine_busy_time_leaves_out_idle_and_iowait() {
        let stat = "cpu  100 5 30 1000 40 2 3 1 0 0\ncpu0 50 2 15 500 20 1 1 0 0 0\nintr 1\n";
        assert_eq!(busy_ticks(stat), Some(100 + 5 + 30 + 2 + 3 + 1));
        assert_eq!(busy_ticks("cpu  1 2 3\n"), None);
        assert_eq!(busy_ticks("intr 1\n"), None);
    }

    #[test]
    fn the_critical_path_is_the_slowest_stateless_pod_or_the_stateful_chain() {
        // Stateless pods go together: the slowest one counts.
        assert_eq!(critical_path(&[1.5, 4.0, 2.0], &[]), Some(4.0));
        // Stateful pods go one after the other: they add up.
        assert_eq!(critical_path(&[4.0], &[Some(3.0), Some(2.5)]), Some(5.5));
        assert_eq!(critical_path(&[9.0], &[Some(3.0), Some(2.5)]), Some(9.0));
        // A chain with a step missing from the log is not guessed at.
        assert_eq!(critical_path(&[9.0], &[Some(3.0), None]), None);
        assert_eq!(critical_path(&[], &[]), None);
    }

    #[test]
    fn proc_stat_cpu_counts_from_after_the_name() {
        let stat =
            "4242 (berth (a) b) S 1 4242 4242 0 -1 4194304 100 0 0 0 250 75 0 0 20 0 9 0 1 2 3";
        assert_eq!(stat_cpu_ticks(stat), Some(325));
        assert_eq!(stat_cpu_ticks("4242 (berth) S 1"), None);
        assert_eq!(stat_cpu_ticks("garbage"), None);
    }

    #[test]
    fn metric_families_are_summed_and_counters_kept() {
        let body = "# HELP berth_reconcile_total x\n# TYPE berth_reconcile_total counter\n\
                    berth_reconcile_total{result=\"ok\"} 10\nberth_reconcile_total{result=\"error\"} 2\n\
                    berth_reconcile_total_other 7\n\
                    berth_drain_duration_seconds_bucket{le=\"1\"} 3\nberth_drain_duration_seconds_count 3\n\
                    berth_leader 1\nprocess_cpu 4\n";
        assert_eq!(metric_sum(body, "berth_reconcile_total"), Some(12.0));
        assert_eq!(metric_sum(body, "berth_missing"), None);
        let c = counters(body);
        assert_eq!(c.get("berth_leader"), Some(&1.0));
        assert_eq!(c.get("berth_drain_duration_seconds_count"), Some(&3.0));
        assert!(
            !c.keys()
                .any(|k| k.contains("_bucket") || k.starts_with("process"))
        );
    }

    fn drain(floor: f64, wall: Option<f64>) -> ScaleDrain {
        ScaleDrain {
            floor_seconds: floor,
            wall_seconds: wall,
            over_floor_seconds: wall.map(|w| w - floor),
            ..Default::default()
        }
    }

    #[test]
    fn the_targets_are_judged_from_the_slowest_drain_and_the_peak() {
        let mut s = Scale {
            drains: vec![drain(3.0, Some(4.0)), drain(1.0, Some(5.5))],
            populate_peak_rss_mib: Some(100.0),
            measured_peak_rss_mib: Some(200.0),
            ..Default::default()
        };
        s.judge();
        assert_eq!(s.max_over_floor_seconds, Some(4.5));
        assert_eq!(s.peak_rss_mib, Some(200.0));
        assert!(s.targets.drains_pass && s.targets.peak_rss_pass);

        s.drains.push(drain(1.0, None));
        s.measured_peak_rss_mib = Some(300.0);
        s.judge();
        assert_eq!(
            s.max_over_floor_seconds, None,
            "a drain without a wall time"
        );
        assert!(!s.targets.drains_pass && !s.targets.peak_rss_pass);

        let mut failed = Scale {
            drains: vec![drain(1.0, Some(1.5))],
            measured_peak_rss_mib: Some(10.0),
            note: Some("failed: x".into()),
            ..Default::default()
        };
        failed.judge();
        assert!(!failed.targets.drains_pass && !failed.targets.peak_rss_pass);
    }

    #[test]
    fn the_controller_share_is_judged_apart_from_the_cluster_overrun() {
        // 12 s over the floor, 11 s of it the cluster's own steps.
        let slow_cluster = ScaleDrain {
            cluster_over_floor_seconds: Some(11.0),
            controller_seconds: Some(1.0),
            ..drain(12.0, Some(24.0))
        };
        let mut s = Scale {
            drains: vec![slow_cluster.clone(), drain(3.0, Some(3.5))],
            measured_peak_rss_mib: Some(10.0),
            ..Default::default()
        };
        s.drains[1].controller_seconds = Some(0.2);
        s.drains[1].cluster_over_floor_seconds = Some(0.3);
        s.judge();
        assert_eq!(s.max_over_floor_seconds, Some(12.0));
        assert_eq!(s.max_cluster_over_floor_seconds, Some(11.0));
        assert_eq!(s.max_controller_seconds, Some(1.0));
        assert!(!s.targets.drains_pass);
        assert!(s.targets.controller_share_pass);

        // A drain whose split is unknown (a step missing from the audit
        // log) cannot pass on its controller's share.
        s.drains[1].controller_seconds = None;
        s.judge();
        assert_eq!(s.max_controller_seconds, None);
        assert!(!s.targets.controller_share_pass);
    }
}
