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

    fn pods(&self) -> u32 {
        self.background_pods
            + self
                .drains
                .iter()
                .map(|d| d.stateful + d.stateless)
                .sum::<u32>()
    }

    fn attachments(&self) -> u32 {
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

/// Reconciles a second below which the pass over every Machine after a
/// sync is over.
pub fn settled_rate(machines: f64) -> f64 {
    machines / 10.0 + 1.0
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS`, `VmHWM`), in KiB.
pub fn status_kib(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == key).then(|| v.split_whitespace().next()?.parse().ok())?
    })
}

/// `utime + stime` from `/proc/<pid>/stat`, in clock ticks. The command
/// name (field 2) may contain spaces and parentheses, so fields are counted
/// from its closing parenthesis.
pub fn stat_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state (3), ppid (4), …, utime (14), stime (15).
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Busy time of the whole machine from `/proc/stat`'s `cpu` line, in clock
/// ticks: every column but `idle` and `iowait` (guest time is already in
/// `user` and `nice`, so the two guest columns are left out too).
pub fn busy_ticks(proc_stat: &str) -> Option<u64> {
    let line = proc_stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice]
    let (user, nice, system, irq, softirq) = (v[0], v[1], v[2], *v.get(5)?, *v.get(6)?);
    let steal = v.get(7).copied().unwrap_or(0);
    Some(user + nice + system + irq + softirq + steal)
}

fn machine_busy_ticks() -> Option<u64> {
    busy_ticks(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// CPU ticks so far of each named process (those that have exited are
/// left out).
fn process_ticks(pids: &[(String, u32)]) -> BTreeMap<String, u64> {
    pids.iter()
        .filter_map(|(name, pid)| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            Some((name.clone(), stat_cpu_ticks(&stat)?))
        })
        .collect()
}

/// Mean cores of `ticks` of CPU time spent over `seconds`.
fn cores(ticks: u64, seconds: f64) -> f64 {
    ticks as f64 / CLOCK_TICKS_PER_SECOND / seconds.max(f64::EPSILON)
}

/// Mean cores of each process between two [`process_ticks`] readings
/// `seconds` apart.
pub fn cores_between(
    from: &BTreeMap<String, u64>,
    to: &BTreeMap<String, u64>,
    seconds: f64,
) -> BTreeMap<String, f64> {
    to.iter()
        .filter_map(|(name, t)| {
            let busy = t.checked_sub(*from.get(name)?)?;
            Some((name.clone(), cores(busy, seconds)))
        })
        .collect()
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

/// The sum of every sample of the metric family `name` in a Prometheus text
/// exposition.
pub fn metric_sum(body: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for (sample, value) in samples(body) {
        let family = sample.split('{').next().unwrap_or(sample);
        if family == name {
            *found.get_or_insert(0.0) += value;
        }
    }
    found
}

/// The API server's mutating requests so far (`apiserver_request_total`),
/// Lease renewals left out.
pub fn writes_served(body: &str) -> f64 {
    writes_by_kind(body)
        .into_iter()
        .filter(|(kind, _)| !kind.ends_with(" leases"))
        .map(|(_, n)| n)
        .sum()
}

/// The API server's mutating requests so far, every client's, by `VERB
/// resource[/subresource]` (from `apiserver_request_total`, over every
/// response code and API version).
pub fn writes_by_kind(body: &str) -> BTreeMap<String, f64> {
    let label = |sample: &str, name: &str| -> Option<String> {
        let start = sample.find(&format!("{name}=\""))? + name.len() + 2;
        let len = sample[start..].find('"')?;
        Some(sample[start..start + len].to_owned())
    };
    let mut out = BTreeMap::new();
    for (sample, value) in samples(body).filter(|(s, _)| s.starts_with("apiserver_request_total{"))
    {
        let Some(verb) = label(sample, "verb") else {
            continue;
        };
        if !["POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION"].contains(&verb.as_str()) {
            continue;
        }
        let resource = label(sample, "resource").unwrap_or_default();
        let kind = match label(sample, "subresource").filter(|s| !s.is_empty()) {
            Some(sub) => format!("{verb} {resource}/{sub}"),
            None => format!("{verb} {resource}"),
        };
        *out.entry(kind).or_insert(0.0) += value;
    }
    out
}

/// Each kind's count in `after` less its count in `before`; kinds that did
/// not change are left out.
pub fn served_between(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter_map(|(kind, n)| {
            let d = n - before.get(kind).copied().unwrap_or(0.0);
            (d > 0.0).then(|| (kind.clone(), d.round() as u64))
        })
        .collect()
}

/// Waits until the API server serves fewer than
/// [`SETTLED_WRITES_PER_SECOND`] writes; returns how long that took.
async fn settle(admin: &Client) -> anyhow::Result<f64> {
    let served = || async { anyhow::Ok(writes_served(&apiserver_metrics(admin).await?)) };
    let started = Instant::now();
    let mut before = served().await?;
    loop {
        tokio::time::sleep(SETTLE_WINDOW).await;
        let now = served().await?;
        let rate = (now - before) / SETTLE_WINDOW.as_secs_f64();
        if rate < SETTLED_WRITES_PER_SECOND {
            return Ok(started.elapsed().as_secs_f64());
        }
        if started.elapsed() > STEP_TIMEOUT {
            anyhow::bail!(
                "the test bed still served {rate:.0} writes a second {STEP_TIMEOUT:?} after populating"
            );
        }
        eprintln!("scale: the test bed is still busy: {rate:.0} writes a second");
        before = now;
    }
}

/// The API server's own `/metrics`.
async fn apiserver_metrics(admin: &Client) -> anyhow::Result<String> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    Ok(admin.request_text(req).await?)
}

/// Every `berth_` sample except histogram buckets.
pub fn counters(body: &str) -> BTreeMap<String, f64> {
    samples(body)
        .filter(|(s, _)| s.starts_with("berth_") && !s.contains("_bucket"))
        .map(|(s, v)| (s.to_string(), v))
        .collect()
}

fn samples(body: &str) -> impl Iterator<Item = (&str, f64)> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (sample, value) = l.rsplit_once(' ')?;
            Some((sample, value.parse().ok()?))
        })
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
    super::controller_client(&bed, &admin).await?;
    let kubeconfig = super::controller_kubeconfig(&bed);

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

