//! Embedding requests: each input is looked up in the feature store first
//! (keyed by the embedder's weights, its settings and the text's sha256),
//! and only the misses are computed, a padded batch per engine pass
//! (between decode steps and transcription windows), shortest first so a
//! batch's rows are about as long as each other. A re-index of unchanged
//! chunks is answered from the store, after a restart too. Each stored
//! vector carries its input's token counts, so an input found there is
//! not even tokenized (tokenizing was most of a store hit's time).

use crate::error::EngineError;
use crate::media::SharedStore;
use crate::model::family::Embedder;
use mlxbc_cache::{content_hash, FeatureKey, Features, Modality};
use mlxbc_shared::{EmbedRequest, Embeddings, RerankRequest, RerankResult, Reranking, Response, MAX_EMBED_INPUTS};
use std::rc::Rc;
use std::time::Instant;
use tokio::sync::oneshot;

/// Tokens (padding included) one batch may hold: bounds the attention's
/// memory (`rows × length²` per head) whatever the inputs.
const BATCH_TOKENS: usize = 16 * 1024;

/// The most inputs one batch may hold.
const BATCH_ROWS: usize = 64;

/// What a job's vectors are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Vectors, cut to `dimensions`.
    Embed { dimensions: usize },
    /// A reranker's scores (one per document), most relevant `top_n` first.
    Rerank { top_n: usize },
}

/// An embedding (or reranking) request in progress: its inputs looked up
/// in the store, the misses computed one batch per engine pass
/// ([`Self::step`]), so a request of thousands of texts does not stall the
/// streams of others.
pub struct EmbedJob {
    name: String,
    model: Rc<dyn Embedder>,
    purpose: Purpose,
    /// Each input's identity (a repeat is computed once): the text, or a
    /// reranked document.
    inputs: Vec<String>,
    /// Per input, the index of its first occurrence in the request.
    first: Vec<usize>,
    /// Per input, its token ids as embedded (empty for one the store had).
    ids: Vec<Vec<u32>>,
    /// Per input, its token counts as sent and as embedded (kept with its vector).
    counts: Vec<Counts>,
    vectors: Vec<Option<Vec<f32>>>,
    /// The misses to compute, shortest first; `at` is the next.
    misses: Vec<usize>,
    at: usize,
    keys: Vec<FeatureKey>,
    cached: u32,
    load_ms: f64,
    received: Instant,
    keep_alive: Option<mlxbc_shared::KeepAlive>,
    reply: Option<oneshot::Sender<Response>>,
}

/// What a job's inputs are: texts, or token ids (told apart in the key).
#[derive(Clone, Copy)]
enum Form {
    Text,
    TokenIds,
}

/// An input's tokens: as sent (what a refusal names) and as embedded (cut
/// to the model's length; what usage counts).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counts {
    sent: u32,
    embedded: u32,
}

/// A job's inputs before the store is asked: token ids already (token-id
/// inputs, reranked pairs), or texts tokenized only where the store has
/// no vector for them.
enum Tokens {
    Ready(Vec<Vec<u32>>),
    Later { truncate: bool },
}

/// A stored value: the vector, then its input's two token counts (f32 is
/// exact for them). A value without the counts (stored before they were)
/// is still a hit; its input is tokenized for its counts.
fn stored_value(vector: &[f32], counts: Counts) -> Vec<f32> {
    let mut v = Vec::with_capacity(vector.len() + 2);
    v.extend_from_slice(vector);
    v.extend([counts.sent as f32, counts.embedded as f32]);
    v
}

/// [`stored_value`]'s parts, for a model of `full` dimensions.
fn from_stored(mut v: Vec<f32>, full: usize) -> Option<(Vec<f32>, Option<Counts>)> {
    if v.len() == full + 2 {
        let counts = Counts { sent: v[full] as u32, embedded: v[full + 1] as u32 };
        v.truncate(full);
        Some((v, Some(counts)))
    } else if v.len() == full {
        Some((v, None))
    } else {
        None
    }
}

