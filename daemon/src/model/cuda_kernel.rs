//! MLX's custom CUDA kernels from Rust (mlx-c's `mlx_fast_cuda_kernel_*`):
//! the plumbing that mlxbc's own kernels ([`crate::model::batch_attention`],
//! [`crate::model::w4a16`]) share. MLX compiles a kernel's body with NVRTC
//! at its first use per template set and keeps it in its kernel cache.

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};
use std::ffi::{CStr, CString};

/// `MLXBC_STEP_FUSION=off` (read once): decode steps keep MLX's operations
/// around the projections (norm and rope of q and k, SwiGLU, the residual
/// adds) instead of the fused kernels of [`crate::model::qk_rope`] and
/// [`crate::model::w4a16::matmul_add`]; for measuring them against.
pub fn step_fusion_on() -> bool {
    *STEP_FUSION != StepFusion::Off
}

/// Whether the 4-bit kernel may apply a layer's RMS norms as it reads its
/// input ([`crate::model::w4a16::matmul_normed`]): on with the step's
/// fusion, off under `MLXBC_STEP_FUSION=no-norm` (the rest of the fusion
/// kept, for measuring the norms alone) or `off`.
pub fn norm_fusion_on() -> bool {
    *STEP_FUSION == StepFusion::All
}

/// `MLXBC_STEP_FUSION`, read once: unset (or anything else) all, `off`
/// none, `no-norm` all but the norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepFusion {
    All,
    NoNorm,
    Off,
}

static STEP_FUSION: std::sync::LazyLock<StepFusion> = std::sync::LazyLock::new(|| {
    match std::env::var("MLXBC_STEP_FUSION").unwrap_or_default().to_ascii_lowercase().as_str() {
        "off" => StepFusion::Off,
        "no-norm" => StepFusion::NoNorm,
        _ => StepFusion::All,
    }
});

/// A template argument of a kernel's body.
#[derive(Debug, Clone, Copy)]
pub enum Template<'a> {
    /// A float type (`T` in the body).
    Type(&'a CStr, Dtype),
    /// An integer constant.
    Int(&'a CStr, i32),
}

/// One launch: the output's shape and dtype, the grid in threads (MLX's
/// convention) and the block, and the template arguments.
pub struct Launch<'a> {
    pub output_shape: &'a [i32],
    pub output_dtype: Dtype,
    pub grid: (i32, i32, i32),
    pub block: (i32, i32, i32),
    pub templates: &'a [Template<'a>],
}

/// A compiled kernel function (mlx-c's handle).
pub struct CudaKernel {
    raw: mlx_sys::mlx_fast_cuda_kernel,
    /// What errors name.
    name: String,
}

impl Drop for CudaKernel {
    fn drop(&mut self) {
        // SAFETY: made by `mlx_fast_cuda_kernel_new`, freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.raw) };
    }
}

impl CudaKernel {
    /// A kernel named `name` over `inputs` (the body reads them by these
    /// names, and `NAME_shape` / `NAME_strides` where it refers to them)
    /// writing `outputs`; `row_contiguous`: MLX copies an input that is not.
    pub fn new(name: &str, inputs: &[&str], outputs: &[&str], source: &str, row_contiguous: bool) -> Result<Self> {
        let cstr = |s: &str| CString::new(s).expect("no NUL in kernel strings");
        let (c_name, c_source, header) = (cstr(name), cstr(source), cstr(""));
        let names = |list: &[&str]| {
            let owned: Vec<CString> = list.iter().map(|s| cstr(s)).collect();
            let ptrs: Vec<*const std::os::raw::c_char> = owned.iter().map(|s| s.as_ptr()).collect();
            // SAFETY: the pointers live in `owned` for the call; mlx-c copies the strings.
            unsafe { mlx_sys::mlx_vector_string_new_data(ptrs.as_ptr() as *mut _, ptrs.len()) }
        };
        let (inputs, outputs) = (names(inputs), names(outputs));
        // SAFETY: every argument is a live C string or vector for the call;
        // the vectors are freed after, the handle is owned by `CudaKernel`.
        let raw = unsafe {
            let raw = mlx_sys::mlx_fast_cuda_kernel_new(
                c_name.as_ptr(),
                inputs,
                outputs,
                c_source.as_ptr(),
                header.as_ptr(),
                row_contiguous,
                0,
            );
            mlx_sys::mlx_vector_string_free(inputs);
            mlx_sys::mlx_vector_string_free(outputs);
            raw
        };
        if raw.ctx.is_null() {
            bail!("mlx_fast_cuda_kernel_new failed for {name}");
        }
        Ok(Self { raw, name: name.to_string() })
    }

