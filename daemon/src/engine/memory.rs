//! How much memory the machine has and how much is left, for the memory
//! budget and for shedding under pressure.
//! Linux: /proc/meminfo (MemTotal, MemAvailable). macOS: hw.memsize, and the
//! kernel's pressure level (kern.memorystatus_vm_pressure_level) mapped to
//! "available" = 0 when it says warn or critical.

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
