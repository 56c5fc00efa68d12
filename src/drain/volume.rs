//! The persistent volumes a pod uses, how each is recognised when attached,
//! and whether anything is expected to pick a volume up again.
//!
//! A pod **has a persistent volume** when one of its `spec.volumes` names a
//! PersistentVolumeClaim in the pod's namespace that is bound
//! (`spec.volumeName`) to a PersistentVolume that exists. The claim is named
//! by `persistentVolumeClaim.claimName`, or, for a generic ephemeral volume,
//! is `<pod name>-<volume name>` and must have been created for this pod (its
//! controller ownerReference is the pod). A claim that is missing, unbound,
//! bound to a missing PV or not created for the pod gives the pod no volume
//! and leaves a note instead: such a pod cannot be using a volume yet.
//!
//! A volume is recognised by two computed identities, never by guessing:
//!
//! - its PV name, which VolumeAttachments carry in
//!   `spec.source.persistentVolumeName`;
//! - for a CSI PV, the unique name the Node lists in
//!   `status.volumesAttached[].name`, exactly
//!   `kubernetes.io/csi/<driver>^<volumeHandle>`. Other PVs have none and are
//!   recognised by their VolumeAttachments alone.
//!
//! All comparisons are exact string equality.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;

use crate::drain::select::{NamespacedName, fmt_key};
use crate::volumes::{is_attached, pv_of, unique_name_of};

/// One persistent volume a pod uses, with the names it is recognised by.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct VolumeRef {
    /// The PV name (VolumeAttachment `spec.source.persistentVolumeName`).
    pub pv: String,
    /// The claim bound to the PV, in the pod's namespace.
    pub claim: NamespacedName,
    /// For a CSI PV, `kubernetes.io/csi/<driver>^<volumeHandle>`, the name
    /// in `node.status.volumesAttached`.
    pub csi_unique_name: Option<String>,
    /// The claim belongs to a generic ephemeral volume: it is deleted with
    /// its pod, so its volume is never attached anywhere again.
    pub ephemeral: bool,
}

/// The volumes of one pod, and why some of its claims gave none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodVolumes {
    /// Distinct PVs, in the order of `spec.volumes`.
    pub refs: Vec<VolumeRef>,
    /// One line per claim that gave no PV.
    pub notes: Vec<String>,
}

/// Looks claims and volumes up by name; built once per plan.
#[derive(Debug, Clone)]
pub struct VolumeIndex<'a> {
    claims: BTreeMap<(&'a str, &'a str), &'a PersistentVolumeClaim>,
    volumes: BTreeMap<&'a str, &'a PersistentVolume>,
}

impl<'a> VolumeIndex<'a> {
    pub fn new(pvcs: &'a [PersistentVolumeClaim], pvs: &'a [PersistentVolume]) -> Self {
        let claims = pvcs
            .iter()
            .filter_map(|c| {
                let ns = c.metadata.namespace.as_deref()?;
                let name = c.metadata.name.as_deref()?;
                Some(((ns, name), c))
            })
            .collect();
        let volumes = pvs
            .iter()
            .filter_map(|v| Some((v.metadata.name.as_deref()?, v)))
            .collect();
        Self { claims, volumes }
    }

    /// The persistent volumes `pod` uses; see the module documentation.
    pub fn pod_volumes(&self, pod: &Pod) -> PodVolumes {
        let mut out = PodVolumes::default();
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
        let volumes = pod.spec.iter().flat_map(|s| s.volumes.iter().flatten());
        for volume in volumes {
            let (claim_name, ephemeral) = if let Some(source) = &volume.persistent_volume_claim {
                (source.claim_name.clone(), false)
            } else if volume.ephemeral.is_some() {
                (format!("{pod_name}-{}", volume.name), true)
            } else {
                continue;
            };
            let claim: NamespacedName = (ns.to_string(), claim_name);
            let what = format!("claim {} (volume {})", fmt_key(&claim), volume.name);
            let Some(pvc) = self.claims.get(&(ns, claim.1.as_str())) else {
                out.notes
                    .push(format!("{what} not found; counted as no persistent volume"));
                continue;
            };
            if ephemeral && !created_for(pvc, pod) {
                out.notes.push(format!(
                    "{what} was not created for this pod; counted as no persistent volume"
                ));
                continue;
            }
            let Some(pv_name) = pvc
                .spec
                .as_ref()
                .and_then(|s| s.volume_name.as_deref())
                .filter(|n| !n.is_empty())
            else {
                out.notes.push(format!(
                    "{what} is not bound to a PV; counted as no persistent volume"
                ));
                continue;
            };
            let Some(pv) = self.volumes.get(pv_name) else {
                out.notes.push(format!(
                    "{what} is bound to PV {pv_name}, which does not exist; counted as no persistent volume"
                ));
                continue;
            };
            if out.refs.iter().any(|r| r.pv == pv_name) {
                continue;
            }
            out.refs.push(VolumeRef {
                pv: pv_name.to_string(),
                claim,
                csi_unique_name: unique_name_of(pv),
                ephemeral,
            });
        }
        out
    }
}

