use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    Node, NodeCondition, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, NodeSpec,
    NodeStatus, PersistentVolume, Pod, Taint,
};
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::json;

use super::*;

const EBS: &str = "ebs.csi.aws.com";

/// A cluster in memory.
#[derive(Default)]
struct World {
    nodes: Vec<Arc<Node>>,
    csi: BTreeMap<String, Arc<CSINode>>,
    pods: Vec<Arc<Pod>>,
    pvs: Vec<Arc<PersistentVolume>>,
    drivers: Vec<Arc<CSIDriver>>,
    draining: Vec<String>,
    reserved: BTreeMap<String, Vec<Reserved>>,
}

impl Sight for World {
    fn nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.clone()
    }
    fn csi_node(&self, node: &str) -> Option<Arc<CSINode>> {
        self.csi.get(node).cloned()
    }
    fn pods_on(&self, node: &str) -> Vec<Arc<Pod>> {
        self.pods
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
            .cloned()
            .collect()
    }
    fn pv(&self, name: &str) -> Option<Arc<PersistentVolume>> {
        self.pvs
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(name))
            .cloned()
    }
    fn pv_of_claim(&self, namespace: &str, claim: &str) -> Option<Arc<PersistentVolume>> {
        self.pvs
            .iter()
            .find(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.claim_ref.as_ref())
                    .is_some_and(|c| {
                        c.namespace.as_deref() == Some(namespace)
                            && c.name.as_deref() == Some(claim)
                    })
            })
            .cloned()
    }
    fn driver(&self, name: &str) -> Option<Arc<CSIDriver>> {
        self.drivers
            .iter()
            .find(|d| d.metadata.name.as_deref() == Some(name))
            .cloned()
    }
    fn draining(&self, node: &Node) -> bool {
        self.draining
            .contains(node.metadata.name.as_ref().expect("named"))
    }
    fn claim_users(&self, _: &str, _: &str) -> Vec<Arc<Pod>> {
        Vec::new()
    }
    fn holdings(&self) -> Vec<Holding> {
        Vec::new()
    }
    fn reserved(&self, node: &str) -> Vec<Reserved> {
        self.reserved.get(node).cloned().unwrap_or_default()
    }
}

fn node(name: &str, zone: &str) -> Node {
    Node {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([(ZONE_LABEL.to_string(), zone.to_string())])),
            ..Default::default()
        },
        spec: Some(NodeSpec::default()),
        status: Some(NodeStatus {
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..Default::default()
            }]),
            allocatable: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("4".into())),
                ("memory".to_string(), Quantity("8Gi".into())),
                ("pods".to_string(), Quantity("110".into())),
            ])),
            ..Default::default()
        }),
    }
}

fn csi_node(name: &str, count: Option<i32>) -> CSINode {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"drivers": [{"name": EBS, "nodeID": name, "allocatable": {"count": count}}]}
    }))
    .expect("CSINode")
}

fn pv(name: &str, claim: &str, zone: &str) -> PersistentVolume {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "csi": {"driver": EBS, "volumeHandle": format!("vol-{name}")},
            "claimRef": {"namespace": "db", "name": claim},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": ZONE_LABEL, "operator": "In", "values": [zone]}
            ]}]}}
        }
    }))
    .expect("PV")
}

fn pod(name: &str, node: &str, claim: &str, cpu: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "db"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
        },
        "status": {"phase": "Running"}
    }))
    .expect("Pod")
}

/// The pod db-0 on the draining Node `old` (zone a) with its volume
/// pv-0, and Nodes a1, a2 (zone a) and b1 (zone b), all with the driver
/// and 3 slots.
fn world() -> (World, Pod) {
    let moving = pod("db-0", "old", "data-0", "500m");
    let mut w = World::default();
    for (n, z) in [("old", "a"), ("a1", "a"), ("a2", "a"), ("b1", "b")] {
        w.nodes.push(Arc::new(node(n, z)));
        w.csi.insert(n.into(), Arc::new(csi_node(n, Some(3))));
    }
    if let Some(n) = Arc::get_mut(&mut w.nodes[0]) {
        n.spec.as_mut().expect("spec").unschedulable = Some(true);
    }
    w.draining.push("old".into());
    w.pvs.push(Arc::new(pv("pv-0", "data-0", "a")));
    w.pods.push(Arc::new(moving.clone()));
    (w, moving)
}

fn needs(w: &World, p: &Pod) -> Needs {
    Needs::of(w, p, &["pv-0".to_string()], Rules::default())
}

