//! The drain plan: every pod on a Node, what happens to it and in what order,
//! computed from cached objects in one pure function, `plan`. The drain
//! engine executes it and `berth plan` prints it ([`DrainPlan`]'s `Display`,
//! in `crate::cli::print`; a volume and its wait in words, in
//! `drain::describe`).
//!
//! How the plan is made:
//!
//! - Only pods whose `spec.nodeName` is the Node are considered; each is
//!   classified by [`classify_as`] (with the cluster's DrainRules).
//! - Evictable pods with at least one persistent volume
//!   ([`VolumeIndex::pod_volumes`]) are **stateful**, the others
//!   **stateless**.
//! - Every evictable pod, and every pod a drain rule says to wait on, has
//!   an **order group** ([`crate::drain::rules`]: 0, 1000 for critical
//!   pods, or its `berth.dev/drain-order`). Groups go lowest first; the
//!   engine works on one at a time (`DrainPlan::current_group`), and a
//!   group starts once the pods of the groups before it are gone and their
//!   volumes have moved. Pods a drain rule skips are listed with the
//!   DaemonSet pods; their volumes, and those of pods waited on to
//!   complete, stay attached until then.
//! - Stateless pods are listed by (order, namespace, name); they are
//!   evicted concurrently within their group, so the order only makes the
//!   plan deterministic.
//! - Stateful pods are ordered by group, then by `by_priority`:
//!   `spec.priority` highest first (missing = 0), ties by (namespace, name)
//!   ascending, compared byte-wise. The order is total, so the same pods
//!   always give the same plan. A pod held by `nodeLocalVolumes: Block` (it
//!   uses a node-local volume and no annotation allows losing it) goes after
//!   all the others of its group, so that waiting for an operator holds up
//!   no other pod of it.
//! - Each volume of a stateful pod has a kind ([`crate::drain::volume_kind`]):
//!   attachable volumes are waited on as below; an attach-free volume waits
//!   for the pod that uses its claim next to be Running and Ready
//!   elsewhere; a node-local volume is waited on for nothing (its data is
//!   lost with the VM). Scratch (`emptyDir`) volumes are listed per pod.
//! - A PV is waited on (detach, then reattach) by its **last user** in that
//!   order only. An earlier user is evicted and waited for until gone; the
//!   last user waits, before the detach, for every other user to be gone,
//!   including pods that were already terminating. A PV that a DaemonSet pod
//!   on the Node also uses stays attached until the VM ends, so nobody waits
//!   for it to detach. An ephemeral volume's claim dies with its pod, so it
//!   is waited on to detach but never to reattach.
//! - Each evictable pod lists the PDBs that cover it
//!   ([`findings_for`]).
//! - Before the first stateful eviction the drain waits for the pods that
//!   were already terminating and use volumes
//!   (`DrainPlan::terminating_with_volumes`), then for the volumes still
//!   attached to the Node that no pod on it uses any more
//!   (`detaching_volumes`: pods that left earlier, perhaps before a
//!   controller restart).
//! - The critical path is the stateful pods in order with the bound of each
//!   wait ([`StepBounds`]); its sum is the worst case of the sequence. It
//!   does not count time spent retrying evictions a PDB refuses, and it is an
//!   upper bound when `maxParallelVolumeMigrations` is above 1.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::jiff::Timestamp;

use crate::api::settings::{NodeLocalVolumes, ResolvedSettings};
use crate::drain::cluster_rules::RuleBook;
use crate::drain::deadline::{
    StepBounds, detach_bound, grace_period, pod_gone_bound, reattach_bound,
};
use crate::drain::pdb::{PdbFinding, findings_for};
use crate::drain::rules;
use crate::drain::select::{NamespacedName, PodClass, classify_as, finished, fmt_key, pod_key};
use crate::drain::volume::{VolumeIndex, VolumeRef, attached_nodes, inline_pv_of, is_inline};
use crate::drain::volume_kind::{
    Classified, VolumeContext, VolumeKind, allows_data_loss, scratch_volumes,
};
use crate::volumes::{pv_of, unique_name_of};

/// A pod the drain does not evict: skipped, or deleted outright.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassifiedPod {
    pub pod: NamespacedName,
    pub uid: Option<String>,
    /// Its class; its `Display` is the reason.
    pub class: PodClass,
}

/// A pod that was already being deleted; the drain waits for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TerminatingPod {
    pub pod: NamespacedName,
    pub uid: Option<String>,
    pub since: Timestamp,
    /// Its own grace period: a pod that cannot go holds the drain until the
    /// deadline plus this.
    pub grace: Duration,
    /// The PVs it uses; their last evicted user waits for this pod first.
    /// None for a finished pod, which no longer uses them.
    pub pvs: Vec<String>,
    /// Its order group ([`crate::drain::rules`]): a later group waits for
    /// it to be gone.
    pub order: i32,
}

/// A volume attached to the Node that no pod on it uses any more: its pod
/// left (perhaps before a controller restart) and it is still detaching.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DetachingVolume {
    pub pv: String,
    /// Its unique name, as `node.status.volumesAttached` lists it.
    pub unique_name: Option<String>,
}

/// What the drain waits for about one volume of a stateful pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeWait {
    /// The pod is the last user of the volume on the Node: once it is gone,
    /// wait for the pods in `gone_first` (earlier users and pods that were
    /// already terminating) to be gone too, then for the volume to detach,
    /// then, when `reattach`, for it to attach to another Node.
    Detach {
        gone_first: Vec<NamespacedName>,
        reattach: bool,
    },
    /// A pod later in the order also uses the volume and waits for it.
    LeftTo { last_user: NamespacedName },
    /// DaemonSet pods on the Node use the volume too; it stays attached
    /// until the VM ends, so no detach is waited for.
    StaysAttached { pinned_by: Vec<NamespacedName> },
    /// An attach-free volume: no detach or attach to wait for; the pod
    /// that uses the claim next must be Running and Ready on another Node.
    ReplacementReady,
    /// An attach-free volume of an ephemeral claim, which dies with its
    /// pod: nothing to wait for.
    DiesWithPod,
    /// A node-local volume: its data stays on this Node and is lost with
    /// the VM; nothing can be waited for.
    DataLost,
}

impl VolumeWait {
    /// Whether this pod waits for the volume to detach.
    pub(crate) fn waits_for_detach(&self) -> bool {
        matches!(self, Self::Detach { .. })
    }

    /// Whether this pod waits for the volume to be used elsewhere: attached
    /// where its replacement runs, or, attach-free, its replacement Running
    /// and Ready.
    pub(crate) fn waits_for_reattach(&self) -> bool {
        matches!(
            self,
            Self::Detach { reattach: true, .. } | Self::ReplacementReady
        )
    }
}

/// One persistent volume of a stateful pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedVolume {
    pub volume: VolumeRef,
    /// Its kind, which decides the wait, and why.
    pub kind: VolumeKind,
    pub kind_why: String,
    /// Nodes its VolumeAttachments say it is attached to now.
    pub attached_to: Vec<String>,
    pub wait: VolumeWait,
}

/// A pod the drain evicts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedPod {
    pub pod: NamespacedName,
    pub uid: Option<String>,
    /// `spec.priority`, 0 when unset.
    pub priority: i32,
    /// Its order group ([`crate::drain::rules`]), and where that comes
    /// from when not the default.
    pub order: i32,
    pub order_source: Option<String>,
    /// Termination grace period.
    pub grace: Duration,
    /// The bounds of its waits.
    pub bounds: StepBounds,
    /// Persistent volumes, in `spec.volumes` order; empty for a stateless pod.
    pub volumes: Vec<PlannedVolume>,
    /// PDBs that cover it.
    pub pdbs: Vec<PdbFinding>,
    /// Claims that gave no volume, and why.
    pub notes: Vec<String>,
    /// Its `emptyDir` volumes (scratch, lost with the pod).
    pub scratch: Vec<String>,
    /// Why the drain does not evict it yet (`nodeLocalVolumes: Block` and
    /// a node-local volume), saying how to let it go.
    pub held: Option<String>,
    /// What set its drain behaviour, when not the default
    /// (`berth.dev/drain=wait-completed`, `DrainRule <name>`; see
    /// [`crate::drain::rules::Rule::behavior_source`]).
    pub rule: Option<String>,
    /// Its controller (`Kind/name` of the ownerReference with
    /// `controller: true`), which is expected to replace it.
    pub controller: Option<String>,
    /// The terms for its moves of the DrainRule that picks it, if it sets
    /// any (under its own and its workload's annotations).
    pub rule_terms: Option<rules::RuleTerms>,
}

/// The `Kind/name` of a pod's controlling owner, if it has one.
pub(crate) fn controller_of(pod: &Pod) -> Option<String> {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| format!("{}/{}", o.kind, o.name))
}

impl PlannedPod {
    /// What set its drain behaviour, for words: its source, or the
    /// annotation a pod waited on without one was planned by.
    pub fn rule_words(&self) -> String {
        self.rule
            .clone()
            .unwrap_or_else(|| format!("{}=wait-completed", rules::DRAIN_ANNOTATION))
    }

