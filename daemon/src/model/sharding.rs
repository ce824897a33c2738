//! Cutting weights into a rank's part for tensor parallelism, as mlx-lm's
//! `shard_linear` cuts them: a projection whose output is split
//! ("all-to-sharded": q/k/v, gate/up, the vocabulary of an embedding) keeps
//! a block of rows; one whose input is split ("sharded-to-all": o, down)
//! keeps a block of columns and its partial products are summed over the
//! ranks. Every part is copied into its own buffer: MLX's slices are views
//! that would keep the whole tensor resident, and a rank's memory is meant
//! to be its part.

use super::layers::{Embedding, Linear, Quantized};
use crate::distributed::Shard;
use anyhow::{bail, Result};
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::{Array, Dtype};

/// A rank's tensor-parallel cut of a decoder, as mlx-lm's `shard()` makes
/// it, shared by every family that splits: attention by heads (q/k/v rows,
/// o columns, one sum over the ranks) when the head counts divide by the
/// ranks, else replicated (every rank computes every head: Qwen2.5-0.5B's 2
/// KV heads on 4 ranks); the MLP by its intermediate features (gate/up rows,
/// down columns, one sum) when they divide; the vocabulary (embedding rows,
/// and the tied or separate output head) when it divides, each rank looking
/// up or scoring its block. [`Split::whole`] is the model on one process:
/// every cut and sum is then the identity.
#[derive(Clone, Default)]
pub struct Split {
    pub shard: Option<Shard>,
    pub attention: bool,
    pub mlp: bool,
    /// This rank's vocabulary block `[start, end)`.
    pub vocab: Option<(i32, i32)>,
    /// What a family adds to the description (its experts, its recurrent layers).
    pub notes: Vec<String>,
}

impl Split {
    /// The whole model (no group).
    pub fn whole() -> Self {
        Self::default()
    }

    /// The cut over `shard` (or none) of a decoder with `heads` query and
    /// every count in `kv_heads` of key/value heads, `intermediate` MLP
    /// features and `vocab` tokens.
    pub fn plan(shard: Option<&Shard>, heads: i32, kv_heads: &[i32], intermediate: i32, vocab: i32) -> Self {
        let Some(s) = shard else { return Self::whole() };
        let n = s.size as i32;
        Self {
            shard: Some(s.clone()),
            attention: heads % n == 0 && kv_heads.iter().all(|k| k % n == 0),
            mlp: intermediate % n == 0,
            vocab: s.part(vocab),
            notes: Vec::new(),
        }
    }

    /// Ranks in the group (1 for the whole model).
    pub fn ranks(&self) -> i32 {
        self.shard.as_ref().map_or(1, |s| s.size as i32)
    }

    fn rank(&self) -> i32 {
        self.shard.as_ref().map_or(0, |s| s.rank as i32)
    }

    /// `n` heads' share of this rank when attention is split.
    pub fn heads(&self, n: i32) -> i32 {
        if self.attention {
            n / self.ranks()
        } else {
            n
        }
    }

    /// This rank's block of output rows of `l` (`width` of them) when `on`.
    pub fn rows(&self, l: Linear, width: i32, on: bool) -> Result<Linear> {
        if !on || self.shard.is_none() {
            return Ok(l);
        }
        let (n, r) = (self.ranks(), self.rank());
        linear_rows(&l, width / n * r, width / n * (r + 1))
    }

    /// This rank's block of input columns of `l` (`width` of them) when
    /// `on`; its bias stays on rank 0 only.
    pub fn cols(&self, l: Linear, width: i32, on: bool) -> Result<Linear> {
        if !on || self.shard.is_none() {
            return Ok(l);
        }
        let (n, r) = (self.ranks(), self.rank());
        linear_cols(&l, width / n * r, width / n * (r + 1), r == 0)
    }

    /// Whether `l`'s `width` input columns cut into the ranks' blocks (a
    /// quantized matrix only on its groups' boundaries).
    pub fn can_cut_cols(&self, l: &Linear, width: i32) -> bool {
        let n = self.ranks();
        if width % n != 0 {
            return false;
        }
        match l {
            Linear::Dense { .. } => true,
            Linear::Quantized { q, .. } => (width / n) % q.group_size == 0 && (width / n) % (32 / q.bits) == 0,
        }
    }

