//! The move ledger's scenarios: at most one pod of a workload moves its
//! volumes at a time across every drain, and independent workloads move
//! side by side.
//!
//! - **independent**: `--independent-workloads` single-replica
//!   StatefulSets, each with its own CSI volume, on one Machine whose class
//!   allows as many volume moves at once (`maxParallelVolumeMigrations`).
//!   The Machine is deleted; a second one receives the pods. Floor: one
//!   move (grace period plus detach delay plus attach delay), as every
//!   workload may move at once.
//! - **shared**: `--shared-workloads` StatefulSets of `--shared-machines`
//!   replicas each, one replica of each on every one of
//!   `--shared-machines` Machines (required pod anti-affinity on
//!   `kubernetes.io/hostname`, in a pool of exactly those Nodes), default
//!   drain settings (one volume move at a time per drain). As many new
//!   Machines are created, then every old one is deleted at once. Floor:
//!   the longest chain of moves one after the other, a workload's replicas
//!   (one per Machine) or a drain's pods (one per workload), each one move.
//!
//! Both report the wall time from the (first) Machine deletion to the last
//! volume attached on the new Nodes, the controller's gaps and API cost as
//! the stateful scenario does, and the moves at once ([`moves`],
//! [`most_at_once`]): a replica's move runs from the controller's accepted
//! eviction of its pod (`create pods/eviction` answered 2xx, or a 2xx
//! `delete pods` when it forces one) until its PV is attached on a Node, the
//! attacher's first status write of a VolumeAttachment of that PV made
//! after the eviction, both as the API server received them.

use std::collections::BTreeSet;
use std::sync::Mutex;

use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::StatefulSet;
use kube::runtime::{WatchStreamExt as _, watcher};

use super::*;

const INDEPENDENT_POOL: &str = "bench-independent";
const SHARED_POOL: &str = "bench-shared";
/// How long the deleted Machines may take to go.
const GONE_TIMEOUT: Duration = Duration::from_secs(1800);

/// One replica of a workload: its pod and its PV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replica {
    pub workload: String,
    pub pod: String,
    pub pv: String,
}

impl Replica {
    /// Replica `i` of StatefulSet `workload` in `pool`, its pod and PV
    /// named as `stateful_on` names them.
    pub fn of(pool: &str, workload: &str, i: u32) -> Self {
        Self {
            workload: workload.into(),
            pod: format!("{workload}-{i}"),
            pv: format!("{pool}-{workload}-{i}"),
        }
    }
}

/// One replica's move, as the audit log tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    pub workload: String,
    pub pod: String,
    /// The accepted eviction (or forced deletion), as received.
    pub start: Timestamp,
    /// The attacher's write that attached the PV, as received; `None`: not
    /// seen (the move lasts to the end).
    pub end: Option<Timestamp>,
}

/// A run whose scenario failed, with the failure as its note.
pub(super) fn or_failed(scenario: &str, pods: u32, run: anyhow::Result<Run>) -> Run {
    run.unwrap_or_else(|e| Run {
        scenario: scenario.into(),
        drainer: compare::BERTH.into(),
        pods,
        note: Some(format!("failed: {e:#}")),
        ..Default::default()
    })
}

/// One volume move at its least: grace period, detach, attach.
fn one_move(args: &BenchArgs) -> f64 {
    f64::from(args.grace) + args.detach_delay.as_secs_f64() + args.attach_delay.as_secs_f64()
}