    /// The PVs whose data moves with it (attachable or attach-free, not a
    /// generic ephemeral volume's): those a destination for its
    /// replacement must take (see [`crate::placement`]).
    pub(crate) fn moving_pvs(&self) -> Vec<String> {
        self.volumes
            .iter()
            .filter(|v| {
                !v.volume.ephemeral
                    && matches!(v.kind, VolumeKind::Attachable | VolumeKind::AttachFree)
            })
            .map(|v| v.volume.pv.clone())
            .collect()
    }

    /// Its node-local PVs, whose data is lost with the VM.
    pub(crate) fn node_local(&self) -> Vec<&str> {
        self.volumes
            .iter()
            .filter(|v| v.kind == VolumeKind::NodeLocal)
            .map(|v| v.volume.pv.as_str())
            .collect()
    }
}

/// The order of stateful pods: priority highest first, then (namespace,
/// name) ascending.
pub(crate) fn by_priority(a: &PlannedPod, b: &PlannedPod) -> Ordering {
    (Reverse(a.priority), &a.pod).cmp(&(Reverse(b.priority), &b.pod))
}

/// Everything the drain of one Node will do; see the module documentation.
#[derive(Debug, Clone, PartialEq)]
pub struct DrainPlan {
    pub node: String,
    pub settings: ResolvedSettings,
    /// Mirror and DaemonSet pods, and pods a drain rule skips, by
    /// (namespace, name).
    pub skipped: Vec<ClassifiedPod>,
    /// Terminal pods, deleted outright, by (namespace, name).
    pub to_delete: Vec<ClassifiedPod>,
    /// Pods already being deleted, by (namespace, name).
    pub terminating: Vec<TerminatingPod>,
    /// Pods without persistent volumes, by (order, namespace, name).
    pub stateless: Vec<PlannedPod>,
    /// Pods with persistent volumes, in eviction order (order group first).
    pub stateful: Vec<PlannedPod>,
    /// Pods a drain rule says to wait on until they complete, never
    /// evicted, by (order, namespace, name). Their volumes stay attached
    /// until then (as a DaemonSet pod's).
    pub waiting: Vec<PlannedPod>,
    /// Drain rule annotations not understood (the default was used), by
    /// pod.
    pub rule_problems: Vec<(NamespacedName, String)>,
    /// Volumes still detaching from pods that left, by PV name; waited for
    /// before the first stateful eviction.
    pub detaching: Vec<DetachingVolume>,
}

/// One order group of a plan, for its report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OrderGroup {
    pub(crate) order: i32,
    pub(crate) stateless: usize,
    pub(crate) stateful: usize,
    pub(crate) waiting: usize,
    /// Where the order of its pods comes from, when not the default.
    pub(crate) why: BTreeSet<String>,
}

/// One stateful pod on the critical path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CriticalStep {
    pub(crate) pod: NamespacedName,
    pub(crate) bounds: StepBounds,
}

/// The stateful pods in sequence with the bounds of their waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CriticalPath {
    pub(crate) steps: Vec<CriticalStep>,
    /// The sum of every bound.
    pub(crate) worst_case: Duration,
}

impl DrainPlan {
    /// The stateful pods in the order they are evicted.
    pub fn stateful_order(&self) -> Vec<NamespacedName> {
        self.stateful.iter().map(|p| p.pod.clone()).collect()
    }

    /// The pods already terminating that use volumes, by (namespace,
    /// name): the drain waits for each to be gone before the first
    /// stateful eviction, since their volumes must leave the Node first.
    pub(crate) fn terminating_with_volumes(&self) -> impl Iterator<Item = &TerminatingPod> {
        self.terminating.iter().filter(|t| !t.pvs.is_empty())
    }

    /// The pods `pod` waits for, once it is gone itself, before its volumes
    /// can detach: the `gone_first` of each volume it is the last user of,
    /// each pod once, in the order first named, with its UID (so that a
    /// replacement of the same name elsewhere does not count).
    pub(crate) fn gone_first(&self, pod: &PlannedPod) -> Vec<(NamespacedName, Option<String>)> {
        let mut seen = BTreeSet::new();
        pod.volumes
            .iter()
            .filter_map(|v| match &v.wait {
                VolumeWait::Detach { gone_first, .. } => Some(gone_first),
                _ => None,
            })
            .flatten()
            .filter(|k| seen.insert(*k))
            .map(|k| (k.clone(), self.uid_of(k)))
            .collect()
    }

    /// The UID of a pod the drain evicts or waits for.
    fn uid_of(&self, pod: &NamespacedName) -> Option<String> {
        let mut evicted = self.stateful.iter().chain(&self.stateless);
        evicted
            .find(|p| &p.pod == pod)
            .map(|p| p.uid.clone())
            .or_else(|| {
                let going = self.terminating.iter().find(|t| &t.pod == pod);
                going.map(|t| t.uid.clone())
            })
            .flatten()
    }

    /// The order group a pass works on now: the lowest order of a pod
    /// still to evict, to wait on to complete, or (when `holding` says it
    /// still holds the drain) still terminating. `None` when none is left.
    /// A later group starts only once this one is empty.
    pub(crate) fn current_group(&self, holding: impl Fn(&TerminatingPod) -> bool) -> Option<i32> {
        let evictable = self.stateless.iter().chain(&self.stateful);
        let planned = evictable.chain(&self.waiting).map(|p| p.order);
        let going = self.terminating.iter().filter(|t| holding(t));
        planned.chain(going.map(|t| t.order)).min()
    }

    /// This plan with only the pods of order group `order` to evict and to
    /// wait on to complete; the rest (pods terminating, finished, volumes
    /// detaching) as they are.
    pub(crate) fn only_group(&self, order: i32) -> DrainPlan {
        let keep = |ps: &[PlannedPod]| -> Vec<PlannedPod> {
            ps.iter().filter(|p| p.order == order).cloned().collect()
        };
        DrainPlan {
            stateless: keep(&self.stateless),
            stateful: keep(&self.stateful),
            waiting: keep(&self.waiting),
            ..self.clone()
        }
    }

    /// The order groups, lowest first, each with its pods (without
    /// volumes, with, waited on to complete) and why it has that order.
    pub(crate) fn groups(&self) -> Vec<OrderGroup> {
        let mut groups: BTreeMap<i32, OrderGroup> = BTreeMap::new();
        let all = [
            (&self.stateless, 0),
            (&self.stateful, 1),
            (&self.waiting, 2),
        ];
        for (pods, kind) in all {
            for p in pods {
                let g = groups.entry(p.order).or_insert_with(|| OrderGroup {
                    order: p.order,
                    stateless: 0,
                    stateful: 0,
                    waiting: 0,
                    why: BTreeSet::new(),
                });
                g.why.extend(p.order_source.iter().cloned());
                *match kind {
                    0 => &mut g.stateless,
                    1 => &mut g.stateful,
                    _ => &mut g.waiting,
                } += 1;
            }
        }
        groups.into_values().collect()
    }

    /// The stateful pods in sequence with their bounds and the worst case.
    pub(crate) fn critical_path(&self) -> CriticalPath {
        let steps: Vec<CriticalStep> = self
            .stateful
            .iter()
            .map(|p| CriticalStep {
                pod: p.pod.clone(),
                bounds: p.bounds,
            })
            .collect();
        let worst_case = steps.iter().fold(Duration::ZERO, |sum, s| {
            sum.saturating_add(s.bounds.total())
        });
        CriticalPath { steps, worst_case }
    }
}

/// Plans the drain of `node` from cached objects. `pods` may include pods of
/// other Nodes; only those whose `spec.nodeName` is `node` are planned.
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan(
    node: &str,
    pods: &[Pod],
    pvcs: &[PersistentVolumeClaim],
    pvs: &[PersistentVolume],
    pdbs: &[PodDisruptionBudget],
    vas: &[VolumeAttachment],
    volumes: &VolumeContext,
    settings: &ResolvedSettings,
    rules: &RuleBook,
) -> DrainPlan {
    let mut sorter = Sorter {
        index: VolumeIndex::new(pvcs, pvs),
        pdbs,
        volumes,
        settings,
        rules,
        out: DrainPlan {
            node: node.to_string(),
            settings: settings.clone(),
            skipped: Vec::new(),
            to_delete: Vec::new(),
            terminating: Vec::new(),
            stateless: Vec::new(),
            stateful: Vec::new(),
            waiting: Vec::new(),
            rule_problems: Vec::new(),
            detaching: detaching_volumes(node, pods, pvcs, pvs, vas),
        },
        pinned: BTreeMap::new(),
        already_going: BTreeMap::new(),
        stateful: Vec::new(),
    };
    let on_node = pods
        .iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node));
    for pod in on_node {
        sorter.add(pod);
    }
    sorter.finish(vas)
}

/// A stateful pod before its volumes' waits are known, with each volume's
/// kind.
type Unsequenced = (PlannedPod, Vec<(VolumeRef, Classified)>);

