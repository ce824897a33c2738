//! Attention's softmax and GELU for encoders on MLX's CPU backend, computed
//! here over MLX's buffers instead of as MLX operations.
//!
//! MLX's x86 CPU backend runs element-wise work as scalar loops on one
//! thread per stream, one pass over memory per operation: the polynomial
//! softmax of `cpu_math` is ~27 passes over a `[B, heads, L, L]` score
//! array, and on this project's machine it took as long as all of a
//! MiniLM layer's matrix products (135 against 140 ms for 8 texts of 240
//! tokens, `scripts/bench.d/mlx_cpu_ops.py`). Here each row is read once
//! and written twice while in cache, in loops the compiler vectorizes
//! (AVX2 or AVX-512 when the CPU has them, chosen at run time), on every
//! core. The formulas are `cpu_math`'s, term for term, so the results
//! agree with it to rounding.
//!
//! The price is an evaluation in the middle of the layer's graph (the
//! scores must exist before their softmax is computed here).

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

/// Lanes the loops keep apart so that the compiler can vectorize their
/// reductions (a max and a sum in order would be a serial chain).
const LANES: usize = 16;

const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// The larger of two floats as one vector instruction takes it (`f32::max`
/// also orders NaNs, which keeps the compiler from vectorizing); a NaN in
/// `a` gives `b`.
#[inline(always)]
fn larger(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

#[inline(always)]
fn horner(x: f32, coefficients: &[f32]) -> f32 {
    let mut p = coefficients[0];
    for &c in &coefficients[1..] {
        p = p * x + c;
    }
    p
}

/// `cpu_math::exp_nonpositive`, one element.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    let y = larger(x, -87.0) * LOG2_E;
    let k = y.floor();
    let two_f = horner(y - k, &super::cpu_math::EXP2_HIGH_FIRST);
    // SAFETY: k is whole and in [-126, 0] (y is in [-125.6, 0] and never
    // NaN: `larger` gives -87 for one), so it fits an i32.
    let k = unsafe { k.to_int_unchecked::<i32>() };
    // (k + 127) << 23 is the f32 whose value is 2^k.
    two_f * f32::from_bits(((k + 127) << 23) as u32)
}

/// `cpu_math::gelu`, one element.
#[inline(always)]
fn gelu_one(x: f32) -> f32 {
    // Two comparisons, not `clamp` (whose NaN checks keep the loop scalar).
    let t = larger(-4.0, -larger(-4.0, -(x * std::f32::consts::FRAC_1_SQRT_2)));
    let t2 = t * t;
    let erf = horner(t2, &super::cpu_math::ERF_P) * t / horner(t2, &super::cpu_math::ERF_Q);
    x * (erf + 1.0) * 0.5
}

/// Softmax of one row of `scores + bias` into `out`.
#[inline(always)]
fn softmax_row(scores: &[f32], bias: &[f32], out: &mut [f32]) {
    let n = scores.len();
    let whole = n - n % LANES;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for ((o, s), b) in
        out[..whole].chunks_exact_mut(LANES).zip(scores.chunks_exact(LANES)).zip(bias.chunks_exact(LANES))
    {
        for l in 0..LANES {
            o[l] = s[l] + b[l];
            lanes[l] = larger(o[l], lanes[l]);
        }
    }
    let mut max = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| larger(b, a));
    for j in whole..n {
        out[j] = scores[j] + bias[j];
        max = larger(out[j], max);
    }
    let mut sums = [0.0f32; LANES];
    for o in out[..whole].chunks_exact_mut(LANES) {
        for l in 0..LANES {
            o[l] = exp_nonpositive(o[l] - max);
            sums[l] += o[l];
        }
    }
    let mut sum: f32 = sums.iter().sum();
    for o in &mut out[whole..] {
        *o = exp_nonpositive(*o - max);
        sum += *o;
    }
    let inverse = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= inverse;
    }
}

/// Where a row's bias starts: `bias` is `[Bb, 1, Qb, L]` with Bb 1 or the
/// batch and Qb 1 or the query rows, broadcast over the rest.
#[derive(Clone, Copy)]
struct BiasLayout {
    heads: usize,
    queries: usize,
    keys: usize,
    per_batch: bool,
    per_query: bool,
}

impl BiasLayout {
    fn offset(&self, row: usize) -> usize {
        let batch = row / (self.heads * self.queries);
        let query = row % self.queries;
        let rows_per_batch = if self.per_query { self.queries } else { 1 };
        (usize::from(self.per_batch) * batch * rows_per_batch + usize::from(self.per_query) * query) * self.keys
    }
}

/// The rows `first..` of `out` (whole rows of `layout.keys`).
#[inline(always)]
fn softmax_rows(scores: &[f32], bias: &[f32], layout: BiasLayout, first: usize, out: &mut [f32]) {
    let keys = layout.keys;
    for (i, o) in out.chunks_exact_mut(keys).enumerate() {
        let row = first + i;
        let b = layout.offset(row);
        softmax_row(&scores[row * keys..(row + 1) * keys], &bias[b..b + keys], o);
    }
}

