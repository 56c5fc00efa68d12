//! What a pod asks of a Node, added up as the scheduler adds it up, and
//! resource quantities as numbers: read by the destination check
//! (`crate::placement`) and by the pod cache's trim, which keeps a pod's
//! requests as their sum.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// CPU (millicores), memory (bytes) and pods: what a pod asks of a Node,
/// or what a Node has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpu_milli: i64,
    pub memory: i64,
    pub pods: i64,
}

impl Resources {
    fn add(&mut self, other: Resources) {
        self.cpu_milli += other.cpu_milli;
        self.memory += other.memory;
        self.pods += other.pods;
    }

    fn max(self, other: Resources) -> Resources {
        Resources {
            cpu_milli: self.cpu_milli.max(other.cpu_milli),
            memory: self.memory.max(other.memory),
            pods: self.pods.max(other.pods),
        }
    }

    /// From a resource list (`cpu`, `memory`, `pods`; absent is 0).
    pub fn of(list: Option<&BTreeMap<String, Quantity>>) -> Resources {
        let get = |k: &str, scale: f64| {
            list.and_then(|l| l.get(k))
                .and_then(|q| quantity(&q.0))
                .map_or(0, |v| (v * scale).ceil() as i64)
        };
        Resources {
            cpu_milli: get("cpu", 1000.0),
            memory: get("memory", 1.0),
            pods: get("pods", 1.0),
        }
    }
}

fn requests(r: Option<&ResourceRequirements>) -> Resources {
    Resources::of(r.and_then(|r| r.requests.as_ref()))
}

/// What a pod asks of a Node, added up as the scheduler does: its
/// containers and sidecars (init containers that restart) together, or
/// the largest init container with the sidecars started before it,
/// whichever is more, plus the pod's overhead; and one pod.
pub fn pod_requests(spec: &PodSpec) -> Resources {
    let mut app = Resources::default();
    for c in &spec.containers {
        app.add(requests(c.resources.as_ref()));
    }
    let mut sidecars = Resources::default();
    let mut init = Resources::default();
    for c in spec.init_containers.iter().flatten() {
        let r = requests(c.resources.as_ref());
        if c.restart_policy.as_deref() == Some("Always") {
            sidecars.add(r);
            init = init.max(sidecars);
        } else {
            let mut during = sidecars;
            during.add(r);
            init = init.max(during);
        }
    }
    app.add(sidecars);
    let mut total = app.max(init);
    total.add(Resources::of(spec.overhead.as_ref()));
    total.pods = 1;
    total
}

/// A resource quantity as a number (`100m` = 0.1, `1Gi` = 2^30, `1e3`);
/// `None` when it does not parse.
pub fn quantity(s: &str) -> Option<f64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    let number: f64 = number.parse().ok()?;
    let factor = match suffix {
        "" => 1.0,
        "n" => 1e-9,
        "u" => 1e-6,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        e if e.starts_with(['e', 'E']) => 10f64.powi(e[1..].parse().ok()?),
        _ => return None,
    };
    Some(number * factor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Container;

    #[test]
    fn requests_add_up_as_the_scheduler_adds_them() {
        let c = |cpu: &str, mem: &str, restart: Option<&str>| Container {
            name: String::new(),
            resources: Some(ResourceRequirements {
                requests: Some(BTreeMap::from([
                    ("cpu".to_string(), Quantity(cpu.into())),
                    ("memory".to_string(), Quantity(mem.into())),
                ])),
                ..Default::default()
            }),
            restart_policy: restart.map(Into::into),
            ..Default::default()
        };
        let spec = PodSpec {
            containers: vec![c("250m", "1Gi", None), c("250m", "512Mi", None)],
            init_containers: Some(vec![
                c("100m", "64Mi", Some("Always")),
                c("2", "128Mi", None),
            ]),
            ..Default::default()
        };
        let r = pod_requests(&spec);
        // The init container (2 cores) with the sidecar before it wins on
        // CPU; the app containers with the sidecar on memory.
        assert_eq!(r.cpu_milli, 2100);
        assert_eq!(r.memory, (1536 + 64) * 1024 * 1024);
        assert_eq!(r.pods, 1);
    }

    #[test]
    fn quantities_parse_with_their_suffixes() {
        assert_eq!(quantity("100m"), Some(0.1));
        assert_eq!(quantity("2"), Some(2.0));
        assert_eq!(quantity("1Gi"), Some(1073741824.0));
        assert_eq!(quantity("1.5k"), Some(1500.0));
        assert_eq!(quantity("1e3"), Some(1000.0));
        assert_eq!(quantity("12x"), None);
    }
}
