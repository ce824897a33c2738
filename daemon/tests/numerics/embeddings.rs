//! all-MiniLM-L6-v2 (real weights, from PyPI) against mlx-embeddings' BERT
//! on the same directory (scripts/fixtures/embed_reference.py): every text
//! of a varied corpus (prose, code, CJK, German, emoji, empty and blank
//! strings, a text past the model's 256 tokens) embedded in one padded
//! batch here and alone there, cosine ≥ 0.9999 each, the same token
//! counts, and the same nearest neighbour for every text; and against
//! sentence-transformers' own answers on the same weights, recorded in
//! tests/fixtures/embed/sentence_transformers.json. Fixtures from
//! scripts/test-fixtures.

use crate::common::fixture;
use mlxbc_daemon::families::{self, LoadedModel};
use mlxbc_daemon::model::family::Embedder;
use mlxbc_daemon::model::weights::WeightForm;

fn minilm() -> Box<dyn Embedder> {
    match families::load_any(&fixture("models/all-MiniLM-L6-v2"), WeightForm::DenseF32, None).unwrap() {
        LoadedModel::Embed(e) => e,
        _ => panic!("all-MiniLM-L6-v2 did not load as an embedder"),
    }
}

/// sentence-transformers' own answers on the same fixtures, recorded by
/// scripts/fixtures/sentence_transformers_reference.py (torch is too big
/// for every CI run): `section`'s entry, after checking it was recorded on
/// the weights of `model_dir`.
fn sentence_transformers(section: &str, model_dir: &str) -> serde_json::Value {
    use sha2::Digest;
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/embed/sentence_transformers.json");
    let all: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let entry = all[section].clone();
    let weights = std::fs::read(fixture(model_dir).join("model.safetensors")).unwrap();
    let sha = format!("{:x}", sha2::Sha256::digest(&weights));
    assert_eq!(
        entry["weights_sha256"].as_str(),
        Some(sha.as_str()),
        "{} was recorded on other weights than {model_dir}'s: record it again (`scripts/bench embed` makes the \
         sentence-transformers venv; then scripts/fixtures/sentence_transformers_reference.py)",
        path.display()
    );
    entry
}

fn vectors(v: &serde_json::Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let n = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

/// The index of the text nearest to `i` (other than itself).
fn nearest(vectors: &[Vec<f32>], i: usize) -> usize {
    (0..vectors.len())
        .filter(|&j| j != i)
        .max_by(|&a, &b| cosine(&vectors[i], &vectors[a]).total_cmp(&cosine(&vectors[i], &vectors[b])))
        .unwrap()
}

#[test]
fn minilm_matches_mlx_embeddings_batched_against_alone() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("embed/reference.json")).unwrap()).unwrap();
    let reference = reference.as_array().unwrap();
    let e = minilm();
    assert_eq!((e.dimensions(), e.max_tokens()), (384, 256));
    let ids: Vec<Vec<u32>> =
        reference.iter().map(|r| e.truncate(&e.tokenize(r["text"].as_str().unwrap()).unwrap())).collect();
    let got = e.embed(&ids).unwrap();
    let want: Vec<Vec<f32>> = reference
        .iter()
        .map(|r| r["vector"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect();
    for (i, r) in reference.iter().enumerate() {
        assert_eq!(ids[i].len() as u64, r["tokens"].as_u64().unwrap(), "text {i}: token count");
        let c = cosine(&got[i], &want[i]);
        assert!(c >= 0.9999, "text {i} ({:?}): cosine {c} to mlx-embeddings", r["text"]);
        let norm: f32 = got[i].iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "text {i}: normalized, not {norm}");
        assert_eq!(nearest(&got, i), nearest(&want, i), "text {i}: a different nearest neighbour");
    }
    // sentence-transformers itself (SentenceTransformer.encode, recorded).
    let st = vectors(&sentence_transformers("minilm", "models/all-MiniLM-L6-v2")["vectors"]);
    assert_eq!(st.len(), got.len());
    for (i, v) in st.iter().enumerate() {
        let c = cosine(&got[i], v);
        assert!(c >= 0.9999, "text {i}: cosine {c} to sentence-transformers");
    }
    // "A man is eating food." against "A man is eating a piece of bread.":
    // 0.7553 in sentence-transformers' documentation for this model.
    assert!((cosine(&got[0], &got[1]) - 0.7553).abs() < 1e-3, "{}", cosine(&got[0], &got[1]));
}