/// The independent scenario, with the controller already running as
/// `user`.
pub(super) async fn independent(
    admin: &Client,
    args: &BenchArgs,
    audit_log: &std::path::Path,
    user: &str,
) -> anyhow::Result<Run> {
    let n = args.independent_workloads;
    anyhow::ensure!(n > 0, "--independent-workloads must be at least 1");
    pool_class_with(
        admin,
        INDEPENDENT_POOL,
        serde_json::json!({"timeout": "30m", "maxParallelVolumeMigrations": n}),
    )
    .await?;
    let a = machine(admin, "independent-a", INDEPENDENT_POOL).await?;
    let workloads: Vec<String> = (0..n).map(|i| format!("ind-{i}")).collect();
    stateful_sets(admin, &workloads, 1, args.grace, INDEPENDENT_POOL, false).await?;
    running_on(admin, &a, "ind-", n).await?;
    let old_nodes = BTreeSet::from([a.clone()]);
    super::workloads::attached_on(admin, &old_nodes, n).await?;
    let b = machine(admin, "independent-b", INDEPENDENT_POOL).await?;
    let drained = drain_at_once(admin, &old_nodes, &["independent-a"], &[b]).await?;
    let replicas: Vec<Replica> = workloads
        .iter()
        .map(|w| Replica::of(INDEPENDENT_POOL, w, 0))
        .collect();
    let mut run = Run {
        scenario: "independent".into(),
        drainer: compare::BERTH.into(),
        pods: n,
        floor_seconds: one_move(args),
        ..Default::default()
    };
    measure_into(&mut run, &read_audit(audit_log)?, user, &replicas, &drained)?;
    Ok(run)
}

/// The shared scenario, with the controller already running as `user`.
pub(super) async fn shared(
    admin: &Client,
    args: &BenchArgs,
    audit_log: &std::path::Path,
    user: &str,
) -> anyhow::Result<Run> {
    let (m, w) = (args.shared_machines, args.shared_workloads);
    anyhow::ensure!(
        m > 0 && w > 0,
        "--shared-machines and --shared-workloads must be at least 1"
    );
    pool_class(admin, SHARED_POOL).await?;
    let old: Vec<String> = (0..m).map(|i| format!("shared-{i}")).collect();
    let old_nodes: BTreeSet<String> = machines(admin, &old, SHARED_POOL).await?;
    let workloads: Vec<String> = (0..w).map(|i| format!("sh-{i}")).collect();
    stateful_sets(admin, &workloads, m, args.grace, SHARED_POOL, true).await?;
    one_of_each_per_node(admin, &old_nodes, &workloads).await?;
    super::workloads::attached_on(admin, &old_nodes, m * w).await?;
    let new: Vec<String> = (0..m).map(|i| format!("shared-new-{i}")).collect();
    let new_nodes = machines(admin, &new, SHARED_POOL).await?;
    let old_refs: Vec<&str> = old.iter().map(String::as_str).collect();
    let new_nodes: Vec<String> = new_nodes.into_iter().collect();
    let drained = drain_at_once(admin, &old_nodes, &old_refs, &new_nodes).await?;
    let replicas: Vec<Replica> = workloads
        .iter()
        .flat_map(|wl| (0..m).map(move |i| Replica::of(SHARED_POOL, wl, i)))
        .collect();
    let mut run = Run {
        scenario: "shared".into(),
        drainer: compare::BERTH.into(),
        pods: m * w,
        // A workload's replicas one after the other, and a drain's pods
        // one after the other (one volume move at a time per drain).
        floor_seconds: f64::from(m.max(w)) * one_move(args),
        ..Default::default()
    };
    measure_into(&mut run, &read_audit(audit_log)?, user, &replicas, &drained)?;
    if run.max_moving_per_workload.is_some_and(|n| n > 1) {
        let more = format!(
            "the move ledger let {} replicas of one workload move at once",
            run.max_moving_per_workload.unwrap_or_default()
        );
        run.note = Some(match run.note.take() {
            Some(n) => format!("{more}; {n}"),
            None => more,
        });
    }
    Ok(run)
}

/// Machines `names` of `class`, created together and Running; their Nodes.
async fn machines(
    admin: &Client,
    names: &[String],
    class: &str,
) -> anyhow::Result<BTreeSet<String>> {
    let nodes =
        futures::future::try_join_all(names.iter().map(|n| machine(admin, n, class))).await?;
    Ok(nodes.into_iter().collect())
}

