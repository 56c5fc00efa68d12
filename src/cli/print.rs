//! How `berth plan` prints a drain plan: the `Display` of [`DrainPlan`]
//! (each volume and its wait as the drain names them, see
//! `crate::drain::describe`), and the drain in progress as `status.drain`
//! records it ([`in_progress`]).

use std::fmt;

use humantime::format_duration;

use crate::api::conditions::REMEDIATION;
use crate::api::remediation::Fence;
use crate::api::settings::NodeLocalVolumes;
use crate::api::{DrainStatus, MachineStatus};
use crate::drain::plan::{DrainPlan, PlannedPod};
use crate::drain::rules;
use crate::drain::select::fmt_key;

/// `order 1000, critical: …` for a pod not in the default order group or
/// with an order of its own, else nothing.
fn order_of(p: &PlannedPod) -> Option<String> {
    if p.order == rules::DEFAULT_ORDER && p.order_source.is_none() {
        return None;
    }
    Some(match &p.order_source {
        Some(source) => format!("order {}, {source}", p.order),
        None => format!("order {}", p.order),
    })
}

/// ` (order …)`, or nothing.
fn order_suffix(p: &PlannedPod) -> String {
    order_of(p).map_or_else(String::new, |o| format!(" ({o})"))
}

fn write_pdbs_and_notes(f: &mut fmt::Formatter<'_>, p: &PlannedPod, indent: &str) -> fmt::Result {
    for pdb in &p.pdbs {
        writeln!(f, "{indent}{pdb}")?;
    }
    for note in &p.notes {
        writeln!(f, "{indent}note: {note}")?;
    }
    if !p.scratch.is_empty() {
        writeln!(
            f,
            "{indent}scratch: emptyDir {} (lost with the pod; nothing to wait for)",
            p.scratch.join(", ")
        )?;
    }
    if let Some(why) = &p.held {
        writeln!(f, "{indent}HELD: {why}")?;
    }
    Ok(())
}

impl fmt::Display for DrainPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_header(f)?;
        self.write_groups(f)?;
        self.write_set_aside(f)?;
        self.write_evictions(f)?;
        self.write_critical_path(f)
    }
}

impl DrainPlan {
    /// The Node, the deadline and what becomes of node-local volumes.
    fn write_header(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.settings;
        writeln!(f, "Drain plan for Node {}", self.node)?;
        writeln!(
            f,
            "Deadline: drain.timeout {} from the Machine's deletion; then {}",
            format_duration(s.drain_timeout),
            if s.force_after_deadline {
                "budgets are bypassed (each pod left deleted with its grace period, at the deadline minus it), volumes still waited for"
            } else {
                "the drain fails and is retried"
            }
        )?;

        writeln!(
            f,
            "Node-local volumes: nodeLocalVolumes {}",
            match s.node_local_volumes {
                NodeLocalVolumes::Evict =>
                    "Evict: their pods are evicted and their data is lost with the VM",
                NodeLocalVolumes::Block =>
                    "Block: their pods stay until annotated berth.dev/allow-node-local-data-loss=true (pod or Machine) or the deadline",
            }
        )?;
        Ok(())
    }

    /// The order groups, lowest first, with what each holds.
    fn write_groups(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let groups = self.groups();
        writeln!(
            f,
            "\nOrder groups, lowest first; each starts once every pod of the groups before it is gone and their volumes have moved ({}):",
            groups.len()
        )?;
        for g in &groups {
            write!(f, "  order {}", g.order)?;
            if !g.why.is_empty() {
                let why: Vec<&str> = g.why.iter().map(String::as_str).collect();
                write!(f, " ({})", why.join("; "))?;
            }
            let counts = [
                (g.stateless, "without persistent volumes"),
                (g.stateful, "with persistent volumes"),
                (g.waiting, "waited on to complete"),
            ];
            let counts: Vec<String> = counts
                .iter()
                .filter(|(n, _)| *n > 0)
                .map(|(n, what)| format!("{n} {what}"))
                .collect();
            writeln!(f, ": {}", counts.join(", "))?;
        }
        Ok(())
    }

