//! The `berth.dev/v1alpha1` API: `MachineClass` and `DrainRule`
//! (cluster-scoped), `Machine`, `MachineSet` and `MachineDeployment`
//! (namespaced), and the
//! move ledger's `MovePermit` (namespaced, beside its workload; berth's
//! own record, not for operators to write).
//!
//! The CRD YAML in `deploy/crds.yaml` and `charts/berth/templates/crds.yaml` is generated
//! from these types by `berth crd` and checked for drift by a test. What can
//! be checked statically (duration syntax, non-empty names) is enforced by the
//! apiserver through CEL; what depends on other objects (does the class
//! exist, is the provider known) is checked by the reconciler and reported as
//! a condition.

pub mod ask;
pub mod drainrule;
pub mod machinedeployment;
pub mod machineset;
pub mod owners;
pub mod permit;
pub mod remediation;
pub mod resources;
pub mod settings;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, Time};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use serde::{Deserialize, Serialize};

pub use ask::{MoveAsk, MoveAskSpec, ask_name};
pub use drainrule::DrainRule;
pub use machinedeployment::{
    CLASS_HASH_ANNOTATION, MachineDeployment, MachineDeploymentSpec, MachineDeploymentStatus,
    REVISION_ANNOTATION, ROLLOUT_TAINT_KEY, RollingUpdate, SUPERSEDED_ANNOTATION, Strategy,
    StrategyType, TEMPLATE_HASH_LABEL,
};
pub use machineset::{
    DELETE_PRIORITY_ANNOTATION, MachineSet, MachineSetSpec, MachineSetStatus, MachineTemplate,
    TemplateMetadata,
};
pub use owners::{controlling_set, owner_of, owner_ref, set_owner};
pub use permit::{MovePermit, MovePermitSpec, PermitSurge, SURGED_FOR_ANNOTATION, permit_name};
pub use remediation::{Remediation, RemediationStatus, RemediationStep};
pub use settings::{DrainSettings, NodeLocalVolumes, ResolvedSettings, SettingsError};

pub const GROUP: &str = "berth.dev";
/// The finalizer berth puts on every Machine it manages.
pub const FINALIZER: &str = "machine.berth.dev/finalizer";
/// A Machine with this label set to `"true"` is deleted without a drain:
/// its pods are force-deleted (grace 0, each pinned to its UID, once; a
/// DaemonSet's pods and static pods are left to the VM's end) and the VM
/// goes.
pub const FORCE_DELETION_LABEL: &str = "berth.dev/force-deletion";
/// Annotations with this prefix on a Machine hold its deletion before the
/// drain (lifecycle hooks for other controllers).
pub const PRE_DRAIN_HOOK_PREFIX: &str = "pre-drain.delete.hook.berth.dev/";
/// Annotations with this prefix hold the deletion before the VM is deleted.
pub const PRE_TERMINATE_HOOK_PREFIX: &str = "pre-terminate.delete.hook.berth.dev/";
/// Set to `"true"` on a pod, or on a Machine for all its pods, this lets a
/// drain with `nodeLocalVolumes: Block` evict pods whose node-local
/// PersistentVolumes lose their data with the VM.
pub const ALLOW_NODE_LOCAL_DATA_LOSS: &str = "berth.dev/allow-node-local-data-loss";
/// The NoSchedule taint berth puts on a Node it cordons.
pub const CORDON_TAINT_KEY: &str = "berth.dev/terminating";
/// When berth cordoned a Node (RFC 3339), written with the cordon: a pod
/// created on the Node after it came back, one created before was there all
/// along and is drained.
pub const CORDONED_AT_ANNOTATION: &str = "berth.dev/cordoned-at";

/// When Node `node` was cordoned by berth, from its
/// [`CORDONED_AT_ANNOTATION`]; `None` without one (cordoned by an earlier
/// release, or not yet).
pub fn cordoned_at(
    node: &k8s_openapi::api::core::v1::Node,
) -> Option<k8s_openapi::jiff::Timestamp> {
    node.metadata
        .annotations
        .as_ref()?
        .get(CORDONED_AT_ANNOTATION)?
        .parse()
        .ok()
}