/// StatefulSets `names` of `replicas` pods kept to `pool`, each pod with a
/// pre-bound CSI PV of its own (named as `stateful_on` names them); with
/// `spread`, no two pods of one StatefulSet on one Node.
async fn stateful_sets(
    admin: &Client,
    names: &[String],
    replicas: u32,
    grace: u32,
    pool: &str,
    spread: bool,
) -> anyhow::Result<()> {
    for name in names {
        super::workloads::volumes_for(admin, pool, name, replicas).await?;
        let mut sts = fixtures::stateful_set_in_pool(
            name,
            i32::try_from(replicas)?,
            i64::from(grace),
            pool,
            None,
        );
        if spread {
            spread_over_nodes(&mut sts, name)?;
        }
        crate::testbed::create_or_keep(Api::<StatefulSet>::namespaced(admin.clone(), NS), sts)
            .await?;
    }
    Ok(())
}

/// Required pod anti-affinity on `kubernetes.io/hostname` among the pods
/// of StatefulSet `name` (the fixtures label them `app: <name>`).
fn spread_over_nodes(sts: &mut StatefulSet, name: &str) -> anyhow::Result<()> {
    let affinity = serde_json::from_value(serde_json::json!({"podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {"app": name}},
            "topologyKey": "kubernetes.io/hostname"
        }]
    }}))?;
    let spec = sts
        .spec
        .template
        .spec
        .as_mut()
        .context("the StatefulSet has a pod template")?;
    spec.affinity = Some(affinity);
    Ok(())
}

/// Waits until every pod of `workloads` runs on `nodes`, one of each
/// workload on every Node, and checks that it is so.
async fn one_of_each_per_node(
    admin: &Client,
    nodes: &BTreeSet<String>,
    workloads: &[String],
) -> anyhow::Result<()> {
    let want = nodes.len() * workloads.len();
    let workload_of = |pod: &str| pod.rsplit_once('-').map(|(w, _)| w.to_string());
    let placed = |ps: &[Arc<Pod>]| -> BTreeMap<(String, String), usize> {
        let mut out = BTreeMap::new();
        for p in ps {
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
            let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            let Some(w) = workload_of(&p.name_any()).filter(|w| workloads.contains(w)) else {
                continue;
            };
            if let Some(node) = node.filter(|n| running && nodes.contains(n)) {
                *out.entry((node, w)).or_insert(0) += 1;
            }
        }
        out
    };
    let pods = wait::until(
        Api::<Pod>::namespaced(admin.clone(), NS),
        LONG,
        "one pod of each StatefulSet running on each Node",
        |ps| placed(ps).values().sum::<usize>() >= want,
    )
    .await?;
    let by_node = placed(&pods);
    anyhow::ensure!(
        by_node.len() == want && by_node.values().all(|&n| n == 1),
        "the pods are not one of each StatefulSet per Node: {by_node:?}"
    );
    Ok(())
}

/// What a drain left to measure: the VolumeAttachments (by PV) on the old
/// Nodes before it and on the new ones after it, every VolumeAttachment
/// seen meanwhile (its PV, by name), and the Machines it drained.
struct Drained {
    old: BTreeMap<String, String>,
    new: BTreeMap<String, String>,
    seen: BTreeMap<String, String>,
    machines: Vec<String>,
}

