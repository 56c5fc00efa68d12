//! The references the drain's Events relate to: a pod, a pod by key, a
//! PersistentVolume.

use k8s_openapi::api::core::v1::{ObjectReference, Pod};

use crate::drain::select::{NamespacedName, fmt_key};

pub(super) fn ref_key(r: &ObjectReference) -> String {
    fmt_key(&(
        r.namespace.clone().unwrap_or_default(),
        r.name.clone().unwrap_or_default(),
    ))
}

pub(super) fn pod_ref(pod: &Pod) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: pod.metadata.namespace.clone(),
        name: pod.metadata.name.clone(),
        uid: pod.metadata.uid.clone(),
        ..Default::default()
    }
}

pub(super) fn pod_ref_key(key: &NamespacedName) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(key.0.clone()),
        name: Some(key.1.clone()),
        ..Default::default()
    }
}

pub(super) fn pv_ref(pv: &str) -> Option<ObjectReference> {
    // An inline volume has no object of its own.
    (!crate::drain::volume::is_inline(pv)).then(|| ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolume".into()),
        name: Some(pv.to_string()),
        ..Default::default()
    })
}
