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
//! An **inline** volume of a kind that attaches (an EBS volume, a GCE PD,
//! an iSCSI LUN named in the pod spec itself) is a persistent volume too:
//! it has no PV and no claim, so it goes by one name in place of both,
//! `inline:<kind>:<id>` ([`inline_claim_name`]), and is given its kind and
//! recognised on the Node as the PV it would be ([`inline_as_pv`]).
//!
//! A volume is recognised by two computed identities, never by guessing:
//!
//! - its PV name, which VolumeAttachments carry in
//!   `spec.source.persistentVolumeName`;
//! - the unique name the Node lists in `status.volumesAttached[].name`:
//!   exactly `kubernetes.io/csi/<driver>^<volumeHandle>` for a CSI PV (and
//!   an in-tree PV CSI migration translates), `<plugin>/<volume name>` for
//!   the in-tree kinds the attach-detach controller attaches itself
//!   (iSCSI, FC, RBD, FlexVolume: see [`unique_name_of`]). Other PVs have
//!   none and are recognised by their VolumeAttachments alone.
//!
//! All comparisons are exact string equality.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod, Volume};
use k8s_openapi::api::storage::v1::VolumeAttachment;

use crate::cache::inline::{INLINE_PREFIX, inline_as_pv, inline_claim_name, inline_volume_named};
use crate::drain::select::{NamespacedName, fmt_key, pod_key};
use crate::drain::volume_kind::VolumeKind;
use crate::volumes::{is_attached, pv_of, unique_name_of};

/// One persistent volume a pod uses, with the names it is recognised by.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct VolumeRef {
    /// The PV name (VolumeAttachment `spec.source.persistentVolumeName`).
    pub pv: String,
    /// The claim bound to the PV, in the pod's namespace.
    pub claim: NamespacedName,
    /// The name in `node.status.volumesAttached` ([`unique_name_of`]), for
    /// a PV that has one.
    pub unique_name: Option<String>,
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

    /// The PersistentVolume named `name`.
    pub fn pv(&self, name: &str) -> Option<&'a PersistentVolume> {
        self.volumes.get(name).copied()
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
                if let Some(r) = inline_ref(ns, volume)
                    && !out.refs.iter().any(|o| o.pv == r.pv)
                {
                    out.refs.push(r);
                }
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
                unique_name: unique_name_of(pv),
                ephemeral,
            });
        }
        out
    }
}

/// The [`VolumeRef`] of inline volume `volume` of a pod in namespace `ns`,
/// if it is of a kind that attaches and the Node can list: its name stands
/// for both the PV and the claim.
fn inline_ref(ns: &str, volume: &Volume) -> Option<VolumeRef> {
    let name = inline_claim_name(volume)?;
    let unique_name = unique_name_of(&inline_as_pv(volume)?)?;
    Some(VolumeRef {
        pv: name.clone(),
        claim: (ns.to_string(), name),
        unique_name: Some(unique_name),
        ephemeral: false,
    })
}

/// The PersistentVolume the inline volume of `pod` named `name` (see
/// [`inline_claim_name`]) would be, for its kind.
pub fn inline_pv_of(pod: &Pod, name: &str) -> Option<PersistentVolume> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .find(|v| inline_claim_name(v).as_deref() == Some(name))
        .and_then(inline_as_pv)
}

/// The unique name of the inline volume named `name` (see
/// [`inline_claim_name`]), made again from the name.
pub fn inline_unique_name(name: &str) -> Option<String> {
    unique_name_of(&inline_as_pv(&inline_volume_named(name)?)?)
}

/// Whether `name` is an inline volume's (see [`inline_claim_name`]), not a
/// PV's or a claim's.
pub fn is_inline(name: &str) -> bool {
    name.starts_with(INLINE_PREFIX)
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
    !replacements(claim, pods, evicted_pod_uid, &BTreeSet::new()).is_empty()
}

/// The pods that use `claim` in place of the evicted pod: live pods that
/// reference it (as in [`replacement_expected`]), other than the evicted
/// UID and the pods in `users_before` (the claim's users on other Nodes
/// before the eviction: a ReadWriteMany volume already in use elsewhere
/// says nothing about where the evicted pod's replacement went).
pub fn replacements<'a>(
    claim: &NamespacedName,
    pods: impl IntoIterator<Item = &'a Pod>,
    evicted_pod_uid: &str,
    users_before: &BTreeSet<String>,
) -> Vec<&'a Pod> {
    let (ns, name) = claim;
    pods.into_iter()
        .filter(|pod| {
            let uid = pod.metadata.uid.as_deref();
            pod.metadata.namespace.as_deref() == Some(ns.as_str())
                && uid != Some(evicted_pod_uid)
                && !uid.is_some_and(|u| users_before.contains(u))
                && pod.metadata.deletion_timestamp.is_none()
                && !matches!(
                    pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Succeeded" | "Failed")
                )
                && uses_claim(pod, name)
        })
        .collect()
}

