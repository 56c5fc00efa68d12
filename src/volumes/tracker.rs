//! The tracker itself: registrations, fan-out of watch events to them, and
//! the waits. See the [module documentation](super) for the guarantees.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::Event;
use prometheus::IntCounter;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::predicate::{detached_from, listed_on, pv_of};
use crate::cache::Index;
use crate::telemetry::Metrics;

/// Default capacity of each registration's event channel.
pub(crate) const DEFAULT_CHANNEL_CAPACITY: usize = 16;

/// What a wait is interested in: the Node being drained and the volumes
/// (PersistentVolume names, each with its unique name when known) of the
/// pod being moved off it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Interest {
    node: String,
    volumes: BTreeMap<String, Option<String>>,
}

impl Interest {
    /// An interest in the Node `node` and no volumes yet.
    pub(crate) fn new(node: impl Into<String>) -> Self {
        Self {
            node: node.into(),
            volumes: BTreeMap::new(),
        }
    }

    /// Adds a PersistentVolume, with its unique name as listed in
    /// `node.status.volumesAttached` (see
    /// [`unique_name_of`](super::unique_name_of)) when it has one.
    #[must_use]
    pub(crate) fn volume(mut self, pv: impl Into<String>, unique_name: Option<String>) -> Self {
        self.volumes.insert(pv.into(), unique_name);
        self
    }

    /// The volumes: PV name and unique name, ordered by PV name.
    pub(crate) fn volumes(&self) -> impl Iterator<Item = (&str, Option<&str>)> {
        self.volumes
            .iter()
            .map(|(pv, unique)| (pv.as_str(), unique.as_deref()))
    }

    /// The unique names of the volumes that have one.
    fn unique_names(&self) -> BTreeSet<String> {
        self.volumes.values().flatten().cloned().collect()
    }

    /// Whether `pv` is one of the volumes.
    #[cfg(test)]
    pub(crate) fn contains(&self, pv: &str) -> bool {
        self.volumes.contains_key(pv)
    }
}

/// A hint that something a registration is interested in changed. It says
/// which object, never what the state is: the store is the truth, and a
/// receiver re-reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Hint {
    /// A VolumeAttachment of one of the registration's volumes was applied
    /// or deleted.
    Attachment {
        /// The VolumeAttachment's name.
        name: String,
        /// Its `spec.source.persistentVolumeName`.
        pv: String,
        /// Its `spec.nodeName`.
        node: String,
    },
    /// The registration's Node was applied or deleted.
    Node {
        /// The Node's name.
        name: String,
    },
    /// A watch re-listed: the store was replaced as a whole, possibly
    /// without a Delete event for objects that vanished meanwhile.
    Resync,
}

/// What [`Registration::next_signal`] yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Signal {
    /// Something of interest changed. Hints that were pending at the same
    /// time are coalesced into this one.
    Hint(Hint),
    /// The registration's channel overflowed and hints were not delivered:
    /// re-read the stores. (Pending hints are discarded; the re-read
    /// subsumes them.)
    Lagged,
    /// The tracker was closed; no more signals will come.
    Closed,
}

/// Why a wait ended without its condition being met.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WaitError {
    /// The deadline passed first.
    #[error("timed out waiting for: {}", waiting_for.join("; "))]
    Timeout {
        /// What was still not satisfied, one human-readable sentence per
        /// volume, e.g. `pv-a still attached to node-a (VolumeAttachment
        /// csi-1, attached=true)`.
        waiting_for: Vec<String>,
    },
    /// The tracker was shut down (or the informer behind a store went away
    /// before it ever synced).
    #[error("the volume tracker was shut down")]
    Closed,
}

/// Shared between a registration and the observers that send to it.
#[derive(Debug, Default)]
struct Shared {
    /// Set by an observer whose `try_send` found the channel full; taken by
    /// the receiver, which then re-reads the stores.
    lagged: AtomicBool,
    /// Lag episodes of this registration (false→true transitions of
    /// `lagged`).
    lags: AtomicU64,
    /// Wakes the receiver when `lagged` is set, even if it is blocked on an
    /// empty channel (a permit is stored if nobody waits yet).
    notify: Notify,
}

/// One registration as the observers see it.
struct Slot {
    node: String,
    pvs: BTreeSet<String>,
    /// The unique names of `pvs` that have one: another Node that lists
    /// one is where the volume went (the in-tree kinds the attach-detach
    /// controller attaches without a VolumeAttachment).
    names: BTreeSet<String>,
    tx: mpsc::Sender<Hint>,
    shared: Arc<Shared>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    slots: HashMap<u64, Slot>,
    closed: bool,
}

struct Inner {
    attachments: Store<VolumeAttachment>,
    /// The VolumeAttachments of `attachments` by PV (the shared index of
    /// [`crate::cache::Indexes`], fed by the caller after the store and
    /// before the tracker), so that a wait reads only the attachments of
    /// its own volumes instead of scanning the store.
    by_pv: Index<VolumeAttachment>,
    nodes: Store<Node>,
    capacity: usize,
    events: Option<IntCounter>,
    lagged: Option<IntCounter>,
    state: Mutex<State>,
}

