//! A rollout as the cluster shows it, recorded by watches while it runs:
//! each Machine's steps (created, Running with its Node Ready, deletion
//! begun, gone) in the order of one Machine watch, which is the order the
//! API server wrote them in; each pod's incarnations (UID and Node); and
//! the Nodes that carried berth's rollout taint. The MachineDeployment
//! tests check the pace of a rollout and the moves of its pods against it;
//! the benchmark's rollout scenario takes its times and moves from it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth::api::{Machine, MachineDeployment, ROLLOUT_TAINT_KEY, TEMPLATE_HASH_LABEL};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;

/// How long a watch may take to list.
const LIST_WITHIN: Duration = Duration::from_secs(60);

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
    m.status.as_ref().is_some_and(|s| {
        s.phase == Some(berth::api::MachinePhase::Running)
            && s.conditions
                .iter()
                .any(|c| c.type_ == berth::api::conditions::READY && c.status == "True")
    })
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
) -> anyhow::Result<JoinHandle<()>>
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
    match tokio::time::timeout(LIST_WITHIN, ready).await {
        Ok(Ok(())) => Ok(task),
        Ok(Err(_)) => anyhow::bail!("the timeline's watch ended before listing"),
        Err(_) => {
            task.abort();
            anyhow::bail!("the timeline's watch did not list within {LIST_WITHIN:?}")
        }
    }
}

impl Timeline {
    /// Starts recording the Machines and pods of `ns` and the Nodes named
    /// after it; returns once every watch has listed.
    ///
    /// # Errors
    /// A watch that does not list in time.
    pub async fn start(client: &Client, ns: &str) -> anyhow::Result<Self> {
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
        .await?;

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
        .await?;

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
        .await?;

        Ok(Self {
            start,
            machines,
            pods,
            tainted,
            tasks: vec![machine_task, pod_task, node_task],
        })
    }

    /// The Machine steps so far.
    pub fn steps(&self) -> Vec<Step> {
        self.machines.lock().expect("timeline lock").steps.clone()
    }

