//! One MachineDeployment's reconcile: find its sets, make the current
//! template's set, take the next step of the rollout (`decide::step`),
//! taint the old Machines' Nodes, trim the revision history, and write the
//! status when it changed.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};

use super::Context;
use super::decide::{self, Facts, Failing, Hold, Observed, Pace};
use super::members::{Member, drains_everywhere, members, sum};
use crate::api::conditions::READY;
use crate::api::machinedeployment::conditions::PROGRESSING;
use crate::api::{
    CLASS_HASH_ANNOTATION, Machine, MachineDeployment, MachineSet, MachineSetSpec, MachineTemplate,
    REVISION_ANNOTATION, SUPERSEDED_ANNOTATION, TEMPLATE_HASH_LABEL,
};
use crate::controller::status::{StatusWrite, write_status};
use crate::machine::status::condition;
use crate::machineset::decide::{selector_string, selects};
use crate::machineset::observe::candidate;
use crate::machineset::order::{self, Candidate};

#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("MachineDeployment has no namespace or UID")]
    Incomplete,
    #[error("MachineSet {0} exists and is not this deployment's")]
    NameTaken(String),
    #[error("{what} MachineSet {set}: {source}")]
    Set {
        what: &'static str,
        set: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the status: {0}")]
    Status(#[source] kube::Error),
}

/// What the deployment's spec asks for, read once per reconcile.
struct Wanted {
    /// The hash naming the set of the current template and class (see
    /// [`decide::wanted_hash`]).
    hash: String,
    /// The [`decide::class_hash`] of the template's class, if it is known.
    class_hash: Option<String>,
    replicas: usize,
    pace: Pace,
    /// The template does not match the selector: nothing is made.
    mismatch: Option<String>,
}

impl Wanted {
    fn of(md: &MachineDeployment) -> Self {
        let rolling = md.spec.strategy.rolling_update.as_ref();
        Wanted {
            hash: decide::template_hash(&md.spec.template),
            class_hash: None,
            replicas: usize::try_from(md.spec.replicas).unwrap_or(0),
            pace: Pace::of(
                md.spec.replicas,
                rolling.and_then(|r| r.max_surge.as_ref()),
                rolling.and_then(|r| r.max_unavailable.as_ref()),
            ),
            mismatch: (!selects(&md.spec.selector, &md.spec.template.metadata.labels)).then(|| {
                format!(
                    "the selector ({}) does not match the template's labels: no MachineSet is made",
                    selector_string(&md.spec.selector)
                )
            }),
        }
    }
}

pub(crate) async fn reconcile(
    md: Arc<MachineDeployment>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let (Some(ns), Some(uid)) = (md.namespace(), md.uid()) else {
        return Err(Error::Incomplete);
    };
    if md.metadata.deletion_timestamp.is_some() {
        // The garbage collector deletes its sets, and they their Machines.
        return Ok(Action::await_change());
    }
    let now = Timestamp::now();
    let mut wanted = Wanted::of(&md);

    // The decision and its writes, one deployment at a time.
    let mut expectations = ctx.expectations.lock().await;
    if adopt_orphaned_sets(&md, &ns, &ctx).await? > 0 {
        // Their watch events bring them back as members.
        return Ok(Action::await_change());
    }
    let members = members(&md, &ns, &uid, &ctx, &mut expectations, now);
    // A class edited in place rolls the pool as a new template does.
    wanted.class_hash = ctx
        .caches
        .classes
        .get(&kube::runtime::reflector::ObjectRef::new(
            &md.spec.template.spec.class_ref.name,
        ))
        .map(|c| decide::class_hash(&c.spec));
    let recorded: Vec<(Option<&str>, Option<&str>)> = members
        .iter()
        .map(|m| {
            (
                m.set.labels().get(TEMPLATE_HASH_LABEL).map(String::as_str),
                m.set
                    .annotations()
                    .get(CLASS_HASH_ANNOTATION)
                    .map(String::as_str),
            )
        })
        .collect();
    wanted.hash = decide::wanted_hash(&wanted.hash, wanted.class_hash.as_deref(), &recorded);
    record_class(&members, &wanted, &ns, &ctx).await?;
    let (mut new, mut old): (Vec<Member>, Vec<Member>) = members
        .into_iter()
        .partition(|m| m.set.labels().get(TEMPLATE_HASH_LABEL) == Some(&wanted.hash));
    // Paused, or nothing can be made: no set is touched, and no Node is
    // tainted (a paused rollout does not start). Drains in progress finish
    // (they are the Machine controller's); nothing new starts.
    let held = if !md.spec.paused && wanted.mismatch.is_none() {
        // The old Nodes are tainted before any old Machine is asked to go,
        // so that no pod evicted in this rollout lands on one.
        taint_old_nodes(&new, &old, &ctx).await;
        roll(
            &md,
            &ns,
            &wanted,
            &mut new,
            &mut old,
            &ctx,
            &mut expectations,
        )
        .await?
    } else {
        None
    };
    drop(expectations);

    trim_history(&md, &ns, &mut old, &ctx).await;

    let observed = observe(&md, wanted, &new, &old, held);
    let current = md.status.clone().unwrap_or_default();
    let (status, next_change) = decide::next_status(&current, &observed, now);
    if status != current && !write(&md, &ns, &ctx, &current, &status).await? {
        return Ok(Action::await_change());
    }
    ctx.backoff.reset(&md);
    // Only the progress deadline is a timer; every other change arrives as
    // a watch event of a set, a Machine or a Node.
    Ok(next_change
        .and_then(|d| Duration::try_from(d).ok())
        .map_or_else(Action::await_change, |d| {
            Action::requeue(d + Duration::from_secs(1))
        }))
}

/// The rollout's next step: the current template's set made or scaled, and
/// old Machines asked to go. Returns what holds the rollout back, if
/// anything does.
async fn roll(
    md: &MachineDeployment,
    ns: &str,
    wanted: &Wanted,
    new: &mut [Member],
    old: &mut [Member],
    ctx: &Context,
    expectations: &mut super::Expectations,
) -> Result<Option<Hold>, Error> {
    let new_counts = new.first().map(|m| m.counts).unwrap_or_default();
    let old_counts = sum(old.iter().map(|m| m.counts));
    let drains = drains_everywhere(ctx, expectations);
    ctx.metrics
        .rollout_drains
        .set(i64::try_from(drains).unwrap_or(i64::MAX));
    let step = decide::step(&Facts {
        replicas: wanted.replicas,
        strategy: md.spec.strategy.type_,
        pace: wanted.pace,
        new: new_counts,
        old: old_counts,
        drains_everywhere: drains,
        drain_cap: ctx.drain_cap,
    });
    let next_revision = new
        .iter()
        .chain(old.iter())
        .map(|m| m.revision)
        .max()
        .unwrap_or(0)
        + 1;
    match new.first_mut() {
        None => {
            let created = create_set(md, ns, wanted, step.new_replicas, next_revision, ctx).await?;
            expectations.wrote(&created);
            let note = if old.is_empty() {
                format!(
                    "created MachineSet {} with {} Machines",
                    created.name_any(),
                    step.new_replicas
                )
            } else {
                format!(
                    "rollout of template {} started: created MachineSet {} (revision {next_revision}); {} old Machines to replace",
                    wanted.hash,
                    created.name_any(),
                    old_counts.active + old_counts.deleting
                )
            };
            event(
                ctx,
                md,
                "RolloutStarted",
                "CreateMachineSet",
                &note,
                Some(&created),
            );
        }
        Some(m) => {
            scale_new(
                md,
                ns,
                m,
                step.new_replicas,
                next_revision,
                ctx,
                expectations,
            )
            .await?
        }
    }
    let new_name = new
        .first()
        .map(Member::name)
        .unwrap_or_else(|| set_name(md, &wanted.hash));
    scale_old(md, ns, &new_name, old, step.delete_old, ctx, expectations).await?;
    // Held by its own pace, unless the drains it waits for wait for a
    // workload's move budget.
    let budget = |m: &Arc<Machine>| {
        let drain = m.status.as_ref().and_then(|s| s.drain.as_ref());
        m.metadata.deletion_timestamp.is_some()
            && drain.is_some_and(|d| d.finished_at.is_none() && d.waiting_for_budget.is_some())
    };
    let held_by_budget = old.iter().flat_map(|m| &m.machines).any(budget);
    Ok(match step.held {
        Some(Hold::DrainsAtOnce) if held_by_budget => Some(Hold::MoveBudget),
        held => held,
    })
}

/// The current template's set brought to `replicas` (and to the
/// deployment's `minReadySeconds`); a set an earlier rollout superseded
/// becomes the newest revision again (a rollback).
async fn scale_new(
    md: &MachineDeployment,
    ns: &str,
    m: &mut Member,
    replicas: usize,
    next_revision: i64,
    ctx: &Context,
    expectations: &mut super::Expectations,
) -> Result<(), Error> {
    let revision_behind = m.revision < next_revision - 1;
    let superseded = m.set.annotations().contains_key(SUPERSEDED_ANNOTATION);
    let min_ready_changed = m.set.spec.min_ready_seconds != md.spec.min_ready_seconds
        || m.set.spec.remediation != md.spec.remediation;
    if m.counts.replicas == replicas && !superseded && !revision_behind && !min_ready_changed {
        return Ok(());
    }
    let mut patch = serde_json::json!({
        "spec": {
            "replicas": replicas,
            "minReadySeconds": md.spec.min_ready_seconds,
            "remediation": md.spec.remediation,
        },
    });
    if superseded || revision_behind {
        // A rollback: an earlier template is current again.
        patch["metadata"] = serde_json::json!({"annotations": {
            SUPERSEDED_ANNOTATION: null,
            REVISION_ANNOTATION: next_revision.to_string(),
        }});
    }
    let written = patch_set(ctx, ns, &m.name(), patch, "scaling").await?;
    expectations.wrote(&written);
    if m.counts.replicas != replicas {
        event(
            ctx,
            md,
            "ScaledNewMachineSet",
            // Ups and downs apart: Events alike in reason, action and
            // objects fold into one series.
            if replicas > m.counts.replicas {
                "ScaleUp"
            } else {
                "ScaleDown"
            },
            &format!(
                "scaled MachineSet {} from {} to {}",
                m.name(),
                m.counts.replicas,
                replicas
            ),
            Some(&written),
        );
    }
    m.counts.replicas = replicas;
    Ok(())
}

/// What the status is computed from: the spec, the sets' counts, and the
/// first new Machine that is failing.
fn observe(
    md: &MachineDeployment,
    wanted: Wanted,
    new: &[Member],
    old: &[Member],
    held: Option<Hold>,
) -> Observed {
    let failing = new.first().and_then(|m| {
        m.active().find_map(|machine| {
            let status = machine.status.as_ref();
            let phase = status.and_then(|s| s.phase).map(|p| p.as_str());
            let ready = condition(status, READY);
            decide::failing(phase, ready.map(|c| c.reason.as_str())).then(|| Failing {
                machine: machine.name_any(),
                why: ready.map_or_else(
                    || "phase Failed".to_string(),
                    |c| format!("{}: {}", c.reason, c.message),
                ),
            })
        })
    });
    Observed {
        replicas: wanted.replicas,
        paused: md.spec.paused,
        hash: wanted.hash,
        selector: selector_string(&md.spec.selector),
        generation: md.metadata.generation,
        pace: wanted.pace,
        new: new.first().map(|m| m.counts).unwrap_or_default(),
        old: sum(old.iter().map(|m| m.counts)),
        held,
        failing,
        mismatch: wanted.mismatch,
        deadline: SignedDuration::from_secs(
            md.spec
                .progress_deadline_seconds
                .map_or(decide::DEFAULT_PROGRESS_DEADLINE, i64::from),
        ),
    }
}

/// The status written by compare-and-swap (see `crate::controller::status`)
/// and told by its Events once written. `false`: refused, the watch brings the newer
/// copy and the deployment is reconciled again on it.
async fn write(
    md: &MachineDeployment,
    ns: &str,
    ctx: &Context,
    current: &crate::api::MachineDeploymentStatus,
    status: &crate::api::MachineDeploymentStatus,
) -> Result<bool, Error> {
    let api = Api::<MachineDeployment>::namespaced(ctx.client.clone(), ns);
    match write_status(&api, md, status)
        .await
        .map_err(Error::Status)?
    {
        StatusWrite::Written(_) => {
            event_progressing(ctx, md, current, status);
            Ok(true)
        }
        StatusWrite::Conflict => {
            tracing::debug!(machinedeployment = %md.name_any(), namespace = ns, "status write refused: the deployment changed since it was read");
            Ok(false)
        }
    }
}

/// Adopts the MachineSets of this namespace that no controller owns and
/// that were made by a deployment of this selector (their labels match it,
/// with a template hash): a deployment deleted with its sets orphaned and
/// made again takes its sets and their Machines back, instead of stalling
/// on a set name that is taken. The owner reference is written on the set
/// as read (its resourceVersion), so a set another controller adopted in
/// between is left to it. How many were adopted.
async fn adopt_orphaned_sets(
    md: &MachineDeployment,
    ns: &str,
    ctx: &Context,
) -> Result<usize, Error> {
    let Some(owner) = md.controller_owner_ref(&()) else {
        return Ok(0);
    };
    let mut adopted = 0;
    for set in ctx.caches.sets.state() {
        if set.namespace().as_deref() != Some(ns)
            || set.metadata.deletion_timestamp.is_some()
            || set
                .owner_references()
                .iter()
                .any(|o| o.controller == Some(true))
            || !set.labels().contains_key(TEMPLATE_HASH_LABEL)
            || !selects(&md.spec.selector, set.labels())
        {
            continue;
        }
        let mut owners = set.owner_references().to_vec();
        owners.push(owner.clone());
        let patch = serde_json::json!({"metadata": {
            "ownerReferences": owners,
            "resourceVersion": set.resource_version(),
        }});
        match patch_set(ctx, ns, &set.name_any(), patch, "adopting").await {
            Ok(_) => {
                adopted += 1;
                ctx.events.normal(
                    md.object_ref(&()),
                    "Adopt",
                    "AdoptedMachineSet",
                    format!(
                        "adopted MachineSet {}, which no controller owned and whose labels this deployment's selector matches",
                        set.name_any()
                    ),
                    Some(set.object_ref(&())),
                );
            }
            // Changed in between (another controller's now): left to it.
            Err(Error::Set {
                source: kube::Error::Api(e),
                ..
            }) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(adopted)
}

/// Records the class on the current set when it does not say (a set
/// made before berth recorded classes): from now on an edit of the class
/// rolls the pool, and the upgrade itself rolled nothing.
async fn record_class(
    members: &[Member],
    wanted: &Wanted,
    ns: &str,
    ctx: &Context,
) -> Result<(), Error> {
    let Some(class) = &wanted.class_hash else {
        return Ok(());
    };
    for m in members {
        if m.set.labels().get(TEMPLATE_HASH_LABEL) == Some(&wanted.hash)
            && !m.set.annotations().contains_key(CLASS_HASH_ANNOTATION)
        {
            patch_set(
                ctx,
                ns,
                &m.set.name_any(),
                serde_json::json!({"metadata": {"annotations": {CLASS_HASH_ANNOTATION: class}}}),
                "recording the class of",
            )
            .await?;
        }
    }
    Ok(())
}

fn set_name(md: &MachineDeployment, hash: &str) -> String {
    format!("{}-{hash}", md.name_any())
}

/// Makes the set of the current template, named `<deployment>-<hash>` so
/// that a second attempt (a cache a step behind) finds it taken.
async fn create_set(
    md: &MachineDeployment,
    ns: &str,
    wanted: &Wanted,
    replicas: usize,
    revision: i64,
    ctx: &Context,
) -> Result<MachineSet, Error> {
    let hash = wanted.hash.as_str();
    let name = set_name(md, hash);
    let mut template: MachineTemplate = md.spec.template.clone();
    template
        .metadata
        .labels
        .insert(TEMPLATE_HASH_LABEL.into(), hash.into());
    let mut selector: LabelSelector = md.spec.selector.clone();
    selector
        .match_labels
        .get_or_insert_with(BTreeMap::new)
        .insert(TEMPLATE_HASH_LABEL.into(), hash.into());
    let set = MachineSet {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(ns.into()),
            labels: Some(template.metadata.labels.clone()),
            annotations: Some(
                [(REVISION_ANNOTATION.to_string(), revision.to_string())]
                    .into_iter()
                    .chain(
                        wanted
                            .class_hash
                            .clone()
                            .map(|c| (CLASS_HASH_ANNOTATION.to_string(), c)),
                    )
                    .collect(),
            ),
            owner_references: md.controller_owner_ref(&()).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        spec: MachineSetSpec {
            replicas: i32::try_from(replicas).unwrap_or(i32::MAX),
            selector,
            min_ready_seconds: md.spec.min_ready_seconds,
            template,
            remediation: md.spec.remediation.clone(),
        },
        status: None,
    };
    let api: Api<MachineSet> = Api::namespaced(ctx.client.clone(), ns);
    match api.create(&PostParams::default(), &set).await {
        Ok(created) => Ok(created),
        Err(kube::Error::Api(s)) if s.code == 409 => {
            let existing = api.get(&name).await.map_err(|source| Error::Set {
                what: "reading",
                set: name.clone(),
                source,
            })?;
            if existing
                .owner_references()
                .iter()
                .any(|o| o.controller == Some(true) && Some(o.uid.as_str()) == md.uid().as_deref())
            {
                Ok(existing)
            } else {
                Err(Error::NameTaken(name))
            }
        }
        Err(source) => Err(Error::Set {
            what: "creating",
            set: name,
            source,
        }),
    }
}

async fn patch_set(
    ctx: &Context,
    ns: &str,
    name: &str,
    patch: serde_json::Value,
    what: &'static str,
) -> Result<MachineSet, Error> {
    Api::<MachineSet>::namespaced(ctx.client.clone(), ns)
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .map_err(|source| Error::Set {
            what,
            set: name.into(),
            source,
        })
}

/// Marks the old sets superseded, lowers each to the Machines it still has
/// (so none is replaced by the old template), and takes `delete` more old
/// Machines away: those the deletion order puts first among all old
/// Machines not yet asked for, each by lowering its own set.
async fn scale_old(
    md: &MachineDeployment,
    ns: &str,
    new_name: &str,
    old: &mut [Member],
    delete: usize,
    ctx: &Context,
    expectations: &mut super::Expectations,
) -> Result<(), Error> {
    // The Machines each old set will delete already: its own first ones.
    let mut candidates: Vec<(usize, Candidate)> = Vec::new();
    for (i, m) in old.iter().enumerate() {
        let own: Vec<Candidate> = m.active().map(|x| candidate(x, &ctx.caches)).collect();
        let asked: HashSet<String> = order::choose(own.clone(), m.counts.asked_to_delete())
            .into_iter()
            .map(|c| c.name)
            .collect();
        candidates.extend(
            own.into_iter()
                .filter(|c| !asked.contains(&c.name))
                .map(|c| (i, c)),
        );
    }
    let chosen = order::choose(candidates.iter().map(|(_, c)| c.clone()).collect(), delete);
    let mut lower = vec![0usize; old.len()];
    let mut goes: Vec<Vec<&order::Chosen>> = vec![Vec::new(); old.len()];
    for c in &chosen {
        if let Some((i, _)) = candidates.iter().find(|(_, x)| x.name == c.name) {
            lower[*i] += 1;
            goes[*i].push(c);
        }
    }
    for (i, m) in old.iter_mut().enumerate() {
        let keep = m
            .counts
            .replicas
            .min(m.counts.active)
            .saturating_sub(lower[i]);
        let marked = m
            .set
            .annotations()
            .get(SUPERSEDED_ANNOTATION)
            .map(String::as_str)
            == Some(new_name);
        if keep == m.counts.replicas && marked {
            continue;
        }
        let patch = serde_json::json!({
            "metadata": {"annotations": {SUPERSEDED_ANNOTATION: new_name}},
            "spec": {"replicas": keep},
        });
        let written = patch_set(ctx, ns, &m.name(), patch, "scaling down").await?;
        expectations.wrote(&written);
        // One Event per Machine (an Event names one related object, and
        // Events that differ only in their note are folded into one).
        for c in &goes[i] {
            ctx.metrics.rollout_machines_replaced.inc();
            let machine = m.machines.iter().find(|x| x.name_any() == c.name);
            ctx.events.normal(
                md.object_ref(&()),
                "ScaleMachineSet",
                "ScaledOldMachineSet",
                format!(
                    "scaled old MachineSet {} from {} to {keep} so that Machine {} goes: {}",
                    m.name(),
                    m.counts.replicas,
                    c.name,
                    c.reason
                ),
                machine.map(|x| x.object_ref(&())),
            );
            tracing::info!(machinedeployment = %md.name_any(), machineset = %m.name(), machine = %c.name, why = c.why.as_str(), "old Machine goes for the rollout: {}", c.reason);
        }
        m.counts.replicas = keep;
    }
    Ok(())
}

/// `PreferNoSchedule` on the Nodes of the old Machines, none on the new
/// ones': the pods evicted from the first old Machines land on new ones,
/// not on old ones drained next. Best effort: a Node written in between
/// (a conflict) is tried again on its next event.
async fn taint_old_nodes(new: &[Member], old: &[Member], ctx: &Context) {
    let want = old.iter().flat_map(|m| m.active()).map(|m| (m, true));
    let drop = new.iter().flat_map(|m| m.active()).map(|m| (m, false));
    for (machine, tainted) in want.chain(drop) {
        let Some(node) = ctx.caches.node_of(machine) else {
            continue;
        };
        if let Err(e) = crate::machine::node::rollout_taint(&ctx.client, &node, tainted).await {
            tracing::debug!(node = %node.name_any(), error = %e, "rollout taint not written; next event retries");
        }
    }
}

/// Deletes old sets without Machines beyond `revisionHistoryLimit`, the
/// oldest revisions first.
async fn trim_history(md: &MachineDeployment, ns: &str, old: &mut Vec<Member>, ctx: &Context) {
    let limit = usize::try_from(
        md.spec
            .revision_history_limit
            .unwrap_or(decide::DEFAULT_HISTORY),
    )
    .unwrap_or(0);
    let mut empty: Vec<&Member> = old
        .iter()
        .filter(|m| m.counts.replicas == 0 && m.machines.is_empty())
        .collect();
    if empty.len() <= limit {
        return;
    }
    empty.sort_by_key(|m| m.revision);
    let gone: Vec<String> = empty[..empty.len() - limit]
        .iter()
        .map(|m| m.name())
        .collect();
    let api: Api<MachineSet> = Api::namespaced(ctx.client.clone(), ns);
    for name in &gone {
        let Some(m) = old.iter().find(|m| &m.name() == name) else {
            continue;
        };
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: m.set.uid(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(name, &dp).await {
            Ok(_) => {
                tracing::info!(machinedeployment = %md.name_any(), machineset = %name, "deleted an old MachineSet beyond the revision history")
            }
            Err(e) => {
                tracing::debug!(machineset = %name, error = %e, "old MachineSet not deleted; next reconcile retries")
            }
        }
    }
    old.retain(|m| !gone.contains(&m.name()));
}

/// Events for the transitions of `Progressing` an operator acts on.
fn event_progressing(
    ctx: &Context,
    md: &MachineDeployment,
    before: &crate::api::MachineDeploymentStatus,
    after: &crate::api::MachineDeploymentStatus,
) {
    let reason = |s: &crate::api::MachineDeploymentStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == PROGRESSING)
            .map(|c| (c.reason.clone(), c.message.clone()))
    };
    let (Some((now, message)), then) = (reason(after), reason(before)) else {
        return;
    };
    if then.as_ref().map(|(r, _)| r) == Some(&now) {
        return;
    }
    let warning = matches!(
        now.as_str(),
        "NewMachineFailed" | "ProgressDeadlineExceeded" | "SelectorMismatch"
    );
    if !warning && now != "RolloutComplete" {
        return;
    }
    if now == "RolloutComplete" && then.is_none() {
        // A deployment made complete from the start: nothing rolled.
        return;
    }
    let type_ = if warning {
        EventType::Warning
    } else {
        EventType::Normal
    };
    ctx.events
        .event(type_, md.object_ref(&()), "Rollout", &now, message, None);
}

/// A Normal Event on `md` (related to `set`, if any), logged too.
fn event(
    ctx: &Context,
    md: &MachineDeployment,
    reason: &str,
    action: &str,
    note: &str,
    set: Option<&MachineSet>,
) {
    tracing::info!(machinedeployment = %md.name_any(), namespace = md.namespace().unwrap_or_default(), reason, "{note}");
    ctx.events.normal(
        md.object_ref(&()),
        action,
        reason,
        note,
        set.map(|s| s.object_ref(&())),
    );
}
