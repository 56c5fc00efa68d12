//! Drains on a pool of fake Machines, shared by the drain test files: a test
//! bed with slow attach and detach, a class per pool, Running Machines, and
//! the Machine's Events read back as a timeline.

use std::time::Duration;

use berth::api::{DELETE_PRIORITY_ANNOTATION, Machine};
use berth::providers::fake::FakeProvider;
use berth_devkit::testbed::fixtures::{csi_pv, stateful_set};
use berth_devkit::testbed::{Options, TestBed, wait};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::OnceCell;

use super::{LONG, machine, phase};

/// The label a pool's Nodes carry (`testbed.berth.dev/pool: <pool>`).
pub use berth_devkit::testbed::fixtures::POOL_LABEL as POOL;

/// A test file's bed, by the delays of its CSI attacher: one control plane
/// for the test file, with simulated CSI attach and detach taking `attach`
/// and `detach` (the first call's values hold: the cases of a file share
/// it), and an audit log of the controller's requests (see
/// `support::audit`). A file names its own as a constant,
/// `const BED: Bed = Bed { attach: .., detach: .. };`, and begins its cases
/// with `Case::builder(ns).on(BED)`.
#[derive(Debug, Clone, Copy)]
pub struct Bed {
    pub attach: Duration,
    pub detach: Duration,
}

impl Bed {
    /// The file's control plane.
    pub async fn bed(self) -> &'static TestBed {
        static BED: OnceCell<TestBed> = OnceCell::const_new();
        super::init_logs();
        BED.get_or_init(|| {
            super::start_bed(
                Options::end_to_end()
                    .attach_delay(self.attach)
                    .detach_delay(self.detach),
            )
        })
        .await
    }

    /// An admin client of the bed.
    pub async fn client(self) -> Client {
        self.bed().await.client().await.expect("admin client")
    }
}

pub fn json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("valid object")
}

/// Creates `obj`, or keeps the one of that name.
pub async fn create<K>(api: Api<K>, obj: K)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let name = obj.name_any();
    berth_devkit::testbed::create_or_keep(api, obj)
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"));
}

/// A CSI driver the test bed serves with no attacher: its CSIDriver says
/// `attachRequired: false` (see [`attach_free_driver`]), so the
/// attach-detach controller never makes a VolumeAttachment for it.
pub const ATTACH_FREE_DRIVER: &str = "nfs.testbed.berth.dev";

/// Creates (if missing) CSIDriver `driver`, which attaches nothing
/// (`attachRequired: false`).
pub async fn attach_free_driver(client: &Client, driver: &str) {
    create(
        Api::<k8s_openapi::api::storage::v1::CSIDriver>::all(client.clone()),
        json(serde_json::json!({
            "metadata": {"name": driver},
            "spec": {"attachRequired": false}
        })),
    )
    .await;
}

/// [`csi_pv`] of CSI driver `driver`: PV `name` (volume `handle`),
/// pre-bound to claim `namespace/claim`.
pub fn csi_pv_on(
    driver: &str,
    name: &str,
    handle: &str,
    namespace: &str,
    claim: &str,
) -> k8s_openapi::api::core::v1::PersistentVolume {
    let mut pv = csi_pv(name, handle, namespace, claim);
    if let Some(csi) = pv.spec.as_mut().and_then(|s| s.csi.as_mut()) {
        csi.driver = driver.into();
    }
    pv
}

/// A pool of fake Machines: class `pool` whose Nodes carry the pool label.
pub async fn pool_class(client: &Client, pool: &str, drain: serde_json::Value) {
    let mut c = berth_devkit::testbed::fixtures::pool_class(pool, pool, drain);
    c.spec.creation_timeout = Some("2m".into());
    create(Api::all(client.clone()), c).await;
}

/// A Machine `name` of `class`, once Running; returns its Node's name.
pub async fn running_machine(client: &Client, ns: &str, name: &str, class: &str) -> String {
    running(client, ns, machine(name, class)).await
}

/// Creates `m` and waits until it runs; returns its Node's name.
pub async fn running(client: &Client, ns: &str, m: Machine) -> String {
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let name = m.name_any();
    machines
        .create(&PostParams::default(), &m)
        .await
        .expect("create machine");
    wait::for_one(machines, LONG, "Machine Running", |m| {
        m.name_any() == name && phase(m) == Some("Running")
    })
    .await
    .expect("the Machine runs");
    FakeProvider::node_name(ns, &name)
}

pub fn on_node(p: &Pod, node: &str) -> bool {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
}

