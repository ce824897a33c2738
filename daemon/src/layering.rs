//! The module order, checked: a module may use the modules below it in
//! [`LAYERS`], never one above it or beside it. docs/architecture.md
//! explains each layer; a new top-level module must be placed here, or this
//! test fails and says so.

/// Top to bottom. Modules on one line are peers and do not use each other.
pub const LAYERS: &[&[&str]] = &[
    // I/O: the socket and its connections, the HTTP gateway, and what both hold.
    &["server"],
    &["http"],
    &["state"],
    // Off the engine thread: checking and preparing a request.
    &["requests"],
    // The engine thread: jobs, the scheduler, batches, sequences, residency, speech.
    &["engine"],
    // A model split over a group of daemons: rank 0's coordinator and
    // split model, and the workers' loop.
    &["cluster"],
    // What the engine and the connections share: model lookup, named
    // sessions, the prompt cache, media preparation and the feature store,
    // per-token decoding policy.
    &["catalog", "sessions", "prompt_cache", "media", "decoding"],
    // One folder per model family, then the kit they are built from.
    &["families"],
    &["model"],
    &["audio"],
    // Foundations (`distributed`: MLX's process groups and collectives;
    // `blas_core`: which OpenBLAS kernels MLX's products run on).
    &["error", "limits", "logging", "distributed", "metrics", "blas_core"],
];

/// Items of the crate root anyone may use (`lib.rs`).
const ROOT_ITEMS: &[&str] = &["rss_bytes", "BLAS", "run"];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The top-level modules a source text names through `crate::` (also in
/// `crate::{a, b::c}` groups), comments left out.
pub fn crate_uses(source: &str) -> Vec<String> {
    let code: String =
        source.lines().map(|l| if l.trim_start().starts_with("//") { "" } else { l }).collect::<Vec<_>>().join("\n");
    let mut out = Vec::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        // `mlxbc_shared::...` and the like are other crates, not this one.
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut item, mut items) = (0, String::new(), Vec::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => items.push(std::mem::take(&mut item)),
                    _ => item.push(c),
                }
            }
            items.push(item);
            out.extend(items.iter().map(|i| first_segment(i)).filter(|s| !s.is_empty()));
        } else {
            out.push(first_segment(rest));
        }
    }
    out
}

fn first_segment(path: &str) -> String {
    path.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                sources(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    #[test]
    fn no_module_uses_one_above_it_or_beside_it() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&src, &mut files);
        let mut wrong = Vec::new();
        for file in files {
            let rel = file.strip_prefix(&src).unwrap();
            let top = rel.components().next().unwrap().as_os_str().to_string_lossy();
            let top = top.trim_end_matches(".rs");
            if top == "bin" || top == "lib" || top == "layering" {
                continue;
            }
            let Some(own) = layer_of(top) else {
                wrong.push(format!("{}: module `{top}` is not in layering::LAYERS; place it there", rel.display()));
                continue;
            };
            for used in crate_uses(&std::fs::read_to_string(&file).unwrap()) {
                if used == top || ROOT_ITEMS.contains(&used.as_str()) {
                    continue;
                }
                match layer_of(&used) {
                    Some(l) if l > own => {}
                    Some(_) => {
                        wrong.push(format!("{}: `{top}` uses `crate::{used}`, which is not below it", rel.display()))
                    }
                    None => wrong.push(format!("{}: uses `crate::{used}`, which is not in LAYERS", rel.display())),
                }
            }
        }
        assert!(wrong.is_empty(), "wrong-way imports (daemon/src/layering.rs has the order):\n{}", wrong.join("\n"));
    }

    #[test]
    fn uses_are_read_from_paths_groups_and_not_from_comments_or_other_crates() {
        let text = "use crate::{media, model::Model, decoding::{stop, tools}};\n// crate::server\nlet x = crate::error::E;\nmlxbc_shared::x; other_crate::y;";
        assert_eq!(crate_uses(text), vec!["media", "model", "decoding", "error"]);
    }
}
