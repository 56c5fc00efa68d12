//! A real, throw-away Kubernetes control plane on this machine.
//!
//! [`TestBed::start`] launches etcd and kube-apiserver (the
//! [`Profile::Integration`] profile), plus kube-controller-manager,
//! kube-scheduler and kwok for [`Profile::EndToEnd`], from binaries built by
//! `hack/testbed/build.sh`. It waits until they are ready, writes a
//! kubeconfig, and tears everything down when dropped. Each test bed has
//! its own temporary directory and its own ports, so test beds in parallel
//! tests never collide.
//!
//! This is our own launcher rather than `kwokctl --runtime=binary`: kwokctl
//! detaches its components and keeps their state under `~/.kwok`, so a test
//! that panics or is killed leaves them running. Here every process is a
//! child of one supervisor thread with a parent-death signal (see
//! `supervisor`), and every flag the tests rely on (attach and detach
//! delays, audit log) is set explicitly.
//!
//! It never touches a cluster it did not start.

pub mod fixtures;
mod identity;
pub mod loops;
mod pki;
pub mod stages;
pub(crate) mod supervisor;
pub mod timeline;
pub mod wait;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use base64::Engine as _;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub use self::identity::{Identity, service_account_user};
use self::supervisor::{ProcessSpec, Supervisor};

/// The annotations of a simulated Node, as the `fake` provider sets them:
/// kwok manages a Node (and the pods bound to it) with the first, and the
/// attach-detach controller serves one only with the second.
pub use berth::providers::fake::{CONTROLLER_MANAGED_ATTACH_ANNOTATION, KWOK_NODE_ANNOTATION};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("building the test bed failed (hack/testbed/build.sh): {0}")]
    Build(String),
    #[error("test bed I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("generating test bed certificates: {0}")]
    Pki(#[from] rcgen::Error),
    #[error("{component} exited during start-up ({status}); last lines of {log}:\n{tail}")]
    Exited {
        component: String,
        status: String,
        log: String,
        tail: String,
    },
    #[error("{component} was not ready after {waited:?}; last lines of {log}:\n{tail}")]
    NotReady {
        component: String,
        waited: Duration,
        log: String,
        tail: String,
    },
    #[error("kubeconfig: {0}")]
    Kubeconfig(String),
}

/// Which components run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// etcd and kube-apiserver: enough for API-level integration tests.
    Integration,
    /// Also kube-controller-manager, kube-scheduler and kwok: pods are
    /// scheduled and run, volumes attach and detach, PDBs have status.
    EndToEnd,
}

/// Requests a second that kube-controller-manager and kube-scheduler may
/// send (bursts of twice that) in the end-to-end bed. Their defaults (20 and
/// 50) pace the work of many Nodes drained at once: each replacement pod
/// costs the ReplicaSet or StatefulSet controller a create and an Event,
/// the scheduler a binding and an Event, the attach-detach controller a
/// VolumeAttachment. A simulated cluster of 1,000 Nodes on one machine lifts
/// them, as kwokctl does for large simulated clusters; the API server's own
/// limits still apply.
const CONTROL_PLANE_QPS: u32 = 5000;

/// How to start a test bed.
#[derive(Debug, Clone)]
pub struct Options {
    pub profile: Profile,
    /// How long the simulated CSI attacher takes to attach a volume.
    pub attach_delay: Duration,
    /// How long it takes to detach one once the attach-detach controller
    /// asked for it.
    pub detach_delay: Duration,
    /// Write an audit log (metadata level, every request) to `audit.log` in
    /// the test bed's directory, for counting API calls per user.
    pub audit: bool,
    /// With [`Options::audit`]: log only the requests of these users (all
    /// users when empty), to keep the log small on a large test bed.
    pub audit_users: Vec<String>,
    /// How long to wait for each component to become ready.
    pub ready_timeout: Duration,
    /// How often the simulated kubelets refresh a Node's status (kwok's
    /// heartbeat Stage). Longer than the default, the Node Leases are also
    /// renewed less often and the node lifecycle controller waits longer
    /// before it calls a Node unreachable, so that a bed of 1,000 Nodes
    /// spends its 2 cores on the work measured rather than on heartbeats.
    pub node_heartbeat: Duration,
}