/// A row whose elements sum to `sum`, normalized in place as MLX's layer
/// norm computes it (mean, then the mean square of the centred values),
/// scaled and shifted.
#[inline(always)]
fn normalize_summed(o: &mut [f32], sum: f32, weight: &[f32], shift: &[f32], eps: f32) {
    let d = o.len();
    let whole = d - d % LANES;
    let mean = sum / d as f32;
    let mut squares = [0.0f32; LANES];
    for o in o[..whole].chunks_exact_mut(LANES) {
        for l in 0..LANES {
            o[l] -= mean;
            squares[l] += o[l] * o[l];
        }
    }
    let mut square: f32 = squares.iter().sum();
    for v in &mut o[whole..] {
        *v -= mean;
        square += *v * *v;
    }
    let scale = 1.0 / (square / d as f32 + eps).sqrt();
    for ((v, w), s) in o.iter_mut().zip(weight).zip(shift) {
        *v = *v * scale * w + s;
    }
}

/// `(a + b)` normalized over each row of `weight.len()`, scaled and
/// shifted, as MLX's layer norm computes it (mean, then the mean square
/// of the centred values).
#[inline(always)]
fn add_layer_norm_rows(a: &[f32], b: &[f32], weight: &[f32], bias: &[f32], eps: f32, first: usize, out: &mut [f32]) {
    let d = weight.len();
    let whole = d - d % LANES;
    for (i, o) in out.chunks_exact_mut(d).enumerate() {
        let at = (first + i) * d;
        let (a, b) = (&a[at..at + d], &b[at..at + d]);
        let mut sums = [0.0f32; LANES];
        for ((o, a), b) in o[..whole].chunks_exact_mut(LANES).zip(a.chunks_exact(LANES)).zip(b.chunks_exact(LANES)) {
            for l in 0..LANES {
                o[l] = a[l] + b[l];
                sums[l] += o[l];
            }
        }
        let mut sum: f32 = sums.iter().sum();
        for j in whole..d {
            o[j] = a[j] + b[j];
            sum += o[j];
        }
        normalize_summed(o, sum, weight, bias, eps);
    }
}

#[inline(always)]
fn gelu_all(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = gelu_one(v);
    }
}

/// Compiles `$body` (a call of an `#[inline(always)]` function) three
/// times: for AVX-512, for AVX2 with FMA, and for the baseline, and runs
/// the widest this CPU has.
macro_rules! widest {
    ($name:ident($($arg:ident: $ty:ty),*) => $body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
            unsafe fn avx512($($arg: $ty),*) { $body }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) { $body }
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512dq")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                // SAFETY: the CPU has the features the function is compiled for.
                return unsafe { avx512($($arg),*) };
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: as above.
                return unsafe { avx2($($arg),*) };
            }
        }
        #[allow(unreachable_code)]
        {
            $body
        }
    }};
}

fn softmax_rows_widest(scores: &[f32], bias: &[f32], layout: BiasLayout, first: usize, out: &mut [f32]) {
    widest!(softmax_rows(scores: &[f32], bias: &[f32], layout: BiasLayout, first: usize, out: &mut [f32])
        => softmax_rows(scores, bias, layout, first, out))
}

#[allow(clippy::too_many_arguments)]
fn add_layer_norm_widest(a: &[f32], b: &[f32], w: &[f32], s: &[f32], eps: f32, first: usize, out: &mut [f32]) {
    widest!(add_layer_norm_rows(a: &[f32], b: &[f32], w: &[f32], s: &[f32], eps: f32, first: usize, out: &mut [f32])
        => add_layer_norm_rows(a, b, w, s, eps, first, out))
}

fn gelu_widest(x: &[f32], out: &mut [f32]) {
    widest!(gelu_all(x: &[f32], out: &mut [f32]) => gelu_all(x, out))
}