/// The names of the scenario's objects.
fn drain_pool(i: usize) -> String {
    format!("scale-d{i:03}")
}

fn label(meta: &mut ObjectMeta, value: &str) {
    meta.labels
        .get_or_insert_with(Default::default)
        .insert(SCALE_LABEL.into(), value.into());
}

/// Creates every object, [`CREATE_CONCURRENCY`] at a time, keeping those
/// that exist.
async fn create_all<K>(api: Api<K>, objects: Vec<K>, what: &str) -> anyhow::Result<()>
where
    K: Resource + Clone + Serialize + DeserializeOwned + Debug,
{
    let n = objects.len();
    let started = Instant::now();
    futures::stream::iter(objects.into_iter().map(|o| {
        let api = api.clone();
        async move { crate::testbed::create_or_keep(api, o).await }
    }))
    .buffer_unordered(CREATE_CONCURRENCY)
    .try_collect::<Vec<()>>()
    .await
    .with_context(|| format!("creating {what}"))?;
    eprintln!(
        "scale: created {n} {what} in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Populates the cluster and returns the drains to measure, each with the
/// floor of what is on its Node.
async fn populate_cluster(
    admin: &Client,
    args: &BenchArgs,
    plan: &Plan,
) -> anyhow::Result<Vec<ScaleDrain>> {
    let machines: Api<Machine> = Api::namespaced(admin.clone(), NS);
    super::pool_class(admin, BG_CLASS).await?;
    for i in 0..plan.drains.len() {
        super::pool_class(admin, &drain_pool(i)).await?;
    }

    // The drained and background Machines first; the receiving ones come
    // after the workloads, so that those land on the drained Nodes.
    let drained: Vec<String> = (0..plan.drains.len())
        .map(|i| format!("{}-a", drain_pool(i)))
        .collect();
    let background: Vec<String> = (0..plan.background_machines)
        .map(|j| format!("{BG_CLASS}-{j:05}"))
        .collect();
    let mut first = Vec::new();
    for (i, name) in drained.iter().enumerate() {
        first.push(super::machine_object(name, &drain_pool(i))?);
    }
    for name in &background {
        first.push(super::machine_object(name, BG_CLASS)?);
    }
    let names: Vec<String> = drained.iter().chain(&background).cloned().collect();
    create_all(machines.clone(), first, "Machines").await?;
    machines_running(&machines, &names).await?;

    let bg_nodes: Vec<String> = background
        .iter()
        .map(|m| FakeProvider::node_name(NS, m))
        .collect();
    tokio::try_join!(
        drain_workloads(admin, args, plan),
        background_pods(admin, args, plan, &bg_nodes),
        background_attachments(admin, plan, &bg_nodes),
    )?;
    count_until(
        Api::<Pod>::all(admin.clone()),
        watcher::Config::default()
            .labels(SCALE_LABEL)
            .fields("status.phase=Running"),
        "pods Running",
        plan.pods() as usize,
        |_| true,
    )
    .await?;
    count_until(
        Api::<VolumeAttachment>::all(admin.clone()),
        watcher::Config::default(),
        "VolumeAttachments attached",
        plan.attachments() as usize,
        |va| va.status.as_ref().is_some_and(|s| s.attached),
    )
    .await?;

    let receivers: Vec<String> = (0..plan.drains.len())
        .map(|i| format!("{}-b", drain_pool(i)))
        .collect();
    let mut second = Vec::new();
    for (i, name) in receivers.iter().enumerate() {
        second.push(super::machine_object(name, &drain_pool(i))?);
    }
    create_all(machines.clone(), second, "receiving Machines").await?;
    machines_running(&machines, &receivers).await?;

    // The floors, from what is on each drained Node now.
    let pods = Api::<Pod>::namespaced(admin.clone(), NS)
        .list(&ListParams::default().labels(&format!("{SCALE_LABEL}=drain")))
        .await?
        .items;
    let (detach, attach) = (
        args.detach_delay.as_secs_f64(),
        args.attach_delay.as_secs_f64(),
    );
    Ok(drained
        .iter()
        .map(|machine| {
            let node = FakeProvider::node_name(NS, machine);
            let facts: Vec<PodFacts> = pods
                .iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&node))
                .map(PodFacts::of)
                .collect();
            let stateful = facts.iter().filter(|f| f.stateful).count() as u32;
            ScaleDrain {
                machine: machine.clone(),
                node,
                stateful_pods: stateful,
                stateless_pods: facts.len() as u32 - stateful,
                floor_seconds: floor_seconds(&facts, detach, attach),
                ..Default::default()
            }
        })
        .collect())
}

