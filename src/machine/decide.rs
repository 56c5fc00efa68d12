//! What the Machine lifecycle does next, decided from plain facts.
//!
//! The reconciler observes (caches, the provider), turns what it saw into the
//! fact structs below, asks these functions for the next step, performs it
//! and records it. Nothing here talks to the API server, so every decision is
//! unit-tested, and because a step is chosen from what is observed now (not
//! from a remembered position) a restarted controller resumes at the right
//! step by construction.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};

use crate::api::{CORDON_TAINT_KEY, MachinePhase};
use crate::drain::cluster_rules::RuleBook;

/// What is known about a Machine that is not being deleted.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CreationFacts {
    pub(crate) phase: Option<MachinePhase>,
    /// `spec.providerID`, once the VM exists.
    pub(crate) provider_id: Option<String>,
    /// The Node whose `spec.providerID` matches, if it registered.
    pub(crate) node: Option<NodeFacts>,
    /// Time since the Machine was created.
    pub(crate) age: Duration,
    pub(crate) creation_timeout: Duration,
    pub(crate) health_timeout: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NodeFacts {
    pub(crate) name: String,
    pub(crate) ready: bool,
    /// For how long the Ready condition has had its current value.
    pub(crate) ready_for: Duration,
    /// `spec.unschedulable` and berth's NoSchedule taint are both present.
    pub(crate) cordoned: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum CreationStep {
    /// Ask the provider for the VM (idempotent) and record its providerID.
    CreateVm,
    /// The VM exists; its Node has not registered or is not Ready yet.
    /// `retry_in` is when the creation timeout would pass.
    WaitForNode { retry_in: Duration },
    /// The Node did not become Ready within the creation timeout.
    FailCreation { waited: Duration },
    /// The provider did not create the VM within the creation timeout (it
    /// kept failing, or saying "in progress"): no providerID.
    VmNotCreated { waited: Duration },
    /// The Node is Ready: the Machine is (or stays) Running.
    Running { node: String },
    /// Running, but the Node has been NotReady longer than the health
    /// timeout.
    Unhealthy {
        node: String,
        not_ready_for: Duration,
    },
    /// Failed earlier; stays failed until the Machine is deleted.
    StayFailed,
}

pub(crate) fn next_creation_step(f: &CreationFacts) -> CreationStep {
    if f.phase == Some(MachinePhase::Failed) {
        return CreationStep::StayFailed;
    }
    if f.provider_id.is_none() {
        // A create that keeps failing (a quota, no capacity) ends too.
        if f.age >= f.creation_timeout {
            return CreationStep::VmNotCreated { waited: f.age };
        }
        return CreationStep::CreateVm;
    }
    let was_running = f.phase == Some(MachinePhase::Running);
    match &f.node {
        Some(n) if n.ready => CreationStep::Running {
            node: n.name.clone(),
        },
        Some(n) if was_running => {
            if n.ready_for >= f.health_timeout {
                CreationStep::Unhealthy {
                    node: n.name.clone(),
                    not_ready_for: n.ready_for,
                }
            } else {
                // Still within the grace of the health timeout.
                CreationStep::Running {
                    node: n.name.clone(),
                }
            }
        }
        _ if f.age >= f.creation_timeout => CreationStep::FailCreation { waited: f.age },
        _ => CreationStep::WaitForNode {
            retry_in: f.creation_timeout - f.age,
        },
    }
}

/// What is known about a Machine whose deletion was requested.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct DeletionFacts {
    pub(crate) phase: Option<MachinePhase>,
    /// Labelled for forced deletion: no drain, pods are force-deleted.
    pub(crate) force: bool,
    pub(crate) pre_drain_hooks: Vec<String>,
    pub(crate) pre_terminate_hooks: Vec<String>,
    /// The Machine's Node, if it exists.
    pub(crate) node: Option<NodeFacts>,
    /// The name of the Machine's Node when its object is gone while the VM
    /// may still run (deleted by hand): the drain still runs, finding pods
    /// and attachments by `spec.nodeName`.
    pub(crate) node_gone: Option<String>,
    /// Pods on the Node that a drain has to move (`namespace/name`).
    pub(crate) pods_to_drain: Vec<String>,
    /// Pods on the Node that are not yet gone at all (force path).
    pub(crate) pods_on_node: Vec<String>,
    /// The drain engine has not finished this Machine's drain yet (it may
    /// still wait for volumes to move even when no pod is left).
    pub(crate) drain_pending: bool,
    /// VolumeAttachments that still name the Node.
    pub(crate) volume_attachments: Vec<String>,
    /// The wait for them has lasted longer than the volume detach timeout:
    /// go on (with a warning) rather than hold the Machine forever.
    pub(crate) volume_detach_timed_out: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum DeletionStep {
    MarkTerminating,
    WaitPreDrainHooks(Vec<String>),
    Cordon {
        node: String,
    },
    ForceDeletePods {
        node: String,
        pods: Vec<String>,
    },
    Drain {
        node: String,
        pods: Vec<String>,
    },
    WaitVolumesDetached {
        node: String,
        attachments: Vec<String>,
    },
    WaitPreTerminateHooks(Vec<String>),
    /// Delete the VM, then the Node object if there is one, then let go.
    DeleteVmAndNode {
        node: Option<String>,
    },
}

impl DeletionStep {
    /// Short name recorded in `status.lastOperation.step` and Events.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            DeletionStep::MarkTerminating => "MarkTerminating",
            DeletionStep::WaitPreDrainHooks(_) => "WaitPreDrainHooks",
            DeletionStep::Cordon { .. } => "Cordon",
            DeletionStep::ForceDeletePods { .. } => "ForceDeletePods",
            DeletionStep::Drain { .. } => "Drain",
            DeletionStep::WaitVolumesDetached { .. } => "WaitVolumesDetached",
            DeletionStep::WaitPreTerminateHooks(_) => "WaitPreTerminateHooks",
            DeletionStep::DeleteVmAndNode { .. } => "DeleteVm",
        }
    }

    /// Whether the step acts on the Machine's Node, its pods or its VM
    /// (all but marking the Machine and waiting for its hooks): what a
    /// deletion that cannot tell whose the VM is must not take.
    pub(crate) fn touches_node_or_vm(&self) -> bool {
        !matches!(
            self,
            DeletionStep::MarkTerminating
                | DeletionStep::WaitPreDrainHooks(_)
                | DeletionStep::WaitPreTerminateHooks(_)
        )
    }
}

