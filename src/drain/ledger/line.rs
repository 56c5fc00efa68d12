//! The line of asks across berth processes: this process's parked asks
//! kept in the API server as [`MoveAsk`] objects, and every other
//! process's read from their cache.
//!
//! An ask that parks (its drain's pass is over and it waits for a
//! permit) is written once; it is deleted once it leaves the line
//! (granted, withdrawn, its drain ended). While it waits its `expires` is
//! renewed every [`RENEW`], so that it lives [`TTL`] past its process:
//! another process passes by an ask whose process died. The leader of a
//! scope deletes the asks of its scope that no drain of it waits on (a
//! previous leader's, one whose deletion failed). Nothing polls: the loop
//! wakes on a change of what this process wants in line, on an event of
//! the asks' watch, and at the next renewal or expiry. When another
//! process's ask leaves the line (deleted or expired), the drains that
//! wait here are woken: one of them may be first now.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::reflector::Store;
use tokio::sync::watch;

use super::{Ask, Lined, Workload, ledger_meta, lined_ask, workload_name};
use crate::api::{MoveAsk, MoveAskSpec, ask_name};

/// How often this process renews the asks it keeps in line.
pub const RENEW: Duration = Duration::from_secs(15);
/// How long an ask holds its place past its last renewal: three renewals
/// missed.
pub const TTL: Duration = Duration::from_secs(45);
/// How long after a failed write the loop tries again.
const RETRY: Duration = Duration::from_secs(5);

/// An object's namespace and name.
type Key = (String, String);

/// What this process wants in line: by object, the ask and its owner.
type Wanted = BTreeMap<Key, (Workload, Ask, Option<OwnerReference>)>;

/// The `MoveAsk` objects of every process, read from their cache, and
/// this process's writes of its own.
pub(crate) struct AskStore {
    client: Client,
    cache: Store<MoveAsk>,
    /// Bumped on every event of the asks' watch.
    changes: watch::Receiver<u64>,
    /// The namespace of this process's Machines (`None`: every namespace).
    scope: Option<String>,
    want: watch::Sender<Wanted>,
}

impl AskStore {
    /// Asks written with `client` and read from `cache` (whose events bump
    /// `changes`), for a process whose Machines are those of `scope`.
    pub(crate) fn new(
        client: Client,
        cache: Store<MoveAsk>,
        changes: watch::Receiver<u64>,
        scope: Option<String>,
    ) -> Self {
        Self {
            client,
            cache,
            changes,
            scope,
            want: watch::channel(Wanted::new()).0,
        }
    }

    /// Whether Machine `machine` (`namespace/name`) is of this process's
    /// scope: its asks are this process's.
    fn in_scope(&self, machine: &str) -> bool {
        self.scope
            .as_deref()
            .is_none_or(|ns| machine.split_once('/').is_some_and(|(m, _)| m == ns))
    }

    /// The asks of other processes in line (those of Machines of other
    /// scopes), expired or not: the ledger passes by an expired one.
    pub(crate) fn others(&self) -> Vec<(Workload, Lined)> {
        self.cache
            .state()
            .iter()
            .filter(|o| !self.in_scope(&o.spec.machine))
            .filter_map(|o| lined_ask(o))
            .collect()
    }

    /// This process's asks in line are `asks` now (each with the owner of
    /// its object): the loop ([`AskStore::keep`]) writes what changed.
    pub(crate) fn want(&self, asks: Vec<(Workload, Ask, Option<OwnerReference>)>) {
        let wanted: Wanted = asks
            .into_iter()
            .map(|(w, a, o)| (key(&w, &a), (w, a, o)))
            .collect();
        self.want.send_if_modified(|now| {
            let changed = now.keys().ne(wanted.keys());
            *now = wanted;
            changed
        });
    }

