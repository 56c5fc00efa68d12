//! The `fake` provider: a VM is a ConfigMap `fake-vm-<machine>` in the
//! Machine's namespace, and "booting" it registers a Node carrying the
//! Machine's providerID. Its state lives in the cluster, so it survives a
//! controller restart. It tries berth on a cluster whose Nodes are
//! simulated by kwok (as Cluster API ships an in-memory provider): the Nodes
//! it registers are annotated so that kwok plays their kubelet and the
//! attach-detach controller serves their volumes. It powers the demo, the
//! benchmark and the tests, and is enabled only when `--providers` names it.
//!
//! Failures are injected through the class's `providerSpec`:
//!
//! ```yaml
//! providerSpec:
//!   failCreateTimes: 2      # the first two creates fail (transiently)
//!   failCreatePermanently: false
//!   deleteDelay: 5s         # delete reports "in progress" for 5s
//!   stopDelay: 5s           # stop reports "in progress" for 5s
//!   failStop: false         # true: every stop fails (transiently)
//!   registerNode: true      # false: the VM never registers a Node
//!   nodeReady: true         # false: the Node never becomes Ready
//!   nodeLabels: {pool: a}   # extra labels on the Node
//!   nodeTaints:             # taints the Node registers with, as a cloud's
//!   - {key: node.cloudprovider.kubernetes.io/uninitialized, value: "true", effect: NoSchedule}
//!   csiDrivers:             # the CSI node plugins the VM runs: its CSINode
//!   - {name: csi.example.com, count: 25}   # lists each, with its attach limit
//! ```
//!
//! With its Node, the VM's kubelet registers the Node's CSINode (owned by
//! the Node, as a kubelet's is), listing `csiDrivers`; none by default.
//!
//! A stopped VM's ConfigMap says `state: Stopped` (and when): its kubelet
//! is gone, so its Node loses kwok's annotation and is never Ready again.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Node, NodeSpec, Taint};
use k8s_openapi::api::storage::v1::{CSINode, CSINodeDriver, CSINodeSpec, VolumeNodeResources};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde::Deserialize;

use super::{ListRequest, MachineRef, MachineRequest, Provider, ProviderError, Vm, VmState};
use crate::api::settings::parse_duration;

pub(crate) const NAME: &str = "fake";
const VM_LABEL: &str = "fake.berth.dev/vm";
/// The annotations that name the Machine a fake VM was created for, as a
/// cloud's tags would.
const MACHINE_NAME: &str = "fake.berth.dev/machine";
const MACHINE_UID: &str = "fake.berth.dev/machine-uid";
const FIELD_MANAGER: &str = "berth-fake-provider";

/// The annotation that makes kwok play a Node's kubelet (kwok's
/// `--manage-nodes-with-annotation-selector`).
pub const KWOK_NODE_ANNOTATION: (&str, &str) = ("kwok.x-k8s.io/node", "fake");
/// The annotation without which the attach-detach controller ignores a
/// Node (a real kubelet sets it when it registers).
pub const CONTROLLER_MANAGED_ATTACH_ANNOTATION: (&str, &str) = (
    "volumes.kubernetes.io/controller-managed-attach-detach",
    "true",
);

/// The `providerSpec` the fake driver understands. Unknown fields are
/// rejected so that a typo is reported instead of ignored.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct FakeSpec {
    #[serde(default)]
    pub fail_create_times: u32,
    #[serde(default)]
    pub fail_create_permanently: bool,
    #[serde(default)]
    pub delete_delay: Option<String>,
    #[serde(default = "yes")]
    pub register_node: bool,
    #[serde(default = "yes")]
    pub node_ready: bool,
    #[serde(default)]
    pub node_labels: BTreeMap<String, String>,
    #[serde(default)]
    pub node_taints: Vec<Taint>,
    #[serde(default)]
    pub csi_drivers: Vec<FakeCsiDriver>,
    #[serde(default)]
    pub stop_delay: Option<String>,
    #[serde(default)]
    pub fail_stop: bool,
}

