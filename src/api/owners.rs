//! Who owns what: a Machine's controlling MachineSet and a MachineSet's
//! controlling MachineDeployment, read from controller ownerReferences of
//! berth's group. The caches file Machines by their set with these, and a
//! Machine's or a set's event wakes its owner through them.

use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use super::{GROUP, Machine, MachineDeployment, MachineSet};

/// The name and UID of the controller of `meta` of this `kind` in berth's
/// group.
fn controller_of<'a>(
    owners: Option<&'a [k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference]>,
    kind: &str,
) -> Option<(&'a str, &'a str)> {
    owners
        .into_iter()
        .flatten()
        .find(|o| {
            o.controller == Some(true)
                && o.kind == kind
                && o.api_version.split('/').next() == Some(GROUP)
        })
        .map(|o| (o.name.as_str(), o.uid.as_str()))
}

/// The UID of the MachineSet that controls `m`, if one does: the key the
/// caches file Machines by.
pub fn controlling_set(m: &Machine) -> Vec<String> {
    set_owner(m).map(|(_, uid)| uid).into_iter().collect()
}

/// The name and UID of the MachineSet that controls `m`.
pub fn set_owner(m: &Machine) -> Option<(String, String)> {
    controller_of(m.metadata.owner_references.as_deref(), "MachineSet")
        .map(|(name, uid)| (name.to_string(), uid.to_string()))
}

/// The MachineSet that controls `m`: the set its event wakes.
pub fn owner_ref(m: &Machine) -> Option<ObjectRef<MachineSet>> {
    let (name, _) = set_owner(m)?;
    Some(ObjectRef::new(&name).within(&m.namespace()?))
}

/// The MachineDeployment that controls `set`, if one does.
pub fn owner_of(set: &MachineSet) -> Option<ObjectRef<MachineDeployment>> {
    let (name, _) = controller_of(
        set.metadata.owner_references.as_deref(),
        "MachineDeployment",
    )?;
    Some(ObjectRef::new(name).within(&set.namespace()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_controlling_machineset_owns_a_machine() {
        let m = |owners: serde_json::Value| -> Machine {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "berth.dev/v1alpha1", "kind": "Machine",
                "metadata": {"name": "m", "namespace": "ns", "ownerReferences": owners},
                "spec": {"classRef": {"name": "c"}},
            }))
            .expect("machine")
        };
        let owner = |kind: &str, api: &str, controller: bool| serde_json::json!({"apiVersion": api, "kind": kind, "name": "set", "uid": "u1", "controller": controller});
        let owned = m(serde_json::json!([owner(
            "MachineSet",
            "berth.dev/v1alpha1",
            true
        )]));
        assert_eq!(controlling_set(&owned), ["u1"]);
        assert_eq!(owner_ref(&owned), Some(ObjectRef::new("set").within("ns")));
        for (case, owners) in [
            (
                "not controller",
                serde_json::json!([owner("MachineSet", "berth.dev/v1alpha1", false)]),
            ),
            (
                "another group",
                serde_json::json!([owner("MachineSet", "cluster.x-k8s.io/v1beta1", true)]),
            ),
            (
                "another kind",
                serde_json::json!([owner("MachineDeployment", "berth.dev/v1alpha1", true)]),
            ),
            ("none", serde_json::json!([])),
        ] {
            assert!(controlling_set(&m(owners)).is_empty(), "{case}");
        }
    }
}
