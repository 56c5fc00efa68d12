//! A provider wrapper that counts and times every cloud call in
//! `berth_provider_requests_total{driver,op,result}` and
//! `berth_provider_request_duration_seconds{driver,op}`, so drivers stay
//! free of telemetry code.

use std::sync::Arc;
use std::time::Instant;

use super::{ListRequest, MachineRequest, Provider, ProviderError, Vm};
use crate::telemetry::{Metrics, RESULT_OK};

pub(crate) struct Instrumented {
    inner: Arc<dyn Provider>,
    metrics: Arc<Metrics>,
}

impl Instrumented {
    pub fn new(inner: Arc<dyn Provider>, metrics: Arc<Metrics>) -> Self {
        Self { inner, metrics }
    }

    fn observe<T>(&self, op: &str, started: Instant, result: &Result<T, ProviderError>) {
        let label = match result {
            Ok(_) => RESULT_OK,
            Err(e) => e.metric_label(),
        };
        self.metrics
            .record_provider_request(self.inner.name(), op, label, started.elapsed());
    }
}

#[async_trait::async_trait]
impl Provider for Instrumented {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn validate(&self, provider_spec: &serde_json::Value) -> Result<(), ProviderError> {
        self.inner.validate(provider_spec)
    }

    async fn create(&self, req: &MachineRequest) -> Result<Vm, ProviderError> {
        let started = Instant::now();
        let result = self.inner.create(req).await;
        self.observe("create", started, &result);
        result
    }

    async fn delete(&self, req: &MachineRequest) -> Result<(), ProviderError> {
        let started = Instant::now();
        let result = self.inner.delete(req).await;
        self.observe("delete", started, &result);
        result
    }

    async fn get(&self, req: &MachineRequest) -> Result<Vm, ProviderError> {
        let started = Instant::now();
        let result = self.inner.get(req).await;
        self.observe("get", started, &result);
        result
    }

    async fn stop(&self, req: &MachineRequest) -> Result<(), ProviderError> {
        let started = Instant::now();
        let result = self.inner.stop(req).await;
        self.observe("stop", started, &result);
        result
    }

    async fn list(&self, req: &ListRequest) -> Result<Vec<Vm>, ProviderError> {
        let started = Instant::now();
        let result = self.inner.list(req).await;
        self.observe("list", started, &result);
        result
    }
    fn list_scope(&self, req: &ListRequest) -> String {
        self.inner.list_scope(req)
    }
}
