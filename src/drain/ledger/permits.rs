//! The move ledger of this controller process, shared by every drain, and
//! its permits kept in the API server, shared by every berth process.
//!
//! The decisions are the pure [`Ledger`]'s; this holds it behind a lock.
//! A permit of a workload whose budget is bounded is a
//! [`MovePermit`](crate::api::MovePermit) object beside the workload,
//! taken by creating it (the API server grants a name to one creator, so
//! two processes, whatever their scope, never hold the same permit) and
//! ended by deleting it; before each ask the ledger is told every permit
//! the cache of those objects holds (with this process's own writes the
//! cache has not shown yet), and the asks of other processes in line
//! (their `MoveAsk`s, see `line`); this process's asks that park are put
//! in line there too. A move of a workload without a bound stays in this
//! process. The moves every Machine
//! recorded in `status.drain.moves` are read once, before the first drain
//! asks anything (a restart, a new leader, or an upgrade from a release
//! that kept permits in the process only). Drains that wait are told when
//! a move ends or an ask is withdrawn, here or in another process (the
//! permits' watch), so that they ask again; the metrics of the moves in
//! flight and of the time asks waited are kept here.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use tokio::sync::watch;

use crate::api::{Machine, MovePermit, MovePermitSpec, PermitSurge, permit_name};
#[cfg(doc)]
use crate::drain::ledger::permit_expires;
use crate::drain::ledger::{
    Answer, Ask, AskStore, Budget, Ledger, Permit, Workload, ledger_meta, recorded_moves,
};
use crate::placement::Holding;
use crate::telemetry::{Metrics, WORKLOAD_KINDS};

pub(crate) use super::store::{Held, PermitStore};

/// How long after a permit could not be written the drains that wait ask
/// again (nothing else would wake them: no permit changed).
const RETRY_WRITE_AFTER: Duration = Duration::from_secs(5);

pub(crate) struct Permits {
    ledger: Mutex<Ledger>,
    /// The permits in the API server.
    store: PermitStore,
    /// The asks in line in the API server, this process's and others'.
    line: AskStore,
    /// The owner of each waiting ask's `MoveAsk` (its workload object, if
    /// known), by pod UID.
    owners: Mutex<BTreeMap<String, Option<OwnerReference>>>,
    /// The cap on moves in flight, of every workload together.
    cap: Option<usize>,
    /// Bumped on every end and withdrawal: a waiting drain asks again.
    freed: Arc<watch::Sender<u64>>,
    /// Set once the ledger was rebuilt from the Machines' records.
    rebuilt: OnceLock<()>,
    metrics: Arc<Metrics>,
    /// The permits of this scope held at the last [`Permits::vanished`],
    /// by UID.
    seen: Mutex<BTreeMap<String, Held>>,
    /// The pod UIDs of the moves a running drain left to the keeper (see
    /// [`Permits::linger`]).
    lingering: Mutex<BTreeSet<String>>,
    /// Bumped when a move is left to the keeper.
    lingered: watch::Sender<u64>,
    /// Held by a drain while it looks for a stateful pod's destination
    /// and, when it finds one, holds it (`holding`): two drains of this
    /// process never count on the same free slot.
    placing: Mutex<()>,
    /// The destinations held by moves whose permit is being asked, by pod
    /// UID: until the answer, their attach slots count as reserved.
    holding: Mutex<BTreeMap<String, Holding>>,
}

impl Permits {
    /// A ledger whose moves in flight are at most `cap` (`None`: no cap),
    /// with its permits in `store` and its asks in line in `line`, until
    /// it is rebuilt.
    pub(crate) fn new(
        cap: Option<usize>,
        metrics: Arc<Metrics>,
        store: PermitStore,
        line: AskStore,
    ) -> Self {
        Self {
            ledger: Mutex::new(Ledger::default().with_cap(cap)),
            store,
            line,
            owners: Mutex::default(),
            cap,
            freed: Arc::new(watch::channel(0).0),
            rebuilt: OnceLock::new(),
            metrics,
            seen: Mutex::default(),
            lingering: Mutex::default(),
            lingered: watch::channel(0).0,
            placing: Mutex::default(),
            holding: Mutex::default(),
        }
    }

    /// Runs `look` (a destination check, which reads [`Permits::holdings`])
    /// and holds the destination it found for its move, in one critical
    /// section of this process: no other drain of it looks in between. The
    /// hold lasts until [`Permits::unhold`], after the permit's answer (a
    /// permit granted holds it from then on). No await inside.
    pub(crate) fn hold_destination<T>(&self, look: impl FnOnce() -> (T, Option<Holding>)) -> T {
        let _placing = self.placing.lock();
        let (found, hold) = look();
        if let (Some(h), Ok(mut holding)) = (hold, self.holding.lock()) {
            holding.insert(h.uid.clone(), h);
        }
        found
    }

