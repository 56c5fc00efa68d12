//! The rollout scenario: a MachineDeployment of N Machines, each carrying
//! its own StatefulSet of stateful pods (a CSI volume each) and its own
//! Deployment of pods without volumes, rolled to a new template with the
//! given `maxSurge` and `maxUnavailable`.
//!
//! Reported:
//!
//! - **wall time**, from the template change (the admin's patch, as the
//!   audit log received it) to the later of the last old Machine gone and
//!   the last new Machine Running with its Node Ready, both as a watch saw
//!   them ([`Timeline`]);
//! - its **floor** ([`floor_seconds`]): the same rollout played on the
//!   pacing rules alone, every step at its least duration and every
//!   decision taken at once;
//! - **stateful moves** against the ideal of one per stateful pod (a pod's
//!   incarnations by UID, less one), and **evictions** against one per pod
//!   of the old Machines (a pod without volumes whose replacement the
//!   scheduler put on another old Node is evicted twice; the old Nodes are
//!   only `PreferNoSchedule`-tainted);
//! - whether the rollout kept its **pace** (the [`Timeline`]'s check) and
//!   its peaks;
//! - the controller's **API requests per Machine** rolled, from the audit
//!   log (the fake provider, the stand-in for the cloud and the kubelet's
//!   registration, has a client of its own and is not counted).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde::Serialize;

use super::{BenchArgs, LONG, NS, audit, pool_class, read_audit, running_on};
use crate::testbed::timeline::{self, Pace, Seen, Timeline};
use crate::testbed::{fixtures, wait};
use berth::api::{MachineDeployment, TEMPLATE_HASH_LABEL};

/// The MachineDeployment, its pool (class and Node label) and the prefixes
/// of its workloads' names.
const MD: &str = "roll";
const POOL: &str = "bench-rollout";
const DB: &str = "rdb";
const WEB: &str = "rweb";
/// How long the rollout may take.
const ROLLOUT_TIMEOUT: Duration = Duration::from_secs(1800);

#[derive(Debug, Serialize, Default)]
pub struct Rollout {
    pub machines: u32,
    pub stateful_per_machine: u32,
    pub stateless_per_machine: u32,
    pub max_surge: u32,
    pub max_unavailable: u32,
    pub wall_seconds: Option<f64>,
    pub floor_seconds: Option<f64>,
    /// One old Machine's drain at its floor: its stateful pods one after
    /// the other, each grace period + detach + attach (at least one grace
    /// period, for the pods without volumes).
    pub drain_floor_seconds: f64,
    /// A new Machine's creation to Running with its Node Ready, as measured
    /// (p50 goes into the floor; the fake provider registers the Node at
    /// once and kwok makes it Ready).
    pub create_to_ready_p50_seconds: Option<f64>,
    pub create_to_ready_max_seconds: Option<f64>,
    /// Old Machines' drains at once, most seen, and Machines at once.
    pub peak_old_draining: usize,
    pub peak_machines: usize,
    /// The first step over the pace's limits, if any (`null`: kept).
    pub pace_broken: Option<String>,
    /// New incarnations of the stateful pods, and the ideal (one each).
    pub stateful_moves: u32,
    pub ideal_stateful_moves: u32,
    /// Stateful pods that moved more than once, or not at all.
    pub moved_more_than_once: Vec<String>,
    pub not_moved: Vec<String>,
    /// The controller's evictions granted, and the ideal (every pod of the
    /// old Machines once).
    pub evictions: u32,
    pub ideal_evictions: u32,
    /// Of them, pods that were not on the old Machines when the rollout
    /// began: replacements placed on an old Node and evicted again.
    pub evicted_again: u32,
    /// Those pods, each with the Node it had been placed on.
    pub evicted_again_on: Vec<String>,
    /// Evictions refused (a PodDisruptionBudget's 429, or another error).
    pub evictions_refused: u32,
    /// The controller's requests by `verb resource`, during the rollout.
    pub api_requests: BTreeMap<String, u32>,
    pub api_requests_per_machine: f64,
    pub reads: u32,
    pub note: Option<String>,
}