pub fn pod_running(p: &Pod) -> bool {
    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// One Event: when, reason, note.
pub type Ev = (k8s_openapi::jiff::Timestamp, String, String);

/// Berth's Events about a Machine, oldest first, once its drain's last one
/// is in.
pub async fn events(client: &Client, ns: &str, machine: &str) -> Vec<Ev> {
    super::events_until(
        client,
        ns,
        machine,
        &["Drained", "DrainForced", "DrainFailed"],
    )
    .await
    .iter()
    .filter_map(|e| {
        let t = e.event_time.as_ref().map(|t| t.0)?;
        Some((
            t,
            e.reason.clone().unwrap_or_default(),
            e.note.clone().unwrap_or_default(),
        ))
    })
    .collect()
}

/// The first Event of `reason` whose note contains `needle`.
pub fn first<'a>(evs: &'a [Ev], reason: &str, needle: &str) -> Option<&'a Ev> {
    evs.iter()
        .find(|(_, r, n)| r == reason && n.contains(needle))
}

/// The Events as lines, for assertion messages.
pub fn log_of(evs: &[Ev]) -> String {
    evs.iter()
        .map(|(t, r, n)| format!("{t} {r}: {n}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The pre-terminate hook [`running_held`] puts on a Machine: it keeps the
/// Machine (and its Node's pods) after its drain, to be looked at, until
/// [`release_hook`].
pub const HOOK: &str = "pre-terminate.delete.hook.berth.dev/test";

/// A Running Machine of `class`, optionally held after its drain by
/// [`HOOK`]; returns its Node's name.
pub async fn running_held(
    client: &Client,
    ns: &str,
    name: &str,
    class: &str,
    hold: bool,
) -> String {
    let mut m = machine(name, class);
    if hold {
        m.metadata
            .annotations
            .get_or_insert_default()
            .insert(HOOK.into(), "true".into());
    }
    running(client, ns, m).await
}

/// Removes [`HOOK`] from Machine `name`.
pub async fn release_hook(client: &Client, ns: &str, name: &str) {
    Api::<Machine>::namespaced(client.clone(), ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {HOOK: null}}})),
        )
        .await
        .expect("release the hook");
}

/// What `berth plan` prints for Machine `ns/machine` (the plan part).
pub async fn plan_text(client: &Client, ns: &str, machine: &str) -> String {
    berth::cli::plan::plan_machine(client, ns, machine)
        .await
        .expect("plan")
        .plan
        .to_string()
}

pub fn assert_contains(text: &str, parts: &[&str]) {
    for p in parts {
        assert!(text.contains(p), "lacks {p:?}:\n{text}");
    }
}

pub async fn delete_machine(client: &Client, ns: &str, name: &str) {
    Api::<Machine>::namespaced(client.clone(), ns)
        .delete(name, &DeleteParams::default())
        .await
        .expect("delete machine");
}

/// Waits, up to `within`, for Machine `name` to be gone.
pub async fn gone(client: &Client, ns: &str, name: &str, within: Duration) {
    wait::for_none(
        Api::<Machine>::namespaced(client.clone(), ns),
        within,
        &format!("{name} gone"),
        |m| m.name_any() == name,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Waits until the pods `names` of `ns` are Running.
pub async fn running_pods(client: &Client, ns: &str, names: &[&str]) {
    wait::until(
        Api::<Pod>::namespaced(client.clone(), ns),
        LONG,
        &format!("pods {names:?} running"),
        |ps| {
            names.iter().all(|n| {
                ps.iter().any(|p| {
                    p.name_any() == *n
                        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                })
            })
        },
    )
    .await
    .expect("pods run");
}

/// A pod `db-0` on `node` in `ns` with a volume: a pre-bound claim `data`
/// to a CSI PV; returns once it runs and its claim is Bound (the drain
/// cost counts bound claims only).
pub async fn stateful_pod(client: &Client, ns: &str, node: &str) {
    let pv = format!("{ns}-data");
    create(
        Api::all(client.clone()),
        csi_pv(&pv, &format!("vol-{pv}"), ns, "data"),
    )
    .await;
    create(
        Api::namespaced(client.clone(), ns),
        json::<PersistentVolumeClaim>(serde_json::json!({
            "metadata": {"name": "data"},
            "spec": {
                "accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}}
            }
        })),
    )
    .await;
    create(
        Api::namespaced(client.clone(), ns),
        json::<Pod>(serde_json::json!({
            "metadata": {"name": "db-0"},
            "spec": {
                "nodeName": node,
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": "registry.invalid/db:1",
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]
            }
        })),
    )
    .await;
    wait::for_one(
        Api::<Pod>::namespaced(client.clone(), ns),
        LONG,
        "db-0 Running",
        |p| p.name_any() == "db-0" && pod_running(p),
    )
    .await
    .expect("the stateful pod runs");
    // Its claim is bound (the drain cost counts bound claims only).
    wait::for_one(
        Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns),
        LONG,
        "claim data Bound",
        |c| {
            c.name_any() == "data"
                && c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
        },
    )
    .await
    .expect("the claim binds");
}