/// Deletes `machines` (on `old_nodes`) at once and waits until they are
/// gone and their `Drained` Events are out; the replacements land on
/// `new_nodes`.
async fn drain_at_once(
    admin: &Client,
    old_nodes: &BTreeSet<String>,
    machines: &[&str],
    new_nodes: &[String],
) -> anyhow::Result<Drained> {
    let mut old = BTreeMap::new();
    for node in old_nodes {
        old.extend(attachments_on(admin, node).await?);
    }
    let watch = AttachmentWatch::start(admin).await?;
    let api: Api<Machine> = Api::namespaced(admin.clone(), NS);
    let t = Instant::now();
    let delete = DeleteParams::default();
    futures::future::try_join_all(machines.iter().map(|name| api.delete(name, &delete))).await?;
    let names: BTreeSet<String> = machines.iter().map(|m| m.to_string()).collect();
    wait::for_none(api, GONE_TIMEOUT, "the drained Machines gone", |m| {
        names.contains(&m.name_any())
    })
    .await?;
    eprintln!(
        "berth drains of {}: {:.1}s",
        machines.join(", "),
        t.elapsed().as_secs_f64()
    );
    for m in machines {
        drained_event(admin, m).await?;
    }
    let mut new = BTreeMap::new();
    for node in new_nodes {
        new.extend(attachments_on(admin, node).await?);
    }
    Ok(Drained {
        old,
        new,
        seen: watch.seen(),
        machines: names.into_iter().collect(),
    })
}

/// Fills `run` from the audit log: its wall time from the first Machine
/// deletion to the last volume attached on the new Nodes, the controller's
/// gaps and API cost, and the moves at once.
fn measure_into(
    run: &mut Run,
    log: &[Request],
    user: &str,
    replicas: &[Replica],
    d: &Drained,
) -> anyhow::Result<()> {
    let start = d
        .machines
        .iter()
        .filter_map(|m| deleted_at(log, "machines", m))
        .min()
        .context("the deletes are in the audit log")?;
    let pods: Vec<String> = replicas.iter().map(|r| r.pod.clone()).collect();
    let pvs: Vec<String> = replicas.iter().map(|r| r.pv.clone()).collect();
    let s = steps(log, &pods, &pvs, &d.old, &d.new, start);
    let end = s.end().context("no reattach observed")?;
    run.wall_seconds = Some(secs(start, end));
    for (step, moments) in [
        ("pod_gone", &s.gone),
        ("detached", &s.detached),
        ("reattached", &s.attached),
    ] {
        run.gaps_ms
            .insert(step.into(), Gaps::of(&gaps(log, user, moments)));
    }
    let machines: Vec<&str> = d.machines.iter().map(String::as_str).collect();
    cost_into(run, log, user, start, end, &machines);

    // Every VolumeAttachment's PV: the watch's, and the listed ones in case
    // the watch had not caught up.
    let mut attachments = d.seen.clone();
    for (pv, va) in d.old.iter().chain(&d.new) {
        attachments.insert(va.clone(), pv.clone());
    }
    let all = moves(log, user, replicas, &attachments, start);
    run.max_moving_per_workload = Some(most_per_workload(&all));
    run.max_moving_at_once = Some(most_at_once(&all));
    let mut notes = Vec::new();
    if s.attached.len() < replicas.len() {
        notes.push(format!(
            "{} of {} volumes seen attached on the new Nodes",
            s.attached.len(),
            replicas.len()
        ));
    }
    let unfinished = all.iter().filter(|m| m.end.is_none()).count();
    if unfinished > 0 {
        notes.push(format!("{unfinished} moves without an attach seen"));
    }
    let moved: BTreeSet<&str> = all.iter().map(|m| m.pod.as_str()).collect();
    if moved.len() < replicas.len() || all.len() > replicas.len() {
        notes.push(format!(
            "{} moves of {} pods, {} pods to move",
            all.len(),
            moved.len(),
            replicas.len()
        ));
    }
    if !notes.is_empty() {
        run.note = Some(notes.join("; "));
    }
    Ok(())
}

