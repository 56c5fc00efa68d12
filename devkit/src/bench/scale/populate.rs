//! Populating the scale test bed: Machines, the drained Machines'
//! workloads, background pods and VolumeAttachments, and counting them.

use super::*;

/// The names of the scenario's objects.
pub(super) fn drain_pool(i: usize) -> String {
    format!("scale-d{i:03}")
}

pub(super) fn label(meta: &mut ObjectMeta, value: &str) {
    meta.labels
        .get_or_insert_with(Default::default)
        .insert(SCALE_LABEL.into(), value.into());
}

/// Creates every object, [`CREATE_CONCURRENCY`] at a time, keeping those
/// that exist.
pub(super) async fn create_all<K>(api: Api<K>, objects: Vec<K>, what: &str) -> anyhow::Result<()>
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
pub(super) async fn populate_cluster(
    admin: &Client,
    args: &BenchArgs,
    plan: &Plan,
) -> anyhow::Result<Vec<ScaleDrain>> {
    let machines: Api<Machine> = Api::namespaced(admin.clone(), NS);
    crate::bench::pool_class(admin, BG_CLASS).await?;
    for i in 0..plan.drains.len() {
        crate::bench::pool_class(admin, &drain_pool(i)).await?;
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
        first.push(crate::bench::machine_object(name, &drain_pool(i))?);
    }
    for name in &background {
        first.push(crate::bench::machine_object(name, BG_CLASS)?);
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
        second.push(crate::bench::machine_object(name, &drain_pool(i))?);
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

pub(super) async fn machines_running(
    machines: &Api<Machine>,
    names: &[String],
) -> anyhow::Result<()> {
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
pub(super) async fn drain_workloads(
    admin: &Client,
    args: &BenchArgs,
    plan: &Plan,
) -> anyhow::Result<()> {
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
            if let Some(meta) = set.spec.template.metadata.as_mut() {
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
        if let Some(meta) = web.spec.template.metadata.as_mut() {
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
pub(super) async fn background_pods(
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
pub(super) async fn background_attachments(
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
pub(super) async fn count_until<K, F>(
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
pub(super) async fn count<K>(api: Api<K>) -> anyhow::Result<u32>
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

pub(super) async fn count_cluster(admin: &Client) -> anyhow::Result<Counted> {
    Ok(Counted {
        machines: count(Api::<Machine>::namespaced(admin.clone(), NS)).await?,
        nodes: count(Api::<Node>::all(admin.clone())).await?,
        pods: count(Api::<Pod>::all(admin.clone())).await?,
        volume_attachments: count(Api::<VolumeAttachment>::all(admin.clone())).await?,
        persistent_volumes: count(Api::<PersistentVolume>::all(admin.clone())).await?,
    })
}