/// Where a job's answer goes, and when it began.
pub struct Arrival {
    pub load_ms: f64,
    pub received: Instant,
    pub reply: oneshot::Sender<Response>,
}

impl EmbedJob {
    /// Checks and tokenizes `request.inputs` for `model` (resident as
    /// `name`) and takes what the store has; the rest is for [`Self::step`].
    pub fn begin(
        name: &str,
        model: Rc<dyn Embedder>,
        store: Option<&SharedStore>,
        request: EmbedRequest,
        arrival: Arrival,
    ) -> Result<Self, (EngineError, oneshot::Sender<Response>)> {
        let (dimensions, texts, tokens) = match check(name, &*model, &request) {
            Ok(c) => c,
            Err(e) => return Err((e, arrival.reply)),
        };
        let purpose = Purpose::Embed { dimensions };
        let (contents, form) = match &tokens {
            // The hash is of the text as embedded, its instruction included.
            Tokens::Later { .. } => (texts.iter().map(|t| content_hash(t.as_bytes())).collect(), Form::Text),
            // Of the ids' bytes; the key's settings part tells them from a
            // text of the same bytes.
            Tokens::Ready(ids) => {
                let bytes = |ids: &[u32]| ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>();
                (ids.iter().map(|i| content_hash(&bytes(i))).collect(), Form::TokenIds)
            }
        };
        Self::start(name, model, store, texts, tokens, contents, form, purpose, request.keep_alive, arrival)
    }

    /// The same for a reranking: each (query, document) pair is an input,
    /// its score kept under the pair's hash.
    pub fn begin_rerank(
        name: &str,
        model: Rc<dyn Embedder>,
        store: Option<&SharedStore>,
        request: RerankRequest,
        arrival: Arrival,
    ) -> Result<Self, (EngineError, oneshot::Sender<Response>)> {
        let (top_n, ids) = match check_rerank(name, &*model, &request) {
            Ok(c) => c,
            Err(e) => return Err((e, arrival.reply)),
        };
        // The query's length first, so no other (query, document) split
        // of the same bytes has the same key; an instruction before it, its
        // length first too (a pair without one keeps its earlier key).
        let query = request.query.as_bytes();
        let instruction = match &request.instruction {
            Some(i) => [&(i.len() as u64).to_le_bytes()[..], b"instruction", i.as_bytes()].concat(),
            None => Vec::new(),
        };
        let contents = request
            .documents
            .iter()
            .map(|d| {
                content_hash(&[&instruction[..], &(query.len() as u64).to_le_bytes()[..], query, d.as_bytes()].concat())
            })
            .collect();
        let purpose = Purpose::Rerank { top_n };
        let keep_alive = request.keep_alive;
        let tokens = Tokens::Ready(ids);
        Self::start(name, model, store, request.documents, tokens, contents, Form::Text, purpose, keep_alive, arrival)
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        name: &str,
        model: Rc<dyn Embedder>,
        store: Option<&SharedStore>,
        inputs: Vec<String>,
        tokens: Tokens,
        contents: Vec<[u8; 32]>,
        form: Form,
        purpose: Purpose,
        keep_alive: Option<mlxbc_shared::KeepAlive>,
        arrival: Arrival,
    ) -> Result<Self, (EngineError, oneshot::Sender<Response>)> {
        let fingerprint = model.fingerprint();
        let settings = match form {
            Form::Text => FeatureKey::preprocess_hash(&model.settings()),
            Form::TokenIds => FeatureKey::preprocess_hash(&format!("{}, token ids", model.settings())),
        };
        let keys: Vec<FeatureKey> = contents
            .into_iter()
            .map(|content| FeatureKey { modality: Modality::Text, tower: fingerprint.0, preprocess: settings, content })
            .collect();
        let full = model.dimensions();
        let found: Vec<Option<(Vec<f32>, Option<Counts>)>> = match store {
            Some(s) => {
                let mut s = s.lock();
                keys.iter().map(|k| s.get(k).and_then(|(f, _)| from_stored(f.to_f32(), full))).collect()
            }
            None => vec![None; keys.len()],
        };
        let (ids, counts) = match tokens {
            Tokens::Ready(ids) => {
                let counts = ids.iter().map(|i| Counts { sent: i.len() as u32, embedded: i.len() as u32 }).collect();
                (ids, counts)
            }
            Tokens::Later { truncate } => {
                let known: Vec<Option<Counts>> = found.iter().map(|f| f.as_ref().and_then(|(_, c)| *c)).collect();
                match tokenized(name, &*model, &inputs, &known, truncate) {
                    Ok(t) => t,
                    Err(e) => return Err((e, arrival.reply)),
                }
            }
        };
        let vectors: Vec<Option<Vec<f32>>> = found.into_iter().map(|f| f.map(|(v, _)| v)).collect();
        let cached = vectors.iter().filter(|v| v.is_some()).count() as u32;
        // An input repeated within the request is computed once (its first
        // occurrence), and takes that one's vector in `finish`.
        let mut seen = std::collections::HashMap::with_capacity(inputs.len());
        let first: Vec<usize> = inputs.iter().enumerate().map(|(i, t)| *seen.entry(t.as_str()).or_insert(i)).collect();
        drop(seen);
        // The misses, shortest first.
        let mut misses: Vec<usize> = (0..inputs.len()).filter(|&i| vectors[i].is_none() && first[i] == i).collect();
        misses.sort_by_key(|&i| ids[i].len());
        Ok(Self {
            name: name.to_string(),
            model,
            purpose,
            inputs,
            first,
            ids,
            counts,
            vectors,
            misses,
            at: 0,
            keys,
            cached,
            load_ms: arrival.load_ms,
            received: arrival.received,
            keep_alive,
            reply: Some(arrival.reply),
        })
    }