    /// The pods and volumes the drain does not evict: skipped, deleted,
    /// waited on to complete or to terminate, rules not understood,
    /// volumes still detaching.
    fn write_set_aside(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.settings;
        writeln!(f, "\nSkipped ({}):", self.skipped.len())?;
        for p in &self.skipped {
            writeln!(f, "  {}: {}", fmt_key(&p.pod), p.class)?;
        }

        writeln!(f, "\nDeleted outright ({}):", self.to_delete.len())?;
        for p in &self.to_delete {
            writeln!(f, "  {}: {}", fmt_key(&p.pod), p.class)?;
        }

        writeln!(
            f,
            "\nWaited on to complete, never evicted ({}):",
            self.waiting.len()
        )?;
        for p in &self.waiting {
            writeln!(
                f,
                "  {}{}: drain rule {}: the drain waits until it succeeds, fails or is gone; {}",
                fmt_key(&p.pod),
                order_suffix(p),
                p.rule_words(),
                if s.force_after_deadline {
                    "at the deadline minus its grace period it is deleted with its grace period"
                } else {
                    "at the deadline the drain fails naming it, and is retried"
                }
            )?;
        }

        writeln!(
            f,
            "\nDrain rules not understood or in conflict, defaults or the winning rule used ({}):",
            self.rule_problems.len()
        )?;
        for (pod, problem) in &self.rule_problems {
            writeln!(f, "  {}: {problem}", fmt_key(pod))?;
        }

        writeln!(
            f,
            "\nAlready terminating, waited on ({}):",
            self.terminating.len()
        )?;
        for p in &self.terminating {
            write!(f, "  {}: being deleted since {}", fmt_key(&p.pod), p.since)?;
            if !p.pvs.is_empty() {
                write!(
                    f,
                    "; uses PV {}: gone before the first stateful eviction",
                    p.pvs.join(", ")
                )?;
            }
            writeln!(f)?;
        }

        writeln!(
            f,
            "\nStill detaching from pods that left, waited for before the first stateful eviction ({}):",
            self.detaching.len()
        )?;
        for v in &self.detaching {
            match &v.unique_name {
                Some(unique) => writeln!(f, "  PV {} ({unique})", v.pv)?,
                None => writeln!(f, "  PV {}", v.pv)?,
            }
        }
        Ok(())
    }

    /// The pods evicted: without persistent volumes, then those with, in
    /// their sequence.
    fn write_evictions(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.settings;
        writeln!(
            f,
            "\nWithout persistent volumes, evicted concurrently, up to {} at a time ({}):",
            s.max_concurrent_evictions,
            self.stateless.len()
        )?;
        for p in &self.stateless {
            writeln!(f, "  {}{}", fmt_key(&p.pod), order_suffix(p))?;
            write_pdbs_and_notes(f, p, "    ")?;
        }

        let pace = if s.max_parallel_volume_migrations == 1 {
            "one at a time".to_string()
        } else {
            format!("up to {} at a time", s.max_parallel_volume_migrations)
        };
        writeln!(
            f,
            "\nWith persistent volumes, evicted {pace}, by order group, then highest priority first ({}):",
            self.stateful.len()
        )?;
        for (i, p) in self.stateful.iter().enumerate() {
            writeln!(
                f,
                "  {}. {} (priority {}, grace {}{})",
                i + 1,
                fmt_key(&p.pod),
                p.priority,
                format_duration(p.grace),
                order_of(p).map_or_else(String::new, |o| format!(", {o}"))
            )?;
            for v in &p.volumes {
                writeln!(f, "       {v}")?;
                writeln!(f, "         {}", v.wait)?;
            }
            write_pdbs_and_notes(f, p, "       ")?;
        }
        Ok(())
    }

    /// The stateful sequence with the bound of each wait, and its worst
    /// case against the deadline.
    fn write_critical_path(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.settings;
        let path = self.critical_path();
        writeln!(
            f,
            "\nCritical path: worst case {}, {} drain.timeout {}",
            format_duration(path.worst_case),
            if path.worst_case > s.drain_timeout {
                "exceeds"
            } else {
                "within"
            },
            format_duration(s.drain_timeout)
        )?;
        for (i, step) in path.steps.iter().enumerate() {
            writeln!(f, "  {}. {}: {}", i + 1, fmt_key(&step.pod), step.bounds)?;
        }
        Ok(())
    }
}

/// The drain `status.drain` records, in words: how far it got, what it
/// waits for or what blocks it, and the volume moves in flight (each
/// resumed by a restarted controller before any other stateful eviction).
pub fn in_progress(d: &DrainStatus) -> String {
    let mut out = String::new();
    let Some(started) = &d.started_at else {
        return out;
    };
    match &d.finished_at {
        Some(done) => out.push_str(&format!(
            "Drain started at {}, ended at {} ({} of {} pods evicted)\n",
            started.0, done.0, d.pods_evicted, d.pods_total
        )),
        None => out.push_str(&format!(
            "Drain in progress since {} ({} of {} pods evicted, {} left)\n",
            started.0, d.pods_evicted, d.pods_total, d.pods_remaining
        )),
    }
    if let Some(w) = &d.waiting_for {
        out.push_str(&format!("  waiting for: {w}\n"));
    }
    if let Some(b) = &d.blocked_by {
        out.push_str(&format!("  blocked by: {b}\n"));
    }
    if let Some(w) = &d.waiting_for_budget {
        out.push_str(&format!("  waiting for a move budget: {w}\n"));
    }
    if !d.moves.is_empty() {
        out.push_str(
            "  volume moves in flight (each waited for before the next stateful eviction):\n",
        );
        for m in &d.moves {
            out.push_str(&format!("    {}: {}\n", m.pod, m.volumes.join(", ")));
        }
    }
    out
}

