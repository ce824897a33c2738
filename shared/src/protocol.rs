//! The wire protocol. One enum per direction; variants are only ever appended,
//! because bincode identifies a variant by its index.
//!
//! A connection opens with [`Request::Hello`] and the daemon's
//! [`Response::Hello`] (or an [`ErrorKind::ProtocolMismatch`] error). Each later
//! request gets one reply, except [`Request::Generate`], whose reply is a
//! stream: [`Response::Started`], any number of [`Response::Token`], then
//! exactly one [`Response::Done`] or [`Response::Error`].

use serde::{Deserialize, Serialize};

/// Bumped whenever a wire type changes shape. `Hello` (variant 0 of both enums,
/// with its fields) must never change, so that any two versions can at least
/// tell each other they disagree.
pub const PROTOCOL_VERSION: u32 = 23;

/// A message from a client to the daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// First frame of every connection.
    Hello { protocol: u32, client_version: String },
    /// Generate a chat completion; the reply is a stream of events.
    Generate(GenerateRequest),
    /// List the models the daemon knows (model store and aliases).
    ListModels,
    /// Loaded models, memory and queue.
    Status,
    /// Load a model now (and optionally set how long it stays resident).
    /// `sharded`: split it over the daemon's group (`mlxbc load --sharded`).
    Load { model: String, keep_alive: Option<KeepAlive>, sharded: bool },
    /// Unload a model now.
    Unload { model: String },
    /// Stop the daemon after the current job.
    Shutdown,
    /// Encode media ahead of time so a later question is already a hit.
    /// May be answered with [`Response::NeedMedia`] first, like Generate.
    Prefetch { model: Option<String>, media: Vec<MediaRef> },
    /// Inspect or maintain the encoder-feature store.
    Cache(CacheCommand),
    /// List the daemon's named conversations, or forget one.
    Sessions(SessionCommand),
    /// Transcribe (or translate) an audio file with a speech model. Like
    /// Generate, may be answered with [`Response::NeedMedia`] first: the
    /// audio travels by hash until the daemon asks for its bytes.
    Transcribe(TranscribeRequest),
    /// Embed texts with an embedding model; answered by [`Response::Embedded`].
    Embed(EmbedRequest),
    /// Order documents by relevance to a query with a reranker; answered
    /// by [`Response::Reranked`].
    Rerank(RerankRequest),
    /// Form the daemon's group again now (`mlxbc cluster restart`);
    /// answered with [`Response::Status`].
    ClusterRestart,
}

/// A transcription request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TranscribeRequest {
    /// A speech model (`None`: the first Whisper model the daemon has).
    pub model: Option<String>,
    /// The audio file (WAV, FLAC, MP3, OGG/Vorbis).
    pub audio: MediaRef,
    /// ISO 639-1 code; `None`: detected (multilingual models) or English.
    pub language: Option<String>,
    /// Translate into English instead of transcribing (multilingual models).
    pub translate: bool,
    /// Text that came before, to steer spelling and style.
    pub prompt: Option<String>,
    /// `None`: Whisper's fallback ladder 0, 0.2, ... 1.0 (a window is decoded
    /// again hotter when its text repeats or its log probability is low).
    pub temperature: Option<f32>,
    /// Segment timestamps (Whisper's timestamp tokens); false decodes text only.
    pub timestamps: bool,
    /// Feed each window the text of the ones before (Whisper's default).
    pub condition_on_previous_text: bool,
    pub keep_alive: Option<KeepAlive>,
}

impl TranscribeRequest {
    /// A request with Whisper's defaults for `audio`.
    pub fn new(audio: MediaRef) -> Self {
        Self {
            model: None,
            audio,
            language: None,
            translate: false,
            prompt: None,
            temperature: None,
            timestamps: true,
            condition_on_previous_text: true,
            keep_alive: None,
        }
    }
}

/// One stretch of a transcript.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TranscriptSegment {
    pub id: u32,
    /// The window it was decoded in (its first mel frame, 100 a second).
    pub seek: u32,
    pub start: f64,
    pub end: f64,
    pub text: String,
    /// Its tokens, timestamps included.
    pub tokens: Vec<u32>,
    pub temperature: f32,
    pub avg_logprob: f64,
    pub compression_ratio: f64,
    pub no_speech_prob: f64,
}