    /// Embeds the next batch of misses (bounded by rows and tokens) and
    /// stores their vectors; true when none are left.
    pub fn step(&mut self, store: Option<&SharedStore>) -> Result<bool, EngineError> {
        if self.at >= self.misses.len() {
            return Ok(true);
        }
        let (at, misses) = (self.at, &self.misses);
        let mut end = at + 1;
        while end < misses.len()
            && end - at < BATCH_ROWS
            && self.ids[misses[end]].len() * (end + 1 - at) <= BATCH_TOKENS
        {
            end += 1;
        }
        let batch: Vec<Vec<u32>> = misses[at..end].iter().map(|&i| self.ids[i].clone()).collect();
        let out = self.model.embed(&batch).map_err(EngineError::inference)?;
        let full = self.model.dimensions() as u32;
        for (&i, v) in misses[at..end].iter().zip(out) {
            if let Some(s) = store {
                let value = stored_value(&v, self.counts[i]);
                if let Err(e) = s.lock().put(&self.keys[i], &Features::from_f32(vec![full + 2], &value)) {
                    tracing::warn!(error = %e, "an embedding was not stored");
                }
            }
            self.vectors[i] = Some(v);
        }
        self.at = end;
        Ok(self.at >= self.misses.len())
    }

    /// The model's canonical name, and how long it stays loaded afterwards.
    pub fn model(&self) -> (&str, Option<mlxbc_shared::KeepAlive>) {
        (&self.name, self.keep_alive)
    }

