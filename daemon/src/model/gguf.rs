//! GGUF files: metadata and tensors, read here rather than by MLX's loader.
//!
//! MLX's `load_gguf` maps Q4_0, Q4_1 and Q8_0 blocks to its affine
//! quantization and fails on anything else, and the files people have (every
//! `Q4_K_M` on the hub, most ollama models) mix Q4_K, Q5_0 and Q6_K. Those
//! block formats are affine too (`value = scale * q + bias` per group of 32)
//! except Q6_K (16-element groups, below MLX's smallest group): so each
//! tensor becomes MLX's packed `weight` / `scales` / `biases` with the same
//! values llama.cpp computes, or a dense tensor where no exact packing exists.
//! Block layouts follow ggml's `dequantize_row_*` (ggml-quants.c).

use anyhow::{bail, ensure, Context, Result};
use half::f16;
use mlx_rs::Array;
use std::collections::HashMap;
use std::path::Path;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

/// One tensor as stored: ggml type, dimensions (innermost first, as GGUF
/// lists them) and where its bytes start relative to the data section.
#[derive(Debug, Clone)]
struct TensorInfo {
    name: String,
    dims: Vec<u64>,
    kind: u32,
    offset: u64,
}

/// An opened GGUF file (memory-mapped).
pub struct Gguf {
    path: std::path::PathBuf,
    map: memmap2::Mmap,
    metadata: HashMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    data_start: usize,
}

/// A tensor converted for MLX: `(suffix, array)` pairs under the tensor's
/// module name (`weight` alone, or `weight`, `scales`, `biases`; `bias` for
/// a bias vector).
pub type Converted = Vec<(String, Array)>;

struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).context("GGUF file is truncated")?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u64()? as usize;
        ensure!(n < 1 << 30, "GGUF string of {n} bytes");
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn value(&mut self, kind: u32) -> Result<MetaValue> {
        Ok(match kind {
            0 => MetaValue::Int(self.take(1)?[0] as i64),
            1 => MetaValue::Int(self.take(1)?[0] as i8 as i64),
            2 => MetaValue::Int(u16::from_le_bytes(self.take(2)?.try_into().unwrap()) as i64),
            3 => MetaValue::Int(i16::from_le_bytes(self.take(2)?.try_into().unwrap()) as i64),
            4 => MetaValue::Int(self.u32()? as i64),
            5 => MetaValue::Int(self.u32()? as i32 as i64),
            6 => MetaValue::Float(f32::from_le_bytes(self.take(4)?.try_into().unwrap()) as f64),
            7 => MetaValue::Bool(self.take(1)?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                let (inner, n) = (self.u32()?, self.u64()?);
                // Every item takes at least one byte: a count beyond the bytes left is a lie.
                ensure!(
                    n <= (self.bytes.len() - self.at) as u64,
                    "GGUF array of {n} items runs past the end of the file"
                );
                let mut items = Vec::new();
                for _ in 0..n {
                    items.push(self.value(inner)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::Int(self.u64()? as i64),
            11 => MetaValue::Int(self.u64()? as i64),
            12 => MetaValue::Float(f64::from_le_bytes(self.take(8)?.try_into().unwrap())),
            k => bail!("unknown GGUF metadata type {k}"),
        })
    }
}

impl Gguf {
    /// Opens and parses the header, metadata and tensor directory.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: the file is only read; a model file changed underneath a
        // running daemon is outside what we can defend against here.
        let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
        let mut c = Cursor { bytes: &map, at: 0 };
        ensure!(c.take(4)? == b"GGUF", "{} is not a GGUF file", path.display());
        let version = c.u32()?;
        ensure!((2..=3).contains(&version), "GGUF version {version} is not supported (2 or 3)");
        let (n_tensors, n_meta) = (c.u64()?, c.u64()?);
        let mut metadata = HashMap::new();
        for _ in 0..n_meta {
            let key = c.string()?;
            let kind = c.u32()?;
            metadata.insert(key, c.value(kind)?);
        }
        // Declared counts are bounded by the bytes that could hold them
        // before anything is reserved: a hostile header can claim 2^62.
        ensure!(
            n_tensors <= (map.len() / 24) as u64,
            "GGUF header declares {n_tensors} tensors; the file cannot hold them"
        );
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()?;
            ensure!(n_dims <= 4, "tensor {name} has {n_dims} dimensions");
            let dims = (0..n_dims).map(|_| c.u64()).collect::<Result<Vec<_>>>()?;
            let kind = c.u32()?;
            let offset = c.u64()?;
            tensors.push(TensorInfo { name, dims, kind, offset });
        }
        let align = match metadata.get("general.alignment") {
            Some(MetaValue::Int(a)) if *a > 0 => *a as usize,
            _ => 32,
        };
        let data_start = c.at.div_ceil(align) * align;
        Ok(Self { path: path.to_path_buf(), map, metadata, tensors, data_start })
    }

    /// The file it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A string metadata value.
    pub fn string(&self, key: &str) -> Option<&str> {
        match self.metadata.get(key)? {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A numeric metadata value.
    pub fn number(&self, key: &str) -> Option<f64> {
        match self.metadata.get(key)? {
            MetaValue::Int(i) => Some(*i as f64),
            MetaValue::Float(f) => Some(*f),
            MetaValue::Bool(b) => Some(*b as u8 as f64),
            _ => None,
        }
    }

    /// A string array metadata value.
    pub fn strings(&self, key: &str) -> Option<Vec<String>> {
        match self.metadata.get(key)? {
            MetaValue::Array(items) => {
                items.iter().map(|v| if let MetaValue::Str(s) = v { Some(s.clone()) } else { None }).collect()
            }
            _ => None,
        }
    }

    /// An integer array metadata value.
    pub fn ints(&self, key: &str) -> Option<Vec<i64>> {
        match self.metadata.get(key)? {
            MetaValue::Array(items) => {
                items.iter().map(|v| if let MetaValue::Int(i) = v { Some(*i) } else { None }).collect()
            }
            _ => None,
        }
    }

    /// A numeric array metadata value (integers read as floats too).
    pub fn floats(&self, key: &str) -> Option<Vec<f64>> {
        match self.metadata.get(key)? {
            MetaValue::Array(items) => items
                .iter()
                .map(|v| match v {
                    MetaValue::Float(f) => Some(*f),
                    MetaValue::Int(i) => Some(*i as f64),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }

    /// Whether a tensor of that name exists.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.iter().any(|t| t.name == name)
    }

    /// Rows (outermost dimension) of a tensor.
    pub fn rows(&self, name: &str) -> Option<u64> {
        self.tensors.iter().find(|t| t.name == name).and_then(|t| t.dims.last().copied())
    }

    /// Every tensor, converted, under its module name (`blk.0.attn_q`).
    pub fn tensors(&self) -> impl Iterator<Item = Result<(String, Converted)>> + '_ {
        self.tensors.iter().map(move |t| {
            let (module, suffix) =
                t.name.rsplit_once('.').with_context(|| format!("odd GGUF tensor name {}", t.name))?;
            let converted = self.convert(t).with_context(|| format!("GGUF tensor {}", t.name))?;
            let converted = match (suffix, converted.len()) {
                ("weight", _) => converted.into_iter().map(|(k, a)| (k.to_string(), a)).collect(),
                (other, 1) => converted.into_iter().map(|(_, a)| (other.to_string(), a)).collect(),
                (other, _) => bail!("GGUF tensor {} ({other}) is quantized; only weights may be", t.name),
            };
            Ok((module.to_string(), converted))
        })
    }

    fn convert(&self, t: &TensorInfo) -> Result<Vec<(&'static str, Array)>> {
        // Shapes come from the file: checked before any arithmetic or
        // allocation depends on them (MLX shapes are i32 per axis).
        ensure!(
            !t.dims.is_empty() && t.dims.iter().all(|&d| d > 0 && d <= i32::MAX as u64),
            "tensor shape {:?} is not valid",
            t.dims
        );
        let count =
            t.dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).filter(|&c| c <= self.map.len() as u64 * 8);
        let count = count.with_context(|| format!("tensor shape {:?} is larger than the file", t.dims))?;
        let cols = t.dims[0] as usize;
        // MLX shape: outermost first.
        let shape: Vec<i32> = t.dims.iter().rev().map(|&d| d as i32).collect();
        let format = BlockFormat::of(t.kind)?;
        ensure!(cols.is_multiple_of(format.block), "row of {cols} values is not whole blocks of {}", format.block);
        let bytes = (count as usize / format.block) * format.bytes;
        let data = (self.data_start as u64)
            .checked_add(t.offset)
            .and_then(|start| Some((start as usize, (start as usize).checked_add(bytes)?)))
            .and_then(|(start, end)| self.map.get(start..end))
            .context("tensor data runs past the end of the file")?;
        let rows = count as usize / cols;
        Ok(match format.kind {
            Kind::F32 => {
                let v: Vec<f32> = data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
                vec![("weight", Array::from_slice(&v, &shape))]
            }
            Kind::F16 => {
                let v: Vec<f16> = data.chunks_exact(2).map(|b| f16::from_le_bytes(b.try_into().unwrap())).collect();
                vec![("weight", Array::from_slice(&v, &shape))]
            }
            Kind::Bf16 => {
                let v: Vec<half::bf16> =
                    data.chunks_exact(2).map(|b| half::bf16::from_le_bytes(b.try_into().unwrap())).collect();
                vec![("weight", Array::from_slice(&v, &shape))]
            }
            Kind::Affine { bits, exact_f16 } => {
                let mut q = vec![0u8; count as usize];
                let groups = count as usize / 32;
                let (mut scales, mut biases) = (vec![0f32; groups], vec![0f32; groups]);
                for (b, block) in data.chunks_exact(format.bytes).enumerate() {
                    let per = format.block / 32;
                    let at = b * format.block;
                    affine_block(
                        t.kind,
                        block,
                        &mut q[at..at + format.block],
                        &mut scales[b * per..(b + 1) * per],
                        &mut biases[b * per..(b + 1) * per],
                    );
                }
                let packed = pack_rows(&q, rows, cols, bits);
                let mut gshape = shape.clone();
                *gshape.last_mut().unwrap() = (cols / 32) as i32;
                let mut wshape = shape.clone();
                *wshape.last_mut().unwrap() = (cols * bits as usize / 32) as i32;
                let (s, bi) = if exact_f16 {
                    // These formats' scales and biases are f16 numbers (or
                    // exact multiples by powers of two): keep them f16, as
                    // MLX's own loader does.
                    let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
                    (Array::from_slice(&h(&scales), &gshape), Array::from_slice(&h(&biases), &gshape))
                } else {
                    (Array::from_slice(&scales, &gshape), Array::from_slice(&biases, &gshape))
                };
                vec![("weight", Array::from_slice(&packed, &wshape)), ("scales", s), ("biases", bi)]
            }
            Kind::DenseQ6K => {
                let mut v = vec![0f32; count as usize];
                for (b, block) in data.chunks_exact(format.bytes).enumerate() {
                    dequantize_q6_k(block, &mut v[b * 256..(b + 1) * 256]);
                }
                vec![("weight", Array::from_slice(&v, &shape))]
            }
        })
    }
}

#[derive(Clone, Copy)]
enum Kind {
    F32,
    F16,
    Bf16,
    /// Becomes MLX affine quantization with groups of 32 and `bits` bits.
    Affine {
        bits: i32,
        exact_f16: bool,
    },
    /// Q6_K: 16-value groups, dequantized to f32.
    DenseQ6K,
}

struct BlockFormat {
    kind: Kind,
    /// Values per block.
    block: usize,
    /// Bytes per block.
    bytes: usize,
}

// ggml type ids.
const F32: u32 = 0;
const F16: u32 = 1;
const Q4_0: u32 = 2;
const Q4_1: u32 = 3;
const Q5_0: u32 = 6;
const Q5_1: u32 = 7;
const Q8_0: u32 = 8;
const Q4_K: u32 = 12;
const Q5_K: u32 = 13;
const Q6_K: u32 = 14;
const BF16: u32 = 30;

impl BlockFormat {
    fn of(kind: u32) -> Result<Self> {
        let affine = |bits, exact_f16, block, bytes| Self { kind: Kind::Affine { bits, exact_f16 }, block, bytes };
        Ok(match kind {
            F32 => Self { kind: Kind::F32, block: 1, bytes: 4 },
            F16 => Self { kind: Kind::F16, block: 1, bytes: 2 },
            BF16 => Self { kind: Kind::Bf16, block: 1, bytes: 2 },
            Q4_0 => affine(4, true, 32, 18),
            Q4_1 => affine(4, true, 32, 20),
            Q5_0 => affine(5, true, 32, 22),
            Q5_1 => affine(5, true, 32, 24),
            Q8_0 => affine(8, true, 32, 34),
            Q4_K => affine(4, false, 256, 144),
            Q5_K => affine(5, false, 256, 176),
            Q6_K => Self { kind: Kind::DenseQ6K, block: 256, bytes: 210 },
            other => bail!(
                "GGUF tensor type {} is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, \
                 Q4_K, Q5_K, Q6_K); convert the model with a Q4_K_M or Q8_0 preset",
                type_name(other)
            ),
        })
    }
}

fn type_name(kind: u32) -> String {
    const NAMES: [&str; 31] = [
        "F32", "F16", "Q4_0", "Q4_1", "4", "5", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
        "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32",
        "I64", "F64", "IQ1_M", "BF16",
    ];
    NAMES.get(kind as usize).map_or(format!("#{kind}"), |n| n.to_string())
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K/Q5_K's 6-bit scale and min of sub-block `j` (ggml's get_scale_min_k4).
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Unsigned values, and scale and bias per 32 values, of one block:
/// `value = scale * q + bias` reproduces ggml's dequantization.
fn affine_block(kind: u32, b: &[u8], q: &mut [u8], scales: &mut [f32], biases: &mut [f32]) {
    match kind {
        Q4_0 | Q4_1 => {
            let d = half_at(b, 0);
            let (bias, qs) = if kind == Q4_0 { (-8.0 * d, &b[2..18]) } else { (half_at(b, 2), &b[4..20]) };
            for j in 0..16 {
                q[j] = qs[j] & 0xF;
                q[j + 16] = qs[j] >> 4;
            }
            (scales[0], biases[0]) = (d, bias);
        }
        Q5_0 | Q5_1 => {
            let d = half_at(b, 0);
            let (bias, rest) = if kind == Q5_0 { (-16.0 * d, &b[2..]) } else { (half_at(b, 2), &b[4..]) };
            let qh = u32::from_le_bytes(rest[0..4].try_into().unwrap());
            let qs = &rest[4..20];
            for j in 0..16 {
                q[j] = (qs[j] & 0xF) | ((((qh >> j) << 4) & 0x10) as u8);
                q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 12)) & 0x10) as u8);
            }
            (scales[0], biases[0]) = (d, bias);
        }
        Q8_0 => {
            let d = half_at(b, 0);
            for j in 0..32 {
                q[j] = (b[2 + j] as i8 as i16 + 128) as u8;
            }
            (scales[0], biases[0]) = (d, -128.0 * d);
        }
        Q4_K | Q5_K => {
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let s = &b[4..16];
            let (qh, ql) = if kind == Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for chunk in 0..4 {
                for half in 0..2 {
                    let g = chunk * 2 + half;
                    let (sc, m) = scale_min_k4(g, s);
                    scales[g] = d * sc as f32;
                    biases[g] = -(dmin * m as f32);
                    for l in 0..32 {
                        let byte = ql[chunk * 32 + l];
                        let low = if half == 0 { byte & 0xF } else { byte >> 4 };
                        let high = qh.map_or(0, |h| ((h[l] >> g) & 1) << 4);
                        q[g * 32 + l] = low | high;
                    }
                }
            }
        }
        _ => unreachable!("not an affine block type"),
    }
}

