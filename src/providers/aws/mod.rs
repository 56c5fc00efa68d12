//! The `aws` provider: a Machine's VM is an EC2 instance.
//!
//! - **create**: first looks for an instance already tagged with the
//!   Machine's UID and adopts it (a crash between `RunInstances` and the
//!   providerID write leaves exactly one instance); else `RunInstances` with
//!   a client token derived from the UID (EC2 answers a repeated token with
//!   the instance it made), tagged on the instance and its volumes.
//! - **delete**: `TerminateInstances`, "in progress" until EC2 says
//!   `terminated`, which alone is done. An instance EC2 does not find is
//!   "not found", never taken for terminated here: EC2 is eventually
//!   consistent and can answer `InvalidInstanceID.NotFound` for an instance
//!   that runs (the Machine controller waits `--vm-not-found-grace` before
//!   it believes it). The instance is looked for in the region of its
//!   providerID's zone, so a class whose region changed does not lose it.
//!   It never terminates an instance that does not carry this cluster's tag
//!   and the Machine's UID.
//! - **stop** (the fence of a remediation): `StopInstances` with `Force`
//!   (a dead VM's guest cannot flush anything: nothing is waited for from
//!   it), "in progress" until EC2 says `stopped` (or `terminated`), with
//!   the same ownership check as delete.
//! - **get / list**: by instance id, by the Machine's UID tag, or every
//!   instance carrying this cluster's tag (for orphan collection).
//!
//! The providerID is `aws:///<availability-zone>/<instance-id>`, the form
//! the kubelet's cloud provider, Cluster API's AWS provider and Karpenter
//! use, so that the Node the instance registers is matched to its Machine.
//!
//! Every EC2 request is counted in `berth_provider_requests_total` with the
//! EC2 action as `op`. The calls berth makes are exactly those of
//! `deploy/aws/iam-policy.json`.

mod credentials;
mod ec2;
mod errors;
mod spec;
mod tags;

use std::sync::Arc;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};

use self::ec2::{CallError, Ec2, Instance};
use self::errors::{Class, classify, provider_error};
use self::spec::{AwsSpec, InstanceProfile};
use super::{ListRequest, MachineRef, MachineRequest, Provider, ProviderError, Vm, VmState};
use crate::api::SecretReference;
use crate::telemetry::{Metrics, RESULT_OK};

pub(crate) const NAME: &str = "aws";

/// The EC2 actions berth calls: exactly those `deploy/aws/iam-policy.json`
/// grants (a unit test holds the two together).
const RUN_INSTANCES: &str = "RunInstances";
const DESCRIBE_INSTANCES: &str = "DescribeInstances";
const TERMINATE_INSTANCES: &str = "TerminateInstances";
const STOP_INSTANCES: &str = "StopInstances";
const DESCRIBE_IMAGES: &str = "DescribeImages";
const ACTIONS: &[&str] = &[
    RUN_INSTANCES,
    DESCRIBE_INSTANCES,
    TERMINATE_INSTANCES,
    STOP_INSTANCES,
    DESCRIBE_IMAGES,
];

/// How soon to look again at an instance that is starting or terminating.
const POLL_AFTER: Duration = Duration::from_secs(5);
/// The states in which an instance still exists as far as a Machine cares.
const LIVE_STATES: &str = "pending,running,stopping,stopped,shutting-down";

/// The `aws` provider's settings (flags of `berth run`).
#[derive(Debug, Clone)]
pub struct AwsSettings {
    /// This cluster's id: the value of the `berth.dev/cluster` tag.
    pub cluster_id: String,
    /// An EC2 endpoint to use instead of the region's own (a VPC endpoint,
    /// or an emulator).
    pub endpoint: Option<String>,
}

pub struct AwsProvider {
    settings: AwsSettings,
    http: ec2::Http,
    credentials: credentials::CredentialSource,
    metrics: Arc<Metrics>,
}

