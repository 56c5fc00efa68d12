//! The joining kubelet for moto: what a booting EC2 instance's kubelet
//! (and the AWS cloud provider) do to the cluster, played against moto and
//! the test bed. There is no real kubelet; kwok plays the Node once it is
//! registered.
//!
//! [`MotoKubelet::start`] polls moto (`DescribeInstances` filtered by
//! `tag:berth.dev/cluster=<cluster id>` and `instance-state-name=running`)
//! and registers a Node for each running instance of the cluster, the way
//! the AWS cloud provider names and labels it:
//!
//! - name: the instance's `privateDnsName` (its instance id when it has
//!   none, or with [`NodeNaming::InstanceId`]);
//! - `spec.providerID`: `aws:///<availability zone>/<instance id>`;
//! - labels `kubernetes.io/hostname`, `kubernetes.io/os=linux`,
//!   `kubernetes.io/arch`, `topology.kubernetes.io/zone`,
//!   `topology.kubernetes.io/region`, `node.kubernetes.io/instance-type`;
//! - the annotations that make kwok play its kubelet (so it becomes Ready)
//!   and the attach-detach controller serve its volumes.
//!
//! # Once per boot
//!
//! A kubelet registers its Node when it starts, and does not register it
//! again if the Node is deleted later: it keeps failing to update a Node
//! that is gone until it is restarted. So this one registers each instance
//! once per boot: an instance whose Node berth deleted gets no new Node
//! while it keeps running, nor once it is shutting down or terminated. An
//! instance that leaves `running` (stopped) and comes back is a new boot:
//! it registers again if its Node is gone (and takes the Node as it is if
//! it is still there). moto does not change `launchTime` on a restart, so
//! a boot is told by the instance leaving the running set between two
//! polls; a test that stops and starts an instance must let the kubelet
//! poll in between ([`MotoKubelet::polled`]).
//!
//! If the Node of an instance's name already exists, carrying the same
//! providerID, it is taken as registered. With another providerID it is a
//! [`Conflict`]: nothing is written, and the instance is not tried again
//! until it reboots. Two moto servers hand out the same private addresses
//! (and so the same `privateDnsName`s) in the same region: tests that share
//! a test bed and register Nodes from several moto servers at once must use
//! different regions or [`NodeNaming::InstanceId`].
//!
//! Dropping the handle stops the kubelet. The Nodes stay.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, NodeSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use tokio::sync::watch;

use super::ec2::{Ec2, Instance};
use crate::testbed::{CONTROLLER_MANAGED_ATTACH_ANNOTATION, KWOK_NODE_ANNOTATION};

/// The tag that says which cluster an instance belongs to.
pub const CLUSTER_TAG: &str = "berth.dev/cluster";

/// How a registered Node is named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NodeNaming {
    /// The instance's `privateDnsName` (the instance id when it has none),
    /// as the AWS cloud provider names Nodes by default.
    #[default]
    PrivateDnsName,
    /// The instance id (EC2's resource-name hostnames): unique across moto
    /// servers.
    InstanceId,
}

/// How a [`MotoKubelet`] behaves.
#[derive(Debug, Clone)]
pub struct KubeletOptions {
    /// The value of the `berth.dev/cluster` tag of the instances to join.
    pub cluster_id: String,
    /// How often moto is polled.
    pub every: Duration,
    pub naming: NodeNaming,
    /// How long an instance is seen running before its Node registers (a
    /// boot).
    pub boot_time: Duration,
    /// Whether kwok plays the Node: without it, it never becomes Ready.
    pub ready: bool,
    /// Extra labels on every Node.
    pub labels: BTreeMap<String, String>,
    /// The CSI drivers its CSINode lists (no attach limit): the test
    /// bed's by default.
    pub csi_drivers: Vec<String>,
}

impl KubeletOptions {
    pub fn new(cluster_id: &str) -> Self {
        KubeletOptions {
            cluster_id: cluster_id.into(),
            every: Duration::from_millis(300),
            naming: NodeNaming::default(),
            boot_time: Duration::ZERO,
            ready: true,
            labels: BTreeMap::new(),
            csi_drivers: vec![crate::testbed::stages::CSI_DRIVER.to_string()],
        }
    }

    pub fn every(mut self, every: Duration) -> Self {
        self.every = every;
        self
    }

    pub fn naming(mut self, naming: NodeNaming) -> Self {
        self.naming = naming;
        self
    }