    /// A mark for [`Self::since`]: how many Machine steps there are so far.
    pub fn mark(&self) -> usize {
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
    /// `pace`, Machines of every other template being old (Machines of no
    /// template, not of a MachineDeployment, are left out):
    ///
    /// - never more than `replicas + surge` Machines exist (those being
    ///   deleted count: they are VMs);
    /// - never more than `drains_at_once` old Machines are being deleted;
    /// - with a surge, an old Machine's deletion begins only when a ready
    ///   new Machine is there for it: the ready new Machines and the old
    ///   ones not being deleted (it included) are more than `replicas`.
    ///
    /// # Panics
    /// At the first step that breaks one, with the timeline.
    pub fn assert_paced(&self, new_hash: &str, pace: Pace) -> Peak {
        self.paced(new_hash, pace).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Self::assert_paced`] as a result: the peak, or the first step that
    /// broke the pace, with the timeline.
    ///
    /// # Errors
    /// The first step over a limit.
    pub fn paced(&self, new_hash: &str, pace: Pace) -> Result<Peak, String> {
        check_pace(&self.steps(), new_hash, pace)
    }
}

/// [`Timeline::paced`] on recorded steps.
///
/// # Errors
/// The first step over a limit, with the steps.
pub fn check_pace(steps: &[Step], new_hash: &str, pace: Pace) -> Result<Peak, String> {
    let log = log_of(steps);
    let mut live: BTreeMap<&str, (&str, bool, bool)> = BTreeMap::new();
    let mut peak = Peak::default();
    for (i, s) in steps.iter().enumerate().filter(|(_, s)| !s.hash.is_empty()) {
        match s.seen {
            Seen::Created => {
                live.insert(&s.machine, (&s.hash, false, false));
                peak.machines = peak.machines.max(live.len());
                if live.len() > pace.replicas + pace.surge {
                    return Err(format!(
                        "step {i}: {} Machines exist, more than replicas + maxSurge = {}:\n{log}",
                        live.len(),
                        pace.replicas + pace.surge
                    ));
                }
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
                    if old_draining > pace.drains_at_once {
                        return Err(format!(
                            "step {i}: {old_draining} old Machines being deleted at once, more than {}:\n{log}",
                            pace.drains_at_once
                        ));
                    }
                    let ready_new = live
                        .values()
                        .filter(|(h, running, deleting)| *h == new_hash && *running && !deleting)
                        .count();
                    let old_active = live
                        .values()
                        .filter(|(h, _, deleting)| *h != new_hash && !deleting)
                        .count();
                    if pace.surge > 0 && ready_new + old_active <= pace.replicas {
                        return Err(format!(
                            "step {i}: old Machine {} deleted with {ready_new} ready new Machines and {old_active} old ones: none ready for it:\n{log}",
                            s.machine
                        ));
                    }
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
    Ok(peak)
}

/// Whether a MachineDeployment has rolled out: its status is of its
/// current generation, its template is not `from` (when given), it has
/// its replicas and no drain, and says `RolloutComplete`.
pub fn rolled_out(d: &MachineDeployment, from: Option<&str>) -> bool {
    d.status.as_ref().is_some_and(|s| {
        s.observed_generation == d.metadata.generation
            && (from.is_none() || s.template_hash.as_deref() != from)
            && s.draining_replicas == 0
            && s.replicas == d.spec.replicas
            && s.conditions
                .iter()
                .any(|c| c.type_ == "Progressing" && c.reason == "RolloutComplete")
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(list: &[(&str, &str, Seen)]) -> Vec<Step> {
        list.iter()
            .enumerate()
            .map(|(i, (machine, hash, seen))| Step {
                at: Duration::from_millis(i as u64),
                machine: (*machine).into(),
                hash: (*hash).into(),
                seen: *seen,
            })
            .collect()
    }

    const ONE_AT_A_TIME: Pace = Pace {
        replicas: 2,
        surge: 1,
        drains_at_once: 1,
    };

    #[test]
    fn a_rollout_one_at_a_time_keeps_its_pace_beside_machines_of_no_template() {
        use Seen::*;
        let s = steps(&[
            ("a", "old", Created),
            ("b", "old", Created),
            ("lone", "", Created),
            ("c", "new", Created),
            ("c", "new", Running),
            ("a", "old", Deleting),
            ("a", "old", Gone),
            ("d", "new", Created),
            ("d", "new", Running),
            ("b", "old", Deleting),
            ("b", "old", Gone),
        ]);
        let peak = check_pace(&s, "new", ONE_AT_A_TIME).expect("paced");
        assert_eq!((peak.machines, peak.old_draining), (3, 1));
    }

    #[test]
    fn each_limit_is_named_at_the_step_that_breaks_it() {
        use Seen::*;
        let over_surge = steps(&[
            ("a", "old", Created),
            ("b", "old", Created),
            ("c", "new", Created),
            ("d", "new", Created),
        ]);
        let e = check_pace(&over_surge, "new", ONE_AT_A_TIME).expect_err("4 > 2 + 1");
        assert!(e.starts_with("step 3: 4 Machines exist"), "{e}");

        let no_landing = steps(&[
            ("a", "old", Created),
            ("b", "old", Created),
            ("c", "new", Created),
            ("a", "old", Deleting),
        ]);
        let e = check_pace(&no_landing, "new", ONE_AT_A_TIME).expect_err("c is not ready");
        assert!(e.contains("none ready for it"), "{e}");

        let two_drains = steps(&[
            ("a", "old", Created),
            ("b", "old", Created),
            ("a", "old", Deleting),
            ("b", "old", Deleting),
        ]);
        let no_surge = Pace {
            surge: 0,
            ..ONE_AT_A_TIME
        };
        let e = check_pace(&two_drains, "new", no_surge).expect_err("one drain at a time");
        assert!(
            e.starts_with("step 3: 2 old Machines being deleted at once"),
            "{e}"
        );
    }
}
