//! Telemetry: the Prometheus metrics berth exports and the small HTTP server
//! that serves them together with the liveness and readiness probes.
//!
//! This module owns:
//!
//! * [`Metrics`]: one private [`prometheus::Registry`] (not the global
//!   default one, so tests can build as many as they like) with every
//!   `berth_*` metric family registered exactly once. Callers update the
//!   public metric handles directly; handles are cheap to clone.
//! * `ReconcileTimer`: a drop guard that measures one reconcile and counts
//!   its result, so that every exit path of a reconcile (including `?` and
//!   panics) is observed exactly once.
//! * [`serve`] and [`HttpState`]: `GET /metrics`, `GET /healthz` and
//!   `GET /readyz` on axum.
//! * [`events::EventSink`]: Kubernetes Events, queued and published off the
//!   critical path.
//!
//! The list of family names ([`Metrics::names`]) is what docs/operations.md's metric
//! table is checked against, so adding a metric here means documenting it.

pub mod events;
mod http;

pub use self::http::{HttpState, serve};

use std::time::{Duration, Instant};

use prometheus::core::Collector;
use prometheus::{
    Encoder as _, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use tokio::sync::watch;

/// Content type of the Prometheus text exposition format served on
/// `/metrics`.
pub(crate) const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

/// Buckets for short operations (a reconcile), in seconds: 5 ms .. ~41 s.
const RECONCILE_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
];
/// Buckets for cloud provider calls, in seconds: 10 ms .. 2 min.
const PROVIDER_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Buckets for waiting on a volume to detach or re-attach: 0.5 s .. 30 min.
const VOLUME_WAIT_BUCKETS: &[f64] = &[
    0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0,
];
/// Buckets for whole drains: 1 s .. 8 h.
const DRAIN_BUCKETS: &[f64] = &[
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0,
    28800.0,
];

/// The `result` label value [`ReconcileTimer`] counts unless told otherwise.
pub(crate) const RESULT_OK: &str = "ok";
/// The `result` label value [`ReconcileTimer`] counts when it is dropped
/// while its thread is panicking.
pub(crate) const RESULT_PANIC: &str = "panic";
/// The `result` label value of a reconcile whose status write was refused
/// because the Machine had changed since it was read: not an error, the
/// Machine is reconciled again on its newer version.
pub const RESULT_CONFLICT: &str = "conflict";

/// The outcome of one pod eviction attempt: the `result` label of
/// `berth_pod_evictions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum EvictionResult {
    /// The Eviction API accepted the eviction.
    Evicted,
    /// A PodDisruptionBudget refused it (HTTP 429); will be retried.
    PdbBlocked,
    /// More than one PodDisruptionBudget selects the pod (HTTP 500 from the
    /// Eviction API); needs a human.
    MisconfiguredPdb,
    /// The pod was deleted directly (e.g. it was not running or already
    /// terminating).
    Deleted,
    /// The pod was removed ignoring its PodDisruptionBudget because the
    /// drain deadline passed.
    Forced,
    /// The API server's own flow control refused it (HTTP 429 without a
    /// budget's cause); retried after its `Retry-After`.
    Throttled,
    /// Any other API error.
    Error,
}

/// The `kind` label values of the move ledger's metrics: the workload
/// kinds of Kubernetes' own controllers, `Pod` for a pod without one, and
/// `other` for any other controller (a closed set: a label per custom kind
/// would be a series per kind of every operator's CRDs).
pub(crate) const WORKLOAD_KINDS: [&str; 6] = [
    "StatefulSet",
    "Deployment",
    "ReplicaSet",
    "Job",
    "Pod",
    "other",
];

/// What became of one orphan VM in one round of orphan collection: the
/// `outcome` label of `berth_orphan_vms_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum OrphanOutcome {
    /// The provider deleted it (or was already deleting it, or it was gone).
    Collected,
    /// `--orphan-dry-run`: it would have been deleted.
    WouldCollect,
    /// The provider's delete failed; tried again next round.
    Failed,
    /// Not deleted: its Node still runs pods, or the round found more
    /// orphans than it may take of the fleet at once.
    Held,
}