#[test]
fn a_destination_in_the_volumes_zone_with_the_most_free_slots() {
    let (mut w, p) = world();
    // a1 already has two of its three slots in use.
    for i in 1..=2 {
        w.pvs
            .push(Arc::new(pv(&format!("pv-{i}"), &format!("data-{i}"), "a")));
        w.pods.push(Arc::new(pod(
            &format!("db-{i}"),
            "a1",
            &format!("data-{i}"),
            "100m",
        )));
    }
    let n = needs(&w, &p);
    assert!(n.pinned());
    let v = choose(&w, &n);
    assert_eq!(v.node.as_deref(), Some("a2"));
    let refused: Vec<(&str, &Refusal)> = v
        .refused
        .iter()
        .map(|r| (r.node.as_str(), &r.why))
        .collect();
    assert_eq!(
        refused,
        [
            ("b1", &Refusal::Outside("PV pv-0's node affinity".into())),
            ("old", &Refusal::Cordoned),
        ]
    );
}

#[test]
fn no_destination_names_each_node_of_the_zone_and_why() {
    let (mut w, p) = world();
    // a1: the driver not registered yet; a2: every slot in use or reserved.
    w.csi.remove("a1");
    w.pvs.push(Arc::new(pv("pv-1", "data-1", "a")));
    w.pods.push(Arc::new(pod("db-1", "a2", "data-1", "100m")));
    w.reserved.insert(
        "a2".into(),
        vec![
            Reserved {
                pv: "pv-7".into(),
                driver: EBS.into(),
                pod: "db/x-0".into(),
            },
            Reserved {
                pv: "pv-8".into(),
                driver: EBS.into(),
                pod: "db/y-0".into(),
            },
            // Its own reservation (a resumed move) does not count.
            Reserved {
                pv: "pv-0".into(),
                driver: EBS.into(),
                pod: "db/db-0".into(),
            },
        ],
    );
    let v = choose(&w, &needs(&w, &p));
    assert_eq!(v.node, None);
    assert_eq!(
        v.why(),
        "zone a: a1 no CSINode entry for ebs.csi.aws.com; \
         a2 3/3 attach slots of ebs.csi.aws.com (2 reserved by berth's moves); old cordoned; \
         zone b: b1 outside PV pv-0's node affinity"
    );
    // Freeing a reservation frees the slot.
    w.reserved.get_mut("a2").expect("a2").remove(0);
    assert_eq!(choose(&w, &needs(&w, &p)).node.as_deref(), Some("a2"));
}

#[test]
fn a_reservation_of_a_volume_in_use_there_is_not_counted_twice() {
    let (mut w, p) = world();
    w.csi.insert("a1".into(), Arc::new(csi_node("a1", Some(1))));
    w.csi.insert("a2".into(), Arc::new(csi_node("a2", Some(1))));
    w.pvs.push(Arc::new(pv("pv-1", "data-1", "a")));
    // The replacement of another move is placed on a2 and uses pv-1, which
    // its move also reserved there.
    w.pods.push(Arc::new(pod("db-1", "a2", "data-1", "100m")));
    w.reserved.insert(
        "a2".into(),
        vec![Reserved {
            pv: "pv-1".into(),
            driver: EBS.into(),
            pod: "db/db-1".into(),
        }],
    );
    let v = choose(&w, &needs(&w, &p));
    assert_eq!(v.node.as_deref(), Some("a1"));
    let a2 = v
        .refused
        .iter()
        .find(|r| r.node == "a2")
        .expect("a2 refused");
    assert_eq!(
        a2.why,
        Refusal::Slots {
            driver: EBS.into(),
            limit: 1,
            used: 1,
            reserved: 0
        }
    );
}

#[test]
fn readiness_taints_drains_and_room_are_each_named() {
    let (mut w, mut p) = world();
    let a1 = Arc::get_mut(&mut w.nodes[1]).expect("a1");
    a1.status
        .as_mut()
        .expect("status")
        .conditions
        .as_mut()
        .expect("conds")[0]
        .status = "False".into();
    let a2 = Arc::get_mut(&mut w.nodes[2]).expect("a2");
    a2.spec.as_mut().expect("spec").taints = Some(vec![Taint {
        key: "node.cilium.io/agent-not-ready".into(),
        value: Some("true".into()),
        effect: "NoSchedule".into(),
        time_added: None,
    }]);
    let v = choose(&w, &needs(&w, &p));
    let why: Vec<String> = v
        .refused
        .iter()
        .map(|r| format!("{} {}", r.node, r.why))
        .collect();
    assert_eq!(
        why,
        [
            "a1 not Ready",
            "a2 taint node.cilium.io/agent-not-ready=true:NoSchedule not tolerated",
            "b1 outside PV pv-0's node affinity",
            "old cordoned",
        ]
    );
    // A Node berth drains, not cordoned yet; a pod too large for a Node.
    let (mut w, _) = world();
    w.draining.push("a1".into());
    p.spec.as_mut().expect("spec").containers[0]
        .resources
        .as_mut()
        .expect("resources")
        .requests
        .as_mut()
        .expect("requests")
        .insert("cpu".into(), Quantity("5".into()));
    let v = choose(&w, &needs(&w, &p));
    let why: Vec<String> = v
        .refused
        .iter()
        .map(|r| format!("{} {}", r.node, r.why))
        .collect();
    assert_eq!(why[0], "a1 being drained");
    assert_eq!(
        why[1],
        "a2 no room: cpu requests 5000m, 4000m of 4000m free"
    );
}

