//! Compact constructors for the drain's unit tests.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, EphemeralVolumeSource, HostPathVolumeSource, PersistentVolume,
    PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource,
    PersistentVolumeSpec, Pod, PodSpec, PodStatus, Volume,
};
use k8s_openapi::api::policy::v1::{
    PodDisruptionBudget, PodDisruptionBudgetSpec, PodDisruptionBudgetStatus,
};
use k8s_openapi::api::storage::v1::{
    VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec, VolumeAttachmentStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, ObjectMeta, OwnerReference, Time,
};
use k8s_openapi::jiff::Timestamp;

/// The Node the fixtures' pods run on.
pub const NODE: &str = "node-1";

pub fn ts(secs: i64) -> Timestamp {
    Timestamp::from_second(secs).expect("timestamp in range")
}

fn meta(ns: Option<&str>, name: &str) -> ObjectMeta {
    ObjectMeta {
        namespace: ns.map(str::to_string),
        name: Some(name.to_string()),
        ..Default::default()
    }
}

/// A Running pod on [`NODE`] with uid `uid-<name>`.
pub fn pod(ns: &str, name: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            uid: Some(format!("uid-{name}")),
            ..meta(Some(ns), name)
        },
        spec: Some(PodSpec {
            node_name: Some(NODE.to_string()),
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".to_string()),
            ..Default::default()
        }),
    }
}

/// Chainable changes to a fixture pod.
pub trait PodFixture: Sized {
    fn mirror(self) -> Self;
    fn owned_by(self, kind: &str, name: &str, controller: bool) -> Self;
    fn phase(self, phase: &str) -> Self;
    fn deleting(self, since: Timestamp) -> Self;
    fn priority(self, priority: i32) -> Self;
    fn grace(self, seconds: i64) -> Self;
    fn claim(self, volume: &str, claim: &str) -> Self;
    fn ephemeral(self, volume: &str) -> Self;
    fn on_node(self, node: Option<&str>) -> Self;
    fn uid(self, uid: &str) -> Self;
    fn labels(self, labels: &[(&str, &str)]) -> Self;
}

impl PodFixture for Pod {
    fn mirror(mut self) -> Self {
        self.metadata
            .annotations
            .get_or_insert_default()
            .insert(crate::drain::select::MIRROR_ANNOTATION.into(), "abc".into());
        self
    }
    fn owned_by(mut self, kind: &str, name: &str, controller: bool) -> Self {
        self.metadata
            .owner_references
            .get_or_insert_default()
            .push(OwnerReference {
                api_version: "apps/v1".into(),
                kind: kind.into(),
                name: name.into(),
                uid: format!("uid-{name}"),
                controller: Some(controller),
                ..Default::default()
            });
        self
    }
    fn phase(mut self, phase: &str) -> Self {
        self.status.get_or_insert_default().phase = Some(phase.into());
        self
    }
    fn deleting(mut self, since: Timestamp) -> Self {
        self.metadata.deletion_timestamp = Some(Time(since));
        self
    }
    fn priority(mut self, priority: i32) -> Self {
        self.spec.get_or_insert_default().priority = Some(priority);
        self
    }
    fn grace(mut self, seconds: i64) -> Self {
        self.spec
            .get_or_insert_default()
            .termination_grace_period_seconds = Some(seconds);
        self
    }
    fn claim(mut self, volume: &str, claim: &str) -> Self {
        self.spec
            .get_or_insert_default()
            .volumes
            .get_or_insert_default()
            .push(Volume {
                name: volume.into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.into(),
                    read_only: None,
                }),
                ..Default::default()
            });
        self
    }
    fn ephemeral(mut self, volume: &str) -> Self {
        self.spec
            .get_or_insert_default()
            .volumes
            .get_or_insert_default()
            .push(Volume {
                name: volume.into(),
                ephemeral: Some(EphemeralVolumeSource::default()),
                ..Default::default()
            });
        self
    }
    fn on_node(mut self, node: Option<&str>) -> Self {
        self.spec.get_or_insert_default().node_name = node.map(str::to_string);
        self
    }
    fn uid(mut self, uid: &str) -> Self {
        self.metadata.uid = Some(uid.into());
        self
    }
    fn labels(mut self, labels: &[(&str, &str)]) -> Self {
        self.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        self
    }
}

/// A PVC, bound to `volume` when given.
pub fn pvc(ns: &str, name: &str, volume: Option<&str>) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: meta(Some(ns), name),
        spec: Some(PersistentVolumeClaimSpec {
            volume_name: volume.map(str::to_string),
            ..Default::default()
        }),
        status: None,
    }
}