impl Inner {
    /// The registry. Never held across an await; the critical sections only
    /// insert, remove or `try_send`, so a poisoned lock still holds
    /// consistent data and is used as is.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Delivers `hint` without blocking; on a full channel marks the slot
    /// lagged instead of losing it silently.
    fn send(&self, id: u64, slot: &Slot, hint: Hint) {
        match slot.tx.try_send(hint) {
            Ok(()) | Err(TrySendError::Closed(_)) => {}
            Err(TrySendError::Full(_)) => {
                if !slot.shared.lagged.swap(true, Ordering::AcqRel) {
                    slot.shared.lags.fetch_add(1, Ordering::Relaxed);
                    if let Some(c) = &self.lagged {
                        c.inc();
                    }
                    tracing::debug!(
                        registration = id,
                        node = %slot.node,
                        "volume tracker registration lagged; it will re-read the caches"
                    );
                    slot.shared.notify.notify_one();
                }
            }
        }
    }

    fn count_event(&self) {
        if let Some(c) = &self.events {
            c.inc();
        }
    }

    /// The VolumeAttachments of `pv` in the store, by name.
    fn attachments_of(&self, pv: &str) -> Vec<Arc<VolumeAttachment>> {
        self.by_pv.get(&self.attachments, pv)
    }
}

/// Fans one VolumeAttachment watch and one Node watch out to many concurrent
/// waits, without losing an event. Cheap to clone (an `Arc` inside).
///
/// See the [module documentation](super) for how to feed it.
#[derive(Clone)]
pub(crate) struct Tracker {
    inner: Arc<Inner>,
}

impl fmt::Debug for Tracker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.inner.lock();
        f.debug_struct("Tracker")
            .field("registered", &state.slots.len())
            .field("closed", &state.closed)
            .field("capacity", &self.inner.capacity)
            .finish_non_exhaustive()
    }
}