/// A CSI node plugin a fake VM runs: its driver, and the volumes of it
/// the Node can attach (`None`: no limit reported).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct FakeCsiDriver {
    pub name: String,
    #[serde(default)]
    pub count: Option<i32>,
}

fn yes() -> bool {
    true
}

impl FakeSpec {
    pub fn parse(v: &serde_json::Value) -> Result<(Self, Duration), ProviderError> {
        let v = if v.is_null() {
            serde_json::json!({})
        } else {
            v.clone()
        };
        let spec: FakeSpec =
            serde_json::from_value(v).map_err(|e| ProviderError::InvalidSpec(e.to_string()))?;
        let delay = match &spec.delete_delay {
            None => Duration::ZERO,
            Some(s) => parse_duration(s).ok_or_else(|| {
                ProviderError::InvalidSpec(format!("deleteDelay: {s:?} is not a duration"))
            })?,
        };
        Ok((spec, delay))
    }
}

pub struct FakeProvider {
    client: kube::Client,
}

impl FakeProvider {
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }

    fn vms(&self, ns: &str) -> Api<ConfigMap> {
        Api::namespaced(self.client.clone(), ns)
    }

    /// The providerID of the VM for a Machine.
    pub fn provider_id(namespace: &str, name: &str) -> String {
        format!("fake:///{namespace}/{name}")
    }

    /// The Node name the VM of a Machine registers.
    /// The ConfigMap that plays Machine `machine`'s VM.
    pub fn vm_name(machine: &str) -> String {
        vm_name(machine)
    }

    pub fn node_name(namespace: &str, name: &str) -> String {
        format!("{namespace}-{name}")
    }

    async fn register_node(
        &self,
        req: &MachineRequest,
        spec: &FakeSpec,
        provider_id: &str,
    ) -> Result<(), ProviderError> {
        let name = Self::node_name(&req.namespace, &req.name);
        let node = fake_node(&name, provider_id, spec);
        let nodes = Api::<Node>::all(self.client.clone());
        let node = match nodes.create(&PostParams::default(), &node).await {
            Ok(node) => node,
            Err(kube::Error::Api(e)) if e.code == 409 => {
                nodes.get(&name).await.map_err(transient)?
            }
            Err(e) => return Err(transient(e)),
        };
        let csi = fake_csi_node(&node, spec);
        match Api::<CSINode>::all(self.client.clone())
            .create(&PostParams::default(), &csi)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
            Err(e) => Err(transient(e)),
        }
    }
}

/// The Node a fake VM registers: kwok plays its kubelet (unless the spec
/// says it never becomes Ready) and the attach-detach controller serves
/// its volumes.
fn fake_node(name: &str, provider_id: &str, spec: &FakeSpec) -> Node {
    let mut annotations = BTreeMap::from([(
        CONTROLLER_MANAGED_ATTACH_ANNOTATION.0.to_string(),
        CONTROLLER_MANAGED_ATTACH_ANNOTATION.1.to_string(),
    )]);
    if spec.node_ready {
        // Without kwok's annotation nobody ever reports it Ready.
        annotations.insert(
            KWOK_NODE_ANNOTATION.0.to_string(),
            KWOK_NODE_ANNOTATION.1.to_string(),
        );
    }
    let mut labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_string(), name.to_string()),
        ("kubernetes.io/os".to_string(), "linux".to_string()),
    ]);
    labels.extend(spec.node_labels.clone());
    Node {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            annotations: Some(annotations),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            provider_id: Some(provider_id.to_string()),
            taints: (!spec.node_taints.is_empty()).then(|| spec.node_taints.clone()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The CSINode a fake VM's kubelet registers for `node`: owned by it
/// (deleted with it), listing the VM's CSI drivers.
fn fake_csi_node(node: &Node, spec: &FakeSpec) -> CSINode {
    let name = node.metadata.name.clone().unwrap_or_default();
    CSINode {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: name.clone(),
                uid: node.metadata.uid.clone().unwrap_or_default(),
                ..Default::default()
            }]),
            ..Default::default()
        },
        spec: CSINodeSpec {
            drivers: spec
                .csi_drivers
                .iter()
                .map(|d| CSINodeDriver {
                    name: d.name.clone(),
                    node_id: name.clone(),
                    allocatable: Some(VolumeNodeResources { count: d.count }),
                    topology_keys: None,
                })
                .collect(),
        },
        status: None,
    }
}