    /// The API it serves, for the metrics: "embed" or "rerank".
    pub fn api(&self) -> &'static str {
        match self.purpose {
            Purpose::Embed { .. } => "embed",
            Purpose::Rerank { .. } => "rerank",
        }
    }

    /// The answer, once every batch is done.
    fn finish(&mut self) -> Result<Embeddings, EngineError> {
        // Repeats of an input take its first occurrence's vector.
        for i in 0..self.inputs.len() {
            if self.vectors[i].is_none() {
                self.vectors[i] = self.vectors[self.first[i]].clone();
            }
        }
        let dimensions = match self.purpose {
            Purpose::Embed { dimensions } => dimensions,
            Purpose::Rerank { .. } => 1,
        };
        let vectors = std::mem::take(&mut self.vectors)
            .into_iter()
            .map(|v| v.map(|v| shortened(v, dimensions)))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| EngineError::Internal("an input was left without a vector".into()))?;
        Ok(Embeddings {
            model: self.name.clone(),
            vectors,
            prompt_tokens: self.counts.iter().map(|c| c.embedded as u64).sum(),
            cached: self.cached,
            load_ms: self.load_ms,
            total_ms: self.received.elapsed().as_secs_f64() * 1000.0,
        })
    }

    /// Answers the client: the vectors (or the documents' order), or why not.
    fn answer(&mut self, outcome: &Result<Embeddings, EngineError>) {
        if let Some(r) = self.reply.take() {
            let _ = r.send(match (outcome, self.purpose) {
                (Ok(e), Purpose::Embed { .. }) => Response::Embedded(e.clone()),
                (Ok(e), Purpose::Rerank { top_n }) => Response::Reranked(ranked(e, top_n)),
                (Err(e), _) => e.clone().into_response(),
            });
        }
    }
}

/// A reranker's scores (one-value vectors, in the documents' order) as
/// the documents' order by relevance, the best `top_n`.
fn ranked(e: &Embeddings, top_n: usize) -> Reranking {
    let mut results: Vec<RerankResult> = e
        .vectors
        .iter()
        .enumerate()
        .map(|(i, v)| RerankResult { index: i as u32, score: v.first().copied().unwrap_or(f32::NAN) })
        .collect();
    // Most relevant first; equal scores keep the documents' order.
    results.sort_by(|a, b| b.score.total_cmp(&a.score));
    results.truncate(top_n);
    Reranking {
        model: e.model.clone(),
        results,
        prompt_tokens: e.prompt_tokens,
        cached: e.cached,
        load_ms: e.load_ms,
        total_ms: e.total_ms,
    }
}

/// A reranking's `top_n` and its pairs' token ids, or why it is refused.
fn check_rerank(
    name: &str,
    model: &dyn Embedder,
    request: &RerankRequest,
) -> Result<(usize, Vec<Vec<u32>>), EngineError> {
    if !model.reranks() {
        return Err(EngineError::BadRequest(format!(
            "{name} is an embedding model, not a reranker; rerank with a cross-encoder (`mlxbc models` lists \
             them as rerank), or compare embeddings"
        )));
    }
    let documents = &request.documents;
    if documents.is_empty() {
        return Err(EngineError::BadRequest("no documents to rerank: give at least one".into()));
    }
    if documents.len() > MAX_EMBED_INPUTS {
        return Err(EngineError::BadRequest(format!(
            "{} documents in one request; at most {MAX_EMBED_INPUTS} (send them in several)",
            documents.len()
        )));
    }
    // The query is read with every document: one longer than the model
    // reads would be cut anyway, and tokenizing it once per document is
    // work a peer could multiply (a huge query, thousands of documents).
    let query_tokens = model.tokenize(&request.query).map_err(EngineError::inference)?.len();
    if query_tokens > model.max_tokens() {
        return Err(EngineError::BadRequest(format!(
            "the query is {query_tokens} tokens, more than the {} {name} reads with a document; shorten it",
            model.max_tokens()
        )));
    }
    // The instruction too is read with every document: bounded alike.
    if let Some(instruction) = &request.instruction {
        let tokens = model.tokenize(instruction).map_err(EngineError::inference)?.len();
        if tokens > model.max_tokens() {
            return Err(EngineError::BadRequest(format!(
                "the instruction is {tokens} tokens, more than the {} {name} reads with a document; shorten it",
                model.max_tokens()
            )));
        }
    }
    if request.instruction.is_some() && !model.takes_instruction() {
        return Err(EngineError::BadRequest(format!(
            "{name} is a cross-encoder: it reads no instruction (a decoder reranker such as Qwen3-Reranker does); \
             leave instruction out"
        )));
    }
    let top_n = match request.top_n {
        None => documents.len(),
        Some(0) => return Err(EngineError::BadRequest("top_n must be at least 1".into())),
        Some(n) => (n as usize).min(documents.len()),
    };
    let ids = documents
        .iter()
        .map(|d| model.tokenize_pair(&request.query, d, request.instruction.as_deref()))
        .collect::<anyhow::Result<Vec<_>>>()
        .map_err(EngineError::inference)?;
    Ok((top_n, ids))
}