/// A StatefulSet `name` of `replicas` pods kept to the Nodes of pool `ns`,
/// each with a volume: a pre-bound CSI PV per replica; with an optional
/// priority class.
pub async fn stateful_in_pool(
    client: &Client,
    ns: &str,
    name: &str,
    replicas: i32,
    priority: Option<&str>,
) {
    stateful(client, ns, name, replicas, |sts| {
        if let Some(spec) = sts.spec.template.spec.as_mut() {
            spec.priority_class_name = priority.map(String::from);
        }
    })
    .await;
}

/// A StatefulSet `name` of `replicas` pods kept to the Nodes of pool `ns`,
/// each with a pre-bound CSI PV `<ns>-<name>-<i>`; `adjust` changes it
/// before it is created.
pub async fn stateful(
    client: &Client,
    ns: &str,
    name: &str,
    replicas: i32,
    adjust: impl FnOnce(&mut k8s_openapi::api::apps::v1::StatefulSet),
) {
    for i in 0..replicas {
        let pv = format!("{ns}-{name}-{i}");
        create(
            Api::all(client.clone()),
            csi_pv(&pv, &format!("vol-{pv}"), ns, &format!("data-{name}-{i}")),
        )
        .await;
    }
    let mut sts = stateful_set(name, replicas, 1);
    if let Some(spec) = sts.spec.template.spec.as_mut() {
        spec.node_selector = Some([(POOL.to_string(), ns.to_string())].into());
    }
    adjust(&mut sts);
    create(Api::namespaced(client.clone(), ns), sts).await;
}

/// Makes three Machines of a pool tell apart for a scale-down to one:
/// `marked` (the first) gets `berth.dev/delete-priority: 10`, `stateful`
/// (the second) runs a pod with an attached volume, the third runs
/// nothing.
pub async fn mark_for_scale_down(client: &Client, ns: &str, machines: &[Machine]) {
    Api::<Machine>::namespaced(client.clone(), ns)
        .patch(
            &machines[0].name_any(),
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": {"annotations": {DELETE_PRIORITY_ANNOTATION: "10"}}
            })),
        )
        .await
        .expect("annotate");
    stateful_pod(
        client,
        ns,
        &FakeProvider::node_name(ns, &machines[1].name_any()),
    )
    .await;
}

/// Checks the scale-down Events' `notes` (from 3 to 1, after
/// [`mark_for_scale_down`]): the marked Machine went for its priority, the
/// plain one for its drain, cheaper than the stateful one's.
pub fn assert_scale_down_reasons(notes: &[String], machines: &[Machine]) {
    let (marked, stateful, plain) = (&machines[0], &machines[1], &machines[2]);
    let about = |m: &Machine| {
        notes
            .iter()
            .find(|n| n.contains(&format!("deleted Machine {} ", m.name_any())))
            .unwrap_or_else(|| panic!("no ScaledDown for {}: {notes:?}", m.name_any()))
            .clone()
    };
    let why_marked = about(marked);
    assert!(
        why_marked.contains("scale from 3 to 1")
            && why_marked.contains(&format!("{DELETE_PRIORITY_ANNOTATION} 10")),
        "{why_marked}"
    );
    let why_plain = about(plain);
    assert!(
        why_plain.contains("cheapest drain: 0 stateful pods")
            && why_plain.contains(&format!("{}: 1 stateful pod", stateful.name_any())),
        "{why_plain}"
    );
}

/// The label of a blocker pod (see [`refusing_spare`]).
pub const BLOCKER: &str = "testbed.berth.dev/blocker";

/// A Running Machine `name` of class `class` whose Node runs a blocker
/// pod, beside which a pod that [`shuns_blocker`] may not run: a Node
/// berth's destination check accepts (it reads no pod affinity) and the
/// scheduler refuses such a pod on, so that its replacement cannot be
/// placed after its eviction. Returns the Node's name.
pub async fn refusing_spare(client: &Client, ns: &str, name: &str, class: &str) -> String {
    let node = running_machine(client, ns, name, class).await;
    let blocker = format!("blocker-{name}");
    create(
        Api::<Pod>::namespaced(client.clone(), ns),
        json(serde_json::json!({
            "metadata": {"name": blocker, "labels": {BLOCKER: "true"}},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "b", "image": "registry.invalid/blocker:1"}]}
        })),
    )
    .await;
    running_pods(client, ns, &[&blocker]).await;
    node
}

/// Keeps the pods of `spec` off every Node that runs a blocker pod (see
/// [`refusing_spare`]): a required pod anti-affinity term, beside those
/// it has.
pub fn shuns_blocker(spec: &mut k8s_openapi::api::core::v1::PodSpec) {
    let term = json(serde_json::json!({
        "labelSelector": {"matchLabels": {BLOCKER: "true"}},
        "topologyKey": "kubernetes.io/hostname"
    }));
    spec.affinity
        .get_or_insert_default()
        .pod_anti_affinity
        .get_or_insert_default()
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_default()
        .push(term);
}