impl OrphanOutcome {
    /// Every variant, in a fixed order.
    pub const ALL: [OrphanOutcome; 4] = [
        OrphanOutcome::Collected,
        OrphanOutcome::WouldCollect,
        OrphanOutcome::Failed,
        OrphanOutcome::Held,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            OrphanOutcome::Collected => "collected",
            OrphanOutcome::WouldCollect => "would_collect",
            OrphanOutcome::Failed => "failed",
            OrphanOutcome::Held => "held",
        }
    }
}

impl EvictionResult {
    /// Every variant, in a fixed order.
    pub const ALL: [EvictionResult; 7] = [
        EvictionResult::Evicted,
        EvictionResult::PdbBlocked,
        EvictionResult::MisconfiguredPdb,
        EvictionResult::Deleted,
        EvictionResult::Forced,
        EvictionResult::Throttled,
        EvictionResult::Error,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            EvictionResult::Evicted => "evicted",
            EvictionResult::PdbBlocked => "pdb_blocked",
            EvictionResult::MisconfiguredPdb => "misconfigured_pdb",
            EvictionResult::Deleted => "deleted",
            EvictionResult::Forced => "forced",
            EvictionResult::Throttled => "throttled",
            EvictionResult::Error => "error",
        }
    }
}

/// Every metric berth exports, registered in one private registry.
///
/// Build it once at start-up, wrap it in an `Arc` and hand clones of the
/// `Arc` (or of individual handles) to whoever records.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    names: Vec<String>,
    docs: Vec<MetricDoc>,
    /// `berth_machines{phase}`: Machines per phase.
    pub machines: IntGaugeVec,
    /// `berth_reconcile_total{result}`: reconciles by result.
    pub reconcile_total: IntCounterVec,
    /// `berth_reconcile_duration_seconds`: time per reconcile.
    pub reconcile_duration: Histogram,
    /// `berth_drain_duration_seconds{outcome}`: time per finished drain.
    pub drain_duration: HistogramVec,
    /// `berth_drains_in_progress`: drains started and not yet finished.
    pub drains_in_progress: IntGauge,
    /// `berth_pod_evictions_total{result}`: eviction attempts by result.
    pub pod_evictions: IntCounterVec,
    /// `berth_volume_detach_wait_seconds`: wait for a volume to detach.
    pub volume_detach_wait: Histogram,
    /// `berth_volume_reattach_wait_seconds`: wait for a volume to attach to
    /// the replacement pod's node.
    pub volume_reattach_wait: Histogram,
    /// `berth_volume_attachment_events_total`: VolumeAttachment watch events.
    pub volume_attachment_events: IntCounter,
    /// `berth_tracker_lagged_total`: times a tracker subscriber lagged.
    pub tracker_lagged: IntCounter,
    /// `berth_events_dropped_total`: Events not published.
    pub events_dropped: IntCounter,
    /// `berth_volumes_left_attached_total`: volumes still attached to a
    /// Node when its VM was deleted.
    pub volumes_left_attached: IntCounter,
    /// `berth_provider_requests_total{driver,op,result}`.
    pub provider_requests: IntCounterVec,
    /// `berth_provider_request_duration_seconds{driver,op}`.
    pub provider_request_duration: HistogramVec,
    /// `berth_node_not_ready_machines`: Running Machines whose Node has been
    /// NotReady for longer than the health timeout.
    pub node_not_ready_machines: IntGauge,
    /// `berth_surges_total{outcome}`: surges before evict, by outcome.
    pub surges: IntCounterVec,
    /// `berth_remediations_total{outcome}`: steps of remediations taken.
    pub remediations: IntCounterVec,
    /// `berth_remediations{state}`: Machines held from or under
    /// remediation now.
    pub remediations_now: IntGaugeVec,
    /// `berth_leader`: 1 while this replica holds the leader Lease.
    pub leader: IntGauge,
    /// `berth_orphan_vms_total{driver,outcome}`: orphan VMs found, per
    /// round, by what became of them.
    pub orphan_vms: IntCounterVec,
    /// `berth_rollout_drains`: old Machines being deleted by rollouts now.
    pub rollout_drains: IntGauge,
    /// `berth_rollout_machines_replaced_total`: old Machines rollouts chose
    /// to delete.
    pub rollout_machines_replaced: IntCounter,
    /// `berth_machinedeployments_stalled`: deployments whose Progressing
    /// condition is False.
    pub machinedeployments_stalled: IntGauge,
    /// `berth_volume_moves_in_flight{kind}`: moves holding a permit of the
    /// move ledger, by workload kind.
    pub volume_moves_in_flight: IntGaugeVec,
    /// `berth_move_budget_wait_seconds{kind}`: how long a pod waited for a
    /// permit before its move began, by workload kind.
    pub move_budget_wait: HistogramVec,
    /// `berth_move_permits_expired_total{kind}`: permits ended at their
    /// healthy deadline with their workload not whole, by workload kind.
    pub move_permits_expired: IntCounterVec,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