/// What a transcription measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TranscribeStats {
    pub model: String,
    pub audio_seconds: f64,
    /// 30-second windows decoded (a fallback decodes one again).
    pub windows: u32,
    /// Windows whose encoder output came from the feature store, and those encoded now.
    pub encoder_hits: u32,
    pub encoder_misses: u32,
    pub decode_ms: f64,
    pub encode_ms: f64,
    /// Decoding the file and computing its log-mel.
    pub preprocess_ms: f64,
    pub load_ms: f64,
    pub total_ms: f64,
}

/// A finished transcription.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transcript {
    pub text: String,
    /// The language decoded in (given or detected).
    pub language: String,
    pub segments: Vec<TranscriptSegment>,
    pub stats: TranscribeStats,
}

/// What to do with named conversations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SessionCommand {
    /// Every session with its message count.
    List,
    /// One session's messages.
    Show { name: String },
    /// Forget a session.
    Delete { name: String },
}

/// A named conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub name: String,
    pub messages: Vec<ChatMessage>,
}

/// What to do with the encoder-feature store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CacheCommand {
    /// Counters and sizes.
    Stats,
    /// Every entry.
    List,
    /// Remove everything.
    Clear,
    /// Read every entry and drop damaged ones.
    Verify,
    /// Remove every prompt KV block (RAM and disk); the feature store stays.
    ClearPrompts,
}

/// What a [`MediaRef`]'s file is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum MediaKind {
    /// A still image (PNG, JPEG, WebP, GIF's first frame).
    #[default]
    Image,
    /// A video (anything ffmpeg reads; animated GIF and WebP in-process):
    /// sampled into frames by the model's video settings.
    Video,
    /// An audio clip (WAV, FLAC, MP3, OGG/Vorbis) for a model that hears
    /// (Gemma 4), heard as a whole. Transcription has its own request.
    Audio,
}

/// An image, a video or an audio clip by content hash; the bytes travel only when the
/// daemon asks for them with [`Response::NeedMedia`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MediaRef {
    /// sha256 of the file's bytes.
    pub sha256: [u8; 32],
    /// The bytes, when the daemon asked for them.
    pub bytes: Option<Vec<u8>>,
    pub kind: MediaKind,
}

impl MediaRef {
    /// An image carrying its bytes (the client strips them for the first try).
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        use sha2::Digest;
        Self { sha256: sha2::Sha256::digest(&bytes).into(), bytes: Some(bytes), kind: MediaKind::Image }
    }

    /// A video carrying its bytes.
    pub fn video(bytes: Vec<u8>) -> Self {
        Self { kind: MediaKind::Video, ..Self::from_bytes(bytes) }
    }

    /// An audio clip carrying its bytes.
    pub fn audio(bytes: Vec<u8>) -> Self {
        Self { kind: MediaKind::Audio, ..Self::from_bytes(bytes) }
    }

    /// An image known by its hash only.
    pub fn hash_only(sha256: [u8; 32]) -> Self {
        Self { sha256, bytes: None, kind: MediaKind::Image }
    }

    /// Lower-case hex of the hash.
    pub fn hex(&self) -> String {
        self.sha256.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// One entry of the feature store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheEntry {
    /// sha256 of the media (hex).
    pub content: String,
    /// Tower fingerprint (hex, shortened).
    pub tower: String,
    pub bytes: u64,
}

/// Answer to [`Request::Cache`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheReport {
    pub path: String,
    pub entries: u64,
    pub disk_bytes: u64,
    pub disk_budget_bytes: u64,
    pub ram_entries: u64,
    pub ram_bytes: u64,
    pub ram_hits: u64,
    pub disk_hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub corrupt: u64,
    /// Entries removed by Clear or Verify.
    pub removed: u64,
    /// Entries not written to disk because it was down to its reserve.
    pub skipped_for_space: u64,
    /// Filled by List.
    pub listing: Vec<CacheEntry>,
    /// The prompt cache (KV blocks of prompt prefixes).
    pub prompts: PromptCacheReport,
}

/// The prompt cache's state, in [`CacheReport`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptCacheReport {
    pub path: String,
    /// Prompt positions per block.
    pub block_tokens: u32,
    pub ram_blocks: u64,
    pub ram_bytes: u64,
    pub ram_budget_bytes: u64,
    pub disk_blocks: u64,
    pub disk_bytes: u64,
    pub disk_budget_bytes: u64,
    /// Prompt positions served from RAM / disk since the daemon started.
    pub ram_hit_tokens: u64,
    pub disk_hit_tokens: u64,
    /// Blocks stored since the daemon started.
    pub stored_blocks: u64,
    pub ram_evictions: u64,
    pub disk_evictions: u64,
    /// Damaged blocks found on disk (removed, never served).
    pub corrupt: u64,
    /// Blocks not written to disk because the writer was behind.
    pub writes_dropped: u64,
    /// Prompt positions on disk that were computed instead, because
    /// prefilling them was measured cheaper than reading them (a small
    /// model on a fast GPU).
    pub disk_skipped_tokens: u64,
    /// Blocks not written because the disk was down to its reserve
    /// (`disk_reserve_percent`, `disk_reserve_mib`).
    pub disk_skipped_for_space: u64,
    /// What the disk's free space above the reserve still allows (the
    /// budget in force is the smaller of the two).
    pub disk_room_bytes: u64,
}

