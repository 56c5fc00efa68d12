//! The `berth run` process, as an operator runs it: the real binary against
//! a real kube-apiserver, observed through its logs, its HTTP port and the
//! cluster.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth::api::{Machine, MachineClass};
use berth::testbed::{Options, TestBed, fixtures, wait};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::Notify;

const LONG: Duration = Duration::from_secs(60);

/// A running `berth run` child process.
struct Berth {
    child: tokio::process::Child,
    port: u16,
    logs: Arc<Mutex<Vec<String>>>,
    logged: Arc<Notify>,
}

impl Berth {
    fn spawn(bed: &TestBed, extra: &[&str]) -> Self {
        let port = free_port();
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_berth"))
            .arg("run")
            .arg("--kubeconfig")
            .arg(bed.kubeconfig_path())
            .arg(format!("--metrics-addr=127.0.0.1:{port}"))
            .args(extra)
            .env("BERTH_LOG", "info,berth=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("berth starts");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let logged = Arc::new(Notify::new());
        let stderr = child.stderr.take().expect("stderr is piped");
        let (l, n) = (Arc::clone(&logs), Arc::clone(&logged));
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("[berth:{port}] {line}");
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

    fn logs_contain(&self, needle: &str) -> bool {
        self.logs
            .lock()
            .expect("log lock")
            .iter()
            .any(|l| l.contains(needle))
    }

    /// Waits for a log line containing `needle` (driven by the log reader).
    async fn wait_log(&self, needle: &str) {
        let wait = async {
            loop {
                let notified = self.logged.notified();
                if self.logs_contain(needle) {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(LONG, wait)
            .await
            .unwrap_or_else(|_| panic!("no log line containing {needle:?}"));
    }

    async fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.port, path).await
    }

    /// Waits until `path` answers `status`. The HTTP port has no watch, so
    /// this probes it the way a kubelet would.
    async fn wait_http(&self, path: &str, status: u16) {
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

    /// Waits until `/metrics` contains every one of `lines`.
    async fn wait_metrics(&self, lines: &[&str]) {
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

    /// SIGTERM, then the exit status.
    async fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().expect("running");
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(sent.success());
        tokio::time::timeout(LONG, self.child.wait())
            .await
            .expect("exits after SIGTERM")
            .expect("exit status")
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("berth=info")
        .with_test_writer()
        .try_init();
}

fn class(name: &str) -> MachineClass {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "berth.dev/v1alpha1",
        "kind": "MachineClass",
        "metadata": {"name": name},
        "spec": {"provider": "fake", "providerSpec": {}, "creationTimeout": "10m"}
    }))
    .expect("class")
}

fn machine(name: &str, class: &str) -> Machine {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "berth.dev/v1alpha1",
        "kind": "Machine",
        "metadata": {"name": name},
        "spec": {"classRef": {"name": class}}
    }))
    .expect("machine")
}

/// The `reportingInstance` of every Event about Machine `name`, once there
/// is at least one.
async fn reporters(client: &Client, ns: &str, name: &str) -> Vec<String> {
    let events = wait::until(
        Api::<Event>::namespaced(client.clone(), ns),
        LONG,
        &format!("events about {name}"),
        |evs| {
            evs.iter()
                .any(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        },
    )
    .await
    .expect("the controller records Events");
    events
        .iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| e.reporting_instance.clone().unwrap_or_default())
        .collect()
}

