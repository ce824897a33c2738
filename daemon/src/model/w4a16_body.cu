    // W4A16 for few rows: out[m, n] = sum_k x[m, k] * (scale * q[n, k] + bias),
    // MLX's affine 4-bit packing (uint32 words, low nibble first; scales and
    // biases per GROUP consecutive k). Names: T (float type), ROWS (rows of
    // x), R (output features a warp computes), NW (warps a block), DQ (how a
    // nibble becomes a float: 0 shift and mask, 1 byte permute), K, N, GROUP.
    // x [ROWS, K] T row-contiguous (any leading axes), 16-byte aligned rows; w [N, K / 8];
    // scales, biases [N, K / GROUP]; out [ROWS, N]. Needs K % 32 == 0,
    // GROUP % 32 == 0, N % R == 0. The prelude defines `load8(m, k)` (8
    // values of x's row m from feature k, as a uint4 of T), `wrow(n0, r)`
    // (the weight row of the warp's r-th output), `prepare()` (run once by
    // each warp that has outputs, before the product) and `store(m, n0, r, v,
    // other)` (writes the warp's r-th output of row m, sum v; `other` is
    // the sum of its pair r ^ 1): plain, with a residual added, or a fused
    // gate/up's rows taken in pairs (gate j, up j) and SwiGLU written.
    //
    // Each lane takes 16 bytes (32 values) of each of its warp's R weight
    // rows at a time, so a warp reads R rows' bytes once, coalesced; the 32
    // values lie in one group (one scale, one bias). A nibble becomes a float
    // without an integer conversion: 0x4B000000 | q is the float 2^23 + q.
    const int chunks = K / 32;
    const int groups = K / GROUP;
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * NW + (threadIdx.x >> 5)) * R;
    if (n0 >= N) return;
    // The prelude's set-up for the warp (the normed forms' row norms).
    prepare();
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    float acc[ROWS][R];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
    }
#pragma unroll 2
    for (int c = lane; c < chunks; c += 32) {
        uint4 q[R];
#pragma unroll
        for (int r = 0; r < R; ++r) q[r] = __ldg(w4 + (size_t)wrow(n0, r) * chunks + c);
        const int g = (c * 32) / GROUP;
        float s[R], b[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            s[r] = static_cast<float>(scales[(size_t)wrow(n0, r) * groups + g]);
            b[r] = static_cast<float>(biases[(size_t)wrow(n0, r) * groups + g]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint4 xv[ROWS];
#pragma unroll
            for (int m = 0; m < ROWS; ++m) xv[m] = load8(m, c * 32 + j * 8);
            uint32_t word[R], lo[R], hi[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                word[r] = j == 0 ? q[r].x : j == 1 ? q[r].y : j == 2 ? q[r].z : q[r].w;
                lo[r] = word[r] & 0x0F0F0F0Fu;
                hi[r] = (word[r] >> 4) & 0x0F0F0F0Fu;
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float wv[R];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    uint32_t bits;
                    if (DQ == 1) {
                        // Byte i/2 of the even (lo) or odd (hi) nibbles under the exponent byte.
                        bits = __byte_perm((i & 1) ? hi[r] : lo[r], 0x4B000000u, 0x7440 + (i >> 1));
                    } else {
                        bits = ((word[r] >> (4 * i)) & 0xFu) | 0x4B000000u;
                    }
                    wv[r] = fmaf(s[r], __uint_as_float(bits) - 8388608.f, b[r]);
                }
#pragma unroll
                for (int m = 0; m < ROWS; ++m) {
                    const float xi = static_cast<float>(reinterpret_cast<const T*>(&xv[m])[i]);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[m][r] = fmaf(wv[r], xi, acc[m][r]);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[m][r];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            acc[m][r] = v;
        }
    }
    // Lane r * ROWS + m stores (m, r) (ROWS * R <= 32), else lane 0 all.
    if (ROWS * R <= 32) {
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (lane == r * ROWS + m) store(m, n0, r, acc[m][r], acc[m][R > 1 ? (r ^ 1) : r]);
            }
        }
    } else if (lane == 0) {
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
#pragma unroll
            for (int r = 0; r < R; ++r) store(m, n0, r, acc[m][r], acc[m][R > 1 ? (r ^ 1) : r]);
        }
    }
