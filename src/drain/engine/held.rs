//! A drain's bookkeeping of moves that do not end the usual way:
//!
//! - **held** workloads: the scheduler cannot place the replacement of a
//!   workload's last evicted pod, so none of its other pods is evicted
//!   until it is placed; the move it waits for is kept with the order
//!   group of its pod (no later group starts meanwhile);
//! - **given-up** volumes: their detach wait timed out in this run; they
//!   are warned about once and not waited for again (the reconciler's own
//!   volume step still guards the VM);
//! - pods **without a destination**: since when each has found no Node
//!   for its replacement, and whether that was warned about.
//!
//! No I/O: whether a replacement is placed, or a volume still on the Node,
//! is asked of the caller.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use std::time::Duration;

use tokio::time::Instant;

use crate::api::VolumeMove;

#[derive(Debug, Default)]
pub(super) struct HeldMoves {
    /// By controller: the move its workload waits for, and its pod's order
    /// group.
    held: Mutex<BTreeMap<String, (VolumeMove, i32)>>,
    /// PVs whose detach wait timed out.
    given_up: Mutex<BTreeSet<String>>,
    /// By pod: since when it has found no destination, and whether that
    /// was warned about.
    nowhere: Mutex<BTreeMap<String, (Instant, bool)>>,
}

impl HeldMoves {
    /// Pod `key` found no destination `now`: since when it has found none.
    pub(super) fn nowhere_since(&self, key: &str, now: Instant) -> Instant {
        self.nowhere.lock().map_or(now, |mut n| {
            n.entry(key.to_string()).or_insert((now, false)).0
        })
    }

    /// Whether pod `key`'s wait for a destination is to be warned about
    /// now (it began `after` ago or more, and was not warned about yet);
    /// marks it warned.
    pub(super) fn warn_nowhere(&self, key: &str, now: Instant, after: Duration) -> bool {
        self.nowhere.lock().is_ok_and(|mut n| match n.get_mut(key) {
            Some((since, warned)) if !*warned && now.duration_since(*since) >= after => {
                *warned = true;
                true
            }
            _ => false,
        })
    }

    /// When the first of `keys` not warned about yet is due its warning
    /// (see [`HeldMoves::warn_nowhere`]), if any is.
    pub(super) fn nowhere_warning_due(&self, keys: &[String], after: Duration) -> Option<Instant> {
        let n = self.nowhere.lock().ok()?;
        keys.iter()
            .filter_map(|k| n.get(k))
            .filter(|(_, warned)| !warned)
            .map(|(since, _)| *since + after)
            .min()
    }

    /// Pod `key` found a destination: a later wait starts afresh.
    pub(super) fn somewhere(&self, key: &str) {
        if let Ok(mut n) = self.nowhere.lock() {
            n.remove(key);
        }
    }

    /// Holds back the other pods of `controller` until the replacement of
    /// the pod `moved` left is placed; `order` is that pod's group.
    pub(super) fn hold(&self, controller: &str, moved: VolumeMove, order: i32) {
        if let Ok(mut s) = self.held.lock() {
            s.insert(controller.to_string(), (moved, order));
        }
    }

    /// Whether the move of pod `key` is held.
    pub(super) fn is_held(&self, key: &str) -> bool {
        self.held
            .lock()
            .is_ok_and(|s| s.values().any(|(m, _)| m.pod == key))
    }

    /// Whether pods of `controller` are held back.
    pub(super) fn holds(&self, controller: &str) -> bool {
        self.held.lock().is_ok_and(|s| s.contains_key(controller))
    }

    /// The lowest order group of a held move.
    pub(super) fn lowest_order(&self) -> Option<i32> {
        let held = self.held.lock().ok()?;
        held.values().map(|(_, order)| *order).min()
    }

    /// The volumes of the moves held now, by PV name.
    pub(super) fn volumes(&self) -> BTreeSet<String> {
        self.held.lock().map_or_else(
            |_| BTreeSet::new(),
            |s| s.values().flat_map(|(m, _)| m.volumes.clone()).collect(),
        )
    }

    /// Whether `placed` holds for a held move.
    pub(super) fn any(&self, placed: impl Fn(&VolumeMove) -> bool) -> bool {
        self.held
            .lock()
            .is_ok_and(|s| s.values().any(|(m, _)| placed(m)))
    }

