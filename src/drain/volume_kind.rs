//! What kind of volume each volume of a pod is, which decides what the
//! drain waits for when the pod moves. Pure: the CSIDriver objects and the
//! Node come in as plain data.
//!
//! | kind | what it is | what the drain does |
//! | --- | --- | --- |
//! | **attachable** | a CSI PV whose CSIDriver requires attach (or has no CSIDriver object: Kubernetes then assumes attach), an in-tree PV CSI migration moves to such a driver (EBS, GCE PD, Azure disk, Cinder, vSphere, Portworx), an in-tree iSCSI, FC, RBD or FlexVolume PV the Node lists in `status.volumesAttached` (the attach-detach controller attaches those itself, without a VolumeAttachment) | waits for it to detach from the Node, then to be attached where the replacement pod runs |
//! | **attach-free** | a CSI PV whose CSIDriver says `attachRequired: false` (NFS, EFS, CephFS, SMB, many local-volume drivers), in-tree network kinds that are never attached (nfs, cephfs, glusterfs, azureFile, ...), an iSCSI, FC, RBD or FlexVolume PV the Node does not list (a FlexVolume driver without attach, a Node whose kubelet attaches) | no detach or attach wait: the move is done when the pod that now uses the claim is Running and Ready on another Node |
//! | **node-local** | `spec.local`, `spec.hostPath`, or a PV whose node affinity only this Node meets (every term requires this Node by `kubernetes.io/hostname` or `metadata.name`) | its data cannot follow the pod: `nodeLocalVolumes` says whether the pod is evicted anyway (data lost with the VM, always named) or held |
//! | **scratch** | an `emptyDir` of the pod | nothing to wait for: lost with the pod, which goes with the pods without persistent volumes |
//!
//! The rules are checked in that order, so a CSI local-volume driver's PV
//! pinned to this Node is node-local whatever its CSIDriver says.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, PersistentVolume, Pod};
use k8s_openapi::api::storage::v1::CSIDriver;

use crate::volumes::{in_tree_attachable_name, migrated_csi_source};

/// The label a Node's hostname is in; local PVs are pinned by it.
const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// The kind of a volume, for the drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum VolumeKind {
    Attachable,
    AttachFree,
    NodeLocal,
    Scratch,
}

impl VolumeKind {
    /// The kind as `berth plan`, `status.drain` and Events name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Attachable => "attachable",
            Self::AttachFree => "attach-free",
            Self::NodeLocal => "node-local",
            Self::Scratch => "scratch",
        }
    }
}

impl fmt::Display for VolumeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A volume's kind and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classified {
    pub kind: VolumeKind,
    /// What made it that kind, in words.
    pub why: String,
}

impl Classified {
    fn new(kind: VolumeKind, why: impl Into<String>) -> Self {
        Self {
            kind,
            why: why.into(),
        }
    }
}

/// What classifying a draining Node's volumes needs beyond the PVs: the
/// CSIDriver objects and the Node's names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeContext {
    /// `spec.attachRequired` of each CSIDriver (absent = true, the API
    /// default).
    attach_required: BTreeMap<String, bool>,
    /// The Node's name and its `kubernetes.io/hostname` label.
    node_names: BTreeSet<String>,
    /// The names in the Node's `status.volumesAttached`; `None` when the
    /// Node is not known (gone from the cache).
    listed: Option<BTreeSet<String>>,
    /// The Machine carries the `berth.dev/allow-node-local-data-loss:
    /// "true"` annotation: `nodeLocalVolumes: Block` holds none of its pods.
    pub data_loss_allowed: bool,
}

