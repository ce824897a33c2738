//! Vision: media decoding and preprocessing, and the vision towers whose
//! outputs the feature store keeps.

pub mod gemma3_projector;
pub mod gemma3_vlm;
pub mod image;
pub mod loader;
pub mod mrope;
pub mod qwen25_vl;
pub mod qwen25_vl_tower;
pub mod siglip;
