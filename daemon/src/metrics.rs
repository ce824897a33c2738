//! What a Prometheus scraper reads at `GET /metrics` (the gateway, behind
//! its guard): counters the engine and the gateway record as requests end
//! ([`Metrics`]), and the daemon's state as `mlxbc status` has it (models,
//! memory, queue, batch, KV reserved, connections, the stores), rendered in
//! Prometheus' text exposition format ([`render`]).

use mlxbc_shared::sync::lock;
use mlxbc_shared::{CacheReport, DaemonStatus};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets.
const TTFT_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
/// Upper bounds (seconds) of the per-output-token latency histogram's buckets.
const TOKEN_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

/// A cumulative histogram with fixed buckets.
#[derive(Debug, Clone, Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, bounds: &[f64], v: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; bounds.len()];
        }
        for (c, b) in self.counts.iter_mut().zip(bounds) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

/// Per model.
#[derive(Debug, Clone, Default)]
struct ModelCounters {
    prompt_tokens: u64,
    generated_tokens: u64,
    /// Prompt positions reused from the prompt cache.
    cached_prompt_tokens: u64,
    ttft: Histogram,
    per_token: Histogram,
    embedded_inputs: u64,
    embedded_from_store: u64,
    embedded_tokens: u64,
    /// Seconds of audio in finished transcriptions.
    transcribed_audio_seconds: f64,
    loads: u64,
    load_seconds: f64,
}

#[derive(Debug, Default)]
struct Inner {
    /// Generations and embedding requests by (kind, model, outcome).
    requests: BTreeMap<(&'static str, String, String), u64>,
    models: BTreeMap<String, ModelCounters>,
    /// HTTP requests by (route, status code).
    http: BTreeMap<(String, u16), u64>,
}

/// Counters the engine and the gateway record into; shared by both.
#[derive(Debug, Default)]
pub struct Metrics(Mutex<Inner>);

impl Metrics {
    /// A generation ended: `outcome` is "done", "cancelled" or an error kind.
    pub fn generation(&self, model: &str, outcome: &str, stats: Option<&mlxbc_shared::GenerationStats>) {
        let mut m = lock(&self.0);
        *m.requests.entry(("generate", model.to_string(), outcome.to_string())).or_default() += 1;
        let Some(s) = stats else { return };
        let c = m.models.entry(model.to_string()).or_default();
        c.prompt_tokens += u64::from(s.prompt_tokens);
        c.generated_tokens += u64::from(s.generated_tokens);
        c.cached_prompt_tokens += u64::from(s.prefix_tokens_reused);
        if s.generated_tokens > 0 {
            c.ttft.observe(TTFT_BUCKETS, s.time_to_first_token_ms / 1000.0);
        }
        if s.decode_tokens_per_s > 0.0 {
            c.per_token.observe(TOKEN_BUCKETS, 1.0 / s.decode_tokens_per_s);
        }
    }

    /// An embedding request ended.
    /// `api` is "embed" or "rerank".
    pub fn embedding(&self, api: &'static str, model: &str, outcome: &str, done: Option<&mlxbc_shared::Embeddings>) {
        let mut m = lock(&self.0);
        *m.requests.entry((api, model.to_string(), outcome.to_string())).or_default() += 1;
        if let Some(e) = done {
            let c = m.models.entry(model.to_string()).or_default();
            c.embedded_inputs += e.vectors.len() as u64;
            c.embedded_from_store += u64::from(e.cached);
            c.embedded_tokens += e.prompt_tokens;
        }
    }

    /// A transcription ended: `outcome` as for a generation; the audio's
    /// length when it was transcribed.
    pub fn transcription(&self, model: &str, outcome: &str, audio_seconds: Option<f64>) {
        let mut m = lock(&self.0);
        *m.requests.entry(("transcribe", model.to_string(), outcome.to_string())).or_default() += 1;
        if let Some(seconds) = audio_seconds {
            m.models.entry(model.to_string()).or_default().transcribed_audio_seconds += seconds;
        }
    }

    /// A model was loaded in `ms`.
    pub fn load(&self, model: &str, ms: f64) {
        let mut m = lock(&self.0);
        let c = m.models.entry(model.to_string()).or_default();
        c.loads += 1;
        c.load_seconds += ms / 1000.0;
    }

    /// The gateway answered `route` with `status`.
    pub fn http(&self, route: &str, status: u16) {
        *lock(&self.0).http.entry((route.to_string(), status)).or_default() += 1;
    }