async fn machines_running(machines: &Api<Machine>, names: &[String]) -> anyhow::Result<()> {
    let names: HashSet<String> = names.iter().cloned().collect();
    count_until(
        machines.clone(),
        watcher::Config::default(),
        "Machines Running",
        names.len(),
        |m: &Machine| {
            names.contains(&m.name_any())
                && m.status.as_ref().and_then(|s| s.phase) == Some(MachinePhase::Running)
        },
    )
    .await
}

/// On each drained Machine's pool: the StatefulSet's pre-bound CSI volumes,
/// the StatefulSet and the Deployment.
async fn drain_workloads(admin: &Client, args: &BenchArgs, plan: &Plan) -> anyhow::Result<()> {
    let mut pvs = Vec::new();
    let mut sets = Vec::new();
    let mut deployments = Vec::new();
    for (i, d) in plan.drains.iter().enumerate() {
        let pool = drain_pool(i);
        let sts = format!("d{i:03}-db");
        if d.stateful > 0 {
            for k in 0..d.stateful {
                let pv = format!("{pool}-{sts}-{k}");
                pvs.push(fixtures::csi_pv(
                    &pv,
                    &format!("vol-{pv}"),
                    NS,
                    &format!("data-{sts}-{k}"),
                ));
            }
            let mut set = fixtures::stateful_set_in_pool(
                &sts,
                i32::try_from(d.stateful)?,
                i64::from(args.grace),
                &pool,
                None,
            );
            if let Some(meta) = set.spec.as_mut().and_then(|s| s.template.metadata.as_mut()) {
                label(meta, "drain");
            }
            sets.push(set);
        }
        let mut web = fixtures::deployment(
            &format!("d{i:03}-web"),
            i32::try_from(d.stateless)?,
            i64::from(args.grace),
            &pool,
        );
        if let Some(meta) = web.spec.as_mut().and_then(|s| s.template.metadata.as_mut()) {
            label(meta, "drain");
        }
        deployments.push(web);
    }
    create_all(Api::all(admin.clone()), pvs, "stateful PersistentVolumes").await?;
    create_all(Api::namespaced(admin.clone(), NS), sets, "StatefulSets").await?;
    create_all(
        Api::namespaced(admin.clone(), NS),
        deployments,
        "Deployments",
    )
    .await
}

/// Bare pods bound to the background Nodes in turn.
async fn background_pods(
    admin: &Client,
    args: &BenchArgs,
    plan: &Plan,
    nodes: &[String],
) -> anyhow::Result<()> {
    let pods = (0..plan.background_pods as usize)
        .map(|k| {
            serde_json::from_value::<Pod>(serde_json::json!({
                "metadata": {
                    "name": format!("scale-bg-{k:06}"),
                    "labels": {SCALE_LABEL: "background", "app": "scale-bg"}
                },
                "spec": {
                    "nodeName": nodes[k % nodes.len()],
                    "terminationGracePeriodSeconds": args.grace,
                    "containers": [{"name": "main", "image": "registry.invalid/app:1"}]
                }
            }))
        })
        .collect::<Result<Vec<_>, _>>()?;
    create_all(Api::namespaced(admin.clone(), NS), pods, "background pods").await
}

/// A PersistentVolume and an attached VolumeAttachment for each background
/// attachment, on the background Nodes in turn.
async fn background_attachments(
    admin: &Client,
    plan: &Plan,
    nodes: &[String],
) -> anyhow::Result<()> {
    let names: Vec<String> = (0..plan.background_attachments)
        .map(|k| format!("scale-bg-{k:05}"))
        .collect();
    let pvs: Vec<PersistentVolume> = names
        .iter()
        .map(|name| {
            let mut pv = fixtures::csi_pv(name, &format!("vol-{name}"), NS, "");
            if let Some(spec) = pv.spec.as_mut() {
                spec.claim_ref = None;
                spec.storage_class_name = Some(BG_STORAGE_CLASS.into());
                if let Some(csi) = spec.csi.as_mut() {
                    csi.driver = BG_ATTACHER.into();
                }
            }
            label(&mut pv.metadata, "background");
            pv
        })
        .collect();
    create_all(Api::all(admin.clone()), pvs, "background PersistentVolumes").await?;
    let vas: Api<VolumeAttachment> = Api::all(admin.clone());
    let started = Instant::now();
    futures::stream::iter(names.iter().enumerate().map(|(k, name)| {
        let vas = vas.clone();
        let node = &nodes[k % nodes.len()];
        async move {
            let va: VolumeAttachment = serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "labels": {SCALE_LABEL: "background"}},
                "spec": {
                    "attacher": BG_ATTACHER,
                    "nodeName": node,
                    "source": {"persistentVolumeName": name}
                }
            }))?;
            crate::testbed::create_or_keep(vas.clone(), va).await?;
            vas.patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"status": {"attached": true}})),
            )
            .await?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(CREATE_CONCURRENCY)
    .try_collect::<Vec<()>>()
    .await
    .context("creating background VolumeAttachments")?;
    eprintln!(
        "scale: created and attached {} background VolumeAttachments in {:.1}s",
        names.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Watches `api` (filtered by `config`) until at least `target` objects
/// satisfy `matches`. Counts incrementally, so that tens of thousands of
/// objects cost one check per event, and says how far it is every 15 s.
async fn count_until<K, F>(
    api: Api<K>,
    config: watcher::Config,
    what: &str,
    target: usize,
    matches: F,
) -> anyhow::Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    F: Fn(&K) -> bool,
{
    let key = |o: &K| format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any());
    let watch = async {
        let stream = watcher(api, config).default_backoff();
        futures::pin_mut!(stream);
        let mut matching: HashSet<String> = HashSet::new();
        let mut listing: Option<HashSet<String>> = None;
        let mut listed = false;
        let mut said = Instant::now();
        while let Some(event) = stream.try_next().await? {
            match event {
                watcher::Event::Init => listing = Some(HashSet::new()),
                watcher::Event::InitApply(o) => {
                    if matches(&o) {
                        listing.get_or_insert_with(HashSet::new).insert(key(&o));
                    }
                }
                watcher::Event::InitDone => {
                    matching = listing.take().unwrap_or_default();
                    listed = true;
                }
                watcher::Event::Apply(o) => {
                    if matches(&o) {
                        matching.insert(key(&o));
                    } else {
                        matching.remove(&key(&o));
                    }
                }
                watcher::Event::Delete(o) => {
                    matching.remove(&key(&o));
                }
            }
            if listed && matching.len() >= target {
                return anyhow::Ok(());
            }
            if said.elapsed() >= Duration::from_secs(15) {
                eprintln!("scale: {what}: {}/{target}", matching.len());
                said = Instant::now();
            }
        }
        anyhow::bail!("the watch for {what} ended")
    };
    tokio::time::timeout(STEP_TIMEOUT, watch)
        .await
        .map_err(|_| anyhow::anyhow!("{what}: not {target} after {STEP_TIMEOUT:?}"))?
        .with_context(|| format!("waiting for {what}"))
}

