//! The ledger's decisions: which pod of a workload may begin to move now,
//! across every drain, given the moves in flight (this process's and the
//! permits the API server holds), the asks that wait and the cap on moves
//! in flight. Pure: [`Ledger`] is told what the API server holds (the
//! permits, and the asks of other processes in line) and asked; the
//! process's `Permits` keep it and write its permits and its asks in line.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::jiff::Timestamp;

use super::{Answer, Ask, Budget, Permit, Workload};

/// An ask of another berth process parked in line, as its `MoveAsk` says
/// it: it holds its place until `expires` (its process renews it while it
/// waits; one whose process died is passed by).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lined {
    pub ask: Ask,
    pub expires: Timestamp,
}

/// An ask that waits, since when, and whether its drain is parked on it:
/// done with its pass and waiting for a permit to free (see
/// [`Ledger::keep_waiting`]). Only a parked ask holds its place in line: a
/// drain busy elsewhere (a PodDisruptionBudget, a long chain of moves)
/// would keep a freed permit idle until its pass ends.
#[derive(Debug, Clone)]
struct Waiting {
    ask: Ask,
    since: Timestamp,
    parked: bool,
    /// Parked once and still waiting: other processes see it in line (its
    /// `MoveAsk`) until it is granted or withdrawn, through the passes its
    /// drain makes when woken.
    lined: bool,
}

/// Every move in flight and every ask waiting, by workload.
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    /// By workload, then by pod UID: the moves this process granted or
    /// rebuilt.
    moving: BTreeMap<Workload, BTreeMap<String, Permit>>,
    /// By workload, then by pod UID: the permits the API server holds, of
    /// every process, as last [set](Ledger::set_held). A move in both is
    /// counted once.
    held: BTreeMap<Workload, BTreeMap<String, Permit>>,
    /// By workload, then by pod UID.
    waiting: BTreeMap<Workload, BTreeMap<String, Waiting>>,
    /// By workload: the asks of other processes in line, as last
    /// [set](Ledger::set_lined).
    others: BTreeMap<Workload, Vec<Lined>>,
    /// The most moves in flight at once, of every workload together
    /// (`None`: no cap).
    cap: Option<usize>,
}

impl Ledger {
    /// A ledger whose moves in flight, of every workload together, are at
    /// most `cap` (`None`: no cap), but past a drain's deadline.
    pub fn with_cap(mut self, cap: Option<usize>) -> Self {
        self.cap = cap;
        self
    }

    /// The ledger of the moves recorded in the Machines' status (each with
    /// its workload), as a new leader finds them.
    pub fn rebuild(records: impl IntoIterator<Item = (Workload, Permit)>) -> Self {
        let mut ledger = Self::default();
        for (workload, permit) in records {
            ledger
                .moving
                .entry(workload)
                .or_default()
                .insert(permit.uid.clone(), permit);
        }
        ledger
    }

    /// Answers `ask` under `budget`, at `now`. A pod that already holds a
    /// permit gets it again; otherwise it is granted when a permit of the
    /// budget is free, no ask better ordered waits for it (a parked ask of
    /// this process, or another process's in line and not expired), and
    /// the cap on moves in flight has room.
    pub fn ask(&mut self, ask: &Ask, budget: &Budget, now: Timestamp) -> Answer {
        if let Some(p) = self.permit_of(&ask.workload, &ask.uid) {
            return Answer::Granted(p.clone());
        }
        let moving = self.moving_of(&ask.workload);
        // Replicas down whatever took them down: berth's moves, or more
        // when its owner counts more unavailable.
        let down = moving.len().max(ask.unavailable as usize);
        let degraded = u32::try_from(down - moving.len()).unwrap_or(u32::MAX);
        let free = budget
            .max_moving
            .map_or(usize::MAX, |n| (n as usize).saturating_sub(down));
        let ahead = self.ahead_of(ask, now);
        let in_flight = self.in_flight();
        let capped = self.cap.filter(|cap| ask.volumes && in_flight >= *cap);
        let grant = |past_budget: bool| Permit {
            pod: ask.pod.clone(),
            uid: ask.uid.clone(),
            machine: ask.machine.clone(),
            since: now,
            past_budget,
            volumes: ask.volumes,
            attach: ask.attach.clone(),
            destination: ask.destination.clone(),
        };
        let within_budget = ahead.len() < free;
        let answer = if within_budget && capped.is_none() {
            Answer::Granted(grant(false))
        } else if ask.past_deadline {
            Answer::Bypassed {
                permit: grant(!within_budget),
                moving,
            }
        } else {
            let mut ahead: Vec<&Ask> = ahead;
            ahead.sort_by(|a, b| a.order().cmp(&b.order()));
            let ahead = ahead.iter().map(|a| a.pod.clone()).collect();
            let line = self.waiting.entry(ask.workload.clone()).or_default();
            let before = line.get(&ask.uid);
            let since = before.map_or(now, |w| w.since);
            let lined = before.is_some_and(|w| w.lined);
            line.insert(
                ask.uid.clone(),
                Waiting {
                    ask: ask.clone(),
                    since,
                    // Its drain goes on with its pass; it parks at the end.
                    parked: false,
                    lined,
                },
            );
            return match capped {
                Some(cap) if within_budget => Answer::Capped { in_flight, cap },
                _ => Answer::Wait {
                    moving,
                    ahead,
                    degraded,
                },
            };
        };
        let permit = match &answer {
            Answer::Granted(p) | Answer::Bypassed { permit: p, .. } => p.clone(),
            Answer::Wait { .. } | Answer::Capped { .. } | Answer::Contended { .. } => {
                unreachable!("returned above")
            }
        };
        self.withdraw(&ask.workload, &ask.uid);
        self.moving
            .entry(ask.workload.clone())
            .or_default()
            .insert(ask.uid.clone(), permit);
        answer
    }

