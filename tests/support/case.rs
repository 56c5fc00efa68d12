//! The one way an end-to-end case starts and ends: [`Case::builder`] makes its
//! namespace (and, asked, its pool class with the case's drain settings)
//! and starts its controller, in this process or as a `berth run` process;
//! the [`Case`] it returns stops that controller and checks the case's
//! requests for a loop (`berth_devkit::testbed::loops`) when it is dropped,
//! so that a case whose assertion failed still stops its controller and
//! still says whether it looped.
//!
//! ```ignore
//! let case = Case::builder("drain-x").on(BED).pool(json!({"timeout": "10m"})).start().await;
//! let client = case.client();
//! // ... the case's steps and assertions ...
//! // `case` dropped: the controller stopped, the request-loop check made.
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use berth::providers::Registry;
use berth::providers::fake::FakeProvider;
use berth_devkit::testbed::{TestBed, fixtures};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};

use super::process::Berth;
use super::{LONG, audit, pool};

/// Where a case runs: the test binary's end-to-end bed
/// ([`super::bed`]), a drain file's bed of slow attach and detach
/// ([`pool::Bed`]), or a bed a file started itself.
#[derive(Clone, Copy)]
pub enum On {
    Default,
    Pool(pool::Bed),
    Bed(&'static TestBed),
}

impl From<pool::Bed> for On {
    fn from(b: pool::Bed) -> Self {
        On::Pool(b)
    }
}

impl From<&'static TestBed> for On {
    fn from(b: &'static TestBed) -> Self {
        On::Bed(b)
    }
}

impl On {
    async fn bed(self) -> &'static TestBed {
        super::init_logs();
        match self {
            On::Default => super::bed().await,
            On::Pool(b) => b.bed().await,
            On::Bed(b) => b,
        }
    }
}

/// What [`Case::builder`] returns: a case not begun yet.
#[must_use = "a case begins with `build`, `start`, `start_as` or `spawn`"]
pub struct CaseBuilder {
    on: On,
    ns: String,
    name: String,
    pool: Option<serde_json::Value>,
    user: String,
    service_account: bool,
    admin: bool,
}

impl CaseBuilder {
    /// The case runs on `bed` (by default the test binary's one bed).
    pub fn on(mut self, bed: impl Into<On>) -> Self {
        self.on = bed.into();
        self
    }

    /// A pool class named after the namespace, whose Nodes carry the pool
    /// label, with drain settings `drain` (see [`pool::pool_class`]).
    pub fn pool(mut self, drain: serde_json::Value) -> Self {
        self.pool = Some(drain);
        self
    }

    /// On a bed with no controller-manager: the namespace gets no `default`
    /// ServiceAccount, and none is waited for.
    pub fn without_service_account(mut self) -> Self {
        self.service_account = false;
        self
    }

    /// The in-process controller runs as the bed's admin, which the bed does
    /// not audit: the case has no request-loop check (the lifecycle cases,
    /// whose controllers always ran so).
    pub fn run_as_admin(mut self) -> Self {
        self.admin = true;
        self
    }

    /// The namespace and the pool class; no controller yet (see
    /// [`Case::start_as`] and [`Case::spawn`]).
    pub async fn build(self) -> Case {
        let bed = self.on.bed().await;
        let client = bed.client().await.expect("admin client");
        if self.service_account {
            super::namespace(&client, &self.ns).await;
        } else {
            Api::<Namespace>::all(client.clone())
                .create(&PostParams::default(), &fixtures::namespace(&self.ns))
                .await
                .expect("create namespace");
        }
        if let Some(drain) = self.pool {
            pool::pool_class(&client, &self.ns, drain).await;
        }
        Case {
            bed,
            client,
            ns: self.ns,
            name: self.name,
            user: self.user,
            admin: self.admin,
            controller: None,
            started: false,
            checked: false,
        }
    }