thread_local! {
    /// Set while the thread runs one part of a batch beside others
    /// ([`on_this_core`]): the passes here then stay on it.
    static ONE_CORE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The cores the passes here spread over: every core (at most 16), or
/// only the calling thread inside [`on_this_core`].
pub(crate) fn cores() -> usize {
    if ONE_CORE.with(std::cell::Cell::get) {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(16)
    }
}

/// Runs `work` with every pass and attention here on the calling thread
/// (for threads that each take a part of a batch: with [`BlasThreads`]
/// held, nothing of theirs waits on another core).
pub(crate) fn on_this_core<R>(work: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            ONE_CORE.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(ONE_CORE.with(|c| c.replace(true)));
    work()
}

type SetThreads = unsafe extern "C" fn(i32);
type GetThreads = unsafe extern "C" fn() -> i32;

/// OpenBLAS's `openblas_set_num_threads` and `openblas_get_num_threads`,
/// looked up once (absent with another BLAS: Accelerate, say).
fn openblas_threads() -> Option<(SetThreads, GetThreads)> {
    static FOUND: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    let (set, get) = (*FOUND.get_or_init(|| {
        // SAFETY: dlsym with RTLD_DEFAULT and NUL-terminated names only reads.
        let (set, get) = unsafe {
            (
                libc::dlsym(libc::RTLD_DEFAULT, c"openblas_set_num_threads".as_ptr()),
                libc::dlsym(libc::RTLD_DEFAULT, c"openblas_get_num_threads".as_ptr()),
            )
        };
        (!set.is_null() && !get.is_null()).then_some((set as usize, get as usize))
    }))?;
    // SAFETY: the symbols are OpenBLAS's, of these signatures.
    Some(unsafe { (std::mem::transmute::<usize, SetThreads>(set), std::mem::transmute::<usize, GetThreads>(get)) })
}

/// While one lives, OpenBLAS runs every call on one thread, the caller's,
/// so that threads of our own can each make BLAS calls on a part of a batch
/// at once. (OpenBLAS's threading is process-wide: its idle threads spin
/// in `sched_yield` between the calls they share, and with 2 cores a fifth
/// of an embedding batch's time went there while other threads of ours
/// wanted the cores.) The count before the first is restored when the last
/// is dropped; other work in the process meanwhile gets one-thread BLAS
/// calls, on cores the parts keep busy anyway. `None` where the BLAS is
/// not OpenBLAS.
pub(crate) struct BlasThreads(());

/// Live [`BlasThreads`], and OpenBLAS's thread count before the first.
static BLAS_THREADS_HELD: std::sync::Mutex<(usize, i32)> = std::sync::Mutex::new((0, 0));

impl BlasThreads {
    /// Whether OpenBLAS's thread count can be set here.
    pub(crate) fn available() -> bool {
        openblas_threads().is_some()
    }

    /// OpenBLAS on one thread until the last of these is dropped.
    pub(crate) fn one() -> Option<Self> {
        let (set, get) = openblas_threads()?;
        let mut held = BLAS_THREADS_HELD.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.0 == 0 {
            // SAFETY: OpenBLAS's own functions, callable from any thread.
            held.1 = unsafe { get() };
            unsafe { set(1) };
        }
        held.0 += 1;
        Some(Self(()))
    }
}

impl Drop for BlasThreads {
    fn drop(&mut self) {
        let mut held = BLAS_THREADS_HELD.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        held.0 -= 1;
        if held.0 == 0 {
            if let Some((set, _)) = openblas_threads() {
                // SAFETY: as in `one`.
                unsafe { set(held.1.max(1)) };
            }
        }
    }
}

/// Runs `work(first_unit, out_part)` over `out` cut at whole `unit`s into
/// one part per core.
pub(crate) fn on_every_core(out: &mut [f32], unit: usize, work: impl Fn(usize, &mut [f32]) + Sync) {
    let units = out.len() / unit.max(1);
    let cores = cores();
    // Parts of at least 64 KiB: below that a thread costs more than it saves.
    let parts = cores.min((out.len() / (16 << 10)).max(1)).min(units.max(1));
    let per = units.div_ceil(parts) * unit;
    if parts <= 1 {
        return work(0, out);
    }
    std::thread::scope(|scope| {
        for (i, part) in out.chunks_mut(per).enumerate() {
            let work = &work;
            scope.spawn(move || work(i * per / unit, part));
        }
    });
}

/// An MLX array over `data` without copying it: MLX drops the vector when
/// it no longer needs the buffer (on the CPU, MLX's buffers are plain
/// memory).
pub(crate) fn array_of(data: Vec<f32>, shape: &[i32]) -> Array {
    assert_eq!(data.len(), shape.iter().map(|&d| d as usize).product::<usize>());
    unsafe extern "C" fn drop_vector(payload: *mut std::ffi::c_void) {
        // SAFETY: the payload is the Box made below, dropped once by MLX.
        drop(unsafe { Box::from_raw(payload.cast::<Vec<f32>>()) });
    }
    let data = Box::new(data);
    let pointer = data.as_ptr() as *mut std::ffi::c_void;
    // SAFETY: the buffer lives in the box until MLX calls `drop_vector`
    // with it; the shape outlives the call; the dtype is the vector's.
    unsafe {
        Array::from_ptr(mlx_sys::mlx_array_new_data_managed_payload(
            pointer,
            shape.as_ptr(),
            shape.len() as i32,
            mlx_sys::mlx_dtype__MLX_FLOAT32,
            Box::into_raw(data).cast(),
            Some(drop_vector),
        ))
    }
}

pub(crate) fn f32_data(a: &Array) -> Result<Array, Exception> {
    let a = if a.dtype() == Dtype::Float32 { a.contiguous()? } else { a.as_dtype(Dtype::Float32)?.contiguous()? };
    a.eval()?;
    Ok(a)
}

pub(crate) fn slice(a: &Array) -> Result<&[f32], Exception> {
    a.try_as_slice::<f32>().map_err(|e| Exception::custom(format!("reading an array on the CPU: {e}")))
}

/// Softmax over the last axis of `scores + bias`, f32: `scores`
/// `[B, heads, queries, keys]`, `bias` `[B or 1, 1, queries or 1, keys]`.
pub fn softmax_biased(scores: &Array, bias: &Array) -> Result<Array, Exception> {
    let shape = scores.shape().to_vec();
    let bias_shape = bias.shape();
    let fits = shape.len() == 4
        && bias_shape.len() == 4
        && bias_shape[1] == 1
        && bias_shape[3] == shape[3]
        && (bias_shape[0] == 1 || bias_shape[0] == shape[0])
        && (bias_shape[2] == 1 || bias_shape[2] == shape[2]);
    if !fits {
        return Err(Exception::custom(format!("softmax_biased: scores {shape:?} with a bias of {bias_shape:?}")));
    }
    let layout = BiasLayout {
        heads: shape[1] as usize,
        queries: shape[2] as usize,
        keys: shape[3] as usize,
        per_batch: bias_shape[0] > 1,
        per_query: bias_shape[2] > 1,
    };
    let (scores, bias) = (f32_data(scores)?, f32_data(bias)?);
    let (s, b) = (slice(&scores)?, slice(&bias)?);
    let mut out = vec![0.0f32; s.len()];
    on_every_core(&mut out, layout.keys, |first, part| softmax_rows_widest(s, b, layout, first, part));
    Ok(array_of(out, &shape))
}

/// Layer norm of `a + b` over the last axis (`weight`'s length), f32;
/// `bias` none: no shift.
pub fn add_layer_norm(
    a: &Array,
    b: &Array,
    weight: &Array,
    bias: Option<&Array>,
    eps: f32,
) -> Result<Array, Exception> {
    let shape = a.shape().to_vec();
    if b.shape() != shape.as_slice() || weight.ndim() != 1 || shape.last().copied() != Some(weight.shape()[0]) {
        return Err(Exception::custom(format!(
            "add_layer_norm: {shape:?} + {:?} over {:?}",
            b.shape(),
            weight.shape()
        )));
    }
    let d = weight.shape()[0] as usize;
    let zeros;
    let bias = match bias {
        Some(bias) => f32_data(bias)?,
        None => {
            zeros = Array::zeros::<f32>(&[d as i32])?;
            f32_data(&zeros)?
        }
    };
    let (a, b, weight) = (f32_data(a)?, f32_data(b)?, f32_data(weight)?);
    let (av, bv, wv, sv) = (slice(&a)?, slice(&b)?, slice(&weight)?, slice(&bias)?);
    if sv.len() != d {
        return Err(Exception::custom(format!("add_layer_norm: a shift of {} for rows of {d}", sv.len())));
    }
    let mut out = vec![0.0f32; av.len()];
    on_every_core(&mut out, d, |first, part| add_layer_norm_widest(av, bv, wv, sv, eps, first, part));
    Ok(array_of(out, &shape))
}

/// `cblas_sgemm` of the BLAS MLX's products land in (OpenBLAS, or the
/// wheel's), looked up once.
pub(crate) type Sgemm =
    unsafe extern "C" fn(i32, i32, i32, i32, i32, i32, f32, *const f32, i32, *const f32, i32, f32, *mut f32, i32);

pub(crate) fn sgemm() -> Option<Sgemm> {
    static FOUND: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let address = *FOUND.get_or_init(|| {
        // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
        let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cblas_sgemm".as_ptr()) };
        (!p.is_null()).then_some(p as usize)
    });
    // SAFETY: the symbol is CBLAS's `cblas_sgemm`, of this signature.
    address.map(|a| unsafe { std::mem::transmute::<usize, Sgemm>(a) })
}

const ROW_MAJOR: i32 = 101;
const NO_TRANSPOSE: i32 = 111;
const TRANSPOSE: i32 = 112;

/// The result of [`attention`], written by several threads at once, each
/// into columns of its own.
struct SharedOut(*mut f32);
// SAFETY: the threads write disjoint elements (see `HeadsOf::one`).
unsafe impl Sync for SharedOut {}

/// Rows of a BLAS call in [`attention`] such that rows × tokens × d stays
/// under OpenBLAS's threading threshold (65,536 × 4 multiply-adds): each
/// call then runs in the thread that makes it, and the cores share the
/// heads between them instead of OpenBLAS's threads waking for each small
/// product (with 2 cores, a quarter of the time went to their yielding).
/// Inside [`on_this_core`] (OpenBLAS held at one thread) every call is
/// the caller's anyway: a head's rows go in one call, so its keys are
/// packed once (MiniLM, 300 chunks: 31.0 against 27.7 texts/s in calls
/// of 34 rows, `scripts/bench.d/embed_ab.py 4`).
fn rows_per_call(tokens: usize, d: usize) -> usize {
    if ONE_CORE.with(std::cell::Cell::get) {
        return tokens.max(1);
    }
    ((65_536 * 4 - 1) / (tokens * d).max(1)).clamp(1, tokens.max(1))
}

/// One layer's q, k, v (rows of `stride`, the heads side by side from
/// each slice's start) and padding bias, for [`attention_into`].
struct HeadsOf<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    bias: &'a [f32],
    tokens: usize,
    stride: usize,
    width: usize,
    d: usize,
    scale: f32,
}