impl Tracker {
    /// A tracker reading the informer stores `attachments` and `nodes` (the
    /// truth), and `attachments_by_pv`, the index of `attachments` by PV,
    /// which the caller feeds each event before [`Self::observe_attachment_event`]
    /// (the tracker reads it, never feeds it), and giving each registration
    /// a channel of `channel_capacity`
    /// hints (at least 1). With `metrics`, every observed VolumeAttachment
    /// event is counted in `berth_volume_attachment_events_total` and every
    /// lag episode in `berth_tracker_lagged_total`.
    pub(crate) fn new(
        attachments: Store<VolumeAttachment>,
        attachments_by_pv: Index<VolumeAttachment>,
        nodes: Store<Node>,
        channel_capacity: usize,
        metrics: Option<&Metrics>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                attachments,
                by_pv: attachments_by_pv,
                nodes,
                capacity: channel_capacity.max(1),
                events: metrics.map(|m| m.volume_attachment_events.clone()),
                lagged: metrics.map(|m| m.tracker_lagged.clone()),
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// Registers a wait's interest. From now on every event about one of
    /// its volumes or its Node reaches the returned [`Registration`] (or
    /// marks it lagged), until it is dropped. Register *before* the action
    /// whose effect you will wait for (the eviction).
    pub(crate) fn register(&self, interest: Interest) -> Registration {
        let (tx, rx) = mpsc::channel(self.inner.capacity);
        let shared = Arc::new(Shared::default());
        let mut state = self.inner.lock();
        let id = state.next_id;
        state.next_id += 1;
        if !state.closed {
            state.slots.insert(
                id,
                Slot {
                    node: interest.node.clone(),
                    pvs: interest.volumes.keys().cloned().collect(),
                    names: interest.unique_names(),
                    tx,
                    shared: Arc::clone(&shared),
                },
            );
        }
        // When closed, `tx` is dropped here and the registration's waits end
        // with `WaitError::Closed` unless already satisfied.
        drop(state);
        Registration {
            id,
            inner: Arc::clone(&self.inner),
            interest,
            rx,
            shared,
        }
    }

    /// Number of live registrations.
    #[cfg(test)]
    pub(crate) fn registered(&self) -> usize {
        self.inner.lock().slots.len()
    }

    /// Feeds one VolumeAttachment watch event, *after* the reflector applied
    /// it to the store (call it from an `inspect` directly downstream of
    /// `reflector`). Never blocks.
    ///
    /// `Apply` and `Delete` are routed to the registrations interested in
    /// the attachment's PV; `InitDone` (the store was replaced by a
    /// re-list) reaches every registration as [`Hint::Resync`]; `Init` and
    /// `InitApply` do not change the store and are only counted. The index
    /// by PV must have been fed the event already: a hint must find it as
    /// up to date as the store.
    pub(crate) fn observe_attachment_event(&self, event: &Event<VolumeAttachment>) {
        self.inner.count_event();
        match event {
            Event::Apply(va) | Event::Delete(va) => self.route_attachment(va),
            Event::InitDone => self.resync(),
            Event::Init | Event::InitApply(_) => {}
        }
    }

    /// Feeds one Node watch event, after the reflector applied it to the
    /// store. Never blocks. `Apply`/`Delete` reach the registrations for
    /// that Node, `InitDone` every registration.
    pub(crate) fn observe_node_event(&self, event: &Event<Node>) {
        match event {
            Event::Apply(node) | Event::Delete(node) => self.observe_node(node),
            Event::InitDone => self.resync(),
            Event::Init | Event::InitApply(_) => {}
        }
    }

    /// Routes a Node that was applied or deleted to the registrations for
    /// it, and to those with a volume it lists in `status.volumesAttached`
    /// (attached there: where a volume without a VolumeAttachment went).
    fn observe_node(&self, node: &Node) {
        let Some(name) = node.metadata.name.as_deref() else {
            return;
        };
        let state = self.inner.lock();
        for (id, slot) in &state.slots {
            if slot.node == name || slot.names.iter().any(|n| listed_on(node, n)) {
                let hint = Hint::Node {
                    name: name.to_owned(),
                };
                self.inner.send(*id, slot, hint);
            }
        }
    }

    /// Tells every registration to re-read the stores ([`Hint::Resync`]).
    /// Call it whenever a store may have changed without a per-object event
    /// (the `observe_*_event` methods do so on `InitDone`).
    pub(crate) fn resync(&self) {
        let state = self.inner.lock();
        for (id, slot) in &state.slots {
            self.inner.send(*id, slot, Hint::Resync);
        }
    }

    fn route_attachment(&self, va: &VolumeAttachment) {
        let Some(pv) = pv_of(va) else {
            return;
        };
        let state = self.inner.lock();
        for (id, slot) in &state.slots {
            if slot.pvs.contains(pv) {
                let hint = Hint::Attachment {
                    name: va.metadata.name.clone().unwrap_or_default(),
                    pv: pv.to_owned(),
                    node: va.spec.node_name.clone(),
                };
                self.inner.send(*id, slot, hint);
            }
        }
    }

    /// Shuts the tracker down: every registration is removed, pending and
    /// future waits that are not already satisfied end with
    /// [`WaitError::Closed`]. Idempotent.
    pub(crate) fn close(&self) {
        let mut state = self.inner.lock();
        state.closed = true;
        state.slots.clear();
    }

    /// Whether [`Tracker::close`] was called.
    #[cfg(test)]
    pub(crate) fn is_closed(&self) -> bool {
        self.inner.lock().closed
    }

    /// Every VolumeAttachment of `pv` in the store, sorted by node. Reads
    /// the cache as it is: before its initial list it is empty.
    #[cfg(test)]
    pub(crate) fn attachments(&self, pv: &str) -> Vec<super::Attachment> {
        let vas = self.inner.attachments_of(pv);
        super::attachments_of(pv, vas.iter().map(AsRef::as_ref))
    }

    /// The Nodes `pv` is attached to (`status.attached == true`, whether or
    /// not the attachment is being deleted), sorted and deduplicated.
    #[cfg(test)]
    pub(crate) fn attached_nodes(&self, pv: &str) -> Vec<String> {
        let mut nodes: Vec<String> = self
            .attachments(pv)
            .into_iter()
            .filter(|a| a.attached)
            .map(|a| a.node)
            .collect();
        nodes.dedup();
        nodes
    }

    /// Evaluates, without waiting, whether every volume of `interest` is
    /// detached from its Node (see [`detached_from`] for the rule). Reads
    /// the caches as they are.
    ///
    /// # Errors
    /// One sentence per volume still attached.
    pub(crate) fn detached(&self, interest: &Interest) -> Result<(), Vec<String>> {
        let node_name = interest.node.as_str();
        let node = self.inner.nodes.get(&ObjectRef::new(node_name));
        let pending: Vec<String> = interest
            .volumes()
            .filter_map(|(pv, unique)| {
                let vas = self.inner.attachments_of(pv);
                detached_from(
                    pv,
                    unique,
                    node_name,
                    vas.iter().map(AsRef::as_ref),
                    node.as_deref(),
                )
                .err()
            })
            .collect();
        if pending.is_empty() {
            Ok(())
        } else {
            Err(pending)
        }
    }

    /// Waits until both stores finished their initial list, or the
    /// deadline.
    async fn synced(&self, deadline: Instant) -> Result<(), WaitError> {
        let ready = async {
            self.inner.attachments.wait_until_ready().await?;
            self.inner.nodes.wait_until_ready().await
        };
        match tokio::time::timeout_at(deadline, ready).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_writer_dropped)) => Err(WaitError::Closed),
            Err(_elapsed) => Err(WaitError::Timeout {
                waiting_for: vec![
                    "the VolumeAttachment and Node caches to finish their initial list".to_owned(),
                ],
            }),
        }
    }
}

/// A registered interest: receives the hints routed to it and waits on the
/// stores. Dropping it deregisters, on every exit path (including a wait
/// future being cancelled, since the registration outlives it, or the task
/// being aborted).
#[must_use = "dropping a Registration deregisters it"]
pub(crate) struct Registration {
    id: u64,
    inner: Arc<Inner>,
    interest: Interest,
    rx: mpsc::Receiver<Hint>,
    shared: Arc<Shared>,
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.id)
            .field("interest", &self.interest)
            .field("lags", &self.lags())
            .finish_non_exhaustive()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.inner.lock().slots.remove(&self.id);
    }
}

enum Woke {
    Hint(Option<Hint>),
    Notified,
}

impl Registration {
    fn tracker(&self) -> Tracker {
        Tracker {
            inner: Arc::clone(&self.inner),
        }
    }

    /// The registered interest.
    #[cfg(test)]
    pub(crate) fn interest(&self) -> &Interest {
        &self.interest
    }

    /// How many times this registration lagged (its channel was full when a
    /// hint for it arrived).
    pub(crate) fn lags(&self) -> u64 {
        self.shared.lags.load(Ordering::Relaxed)
    }

