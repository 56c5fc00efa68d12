//! Where the replacement of a pod can run: a destination found before a
//! stateful pod is evicted, so that a pod whose volumes must attach again,
//! or whose volumes pin it to a zone, never leaves its Node for a hole.
//!
//! The question is asked of a [`Sight`] (the controller's caches, or the
//! lists `berth plan` reads) and answered without I/O: every Node is judged
//! by the scheduler's rules, as checks, not as a scheduler (see [`fit`]):
//! Ready, not cordoned, not being drained by berth, no taint the pod does
//! not tolerate; inside every volume's node affinity, the pod's required
//! node affinity and its node selector; the volumes' CSI drivers registered
//! in its CSINode; a free attach slot for each volume (the CSINode's
//! allocatable count, minus the volumes of that driver in use there, minus
//! the slots berth's moves in flight reserved there); room for the pod's
//! requests. The answer is a Node (the one with the most free attach
//! slots), or every Node and why it cannot, in words an operator acts on.

pub mod fit;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, NodeSelector, PersistentVolume, Pod, PodSpec, Toleration};
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode};

use self::fit::Resources;

/// The label that names a Node's (and a volume's) zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// What a destination is judged from: the cluster as the caller sees it.
pub trait Sight {
    /// Every Node.
    fn nodes(&self) -> Vec<Arc<Node>>;
    /// Node `node`'s CSINode (its name is the Node's).
    fn csi_node(&self, node: &str) -> Option<Arc<CSINode>>;
    /// The pods bound to Node `node`, finished or not.
    fn pods_on(&self, node: &str) -> Vec<Arc<Pod>>;
    /// PersistentVolume `name`.
    fn pv(&self, name: &str) -> Option<Arc<PersistentVolume>>;
    /// The PV bound to claim `namespace/claim`.
    fn pv_of_claim(&self, namespace: &str, claim: &str) -> Option<Arc<PersistentVolume>>;
    /// CSIDriver `name`.
    fn driver(&self, name: &str) -> Option<Arc<CSIDriver>>;
    /// Whether berth drains Node `node` (or is about to).
    fn draining(&self, node: &Node) -> bool;
    /// The pods that use claim `namespace/claim`.
    fn claim_users(&self, namespace: &str, claim: &str) -> Vec<Arc<Pod>>;
    /// Berth's moves in flight that hold a destination.
    fn holdings(&self) -> Vec<Holding>;

    /// The attach slots berth's moves in flight reserved on Node `node`:
    /// one per attachable volume of a move whose destination it is, until
    /// a pod that replaced the moved one (another UID using the volume's
    /// claim) is placed, wherever.
    fn reserved(&self, node: &str) -> Vec<Reserved> {
        let mut reserved = Vec::new();
        for h in self.holdings().iter().filter(|h| h.node == node) {
            for name in &h.pvs {
                let Some(pv) = self.pv(name) else { continue };
                let Some(driver) = driver_of(&pv) else {
                    continue;
                };
                if !replaced(self, h, &pv) {
                    reserved.push(Reserved {
                        pv: name.clone(),
                        driver,
                        pod: h.pod.clone(),
                    });
                }
            }
        }
        reserved
    }
}

/// A move in flight holding a destination: the moved pod
/// (`namespace/name`) and its UID, the Node, and the attachable PVs that
/// move with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    pub pod: String,
    pub uid: String,
    pub node: String,
    pub pvs: Vec<String>,
}

/// Whether a pod other than `h`'s moved one uses `pv`'s claim and is
/// placed: the move's reservation is spent.
fn replaced(sight: &(impl Sight + ?Sized), h: &Holding, pv: &PersistentVolume) -> bool {
    let Some(claim) = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref()) else {
        return false;
    };
    sight
        .claim_users(
            claim.namespace.as_deref().unwrap_or_default(),
            claim.name.as_deref().unwrap_or_default(),
        )
        .iter()
        .any(|p| {
            p.metadata.uid.as_deref() != Some(h.uid.as_str())
                && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
        })
}