    pub fn boot_time(mut self, boot_time: Duration) -> Self {
        self.boot_time = boot_time;
        self
    }

    pub fn ready(mut self, ready: bool) -> Self {
        self.ready = ready;
        self
    }

    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }
}

/// An instance whose Node the kubelet registered (or found registered).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    pub instance_id: String,
    pub node: String,
    pub provider_id: String,
    /// The Node was there already, with this providerID.
    pub adopted: bool,
}

/// An instance whose Node name is taken by a Node of another providerID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub instance_id: String,
    pub node: String,
    pub provider_id: String,
    pub existing_provider_id: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("instance {instance_id}: {conflict:?}")]
    Conflict {
        instance_id: String,
        conflict: Conflict,
    },
    #[error("timed out after {timeout:?} waiting for {what} (last error: {last_error:?})")]
    Timeout {
        what: String,
        timeout: Duration,
        last_error: Option<String>,
    },
}

#[derive(Debug, Clone, Default)]
struct State {
    registrations: Vec<Registration>,
    conflicts: Vec<Conflict>,
    polls: u64,
    last_error: Option<String>,
}

/// A running kubelet; dropping it stops it.
pub struct MotoKubelet {
    state: watch::Receiver<State>,
    task: tokio::task::JoinHandle<()>,
}

impl MotoKubelet {
    /// Joins the running instances tagged `berth.dev/cluster=<cluster_id>`
    /// that `ec2` (moto's endpoint and region) sees, to the cluster of
    /// `client`, with the default [`KubeletOptions`].
    pub fn start(client: kube::Client, ec2: Ec2, cluster_id: &str) -> Self {
        Self::start_with(client, ec2, KubeletOptions::new(cluster_id))
    }

    pub fn start_with(client: kube::Client, ec2: Ec2, options: KubeletOptions) -> Self {
        let (tx, rx) = watch::channel(State::default());
        let task = tokio::spawn(run(client, ec2, options, tx));
        MotoKubelet { state: rx, task }
    }

    /// Every registration so far, oldest first.
    pub fn registrations(&self) -> Vec<Registration> {
        self.state.borrow().registrations.clone()
    }

    /// Every conflict so far, oldest first.
    pub fn conflicts(&self) -> Vec<Conflict> {
        self.state.borrow().conflicts.clone()
    }

    /// How many polls completed (instances listed and registered).
    pub fn polls(&self) -> u64 {
        self.state.borrow().polls
    }

    /// The last error of a poll or a registration (both retried).
    pub fn last_error(&self) -> Option<String> {
        self.state.borrow().last_error.clone()
    }

    /// Waits until the instance is registered (its latest registration);
    /// fails at once if its Node name is taken.
    pub async fn registered(
        &self,
        instance_id: &str,
        timeout: Duration,
    ) -> Result<Registration, KubeletError> {
        let found = |s: &State| {
            s.registrations
                .iter()
                .rev()
                .find(|r| r.instance_id == instance_id)
                .cloned()
                .map(Ok)
                .or_else(|| {
                    s.conflicts
                        .iter()
                        .find(|c| c.instance_id == instance_id)
                        .map(|c| {
                            Err(KubeletError::Conflict {
                                instance_id: instance_id.into(),
                                conflict: c.clone(),
                            })
                        })
                })
        };
        let mut rx = self.state.clone();
        let waited = tokio::time::timeout(timeout, rx.wait_for(|s| found(s).is_some())).await;
        match waited {
            Ok(Ok(state)) => found(&state).unwrap_or_else(|| unreachable!("waited for it")),
            _ => Err(self.timeout(format!("instance {instance_id} to register"), timeout)),
        }
    }

    /// Waits until `n` more polls completed: what a test waits for before
    /// it asserts that something did not happen.
    pub async fn polled(&self, n: u64, timeout: Duration) -> Result<(), KubeletError> {
        let target = self.polls() + n;
        let mut rx = self.state.clone();
        match tokio::time::timeout(timeout, rx.wait_for(|s| s.polls >= target)).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(self.timeout(format!("{n} polls"), timeout)),
        }
    }

    fn timeout(&self, what: String, timeout: Duration) -> KubeletError {
        KubeletError::Timeout {
            what,
            timeout,
            last_error: self.last_error(),
        }
    }
}