    /// Ends the hold of pod `uid`'s destination (see
    /// [`Permits::hold_destination`]).
    pub(crate) fn unhold(&self, uid: &str) {
        if let Ok(mut holding) = self.holding.lock() {
            holding.remove(uid);
        }
    }

    /// Every move in flight that holds a destination, once each: this
    /// process's (its ledger, the permits it wrote that the cache has not
    /// shown yet, and the moves whose permit is being asked) and every
    /// process's permits in the API server.
    pub(crate) fn holdings(&self) -> Vec<Holding> {
        let mut by_uid: BTreeMap<String, Holding> = BTreeMap::new();
        for h in self.store.held() {
            if let Some(hold) = h.permit.holding() {
                by_uid.insert(hold.uid.clone(), hold);
            }
        }
        if let Ok(ledger) = self.ledger.lock() {
            for (_, p) in ledger.moves() {
                if let Some(hold) = p.holding() {
                    by_uid.entry(hold.uid.clone()).or_insert(hold);
                }
            }
        }
        if let Ok(holding) = self.holding.lock() {
            for (uid, hold) in holding.iter() {
                by_uid.entry(uid.clone()).or_insert_with(|| hold.clone());
            }
        }
        by_uid.into_values().collect()
    }

    /// The permit the API server holds for the move of pod `uid`, of
    /// `workload`, if there is one.
    pub(crate) fn held_for(&self, workload: &Workload, uid: &str) -> Option<Permit> {
        self.store
            .held()
            .into_iter()
            .find(|h| h.workload == *workload && h.permit.uid == uid)
            .map(|h| h.permit)
    }

    /// The surge the permit of the move of pod `uid`, of `workload`,
    /// records (see [`PermitSurge`]).
    pub(crate) fn surge_of(&self, workload: &Workload, uid: &str) -> Option<PermitSurge> {
        let held = self
            .store
            .held()
            .into_iter()
            .find(|h| h.workload == *workload && h.permit.uid == uid)?;
        self.store.surge(&held.key)
    }

    /// Records `surge` on the permit of the move of pod `uid`, of
    /// `workload`, before berth makes it (or once it undid it). `Err`: no
    /// such permit, or the write failed.
    pub(crate) async fn record_surge(
        &self,
        workload: &Workload,
        uid: &str,
        surge: &PermitSurge,
    ) -> Result<(), String> {
        let held = self
            .store
            .held()
            .into_iter()
            .find(|h| h.workload == *workload && h.permit.uid == uid)
            .ok_or_else(|| format!("no permit of {workload} holds the move"))?;
        self.store
            .write_surge(&held.key, held.uid.as_deref(), surge)
            .await
    }

    /// The permits of this process's scope that record a scale-up not
    /// put back yet, each with it.
    pub(crate) fn surges_here(&self) -> Vec<(Held, PermitSurge)> {
        self.held_here()
            .into_iter()
            .filter_map(|h| {
                let s = self.store.surge(&h.key)?;
                (s.method == "ScaleUp" && s.restored.is_none()).then_some((h, s))
            })
            .collect()
    }

    /// The permits of this process's scope the API server holds.
    pub(crate) fn held_here(&self) -> Vec<Held> {
        self.store
            .held()
            .into_iter()
            .filter(|h| self.store.in_scope(&h.permit.machine))
            .collect()
    }

    /// The drain of the move of pod `uid` is done with it while it is not
    /// over (its replacement not healthy yet, of a kind whose availability
    /// berth does not read): its permit is kept, and the keeper judges it
    /// from now on as it judges the moves of a drain that ended (see
    /// [`Permits::sweep`]).
    pub(crate) fn linger(&self, uid: &str) {
        if let Ok(mut l) = self.lingering.lock() {
            l.insert(uid.to_string());
        }
        self.lingered.send_modify(|n| *n += 1);
    }

    /// Whether a running drain left the move of pod `uid` to the keeper.
    pub(crate) fn is_lingering(&self, uid: &str) -> bool {
        self.lingering.lock().is_ok_and(|l| l.contains(uid))
    }

    /// Bumped whenever a running drain leaves a move to the keeper.
    pub(crate) fn lingered(&self) -> watch::Receiver<u64> {
        self.lingered.subscribe()
    }