    /// The asks better ordered than `ask` that wait for its workload at
    /// `now`: this process's parked ones, and the other processes' in line
    /// and not expired (one this process also has counted once); for an
    /// ask of a pod that is down itself, only those of pods down too.
    fn ahead_of(&self, ask: &Ask, now: Timestamp) -> Vec<&Ask> {
        let mine = self.waiting.get(&ask.workload);
        let theirs = self
            .others
            .get(&ask.workload)
            .into_iter()
            .flatten()
            .filter(|l| l.expires > now)
            .filter(|l| mine.is_none_or(|m| !m.contains_key(&l.ask.uid)))
            .map(|l| &l.ask);
        mine.into_iter()
            .flat_map(|w| w.values())
            .filter(|w| w.parked)
            .map(|w| &w.ask)
            .chain(theirs)
            .filter(|w| w.uid != ask.uid && w.order() < ask.order())
            // A pod that is down itself is not behind pods that serve: they
            // may wait for the workload to be whole, and moving this one
            // is what makes it whole (a circular wait otherwise, until a
            // deadline that then bypasses the budget).
            .filter(|w| !ask.down || w.down)
            .collect()
    }

    /// The asks of other processes in line now, each with its workload
    /// (see [`Lined`]): they hold their place until the next call.
    pub fn set_lined(&mut self, lined: impl IntoIterator<Item = (Workload, Lined)>) {
        self.others.clear();
        for (w, l) in lined {
            self.others.entry(w).or_default().push(l);
        }
    }

    /// This process's asks in line: parked once and still waiting, each
    /// with its workload. Other processes order their asks behind the
    /// better ordered of these.
    pub fn lined(&self) -> Vec<(Workload, Ask)> {
        self.waiting
            .iter()
            .flat_map(|(w, line)| {
                line.values()
                    .filter(|a| a.lined)
                    .map(move |a| (w.clone(), a.ask.clone()))
            })
            .collect()
    }

    /// Whether the pod `uid` of `workload` holds a permit (this process's
    /// or one the API server holds): an ask of it is granted again.
    pub fn holds(&self, workload: &Workload, uid: &str) -> bool {
        self.permit_of(workload, uid).is_some()
    }

    /// The permit the pod `uid` of `workload` holds: this process's, else
    /// one the API server holds.
    fn permit_of(&self, workload: &Workload, uid: &str) -> Option<&Permit> {
        let mine = self.moving.get(workload).and_then(|m| m.get(uid));
        mine.or_else(|| self.held.get(workload).and_then(|m| m.get(uid)))
    }

    /// Since when the pod `uid` has waited for a permit, if it waits.
    pub fn waiting_since(&self, workload: &Workload, uid: &str) -> Option<Timestamp> {
        self.waiting.get(workload)?.get(uid).map(|w| w.since)
    }

    /// Whether the pod `uid` waits for a permit, of any workload.
    pub fn is_waiting(&self, uid: &str) -> bool {
        self.waiting.values().any(|w| w.contains_key(uid))
    }

    /// The pod `uid` no longer asks (its drain stopped, or it went another
    /// way).
    pub fn withdraw(&mut self, workload: &Workload, uid: &str) {
        if let Some(w) = self.waiting.get_mut(workload) {
            w.remove(uid);
            if w.is_empty() {
                self.waiting.remove(workload);
            }
        }
    }

    /// The move of pod `uid` ended; true when it was counted.
    pub fn end(&mut self, workload: &Workload, uid: &str) -> bool {
        let Some(m) = self.moving.get_mut(workload) else {
            return false;
        };
        let ended = m.remove(uid).is_some();
        if m.is_empty() {
            self.moving.remove(workload);
        }
        ended
    }