    /// This rank's block of the vocabulary of an embedding table.
    pub fn vocab_rows(&self, e: Embedding) -> Result<Embedding> {
        match self.vocab {
            Some((a, b)) => embedding_rows(&e, a, b),
            None => Ok(e),
        }
    }

    /// Same for an output head.
    pub fn vocab_head(&self, l: Linear) -> Result<Linear> {
        match self.vocab {
            Some((a, b)) => linear_rows(&l, a, b),
            None => Ok(l),
        }
    }

    /// The sum over the ranks of a split part's partial products (`on`:
    /// the part is split here).
    pub fn sum(&self, x: Array, on: bool) -> Result<Array> {
        match &self.shard {
            Some(s) if on => s.all_sum(&x),
            _ => Ok(x),
        }
    }

    /// This rank's rows of token embeddings `[B, L, D]` of `ids`: its
    /// block's rows, zeros for the others' ids (the ranks' results sum to
    /// the whole lookup, exactly: every id has one nonzero row). The whole
    /// lookup when the vocabulary is not split.
    pub fn lookup_part(&self, table: &Embedding, ids: &Array) -> Result<Array> {
        let Some((start, end)) = self.vocab else { return table.lookup(ids) };
        let ids = ids.as_dtype(Dtype::Int32)?;
        let local = ids.subtract(Array::from_int(start))?;
        let mine = ids.ge(Array::from_int(start))?.logical_and(&ids.lt(Array::from_int(end))?)?;
        let rows = table.lookup(&mlx_rs::ops::select(&mine, &local, Array::from_int(0))?)?;
        Ok(rows.multiply(mine.expand_dims(-1)?.as_dtype(rows.dtype())?)?)
    }

    /// Token embeddings of `ids` over a vocabulary-split table (one sum).
    pub fn lookup(&self, table: &Embedding, ids: &Array) -> Result<Array> {
        let part = self.lookup_part(table, ids)?;
        self.sum(part, self.vocab.is_some())
    }

    /// Logits `[B, vocab]` from each rank's block `[B, block]`: gathered
    /// `[ranks * B, block]` in rank order, laid side by side per row.
    pub fn gather_vocab(&self, logits: Array) -> Result<Array> {
        match &self.shard {
            Some(s) if self.vocab.is_some() => {
                let (n, b) = (s.size as i32, logits.shape()[0]);
                let all = s.all_gather(&logits)?;
                Ok(all.reshape(&[n, b, -1])?.transpose_axes(&[1, 0, 2])?.reshape(&[b, -1])?)
            }
            _ => Ok(logits),
        }
    }

    /// What is split and what is replicated, for the status and the log
    /// (`None` for the whole model).
    pub fn describe(&self) -> Option<String> {
        let s = self.shard.as_ref()?;
        let say = |split: bool, what: &str| if split { format!("{what} split") } else { format!("{what} replicated") };
        let mut parts =
            vec![say(self.attention, "attention heads"), say(self.mlp, "MLP"), say(self.vocab.is_some(), "vocabulary")];
        parts.extend(self.notes.iter().cloned());
        Some(format!("tensor parallel over {} ranks: {}", s.size, parts.join(", ")))
    }

    /// Logs the cut once a rank has loaded its part.
    pub fn log(&self) {
        if let (Some(s), Some(d)) = (&self.shard, self.describe()) {
            tracing::info!(rank = s.rank, "{d}");
        }
    }
}

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

/// Rows `[start, end)` of a matrix (axis -2, so a stack of experts'
/// matrices `[E, out, in]` is cut in every expert) or of a vector.
fn rows(a: &Array, start: i32, end: i32) -> Result<Array> {
    if a.ndim() < 2 {
        return owned(&a.index(start..end));
    }
    owned(&a.index((Ellipsis, start..end, ..)))
}

/// Columns `[start, end)` (the last axis).
fn cols(a: &Array, start: i32, end: i32) -> Result<Array> {
    owned(&a.index((Ellipsis, start..end)))
}

fn quantized_rows(q: &Quantized, start: i32, end: i32) -> Result<Quantized> {
    q.with_parts(rows(&q.weight, start, end)?, rows(&q.scales, start, end)?, rows(&q.biases, start, end)?)
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
            let q = q.with_parts(
                cols(&q.weight, start / per_word, end / per_word)?,
                cols(&q.scales, start / q.group_size, end / q.group_size)?,
                cols(&q.biases, start / q.group_size, end / q.group_size)?,
            )?;
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
