//! Pure predicates over informer-cache contents: is a volume still attached
//! to a Node, has it been attached to another one, and the names that identify
//! a volume on both sides (VolumeAttachment and `node.status.volumesAttached`).
//!
//! Nothing here reads a store or awaits: the tracker's waits feed these
//! functions a snapshot of the stores, so their rules can be tested with
//! plain tables.

use k8s_openapi::api::core::v1::{Node, PersistentVolume};
use k8s_openapi::api::storage::v1::{VolumeAttachment, VolumeError};

/// Prefix of the unique name the attach/detach controller and kubelet give a
/// CSI volume in `node.status.volumesAttached[].name`.
pub const CSI_UNIQUE_NAME_PREFIX: &str = "kubernetes.io/csi/";

/// The unique name of a CSI volume as it appears in
/// `node.status.volumesAttached[].name`:
/// `kubernetes.io/csi/<driver>^<volumeHandle>`.
pub fn csi_unique_name(driver: &str, volume_handle: &str) -> String {
    format!("{CSI_UNIQUE_NAME_PREFIX}{driver}^{volume_handle}")
}

/// The `node.status.volumesAttached` name of a PersistentVolume, computed
/// from its `spec.csi` (driver and volume handle).
///
/// An in-tree PV that CSI migration moves to a CSI driver (EBS, GCE PD,
/// Azure disk, Cinder, vSphere, Portworx) is listed under the name of its
/// translated source ([`migrated_csi_source`](super::intree::migrated_csi_source));
/// one of the in-tree kinds the attach-detach controller attaches itself
/// (iSCSI, FC, RBD, FlexVolume) under its plugin's name
/// ([`in_tree_attachable_name`](super::intree::in_tree_attachable_name)).
///
/// `None` for other PVs (a local or host-path volume, an attach-free
/// in-tree kind, a source that does not translate): such a volume is then
/// only recognised through its VolumeAttachment, by PV name.
pub fn unique_name_of(pv: &PersistentVolume) -> Option<String> {
    if let Some(csi) = pv.spec.as_ref()?.csi.as_ref() {
        return Some(csi_unique_name(&csi.driver, &csi.volume_handle));
    }
    if let Some((driver, handle)) = super::intree::migrated_csi_source(pv) {
        return Some(csi_unique_name(driver, &handle));
    }
    super::intree::in_tree_attachable_name(pv).map(|(_, name)| name)
}

/// Whether Node `node` lists `unique_name` in `status.volumesAttached`:
/// the attach-detach controller attached the volume there.
pub fn listed_on(node: &Node, unique_name: &str) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.volumes_attached.as_ref())
        .is_some_and(|vols| vols.iter().any(|v| v.name == unique_name))
}

/// The PersistentVolume a VolumeAttachment attaches
/// (`spec.source.persistentVolumeName`); `None` for an inline volume.
pub fn pv_of(va: &VolumeAttachment) -> Option<&str> {
    va.spec.source.persistent_volume_name.as_deref()
}

/// Whether the attacher reports the volume attached (`status.attached`).
pub fn is_attached(va: &VolumeAttachment) -> bool {
    va.status.as_ref().is_some_and(|s| s.attached)
}

/// Whether the VolumeAttachment has been asked to go away
/// (`metadata.deletionTimestamp` is set).
pub fn is_deleting(va: &VolumeAttachment) -> bool {
    va.metadata.deletion_timestamp.is_some()
}

/// What the cache says about one VolumeAttachment of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// Name of the VolumeAttachment object.
    pub name: String,
    /// `spec.nodeName`.
    pub node: String,
    /// `status.attached`.
    pub attached: bool,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
}

impl Attachment {
    /// Summarises one VolumeAttachment.
    pub fn of(va: &VolumeAttachment) -> Self {
        Self {
            name: va.metadata.name.clone().unwrap_or_default(),
            node: va.spec.node_name.clone(),
            attached: is_attached(va),
            deleting: is_deleting(va),
        }
    }
}

