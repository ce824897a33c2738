//! A process group and its collectives over mlx-c.

use anyhow::{bail, Result};
use mlx_rs::Array;
use std::ffi::CString;

/// This process's membership of a group (mlx-c's handle to MLX's
/// `shared_ptr` of the backend's group).
pub struct Group {
    raw: mlx_sys::mlx_distributed_group,
}

// SAFETY: the handle points at an immutable `Group` value (a shared pointer
// to the backend); MLX's collectives take it by value and the backends
// serialize their own sockets. Collectives are only issued from the one
// thread that runs the sharded model; other threads only read rank and size.
unsafe impl Send for Group {}
// SAFETY: as above: `&Group` only reads the handle.
unsafe impl Sync for Group {}

impl Group {
    /// Whether `backend` (`ring`, `jaccl`, `nccl`, `mpi` or `any`) was
    /// built into this MLX.
    pub fn is_available(backend: &str) -> bool {
        let Ok(name) = CString::new(backend) else { return false };
        // SAFETY: a valid NUL-terminated string, read during the call.
        unsafe { mlx_sys::mlx_distributed_is_available(name.as_ptr()) }
    }

    /// Joins the group MLX's launch environment describes (for `ring`:
    /// `MLX_HOSTFILE`, a JSON list with one list of `"host:port"` per rank,
    /// and `MLX_RANK`). With `strict` false a backend that cannot start
    /// gives a group of one (this process alone); with `strict` it is an error.
    pub fn init(backend: &str, strict: bool) -> Result<Self> {
        let name = CString::new(backend)?;
        // SAFETY: mlx-c fills `raw` on success; the name is read during the call.
        let raw = unsafe {
            let mut raw = mlx_sys::mlx_distributed_group_new();
            if mlx_sys::mlx_distributed_init(&mut raw, strict, name.as_ptr()) != 0 || raw.ctx.is_null() {
                bail!("MLX could not join a group through the {backend} backend (see the log for MLX's reason)");
            }
            raw
        };
        Ok(Self { raw })
    }

    /// Forgets the groups MLX keeps per backend name, so the next
    /// [`Self::init`] forms a new one (after a peer died, the old group's
    /// sockets are gone for good). MLX caches the first group per backend
    /// for the process's life; mlx-c does not wrap `clear_backends`.
    pub fn forget_backends() {
        extern "C" {
            // mlx::core::distributed::clear_backends(): a free function
            // taking and returning nothing (the same call on every ABI
            // MLX ships for), declared public in MLX's distributed.h.
            #[link_name = "_ZN3mlx4core11distributed14clear_backendsEv"]
            fn mlx_clear_backends();
        }
        // SAFETY: clears a static map under MLX's own rules; no arguments.
        unsafe { mlx_clear_backends() }
    }

    /// This process's rank, from 0.
    pub fn rank(&self) -> usize {
        // SAFETY: a live group handle.
        unsafe { mlx_sys::mlx_distributed_group_rank(self.raw) }.max(0) as usize
    }

    /// How many processes the group has.
    pub fn size(&self) -> usize {
        // SAFETY: a live group handle.
        unsafe { mlx_sys::mlx_distributed_group_size(self.raw) }.max(1) as usize
    }

    /// The element-wise sum of `x` over every rank (lazy, like any MLX op:
    /// the communication happens when the result is evaluated).
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        self.collective(x, "all_sum", mlx_sys::mlx_distributed_all_sum)
    }

    /// One of mlx-c's collectives of this shape on `x`, on the default stream.
    fn collective(&self, x: &Array, name: &str, op: Collective) -> Result<Array> {
        let stream = mlx_rs::Stream::default();
        // SAFETY: `res` is a fresh handle mlx-c fills on success and we then
        // own (`from_ptr`); on failure it is freed here.
        unsafe {
            let mut res = mlx_sys::mlx_array_new();
            if op(&mut res, x.as_ptr(), self.raw, stream.as_ptr()) != 0 {
                mlx_sys::mlx_array_free(res);
                bail!("{name} over the group failed");
            }
            Ok(Array::from_ptr(res))
        }
    }
}

/// mlx-c's signature of a collective on one array.
type Collective = unsafe extern "C" fn(
    *mut mlx_sys::mlx_array,
    mlx_sys::mlx_array,
    mlx_sys::mlx_distributed_group,
    mlx_sys::mlx_stream,
) -> std::os::raw::c_int;

