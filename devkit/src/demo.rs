//! `berth-dev demo` (`make demo`): the main job in one command. It starts a local control
//! plane (the test bed), installs the CRDs, runs the controller with the
//! `fake` provider, creates three Machines, puts a StatefulSet with
//! PersistentVolumes, a Deployment behind a PodDisruptionBudget and a
//! DaemonSet on the first one, deletes it, and prints the drain as it
//! happens. Then a MachineDeployment of three Machines takes the
//! workloads and is rolled to a new template, shown live with how often
//! each stateful pod moved. Everything it started is removed when it ends.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

use crate::testbed::timeline::rolled_out;
use crate::testbed::{Options, TestBed, fixtures, wait};
use berth::api::{Machine, MachineClass, MachineDeployment};
use berth::providers::Registry;
use berth::providers::fake::FakeProvider;
use berth::telemetry::{HttpState, Metrics};

const NS: &str = "demo";
const LONG: Duration = Duration::from_secs(120);

/// How the demo runs.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Simulated CSI attach latency.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub attach_delay: Duration,
    /// Simulated CSI detach latency.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub detach_delay: Duration,
    /// Replicas of the StatefulSet (each with its own PersistentVolume).
    #[arg(long, default_value_t = 3)]
    pub stateful: u32,
    /// Replicas of the Deployment (no volumes).
    #[arg(long, default_value_t = 6)]
    pub stateless: u32,
    /// Address for /metrics while the demo runs.
    #[arg(long, default_value = "127.0.0.1:9180")]
    pub metrics_addr: std::net::SocketAddr,
    /// Keep the control plane and controller running after the drain until
    /// Ctrl-C (to scrape /metrics or look around with kubectl).
    #[arg(long)]
    pub keep: bool,
    /// After the drain, roll a MachineDeployment of three Machines to a
    /// new template and show the rollout (`--rollout=false` skips it).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub rollout: bool,
}

struct Clock(Instant);

impl Clock {
    fn say(&self, what: impl std::fmt::Display) {
        println!("[{:>6.1}s] {what}", self.0.elapsed().as_secs_f64());
        let _ = std::io::stdout().flush();
    }
}

/// Runs the demo.
///
/// # Errors
/// Any step that fails, with what it was doing.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let clock = Clock(Instant::now());
    clock.say("starting a local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok)…");
    let bed = TestBed::start(
        Options::end_to_end()
            .attach_delay(args.attach_delay)
            .detach_delay(args.detach_delay),
    )
    .await
    .context("starting the local control plane")?;
    clock.say(format!(
        "control plane ready at {}  (export KUBECONFIG={})",
        bed.server(),
        bed.kubeconfig_path().display()
    ));
    let client = bed.client().await?;
    berth::api::install_crds(client.clone(), LONG).await?;
    clock.say("CRDs installed: machineclasses.berth.dev, machines.berth.dev");

    // The controller, in this process, with its metrics endpoint.
    let metrics = Arc::new(Metrics::new()?);
    let http = HttpState::new(Arc::clone(&metrics));
    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("cannot listen on {}", args.metrics_addr))?;
    let metrics_addr = listener.local_addr().unwrap_or(args.metrics_addr);
    let (http_stop_tx, http_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(berth::telemetry::serve(
        listener,
        http.clone(),
        async move {
            let _ = http_stop_rx.await;
        },
    ));
    let providers = Registry::default().with(Arc::new(FakeProvider::new(client.clone())));
    let settings = berth::wiring::manager::Settings {
        namespace: Some(NS.into()),
        instance: "berth-demo".into(),
        concurrency: 4,
        ..Default::default()
    };
    let mut controller =
        berth::wiring::manager::spawn(client.clone(), providers, settings, Arc::clone(&metrics));
    (&mut controller.ready)
        .await
        .context("the controller did not start")?;
    http.set_ready(true);
    clock.say(format!(
        "controller running (fake provider); metrics at http://{metrics_addr}/metrics"
    ));

    let result = scenario(&client, &clock, &args, &metrics).await;

    if args.keep && result.is_ok() {
        println!(
            "\nStill running: KUBECONFIG={} kubectl get machines,nodes,pods -A; metrics at http://{}/metrics. Ctrl-C ends the demo.",
            bed.kubeconfig_path().display(),
            metrics_addr
        );
        let _ = tokio::signal::ctrl_c().await;
    }
    controller.stop(Duration::from_secs(30)).await;
    let _ = http_stop_tx.send(());
    let _ = server.await;
    drop(bed);
    println!("cleaned up: control plane stopped and its directory removed");
    result
}