/// The deletion steps in order; the first one not done is returned.
pub(crate) fn next_deletion_step(f: &DeletionFacts) -> DeletionStep {
    if f.phase != Some(MachinePhase::Terminating) {
        return DeletionStep::MarkTerminating;
    }
    if f.force {
        if let Some(n) = &f.node
            && !f.pods_on_node.is_empty()
        {
            return DeletionStep::ForceDeletePods {
                node: n.name.clone(),
                pods: f.pods_on_node.clone(),
            };
        }
        return DeletionStep::DeleteVmAndNode {
            node: f.node.as_ref().map(|n| n.name.clone()),
        };
    }
    if !f.pre_drain_hooks.is_empty() {
        return DeletionStep::WaitPreDrainHooks(f.pre_drain_hooks.clone());
    }
    if let Some(n) = &f.node {
        if !n.cordoned {
            return DeletionStep::Cordon {
                node: n.name.clone(),
            };
        }
        if !f.pods_to_drain.is_empty() || f.drain_pending {
            return DeletionStep::Drain {
                node: n.name.clone(),
                pods: f.pods_to_drain.clone(),
            };
        }
        if !f.volume_attachments.is_empty() && !f.volume_detach_timed_out {
            return DeletionStep::WaitVolumesDetached {
                node: n.name.clone(),
                attachments: f.volume_attachments.clone(),
            };
        }
    } else if let Some(name) = &f.node_gone {
        // Nothing to cordon: the kubelet may still run the pods, so they
        // are drained, and their volumes waited for, all the same.
        if !f.pods_to_drain.is_empty() || f.drain_pending {
            return DeletionStep::Drain {
                node: name.clone(),
                pods: f.pods_to_drain.clone(),
            };
        }
        if !f.volume_attachments.is_empty() && !f.volume_detach_timed_out {
            return DeletionStep::WaitVolumesDetached {
                node: name.clone(),
                attachments: f.volume_attachments.clone(),
            };
        }
    }
    if !f.pre_terminate_hooks.is_empty() {
        return DeletionStep::WaitPreTerminateHooks(f.pre_terminate_hooks.clone());
    }
    DeletionStep::DeleteVmAndNode {
        node: f.node.as_ref().map(|n| n.name.clone()),
    }
}