/// A message from the daemon to a client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Response {
    /// Answer to [`Request::Hello`].
    Hello { protocol: u32, daemon_version: String, device: String, blas: String },
    /// A generation has been admitted and its prompt tokenized.
    Started { model: String, prompt_tokens: u32 },
    /// The next piece of generated text (never a split UTF-8 character).
    Token { text: String },
    /// The generation finished; always the last event of a stream that did not fail.
    Done { stats: GenerationStats },
    /// The request failed; the last event of its stream.
    Error { kind: ErrorKind, message: String },
    /// Answer to [`Request::ListModels`].
    Models { models: Vec<ModelInfo> },
    /// Answer to [`Request::Status`].
    Status(DaemonStatus),
    /// Answer to [`Request::Load`].
    Loaded { model: String, load_ms: u64, memory_bytes: u64 },
    /// Answer to [`Request::Unload`]; `was_loaded` is false when it was not resident.
    Unloaded { model: String, was_loaded: bool },
    /// Answer to [`Request::Shutdown`].
    ShuttingDown,
    /// The daemon has no features for these media: send the request again
    /// with their bytes. Ends the stream.
    NeedMedia { missing: Vec<[u8; 32]> },
    /// Answer to [`Request::Prefetch`]: how many were encoded now and how many were already stored.
    Prefetched { encoded: u32, cached: u32 },
    /// Answer to [`Request::Cache`].
    Cache(CacheReport),
    /// Answer to [`Request::Sessions`] (`Delete`: the one deleted, if it existed).
    Sessions(Vec<SessionInfo>),
    /// Answer to [`Request::Transcribe`].
    Transcribed(Transcript),
    /// Answer to [`Request::Embed`].
    Embedded(Embeddings),
    /// Answer to [`Request::Rerank`].
    Reranked(Reranking),
}

/// The most texts one [`EmbedRequest`] may carry.
pub const MAX_EMBED_INPUTS: usize = 8192;

/// Texts to embed (`mlxbc embed`, `/v1/embeddings`, `/api/embed`). Each
/// text's vector is kept in the daemon's store under the model's weights,
/// its settings and the text's hash: a text is embedded once, ever.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbedRequest {
    /// The embedding model (a name `mlxbc models` lists as embedding).
    pub model: String,
    /// The texts, each embedded on its own (at most [`MAX_EMBED_INPUTS`]).
    pub inputs: Vec<String>,
    /// A text longer than the model takes is cut to its first tokens
    /// (true) or refused with an error naming it (false).
    pub truncate: bool,
    /// Keep each vector's first `dimensions` values, normalized again
    /// (Matryoshka embeddings); `None`: all of them.
    pub dimensions: Option<u32>,
    pub keep_alive: Option<KeepAlive>,
    /// The model's instruction to put before each input, by name (its
    /// `config_sentence_transformers.json` `prompts`: `query` for
    /// Qwen3-Embedding's and E5's queries, `document`); `None`: its
    /// default (usually none).
    pub prompt: Option<String>,
    /// Inputs given as token ids of the model's own tokenizer instead of
    /// texts (OpenAI's token-array inputs), embedded as given: no special
    /// tokens added, no instruction put before them. Either these or
    /// [`Self::inputs`], not both.
    pub token_inputs: Vec<Vec<u32>>,
}

/// The vectors of an [`EmbedRequest`], in its inputs' order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Embeddings {
    /// The model's canonical name.
    pub model: String,
    pub vectors: Vec<Vec<f32>>,
    /// Tokens of the inputs as embedded (after truncation), stored or not.
    pub prompt_tokens: u64,
    /// Inputs whose vectors came from the store (no computation).
    pub cached: u32,
    /// Milliseconds loading the model took (0 when resident), and the whole request.
    pub load_ms: f64,
    pub total_ms: f64,
}

