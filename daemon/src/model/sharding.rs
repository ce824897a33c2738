//! Cutting weights into a rank's part for tensor parallelism, as mlx-lm's
//! `shard_linear` cuts them: a projection whose output is split
//! ("all-to-sharded": q/k/v, gate/up, the vocabulary of an embedding) keeps
//! a block of rows; one whose input is split ("sharded-to-all": o, down)
//! keeps a block of columns and its partial products are summed over the
//! ranks. Every part is copied into its own buffer: MLX's slices are views
//! that would keep the whole tensor resident, and a rank's memory is meant
//! to be its part.

use super::layers::{Embedding, Linear, Quantized};
use anyhow::{bail, Result};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

/// `a` (any view) copied into a buffer of its own.
pub fn owned(a: &Array) -> Result<Array> {
    let c = a.contiguous()?;
    c.eval()?;
    let shape = c.shape().to_vec();
    Ok(match c.dtype() {
        Dtype::Float32 => Array::from_slice(c.as_slice::<f32>(), &shape),
        Dtype::Float16 => Array::from_slice(c.as_slice::<half::f16>(), &shape),
        Dtype::Bfloat16 => Array::from_slice(c.as_slice::<half::bf16>(), &shape),
        Dtype::Uint32 => Array::from_slice(c.as_slice::<u32>(), &shape),
        Dtype::Int32 => Array::from_slice(c.as_slice::<i32>(), &shape),
        Dtype::Uint8 => Array::from_slice(c.as_slice::<u8>(), &shape),
        other => bail!("cannot copy a weight of dtype {other:?} into a shard"),
    })
}

fn rows(a: &Array, start: i32, end: i32) -> Result<Array> {
    owned(&a.index(start..end))
}

fn cols(a: &Array, start: i32, end: i32) -> Result<Array> {
    owned(&a.index((.., start..end)))
}

fn quantized_rows(q: &Quantized, start: i32, end: i32) -> Result<Quantized> {
    Ok(Quantized {
        weight: rows(&q.weight, start, end)?,
        scales: rows(&q.scales, start, end)?,
        biases: rows(&q.biases, start, end)?,
        ..q.clone()
    })
}

/// Output rows `[start, end)` of a projection (its bias alike).
pub fn linear_rows(l: &Linear, start: i32, end: i32) -> Result<Linear> {
    let bias = |b: &Option<Array>| b.as_ref().map(|b| rows(b, start, end)).transpose();
    Ok(match l {
        Linear::Dense { weight, bias: b } => Linear::Dense { weight: rows(weight, start, end)?, bias: bias(b)? },
        Linear::Quantized { q, bias: b } => Linear::Quantized { q: quantized_rows(q, start, end)?, bias: bias(b)? },
    })
}

/// Input columns `[start, end)` of a projection. Its bias is added once
/// over the ranks' sum: kept where `keep_bias` (rank 0), dropped elsewhere.
/// A quantized matrix is cut only on its groups' and words' boundaries.
pub fn linear_cols(l: &Linear, start: i32, end: i32, keep_bias: bool) -> Result<Linear> {
    let bias = |b: &Option<Array>| if keep_bias { b.clone() } else { None };
    Ok(match l {
        Linear::Dense { weight, bias: b } => Linear::Dense { weight: cols(weight, start, end)?, bias: bias(b) },
        Linear::Quantized { q, bias: b } => {
            let per_word = 32 / q.bits;
            if start % q.group_size != 0 || end % q.group_size != 0 || start % per_word != 0 {
                bail!(
                    "columns {start}..{end} do not fall on the quantization groups of {} (cut it into fewer parts)",
                    q.group_size
                );
            }
            let q = Quantized {
                weight: cols(&q.weight, start / per_word, end / per_word)?,
                scales: cols(&q.scales, start / q.group_size, end / q.group_size)?,
                biases: cols(&q.biases, start / q.group_size, end / q.group_size)?,
                ..q.clone()
            };
            Linear::Quantized { q, bias: bias(b) }
        }
    })
}

/// Rows `[start, end)` of an embedding table (a block of the vocabulary).
pub fn embedding_rows(e: &Embedding, start: i32, end: i32) -> Result<Embedding> {
    Ok(match e {
        Embedding::Dense(w) => Embedding::Dense(rows(w, start, end)?),
        Embedding::Quantized(q) => Embedding::Quantized(quantized_rows(q, start, end)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splitting a projection's rows or columns and recombining the parts
    /// (concatenating outputs, summing partial products) gives the whole's
    /// result: the identity tensor parallelism rests on.
    #[test]
    fn row_and_column_parts_recombine_to_the_whole() {
        let w = mlx_rs::random::normal::<f32>(&[8, 6], None, None, None).unwrap();
        let b = mlx_rs::random::normal::<f32>(&[8], None, None, None).unwrap();
        let x = mlx_rs::random::normal::<f32>(&[2, 6], None, None, None).unwrap();
        let whole = Linear::Dense { weight: w.clone(), bias: Some(b.clone()) };
        let want = whole.forward(&x).unwrap();
        let parts: Vec<Array> =
            (0..2).map(|r| linear_rows(&whole, r * 4, r * 4 + 4).unwrap().forward(&x).unwrap()).collect();
        let got = mlx_rs::ops::concatenate(&[&parts[0], &parts[1]], -1).unwrap();
        assert!(got.all_close(&want, 1e-5, 1e-5, None).unwrap());
        let sum = (0..2)
            .map(|r| {
                let part = linear_cols(&whole, r * 3, r * 3 + 3, r == 0).unwrap();
                part.forward(&x.index((.., r * 3..r * 3 + 3))).unwrap()
            })
            .reduce(|a, b| a.add(&b).unwrap())
            .unwrap();
        assert!(sum.all_close(&want, 1e-5, 1e-5, None).unwrap());
        // A copy, not a view of the whole buffer.
        let part = linear_rows(&whole, 0, 4).unwrap();
        assert_eq!(part.nbytes(), 4 * 6 * 4 + 4 * 4);
    }
}
