//! The surge scenario: a singleton Deployment (one replica, the default
//! strategy, pods without volumes) behind a PodDisruptionBudget of
//! `minAvailable: 1`, on a Machine that is deleted; its pool's class
//! drains within 60 s (`forceAfterDeadline` as the defaults have it: on).
//! A second Machine of the pool takes the replacement, which turns Ready
//! `--surge-start` (5 s) after it runs, as a real one would after its
//! image pull and readiness probe (kwok makes a pod Ready at once). No
//! eviction of that pod can ever be accepted: without a surge the drain
//! retries until its deadline, then deletes the pod bypassing its budget;
//! the ReplicaSet controller replaces it at once, and the service has no
//! pod Ready until the replacement is. With surge before evict the
//! Deployment's own controllers bring the new pod up first and remove the
//! old one.
//!
//! Measured from the cluster, not from berth's Events: a watch of the
//! Deployment's pods from before the deletion gives each moment the
//! service had no pod Ready and not terminating (goal: none); the audit
//! log gives the deletion, who removed the old pod and how, and the
//! controller's requests; a watch of the Machine gives the drain's end
//! (`status.drain.finishedAt`, as the stateless scenario's) and the
//! Machine gone.

use std::sync::Mutex;

use futures::StreamExt as _;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::watcher;

use super::*;
use crate::testbed::stages::READY_AFTER_ANNOTATION;

const POOL: &str = "bench-surge";
const NAME: &str = "solo";
const DRAINED: &str = "surge-a";
const SPARE: &str = "surge-b";
/// The drain timeout of the pool's class.
const TIMEOUT: Duration = Duration::from_secs(60);

/// What the scenario measured.
#[derive(Debug, Serialize, Default)]
pub struct Surge {
    /// The class's drain timeout (`forceAfterDeadline` on, the default).
    pub drain_timeout_seconds: f64,
    pub grace_seconds: f64,
    /// How long a pod takes to turn Ready once it runs.
    pub replacement_start_seconds: f64,
    /// How long, in all, the Deployment had no pod Ready and not
    /// terminating, from the Machine's deletion until a pod served again
    /// after it was gone (goal 0).
    pub zero_ready_seconds: Option<f64>,
    /// Each such stretch: seconds after the deletion, and how long.
    pub zero_ready_windows: Vec<Window>,
    /// From the deletion (as the API server received it) to the drain's
    /// end, `status.drain.finishedAt`.
    pub wall_seconds: Option<f64>,
    /// From the deletion to the Machine gone (its watch).
    pub gone_seconds: Option<f64>,
    /// The most pods of the Deployment not terminating at once.
    pub most_pods_not_terminating: usize,
    /// The Deployment's pods seen in all (UIDs).
    pub pods_seen: usize,
    /// Who removed the old pod, by the audit log: berth's eviction, berth's
    /// deletion (its budget bypassed) or its ReplicaSet controller.
    pub old_pod_removed_by: Option<String>,
    /// Evictions of the old pod the API server refused (429).
    pub refused_evictions: u32,
    /// berth's accepted writes to the Deployment (a roll is one).
    pub deployment_writes: u32,
    /// The pods' states as the watch saw them change: seconds after the
    /// deletion, then Ready and not terminating / not terminating /
    /// existing.
    pub timeline: Vec<String>,
    /// The controller's requests from the deletion to the Machine gone
    /// (and the Machine's Events published after), by verb and resource.
    pub api_requests: BTreeMap<String, u32>,
    pub api_requests_total: u32,
    pub reads_during_drain: u32,
    pub note: Option<String>,
}

/// A stretch of time without a pod serving.
#[derive(Debug, Serialize, Default, Clone, PartialEq)]
pub struct Window {
    /// Seconds after the Machine's deletion.
    pub from_seconds: f64,
    pub seconds: f64,
}

/// A run that failed, with the failure as its note.
pub(super) fn or_failed(r: anyhow::Result<Surge>) -> Surge {
    r.unwrap_or_else(|e| Surge {
        drain_timeout_seconds: TIMEOUT.as_secs_f64(),
        note: Some(format!("failed: {e:#}")),
        ..Default::default()
    })
}

/// One state of the Deployment's pods, as the watch saw it change.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    at: Timestamp,
    /// Ready and not terminating.
    serving: usize,
    /// Not terminating.
    live: usize,
    existing: usize,
}