    /// [`CaseBuilder::build`], then the controller in this process, its
    /// instance named after the namespace.
    pub async fn start(self) -> Case {
        let mut case = self.build().await;
        case.start().await;
        case
    }

    /// [`CaseBuilder::start`] with the instance named `instance`.
    pub async fn start_as(self, instance: &str) -> Case {
        let mut case = self.build().await;
        case.start_as(instance).await;
        case
    }

    /// [`CaseBuilder::build`], then the controller as a `berth run` process
    /// with `flags` (see [`Case::spawn`]).
    pub async fn spawn(self, flags: &[&str]) -> Case {
        let mut case = self.build().await;
        case.spawn(flags).await;
        case
    }
}

/// The controller, scoped to one namespace, running in this process, and
/// its metrics.
pub struct Running(
    berth::wiring::manager::Spawned,
    Arc<berth::telemetry::Metrics>,
);

impl Running {
    /// The controller with the fake provider, as `client`, scoped to `ns`,
    /// its instance named `instance`, once its caches have synced.
    async fn start(client: &Client, ns: &str, instance: &str) -> Self {
        let providers = Registry::default().with(Arc::new(FakeProvider::new(client.clone())));
        let settings = berth::wiring::manager::Settings {
            namespace: Some(ns.to_string()),
            instance: instance.to_string(),
            concurrency: 4,
            ..Default::default()
        };
        let metrics = Arc::new(berth::telemetry::Metrics::new().expect("metrics"));
        let mut spawned = berth::wiring::manager::spawn(
            client.clone(),
            providers,
            settings,
            Arc::clone(&metrics),
        );
        tokio::time::timeout(LONG, &mut spawned.ready)
            .await
            .expect("caches sync in time")
            .expect("controller reports ready");
        Running(spawned, metrics)
    }

    /// Graceful shutdown; waits for the controller to finish.
    async fn stop(self) {
        self.0.stop(LONG).await;
    }

    /// What the controller's metrics endpoint would show.
    pub fn metrics(&self) -> &berth::telemetry::Metrics {
        &self.1
    }
}

/// The controller of a case.
enum Controller {
    InProcess(Running),
    Process(Berth),
}

impl Controller {
    /// Stops it gracefully (SIGTERM for a process); `Err` says what went
    /// wrong, without panicking (the case's Drop may run while unwinding).
    async fn stop(self) -> Result<(), String> {
        match self {
            Controller::InProcess(r) => {
                r.stop().await;
                Ok(())
            }
            Controller::Process(b) => b.shut_down().await.map(|_| ()),
        }
    }
}

/// A case begun by [`CaseBuilder`]: its namespace, an admin client, and
/// its controller. Dropped, at the end of the test or when an assertion
/// fails, it stops the controller and (if one ran) checks that the case
/// made no request loop: a panic when the case otherwise passed, a report
/// on stderr when it had already failed.
pub struct Case {
    /// The case's control plane.
    pub bed: &'static TestBed,
    /// An admin client of the bed.
    pub client: Client,
    /// The case's namespace, where its controller acts alone.
    pub ns: String,
    name: String,
    user: String,
    /// Whether the in-process controller runs as the unaudited admin.
    admin: bool,
    controller: Option<Controller>,
    /// Whether a controller ran in the case: a case without one has no
    /// requests to check.
    started: bool,
    checked: bool,
}

impl Case {
    /// A case in namespace `ns` (fresh: the namespace is created); the test
    /// that calls it and `ns` name the case in the request report.
    pub fn builder(ns: &str) -> CaseBuilder {
        let name = std::thread::current()
            .name()
            .filter(|n| *n != "main")
            .map(|n| format!("{} [{ns}]", n.rsplit("::").next().unwrap_or(n)))
            .unwrap_or_else(|| ns.to_string());
        CaseBuilder {
            on: On::Default,
            ns: ns.to_string(),
            name,
            pool: None,
            user: audit::controller_user(),
            service_account: true,
            admin: false,
        }
    }

