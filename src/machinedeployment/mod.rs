//! The MachineDeployment controller: keeps one MachineSet per template
//! (named by the template's hash) and rolls a template change out from the
//! old sets to the new one at the pace of `decide`, so that each stateful
//! pod moves once and no old Machine goes before its pods have somewhere
//! new to land.
//!
//! It scales MachineSets; the MachineSet controller creates and deletes
//! the Machines, and chooses which Machine of a set goes by its order
//! (`crate::machineset::order`). The deployment chooses which old *set*
//! gives up a Machine with the same order over all its old Machines, so the
//! Machine it counted on is the one the set deletes.
//!
//! Like the MachineSet controller it runs on the leader, on the caches
//! the controllers share (the MachineSets' included). A Machine event (or its
//! Node's) wakes the deployment of its set, and a MachineSet event its
//! deployment, so nothing polls. Writes to a set's `spec.replicas` are
//! remembered until the cache has seen them (`Expectations`), so a reconcile
//! that runs on a cache a step behind never asks for a deletion twice; and
//! the decisions that count drains across deployments are taken one
//! deployment at a time, so the global cap holds.

pub(crate) mod decide;
mod members;
mod reconcile;

use std::collections::HashMap;
use std::sync::Arc;

use futures::Stream;
use kube::Client;
use kube::api::Api;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;

use crate::api::{MachineDeployment, MachineSet};
use crate::cache::Caches;
use crate::telemetry::Metrics;
use crate::telemetry::events::EventSink;

/// What the controller needs besides the caches.
pub(crate) struct Context {
    pub(crate) client: Client,
    pub(crate) caches: Caches,
    pub(crate) events: EventSink,
    /// The most old Machines being deleted by rollouts at once, across
    /// every deployment (`berth run --max-concurrent-drains`).
    pub(crate) drain_cap: usize,
    /// Held while a deployment decides and writes its next step: the
    /// writes the cache has yet to see.
    pub(crate) expectations: tokio::sync::Mutex<Expectations>,
    pub(crate) metrics: Arc<Metrics>,
    backoff: crate::controller::Backoffs<MachineDeployment>,
}

/// The expectations of the deployment controller, as the MachineSet
/// controller has its own (`crate::machineset::Expectations`):
/// `spec.replicas` written to MachineSets and not yet seen in the cache,
/// set UID to (the generation the write produced, the replicas written).
#[derive(Default)]
pub(crate) struct Expectations(HashMap<String, (i64, usize)>);

impl Expectations {
    /// The set's replicas: ours when the cache has not yet seen our write.
    pub(crate) fn replicas(&mut self, set: &MachineSet) -> usize {
        let cached = usize::try_from(set.spec.replicas).unwrap_or(0);
        let Some(uid) = set.metadata.uid.as_deref() else {
            return cached;
        };
        match self.0.get(uid) {
            Some((generation, replicas)) if set.metadata.generation.unwrap_or(0) < *generation => {
                *replicas
            }
            Some(_) => {
                self.0.remove(uid);
                cached
            }
            None => cached,
        }
    }

    pub(crate) fn wrote(&mut self, written: &MachineSet) {
        if let (Some(uid), Some(generation)) =
            (written.metadata.uid.clone(), written.metadata.generation)
        {
            let replicas = usize::try_from(written.spec.replicas).unwrap_or(0);
            self.0.insert(uid, (generation, replicas));
        }
    }
}

/// Runs the MachineDeployment controller until `shutdown` resolves, once
/// every cache has synced and the MachineSet watch has listed.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    client: Client,
    namespace: Option<String>,
    caches: Caches,
    events: EventSink,
    drain_cap: usize,
    metrics: Arc<Metrics>,
    wakes: impl Stream<Item = ObjectRef<MachineDeployment>> + Send + 'static,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) {
    let mut synced = caches.synced.clone();
    let ready = async {
        synced.wait_for(|s| *s).await.is_ok() && caches.sets.wait_until_ready().await.is_ok()
    };
    tokio::select! {
        ok = ready => if !ok { return },
        _ = shutdown.clone() => return,
    }
    let api: Api<MachineDeployment> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let ctx = Arc::new(Context {
        client,
        caches,
        events,
        drain_cap,
        expectations: tokio::sync::Mutex::new(Expectations::default()),
        metrics: Arc::clone(&metrics),
        backoff: Default::default(),
    });
    tracing::info!(drain_cap, "reconciling MachineDeployments");
    let controller = Controller::new(api, watcher::Config::default());
    let deployments = controller.store();
    let controller = controller.reconcile_on(wakes);
    let count_stalled = || {
        let stalled = deployments.state().iter().filter(|d| stalled(d)).count();
        metrics
            .machinedeployments_stalled
            .set(i64::try_from(stalled).unwrap_or(i64::MAX));
    };
    crate::controller::skeleton::run(
        controller,
        reconcile::reconcile,
        ctx,
        shutdown,
        count_stalled,
    )
    .await;
}

/// Its Progressing condition is False.
fn stalled(md: &MachineDeployment) -> bool {
    md.status.iter().flat_map(|s| &s.conditions).any(|c| {
        c.type_ == crate::api::machinedeployment::conditions::PROGRESSING && c.status == "False"
    })
}

impl crate::controller::Reconciler for Context {
    type Object = MachineDeployment;
    type Error = reconcile::Error;
    const KIND: &'static str = "MachineDeployment";

    fn backoff(&self) -> &crate::controller::Backoffs<MachineDeployment> {
        &self.backoff
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(generation: i64, replicas: i32) -> MachineSet {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "berth.dev/v1alpha1", "kind": "MachineSet",
            "metadata": {"name": "s", "namespace": "ns", "uid": "u", "generation": generation,
                "ownerReferences": [{"apiVersion": "berth.dev/v1alpha1", "kind": "MachineDeployment",
                    "name": "pool", "uid": "d", "controller": true}]},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"a": "b"}},
                "template": {"spec": {"classRef": {"name": "c"}}}},
        }))
        .expect("set")
    }

    #[test]
    fn the_expectations_answer_until_the_cache_has_seen_the_write() {
        let mut l = Expectations::default();
        assert_eq!(l.replicas(&set(3, 4)), 4);
        l.wrote(&set(4, 3));
        assert_eq!(l.replicas(&set(3, 4)), 3, "the cache is a step behind");
        assert_eq!(l.replicas(&set(4, 3)), 3);
        assert_eq!(l.replicas(&set(5, 7)), 7, "forgotten once seen");
        assert_eq!(
            crate::api::owner_of(&set(1, 1)),
            Some(ObjectRef::new("pool").within("ns"))
        );
    }
}