#[derive(Default)]
struct Seen {
    listing: bool,
    pods: BTreeMap<String, Pod>,
    uids: std::collections::BTreeSet<String>,
    samples: Vec<Sample>,
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Ready and not being deleted: a pod that serves, and that the
/// disruption controller counts healthy.
fn serving(p: &Pod) -> bool {
    is_ready(p) && p.metadata.deletion_timestamp.is_none()
}

/// Watches the pods of the Deployment (label `app: <NAME>`), recording
/// each change of their counts once listed (never mid-list); returns once
/// the watch has listed.
async fn watch_pods(
    admin: &Client,
) -> anyhow::Result<(Arc<Mutex<Seen>>, tokio::task::JoinHandle<()>)> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (tx, listed) = tokio::sync::oneshot::channel::<()>();
    let api: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let config = watcher::Config::default().labels(&format!("app={NAME}"));
    let task = {
        let seen = Arc::clone(&seen);
        tokio::spawn(async move {
            let mut tx = Some(tx);
            let mut stream = watcher::watcher(api, config).boxed();
            while let Some(ev) = stream.next().await {
                let at = Timestamp::now();
                let mut s = seen.lock().expect("lock");
                match ev {
                    Ok(watcher::Event::Init) => {
                        s.listing = true;
                        s.pods.clear();
                    }
                    Ok(watcher::Event::InitApply(p) | watcher::Event::Apply(p)) => {
                        let uid = p.uid().unwrap_or_default();
                        s.uids.insert(uid.clone());
                        s.pods.insert(uid, p);
                    }
                    Ok(watcher::Event::Delete(p)) => {
                        s.pods.remove(&p.uid().unwrap_or_default());
                    }
                    Ok(watcher::Event::InitDone) => {
                        s.listing = false;
                        if let Some(tx) = tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Err(_) => {}
                }
                if !s.listing {
                    let sample = Sample {
                        at,
                        serving: s.pods.values().filter(|p| serving(p)).count(),
                        live: s
                            .pods
                            .values()
                            .filter(|p| p.metadata.deletion_timestamp.is_none())
                            .count(),
                        existing: s.pods.len(),
                    };
                    let changed = s.samples.last().is_none_or(|l| {
                        (l.serving, l.live, l.existing)
                            != (sample.serving, sample.live, sample.existing)
                    });
                    if changed {
                        s.samples.push(sample);
                    }
                }
            }
        })
    };
    tokio::time::timeout(LONG, listed)
        .await
        .context("the pods' watch did not list in time")?
        .context("the pods' watch ended before listing")?;
    Ok((seen, task))
}

/// The stretches in `[from, to]` with no pod serving, by `samples` (each a
/// state that holds until the next; the one before `from` holds at
/// `from`).
fn zero_windows(samples: &[Sample], from: Timestamp, to: Timestamp) -> Vec<Window> {
    let mut out = Vec::new();
    let mut down: Option<Timestamp> = samples
        .iter()
        .rfind(|s| s.at <= from)
        .filter(|s| s.serving == 0)
        .map(|_| from);
    for s in samples.iter().filter(|s| s.at > from && s.at <= to) {
        match (down, s.serving) {
            (None, 0) => down = Some(s.at),
            (Some(d), n) if n > 0 => {
                out.push(Window {
                    from_seconds: secs(from, d),
                    seconds: secs(d, s.at),
                });
                down = None;
            }
            _ => {}
        }
    }
    if let Some(d) = down {
        out.push(Window {
            from_seconds: secs(from, d),
            seconds: secs(d, to),
        });
    }
    out
}

/// Runs the scenario (see the module) with the controller `user` running.
pub(super) async fn run(
    admin: &Client,
    args: &BenchArgs,
    audit_log: &std::path::Path,
    user: &str,
) -> anyhow::Result<Surge> {
    pool_class_with(
        admin,
        POOL,
        serde_json::json!({"timeout": format!("{}s", TIMEOUT.as_secs())}),
    )
    .await?;
    // The Deployment's pod lands on the pool's only Node; the spare comes
    // after.
    let node = machine(admin, DRAINED, POOL).await?;
    let mut deployment = fixtures::deployment(NAME, 1, i64::from(args.grace), POOL);
    if !args.surge_start.is_zero() {
        deployment
            .spec
            .template
            .metadata
            .get_or_insert_default()
            .annotations
            .get_or_insert_default()
            .insert(
                READY_AFTER_ANNOTATION.into(),
                format!("{}ms", args.surge_start.as_millis()),
            );
    }
    crate::testbed::create_or_keep(Api::namespaced(admin.clone(), NS), deployment).await?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let prefix = format!("{NAME}-");
    let old = wait::for_one(pods.clone(), LONG, "the singleton Ready", |p| {
        p.name_any().starts_with(&prefix)
            && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node.as_str())
            && serving(p)
    })
    .await?
    .name_any();
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(admin.clone(), NS);
    crate::testbed::create_or_keep(
        pdbs.clone(),
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": NAME},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": NAME}}}
        }))?,
    )
    .await?;
    wait::for_one(pdbs, LONG, "the budget allows no disruption", |p| {
        p.name_any() == NAME
            && p.status.as_ref().is_some_and(|s| {
                s.current_healthy == Some(1)
                    && s.expected_pods == Some(1)
                    && s.disruptions_allowed == Some(0)
            })
    })
    .await?;
    machine(admin, SPARE, POOL).await?;

    let machines: Api<Machine> = Api::namespaced(admin.clone(), NS);
    let (listed_tx, listed) = tokio::sync::oneshot::channel();
    let ends = tokio::spawn(scale::watch_ends(
        machines.clone(),
        [DRAINED.to_string()].into(),
        listed_tx,
    ));
    listed
        .await
        .context("the Machine watch ended before listing")?;
    let (seen, watching) = watch_pods(admin).await?;
    let before = Timestamp::now();
    machines.delete(DRAINED, &DeleteParams::default()).await?;
    let ends = tokio::time::timeout(LONG, ends)
        .await
        .context("the Machine not gone in time")?
        .context("the Machine watch failed")??;
    // Until a pod serves again, so that every stretch without one is
    // closed.
    let deadline = Instant::now() + LONG;
    let back = loop {
        let up = seen
            .lock()
            .expect("lock")
            .samples
            .last()
            .is_some_and(|s| s.serving > 0);
        if up {
            break Timestamp::now();
        }
        if Instant::now() > deadline {
            watching.abort();
            anyhow::bail!(
                "no pod of {NAME} Ready {} s after the drain",
                LONG.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    watching.abort();
    // Its Events are published from a queue: wait for the one of its
    // drain's outcome (a drain that forced a pod out ends with
    // `DrainForced`, not `Drained`), so that they are in the audit log.
    let note = wait::for_one(
        Api::<Event>::namespaced(admin.clone(), NS),
        Duration::from_secs(60),
        &format!("the Event of {DRAINED}'s drain's outcome"),
        |e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(DRAINED)
                && matches!(
                    e.reason.as_deref(),
                    Some("Drained" | "DrainForced" | "DrainFailed")
                )
        },
    )
    .await
    .err()
    .map(|e| format!("{e:#}"));
    // The audit log is written as requests complete: let the last land.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let log = read_audit(audit_log)?;
    let deleted = deleted_at(&log, "machines", DRAINED)
        .context("the delete is in the audit log")?
        .max(before);
    let gone = *ends
        .gone
        .get(DRAINED)
        .context("the Machine's deletion not seen")?;
    let drained = ends.finished.get(DRAINED).copied();
    let (samples, pods_seen) = {
        let s = seen.lock().expect("lock");
        (s.samples.clone(), s.uids.len())
    };
    let windows = zero_windows(&samples, deleted, back);
    // Not `sum`: that of no stretch is -0.0.
    let zero = windows.iter().fold(0.0, |all, w| all + w.seconds);
    let mut api_requests = audit::cost(&log, user, deleted, gone);
    // The Machine's Events, published from a queue after it went.
    let prefix = format!("{DRAINED}.");
    for r in log
        .iter()
        .filter(|r| r.user == user && r.resource == "events" && r.is_write())
        .filter(|r| r.received > gone)
        .filter(|r| r.name.as_deref().is_some_and(|n| n.starts_with(&prefix)))
    {
        *api_requests.entry(r.kind()).or_default() += 1;
    }
    let about_old = |r: &&Request| {
        r.resource == "pods"
            && r.name.as_deref() == Some(old.as_str())
            && r.namespace.as_deref() == Some(NS)
            && r.received >= deleted
    };
    let refused_evictions = log
        .iter()
        .filter(about_old)
        .filter(|r| r.user == user && r.subresource.as_deref() == Some("eviction"))
        .filter(|r| r.code == 429)
        .count() as u32;
    let removal = log
        .iter()
        .filter(about_old)
        .filter(|r| (200..300).contains(&r.code))
        .filter(|r| {
            (r.verb == "delete" && r.subresource.is_none())
                || (r.verb == "create" && r.subresource.as_deref() == Some("eviction"))
        })
        .min_by_key(|r| r.received);
    let old_pod_removed_by = removal.map(|r| {
        let at = secs(deleted, r.received);
        if r.user == user && r.subresource.is_some() {
            format!("berth's eviction, {at:.1} s after the deletion")
        } else if r.user == user {
            format!("berth's deletion (its budget bypassed), {at:.1} s after the deletion")
        } else if r.user_agent.contains("replicaset-controller") {
            format!("its ReplicaSet controller, {at:.1} s after the deletion")
        } else {
            format!(
                "{} ({}), {at:.1} s after the deletion",
                r.user, r.user_agent
            )
        }
    });
    let deployment_writes = log
        .iter()
        .filter(|r| r.user == user && r.is_write() && r.resource == "deployments")
        .filter(|r| r.name.as_deref() == Some(NAME) && r.received >= deleted)
        .filter(|r| (200..300).contains(&r.code))
        .count() as u32;
    let timeline = samples
        .iter()
        .filter(|s| s.at <= back)
        .map(|s| {
            let t = if s.at < deleted {
                "before".to_string()
            } else {
                format!("{:.2} s", secs(deleted, s.at))
            };
            format!(
                "{t}: ready {}, not terminating {}, existing {}",
                s.serving, s.live, s.existing
            )
        })
        .collect();
    Ok(Surge {
        drain_timeout_seconds: TIMEOUT.as_secs_f64(),
        grace_seconds: f64::from(args.grace),
        replacement_start_seconds: args.surge_start.as_secs_f64(),
        zero_ready_seconds: Some(zero),
        zero_ready_windows: windows,
        wall_seconds: drained.map(|d| secs(deleted, d)),
        gone_seconds: Some(secs(deleted, gone)),
        most_pods_not_terminating: samples.iter().map(|s| s.live).max().unwrap_or(0),
        pods_seen,
        old_pod_removed_by,
        refused_evictions,
        deployment_writes,
        timeline,
        api_requests_total: api_requests.values().sum(),
        reads_during_drain: log
            .iter()
            .filter(|r| {
                r.user == user && r.is_read() && r.received >= deleted && r.received <= gone
            })
            .count() as u32,
        api_requests,
        note,
    })
}

/// The scenario's lines of the report table.
pub(super) fn lines(s: &Surge) -> String {
    if s.zero_ready_seconds.is_none() {
        return format!("surge: {}\n", s.note.as_deref().unwrap_or("no result"));
    }
    let opt = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1}"));
    let mut out = format!(
        "surge: no pod Ready for {} s (goal 0 s) in {} stretch(es); drain {} s, Machine gone {} s (drain timeout {:.0} s, grace {:.0} s, replacement's start {:.1} s); {} requests\n",
        opt(s.zero_ready_seconds),
        s.zero_ready_windows.len(),
        opt(s.wall_seconds),
        opt(s.gone_seconds),
        s.drain_timeout_seconds,
        s.grace_seconds,
        s.replacement_start_seconds,
        s.api_requests_total,
    );
    out.push_str(&format!(
        "    old pod removed by {}; {} refused eviction(s); {} Deployment write(s); at most {} pods not terminating, {} in all\n",
        s.old_pod_removed_by.as_deref().unwrap_or("-"),
        s.refused_evictions,
        s.deployment_writes,
        s.most_pods_not_terminating,
        s.pods_seen,
    ));
    let requests: Vec<String> = s
        .api_requests
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    out.push_str(&format!("    requests: {}\n", requests.join(", ")));
    if let Some(n) = &s.note {
        out.push_str(&format!("    note: {n}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: f64) -> Timestamp {
        Timestamp::UNIX_EPOCH + Duration::from_secs_f64(s)
    }

    fn sample(t: f64, serving: usize) -> Sample {
        Sample {
            at: at(t),
            serving,
            live: serving,
            existing: serving,
        }
    }

    #[test]
    fn the_stretches_without_a_pod_serving_are_cut_to_the_window() {
        let samples = [
            sample(0.0, 1),
            sample(5.0, 0),
            sample(6.5, 1),
            sample(8.0, 2),
            sample(9.0, 0),
        ];
        let w = zero_windows(&samples, at(1.0), at(10.0));
        assert_eq!(
            w,
            [
                Window {
                    from_seconds: 4.0,
                    seconds: 1.5
                },
                Window {
                    from_seconds: 8.0,
                    seconds: 1.0
                }
            ]
        );
        // Down already when the window opens.
        let w = zero_windows(&samples, at(5.5), at(7.0));
        assert_eq!(
            w,
            [Window {
                from_seconds: 0.0,
                seconds: 1.0
            }]
        );
        // Serving throughout.
        assert!(zero_windows(&[sample(0.0, 1), sample(2.0, 2)], at(1.0), at(3.0)).is_empty());
    }
}
