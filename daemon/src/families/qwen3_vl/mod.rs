//! Qwen3-VL: a Qwen3 decoder (the llama family's, with interleaved
//! multimodal rope and deepstack injection) and its own vision tower
//! (`tower`); as mlx-vlm's `qwen3_vl` package. Preprocessing and rope
//! positions are Qwen2.5-VL's (`crate::families::qwen2_5_vl`) with 16-pixel
//! patches.

pub mod tower;