/// Counts the objects of `api`, a page of metadata at a time.
async fn count<K>(api: Api<K>) -> anyhow::Result<u32>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let mut lp = ListParams::default().limit(500);
    let mut n = 0;
    loop {
        let page = api.list_metadata(&lp).await?;
        n += page.items.len() as u32;
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
            _ => return Ok(n),
        }
    }
}

async fn count_cluster(admin: &Client) -> anyhow::Result<Counted> {
    Ok(Counted {
        machines: count(Api::<Machine>::namespaced(admin.clone(), NS)).await?,
        nodes: count(Api::<Node>::all(admin.clone())).await?,
        pods: count(Api::<Pod>::all(admin.clone())).await?,
        volume_attachments: count(Api::<VolumeAttachment>::all(admin.clone())).await?,
        persistent_volumes: count(Api::<PersistentVolume>::all(admin.clone())).await?,
    })
}

/// Deletes every drained Machine at once and fills in each drain's wall
/// time (to its `status.drain.finishedAt`) and time until the Machine is
/// gone.
async fn drain_all(admin: &Client, drains: &mut [ScaleDrain]) -> anyhow::Result<Vec<Route>> {
    let mut routes = routes_before(admin, drains).await?;
    let machines: Api<Machine> = Api::namespaced(admin.clone(), NS);
    let names: BTreeSet<String> = drains.iter().map(|d| d.machine.clone()).collect();
    let (listed_tx, listed) = tokio::sync::oneshot::channel();
    let gone = tokio::spawn(watch_ends(machines.clone(), names, listed_tx));
    listed
        .await
        .context("the Machine watch ended before listing")?;
    let deleted: Vec<(String, anyhow::Result<Timestamp>)> =
        futures::future::join_all(drains.iter().map(|d| {
            let machines = machines.clone();
            let name = d.machine.clone();
            async move {
                let at = Timestamp::now();
                let sent = machines
                    .delete(&name, &DeleteParams::default())
                    .await
                    .map(|_| at)
                    .with_context(|| format!("deleting {name}"));
                (name, sent)
            }
        }))
        .await;
    let mut starts = BTreeMap::new();
    for (name, at) in deleted {
        starts.insert(name, at?);
    }
    let gone = tokio::time::timeout(STEP_TIMEOUT, gone)
        .await
        .map_err(|_| anyhow::anyhow!("the drained Machines were not gone after {STEP_TIMEOUT:?}"))?
        .context("the Machine watch failed")??;
    // Each drain's last Event says how it ended. Events are published from
    // a queue, so the last ones may come a little after their Machines went.
    let ending = |e: &Event| {
        matches!(
            e.reason.as_deref(),
            Some("Drained" | "DrainForced" | "DrainFailed")
        )
    };
    let events: Vec<Event> = crate::testbed::wait::until(
        Api::<Event>::namespaced(admin.clone(), NS),
        Duration::from_secs(120),
        "every drained Machine's last drain Event",
        |all| {
            drains.iter().all(|d| {
                all.iter().any(|e| {
                    ending(e)
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(&d.machine)
                })
            })
        },
    )
    .await?
    .into_iter()
    .map(|e| (*e).clone())
    .collect();
    for d in drains.iter_mut() {
        let Some(start) = starts.get(&d.machine).copied() else {
            continue;
        };
        // The outcome from the drain's last Event; its time from the
        // status, since Events are published from a queue (a busy one lags).
        let last = events
            .iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(&d.machine))
            .filter(|e| ending(e))
            .filter_map(|e| Some((e.event_time.as_ref()?.0, e.reason.clone()?)))
            .max_by_key(|(t, _)| *t);
        if let Some((_, reason)) = last {
            if let Some(t) = gone
                .finished
                .get(&d.machine)
                .filter(|_| reason == "Drained")
            {
                let wall = super::secs(start, *t);
                d.wall_seconds = Some(wall);
                d.over_floor_seconds = Some(wall - d.floor_seconds);
            }
            d.outcome = Some(reason);
        }
        d.gone_seconds = gone.gone.get(&d.machine).map(|t| super::secs(start, *t));
    }
    let vas = Api::<VolumeAttachment>::all(admin.clone())
        .list(&ListParams::default())
        .await?
        .items;
    for r in &mut routes {
        r.start = starts.get(&r.machine).copied();
        for va in &vas {
            if let Some(pv) = va.spec.source.persistent_volume_name.as_deref()
                && va.spec.node_name != r.node
                && r.pvs.iter().any(|p| p == pv)
            {
                r.new.insert(pv.to_owned(), va.name_any());
            }
        }
    }
    Ok(routes)
}