/// Every VolumeAttachment seen from its start, by name: its PV. Watched
/// from before the drains, so that one created and deleted while they ran
/// (a replacement that moved twice) is known too.
struct AttachmentWatch {
    seen: Arc<Mutex<BTreeMap<String, String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl AttachmentWatch {
    /// Starts the watch and returns once it has its initial list.
    async fn start(admin: &Client) -> anyhow::Result<Self> {
        let seen = Arc::new(Mutex::new(BTreeMap::new()));
        let record = Arc::clone(&seen);
        let api: Api<VolumeAttachment> = Api::all(admin.clone());
        let (listed_tx, listed) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let stream = watcher(api, watcher::Config::default()).default_backoff();
            futures::pin_mut!(stream);
            let mut listed_tx = Some(listed_tx);
            while let Some(event) = stream.next().await {
                let va = match event {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = listed_tx.take() {
                            let _ = tx.send(());
                        }
                        continue;
                    }
                    Ok(
                        watcher::Event::Apply(va)
                        | watcher::Event::InitApply(va)
                        | watcher::Event::Delete(va),
                    ) => va,
                    Ok(watcher::Event::Init) | Err(_) => continue,
                };
                if let Some(pv) = va.spec.source.persistent_volume_name.clone() {
                    record
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(va.name_any(), pv);
                }
            }
        });
        listed
            .await
            .context("the VolumeAttachment watch ended before listing")?;
        Ok(Self { seen, task })
    }

    fn seen(&self) -> BTreeMap<String, String> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl Drop for AttachmentWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether `r` is `user`'s accepted eviction of `pod` in the bench
/// namespace, or its accepted deletion (a forced one).
fn moves_pod(r: &Request, user: &str, pod: &str) -> bool {
    let evicted = r.verb == "create" && r.subresource.as_deref() == Some("eviction");
    let deleted = r.verb == "delete" && r.subresource.is_none();
    r.user == user
        && r.resource == "pods"
        && r.namespace.as_deref() == Some(NS)
        && r.name.as_deref() == Some(pod)
        && (200..300).contains(&r.code)
        && (evicted || deleted)
}

/// Each replica's moves from `from` on, read from the audit log: from
/// `user`'s accepted eviction (or deletion) of its pod to the first
/// attach of its PV after it, the attacher's first status write of a
/// VolumeAttachment of that PV (`attachments`: PV by VolumeAttachment
/// name), both as received. A second accepted request for the pod before
/// that attach is the same move.
pub fn moves(
    log: &[Request],
    user: &str,
    replicas: &[Replica],
    attachments: &BTreeMap<String, String>,
    from: Timestamp,
) -> Vec<Move> {
    let mut attached: BTreeMap<&str, Vec<Timestamp>> = BTreeMap::new();
    for (va, pv) in attachments {
        if let Some(r) = first_write_by(log, "kwok", "volumeattachments", va, "status") {
            attached.entry(pv.as_str()).or_default().push(r.received);
        }
    }
    let mut out = Vec::new();
    for rep in replicas {
        let mut starts: Vec<Timestamp> = log
            .iter()
            .filter(|r| r.received >= from && moves_pod(r, user, &rep.pod))
            .map(|r| r.received)
            .collect();
        starts.sort();
        let ends = attached.get(rep.pv.as_str()).map_or(&[][..], Vec::as_slice);
        let mut last_end = None;
        for start in starts {
            let end = ends.iter().copied().filter(|e| *e > start).min();
            if last_end == Some(end) {
                continue;
            }
            last_end = Some(end);
            out.push(Move {
                workload: rep.workload.clone(),
                pod: rep.pod.clone(),
                start,
                end,
            });
        }
    }
    out
}

/// The most of `moves` under way at once. A move that ends at the moment
/// another starts does not overlap it; one without an end lasts for ever.
pub fn most_at_once<'a>(moves: impl IntoIterator<Item = &'a Move>) -> u32 {
    let mut edges: Vec<(Timestamp, i32)> = Vec::new();
    for m in moves {
        edges.push((m.start, 1));
        if let Some(end) = m.end {
            edges.push((end, -1));
        }
    }
    // At one moment, ends (-1) before starts (+1).
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in edges {
        now += step;
        most = most.max(now);
    }
    u32::try_from(most).unwrap_or(0)
}

