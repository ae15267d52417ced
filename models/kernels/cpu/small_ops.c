/* The small ops of a decode step (RMS norm with the residual add, rotary, SiLU-and-multiply),
 * the greedy argmax, the bandwidth ruler, and the variant this library was compiled as.
 *
 * These and the other sources of this folder are compiled by models/kernels/native_build.py once
 * per instruction-set variant (models/kernels/cpu_variants.py) and loaded with ctypes; each kernel
 * has a plain-C path, vectorized by the compiler for whatever the variant targets, and faster
 * paths for instruction sets that have them (AVX-512 BF16 / VNNI, AVX2, NEON dot products). The
 * engine only runs a kernel where it measured faster than PyTorch's on this machine
 * (models/kernels/linear_choice.py, models/layers/attention.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifndef MM_VARIANT
#define MM_VARIANT "unnamed"
#endif

/* The variant this library was compiled as (models/kernels/cpu_variants.py). */
const char* mm_variant(void) { return MM_VARIANT; }

int64_t mm_solo_bytes = 1 << 20;
void mm_set_solo_bytes(int64_t bytes) { mm_solo_bytes = bytes; }

/* Per row of x [rows, n] float32, the index of its largest value, the first of equal ones, as
 * torch.argmax (a NaN counts as the largest: the first NaN's index). One pass for the maximum
 * (vectorized), one to find it: PyTorch's argmax does not vectorize over a vocabulary. */
void mm_argmax(const float* x, int64_t rows, int64_t n, int64_t* out) {
    for (int64_t r = 0; r < rows; r++) {
        const float* v = x + r * n;
        float top = -INFINITY;
        int nan = 0;
        _Pragma("omp simd reduction(max:top) reduction(|:nan)")
        for (int64_t j = 0; j < n; j++) {
            top = v[j] > top ? v[j] : top;
            nan |= v[j] != v[j];
        }
        out[r] = 0;
        for (int64_t j = 0; j < n; j++)
            if (nan ? v[j] != v[j] : v[j] == top) {
                out[r] = j;
                break;
            }
    }
}

/* The sum of x [n]: a plain streaming read, the ruler the benchmarks hold decode against. */
double mm_read_sum(const float* x, int64_t n, int threads) {
    double total = 0.0;
    _Pragma("omp parallel for num_threads(threads) schedule(static) reduction(+:total)")
    for (int64_t c = 0; c < n; c += 4096) {
        const int64_t end = c + 4096 < n ? c + 4096 : n;
        float part = 0.0f;
        _Pragma("omp simd reduction(+:part)")
        for (int64_t i = c; i < end; i++) part += x[i];
        total += part;
    }
    return total;
}

/* Fused small ops of a decode step: each replaces several PyTorch operators (and their
 * dispatch, which dominates at a decode's few rows) with one call, rounding where the operator
 * chain it replaces rounds, so that results match it (up to float32 summation order). One thread:
 * at a few rows the work is smaller than waking a thread pool. */

/* x rounded to `dt` (float32: unchanged) */
static inline float round_to(int dt, float x) {
    return dt == DTYPE_F32 ? x : bf16_to_f32(f32_to_bf16(x));
}

/* RMS norm of rows [rows, dim]: delta != NULL first forms h = x + delta in the dtype (written to
 * `sum`), then normalizes h. mode 0: normed * w in float32 (F.rms_norm, for float32); 1: w *
 * dtype(normed), the product rounded (reduced precision); 2: dtype(normed * (1 + w)) (unit
 * offset). normed = h * rsqrt(mean(h^2) + eps), in float32. Nonzero when out of memory. */
int mm_rms_norm(const void* x, const void* delta, void* sum, const void* w, void* out, int dt,
                int64_t rows, int64_t dim, float eps, int mode) {
    float* work = malloc(sizeof(float) * (size_t)(3 * dim));
    if (work == NULL) return 1;
    float *h = work, *other = work + dim, *weight = work + 2 * dim;
    load_row(weight, w, dt, 0, dim);
    for (int64_t r = 0; r < rows; r++) {
        load_row(h, x, dt, r * dim, dim);
        if (delta != NULL) {
            load_row(other, delta, dt, r * dim, dim);
            _Pragma("omp simd")
            for (int64_t j = 0; j < dim; j++) h[j] += other[j];
            store_row(sum, h, dt, r * dim, dim);
            load_row(h, sum, dt, r * dim, dim);  /* the sum as rounded to the dtype */
        }
        float squares = 0.0f;
        _Pragma("omp simd reduction(+:squares)")
        for (int64_t j = 0; j < dim; j++) squares += h[j] * h[j];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        if (mode == NORM_FLOAT32) {
            _Pragma("omp simd")
            for (int64_t j = 0; j < dim; j++) other[j] = h[j] * inv * weight[j];
        } else if (mode == NORM_REDUCED) {
            _Pragma("omp simd")
            for (int64_t j = 0; j < dim; j++) {
                const float normed = h[j] * inv;
                other[j] = weight[j] * (dt == DTYPE_F32 ? normed
                                                        : bf16_to_f32(f32_to_bf16(normed)));
            }
        } else {
            _Pragma("omp simd")
            for (int64_t j = 0; j < dim; j++) other[j] = h[j] * inv * (1.0f + weight[j]);
        }
        store_row(out, other, dt, r * dim, dim);
    }
    free(work);
    return 0;
}

