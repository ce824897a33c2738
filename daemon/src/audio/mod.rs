//! Audio for the speech families (Whisper): the log-mel frontend. Decoding
//! files and resampling come next (issue "It hears").

pub mod mel;
