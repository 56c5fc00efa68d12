//! Machines filed by their Node, so that an event of a Node, a pod or a
//! VolumeAttachment finds its Machine without a scan of every Machine;
//! and the lookups of a Machine's objects that every controller makes
//! (its Node, a set's Machines).

use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

use super::{Caches, Index};
use crate::api::Machine;

impl Caches {
    /// The Node `m`'s `status.nodeRef` names, from the cache (whoever's
    /// it is: the Machine controller also checks that it is `m`'s).
    pub(crate) fn node_of(&self, m: &Machine) -> Option<Arc<Node>> {
        let name = &m.status.as_ref()?.node_ref.as_ref()?.name;
        self.nodes.get(&ObjectRef::new(name))
    }

    /// The Machines the MachineSet of UID `set_uid` controls, from the
    /// cache.
    pub(crate) fn machines_of_set(&self, set_uid: &str) -> Vec<Arc<Machine>> {
        self.machines_by_set.get(&self.machines, set_uid)
    }
}

/// Machines filed by their Node: by `status.nodeRef` and by
/// `spec.providerID` (the Node that has just registered with it), fed by the
/// Machine watch, so that a Node, pod or VolumeAttachment event finds its
/// Machine without a scan of every Machine.
#[derive(Clone)]
pub(crate) struct MachinesByNode {
    by_node_ref: Index<Machine>,
    by_provider_id: Index<Machine>,
}

impl Default for MachinesByNode {
    fn default() -> Self {
        Self {
            by_node_ref: Index::new(node_ref_of),
            by_provider_id: Index::new(provider_id_of),
        }
    }
}

fn node_ref_of(m: &Machine) -> Vec<String> {
    m.status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| r.name.clone())
        .into_iter()
        .collect()
}

fn provider_id_of(m: &Machine) -> Vec<String> {
    m.spec.provider_id.clone().into_iter().collect()
}

impl MachinesByNode {
    /// Applies one Machine watch event, after the store has.
    pub(crate) fn observe(&self, ev: &watcher::Event<Machine>) {
        self.by_node_ref.observe(ev);
        self.by_provider_id.observe(ev);
    }

    /// The Machines whose Node this is: by `status.nodeRef`, or by
    /// providerID for a Node that has just registered.
    pub(crate) fn of_node(&self, node: &str, provider_id: Option<&str>) -> Vec<ObjectRef<Machine>> {
        let mut refs = self.by_node_ref.refs(node);
        for r in provider_id
            .map(|id| self.by_provider_id.refs(id))
            .unwrap_or_default()
        {
            if !refs.contains(&r) {
                refs.push(r);
            }
        }
        refs
    }

    /// The Machines being deleted whose Node (by `status.nodeRef`) this is.
    pub(crate) fn deleting_of_node(
        &self,
        machines: &Store<Machine>,
        node: &str,
    ) -> Vec<ObjectRef<Machine>> {
        self.by_node_ref
            .get(machines, node)
            .iter()
            .filter(|m| m.metadata.deletion_timestamp.is_some())
            .map(|m| ObjectRef::from_obj(&**m))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(
        name: &str,
        node: Option<&str>,
        provider_id: Option<&str>,
        deleting: bool,
    ) -> Machine {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "berth.dev/v1alpha1", "kind": "Machine",
            "metadata": {
                "name": name, "namespace": "ns",
                "deletionTimestamp": deleting.then_some("2026-11-21T06:00:00Z"),
            },
            "spec": {"classRef": {"name": "c"}, "providerID": provider_id},
            "status": {"nodeRef": node.map(|n| serde_json::json!({"name": n}))},
        }))
        .expect("machine")
    }

    fn names(mut refs: Vec<ObjectRef<Machine>>) -> Vec<String> {
        refs.sort_by(|a, b| a.name.cmp(&b.name));
        refs.into_iter().map(|r| r.name).collect()
    }

    #[test]
    fn node_pod_and_attachment_events_find_their_machines_by_node() {
        let mut writer = kube::runtime::reflector::store::Writer::<Machine>::default();
        let store = writer.as_reader();
        let index = MachinesByNode::default();
        let mut feed = |ev: watcher::Event<Machine>| {
            writer.apply_watcher_event(&ev);
            index.observe(&ev);
        };
        feed(watcher::Event::Init);
        feed(watcher::Event::InitApply(machine(
            "m1",
            Some("n1"),
            Some("fake://n1"),
            true,
        )));
        feed(watcher::Event::InitApply(machine(
            "m2",
            Some("n1"),
            None,
            false,
        )));
        feed(watcher::Event::InitApply(machine(
            "m3",
            None,
            Some("fake://n2"),
            false,
        )));
        feed(watcher::Event::InitDone);

        // A Node event: by nodeRef, and by providerID for a new Node.
        assert_eq!(names(index.of_node("n1", None)), ["m1", "m2"]);
        assert_eq!(names(index.of_node("n2", Some("fake://n2"))), ["m3"]);
        assert_eq!(names(index.of_node("n1", Some("fake://n1"))), ["m1", "m2"]);
        assert!(index.of_node("n9", None).is_empty());
        // Pod and VolumeAttachment events wake only Machines being deleted.
        assert_eq!(names(index.deleting_of_node(&store, "n1")), ["m1"]);
        assert!(index.deleting_of_node(&store, "n2").is_empty());

        // A Machine whose Node changes moves in the index; a deleted one goes.
        feed(watcher::Event::Apply(machine("m2", Some("n3"), None, true)));
        assert_eq!(names(index.of_node("n1", None)), ["m1"]);
        assert_eq!(names(index.deleting_of_node(&store, "n3")), ["m2"]);
        feed(watcher::Event::Delete(machine(
            "m1",
            Some("n1"),
            Some("fake://n1"),
            true,
        )));
        assert!(index.deleting_of_node(&store, "n1").is_empty());
        assert!(index.of_node("n1", Some("fake://n1")).is_empty());
    }
}
