//! What mlxbcd and its clients agree on: the wire protocol, the framing codec,
//! where files live, and the settings file. No MLX here, so the client library
//! that editors and shells embed stays thin and builds in seconds.

pub mod codec;
#[cfg(feature = "fuzz")]
pub mod fuzz;
pub mod paths;
pub mod protocol;
pub mod settings;
pub mod subtitles;
pub mod sync;

pub use codec::{FrameError, WireCodec, MAX_FRAME_BYTES};
pub use protocol::*;