/// Whether an ephemeral volume's claim was created for `pod`: its controller
/// ownerReference is the pod. A pod without a uid (only in synthetic data)
/// cannot be checked and is trusted.
fn created_for(pvc: &PersistentVolumeClaim, pod: &Pod) -> bool {
    let Some(uid) = pod.metadata.uid.as_deref() else {
        return true;
    };
    pvc.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|r| r.controller == Some(true) && r.uid == uid)
}

/// The Nodes a PV is attached to according to VolumeAttachments
/// (`status.attached == true`), sorted and distinct.
pub fn attached_nodes(pv: &str, vas: &[VolumeAttachment]) -> Vec<String> {
    let mut nodes: Vec<String> = vas
        .iter()
        .filter(|va| pv_of(va) == Some(pv) && is_attached(va))
        .map(|va| va.spec.node_name.clone())
        .collect();
    nodes.sort();
    nodes.dedup();
    nodes
}

/// Whether a pod other than the evicted one (pending, not yet scheduled or
/// newly created, including a replacement of the same name) references the
/// claim through `persistentVolumeClaim.claimName`. Pods that are finished
/// or being deleted do not count.
///
/// When this is false nothing will attach the volume again (a StatefulSet
/// scaled down, a Job that completed), so a reattach wait can end at once.
/// An ephemeral volume's claim dies with its pod, so the caller skips the
/// reattach wait for [`VolumeRef::ephemeral`] volumes instead.
pub fn replacement_expected<'a>(
    claim: &NamespacedName,
    pods: impl IntoIterator<Item = &'a Pod>,
    evicted_pod_uid: &str,
) -> bool {
    let (ns, name) = claim;
    pods.into_iter().any(|pod| {
        pod.metadata.namespace.as_deref() == Some(ns.as_str())
            && pod.metadata.uid.as_deref() != Some(evicted_pod_uid)
            && pod.metadata.deletion_timestamp.is_none()
            && !matches!(
                pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )
            && pod
                .spec
                .iter()
                .flat_map(|s| s.volumes.iter().flatten())
                .filter_map(|v| v.persistent_volume_claim.as_ref())
                .any(|c| c.claim_name == *name)
    })
}

