//! Kubernetes Events, published off the critical path.
//!
//! An Event is a record for people; it must never hold up the work it
//! records. The reconciler and the drain engine hand their Events to an
//! [`EventSink`], which queues them and returns at once; one task publishes
//! them in order through kube's `Recorder` (which folds repeats into a
//! series), on the Events client with its own rate limit. When the queue is
//! full, an Event is dropped, logged and counted in
//! `berth_events_dropped_total`, as client-go's broadcaster drops rather
//! than blocks.
//!
//! Awaiting each Event in line would put the Events of many concurrent
//! drains (one per eviction) in one rate-limited line, and every Machine's
//! next step would wait its turn in it. The price of the queue is that an
//! Event's time is when it was published, up to the queue's lag after what
//! it records; the drain's own end is in `status.drain.finishedAt`.

use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};
use tokio::sync::mpsc;

use super::Metrics;

/// Events waiting to be published, at most.
pub(crate) const QUEUE: usize = 1024;

/// Where Events go; cheap to clone.
#[derive(Clone)]
pub struct EventSink {
    tx: mpsc::Sender<(Event, ObjectReference)>,
    metrics: Arc<Metrics>,
}

impl EventSink {
    /// A sink and the task that publishes what it receives, until every
    /// sink is dropped and the queue is empty.
    pub fn new(
        recorder: Recorder,
        metrics: Arc<Metrics>,
        capacity: usize,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = mpsc::channel::<(Event, ObjectReference)>(capacity);
        let publisher = {
            let metrics = Arc::clone(&metrics);
            tokio::spawn(async move {
                while let Some((ev, regarding)) = rx.recv().await {
                    if let Err(e) = recorder.publish(&ev, &regarding).await {
                        metrics.events_dropped.inc();
                        tracing::warn!(error = %e, reason = %ev.reason, "could not publish an Event");
                    }
                }
            })
        };
        (Self { tx, metrics }, publisher)
    }

    /// A sink whose Events are not published but received here, for unit
    /// tests of what a caller reports.
    #[cfg(test)]
    pub(crate) fn captured(capacity: usize) -> (Self, mpsc::Receiver<(Event, ObjectReference)>) {
        let metrics = Arc::new(Metrics::new().expect("metrics"));
        let (tx, rx) = mpsc::channel(capacity);
        (Self { tx, metrics }, rx)
    }

    /// A Normal Event about `regarding`: what `action` did (`reason`, in
    /// CamelCase, and a note for people), and the object it did it to or
    /// with, if another (`related`). Never waits.
    pub fn normal(
        &self,
        regarding: ObjectReference,
        action: &str,
        reason: &str,
        note: impl Into<String>,
        related: Option<ObjectReference>,
    ) {
        self.event(
            EventType::Normal,
            regarding,
            action,
            reason,
            note.into(),
            related,
        );
    }

    /// A Warning Event: as [`EventSink::normal`], for what an operator
    /// should look at.
    pub fn warning(
        &self,
        regarding: ObjectReference,
        action: &str,
        reason: &str,
        note: impl Into<String>,
        related: Option<ObjectReference>,
    ) {
        self.event(
            EventType::Warning,
            regarding,
            action,
            reason,
            note.into(),
            related,
        );
    }

    /// An Event of `type_`, for a caller that decides it (a step that
    /// failed or not); otherwise [`EventSink::normal`] or
    /// [`EventSink::warning`].
    pub fn event(
        &self,
        type_: EventType,
        regarding: ObjectReference,
        action: &str,
        reason: &str,
        note: String,
        related: Option<ObjectReference>,
    ) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: related,
        };
        self.queue(ev, regarding);
    }

    /// Queues `ev` about `regarding`; never waits.
    fn queue(&self, mut ev: Event, regarding: ObjectReference) {
        // The API server refuses a note longer than this (the whole Event
        // would be lost): a long one is cut, and says so.
        if let Some(note) = ev.note.as_mut() {
            cut_note(note);
        }
        if let Err(e) = self.tx.try_send((ev, regarding)) {
            self.metrics.events_dropped.inc();
            let (ev, _) = e.into_inner();
            tracing::warn!(reason = %ev.reason, "Event queue full: Event dropped");
        }
    }
}

/// The longest note the API server takes (`events.k8s.io/v1` `note`).
pub(crate) const MAX_NOTE: usize = 1024;

/// Cuts `note` to [`MAX_NOTE`] bytes at a character boundary, ending in
/// `…` when cut.
fn cut_note(note: &mut String) {
    if note.len() <= MAX_NOTE {
        return;
    }
    let ellipsis = '…';
    let mut end = MAX_NOTE - ellipsis.len_utf8();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    note.truncate(end);
    note.push(ellipsis);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(reason: &str) -> Event {
        Event {
            type_: EventType::Normal,
            reason: reason.into(),
            note: None,
            action: "Test".into(),
            secondary: None,
        }
    }

    #[tokio::test]
    async fn a_full_queue_drops_and_counts_instead_of_waiting() {
        let metrics = Arc::new(Metrics::new().expect("metrics"));
        // A sink whose publisher is not running: nothing leaves the queue.
        let (tx, _rx) = mpsc::channel(2);
        let sink = EventSink {
            tx,
            metrics: Arc::clone(&metrics),
        };
        for reason in ["A", "B", "C", "D"] {
            sink.queue(event(reason), ObjectReference::default());
        }
        assert_eq!(metrics.events_dropped.get(), 2);
    }

    #[test]
    fn a_long_note_is_cut_to_what_the_api_server_takes() {
        let mut short = "evicted pod db/pg-0".to_string();
        cut_note(&mut short);
        assert_eq!(short, "evicted pod db/pg-0");
        let mut long = "é".repeat(MAX_NOTE);
        cut_note(&mut long);
        assert!(long.len() <= MAX_NOTE, "{}", long.len());
        assert!(long.ends_with('…'));
    }
}
