//! A client with an identity of its own on the test bed: a ServiceAccount
//! bound to `cluster-admin` (or to a ClusterRole a test makes), with a
//! token in a kubeconfig of its own, so that the audit log tells the
//! controller's requests from the test's.

use std::path::PathBuf;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::Client;
use kube::api::{Api, PostParams};

use super::{TestBed, create_or_keep};

/// A ServiceAccount's kubeconfig (for a `berth run` process, or
/// [`Identity::client`]) and its user name as the audit log records it.
#[derive(Debug, Clone)]
pub struct Identity {
    pub kubeconfig: PathBuf,
    pub user: String,
    /// Its bearer token, for a request made without a Kubernetes client.
    pub token: String,
}

impl Identity {
    /// A new client with this identity. A client's connection pool lives on
    /// the Tokio runtime that made it, so each runtime (each test) needs its
    /// own. Client-side retries are off, so that every request the audit
    /// log shows is one the caller made.
    pub async fn client(&self) -> anyhow::Result<Client> {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig)?;
        let mut config = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
        config.default_retry = false;
        Ok(Client::try_from(config)?)
    }
}

/// The user name of ServiceAccount `name` in namespace `ns`.
pub fn service_account_user(ns: &str, name: &str) -> String {
    format!("system:serviceaccount:{ns}:{name}")
}

impl TestBed {
    /// ServiceAccount `name` in namespace `ns` (which must exist), bound to
    /// `cluster-admin`, with a token valid for two hours; its kubeconfig is
    /// written into the bed's directory.
    pub async fn identity(&self, admin: &Client, ns: &str, name: &str) -> anyhow::Result<Identity> {
        self.identity_as(admin, ns, name, "cluster-admin").await
    }

    /// [`TestBed::identity`], bound to ClusterRole `role` instead.
    pub async fn identity_as(
        &self,
        admin: &Client,
        ns: &str,
        name: &str,
        role: &str,
    ) -> anyhow::Result<Identity> {
        create_or_keep(
            Api::<ServiceAccount>::namespaced(admin.clone(), ns),
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?,
        )
        .await?;
        let binding = format!("{ns}-{name}");
        create_or_keep(
            Api::<ClusterRoleBinding>::all(admin.clone()),
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": binding},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]
            }))?,
        )
        .await?;
        let token = Api::<ServiceAccount>::namespaced(admin.clone(), ns)
            .create_token_request(
                name,
                &PostParams::default(),
                &serde_json::from_value(
                    serde_json::json!({"spec": {"audiences": [], "expirationSeconds": 7200}}),
                )?,
            )
            .await?
            .status
            .and_then(|s| s.token)
            .context("no token issued")?;
        let kubeconfig = self.dir().join(format!("{binding}.kubeconfig"));
        let ca = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, self.ca_pem()?);
        std::fs::write(
            &kubeconfig,
            serde_yaml_ng::to_string(&serde_json::json!({
                "apiVersion": "v1", "kind": "Config", "current-context": "bed",
                "clusters": [{"name": "bed", "cluster": {"server": self.server(), "certificate-authority-data": ca}}],
                "users": [{"name": name, "user": {"token": &token}}],
                "contexts": [{"name": "bed", "context": {"cluster": "bed", "user": name, "namespace": ns}}]
            }))?,
        )?;
        Ok(Identity {
            kubeconfig,
            user: service_account_user(ns, name),
            token,
        })
    }
}
