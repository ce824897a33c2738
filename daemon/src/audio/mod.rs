//! Audio for the speech families (Whisper): files decoded and resampled to
//! 16 kHz mono ([`decode`]), and Whisper's log-mel frontend ([`mel`]).

pub mod decode;
pub mod mel;

/// A recording ready for the engine: its samples (when sent; `None` when
/// the store holds its encoder outputs) and its length in mel frames (10 ms each).
pub struct AudioInput {
    pub samples: Option<std::sync::Arc<Vec<f32>>>,
    pub frames: usize,
}