/// A query and the documents to order by relevance to it (`mlxbc rerank`,
/// `/v1/rerank`). Each pair's score is kept in the daemon's store under the
/// reranker's weights and the pair's hash: a pair is scored once, ever.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RerankRequest {
    /// The reranker (a name `mlxbc models` lists as rerank).
    pub model: String,
    pub query: String,
    /// At most [`MAX_EMBED_INPUTS`]; a pair longer than the model takes is
    /// cut, the longer text first (as cross-encoders truncate).
    pub documents: Vec<String>,
    /// Answer only the `top_n` most relevant; `None`: all, ordered.
    pub top_n: Option<u32>,
    pub keep_alive: Option<KeepAlive>,
    /// What relevance means, for a decoder reranker that reads it
    /// (Qwen3-Reranker's `<Instruct>`; `None`: the model's default); a
    /// cross-encoder refuses one.
    pub instruction: Option<String>,
}

/// A [`RerankRequest`]'s documents, most relevant first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reranking {
    /// The model's canonical name.
    pub model: String,
    pub results: Vec<RerankResult>,
    /// Tokens of the (query, document) pairs as scored, stored or not.
    pub prompt_tokens: u64,
    /// Pairs whose scores came from the store (no computation).
    pub cached: u32,
    pub load_ms: f64,
    pub total_ms: f64,
}

/// One document's place in a [`Reranking`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RerankResult {
    /// Its index in [`RerankRequest::documents`].
    pub index: u32,
    /// Relevance, 0 to 1 (the cross-encoder's sigmoid).
    pub score: f32,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
    /// Media (images, videos and audio clips, see [`MediaRef::kind`]) that
    /// come with this message, in order, before its text. Sessions saved
    /// before the rename wrote it as `images`.
    #[serde(alias = "images")]
    pub media: Vec<MediaRef>,
    /// An assistant message's tool calls (an earlier turn that called tools).
    #[serde(default)]
    pub tool_calls: Vec<ToolCall>,
    /// A `Role::Tool` message: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    fn empty() -> Self {
        Self { role: Role::User, content: String::new(), media: Vec::new(), tool_calls: Vec::new(), tool_call_id: None }
    }
    /// A tool's result for the call `id`.
    pub fn tool(id: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: Role::Tool, content: content.into(), tool_call_id: Some(id.into()), ..Self::empty() }
    }
    /// A message from the user.
    pub fn user(content: impl Into<String>) -> Self {
        Self { role: Role::User, content: content.into(), ..Self::empty() }
    }
    /// A system prompt.
    pub fn system(content: impl Into<String>) -> Self {
        Self { role: Role::System, content: content.into(), ..Self::empty() }
    }
    /// An earlier answer of the model.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self { role: Role::Assistant, content: content.into(), ..Self::empty() }
    }
}

/// Who said a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    System,
    User,
    Assistant,
    /// A tool's result (answers an assistant's tool call).
    Tool,
}

impl Role {
    /// The name chat templates expect.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A chat completion request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Model name, alias or path; `None` means the configured default.
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub sampling: SamplingParams,
    /// Upper bound on generated tokens.
    pub max_tokens: u32,
    /// Generation stops before any of these strings would be emitted.
    pub stop: Vec<String>,
    /// How long the model stays resident after this request.
    pub keep_alive: Option<KeepAlive>,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// A named conversation the daemon keeps (across restarts): its history
    /// goes before `messages`, and this exchange is appended to it.
    pub session: Option<String>,
    /// The answer must match this (structured output), enforced token by
    /// token: a token that would break it is never sampled.
    pub constraint: Option<Constraint>,
    /// Functions the model may call (rendered through its chat template);
    /// calls come back in the statistics' `tool_calls`, not as text.
    pub tools: Vec<Tool>,
    pub tool_choice: ToolChoice,
    /// A prompt sent as text, not as messages through the chat template
    /// (`messages` then stays empty): completions and fill-in-the-middle.
    pub raw: Option<RawPrompt>,
    /// Report each generated token's log-probability and this many of the
    /// likeliest alternatives (0–20) in [`GenerationStats::logprobs`].
    pub logprobs: Option<u8>,
    /// Whether the answer may be decoded several tokens per step.
    pub speculate: Speculation,
    /// A draft model (a small model with the same tokenizer) to draft with
    /// for this request, in place of the one config.toml names for the
    /// model (`[models."NAME"] draft`); loaded beside it.
    pub draft: Option<String>,
    /// The most tokens drafted a step, 1 to 8 (llama.cpp's `--draft-max`);
    /// `None`: up to 8, as the daemon chooses. Forced drafting (`Ngram`,
    /// `Draft`) grows its drafts up to it; `Auto` weighs widths up to it.
    pub draft_max: Option<u8>,
    /// How this request's keys and values are kept (quantized KV cache);
    /// each field left out takes the model's setting (`[models."NAME"]` in
    /// config.toml), else full precision.
    pub kv: KvCacheSpec,
    /// A LoRA adapter to answer under (a directory mlx-lm's trainer wrote,
    /// by its name in the models directory; on the socket also a path):
    /// loaded beside its base on first use.
    pub adapter: Option<String>,
}

