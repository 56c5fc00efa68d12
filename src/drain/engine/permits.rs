//! The move ledger of this controller process, shared by every drain (one
//! per leadership term: a new leader starts with a new one).
//!
//! The decisions are the pure [`Ledger`]'s; this holds it behind a lock,
//! rebuilds it from the moves every Machine recorded in `status.drain.moves`
//! before the first drain asks anything (a restart or a new leader finds
//! the moves in flight there), and tells the drains that wait when a move
//! ends or an ask is withdrawn, so that they ask again.

use std::sync::{Mutex, OnceLock};

use k8s_openapi::jiff::Timestamp;
use tokio::sync::watch;

use crate::api::{Machine, VolumeMove};
use crate::drain::ledger::{Answer, Ask, Budget, Ledger, Permit, Workload};

pub(crate) struct Permits {
    ledger: Mutex<Ledger>,
    /// Bumped on every end and withdrawal: a waiting drain asks again.
    freed: watch::Sender<u64>,
    /// Set once the ledger was rebuilt from the Machines' records.
    rebuilt: OnceLock<()>,
}

impl Default for Permits {
    fn default() -> Self {
        Self {
            ledger: Mutex::new(Ledger::default()),
            freed: watch::channel(0).0,
            rebuilt: OnceLock::new(),
        }
    }
}

impl Permits {
    /// Rebuilds the ledger from the moves `machines` record, once: the
    /// caller (the first drain to start) has the synced cache of every
    /// Machine.
    pub(crate) fn rebuild_once<'m>(&self, machines: impl IntoIterator<Item = &'m Machine>) {
        self.rebuilt.get_or_init(|| {
            let records: Vec<(Workload, Permit)> = machines
                .into_iter()
                .flat_map(|m| {
                    let machine = format!(
                        "{}/{}",
                        m.metadata.namespace.as_deref().unwrap_or_default(),
                        m.metadata.name.as_deref().unwrap_or_default()
                    );
                    let moves = m
                        .status
                        .as_ref()
                        .and_then(|s| s.drain.as_ref())
                        .map(|d| d.moves.clone())
                        .unwrap_or_default();
                    moves
                        .into_iter()
                        .filter_map(move |mv| recorded(&machine, &mv))
                })
                .collect();
            if !records.is_empty() {
                tracing::info!(
                    moves = records.len(),
                    "move ledger rebuilt from the Machines' records"
                );
            }
            if let Ok(mut l) = self.ledger.lock() {
                *l = Ledger::rebuild(records);
            }
        });
    }

    /// Asks the ledger (see [`Ledger::ask`]).
    pub(crate) fn ask(&self, ask: &Ask, budget: &Budget) -> Answer {
        match self.ledger.lock() {
            Ok(mut l) => l.ask(ask, budget, Timestamp::now()),
            // A poisoned ledger cannot say who moves: nobody does until the
            // next leadership term builds a new one.
            Err(_) => Answer::Wait {
                moving: Vec::new(),
                ahead: Vec::new(),
            },
        }
    }

    /// The move of `uid` ended (or never began): its permit is free.
    pub(crate) fn end(&self, workload: &Workload, uid: &str) {
        let ended = self.ledger.lock().is_ok_and(|mut l| l.end(workload, uid));
        if ended {
            self.freed.send_modify(|n| *n += 1);
        }
    }

    /// Ends the moves of `machine` its drain does not record (`keep`: the
    /// UIDs it does).
    pub(crate) fn release_machine(&self, machine: &str, keep: &[String]) {
        // Its waiting asks go too; a wake for them costs one pass of each
        // waiting drain, at a drain's end.
        let ended = self
            .ledger
            .lock()
            .map(|mut l| l.release_machine(machine, keep))
            .unwrap_or(0);
        if ended > 0 {
            self.freed.send_modify(|n| *n += 1);
        }
    }

    /// `machine` waits for permits for the pods `uids` only, as its last
    /// pass asked (see [`Ledger::keep_waiting`]).
    /// Only a withdrawal wakes the drains that wait: asking again for
    /// the same pods frees nothing.
    pub(crate) fn keep_waiting(&self, machine: &str, uids: &[String]) {
        let withdrawn = self
            .ledger
            .lock()
            .map(|mut l| l.keep_waiting(machine, uids))
            .unwrap_or(0);
        if withdrawn > 0 {
            self.freed.send_modify(|n| *n += 1);
        }
    }

    /// Bumped whenever a permit may have freed.
    pub(crate) fn freed(&self) -> watch::Receiver<u64> {
        self.freed.subscribe()
    }
}

/// The workload and permit of a move `machine` recorded.
fn recorded(machine: &str, mv: &VolumeMove) -> Option<(Workload, Permit)> {
    let (ns, _) = mv.pod.split_once('/')?;
    let workload = workload_of_record(ns, mv)?;
    Some((
        workload,
        Permit {
            pod: mv.pod.clone(),
            uid: mv.uid.clone().unwrap_or_else(|| mv.pod.clone()),
            machine: machine.to_string(),
            since: mv.since.as_ref().map_or_else(Timestamp::now, |t| t.0),
            past_budget: false,
        },
    ))
}

/// The workload a move record names (`Kind/name`, in the pod's
/// namespace): its `workload`, else its controller, else the pod itself.
pub(crate) fn workload_of_record(ns: &str, mv: &VolumeMove) -> Option<Workload> {
    let named = mv.workload.as_deref().or(mv.controller.as_deref());
    match named.and_then(|w| w.split_once('/')) {
        Some((kind, name)) => Some(Workload::new(kind, ns, name)),
        None => {
            let (_, pod) = mv.pod.split_once('/')?;
            Some(Workload::new("Pod", ns, pod))
        }
    }
}

/// A workload as a move record names it, `Kind/name` (its namespace is the
/// pod's).
pub(super) fn workload_name(w: &Workload) -> String {
    format!("{}/{}", w.kind, w.name)
}
