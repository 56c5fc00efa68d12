//! A rollout as the cluster shows it, recorded by watches while it runs:
//! each Machine's steps (created, Running with its Node Ready, deletion
//! begun, gone) in the order of one Machine watch, which is the order the
//! API server wrote them in; each pod's incarnations (UID and Node); and
//! the Nodes that carried berth's rollout taint. The MachineDeployment
//! tests check the pace of a rollout and the moves of its pods against it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth::api::{Machine, ROLLOUT_TAINT_KEY, TEMPLATE_HASH_LABEL};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;

use super::LONG;

/// What became true of a Machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    Created,
    /// Phase Running with its Ready condition True: its Node is Ready.
    Running,
    /// Its deletion began (a deletion timestamp).
    Deleting,
    /// Its object is gone: drained, VM and Node deleted.
    Gone,
}

#[derive(Debug, Clone)]
pub struct Step {
    /// Since the recording started.
    pub at: Duration,
    pub machine: String,
    /// Its `berth.dev/template-hash`.
    pub hash: String,
    pub seen: Seen,
}

/// The limits a rolling update keeps to.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    pub replicas: usize,
    pub surge: usize,
    /// `max(maxUnavailable, 1)`.
    pub drains_at_once: usize,
}

/// The most the recorded rollout came to, for the record.
#[derive(Debug, Default)]
pub struct Peak {
    pub machines: usize,
    pub old_draining: usize,
}

#[derive(Default)]
struct Machines {
    steps: Vec<Step>,
    /// Name to (hash, running, deleting) of the Machines that exist.
    live: BTreeMap<String, (String, bool, bool)>,
}

/// Pod name to its incarnations, in the order seen: (UID, Node).
type Incarnations = BTreeMap<String, Vec<(String, String)>>;

/// The recording; stops when dropped.
pub struct Timeline {
    start: Instant,
    machines: Arc<Mutex<Machines>>,
    pods: Arc<Mutex<Incarnations>>,
    /// Nodes seen with `berth.dev/rolling-out=old:PreferNoSchedule`.
    tainted: Arc<Mutex<BTreeSet<String>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Timeline {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn running(m: &Machine) -> bool {
    super::phase(m) == Some("Running")
        && super::condition(m, berth::api::conditions::READY).is_some_and(|c| c.status == "True")
}

fn hash_of(m: &Machine) -> String {
    m.labels()
        .get(TEMPLATE_HASH_LABEL)
        .cloned()
        .unwrap_or_default()
}

fn rollout_tainted(n: &Node) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| {
            ts.iter().any(|t| {
                t.key == ROLLOUT_TAINT_KEY
                    && t.value.as_deref() == Some("old")
                    && t.effect == "PreferNoSchedule"
            })
        })
}

/// Runs a watch of `api`, handing each object seen (listed, added or
/// changed) to `seen` and each one gone to `gone`, and resolves once the
/// first list is in. A re-list that misses an object reports it gone.
async fn record<K>(
    api: Api<K>,
    mut seen: impl FnMut(&K) + Send + 'static,
    mut gone: impl FnMut(&str) + Send + 'static,
) -> JoinHandle<()>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default,
{
    let (listed, ready) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut listed = Some(listed);
        let mut known = BTreeSet::<String>::new();
        let mut relisted = BTreeSet::<String>::new();
        let stream = watcher(api, watcher::Config::default()).default_backoff();
        futures::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(watcher::Event::Init) => relisted.clear(),
                Ok(watcher::Event::InitApply(o)) => {
                    relisted.insert(o.name_any());
                    known.insert(o.name_any());
                    seen(&o);
                }
                Ok(watcher::Event::InitDone) => {
                    for name in known.difference(&relisted) {
                        gone(name);
                    }
                    known = std::mem::take(&mut relisted);
                    if let Some(tx) = listed.take() {
                        let _ = tx.send(());
                    }
                }
                Ok(watcher::Event::Apply(o)) => {
                    known.insert(o.name_any());
                    seen(&o);
                }
                Ok(watcher::Event::Delete(o)) => {
                    known.remove(&o.name_any());
                    gone(&o.name_any());
                }
                Err(e) => eprintln!("timeline watch: {e}"),
            }
        }
    });
    tokio::time::timeout(LONG, ready)
        .await
        .expect("the timeline's watch lists in time")
        .expect("the timeline's watch runs");
    task
}