/// A PVC created for an ephemeral volume of the pod with uid `owner_uid`.
pub fn ephemeral_pvc(ns: &str, name: &str, volume: &str, owner_uid: &str) -> PersistentVolumeClaim {
    let mut claim = pvc(ns, name, Some(volume));
    claim.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name: "owner".into(),
        uid: owner_uid.into(),
        controller: Some(true),
        ..Default::default()
    }]);
    claim
}

pub fn csi_pv(name: &str, driver: &str, handle: &str) -> PersistentVolume {
    PersistentVolume {
        metadata: meta(None, name),
        spec: Some(PersistentVolumeSpec {
            csi: Some(CSIPersistentVolumeSource {
                driver: driver.into(),
                volume_handle: handle.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// A PV with no volume source berth knows: attachable, with no unique name.
pub fn bare_pv(name: &str) -> PersistentVolume {
    PersistentVolume {
        metadata: meta(None, name),
        spec: Some(PersistentVolumeSpec::default()),
        status: None,
    }
}

/// A hostPath PV: node-local.
pub fn host_pv(name: &str) -> PersistentVolume {
    PersistentVolume {
        metadata: meta(None, name),
        spec: Some(PersistentVolumeSpec {
            host_path: Some(HostPathVolumeSource {
                path: "/data".into(),
                type_: None,
            }),
            ..Default::default()
        }),
        status: None,
    }
}

pub fn va(pv: &str, node: &str, attached: bool) -> VolumeAttachment {
    VolumeAttachment {
        metadata: meta(None, &format!("csi-{pv}-{node}")),
        spec: VolumeAttachmentSpec {
            attacher: "ebs.csi.aws.com".into(),
            node_name: node.into(),
            source: VolumeAttachmentSource {
                persistent_volume_name: Some(pv.into()),
                inline_volume_spec: None,
            },
        },
        status: Some(VolumeAttachmentStatus {
            attached,
            ..Default::default()
        }),
    }
}

pub fn match_labels(labels: &[(&str, &str)]) -> LabelSelector {
    LabelSelector {
        match_labels: Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        ),
        match_expressions: None,
    }
}

pub fn expression(key: &str, operator: &str, values: &[&str]) -> LabelSelectorRequirement {
    LabelSelectorRequirement {
        key: key.into(),
        operator: operator.into(),
        values: (!values.is_empty()).then(|| values.iter().map(|v| v.to_string()).collect()),
    }
}

/// The status numbers of a PDB: (generation, observedGeneration,
/// expectedPods, currentHealthy, disruptionsAllowed).
pub type PdbNumbers = (i64, i64, i32, i32, i32);

pub fn pdb(
    ns: &str,
    name: &str,
    selector: Option<LabelSelector>,
    (generation, observed, expected, healthy, allowed): PdbNumbers,
) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: ObjectMeta {
            generation: Some(generation),
            ..meta(Some(ns), name)
        },
        spec: Some(PodDisruptionBudgetSpec {
            selector,
            ..Default::default()
        }),
        status: Some(PodDisruptionBudgetStatus {
            observed_generation: Some(observed),
            expected_pods: Some(expected),
            current_healthy: Some(healthy),
            desired_healthy: Some(expected),
            disruptions_allowed: Some(allowed),
            ..Default::default()
        }),
    }
}

/// A CSIDriver `name` that does (or does not) require attach.
pub fn csi_driver(name: &str, attach_required: bool) -> k8s_openapi::api::storage::v1::CSIDriver {
    k8s_openapi::api::storage::v1::CSIDriver {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: k8s_openapi::api::storage::v1::CSIDriverSpec {
            attach_required: Some(attach_required),
            ..Default::default()
        },
    }
}

/// A stateful pod of the plan without volumes, PDBs or notes: priority
/// `priority`, `ns/name`, a 30 s grace period and a 60 s pod-gone bound.
pub fn planned(priority: i32, ns: &str, name: &str) -> crate::drain::plan::PlannedPod {
    crate::drain::plan::PlannedPod {
        pod: (ns.to_string(), name.to_string()),
        uid: None,
        priority,
        order: 0,
        order_source: None,
        grace: std::time::Duration::from_secs(30),
        bounds: crate::drain::deadline::StepBounds {
            pod_gone: std::time::Duration::from_secs(60),
            detach: None,
            reattach: None,
        },
        volumes: Vec::new(),
        pdbs: Vec::new(),
        notes: Vec::new(),
        scratch: Vec::new(),
        held: None,
        rule: None,
        controller: None,
        rule_terms: None,
    }
}
