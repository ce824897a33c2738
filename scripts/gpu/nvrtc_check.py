#!/usr/bin/env python3
"""Compiles mlxbc's CUDA kernel bodies (the W4A16 matmul in its five forms,
the q/k norm and rope, the LoRA update's two, the padded batch's attention)
with NVRTC on this machine, no GPU needed, inside a
wrapper shaped like the one MLX's custom-kernel API generates (inputs as
pointers, `NAME_shape` arrays, the template arguments): a syntax or type
error shows here, not as a kernel that failed to build in a device lease.

Usage: nvrtc_check.py REPO WHEELS (WHEELS: nvidia-cuda-nvrtc-cu12 and
nvidia-cuda-runtime-cu12 unpacked; scripts/gpu/nvrtc-check fetches them)."""
import ctypes, os, re, sys
WHEELS = sys.argv[2]
lib = ctypes.CDLL(os.path.join(WHEELS, "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
INC = os.path.join(WHEELS, "nvidia/cuda_runtime/include")

def compile_(src, name_expr, label):
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None)
    assert rc == 0, rc
    lib.nvrtcAddNameExpression(prog, name_expr.encode())
    opts = [b"--std=c++17", b"-arch=compute_90", ("-I" + INC).encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    print(f"{label}: {'OK' if rc == 0 else 'FAILED'}")
    if log.value.strip():
        print(log.value.decode()[:3000])
    return rc == 0

def rust_const(path, name):
    s = open(path).read()
    m = re.search(r'const ' + name + r': &str = r#"(.*?)"#;', s, re.S)
    return m.group(1)

HDR = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\ntypedef unsigned int uint32_t;\ntypedef int int32_t;\n"
root = sys.argv[1]
body = open(f"{root}/daemon/src/model/w4a16_body.cu").read()
w4 = f"{root}/daemon/src/model/w4a16.rs"
plain_rows = "auto wrow = [&](int n0, int r) -> int { return n0 + r; };"
swiglu_rows = "auto wrow = [&](int n0, int r) -> int { return (r & 1) ? N / 2 + n0 / 2 + r / 2 : n0 / 2 + r / 2; };"
plain_store = "auto store = [&](int m, int n0, int r, float v, float) { out[(size_t)m * N + n0 + r] = static_cast<T>(v); };"
ok = True
plain_read, normed_read = rust_const(w4, "PLAIN_READ"), rust_const(w4, "NORMED_READ")
for label, rows, store, extra, read in [
    ("w4a16 plain", plain_rows, plain_store, None, plain_read),
    ("w4a16 residual", plain_rows, rust_const(w4, "RESIDUAL_STORE"), "res", plain_read),
    ("w4a16 gate/up SwiGLU", swiglu_rows, rust_const(w4, "SWIGLU_STORE"), None, plain_read),
    ("w4a16 normed", plain_rows, plain_store, "gamma", normed_read),
    ("w4a16 normed gate/up SwiGLU", swiglu_rows, rust_const(w4, "SWIGLU_STORE"), "gamma", normed_read),
]:
    prelude = ("const int K = w_shape[1] * 8;\n const int N = w_shape[0];\n const int GROUP = K / scales_shape[1];\n"
               f"{read}\n{rows}\n{store}\n")
    args = "const T* x, const uint32_t* w, const T* scales, const T* biases, " + \
        (f"const T* {extra}, " if extra else "") + "const int* x_shape, const int* w_shape, const int* scales_shape, T* out"
    normed = extra == "gamma"
    tpl = "typename T, int ROWS, int R, int NW, int DQ" + (", int EPS_BITS" if normed else "")
    src = HDR + f"template <{tpl}>\n__global__ void k({args}) {{\n{prelude}{body}\n}}\n"
    for t in ["__half", "__nv_bfloat16"]:
        for rr in (1, 4):
            # 1e-6's f32 bits for the normed forms.
            ok &= compile_(src, f"k<{t},{rr},4,4,1{',897988541' if normed else ''}>", f"{label} {t} rows {rr}")
qk = rust_const(f"{root}/daemon/src/model/qk_rope.rs", "SOURCE")
args = "const T* y, const T* qw, const T* kw, const float* freqs, const float* params, const int32_t* positions, " \
    "const int* y_shape, const int* positions_shape, T* out"
src = HDR + f"template <typename T, int D, int HQ, int NORM, int FREQS>\n__global__ void k({args}) {{\n{qk}\n}}\n"
for t in ["__half", "__nv_bfloat16"]:
    ok &= compile_(src, f"k<{t},128,32,1,0>", f"qk_rope {t} norm")
    ok &= compile_(src, f"k<{t},64,9,0,1>", f"qk_rope {t} freqs")


def wrapped(body, templates, inputs, output):
    """`body` inside a kernel of `templates` over `inputs` [(name, C type)]
    writing `output` (name, C type), with `NAME_shape` / `NAME_strides`
    declared for each input the body refers to them by, as MLX does."""
    params = []
    for name, ctype in inputs:
        params.append(f"const {ctype}* {name}")
        if f"{name}_shape" in body:
            params.append(f"const int* {name}_shape")
        if f"{name}_strides" in body:
            params.append(f"const long long* {name}_strides")
    params.append(f"{output[1]}* {output[0]}")
    tpl = ", ".join(templates)
    return HDR + f"template <{tpl}>\n__global__ void k({', '.join(params)}) {{\n{body}\n}}\n"


# The LoRA update's two kernels (model/lora_kernel.rs) and the padded
# batch's attention (model/batch_attention.rs).
lora = f"{root}/daemon/src/model/lora_kernel.rs"
lora_t = ["typename T", "int STACKED", "int THREADS", "int SPLIT"]
xa = wrapped(rust_const(lora, "XA_BODY"), lora_t, [("x", "T"), ("a", "T")], ("partial", "float"))
add = wrapped(rust_const(lora, "ADD_BODY"), lora_t, [("y", "T"), ("partial", "float"), ("b", "T")], ("out", "T"))
att = wrapped(rust_const(f"{root}/daemon/src/model/batch_attention.rs", "SOURCE"),
              ["typename T", "int D", "int NW", "int SCALE_BITS"],
              [("q", "T"), ("k", "T"), ("v", "T"), ("starts", "int32_t"), ("ends", "int32_t")], ("out", "T"))
for t in ["__half", "__nv_bfloat16"]:
    for stacked in (0, 1):
        ok &= compile_(xa, f"k<{t},{stacked},256,16>", f"lora_xa {t} stacked {stacked}")
        ok &= compile_(add, f"k<{t},{stacked},256,16>", f"lora_add {t} stacked {stacked}")
    ok &= compile_(att, f"k<{t},128,16,1035993203>", f"padded attention {t}")
# Dense products of 2-16 rows (model/dense_rows.rs).
dense = wrapped(rust_const(f"{root}/daemon/src/model/dense_rows.rs", "SOURCE"),
                ["typename T", "int R", "int NW", "int MAXROWS"], [("x", "T"), ("w", "T")], ("out", "T"))
for t in ["__half", "__nv_bfloat16", "float"]:
    ok &= compile_(dense, f"k<{t},4,4,16>", f"dense rows {t}")
sys.exit(0 if ok else 1)