/// What a drained Machine's steps are named by in the audit log.
#[derive(Debug, Default)]
pub struct Route {
    machine: String,
    node: String,
    start: Option<Timestamp>,
    /// Every pod on the Node when the drain started.
    pods: Vec<String>,
    /// The stateful ones, and their PVs, pairwise.
    stateful: Vec<String>,
    pvs: Vec<String>,
    /// PV → its VolumeAttachment to the drained Node, and (after the drain)
    /// to the Node its pod moved to.
    old: BTreeMap<String, String>,
    new: BTreeMap<String, String>,
}

/// The pods, volumes and attachments of each drained Node, before deletion.
async fn routes_before(admin: &Client, drains: &[ScaleDrain]) -> anyhow::Result<Vec<Route>> {
    let pods = Api::<Pod>::namespaced(admin.clone(), NS)
        .list(&ListParams::default())
        .await?
        .items;
    let claims =
        Api::<k8s_openapi::api::core::v1::PersistentVolumeClaim>::namespaced(admin.clone(), NS)
            .list(&ListParams::default())
            .await?
            .items;
    let vas = Api::<VolumeAttachment>::all(admin.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let volume_of = |claim: &str| {
        claims
            .iter()
            .find(|c| c.name_any() == claim)
            .and_then(|c| c.spec.as_ref()?.volume_name.clone())
    };
    Ok(drains
        .iter()
        .map(|d| {
            let mut r = Route {
                machine: d.machine.clone(),
                node: d.node.clone(),
                ..Default::default()
            };
            for p in pods
                .iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&d.node))
            {
                r.pods.push(p.name_any());
                let claim = p
                    .spec
                    .iter()
                    .flat_map(|s| s.volumes.iter().flatten())
                    .find_map(|v| v.persistent_volume_claim.as_ref());
                if let Some(pv) = claim.and_then(|c| volume_of(&c.claim_name)) {
                    r.stateful.push(p.name_any());
                    if let Some(va) = vas.iter().find(|va| {
                        va.spec.node_name == d.node
                            && va.spec.source.persistent_volume_name.as_deref() == Some(&pv)
                    }) {
                        r.old.insert(pv.clone(), va.name_any());
                    }
                    r.pvs.push(pv);
                }
            }
            r
        })
        .collect())
}

/// One drain's figures from the audit log: delete → first eviction, and
/// the cluster's critical path ([`critical_path`]).
#[derive(Debug, Default)]
struct RouteTimes {
    first_eviction: Option<f64>,
    cluster: Option<f64>,
}

/// The step durations of every route (see [`Scale::steps_seconds`]), and
/// each route's [`RouteTimes`] by Machine.
fn step_times(
    log: &[super::audit::Request],
    user: &str,
    routes: &[Route],
) -> (BTreeMap<String, super::Gaps>, BTreeMap<String, RouteTimes>) {
    let mut out: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut per_route = BTreeMap::new();
    for r in routes {
        let Some(start) = r.start else { continue };
        let evicted = |pod: &str| {
            log.iter()
                .filter(|q| q.user == user && q.verb == "create" && q.resource == "pods")
                .filter(|q| q.subresource.as_deref() == Some("eviction"))
                .filter(|q| q.name.as_deref() == Some(pod) && q.received > start)
                .filter(|q| q.code < 300)
                .map(|q| q.received)
                .min()
        };
        let gone = |pod: &str| super::pod_gone(log, pod, start).map(|q| q.completed);
        let mut stateless = Vec::new();
        for pod in &r.pods {
            if let (Some(e), Some(g)) = (evicted(pod), gone(pod)) {
                let took = super::secs(e, g);
                out.entry("evicted → gone").or_default().push(took);
                if !r.stateful.contains(pod) {
                    stateless.push(took);
                }
            }
        }
        let mut chain = Vec::new();
        // In the order the controller evicted them.
        let mut order: Vec<(Option<Timestamp>, &String, &String)> = r
            .stateful
            .iter()
            .zip(&r.pvs)
            .map(|(pod, pv)| (evicted(pod), pod, pv))
            .collect();
        order.sort();
        for (i, (_, pod, pv)) in order.iter().enumerate() {
            let gone = gone(pod);
            let detached = r
                .old
                .get(*pv)
                .and_then(|va| super::last_write_by(log, "kwok", "volumeattachments", va))
                .map(|q| q.completed);
            let attached_by = r.new.get(*pv).and_then(|va| {
                super::first_write_by(log, "kwok", "volumeattachments", va, "status")
            });
            let attached = attached_by.map(|q| q.completed);
            let evicted_at = order[i].0;
            let moved = evicted_at.zip(attached).map(|(e, a)| super::secs(e, a));
            if let Some(took) = moved {
                // The first move of every drain meets the burst of all
                // drains' first evictions; the later ones do not.
                let which = if i == 0 {
                    "evicted → attached elsewhere, first stateful pod"
                } else {
                    "evicted → attached elsewhere, later stateful pods"
                };
                out.entry(which).or_default().push(took);
            }
            chain.push(moved);
            if let (Some(g), Some(d)) = (gone, detached) {
                out.entry("gone → detached")
                    .or_default()
                    .push(super::secs(g, d));
            }
            if let (Some(d), Some(a)) = (detached, attached) {
                out.entry("detached → attached elsewhere")
                    .or_default()
                    .push(super::secs(d, a));
            }
            // The controller's turn: the next stateful pod's eviction (see
            // `audit::reaction_ms` on one heard before the attach completed).
            if let (Some(a), Some((Some(e), _, _))) = (attached_by, order.get(i + 1))
                && let Some(took) = super::audit::reaction_seconds(a, *e)
            {
                out.entry("attached → next eviction (controller)")
                    .or_default()
                    .push(took);
            }
        }
        let first_eviction = r.pods.iter().filter_map(|p| evicted(p)).min();
        per_route.insert(
            r.machine.clone(),
            RouteTimes {
                first_eviction: first_eviction.map(|e| super::secs(start, e)),
                cluster: critical_path(&stateless, &chain),
            },
        );
    }
    let steps = out
        .into_iter()
        .map(|(k, v)| (k.to_owned(), super::Gaps::of(&v)))
        .collect();
    (steps, per_route)
}