/// Every VolumeAttachment of `pv` among `attachments`, sorted by node then
/// name.
pub fn attachments_of<'a>(
    pv: &str,
    attachments: impl IntoIterator<Item = &'a VolumeAttachment>,
) -> Vec<Attachment> {
    let mut out: Vec<Attachment> = attachments
        .into_iter()
        .filter(|va| pv_of(va) == Some(pv))
        .map(Attachment::of)
        .collect();
    out.sort_by(|a, b| (&a.node, &a.name).cmp(&(&b.node, &b.name)));
    out
}

fn error_message(e: Option<&VolumeError>) -> Option<String> {
    e.map(|e| {
        let message = e.message.as_deref().unwrap_or("(no message)");
        match e.error_code {
            Some(code) => format!("{message} (code {code})"),
            None => message.to_string(),
        }
    })
}

/// The gRPC status code `RESOURCE_EXHAUSTED`, in a VolumeAttachment's
/// `status.attachError.errorCode`: the attacher cannot attach the volume
/// there for lack of a resource (the Node has no free attach slot), and
/// retrying will not help until one frees.
pub const RESOURCE_EXHAUSTED: i32 = 8;

/// A VolumeAttachment whose attacher said it cannot attach its volume
/// there (see [`attach_exhausted`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachRefused {
    /// Name of the VolumeAttachment.
    pub name: String,
    /// The Node it would attach the volume to.
    pub node: String,
    /// The attach error's message.
    pub message: String,
}

/// Whether the attacher refused, for lack of a resource, to attach `pv`
/// on a Node other than `old_node`: a VolumeAttachment of `pv` there, not
/// attached and not being deleted, whose `status.attachError.errorCode`
/// is [`RESOURCE_EXHAUSTED`] (the CSI driver's answer for a Node at its
/// attach limit). The attacher keeps trying, in vain while nothing frees,
/// so a wait for the volume to attach there can end now. The first such
/// attachment by Node, then name.
pub fn attach_exhausted<'a>(
    pv: &str,
    old_node: &str,
    attachments: impl IntoIterator<Item = &'a VolumeAttachment>,
) -> Option<AttachRefused> {
    let mut refused: Vec<AttachRefused> = attachments
        .into_iter()
        .filter(|va| pv_of(va) == Some(pv) && va.spec.node_name != old_node)
        .filter(|va| !is_attached(va) && !is_deleting(va))
        .filter_map(|va| {
            let error = va.status.as_ref()?.attach_error.as_ref()?;
            (error.error_code == Some(RESOURCE_EXHAUSTED)).then(|| AttachRefused {
                name: va.metadata.name.clone().unwrap_or_default(),
                node: va.spec.node_name.clone(),
                message: error.message.clone().unwrap_or_default(),
            })
        })
        .collect();
    refused.sort_by(|a, b| (&a.node, &a.name).cmp(&(&b.node, &b.name)));
    refused.into_iter().next()
}

fn describe(va: &VolumeAttachment) -> String {
    let mut s = format!(
        "VolumeAttachment {}, attached={}",
        va.metadata.name.as_deref().unwrap_or("<unnamed>"),
        is_attached(va)
    );
    if is_deleting(va) {
        s.push_str(", being deleted");
    }
    let status = va.status.as_ref();
    if let Some(m) = error_message(status.and_then(|s| s.detach_error.as_ref())) {
        s.push_str(", detach error: ");
        s.push_str(&m);
    }
    if let Some(m) = error_message(status.and_then(|s| s.attach_error.as_ref())) {
        s.push_str(", attach error: ");
        s.push_str(&m);
    }
    s
}

