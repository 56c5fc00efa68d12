//! The documentation's configuration and metrics references
//! (`docs/operations.md`) are generated from the code, and its code layout
//! (`docs/architecture.md`) names every folder of `src/`; this test fails
//! when they drift. `BERTH_BLESS=1 cargo test --test readme` rewrites the
//! generated references. It also checks that every relative link of the
//! README and of `docs/` leads to a file that exists and, with an anchor,
//! to a heading of that file.

use std::path::{Path, PathBuf};

/// The document that holds the generated configuration and metrics
/// references.
const REFERENCES: &str = "docs/operations.md";
/// The document whose "Code layout" section names every folder of `src/`.
const LAYOUT: &str = "docs/architecture.md";

fn section<'a>(doc: &'a str, file: &str, name: &str) -> (usize, usize, &'a str) {
    let begin =
        format!("<!-- begin:{name} (generated; BERTH_BLESS=1 cargo test --test readme) -->\n");
    let end = format!("<!-- end:{name} -->");
    let start = doc
        .find(&begin)
        .unwrap_or_else(|| panic!("{file} has no {begin:?} marker"))
        + begin.len();
    let stop = doc[start..]
        .find(&end)
        .unwrap_or_else(|| panic!("{file} has no {end:?} marker"))
        + start;
    (start, stop, &doc[start..stop])
}

#[test]
fn readme_references_match_the_code() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(REFERENCES);
    let mut doc = std::fs::read_to_string(&path).expect(REFERENCES);
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
        let (start, stop, _) = section(&doc, REFERENCES, name);
        if doc[start..stop] != generated {
            if bless {
                doc.replace_range(start..stop, &generated);
            } else {
                stale.push(format!(
                    "--- {name} in {REFERENCES} should be:\n{generated}"
                ));
            }
        }
    }
    if bless {
        std::fs::write(&path, &doc).expect("write the references");
    }
    assert!(
        stale.is_empty(),
        "{REFERENCES} is out of date (run BERTH_BLESS=1 cargo test --test readme):\n{}",
        stale.join("\n")
    );
    // Every metric the code registers is documented.
    let (_, _, documented) = section(&doc, REFERENCES, "metrics");
    for name in metrics.names() {
        assert!(
            documented.contains(&format!("`{name}`")),
            "{name} undocumented in {REFERENCES}"
        );
    }
}

/// The code layout table names every folder of `src/`, so a new part of the
/// design cannot go unmentioned.
#[test]
fn readme_layout_names_every_source_folder() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join(LAYOUT)).expect(LAYOUT);
    let layout = doc
        .split("## Code layout")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .unwrap_or_else(|| panic!("{LAYOUT} has a \"Code layout\" section"));
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
        "{LAYOUT}'s code layout does not mention {missing:?}"
    );
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-`
/// and `_` dropped, spaces made `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(doc: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in doc.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

/// The README moved its details into `docs/`: every relative link between
/// them (and to the repository's files) must still lead somewhere.
#[test]
fn readme_and_docs_links_resolve() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).expect("docs/") {
        let path = entry.expect("docs/ entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    let mut broken = Vec::new();
    for file in &files {
        let doc = std::fs::read_to_string(file).expect("a Markdown file");
        let shown = file
            .strip_prefix(root)
            .unwrap_or(file)
            .display()
            .to_string();
        let mut rest = doc.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            rest = &rest[end..];
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, fragment) = match target.split_once('#') {
                Some((p, f)) => (p, Some(f)),
                None => (target, None),
            };
            let linked = if path.is_empty() {
                file.clone()
            } else {
                file.parent().expect("a folder").join(path)
            };
            if !linked.exists() {
                broken.push(format!("{shown}: {target} (no such file)"));
                continue;
            }
            if let Some(fragment) = fragment
                && linked.extension().is_some_and(|e| e == "md")
            {
                let text = std::fs::read_to_string(&linked).expect("a linked Markdown file");
                if !anchors(&text).iter().any(|a| a == fragment) {
                    broken.push(format!("{shown}: {target} (no such heading)"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
