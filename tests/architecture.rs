//! The shape of `src/`, checked from its text: the layers of
//! `docs/architecture.md` (every folder uses only the folders listed
//! before it in the code layout table), no import cycle between the
//! modules of one folder, and the size bars (a file's non-test lines, a
//! function's lines). Only non-test code counts: a test module may use
//! whatever helps it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The most non-test lines a file of `src/` may have.
const FILE_BAR: usize = 900;
/// The most lines a function may have.
const FN_BAR: usize = 120;
/// Functions over [`FN_BAR`] that are yet to be split, as
/// `file:function`. The list may only shrink: a function that falls under
/// the bar must leave it, and a new one may not join it.
const FNS_OVER_THE_BAR: &[&str] = &[];
/// Files over [`FILE_BAR`] that are yet to be split, likewise.
const FILES_OVER_THE_BAR: &[&str] = &[];

struct Source {
    /// `src/a/b.rs`
    path: String,
    /// The module's path: `["a", "b"]` for `src/a/b.rs` and `src/a/b/mod.rs`.
    module: Vec<String>,
    /// The text before its test module.
    code: String,
}

fn sources() -> Vec<Source> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    let mut dirs = vec![root.join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
        .into_iter()
        .map(|path: PathBuf| {
            let rel = path
                .strip_prefix(root)
                .expect("under the root")
                .to_string_lossy()
                .into_owned();
            let mut module: Vec<String> = rel
                .trim_start_matches("src/")
                .trim_end_matches(".rs")
                .split('/')
                .map(String::from)
                .collect();
            if matches!(
                module.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                module.pop();
            }
            let text = std::fs::read_to_string(&path).expect("read a source");
            let code = match text.find("#[cfg(test)]\nmod tests") {
                Some(i) => text[..i].to_string(),
                None => text,
            };
            Source {
                path: rel,
                module,
                code,
            }
        })
        .collect()
}

/// The code of a line, without a `//` comment (a line comment that is the
/// whole line, or one after the code).
fn code_of(line: &str) -> &str {
    let t = line.trim_start();
    if t.starts_with("//") {
        return "";
    }
    match line.find(" // ") {
        Some(i) if !line[..i].contains('"') => &line[..i],
        _ => line,
    }
}

/// The module paths `code` refers to, as written after `crate::`,
/// `super::` or `self::`, resolved against `module` (the referring file's).
fn references(module: &[String], code: &str) -> BTreeSet<Vec<String>> {
    let parent = module[..module.len().saturating_sub(1)].to_vec();
    let mut out = BTreeSet::new();
    for line in code.lines().map(code_of) {
        for (prefix, base) in [
            ("crate::", Vec::new()),
            ("super::", parent.clone()),
            ("self::", module.to_vec()),
        ] {
            let mut rest = line;
            while let Some(i) = rest.find(prefix) {
                let before = rest[..i].chars().last();
                rest = &rest[i + prefix.len()..];
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                    continue;
                }
                for path in paths_at(rest) {
                    let mut full = base.clone();
                    full.extend(path);
                    out.insert(full);
                }
            }
        }
    }
    out
}

/// The paths written at the start of `s`: `a::b::C` gives one, and
/// `{a::X, b}` one per item.
fn paths_at(s: &str) -> Vec<Vec<String>> {
    if let Some(inner) = s.strip_prefix('{') {
        let end = inner.find('}').unwrap_or(inner.len());
        return inner[..end]
            .split(',')
            .map(|item| path_at(item.trim()))
            .filter(|p| !p.is_empty())
            .collect();
    }
    vec![path_at(s)]
}

fn path_at(s: &str) -> Vec<String> {
    let mut path = Vec::new();
    let mut rest = s;
    loop {
        let len = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if len == 0 || rest[..len] == *"super" {
            break;
        }
        path.push(rest[..len].to_string());
        match rest[len..].strip_prefix("::") {
            Some(r) if !r.starts_with('{') && !r.starts_with('*') => rest = r,
            _ => break,
        }
    }
    path
}

/// The top-level folders in the order of `docs/architecture.md`'s code
/// layout table.
fn layers() -> Vec<String> {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md"))
            .expect("docs/architecture.md");
    let start = doc.find("## Code layout").expect("a code layout section");
    doc[start..]
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once("/` |"))
        .map(|(name, _)| name.to_string())
        .collect()
}