impl Timeline {
    /// Starts recording the Machines and pods of `ns` and the Nodes named
    /// after it; returns once every watch has listed.
    pub async fn start(client: &Client, ns: &str) -> Self {
        let start = Instant::now();
        let machines = Arc::new(Mutex::new(Machines::default()));
        let pods = Arc::new(Mutex::new(BTreeMap::new()));
        let tainted = Arc::new(Mutex::new(BTreeSet::new()));

        let (on_machine, on_gone) = (Arc::clone(&machines), Arc::clone(&machines));
        let machine_task = record(
            Api::<Machine>::namespaced(client.clone(), ns),
            move |m: &Machine| {
                let mut all = on_machine.lock().expect("timeline lock");
                let name = m.name_any();
                let at = start.elapsed();
                let hash = hash_of(m);
                let mut new_steps = Vec::new();
                let entry = all.live.entry(name.clone()).or_insert_with(|| {
                    new_steps.push(Seen::Created);
                    (hash.clone(), false, false)
                });
                if !entry.1 && running(m) {
                    entry.1 = true;
                    new_steps.push(Seen::Running);
                }
                if !entry.2 && m.metadata.deletion_timestamp.is_some() {
                    entry.2 = true;
                    new_steps.push(Seen::Deleting);
                }
                for seen in new_steps {
                    all.steps.push(Step {
                        at,
                        machine: name.clone(),
                        hash: hash.clone(),
                        seen,
                    });
                }
            },
            move |name: &str| {
                let mut all = on_gone.lock().expect("timeline lock");
                if let Some((hash, _, _)) = all.live.remove(name) {
                    all.steps.push(Step {
                        at: start.elapsed(),
                        machine: name.to_string(),
                        hash,
                        seen: Seen::Gone,
                    });
                }
            },
        )
        .await;

        let on_pod = Arc::clone(&pods);
        let pod_task = record(
            Api::<Pod>::namespaced(client.clone(), ns),
            move |p: &Pod| {
                let (Some(uid), Some(node)) = (
                    p.metadata.uid.clone(),
                    p.spec.as_ref().and_then(|s| s.node_name.clone()),
                ) else {
                    return;
                };
                let mut all = on_pod.lock().expect("timeline lock");
                let lives = all.entry(p.name_any()).or_insert_with(Vec::new);
                if !lives.iter().any(|(u, _)| *u == uid) {
                    lives.push((uid, node));
                }
            },
            |_| {},
        )
        .await;

        let on_node = Arc::clone(&tainted);
        let prefix = format!("{ns}-");
        let node_task = record(
            Api::<Node>::all(client.clone()),
            move |n: &Node| {
                if n.name_any().starts_with(&prefix) && rollout_tainted(n) {
                    on_node.lock().expect("timeline lock").insert(n.name_any());
                }
            },
            |_| {},
        )
        .await;

        Self {
            start,
            machines,
            pods,
            tainted,
            tasks: vec![machine_task, pod_task, node_task],
        }
    }

    /// The Machine steps so far.
    pub fn steps(&self) -> Vec<Step> {
        self.machines.lock().expect("timeline lock").steps.clone()
    }

    /// How many Machine steps there are so far (a mark for [`Self::since`]).
    pub fn len(&self) -> usize {
        self.machines.lock().expect("timeline lock").steps.len()
    }

    /// The Machine steps after the mark `from`.
    pub fn since(&self, from: usize) -> Vec<Step> {
        self.steps().into_iter().skip(from).collect()
    }

    /// Since the recording started.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Each pod's incarnations (UID, Node), in the order seen.
    pub fn incarnations(&self) -> Incarnations {
        self.pods.lock().expect("timeline lock").clone()
    }

    /// The Nodes seen with the rollout taint.
    pub fn tainted(&self) -> BTreeSet<String> {
        self.tainted.lock().expect("timeline lock").clone()
    }

    /// The Machine steps as lines, for assertion messages.
    pub fn log(&self) -> String {
        log_of(&self.steps())
    }

    /// Checks the recorded rollout to the template `new_hash` against
    /// `pace`, Machines of every other template being old:
    ///
    /// - never more than `replicas + surge` Machines exist (those being
    ///   deleted count: they are VMs);
    /// - never more than `drains_at_once` old Machines are being deleted;
    /// - with a surge, an old Machine's deletion begins only when a ready
    ///   new Machine is there for it: the ready new Machines and the old
    ///   ones not being deleted (it included) are more than `replicas`.
    pub fn assert_paced(&self, new_hash: &str, pace: Pace) -> Peak {
        let steps = self.steps();
        let log = log_of(&steps);
        let mut live: BTreeMap<&str, (&str, bool, bool)> = BTreeMap::new();
        let mut peak = Peak::default();
        for (i, s) in steps.iter().enumerate() {
            match s.seen {
                Seen::Created => {
                    live.insert(&s.machine, (&s.hash, false, false));
                    peak.machines = peak.machines.max(live.len());
                    assert!(
                        live.len() <= pace.replicas + pace.surge,
                        "step {i}: {} Machines exist, more than replicas + maxSurge = {}:\n{log}",
                        live.len(),
                        pace.replicas + pace.surge
                    );
                }
                Seen::Running => {
                    if let Some(m) = live.get_mut(s.machine.as_str()) {
                        m.1 = true;
                    }
                }
                Seen::Deleting => {
                    if s.hash != new_hash {
                        let old_draining = 1 + live
                            .values()
                            .filter(|(h, _, deleting)| *h != new_hash && *deleting)
                            .count();
                        peak.old_draining = peak.old_draining.max(old_draining);
                        assert!(
                            old_draining <= pace.drains_at_once,
                            "step {i}: {old_draining} old Machines being deleted at once, more than {}:\n{log}",
                            pace.drains_at_once
                        );
                        let ready_new = live
                            .values()
                            .filter(|(h, running, deleting)| {
                                *h == new_hash && *running && !deleting
                            })
                            .count();
                        let old_active = live
                            .values()
                            .filter(|(h, _, deleting)| *h != new_hash && !deleting)
                            .count();
                        assert!(
                            pace.surge == 0 || ready_new + old_active > pace.replicas,
                            "step {i}: old Machine {} deleted with {ready_new} ready new Machines and {old_active} old ones: none ready for it:\n{log}",
                            s.machine
                        );
                    }
                    if let Some(m) = live.get_mut(s.machine.as_str()) {
                        m.2 = true;
                    }
                }
                Seen::Gone => {
                    live.remove(s.machine.as_str());
                }
            }
        }
        peak
    }
}

pub fn log_of(steps: &[Step]) -> String {
    steps
        .iter()
        .map(|s| {
            format!(
                "  {:>7.3}s {:?} {} ({})",
                s.at.as_secs_f64(),
                s.seen,
                s.machine,
                s.hash
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
