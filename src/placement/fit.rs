//! The scheduler's rules a destination is judged by, as checks: a Node
//! selector term against a Node's labels and name, a taint against a
//! pod's tolerations, a pod's resource requests as the scheduler adds
//! them up, and resource quantities.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PodSpec, ResourceRequirements,
    Taint, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Whether `node` meets `selector`: at least one of its terms (a term with
/// no requirement meets nothing, as the scheduler reads it).
pub fn meets(selector: &NodeSelector, node: &Node) -> bool {
    selector
        .node_selector_terms
        .iter()
        .any(|t| meets_term(t, node))
}

fn meets_term(term: &NodeSelectorTerm, node: &Node) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    let labels = node.metadata.labels.clone().unwrap_or_default();
    let name = node.metadata.name.clone().unwrap_or_default();
    exprs
        .iter()
        .all(|r| requirement_holds(r, labels.get(&r.key).map(String::as_str)))
        && fields.iter().all(|r| {
            let value = (r.key == "metadata.name").then_some(name.as_str());
            r.key == "metadata.name" && requirement_holds(r, value)
        })
}

/// One requirement against the value (`None`: no such label).
fn requirement_holds(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| values.iter().all(|x| x != v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (
                value.and_then(number),
                values.first().and_then(|b| number(b)),
            ) else {
                return false;
            };
            if r.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}

/// Whether `labels` carries every pair of a pod's `nodeSelector`.
pub fn selected(node_selector: &BTreeMap<String, String>, node: &Node) -> bool {
    let labels = node.metadata.labels.as_ref();
    node_selector
        .iter()
        .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

/// The first of `node`'s taints that keeps a pod with `tolerations` off
/// it (`NoSchedule` or `NoExecute`, not tolerated), if any.
pub fn untolerated<'n>(node: &'n Node, tolerations: &[Toleration]) -> Option<&'n Taint> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .find(|t| !tolerations.iter().any(|tol| tolerates(tol, t)))
}

/// Whether `tol` tolerates `taint`, by the API's rules: an empty key with
/// `Exists` tolerates everything; an empty effect every effect.
fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if tol
        .effect
        .as_deref()
        .is_some_and(|e| !e.is_empty() && e != taint.effect)
    {
        return false;
    }
    let key = tol.key.as_deref().unwrap_or_default();
    let exists = tol.operator.as_deref() == Some("Exists");
    if key.is_empty() {
        return exists;
    }
    key == taint.key
        && (exists
            || tol.value.as_deref().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default())
}

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
    use k8s_openapi::api::core::v1::{Container, NodeSpec};
    use kube::api::ObjectMeta;

    fn node(labels: &[(&str, &str)], taints: Vec<Taint>) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                taints: Some(taints),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn req(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(values.iter().map(|v| v.to_string()).collect()),
        }
    }

    fn selector(terms: Vec<NodeSelectorTerm>) -> NodeSelector {
        NodeSelector {
            node_selector_terms: terms,
        }
    }

    #[test]
    fn node_selector_terms_are_ored_and_their_requirements_anded() {
        let n = node(&[("zone", "a"), ("cores", "8")], vec![]);
        let term = |rs: Vec<NodeSelectorRequirement>| NodeSelectorTerm {
            match_expressions: Some(rs),
            match_fields: None,
        };
        assert!(meets(
            &selector(vec![term(vec![req("zone", "In", &["a", "b"])])]),
            &n
        ));
        assert!(!meets(
            &selector(vec![term(vec![req("zone", "In", &["b"])])]),
            &n
        ));
        assert!(meets(
            &selector(vec![
                term(vec![req("zone", "In", &["b"])]),
                term(vec![
                    req("cores", "Gt", &["4"]),
                    req("gpu", "DoesNotExist", &[])
                ]),
            ]),
            &n
        ));
        assert!(!meets(
            &selector(vec![term(vec![req("cores", "Lt", &["4"])])]),
            &n
        ));
        assert!(meets(
            &selector(vec![term(vec![req("zone", "NotIn", &["b"])])]),
            &n
        ));
        assert!(!meets(
            &selector(vec![term(vec![req("zone", "DoesNotExist", &[])])]),
            &n
        ));
        // An empty term meets nothing; so does an empty selector.
        assert!(!meets(&selector(vec![term(vec![])]), &n));
        assert!(!meets(&selector(vec![]), &n));
        let by_name = NodeSelectorTerm {
            match_expressions: None,
            match_fields: Some(vec![req("metadata.name", "In", &["n1"])]),
        };
        assert!(meets(&selector(vec![by_name]), &n));
    }

    #[test]
    fn taints_are_tolerated_by_key_value_and_effect() {
        let taint = |key: &str, value: Option<&str>, effect: &str| Taint {
            key: key.into(),
            value: value.map(Into::into),
            effect: effect.into(),
            time_added: None,
        };
        let n = node(
            &[],
            vec![
                taint("soft", None, "PreferNoSchedule"),
                taint("dedicated", Some("db"), "NoSchedule"),
            ],
        );
        assert_eq!(
            untolerated(&n, &[]).map(|t| t.key.as_str()),
            Some("dedicated")
        );
        let tol =
            |key: Option<&str>, op: &str, value: Option<&str>, effect: Option<&str>| Toleration {
                key: key.map(Into::into),
                operator: Some(op.into()),
                value: value.map(Into::into),
                effect: effect.map(Into::into),
                toleration_seconds: None,
            };
        assert!(untolerated(&n, &[tol(Some("dedicated"), "Equal", Some("db"), None)]).is_none());
        assert!(untolerated(&n, &[tol(Some("dedicated"), "Equal", Some("web"), None)]).is_some());
        assert!(
            untolerated(
                &n,
                &[tol(Some("dedicated"), "Exists", None, Some("NoSchedule"))]
            )
            .is_none()
        );
        assert!(
            untolerated(
                &n,
                &[tol(Some("dedicated"), "Exists", None, Some("NoExecute"))]
            )
            .is_some()
        );
        assert!(untolerated(&n, &[tol(None, "Exists", None, None)]).is_none());
    }

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