/// A checked embedding request: its output dimensions, its inputs as
/// embedded (after the instruction its prompt names) and their token ids.
type Checked = (usize, Vec<String>, Tokens);

/// The request checked (its inputs truncated where it allows), or why it
/// is refused.
fn check(name: &str, model: &dyn Embedder, request: &EmbedRequest) -> Result<Checked, EngineError> {
    if model.reranks() {
        return Err(EngineError::BadRequest(format!(
            "{name} is a reranker: it scores documents against a query (`mlxbc rerank`, /v1/rerank) and does not \
             embed; embed with an embedding model, e.g. all-MiniLM-L6-v2"
        )));
    }
    let inputs = &request.inputs;
    let count = inputs.len() + request.token_inputs.len();
    if count == 0 {
        return Err(EngineError::BadRequest("nothing to embed: give at least one input".into()));
    }
    if count > MAX_EMBED_INPUTS {
        return Err(EngineError::BadRequest(format!(
            "{count} inputs in one request; at most {MAX_EMBED_INPUTS} (send them in several)"
        )));
    }
    let full = model.dimensions();
    let dimensions = match request.dimensions {
        None => full,
        Some(d) if d >= 1 && (d as usize) <= full => d as usize,
        Some(d) => return Err(EngineError::BadRequest(format!("dimensions {d} is not between 1 and {name}'s {full}"))),
    };
    let instruction =
        model.prompt(request.prompt.as_deref()).map_err(|e| EngineError::BadRequest(format!("{name}: {e:#}")))?;
    if !request.token_inputs.is_empty() {
        if !inputs.is_empty() {
            return Err(EngineError::BadRequest("give texts or token ids, not both in one request".into()));
        }
        if !instruction.is_empty() {
            return Err(EngineError::BadRequest(format!(
                "{name} puts an instruction before this prompt's inputs, which token ids cannot carry: send text"
            )));
        }
        let ids = check_token_inputs(name, model, &request.token_inputs, request.truncate)?;
        let identities = ids.iter().map(|i| format!("{i:?}")).collect();
        return Ok((dimensions, identities, Tokens::Ready(ids)));
    }
    let texts: Vec<String> = inputs.iter().map(|t| format!("{instruction}{t}")).collect();
    Ok((dimensions, texts, Tokens::Later { truncate: request.truncate }))
}

/// Each text's ids as embedded (cut to the model's length where `truncate`,
/// else a text that is too long is refused) and token counts; a text whose
/// counts the store `known` is not tokenized (its ids stay empty: it is
/// not computed).
fn tokenized(
    name: &str,
    model: &dyn Embedder,
    texts: &[String],
    known: &[Option<Counts>],
    truncate: bool,
) -> Result<(Vec<Vec<u32>>, Vec<Counts>), EngineError> {
    let max = model.max_tokens();
    let too_long = |i: usize, n: usize| {
        EngineError::BadRequest(format!(
            "input {i} is {n} tokens, more than the {max} {name} takes; shorten it, or let it be truncated"
        ))
    };
    let (mut ids, mut counts) = (Vec::with_capacity(texts.len()), Vec::with_capacity(texts.len()));
    for (i, (text, known)) in texts.iter().zip(known).enumerate() {
        let (t, c) = match known {
            Some(c) => (Vec::new(), *c),
            None => {
                let t = model.tokenize(text).map_err(EngineError::inference)?;
                let sent = t.len() as u32;
                let t = model.truncate(&t);
                let embedded = t.len() as u32;
                (t, Counts { sent, embedded })
            }
        };
        if c.sent as usize > max && !truncate {
            return Err(too_long(i, c.sent as usize));
        }
        ids.push(t);
        counts.push(c);
    }
    Ok((ids, counts))
}