/// `sight` with Node `node` being drained too: a Machine about to be
/// deleted (a scale-down's candidate), whose Node takes no replacement.
pub struct Draining<'a, S> {
    pub sight: &'a S,
    pub node: &'a str,
}

impl<S: Sight> Sight for Draining<'_, S> {
    fn nodes(&self) -> Vec<Arc<Node>> {
        self.sight.nodes()
    }
    fn csi_node(&self, node: &str) -> Option<Arc<CSINode>> {
        self.sight.csi_node(node)
    }
    fn pods_on(&self, node: &str) -> Vec<Arc<Pod>> {
        self.sight.pods_on(node)
    }
    fn pv(&self, name: &str) -> Option<Arc<PersistentVolume>> {
        self.sight.pv(name)
    }
    fn pv_of_claim(&self, namespace: &str, claim: &str) -> Option<Arc<PersistentVolume>> {
        self.sight.pv_of_claim(namespace, claim)
    }
    fn driver(&self, name: &str) -> Option<Arc<CSIDriver>> {
        self.sight.driver(name)
    }
    fn draining(&self, node: &Node) -> bool {
        node.metadata.name.as_deref() == Some(self.node) || self.sight.draining(node)
    }
    fn claim_users(&self, namespace: &str, claim: &str) -> Vec<Arc<Pod>> {
        self.sight.claim_users(namespace, claim)
    }
    fn holdings(&self) -> Vec<Holding> {
        self.sight.holdings()
    }
}

/// The PVs that would move with `pod`: those of its claims (not its
/// generic ephemeral volumes', deleted with it), but a node-local one
/// (`local` or `hostPath`), whose data cannot follow it.
pub fn moving_pvs(sight: &impl Sight, pod: &Pod) -> Vec<String> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| v.persistent_volume_claim.as_ref())
        .filter_map(|c| sight.pv_of_claim(ns, &c.claim_name))
        .filter(|pv| {
            pv.spec
                .as_ref()
                .is_some_and(|s| s.local.is_none() && s.host_path.is_none())
        })
        .filter_map(|pv| pv.metadata.name.clone())
        .collect()
}

/// One attach slot a move in flight reserved on a Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    pub pv: String,
    pub driver: String,
    /// The pod whose move holds it, `namespace/name`.
    pub pod: String,
}

/// How strict the check is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// An attach-required CSI driver must be registered in the
    /// destination's CSINode (the drain setting `requireCsiNode`); a
    /// driver whose CSIDriver sets `preventPodSchedulingIfMissing` always.
    pub require_csi_node: bool,
}

impl Default for Rules {
    fn default() -> Self {
        Self {
            require_csi_node: true,
        }
    }
}

/// One volume that moves with the pod, as a destination must take it.
#[derive(Debug, Clone, PartialEq)]
pub struct NeededVolume {
    pub pv: String,
    /// Its CSI driver (a migrated in-tree volume's, by translation).
    pub driver: Option<String>,
    /// It takes an attach slot on the destination.
    pub attach: bool,
    /// Its driver must be in the destination's CSINode.
    pub registered: bool,
    /// Its node affinity.
    pub affinity: Option<NodeSelector>,
}

/// What a pod's replacement needs of a Node.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Needs {
    /// The pod, `namespace/name`.
    pub pod: String,
    pub tolerations: Vec<Toleration>,
    pub node_selector: BTreeMap<String, String>,
    /// Its required node affinity.
    pub affinity: Option<NodeSelector>,
    pub volumes: Vec<NeededVolume>,
    pub requests: Resources,
}