impl AwsProvider {
    pub fn new(
        kube: kube::Client,
        settings: AwsSettings,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Self> {
        Ok(Self {
            settings,
            http: ec2::http()?,
            credentials: credentials::CredentialSource::new(kube),
            metrics,
        })
    }

    fn endpoint(&self, region: &str) -> String {
        match &self.settings.endpoint {
            Some(e) => e.clone(),
            None => regional_endpoint(region),
        }
    }

    /// One EC2 call, counted. Calls that are safe to repeat (all but
    /// `RunInstances`, whose retry is the next reconcile, which looks for
    /// the instance by tag first) are retried at once on throttling and
    /// transient failures, with jittered backoff.
    async fn call(
        &self,
        region: &str,
        secret: Option<&SecretReference>,
        action: &str,
        params: &[(String, String)],
    ) -> Result<String, ProviderError> {
        debug_assert!(ACTIONS.contains(&action), "{action} is not in ACTIONS");
        let creds = self.credentials.get(secret).await?;
        let endpoint = self.endpoint(region);
        let client = Ec2 {
            http: &self.http,
            endpoint: &endpoint,
            region,
            credentials: &creds,
        };
        let once = || async {
            let started = std::time::Instant::now();
            let result = client.call(action, params).await;
            let label = match &result {
                Ok(_) => RESULT_OK,
                Err(e) => classify(e).label(),
            };
            self.metrics
                .record_provider_request(NAME, action, label, started.elapsed());
            result
        };
        let result = if action == RUN_INSTANCES {
            once().await
        } else {
            once.retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(200))
                    .with_max_delay(Duration::from_secs(2))
                    .with_max_times(2)
                    .with_jitter(),
            )
            .when(|e: &CallError| classify(e).retryable())
            .await
        };
        result.map_err(|e| {
            if matches!(classify(&e), Class::Unauthorized) || e.code == "ExpiredToken" {
                self.credentials.forget(secret);
            }
            provider_error(action, &e)
        })
    }

    async fn describe(
        &self,
        region: &str,
        secret: Option<&SecretReference>,
        filters: &[(&str, &str)],
        ids: &[&str],
    ) -> Result<Vec<Instance>, ProviderError> {
        let mut params = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            params.push((format!("InstanceId.{}", i + 1), (*id).to_string()));
        }
        for (i, (name, values)) in filters.iter().enumerate() {
            params.push((format!("Filter.{}.Name", i + 1), (*name).to_string()));
            for (j, v) in values.split(',').enumerate() {
                params.push((format!("Filter.{}.Value.{}", i + 1, j + 1), v.to_string()));
            }
        }
        if ids.is_empty() {
            params.push(("MaxResults".into(), "1000".into()));
        }
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut page = params.clone();
            if let Some(t) = &token {
                page.push(("NextToken".into(), t.clone()));
            }
            let xml = match self.call(region, secret, DESCRIBE_INSTANCES, &page).await {
                Ok(xml) => xml,
                // Asked by id, an instance EC2 no longer knows.
                Err(ProviderError::NotFound(_)) => return Ok(out),
                Err(e) => return Err(e),
            };
            out.extend(ec2::instances(&xml).map_err(ProviderError::Transient)?);
            token = ec2::next_token(&xml);
            if token.is_none() {
                return Ok(out);
            }
        }
    }

    /// The live instances tagged as this Machine's, oldest first.
    async fn by_uid(
        &self,
        spec: &AwsSpec,
        req: &MachineRequest,
    ) -> Result<Vec<Instance>, ProviderError> {
        let uid_tag = format!("tag:{}", tags::MACHINE_UID);
        let cluster_tag = format!("tag:{}", tags::CLUSTER);
        let mut found = self
            .describe(
                &spec.region,
                req.secret_ref.as_ref(),
                &[
                    (&uid_tag, &req.uid),
                    (&cluster_tag, &self.settings.cluster_id),
                    ("instance-state-name", LIVE_STATES),
                ],
                &[],
            )
            .await?;
        found.retain(|i| self.owns(i) && i.tags.get(tags::MACHINE_UID) == Some(&req.uid));
        found.sort_by(|a, b| a.launched.cmp(&b.launched).then(a.id.cmp(&b.id)));
        Ok(found)
    }

    /// The Machine's instance: by the id of its providerID, else by its
    /// UID tag. `None` when there is none, or it is terminated.
    async fn instance_of(
        &self,
        spec: &AwsSpec,
        req: &MachineRequest,
    ) -> Result<Option<Instance>, ProviderError> {
        Ok(self
            .lookup(spec, req)
            .await?
            .filter(|i| i.state != "terminated"))
    }

    /// The Machine's instance in any state (a terminated one is listed for
    /// about an hour): by the id of its providerID, in the region of the
    /// providerID's zone (a class whose region changed does not lose it),
    /// else by its UID tag.
    async fn lookup(
        &self,
        spec: &AwsSpec,
        req: &MachineRequest,
    ) -> Result<Option<Instance>, ProviderError> {
        let found = match req.provider_id.as_deref() {
            Some(pid) => {
                let id = instance_id(pid).ok_or_else(|| {
                    ProviderError::Permanent(format!(
                        "providerID {pid:?} is not aws:///<zone>/<instance-id>"
                    ))
                })?;
                let region = region_of(req, spec);
                self.describe(&region, req.secret_ref.as_ref(), &[], &[id])
                    .await?
            }
            None => self.by_uid(spec, req).await?,
        };
        // A live one first, should EC2 list two.
        Ok(found
            .iter()
            .find(|i| i.state != "terminated")
            .or(found.first())
            .cloned())
    }

    /// The instance of `req` (see [`AwsProvider::lookup`]), or `NotFound`
    /// (which says only that EC2 does not find it now).
    async fn found(&self, spec: &AwsSpec, req: &MachineRequest) -> Result<Instance, ProviderError> {
        self.lookup(spec, req).await?.ok_or_else(|| {
            ProviderError::NotFound(
                req.provider_id
                    .clone()
                    .unwrap_or_else(|| format!("no instance tagged {}", req.uid)),
            )
        })
    }

    fn owns(&self, i: &Instance) -> bool {
        i.tags.get(tags::CLUSTER) == Some(&self.settings.cluster_id)
    }

    async fn run_instance(
        &self,
        spec: &AwsSpec,
        req: &MachineRequest,
    ) -> Result<Instance, ProviderError> {
        let secret = req.secret_ref.as_ref();
        let root_device = match &spec.root_volume {
            None => None,
            Some(_) => {
                let xml = self
                    .call(
                        &spec.region,
                        secret,
                        DESCRIBE_IMAGES,
                        &[("ImageId.1".into(), spec.image_id.clone())],
                    )
                    .await?;
                Some(ec2::root_device_name(&xml).ok_or_else(|| {
                    ProviderError::InvalidSpec(format!(
                        "imageId: {} is not an image this account can see",
                        spec.image_id
                    ))
                })?)
            }
        };
        let params = run_params(spec, req, &self.settings.cluster_id, root_device.as_deref());
        let xml = self
            .call(&spec.region, secret, RUN_INSTANCES, &params)
            .await?;
        #[cfg(feature = "fault-injection")]
        fault_injection::after_run_instances();
        ec2::instances(&xml)
            .map_err(ProviderError::Transient)?
            .into_iter()
            .next()
            .ok_or_else(|| ProviderError::Transient("RunInstances answered no instance".into()))
    }
}

