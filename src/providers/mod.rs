//! Provider drivers: the small interface between a Machine and the cloud
//! that runs its VM, and the registry the reconciler looks drivers up in.
//!
//! A driver decides nothing about the lifecycle; it creates, deletes and
//! describes VMs, idempotently, and says through its error type whether a
//! failure is worth retrying.

pub mod fake;
pub(crate) mod instrumented;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Everything a driver gets to know about the Machine it acts for.
#[derive(Debug, Clone, PartialEq)]
pub struct MachineRequest {
    pub namespace: String,
    pub name: String,
    pub class: String,
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    Creating,
    Running,
    Deleting,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProviderError {
    /// The VM does not exist (for delete: it is already gone).
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
}

impl ProviderError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            ProviderError::NotFound(_) => "not_found",
            ProviderError::InProgress { .. } => "in_progress",
            ProviderError::Transient(_) => "transient",
            ProviderError::Permanent(_) => "permanent",
            ProviderError::InvalidSpec(_) => "invalid_spec",
        }
    }
}

/// A cloud behind berth. Every method is idempotent: `create` of a VM that
/// exists returns it, `delete` of a VM that is gone returns `NotFound`.
#[async_trait::async_trait]
pub trait Provider: Send + Sync {
    /// The name MachineClasses use in `spec.provider`.
    fn name(&self) -> &'static str;
    /// Checks a class's `providerSpec` without touching the cloud.
    fn validate(&self, provider_spec: &serde_json::Value) -> Result<(), ProviderError>;
    async fn create(&self, req: &MachineRequest) -> Result<Vm, ProviderError>;
    async fn delete(&self, req: &MachineRequest) -> Result<(), ProviderError>;
    async fn get(&self, req: &MachineRequest) -> Result<Vm, ProviderError>;
    async fn list(&self) -> Result<Vec<Vm>, ProviderError>;
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

    /// The same drivers, each wrapped so that its calls are counted and
    /// timed in `metrics`.
    pub(crate) fn instrumented(self, metrics: &Arc<crate::telemetry::Metrics>) -> Self {
        let drivers = self
            .drivers
            .into_iter()
            .map(|(name, driver)| {
                let wrapped: Arc<dyn Provider> =
                    Arc::new(instrumented::Instrumented::new(driver, Arc::clone(metrics)));
                (name, wrapped)
            })
            .collect();
        Self { drivers }
    }
}