/// What the Machine watch saw of each drained Machine.
#[derive(Debug, Default)]
pub struct Seen {
    /// When it disappeared.
    pub gone: BTreeMap<String, Timestamp>,
    /// Its `status.drain.finishedAt`, as the controller wrote it.
    pub finished: BTreeMap<String, Timestamp>,
}

/// When each of `names` finished its drain and disappeared, watched from
/// before their deletion (`listed` fires once the watch has its initial
/// list).
pub async fn watch_ends(
    api: Api<Machine>,
    names: BTreeSet<String>,
    listed: tokio::sync::oneshot::Sender<()>,
) -> anyhow::Result<Seen> {
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    futures::pin_mut!(stream);
    let mut listed = Some(listed);
    let mut present: BTreeSet<String> = BTreeSet::new();
    let mut seen = Seen::default();
    while let Some(event) = stream.try_next().await? {
        match event {
            watcher::Event::Init => present.clear(),
            watcher::Event::InitApply(m) => {
                present.insert(m.name_any());
            }
            watcher::Event::InitDone => {
                // After a re-list, a Machine missing from it went meanwhile.
                let now = Timestamp::now();
                for n in names.iter().filter(|n| !present.contains(*n)) {
                    seen.gone.entry(n.clone()).or_insert(now);
                }
                if let Some(tx) = listed.take() {
                    let _ = tx.send(());
                }
            }
            watcher::Event::Apply(m) => {
                let finished = m
                    .status
                    .as_ref()
                    .and_then(|s| s.drain.as_ref())
                    .and_then(|d| d.finished_at.as_ref());
                if let Some(t) = finished.filter(|_| names.contains(&m.name_any())) {
                    seen.finished.insert(m.name_any(), t.0);
                }
            }
            watcher::Event::Delete(m) => {
                if names.contains(&m.name_any()) {
                    seen.gone.entry(m.name_any()).or_insert_with(Timestamp::now);
                }
            }
        }
        if listed.is_none() && seen.gone.len() == names.len() {
            return Ok(seen);
        }
    }
    anyhow::bail!("the Machine watch ended")
}

/// A `berth run` child process: the same binary, under the bench
/// ServiceAccount's kubeconfig, fake provider, Machines of the bench
/// namespace only, no leader election. Its resident memory is sampled in
/// the background; it is killed if dropped, and (through `setpriv
/// --pdeathsig`, where available, as the test bed's components) if the
/// benchmark dies.
struct Controller {
    child: tokio::process::Child,
    pid: u32,
    port: u16,
    log: PathBuf,
    samples: Arc<Mutex<Vec<(Instant, u64)>>>,
    sampler: tokio::task::JoinHandle<()>,
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.sampler.abort();
    }
}

/// The controller binary the scale scenario runs as its own process: the
/// `berth` built beside this `berth-dev` (`make bench` builds both).
fn berth_binary() -> anyhow::Result<PathBuf> {
    let dev = std::env::current_exe()?;
    let berth = dev.with_file_name("berth");
    anyhow::ensure!(
        berth.exists(),
        "the scale scenario runs the controller as `berth run`, and {} is not built \
         (`cargo build --release --locked --workspace --bins` builds it beside berth-dev)",
        berth.display()
    );
    Ok(berth)
}

