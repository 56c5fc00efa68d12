//! The workloads the scenarios drain, put on a Node and waited for.

use std::collections::BTreeSet;

use futures::StreamExt as _;
use k8s_openapi::api::storage::v1::VolumeError;
use kube::runtime::{WatchStreamExt as _, reflector, watcher};

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

/// Waits until the volume of each pod of `volumes` (pod name to PV name,
/// in the bench namespace) is attached on the Node where that pod runs
/// now: the pod Running and not being deleted, and a VolumeAttachment of
/// its PV on its Node, attached and not being deleted. Driven by a watch of
/// the pods and one of the VolumeAttachments, checked again after a change
/// to either, so a pod that moves is followed to its new Node. Returns the
/// pods of `volumes` as they were then.
///
/// # Errors
/// On timeout (or a watch that keeps failing), `what` and a listing of
/// each pod of `volumes` (Node, phase) and of every VolumeAttachment of its
/// PV (Node, attached, deleting, errors), as the watches last saw them, so
/// that a failure names the volume that did not follow.
pub(super) async fn attached_where_pods_run(
    admin: &Client,
    what: &str,
    volumes: &BTreeMap<String, String>,
) -> anyhow::Result<Vec<Arc<Pod>>> {
    let (pods, pods_writer) = reflector::store::<Pod>();
    let (vas, vas_writer) = reflector::store::<VolumeAttachment>();
    // Each event as (which watch, whether it ends that watch's initial
    // list).
    let pod_events = reflector(
        pods_writer,
        watcher(
            Api::<Pod>::namespaced(admin.clone(), NS),
            watcher::Config::default(),
        )
        .default_backoff(),
    )
    .map(|e| (0_usize, e.map(|e| matches!(e, watcher::Event::InitDone))));
    let va_events = reflector(
        vas_writer,
        watcher(
            Api::<VolumeAttachment>::all(admin.clone()),
            watcher::Config::default(),
        )
        .default_backoff(),
    )
    .map(|e| (1_usize, e.map(|e| matches!(e, watcher::Event::InitDone))));
    let events = futures::stream::select(pod_events, va_events);
    futures::pin_mut!(events);
    // As `wait::until`: a watch error is retried (with backoff) until the
    // deadline, and the last one is what a timeout reports.
    let deadline = tokio::time::Instant::now() + LONG;
    let mut synced = [false, false];
    let mut last_error = None;
    loop {
        match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some((which, Ok(init_done)))) => {
                synced[which] |= init_done;
                if synced == [true, true] {
                    let (ps, vs) = (pods.state(), vas.state());
                    if attached_where_they_run(volumes, &ps, &vs) {
                        return Ok(ps
                            .into_iter()
                            .filter(|p| volumes.contains_key(&p.name_any()))
                            .collect());
                    }
                }
            }
            Ok(Some((_, Err(e)))) => last_error = Some(e),
            Ok(None) | Err(_) => {
                let now = attachment_listing(volumes, &pods.state(), &vas.state());
                return Err(match last_error {
                    Some(e) => anyhow::Error::new(e).context(format!(
                        "timed out waiting for {what}, the watch failing; now: {now}"
                    )),
                    None => {
                        anyhow::anyhow!("timed out after {LONG:?} waiting for {what}; now: {now}")
                    }
                });
            }
        }
    }
}

/// The Node pod `p` runs on: Running, not being deleted and bound to one.
fn runs_on(p: &Pod) -> Option<&str> {
    if p.metadata.deletion_timestamp.is_some()
        || p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running")
    {
        return None;
    }
    p.spec.as_ref()?.node_name.as_deref()
}

/// Whether the PV of each pod of `volumes` (pod name to PV name) has a
/// VolumeAttachment attached, and not being deleted, on the Node where its
/// pod runs.
fn attached_where_they_run(
    volumes: &BTreeMap<String, String>,
    pods: &[Arc<Pod>],
    vas: &[Arc<VolumeAttachment>],
) -> bool {
    volumes.iter().all(|(pod, pv)| {
        let Some(node) = pods
            .iter()
            .find(|p| p.name_any() == *pod)
            .and_then(|p| runs_on(p))
        else {
            return false;
        };
        vas.iter().any(|va| {
            va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
                && va.spec.node_name == node
                && va.metadata.deletion_timestamp.is_none()
                && va.status.as_ref().is_some_and(|s| s.attached)
        })
    })
}