impl VolumeContext {
    /// The context of Node `node` (its object, when cached, for its
    /// hostname label) with the cluster's CSIDrivers.
    pub fn new(node: &str, node_obj: Option<&Node>, drivers: &[CSIDriver]) -> Self {
        let attach_required = drivers
            .iter()
            .filter_map(|d| {
                let name = d.metadata.name.clone()?;
                Some((name, d.spec.attach_required.unwrap_or(true)))
            })
            .collect();
        let mut node_names = BTreeSet::from([node.to_string()]);
        if let Some(h) = node_obj
            .and_then(|n| n.metadata.labels.as_ref())
            .and_then(|l| l.get(HOSTNAME_LABEL))
        {
            node_names.insert(h.clone());
        }
        let listed = node_obj.map(|n| {
            n.status
                .iter()
                .flat_map(|s| s.volumes_attached.iter().flatten())
                .map(|v| v.name.clone())
                .collect()
        });
        Self {
            attach_required,
            node_names,
            listed,
            data_loss_allowed: false,
        }
    }

    /// The same, with the Machine's permission to lose node-local data.
    #[must_use]
    pub fn allowing_data_loss(mut self, allowed: bool) -> Self {
        self.data_loss_allowed = allowed;
        self
    }

    /// The kind of a PersistentVolume used by a pod on this Node.
    pub fn classify(&self, pv: &PersistentVolume) -> Classified {
        use VolumeKind::{AttachFree, Attachable, NodeLocal};
        let Some(spec) = pv.spec.as_ref() else {
            return Classified::new(AttachFree, "PV without a spec: nothing attaches it");
        };
        if spec.local.is_some() {
            return Classified::new(NodeLocal, "local volume (spec.local)");
        }
        if spec.host_path.is_some() {
            return Classified::new(NodeLocal, "hostPath volume");
        }
        if self.pinned_here(pv) {
            return Classified::new(NodeLocal, "its node affinity only this Node meets");
        }
        if let Some(csi) = &spec.csi {
            return self.by_driver(&csi.driver, "");
        }
        if let Some((driver, _)) = migrated_csi_source(pv) {
            let kind = in_tree_kind(pv).unwrap_or("in-tree");
            return self.by_driver(driver, &format!("in-tree {kind} migrated to CSI, "));
        }
        if let Some((kind, name)) = in_tree_attachable_name(pv) {
            return match &self.listed {
                Some(listed) if !listed.contains(&name) => Classified::new(
                    AttachFree,
                    format!(
                        "in-tree {kind} the Node does not list in status.volumesAttached: nothing attaches it"
                    ),
                ),
                Some(_) => Classified::new(
                    Attachable,
                    format!(
                        "in-tree {kind} the attach-detach controller attached (no VolumeAttachment is made for it)"
                    ),
                ),
                None => Classified::new(
                    Attachable,
                    format!("in-tree {kind}, the Node unknown: treated as attachable"),
                ),
            };
        }
        match in_tree_kind(pv) {
            Some(kind) => Classified::new(
                AttachFree,
                format!("in-tree {kind}: no VolumeAttachment is ever made for it"),
            ),
            None => Classified::new(Attachable, "unknown volume source: treated as attachable"),
        }
    }

    fn by_driver(&self, driver: &str, prefix: &str) -> Classified {
        match self.attach_required.get(driver) {
            Some(false) => Classified::new(
                VolumeKind::AttachFree,
                format!("{prefix}CSIDriver {driver} has attachRequired: false"),
            ),
            Some(true) => Classified::new(
                VolumeKind::Attachable,
                format!("{prefix}CSIDriver {driver} requires attach"),
            ),
            None => Classified::new(
                VolumeKind::Attachable,
                format!("{prefix}{driver} has no CSIDriver object, so attach is required"),
            ),
        }
    }

    /// Whether the PV's node affinity can only be met by this Node: it has
    /// terms, and each requires this Node by hostname label or name.
    fn pinned_here(&self, pv: &PersistentVolume) -> bool {
        let terms = pv
            .spec
            .as_ref()
            .and_then(|s| s.node_affinity.as_ref())
            .and_then(|a| a.required.as_ref())
            .map(|r| r.node_selector_terms.as_slice())
            .unwrap_or_default();
        let names_only_this = |r: &NodeSelectorRequirement, key: &str| {
            r.key == key
                && r.operator == "In"
                && r.values
                    .as_ref()
                    .is_some_and(|v| !v.is_empty() && v.iter().all(|n| self.node_names.contains(n)))
        };
        !terms.is_empty()
            && terms.iter().all(|t| {
                let by_label = t.match_expressions.iter().flatten();
                let by_field = t.match_fields.iter().flatten();
                by_label
                    .into_iter()
                    .any(|r| names_only_this(r, HOSTNAME_LABEL))
                    || by_field
                        .into_iter()
                        .any(|r| names_only_this(r, "metadata.name"))
            })
    }
}