/// Crash points that only the tests' build has: the integration tests
/// build berth with the `fault-injection` feature (through the development
/// kit), and the release build, the image and `cargo build` never do, so
/// the code below is not in the binary that runs in clusters.
#[cfg(feature = "fault-injection")]
mod fault_injection {
    /// Set, the process aborts (no cleanup, like `kill -9`) right after
    /// EC2 accepted a `RunInstances`, before the providerID is written.
    pub(crate) const ABORT_AFTER_RUN_INSTANCES: &str = "BERTH_FAULT_ABORT_AFTER_RUN_INSTANCES";

    pub(crate) fn after_run_instances() {
        if std::env::var_os(ABORT_AFTER_RUN_INSTANCES).is_some() {
            eprintln!("fault injection: aborting after RunInstances");
            std::process::abort();
        }
    }
}

/// EC2's endpoint for a region.
fn regional_endpoint(region: &str) -> String {
    if region.starts_with("cn-") {
        format!("https://ec2.{region}.amazonaws.com.cn/")
    } else {
        format!("https://ec2.{region}.amazonaws.com/")
    }
}

/// The instance id of an `aws:///<zone>/<id>` providerID.
fn instance_id(provider_id: &str) -> Option<&str> {
    let rest = provider_id.strip_prefix("aws://")?;
    let id = rest.rsplit('/').next()?;
    id.starts_with("i-").then_some(id)
}

/// Where a list looks: the class's region, with its credentials (the
/// account).
fn list_scope(req: &ListRequest) -> String {
    let region = parse_spec(&req.provider_spec)
        .map(|s| s.region)
        .unwrap_or_else(|e| format!("(invalid: {e})"));
    format!(
        "{region}\n{:?}",
        req.secret_ref.as_ref().map(|s| (&s.namespace, &s.name))
    )
}

