//! Events about evictions: the pods without volumes evicted within a second
//! of one another share one Event, and the references Events relate to.

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use tokio::time::Instant;

/// Evictions of pods without volumes accepted within this long of one
/// another share one Event. A pod per Event puts hundreds of Events into
/// the API server's busiest second when many drains start together, and
/// gives a Machine with 100 pods 100 one-line Events; the
/// log still names each pod, and an eviction refused by a
/// PodDisruptionBudget still gets an Event of its own.
const EVICTED_BATCH: Duration = Duration::from_secs(1);

/// Pods evicted and not yet announced, and when the oldest was.
#[derive(Debug, Default)]
pub(super) struct Batch {
    pods: Vec<ObjectReference>,
    since: Option<Instant>,
}

impl Batch {
    pub(super) fn push(&mut self, pod: ObjectReference, now: Instant) {
        self.since.get_or_insert(now);
        self.pods.push(pod);
    }

    /// When the batch must be announced: [`EVICTED_BATCH`] after its
    /// oldest pod; `None` while empty.
    pub(super) fn due(&self) -> Option<Instant> {
        self.since.map(|s| s + EVICTED_BATCH)
    }

    pub(super) fn take(&mut self) -> Vec<ObjectReference> {
        self.since = None;
        std::mem::take(&mut self.pods)
    }
}

/// An Event's note may hold 1 kB; the names past this many characters are
/// counted instead.
const NOTE_NAMES_CHARS: usize = 800;

/// The note of one Event for several evicted pods: how many, then their
/// `namespace/name`s, as many as fit in `NOTE_NAMES_CHARS`.
pub fn evicted_note(names: &[String]) -> String {
    let mut listed = String::new();
    let mut shown = 0;
    for name in names {
        let sep = if shown == 0 { "" } else { ", " };
        if listed.len() + sep.len() + name.len() > NOTE_NAMES_CHARS {
            break;
        }
        listed.push_str(sep);
        listed.push_str(name);
        shown += 1;
    }
    let more = names.len() - shown;
    let tail = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    format!(
        "evicted {} pods without persistent volumes: {listed}{tail}",
        names.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::engine::reports::ref_key;

    #[test]
    fn evictions_are_announced_a_batch_at_a_time() {
        let now = Instant::now();
        let pod = |name: &str| ObjectReference {
            namespace: Some("web".into()),
            name: Some(name.into()),
            ..Default::default()
        };
        let mut batch = Batch::default();
        assert_eq!(batch.due(), None, "nothing to announce");
        batch.push(pod("a"), now);
        batch.push(pod("b"), now + Duration::from_millis(700));
        assert_eq!(
            batch.due(),
            Some(now + EVICTED_BATCH),
            "due after the oldest"
        );
        let taken: Vec<String> = batch.take().iter().map(ref_key).collect();
        assert_eq!(taken, ["web/a", "web/b"]);
        assert_eq!(batch.due(), None);
        batch.push(pod("c"), now + Duration::from_secs(5));
        assert_eq!(
            batch.due(),
            Some(now + Duration::from_secs(5) + EVICTED_BATCH)
        );
    }

    #[test]
    fn one_event_names_the_pods_evicted_together_within_an_events_size() {
        let few = ["web/a".to_string(), "web/b".to_string()];
        assert_eq!(
            evicted_note(&few),
            "evicted 2 pods without persistent volumes: web/a, web/b"
        );
        let many: Vec<String> = (0..200).map(|i| format!("web/frontend-{i:03}")).collect();
        let note = evicted_note(&many);
        assert!(
            note.starts_with("evicted 200 pods without persistent volumes: web/frontend-000, ")
        );
        assert!(
            note.len() <= 1024,
            "an Event note holds 1 kB: {}",
            note.len()
        );
        let shown = note.matches("web/frontend-").count();
        assert!(
            note.ends_with(&format!(" and {} more", 200 - shown)),
            "{note}"
        );
    }
}