/// Token-id inputs checked against the model's vocabulary and length (cut
/// to the first [`Embedder::max_tokens`] where `truncate`).
fn check_token_inputs(
    name: &str,
    model: &dyn Embedder,
    inputs: &[Vec<u32>],
    truncate: bool,
) -> Result<Vec<Vec<u32>>, EngineError> {
    let (vocabulary, max) = (model.vocabulary(), model.max_tokens());
    let mut out = Vec::with_capacity(inputs.len());
    for (i, ids) in inputs.iter().enumerate() {
        if ids.is_empty() {
            return Err(EngineError::BadRequest(format!("input {i} is an empty list of token ids")));
        }
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocabulary) {
            return Err(EngineError::BadRequest(format!(
                "input {i}: token id {bad} is not in {name}'s vocabulary of {vocabulary}; token ids are the \
                 model's own tokenizer's (LangChain's OpenAIEmbeddings sends tiktoken's unless \
                 check_embedding_ctx_length=False): send the text"
            )));
        }
        if ids.len() > max && !truncate {
            return Err(EngineError::BadRequest(format!(
                "input {i} is {} tokens, more than the {max} {name} takes; shorten it",
                ids.len()
            )));
        }
        out.push(ids[..ids.len().min(max)].to_vec());
    }
    Ok(out)
}

/// The embedding requests in progress, served one batch per engine pass
/// in turn.
#[derive(Default)]
pub struct EmbedJobs(std::collections::VecDeque<EmbedJob>);

impl EmbedJobs {
    pub fn add(&mut self, job: EmbedJob) {
        self.0.push_back(job);
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// One batch of the first job; a job that is done (or failed) is
    /// counted in `metrics` and then answered (so a client that reads the
    /// metrics right after its answer finds its request counted), and
    /// leaves. Returns the job that ended, and its outcome, if one did.
    pub fn step(
        &mut self,
        store: Option<&SharedStore>,
        metrics: &crate::metrics::Metrics,
    ) -> Option<(EmbedJob, Result<Embeddings, EngineError>)> {
        let mut job = self.0.pop_front()?;
        let outcome = match job.step(store) {
            Ok(false) => {
                self.0.push_back(job);
                return None;
            }
            Ok(true) => job.finish(),
            Err(e) => Err(e),
        };
        let kind = outcome.as_ref().map_or_else(|e| format!("{:?}", e.kind()), |_| "done".into());
        metrics.embedding(job.api(), &job.name, &kind, outcome.as_ref().ok());
        job.answer(&outcome);
        Some((job, outcome))
    }

    /// Answers every job with `why` (the daemon is stopping).
    pub fn clear(&mut self, why: impl Fn() -> EngineError) {
        for mut job in self.0.drain(..) {
            job.answer(&Err(why()));
        }
    }
}

/// `v`'s first `dimensions` values, normalized again when cut (Matryoshka
/// embeddings, as OpenAI's `dimensions` returns them).
fn shortened(mut v: Vec<f32>, dimensions: usize) -> Vec<f32> {
    if dimensions >= v.len() {
        return v;
    }
    v.truncate(dimensions);
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts its batches and rows; a text's vector is its length, then zeros.
    struct Lengths(std::cell::Cell<usize>, std::cell::Cell<usize>);

    /// Inputs whose counts the store knows are not tokenized; the others
    /// are, and a too-long one is refused by either count.
    #[test]
    fn known_counts_spare_tokenizing_and_still_refuse_a_long_input() {
        let model = Lengths(Default::default(), Default::default());
        let texts = vec!["abc".to_string(), "stored".to_string()];
        let known = [None, Some(Counts { sent: 900, embedded: 512 })];
        let (ids, counts) = tokenized("m", &model, &texts, &known, true).unwrap();
        assert_eq!(ids, vec![vec![97, 98, 99], vec![]], "the stored one is not tokenized");
        assert_eq!(counts, vec![Counts { sent: 3, embedded: 3 }, Counts { sent: 900, embedded: 512 }]);
        let e = tokenized("m", &model, &texts, &known, false).unwrap_err();
        assert!(e.to_string().contains("input 1 is 900 tokens"), "{e}");
        // A value and its counts round-trip; a value stored without counts is a hit without them.
        let c = Counts { sent: 300, embedded: 256 };
        assert_eq!(from_stored(stored_value(&[0.5, -1.0], c), 2), Some((vec![0.5, -1.0], Some(c))));
        assert_eq!(from_stored(vec![0.5, -1.0], 2), Some((vec![0.5, -1.0], None)));
        assert_eq!(from_stored(vec![0.5], 2), None);
    }

    impl Embedder for Lengths {
        fn architecture(&self) -> &'static str {
            "lengths"
        }
        fn dimensions(&self) -> usize {
            2
        }
        fn max_tokens(&self) -> usize {
            512
        }
        fn tokenize(&self, text: &str) -> anyhow::Result<Vec<u32>> {
            Ok(text.bytes().map(u32::from).collect())
        }
        fn truncate(&self, ids: &[u32]) -> Vec<u32> {
            ids.to_vec()
        }
        fn embed(&self, inputs: &[Vec<u32>]) -> anyhow::Result<Vec<Vec<f32>>> {
            self.0.set(self.0.get() + 1);
            self.1.set(self.1.get() + inputs.len());
            Ok(inputs.iter().map(|i| vec![i.len() as f32, 0.0]).collect())
        }
        fn fingerprint(&self) -> mlxbc_cache::TowerFingerprint {
            mlxbc_cache::TowerFingerprint([7; 32])
        }
        fn vocabulary(&self) -> usize {
            1000
        }

        fn settings(&self) -> String {
            "test".into()
        }
    }