/// Each pod of `volumes` (its Node and phase) and every VolumeAttachment
/// of its PV (its Node, attached or not, deleting, its errors), on one
/// line: what a timed-out [`attached_where_pods_run`] reports.
fn attachment_listing(
    volumes: &BTreeMap<String, String>,
    pods: &[Arc<Pod>],
    vas: &[Arc<VolumeAttachment>],
) -> String {
    volumes
        .iter()
        .map(|(pod, pv)| {
            let p = match pods.iter().find(|p| p.name_any() == *pod) {
                Some(p) => format!(
                    "pod {pod} on {} ({}{})",
                    p.spec
                        .as_ref()
                        .and_then(|s| s.node_name.as_deref())
                        .unwrap_or("no Node"),
                    p.status
                        .as_ref()
                        .and_then(|s| s.phase.as_deref())
                        .unwrap_or("no phase"),
                    if p.metadata.deletion_timestamp.is_some() {
                        ", deleting"
                    } else {
                        ""
                    },
                ),
                None => format!("no pod {pod}"),
            };
            let attachments: Vec<String> = vas
                .iter()
                .filter(|va| va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str()))
                .map(|va| {
                    let status = va.status.as_ref();
                    let error = |e: Option<&VolumeError>, what: &str| {
                        e.map(|e| {
                            format!(
                                ", {what} error: {}",
                                e.message.as_deref().unwrap_or("(no message)")
                            )
                        })
                        .unwrap_or_default()
                    };
                    format!(
                        "VolumeAttachment {} on {} ({}{}{}{})",
                        va.name_any(),
                        va.spec.node_name,
                        if status.is_some_and(|s| s.attached) {
                            "attached"
                        } else {
                            "not attached"
                        },
                        if va.metadata.deletion_timestamp.is_some() {
                            ", deleting"
                        } else {
                            ""
                        },
                        error(status.and_then(|s| s.attach_error.as_ref()), "attach"),
                        error(status.and_then(|s| s.detach_error.as_ref()), "detach"),
                    )
                })
                .collect();
            format!(
                "{p}, its PV {pv}: {}",
                if attachments.is_empty() {
                    "no VolumeAttachment".to_string()
                } else {
                    attachments.join(", ")
                }
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, node: &str, phase: &str) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": NS},
                "spec": {"nodeName": node, "containers": []},
                "status": {"phase": phase}
            }))
            .expect("a pod"),
        )
    }

    fn va(name: &str, pv: &str, node: &str, attached: bool) -> Arc<VolumeAttachment> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name},
                "spec": {"attacher": "csi.testbed.berth.dev", "nodeName": node,
                    "source": {"persistentVolumeName": pv}},
                "status": {"attached": attached}
            }))
            .expect("a VolumeAttachment"),
        )
    }

    #[test]
    fn a_volume_counts_only_where_its_pod_runs_now() {
        let volumes = BTreeMap::from([("db-0".to_string(), "pv-0".to_string())]);
        let moved = [pod("db-0", "b", "Running")];
        // Still attached on the Node it left, not yet on its new one.
        let before = [
            va("va-a", "pv-0", "a", true),
            va("va-b", "pv-0", "b", false),
        ];
        assert!(!attached_where_they_run(&volumes, &moved, &before));
        assert_eq!(
            attachment_listing(&volumes, &moved, &before),
            "pod db-0 on b (Running), its PV pv-0: VolumeAttachment va-a on a (attached), \
             VolumeAttachment va-b on b (not attached)"
        );
        let after = [va("va-a", "pv-0", "a", true), va("va-b", "pv-0", "b", true)];
        assert!(attached_where_they_run(&volumes, &moved, &after));
        // A pod not Running, or gone, has no volume where it runs.
        let pending = [pod("db-0", "b", "Pending")];
        assert!(!attached_where_they_run(&volumes, &pending, &after));
        assert!(!attached_where_they_run(&volumes, &[], &after));
        assert_eq!(
            attachment_listing(&volumes, &[], &[]),
            "no pod db-0, its PV pv-0: no VolumeAttachment"
        );
    }
}