/// Whether a toleration tolerates berth's cordon taint
/// ([`CORDON_TAINT_KEY`], `NoSchedule`): a
/// pod with one may be scheduled back onto the Node being drained.
pub fn tolerates_cordon(t: &k8s_openapi::api::core::v1::Toleration) -> bool {
    let effect_ok = t
        .effect
        .as_deref()
        .is_none_or(|e| e.is_empty() || e == "NoSchedule");
    let key_ok = match t.key.as_deref() {
        None | Some("") => t.operator.as_deref() == Some("Exists"),
        Some(k) => k == CORDON_TAINT_KEY,
    };
    effect_ok && key_ok
}

/// The types of the conditions berth sets on a Machine.
pub mod conditions {
    /// The Machine's Node is Ready (or why not: creating, invalid class,
    /// creation timeout).
    pub const READY: &str = "Ready";
    /// A Running Machine's Node has not been NotReady past the health
    /// timeout.
    pub const NODE_HEALTHY: &str = "NodeHealthy";
    /// No pod the drain has to move is left on the Node.
    pub const DRAINED: &str = "Drained";
    /// No VolumeAttachment names the Node any more. False with reason
    /// `Detaching` while they are waited for; `VolumesLeftAttached` when
    /// the VM is deleted with some still attached (naming each PV);
    /// `ReleasingVolumes` once the VM is gone and the Node is tainted
    /// `node.kubernetes.io/out-of-service` to release them.
    pub const VOLUMES_DETACHED: &str = "VolumesDetached";
    /// Pods on the Node use node-local PersistentVolumes, whose data is
    /// lost with the VM: True with reason `DataLost` once such pods were
    /// evicted (naming each PV), False with reason `EvictionHeld` while
    /// `nodeLocalVolumes: Block` holds them (saying how to let them go).
    pub const NODE_LOCAL_VOLUMES: &str = "NodeLocalVolumes";
    /// Set before the provider is first asked for the VM. A Machine without
    /// it and without a providerID never had a VM, so its deletion needs no
    /// provider (which may not even be resolvable).
    pub const VM_REQUESTED: &str = "VMRequested";
    /// The drain of a Machine being deleted uses its class's settings. False
    /// when the class is missing or invalid: the drain then uses the
    /// Machine's own `spec.drain` and built-in defaults for the rest, and
    /// the message says which.
    pub const DRAIN_SETTINGS: &str = "DrainSettings";
    /// What became of an unhealthy Machine: False with reason
    /// `RemediationOff` (its class and pool leave it as it is) or
    /// `RemediationHeld` (too many Machines are unhealthy: a partition is
    /// not remediated); True while it is remediated (`Fencing`,
    /// `FenceFailed`, `FenceUnsupported`, `WaitingForMovePermits`,
    /// `Freeing`, `Replacing`) and once it was (`Replaced`, `Failed`);
    /// False with `RemediationCanceled` when its Node came back before the
    /// VM was fenced.
    pub const REMEDIATION: &str = "Remediation";
}

