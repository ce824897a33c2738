//! What both front doors (the socket server and the HTTP gateway) do with
//! a request before the engine sees it: check its bounds (`validate`) and
//! prepare it off the engine thread (`prepare`). Depends on the engine
//! only, so `server`, `http` and `state` all build on it without circles.

pub mod prepare;
pub mod transcribe;
pub mod validate;
