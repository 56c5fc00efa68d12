//! [`Index`]: objects of a store filed by a key, and the [`Indexes`] the
//! drain and the reconcilers look objects up by.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::Resource;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::Event;

/// The keys one object is filed under (none, one or several).
pub type KeyFn<K> = fn(&K) -> Vec<String>;

/// Objects of a store filed by a key computed from each object.
///
/// Feed it every watch event with [`Index::observe`], after the store has
/// applied it (the reflector's stream order). Until the first list is done
/// it is empty, as the store is; during a re-list it keeps answering from
/// the previous list and switches over at `InitDone`, as the store does.
pub struct Index<K: Resource>
where
    K::DynamicType: Hash + Eq + Clone,
{
    keys: KeyFn<K>,
    state: Arc<RwLock<State<K>>>,
}

impl<K: Resource> Clone for Index<K>
where
    K::DynamicType: Hash + Eq + Clone,
{
    fn clone(&self) -> Self {
        Self {
            keys: self.keys,
            state: Arc::clone(&self.state),
        }
    }
}

struct State<K: Resource>
where
    K::DynamicType: Hash + Eq + Clone,
{
    by_key: HashMap<String, HashSet<ObjectRef<K>>>,
    keys_of: HashMap<ObjectRef<K>, Vec<String>>,
    /// The re-list in progress: every object listed so far, with its keys.
    relist: Option<HashMap<ObjectRef<K>, Vec<String>>>,
}