/// A class of Machines: which provider creates them, with what parameters,
/// and the default drain settings of its Machines.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "berth.dev",
    version = "v1alpha1",
    kind = "MachineClass",
    shortname = "mcls",
    category = "berth",
    printcolumn = r#"{"name":"Provider","type":"string","jsonPath":".spec.provider"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MachineClassSpec {
    /// Name of the provider driver that creates and deletes this class's VMs
    /// (`aws`, or `fake` for kwok clusters).
    #[x_kube(validation = Rule::new("self != ''").message("provider must not be empty"))]
    pub provider: String,
    /// Free-form parameters handed to the provider driver unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_object")]
    pub provider_spec: Option<serde_json::Value>,
    /// Secret with the provider's credentials, if it needs any (for `aws`:
    /// the keys `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and optionally
    /// `AWS_SESSION_TOKEN`; without it, the controller's own AWS
    /// credentials chain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretReference>,
    /// Default drain settings for Machines of this class. A Machine's own
    /// `spec.drain` overrides them field by field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<DrainSettings>,
    /// How long a new Machine may take from creation until its Node is Ready
    /// before it is marked Failed (a duration such as `20m`; default 20m).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = settings::duration_rule())]
    pub creation_timeout: Option<String>,
    /// How long the Node of a Running Machine may stay NotReady before the
    /// Machine reports it as unhealthy (default 10m).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = settings::duration_rule())]
    pub health_timeout: Option<String>,
    /// What berth does with a Running Machine of this class whose Node
    /// stays unhealthy (default: nothing but name it). A MachineSet's
    /// `remediation` wins field by field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remediation: Option<Remediation>,
}

/// A reference to a Secret.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct SecretReference {
    /// Name of the Secret.
    pub name: String,
    /// Namespace of the Secret.
    pub namespace: String,
}

/// A VM and the Node it runs. Deleting a Machine drains its Node in a
/// volume-aware order before the VM is deleted.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "berth.dev",
    version = "v1alpha1",
    kind = "Machine",
    namespaced,
    status = "MachineStatus",
    shortname = "mach",
    category = "berth",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".status.nodeRef.name"}"#,
    printcolumn = r#"{"name":"Drain","type":"string","jsonPath":".status.drain.progress","description":"pods evicted / pods to drain"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MachineSpec {
    /// The MachineClass this Machine is created from.
    pub class_ref: ClassReference,
    /// The provider's ID of the VM (`<provider>://<id>`), set by the
    /// controller once the VM exists. The Node with the same
    /// `spec.providerID` is this Machine's Node.
    #[serde(
        default,
        rename = "providerID",
        skip_serializing_if = "Option::is_none"
    )]
    #[x_kube(validation = Rule::new("self == oldSelf").message("providerID cannot change once set"))]
    pub provider_id: Option<String>,
    /// Drain settings; each field overrides the class's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<DrainSettings>,
}

/// A reference to a MachineClass.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ClassReference {
    /// Name of the MachineClass.
    #[x_kube(validation = Rule::new("self != ''").message("classRef.name must not be empty"))]
    pub name: String,
}

/// Where a Machine is in its life.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MachinePhase {
    Pending,
    Creating,
    Running,
    Terminating,
    Failed,
}

impl MachinePhase {
    pub const ALL: [MachinePhase; 5] = [
        MachinePhase::Pending,
        MachinePhase::Creating,
        MachinePhase::Running,
        MachinePhase::Terminating,
        MachinePhase::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MachinePhase::Pending => "Pending",
            MachinePhase::Creating => "Creating",
            MachinePhase::Running => "Running",
            MachinePhase::Terminating => "Terminating",
            MachinePhase::Failed => "Failed",
        }
    }
}

/// Observed state of a Machine.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatus {
    /// Pending, Creating, Running, Terminating or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<MachinePhase>,
    /// The Node that registered with this Machine's providerID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_ref: Option<NodeReference>,
    /// Conditions: Ready, NodeHealthy, Remediation, Drained,
    /// VolumesDetached, VMRequested, NodeLocalVolumes (a drain moved or
    /// holds node-local data),
    /// DrainSettings (what the drain of a Machine whose class cannot be
    /// resolved uses).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The step the controller took last and how it went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_operation: Option<LastOperation>,
    /// Progress of the drain of this Machine's Node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<DrainStatus>,
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The remediation under way of a Machine whose Node died (see the
    /// `Remediation` condition).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remediation: Option<RemediationStatus>,
}

/// A reference to a Node.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct NodeReference {
    /// Name of the Node.
    pub name: String,
}