impl Options {
    pub fn integration() -> Self {
        Self {
            profile: Profile::Integration,
            attach_delay: Duration::from_millis(500),
            detach_delay: Duration::from_millis(500),
            audit: false,
            audit_users: Vec::new(),
            ready_timeout: Duration::from_secs(90),
            node_heartbeat: stages::DEFAULT_HEARTBEAT,
        }
    }

    pub fn end_to_end() -> Self {
        Self {
            profile: Profile::EndToEnd,
            ..Self::integration()
        }
    }

    pub fn attach_delay(mut self, d: Duration) -> Self {
        self.attach_delay = d;
        self
    }

    pub fn detach_delay(mut self, d: Duration) -> Self {
        self.detach_delay = d;
        self
    }

    pub fn audit(mut self, on: bool) -> Self {
        self.audit = on;
        self
    }

    pub fn node_heartbeat(mut self, every: Duration) -> Self {
        self.node_heartbeat = every;
        self
    }

    /// Seconds of kwok's Node Leases (renewed every quarter of that).
    fn lease_seconds(&self) -> u64 {
        (self.node_heartbeat.as_secs() * 2).max(40)
    }

    /// Audit only the requests of `users` (and turn the audit log on).
    pub fn audit_only(mut self, users: &[&str]) -> Self {
        self.audit = true;
        self.audit_users = users.iter().map(|u| u.to_string()).collect();
        self
    }
}

/// A running control plane. Dropping it stops every process and removes its
/// directory (set `BERTH_TESTBED_KEEP=1` to keep the directory and its logs).
pub struct TestBed {
    // Field order matters: the processes must stop before the directory goes.
    supervisor: Supervisor,
    _dir: Option<tempfile::TempDir>,
    path: PathBuf,
    kubeconfig: PathBuf,
    server: String,
    options: Options,
    pids: std::sync::Mutex<Vec<(String, u32)>>,
}

impl TestBed {
    /// Builds (or reuses) the binaries, starts the components of
    /// `options.profile` and waits until they are ready.
    pub async fn start(options: Options) -> Result<Self, Error> {
        let bin = bin_dir()?;
        sweep_stale_dirs();
        let dir = tempfile::Builder::new().prefix(DIR_PREFIX).tempdir()?;
        let path = dir.path().to_path_buf();
        std::fs::create_dir_all(path.join("logs"))?;
        std::fs::write(path.join(OWNER_FILE), std::process::id().to_string())?;

        let pki = pki::Pki::generate()?;
        for (file, pem) in [
            ("ca.crt", &pki.ca_cert),
            ("apiserver.crt", &pki.serving_cert),
            ("apiserver.key", &pki.serving_key),
            ("sa.pub", &pki.sa_public_key),
            ("sa.key", &pki.sa_private_key),
        ] {
            std::fs::write(path.join(file), pem)?;
        }

        let [etcd_client, etcd_peer, apiserver_port, kwok_port] = free_ports()?;
        let server = format!("https://127.0.0.1:{apiserver_port}");
        let kubeconfig = path.join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_json(&server, &pki))?;

        let bed = Self {
            supervisor: Supervisor::new()?,
            _dir: keep_or(dir, &path),
            path: path.clone(),
            kubeconfig: kubeconfig.clone(),
            server,
            options: options.clone(),
            pids: Default::default(),
        };
        let p = |f: &str| path.join(f).display().to_string();
        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");

        bed.spawn(
            &bin,
            "etcd",
            vec![
                "--name=default".into(),
                format!("--data-dir={}", p("etcd")),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=default={peer_url}"),
                "--unsafe-no-fsync=true".into(),
                "--quota-backend-bytes=8589934592".into(),
                "--log-level=warn".into(),
            ],
        )?;