/// ggml's dequantize_row_q6_K for one 256-value block.
fn dequantize_q6_k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 208);
    for n in 0..2 {
        let (ql, qh, sc) = (&b[n * 64..], &b[128 + n * 32..], &b[192 + n * 8..]);
        let y = &mut y[n * 128..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8 as f32) * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8 as f32) * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8 as f32) * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8 as f32) * q4 as f32;
        }
    }
}

/// Packs `bits`-bit values row by row into MLX's layout: a little-endian bit
/// stream per row, value i at bits `[i*bits, (i+1)*bits)`, read as u32 words.
pub fn pack_rows(q: &[u8], rows: usize, cols: usize, bits: i32) -> Vec<u32> {
    let bits = bits as usize;
    let words_per_row = cols * bits / 32;
    let mut out = vec![0u32; rows * words_per_row];
    for r in 0..rows {
        let row = &mut out[r * words_per_row..(r + 1) * words_per_row];
        for (i, &v) in q[r * cols..(r + 1) * cols].iter().enumerate() {
            let bit = i * bits;
            let (w, s) = (bit / 32, bit % 32);
            row[w] |= (v as u32) << s;
            if s + bits > 32 {
                row[w + 1] |= (v as u32) >> (32 - s);
            }
        }
    }
    out
}