    /// The permits of this process's scope that were held at the last
    /// call and are gone now, though this process did not end them:
    /// deleted by someone else (by hand, or their workload's garbage
    /// collection). The keeper names those whose move was not over.
    pub(crate) fn vanished(&self) -> Vec<Held> {
        let now: BTreeMap<String, Held> = self
            .store
            .held()
            .into_iter()
            .filter(|h| self.store.in_scope(&h.permit.machine))
            .map(|h| (h.uid_or_name(), h))
            .collect();
        let Ok(mut seen) = self.seen.lock() else {
            return Vec::new();
        };
        let Ok(mut ended) = self.store.ended_here.lock() else {
            return Vec::new();
        };
        let gone = seen
            .iter()
            .filter(|(uid, _)| !now.contains_key(*uid) && !ended.contains(*uid))
            .map(|(_, h)| h.clone())
            .collect();
        // An end not seen yet stays until it is.
        ended.retain(|uid| now.contains_key(uid));
        *seen = now;
        gone
    }

    /// Rebuilds the ledger from the moves `machines` record, once: the
    /// caller (the first drain to start) has the synced cache of every
    /// Machine.
    pub(crate) fn rebuild_once<'m>(&self, machines: impl IntoIterator<Item = &'m Machine>) {
        self.rebuilt.get_or_init(|| {
            let records = recorded_moves(machines);
            if !records.is_empty() {
                tracing::info!(
                    moves = records.len(),
                    "move ledger rebuilt from the Machines' records"
                );
            }
            if let Ok(mut l) = self.ledger.lock() {
                *l = Ledger::rebuild(records).with_cap(self.cap);
                self.publish(&l);
            }
        });
    }

    /// Asks the ledger (see [`Ledger::ask`]) with every permit the API
    /// server holds; a grant of a bounded budget is taken there as a
    /// `MovePermit` owned by `owner` (the workload object, if known),
    /// expiring at `expires` (see [`permit_expires`]), before it is
    /// answered. A grant after a wait is counted in the time asks waited.
    pub(crate) async fn ask(
        &self,
        ask: &Ask,
        budget: &Budget,
        owner: Option<&OwnerReference>,
        expires: Timestamp,
    ) -> Answer {
        let held = self.store.held();
        let now = Timestamp::now();
        let (answer, since) = {
            let Ok(mut l) = self.ledger.lock() else {
                // A poisoned ledger cannot say who moves: nobody does until
                // the next leadership term builds a new one.
                return Answer::Contended {
                    error: Some("the move ledger is poisoned".into()),
                };
            };
            l.set_held(held.iter().map(|h| (h.workload.clone(), h.permit.clone())));
            l.set_lined(self.line.others());
            let since = l.waiting_since(&ask.workload, &ask.uid);
            let fresh = !l.holds(&ask.workload, &ask.uid);
            let answer = l.ask(ask, budget, now);
            let granted = matches!(answer, Answer::Granted(_) | Answer::Bypassed { .. });
            // Its drain begins a volume move: its other asks leave the line
            // (see `Ledger::busy`), and the drains behind them ask again.
            if fresh && granted && ask.volumes && l.busy(&ask.machine) {
                self.freed.send_modify(|n| *n += 1);
            }
            if let Ok(mut o) = self.owners.lock() {
                o.insert(ask.uid.clone(), owner.cloned());
            }
            // A grant leaves the line once its permit is taken: before,
            // another process would see neither and take the permit.
            if !granted {
                self.line_up(&l);
            }
            self.publish(&l);
            (answer, since)
        };
        let permit = match &answer {
            Answer::Granted(p) | Answer::Bypassed { permit: p, .. } => p.clone(),
            _ => return answer,
        };
        let in_store = held
            .iter()
            .any(|h| h.workload == ask.workload && h.permit.uid == ask.uid);
        if budget.max_moving.is_some() && !in_store {
            let slots = slots_of(&held, &ask.workload);
            let beyond = matches!(answer, Answer::Bypassed { .. });
            let taken = match free_slot(&slots, budget.max_moving, beyond) {
                Some(slot) => {
                    let object = permit_object(&ask.workload, &permit, slot, owner, expires);
                    self.store.take(object).await
                }
                None => Err(None),
            };
            if let Err(error) = taken {
                if let Ok(mut l) = self.ledger.lock() {
                    l.end(&ask.workload, &ask.uid);
                    self.line_up(&l);
                    self.publish(&l);
                }
                if error.is_some() {
                    self.retry_later();
                }
                return Answer::Contended { error };
            }
        }
        if let Ok(l) = self.ledger.lock() {
            self.line_up(&l);
        }
        if let Some(since) = since {
            let waited = now.duration_since(since).as_secs_f64().max(0.0);
            self.metrics
                .move_budget_wait
                .with_label_values(&[kind_label(&ask.workload)])
                .observe(waited);
        }
        answer
    }

    /// Whether [`Permits::ask`] would grant `ask` under `budget` now, as
    /// far as this process can tell (another may take the slot first):
    /// asked of a copy of the ledger, which is left as it is.
    pub(crate) fn would_grant(&self, ask: &Ask, budget: &Budget) -> bool {
        let held = self.store.held();
        let Ok(l) = self.ledger.lock() else {
            return false;
        };
        let mut l = l.clone();
        l.set_held(held.into_iter().map(|h| (h.workload, h.permit)));
        matches!(
            l.ask(ask, budget, Timestamp::now()),
            Answer::Granted(_) | Answer::Bypassed { .. }
        )
    }

    /// Wakes the drains that wait after [`RETRY_WRITE_AFTER`].
    fn retry_later(&self) {
        let freed = Arc::clone(&self.freed);
        tokio::spawn(async move {
            tokio::time::sleep(RETRY_WRITE_AFTER).await;
            freed.send_modify(|n| *n += 1);
        });
    }

    /// The cap on moves in flight, if there is one.
    pub(crate) fn cap(&self) -> Option<usize> {
        self.cap
    }

    /// The move of `uid` ended (or never began): its permit is free, here
    /// and in the API server.
    pub(crate) fn end(&self, workload: &Workload, uid: &str) {
        let stored = self
            .store
            .end(|h| h.workload == *workload && h.permit.uid == uid);
        let ended = self.ledger.lock().is_ok_and(|mut l| {
            let ended = l.end(workload, uid);
            self.publish_fresh(&mut l);
            ended
        });
        if ended || stored > 0 {
            self.freed.send_modify(|n| *n += 1);
        }
    }

    /// Ends the moves of `machine` its drain does not record (`keep`: the
    /// UIDs it does).
    fn release_machine(&self, machine: &str, keep: &[String]) {
        // Its waiting asks go too; a wake for them costs one pass of each
        // waiting drain, at a drain's end.
        let stored = self
            .store
            .end(|h| h.permit.machine == machine && !keep.contains(&h.permit.uid));
        let ended = self
            .ledger
            .lock()
            .map(|mut l| {
                let ended = l.release_machine(machine, keep);
                self.line_up(&l);
                self.publish_fresh(&mut l);
                ended
            })
            .unwrap_or(0);
        if ended + stored > 0 {
            self.freed.send_modify(|n| *n += 1);
        }
    }

    /// Ends the moves of `machine` whose move `done` says is over (it never
    /// began, or its workload is whole again) and withdraws its asks: what
    /// a Machine whose drain is over or that is gone held. The others keep
    /// their permits, here and in the API server, until a later call finds
    /// them done.
    pub(crate) fn release_done(&self, machine: &str, done: impl Fn(&Workload, &Permit) -> bool) {
        let mut keep: Vec<String> = self
            .ledger
            .lock()
            .map(|l| {
                l.moves()
                    .into_iter()
                    .filter(|(w, p)| p.machine == machine && !done(w, p))
                    .map(|(_, p)| p.uid)
                    .collect()
            })
            .unwrap_or_default();
        keep.extend(
            self.store
                .held()
                .into_iter()
                .filter(|h| h.permit.machine == machine && !done(&h.workload, &h.permit))
                .map(|h| h.permit.uid),
        );
        self.release_machine(machine, &keep);
    }

    /// Judges the moves of every Machine of this process's scope whose
    /// drain no longer watches them (`idle`: the drain ended, or the
    /// Machine is gone, its VM with it): ends those whose move `done` says
    /// is over, those past their healthy deadline (returned, for a Warning
    /// each), and those kept in this process only (a workload without a
    /// bound: once its drain is over its move holds no one's budget). The
    /// others keep their permits; says when the first of those expires. A
    /// Machine of another scope is another process's to judge.
    pub(crate) fn sweep(
        &self,
        idle: impl Fn(&str) -> bool,
        done: impl Fn(&Workload, &Permit) -> bool,
        now: Timestamp,
    ) -> Swept {
        let held = self.store.held();
        let mut machines: BTreeSet<String> = self
            .ledger
            .lock()
            .map(|l| l.machines().into_iter().collect())
            .unwrap_or_default();
        machines.extend(held.iter().map(|h| h.permit.machine.clone()));
        machines.retain(|m| self.store.in_scope(m) && idle(m));
        let mut swept = Swept::default();
        // The moves running drains left to the keeper: each judged alone,
        // the drain's other permits are its own.
        let lingering: BTreeSet<String> = self
            .lingering
            .lock()
            .map(|mut l| {
                l.retain(|uid| held.iter().any(|h| h.permit.uid == *uid));
                l.clone()
            })
            .unwrap_or_default();
        for h in held
            .iter()
            .filter(|h| lingering.contains(&h.permit.uid) && !machines.contains(&h.permit.machine))
        {
            if done(&h.workload, &h.permit) {
                self.end(&h.workload, &h.permit.uid);
                continue;
            }
            match h.expires {
                Some(at) if at <= now => {
                    swept.expired.push(h.clone());
                    self.end(&h.workload, &h.permit.uid);
                }
                at => swept.next = earliest(swept.next, at),
            }
        }
        for machine in machines {
            let mut keep = Vec::new();
            for h in held.iter().filter(|h| h.permit.machine == machine) {
                if done(&h.workload, &h.permit) {
                    continue;
                }
                match h.expires {
                    Some(at) if at <= now => swept.expired.push(h.clone()),
                    at => {
                        swept.next = earliest(swept.next, at);
                        keep.push(h.permit.uid.clone());
                    }
                }
            }
            self.release_machine(&machine, &keep);
        }
        swept
    }

    /// `machine` waits for permits for the pods `uids` only, as its last
    /// pass asked (see [`Ledger::keep_waiting`]).
    /// Only a withdrawal wakes the drains that wait: asking again for
    /// the same pods frees nothing.
    pub(crate) fn keep_waiting(&self, machine: &str, uids: &[String]) {
        let withdrawn = self
            .ledger
            .lock()
            .map(|mut l| {
                let withdrawn = l.keep_waiting(machine, uids);
                self.line_up(&l);
                withdrawn
            })
            .unwrap_or(0);
        if withdrawn > 0 {
            self.freed.send_modify(|n| *n += 1);
        }
    }

    /// Puts in line in the API server this process's asks in line in `l`
    /// (see [`Ledger::lined`]), each owned as its ask said; the owners of
    /// asks that no longer wait are forgotten.
    fn line_up(&self, l: &Ledger) {
        let Ok(mut owners) = self.owners.lock() else {
            return;
        };
        owners.retain(|uid, _| l.is_waiting(uid));
        let lined = l
            .lined()
            .into_iter()
            .map(|(w, a)| {
                let owner = owners.get(&a.uid).cloned().flatten();
                (w, a, owner)
            })
            .collect();
        self.line.want(lined);
    }

    /// Keeps this process's asks in line in the API server for as long as
    /// it leads (see `line`): parked, renewed, taken out. The drains that
    /// wait are woken when another process's ask leaves the line.
    pub(crate) async fn keep_line(&self) {
        self.line.keep(|| self.freed.send_modify(|n| *n += 1)).await;
    }

    /// Bumped whenever a permit of this process may have freed (the
    /// permits' watch says when another process's did).
    pub(crate) fn freed(&self) -> watch::Receiver<u64> {
        self.freed.subscribe()
    }

    /// Publishes the moves in flight with the permits the API server holds
    /// now (the ledger's copy of them is otherwise the last ask's: the
    /// gauge kept counting permits ended since).
    fn publish_fresh(&self, l: &mut Ledger) {
        l.set_held(
            self.store
                .held()
                .into_iter()
                .map(|h| (h.workload, h.permit)),
        );
        self.publish(l);
    }

    /// Brings the metrics of the moves in flight up to date with the
    /// permits the API server holds (another process's ended, say).
    pub(crate) fn refresh(&self) {
        if let Ok(mut l) = self.ledger.lock() {
            self.publish_fresh(&mut l);
        }
    }

    /// The moves in flight per workload kind, for the metrics.
    fn publish(&self, l: &Ledger) {
        let gauge = &self.metrics.volume_moves_in_flight;
        let by_kind = by_kind(&l.moves());
        for kind in WORKLOAD_KINDS {
            gauge
                .with_label_values(&[kind])
                .set(by_kind.get(kind).copied().unwrap_or(0));
        }
    }
}