impl Group {
    /// Every rank's `x` concatenated along the first axis, in rank order (lazy).
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        self.collective(x, "all_gather", mlx_sys::mlx_distributed_all_gather)
    }

    /// Rank 0's `bytes` on every rank (the others pass `None`), through
    /// the group itself: a sum in which every other rank adds zeros. One
    /// collective for up to [`INLINE`] bytes, a second for the rest.
    /// Evaluated before it returns, so the order of collectives on every
    /// rank is the order of calls.
    pub fn broadcast_bytes(&self, bytes: Option<&[u8]>) -> Result<Vec<u8>> {
        let mut head = [0u8; INLINE + 4];
        if let Some(b) = bytes {
            let n = u32::try_from(b.len())?;
            head[..4].copy_from_slice(&n.to_le_bytes());
            let inline = b.len().min(INLINE);
            head[4..4 + inline].copy_from_slice(&b[..inline]);
        }
        let summed = self.all_sum(&Array::from_slice(&head, &[head.len() as i32]))?;
        summed.eval()?;
        let head = summed.as_slice::<u8>();
        let n = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
        if n > MAX_MESSAGE {
            bail!("a group message of {n} bytes is over the {MAX_MESSAGE}-byte bound");
        }
        let mut out = head[4..4 + n.min(INLINE)].to_vec();
        if n > INLINE {
            let rest = match bytes {
                Some(b) => b[INLINE..].to_vec(),
                None => vec![0u8; n - INLINE],
            };
            let summed = self.all_sum(&Array::from_slice(&rest, &[rest.len() as i32]))?;
            summed.eval()?;
            out.extend_from_slice(summed.as_slice::<u8>());
        }
        Ok(out)
    }

    /// Rank 0's `x` on every rank: the others pass an array of the same
    /// shape and dtype (zeros), and a sum adds nothing to rank 0's values.
    pub fn broadcast(&self, x: &Array) -> Result<Array> {
        let y = self.all_sum(x)?;
        y.eval()?;
        Ok(y)
    }
}

/// Bytes of a group message that ride in its first collective.
pub const INLINE: usize = 1020;
/// The longest group message (a plan with a long prompt's ids fits many times).
pub const MAX_MESSAGE: usize = 64 << 20;

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: the handle came from mlx_distributed_init and is freed once.
        unsafe {
            mlx_sys::mlx_distributed_group_free(self.raw);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a launch environment a non-strict join is a group of one,
    /// whose collectives are the identity: what a daemon that is not part
    /// of a cluster gets.
    #[test]
    fn a_process_alone_is_a_group_of_one_and_its_sum_is_its_own() {
        std::env::remove_var("MLX_HOSTFILE");
        std::env::remove_var("MLX_RANK");
        assert!(Group::is_available("ring"), "this MLX was built without the ring backend");
        let g = Group::init("any", false).unwrap();
        assert_eq!((g.rank(), g.size()), (0, 1));
        let x = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
        let y = g.all_sum(&x).unwrap();
        assert_eq!(y.as_slice::<f32>(), &[1.0, 2.0, 3.0]);
        assert!(Group::init("ring", true).is_err(), "ring without MLX_HOSTFILE cannot start strictly");
    }

    /// Two real processes (this test binary, started again as rank 0 and
    /// rank 1) join a ring over loopback and sum: the backend the daemon's
    /// cluster uses on CPU, end to end through mlx-c.
    #[test]
    fn two_processes_on_loopback_sum_over_the_ring() {
        const TEST: &str = "distributed::group::tests::two_processes_on_loopback_sum_over_the_ring";
        if let Ok(rank) = std::env::var("MLXBC_RING_TEST_RANK") {
            // One of the two ranks.
            let g = Group::init("ring", true).unwrap();
            assert_eq!((g.rank().to_string(), g.size()), (rank, 2));
            let x = Array::from_slice(&[g.rank() as f32 + 1.0; 4], &[4]);
            let y = g.all_sum(&x).unwrap();
            println!("rank {} sum {:?}", g.rank(), y.as_slice::<f32>());
            return;
        }
        let ports: Vec<u16> =
            (0..2).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()).collect();
        let dir = tempfile::tempdir().unwrap();
        let hostfile = dir.path().join("hosts.json");
        std::fs::write(&hostfile, format!(r#"[["127.0.0.1:{}"], ["127.0.0.1:{}"]]"#, ports[0], ports[1])).unwrap();
        let exe = std::env::current_exe().unwrap();
        let children: Vec<std::process::Child> = (0..2)
            .map(|rank| {
                std::process::Command::new(&exe)
                    .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
                    .env("MLXBC_RING_TEST_RANK", rank.to_string())
                    .env("MLX_HOSTFILE", &hostfile)
                    .env("MLX_RANK", rank.to_string())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        for (rank, mut child) in children.into_iter().enumerate() {
            while child.try_wait().unwrap().is_none() {
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    panic!("rank {rank} did not finish within 60 s");
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let out = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "rank {rank}: {text}{}", String::from_utf8_lossy(&out.stderr));
            assert!(text.contains(&format!("rank {rank} sum [3.0, 3.0, 3.0, 3.0]")), "rank {rank}: {text}");
        }
    }
}