/// all-MiniLM-L6-v2 as BERT GGUF files (f16, as ollama's `all-minilm`
/// ships, and Q8_0), written from the same directory as llama.cpp's
/// converter writes them (scripts/fixtures/bert_to_gguf.py, llama.cpp's
/// gguf-py): the WordPiece vocabulary rebuilt from the file's phantom-space
/// pieces tokenizes every text of the corpus exactly as the directory's
/// `tokenizer.json`; pooled and normalized as the file says, the vectors
/// (cut at the directory's 256 tokens: the file allows its 512 positions)
/// are within the files' rounding of mlx-embeddings' on the directory
/// (cosine ≥ 0.9999 for f16, ≥ 0.999 for Q8_0) with the same nearest neighbours.
#[test]
fn a_bert_gguf_tokenizes_and_embeds_as_its_directory_does() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("embed/reference.json")).unwrap()).unwrap();
    let reference = reference.as_array().unwrap();
    let dir = minilm();
    let want = vectors(&serde_json::Value::Array(reference.iter().map(|r| r["vector"].clone()).collect()));
    for (kind, floor) in [("f16", 0.9999), ("q8_0", 0.999)] {
        let path = fixture(&format!("embed-gguf/all-MiniLM-L6-v2.{kind}.gguf"));
        let e = match families::load_any(&path, WeightForm::DenseF32, None).unwrap() {
            LoadedModel::Embed(e) => e,
            _ => panic!("{} did not load as an embedder", path.display()),
        };
        assert_eq!((e.dimensions(), e.max_tokens(), e.architecture()), (384, 512, "bert"));
        let mut ids = Vec::new();
        for (i, r) in reference.iter().enumerate() {
            let text = r["text"].as_str().unwrap();
            let (mine, theirs) = (e.tokenize(text).unwrap(), dir.tokenize(text).unwrap());
            assert_eq!(mine, theirs, "{kind}, text {i} ({text:?}): token ids");
            ids.push(dir.truncate(&mine));
        }
        let got = e.embed(&ids).unwrap();
        let mut worst = 1.0f64;
        for i in 0..reference.len() {
            worst = worst.min(cosine(&got[i], &want[i]));
            assert_eq!(nearest(&got, i), nearest(&want, i), "{kind}, text {i}: a different nearest neighbour");
        }
        assert!(worst >= floor, "{kind}: smallest cosine {worst} to mlx-embeddings on the directory");
        eprintln!("{kind}: smallest cosine to mlx-embeddings on the directory {worst:.6}");
    }
    // A file that says not to lower-case (as llama.cpp reads
    // `tokenizer.ggml.normalizer.lowercase`) keeps capitals: this uncased
    // vocabulary has no "A", lower-case text is unchanged.
    let cased = match families::load_any(&fixture("embed-gguf/all-MiniLM-L6-v2.cased.gguf"), WeightForm::DenseF32, None)
    {
        Ok(LoadedModel::Embed(e)) => e,
        _ => panic!("the cased GGUF did not load as an embedder"),
    };
    assert_ne!(cased.tokenize("A man").unwrap(), dir.tokenize("A man").unwrap());
    assert_eq!(cased.tokenize("a man").unwrap(), dir.tokenize("a man").unwrap());
    // A WordPiece vocabulary named `t5` (XLM-RoBERTa's SentencePiece) has
    // no scores: refused with a sentence, not read as either.
    let path = fixture("embed-gguf/all-MiniLM-L6-v2.t5-named.gguf");
    let e = families::load_any(&path, WeightForm::DenseF32, None).err().expect("refused");
    assert!(format!("{e:#}").contains("tokenizer.ggml.scores"), "{e:#}");
}

