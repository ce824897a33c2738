//! Audio for the speech families (Whisper): files decoded and resampled to
//! 16 kHz mono ([`decode`]), and Whisper's log-mel frontend ([`mel`]).

pub mod decode;
pub mod mel;
