//! The stateful scenario: a StatefulSet whose pods each have a CSI volume,
//! drained by berth; its wall time against its floor, the controller-added
//! gap after each step, and its API cost.

use super::*;

/// The StatefulSet: a name of its own among the scenarios, which share one
/// namespace on one test bed (its claims are `data-stateful-db-<i>`).
const STS: &str = "stateful-db";

pub(super) async fn stateful_berth(
    admin: &Client,
    args: &BenchArgs,
    audit_log: &std::path::Path,
    user: &str,
) -> anyhow::Result<Run> {
    let pool = "bench-stateful";
    pool_class(admin, pool).await?;
    let a = machine(admin, "stateful-a", pool).await?;
    stateful_on(admin, STS, args.stateful, args.grace, pool, &a).await?;
    let b = machine(admin, "stateful-b", pool).await?;
    let old = attachments_on(admin, &a).await?;
    let machines: Api<Machine> = Api::namespaced(admin.clone(), NS);
    let t = Instant::now();
    machines
        .delete("stateful-a", &DeleteParams::default())
        .await?;
    wait::for_none(
        machines,
        Duration::from_secs(1800),
        "stateful-a gone",
        |m| m.name_any() == "stateful-a",
    )
    .await?;
    eprintln!("berth stateful drain: {:.1}s", t.elapsed().as_secs_f64());
    drained_event(admin, "stateful-a").await?;
    let new = attachments_on(admin, &b).await?;
    let log = read_audit(audit_log)?;
    let start =
        deleted_at(&log, "machines", "stateful-a").context("the delete is in the audit log")?;
    let mut pods: Vec<String> = (0..args.stateful).map(|i| format!("{STS}-{i}")).collect();
    pods.sort();
    let pvs: Vec<String> = pods.iter().map(|p| format!("{pool}-{p}")).collect();
    let s = steps(&log, &pods, &pvs, &old, &new, start);
    let end = s.end().context("no reattach observed")?;
    let mut run = Run {
        scenario: "stateful".into(),
        drainer: compare::BERTH.into(),
        pods: args.stateful,
        wall_seconds: Some(secs(start, end)),
        floor_seconds: f64::from(args.stateful)
            * (f64::from(args.grace)
                + args.detach_delay.as_secs_f64()
                + args.attach_delay.as_secs_f64()),
        ..Default::default()
    };
    for (step, moments) in [
        ("pod_gone", &s.gone),
        ("detached", &s.detached),
        ("reattached", &s.attached),
    ] {
        run.gaps_ms
            .insert(step.into(), Gaps::of(&gaps(&log, user, moments)));
    }
    cost_into(&mut run, &log, user, start, end, &["stateful-a"]);
    Ok(run)
}
