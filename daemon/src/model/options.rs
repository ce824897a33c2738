//! The daemon's diagnostic switches, read once at start (config.toml's
//! `weights`, `decode`, `fuse`, each overridden by its environment
//! variable) and passed down, so that nothing below reads the environment
//! (it used to be read per request inside the layers, the decode step and
//! the weight loader):
//!
//! - `MLXBC_WEIGHTS=dense|packed`: force the weight form (default: the
//!   device's fastest; docs/benchmarks.md "Compute dtype"),
//! - `MLXBC_DECODE=eager|compiled`: force how decode steps are built,
//! - `MLXBC_FUSE=0|dense`: keep q/k/v and gate/up projections separate
//!   (all of them, or the quantized ones),
//! - `MLXBC_BATCH_WEIGHTS=packed|dense|expand`: how quantized matrices serve
//!   steps of several rows (default: dense copies on CUDA where the memory
//!   budget holds them, else expanded per step; packed elsewhere:
//!   [`BatchWeights`]),
//! - `MLXBC_BATCH_ATTENTION=auto|mask`: how a padded batch's decode step
//!   attends (default: mlxbc's own kernel on CUDA, the padding mask
//!   elsewhere: [`crate::model::batch_attention`]),
//! - `MLXBC_W4A16_ROWS=N`: on CUDA, 4-bit steps of up to N rows read the
//!   packed weights through mlxbc's own kernel (default
//!   [`crate::model::w4a16::DEFAULT_ROWS`]: 4; 0: never),
//! - `MLXBC_SPLIT_PARTS=copy|views`: whether a fused projection's parts are
//!   copied for steps of several rows ([`SplitParts`]),
//! - `MLXBC_DRAFT_ROWS=together|apart`: whether a decode batch's rows with
//!   one draft model draft in one batch of it (the default) or each alone
//!   ([`DraftRows`]).

use crate::model::batch_attention::BatchAttention;
use crate::model::decode_step::DecodeMode;
use crate::model::layers::{BatchWeights, SplitParts};
use crate::model::weights::WeightForm;

/// Which projections may be fused into one matmul.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Fusion {
    /// Whenever the parts share a form.
    #[default]
    All,
    /// Dense parts only.
    DenseOnly,
    /// Never.
    Off,
}

/// How models are loaded: the weights' form, the fusion policy, and the
/// part of the model this process holds when it is split over a group.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelOptions {
    pub form: WeightForm,
    pub fusion: Fusion,
    /// How quantized matrices serve batched steps (chosen per load by the
    /// device and the memory budget: `engine::residency`).
    pub batch: BatchWeights,
    /// `Some`: load only this rank's shard (tensor parallel).
    pub shard: Option<crate::distributed::Shard>,
}

impl From<WeightForm> for ModelOptions {
    fn from(form: WeightForm) -> Self {
        Self { form, fusion: Fusion::All, batch: BatchWeights::Packed, shard: None }
    }
}

/// Everything the environment may force, read once.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineOptions {
    /// Force this weight form (None: the device's fastest).
    pub weights: Option<WeightForm>,
    /// Force this decode step (None: the device's measured best).
    pub decode: Option<DecodeMode>,
    pub fusion: Fusion,
    /// Force how quantized matrices serve batches (None: the device's choice, [`BatchWeights::for_device`]).
    pub batch: Option<BatchWeights>,
    /// How padded batches attend in decode steps.
    pub attention: BatchAttention,
    /// Whether greedy sequences draft from their history.
    pub speculate: Speculate,
    /// Steps of up to this many rows use the W4A16 kernel on CUDA (0:
    /// never; None: [`crate::model::w4a16::DEFAULT_ROWS`]).
    pub w4a16_rows: Option<i32>,
    /// Whether fused projections' parts are copied for steps of several rows.
    pub split_parts: SplitParts,
    /// Whether a batch's rows with one draft model draft together.
    pub draft_rows: DraftRows,
    /// The shortest prompt-lookup match `auto` drafts from
    /// (`MLXBC_LOOKUP_SHORTEST`, 1-3; `None`: `decoding::lookup`'s default).
    pub lookup_shortest: Option<usize>,
}

