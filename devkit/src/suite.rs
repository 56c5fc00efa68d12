//! `berth-dev suite`: the whole test suite (`make test`), its test binaries
//! side by side.
//!
//! The end-to-end binaries spend their time waiting (kwok's delays, the
//! drains' timeouts, readiness holds): run one after another, as `cargo
//! test` does, they kept a 2-core machine at a load of 0.5 for most of an
//! hour. Each binary is a group of cases that share state (its test beds,
//! started once per process, and the identities on them) and nothing else:
//! its cases have namespaces of their own, and two binaries share nothing
//! at all. So the unit of scheduling is the binary: up to `--jobs` of them
//! run at once, each with its own beds, the longest first (by the times of
//! the last run, kept in the report folder), and a binary that needs the
//! machine to itself ([`ALONE`]) runs after the others, alone. Within a
//! binary, libtest runs `--test-threads` of its cases at once (4 by
//! default: they too mostly wait).
//!
//! Each binary's output is kept in a file of its own and printed whole when
//! it ends, so that the log reads one binary at a time; the run ends with a
//! table of the binaries and their times, and one line of totals.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Deserialize;
use tokio::process::Command;

/// Each binary's time in a measured run, seconds: the order of a run with
/// no times of its own yet (a fresh clone), so that it too starts with the
/// longest (the release build, the ledger) rather than by name.
const DEFAULT_TIMES: &str = include_str!("suite-times.json");

/// Test binaries that need the machine to themselves: they run after the
/// others, one at a time. Named as [`Job::name`] names them.
pub const ALONE: &[&str] = &[];

#[derive(Debug, clap::Args)]
pub struct SuiteArgs {
    /// Cargo's JSON messages of the build of the tests (`cargo test
    /// --no-run --message-format=json`), listing the test binaries.
    #[arg(long)]
    pub artifacts: PathBuf,
    /// How many test binaries run at once.
    #[arg(long, default_value_t = 4, env = "BERTH_SUITE_JOBS")]
    pub jobs: usize,
    /// How many cases of one binary run at once (libtest's
    /// `--test-threads`): its cases wait on the cluster far more than they
    /// compute.
    #[arg(long, default_value_t = 4, env = "BERTH_SUITE_TEST_THREADS")]
    pub test_threads: usize,
    /// A binary still running after this is killed and counted failed.
    #[arg(long, default_value = "25m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Where each binary's output and the times of the run are kept.
    #[arg(long, default_value = "target/suite")]
    pub report: PathBuf,
    /// Also run this test binary with these arguments, as a job of its own
    /// at low priority: `NAME=BINARY_NAME ARGS...` (the release build's
    /// test: `release=berth::chart --ignored --exact
    /// make_release_builds_a_working_binary`).
    #[arg(long = "extra", value_name = "NAME=BINARY ARGS")]
    pub extra: Vec<String>,
    /// Only the binaries whose name contains one of these.
    #[arg(long)]
    pub only: Vec<String>,
}

/// One test binary to run, with its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// `package::test` for an integration test, `package (lib)` for unit
    /// tests.
    pub name: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Its package's folder, where `cargo test` runs it.
    pub cwd: PathBuf,
    /// Run at a lower CPU priority (a build, not a test that waits).
    pub nice: bool,
}

#[derive(Deserialize)]
struct Message {
    reason: String,
    #[serde(default)]
    executable: Option<PathBuf>,
    #[serde(default)]
    manifest_path: Option<PathBuf>,
    #[serde(default)]
    profile: Option<Profile>,
    #[serde(default)]
    target: Option<Target>,
    #[serde(default)]
    package_id: String,
}

#[derive(Deserialize)]
struct Profile {
    test: bool,
}

#[derive(Deserialize)]
struct Target {
    name: String,
    kind: Vec<String>,
}