/// The region of the Machine's instance: that of its providerID's zone
/// (`aws:///us-east-1a/i-…` is in `us-east-1`), else the class's.
fn region_of(req: &MachineRequest, spec: &AwsSpec) -> String {
    req.provider_id
        .as_deref()
        .and_then(|pid| pid.strip_prefix("aws:///")?.split('/').next())
        .and_then(region_of_zone)
        .unwrap_or_else(|| spec.region.clone())
}

/// The region of an availability zone, local zone or wavelength zone:
/// `us-east-1a` → `us-east-1`, `us-gov-west-1b` → `us-gov-west-1`,
/// `us-west-2-lax-1a` → `us-west-2`. `None` for what is not a zone name.
fn region_of_zone(zone: &str) -> Option<String> {
    let parts: Vec<&str> = zone.split('-').collect();
    let (prefix, number) = match parts.as_slice() {
        [a, "gov", b, n, ..] => (format!("{a}-gov-{b}"), *n),
        [a, b, n, ..] => (format!("{a}-{b}"), *n),
        _ => return None,
    };
    let digits: String = number.chars().take_while(char::is_ascii_digit).collect();
    let letters_only = prefix.chars().all(|c| c.is_ascii_lowercase() || c == '-');
    (!digits.is_empty() && letters_only).then(|| format!("{prefix}-{digits}"))
}

fn provider_id(i: &Instance) -> String {
    format!("aws:///{}/{}", i.zone, i.id)
}

/// The client token of a Machine's `RunInstances`: the same for every
/// attempt, so EC2 makes one instance however often it is asked. EC2 takes
/// at most 64 ASCII characters; a Kubernetes UID is 36.
fn client_token(uid: &str) -> String {
    let mut t = format!("berth-{uid}");
    t.truncate(64);
    t
}