async fn holder(client: &Client, ns: &str) -> String {
    let lease = wait::for_one(
        Api::<Lease>::namespaced(client.clone(), ns),
        LONG,
        "a held Lease",
        |l: &Lease| {
            l.name_any() == "berth-controller"
                && l.spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.as_deref())
                    .is_some_and(|h| !h.is_empty())
        },
    )
    .await
    .expect("someone holds the Lease");
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_crds_get_a_clear_message_then_berth_starts_by_itself() {
    init_logs();
    let bed = TestBed::start(Options::integration()).await.expect("bed");
    let client = bed.client().await.expect("client");

    let berth = Berth::spawn(&bed, &["--leader-elect=false"]);
    berth.wait_log("machines.berth.dev is not installed").await;
    assert!(berth.logs_contain("berth crd | kubectl apply"));
    berth.wait_http("/healthz", 200).await;
    assert_eq!(
        berth.get("/readyz").await.map(|(s, _)| s),
        Some(503),
        "not ready without CRDs"
    );
    assert!(
        !berth.logs_contain("panicked") && !berth.logs_contain("stack backtrace"),
        "a clear message, not a crash"
    );

    berth::api::install_crds(client.clone(), LONG)
        .await
        .expect("CRDs installed");
    berth.wait_log("caches synced").await;
    berth.wait_http("/readyz", 200).await;

    let status = berth.terminate().await;
    assert!(status.success(), "SIGTERM is a clean exit: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_only_the_leader_acts_and_sigterm_hands_over() {
    init_logs();
    let bed = TestBed::start(Options::integration()).await.expect("bed");
    let client = bed.client().await.expect("client");
    berth::api::install_crds(client.clone(), LONG)
        .await
        .expect("CRDs installed");
    let ns = "replicas";
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &fixtures::namespace(ns))
        .await
        .expect("namespace");
    Api::<MachineClass>::all(client.clone())
        .create(&PostParams::default(), &class("fake-small"))
        .await
        .expect("class");

    let flags = |id: &'static str| {
        [
            "--identity",
            id,
            "--lease-namespace",
            ns,
            "--lease-duration=4s",
            "--namespace",
            ns,
        ]
    };
    let a = Berth::spawn(&bed, &flags("replica-a"));
    let b = Berth::spawn(&bed, &flags("replica-b"));
    let first = holder(&client, ns).await;
    let (leader, standby) = if first == "replica-a" { (a, b) } else { (b, a) };
    let second = if first == "replica-a" {
        "replica-b"
    } else {
        "replica-a"
    };
    leader.wait_log("caches synced").await;
    standby.wait_log("waiting to become leader").await;
    standby.wait_http("/readyz", 200).await;

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    machines
        .create(&PostParams::default(), &machine("m1", "fake-small"))
        .await
        .expect("m1");
    let by = reporters(&client, ns, "m1").await;
    assert!(
        by.iter().all(|r| *r == first),
        "only the leader {first} acts on m1: {by:?}"
    );
    let (_, metrics) = standby.get("/metrics").await.expect("standby metrics");
    assert!(metrics.contains("berth_leader 0"), "{metrics}");
    let (_, metrics) = leader.get("/metrics").await.expect("leader metrics");
    assert!(metrics.contains("berth_leader 1"), "{metrics}");
    // The provider call and the phase it leads to land a moment after the
    // first Event.
    leader
        .wait_metrics(&[
            r#"berth_provider_requests_total{driver="fake",op="create",result="ok"} 1"#,
            r#"berth_machines{phase="Creating"} 1"#,
            r#"berth_reconcile_total{result="ok"}"#,
        ])
        .await;

    // SIGTERM: the leader finishes, releases the Lease, and the standby takes
    // over well before the Lease would have expired on its own... or at the
    // latest one lease duration later.
    let status = leader.terminate().await;
    assert!(status.success(), "clean exit on SIGTERM: {status:?}");
    standby.wait_log("became leader").await;
    assert_eq!(holder(&client, ns).await, second);
    machines
        .create(&PostParams::default(), &machine("m2", "fake-small"))
        .await
        .expect("m2");
    let by = reporters(&client, ns, "m2").await;
    assert!(
        by.iter().all(|r| r == second),
        "the new leader {second} acts on m2: {by:?}"
    );
    let m1 = machines.get("m1").await.expect("m1");
    assert!(
        m1.finalizers().iter().any(|f| f == berth::api::FINALIZER),
        "m1 is still owned"
    );
    let status = standby.terminate().await;
    assert!(status.success());
}
