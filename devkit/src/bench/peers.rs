//! The peers: the stateful scenario again with `kubectl drain` and, when
//! its driver is built, Gardener machine-controller-manager's drain.

use super::*;

/// Two bare kwok Nodes in `pool` and the stateful workload on the first.
pub(super) async fn peer_nodes(
    admin: &Client,
    pool: &str,
    args: &BenchArgs,
) -> anyhow::Result<(String, String)> {
    let (a, b) = (format!("{pool}-a"), format!("{pool}-b"));
    let nodes: Api<Node> = Api::all(admin.clone());
    let mut na = fixtures::node(&a);
    na.labels_mut()
        .insert(fixtures::POOL_LABEL.into(), pool.into());
    crate::testbed::create_or_keep(nodes.clone(), na).await?;
    let sts = format!("{}-db", pool.trim_start_matches("bench-"));
    stateful_on(admin, &sts, args.stateful, args.grace, pool, &a).await?;
    let mut nb = fixtures::node(&b);
    nb.labels_mut()
        .insert(fixtures::POOL_LABEL.into(), pool.into());
    crate::testbed::create_or_keep(nodes, nb).await?;
    Ok((a, b))
}

pub(super) async fn peer_run(
    admin: &Client,
    args: &BenchArgs,
    audit_log: &std::path::Path,
    pool: &str,
    drainer: &str,
    agent: &str,
    command: std::process::Command,
) -> anyhow::Result<Run> {
    let (a, b) = peer_nodes(admin, pool, args).await?;
    let old = attachments_on(admin, &a).await?;
    let sts = format!("{}-db", pool.trim_start_matches("bench-"));
    let mut command = command;
    command.arg(&a);
    let started = Timestamp::now();
    let t = Instant::now();
    // A peer gets ten minutes; one that hangs is killed and reported.
    let mut command = tokio::process::Command::from(command);
    command.kill_on_drop(true);
    let out = match tokio::time::timeout(PEER_TIMEOUT, command.output()).await {
        Ok(out) => out?,
        Err(_) => {
            anyhow::bail!(
                "{drainer} did not finish within {}",
                humantime::format_duration(PEER_TIMEOUT)
            )
        }
    };
    let exited = t.elapsed();
    let mut run = Run {
        scenario: "stateful".into(),
        drainer: drainer.into(),
        pods: args.stateful,
        floor_seconds: f64::from(args.stateful)
            * (f64::from(args.grace)
                + args.detach_delay.as_secs_f64()
                + args.attach_delay.as_secs_f64()),
        ..Default::default()
    };
    if !out.status.success() {
        run.note = Some(format!(
            "exited {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .chars()
                .take(400)
                .collect::<String>()
        ));
        return Ok(run);
    }
    // The peer returns when its pods are gone; the volumes settle later.
    let pvs: Vec<String> = (0..args.stateful)
        .map(|i| format!("{pool}-{sts}-{i}"))
        .collect();
    wait::until(
        Api::<VolumeAttachment>::all(admin.clone()),
        LONG,
        "volumes on B",
        |vas| {
            pvs.iter().all(|pv| {
                vas.iter().any(|va| {
                    va.spec.node_name == b
                        && va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
                        && va.status.as_ref().is_some_and(|s| s.attached)
                })
            })
        },
    )
    .await?;
    let new = attachments_on(admin, &b).await?;
    let log = read_audit(audit_log)?;
    let mut pods: Vec<String> = (0..args.stateful).map(|i| format!("{sts}-{i}")).collect();
    pods.sort();
    let s = steps(&log, &pods, &pvs, &old, &new, started);
    let end = s.end();
    run.wall_seconds = end.map(|e| secs(started, e));
    run.note = Some(format!(
        "{drainer} returned after {:.1}s (pods gone); wall time is until the last volume attached on the new Node",
        exited.as_secs_f64()
    ));
    let users: Vec<&str> = log
        .iter()
        .filter(|r| r.user_agent.contains(agent) && r.received >= started)
        .map(|r| r.user.as_str())
        .collect();
    if let (Some(user), Some(end)) = (users.first(), end) {
        let mut cost = BTreeMap::new();
        for r in log.iter().filter(|r| {
            r.user == *user
                && r.user_agent.contains(agent)
                && r.received >= started
                && r.received <= end
        }) {
            *cost.entry(r.kind()).or_insert(0) += 1;
        }
        run.api_requests_per_pod =
            f64::from(cost.values().sum::<u32>()) / f64::from(run.pods.max(1));
        run.reads_during_drain = log
            .iter()
            .filter(|r| {
                r.user == *user
                    && r.user_agent.contains(agent)
                    && r.is_read()
                    && r.received >= started
                    && r.received <= end
            })
            .count() as u32;
        run.api_requests = cost;
    }
    Ok(run)
}

pub(super) async fn stateful_kubectl(
    admin: &Client,
    bed: &TestBed,
    args: &BenchArgs,
    audit_log: &std::path::Path,
) -> anyhow::Result<Run> {
    let mut cmd = std::process::Command::new(crate::testbed::bin_dir()?.join("kubectl"));
    cmd.arg("--kubeconfig").arg(bed.kubeconfig_path()).args([
        "drain",
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        "--timeout=30m",
    ]);
    peer_run(
        admin,
        args,
        audit_log,
        "bench-kubectl",
        "kubectl drain",
        "kubectl",
        cmd,
    )
    .await
}

pub(super) async fn stateful_mcm(
    admin: &Client,
    bed: &TestBed,
    args: &BenchArgs,
    audit_log: &std::path::Path,
) -> Run {
    let script = crate::testbed::repo_root().join("hack/bench/build.sh");
    let not_driven = |why: String| Run {
        scenario: "stateful".into(),
        drainer: "machine-controller-manager drain".into(),
        pods: args.stateful,
        note: Some(format!("not driven: {why}")),
        ..Default::default()
    };
    if !script.exists() {
        return not_driven("hack/bench/build.sh (the MCM driver) is not in this build".into());
    }
    let dir = match std::process::Command::new("bash")
        .arg(&script)
        .arg("--bin-dir")
        .output()
    {
        Ok(o) if o.status.success() => PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
        Ok(o) => {
            return not_driven(format!(
                "building the MCM driver failed: {}",
                String::from_utf8_lossy(&o.stderr)
                    .chars()
                    .take(400)
                    .collect::<String>()
            ));
        }
        Err(e) => return not_driven(format!("cannot run {}: {e}", script.display())),
    };
    let mut cmd = std::process::Command::new(dir.join("mcm-drain"));
    cmd.arg("--kubeconfig")
        .arg(bed.kubeconfig_path())
        .arg("--timeout=30m")
        .arg("--node");
    match peer_run(
        admin,
        args,
        audit_log,
        "bench-mcm",
        "machine-controller-manager drain",
        "mcm-drain",
        cmd,
    )
    .await
    {
        Ok(run) => run,
        Err(e) => not_driven(format!("{e:#}")),
    }
}
