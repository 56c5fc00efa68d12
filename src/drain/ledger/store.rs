//! The `MovePermit` objects of every berth process, as this process
//! reads them from their cache and writes them: a permit is taken by
//! creating its object and ended by deleting it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::reflector::Store;

use crate::api::{MovePermit, PermitSurge};
use crate::drain::ledger::{Permit, Workload, held_permit};

/// How long a permit waits for this process's own deletion of the one
/// before it of the same name.
const DELETION_WAIT: Duration = Duration::from_secs(10);

/// A permit the API server holds (or this process wrote and the cache has
/// not shown yet).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Held {
    pub(super) workload: Workload,
    pub(super) permit: Permit,
    /// The object's namespace and name, and its UID (for the deletion's
    /// precondition).
    pub(super) key: (String, String),
    pub(super) uid: Option<String>,
    /// When it expires once its drain no longer watches its move.
    pub(super) expires: Option<Timestamp>,
    /// The workload object that owns it.
    pub(super) owner: Option<OwnerReference>,
}

impl Held {
    /// The workload whose permit this is.
    pub(crate) fn workload(&self) -> &Workload {
        &self.workload
    }

    /// The move that held it.
    pub(crate) fn permit(&self) -> &Permit {
        &self.permit
    }

    /// The object's name, and when it expired.
    pub(crate) fn name(&self) -> &str {
        &self.key.1
    }

    /// Its UID, or its name for a permit that has none yet.
    pub(super) fn uid_or_name(&self) -> String {
        self.uid.clone().unwrap_or_else(|| self.key.1.clone())
    }

    /// When it expires.
    pub(crate) fn expires(&self) -> Option<Timestamp> {
        self.expires
    }

    /// What an Event about it regards: its workload object, else (a move
    /// group's, a bare pod's) the permit itself.
    pub(crate) fn regarding(&self) -> k8s_openapi::api::core::v1::ObjectReference {
        use k8s_openapi::api::core::v1::ObjectReference;
        match &self.owner {
            Some(o) => ObjectReference {
                api_version: Some(o.api_version.clone()),
                kind: Some(o.kind.clone()),
                name: Some(o.name.clone()),
                namespace: Some(self.key.0.clone()),
                uid: Some(o.uid.clone()),
                ..ObjectReference::default()
            },
            None => ObjectReference {
                api_version: Some("berth.dev/v1alpha1".into()),
                kind: Some("MovePermit".into()),
                name: Some(self.key.1.clone()),
                namespace: Some(self.key.0.clone()),
                uid: self.uid.clone(),
                ..ObjectReference::default()
            },
        }
    }
}

/// A permit's deletion under way, which several may wait for.
type Deletion = Shared<BoxFuture<'static, ()>>;

/// The `MovePermit` objects of every process, read from their cache, and
/// this process's writes of them.
pub(crate) struct PermitStore {
    client: Client,
    cache: Store<MovePermit>,
    /// The namespace of this process's Machines (`None`: every namespace).
    scope: Option<String>,
    /// Permits taken here that the cache does not show yet, by UID.
    pub(super) taken: Mutex<BTreeMap<String, MovePermit>>,
    /// The UIDs of the permits ended here whose object the cache still
    /// shows.
    ended: Mutex<BTreeSet<String>>,
    /// The deletions of the permits ended here, by name: a permit of the
    /// same name is taken once its deletion is done, not refused by it.
    deleting: Mutex<BTreeMap<(String, String), Deletion>>,
    /// The UIDs of the permits ended here since the last
    /// [`Permits::vanished`]: gone by this process's hand.
    pub(super) ended_here: Mutex<BTreeSet<String>>,
    /// The surges written here on permits, by the permit's namespace and
    /// name: newer than the cache until it shows them.
    surges: Mutex<BTreeMap<(String, String), PermitSurge>>,
}