    /// Keeps this process's asks in the API server for as long as it
    /// leads (see the module), `wake` called when another process's ask
    /// left the line. The caller waits for the asks' cache to sync first:
    /// until then this scope's asks would look stale.
    pub(crate) async fn keep(&self, wake: impl Fn()) {
        let mut want = self.want.subscribe();
        let mut changes = self.changes.clone();
        // What this process wrote, by object: until when it holds.
        let mut written: BTreeMap<Key, Timestamp> = BTreeMap::new();
        // The UIDs deleted here that the cache may still show.
        let mut deleted: BTreeSet<String> = BTreeSet::new();
        let mut others: BTreeSet<Key> = BTreeSet::new();
        loop {
            let wanted = want.borrow_and_update().clone();
            changes.borrow_and_update();
            let now = Timestamp::now();
            let live: BTreeMap<Key, Timestamp> = self
                .cache
                .state()
                .iter()
                .filter(|o| !self.in_scope(&o.spec.machine) && o.spec.expires.0 > now)
                .map(|o| (key_of(o), o.spec.expires.0))
                .collect();
            if others.iter().any(|k| !live.contains_key(k)) {
                wake();
            }
            others = live.keys().cloned().collect();
            let failed = self.write(&wanted, &mut written, &mut deleted, now).await;
            // The next renewal, the next expiry of another's ask, or a retry.
            let renew = written
                .values()
                .min()
                .map(|at| after(now, *at, TTL.saturating_sub(RENEW)));
            let expiry = live
                .values()
                .min()
                .map(|at| after(now, *at, Duration::ZERO));
            let next = [renew, expiry, failed.then_some(RETRY)]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(Duration::from_secs(86_400));
            tokio::select! {
                r = want.changed() => if r.is_err() { return },
                r = changes.changed() => if r.is_err() { return },
                () = tokio::time::sleep(next + Duration::from_millis(100)) => {}
            }
        }
    }