fn transient(e: kube::Error) -> ProviderError {
    ProviderError::Transient(e.to_string())
}

fn vm_name(machine: &str) -> String {
    format!("fake-vm-{machine}")
}

fn vm_of(cm: &ConfigMap) -> Option<Vm> {
    let data = cm.data.as_ref()?;
    let annotations = cm.metadata.annotations.as_ref();
    let machine = annotations.and_then(|a| {
        Some(MachineRef {
            namespace: cm.metadata.namespace.clone()?,
            name: a.get(MACHINE_NAME)?.clone(),
            uid: a.get(MACHINE_UID)?.clone(),
        })
    });
    let state = match data.get("state").map(String::as_str) {
        Some("Running") => VmState::Running,
        Some("Deleting") => VmState::Deleting,
        Some("Stopped") => VmState::Stopped,
        _ => VmState::Creating,
    };
    Some(Vm {
        provider_id: data.get("providerID")?.clone(),
        state,
        machine,
        created_at: cm.metadata.creation_timestamp.as_ref().map(|t| t.0),
    })
}

#[async_trait::async_trait]
impl Provider for FakeProvider {
    fn name(&self) -> &'static str {
        NAME
    }

    fn validate(&self, provider_spec: &serde_json::Value) -> Result<(), ProviderError> {
        FakeSpec::parse(provider_spec).map(|_| ())
    }

    async fn create(&self, req: &MachineRequest) -> Result<Vm, ProviderError> {
        let (spec, _) = FakeSpec::parse(&req.provider_spec)?;
        let api = self.vms(&req.namespace);
        let name = vm_name(&req.name);
        let provider_id = Self::provider_id(&req.namespace, &req.name);
        let existing = api.get_opt(&name).await.map_err(transient)?;
        let attempts: u32 = existing
            .as_ref()
            .and_then(|cm| cm.data.as_ref()?.get("failedCreates")?.parse().ok())
            .unwrap_or(0);
        if let Some(vm) = existing.as_ref().and_then(vm_of)
            && vm.state == VmState::Running
        {
            if spec.register_node {
                self.register_node(req, &spec, &vm.provider_id).await?;
            }
            return Ok(vm);
        }
        let failing = spec.fail_create_permanently || attempts < spec.fail_create_times;
        let data = BTreeMap::from([
            ("providerID".to_string(), provider_id.clone()),
            (
                "state".to_string(),
                if failing { "Creating" } else { "Running" }.to_string(),
            ),
            (
                "failedCreates".to_string(),
                (attempts + u32::from(failing)).to_string(),
            ),
        ]);
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([(VM_LABEL.to_string(), "true".to_string())])),
                annotations: Some(BTreeMap::from([
                    (MACHINE_NAME.to_string(), req.name.clone()),
                    (MACHINE_UID.to_string(), req.uid.clone()),
                ])),
                ..Default::default()
            },
            data: Some(data),
            ..Default::default()
        };
        api.patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&cm),
        )
        .await
        .map_err(transient)?;
        if spec.fail_create_permanently {
            return Err(ProviderError::Permanent(
                "injected permanent create failure".into(),
            ));
        }
        if failing {
            return Err(ProviderError::Transient(format!(
                "injected create failure {} of {}",
                attempts + 1,
                spec.fail_create_times
            )));
        }
        if spec.register_node {
            self.register_node(req, &spec, &provider_id).await?;
        }
        Ok(Vm {
            provider_id,
            state: VmState::Running,
            machine: Some(MachineRef {
                namespace: req.namespace.clone(),
                name: req.name.clone(),
                uid: req.uid.clone(),
            }),
            created_at: None,
        })
    }

    async fn delete(&self, req: &MachineRequest) -> Result<(), ProviderError> {
        let (_, delay) = FakeSpec::parse(&req.provider_spec)?;
        let api = self.vms(&req.namespace);
        let name = vm_name(&req.name);
        // The fake cloud is consistent: a VM it does not have is certainly
        // gone.
        let Some(cm) = api.get_opt(&name).await.map_err(transient)? else {
            return Ok(());
        };
        if !delay.is_zero() {
            let requested = cm
                .data
                .as_ref()
                .and_then(|d| d.get("deleteRequestedAt"))
                .and_then(|t| t.parse::<Timestamp>().ok());
            let now = Timestamp::now();
            let Some(requested) = requested else {
                let patch = serde_json::json!({"data": {"state": "Deleting", "deleteRequestedAt": now.to_string()}});
                api.patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                    .await
                    .map_err(transient)?;
                return Err(ProviderError::InProgress {
                    what: format!("deleting {name}"),
                    retry_after: delay,
                });
            };
            let elapsed = Duration::try_from(now.duration_since(requested)).unwrap_or_default();
            if elapsed < delay {
                return Err(ProviderError::InProgress {
                    what: format!("deleting {name}"),
                    retry_after: delay - elapsed,
                });
            }
        }
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(transient(e)),
        }
    }

    /// Stops the VM: `state: Stopped` once `stopDelay` has passed since
    /// the first stop, and its Node is no longer played by kwok.
    async fn stop(&self, req: &MachineRequest) -> Result<(), ProviderError> {
        let (spec, _) = FakeSpec::parse(&req.provider_spec)?;
        if spec.fail_stop {
            return Err(ProviderError::Transient("injected stop failure".into()));
        }
        let delay = match &spec.stop_delay {
            None => Duration::ZERO,
            Some(s) => parse_duration(s).ok_or_else(|| {
                ProviderError::InvalidSpec(format!("stopDelay: {s:?} is not a duration"))
            })?,
        };
        let api = self.vms(&req.namespace);
        let name = vm_name(&req.name);
        let Some(cm) = api.get_opt(&name).await.map_err(transient)? else {
            // The fake cloud is consistent: a VM it does not have is gone.
            return Ok(());
        };
        let data = cm.data.clone().unwrap_or_default();
        if data.get("state").map(String::as_str) == Some("Stopped") {
            return Ok(());
        }
        let now = Timestamp::now();
        let requested = data
            .get("stopRequestedAt")
            .and_then(|t| t.parse::<Timestamp>().ok());
        let Some(requested) = requested.or(delay.is_zero().then_some(now)) else {
            let patch = serde_json::json!({"data": {"stopRequestedAt": now.to_string()}});
            api.patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                .await
                .map_err(transient)?;
            return Err(ProviderError::InProgress {
                what: format!("stopping {name}"),
                retry_after: delay,
            });
        };
        let elapsed = Duration::try_from(now.duration_since(requested)).unwrap_or_default();
        if elapsed < delay {
            return Err(ProviderError::InProgress {
                what: format!("stopping {name}"),
                retry_after: delay - elapsed,
            });
        }
        // Its kubelet stops with it: kwok no longer plays the Node.
        let node = Self::node_name(&req.namespace, &req.name);
        let unplayed =
            serde_json::json!({"metadata": {"annotations": {KWOK_NODE_ANNOTATION.0: null}}});
        match Api::<Node>::all(self.client.clone())
            .patch(&node, &PatchParams::default(), &Patch::Merge(unplayed))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(transient(e)),
        }
        let patch = serde_json::json!({"data": {"state": "Stopped", "stoppedAt": now.to_string()}});
        api.patch(&name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map_err(transient)?;
        Ok(())
    }

    /// The VM the providerID names (`fake:///<namespace>/<machine>`), else
    /// the Machine's own.
    async fn get(&self, req: &MachineRequest) -> Result<Vm, ProviderError> {
        let named = req
            .provider_id
            .as_deref()
            .and_then(|p| p.strip_prefix("fake:///")?.split_once('/'));
        let (ns, machine) = named.unwrap_or((req.namespace.as_str(), req.name.as_str()));
        let name = vm_name(machine);
        self.vms(ns)
            .get_opt(&name)
            .await
            .map_err(transient)?
            .as_ref()
            .and_then(vm_of)
            .ok_or(ProviderError::NotFound(name))
    }

    /// The fake cloud has one region: every class lists the same VMs.
    fn list_scope(&self, _: &ListRequest) -> String {
        String::new()
    }

    /// Every fake VM in the cluster: the fake cloud has one region.
    async fn list(&self, _: &ListRequest) -> Result<Vec<Vm>, ProviderError> {
        let cms = Api::<ConfigMap>::all(self.client.clone())
            .list(&ListParams::default().labels(&format!("{VM_LABEL}=true")))
            .await
            .map_err(transient)?;
        Ok(cms.items.iter().filter_map(vm_of).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absent_spec_means_a_healthy_vm() {
        let (spec, delay) = FakeSpec::parse(&serde_json::Value::Null).expect("valid");
        assert!(spec.register_node && spec.node_ready);
        assert_eq!(spec.fail_create_times, 0);
        assert_eq!(delay, Duration::ZERO);
    }

    #[test]
    fn injected_failures_are_read_from_the_spec() {
        let (spec, delay) = FakeSpec::parse(&serde_json::json!({
            "failCreateTimes": 2, "deleteDelay": "3s", "nodeReady": false
        }))
        .expect("valid");
        assert_eq!(spec.fail_create_times, 2);
        assert!(!spec.node_ready);
        assert_eq!(delay, Duration::from_secs(3));
    }

    #[test]
    fn typos_and_bad_durations_are_invalid_specs() {
        for bad in [
            serde_json::json!({"failCreateTime": 1}),
            serde_json::json!({"deleteDelay": "soon"}),
            serde_json::json!({"registerNode": "yes"}),
        ] {
            assert!(
                matches!(FakeSpec::parse(&bad), Err(ProviderError::InvalidSpec(_))),
                "{bad} must be rejected"
            );
        }
    }

    #[test]
    fn the_node_is_played_by_kwok_unless_it_must_never_be_ready() {
        let (ready, _) =
            FakeSpec::parse(&serde_json::json!({"nodeLabels": {"pool": "a"}})).expect("valid");
        let node = fake_node("ns-m1", "fake:///ns/m1", &ready);
        let annotations = node.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(
            annotations.get(KWOK_NODE_ANNOTATION.0).map(String::as_str),
            Some(KWOK_NODE_ANNOTATION.1)
        );
        assert!(annotations.contains_key(CONTROLLER_MANAGED_ATTACH_ANNOTATION.0));
        let labels = node.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels.get("pool").map(String::as_str), Some("a"));
        assert_eq!(
            labels.get("kubernetes.io/hostname").map(String::as_str),
            Some("ns-m1")
        );
        assert_eq!(
            node.spec.and_then(|s| s.provider_id).as_deref(),
            Some("fake:///ns/m1")
        );

        let (never, _) = FakeSpec::parse(&serde_json::json!({"nodeReady": false})).expect("valid");
        let node = fake_node("ns-m1", "fake:///ns/m1", &never);
        let annotations = node.metadata.annotations.unwrap_or_default();
        assert!(!annotations.contains_key(KWOK_NODE_ANNOTATION.0));
        assert!(annotations.contains_key(CONTROLLER_MANAGED_ATTACH_ANNOTATION.0));
    }

    #[test]
    fn ids_and_node_names_are_derived_from_the_machine() {
        assert_eq!(FakeProvider::provider_id("ns", "m1"), "fake:///ns/m1");
        assert_eq!(FakeProvider::node_name("ns", "m1"), "ns-m1");
    }
}
