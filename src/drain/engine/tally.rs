//! What one run of a drain did to pods: the pods it evicted or deleted
//! (counted once each), their UIDs and controllers (a new pod of one of
//! those controllers on the cordoned Node came back), the pods it deleted
//! with their budget bypassed, and the pods on the Node when it first
//! planned (none of those came back).
//!
//! No I/O: the drain reads and writes it between its calls.

use std::collections::BTreeSet;
use std::sync::{Mutex, OnceLock};

use k8s_openapi::api::core::v1::Pod;

use crate::drain::select::{NamespacedName, fmt_key};

#[derive(Debug, Default)]
pub(super) struct Tally {
    /// Pods evicted or deleted, by `namespace/name`: progress counts each
    /// once.
    counted: Mutex<BTreeSet<String>>,
    /// The UIDs of the pods evicted or deleted.
    uids: Mutex<BTreeSet<String>>,
    /// Their controllers.
    controllers: Mutex<BTreeSet<String>>,
    /// Pods deleted with their PodDisruptionBudget bypassed (the deadline).
    forced: Mutex<Vec<String>>,
    /// The pods (by UID) on the Node when this run first planned, before
    /// it evicted anything.
    seen_first: OnceLock<BTreeSet<String>>,
}

impl Tally {
    /// Counts pod `key` gone; true the first time.
    pub(super) fn count(&self, key: &NamespacedName) -> bool {
        self.counted
            .lock()
            .map(|mut e| e.insert(fmt_key(key)))
            .unwrap_or(false)
    }

    /// Records a pod this run evicted, and its controller.
    pub(super) fn evicted(&self, pod: &Pod, controller: Option<&str>) {
        if let (Some(uid), Ok(mut e)) = (pod.metadata.uid.clone(), self.uids.lock()) {
            e.insert(uid);
        }
        if let (Some(c), Ok(mut e)) = (controller, self.controllers.lock()) {
            e.insert(c.to_string());
        }
    }

    /// Whether this run evicted or deleted this very pod (by UID).
    pub(super) fn was_evicted(&self, pod: &Pod) -> bool {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        self.uids.lock().is_ok_and(|e| e.contains(uid))
    }

    /// The controllers of the pods this run evicted.
    pub(super) fn controllers(&self) -> BTreeSet<String> {
        self.controllers
            .lock()
            .map(|e| e.clone())
            .unwrap_or_default()
    }

    /// Records a pod deleted with its budget bypassed.
    pub(super) fn forced(&self, key: &NamespacedName) {
        if let Ok(mut f) = self.forced.lock() {
            f.push(fmt_key(key));
        }
    }

    /// The pods deleted with their budget bypassed so far.
    pub(super) fn forced_pods(&self) -> Vec<String> {
        self.forced.lock().map(|f| f.clone()).unwrap_or_default()
    }

    /// The UIDs of the pods on the Node when this run first planned: the
    /// first call's `pods` (later calls' are ignored).
    pub(super) fn seen_first(&self, pods: &[std::sync::Arc<Pod>]) -> &BTreeSet<String> {
        self.seen_first
            .get_or_init(|| pods.iter().filter_map(|p| p.metadata.uid.clone()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn pod(name: &str, uid: &str) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.metadata.namespace = Some("ns".into());
        p.metadata.uid = Some(uid.into());
        p
    }

    #[test]
    fn a_pod_counts_once_however_often_it_is_evicted() {
        let t = Tally::default();
        let key = ("ns".to_string(), "a".to_string());
        assert!(t.count(&key));
        assert!(!t.count(&key));
        assert!(t.count(&("ns".to_string(), "b".to_string())));
    }

    #[test]
    fn an_evicted_pod_is_known_by_its_uid_not_its_name() {
        let t = Tally::default();
        t.evicted(&pod("db-0", "u1"), Some("StatefulSet/db"));
        assert!(t.was_evicted(&pod("db-0", "u1")));
        assert!(!t.was_evicted(&pod("db-0", "u2")), "its replacement");
        assert_eq!(t.controllers(), BTreeSet::from(["StatefulSet/db".into()]));
    }

    #[test]
    fn forced_pods_are_listed_in_order() {
        let t = Tally::default();
        t.forced(&("ns".into(), "b".into()));
        t.forced(&("ns".into(), "a".into()));
        assert_eq!(t.forced_pods(), ["ns/b", "ns/a"]);
    }

    #[test]
    fn the_first_plan_fixes_the_pods_seen_first() {
        let t = Tally::default();
        let first = [Arc::new(pod("a", "u1"))];
        assert_eq!(t.seen_first(&first), &BTreeSet::from(["u1".into()]));
        let later = [Arc::new(pod("a", "u1")), Arc::new(pod("b", "u2"))];
        assert_eq!(t.seen_first(&later), &BTreeSet::from(["u1".into()]));
    }
}