impl Drop for MotoKubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The Node the instance's kubelet registers, or `None` when the instance
/// has no availability zone (so no providerID).
pub fn node_for(instance: &Instance, region: &str, options: &KubeletOptions) -> Option<Node> {
    let provider_id = instance.provider_id()?;
    let name = node_name(instance, options.naming);
    let mut annotations = BTreeMap::from([(
        CONTROLLER_MANAGED_ATTACH_ANNOTATION.0.to_string(),
        CONTROLLER_MANAGED_ATTACH_ANNOTATION.1.to_string(),
    )]);
    if options.ready {
        annotations.insert(
            KWOK_NODE_ANNOTATION.0.to_string(),
            KWOK_NODE_ANNOTATION.1.to_string(),
        );
    }
    let arch = match instance.architecture.as_deref() {
        Some("arm64") => "arm64",
        _ => "amd64",
    };
    let mut labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_string(), name.clone()),
        ("kubernetes.io/os".to_string(), "linux".to_string()),
        ("kubernetes.io/arch".to_string(), arch.to_string()),
        (
            "topology.kubernetes.io/region".to_string(),
            region.to_string(),
        ),
    ]);
    if let Some(zone) = &instance.zone {
        labels.insert("topology.kubernetes.io/zone".into(), zone.clone());
    }
    if let Some(t) = &instance.instance_type {
        labels.insert("node.kubernetes.io/instance-type".into(), t.clone());
    }
    labels.extend(options.labels.clone());
    Some(Node {
        metadata: ObjectMeta {
            name: Some(name),
            annotations: Some(annotations),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            provider_id: Some(provider_id),
            ..Default::default()
        }),
        ..Default::default()
    })
}

fn node_name(instance: &Instance, naming: NodeNaming) -> String {
    match naming {
        NodeNaming::PrivateDnsName => instance
            .private_dns_name
            .clone()
            .unwrap_or_else(|| instance.id.clone()),
        NodeNaming::InstanceId => instance.id.clone(),
    }
}

/// One boot of an instance, as the kubelet sees it.
struct Boot {
    since: Instant,
    /// Registered, or given up on (a conflict): nothing more this boot.
    done: bool,
}

enum Outcome {
    Registered(Registration),
    Conflict(Conflict),
}

async fn run(client: kube::Client, ec2: Ec2, options: KubeletOptions, state: watch::Sender<State>) {
    let nodes: Api<Node> = Api::all(client);
    let tag = format!("tag:{CLUSTER_TAG}");
    let cluster = [options.cluster_id.as_str()];
    let filters: [(&str, &[&str]); 2] = [(&tag, &cluster), ("instance-state-name", &["running"])];
    let mut boots: HashMap<String, Boot> = HashMap::new();
    loop {
        match ec2.instances(&filters).await {
            Err(e) => state.send_modify(|s| s.last_error = Some(e.to_string())),
            Ok(running) => {
                // An instance no longer running has shut down: if it runs
                // again, that is a new boot.
                let ids: HashSet<&str> = running.iter().map(|i| i.id.as_str()).collect();
                boots.retain(|id, _| ids.contains(id.as_str()));
                for instance in &running {
                    let boot = boots.entry(instance.id.clone()).or_insert(Boot {
                        since: Instant::now(),
                        done: false,
                    });
                    if boot.done || boot.since.elapsed() < options.boot_time {
                        continue;
                    }
                    match register(&nodes, instance, ec2.region(), &options).await {
                        Ok(Outcome::Registered(r)) => {
                            boot.done = true;
                            state.send_modify(|s| s.registrations.push(r));
                        }
                        Ok(Outcome::Conflict(c)) => {
                            boot.done = true;
                            state.send_modify(|s| s.conflicts.push(c));
                        }
                        Err(e) => state.send_modify(|s| {
                            s.last_error = Some(format!("registering {}: {e}", instance.id))
                        }),
                    }
                }
                state.send_modify(|s| s.polls += 1);
            }
        }
        tokio::time::sleep(options.every).await;
    }
}

