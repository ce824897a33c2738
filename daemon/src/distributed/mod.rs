//! MLX's distributed layer, for a model sharded over several processes
//! or hosts: a [`Group`] joined through one of MLX's backends (`ring` over
//! TCP, `jaccl` over Thunderbolt 5 RDMA, `nccl`, `mpi`) and its collectives.
//! mlx-rs 0.33 wraps none of mlx-c's `mlx_distributed_*` functions; this
//! module is the one place that calls them. Activations and weights' shards
//! move only through these collectives (no transport of our own).
//!
//! What the backends do on a fault was measured first
//! (docs/trials/distributed/): a peer whose sockets close makes the next
//! collective fail at once; a peer that stops answering blocks it forever,
//! so callers bound every collective themselves.

mod cut;
mod group;
mod hostfile;
mod shard;

pub use cut::{cut_ring_sockets, ring_sockets, wait_readable};
pub use group::{Group, INLINE, MAX_MESSAGE};
pub use hostfile::Hostfile;
pub use shard::{release_freed_memory, Link, Shard};