impl HeadsOf<'_> {
    /// Head `head` of text `text` into its columns of `out`: the scores by
    /// BLAS products with the rows' stride, the softmax while they are in
    /// cache, the weighted sum of v.
    ///
    /// # Safety
    /// `out` holds `texts × tokens × width` floats, and no other thread
    /// writes this text's rows in this head's columns.
    unsafe fn one(
        &self,
        sgemm: Sgemm,
        text: usize,
        head: usize,
        out: *mut f32,
        scores: &mut [f32],
        weights: &mut [f32],
    ) {
        let (tokens, width, d) = (self.tokens, self.width, self.d);
        let column = text * tokens * self.stride + head * d;
        let written = text * tokens * width + head * d;
        let (n, w) = (tokens as i32, self.stride as i32);
        let step = rows_per_call(tokens, d);
        for first in (0..tokens).step_by(step) {
            let rows = step.min(tokens - first);
            // SAFETY: `rows` query rows of stride `stride` from `column +
            // first × stride`, d wide; all `tokens` key rows; `rows` rows of
            // the tokens × tokens buffer.
            unsafe {
                let q = self.q.as_ptr().add(column + first * self.stride);
                let k = self.k.as_ptr().add(column);
                let scores = scores.as_mut_ptr().add(first * tokens);
                product(sgemm, true, (rows, tokens, d), self.scale, (q, w), (k, w), 0.0, (scores, n));
            }
        }
        let layout = BiasLayout { heads: 1, queries: tokens, keys: tokens, per_batch: false, per_query: false };
        softmax_rows_widest(scores, &self.bias[text * tokens..(text + 1) * tokens], layout, 0, weights);
        for first in (0..tokens).step_by(step) {
            let rows = step.min(tokens - first);
            // SAFETY: `rows` rows of the weights; all of v's rows in this
            // head's columns; `rows` rows of `out` in them (the caller's).
            unsafe {
                let p = weights.as_ptr().add(first * tokens);
                let o = out.add(written + first * width);
                product(
                    sgemm,
                    false,
                    (rows, d, tokens),
                    1.0,
                    (p, n),
                    (self.v.as_ptr().add(column), w),
                    0.0,
                    (o, width as i32),
                );
            }
        }
    }
}