/// An XLM-RoBERTa embedder as llama.cpp's converter writes bge-m3 and
/// multilingual-e5 (architecture `bert`, a SentencePiece Unigram vocabulary
/// llama.cpp calls `t5`, positions cut after the padding id; tiny random
/// weights and a SentencePiece model trained for the fixture: none ships on
/// PyPI) against llama.cpp itself on the file
/// (scripts/fixtures/xlmr_gguf_reference.py): token ids equal to
/// `llama-tokenize`'s (and to the directory's `tokenizer.json`'s) on every
/// corpus text, CJK, emoji, code and a 1,000-piece text included; vectors
/// (CLS-pooled, normalized) within cosine 0.9999 of `llama-embedding`'s,
/// the corpus in one padded batch; the sentence-transformers directory of
/// the same weights gives the same vectors.
#[test]
fn an_xlm_roberta_gguf_tokenizes_and_embeds_as_llama_cpp_does() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("xlmr-gguf/reference.json")).unwrap()).unwrap();
    let reference = reference.as_array().unwrap();
    let want = vectors(&serde_json::Value::Array(reference.iter().map(|r| r["vector"].clone()).collect()));
    let ids_of = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect()
    };
    for path in ["xlmr-gguf/tiny-xlmr.f32.gguf", "xlmr-gguf/tiny-xlmr"] {
        let e = match families::load_any(&fixture(path), WeightForm::DenseF32, None).unwrap() {
            LoadedModel::Embed(e) => e,
            _ => panic!("{path} did not load as an embedder"),
        };
        assert_eq!((e.dimensions(), e.max_tokens(), e.architecture()), (64, 2048, "bert"), "{path}");
        let ids: Vec<Vec<u32>> =
            reference.iter().map(|r| e.truncate(&e.tokenize(r["text"].as_str().unwrap()).unwrap())).collect();
        for (i, r) in reference.iter().enumerate() {
            // llama-tokenize refuses an empty text (None); tokenizer.json's ids then.
            let want_ids = if r["llama_ids"].is_null() { ids_of(&r["hf_ids"]) } else { ids_of(&r["llama_ids"]) };
            assert_eq!(ids[i], want_ids, "{path}, text {i} ({:?}): token ids", r["text"]);
        }
        let got = e.embed(&ids).unwrap();
        let mut worst = 1.0f64;
        for (i, r) in reference.iter().enumerate() {
            let c = cosine(&got[i], &want[i]);
            worst = worst.min(c);
            assert!(c >= 0.9999, "{path}, text {i} ({:?}): cosine {c} to llama.cpp", r["text"]);
            // The same nearest neighbour, or one llama.cpp ranks within 1e-4
            // of its own (random weights pool near-ties: text 18's two best
            // are 3e-5 apart there).
            let (ours, theirs) = (nearest(&got, i), nearest(&want, i));
            let gap = cosine(&want[i], &want[theirs]) - cosine(&want[i], &want[ours]);
            assert!(gap < 1e-4, "{path}, text {i}: nearest neighbour {ours}, llama.cpp's {theirs} ({gap} closer)");
        }
        eprintln!("{path}: smallest cosine to llama.cpp {worst:.7}");
    }
}

/// An XLM-RoBERTa embedder (multilingual-e5's and bge-m3's architecture;
/// tiny random weights as sentence-transformers lays such a model out,
/// MiniLM's real tokenizer) against mlx-embeddings' `xlm_roberta.py` on
/// the same weights (scripts/fixtures/xlmr_reference.py): its positions
/// start after the padding id. Every text of the corpus in one padded
/// batch here and alone there, cosine ≥ 0.9999, the same token counts (cut
/// at 64) and nearest neighbours; the positions taken as BERT takes them
/// (from 0) would not pass (the fixture's position rows are wide).
#[test]
fn an_xlm_roberta_embedder_matches_mlx_embeddings_batched_against_alone() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("xlmr/reference.json")).unwrap()).unwrap();
    let reference = reference.as_array().unwrap();
    let e = match families::load_any(&fixture("xlmr/tiny-xlm-roberta"), WeightForm::DenseF32, None).unwrap() {
        LoadedModel::Embed(e) => e,
        _ => panic!("the tiny XLM-RoBERTa did not load as an embedder"),
    };
    assert_eq!((e.dimensions(), e.max_tokens()), (64, 64));
    let ids: Vec<Vec<u32>> =
        reference.iter().map(|r| e.truncate(&e.tokenize(r["text"].as_str().unwrap()).unwrap())).collect();
    let got = e.embed(&ids).unwrap();
    let want = vectors(&serde_json::Value::Array(reference.iter().map(|r| r["vector"].clone()).collect()));
    for (i, r) in reference.iter().enumerate() {
        assert_eq!(ids[i].len() as u64, r["tokens"].as_u64().unwrap(), "text {i}: token count");
        let c = cosine(&got[i], &want[i]);
        assert!(c >= 0.9999, "text {i} ({:?}): cosine {c} to mlx-embeddings", r["text"]);
        assert_eq!(nearest(&got, i), nearest(&want, i), "text {i}: a different nearest neighbour");
    }
}

