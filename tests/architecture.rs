//! The crate's import graph, read from its source: no cycles between modules, `store` uses no
//! Redis item, `publish` no SQL item, and `dispatch` does not know the admin endpoints (the
//! composition root, `app`, wires them together). A module that brings one of these back fails
//! here, naming the file and the import.
//!
//! A module is a file under `src/` (`mod.rs` is its folder's module). An import is any path that
//! starts with `crate::`, `super::` or `self::`, in a `use` or inline, grouped paths included;
//! it points at the longest module prefix of the path. A module and its own submodules may use
//! each other (a folder's `mod.rs` re-exports what its files define); unit-test modules at the
//! end of a file are not read.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every module of the crate, by path (`""` is the crate root), with its source.
fn modules() -> BTreeMap<String, (PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&root, &mut files);
    files
        .into_iter()
        .map(|path| {
            let rel = path.strip_prefix(&root).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            if parts == ["lib"] || parts == ["main"] {
                parts.clear();
            }
            let text = std::fs::read_to_string(&path).unwrap();
            (parts.join("::"), (path, code_of(&text)))
        })
        .collect()
}

/// The source without its unit tests and comments.
fn code_of(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    text.lines()
        .map(|line| match line.find("//") {
            // A `//` inside a string (a URL) cuts the rest of its line too: imports do not sit
            // on such lines.
            Some(i) => &line[..i],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every path starting with `crate::`, `super::` or `self::` in `code`, groups expanded:
/// `crate::{a::b, c}` gives `crate::a::b` and `crate::c`.
fn paths(code: &str) -> Vec<String> {
    let bytes = code.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts = [&b"crate::"[..], b"super::", b"self::"]
            .iter()
            .any(|p| bytes[i..].starts_with(p));
        if starts && (i == 0 || !ident(bytes[i - 1]) && bytes[i - 1] != b':') {
            let (found, end) = use_tree(code, i);
            out.extend(found);
            i = end.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// Parses the use tree starting at `at` (a path, possibly ending in a `{…}` group); returns its
/// paths and where it ends.
fn use_tree(code: &str, at: usize) -> (Vec<String>, usize) {
    let bytes = code.as_bytes();
    let mut i = at;
    let mut prefix = String::new();
    loop {
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            i += 1;
        }
        prefix.push_str(&String::from_utf8_lossy(&bytes[start..i]));
        if bytes[i..].starts_with(b"::") {
            i += 2;
            if bytes[i..].starts_with(b"{") {
                i += 1;
                let mut found = Vec::new();
                loop {
                    while i < bytes.len() && (bytes[i].is_ascii_whitespace() || bytes[i] == b',') {
                        i += 1;
                    }
                    if i >= bytes.len() || bytes[i] == b'}' {
                        return (found, i + 1);
                    }
                    let (inner, end) = use_tree(code, i);
                    let inner = if inner.is_empty() {
                        vec![String::new()]
                    } else {
                        inner
                    };
                    found.extend(inner.into_iter().map(|p| format!("{prefix}::{p}")));
                    // Skip an `as name` or anything else up to the next item.
                    i = end;
                    while i < bytes.len() && bytes[i] != b',' && bytes[i] != b'}' {
                        i += 1;
                    }
                }
            }
            prefix.push_str("::");
        } else {
            return (vec![prefix], i);
        }
    }
}

/// The module `path` (as written in module `from`) points at: its longest prefix that is a
/// module.
fn resolve(from: &str, path: &str, known: &BTreeMap<String, (PathBuf, String)>) -> Option<String> {
    let mut segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    let mut base: Vec<&str> = if from.is_empty() {
        Vec::new()
    } else {
        from.split("::").collect()
    };
    match segs.first() {
        Some(&"crate") => {
            base.clear();
            segs.remove(0);
        }
        Some(&"self") => {
            segs.remove(0);
        }
        Some(&"super") => {
            while segs.first() == Some(&"super") {
                base.pop();
                segs.remove(0);
            }
        }
        _ => return None,
    }
    base.extend(segs);
    (0..=base.len())
        .rev()
        .map(|n| base[..n].join("::"))
        .find(|m| known.contains_key(m))
}

/// `a` is `b`, or one is inside the other.
fn related(a: &str, b: &str) -> bool {
    a == b
        || a.is_empty()
        || b.is_empty()
        || a.starts_with(&format!("{b}::"))
        || b.starts_with(&format!("{a}::"))
}

/// Module → the modules it imports (related ones left out), each with the path that shows it.
fn graph() -> BTreeMap<String, BTreeMap<String, String>> {
    let known = modules();
    let mut edges: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (module, (_, code)) in &known {
        let out = edges.entry(module.clone()).or_default();
        for path in paths(code) {
            if let Some(to) = resolve(module, &path, &known)
                && !related(module, &to)
            {
                out.entry(to).or_insert(path);
            }
        }
    }
    edges
}

/// The strongly connected components with more than one module (Tarjan).
fn cycles(edges: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeMap<String, String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        let edges = s.edges;
        for w in edges.get(v).into_iter().flat_map(|m| m.keys()) {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !state.index.contains_key(v.as_str()) {
            visit(&mut state, v);
        }
    }
    state.found
}

/// The graph between the crate's top-level modules (`store`, `dispatch`, ...): a path into a
/// folder's re-exports points at the folder, so a cycle through them shows only here.
fn top_level(
    edges: &BTreeMap<String, BTreeMap<String, String>>,
) -> BTreeMap<String, BTreeMap<String, String>> {
    let top = |m: &str| m.split("::").next().unwrap_or_default().to_owned();
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (from, to) in edges {
        for (to, path) in to {
            let (a, b) = (top(from), top(to));
            if !a.is_empty() && !b.is_empty() && a != b {
                out.entry(a)
                    .or_default()
                    .entry(b)
                    .or_insert_with(|| format!("{from}: {path}"));
            }
        }
    }
    out
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let files = graph();
    for edges in [top_level(&files), files] {
        no_cycles(&edges);
    }
}

fn no_cycles(edges: &BTreeMap<String, BTreeMap<String, String>>) {
    let found = cycles(edges);
    let described: Vec<String> = found
        .iter()
        .map(|component| {
            let arrows: Vec<String> = component
                .iter()
                .flat_map(|from| {
                    edges[from]
                        .iter()
                        .filter(|(to, _)| component.contains(to))
                        .map(move |(to, path)| format!("{from} -> {to} ({path})"))
                })
                .collect();
            arrows.join("; ")
        })
        .collect();
    assert!(
        found.is_empty(),
        "modules that import each other (move what both need into a module of its own): {}",
        described.join(" | ")
    );
    // The graph is read at all: the composition root imports the relay and the admin endpoints.
    assert!(
        edges["app"].contains_key("admin")
            && edges["app"].keys().any(|m| m.starts_with("dispatch")),
        "{:?}",
        edges["app"]
    );
}

/// Lines of `module` and its submodules that mention `needle` as the start of a path.
fn mentions(module: &str, needle: &str) -> Vec<String> {
    modules()
        .into_iter()
        .filter(|(m, _)| m == module || m.starts_with(&format!("{module}::")))
        .flat_map(|(_, (path, code))| {
            code.lines()
                .enumerate()
                .filter(|(_, line)| {
                    line.match_indices(needle).any(|(i, _)| {
                        i == 0 || {
                            let b = line.as_bytes()[i - 1];
                            !(b.is_ascii_alphanumeric() || b == b'_' || b == b':')
                        }
                    })
                })
                .map(|(n, line)| format!("{}:{}: {}", path.display(), n + 1, line.trim()))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn the_store_knows_no_redis_and_publishing_knows_no_sql() {
    for (module, needle, why) in [
        ("store", "redis::", "the store speaks SQL only"),
        ("publish", "sea_orm::", "publishing speaks Redis only"),
        ("publish", "sqlx::", "publishing speaks Redis only"),
        ("publish", "crate::store", "publishing speaks Redis only"),
        (
            "dispatch",
            "crate::admin",
            "the relay does not know the admin endpoints",
        ),
        (
            "dispatch",
            "crate::app",
            "the relay does not know the node that wires it",
        ),
        (
            "admin",
            "crate::app",
            "the admin endpoints do not know the node that serves them",
        ),
    ] {
        let found = mentions(module, needle);
        assert!(found.is_empty(), "{why}: {}", found.join("; "));
    }
    // The search finds what it looks for.
    assert!(!mentions("publish", "redis::").is_empty());
    assert!(!mentions("store", "sea_orm::").is_empty());
}

#[test]
fn grouped_and_relative_paths_are_read() {
    let found = paths("use crate::{a::b, c::{d, e as f}};\nlet x = super::g::h(1);");
    assert_eq!(
        found,
        ["crate::a::b", "crate::c::d", "crate::c::e", "super::g::h"]
    );
}
