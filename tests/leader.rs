//! Leader election against a real kube-apiserver: one leader at a time,
//! quick hand-over on release or drop, and `lost()` resolving when the
//! election dies.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use berth::wiring::leader::{LeaderElection, LeaderError};
use berth_devkit::testbed::{Options, TestBed};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::{Api, DeleteParams};
use tokio::sync::{OnceCell, watch};

const NS: &str = "default";
const LEASE: Duration = Duration::from_secs(2);
/// Generous bound for anything that should take about one lease duration.
const WITHIN: Duration = Duration::from_secs(8);

/// One control plane for the tests of this file.
async fn client() -> Client {
    static BED: OnceCell<TestBed> = OnceCell::const_new();
    BED.get_or_init(|| async {
        TestBed::start(Options::integration())
            .await
            .expect("the integration test bed starts")
    })
    .await
    .client()
    .await
    .expect("admin client")
}

async fn holder(client: &Client, lease: &str) -> Option<String> {
    Api::<Lease>::namespaced(client.clone(), NS)
        .get(lease)
        .await
        .expect("read the Lease")
        .spec
        .and_then(|s| s.holder_identity)
}

/// Samples two "am I leader" channels until stopped and records whether
/// both were ever true at once. A channel is only counted as true across
/// the other's read if it read true both before and after it (leadership
/// never comes back once lost, so that means it was true throughout).
struct OverlapSampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(bool, u64)>,
}