/// The moves of volumes among `moves`, counted by workload kind label.
fn by_kind(moves: &[(Workload, Permit)]) -> BTreeMap<&'static str, i64> {
    let mut by_kind = BTreeMap::new();
    for (w, _) in moves.iter().filter(|(_, p)| p.volumes) {
        *by_kind.entry(kind_label(w)).or_default() += 1;
    }
    by_kind
}

/// What [`Permits::sweep`] found: the permits it ended at their healthy
/// deadline, and when the first of those it kept expires.
#[derive(Debug, Default)]
pub(crate) struct Swept {
    pub(crate) expired: Vec<Held>,
    pub(crate) next: Option<Timestamp>,
}

/// The slots of `workload` among `held` (the permits held now: one ended
/// here is taken again once its deletion is done, see
/// [`PermitStore::take`]).
fn slots_of(held: &[Held], workload: &Workload) -> BTreeSet<u32> {
    held.iter()
        .filter(|h| h.workload == *workload)
        .filter_map(|h| slot_of(&h.key.1))
        .collect()
}

/// The slot of a permit's name (`<kind>.<name>.<slot>`).
fn slot_of(name: &str) -> Option<u32> {
    name.rsplit_once('.')?.1.parse().ok()
}

/// The lowest slot not in `taken`: below `budget` (`None`: unbounded)
/// unless `beyond` (a drain past its deadline), where any slot will do.
fn free_slot(taken: &BTreeSet<u32>, budget: Option<u32>, beyond: bool) -> Option<u32> {
    let limit = if beyond { None } else { budget };
    (0..limit.unwrap_or(u32::MAX)).find(|s| !taken.contains(s))
}