/// A quantized KV cache, as mlx-lm's `kv_bits`, `kv_group_size` and
/// `quantized_kv_start` set it: affine quantization of every cached key
/// and value, per group of `group_size` values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheSpec {
    /// 8 or 4 (also 2, 3, 5, 6); 0 or 16: full precision.
    pub bits: Option<u8>,
    /// 32, 64 (the default) or 128; it must divide the model's head size.
    pub group_size: Option<u16>,
    /// Positions kept in full precision before the cache is quantized
    /// (default 0: from the first prefill chunk on).
    pub start: Option<u32>,
    /// Rotate keys and values by a Hadamard matrix before quantizing them
    /// (outlier channels spread over all; the attention is unchanged);
    /// default true; false: mlx-lm's arithmetic exactly.
    pub rotate: Option<bool>,
    /// The keys' bits when they differ from the values' (`bits`): 8-bit
    /// keys with 4-bit values keep the keys' outlier channels (llama.cpp's
    /// `-ctk q8_0 -ctv q4_0`); default: `bits`.
    pub key_bits: Option<u8>,
}

/// Speculative decoding for one request: drafted tokens verified in one
/// pass of the model. A greedy answer is the same as without it; a
/// sampled one is distributed the same.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Speculation {
    /// The daemon's setting (`speculate` in config.toml): by default,
    /// drafts where the daemon measures that they pay.
    #[default]
    Auto,
    /// One token per step.
    Off,
    /// Prompt-lookup drafts verified whenever there are any (refused with
    /// a sentence by a model that cannot verify drafts).
    Ngram,
    /// Drafts of a draft model (the request's `draft`, else the model's
    /// in config.toml) verified every step, whatever they cost (refused
    /// with a sentence where there is none).
    Draft,
}

/// The most alternatives [`GenerateRequest::logprobs`] may ask for (OpenAI's cap).
pub const MAX_TOP_LOGPROBS: u8 = 20;

/// One generated token's log-probability under the model (before
/// temperature, top-k/p and constraints), with the likeliest alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: TokenText,
    pub logprob: f32,
    /// Likeliest first.
    pub top: Vec<(TokenText, f32)>,
}

/// A token's id and its text alone (a piece of a character may decode to U+FFFD).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenText {
    pub id: u32,
    pub text: String,
}

/// An untemplated prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RawPrompt {
    /// The text (with `suffix`: the code before the gap).
    pub prefix: String,
    /// The code after the gap: the prompt is the model's fill-in-the-middle
    /// format around it (its FIM tokens), and the answer is the middle.
    pub suffix: Option<String>,
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    pub description: String,
    /// Its arguments' JSON Schema (text).
    pub parameters: String,
}

/// Whether the model must call a tool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub enum ToolChoice {
    /// The model decides.
    #[default]
    Auto,
    /// Tools are described but never called.
    None,
    /// At least one call (enforced by a grammar: it always parses and
    /// matches its schema).
    Required,
    /// A call of this function (enforced likewise).
    Function(String),
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Unique within the answer (`call_...`), for the tool's reply.
    pub id: String,
    pub name: String,
    /// Its arguments, a JSON object (text).
    pub arguments: String,
}

/// What a constrained answer must be. Schemas and grammars travel as text
/// (bincode has no JSON values); the daemon compiles them with llguidance
/// and answers `BadRequest` with its message when it cannot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Constraint {
    /// Any JSON object (OpenAI's `json_object`, ollama's `format: "json"`).
    JsonObject,
    /// JSON valid under this JSON Schema (its text).
    JsonSchema(String),
    /// Text matching this regular expression (whole answer).
    Regex(String),
    /// Text in this Lark grammar (llguidance's dialect).
    Lark(String),
}