/// How a decode batch's rows with one draft model are drafted
/// (`crate::engine::draft_batch`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DraftRows {
    /// In one batch of the draft model.
    #[default]
    Together,
    /// Each row alone (`MLXBC_DRAFT_ROWS=apart`: a diagnostic).
    Apart,
}

/// Whether sequences draft from their own history by default
/// (`crate::decoding::lookup`; a request may say otherwise).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Speculate {
    /// Prompt-lookup drafts where the measured costs of a verify pass and
    /// a plain step and the sequence's acceptance say they pay.
    #[default]
    Auto,
    /// One token per step (`MLXBC_SPECULATE=off`).
    Off,
    /// Prompt-lookup drafts verified every step there are any, whatever
    /// they cost (`MLXBC_SPECULATE=ngram`).
    Ngram,
    /// A draft model's drafts verified every step, whatever they cost
    /// (`MLXBC_SPECULATE=draft`; models with no draft model: `Auto`).
    Draft,
}

impl BatchWeights {
    /// `forced`, else what the device wants: dense copies on CUDA, whose
    /// quantized matmul does not batch (the memory budget may still turn
    /// them into [`BatchWeights::Expand`] at load); packed on Metal and CPU,
    /// whose quantized kernels batch.
    pub fn for_device(forced: Option<BatchWeights>) -> Self {
        forced.unwrap_or(if cuda_available() { BatchWeights::Dense } else { BatchWeights::Packed })
    }
}

/// True when MLX runs on CUDA (the CUDA `libmlx` is the one loaded).
pub fn cuda_available() -> bool {
    let mut yes = false;
    // SAFETY: writes one bool.
    let rc = unsafe { mlx_sys::mlx_cuda_is_available(&mut yes) };
    rc == 0 && yes
}

impl EngineOptions {
    /// The switches from `settings` (config.toml), each overridden by its
    /// environment variable; a value that is none of the documented ones is
    /// an error that names where it came from.
    pub fn from_settings_and_env(settings: &mlxbc_shared::settings::Settings) -> Result<Self, String> {
        Self::read(&[
            ("weights", settings.weights.clone()),
            ("decode", settings.decode.clone()),
            ("fuse", settings.fuse.clone()),
            ("batch_weights", settings.batch_weights.clone()),
            ("batch_attention", settings.batch_attention.clone()),
            ("speculate", settings.speculate.clone()),
        ])
    }

