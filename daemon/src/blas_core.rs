//! OpenBLAS chooses its kernels by the CPU model once, as it loads. Debian
//! 12's OpenBLAS (0.3.21) does not know newer CPUs and takes them for the
//! oldest x86 it has kernels for: on this project's development machine
//! (an Intel Xeon with AVX-512, a Sapphire Rapids) it picked "Prescott"
//! (SSE3 kernels) and MLX's f32 matmuls ran at 55 GFLOP/s on 2 cores,
//! against 170 with its "SkylakeX" kernels (`OPENBLAS_CORETYPE=SkylakeX`,
//! measured in docs/measurements/cpu-2026-12-06-blas-core.md). Embeddings,
//! prefill and every f32 matmul on the CPU pay for that.
//!
//! Its kernels can only be chosen by `OPENBLAS_CORETYPE` in the
//! environment before it loads, and it loads with the executable (it is
//! linked to win symbol lookup over the MLX wheel's reference BLAS:
//! build.rs). So mlxbcd, when OpenBLAS fell back to SSE-era kernels (it did not
//! recognize the CPU) on a CPU with AVX2 or AVX-512, sets `OPENBLAS_CORETYPE` and executes itself again
//! (same pid, arguments and inherited sockets) before anything else runs.
//! A `OPENBLAS_CORETYPE` already set is left alone: the user's choice, and
//! what stops a second restart.

use std::ffi::CStr;

/// What OpenBLAS's kernels were chosen for, when it was restarted with
/// better ones: set for the second execution, read for the log.
const RESTARTED_FROM: &str = "MLXBC_OPENBLAS_DETECTED";

/// The name of the kernels OpenBLAS picked ("Prescott", "Haswell",
/// "SkylakeX", ...), or `None` where OpenBLAS is not what MLX's BLAS
/// calls land in.
pub fn openblas_core() -> Option<String> {
    // Looked up, not linked: a build with MLXBC_BLAS=reference has no
    // OpenBLAS.
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
    let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"openblas_get_corename".as_ptr()) };
    if symbol.is_null() {
        return None;
    }
    // SAFETY: `openblas_get_corename` takes nothing and returns a static
    // NUL-terminated string (OpenBLAS's cblas.h).
    let name = unsafe {
        let get: extern "C" fn() -> *const libc::c_char = std::mem::transmute(symbol);
        let p = get();
        if p.is_null() {
            return None;
        }
        CStr::from_ptr(p).to_string_lossy().into_owned()
    };
    Some(name)
}

/// How wide a vector unit OpenBLAS's kernels of `core` use: 0 SSE, 1 AVX,
/// 2 AVX2 and FMA, 3 AVX-512; `None` for a name not known here (left
/// alone).
fn vector_class(core: &str) -> Option<u8> {
    let core = core.to_ascii_lowercase();
    Some(match core.as_str() {
        "katmai" | "coppermine" | "northwood" | "prescott" | "banias" | "core2" | "penryn" | "dunnington"
        | "nehalem" | "atom" | "athlon" | "opteron" | "opteron_sse3" | "barcelona" | "nano" | "bobcat" => 0,
        "sandybridge" | "bulldozer" | "piledriver" | "steamroller" | "excavator" => 1,
        "haswell" | "zen" => 2,
        "skylakex" | "cooperlake" | "sapphirerapids" => 3,
        _ => return None,
    })
}

/// The kernels this CPU can run that are widest, as OpenBLAS names them,
/// with their vector class.
fn widest_for_this_cpu() -> Option<(&'static str, u8)> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            // Cooperlake's kernels add bf16 ones MLX does not call: the
            // f32 sgemm is SkylakeX's in both (measured within 2%).
            return Some(("SkylakeX", 3));
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return Some(("Haswell", 2));
        }
    }
    None
}

/// The `OPENBLAS_CORETYPE` that would give this CPU wider kernels where
/// OpenBLAS fell back to SSE-era ones (`detected`: it did not recognize
/// the CPU), or `None`. A pick OpenBLAS made knowingly (AVX2 "Zen" on a
/// Zen 4 with AVX-512, say) is left alone: its results are what the
/// committed references of such machines were made with.
pub fn better_core(detected: &str) -> Option<&'static str> {
    let have = vector_class(detected)?;
    let (name, class) = widest_for_this_cpu()?;
    (have == 0 && class > have).then_some(name)
}

/// At the start of `main`, before any thread exists: when OpenBLAS fell back
/// to SSE-era kernels on a CPU with wider ones ([`better_core`]), executes this program again with
/// `OPENBLAS_CORETYPE` set to the widest (it does not return then). Does
/// nothing where the variable is already set, off Linux, or where the
/// restart fails (it runs on with the kernels it has).
pub fn restart_with_wider_kernels() {
    if !cfg!(target_os = "linux") || std::env::var_os("OPENBLAS_CORETYPE").is_some() {
        return;
    }
    let Some(detected) = openblas_core() else { return };
    let Some(wider) = better_core(&detected) else { return };
    let Ok(exe) = std::env::current_exe() else { return };
    use std::os::unix::process::CommandExt;
    let error = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("OPENBLAS_CORETYPE", wider)
        .env(RESTARTED_FROM, &detected)
        .exec();
    // Only reached when exec failed; the log is not open yet.
    eprintln!(
        "mlxbcd: restarting with OPENBLAS_CORETYPE={wider} failed ({error}); running on OpenBLAS's {detected} kernels"
    );
}

/// For the daemon's first log line: the kernels in use, and what
/// OpenBLAS had picked when mlxbcd restarted itself for wider ones.
pub fn describe() -> Option<String> {
    let core = openblas_core()?;
    Some(match std::env::var(RESTARTED_FROM) {
        Ok(from) => format!("{core} (OpenBLAS took this CPU for a {from}; OPENBLAS_CORETYPE set)"),
        Err(_) => core,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_kernels_of_an_unrecognized_cpu_are_replaced() {
        match widest_for_this_cpu() {
            Some((name, class)) => {
                assert_eq!(better_core("Prescott"), Some(name));
                assert_eq!(better_core("Nehalem"), Some(name));
                assert_eq!(better_core("SkylakeX"), None, "nothing is wider than AVX-512");
                assert_eq!(better_core("Haswell"), None, "a recognized CPU keeps its kernels ({class})");
                assert_eq!(better_core("Sandybridge"), None);
            }
            None => assert_eq!(better_core("Prescott"), None),
        }
        // A name not in the table (a newer OpenBLAS's) is left alone.
        assert_eq!(better_core("Emeraldrapids"), None);
    }
}