/// The least time a rollout of `machines` Machines can take under berth's
/// pacing (docs/pools.md), played as events: new Machines
/// are created while the VMs, those being deleted included, stay within
/// `machines + surge`, each Ready `create` seconds later; an old Machine
/// starts its drain, `drain` seconds, when no more than `max(unavailable,
/// 1)` are draining, at least `machines - unavailable` stay available after
/// it, and, with a surge, a ready new Machine is there for it; it is gone
/// when its drain ends. Both zero means one unavailable, as berth reads it.
///
/// For example, one at a time (`surge 1`, `unavailable 0`) is `machines ×
/// (create + drain)`: the next new Machine waits for the old VM to go; a
/// surge of every Machine is `create + machines × drain`.
pub fn floor_seconds(
    machines: usize,
    surge: usize,
    unavailable: usize,
    create: f64,
    drain: f64,
) -> f64 {
    let unavailable = if surge == 0 && unavailable == 0 {
        1
    } else {
        unavailable
    };
    let at_once = unavailable.max(1);
    let min_available = machines.saturating_sub(unavailable);
    let (mut old, mut ready) = (machines, 0usize);
    let (mut creating, mut draining) = (Vec::<f64>::new(), Vec::<f64>::new());
    let mut t = 0.0;
    loop {
        ready += creating.iter().filter(|&&r| r <= t).count();
        creating.retain(|&r| r > t);
        draining.retain(|&e| e > t);
        while ready + creating.len() < machines
            && old + draining.len() + ready + creating.len() < machines + surge
        {
            creating.push(t + create);
        }
        while old > 0
            && draining.len() < at_once
            && (surge == 0 || ready + old > machines)
            && ready + old > min_available
        {
            old -= 1;
            draining.push(t + drain);
        }
        if old == 0 && draining.is_empty() && creating.is_empty() {
            return t;
        }
        let next = creating
            .iter()
            .chain(&draining)
            .copied()
            .fold(f64::INFINITY, f64::min);
        if !next.is_finite() {
            // Nothing under way and nothing allowed: the rules hold the
            // rollout for ever (not so for any valid pace).
            return f64::INFINITY;
        }
        t = next;
    }
}

