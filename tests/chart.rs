//! The Helm chart, the plain manifests, the container image recipe and the
//! Grafana dashboard, proven with the real tools on the real test bed:
//!
//! * `helm lint` (also `--strict`) and `helm template` pass, and the values
//!   schema rejects misspelt keys;
//! * the rendered objects (and `deploy/`) validate with kubeconform against
//!   JSON schemas generated from the test bed's own `/openapi/v2`, CRDs
//!   included, with unknown fields rejected;
//! * `deploy/berth.yaml` is the chart rendered with its defaults;
//! * the Dockerfile builds with the same command as `make release`, onto a
//!   distroless image with a numeric non-root user;
//! * `helm install` into an end-to-end test bed, then the real `berth run`
//!   binary, authenticated as the chart's ServiceAccount (a TokenRequest
//!   token), creates two Machines and deletes one with a drain of a stateful
//!   and a stateless pod: a missing RBAC rule fails this test. Every metric
//!   the dashboard queries is then found in that process's live `/metrics`.
//!   `helm upgrade` with a changed CRD updates the live CRD, and
//!   `helm uninstall` keeps the CRDs.
//!
//! `BERTH_BLESS=1 cargo test --test chart committed` rewrites
//! `deploy/berth.yaml` (`make manifests`).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use berth::api::Machine;
use berth::providers::fake::FakeProvider;
use berth_devkit::testbed::fixtures::{csi_pv, stateful_set};
use berth_devkit::testbed::{Options, TestBed, wait};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use serde::Deserialize as _;
use serde_json::{Value, json};
use support::process::Berth;
use support::{LONG, class, machine, phase};