/// Registers collectors in one registry and remembers their family names
/// (a registry does not list families that have no samples yet).
struct Registrar {
    registry: Registry,
    names: Vec<String>,
    docs: Vec<MetricDoc>,
}

/// One metric family as documented in the metrics reference of docs/operations.md.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricDoc {
    pub name: String,
    /// `counter`, `gauge` or `histogram`.
    pub kind: &'static str,
    pub labels: Vec<String>,
    pub help: String,
}

fn kind_of<C>() -> &'static str {
    let t = std::any::type_name::<C>();
    if t.contains("Histogram") {
        "histogram"
    } else if t.contains("Counter") {
        "counter"
    } else {
        "gauge"
    }
}

impl Registrar {
    fn gauge(&mut self, name: &str, help: &str) -> prometheus::Result<IntGauge> {
        self.add(IntGauge::new(name, help)?)
    }

    fn gauge_vec(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> prometheus::Result<IntGaugeVec> {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels)?)
    }

    fn counter(&mut self, name: &str, help: &str) -> prometheus::Result<IntCounter> {
        self.add(IntCounter::new(name, help)?)
    }

    fn counter_vec(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> prometheus::Result<IntCounterVec> {
        self.add(IntCounterVec::new(Opts::new(name, help), labels)?)
    }

    fn histogram(
        &mut self,
        name: &str,
        help: &str,
        buckets: &[f64],
    ) -> prometheus::Result<Histogram> {
        self.add(Histogram::with_opts(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        )?)
    }

    fn histogram_vec(
        &mut self,
        name: &str,
        help: &str,
        buckets: &[f64],
        labels: &[&str],
    ) -> prometheus::Result<HistogramVec> {
        self.add(HistogramVec::new(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
            labels,
        )?)
    }

    fn add<C: Collector + Clone + 'static>(&mut self, collector: C) -> prometheus::Result<C> {
        self.names
            .extend(collector.desc().iter().map(|d| d.fq_name.clone()));
        self.docs.extend(collector.desc().iter().map(|d| MetricDoc {
            name: d.fq_name.clone(),
            kind: kind_of::<C>(),
            labels: d.variable_labels.clone(),
            help: d.help.clone(),
        }));
        self.registry.register(Box::new(collector.clone()))?;
        Ok(collector)
    }
}