fn uses_claim(pod: &Pod, claim: &str) -> bool {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .any(|v| match &v.persistent_volume_claim {
            Some(c) => c.claim_name == claim,
            None => is_inline(claim) && inline_claim_name(v).as_deref() == Some(claim),
        })
}

/// The UIDs of the pods that use `claim` on a Node other than `node` (bound
/// to it, live): taken before an eviction, they are not its replacement.
pub fn users_elsewhere<'a>(
    claim: &NamespacedName,
    pods: impl IntoIterator<Item = &'a Pod>,
    node: &str,
) -> BTreeSet<String> {
    pods.into_iter()
        .filter(|p| p.metadata.namespace.as_deref() == Some(claim.0.as_str()))
        .filter(|p| {
            let on = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
            on.is_some_and(|n| n != node)
        })
        .filter(|p| uses_claim(p, &claim.1))
        .filter_map(|p| p.metadata.uid.clone())
        .collect()
}

/// [`users_elsewhere`] among the pods created before `since`: after a
/// restart, the pods that used the claim elsewhere before the move began
/// (a pod created since may be its replacement).
pub fn users_elsewhere_before<'a>(
    claim: &NamespacedName,
    pods: impl IntoIterator<Item = &'a Pod>,
    node: &str,
    since: k8s_openapi::jiff::Timestamp,
) -> BTreeSet<String> {
    let before = pods.into_iter().filter(|p| {
        p.metadata
            .creation_timestamp
            .as_ref()
            .is_some_and(|t| t.0 < since)
    });
    users_elsewhere(claim, before, node)
}

/// Where a volume went: the Node and the pod that uses it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    pub node: String,
    pub pod: NamespacedName,
}

/// Whether a volume of kind `kind` has moved off `old_node` with its
/// claim's `replacements`: for an attachable volume, a replacement is
/// bound to another Node and a VolumeAttachment of `pv` to that Node is
/// attached (and not being deleted), or that Node lists the volume in
/// `status.volumesAttached` (`listed_on`: the in-tree kinds the
/// attach-detach controller attaches without a VolumeAttachment); for an
/// attach-free one, a replacement is Running and Ready on another Node.
/// The first replacement (by namespace and name) that qualifies is the
/// answer.
///
/// # Errors
/// What is still awaited, in words that name the kind.
pub fn volume_moved(
    pv: &str,
    kind: VolumeKind,
    old_node: &str,
    replacements: &[&Pod],
    attachments: &[VolumeAttachment],
    listed_on: &dyn Fn(&str) -> bool,
) -> Result<Moved, String> {
    let mut candidates: Vec<(NamespacedName, &str, &Pod)> = replacements
        .iter()
        .map(|p| {
            let key = pod_key(p);
            let node = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
            (key, node.unwrap_or_default(), *p)
        })
        .collect();
    candidates.sort_by(|a, b| a.0.cmp(&b.0));
    let mut pending = Vec::new();
    for (key, node, pod) in &candidates {
        let who = format!("pod {}", fmt_key(key));
        if node.is_empty() {
            pending.push(format!("{who} is not scheduled yet"));
            continue;
        }
        if *node == old_node {
            pending.push(format!("{who} is on the draining Node {old_node}"));
            continue;
        }
        let done = match kind {
            VolumeKind::AttachFree => {
                let ready = is_running_and_ready(pod);
                if !ready {
                    pending.push(format!("{who} on Node {node} is not Running and Ready yet"));
                }
                ready
            }
            _ => {
                let held = attachments.iter().any(|va| {
                    pv_of(va) == Some(pv)
                        && va.spec.node_name == *node
                        && is_attached(va)
                        && va.metadata.deletion_timestamp.is_none()
                }) || listed_on(node);
                if !held {
                    pending.push(format!("not attached on Node {node}, where {who} runs"));
                }
                held
            }
        };
        if done {
            return Ok(Moved {
                node: node.to_string(),
                pod: key.clone(),
            });
        }
    }
    if candidates.is_empty() {
        pending.push("no pod uses its claim yet".into());
    }
    Err(format!("{kind} PV {pv}: {}", pending.join("; ")))
}

