//! What a reconcile looks up: the Machine's class, driver and settings
//! ([`resolve_machine`]), its Node from the cache or the API server, and
//! whether a Node is the Machine's ([`belongs`]: a Node that took its
//! Node's name is not), and whose VM a hand-written providerID names
//! ([`vm_owner`]).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;

use super::Context;
use super::error::{Error, Step, at};
use super::record::Unresolved;
use crate::api::Machine;
use crate::api::conditions::VM_REQUESTED;
use crate::api::settings::{ResolvedSettings, resolve};
use crate::machine::status::condition;
use crate::providers::{MachineRequest, Provider, ProviderError};

/// A Machine's class, driver and settings, or why they cannot be had.
pub(super) struct Resolved {
    pub(super) provider: Arc<dyn Provider>,
    pub(super) settings: ResolvedSettings,
    pub(super) request: MachineRequest,
    /// The class's `remediation`, as written.
    pub(super) class_remediation: Option<crate::api::Remediation>,
}

pub(super) fn resolve_machine(m: &Machine, ctx: &Context) -> Result<Resolved, Unresolved> {
    let class_name = &m.spec.class_ref.name;
    let class = ctx
        .caches
        .classes
        .get(&ObjectRef::new(class_name))
        .ok_or_else(|| Unresolved {
            reason: "ClassNotFound",
            message: format!("MachineClass {class_name:?} does not exist"),
        })?;
    let provider = ctx
        .providers
        .get(&class.spec.provider)
        .ok_or_else(|| Unresolved {
            reason: "UnknownProvider",
            message: format!(
                "MachineClass {class_name:?} names provider {:?}; this controller knows {:?}",
                class.spec.provider,
                ctx.providers.names()
            ),
        })?;
    let settings = resolve(
        m.spec.drain.as_ref(),
        class.spec.drain.as_ref(),
        class.spec.creation_timeout.as_deref(),
        class.spec.health_timeout.as_deref(),
    )
    .map_err(|e| Unresolved {
        reason: "InvalidSettings",
        message: e.to_string(),
    })?;
    let provider_spec = class
        .spec
        .provider_spec
        .clone()
        .unwrap_or(serde_json::Value::Null);
    provider.validate(&provider_spec).map_err(|e| Unresolved {
        reason: "InvalidProviderSpec",
        message: format!("MachineClass {class_name:?}: {e}"),
    })?;
    Ok(Resolved {
        provider,
        settings,
        class_remediation: class.spec.remediation.clone(),
        request: MachineRequest {
            namespace: m.namespace().unwrap_or_default(),
            name: m.name_any(),
            uid: m.metadata.uid.clone().unwrap_or_default(),
            class: class_name.clone(),
            secret_ref: class.spec.secret_ref.clone(),
            provider_spec,
            provider_id: m.spec.provider_id.clone(),
        },
    })
}

/// The Machine's Node: by `status.nodeRef`, else by providerID.
pub(super) async fn node_from_api(m: &Machine, ctx: &Context) -> Result<Option<Arc<Node>>, Error> {
    let Some(name) = m
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| &r.name)
    else {
        return Ok(None);
    };
    let node = Api::<Node>::all(ctx.client.clone())
        .get_opt(name)
        .await
        .map_err(at(Step::NodeGet))?
        .filter(|n| belongs(m, n));
    if node.is_some() {
        tracing::warn!(node = %name, "Node missing from the cache but present in the API server");
    }
    Ok(node.map(Arc::new))
}

/// Whether `node` is the Machine's by what it registers: a Node whose
/// providerID is another VM's took the name of the Machine's Node (a
/// reused IP or hostname) and is another Machine's, never cordoned,
/// drained or deleted for this one. A Node that does not say (its cloud
/// controller has not set it yet), or a Machine without a providerID,
/// goes by name.
pub(super) fn belongs(m: &Machine, node: &Node) -> bool {
    match (
        m.spec.provider_id.as_deref(),
        node.spec.as_ref().and_then(|s| s.provider_id.as_deref()),
    ) {
        (Some(mine), Some(its)) => mine == its,
        _ => true,
    }
}

/// The Node that holds the name of the Machine's Node but is another
/// Machine's (see [`belongs`]), if one does.
pub(super) fn node_name_taken(m: &Machine, ctx: &Context) -> Option<Arc<Node>> {
    ctx.caches.node_of(m).filter(|n| !belongs(m, n))
}

