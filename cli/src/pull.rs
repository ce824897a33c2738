//! `mlxbc pull REPO`: fetches a model from the Hugging Face hub into its
//! shared cache (`mlxbc_pull`), with a progress bar on a terminal. The
//! daemon finds the snapshot there under the repo's name.

use anyhow::Result;
use std::io::IsTerminal;

pub async fn run(repo_id: &str, revision: &str, include: &[String]) -> Result<()> {
    let plan = mlxbc_pull::plan(repo_id, revision, include).await?;
    let terminal = std::io::stderr().is_terminal();
    for f in &plan.files {
        if plan.is_cached(f) {
            continue;
        }
        if terminal {
            plan.fetch(f, indicatif::ProgressBar::new(0)).await?;
        } else {
            plan.fetch(f, ()).await?;
            eprintln!("{f}");
        }
    }
    println!("pulled {repo_id} ({} files) into {}", plan.files.len(), plan.snapshot_dir.display());
    println!("ask it: mlxbc ask -m {} \"...\"", plan.model_name);
    Ok(())
}