    /// Takes the held moves for which `placed` holds: their workloads are
    /// held no more.
    pub(super) fn take(&self, placed: impl Fn(&VolumeMove) -> bool) -> Vec<VolumeMove> {
        let Ok(mut held) = self.held.lock() else {
            return Vec::new();
        };
        let done: Vec<String> = held
            .iter()
            .filter(|(_, (m, _))| placed(m))
            .map(|(c, _)| c.clone())
            .collect();
        done.iter()
            .filter_map(|c| held.remove(c))
            .map(|(m, _)| m)
            .collect()
    }

    /// Gives up waiting for these volumes to detach in this run.
    pub(super) fn give_up(&self, pvs: impl IntoIterator<Item = String>) {
        if let Ok(mut a) = self.given_up.lock() {
            a.extend(pvs);
        }
    }

    /// The volumes given up on so far.
    pub(super) fn given_up(&self) -> BTreeSet<String> {
        self.given_up.lock().map(|a| a.clone()).unwrap_or_default()
    }

    /// The volumes of move `m` given up on.
    pub(super) fn given_up_of(&self, m: &VolumeMove) -> Vec<String> {
        let Ok(given_up) = self.given_up.lock() else {
            return Vec::new();
        };
        m.volumes
            .iter()
            .filter(|pv| given_up.contains(*pv))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moved(pod: &str, pvs: &[&str]) -> VolumeMove {
        VolumeMove {
            pod: pod.into(),
            uid: None,
            volumes: pvs.iter().map(|s| s.to_string()).collect(),
            controller: None,
            workload: None,
            since: None,
        }
    }

    #[test]
    fn a_wait_for_a_destination_is_warned_about_once_when_due() {
        let h = HeldMoves::default();
        let (t0, after) = (Instant::now(), Duration::from_secs(10));
        let key = ["ns/db-0".to_string()];
        assert_eq!(h.nowhere_warning_due(&key, after), None);
        assert_eq!(h.nowhere_since("ns/db-0", t0), t0);
        // A later pass keeps the first time.
        assert_eq!(h.nowhere_since("ns/db-0", t0 + Duration::from_secs(3)), t0);
        assert_eq!(h.nowhere_warning_due(&key, after), Some(t0 + after));
        assert!(!h.warn_nowhere("ns/db-0", t0 + Duration::from_secs(9), after));
        assert!(h.warn_nowhere("ns/db-0", t0 + after, after));
        assert!(!h.warn_nowhere("ns/db-0", t0 + after * 2, after), "once");
        assert_eq!(h.nowhere_warning_due(&key, after), None);
        // Found one, then none again: a new wait.
        h.somewhere("ns/db-0");
        let t1 = t0 + after * 3;
        assert_eq!(h.nowhere_since("ns/db-0", t1), t1);
    }

    #[test]
    fn a_held_workload_is_held_until_its_move_is_taken() {
        let h = HeldMoves::default();
        h.hold("StatefulSet/db", moved("ns/db-0", &["pv-a"]), 0);
        h.hold("StatefulSet/web", moved("ns/web-0", &["pv-b"]), -5);
        assert!(h.holds("StatefulSet/db") && h.is_held("ns/db-0"));
        assert_eq!(h.lowest_order(), Some(-5));
        assert_eq!(h.volumes(), BTreeSet::from(["pv-a".into(), "pv-b".into()]));
        assert!(h.any(|m| m.pod == "ns/db-0"));
        let taken = h.take(|m| m.pod == "ns/db-0");
        assert_eq!(taken.len(), 1);
        assert!(!h.holds("StatefulSet/db") && h.holds("StatefulSet/web"));
        assert_eq!(h.lowest_order(), Some(-5));
        assert_eq!(h.take(|_| true).len(), 1);
        assert_eq!(h.lowest_order(), None);
    }

    #[test]
    fn volumes_given_up_are_named_per_move() {
        let h = HeldMoves::default();
        h.give_up(["pv-a".to_string()]);
        assert_eq!(
            h.given_up_of(&moved("ns/db-0", &["pv-a", "pv-b"])),
            ["pv-a"]
        );
        assert!(h.given_up_of(&moved("ns/db-1", &["pv-c"])).is_empty());
        assert_eq!(h.given_up(), BTreeSet::from(["pv-a".into()]));
    }
}
