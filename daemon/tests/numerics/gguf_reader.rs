//! The daemon's GGUF reader against llama.cpp's block formats and MLX's loader.

use crate::common::*;
use mlx_rs::Array;
use mlxbc_daemon::model::gguf::Gguf;
use std::collections::HashMap;

/// Every tensor of a file, converted, under `module.suffix` names.
fn converted(file: &Gguf) -> HashMap<String, Array> {
    file.tensors()
        .flat_map(|t| {
            let (module, parts) = t.unwrap();
            parts.into_iter().map(move |(suffix, a)| (format!("{module}.{suffix}"), a))
        })
        .collect()
}

/// Real Q4_K, Q5_0, Q6_K and Q8_0 rows (from Qwen2.5-Coder-0.5B and Gemma 3
/// 270M, scripts/goldens/gguf_blocks.py): converted by the reader and
/// expanded by MLX, they are the values llama.cpp's gguf-py dequantizes.
#[test]
fn block_formats_give_llama_cpp_values() {
    let file = Gguf::open(&reference_path("gguf-blocks.gguf")).unwrap();
    let t = converted(&file);
    for kind in ["Q4_K", "Q5_0", "Q6_K", "Q8_0"] {
        let want = &t[&format!("ref.{kind}.weight")];
        let got = match t.get(&format!("q.{kind}.scales")) {
            Some(scales) => {
                let w = &t[&format!("q.{kind}.weight")];
                let bits = w.shape()[1] * 32 / want.shape()[1];
                let f32 = |a: &Array| a.as_dtype(mlx_rs::Dtype::Float32).unwrap();
                let biases = f32(&t[&format!("q.{kind}.biases")]);
                mlx_rs::ops::dequantize(w, f32(scales), &biases, 32, bits).unwrap()
            }
            None => t[&format!("q.{kind}.weight")].clone(),
        };
        assert_eq!(got.shape(), want.shape(), "{kind}");
        let (g, w) = (got.as_slice::<f32>(), want.as_slice::<f32>());
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= scale * 1e-6, "{kind}: max abs error {worst} (values up to {scale})");
    }
    // K-quants and Q5_0 stay packed (exact affine groups of 32); Q6_K's
    // 16-value groups have no MLX packing and come back dense.
    assert!(t.contains_key("q.Q4_K.scales") && t.contains_key("q.Q5_0.scales") && t.contains_key("q.Q8_0.scales"));
    assert!(!t.contains_key("q.Q6_K.scales"));
}

/// On the formats MLX's own loader reads (SmolLM2: Q4_1, Q8_0, F32), the
/// reader returns exactly its arrays, so nothing changed for those files.
#[test]
fn same_arrays_as_mlx_loader_on_formats_it_reads() {
    let path = fixture("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let ours = converted(&Gguf::open(&path).unwrap());
    let mlx = mlx_rs::io::GgufFile::load(&path).unwrap();
    let theirs: HashMap<String, Array> = mlx.arrays().unwrap();
    assert_eq!(ours.len(), theirs.len(), "tensor count");
    for (name, want) in &theirs {
        let got = ours.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(got.dtype(), want.dtype(), "{name}");
        assert_eq!(got.shape(), want.shape(), "{name}");
        assert!(got.eq_values(want).unwrap(), "{name} differs");
    }
}

/// Metadata reads: the architecture, numbers and the tokenizer's arrays.
#[test]
fn metadata() {
    let file = Gguf::open(&fixture("models/SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    assert_eq!(file.string("general.architecture"), Some("llama"));
    assert_eq!(file.number("llama.block_count"), Some(30.0));
    assert_eq!(file.strings("tokenizer.ggml.tokens").unwrap().len(), 49152);
    assert_eq!(file.ints("tokenizer.ggml.token_type").unwrap().len(), 49152);
    assert!(file.has_tensor("token_embd.weight") && !file.has_tensor("output.weight"));
    assert_eq!(file.rows("token_embd.weight"), Some(49152));
}

/// Not GGUF, truncated, or an unsupported block type: a clear error.
#[test]
fn bad_files_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"not a gguf at all").unwrap();
    assert!(format!("{:#}", Gguf::open(&junk).err().unwrap()).contains("is not a GGUF file"));
    let good = std::fs::read(fixture("models/SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &good[..4096]).unwrap();
    let err = match Gguf::open(&cut) {
        Err(e) => format!("{e:#}"),
        Ok(f) => format!("{:#}", f.tensors().find_map(Result::err).expect("a truncated file fails")),
    };
    assert!(err.contains("truncated") || err.contains("past the end"), "{err}");
}

/// Hostile GGUF headers: structure-aware mutations (huge declared counts,
/// lengths and shapes, flips, cuts) of a real file's header. Opening and
/// converting never panics or aborts; it succeeds or names the problem.
#[test]
fn fuzzed_gguf_headers_are_refused_not_crashed_on() {
    use mlxbc_shared::fuzz::{mutate, Rng};
    let real = std::fs::read(reference_path("gguf-blocks.gguf")).unwrap();
    let header = 2048.min(real.len());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hostile.gguf");
    let mut rng = Rng::new(0x6767);
    let (mut opened, mut refused) = (0, 0);
    for _ in 0..1_000 {
        let mut head = real[..header].to_vec();
        mutate(&mut rng, &mut head, &real[..header]);
        head.extend_from_slice(&real[header..]);
        std::fs::write(&path, &head).unwrap();
        let result = std::panic::catch_unwind(|| match Gguf::open(&path) {
            Ok(file) => file.tensors().try_for_each(|t| t.map(|_| ())),
            Err(e) => Err(e),
        });
        match result.expect("the reader panicked on a mutated header") {
            Ok(()) => opened += 1,
            Err(_) => refused += 1,
        }
    }
    assert!(refused > 100, "{opened} opened, {refused} refused");
}

/// Safetensors headers are checked before MLX reads them.
#[test]
fn hostile_safetensors_headers_are_refused() {
    use mlxbc_daemon::model::weights::check_safetensors;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    let file = |header: &[u8], declared: u64, data: usize| {
        let mut b = declared.to_le_bytes().to_vec();
        b.extend_from_slice(header);
        b.extend(std::iter::repeat_n(0u8, data));
        std::fs::write(&path, b).unwrap();
    };
    let ok = br#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;
    file(ok, ok.len() as u64, 16);
    check_safetensors(&path).unwrap();
    file(ok, 1 << 62, 16);
    assert!(check_safetensors(&path).is_err(), "a 2^62-byte header");
    let past = br#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,1600000]}}"#;
    file(past, past.len() as u64, 16);
    assert!(check_safetensors(&path).is_err(), "data past the end");
    let shape = br#"{"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}}"#;
    file(shape, shape.len() as u64, 16);
    assert!(check_safetensors(&path).is_err(), "a shape that overflows");
    // A real tower file passes.
    check_safetensors(&reference_path("gemma3-tower.safetensors")).unwrap();
}