/// The in-tree source kind of a PV, as its field is named.
fn in_tree_kind(pv: &PersistentVolume) -> Option<&'static str> {
    let s = pv.spec.as_ref()?;
    let kinds = [
        (s.aws_elastic_block_store.is_some(), "awsElasticBlockStore"),
        (s.gce_persistent_disk.is_some(), "gcePersistentDisk"),
        (s.azure_disk.is_some(), "azureDisk"),
        (s.cinder.is_some(), "cinder"),
        (s.vsphere_volume.is_some(), "vsphereVolume"),
        (s.portworx_volume.is_some(), "portworxVolume"),
        (s.nfs.is_some(), "nfs"),
        (s.cephfs.is_some(), "cephfs"),
        (s.glusterfs.is_some(), "glusterfs"),
        (s.azure_file.is_some(), "azureFile"),
        (s.iscsi.is_some(), "iscsi"),
        (s.fc.is_some(), "fc"),
        (s.rbd.is_some(), "rbd"),
        (s.flex_volume.is_some(), "flexVolume"),
        (s.flocker.is_some(), "flocker"),
        (s.quobyte.is_some(), "quobyte"),
        (s.scale_io.is_some(), "scaleIO"),
        (s.storageos.is_some(), "storageos"),
        (s.photon_persistent_disk.is_some(), "photonPersistentDisk"),
    ];
    kinds.into_iter().find(|(set, _)| *set).map(|(_, k)| k)
}

/// Whether an object's annotations allow losing node-local data
/// ([`ALLOW_NODE_LOCAL_DATA_LOSS`](crate::api::ALLOW_NODE_LOCAL_DATA_LOSS)
/// set to `"true"`).
pub fn allows_data_loss(annotations: Option<&BTreeMap<String, String>>) -> bool {
    annotations
        .and_then(|a| a.get(crate::api::ALLOW_NODE_LOCAL_DATA_LOSS))
        .is_some_and(|v| v == "true")
}