/// The remediation of the Machine, as its status records it: the step
/// under way (`status.remediation`) and the `Remediation` condition, which
/// also says why none is under way (held by `maxUnhealthy`, off, an
/// invalid setting, canceled). Empty when the Machine has neither.
pub fn remediation(s: &MachineStatus) -> String {
    let mut out = String::new();
    if let Some(r) = &s.remediation {
        out.push_str(&format!(
            "Remediation of Node {} since {}: step {} (fence {}){}\n  why: {}\n",
            r.node,
            r.started_at.0,
            r.step.as_str(),
            match r.fence {
                Fence::Stop => "Stop",
                Fence::Terminate => "Terminate",
            },
            match (&r.fenced_at, &r.freed_at) {
                (_, Some(t)) => format!(", freed at {}", t.0),
                (Some(t), None) => format!(", fenced at {}", t.0),
                (None, None) => String::new(),
            },
            r.reason
        ));
    }
    if let Some(c) = s.conditions.iter().find(|c| c.type_ == REMEDIATION) {
        out.push_str(&format!("Remediation: {}: {}\n", c.reason, c.message));
    }
    out
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;
    use crate::api::VolumeMove;

    #[test]
    fn a_drain_in_progress_names_its_wait_its_block_and_its_moves() {
        assert_eq!(in_progress(&DrainStatus::default()), "", "never started");
        let started = "2026-11-23T09:00:00Z".parse().expect("time");
        let d = DrainStatus {
            started_at: Some(Time(started)),
            pods_total: 3,
            pods_evicted: 1,
            pods_remaining: 2,
            waiting_for: Some("pv-db-0 to detach from Node n1".into()),
            blocked_by: Some("PodDisruptionBudget web".into()),
            moves: vec![VolumeMove {
                pod: "db/db-0".into(),
                uid: Some("u0".into()),
                volumes: vec!["pv-db-0".into()],
                ..VolumeMove::default()
            }],
            ..DrainStatus::default()
        };
        let text = in_progress(&d);
        for needle in [
            "Drain in progress since 2026-11-23T09:00:00Z (1 of 3 pods evicted, 2 left)",
            "waiting for: pv-db-0 to detach from Node n1",
            "blocked by: PodDisruptionBudget web",
            "db/db-0: pv-db-0",
        ] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
    }

    #[test]
    fn the_remediation_says_its_step_and_why_or_why_none() {
        use crate::api::remediation::{RemediationStatus, RemediationStep};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
        assert_eq!(remediation(&MachineStatus::default()), "");
        let at = |s: &str| Time(s.parse().expect("time"));
        let held = MachineStatus {
            conditions: vec![Condition {
                type_: REMEDIATION.into(),
                status: "False".into(),
                reason: "RemediationHeld".into(),
                message: "3 of 5 Machines in its pool are unhealthy".into(),
                last_transition_time: at("2026-11-23T09:00:00Z"),
                observed_generation: None,
            }],
            ..MachineStatus::default()
        };
        assert_eq!(
            remediation(&held),
            "Remediation: RemediationHeld: 3 of 5 Machines in its pool are unhealthy\n"
        );
        let fenced = MachineStatus {
            remediation: Some(RemediationStatus {
                step: RemediationStep::Free,
                node: "n1".into(),
                reason: "Node n1 has been Ready False for 5m".into(),
                fence: Fence::Stop,
                started_at: at("2026-11-23T09:00:00Z"),
                escalated_at: None,
                fenced_at: Some(at("2026-11-23T09:00:20Z")),
                freed_at: None,
            }),
            ..MachineStatus::default()
        };
        let text = remediation(&fenced);
        assert!(
            text.starts_with(
                "Remediation of Node n1 since 2026-11-23T09:00:00Z: step Free (fence Stop), fenced at 2026-11-23T09:00:20Z\n  why: Node n1 has been Ready False for 5m\n"
            ),
            "{text}"
        );
    }
}
