//! Provider drivers: the small interface between a Machine and the cloud
//! that runs its VM, and the registry the reconciler looks drivers up in.
//!
//! A driver decides nothing about the lifecycle; it creates, deletes and
//! describes VMs, idempotently, and says through its error type whether a
//! failure is worth retrying.

pub mod aws;
pub mod fake;
pub(crate) mod gated;
pub(crate) mod instrumented;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use crate::api::SecretReference;

/// Everything a driver gets to know about the Machine it acts for.
#[derive(Debug, Clone, PartialEq)]
pub struct MachineRequest {
    pub namespace: String,
    pub name: String,
    /// The Machine's UID: what a driver tags its VM with, so that a VM
    /// created just before a crash is found and adopted instead of created
    /// twice.
    pub uid: String,
    pub class: String,
    /// The class's `secretRef`: credentials for the cloud, when the class
    /// names them instead of the controller's own.
    pub secret_ref: Option<SecretReference>,
    /// The class's `providerSpec`, unchanged (`null` when absent).
    pub provider_spec: serde_json::Value,
    /// Set once the VM exists.
    pub provider_id: Option<String>,
}

/// A VM as the provider sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vm {
    pub provider_id: String,
    pub state: VmState,
    /// The Machine the VM was created for, as the VM's own tags say;
    /// `None` for a VM that carries no such tags.
    pub machine: Option<MachineRef>,
    /// When the cloud created the VM, if it says.
    pub created_at: Option<Timestamp>,
}

/// The Machine a VM says it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// Where to list VMs: a class's `providerSpec` and credentials, which say
/// the region or account a driver looks in.
#[derive(Debug, Clone, PartialEq)]
pub struct ListRequest {
    pub provider_spec: serde_json::Value,
    pub secret_ref: Option<SecretReference>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    Creating,
    Running,
    /// Powered off, its disks kept: nothing on it runs or writes.
    Stopped,
    Deleting,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProviderError {
    /// The cloud does not find the VM (which may still be there: see
    /// [`Provider`]).
    #[error("VM not found: {0}")]
    NotFound(String),
    /// The operation was accepted and is still running; ask again later.
    #[error("in progress: {what}")]
    InProgress { what: String, retry_after: Duration },
    /// A failure that may go away by itself (throttling, a timeout).
    #[error("transient provider failure: {0}")]
    Transient(String),
    /// A failure that retrying will not fix (quota, a rejected image).
    #[error("permanent provider failure: {0}")]
    Permanent(String),
    /// The class's `providerSpec` is not valid for this driver.
    #[error("invalid providerSpec: {0}")]
    InvalidSpec(String),
    /// The cloud refuses berth's credentials, or they may not make this
    /// call: what to grant or fix. Retried slowly, since the fix is made
    /// outside berth.
    #[error("not authorised: {0}")]
    Unauthorized(String),
    /// The driver cannot do this at all (a cloud without a stop).
    #[error("not supported: {0}")]
    Unsupported(String),
}

impl ProviderError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            ProviderError::NotFound(_) => "not_found",
            ProviderError::InProgress { .. } => "in_progress",
            ProviderError::Transient(_) => "transient",
            ProviderError::Permanent(_) => "permanent",
            ProviderError::InvalidSpec(_) => "invalid_spec",
            ProviderError::Unauthorized(_) => "unauthorized",
            ProviderError::Unsupported(_) => "unsupported",
        }
    }
}

/// A cloud behind berth. Every method is idempotent: `create` of a VM that
/// exists returns it, `delete` of a VM that is certainly gone (the cloud
/// says it is terminated, or the cloud is consistent and does not have it)
/// returns `Ok`. `NotFound` says only that the cloud does not find it now:
/// an eventually consistent cloud may not find a VM that runs, so the
/// Machine controller takes it for gone only once that has lasted
/// `--vm-not-found-grace`.
#[async_trait::async_trait]
pub trait Provider: Send + Sync {
    /// The name MachineClasses use in `spec.provider`.
    fn name(&self) -> &'static str;
    /// Whether the driver counts each of its cloud requests in
    /// `berth_provider_requests_total` itself (with the cloud's action as
    /// `op`); the others are counted per operation by a wrapper.
    fn counts_own_requests(&self) -> bool {
        false
    }
    /// Checks a class's `providerSpec` without touching the cloud.
    fn validate(&self, provider_spec: &serde_json::Value) -> Result<(), ProviderError>;
    async fn create(&self, req: &MachineRequest) -> Result<Vm, ProviderError>;
    async fn delete(&self, req: &MachineRequest) -> Result<(), ProviderError>;
    async fn get(&self, req: &MachineRequest) -> Result<Vm, ProviderError>;
    /// Stops the VM (powered off, its disks kept): the fence before the
    /// pods and volumes of a dead Node are freed. `Ok` only once the cloud
    /// says it is stopped (or certainly gone), `InProgress` while it
    /// stops; asked again until then. A driver that cannot tell says
    /// `Unsupported`, and nothing is freed.
    async fn stop(&self, req: &MachineRequest) -> Result<(), ProviderError> {
        let _ = req;
        Err(ProviderError::Unsupported(format!(
            "provider {} cannot stop a VM",
            self.name()
        )))
    }
    /// The VMs this cluster owns where `req` points (a driver tells its
    /// own VMs from others' by the cluster's ownership mark, and never
    /// lists a VM without it).
    async fn list(&self, req: &ListRequest) -> Result<Vec<Vm>, ProviderError>;
    /// Where `list` of `req` looks, as a key: two requests with the same
    /// key list the same VMs, so a round of orphan collection lists once
    /// per key, not once per class (classes that differ only in what a VM
    /// is made of point to the same place). By default the whole request.
    fn list_scope(&self, req: &ListRequest) -> String {
        format!(
            "{}\n{:?}",
            req.provider_spec,
            req.secret_ref.as_ref().map(|s| (&s.namespace, &s.name))
        )
    }
}

/// The drivers this process knows, by name.
#[derive(Clone, Default)]
pub struct Registry {
    drivers: BTreeMap<&'static str, Arc<dyn Provider>>,
}

impl Registry {
    pub fn with(mut self, driver: Arc<dyn Provider>) -> Self {
        self.drivers.insert(driver.name(), driver);
        self
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn Provider>> {
        self.drivers.get(name).cloned()
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.drivers.keys().copied().collect()
    }

    /// The same drivers, each refusing to create or delete a VM while
    /// `may_act` says no (see `providers::gated`).
    pub fn gated(self, may_act: &gated::MayAct) -> Self {
        let drivers = self
            .drivers
            .into_iter()
            .map(|(name, driver)| {
                let wrapped: Arc<dyn Provider> =
                    Arc::new(gated::Gated::new(driver, Arc::clone(may_act)));
                (name, wrapped)
            })
            .collect();
        Self { drivers }
    }

    /// The same drivers, each wrapped so that its calls are counted and
    /// timed in `metrics`.
    pub(crate) fn instrumented(self, metrics: &Arc<crate::telemetry::Metrics>) -> Self {
        let drivers = self
            .drivers
            .into_iter()
            .map(|(name, driver)| {
                if driver.counts_own_requests() {
                    return (name, driver);
                }
                let wrapped: Arc<dyn Provider> =
                    Arc::new(instrumented::Instrumented::new(driver, Arc::clone(metrics)));
                (name, wrapped)
            })
            .collect();
        Self { drivers }
    }
}
