//! The move ledger of this controller process, shared by every drain (one
//! per leadership term: a new leader starts with a new one).
//!
//! The decisions are the pure [`Ledger`]'s; this holds it behind a lock,
//! rebuilds it from the moves every Machine recorded in `status.drain.moves`
//! before the first drain asks anything (a restart or a new leader finds
//! the moves in flight there), tells the drains that wait when a move ends
//! or an ask is withdrawn, so that they ask again, and keeps the metrics of
//! the moves in flight and of the time asks waited.

use std::sync::{Arc, Mutex, OnceLock};

use k8s_openapi::jiff::Timestamp;
use tokio::sync::watch;

use crate::api::Machine;
use crate::drain::ledger::{Answer, Ask, Budget, Ledger, Workload, recorded_moves};
use crate::telemetry::{Metrics, WORKLOAD_KINDS};

pub(crate) struct Permits {
    ledger: Mutex<Ledger>,
    /// The cap on moves in flight, of every workload together.
    cap: Option<usize>,
    /// Bumped on every end and withdrawal: a waiting drain asks again.
    freed: watch::Sender<u64>,
    /// Set once the ledger was rebuilt from the Machines' records.
    rebuilt: OnceLock<()>,
    metrics: Arc<Metrics>,
}

impl Permits {
    /// An empty ledger whose moves in flight are at most `cap` (`None`: no
    /// cap), until it is rebuilt.
    pub(crate) fn new(cap: Option<usize>, metrics: Arc<Metrics>) -> Self {
        Self {
            ledger: Mutex::new(Ledger::default().with_cap(cap)),
            cap,
            freed: watch::channel(0).0,
            rebuilt: OnceLock::new(),
            metrics,
        }
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

    /// Asks the ledger (see [`Ledger::ask`]); a grant after a wait is
    /// counted in the time asks waited.
    pub(crate) fn ask(&self, ask: &Ask, budget: &Budget) -> Answer {
        let Ok(mut l) = self.ledger.lock() else {
            // A poisoned ledger cannot say who moves: nobody does until the
            // next leadership term builds a new one.
            return Answer::Wait {
                moving: Vec::new(),
                ahead: Vec::new(),
                degraded: 0,
            };
        };
        let now = Timestamp::now();
        let since = l.waiting_since(&ask.workload, &ask.uid);
        let answer = l.ask(ask, budget, now);
        if let (Answer::Granted(_) | Answer::Bypassed { .. }, Some(since)) = (&answer, since) {
            let waited = now.duration_since(since).as_secs_f64().max(0.0);
            self.metrics
                .move_budget_wait
                .with_label_values(&[kind_label(&ask.workload)])
                .observe(waited);
        }
        self.publish(&l);
        answer
    }

    /// The cap on moves in flight, if there is one.
    pub(crate) fn cap(&self) -> Option<usize> {
        self.cap
    }

    /// The move of `uid` ended (or never began): its permit is free.
    pub(crate) fn end(&self, workload: &Workload, uid: &str) {
        let ended = self.ledger.lock().is_ok_and(|mut l| {
            let ended = l.end(workload, uid);
            self.publish(&l);
            ended
        });
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
            .map(|mut l| {
                let ended = l.release_machine(machine, keep);
                self.publish(&l);
                ended
            })
            .unwrap_or(0);
        if ended > 0 {
            self.freed.send_modify(|n| *n += 1);
        }
    }

    /// Ends the moves and withdraws the asks of every Machine that no
    /// longer `exists` (deleted while its drain held a permit: its finalizer
    /// removed by hand, or the object gone while this process was away).
    pub(crate) fn release_vanished(&self, exists: impl Fn(&str) -> bool) {
        let gone: Vec<String> = self
            .ledger
            .lock()
            .map(|l| l.machines().into_iter().filter(|m| !exists(m)).collect())
            .unwrap_or_default();
        for machine in gone {
            tracing::info!(%machine, "the Machine is gone: its moves' permits are free");
            self.release_machine(&machine, &[]);
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

    /// The moves in flight per workload kind, for the metrics.
    fn publish(&self, l: &Ledger) {
        let gauge = &self.metrics.volume_moves_in_flight;
        let mut by_kind: std::collections::BTreeMap<&str, i64> = Default::default();
        for (w, _) in l.moves().filter(|(_, p)| p.volumes) {
            *by_kind.entry(kind_label(w)).or_default() += 1;
        }
        for kind in WORKLOAD_KINDS {
            gauge
                .with_label_values(&[kind])
                .set(by_kind.get(kind).copied().unwrap_or(0));
        }
    }
}

/// The `kind` label of `w` (see [`WORKLOAD_KINDS`]).
fn kind_label(w: &Workload) -> &'static str {
    WORKLOAD_KINDS
        .iter()
        .find(|k| **k == w.kind && **k != "other")
        .copied()
        .unwrap_or("other")
}

/// A workload as a move record names it, `Kind/name` (its namespace is the
/// pod's).
pub(super) fn workload_name(w: &Workload) -> String {
    format!("{}/{}", w.kind, w.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(pod: &str, kind: &str, machine: &str) -> Ask {
        Ask {
            workload: Workload::new(kind, "ns", "w"),
            pod: format!("ns/{pod}"),
            uid: format!("uid-{pod}"),
            machine: format!("ns/{machine}"),
            priority: 0,
            requested: Timestamp::UNIX_EPOCH,
            past_deadline: false,
            volumes: true,
            unavailable: 0,
        }
    }

    #[test]
    fn a_vanished_machine_frees_its_permits_and_wakes_the_waiting() {
        let metrics = Arc::new(Metrics::new().expect("metrics"));
        let permits = Permits::new(Some(10), Arc::clone(&metrics));
        let mut freed = permits.freed();
        let one = Budget::default_for(true);
        let gauge = |kind: &str| {
            metrics
                .volume_moves_in_flight
                .with_label_values(&[kind])
                .get()
        };
        assert!(matches!(
            permits.ask(&ask("db-0", "StatefulSet", "a"), &one),
            Answer::Granted(_)
        ));
        assert!(matches!(
            permits.ask(&ask("x-0", "CustomDatabase", "a"), &one),
            Answer::Granted(_)
        ));
        assert_eq!((gauge("StatefulSet"), gauge("other")), (1, 1));
        assert!(matches!(
            permits.ask(&ask("db-1", "StatefulSet", "b"), &one),
            Answer::Wait { .. }
        ));
        freed.borrow_and_update();
        // Machine b still exists: nothing changes.
        permits.release_vanished(|m| m != "ns/c");
        assert!(!freed.has_changed().expect("open"));
        // Machine a is gone: its permits are free, the waiting drain is
        // woken, and db-1 goes, counted as having waited.
        permits.release_vanished(|m| m != "ns/a");
        assert!(freed.has_changed().expect("open"));
        assert_eq!((gauge("StatefulSet"), gauge("other")), (0, 0));
        assert!(matches!(
            permits.ask(&ask("db-1", "StatefulSet", "b"), &one),
            Answer::Granted(_)
        ));
        let waited = metrics
            .move_budget_wait
            .with_label_values(&["StatefulSet"])
            .get_sample_count();
        assert_eq!(waited, 1);
    }
}
