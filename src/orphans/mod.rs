//! Orphan-VM collection: deletes the VMs this cluster owns that no Machine
//! has, such as the VM of a create that returned after its Machine was
//! deleted, or one left by a controller that crashed between the cloud's
//! answer and the write of the providerID.
//!
//! It works on the provider interface alone, so every driver gets it: at
//! start and then every `--orphan-interval`, for each enabled driver and
//! each MachineClass naming it, it asks the driver's `list` for the VMs of
//! this cluster where that class points (a VM listed for several classes is
//! judged once), judges each against the controller's Machine cache
//! (`decide`), and asks the driver's `delete` for each orphan older than
//! `--orphan-grace`, or only reports it under `--orphan-dry-run`.
//!
//! It runs only on the leader, beside the Machine controller, and reads the
//! controller's own caches of Machines and MachineClasses: its only
//! requests are the drivers' `list` and `delete` and its Events. Its first
//! round waits for the Machine cache's first complete list, without which
//! every VM would look like an orphan. It never deletes a VM whose tags do
//! not name a Machine, whose age the provider does not give, whose Machine
//! (by providerID or by UID) is in the cache, or whose Node still runs pods
//! (held and named: never terminated without a drain; an empty Node goes
//! with its VM); a round that finds more orphans than a tenth of the fleet
//! (at least five) collects none and says so. It never stops on an error:
//! a failed list or delete is logged, counted, and tried again the next
//! round.

pub(crate) mod decide;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};

use crate::api::{Machine, MachineClass};
use crate::cache::Caches;
use crate::providers::Registry;
use crate::providers::{ListRequest, MachineRef, MachineRequest, Provider, ProviderError, Vm};
use crate::telemetry::events::EventSink;
use crate::telemetry::{Metrics, OrphanOutcome};
use decide::{Machines, Once, Rules, Tally, Verdict};

/// The `berth run` flags of orphan collection.
#[derive(Debug, Clone, clap::Args)]
pub struct OrphanArgs {
    /// How often to look for orphan VMs (VMs tagged for a Machine of this
    /// cluster that no Machine has), once at start and then at this
    /// interval; `0` turns orphan collection off. Each round lists the VMs
    /// once per MachineClass, through the provider's API.
    #[arg(long, env = "BERTH_ORPHAN_INTERVAL", default_value = "10m", value_parser = humantime::parse_duration)]
    pub orphan_interval: Duration,
    /// How old an orphan VM must be before it is deleted. It covers what
    /// the Machine cache cannot see yet: a VM whose Machine was just
    /// created by another replica or restored from a backup, a cloud whose
    /// listing lags its creates, clocks that disagree. A VM the provider
    /// gives no creation time for is never deleted.
    #[arg(long, env = "BERTH_ORPHAN_GRACE", default_value = "30m", value_parser = humantime::parse_duration)]
    pub orphan_grace: Duration,
    /// Only report orphan VMs (log line, Event, `berth_orphan_vms_total`
    /// with outcome `would_collect`); delete none.
    #[arg(
        long,
        env = "BERTH_ORPHAN_DRY_RUN",
        default_value_t = false,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub orphan_dry_run: bool,
}

/// How orphan collection runs. The default runs none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settings {
    /// Between rounds; zero: never run.
    pub interval: Duration,
    /// How old an orphan must be to be collected.
    pub grace: Duration,
    /// Report only.
    pub dry_run: bool,
    /// The namespace the controller watches (`--namespace`), if only one.
    pub namespace: Option<String>,
}

impl Settings {
    pub fn new(args: &OrphanArgs, namespace: Option<String>) -> Self {
        Self {
            interval: args.orphan_interval,
            grace: args.orphan_grace,
            dry_run: args.orphan_dry_run,
            namespace,
        }
    }
}

/// What orphan collection reads and acts through: the controller's caches
/// (it reads no API object the controllers do not already watch), its
/// drivers (counted in the metrics) and its Events queue.
pub(crate) struct Shared {
    /// For the Node of a collected VM, deleted with it.
    pub(crate) client: kube::Client,
    pub(crate) caches: Caches,
    pub(crate) providers: Registry,
    pub(crate) events: EventSink,
}

