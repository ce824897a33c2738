//! Model lookup: which model a name means (`registry`: the default, plain
//! names, paths, aliases) and where models live on this machine
//! (`discovery`: the pull store, Hugging Face's cache, LM Studio's and
//! ollama's). Used by connections, the gateway and the engine alike; it
//! loads nothing.

pub mod discovery;
pub mod registry;
