//! Writes a GGUF model as an MLX model directory holding the exact arrays
//! mlxbcd computes with (see mlxbc_daemon::model::export), for mlx-lm to run
//! the same weights in reference ids and benchmarks.
//!
//! Usage: mlxbc-gguf-to-mlx MODEL.gguf OUT_DIR [float32|float16|bfloat16]

use anyhow::{bail, Result};
use mlx_rs::Dtype;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dtype = match args.get(3).map(String::as_str) {
        None | Some("float32") => Dtype::Float32,
        Some("float16") => Dtype::Float16,
        Some("bfloat16") => Dtype::Bfloat16,
        Some(other) => bail!("unknown dtype {other} (float32, float16, bfloat16)"),
    };
    if args.len() < 3 {
        bail!("usage: mlxbc-gguf-to-mlx MODEL.gguf OUT_DIR [float32|float16|bfloat16]");
    }
    mlxbc_daemon::families::llama::export::gguf_to_mlx_dir(args[1].as_ref(), args[2].as_ref(), dtype)
}