impl Metrics {
    /// Creates every metric and registers it in a fresh registry.
    ///
    /// # Errors
    /// Only on a programming error in the definitions below (invalid name,
    /// duplicate registration, bad buckets).
    pub fn new() -> Result<Self, prometheus::Error> {
        let mut r = Registrar {
            registry: Registry::new(),
            names: Vec::new(),
            docs: Vec::new(),
        };
        // Registered in the order written: the order of `names()` and of
        // the reference table in docs/operations.md.
        let metrics = Self {
            machines: r.gauge_vec("berth_machines", "Number of Machines in each lifecycle phase, as last seen by this replica.", &["phase"])?,
            reconcile_total: r.counter_vec("berth_reconcile_total", "Machine reconciles by result: \"ok\"; \"conflict\" when a status write was refused because the Machine had changed since it was read (reconciled again shortly on the newer version; not an error); or \"error_\" and the call that failed: error_status, error_provider_id (recording the providerID), error_finalizer, error_node_get, error_cordon, error_pod_delete, error_node_delete, error_out_of_service (the out-of-service taint), error_node_conditions (the Node's lifecycle conditions), error_provider_create, error_provider_delete, error_provider_fence (stopping or terminating the VM of a Machine being remediated), error_machine_delete (deleting a remediated Machine), error_no_namespace.", &["result"])?,
            reconcile_duration: r.histogram("berth_reconcile_duration_seconds", "Wall-clock time of one Machine reconcile, whatever its result.", RECONCILE_BUCKETS)?,
            drain_duration: r.histogram_vec("berth_drain_duration_seconds", "Time from the start of a Node drain until it finished, by outcome.", DRAIN_BUCKETS, &["outcome"])?,
            drains_in_progress: r.gauge("berth_drains_in_progress", "Node drains started by this replica and not finished yet.")?,
            pod_evictions: r.counter_vec("berth_pod_evictions_total", "Pod eviction attempts during drains, by result (evicted, pdb_blocked, misconfigured_pdb, deleted, forced, throttled, error).", &["result"])?,
            volume_detach_wait: r.histogram("berth_volume_detach_wait_seconds", "Time from evicting a pod until every volume it used was detached from the draining Node.", VOLUME_WAIT_BUCKETS)?,
            volume_reattach_wait: r.histogram("berth_volume_reattach_wait_seconds", "Time from a volume's detach until it was attached to the Node of the replacement pod.", VOLUME_WAIT_BUCKETS)?,
            volume_attachment_events: r.counter("berth_volume_attachment_events_total", "VolumeAttachment watch events processed by the volume tracker.")?,
            tracker_lagged: r.counter("berth_tracker_lagged_total", "Times a volume tracker subscriber fell behind and missed events (it then re-reads the state).")?,
            events_dropped: r.counter("berth_events_dropped_total", "Kubernetes Events not published: their queue was full or the API server refused them.")?,
            volumes_left_attached: r.counter("berth_volumes_left_attached_total", "Volumes (VolumeAttachments) still attached to a Node when its VM was deleted: their detach was not confirmed in volumeDetachTimeout, or the deletion was forced.")?,
            provider_requests: r.counter_vec("berth_provider_requests_total", "Requests to the machine provider, by driver, operation and result. For aws, every EC2 API request, with the EC2 action as op (RunInstances, DescribeInstances, TerminateInstances, StopInstances, DescribeImages) and result ok, throttled, transient, invalid_spec, unauthorized, not_found or permanent; for fake, each operation (create, delete, get, stop, list).", &["driver", "op", "result"])?,
            provider_request_duration: r.histogram_vec("berth_provider_request_duration_seconds", "Latency of requests to the machine provider, by driver and operation (for aws, the EC2 action).", PROVIDER_BUCKETS, &["driver", "op"])?,
            node_not_ready_machines: r.gauge("berth_node_not_ready_machines", "Running Machines whose Node has been NotReady for longer than the health timeout.")?,
            surges: r.counter_vec("berth_surges_total", "Surges before evict of pods whose PodDisruptionBudget let none go, by outcome: rolled (a Deployment's template annotated, one new revision), scaled (a Deployment scaled up by one), replaced (the old pod removed by its controller once the new one was available), impossible (named; the pod is evicted as before), failed (no new pod available in time, or a write refused; the pod is evicted as before).", &["outcome"])?,
            remediations: r.counter_vec("berth_remediations_total", "Steps of the remediations of Machines whose Node died, by outcome: started (its VM is to be fenced), canceled (its Node came back before the VM was fenced), escalated (a stop past fenceTimeout turned into a terminate), fenced (the provider said the VM is stopped or terminated), freed (its Node tainted out of service and its pods deleted), failed (outside a pool: marked Failed, not replaced).", &["outcome"])?,
            remediations_now: r.gauge_vec("berth_remediations", "Machines whose Node is unhealthy, by the state of their remediation: held (more Machines are unhealthy than maxUnhealthy allows), fence, free, replace (the step under way).", &["state"])?,
            leader: r.gauge("berth_leader", "1 while this replica holds the leader election Lease, 0 otherwise.")?,
            orphan_vms: r.counter_vec("berth_orphan_vms_total", "Orphan VMs (tagged for a Machine of this cluster that no Machine has, older than --orphan-grace) found by orphan collection, once per round each, by driver and outcome: collected (deleted), would_collect (--orphan-dry-run), failed (the delete failed; tried again next round), held (not deleted: its Node still runs pods, or the round found more orphans than it may take of the fleet at once).", &["driver", "outcome"])?,
            rollout_drains: r.gauge("berth_rollout_drains", "Old Machines that MachineDeployment rollouts are deleting now, across every deployment, counted against --max-concurrent-drains (deletions asked of a MachineSet and not yet begun included).")?,
            rollout_machines_replaced: r.counter("berth_rollout_machines_replaced_total", "Old Machines that MachineDeployment rollouts chose to delete (each one lowers its old MachineSet by one).")?,
            machinedeployments_stalled: r.gauge("berth_machinedeployments_stalled", "MachineDeployments whose Progressing condition is False: a new Machine failing (NewMachineFailed), no progress within progressDeadlineSeconds (ProgressDeadlineExceeded), or a template its selector does not match.")?,
            volume_moves_in_flight: r.gauge_vec("berth_volume_moves_in_flight", "Volume moves holding a permit of the move ledger (evicted, and not yet attached where a healthy replacement runs), across every drain of this replica, by workload kind (StatefulSet, Deployment, ReplicaSet, Job, Pod for a pod without a controller, other). Bounded by --max-volume-moves and, per workload, by its berth.dev/max-moving.", &["kind"])?,
            move_permits_expired: r.counter_vec("berth_move_permits_expired_total", "Move permits ended at their healthy deadline (berth.dev/healthy-deadline, else the deadline of the drain that began the move) while their workload still had replicas unavailable, after the drain that held them ended or its Machine went: the next pod of that workload may move with the workload not whole. By workload kind.", &["kind"])?,
            move_budget_wait: r.histogram_vec("berth_move_budget_wait_seconds", "Time a stateful pod waited for its workload's move budget (another replica moving, on any Machine) or for a place under --max-volume-moves before its eviction, by workload kind.", DRAIN_BUCKETS, &["kind"])?,
            registry: r.registry,
            names: r.names,
            docs: r.docs,
        };
        // Series with a closed set of label values exist from the start, so
        // rate() and absent() work before the first event.
        for result in EvictionResult::ALL {
            metrics.pod_evictions.with_label_values(&[result.as_str()]);
        }
        metrics.reconcile_total.with_label_values(&[RESULT_OK]);
        for outcome in [
            "started",
            "canceled",
            "escalated",
            "fenced",
            "freed",
            "failed",
        ] {
            metrics.remediations.with_label_values(&[outcome]);
        }
        for outcome in ["rolled", "scaled", "replaced", "impossible", "failed"] {
            metrics.surges.with_label_values(&[outcome]);
        }
        for state in ["held", "fence", "free", "replace"] {
            metrics.remediations_now.with_label_values(&[state]);
        }
        for kind in WORKLOAD_KINDS {
            metrics.volume_moves_in_flight.with_label_values(&[kind]);
            metrics.move_budget_wait.with_label_values(&[kind]);
            metrics.move_permits_expired.with_label_values(&[kind]);
        }
        Ok(metrics)
    }