    /// An admin client of the bed.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// [`Case::start_as`] with the instance named after the namespace.
    pub async fn start(&mut self) {
        let instance = self.ns.clone();
        self.start_as(&instance).await;
    }

    /// Starts the controller in this process, scoped to the case's
    /// namespace, as the audited controller identity (or the admin, see
    /// [`CaseBuilder::run_as_admin`]), its instance named `instance`. A
    /// controller of the case must not be running.
    pub async fn start_as(&mut self, instance: &str) {
        assert!(
            self.controller.is_none(),
            "{}: a controller already runs",
            self.name
        );
        let client = if self.admin {
            self.client.clone()
        } else {
            audit::controller_client(self.bed).await
        };
        let running = Running::start(&client, &self.ns, instance).await;
        self.controller = Some(Controller::InProcess(running));
        self.started = true;
    }

    /// Starts the controller as a `berth run` process with `flags`, as the
    /// audited controller identity (its kubeconfig).
    pub async fn spawn(&mut self, flags: &[&str]) -> &Berth {
        let kubeconfig = audit::controller(self.bed).await.kubeconfig.clone();
        self.spawn_with(&kubeconfig, flags, &[])
    }

    /// [`Case::spawn`] with a kubeconfig and environment of the case's own.
    pub fn spawn_with(
        &mut self,
        kubeconfig: &Path,
        flags: &[&str],
        env: &[(&str, &str)],
    ) -> &Berth {
        assert!(
            self.controller.is_none(),
            "{}: a controller already runs",
            self.name
        );
        self.controller = Some(Controller::Process(Berth::spawn_with(
            kubeconfig, flags, env,
        )));
        self.started = true;
        self.berth()
    }

    /// Makes `berth`, a `berth run` process the test spawned its own way
    /// (a cloud's flags), the case's controller.
    pub fn adopt(&mut self, berth: Berth) -> &Berth {
        assert!(
            self.controller.is_none(),
            "{}: a controller already runs",
            self.name
        );
        self.controller = Some(Controller::Process(berth));
        self.started = true;
        self.berth()
    }

    /// The controller's kubeconfig for a `berth run` process.
    pub async fn kubeconfig(&self) -> PathBuf {
        audit::controller(self.bed).await.kubeconfig.clone()
    }

    /// The request-loop check counts the requests of `user` (a controller
    /// the case runs as `audit::restricted_user`), not those of the
    /// controller's usual identity.
    pub fn audited_as(&mut self, user: String) {
        self.user = user;
    }

    /// The running `berth run` process.
    pub fn berth(&self) -> &Berth {
        match &self.controller {
            Some(Controller::Process(b)) => b,
            _ => panic!("{}: no berth process runs", self.name),
        }
    }

    /// The running in-process controller.
    pub fn running(&self) -> &Running {
        match &self.controller {
            Some(Controller::InProcess(r)) => r,
            _ => panic!("{}: no in-process controller runs", self.name),
        }
    }

    /// Stops the controller gracefully (to start another).
    pub async fn stop(&mut self) {
        if let Some(c) = self.controller.take() {
            c.stop()
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", self.name));
        }
    }

    /// SIGKILL to the `berth run` process: it stops wherever it is.
    pub async fn kill(&mut self) {
        match self.controller.take() {
            Some(Controller::Process(b)) => b.kill().await,
            _ => panic!("{}: no berth process to kill", self.name),
        }
    }

    /// Takes the `berth run` process out of the case (to end it as the case
    /// asserts, `terminate` or `exited`); the case no longer stops it.
    pub fn take_berth(&mut self) -> Berth {
        match self.controller.take() {
            Some(Controller::Process(b)) => b,
            _ => panic!("{}: no berth process runs", self.name),
        }
    }