impl GenerateRequest {
    /// A single user question with default sampling (greedy) and limits.
    pub fn ask(prompt: impl Into<String>) -> Self {
        Self {
            model: None,
            messages: vec![ChatMessage::user(prompt)],
            sampling: SamplingParams::default(),
            max_tokens: 512,
            stop: Vec::new(),
            keep_alive: None,
            ignore_eos: false,
            session: None,
            constraint: None,
            tools: Vec::new(),
            tool_choice: ToolChoice::Auto,
            raw: None,
            logprobs: None,
            speculate: Speculation::Auto,
            draft: None,
            draft_max: None,
            kv: KvCacheSpec::default(),
            adapter: None,
        }
    }
}

/// How the next token is chosen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// 1.0 disables nucleus sampling.
    pub top_p: f32,
    /// Seed for reproducible sampling; `None` draws one.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, seed: None }
    }
}

/// How long a model stays loaded after its last use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KeepAlive {
    /// Unload after this many seconds idle (0: right after the request).
    Seconds(u64),
    /// Never unload for idleness.
    Forever,
}

impl KeepAlive {
    /// Parses "30m", "90s", "2h", "0", "forever" (also "-1", as ollama users write it).
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim().to_ascii_lowercase();
        if t == "forever" || t == "-1" || t == "inf" {
            return Ok(KeepAlive::Forever);
        }
        let (digits, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
        let n: u64 =
            digits.parse().map_err(|_| format!("bad keep-alive {text:?}: expected e.g. 30m, 90s, 2h, 0 or forever"))?;
        let mult = match unit {
            "" | "s" => 1,
            "m" => 60,
            "h" => 3600,
            "d" => 86400,
            _ => return Err(format!("bad keep-alive unit in {text:?}: use s, m, h, d or forever")),
        };
        n.checked_mul(mult).map(KeepAlive::Seconds).ok_or_else(|| format!("keep-alive {text:?} is too long"))
    }
}

impl std::fmt::Display for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeepAlive::Forever => write!(f, "forever"),
            KeepAlive::Seconds(s) => write!(f, "{s}s"),
        }
    }
}

/// Why a generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// `max_tokens` was reached.
    MaxTokens,
    /// A stop string was matched.
    StopString,
    /// The context window is full.
    ContextFull,
}

/// What a finished generation measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationStats {
    pub model: String,
    pub prompt_tokens: u32,
    pub generated_tokens: u32,
    /// From the daemon receiving the request to the first token being sent.
    pub time_to_first_token_ms: f64,
    /// Time spent loading the model for this request (0 when resident).
    pub load_ms: f64,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    pub stop_reason: StopReason,
    /// Greedy/sampled token ids, for checking against reference implementations.
    pub token_ids: Vec<u32>,
    /// Media answered from the feature store (RAM or disk) / encoded now.
    pub encoder_hits: u32,
    pub encoder_misses: u32,
    /// Time in the vision tower, on the engine (0 when every image was a hit).
    pub encode_ms: f64,
    /// Time looking features up in the store.
    pub lookup_ms: f64,
    /// Time hashing, decoding and preprocessing new media (resizing,
    /// normalizing, patchifying), off the engine thread: other clients'
    /// tokens keep flowing meanwhile.
    pub preprocess_ms: f64,
    /// Prompt tokens whose KV state was reused from an earlier request
    /// (the prompt cache: RAM and disk together).
    pub prefix_tokens_reused: u32,
    /// Of those, the ones read from disk (the rest came from RAM).
    pub prompt_tokens_from_disk: u32,
    /// Prompt tokens prefilled now (the prompt less what was reused).
    pub prefill_tokens_computed: u32,
    /// Time spent in prefill proper (time to first token = queue + load + lookup + encode + prefill).
    pub prefill_ms: f64,
    /// What went wrong after the answer was complete, e.g. a session turn
    /// that could not be saved (the disk is full). Empty when all is well;
    /// clients show these and exit non-zero.
    pub warnings: Vec<String>,
    /// The tools the model called (their text is not in the stream).
    pub tool_calls: Vec<ToolCall>,
    /// The stop string that ended the answer (with [`StopReason::StopString`]).
    pub stop_string: Option<String>,
    /// Per generated token, when the request asked for them.
    pub logprobs: Vec<TokenLogprob>,
    /// Tokens proposed by speculation (prompt lookup) and verified by the
    /// model, and of those the ones it agreed with (each saved a step).
    pub draft_tokens: u32,
    pub accepted_draft_tokens: u32,
}

