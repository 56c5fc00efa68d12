//! Why a Machine reconcile failed: the call it failed at ([`Step`], the
//! `result` label of `berth_reconcile_total`) and what answered.

use std::convert::Infallible;

use kube::runtime::finalizer;

use crate::providers::ProviderError;

/// The call a reconcile failed at. [`Step::metric_label`] is the `result`
/// label of `berth_reconcile_total` for a reconcile that failed there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Writing the Machine's status.
    Status,
    /// Recording the VM's providerID in the Machine's spec.
    ProviderId,
    /// Adding or removing the Machine's finalizer.
    Finalizer,
    /// Reading the Node from the API server (the cache did not have it).
    NodeGet,
    /// Cordoning the Node.
    Cordon,
    /// Force-deleting a pod (forced deletion).
    PodDelete,
    /// Deleting the Node object.
    NodeDelete,
    /// Tainting the Node out of service once its VM is gone.
    OutOfService,
    /// Writing the Node's lifecycle conditions (`DrainInProgress`,
    /// `Drained`).
    NodeConditions,
    /// Asking the provider for the VM.
    ProviderCreate,
    /// Asking the provider to delete the VM.
    ProviderDelete,
    /// Asking the provider to fence the VM of an unhealthy Machine.
    ProviderFence,
    /// Deleting a remediated Machine, for its pool to replace it.
    MachineDelete,
}

impl Step {
    /// `error_` and the step: a short, bounded label for metrics.
    pub(crate) fn metric_label(self) -> &'static str {
        match self {
            Step::Status => "error_status",
            Step::ProviderId => "error_provider_id",
            Step::Finalizer => "error_finalizer",
            Step::NodeGet => "error_node_get",
            Step::Cordon => "error_cordon",
            Step::PodDelete => "error_pod_delete",
            Step::NodeDelete => "error_node_delete",
            Step::OutOfService => "error_out_of_service",
            Step::NodeConditions => "error_node_conditions",
            Step::ProviderCreate => "error_provider_create",
            Step::ProviderDelete => "error_provider_delete",
            Step::ProviderFence => "error_provider_fence",
            Step::MachineDelete => "error_machine_delete",
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Step::Status => "status write",
            Step::ProviderId => "providerID write",
            Step::Finalizer => "finalizer",
            Step::NodeGet => "Node read",
            Step::Cordon => "cordon",
            Step::PodDelete => "pod deletion",
            Step::NodeDelete => "Node deletion",
            Step::OutOfService => "out-of-service taint",
            Step::NodeConditions => "Node lifecycle conditions",
            Step::ProviderCreate => "VM creation",
            Step::ProviderDelete => "VM deletion",
            Step::ProviderFence => "VM fence",
            Step::MachineDelete => "Machine deletion",
        }
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a reconcile failed. A step that is not done yet is not an error:
/// it is a [`Next`].
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("{step}: Kubernetes API: {source}")]
    Kube {
        step: Step,
        #[source]
        source: kube::Error,
    },
    #[error("{step}: provider {provider}: {source}")]
    Provider {
        step: Step,
        provider: String,
        #[source]
        source: ProviderError,
    },
    /// kube's finalizer helper refused the object (no name, a finalizer
    /// name that is not a JSON pointer).
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<finalizer::Error<Infallible>>),
    #[error("Machine has no namespace")]
    NoNamespace,
}

impl Error {
    /// A short, bounded label for metrics: `error_` and the step it failed
    /// at.
    pub(crate) fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube { step, .. } | Error::Provider { step, .. } => step.metric_label(),
            Error::Finalizer(_) => Step::Finalizer.metric_label(),
            Error::NoNamespace => "error_no_namespace",
        }
    }

    /// The API server answered 404.
    pub(super) fn is_not_found(&self) -> bool {
        matches!(self, Error::Kube { source: kube::Error::Api(s), .. } if s.code == 404)
    }
}

/// Tags a `kube::Error` with the step it came from.
pub(super) fn at(step: Step) -> impl FnOnce(kube::Error) -> Error {
    move |source| Error::Kube { step, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_step_has_its_own_error_label() {
        let steps = [
            Step::Status,
            Step::ProviderId,
            Step::Finalizer,
            Step::NodeGet,
            Step::Cordon,
            Step::PodDelete,
            Step::NodeDelete,
            Step::OutOfService,
            Step::NodeConditions,
            Step::ProviderCreate,
            Step::ProviderDelete,
        ];
        let labels: std::collections::HashSet<_> = steps.iter().map(|s| s.metric_label()).collect();
        assert_eq!(labels.len(), steps.len());
        assert!(labels.iter().all(|l| l.starts_with("error_")));
        let e = Error::Kube {
            step: Step::Cordon,
            source: kube::Error::Api(Box::new(
                kube::core::Status::failure("boom", "InternalError").with_code(500),
            )),
        };
        assert_eq!(e.metric_label(), "error_cordon");
        assert!(e.to_string().starts_with("cordon: "), "{e}");
        assert!(!e.is_not_found());
    }
}