    /// Queues the kernel on `inputs` (in the order named at [`Self::new`])
    /// on the default stream; returns its one output.
    pub fn apply(&self, inputs: &[&Array], launch: &Launch) -> Result<Array> {
        // SAFETY: the config and vectors are created, used and freed here;
        // the inputs are live arrays for the call; the one output handle
        // mlx-c returns is taken over by `Array::from_ptr`.
        unsafe {
            let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
            let dtype: mlx_sys::mlx_dtype = launch.output_dtype.into();
            let shape = launch.output_shape;
            let mut rc =
                mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(config, shape.as_ptr(), shape.len(), dtype);
            let ((gx, gy, gz), (bx, by, bz)) = (launch.grid, launch.block);
            rc |= mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config, gx, gy, gz);
            rc |= mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(config, bx, by, bz);
            for t in launch.templates {
                rc |= match *t {
                    Template::Type(name, dtype) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(config, name.as_ptr(), dtype.into())
                    }
                    Template::Int(name, value) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(config, name.as_ptr(), value)
                    }
                };
            }
            let handles: Vec<mlx_sys::mlx_array> = inputs.iter().map(|a| a.as_ptr()).collect();
            let inputs = mlx_sys::mlx_vector_array_new_data(handles.as_ptr(), handles.len());
            let mut outputs = mlx_sys::mlx_vector_array_new();
            let stream = mlx_rs::Stream::default();
            if rc == 0 {
                rc = mlx_sys::mlx_fast_cuda_kernel_apply(&mut outputs, self.raw, inputs, config, stream.as_ptr());
            }
            let mut out = mlx_sys::mlx_array_new();
            if rc == 0 && mlx_sys::mlx_vector_array_size(outputs) == 1 {
                rc = mlx_sys::mlx_vector_array_get(&mut out, outputs, 0);
            } else {
                rc |= 1;
            }
            mlx_sys::mlx_vector_array_free(inputs);
            mlx_sys::mlx_vector_array_free(outputs);
            mlx_sys::mlx_fast_cuda_kernel_config_free(config);
            if rc != 0 {
                mlx_sys::mlx_array_free(out);
                bail!("the {} kernel could not be applied", self.name);
            }
            Ok(Array::from_ptr(out))
        }
    }
}

/// One of our kernels, built and checked on CUDA only: `None` off CUDA, or
/// when `new` fails or `check` disagrees with MLX (logged as "`fallback`:
/// ..."); else logged as "`used` (`check`'s report)".
pub fn built_and_checked<K>(
    fallback: &str,
    used: &str,
    new: impl FnOnce() -> Result<K>,
    check: impl FnOnce(&K) -> Result<String>,
) -> Option<K> {
    if !crate::model::options::cuda_available() {
        return None;
    }
    let kernel = match new() {
        Ok(k) => k,
        Err(e) => {
            tracing::warn!("{fallback}: the kernel was not built: {e:#}");
            return None;
        }
    };
    match check(&kernel) {
        Ok(report) => {
            tracing::info!("{used} ({report})");
            Some(kernel)
        }
        Err(e) => {
            tracing::warn!("{fallback}: the kernel failed its check: {e:#}");
            None
        }
    }
}
