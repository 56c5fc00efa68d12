//! Small builders for the objects that tests, the demo and the benchmark put
//! into a test bed. Each returns a plain `k8s-openapi` object, so a caller can
//! adjust any field before creating it.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, StatefulSet, StatefulSetSpec};
use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Container, Namespace, Node, NodeSpec, ObjectReference,
    PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeSpec,
    PodSpec, PodTemplateSpec, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};

use super::stages::CSI_DRIVER;
use super::{CONTROLLER_MANAGED_ATTACH_ANNOTATION, KWOK_NODE_ANNOTATION};

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub fn namespace(name: &str) -> Namespace {
    Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// A Node that kwok brings to Ready and the attach-detach controller serves.
pub fn node(name: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            annotations: Some(labels(&[
                KWOK_NODE_ANNOTATION,
                CONTROLLER_MANAGED_ATTACH_ANNOTATION,
            ])),
            labels: Some(labels(&[
                ("kubernetes.io/hostname", name),
                ("kubernetes.io/os", "linux"),
                ("type", "kwok"),
            ])),
            ..Default::default()
        },
        spec: Some(NodeSpec::default()),
        ..Default::default()
    }
}

/// A CSI PersistentVolume served by the test bed's attacher, pre-bound to
/// the claim `namespace/claim` (e.g. `data-db-0` for a StatefulSet `db` with
/// a volume claim template `data`).
pub fn csi_pv(name: &str, volume_handle: &str, namespace: &str, claim: &str) -> PersistentVolume {
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([(
                "storage".to_string(),
                Quantity("1Gi".into()),
            )])),
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            persistent_volume_reclaim_policy: Some("Retain".into()),
            storage_class_name: Some(String::new()),
            claim_ref: Some(ObjectReference {
                namespace: Some(namespace.into()),
                name: Some(claim.into()),
                ..Default::default()
            }),
            csi: Some(CSIPersistentVolumeSource {
                driver: CSI_DRIVER.into(),
                volume_handle: volume_handle.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A StatefulSet whose pods each mount one claim from the template `data`,
/// with the given grace period and priority class.
pub fn stateful_set(name: &str, replicas: i32, grace_seconds: i64) -> StatefulSet {
    let sel = labels(&[("app", name)]);
    StatefulSet {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: StatefulSetSpec {
            replicas: Some(replicas),
            service_name: Some(name.into()),
            pod_management_policy: Some("Parallel".into()),
            selector: LabelSelector {
                match_labels: Some(sel.clone()),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(sel),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    termination_grace_period_seconds: Some(grace_seconds),
                    containers: vec![Container {
                        name: "main".into(),
                        image: Some("registry.invalid/app:1".into()),
                        volume_mounts: Some(vec![VolumeMount {
                            name: "data".into(),
                            mount_path: "/data".into(),
                            ..Default::default()
                        }]),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
            },
            volume_claim_templates: Some(vec![PersistentVolumeClaim {
                metadata: ObjectMeta {
                    name: Some("data".into()),
                    ..Default::default()
                },
                spec: Some(PersistentVolumeClaimSpec {
                    access_modes: Some(vec!["ReadWriteOnce".into()]),
                    storage_class_name: Some(String::new()),
                    resources: Some(VolumeResourceRequirements {
                        requests: Some(BTreeMap::from([(
                            "storage".to_string(),
                            Quantity("1Gi".into()),
                        )])),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The unique volume name the attach-detach controller puts in
/// `node.status.volumesAttached` for a CSI volume.
pub fn csi_unique_name(driver: &str, volume_handle: &str) -> String {
    berth::volumes::csi_unique_name(driver, volume_handle)
}

/// Nodes of a test pool carry this label; workloads select it.
pub const POOL_LABEL: &str = "testbed.berth.dev/pool";

/// [`stateful_set`] kept to the Nodes of `pool`, with an optional priority
/// class.
pub fn stateful_set_in_pool(
    name: &str,
    replicas: i32,
    grace_seconds: i64,
    pool: &str,
    priority_class: Option<&str>,
) -> StatefulSet {
    let mut sts = stateful_set(name, replicas, grace_seconds);
    if let Some(spec) = sts.spec.template.spec.as_mut() {
        spec.node_selector = Some(labels(&[(POOL_LABEL, pool)]));
        spec.priority_class_name = priority_class.map(String::from);
    }
    sts
}

/// A Deployment of pods without volumes, kept to the Nodes of `pool`.
pub fn deployment(name: &str, replicas: i32, grace_seconds: i64, pool: &str) -> Deployment {
    let sel = labels(&[("app", name)]);
    Deployment {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(sel.clone()),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(sel),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    node_selector: Some(labels(&[(POOL_LABEL, pool)])),
                    termination_grace_period_seconds: Some(grace_seconds),
                    containers: vec![Container {
                        name: "main".into(),
                        image: Some("registry.invalid/app:1".into()),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The berth objects every test, the benchmark and the demo make, so that
/// each is built one way. Each returns the object for the caller to adjust
/// (a namespace, settings) before it is created.
fn berth_object<T: serde::de::DeserializeOwned>(kind: &str, v: serde_json::Value) -> T {
    let mut v = v;
    v["apiVersion"] = "berth.dev/v1alpha1".into();
    v["kind"] = kind.into();
    serde_json::from_value(v).unwrap_or_else(|e| panic!("a valid {kind}: {e}"))
}

/// Machine `name` of MachineClass `class`.
pub fn machine(name: &str, class: &str) -> berth::api::Machine {
    berth_object(
        "Machine",
        serde_json::json!({"metadata": {"name": name}, "spec": {"classRef": {"name": class}}}),
    )
}

/// MachineClass `name` of `provider`, with `provider_spec`. A `fake` VM
/// runs the test bed's CSI driver ([`CSI_DRIVER`],
/// registered in its Node's CSINode) unless `provider_spec` says which.
pub fn machine_class(
    name: &str,
    provider: &str,
    mut provider_spec: serde_json::Value,
) -> berth::api::MachineClass {
    if provider == "fake" {
        if provider_spec.is_null() {
            provider_spec = serde_json::json!({});
        }
        if let Some(spec) = provider_spec.as_object_mut() {
            spec.entry("csiDrivers")
                .or_insert_with(|| serde_json::json!([{"name": super::stages::CSI_DRIVER}]));
        }
    }
    berth_object(
        "MachineClass",
        serde_json::json!({"metadata": {"name": name},
            "spec": {"provider": provider, "providerSpec": provider_spec}}),
    )
}

/// A `fake` MachineClass `name` whose Nodes join pool `pool` (the
/// [`POOL_LABEL`] the fixtures' pods select), with drain settings `drain`.
pub fn pool_class(name: &str, pool: &str, drain: serde_json::Value) -> berth::api::MachineClass {
    let mut c = machine_class(
        name,
        "fake",
        serde_json::json!({"nodeLabels": {POOL_LABEL: pool}}),
    );
    c.spec.drain = Some(serde_json::from_value(drain).expect("drain settings"));
    c
}

/// MachineSet `name` of `replicas` Machines of class `class`, selected by
/// the label `set: <name>`.
pub fn machine_set(name: &str, class: &str, replicas: i32) -> berth::api::MachineSet {
    berth_object(
        "MachineSet",
        serde_json::json!({"metadata": {"name": name}, "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"set": name}},
            "template": {"metadata": {"labels": {"set": name}}, "spec": {"classRef": {"name": class}}}
        }}),
    )
}

/// MachineDeployment `name` of `replicas` Machines of class `class`,
/// selected by the label `label: <name>`, rolled out by `strategy` (`null`:
/// the default).
pub fn machine_deployment(
    name: &str,
    class: &str,
    replicas: i32,
    label: &str,
    strategy: serde_json::Value,
) -> berth::api::MachineDeployment {
    let mut spec = serde_json::json!({
        "replicas": replicas,
        "selector": {"matchLabels": {label: name}},
        "template": {"metadata": {"labels": {label: name}}, "spec": {"classRef": {"name": class}}}
    });
    if !strategy.is_null() {
        spec["strategy"] = strategy;
    }
    berth_object(
        "MachineDeployment",
        serde_json::json!({"metadata": {"name": name}, "spec": spec}),
    )
}

/// A `RollingUpdate` strategy of `surge` and `unavailable`.
pub fn rolling(surge: serde_json::Value, unavailable: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}
    })
}