    /// Writes what changed: parks the asks `wanted` that are not written
    /// yet, renews those due, deletes those that left the line and the
    /// asks of this scope no drain here waits on. Whether a write failed.
    async fn write(
        &self,
        wanted: &Wanted,
        written: &mut BTreeMap<Key, Timestamp>,
        deleted: &mut BTreeSet<String>,
        now: Timestamp,
    ) -> bool {
        let mut failed = false;
        let until = now
            .checked_add(SignedDuration::try_from(TTL).unwrap_or_default())
            .unwrap_or(now);
        for (k, (w, a, owner)) in wanted {
            let due = written
                .get(k)
                .is_none_or(|at| after(now, *at, TTL.saturating_sub(RENEW)).is_zero());
            if !due {
                continue;
            }
            let renewal = written.contains_key(k);
            match self
                .put(ask_object(w, a, owner.as_ref(), until), renewal)
                .await
            {
                Ok(()) => {
                    written.insert(k.clone(), until);
                }
                Err(e) => {
                    tracing::warn!(error = %e, ask = ?k, "cannot keep a move ask in line");
                    failed = true;
                }
            }
        }
        let ending = self.to_take_out(wanted, written, deleted);
        for (k, uid) in ending {
            let api: Api<MoveAsk> = Api::namespaced(self.client.clone(), &k.0);
            let params = DeleteParams {
                preconditions: uid.clone().map(|uid| Preconditions {
                    uid: Some(uid),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match api.delete(&k.1, &params).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(e) => {
                    tracing::warn!(error = %e, ask = ?k, "cannot take a move ask out of line");
                    failed = true;
                    continue;
                }
            }
            written.remove(&k);
            if let Some(uid) = uid {
                deleted.insert(uid);
            }
        }
        failed
    }

    /// The asks to take out of line, each with its UID when the cache
    /// shows it: those written here that are no longer `wanted`, and those
    /// of this scope that no drain here waits on (a previous leader's, a
    /// Machine whose drain ended or that is gone, one whose deletion
    /// failed), but those `deleted` here that the cache still shows.
    fn to_take_out(
        &self,
        wanted: &Wanted,
        written: &BTreeMap<Key, Timestamp>,
        deleted: &mut BTreeSet<String>,
    ) -> Vec<(Key, Option<String>)> {
        let objects = self.cache.state();
        let uids: BTreeSet<String> = objects
            .iter()
            .filter_map(|o| o.metadata.uid.clone())
            .collect();
        deleted.retain(|u| uids.contains(u));
        let uid_of = |k: &Key| {
            objects
                .iter()
                .find(|o| key_of(o) == *k)
                .and_then(|o| o.metadata.uid.clone())
        };
        let gone: Vec<Key> = written
            .keys()
            .filter(|k| !wanted.contains_key(*k))
            .cloned()
            .collect();
        let mut ending: Vec<(Key, Option<String>)> =
            gone.iter().map(|k| (k.clone(), uid_of(k))).collect();
        ending.extend(
            objects
                .iter()
                .filter(|o| self.in_scope(&o.spec.machine))
                .filter(|o| {
                    let k = key_of(o);
                    !wanted.contains_key(&k) && !gone.contains(&k)
                })
                .filter(|o| o.metadata.uid.as_ref().is_none_or(|u| !deleted.contains(u)))
                .map(|o| (key_of(o), o.metadata.uid.clone())),
        );
        ending
    }

    /// Creates `object` (an ask that parks), or merges its spec into the
    /// one of that name (a renewal, or an ask a previous leader left).
    async fn put(&self, object: MoveAsk, renewal: bool) -> Result<(), kube::Error> {
        let ns = object.metadata.namespace.clone().unwrap_or_default();
        let name = object.metadata.name.clone().unwrap_or_default();
        let api: Api<MoveAsk> = Api::namespaced(self.client.clone(), &ns);
        if !renewal {
            match api.create(&PostParams::default(), &object).await {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(e),
            }
        }
        let spec = serde_json::json!({ "spec": object.spec });
        api.patch(&name, &PatchParams::default(), &Patch::Merge(spec))
            .await
            .map(|_| ())
    }
}

/// From `now`, the time until `margin` before `at` (zero when that is
/// past).
fn after(now: Timestamp, at: Timestamp, margin: Duration) -> Duration {
    let left = Duration::try_from(at.duration_since(now)).unwrap_or(Duration::ZERO);
    left.saturating_sub(margin)
}

/// The object of `ask` of `workload`.
fn key(workload: &Workload, ask: &Ask) -> Key {
    (
        workload.namespace.clone(),
        ask_name(&workload.kind, &workload.name, pod_name(ask)),
    )
}

/// The name of an ask's pod, without its namespace.
fn pod_name(ask: &Ask) -> &str {
    ask.pod.split_once('/').map_or(ask.pod.as_str(), |(_, n)| n)
}

/// An object's namespace and name.
fn key_of(o: &MoveAsk) -> Key {
    (
        o.metadata.namespace.clone().unwrap_or_default(),
        o.metadata.name.clone().unwrap_or_default(),
    )
}

/// The `MoveAsk` of `ask` of `workload`, owned by `owner`, holding its
/// place until `expires`.
fn ask_object(
    workload: &Workload,
    ask: &Ask,
    owner: Option<&OwnerReference>,
    expires: Timestamp,
) -> MoveAsk {
    let (_, name) = key(workload, ask);
    MoveAsk {
        metadata: ledger_meta(workload, name, owner),
        spec: MoveAskSpec {
            workload: workload_name(workload),
            pod: pod_name(ask).to_string(),
            pod_uid: ask.uid.clone(),
            machine: ask.machine.clone(),
            priority: ask.priority,
            requested: Time(ask.requested),
            moves_left: ask.moves_left,
            expires: Time(expires),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::ledger::tests::{ask, db, t};

    #[test]
    fn an_ask_object_says_its_place_in_line_and_reads_back_the_same() {
        let mut a = ask("db-1", "b", 20);
        a.priority = 7;
        a.moves_left = 3;
        let owner = OwnerReference {
            api_version: "apps/v1".into(),
            kind: "StatefulSet".into(),
            name: "db".into(),
            uid: "uid-sts".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        };
        let o = ask_object(&db(), &a, Some(&owner), t(60));
        assert_eq!(o.metadata.name.as_deref(), Some("statefulset.db.db-1"));
        assert_eq!(o.metadata.namespace.as_deref(), Some("ns"));
        let owners = o.metadata.owner_references.clone().expect("owned");
        assert_eq!(
            (
                owners[0].uid.as_str(),
                owners[0].controller,
                owners[0].block_owner_deletion
            ),
            ("uid-sts", None, None),
            "owned by its workload, neither controlling nor blocking it"
        );
        let (w, lined) = lined_ask(&o).expect("reads back");
        assert_eq!(w, db());
        assert_eq!(lined.expires, t(60));
        let back = &lined.ask;
        assert_eq!(
            (back.pod.as_str(), back.uid.as_str(), back.machine.as_str()),
            ("ns/db-1", "uid-db-1", "ns/b")
        );
        assert_eq!(
            (back.priority, back.requested, back.moves_left),
            (7, t(20), 3)
        );
    }

    /// The asks of this scope leave the line when no drain here waits on
    /// them, a previous leader's too; another scope's are its leader's to
    /// take out, and this process reads them, expired ones included (the
    /// ledger passes those by).
    #[tokio::test]
    async fn the_leader_takes_out_its_scopes_asks_no_drain_waits_on() {
        use kube::runtime::watcher::Event;
        let (cache, mut writer) = kube::runtime::reflector::store::<MoveAsk>();
        let client = Client::try_from(kube::Config::new(
            "https://127.0.0.1:1".parse().expect("a uri"),
        ))
        .expect("a client that is never reached");
        let store = AskStore::new(client, cache, watch::channel(0).1, Some("ns".into()));
        let object = |pod: &str, machine: &str, uid: &str, expires: i64| {
            let a = Ask {
                machine: machine.into(),
                ..ask(pod, "x", 0)
            };
            let mut o = ask_object(&db(), &a, None, t(expires));
            o.metadata.uid = Some(uid.into());
            (a, o)
        };
        let (waits, waits_o) = object("db-1", "ns/b", "u1", 60);
        let (_, ended_o) = object("db-2", "ns/c", "u2", 60);
        let (_, left_o) = object("db-3", "ns/d", "u3", 60);
        let (_, theirs_o) = object("db-4", "other/e", "u4", 60);
        let (_, dead_o) = object("db-5", "other/f", "u5", 10);
        for o in [&waits_o, &ended_o, &left_o, &theirs_o, &dead_o] {
            writer.apply_watcher_event(&Event::Apply(o.clone()));
        }
        let wanted: Wanted = [(key(&db(), &waits), (db(), waits.clone(), None))].into();
        // db-2's was written here and its drain ended; db-3's a previous
        // leader left, and its deletion here is not seen yet.
        let written: BTreeMap<Key, Timestamp> =
            [(key_of(&waits_o), t(60)), (key_of(&ended_o), t(60))].into();
        let mut deleted = BTreeSet::new();
        let out = store.to_take_out(&wanted, &written, &mut deleted);
        let names: Vec<&str> = out.iter().map(|(k, _)| k.1.as_str()).collect();
        assert_eq!(names, ["statefulset.db.db-2", "statefulset.db.db-3"]);
        assert_eq!(out[0].1.as_deref(), Some("u2"), "pinned to its UID");
        deleted.insert("u3".to_string());
        let out = store.to_take_out(&wanted, &BTreeMap::new(), &mut deleted);
        let names: Vec<&str> = out.iter().map(|(k, _)| k.1.as_str()).collect();
        assert_eq!(
            names,
            ["statefulset.db.db-2"],
            "db-3's deletion is on its way"
        );
        let mut others: Vec<(String, Timestamp)> = store
            .others()
            .into_iter()
            .map(|(_, l)| (l.ask.pod, l.expires))
            .collect();
        others.sort();
        assert_eq!(
            others,
            [
                ("ns/db-4".to_string(), t(60)),
                ("ns/db-5".to_string(), t(10))
            ]
        );
    }

    #[test]
    fn a_renewal_is_due_once_its_ask_was_written_renew_ago() {
        let now = t(100);
        let written_now = now
            .checked_add(SignedDuration::try_from(TTL).expect("ttl"))
            .expect("time");
        assert_eq!(after(now, written_now, TTL - RENEW), RENEW);
        assert!(after(t(200), written_now, TTL - RENEW).is_zero());
    }
}
