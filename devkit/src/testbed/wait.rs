//! Waiting on a test bed by watching it: every helper here is driven by a
//! watch, never by re-reading the API on a timer.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::Resource;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde::de::DeserializeOwned;

#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error("timed out after {timeout:?} waiting for {what}")]
    Timeout { what: String, timeout: Duration },
    #[error("timed out waiting for {what}, the watch failing: {source}")]
    Watch {
        what: String,
        #[source]
        source: watcher::Error,
    },
}

/// Watches every object of `api` and returns them once `done` holds for the
/// whole set (checked after the initial list and after every change).
pub async fn until<K, F>(
    api: Api<K>,
    timeout: Duration,
    what: &str,
    done: F,
) -> Result<Vec<Arc<K>>, WaitError>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
    F: Fn(&[Arc<K>]) -> bool,
{
    let (reader, writer) = reflector::store();
    let stream = reflector(
        writer,
        watcher(api, watcher::Config::default()).default_backoff(),
    );
    futures::pin_mut!(stream);
    // A watch error is retried by the watcher, with backoff, until the
    // timeout: the API server answers 429 "storage is (re)initializing"
    // while its watch cache starts again, and a connection can drop. The
    // last error is what a timeout reports.
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error = None;
    let mut synced = false;
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(Ok(event))) => {
                synced |= matches!(event, watcher::Event::InitDone);
                if synced {
                    let state = reader.state();
                    if done(&state) {
                        return Ok(state);
                    }
                }
            }
            Ok(Some(Err(e))) => last_error = Some(e),
            Ok(None) | Err(_) => {
                let what = what.to_string();
                return Err(match last_error {
                    Some(source) => WaitError::Watch { what, source },
                    None => WaitError::Timeout { what, timeout },
                });
            }
        }
    }
}

/// Waits for the first object of `api` for which `matches` holds.
pub async fn for_one<K, F>(
    api: Api<K>,
    timeout: Duration,
    what: &str,
    matches: F,
) -> Result<Arc<K>, WaitError>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
    F: Fn(&K) -> bool,
{
    let found = until(api, timeout, what, |all| all.iter().any(|o| matches(o))).await?;
    found
        .into_iter()
        .find(|o| matches(o))
        .ok_or_else(|| WaitError::Timeout {
            what: what.to_string(),
            timeout,
        })
}

/// Waits until no object of `api` satisfies `matches`.
pub async fn for_none<K, F>(
    api: Api<K>,
    timeout: Duration,
    what: &str,
    matches: F,
) -> Result<(), WaitError>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
    F: Fn(&K) -> bool,
{
    until(api, timeout, what, |all| !all.iter().any(|o| matches(o)))
        .await
        .map(|_| ())
}