impl OverlapSampler {
    fn start(a: watch::Receiver<bool>, b: watch::Receiver<bool>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn({
            let stop = Arc::clone(&stop);
            async move {
                let mut overlap = false;
                while !stop.load(Ordering::Acquire) {
                    let (a1, b1) = (*a.borrow(), *b.borrow());
                    let (a2, b2) = (*a.borrow(), *b.borrow());
                    // a1 && a2 spans the read of b1; b1 && b2 spans the read of a2.
                    overlap |= b1 && a2 && (a1 || b2);
                    samples.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                (overlap, samples.load(Ordering::Relaxed))
            }
        });
        Self { stop, task }
    }

    async fn finish(self) -> (bool, u64) {
        self.stop.store(true, Ordering::Release);
        self.task.await.expect("sampler does not panic")
    }
}

async fn start(client: &Client, lease: &str, identity: &str) -> LeaderElection {
    LeaderElection::start(client.clone(), NS, lease, identity, LEASE)
        .await
        .expect("leader election starts")
}

/// Waits until one of the two is leader; returns (leader, follower).
async fn race(mut a: LeaderElection, mut b: LeaderElection) -> (LeaderElection, LeaderElection) {
    let a_won = tokio::time::timeout(WITHIN, async {
        tokio::select! {
            r = a.acquired() => { r.expect("a acquires"); true }
            r = b.acquired() => { r.expect("b acquires"); false }
        }
    })
    .await
    .expect("someone becomes leader");
    if a_won { (a, b) } else { (b, a) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_at_a_time_and_quick_handover_on_release() {
    let client = client().await;
    let lease = "berth-leader-release";
    let (a, b) = tokio::join!(
        start(&client, lease, "replica-a"),
        start(&client, lease, "replica-b")
    );
    let sampler = OverlapSampler::start(a.subscribe(), b.subscribe());
    let sampling = Instant::now();
    let (leader, mut follower) = race(a, b).await;
    assert!(leader.is_leader());
    assert_eq!(
        holder(&client, lease).await.as_deref(),
        Some(leader.identity())
    );

    // Over more than a lease duration the leader renews (and its watchdog
    // confirms the renewals) and the follower stays a follower.
    tokio::time::sleep(LEASE + LEASE / 2).await;
    assert!(leader.is_leader(), "the leader kept its lease");
    assert!(!follower.is_leader(), "the follower stayed a follower");

    let released = Instant::now();
    let leader_identity = leader.identity().to_string();
    leader.release().await.expect("release succeeds");
    tokio::time::timeout(WITHIN, follower.acquired())
        .await
        .expect("the follower takes over within bounds")
        .expect("the follower acquires");
    let handover = released.elapsed();
    eprintln!("hand-over after release took {handover:?}");
    assert!(
        handover <= LEASE * 2 + LEASE / 2,
        "hand-over took {handover:?}"
    );
    assert_eq!(
        holder(&client, lease).await.as_deref(),
        Some(follower.identity())
    );
    assert_ne!(follower.identity(), leader_identity);

    // The sampler looked often enough to see an overlap: ten times a
    // lease duration at least (its pace is a sample every 5 ms; how many it
    // takes in the case's seconds is the machine's speed).
    let sampled_for = sampling.elapsed();
    let (overlap, samples) = sampler.finish().await;
    let least = (sampled_for.as_secs_f64() / LEASE.as_secs_f64() * 10.0) as u64;
    assert!(
        samples >= least.max(10),
        "only {samples} samples in {sampled_for:?}"
    );
    assert!(!overlap, "both replicas were leader at the same time");

    follower.release().await.expect("release succeeds");
    assert_eq!(
        holder(&client, lease).await,
        None,
        "release clears the holder"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_leader_hands_over() {
    let client = client().await;
    let lease = "berth-leader-drop";
    let (a, b) = tokio::join!(
        start(&client, lease, "replica-c"),
        start(&client, lease, "replica-d")
    );
    let sampler = OverlapSampler::start(a.subscribe(), b.subscribe());
    let (leader, mut follower) = race(a, b).await;
    let dropped = Instant::now();
    drop(leader);
    tokio::time::timeout(WITHIN, follower.acquired())
        .await
        .expect("the follower takes over within bounds")
        .expect("the follower acquires");
    eprintln!("hand-over after drop took {:?}", dropped.elapsed());
    let (overlap, _) = sampler.finish().await;
    assert!(!overlap, "both replicas were leader at the same time");
    follower.release().await.expect("release succeeds");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_resolves_when_the_lease_is_deleted() {
    let client = client().await;
    let lease = "berth-leader-deleted";
    let mut leader = start(&client, lease, "replica-e").await;
    tokio::time::timeout(WITHIN, leader.acquired())
        .await
        .expect("acquires within bounds")
        .expect("acquires");
    let mut follower = start(&client, lease, "replica-f").await;
    assert!(!follower.is_leader());

    Api::<Lease>::namespaced(client.clone(), NS)
        .delete(lease, &DeleteParams::default())
        .await
        .expect("delete the Lease");
    let deleted = Instant::now();

    let reason = tokio::time::timeout(WITHIN, leader.lost())
        .await
        .expect("the leader notices within bounds");
    eprintln!("leader noticed after {:?}: {reason}", deleted.elapsed());
    assert!(
        matches!(
            reason,
            LeaderError::LeaseDeleted { .. } | LeaderError::Lost { .. }
        ),
        "{reason:?}"
    );
    assert!(!leader.is_leader());
    // lost() keeps answering once resolved.
    assert_eq!(leader.lost().await.metric_label(), reason.metric_label());

    // The follower's election dies too: both waits resolve instead of
    // hanging on a dead task.
    let reason = tokio::time::timeout(WITHIN, follower.lost())
        .await
        .expect("the follower's election ends within bounds");
    assert_eq!(reason.metric_label(), "lease_deleted", "{reason:?}");
    let err = follower
        .acquired()
        .await
        .expect_err("no leadership any more");
    assert_eq!(err.metric_label(), "lease_deleted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejects_unusable_settings() {
    let client = client().await;
    for (lease, identity, duration) in [
        ("berth-leader-bad", "x", Duration::from_secs(1)),
        ("berth-leader-bad", "x", Duration::from_millis(2500)),
        ("berth-leader-bad", "", LEASE),
        ("", "x", LEASE),
    ] {
        let err = LeaderElection::start(client.clone(), NS, lease, identity, duration)
            .await
            .expect_err("invalid settings are refused");
        assert_eq!(err.metric_label(), "invalid_config", "{err}");
    }
}