/// The sizes of one [`attention_into`] call.
#[derive(Clone, Copy)]
pub(crate) struct Attention {
    pub texts: usize,
    pub tokens: usize,
    pub heads: usize,
    /// Width of a row of the result (all heads).
    pub width: usize,
    /// Distance between rows of q, k and v (`width`, or 3 × `width` where
    /// they are one fused projection's thirds).
    pub stride: usize,
    pub scale: f32,
}

/// [`attention`] over slices: q, k, v of rows `shape.stride` apart (each
/// slice starting at its first head), `bias` `[texts, tokens]`, into `out`
/// `[texts, tokens, width]`; the (text, head) pairs shared among the cores.
pub(crate) fn attention_into(
    sgemm: Sgemm,
    qkv: (&[f32], &[f32], &[f32]),
    bias: &[f32],
    shape: Attention,
    out: &mut [f32],
) {
    let Attention { texts, tokens, heads, width, stride, scale } = shape;
    let (q, k, v) = qkv;
    let rows_end = texts.saturating_sub(1) * tokens * stride + tokens.saturating_sub(1) * stride + width;
    assert!(texts * tokens == 0 || (q.len() >= rows_end && k.len() >= rows_end && v.len() >= rows_end));
    assert!(out.len() == texts * tokens * width && bias.len() == texts * tokens && width.is_multiple_of(heads));
    let heads_of = HeadsOf { q, k, v, bias, tokens, stride, width, d: width / heads, scale };
    // Every (text, head) on some core, each core a range of them.
    let units = texts * heads;
    let cores = cores().min(units.max(1));
    let per = units.div_ceil(cores.max(1));
    let written = SharedOut(out.as_mut_ptr());
    std::thread::scope(|scope| {
        for first in (0..units).step_by(per.max(1)) {
            let heads_of = &heads_of;
            let written = &written;
            let work = move || {
                let mut scores = vec![0.0f32; tokens * tokens];
                let mut weights = vec![0.0f32; tokens * tokens];
                for unit in first..(first + per).min(units) {
                    // SAFETY: each unit writes only its own head's columns
                    // of its own text's rows; units are disjoint; the
                    // slices hold the rows asserted above.
                    unsafe { heads_of.one(sgemm, unit / heads, unit % heads, written.0, &mut scores, &mut weights) };
                }
            };
            if first + per >= units {
                work(); // the last range on this thread
            } else {
                scope.spawn(work);
            }
        }
    });
}

