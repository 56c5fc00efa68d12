//! The cloud side of the aws tests: moto's EC2 server (a real emulator),
//! optionally behind a fault-injecting proxy, the test bed's stand-in for
//! the kubelet that joins a running instance to the cluster, the
//! credentials Secret and the MachineClass, and `berth run` pointed at it.

use std::time::Duration;

use berth::api::Machine;
use berth_devkit::moto::kubelet::{KubeletOptions, MotoKubelet, NodeNaming};
use berth_devkit::moto::proxy::FaultProxy;
use berth_devkit::moto::{Ec2, Moto};
use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::api::{Api, PostParams};

use super::pool::{POOL, create};
use super::process::Berth;
use super::{LONG, class};

pub const REGION: &str = "eu-west-1";

/// Credentials for the standard AWS chain's first link, the environment
/// (moto takes any keys).
pub const CHAIN_CREDENTIALS: &[(&str, &str)] = &[
    ("AWS_ACCESS_KEY_ID", "AKIDBERTHCHAIN"),
    ("AWS_SECRET_ACCESS_KEY", "berth-chain-secret-key"),
];

/// moto, the kubelet stand-in and what a class needs, for one test
/// namespace (its cluster id is the namespace: every test owns its tag).
pub struct Cloud {
    pub moto: Moto,
    pub proxy: Option<FaultProxy>,
    pub ec2: Ec2,
    pub cluster_id: String,
    pub image: String,
    pub subnet: String,
    _kubelet: MotoKubelet,
}

impl Cloud {
    /// moto, and a kubelet stand-in that registers a kwok Node (labelled
    /// with the test's pool) for each running instance of this cluster.
    pub async fn start(client: &Client, ns: &str, proxied: bool) -> Self {
        let moto = Moto::start().await.expect("moto starts");
        let ec2 = moto.client(REGION);
        let image = ec2.image_id().await.expect("an image moto knows");
        let subnet = ec2
            .default_subnets()
            .await
            .expect("the default VPC's subnets")
            .into_iter()
            .next()
            .expect("a default subnet")
            .id;
        let proxy = if proxied {
            Some(
                FaultProxy::start(&moto.endpoint())
                    .await
                    .expect("the proxy starts"),
            )
        } else {
            None
        };
        let kubelet = MotoKubelet::start_with(
            client.clone(),
            moto.client(REGION),
            // Every moto server hands out the same first addresses, so
            // the Nodes of tests sharing the bed are named by instance id.
            KubeletOptions::new(ns)
                .label(POOL, ns)
                .naming(NodeNaming::InstanceId),
        );
        Self {
            moto,
            proxy,
            ec2,
            cluster_id: ns.to_string(),
            image,
            subnet,
            _kubelet: kubelet,
        }
    }

    /// Where berth sends its EC2 calls: the proxy when there is one.
    pub fn endpoint(&self) -> String {
        match &self.proxy {
            Some(p) => p.endpoint(),
            None => self.moto.endpoint(),
        }
    }

    /// The proxy in front of moto.
    pub fn proxy(&self) -> &FaultProxy {
        self.proxy.as_ref().expect("a proxied cloud")
    }