        let mut apiserver = vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--secure-port={apiserver_port}"),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            // Since 1.37 the API server refuses a loopback advertise
            // address for the `kubernetes` Service's endpoints; nothing on
            // the test bed reaches the API server through that Service.
            "--endpoint-reconciler-type=none".into(),
            format!("--cert-dir={}", p("certs")),
            format!("--tls-cert-file={}", p("apiserver.crt")),
            format!("--tls-private-key-file={}", p("apiserver.key")),
            format!("--client-ca-file={}", p("ca.crt")),
            "--service-cluster-ip-range=10.96.0.0/16".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            "--authorization-mode=RBAC".into(),
            "--allow-privileged=true".into(),
            "--profiling=false".into(),
        ];
        if options.profile == Profile::Integration {
            // Without kube-controller-manager nobody creates the `default`
            // ServiceAccount, and the admission plugin would refuse every pod.
            apiserver.push("--disable-admission-plugins=ServiceAccount".into());
        }
        if options.audit {
            std::fs::write(
                path.join("audit-policy.yaml"),
                audit_policy(&options.audit_users),
            )?;
            apiserver.push(format!("--audit-policy-file={}", p("audit-policy.yaml")));
            apiserver.push(format!("--audit-log-path={}", p("audit.log")));
            apiserver.push("--audit-log-mode=blocking".into());
        }
        wait_http(&bed, "etcd", etcd_client, "/health", options.ready_timeout).await?;
        bed.spawn(&bin, "kube-apiserver", apiserver)?;
        let client = bed.client().await?;
        bed.wait_apiserver(&client).await?;

        if options.profile == Profile::EndToEnd {
            let kc = kubeconfig.display().to_string();
            let mut kcm = vec![
                format!("--kubeconfig={kc}"),
                format!("--kube-api-qps={CONTROL_PLANE_QPS}"),
                format!("--kube-api-burst={}", CONTROL_PLANE_QPS * 2),
            ];
            if options.node_heartbeat != stages::DEFAULT_HEARTBEAT {
                // A Node is unreachable when neither its Lease nor its
                // status was renewed for this long.
                kcm.push(format!(
                    "--node-monitor-grace-period={}s",
                    options.lease_seconds() + 30
                ));
            }
            bed.spawn(
                &bin,
                "kube-controller-manager",
                kcm.into_iter()
                    .chain([
                        "--leader-elect=false".into(),
                        "--secure-port=0".into(),
                        "--controllers=*".into(),
                        "--use-service-account-credentials=false".into(),
                        format!("--service-account-private-key-file={}", p("sa.key")),
                        format!("--root-ca-file={}", p("ca.crt")),
                        "--cluster-name=berth-testbed".into(),
                    ])
                    .collect(),
            )?;
            bed.spawn(
                &bin,
                "kube-scheduler",
                vec![
                    format!("--kubeconfig={kc}"),
                    format!("--authentication-kubeconfig={kc}"),
                    format!("--authorization-kubeconfig={kc}"),
                    "--leader-elect=false".into(),
                    "--secure-port=0".into(),
                    format!("--kube-api-qps={CONTROL_PLANE_QPS}"),
                    format!("--kube-api-burst={}", CONTROL_PLANE_QPS * 2),
                ],
            )?;
            std::fs::write(
                path.join("kwok.yaml"),
                stages::kwok_config(
                    options.attach_delay,
                    options.detach_delay,
                    options.node_heartbeat,
                ),
            )?;
            let (ak, av) = KWOK_NODE_ANNOTATION;
            bed.spawn(
                &bin,
                "kwok",
                vec![
                    format!("--kubeconfig={kc}"),
                    format!("--config={}", p("kwok.yaml")),
                    "--manage-all-nodes=false".into(),
                    format!("--manage-nodes-with-annotation-selector={ak}={av}"),
                    format!("--server-address=127.0.0.1:{kwok_port}"),
                    format!("--node-lease-duration-seconds={}", options.lease_seconds()),
                    "--cidr=10.244.0.0/16".into(),
                ],
            )?;
            wait_http(&bed, "kwok", kwok_port, "/healthz", options.ready_timeout).await?;
            bed.wait_controller_manager(&client).await?;
        }
        Ok(bed)
    }

    /// A kube client with cluster-admin rights on this test bed.
    pub async fn client(&self) -> Result<kube::Client, Error> {
        kube::Client::try_from(self.kube_config().await?)
            .map_err(|e| Error::Kubeconfig(e.to_string()))
    }

    /// The admin client configuration.
    ///
    /// kube's client retries 429 answers by itself (up to 15 times, with
    /// backoff that grows to minutes) unless told not to; an eviction refused
    /// by a PodDisruptionBudget is a 429, and callers here need to see it.
    pub async fn kube_config(&self) -> Result<kube::Config, Error> {
        let kc = Kubeconfig::read_from(&self.kubeconfig)
            .map_err(|e| Error::Kubeconfig(e.to_string()))?;
        let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .map_err(|e| Error::Kubeconfig(e.to_string()))?;
        config.default_retry = false;
        Ok(config)
    }

    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// `https://127.0.0.1:<port>`
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The test bed's directory: kubeconfig, certificates, `logs/`,
    /// `audit.log`.
    pub fn dir(&self) -> &Path {
        &self.path
    }

    pub fn options(&self) -> &Options {
        &self.options
    }

    /// The CA bundle that signs the apiserver's serving certificate (PEM).
    pub fn ca_pem(&self) -> Result<String, Error> {
        Ok(std::fs::read_to_string(self.path.join("ca.crt"))?)
    }

    /// The name and pid of every process this test bed started.
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.pids.lock().map(|p| p.clone()).unwrap_or_default()
    }

    fn spawn(&self, bin: &Path, name: &str, args: Vec<String>) -> Result<(), Error> {
        let pid = self.supervisor.spawn(ProcessSpec {
            name: name.to_string(),
            program: bin.join(name),
            args,
            log: self.log_path(name),
        })?;
        if let Ok(mut pids) = self.pids.lock() {
            pids.push((name.to_string(), pid));
        }
        Ok(())
    }

    fn log_path(&self, name: &str) -> PathBuf {
        self.path.join("logs").join(format!("{name}.log"))
    }

    fn check_alive(&self, name: &str) -> Result<(), Error> {
        match self.supervisor.exited(name) {
            None => Ok(()),
            Some(status) => Err(Error::Exited {
                component: name.to_string(),
                status: status.to_string(),
                log: self.log_path(name).display().to_string(),
                tail: tail(&self.log_path(name)),
            }),
        }
    }

    fn not_ready(&self, name: &str) -> Error {
        Error::NotReady {
            component: name.to_string(),
            waited: self.options.ready_timeout,
            log: self.log_path(name).display().to_string(),
            tail: tail(&self.log_path(name)),
        }
    }

    // Start-up is the one place that polls: there is nothing to watch before
    // the apiserver answers.
    async fn wait_apiserver(&self, client: &kube::Client) -> Result<(), Error> {
        let deadline = Instant::now() + self.options.ready_timeout;
        loop {
            self.check_alive("etcd")?;
            self.check_alive("kube-apiserver")?;
            let req = http::Request::get("/readyz")
                .body(Vec::new())
                .map_err(|e| Error::Kubeconfig(e.to_string()))?;
            if let Ok(body) = client.request_text(req).await
                && body.trim() == "ok"
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.not_ready("kube-apiserver"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// kube-controller-manager is working once its service-account
    /// controller has created the `default` ServiceAccount.
    async fn wait_controller_manager(&self, client: &kube::Client) -> Result<(), Error> {
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
        let cond =
            kube::runtime::wait::await_condition(sas, "default", |sa: Option<&ServiceAccount>| {
                sa.is_some()
            });
        let checks = async {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                for c in ["kube-controller-manager", "kube-scheduler", "kwok"] {
                    self.check_alive(c)?;
                }
            }
        };
        tokio::select! {
            r = tokio::time::timeout(self.options.ready_timeout, cond) => match r {
                Ok(Ok(_)) => Ok(()),
                _ => Err(self.not_ready("kube-controller-manager")),
            },
            e = checks => e,
        }
    }
}

const DIR_PREFIX: &str = "berth-testbed-";
const OWNER_FILE: &str = "owner.pid";

/// A test bed held in a `static` (shared by the tests of one binary) is never
/// dropped: its processes die with the test process (parent-death signal),
/// but its directory stays. Remove such directories whose owner is gone.
fn sweep_stale_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_ours = entry.file_name().to_string_lossy().starts_with(DIR_PREFIX);
        let owner = std::fs::read_to_string(path.join(OWNER_FILE)).ok();
        if let (true, Some(pid)) = (is_ours, owner)
            && !Path::new("/proc").join(pid.trim()).exists()
        {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

fn keep_or(dir: tempfile::TempDir, path: &Path) -> Option<tempfile::TempDir> {
    if std::env::var_os("BERTH_TESTBED_KEEP").is_some() {
        eprintln!("testbed: keeping {}", path.display());
        // A kept directory is never swept.
        let _ = std::fs::remove_file(path.join(OWNER_FILE));
        let _ = dir.keep();
        None
    } else {
        Some(dir)
    }
}

/// The repository this development kit was built in: its scripts
/// (`hack/`) are run from there. A development tool only, so the build
/// machine's path is the right one.
pub fn repo_root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The directory with the test bed's binaries: `$BERTH_TESTBED_BIN`, or what
/// `hack/testbed/build.sh --bin-dir` builds or finds in its cache.
pub fn bin_dir() -> Result<PathBuf, Error> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| cached_tool("BERTH_TESTBED_BIN", "hack/testbed/build.sh"))
        .clone()
        .map_err(Error::Build)
}