    /// A request of 100 texts (one repeated) is computed a batch per step
    /// (64 rows at most), answered once, in its inputs' order: the engine
    /// runs one step per pass, between other requests' decode steps.
    #[test]
    fn a_job_is_computed_a_batch_per_step_and_answered_once_in_order() {
        let model = Rc::new(Lengths(Default::default(), Default::default()));
        let mut inputs: Vec<String> = (0..99).map(|i| format!("text {i}")).collect();
        inputs.push(inputs[3].clone());
        let request = EmbedRequest {
            model: "m".into(),
            inputs: inputs.clone(),
            truncate: true,
            dimensions: None,
            keep_alive: None,
            prompt: None,
            token_inputs: Vec::new(),
        };
        let (reply, mut answer) = oneshot::channel();
        let arrival = Arrival { load_ms: 0.0, received: Instant::now(), reply };
        let job = EmbedJob::begin("m", model.clone(), None, request, arrival).ok().unwrap();
        let mut jobs = EmbedJobs::default();
        jobs.add(job);
        assert!(jobs.step(None, &Default::default()).is_none(), "the first batch leaves misses");
        assert!(answer.try_recv().is_err(), "not answered yet");
        let (_, outcome) = jobs.step(None, &Default::default()).expect("the second batch ends it");
        assert!(jobs.is_empty());
        assert_eq!(model.0.get(), 2);
        assert_eq!(model.1.get(), 99, "the repeat (not next to its twin once sorted) is computed once");
        let Ok(Response::Embedded(e)) = answer.try_recv() else { panic!("no answer") };
        assert_eq!(e.vectors, outcome.unwrap().vectors);
        let want: Vec<Vec<f32>> = inputs.iter().map(|t| vec![t.len() as f32, 0.0]).collect();
        assert_eq!(e.vectors, want);
    }

    #[test]
    fn a_shortened_vector_is_normalized_again() {
        let v = shortened(vec![3.0, 4.0, 12.0], 2);
        assert_eq!(v, vec![0.6, 0.8]);
        assert_eq!(shortened(vec![1.0, 2.0], 5), vec![1.0, 2.0]);
    }
}