/// Runs the scenario on the bench's test bed, with the controller already
/// running as `user`.
pub(super) async fn run(
    admin: &Client,
    args: &BenchArgs,
    audit_log: &std::path::Path,
    user: &str,
) -> anyhow::Result<Rollout> {
    anyhow::ensure!(
        args.max_surge + args.max_unavailable > 0,
        "--max-surge and --max-unavailable cannot both be 0"
    );
    let (n, per_db, per_web) = (
        args.rollout_machines,
        args.rollout_stateful,
        args.rollout_stateless,
    );
    let mut out = Rollout {
        machines: n,
        stateful_per_machine: per_db,
        stateless_per_machine: per_web,
        max_surge: args.max_surge,
        max_unavailable: args.max_unavailable,
        drain_floor_seconds: f64::from(args.grace).max(
            f64::from(per_db)
                * (f64::from(args.grace)
                    + args.detach_delay.as_secs_f64()
                    + args.attach_delay.as_secs_f64()),
        ),
        ideal_stateful_moves: n * per_db,
        ideal_evictions: n * (per_db + per_web),
        ..Default::default()
    };
    pool_class(admin, POOL).await?;
    let mds: Api<MachineDeployment> = Api::namespaced(admin.clone(), NS);
    crate::testbed::create_or_keep(
        mds.clone(),
        fixtures::machine_deployment(
            MD,
            POOL,
            i32::try_from(n)?,
            "rollout",
            fixtures::rolling(args.max_surge.into(), args.max_unavailable.into()),
        ),
    )
    .await?;
    let d = wait::for_one(mds.clone(), LONG, "the pool rolled out", |d| {
        timeline::rolled_out(d, None)
    })
    .await?;
    let old_hash = d
        .status
        .as_ref()
        .and_then(|s| s.template_hash.clone())
        .context("the pool's status names its template")?;
    let old_nodes = place_workloads(admin, args, &old_hash).await?;
    eprintln!(
        "rollout: {n} Machines carry {} stateful and {} other pods; waiting for the test bed to settle",
        n * per_db,
        n * per_web
    );
    super::scale::settle(admin).await?;
    let first_pods: std::collections::BTreeSet<String> = Api::<Pod>::namespaced(admin.clone(), NS)
        .list(&Default::default())
        .await?
        .items
        .iter()
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_some_and(|n| old_nodes.contains(n))
        })
        .map(|p| p.name_any())
        .collect();

    let recorded = Timeline::start(admin, NS).await?;
    let begun = recorded.elapsed();
    mds.patch(
        MD,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({
            "spec": {"template": {"metadata": {"annotations": {"bench.berth.dev/revision": "2"}}}}
        })),
    )
    .await?;
    let d = wait::for_one(mds, ROLLOUT_TIMEOUT, "the rollout complete", |d| {
        timeline::rolled_out(d, Some(&old_hash))
    })
    .await?;
    let machines = Api::<berth::api::Machine>::namespaced(admin.clone(), NS);
    wait::for_none(machines, LONG, "the old Machines gone", |m| {
        m.labels().get(TEMPLATE_HASH_LABEL) == Some(&old_hash)
    })
    .await?;
    let ended = Timestamp::now();
    let new_hash = d
        .status
        .as_ref()
        .and_then(|s| s.template_hash.clone())
        .context("the rolled pool's status names its template")?;

    // Times and pace, from the watches.
    let steps = recorded.steps();
    let ours = |s: &&timeline::Step| s.at >= begun && (s.hash == old_hash || s.hash == new_hash);
    let end = steps
        .iter()
        .filter(ours)
        .filter(|s| {
            (s.hash == old_hash && s.seen == Seen::Gone)
                || (s.hash == new_hash && s.seen == Seen::Running)
        })
        .map(|s| s.at)
        .max();
    out.wall_seconds = end.map(|e| e.saturating_sub(begun).as_secs_f64());
    let creations = create_to_ready(&steps, &new_hash);
    out.create_to_ready_p50_seconds = audit::percentile(&creations, 50.0);
    out.create_to_ready_max_seconds = creations.iter().copied().reduce(f64::max);
    out.floor_seconds = out.create_to_ready_p50_seconds.map(|c| {
        floor_seconds(
            n as usize,
            args.max_surge as usize,
            args.max_unavailable as usize,
            c,
            out.drain_floor_seconds,
        )
    });
    let pace = Pace {
        replicas: n as usize,
        surge: args.max_surge as usize,
        drains_at_once: args.max_unavailable.max(1) as usize,
    };
    match recorded.paced(&new_hash, pace) {
        Ok(peak) => {
            out.peak_machines = peak.machines;
            out.peak_old_draining = peak.old_draining;
        }
        Err(e) => out.pace_broken = Some(e.lines().next().unwrap_or_default().to_string()),
    }

    // Moves of the stateful pods, by incarnation.
    let lives = recorded.incarnations();
    for i in 0..n {
        for j in 0..per_db {
            let pod = format!("{DB}-{i}-{j}");
            let moves = lives.get(&pod).map_or(0, |l| l.len().saturating_sub(1));
            out.stateful_moves += moves as u32;
            match moves {
                0 => out.not_moved.push(pod),
                1 => {}
                _ => out.moved_more_than_once.push(pod),
            }
        }
    }
    let moved_off_old = lives
        .iter()
        .filter(|(name, _)| name.starts_with(&format!("{DB}-")))
        .all(|(_, l)| l.last().is_none_or(|(_, node)| !old_nodes.contains(node)));
    if !moved_off_old {
        out.note = Some("a stateful pod was left on an old Node".into());
    }

    // The controller's requests, from the audit log.
    let log = read_audit(audit_log)?;
    let start = log
        .iter()
        .filter(|r| r.verb == "patch" && r.resource == "machinedeployments")
        .filter(|r| r.name.as_deref() == Some(MD) && r.user != user)
        .map(|r| r.received)
        .max()
        .context("the template's patch is in the audit log")?;
    out.api_requests = audit::cost(&log, user, start, ended);
    let evictions = || {
        log.iter().filter(|r| {
            r.user == user
                && r.verb == "create"
                && r.resource == "pods"
                && r.subresource.as_deref() == Some("eviction")
                && r.received >= start
                && r.received <= ended
        })
    };
    let granted: Vec<&str> = evictions()
        .filter(|r| (200..300).contains(&r.code))
        .filter_map(|r| r.name.as_deref())
        .collect();
    out.evictions = granted.len() as u32;
    let again: Vec<&&str> = granted
        .iter()
        .filter(|name| !first_pods.contains(**name))
        .collect();
    out.evicted_again = again.len() as u32;
    // Where each had been placed.
    out.evicted_again_on = again
        .iter()
        .map(|name| {
            let node = lives
                .get(**name)
                .and_then(|l| l.first())
                .map_or("?", |(_, node)| node.as_str());
            format!("{name} on {node}")
        })
        .collect();
    out.evictions_refused = evictions().count() as u32 - out.evictions;
    out.api_requests_per_machine =
        f64::from(out.api_requests.values().sum::<u32>()) / f64::from(n.max(1));
    out.reads = log
        .iter()
        .filter(|r| r.user == user && r.is_read() && r.received >= start && r.received <= ended)
        .count() as u32;
    Ok(out)
}