/// Attention for an encoder, heads read where the projections put them:
/// q, k, v `[B, L, width]` (heads side by side in `width`), `bias`
/// `[B, 1, 1, L]` (0 to attend, -1e9 at padding), f32; the result
/// `[B, L, width]`, as the output projection takes it. Per text and head,
/// the (text, head) pairs shared among the cores: the scores by BLAS
/// products with the rows' stride (no head is transposed or copied out),
/// [`softmax_biased`]'s softmax while they are in cache, and the weighted
/// sum of v written straight into its columns of the result. `None` where
/// no CBLAS is found.
pub fn attention(
    q: &Array,
    k: &Array,
    v: &Array,
    heads: usize,
    scale: f32,
    bias: &Array,
) -> Result<Option<Array>, Exception> {
    let Some(sgemm) = sgemm() else { return Ok(None) };
    let shape = q.shape().to_vec();
    let (b, l) = (shape.first().copied().unwrap_or(0), shape.get(1).copied().unwrap_or(0));
    let fits = shape.len() == 3
        && k.shape() == shape.as_slice()
        && v.shape() == shape.as_slice()
        && heads > 0
        && (shape[2] as usize).is_multiple_of(heads)
        && bias.shape() == [b, 1, 1, l];
    if !fits {
        return Err(Exception::custom(format!(
            "attention: q {shape:?}, k {:?}, v {:?}, {heads} heads, bias {:?}",
            k.shape(),
            v.shape(),
            bias.shape()
        )));
    }
    let (texts, tokens, width) = (b as usize, l as usize, shape[2] as usize);
    let (q, k, v, bias) = (f32_data(q)?, f32_data(k)?, f32_data(v)?, f32_data(bias)?);
    let mut out = vec![0.0f32; texts * tokens * width];
    let shape_of = Attention { texts, tokens, heads, width, stride: width, scale };
    attention_into(sgemm, (slice(&q)?, slice(&k)?, slice(&v)?), slice(&bias)?, shape_of, &mut out);
    Ok(Some(array_of(out, &shape)))
}

/// `c = alpha a b + beta c` by CBLAS, row-major: `a` `[m, k]`, `b` `[k,
/// n]` (`[n, k]` read transposed where `b_transposed`), `c` `[m, n]`, each
/// with its rows' stride.
///
/// # Safety
/// Each pointer holds its matrix at its stride.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    sgemm: Sgemm,
    b_transposed: bool,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (a, lda): (*const f32, i32),
    (b, ldb): (*const f32, i32),
    beta: f32,
    (c, ldc): (*mut f32, i32),
) {
    let transpose = if b_transposed { TRANSPOSE } else { NO_TRANSPOSE };
    // SAFETY: the caller's.
    unsafe {
        sgemm(ROW_MAJOR, NO_TRANSPOSE, transpose, m as i32, n as i32, k as i32, alpha, a, lda, b, ldb, beta, c, ldc)
    }
}

/// `c = a W^T + beta c`: `a` `[rows, inner]`, `w` `[outputs, inner]`, `c`
/// `[rows, outputs]`, row-major f32, by CBLAS.
pub(crate) fn gemm_nt(sgemm: Sgemm, a: &[f32], inner: usize, w: &[f32], beta: f32, c: &mut [f32]) {
    let outputs = w.len() / inner.max(1);
    gemm_nt_columns(sgemm, a, inner, w, beta, c, 0, outputs)
}

/// [`gemm_nt`] into columns `first..first + outputs` of `c`'s rows of
/// `stride` (the thirds of a fused q/k/v buffer, say).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_nt_columns(
    sgemm: Sgemm,
    a: &[f32],
    inner: usize,
    w: &[f32],
    beta: f32,
    c: &mut [f32],
    first: usize,
    stride: usize,
) {
    let outputs = w.len() / inner.max(1);
    let rows = a.len() / inner.max(1);
    assert!(inner > 0 && a.len() == rows * inner && w.len() == outputs * inner);
    assert!(first + outputs <= stride && c.len() == rows * stride);
    let (ai, ci) = (inner as i32, stride as i32);
    // SAFETY: a and w hold exactly the matrices named, and c `rows` rows of
    // `stride` with these columns inside them (asserted).
    unsafe {
        let c = c.as_mut_ptr().add(first);
        product(sgemm, true, (rows, outputs, inner), 1.0, (a.as_ptr(), ai), (w.as_ptr(), ai), beta, (c, ci))
    }
}