/// A ModernBERT embedder (modernbert-embed-base's and gte-modernbert's
/// architecture; tiny random weights laid out as sentence-transformers
/// ships them, MiniLM's real tokenizer) against mlx-embeddings'
/// `modernbert.py` on the same weights (scripts/fixtures/modernbert_reference.py):
/// four layers, the first and fourth attending to the whole text with the
/// global rope base, the others within ±4 positions with the local one.
/// Every text of the corpus in one padded batch here and alone there,
/// cosine ≥ 0.9999, the same token counts (cut at 64) and nearest neighbours.
#[test]
fn a_modernbert_embedder_matches_mlx_embeddings_batched_against_alone() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("modernbert/reference.json")).unwrap()).unwrap();
    let reference = reference.as_array().unwrap();
    let e = match families::load_any(&fixture("modernbert/tiny-modernbert"), WeightForm::DenseF32, None).unwrap() {
        LoadedModel::Embed(e) => e,
        _ => panic!("the tiny ModernBERT did not load as an embedder"),
    };
    assert_eq!((e.dimensions(), e.max_tokens(), e.architecture()), (64, 64, "modernbert"));
    let ids: Vec<Vec<u32>> =
        reference.iter().map(|r| e.truncate(&e.tokenize(r["text"].as_str().unwrap()).unwrap())).collect();
    let got = e.embed(&ids).unwrap();
    let want = vectors(&serde_json::Value::Array(reference.iter().map(|r| r["vector"].clone()).collect()));
    let mut worst = 1.0f64;
    for (i, r) in reference.iter().enumerate() {
        assert_eq!(ids[i].len() as u64, r["tokens"].as_u64().unwrap(), "text {i}: token count");
        let c = cosine(&got[i], &want[i]);
        worst = worst.min(c);
        assert!(c >= 0.9999, "text {i} ({:?}): cosine {c} to mlx-embeddings", r["text"]);
        assert_eq!(nearest(&got, i), nearest(&want, i), "text {i}: a different nearest neighbour");
    }
    eprintln!("smallest cosine to mlx-embeddings {worst:.7}");
}

/// A nomic-bert embedder (nomic-embed-text v1/v1.5's architecture: rotary
/// positions, fused q/k/v, SwiGLU, post-norm; tiny random weights laid out
/// as sentence-transformers ships it, MiniLM's real tokenizer) against
/// llama.cpp's own `llama-embedding` on the same weights written as a GGUF
/// (scripts/fixtures/nomic_reference.py; no Python nomic-bert runs here):
/// the directory, the F32 GGUF and the F16 GGUF each embed the corpus in
/// one padded batch (llama.cpp: the texts in one call), cosine ≥ 0.9999
/// (F16 weights: ≥ 0.999), the same token counts and nearest neighbours.
#[test]
fn a_nomic_bert_embedder_matches_llama_cpp_from_its_directory_and_its_gguf() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("nomic/reference.json")).unwrap()).unwrap();
    let reference = reference.as_array().unwrap();
    let want = vectors(&serde_json::Value::Array(reference.iter().map(|r| r["vector"].clone()).collect()));
    for (path, floor) in [
        ("nomic/tiny-nomic-bert", 0.9999),
        ("nomic/tiny-nomic-bert.f32.gguf", 0.9999),
        ("nomic/tiny-nomic-bert.f16.gguf", 0.999),
    ] {
        let e = match families::load_any(&fixture(path), WeightForm::DenseF32, None).unwrap() {
            LoadedModel::Embed(e) => e,
            _ => panic!("{path} did not load as an embedder"),
        };
        assert_eq!((e.dimensions(), e.max_tokens(), e.architecture()), (64, 2048, "nomic-bert"), "{path}");
        let ids: Vec<Vec<u32>> =
            reference.iter().map(|r| e.truncate(&e.tokenize(r["text"].as_str().unwrap()).unwrap())).collect();
        let got = e.embed(&ids).unwrap();
        let mut worst = 1.0f64;
        for (i, r) in reference.iter().enumerate() {
            assert_eq!(ids[i].len() as u64, r["tokens"].as_u64().unwrap(), "{path}, text {i}: token count");
            let c = cosine(&got[i], &want[i]);
            worst = worst.min(c);
            assert!(c >= floor, "{path}, text {i} ({:?}): cosine {c} to llama.cpp", r["text"]);
            assert_eq!(nearest(&got, i), nearest(&want, i), "{path}, text {i}: a different nearest neighbour");
        }
        eprintln!("{path}: smallest cosine to llama.cpp {worst:.7}");
    }
}

