//! What the cluster did, as the cluster says it: the API server's audit log
//! (what the controller sent, when the API server received it, what it
//! answered) and watches of Pods and VolumeAttachments (what happened, and
//! when a watcher saw it). A drain test's order and count assertions take
//! their truth from here; berth's Events only show what operators are told.
//!
//! Two rules make the timestamps sound:
//! - "R came after change C" compares R's arrival with the arrival of the
//!   write that made C (another client's, also in the audit log: the test
//!   bed audits VolumeAttachment, pod and Node status writes of everyone).
//!   A watcher sees C only after it is committed, so its time is no lower
//!   bound; the arrival of C's write is (its commit follows within
//!   milliseconds, and nobody can act on C before it), the rule the
//!   benchmark's reaction times use.
//! - "change C came before request R" compares when the watch saw C with
//!   R's arrival: a watch sees C after its commit, so seen-before proves it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_devkit::bench::audit::Request;
use berth_devkit::testbed::TestBed;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt};

use super::audit::requests;

/// The controller's eviction requests in namespace `ns`, oldest first,
/// whatever their answer.
pub fn evictions(bed: &TestBed, ns: &str) -> Vec<Request> {
    requests(bed, ns)
        .into_iter()
        .filter(|r| r.resource == "pods" && r.subresource.as_deref() == Some("eviction"))
        .collect()
}

/// Whether the API server accepted request `r`.
pub fn accepted(r: &Request) -> bool {
    (200..300).contains(&r.code)
}

/// The evictions of pod `name` (or of pods whose name starts with it, for
/// `prefix*`) that the API server accepted, oldest first.
pub fn accepted_evictions_of<'a>(all: &'a [Request], name: &str) -> Vec<&'a Request> {
    all.iter()
        .filter(|r| accepted(r) && matches_name(r.name.as_deref(), name))
        .collect()
}

/// The one accepted eviction of `pod` (a name, or a prefix ending in `*`),
/// asserting there is exactly one; `log` says what the cluster did.
pub fn evicted_once<'a>(all: &'a [Request], pod: &str, log: &str) -> &'a Request {
    let evicted = accepted_evictions_of(all, pod);
    assert_eq!(evicted.len(), 1, "{pod} evicted once: {log}");
    evicted[0]
}

/// Of `a` and `b`, each evicted once: the first evicted, then the other,
/// each with its eviction.
pub fn in_order<'n, 'r>(
    all: &'r [Request],
    (a, b): (&'n str, &'n str),
    log: &str,
) -> ((&'n str, &'r Request), (&'n str, &'r Request)) {
    let (ea, eb) = (evicted_once(all, a, log), evicted_once(all, b, log));
    if ea.received < eb.received {
        ((a, ea), (b, eb))
    } else {
        ((b, eb), (a, ea))
    }
}

fn matches_name(have: Option<&str>, want: &str) -> bool {
    match (have, want.strip_suffix('*')) {
        (Some(h), Some(prefix)) => h.starts_with(prefix),
        (Some(h), None) => h == want,
        (None, _) => false,
    }
}

/// Every request the bed's audit log has, whoever sent it, oldest first.
pub fn cluster_requests(bed: &TestBed) -> Vec<Request> {
    let log = std::fs::read_to_string(bed.dir().join("audit.log")).expect("the audit log");
    let mut all = berth_devkit::bench::audit::parse(&log);
    all.sort_by_key(|r| r.received);
    all
}

/// The controller's writes (not reads or watches) in namespace `ns` or
/// about objects named after it, oldest first.
pub fn writes(bed: &TestBed, ns: &str) -> Vec<Request> {
    requests(bed, ns)
        .into_iter()
        .filter(Request::is_write)
        .collect()
}

