//! A provider wrapper that refuses to create or delete a VM while the
//! process may not act (it lost, or never held, leadership): the cloud is
//! fenced as the API server is (see `wiring::fence`). Reads go through.

use std::sync::Arc;

use super::{ListRequest, MachineRequest, Provider, ProviderError, Vm};

/// Whether the process may act now.
pub type MayAct = Arc<dyn Fn() -> bool + Send + Sync>;

pub(crate) struct Gated {
    inner: Arc<dyn Provider>,
    may_act: MayAct,
}

impl Gated {
    pub fn new(inner: Arc<dyn Provider>, may_act: MayAct) -> Self {
        Self { inner, may_act }
    }

    fn check(&self, op: &str) -> Result<(), ProviderError> {
        if (self.may_act)() {
            Ok(())
        } else {
            Err(ProviderError::Transient(format!(
                "not leader: {op} not sent to the cloud (leadership lost or expired)"
            )))
        }
    }
}

#[async_trait::async_trait]
impl Provider for Gated {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn counts_own_requests(&self) -> bool {
        self.inner.counts_own_requests()
    }

    fn validate(&self, provider_spec: &serde_json::Value) -> Result<(), ProviderError> {
        self.inner.validate(provider_spec)
    }

    async fn create(&self, req: &MachineRequest) -> Result<Vm, ProviderError> {
        self.check("create")?;
        self.inner.create(req).await
    }

    async fn delete(&self, req: &MachineRequest) -> Result<(), ProviderError> {
        self.check("delete")?;
        self.inner.delete(req).await
    }

    async fn get(&self, req: &MachineRequest) -> Result<Vm, ProviderError> {
        self.inner.get(req).await
    }

    async fn stop(&self, req: &MachineRequest) -> Result<(), ProviderError> {
        self.check("stop")?;
        self.inner.stop(req).await
    }

    async fn list(&self, req: &ListRequest) -> Result<Vec<Vm>, ProviderError> {
        self.inner.list(req).await
    }
    fn list_scope(&self, req: &ListRequest) -> String {
        self.inner.list_scope(req)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::providers::fake::FakeProvider;

    #[tokio::test]
    async fn writes_wait_for_leadership_reads_do_not() {
        let leader = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&leader);
        let client = kube::Client::try_from(kube::Config::new(
            "http://127.0.0.1:9".parse().expect("uri"),
        ))
        .expect("client");
        let gated = Gated::new(
            Arc::new(FakeProvider::new(client)),
            Arc::new(move || flag.load(Ordering::Relaxed)),
        );
        let req = MachineRequest {
            namespace: "a".into(),
            name: "m".into(),
            uid: "u-1".into(),
            class: "c".into(),
            secret_ref: None,
            provider_spec: serde_json::Value::Null,
            provider_id: Some("fake:///m".into()),
        };
        let refused = gated.delete(&req).await;
        assert!(
            matches!(&refused, Err(ProviderError::Transient(m)) if m.starts_with("not leader")),
            "{refused:?}"
        );
        assert!(matches!(
            gated.create(&req).await,
            Err(ProviderError::Transient(_))
        ));
        leader.store(true, Ordering::Relaxed);
        // Let through: the fake provider's own answer (its API server is
        // not there), not the gate's.
        let sent = gated.delete(&req).await;
        assert!(
            !matches!(&sent, Err(ProviderError::Transient(m)) if m.starts_with("not leader")),
            "{sent:?}"
        );
    }
}