impl<K> Index<K>
where
    K: Resource + Clone,
    K::DynamicType: Hash + Eq + Clone + Default,
{
    pub fn new(keys: KeyFn<K>) -> Self {
        Self {
            keys,
            state: Arc::new(RwLock::new(State {
                by_key: HashMap::new(),
                keys_of: HashMap::new(),
                relist: None,
            })),
        }
    }

    /// Applies one watch event.
    pub fn observe(&self, event: &Event<K>) {
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        match event {
            Event::Apply(obj) => {
                let keys = (self.keys)(obj);
                state.file(reference(obj), keys);
            }
            Event::Delete(obj) => state.file(reference(obj), Vec::new()),
            Event::Init => state.relist = Some(HashMap::new()),
            Event::InitApply(obj) => {
                let keys = (self.keys)(obj);
                let relist = state.relist.get_or_insert_with(HashMap::new);
                if !keys.is_empty() {
                    relist.insert(reference(obj), keys);
                }
            }
            Event::InitDone => {
                let listed = state.relist.take().unwrap_or_default();
                let mut by_key: HashMap<String, HashSet<ObjectRef<K>>> = HashMap::new();
                for (r, keys) in &listed {
                    for k in keys {
                        by_key.entry(k.clone()).or_default().insert(r.clone());
                    }
                }
                state.by_key = by_key;
                state.keys_of = listed;
            }
        }
    }

    /// The references filed under `key`, in no particular order.
    pub fn refs(&self, key: &str) -> Vec<ObjectRef<K>> {
        let state = self.state.read().unwrap_or_else(|e| e.into_inner());
        state
            .by_key
            .get(key)
            .map(|set| set.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The objects filed under `key`, read from `store`, sorted by
    /// namespace and name so callers see a stable order. An object the
    /// store no longer has (deleted, the index not yet told) is left out.
    pub fn get(&self, store: &Store<K>, key: &str) -> Vec<Arc<K>> {
        let mut refs = self.refs(key);
        refs.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        refs.iter().filter_map(|r| store.get(r)).collect()
    }

    /// How many objects are indexed (for tests and metrics).
    pub fn len(&self) -> usize {
        self.state
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys_of
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<K: Resource> State<K>
where
    K::DynamicType: Hash + Eq + Clone,
{
    /// Files `r` under exactly `keys` (none: forgets it).
    fn file(&mut self, r: ObjectRef<K>, keys: Vec<String>) {
        if let Some(old) = self.keys_of.remove(&r) {
            for k in old {
                if let Some(set) = self.by_key.get_mut(&k) {
                    set.remove(&r);
                    if set.is_empty() {
                        self.by_key.remove(&k);
                    }
                }
            }
        }
        if keys.is_empty() {
            return;
        }
        for k in &keys {
            self.by_key.entry(k.clone()).or_default().insert(r.clone());
        }
        self.keys_of.insert(r, keys);
    }
}

/// The reference an index files: name and namespace only (an
/// [`ObjectRef::from_obj`] also carries the resourceVersion and UID, which
/// lookups never need).
fn reference<K>(obj: &K) -> ObjectRef<K>
where
    K: Resource,
    K::DynamicType: Hash + Eq + Clone + Default,
{
    let meta = obj.meta();
    let r = ObjectRef::new(meta.name.as_deref().unwrap_or_default());
    match meta.namespace.as_deref() {
        Some(ns) => r.within(ns),
        None => r,
    }
}

/// Pods by the Node they are bound to (`spec.nodeName`).
pub fn pod_node(pod: &Pod) -> Vec<String> {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .into_iter()
        .collect()
}

/// Pods by the UID of their controller (a pod without one is filed under
/// nothing): a workload's pods, for the replacement of a pod without
/// volumes whose move waits for it to be healthy.
pub fn pod_controller(pod: &Pod) -> Vec<String> {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .filter(|o| o.controller == Some(true))
        .map(|o| o.uid.clone())
        .collect()
}

/// Pods by the claims their volumes name, as `namespace/claim` (see
/// [`claim_names`]).
pub fn pod_claims(pod: &Pod) -> Vec<String> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    claim_names(pod)
        .iter()
        .map(|claim| claim_key(ns, claim))
        .collect()
}

/// The claims a pod's volumes name, in its namespace: a
/// `persistentVolumeClaim` volume's claim, a generic ephemeral volume's
/// claim (`<pod>-<volume>`), and the name an inline volume of a kind that
/// attaches goes by instead ([`super::inline::inline_claim_name`]).
pub fn claim_names(pod: &Pod) -> Vec<String> {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| {
            if let Some(c) = &v.persistent_volume_claim {
                Some(c.claim_name.clone())
            } else if v.ephemeral.is_some() {
                Some(format!("{name}-{}", v.name))
            } else {
                super::inline::inline_claim_name(v)
            }
        })
        .collect()
}

/// The key [`pod_claims`] files a claim under.
pub fn claim_key(namespace: &str, claim: &str) -> String {
    format!("{namespace}/{claim}")
}

/// VolumeAttachments by the Node they attach to.
pub fn attachment_node(va: &VolumeAttachment) -> Vec<String> {
    vec![va.spec.node_name.clone()]
}

/// VolumeAttachments by the PersistentVolume they attach.
pub fn attachment_pv(va: &VolumeAttachment) -> Vec<String> {
    va.spec
        .source
        .persistent_volume_name
        .clone()
        .into_iter()
        .collect()
}

/// Nodes by `spec.providerID`.
pub fn node_provider_id(node: &Node) -> Vec<String> {
    node.spec
        .as_ref()
        .and_then(|s| s.provider_id.clone())
        .into_iter()
        .collect()
}

/// The indexes the reconciler and the drain read, next to their stores.
#[derive(Clone)]
pub struct Indexes {
    pub pods_by_node: Index<Pod>,
    pub pods_by_claim: Index<Pod>,
    pub pods_by_controller: Index<Pod>,
    pub attachments_by_node: Index<VolumeAttachment>,
    pub attachments_by_pv: Index<VolumeAttachment>,
    pub nodes_by_provider_id: Index<Node>,
}

impl Default for Indexes {
    fn default() -> Self {
        Self {
            pods_by_node: Index::new(pod_node),
            pods_by_claim: Index::new(pod_claims),
            pods_by_controller: Index::new(pod_controller),
            attachments_by_node: Index::new(attachment_node),
            attachments_by_pv: Index::new(attachment_pv),
            nodes_by_provider_id: Index::new(node_provider_id),
        }
    }
}

impl Indexes {
    pub fn observe_pod(&self, event: &Event<Pod>) {
        self.pods_by_node.observe(event);
        self.pods_by_claim.observe(event);
        self.pods_by_controller.observe(event);
    }

    pub fn observe_attachment(&self, event: &Event<VolumeAttachment>) {
        self.attachments_by_node.observe(event);
        self.attachments_by_pv.observe(event);
    }

    pub fn observe_node(&self, event: &Event<Node>) {
        self.nodes_by_provider_id.observe(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::reflector::store::Writer;

    fn pod(ns: &str, name: &str, node: Option<&str>, claims: &[&str]) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": ns, "name": name},
            "spec": {
                "nodeName": node,
                "containers": [],
                "volumes": claims.iter().map(|c| serde_json::json!(
                    {"name": c, "persistentVolumeClaim": {"claimName": c}}
                )).collect::<Vec<_>>(),
            }
        }))
        .unwrap()
    }

    /// A store and an index fed the same events, in the reflector's order.
    struct Fed {
        writer: Writer<Pod>,
        index: Index<Pod>,
    }

    impl Fed {
        fn new(keys: KeyFn<Pod>) -> Self {
            Self {
                writer: Writer::default(),
                index: Index::new(keys),
            }
        }
        fn send(&mut self, ev: Event<Pod>) {
            self.writer.apply_watcher_event(&ev);
            self.index.observe(&ev);
        }
        fn names(&self, key: &str) -> Vec<String> {
            self.index
                .get(&self.writer.as_reader(), key)
                .iter()
                .map(|p| p.metadata.name.clone().unwrap_or_default())
                .collect()
        }
    }

    fn listed(fed: &mut Fed, pods: Vec<Pod>) {
        fed.send(Event::Init);
        for p in pods {
            fed.send(Event::InitApply(p));
        }
        fed.send(Event::InitDone);
    }

    #[test]
    fn files_by_node_and_follows_applies_and_deletes() {
        let mut fed = Fed::new(pod_node);
        listed(
            &mut fed,
            vec![
                pod("a", "p2", Some("n1"), &[]),
                pod("a", "p1", Some("n1"), &[]),
                pod("a", "p3", Some("n2"), &[]),
                pod("a", "pending", None, &[]),
            ],
        );
        assert_eq!(fed.names("n1"), ["p1", "p2"], "sorted by name");
        assert_eq!(fed.names("n2"), ["p3"]);
        assert_eq!(fed.index.len(), 3, "an unscheduled pod has no key");

        // Scheduled later: filed under its Node.
        fed.send(Event::Apply(pod("a", "pending", Some("n2"), &[])));
        assert_eq!(fed.names("n2"), ["p3", "pending"]);
        fed.send(Event::Delete(pod("a", "p3", Some("n2"), &[])));
        assert_eq!(fed.names("n2"), ["pending"]);
        fed.send(Event::Delete(pod("a", "pending", Some("n2"), &[])));
        assert!(fed.names("n2").is_empty());
        assert!(fed.index.refs("n2").is_empty(), "empty keys are dropped");
    }

    #[test]
    fn same_name_in_two_namespaces_are_two_objects() {
        let mut fed = Fed::new(pod_node);
        listed(
            &mut fed,
            vec![
                pod("a", "p", Some("n1"), &[]),
                pod("b", "p", Some("n1"), &[]),
            ],
        );
        assert_eq!(fed.index.refs("n1").len(), 2);
        fed.send(Event::Delete(pod("a", "p", Some("n1"), &[])));
        let left = fed.index.get(&fed.writer.as_reader(), "n1");
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].metadata.namespace.as_deref(), Some("b"));
    }

    #[test]
    fn a_relist_replaces_everything_at_init_done() {
        let mut fed = Fed::new(pod_node);
        listed(
            &mut fed,
            vec![
                pod("a", "old", Some("n1"), &[]),
                pod("a", "kept", Some("n1"), &[]),
            ],
        );
        fed.send(Event::Init);
        fed.send(Event::InitApply(pod("a", "kept", Some("n1"), &[])));
        fed.send(Event::InitApply(pod("a", "new", Some("n3"), &[])));
        // Mid re-list: still the previous answer (the store agrees).
        assert_eq!(fed.index.refs("n1").len(), 2);
        assert!(fed.index.refs("n3").is_empty());
        fed.send(Event::InitDone);
        // "old" was not listed again: it was deleted while we were away.
        assert_eq!(fed.names("n1"), ["kept"]);
        assert_eq!(fed.names("n3"), ["new"]);
        assert_eq!(fed.index.len(), 2);
    }

    #[test]
    fn claims_index_files_a_pod_under_each_claim() {
        let mut fed = Fed::new(pod_claims);
        let mut eph = pod("db", "pg-0", Some("n1"), &["data"]);
        if let Some(spec) = eph.spec.as_mut() {
            spec.volumes.get_or_insert_with(Vec::new).push(
                serde_json::from_value(serde_json::json!({"name": "scratch", "ephemeral": {}}))
                    .unwrap(),
            );
        }
        listed(
            &mut fed,
            vec![eph, pod("db", "other", Some("n2"), &["data", "logs"])],
        );
        assert_eq!(fed.names(&claim_key("db", "data")), ["other", "pg-0"]);
        assert_eq!(fed.names(&claim_key("db", "logs")), ["other"]);
        assert_eq!(fed.names(&claim_key("db", "pg-0-scratch")), ["pg-0"]);
        assert!(fed.names(&claim_key("other-ns", "data")).is_empty());
    }

    #[test]
    fn a_lookup_never_returns_what_the_store_has_dropped() {
        let mut fed = Fed::new(pod_node);
        listed(&mut fed, vec![pod("a", "p", Some("n1"), &[])]);
        // The store applies the delete before the index sees it.
        fed.writer
            .apply_watcher_event(&Event::Delete(pod("a", "p", Some("n1"), &[])));
        assert!(fed.names("n1").is_empty());
    }
}
