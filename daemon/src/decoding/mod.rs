//! Per-token decoding policy, applied to each sequence's logits and text
//! on the engine thread, and checked off it when a request arrives:
//! sampling, stop strings, log-probabilities, grammar constraints
//! (llguidance), the tool-call filter and prompt-lookup drafts.

pub mod constraint;
pub mod logprobs;
pub mod lookup;
pub mod sampling;
pub mod stop;
pub mod tools;