/// Annotation keys starting with `prefix`, sorted.
pub(crate) fn hooks<'a>(
    annotations: impl IntoIterator<Item = &'a String>,
    prefix: &str,
) -> Vec<String> {
    let mut v: Vec<String> = annotations
        .into_iter()
        .filter(|k| k.starts_with(prefix))
        .cloned()
        .collect();
    v.sort();
    v
}

/// A Node's `Ready` condition.
fn ready_condition(node: &Node) -> Option<&k8s_openapi::api::core::v1::NodeCondition> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
}

/// Whether a Node says it is Ready.
pub(crate) fn node_ready(node: &Node) -> bool {
    ready_condition(node).is_some_and(|c| c.status == "True")
}

/// The taints a Node carries while it starts, or while its kubelet or its
/// network is not heard from: the API server puts `not-ready` on every new
/// Node, the node lifecycle controller takes it off some time after the
/// Ready condition turns True, and a cloud controller manager removes
/// `uninitialized` once it has set the Node up. The scheduler places no
/// pod on a Node with one of them (NoSchedule or NoExecute), whatever its
/// Ready condition says.
const STARTUP_TAINTS: [&str; 4] = [
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
    "node.kubernetes.io/network-unavailable",
    "node.cloudprovider.kubernetes.io/uninitialized",
];

/// Whether a taint key says, by the convention node agents follow, that
/// the Node is not set up yet: a CSI driver's node plugin
/// (`ebs.csi.aws.com/agent-not-ready`), a CNI agent
/// (`node.cilium.io/agent-not-ready`), and any `…not-ready`,
/// `…uninitialized` or `…unreachable` key.
fn says_starting(key: &str) -> bool {
    STARTUP_TAINTS.contains(&key)
        || ["not-ready", "uninitialized", "unreachable"]
            .iter()
            .any(|end| key.ends_with(end))
}

/// Whether pods can land on a Node now: Ready, not cordoned
/// (`spec.unschedulable`), and no taint of a starting Node (see
/// [`says_starting`]) with an effect that keeps pods off. A Machine counts
/// as ready in its set only then, so that a rollout never drains an old
/// Machine towards a Node that cannot take its pods yet. Other taints (a
/// pool's `dedicated`) are the pool's own, tolerated by its pods.
pub(crate) fn node_takes_pods(node: &Node) -> bool {
    let spec = node.spec.as_ref();
    node_ready(node)
        && !spec.and_then(|s| s.unschedulable).unwrap_or(false)
        && !spec.and_then(|s| s.taints.as_ref()).is_some_and(|ts| {
            ts.iter().any(|t| {
                says_starting(&t.key) && matches!(t.effect.as_str(), "NoSchedule" | "NoExecute")
            })
        })
}

/// Node facts from a Node object, at `now`.
pub(crate) fn node_facts(node: &Node, now: k8s_openapi::jiff::Timestamp) -> NodeFacts {
    let ready_cond = ready_condition(node);
    let ready = node_ready(node);
    let since = ready_cond
        .and_then(|c| c.last_transition_time.as_ref())
        .or(node.metadata.creation_timestamp.as_ref())
        .map(|t| t.0);
    let ready_for = since
        .and_then(|t| Duration::try_from(now.duration_since(t)).ok())
        .unwrap_or_default();
    let spec = node.spec.as_ref();
    let unschedulable = spec.and_then(|s| s.unschedulable).unwrap_or(false);
    let tainted = spec.and_then(|s| s.taints.as_ref()).is_some_and(|ts| {
        ts.iter()
            .any(|t| t.key == CORDON_TAINT_KEY && t.effect == "NoSchedule")
    });
    NodeFacts {
        name: node.metadata.name.clone().unwrap_or_default(),
        ready,
        ready_for,
        cordoned: unschedulable && tainted,
    }
}