/// Runs orphan collection until the task is dropped: waits for every
/// cache to sync (the first complete list of Machines included), then runs
/// a round at once and one every `settings.interval`. Returns at once when
/// the interval is zero, and when the watches went away before the sync.
pub(crate) async fn run(settings: Settings, shared: Shared, metrics: Arc<Metrics>) {
    if settings.interval.is_zero() {
        tracing::info!("orphan VM collection is off (--orphan-interval=0)");
        return;
    }
    if !shared.caches.wait_until_synced().await {
        return;
    }
    for driver in shared.providers.names() {
        metrics.init_orphans(driver);
    }
    tracing::info!(
        interval = %humantime::format_duration(settings.interval),
        grace = %humantime::format_duration(settings.grace),
        dry_run = settings.dry_run,
        drivers = ?shared.providers.names(),
        "collecting orphan VMs"
    );
    let mut collector = Collector {
        rules: Rules {
            grace: settings.grace,
            namespace: settings.namespace,
        },
        dry_run: settings.dry_run,
        shared,
        metrics,
        untagged: Once::default(),
        refused: Once::default(),
    };
    let mut ticks = tokio::time::interval(settings.interval);
    // A round that overran starts the next one a full interval later, not
    // at once: a slow cloud must not turn rounds into a loop.
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        collector.round().await;
    }
}

/// One replica's orphan collection, between rounds.
struct Collector {
    rules: Rules,
    dry_run: bool,
    shared: Shared,
    metrics: Arc<Metrics>,
    /// VMs without Machine tags already reported, by providerID.
    untagged: Once,
    /// Classes whose providerSpec the driver refused, already reported.
    refused: Once,
}

impl Collector {
    /// One round over every enabled driver.
    async fn round(&mut self) {
        let mut complete = true;
        for name in self.shared.providers.names() {
            let Some(provider) = self.shared.providers.get(name) else {
                continue;
            };
            complete &= self.round_of(provider.as_ref()).await;
        }
        self.untagged.end_round(complete);
        self.refused.end_round(complete);
    }

    /// One round over one driver's classes. False when a list failed.
    async fn round_of(&mut self, provider: &dyn Provider) -> bool {
        let driver = provider.name();
        let (listed, complete) = self.list(provider).await;
        let vms = decide::dedupe(listed);
        let machines = Machines::of(self.shared.caches.machines.state().iter().map(|m| &**m));
        let now = Timestamp::now();
        let judged: Vec<_> = vms
            .into_iter()
            .map(|(class, vm)| {
                let verdict = decide::judge(&vm, &machines, &self.rules, now);
                (class, vm, verdict)
            })
            .collect();
        // Too many orphans at once is a wrong cache or wrong tags, not a
        // leak: none is collected this round.
        let fleet = judged
            .iter()
            .filter(|(_, _, v)| !matches!(v, Verdict::Untagged | Verdict::OutOfScope))
            .count();
        let orphaned = judged
            .iter()
            .filter(|(_, _, v)| matches!(v, Verdict::Orphan { .. } | Verdict::Young { .. }))
            .count();
        let bound = decide::round_bound(fleet);
        let stopped = orphaned > bound;
        if stopped {
            tracing::warn!(
                driver,
                orphaned,
                fleet,
                bound,
                "orphan collection stopped: this round found more VMs without a Machine than it \
                 may take of the fleet at once (a tenth, at least {}); none is deleted. Check that \
                 the Machines and their UIDs are as they should be (a restore from a backup gives \
                 new UIDs) and that --namespace is right",
                decide::MIN_ORPHANS_PER_ROUND
            );
        }
        let mut tally = Tally::default();
        for (class, vm, verdict) in judged {
            tally.count(&verdict);
            match verdict {
                Verdict::Untagged if self.untagged.first(&vm.provider_id) => {
                    tracing::info!(
                        driver,
                        provider_id = %vm.provider_id,
                        "a VM with this cluster's mark carries no Machine tags: orphan \
                         collection never touches it (reported once)"
                    );
                }
                Verdict::Young { collect_in } => tracing::debug!(
                    driver,
                    provider_id = %vm.provider_id,
                    collect_in = %humantime::format_duration(whole_seconds(collect_in)),
                    "orphan VM younger than --orphan-grace: kept for now"
                ),
                Verdict::Orphan { .. } if stopped => {
                    self.metrics.record_orphan(driver, OrphanOutcome::Held);
                }
                Verdict::Orphan { .. } => self.collect(provider, &class, vm).await,
                _ => {}
            }
        }
        tracing::debug!(
            driver,
            listed = tally.listed,
            in_use = tally.in_use,
            orphans = tally.orphans,
            young = tally.young,
            untagged = tally.untagged,
            out_of_scope = tally.out_of_scope,
            deleting = tally.deleting,
            age_unknown = tally.age_unknown,
            complete,
            "orphan collection round"
        );
        complete
    }

