//! The committed CRD YAML is what `berth crd` generates from the Rust types:
//! `deploy/crds.yaml` verbatim, and the Helm chart's `templates/crds.yaml`,
//! which is the same YAML inside an `{{- if .Values.crds.install }}` guard
//! with the chart's labels and the `helm.sh/resource-policy: keep`
//! annotation inserted into each CRD's metadata.
//!
//! `BERTH_BLESS=1 cargo test --test crd` rewrites both files.
//! (`tests/chart.rs` also renders the template with helm and checks that,
//! labels and annotations aside, it yields exactly the generated objects.)

use std::path::Path;

const DEPLOY: &str = "deploy/crds.yaml";
const CHART_TEMPLATE: &str = "charts/berth/templates/crds.yaml";

/// What goes into each CRD's `metadata`, right after its `name`.
const CHART_METADATA: &str = r#"  labels:
    {{- include "berth.labels" . | nindent 4 }}
    {{- with .Values.crds.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # Kept by `helm uninstall`: deleting a CRD deletes every Machine.
    helm.sh/resource-policy: keep
    {{- with .Values.crds.annotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
"#;

/// The chart's CRD template for the generated CRD YAML.
fn chart_template(generated: &str) -> String {
    let mut out = String::from(
        "{{- /*\nGenerated from `berth crd` (src/api) by tests/crd.rs; do not edit.\n\
         Regenerate with `BERTH_BLESS=1 cargo test --test crd`.\n\
         These are templates, not files under crds/, so that `helm upgrade`\n\
         updates them; the keep policy leaves them (and every Machine) in\n\
         place on `helm uninstall`.\n*/ -}}\n\
         {{- if .Values.crds.install }}\n",
    );
    let lines: Vec<&str> = generated.lines().collect();
    let mut inserted = 0;
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with('#') {
            // The generator's own "do not edit" header.
            continue;
        }
        out.push_str(line);
        out.push('\n');
        if line.starts_with("  name: ") && i > 0 && lines[i - 1] == "metadata:" {
            assert!(
                !lines.get(i + 1).is_some_and(|l| l.starts_with("  ")),
                "the generated metadata has more than a name; extend tests/crd.rs"
            );
            out.push_str(CHART_METADATA);
            inserted += 1;
        }
    }
    assert_eq!(inserted, 7, "one metadata block per CRD");
    assert!(
        !generated.contains("{{") && !generated.contains("}}"),
        "the generated YAML would need escaping for Helm"
    );
    out.push_str("{{- end }}\n");
    out
}

#[test]
fn committed_crds_match_the_code() {
    let generated = berth::api::crds_yaml().expect("CRDs render");
    let bless = std::env::var_os("BERTH_BLESS").is_some();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut stale = Vec::new();
    for (file, wanted) in [
        (DEPLOY, generated.clone()),
        (CHART_TEMPLATE, chart_template(&generated)),
    ] {
        let path = root.join(file);
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        if committed != wanted {
            if bless {
                std::fs::write(&path, &wanted).expect("write");
            } else {
                stale.push(file);
            }
        }
    }
    assert!(
        stale.is_empty(),
        "{stale:?} stale: regenerate with `BERTH_BLESS=1 cargo test --test crd`"
    );
}

#[test]
fn the_chart_no_longer_ships_crds_helm_would_never_upgrade() {
    let crds_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/berth/crds");
    assert!(
        !crds_dir.exists(),
        "charts/berth/crds/ is installed once and never upgraded by Helm; the CRDs are {CHART_TEMPLATE}"
    );
}
