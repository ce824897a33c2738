//! A model split over a group of daemons (tensor parallel over MLX's
//! distributed backends), and everything around it: rank 0's
//! [`Coordinator`] (forming the group, sending each call's plan, the
//! watchdog), its [`ShardedLm`] (the engine's view of a split model), the
//! [`plan`] every call sends, and the [`worker`] loop of the ranks above 0.
//! docs/distributed.md is the user's guide and the design.
//!
//! The split itself is the family's (`families::llama` cuts its weights by
//! heads, MLP features and vocabulary; `model::sharding` the tensors), and
//! the collectives are MLX's (`crate::distributed`); nothing here moves
//! tensors of its own.

mod coordinator;
mod fingerprint;
pub mod plan;
mod sharded;
pub mod worker;

pub use coordinator::{own_reply, Coordinator, Phase, RankLine, Stats};
pub use fingerprint::weights_fingerprint;
pub use sharded::ShardedLm;