    fn read(file: &[(&str, Option<String>); 6]) -> Result<Self, String> {
        let var = |name: &str, key: &str| -> Option<(String, String)> {
            match std::env::var(name).ok().filter(|v| !v.is_empty()) {
                Some(v) => Some((name.to_string(), v)),
                None => file
                    .iter()
                    .find(|(k, _)| *k == key)
                    .and_then(|(_, v)| v.clone())
                    .map(|v| (format!("config.toml {key}"), v)),
            }
        };
        let bad = |(from, v): &(String, String), want: &str| format!("{from} = {v:?} is not one of {want}");
        let weights = match var("MLXBC_WEIGHTS", "weights") {
            None => None,
            Some((_, v)) if v == "dense" => Some(WeightForm::DenseF32),
            Some((_, v)) if v == "packed" => Some(WeightForm::Packed(mlx_rs::Dtype::Float16)),
            Some(other) => return Err(bad(&other, "dense, packed")),
        };
        let decode = match var("MLXBC_DECODE", "decode") {
            None => None,
            Some((_, v)) if v == "eager" => Some(DecodeMode::Eager),
            Some((_, v)) if v == "compiled" => Some(DecodeMode::Compiled),
            Some(other) => return Err(bad(&other, "eager, compiled")),
        };
        let fusion = match var("MLXBC_FUSE", "fuse") {
            None => Fusion::All,
            Some((_, v)) if v == "1" => Fusion::All,
            Some((_, v)) if v == "dense" => Fusion::DenseOnly,
            Some((_, v)) if v == "0" => Fusion::Off,
            Some(other) => return Err(bad(&other, "0, dense, 1")),
        };
        let batch = match var("MLXBC_BATCH_WEIGHTS", "batch_weights") {
            None => None,
            Some((_, v)) if v == "packed" => Some(BatchWeights::Packed),
            Some((_, v)) if v == "dense" => Some(BatchWeights::Dense),
            Some((_, v)) if v == "expand" => Some(BatchWeights::Expand),
            Some(other) => return Err(bad(&other, "packed, dense, expand")),
        };
        let attention = match var("MLXBC_BATCH_ATTENTION", "batch_attention") {
            None => BatchAttention::Auto,
            Some((_, v)) if v == "auto" => BatchAttention::Auto,
            Some((_, v)) if v == "mask" => BatchAttention::Mask,
            Some(other) => return Err(bad(&other, "auto, mask")),
        };
        let speculate = match var("MLXBC_SPECULATE", "speculate") {
            None => Speculate::Auto,
            Some((_, v)) if v == "auto" => Speculate::Auto,
            Some((_, v)) if v == "off" => Speculate::Off,
            Some((_, v)) if v == "ngram" => Speculate::Ngram,
            Some((_, v)) if v == "draft" => Speculate::Draft,
            Some(other) => return Err(bad(&other, "auto, off, ngram, draft")),
        };
        let w4a16_rows =
            env_number("MLXBC_W4A16_ROWS", |n| (0..=16).contains(&n), "a number from 0 to 16")?.map(|n| n as i32);
        let lookup_shortest =
            env_number("MLXBC_LOOKUP_SHORTEST", |n| (1..=3).contains(&n), "1, 2 or 3")?.map(|n| n as usize);
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty()).map(|v| (name.to_string(), v));
        let split_parts = match env("MLXBC_SPLIT_PARTS") {
            None => SplitParts::default(),
            Some((_, v)) if v == "copy" => SplitParts::Copy,
            Some((_, v)) if v == "views" => SplitParts::Views,
            Some(other) => return Err(bad(&other, "copy, views")),
        };
        let draft_rows = match env("MLXBC_DRAFT_ROWS") {
            None => Default::default(),
            Some((_, v)) if v == "together" => DraftRows::Together,
            Some((_, v)) if v == "apart" => DraftRows::Apart,
            Some(other) => return Err(bad(&other, "together, apart")),
        };
        Ok(Self {
            weights,
            decode,
            fusion,
            batch,
            attention,
            speculate,
            w4a16_rows,
            split_parts,
            draft_rows,
            lookup_shortest,
        })
    }
}

