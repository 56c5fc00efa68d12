//! What the Machine, MachineSet and MachineDeployment controllers share:
//! the per-object backoff of failed reconciles (`backoff`), the error
//! policy and the loop that drives a controller (`skeleton`), the
//! compare-and-swap status write (`status`), and tasks that end with their
//! owner (`AbortOnDrop`).

pub(crate) mod backoff;
pub(crate) mod skeleton;
pub mod status;

pub(crate) use backoff::Backoffs;
pub(crate) use skeleton::Reconciler;

/// A spawned task that is aborted when this is dropped, on every path out
/// of the scope that holds it (an aborted task drops its future, and so
/// this): no task outlives the work it belongs to.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