/// A cross-encoder (tiny random weights, MiniLM's real tokenizer; no real
/// reranker ships on PyPI) against mlx-embeddings' BERT with the pooler,
/// classifier and sigmoid after it on the same weights
/// (scripts/fixtures/rerank_reference.py): every (query, document) pair
/// scored in one padded batch here and alone there, within 1e-4, with the
/// same token counts (a pair truncated longest first), and the same order.
#[test]
fn a_cross_encoder_matches_the_reference_batched_against_alone() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("rerank/reference.json")).unwrap()).unwrap();
    let query = reference["query"].as_str().unwrap();
    let pairs = reference["pairs"].as_array().unwrap();
    let r = match families::load_any(&fixture("rerank/tiny-cross-encoder"), WeightForm::DenseF32, None).unwrap() {
        LoadedModel::Embed(e) => e,
        _ => panic!("the cross-encoder did not load as a reranker"),
    };
    assert!(r.reranks());
    assert_eq!((r.dimensions(), r.max_tokens()), (1, 96));
    let ids: Vec<Vec<u32>> =
        pairs.iter().map(|p| r.tokenize_pair(query, p["document"].as_str().unwrap(), None).unwrap()).collect();
    let got = r.embed(&ids).unwrap();
    let mut order_got: Vec<usize> = (0..pairs.len()).collect();
    let mut order_want = order_got.clone();
    for (i, p) in pairs.iter().enumerate() {
        assert_eq!(ids[i].len() as u64, p["tokens"].as_u64().unwrap(), "pair {i}: token count");
        let want = p["score"].as_f64().unwrap();
        let score = f64::from(got[i][0]);
        assert!((score - want).abs() < 1e-4, "pair {i} ({:?}): {score} against {want}", p["document"]);
    }
    // sentence-transformers' CrossEncoder.predict (recorded).
    let st = sentence_transformers("cross_encoder", "rerank/tiny-cross-encoder");
    for (i, s) in st["scores"].as_array().unwrap().iter().enumerate() {
        let (score, want) = (f64::from(got[i][0]), s.as_f64().unwrap());
        assert!((score - want).abs() < 1e-4, "pair {i}: {score} against CrossEncoder's {want}");
    }
    order_got.sort_by(|&a, &b| got[b][0].total_cmp(&got[a][0]));
    order_want.sort_by(|&a, &b| pairs[b]["score"].as_f64().unwrap().total_cmp(&pairs[a]["score"].as_f64().unwrap()));
    assert_eq!(order_got, order_want);
    // An embedding model does not read pairs.
    assert!(minilm().tokenize_pair("q", "d", None).is_err());
}

/// A decoder embedder laid out as sentence-transformers ships
/// Qwen3-Embedding (tiny random Qwen3 weights, a real Qwen tokenizer ending
/// each input with `<|endoftext|>`) against mlx-embeddings' `qwen3.py` on
/// the same weights (scripts/fixtures/decoder_embed_reference.py): the
/// corpus as documents and two queries after the directory's query
/// instruction, all in one left-padded batch here and each alone there,
/// cosine ≥ 0.9999, the same token counts (the long text cut to the first
/// 47 tokens and `<|endoftext|>`).
#[test]
fn a_qwen3_embedding_model_matches_mlx_embeddings_batched_against_alone() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("decoder-embed/reference.json")).unwrap()).unwrap();
    let reference = reference.as_array().unwrap();
    let e =
        match families::load_any(&fixture("decoder-embed/tiny-qwen3-embedding"), WeightForm::DenseF32, None).unwrap() {
            LoadedModel::Embed(e) => e,
            _ => panic!("the Qwen3 embedding directory did not load as an embedder"),
        };
    assert_eq!((e.dimensions(), e.max_tokens(), e.reranks()), (64, 48, false));
    let query = e.prompt(Some("query")).unwrap();
    assert!(query.starts_with("Instruct: "), "{query:?}");
    assert_eq!(e.prompt(Some("document")).unwrap(), "");
    assert!(e.prompt(Some("passage")).is_err(), "a prompt the directory does not name");
    let ids: Vec<Vec<u32>> = reference
        .iter()
        .map(|r| {
            let prefix = if r["prompt"] == "query" { query.as_str() } else { "" };
            e.truncate(&e.tokenize(&format!("{prefix}{}", r["text"].as_str().unwrap())).unwrap())
        })
        .collect();
    let got = e.embed(&ids).unwrap();
    for (i, r) in reference.iter().enumerate() {
        assert_eq!(ids[i].len() as u64, r["tokens"].as_u64().unwrap(), "text {i}: token count");
        assert_eq!(*ids[i].last().unwrap(), 151643, "text {i} ends with <|endoftext|>");
        let want: Vec<f32> = r["vector"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        let c = cosine(&got[i], &want);
        assert!(c >= 0.9999, "text {i} ({:?}): cosine {c} to mlx-embeddings", r["text"]);
    }
    // sentence-transformers (encode, and prompt_name="query"; recorded):
    // it strips each text, which a byte-level tokenizer would otherwise read.
    let st = vectors(&sentence_transformers("qwen3_embedding", "decoder-embed/tiny-qwen3-embedding")["vectors"]);
    assert_eq!(st.len(), got.len());
    for (i, v) in st.iter().enumerate() {
        let c = cosine(&got[i], v);
        assert!(c >= 0.9999, "text {i}: cosine {c} to sentence-transformers");
    }
}

