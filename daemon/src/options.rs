//! The daemon's diagnostic switches, read once at start and passed down,
//! so that nothing below reads the environment (it used to be read per
//! request inside the layers, the decode step and the weight loader):
//!
//! - `MLXBC_WEIGHTS=dense|packed`: force the weight form (default: the
//!   device's fastest; README "Compute dtype"),
//! - `MLXBC_DECODE=eager|compiled`: force how decode steps are built,
//! - `MLXBC_FUSE=0|dense`: keep q/k/v and gate/up projections separate
//!   (all of them, or the quantized ones).

use crate::model::decode_step::DecodeMode;
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

/// How models are loaded: the weights' form and the fusion policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelOptions {
    pub form: WeightForm,
    pub fusion: Fusion,
}

impl From<WeightForm> for ModelOptions {
    fn from(form: WeightForm) -> Self {
        Self { form, fusion: Fusion::All }
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
}

impl EngineOptions {
    /// Reads `MLXBC_WEIGHTS`, `MLXBC_DECODE`, `MLXBC_FUSE`; a value that is
    /// none of the documented ones is an error that names it.
    pub fn from_env() -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let bad = |name: &str, v: &str, want: &str| format!("{name}={v:?} is not one of {want}");
        let weights = match var("MLXBC_WEIGHTS").as_deref() {
            None => None,
            Some("dense") => Some(WeightForm::DenseF32),
            Some("packed") => Some(WeightForm::Packed(mlx_rs::Dtype::Float16)),
            Some(v) => return Err(bad("MLXBC_WEIGHTS", v, "dense, packed")),
        };
        let decode = match var("MLXBC_DECODE").as_deref() {
            None => None,
            Some("eager") => Some(DecodeMode::Eager),
            Some("compiled") => Some(DecodeMode::Compiled),
            Some(v) => return Err(bad("MLXBC_DECODE", v, "eager, compiled")),
        };
        let fusion = match var("MLXBC_FUSE").as_deref() {
            None | Some("1") => Fusion::All,
            Some("dense") => Fusion::DenseOnly,
            Some("0") => Fusion::Off,
            Some(v) => return Err(bad("MLXBC_FUSE", v, "0, dense, 1")),
        };
        Ok(Self { weights, decode, fusion })
    }
}