/// Whether `pv` is no longer attached to the Node `node_name`.
///
/// The rule is deliberately the safest one:
///
/// * **VolumeAttachment side**: no VolumeAttachment for (`pv`,
///   `node_name`) may exist at all. One with `status.attached == false`, or
///   one that is being deleted (deletionTimestamp set), still counts as
///   attached: the external attacher removes its finalizer, and so the
///   object, only after the detach succeeded (`ControllerUnpublishVolume`),
///   so the object's disappearance is the one reliable signal.
/// * **Node side**, when the volume's unique name is known (see
///   [`unique_name_of`]): `node.status.volumesAttached` must not list it.
///   A Node that is gone from the cache counts as detached on this side
///   (there is nothing left to be attached to).
///
/// `attachments` may contain any VolumeAttachments; only those of `pv` on
/// `node_name` matter.
///
/// # Errors
/// A human-readable sentence saying what is still attached, e.g.
/// `pv-a still attached to node-a (VolumeAttachment csi-1, attached=true)`.
pub fn detached_from<'a>(
    pv: &str,
    unique_name: Option<&str>,
    node_name: &str,
    attachments: impl IntoIterator<Item = &'a VolumeAttachment>,
    node: Option<&Node>,
) -> Result<(), String> {
    let mut held: Vec<&VolumeAttachment> = attachments
        .into_iter()
        .filter(|va| pv_of(va) == Some(pv) && va.spec.node_name == node_name)
        .collect();
    held.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));

    let listed = match (unique_name, node) {
        (Some(unique), Some(node)) => listed_on(node, unique),
        _ => false,
    };

    let mut reasons = Vec::new();
    if !held.is_empty() {
        let what: Vec<String> = held.iter().map(|va| describe(va)).collect();
        reasons.push(format!(
            "{pv} still attached to {node_name} ({})",
            what.join("; ")
        ));
    }
    if listed {
        reasons.push(format!(
            "{pv} still listed in status.volumesAttached of Node {node_name} as {}",
            unique_name.unwrap_or_default()
        ));
    }
    if reasons.is_empty() {
        Ok(())
    } else {
        Err(reasons.join(" and "))
    }
}

/// Whether `pv` is attached to a Node other than `old_node`: some
/// VolumeAttachment of `pv` has `spec.nodeName != old_node`,
/// `status.attached == true` and is not being deleted (an attachment on its
/// way out is not where the volume went).
///
/// Returns that Node's name; if several qualify (a multi-attach volume), the
/// lexicographically smallest one, so the answer is deterministic.
///
/// # Errors
/// A human-readable sentence saying why not yet, naming the candidate
/// VolumeAttachments and any attach error.
pub fn attached_elsewhere<'a>(
    pv: &str,
    old_node: &str,
    attachments: impl IntoIterator<Item = &'a VolumeAttachment>,
) -> Result<String, String> {
    let mut candidates: Vec<&VolumeAttachment> = attachments
        .into_iter()
        .filter(|va| pv_of(va) == Some(pv) && va.spec.node_name != old_node)
        .collect();
    candidates.sort_by(|a, b| {
        (&a.spec.node_name, &a.metadata.name).cmp(&(&b.spec.node_name, &b.metadata.name))
    });
    if let Some(va) = candidates
        .iter()
        .find(|va| is_attached(va) && !is_deleting(va))
    {
        return Ok(va.spec.node_name.clone());
    }
    if candidates.is_empty() {
        return Err(format!(
            "{pv} not attached to any Node other than {old_node} (no VolumeAttachment elsewhere yet)"
        ));
    }
    let what: Vec<String> = candidates
        .iter()
        .map(|va| format!("on {}: {}", va.spec.node_name, describe(va)))
        .collect();
    Err(format!(
        "{pv} not yet attached to a Node other than {old_node} ({})",
        what.join("; ")
    ))
}