/* Rotary embedding of x [tokens, heads, dim] (token t at t * token_stride) with cos / sin
 * [tokens, dim / 2] (in x's dtype) into out [tokens, heads, dim]:
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product and sum rounded to the dtype as
 * PyTorch's elementwise ops round them. */
/* products and sums rounded separately, as PyTorch's separate ops do: no fused multiply-add */
__attribute__((optimize("fp-contract=off")))
void mm_rotary(const void* x, const void* cos, const void* sin, void* out, int dt, int64_t tokens,
               int64_t heads, int64_t dim, int64_t token_stride) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t in = t * token_stride + h * dim, at = (t * heads + h) * dim;
            for (int64_t j = 0; j < half; j++) {
                const float c = load_x(cos, dt, t * half + j), s = load_x(sin, dt, t * half + j);
                const float x1 = load_x(x, dt, in + j), x2 = load_x(x, dt, in + half + j);
                store(out, dt, at + j, round_to(dt, x1 * c) - round_to(dt, x2 * s));
                store(out, dt, at + half + j, round_to(dt, x2 * c) + round_to(dt, x1 * s));
            }
        }
}

/* silu(gate) * up for gate_up [rows, 2 * inner] (gate first) -> out [rows, inner]; silu rounded
 * to the dtype before the product, as two PyTorch ops would. silu(g) = g / (1 + exp(-g)),
 * written with e = exp(-|g|) <= 1 so that the loop vectorizes (no libm call). */
static inline float silu(float g) {
    const float e = exp_nonpositive(-fabsf(g));
    return (g >= 0.0f ? g : g * e) / (1.0f + e);
}

void mm_silu_mul(const void* gate_up, void* out, int dt, int64_t rows, int64_t inner) {
    for (int64_t r = 0; r < rows; r++) {
        if (dt == DTYPE_F32) {
            const float* g = (const float*)gate_up + r * 2 * inner;
            float* o = (float*)out + r * inner;
            _Pragma("omp simd")
            for (int64_t j = 0; j < inner; j++) o[j] = silu(g[j]) * g[inner + j];
        } else {
            const uint16_t* g = (const uint16_t*)gate_up + r * 2 * inner;
            uint16_t* o = (uint16_t*)out + r * inner;
            _Pragma("omp simd")
            for (int64_t j = 0; j < inner; j++) {
                const float a = bf16_to_f32(f32_to_bf16(silu(bf16_to_f32(g[j]))));
                o[j] = f32_to_bf16(a * bf16_to_f32(g[inner + j]));
            }
        }
    }
}

/* An activation of a decode step's rows, each value computed from its own input alone: PyTorch
 * computes these with vector code for some values and scalar code for the others, by where
 * they fall in the buffer (the tail of a vector loop, a thread's share), which moves with the
 * step's row count, and the two differ in the last bits. Here no value's result depends on its
 * place, so a row computes alike whatever else the step holds (speculative decoding's verified
 * rows equal decodes of their tokens). x and out [n], float32 or bfloat16 (computed in float32
 * and rounded once). kind: 0 sigmoid, 1 silu, 2 softplus (PyTorch's: x past 20 is x),
 * 3 exp, 4 tanh, 5 GELU with the tanh approximation, 6 GELU (erf). */
static inline float activation(int kind, float x) {
    switch (kind) {
    case ACT_SIGMOID: {
        const float e = exp_nonpositive(-fabsf(x));
        return (x >= 0.0f ? 1.0f : e) / (1.0f + e);
    }
    case ACT_SILU:
        return silu(x);
    case ACT_SOFTPLUS:
        return x > 20.0f ? x : log1pf(expf(x));
    case ACT_EXP:
        return expf(x);
    case ACT_TANH:
        return tanhf(x);
    case ACT_GELU_TANH: {
        const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        return 0.5f * x * (1.0f + tanhf(inner));
    }
    default: /* ACT_GELU */
        return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
    }
}

/* noinline: mm_activation and mm_act_mul run this very code, so that their activations agree
 * to the bit (the compiler may contract a copy inlined elsewhere otherwise) */
__attribute__((noinline)) static void activation_row(const void* x, void* out, int dt, int64_t n,
                                                     int kind) {
    if (dt == DTYPE_F32) {
        const float* in = (const float*)x;
        float* o = (float*)out;
        for (int64_t i = 0; i < n; i++) o[i] = activation(kind, in[i]);
    } else {
        const uint16_t* in = (const uint16_t*)x;
        uint16_t* o = (uint16_t*)out;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(activation(kind, bf16_to_f32(in[i])));
    }
}

void mm_activation(const void* x, void* out, int dt, int64_t n, int kind) {
    activation_row(x, out, dt, n, kind);
}

/* act(gate) * up for gate_up [rows, 2 * inner] (gate first) -> out [rows, inner]: the gate's
 * activation by mm_activation's code (rounded to the dtype), then the product rounded, as a
 * decoder's modules compute a gated MLP with another activation than SiLU
 * (models/layers/mlp.py). */
void mm_act_mul(const void* gate_up, void* out, int dt, int64_t rows, int64_t inner, int kind) {
    const size_t elem = dt == DTYPE_F32 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++) {
        activation_row((const char*)gate_up + (size_t)(2 * r * inner) * elem,
                       (char*)out + (size_t)(r * inner) * elem, dt, inner, kind);
        for (int64_t j = 0; j < inner; j++)
            store(out, dt, r * inner + j,
                  load_x(out, dt, r * inner + j) * load_x(gate_up, dt, (2 * r + 1) * inner + j));
    }
}