/// A decoder reranker laid out as Qwen3-Reranker ships (tiny random Qwen3
/// weights in a directory named as a reranker, a real Qwen tokenizer)
/// against mlx-lm's `qwen3.py` in the model card's prompt on the same
/// weights (scripts/fixtures/lm_rerank_reference.py), each pair alone
/// there and all in one left-padded batch here, and against the model
/// card's own transformers code (recorded): scores within 1e-4, the same
/// token counts (a long document cut to the context, the prompt's end
/// kept), an instruction read where given, and the same order.
#[test]
fn a_qwen3_reranker_matches_mlx_lm_and_the_model_card_batched_against_alone() {
    let dir = fixture("lm-rerank/tiny-qwen3-reranker");
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert!(mlxbc_daemon::model::lm_reranker::is_reranker_dir(&dir, &raw));
    assert!(!mlxbc_daemon::model::lm_reranker::is_reranker_dir(&fixture("decoder-embed/tiny-qwen3-embedding"), &raw));
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("lm-rerank/reference.json")).unwrap()).unwrap();
    let cases = cases.as_array().unwrap();
    let r = match families::load_any(&dir, WeightForm::DenseF32, None).unwrap() {
        LoadedModel::Embed(e) => e,
        _ => panic!("the Qwen3-Reranker directory did not load as a reranker"),
    };
    assert!(r.reranks() && r.takes_instruction());
    assert_eq!((r.dimensions(), r.max_tokens()), (1, 256));
    let ids: Vec<Vec<u32>> = cases
        .iter()
        .map(|c| {
            let (q, d) = (c["query"].as_str().unwrap(), c["document"].as_str().unwrap());
            r.tokenize_pair(q, d, c["instruction"].as_str()).unwrap()
        })
        .collect();
    let got = r.embed(&ids).unwrap();
    let card = sentence_transformers("qwen3_reranker", "lm-rerank/tiny-qwen3-reranker");
    let card = card["scores"].as_array().unwrap();
    for (i, c) in cases.iter().enumerate() {
        assert_eq!(ids[i].len() as u64, c["tokens"].as_u64().unwrap(), "pair {i}: token count");
        let score = f64::from(got[i][0]);
        let want = c["score"].as_f64().unwrap();
        assert!((score - want).abs() < 1e-4, "pair {i}: {score} against mlx-lm's {want}");
        let want = card[i].as_f64().unwrap();
        assert!((score - want).abs() < 1e-4, "pair {i}: {score} against the model card's {want}");
    }
    // The instruction is read: the same pair scores otherwise under another.
    assert_ne!(got[0][0], got[7][0]);
    let mut order_got: Vec<usize> = (0..cases.len()).collect();
    let mut order_want = order_got.clone();
    order_got.sort_by(|&a, &b| got[b][0].total_cmp(&got[a][0]));
    order_want.sort_by(|&a, &b| cases[b]["score"].as_f64().unwrap().total_cmp(&cases[a]["score"].as_f64().unwrap()));
    assert_eq!(order_got, order_want);
}
