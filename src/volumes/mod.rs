//! The volume-attachment tracker: one VolumeAttachment and Node watch fanned
//! out to many concurrent waits, without ever losing a detach or reattach.
//!
//! # Shape
//!
//! * `Tracker` holds the informer stores (`Store<VolumeAttachment>`,
//!   `Store<Node>`), which are the truth, the shared index of the
//!   attachments by PV (read only: the caller feeds it), and a registry of
//!   waits.
//! * `Tracker::register` returns a `Registration` for an `Interest`:
//!   the Node being drained and the PersistentVolumes of the pod being moved
//!   (each with its unique name, see [`unique_name_of`]).
//! * The watch streams feed the tracker with
//!   `Tracker::observe_attachment_event` and
//!   `Tracker::observe_node_event`. Each event is routed only to the
//!   registrations it concerns (a VolumeAttachment to those interested in
//!   its PV, a Node to those draining it), as a `Hint` through the
//!   registration's own **bounded** channel.
//! * `Registration::wait_detached` evaluates a pure predicate
//!   ([`detached_from`]) over the stores when it starts, after every hint
//!   and after every lag, until it holds or the deadline passes. The
//!   deadline is the only timer: nothing polls. Waits for a volume to
//!   attach where its replacement runs take the registration's signals
//!   (`Registration::next_signal`) and evaluate the drain's own predicate
//!   (`drain::volume::volume_moved`), which needs the pods too.
//!
//! # Why nothing is lost
//!
//! A hint never carries state; it only says "look again". Losslessness
//! therefore reduces to: *after every store change that matters to a wait,
//! the wait reads the store again*. That holds because:
//!
//! 1. **Store first, then hint.** The reflector writes an event into its
//!    store before yielding it downstream, and the `observe_*` methods are
//!    called from an `inspect` right after the reflector, after the index by
//!    PV was fed the same event. So when a hint is sent, the store and the
//!    index already show the change (or a newer state).
//! 2. **Register before acting.** A registration receives every event
//!    observed after `Tracker::register` returned, and every wait first
//!    evaluates its predicate over the store. A change that happened before
//!    the registration is in the store; one after it produces a hint. So
//!    register *before* evicting the pod.
//! 3. **Overflow is never silent.** Observers only `try_send` (they run
//!    inside a stream combinator and must not block the watch). When a
//!    registration's channel is full, the observer sets the registration's
//!    `lagged` flag (counted in `berth_tracker_lagged_total`, once per lag
//!    episode) and wakes it through a `Notify`, which stores a permit if the
//!    receiver is not waiting yet. The receiver's next
//!    `Registration::next_signal` yields `Signal::Lagged`, and the wait
//!    re-reads the store, which by (1) already contains the change whose
//!    hint was not queued. Unlike the design this replaces (which discarded
//!    the event with a warning), a slow wait costs a re-read, never a
//!    missed detach or reattach; and because each channel is bounded, it
//!    cannot grow memory either.
//! 4. **Re-lists are broadcast.** When a watch restarts, the reflector
//!    swaps in a freshly listed store on `InitDone`; objects deleted in the
//!    meantime vanish without a Delete event. The tracker sends
//!    `Hint::Resync` to every registration on `InitDone`.
//! 5. **Caches are synced first.** An empty, not yet listed store would make
//!    "detached" look true; the waits first wait for both stores' initial
//!    list (within their deadline).
//! 6. **Deregistration is RAII.** Dropping a `Registration` removes it
//!    from the registry, whichever way the code leaves its scope (`?`,
//!    timeout, a cancelled future, an aborted task, a panic).
//!
//! # Feeding the tracker
//!
//! ```ignore
//! let vas = reflector(va_writer, watcher(va_api, cfg))
//!     .inspect(|ev| if let Ok(ev) = ev { tracker.observe_attachment_event(ev) });
//! let nodes = reflector(node_writer, watcher(node_api, cfg))
//!     .inspect(|ev| if let Ok(ev) = ev { tracker.observe_node_event(ev) });
//! ```
//!
//! The `inspect` must come directly after `reflector`, before any filter
//! (e.g. a predicate filter) that could drop events. `Tracker::close` ends
//! pending waits with `WaitError::Closed` at shutdown.

mod intree;
mod predicate;
mod tracker;

pub use self::intree::{in_tree_attachable_name, migrated_csi_source};
pub use self::predicate::{
    AttachRefused, Attachment, CSI_UNIQUE_NAME_PREFIX, RESOURCE_EXHAUSTED, attach_exhausted,
    attached_elsewhere, attachments_of, csi_unique_name, detached_from, is_attached, is_deleting,
    listed_on, pv_of, unique_name_of,
};
pub(crate) use self::tracker::{
    DEFAULT_CHANNEL_CAPACITY, Interest, Registration, Signal, Tracker, WaitError,
};
