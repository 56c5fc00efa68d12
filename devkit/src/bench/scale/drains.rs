//! The drains: every drained Machine deleted at once, each drain's end
//! watched, and its steps timed from the audit log.

use super::*;

/// Deletes every drained Machine at once and fills in each drain's wall
/// time (to its `status.drain.finishedAt`) and time until the Machine is
/// gone.
pub(super) async fn drain_all(
    admin: &Client,
    drains: &mut [ScaleDrain],
) -> anyhow::Result<Vec<Route>> {
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
                let wall = crate::bench::secs(start, *t);
                d.wall_seconds = Some(wall);
                d.over_floor_seconds = Some(wall - d.floor_seconds);
            }
            d.outcome = Some(reason);
        }
        d.gone_seconds = gone
            .gone
            .get(&d.machine)
            .map(|t| crate::bench::secs(start, *t));
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
pub(super) async fn routes_before(
    admin: &Client,
    drains: &[ScaleDrain],
) -> anyhow::Result<Vec<Route>> {
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
pub(super) struct RouteTimes {
    pub(super) first_eviction: Option<f64>,
    pub(super) cluster: Option<f64>,
}

/// The step durations of every route (see [`Scale::steps_seconds`]), and
/// each route's [`RouteTimes`] by Machine.
pub(super) fn step_times(
    log: &[crate::bench::audit::Request],
    user: &str,
    routes: &[Route],
) -> (
    BTreeMap<String, crate::bench::Gaps>,
    BTreeMap<String, RouteTimes>,
) {
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
        let gone = |pod: &str| crate::bench::pod_gone(log, pod, start).map(|q| q.completed);
        let mut stateless = Vec::new();
        for pod in &r.pods {
            if let (Some(e), Some(g)) = (evicted(pod), gone(pod)) {
                let took = crate::bench::secs(e, g);
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
                .and_then(|va| crate::bench::last_write_by(log, "kwok", "volumeattachments", va))
                .map(|q| q.completed);
            let attached_by = r.new.get(*pv).and_then(|va| {
                crate::bench::first_write_by(log, "kwok", "volumeattachments", va, "status")
            });
            let attached = attached_by.map(|q| q.completed);
            // A move ends once its replacement is Ready too (the drain
            // waits for it): kwok's, a cluster step that can come after the
            // attach when kwok lags.
            let ready = gone
                .and_then(|g| crate::bench::pod_ready(log, pod, g))
                .map(|q| q.completed);
            if let (Some(a), Some(r)) = (attached, ready) {
                out.entry("attached elsewhere → replacement Ready")
                    .or_default()
                    .push(crate::bench::secs(a, r).max(0.0));
            }
            let whole = attached.map(|a| ready.map_or(a, |r| r.max(a)));
            let evicted_at = order[i].0;
            let moved = evicted_at.zip(whole).map(|(e, a)| crate::bench::secs(e, a));
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
                    .push(crate::bench::secs(g, d));
            }
            if let (Some(d), Some(a)) = (detached, attached) {
                out.entry("detached → attached elsewhere")
                    .or_default()
                    .push(crate::bench::secs(d, a));
            }
            // The controller's turn: the next stateful pod's eviction after
            // the later of the attach and the replacement Ready (see
            // `audit::reaction_ms` on one heard before the step completed).
            let last_step = match (attached_by, ready) {
                (Some(a), Some(r)) if r > a.completed => {
                    gone.and_then(|g| crate::bench::pod_ready(log, pod, g))
                }
                (a, _) => a,
            };
            if let (Some(a), Some((Some(e), _, _))) = (last_step, order.get(i + 1))
                && let Some(took) = crate::bench::audit::reaction_seconds(a, *e)
            {
                out.entry("whole → next eviction (controller)")
                    .or_default()
                    .push(took);
            }
        }
        let first_eviction = r.pods.iter().filter_map(|p| evicted(p)).min();
        per_route.insert(
            r.machine.clone(),
            RouteTimes {
                first_eviction: first_eviction.map(|e| crate::bench::secs(start, e)),
                cluster: critical_path(&stateless, &chain),
            },
        );
    }
    let steps = out
        .into_iter()
        .map(|(k, v)| (k.to_owned(), crate::bench::Gaps::of(&v)))
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