/// The pass of `plan` over a Node's pods: each pod into its list, and what
/// the stateful pods' volume waits are decided from.
struct Sorter<'a> {
    index: VolumeIndex<'a>,
    pdbs: &'a [PodDisruptionBudget],
    volumes: &'a VolumeContext,
    settings: &'a ResolvedSettings,
    /// The cluster's DrainRules that apply to this Machine.
    rules: &'a RuleBook,
    out: DrainPlan,
    /// Users of each PV that the evictions do not remove.
    pinned: BTreeMap<String, Vec<NamespacedName>>,
    /// Users of each PV that were terminating before the drain.
    already_going: BTreeMap<String, Vec<NamespacedName>>,
    stateful: Vec<Unsequenced>,
}

impl Sorter<'_> {
    fn add(&mut self, pod: &Pod) {
        let key = pod_key(pod);
        let uid = pod.metadata.uid.clone();
        let drain_rule = rules::rule_in(pod, self.rules.matched(pod).as_ref());
        let class = classify_as(pod, &drain_rule);
        if !matches!(class, PodClass::Mirror | PodClass::DaemonSet { .. }) {
            for problem in &drain_rule.problems {
                self.out.rule_problems.push((key.clone(), problem.clone()));
            }
        }
        match class {
            class @ (PodClass::Mirror | PodClass::DaemonSet { .. } | PodClass::Skipped { .. }) => {
                for v in self.index.pod_volumes(pod).refs {
                    self.pinned.entry(v.pv).or_default().push(key.clone());
                }
                self.out.skipped.push(ClassifiedPod {
                    pod: key,
                    uid,
                    class,
                });
            }
            class @ PodClass::Terminal { .. } => self.out.to_delete.push(ClassifiedPod {
                pod: key,
                uid,
                class,
            }),
            PodClass::Terminating { since } => {
                let pvs: Vec<String> = if finished(pod) {
                    Vec::new()
                } else {
                    let refs = self.index.pod_volumes(pod).refs;
                    refs.into_iter().map(|v| v.pv).collect()
                };
                for pv in &pvs {
                    let going = self.already_going.entry(pv.clone()).or_default();
                    going.push(key.clone());
                }
                self.out.terminating.push(TerminatingPod {
                    pod: key,
                    uid,
                    since,
                    grace: grace_period(pod),
                    pvs,
                    order: drain_rule.order,
                });
            }
            PodClass::WaitCompleted { .. } | PodClass::Evictable => {
                let wait = class != PodClass::Evictable;
                self.add_evictable(pod, key, uid, &drain_rule, wait);
            }
        }
    }

    /// A pod to evict, or (`wait_completed`) to wait on to complete.
    fn add_evictable(
        &mut self,
        pod: &Pod,
        key: NamespacedName,
        uid: Option<String>,
        drain_rule: &rules::Rule,
        wait_completed: bool,
    ) {
        let pod_volumes = self.index.pod_volumes(pod);
        let grace = grace_period(pod);
        let mut planned = PlannedPod {
            pod: key,
            uid,
            priority: pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
            order: drain_rule.order,
            order_source: drain_rule.order_source(),
            grace,
            bounds: StepBounds {
                pod_gone: pod_gone_bound(grace),
                detach: None,
                reattach: None,
            },
            volumes: Vec::new(),
            pdbs: findings_for(pod, self.pdbs),
            notes: pod_volumes.notes,
            scratch: scratch_volumes(pod),
            held: None,
            rule: drain_rule.behavior_source.clone(),
            controller: controller_of(pod),
            rule_terms: drain_rule.terms.clone(),
        };
        if wait_completed {
            // Its volumes stay attached until it completes: nobody waits
            // for them to detach before then.
            for v in pod_volumes.refs {
                self.pinned
                    .entry(v.pv)
                    .or_default()
                    .push(planned.pod.clone());
            }
            self.out.waiting.push(planned);
        } else if pod_volumes.refs.is_empty() {
            self.out.stateless.push(planned);
        } else {
            let refs: Vec<(VolumeRef, Classified)> = pod_volumes
                .refs
                .into_iter()
                .map(|v| {
                    let c = self.kind_of(pod, &v);
                    (v, c)
                })
                .collect();
            planned.held = hold(pod, &refs, self.volumes, self.settings);
            self.stateful.push((planned, refs));
        }
    }

    fn kind_of(&self, pod: &Pod, v: &VolumeRef) -> Classified {
        let inline = is_inline(&v.pv).then(|| inline_pv_of(pod, &v.pv)).flatten();
        match inline.as_ref().or_else(|| self.index.pv(&v.pv)) {
            Some(pv) if inline.is_some() => {
                let c = self.volumes.classify(pv);
                Classified {
                    kind: c.kind,
                    why: format!("inline volume of the pod, {}", c.why),
                }
            }
            Some(pv) => self.volumes.classify(pv),
            None => Classified {
                kind: VolumeKind::Attachable,
                why: "PV not found".into(),
            },
        }
    }

    /// The lists in their order, and each stateful pod's volumes with
    /// their waits and its bounds.
    fn finish(mut self, vas: &[VolumeAttachment]) -> DrainPlan {
        let out = &mut self.out;
        out.skipped.sort_by(|a, b| a.pod.cmp(&b.pod));
        out.to_delete.sort_by(|a, b| a.pod.cmp(&b.pod));
        out.terminating.sort_by(|a, b| a.pod.cmp(&b.pod));
        out.stateless
            .sort_by(|a, b| (a.order, &a.pod).cmp(&(b.order, &b.pod)));
        out.waiting
            .sort_by(|a, b| (a.order, &a.pod).cmp(&(b.order, &b.pod)));
        // Order groups first. Within one, a pod `nodeLocalVolumes: Block`
        // holds waits for an operator: it goes last, so that it holds up no
        // other pod of its group.
        self.stateful.sort_by(|(a, _), (b, _)| {
            a.order
                .cmp(&b.order)
                .then_with(|| a.held.is_some().cmp(&b.held.is_some()))
                .then_with(|| by_priority(a, b))
        });
        let waits = self.volume_waits();
        for ((mut p, refs), waits) in self.stateful.into_iter().zip(waits) {
            p.volumes = refs
                .into_iter()
                .zip(waits)
                .map(|((volume, kind), wait)| PlannedVolume {
                    attached_to: attached_nodes(&volume.pv, vas),
                    volume,
                    kind: kind.kind,
                    kind_why: kind.why,
                    wait,
                })
                .collect();
            if p.volumes.iter().any(|v| v.wait.waits_for_detach()) {
                p.bounds.detach = Some(detach_bound(p.grace, self.settings));
            }
            if p.volumes.iter().any(|v| v.wait.waits_for_reattach()) {
                p.bounds.reattach = Some(reattach_bound(self.settings));
            }
            self.out.stateful.push(p);
        }
        self.out
    }

    /// What each volume of each stateful pod (in eviction order) is waited
    /// on for.
    fn volume_waits(&self) -> Vec<Vec<VolumeWait>> {
        // The evicted users of each PV, in eviction order.
        let mut users: BTreeMap<&str, Vec<NamespacedName>> = BTreeMap::new();
        for (p, refs) in &self.stateful {
            for (v, c) in refs {
                if c.kind == VolumeKind::Attachable {
                    users.entry(&v.pv).or_default().push(p.pod.clone());
                }
            }
        }
        self.stateful
            .iter()
            .map(|(p, refs)| {
                refs.iter()
                    .map(|(v, c)| match c.kind {
                        VolumeKind::Attachable => {
                            volume_wait(&p.pod, v, &users, &self.pinned, &self.already_going)
                        }
                        VolumeKind::AttachFree if v.ephemeral => VolumeWait::DiesWithPod,
                        VolumeKind::AttachFree => VolumeWait::ReplacementReady,
                        VolumeKind::NodeLocal | VolumeKind::Scratch => VolumeWait::DataLost,
                    })
                    .collect()
            })
            .collect()
    }
}

/// Why `nodeLocalVolumes: Block` holds `pod`, if it does: it uses
/// node-local volumes and neither it nor the Machine allows losing them.
fn hold(
    pod: &Pod,
    volumes: &[(VolumeRef, Classified)],
    ctx: &VolumeContext,
    settings: &ResolvedSettings,
) -> Option<String> {
    let local: Vec<&str> = volumes
        .iter()
        .filter(|(_, c)| c.kind == VolumeKind::NodeLocal)
        .map(|(v, _)| v.pv.as_str())
        .collect();
    if local.is_empty()
        || settings.node_local_volumes != NodeLocalVolumes::Block
        || ctx.data_loss_allowed
        || allows_data_loss(pod.metadata.annotations.as_ref())
    {
        return None;
    }
    let key = fmt_key(&pod_key(pod));
    let annotation = crate::api::ALLOW_NODE_LOCAL_DATA_LOSS;
    Some(format!(
        "pod {key} uses node-local PV {}, whose data is lost with the VM; nodeLocalVolumes is Block, so it is not evicted until the pod or the Machine is annotated {annotation}=true (kubectl annotate pod -n {} {} {annotation}=true), or the drain deadline passes",
        local.join(", "),
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default(),
    ))
}

