//! The MachineSet controller: keeps `spec.replicas` Machines made from a
//! set's template, and on scale-down deletes first the Machines whose
//! removal costs least (`order`).
//!
//! It runs beside the Machine controller, on the leader only, on that
//! controller's caches: the Machines (filed by their owning set, fed by the
//! Machine watch), Nodes, pods by Node, claims and VolumeAttachments by
//! Node. Its own watch is of MachineSets; a Machine event wakes the set that
//! owns it, and a Node event the sets of that Node's Machines, so nothing
//! polls. It never adopts a Machine it does not own (controller
//! ownerReference), never deletes a Machine already being deleted, and
//! never deletes or creates twice for one change: what it asked for is
//! remembered until the Machine cache has seen it (`Expectations`), as
//! the ReplicaSet controller does.
//!
//! `decide` counts and builds the status, `order` chooses which Machine
//! goes, `reconcile` observes, acts and records.

pub(crate) mod decide;
pub(crate) mod order;
pub(crate) mod reconcile;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};

use crate::api::{Machine, MachineDeployment, MachineSet};
use crate::cache::{Index, Indexes};
use crate::telemetry::events::EventSink;

use reconcile::Error;

/// The Machine controller's caches the set controller reads.
#[derive(Clone)]
pub(crate) struct Caches {
    pub(crate) machines: Store<Machine>,
    /// Machines by the UID of the MachineSet that controls them.
    pub(crate) machines_by_set: Index<Machine>,
    pub(crate) nodes: Store<Node>,
    pub(crate) pods: Store<Pod>,
    pub(crate) pvcs: Store<PersistentVolumeClaim>,
    pub(crate) pdbs: Store<PodDisruptionBudget>,
    pub(crate) indexes: Indexes,
}

/// The UID of the MachineSet that controls `m`, if one does.
pub(crate) fn controlling_set(m: &Machine) -> Vec<String> {
    set_owner(m).map(|(_, uid)| uid).into_iter().collect()
}

/// The name and UID of the MachineSet that controls `m`.
fn set_owner(m: &Machine) -> Option<(String, String)> {
    m.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| {
            o.controller == Some(true)
                && o.kind == "MachineSet"
                && o.api_version.split('/').next() == Some(crate::api::GROUP)
        })
        .map(|o| (o.name.clone(), o.uid.clone()))
}

/// The MachineSet a Machine's event wakes.
pub(crate) fn owner_ref(m: &Machine) -> Option<ObjectRef<MachineSet>> {
    let (name, _) = set_owner(m)?;
    Some(ObjectRef::new(&name).within(&m.namespace()?))
}

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
            if let Some(d) = self
                .set_store
                .get(&r)
                .and_then(|set| crate::machinedeployment::owner_of(&set))
            {
                let _ = self.deployments.send(d);
            }
            let _ = self.sets.send(r);
        }
    }

    /// Wakes the deployment of a set that changed.
    pub(crate) fn set(&self, set: &MachineSet) {
        if let Some(d) = crate::machinedeployment::owner_of(set) {
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

/// Creates and deletes asked for and not yet seen in the Machine cache, per
/// set UID. While a set has some, it does not scale again: the cache would
/// show too few or too many Machines.
#[derive(Default)]
pub(crate) struct Expectations(Mutex<HashMap<String, Pending>>);

struct Pending {
    creates: HashSet<String>,
    deletes: HashSet<String>,
    since: tokio::time::Instant,
}

/// How long an expectation is trusted: a create whose watch event never
/// comes (the Machine deleted at once by someone else) must not hold a
/// set forever. The ReplicaSet controller uses 5 minutes.
const EXPECTATION_TTL: Duration = Duration::from_secs(60);

impl Expectations {
    fn expect(&self, set: &str, create: Option<String>, delete: Option<String>) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let p = map.entry(set.to_string()).or_insert_with(|| Pending {
            creates: HashSet::new(),
            deletes: HashSet::new(),
            since: tokio::time::Instant::now(),
        });
        p.creates.extend(create);
        p.deletes.extend(delete);
        p.since = tokio::time::Instant::now();
    }

    /// Drops what `seen` says happened; true when nothing is pending.
    fn settled(&self, set: &str, seen: impl Fn(&str, bool) -> bool) -> bool {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(p) = map.get_mut(set) else {
            return true;
        };
        p.creates.retain(|n| !seen(n, true));
        p.deletes.retain(|n| !seen(n, false));
        if (p.creates.is_empty() && p.deletes.is_empty()) || p.since.elapsed() > EXPECTATION_TTL {
            map.remove(set);
            return true;
        }
        false
    }

    fn forget(&self, set: &str) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(set);
    }
}

pub(crate) struct Context {
    pub(crate) client: Client,
    pub(crate) caches: Caches,
    pub(crate) events: EventSink,
    pub(crate) expectations: Expectations,
    backoff: crate::machine::backoff::Backoffs<MachineSet>,
}

/// Runs the MachineSet controller until `shutdown` resolves: waits for
/// `synced` (every cache of the Machine controller has synced) and for the
/// first complete list of Machines, then reconciles the sets of `sets`
/// (the set watch, which fills `store`), woken by it and by `wakes`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    client: Client,
    caches: Caches,
    sets: impl Stream<Item = Result<MachineSet, watcher::Error>> + Send + 'static,
    store: Store<MachineSet>,
    events: EventSink,
    mut synced: tokio::sync::watch::Receiver<bool>,
    mut machines_listed: tokio::sync::watch::Receiver<bool>,
    wakes: impl Stream<Item = ObjectRef<MachineSet>> + Send + 'static,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) {
    let ready = async {
        synced.wait_for(|s| *s).await.is_ok() && machines_listed.wait_for(|l| *l).await.is_ok()
    };
    tokio::select! {
        ok = ready => if !ok { return },
        _ = shutdown.clone() => return,
    }
    let ctx = Arc::new(Context {
        client,
        caches,
        events,
        expectations: Expectations::default(),
        backoff: Default::default(),
    });
    tracing::info!("reconciling MachineSets");
    Controller::for_stream(sets, store)
        .reconcile_on(wakes)
        .graceful_shutdown_on(shutdown)
        .run(reconcile::reconcile, error_policy, ctx)
        .for_each(|result| {
            match result {
                Ok((set, _)) => tracing::debug!(machineset = %set, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "MachineSet reconcile failed"),
            }
            futures::future::ready(())
        })
        .await;
}

fn error_policy(set: Arc<MachineSet>, error: &Error, ctx: Arc<Context>) -> Action {
    let delay = ctx.backoff.next(&set);
    tracing::warn!(
        machineset = %set.name_any(),
        namespace = set.namespace().unwrap_or_default(),
        error = %error,
        retry_in = ?delay,
        "MachineSet reconcile failed"
    );
    Action::requeue(delay)
}

impl Context {
    fn reset_backoff(&self, set: &MachineSet) {
        self.backoff.reset(set);
    }
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

    #[tokio::test]
    async fn expectations_hold_until_the_cache_has_seen_them() {
        let e = Expectations::default();
        assert!(e.settled("u", |_, _| false), "nothing asked");
        e.expect("u", Some("s-a".into()), None);
        e.expect("u", None, Some("s-b".into()));
        assert!(!e.settled("u", |_, _| false));
        assert!(
            !e.settled("u", |n, created| created && n == "s-a"),
            "s-b not yet gone"
        );
        assert!(e.settled("u", |n, created| !created && n == "s-b"));
        e.expect("u", Some("s-c".into()), None);
        e.forget("u");
        assert!(e.settled("u", |_, _| false));
    }
}