/// A tool directory the project builds or installs into a cache of its own:
/// `$<env>` when set, else what `<script> --bin-dir` (run from the
/// repository, its progress on our stderr) prints.
pub(crate) fn cached_tool(env: &str, script: &str) -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os(env) {
        return Ok(PathBuf::from(dir));
    }
    let script = repo_root().join(script);
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg("--bin-dir")
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!("{} exited with {}", script.display(), out.status));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Distinct free loopback ports, all held until every one is chosen.
fn free_ports<const N: usize>() -> Result<[u16; N], Error> {
    let listeners = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()?;
    let mut ports = [0u16; N];
    for (p, l) in ports.iter_mut().zip(&listeners) {
        *p = l.local_addr()?.port();
    }
    Ok(ports)
}

async fn wait_http(
    bed: &TestBed,
    name: &str,
    port: u16,
    path: &str,
    timeout: Duration,
) -> Result<(), Error> {
    let deadline = Instant::now() + timeout;
    loop {
        bed.check_alive(name)?;
        if http_ok(port, path).await {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(bed.not_ready(name));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn http_ok(port: u16, path: &str) -> bool {
    http_get(port, path)
        .await
        .is_some_and(|(status, _)| status == 200)
}

/// A plain HTTP/1.0 GET on a local port: the status and the body, or
/// `None` when nothing answers.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    http_exchange(
        port,
        &format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"),
    )
    .await
}

/// Sends one raw HTTP/1.0 request to `127.0.0.1:port` and returns the
/// response's status and body (`None` if the exchange failed).
pub(crate) async fn http_exchange(port: u16, request: &str) -> Option<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(request.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.ok()?;
    let text = String::from_utf8_lossy(&buf);
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

/// The last 25 lines of a log file.
pub fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(25)..].join("\n")
}

