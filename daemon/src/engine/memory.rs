//! How much memory the machine has and how much is left, for the memory
//! budget and for shedding under pressure.
//! Linux: /proc/meminfo (MemTotal, MemAvailable). macOS: hw.memsize, and the
//! kernel's pressure level (kern.memorystatus_vm_pressure_level) mapped to
//! "available" = 0 when it says warn or critical.
//! A discrete GPU (CUDA) has memory of its own: MLX's device info gives its
//! total and what was free when first asked (other processes' share).

/// Physical memory in bytes (0 if unknown).
pub fn total_bytes() -> u64 {
    #[cfg(target_os = "macos")]
    {
        sysctl_u64("hw.memsize").unwrap_or(0)
    }
    #[cfg(not(target_os = "macos"))]
    {
        meminfo("MemTotal:").unwrap_or(0)
    }
}

/// Memory available to new allocations without swapping, if known.
pub fn available_bytes() -> Option<u64> {
    #[cfg(target_os = "macos")]
    {
        // 1 normal, 2 warn, 4 critical.
        let level = sysctl_u64("kern.memorystatus_vm_pressure_level")?;
        Some(if level >= 2 { 0 } else { total_bytes() })
    }
    #[cfg(not(target_os = "macos"))]
    {
        meminfo("MemAvailable:")
    }
}

/// A discrete GPU's memory as MLX's CUDA backend reports it: (total, free
/// when first asked), in bytes. None on the CPU, on Apple silicon (unified
/// memory: the machine's own numbers apply) or when MLX cannot say.
pub fn discrete_gpu_bytes() -> Option<(u64, u64)> {
    // SAFETY: the device and info objects are created, read and freed here;
    // mlx_device_info_get fills `info` for a valid device; the keys are
    // NUL-terminated literals.
    unsafe {
        let device = mlx_sys::mlx_device_new_type(mlx_sys::mlx_device_type__MLX_GPU, 0);
        let mut info = mlx_sys::mlx_device_info_new();
        let mut sizes = None;
        if mlx_sys::mlx_device_info_get(&mut info, device) == 0 {
            let (mut total, mut free) = (0usize, 0usize);
            // total_memory and free_memory are CUDA's keys (Metal says memory_size).
            if mlx_sys::mlx_device_info_get_size(&mut total, info, c"total_memory".as_ptr()) == 0
                && mlx_sys::mlx_device_info_get_size(&mut free, info, c"free_memory".as_ptr()) == 0
            {
                sizes = Some((total as u64, free as u64));
            }
        }
        mlx_sys::mlx_device_info_free(info);
        mlx_sys::mlx_device_free(device);
        sizes
    }
}

/// The default memory budget: three quarters of the machine's memory (what
/// Metal recommends as a working set on Apple silicon), or on a discrete GPU
/// 90% of what was free on it when the daemon started, so another process
/// already on the card (a second daemon, a training job) is not counted as
/// ours to fill.
pub fn default_budget_bytes(on_gpu: bool) -> u64 {
    let host = total_bytes() / 4 * 3;
    match on_gpu.then(discrete_gpu_bytes).flatten() {
        Some((_, free)) if free > 0 => free / 10 * 9,
        _ => host,
    }
}

#[cfg(not(target_os = "macos"))]
fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line[field.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

#[cfg(target_os = "macos")]
fn sysctl_u64(name: &str) -> Option<u64> {
    let name = std::ffi::CString::new(name).ok()?;
    let mut value: u64 = 0;
    let mut len = std::mem::size_of::<u64>();
    // SAFETY: sysctlbyname writes at most `len` bytes into `value`.
    let rc = unsafe {
        libc::sysctlbyname(name.as_ptr(), (&mut value as *mut u64).cast(), &mut len, std::ptr::null_mut(), 0)
    };
    (rc == 0).then_some(if len == 4 { value & 0xffff_ffff } else { value })
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_machine_reports_its_memory() {
        let total = super::total_bytes();
        assert!(total > 1 << 28, "total {total}");
        let avail = super::available_bytes().expect("MemAvailable");
        assert!(avail <= total);
    }
}