#[cfg(test)]
pub(crate) mod fixtures {
    use k8s_openapi::api::core::v1::{AttachedVolume, Node, NodeStatus};
    use k8s_openapi::api::storage::v1::{
        VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec, VolumeAttachmentStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    /// A VolumeAttachment of `pv` on `node`.
    pub fn va(name: &str, pv: &str, node: &str, attached: bool) -> VolumeAttachment {
        VolumeAttachment {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            spec: VolumeAttachmentSpec {
                attacher: "ebs.csi.aws.com".to_owned(),
                node_name: node.to_owned(),
                source: VolumeAttachmentSource {
                    persistent_volume_name: Some(pv.to_owned()),
                    ..VolumeAttachmentSource::default()
                },
            },
            status: Some(VolumeAttachmentStatus {
                attached,
                ..VolumeAttachmentStatus::default()
            }),
        }
    }

    /// `va` with a deletion timestamp.
    pub fn deleting(mut va: VolumeAttachment) -> VolumeAttachment {
        va.metadata.deletion_timestamp = Some(Time(Default::default()));
        va
    }

    /// A Node whose `status.volumesAttached` lists `attached`.
    pub fn node(name: &str, attached: &[&str]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            status: Some(NodeStatus {
                volumes_attached: Some(
                    attached
                        .iter()
                        .map(|n| AttachedVolume {
                            name: (*n).to_owned(),
                            device_path: String::new(),
                        })
                        .collect(),
                ),
                ..NodeStatus::default()
            }),
            ..Node::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{deleting, node, va};
    use super::*;
    use k8s_openapi::api::core::v1::{CSIPersistentVolumeSource, PersistentVolumeSpec};
    use k8s_openapi::api::storage::v1::VolumeAttachmentStatus;

    const UNIQUE_A: &str = "kubernetes.io/csi/ebs.csi.aws.com^vol-a";

    /// (case, VolumeAttachments, unique name, Node, expected error fragments
    /// or `None` for detached).
    type DetachCase<'a> = (
        &'a str,
        Vec<&'a VolumeAttachment>,
        Option<&'a str>,
        Option<&'a Node>,
        Option<&'a [&'a str]>,
    );
    /// (case, VolumeAttachments, new node or expected error fragments).
    type ReattachCase<'a> = (
        &'a str,
        Vec<&'a VolumeAttachment>,
        Result<&'a str, &'a [&'a str]>,
    );

    #[test]
    fn csi_unique_name_is_computed_from_driver_and_handle() {
        assert_eq!(csi_unique_name("ebs.csi.aws.com", "vol-a"), UNIQUE_A);
        let pv = PersistentVolume {
            spec: Some(PersistentVolumeSpec {
                csi: Some(CSIPersistentVolumeSource {
                    driver: "ebs.csi.aws.com".to_owned(),
                    volume_handle: "vol-a".to_owned(),
                    ..CSIPersistentVolumeSource::default()
                }),
                ..PersistentVolumeSpec::default()
            }),
            ..PersistentVolume::default()
        };
        assert_eq!(unique_name_of(&pv).as_deref(), Some(UNIQUE_A));
        assert_eq!(unique_name_of(&PersistentVolume::default()), None);
    }