    /// Narrows the interest to the volumes for which `keep` returns true
    /// (e.g. before waiting for re-attachment, to the volumes some pending
    /// pod still needs). Narrowing cannot lose an event for a kept volume.
    pub(crate) fn retain_volumes(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.interest.volumes.retain(|pv, _| keep(pv));
        let pvs: BTreeSet<String> = self.interest.volumes.keys().cloned().collect();
        let names = self.interest.unique_names();
        if let Some(slot) = self.inner.lock().slots.get_mut(&self.id) {
            slot.pvs = pvs;
            slot.names = names;
        }
    }

    /// Takes a pending lag, discarding the hints it subsumes.
    fn take_lag(&mut self) -> bool {
        if self.shared.lagged.swap(false, Ordering::AcqRel) {
            while self.rx.try_recv().is_ok() {}
            true
        } else {
            false
        }
    }

    /// The next signal: a hint, [`Signal::Lagged`] or [`Signal::Closed`].
    /// After any of them, re-read the stores (e.g. with
    /// [`Registration::detached`]); a signal carries no state.
    ///
    /// Cancel-safe: a signal lost by dropping this future is recovered by
    /// re-reading the stores before waiting again, which every wait does.
    pub(crate) async fn next_signal(&mut self) -> Signal {
        loop {
            if self.take_lag() {
                return Signal::Lagged;
            }
            let woke = tokio::select! {
                biased;
                hint = self.rx.recv() => Woke::Hint(hint),
                () = self.shared.notify.notified() => Woke::Notified,
            };
            match woke {
                Woke::Hint(None) => return Signal::Closed,
                Woke::Hint(Some(hint)) => {
                    // Hints queued behind this one are subsumed by the store
                    // read that follows it.
                    while self.rx.try_recv().is_ok() {}
                    if self.take_lag() {
                        return Signal::Lagged;
                    }
                    return Signal::Hint(hint);
                }
                // Possibly a stale permit; the loop re-checks the flag.
                Woke::Notified => {}
            }
        }
    }

    /// [`Tracker::detached`] for this registration's interest, now.
    ///
    /// # Errors
    /// One sentence per volume still attached.
    pub(crate) fn detached(&self) -> Result<(), Vec<String>> {
        self.tracker().detached(&self.interest)
    }

    /// Waits until every volume is detached from the interest's Node: no
    /// VolumeAttachment for (PV, Node) left in the store, and the Node's
    /// `status.volumesAttached` no longer listing the PV's unique name
    /// (a Node gone from the store counts as detached). See
    /// [`detached_from`].
    ///
    /// # Errors
    /// [`WaitError::Timeout`] naming what is still attached when `deadline`
    /// passes; [`WaitError::Closed`] if the tracker is shut down first.
    pub(crate) async fn wait_detached(&mut self, deadline: Instant) -> Result<(), WaitError> {
        self.wait_until(deadline, "detach", Self::detached).await
    }