async fn scenario(
    client: &Client,
    clock: &Clock,
    args: &DemoArgs,
    metrics: &Metrics,
) -> anyhow::Result<()> {
    crate::testbed::create_or_keep(
        Api::<Namespace>::all(client.clone()),
        fixtures::namespace(NS),
    )
    .await?;
    crate::testbed::create_or_keep(
        Api::<MachineClass>::all(client.clone()),
        fixtures::pool_class(
            "demo",
            NS,
            serde_json::json!({"timeout": "10m", "volumeDetachTimeout": "1m", "volumeReattachTimeout": "1m"}),
        ),
    )
    .await?;
    let machines: Api<Machine> = Api::namespaced(client.clone(), NS);
    let a = machine(client, clock, "machine-a").await?;

    // Workloads, all on machine-a's Node (the only one so far).
    for (name, value) in [("demo-critical", 1000), ("demo-normal", 100)] {
        crate::testbed::create_or_keep(
            Api::<PriorityClass>::all(client.clone()),
            json(serde_json::json!({"metadata": {"name": name}, "value": value}))?,
        )
        .await?;
    }
    for i in 0..args.stateful {
        let pv = format!("demo-db-{i}");
        crate::testbed::create_or_keep(
            Api::all(client.clone()),
            fixtures::csi_pv(&pv, &format!("vol-{pv}"), NS, &format!("data-db-{i}")),
        )
        .await?;
    }
    let mut sts = fixtures::stateful_set("db", i32::try_from(args.stateful).unwrap_or(3), 2);
    if let Some(spec) = sts.spec.template.spec.as_mut() {
        spec.node_selector = Some([(fixtures::POOL_LABEL.to_string(), NS.to_string())].into());
        spec.priority_class_name = Some("demo-critical".into());
    }
    crate::testbed::create_or_keep(Api::namespaced(client.clone(), NS), sts).await?;
    crate::testbed::create_or_keep(
        Api::<Deployment>::namespaced(client.clone(), NS),
        json(serde_json::json!({
            "metadata": {"name": "web"},
            "spec": {
                "replicas": args.stateless,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "nodeSelector": {fixtures::POOL_LABEL: NS},
                        "priorityClassName": "demo-normal",
                        "terminationGracePeriodSeconds": 1,
                        "containers": [{"name": "web", "image": "registry.invalid/web:1"}]
                    }
                }
            }
        }))?,
    )
    .await?;
    crate::testbed::create_or_keep(
        Api::<PodDisruptionBudget>::namespaced(client.clone(), NS),
        json(serde_json::json!({
            "metadata": {"name": "web"},
            "spec": {"maxUnavailable": 2, "selector": {"matchLabels": {"app": "web"}}}
        }))?,
    )
    .await?;
    crate::testbed::create_or_keep(
        Api::<DaemonSet>::namespaced(client.clone(), NS),
        json(serde_json::json!({
            "metadata": {"name": "node-agent"},
            "spec": {
                "selector": {"matchLabels": {"app": "node-agent"}},
                "template": {
                    "metadata": {"labels": {"app": "node-agent"}},
                    "spec": {
                        "nodeSelector": {fixtures::POOL_LABEL: NS},
                        "containers": [{"name": "agent", "image": "registry.invalid/agent:1"}]
                    }
                }
            }
        }))?,
    )
    .await?;
    let want = args.stateful + args.stateless + 1;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    wait::until(pods.clone(), LONG, "workloads running", |ps| {
        ps.iter()
            .filter(|p| {
                p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(a.as_str())
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            })
            .count()
            >= want as usize
    })
    .await?;
    wait::until(
        Api::<k8s_openapi::api::storage::v1::VolumeAttachment>::all(client.clone()),
        LONG,
        "volumes attached",
        |vas| {
            vas.iter()
                .filter(|va| {
                    va.spec.node_name == a && va.status.as_ref().is_some_and(|s| s.attached)
                })
                .count()
                >= args.stateful as usize
        },
    )
    .await?;
    clock.say(format!(
        "on {a}: StatefulSet db ({} pods, a PersistentVolume each, attached), Deployment web ({} pods, PDB maxUnavailable=2), DaemonSet node-agent",
        args.stateful, args.stateless
    ));
    machine(client, clock, "machine-b").await?;
    machine(client, clock, "machine-c").await?;

    // The plan, then the deletion, followed live.
    let live = berth::cli::plan::plan_machine(client, NS, "machine-a").await?;
    println!("\n--- berth plan {NS}/machine-a ---\n{}---", live.plan);
    clock.say("deleting machine-a");
    let started = Instant::now();
    let (follow_stop, follow_stopped) = tokio::sync::oneshot::channel::<()>();
    let events = tokio::spawn(follow(client.clone(), clock.0, follow_stopped));
    machines
        .delete("machine-a", &DeleteParams::default())
        .await?;
    wait::for_none(
        machines.clone(),
        Duration::from_secs(600),
        "machine-a gone",
        |m| m.name_any() == "machine-a",
    )
    .await?;
    let took = started.elapsed();
    let _ = follow_stop.send(());
    let (log, warnings) = events.await.unwrap_or_default();
    summary(client, &log, &warnings, took, metrics).await;
    if args.rollout {
        rollout(client, clock, args.stateful).await?;
    }
    Ok(())
}

