//! Who wakes whom: the events that reach a controller from watches of
//! other kinds. A Machine's event wakes its MachineSet and that set's
//! MachineDeployment, a set's event its deployment, a MachineClass's event
//! the deployments of the sets made from it, and only the Node events that
//! can change a decision wake a Machine.

use std::collections::HashMap;

use futures::Stream;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

use crate::api::{Machine, MachineClass, MachineDeployment, MachineSet, owner_of, owner_ref};

/// Feeds the set and deployment controllers from the Machine controller's
/// watches: a Machine wakes the set that owns it, and that set's
/// deployment (found in the set cache).
#[derive(Clone)]
pub(crate) struct Wakes {
    sets: tokio::sync::mpsc::UnboundedSender<ObjectRef<MachineSet>>,
    deployments: tokio::sync::mpsc::UnboundedSender<ObjectRef<MachineDeployment>>,
    set_store: Store<MachineSet>,
}

/// The streams [`Wakes`] feeds.
pub(crate) type WakeStream<K> = std::pin::Pin<Box<dyn Stream<Item = ObjectRef<K>> + Send>>;

fn stream_of<K: kube::Resource + 'static>(
    rx: tokio::sync::mpsc::UnboundedReceiver<ObjectRef<K>>,
) -> WakeStream<K>
where
    K::DynamicType: Send,
{
    Box::pin(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|r| (r, rx))
    }))
}

impl Wakes {
    /// A waker and the streams of sets and deployments it wakes.
    pub(crate) fn new(
        set_store: Store<MachineSet>,
    ) -> (Self, WakeStream<MachineSet>, WakeStream<MachineDeployment>) {
        let (sets, sets_rx) = tokio::sync::mpsc::unbounded_channel();
        let (deployments, deployments_rx) = tokio::sync::mpsc::unbounded_channel();
        (
            Self {
                sets,
                deployments,
                set_store,
            },
            stream_of(sets_rx),
            stream_of(deployments_rx),
        )
    }

    /// Wakes the set that owns `m`, if any, and its deployment.
    pub(crate) fn machine(&self, m: &Machine) {
        if let Some(r) = owner_ref(m) {
            if let Some(d) = self.set_store.get(&r).and_then(|set| owner_of(&set)) {
                let _ = self.deployments.send(d);
            }
            let _ = self.sets.send(r);
        }
    }

    /// Wakes the deployment of a set that changed.
    pub(crate) fn set(&self, set: &MachineSet) {
        if let Some(d) = owner_of(set) {
            let _ = self.deployments.send(d);
        }
    }

    /// Wakes the set of each Machine event (the store has applied it).
    pub(crate) fn machine_event(&self, ev: &watcher::Event<Machine>) {
        match ev {
            watcher::Event::Apply(m) | watcher::Event::Delete(m) | watcher::Event::InitApply(m) => {
                self.machine(m)
            }
            watcher::Event::Init | watcher::Event::InitDone => {}
        }
    }

    /// Wakes the deployment of every set made from `class` (its template's
    /// class): an edit of what the class makes a VM from rolls the pool.
    pub(crate) fn class(&self, class: &MachineClass) {
        let name = class.name_any();
        for set in self.set_store.state() {
            if set.spec.template.spec.class_ref.name == name
                && let Some(d) = owner_of(&set)
            {
                let _ = self.deployments.send(d);
            }
        }
    }

    /// Wakes the deployment of each set event.
    pub(crate) fn set_event(&self, ev: &watcher::Event<MachineSet>) {
        match ev {
            watcher::Event::Apply(s) | watcher::Event::Delete(s) | watcher::Event::InitApply(s) => {
                self.set(s)
            }
            watcher::Event::Init | watcher::Event::InitDone => {}
        }
    }
}

/// Passes the Node events that can change a decision about a Machine, by
/// remembering a hash of [`node_relevance`] per Node.
///
/// Nodes refresh their status on a timer (a kubelet every 10 s to 5 min, the
/// test bed's kwok every 20-45 s); with 1,000 Nodes the benchmark counted 46
/// reconciles a second that could change nothing. The volume tracker and
/// the Node cache still see every event: this filters only what wakes a
/// Machine.
#[derive(Default)]
pub(crate) struct NodeChanges {
    seen: HashMap<String, u64>,
}

impl NodeChanges {
    pub(crate) fn wakes(&mut self, ev: &watcher::Event<Node>) -> bool {
        match ev {
            watcher::Event::Apply(n) | watcher::Event::InitApply(n) => {
                let name = n.name_any();
                let hash = node_relevance(n);
                self.seen.insert(name, hash) != Some(hash)
            }
            watcher::Event::Delete(n) => {
                self.seen.remove(&n.name_any());
                true
            }
            watcher::Event::Init | watcher::Event::InitDone => true,
        }
    }
}

/// A hash of what about a Node a Machine's decisions read: deletion,
/// providerID, cordon and taints, each condition's type, status and reason,
/// and the volumes attached and in use. Heartbeat and transition times are
/// left out.
fn node_relevance(node: &Node) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| t.0.to_string())
        .hash(&mut h);
    if let Some(spec) = &node.spec {
        spec.provider_id.hash(&mut h);
        spec.unschedulable.hash(&mut h);
        for t in spec.taints.iter().flatten() {
            (&t.key, &t.value, &t.effect).hash(&mut h);
        }
    }
    if let Some(status) = &node.status {
        for c in status.conditions.iter().flatten() {
            (&c.type_, &c.status, &c.reason).hash(&mut h);
        }
        for v in status.volumes_attached.iter().flatten() {
            v.name.hash(&mut h);
        }
        status.volumes_in_use.hash(&mut h);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(ready: &str, heartbeat: &str, unschedulable: bool) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1"},
            "spec": {"providerID": "fake://n1", "unschedulable": unschedulable},
            "status": {"conditions": [{
                "type": "Ready", "status": ready, "reason": "KubeletReady",
                "lastHeartbeatTime": heartbeat, "lastTransitionTime": heartbeat
            }]}
        }))
        .expect("node")
    }

    #[test]
    fn a_heartbeat_wakes_nothing_but_a_change_does() {
        let mut changes = NodeChanges::default();
        let at = |t: &str| format!("2026-11-21T06:00:{t}Z");
        assert!(changes.wakes(&watcher::Event::InitApply(node("True", &at("00"), false))));
        assert!(changes.wakes(&watcher::Event::InitDone));
        assert!(
            !changes.wakes(&watcher::Event::Apply(node("True", &at("20"), false))),
            "only the heartbeat moved"
        );
        assert!(changes.wakes(&watcher::Event::Apply(node("False", &at("40"), false))));
        assert!(!changes.wakes(&watcher::Event::Apply(node("False", &at("50"), false))));
        assert!(
            changes.wakes(&watcher::Event::Apply(node("False", &at("55"), true))),
            "cordoned"
        );
        let gone = node("False", &at("59"), true);
        assert!(
            changes.wakes(&watcher::Event::Delete(gone.clone())),
            "a deletion always wakes"
        );
        assert!(
            changes.wakes(&watcher::Event::Apply(gone)),
            "and a Node that comes back is new"
        );
    }

    #[test]
    fn attached_volumes_are_relevant() {
        let before = node("True", "2026-11-21T06:00:00Z", true);
        let mut after = before.clone();
        after.status.as_mut().expect("status").volumes_attached = Some(vec![
            serde_json::from_value(
                serde_json::json!({"name": "kubernetes.io/csi/d^h", "devicePath": ""}),
            )
            .expect("volume"),
        ]);
        assert_ne!(node_relevance(&before), node_relevance(&after));
    }
}