    /// The registry every metric is registered in.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Names of all registered metric families, in registration order.
    /// Families of labelled metrics are listed even before their first
    /// sample.
    pub fn names(&self) -> Vec<String> {
        self.names.clone()
    }

    /// Name, type, labels and help of every family, in registration order.
    pub fn docs(&self) -> &[MetricDoc] {
        &self.docs
    }

    /// The metrics reference of docs/operations.md: a Markdown table generated from the
    /// definitions, so the documentation cannot drift from the code.
    pub fn reference_markdown(&self) -> String {
        let mut out =
            String::from("| Metric | Type | Labels | Meaning |\n| --- | --- | --- | --- |\n");
        for d in &self.docs {
            let labels = if d.labels.is_empty() {
                "".to_string()
            } else {
                d.labels
                    .iter()
                    .map(|l| format!("`{l}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            out.push_str(&format!(
                "| `{}` | {} | {} | {} |\n",
                d.name,
                d.kind,
                labels,
                d.help.replace('|', "\\|")
            ));
        }
        out
    }

    /// The registry in the Prometheus text exposition format (version
    /// 0.0.4, see [`CONTENT_TYPE`]).
    ///
    /// # Errors
    /// Only if a collected family is malformed, which the metrics defined
    /// here cannot produce.
    pub(crate) fn try_encode(&self) -> Result<String, prometheus::Error> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        String::from_utf8(buf).map_err(|e| prometheus::Error::Msg(e.to_string()))
    }

