//! Drain and lifecycle settings: the API shape (strings, all optional), the
//! defaults, and the resolution Machine → class → default into plain values.
//! Resolution is pure and is the one place a bad value is turned into an
//! error the reconciler reports as a condition.

use std::time::Duration;

use kube::KubeSchema;
use kube::core::Rule;
use serde::{Deserialize, Serialize};

/// Durations are written as integers with units, e.g. `90s`, `2m`, `1h30m`.
pub const DURATION_PATTERN: &str = "^([0-9]+(ms|s|m|h))+$";

pub(crate) fn duration_rule() -> Rule {
    Rule::new(format!("self.matches('{DURATION_PATTERN}')"))
        .message("must be a duration such as 90s, 2m or 1h30m")
}

/// How a Machine's Node is drained. Every field is optional: a Machine's
/// value wins over its class's, which wins over the default.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DrainSettings {
    /// Deadline for the whole drain, measured from the deletion request
    /// (pre-drain hook time counts) and never reset by a retry or a restart
    /// (default 2h). At the deadline PodDisruptionBudgets stop being
    /// honoured, volumes do not: see `forceAfterDeadline`. A pod that a
    /// finalizer keeps after its grace period holds the Machine until the
    /// deadline plus its grace period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = duration_rule())]
    pub timeout: Option<String>,
    /// How long a volume may take to detach from the old Node once its pod
    /// is gone, on top of the pod's grace period (default 2m).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = duration_rule())]
    pub volume_detach_timeout: Option<String>,
    /// How long to wait for a volume to attach on another Node before moving
    /// on with a warning (default 90s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = duration_rule())]
    pub volume_reattach_timeout: Option<String>,
    /// At the deadline, delete the pods still not evicted, their
    /// PodDisruptionBudgets bypassed, each with its own grace period at the
    /// deadline minus that grace period; stateful pods still one at a time,
    /// each one's volume detach still waited for (default true). When
    /// false, the drain fails at the deadline naming the pods left, and is
    /// retried every 30 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub force_after_deadline: Option<bool>,
    /// Evictions of one pod refused by a PodDisruptionBudget before it counts
    /// as stuck (default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_evict_retries: Option<u32>,
    /// Stateful pods whose volumes may move at the same time (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_parallel_volume_migrations: Option<u32>,
    /// Pods without volumes evicted at the same time (default 20).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_concurrent_evictions: Option<u32>,
    /// What to do with a pod that uses a node-local PersistentVolume
    /// (`spec.local`, `hostPath`, or node affinity only this Node meets),
    /// whose data cannot follow it and is lost with the VM. `Evict` (the
    /// default) evicts it without waiting for any reattach, with a Warning
    /// Event and the `NodeLocalVolumes` condition naming each such PV.
    /// `Block` does not evict it until the pod or the Machine is annotated
    /// `berth.dev/allow-node-local-data-loss: "true"`; the drain deadline
    /// still applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_local_volumes: Option<NodeLocalVolumes>,
    /// Before a stateful pod is evicted, a Node that can take its
    /// replacement must have registered the CSI driver of each of its
    /// volumes that attach (in its CSINode) (default true). When false,
    /// only a driver whose CSIDriver sets `preventPodSchedulingIfMissing`
    /// must be registered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub require_csi_node: Option<bool>,
}

/// What to do with a pod that uses a node-local PersistentVolume
/// (`spec.local`, `hostPath`, or node affinity only this Node meets), whose
/// data cannot follow it and is lost with the VM. `Evict` (the default)
/// evicts it without waiting for any reattach, with a Warning Event and the
/// `NodeLocalVolumes` condition naming each such PV. `Block` does not evict
/// it until the pod or the Machine is annotated
/// `berth.dev/allow-node-local-data-loss: "true"`; the drain deadline still
/// applies.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum NodeLocalVolumes {
    /// Evict it; its data is lost with the VM (named in an Event and a
    /// condition).
    #[default]
    Evict,
    /// Do not evict it until an operator allows the loss with the
    /// `berth.dev/allow-node-local-data-loss: "true"` annotation on the pod
    /// or the Machine.
    Block,
}

/// Settings with every default applied and every duration parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedSettings {
    pub drain_timeout: Duration,
    pub volume_detach_timeout: Duration,
    pub volume_reattach_timeout: Duration,
    pub force_after_deadline: bool,
    pub max_evict_retries: u32,
    pub max_parallel_volume_migrations: u32,
    pub max_concurrent_evictions: u32,
    pub node_local_volumes: NodeLocalVolumes,
    pub require_csi_node: bool,
    pub creation_timeout: Duration,
    pub health_timeout: Duration,
}

