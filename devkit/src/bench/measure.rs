//! What every scenario measures: the steps of a drain in the audit log, the
//! controller's gap after each, and its API cost.

use super::*;

/// The requests that completed each stateful pod's steps, read from the
/// audit log: pod gone (kwok deleted it), volume detached (kwok released
/// the old VolumeAttachment), volume attached (kwok marked the new one
/// attached).
pub(crate) struct Steps<'a> {
    pub(super) gone: Vec<&'a Request>,
    pub(super) detached: Vec<&'a Request>,
    pub(super) attached: Vec<&'a Request>,
}

impl Steps<'_> {
    /// When the last volume was attached on the new Node.
    pub(super) fn end(&self) -> Option<Timestamp> {
        self.attached.iter().map(|r| r.completed).max()
    }
}

pub(super) fn steps<'a>(
    log: &'a [Request],
    pods: &[String],
    pvs: &[String],
    old: &BTreeMap<String, String>,
    new: &BTreeMap<String, String>,
    start: Timestamp,
) -> Steps<'a> {
    let mut s = Steps {
        gone: vec![],
        detached: vec![],
        attached: vec![],
    };
    for (pod, pv) in pods.iter().zip(pvs) {
        s.gone.extend(pod_gone(log, pod, start));
        s.detached.extend(
            old.get(pv)
                .and_then(|va| last_write_by(log, "kwok", "volumeattachments", va)),
        );
        // The attacher's first status write is the one that sets
        // `attached: true`.
        s.attached.extend(
            new.get(pv)
                .and_then(|va| first_write_by(log, "kwok", "volumeattachments", va, "status")),
        );
    }
    s
}

/// kwok's first status write of a pod named `pod` completed after `after`
/// (the old pod gone): the replacement of that name Running and Ready
/// (kwok's `pod-ready` stage writes both at once).
pub(crate) fn pod_ready<'a>(
    log: &'a [Request],
    pod: &str,
    after: Timestamp,
) -> Option<&'a Request> {
    log.iter()
        .filter(|r| r.user_agent.contains("kwok") && r.is_write() && r.resource == "pods")
        .filter(|r| r.subresource.as_deref() == Some("status"))
        .filter(|r| r.name.as_deref() == Some(pod) && r.completed > after)
        .min_by_key(|r| r.completed)
}

/// kwok's deletion of `pod` after `start`: the pod is gone.
pub(crate) fn pod_gone<'a>(log: &'a [Request], pod: &str, start: Timestamp) -> Option<&'a Request> {
    log.iter()
        .filter(|r| r.user_agent.contains("kwok") && r.verb == "delete" && r.resource == "pods")
        .filter(|r| r.name.as_deref() == Some(pod) && r.completed > start)
        .min_by_key(|r| r.completed)
}

pub(super) fn gaps(log: &[Request], user: &str, steps: &[&Request]) -> Vec<f64> {
    steps
        .iter()
        .filter_map(|step| audit::reaction_ms(log, user, step))
        .collect()
}

/// Waits for the `Drained` Event of `machine`: Events are published from a
/// queue, so it may come a moment after the Machine went.
pub(super) async fn drained_event(admin: &Client, machine: &str) -> anyhow::Result<()> {
    wait::for_one(
        Api::<Event>::namespaced(admin.clone(), NS),
        Duration::from_secs(60),
        &format!("the Drained Event of {machine}"),
        |e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(machine)
                && e.reason.as_deref() == Some("Drained")
        },
    )
    .await?;
    Ok(())
}

/// The drain's requests from `start` to `end`, and the Events about the
/// Machines `events` published after `end` (from the controller's queue)
/// but for their drains.
pub(super) fn cost_into(
    run: &mut Run,
    log: &[Request],
    user: &str,
    start: Timestamp,
    end: Timestamp,
    events: &[&str],
) {
    run.api_requests = audit::cost(log, user, start, end);
    for machine in events {
        let prefix = format!("{machine}.");
        for r in log
            .iter()
            .filter(|r| r.user == user && r.resource == "events" && r.is_write())
            .filter(|r| r.received > end)
            .filter(|r| r.name.as_deref().is_some_and(|n| n.starts_with(&prefix)))
        {
            *run.api_requests.entry(r.kind()).or_default() += 1;
        }
    }
    let total: u32 = run.api_requests.values().sum();
    run.api_requests_per_pod = f64::from(total) / f64::from(run.pods.max(1));
    run.reads_during_drain = log
        .iter()
        .filter(|r| r.user == user && r.is_read() && r.received >= start && r.received <= end)
        .count() as u32;
}
