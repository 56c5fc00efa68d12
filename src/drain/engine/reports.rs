//! What a drain tells operators: its Events about the Machine (each with
//! the object it concerns: a pod, a PersistentVolume), the memory of what
//! was reported once (kept across the runs of one Machine's drain, so a
//! retry does not report it again), and one Event for pods evicted
//! together.
//!
//! No I/O of its own: Events go to the process's queue
//! ([`EventSink`]), which publishes them.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::runtime::events::EventType;

use super::batch::evicted_note;
use crate::drain::select::{NamespacedName, fmt_key};
use crate::telemetry::events::EventSink;
use crate::volumes::WaitError;

/// What one Machine's drains said and judged, kept by the
/// [`Drainer`](super::Drainer) across the runs of its drain (a failed drain
/// retried, a drain started again for pods that came back), so that a retry
/// neither reports again what was reported nor counts again a pod that came
/// back.
#[derive(Debug, Default)]
pub(crate) struct Memory {
    /// What was reported once (a topic and a pod's UID).
    pub(crate) reported: BTreeSet<String>,
    /// The pods (by UID) judged to have come back after the cordon.
    pub(crate) returned: BTreeSet<String>,
}

/// The reports of one drain.
pub(super) struct Reports {
    events: EventSink,
    /// The Machine, which every Event is about.
    machine: ObjectReference,
    memory: Arc<Mutex<Memory>>,
}

impl Reports {
    pub(super) fn new(
        events: EventSink,
        machine: ObjectReference,
        memory: Arc<Mutex<Memory>>,
    ) -> Self {
        Self {
            events,
            machine,
            memory,
        }
    }

    /// Publishes an Event about the Machine. `related` (the pod or volume
    /// concerned) also keeps Events about different objects apart: the
    /// recorder folds Events with the same reason and related object into
    /// one series.
    pub(super) fn event(
        &self,
        type_: EventType,
        reason: &str,
        note: String,
        related: Option<ObjectReference>,
    ) {
        self.events
            .event(type_, self.machine.clone(), "Drain", reason, note, related);
    }

    /// A volume wait that ended without success. The Event's related
    /// object is the first volume waited for: kube's `Recorder` folds Events
    /// with the same reason and objects into one series whatever their
    /// notes, so two volumes' timeouts with none would show as one.
    pub(super) fn volume_wait_failed(&self, reason: &str, e: &WaitError, pv: Option<&str>) {
        tracing::warn!(reason, error = %e, "volume wait ended without success");
        self.event(
            EventType::Warning,
            reason,
            e.to_string(),
            pv.and_then(pv_ref),
        );
    }

    /// Whether `what` (a pod's UID and a topic) is reported for the first
    /// time in this Machine's drains: each report is made once.
    pub(super) fn first(&self, what: String) -> bool {
        self.memory
            .lock()
            .map(|mut m| m.reported.insert(what))
            .unwrap_or(false)
    }

    /// Whether `what` was reported in this Machine's drains already.
    pub(super) fn reported(&self, what: &str) -> bool {
        self.memory
            .lock()
            .map(|m| m.reported.contains(what))
            .unwrap_or(false)
    }

    /// Whether pod `uid` is judged to have come back for the first time.
    pub(super) fn first_return(&self, uid: String) -> bool {
        self.memory
            .lock()
            .map(|mut m| m.returned.insert(uid))
            .unwrap_or(false)
    }

    /// One Event for pods evicted together: the pod's own `Evicted` Event
    /// when there is one, else one that names them all.
    pub(super) fn evicted(&self, mut batch: Vec<ObjectReference>) {
        match batch.len() {
            0 => {}
            1 => {
                let pod = batch.pop();
                let key = pod.as_ref().map(ref_key).unwrap_or_default();
                self.event(
                    EventType::Normal,
                    "Evicted",
                    format!("evicted pod {key}"),
                    pod,
                );
            }
            _ => {
                // The first pod is the related object: it says which batch
                // this is, and kube's `Recorder` (which folds Events by
                // reason and objects, not by note) would otherwise take a
                // second batch for a repeat of the first and drop its names.
                let names: Vec<String> = batch.iter().map(ref_key).collect();
                let first = batch.into_iter().next();
                self.event(EventType::Normal, "Evicted", evicted_note(&names), first);
            }
        }
    }
}

/// The `namespace/name` of an object reference.
pub(super) fn ref_key(r: &ObjectReference) -> String {
    fmt_key(&(
        r.namespace.clone().unwrap_or_default(),
        r.name.clone().unwrap_or_default(),
    ))
}

/// A reference to a pod, with its UID.
pub(super) fn pod_ref(pod: &Pod) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: pod.metadata.namespace.clone(),
        name: pod.metadata.name.clone(),
        uid: pod.metadata.uid.clone(),
        ..Default::default()
    }
}

/// A reference to a pod by its key.
pub(super) fn pod_ref_key(key: &NamespacedName) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(key.0.clone()),
        name: Some(key.1.clone()),
        ..Default::default()
    }
}

/// A reference to a PersistentVolume; none for an inline volume, which has
/// no object of its own.
pub(super) fn pv_ref(pv: &str) -> Option<ObjectReference> {
    (!crate::drain::volume::is_inline(pv)).then(|| ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolume".into()),
        name: Some(pv.to_string()),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reports() -> (
        Reports,
        tokio::sync::mpsc::Receiver<(kube::runtime::events::Event, ObjectReference)>,
    ) {
        let (sink, rx) = EventSink::captured(16);
        let machine = ObjectReference {
            name: Some("m1".into()),
            ..Default::default()
        };
        (Reports::new(sink, machine, Arc::default()), rx)
    }

    fn pod(name: &str) -> ObjectReference {
        pod_ref_key(&("ns".into(), name.into()))
    }

    #[test]
    fn each_report_is_made_once_across_runs_of_one_machine() {
        let (r, _rx) = reports();
        assert!(r.first("waits/u1/u2".into()));
        assert!(!r.first("waits/u1/u2".into()));
        let again = Reports::new(
            EventSink::captured(1).0,
            ObjectReference::default(),
            Arc::clone(&r.memory),
        );
        assert!(!again.first("waits/u1/u2".into()), "a retried drain");
        assert!(again.first_return("u9".into()));
        assert!(!r.first_return("u9".into()));
    }

    #[test]
    fn pods_evicted_together_share_one_event_about_the_machine() {
        let (r, mut rx) = reports();
        r.evicted(vec![]);
        r.evicted(vec![pod("a")]);
        r.evicted(vec![pod("b"), pod("c")]);
        let (one, about) = rx.try_recv().expect("one pod's Event");
        assert_eq!(about.name.as_deref(), Some("m1"));
        assert_eq!(one.note.as_deref(), Some("evicted pod ns/a"));
        let (two, _) = rx.try_recv().expect("the batch's Event");
        assert_eq!(
            two.note.as_deref(),
            Some("evicted 2 pods without persistent volumes: ns/b, ns/c")
        );
        assert_eq!(two.secondary.and_then(|s| s.name).as_deref(), Some("b"));
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn an_inline_volume_has_no_reference() {
        assert!(pv_ref("pv-1").is_some());
        let inline = format!("{}ns-pod-data", crate::cache::inline::INLINE_PREFIX);
        assert!(pv_ref(&inline).is_none());
        assert_eq!(ref_key(&pod("x")), "ns/x");
    }
}