    /// Evaluates `check` over the stores once they are synced, then again
    /// after every signal, until it holds, the deadline passes or the
    /// tracker closes. The deadline is the only timer.
    async fn wait_until<T>(
        &mut self,
        deadline: Instant,
        what: &'static str,
        check: fn(&Self) -> Result<T, Vec<String>>,
    ) -> Result<T, WaitError> {
        self.tracker().synced(deadline).await?;
        loop {
            match check(self) {
                Ok(done) => return Ok(done),
                Err(pending) => {
                    tracing::trace!(registration = self.id, what, ?pending, "still waiting");
                }
            }
            let signal = tokio::select! {
                signal = self.next_signal() => Some(signal),
                () = tokio::time::sleep_until(deadline) => None,
            };
            match signal {
                // One last look: the state may have changed right at the
                // deadline.
                None => {
                    return check(self).map_err(|waiting_for| WaitError::Timeout { waiting_for });
                }
                Some(Signal::Closed) => return check(self).map_err(|_| WaitError::Closed),
                Some(Signal::Lagged) => {
                    tracing::debug!(
                        registration = self.id,
                        what,
                        "lagged behind the watch; re-reading the caches"
                    );
                }
                Some(Signal::Hint(hint)) => {
                    tracing::trace!(registration = self.id, what, ?hint, "woken");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::api::storage::v1::VolumeAttachment;
    use kube::runtime::reflector::store::Writer;
    use kube::runtime::watcher::Event;

    use super::super::predicate::fixtures::{deleting, node, va};
    use super::*;

    const UNIQUE_A: &str = "kubernetes.io/csi/ebs.csi.aws.com^vol-a";
    /// Generous bound for "promptly" in real time; the waits under test
    /// finish in microseconds, their deadlines are 30 s away.
    const PROMPT: Duration = Duration::from_secs(5);
    /// Deadline of the waits that are meant to time out.
    const SHORT: Duration = Duration::from_millis(50);

    /// The reflector's side: writes each event into a store, then tells the
    /// tracker, in that order.
    struct Feed {
        vas: Writer<VolumeAttachment>,
        by_pv: Index<VolumeAttachment>,
        nodes: Writer<Node>,
        tracker: Tracker,
    }

    impl Feed {
        fn va_event(&mut self, ev: Event<VolumeAttachment>) {
            self.vas.apply_watcher_event(&ev);
            self.by_pv.observe(&ev);
            self.tracker.observe_attachment_event(&ev);
        }
        fn node_event(&mut self, ev: Event<Node>) {
            self.nodes.apply_watcher_event(&ev);
            self.tracker.observe_node_event(&ev);
        }
        fn apply_va(&mut self, v: VolumeAttachment) {
            self.va_event(Event::Apply(v));
        }
        fn delete_va(&mut self, v: VolumeAttachment) {
            self.va_event(Event::Delete(v));
        }
        fn apply_node(&mut self, n: Node) {
            self.node_event(Event::Apply(n));
        }
        fn synced(mut self) -> Self {
            self.va_event(Event::Init);
            self.va_event(Event::InitDone);
            self.node_event(Event::Init);
            self.node_event(Event::InitDone);
            self
        }
    }

    fn unsynced(capacity: usize) -> (Feed, Tracker, Metrics) {
        let metrics = Metrics::new().expect("metrics register");
        let vas = Writer::<VolumeAttachment>::default();
        let nodes = Writer::<Node>::default();
        let by_pv = Index::new(crate::cache::attachment_pv);
        let tracker = Tracker::new(
            vas.as_reader(),
            by_pv.clone(),
            nodes.as_reader(),
            capacity,
            Some(&metrics),
        );
        let feed = Feed {
            vas,
            by_pv,
            nodes,
            tracker: tracker.clone(),
        };
        (feed, tracker, metrics)
    }

    fn setup(capacity: usize) -> (Feed, Tracker, Metrics) {
        let (feed, tracker, metrics) = unsynced(capacity);
        (feed.synced(), tracker, metrics)
    }

    fn interest_a() -> Interest {
        Interest::new("node-a").volume("pv-a", Some(UNIQUE_A.to_owned()))
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    /// Lets spawned tasks run (and block again) without relying on timing
    /// for correctness.
    async fn settle() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wait_registered_before_the_event_sees_it() {
        let (mut feed, tracker, _m) = setup(4);
        let old = va("csi-1", "pv-a", "node-a", true);
        feed.apply_va(old.clone());
        feed.apply_node(node("node-a", &[]));

        let mut reg = tracker.register(interest_a());
        // The "eviction" and the detach happen in another task after the
        // registration, while (or before) the wait runs.
        let feeder = tokio::spawn(async move {
            settle().await;
            feed.delete_va(old);
            feed
        });
        let started = Instant::now();
        reg.wait_detached(far()).await.expect("detached");
        assert!(started.elapsed() < PROMPT, "took {:?}", started.elapsed());
        feeder.await.expect("feeder");
    }

    #[tokio::test]
    async fn an_event_between_register_and_wait_is_not_missed() {
        let (mut feed, tracker, _m) = setup(4);
        let old = va("csi-1", "pv-a", "node-a", true);
        feed.apply_va(old.clone());
        let mut reg = tracker.register(interest_a());
        feed.delete_va(old);
        // Already true when the wait starts: no deadline needed at all.
        reg.wait_detached(Instant::now()).await.expect("detached");
    }

    #[tokio::test]
    async fn a_predicate_already_true_returns_at_once() {
        let (mut feed, tracker, _m) = setup(4);
        feed.apply_node(node("node-a", &[]));
        feed.apply_va(va("csi-2", "pv-a", "node-b", true));
        let mut reg = tracker.register(interest_a());
        // A deadline that has already passed still yields Ok: the store is
        // read before anything waits.
        reg.wait_detached(Instant::now()).await.expect("detached");
        // An empty interest is trivially satisfied.
        let mut empty = tracker.register(Interest::new("node-a"));
        empty.wait_detached(Instant::now()).await.expect("vacuous");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flood_of_unrelated_events_neither_delays_nor_loses_the_one_that_matters() {
        let (mut feed, tracker, metrics) = setup(4);
        let old = va("csi-1", "pv-a", "node-a", true);
        feed.apply_va(old.clone());
        let mut reg = tracker.register(interest_a());
        let events_before = metrics.volume_attachment_events.get();

        let feeder = tokio::spawn(async move {
            for i in 0..10_000 {
                let other = va(&format!("csi-x{i}"), &format!("pv-x{i}"), "node-a", true);
                feed.apply_va(other);
                if i % 1000 == 0 {
                    feed.apply_node(node("node-b", &[]));
                }
            }
            feed.delete_va(old);
            feed
        });
        let started = Instant::now();
        reg.wait_detached(far()).await.expect("detached");
        assert!(started.elapsed() < PROMPT, "took {:?}", started.elapsed());
        feeder.await.expect("feeder");

        assert_eq!(reg.lags(), 0, "unrelated events must not reach the wait");
        assert_eq!(metrics.tracker_lagged.get(), 0);
        assert_eq!(
            metrics.volume_attachment_events.get() - events_before,
            10_001
        );
    }

    #[tokio::test]
    async fn overflow_marks_the_wait_lagged_and_it_rereads_the_store() {
        let (mut feed, tracker, metrics) = setup(1);
        feed.apply_node(node("node-a", &[]));
        let mut reg = tracker.register(interest_a());

        // 100 relevant events while nobody consumes: the channel (capacity
        // 1) overflows.
        for i in 0..100 {
            let mut v = va("csi-1", "pv-a", "node-a", i % 2 == 0);
            v.metadata.resource_version = Some(i.to_string());
            feed.apply_va(v);
        }
        assert_eq!(reg.lags(), 1, "one lag episode");
        assert_eq!(metrics.tracker_lagged.get(), 1);
        assert_eq!(reg.next_signal().await, Signal::Lagged);
        assert!(reg.detached().is_err(), "still attached");

        // The decisive event overflows the channel again.
        feed.apply_va(va("csi-1", "pv-a", "node-a", true));
        feed.apply_va(va("csi-1", "pv-a", "node-a", false));
        feed.delete_va(va("csi-1", "pv-a", "node-a", false));
        assert_eq!(reg.lags(), 2);
        assert_eq!(metrics.tracker_lagged.get(), 2);
        reg.wait_detached(Instant::now()).await.expect("detached");
    }

    #[tokio::test]
    async fn a_blocked_waiter_that_lags_still_returns_the_right_answer() {
        let (mut feed, tracker, metrics) = setup(1);
        let mut reg = tracker.register(interest_a());
        feed.apply_va(va("csi-1", "pv-a", "node-a", true));
        let waiter = tokio::spawn(async move {
            let out = reg.wait_detached(far()).await;
            (out, reg.lags())
        });
        settle().await;

        // A burst without yielding: the waiter cannot consume in between.
        for _ in 0..50 {
            feed.apply_va(va("csi-1", "pv-a", "node-a", true));
        }
        feed.delete_va(va("csi-1", "pv-a", "node-a", true));
        let started = Instant::now();
        let (out, lags) = waiter.await.expect("waiter");
        out.expect("detached");
        assert!(started.elapsed() < PROMPT);
        assert!(lags >= 1, "the burst overflowed");
        assert!(metrics.tracker_lagged.get() >= 1);
        assert_eq!(tracker.registered(), 0);
    }

    #[tokio::test]
    async fn overflow_never_yields_a_wrong_answer() {
        let (mut feed, tracker, _m) = setup(1);
        let mut reg = tracker.register(interest_a());
        for _ in 0..20 {
            feed.apply_va(va("csi-1", "pv-a", "node-a", false));
        }
        assert!(reg.lags() >= 1);
        let err = reg
            .wait_detached(Instant::now() + SHORT)
            .await
            .expect_err("the VolumeAttachment still exists");
        assert!(matches!(err, WaitError::Timeout { .. }), "{err}");
    }

    /// What the drain engine does for one pod.
    async fn move_one(tracker: &Tracker, deadline: Instant) -> Result<(), WaitError> {
        let mut reg = tracker.register(interest_a());
        reg.wait_detached(deadline).await?;
        Ok(())
    }

    #[tokio::test]
    async fn deregisters_on_every_exit_path() {
        let (mut feed, tracker, _m) = setup(4);
        let v = va("csi-1", "pv-a", "node-a", true);

        // Dropped without waiting.
        let reg = tracker.register(interest_a());
        assert_eq!(tracker.registered(), 1);
        drop(reg);
        assert_eq!(tracker.registered(), 0);

        // After Ok.
        move_one(&tracker, far()).await.expect("nothing attached");
        assert_eq!(tracker.registered(), 0);

        // After Timeout (through `?`).
        feed.apply_va(v.clone());
        let err = move_one(&tracker, Instant::now() + SHORT).await;
        assert!(matches!(err, Err(WaitError::Timeout { .. })), "{err:?}");
        assert_eq!(tracker.registered(), 0);

        // The wait future dropped mid-wait (cancellation).
        let cancelled = tokio::time::timeout(SHORT, move_one(&tracker, far())).await;
        assert!(cancelled.is_err(), "cancelled by the outer timeout");
        assert_eq!(tracker.registered(), 0);

        // Cancelled through select!.
        tokio::select! {
            _ = move_one(&tracker, far()) => panic!("cannot finish"),
            () = settle() => {}
        }
        assert_eq!(tracker.registered(), 0);

        // The task running it aborted.
        let t2 = tracker.clone();
        let task = tokio::spawn(async move { move_one(&t2, far()).await });
        settle().await;
        assert_eq!(tracker.registered(), 1, "registered while waiting");
        task.abort();
        assert!(task.await.expect_err("aborted").is_cancelled());
        assert_eq!(tracker.registered(), 0);

        // And a successful wait woken by an event.
        let t3 = tracker.clone();
        let task = tokio::spawn(async move { move_one(&t3, far()).await });
        settle().await;
        assert_eq!(tracker.registered(), 1);
        feed.delete_va(v);
        task.await.expect("task").expect("detached");
        assert_eq!(tracker.registered(), 0);
    }

    #[tokio::test]
    async fn a_timeout_names_what_is_still_attached() {
        let (mut feed, tracker, _m) = setup(4);
        feed.apply_va(va("csi-1", "pv-a", "node-a", true));
        feed.apply_node(node("node-a", &[UNIQUE_A]));
        let mut reg = tracker.register(
            interest_a().volume("pv-b", None), // pv-b: nothing attached
        );
        let started = Instant::now();
        let err = reg
            .wait_detached(started + SHORT)
            .await
            .expect_err("still attached");
        assert!(started.elapsed() >= SHORT);
        let WaitError::Timeout { waiting_for } = &err else {
            panic!("expected a timeout, got {err:?}");
        };
        assert_eq!(waiting_for.len(), 1, "{waiting_for:?}");
        let what = &waiting_for[0];
        for fragment in [
            "pv-a still attached to node-a",
            "VolumeAttachment csi-1",
            UNIQUE_A,
        ] {
            assert!(what.contains(fragment), "{what:?} lacks {fragment:?}");
        }
        assert!(err.to_string().starts_with("timed out waiting for: pv-a"));
    }

    #[tokio::test]
    async fn node_volumes_attached_keeps_the_detach_wait_waiting() {
        let (mut feed, tracker, _m) = setup(4);
        feed.apply_node(node("node-a", &[UNIQUE_A]));
        // The VolumeAttachment is already gone.
        let mut reg = tracker.register(interest_a());
        let waiter = tokio::spawn(async move { reg.wait_detached(far()).await });
        settle().await;
        assert!(!waiter.is_finished(), "the Node still lists the volume");

        // An unrelated Node change does not release it either.
        feed.apply_node(node("node-b", &[]));
        settle().await;
        assert!(!waiter.is_finished());

        feed.apply_node(node("node-a", &["kubernetes.io/csi/ebs.csi.aws.com^vol-z"]));
        waiter.await.expect("waiter").expect("detached");
    }

    #[tokio::test]
    async fn a_deleted_node_counts_as_detached() {
        let (mut feed, tracker, _m) = setup(4);
        let n = node("node-a", &[UNIQUE_A]);
        feed.apply_node(n.clone());
        let mut reg = tracker.register(interest_a());
        let waiter = tokio::spawn(async move { reg.wait_detached(far()).await });
        settle().await;
        feed.node_event(Event::Delete(n));
        waiter.await.expect("waiter").expect("detached");
    }

    #[tokio::test]
    async fn hints_reach_only_interested_registrations() {
        let (mut feed, tracker, _m) = setup(4);
        let mut a = tracker.register(interest_a());
        let mut b = tracker.register(Interest::new("node-b").volume("pv-b", None));

        feed.apply_va(va("csi-1", "pv-a", "node-z", true));
        feed.apply_node(node("node-b", &[]));
        feed.apply_va(va("csi-9", "pv-z", "node-a", true));

        assert_eq!(
            a.next_signal().await,
            Signal::Hint(Hint::Attachment {
                name: "csi-1".to_owned(),
                pv: "pv-a".to_owned(),
                node: "node-z".to_owned(),
            })
        );
        assert_eq!(
            b.next_signal().await,
            Signal::Hint(Hint::Node {
                name: "node-b".to_owned()
            })
        );
        for reg in [&mut a, &mut b] {
            let more = tokio::time::timeout(SHORT, reg.next_signal()).await;
            assert!(more.is_err(), "unexpected {more:?}");
        }
    }

    #[tokio::test]
    async fn another_node_that_lists_a_volume_wakes_its_registration() {
        // An in-tree iSCSI volume has no VolumeAttachment: the only sign
        // that it attached where its replacement runs is that Node's list.
        let (mut feed, tracker, _m) = setup(4);
        let mut a = tracker.register(interest_a());
        feed.apply_node(node("node-b", &["kubernetes.io/iscsi/other:iqn:0"]));
        let quiet = tokio::time::timeout(SHORT, a.next_signal()).await;
        assert!(
            quiet.is_err(),
            "node-b lists none of a's volumes: {quiet:?}"
        );
        feed.apply_node(node("node-b", &[UNIQUE_A]));
        assert_eq!(
            a.next_signal().await,
            Signal::Hint(Hint::Node {
                name: "node-b".to_owned()
            })
        );
        // Narrowed to no volume, it is woken by its own Node only.
        a.retain_volumes(|_| false);
        feed.apply_node(node("node-c", &[UNIQUE_A]));
        let quiet = tokio::time::timeout(SHORT, a.next_signal()).await;
        assert!(quiet.is_err(), "pv-a is no longer of interest: {quiet:?}");
    }

    #[tokio::test]
    async fn a_relist_that_drops_an_attachment_wakes_the_wait() {
        let (mut feed, tracker, metrics) = setup(4);
        feed.apply_va(va("csi-1", "pv-a", "node-a", true));
        let mut reg = tracker.register(interest_a());
        let waiter = tokio::spawn(async move { reg.wait_detached(far()).await });
        settle().await;

        // The watch restarts; csi-1 was deleted while it was down, so no
        // Delete event ever comes, only a new list without it.
        let before = metrics.volume_attachment_events.get();
        feed.va_event(Event::Init);
        feed.va_event(Event::InitApply(va("csi-2", "pv-b", "node-a", true)));
        settle().await;
        assert!(
            !waiter.is_finished(),
            "the store is unchanged until InitDone"
        );
        feed.va_event(Event::InitDone);
        waiter.await.expect("waiter").expect("detached");
        assert_eq!(metrics.volume_attachment_events.get() - before, 3);
    }

    #[tokio::test]
    async fn waits_wait_for_the_initial_list() {
        let (feed, tracker, _m) = unsynced(4);
        let mut reg = tracker.register(interest_a());
        // The raw view of an unsynced store is empty and looks "detached";
        // the waits must not trust it.
        assert!(
            tracker.detached(&interest_a()).is_ok(),
            "the raw view is empty"
        );
        let err = reg
            .wait_detached(Instant::now() + SHORT)
            .await
            .expect_err("not synced");
        let WaitError::Timeout { waiting_for } = err else {
            panic!("expected a timeout");
        };
        assert!(waiting_for[0].contains("initial list"), "{waiting_for:?}");

        let mut feed = feed;
        feed.va_event(Event::Init);
        feed.va_event(Event::InitApply(va("csi-1", "pv-a", "node-a", true)));
        feed.va_event(Event::InitDone);
        let waiter = tokio::spawn(async move { reg.wait_detached(far()).await });
        settle().await;
        assert!(!waiter.is_finished(), "Node cache not synced yet");
        feed.node_event(Event::Init);
        feed.node_event(Event::InitDone);
        settle().await;
        assert!(!waiter.is_finished(), "synced, and pv-a is attached");
        feed.delete_va(va("csi-1", "pv-a", "node-a", true));
        waiter.await.expect("waiter").expect("detached");
    }

    #[tokio::test]
    async fn a_store_whose_writer_is_gone_before_syncing_closes_the_wait() {
        let (feed, tracker, _m) = unsynced(4);
        let mut reg = tracker.register(interest_a());
        drop(feed);
        assert_eq!(reg.wait_detached(far()).await, Err(WaitError::Closed));
    }

    #[tokio::test]
    async fn close_ends_pending_and_future_waits() {
        let (mut feed, tracker, _m) = setup(4);
        feed.apply_va(va("csi-1", "pv-a", "node-a", true));
        let mut reg = tracker.register(interest_a());
        let waiter = tokio::spawn(async move { reg.wait_detached(far()).await });
        settle().await;
        assert!(!tracker.is_closed());
        tracker.close();
        assert!(tracker.is_closed());
        assert_eq!(waiter.await.expect("waiter"), Err(WaitError::Closed));
        assert_eq!(tracker.registered(), 0);

        let mut late = tracker.register(interest_a());
        assert_eq!(tracker.registered(), 0);
        assert_eq!(late.wait_detached(far()).await, Err(WaitError::Closed));
        // A condition that already holds is still reported as such.
        let mut other = tracker.register(Interest::new("node-a").volume("pv-b", None));
        other
            .wait_detached(far())
            .await
            .expect("pv-b was never attached");
    }

    #[tokio::test]
    async fn retain_volumes_narrows_the_interest() {
        let (mut feed, tracker, _m) = setup(4);
        feed.apply_va(va("csi-1", "pv-a", "node-a", true));
        feed.apply_va(va("csi-2", "pv-b", "node-a", true));
        let mut reg = tracker.register(interest_a().volume("pv-b", None));
        assert_eq!(reg.detached().expect_err("both attached").len(), 2);

        reg.retain_volumes(|pv| pv == "pv-a");
        assert!(reg.interest().contains("pv-a"));
        assert!(!reg.interest().contains("pv-b"));
        feed.apply_va(va("csi-2", "pv-b", "node-a", false));
        let quiet = tokio::time::timeout(SHORT, reg.next_signal()).await;
        assert!(quiet.is_err(), "pv-b is no longer routed: {quiet:?}");

        let waiter = tokio::spawn(async move { reg.wait_detached(far()).await });
        settle().await;
        feed.delete_va(va("csi-1", "pv-a", "node-a", true));
        waiter
            .await
            .expect("waiter")
            .expect("pv-a detached, pv-b ignored");
    }

    #[tokio::test]
    async fn the_current_state_can_be_queried_without_waiting() {
        let (mut feed, tracker, _m) = setup(4);
        feed.apply_va(va("csi-1", "pv-a", "node-a", true));
        feed.apply_va(va("csi-2", "pv-a", "node-b", false));
        feed.apply_va(deleting(va("csi-3", "pv-a", "node-c", true)));
        feed.apply_va(va("csi-4", "pv-b", "node-d", true));
        assert_eq!(tracker.attached_nodes("pv-a"), vec!["node-a", "node-c"]);
        let all = tracker.attachments("pv-a");
        assert_eq!(
            all.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
            vec!["csi-1", "csi-2", "csi-3"]
        );
        assert!(all[2].deleting);
        assert!(tracker.attached_nodes("pv-none").is_empty());
        assert!(format!("{tracker:?}").contains("registered: 0"));
    }

    #[tokio::test]
    async fn waits_read_the_attachments_of_their_own_volumes_by_pv() {
        let (mut feed, tracker, _m) = setup(4);
        for i in 0..500 {
            feed.apply_va(va(
                &format!("other-{i}"),
                &format!("pv-{i}"),
                "node-a",
                true,
            ));
        }
        feed.apply_va(va("csi-1", "pv-a", "node-a", true));
        let reg = tracker.register(interest_a());
        let pending = reg.detached().expect_err("pv-a is attached");
        assert_eq!(pending.len(), 1, "{pending:?}");
        assert!(pending[0].starts_with("pv-a still attached to node-a"));
        // Applies, deletes and re-lists reach the lookup by PV.
        feed.apply_va(va("csi-2", "pv-a", "node-b", true));
        assert_eq!(tracker.attached_nodes("pv-a"), ["node-a", "node-b"]);
        feed.delete_va(va("csi-1", "pv-a", "node-a", true));
        assert_eq!(reg.detached(), Ok(()));
        feed.va_event(Event::Init);
        feed.va_event(Event::InitApply(va("csi-1", "pv-a", "node-a", true)));
        feed.va_event(Event::InitDone);
        assert!(reg.detached().is_err(), "the re-list brought csi-1 back");
        assert_eq!(
            tracker.attached_nodes("pv-a"),
            ["node-a"],
            "and dropped csi-2"
        );
    }
}