/// Each new Machine's creation to Running with its Node Ready, seconds.
fn create_to_ready(steps: &[timeline::Step], hash: &str) -> Vec<f64> {
    let mut created = BTreeMap::new();
    let mut out = Vec::new();
    for s in steps.iter().filter(|s| s.hash == hash) {
        match s.seen {
            Seen::Created => {
                created.insert(s.machine.as_str(), s.at);
            }
            Seen::Running => {
                if let Some(c) = created.get(s.machine.as_str()) {
                    out.push(s.at.saturating_sub(*c).as_secs_f64());
                }
            }
            Seen::Deleting | Seen::Gone => {}
        }
    }
    out
}

/// Puts Machine i's own workloads on it: the StatefulSet `rdb-i` and the
/// Deployment `rweb-i`, kept to the pool but free to go to any of its
/// Nodes later. Each is placed by cordoning every other Node of the pool
/// while it starts. Returns the pool's Nodes.
async fn place_workloads(
    admin: &Client,
    args: &BenchArgs,
    hash: &str,
) -> anyhow::Result<std::collections::BTreeSet<String>> {
    let machines = Api::<berth::api::Machine>::namespaced(admin.clone(), NS);
    let mut nodes: Vec<String> = machines
        .list(&Default::default())
        .await?
        .items
        .iter()
        .filter(|m| m.labels().get(TEMPLATE_HASH_LABEL).map(String::as_str) == Some(hash))
        .filter_map(|m| m.status.as_ref()?.node_ref.as_ref().map(|r| r.name.clone()))
        .collect();
    nodes.sort();
    anyhow::ensure!(
        nodes.len() == args.rollout_machines as usize,
        "the pool has {} Nodes, not {}",
        nodes.len(),
        args.rollout_machines
    );
    let node_api: Api<Node> = Api::all(admin.clone());
    let cordon = |name: String, on: bool| {
        let api = node_api.clone();
        async move {
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"unschedulable": on}})),
            )
            .await
        }
    };
    for node in &nodes {
        cordon(node.clone(), true).await?;
    }
    for (i, node) in nodes.iter().enumerate() {
        cordon(node.clone(), false).await?;
        let (db, web) = (format!("{DB}-{i}"), format!("{WEB}-{i}"));
        for j in 0..args.rollout_stateful {
            let pv = format!("{POOL}-{db}-{j}");
            crate::testbed::create_or_keep(
                Api::all(admin.clone()),
                fixtures::csi_pv(&pv, &format!("vol-{pv}"), NS, &format!("data-{db}-{j}")),
            )
            .await?;
        }
        crate::testbed::create_or_keep(
            Api::namespaced(admin.clone(), NS),
            fixtures::stateful_set_in_pool(
                &db,
                i32::try_from(args.rollout_stateful)?,
                i64::from(args.grace),
                POOL,
                None,
            ),
        )
        .await?;
        crate::testbed::create_or_keep(
            Api::namespaced(admin.clone(), NS),
            fixtures::deployment(
                &web,
                i32::try_from(args.rollout_stateless)?,
                i64::from(args.grace),
                POOL,
            ),
        )
        .await?;
        running_on(admin, node, &format!("{db}-"), args.rollout_stateful).await?;
        running_on(admin, node, &format!("{web}-"), args.rollout_stateless).await?;
        cordon(node.clone(), true).await?;
    }
    for node in &nodes {
        cordon(node.clone(), false).await?;
    }
    let want = (args.rollout_machines * args.rollout_stateful) as usize;
    let pool: std::collections::BTreeSet<String> = nodes.into_iter().collect();
    wait::until(
        Api::<VolumeAttachment>::all(admin.clone()),
        LONG,
        "the pool's volumes attached",
        |vas| {
            vas.iter()
                .filter(|va| {
                    pool.contains(&va.spec.node_name)
                        && va.status.as_ref().is_some_and(|s| s.attached)
                })
                .count()
                >= want
        },
    )
    .await?;
    // Every pod Running where it was put (none pending elsewhere).
    let pods = Api::<Pod>::namespaced(admin.clone(), NS)
        .list(&Default::default())
        .await?;
    let stray = pods
        .items
        .iter()
        .filter(|p| p.name_any().starts_with(&format!("{DB}-")))
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_none_or(|n| !pool.contains(n))
        })
        .count();
    anyhow::ensure!(stray == 0, "{stray} stateful pods are off the pool");
    Ok(pool)
}

