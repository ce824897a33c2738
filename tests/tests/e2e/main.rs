//! End-to-end tests: the real mlxbcd binary on a temp socket with real
//! SmolLM2 weights (and the fixture models), driven through the client
//! library, the `mlxbc` CLI, and raw frames.

mod bad_input;
mod batching;
mod cli;
mod clients;
mod cluster;
mod crash_soak;
mod embeddings;
mod faults;
mod gemma4;
mod generation;
mod helper;
mod hostile;
mod hostile_gateway;
mod http;
mod kv_quantized;
mod lifecycle;
mod lora;
mod neighbour;
mod prompt_cache;
mod pull;
mod qwen3_5;
mod reference;
mod residency;
mod service;
mod speculation;
mod speech;
mod video;
mod vision;