async fn register(
    nodes: &Api<Node>,
    instance: &Instance,
    region: &str,
    options: &KubeletOptions,
) -> Result<Outcome, String> {
    let node = node_for(instance, region, options)
        .ok_or_else(|| "no availability zone: no providerID".to_string())?;
    let name = node.metadata.name.clone().unwrap_or_default();
    let provider_id = instance.provider_id().unwrap_or_default();
    let registration = |adopted| {
        Outcome::Registered(Registration {
            instance_id: instance.id.clone(),
            node: name.clone(),
            provider_id: provider_id.clone(),
            adopted,
        })
    };
    match nodes.create(&PostParams::default(), &node).await {
        Ok(node) => {
            csi_node(nodes, &node, &options.csi_drivers).await?;
            Ok(registration(false))
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let existing = nodes
                .get_opt(&name)
                .await
                .map_err(|e| e.to_string())?
                // Deleted in between: register on the next poll.
                .ok_or_else(|| format!("Node {name} went away while registering"))?;
            let existing_provider_id = existing.spec.clone().and_then(|s| s.provider_id);
            if existing_provider_id.as_deref() == Some(provider_id.as_str()) {
                csi_node(nodes, &existing, &options.csi_drivers).await?;
                Ok(registration(true))
            } else {
                Ok(Outcome::Conflict(Conflict {
                    instance_id: instance.id.clone(),
                    node: name,
                    provider_id,
                    existing_provider_id,
                }))
            }
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Registers `node`'s CSINode (owned by it, as a kubelet's), listing
/// `drivers`; one already there is kept.
async fn csi_node(nodes: &Api<Node>, node: &Node, drivers: &[String]) -> Result<(), String> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let csi: k8s_openapi::api::storage::v1::CSINode = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": name,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name,
                                 "uid": node.metadata.uid.clone().unwrap_or_default()}]
        },
        "spec": {"drivers": drivers.iter().map(|d| serde_json::json!({"name": d, "nodeID": name}))
            .collect::<Vec<_>>()}
    }))
    .map_err(|e| e.to_string())?;
    match Api::all(nodes.clone().into_client())
        .create(&PostParams::default(), &csi)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance() -> Instance {
        Instance {
            id: "i-0abc".into(),
            state: "running".into(),
            zone: Some("eu-west-1b".into()),
            private_dns_name: Some("ip-172-31-16-4.eu-west-1.compute.internal".into()),
            instance_type: Some("m5.large".into()),
            architecture: Some("x86_64".into()),
            ..Default::default()
        }
    }

    #[test]
    fn the_node_is_named_and_labelled_as_the_aws_cloud_provider_does() {
        let options = KubeletOptions::new("c1").label("pool", "a");
        let node = node_for(&instance(), "eu-west-1", &options).expect("a Node");
        let name = "ip-172-31-16-4.eu-west-1.compute.internal";
        assert_eq!(node.metadata.name.as_deref(), Some(name));
        assert_eq!(
            node.spec.and_then(|s| s.provider_id).as_deref(),
            Some("aws:///eu-west-1b/i-0abc")
        );
        let labels = node.metadata.labels.unwrap_or_default();
        for (k, v) in [
            ("kubernetes.io/hostname", name),
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", "amd64"),
            ("topology.kubernetes.io/zone", "eu-west-1b"),
            ("topology.kubernetes.io/region", "eu-west-1"),
            ("node.kubernetes.io/instance-type", "m5.large"),
            ("pool", "a"),
        ] {
            assert_eq!(labels.get(k).map(String::as_str), Some(v), "{k}");
        }
        let annotations = node.metadata.annotations.unwrap_or_default();
        assert!(annotations.contains_key(KWOK_NODE_ANNOTATION.0));
        assert!(annotations.contains_key(CONTROLLER_MANAGED_ATTACH_ANNOTATION.0));
    }

    #[test]
    fn the_instance_id_names_a_node_without_a_private_dns_name_or_when_asked() {
        let mut i = instance();
        let by_id = KubeletOptions::new("c1").naming(NodeNaming::InstanceId);
        let node = node_for(&i, "eu-west-1", &by_id).expect("a Node");
        assert_eq!(node.metadata.name.as_deref(), Some("i-0abc"));
        i.private_dns_name = None;
        let node = node_for(&i, "eu-west-1", &KubeletOptions::new("c1")).expect("a Node");
        assert_eq!(node.metadata.name.as_deref(), Some("i-0abc"));
        let never_ready = KubeletOptions::new("c1").ready(false);
        let node = node_for(&i, "eu-west-1", &never_ready).expect("a Node");
        let annotations = node.metadata.annotations.unwrap_or_default();
        assert!(!annotations.contains_key(KWOK_NODE_ANNOTATION.0));
        assert!(annotations.contains_key(CONTROLLER_MANAGED_ATTACH_ANNOTATION.0));
        i.zone = None;
        assert!(node_for(&i, "eu-west-1", &KubeletOptions::new("c1")).is_none());
    }
}
