//! The README's configuration and metrics references are generated from the
//! code; this test fails when they drift. `BERTH_BLESS=1 cargo test --test
//! readme` rewrites them.

use std::path::Path;

fn section<'a>(readme: &'a str, name: &str) -> (usize, usize, &'a str) {
    let begin =
        format!("<!-- begin:{name} (generated; BERTH_BLESS=1 cargo test --test readme) -->\n");
    let end = format!("<!-- end:{name} -->");
    let start = readme
        .find(&begin)
        .unwrap_or_else(|| panic!("README.md has no {begin:?} marker"))
        + begin.len();
    let stop = readme[start..]
        .find(&end)
        .unwrap_or_else(|| panic!("README.md has no {end:?} marker"))
        + start;
    (start, stop, &readme[start..stop])
}

#[test]
fn readme_references_match_the_code() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let mut readme = std::fs::read_to_string(&path).expect("README.md");
    let metrics = berth::telemetry::Metrics::new().expect("metrics");
    let wanted = [
        (
            "config",
            berth::wiring::process::config_reference_markdown(),
        ),
        ("metrics", metrics.reference_markdown()),
    ];
    let bless = std::env::var_os("BERTH_BLESS").is_some();
    let mut stale = Vec::new();
    for (name, generated) in wanted {
        let (start, stop, _) = section(&readme, name);
        if readme[start..stop] != generated {
            if bless {
                readme.replace_range(start..stop, &generated);
            } else {
                stale.push(format!("--- {name} in README.md should be:\n{generated}"));
            }
        }
    }
    if bless {
        std::fs::write(&path, &readme).expect("write README.md");
    }
    assert!(
        stale.is_empty(),
        "README.md is out of date (run BERTH_BLESS=1 cargo test --test readme):\n{}",
        stale.join("\n")
    );
    // Every metric the code registers is documented.
    let (_, _, documented) = section(&readme, "metrics");
    for name in metrics.names() {
        assert!(
            documented.contains(&format!("`{name}`")),
            "{name} undocumented"
        );
    }
}

/// The code layout table names every folder of `src/`, so a new part of the
/// design cannot go unmentioned.
#[test]
fn readme_layout_names_every_source_folder() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let layout = readme
        .split("## Code layout")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("README.md has a \"Code layout\" section");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(root.join("src")).expect("src/") {
        let entry = entry.expect("src/ entry");
        if entry.file_type().expect("file type").is_dir() {
            let name = format!("`{}/`", entry.file_name().to_string_lossy());
            if !layout.contains(&name) {
                missing.push(name);
            }
        }
    }
    assert!(
        missing.is_empty(),
        "README.md's code layout does not mention {missing:?}"
    );
}
