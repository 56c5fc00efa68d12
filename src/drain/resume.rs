//! A volume move an earlier run recorded (`status.drain.moves`), planned
//! again after a restart or a change of leader: its pod is gone, so the
//! move is rebuilt from the record and the PersistentVolumes it names, and
//! then follows the same steps as a first run from "pod gone" on (detach,
//! replacement, moved; see the engine's `migration`). Pure.
//!
//! What the record keeps for that: the pod's controller (a replacement is
//! expected and waited for, as in a first run) and when the move began (a
//! pod that used one of its claims on another Node before then, a
//! ReadWriteMany peer, is not its replacement).

use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume};

use crate::api::VolumeMove;
use crate::api::settings::ResolvedSettings;
use crate::cache::inline::{inline_as_pv, inline_volume_named};
use crate::drain::deadline::StepBounds;
use crate::drain::plan::{PlannedPod, PlannedVolume, VolumeWait};
use crate::drain::rules::DEFAULT_ORDER;
use crate::drain::volume::{VolumeRef, is_inline};
use crate::drain::volume_kind::{VolumeContext, VolumeKind};
use crate::volumes::unique_name_of;

/// The pod of recorded move `m`, as a first run would have planned its
/// volumes: each of `pvs` (those of the record that still exist) given its kind
/// by `ctx`; an attachable one waited for to detach and to attach where the
/// replacement runs, an attach-free one until the replacement is Ready, a
/// node-local one not at all (its data stayed). A PV bound to no claim any
/// more cannot follow a pod and is left out. `None` for a record that does
/// not name a pod as `namespace/name`.
pub(crate) fn resumed_pod(
    m: &VolumeMove,
    pvs: &[PersistentVolume],
    ctx: &VolumeContext,
    settings: &ResolvedSettings,
) -> Option<PlannedPod> {
    let (ns, name) = m.pod.split_once('/')?;
    // An inline volume is recorded by the name that stands for its PV and
    // claim: made again from it, as the PV it would be, bound to itself.
    let inline: Vec<PersistentVolume> = m
        .volumes
        .iter()
        .filter(|v| is_inline(v))
        .filter_map(|v| {
            let mut pv = inline_as_pv(&inline_volume_named(v)?)?;
            pv.metadata.name = Some(v.clone());
            pv.spec.get_or_insert_default().claim_ref = Some(ObjectReference {
                namespace: Some(ns.to_string()),
                name: Some(v.clone()),
                ..Default::default()
            });
            Some(pv)
        })
        .collect();
    let volumes = pvs
        .iter()
        .chain(&inline)
        .filter_map(|pv| {
            let name = pv.metadata.name.clone()?;
            let claim = pv.spec.as_ref()?.claim_ref.as_ref()?;
            let claim = (claim.namespace.clone()?, claim.name.clone()?);
            let classified = ctx.classify(pv);
            let wait = match classified.kind {
                VolumeKind::Attachable => VolumeWait::Detach {
                    gone_first: Vec::new(),
                    reattach: true,
                },
                VolumeKind::AttachFree => VolumeWait::ReplacementReady,
                VolumeKind::NodeLocal | VolumeKind::Scratch => VolumeWait::DataLost,
            };
            Some(PlannedVolume {
                volume: VolumeRef {
                    pv: name,
                    claim,
                    unique_name: unique_name_of(pv),
                    ephemeral: false,
                },
                kind: classified.kind,
                kind_why: classified.why,
                attached_to: Vec::new(),
                wait,
            })
        })
        .collect();
    Some(PlannedPod {
        pod: (ns.to_string(), name.to_string()),
        uid: m.uid.clone(),
        priority: 0,
        order: DEFAULT_ORDER,
        order_source: None,
        grace: Duration::ZERO,
        bounds: StepBounds {
            pod_gone: Duration::ZERO,
            detach: Some(settings.volume_detach_timeout),
            reattach: Some(settings.volume_reattach_timeout),
        },
        volumes,
        pdbs: Vec::new(),
        notes: Vec::new(),
        scratch: Vec::new(),
        held: None,
        rule: None,
        controller: m.controller.clone(),
        rule_terms: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pv(name: &str, driver: &str, claim: Option<&str>) -> PersistentVolume {
        let mut pv: PersistentVolume = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"csi": {"driver": driver, "volumeHandle": format!("h-{name}")}}
        }))
        .expect("pv");
        if let Some(c) = claim {
            pv.spec.get_or_insert_default().claim_ref = Some(
                serde_json::from_value(serde_json::json!({"namespace": "db", "name": c}))
                    .expect("claimRef"),
            );
        }
        pv
    }

    #[test]
    fn a_resumed_move_waits_for_each_volume_as_a_first_run_would() {
        let nfs = crate::drain::fixtures::csi_driver("nfs.csi", false);
        let ctx = VolumeContext::new("n1", None, &[nfs]);
        let m = VolumeMove {
            pod: "db/pg-0".into(),
            uid: Some("u-0".into()),
            volumes: vec!["block".into(), "shared".into(), "loose".into()],
            controller: Some("StatefulSet/pg".into()),
            workload: Some("StatefulSet/pg".into()),
            since: None,
        };
        let pvs = [
            pv("block", "ebs.csi", Some("data-pg-0")),
            pv("shared", "nfs.csi", Some("files")),
            pv("loose", "ebs.csi", None),
        ];
        let p = resumed_pod(&m, &pvs, &ctx, &ResolvedSettings::default()).expect("a pod");
        assert_eq!(p.pod, ("db".to_string(), "pg-0".to_string()));
        assert_eq!(p.controller.as_deref(), Some("StatefulSet/pg"));
        let waits: Vec<(&str, VolumeKind, bool, bool)> = p
            .volumes
            .iter()
            .map(|v| {
                (
                    v.volume.pv.as_str(),
                    v.kind,
                    v.wait.waits_for_detach(),
                    v.wait.waits_for_reattach(),
                )
            })
            .collect();
        assert_eq!(
            waits,
            [
                ("block", VolumeKind::Attachable, true, true),
                ("shared", VolumeKind::AttachFree, false, true),
            ],
            "the PV bound to no claim is left out"
        );
        assert_eq!(p.volumes[0].volume.claim.1, "data-pg-0");
        assert!(
            resumed_pod(
                &VolumeMove {
                    pod: "no-namespace".into(),
                    ..m.clone()
                },
                &pvs,
                &ctx,
                &ResolvedSettings::default()
            )
            .is_none()
        );
    }
}
