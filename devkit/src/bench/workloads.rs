//! The workloads the scenarios drain, put on a Node and waited for.

use std::collections::BTreeSet;

use super::*;

/// A StatefulSet `name` of `n` pods with a CSI volume each, all running on
/// `node` with their volumes attached there.
pub(super) async fn stateful_on(
    admin: &Client,
    name: &str,
    n: u32,
    grace: u32,
    pool: &str,
    node: &str,
) -> anyhow::Result<()> {
    volumes_for(admin, pool, name, n).await?;
    crate::testbed::create_or_keep(
        Api::namespaced(admin.clone(), NS),
        fixtures::stateful_set_in_pool(name, i32::try_from(n)?, i64::from(grace), pool, None),
    )
    .await?;
    running_on(admin, node, &format!("{name}-"), n).await?;
    attached_on(admin, &BTreeSet::from([node.to_string()]), n).await?;
    Ok(())
}

/// The pre-bound CSI PV `<pool>-<name>-<i>` of each of the `n` pods of
/// StatefulSet `name` (claim `data-<name>-<i>`).
pub(super) async fn volumes_for(
    admin: &Client,
    pool: &str,
    name: &str,
    n: u32,
) -> anyhow::Result<()> {
    for i in 0..n {
        let pv = format!("{pool}-{name}-{i}");
        crate::testbed::create_or_keep(
            Api::all(admin.clone()),
            fixtures::csi_pv(&pv, &format!("vol-{pv}"), NS, &format!("data-{name}-{i}")),
        )
        .await?;
    }
    Ok(())
}

/// Waits until at least `n` volumes are attached on `nodes`.
pub(super) async fn attached_on(
    admin: &Client,
    nodes: &BTreeSet<String>,
    n: u32,
) -> anyhow::Result<()> {
    wait::until(
        Api::<VolumeAttachment>::all(admin.clone()),
        LONG,
        "volumes attached",
        |vas| {
            vas.iter()
                .filter(|va| {
                    nodes.contains(&va.spec.node_name)
                        && va.status.as_ref().is_some_and(|s| s.attached)
                })
                .count()
                >= n as usize
        },
    )
    .await?;
    Ok(())
}

pub(super) async fn running_on(
    admin: &Client,
    node: &str,
    prefix: &str,
    n: u32,
) -> anyhow::Result<()> {
    wait::until(
        Api::<Pod>::namespaced(admin.clone(), NS),
        LONG,
        "pods running",
        |ps| {
            ps.iter()
                .filter(|p| {
                    p.name_any().starts_with(prefix)
                        && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                })
                .count()
                >= n as usize
        },
    )
    .await?;
    Ok(())
}