    /// The VMs of `provider` where each class naming it points, with the
    /// class that listed them; false when a list failed.
    async fn list(&mut self, provider: &dyn Provider) -> (Vec<(Arc<MachineClass>, Vec<Vm>)>, bool) {
        let driver = provider.name();
        let mut classes: Vec<Arc<MachineClass>> = self
            .shared
            .caches
            .classes
            .state()
            .into_iter()
            .filter(|c| c.spec.provider == driver)
            .collect();
        classes.sort_by_key(|c| c.name_any());
        let mut asked: Vec<String> = Vec::new();
        let mut listed = Vec::new();
        let mut complete = true;
        for class in classes {
            let req = ListRequest {
                provider_spec: class
                    .spec
                    .provider_spec
                    .clone()
                    .unwrap_or(serde_json::Value::Null),
                secret_ref: class.spec.secret_ref.clone(),
            };
            if let Err(e) = provider.validate(&req.provider_spec) {
                let key = format!("{}\n{}", class.name_any(), req.provider_spec);
                if self.refused.first(&key) {
                    tracing::warn!(
                        driver,
                        class = %class.name_any(),
                        error = %e,
                        "orphan collection skips this MachineClass: the driver refuses its \
                         providerSpec (reported once per spec)"
                    );
                }
                continue;
            }
            // Classes that differ only in what a VM is made of point to the
            // same place (a region and account): ask once.
            let scope = provider.list_scope(&req);
            if asked.contains(&scope) {
                continue;
            }
            match provider.list(&req).await {
                Ok(vms) => listed.push((Arc::clone(&class), vms)),
                Err(e) => {
                    complete = false;
                    tracing::warn!(
                        driver,
                        class = %class.name_any(),
                        error = %e,
                        kind = e.metric_label(),
                        "orphan collection could not list VMs; trying again next round"
                    );
                }
            }
            asked.push(scope);
        }
        (listed, complete)
    }

