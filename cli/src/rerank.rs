//! `mlxbc rerank [-m MODEL] QUERY DOCUMENT...|-`: documents ordered by a
//! reranker's relevance to the query, most relevant first: a line each
//! (score, index, the document), or one JSON object per line with `--json`.
//! Pairs the daemon scored before come back from its store.

use anyhow::{bail, Context, Result};
use mlxbc_client::{Client, RerankRequest};
use std::io::{Read, Write};

#[derive(clap::Args, Debug)]
pub struct RerankArgs {
    /// What the documents are ranked against.
    query: String,
    /// The documents; `-` reads stdin, one document per line.
    #[arg(required = true)]
    documents: Vec<String>,
    /// Reranker (default: the first one `mlxbc models` lists as rerank).
    #[arg(long, short, value_parser = crate::model_arg)]
    model: Option<String>,
    /// Print only the N most relevant.
    #[arg(long)]
    top_n: Option<u32>,
    /// What relevance means, for a decoder reranker (Qwen3-Reranker's
    /// instruction; default: "Given a web search query, retrieve relevant
    /// passages that answer the query").
    #[arg(long)]
    instruction: Option<String>,
    /// One JSON object per document: index, score, document.
    #[arg(long)]
    json: bool,
    /// How long the model stays loaded afterwards (e.g. 10m, forever).
    #[arg(long)]
    keep_alive: Option<String>,
    /// Print tokens, store hits and time to stderr.
    #[arg(long, short)]
    verbose: bool,
}

pub async fn run(client: &mut Client, args: &RerankArgs) -> Result<()> {
    let mut documents = Vec::new();
    for d in &args.documents {
        if d == "-" {
            let mut text = String::new();
            std::io::stdin().read_to_string(&mut text).context("reading documents from stdin")?;
            documents.extend(text.lines().filter(|l| !l.is_empty()).map(String::from));
        } else {
            documents.push(d.clone());
        }
    }
    if documents.is_empty() {
        bail!("no document to rerank");
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        None => match client.list_models().await?.into_iter().find(|m| m.capability == "rerank") {
            Some(m) => m.name,
            None => bail!(
                "no reranker is installed: put a cross-encoder (e.g. ms-marco-MiniLM-L-6-v2) or a Qwen3-Reranker \
                 directory in the models directory, or name one with -m"
            ),
        },
    };
    let request = RerankRequest {
        model,
        query: args.query.clone(),
        documents: documents.clone(),
        top_n: args.top_n,
        keep_alive: crate::keep_alive(&args.keep_alive)?,
        instruction: args.instruction.clone(),
    };
    let r = client.rerank(request).await?;
    let mut out = std::io::stdout().lock();
    for x in &r.results {
        let document = &documents[x.index as usize];
        if args.json {
            let line = serde_json::json!({"index": x.index, "score": x.score, "document": document});
            writeln!(out, "{line}")?;
        } else {
            writeln!(out, "{:.4}\t{}\t{}", x.score, x.index, document)?;
        }
    }
    if args.verbose {
        eprintln!(
            "{}: {} documents ({} tokens), {} from the store, {:.0} ms ({:.0} ms loading)",
            r.model,
            documents.len(),
            r.prompt_tokens,
            r.cached,
            r.total_ms,
            r.load_ms
        );
    }
    Ok(())
}