#[test]
fn every_folder_uses_only_the_folders_below_it() {
    let layers = layers();
    let rank = |m: &str| layers.iter().position(|l| l == m);
    let mut wrong = BTreeSet::new();
    for s in sources() {
        let Some(top) = s.module.first() else {
            continue;
        };
        // lib.rs and main.rs (module `[]`) are skipped above; every folder
        // is in the table (`tests/readme.rs` says so), `cli/` last.
        let Some(mine) = rank(top) else {
            continue;
        };
        for r in references(&s.module, &s.code) {
            let Some(theirs) = r.first().and_then(|t| rank(t)) else {
                continue;
            };
            if theirs > mine {
                wrong.insert(format!("{} uses {}", s.path, r.join("::")));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "a folder uses one listed after it in docs/architecture.md:\n{}",
        wrong.into_iter().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn no_two_modules_of_a_folder_use_each_other() {
    // Edges between sibling modules: the child of their common folder that
    // each side is in.
    let mut edges: BTreeMap<Vec<String>, BTreeSet<(String, String)>> = BTreeMap::new();
    let known: BTreeSet<Vec<String>> = sources().into_iter().map(|s| s.module).collect();
    for s in sources() {
        for mut r in references(&s.module, &s.code) {
            // The longest prefix that is a module of ours.
            while !r.is_empty() && !known.contains(&r) {
                r.pop();
            }
            let common = s.module.iter().zip(&r).take_while(|(a, b)| a == b).count();
            // A module and its own folder (a child and its mod.rs) are not
            // siblings.
            if common >= s.module.len() || common >= r.len() {
                continue;
            }
            let folder = s.module[..common].to_vec();
            edges
                .entry(folder)
                .or_default()
                .insert((s.module[common].clone(), r[common].clone()));
        }
    }
    let mut cycles = Vec::new();
    for (folder, es) in &edges {
        for (a, b) in es {
            if a < b && reaches(es, b, a) {
                cycles.push(format!("{}: {a} <-> {b}", folder.join("::")));
            }
        }
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

fn reaches(edges: &BTreeSet<(String, String)>, from: &str, to: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut next = vec![from.to_string()];
    while let Some(n) = next.pop() {
        if n == to {
            return true;
        }
        if seen.insert(n.clone()) {
            next.extend(
                edges
                    .iter()
                    .filter(|(a, _)| *a == n)
                    .map(|(_, b)| b.clone()),
            );
        }
    }
    false
}

/// The functions of `code` and their lengths in lines, as rustfmt lays
/// them out: from the `fn` line to the closing brace at its indentation.
fn functions(code: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let indent = line.len() - t.len();
        let after = ["pub ", "pub(crate) ", "pub(super) ", "async ", "const "]
            .iter()
            .fold(t, |t, p| t.strip_prefix(p).unwrap_or(t));
        let after = after.strip_prefix("async ").unwrap_or(after);
        let Some(rest) = after.strip_prefix("fn ") else {
            continue;
        };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let close = format!("{}}}", " ".repeat(indent));
        if let Some(end) = lines[i..].iter().position(|l| *l == close) {
            out.push((name, end + 1));
        }
    }
    out
}

#[test]
fn files_and_functions_stay_under_the_bars() {
    let mut over_fns = BTreeSet::new();
    let mut over_files = BTreeSet::new();
    let mut report = Vec::new();
    for s in sources() {
        let n = s.code.lines().count();
        if n > FILE_BAR {
            over_files.insert(s.path.clone());
            report.push(format!("{}: {n} non-test lines", s.path));
        }
        for (name, len) in functions(&s.code) {
            if len > FN_BAR {
                over_fns.insert(format!("{}:{name}", s.path));
                report.push(format!("{}: fn {name}, {len} lines", s.path));
            }
        }
    }
    let listed_fns: BTreeSet<String> = FNS_OVER_THE_BAR.iter().map(|s| s.to_string()).collect();
    let listed_files: BTreeSet<String> = FILES_OVER_THE_BAR.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        (over_files, over_fns),
        (listed_files, listed_fns),
        "the files and functions over the bars ({FILE_BAR} non-test lines, {FN_BAR} lines) \
         are not the ones listed; now:\n{}",
        report.join("\n")
    );
}