/// The last step of the lifecycle the controller worked on.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LastOperation {
    /// Create, Health, or Delete.
    #[serde(rename = "type")]
    pub type_: String,
    /// The step within the operation, e.g. `Cordon` or `WaitVolumesDetached`.
    pub step: String,
    /// Processing, Succeeded, Waiting or Failed.
    pub state: String,
    /// What happened or what is awaited, in words.
    pub description: String,
    /// When this record last changed.
    pub last_update_time: Time,
}

/// Progress of a drain, kept in status so it survives a controller restart.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DrainStatus {
    /// When the drain started (the deletion of the Machine was requested).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// Pods the drain has to move off the Node.
    #[serde(default)]
    pub pods_total: u32,
    /// Pods evicted or deleted so far.
    #[serde(default)]
    pub pods_evicted: u32,
    /// Pods still on the Node that the drain has to move.
    #[serde(default)]
    pub pods_remaining: u32,
    /// `evicted/total`, for `kubectl get machines`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
    /// The pod the drain is waiting on (`namespace/name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_pod: Option<String>,
    /// The PersistentVolume the drain is waiting on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_volume: Option<String>,
    /// What the drain waits for, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
    /// What blocks it, if anything (a PDB, a deadline), in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked_by: Option<String>,
    /// The stateful pods that wait for their workload's move budget (a
    /// replica of it moving, from this or another Machine) or for a place
    /// under the controller's cap on moves in flight, in words. A
    /// MachineDeployment whose rollout waits on this drain says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for_budget: Option<String>,
    /// When the drain ended, whatever its outcome (the `Drained`,
    /// `DrainForced` or `DrainFailed` Event says which), to the microsecond.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<MicroTime>,
    /// Volume moves in flight: each stateful pod evicted (recorded before
    /// its eviction is sent) whose volumes have not yet attached where a pod
    /// needs them again. A controller that restarts resumes each one (waits
    /// for its pod to go, its volumes to detach from this Node and attach
    /// elsewhere) before it evicts another stateful pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moves: Vec<VolumeMove>,
}

/// A stateful pod's volumes on their way to another Node.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMove {
    /// The pod evicted (`namespace/name`).
    pub pod: String,
    /// Its UID: a pod of the same name with another UID is its replacement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// The PersistentVolumes moving with it.
    pub volumes: Vec<String>,
    /// Its controller (`Kind/name`), which is expected to replace it: a
    /// resumed move waits for the replacement as a first run does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<String>,
    /// Its workload (`Kind/name`, in the pod's namespace), whose move
    /// budget the move counts against across every drain: a new leader
    /// rebuilds the move ledger from these records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// When the move began, just before the eviction: a pod that used one
    /// of its claims on another Node before then (a ReadWriteMany peer) is
    /// not its replacement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
}

fn free_form_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// The CRDs as one multi-document YAML, as `berth crd` prints it and as it
/// is committed in `deploy/crds.yaml` and (wrapped in a Helm condition)
/// `charts/berth/templates/crds.yaml`.
pub fn crds_yaml() -> Result<String, serde_yaml_ng::Error> {
    let mut out = String::from("# Generated by `berth crd` from src/api. Do not edit.\n");
    for crd in [
        MachineClass::crd(),
        Machine::crd(),
        MachineSet::crd(),
        MachineDeployment::crd(),
        MovePermit::crd(),
        MoveAsk::crd(),
        DrainRule::crd(),
    ] {
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(&crd)?);
    }
    Ok(out)
}

