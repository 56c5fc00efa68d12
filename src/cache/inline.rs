//! A pod's inline volumes of the kinds that attach to a Node (a cloud disk
//! or a SAN LUN named in the pod spec itself, without a claim): the drain
//! moves them as it moves a claim's volume, so the caches keep them and
//! file the pods that use one under a name in place of a claim's.
//!
//! The name is `inline:<kind>:<what identifies the volume>` (for iSCSI and
//! FC, several fields apart by spaces); a colon can never be in a claim's
//! name, so the two never meet. Two pods use the same inline volume when
//! they name the same one (a replacement made from the same template
//! does). The name says enough to make the volume again
//! ([`inline_volume_named`]): a move recorded by name can be resumed
//! after a restart, with its pod gone.

use k8s_openapi::api::core::v1::{
    CinderPersistentVolumeSource, ISCSIPersistentVolumeSource, PersistentVolume,
    PersistentVolumeSpec, Volume,
};

/// What an inline volume's name starts with.
pub const INLINE_PREFIX: &str = "inline:";

/// The name a pod's inline volume `v` is filed under where a claim's name
/// goes, if it is of a kind that attaches: EBS, GCE PD, Azure disk,
/// Cinder, vSphere, Portworx (migrated to CSI), iSCSI, Fibre Channel.
pub fn inline_claim_name(v: &Volume) -> Option<String> {
    let (kind, id) = if let Some(s) = &v.aws_elastic_block_store {
        ("awsElasticBlockStore", s.volume_id.clone())
    } else if let Some(s) = &v.gce_persistent_disk {
        ("gcePersistentDisk", s.pd_name.clone())
    } else if let Some(s) = &v.azure_disk {
        ("azureDisk", s.disk_uri.clone())
    } else if let Some(s) = &v.cinder {
        ("cinder", s.volume_id.clone())
    } else if let Some(s) = &v.vsphere_volume {
        ("vsphereVolume", s.volume_path.clone())
    } else if let Some(s) = &v.portworx_volume {
        ("portworxVolume", s.volume_id.clone())
    } else if let Some(s) = &v.iscsi {
        ("iscsi", format!("{} {} {}", s.target_portal, s.iqn, s.lun))
    } else if let Some(s) = &v.fc {
        let wwns = s.target_wwns.as_deref().unwrap_or_default().join(",");
        let wwids = s.wwids.as_deref().unwrap_or_default().join(",");
        let lun = s.lun.map(|l| l.to_string()).unwrap_or_default();
        ("fc", format!("{wwns} {lun} {wwids}"))
    } else {
        return None;
    };
    Some(format!("{INLINE_PREFIX}{kind}:{id}"))
}

/// The inline volume [`inline_claim_name`] named `name`, made again from
/// the name (as much of its source as names it); `None` for another name.
pub fn inline_volume_named(name: &str) -> Option<Volume> {
    let (kind, id) = name.strip_prefix(INLINE_PREFIX)?.split_once(':')?;
    let list = |s: &str| -> Vec<String> {
        s.split(',')
            .filter(|w| !w.is_empty())
            .map(String::from)
            .collect()
    };
    let source = match kind {
        "awsElasticBlockStore" => serde_json::json!({"awsElasticBlockStore": {"volumeID": id}}),
        "gcePersistentDisk" => serde_json::json!({"gcePersistentDisk": {"pdName": id}}),
        "azureDisk" => {
            let disk = id.rsplit('/').next().unwrap_or(id);
            serde_json::json!({"azureDisk": {"diskURI": id, "diskName": disk}})
        }
        "cinder" => serde_json::json!({"cinder": {"volumeID": id}}),
        "vsphereVolume" => serde_json::json!({"vsphereVolume": {"volumePath": id}}),
        "portworxVolume" => serde_json::json!({"portworxVolume": {"volumeID": id}}),
        "iscsi" => {
            let mut f = id.split(' ');
            let (portal, iqn, lun) = (f.next()?, f.next()?, f.next()?.parse::<i32>().ok()?);
            serde_json::json!({"iscsi": {"targetPortal": portal, "iqn": iqn, "lun": lun}})
        }
        "fc" => {
            let mut f = id.split(' ');
            let (wwns, lun, wwids) = (list(f.next()?), f.next()?, list(f.next()?));
            let lun = (!lun.is_empty()).then(|| lun.parse::<i32>().ok()).flatten();
            serde_json::json!({"fc": {"targetWWNs": wwns, "lun": lun, "wwids": wwids}})
        }
        _ => return None,
    };
    let mut v = source;
    v["name"] = "inline".into();
    serde_json::from_value(v).ok()
}