    #[test]
    fn detached_from_table() {
        let n_listed = node("node-a", &[UNIQUE_A]);
        let n_empty = node("node-a", &[]);
        let n_other = node("node-a", &["kubernetes.io/csi/ebs.csi.aws.com^vol-b"]);
        let here = va("csi-1", "pv-a", "node-a", true);
        let here_detached = va("csi-1", "pv-a", "node-a", false);
        let here_deleting = deleting(va("csi-1", "pv-a", "node-a", false));
        let elsewhere = va("csi-2", "pv-a", "node-b", true);
        let other_pv = va("csi-3", "pv-b", "node-a", true);

        // (case, vas, unique name, node, expected error fragments or None)
        let cases: Vec<DetachCase<'_>> = vec![
            ("nothing at all", vec![], Some(UNIQUE_A), None, None),
            (
                "node lists nothing",
                vec![],
                Some(UNIQUE_A),
                Some(&n_empty),
                None,
            ),
            (
                "node lists other volume",
                vec![&other_pv],
                Some(UNIQUE_A),
                Some(&n_other),
                None,
            ),
            (
                "only attached elsewhere",
                vec![&elsewhere],
                Some(UNIQUE_A),
                Some(&n_empty),
                None,
            ),
            (
                "va attached here",
                vec![&here, &elsewhere],
                Some(UNIQUE_A),
                Some(&n_empty),
                Some(&[
                    "pv-a still attached to node-a",
                    "VolumeAttachment csi-1",
                    "attached=true",
                ]),
            ),
            (
                "va detached but still present",
                vec![&here_detached],
                None,
                None,
                Some(&["pv-a still attached to node-a", "attached=false"]),
            ),
            (
                "va being deleted",
                vec![&here_deleting],
                None,
                Some(&n_empty),
                Some(&["being deleted"]),
            ),
            (
                "va gone, node still lists it",
                vec![],
                Some(UNIQUE_A),
                Some(&n_listed),
                Some(&[
                    "pv-a still listed in status.volumesAttached of Node node-a",
                    UNIQUE_A,
                ]),
            ),
            (
                "both sides",
                vec![&here],
                Some(UNIQUE_A),
                Some(&n_listed),
                Some(&["csi-1", " and ", UNIQUE_A]),
            ),
            (
                "node lists it but unique name unknown",
                vec![],
                None,
                Some(&n_listed),
                None,
            ),
            ("node gone", vec![], Some(UNIQUE_A), None, None),
        ];
        for (case, vas, unique, n, expected) in cases {
            let got = detached_from("pv-a", unique, "node-a", vas, n);
            match (expected, got) {
                (None, Ok(())) => {}
                (Some(fragments), Err(msg)) => {
                    for f in fragments {
                        assert!(msg.contains(f), "{case}: {msg:?} lacks {f:?}");
                    }
                }
                (expected, got) => panic!("{case}: expected {expected:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn detached_from_reports_detach_errors() {
        let mut v = va("csi-1", "pv-a", "node-a", true);
        v.status = Some(VolumeAttachmentStatus {
            attached: true,
            detach_error: Some(VolumeError {
                message: Some("rpc error: volume busy".to_owned()),
                ..VolumeError::default()
            }),
            ..VolumeAttachmentStatus::default()
        });
        let err = detached_from("pv-a", None, "node-a", [&v], None).unwrap_err();
        assert!(
            err.contains("detach error: rpc error: volume busy"),
            "{err}"
        );
    }

    #[test]
    fn attached_elsewhere_table() {
        let old = va("csi-1", "pv-a", "node-a", true);
        let new_pending = va("csi-2", "pv-a", "node-b", false);
        let new_attached = va("csi-2", "pv-a", "node-b", true);
        let new_leaving = deleting(va("csi-2", "pv-a", "node-b", true));
        let third = va("csi-3", "pv-a", "node-c", true);
        let other_pv = va("csi-4", "pv-b", "node-b", true);

        let cases: Vec<ReattachCase<'_>> = vec![
            (
                "nothing",
                vec![],
                Err(&["no VolumeAttachment elsewhere yet"]),
            ),
            (
                "only the old node",
                vec![&old],
                Err(&["no VolumeAttachment elsewhere yet"]),
            ),
            (
                "other pv only",
                vec![&other_pv],
                Err(&["no VolumeAttachment elsewhere yet"]),
            ),
            (
                "new node not attached yet",
                vec![&old, &new_pending],
                Err(&["on node-b", "VolumeAttachment csi-2, attached=false"]),
            ),
            ("new node attached", vec![&new_attached], Ok("node-b")),
            (
                "new node attached, old still there",
                vec![&old, &new_attached],
                Ok("node-b"),
            ),
            (
                "attached but being deleted",
                vec![&new_leaving],
                Err(&["being deleted"]),
            ),
            (
                "two new nodes: smallest name",
                vec![&third, &new_attached],
                Ok("node-b"),
            ),
            (
                "one pending one attached",
                vec![&new_pending, &third],
                Ok("node-c"),
            ),
        ];
        for (case, vas, expected) in cases {
            let got = attached_elsewhere("pv-a", "node-a", vas);
            match (expected, got) {
                (Ok(want), Ok(got)) => assert_eq!(want, got, "{case}"),
                (Err(fragments), Err(msg)) => {
                    for f in fragments {
                        assert!(msg.contains(f), "{case}: {msg:?} lacks {f:?}");
                    }
                }
                (expected, got) => panic!("{case}: expected {expected:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn attached_elsewhere_reports_attach_errors() {
        let mut v = va("csi-2", "pv-a", "node-b", false);
        v.status = Some(VolumeAttachmentStatus {
            attach_error: Some(VolumeError {
                message: Some("quota exceeded".to_owned()),
                ..VolumeError::default()
            }),
            ..VolumeAttachmentStatus::default()
        });
        let err = attached_elsewhere("pv-a", "node-a", [&v]).unwrap_err();
        assert!(err.contains("attach error: quota exceeded"), "{err}");
    }

    /// `va` with an attach error of gRPC code `code`.
    fn failing(mut v: VolumeAttachment, code: Option<i32>, message: &str) -> VolumeAttachment {
        v.status.get_or_insert_default().attach_error = Some(VolumeError {
            error_code: code,
            message: Some(message.to_owned()),
            ..VolumeError::default()
        });
        v
    }

    #[test]
    fn an_attach_refused_for_lack_of_a_resource_is_named() {
        let full = "attachdetachment limit reached on node-b";
        let exhausted = failing(va("csi-2", "pv-a", "node-b", false), Some(8), full);
        assert_eq!(
            attach_exhausted("pv-a", "node-a", [&exhausted]),
            Some(AttachRefused {
                name: "csi-2".to_owned(),
                node: "node-b".to_owned(),
                message: full.to_owned(),
            })
        );
        let err = attached_elsewhere("pv-a", "node-a", [&exhausted]).unwrap_err();
        assert!(
            err.contains(&format!("attach error: {full} (code 8)")),
            "{err}"
        );

        // Not the refusal the attacher will keep giving: any other code, or
        // none (an older attacher, a transient failure).
        let unavailable = failing(va("csi-2", "pv-a", "node-b", false), Some(14), "timeout");
        let no_code = failing(va("csi-2", "pv-a", "node-b", false), None, "timeout");
        // Where it is attached after all, or on its way out, or on the Node
        // it leaves, or of another volume: nothing to end the wait for.
        let attached = failing(va("csi-2", "pv-a", "node-b", true), Some(8), full);
        let going = deleting(failing(va("csi-2", "pv-a", "node-b", false), Some(8), full));
        let old = failing(va("csi-1", "pv-a", "node-a", false), Some(8), full);
        let other = failing(va("csi-3", "pv-b", "node-b", false), Some(8), full);
        for (case, v) in [
            ("another code", &unavailable),
            ("no code", &no_code),
            ("attached", &attached),
            ("being deleted", &going),
            ("on the Node it leaves", &old),
            ("another volume", &other),
        ] {
            assert_eq!(attach_exhausted("pv-a", "node-a", [v]), None, "{case}");
        }
        // Among several, the first by Node.
        let on_c = failing(va("csi-0", "pv-a", "node-c", false), Some(8), "full too");
        let first = attach_exhausted("pv-a", "node-a", [&on_c, &unavailable, &exhausted]);
        assert_eq!(first.map(|r| r.node), Some("node-b".to_owned()));
    }

    #[test]
    fn attachments_of_lists_only_the_volume_sorted() {
        let a = va("csi-2", "pv-a", "node-b", true);
        let b = deleting(va("csi-1", "pv-a", "node-a", false));
        let c = va("csi-3", "pv-b", "node-a", true);
        let got = attachments_of("pv-a", [&a, &b, &c]);
        assert_eq!(
            got,
            vec![
                Attachment {
                    name: "csi-1".to_owned(),
                    node: "node-a".to_owned(),
                    attached: false,
                    deleting: true,
                },
                Attachment {
                    name: "csi-2".to_owned(),
                    node: "node-b".to_owned(),
                    attached: true,
                    deleting: false,
                },
            ]
        );
    }
}
