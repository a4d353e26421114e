//! The import rule of the source tree: a module imports only modules below it.
//!
//! Top-level modules, lowest first: `error`, `files` → `cpu` → `model` → `data` → `decode` →
//! `draft` → `spec` → `train` → `eval` → `cli` (the binary's). Within a folder, files are ordered
//! too (`FILE_ORDER`); a folder's `mod.rs` may name its own files. A `crate::` path in code
//! (comments and strings aside) that points above the file's own place fails this test, naming
//! the file, the line and the path.
use std::path::{Path, PathBuf};

const LAYERS: &[&[&str]] = &[&["error", "files"], &["cpu"], &["model"], &["data"], &["decode"], &["draft"], &["spec"], &["train"], &["eval"], &["serve"], &["cli", "main", "lib"]];

/// Files of a folder, lowest first: a file may import only files before it (and itself).
const FILE_ORDER: &[(&str, &[&str])] = &[
    ("cpu", &["testutil", "isa", "team", "exp", "lanes", "storage", "matmul", "bf16", "quant", "ops", "attention", "reduce"]),
    ("model", &["kv_cache", "tokenizer", "gguf", "llama", "loader", "timing", "fixtures"]),
    ("data", &["manifest"]),
    ("decode", &["sampling", "generate"]),
    ("draft", &["tree", "budget", "choice", "datastore", "lookup", "grad", "heads", "layer", "eagle3", "drafter", "export"]),
    ("spec", &["verify", "plan", "prefix", "session", "driver", "conversation"]),
    ("train", &["loss", "parallel", "heads", "layer", "distill", "recipe"]),
    ("eval", &["run", "report", "tune", "roofline", "bench"]),
    ("serve", &["api", "engine", "http"]),
];

fn layer_of(top: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&top))
}

/// `src/a/b.rs` → ("a", Some("b")); `src/a.rs` → ("a", None); `src/a/mod.rs` → ("a", None).
fn place(src: &Path, file: &Path) -> (String, Option<String>) {
    let rel = file.strip_prefix(src).unwrap();
    let parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string()).collect();
    match parts.as_slice() {
        [top] => (top.clone(), None),
        [top, f] if f == "mod" => (top.clone(), None),
        [top, f, ..] => (top.clone(), Some(f.clone())),
        _ => unreachable!(),
    }
}

/// Code without comments and the insides of string and char literals.
fn code_only(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == '/' && b.get(i + 1) == Some(&'/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if b[i] == '/' && b.get(i + 1) == Some(&'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == '*' && b[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if b[i] == '"' {
            out.push('"');
            i += 1;
            while i < b.len() && b[i] != '"' {
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            out.push('"');
            i += 1;
        } else if b[i] == '\'' && b.get(i + 2) == Some(&'\'') {
            i += 3; // 'x'
        } else if b[i] == '\'' && b.get(i + 1) == Some(&'\\') {
            i += 2;
            while i < b.len() && b[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

fn ident_at(s: &str) -> String {
    s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()
}

/// Every path `crate::a::b…` in `code` as its first two segments, with its line; `crate::{a::x, b}`
/// gives one entry per item.
fn crate_paths(code: &str, root: &str) -> Vec<(usize, String, Option<String>)> {
    let mut out = Vec::new();
    let pat = format!("{root}::");
    let mut from = 0;
    while let Some(at) = code[from..].find(&pat) {
        let start = from + at;
        from = start + pat.len();
        if start > 0 && code[..start].chars().last().is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let line = code[..start].matches('\n').count() + 1;
        let rest = &code[from..];
        let items: Vec<String> = if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let end = group.char_indices().find(|&(_, c)| {
                depth += match c {
                    '{' => 1,
                    '}' => -1,
                    _ => 0,
                };
                depth == 0
            });
            let inner = &group[..end.map_or(group.len(), |e| e.0)];
            let mut parts = Vec::new();
            let (mut d, mut cur) = (0, String::new());
            for c in inner.chars() {
                match c {
                    '{' => d += 1,
                    '}' => d -= 1,
                    ',' if d == 0 => parts.push(std::mem::take(&mut cur)),
                    _ => {}
                }
                cur.push(c);
            }
            parts.push(cur);
            parts.into_iter().map(|p| p.trim().trim_start_matches(',').trim().to_string()).filter(|p| !p.is_empty()).collect()
        } else {
            vec![rest.to_string()]
        };
        for it in items {
            let first = ident_at(&it);
            let second = it.strip_prefix(&format!("{first}::")).map(ident_at).filter(|s| !s.is_empty());
            if !first.is_empty() {
                out.push((line, first, second));
            }
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The violations in the tree at `src`, as "file:line: path (why)".
fn violations(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let mut bad = Vec::new();
    for f in &files {
        let (top, file) = place(src, f);
        let Some(own) = layer_of(&top) else {
            bad.push(format!("{}: module '{top}' has no place in the layer list of tests/layers.rs", f.display()));
            continue;
        };
        let code = code_only(&std::fs::read_to_string(f).unwrap());
        // The binary's files name the library `selfspec::`; library files name it `crate::`.
        let root = if matches!(top.as_str(), "cli" | "main") { "selfspec" } else { "crate" };
        for (line, first, second) in crate_paths(&code, root) {
            let Some(theirs) = layer_of(&first) else { continue }; // Error, Result: re-exported from `error`
            let path = format!("{root}::{first}{}", second.as_ref().map(|s| format!("::{s}")).unwrap_or_default());
            if theirs > own {
                bad.push(format!("{}:{line}: {path} (`{first}` is above `{top}`)", f.display()));
            } else if theirs == own && first == top {
                let order = FILE_ORDER.iter().find(|(d, _)| *d == top).map(|(_, o)| *o);
                if let (Some(order), Some(me), Some(target)) = (order, &file, &second) {
                    let rank = |n: &str| order.iter().position(|x| *x == n);
                    match (rank(me), rank(target)) {
                        (None, _) => bad.push(format!("{}: file '{me}' has no place in {top}'s file order in tests/layers.rs", f.display())),
                        (Some(a), Some(b)) if b > a => bad.push(format!("{}:{line}: {path} (`{target}` is above `{me}` in {top}/)", f.display())),
                        _ => {}
                    }
                }
            }
        }
    }
    bad
}

#[test]
fn imports_point_only_downward() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let bad = violations(&src);
    assert!(bad.is_empty(), "imports that point upward:\n{}", bad.join("\n"));
}

/// The checker itself: an upward import, one hidden in a `crate::{…}` group, and one in a
/// comment or string (which are not imports).
#[test]
fn the_checker_finds_upward_imports() {
    let dir = std::env::temp_dir().join(format!("selfspec-layers-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("cpu")).unwrap();
    std::fs::create_dir_all(dir.join("draft")).unwrap();
    std::fs::write(dir.join("cpu/isa.rs"), "use crate::model::Llama;\n// crate::spec::x\nconst S: &str = \"crate::eval\";\n").unwrap();
    std::fs::write(dir.join("cpu/team.rs"), "use crate::{error::Error, cpu::matmul::X};\nfn f() { crate::cpu::isa::isa(); }\n").unwrap();
    std::fs::write(dir.join("draft/tree.rs"), "use crate::{cpu::isa, model::Llama};\n").unwrap();
    let bad = violations(&dir);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(bad.len(), 2, "{bad:#?}");
    assert!(bad[0].contains("isa.rs:1: crate::model::Llama"), "{bad:#?}");
    assert!(bad[1].contains("team.rs:1: crate::cpu::matmul"), "{bad:#?}");
}