/// The audit policy: every request at Metadata level, or only those of
/// `users` when there are any, their writes with the request's body (the request-loop check tells a write that says something new from
/// one that says the same again: `loops`).
///
/// With users named, the steps of a drain that other clients complete are
/// logged too, whoever sends them: pod creations, bindings and deletions
/// (a replacement created by its controller, placed by the scheduler; kwok
/// deleting a pod once its grace period is over), Node status writes (the
/// attach-detach controller's `volumesAttached`), pod status writes (kwok
/// turning a replacement Ready) and VolumeAttachment
/// writes (the attach-detach controller's and the simulated attacher's),
/// so that the time a drain spends waiting on the cluster can be told from
/// the controller's, and the cluster's time split among its components.
fn audit_policy(users: &[String]) -> String {
    let head = "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n";
    if users.is_empty() {
        return format!("{head}- level: Metadata\n");
    }
    let users = serde_json::to_string(users).unwrap_or_else(|_| "[]".into());
    format!(
        "{head}- level: Request\n  users: {users}\n  verbs: [create, patch, update]\n\
         - level: Metadata\n  users: {users}\n\
         - level: Metadata\n  verbs: [create, delete]\n  resources: [{{group: \"\", resources: [pods, pods/binding]}}]\n\
         - level: Metadata\n  verbs: [patch, update]\n  resources: [{{group: \"\", resources: [nodes/status, pods/status]}}]\n\
         - level: Metadata\n  verbs: [create, update, patch, delete]\n  resources: [{{group: storage.k8s.io, resources: [volumeattachments, volumeattachments/status]}}]\n\
         - level: None\n"
    )
}

