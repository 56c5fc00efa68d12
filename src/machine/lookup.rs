//! What a reconcile looks up: the Machine's class, driver and settings,
//! and its Node.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;

use super::Context;
use super::error::{Error, Step, at};
use super::record::Unresolved;
use crate::api::Machine;
use crate::api::settings::{ResolvedSettings, resolve};
use crate::providers::{MachineRequest, Provider};

/// A Machine's class, driver and settings, or why they cannot be had.
pub(super) struct Resolved {
    pub(super) provider: Arc<dyn Provider>,
    pub(super) settings: ResolvedSettings,
    pub(super) request: MachineRequest,
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
        .map_err(at(Step::NodeGet))?;
    if node.is_some() {
        tracing::warn!(node = %name, "Node missing from the cache but present in the API server");
    }
    Ok(node.map(Arc::new))
}

pub(super) fn find_node(m: &Machine, ctx: &Context) -> Option<Arc<Node>> {
    if let Some(name) = m
        .status
        .as_ref()
        .and_then(|s| s.node_ref.as_ref())
        .map(|r| &r.name)
        && let Some(n) = ctx.caches.nodes.get(&ObjectRef::new(name))
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
