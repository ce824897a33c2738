//! The daemon's numerics tests, one binary (each integration-test binary
//! links libmlx): the kit and every family against the reference
//! implementations on identical weights (mlx-lm, mlx-vlm, mlx-whisper,
//! llama.cpp's GGUF blocks), loaded in process without a daemon. The
//! end-to-end suite, through a real daemon, is `tests/tests/e2e/`.

mod common;

mod batch_rows;
mod draft_batch;
mod dtype_dirs;
mod embeddings;
mod gemma4;
mod gemma4_unified;
mod gguf_reader;
mod qwen3_5;
mod stream_decoder;
mod tokenizer_and_template;
mod vision_towers;
mod whisper_frontend;
mod whisper_reference;