fn kubeconfig_json(server: &str, pki: &pki::Pki) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "berth-testbed", "cluster": {
            "server": server,
            "certificate-authority-data": b64(&pki.ca_cert),
        }}],
        "users": [{"name": "admin", "user": {
            "client-certificate-data": b64(&pki.admin_cert),
            "client-key-data": b64(&pki.admin_key),
        }}],
        "contexts": [{"name": "berth-testbed", "context": {"cluster": "berth-testbed", "user": "admin"}}],
        "current-context": "berth-testbed",
    })
    .to_string()
}

/// Creates `obj`, or leaves the one that already exists (409) as it is:
/// the set-up step of the demo, the benchmark and the tests, which may run
/// again on the same control plane.
///
/// # Errors
/// Any other API error.
pub async fn create_or_keep<K>(api: kube::Api<K>, obj: K) -> Result<(), kube::Error>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&kube::api::PostParams::default(), &obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_audit_policy_logs_everyone_or_only_the_users_named() {
        let all = audit_policy(&[]);
        assert!(all.ends_with("rules:\n- level: Metadata\n"), "{all}");
        let some = audit_policy(&["system:serviceaccount:ns:sa".into()]);
        let parsed: serde_json::Value = serde_yaml_ng::from_str(&some).expect("YAML");
        let rules = parsed["rules"].as_array().expect("rules");
        assert_eq!(rules.len(), 6, "{some}");
        assert_eq!(rules[0]["users"][0], "system:serviceaccount:ns:sa");
        assert_eq!(rules[0]["level"], "Request");
        assert_eq!(rules[0]["verbs"][1], "patch");
        assert_eq!(rules[1]["users"][0], "system:serviceaccount:ns:sa");
        assert_eq!(rules[1]["level"], "Metadata");
        assert_eq!(rules[2]["verbs"][1], "delete");
        assert_eq!(rules[2]["resources"][0]["resources"][0], "pods");
        assert_eq!(rules[2]["resources"][0]["resources"][1], "pods/binding");
        assert_eq!(rules[3]["resources"][0]["resources"][0], "nodes/status");
        assert_eq!(rules[3]["resources"][0]["resources"][1], "pods/status");
        assert_eq!(rules[4]["resources"][0]["group"], "storage.k8s.io");
        assert_eq!(
            rules[4]["resources"][0]["resources"][1],
            "volumeattachments/status"
        );
        assert_eq!(rules[5]["level"], "None");
    }
}
