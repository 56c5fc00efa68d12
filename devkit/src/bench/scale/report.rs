//! The scale scenario's lines of the printed table.

use super::*;

pub(super) fn opt(v: Option<f64>, precision: usize) -> String {
    v.map(|v| format!("{v:.precision$}"))
        .unwrap_or_else(|| "-".into())
}

pub(super) fn verdict(pass: bool) -> &'static str {
    if pass { "pass" } else { "FAIL" }
}

/// The scale scenario's lines of the printed table.
pub fn table(s: &Scale) -> String {
    let c = &s.counted;
    let mut out = format!(
        "scale: {} Machines, {} Nodes, {} pods, {} VolumeAttachments, {} PersistentVolumes (counted); {} concurrent drains of {} pods; populated in {} s, settled {} s later\n",
        c.machines,
        c.nodes,
        c.pods,
        c.volume_attachments,
        c.persistent_volumes,
        s.drains.len(),
        s.drained_pods,
        opt(s.populate_seconds, 0),
        opt(s.settle_seconds, 0),
    );
    out.push_str(&format!(
        "  restarted controller: ready (caches synced) in {} s, its pass over every Machine done in {} s\n",
        opt(s.ready_seconds, 1),
        opt(s.sync_seconds, 1),
    ));
    out.push_str(
        "  phase      seconds  CPU s  cores  machine busy cores  RSS end MiB  RSS peak MiB  reconciles  API writes\n",
    );
    for p in &s.phases {
        out.push_str(&format!(
            "  {:<9} {:>8.1}  {:>5}  {:>5}  {:>18}  {:>11}  {:>12}  {:>10}  {:>10}\n",
            p.name,
            p.seconds,
            opt(p.cpu_seconds, 1),
            opt(p.cpu_cores, 2),
            opt(p.machine_busy_cores, 2),
            opt(p.rss_end_mib, 1),
            opt(p.rss_peak_sampled_mib, 1),
            opt(p.reconciles, 0),
            p.api_writes,
        ));
    }
    for p in s.phases.iter().filter(|p| !p.bed_cores.is_empty()) {
        let mut by_use: Vec<(&String, &f64)> = p.bed_cores.iter().collect();
        by_use.sort_by(|a, b| b.1.total_cmp(a.1));
        let parts: Vec<String> = by_use
            .iter()
            .map(|(name, cores)| format!("{name} {cores:.2}"))
            .collect();
        out.push_str(&format!(
            "  {:<9} test bed cores: {}\n",
            p.name,
            parts.join(", ")
        ));
    }
    if !s.bed_writes_during_drains.is_empty() {
        let mut by_count: Vec<(&String, &u64)> = s.bed_writes_during_drains.iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let total: u64 = by_count.iter().map(|(_, n)| **n).sum();
        let top: Vec<String> = by_count
            .iter()
            .take(12)
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect();
        out.push_str(&format!(
            "  writes the API server served during the drains (every client): {total}; {}\n",
            top.join(", ")
        ));
    }
    out.push_str(&format!(
        "  peak RSS {} MiB (populating {}, after restart {}), {} MiB after sync: target <= {:.0} MiB {}\n",
        opt(s.peak_rss_mib, 1),
        opt(s.populate_peak_rss_mib, 1),
        opt(s.measured_peak_rss_mib, 1),
        opt(s.rss_after_sync_mib, 1),
        s.targets.peak_rss_mib,
        verdict(s.targets.peak_rss_pass),
    ));
    out.push_str(&format!(
        "  slowest drain over its floor by {} s: target <= {:.0} s {}\n",
        opt(s.max_over_floor_seconds, 1),
        s.targets.over_floor_seconds,
        verdict(s.targets.drains_pass),
    ));
    out.push_str(&format!(
        "    of which the cluster's own steps: up to {} s over a floor; the controller's part of any drain: at most {} s ({} on the same bound)\n",
        opt(s.max_cluster_over_floor_seconds, 1),
        opt(s.max_controller_seconds, 1),
        verdict(s.targets.controller_share_pass),
    ));
    if !s.steps_seconds.is_empty() {
        out.push_str("  where the time went, per pod (s): step  n  p50 / p99 / max\n");
    }
    for (step, g) in &s.steps_seconds {
        out.push_str(&format!(
            "    {:<40} {:>4}  {} / {} / {}\n",
            step,
            g.n,
            opt(g.p50, 3),
            opt(g.p99, 3),
            opt(g.max, 3)
        ));
    }
    for d in &s.drains {
        out.push_str(&format!(
            "    {:<14} stateful {:>2}  stateless {:>3}  floor {:>5.1} s  wall {:>6} s  over {:>5} s  (cluster {:>5} s, controller {:>5} s, first eviction after {:>5} s)  gone {:>6} s  {}\n",
            d.machine,
            d.stateful_pods,
            d.stateless_pods,
            d.floor_seconds,
            opt(d.wall_seconds, 1),
            opt(d.over_floor_seconds, 1),
            opt(d.cluster_seconds, 1),
            opt(d.controller_seconds, 1),
            opt(d.first_eviction_seconds, 1),
            opt(d.gone_seconds, 1),
            d.outcome.as_deref().unwrap_or("no drain Event"),
        ));
    }
    if let Some(n) = &s.note {
        out.push_str(&format!("  note: {n}\n"));
    }
    out
}