    /// Deletes (or, in a dry run, reports) one orphan, judged again on the
    /// latest cache: a Machine may have arrived while the round listed.
    async fn collect(&self, provider: &dyn Provider, class: &MachineClass, vm: Vm) {
        let driver = provider.name();
        let machines = Machines::of(self.shared.caches.machines.state().iter().map(|m| &**m));
        let (age, namesake) = match decide::judge(&vm, &machines, &self.rules, Timestamp::now()) {
            Verdict::Orphan { age, namesake } => (age, namesake),
            _ => return,
        };
        let Some(tag) = vm.machine.clone() else {
            return;
        };
        let age = whole_seconds(age);
        let fields = Report {
            driver,
            provider_id: &vm.provider_id,
            tag: &tag,
            class: &class.name_any(),
            age,
        };
        // A VM whose Node still runs pods is never terminated without a
        // drain: it is held, and named.
        let node = self
            .shared
            .caches
            .indexes
            .nodes_by_provider_id
            .get(&self.shared.caches.nodes, &vm.provider_id)
            .into_iter()
            .next();
        if let Some(node) = &node {
            let name = node.name_any();
            let pods: Vec<String> = self
                .shared
                .caches
                .indexes
                .pods_by_node
                .get(&self.shared.caches.pods, &name)
                .iter()
                .filter(|p| decide::holds_vm(p))
                .map(|p| format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()))
                .collect();
            if !pods.is_empty() {
                self.metrics.record_orphan(driver, OrphanOutcome::Held);
                let why = format!(
                    "its Node {name} still runs {} pods ({}): not deleted without a drain; \
                     drain and delete the Node, or give the VM a Machine",
                    pods.len(),
                    pods.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
                );
                fields.log(OrphanOutcome::Held, Some(&why));
                self.event(&fields, namesake, OrphanOutcome::Held, Some(&why));
                return;
            }
        }
        if self.dry_run {
            self.metrics
                .record_orphan(driver, OrphanOutcome::WouldCollect);
            fields.log(OrphanOutcome::WouldCollect, None);
            self.event(&fields, namesake, OrphanOutcome::WouldCollect, None);
            return;
        }
        let req = MachineRequest {
            namespace: tag.namespace.clone(),
            name: tag.name.clone(),
            uid: tag.uid.clone(),
            class: class.name_any(),
            secret_ref: class.spec.secret_ref.clone(),
            provider_spec: class
                .spec
                .provider_spec
                .clone()
                .unwrap_or(serde_json::Value::Null),
            provider_id: Some(vm.provider_id.clone()),
        };
        let (outcome, error) = match provider.delete(&req).await {
            // Deleting, or already gone: either way it is going.
            Ok(()) | Err(ProviderError::InProgress { .. } | ProviderError::NotFound(_)) => {
                (OrphanOutcome::Collected, None)
            }
            Err(e) => (OrphanOutcome::Failed, Some(e)),
        };
        self.metrics.record_orphan(driver, outcome);
        let detail = error.as_ref().map(|e| e as &dyn std::fmt::Display);
        fields.log(outcome, detail);
        self.event(&fields, namesake, outcome, detail);
        // Its Node, empty, goes with it: pinned to the UID judged empty.
        if outcome == OrphanOutcome::Collected
            && let Some(node) = node
        {
            match crate::machine::node::delete_pinned(&self.shared.client, &node).await {
                Ok(true) => {
                    tracing::info!(driver, node = %node.name_any(), provider_id = %vm.provider_id, "the collected orphan VM's Node deleted")
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(driver, node = %node.name_any(), error = %e, "could not delete the collected orphan VM's Node")
                }
            }
        }
    }

    /// An Event on the Machine that now has the name the orphan's tags give
    /// (`namesake`, its UID), if there is one: whoever looks at that Machine
    /// learns that a VM of an earlier Machine of that name was found. There
    /// is no other object to put it on.
    fn event(
        &self,
        r: &Report<'_>,
        namesake: Option<String>,
        outcome: OrphanOutcome,
        detail: Option<&dyn std::fmt::Display>,
    ) {
        let error = detail.map(ToString::to_string);
        let error = error.as_deref();
        let Some(uid) = namesake else {
            return;
        };
        let key = ObjectRef::<Machine>::new(&r.tag.name).within(&r.tag.namespace);
        let Some(machine) = self.shared.caches.machines.get(&key) else {
            return;
        };
        if machine.metadata.uid.as_deref() != Some(uid.as_str()) {
            return;
        }
        let what = format!(
            "VM {} ({} driver, {} old) was created for an earlier Machine {}/{} (UID {}) and no \
             Machine has it",
            r.provider_id,
            r.driver,
            humantime::format_duration(r.age),
            r.tag.namespace,
            r.tag.name,
            r.tag.uid
        );
        let (type_, reason, note) = match (outcome, error) {
            (OrphanOutcome::Collected, _) => (
                EventType::Normal,
                "OrphanVmCollected",
                format!("{what}: deleted"),
            ),
            (OrphanOutcome::WouldCollect, _) => (
                EventType::Warning,
                "OrphanVmFound",
                format!("{what}: not deleted (--orphan-dry-run)"),
            ),
            (OrphanOutcome::Held, e) => (
                EventType::Warning,
                "OrphanVmHeld",
                format!("{what}: {}", e.unwrap_or_default()),
            ),
            (OrphanOutcome::Failed, e) => (
                EventType::Warning,
                "OrphanVmCollectFailed",
                format!(
                    "{what}: its deletion failed ({}); tried again next round",
                    e.unwrap_or_default()
                ),
            ),
        };
        // The earlier Machine is the related object: kube's Recorder folds
        // Events with the same reason and objects into one series, note
        // aside, so two earlier Machines' VMs need two related objects.
        let earlier = ObjectReference {
            api_version: Some(Machine::api_version(&()).into_owned()),
            kind: Some(Machine::kind(&()).into_owned()),
            namespace: Some(r.tag.namespace.clone()),
            name: Some(r.tag.name.clone()),
            uid: Some(r.tag.uid.clone()),
            ..Default::default()
        };
        self.shared.events.event(
            type_,
            machine.object_ref(&()),
            "CollectOrphanVm",
            reason,
            note,
            Some(earlier),
        );
    }
}