#[test]
fn the_pods_own_affinity_and_node_selector_pin_it_too() {
    let (w, mut p) = world();
    let spec = p.spec.as_mut().expect("spec");
    spec.node_selector = Some(BTreeMap::from([("disk".to_string(), "ssd".to_string())]));
    let v = choose(&w, &needs(&w, &p));
    assert_eq!(v.node, None);
    assert!(
        v.why()
            .contains("zone a: 3 Nodes outside the pod's nodeSelector"),
        "{}",
        v.why()
    );
    let spec = p.spec.as_mut().expect("spec");
    spec.node_selector = None;
    spec.affinity = Some(k8s_openapi::api::core::v1::Affinity {
        node_affinity: Some(k8s_openapi::api::core::v1::NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_fields: Some(vec![NodeSelectorRequirement {
                        key: "metadata.name".into(),
                        operator: "In".into(),
                        values: Some(vec!["a2".into()]),
                    }]),
                    match_expressions: None,
                }],
            }),
            preferred_during_scheduling_ignored_during_execution: None,
        }),
        ..Default::default()
    });
    assert_eq!(choose(&w, &needs(&w, &p)).node.as_deref(), Some("a2"));
}

#[test]
fn the_csi_node_rule_follows_the_setting_and_the_driver() {
    let (mut w, p) = world();
    w.csi.clear();
    let strict = Needs::of(&w, &p, &["pv-0".to_string()], Rules::default());
    assert_eq!(choose(&w, &strict).node, None);
    let relaxed = Needs::of(
        &w,
        &p,
        &["pv-0".to_string()],
        Rules {
            require_csi_node: false,
        },
    );
    assert_eq!(choose(&w, &relaxed).node.as_deref(), Some("a1"));
    // A driver that asks for it is required whatever the setting.
    w.drivers.push(Arc::new(
        serde_json::from_value(json!({
            "metadata": {"name": EBS},
            "spec": {"attachRequired": true, "preventPodSchedulingIfMissing": true}
        }))
        .expect("CSIDriver"),
    ));
    let relaxed = Needs::of(
        &w,
        &p,
        &["pv-0".to_string()],
        Rules {
            require_csi_node: false,
        },
    );
    assert_eq!(choose(&w, &relaxed).node, None);
    // An attach-free volume without affinity pins nothing.
    let mut free: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": "nfs-0"},
        "spec": {"csi": {"driver": "nfs.example", "volumeHandle": "h"}}
    }))
    .expect("PV");
    free.metadata.name = Some("nfs-0".into());
    w.pvs.push(Arc::new(free));
    w.drivers.push(Arc::new(
        serde_json::from_value(
            json!({"metadata": {"name": "nfs.example"}, "spec": {"attachRequired": false}}),
        )
        .expect("CSIDriver"),
    ));
    let n = Needs::of(&w, &p, &["nfs-0".to_string()], Rules::default());
    assert!(!n.pinned());
}

#[test]
fn a_stateful_sets_replacement_is_judged_by_its_template_now() {
    let (w, p) = world();
    // Made when the template pinned it to `old`; the template no longer
    // does (an `OnDelete` StatefulSet whose pods come back changed).
    let mut pinned = p.clone();
    pinned.spec.as_mut().expect("spec").node_selector = Some(BTreeMap::from([(
        "kubernetes.io/hostname".to_string(),
        "old".to_string(),
    )]));
    assert_eq!(choose(&w, &needs(&w, &pinned)).node, None);
    let template = k8s_openapi::api::core::v1::PodSpec {
        containers: p.spec.clone().expect("spec").containers,
        ..Default::default()
    };
    let made = made_from(&pinned, &template);
    assert_eq!(
        made.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some("old")
    );
    assert_eq!(choose(&w, &needs(&w, &made)).node.as_deref(), Some("a1"));
}