/// The scheduler's word on a replacement it cannot place: the first pod
/// of `pods` (by namespace and name) that uses `claim`, is not the evicted
/// pod and whose `PodScheduled` condition is False for reason
/// `Unschedulable`, with the scheduler's message.
pub fn unschedulable_replacement<'a>(
    claim: &NamespacedName,
    pods: impl IntoIterator<Item = &'a Pod>,
    evicted_pod_uid: &str,
) -> Option<(NamespacedName, String)> {
    let mut found: Vec<(NamespacedName, String)> = pods
        .into_iter()
        .filter(|pod| replacement_expected(claim, [*pod], evicted_pod_uid))
        .filter_map(|pod| {
            let cond = pod
                .status
                .as_ref()?
                .conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == "PodScheduled")?;
            (cond.status == "False" && cond.reason.as_deref() == Some("Unschedulable")).then(|| {
                (
                    crate::drain::select::pod_key(pod),
                    cond.message.clone().unwrap_or_default(),
                )
            })
        })
        .collect();
    found.sort();
    found.into_iter().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unschedulable_replacement_is_named_with_the_schedulers_message() {
        use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
        let claim = ("db".to_string(), "data-pg-0".to_string());
        let with_scheduled = |p: Pod, status: &str, reason: &str| {
            let mut p = p;
            p.status = Some(PodStatus {
                conditions: Some(vec![PodCondition {
                    type_: "PodScheduled".into(),
                    status: status.into(),
                    reason: Some(reason.into()),
                    message: Some(
                        "0/3 nodes are available: 3 node(s) had volume node affinity conflict."
                            .into(),
                    ),
                    ..Default::default()
                }]),
                ..Default::default()
            });
            p
        };
        let evicted = with_scheduled(
            pod("db", "pg-0").uid("old").claim("d", "data-pg-0"),
            "False",
            "Unschedulable",
        );
        let pending = with_scheduled(
            pod("db", "pg-0")
                .uid("new")
                .claim("d", "data-pg-0")
                .on_node(None),
            "False",
            "Unschedulable",
        );
        let placed = with_scheduled(
            pod("db", "pg-0").uid("new").claim("d", "data-pg-0"),
            "True",
            "",
        );
        let other_claim = with_scheduled(
            pod("db", "pg-1")
                .uid("x")
                .claim("d", "data-pg-1")
                .on_node(None),
            "False",
            "Unschedulable",
        );
        assert_eq!(
            unschedulable_replacement(&claim, [&evicted, &pending], "old"),
            Some((
                ("db".to_string(), "pg-0".to_string()),
                "0/3 nodes are available: 3 node(s) had volume node affinity conflict.".to_string()
            ))
        );
        assert_eq!(
            unschedulable_replacement(&claim, [&evicted], "old"),
            None,
            "the evicted pod is not its replacement"
        );
        assert_eq!(
            unschedulable_replacement(&claim, [&placed], "old"),
            None,
            "placed"
        );
        assert_eq!(
            unschedulable_replacement(&claim, [&other_claim], "old"),
            None,
            "another claim"
        );
    }
    use crate::drain::fixtures::{
        NODE, PodFixture, csi_pv, ephemeral_pvc, host_pv, pod, pvc, ts, va,
    };

    fn vref(pv: &str, claim: &str, csi: Option<&str>, ephemeral: bool) -> VolumeRef {
        VolumeRef {
            pv: pv.into(),
            claim: ("db".into(), claim.into()),
            csi_unique_name: csi.map(str::to_string),
            ephemeral,
        }
    }

    #[test]
    fn csi_unique_name_is_driver_caret_handle() {
        let cases = [
            (
                csi_pv("pv-1", "ebs.csi.aws.com", "vol-0abc"),
                Some("kubernetes.io/csi/ebs.csi.aws.com^vol-0abc"),
            ),
            (
                csi_pv(
                    "pv-2",
                    "pd.csi.storage.gke.io",
                    "projects/p/zones/z/disks/d",
                ),
                Some("kubernetes.io/csi/pd.csi.storage.gke.io^projects/p/zones/z/disks/d"),
            ),
            (host_pv("pv-3"), None),
            (PersistentVolume::default(), None),
        ];
        for (pv, want) in cases {
            assert_eq!(unique_name_of(&pv).as_deref(), want);
        }
    }

    #[test]
    fn claims_resolve_to_volumes_or_notes() {
        let pvcs = [
            pvc("db", "data", Some("pv-csi")),
            pvc("db", "logs", Some("pv-host")),
            pvc("db", "unbound", None),
            pvc("db", "empty-name", Some("")),
            pvc("db", "dangling", Some("pv-gone")),
            pvc("other", "elsewhere", Some("pv-csi")),
            ephemeral_pvc("db", "pg-0-scratch", "pv-eph", "uid-pg-0"),
            ephemeral_pvc("db", "pg-0-stale", "pv-eph", "uid-old"),
        ];
        let pvs = [
            csi_pv("pv-csi", "ebs.csi.aws.com", "vol-1"),
            host_pv("pv-host"),
            csi_pv("pv-eph", "ebs.csi.aws.com", "vol-2"),
        ];
        let index = VolumeIndex::new(&pvcs, &pvs);
        let csi1 = Some("kubernetes.io/csi/ebs.csi.aws.com^vol-1");
        let csi2 = Some("kubernetes.io/csi/ebs.csi.aws.com^vol-2");
        let cases: Vec<(&str, Pod, Vec<VolumeRef>, Vec<&str>)> = vec![
            ("no volumes", pod("db", "pg-0"), vec![], vec![]),
            (
                "bound CSI claim",
                pod("db", "pg-0").claim("d", "data"),
                vec![vref("pv-csi", "data", csi1, false)],
                vec![],
            ),
            (
                "bound non-CSI claim",
                pod("db", "pg-0").claim("l", "logs"),
                vec![vref("pv-host", "logs", None, false)],
                vec![],
            ),
            (
                "unbound claim",
                pod("db", "pg-0").claim("u", "unbound"),
                vec![],
                vec!["claim db/unbound (volume u) is not bound to a PV"],
            ),
            (
                "claim with empty volumeName",
                pod("db", "pg-0").claim("u", "empty-name"),
                vec![],
                vec!["claim db/empty-name (volume u) is not bound to a PV"],
            ),
            (
                "missing claim",
                pod("db", "pg-0").claim("m", "nope"),
                vec![],
                vec!["claim db/nope (volume m) not found"],
            ),
            (
                "claim in another namespace is not used",
                pod("db", "pg-0").claim("e", "elsewhere"),
                vec![],
                vec!["claim db/elsewhere (volume e) not found"],
            ),
            (
                "bound to a missing PV",
                pod("db", "pg-0").claim("x", "dangling"),
                vec![],
                vec!["bound to PV pv-gone, which does not exist"],
            ),
            (
                "ephemeral volume",
                pod("db", "pg-0").ephemeral("scratch"),
                vec![vref("pv-eph", "pg-0-scratch", csi2, true)],
                vec![],
            ),
            (
                "ephemeral claim left by another pod",
                pod("db", "pg-0").ephemeral("stale"),
                vec![],
                vec!["claim db/pg-0-stale (volume stale) was not created for this pod"],
            ),
            (
                "ephemeral claim not created yet",
                pod("db", "pg-0").ephemeral("cache"),
                vec![],
                vec!["claim db/pg-0-cache (volume cache) not found"],
            ),
            (
                "same claim twice gives one volume",
                pod("db", "pg-0").claim("a", "data").claim("b", "data"),
                vec![vref("pv-csi", "data", csi1, false)],
                vec![],
            ),
            (
                "mixed, in spec order",
                pod("db", "pg-0")
                    .claim("l", "logs")
                    .claim("u", "unbound")
                    .claim("d", "data"),
                vec![
                    vref("pv-host", "logs", None, false),
                    vref("pv-csi", "data", csi1, false),
                ],
                vec!["claim db/unbound (volume u) is not bound"],
            ),
        ];
        for (what, pod, refs, notes) in cases {
            let got = index.pod_volumes(&pod);
            assert_eq!(got.refs, refs, "{what}");
            assert_eq!(got.notes.len(), notes.len(), "{what}: {:?}", got.notes);
            for (note, want) in got.notes.iter().zip(notes) {
                assert!(note.contains(want), "{what}: {note:?} lacks {want:?}");
            }
        }
    }

    #[test]
    fn attachments_are_read_from_volume_attachments() {
        let vas = [
            va("pv-1", "node-b", true),
            va("pv-1", NODE, true),
            va("pv-1", "node-c", false),
            va("pv-10", "node-d", true),
            va("pv-1", "node-b", true),
        ];
        assert_eq!(attached_nodes("pv-1", &vas), vec!["node-1", "node-b"]);
        assert_eq!(attached_nodes("pv-10", &vas), vec!["node-d"]);
        assert_eq!(attached_nodes("pv-2", &vas), Vec::<String>::new());
    }

    #[test]
    fn replacement_is_another_live_pod_on_the_claim() {
        let claim: NamespacedName = ("db".into(), "data-pg-0".into());
        let evicted = pod("db", "pg-0").claim("d", "data-pg-0");
        let cases = [
            ("only the evicted pod", vec![evicted.clone()], false),
            ("nothing at all", vec![], false),
            (
                "recreated with the same name",
                vec![
                    evicted.clone(),
                    pod("db", "pg-0")
                        .uid("uid-new")
                        .claim("d", "data-pg-0")
                        .phase("Pending")
                        .on_node(None),
                ],
                true,
            ),
            (
                "another pod on the claim",
                vec![pod("db", "reader").claim("d", "data-pg-0")],
                true,
            ),
            (
                "same claim name in another namespace",
                vec![pod("web", "reader").claim("d", "data-pg-0")],
                false,
            ),
            (
                "another claim",
                vec![pod("db", "pg-1").claim("d", "data-pg-1")],
                false,
            ),
            (
                "other user being deleted",
                vec![pod("db", "reader").claim("d", "data-pg-0").deleting(ts(5))],
                false,
            ),
            (
                "other user finished",
                vec![pod("db", "job").claim("d", "data-pg-0").phase("Succeeded")],
                false,
            ),
            (
                "ephemeral volume of the same name does not count",
                vec![pod("db", "data").ephemeral("pg-0")],
                false,
            ),
        ];
        for (what, pods, want) in cases {
            assert_eq!(
                replacement_expected(&claim, &pods, "uid-pg-0"),
                want,
                "{what}"
            );
        }
    }
}