/// The pod's `emptyDir` volumes, by name: scratch space lost with the pod.
pub fn scratch_volumes(pod: &Pod) -> Vec<String> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter(|v| v.empty_dir.is_some())
        .map(|v| v.name.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{
        AWSElasticBlockStoreVolumeSource, AttachedVolume, CSIPersistentVolumeSource,
        EmptyDirVolumeSource, HostPathVolumeSource, ISCSIPersistentVolumeSource, LocalVolumeSource,
        NFSVolumeSource, NodeSelector, NodeSelectorTerm, NodeStatus, PersistentVolumeSpec, PodSpec,
        RBDPersistentVolumeSource, Volume, VolumeNodeAffinity,
    };
    use k8s_openapi::api::storage::v1::CSIDriverSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;
    use VolumeKind::{AttachFree, Attachable, NodeLocal};

    fn driver(name: &str, attach: Option<bool>) -> CSIDriver {
        CSIDriver {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: CSIDriverSpec {
                attach_required: attach,
                ..Default::default()
            },
        }
    }

    fn pv(spec: PersistentVolumeSpec) -> PersistentVolume {
        PersistentVolume {
            spec: Some(spec),
            ..Default::default()
        }
    }

    fn csi(driver: &str) -> PersistentVolumeSpec {
        PersistentVolumeSpec {
            csi: Some(CSIPersistentVolumeSource {
                driver: driver.into(),
                volume_handle: "h".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn requirement(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(values.iter().map(|v| v.to_string()).collect()),
        }
    }

    /// `spec` with node affinity terms, each (label requirements, field
    /// requirements).
    fn pinned(
        mut spec: PersistentVolumeSpec,
        terms: Vec<(Vec<NodeSelectorRequirement>, Vec<NodeSelectorRequirement>)>,
    ) -> PersistentVolumeSpec {
        spec.node_affinity = Some(VolumeNodeAffinity {
            required: Some(NodeSelector {
                node_selector_terms: terms
                    .into_iter()
                    .map(|(e, f)| NodeSelectorTerm {
                        match_expressions: Some(e),
                        match_fields: Some(f),
                    })
                    .collect(),
            }),
        });
        spec
    }

    #[test]
    fn every_persistent_volume_gets_a_kind() {
        let node = Node {
            metadata: ObjectMeta {
                name: Some("node-1".into()),
                labels: Some([(HOSTNAME_LABEL.to_string(), "ip-10-0-0-1".to_string())].into()),
                ..Default::default()
            },
            status: Some(NodeStatus {
                volumes_attached: Some(
                    [
                        "kubernetes.io/iscsi/10.0.0.9:3260:iqn.2020-01.io.example:db:0",
                        "kubernetes.io/rbd/rbd:img-1",
                    ]
                    .map(|name| AttachedVolume {
                        name: name.into(),
                        device_path: String::new(),
                    })
                    .into(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        };
        let iscsi = |lun| PersistentVolumeSpec {
            iscsi: Some(ISCSIPersistentVolumeSource {
                target_portal: "10.0.0.9:3260".into(),
                iqn: "iqn.2020-01.io.example:db".into(),
                lun,
                ..Default::default()
            }),
            ..Default::default()
        };
        let ctx = VolumeContext::new(
            "node-1",
            Some(&node),
            &[
                driver("nfs.csi.k8s.io", Some(false)),
                driver("ebs.csi.aws.com", Some(true)),
                driver("defaulted.csi", None),
                driver("efs.csi.aws.com", Some(false)),
            ],
        );
        let hostname = |op, v: &[&str]| requirement(HOSTNAME_LABEL, op, v);
        let zone = requirement("topology.kubernetes.io/zone", "In", &["us-east-1a"]);
        let cases: Vec<(&str, PersistentVolumeSpec, VolumeKind, &str)> = vec![
            (
                "CSI, attach required",
                csi("ebs.csi.aws.com"),
                Attachable,
                "requires attach",
            ),
            (
                "CSI, attachRequired unset",
                csi("defaulted.csi"),
                Attachable,
                "requires attach",
            ),
            (
                "CSI, no CSIDriver object",
                csi("other.csi"),
                Attachable,
                "no CSIDriver object",
            ),
            (
                "CSI, attach-free",
                csi("nfs.csi.k8s.io"),
                AttachFree,
                "attachRequired: false",
            ),
            (
                "local",
                PersistentVolumeSpec {
                    local: Some(LocalVolumeSource {
                        path: "/mnt/disks/a".into(),
                        fs_type: None,
                    }),
                    ..Default::default()
                },
                NodeLocal,
                "spec.local",
            ),
            (
                "hostPath",
                PersistentVolumeSpec {
                    host_path: Some(HostPathVolumeSource {
                        path: "/data".into(),
                        type_: None,
                    }),
                    ..Default::default()
                },
                NodeLocal,
                "hostPath",
            ),
            (
                "CSI pinned to this Node by hostname label",
                pinned(
                    csi("ebs.csi.aws.com"),
                    vec![(vec![hostname("In", &["ip-10-0-0-1"])], vec![])],
                ),
                NodeLocal,
                "only this Node meets",
            ),
            (
                "pinned by name, with a zone too",
                pinned(
                    csi("nfs.csi.k8s.io"),
                    vec![(
                        vec![zone.clone()],
                        vec![requirement("metadata.name", "In", &["node-1"])],
                    )],
                ),
                NodeLocal,
                "only this Node meets",
            ),
            (
                "pinned to this Node or another",
                pinned(
                    csi("ebs.csi.aws.com"),
                    vec![(vec![hostname("In", &["ip-10-0-0-1", "ip-2"])], vec![])],
                ),
                Attachable,
                "requires attach",
            ),
            (
                "one term pinned, another not",
                pinned(
                    csi("ebs.csi.aws.com"),
                    vec![
                        (vec![hostname("In", &["node-1"])], vec![]),
                        (vec![zone.clone()], vec![]),
                    ],
                ),
                Attachable,
                "requires attach",
            ),
            (
                "NotIn is no pin",
                pinned(
                    csi("ebs.csi.aws.com"),
                    vec![(vec![hostname("NotIn", &["node-2"])], vec![])],
                ),
                Attachable,
                "requires attach",
            ),
            (
                "zonal only",
                pinned(csi("ebs.csi.aws.com"), vec![(vec![zone], vec![])]),
                Attachable,
                "requires attach",
            ),
            (
                "in-tree EBS, migrated",
                PersistentVolumeSpec {
                    aws_elastic_block_store: Some(AWSElasticBlockStoreVolumeSource {
                        volume_id: "vol-1".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                Attachable,
                "in-tree awsElasticBlockStore migrated to CSI, CSIDriver ebs.csi.aws.com requires attach",
            ),
            (
                "in-tree nfs",
                PersistentVolumeSpec {
                    nfs: Some(NFSVolumeSource {
                        server: "s".into(),
                        path: "/".into(),
                        read_only: None,
                    }),
                    ..Default::default()
                },
                AttachFree,
                "in-tree nfs: no VolumeAttachment",
            ),
            (
                "in-tree iscsi the Node lists",
                iscsi(0),
                Attachable,
                "in-tree iscsi the attach-detach controller attached",
            ),
            (
                "in-tree iscsi the Node does not list",
                iscsi(1),
                AttachFree,
                "in-tree iscsi the Node does not list",
            ),
            (
                "in-tree rbd the Node lists",
                PersistentVolumeSpec {
                    rbd: Some(RBDPersistentVolumeSource {
                        image: "img-1".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                Attachable,
                "in-tree rbd the attach-detach controller attached",
            ),
            (
                "no source at all",
                PersistentVolumeSpec::default(),
                Attachable,
                "unknown",
            ),
        ];
        for (what, spec, kind, why) in cases {
            let got = ctx.classify(&pv(spec));
            assert_eq!(got.kind, kind, "{what}: {}", got.why);
            assert!(got.why.contains(why), "{what}: {:?} lacks {why:?}", got.why);
        }
        // Without the Node object only its name pins.
        let bare = VolumeContext::new("node-1", None, &[]);
        let by_hostname = pinned(
            csi("x"),
            vec![(vec![hostname("In", &["ip-10-0-0-1"])], vec![])],
        );
        assert_eq!(bare.classify(&pv(by_hostname)).kind, Attachable);
        let by_name = pinned(csi("x"), vec![(vec![hostname("In", &["node-1"])], vec![])]);
        assert_eq!(bare.classify(&pv(by_name)).kind, NodeLocal);
        // Nor can it tell an in-tree kind that attaches from one that does
        // not: the safe side waits.
        assert_eq!(bare.classify(&pv(iscsi(1))).kind, Attachable);
    }

    #[test]
    fn empty_dirs_are_scratch() {
        let vol = |name: &str, empty: bool| Volume {
            name: name.into(),
            empty_dir: empty.then(EmptyDirVolumeSource::default),
            ..Default::default()
        };
        let pod = Pod {
            spec: Some(PodSpec {
                volumes: Some(vec![
                    vol("cache", true),
                    vol("config", false),
                    vol("tmp", true),
                ]),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(scratch_volumes(&pod), ["cache", "tmp"]);
        assert!(scratch_volumes(&Pod::default()).is_empty());
        assert_eq!(VolumeKind::Scratch.to_string(), "scratch");
    }
}