/// Why a pod on a draining Node is left alone, or `None` if the drain has to
/// move it, with the cluster's DrainRules `rules` that apply to its
/// Machine. (The drain engine's own selection refines this; this is the gate
/// that keeps the lifecycle from going past the drain while such pods run.)
pub(crate) fn drain_skip_reason(pod: &Pod, rules: &RuleBook) -> Option<&'static str> {
    use crate::drain::rules::rule_in;
    use crate::drain::select::{PodClass, classify_as};
    match classify_as(pod, &rule_in(pod, rules.matched(pod).as_ref())) {
        PodClass::Mirror => Some("mirror pod"),
        PodClass::DaemonSet { .. } => Some("DaemonSet pod"),
        PodClass::Terminal { .. } => Some("terminal pod"),
        PodClass::Skipped { .. } => Some("pod skipped by its drain rule"),
        PodClass::Terminating { .. } | PodClass::WaitCompleted { .. } | PodClass::Evictable => None,
    }
}

/// The longest pause between two asks of a VM the provider is still
/// deleting.
pub(crate) const DELETING_ASK_AT_MOST: Duration = Duration::from_secs(120);

/// When to ask again about a VM the provider is still deleting
/// (`retry_after`, as it asked), `deleting` after the Machine's deletion
/// was requested: as asked at first, then a tenth of the time it has taken
/// so far, up to [`DELETING_ASK_AT_MOST`]. An instance stuck in
/// `shutting-down` for hours is asked about a few times an hour, not every
/// 5 seconds.
pub(crate) fn ask_again_in(retry_after: Duration, deleting: Duration) -> Duration {
    retry_after.max((deleting / 10).min(DELETING_ASK_AT_MOST))
}

/// How often the provider is asked again while it does not find a deleted
/// Machine's VM.
pub(crate) const NOT_FOUND_ASK_EVERY: Duration = Duration::from_secs(10);