    /// The request-loop check now rather than at the end, for a case whose
    /// last steps are clean-up that is not the case's work; the end then
    /// checks nothing more. The case's work is done: its controller is
    /// left [`audit::QUIET`] first.
    pub fn assert_no_request_loop(&mut self) {
        let quiet_from = self.quiet_blocking();
        self.checked = true;
        if let Err(e) = self.request_loop(quiet_from) {
            panic!("{e}");
        }
    }

    fn request_loop(&self, quiet_from: Option<Timestamp>) -> Result<(), String> {
        audit::check(self.bed, &self.name, &self.ns, &self.user, quiet_from)
    }

    /// Whether the end of the case waits for a quiet period: its work done
    /// (it is not failing), its controller audited and still running.
    fn wants_quiet(&self) -> bool {
        !std::thread::panicking() && !self.checked && !self.admin && self.controller.is_some()
    }

    /// The quiet period after the case's work (see [`audit::QUIET`]), from
    /// a Drop or a sync call: the current thread leaves the runtime while
    /// the controller goes on. When it began, if it was waited for.
    fn quiet_blocking(&self) -> Option<Timestamp> {
        if !self.wants_quiet() {
            return None;
        }
        let from = Timestamp::now();
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| std::thread::sleep(audit::QUIET));
                Some(from)
            }
            // Without a multi-thread runtime the controller cannot go on
            // while this thread sleeps: no quiet period to look at.
            _ => None,
        }
    }

    /// Ends the case as dropping it does, awaited: the quiet period, the
    /// controller stopped, then the request-loop check.
    pub async fn finish(mut self) {
        let quiet_from = if self.wants_quiet() {
            let from = Timestamp::now();
            tokio::time::sleep(audit::QUIET).await;
            Some(from)
        } else {
            None
        };
        let stopped = match self.controller.take() {
            Some(c) => c.stop().await,
            None => Ok(()),
        };
        self.end(stopped, quiet_from);
    }

    /// The end of the case, its controller stopped (`stopped`) after the
    /// quiet period that began at `quiet_from`, if any: the request-loop
    /// check, unless made already; panics with what failed, or reports it
    /// if the case is already failing.
    fn end(&mut self, stopped: Result<(), String>, quiet_from: Option<Timestamp>) {
        let unaudited = !self.started || self.admin;
        let checked = if std::mem::replace(&mut self.checked, true) || unaudited {
            Ok(())
        } else {
            self.request_loop(quiet_from)
        };
        // The check's own message names the case.
        let stopped = stopped.map_err(|e| format!("{}: {e}", self.name));
        let failures: Vec<String> = [stopped.err(), checked.err()]
            .into_iter()
            .flatten()
            .collect();
        if failures.is_empty() {
            return;
        }
        let msg = failures.join("; ");
        if std::thread::panicking() {
            eprintln!("also, at the end of the failed case: {msg}");
        } else {
            panic!("{msg}");
        }
    }
}

impl Drop for Case {
    fn drop(&mut self) {
        if self.checked && self.controller.is_none() {
            return;
        }
        let quiet_from = self.quiet_blocking();
        let stopped = match self.controller.take() {
            Some(c) => stop_blocking(c),
            None => Ok(()),
        };
        self.end(stopped, quiet_from);
    }
}

/// Stops `c` from a Drop, which cannot await: on the tests' multi-thread
/// runtime, the current thread leaves the runtime (`block_in_place`) and
/// waits for the stop while the runtime's workers run the controller's
/// tasks. Elsewhere (no runtime, a current-thread one) the controller is
/// only dropped: an in-process one then stops by itself (its stop signal's
/// sender is gone), a process is killed (`kill_on_drop`).
fn stop_blocking(c: Controller) -> Result<(), String> {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(|| {
                h.block_on(async {
                    tokio::time::timeout(LONG + LONG, c.stop())
                        .await
                        .unwrap_or_else(|_| Err("the controller did not stop".into()))
                })
            })
        }
        _ => {
            drop(c);
            Ok(())
        }
    }
}