impl Needs {
    /// What `pod`'s replacement needs, with the PVs `pvs` that move with
    /// it (not its node-local or ephemeral ones, which do not).
    pub fn of(sight: &impl Sight, pod: &Pod, pvs: &[String], rules: Rules) -> Self {
        let spec = pod.spec.clone().unwrap_or_default();
        let volumes = pvs
            .iter()
            .map(|name| {
                let pv = sight.pv(name);
                let driver = pv.as_deref().and_then(driver_of);
                let object = driver.as_deref().and_then(|d| sight.driver(d));
                let csi = object.as_ref().map(|o| &o.spec);
                let attach =
                    driver.is_some() && csi.is_none_or(|s| s.attach_required != Some(false));
                let prevent =
                    csi.is_some_and(|s| s.prevent_pod_scheduling_if_missing == Some(true));
                NeededVolume {
                    pv: name.clone(),
                    registered: prevent || (attach && rules.require_csi_node),
                    attach,
                    affinity: pv
                        .as_deref()
                        .and_then(|p| p.spec.as_ref()?.node_affinity.as_ref()?.required.clone()),
                    driver,
                }
            })
            .collect();
        Self {
            pod: format!(
                "{}/{}",
                pod.metadata.namespace.as_deref().unwrap_or_default(),
                pod.metadata.name.as_deref().unwrap_or_default()
            ),
            tolerations: spec.tolerations.clone().unwrap_or_default(),
            node_selector: spec.node_selector.clone().unwrap_or_default(),
            affinity: spec
                .affinity
                .as_ref()
                .and_then(|a| a.node_affinity.as_ref())
                .and_then(|a| {
                    a.required_during_scheduling_ignored_during_execution
                        .clone()
                }),
            volumes,
            requests: fit::pod_requests(&spec),
        }
    }

    /// Whether a destination must be found before the pod goes: one of its
    /// volumes attaches again, or is pinned to Nodes by its affinity.
    pub fn pinned(&self) -> bool {
        self.volumes
            .iter()
            .any(|v| v.attach || v.registered || v.affinity.is_some())
    }

    /// Its attach slots by driver.
    fn slots(&self) -> BTreeMap<&str, u32> {
        let mut slots = BTreeMap::new();
        for v in self.volumes.iter().filter(|v| v.attach) {
            if let Some(d) = &v.driver {
                *slots.entry(d.as_str()).or_default() += 1;
            }
        }
        slots
    }
}

/// `pod` as its controller would make its replacement from `template`
/// (a StatefulSet's pod template now, which a template changed since the
/// pod was made, with `OnDelete`, differs from): the template's
/// tolerations, node selector, affinity, containers and overhead, with the
/// pod's own volumes and identity.
pub fn made_from(pod: &Pod, template: &PodSpec) -> Pod {
    let mut made = pod.clone();
    if let Some(spec) = made.spec.as_mut() {
        spec.tolerations = template.tolerations.clone();
        spec.node_selector = template.node_selector.clone();
        spec.affinity = template.affinity.clone();
        spec.containers = template.containers.clone();
        spec.init_containers = template.init_containers.clone();
        spec.overhead = template.overhead.clone();
    }
    made
}

/// The CSI driver of a PV: its own, or the one CSI migration gives an
/// in-tree volume.
pub fn driver_of(pv: &PersistentVolume) -> Option<String> {
    if let Some(csi) = pv.spec.as_ref()?.csi.as_ref() {
        return Some(csi.driver.clone());
    }
    crate::volumes::migrated_csi_source(pv).map(|(d, _)| d.to_string())
}

/// Why a Node cannot take the replacement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Outside what pins the pod: a volume's node affinity, the pod's
    /// node affinity or its node selector (named).
    Outside(String),
    NotReady,
    Cordoned,
    Draining,
    /// A taint the pod does not tolerate, `key=value:effect`.
    Taint(String),
    /// No CSINode, or none that lists the driver.
    Unregistered(String),
    /// Every attach slot of the driver is used or reserved.
    Slots {
        driver: String,
        limit: u32,
        used: u32,
        reserved: u32,
    },
    /// Not enough of a resource, in words.
    Room(String),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Outside(what) => write!(f, "outside {what}"),
            Self::NotReady => f.write_str("not Ready"),
            Self::Cordoned => f.write_str("cordoned"),
            Self::Draining => f.write_str("being drained"),
            Self::Taint(t) => write!(f, "taint {t} not tolerated"),
            Self::Unregistered(d) => write!(f, "no CSINode entry for {d}"),
            Self::Slots {
                driver,
                limit,
                used,
                reserved,
            } => {
                write!(f, "{}/{limit} attach slots of {driver}", used + reserved)?;
                if *reserved > 0 {
                    write!(f, " ({reserved} reserved by berth's moves)")?;
                }
                Ok(())
            }
            Self::Room(what) => write!(f, "no room: {what}"),
        }
    }
}