/// The most moves of one workload under way at once, over every workload.
pub fn most_per_workload(moves: &[Move]) -> u32 {
    let mut by: BTreeMap<&str, Vec<&Move>> = BTreeMap::new();
    for m in moves {
        by.entry(m.workload.as_str()).or_default().push(m);
    }
    by.values()
        .map(|ms| most_at_once(ms.iter().copied()))
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: &str) -> Timestamp {
        format!("2026-01-01T00:00:{s}Z").parse().expect("ts")
    }

    fn request(user: &str, verb: &str, resource: &str, name: &str, at: &str) -> Request {
        Request {
            user: user.into(),
            user_agent: if user == "kwok" { "kwok/v0" } else { "berth" }.into(),
            verb: verb.into(),
            resource: resource.into(),
            subresource: None,
            namespace: Some(NS.into()),
            name: Some(name.into()),
            code: 201,
            received: ts(at),
            completed: ts(at),
            body: None,
        }
    }

    fn eviction(pod: &str, at: &str, code: u16) -> Request {
        Request {
            subresource: Some("eviction".into()),
            code,
            ..request("c", "create", "pods", pod, at)
        }
    }

    fn attach(va: &str, at: &str) -> Request {
        Request {
            subresource: Some("status".into()),
            namespace: None,
            ..request("kwok", "patch", "volumeattachments", va, at)
        }
    }

    fn mv(workload: &str, start: &str, end: Option<&str>) -> Move {
        Move {
            workload: workload.into(),
            pod: format!("{workload}-x"),
            start: ts(start),
            end: end.map(ts),
        }
    }

    #[test]
    fn a_move_runs_from_the_accepted_eviction_to_the_attach_after_it() {
        let log = [
            // Before the drain: the first attach, not a move's end.
            attach("va-old", "01"),
            eviction("db-0", "10", 429),
            eviction("db-0", "11", 201),
            // A second accepted request in the same move.
            eviction("db-0", "12", 200),
            attach("va-new", "15"),
            // A later status write of the same attachment is not the
            // attach.
            attach("va-new", "20"),
            Request {
                user: "other".into(),
                ..eviction("db-1", "16", 201)
            },
        ];
        let attachments = BTreeMap::from([
            ("va-old".to_string(), "pool-db-0".to_string()),
            ("va-new".to_string(), "pool-db-0".to_string()),
        ]);
        let replicas = [Replica::of("pool", "db", 0), Replica::of("pool", "db", 1)];
        let got = moves(&log, "c", &replicas, &attachments, ts("05"));
        assert_eq!(
            got,
            [Move {
                workload: "db".into(),
                pod: "db-0".into(),
                start: ts("11"),
                end: Some(ts("15")),
            }]
        );
    }

    #[test]
    fn a_forced_deletion_starts_a_move_too() {
        let log = [request("c", "delete", "pods", "db-0", "10")];
        let got = moves(
            &log,
            "c",
            &[Replica::of("pool", "db", 0)],
            &BTreeMap::new(),
            ts("00"),
        );
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].end, None, "no attach seen: {got:?}");
    }

    #[test]
    fn moves_one_after_the_other_do_not_overlap() {
        let chain = [
            mv("a", "10", Some("14")),
            mv("a", "14", Some("18")),
            mv("a", "18", Some("22")),
        ];
        assert_eq!(most_at_once(&chain), 1);
        assert_eq!(most_per_workload(&chain), 1);
    }

    #[test]
    fn overlapping_moves_of_one_workload_are_counted_apart_from_others() {
        let all = [
            mv("a", "10", Some("14")),
            mv("b", "10", Some("14")),
            mv("c", "11", Some("13")),
            mv("a", "13", Some("16")),
            // Never attached: lasts to the end.
            mv("b", "20", None),
            mv("b", "30", Some("31")),
        ];
        // a, b and c at 11; at 13 c ends as a's second move starts.
        assert_eq!(most_at_once(&all), 3);
        assert_eq!(most_per_workload(&all), 2);
        assert_eq!(most_per_workload(&[]), 0);
    }
}