/// The volumes attached to `node` (a VolumeAttachment names the Node) that
/// no pod on it uses (`pods` may include pods of other Nodes), each once,
/// by PV name, with their unique names when `pvs` has them.
pub(crate) fn detaching_volumes(
    node: &str,
    pods: &[Pod],
    pvcs: &[PersistentVolumeClaim],
    pvs: &[PersistentVolume],
    vas: &[VolumeAttachment],
) -> Vec<DetachingVolume> {
    let index = VolumeIndex::new(pvcs, pvs);
    let in_use: BTreeSet<String> = pods
        .iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .flat_map(|p| index.pod_volumes(p).refs.into_iter().map(|v| v.pv))
        .collect();
    let by_name: BTreeMap<&str, &PersistentVolume> = pvs
        .iter()
        .filter_map(|pv| pv.metadata.name.as_deref().map(|n| (n, pv)))
        .collect();
    let left: BTreeSet<&str> = vas
        .iter()
        .filter(|va| va.spec.node_name == node)
        .filter_map(pv_of)
        .filter(|pv| !in_use.contains(*pv))
        .collect();
    left.into_iter()
        .map(|pv| DetachingVolume {
            pv: pv.to_string(),
            unique_name: by_name.get(pv).and_then(|p| unique_name_of(p)),
        })
        .collect()
}

/// The detaching volumes still to wait for: those whose detach wait has not
/// already timed out in this drain (`abandoned`, warned about once; the
/// reconciler's own volume step still guards the VM).
pub(crate) fn still_to_wait_for(
    detaching: &[DetachingVolume],
    abandoned: &BTreeSet<String>,
) -> Vec<DetachingVolume> {
    detaching
        .iter()
        .filter(|v| !abandoned.contains(&v.pv))
        .cloned()
        .collect()
}