impl PermitStore {
    /// Permits written with `client` and read from `cache`, for a process
    /// whose Machines are those of `scope` (`None`: all).
    pub(crate) fn new(client: Client, cache: Store<MovePermit>, scope: Option<String>) -> Self {
        Self {
            client,
            cache,
            scope,
            taken: Mutex::default(),
            ended: Mutex::default(),
            deleting: Mutex::default(),
            ended_here: Mutex::default(),
            surges: Mutex::default(),
        }
    }

    /// The surge the permit object `key` records: as written here last,
    /// else as the cache shows it.
    pub(super) fn surge(&self, key: &(String, String)) -> Option<PermitSurge> {
        let written = self.surges.lock().ok().and_then(|s| s.get(key).cloned());
        written.or_else(|| {
            let obj = self
                .cache
                .get(&kube::runtime::reflector::ObjectRef::new(&key.1).within(&key.0));
            let taken = || {
                self.taken.lock().ok().and_then(|t| {
                    t.values()
                        .find(|o| key_of(o) == *key)
                        .and_then(|o| o.spec.surge.clone())
                })
            };
            obj.and_then(|o| o.spec.surge.clone()).or_else(taken)
        })
    }

    /// Writes `surge` on the permit object `key` (a merge patch of its
    /// spec, pinned to its UID when known).
    pub(super) async fn write_surge(
        &self,
        key: &(String, String),
        uid: Option<&str>,
        surge: &PermitSurge,
    ) -> Result<(), String> {
        let api: Api<MovePermit> = Api::namespaced(self.client.clone(), &key.0);
        let mut patch = serde_json::json!({"spec": {"surge": surge}});
        if let Some(uid) = uid {
            patch["metadata"] = serde_json::json!({"uid": uid});
        }
        api.patch(&key.1, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map_err(|e| e.to_string())?;
        if let Ok(mut s) = self.surges.lock() {
            s.insert(key.clone(), surge.clone());
        }
        Ok(())
    }

    /// Whether Machine `machine` (`namespace/name`) is of this process's
    /// scope.
    pub(super) fn in_scope(&self, machine: &str) -> bool {
        self.scope
            .as_deref()
            .is_none_or(|ns| machine.split_once('/').is_some_and(|(m, _)| m == ns))
    }

    /// Every permit held now: the cache's, less those ended here, with
    /// those taken here that it does not show yet. What the cache has
    /// caught up with is forgotten here. Objects are told apart by UID: a
    /// slot's name is taken again by the next move of its workload.
    pub(super) fn held(&self) -> Vec<Held> {
        let objects = self.cache.state();
        let uids: BTreeSet<String> = objects.iter().map(|o| uid_of(o)).collect();
        let taken: Vec<MovePermit> = match self.taken.lock() {
            Ok(mut t) => {
                t.retain(|uid, _| !uids.contains(uid));
                t.values().cloned().collect()
            }
            Err(_) => Vec::new(),
        };
        let ended = match self.ended.lock() {
            Ok(mut e) => {
                e.retain(|uid| uids.contains(uid));
                e.clone()
            }
            Err(_) => BTreeSet::new(),
        };
        objects
            .iter()
            .map(|o| &**o)
            .filter(|o| !ended.contains(&uid_of(o)))
            .chain(taken.iter())
            .filter_map(held_of)
            .collect()
    }

    /// Creates `object`, once this process's own deletion of an earlier
    /// permit of that name is done (for at most [`DELETION_WAIT`]):
    /// `Err(None)` when its name is taken (a permit of another drain or
    /// process), `Err(Some(why))` when the write failed.
    pub(super) async fn take(&self, object: MovePermit) -> Result<(), Option<String>> {
        let pending = self
            .deleting
            .lock()
            .ok()
            .and_then(|d| d.get(&key_of(&object)).cloned());
        if let Some(deleted) = pending {
            let _ = tokio::time::timeout(DELETION_WAIT, deleted).await;
        }
        let ns = object.metadata.namespace.clone().unwrap_or_default();
        let api: Api<MovePermit> = Api::namespaced(self.client.clone(), &ns);
        match api.create(&PostParams::default(), &object).await {
            Ok(created) => {
                if let Ok(mut t) = self.taken.lock() {
                    t.insert(uid_of(&created), created);
                }
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Err(None),
            Err(e) => {
                tracing::warn!(error = %e, permit = ?key_of(&object), "cannot take a move permit");
                Err(Some(e.to_string()))
            }
        }
    }

    /// Ends every permit held that `which` picks: forgotten here at once,
    /// its object deleted in the background (pinned to its UID, retried
    /// with backoff; gone or replaced counts as done). How many.
    pub(super) fn end(&self, which: impl Fn(&Held) -> bool) -> usize {
        let ending: Vec<Held> = self.held().into_iter().filter(|h| which(h)).collect();
        for h in &ending {
            let uid = h.uid_or_name();
            if let Ok(mut t) = self.taken.lock() {
                t.remove(&uid);
            }
            if let Ok(mut e) = self.ended_here.lock() {
                e.insert(uid.clone());
            }
            if let Ok(mut e) = self.ended.lock() {
                e.insert(uid);
            }
            if let Ok(mut s) = self.surges.lock() {
                s.remove(&h.key);
            }
            let api: Api<MovePermit> = Api::namespaced(self.client.clone(), &h.key.0);
            let (name, uid) = (h.key.1.clone(), h.uid.clone());
            let deleted = tokio::spawn(async move { delete_permit(api, name, uid).await })
                .map(|_| ())
                .boxed()
                .shared();
            if let Ok(mut d) = self.deleting.lock() {
                // Those done are forgotten.
                d.retain(|_, f| f.peek().is_none());
                d.insert(h.key.clone(), deleted);
            }
        }
        ending.len()
    }
}

/// How many failed deletions of a permit are logged at debug level before
/// each further one is an error (about ten minutes of backoff).
const DELETE_QUIET_TRIES: u32 = 15;

/// Deletes permit `name` (UID `uid`), retried with backoff (at most a
/// minute apart) until it is gone: this process has forgotten the permit,
/// and every other process would wait on it until its healthy deadline.
/// A process that stops meanwhile leaves it to the next leader's keeper.
/// After about ten minutes each failure is logged as an error.
async fn delete_permit(api: Api<MovePermit>, name: String, uid: Option<String>) {
    use backon::BackoffBuilder;
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    let mut backoff = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(60))
        .with_jitter()
        .without_max_times()
        .build();
    let mut tries = 0u32;
    loop {
        match api.delete(&name, &params).await {
            Ok(_) => return,
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => return,
            Err(e) => {
                tries += 1;
                if tries > DELETE_QUIET_TRIES {
                    tracing::error!(error = %e, permit = %name, tries, "cannot delete a move permit: other berth processes count it until it is deleted or expires; retrying");
                } else {
                    tracing::debug!(error = %e, permit = %name, "deleting a move permit failed; retrying");
                }
                let pause = backoff.next().unwrap_or(Duration::from_secs(60));
                tokio::time::sleep(pause).await;
            }
        }
    }
}

/// An object's UID (its name, for one that has none yet).
pub(super) fn uid_of(o: &MovePermit) -> String {
    o.metadata
        .uid
        .clone()
        .unwrap_or_else(|| o.metadata.name.clone().unwrap_or_default())
}

/// An object's namespace and name.
pub(super) fn key_of(o: &MovePermit) -> (String, String) {
    (
        o.metadata.namespace.clone().unwrap_or_default(),
        o.metadata.name.clone().unwrap_or_default(),
    )
}

/// What a `MovePermit` says, as the ledger counts it, with its object's
/// name and UID.
pub(super) fn held_of(o: &MovePermit) -> Option<Held> {
    let (workload, permit) = held_permit(o)?;
    Some(Held {
        workload,
        permit,
        key: key_of(o),
        uid: o.metadata.uid.clone(),
        expires: o.spec.expires.as_ref().map(|t| t.0),
        owner: o
            .metadata
            .owner_references
            .as_ref()
            .and_then(|os| os.first().cloned()),
    })
}
