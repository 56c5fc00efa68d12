//! `berth plan`: the drain that would happen now, read from a live cluster
//! without changing anything. It lists what the engine reads from its
//! caches and feeds the same pure `plan` function, so the plan printed and
//! the drain performed cannot disagree.

use k8s_openapi::api::core::v1::{Namespace, Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::{CSIDriver, VolumeAttachment};
use kube::Client;
use kube::api::{Api, ListParams};

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use super::print::{in_progress, remediation};
use crate::api::settings::resolve;
use crate::api::{DrainRule, Machine, MachineClass};
use crate::drain::cluster_rules::{RuleBook, namespace_labels, validate};
use crate::drain::ledger::workload::{controller, workload_of};
use crate::drain::ledger::{
    Answer, Asker, Ledger, MOVE_GROUP_ANNOTATION, PodAsk, Workload, WorkloadFacts, WorkloadTerms,
    held_permit, lined_ask, moves_in, planned_ask, recorded_moves,
};
use crate::drain::plan::{DrainPlan, plan};
use crate::drain::select::{fmt_key, pod_key};
use crate::drain::volume_kind::{VolumeContext, allows_data_loss};

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("Machine {0} not found")]
    MachineNotFound(String),
    #[error("Machine {0} has no Node (status.nodeRef is empty): there is nothing to drain")]
    NoNode(String),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// What `berth plan` prints: the Machine's plan and its Node, and the
/// notes that go with it (see [`LivePlan::notes`]).
pub struct LivePlan {
    pub machine: Machine,
    pub plan: DrainPlan,
    /// Why the settings are not the class's, when they are not (the class
    /// is missing or invalid: the drain then uses the Machine's own
    /// `spec.drain` over the built-in defaults, as the controller does).
    pub settings_note: Option<String>,
    /// The cluster's DrainRules the drain does not apply because they
    /// are invalid, each with why.
    pub rule_notes: Vec<String>,
    /// Each stateful pod's workload, its move budget and what its move
    /// would wait for now, across every Machine's drain.
    pub budgets: Vec<String>,
    /// Where each stateful pod's replacement can run, or why nowhere (see
    /// `destinations`).
    pub destinations: Vec<String>,
    /// For each pod whose PodDisruptionBudget lets none go now, the surge
    /// its drain would make before it goes, or why none (see `surges`).
    pub surges: Vec<String>,
}

impl LivePlan {
    /// The lines printed before the plan: where the settings come from
    /// when not from the class, the remediation of a Machine whose Node
    /// died (or why none), and the drain in progress, if any, as
    /// `status.drain` records it.
    pub fn notes(&self) -> String {
        let mut out = String::new();
        if let Some(n) = &self.settings_note {
            out.push_str(&format!("Settings: {n}\n"));
        }
        for n in &self.rule_notes {
            out.push_str(&format!("DrainRules: {n}\n"));
        }
        if let Some(s) = self.machine.status.as_ref() {
            out.push_str(&remediation(s));
        }
        if let Some(d) = self.machine.status.as_ref().and_then(|s| s.drain.as_ref()) {
            out.push_str(&in_progress(d));
        }
        out
    }

    /// The section printed after the plan: the move ledger's view of each
    /// stateful pod, in the plan's order.
    pub fn budgets(&self) -> String {
        if self.budgets.is_empty() {
            return String::new();
        }
        let mut out = String::from(
            "\nMove budgets, across every Machine's drain (the move ledger: the MovePermits every berth process holds, and every Machine's status.drain.moves):\n",
        );
        for line in &self.budgets {
            out.push_str(&format!("  {line}\n"));
        }
        out
    }

    /// The section of the surges: each pod whose budget lets none go now,
    /// and whether its replacement would be made first.
    pub fn surges(&self) -> String {
        if self.surges.is_empty() {
            return String::new();
        }
        let mut out = String::from(
            "\nSurges before evict, for pods whose PodDisruptionBudget lets none go now (their Deployment makes the new pod first, and removes the old one once it is available):\n",
        );
        for line in &self.surges {
            out.push_str(&format!("  {line}\n"));
        }
        out
    }