/// What went wrong, for callers that branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The peers speak different protocol versions.
    ProtocolMismatch,
    /// A frame could not be decoded, or was too large.
    BadFrame,
    /// The request made no sense here (e.g. Generate before Hello).
    BadRequest,
    /// The named model is not known.
    UnknownModel,
    /// The model file is missing, corrupt or unsupported.
    ModelLoad,
    /// The prompt does not fit the model's context.
    ContextOverflow,
    /// The model ran into an error while computing.
    Inference,
    /// The daemon is shutting down.
    ShuttingDown,
    /// Anything else.
    Internal,
    /// Media could not be used: not an image, corrupt, too large, a count
    /// that does not match the prompt, or a text-only model.
    BadMedia,
    /// The connecting user is not the daemon's user.
    PermissionDenied,
    /// The model does not fit the memory budget, even after unloading others.
    OutOfMemory,
    /// Every connection slot is taken by a request in flight; retry shortly.
    Busy,
    /// A model split over a group lost a rank: "rank 1 (10.0.0.2) stopped
    /// answering". The daemon keeps serving its own models; the group
    /// re-forms when the rank is back.
    RankStopped,
}

/// A model the daemon can serve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// The name to ask for.
    pub name: String,
    /// Other names that resolve to it.
    pub aliases: Vec<String>,
    /// Where it lives on disk.
    pub path: String,
    /// "gguf" or "mlx".
    pub format: String,
    pub size_bytes: u64,
    pub loaded: bool,
    /// Where it was found: "store" (the models directory), "hf-cache", "ollama", "lmstudio".
    pub source: String,
    /// What it does: "chat", "vision" (chat with images), "speech"
    /// (transcribes audio), "embedding" (embeds text) or "rerank" (orders
    /// documents by relevance to a query).
    pub capability: String,
}

/// A resident model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadedModel {
    pub name: String,
    pub architecture: String,
    pub memory_bytes: u64,
    pub keep_alive: KeepAlive,
    /// Seconds until idle unload (`None` when pinned).
    pub expires_in_s: Option<u64>,
    pub idle_s: u64,
    pub context_length: u32,
    /// Kept regardless of idleness and memory pressure (keep-alive "forever").
    pub pinned: bool,
    /// How its weights serve steps: "packed", "packed + dense copies",
    /// "packed, expanded per batched step" (the memory budget decides on
    /// CUDA), "-" for a model without that choice.
    pub batch_weights: String,
    /// How its answers speculate by default: "auto", "off", "ngram", or
    /// "-" for a model that cannot verify drafts.
    pub speculation: String,
    /// Tokens drafted by speculation over its finished generations, and
    /// of those the ones the model accepted.
    pub draft_tokens: u64,
    pub accepted_draft_tokens: u64,
    /// Adapters loaded on it.
    pub adapters: Vec<AdapterStatus>,
}

/// One fine-tune adapter resident on its base model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterStatus {
    /// Its directory's name.
    pub name: String,
    /// "LoRA" or "DoRA" (magnitude vectors too).
    pub method: String,
    /// Rank of its low-rank updates.
    pub rank: u32,
    /// Bytes of its weights.
    pub bytes: u64,
}

/// One thing the daemon let go of under memory pressure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShedEvent {
    /// Seconds since it happened.
    pub ago_s: u64,
    /// "encoder RAM tier", "prompt cache RAM tier" or "model".
    pub tier: String,
    /// What was dropped (a model's name, a count of entries).
    pub what: String,
    /// Bytes it held.
    pub freed_bytes: u64,
    /// Memory available on the machine when it was shed.
    pub available_bytes: u64,
}

/// Answer to [`Request::Status`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DaemonStatus {
    pub daemon_version: String,
    pub protocol: u32,
    pub pid: u32,
    pub uptime_s: u64,
    pub device: String,
    pub blas: String,
    pub loaded: Vec<LoadedModel>,
    /// MLX active memory.
    pub mlx_active_bytes: u64,
    /// MLX peak memory since start.
    pub mlx_peak_bytes: u64,
    /// Resident set size of the daemon process.
    pub rss_bytes: u64,
    /// Jobs waiting for the engine (not counting the running one).
    pub queued_jobs: u32,
    pub requests_served: u64,
    /// Generations abandoned because their client went away.
    pub generations_cancelled: u64,
    /// What resident models may take together.
    pub memory_budget_bytes: u64,
    /// Memory available on the machine (Linux MemAvailable), if known.
    pub available_bytes: Option<u64>,
    /// Recent memory-pressure sheds, newest last.
    pub memory_sheds: Vec<ShedEvent>,
    /// Client connections open now, and the cap in force.
    pub connections_open: u32,
    pub connections_cap: u32,
    /// Idle connections closed to make room for new ones, and connections
    /// refused because every slot had a request in flight.
    pub connections_evicted: u64,
    pub connections_refused: u64,
    /// Every request in flight on the engine, oldest first: waiting for
    /// admission, prefilling, or decoding in a batch.
    pub sequences: Vec<SequenceInfo>,
    /// Requests waiting for admission (memory or batch room).
    pub admission_queue: u32,
    /// KV bytes reserved by admitted requests (counted in the memory budget).
    pub reserved_kv_bytes: u64,
    /// Limits in force: sequences of one model at once, and waiting requests.
    pub max_batch: u32,
    pub max_queue: u32,
    /// The HTTP gateway's connections open now and its cap (0: gateway off),
    /// idle ones closed for room and ones refused (all busy).
    pub http_connections_open: u32,
    pub http_connections_cap: u32,
    pub http_connections_evicted: u64,
    pub http_connections_refused: u64,
    /// The group this daemon leads, when it is rank 0 of one.
    pub cluster: Option<ClusterStatus>,
    /// Counters since the daemon started: what `GET /metrics` exports,
    /// for `mlxbc status --json` (boxed: the status is one of the
    /// responses, which should stay small).
    pub counters: Box<Counters>,
}

