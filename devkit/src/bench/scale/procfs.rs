//! What `/proc` says of a process and of the machine: resident memory,
//! CPU ticks, and the mean cores between two readings.

use super::*;

/// A `kB` field of `/proc/<pid>/status` (`VmRSS`, `VmHWM`), in KiB.
pub fn status_kib(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == key).then(|| v.split_whitespace().next()?.parse().ok())?
    })
}

/// `utime + stime` from `/proc/<pid>/stat`, in clock ticks. The command
/// name (field 2) may contain spaces and parentheses, so fields are counted
/// from its closing parenthesis.
pub fn stat_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state (3), ppid (4), …, utime (14), stime (15).
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Busy time of the whole machine from `/proc/stat`'s `cpu` line, in clock
/// ticks: every column but `idle` and `iowait` (guest time is already in
/// `user` and `nice`, so the two guest columns are left out too).
pub fn busy_ticks(proc_stat: &str) -> Option<u64> {
    let line = proc_stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice]
    let (user, nice, system, irq, softirq) = (v[0], v[1], v[2], *v.get(5)?, *v.get(6)?);
    let steal = v.get(7).copied().unwrap_or(0);
    Some(user + nice + system + irq + softirq + steal)
}

pub(super) fn machine_busy_ticks() -> Option<u64> {
    busy_ticks(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// CPU ticks so far of each named process (those that have exited are
/// left out).
pub(super) fn process_ticks(pids: &[(String, u32)]) -> BTreeMap<String, u64> {
    pids.iter()
        .filter_map(|(name, pid)| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            Some((name.clone(), stat_cpu_ticks(&stat)?))
        })
        .collect()
}

/// Mean cores of `ticks` of CPU time spent over `seconds`.
pub(super) fn cores(ticks: u64, seconds: f64) -> f64 {
    ticks as f64 / CLOCK_TICKS_PER_SECOND / seconds.max(f64::EPSILON)
}

/// Mean cores of each process between two [`process_ticks`] readings
/// `seconds` apart.
pub fn cores_between(
    from: &BTreeMap<String, u64>,
    to: &BTreeMap<String, u64>,
    seconds: f64,
) -> BTreeMap<String, f64> {
    to.iter()
        .filter_map(|(name, t)| {
            let busy = t.checked_sub(*from.get(name)?)?;
            Some((name.clone(), cores(busy, seconds)))
        })
        .collect()
}

/// Samples `VmRSS` of `pid` every [`SAMPLE_EVERY`] until it is gone.
pub(super) async fn sample_rss(pid: u32, samples: Arc<Mutex<Vec<(Instant, u64)>>>) {
    let mut every = tokio::time::interval(SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return;
        };
        if let (Some(kib), Ok(mut s)) = (status_kib(&status, "VmRSS"), samples.lock()) {
            s.push((Instant::now(), kib));
        }
    }
}