    /// The section printed last: each stateful pod's destination, which
    /// the drain finds before it evicts the pod.
    pub fn destinations(&self) -> String {
        if self.destinations.is_empty() {
            return String::new();
        }
        let mut out = String::from(
            "\nDestinations, found before each stateful eviction (Ready, uncordoned, not draining, tolerated, in the volumes' zone, CSI driver registered, a free attach slot, room for the requests):\n",
        );
        for line in &self.destinations {
            out.push_str(&format!("  {line}\n"));
        }
        out
    }
}

/// What the cluster says of the workloads of a plan's pods, as read for
/// `berth plan`.
#[derive(Debug, Default)]
pub struct KnownWorkloads {
    /// The owners of a ReplicaSet, by namespace and name.
    pub rs_owners: BTreeMap<(String, String), Vec<OwnerReference>>,
    /// What each workload object says of its moves.
    pub terms: BTreeMap<Workload, WorkloadTerms>,
    /// The terms of every member of each move group, by namespace and
    /// group.
    pub groups: BTreeMap<(String, String), Vec<WorkloadTerms>>,
}

/// What `berth plan` read, as the ledger reads a pod's workload: the
/// owner's status is its availability (the controller counts it from the
/// pods of its caches, see [`WorkloadFacts::counted`]), and a planned pod's
/// attachable PVs are the plan's.
impl WorkloadFacts for KnownWorkloads {
    fn replica_set_owners(&self, ns: &str, name: &str) -> Option<Vec<OwnerReference>> {
        self.rs_owners
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
    }

    fn terms(&self, w: &Workload) -> WorkloadTerms {
        self.terms.get(w).cloned().unwrap_or_default()
    }

    fn group_members(&self, ns: &str, group: &str) -> Vec<WorkloadTerms> {
        self.groups
            .get(&(ns.to_string(), group.to_string()))
            .cloned()
            .unwrap_or_default()
    }

    fn counted(&self, _: &Workload, terms: WorkloadTerms) -> WorkloadTerms {
        terms
    }

    /// Never asked: `berth plan` asks for planned pods only.
    fn attached(&self, _: &str, _: &[String]) -> Vec<String> {
        Vec::new()
    }
}

/// What the move ledger would answer for each stateful pod of `plan`, in
/// its order, as if its drain asked now (`ledger`: rebuilt from every
/// Machine's records; a pod granted here counts against the ones after
/// it). `pods` are the Node's pods.
pub fn budget_lines(
    plan: &DrainPlan,
    pods: &[Pod],
    mut ledger: Ledger,
    machine: &str,
    requested: k8s_openapi::jiff::Timestamp,
    known: &KnownWorkloads,
) -> Vec<String> {
    let now = k8s_openapi::jiff::Timestamp::now();
    let mut out = Vec::new();
    for p in &plan.stateful {
        let Some(pod) = pods
            .iter()
            .find(|x| x.metadata.uid == p.uid && pod_key(x) == p.pod)
        else {
            continue;
        };
        let key = fmt_key(&p.pod);
        let drain = Asker {
            machine: machine.to_string(),
            requested,
            past_deadline: false,
            moves_left: moves_in(plan),
        };
        let PodAsk {
            workload,
            budget,
            terms,
            bad,
            ask,
            ..
        } = planned_ask(known, p, Some(pod), None, &drain);
        let Some(ask) = ask else {
            // Never for a stateful pod: its volumes move.
            continue;
        };
        let limit = budget
            .max_moving
            .map_or_else(|| "no limit".to_string(), |n| format!("at most {n} moving"));
        let verdict = match ledger.ask(&ask, &budget, now) {
            Answer::Granted(permit) if permit.machine == machine && permit.since < now => {
                format!("moving now (since {})", permit.since)
            }
            Answer::Granted(_) | Answer::Bypassed { .. } => "may move now".to_string(),
            Answer::Wait {
                moving,
                ahead,
                degraded,
            } => {
                let mut by: Vec<String> = moving
                    .iter()
                    .map(|m| {
                        if m.machine == machine {
                            format!("{} moves first, from this Machine", m.pod)
                        } else {
                            format!("{} is moving, from Machine {}", m.pod, m.machine)
                        }
                    })
                    .collect();
                if degraded > 0 {
                    let a = terms.availability.unwrap_or_default();
                    by.push(format!(
                        "{} of {} replicas unavailable, {degraded} down besides berth's moves",
                        a.unavailable, a.replicas
                    ));
                }
                let mut v = format!("would wait: {}", by.join(", "));
                if !ahead.is_empty() {
                    v.push_str(&format!("; {} go first", ahead.join(", ")));
                }
                v
            }
            Answer::Capped { in_flight, cap } => {
                format!("would wait: {in_flight} volume moves in flight, berth's cap of {cap}")
            }
            // Said by a process's permit store only, never by the ledger.
            Answer::Contended { .. } => "would wait: its permit is being taken".to_string(),
        };
        let mut line = format!("{key}: {workload}, {limit}: {verdict}");
        for b in bad {
            line.push_str(&format!(" (ignored: {b})"));
        }
        out.push(line);
    }
    out
}