pub(super) fn find_node(m: &Machine, ctx: &Context) -> Option<Arc<Node>> {
    if let Some(name) = m
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| &r.name)
        && let Some(n) = ctx.caches.nodes.get(&ObjectRef::new(name))
        && belongs(m, &n)
    {
        return Some(n);
    }
    let id = m.spec.provider_id.as_deref()?;
    ctx.caches
        .indexes
        .nodes_by_provider_id
        .get(&ctx.caches.nodes, id)
        .into_iter()
        .next()
}

/// How long a deletion that cannot ask whose VM it is waits before it asks
/// again, the provider having failed.
pub(super) const OWNER_ASK_AGAIN: Duration = Duration::from_secs(30);

/// Whose VM `spec.providerID` names, as far as a deletion can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum VmOwner {
    /// This Machine's: berth requested it (a `VMRequested` condition), its
    /// tags name this Machine, there is no providerID, or the provider
    /// does not find the VM (the deletion's own wait on a VM not found
    /// applies).
    Ours,
    /// Another Machine's, or nobody's (the providerID was written by hand
    /// for a VM berth did not make for this Machine): why. Its Node and VM
    /// are left alone.
    Foreign(String),
    /// Not known: the class cannot be resolved, or the provider failed.
    /// The deletion touches neither the Node nor the VM until it is, and
    /// asks again after `ask_again` (or when the class changes).
    Unknown {
        why: String,
        ask_again: Option<Duration>,
    },
}

/// Whose VM `spec.providerID` names (see [`VmOwner`]). The provider is
/// asked only for a Machine berth never requested a VM for, and only until
/// it says the VM is this Machine's (remembered in `ctx`).
pub(super) async fn vm_owner(
    m: &Machine,
    resolved: &Result<Resolved, Unresolved>,
    ctx: &Context,
) -> VmOwner {
    let Some(pid) = m.spec.provider_id.as_deref() else {
        return VmOwner::Ours;
    };
    if condition(m.status.as_ref(), VM_REQUESTED).is_some() || ctx.vm_owned(m) {
        return VmOwner::Ours;
    }
    let r = match resolved {
        Ok(r) => r,
        Err(why) => {
            return VmOwner::Unknown {
                why: format!(
                    "{} ({}): the provider cannot be asked whose VM providerID {pid} is",
                    why.message, why.reason
                ),
                ask_again: None,
            };
        }
    };
    let vm = match r.provider.get(&r.request).await {
        Ok(vm) => vm,
        Err(ProviderError::NotFound(_)) => return VmOwner::Ours,
        Err(e) => {
            return VmOwner::Unknown {
                why: format!(
                    "provider {} could not say whose VM providerID {pid} is: {e}",
                    r.provider.name()
                ),
                ask_again: Some(OWNER_ASK_AGAIN),
            };
        }
    };
    let uid = m.metadata.uid.as_deref().unwrap_or_default();
    match vm.machine {
        Some(t) if t.uid == uid => {
            ctx.set_vm_owned(m, true);
            VmOwner::Ours
        }
        Some(t) => VmOwner::Foreign(format!(
            "the VM of providerID {pid} was made for Machine {}/{} (UID {}), not this one",
            t.namespace, t.name, t.uid
        )),
        None => VmOwner::Foreign(format!(
            "the VM of providerID {pid} carries no Machine tags: berth did not make it"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_the_machines_unless_it_registers_another_vm() {
        let machine = |pid: Option<&str>| -> Machine {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "berth.dev/v1alpha1", "kind": "Machine",
                "metadata": {"name": "a", "namespace": "ns"},
                "spec": {"classRef": {"name": "c"}, "providerID": pid}
            }))
            .expect("a Machine")
        };
        let node = |pid: Option<&str>| -> Node {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "ns-a"}, "spec": {"providerID": pid}
            }))
            .expect("a Node")
        };
        let mine = Some("aws:///us-east-1a/i-1");
        assert!(belongs(&machine(mine), &node(mine)));
        assert!(
            !belongs(&machine(mine), &node(Some("aws:///us-east-1a/i-2"))),
            "another VM took the name"
        );
        assert!(
            belongs(&machine(mine), &node(None)),
            "not said yet: by name"
        );
        assert!(belongs(
            &machine(None),
            &node(Some("aws:///us-east-1a/i-2"))
        ));
    }
}
