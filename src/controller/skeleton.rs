//! What is the same in every controller of berth: how a failed reconcile
//! is retried, and how the controller's stream of results is driven.
//!
//! A controller's context says which kind it reconciles and keeps the
//! per-object [`Backoffs`]; [`error_policy`] then retries a failed
//! reconcile after the object's next backoff delay, with one warning that
//! names the kind, the object and the error. [`run`] drives a configured
//! kube `Controller` until shutdown, logging each result and calling back
//! after each (for gauges recounted from the cache).

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryFuture};
use kube::runtime::controller::{Action, Controller};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;

use super::Backoffs;

/// A controller's context, as the shared skeleton sees it.
pub(crate) trait Reconciler: Send + Sync + 'static {
    /// The kind reconciled.
    type Object: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static;
    /// What a failed reconcile says.
    type Error: std::error::Error + Send + Sync + 'static;
    /// The kind's name, for logs.
    const KIND: &'static str;

    /// The per-object backoff of failed reconciles (reset by the reconcile
    /// on success).
    fn backoff(&self) -> &Backoffs<Self::Object>;

    /// Told of each failure with the delay before the retry: for a
    /// controller that must also keep something else from asking again
    /// sooner (the Machine's provider calls).
    fn failed(&self, _obj: &Self::Object, _error: &Self::Error, _delay: Duration) {}

    /// The error's class, for the log (a bounded set of names).
    fn class(_error: &Self::Error) -> &'static str {
        "error"
    }
}

/// The one error policy: retry after the object's next backoff delay (0.5 s
/// doubling to 5 min, with jitter), with a warning.
pub(crate) fn error_policy<C: Reconciler>(
    obj: Arc<C::Object>,
    error: &C::Error,
    ctx: Arc<C>,
) -> Action {
    let delay = ctx.backoff().next(&obj);
    ctx.failed(&obj, error, delay);
    tracing::warn!(
        kind = C::KIND,
        name = %obj.name_any(),
        namespace = obj.namespace().unwrap_or_default(),
        error = %error,
        class = C::class(error),
        retry_in = ?delay,
        "reconcile failed"
    );
    Action::requeue(delay)
}

/// Drives `controller` with `reconcile` and [`error_policy`] until
/// `shutdown` resolves (reconciles in flight finish first), calling
/// `after_each` after every result.
pub(crate) async fn run<C, F, Fut>(
    controller: Controller<C::Object>,
    reconcile: F,
    ctx: Arc<C>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
    mut after_each: impl FnMut(),
) where
    C: Reconciler,
    F: FnMut(Arc<C::Object>, Arc<C>) -> Fut,
    Fut: TryFuture<Ok = Action, Error = C::Error> + Send + 'static,
{
    controller
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy::<C>, ctx)
        .for_each(|result| {
            match result {
                Ok((obj, _)) => tracing::debug!(kind = C::KIND, object = %obj, "reconciled"),
                Err(e) => tracing::debug!(kind = C::KIND, error = %e, "reconcile failed"),
            }
            after_each();
            futures::future::ready(())
        })
        .await;
}
