//! `mlxbc pull REPO`: fetches a model from the Hugging Face hub (or the
//! mirror `HF_ENDPOINT` names) into the standard hub cache (`HF_HOME`), with
//! hf-hub: shared with Python's huggingface_hub, resumable (an interrupted
//! file continues from its last committed chunk), a progress bar on a
//! terminal. The daemon finds the snapshot there under the repo's name.

use anyhow::{bail, Context, Result};
use hf_hub::api::tokio::ApiBuilder;
use hf_hub::{Repo, RepoType};
use std::io::IsTerminal;

/// Files an MLX or HF model directory needs (weights, configs, tokenizer, template).
const MODEL_FILES: &[&str] =
    &["*.safetensors", "*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"];

pub async fn run(repo_id: &str, revision: &str, include: &[String]) -> Result<()> {
    let api = ApiBuilder::from_env().with_progress(false).build().context("setting up the hub client")?;
    let repo = api.repo(Repo::with_revision(repo_id.to_string(), RepoType::Model, revision.to_string()));
    let info = repo.info().await.with_context(|| format!("looking up {repo_id} ({revision}) on the hub"))?;
    // Files of this very commit already in the cache are not fetched again.
    let snapshot_dir = hf_hub::Cache::from_env()
        .path()
        .join(format!("models--{}", repo_id.replace('/', "--")))
        .join("snapshots")
        .join(&info.sha);
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let patterns: Vec<glob::Pattern> = if include.is_empty() {
        let ggufs: Vec<&String> = files.iter().filter(|f| f.ends_with(".gguf")).collect();
        let has_weights = files.iter().any(|f| f.ends_with(".safetensors"));
        if !has_weights && ggufs.len() > 1 {
            let names: Vec<&str> = ggufs.iter().map(|s| s.as_str()).collect();
            bail!(
                "{repo_id} holds {} GGUF files; choose one with --include, e.g. --include '{}'\n  {}",
                ggufs.len(),
                ggufs[0],
                names.join("\n  ")
            );
        }
        let mut p: Vec<&str> = MODEL_FILES.to_vec();
        p.push("*.gguf");
        p.iter().map(|s| glob::Pattern::new(s).expect("valid pattern")).collect()
    } else {
        include.iter().map(|s| glob::Pattern::new(s)).collect::<Result<_, _>>().context("--include pattern")?
    };
    let wanted: Vec<&String> = files.iter().filter(|f| patterns.iter().any(|p| p.matches(f))).collect();
    if wanted.is_empty() {
        bail!("nothing in {repo_id} matches; its files: {}", files.join(", "));
    }
    let terminal = std::io::stderr().is_terminal();
    let mut snapshot = None;
    for f in &wanted {
        if snapshot_dir.join(f).is_file() {
            snapshot = Some(snapshot_dir.clone());
            continue;
        }
        let path = if terminal {
            let bar = indicatif::ProgressBar::new(0);
            repo.download_with_progress(f, bar).await
        } else {
            repo.download_with_progress(f, ()).await
        }
        .with_context(|| format!("downloading {f} from {repo_id} (run the same command again to resume)"))?;
        if !terminal {
            eprintln!("{f}");
        }
        snapshot = path.parent().map(|p| p.to_path_buf());
    }
    let ggufs: Vec<&&String> = wanted.iter().filter(|f| f.ends_with(".gguf")).collect();
    let name = match ggufs.as_slice() {
        [one] if !wanted.iter().any(|f| f.ends_with(".safetensors")) => format!("{repo_id}/{one}"),
        _ => repo_id.to_string(),
    };
    println!(
        "pulled {repo_id} ({} files) into {}",
        wanted.len(),
        snapshot.map_or("the hub cache".into(), |p| p.display().to_string())
    );
    println!("ask it: mlxbc ask -m {name} \"...\"");
    Ok(())
}