/// Requests, tokens, latencies and loads since the daemon started.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Counters {
    pub requests: Vec<RequestCount>,
    pub models: Vec<ModelCounters>,
    pub http: Vec<HttpCount>,
}

/// Requests of one kind (`generate`, `embed`, `rerank`) for one model that
/// ended one way (`done`, `cancelled`, or an error kind).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestCount {
    pub kind: String,
    pub model: String,
    pub outcome: String,
    pub count: u64,
}

/// One model's tokens, latencies and loads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ModelCounters {
    pub model: String,
    pub prompt_tokens: u64,
    /// Prompt positions reused from the prompt cache.
    pub cached_prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Texts embedded (and pairs reranked), of them from the store, and their tokens.
    pub embedded_inputs: u64,
    pub embedded_from_store: u64,
    pub embedded_tokens: u64,
    pub loads: u64,
    pub load_seconds: f64,
    pub time_to_first_token: Latencies,
    pub per_token: Latencies,
}

/// A latency histogram (seconds): cumulative counts per upper bound.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Latencies {
    pub count: u64,
    pub sum_s: f64,
    /// (upper bound in seconds, observations at or below it).
    pub buckets: Vec<(f64, u64)>,
}

/// HTTP requests to one route answered with one status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HttpCount {
    pub route: String,
    pub status: u16,
    pub count: u64,
}

/// A group of daemons splitting models between them, as rank 0 sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ClusterStatus {
    /// MLX's backend: ring, jaccl, nccl, mpi.
    pub backend: String,
    /// "formed", "forming: ..." or "refused: ...".
    pub state: String,
    pub ranks: Vec<RankStatus>,
    /// Calls of split models so far and their mean time (ms), and of that
    /// the mean time rank 0 spent sending each call's plan and inputs.
    pub calls: u64,
    pub mean_call_ms: f64,
    pub mean_message_ms: f64,
    /// One all-reduce of a 4096-wide row, measured when the group formed (µs).
    pub all_sum_us: f64,
    /// How each split model is cut.
    pub models: Vec<(String, String)>,
    /// Why the group last broke.
    pub last_break: Option<String>,
}

/// One rank of a group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct RankStatus {
    pub rank: u32,
    pub host: String,
    pub rss_bytes: u64,
    /// Mean milliseconds of a split model's forward pass on the rank, its
    /// collectives included (0 before it ran one).
    pub step_ms: f64,
}

/// One request in flight, as `mlxbc ps` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequenceInfo {
    /// The engine's number for it, in arrival order.
    pub id: u64,
    pub model: String,
    /// `waiting` (for admission), `prefill` or `decode`.
    pub state: String,
    pub prompt_tokens: u32,
    pub generated_tokens: u32,
    /// Rows in the decode batch it is in (0 while not decoding).
    pub batch_size: u32,
    /// Since the daemon received it.
    pub age_ms: u64,
    /// KV bytes reserved for it (prompt plus its whole answer).
    pub reserved_kv_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_saved_when_media_was_called_images_still_loads() {
        let old = r#"{"role":"User","content":"what is this?","images":[]}"#;
        let m: ChatMessage = serde_json::from_str(old).unwrap();
        assert_eq!((m.content.as_str(), m.media.len()), ("what is this?", 0));
        let new = serde_json::to_string(&m).unwrap();
        assert!(new.contains("\"media\"") && !new.contains("\"images\""), "{new}");
    }
}