impl Controller {
    fn spawn(kubeconfig: &Path, log: &Path) -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let out = std::fs::File::create(log)
            .with_context(|| format!("creating the controller log {}", log.display()))?;
        let exe = berth_binary()?;
        let setpriv = Path::new("/usr/bin/setpriv");
        let mut command = if setpriv.exists() {
            let mut c = tokio::process::Command::new(setpriv);
            c.args(["--pdeathsig", "KILL", "--"]).arg(exe);
            c
        } else {
            tokio::process::Command::new(exe)
        };
        let child = command
            .arg("run")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg(format!("--namespace={NS}"))
            .arg(format!("--metrics-addr=127.0.0.1:{port}"))
            .arg("--leader-elect=false")
            .arg("--providers=fake")
            .env("BERTH_LOG", "info")
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .context("starting `berth run`")?;
        let pid = child.id().context("the controller exited at once")?;
        let samples = Arc::new(Mutex::new(Vec::new()));
        let sampler = tokio::spawn(sample_rss(pid, Arc::clone(&samples)));
        Ok(Self {
            child,
            pid,
            port,
            log: log.to_path_buf(),
            samples,
            sampler,
        })
    }

    fn proc(&self, file: &str) -> Option<String> {
        std::fs::read_to_string(format!("/proc/{}/{file}", self.pid)).ok()
    }

    fn cpu_seconds(&self) -> Option<f64> {
        stat_cpu_ticks(&self.proc("stat")?).map(|t| t as f64 / CLOCK_TICKS_PER_SECOND)
    }

    fn status_mib(&self, key: &str) -> Option<f64> {
        status_kib(&self.proc("status")?, key).map(|k| k as f64 / 1024.0)
    }

    fn peak_sampled_since(&self, since: Instant) -> Option<f64> {
        self.samples
            .lock()
            .ok()?
            .iter()
            .filter(|(t, _)| *t >= since)
            .map(|(_, kib)| *kib)
            .max()
            .map(|k| k as f64 / 1024.0)
    }

    /// Closes `phase` now; `cpu_before` and `reconciles_before` are the
    /// readings at its start. Returns the CPU reading at its end.
    async fn end_phase(
        &self,
        phase: &mut Phase,
        bed: &TestBed,
        started: Instant,
        cpu_before: f64,
        reconciles_before: Option<f64>,
    ) -> f64 {
        phase.to = Timestamp::now();
        phase.seconds = started.elapsed().as_secs_f64();
        phase.bed_cores =
            cores_between(&phase.bed_from, &process_ticks(&bed.pids()), phase.seconds);
        let cpu = self.cpu_seconds();
        phase.cpu_seconds = cpu.map(|c| c - cpu_before);
        phase.cpu_cores = phase
            .cpu_seconds
            .map(|c| c / phase.seconds.max(f64::EPSILON));
        phase.machine_busy_cores = match (phase.machine_busy_from, machine_busy_ticks()) {
            (Some(a), Some(b)) => Some(cores(b.saturating_sub(a), phase.seconds)),
            _ => None,
        };
        phase.rss_end_mib = self.status_mib("VmRSS");
        phase.rss_peak_sampled_mib = self.peak_sampled_since(started);
        let now = self.reconciles().await;
        phase.reconciles = match (now, reconciles_before) {
            (Some(n), Some(b)) => Some(n - b),
            (n, None) => n,
            (None, _) => None,
        };
        eprintln!(
            "scale: {} {:.1}s: CPU {:.1}s (machine busy {:.2} cores), RSS {:.1} MiB (peak sampled {:.1}), {} reconciles",
            phase.name,
            phase.seconds,
            phase.cpu_seconds.unwrap_or(f64::NAN),
            phase.machine_busy_cores.unwrap_or(f64::NAN),
            phase.rss_end_mib.unwrap_or(f64::NAN),
            phase.rss_peak_sampled_mib.unwrap_or(f64::NAN),
            phase.reconciles.unwrap_or(f64::NAN)
        );
        cpu.unwrap_or(cpu_before)
    }

    /// A GET on the controller's HTTP port: status and body.
    async fn get(&self, path: &str) -> Option<(u16, String)> {
        crate::testbed::http_get(self.port, path).await
    }

    async fn reconciles(&self) -> Option<f64> {
        let (_, body) = self.get("/metrics").await?;
        metric_sum(&body, "berth_reconcile_total")
    }

    fn exited(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            anyhow::bail!(
                "the controller exited ({status}); last lines of {}:\n{}",
                self.log.display(),
                crate::testbed::tail(&self.log)
            );
        }
        Ok(())
    }

    /// The HTTP port has no watch: it is probed, as a kubelet would.
    async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.exited()?;
            if self.get("/readyz").await.is_some_and(|(s, _)| s == 200) {
                return Ok(());
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "the controller was not ready after {timeout:?}; last lines of {}:\n{}",
                    self.log.display(),
                    crate::testbed::tail(&self.log)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// After the sync every Machine is reconciled once more. Waits until
    /// that pass is over: `berth_reconcile_total` has reached `machines`
    /// and then grew by less than a tenth of `machines` in a second (the
    /// Node heartbeats alone wake about a thirtieth of the Machines a
    /// second).
    async fn wait_settled(&mut self, machines: f64, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last: Option<f64> = None;
        loop {
            self.exited()?;
            let now = self.reconciles().await;
            if let (Some(n), Some(l)) = (now, last)
                && n >= machines
                && n - l < settled_rate(machines)
            {
                return Ok(());
            }
            last = now;
            if Instant::now() > deadline {
                anyhow::bail!("the controller's reconciles had not settled after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// SIGTERM, then up to a minute for a graceful exit before SIGKILL.
    async fn stop(mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status();
        if tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .is_err()
        {
            eprintln!("scale: the controller ignored SIGTERM for 60s; killing it");
            let _ = self.child.kill().await;
        }
    }
}

/// Samples `VmRSS` of `pid` every [`SAMPLE_EVERY`] until it is gone.
async fn sample_rss(pid: u32, samples: Arc<Mutex<Vec<(Instant, u64)>>>) {
    let mut every = tokio::time::interval(SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return;
        };
        if let (Some(kib), Ok(mut s)) = (status_kib(&status, "VmRSS"), samples.lock()) {
            s.push((Instant::now(), kib));
        }
    }
}

fn opt(v: Option<f64>, precision: usize) -> String {
    v.map(|v| format!("{v:.precision$}"))
        .unwrap_or_else(|| "-".into())
}

fn verdict(pass: bool) -> &'static str {
    if pass { "pass" } else { "FAIL" }
}

/// The scale scenario's lines of the printed table.
pub fn table(s: &Scale) -> String {
    let c = &s.counted;
    let mut out = format!(
        "scale: {} Machines, {} Nodes, {} pods, {} VolumeAttachments, {} PersistentVolumes (counted); {} concurrent drains of {} pods; populated in {} s, settled {} s later\n",
        c.machines,
        c.nodes,
        c.pods,
        c.volume_attachments,
        c.persistent_volumes,
        s.drains.len(),
        s.drained_pods,
        opt(s.populate_seconds, 0),
        opt(s.settle_seconds, 0),
    );
    out.push_str(&format!(
        "  restarted controller: ready (caches synced) in {} s, its pass over every Machine done in {} s\n",
        opt(s.ready_seconds, 1),
        opt(s.sync_seconds, 1),
    ));
    out.push_str(
        "  phase      seconds  CPU s  cores  machine busy cores  RSS end MiB  RSS peak MiB  reconciles  API writes\n",
    );
    for p in &s.phases {
        out.push_str(&format!(
            "  {:<9} {:>8.1}  {:>5}  {:>5}  {:>18}  {:>11}  {:>12}  {:>10}  {:>10}\n",
            p.name,
            p.seconds,
            opt(p.cpu_seconds, 1),
            opt(p.cpu_cores, 2),
            opt(p.machine_busy_cores, 2),
            opt(p.rss_end_mib, 1),
            opt(p.rss_peak_sampled_mib, 1),
            opt(p.reconciles, 0),
            p.api_writes,
        ));
    }
    for p in s.phases.iter().filter(|p| !p.bed_cores.is_empty()) {
        let mut by_use: Vec<(&String, &f64)> = p.bed_cores.iter().collect();
        by_use.sort_by(|a, b| b.1.total_cmp(a.1));
        let parts: Vec<String> = by_use
            .iter()
            .map(|(name, cores)| format!("{name} {cores:.2}"))
            .collect();
        out.push_str(&format!(
            "  {:<9} test bed cores: {}\n",
            p.name,
            parts.join(", ")
        ));
    }
    if !s.bed_writes_during_drains.is_empty() {
        let mut by_count: Vec<(&String, &u64)> = s.bed_writes_during_drains.iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let total: u64 = by_count.iter().map(|(_, n)| **n).sum();
        let top: Vec<String> = by_count
            .iter()
            .take(12)
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect();
        out.push_str(&format!(
            "  writes the API server served during the drains (every client): {total}; {}\n",
            top.join(", ")
        ));
    }
    out.push_str(&format!(
        "  peak RSS {} MiB (populating {}, after restart {}), {} MiB after sync: target <= {:.0} MiB {}\n",
        opt(s.peak_rss_mib, 1),
        opt(s.populate_peak_rss_mib, 1),
        opt(s.measured_peak_rss_mib, 1),
        opt(s.rss_after_sync_mib, 1),
        s.targets.peak_rss_mib,
        verdict(s.targets.peak_rss_pass),
    ));
    out.push_str(&format!(
        "  slowest drain over its floor by {} s: target <= {:.0} s {}\n",
        opt(s.max_over_floor_seconds, 1),
        s.targets.over_floor_seconds,
        verdict(s.targets.drains_pass),
    ));
    out.push_str(&format!(
        "    of which the cluster's own steps: up to {} s over a floor; the controller's part of any drain: at most {} s ({} on the same bound)\n",
        opt(s.max_cluster_over_floor_seconds, 1),
        opt(s.max_controller_seconds, 1),
        verdict(s.targets.controller_share_pass),
    ));
    if !s.steps_seconds.is_empty() {
        out.push_str("  where the time went, per pod (s): step  n  p50 / p99 / max\n");
    }
    for (step, g) in &s.steps_seconds {
        out.push_str(&format!(
            "    {:<40} {:>4}  {} / {} / {}\n",
            step,
            g.n,
            opt(g.p50, 3),
            opt(g.p99, 3),
            opt(g.max, 3)
        ));
    }
    for d in &s.drains {
        out.push_str(&format!(
            "    {:<14} stateful {:>2}  stateless {:>3}  floor {:>5.1} s  wall {:>6} s  over {:>5} s  (cluster {:>5} s, controller {:>5} s, first eviction after {:>5} s)  gone {:>6} s  {}\n",
            d.machine,
            d.stateful_pods,
            d.stateless_pods,
            d.floor_seconds,
            opt(d.wall_seconds, 1),
            opt(d.over_floor_seconds, 1),
            opt(d.cluster_seconds, 1),
            opt(d.controller_seconds, 1),
            opt(d.first_eviction_seconds, 1),
            opt(d.gone_seconds, 1),
            d.outcome.as_deref().unwrap_or("no drain Event"),
        ));
    }
    if let Some(n) = &s.note {
        out.push_str(&format!("  note: {n}\n"));
    }
    out
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
        let template = sts.spec.expect("spec").template;
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