/// The parameters of a Machine's `RunInstances`.
fn run_params(
    spec: &AwsSpec,
    req: &MachineRequest,
    cluster_id: &str,
    root_device: Option<&str>,
) -> Vec<(String, String)> {
    use base64::Engine as _;
    let mut p: Vec<(String, String)> = vec![
        ("ImageId".into(), spec.image_id.clone()),
        ("InstanceType".into(), spec.instance_type.clone()),
        ("MinCount".into(), "1".into()),
        ("MaxCount".into(), "1".into()),
        ("ClientToken".into(), client_token(&req.uid)),
    ];
    if let Some(s) = &spec.subnet_id {
        p.push(("SubnetId".into(), s.clone()));
    }
    for (i, sg) in spec.security_group_ids.iter().enumerate() {
        p.push((format!("SecurityGroupId.{}", i + 1), sg.clone()));
    }
    match &spec.iam_instance_profile {
        Some(InstanceProfile::Name(n)) => p.push(("IamInstanceProfile.Name".into(), n.clone())),
        Some(InstanceProfile::Arn(a)) => p.push(("IamInstanceProfile.Arn".into(), a.clone())),
        None => {}
    }
    if let Some(k) = &spec.key_name {
        p.push(("KeyName".into(), k.clone()));
    }
    if let Some(u) = spec.user_data_for(&req.name) {
        p.push((
            "UserData".into(),
            base64::engine::general_purpose::STANDARD.encode(u),
        ));
    }
    if let (Some(v), Some(device)) = (&spec.root_volume, root_device) {
        p.push(("BlockDeviceMapping.1.DeviceName".into(), device.to_string()));
        p.push((
            "BlockDeviceMapping.1.Ebs.VolumeSize".into(),
            v.size_gib.to_string(),
        ));
        if let Some(t) = &v.volume_type {
            p.push(("BlockDeviceMapping.1.Ebs.VolumeType".into(), t.clone()));
        }
        p.push((
            "BlockDeviceMapping.1.Ebs.DeleteOnTermination".into(),
            "true".into(),
        ));
    }
    let metadata = &spec.instance_metadata;
    p.push((
        "MetadataOptions.HttpTokens".into(),
        if metadata.tokens_required {
            "required"
        } else {
            "optional"
        }
        .into(),
    ));
    p.push((
        "MetadataOptions.HttpPutResponseHopLimit".into(),
        metadata.hop_limit.to_string(),
    ));
    p.push(("MetadataOptions.HttpEndpoint".into(), "enabled".into()));
    let mut all_tags: Vec<(&str, &str)> = vec![
        (tags::CLUSTER, cluster_id),
        (tags::MACHINE_UID, &req.uid),
        (tags::MACHINE_NAMESPACE, &req.namespace),
        (tags::MACHINE_NAME, &req.name),
        (tags::NAME, &req.name),
    ];
    all_tags.extend(spec.tags.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    for (s, resource) in ["instance", "volume"].iter().enumerate() {
        let s = s + 1;
        p.push((
            format!("TagSpecification.{s}.ResourceType"),
            (*resource).into(),
        ));
        for (t, (k, v)) in all_tags.iter().enumerate() {
            let t = t + 1;
            p.push((format!("TagSpecification.{s}.Tag.{t}.Key"), (*k).into()));
            p.push((format!("TagSpecification.{s}.Tag.{t}.Value"), (*v).into()));
        }
    }
    p
}

/// A VM as berth sees an instance.
fn vm_of(i: &Instance) -> Vm {
    let state = match i.state.as_str() {
        "pending" => VmState::Creating,
        "shutting-down" | "terminated" => VmState::Deleting,
        "stopped" => VmState::Stopped,
        // running, stopping: the instance is there; whether its Node is
        // healthy is for the Node to say.
        _ => VmState::Running,
    };
    let machine = (|| {
        Some(MachineRef {
            namespace: i.tags.get(tags::MACHINE_NAMESPACE)?.clone(),
            name: i.tags.get(tags::MACHINE_NAME)?.clone(),
            uid: i.tags.get(tags::MACHINE_UID)?.clone(),
        })
    })();
    Vm {
        provider_id: provider_id(i),
        state,
        machine,
        created_at: i.launched,
    }
}

fn parse_spec(v: &serde_json::Value) -> Result<AwsSpec, ProviderError> {
    AwsSpec::parse(v).map_err(|e| ProviderError::InvalidSpec(e.to_string()))
}

#[async_trait::async_trait]
impl Provider for AwsProvider {
    fn name(&self) -> &'static str {
        NAME
    }

    fn counts_own_requests(&self) -> bool {
        true
    }

    fn validate(&self, provider_spec: &serde_json::Value) -> Result<(), ProviderError> {
        parse_spec(provider_spec).map(|_| ())
    }

    async fn create(&self, req: &MachineRequest) -> Result<Vm, ProviderError> {
        let spec = parse_spec(&req.provider_spec)?;
        if req.uid.is_empty() {
            return Err(ProviderError::Permanent("the Machine has no UID".into()));
        }
        if req.provider_id.is_some() {
            return self
                .instance_of(&spec, req)
                .await?
                .map(|i| vm_of(&i))
                .ok_or_else(|| {
                    ProviderError::NotFound(req.provider_id.clone().unwrap_or_default())
                });
        }
        let mut found = self.by_uid(&spec, req).await?;
        if !found.is_empty() {
            let adopted = found.remove(0);
            // Two live instances for one Machine: only an EC2 that ignored
            // the client token could make them. Both carry this Machine's
            // UID and this cluster's tag, so the later ones are certainly
            // ours and certainly extra.
            for extra in found {
                tracing::warn!(
                    machine = %req.name, namespace = %req.namespace, instance = %extra.id,
                    adopted = %adopted.id,
                    "a second instance carries this Machine's UID; terminating it"
                );
                match self
                    .terminate(&spec.region, req.secret_ref.as_ref(), &extra.id)
                    .await
                {
                    Ok(_) | Err(ProviderError::NotFound(_)) => {}
                    Err(e) => return Err(e),
                }
            }
            tracing::info!(
                machine = %req.name, namespace = %req.namespace, instance = %adopted.id,
                "adopting the instance tagged with this Machine's UID"
            );
            return Ok(vm_of(&adopted));
        }
        let made = self.run_instance(&spec, req).await?;
        Ok(vm_of(&made))
    }

    async fn delete(&self, req: &MachineRequest) -> Result<(), ProviderError> {
        let spec = parse_spec(&req.provider_spec)?;
        // Not found is not terminated: EC2 is eventually consistent, and
        // may not find an instance that runs. Only `terminated` is gone for
        // certain; the caller decides how long a not-found may last.
        let i = self.found(&spec, req).await?;
        if i.state == "terminated" {
            return Ok(());
        }
        self.made_for(&i, req, "terminates")?;
        if i.state == "shutting-down" {
            return Err(ProviderError::InProgress {
                what: format!("instance {} is shutting down", i.id),
                retry_after: POLL_AFTER,
            });
        }
        let region = region_of(req, &spec);
        match self
            .terminate(&region, req.secret_ref.as_ref(), &i.id)
            .await?
        {
            Some(state) if state == "terminated" => Ok(()),
            state => Err(ProviderError::InProgress {
                what: format!(
                    "instance {} is {}",
                    i.id,
                    state.as_deref().unwrap_or("being terminated")
                ),
                retry_after: POLL_AFTER,
            }),
        }
    }

    async fn stop(&self, req: &MachineRequest) -> Result<(), ProviderError> {
        let spec = parse_spec(&req.provider_spec)?;
        // As for delete: not found is not stopped.
        let i = self.found(&spec, req).await?;
        if matches!(i.state.as_str(), "stopped" | "terminated") {
            return Ok(());
        }
        self.made_for(&i, req, "stops")?;
        let state = match i.state.as_str() {
            "stopping" | "shutting-down" => Some(i.state.clone()),
            _ => {
                let region = region_of(req, &spec);
                self.power(STOP_INSTANCES, &region, req.secret_ref.as_ref(), &i.id)
                    .await?
            }
        };
        match state.as_deref() {
            Some("stopped" | "terminated") => Ok(()),
            state => Err(ProviderError::InProgress {
                what: format!("instance {} is {}", i.id, state.unwrap_or("being stopped")),
                retry_after: POLL_AFTER,
            }),
        }
    }

    async fn get(&self, req: &MachineRequest) -> Result<Vm, ProviderError> {
        let spec = parse_spec(&req.provider_spec)?;
        self.instance_of(&spec, req)
            .await?
            .map(|i| vm_of(&i))
            .ok_or_else(|| {
                ProviderError::NotFound(
                    req.provider_id
                        .clone()
                        .unwrap_or_else(|| format!("no instance tagged {}", req.uid)),
                )
            })
    }

    /// An aws class lists the instances of its region, with its
    /// credentials (the account): classes that differ in image, type or
    /// subnet list the same instances.
    fn list_scope(&self, req: &ListRequest) -> String {
        list_scope(req)
    }

    async fn list(&self, req: &ListRequest) -> Result<Vec<Vm>, ProviderError> {
        let spec = parse_spec(&req.provider_spec)?;
        let cluster_tag = format!("tag:{}", tags::CLUSTER);
        let found = self
            .describe(
                &spec.region,
                req.secret_ref.as_ref(),
                &[
                    (&cluster_tag, &self.settings.cluster_id),
                    ("instance-state-name", LIVE_STATES),
                ],
                &[],
            )
            .await?;
        Ok(found.iter().filter(|i| self.owns(i)).map(vm_of).collect())
    }
}