/// Plans the drain of Machine `namespace/name` from fresh lists.
///
/// # Errors
/// A missing Machine, Node reference or class; invalid settings; API errors.
pub async fn plan_machine(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<LivePlan, PlanError> {
    let machine = Api::<Machine>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await?
        .ok_or_else(|| PlanError::MachineNotFound(format!("{namespace}/{name}")))?;
    let node = machine
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| r.name.clone())
        .ok_or_else(|| PlanError::NoNode(format!("{namespace}/{name}")))?;
    // As the controller does: a class that is missing or invalid never
    // drops the Machine's own settings.
    let class_name = &machine.spec.class_ref.name;
    let class = Api::<MachineClass>::all(client.clone())
        .get_opt(class_name)
        .await?;
    let own = || resolve(machine.spec.drain.as_ref(), None, None, None).unwrap_or_default();
    let (settings, settings_note) = match &class {
        None => (
            own(),
            Some(format!(
                "MachineClass {class_name:?} not found: the drain uses the Machine's own spec.drain over the built-in defaults"
            )),
        ),
        Some(c) => match resolve(
            machine.spec.drain.as_ref(),
            c.spec.drain.as_ref(),
            c.spec.creation_timeout.as_deref(),
            c.spec.health_timeout.as_deref(),
        ) {
            Ok(s) => (s, None),
            Err(e) => (
                own(),
                Some(format!(
                    "the drain settings of MachineClass {class_name:?} are invalid ({e}): the drain uses the Machine's own spec.drain over the built-in defaults"
                )),
            ),
        },
    };

    let lp = ListParams::default();
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?
        .items;
    let pvcs = Api::<PersistentVolumeClaim>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let pvs = Api::<PersistentVolume>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let pdbs = Api::<PodDisruptionBudget>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let vas = Api::<VolumeAttachment>::all(client.clone())
        .list(&lp)
        .await?
        .items;
    let drivers = Api::<CSIDriver>::all(client.clone()).list(&lp).await?.items;
    let node_obj = Api::<Node>::all(client.clone()).get_opt(&node).await?;
    let volumes = VolumeContext::new(&node, node_obj.as_ref(), &drivers)
        .allowing_data_loss(allows_data_loss(machine.metadata.annotations.as_ref()));
    let (book, rule_notes) = rule_book(client, &machine).await?;
    let plan = plan(
        &node, &pods, &pvcs, &pvs, &pdbs, &vas, &volumes, &settings, &book,
    );
    let budgets = ledger_view(client, &machine, &plan, &pods).await?;
    let listed = super::destinations::Volumes {
        pvcs: &pvcs,
        pvs: &pvs,
        drivers: &drivers,
    };
    let destinations =
        super::destinations::destination_lines(client, &plan, &pods, &settings, &listed).await?;
    let surges = super::surges::surge_lines(client, &machine, &node, &plan, &pods, &pvcs).await?;
    Ok(LivePlan {
        machine,
        plan,
        settings_note,
        rule_notes,
        budgets,
        destinations,
        surges,
    })
}

