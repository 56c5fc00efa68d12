//! What is dropped from objects before they enter the caches.
//!
//! The caches hold every pod of the cluster; a Pod as the API server sends
//! it carries containers, their environment, probes and statuses, projected
//! token volumes and `managedFields`, none of which a decision reads. At
//! 20,000 pods the difference is the controller's memory budget. Each
//! function below keeps exactly the fields the reconciler, the drain and the
//! volume tracker read; a test checks that the drain plans the same from
//! trimmed and untrimmed pods. A decision that starts reading another field
//! must keep it here too.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStatus, RollingUpdateStatefulSetStrategy, StatefulSet,
    StatefulSetSpec, StatefulSetStatus, StatefulSetUpdateStrategy,
};
use k8s_openapi::api::core::v1::{
    Affinity, EmptyDirVolumeSource, Node, NodeAffinity, Pod, PodSpec, PodStatus, PodTemplateSpec,
};
use k8s_openapi::api::storage::v1::{CSIDriver, CSIDriverSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;

use crate::api::resources::pod_requests;

/// Every object: `managedFields` (often the largest part of an object) and
/// the last-applied annotation of `kubectl apply`, a second copy of the
/// object.
pub fn metadata<K: Resource>(obj: &mut K) {
    let meta = obj.meta_mut();
    meta.managed_fields = None;
    if let Some(a) = meta.annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

/// A pod keeps its metadata (labels for PodDisruptionBudgets, owners, the
/// mirror annotation and the drain rule annotations, UID, deletion
/// timestamp), of its spec the Node, the priority and its class (critical
/// pods go last), the grace period, its claim-backed volumes
/// (`persistentVolumeClaim` and generic `ephemeral`), its inline volumes
/// of the kinds that attach (see [`super::inline`]) and the names of its
/// `emptyDir` volumes (scratch, for the plan), and of its status the phase
/// and the `Ready` condition (an attach-free volume has moved when the pod
/// that uses it next is Ready).
pub fn pod(pod: &mut Pod) {
    metadata(pod);
    if let Some(spec) = pod.spec.as_mut() {
        let volumes = spec.volumes.take().map(|vs| {
            vs.into_iter()
                .filter_map(|mut v| {
                    if v.empty_dir.is_some() {
                        v.empty_dir = Some(EmptyDirVolumeSource::default());
                        return Some(v);
                    }
                    (v.persistent_volume_claim.is_some()
                        || v.ephemeral.is_some()
                        || super::inline::inline_claim_name(&v).is_some())
                    .then_some(v)
                })
                .collect::<Vec<_>>()
        });
        let scheduling = scheduling(spec);
        *spec = PodSpec {
            node_name: spec.node_name.take(),
            priority: spec.priority,
            priority_class_name: spec.priority_class_name.take(),
            termination_grace_period_seconds: spec.termination_grace_period_seconds,
            volumes: volumes.filter(|v| !v.is_empty()),
            ..scheduling
        };
    }
    if let Some(status) = pod.status.as_mut() {
        // Ready (for the replacement of a volume that needs no attach) and
        // the scheduler's refusal (PodScheduled False, with its message: the
        // drain reports a replacement it cannot place) are kept.
        let kept = status
            .conditions
            .take()
            .into_iter()
            .flatten()
            .filter_map(|mut c| match (c.type_.as_str(), c.status.as_str()) {
                ("Ready", _) => {
                    c.message = None;
                    c.reason = None;
                    Some(c)
                }
                ("PodScheduled", "False") => Some(c),
                _ => None,
            })
            .collect::<Vec<_>>();
        *status = PodStatus {
            phase: status.phase.take(),
            conditions: (!kept.is_empty()).then_some(kept),
            ..PodStatus::default()
        };
    }
}

/// What a destination for a pod's replacement is judged by (see
/// `crate::placement`), taken from `spec`: its tolerations, node selector
/// and required node affinity, and what it asks of a Node. The last is
/// kept as its sum ([`pod_requests`]) in `overhead`, with no container:
/// a `Container` per container of every pod is the cache's largest cost,
/// and the sum of a spec that has only an overhead is that overhead.
fn scheduling(spec: &mut PodSpec) -> PodSpec {
    let affinity = spec
        .affinity
        .take()
        .and_then(|a| a.node_affinity)
        .and_then(|n| n.required_during_scheduling_ignored_during_execution)
        .map(|required| Affinity {
            node_affinity: Some(NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(required),
                ..NodeAffinity::default()
            }),
            ..Affinity::default()
        });
    let asks = pod_requests(spec);
    let mut sum = BTreeMap::new();
    if asks.cpu_milli > 0 {
        sum.insert("cpu".to_string(), Quantity(format!("{}m", asks.cpu_milli)));
    }
    if asks.memory > 0 {
        sum.insert("memory".to_string(), Quantity(asks.memory.to_string()));
    }
    PodSpec {
        tolerations: spec.tolerations.take().filter(|t| !t.is_empty()),
        node_selector: spec.node_selector.take().filter(|s| !s.is_empty()),
        affinity,
        overhead: (!sum.is_empty()).then_some(sum),
        ..PodSpec::default()
    }
}

/// A CSIDriver keeps its name and `spec.attachRequired`.
pub fn csi_driver(driver: &mut CSIDriver) {
    metadata(driver);
    driver.metadata.annotations = None;
    driver.metadata.labels = None;
    driver.spec = CSIDriverSpec {
        attach_required: driver.spec.attach_required,
        prevent_pod_scheduling_if_missing: driver.spec.prevent_pod_scheduling_if_missing,
        ..CSIDriverSpec::default()
    };
}

/// A Node drops its list of container images (the largest part of a real
/// Node's status, read by nothing here).
pub fn node(node: &mut Node) {
    metadata(node);
    if let Some(status) = node.status.as_mut() {
        status.images = None;
    }
}

/// A StatefulSet keeps its metadata (the move budget's annotations) and,
/// of its spec, the replicas and ordinals it wants (whether an evicted
/// pod comes back), `minReadySeconds` (when a replacement is available)
/// and its rolling update's `maxUnavailable` (its default move budget);
/// its pod template, claim templates and the rest of its update strategy
/// go.
pub fn stateful_set(sts: &mut StatefulSet) {
    metadata(sts);
    sts.metadata.labels = None;
    let spec = &mut sts.spec;
    let max_unavailable = spec
        .update_strategy
        .take()
        .and_then(|u| u.rolling_update)
        .and_then(|r| r.max_unavailable);
    // What its replacement pods are judged by before an eviction: a pod
    // made before a template change (`OnDelete`) comes back as the
    // template says now.
    let template = spec.template.spec.as_mut().map(scheduling);
    *spec = StatefulSetSpec {
        replicas: spec.replicas,
        ordinals: spec.ordinals.take(),
        template: PodTemplateSpec {
            metadata: None,
            spec: template,
        },
        min_ready_seconds: spec.min_ready_seconds,
        update_strategy: max_unavailable.map(|m| StatefulSetUpdateStrategy {
            rolling_update: Some(RollingUpdateStatefulSetStrategy {
                max_unavailable: Some(m),
                partition: None,
            }),
            type_: None,
        }),
        ..StatefulSetSpec::default()
    };
    // How many of its replicas are available: the move budget counts
    // those down for any reason.
    sts.status = sts.status.take().map(|s| StatefulSetStatus {
        replicas: s.replicas,
        available_replicas: s.available_replicas,
        ..StatefulSetStatus::default()
    });
}

/// A Deployment keeps its metadata (the move budget's annotations), its
/// `minReadySeconds`, the replicas it wants and has available, its
/// strategy and, of its pod template, only the annotation of berth's
/// surge (whether berth rolled it, see `drain::surge`).
pub fn deployment(d: &mut Deployment) {
    metadata(d);
    d.metadata.labels = None;
    let spec = &mut d.spec;
    let surged = spec
        .template
        .metadata
        .as_mut()
        .and_then(|m| m.annotations.as_mut())
        .and_then(|a| a.remove(crate::api::SURGED_FOR_ANNOTATION));
    *spec = DeploymentSpec {
        replicas: spec.replicas,
        min_ready_seconds: spec.min_ready_seconds,
        strategy: spec.strategy.take(),
        ..DeploymentSpec::default()
    };
    if let Some(v) = surged {
        spec.template.metadata = Some(ObjectMeta {
            annotations: Some([(crate::api::SURGED_FOR_ANNOTATION.to_string(), v)].into()),
            ..ObjectMeta::default()
        });
    }
    d.status = d.status.take().map(|s| DeploymentStatus {
        available_replicas: s.available_replicas,
        ..DeploymentStatus::default()
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::settings::ResolvedSettings;
    use crate::drain::cluster_rules::RuleBook;
    use crate::drain::fixtures::{
        PodFixture, csi_pv, match_labels, pdb, pod as fixture_pod, pvc, va,
    };
    use crate::drain::plan::plan;
    use crate::drain::volume_kind::VolumeContext;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    /// A pod as the API server sends it, with everything a kubelet and the
    /// admission plugins add.
    fn full_pod(name: &str, claim: Option<&str>) -> Pod {
        let mut volumes = vec![serde_json::json!({
            "name": "kube-api-access-x",
            "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}
        })];
        if let Some(c) = claim {
            volumes.push(
                serde_json::json!({"name": "data", "persistentVolumeClaim": {"claimName": c}}),
            );
        }
        volumes.push(serde_json::json!({"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}}));
        if claim.is_some() {
            volumes.push(serde_json::json!({"name": "disk", "awsElasticBlockStore": {"volumeID": format!("vol-{name}")}}));
            volumes.push(serde_json::json!({"name": "share", "nfs": {"server": "s", "path": "/"}}));
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "namespace": "db", "name": name, "uid": format!("uid-{name}"),
                "labels": {"app": "db"},
                "annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": "{...}",
                    "note": "kept"
                },
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "db",
                                     "uid": "ss", "controller": true}],
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}]
            },
            "spec": {
                "nodeName": "node-1",
                "priority": 100,
                "priorityClassName": "high",
                "terminationGracePeriodSeconds": 30,
                "containers": [{"name": "c", "image": "db:1", "env": [{"name": "A", "value": "b"}],
                                "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2"}}}],
                "nodeSelector": {"disk": "ssd"},
                "affinity": {
                    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [
                            {"key": "zone", "operator": "In", "values": ["a"]}]}]}},
                    "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                        {"topologyKey": "kubernetes.io/hostname"}]}
                },
                "tolerations": [{"key": "k", "operator": "Exists"}, {"operator": "Exists"}],
                "volumes": volumes
            },
            "status": {
                "phase": "Running",
                "podIP": "10.0.0.1",
                "conditions": [
                    {"type": "Ready", "status": "True", "message": "m"},
                    {"type": "PodScheduled", "status": "True"}
                ],
                "containerStatuses": [{"name": "c", "image": "db:1", "imageID": "x", "ready": true,
                                       "restartCount": 0}]
            }
        }))
        .expect("pod")
    }

    #[test]
    fn a_pod_keeps_what_decisions_read_and_nothing_else() {
        let mut p = full_pod("pg-0", Some("data-pg-0"));
        pod(&mut p);
        assert_eq!(p.metadata.managed_fields, None);
        let annotations = p.metadata.annotations.as_ref().expect("annotations");
        assert_eq!(annotations.len(), 1, "{annotations:?}");
        assert_eq!(annotations["note"], "kept");
        assert_eq!(p.metadata.owner_references.as_ref().map(Vec::len), Some(1));
        assert_eq!(p.metadata.uid.as_deref(), Some("uid-pg-0"));
        let spec = p.spec.as_ref().expect("spec");
        assert_eq!(spec.node_name.as_deref(), Some("node-1"));
        assert_eq!(spec.priority, Some(100));
        assert_eq!(spec.priority_class_name.as_deref(), Some("high"));
        assert_eq!(spec.termination_grace_period_seconds, Some(30));
        // What a destination for its replacement is judged by: its
        // requests as their sum, no container.
        assert!(spec.containers.is_empty() && spec.init_containers.is_none());
        assert_eq!(
            serde_json::to_value(&spec.overhead).expect("overhead"),
            serde_json::json!({"cpu": "1000m"})
        );
        assert_eq!(
            crate::api::resources::pod_requests(spec).cpu_milli,
            1000,
            "the sum the scheduler would count"
        );
        assert_eq!(spec.tolerations.as_ref().map(Vec::len), Some(2));
        assert_eq!(
            spec.node_selector.as_ref().map(|s| s["disk"].as_str()),
            Some("ssd")
        );
        let affinity = spec.affinity.as_ref().expect("affinity");
        assert!(affinity.pod_anti_affinity.is_none());
        assert!(affinity.node_affinity.as_ref().is_some_and(|n| {
            n.required_during_scheduling_ignored_during_execution
                .is_some()
        }));
        let volumes = spec.volumes.as_ref().expect("the claim's volume");
        assert_eq!(
            volumes.len(),
            3,
            "the NFS share attaches nowhere: {volumes:?}"
        );
        assert_eq!(volumes[0].name, "data");
        assert_eq!(volumes[1].name, "cache");
        assert_eq!(volumes[1].empty_dir, Some(Default::default()));
        assert_eq!(
            volumes[2].name, "disk",
            "an inline volume that attaches stays"
        );
        let status = p.status.as_ref().expect("status");
        assert_eq!(status.phase.as_deref(), Some("Running"));
        let conditions = status.conditions.as_ref().expect("Ready");
        assert_eq!(conditions.len(), 1);
        assert_eq!(
            (conditions[0].type_.as_str(), conditions[0].status.as_str()),
            ("Ready", "True")
        );
        assert_eq!(conditions[0].message, None);
        assert_eq!(status.pod_ip, None);
        assert_eq!(status.container_statuses, None);

        let mut pending = full_pod("pg-1", Some("data-pg-1"));
        pending.status = serde_json::from_value(serde_json::json!({
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                            "message": "0/3 nodes are available"}]
        }))
        .expect("status");
        pod(&mut pending);
        let kept = pending
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default();
        assert_eq!(
            kept.iter().map(|c| c.reason.as_deref()).collect::<Vec<_>>(),
            [Some("Unschedulable")],
            "the scheduler's refusal is kept"
        );

        let mut no_claims = full_pod("web", None);
        pod(&mut no_claims);
        let names: Vec<String> = no_claims
            .spec
            .and_then(|s| s.volumes)
            .into_iter()
            .flatten()
            .map(|v| v.name)
            .collect();
        assert_eq!(names, ["cache"]);
    }

    #[test]
    fn the_drain_plans_the_same_from_trimmed_pods() {
        use crate::drain::rules::{DRAIN_ANNOTATION, ORDER_ANNOTATION};
        let mut critical = full_pod("dns", None);
        if let Some(spec) = critical.spec.as_mut() {
            spec.priority = None;
            spec.priority_class_name = Some("system-cluster-critical".into());
        }
        let ruled = |name: &str, key: &str, value: &str| {
            let mut p = full_pod(name, None);
            p.metadata
                .annotations
                .get_or_insert_default()
                .insert(key.into(), value.into());
            p
        };
        let pods = vec![
            critical,
            ruled("batch", DRAIN_ANNOTATION, "wait-completed"),
            ruled("agent", DRAIN_ANNOTATION, "skip"),
            ruled("late", ORDER_ANNOTATION, "5"),
            ruled("odd", ORDER_ANNOTATION, "soon"),
            full_pod("pg-0", Some("data-pg-0")),
            full_pod("pg-1", Some("data-pg-1")),
            full_pod("web", None),
            fixture_pod("db", "old")
                .on_node(Some("node-1"))
                .phase("Succeeded"),
            fixture_pod("kube-system", "static")
                .on_node(Some("node-1"))
                .mirror(),
            fixture_pod("db", "ds")
                .on_node(Some("node-1"))
                .owned_by("DaemonSet", "agent", true),
        ];
        let pvcs = [
            pvc("db", "data-pg-0", Some("pv-0")),
            pvc("db", "data-pg-1", Some("pv-1")),
        ];
        let pvs = [csi_pv("pv-0", "d.csi", "h0"), csi_pv("pv-1", "d.csi", "h1")];
        let pdbs = [pdb(
            "db",
            "db",
            Some(match_labels(&[("app", "db")])),
            (1, 1, 2, 2, 1),
        )];
        let vas = [va("pv-0", "node-1", true), va("pv-1", "node-1", true)];
        let settings = ResolvedSettings::default();
        let trimmed: Vec<Pod> = pods
            .iter()
            .cloned()
            .map(|mut p| {
                pod(&mut p);
                p
            })
            .collect();
        let ctx = VolumeContext::default();
        let before = plan(
            "node-1",
            &pods,
            &pvcs,
            &pvs,
            &pdbs,
            &vas,
            &ctx,
            &settings,
            &RuleBook::default(),
        );
        let after = plan(
            "node-1",
            &trimmed,
            &pvcs,
            &pvs,
            &pdbs,
            &vas,
            &ctx,
            &settings,
            &RuleBook::default(),
        );
        assert_eq!(before.to_string(), after.to_string());
        assert_eq!(before.stateful.len(), 2, "{before}");
        let report = after.to_string();
        for line in [
            "order 1000 (critical: priorityClassName system-cluster-critical): 1 without persistent volumes",
            "order 5 (berth.dev/drain-order): 1 without persistent volumes",
            "db/agent: drain rule berth.dev/drain=skip",
            "db/batch: drain rule berth.dev/drain=wait-completed",
            "db/odd: berth.dev/drain-order=\"soon\" is not a 32-bit integer",
        ] {
            assert!(report.contains(line), "{line:?}:\n{report}");
        }
    }

    #[test]
    fn a_csi_driver_keeps_its_name_and_attach_required() {
        let mut d: CSIDriver = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "nfs.csi.k8s.io", "labels": {"a": "b"}},
            "spec": {"attachRequired": false, "podInfoOnMount": true,
                     "volumeLifecycleModes": ["Persistent"]}
        }))
        .expect("driver");
        csi_driver(&mut d);
        assert_eq!(d.metadata.name.as_deref(), Some("nfs.csi.k8s.io"));
        assert_eq!(d.metadata.labels, None);
        assert_eq!(
            d.spec,
            CSIDriverSpec {
                attach_required: Some(false),
                ..Default::default()
            }
        );
    }

    #[test]
    fn a_node_drops_its_images() {
        let mut n: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n"},
            "spec": {"providerID": "fake://n"},
            "status": {
                "images": [{"names": ["db:1"], "sizeBytes": 1}],
                "volumesAttached": [{"name": "kubernetes.io/csi/d^h", "devicePath": ""}],
                "conditions": [{"type": "Ready", "status": "True"}]
            }
        }))
        .expect("node");
        node(&mut n);
        let status = n.status.expect("status");
        assert_eq!(status.images, None);
        assert_eq!(status.volumes_attached.map(|v| v.len()), Some(1));
        assert_eq!(status.conditions.map(|c| c.len()), Some(1));
        assert_eq!(
            n.spec.and_then(|s| s.provider_id).as_deref(),
            Some("fake://n")
        );
    }

    #[test]
    fn workloads_keep_what_a_move_reads_of_them() {
        let mut sts: StatefulSet = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "db", "namespace": "ns",
                "annotations": {"berth.dev/max-moving": "2"}, "labels": {"app": "db"},
                "managedFields": [{"manager": "kubectl"}]},
            "spec": {"replicas": 3, "ordinals": {"start": 2}, "minReadySeconds": 20,
                "updateStrategy": {"type": "RollingUpdate",
                    "rollingUpdate": {"maxUnavailable": "70%", "partition": 1}},
                "serviceName": "db", "selector": {"matchLabels": {"app": "db"}},
                "template": {"metadata": {"labels": {"app": "db"}},
                    "spec": {"containers": [{"name": "db", "image": "postgres",
                                             "resources": {"requests": {"cpu": "1"}}}],
                             "nodeSelector": {"disk": "ssd"}}},
                "volumeClaimTemplates": [{"metadata": {"name": "data"}}]},
            "status": {"replicas": 3, "readyReplicas": 3, "availableReplicas": 2,
                "currentRevision": "db-1", "conditions": []}
        }))
        .expect("a StatefulSet");
        stateful_set(&mut sts);
        let pod = "db-4";
        assert_eq!(
            crate::drain::ledger::workload::wants_ordinal(&sts, pod),
            Some(true)
        );
        let terms = crate::drain::ledger::workload::stateful_set_terms(&sts);
        assert_eq!(terms.min_ready, std::time::Duration::from_secs(20));
        assert_eq!(terms.annotations.len(), 1);
        assert_eq!(
            terms.max_unavailable,
            Some(2),
            "70% of 3 replicas, rounded down as the StatefulSet controller does"
        );
        let spec = &sts.spec;
        assert!(spec.template.metadata.is_none() && spec.volume_claim_templates.is_none());
        // What its replacements are judged by before an eviction.
        let template = spec
            .template
            .spec
            .as_ref()
            .expect("the template's scheduling");
        assert_eq!(
            serde_json::to_value(template).expect("template"),
            serde_json::json!({"containers": [], "nodeSelector": {"disk": "ssd"},
                               "overhead": {"cpu": "1000m"}})
        );
        let rolling = spec
            .update_strategy
            .as_ref()
            .and_then(|u| u.rolling_update.as_ref())
            .expect("the rolling update's maxUnavailable is kept");
        assert_eq!(
            (&rolling.max_unavailable, rolling.partition),
            (&Some(IntOrString::String("70%".into())), None),
            "its maxUnavailable alone"
        );
        assert_eq!(
            spec.update_strategy
                .as_ref()
                .and_then(|u| u.type_.as_deref()),
            None
        );
        assert_eq!(
            terms.availability,
            Some(crate::drain::ledger::Availability {
                replicas: 3,
                unavailable: 1
            })
        );
        let status = sts.status.as_ref().expect("status");
        assert!(status.current_revision.is_none() && status.conditions.is_none());
        assert!(sts.metadata.managed_fields.is_none());

        let mut d: Deployment = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "annotations": {"berth.dev/min-healthy-time": "5s"}},
            "spec": {"replicas": 4, "minReadySeconds": 7, "selector": {},
                "template": {"spec": {"containers": [{"name": "web", "image": "nginx"}]}}},
            "status": {"replicas": 4, "availableReplicas": 4, "conditions": []}
        }))
        .expect("a Deployment");
        deployment(&mut d);
        let terms = crate::drain::ledger::workload::deployment_terms(&d);
        assert_eq!(terms.min_ready, std::time::Duration::from_secs(7));
        assert_eq!(terms.annotations.len(), 1);
        assert!(d.spec.template.spec.is_none());
        assert_eq!(
            terms.availability,
            Some(crate::drain::ledger::Availability {
                replicas: 4,
                unavailable: 0
            })
        );
        assert!(d.status.as_ref().expect("status").conditions.is_none());
    }
}