/// Applies the CRDs (server-side apply) and waits until the apiserver
/// serves them. For the demo, the tests and `berth run --install-crds`;
/// production installs take them from the Helm chart.
pub async fn install_crds(
    client: kube::Client,
    timeout: std::time::Duration,
) -> Result<(), kube::Error> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{Api, Patch, PatchParams};
    use kube::runtime::wait::{await_condition, conditions};
    let api: Api<CustomResourceDefinition> = Api::all(client);
    for crd in [
        MachineClass::crd(),
        Machine::crd(),
        MachineSet::crd(),
        MachineDeployment::crd(),
        MovePermit::crd(),
        MoveAsk::crd(),
        DrainRule::crd(),
    ] {
        let name = crd.metadata.name.clone().unwrap_or_default();
        api.patch(
            &name,
            &PatchParams::apply("berth").force(),
            &Patch::Apply(&crd),
        )
        .await?;
        let established = await_condition(api.clone(), &name, conditions::is_crd_established());
        match tokio::time::timeout(timeout, established).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                return Err(kube::Error::Service(Box::new(e)));
            }
            Err(_) => {
                return Err(kube::Error::Service(
                    format!("CRD {name} was not established within {timeout:?}").into(),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_tolerations_tolerate_the_cordon() {
        let tol = |key: Option<&str>, op: &str, effect: Option<&str>| {
            k8s_openapi::api::core::v1::Toleration {
                key: key.map(String::from),
                operator: Some(op.into()),
                effect: effect.map(String::from),
                ..Default::default()
            }
        };
        let cases = [
            (tol(None, "Exists", None), true, "tolerates everything"),
            (
                tol(Some(CORDON_TAINT_KEY), "Exists", Some("NoSchedule")),
                true,
                "berth's taint",
            ),
            (
                tol(Some(CORDON_TAINT_KEY), "Equal", None),
                true,
                "berth's taint, any effect",
            ),
            (
                tol(None, "Exists", Some("NoExecute")),
                false,
                "another effect",
            ),
            (
                tol(
                    Some("node.kubernetes.io/not-ready"),
                    "Exists",
                    Some("NoExecute"),
                ),
                false,
                "the defaults",
            ),
            (tol(None, "Equal", None), false, "an empty key needs Exists"),
        ];
        for (t, want, what) in cases {
            assert_eq!(tolerates_cordon(&t), want, "{what}");
        }
    }

    #[test]
    fn crds_carry_printer_columns_descriptions_and_cel_rules() {
        let yaml = crds_yaml().expect("renders");
        for needle in [
            "name: machines.berth.dev",
            "name: machineclasses.berth.dev",
            "scope: Namespaced",
            "scope: Cluster",
            "jsonPath: .status.phase",
            "jsonPath: .status.nodeRef.name",
            "jsonPath: .status.drain.progress",
            "x-kubernetes-validations",
            "providerID cannot change once set",
            "x-kubernetes-preserve-unknown-fields: true",
            "The MachineClass this Machine is created from.",
            "subresources:",
        ] {
            assert!(yaml.contains(needle), "CRD YAML lacks {needle:?}");
        }
    }

    #[test]
    fn the_machineset_crd_has_scale_status_columns_and_rules() {
        let yaml = serde_yaml_ng::to_string(&MachineSet::crd()).expect("renders");
        for needle in [
            "name: machinesets.berth.dev",
            "specReplicasPath: .spec.replicas",
            "statusReplicasPath: .status.replicas",
            "labelSelectorPath: .status.selector",
            "jsonPath: .status.readyReplicas",
            "replicas must not be negative",
            "selector is immutable",
            "default: 1",
        ] {
            assert!(yaml.contains(needle), "MachineSet CRD lacks {needle:?}");
        }
    }

    #[test]
    fn machine_spec_round_trips_with_the_documented_field_names() {
        let m: MachineSpec = serde_json::from_value(serde_json::json!({
            "classRef": {"name": "small"},
            "providerID": "fake:///default/worker-1",
            "drain": {"timeout": "2h", "volumeDetachTimeout": "2m", "forceAfterDeadline": false}
        }))
        .expect("parses");
        assert_eq!(m.provider_id.as_deref(), Some("fake:///default/worker-1"));
        let back = serde_json::to_value(&m).expect("serializes");
        assert_eq!(back["drain"]["volumeDetachTimeout"], "2m");
        assert_eq!(back["classRef"]["name"], "small");
    }
}
