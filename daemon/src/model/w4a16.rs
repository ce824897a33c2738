//! Our own 4-bit-weight, 16-bit-activation matmul for a few rows on CUDA,
//! through MLX's custom-kernel API (mlx-c `mlx_fast_cuda_kernel_*`).
//!
//! MLX 0.32's CUDA quantized matmul reads a packed 8B model at ~0.8 TB/s for
//! one row and pays again for every further row (5.7 ms for one row's
//! projections, 17.7 ms for four; docs/measurements/
//! gpu-2026-12-04-quantized-matmul-by-rows.md). Here one warp per output
//! feature reads its packed row once, with 16-byte coalesced loads, and
//! applies it to every row of `x` (a compile-time count, up to
//! [`MAX_ROWS`]), accumulating in f32: the same sum as `quantized_matmul`
//! in another order (scripts/gpu/w4a16.py checks the two against an f32
//! reference on the device). The same source is the prototype there.

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};
use std::ffi::CString;
use std::sync::atomic::{AtomicI32, Ordering};

/// Steps of up to this many rows use the kernel (0: never). Set once at
/// start from the device and `MLXBC_W4A16_ROWS` ([`set_rows_served`]).
static ROWS_SERVED: AtomicI32 = AtomicI32::new(0);

/// Lets steps of up to `rows` rows (at most [`MAX_ROWS`]) use the kernel;
/// 0 turns it off. Only meaningful on CUDA.
pub fn set_rows_served(rows: i32) {
    ROWS_SERVED.store(rows.clamp(0, MAX_ROWS), Ordering::Relaxed);
}

/// Rows up to which the kernel is used.
pub fn rows_served() -> i32 {
    ROWS_SERVED.load(Ordering::Relaxed)
}

/// Rows one launch serves (a template constant: one compiled kernel per
/// count, warmed with the batch sizes).
pub const MAX_ROWS: i32 = 8;

/// Warps (output features) per block.
const WARPS: i32 = 4;

const SOURCE: &str = r#"
    const int lane = threadIdx.x;
    const int n = blockIdx.y * blockDim.y + threadIdx.y;
    if (n >= N) return;
    const uint4* wrow = reinterpret_cast<const uint4*>(w) + (size_t)n * (K / 32);
    const T* srow = scales + (size_t)n * (K / GROUP);
    const T* brow = biases + (size_t)n * (K / GROUP);
    float acc[ROWS];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) acc[m] = 0.f;
    for (int c = lane; c < K / 32; c += 32) {
        const uint4 q = wrow[c];
        const int k0 = c * 32;
        const float s = static_cast<float>(srow[k0 / GROUP]);
        const float b = static_cast<float>(brow[k0 / GROUP]);
        const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)m * K + k0);
            float dot = 0.f, sum = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint4 xv = xr[j];
                const T* xh = reinterpret_cast<const T*>(&xv);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float xi = static_cast<float>(xh[i]);
                    dot += static_cast<float>((words[j] >> (4 * i)) & 0xFu) * xi;
                    sum += xi;
                }
            }
            acc[m] += s * dot + b * sum;
        }
    }
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        float v = acc[m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) out[(size_t)m * N + n] = static_cast<T>(v);
    }
"#;

/// The compiled-on-first-use kernel object (MLX caches the module per
/// template instance).
struct Kernel(mlx_sys::mlx_fast_cuda_kernel);

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: made by mlx_fast_cuda_kernel_new, freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.0) };
    }
}

thread_local! {
    static KERNEL: Kernel = Kernel::new();
}

impl Kernel {
    fn new() -> Self {
        let strings = |names: &[&str]| {
            // SAFETY: a new vector, filled with copies of the strings.
            unsafe {
                let v = mlx_sys::mlx_vector_string_new();
                for n in names {
                    let c = CString::new(*n).unwrap();
                    mlx_sys::mlx_vector_string_append_value(v, c.as_ptr());
                }
                v
            }
        };
        let (inputs, outputs) = (strings(&["x", "w", "scales", "biases"]), strings(&["out"]));
        let (name, source, header) =
            (CString::new("mlxbc_w4a16").unwrap(), CString::new(SOURCE).unwrap(), CString::new("").unwrap());
        // SAFETY: every pointer lives through the call; MLX copies what it keeps.
        let k = unsafe {
            let k = mlx_sys::mlx_fast_cuda_kernel_new(
                name.as_ptr(),
                inputs,
                outputs,
                source.as_ptr(),
                header.as_ptr(),
                true,
                0,
            );
            mlx_sys::mlx_vector_string_free(inputs);
            mlx_sys::mlx_vector_string_free(outputs);
            k
        };
        Kernel(k)
    }
}

