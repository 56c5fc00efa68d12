//! The controller's requests, as the test bed's audit log records them:
//! the controller runs as a ServiceAccount of its own, which is the only
//! user the beds of these tests audit, so that a test can assert that a
//! failure case makes no request loop.

use berth_devkit::bench::audit::{self, Request};
use berth_devkit::testbed::{Identity, TestBed, loops, service_account_user};
use k8s_openapi::jiff::Timestamp;
use tokio::sync::OnceCell;

const CONTROLLER_NS: &str = "kube-system";
const CONTROLLER_SA: &str = "berth-controller";
/// A second controller identity the beds audit, for a case whose
/// controller runs with less than cluster-admin (see
/// [`restricted_user`]).
pub const RESTRICTED_SA: &str = "berth-restricted";

/// The user the controller's requests carry.
pub fn controller_user() -> String {
    service_account_user(CONTROLLER_NS, CONTROLLER_SA)
}

/// The user of a controller a case binds to a ClusterRole of its own
/// (`TestBed::identity_as` in namespace `kube-system`, named
/// [`RESTRICTED_SA`]); audited like [`controller_user`].
pub fn restricted_user() -> String {
    service_account_user(CONTROLLER_NS, RESTRICTED_SA)
}

/// The identity the controller runs as on `bed`, the test binary's one bed
/// (a ServiceAccount bound to cluster-admin): its kubeconfig for a `berth
/// run` process, or a client for an in-process controller from
/// [`controller_client`].
pub async fn controller(bed: &'static TestBed) -> &'static Identity {
    static ID: OnceCell<Identity> = OnceCell::const_new();
    ID.get_or_init(|| async {
        let admin = bed.client().await.expect("admin client");
        bed.identity(&admin, CONTROLLER_NS, CONTROLLER_SA)
            .await
            .expect("the controller's identity")
    })
    .await
}

/// A client as the controller's identity on `bed`, for this test's runtime.
pub async fn controller_client(bed: &'static TestBed) -> kube::Client {
    controller(bed)
        .await
        .client()
        .await
        .expect("the controller's client")
}

/// How long a case's controller is left running once the case's work is
/// done, before it stops: the quiet period of the request-loop check (see
/// [`loops`]), in which it has nothing left to do and so should send almost
/// nothing new. Long enough for a steady once-a-second loop to show five
/// times, against a limit of three.
pub const QUIET: std::time::Duration = std::time::Duration::from_secs(5);

/// The controller's requests (watches aside) for the case in namespace
/// `ns` (each case has a namespace of its own, and its controller acts in
/// it alone): about objects in `ns`, or named after it (the pool's Nodes
/// and PVs); oldest first.
pub fn requests(bed: &TestBed, ns: &str) -> Vec<Request> {
    requests_of(bed, ns, &controller_user())
}

/// [`requests`] of `user`.
pub fn requests_of(bed: &TestBed, ns: &str, user: &str) -> Vec<Request> {
    read_requests_of(bed, ns, user).unwrap_or_else(|e| panic!("{e}"))
}

/// [`requests_of`], or why the audit log could not be read.
fn read_requests_of(bed: &TestBed, ns: &str, user: &str) -> Result<Vec<Request>, String> {
    let path = bed.dir().join("audit.log");
    let log = std::fs::read_to_string(&path)
        .map_err(|e| format!("the audit log {}: {e}", path.display()))?;
    let prefix = format!("{ns}-");
    let mut mine: Vec<Request> = audit::parse(&log)
        .into_iter()
        .filter(|r| r.user == *user && r.verb != "watch")
        .filter(|r| {
            r.namespace.as_deref() == Some(ns)
                || r.name.as_deref().is_some_and(|n| n.starts_with(&prefix))
        })
        .collect();
    mine.sort_by_key(|r| r.received);
    Ok(mine)
}

/// The names of the objects of `resource` the controller deleted for the
/// case in `ns` (each accepted DELETE, the collection's included),
/// sorted: one deleted twice shows twice. What it did, by the API server's
/// record, to count exactly where its Events only say what it announced.
pub fn deleted(bed: &TestBed, ns: &str, resource: &str) -> Vec<String> {
    let mut names: Vec<String> = requests(bed, ns)
        .into_iter()
        .filter(|r| r.verb == "delete" && r.resource == resource && r.subresource.is_none())
        .filter(|r| r.code < 400)
        .map(|r| r.name.unwrap_or_default())
        .collect();
    names.sort();
    names
}

/// The request-loop check of the case `case` in `ns` for the controller
/// running as `user` (`support::Case` makes it at the case's end; see
/// [`loops`] for what counts as a loop): `quiet_from` is when the case's
/// work was done, if its controller was then left running for [`QUIET`].
/// At least one request is required (a case whose controller made none
/// checked nothing). Prints what it saw for the record; says what failed
/// rather than panicking, as the end may come while the case is already
/// failing.
pub fn check(
    bed: &TestBed,
    case: &str,
    ns: &str,
    user: &str,
    quiet_from: Option<Timestamp>,
) -> Result<(), String> {
    let mine = read_requests_of(bed, ns, user).map_err(|e| format!("{case}: {e}"))?;
    let report = loops::check(&mine, quiet_from, &loops::Limits::default());
    eprintln!(
        "requests: {case}: {} in {:.0} s, busiest request in 10 s: {:?}, after the work: {}",
        report.requests,
        report.seconds,
        report.busiest,
        report
            .when_quiet
            .map_or_else(|| "not waited for".to_string(), |n| n.to_string()),
    );
    record(case, &report);
    if report.requests == 0 {
        return Err(format!(
            "{case}: no request of the controller in the audit log"
        ));
    }
    if !report.loops.is_empty() {
        let found: Vec<String> = report.loops.iter().map(ToString::to_string).collect();
        return Err(format!("{case}: request loop: {}", found.join("; ")));
    }
    Ok(())
}

/// Appends the check's figures for `case` as one JSON line to the file
/// `BERTH_REQUEST_REPORT` names, if it does (`berth-dev suite` names
/// `target/suite/requests.jsonl`): the record from which the loop check's
/// limits are judged, passing cases included (whose output libtest hides).
fn record(case: &str, report: &loops::Report) {
    use std::io::Write;
    let Some(path) = std::env::var_os("BERTH_REQUEST_REPORT") else {
        return;
    };
    let line = serde_json::json!({
        "case": case,
        "requests": report.requests,
        "seconds": report.seconds,
        "busiest": report.busiest,
        "when_quiet": report.when_quiet,
        "loops": report.loops.iter().map(ToString::to_string).collect::<Vec<_>>(),
    });
    // One write of one line: appends of concurrent test binaries do not
    // interleave.
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = f.write_all(format!("{line}\n").as_bytes());
    }
}