/// What the log line of one orphan says.
struct Report<'a> {
    driver: &'a str,
    provider_id: &'a str,
    tag: &'a MachineRef,
    /// The class whose list found it, whose providerSpec and secretRef its
    /// delete is asked with (`via_class`: not necessarily the class of the
    /// Machine it was made for, which is gone).
    class: &'a str,
    age: Duration,
}

impl Report<'_> {
    fn log(&self, outcome: OrphanOutcome, detail: Option<&dyn std::fmt::Display>) {
        let error = detail.map(ToString::to_string);
        let error = error.as_deref();
        let age = humantime::format_duration(self.age);
        macro_rules! orphan {
            ($level:ident, $($rest:tt)+) => {
                tracing::$level!(
                    driver = self.driver,
                    provider_id = %self.provider_id,
                    machine_namespace = %self.tag.namespace,
                    machine_name = %self.tag.name,
                    machine_uid = %self.tag.uid,
                    via_class = %self.class,
                    %age,
                    outcome = outcome.as_str(),
                    $($rest)+
                )
            };
        }
        match (outcome, error) {
            (OrphanOutcome::Collected, _) => orphan!(info, "orphan VM collected"),
            (OrphanOutcome::WouldCollect, _) => {
                orphan!(warn, "orphan VM found; not deleted (--orphan-dry-run)")
            }
            (OrphanOutcome::Failed, e) => orphan!(
                warn,
                error = %e.unwrap_or_default(),
                "orphan VM not collected: its deletion failed; trying again next round"
            ),
            (OrphanOutcome::Held, e) => orphan!(
                warn,
                why = %e.unwrap_or_default(),
                "orphan VM held"
            ),
        }
    }
}

/// `d` without its fraction of a second, for logs and Events.
fn whole_seconds(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        orphans: OrphanArgs,
    }

    fn parse(args: &[&str]) -> Result<Settings, clap::Error> {
        let cli = Cli::try_parse_from(std::iter::once("berth").chain(args.iter().copied()))?;
        Ok(Settings::new(&cli.orphans, None))
    }

    #[test]
    fn orphan_flags_default_to_a_cautious_collection() {
        let s = parse(&[]).expect("defaults");
        assert_eq!(s.interval, Duration::from_secs(600));
        assert_eq!(s.grace, Duration::from_secs(1800));
        assert!(!s.dry_run);
    }

    #[test]
    fn orphan_flags_parse_dry_run_both_ways_and_zero_turns_it_off() {
        let s = parse(&[
            "--orphan-interval=0",
            "--orphan-grace=45s",
            "--orphan-dry-run",
        ])
        .expect("valid");
        assert!(s.interval.is_zero());
        assert_eq!(s.grace, Duration::from_secs(45));
        assert!(s.dry_run);
        assert!(!parse(&["--orphan-dry-run=false"]).expect("valid").dry_run);
        assert!(parse(&["--orphan-dry-run=true"]).expect("valid").dry_run);
        assert!(parse(&["--orphan-grace=soon"]).is_err());
        assert!(parse(&["--orphan-dry-run=maybe"]).is_err());
    }
}