/// The PersistentVolume inline volume `v` would be: the same source, as a
/// PV spec, without a name or labels. What a PV's source decides (its
/// class, the name the Node lists it under) is decided for the inline
/// volume from it, as CSI migration translates an inline volume the way
/// it translates a PV. `None` for the kinds [`inline_claim_name`] does not
/// name.
pub fn inline_as_pv(v: &Volume) -> Option<PersistentVolume> {
    inline_claim_name(v)?;
    let spec = PersistentVolumeSpec {
        aws_elastic_block_store: v.aws_elastic_block_store.clone(),
        gce_persistent_disk: v.gce_persistent_disk.clone(),
        azure_disk: v.azure_disk.clone(),
        cinder: v.cinder.as_ref().map(|s| CinderPersistentVolumeSource {
            volume_id: s.volume_id.clone(),
            fs_type: s.fs_type.clone(),
            read_only: s.read_only,
            secret_ref: None,
        }),
        vsphere_volume: v.vsphere_volume.clone(),
        portworx_volume: v.portworx_volume.clone(),
        iscsi: v.iscsi.as_ref().map(|s| ISCSIPersistentVolumeSource {
            target_portal: s.target_portal.clone(),
            iqn: s.iqn.clone(),
            lun: s.lun,
            portals: s.portals.clone(),
            ..Default::default()
        }),
        fc: v.fc.clone(),
        ..Default::default()
    };
    Some(PersistentVolume {
        spec: Some(spec),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(source: serde_json::Value) -> Volume {
        let mut v = source;
        v["name"] = "data".into();
        serde_json::from_value(v).expect("a volume")
    }

    #[test]
    fn attachable_inline_volumes_are_named_and_others_are_not() {
        let cases = [
            (
                serde_json::json!({"awsElasticBlockStore": {"volumeID": "vol-1"}}),
                Some("inline:awsElasticBlockStore:vol-1"),
            ),
            (
                serde_json::json!({"gcePersistentDisk": {"pdName": "disk-1"}}),
                Some("inline:gcePersistentDisk:disk-1"),
            ),
            (
                serde_json::json!({"cinder": {"volumeID": "c-1"}}),
                Some("inline:cinder:c-1"),
            ),
            (
                serde_json::json!({"iscsi": {"targetPortal": "10.0.0.9:3260", "iqn": "iqn.x:y", "lun": 2}}),
                Some("inline:iscsi:10.0.0.9:3260 iqn.x:y 2"),
            ),
            (
                serde_json::json!({"fc": {"targetWWNs": ["a", "b"], "lun": 1}}),
                Some("inline:fc:a,b 1 "),
            ),
            (
                serde_json::json!({"fc": {"wwids": ["w"]}}),
                Some("inline:fc:  w"),
            ),
            (
                serde_json::json!({"azureDisk": {"diskName": "d", "diskURI": "/s/g/disks/d"}}),
                Some("inline:azureDisk:/s/g/disks/d"),
            ),
            (serde_json::json!({"emptyDir": {}}), None),
            (
                serde_json::json!({"nfs": {"server": "s", "path": "/"}}),
                None,
            ),
            (
                serde_json::json!({"persistentVolumeClaim": {"claimName": "data"}}),
                None,
            ),
        ];
        for (source, want) in cases {
            let v = volume(source.clone());
            assert_eq!(inline_claim_name(&v).as_deref(), want, "{source}");
            assert_eq!(inline_as_pv(&v).is_some(), want.is_some(), "{source}");
            // The name makes the volume again, as far as it names it.
            if let Some(name) = want {
                let again = inline_volume_named(name).expect("made again");
                assert_eq!(inline_claim_name(&again).as_deref(), Some(name), "{source}");
            }
        }
        assert!(inline_volume_named("data-db-0").is_none());
        assert!(inline_volume_named("inline:nfs:x").is_none());
        // The PV it would be carries the same source.
        let pv = inline_as_pv(&volume(serde_json::json!({
            "cinder": {"volumeID": "c-1", "secretRef": {"name": "s"}}
        })))
        .expect("a PV");
        let cinder = pv.spec.and_then(|s| s.cinder).expect("cinder");
        assert_eq!(cinder.volume_id, "c-1");
    }
}
