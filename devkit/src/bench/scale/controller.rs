//! The controller under measure: `berth run` as a child process, its
//! memory sampled, its CPU time and reconciles read by phase.

use super::*;

/// A `berth run` child process: the same binary, under the bench
/// ServiceAccount's kubeconfig, fake provider, Machines of the bench
/// namespace only, no leader election. Its resident memory is sampled in
/// the background; it is killed if dropped, and (through `setpriv
/// --pdeathsig`, where available, as the test bed's components) if the
/// benchmark dies.
pub(super) struct Controller {
    child: tokio::process::Child,
    pid: u32,
    port: u16,
    log: PathBuf,
    samples: Arc<Mutex<Vec<(Instant, u64)>>>,
    sampler: tokio::task::JoinHandle<()>,
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.sampler.abort();
    }
}

/// The controller binary the scale scenario runs as its own process: the
/// `berth` built beside this `berth-dev` (`make bench` builds both).
pub(super) fn berth_binary() -> anyhow::Result<PathBuf> {
    let dev = std::env::current_exe()?;
    let berth = dev.with_file_name("berth");
    anyhow::ensure!(
        berth.exists(),
        "the scale scenario runs the controller as `berth run`, and {} is not built \
         (`cargo build --release --locked --workspace --bins` builds it beside berth-dev)",
        berth.display()
    );
    Ok(berth)
}

impl Controller {
    pub(super) fn spawn(kubeconfig: &Path, log: &Path) -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let out = std::fs::File::create(log)
            .with_context(|| format!("creating the controller log {}", log.display()))?;
        let exe = berth_binary()?;
        let setpriv = Path::new("/usr/bin/setpriv");
        let mut command = if setpriv.exists() {
            let mut c = tokio::process::Command::new(setpriv);
            c.args(["--pdeathsig", "KILL", "--"]).arg(exe);
            c
        } else {
            tokio::process::Command::new(exe)
        };
        let child = command
            .arg("run")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg(format!("--namespace={NS}"))
            .arg(format!("--metrics-addr=127.0.0.1:{port}"))
            .arg("--leader-elect=false")
            .arg("--providers=fake")
            .env("BERTH_LOG", "info")
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .context("starting `berth run`")?;
        let pid = child.id().context("the controller exited at once")?;
        let samples = Arc::new(Mutex::new(Vec::new()));
        let sampler = tokio::spawn(sample_rss(pid, Arc::clone(&samples)));
        Ok(Self {
            child,
            pid,
            port,
            log: log.to_path_buf(),
            samples,
            sampler,
        })
    }

    pub(super) fn proc(&self, file: &str) -> Option<String> {
        std::fs::read_to_string(format!("/proc/{}/{file}", self.pid)).ok()
    }

    pub(super) fn cpu_seconds(&self) -> Option<f64> {
        stat_cpu_ticks(&self.proc("stat")?).map(|t| t as f64 / CLOCK_TICKS_PER_SECOND)
    }

    pub(super) fn status_mib(&self, key: &str) -> Option<f64> {
        status_kib(&self.proc("status")?, key).map(|k| k as f64 / 1024.0)
    }

    pub(super) fn peak_sampled_since(&self, since: Instant) -> Option<f64> {
        self.samples
            .lock()
            .ok()?
            .iter()
            .filter(|(t, _)| *t >= since)
            .map(|(_, kib)| *kib)
            .max()
            .map(|k| k as f64 / 1024.0)
    }

    /// Closes `phase` now; `cpu_before` and `reconciles_before` are the
    /// readings at its start. Returns the CPU reading at its end.
    pub(super) async fn end_phase(
        &self,
        phase: &mut Phase,
        bed: &TestBed,
        started: Instant,
        cpu_before: f64,
        reconciles_before: Option<f64>,
    ) -> f64 {
        phase.to = Timestamp::now();
        phase.seconds = started.elapsed().as_secs_f64();
        phase.bed_cores =
            cores_between(&phase.bed_from, &process_ticks(&bed.pids()), phase.seconds);
        let cpu = self.cpu_seconds();
        phase.cpu_seconds = cpu.map(|c| c - cpu_before);
        phase.cpu_cores = phase
            .cpu_seconds
            .map(|c| c / phase.seconds.max(f64::EPSILON));
        phase.machine_busy_cores = match (phase.machine_busy_from, machine_busy_ticks()) {
            (Some(a), Some(b)) => Some(cores(b.saturating_sub(a), phase.seconds)),
            _ => None,
        };
        phase.rss_end_mib = self.status_mib("VmRSS");
        phase.rss_peak_sampled_mib = self.peak_sampled_since(started);
        let now = self.reconciles().await;
        phase.reconciles = match (now, reconciles_before) {
            (Some(n), Some(b)) => Some(n - b),
            (n, None) => n,
            (None, _) => None,
        };
        eprintln!(
            "scale: {} {:.1}s: CPU {:.1}s (machine busy {:.2} cores), RSS {:.1} MiB (peak sampled {:.1}), {} reconciles",
            phase.name,
            phase.seconds,
            phase.cpu_seconds.unwrap_or(f64::NAN),
            phase.machine_busy_cores.unwrap_or(f64::NAN),
            phase.rss_end_mib.unwrap_or(f64::NAN),
            phase.rss_peak_sampled_mib.unwrap_or(f64::NAN),
            phase.reconciles.unwrap_or(f64::NAN)
        );
        cpu.unwrap_or(cpu_before)
    }

    /// A GET on the controller's HTTP port: status and body.
    pub(super) async fn get(&self, path: &str) -> Option<(u16, String)> {
        crate::testbed::http_get(self.port, path).await
    }

    pub(super) async fn reconciles(&self) -> Option<f64> {
        let (_, body) = self.get("/metrics").await?;
        metric_sum(&body, "berth_reconcile_total")
    }

    pub(super) fn exited(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            anyhow::bail!(
                "the controller exited ({status}); last lines of {}:\n{}",
                self.log.display(),
                crate::testbed::tail(&self.log)
            );
        }
        Ok(())
    }

    /// The HTTP port has no watch: it is probed, as a kubelet would.
    pub(super) async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.exited()?;
            if self.get("/readyz").await.is_some_and(|(s, _)| s == 200) {
                return Ok(());
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "the controller was not ready after {timeout:?}; last lines of {}:\n{}",
                    self.log.display(),
                    crate::testbed::tail(&self.log)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// After the sync every Machine is reconciled once more. Waits until
    /// that pass is over: `berth_reconcile_total` has reached `machines`
    /// and then grew by less than a tenth of `machines` in a second (the
    /// Node heartbeats alone wake about a thirtieth of the Machines a
    /// second).
    pub(super) async fn wait_settled(
        &mut self,
        machines: f64,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last: Option<f64> = None;
        loop {
            self.exited()?;
            let now = self.reconciles().await;
            if let (Some(n), Some(l)) = (now, last)
                && n >= machines
                && n - l < settled_rate(machines)
            {
                return Ok(());
            }
            last = now;
            if Instant::now() > deadline {
                anyhow::bail!("the controller's reconciles had not settled after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// SIGTERM, then up to a minute for a graceful exit before SIGKILL.
    pub(super) async fn stop(mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status();
        if tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .is_err()
        {
            eprintln!("scale: the controller ignored SIGTERM for 60s; killing it");
            let _ = self.child.kill().await;
        }
    }
}
