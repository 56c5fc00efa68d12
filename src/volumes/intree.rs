//! The names the Node gives in-tree PersistentVolumes in
//! `status.volumesAttached`: the CSI identity CSI migration gives the cloud
//! kinds, and the plugin's own name for the in-tree kinds that still attach
//! without CSI (iSCSI, Fibre Channel, Ceph RBD, FlexVolume).
//!
//! With CSI migration (on by default for every cloud volume plugin since
//! Kubernetes 1.25-1.27, the in-tree code gone since), the attach-detach
//! controller and the kubelet translate an in-tree PV's source into a CSI
//! source before they attach it. The VolumeAttachment they create still
//! names the PV (`spec.source.persistentVolumeName`), so a migrated PV is
//! recognised by name there without any translation; but the Node lists it
//! in `status.volumesAttached` under the unique name of the *translated*
//! source, `kubernetes.io/csi/<driver>^<volumeHandle>`, and that name is
//! what the detach wait needs to know the volume is gone from the Node.
//!
//! The rules below follow upstream's translation library
//! (`k8s.io/csi-translation-lib/plugins`), one function per plugin; the
//! table tests pin each. A PV whose in-tree source cannot be translated
//! (upstream would refuse it too) gets no unique name and is recognised by
//! its VolumeAttachment alone.

use k8s_openapi::api::core::v1::PersistentVolume;

/// The `node.status.volumesAttached` name of a PV of an in-tree kind whose
/// plugin the attach-detach controller still drives itself, without CSI
/// and without a VolumeAttachment: `<plugin>/<volume name>`, the volume
/// name as the plugin's `GetVolumeName` makes it (`k8s.io/kubernetes`,
/// `pkg/volume/<plugin>`):
///
/// - iSCSI: `kubernetes.io/iscsi/<targetPortal>:<iqn>:<lun>`;
/// - Fibre Channel: `kubernetes.io/fc/[<wwn> …]:<lun>`, or
///   `kubernetes.io/fc/[<wwid> …]` (Go's `%v` of a string list);
/// - Ceph RBD (the plugin left Kubernetes in 1.31; older clusters):
///   `kubernetes.io/rbd/<pool>:<image>`;
/// - FlexVolume: `<driver>/<PV name>` (the plugin is named after its
///   driver, and the volume after the PV whatever the driver answers).
///
/// Returns the kind too, as the PV's field is named. `None` for any other
/// PV, or one whose source names no volume (upstream refuses it too).
pub fn in_tree_attachable_name(pv: &PersistentVolume) -> Option<(&'static str, String)> {
    let spec = pv.spec.as_ref()?;
    if let Some(iscsi) = &spec.iscsi {
        let name = format!("{}:{}:{}", iscsi.target_portal, iscsi.iqn, iscsi.lun);
        return Some(("iscsi", format!("kubernetes.io/iscsi/{name}")));
    }
    if let Some(fc) = &spec.fc {
        let list = |v: &[String]| format!("[{}]", v.join(" "));
        let wwns = fc.target_wwns.as_deref().unwrap_or_default();
        let wwids = fc.wwids.as_deref().unwrap_or_default();
        let name = match fc.lun {
            Some(lun) if !wwns.is_empty() => format!("{}:{lun}", list(wwns)),
            _ if !wwids.is_empty() => list(wwids),
            _ => return None,
        };
        return Some(("fc", format!("kubernetes.io/fc/{name}")));
    }
    if let Some(rbd) = &spec.rbd {
        let pool = rbd.pool.as_deref().unwrap_or(RBD_DEFAULT_POOL);
        return Some(("rbd", format!("kubernetes.io/rbd/{pool}:{}", rbd.image)));
    }
    if let Some(flex) = &spec.flex_volume {
        let name = pv.metadata.name.as_deref()?;
        return Some(("flexVolume", format!("{}/{name}", flex.driver)));
    }
    None
}

/// The pool the API server defaults an RBD source to.
const RBD_DEFAULT_POOL: &str = "rbd";

