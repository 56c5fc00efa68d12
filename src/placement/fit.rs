//! The scheduler's rules a destination is judged by, as checks: a Node
//! selector term against a Node's labels and name, a taint against a
//! pod's tolerations; a pod's resource requests as the scheduler adds
//! them up are `crate::api::resources`' (the pod cache keeps their sum).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Taint, Toleration,
};

pub use crate::api::resources::{Resources, pod_requests, quantity};

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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeSpec;
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
}