    /// Every counter, as `mlxbc status --json` shows them.
    pub fn counters(&self) -> mlxbc_shared::Counters {
        use mlxbc_shared::{HttpCount, Latencies, ModelCounters as Counted, RequestCount};
        let latencies = |bounds: &[f64], h: &Histogram| Latencies {
            count: h.count,
            sum_s: h.sum,
            buckets: bounds.iter().copied().zip(h.counts.iter().copied().chain(std::iter::repeat(0))).collect(),
        };
        let m = lock(&self.0);
        mlxbc_shared::Counters {
            requests: m
                .requests
                .iter()
                .map(|((kind, model, outcome), &count)| RequestCount {
                    kind: kind.to_string(),
                    model: model.clone(),
                    outcome: outcome.clone(),
                    count,
                })
                .collect(),
            models: m
                .models
                .iter()
                .map(|(model, c)| Counted {
                    model: model.clone(),
                    prompt_tokens: c.prompt_tokens,
                    cached_prompt_tokens: c.cached_prompt_tokens,
                    generated_tokens: c.generated_tokens,
                    embedded_inputs: c.embedded_inputs,
                    embedded_from_store: c.embedded_from_store,
                    embedded_tokens: c.embedded_tokens,
                    loads: c.loads,
                    load_seconds: c.load_seconds,
                    time_to_first_token: latencies(TTFT_BUCKETS, &c.ttft),
                    per_token: latencies(TOKEN_BUCKETS, &c.per_token),
                })
                .collect(),
            http: m
                .http
                .iter()
                .map(|((route, status), &count)| HttpCount { route: route.clone(), status: *status, count })
                .collect(),
        }
    }
}

/// A per-model counter: its name, help, and how to read it.
type PerModel = (&'static str, &'static str, fn(&ModelCounters) -> f64);

/// A label value, escaped as the text format asks.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// One metric family's `# HELP` and `# TYPE` lines.
fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn histogram(out: &mut String, name: &str, model: &str, bounds: &[f64], h: &Histogram) {
    let m = label(model);
    for (b, c) in bounds.iter().zip(&h.counts) {
        let _ = writeln!(out, "{name}_bucket{{model=\"{m}\",le=\"{b}\"}} {c}");
    }
    let _ = writeln!(out, "{name}_bucket{{model=\"{m}\",le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum{{model=\"{m}\"}} {}", h.sum);
    let _ = writeln!(out, "{name}_count{{model=\"{m}\"}} {}", h.count);
}

/// The exposition: the counters, then the state.
pub fn render(metrics: &Metrics, status: &DaemonStatus, store: Option<&CacheReport>) -> String {
    let mut out = String::new();
    let m = lock(&metrics.0);
    family(
        &mut out,
        "mlxbc_requests_total",
        "counter",
        "Generations, embedding, reranking and transcription requests by kind, model and outcome.",
    );
    for ((kind, model, outcome), n) in &m.requests {
        let _ = writeln!(
            out,
            "mlxbc_requests_total{{kind=\"{kind}\",model=\"{}\",outcome=\"{}\"}} {n}",
            label(model),
            label(outcome)
        );
    }
    let per_model: [PerModel; 10] = [
        ("mlxbc_prompt_tokens_total", "Prompt tokens of finished generations.", |c| c.prompt_tokens as f64),
        ("mlxbc_generated_tokens_total", "Tokens generated.", |c| c.generated_tokens as f64),
        ("mlxbc_cached_prompt_tokens_total", "Prompt tokens reused from the prompt cache.", |c| {
            c.cached_prompt_tokens as f64
        }),
        ("mlxbc_embedded_inputs_total", "Texts embedded (from the store or computed).", |c| c.embedded_inputs as f64),
        ("mlxbc_embedded_from_store_total", "Texts whose vectors came from the store.", |c| {
            c.embedded_from_store as f64
        }),
        ("mlxbc_embedded_tokens_total", "Tokens of embedded texts.", |c| c.embedded_tokens as f64),
        ("mlxbc_transcribed_audio_seconds_total", "Seconds of audio transcribed.", |c| c.transcribed_audio_seconds),
        ("mlxbc_model_loads_total", "Model loads.", |c| c.loads as f64),
        ("mlxbc_model_load_seconds_total", "Time spent loading models.", |c| c.load_seconds),
        ("mlxbc_generations_timed_total", "Generations in the latency histograms.", |c| c.ttft.count as f64),
    ];
    for (name, help, get) in per_model {
        family(&mut out, name, "counter", help);
        for (model, c) in &m.models {
            let _ = writeln!(out, "{name}{{model=\"{}\"}} {}", label(model), get(c));
        }
    }
    family(&mut out, "mlxbc_time_to_first_token_seconds", "histogram", "Time to first token, by model.");
    for (model, c) in m.models.iter().filter(|(_, c)| c.ttft.count > 0) {
        histogram(&mut out, "mlxbc_time_to_first_token_seconds", model, TTFT_BUCKETS, &c.ttft);
    }
    family(
        &mut out,
        "mlxbc_time_per_output_token_seconds",
        "histogram",
        "Decode time per token (a generation's mean), by model.",
    );
    for (model, c) in m.models.iter().filter(|(_, c)| c.per_token.count > 0) {
        histogram(&mut out, "mlxbc_time_per_output_token_seconds", model, TOKEN_BUCKETS, &c.per_token);
    }
    family(&mut out, "mlxbc_http_requests_total", "counter", "Gateway requests by route and status code.");
    for ((route, code), n) in &m.http {
        let _ = writeln!(out, "mlxbc_http_requests_total{{route=\"{}\",code=\"{code}\"}} {n}", label(route));
    }
    drop(m);
    state(&mut out, status, store);
    out
}

/// Gauges (and the daemon's own counters) of `status` and the store.
fn state(out: &mut String, s: &DaemonStatus, store: Option<&CacheReport>) {
    let gauges: [(&str, &str, f64); 14] = [
        ("mlxbc_uptime_seconds", "Seconds since the daemon started.", s.uptime_s as f64),
        ("mlxbc_queued_jobs", "Jobs waiting for the engine.", f64::from(s.queued_jobs)),
        ("mlxbc_admission_queue", "Generations waiting for batch room or memory.", f64::from(s.admission_queue)),
        ("mlxbc_batch_sequences", "Sequences being generated.", s.sequences.len() as f64),
        ("mlxbc_max_batch", "Most sequences in one batch.", f64::from(s.max_batch)),
        ("mlxbc_reserved_kv_bytes", "KV memory reserved for admitted generations.", s.reserved_kv_bytes as f64),
        ("mlxbc_memory_budget_bytes", "The models' memory budget.", s.memory_budget_bytes as f64),
        ("mlxbc_mlx_active_bytes", "Memory MLX holds in arrays.", s.mlx_active_bytes as f64),
        ("mlxbc_mlx_peak_bytes", "MLX's peak memory.", s.mlx_peak_bytes as f64),
        ("mlxbc_resident_bytes", "The daemon's resident set.", s.rss_bytes as f64),
        ("mlxbc_connections_open", "Socket connections open.", f64::from(s.connections_open)),
        ("mlxbc_http_connections_open", "Gateway connections open.", f64::from(s.http_connections_open)),
        ("mlxbc_requests_served_total", "Jobs the engine has served.", s.requests_served as f64),
        ("mlxbc_generations_cancelled_total", "Generations whose client left.", s.generations_cancelled as f64),
    ];
    for (name, help, v) in gauges {
        let kind = if name.ends_with("_total") { "counter" } else { "gauge" };
        family(out, name, kind, help);
        let _ = writeln!(out, "{name} {v}");
    }
    family(out, "mlxbc_model_memory_bytes", "gauge", "Memory each resident model took at load.");
    for m in &s.loaded {
        let _ = writeln!(out, "mlxbc_model_memory_bytes{{model=\"{}\"}} {}", label(&m.name), m.memory_bytes);
    }
    family(out, "mlxbc_draft_tokens_total", "counter", "Tokens drafted by speculation, by target model.");
    for m in &s.loaded {
        let _ = writeln!(out, "mlxbc_draft_tokens_total{{model=\"{}\"}} {}", label(&m.name), m.draft_tokens);
    }
    family(out, "mlxbc_accepted_draft_tokens_total", "counter", "Drafted tokens the model accepted.");
    for m in &s.loaded {
        let _ = writeln!(
            out,
            "mlxbc_accepted_draft_tokens_total{{model=\"{}\"}} {}",
            label(&m.name),
            m.accepted_draft_tokens
        );
    }
    let Some(c) = store else { return };
    let stores: [(&str, &str, &str, f64); 14] = [
        ("mlxbc_store_hits_total", "counter", "tier=\"ram\"", c.ram_hits as f64),
        ("mlxbc_store_hits_total", "counter", "tier=\"disk\"", c.disk_hits as f64),
        ("mlxbc_store_misses_total", "counter", "", c.misses as f64),
        ("mlxbc_store_evictions_total", "counter", "", c.evictions as f64),
        ("mlxbc_store_entries", "gauge", "tier=\"disk\"", c.entries as f64),
        ("mlxbc_store_entries", "gauge", "tier=\"ram\"", c.ram_entries as f64),
        ("mlxbc_store_bytes", "gauge", "tier=\"disk\"", c.disk_bytes as f64),
        ("mlxbc_store_bytes", "gauge", "tier=\"ram\"", c.ram_bytes as f64),
        ("mlxbc_prompt_cache_hit_tokens_total", "counter", "tier=\"ram\"", c.prompts.ram_hit_tokens as f64),
        ("mlxbc_prompt_cache_hit_tokens_total", "counter", "tier=\"disk\"", c.prompts.disk_hit_tokens as f64),
        ("mlxbc_prompt_cache_evictions_total", "counter", "tier=\"ram\"", c.prompts.ram_evictions as f64),
        ("mlxbc_prompt_cache_evictions_total", "counter", "tier=\"disk\"", c.prompts.disk_evictions as f64),
        ("mlxbc_prompt_cache_bytes", "gauge", "tier=\"ram\"", c.prompts.ram_bytes as f64),
        ("mlxbc_prompt_cache_bytes", "gauge", "tier=\"disk\"", c.prompts.disk_bytes as f64),
    ];
    let mut seen = std::collections::BTreeSet::new();
    for (name, kind, labels, v) in stores {
        if seen.insert(name) {
            let help = match name {
                n if n.starts_with("mlxbc_prompt_cache") => "The prompt cache (KV blocks of prompt prefixes), by tier.",
                _ => "The feature store (encoder features and embeddings), by tier.",
            };
            family(out, name, kind, help);
        }
        let labels = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}{labels} {v}");
    }
}