/// A GGUF file's `general.architecture`, read from its header alone (the
/// key comes first in the files llama.cpp's tools write; at most the first
/// 64 keys are looked at, and only the bytes they take are read).
pub fn architecture(path: &Path) -> Result<String> {
    use std::io::Read;
    // Enough for the header and its first keys; a tokenizer's arrays come later.
    let mut head = Vec::new();
    std::fs::File::open(path)?.take(64 << 10).read_to_end(&mut head)?;
    let mut c = Cursor { bytes: &head, at: 0 };
    ensure!(c.take(4)? == b"GGUF", "{} is not a GGUF file", path.display());
    let version = c.u32()?;
    ensure!((2..=3).contains(&version), "GGUF version {version} is not supported (2 or 3)");
    let (_, n_meta) = (c.u64()?, c.u64()?);
    for _ in 0..n_meta.min(64) {
        let key = c.string()?;
        let kind = c.u32()?;
        let value = c.value(kind)?;
        if key == "general.architecture" {
            if let MetaValue::Str(s) = value {
                return Ok(s);
            }
        }
    }
    bail!("{}: no general.architecture among its first keys", path.display())
}

/// A string metadata value.
pub fn gguf_string(file: &Gguf, key: &str) -> Result<String> {
    file.string(key).map(str::to_string).with_context(|| format!("GGUF metadata {key} is missing"))
}