    /// A valid providerSpec for this cloud, with `extra` fields merged in.
    pub fn spec(&self, extra: serde_json::Value) -> serde_json::Value {
        let mut spec = serde_json::json!({
            "region": REGION,
            "imageId": self.image,
            "instanceType": "t3.micro",
            "subnetId": self.subnet,
            "tags": {"team": "storage"},
            "userData": "#!/bin/sh\necho {{machine}}",
        });
        if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                s.insert(k.clone(), v.clone());
            }
        }
        spec
    }

    /// A credentials Secret `aws-credentials` in `ns` (moto takes any keys)
    /// and an aws MachineClass `name` that names it.
    pub async fn class(&self, client: &Client, ns: &str, name: &str, spec: serde_json::Value) {
        self.class_with(client, ns, name, spec, true).await;
    }

    /// An aws MachineClass `name`; with `secret`, it names a credentials
    /// Secret, else berth's own credentials chain applies (see
    /// [`CHAIN_CREDENTIALS`]).
    pub async fn class_with(
        &self,
        client: &Client,
        ns: &str,
        name: &str,
        spec: serde_json::Value,
        secret: bool,
    ) {
        let mut c = class(name, "aws", spec);
        if !secret {
            create(Api::all(client.clone()), c).await;
            return;
        }
        let secret: Secret = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "aws-credentials", "namespace": ns},
            "stringData": {
                "AWS_ACCESS_KEY_ID": "AKIDBERTHTEST",
                "AWS_SECRET_ACCESS_KEY": "berth-test-secret-key",
            }
        }))
        .expect("secret");
        match Api::<Secret>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &secret)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => panic!("creating the credentials Secret: {e}"),
        }
        c.spec.secret_ref = Some(berth::api::SecretReference {
            name: "aws-credentials".into(),
            namespace: ns.into(),
        });
        create(Api::all(client.clone()), c).await;
    }

    /// `berth run` for `ns` with the aws provider pointed at this cloud.
    pub fn berth(&self, kubeconfig: &std::path::Path, ns: &str, extra: &[&str]) -> Berth {
        self.berth_with(kubeconfig, ns, extra, &[])
    }

    pub fn berth_with(
        &self,
        kubeconfig: &std::path::Path,
        ns: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Berth {
        let endpoint = format!("--aws-endpoint-url={}", self.endpoint());
        let cluster = format!("--cluster-id={}", self.cluster_id);
        let mut flags = vec![
            "--namespace",
            ns,
            "--leader-elect=false",
            "--providers=aws",
            &endpoint,
            &cluster,
        ];
        flags.extend_from_slice(extra);
        Berth::spawn_with(kubeconfig, &flags, env)
    }

    /// The instances tagged with a Machine's UID, whatever their state.
    pub async fn instances_of(&self, m: &Machine) -> Vec<berth_devkit::moto::ec2::Instance> {
        let uid = m.metadata.uid.as_deref().expect("uid");
        self.ec2
            .instances_tagged("berth.dev/machine-uid", uid)
            .await
            .expect("describe")
    }

    /// Waits until instance `id` is in `state`.
    pub async fn wait_state(&self, id: &str, state: &str) {
        self.wait_state_within(id, state, LONG).await;
    }

    /// Waits, up to `within`, until instance `id` is in `state`.
    pub async fn wait_state_within(&self, id: &str, state: &str, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let now = self.ec2.instance_state(id).await.expect("describe");
            if now.as_deref() == Some(state) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{id} never {state} (is {now:?})"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// A stand-in for the container credentials endpoint of the AWS chain
/// (`AWS_CONTAINER_CREDENTIALS_FULL_URI`, as on ECS or EKS Pod Identity):
/// answers 500 until [`CredentialsEndpoint::serve`], then credentials moto
/// takes. It counts the requests it gets.
pub struct CredentialsEndpoint {
    pub url: String,
    serving: std::sync::Arc<std::sync::atomic::AtomicBool>,
    asked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl CredentialsEndpoint {
    pub async fn start() -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let url = format!(
            "http://{}/credentials",
            listener.local_addr().expect("its address")
        );
        let serving = Arc::new(AtomicBool::new(false));
        let asked = Arc::new(AtomicUsize::new(0));
        let (s, a) = (serving.clone(), asked.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (serving, asked) = (s.clone(), a.clone());
                tokio::spawn(async move {
                    let (mut got, mut buf) = (Vec::new(), [0u8; 2048]);
                    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                    asked.fetch_add(1, Ordering::Relaxed);
                    let (status, body) = if serving.load(Ordering::Relaxed) {
                        (
                            "200 OK",
                            serde_json::json!({
                                "AccessKeyId": "AKIDBERTHCONTAINER",
                                "SecretAccessKey": "berth-container-secret-key",
                                "Token": "berth-container-token",
                                "Expiration": "2099-01-01T00:00:00Z",
                            })
                            .to_string(),
                        )
                    } else {
                        ("500 Internal Server Error", "{}".to_string())
                    };
                    let answer = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\n\
                         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = conn.write_all(answer.as_bytes()).await;
                    let _ = conn.shutdown().await;
                });
            }
        });
        Self {
            url,
            serving,
            asked,
            task,
        }
    }

    /// From now on, answers with credentials.
    pub fn serve(&self) {
        self.serving
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// How many requests it got.
    pub fn asked(&self) -> usize {
        self.asked.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The environment of a `berth run` whose AWS chain has this endpoint
    /// and nothing else (no instance metadata, no profile files).
    pub fn env(&self) -> Vec<(&str, &str)> {
        vec![
            ("AWS_CONTAINER_CREDENTIALS_FULL_URI", self.url.as_str()),
            ("AWS_EC2_METADATA_DISABLED", "true"),
            ("AWS_CONFIG_FILE", "/nonexistent/berth/aws-config"),
            (
                "AWS_SHARED_CREDENTIALS_FILE",
                "/nonexistent/berth/aws-credentials",
            ),
        ]
    }
}

impl Drop for CredentialsEndpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}