/// The `MovePermit` of `permit`, of `workload`, in `slot`, owned by
/// `owner`, expiring at `expires`.
fn permit_object(
    workload: &Workload,
    permit: &Permit,
    slot: u32,
    owner: Option<&OwnerReference>,
    expires: Timestamp,
) -> MovePermit {
    let pod = permit
        .pod
        .split_once('/')
        .map_or(permit.pod.as_str(), |(_, name)| name);
    MovePermit {
        metadata: ledger_meta(
            workload,
            permit_name(&workload.kind, &workload.name, slot),
            owner,
        ),
        spec: MovePermitSpec {
            workload: workload_name(workload),
            pod: pod.to_string(),
            pod_uid: permit.uid.clone(),
            machine: permit.machine.clone(),
            since: Time(permit.since),
            past_budget: permit.past_budget,
            volumes: permit.volumes,
            expires: Some(Time(expires)),
            attach: permit.attach.clone(),
            destination: permit.destination.clone(),
            surge: None,
        },
    }
}

/// The earlier of two times, either of which may be unknown.
pub(crate) fn earliest(a: Option<Timestamp>, b: Option<Timestamp>) -> Option<Timestamp> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The `kind` label of `w` (see [`WORKLOAD_KINDS`]).
pub(crate) fn kind_label(w: &Workload) -> &'static str {
    WORKLOAD_KINDS
        .iter()
        .find(|k| **k == w.kind && **k != "other")
        .copied()
        .unwrap_or("other")
}

