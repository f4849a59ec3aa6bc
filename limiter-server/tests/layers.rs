//! The server's modules are layers and imports point down only: every `crate::` path
//! in `src/` is checked against the table below, so a change that imports upward
//! fails here. README's design section draws the same table.

use std::path::Path;

/// The layers, top first, and what each may use (besides itself).
const LAYERS: &[(&str, &[&str])] = &[
    ("api", &["owner", "cluster", "config", "ground"]),
    ("admin", &["owner", "config", "ground"]),
    ("owner", &["store", "cluster", "config", "ground"]),
    ("cluster", &["config", "ground"]),
    ("store", &["config", "ground"]),
    ("security", &["config", "ground"]),
    ("config", &["ground"]),
    ("ground", &[]),
];

/// Files of the ground layer (everything may use them).
const GROUND: &[&str] = &["error", "metrics", "convert", "listener", "trace"];

/// The top: wiring, free to use everything.
const TOP: &[&str] = &["lib", "cli", "main"];

/// The layer of the module `name` (a top folder or file of `src/`), if any.
fn layer_of(name: &str) -> Option<&'static str> {
    if GROUND.contains(&name) {
        return Some("ground");
    }
    LAYERS.iter().map(|(l, _)| *l).find(|l| *l == name)
}

/// The upward imports of a file of layer `layer` with text `text`: `(line, module)`.
fn violations(layer: &str, text: &str) -> Vec<(usize, String)> {
    let allowed = LAYERS.iter().find(|(l, _)| *l == layer).map_or(&[][..], |(_, a)| a);
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String =
                rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if let Some(target) = layer_of(&name)
                && target != layer
                && !allowed.contains(&target)
            {
                out.push((i + 1, name));
            }
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn imports_point_down_only() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut found = Vec::new();
    let mut unplaced = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_string_lossy();
        let name = first.trim_end_matches(".rs");
        if TOP.contains(&name) {
            continue;
        }
        let Some(layer) = layer_of(name) else {
            unplaced.push(rel.display().to_string());
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for (line, module) in violations(layer, &text) {
            found.push(format!("{}:{line}: {layer} uses {module}", rel.display()));
        }
    }
    assert!(unplaced.is_empty(), "modules in no layer (add them to the table): {unplaced:?}");
    assert!(found.is_empty(), "imports that point up:\n  {}", found.join("\n  "));
}

#[test]
fn the_check_sees_an_upward_import() {
    let text = "use crate::metrics as m;\nuse crate::owner::Owner; // up\nfn f() { crate::config::x(); }\n";
    assert_eq!(violations("cluster", text), vec![(2, "owner".to_owned())]);
    assert!(violations("owner", text).is_empty());
    assert_eq!(
        violations("ground", "use crate::config::Limits;\n"),
        vec![(1, "config".to_owned())]
    );
}