/// One Node that cannot take the replacement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub node: String,
    pub zone: Option<String>,
    pub why: Refusal,
}

/// The answer: a destination, or why there is none.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Verdict {
    /// The Node that takes it (of those that can, the one with the most
    /// free attach slots), if any.
    pub node: Option<String>,
    /// Every Node that cannot, and why.
    pub refused: Vec<Refused>,
}

/// The most Nodes named in a zone's line; the rest are counted.
const NAMED_PER_ZONE: usize = 6;

impl Verdict {
    /// Why there is no destination, by zone ("zone a: n1 cordoned; n2 no
    /// CSINode entry for ebs.csi.aws.com; zone b: 3 Nodes outside PV
    /// pv-1's node affinity").
    pub fn why(&self) -> String {
        if self.refused.is_empty() {
            return "no Node in the cluster".into();
        }
        let mut zones: BTreeMap<&str, Vec<&Refused>> = BTreeMap::new();
        for r in &self.refused {
            zones
                .entry(r.zone.as_deref().unwrap_or("(none)"))
                .or_default()
                .push(r);
        }
        let lines: Vec<String> = zones
            .into_iter()
            .map(|(zone, refused)| {
                let mut parts = Vec::new();
                // Nodes outside what pins the pod are one item each reason.
                let mut outside: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
                for r in &refused {
                    match &r.why {
                        Refusal::Outside(what) => {
                            outside.entry(what).or_default().push(&r.node);
                        }
                        why => parts.push(format!("{} {why}", r.node)),
                    }
                }
                let named = parts.len();
                parts.truncate(NAMED_PER_ZONE);
                if named > NAMED_PER_ZONE {
                    parts.push(format!("{} more", named - NAMED_PER_ZONE));
                }
                for (what, nodes) in outside {
                    parts.push(match nodes.as_slice() {
                        [one] => format!("{one} outside {what}"),
                        many => format!("{} Nodes outside {what}", many.len()),
                    });
                }
                format!("zone {zone}: {}", parts.join("; "))
            })
            .collect();
        lines.join("; ")
    }
}

/// Judges every Node for `needs` and picks the destination.
pub fn choose(sight: &impl Sight, needs: &Needs) -> Verdict {
    let mut nodes = sight.nodes();
    nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let mut verdict = Verdict::default();
    let mut best: Option<(i64, String)> = None;
    for node in nodes {
        let name = node.metadata.name.clone().unwrap_or_default();
        let zone = node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(ZONE_LABEL))
            .cloned();
        match judge(sight, needs, &node) {
            Ok(free) => {
                if best.as_ref().is_none_or(|(f, _)| free > *f) {
                    best = Some((free, name));
                }
            }
            Err(why) => verdict.refused.push(Refused {
                node: name,
                zone,
                why,
            }),
        }
    }
    verdict.node = best.map(|(_, n)| n);
    verdict
}