/// The scenario's lines of the table.
pub fn table(r: &Rollout) -> String {
    let s = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1}"));
    let mut out = format!(
        "rollout: {} Machines ({} stateful + {} other pods each), maxSurge {} maxUnavailable {}\n",
        r.machines, r.stateful_per_machine, r.stateless_per_machine, r.max_surge, r.max_unavailable
    );
    out.push_str(&format!(
        "  wall {} s, floor {} s (drain {:.1} s per Machine, create→Ready p50 {} s, max {} s)\n",
        s(r.wall_seconds),
        s(r.floor_seconds),
        r.drain_floor_seconds,
        s(r.create_to_ready_p50_seconds),
        s(r.create_to_ready_max_seconds),
    ));
    out.push_str(&format!(
        "  stateful moves {} (ideal {}), evictions {} (ideal {}; {} of pods placed on an old Node, {} refused), pace {} (peak {} Machines, {} old draining)\n",
        r.stateful_moves,
        r.ideal_stateful_moves,
        r.evictions,
        r.ideal_evictions,
        r.evicted_again,
        r.evictions_refused,
        r.pace_broken.as_deref().unwrap_or("kept"),
        r.peak_machines,
        r.peak_old_draining,
    ));
    out.push_str(&format!(
        "  controller requests {:.1} per Machine, {} reads\n",
        r.api_requests_per_machine, r.reads
    ));
    for (what, pods) in [
        ("moved more than once", &r.moved_more_than_once),
        ("not moved", &r.not_moved),
    ] {
        if !pods.is_empty() {
            out.push_str(&format!("  {what}: {}\n", pods.join(", ")));
        }
    }
    if let Some(n) = &r.note {
        out.push_str(&format!("  note: {n}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::floor_seconds;

    #[test]
    fn one_at_a_time_waits_for_each_old_vm_to_go_before_the_next_new_one() {
        // surge 1: the new Machine, then the old one's drain, then the next.
        assert_eq!(floor_seconds(10, 1, 0, 1.0, 6.0), 70.0);
        // unavailable 1, no surge: the old one's drain first, then its
        // replacement, which must be ready before the next old one goes.
        assert_eq!(floor_seconds(10, 0, 1, 1.0, 6.0), 70.0);
        // Both zero reads as one unavailable.
        assert_eq!(floor_seconds(10, 0, 0, 1.0, 6.0), 70.0);
    }

    #[test]
    fn a_large_surge_creates_ahead_and_leaves_the_drains_one_at_a_time() {
        assert_eq!(floor_seconds(10, 10, 0, 1.0, 6.0), 61.0);
        // Surge 2: the third new Machine is created while the first old
        // one drains, so after the first, creation is off the path.
        assert_eq!(floor_seconds(4, 2, 0, 1.0, 6.0), 25.0);
    }

    #[test]
    fn unavailable_drains_that_many_at_once() {
        // Two waves of two, each a creation then two drains side by side.
        assert_eq!(floor_seconds(4, 2, 2, 1.0, 6.0), 14.0);
        // With a surge of 1 only one new Machine is ready for a wave, so
        // the landing rule drains one at a time though two may.
        assert_eq!(floor_seconds(4, 1, 2, 1.0, 6.0), 28.0);
        // Without surge, two old ones drain, then two new ones come up.
        assert_eq!(floor_seconds(4, 0, 2, 1.0, 6.0), 14.0);
    }

    #[test]
    fn nothing_to_roll_takes_no_time() {
        assert_eq!(floor_seconds(0, 1, 0, 1.0, 6.0), 0.0);
    }
}
