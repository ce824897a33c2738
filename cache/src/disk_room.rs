//! How much a disk cache may still write: the free space of its filesystem
//! less the reserve the settings keep (`disk_reserve_percent`,
//! `disk_reserve_mib`). Asked before every write, since other programs
//! fill the disk too.
//!
//! Found before this existed: the prompt cache's fixed 8 GiB budget filled
//! a small home to 94%, after which session turns could not be saved.

use mlxbc_shared::settings::DiskReserve;
use std::path::Path;

/// A filesystem's size and the space an unprivileged writer may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskSpace {
    pub total: u64,
    pub available: u64,
}

/// The size and free space of the filesystem holding `dir` (None if it
/// cannot be read, e.g. the folder is gone).
pub fn disk_space(dir: &Path) -> Option<DiskSpace> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs fills the struct it is given from a valid C string path.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return None;
    }
    let unit = s.f_frsize as u64;
    Some(DiskSpace { total: s.f_blocks as u64 * unit, available: s.f_bavail as u64 * unit })
}

/// Bytes that may still be written under `dir` before the filesystem's
/// free space falls to the reserve (0 when it is there already; `u64::MAX`
/// when the free space cannot be read, so a probe failure never disables a cache).
pub fn room(dir: &Path, reserve: DiskReserve) -> u64 {
    match disk_space(dir) {
        Some(space) => space.available.saturating_sub(reserve.bytes(space.total)),
        None => u64::MAX,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_is_the_free_space_less_the_reserve() {
        let dir = tempfile::tempdir().unwrap();
        let space = disk_space(dir.path()).unwrap();
        assert!(space.total > 0 && space.available <= space.total);
        let none = DiskReserve { percent: 0, min_bytes: 0 };
        assert!(room(dir.path(), none).abs_diff(space.available) < 64 << 20);
        let all = DiskReserve { percent: 0, min_bytes: u64::MAX };
        assert_eq!(room(dir.path(), all), 0);
        assert_eq!(DiskReserve { percent: 10, min_bytes: 2 << 30 }.bytes(100 << 30), 10 << 30);
        assert_eq!(DiskReserve { percent: 10, min_bytes: 2 << 30 }.bytes(8 << 30), 2 << 30);
    }
}