/// Whether `node` can take the replacement: the fewest attach slots it
/// has left for the pod's drivers after taking it (`i64::MAX` when none
/// is counted), or why not.
fn judge(sight: &impl Sight, needs: &Needs, node: &Node) -> Result<i64, Refusal> {
    for v in &needs.volumes {
        if let Some(a) = &v.affinity
            && !fit::meets(a, node)
        {
            return Err(Refusal::Outside(format!("PV {}'s node affinity", v.pv)));
        }
    }
    if let Some(a) = &needs.affinity
        && !fit::meets(a, node)
    {
        return Err(Refusal::Outside("the pod's node affinity".into()));
    }
    if !fit::selected(&needs.node_selector, node) {
        return Err(Refusal::Outside("the pod's nodeSelector".into()));
    }
    if !ready(node) {
        return Err(Refusal::NotReady);
    }
    if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
        return Err(Refusal::Cordoned);
    }
    if sight.draining(node) {
        return Err(Refusal::Draining);
    }
    if let Some(t) = fit::untolerated(node, &needs.tolerations) {
        let value = t
            .value
            .as_deref()
            .map(|v| format!("={v}"))
            .unwrap_or_default();
        return Err(Refusal::Taint(format!("{}{value}:{}", t.key, t.effect)));
    }
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let csi = sight.csi_node(name);
    let registered = |driver: &str| {
        csi.as_ref()
            .and_then(|c| c.spec.drivers.iter().find(|d| d.name == driver))
    };
    for v in needs.volumes.iter().filter(|v| v.registered) {
        if let Some(d) = &v.driver
            && registered(d).is_none()
        {
            return Err(Refusal::Unregistered(d.clone()));
        }
    }
    let pods: Vec<Arc<Pod>> = sight
        .pods_on(name)
        .into_iter()
        .filter(|p| !finished(p))
        .collect();
    let mut free = i64::MAX;
    let slots = needs.slots();
    if !slots.is_empty() {
        let in_use = volumes_in_use(sight, &pods);
        let mine: BTreeSet<&str> = needs.volumes.iter().map(|v| v.pv.as_str()).collect();
        let reserved = sight.reserved(name);
        for (driver, need) in slots {
            let Some(limit) = registered(driver)
                .and_then(|d| d.allocatable.as_ref()?.count)
                .and_then(|c| u32::try_from(c).ok())
            else {
                continue;
            };
            let used_set = in_use.get(driver);
            let used = used_set.map_or(0, |s| s.len() as u32);
            let held: BTreeSet<&str> = reserved
                .iter()
                .filter(|r| r.driver == driver)
                .map(|r| r.pv.as_str())
                .filter(|pv| !mine.contains(pv) && used_set.is_none_or(|s| !s.contains(*pv)))
                .collect();
            let held = held.len() as u32;
            if used + held + need > limit {
                return Err(Refusal::Slots {
                    driver: driver.to_string(),
                    limit,
                    used,
                    reserved: held,
                });
            }
            free = free.min(i64::from(limit - used - held - need));
        }
    }
    room(node, &pods, needs.requests)?;
    Ok(free)
}

/// The attachable PVs the pods use, by driver.
fn volumes_in_use(sight: &impl Sight, pods: &[Arc<Pod>]) -> BTreeMap<String, BTreeSet<String>> {
    let mut in_use: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for pod in pods {
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        for claim in crate::cache::claim_names(pod) {
            let Some(pv) = sight.pv_of_claim(ns, &claim) else {
                continue;
            };
            if let Some(driver) = driver_of(&pv)
                && sight
                    .driver(&driver)
                    .is_none_or(|d| d.spec.attach_required != Some(false))
            {
                let name = pv.metadata.name.clone().unwrap_or_default();
                in_use.entry(driver).or_default().insert(name);
            }
        }
    }
    in_use
}

/// Room for `need` beside `pods` on `node`, by its allocatable resources
/// (a resource it does not report is not counted).
fn room(node: &Node, pods: &[Arc<Pod>], need: Resources) -> Result<(), Refusal> {
    let allocatable = Resources::of(node.status.as_ref().and_then(|s| s.allocatable.as_ref()));
    let mut used = Resources::default();
    for p in pods {
        let r = p.spec.as_ref().map(fit::pod_requests).unwrap_or_default();
        used.cpu_milli += r.cpu_milli;
        used.memory += r.memory;
        used.pods += r.pods;
    }
    let short = |what: &str, have: i64, used: i64, need: i64, unit: &str| {
        (have > 0 && used + need > have).then(|| {
            format!(
                "{what} requests {need}{unit}, {}{unit} of {have}{unit} free",
                (have - used).max(0)
            )
        })
    };
    let lacking = short(
        "cpu",
        allocatable.cpu_milli,
        used.cpu_milli,
        need.cpu_milli,
        "m",
    )
    .or_else(|| short("memory", allocatable.memory, used.memory, need.memory, "B"))
    .or_else(|| short("pods", allocatable.pods, used.pods, need.pods, ""));
    match lacking {
        Some(what) => Err(Refusal::Room(what)),
        None => Ok(()),
    }
}

/// Whether the Node reports Ready.
fn ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

#[cfg(test)]
mod tests;