/// Every row of `c` set to `row`, on every core (a product's bias before
/// a BLAS call that adds to it, as MLX's `addmm` does).
pub(crate) fn fill_rows(c: &mut [f32], row: &[f32]) {
    on_every_core(c, row.len(), |_, part| {
        for r in part.chunks_exact_mut(row.len()) {
            r.copy_from_slice(row);
        }
    });
}

#[inline(always)]
fn bias_gelu_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v = gelu_one(*v + b);
        }
    }
}

fn bias_gelu_widest(x: &mut [f32], bias: &[f32]) {
    widest!(bias_gelu_rows(x: &mut [f32], bias: &[f32]) => bias_gelu_rows(x, bias))
}

/// `x = gelu(x + bias)` over rows of `bias.len()`, in place, on every core.
pub(crate) fn bias_gelu_in_place(x: &mut [f32], bias: &[f32]) {
    on_every_core(x, bias.len(), |_, part| bias_gelu_widest(part, bias));
}

/// `x = layer_norm(x + (a + a_bias))` a row at a time: the post-norm
/// layer's residual, its sublayer's product and that product's bias (the
/// sum in the order `addmm` then the residual add give it), normalized as
/// [`add_layer_norm_rows`] does.
#[inline(always)]
fn residual_norm_rows(x: &mut [f32], a: &[f32], a_bias: &[f32], weight: &[f32], shift: &[f32], eps: f32) {
    let d = weight.len();
    let whole = d - d % LANES;
    for (o, a) in x.chunks_exact_mut(d).zip(a.chunks_exact(d)) {
        let mut sums = [0.0f32; LANES];
        for ((o, a), b) in o[..whole].chunks_exact_mut(LANES).zip(a.chunks_exact(LANES)).zip(a_bias.chunks_exact(LANES))
        {
            for l in 0..LANES {
                o[l] += a[l] + b[l];
                sums[l] += o[l];
            }
        }
        let mut sum: f32 = sums.iter().sum();
        for j in whole..d {
            o[j] += a[j] + a_bias[j];
            sum += o[j];
        }
        normalize_summed(o, sum, weight, shift, eps);
    }
}

#[allow(clippy::too_many_arguments)]
fn residual_norm_widest(x: &mut [f32], a: &[f32], a_bias: &[f32], w: &[f32], s: &[f32], eps: f32) {
    widest!(residual_norm_rows(x: &mut [f32], a: &[f32], a_bias: &[f32], w: &[f32], s: &[f32], eps: f32)
        => residual_norm_rows(x, a, a_bias, w, s, eps))
}

/// `x = layer_norm(x + a + a_bias)` over rows of `weight.len()`, scaled by
/// `weight` and shifted by `shift`, in place, on every core.
pub(crate) fn residual_norm_in_place(
    x: &mut [f32],
    a: &[f32],
    a_bias: &[f32],
    weight: &[f32],
    shift: &[f32],
    eps: f32,
) {
    let d = weight.len();
    assert!(a.len() == x.len() && a_bias.len() == d && shift.len() == d && x.len().is_multiple_of(d));
    on_every_core(x, d, |first, part| {
        residual_norm_widest(part, &a[first * d..first * d + part.len()], a_bias, weight, shift, eps)
    });
}