    /// Keeps of `machine`'s waiting asks only those of the pods `uids`:
    /// those its drain asked for again in its last pass (a pod gone, or
    /// moved another way, no longer holds the line), and parks them: its
    /// pass is over and it waits for a permit to free, so they hold their
    /// place in line until it asks again. How many were withdrawn.
    pub fn keep_waiting(&mut self, machine: &str, uids: &[String]) -> usize {
        let mut withdrawn = 0;
        self.waiting.retain(|_, w| {
            let before = w.len();
            w.retain(|uid, a| a.ask.machine != machine || uids.contains(uid));
            for (_, a) in w.iter_mut().filter(|(_, a)| a.ask.machine == machine) {
                a.parked = true;
                a.lined = true;
            }
            withdrawn += before - w.len();
            !w.is_empty()
        });
        withdrawn
    }

    /// `machine`'s drain began a volume move: until its pass is over it
    /// cannot begin another (one volume move at a time by default; with
    /// more, its pass asks again for each pod it reaches), so its other
    /// asks leave the line, here (no longer parked) and for the other
    /// processes (no longer lined), and a permit that frees meanwhile goes
    /// to a drain that can use it. They park again when its pass ends
    /// ([`Ledger::keep_waiting`]), in their place: the order is the ask's.
    /// True when one held a place in line (the drains behind it may go
    /// now).
    pub fn busy(&mut self, machine: &str) -> bool {
        let mut held = false;
        for a in self
            .waiting
            .values_mut()
            .flat_map(|w| w.values_mut())
            .filter(|a| a.ask.machine == machine)
        {
            held |= a.parked || a.lined;
            a.parked = false;
            a.lined = false;
        }
        held
    }

    /// Ends the moves of `machine` but those of the pods `keep` (by UID):
    /// what its drain no longer records (a drain that ended, or stopped
    /// between a grant and its record), and withdraws its waiting asks. How
    /// many moves ended.
    pub fn release_machine(&mut self, machine: &str, keep: &[String]) -> usize {
        self.keep_waiting(machine, &[]);
        let mut ended = 0;
        self.moving.retain(|_, m| {
            let before = m.len();
            m.retain(|uid, p| p.machine != machine || keep.contains(uid));
            ended += before - m.len();
            !m.is_empty()
        });
        ended
    }

    /// The permits the API server holds now (of every process), each with
    /// its workload: they count as moves in flight until the next call.
    pub fn set_held(&mut self, held: impl IntoIterator<Item = (Workload, Permit)>) {
        self.held.clear();
        for (w, p) in held {
            self.held.entry(w).or_default().insert(p.uid.clone(), p);
        }
    }

    /// Every move in flight, this process's and those the API server
    /// holds, once each, by workload then pod UID.
    fn all_moving(&self) -> BTreeMap<&Workload, BTreeMap<&str, &Permit>> {
        let mut all: BTreeMap<&Workload, BTreeMap<&str, &Permit>> = BTreeMap::new();
        for (w, m) in self.held.iter().chain(&self.moving) {
            let of = all.entry(w).or_default();
            for (uid, p) in m {
                of.insert(uid.as_str(), p);
            }
        }
        all
    }

    /// The moves of `workload` in flight, oldest first.
    pub fn moving_of(&self, workload: &Workload) -> Vec<Permit> {
        let of = |m: Option<&BTreeMap<String, Permit>>| -> Vec<Permit> {
            m.into_iter().flat_map(|m| m.values().cloned()).collect()
        };
        let mut moving = of(self.held.get(workload));
        for p in of(self.moving.get(workload)) {
            if !moving.iter().any(|h| h.uid == p.uid) {
                moving.push(p);
            }
        }
        moving.sort_by(|a, b| (a.since, &a.pod).cmp(&(b.since, &b.pod)));
        moving
    }

    /// Every move in flight, by workload.
    pub fn moves(&self) -> Vec<(Workload, Permit)> {
        self.all_moving()
            .into_iter()
            .flat_map(|(w, m)| m.into_values().map(move |p| (w.clone(), p.clone())))
            .collect()
    }

    /// How many asks wait, for the metrics.
    pub fn waiting(&self) -> usize {
        self.waiting.values().map(BTreeMap::len).sum()
    }

    /// How many moves of volumes are in flight, of every workload.
    pub fn in_flight(&self) -> usize {
        self.all_moving()
            .values()
            .flat_map(BTreeMap::values)
            .filter(|p| p.volumes)
            .count()
    }