/// The state of a MachineDeployment as `kubectl get md` shows it.
fn md_line(d: &MachineDeployment) -> Option<String> {
    let s = d.status.as_ref()?;
    let progressing = s.conditions.iter().find(|c| c.type_ == "Progressing")?;
    Some(format!(
        "desired {} current {} updated {} ready {} available {} draining {}  {}: {}",
        d.spec.replicas,
        s.replicas,
        s.updated_replicas,
        s.ready_replicas,
        s.available_replicas,
        s.draining_replicas,
        progressing.reason,
        progressing.message
    ))
}

/// A MachineDeployment of three Machines takes the workloads, then rolls
/// to a new template, shown as an operator would follow it: the
/// deployment's columns, the old Machine chosen at each step and why, and
/// at the end how often each stateful pod moved.
async fn rollout(client: &Client, clock: &Clock, stateful: u32) -> anyhow::Result<()> {
    println!(
        "\n--- a rolling update: MachineDeployment pool, 3 Machines, maxSurge 1, maxUnavailable 0 ---"
    );
    let mds: Api<MachineDeployment> = Api::namespaced(client.clone(), NS);
    crate::testbed::create_or_keep(
        mds.clone(),
        fixtures::machine_deployment(
            "pool",
            "demo",
            3,
            "pool",
            fixtures::rolling(1.into(), 0.into()),
        ),
    )
    .await?;
    let d = wait::for_one(mds.clone(), LONG, "the pool ready", |d| rolled_out(d, None)).await?;
    let first = d.status.as_ref().and_then(|s| s.template_hash.clone());
    clock.say(format!("pool ready: {}", md_line(&d).unwrap_or_default()));
    // The workloads move onto the pool: the two single Machines go.
    let machines: Api<Machine> = Api::namespaced(client.clone(), NS);
    for m in ["machine-b", "machine-c"] {
        machines.delete(m, &DeleteParams::default()).await?;
    }
    clock.say("deleting machine-b and machine-c: their pods move onto the pool");
    wait::for_none(
        machines.clone(),
        Duration::from_secs(600),
        "machine-b and machine-c gone",
        |m| m.name_any() == "machine-b" || m.name_any() == "machine-c",
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let running = |p: &Pod| {
        p.name_any().starts_with("db-")
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    };
    wait::until(pods.clone(), LONG, "db pods running on the pool", |ps| {
        ps.iter().filter(|p| running(p)).count() >= stateful as usize
    })
    .await?;
    clock.say(format!(
        "the pool runs the StatefulSet db ({stateful} pods with volumes) and web"
    ));

    // Each db pod's incarnations from here on, by UID.
    let mut uids: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    for p in pods
        .list(&Default::default())
        .await?
        .items
        .iter()
        .filter(|p| running(p))
    {
        uids.entry(p.name_any()).or_default().extend(p.uid());
    }
    clock.say("changing the pool's template (annotation image: v2): the rollout starts");
    let started = Instant::now();
    let since = k8s_openapi::jiff::Timestamp::now();
    mds.patch(
        "pool",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(serde_json::json!({
            "spec": {"template": {"metadata": {"annotations": {"image": "v2"}}}}
        })),
    )
    .await?;
    let md_events = watcher(mds.clone(), watcher::Config::default())
        .applied_objects()
        .default_backoff();
    let pod_events = watcher(pods.clone(), watcher::Config::default())
        .applied_objects()
        .default_backoff();
    let evs = watcher(
        Api::<Event>::namespaced(client.clone(), NS),
        watcher::Config::default(),
    )
    .applied_objects()
    .default_backoff();
    let mut md_events = std::pin::pin!(md_events);
    let mut pod_events = std::pin::pin!(pod_events);
    let mut evs = std::pin::pin!(evs);
    let mut last = String::new();
    let mut seen = std::collections::BTreeSet::new();
    let deadline = tokio::time::sleep(Duration::from_secs(600));
    let mut deadline = std::pin::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => anyhow::bail!("the rollout did not complete within 10 minutes"),
            Some(Ok(d)) = md_events.next() => {
                if let Some(line) = md_line(&d) && line != last {
                    clock.say(format!("pool: {line}"));
                    last = line;
                }
                if rolled_out(&d, first.as_deref()) {
                    break;
                }
            }
            Some(Ok(p)) = pod_events.next() => {
                if p.name_any().starts_with("db-") {
                    uids.entry(p.name_any()).or_default().extend(p.uid());
                }
            }
            Some(Ok(e)) = evs.next() => {
                let reason = e.reason.clone().unwrap_or_default();
                // The pool's own making is not part of the rollout.
                let fresh = e.event_time.as_ref().is_none_or(|t| t.0 >= since);
                if fresh
                    && matches!(reason.as_str(), "ScaledOldMachineSet" | "RolloutStarted" | "RolloutComplete" | "NewMachineFailed")
                    && seen.insert(e.name_any())
                {
                    clock.say(format!("  {reason:<20} {}", e.note.clone().unwrap_or_default()));
                }
            }
        }
    }
    println!("\n--- rollout summary ---");
    println!(
        "3 Machines rolled in {:.1}s; each old Machine went only once a new one was Ready",
        started.elapsed().as_secs_f64()
    );
    for (pod, seen) in &uids {
        let moves = seen.len().saturating_sub(1);
        println!(
            "{pod}: moved {moves} time{}",
            if moves == 1 { "" } else { "s" }
        );
    }
    Ok(())
}