/// The environment's `name` as a number that `ok` accepts (`want` says
/// which, in the error), if it is set.
fn env_number(name: &str, ok: impl Fn(i64) -> bool, want: &str) -> Result<Option<i64>, String> {
    match std::env::var(name).ok().filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => match v.parse::<i64>() {
            Ok(n) if ok(n) => Ok(Some(n)),
            _ => Err(format!("{name} = {v:?} is not {want}")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(weights: Option<&str>, decode: Option<&str>) -> mlxbc_shared::settings::Settings {
        let home = std::env::temp_dir().join(format!("mlxbc-options-{}", std::process::id()));
        let paths = mlxbc_shared::paths::Paths::under(home);
        let mut s = mlxbc_shared::settings::Settings::load(paths).unwrap();
        s.weights = weights.map(String::from);
        s.decode = decode.map(String::from);
        s
    }

    /// One test: the environment is the process's, shared by threads.
    #[test]
    fn config_values_are_used_and_the_environment_overrides_them() {
        for v in [
            "MLXBC_WEIGHTS",
            "MLXBC_DECODE",
            "MLXBC_FUSE",
            "MLXBC_BATCH_WEIGHTS",
            "MLXBC_BATCH_ATTENTION",
            "MLXBC_SPECULATE",
            "MLXBC_W4A16_ROWS",
            "MLXBC_SPLIT_PARTS",
            "MLXBC_DRAFT_ROWS",
            "MLXBC_LOOKUP_SHORTEST",
        ] {
            std::env::remove_var(v);
        }
        let o = EngineOptions::from_settings_and_env(&settings(Some("dense"), Some("eager"))).unwrap();
        assert_eq!((o.weights, o.decode), (Some(WeightForm::DenseF32), Some(DecodeMode::Eager)));
        std::env::set_var("MLXBC_DECODE", "compiled");
        let o = EngineOptions::from_settings_and_env(&settings(Some("dense"), Some("eager"))).unwrap();
        assert_eq!(o.decode, Some(DecodeMode::Compiled), "the environment wins");
        std::env::remove_var("MLXBC_DECODE");
        let e = EngineOptions::from_settings_and_env(&settings(Some("fast"), None)).unwrap_err();
        assert!(e.contains("config.toml weights") && e.contains("dense, packed"), "{e}");
        assert_eq!(EngineOptions::from_settings_and_env(&settings(None, None)).unwrap(), EngineOptions::default());
        std::env::set_var("MLXBC_BATCH_WEIGHTS", "expand");
        let o = EngineOptions::from_settings_and_env(&settings(None, None)).unwrap();
        assert_eq!(o.batch, Some(BatchWeights::Expand));
        std::env::set_var("MLXBC_BATCH_WEIGHTS", "wide");
        let e = EngineOptions::from_settings_and_env(&settings(None, None)).unwrap_err();
        assert!(e.contains("MLXBC_BATCH_WEIGHTS") && e.contains("packed, dense, expand"), "{e}");
        std::env::remove_var("MLXBC_BATCH_WEIGHTS");
        std::env::set_var("MLXBC_W4A16_ROWS", "0");
        assert_eq!(EngineOptions::from_settings_and_env(&settings(None, None)).unwrap().w4a16_rows, Some(0));
        std::env::set_var("MLXBC_W4A16_ROWS", "99");
        let e = EngineOptions::from_settings_and_env(&settings(None, None)).unwrap_err();
        assert!(e.contains("MLXBC_W4A16_ROWS") && e.contains("0 to 16"), "{e}");
        std::env::remove_var("MLXBC_W4A16_ROWS");
        std::env::set_var("MLXBC_LOOKUP_SHORTEST", "1");
        assert_eq!(EngineOptions::from_settings_and_env(&settings(None, None)).unwrap().lookup_shortest, Some(1));
        std::env::set_var("MLXBC_LOOKUP_SHORTEST", "4");
        let e = EngineOptions::from_settings_and_env(&settings(None, None)).unwrap_err();
        assert!(e.contains("MLXBC_LOOKUP_SHORTEST") && e.contains("1, 2 or 3"), "{e}");
        std::env::remove_var("MLXBC_LOOKUP_SHORTEST");
        std::env::set_var("MLXBC_BATCH_ATTENTION", "mask");
        let o = EngineOptions::from_settings_and_env(&settings(None, None)).unwrap();
        assert_eq!(o.attention, BatchAttention::Mask);
        std::env::set_var("MLXBC_BATCH_ATTENTION", "flash");
        let e = EngineOptions::from_settings_and_env(&settings(None, None)).unwrap_err();
        assert!(e.contains("MLXBC_BATCH_ATTENTION") && e.contains("auto, mask"), "{e}");
        std::env::remove_var("MLXBC_BATCH_ATTENTION");
        std::env::set_var("MLXBC_SPECULATE", "ngram");
        let o = EngineOptions::from_settings_and_env(&settings(None, None)).unwrap();
        assert_eq!(o.speculate, Speculate::Ngram);
        std::env::set_var("MLXBC_SPECULATE", "eagle");
        let e = EngineOptions::from_settings_and_env(&settings(None, None)).unwrap_err();
        assert!(e.contains("MLXBC_SPECULATE") && e.contains("auto, off, ngram"), "{e}");
        std::env::remove_var("MLXBC_SPECULATE");
        assert_eq!(EngineOptions::from_settings_and_env(&settings(None, None)).unwrap().split_parts, SplitParts::Views);
        std::env::set_var("MLXBC_SPLIT_PARTS", "copy");
        let o = EngineOptions::from_settings_and_env(&settings(None, None)).unwrap();
        assert_eq!(o.split_parts, SplitParts::Copy);
        std::env::set_var("MLXBC_SPLIT_PARTS", "some");
        let e = EngineOptions::from_settings_and_env(&settings(None, None)).unwrap_err();
        assert!(e.contains("MLXBC_SPLIT_PARTS") && e.contains("copy, views"), "{e}");
        std::env::remove_var("MLXBC_SPLIT_PARTS");
        assert!(!cuda_available(), "this test runs on the CPU build");
    }
}
