//! The real `berth` binary as a child process, observed through its logs
//! and its HTTP port.

use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::Notify;

use super::LONG;

/// A `berth run` child process, its stderr captured.
pub struct Berth {
    child: tokio::process::Child,
    port: u16,
    logs: Arc<Mutex<Vec<String>>>,
    logged: Arc<Notify>,
}

impl Berth {
    pub fn spawn(kubeconfig: &Path, extra: &[&str]) -> Self {
        Self::spawn_with(kubeconfig, extra, &[])
    }

    /// As [`Berth::spawn`], with environment variables of its own (cloud
    /// credentials, a crash point of the `fault-injection` build).
    pub fn spawn_with(kubeconfig: &Path, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_berth"))
            .arg("run")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg(format!("--metrics-addr=127.0.0.1:{port}"))
            // The test bed's Nodes are kwok's: the fake provider, asked for.
            .arg("--providers=fake")
            .args(extra)
            .env("BERTH_LOG", "info,berth=debug")
            .envs(env.iter().copied())
            .env_remove("KUBECONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("berth starts");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let logged = Arc::new(Notify::new());
        let stderr = child.stderr.take().expect("stderr");
        let (l, n) = (Arc::clone(&logs), Arc::clone(&logged));
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("[berth] {line}");
                l.lock().expect("log lock").push(line);
                n.notify_waiters();
            }
        });
        Self {
            child,
            port,
            logs,
            logged,
        }
    }

    pub fn log_lines_matching(&self, needle: &str) -> Vec<String> {
        let needle = needle.to_lowercase();
        self.log_lines_where(|l| l.to_lowercase().contains(&needle))
    }

    /// The log lines so far for which `matches` holds.
    pub fn log_lines_where(&self, matches: impl Fn(&str) -> bool) -> Vec<String> {
        self.logs
            .lock()
            .expect("log lock")
            .iter()
            .filter(|l| matches(l))
            .cloned()
            .collect()
    }

    pub async fn wait_log(&self, needle: &str) {
        let needle_lc = needle.to_lowercase();
        self.wait_log_line(&format!("containing {needle:?}"), |l| {
            l.to_lowercase().contains(&needle_lc)
        })
        .await;
    }

    /// Waits, woken by each new line, for a log line for which `matches`
    /// holds (`what` names it in the failure), and returns it.
    pub async fn wait_log_line(&self, what: &str, matches: impl Fn(&str) -> bool) -> String {
        let wait = async {
            loop {
                let notified = self.logged.notified();
                if let Some(line) = self.log_lines_where(&matches).into_iter().next() {
                    return line;
                }
                notified.await;
            }
        };
        tokio::time::timeout(LONG, wait)
            .await
            .unwrap_or_else(|_| panic!("no log line {what}"))
    }

    /// Runs `step`, failing at once if the controller logs that the API
    /// server refused it something (a missing RBAC rule), instead of letting
    /// `step` time out.
    pub async fn unforbidden<T>(
        &self,
        what: &str,
        step: impl std::future::Future<Output = T>,
    ) -> T {
        let refused = async {
            loop {
                let notified = self.logged.notified();
                let lines = self.log_lines_matching("forbidden");
                if !lines.is_empty() {
                    return lines;
                }
                notified.await;
            }
        };
        tokio::select! {
            done = step => done,
            lines = refused => panic!(
                "RBAC refused the controller something while {what}:\n{}",
                lines.join("\n")
            ),
        }
    }

    pub async fn get(&self, path: &str) -> Option<(u16, String)> {
        berth_devkit::testbed::http_get(self.port, path).await
    }

    /// The HTTP port has no watch: probe it the way a kubelet would.
    pub async fn wait_http(&self, path: &str, status: u16) {
        let wait = async {
            loop {
                if self.get(path).await.is_some_and(|(s, _)| s == status) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        tokio::time::timeout(LONG, wait)
            .await
            .unwrap_or_else(|_| panic!("{path} never answered {status}"));
    }

    pub async fn terminate(self) -> std::process::ExitStatus {
        self.shut_down().await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Berth::terminate`], saying what went wrong rather than panicking
    /// (for a case's end, which may come while the case is failing); a
    /// process that does not exit is killed as the value drops.
    pub async fn shut_down(mut self) -> Result<std::process::ExitStatus, String> {
        let pid = self.child.id().ok_or("berth had already exited")?;
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .map_err(|e| format!("kill -TERM {pid}: {e}"))?;
        if !sent.success() {
            return Err(format!("kill -TERM {pid}: {sent}"));
        }
        tokio::time::timeout(LONG, self.child.wait())
            .await
            .map_err(|_| "berth did not exit after SIGTERM".to_string())?
            .map_err(|e| format!("berth's exit status: {e}"))
    }

    /// SIGSTOP: the process is frozen wherever it is (a paused VM, a
    /// starved node), its timers running on; [`Berth::resume`] thaws it.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`Berth::freeze`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, which: &str) {
        let pid = self.child.id().expect("running");
        let sent = std::process::Command::new("kill")
            .args([which, &pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "kill {which} {pid}");
    }

    /// SIGKILL: the process stops wherever it is, with no chance to clean
    /// up, as when its node dies or the OOM killer takes it.
    pub async fn kill(mut self) {
        self.child.start_kill().expect("SIGKILL sent");
        tokio::time::timeout(LONG, self.child.wait())
            .await
            .expect("exits after SIGKILL")
            .expect("exit status");
    }

    /// Waits for the process to end by itself (a crash point); its status.
    pub async fn exited(mut self) -> std::process::ExitStatus {
        tokio::time::timeout(LONG, self.child.wait())
            .await
            .expect("exits by itself")
            .expect("exit status")
    }

    pub fn logs_contain(&self, needle: &str) -> bool {
        !self.log_lines_matching(needle).is_empty()
    }

    /// Waits until `/metrics` contains every one of `lines`.
    pub async fn wait_metrics(&self, lines: &[&str]) {
        let wait = async {
            loop {
                if let Some((_, body)) = self.get("/metrics").await
                    && lines.iter().all(|l| body.contains(l))
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        if tokio::time::timeout(LONG, wait).await.is_err() {
            let body = self.get("/metrics").await.map(|(_, b)| b);
            panic!("/metrics never showed {lines:?}: {body:?}");
        }
    }
}
