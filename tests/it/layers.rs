//! The source keeps its shape: modules import only lower layers and never
//! each other in a circle, no function outgrows a reader's attention and no
//! file outgrows one concept. The rules and the layer table are written
//! down in `src/lib.rs`; this test reads `src/` and holds the code to them.
//!
//! Test code (`#[cfg(test)]` items) is left out: a test may reach across
//! layers and be as long as its scenario.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules by layer, bottom first: a module may import its own
/// folder's modules and modules of lower layers.
const LAYERS: &[&[&str]] = &[
    &["units", "sys", "logging", "switch"],
    &["files"],
    &["model"],
    &["target", "sample", "event"],
    &["store"],
    &["engine"],
    &["report"],
    &["export"],
    &["config", "shutdown"],
    &["app", "cli"],
];

/// The longest a function may be, in lines from `fn` to its closing brace.
const MAX_FN_LINES: usize = 150;

/// The longest a file may be, in lines of non-test code.
const MAX_FILE_LINES: usize = 1000;

/// Files that may be longer: one self-contained concept each.
const LONG_FILES: &[&str] = &["src/export/clearml/hocon.rs"];

/// One source file as a module.
struct Module {
    /// `sample::procfs`; "" for lib.rs.
    name: String,
    path: String,
    /// The code with comments, literals and test items blanked out
    /// (newlines kept, so line numbers hold).
    code: String,
    /// Non-blank lines outside test items, comments included.
    lines: usize,
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn modules() -> Vec<Module> {
    let root = src_dir();
    let mut out = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if !rel.ends_with(".rs") || rel == "main.rs" {
                continue;
            }
            let mut parts: Vec<&str> = rel.trim_end_matches(".rs").split('/').collect();
            if matches!(parts.last(), Some(&"mod") | Some(&"lib")) {
                parts.pop();
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let blanked = blank_comments_and_literals(&text);
            let tests = test_items(&blanked);
            out.push(Module {
                name: parts.join("::"),
                path: format!("src/{rel}"),
                code: blank_ranges(&blanked, &tests),
                lines: blank_ranges(&text, &tests)
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .count(),
            });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Replaces comments, string and char literals by spaces, keeping
/// newlines, so braces and paths inside them are not code.
fn blank_comments_and_literals(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let mut i = 0;
    while i < b.len() {
        let rest = &b[i..];
        let word_before = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if rest.starts_with(b"//") {
            let end = rest
                .iter()
                .position(|&c| c == b'\n')
                .map_or(b.len(), |p| i + p);
            blank(&mut out, i, end);
            i = end;
        } else if rest.starts_with(b"/*") {
            let mut depth = 0;
            let mut j = i;
            while j < b.len() {
                if b[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if b[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if !word_before
            && (rest.starts_with(b"r#") || rest.starts_with(b"r\"") || rest.starts_with(b"br"))
        {
            let start = if rest[0] == b'b' { i + 2 } else { i + 1 };
            let hashes = b[start..].iter().take_while(|&&c| c == b'#').count();
            if b.get(start + hashes) != Some(&b'"') {
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            let body = start + hashes + 1;
            let end = b[body..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(b.len(), |p| body + p + close.len());
            blank(&mut out, i, end);
            i = end;
        } else if rest[0] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            blank(&mut out, i, (j + 1).min(b.len()));
            i = j + 1;
        } else if rest[0] == b'\'' {
            // A char literal ('x', '\n', '\u{..}', '{'); else a lifetime.
            let len = if rest.get(1) == Some(&b'\\') {
                rest[2..].iter().position(|&c| c == b'\'').map(|p| p + 3)
            } else {
                text[i + 1..].chars().next().and_then(|c| {
                    (rest.get(1 + c.len_utf8()) == Some(&b'\'')).then_some(c.len_utf8() + 2)
                })
            };
            match len {
                Some(n) => {
                    blank(&mut out, i, i + n);
                    i += n;
                }
                None => i += 1,
            }
        } else {
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

/// Index just past the item that starts at `from`: its matching closing
/// brace, or its `;` when that comes before any brace.
fn item_end(code: &[u8], from: usize) -> usize {
    let mut depth = 0usize;
    for (j, &c) in code.iter().enumerate().skip(from) {
        match c {
            b';' if depth == 0 => return j + 1,
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// The byte ranges of the items marked `#[cfg(test)]` in blanked code.
fn test_items(code: &str) -> Vec<(usize, usize)> {
    let mark = "#[cfg(test)]";
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(p) = code[i..].find(mark) {
        let start = i + p;
        let end = item_end(code.as_bytes(), start + mark.len());
        out.push((start, end));
        i = end;
    }
    out
}

/// `text` with the given byte ranges blanked (newlines kept).
fn blank_ranges(text: &str, ranges: &[(usize, usize)]) -> String {
    let mut out = text.as_bytes().to_vec();
    for &(from, to) in ranges {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Blanks every item marked `#[cfg(test)]`.
fn without_tests(code: &str) -> String {
    blank_ranges(code, &test_items(code))
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The `a::b::c` path that starts at `at`, and the `{…}` group after it
/// (flattened into full paths).
fn paths_at(code: &str, at: usize) -> Vec<String> {
    let b = code.as_bytes();
    let mut j = at;
    while j < b.len() && (is_ident(b[j]) || b[j] == b':') {
        j += 1;
    }
    let raw = &code[at..j];
    let head = raw.trim_end_matches(':').to_string();
    if b.get(j) != Some(&b'{') || !(raw.is_empty() || raw.ends_with("::")) {
        return vec![head];
    }
    let end = item_end(b, j);
    let inner = &code[j + 1..end - 1];
    let mut out = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    let ib = inner.as_bytes();
    for k in 0..=ib.len() {
        let c = ib.get(k).copied().unwrap_or(b',');
        match c {
            b'{' => depth += 1,
            b'}' => depth -= 1,
            b',' if depth == 0 => {
                let part = inner[start..k].trim();
                start = k + 1;
                if part.is_empty() || part == "self" {
                    out.push(head.clone());
                } else if let Some(off) = inner[..k].rfind(part) {
                    for p in paths_at(inner, off) {
                        out.push(if head.is_empty() {
                            p
                        } else {
                            format!("{head}::{p}")
                        });
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The modules `m` refers to: through `crate::`, `super::`, and (from a
/// folder's front) its children by their bare names.
fn references(m: &Module, names: &BTreeSet<String>) -> BTreeSet<String> {
    let code = &m.code;
    let b = code.as_bytes();
    let own: Vec<&str> = if m.name.is_empty() {
        vec![]
    } else {
        m.name.split("::").collect()
    };
    let children: BTreeSet<String> = names
        .iter()
        .filter_map(|n| {
            let rest = if m.name.is_empty() {
                Some(n.as_str())
            } else {
                n.strip_prefix(&format!("{}::", m.name))
            };
            rest.filter(|r| !r.is_empty() && !r.contains("::"))
                .map(str::to_string)
        })
        .collect();
    let mut found = Vec::new();
    for (i, _) in code.match_indices("::") {
        // The path's first segment ends at `i`; find where it starts.
        let mut s = i;
        while s > 0 && is_ident(b[s - 1]) {
            s -= 1;
        }
        if s > 0 && (b[s - 1] == b':' || is_ident(b[s - 1])) {
            continue; // not the path's first segment
        }
        let first = &code[s..i];
        let base: Vec<String> = match first {
            "crate" => vec![],
            "self" => own.iter().map(|x| x.to_string()).collect(),
            "super" => {
                let mut up = own.clone();
                let mut k = s;
                while code[k..].starts_with("super::") {
                    up.pop();
                    k += "super::".len();
                }
                let full: Vec<String> = up.iter().map(|x| x.to_string()).collect();
                for p in paths_at(code, k) {
                    found.push(join(&full, &p));
                }
                continue;
            }
            c if children.contains(c) => own
                .iter()
                .map(|x| x.to_string())
                .chain([c.to_string()])
                .collect(),
            _ => continue,
        };
        if first == "crate" || first == "self" {
            for p in paths_at(code, i + 2) {
                found.push(join(&base, &p));
            }
        } else {
            let prefix: Vec<String> = base[..base.len() - 1].to_vec();
            for p in paths_at(code, s) {
                found.push(join(&prefix, &p));
            }
        }
    }
    found
        .into_iter()
        .filter_map(|p| longest_module(&p, names))
        .filter(|t| *t != m.name)
        .collect()
}

fn join(base: &[String], path: &str) -> String {
    let mut parts: Vec<String> = base.to_vec();
    parts.extend(
        path.split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_string),
    );
    parts.join("::")
}

fn longest_module(path: &str, names: &BTreeSet<String>) -> Option<String> {
    let segs: Vec<&str> = path.split("::").collect();
    (1..=segs.len())
        .rev()
        .map(|k| segs[..k].join("::"))
        .find(|c| names.contains(c))
}

fn layer_of(module: &str) -> Option<usize> {
    let top = module.split("::").next().unwrap_or("");
    LAYERS.iter().position(|l| l.contains(&top))
}

fn graph() -> (Vec<Module>, BTreeMap<String, BTreeSet<String>>) {
    let mods = modules();
    let names: BTreeSet<String> = mods.iter().map(|m| m.name.clone()).collect();
    let edges = mods
        .iter()
        .map(|m| (m.name.clone(), references(m, &names)))
        .collect();
    (mods, edges)
}

#[test]
fn every_top_level_module_has_a_layer() {
    let (mods, _) = graph();
    let missing: BTreeSet<&str> = mods
        .iter()
        .filter(|m| !m.name.is_empty() && layer_of(&m.name).is_none())
        .map(|m| m.name.split("::").next().unwrap())
        .collect();
    assert!(
        missing.is_empty(),
        "add these modules to LAYERS and to lib.rs's table: {missing:?}"
    );
}

#[test]
fn modules_import_only_lower_layers() {
    let (_, edges) = graph();
    let mut wrong = Vec::new();
    for (from, tos) in &edges {
        let (Some(lf), top_from) = (layer_of(from), from.split("::").next().unwrap()) else {
            continue;
        };
        for to in tos {
            let top_to = to.split("::").next().unwrap();
            if top_to == top_from {
                continue;
            }
            if layer_of(to).is_some_and(|lt| lt >= lf) {
                wrong.push(format!("{from} -> {to}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports that go up or sideways:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_import_cycles() {
    let (_, edges) = graph();
    // A cycle exists exactly when a depth-first search meets a module that
    // is still on its path.
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
        cycles: &mut Vec<String>,
    ) {
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for t in edges.get(n).into_iter().flatten() {
            match state.get(t.as_str()).copied().unwrap_or(0) {
                0 => visit(t, edges, state, path, cycles),
                1 => {
                    let at = path.iter().position(|p| p == t).unwrap();
                    cycles.push(format!("{} -> {t}", path[at..].join(" -> ")));
                }
                _ => {}
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
    }
    let mut state = BTreeMap::new();
    let mut cycles = Vec::new();
    for n in edges.keys() {
        if !state.contains_key(n) {
            visit(n, &edges, &mut state, &mut Vec::new(), &mut cycles);
        }
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn no_function_is_longer_than_a_reader_can_hold() {
    let mut long = Vec::new();
    for m in modules() {
        let b = m.code.as_bytes();
        for (i, _) in m.code.match_indices("fn ") {
            if i > 0 && is_ident(b[i - 1]) {
                continue;
            }
            let name: String = m.code[i + 3..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if name.is_empty() {
                continue; // `fn(` types
            }
            let end = item_end(b, i);
            if b[end - 1] != b'}' {
                continue; // a declaration without a body
            }
            let first = m.code[..i].matches('\n').count() + 1;
            let last = m.code[..end].matches('\n').count() + 1;
            if last - first + 1 > MAX_FN_LINES {
                long.push(format!(
                    "{}:{first} {name}: {} lines",
                    m.path,
                    last - first + 1
                ));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn no_file_holds_more_than_one_concept() {
    let long: Vec<String> = modules()
        .iter()
        .filter(|m| !LONG_FILES.contains(&m.path.as_str()))
        .filter(|m| m.lines > MAX_FILE_LINES)
        .map(|m| format!("{}: {} lines", m.path, m.lines))
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_FILE_LINES} non-blank lines outside tests:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_checker_sees_what_it_must() {
    // The rules above pass vacuously if the reader sees nothing: pin a few
    // facts of the source it must find.
    let (mods, edges) = graph();
    assert!(mods.len() > 40, "{} modules", mods.len());
    let store = &edges["store"];
    assert!(store.contains("model"), "{store:?}");
    let engine = &edges["engine"];
    assert!(
        engine.contains("store") || engine.iter().any(|e| e.starts_with("store::")),
        "{engine:?}"
    );
    // Test items are blanked: a `#[cfg(test)] mod tests` reaching anywhere
    // does not count.
    let code = without_tests("fn a() {}\n#[cfg(test)]\nmod tests {\n use crate::app::x;\n}\n");
    assert!(!code.contains("app"), "{code}");
    // Literals and comments are blanked, lifetimes are not literals.
    let code = blank_comments_and_literals(
        "let s = \"crate::app\"; // crate::cli\nfn f<'a>(x: &'a str) -> char { '{' }",
    );
    assert!(
        !code.contains("app") && !code.contains("cli") && !code.contains("'{'"),
        "{code}"
    );
    assert!(code.contains("fn f<'a>(x: &'a str)"), "{code}");
    // Groups and `super::` resolve to modules.
    let names: BTreeSet<String> = ["a", "a::b", "a::c", "d"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let m = Module {
        name: "a::c".into(),
        path: "src/a/c.rs".into(),
        code: "use crate::{d, a::b::{X, Y}};\nuse super::b::Z;\n".into(),
        lines: 2,
    };
    let refs = references(&m, &names);
    assert_eq!(refs, ["a::b", "d"].iter().map(|s| s.to_string()).collect());
}
