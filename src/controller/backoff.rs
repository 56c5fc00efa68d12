//! Per-object exponential backoff for a controller's failed reconciles,
//! reset by a successful one: the Machine, MachineSet and MachineDeployment
//! controllers share it, so that all back off the same way (0.5 s doubling
//! to 5 min, with jitter).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use backon::BackoffBuilder;
use kube::Resource;
use kube::runtime::reflector::ObjectRef;

/// The delay when the backoff cannot be had (a poisoned lock).
const CEILING: Duration = Duration::from_secs(300);

pub(crate) struct Backoffs<K: Resource<DynamicType = ()>> {
    by_object: Mutex<HashMap<ObjectRef<K>, backon::ExponentialBackoff>>,
}

impl<K: Resource<DynamicType = ()>> Default for Backoffs<K> {
    fn default() -> Self {
        Self {
            by_object: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Resource<DynamicType = ()>> Backoffs<K> {
    /// How long to wait after one more failure of `obj`.
    pub(crate) fn next(&self, obj: &K) -> Duration {
        self.by_object
            .lock()
            .ok()
            .and_then(|mut map| {
                map.entry(ObjectRef::from_obj(obj))
                    .or_insert_with(fresh)
                    .next()
            })
            .unwrap_or(CEILING)
    }

    /// `obj` reconciled: its next failure starts from the shortest delay.
    pub(crate) fn reset(&self, obj: &K) {
        if let Ok(mut map) = self.by_object.lock() {
            map.remove(&ObjectRef::from_obj(obj));
        }
    }
}

fn fresh() -> backon::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(CEILING)
        .with_jitter()
        .without_max_times()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Machine;

    #[test]
    fn failures_back_off_up_to_five_minutes_and_a_success_starts_again() {
        let b = Backoffs::<Machine>::default();
        let mut m = Machine::new("m", Default::default());
        m.metadata.namespace = Some("ns".into());
        let first = b.next(&m);
        assert!(first <= Duration::from_secs(1), "{first:?}");
        let later = (0..20).map(|_| b.next(&m)).last().expect("delays");
        assert!(
            later > Duration::from_secs(60) && later <= CEILING * 2,
            "{later:?}"
        );
        b.reset(&m);
        assert!(b.next(&m) <= Duration::from_secs(1));
    }
}