/// GELU with `cpu_math`'s erf, f32, any shape.
pub fn gelu(x: &Array) -> Result<Array, Exception> {
    let shape = x.shape().to_vec();
    let x = f32_data(x)?;
    let v = slice(&x)?;
    let mut out = vec![0.0f32; v.len()];
    on_every_core(&mut out, 1, |first, part| gelu_widest(&v[first..first + part.len()], part));
    Ok(array_of(out, &shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::indexing::IndexOp;

    fn values(n: i32, scale: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 2.0 * scale).collect()
    }

    #[test]
    fn softmax_agrees_with_mlx_for_every_bias_layout() {
        // 37 keys: two whole lane groups and a tail; 2 x 3 heads x 5 queries.
        let scores = Array::from_slice(&values(2 * 3 * 5 * 37, 30.0), &[2, 3, 5, 37]);
        let mut padding = vec![0.0f32; 2 * 37];
        padding[37 + 30..].iter_mut().for_each(|b| *b = -1e9);
        let layouts = [
            Array::from_slice(&padding, &[2, 1, 1, 37]),
            Array::from_slice(&values(2 * 5 * 37, 3.0), &[2, 1, 5, 37]),
            Array::from_slice(&values(37, 3.0), &[1, 1, 1, 37]),
        ];
        for bias in &layouts {
            let want = mlx_rs::ops::softmax_axis(scores.add(bias).unwrap(), -1, None).unwrap();
            let got = softmax_biased(&scores, bias).unwrap();
            assert_eq!(got.shape(), want.shape());
            // Relative to each value, masked ones (~0) included.
            let close = got.subtract(&want).unwrap().abs().unwrap();
            let bound = want.multiply(Array::from_f32(2e-6)).unwrap().add(Array::from_f32(1e-30)).unwrap();
            assert!(
                close.le(&bound).unwrap().all(None).unwrap().try_item_cast::<bool>().unwrap(),
                "bias {:?}",
                bias.shape()
            );
        }
        // The padded keys of the second text weigh nothing.
        let got = softmax_biased(&scores, &layouts[0]).unwrap();
        let second = got.index((1, .., .., 30..));
        assert!(second.max(None).unwrap().try_item_cast::<f32>().unwrap() < 1e-30);
    }

    #[test]
    fn softmax_refuses_a_bias_that_does_not_broadcast() {
        let scores = Array::zeros::<f32>(&[2, 3, 5, 8]).unwrap();
        assert!(softmax_biased(&scores, &Array::zeros::<f32>(&[3, 1, 1, 8]).unwrap()).is_err());
        assert!(softmax_biased(&scores, &Array::zeros::<f32>(&[2, 1, 1, 7]).unwrap()).is_err());
    }

    #[test]
    fn attention_agrees_with_mlx_without_moving_heads() {
        // 3 texts of 21 tokens (a lane group and a tail), 4 heads of 8.
        let (b, l, heads, d) = (3, 21, 4, 8);
        let make = |scale: f32, shift: usize| {
            let v = values(b * l * heads * d + shift as i32, scale)[shift..].to_vec();
            Array::from_slice(&v, &[b, l, heads * d])
        };
        let (q, k, v) = (make(2.0, 0), make(2.0, 7), make(1.0, 13));
        let mut keep = vec![true; (b * l) as usize];
        keep[(l + 15) as usize..(2 * l) as usize].iter_mut().for_each(|x| *x = false);
        let keep = Array::from_slice(&keep, &[b, 1, 1, l]);
        let bias = mlx_rs::ops::select(&keep, Array::from_f32(0.0), Array::from_f32(-1e9)).unwrap();
        let scale = 1.0 / (d as f32).sqrt();
        let to_heads = |x: &Array| x.reshape(&[b, l, heads, d]).unwrap().transpose_axes(&[0, 2, 1, 3]).unwrap();
        let want = mlx_rs::fast::scaled_dot_product_attention(
            to_heads(&q),
            to_heads(&k),
            to_heads(&v),
            scale,
            mlx_rs::fast::ScaledDotProductAttentionMask::Array(&keep),
            None,
        )
        .unwrap()
        .transpose_axes(&[0, 2, 1, 3])
        .unwrap()
        .reshape(&[b, l, heads * d])
        .unwrap();
        let got = attention(&q, &k, &v, heads as usize, scale, &bias).unwrap().expect("MLX's CBLAS is linked");
        assert_eq!(got.shape(), want.shape());
        let worst = got.subtract(&want).unwrap().abs().unwrap().max(None).unwrap().try_item_cast::<f32>().unwrap();
        assert!(worst < 1e-5, "{worst}");
        assert!(attention(&q, &k, &v, 5, scale, &bias).is_err(), "32 features in 5 heads");
    }

    #[test]
    fn add_layer_norm_agrees_with_mlx() {
        // Rows of 37 (lane groups and a tail), enough rows for several parts.
        let (rows, d) = (1_000, 37);
        let a = Array::from_slice(&values(rows * d, 3.0), &[10, rows / 10, d]);
        let b = a.multiply(Array::from_f32(-0.3)).unwrap().add(Array::from_f32(0.7)).unwrap();
        let weight = Array::from_slice(&values(d, 2.0), &[d]);
        let shift = Array::from_slice(&values(d, 0.5), &[d]);
        for bias in [Some(&shift), None] {
            let want = mlx_rs::fast::layer_norm(a.add(&b).unwrap(), &weight, bias, 1e-12).unwrap();
            let got = add_layer_norm(&a, &b, &weight, bias, 1e-12).unwrap();
            assert_eq!(got.shape(), want.shape());
            let worst = got.subtract(&want).unwrap().abs().unwrap().max(None).unwrap().try_item_cast::<f32>().unwrap();
            assert!(worst < 1e-5, "{worst}");
        }
        assert!(add_layer_norm(&a, &b, &shift.index(..3), None, 1e-12).is_err());
    }

    #[test]
    fn gelu_agrees_with_mlx_to_float_precision() {
        // Past the parallel threshold (several parts) and a tail.
        let x = Array::from_slice(&values(100_003, 6.0), &[100_003]);
        let got = gelu(&x).unwrap();
        let want = mlx_rs::nn::gelu(&x).unwrap();
        let worst = got.subtract(&want).unwrap().abs().unwrap().max(None).unwrap().try_item_cast::<f32>().unwrap();
        assert!(worst < 5e-6, "{worst}");
        // And the same as cpu_math's polynomial in MLX operations, to rounding.
        let polynomial = super::super::cpu_math::gelu_polynomial(&x).unwrap();
        assert!(
            got.subtract(&polynomial).unwrap().abs().unwrap().max(None).unwrap().try_item_cast::<f32>().unwrap() < 1e-6
        );
    }
}