/// A workload as a move record names it, `Kind/name` (its namespace is the
/// pod's).
pub(crate) fn workload_name(w: &Workload) -> String {
    format!("{}/{}", w.kind, w.name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::ledger::store::held_of;
    use kube::Client;

    /// An empty line that is never written.
    fn no_line() -> AskStore {
        let client = Client::try_from(kube::Config::new(
            "https://127.0.0.1:1".parse().expect("a uri"),
        ))
        .expect("a client that is never reached");
        let (cache, _) = kube::runtime::reflector::store();
        AskStore::new(client, cache, watch::channel(0).1, Some("db".into()))
    }

    fn permit(pod: &str, machine: &str) -> Permit {
        Permit {
            pod: format!("db/{pod}"),
            uid: format!("uid-{pod}"),
            machine: machine.into(),
            since: Timestamp::from_second(1_700_000_000).expect("time"),
            past_budget: false,
            volumes: true,
            attach: vec![],
            destination: None,
        }
    }

    #[test]
    fn a_permit_object_says_whose_move_holds_it_and_reads_back_the_same() {
        let db = Workload::new("StatefulSet", "db", "pg");
        let owner = OwnerReference {
            api_version: "apps/v1".into(),
            kind: "StatefulSet".into(),
            name: "pg".into(),
            uid: "uid-pg".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        };
        let p = permit("pg-0", "pool/a");
        let expires = Timestamp::from_second(1_700_007_200).expect("time");
        let mut o = permit_object(&db, &p, 0, Some(&owner), expires);
        assert_eq!(o.metadata.name.as_deref(), Some("statefulset.pg.0"));
        assert_eq!(o.metadata.namespace.as_deref(), Some("db"));
        let owners = o.metadata.owner_references.clone().expect("owned");
        assert_eq!(owners[0].uid, "uid-pg");
        assert_eq!(
            (owners[0].controller, owners[0].block_owner_deletion),
            (None, None),
            "neither controls nor blocks its workload"
        );
        assert_eq!(
            (o.spec.workload.as_str(), o.spec.pod.as_str()),
            ("StatefulSet/pg", "pg-0")
        );
        o.metadata.uid = Some("uid-permit".into());
        let held = held_of(&o).expect("reads back");
        assert_eq!(held.workload, db);
        assert_eq!(held.permit, p);
        assert_eq!(held.key, ("db".to_string(), "statefulset.pg.0".to_string()));
        assert_eq!(held.uid.as_deref(), Some("uid-permit"));
        assert_eq!(held.expires, Some(expires));
        assert_eq!(held.regarding().name.as_deref(), Some("pg"), "its workload");
        assert_eq!(slot_of("statefulset.pg.12"), Some(12));
        assert_eq!(slot_of("statefulset.pg"), None);
        // Without a known owner it is owned by nothing (a bare pod's).
        assert!(
            permit_object(&db, &p, 1, None, expires)
                .metadata
                .owner_references
                .is_none()
        );
    }

    /// The next move of a workload takes the slot its last move ended: the
    /// permits are told apart by UID, so the one ended is not counted and
    /// the new one of the same name is, whatever the cache shows yet.
    #[tokio::test]
    async fn a_slot_ended_and_taken_again_is_counted_once_by_its_new_permit() {
        use kube::runtime::watcher::Event;
        let (cache, mut writer) = kube::runtime::reflector::store::<MovePermit>();
        let client = Client::try_from(kube::Config::new(
            "https://127.0.0.1:1".parse().expect("a uri"),
        ))
        .expect("a client that is never reached");
        let store = PermitStore::new(client, cache, None);
        let db = Workload::new("StatefulSet", "db", "pg");
        let object = |pod: &str, uid: &str| {
            let at = Timestamp::from_second(1_700_007_200).expect("time");
            let mut o = permit_object(&db, &permit(pod, "db/a"), 0, None, at);
            o.metadata.uid = Some(uid.into());
            o
        };
        let first = object("pg-0", "u1");
        writer.apply_watcher_event(&Event::Apply(first.clone()));
        assert_eq!(slots_of(&store.held(), &db), BTreeSet::from([0]));
        // Its move ends: gone here at once, its deletion on its way.
        assert_eq!(store.end(|h| h.permit.pod == "db/pg-0"), 1);
        assert!(store.held().is_empty());
        assert!(
            slots_of(&store.held(), &db).is_empty(),
            "slot 0 is free again"
        );
        // The next move takes slot 0 before the cache has seen the first
        // go: the new permit counts, the old one does not.
        let second = object("pg-1", "u2");
        if let Ok(mut t) = store.taken.lock() {
            t.insert("u2".into(), second.clone());
        }
        let held: Vec<String> = store.held().into_iter().map(|h| h.permit.pod).collect();
        assert_eq!(held, ["db/pg-1"]);
        // The cache catches up: still the one permit, and it ends.
        writer.apply_watcher_event(&Event::Delete(first));
        writer.apply_watcher_event(&Event::Apply(second));
        let held: Vec<String> = store.held().into_iter().map(|h| h.permit.pod).collect();
        assert_eq!(held, ["db/pg-1"]);
        assert_eq!(store.end(|h| h.permit.pod == "db/pg-1"), 1);
        assert!(store.held().is_empty());
    }

    /// A permit gone without this process ending it (deleted by hand) is
    /// told from one it ended, once; another scope's is not its to name.
    #[tokio::test]
    async fn a_permit_deleted_by_someone_else_is_told_from_one_ended_here() {
        use kube::runtime::watcher::Event;
        let (cache, mut writer) = kube::runtime::reflector::store::<MovePermit>();
        let client = Client::try_from(kube::Config::new(
            "https://127.0.0.1:1".parse().expect("a uri"),
        ))
        .expect("a client that is never reached");
        let store = PermitStore::new(client, cache, Some("db".into()));
        let permits = Permits::new(
            None,
            Arc::new(Metrics::new().expect("metrics")),
            store,
            no_line(),
        );
        let object = |name: &str, pod: &str, machine: &str, uid: &str| {
            let at = Timestamp::from_second(1_700_000_000).expect("time");
            let w = Workload::new("StatefulSet", "db", name);
            let mut o = permit_object(&w, &permit(pod, machine), 0, None, at);
            o.metadata.uid = Some(uid.into());
            o
        };
        let (by_hand, ended, other) = (
            object("a", "a-0", "db/m1", "u1"),
            object("b", "b-0", "db/m1", "u2"),
            object("c", "c-0", "other/m2", "u3"),
        );
        for o in [&by_hand, &ended, &other] {
            writer.apply_watcher_event(&Event::Apply(o.clone()));
        }
        assert!(permits.vanished().is_empty(), "nothing gone yet");
        // One ended here, one deleted by hand, one of another scope deleted.
        assert_eq!(permits.store.end(|h| h.permit.pod == "db/b-0"), 1);
        for o in [&by_hand, &ended, &other] {
            writer.apply_watcher_event(&Event::Delete(o.clone()));
        }
        let gone: Vec<String> = permits
            .vanished()
            .into_iter()
            .map(|h| h.permit.pod)
            .collect();
        assert_eq!(gone, ["db/a-0"]);
        assert!(permits.vanished().is_empty(), "named once");
    }

    /// The permits of Machines whose drain no longer watches them: ended
    /// when their move is over or past their healthy deadline (named),
    /// kept otherwise, with the first expiry to wake at; a drain that
    /// still runs, or a Machine of another scope, is not judged.
    #[tokio::test]
    async fn a_permit_left_by_its_drain_ends_when_its_workload_is_whole_or_it_expires() {
        use kube::runtime::watcher::Event;
        let (cache, mut writer) = kube::runtime::reflector::store::<MovePermit>();
        let client = Client::try_from(kube::Config::new(
            "https://127.0.0.1:1".parse().expect("a uri"),
        ))
        .expect("a client that is never reached");
        let at = |s: i64| Timestamp::from_second(1_700_000_000 + s).expect("time");
        let object = |name: &str, pod: &str, machine: &str, expires: i64| {
            let w = Workload::new("StatefulSet", "db", name);
            let mut o = permit_object(&w, &permit(pod, machine), 0, None, at(expires));
            o.metadata.uid = Some(format!("uid-{name}"));
            o
        };
        for o in [
            object("whole", "whole-0", "db/gone", 600),
            object("late", "late-0", "db/gone", 100),
            object("slow", "slow-0", "db/ended", 900),
            object("later", "later-0", "db/ended", 700),
            object("busy", "busy-0", "db/running", 100),
            object("theirs", "theirs-0", "other/gone", 100),
        ] {
            writer.apply_watcher_event(&Event::Apply(o));
        }
        let store = PermitStore::new(client, cache, Some("db".into()));
        let metrics = Arc::new(Metrics::new().expect("metrics"));
        let permits = Permits::new(None, Arc::clone(&metrics), store, no_line());
        let swept = permits.sweep(|m| m != "db/running", |w, _| w.name == "whole", at(300));
        let expired: Vec<&str> = swept
            .expired
            .iter()
            .map(|h| h.permit.pod.as_str())
            .collect();
        assert_eq!(expired, ["db/late-0"]);
        assert_eq!(swept.next, Some(at(700)), "the first kept permit to expire");
        let mut left: Vec<String> = permits
            .store
            .held()
            .into_iter()
            .map(|h| h.permit.pod)
            .collect();
        left.sort();
        assert_eq!(
            left,
            ["db/busy-0", "db/later-0", "db/slow-0", "db/theirs-0"],
            "whole and late ended; a running drain's and another scope's untouched"
        );
        // The gauge counts the permits held now, not those of the last ask.
        let in_flight = metrics
            .volume_moves_in_flight
            .with_label_values(&["StatefulSet"])
            .get();
        assert_eq!(in_flight, 4);
    }

    #[test]
    fn a_permit_takes_the_lowest_free_slot_of_its_budget() {
        let taken = |s: &[u32]| s.iter().copied().collect::<BTreeSet<u32>>();
        assert_eq!(free_slot(&taken(&[]), Some(1), false), Some(0));
        assert_eq!(free_slot(&taken(&[0]), Some(1), false), None);
        assert_eq!(free_slot(&taken(&[0, 2]), Some(3), false), Some(1));
        // Past the deadline, beyond the budget.
        assert_eq!(free_slot(&taken(&[0]), Some(1), true), Some(1));
        assert_eq!(free_slot(&taken(&[1]), Some(1), true), Some(0));
        // A budget lowered while its permits are held: the high slots still
        // exist and count; no slot below the new budget is free.
        assert_eq!(free_slot(&taken(&[0, 1]), Some(1), false), None);
    }

    #[test]
    fn moves_of_volumes_are_counted_by_workload_kind() {
        let moves = vec![
            (
                Workload::new("StatefulSet", "db", "pg"),
                permit("pg-0", "a"),
            ),
            (
                Workload::new("CustomDatabase", "db", "x"),
                permit("x-0", "a"),
            ),
            (
                Workload::new("Deployment", "db", "web"),
                Permit {
                    volumes: false,
                    ..permit("web-0", "a")
                },
            ),
        ];
        let counted = by_kind(&moves);
        assert_eq!(counted.get("StatefulSet"), Some(&1));
        assert_eq!(counted.get("other"), Some(&1));
        assert_eq!(counted.get("Deployment"), None, "no volumes");
    }
}