/// The cluster's DrainRules as `machine`'s drain applies them, and a note
/// for each it does not (invalid). No DrainRule kind installed (a chart
/// older than it): none.
async fn rule_book(
    client: &Client,
    machine: &Machine,
) -> Result<(RuleBook, Vec<String>), PlanError> {
    let lp = ListParams::default();
    let rules = match Api::<DrainRule>::all(client.clone()).list(&lp).await {
        Ok(l) => l.items,
        Err(kube::Error::Api(e)) if e.code == 404 => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    let notes = rules
        .iter()
        .filter_map(|r| {
            validate(&r.spec).err().map(|why| {
                format!(
                    "{} is invalid and applies to nothing: {why}",
                    r.metadata.name.as_deref().unwrap_or_default()
                )
            })
        })
        .collect();
    let namespaces = match rules.is_empty() {
        true => BTreeMap::new(),
        false => namespace_labels(&Api::<Namespace>::all(client.clone()).list(&lp).await?.items),
    };
    let labels = machine.metadata.labels.clone().unwrap_or_default();
    Ok((RuleBook::new(&rules, &labels, namespaces), notes))
}

/// [`budget_lines`] from fresh lists: every Machine's records, and the
/// owners of the ReplicaSets that control the plan's stateful pods. The
/// controller's cap on moves in flight is not known here (a flag of `berth
/// run`): the lines say what each workload's budget allows.
async fn ledger_view(
    client: &Client,
    machine: &Machine,
    plan: &DrainPlan,
    pods: &[Pod],
) -> Result<Vec<String>, PlanError> {
    if plan.stateful.is_empty() {
        return Ok(Vec::new());
    }
    let machines = Api::<Machine>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let mut ledger = Ledger::rebuild(recorded_moves(&machines));
    // The permits every berth process holds in the API server.
    let permits = Api::<crate::api::MovePermit>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    ledger.set_held(permits.iter().filter_map(held_permit));
    let known = known_workloads(client, pods).await?;
    let key = format!(
        "{}/{}",
        machine.metadata.namespace.as_deref().unwrap_or_default(),
        machine.metadata.name.as_deref().unwrap_or_default()
    );
    // The asks every berth process keeps in line but this Machine's: a
    // release without the kind (or a reader not allowed it) shows none.
    let asks = Api::<crate::api::MoveAsk>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    ledger.set_lined(
        asks.iter()
            .filter(|a| a.spec.machine != key)
            .filter_map(lined_ask),
    );
    let requested = machine
        .metadata
        .deletion_timestamp
        .as_ref()
        .map_or_else(k8s_openapi::jiff::Timestamp::now, |t| t.0);
    Ok(budget_lines(plan, pods, ledger, &key, requested, &known))
}

/// Reads what the cluster says of the workloads of `pods`: each
/// ReplicaSet's owners, and each StatefulSet's, Deployment's or
/// ReplicaSet's annotations and `minReadySeconds`.
async fn known_workloads(client: &Client, pods: &[Pod]) -> Result<KnownWorkloads, PlanError> {
    let mut known = KnownWorkloads::default();
    for pod in pods {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let Some(c) = controller(pod.metadata.owner_references.as_deref()) else {
            continue;
        };
        if c.kind != "ReplicaSet" || known.rs_owners.contains_key(&(ns.clone(), c.name.clone())) {
            continue;
        }
        let rs = Api::<ReplicaSet>::namespaced(client.clone(), &ns)
            .get_metadata_opt(&c.name)
            .await?;
        if let Some(rs) = rs {
            known.terms.insert(
                Workload::new("ReplicaSet", &ns, &c.name),
                crate::drain::ledger::workload::terms(&rs.metadata, None),
            );
            known.rs_owners.insert(
                (ns, c.name.clone()),
                rs.metadata.owner_references.unwrap_or_default(),
            );
        }
    }
    for pod in pods {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let w = workload_of(pod, |rs| {
            known.rs_owners.get(&(ns.clone(), rs.to_string())).cloned()
        });
        if known.terms.contains_key(&w) {
            continue;
        }
        let terms = match w.kind.as_str() {
            "StatefulSet" => Api::<StatefulSet>::namespaced(client.clone(), &ns)
                .get_opt(&w.name)
                .await?
                .map(|s| crate::drain::ledger::workload::stateful_set_terms(&s)),
            "Deployment" => Api::<Deployment>::namespaced(client.clone(), &ns)
                .get_opt(&w.name)
                .await?
                .map(|d| crate::drain::ledger::workload::deployment_terms(&d)),
            _ => None,
        };
        if let Some(t) = terms {
            if let Some(group) = t.annotations.get(MOVE_GROUP_ANNOTATION) {
                let key = (ns.clone(), group.trim().to_string());
                if let std::collections::btree_map::Entry::Vacant(e) = known.groups.entry(key) {
                    let members = group_members(client, &ns, &e.key().1).await?;
                    e.insert(members);
                }
            }
            known.terms.insert(w, t);
        }
    }
    Ok(known)
}

/// The terms of every StatefulSet and Deployment of namespace `ns` whose
/// object names move group `group`.
async fn group_members(
    client: &Client,
    ns: &str,
    group: &str,
) -> Result<Vec<WorkloadTerms>, PlanError> {
    let named = |a: Option<&BTreeMap<String, String>>| {
        a.and_then(|a| a.get(MOVE_GROUP_ANNOTATION))
            .is_some_and(|g| g.trim() == group)
    };
    let sets = Api::<StatefulSet>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items;
    let deployments = Api::<Deployment>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items;
    let mut members: Vec<WorkloadTerms> = sets
        .iter()
        .filter(|s| named(s.metadata.annotations.as_ref()))
        .map(crate::drain::ledger::workload::stateful_set_terms)
        .collect();
    members.extend(
        deployments
            .iter()
            .filter(|d| named(d.metadata.annotations.as_ref()))
            .map(crate::drain::ledger::workload::deployment_terms),
    );
    Ok(members)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_section_says_what_each_stateful_pod_would_wait_for() {
        use crate::drain::fixtures::{NODE, PodFixture, csi_pv, pod, pvc};
        use crate::drain::ledger::{Permit, Workload};
        let pods = vec![
            pod("db", "db-0")
                .owned_by("StatefulSet", "db", true)
                .claim("data", "data-db-0"),
            pod("db", "db-1")
                .owned_by("StatefulSet", "db", true)
                .claim("data", "data-db-1"),
            pod("db", "cache-1")
                .owned_by("StatefulSet", "cache", true)
                .claim("data", "data-cache-1"),
            pod("db", "web-1")
                .owned_by("ReplicaSet", "web-5d8f", true)
                .claim("data", "data-web-1"),
        ];
        let pvcs: Vec<_> = ["db-0", "db-1", "cache-1", "web-1"]
            .iter()
            .map(|p| pvc("db", &format!("data-{p}"), Some(&format!("pv-{p}"))))
            .collect();
        let pvs: Vec<_> = ["db-0", "db-1", "cache-1", "web-1"]
            .iter()
            .map(|p| csi_pv(&format!("pv-{p}"), "ebs.csi.aws.com", p))
            .collect();
        let volumes = VolumeContext::new(NODE, None, &[]);
        let plan = plan(
            NODE,
            &pods,
            &pvcs,
            &pvs,
            &[],
            &[],
            &volumes,
            &crate::api::settings::ResolvedSettings::default(),
            &RuleBook::default(),
        );
        // cache-0 is moving from Machine b; the ReplicaSet is Deployment
        // web's.
        let ledger = Ledger::rebuild([(
            Workload::new("StatefulSet", "db", "cache"),
            Permit {
                pod: "db/cache-0".into(),
                uid: "uid-cache-0".into(),
                machine: "db/b".into(),
                since: crate::drain::fixtures::ts(1_700_000_000),
                past_budget: false,
                volumes: true,
                attach: vec![],
                destination: None,
            },
        )]);
        let owners = BTreeMap::from([(
            ("db".to_string(), "web-5d8f".to_string()),
            vec![OwnerReference {
                api_version: "apps/v1".into(),
                kind: "Deployment".into(),
                name: "web".into(),
                uid: "uid-web".into(),
                controller: Some(true),
                block_owner_deletion: None,
            }],
        )]);
        // The StatefulSet cache says, on its object, that two may move.
        let known = KnownWorkloads {
            rs_owners: owners,
            terms: BTreeMap::from([(
                Workload::new("StatefulSet", "db", "cache"),
                WorkloadTerms {
                    annotations: BTreeMap::from([(
                        crate::drain::ledger::MAX_MOVING_ANNOTATION.to_string(),
                        "2".to_string(),
                    )]),
                    min_ready: std::time::Duration::ZERO,
                    availability: None,
                    max_unavailable: None,
                },
            )]),
            groups: BTreeMap::new(),
        };
        let lines = budget_lines(
            &plan,
            &pods,
            ledger,
            "db/a",
            crate::drain::fixtures::ts(1_700_000_100),
            &known,
        );
        assert_eq!(
            lines,
            vec![
                "db/cache-1: StatefulSet db/cache, at most 2 moving: may move now",
                "db/db-0: StatefulSet db/db, at most 1 moving: may move now",
                "db/db-1: StatefulSet db/db, at most 1 moving: would wait: db/db-0 moves first, from this Machine",
                "db/web-1: Deployment db/web, at most 1 moving: may move now",
            ]
        );
    }
}
