//! `mlxbc embed [-m MODEL] TEXT...|-`: sentence embeddings from an
//! embedding model on the daemon, one JSON array per input (a line each)
//! or a NumPy `.npy` matrix. Texts the daemon embedded before come back
//! from its store without being computed again.

use anyhow::{bail, Context, Result};
use mlxbc_client::{Client, EmbedRequest};
use std::io::{Read, Write};

/// How the vectors are printed.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON array per input, a line each.
    Json,
    /// A float32 `.npy` matrix, one row per input (binary, to a file or pipe).
    Npy,
}

#[derive(clap::Args, Debug)]
pub struct EmbedArgs {
    /// Texts to embed, each on its own; `-` reads stdin, one text per line.
    #[arg(required = true)]
    texts: Vec<String>,
    /// Embedding model (default: the first one `mlxbc models` lists).
    #[arg(long, short, value_parser = crate::model_arg)]
    model: Option<String>,
    /// Keep each vector's first N values, normalized again (Matryoshka models).
    #[arg(long)]
    dimensions: Option<u32>,
    /// The model's instruction to put before each text, by name (`query`
    /// for Qwen3-Embedding's and E5's queries, `document`).
    #[arg(long)]
    prompt: Option<String>,
    /// Refuse a text longer than the model takes instead of cutting it.
    #[arg(long)]
    no_truncate: bool,
    #[arg(long, value_enum, default_value_t = Format::Json)]
    format: Format,
    /// How long the model stays loaded afterwards (e.g. 10m, forever).
    #[arg(long)]
    keep_alive: Option<String>,
    /// Print tokens, store hits and time to stderr.
    #[arg(long, short)]
    verbose: bool,
}

pub async fn run(client: &mut Client, args: &EmbedArgs) -> Result<()> {
    let mut inputs = Vec::new();
    for t in &args.texts {
        if t == "-" {
            let mut text = String::new();
            std::io::stdin().read_to_string(&mut text).context("reading texts from stdin")?;
            inputs.extend(text.lines().filter(|l| !l.is_empty()).map(String::from));
        } else {
            inputs.push(t.clone());
        }
    }
    if inputs.is_empty() {
        bail!("no text to embed");
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        None => match client.list_models().await?.into_iter().find(|m| m.capability == "embedding") {
            Some(m) => m.name,
            None => bail!(
                "no embedding model is installed: put a sentence-transformers directory (e.g. all-MiniLM-L6-v2) \
                 in the models directory, or name one with -m"
            ),
        },
    };
    let request = EmbedRequest {
        model,
        inputs,
        truncate: !args.no_truncate,
        dimensions: args.dimensions,
        keep_alive: crate::keep_alive(&args.keep_alive)?,
        prompt: args.prompt.clone(),
        token_inputs: Vec::new(),
    };
    let e = client.embed(request).await?;
    let mut out = std::io::stdout().lock();
    match args.format {
        Format::Json => {
            for v in &e.vectors {
                writeln!(out, "{}", serde_json::to_string(v)?)?;
            }
        }
        Format::Npy => out.write_all(&npy(&e.vectors))?,
    }
    if args.verbose {
        eprintln!(
            "{}: {} input{} ({} tokens), {} from the store, {:.0} ms ({:.0} ms loading)",
            e.model,
            e.vectors.len(),
            if e.vectors.len() == 1 { "" } else { "s" },
            e.prompt_tokens,
            e.cached,
            e.total_ms,
            e.load_ms
        );
    }
    Ok(())
}

/// A little-endian float32 `.npy` (version 1.0) of `rows`.
fn npy(rows: &[Vec<f32>]) -> Vec<u8> {
    let cols = rows.first().map_or(0, Vec::len);
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {cols}), }}", rows.len());
    // Magic (6) + version (2) + length (2) + header + newline: a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in rows {
        for x in v {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn npy_headers_are_padded_to_64_bytes() {
        let b = super::npy(&[vec![1.0, 2.0], vec![3.0, 4.0]]);
        let header = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + header) % 64, 0);
        assert_eq!(b.len(), 10 + header + 16);
        assert_eq!(&b[10 + header..10 + header + 4], &1.0f32.to_le_bytes());
    }
}
