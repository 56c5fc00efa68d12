//! The committed CRD YAML is what `berth crd` generates from the Rust types.

use std::path::Path;

#[test]
fn committed_crds_match_the_code() {
    let generated = berth::api::crds_yaml().expect("CRDs render");
    for file in ["deploy/crds.yaml", "charts/berth/crds/crds.yaml"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
        let committed = std::fs::read_to_string(&path).expect("committed CRD file exists");
        assert!(
            committed == generated,
            "{file} is stale: regenerate it with `cargo run -- crd > {file}`"
        );
    }
}