/// A scalar numeric metadata value, as f64.
pub fn gguf_number(file: &Gguf, key: &str) -> Result<f64> {
    file.number(key).with_context(|| format!("GGUF metadata {key} is missing or not a number"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MLX's dequantize reads our packing back as the values packed, for
    /// every bit width the GGUF formats map to.
    #[test]
    fn packing_is_mlx_layout() {
        let (rows, cols) = (3usize, 64usize);
        for bits in [4, 5, 8] {
            let q: Vec<u8> = (0..rows * cols).map(|i| ((i * 7 + i / 5) % (1 << bits)) as u8).collect();
            let packed = pack_rows(&q, rows, cols, bits);
            let w = Array::from_slice(&packed, &[rows as i32, (cols * bits as usize / 32) as i32]);
            let ones = Array::from_slice(&vec![1f32; rows * cols / 32], &[rows as i32, (cols / 32) as i32]);
            let zeros = Array::from_slice(&vec![0f32; rows * cols / 32], &[rows as i32, (cols / 32) as i32]);
            let back = mlx_rs::ops::dequantize(&w, &ones, &zeros, 32, bits).unwrap();
            let want: Vec<f32> = q.iter().map(|&v| v as f32).collect();
            assert_eq!(back.as_slice::<f32>(), &want[..], "{bits}-bit");
        }
    }
}
