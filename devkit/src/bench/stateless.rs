//! The stateless scenario: a Deployment of pods without volumes, drained by
//! berth; its wall time against the grace period, and its API cost.

use super::*;

pub(super) async fn stateless_berth(
    admin: &Client,
    args: &BenchArgs,
    audit_log: &std::path::Path,
    user: &str,
) -> anyhow::Result<Run> {
    let pool = "bench-stateless";
    pool_class(admin, pool).await?;
    let c = machine(admin, "stateless-a", pool).await?;
    crate::testbed::create_or_keep(
        Api::namespaced(admin.clone(), NS),
        fixtures::deployment(
            "web",
            i32::try_from(args.stateless)?,
            i64::from(args.grace),
            pool,
        ),
    )
    .await?;
    running_on(admin, &c, "web-", args.stateless).await?;
    machine(admin, "stateless-b", pool).await?;
    let machines: Api<Machine> = Api::namespaced(admin.clone(), NS);
    // The drain's end is its `status.drain.finishedAt`, seen by a watch
    // from before the delete (the Machine is gone soon after).
    let (listed_tx, listed) = tokio::sync::oneshot::channel();
    let seen = tokio::spawn(scale::watch_ends(
        machines.clone(),
        ["stateless-a".to_string()].into(),
        listed_tx,
    ));
    listed
        .await
        .context("the Machine watch ended before listing")?;
    machines
        .delete("stateless-a", &DeleteParams::default())
        .await?;
    let seen = tokio::time::timeout(LONG, seen)
        .await
        .context("stateless-a not gone in time")?
        .context("the Machine watch failed")??;
    drained_event(admin, "stateless-a").await?;
    let log = read_audit(audit_log)?;
    let start =
        deleted_at(&log, "machines", "stateless-a").context("the delete is in the audit log")?;
    let drained = *seen
        .finished
        .get("stateless-a")
        .context("no status.drain.finishedAt seen")?;
    let mut run = Run {
        scenario: "stateless".into(),
        drainer: compare::BERTH.into(),
        pods: args.stateless,
        wall_seconds: Some(secs(start, drained)),
        floor_seconds: f64::from(args.grace),
        ..Default::default()
    };
    cost_into(&mut run, &log, user, start, drained, &["stateless-a"]);
    Ok(run)
}