/// The test binaries in cargo's JSON messages, sorted by name.
pub fn jobs_from_artifacts(json: &str) -> Vec<Job> {
    let mut out: Vec<Job> = json
        .lines()
        .filter_map(|l| serde_json::from_str::<Message>(l).ok())
        .filter(|m| m.reason == "compiler-artifact" && m.profile.as_ref().is_some_and(|p| p.test))
        .filter_map(|m| {
            let program = m.executable?;
            let target = m.target?;
            let cwd = m.manifest_path?.parent()?.to_path_buf();
            let package = package_name(&m.package_id);
            let name = if target.kind.iter().any(|k| k == "test") {
                format!("{package}::{}", target.name)
            } else {
                format!("{package} ({})", target.kind.join(","))
            };
            Some(Job {
                name,
                program,
                args: vec![],
                cwd,
                nice: false,
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out.dedup_by(|a, b| a.name == b.name);
    out
}

/// A package's name from its cargo id: `path+file:///w/devkit#berth-devkit@0.1.0`
/// (or the older `berth-devkit 0.1.0 (path+file:///w/devkit)`).
fn package_name(id: &str) -> String {
    if let Some((_, tail)) = id.rsplit_once('#') {
        let name = tail.split('@').next().unwrap_or(tail);
        // `#0.1.0` alone: the name is the path's last part.
        if name.chars().next().is_some_and(|c| c.is_ascii_digit()) {
            let path = id.split('#').next().unwrap_or(id);
            return path.rsplit('/').next().unwrap_or(path).to_string();
        }
        return name.to_string();
    }
    id.split_whitespace().next().unwrap_or(id).to_string()
}

/// `--extra` jobs: `NAME=BINARY ARGS...`, BINARY one of `jobs`' names.
fn extra_jobs(extra: &[String], jobs: &[Job]) -> anyhow::Result<Vec<Job>> {
    extra
        .iter()
        .map(|e| {
            let (name, rest) = e
                .split_once('=')
                .with_context(|| format!("--extra {e:?}: NAME=BINARY ARGS"))?;
            let mut words = rest.split_whitespace();
            let binary = words.next().context("--extra: no binary")?;
            let base = jobs
                .iter()
                .find(|j| j.name == binary)
                .with_context(|| format!("--extra: no test binary {binary}"))?;
            Ok(Job {
                name: name.to_string(),
                args: words.map(String::from).collect(),
                nice: true,
                ..base.clone()
            })
        })
        .collect()
}

/// The order the jobs start in: the longest of the last run first, a job
/// without a time (new) before all, so that the last to start are the
/// shortest and the run ends with little idle. Those named in `alone` are
/// split off, in the same order.
pub fn schedule(
    mut jobs: Vec<Job>,
    last: &BTreeMap<String, f64>,
    alone: &[&str],
) -> (Vec<Job>, Vec<Job>) {
    let time = |j: &Job| last.get(&j.name).copied().unwrap_or(f64::INFINITY);
    jobs.sort_by(|a, b| {
        time(b)
            .partial_cmp(&time(a))
            .unwrap_or(std::cmp::Ordering::Equal)
            .then_with(|| a.name.cmp(&b.name))
    });
    jobs.into_iter()
        .partition(|j| !alone.contains(&j.name.as_str()))
}

/// What libtest said about one binary: the sums of its `test result:`
/// lines.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub passed: usize,
    pub failed: usize,
    pub ignored: usize,
    /// Whether a `test result:` line was there at all.
    pub reported: bool,
}

/// The counts of libtest's output `out`.
pub fn counts(out: &str) -> Counts {
    let mut c = Counts::default();
    for line in out.lines() {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            continue;
        };
        c.reported = true;
        for part in rest.split(['.', ';']) {
            let mut words = part.split_whitespace();
            let (Some(n), Some(what)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<usize>() else { continue };
            match what {
                "passed" => c.passed += n,
                "failed" => c.failed += n,
                "ignored" => c.ignored += n,
                _ => {}
            }
        }
    }
    c
}

struct Done {
    job: Job,
    seconds: f64,
    counts: Counts,
    ok: bool,
    why: Option<String>,
}

pub async fn run(args: SuiteArgs) -> anyhow::Result<()> {
    let json = std::fs::read_to_string(&args.artifacts)
        .with_context(|| format!("reading {}", args.artifacts.display()))?;
    let mut jobs = jobs_from_artifacts(&json);
    if jobs.is_empty() {
        bail!("no test binary in {}", args.artifacts.display());
    }
    let extra = extra_jobs(&args.extra, &jobs)?;
    jobs.extend(extra);
    if !args.only.is_empty() {
        jobs.retain(|j| args.only.iter().any(|o| j.name.contains(o.as_str())));
    }
    for j in &mut jobs {
        j.args
            .push(format!("--test-threads={}", args.test_threads.max(1)));
    }
    std::fs::create_dir_all(&args.report)?;
    let times_path = args.report.join("times.json");
    let mut last: BTreeMap<String, f64> =
        serde_json::from_str(DEFAULT_TIMES).context("the default times")?;
    let measured: BTreeMap<String, f64> = std::fs::read_to_string(&times_path)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    last.extend(measured);
    let (together, alone) = schedule(jobs, &last, ALONE);
    // Each case's request figures (tests/support/audit.rs), afresh.
    let requests = args.report.join("requests.jsonl");
    let _ = std::fs::remove_file(&requests);
    let requests = std::path::absolute(&requests)?;
    let started = Instant::now();
    say(&format!(
        "{} test binaries, {} at a time{}",
        together.len() + alone.len(),
        args.jobs.max(1),
        if alone.is_empty() {
            String::new()
        } else {
            format!(", then {} alone", alone.len())
        }
    ));
    let mut done = run_all(together, args.jobs.max(1), &args, &requests, started).await;
    done.extend(run_all(alone, 1, &args, &requests, started).await);

    let mut times = last;
    for d in &done {
        times.insert(d.job.name.clone(), (d.seconds * 10.0).round() / 10.0);
    }
    std::fs::write(&times_path, serde_json::to_string_pretty(&times)?)?;

    done.sort_by(|a, b| {
        b.seconds
            .partial_cmp(&a.seconds)
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    println!("\nsuite: binary times, longest first");
    let mut total = Counts::default();
    for d in &done {
        println!(
            "  {:>6.1} s  {:<8} {:<40} {} passed, {} failed, {} ignored{}",
            d.seconds,
            if d.ok { "ok" } else { "FAILED" },
            d.job.name,
            d.counts.passed,
            d.counts.failed,
            d.counts.ignored,
            d.why
                .as_deref()
                .map(|w| format!(" ({w})"))
                .unwrap_or_default()
        );
        total.passed += d.counts.passed;
        total.failed += d.counts.failed;
        total.ignored += d.counts.ignored;
    }
    let broken: Vec<&str> = done
        .iter()
        .filter(|d| !d.ok)
        .map(|d| d.job.name.as_str())
        .collect();
    println!(
        "suite: wall time {:.0} s; failed binaries: {}",
        started.elapsed().as_secs_f64(),
        if broken.is_empty() {
            "none".to_string()
        } else {
            broken.join(", ")
        }
    );
    // A binary that died without its result line counts one failure.
    let failed = total.failed.max(broken.len());
    println!(
        "suite: {} passed, {} failed, {} skipped",
        total.passed, failed, total.ignored
    );
    if !broken.is_empty() {
        bail!(
            "{} test binaries failed: {}",
            broken.len(),
            broken.join(", ")
        );
    }
    Ok(())
}

fn say(msg: &str) {
    eprintln!("suite: {} {msg}", now());
}

fn now() -> String {
    k8s_openapi::jiff::Zoned::now()
        .strftime("%H:%M:%S")
        .to_string()
}

/// Runs `jobs` in their order, `at_once` at a time; what each did, in the
/// order they ended.
async fn run_all(
    jobs: Vec<Job>,
    at_once: usize,
    args: &SuiteArgs,
    requests: &Path,
    t0: Instant,
) -> Vec<Done> {
    let requests = requests.to_path_buf();
    let mut queue = jobs.into_iter();
    let mut running = tokio::task::JoinSet::new();
    let mut done = Vec::new();
    let mut heartbeat = tokio::time::interval(Duration::from_secs(120));
    heartbeat.tick().await;
    let mut names = BTreeMap::<String, Instant>::new();
    loop {
        while running.len() < at_once {
            let Some(job) = queue.next() else { break };
            say(&format!("start {}", job.name));
            names.insert(job.name.clone(), Instant::now());
            let (timeout, report, requests) = (args.timeout, args.report.clone(), requests.clone());
            running.spawn(async move { run_one(job, timeout, &report, &requests).await });
        }
        if running.is_empty() {
            return done;
        }
        tokio::select! {
            Some(joined) = running.join_next() => {
                let d = joined.expect("a job's task");
                names.remove(&d.job.name);
                print_done(&d, &args.report);
                done.push(d);
            }
            _ = heartbeat.tick() => {
                let list: Vec<String> = names
                    .iter()
                    .map(|(n, t)| format!("{n} ({:.0} s)", t.elapsed().as_secs_f64()))
                    .collect();
                say(&format!(
                    "at {:.0} s, running: {}",
                    t0.elapsed().as_secs_f64(),
                    list.join(", ")
                ));
            }
        }
    }
}

fn log_path(report: &Path, name: &str) -> PathBuf {
    let file: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    report.join(format!("{file}.log"))
}

fn print_done(d: &Done, report: &Path) {
    let out = std::fs::read_to_string(log_path(report, &d.job.name)).unwrap_or_default();
    println!(
        "\n===== {} ({:.1} s, {}) =====",
        d.job.name,
        d.seconds,
        if d.ok { "ok" } else { "FAILED" }
    );
    print!("{out}");
    if let Some(why) = &d.why {
        println!("suite: {}: {why}", d.job.name);
    }
    say(&format!(
        "end {} in {:.1} s: {}",
        d.job.name,
        d.seconds,
        if d.ok { "ok" } else { "FAILED" }
    ));
}

/// Runs one job with its output to its log file, killed (with everything
/// it started in its process group) past `timeout`.
async fn run_one(job: Job, timeout: Duration, report: &Path, requests: &Path) -> Done {
    let started = Instant::now();
    let path = log_path(report, &job.name);
    let result = async {
        let log = std::fs::File::create(&path)?;
        let mut cmd = if job.nice {
            let mut c = Command::new("nice");
            c.arg("-n").arg("10").arg(&job.program);
            c
        } else {
            Command::new(&job.program)
        };
        cmd.args(&job.args)
            .env("BERTH_REQUEST_REPORT", requests)
            .current_dir(&job.cwd)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd.spawn()?;
        let pid = child.id();
        match tokio::time::timeout(timeout, child.wait()).await {
            Ok(status) => Ok::<_, std::io::Error>((status?.success(), None)),
            Err(_) => {
                if let Some(pid) = pid {
                    let _ = Command::new("kill")
                        .arg("-KILL")
                        .arg(format!("-{pid}"))
                        .status()
                        .await;
                }
                let _ = child.wait().await;
                Ok((
                    false,
                    Some(format!(
                        "killed after {}",
                        humantime::format_duration(timeout)
                    )),
                ))
            }
        }
    }
    .await;
    let seconds = started.elapsed().as_secs_f64();
    let out = std::fs::read_to_string(&path).unwrap_or_default();
    let counts = counts(&out);
    let (ok, why) = match result {
        Ok((true, None)) if counts.reported => (true, None),
        Ok((true, None)) => (false, Some("no `test result:` line".to_string())),
        Ok((ok, why)) => (ok && why.is_none(), why),
        Err(e) => (false, Some(format!("could not run: {e}"))),
    };
    Done {
        job,
        seconds,
        counts,
        ok,
        why,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ARTIFACTS: &str = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/main#berth@0.1.0","manifest_path":"/w/main/Cargo.toml","target":{"kind":["lib"],"name":"berth"},"profile":{"test":true},"executable":"/w/main/target/debug/deps/berth-aaa"}
{"reason":"compiler-artifact","package_id":"path+file:///w/main#berth@0.1.0","manifest_path":"/w/main/Cargo.toml","target":{"kind":["lib"],"name":"berth"},"profile":{"test":false},"executable":null}
{"reason":"compiler-artifact","package_id":"path+file:///w/main/devkit#berth-devkit@0.1.0","manifest_path":"/w/main/devkit/Cargo.toml","target":{"kind":["test"],"name":"moto"},"profile":{"test":true},"executable":"/w/main/target/debug/deps/moto-bbb"}
{"reason":"compiler-artifact","package_id":"path+file:///w/main#berth@0.1.0","manifest_path":"/w/main/Cargo.toml","target":{"kind":["test"],"name":"drain"},"profile":{"test":true},"executable":"/w/main/target/debug/deps/drain-ccc"}
{"reason":"compiler-artifact","package_id":"path+file:///w/main#berth@0.1.0","manifest_path":"/w/main/Cargo.toml","target":{"kind":["bin"],"name":"berth"},"profile":{"test":false},"executable":"/w/main/target/debug/berth"}
{"reason":"build-finished","success":true}"#;

    #[test]
    fn the_test_binaries_are_read_from_cargos_messages() {
        let jobs = jobs_from_artifacts(ARTIFACTS);
        let names: Vec<&str> = jobs.iter().map(|j| j.name.as_str()).collect();
        assert_eq!(names, ["berth (lib)", "berth-devkit::moto", "berth::drain"]);
        assert_eq!(jobs[1].cwd, Path::new("/w/main/devkit"));
        assert_eq!(
            jobs[2].program,
            Path::new("/w/main/target/debug/deps/drain-ccc")
        );
    }

    #[test]
    fn package_names_from_either_id_form() {
        assert_eq!(
            package_name("path+file:///w/devkit#berth-devkit@0.1.0"),
            "berth-devkit"
        );
        assert_eq!(package_name("path+file:///w/berth#0.1.0"), "berth");
        assert_eq!(package_name("berth 0.1.0 (path+file:///w/main)"), "berth");
    }

    #[test]
    fn an_extra_job_runs_a_binary_with_its_arguments_at_low_priority() {
        let jobs = jobs_from_artifacts(ARTIFACTS);
        let extra =
            extra_jobs(&["release=berth::drain --ignored --exact x".into()], &jobs).unwrap();
        assert_eq!(extra[0].name, "release");
        assert_eq!(extra[0].args, ["--ignored", "--exact", "x"]);
        assert!(extra[0].nice);
        assert!(extra_jobs(&["r=berth::nope".into()], &jobs).is_err());
    }

    #[test]
    fn the_longest_start_first_and_new_ones_before_all() {
        let jobs = jobs_from_artifacts(ARTIFACTS);
        let last = BTreeMap::from([
            ("berth (lib)".to_string(), 2.0),
            ("berth::drain".to_string(), 300.0),
        ]);
        let (together, alone) = schedule(jobs.clone(), &last, &["berth (lib)"]);
        let names: Vec<&str> = together.iter().map(|j| j.name.as_str()).collect();
        assert_eq!(names, ["berth-devkit::moto", "berth::drain"]);
        assert_eq!(alone.len(), 1);
        assert_eq!(alone[0].name, "berth (lib)");
    }

    #[test]
    fn the_default_times_name_the_long_binaries() {
        let t: BTreeMap<String, f64> = serde_json::from_str(DEFAULT_TIMES).unwrap();
        assert!(t["release"] > t["berth (lib)"]);
        assert!(t["berth::ledger"] > t["berth::crd"]);
    }

    #[test]
    fn counts_sum_every_result_line() {
        let out = "running 3 tests\n\
            test a ... ok\n\
            test result: ok. 2 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s\n\
            test result: FAILED. 5 passed; 2 failed; 0 ignored; 0 measured; 9 filtered out; finished in 3.00s\n";
        assert_eq!(
            counts(out),
            Counts {
                passed: 7,
                failed: 2,
                ignored: 1,
                reported: true
            }
        );
        assert!(!counts("thread main panicked").reported);
    }
}