/// True when the kernel serves this product: 4-bit weights in groups of
/// 32, 64 or 128 over `k` inputs (a multiple of 32), f16/bf16 rows, at most
/// [`MAX_ROWS`] of them.
pub fn serves(rows: i32, k: i32, bits: i32, group: i32, dtype: Dtype) -> bool {
    bits == 4
        && [32, 64, 128].contains(&group)
        && k % group == 0
        && k % 32 == 0
        && (1..=MAX_ROWS).contains(&rows)
        && matches!(dtype, Dtype::Float16 | Dtype::Bfloat16)
}

/// `x W^T` for packed 4-bit `w` `[n, k/8]` with `scales`/`biases`
/// `[n, k/group]` (of `x`'s dtype), over `x`'s last axis (`[..., k]`).
pub fn matmul(x: &Array, w: &Array, scales: &Array, biases: &Array, group: i32) -> Result<Array> {
    let k = *x.shape().last().unwrap_or(&0);
    let n = w.shape()[0];
    let rows = if k == 0 { 0 } else { (x.size() as i32) / k };
    if !serves(rows, k, 4, group, x.dtype()) || scales.dtype() != x.dtype() {
        bail!("the W4A16 kernel does not serve {rows} rows of {k} ({:?})", x.dtype());
    }
    let flat = x.reshape(&[rows, k])?;
    let out = KERNEL.with(|kernel| -> Result<Array> {
        // SAFETY: the config, the vectors and the stream are made, used and
        // freed here; the inputs' arrays outlive the call (MLX retains them).
        unsafe {
            let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
            let shape = [rows, n];
            mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(config, shape.as_ptr(), 2, x.dtype() as u32);
            mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config, 32, (n + WARPS - 1) / WARPS * WARPS, 1);
            mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(config, 32, WARPS, 1);
            let t = CString::new("T").unwrap();
            mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(config, t.as_ptr(), x.dtype() as u32);
            for (name, value) in [("ROWS", rows), ("K", k), ("N", n), ("GROUP", group)] {
                let c = CString::new(name).unwrap();
                mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(config, c.as_ptr(), value);
            }
            let inputs = mlx_sys::mlx_vector_array_new();
            for a in [&flat, w, scales, biases] {
                mlx_sys::mlx_vector_array_append_value(inputs, a.as_ptr());
            }
            let mut outputs = mlx_sys::mlx_vector_array_new();
            let stream = mlx_rs::Stream::gpu();
            let rc = mlx_sys::mlx_fast_cuda_kernel_apply(&mut outputs, kernel.0, inputs, config, stream.as_ptr());
            mlx_sys::mlx_vector_array_free(inputs);
            mlx_sys::mlx_fast_cuda_kernel_config_free(config);
            if rc != 0 || mlx_sys::mlx_vector_array_size(outputs) != 1 {
                mlx_sys::mlx_vector_array_free(outputs);
                bail!("MLX refused the W4A16 kernel (rc {rc})");
            }
            let mut out = mlx_sys::mlx_array_new();
            mlx_sys::mlx_vector_array_get(&mut out, outputs, 0);
            mlx_sys::mlx_vector_array_free(outputs);
            Ok(Array::from_ptr(out))
        }
    })?;
    let mut shape = x.shape().to_vec();
    *shape.last_mut().unwrap() = n;
    Ok(out.reshape(&shape)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_only_what_it_was_written_for() {
        assert!(serves(1, 4096, 4, 64, Dtype::Float16));
        assert!(serves(8, 12288, 4, 32, Dtype::Bfloat16));
        assert!(!serves(9, 4096, 4, 64, Dtype::Float16), "more rows than compiled for");
        assert!(!serves(1, 4096, 8, 64, Dtype::Float16), "8-bit weights");
        assert!(!serves(1, 4096, 4, 64, Dtype::Float32), "f32 rows");
        assert!(!serves(1, 4104, 4, 64, Dtype::Float16), "inputs not a multiple of the group");
    }
}