/// A deleted Machine's VM that the provider has not found for `waited`:
/// gone (`None`) once that is `grace`, else when to ask again. A cloud that
/// is eventually consistent does not find a VM that runs, for a while;
/// only its own "terminated" is gone at once.
pub(crate) fn ask_again_for_vm(waited: Duration, grace: Duration) -> Option<Duration> {
    (waited < grace).then(|| (grace - waited).min(NOT_FOUND_ASK_EVERY))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeCondition, NodeSpec, NodeStatus, PodStatus, Taint};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
    use k8s_openapi::jiff::{SignedDuration, Timestamp};

    const MIN: Duration = Duration::from_secs(60);

    fn node(ready: bool, cordoned: bool) -> NodeFacts {
        NodeFacts {
            name: "n1".into(),
            ready,
            ready_for: Duration::ZERO,
            cordoned,
        }
    }

    fn creation(
        phase: Option<MachinePhase>,
        id: bool,
        n: Option<NodeFacts>,
        age: Duration,
    ) -> CreationFacts {
        CreationFacts {
            phase,
            provider_id: id.then(|| "fake:///ns/m".to_string()),
            node: n,
            age,
            creation_timeout: 20 * MIN,
            health_timeout: 10 * MIN,
        }
    }

    #[test]
    fn creation_steps() {
        use CreationStep::{
            CreateVm, FailCreation, Running, StayFailed, VmNotCreated, WaitForNode,
        };
        use MachinePhase::{Creating, Failed};
        let cases = [
            (creation(None, false, None, Duration::ZERO), CreateVm),
            (creation(Some(Creating), false, None, 19 * MIN), CreateVm),
            // A create that kept failing ends at the creation timeout too.
            (
                creation(Some(Creating), false, None, 30 * MIN),
                VmNotCreated { waited: 30 * MIN },
            ),
            (
                creation(Some(Creating), true, None, 5 * MIN),
                WaitForNode { retry_in: 15 * MIN },
            ),
            (
                creation(Some(Creating), true, Some(node(false, false)), 5 * MIN),
                WaitForNode { retry_in: 15 * MIN },
            ),
            (
                creation(Some(Creating), true, None, 20 * MIN),
                FailCreation { waited: 20 * MIN },
            ),
            (
                creation(Some(Creating), true, Some(node(true, false)), 25 * MIN),
                Running { node: "n1".into() },
            ),
            (
                creation(Some(Failed), true, Some(node(true, false)), MIN),
                StayFailed,
            ),
        ];
        for (facts, want) in cases {
            assert_eq!(next_creation_step(&facts), want, "{facts:?}");
        }
    }

    #[test]
    fn a_running_machine_is_unhealthy_only_after_the_health_timeout() {
        let mut n = node(false, false);
        n.ready_for = 9 * MIN;
        let f = creation(Some(MachinePhase::Running), true, Some(n.clone()), 60 * MIN);
        assert_eq!(
            next_creation_step(&f),
            CreationStep::Running { node: "n1".into() }
        );
        n.ready_for = 10 * MIN;
        let f = creation(Some(MachinePhase::Running), true, Some(n), 60 * MIN);
        assert_eq!(
            next_creation_step(&f),
            CreationStep::Unhealthy {
                node: "n1".into(),
                not_ready_for: 10 * MIN
            }
        );
    }

    fn terminating() -> DeletionFacts {
        DeletionFacts {
            phase: Some(MachinePhase::Terminating),
            node: Some(node(true, true)),
            ..Default::default()
        }
    }

    #[test]
    fn a_node_object_gone_while_the_vm_runs_is_still_drained() {
        let gone = |pods: Vec<String>, pending: bool, vas: Vec<String>| DeletionFacts {
            phase: Some(MachinePhase::Terminating),
            node: None,
            node_gone: Some("n1".into()),
            pods_to_drain: pods,
            drain_pending: pending,
            volume_attachments: vas,
            ..Default::default()
        };
        assert_eq!(
            next_deletion_step(&gone(vec!["a/p".into()], true, vec![])),
            DeletionStep::Drain {
                node: "n1".into(),
                pods: vec!["a/p".into()]
            },
            "no cordon: drained by spec.nodeName"
        );
        assert_eq!(
            next_deletion_step(&gone(vec![], false, vec!["va-1".into()])),
            DeletionStep::WaitVolumesDetached {
                node: "n1".into(),
                attachments: vec!["va-1".into()]
            }
        );
        assert_eq!(
            next_deletion_step(&gone(vec![], false, vec![])),
            DeletionStep::DeleteVmAndNode { node: None },
            "then the VM; no Node object to delete"
        );
    }

    #[test]
    fn deletion_steps_stop_at_the_first_not_done() {
        use DeletionStep::*;
        let n = || "n1".to_string();
        let mut cases: Vec<(DeletionFacts, DeletionStep)> = vec![];
        cases.push((
            DeletionFacts {
                phase: Some(MachinePhase::Running),
                ..terminating()
            },
            MarkTerminating,
        ));
        cases.push((
            DeletionFacts {
                pre_drain_hooks: vec!["pre-drain.delete.hook.berth.dev/backup".into()],
                node: Some(node(true, false)),
                ..terminating()
            },
            WaitPreDrainHooks(vec!["pre-drain.delete.hook.berth.dev/backup".into()]),
        ));
        cases.push((
            DeletionFacts {
                node: Some(node(true, false)),
                pods_to_drain: vec!["a/p".into()],
                ..terminating()
            },
            Cordon { node: n() },
        ));
        cases.push((
            DeletionFacts {
                pods_to_drain: vec!["a/p".into()],
                volume_attachments: vec!["csi-1".into()],
                ..terminating()
            },
            Drain {
                node: n(),
                pods: vec!["a/p".into()],
            },
        ));
        cases.push((
            DeletionFacts {
                volume_attachments: vec!["csi-1".into()],
                pre_terminate_hooks: vec!["pre-terminate.delete.hook.berth.dev/x".into()],
                ..terminating()
            },
            WaitVolumesDetached {
                node: n(),
                attachments: vec!["csi-1".into()],
            },
        ));
        cases.push((
            DeletionFacts {
                pre_terminate_hooks: vec!["pre-terminate.delete.hook.berth.dev/x".into()],
                ..terminating()
            },
            WaitPreTerminateHooks(vec!["pre-terminate.delete.hook.berth.dev/x".into()]),
        ));
        cases.push((terminating(), DeleteVmAndNode { node: Some(n()) }));
        cases.push((
            DeletionFacts {
                volume_attachments: vec!["csi-1".into()],
                volume_detach_timed_out: true,
                ..terminating()
            },
            DeleteVmAndNode { node: Some(n()) },
        ));
        // A Node that never registered (or is already gone): no drain.
        cases.push((
            DeletionFacts {
                node: None,
                pods_to_drain: vec![],
                ..terminating()
            },
            DeleteVmAndNode { node: None },
        ));
        for (facts, want) in cases {
            assert_eq!(next_deletion_step(&facts), want, "{facts:?}");
        }
    }

    #[test]
    fn forced_deletion_skips_hooks_cordon_and_drain() {
        let f = DeletionFacts {
            force: true,
            node: Some(node(true, false)),
            pre_drain_hooks: vec!["pre-drain.delete.hook.berth.dev/x".into()],
            pods_to_drain: vec!["a/p".into()],
            pods_on_node: vec!["a/p".into(), "a/ds".into()],
            ..terminating()
        };
        assert_eq!(
            next_deletion_step(&f),
            DeletionStep::ForceDeletePods {
                node: "n1".into(),
                pods: vec!["a/p".into(), "a/ds".into()]
            }
        );
        let f = DeletionFacts {
            pods_on_node: vec![],
            ..f
        };
        assert_eq!(
            next_deletion_step(&f),
            DeletionStep::DeleteVmAndNode {
                node: Some("n1".into())
            }
        );
    }

    #[test]
    fn hooks_are_selected_by_prefix_and_sorted() {
        let keys = [
            "pre-drain.delete.hook.berth.dev/z".to_string(),
            "other".to_string(),
            "pre-drain.delete.hook.berth.dev/a".to_string(),
        ];
        assert_eq!(
            hooks(&keys, crate::api::PRE_DRAIN_HOOK_PREFIX),
            vec![
                "pre-drain.delete.hook.berth.dev/a".to_string(),
                "pre-drain.delete.hook.berth.dev/z".to_string()
            ]
        );
    }

    #[test]
    fn node_facts_read_readiness_age_and_cordon() {
        let now = Timestamp::from_second(10_000).expect("valid");
        let since = now
            .checked_sub(SignedDuration::from_secs(90))
            .expect("valid");
        let mut n = Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                unschedulable: Some(true),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: "False".into(),
                    last_transition_time: Some(Time(since)),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        };
        let f = node_facts(&n, now);
        assert!(!f.ready);
        assert_eq!(f.ready_for, Duration::from_secs(90));
        assert!(
            !f.cordoned,
            "unschedulable without berth's taint is not our cordon"
        );
        if let Some(spec) = n.spec.as_mut() {
            spec.taints = Some(vec![Taint {
                key: CORDON_TAINT_KEY.into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            }]);
        }
        assert!(node_facts(&n, now).cordoned);
    }

    #[test]
    fn a_ready_node_takes_pods_only_without_the_taints_of_a_starting_node() {
        let node = |ready: &str, taints: &[(&str, &str)]| Node {
            spec: Some(NodeSpec {
                taints: Some(
                    taints
                        .iter()
                        .map(|(key, effect)| Taint {
                            key: (*key).into(),
                            effect: (*effect).into(),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: ready.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(node_takes_pods(&node("True", &[])));
        assert!(!node_takes_pods(&node("False", &[])));
        // Ready already, but the node lifecycle controller has not yet
        // taken off the taint the API server put on the new Node.
        let starting = node("True", &[("node.kubernetes.io/not-ready", "NoSchedule")]);
        assert!(node_ready(&starting));
        assert!(!node_takes_pods(&starting));
        for key in [
            "node.kubernetes.io/unreachable",
            "node.kubernetes.io/network-unavailable",
            "node.cloudprovider.kubernetes.io/uninitialized",
        ] {
            assert!(
                !node_takes_pods(&node("True", &[(key, "NoExecute")])),
                "{key}"
            );
        }
        // A node agent that has not started yet (a CSI driver's, a CNI's).
        for key in [
            "ebs.csi.aws.com/agent-not-ready",
            "node.cilium.io/agent-not-ready",
        ] {
            assert!(
                !node_takes_pods(&node("True", &[(key, "NoSchedule")])),
                "{key}"
            );
        }
        // Cordoned: the scheduler places nothing there.
        let mut cordoned = node("True", &[]);
        if let Some(s) = cordoned.spec.as_mut() {
            s.unschedulable = Some(true);
        }
        assert!(!node_takes_pods(&cordoned));
        // A preference, or another taint the pool's pods tolerate, is no
        // reason to wait.
        assert!(node_takes_pods(&node(
            "True",
            &[
                ("node.kubernetes.io/not-ready", "PreferNoSchedule"),
                ("dedicated", "NoSchedule"),
                ("berth.dev/rolling-out", "PreferNoSchedule"),
            ]
        )));
    }

    #[test]
    fn the_drain_gate_skips_mirror_daemonset_and_terminal_pods() {
        let pod = |annot: bool, ds: bool, phase: &str| Pod {
            metadata: ObjectMeta {
                annotations: annot
                    .then(|| [("kubernetes.io/config.mirror".to_string(), "x".to_string())].into()),
                owner_references: ds.then(|| {
                    vec![OwnerReference {
                        kind: "DaemonSet".into(),
                        controller: Some(true),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            },
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            drain_skip_reason(&pod(true, false, "Running"), &RuleBook::default()),
            Some("mirror pod")
        );
        assert_eq!(
            drain_skip_reason(&pod(false, true, "Running"), &RuleBook::default()),
            Some("DaemonSet pod")
        );
        assert_eq!(
            drain_skip_reason(&pod(false, false, "Succeeded"), &RuleBook::default()),
            Some("terminal pod")
        );
        assert_eq!(
            drain_skip_reason(&pod(false, false, "Failed"), &RuleBook::default()),
            Some("terminal pod")
        );
        assert_eq!(
            drain_skip_reason(&pod(false, false, "Running"), &RuleBook::default()),
            None
        );
        assert_eq!(
            drain_skip_reason(&pod(false, false, "Pending"), &RuleBook::default()),
            None
        );
    }

    #[test]
    fn a_pending_drain_holds_the_deletion_even_without_pods() {
        let mut f = terminating();
        f.drain_pending = true;
        assert!(matches!(next_deletion_step(&f), DeletionStep::Drain { .. }));
        f.drain_pending = false;
        assert!(matches!(
            next_deletion_step(&f),
            DeletionStep::DeleteVmAndNode { .. }
        ));
    }

    #[test]
    fn a_vm_not_found_is_gone_only_once_that_lasted_the_grace() {
        let grace = Duration::from_secs(180);
        assert_eq!(
            ask_again_for_vm(Duration::ZERO, grace),
            Some(NOT_FOUND_ASK_EVERY)
        );
        assert_eq!(
            ask_again_for_vm(Duration::from_secs(175), grace),
            Some(Duration::from_secs(5))
        );
        assert_eq!(ask_again_for_vm(grace, grace), None);
        assert_eq!(ask_again_for_vm(Duration::ZERO, Duration::ZERO), None);
    }

    #[test]
    fn a_vm_that_stays_deleting_is_asked_about_less_and_less_often() {
        let five = Duration::from_secs(5);
        assert_eq!(ask_again_in(five, Duration::from_secs(20)), five);
        assert_eq!(ask_again_in(five, 10 * MIN), MIN);
        assert_eq!(ask_again_in(five, 300 * MIN), DELETING_ASK_AT_MOST);
        assert_eq!(
            ask_again_in(10 * MIN, MIN),
            10 * MIN,
            "as the provider asks"
        );
    }

    #[test]
    fn a_deletion_that_cannot_tell_whose_the_vm_is_only_marks_and_waits_for_hooks() {
        let n = || "n".to_string();
        for step in [
            DeletionStep::MarkTerminating,
            DeletionStep::WaitPreDrainHooks(vec!["h".into()]),
            DeletionStep::WaitPreTerminateHooks(vec!["h".into()]),
        ] {
            assert!(!step.touches_node_or_vm(), "{step:?}");
        }
        for step in [
            DeletionStep::Cordon { node: n() },
            DeletionStep::ForceDeletePods {
                node: n(),
                pods: vec![],
            },
            DeletionStep::Drain {
                node: n(),
                pods: vec![],
            },
            DeletionStep::WaitVolumesDetached {
                node: n(),
                attachments: vec![],
            },
            DeletionStep::DeleteVmAndNode { node: None },
        ] {
            assert!(step.touches_node_or_vm(), "{step:?}");
        }
    }
}