    /// The Machines that hold a permit or wait for one.
    pub fn machines(&self) -> BTreeSet<String> {
        let all = self.all_moving();
        let moving = all.values().flat_map(|m| m.values().map(|p| &p.machine));
        let waiting = self
            .waiting
            .values()
            .flat_map(|w| w.values().map(|w| &w.ask.machine));
        moving.chain(waiting).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::ledger::Lined;
    use crate::drain::ledger::tests::{ask, db, granted, t};

    #[test]
    fn one_replica_of_a_workload_moves_at_a_time_across_machines() {
        let mut l = Ledger::default();
        let one = Budget::default_for(true);
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let b = l.ask(&ask("db-1", "b", 0), &one, t(2));
        let Answer::Wait { moving, ahead, .. } = b else {
            panic!("db-1 must wait: {b:?}")
        };
        assert_eq!(moving.len(), 1);
        assert_eq!(moving[0].pod, "ns/db-0");
        assert_eq!(moving[0].machine, "ns/a");
        assert!(ahead.is_empty());
        // Asked again (a retried pass): still the one permit, still waiting.
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(3))));
        assert!(!granted(&l.ask(&ask("db-1", "b", 0), &one, t(3))));
        assert!(l.end(&db(), "uid-db-0"));
        assert!(granted(&l.ask(&ask("db-1", "b", 0), &one, t(4))));
        assert_eq!(l.waiting(), 0);
    }

    #[test]
    fn a_replica_down_for_another_reason_holds_the_budget_as_a_move_does() {
        let mut l = Ledger::default();
        let one = Budget::default_for(true);
        let two = Budget {
            max_moving: Some(2),
            ..Budget::default_for(true)
        };
        // db-2 crash-loops (its owner counts one unavailable): with one
        // move at a time, nothing else of db moves while it is down.
        let degraded = Ask {
            unavailable: 1,
            ..ask("db-0", "a", 0)
        };
        let Answer::Wait {
            moving, degraded, ..
        } = l.ask(&degraded, &one, t(1))
        else {
            panic!("a degraded workload waits")
        };
        assert!(moving.is_empty());
        assert_eq!(degraded, 1);
        // With a budget of two, one more may go down.
        let mut l = Ledger::default();
        let first = Ask {
            unavailable: 1,
            ..ask("db-0", "a", 0)
        };
        assert!(granted(&l.ask(&first, &two, t(1))));
        // Right after: db-0 evicted, its owner now counts two down (db-0
        // and db-2), of which one is berth's move.
        let second = Ask {
            unavailable: 2,
            ..ask("db-1", "b", 0)
        };
        let Answer::Wait {
            moving, degraded, ..
        } = l.ask(&second, &two, t(2))
        else {
            panic!("two down of a budget of two")
        };
        assert_eq!((moving.len(), degraded), (1, 1));
        // An owner whose status lags (still none down) does not hide the
        // move in flight.
        let lagging = Ask {
            unavailable: 0,
            ..ask("db-1", "b", 0)
        };
        assert!(granted(&l.ask(&lagging, &two, t(3))));
        // Past its deadline a drain goes beyond, as for moves.
        let mut l = Ledger::default();
        let late = Ask {
            unavailable: 1,
            past_deadline: true,
            ..ask("db-0", "a", 0)
        };
        assert!(matches!(l.ask(&late, &one, t(1)), Answer::Bypassed { .. }));
    }

    #[test]
    fn other_workloads_and_workloads_without_volumes_are_not_held() {
        let mut l = Ledger::default();
        let one = Budget::default_for(true);
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let mut other = ask("cache-0", "a", 0);
        other.workload = Workload::new("StatefulSet", "ns", "cache");
        assert!(granted(&l.ask(&other, &one, t(1))));
        let unbounded = Budget::default_for(false);
        let mut web = ask("web-1", "a", 0);
        web.workload = Workload::new("Deployment", "ns", "web");
        for i in 0..5 {
            web.uid = format!("web-{i}");
            assert!(granted(&l.ask(&web, &unbounded, t(1))));
        }
    }

    #[test]
    fn a_budget_of_two_lets_two_go() {
        let mut l = Ledger::default();
        let two = Budget {
            max_moving: Some(2),
            ..Budget::default_for(true)
        };
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &two, t(1))));
        assert!(granted(&l.ask(&ask("db-1", "b", 0), &two, t(1))));
        assert!(!granted(&l.ask(&ask("db-2", "c", 0), &two, t(1))));
    }

    #[test]
    fn a_freed_permit_goes_by_priority_then_deletion_order_then_name() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        // b's Machine was deleted after c's; d's pod has a higher priority.
        let b = ask("db-1", "b", 20);
        let c = ask("db-2", "c", 10);
        let mut d = ask("db-3", "d", 30);
        d.priority = 100;
        for x in [&b, &c, &d] {
            assert!(!granted(&l.ask(x, &one, t(2))));
            // Each drain's pass ends, and it parks on its ask.
            l.keep_waiting(&x.machine, std::slice::from_ref(&x.uid));
        }
        l.end(&db(), "uid-db-0");
        // The first to ask again after the end is not the first in line.
        let Answer::Wait { ahead, .. } = l.ask(&b, &one, t(3)) else {
            panic!("b is behind d and c")
        };
        assert_eq!(ahead, vec!["ns/db-3".to_string(), "ns/db-2".to_string()]);
        assert!(!granted(&l.ask(&c, &one, t(3))), "c is behind d");
        assert!(granted(&l.ask(&d, &one, t(3))));
        l.end(&db(), "uid-db-3");
        assert!(granted(&l.ask(&c, &one, t(4))));
        l.end(&db(), "uid-db-2");
        assert!(granted(&l.ask(&b, &one, t(5))));
    }

    /// Of Machines deleted together, the drain with more volume moves left
    /// goes first: the one the rollout waits for the longest (the shared
    /// benchmark's last Machine, last by name, began its three moves after
    /// every other drain was done with its own).
    #[test]
    fn of_drains_deleted_together_the_one_with_more_moves_left_goes_first() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let mut b = ask("db-1", "b", 0);
        b.moves_left = 1;
        let mut c = ask("db-2", "c", 0);
        c.moves_left = 3;
        // Deleted a second later, with more left still: behind both.
        let mut d = ask("db-3", "d", 1);
        d.moves_left = 5;
        for x in [&b, &c, &d] {
            assert!(!granted(&l.ask(x, &one, t(2))));
            l.keep_waiting(&x.machine, std::slice::from_ref(&x.uid));
        }
        l.end(&db(), "uid-db-0");
        let Answer::Wait { ahead, .. } = l.ask(&b, &one, t(3)) else {
            panic!("b is behind c")
        };
        assert_eq!(ahead, vec!["ns/db-2".to_string()]);
        l.keep_waiting(&b.machine, std::slice::from_ref(&b.uid));
        assert!(granted(&l.ask(&c, &one, t(3))));
        l.end(&db(), "uid-db-2");
        assert!(!granted(&l.ask(&d, &one, t(4))), "d was deleted later");
        assert!(granted(&l.ask(&b, &one, t(4))));
    }

    /// Case 8 of issue 36: a drain busy elsewhere (its pass not over) does
    /// not keep its place in line; once parked, it does, until it asks
    /// again.
    #[test]
    fn a_drain_busy_elsewhere_keeps_no_place_in_line() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        // b was deleted first, but its pass is still busy elsewhere.
        let busy = ask("db-1", "b", 0);
        let parked = ask("db-2", "c", 5);
        assert!(!granted(&l.ask(&busy, &one, t(2))));
        assert!(!granted(&l.ask(&parked, &one, t(2))));
        l.keep_waiting("ns/c", &["uid-db-2".to_string()]);
        l.end(&db(), "uid-db-0");
        assert!(
            granted(&l.ask(&parked, &one, t(3))),
            "the freed permit is not kept for b's busy drain"
        );
        l.end(&db(), "uid-db-2");
        // Parked first, b holds its place against c's later ask, even
        // though c asks before b does.
        l.keep_waiting("ns/b", &["uid-db-1".to_string()]);
        let again = ask("db-3", "c", 5);
        assert!(!granted(&l.ask(&again, &one, t(4))), "b is parked ahead");
        assert!(granted(&l.ask(&busy, &one, t(4))));
    }

    /// The shared benchmark's lost slot (issue 36): a drain parked on an
    /// ask of one workload that then begins a move of another keeps no
    /// place in line while it moves, here or for other processes; it parks
    /// again, in its place, when its pass ends.
    #[test]
    fn a_drain_that_begins_a_move_leaves_the_line_until_its_pass_ends() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        // b, deleted first, parks on db-1; c, deleted later, on db-2.
        let b_db = ask("db-1", "b", 0);
        let c_db = ask("db-2", "c", 5);
        for x in [&b_db, &c_db] {
            assert!(!granted(&l.ask(x, &one, t(2))));
            l.keep_waiting(&x.machine, std::slice::from_ref(&x.uid));
        }
        assert_eq!(l.lined().len(), 2);
        // b's next pass begins a move of another workload.
        let mut b_web = ask("web-1", "b", 0);
        b_web.workload = Workload::new("StatefulSet", "ns", "web");
        b_web.uid = "uid-web-1".into();
        assert!(granted(&l.ask(&b_web, &one, t(3))));
        assert!(l.busy("ns/b"), "b held a place in line");
        assert!(!l.busy("ns/b"), "and holds none now");
        assert_eq!(
            l.lined()
                .iter()
                .map(|(_, a)| a.uid.as_str())
                .collect::<Vec<_>>(),
            vec!["uid-db-2"],
            "other processes no longer see b in line"
        );
        l.end(&db(), "uid-db-0");
        assert!(
            granted(&l.ask(&c_db, &one, t(4))),
            "the freed permit goes to c, which can move now"
        );
        l.end(&db(), "uid-db-2");
        // b's pass ends: it parks again, ahead of a later ask of c.
        l.keep_waiting("ns/b", std::slice::from_ref(&b_db.uid));
        assert!(!granted(&l.ask(&ask("db-3", "c", 5), &one, t(5))));
        assert!(granted(&l.ask(&b_db, &one, t(5))));
    }

    /// Issue 36, across processes: a parked ask of another process (its
    /// `MoveAsk`), better ordered, is ahead of this process's ask, whoever
    /// asks first once a permit frees; one ordered after is not.
    #[test]
    fn a_parked_ask_of_another_process_better_ordered_is_ahead() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        let theirs = |pod: &str, requested: i64| Lined {
            ask: Ask {
                machine: "other/b".into(),
                ..ask(pod, "b", requested)
            },
            expires: t(60),
        };
        // db's permit is free, but b's ask (its Machine deleted first)
        // waits in line in the other process.
        l.set_lined([(db(), theirs("db-1", 10))]);
        let mine = ask("db-2", "e", 20);
        let Answer::Wait { moving, ahead, .. } = l.ask(&mine, &one, t(30)) else {
            panic!("b's ask is first in line")
        };
        assert!(moving.is_empty());
        assert_eq!(ahead, ["ns/db-1"], "named as an ask of this process is");
        // Of another workload, or ordered after this one: not ahead.
        let mut cache = theirs("cache-0", 0);
        cache.ask.workload = Workload::new("StatefulSet", "ns", "cache");
        l.set_lined([
            (Workload::new("StatefulSet", "ns", "cache"), cache),
            (db(), theirs("db-3", 40)),
        ]);
        assert!(granted(&l.ask(&mine, &one, t(31))));
        l.end(&db(), "uid-db-2");
        // A higher priority goes first, whenever its Machine was deleted.
        let mut urgent = theirs("db-4", 50);
        urgent.ask.priority = 100;
        l.set_lined([(db(), urgent)]);
        assert!(!granted(&l.ask(&mine, &one, t(32))));
    }

    /// An ask whose process died is renewed no more: past its expiry it
    /// holds no place in line.
    #[test]
    fn an_expired_ask_of_another_process_is_not_ahead() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        let dead = Lined {
            ask: Ask {
                machine: "other/b".into(),
                ..ask("db-1", "b", 10)
            },
            expires: t(60),
        };
        l.set_lined([(db(), dead)]);
        let mine = ask("db-2", "e", 20);
        assert!(!granted(&l.ask(&mine, &one, t(59))), "still renewed");
        assert!(granted(&l.ask(&mine, &one, t(60))), "expired");
    }

    /// What this process shows other processes: an ask in line from its
    /// first park until it is granted or withdrawn, through the passes
    /// its drain makes when woken (one write when it parks, one when it
    /// leaves the line).
    #[test]
    fn an_ask_is_in_line_from_its_park_until_it_leaves_the_line() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let b = ask("db-1", "b", 10);
        let c = ask("db-2", "c", 20);
        assert!(!granted(&l.ask(&b, &one, t(2))));
        assert!(l.lined().is_empty(), "its drain's pass is not over");
        l.keep_waiting("ns/b", std::slice::from_ref(&b.uid));
        let pods =
            |l: &Ledger| -> Vec<String> { l.lined().into_iter().map(|(_, a)| a.pod).collect() };
        assert_eq!(pods(&l), ["ns/db-1"]);
        // Woken, it asks again and still waits: still in line.
        assert!(!granted(&l.ask(&b, &one, t(3))));
        assert_eq!(pods(&l), ["ns/db-1"]);
        assert!(!granted(&l.ask(&c, &one, t(3))));
        l.keep_waiting("ns/c", std::slice::from_ref(&c.uid));
        assert_eq!(pods(&l), ["ns/db-1", "ns/db-2"]);
        l.end(&db(), "uid-db-0");
        assert!(granted(&l.ask(&b, &one, t(4))));
        assert_eq!(pods(&l), ["ns/db-2"], "granted: out of line");
        l.release_machine("ns/c", &[]);
        assert!(l.lined().is_empty(), "its drain ended");
    }

    #[test]
    fn a_pod_down_itself_is_not_behind_asks_that_wait_for_it() {
        // db-0 is down (not Ready, or on a dead Node); db-1, Ready, asked
        // first and waits for db to be whole: parked, better ordered.
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        let healthy = Ask {
            unavailable: 1,
            ..ask("db-1", "b", 0)
        };
        assert!(!granted(&l.ask(&healthy, &one, t(1))));
        l.keep_waiting("ns/b", std::slice::from_ref(&healthy.uid));
        // The drain (or remediation) of db-0's Machine asks later: db-0's
        // move is what makes db whole, so db-1's ask is not ahead of it.
        let down = Ask {
            down: true,
            ..ask("db-0", "a", 10)
        };
        assert!(granted(&l.ask(&down, &one, t(2))), "no circular wait");
        // While db-0 moves, db-1 still waits for its permit.
        assert!(!granted(&l.ask(&healthy, &one, t(3))));
        // A pod that serves is behind the better ordered asks as before,
        // and a pod down is behind others down.
        let mut l = Ledger::default();
        let first_down = Ask {
            down: true,
            ..ask("db-2", "c", 0)
        };
        assert!(granted(&l.ask(&ask("db-9", "z", 0), &one, t(1))));
        assert!(!granted(&l.ask(&first_down, &one, t(2))));
        l.keep_waiting("ns/c", std::slice::from_ref(&first_down.uid));
        l.end(&db(), "uid-db-9");
        let Answer::Wait { ahead, .. } = l.ask(&down, &one, t(3)) else {
            panic!("behind the other pod that is down")
        };
        assert_eq!(ahead, ["ns/db-2"]);
    }

    #[test]
    fn a_withdrawn_ask_no_longer_holds_the_line() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let first = ask("db-1", "b", 0);
        let second = ask("db-2", "c", 5);
        assert!(!granted(&l.ask(&first, &one, t(2))));
        assert!(!granted(&l.ask(&second, &one, t(2))));
        l.keep_waiting("ns/b", &["uid-db-1".to_string()]);
        l.end(&db(), "uid-db-0");
        l.withdraw(&db(), "uid-db-1");
        assert!(granted(&l.ask(&second, &one, t(3))));
    }

    #[test]
    fn a_drain_that_no_longer_asks_for_a_pod_takes_it_out_of_the_line() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let first = ask("db-1", "b", 0);
        let later = ask("db-2", "c", 5);
        assert!(!granted(&l.ask(&first, &one, t(2))));
        assert!(!granted(&l.ask(&later, &one, t(2))));
        l.end(&db(), "uid-db-0");
        // b's drain asked again for db-1 alone: nothing changes.
        assert_eq!(l.keep_waiting("ns/b", &["uid-db-1".to_string()]), 0);
        assert!(!granted(&l.ask(&later, &one, t(3))), "db-1 is first");
        // Its next pass no longer asks for db-1 (gone another way).
        assert_eq!(l.keep_waiting("ns/b", &[]), 1);
        assert!(granted(&l.ask(&later, &one, t(4))));
    }

    #[test]
    fn a_machine_releases_what_its_drain_no_longer_records() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let mut cache = ask("cache-0", "a", 0);
        cache.workload = Workload::new("StatefulSet", "ns", "cache");
        assert!(granted(&l.ask(&cache, &one, t(1))));
        assert_eq!(l.release_machine("ns/a", &["uid-db-0".to_string()]), 1);
        assert_eq!(l.release_machine("ns/b", &[]), 0);
        assert!(!granted(&l.ask(&ask("db-1", "b", 0), &one, t(2))));
        assert_eq!(l.release_machine("ns/a", &[]), 1);
        assert!(granted(&l.ask(&ask("db-1", "b", 0), &one, t(3))));
    }

    #[test]
    fn past_its_deadline_a_drain_moves_beyond_the_budget_and_is_counted() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default();
        assert!(granted(&l.ask(&ask("db-0", "a", 0), &one, t(1))));
        let mut late = ask("db-1", "b", 0);
        late.past_deadline = true;
        let Answer::Bypassed { permit, moving } = l.ask(&late, &one, t(2)) else {
            panic!("bypassed")
        };
        assert!(permit.past_budget);
        assert_eq!(moving.len(), 1);
        // Counted: a third replica waits for both.
        let Answer::Wait { moving, .. } = l.ask(&ask("db-2", "c", 0), &one, t(3)) else {
            panic!("waits")
        };
        assert_eq!(moving.len(), 2);
        l.end(&db(), "uid-db-0");
        assert!(!granted(&l.ask(&ask("db-2", "c", 0), &one, t(4))));
        l.end(&db(), "uid-db-1");
        assert!(granted(&l.ask(&ask("db-2", "c", 0), &one, t(5))));
    }

    #[test]
    fn the_cap_bounds_moves_of_every_workload_together() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default().with_cap(Some(2));
        let of = |pod: &str, workload: &str, machine: &str| {
            let mut a = ask(pod, machine, 0);
            a.workload = Workload::new("StatefulSet", "ns", workload);
            a
        };
        assert!(granted(&l.ask(&of("db-0", "db", "a"), &one, t(1))));
        assert!(granted(&l.ask(&of("cache-0", "cache", "a"), &one, t(1))));
        let queue = of("queue-0", "queue", "b");
        assert_eq!(
            l.ask(&queue, &one, t(2)),
            Answer::Capped {
                in_flight: 2,
                cap: 2
            }
        );
        assert_eq!(l.waiting_since(&queue.workload, &queue.uid), Some(t(2)));
        // A workload's own budget still answers first.
        assert!(matches!(
            l.ask(&of("db-1", "db", "b"), &one, t(3)),
            Answer::Wait { .. }
        ));
        // Waiting since its first ask, not its last.
        assert!(!granted(&l.ask(&queue, &one, t(4))));
        assert_eq!(l.waiting_since(&queue.workload, &queue.uid), Some(t(2)));
        l.end(&Workload::new("StatefulSet", "ns", "cache"), "uid-cache-0");
        assert!(granted(&l.ask(&queue, &one, t(5))));
        assert_eq!(l.waiting_since(&queue.workload, &queue.uid), None);
        // Past its deadline a drain goes beyond the cap, within the budget
        // (not past it).
        let mut late = of("log-0", "log", "c");
        late.past_deadline = true;
        let Answer::Bypassed { permit, .. } = l.ask(&late, &one, t(6)) else {
            panic!("past the deadline, beyond the cap")
        };
        assert!(!permit.past_budget);
        assert_eq!(l.in_flight(), 3);
        assert_eq!(
            l.machines(),
            ["ns/a", "ns/b", "ns/c"].map(String::from).into()
        );
    }

    #[test]
    fn permits_the_api_server_holds_count_once_with_this_processs_own() {
        let one = Budget::default_for(true);
        let two = Budget {
            max_moving: Some(2),
            ..one.clone()
        };
        let theirs = Permit {
            pod: "ns/db-0".into(),
            uid: "uid-db-0".into(),
            machine: "other/x".into(),
            since: t(0),
            past_budget: false,
            volumes: true,
            attach: vec![],
            destination: None,
        };
        let mut l = Ledger::default();
        // Another process's move holds db's one permit.
        l.set_held([(db(), theirs.clone())]);
        let Answer::Wait { moving, .. } = l.ask(&ask("db-1", "b", 0), &one, t(1)) else {
            panic!("held by the other process")
        };
        assert_eq!(moving, vec![theirs.clone()]);
        assert_eq!(l.machines(), ["ns/b", "other/x"].map(String::from).into());
        // This process's grant, also in the API server by the next ask:
        // counted once.
        let Answer::Granted(mine) = l.ask(&ask("db-1", "b", 0), &two, t(2)) else {
            panic!("a second permit of two")
        };
        l.set_held([(db(), theirs.clone()), (db(), mine.clone())]);
        assert_eq!(l.moving_of(&db()).len(), 2);
        assert_eq!(l.in_flight(), 2);
        assert_eq!(l.moves().len(), 2);
        assert!(!granted(&l.ask(&ask("db-2", "c", 0), &two, t(3))));
        // The other process ended its move: the next snapshot drops it.
        l.set_held([(db(), mine)]);
        assert!(granted(&l.ask(&ask("db-2", "c", 0), &two, t(4))));
        // A pod whose permit the API server holds gets it again.
        let mut resumed = Ledger::default();
        resumed.set_held([(db(), theirs.clone())]);
        let again = Ask {
            machine: "other/x".into(),
            ..ask("db-0", "x", 0)
        };
        assert_eq!(resumed.ask(&again, &one, t(5)), Answer::Granted(theirs));
    }

    #[test]
    fn a_rebuilt_ledger_holds_what_the_machines_recorded() {
        let one = Budget::default_for(true);
        let permit = Permit {
            pod: "ns/db-0".into(),
            uid: "uid-db-0".into(),
            machine: "ns/a".into(),
            since: t(0),
            past_budget: false,
            volumes: true,
            attach: vec![],
            destination: None,
        };
        let mut l = Ledger::rebuild([(db(), permit.clone())]);
        assert_eq!(l.moves().len(), 1);
        assert!(!granted(&l.ask(&ask("db-1", "b", 0), &one, t(1))));
        // The recorded move resumes under its own permit.
        assert_eq!(
            l.ask(&ask("db-0", "a", 0), &one, t(2)),
            Answer::Granted(permit)
        );
    }

    #[test]
    fn moves_without_volumes_keep_their_budget_and_leave_the_cap_alone() {
        let one = Budget::default_for(true);
        let mut l = Ledger::default().with_cap(Some(1));
        let web = |pod: &str, machine: &str| Ask {
            workload: Workload::new("Deployment", "ns", "web"),
            volumes: false,
            ..ask(pod, machine, 0)
        };
        assert!(matches!(
            l.ask(&web("web-1", "a"), &one, t(1)),
            Answer::Granted(_)
        ));
        // Its budget of one holds for the workload's other pod ...
        assert!(matches!(
            l.ask(&web("web-2", "b"), &one, t(1)),
            Answer::Wait { .. }
        ));
        // ... but the cap on moves in flight counts moves of volumes only.
        assert_eq!(l.in_flight(), 0);
        assert!(matches!(
            l.ask(&ask("db-0", "a", 0), &one, t(1)),
            Answer::Granted(_)
        ));
        assert_eq!(l.in_flight(), 1);
        let other = Ask {
            workload: Workload::new("StatefulSet", "ns", "cache"),
            ..ask("cache-0", "b", 0)
        };
        assert!(matches!(l.ask(&other, &one, t(1)), Answer::Capped { .. }));
    }
}