const RELEASE: &str = "berth";
const RELEASE_NS: &str = "berth-system";
/// The chart's object names for release `berth` (fullname = release name).
const SERVICE_ACCOUNT: &str = "berth";
const RECOMMENDED_LABELS: [&str; 6] = [
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn chart_dir() -> PathBuf {
    root().join("charts/berth")
}

fn tool(name: &str) -> PathBuf {
    berth_devkit::testbed::bin_dir()
        .expect("test bed binaries (hack/testbed/build.sh)")
        .join(name)
}

/// helm with its own config, cache and data directories, so a test never
/// reads or writes the user's, and never talks to a cluster unless given
/// `--kubeconfig`.
struct Helm {
    home: tempfile::TempDir,
}

impl Helm {
    fn new() -> Self {
        Self {
            home: tempfile::tempdir().expect("helm home"),
        }
    }

    fn command(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(tool("helm"));
        let h = self.home.path();
        cmd.env("HELM_CONFIG_HOME", h.join("config"))
            .env("HELM_CACHE_HOME", h.join("cache"))
            .env("HELM_DATA_HOME", h.join("data"))
            .env_remove("KUBECONFIG")
            .env_remove("HELM_NAMESPACE");
        cmd
    }

    /// stdout on success, stderr (and stdout) on failure.
    fn run<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> Result<String, String> {
        let out = self.command().args(args).output().expect("helm runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(stdout)
        } else {
            Err(format!(
                "{}\n{stdout}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// `helm template berth charts/berth --namespace berth-system <extra>`.
    fn template(&self, extra: &[&str]) -> Result<String, String> {
        let chart = chart_dir();
        let mut args = vec![
            "template",
            RELEASE,
            chart.to_str().expect("utf-8 path"),
            "--namespace",
            RELEASE_NS,
        ];
        args.extend_from_slice(extra);
        self.run(&args)
    }
}

/// Every YAML document of a multi-document stream, as JSON values.
fn docs(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|d| Value::deserialize(d).expect("valid YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn kind_name(v: &Value) -> (String, String) {
    (
        v["kind"].as_str().unwrap_or_default().to_string(),
        v["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

fn find<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn one<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let found = find(objects, kind);
    assert_eq!(found.len(), 1, "exactly one {kind}");
    found[0]
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// (apiGroup, resource, verb) for every rule of a (Cluster)Role.
fn grants(role: &Value) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for rule in role["rules"].as_array().expect("rules") {
        for g in strings(&rule["apiGroups"]) {
            for r in strings(&rule["resources"]) {
                for v in strings(&rule["verbs"]) {
                    out.insert((g.clone(), r.clone(), v));
                }
            }
        }
    }
    out
}

fn expected_grants(table: &[(&str, &[&str], &[&str])]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for (group, resources, verbs) in table {
        for r in *resources {
            for v in *verbs {
                out.insert((group.to_string(), r.to_string(), v.to_string()));
            }
        }
    }
    out
}

/// What the controller calls, and nothing else (see the ClusterRole's
/// comments). The end-to-end test below proves it is enough.
const CLUSTER_GRANTS: &[(&str, &[&str], &[&str])] = &[
    (
        "berth.dev",
        &["machines"],
        &["get", "list", "watch", "patch", "create", "delete"],
    ),
    ("berth.dev", &["machines/status"], &["get", "patch"]),
    ("berth.dev", &["machines/finalizers"], &["update"]),
    ("berth.dev", &["machineclasses"], &["get", "list", "watch"]),
    ("berth.dev", &["drainrules"], &["list", "watch"]),
    ("berth.dev", &["drainrules/status"], &["patch"]),
    ("", &["namespaces"], &["list", "watch"]),
    (
        "berth.dev",
        &["machinesets"],
        &["list", "watch", "create", "patch", "delete"],
    ),
    (
        "berth.dev",
        &["machinesets/status", "machinedeployments/status"],
        &["patch"],
    ),
    ("berth.dev", &["machinedeployments"], &["list", "watch"]),
    (
        "berth.dev",
        &["machinesets/finalizers", "machinedeployments/finalizers"],
        &["update"],
    ),
    ("", &["nodes"], &["get", "list", "watch", "patch", "delete"]),
    ("", &["nodes/status"], &["patch"]),
    ("", &["pods"], &["get", "list", "watch", "patch", "delete"]),
    ("", &["pods/eviction"], &["create"]),
    (
        "",
        &["persistentvolumeclaims", "persistentvolumes"],
        &["get", "list", "watch"],
    ),
    (
        "storage.k8s.io",
        &["volumeattachments"],
        &["get", "list", "watch"],
    ),
    ("storage.k8s.io", &["csidrivers"], &["list", "watch"]),
    ("storage.k8s.io", &["csinodes"], &["list", "watch"]),
    (
        "policy",
        &["poddisruptionbudgets"],
        &["get", "list", "watch"],
    ),
    ("apps", &["replicasets"], &["list", "watch"]),
    ("apps", &["statefulsets"], &["list", "watch"]),
    ("apps", &["deployments"], &["get", "list", "watch", "patch"]),
    ("autoscaling", &["horizontalpodautoscalers"], &["list"]),
    (
        "berth.dev",
        &["movepermits"],
        &["list", "watch", "create", "patch", "delete"],
    ),
    (
        "berth.dev",
        &["moveasks"],
        &["list", "watch", "create", "patch", "delete"],
    ),
    ("events.k8s.io", &["events"], &["create", "patch"]),
];

/// What the aws provider adds: reading the Secret a class names.
const AWS_PROVIDER_GRANTS: &[(&str, &[&str], &[&str])] = &[("", &["secrets"], &["get"])];

const FAKE_PROVIDER_GRANTS: &[(&str, &[&str], &[&str])] = &[
    ("", &["nodes"], &["create"]),
    ("storage.k8s.io", &["csinodes"], &["create"]),
    (
        "",
        &["configmaps"],
        &["get", "list", "create", "patch", "delete"],
    ),
];

fn args_of(deployment: &Value) -> Vec<String> {
    strings(&deployment["spec"]["template"]["spec"]["containers"][0]["args"])
}

// ---------------------------------------------------------------------------
// Lint, render, values schema.

#[test]
fn helm_lint_passes_also_strict_and_with_every_option_on() {
    let helm = Helm::new();
    let chart = chart_dir();
    let chart = chart.to_str().expect("utf-8");
    let everything = "replicas=2,podDisruptionBudget.enabled=true,dashboard.enabled=true,metrics.serviceMonitor.enabled=true";
    for args in [
        vec!["lint", chart],
        vec!["lint", "--strict", chart],
        vec!["lint", "--strict", chart, "--set", everything],
    ] {
        let out = helm
            .run(&args)
            .unwrap_or_else(|e| panic!("helm {args:?}: {e}"));
        assert!(out.contains("0 chart(s) failed"), "{out}");
        assert!(
            !out.contains("[WARNING]") && !out.contains("[ERROR]"),
            "{out}"
        );
    }
}

#[test]
fn the_values_schema_rejects_typos_and_unsafe_combinations() {
    let helm = Helm::new();
    helm.template(&[]).expect("the defaults render");
    let two = docs(&helm.template(&["--set", "replicas=2"]).expect("renders"));
    assert_eq!(one(&two, "Deployment")["spec"]["replicas"], 2);

    for (set, complaint) in [
        ("replicaCount=2", "replicaCount"),
        ("foo=bar", "foo"),
        ("controller.concurency=3", "concurency"),
        ("image.pullpolicy=Always", "pullpolicy"),
        ("crds.instal=false", "instal"),
        ("metrics.serviceMonitor.enable=true", "enable"),
        ("controller.logFormat=yaml", "logFormat"),
        ("leaderElection.leaseDuration=soon", "leaseDuration"),
        ("orphanCollection.grace=soon", "grace"),
        ("orphanCollection.dryrun=true", "dryrun"),
        // Two replicas without leader election would drain the same Machine
        // twice.
        ("replicas=2,leaderElection.enabled=false", "enabled"),
    ] {
        let err = helm
            .template(&["--set", set])
            .expect_err(&format!("--set {set} must be rejected"));
        assert!(
            err.contains("schema") && err.contains(complaint),
            "--set {set}: the error names the problem: {err}"
        );
    }
}

/// helm-docs style: every leaf value carries a `# --` comment, on itself or
/// on an enclosing key documented as a whole (e.g. `resources`).
#[test]
fn every_value_is_documented() {
    let text = std::fs::read_to_string(chart_dir().join("values.yaml")).expect("values.yaml");
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let is_key = |l: &str| {
        let t = l.trim_start();
        !t.is_empty() && !t.starts_with('#') && !t.starts_with('-') && t.contains(':')
    };
    // (indent, documented) of the enclosing keys.
    let mut stack: Vec<(usize, bool)> = Vec::new();
    let mut undocumented = Vec::new();
    let mut keys = 0;
    for (i, line) in lines.iter().enumerate() {
        if !is_key(line) {
            continue;
        }
        keys += 1;
        let ind = indent(line);
        while stack.last().is_some_and(|(d, _)| *d >= ind) {
            stack.pop();
        }
        let mut documented = false;
        for above in lines[..i].iter().rev() {
            let t = above.trim_start();
            if !t.starts_with('#') {
                break;
            }
            documented |= t.starts_with("# --");
        }
        let next = lines[i + 1..]
            .iter()
            .find(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
        let value = line.split_once(':').map(|(_, v)| v.trim()).unwrap_or("");
        let is_leaf = !value.is_empty() || next.is_none_or(|n| indent(n) <= ind);
        let inherited = stack.iter().any(|(_, d)| *d);
        if is_leaf && !documented && !inherited {
            undocumented.push(line.trim().to_string());
        }
        stack.push((ind, documented));
    }
    assert!(keys > 40, "parsed the values ({keys} keys)");
    assert!(
        undocumented.is_empty(),
        "values without a `# --` comment: {undocumented:?}"
    );
}

#[test]
fn the_default_render_is_hardened_labelled_and_least_privilege() {
    let helm = Helm::new();
    let objects = docs(&helm.template(&[]).expect("renders"));
    let kinds: BTreeMap<String, usize> = objects.iter().fold(BTreeMap::new(), |mut m, o| {
        *m.entry(kind_name(o).0).or_default() += 1;
        m
    });
    assert_eq!(
        kinds,
        BTreeMap::from(
            [
                ("ClusterRole", 1),
                ("ClusterRoleBinding", 1),
                ("CustomResourceDefinition", 7),
                ("Deployment", 1),
                ("Role", 1),
                ("RoleBinding", 1),
                ("Service", 1),
                ("ServiceAccount", 1),
            ]
            .map(|(k, n)| (k.to_string(), n))
        ),
        "optional objects are off by default"
    );
    for o in &objects {
        for label in RECOMMENDED_LABELS {
            assert!(
                o["metadata"]["labels"][label].is_string(),
                "{:?} lacks {label}",
                kind_name(o)
            );
        }
    }

    let d = one(&objects, "Deployment");
    let pod = &d["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(d["spec"]["replicas"], 1);
    assert_eq!(pod["serviceAccountName"], SERVICE_ACCOUNT);
    for (path, want) in [
        ("/securityContext/runAsNonRoot", json!(true)),
        ("/securityContext/runAsUser", json!(65532)),
        (
            "/securityContext/seccompProfile/type",
            json!("RuntimeDefault"),
        ),
    ] {
        assert_eq!(pod.pointer(path), Some(&want), "pod {path}");
    }
    for (path, want) in [
        ("/securityContext/runAsNonRoot", json!(true)),
        ("/securityContext/runAsUser", json!(65532)),
        ("/securityContext/readOnlyRootFilesystem", json!(true)),
        ("/securityContext/allowPrivilegeEscalation", json!(false)),
        ("/securityContext/capabilities/drop", json!(["ALL"])),
        (
            "/securityContext/seccompProfile/type",
            json!("RuntimeDefault"),
        ),
        ("/livenessProbe/httpGet/path", json!("/healthz")),
        ("/readinessProbe/httpGet/path", json!("/readyz")),
        ("/ports/0/containerPort", json!(8080)),
        ("/resources/requests/memory", json!("64Mi")),
    ] {
        assert_eq!(c.pointer(path), Some(&want), "container {path}");
    }
    let env: BTreeMap<String, String> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap_or_default().to_string(),
                e["valueFrom"]["fieldRef"]["fieldPath"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(env["BERTH_IDENTITY"], "metadata.name");
    assert_eq!(env["BERTH_LEASE_NAMESPACE"], "metadata.namespace");
    let args = args_of(d);
    assert_eq!(args[0], "run");
    for flag in [
        "--leader-elect=true",
        "--lease-name=berth-controller",
        // No provider unless the values enable one: the fake one is never
        // on by default.
        "--providers=",
        "--metrics-addr=0.0.0.0:8080",
        // Orphan VMs are collected, cautiously, unless told otherwise.
        "--orphan-interval=10m",
        "--orphan-grace=30m",
        "--orphan-dry-run=false",
    ] {
        assert!(args.iter().any(|a| a == flag), "{flag} in {args:?}");
    }

    // RBAC: exactly the grants the code needs; no wildcard anywhere.
    let cluster_role = one(&objects, "ClusterRole");
    assert_eq!(grants(cluster_role), expected_grants(CLUSTER_GRANTS));
    for role in find(&objects, "ClusterRole")
        .into_iter()
        .chain(find(&objects, "Role"))
    {
        let text = role["rules"].to_string();
        assert!(!text.contains('*'), "a wildcard in {text}");
    }
    let role = one(&objects, "Role");
    assert_eq!(role["metadata"]["namespace"], RELEASE_NS);
    assert_eq!(
        grants(role),
        expected_grants(&[(
            "coordination.k8s.io",
            &["leases"],
            &["create", "get", "patch"]
        )])
    );
    let named = role["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .find(|r| r["verbs"] == json!(["get", "patch"]))
        .expect("the get/patch rule");
    assert_eq!(named["resourceNames"], json!(["berth-controller"]));
    for binding in ["ClusterRoleBinding", "RoleBinding"] {
        let b = one(&objects, binding);
        assert_eq!(
            b["subjects"],
            json!([{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": RELEASE_NS}])
        );
    }
}

#[test]
fn options_switch_exactly_their_objects_and_rules() {
    let helm = Helm::new();
    let render = |set: &str| docs(&helm.template(&["--set", set]).expect("renders"));

    let o = render("crds.install=false");
    assert!(find(&o, "CustomResourceDefinition").is_empty());

    let o = render("leaderElection.enabled=false");
    assert!(find(&o, "Role").is_empty() && find(&o, "RoleBinding").is_empty());
    assert!(args_of(one(&o, "Deployment")).contains(&"--leader-elect=false".to_string()));

    let o = render("providers.fake.enabled=true");
    let mut wanted = expected_grants(CLUSTER_GRANTS);
    wanted.extend(expected_grants(FAKE_PROVIDER_GRANTS));
    assert_eq!(
        grants(one(&o, "ClusterRole")),
        wanted,
        "ConfigMap access and Node creation only with the fake provider"
    );
    assert!(args_of(one(&o, "Deployment")).contains(&"--providers=fake".to_string()));

    // The aws provider: its flags, the Secret read for a class's
    // secretRef, IRSA on the ServiceAccount, the controller's own
    // credentials from a Secret; and no cluster id, no render.
    let o = render(
        "providers.aws.enabled=true,providers.aws.clusterId=prod-eu,providers.aws.roleArn=arn:aws:iam::123456789012:role/berth,providers.aws.region=eu-west-1,providers.aws.credentialsSecret=aws-keys,providers.aws.endpointUrl=https://ec2.eu-west-1.amazonaws.com",
    );
    let mut wanted = expected_grants(CLUSTER_GRANTS);
    wanted.extend(expected_grants(AWS_PROVIDER_GRANTS));
    assert_eq!(
        grants(one(&o, "ClusterRole")),
        wanted,
        "Secret get only with aws"
    );
    let d = one(&o, "Deployment");
    let args = args_of(d);
    for flag in [
        "--providers=aws",
        "--cluster-id=prod-eu",
        "--aws-endpoint-url=https://ec2.eu-west-1.amazonaws.com",
    ] {
        assert!(args.contains(&flag.to_string()), "{flag} in {args:?}");
    }
    let container = &d["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["envFrom"][0]["secretRef"]["name"], "aws-keys");
    assert!(
        container["env"]
            .as_array()
            .expect("env")
            .iter()
            .any(|e| e["name"] == "AWS_REGION" && e["value"] == "eu-west-1")
    );
    assert_eq!(
        one(&o, "ServiceAccount")["metadata"]["annotations"]["eks.amazonaws.com/role-arn"],
        "arn:aws:iam::123456789012:role/berth"
    );
    let err = helm
        .template(&["--set", "providers.aws.enabled=true"])
        .expect_err("no cluster id");
    assert!(err.contains("providers.aws.clusterId"), "{err}");
    let err = helm
        .template(&["--set", "providers.aws.roleArn=berth"])
        .expect_err("not an ARN");
    assert!(err.contains("roleArn"), "{err}");

    let o = render(
        "controller.watchNamespace=machines,image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    );
    let d = one(&o, "Deployment");
    assert!(args_of(d).contains(&"--namespace=machines".to_string()));
    assert_eq!(
        d["spec"]["template"]["spec"]["containers"][0]["image"],
        "ghcr.io/berth-dev/berth@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    );

    let o = render(
        "replicas=2,podDisruptionBudget.enabled=true,dashboard.enabled=true,metrics.serviceMonitor.enabled=true",
    );
    let pdb = one(&o, "PodDisruptionBudget");
    let deployment = one(&o, "Deployment");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"]
    );
    let dashboard = one(&o, "ConfigMap");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let shipped: Value = serde_json::from_str(
        dashboard["data"]["berth.json"]
            .as_str()
            .expect("dashboard JSON"),
    )
    .expect("the shipped dashboard is JSON");
    let file: Value = serde_json::from_str(
        &std::fs::read_to_string(chart_dir().join("dashboards/berth.json")).expect("dashboard"),
    )
    .expect("JSON");
    assert_eq!(shipped, file, "the ConfigMap carries dashboards/berth.json");
    // The ServiceMonitor scrapes the Service's named port, selected by the
    // Service's own labels.
    let sm = one(&o, "ServiceMonitor");
    let service = one(&o, "Service");
    assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(service["spec"]["ports"][0]["name"], "metrics");
    for (k, v) in sm["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("labels")
    {
        assert_eq!(&service["metadata"]["labels"][k], v);
    }

    // The example MachineClass is the fake provider's, and says so.
    let err = helm
        .template(&[
            "--set",
            "exampleMachineClass.enabled=true",
            "--api-versions",
            "berth.dev/v1alpha1/MachineClass",
        ])
        .expect_err("the fake provider is not enabled by default");
    assert!(err.contains("providers.fake.enabled=true"), "{err}");
    // It needs the CRDs to exist first, and says so.
    let err = helm
        .template(&[
            "--set",
            "exampleMachineClass.enabled=true,providers.fake.enabled=true",
        ])
        .expect_err("no CRDs in a plain `helm template`");
    assert!(err.contains("helm upgrade --reuse-values"), "{err}");
    let o = docs(
        &helm
            .template(&[
                "--set",
                "exampleMachineClass.enabled=true,providers.fake.enabled=true",
                "--api-versions",
                "berth.dev/v1alpha1/MachineClass",
            ])
            .expect("renders once the API exists"),
    );
    assert_eq!(one(&o, "MachineClass")["spec"]["provider"], "fake");
}

#[test]
fn the_crd_template_renders_exactly_the_generated_crds() {
    let helm = Helm::new();
    let rendered = docs(
        &helm
            .template(&["--show-only", "templates/crds.yaml"])
            .expect("renders"),
    );
    let generated = docs(&berth::api::crds_yaml().expect("CRDs"));
    assert_eq!(rendered.len(), generated.len());
    assert_eq!(
        rendered.len(),
        7,
        "MachineClass, Machine, MachineSet, MachineDeployment, MovePermit, MoveAsk, DrainRule"
    );
    for (mut r, g) in rendered.into_iter().zip(generated) {
        let meta = r["metadata"].as_object_mut().expect("metadata");
        let annotations = meta.remove("annotations").expect("annotations");
        let labels = meta.remove("labels").expect("labels");
        assert_eq!(annotations["helm.sh/resource-policy"], "keep");
        assert_eq!(labels["app.kubernetes.io/part-of"], "berth");
        assert_eq!(r, g, "the chart's CRD is the generated one");
    }
}

// ---------------------------------------------------------------------------
// deploy/ and the image recipe.

fn deploy_manifest(helm: &Helm) -> String {
    let rendered = helm.template(&[]).expect("the defaults render");
    format!(
        "# Generated from charts/berth with its default values; do not edit.\n\
         # Regenerate with `make manifests` (BERTH_BLESS=1 cargo test --test chart committed):\n\
         #   helm template {RELEASE} charts/berth --namespace {RELEASE_NS}\n\
         # plus the Namespace. Install with:\n\
         #   kubectl apply --server-side -f deploy/berth.yaml\n\
         ---\n\
         apiVersion: v1\n\
         kind: Namespace\n\
         metadata:\n  \
           name: {RELEASE_NS}\n  \
           labels:\n    \
             app.kubernetes.io/part-of: berth\n\
         {rendered}"
    )
}

#[test]
fn committed_deploy_manifests_match_the_chart() {
    let helm = Helm::new();
    let wanted = deploy_manifest(&helm);
    let path = root().join("deploy/berth.yaml");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != wanted && std::env::var_os("BERTH_BLESS").is_some() {
        std::fs::write(&path, &wanted).expect("write deploy/berth.yaml");
        return;
    }
    assert!(
        committed == wanted,
        "deploy/berth.yaml is stale: run `make manifests`"
    );
    let objects = docs(&committed);
    assert_eq!(
        kind_name(&objects[0]),
        ("Namespace".into(), RELEASE_NS.into())
    );
    for o in &objects[1..] {
        let cluster_scoped = [
            "ClusterRole",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
        ]
        .contains(&o["kind"].as_str().unwrap_or_default());
        assert!(
            cluster_scoped || o["metadata"]["namespace"] == RELEASE_NS,
            "{:?} is in {RELEASE_NS}",
            kind_name(o)
        );
    }
}

/// The lines of a Dockerfile, continuation lines joined.
fn dockerfile_instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || (t.is_empty() && current.is_empty()) {
            continue;
        }
        if let Some(cont) = t.strip_suffix('\\') {
            current.push_str(cont.trim());
            current.push(' ');
            continue;
        }
        current.push_str(t);
        let (op, rest) = current.split_once(' ').unwrap_or((&current, ""));
        out.push((op.to_uppercase(), rest.trim().to_string()));
        current.clear();
    }
    out
}

#[test]
fn the_dockerfile_builds_what_make_release_builds_onto_distroless_non_root() {
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).expect("Dockerfile");
    let makefile = std::fs::read_to_string(root().join("Makefile")).expect("Makefile");
    let instructions = dockerfile_instructions(&dockerfile);

    // Two stages: the Rust builder, then distroless.
    let froms: Vec<&String> = instructions
        .iter()
        .filter(|(op, _)| op == "FROM")
        .map(|(_, a)| a)
        .collect();
    assert_eq!(froms.len(), 2, "multi-stage: {froms:?}");
    let builder = froms[0]
        .strip_suffix(" AS builder")
        .expect("the first stage is `builder`");
    let version = builder
        .strip_prefix("rust:")
        .and_then(|v| v.split('-').next())
        .expect("a rust:<version> builder");
    let parse =
        |v: &str| -> Vec<u32> { v.split('.').map(|n| n.parse().expect("number")).collect() };
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml");
    let msrv = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .map(|v| v.trim_matches('"'))
        .expect("rust-version");
    assert!(
        parse(version) >= parse(msrv),
        "builder {version} < rust-version {msrv}"
    );
    assert!(
        froms[1].starts_with("gcr.io/distroless/"),
        "distroless final image: {}",
        froms[1]
    );

    // The build command is exactly `make release`'s.
    let final_stage = instructions
        .iter()
        .rposition(|(op, _)| op == "FROM")
        .expect("final stage");
    let builds: Vec<&String> = instructions[..final_stage]
        .iter()
        .filter(|(op, a)| op == "RUN" && a.contains("cargo"))
        .map(|(_, a)| a)
        .collect();
    assert_eq!(builds.len(), 1, "{builds:?}");
    let mut recipe = makefile
        .lines()
        .skip_while(|l| !l.starts_with("release:"))
        .skip(1)
        .take_while(|l| l.starts_with('\t'))
        .map(str::trim);
    let make_release = recipe.next().expect("a `release` target in the Makefile");
    assert_eq!(recipe.next(), None, "`make release` is one command");
    assert_eq!(builds[0], make_release);
    assert!(
        make_release.contains("--release") && make_release.contains("--locked"),
        "{make_release}"
    );
    assert!(
        !make_release.contains("--target"),
        "host target: target/release"
    );

    // It ships that binary, as a numeric non-root user, with no shell needed.
    let stage: Vec<&(String, String)> = instructions[final_stage..].iter().collect();
    let bin = manifest
        .split("[[bin]]")
        .nth(1)
        .and_then(|b| b.lines().find_map(|l| l.strip_prefix("name = ")))
        .map(|n| n.trim_matches('"'))
        .expect("[[bin]] name");
    assert!(
        stage.iter().any(|(op, a)| op == "COPY"
            && *a == format!("--from=builder /src/target/release/{bin} /{bin}")),
        "{stage:?}"
    );
    let user = stage
        .iter()
        .find(|(op, _)| op == "USER")
        .map(|(_, a)| a.as_str())
        .expect("USER");
    let uid: u32 = user
        .split(':')
        .next()
        .and_then(|u| u.parse().ok())
        .unwrap_or_else(|| panic!("USER {user} is numeric"));
    assert_ne!(uid, 0, "non-root");
    assert!(
        stage
            .iter()
            .any(|(op, a)| op == "ENTRYPOINT" && *a == format!("[\"/{bin}\"]")),
        "exec-form entrypoint, no shell"
    );
    assert!(stage.iter().any(|(op, a)| op == "CMD" && a == "[\"run\"]"));

    // The chart runs the image as that same user.
    let values: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(chart_dir().join("values.yaml")).expect("values"),
    )
    .expect("YAML");
    assert_eq!(values["securityContext"]["runAsUser"], uid);
    assert_eq!(values["podSecurityContext"]["runAsUser"], uid);

    // Everything the build reads is in the build context.
    let ignore = std::fs::read_to_string(root().join(".dockerignore")).expect(".dockerignore");
    for input in [
        "Cargo.toml",
        "Cargo.lock",
        "src/",
        "devkit/Cargo.toml",
        "devkit/src/",
    ] {
        assert!(
            ignore.lines().any(|l| l.trim() == format!("!{input}")),
            ".dockerignore lets {input} in"
        );
    }
}

/// The release build itself (minutes on 2 cores, so not part of the default
/// run): `cargo test --test chart -- --ignored`.
#[test]
#[ignore = "runs the release build (`make release`); minutes"]
fn make_release_builds_a_working_binary() {
    let status = std::process::Command::new("make")
        .arg("release")
        .current_dir(root())
        .status()
        .expect("make runs");
    assert!(status.success());
    let out = std::process::Command::new(root().join("target/release/berth"))
        .arg("crd")
        .output()
        .expect("the release binary runs");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        berth::api::crds_yaml().expect("CRDs")
    );
}

// ---------------------------------------------------------------------------
// kubeconform against the test bed's own schemas.

const INT_OR_STRING: &str = "io.k8s.apimachinery.pkg.util.intstr.IntOrString";
const QUANTITY: &str = "io.k8s.apimachinery.pkg.api.resource.Quantity";

/// Rejects unknown fields, like the `-strict` schemas kubeconform usually
/// downloads: every object schema with `properties` gets
/// `additionalProperties: false`, unless it preserves unknown fields.
fn forbid_unknown_fields(schema: &mut Value) {
    let Some(obj) = schema.as_object_mut() else {
        return;
    };
    if let Some(props) = obj.get_mut("properties").and_then(Value::as_object_mut) {
        for p in props.values_mut() {
            forbid_unknown_fields(p);
        }
        let preserves = obj
            .get("x-kubernetes-preserve-unknown-fields")
            .is_some_and(|v| v == true);
        if !preserves && !obj.contains_key("additionalProperties") {
            obj.insert("additionalProperties".into(), Value::Bool(false));
        }
    }
    for key in ["items", "additionalProperties"] {
        if let Some(v) = obj.get_mut(key) {
            forbid_unknown_fields(v);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(list) = obj.get_mut(key).and_then(Value::as_array_mut) {
            list.iter_mut().for_each(forbid_unknown_fields);
        }
    }
}

fn referenced(
    schema: &Value,
    definitions: &serde_json::Map<String, Value>,
    out: &mut BTreeSet<String>,
) {
    match schema {
        Value::Object(o) => {
            if let Some(name) = o
                .get("$ref")
                .and_then(Value::as_str)
                .and_then(|r| r.strip_prefix("#/definitions/"))
                && out.insert(name.to_string())
                && let Some(def) = definitions.get(name)
            {
                referenced(def, definitions, out);
            }
            o.values().for_each(|v| referenced(v, definitions, out));
        }
        Value::Array(a) => a.iter().for_each(|v| referenced(v, definitions, out)),
        _ => {}
    }
}

/// Writes one JSON schema per group/version/kind of the API server's
/// OpenAPI v2 document into `dir`, named as kubeconform looks them up with
/// `-schema-location 'DIR/{{ .ResourceKind }}{{ .KindSuffix }}.json'`:
/// `<kind>[-<first DNS label of the group>]-<version>.json`, lowercase.
/// Each file is `{"$ref": "#/definitions/<name>", "definitions": {...}}` with
/// the definitions it needs. Returns how many it wrote.
fn write_schemas(openapi: &Value, dir: &Path) -> usize {
    let mut definitions = openapi["definitions"]
        .as_object()
        .expect("definitions")
        .clone();
    // Both are strings in the OpenAPI document; YAML may carry numbers.
    let number_or_string = json!({"oneOf": [{"type": "string"}, {"type": "integer"}]});
    for name in [INT_OR_STRING, QUANTITY] {
        assert!(definitions.contains_key(name), "{name} defined");
        definitions.insert(name.into(), number_or_string.clone());
    }
    definitions.values_mut().for_each(forbid_unknown_fields);
    let mut written = 0;
    for (name, def) in &definitions {
        let Some(gvks) = def["x-kubernetes-group-version-kind"].as_array() else {
            continue;
        };
        let mut needed = BTreeSet::from([name.clone()]);
        referenced(def, &definitions, &mut needed);
        let file = json!({
            "$ref": format!("#/definitions/{name}"),
            "definitions": needed
                .iter()
                .filter_map(|n| Some((n.clone(), definitions.get(n)?.clone())))
                .collect::<serde_json::Map<_, _>>(),
        });
        for gvk in gvks {
            let group = gvk["group"].as_str().unwrap_or_default();
            let label = group.split('.').next().unwrap_or_default();
            let suffix = if label.is_empty() {
                String::new()
            } else {
                format!("-{label}")
            };
            let fname = format!(
                "{}{suffix}-{}.json",
                gvk["kind"].as_str().unwrap_or_default(),
                gvk["version"].as_str().unwrap_or_default()
            )
            .to_lowercase();
            std::fs::write(dir.join(fname), file.to_string()).expect("write schema");
            written += 1;
        }
    }
    written
}

/// kubeconform, strict, with only the local schemas: (success, output).
fn kubeconform(schemas: &Path, files: &[&Path]) -> (bool, String) {
    let location = format!(
        "{}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json",
        schemas.display()
    );
    let out = std::process::Command::new(tool("kubeconform"))
        .args(["-strict", "-summary", "-output", "text", "-schema-location"])
        .arg(&location)
        .args(files)
        .output()
        .expect("kubeconform runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendered_objects_validate_against_the_test_beds_own_schemas() {
    support::init_logs();
    let bed = TestBed::start(Options::integration())
        .await
        .expect("test bed");
    let client = bed.client().await.expect("client");
    berth::api::install_crds(client.clone(), LONG)
        .await
        .expect("CRDs");
    // The OpenAPI document has no watch; the CRDs' definitions appear in it
    // shortly after they are established, so this polls it.
    let started = Instant::now();
    let openapi: Value = loop {
        let req = http::Request::get("/openapi/v2")
            .header("Accept", "application/json")
            .body(Vec::new())
            .expect("request");
        let text = client.request_text(req).await.expect("GET /openapi/v2");
        let doc: Value = serde_json::from_str(&text).expect("OpenAPI JSON");
        let defs = &doc["definitions"];
        if defs["dev.berth.v1alpha1.Machine"].is_object()
            && defs["dev.berth.v1alpha1.MachineClass"].is_object()
        {
            break doc;
        }
        assert!(
            started.elapsed() < LONG,
            "the CRDs never appeared in /openapi/v2"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let dir = tempfile::tempdir().expect("dir");
    let schemas = dir.path().join("schemas");
    std::fs::create_dir(&schemas).expect("mkdir");
    let written = write_schemas(&openapi, &schemas);
    assert!(written > 100, "{written} schemas");
    for f in [
        "deployment-apps-v1",
        "machine-berth-v1alpha1",
        "clusterrole-rbac-v1",
        "service-v1",
    ] {
        assert!(schemas.join(format!("{f}.json")).exists(), "{f}.json");
    }

    // Everything the chart can render, except the ServiceMonitor: its
    // schema (monitoring.coreos.com/v1) is not in the test bed, and
    // kubeconform is never told to skip a missing schema. Its shape is
    // checked in `options_switch_exactly_their_objects_and_rules`.
    let helm = Helm::new();
    let full = helm
        .template(&[
            "--set",
            "replicas=2,podDisruptionBudget.enabled=true,dashboard.enabled=true,exampleMachineClass.enabled=true,providers.fake.enabled=true",
            "--api-versions",
            "berth.dev/v1alpha1/MachineClass",
        ])
        .expect("renders");
    let rendered = dir.path().join("chart.yaml");
    std::fs::write(&rendered, &full).expect("write");
    let deploy = root().join("deploy");
    let files = [
        rendered.as_path(),
        &deploy.join("berth.yaml"),
        &deploy.join("crds.yaml"),
        &deploy.join("examples/machineclass.yaml"),
        &deploy.join("examples/machine.yaml"),
        &deploy.join("examples/machinedeployment.yaml"),
    ];
    let expected: usize = files
        .iter()
        .map(|f| docs(&std::fs::read_to_string(f).expect("read")).len())
        .sum();
    let (ok, out) = kubeconform(&schemas, &files);
    assert!(ok, "kubeconform:\n{out}");
    assert!(
        out.contains(&format!(
            "Valid: {expected}, Invalid: 0, Errors: 0, Skipped: 0"
        )),
        "all {expected} objects validated, none skipped:\n{out}"
    );

    // The schemas have teeth: a misspelt field in a pass-through value, and
    // in a Machine, are caught.
    let bad = helm
        .template(&["--set", "securityContext.runAsNonroot=true"])
        .expect("the chart schema lets Kubernetes objects through");
    let bad_chart = dir.path().join("bad-chart.yaml");
    std::fs::write(&bad_chart, bad).expect("write");
    let bad_machine = dir.path().join("bad-machine.yaml");
    std::fs::write(
        &bad_machine,
        "apiVersion: berth.dev/v1alpha1\nkind: Machine\nmetadata: {name: m}\nspec: {classRef: {name: c}, drian: {}}\n",
    )
    .expect("write");
    for (file, field) in [(&bad_chart, "runAsNonroot"), (&bad_machine, "drian")] {
        let (ok, out) = kubeconform(&schemas, &[file]);
        assert!(
            !ok && out.contains(field),
            "{field} must be rejected:\n{out}"
        );
    }

    // The examples also pass the API server's own validation (CEL rules
    // included), in a server-side dry run.
    let ns = "examples";
    kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &berth_devkit::testbed::fixtures::namespace(ns),
        )
        .await
        .expect("namespace");
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    for example in ["machineclass.yaml", "machine.yaml"] {
        let text = std::fs::read_to_string(deploy.join("examples").join(example)).expect("read");
        for doc in docs(&text) {
            let (kind, name) = kind_name(&doc);
            match kind.as_str() {
                "MachineClass" => {
                    Api::<berth::api::MachineClass>::all(client.clone())
                        .create(&dry, &serde_json::from_value(doc).expect("a MachineClass"))
                        .await
                        .unwrap_or_else(|e| panic!("{example} {name}: {e}"));
                }
                "Machine" => {
                    Api::<Machine>::namespaced(client.clone(), ns)
                        .create(&dry, &serde_json::from_value(doc).expect("a Machine"))
                        .await
                        .unwrap_or_else(|e| panic!("{example} {name}: {e}"));
                }
                other => panic!("unexpected {other} in {example}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Dashboard.

/// Every `berth_*` name in the dashboard's queries (panel `expr`s and
/// template variable queries).
fn dashboard_metric_names() -> BTreeSet<String> {
    let text =
        std::fs::read_to_string(chart_dir().join("dashboards/berth.json")).expect("dashboard");
    let dash: Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut queries = Vec::new();
    fn walk(v: &Value, queries: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                for (k, v) in o {
                    if matches!(k.as_str(), "expr" | "query" | "definition")
                        && let Some(s) = v.as_str()
                    {
                        queries.push(s.to_string());
                    }
                    walk(v, queries);
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, queries)),
            _ => {}
        }
    }
    walk(&dash, &mut queries);
    let mut names = BTreeSet::new();
    for q in &queries {
        let mut rest = q.as_str();
        while let Some(at) = rest.find("berth_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(tail.len());
            names.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    names
}

/// The metric family a sample name belongs to, given the families exported.
fn family_of(name: &str, families: &BTreeSet<String>) -> Option<String> {
    if families.contains(name) {
        return Some(name.to_string());
    }
    ["_bucket", "_sum", "_count"]
        .iter()
        .filter_map(|s| name.strip_suffix(s))
        .find(|f| families.contains(*f))
        .map(String::from)
}

#[test]
fn the_dashboard_is_a_grafana_dashboard_over_a_prometheus_datasource_variable() {
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(chart_dir().join("dashboards/berth.json")).expect("dashboard"),
    )
    .expect("JSON");
    assert_eq!(dash["schemaVersion"], 39);
    let vars = dash["templating"]["list"].as_array().expect("variables");
    let ds = vars
        .iter()
        .find(|v| v["name"] == "datasource")
        .expect("a datasource variable");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    let panels = dash["panels"].as_array().expect("panels");
    let mut titles = Vec::new();
    for p in panels.iter().filter(|p| p["type"] != "row") {
        titles.push(p["title"].as_str().unwrap_or_default().to_string());
        let want = json!({"type": "prometheus", "uid": "${datasource}"});
        assert_eq!(p["datasource"], want, "{}", p["title"]);
        for t in p["targets"].as_array().expect("targets") {
            assert_eq!(t["datasource"], want);
            assert!(t["expr"].as_str().is_some_and(|e| e.contains("berth_")));
        }
    }
    // What operators look at, by the metric behind it.
    let names = dashboard_metric_names();
    for metric in [
        "berth_machines",
        "berth_drains_in_progress",
        "berth_drain_duration_seconds_bucket",
        "berth_pod_evictions_total",
        "berth_volume_detach_wait_seconds_bucket",
        "berth_volume_reattach_wait_seconds_bucket",
        "berth_tracker_lagged_total",
        "berth_volume_attachment_events_total",
        "berth_reconcile_total",
        "berth_reconcile_duration_seconds_bucket",
        "berth_provider_request_duration_seconds_bucket",
        "berth_provider_requests_total",
        "berth_leader",
        "berth_node_not_ready_machines",
    ] {
        assert!(names.contains(metric), "no panel on {metric}: {titles:?}");
    }
    // A first, cluster-free check; the live scrape in the end-to-end test
    // below is the real one.
    let registered: BTreeSet<String> = berth::telemetry::Metrics::new()
        .expect("metrics")
        .names()
        .into_iter()
        .collect();
    for n in &names {
        assert!(family_of(n, &registered).is_some(), "{n} is not registered");
    }
}

// ---------------------------------------------------------------------------
// End to end: install, run as the chart's ServiceAccount, drain, upgrade.

/// A kubeconfig that authenticates with the chart's ServiceAccount token.
async fn service_account_kubeconfig(bed: &TestBed, client: &Client, path: &Path) -> Client {
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let token = Api::<ServiceAccount>::namespaced(client.clone(), RELEASE_NS)
        .create_token_request(SERVICE_ACCOUNT, &PostParams::default(), &request)
        .await
        .expect("a token for the chart's ServiceAccount")
        .status
        .expect("token status")
        .token;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let kubeconfig = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "bed", "cluster": {
            "server": bed.server(),
            "certificate-authority-data": b64(&bed.ca_pem().expect("CA")),
        }}],
        "users": [{"name": SERVICE_ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": "chart", "context": {"cluster": "bed", "user": SERVICE_ACCOUNT}}],
        "current-context": "chart",
    });
    std::fs::write(path, kubeconfig.to_string()).expect("write kubeconfig");
    let kc = kube::config::Kubeconfig::read_from(path).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .expect("config");
    Client::try_from(config).expect("client")
}

fn json_obj<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).expect("valid object")
}

fn on_node_running(p: &Pod, node: &str) -> bool {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read dir").flatten() {
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_installs_and_its_service_account_drains_a_machine_then_upgrades_its_crds() {
    support::init_logs();
    let bed = TestBed::start(Options::end_to_end())
        .await
        .expect("the end-to-end test bed starts");
    let client = bed.client().await.expect("admin client");
    let kubeconfig = bed.kubeconfig_path().to_str().expect("utf-8").to_string();
    let helm = Helm::new();
    let chart = chart_dir();
    let chart = chart.to_str().expect("utf-8");

    // 1. helm install: two replicas and their PDB. The controller's pods can
    //    never run here (no image, no kubelet), so they are kept off the
    //    kwok Nodes; the ReplicaSet creating them proves the pod template
    //    passes the API server's validation and admission.
    let t = Instant::now();
    let out = tokio::task::block_in_place(|| {
        helm.run(&[
            "install",
            RELEASE,
            chart,
            "--namespace",
            RELEASE_NS,
            "--create-namespace",
            "--kubeconfig",
            &kubeconfig,
            "--set",
            "replicas=2,podDisruptionBudget.enabled=true,providers.fake.enabled=true",
            "--set-string",
            "nodeSelector.berth\\.dev/never-scheduled=true",
        ])
    })
    .expect("helm install succeeds");
    assert!(out.contains("STATUS: deployed"), "{out}");
    // The notes say which provider runs the Machines, and that this one is
    // for trying berth only.
    assert!(
        out.contains("The fake provider is enabled") && out.contains("never for real machines"),
        "{out}"
    );
    eprintln!("helm install took {:?}", t.elapsed());
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in [
        "machines.berth.dev",
        "machineclasses.berth.dev",
        "machinesets.berth.dev",
        "machinedeployments.berth.dev",
    ] {
        let established = kube::runtime::wait::await_condition(
            crds.clone(),
            name,
            kube::runtime::wait::conditions::is_crd_established(),
        );
        tokio::time::timeout(LONG, established)
            .await
            .expect("in time")
            .expect("the chart's CRD is established");
    }
    let pods = wait::until(
        Api::<Pod>::namespaced(client.clone(), RELEASE_NS),
        LONG,
        "the controller's two pods",
        |ps| ps.len() == 2,
    )
    .await
    .expect("the ReplicaSet creates the controller's pods");
    for p in &pods {
        let spec = p.spec.as_ref().expect("spec");
        assert_eq!(spec.service_account_name.as_deref(), Some(SERVICE_ACCOUNT));
        let sc = spec.containers[0]
            .security_context
            .as_ref()
            .expect("securityContext");
        assert_eq!(sc.read_only_root_filesystem, Some(true));
    }

    // 2. The chart's ServiceAccount: a token, and proof that it is not an
    //    admin.
    let dir = tempfile::tempdir().expect("dir");
    let sa_kubeconfig = dir.path().join("berth-sa.kubeconfig");
    let sa_client = service_account_kubeconfig(&bed, &client, &sa_kubeconfig).await;
    match Api::<Secret>::all(sa_client.clone())
        .list(&Default::default())
        .await
    {
        Err(kube::Error::Api(e)) if e.code == 403 => {}
        other => panic!("the ServiceAccount must not read Secrets: {other:?}"),
    }

    // 3. The real binary under those credentials, leader election on (the
    //    Lease in the release namespace, through the chart's Role).
    let ns = "chart-e2e";
    support::namespace(&client, ns).await;
    Api::<berth::api::MachineClass>::all(client.clone())
        .create(
            &PostParams::default(),
            &class(
                ns,
                "fake",
                json!({"nodeLabels": {berth_devkit::testbed::fixtures::POOL_LABEL: ns}}),
            ),
        )
        .await
        .expect("class");
    let identity = "chart-e2e-controller";
    let berth = Berth::spawn(
        &sa_kubeconfig,
        &[
            "--namespace",
            ns,
            "--lease-namespace",
            RELEASE_NS,
            "--identity",
            identity,
        ],
    );
    let leader = wait::for_one(
        Api::<Lease>::namespaced(client.clone(), RELEASE_NS),
        LONG,
        "the Lease held by the controller",
        |l| {
            l.name_any() == "berth-controller"
                && l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) == Some(identity)
        },
    );
    berth
        .unforbidden("taking the Lease", leader)
        .await
        .expect("the controller takes the Lease");
    berth
        .unforbidden("syncing its caches", berth.wait_log("caches synced"))
        .await;
    berth.wait_http("/readyz", 200).await;

    // 4. Two Machines; a stateful and a stateless pod on the first.
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let running = |name: &'static str| {
        let machines = machines.clone();
        async move {
            machines
                .create(&PostParams::default(), &machine(name, ns))
                .await
                .expect("create machine");
            wait::for_one(machines, LONG, "Machine Running", |m| {
                m.name_any() == name && phase(m) == Some("Running")
            })
            .await
            .unwrap_or_else(|e| panic!("Machine {name} runs: {e}"));
            FakeProvider::node_name(ns, name)
        }
    };
    let node_a = berth.unforbidden("creating Machine a", running("a")).await;
    let pv = format!("{ns}-db-0");
    Api::<k8s_openapi::api::core::v1::PersistentVolume>::all(client.clone())
        .create(
            &PostParams::default(),
            &csi_pv(&pv, &format!("vol-{pv}"), ns, "data-db-0"),
        )
        .await
        .expect("pv");
    let mut sts = stateful_set("db", 1, 1);
    if let Some(spec) = sts.spec.template.spec.as_mut() {
        spec.node_selector = Some(
            [(
                berth_devkit::testbed::fixtures::POOL_LABEL.to_string(),
                ns.to_string(),
            )]
            .into(),
        );
    }
    Api::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &sts)
        .await
        .expect("statefulset");
    Api::<Deployment>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &json_obj(json!({
                "metadata": {"name": "web"},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": {"app": "web"}},
                    "template": {
                        "metadata": {"labels": {"app": "web"}},
                        "spec": {
                            "nodeSelector": {berth_devkit::testbed::fixtures::POOL_LABEL: ns},
                            "terminationGracePeriodSeconds": 1,
                            "containers": [{"name": "main", "image": "registry.invalid/web:1"}]
                        }
                    }
                }
            })),
        )
        .await
        .expect("deployment");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::until(pods.clone(), LONG, "db-0 and web running on A", |ps| {
        ps.iter()
            .any(|p| p.name_any() == "db-0" && on_node_running(p, &node_a))
            && ps
                .iter()
                .any(|p| p.name_any().starts_with("web-") && on_node_running(p, &node_a))
    })
    .await
    .expect("the workloads run on A");
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    wait::for_one(vas.clone(), LONG, "the volume attached to A", |va| {
        va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
            && va.spec.node_name == node_a
            && va.status.as_ref().is_some_and(|s| s.attached)
    })
    .await
    .expect("the volume attaches");
    let node_b = berth.unforbidden("creating Machine b", running("b")).await;

    // 5. Delete A: cordon, drain, volume moves, VM and Node deleted.
    let t = Instant::now();
    machines
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete a");
    let gone = wait::for_none(machines.clone(), Duration::from_secs(180), "a gone", |m| {
        m.name_any() == "a"
    });
    berth
        .unforbidden("deleting Machine a", gone)
        .await
        .expect("the deletion completes under the chart's RBAC");
    eprintln!("deletion of a took {:?}", t.elapsed());
    let evs: Vec<(String, String)> =
        support::reason_notes(&support::events_until(&client, ns, "a", &["DeleteVmAndNode"]).await);
    let log = evs
        .iter()
        .map(|(r, n)| format!("{r}: {n}"))
        .collect::<Vec<_>>()
        .join("\n");
    for (reason, needle) in [
        ("Evicted", format!("{ns}/db-0")),
        ("Evicted", format!("{ns}/web-")),
        ("VolumeDetached", pv.clone()),
        ("VolumeAttached", pv.clone()),
    ] {
        assert!(
            evs.iter().any(|(r, n)| *r == reason && n.contains(&needle)),
            "{reason} {needle}:\n{log}"
        );
    }
    support::assert_vm_and_node_gone(&client, ns, "a", &node_a).await;
    wait::until(pods, LONG, "db-0 and web running on B", |ps| {
        ps.iter()
            .any(|p| p.name_any() == "db-0" && on_node_running(p, &node_b))
            && ps
                .iter()
                .any(|p| p.name_any().starts_with("web-") && on_node_running(p, &node_b))
    })
    .await
    .expect("the workloads moved to B");
    wait::for_one(vas, LONG, "the volume attached to B", |va| {
        va.spec.source.persistent_volume_name.as_deref() == Some(pv.as_str())
            && va.spec.node_name == node_b
            && va.status.as_ref().is_some_and(|s| s.attached)
    })
    .await
    .expect("the volume follows db-0 to B");
    let forbidden = berth.log_lines_matching("forbidden");
    assert!(
        forbidden.is_empty(),
        "RBAC refused the controller something:\n{}",
        forbidden.join("\n")
    );

    // 6. Every metric the dashboard queries is exported by this process.
    let (status, metrics) = berth.get("/metrics").await.expect("/metrics answers");
    assert_eq!(status, 200);
    let families: BTreeSet<String> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect();
    let missing: Vec<String> = dashboard_metric_names()
        .into_iter()
        .filter(|n| family_of(n, &families).is_none())
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics the controller does not export: {missing:?}\n{metrics}"
    );
    // After a full create/drain/delete every registered family has samples,
    // so the live scrape shows all of them.
    let registered: BTreeSet<String> = berth::telemetry::Metrics::new()
        .expect("metrics")
        .names()
        .into_iter()
        .collect();
    assert_eq!(families, registered, "{metrics}");
    assert!(metrics.contains("berth_leader 1"), "{metrics}");

    let status = berth.terminate().await;
    assert!(status.success(), "clean exit on SIGTERM: {status:?}");

    // 7. helm upgrade to a chart whose Machine CRD changed (a new printer
    //    column, as a new release would bring), enabling the example
    //    MachineClass now that the CRDs exist.
    let next = dir.path().join("berth-next");
    copy_dir(&chart_dir(), &next);
    let crd_template = next.join("templates/crds.yaml");
    let text = std::fs::read_to_string(&crd_template).expect("crds template");
    let marker = "  - additionalPrinterColumns:\n";
    let machine_crd = text.find("name: machines.berth.dev").expect("machines CRD");
    let at =
        machine_crd + text[machine_crd..].find(marker).expect("printer columns") + marker.len();
    let mut changed = text.clone();
    changed.insert_str(
        at,
        "    - jsonPath: .spec.classRef.name\n      name: Class\n      type: string\n",
    );
    std::fs::write(&crd_template, changed).expect("write");
    let t = Instant::now();
    let out = tokio::task::block_in_place(|| {
        helm.run(&[
            "upgrade",
            RELEASE,
            next.to_str().expect("utf-8"),
            "--namespace",
            RELEASE_NS,
            "--kubeconfig",
            &kubeconfig,
            "--reuse-values",
            "--set",
            "exampleMachineClass.enabled=true",
        ])
    })
    .expect("helm upgrade succeeds");
    assert!(out.contains("REVISION: 2"), "{out}");
    eprintln!("helm upgrade took {:?}", t.elapsed());
    let live = crds.get("machines.berth.dev").await.expect("CRD");
    let columns: Vec<String> = live.spec.versions[0]
        .additional_printer_columns
        .iter()
        .flatten()
        .map(|c| c.name.clone())
        .collect();
    assert!(
        columns.iter().any(|c| c == "Class"),
        "the upgrade changed the live CRD: {columns:?}"
    );
    let example = Api::<berth::api::MachineClass>::all(client.clone())
        .get("fake-small")
        .await
        .expect("the example MachineClass is installed");
    assert_eq!(example.spec.provider, "fake");

    // 8. helm uninstall keeps the CRDs (and so every Machine).
    let out = tokio::task::block_in_place(|| {
        helm.run(&[
            "uninstall",
            RELEASE,
            "--namespace",
            RELEASE_NS,
            "--kubeconfig",
            &kubeconfig,
            "--wait",
        ])
    })
    .expect("helm uninstall");
    assert!(out.contains("uninstalled"), "{out}");
    for name in [
        "machines.berth.dev",
        "machineclasses.berth.dev",
        "machinesets.berth.dev",
        "machinedeployments.berth.dev",
    ] {
        assert!(
            crds.get_opt(name).await.expect("get CRD").is_some(),
            "{name} kept by helm.sh/resource-policy: keep"
        );
    }
    assert!(
        machines.get_opt("b").await.expect("get b").is_some(),
        "Machine b survives the uninstall"
    );
    assert!(
        Api::<Deployment>::namespaced(client.clone(), RELEASE_NS)
            .get_opt(RELEASE)
            .await
            .expect("get deployment")
            .is_none(),
        "the controller is uninstalled"
    );
}
