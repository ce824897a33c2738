//! Sentence embeddings through a real daemon (all-MiniLM-L6-v2, real
//! weights): the client library's `embed` and `mlxbc embed`; every text
//! embedded once, ever (a second request, and one after a restart, are
//! answered from the store with the same vectors); the `openai` SDK and the
//! `ollama` client through the gateway (tests/clients/embeddings.py); bad
//! requests refused with a sentence while the daemon keeps serving. And a
//! reranker (a tiny cross-encoder) through the socket, the CLI and HTTP.

use crate::helper::{fixture, Daemon, DaemonOptions, SMOLLM2};
use mlxbc_client::EmbedRequest;

const MINILM: &str = "all-MiniLM-L6-v2";

fn options(args: Vec<String>) -> DaemonOptions {
    DaemonOptions {
        models: vec![(SMOLLM2, fixture(&format!("models/{SMOLLM2}"))), (MINILM, fixture("models/all-MiniLM-L6-v2"))],
        args,
    }
}

fn request(inputs: &[&str]) -> EmbedRequest {
    EmbedRequest {
        model: MINILM.into(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        truncate: true,
        dimensions: None,
        keep_alive: None,
        prompt: None,
        token_inputs: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn texts_are_embedded_once_ever_and_the_daemon_keeps_serving_after_bad_requests() {
    let mut d = Daemon::start_with(options(vec![]));
    let texts: Vec<String> = (0..40).map(|i| format!("Chunk {i}: fn item_{i}() -> u32 {{ {i} * 7 }}")).collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let mut c = d.client().await;
    let first = c.embed(request(&refs)).await.unwrap();
    assert_eq!((first.vectors.len(), first.cached), (40, 0));
    assert!(first.vectors.iter().all(|v| v.len() == 384));
    let again = c.embed(request(&refs)).await.unwrap();
    assert_eq!(again.cached, 40, "the second request should come from the store");
    assert_eq!(again.vectors, first.vectors);
    // Counted from the counts stored with the vectors (the texts are not tokenized again).
    assert_eq!(again.prompt_tokens, first.prompt_tokens);
    // A text past the model's 256 tokens, cut when embedded; asked again
    // without truncation it is refused from its stored count.
    let long = "word ".repeat(600);
    let cut = c.embed(request(&[&long])).await.unwrap();
    assert_eq!((cut.prompt_tokens, cut.cached), (256, 0));
    let stored = c.embed(request(&[&long])).await.unwrap();
    assert_eq!((stored.prompt_tokens, stored.cached, &stored.vectors), (256, 1, &cut.vectors));
    let e = c.embed(EmbedRequest { truncate: false, ..request(&[&long]) }).await.expect_err("too long");
    assert!(e.to_string().contains("input 0 is 602 tokens, more than the 256"), "{e}");
    // A request mixing stored and new texts, with a repeat.
    let mixed = c.embed(request(&[refs[3], "something new", refs[3]])).await.unwrap();
    assert_eq!(mixed.cached, 2);
    assert_eq!((&mixed.vectors[0], &mixed.vectors[2]), (&first.vectors[3], &first.vectors[3]));
    drop(c);

    // Refusals, each a sentence; the daemon answers afterwards.
    let mut c = d.client().await;
    for (r, says) in [
        (request(&[]), "nothing to embed"),
        (EmbedRequest { model: SMOLLM2.into(), ..request(&["x"]) }, "not an embedding model"),
        (EmbedRequest { truncate: false, ..request(&[&"word ".repeat(600)]) }, "tokens"),
        (EmbedRequest { dimensions: Some(9999), ..request(&["x"]) }, "dimensions"),
    ] {
        let e = c.embed(r).await.expect_err("refused");
        assert!(e.to_string().contains(says), "{e}");
    }
    let (text, _) = crate::helper::ask(&d.socket, crate::helper::greedy(Some(SMOLLM2), "Say hi.", 4)).await.unwrap();
    assert!(!text.is_empty());
    drop(c);

    // After a restart, from the disk tier.
    d.terminate();
    d.spawn(&[]);
    let mut c = d.client().await;
    let after = c.embed(request(&refs)).await.unwrap();
    assert_eq!(after.cached, 40, "after a restart the vectors should come from disk");
    assert_eq!(after.vectors, first.vectors);
    assert_eq!(after.prompt_tokens, first.prompt_tokens);
    drop(c);

    // The CLI: one JSON array per text, and `mlxbc models` says what it does.
    let out = d.cli().args(["embed", "-m", MINILM, "A man is eating food.", "-v"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8(out.stdout).unwrap();
    let v: Vec<f32> = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(v.len(), 384);
    let models = String::from_utf8(d.cli().arg("models").output().unwrap().stdout).unwrap();
    assert!(models.lines().any(|l| l.contains(MINILM) && l.contains("embedding")), "{models}");

    // `mlxbc status --json`: the counters /metrics exports, and the stores.
    let out = d.cli().args(["status", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let counters = &j["status"]["counters"];
    let done = counters["requests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["kind"] == "embed" && r["model"] == MINILM && r["outcome"] == "done")
        .unwrap_or_else(|| panic!("{counters}"));
    assert!(done["count"].as_u64().unwrap() >= 2, "this daemon's embed requests since the restart: {done}");
    let m = counters["models"].as_array().unwrap().iter().find(|m| m["model"] == MINILM).unwrap();
    assert!(m["embedded_from_store"].as_u64().unwrap() >= 40, "{m}");
    assert!(j["stores"]["entries"].as_u64().unwrap() >= 42, "{}", j["stores"]);
}

/// The `openai` SDK and the `ollama` client.
#[test]
fn openai_sdk_and_ollama_client_embed() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _d = Daemon::start_with(options(vec!["--http".into(), format!("127.0.0.1:{port}")]));
    crate::http::run_client_script("embeddings.py", &[&format!("http://127.0.0.1:{port}"), MINILM, SMOLLM2]);
}

/// A BERT GGUF file (all-MiniLM-L6-v2 as ollama's `all-minilm` ships it:
/// f16, written as llama.cpp's converter writes it) served beside its
/// directory: listed as an embedding model, its vectors those of the
/// directory within f16 rounding, kept in the store under its own
/// fingerprint (a second request is served from it), refused as a chat
/// model with a sentence.
#[tokio::test(flavor = "multi_thread")]
async fn a_bert_gguf_file_embeds_as_its_directory_does() {
    const GGUF: &str = "all-minilm.gguf";
    let d = Daemon::start_with(DaemonOptions {
        models: vec![
            (MINILM, fixture("models/all-MiniLM-L6-v2")),
            (GGUF, fixture("embed-gguf/all-MiniLM-L6-v2.f16.gguf")),
        ],
        args: vec![],
    });
    let texts = ["A man is eating food.", "fn main() { println!(\"hi\"); }", "東京は日本の首都です。"];
    let mut c = d.client().await;
    let dir = c.embed(request(&texts)).await.unwrap();
    let file = c.embed(EmbedRequest { model: GGUF.into(), ..request(&texts) }).await.unwrap();
    assert_eq!((file.cached, file.prompt_tokens), (0, dir.prompt_tokens), "its own fingerprint, the same tokens");
    for (a, b) in dir.vectors.iter().zip(&file.vectors) {
        let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        assert!(dot > 0.9999, "cosine {dot} between the directory's and the GGUF's vectors");
    }
    let again = c.embed(EmbedRequest { model: GGUF.into(), ..request(&texts) }).await.unwrap();
    assert_eq!((again.cached, &again.vectors), (3, &file.vectors));
    let e =
        crate::helper::ask(&d.socket, crate::helper::greedy(Some(GGUF), "hi", 4)).await.expect_err("not a chat model");
    assert!(e.to_string().contains("embedding model"), "{e}");
    let models = String::from_utf8(d.cli().arg("models").output().unwrap().stdout).unwrap();
    assert!(models.lines().any(|l| l.contains(GGUF) && l.contains("embedding")), "{models}");
}

/// A nomic-bert embedder (nomic-embed-text's architecture; tiny random
/// weights, checked against llama.cpp in numerics) served from its
/// sentence-transformers directory and as the GGUF ollama's
/// `nomic-embed-text` is: the directory's named prompt (`search_query`)
/// gives what the GGUF gives for the text with the prefix written out (as
/// ollama's users write it), within f16 rounding; Matryoshka `dimensions`
/// cut and normalize again; both listed as embedding models; a second
/// request served from the store.
#[tokio::test(flavor = "multi_thread")]
async fn a_nomic_bert_embeds_from_its_directory_and_its_gguf_with_its_prompts() {
    const DIR: &str = "tiny-nomic-bert";
    const GGUF: &str = "nomic-embed-text.gguf";
    let d = Daemon::start_with(DaemonOptions {
        models: vec![(DIR, fixture("nomic/tiny-nomic-bert")), (GGUF, fixture("nomic/tiny-nomic-bert.f16.gguf"))],
        args: vec![],
    });
    let texts = ["What is the capital of Japan?", "fn main() { println!(\"hi\"); }"];
    let mut c = d.client().await;
    let dir = c
        .embed(EmbedRequest { model: DIR.into(), prompt: Some("search_query".into()), ..request(&texts) })
        .await
        .unwrap();
    let prefixed: Vec<String> = texts.iter().map(|t| format!("search_query: {t}")).collect();
    let prefixed: Vec<&str> = prefixed.iter().map(String::as_str).collect();
    let file = c.embed(EmbedRequest { model: GGUF.into(), ..request(&prefixed) }).await.unwrap();
    assert_eq!(dir.prompt_tokens, file.prompt_tokens, "the prompt's tokens counted alike");
    for (a, b) in dir.vectors.iter().zip(&file.vectors) {
        assert_eq!(a.len(), 64);
        let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        assert!(dot > 0.999, "cosine {dot} between the directory's (prompt by name) and the GGUF's vectors");
    }
    let bare = c.embed(EmbedRequest { model: DIR.into(), ..request(&texts) }).await.unwrap();
    let dot: f32 = bare.vectors[0].iter().zip(&dir.vectors[0]).map(|(x, y)| x * y).sum();
    assert!(dot < 0.999, "the prompt changes the vector (cosine {dot})");
    let short = c.embed(EmbedRequest { model: GGUF.into(), dimensions: Some(32), ..request(&prefixed) }).await.unwrap();
    let norm: f32 = short.vectors[0].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert_eq!(short.vectors[0].len(), 32);
    assert!((norm - 1.0).abs() < 1e-4, "a cut vector is normalized again ({norm})");
    let again = c.embed(EmbedRequest { model: GGUF.into(), ..request(&prefixed) }).await.unwrap();
    assert_eq!((again.cached, &again.vectors), (2, &file.vectors));
    let models = String::from_utf8(d.cli().arg("models").output().unwrap().stdout).unwrap();
    for name in [DIR, GGUF] {
        assert!(models.lines().any(|l| l.contains(name) && l.contains("embedding")), "{models}");
    }
}

/// `GET /metrics` parses with prometheus_client's parser and its counters
/// move as requests are served (tests/clients/metrics.py).
#[test]
fn metrics_parse_and_move_as_requests_are_served() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut with_speech = options(vec!["--http".into(), format!("127.0.0.1:{port}")]);
    with_speech.models.push(("whisper-tiny.en", fixture("models/whisper-tiny.en")));
    let _d = Daemon::start_with(with_speech);
    let wav = fixture("whisper/clips/s1.wav");
    crate::http::run_client_script(
        "metrics.py",
        &[&format!("http://127.0.0.1:{port}"), SMOLLM2, MINILM, "whisper-tiny.en", wav.to_str().unwrap()],
    );
}

const RERANKER: &str = "tiny-cross-encoder";

fn rerank_request(query: &str, documents: &[String], top_n: Option<u32>) -> mlxbc_client::RerankRequest {
    mlxbc_client::RerankRequest {
        model: RERANKER.into(),
        query: query.into(),
        documents: documents.to_vec(),
        top_n,
        keep_alive: None,
        instruction: None,
    }
}

/// A reranker (a tiny random-weight cross-encoder with MiniLM's tokenizer:
/// no real one ships on PyPI; its scores are checked against the reference
/// in numerics) through the client library, `mlxbc rerank` and plain HTTP
/// (`/v1/rerank`, `/rerank`): documents ordered by the reference's scores,
/// each pair scored once, ever (the second request from the store), and
/// refusals with a sentence (an embedder asked to rerank, a reranker asked
/// to embed, a chat model, no documents, `top_n` 0, a query longer than the
/// model reads) while the daemon
/// keeps serving.
#[tokio::test(flavor = "multi_thread")]
async fn a_reranker_orders_documents_once_ever_through_the_socket_cli_and_http() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("rerank/reference.json")).unwrap()).unwrap();
    let query = reference["query"].as_str().unwrap().to_string();
    let pairs = reference["pairs"].as_array().unwrap();
    let documents: Vec<String> = pairs.iter().map(|p| p["document"].as_str().unwrap().to_string()).collect();
    let want: Vec<f32> = pairs.iter().map(|p| p["score"].as_f64().unwrap() as f32).collect();
    let mut order: Vec<usize> = (0..want.len()).collect();
    order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut opts = options(vec!["--http".into(), format!("127.0.0.1:{port}")]);
    opts.models.push((RERANKER, fixture("rerank/tiny-cross-encoder")));
    let d = Daemon::start_with(opts);
    let mut c = d.client().await;
    let first = c.rerank(rerank_request(&query, &documents, None)).await.unwrap();
    assert_eq!(first.cached, 0);
    let got: Vec<usize> = first.results.iter().map(|r| r.index as usize).collect();
    assert_eq!(got, order, "most relevant first, as the reference scores them");
    for r in &first.results {
        assert!((r.score - want[r.index as usize]).abs() < 1e-4, "document {}: {}", r.index, r.score);
    }
    let again = c.rerank(rerank_request(&query, &documents, Some(3))).await.unwrap();
    assert_eq!(again.cached, documents.len() as u32, "the second request should come from the store");
    assert_eq!(again.results, first.results[..3]);
    // Another query over the same documents is another pair: computed.
    let other = c.rerank(rerank_request("the lighthouse keeper", &documents, None)).await.unwrap();
    assert_eq!(other.cached, 0);

    for (result, says) in [
        (c.rerank(rerank_request(&query, &[], None)).await.map(|_| ()), "no documents"),
        (c.rerank(rerank_request(&query, &documents, Some(0))).await.map(|_| ()), "top_n"),
        (c.rerank(rerank_request(&"word ".repeat(600), &documents, None)).await.map(|_| ()), "the query is"),
        (
            c.rerank(mlxbc_client::RerankRequest { model: MINILM.into(), ..rerank_request(&query, &documents, None) })
                .await
                .map(|_| ()),
            "not a reranker",
        ),
        (
            c.rerank(mlxbc_client::RerankRequest { model: SMOLLM2.into(), ..rerank_request(&query, &documents, None) })
                .await
                .map(|_| ()),
            "not an embedding model or a reranker",
        ),
        (c.embed(EmbedRequest { model: RERANKER.into(), ..request(&["x"]) }).await.map(|_| ()), "is a reranker"),
    ] {
        let e = result.expect_err("refused");
        assert!(e.to_string().contains(says), "{e}");
    }
    drop(c);

    // The CLI: a line per document, most relevant first; `mlxbc models`.
    let mut args =
        vec!["rerank".to_string(), "-m".into(), RERANKER.into(), "--top-n".into(), "2".into(), query.clone()];
    args.extend(documents.iter().filter(|d| !d.is_empty()).cloned());
    let out = d.cli().args(&args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let first_line: Vec<&str> = text.lines().next().unwrap().splitn(3, '\t').collect();
    assert_eq!(text.lines().count(), 2, "{text}");
    assert_eq!(first_line[2], documents[order[0]], "{text}");
    let models = String::from_utf8(d.cli().arg("models").output().unwrap().stdout).unwrap();
    assert!(models.lines().any(|l| l.contains(RERANKER) && l.contains("rerank")), "{models}");

    // Plain HTTP: Jina/Cohere's shape, documents as strings or objects.
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let objects: Vec<serde_json::Value> = documents.iter().map(|d| serde_json::json!({"text": d})).collect();
    let body = serde_json::json!({"model": RERANKER, "query": query, "documents": objects, "top_n": 2,
                                  "return_documents": true});
    let r: serde_json::Value =
        http.post(format!("{base}/v1/rerank")).json(&body).send().await.unwrap().json().await.unwrap();
    let results = r["results"].as_array().unwrap_or_else(|| panic!("{r}"));
    assert_eq!(results.len(), 2, "{r}");
    assert_eq!(results[0]["index"], order[0], "{r}");
    assert_eq!(results[0]["document"]["text"], documents[order[0]].as_str(), "{r}");
    assert!((results[0]["relevance_score"].as_f64().unwrap() as f32 - want[order[0]]).abs() < 1e-4);
    assert!(r["usage"]["total_tokens"].as_u64().unwrap() > 0, "{r}");
    // No model: the daemon's reranker; TEI's `texts`.
    let body = serde_json::json!({"query": query, "texts": documents});
    let r: serde_json::Value =
        http.post(format!("{base}/rerank")).json(&body).send().await.unwrap().json().await.unwrap();
    assert_eq!(r["model"], RERANKER, "{r}");
    assert_eq!(r["results"].as_array().unwrap().len(), documents.len());
    for (body, says) in [
        (serde_json::json!({"model": RERANKER, "query": query}), "documents is required"),
        (serde_json::json!({"model": RERANKER, "query": query, "documents": []}), "no documents"),
        (serde_json::json!({"model": MINILM, "query": query, "documents": ["a"]}), "not a reranker"),
    ] {
        let resp = http.post(format!("{base}/v1/rerank")).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 400, "{body}");
        let e: serde_json::Value = resp.json().await.unwrap();
        assert!(e["error"]["message"].as_str().unwrap().contains(says), "{e}");
    }
    let (text, _) = crate::helper::ask(&d.socket, crate::helper::greedy(Some(SMOLLM2), "Say hi.", 4)).await.unwrap();
    assert!(!text.is_empty());
}

/// A decoder reranker (a tiny random-weight Qwen3 laid out as
/// Qwen3-Reranker ships, in a directory named as a reranker; its scores
/// against mlx-lm and the model card in numerics) over plain HTTP: listed
/// as rerank, documents ordered by the reference's scores, the default
/// instruction and one given (`instruction`, an extension) each scored
/// once, ever, and a cross-encoder refusing an instruction with a sentence.
#[tokio::test(flavor = "multi_thread")]
async fn a_qwen3_reranker_orders_documents_by_its_yes_and_reads_an_instruction() {
    const LM_RERANKER: &str = "tiny-qwen3-reranker";
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("lm-rerank/reference.json")).unwrap()).unwrap();
    let cases = cases.as_array().unwrap();
    let plain: Vec<&serde_json::Value> = cases.iter().filter(|c| c["instruction"].is_null()).collect();
    let documents: Vec<&str> = plain.iter().map(|c| c["document"].as_str().unwrap()).collect();
    let mut order: Vec<usize> = (0..plain.len()).collect();
    order.sort_by(|&a, &b| plain[b]["score"].as_f64().unwrap().total_cmp(&plain[a]["score"].as_f64().unwrap()));

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut opts = options(vec!["--http".into(), format!("127.0.0.1:{port}")]);
    opts.models.push((LM_RERANKER, fixture("lm-rerank/tiny-qwen3-reranker")));
    opts.models.push((RERANKER, fixture("rerank/tiny-cross-encoder")));
    let d = Daemon::start_with(opts);
    let models = String::from_utf8(d.cli().arg("models").output().unwrap().stdout).unwrap();
    assert!(models.lines().any(|l| l.contains(LM_RERANKER) && l.contains("rerank")), "{models}");

    let http = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/v1/rerank");
    let query = plain[0]["query"].as_str().unwrap();
    let body = serde_json::json!({"model": LM_RERANKER, "query": query, "documents": documents});
    for round in 0..2 {
        let r: serde_json::Value = http.post(&url).json(&body).send().await.unwrap().json().await.unwrap();
        let results = r["results"].as_array().unwrap_or_else(|| panic!("{r}"));
        let got: Vec<usize> = results.iter().map(|x| x["index"].as_u64().unwrap() as usize).collect();
        assert_eq!(got, order, "round {round}: most relevant first, as mlx-lm scores them: {r}");
        for x in results {
            let want = plain[x["index"].as_u64().unwrap() as usize]["score"].as_f64().unwrap();
            assert!((x["relevance_score"].as_f64().unwrap() - want).abs() < 1e-4, "{x} against {want}");
        }
    }

    // An instruction: another key, the reference's score under it.
    let with: Vec<&serde_json::Value> = cases.iter().filter(|c| !c["instruction"].is_null()).collect();
    let instruction = with[0]["instruction"].as_str().unwrap();
    let docs: Vec<&str> = with.iter().map(|c| c["document"].as_str().unwrap()).collect();
    let body = serde_json::json!({"model": LM_RERANKER, "query": query, "documents": docs,
                                  "instruction": instruction});
    let r: serde_json::Value = http.post(&url).json(&body).send().await.unwrap().json().await.unwrap();
    for x in r["results"].as_array().unwrap_or_else(|| panic!("{r}")) {
        let want = with[x["index"].as_u64().unwrap() as usize]["score"].as_f64().unwrap();
        assert!((x["relevance_score"].as_f64().unwrap() - want).abs() < 1e-4, "{x} against {want}");
    }
    // The socket says how many came from the store: the default
    // instruction's pairs are stored, this instruction's are too now.
    let mut c = d.client().await;
    let again = c
        .rerank(mlxbc_client::RerankRequest {
            model: LM_RERANKER.into(),
            instruction: Some(instruction.into()),
            ..rerank_request(query, &docs.iter().map(|s| s.to_string()).collect::<Vec<_>>(), None)
        })
        .await
        .unwrap();
    assert_eq!(again.cached, docs.len() as u32);
    let other = c
        .rerank(mlxbc_client::RerankRequest {
            model: LM_RERANKER.into(),
            instruction: Some("Find poems.".into()),
            ..rerank_request(query, &docs.iter().map(|s| s.to_string()).collect::<Vec<_>>(), None)
        })
        .await
        .unwrap();
    assert_eq!(other.cached, 0, "another instruction is another pair");

    let body = serde_json::json!({"model": LM_RERANKER, "query": query, "documents": ["a"],
                                  "instruction": "word ".repeat(600)});
    let resp = http.post(&url).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 400, "an instruction longer than the model reads");
    let body = serde_json::json!({"model": RERANKER, "query": query, "documents": ["a"], "instruction": "x"});
    let resp = http.post(&url).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 400);
    let e: serde_json::Value = resp.json().await.unwrap();
    assert!(e["error"]["message"].as_str().unwrap().contains("reads no instruction"), "{e}");
}