/// Reads the controller's requests for `ns` until `done` holds over them
/// (the API server writes an audit line after the response, so the last
/// request of a case may show a moment after its effect), for at most 15
/// seconds; then the last read, whatever it holds.
pub async fn requests_once(
    bed: &TestBed,
    ns: &str,
    done: impl Fn(&[Request]) -> bool,
) -> Vec<Request> {
    let until = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let all = requests(bed, ns);
        if done(&all) || std::time::Instant::now() >= until {
            return all;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One change a watch saw.
#[derive(Debug, Clone, PartialEq)]
pub enum Seen {
    /// VolumeAttachment `va` of `pv` to `node` reported attached.
    Attached {
        pv: String,
        node: String,
        va: String,
    },
    /// The VolumeAttachment of `pv` to `node` is gone: detached.
    Detached { pv: String, node: String },
    /// Pod `name` (this UID) is bound to `node`.
    PodOn {
        name: String,
        uid: String,
        node: String,
    },
    /// Pod `name` (this UID) is Ready.
    PodReady { name: String, uid: String },
    /// Pod `name` (this UID) finished: phase Succeeded or Failed.
    PodFinished { name: String, uid: String },
    /// Pod `name` (this UID) is being deleted (evicted, or deleted): its
    /// deletion timestamp is set.
    PodDeleting { name: String, uid: String },
    /// Pod `name` (this UID) is gone.
    PodGone { name: String, uid: String },
}

/// Records what watches of the VolumeAttachments (all) and of the pods of
/// one namespace see, each change with the time it was seen.
pub struct Watches {
    seen: Arc<Mutex<Vec<(Timestamp, Seen)>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Watches {
    /// Starts watching; returns once both watches have listed.
    pub async fn start(client: &Client, ns: &str) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, mut ready) = tokio::sync::mpsc::channel::<()>(2);
        let vas = {
            let seen = Arc::clone(&seen);
            let ready = ready_tx.clone();
            let api: Api<VolumeAttachment> = Api::all(client.clone());
            tokio::spawn(async move {
                let mut attached = std::collections::BTreeSet::new();
                let mut stream = watcher::watcher(api, watcher::Config::default()).boxed();
                while let Some(ev) = stream.next().await {
                    let now = Timestamp::now();
                    let record = |s: Seen| seen.lock().expect("lock").push((now, s));
                    match ev {
                        Ok(Event::InitDone) => {
                            let _ = ready.send(()).await;
                        }
                        Ok(Event::Apply(va) | Event::InitApply(va)) => {
                            let pv = va.spec.source.persistent_volume_name.clone();
                            let up = va.status.as_ref().is_some_and(|s| s.attached);
                            if let (Some(pv), true) = (pv, up)
                                && attached.insert(va.name_any())
                            {
                                record(Seen::Attached {
                                    pv,
                                    node: va.spec.node_name.clone(),
                                    va: va.name_any(),
                                });
                            }
                        }
                        Ok(Event::Delete(va)) => {
                            attached.remove(&va.name_any());
                            if let Some(pv) = va.spec.source.persistent_volume_name.clone() {
                                record(Seen::Detached {
                                    pv,
                                    node: va.spec.node_name.clone(),
                                });
                            }
                        }
                        Ok(Event::Init) | Err(_) => {}
                    }
                }
            })
        };
        let pods = {
            let seen = Arc::clone(&seen);
            let api: Api<Pod> = Api::namespaced(client.clone(), ns);
            tokio::spawn(async move {
                let mut bound = std::collections::BTreeSet::new();
                let mut ready = std::collections::BTreeSet::new();
                let mut finished = std::collections::BTreeSet::new();
                let mut deleting = std::collections::BTreeSet::new();
                let mut stream = watcher::watcher(api, watcher::Config::default()).boxed();
                while let Some(ev) = stream.next().await {
                    let now = Timestamp::now();
                    let record = |s: Seen| seen.lock().expect("lock").push((now, s));
                    match ev {
                        Ok(Event::InitDone) => {
                            let _ = ready_tx.send(()).await;
                        }
                        Ok(Event::Apply(p) | Event::InitApply(p)) => {
                            let uid = p.metadata.uid.clone().unwrap_or_default();
                            let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
                            if let Some(node) = node
                                && bound.insert(uid.clone())
                            {
                                record(Seen::PodOn {
                                    name: p.name_any(),
                                    uid: uid.clone(),
                                    node,
                                });
                            }
                            if is_ready(&p) && ready.insert(uid.clone()) {
                                record(Seen::PodReady {
                                    name: p.name_any(),
                                    uid: uid.clone(),
                                });
                            }
                            if p.metadata.deletion_timestamp.is_some()
                                && deleting.insert(uid.clone())
                            {
                                record(Seen::PodDeleting {
                                    name: p.name_any(),
                                    uid: uid.clone(),
                                });
                            }
                            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                            if matches!(phase, Some("Succeeded" | "Failed"))
                                && finished.insert(uid.clone())
                            {
                                record(Seen::PodFinished {
                                    name: p.name_any(),
                                    uid,
                                });
                            }
                        }
                        Ok(Event::Delete(p)) => record(Seen::PodGone {
                            name: p.name_any(),
                            uid: p.metadata.uid.clone().unwrap_or_default(),
                        }),
                        Ok(Event::Init) | Err(_) => {}
                    }
                }
            })
        };
        for _ in 0..2 {
            tokio::time::timeout(super::LONG, ready.recv())
                .await
                .expect("the watches list");
        }
        Self {
            seen,
            tasks: vec![vas, pods],
        }
    }

    /// Everything seen so far, oldest first.
    pub fn seen(&self) -> Vec<(Timestamp, Seen)> {
        self.seen.lock().expect("lock").clone()
    }

    /// When `what` was first seen.
    pub fn first(&self, what: impl Fn(&Seen) -> bool) -> Option<Timestamp> {
        self.seen()
            .into_iter()
            .find(|(_, s)| what(s))
            .map(|(t, _)| t)
    }

    /// The VolumeAttachment first seen attaching `pv` to a Node other than
    /// `not`.
    pub fn attachment_elsewhere(&self, pv: &str, not: &str) -> Option<String> {
        self.seen().into_iter().find_map(|(_, s)| match s {
            Seen::Attached { pv: p, node, va } if p == pv && node != not => Some(va),
            _ => None,
        })
    }

    /// When the write that attached `pv` to a Node other than `not` reached
    /// the API server (the first status write of that VolumeAttachment,
    /// the attacher's, from the audit log).
    pub async fn attached_elsewhere(
        &self,
        bed: &TestBed,
        pv: &str,
        not: &str,
    ) -> Option<Timestamp> {
        let va = self.attachment_elsewhere(pv, not)?;
        attach_write(bed, &va).await
    }

    /// When the write that attached `pv` to Node `node` reached the API
    /// server (as [`Watches::attached_elsewhere`], for one Node).
    pub async fn attached_on(&self, bed: &TestBed, pv: &str, node: &str) -> Option<Timestamp> {
        let va = self.seen().into_iter().find_map(|(_, s)| match s {
            Seen::Attached { pv: p, node: n, va } if p == pv && n == node => Some(va),
            _ => None,
        })?;
        attach_write(bed, &va).await
    }

    /// The ledger's and the drain's promise, by the cluster: `later` (a
    /// request of the audit log) reached the API server only after `pv` was
    /// attached on a Node other than `old`, where the replacement of the
    /// pod that used it runs. Returns that moment.
    pub async fn assert_after_moved(
        &self,
        bed: &TestBed,
        later: &Request,
        pv: &str,
        old: &str,
        log: &str,
    ) -> Timestamp {
        let moved = self
            .attached_elsewhere(bed, pv, old)
            .await
            .unwrap_or_else(|| panic!("{pv} attached elsewhere than {old}: {log}"));
        assert!(
            later.received > moved,
            "{} {} sent at {}, before {pv} was attached where its replacement runs ({moved}): {log}",
            later.verb,
            later.name.as_deref().unwrap_or_default(),
            later.received,
        );
        moved
    }

    /// When `pv` was first seen detached from `node`.
    pub fn detached_from(&self, pv: &str, node: &str) -> Option<Timestamp> {
        self.first(|s| matches!(s, Seen::Detached { pv: p, node: n } if p == pv && n == node))
    }

    /// When the write that detached `pv` from `node` reached the API
    /// server (the first rule above): the test bed's attacher removing its
    /// finalizer from the VolumeAttachment the attach-detach controller
    /// deleted, from the audit log. What a request that reacts to the
    /// detach is compared with: the controller may see the detach, and
    /// act, before this process's watch has told it (on a loaded machine,
    /// by more than the controller takes to act).
    pub async fn detached_write(&self, bed: &TestBed, pv: &str, node: &str) -> Option<Timestamp> {
        let va = self.seen().into_iter().find_map(|(_, s)| match s {
            Seen::Attached { pv: p, node: n, va } if p == pv && n == node => Some(va),
            _ => None,
        })?;
        detach_write(bed, &va).await
    }

    /// What was seen, as lines, for assertion messages.
    pub fn log(&self) -> String {
        self.seen()
            .iter()
            .map(|(t, s)| format!("{t} {s:?}"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// When the first status write of VolumeAttachment `va` (the attacher's,
/// which attached it) reached the API server, from the audit log.
async fn attach_write(bed: &TestBed, va: &str) -> Option<Timestamp> {
    let is_it = |r: &Request| {
        r.resource == "volumeattachments"
            && r.subresource.as_deref() == Some("status")
            && matches!(r.verb.as_str(), "patch" | "update")
            && r.name.as_deref() == Some(va)
    };
    let until = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let found = cluster_requests(bed).into_iter().find(|r| is_it(r));
        if found.is_some() || std::time::Instant::now() >= until {
            return found.map(|r| r.received);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// When the write that let VolumeAttachment `va` go reached the API
/// server, from the audit log: the first change of it (the attacher's
/// finalizer removed) after the attach-detach controller's deletion of it.
async fn detach_write(bed: &TestBed, va: &str) -> Option<Timestamp> {
    let of_it = |r: &Request| {
        r.resource == "volumeattachments"
            && r.subresource.is_none()
            && r.name.as_deref() == Some(va)
            && accepted(r)
    };
    let until = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let writes: Vec<Request> = cluster_requests(bed)
            .into_iter()
            .filter(|r| of_it(r))
            .collect();
        let freed = writes
            .iter()
            .position(|r| r.verb == "delete")
            .and_then(|i| {
                writes[i + 1..]
                    .iter()
                    .find(|r| matches!(r.verb.as_str(), "patch" | "update"))
            })
            .map(|r| r.received);
        if freed.is_some() || std::time::Instant::now() >= until {
            return freed;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

impl Drop for Watches {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The requests as lines, for assertion messages.
pub fn log_of(rs: &[Request]) -> String {
    rs.iter()
        .map(|r| {
            format!(
                "{} {} {} {} -> {}",
                r.received,
                r.kind(),
                r.namespace.as_deref().unwrap_or("-"),
                r.name.as_deref().unwrap_or("-"),
                r.code
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
