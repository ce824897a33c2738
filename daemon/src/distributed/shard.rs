//! What a sharded model holds of its group.

use super::Group;
use anyhow::{anyhow, Result};
use mlx_rs::Array;
use std::sync::{Arc, Mutex};

/// The group a sharded model's collectives go through, replaceable: when
/// a group breaks (a peer died) and re-forms, the models keep their shards
/// and their next collectives use the new group.
#[derive(Clone, Default)]
pub struct Link(Arc<Mutex<Option<Arc<Group>>>>);

impl Link {
    /// A link to `group`.
    pub fn new(group: Arc<Group>) -> Self {
        Self(Arc::new(Mutex::new(Some(group))))
    }

    /// Points the link at a new group, or at none while it re-forms.
    pub fn set(&self, group: Option<Arc<Group>>) {
        *mlxbc_shared::sync::lock(&self.0) = group;
    }

    /// The current group.
    pub fn group(&self) -> Result<Arc<Group>> {
        mlxbc_shared::sync::lock(&self.0).clone().ok_or_else(|| anyhow!("the group is not formed"))
    }
}

/// This process's part of a model split over `size` ranks.
#[derive(Clone)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
    pub link: Link,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} of {}", self.rank, self.size)
    }
}

impl PartialEq for Shard {
    fn eq(&self, other: &Self) -> bool {
        (self.rank, self.size) == (other.rank, other.size)
    }
}

impl Shard {
    /// This rank's contiguous part `[start, end)` of `n` equal parts'
    /// whole, when `n` divides by the ranks.
    pub fn part(&self, n: i32) -> Option<(i32, i32)> {
        let size = self.size as i32;
        (n % size == 0).then(|| (n / size * self.rank as i32, n / size * (self.rank as i32 + 1)))
    }

    /// The sum of `x` over the ranks (lazy).
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        self.link.group()?.all_sum(x)
    }

    /// Every rank's `x` along axis 0, in rank order (lazy).
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        self.link.group()?.all_gather(x)
    }
}

/// Gives the memory a load freed back to the system: MLX's buffer cache,
/// and (glibc) the heap's free pages, where the whole tensors the shards
/// were cut from went. A rank's resident memory is then about its part.
pub fn release_freed_memory() {
    let _ = mlx_rs::memory::clear_cache();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_split_evenly_or_not_at_all() {
        let s = |rank| Shard { rank, size: 4, link: Link::default() };
        assert_eq!(s(0).part(16), Some((0, 4)));
        assert_eq!(s(3).part(16), Some((12, 16)));
        assert_eq!(s(1).part(14), None);
        assert!(s(0).all_sum(&Array::from_f32(1.0)).unwrap_err().to_string().contains("not formed"));
    }
}