impl Default for ResolvedSettings {
    fn default() -> Self {
        Self {
            drain_timeout: Duration::from_secs(2 * 3600),
            volume_detach_timeout: Duration::from_secs(120),
            volume_reattach_timeout: Duration::from_secs(90),
            force_after_deadline: true,
            max_evict_retries: 10,
            max_parallel_volume_migrations: 1,
            max_concurrent_evictions: 20,
            node_local_volumes: NodeLocalVolumes::Evict,
            require_csi_node: true,
            creation_timeout: Duration::from_secs(20 * 60),
            health_timeout: Duration::from_secs(10 * 60),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    #[error("{field}: {value:?} is not a duration such as 90s, 2m or 1h30m")]
    BadDuration { field: &'static str, value: String },
    #[error("{field} must be greater than zero")]
    Zero { field: &'static str },
}

/// Resolves the Machine's settings over its class's over the defaults.
pub fn resolve(
    machine: Option<&DrainSettings>,
    class: Option<&DrainSettings>,
    creation_timeout: Option<&str>,
    health_timeout: Option<&str>,
) -> Result<ResolvedSettings, SettingsError> {
    let d = ResolvedSettings::default();
    let pick =
        |f: fn(&DrainSettings) -> Option<String>| machine.and_then(f).or_else(|| class.and_then(f));
    let pick_u32 =
        |f: fn(&DrainSettings) -> Option<u32>| machine.and_then(f).or_else(|| class.and_then(f));
    let dur = |field: &'static str, v: Option<String>, default: Duration| match v {
        None => Ok(default),
        Some(s) => parse_duration(&s)
            .ok_or(SettingsError::BadDuration { field, value: s })
            .and_then(|d| {
                if d.is_zero() {
                    Err(SettingsError::Zero { field })
                } else {
                    Ok(d)
                }
            }),
    };
    let count = |field: &'static str, v: Option<u32>, default: u32| match v {
        Some(0) => Err(SettingsError::Zero { field }),
        Some(n) => Ok(n),
        None => Ok(default),
    };
    Ok(ResolvedSettings {
        drain_timeout: dur(
            "drain.timeout",
            pick(|s| s.timeout.clone()),
            d.drain_timeout,
        )?,
        volume_detach_timeout: dur(
            "drain.volumeDetachTimeout",
            pick(|s| s.volume_detach_timeout.clone()),
            d.volume_detach_timeout,
        )?,
        volume_reattach_timeout: dur(
            "drain.volumeReattachTimeout",
            pick(|s| s.volume_reattach_timeout.clone()),
            d.volume_reattach_timeout,
        )?,
        force_after_deadline: machine
            .and_then(|s| s.force_after_deadline)
            .or_else(|| class.and_then(|s| s.force_after_deadline))
            .unwrap_or(d.force_after_deadline),
        require_csi_node: machine
            .and_then(|s| s.require_csi_node)
            .or_else(|| class.and_then(|s| s.require_csi_node))
            .unwrap_or(d.require_csi_node),
        max_evict_retries: count(
            "drain.maxEvictRetries",
            pick_u32(|s| s.max_evict_retries),
            d.max_evict_retries,
        )?,
        max_parallel_volume_migrations: count(
            "drain.maxParallelVolumeMigrations",
            pick_u32(|s| s.max_parallel_volume_migrations),
            d.max_parallel_volume_migrations,
        )?,
        max_concurrent_evictions: count(
            "drain.maxConcurrentEvictions",
            pick_u32(|s| s.max_concurrent_evictions),
            d.max_concurrent_evictions,
        )?,
        node_local_volumes: machine
            .and_then(|s| s.node_local_volumes)
            .or_else(|| class.and_then(|s| s.node_local_volumes))
            .unwrap_or(d.node_local_volumes),
        creation_timeout: dur(
            "creationTimeout",
            creation_timeout.map(str::to_string),
            d.creation_timeout,
        )?,
        health_timeout: dur(
            "healthTimeout",
            health_timeout.map(str::to_string),
            d.health_timeout,
        )?,
    })
}

/// Parses the duration syntax of [`DURATION_PATTERN`]: integers with the
/// units `ms`, `s`, `m`, `h`, concatenated (`1h30m`).
pub fn parse_duration(s: &str) -> Option<Duration> {
    if s.is_empty() {
        return None;
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        if digits == 0 {
            return None;
        }
        let n: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let (unit, len) = if rest.starts_with("ms") {
            (Duration::from_millis(1), 2)
        } else if rest.starts_with('s') {
            (Duration::from_secs(1), 1)
        } else if rest.starts_with('m') {
            (Duration::from_secs(60), 1)
        } else if rest.starts_with('h') {
            (Duration::from_secs(3600), 1)
        } else {
            return None;
        };
        total = total.checked_add(unit.checked_mul(u32::try_from(n).ok()?)?)?;
        rest = &rest[len..];
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_like_the_cel_pattern_allows() {
        let cases = [
            ("90s", Some(90)),
            ("2m", Some(120)),
            ("1h30m", Some(5400)),
            ("2h", Some(7200)),
            ("1500ms", Some(1)),
            ("", None),
            ("5", None),
            ("m5", None),
            ("1.5h", None),
            ("2 hours", None),
            ("-1s", None),
        ];
        for (input, secs) in cases {
            assert_eq!(
                parse_duration(input).map(|d| d.as_secs()),
                secs,
                "parse_duration({input:?})"
            );
        }
        assert_eq!(parse_duration("1500ms"), Some(Duration::from_millis(1500)));
    }

    #[test]
    fn defaults_apply_when_nothing_is_set() {
        assert_eq!(
            resolve(None, None, None, None),
            Ok(ResolvedSettings::default())
        );
        let d = ResolvedSettings::default();
        assert_eq!(d.drain_timeout, Duration::from_secs(7200));
        assert_eq!(d.volume_detach_timeout, Duration::from_secs(120));
        assert_eq!(d.volume_reattach_timeout, Duration::from_secs(90));
        assert!(d.force_after_deadline);
        assert_eq!(d.max_parallel_volume_migrations, 1);
    }

    #[test]
    fn machine_overrides_class_field_by_field() {
        let class = DrainSettings {
            timeout: Some("1h".into()),
            volume_detach_timeout: Some("5m".into()),
            force_after_deadline: Some(false),
            ..Default::default()
        };
        let machine = DrainSettings {
            timeout: Some("30m".into()),
            max_evict_retries: Some(3),
            ..Default::default()
        };
        let r = resolve(Some(&machine), Some(&class), Some("5m"), None).expect("valid");
        assert_eq!(r.drain_timeout, Duration::from_secs(1800));
        assert_eq!(r.volume_detach_timeout, Duration::from_secs(300));
        assert!(!r.force_after_deadline);
        assert_eq!(r.max_evict_retries, 3);
        assert_eq!(r.creation_timeout, Duration::from_secs(300));
        assert_eq!(r.health_timeout, ResolvedSettings::default().health_timeout);
        assert_eq!(r.node_local_volumes, NodeLocalVolumes::Evict);
    }

    #[test]
    fn node_local_volumes_resolve_machine_over_class_over_evict() {
        let with = |v| DrainSettings {
            node_local_volumes: v,
            ..Default::default()
        };
        let (block, evict) = (
            with(Some(NodeLocalVolumes::Block)),
            with(Some(NodeLocalVolumes::Evict)),
        );
        let cases = [
            (None, None, NodeLocalVolumes::Evict),
            (None, Some(&block), NodeLocalVolumes::Block),
            (Some(&evict), Some(&block), NodeLocalVolumes::Evict),
            (Some(&block), None, NodeLocalVolumes::Block),
        ];
        for (machine, class, want) in cases {
            let r = resolve(machine, class, None, None).expect("valid");
            assert_eq!(r.node_local_volumes, want, "{machine:?} over {class:?}");
        }
        let json: DrainSettings =
            serde_json::from_value(serde_json::json!({"nodeLocalVolumes": "Block"}))
                .expect("parses");
        assert_eq!(json.node_local_volumes, Some(NodeLocalVolumes::Block));
    }

    #[test]
    fn bad_values_name_the_field() {
        let bad = DrainSettings {
            volume_reattach_timeout: Some("soon".into()),
            ..Default::default()
        };
        assert_eq!(
            resolve(Some(&bad), None, None, None),
            Err(SettingsError::BadDuration {
                field: "drain.volumeReattachTimeout",
                value: "soon".into()
            })
        );
        let zero = DrainSettings {
            timeout: Some("0s".into()),
            ..Default::default()
        };
        assert_eq!(
            resolve(None, Some(&zero), None, None),
            Err(SettingsError::Zero {
                field: "drain.timeout"
            })
        );
        let zero_count = DrainSettings {
            max_parallel_volume_migrations: Some(0),
            ..Default::default()
        };
        assert_eq!(
            resolve(Some(&zero_count), None, None, None),
            Err(SettingsError::Zero {
                field: "drain.maxParallelVolumeMigrations"
            })
        );
    }
}
