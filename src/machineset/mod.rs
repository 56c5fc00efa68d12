//! The MachineSet controller: keeps `spec.replicas` Machines made from a
//! set's template, and on scale-down deletes first the Machines whose
//! removal costs least (`order`).
//!
//! It runs beside the Machine controller, on the leader only, on the
//! caches they share (`crate::cache::Caches`): the Machines (filed by their
//! owning set), Nodes, pods by Node, claims and VolumeAttachments by Node.
//! Its own watch is of MachineSets; a Machine event wakes the set that owns
//! it, and a Node event the sets of that Node's Machines
//! (`crate::cache::wakes`), so nothing polls. It never adopts a Machine it
//! does not own (controller ownerReference), never deletes a Machine
//! already being deleted, and never deletes or creates twice for one
//! change: what it asked for is remembered until the Machine cache has
//! seen it (`Expectations`), as the ReplicaSet controller does.
//!
//! `decide` counts and builds the status, `order` chooses which Machine
//! goes, `observe` reads what both of them need of a Machine from the
//! caches (the MachineDeployment controller reads it there too),
//! `reconcile` observes, acts and records.

pub(crate) mod decide;
pub(crate) mod observe;
pub(crate) mod order;
mod reconcile;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use kube::Client;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;

use crate::api::MachineSet;
use crate::cache::Caches;
use crate::telemetry::events::EventSink;

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
/// set forever, and a watch that lags (a loaded API server, a re-list)
/// must not make the set create twice. The ReplicaSet controller uses
/// 5 minutes, and so does berth (it was 60 s, shorter than a watch can lag).
const EXPECTATION_TTL: Duration = Duration::from_secs(300);

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
    backoff: crate::controller::Backoffs<MachineSet>,
}

/// Runs the MachineSet controller until `shutdown` resolves: waits for
/// every cache to sync (the first complete list of Machines included),
/// then reconciles the sets of `sets` (the set watch, which fills
/// `caches.sets`), woken by it and by `wakes`.
pub(crate) async fn run(
    client: Client,
    caches: Caches,
    sets: impl Stream<Item = Result<MachineSet, watcher::Error>> + Send + 'static,
    events: EventSink,
    wakes: impl Stream<Item = ObjectRef<MachineSet>> + Send + 'static,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) {
    tokio::select! {
        ok = caches.wait_until_synced() => if !ok { return },
        _ = shutdown.clone() => return,
    }
    let store = caches.sets.clone();
    let ctx = Arc::new(Context {
        client,
        caches,
        events,
        expectations: Expectations::default(),
        backoff: Default::default(),
    });
    tracing::info!("reconciling MachineSets");
    let controller = Controller::for_stream(sets, store).reconcile_on(wakes);
    crate::controller::skeleton::run(controller, reconcile::reconcile, ctx, shutdown, || {}).await;
}

impl crate::controller::Reconciler for Context {
    type Object = MachineSet;
    type Error = reconcile::Error;
    const KIND: &'static str = "MachineSet";

    fn backoff(&self) -> &crate::controller::Backoffs<MachineSet> {
        &self.backoff
    }
}

impl Context {
    fn reset_backoff(&self, set: &MachineSet) {
        self.backoff.reset(set);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[tokio::test(start_paused = true)]
    async fn an_expectation_outlasts_a_lagging_watch_and_ends_after_its_ttl() {
        let e = Expectations::default();
        e.expect("u", Some("s-a".into()), None);
        tokio::time::advance(Duration::from_secs(240)).await;
        assert!(
            !e.settled("u", |_, _| false),
            "a watch 4 minutes late: the create is still awaited, none made again"
        );
        tokio::time::advance(EXPECTATION_TTL - Duration::from_secs(239)).await;
        assert!(
            e.settled("u", |_, _| false),
            "never seen: let go after the TTL"
        );
    }
}