/// Prints the Machine's Events and drain progress as they come; returns
/// what it printed (reason, note) and the reasons of its Warnings.
async fn follow(
    client: Client,
    started: Instant,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> (Vec<(String, String)>, Vec<String>) {
    let evs = watcher(
        Api::<Event>::namespaced(client.clone(), NS),
        watcher::Config::default(),
    )
    .applied_objects()
    .default_backoff();
    let ms = watcher(
        Api::<Machine>::namespaced(client, NS),
        watcher::Config::default(),
    )
    .applied_objects()
    .default_backoff();
    let mut seen = std::collections::BTreeSet::new();
    let mut last_progress = String::new();
    let mut log = Vec::new();
    let mut warnings = Vec::new();
    let mut evs = std::pin::pin!(evs);
    let mut ms = std::pin::pin!(ms);
    // After `stop`, Events still on their way are shown for one more second.
    let mut until: Option<tokio::time::Instant> = None;
    loop {
        let grace = tokio::time::sleep_until(
            until.unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(3600)),
        );
        tokio::select! {
            _ = &mut stop, if until.is_none() => {
                until = Some(tokio::time::Instant::now() + Duration::from_secs(1));
            }
            _ = grace, if until.is_some() => return (log, warnings),
            Some(Ok(e)) = evs.next() => {
                if e.regarding.as_ref().and_then(|r| r.name.as_deref()) != Some("machine-a") {
                    continue;
                }
                let reason = e.reason.clone().unwrap_or_default();
                let note = e.note.clone().unwrap_or_default();
                if matches!(reason.as_str(), "CreateVm" | "WaitForNode" | "Running") || !seen.insert(e.name_any()) {
                    continue;
                }
                println!("[{:>6.1}s] {reason:<22} {note}", started.elapsed().as_secs_f64());
                if e.type_.as_deref() == Some("Warning") {
                    warnings.push(reason.clone());
                }
                log.push((reason, note));
            }
            Some(Ok(m)) = ms.next() => {
                if m.name_any() != "machine-a" { continue; }
                let Some(d) = m.status.as_ref().and_then(|s| s.drain.as_ref()) else { continue };
                let done = d.pods_total.saturating_sub(d.pods_remaining);
                let line = format!(
                    "{} {done}/{} pods{}",
                    bar(done, d.pods_total),
                    d.pods_total,
                    d.waiting_for.as_ref().map(|w| format!(", waiting for {w}")).unwrap_or_default()
                );
                if line != last_progress && d.pods_total > 0 {
                    println!("[{:>6.1}s]   {line}", started.elapsed().as_secs_f64());
                    last_progress = line;
                }
            }
            else => return (log, warnings),
        }
    }
}