    /// Like `Metrics::try_encode`, but logs an error and returns an empty
    /// exposition instead of failing.
    pub fn encode(&self) -> String {
        self.try_encode().unwrap_or_else(|e| {
            tracing::error!(error = %e, "encoding metrics failed");
            String::new()
        })
    }

    /// Starts timing one reconcile; see [`ReconcileTimer`].
    pub(crate) fn reconcile_timer(&self) -> ReconcileTimer {
        ReconcileTimer {
            start: Instant::now(),
            result: RESULT_OK,
            duration: self.reconcile_duration.clone(),
            total: self.reconcile_total.clone(),
        }
    }

    /// Records one eviction attempt.
    pub(crate) fn record_eviction(&self, result: EvictionResult) {
        self.pod_evictions
            .with_label_values(&[result.as_str()])
            .inc();
    }

    /// Records one finished provider request.
    pub(crate) fn record_provider_request(
        &self,
        driver: &str,
        op: &str,
        result: &str,
        took: Duration,
    ) {
        self.provider_requests
            .with_label_values(&[driver, op, result])
            .inc();
        self.provider_request_duration
            .with_label_values(&[driver, op])
            .observe(took.as_secs_f64());
    }

    /// Makes the `berth_orphan_vms_total` series of `driver` exist, at 0,
    /// so that rate() and absent() work before the first orphan.
    pub(crate) fn init_orphans(&self, driver: &str) {
        for outcome in OrphanOutcome::ALL {
            self.orphan_vms
                .with_label_values(&[driver, outcome.as_str()]);
        }
    }

    /// Records one orphan VM's outcome.
    pub(crate) fn record_orphan(&self, driver: &str, outcome: OrphanOutcome) {
        self.orphan_vms
            .with_label_values(&[driver, outcome.as_str()])
            .inc();
    }

    /// Records one finished drain.
    pub(crate) fn record_drain(&self, outcome: &str, took: Duration) {
        self.drain_duration
            .with_label_values(&[outcome])
            .observe(took.as_secs_f64());
    }

    /// Mirrors a leader-election "am I leader" channel into `berth_leader`
    /// until the channel's sender goes away, then sets it to 0. Spawn it.
    pub(crate) fn follow_leader(
        &self,
        mut is_leader: watch::Receiver<bool>,
    ) -> impl Future<Output = ()> + Send + 'static {
        let gauge = self.leader.clone();
        async move {
            loop {
                gauge.set(i64::from(*is_leader.borrow_and_update()));
                if is_leader.changed().await.is_err() {
                    break;
                }
            }
            gauge.set(0);
        }
    }
}

/// Measures one reconcile: when dropped, observes the elapsed time in
/// `berth_reconcile_duration_seconds` and increments
/// `berth_reconcile_total{result}` once.
///
/// The result is [`RESULT_OK`] unless changed with
/// [`ReconcileTimer::set_result`] or [`ReconcileTimer::record`], or
/// [`RESULT_PANIC`] when dropped during a panic. Create it first thing in the
/// reconcile and let it fall out of scope: early returns and `?` are then
/// counted too.
#[derive(Debug)]
#[must_use = "the reconcile is measured when the timer is dropped"]
pub(crate) struct ReconcileTimer {
    start: Instant,
    result: &'static str,
    duration: Histogram,
    total: IntCounterVec,
}

impl ReconcileTimer {
    /// Sets the `result` label counted when the timer is dropped.
    pub(crate) fn set_result(&mut self, result: &'static str) {
        self.result = result;
    }