/// `topology.kubernetes.io/zone`, and its deprecated beta twin, which GCE PD
/// reads first.
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
const BETA_ZONE_LABEL: &str = "failure-domain.beta.kubernetes.io/zone";
/// How a regional PD's label lists its zones.
const MULTI_ZONE_DELIMITER: &str = "__";
/// GCE PD's placeholder for a project or zone the PV does not say.
const UNSPECIFIED: &str = "UNSPECIFIED";

/// The CSI driver and volume handle CSI migration gives `pv`, if it has an
/// in-tree source that migrates to an attachable CSI driver.
pub fn migrated_csi_source(pv: &PersistentVolume) -> Option<(&'static str, String)> {
    let spec = pv.spec.as_ref()?;
    if let Some(ebs) = &spec.aws_elastic_block_store {
        return Some(("ebs.csi.aws.com", ebs_volume_id(&ebs.volume_id)?));
    }
    if let Some(pd) = &spec.gce_persistent_disk {
        let labels = pv.metadata.labels.as_ref();
        let label = |k: &str| labels.and_then(|l| l.get(k)).filter(|v| !v.is_empty());
        let zones = label(BETA_ZONE_LABEL).or_else(|| label(ZONE_LABEL));
        return Some(("pd.csi.storage.gke.io", gce_pd_handle(&pd.pd_name, zones)?));
    }
    if let Some(disk) = &spec.azure_disk {
        return Some(("disk.csi.azure.com", disk.disk_uri.clone()));
    }
    if let Some(cinder) = &spec.cinder {
        return Some(("cinder.csi.openstack.org", cinder.volume_id.clone()));
    }
    if let Some(vsphere) = &spec.vsphere_volume {
        return Some(("csi.vsphere.vmware.com", vsphere.volume_path.clone()));
    }
    if let Some(px) = &spec.portworx_volume {
        return Some(("pxd.portworx.com", px.volume_id.clone()));
    }
    None
}

/// An EBS volume ID from the forms the in-tree plugin accepted:
/// `vol-…`, `aws:///vol-…` and `aws://<zone>/vol-…`. A URL form whose path
/// is not a volume ID is refused, as upstream refuses it.
fn ebs_volume_id(id: &str) -> Option<String> {
    let Some(rest) = id.strip_prefix("aws://") else {
        return Some(id.to_string());
    };
    // After the scheme: an optional zone (the URL's host), then the path.
    let path = rest.find('/').map_or("", |at| &rest[at..]);
    let volume = path.trim_matches('/');
    (volume.starts_with("vol-") && !volume.contains('/')).then(|| volume.to_string())
}

/// A GCE PD handle: zonal when the PV's zone label names one zone,
/// regional when it names several (`a__b`) of one region, both with an
/// unspecified project; zone unspecified when there is no label.
fn gce_pd_handle(pd_name: &str, zones: Option<&String>) -> Option<String> {
    let zones: Vec<&str> = zones.map_or_else(Vec::new, |z| z.split(MULTI_ZONE_DELIMITER).collect());
    match zones.as_slice() {
        [] => Some(format!(
            "projects/{UNSPECIFIED}/zones/{UNSPECIFIED}/disks/{pd_name}"
        )),
        [zone] => Some(format!(
            "projects/{UNSPECIFIED}/zones/{zone}/disks/{pd_name}"
        )),
        many => {
            let region = gce_region(many)?;
            Some(format!(
                "projects/{UNSPECIFIED}/regions/{region}/disks/{pd_name}"
            ))
        }
    }
}