impl AwsProvider {
    /// Terminates one instance in `region`; its state after the call, as
    /// EC2 says. An instance EC2 does not find is `NotFound` (perhaps not
    /// yet visible: never taken for terminated).
    async fn terminate(
        &self,
        region: &str,
        secret: Option<&SecretReference>,
        id: &str,
    ) -> Result<Option<String>, ProviderError> {
        self.power(TERMINATE_INSTANCES, region, secret, id).await
    }

    /// Whether `i` carries this cluster's tag and `req`'s Machine UID: the
    /// only instances berth `does` (terminates, stops) anything to.
    fn made_for(
        &self,
        i: &Instance,
        req: &MachineRequest,
        does: &str,
    ) -> Result<(), ProviderError> {
        if self.owns(i) && i.tags.get(tags::MACHINE_UID) == Some(&req.uid) {
            return Ok(());
        }
        Err(ProviderError::Permanent(format!(
            "instance {} does not carry this cluster's tag ({}={}) and this Machine's UID \
             ({}={}); berth {does} only instances it made for this Machine",
            i.id,
            tags::CLUSTER,
            self.settings.cluster_id,
            tags::MACHINE_UID,
            req.uid
        )))
    }

    /// `TerminateInstances` or `StopInstances` (forced: a dead guest is not
    /// waited for) of one instance in `region`; its state after the call,
    /// as EC2 says.
    async fn power(
        &self,
        action: &'static str,
        region: &str,
        secret: Option<&SecretReference>,
        id: &str,
    ) -> Result<Option<String>, ProviderError> {
        let mut params = vec![("InstanceId.1".to_string(), id.to_string())];
        if action == STOP_INSTANCES {
            params.push(("Force".into(), "true".into()));
        }
        let xml = self.call(region, secret, action, &params).await?;
        Ok(ec2::instances(&xml)
            .map_err(ProviderError::Transient)?
            .into_iter()
            .find(|i| i.id == id)
            .map(|i| i.state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> MachineRequest {
        MachineRequest {
            namespace: "prod".into(),
            name: "db-1".into(),
            uid: "0b5c3a52-5f1e-4c4e-9d43-0c1f6d2f7a11".into(),
            class: "c".into(),
            secret_ref: None,
            provider_spec: serde_json::Value::Null,
            provider_id: None,
        }
    }

    /// The policy operators attach grants exactly the calls the code
    /// makes: a new call without its permission would fail only in a real
    /// account, and a permission no call needs widens every install.
    #[test]
    fn the_iam_policy_grants_exactly_the_calls_the_code_makes() {
        let policy: serde_json::Value =
            serde_json::from_str(include_str!("../../../deploy/aws/iam-policy.json"))
                .expect("the policy is JSON");
        let mut granted = std::collections::BTreeSet::new();
        for statement in policy["Statement"].as_array().expect("statements") {
            let actions = match &statement["Action"] {
                serde_json::Value::String(a) => vec![a.clone()],
                serde_json::Value::Array(a) => a
                    .iter()
                    .map(|a| a.as_str().expect("an action").to_string())
                    .collect(),
                other => panic!("Action {other}"),
            };
            granted.extend(actions);
        }
        let mut wanted: std::collections::BTreeSet<String> =
            ACTIONS.iter().map(|a| format!("ec2:{a}")).collect();
        // Not calls of berth's: EC2 checks them for RunInstances' tags and
        // instance profile.
        wanted.insert("ec2:CreateTags".into());
        wanted.insert("iam:PassRole".into());
        assert_eq!(granted, wanted);
    }

    #[test]
    fn provider_ids_and_tokens_have_the_forms_ec2_and_kubernetes_use() {
        assert_eq!(
            instance_id("aws:///eu-west-1a/i-0123456789abcdef0"),
            Some("i-0123456789abcdef0")
        );
        assert_eq!(instance_id("aws://eu-west-1a/i-0123"), Some("i-0123"));
        assert_eq!(instance_id("fake:///ns/m"), None);
        assert_eq!(instance_id("aws:///eu-west-1a/"), None);
        let token = client_token(&request().uid);
        assert!(token.len() <= 64 && token.is_ascii(), "{token}");
        assert_eq!(
            token,
            client_token(&request().uid),
            "same Machine, same token"
        );
        assert_eq!(client_token(&"x".repeat(100)).len(), 64);
        assert_eq!(
            regional_endpoint("eu-west-1"),
            "https://ec2.eu-west-1.amazonaws.com/"
        );
        assert_eq!(
            regional_endpoint("cn-north-1"),
            "https://ec2.cn-north-1.amazonaws.com.cn/"
        );
    }

    #[test]
    fn run_instances_tags_the_instance_and_its_volumes_and_sets_every_field() {
        let spec = AwsSpec::parse(&serde_json::json!({
            "region": "eu-west-1", "imageId": "ami-12345678", "instanceType": "m6i.large",
            "subnetId": "subnet-12345678", "securityGroupIds": ["sg-12345678", "sg-87654321"],
            "iamInstanceProfile": "nodes", "keyName": "ops", "tags": {"team": "db"},
            "userData": "name={{machine}}", "rootVolume": {"sizeGiB": 40, "type": "gp3"}
        }))
        .expect("valid");
        let p = run_params(&spec, &request(), "prod-cluster", Some("/dev/xvda"));
        let get = |k: &str| p.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        assert_eq!(get("ImageId"), Some("ami-12345678"));
        assert_eq!(
            get("ClientToken"),
            Some(client_token(&request().uid).as_str())
        );
        assert_eq!(get("SubnetId"), Some("subnet-12345678"));
        assert_eq!(get("SecurityGroupId.2"), Some("sg-87654321"));
        assert_eq!(get("IamInstanceProfile.Name"), Some("nodes"));
        assert_eq!(get("KeyName"), Some("ops"));
        assert_eq!(get("UserData"), Some("bmFtZT1kYi0x"), "base64 of name=db-1");
        assert_eq!(get("BlockDeviceMapping.1.DeviceName"), Some("/dev/xvda"));
        assert_eq!(get("BlockDeviceMapping.1.Ebs.VolumeSize"), Some("40"));
        assert_eq!(get("BlockDeviceMapping.1.Ebs.VolumeType"), Some("gp3"));
        assert_eq!(get("MetadataOptions.HttpTokens"), Some("required"));
        assert_eq!(get("MetadataOptions.HttpPutResponseHopLimit"), Some("1"));
        for s in ["1", "2"] {
            let tags: Vec<(&str, &str)> = (1..=6)
                .map(|t| {
                    (
                        get(&format!("TagSpecification.{s}.Tag.{t}.Key")).expect("key"),
                        get(&format!("TagSpecification.{s}.Tag.{t}.Value")).expect("value"),
                    )
                })
                .collect();
            assert!(
                tags.contains(&("berth.dev/cluster", "prod-cluster")),
                "{tags:?}"
            );
            assert!(tags.contains(&("berth.dev/machine-uid", request().uid.as_str())));
            assert!(tags.contains(&("berth.dev/machine-namespace", "prod")));
            assert!(tags.contains(&("berth.dev/machine-name", "db-1")));
            assert!(tags.contains(&("Name", "db-1")));
            assert!(tags.contains(&("team", "db")));
        }
        assert_eq!(get("TagSpecification.1.ResourceType"), Some("instance"));
        assert_eq!(get("TagSpecification.2.ResourceType"), Some("volume"));

        let minimal = AwsSpec::parse(&serde_json::json!({
            "region": "eu-west-1", "imageId": "ami-12345678", "instanceType": "t3.micro"
        }))
        .expect("valid");
        let p = run_params(&minimal, &request(), "c", None);
        assert!(!p.iter().any(|(k, _)| k.starts_with("BlockDevice")
            || k == "UserData"
            || k == "SubnetId"
            || k.starts_with("IamInstanceProfile")));
    }

    #[test]
    fn an_instance_becomes_a_vm_naming_its_machine() {
        let mut i = Instance {
            id: "i-0123".into(),
            state: "pending".into(),
            zone: "eu-west-1a".into(),
            launched: None,
            tags: [
                (tags::MACHINE_NAMESPACE, "prod"),
                (tags::MACHINE_NAME, "db-1"),
                (tags::MACHINE_UID, "u"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        };
        let vm = vm_of(&i);
        assert_eq!(vm.provider_id, "aws:///eu-west-1a/i-0123");
        assert_eq!(vm.state, VmState::Creating);
        assert_eq!(
            vm.machine,
            Some(MachineRef {
                namespace: "prod".into(),
                name: "db-1".into(),
                uid: "u".into()
            })
        );
        for (state, want) in [
            ("running", VmState::Running),
            ("stopping", VmState::Running),
            ("stopped", VmState::Stopped),
            ("shutting-down", VmState::Deleting),
        ] {
            i.state = state.into();
            assert_eq!(vm_of(&i).state, want, "{state}");
        }
        i.tags.remove(tags::MACHINE_UID);
        assert_eq!(
            vm_of(&i).machine,
            None,
            "a VM without the UID tag names no Machine"
        );
    }

    #[test]
    fn the_region_comes_from_the_zone_of_the_provider_id() {
        for (zone, region) in [
            ("us-east-1a", Some("us-east-1")),
            ("eu-central-2c", Some("eu-central-2")),
            ("us-gov-west-1b", Some("us-gov-west-1")),
            ("us-west-2-lax-1a", Some("us-west-2")),
            ("ap-northeast-1-wl1-nrt-wlz-1", Some("ap-northeast-1")),
            ("", None),
            ("zone", None),
            ("us-east-a", None),
        ] {
            assert_eq!(region_of_zone(zone).as_deref(), region, "{zone}");
        }
    }

    #[test]
    fn classes_of_one_region_and_account_list_once() {
        let req = |spec: serde_json::Value, secret: Option<&str>| ListRequest {
            provider_spec: spec,
            secret_ref: secret.map(|n| SecretReference {
                name: n.into(),
                namespace: "ns".into(),
            }),
        };
        let small = serde_json::json!({"region": "eu-west-1", "imageId": "ami-12345678", "instanceType": "t3.micro"});
        let large = serde_json::json!({"region": "eu-west-1", "imageId": "ami-87654321", "instanceType": "m6i.large"});
        let elsewhere = serde_json::json!({"region": "us-east-1", "imageId": "ami-12345678", "instanceType": "t3.micro"});
        assert_eq!(
            list_scope(&req(small.clone(), Some("a"))),
            list_scope(&req(large, Some("a")))
        );
        assert_ne!(
            list_scope(&req(small.clone(), Some("a"))),
            list_scope(&req(elsewhere, Some("a")))
        );
        assert_ne!(
            list_scope(&req(small.clone(), Some("a"))),
            list_scope(&req(small, Some("b"))),
            "another account"
        );
    }
}