/// Phase Running and condition Ready True.
pub fn is_running_and_ready(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    status.and_then(|s| s.phase.as_deref()) == Some("Running")
        && status
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True")
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
            unique_name: csi.map(str::to_string),
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
    fn an_inline_volume_that_attaches_is_a_persistent_volume() {
        let inline = |source: serde_json::Value| {
            let mut p = pod("db", "legacy-1");
            let mut v = source;
            v["name"] = "disk".into();
            p.spec
                .get_or_insert_default()
                .volumes
                .get_or_insert_default()
                .push(serde_json::from_value(v).expect("a volume"));
            p
        };
        let index = VolumeIndex::new(&[], &[]);
        let ebs = inline(serde_json::json!({"awsElasticBlockStore": {"volumeID": "vol-1"}}));
        let got = index.pod_volumes(&ebs);
        let name = "inline:awsElasticBlockStore:vol-1".to_string();
        assert_eq!(
            got.refs,
            vec![VolumeRef {
                pv: name.clone(),
                claim: ("db".into(), name.clone()),
                unique_name: Some("kubernetes.io/csi/ebs.csi.aws.com^vol-1".into()),
                ephemeral: false,
            }]
        );
        assert!(is_inline(&name));
        assert!(inline_pv_of(&ebs, &name).is_some());
        // Its replacement, made from the same template, uses it too.
        let new = inline(serde_json::json!({"awsElasticBlockStore": {"volumeID": "vol-1"}}))
            .uid("uid-new")
            .on_node(Some("node-2"));
        let found = replacements(&("db".into(), name), [&new], "uid-old", &BTreeSet::new());
        assert_eq!(found.len(), 1);
        // An inline NFS share attaches nowhere: no persistent volume.
        let nfs = inline(serde_json::json!({"nfs": {"server": "s", "path": "/"}}));
        assert!(index.pod_volumes(&nfs).refs.is_empty());
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

    fn ready(mut p: Pod, ready: bool) -> Pod {
        let status = p.status.get_or_insert_default();
        status.conditions = Some(vec![k8s_openapi::api::core::v1::PodCondition {
            type_: "Ready".into(),
            status: if ready { "True" } else { "False" }.into(),
            ..Default::default()
        }]);
        p
    }

    #[test]
    fn users_on_other_nodes_before_the_eviction_are_not_its_replacement() {
        let claim: NamespacedName = ("db".into(), "shared".into());
        let before_eviction = [
            pod("db", "evicted").claim("d", "shared"),
            pod("db", "peer")
                .claim("d", "shared")
                .on_node(Some("node-2")),
            pod("db", "pending").claim("d", "shared").on_node(None),
            pod("db", "other")
                .claim("d", "other")
                .on_node(Some("node-3")),
        ];
        let before = users_elsewhere(&claim, &before_eviction, NODE);
        assert_eq!(before, BTreeSet::from(["uid-peer".to_string()]));
        let after = [
            pod("db", "peer")
                .claim("d", "shared")
                .on_node(Some("node-2")),
            pod("db", "evicted")
                .uid("uid-new")
                .claim("d", "shared")
                .on_node(Some("node-3")),
        ];
        let got: Vec<String> = replacements(&claim, &after, "uid-evicted", &before)
            .iter()
            .map(|p| p.metadata.uid.clone().unwrap_or_default())
            .collect();
        assert_eq!(got, ["uid-new"]);
        assert!(replacements(&claim, &after[..1], "uid-evicted", &before).is_empty());
        // Without the list, the peer would count (the old rule).
        assert!(replacement_expected(&claim, &after[..1], "uid-evicted"));
    }

    #[test]
    fn after_a_restart_the_users_before_are_those_created_before_the_move() {
        use crate::drain::fixtures::ts;
        let claim: NamespacedName = ("db".into(), "shared".into());
        let created = |p: Pod, secs: i64| {
            let mut p = p;
            p.metadata.creation_timestamp = Some(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(ts(secs)),
            );
            p
        };
        // After the restart both the peer (there all along) and the
        // replacement use the claim on other Nodes; only the peer was
        // there before the move began at 100.
        let now = [
            created(
                pod("db", "peer")
                    .claim("d", "shared")
                    .on_node(Some("node-2")),
                10,
            ),
            created(
                pod("db", "evicted")
                    .uid("uid-new")
                    .claim("d", "shared")
                    .on_node(Some("node-3")),
                105,
            ),
        ];
        let before = users_elsewhere_before(&claim, &now, NODE, ts(100));
        assert_eq!(before, BTreeSet::from(["uid-peer".to_string()]));
        let got: Vec<String> = replacements(&claim, &now, "uid-evicted", &before)
            .iter()
            .map(|p| p.metadata.uid.clone().unwrap_or_default())
            .collect();
        assert_eq!(got, ["uid-new"], "the peer is not the replacement");
        // Every user now (the first run's rule at this point) would take
        // the replacement for a peer, and wait for ever.
        let all = users_elsewhere(&claim, &now, NODE);
        assert!(replacements(&claim, &now, "uid-evicted", &all).is_empty());
    }

    #[test]
    fn a_volume_moved_where_its_replacement_runs() {
        let attachable = VolumeKind::Attachable;
        let free = VolumeKind::AttachFree;
        let new = |node: Option<&str>| {
            pod("db", "pg-0")
                .uid("uid-new")
                .claim("d", "data")
                .on_node(node)
        };
        let on2 = new(Some("node-2"));
        let unscheduled = new(None);
        let back_here = new(Some(NODE));
        let ready_on2 = ready(new(Some("node-2")), true);
        let not_ready_on2 = ready(new(Some("node-2")), false);
        let pending_on2 = ready(new(Some("node-2")).phase("Pending"), true);
        let attached_2 = va("pv-1", "node-2", true);
        let attached_3 = va("pv-1", "node-3", true);
        let attaching_2 = va("pv-1", "node-2", false);
        // (what, kind, replacements, attachments, Ok(node) or a part of the error)
        type Case<'a> = (
            &'a str,
            VolumeKind,
            Vec<&'a Pod>,
            Vec<VolumeAttachment>,
            Result<&'a str, &'a str>,
        );
        let cases: Vec<Case> = vec![
            (
                "attached where it runs",
                attachable,
                vec![&on2],
                vec![attached_2.clone()],
                Ok("node-2"),
            ),
            (
                "attached elsewhere only (ReadWriteMany peer)",
                attachable,
                vec![&on2],
                vec![attached_3.clone()],
                Err("attachable PV pv-1: not attached on Node node-2, where pod db/pg-0 runs"),
            ),
            (
                "still attaching",
                attachable,
                vec![&on2],
                vec![attaching_2],
                Err("not attached on Node node-2"),
            ),
            (
                "not scheduled",
                attachable,
                vec![&unscheduled],
                vec![attached_3],
                Err("not scheduled yet"),
            ),
            (
                "no replacement",
                attachable,
                vec![],
                vec![attached_2.clone()],
                Err("no pod uses its claim yet"),
            ),
            (
                "back on the draining Node",
                attachable,
                vec![&back_here],
                vec![va("pv-1", NODE, true)],
                Err("on the draining Node"),
            ),
            (
                "attach-free, Running and Ready",
                free,
                vec![&ready_on2],
                vec![],
                Ok("node-2"),
            ),
            (
                "attach-free, not Ready",
                free,
                vec![&not_ready_on2],
                vec![],
                Err("attach-free PV pv-1: pod db/pg-0 on Node node-2 is not Running and Ready yet"),
            ),
            (
                "attach-free, Pending",
                free,
                vec![&pending_on2],
                vec![],
                Err("not Running and Ready"),
            ),
            (
                "attach-free, no Ready condition",
                free,
                vec![&on2],
                vec![attached_2],
                Err("not Running and Ready"),
            ),
        ];
        let listed_nowhere = |_: &str| false;
        for (what, kind, pods, vas, want) in cases {
            let got = volume_moved("pv-1", kind, NODE, &pods, &vas, &listed_nowhere);
            match (got, want) {
                (Ok(m), Ok(node)) => {
                    assert_eq!(m.node, node, "{what}");
                    assert_eq!(m.pod, ("db".to_string(), "pg-0".to_string()), "{what}");
                }
                (Err(e), Err(part)) => assert!(e.contains(part), "{what}: {e:?} lacks {part:?}"),
                (got, want) => panic!("{what}: {got:?}, wanted {want:?}"),
            }
        }
        // An in-tree kind the attach-detach controller attaches itself has
        // no VolumeAttachment: the Node where the replacement runs lists
        // it, and no other Node's listing counts.
        let on_node_2 = |node: &str| node == "node-2";
        let on_node_3 = |node: &str| node == "node-3";
        let got = volume_moved("pv-1", attachable, NODE, &[&on2], &[], &on_node_2);
        assert_eq!(got.expect("listed where it runs").node, "node-2");
        let got = volume_moved("pv-1", attachable, NODE, &[&on2], &[], &on_node_3);
        assert!(got.is_err(), "listed elsewhere only: {got:?}");
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