/// The one region of GCE zones `<locale>-<region>-<zone>`; none when a zone
/// has another shape or the zones span regions.
fn gce_region(zones: &[&str]) -> Option<String> {
    let mut regions = zones.iter().map(|z| {
        let parts: Vec<&str> = z.split('-').collect();
        (parts.len() == 3).then(|| format!("{}-{}", parts[0], parts[1]))
    });
    let first = regions.next()??;
    regions
        .all(|r| r.as_deref() == Some(first.as_str()))
        .then_some(first)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::{
        AWSElasticBlockStoreVolumeSource, AzureDiskVolumeSource, CinderPersistentVolumeSource,
        FCVolumeSource, FlexPersistentVolumeSource, GCEPersistentDiskVolumeSource,
        ISCSIPersistentVolumeSource, PersistentVolumeSpec, PortworxVolumeSource,
        RBDPersistentVolumeSource, VsphereVirtualDiskVolumeSource,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;
    use crate::volumes::unique_name_of;

    fn pv(spec: PersistentVolumeSpec, labels: &[(&str, &str)]) -> PersistentVolume {
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some("pv".into()),
                labels: (!labels.is_empty()).then(|| {
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect::<BTreeMap<_, _>>()
                }),
                ..Default::default()
            },
            spec: Some(spec),
            status: None,
        }
    }

    fn ebs(id: &str) -> PersistentVolume {
        pv(
            PersistentVolumeSpec {
                aws_elastic_block_store: Some(AWSElasticBlockStoreVolumeSource {
                    volume_id: id.into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &[],
        )
    }

    fn pd(name: &str, labels: &[(&str, &str)]) -> PersistentVolume {
        pv(
            PersistentVolumeSpec {
                gce_persistent_disk: Some(GCEPersistentDiskVolumeSource {
                    pd_name: name.into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            labels,
        )
    }

    #[test]
    fn in_tree_pvs_get_the_unique_name_migration_gives_them() {
        let azure = pv(
            PersistentVolumeSpec {
                azure_disk: Some(AzureDiskVolumeSource {
                    disk_name: "d1".into(),
                    disk_uri:
                        "/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/disks/d1"
                            .into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &[],
        );
        let cinder = pv(
            PersistentVolumeSpec {
                cinder: Some(CinderPersistentVolumeSource {
                    volume_id: "8a3c-11".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &[],
        );
        let vsphere = pv(
            PersistentVolumeSpec {
                vsphere_volume: Some(VsphereVirtualDiskVolumeSource {
                    volume_path: "[vsanDatastore] kubevols/disk.vmdk".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &[],
        );
        let portworx = pv(
            PersistentVolumeSpec {
                portworx_volume: Some(PortworxVolumeSource {
                    volume_id: "px-1".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &[],
        );
        let spec_pv = |spec: PersistentVolumeSpec| pv(spec, &[]);
        let fc = |wwns: &[&str], lun: Option<i32>, wwids: &[&str]| {
            spec_pv(PersistentVolumeSpec {
                fc: Some(FCVolumeSource {
                    target_wwns: Some(wwns.iter().map(|s| s.to_string()).collect()),
                    lun,
                    wwids: Some(wwids.iter().map(|s| s.to_string()).collect()),
                    ..Default::default()
                }),
                ..Default::default()
            })
        };
        let iscsi = spec_pv(PersistentVolumeSpec {
            iscsi: Some(ISCSIPersistentVolumeSource {
                target_portal: "10.0.0.9:3260".into(),
                iqn: "iqn.2020-01.io.example:db".into(),
                lun: 3,
                portals: Some(vec!["10.0.0.10:3260".into()]),
                ..Default::default()
            }),
            ..Default::default()
        });
        let rbd = |pool: Option<&str>| {
            spec_pv(PersistentVolumeSpec {
                rbd: Some(RBDPersistentVolumeSource {
                    image: "img".into(),
                    pool: pool.map(str::to_string),
                    ..Default::default()
                }),
                ..Default::default()
            })
        };
        let flex = spec_pv(PersistentVolumeSpec {
            flex_volume: Some(FlexPersistentVolumeSource {
                driver: "example.com/lvm".into(),
                ..Default::default()
            }),
            ..Default::default()
        });
        let cases: Vec<(&str, PersistentVolume, Option<&str>)> = vec![
            (
                "iSCSI: the target portal only (not the other portals), IQN and LUN",
                iscsi,
                Some("kubernetes.io/iscsi/10.0.0.9:3260:iqn.2020-01.io.example:db:3"),
            ),
            (
                "FC: target WWNs and LUN",
                fc(&["500a0981891b8dc5", "500a0981991b8dc5"], Some(1), &["w"]),
                Some("kubernetes.io/fc/[500a0981891b8dc5 500a0981991b8dc5]:1"),
            ),
            (
                "FC: WWIDs without a LUN",
                fc(&["500a0981891b8dc5"], None, &["3600508b400105e21"]),
                Some("kubernetes.io/fc/[3600508b400105e21]"),
            ),
            ("FC: nothing to name it by", fc(&[], Some(1), &[]), None),
            (
                "RBD: the pool it says",
                rbd(Some("kube")),
                Some("kubernetes.io/rbd/kube:img"),
            ),
            (
                "RBD: the default pool",
                rbd(None),
                Some("kubernetes.io/rbd/rbd:img"),
            ),
            (
                "FlexVolume: the driver, then the PV's name",
                flex,
                Some("example.com/lvm/pv"),
            ),
            (
                "EBS, bare ID",
                ebs("vol-0abc"),
                Some("kubernetes.io/csi/ebs.csi.aws.com^vol-0abc"),
            ),
            (
                "EBS, URL without zone",
                ebs("aws:///vol-0abc"),
                Some("kubernetes.io/csi/ebs.csi.aws.com^vol-0abc"),
            ),
            (
                "EBS, URL with zone",
                ebs("aws://us-east-1a/vol-0abc"),
                Some("kubernetes.io/csi/ebs.csi.aws.com^vol-0abc"),
            ),
            (
                "EBS, URL without a volume ID",
                ebs("aws://us-east-1a/disk-1"),
                None,
            ),
            ("EBS, URL with a nested path", ebs("aws://z/a/vol-1"), None),
            (
                "GCE PD, no zone label",
                pd("disk-1", &[]),
                Some(
                    "kubernetes.io/csi/pd.csi.storage.gke.io^projects/UNSPECIFIED/zones/UNSPECIFIED/disks/disk-1",
                ),
            ),
            (
                "GCE PD, zonal (GA label)",
                pd("disk-1", &[(ZONE_LABEL, "us-central1-a")]),
                Some(
                    "kubernetes.io/csi/pd.csi.storage.gke.io^projects/UNSPECIFIED/zones/us-central1-a/disks/disk-1",
                ),
            ),
            (
                "GCE PD, the beta label wins",
                pd(
                    "disk-1",
                    &[
                        (BETA_ZONE_LABEL, "europe-west1-b"),
                        (ZONE_LABEL, "us-central1-a"),
                    ],
                ),
                Some(
                    "kubernetes.io/csi/pd.csi.storage.gke.io^projects/UNSPECIFIED/zones/europe-west1-b/disks/disk-1",
                ),
            ),
            (
                "GCE PD, regional",
                pd("disk-1", &[(ZONE_LABEL, "us-central1-a__us-central1-c")]),
                Some(
                    "kubernetes.io/csi/pd.csi.storage.gke.io^projects/UNSPECIFIED/regions/us-central1/disks/disk-1",
                ),
            ),
            (
                "GCE PD, zones in two regions",
                pd("disk-1", &[(ZONE_LABEL, "us-central1-a__europe-west1-b")]),
                None,
            ),
            (
                "GCE PD, a zone of another shape",
                pd("disk-1", &[(ZONE_LABEL, "us-central1-a__zone")]),
                None,
            ),
            (
                "Azure disk: the disk URI",
                azure,
                Some(
                    "kubernetes.io/csi/disk.csi.azure.com^/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/disks/d1",
                ),
            ),
            (
                "Cinder: the volume ID",
                cinder,
                Some("kubernetes.io/csi/cinder.csi.openstack.org^8a3c-11"),
            ),
            (
                "vSphere: the volume path",
                vsphere,
                Some("kubernetes.io/csi/csi.vsphere.vmware.com^[vsanDatastore] kubevols/disk.vmdk"),
            ),
            (
                "Portworx: the volume ID",
                portworx,
                Some("kubernetes.io/csi/pxd.portworx.com^px-1"),
            ),
            (
                "no in-tree source",
                pv(PersistentVolumeSpec::default(), &[]),
                None,
            ),
        ];
        for (what, pv, want) in cases {
            assert_eq!(unique_name_of(&pv).as_deref(), want, "{what}");
        }
    }
}