/// The wait of `pod` on `volume`, given every user of each PV: evicted
/// users in order, pinned (DaemonSet) users and already terminating users.
fn volume_wait(
    pod: &NamespacedName,
    volume: &VolumeRef,
    users: &BTreeMap<&str, Vec<NamespacedName>>,
    pinned: &BTreeMap<String, Vec<NamespacedName>>,
    already_going: &BTreeMap<String, Vec<NamespacedName>>,
) -> VolumeWait {
    if let Some(pinned_by) = pinned.get(&volume.pv) {
        return VolumeWait::StaysAttached {
            pinned_by: pinned_by.clone(),
        };
    }
    let evicted = users.get(volume.pv.as_str()).map_or(&[][..], Vec::as_slice);
    match evicted.last() {
        Some(last) if last != pod => VolumeWait::LeftTo {
            last_user: last.clone(),
        },
        _ => {
            let mut gone_first: Vec<NamespacedName> =
                evicted.iter().filter(|u| *u != pod).cloned().collect();
            gone_first.extend(already_going.get(&volume.pv).into_iter().flatten().cloned());
            VolumeWait::Detach {
                gone_first,
                reattach: !volume.ephemeral,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::fixtures::planned;
    use crate::drain::fixtures::{
        NODE, PodFixture, bare_pv, csi_pv, ephemeral_pvc, host_pv, match_labels, pdb, pod, pvc, ts,
        va,
    };
    use crate::drain::pdb::PdbVerdict;

    fn ctx() -> VolumeContext {
        VolumeContext::new(NODE, None, &[])
    }

    fn key(ns: &str, name: &str) -> NamespacedName {
        (ns.to_string(), name.to_string())
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn plan_of(
        pods: &[Pod],
        pvcs: &[PersistentVolumeClaim],
        pvs: &[PersistentVolume],
    ) -> DrainPlan {
        plan(
            NODE,
            pods,
            pvcs,
            pvs,
            &[],
            &[],
            &ctx(),
            &ResolvedSettings::default(),
            &RuleBook::default(),
        )
    }

    #[test]
    fn priority_order_is_total() {
        use Ordering::{Equal, Greater, Less};
        let cases = [
            (planned(10, "a", "x"), planned(0, "a", "x"), Less),
            (planned(0, "a", "x"), planned(10, "a", "x"), Greater),
            (planned(-5, "a", "x"), planned(0, "a", "x"), Greater),
            (planned(5, "a", "y"), planned(5, "b", "x"), Less),
            (planned(5, "b", "a"), planned(5, "a", "z"), Greater),
            (planned(5, "a", "pg-10"), planned(5, "a", "pg-2"), Less),
            (planned(5, "a", "x"), planned(5, "a", "x"), Equal),
        ];
        for (a, b, want) in cases {
            assert_eq!(by_priority(&a, &b), want, "{:?} vs {:?}", a.pod, b.pod);
        }
    }

    #[test]
    fn every_pod_lands_in_one_group() {
        let pods = [
            pod("kube-system", "etcd").mirror(),
            pod("kube-system", "fluentd-x").owned_by("DaemonSet", "fluentd", true),
            pod("batch", "job-1").phase("Succeeded"),
            pod("batch", "job-0").phase("Failed"),
            pod("db", "old-0").deleting(ts(10)).claim("d", "data-old"),
            pod("web", "b"),
            pod("web", "a").claim("d", "unbound"),
            pod("db", "pg-0").claim("d", "data-pg-0"),
            pod("web", "elsewhere").on_node(Some("node-2")),
            pod("web", "pending").on_node(None),
        ];
        let pvcs = [
            pvc("db", "data-old", Some("pv-old")),
            pvc("web", "unbound", None),
            pvc("db", "data-pg-0", Some("pv-pg-0")),
        ];
        let pvs = [host_pv("pv-old"), csi_pv("pv-pg-0", "d.csi", "h0")];
        let p = plan_of(&pods, &pvcs, &pvs);

        let keys = |v: &[ClassifiedPod]| v.iter().map(|p| p.pod.clone()).collect::<Vec<_>>();
        assert_eq!(
            keys(&p.skipped),
            vec![key("kube-system", "etcd"), key("kube-system", "fluentd-x")]
        );
        assert_eq!(p.skipped[0].class, PodClass::Mirror);
        assert_eq!(
            keys(&p.to_delete),
            vec![key("batch", "job-0"), key("batch", "job-1")]
        );
        assert_eq!(p.to_delete[0].uid.as_deref(), Some("uid-job-0"));
        assert_eq!(
            p.terminating,
            vec![TerminatingPod {
                pod: key("db", "old-0"),
                uid: Some("uid-old-0".into()),
                since: ts(10),
                grace: secs(30),
                pvs: vec!["pv-old".into()],
                order: 0,
            }]
        );
        assert_eq!(
            p.stateless
                .iter()
                .map(|p| p.pod.clone())
                .collect::<Vec<_>>(),
            vec![key("web", "a"), key("web", "b")]
        );
        assert_eq!(p.stateless[0].notes.len(), 1);
        assert!(p.stateless[0].notes[0].contains("claim web/unbound (volume d) is not bound"));
        assert_eq!(p.stateless[0].bounds.total(), secs(60));
        assert_eq!(p.stateful_order(), vec![key("db", "pg-0")]);
    }

    #[test]
    fn a_finished_pod_being_deleted_is_waited_on_and_frees_its_volumes() {
        let pods = [pod("batch", "job-0")
            .phase("Succeeded")
            .grace(5)
            .deleting(ts(10))
            .claim("d", "data")];
        let pvcs = [pvc("batch", "data", Some("pv-d"))];
        let pvs = [csi_pv("pv-d", "d.csi", "h")];
        let p = plan_of(&pods, &pvcs, &pvs);
        assert!(p.to_delete.is_empty(), "not deleted again");
        assert_eq!(
            p.terminating
                .iter()
                .map(|t| (t.pod.clone(), t.grace, t.pvs.len()))
                .collect::<Vec<_>>(),
            vec![(key("batch", "job-0"), secs(5), 0)],
            "it no longer uses its volume"
        );
    }

    #[test]
    fn stateful_pods_by_priority_then_name() {
        let pods = [
            pod("b", "low").priority(1).claim("d", "c1"),
            pod("a", "unset").claim("d", "c2"),
            pod("z", "high").priority(1000).claim("d", "c3"),
            pod("a", "tie-2").priority(50).claim("d", "c4"),
            pod("b", "tie-1").priority(50).claim("d", "c5"),
            pod("a", "tie-1").priority(50).claim("d", "c6"),
            pod("a", "negative").priority(-10).claim("d", "c7"),
        ];
        let mut pvcs = Vec::new();
        let mut pvs = Vec::new();
        for (i, ns) in ["b", "a", "z", "a", "b", "a", "a"].iter().enumerate() {
            let n = i + 1;
            pvcs.push(pvc(ns, &format!("c{n}"), Some(&format!("pv-{n}"))));
            pvs.push(csi_pv(&format!("pv-{n}"), "d.csi", &format!("h{n}")));
        }
        let p = plan_of(&pods, &pvcs, &pvs);
        assert_eq!(
            p.stateful_order(),
            vec![
                key("z", "high"),
                key("a", "tie-1"),
                key("a", "tie-2"),
                key("b", "tie-1"),
                key("b", "low"),
                key("a", "unset"),
                key("a", "negative"),
            ]
        );
        assert_eq!(
            p.stateful.iter().map(|p| p.priority).collect::<Vec<_>>(),
            vec![1000, 50, 50, 50, 1, 0, -10]
        );
        // Every pod is the only user of its PV, so each waits for both.
        for sp in &p.stateful {
            assert_eq!(sp.volumes.len(), 1);
            assert_eq!(
                sp.volumes[0].wait,
                VolumeWait::Detach {
                    gone_first: vec![],
                    reattach: true
                }
            );
            assert_eq!(
                sp.bounds,
                StepBounds {
                    pod_gone: secs(60),
                    detach: Some(secs(150)),
                    reattach: Some(secs(90)),
                }
            );
        }
    }

    #[test]
    fn stateless_pods_are_sorted_by_namespace_then_name() {
        let pods = [pod("b", "a"), pod("a", "z"), pod("a", "b").priority(100)];
        let p = plan_of(&pods, &[], &[]);
        assert_eq!(
            p.stateless
                .iter()
                .map(|p| p.pod.clone())
                .collect::<Vec<_>>(),
            vec![key("a", "b"), key("a", "z"), key("b", "a")]
        );
    }

    #[test]
    fn a_shared_pv_is_waited_on_by_its_last_user_only() {
        let pods = [
            pod("db", "reader").priority(10).claim("d", "shared"),
            pod("db", "writer")
                .priority(100)
                .claim("d", "shared")
                .claim("o", "own"),
            pod("db", "old").deleting(ts(5)).claim("d", "shared"),
            pod("db", "ds")
                .owned_by("DaemonSet", "backup", true)
                .claim("d", "pinned"),
            pod("db", "user").claim("d", "pinned"),
        ];
        let pvcs = [
            pvc("db", "shared", Some("pv-shared")),
            pvc("db", "own", Some("pv-own")),
            pvc("db", "pinned", Some("pv-pinned")),
        ];
        let pvs = [
            csi_pv("pv-shared", "d.csi", "s"),
            csi_pv("pv-own", "d.csi", "o"),
            bare_pv("pv-pinned"),
        ];
        let p = plan_of(&pods, &pvcs, &pvs);
        assert_eq!(
            p.stateful_order(),
            vec![key("db", "writer"), key("db", "reader"), key("db", "user")]
        );
        let waits = |i: usize| {
            p.stateful[i]
                .volumes
                .iter()
                .map(|v| (v.volume.pv.as_str(), v.wait.clone()))
                .collect::<Vec<_>>()
        };
        // (position, volumes and their waits, bounds)
        let cases = [
            (
                0,
                vec![
                    (
                        "pv-shared",
                        VolumeWait::LeftTo {
                            last_user: key("db", "reader"),
                        },
                    ),
                    (
                        "pv-own",
                        VolumeWait::Detach {
                            gone_first: vec![],
                            reattach: true,
                        },
                    ),
                ],
                (Some(secs(150)), Some(secs(90))),
            ),
            (
                1,
                vec![(
                    "pv-shared",
                    VolumeWait::Detach {
                        gone_first: vec![key("db", "writer"), key("db", "old")],
                        reattach: true,
                    },
                )],
                (Some(secs(150)), Some(secs(90))),
            ),
            (
                2,
                vec![(
                    "pv-pinned",
                    VolumeWait::StaysAttached {
                        pinned_by: vec![key("db", "ds")],
                    },
                )],
                (None, None),
            ),
        ];
        for (i, want, (detach, reattach)) in cases {
            assert_eq!(waits(i), want, "position {i}");
            assert_eq!(p.stateful[i].bounds.detach, detach, "position {i}");
            assert_eq!(p.stateful[i].bounds.reattach, reattach, "position {i}");
        }
    }

    #[test]
    fn shared_pv_order_follows_priority_not_input_order() {
        let pvcs = [pvc("db", "shared", Some("pv-s"))];
        let pvs = [csi_pv("pv-s", "d.csi", "s")];
        for (first, second) in [(5, 1), (1, 5)] {
            let pods = [
                pod("db", "a").priority(first).claim("d", "shared"),
                pod("db", "b").priority(second).claim("d", "shared"),
            ];
            let p = plan_of(&pods, &pvcs, &pvs);
            let (early, late) = if first > second {
                ("a", "b")
            } else {
                ("b", "a")
            };
            assert_eq!(p.stateful_order(), vec![key("db", early), key("db", late)]);
            assert_eq!(
                p.stateful[0].volumes[0].wait,
                VolumeWait::LeftTo {
                    last_user: key("db", late)
                }
            );
            assert!(!p.stateful[0].volumes[0].wait.waits_for_detach());
            assert_eq!(p.stateful[0].bounds.detach, None);
            assert_eq!(
                p.stateful[1].volumes[0].wait,
                VolumeWait::Detach {
                    gone_first: vec![key("db", early)],
                    reattach: true
                }
            );
        }
    }

    #[test]
    fn ephemeral_volumes_detach_but_never_reattach() {
        let pods = [pod("db", "pg-0").ephemeral("scratch").grace(60)];
        let pvcs = [ephemeral_pvc("db", "pg-0-scratch", "pv-e", "uid-pg-0")];
        let pvs = [csi_pv("pv-e", "d.csi", "e")];
        let p = plan_of(&pods, &pvcs, &pvs);
        let sp = &p.stateful[0];
        assert_eq!(
            sp.volumes[0].wait,
            VolumeWait::Detach {
                gone_first: vec![],
                reattach: false
            }
        );
        assert!(sp.volumes[0].wait.waits_for_detach());
        assert!(!sp.volumes[0].wait.waits_for_reattach());
        assert_eq!(
            sp.bounds,
            StepBounds {
                pod_gone: secs(90),
                detach: Some(secs(180)),
                reattach: None
            }
        );
    }

    #[test]
    fn volumes_carry_identities_and_attachments() {
        let pods = [pod("db", "pg-0").claim("d", "data").claim("l", "logs")];
        let pvcs = [
            pvc("db", "data", Some("pv-d")),
            pvc("db", "logs", Some("pv-l")),
        ];
        let pvs = [csi_pv("pv-d", "ebs.csi.aws.com", "vol-1"), host_pv("pv-l")];
        let vas = [
            va("pv-d", NODE, true),
            va("pv-d", "node-2", false),
            va("pv-other", NODE, true),
        ];
        let p = plan(
            NODE,
            &pods,
            &pvcs,
            &pvs,
            &[],
            &vas,
            &ctx(),
            &ResolvedSettings::default(),
            &RuleBook::default(),
        );
        let vols = &p.stateful[0].volumes;
        assert_eq!(
            vols[0].volume,
            VolumeRef {
                pv: "pv-d".into(),
                claim: key("db", "data"),
                unique_name: Some("kubernetes.io/csi/ebs.csi.aws.com^vol-1".into()),
                ephemeral: false,
            }
        );
        assert_eq!(vols[0].attached_to, vec![NODE.to_string()]);
        assert_eq!(vols[1].volume.unique_name, None);
        assert_eq!(vols[1].attached_to, Vec::<String>::new());
    }

    #[test]
    fn pdb_findings_are_attached_to_evictable_pods() {
        let pods = [
            pod("web", "a").labels(&[("app", "web")]),
            pod("db", "pg-0")
                .labels(&[("app", "pg")])
                .claim("d", "data"),
            pod("db", "done")
                .labels(&[("app", "pg")])
                .phase("Succeeded"),
        ];
        let pvcs = [pvc("db", "data", Some("pv-d"))];
        let pvs = [csi_pv("pv-d", "d.csi", "d")];
        let pdbs = [
            pdb(
                "web",
                "web",
                Some(match_labels(&[("app", "web")])),
                (1, 1, 2, 1, 0),
            ),
            pdb(
                "db",
                "pg",
                Some(match_labels(&[("app", "pg")])),
                (1, 1, 3, 3, 0),
            ),
        ];
        let p = plan(
            NODE,
            &pods,
            &pvcs,
            &pvs,
            &pdbs,
            &[],
            &ctx(),
            &ResolvedSettings::default(),
            &RuleBook::default(),
        );
        assert_eq!(p.stateless[0].pdbs.len(), 1);
        assert_eq!(p.stateless[0].pdbs[0].verdict, PdbVerdict::Blocking);
        assert_eq!(p.stateful[0].pdbs.len(), 1);
        assert_eq!(p.stateful[0].pdbs[0].verdict, PdbVerdict::Misconfigured);
        assert_eq!(p.to_delete.len(), 1);
    }

    #[test]
    fn critical_path_sums_the_bounds_in_order() {
        let pods = [
            pod("db", "a").priority(2).grace(10).claim("d", "ca"),
            pod("db", "b").priority(1).claim("d", "cb"),
            pod("db", "c").claim("d", "shared"),
            pod("db", "d").claim("d", "shared"),
            pod("web", "x").grace(600),
        ];
        let pvcs = [
            pvc("db", "ca", Some("pv-a")),
            pvc("db", "cb", Some("pv-b")),
            pvc("db", "shared", Some("pv-s")),
        ];
        let pvs = [
            csi_pv("pv-a", "d.csi", "a"),
            csi_pv("pv-b", "d.csi", "b"),
            csi_pv("pv-s", "d.csi", "s"),
        ];
        let p = plan_of(&pods, &pvcs, &pvs);
        let path = p.critical_path();
        let want = [
            (key("db", "a"), 40, Some(130), Some(90)),
            (key("db", "b"), 60, Some(150), Some(90)),
            (key("db", "c"), 60, None, None),
            (key("db", "d"), 60, Some(150), Some(90)),
        ];
        assert_eq!(path.steps.len(), want.len());
        for (step, (pod, gone, detach, reattach)) in path.steps.iter().zip(want) {
            assert_eq!(step.pod, pod);
            assert_eq!(
                step.bounds,
                StepBounds {
                    pod_gone: secs(gone),
                    detach: detach.map(secs),
                    reattach: reattach.map(secs),
                },
                "{pod:?}"
            );
        }
        assert_eq!(path.worst_case, secs(260 + 300 + 60 + 300));
        assert_eq!(
            plan_of(&[], &[], &[]).critical_path().worst_case,
            Duration::ZERO
        );
    }

    #[test]
    fn the_report_names_every_group_and_decision() {
        let pods = [
            pod("kube-system", "etcd").mirror(),
            pod("kube-system", "fluentd-x").owned_by("DaemonSet", "fluentd", true),
            pod("batch", "job-1").phase("Failed"),
            pod("db", "old-0").deleting(ts(0)).claim("d", "shared"),
            pod("web", "a")
                .labels(&[("app", "web")])
                .claim("x", "missing"),
            pod("db", "pg-0")
                .priority(100)
                .claim("d", "shared")
                .labels(&[("app", "pg")]),
            pod("db", "pg-1").claim("d", "shared").claim("l", "logs"),
        ];
        let pvcs = [
            pvc("db", "shared", Some("pv-s")),
            pvc("db", "logs", Some("pv-l")),
        ];
        let pvs = [csi_pv("pv-s", "ebs.csi.aws.com", "vol-9"), host_pv("pv-l")];
        let pdbs = [pdb(
            "db",
            "pg",
            Some(match_labels(&[("app", "pg")])),
            (1, 1, 3, 3, 0),
        )];
        let vas = [va("pv-s", NODE, true)];
        let settings = ResolvedSettings {
            drain_timeout: secs(600),
            max_parallel_volume_migrations: 2,
            force_after_deadline: false,
            ..Default::default()
        };
        let report = plan(
            NODE,
            &pods,
            &pvcs,
            &pvs,
            &pdbs,
            &vas,
            &ctx(),
            &settings,
            &RuleBook::default(),
        )
        .to_string();
        let expected = [
            "Drain plan for Node node-1",
            "Deadline: drain.timeout 10m from the Machine's deletion; then the drain fails and is retried",
            "Skipped (2):",
            "  kube-system/etcd: mirror of a static pod",
            "  kube-system/fluentd-x: managed by DaemonSet fluentd",
            "Deleted outright (1):\n  batch/job-1: phase Failed",
            "Already terminating, waited on (1):\n  db/old-0: being deleted since 1970-01-01T00:00:00Z; uses PV pv-s",
            "Without persistent volumes, evicted concurrently, up to 20 at a time (1):\n  web/a\n",
            "    note: claim web/missing (volume x) not found",
            "With persistent volumes, evicted up to 2 at a time, by order group, then highest priority first (2):",
            "  1. db/pg-0 (priority 100, grace 30s)\n       PV pv-s (claim db/shared), attachable: ebs.csi.aws.com has no CSIDriver object, so attach is required; on the Node as kubernetes.io/csi/ebs.csi.aws.com^vol-9, attached to node-1\n         shared: db/pg-1 uses it later and waits for it",
            "       PDB db/pg allows 0 disruptions with 3/3 healthy (misconfigured:",
            "  2. db/pg-1 (priority 0, grace 30s)",
            "         last user: waits until db/pg-0, db/old-0 are gone, then for detach, then for attach to another Node",
            "       PV pv-l (claim db/logs), node-local: hostPath volume, attached nowhere per VolumeAttachments\n         its data stays on this Node and is lost with the VM; evicted without any reattach wait",
            "Node-local volumes: nodeLocalVolumes Evict: their pods are evicted and their data is lost with the VM",
            "Critical path: worst case 6m, within drain.timeout 10m",
            "  1. db/pg-0: pod gone ≤ 1m\n",
            "  2. db/pg-1: pod gone ≤ 1m, detach ≤ 2m 30s, reattach ≤ 1m 30s",
        ];
        for want in expected {
            assert!(report.contains(want), "report lacks {want:?}:\n{report}");
        }
        // Groups appear in the order they happen.
        let at = |s: &str| report.find(s).expect(s);
        assert!(at("Skipped") < at("Deleted outright"));
        assert!(at("Deleted outright") < at("Already terminating"));
        assert!(at("Without persistent") < at("With persistent"));
        assert!(at("With persistent") < at("Critical path"));
    }

    #[test]
    fn volume_waits_read_as_sentences() {
        let cases = [
            (
                VolumeWait::Detach {
                    gone_first: vec![],
                    reattach: true,
                },
                "last user: waits for detach, then for attach to another Node",
            ),
            (
                VolumeWait::Detach {
                    gone_first: vec![key("db", "old")],
                    reattach: false,
                },
                "last user: waits until db/old is gone, then for detach; no reattach (ephemeral claim dies with its pod)",
            ),
            (
                VolumeWait::LeftTo {
                    last_user: key("db", "b"),
                },
                "shared: db/b uses it later and waits for it",
            ),
            (
                VolumeWait::StaysAttached {
                    pinned_by: vec![key("ops", "backup-x"), key("ops", "backup-y")],
                },
                "stays attached: also used by ops/backup-x, ops/backup-y, which end(s) with the VM; no detach wait",
            ),
        ];
        for (wait, want) in cases {
            assert_eq!(wait.to_string(), want);
        }
        let ephemeral = PlannedVolume {
            volume: VolumeRef {
                pv: "pv-e".into(),
                claim: key("db", "pg-0-scratch"),
                unique_name: Some("kubernetes.io/csi/d.csi^e".into()),
                ephemeral: true,
            },
            kind: VolumeKind::Attachable,
            kind_why: "CSIDriver d.csi requires attach".into(),
            attached_to: vec![NODE.into(), "node-2".into()],
            wait: VolumeWait::LeftTo {
                last_user: key("db", "b"),
            },
        };
        assert_eq!(
            ephemeral.to_string(),
            "PV pv-e (claim db/pg-0-scratch, ephemeral), attachable: CSIDriver d.csi requires attach; on the Node as kubernetes.io/csi/d.csi^e, attached to node-1, node-2"
        );
    }

    #[test]
    fn volumes_no_pod_on_the_node_uses_are_still_detaching() {
        let pods = [
            pod("db", "c").claim("d", "data-c"),
            // A pod elsewhere does not keep a volume of this Node in use.
            pod("db", "a").claim("d", "data-a").on_node(Some("node-2")),
        ];
        let pvcs = [
            pvc("db", "data-c", Some("pv-c")),
            pvc("db", "data-a", Some("pv-a")),
        ];
        let pvs = [
            csi_pv("pv-a", "d.csi", "h-a"),
            host_pv("pv-b"),
            csi_pv("pv-c", "d.csi", "h-c"),
        ];
        let vas = [
            va("pv-b", NODE, true),
            va("pv-a", NODE, false),
            va("pv-b", NODE, true),
            va("pv-c", NODE, true),
            va("pv-d", "node-2", true),
        ];
        let left = detaching_volumes(NODE, &pods, &pvcs, &pvs, &vas);
        assert_eq!(
            left,
            vec![
                DetachingVolume {
                    pv: "pv-a".into(),
                    unique_name: Some("kubernetes.io/csi/d.csi^h-a".into()),
                },
                DetachingVolume {
                    pv: "pv-b".into(),
                    unique_name: None,
                },
            ],
            "each once, by name; pv-c is in use, pv-d is on another Node"
        );
        assert!(detaching_volumes(NODE, &pods, &pvcs, &pvs, &[]).is_empty());
        // The plan carries the same list.
        let p = plan(
            NODE,
            &pods,
            &pvcs,
            &pvs,
            &[],
            &vas,
            &ctx(),
            &ResolvedSettings::default(),
            &RuleBook::default(),
        );
        assert_eq!(p.detaching, left);

        // A volume whose detach wait already timed out is not waited for
        // again.
        let abandoned: BTreeSet<String> = ["pv-a".to_string()].into();
        let still: Vec<String> = still_to_wait_for(&left, &abandoned)
            .into_iter()
            .map(|v| v.pv)
            .collect();
        assert_eq!(still, ["pv-b"]);
        assert_eq!(still_to_wait_for(&left, &BTreeSet::new()), left);
    }

    /// The engine reads its order from the plan's fields (the stateful
    /// order, the terminating pods with volumes, the volumes still detaching,
    /// each pod's `gone_first`): pin that the report prints the same.
    #[test]
    fn the_drain_reads_the_order_the_report_prints() {
        let pods = [
            pod("db", "old-0").deleting(ts(0)).claim("d", "shared"),
            pod("db", "done").deleting(ts(0)),
            pod("db", "pg-1").claim("d", "shared").claim("l", "logs"),
            pod("db", "pg-0").priority(100).claim("d", "shared"),
            pod("db", "pg-2").priority(50).claim("d", "own"),
        ];
        let pvcs = [
            pvc("db", "shared", Some("pv-s")),
            pvc("db", "logs", Some("pv-l")),
            pvc("db", "own", Some("pv-o")),
        ];
        let pvs = [
            csi_pv("pv-s", "d.csi", "s"),
            host_pv("pv-l"),
            csi_pv("pv-o", "d.csi", "o"),
            csi_pv("pv-gone", "d.csi", "g"),
        ];
        let vas = [va("pv-s", NODE, true), va("pv-gone", NODE, true)];
        let settings = ResolvedSettings {
            max_parallel_volume_migrations: 2,
            ..Default::default()
        };
        let p = plan(
            NODE,
            &pods,
            &pvcs,
            &pvs,
            &[],
            &vas,
            &ctx(),
            &settings,
            &RuleBook::default(),
        );
        let report = p.to_string();
        let at = |s: &str| report.find(s).unwrap_or_else(|| panic!("{s:?}:\n{report}"));

        // The stateful pods in the order the report numbers them.
        let order = p.stateful_order();
        assert_eq!(
            order,
            [key("db", "pg-0"), key("db", "pg-2"), key("db", "pg-1")]
        );
        for (i, k) in order.iter().enumerate() {
            at(&format!("  {}. {} (priority", i + 1, fmt_key(k)));
        }

        // First the terminating pods with volumes, then the volumes of pods
        // that left, then the stateful pods.
        let first: Vec<NamespacedName> = p
            .terminating_with_volumes()
            .map(|t| t.pod.clone())
            .collect();
        assert_eq!(first, [key("db", "old-0")]);
        at(
            "db/old-0: being deleted since 1970-01-01T00:00:00Z; uses PV pv-s: gone before the first stateful eviction",
        );
        assert!(!report.contains("db/done: being deleted since 1970-01-01T00:00:00Z;"));
        assert_eq!(
            p.detaching,
            [DetachingVolume {
                pv: "pv-gone".into(),
                unique_name: Some("kubernetes.io/csi/d.csi^g".into()),
            }]
        );
        at(
            "Still detaching from pods that left, waited for before the first stateful eviction (1):\n  PV pv-gone (kubernetes.io/csi/d.csi^g)\n",
        );
        assert!(at("Already terminating") < at("Still detaching"));
        assert!(at("Still detaching") < at("With persistent volumes"));

        // The last user of the shared volume waits for its earlier user and
        // the terminating one, by UID, as its line says.
        let last = &p.stateful[2];
        assert_eq!(
            p.gone_first(last),
            [
                (key("db", "pg-0"), Some("uid-pg-0".to_string())),
                (key("db", "old-0"), Some("uid-old-0".to_string())),
            ]
        );
        at("last user: waits until db/pg-0, db/old-0 are gone, then for detach");
        assert!(
            p.gone_first(&p.stateful[0]).is_empty(),
            "pg-0 leaves pv-s to pg-1"
        );
        assert!(
            p.gone_first(&p.stateful[1]).is_empty(),
            "pg-2 is alone on pv-o"
        );
    }

    fn annotated(p: Pod, key: &str, value: &str) -> Pod {
        let mut p = p;
        p.metadata
            .annotations
            .get_or_insert_default()
            .insert(key.into(), value.into());
        p
    }

    fn with_empty_dir(mut p: Pod, name: &str) -> Pod {
        let spec = p.spec.get_or_insert_default();
        spec.volumes
            .get_or_insert_default()
            .push(k8s_openapi::api::core::v1::Volume {
                name: name.into(),
                empty_dir: Some(Default::default()),
                ..Default::default()
            });
        p
    }

    #[test]
    fn each_class_of_volume_gets_its_wait() {
        let nfs = crate::drain::fixtures::csi_driver("nfs.csi", false);
        let allow = crate::api::ALLOW_NODE_LOCAL_DATA_LOSS;
        let pods = [
            pod("db", "block").claim("d", "c-block"),
            pod("db", "free").claim("d", "c-free").ephemeral("tmp"),
            annotated(pod("db", "allowed").claim("d", "c-allowed"), allow, "true"),
            annotated(pod("db", "not-true").claim("d", "c-not-true"), allow, "yes"),
            with_empty_dir(pod("web", "cache"), "cache"),
            pod("db", "shared-a").claim("d", "c-shared"),
            pod("db", "shared-b").claim("d", "c-shared"),
        ];
        let pvcs = [
            pvc("db", "c-block", Some("pv-block")),
            pvc("db", "c-free", Some("pv-free")),
            ephemeral_pvc("db", "free-tmp", "pv-free-tmp", "uid-free"),
            pvc("db", "c-allowed", Some("pv-allowed")),
            pvc("db", "c-not-true", Some("pv-not-true")),
            pvc("db", "c-shared", Some("pv-shared")),
        ];
        let pvs = [
            host_pv("pv-block"),
            csi_pv("pv-free", "nfs.csi", "f"),
            csi_pv("pv-free-tmp", "nfs.csi", "t"),
            host_pv("pv-allowed"),
            host_pv("pv-not-true"),
            csi_pv("pv-shared", "nfs.csi", "s"),
        ];
        let plan_with = |mode, machine_allows| {
            let settings = ResolvedSettings {
                node_local_volumes: mode,
                ..Default::default()
            };
            let ctx = VolumeContext::new(NODE, None, std::slice::from_ref(&nfs))
                .allowing_data_loss(machine_allows);
            plan(
                NODE,
                &pods,
                &pvcs,
                &pvs,
                &[],
                &[],
                &ctx,
                &settings,
                &RuleBook::default(),
            )
        };
        let p = plan_with(NodeLocalVolumes::Block, false);
        let find = |name: &str| {
            p.stateful
                .iter()
                .chain(&p.stateless)
                .find(|x| x.pod.1 == name)
                .unwrap_or_else(|| panic!("{name}"))
        };
        // (pod, its volumes' classes and waits, held, reattach bound)
        type Case<'a> = (&'a str, Vec<(VolumeKind, VolumeWait)>, bool, bool);
        let cases: Vec<Case> = vec![
            (
                "block",
                vec![(VolumeKind::NodeLocal, VolumeWait::DataLost)],
                true,
                false,
            ),
            (
                "free",
                vec![
                    (VolumeKind::AttachFree, VolumeWait::ReplacementReady),
                    (VolumeKind::AttachFree, VolumeWait::DiesWithPod),
                ],
                false,
                true,
            ),
            (
                "allowed",
                vec![(VolumeKind::NodeLocal, VolumeWait::DataLost)],
                false,
                false,
            ),
            (
                "not-true",
                vec![(VolumeKind::NodeLocal, VolumeWait::DataLost)],
                true,
                false,
            ),
            (
                "shared-a",
                vec![(VolumeKind::AttachFree, VolumeWait::ReplacementReady)],
                false,
                true,
            ),
            (
                "shared-b",
                vec![(VolumeKind::AttachFree, VolumeWait::ReplacementReady)],
                false,
                true,
            ),
        ];
        for (name, waits, held, reattach) in cases {
            let planned = find(name);
            let got: Vec<(VolumeKind, VolumeWait)> = planned
                .volumes
                .iter()
                .map(|v| (v.kind, v.wait.clone()))
                .collect();
            assert_eq!(got, waits, "{name}");
            assert_eq!(planned.held.is_some(), held, "{name}: {:?}", planned.held);
            assert_eq!(planned.bounds.detach, None, "{name}: nothing detaches");
            assert_eq!(planned.bounds.reattach.is_some(), reattach, "{name}");
        }
        let order: Vec<&str> = p.stateful.iter().map(|x| x.pod.1.as_str()).collect();
        assert_eq!(
            order,
            [
                "allowed", "free", "shared-a", "shared-b", "block", "not-true"
            ],
            "held pods last"
        );
        let held = find("block").held.clone().unwrap_or_default();
        for part in [
            "pod db/block uses node-local PV pv-block",
            "berth.dev/allow-node-local-data-loss=true",
            "kubectl annotate pod -n db block berth.dev/allow-node-local-data-loss=true",
        ] {
            assert!(held.contains(part), "{held:?} lacks {part:?}");
        }
        // Scratch only: a stateless pod that lists its emptyDir.
        assert_eq!(find("cache").scratch, ["cache"]);
        assert!(p.stateless.iter().any(|x| x.pod.1 == "cache"));

        // Evict holds nobody; neither does Block once the Machine allows.
        for (mode, allows) in [
            (NodeLocalVolumes::Evict, false),
            (NodeLocalVolumes::Block, true),
        ] {
            let p = plan_with(mode, allows);
            assert!(
                p.stateful.iter().all(|x| x.held.is_none()),
                "{mode:?}, machine allows: {allows}"
            );
        }

        let report = p.to_string();
        for line in [
            "PV pv-free (claim db/c-free), attach-free: CSIDriver nfs.csi has attachRequired: false; on the Node as kubernetes.io/csi/nfs.csi^f",
            "no detach or attach: waits for the pod that uses the claim next to be Running and Ready on another Node",
            "no wait: the ephemeral claim dies with its pod",
            "PV pv-block (claim db/c-block), node-local: hostPath volume",
            "HELD: pod db/block uses node-local PV pv-block",
            "    scratch: emptyDir cache (lost with the pod; nothing to wait for)",
            "Node-local volumes: nodeLocalVolumes Block",
        ] {
            assert!(report.contains(line), "report lacks {line:?}:\n{report}");
        }
    }

    #[test]
    fn critical_pods_and_order_groups_go_in_ascending_order() {
        use crate::drain::rules::{DRAIN_ANNOTATION, ORDER_ANNOTATION};
        let critical = |mut p: Pod, class: &str| {
            p.spec.get_or_insert_default().priority_class_name = Some(class.into());
            p
        };
        let pods = [
            // Highest priority of all, but critical: last.
            critical(pod("kube-system", "csi-node"), "system-node-critical")
                .priority(2_000_001_000)
                .claim("d", "plugin"),
            critical(pod("kube-system", "dns"), "system-cluster-critical"),
            pod("db", "pg-0").priority(100).claim("d", "data-0"),
            pod("db", "pg-1").claim("d", "data-1"),
            pod("web", "a"),
            annotated(pod("web", "first"), ORDER_ANNOTATION, "-1"),
            annotated(pod("web", "odd"), ORDER_ANNOTATION, "after-dns"),
            annotated(pod("batch", "report"), DRAIN_ANNOTATION, "wait-completed")
                .claim("d", "shared"),
            annotated(pod("ops", "keep"), DRAIN_ANNOTATION, "skip").claim("d", "shared"),
            annotated(pod("db", "pg-2"), DRAIN_ANNOTATION, "wait-completed").deleting(ts(0)),
            pod("db", "pg-3").claim("d", "shared"),
        ];
        let pvcs = [
            pvc("kube-system", "plugin", Some("pv-p")),
            pvc("db", "data-0", Some("pv-0")),
            pvc("db", "data-1", Some("pv-1")),
            pvc("batch", "shared", Some("pv-s")),
            pvc("ops", "shared", Some("pv-s")),
            pvc("db", "shared", Some("pv-s")),
        ];
        let pvs = [
            csi_pv("pv-p", "d.csi", "p"),
            csi_pv("pv-0", "d.csi", "0"),
            csi_pv("pv-1", "d.csi", "1"),
            csi_pv("pv-s", "d.csi", "s"),
        ];
        let p = plan_of(&pods, &pvcs, &pvs);
        let names =
            |ps: &[PlannedPod]| -> Vec<String> { ps.iter().map(|x| fmt_key(&x.pod)).collect() };
        assert_eq!(
            names(&p.stateful),
            ["db/pg-0", "db/pg-1", "db/pg-3", "kube-system/csi-node"],
            "critical last, whatever its priority"
        );
        assert_eq!(
            names(&p.stateless),
            ["web/first", "web/a", "web/odd", "kube-system/dns"]
        );
        assert_eq!(names(&p.waiting), ["batch/report"]);
        assert_eq!(
            p.skipped
                .iter()
                .map(|x| (fmt_key(&x.pod), x.class.clone()))
                .collect::<Vec<_>>(),
            [(
                "ops/keep".to_string(),
                PodClass::Skipped {
                    by: "berth.dev/drain=skip".into()
                }
            )]
        );
        // A pod waited on that is being deleted is waited on as such, in
        // its group.
        assert_eq!(p.terminating[0].pod, key("db", "pg-2"));
        assert_eq!(p.terminating[0].order, 0);
        // The volume a skipped pod and a pod waited on also use stays
        // attached: nobody waits for it to detach before the VM goes.
        let pg3 = p.stateful.iter().find(|x| x.pod.1 == "pg-3").expect("pg-3");
        assert_eq!(
            pg3.volumes[0].wait,
            VolumeWait::StaysAttached {
                pinned_by: vec![key("batch", "report"), key("ops", "keep")]
            }
        );
        assert_eq!(
            p.rule_problems,
            [(
                key("web", "odd"),
                "berth.dev/drain-order=\"after-dns\" is not a 32-bit integer; order 0 used"
                    .to_string()
            )]
        );

        // The groups, and the one a pass works on.
        let groups: Vec<(i32, usize, usize, usize)> = p
            .groups()
            .iter()
            .map(|g| (g.order, g.stateless, g.stateful, g.waiting))
            .collect();
        assert_eq!(groups, [(-1, 1, 0, 0), (0, 2, 3, 1), (1000, 1, 1, 0)]);
        assert_eq!(p.current_group(|_| true), Some(-1));
        let first = p.only_group(-1);
        assert_eq!(names(&first.stateless), ["web/first"]);
        assert!(first.stateful.is_empty() && first.waiting.is_empty());
        assert_eq!(first.terminating, p.terminating, "waited on in any group");
        // Once the groups before it are empty, the critical group; a pod
        // still terminating holds its group while it holds the drain.
        let mut later = p.clone();
        later.stateless.retain(|x| x.order >= 1000);
        later.stateful.retain(|x| x.order >= 1000);
        later.waiting.clear();
        assert_eq!(later.current_group(|_| true), Some(0), "db/pg-2 going");
        assert_eq!(later.current_group(|_| false), Some(1000));
        later.stateless.clear();
        later.stateful.clear();
        assert_eq!(later.current_group(|_| false), None);

        let report = p.to_string();
        for line in [
            "Order groups, lowest first; each starts once every pod of the groups before it is gone and their volumes have moved (3):\n  order -1 (berth.dev/drain-order): 1 without persistent volumes\n  order 0: 2 without persistent volumes, 3 with persistent volumes, 1 waited on to complete\n  order 1000 (critical: priorityClassName system-cluster-critical; critical: priorityClassName system-node-critical): 1 without persistent volumes, 1 with persistent volumes\n",
            "  ops/keep: drain rule berth.dev/drain=skip: never evicted; ends with the VM",
            "Waited on to complete, never evicted (1):\n  batch/report: drain rule berth.dev/drain=wait-completed: the drain waits until it succeeds, fails or is gone; at the deadline minus its grace period it is deleted with its grace period\n",
            "Drain rules not understood or in conflict, defaults or the winning rule used (1):\n  web/odd: berth.dev/drain-order=\"after-dns\" is not a 32-bit integer; order 0 used\n",
            "  web/first (order -1, berth.dev/drain-order)\n  web/a\n  web/odd\n  kube-system/dns (order 1000, critical: priorityClassName system-cluster-critical)\n",
            "  4. kube-system/csi-node (priority 2000001000, grace 30s, order 1000, critical: priorityClassName system-node-critical)",
        ] {
            assert!(report.contains(line), "report lacks {line:?}:\n{report}");
        }
        let at = |s: &str| report.find(s).unwrap_or_else(|| panic!("{s:?}:\n{report}"));
        assert!(at("Order groups") < at("Skipped"));
        let without_forcing = plan(
            NODE,
            &pods,
            &pvcs,
            &pvs,
            &[],
            &[],
            &ctx(),
            &ResolvedSettings {
                force_after_deadline: false,
                ..Default::default()
            },
            &RuleBook::default(),
        );
        assert!(
            without_forcing
                .to_string()
                .contains("at the deadline the drain fails naming it, and is retried"),
            "{without_forcing}"
        );
    }

    #[test]
    fn the_report_flags_a_worst_case_beyond_the_deadline() {
        let pods = [pod("db", "pg-0").grace(3600).claim("d", "data")];
        let pvcs = [pvc("db", "data", Some("pv"))];
        let pvs = [host_pv("pv")];
        let settings = ResolvedSettings {
            drain_timeout: secs(3600),
            ..Default::default()
        };
        let report = plan(
            NODE,
            &pods,
            &pvcs,
            &pvs,
            &[],
            &[],
            &ctx(),
            &settings,
            &RuleBook::default(),
        )
        .to_string();
        assert!(report.contains("exceeds drain.timeout 1h"), "{report}");
        assert!(report.contains("evicted one at a time"), "{report}");
        assert!(
            report
                .contains("then budgets are bypassed (each pod left deleted with its grace period"),
            "{report}"
        );
    }
}