/// Pods an `Evicted` Event's note names: one (`evicted pod ns/name`), or
/// the count of an Event for several (`evicted 6 pods without …`).
fn pods_in(note: &str) -> usize {
    if note.starts_with("evicted pod ") {
        return 1;
    }
    note.strip_prefix("evicted ")
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(1)
}

fn bar(done: u32, total: u32) -> String {
    let width = 20usize;
    let filled = if total == 0 {
        0
    } else {
        (done as usize * width) / total as usize
    };
    format!("[{}{}]", "#".repeat(filled), ".".repeat(width - filled))
}

/// The drain's summary: `log` holds every Event's (reason, note), and
/// `warnings` the reasons of those of type Warning.
async fn summary(
    client: &Client,
    log: &[(String, String)],
    warnings: &[String],
    took: Duration,
    metrics: &Metrics,
) {
    let count = |r: &str| log.iter().filter(|(reason, _)| reason == r).count();
    let evicted: usize = log
        .iter()
        .filter(|(reason, _)| reason == "Evicted")
        .map(|(_, note)| pods_in(note))
        .sum();
    let mut by_node: BTreeMap<String, usize> = BTreeMap::new();
    if let Ok(pods) = Api::<Pod>::namespaced(client.clone(), NS)
        .list(&Default::default())
        .await
    {
        for p in pods.items {
            if let Some(n) = p.spec.and_then(|s| s.node_name) {
                *by_node.entry(n).or_default() += 1;
            }
        }
    }
    println!("\n--- summary ---");
    println!(
        "machine-a drained and deleted in {:.1}s",
        took.as_secs_f64()
    );
    println!(
        "evictions: {}   volumes detached: {}   volumes re-attached elsewhere: {}   warnings: {}",
        evicted,
        count("VolumeDetached"),
        count("VolumeAttached"),
        warnings.len()
    );
    if !warnings.is_empty() {
        println!("warnings: {}", warnings.join(", "));
    }
    println!("pods now: {by_node:?}");
    let text = metrics.encode();
    for line in text.lines().filter(|l| {
        l.starts_with("berth_pod_evictions_total")
            || l.starts_with("berth_drain_duration_seconds_sum")
            || l.starts_with("berth_volume_detach_wait_seconds_count")
            || l.starts_with("berth_volume_reattach_wait_seconds_count")
    }) {
        println!("  {line}");
    }
}

async fn machine(client: &Client, clock: &Clock, name: &str) -> anyhow::Result<String> {
    let machines: Api<Machine> = Api::namespaced(client.clone(), NS);
    crate::testbed::create_or_keep(machines.clone(), fixtures::machine(name, "demo")).await?;
    wait::for_one(machines, LONG, "Machine Running", |m| {
        m.name_any() == name
            && m.status.as_ref().and_then(|s| s.phase) == Some(berth::api::MachinePhase::Running)
    })
    .await?;
    let node = FakeProvider::node_name(NS, name);
    clock.say(format!("{name} is Running (Node {node})"));
    Ok(node)
}

fn json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> anyhow::Result<T> {
    serde_json::from_value(v).context("building a demo object")
}

#[cfg(test)]
mod tests {
    use super::pods_in;
    use berth::drain::engine::evicted_note;

    #[test]
    fn the_summary_counts_every_pod_an_evicted_event_names() {
        assert_eq!(pods_in("evicted pod demo/db-0"), 1);
        let names: Vec<String> = (0..6).map(|i| format!("demo/web-{i}")).collect();
        assert_eq!(pods_in(&evicted_note(&names)), 6);
        let many: Vec<String> = (0..300).map(|i| format!("demo/web-{i:04}")).collect();
        assert_eq!(
            pods_in(&evicted_note(&many)),
            300,
            "names cut short, count kept"
        );
    }
}