    /// The `result` label that will be counted.
    #[cfg(test)]
    fn result(&self) -> &'static str {
        self.result
    }

    /// Sets the result from a reconcile's `Result`: [`RESULT_OK`] for `Ok`,
    /// `label(error)` for `Err`.
    pub fn record<T, E>(&mut self, outcome: &Result<T, E>, label: impl FnOnce(&E) -> &'static str) {
        self.result = match outcome {
            Ok(_) => RESULT_OK,
            Err(e) => label(e),
        };
    }
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        let result = if std::thread::panicking() {
            RESULT_PANIC
        } else {
            self.result
        };
        self.duration.observe(self.start.elapsed().as_secs_f64());
        self.total.with_label_values(&[result]).inc();
    }
}

/// Holds one count of a gauge (a drain in `berth_drains_in_progress`) for
/// as long as it lives: given back when dropped, so a task that is aborted
/// (a forgotten Machine, lost leadership) gives it back too.
#[derive(Debug)]
pub(crate) struct GaugeHold(IntGauge);

impl GaugeHold {
    pub(crate) fn new(gauge: &IntGauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for GaugeHold {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_NAMES: [&str; 26] = [
        "berth_machines",
        "berth_reconcile_total",
        "berth_reconcile_duration_seconds",
        "berth_drain_duration_seconds",
        "berth_drains_in_progress",
        "berth_pod_evictions_total",
        "berth_volume_detach_wait_seconds",
        "berth_volume_reattach_wait_seconds",
        "berth_volume_attachment_events_total",
        "berth_tracker_lagged_total",
        "berth_events_dropped_total",
        "berth_volumes_left_attached_total",
        "berth_provider_requests_total",
        "berth_provider_request_duration_seconds",
        "berth_node_not_ready_machines",
        "berth_leader",
        "berth_remediations_total",
        "berth_remediations",
        "berth_surges_total",
        "berth_orphan_vms_total",
        "berth_rollout_drains",
        "berth_rollout_machines_replaced_total",
        "berth_machinedeployments_stalled",
        "berth_volume_moves_in_flight",
        "berth_move_budget_wait_seconds",
        "berth_move_permits_expired_total",
    ];

    fn count(m: &Metrics, result: &str) -> u64 {
        m.reconcile_total.with_label_values(&[result]).get()
    }

    #[test]
    fn every_metric_is_registered_once() {
        let m = Metrics::new().expect("metrics register");
        let names = m.names();
        for name in ALL_NAMES {
            assert!(names.iter().any(|n| n == name), "{name} not registered");
        }
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "duplicate names: {names:?}");
        assert_eq!(
            names.len(),
            ALL_NAMES.len(),
            "unexpected families: {names:?}"
        );
    }

    #[tokio::test]
    async fn a_held_gauge_is_given_back_when_its_task_is_aborted() {
        let m = Metrics::new().expect("metrics register");
        let gauge = m.drains_in_progress.clone();
        let task = tokio::spawn(async move {
            let _hold = GaugeHold::new(&gauge);
            std::future::pending::<()>().await;
        });
        tokio::task::yield_now().await;
        while m.drains_in_progress.get() == 0 {
            tokio::task::yield_now().await;
        }
        task.abort();
        assert!(task.await.is_err_and(|e| e.is_cancelled()));
        assert_eq!(m.drains_in_progress.get(), 0);
        {
            let _a = GaugeHold::new(&m.drains_in_progress);
            let _b = GaugeHold::new(&m.drains_in_progress);
            assert_eq!(m.drains_in_progress.get(), 2);
        }
        assert_eq!(m.drains_in_progress.get(), 0);
    }

    #[test]
    fn every_metric_is_encoded_with_help_after_use() {
        let m = Metrics::new().expect("metrics register");
        m.machines.with_label_values(&["Running"]).set(3);
        let _ = m.reconcile_timer();
        m.record_drain("completed", Duration::from_secs(90));
        m.drains_in_progress.inc();
        m.record_eviction(EvictionResult::PdbBlocked);
        m.volume_detach_wait.observe(4.0);
        m.volume_reattach_wait.observe(7.0);
        m.volume_attachment_events.inc();
        m.tracker_lagged.inc();
        m.events_dropped.inc();
        m.volumes_left_attached.inc();
        m.record_provider_request("fake", "create", "ok", Duration::from_millis(30));
        m.node_not_ready_machines.set(1);
        m.remediations.with_label_values(&["started"]).inc();
        m.remediations_now.with_label_values(&["held"]).set(1);
        m.leader.set(1);
        m.init_orphans("fake");
        m.record_orphan("fake", OrphanOutcome::Collected);

        let text = m.encode();
        for name in m.names() {
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "no help for {name}:\n{text}"
            );
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "no type for {name}:\n{text}"
            );
        }
        assert!(text.contains("berth_machines{phase=\"Running\"} 3"));
        assert!(text.contains("berth_pod_evictions_total{result=\"pdb_blocked\"} 1"));
        assert!(text.contains("berth_pod_evictions_total{result=\"forced\"} 0"));
        assert!(text.contains(
            "berth_provider_requests_total{driver=\"fake\",op=\"create\",result=\"ok\"} 1"
        ));
        assert!(
            text.contains(
                "berth_drain_duration_seconds_bucket{outcome=\"completed\",le=\"28800\"} 1"
            )
        );
        assert!(text.contains("berth_leader 1"));
        assert!(text.contains("berth_orphan_vms_total{driver=\"fake\",outcome=\"collected\"} 1"));
        assert!(
            text.contains("berth_orphan_vms_total{driver=\"fake\",outcome=\"would_collect\"} 0")
        );
    }

    #[test]
    fn reconcile_timer_counts_ok_by_default() {
        let m = Metrics::new().expect("metrics register");
        {
            let t = m.reconcile_timer();
            assert_eq!(t.result(), RESULT_OK);
        }
        assert_eq!(count(&m, "ok"), 1);
        assert_eq!(m.reconcile_duration.get_sample_count(), 1);
    }

    #[test]
    fn reconcile_timer_counts_each_exit_path_once() {
        fn reconcile(m: &Metrics, fail: bool) -> Result<(), &'static str> {
            let mut timer = m.reconcile_timer();
            let outcome = if fail { Err("provider") } else { Ok(()) };
            timer.record(&outcome, |e| e);
            outcome?;
            Ok(())
        }
        let m = Metrics::new().expect("metrics register");
        assert!(reconcile(&m, true).is_err());
        assert!(reconcile(&m, false).is_ok());
        assert!(reconcile(&m, true).is_err());
        assert_eq!(count(&m, "provider"), 2);
        assert_eq!(count(&m, "ok"), 1);
        assert_eq!(m.reconcile_duration.get_sample_count(), 3);

        let mut t = m.reconcile_timer();
        t.set_result("conflict");
        t.set_result("not_found");
        drop(t);
        assert_eq!(count(&m, "not_found"), 1);
        assert_eq!(count(&m, "conflict"), 0);
        assert_eq!(m.reconcile_duration.get_sample_count(), 4);
    }

    #[test]
    fn reconcile_timer_counts_a_panic() {
        let m = Metrics::new().expect("metrics register");
        let m2 = m.clone();
        let joined = std::thread::spawn(move || {
            let _timer = m2.reconcile_timer();
            panic!("reconcile blew up");
        })
        .join();
        assert!(joined.is_err());
        assert_eq!(count(&m, RESULT_PANIC), 1);
        assert_eq!(count(&m, RESULT_OK), 0);
        assert_eq!(m.reconcile_duration.get_sample_count(), 1);
    }

    #[test]
    fn reconcile_timer_measures_elapsed_time() {
        let m = Metrics::new().expect("metrics register");
        {
            let _t = m.reconcile_timer();
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(m.reconcile_duration.get_sample_sum() >= 0.02);
    }

    #[tokio::test]
    async fn leader_gauge_follows_the_channel() {
        let m = Metrics::new().expect("metrics register");
        let (tx, rx) = watch::channel(false);
        let task = tokio::spawn(m.follow_leader(rx));
        tx.send_replace(true);
        for _ in 0..100 {
            if m.leader.get() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(m.leader.get(), 1);
        drop(tx);
        task.await.expect("follower ends");
        assert_eq!(m.leader.get(), 0);
    }
}
