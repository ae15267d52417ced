/* CPU kernels of our own for the decode step, compiled on the machine at hand by models/kernels/native.py
 * (-O3 -march=native, OpenMP from the runtime PyTorch itself loaded) and loaded with ctypes.
 *
 * Plain C: the compiler vectorizes the inner loops (`omp simd`) for whatever vector ISA the CPU
 * has, so one source serves AVX2, AVX-512 and Arm machines. The engine only runs a kernel here
 * where it measured faster than PyTorch's on this machine (models/kernels/plan.py,
 * models/layers/attention.py).
 *
 * - mm_linear_*: y[M, N] = x[M, K] . W[N, K]^T for few rows M (decode). A weight row is streamed
 *   once per call and reused from L1 for every row of x, so the kernel runs at the memory
 *   bandwidth where a GEMM library's small-M path does not. Weights float32, bfloat16 or int8
 *   with one bfloat16 scale per output channel; x and y float32 or bfloat16 (y in x's dtype);
 *   float32 accumulation.
 * - mm_linear_i4: the same for int4 weights in our pack (models/kernels/quantization.py), read in place (group-wise
 *   scales and zeros), through VNNI dot products where the CPU has them.
 * - mm_decode_attention: one query token per sequence against its keys read in place from the
 *   paged cache (no gather), with sliding windows, logit soft-capping and grouped-query heads;
 *   scores, softmax and the weighted sum in float32.
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

/* rows [M, K] of dtype `dt` -> float32 (a copy when not float32 already; NULL if out of memory) */
static float* as_f32(const void* x, int dt, int64_t n, int* owned) {
    *owned = dt != DTYPE_F32;
    if (!*owned) return (float*)x;
    float* out = malloc(sizeof(float) * (size_t)n);
    if (out != NULL) load_row(out, x, dt, 0, n);
    return out;
}

/* One instantiation per weight type: LOAD(w, k) reads element k of a weight row as float. */
#define LINEAR(NAME, WTYPE, LOAD)                                                              \
    static int NAME(const void* x, int x_dtype, const WTYPE* w, const uint16_t* scales,       \
                    void* y, int64_t m, int64_t n, int64_t k, int threads) {                   \
        int owned;                                                                             \
        const float* xf = as_f32(x, x_dtype, m * k, &owned);                                   \
        if (xf == NULL) return 1;                                                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                      \
        for (int64_t r = 0; r < n; r++) {                                                      \
            const WTYPE* wr = w + r * k;                                                       \
            float scale = scales ? bf16_to_f32(scales[r]) : 1.0f;                              \
            for (int64_t i = 0; i < m; i++) {                                                  \
                const float* xr = xf + i * k;                                                  \
                float acc = 0.0f;                                                              \
                _Pragma("omp simd reduction(+:acc)")                                           \
                for (int64_t j = 0; j < k; j++) acc += xr[j] * LOAD(wr, j);                    \
                store(y, x_dtype, i * n + r, acc * scale);                                     \
            }                                                                                  \
        }                                                                                      \
        if (owned) free((void*)xf);                                                            \
        return 0;                                                                              \
    }

#define LOAD_F32(w, j) (w)[j]
#define LOAD_BF16(w, j) bf16_to_f32((w)[j])
#define LOAD_I8(w, j) ((float)(w)[j])
LINEAR(linear_f32, float, LOAD_F32)
LINEAR(linear_bf16, uint16_t, LOAD_BF16)

int mm_linear_f32(const void* x, int x_dtype, const float* w, const uint16_t* scales, void* y,
                  int64_t m, int64_t n, int64_t k, int threads) {
    return linear_f32(x, x_dtype, w, scales, y, m, n, k, threads);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
/* bfloat16 activations and weights: VDPBF16PS multiplies pairs of bfloat16 exactly and adds
 * them into float32 lanes, one instruction per 32 weights, where the plain loop converts each
 * weight to float32 first. Requires k % 32 == 0. */
static int linear_bf16_dot(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m,
                           int64_t n, int64_t k, int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t r = 0; r < n; r++) {
        const uint16_t* wr = w + r * k;
        for (int64_t i = 0; i < m; i++) {
            const uint16_t* xr = x + i * k;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            int64_t j = 0;
            for (; j + 64 <= k; j += 64) {  /* two independent sums */
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xr + j),
                                      (__m512bh)_mm512_loadu_si512(wr + j));
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(xr + j + 32),
                                      (__m512bh)_mm512_loadu_si512(wr + j + 32));
            }
            if (j < k)
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xr + j),
                                      (__m512bh)_mm512_loadu_si512(wr + j));
            y[i * n + r] = f32_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(a0, a1)));
        }
    }
    return 0;
}
#endif

int mm_linear_bf16(const void* x, int x_dtype, const uint16_t* w, const uint16_t* scales,
                   void* y, int64_t m, int64_t n, int64_t k, int threads) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if (x_dtype == DTYPE_BF16 && scales == NULL && k % 32 == 0)
        return linear_bf16_dot(x, w, y, m, n, k, threads);
#endif
    return linear_bf16(x, x_dtype, w, scales, y, m, n, k, threads);
}
LINEAR(linear_i8_float, int8_t, LOAD_I8)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define I8_BLOCK 64 /* activations share one scale per 64 inputs: one 512-bit register */
/* ACC += A (unsigned bytes) . B (signed bytes), per 32-bit lane. Inline, so that the compiler
 * keeps the accumulator in place: with the intrinsic, GCC 12 copies (and spills) it around
 * every instruction. */
#define DPBUSD(ACC, A, B) __asm__("vpdpbusd %2, %1, %0" : "+v"(ACC) : "v"(A), "v"(B))

/* int8 weights through VNNI's int8 dot products. Each block of 64 activations is written as
 * s * (h + l / 256), h in [-127, 127] and l in [-128, 127] integers with s = max|x| / 127: two
 * int8 digits, within max|x| / 65024 of x (finer than the bfloat16 activations PyTorch's int8
 * kernel takes; l = 128, a tie, is written 127: within max|x| / 32512 there). VNNI multiplies
 * unsigned by signed bytes: the digits are the signed operand and the weights the unsigned one,
 * offset by 128 (q XOR 0x80 = q + 128), which adds 128 * sum_k (256 h_k + l_k) * s / 256 to
 * every output channel alike: subtracted once per row of x at the end. Per 64 weight bytes: an
 * XOR and two dot products, no int-to-float conversion of the weights. Requires k % 64 == 0. */
static int linear_i8_vnni(const void* x, int x_dtype, const int8_t* w, const uint16_t* scales,
                          void* y, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t blocks = k / I8_BLOCK;
    int8_t* digits = malloc((size_t)(2 * m * k));  /* h, then l, per block of 64 */
    float* block_scale = malloc(sizeof(float) * (size_t)(m * blocks));  /* s / 256 */
    float* offset = malloc(sizeof(float) * (size_t)m);  /* what the weights' +128 adds */
    if (digits == NULL || block_scale == NULL || offset == NULL) {
        free(digits), free(block_scale), free(offset);
        return 1;
    }
    const __m512 zero_ps = _mm512_setzero_ps();
    for (int64_t i = 0; i < m; i++) {
        double added = 0.0;
        for (int64_t b = 0; b < blocks; b++) {  /* 16 lanes at a time (this runs on one thread) */
            const int64_t at = i * k + b * I8_BLOCK;
            __m512 v[4], top = zero_ps;
            for (int q = 0; q < 4; q++) {
                float lanes[16];
                load_row(lanes, x, x_dtype, at + 16 * q, 16);
                v[q] = _mm512_loadu_ps(lanes);
                top = _mm512_max_ps(top, _mm512_abs_ps(v[q]));
            }
            const float largest = _mm512_reduce_max_ps(top);
            const __m512 s = _mm512_set1_ps(largest > 0.0f ? largest / 127.0f : 1.0f);
            int8_t* hd = digits + 2 * at;
            __m512i digit_sum = _mm512_setzero_si512();  /* 256 h + l, per lane */
            for (int q = 0; q < 4; q++) {
                const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
                const __m512 u = _mm512_div_ps(v[q], s);
                const __m512 h = _mm512_roundscale_ps(u, nearest);
                __m512 l = _mm512_roundscale_ps(
                    _mm512_mul_ps(_mm512_sub_ps(u, h), _mm512_set1_ps(256.0f)), nearest);
                l = _mm512_min_ps(_mm512_max_ps(l, _mm512_set1_ps(-128.0f)),
                                  _mm512_set1_ps(127.0f));
                const __m512i hi = _mm512_cvtps_epi32(h), lo = _mm512_cvtps_epi32(l);
                digit_sum = _mm512_add_epi32(digit_sum, _mm512_add_epi32(
                    _mm512_slli_epi32(hi, 8), lo));
                _mm_storeu_si128((__m128i*)(hd + 16 * q), _mm512_cvtepi32_epi8(hi));
                _mm_storeu_si128((__m128i*)(hd + I8_BLOCK + 16 * q), _mm512_cvtepi32_epi8(lo));
            }
            const float bs = _mm512_cvtss_f32(s) / 256.0f;
            block_scale[i * blocks + b] = bs;
            added += 128.0 * (double)_mm512_reduce_add_epi32(digit_sum) * bs;
        }
        offset[i] = (float)added;
    }
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t r = 0; r < n; r++) {
        const int8_t* wr = w + r * k;
        const float scale = bf16_to_f32(scales[r]);
        for (int64_t i = 0; i < m; i++) {
            __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();  /* two fma chains */
            const int8_t* hd = digits + 2 * i * k;
            const float* bs = block_scale + i * blocks;
#define I8_BLOCK_DOT(ACC, B)                                                                  \
    do {                                                                                      \
        const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(wr + (B) * I8_BLOCK), bias);   \
        __m512i both = _mm512_setzero_si512();                                                \
        DPBUSD(both, wu, _mm512_loadu_si512(hd + 2 * (B) * I8_BLOCK));                        \
        both = _mm512_slli_epi32(both, 8);                                                    \
        DPBUSD(both, wu, _mm512_loadu_si512(hd + (2 * (B) + 1) * I8_BLOCK));                  \
        ACC = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_set1_ps(bs[B]), ACC);          \
    } while (0)
            int64_t b = 0;
            for (; b + 2 <= blocks; b += 2) {
                I8_BLOCK_DOT(even, b);
                I8_BLOCK_DOT(odd, b + 1);
            }
            if (b < blocks) I8_BLOCK_DOT(even, b);
#undef I8_BLOCK_DOT
            const float sum = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
            store(y, x_dtype, i * n + r, (sum - offset[i]) * scale);
        }
    }
    free(digits), free(block_scale), free(offset);
    return 0;
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define I8_ROWS 4 /* rows of x per pass over a weight row (accumulators in registers) */
/* Several rows of x: the digit path's work grows with every row, so here each block of 32
 * weights is converted to bfloat16 once (exact: |q| <= 127) and multiplied with every row of x
 * by VDPBF16PS (exact products, float32 sums), the channel's scale applied at the end. A
 * bfloat16 x is taken as it is; a float32 x as two bfloat16 planes, hi = bf16(x) and
 * lo = bf16(x - hi), within |x| / 2^16 of x as the digits are. Requires k % 32 == 0. */
static int linear_i8_bf16_rows(const void* x, int x_dtype, const int8_t* w,
                               const uint16_t* scales, void* y, int64_t m, int64_t n, int64_t k,
                               int threads) {
    const int split = x_dtype != DTYPE_BF16;
    uint16_t* xb = (uint16_t*)x;  /* [m, k], then with `split` the low plane [m, k] */
    if (split) {
        xb = malloc(sizeof(uint16_t) * (size_t)(2 * m * k));
        if (xb == NULL) return 1;
        for (int64_t j = 0; j < m * k; j++) {
            const float v = ((const float*)x)[j];
            xb[j] = f32_to_bf16(v);
            xb[m * k + j] = f32_to_bf16(v - bf16_to_f32(xb[j]));
        }
    }
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t r = 0; r < n; r++) {
        const int8_t* wr = w + r * k;
        const float scale = bf16_to_f32(scales[r]);
        for (int64_t i0 = 0; i0 < m; i0 += I8_ROWS) {
            const int rows = m - i0 < I8_ROWS ? (int)(m - i0) : I8_ROWS;
            __m512 acc[I8_ROWS];
            for (int i = 0; i < I8_ROWS; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t j = 0; j < k; j += 32) {
                const __m512 lo = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + j))));
                const __m512 hi = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + j + 16))));
                const __m512bh wb = _mm512_cvtne2ps_pbh(hi, lo);  /* weights j .. j + 31 */
                for (int i = 0; i < rows; i++) {
                    const uint16_t* xr = xb + (i0 + i) * k + j;
                    acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(xr), wb);
                    if (split)
                        acc[i] = _mm512_dpbf16_ps(
                            acc[i], (__m512bh)_mm512_loadu_si512(xr + m * k), wb);
                }
            }
            for (int i = 0; i < rows; i++)
                store(y, x_dtype, (i0 + i) * n + r, _mm512_reduce_add_ps(acc[i]) * scale);
        }
    }
    if (split) free(xb);
    return 0;
}
#endif

int mm_linear_i8(const void* x, int x_dtype, const int8_t* w, const uint16_t* scales, void* y,
                 int64_t m, int64_t n, int64_t k, int threads) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if (m > 1 && k % 32 == 0)
        return linear_i8_bf16_rows(x, x_dtype, w, scales, y, m, n, k, threads);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (k % I8_BLOCK == 0) return linear_i8_vnni(x, x_dtype, w, scales, y, m, n, k, threads);
#endif
    return linear_i8_float(x, x_dtype, w, scales, y, m, n, k, threads);
}

/* int4 weights in our pack (models/kernels/quantization.py), read in place:
 * packed [N / 64, K, 32] bytes, byte (b, k, d) holding q of channel 64b + d in its low nibble and
 * of 64b + 32 + d in its high one; sz [K / group, N, 2] bfloat16 (scale, zero), the weight being
 * (q - 8) * scale + zero. Per group and channel,
 *   sum_k w_k x_k = scale * sum_k q_k x_k + (zero - 8 * scale) * sum_k x_k,
 * where sum_k x_k is shared by all channels (computed once per call: of x itself on the plain
 * path, of the values its digits write on the VNNI one). Requires n % 64 == 0, k % group == 0
 * and group % 4 == 0. */

/* The generic path: one block of 64 channels for every row of x (float32 [m, k]). */
static void i4_block_float(const float* xf, const float* xsum, const uint8_t* wb,
                           const uint16_t* sz, float* out, int64_t m, int64_t n, int64_t k,
                           int64_t group, int64_t b) {
    const int64_t groups = k / group;
    for (int64_t i = 0; i < m; i++) {
        float acc[I4_BLOCK_N] = {0};
        for (int64_t g = 0; g < groups; g++) {
            float dot[I4_BLOCK_N] = {0};
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++) {
                const uint8_t* bytes = wb + kk * (I4_BLOCK_N / 2);
                const float xv = xf[i * k + kk];
                _Pragma("omp simd")
                for (int d = 0; d < I4_BLOCK_N / 2; d++) {
                    dot[d] += (float)(bytes[d] & 15) * xv;
                    dot[d + I4_BLOCK_N / 2] += (float)(bytes[d] >> 4) * xv;
                }
            }
            const uint16_t* s = sz + (g * n + b * I4_BLOCK_N) * 2;
            const float sum = xsum[i * groups + g];
            _Pragma("omp simd")
            for (int c = 0; c < I4_BLOCK_N; c++) {
                const float scale = bf16_to_f32(s[2 * c]), zero = bf16_to_f32(s[2 * c + 1]);
                acc[c] += scale * dot[c] + (zero - 8.0f * scale) * sum;
            }
        }
        memcpy(out + i * n + b * I4_BLOCK_N, acc, sizeof(acc));
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define I4_VNNI 1
/* acc += dot(u8 lanes of a, s8 lanes of b), as _mm512_dpbusd_epi32, written as an instruction
 * whose accumulator the compiler keeps in place: with the intrinsic, GCC 12 copies every
 * accumulator through another register (and spills) around each dot product. */
/* The VNNI path, for one row of x and one block of 64 channels. The activations of each group
 * are written as s * (h + l / 256) with int8 digits h, l (s = max|x| / 127 over the group), as
 * for int8 weights; the nibbles are the unsigned operand of VNNI's dot products, the digits the
 * signed one. One step takes four consecutive k of the block (128 bytes) and transposes them with
 * two byte permutes into 32-bit lanes of four k per channel: lane j of the low / high nibbles of
 * permute 0 holds channel j / 32 + j, of permute 1 channel 16 + j / 48 + j. Written out per
 * register (no arrays), so that the accumulators stay in registers. */
static inline void i4_block_vnni(const int8_t* hd, const int8_t* ld, const float* gscale,
                                 const float* xsum, const uint8_t* wb, const uint16_t* sz,
                                 float* out, int64_t n, int64_t k, int64_t group, int64_t b,
                                 const __m512i idx0, const __m512i idx1) {
    const int64_t groups = k / group;
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i zero_i = _mm512_setzero_si512();
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int64_t g = 0; g < groups; g++) {
        __m512i h0 = zero_i, h1 = zero_i, h2 = zero_i, h3 = zero_i;
        __m512i l0 = zero_i, l1 = zero_i, l2 = zero_i, l3 = zero_i;
        const uint8_t* p = wb + g * group * (I4_BLOCK_N / 2);
        for (int64_t kk = g * group; kk < (g + 1) * group; kk += 4, p += 128) {
            const __m512i a = _mm512_loadu_si512(p), c = _mm512_loadu_si512(p + 64);
            const __m512i q0 = _mm512_permutex2var_epi8(a, idx0, c);
            const __m512i q1 = _mm512_permutex2var_epi8(a, idx1, c);
            const __m512i w0 = _mm512_and_si512(q0, nibble);
            const __m512i w1 = _mm512_and_si512(q1, nibble);
            const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(q0, 4), nibble);
            const __m512i w3 = _mm512_and_si512(_mm512_srli_epi16(q1, 4), nibble);
            int32_t h4, l4;
            memcpy(&h4, hd + kk, 4);
            memcpy(&l4, ld + kk, 4);
            const __m512i hv = _mm512_set1_epi32(h4), lv = _mm512_set1_epi32(l4);
            DPBUSD(h0, w0, hv); DPBUSD(l0, w0, lv);
            DPBUSD(h1, w1, hv); DPBUSD(l1, w1, lv);
            DPBUSD(h2, w2, hv); DPBUSD(l2, w2, lv);
            DPBUSD(h3, w3, hv); DPBUSD(l3, w3, lv);
        }
        /* (scale, zero) pairs of 16 channels per register, the scale in each lane's low half */
        const uint16_t* s = sz + (g * n + b * I4_BLOCK_N) * 2;
        const __m512 sr = _mm512_set1_ps(gscale[g]), xs = _mm512_set1_ps(xsum[g]);
#define I4_FINISH(ACC, H, L, AT)                                                              \
        {                                                                                     \
            const __m512i pair = _mm512_loadu_si512(s + (AT));                                \
            const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));            \
            const __m512 zero = _mm512_castsi512_ps(                                          \
                _mm512_and_si512(pair, _mm512_set1_epi32((int)0xffff0000u)));                 \
            const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);        \
            const __m512i both = _mm512_add_epi32(_mm512_slli_epi32(H, 8), L);                \
            const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(both), sr);                   \
            ACC = _mm512_fmadd_ps(offset, xs, _mm512_fmadd_ps(dot, scale, ACC));             \
        }
        I4_FINISH(acc0, h0, l0, 0)
        I4_FINISH(acc1, h1, l1, 32)
        I4_FINISH(acc2, h2, l2, 64)
        I4_FINISH(acc3, h3, l3, 96)
#undef I4_FINISH
    }
    float* o = out + b * I4_BLOCK_N;
    _mm512_storeu_ps(o, acc0), _mm512_storeu_ps(o + 16, acc1);
    _mm512_storeu_ps(o + 32, acc2), _mm512_storeu_ps(o + 48, acc3);
}

static void i4_permute_indices(__m512i* idx0, __m512i* idx1) {
    uint8_t raw[2][64];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 16; j++) {
            const int d = 16 * h + j;  /* bytes of d at k, k + 1, k + 2, k + 3 */
            raw[h][4 * j] = (uint8_t)d, raw[h][4 * j + 1] = (uint8_t)(32 + d);
            raw[h][4 * j + 2] = (uint8_t)(64 + d), raw[h][4 * j + 3] = (uint8_t)(96 + d);
        }
    *idx0 = _mm512_loadu_si512(raw[0]), *idx1 = _mm512_loadu_si512(raw[1]);
}
#endif

/* generic != 0: the float path even where the VNNI one is built (for tests). */
int mm_linear_i4(const void* x, int x_dtype, const uint8_t* w, const uint16_t* sz, void* y,
                 int64_t m, int64_t n, int64_t k, int64_t group, int generic, int threads) {
    const int64_t groups = k / group, blocks = n / I4_BLOCK_N;
    if (n % I4_BLOCK_N || k % group || group % 4) return 2;
    int owned;
    const float* xf = as_f32(x, x_dtype, m * k, &owned);
    float* xsum = malloc(sizeof(float) * (size_t)(2 * m * groups));  /* sum of x per group */
    float* xqsum = xsum + m * groups;  /* and of its two-digit form */
    float* gscale = malloc(sizeof(float) * (size_t)(m * groups));  /* s / 256 per group */
    int8_t* digits = malloc((size_t)(2 * m * k));  /* [m][h, l][k] */
    float* out = y;
    if (x_dtype != DTYPE_F32) out = malloc(sizeof(float) * (size_t)(m * n));
    int failed = xf == NULL || xsum == NULL || gscale == NULL || digits == NULL || out == NULL;
    if (!failed) {
        for (int64_t i = 0; i < m; i++) {
            for (int64_t g = 0; g < groups; g++) {
                const float* v = xf + i * k + g * group;
                float top = 0.0f, sum = 0.0f;
                _Pragma("omp simd reduction(max:top) reduction(+:sum)")
                for (int64_t j = 0; j < group; j++) {
                    top = fabsf(v[j]) > top ? fabsf(v[j]) : top;
                    sum += v[j];
                }
                const float s = top > 0.0f ? top / 127.0f : 1.0f;
                int8_t* hd = digits + 2 * i * k + g * group;
                int8_t* ld = hd + k;
                float digit_sum = 0.0f;  /* of 256 h + l: integers, exact in any order */
                _Pragma("omp simd reduction(+:digit_sum)")
                for (int64_t j = 0; j < group; j++) {
                    const float u = v[j] / s;
                    const float h = rintf(u);  /* rintf, not roundf: it vectorizes */
                    float l = rintf((u - h) * 256.0f);
                    l = l > 127.0f ? 127.0f : (l < -127.0f ? -127.0f : l);
                    hd[j] = (int8_t)h, ld[j] = (int8_t)l;
                    digit_sum += 256.0f * h + l;
                }
                xsum[i * groups + g] = sum;
                /* The VNNI path's offset term takes the sum of the values its digits write, so
                 * that it computes exactly W . x' for the written x' (x' - x is then weighted
                 * by |w|, not by the group's range of w). */
                xqsum[i * groups + g] = digit_sum * (s / 256.0f);
                gscale[i * groups + g] = s / 256.0f;
            }
        }
#ifdef I4_VNNI
        __m512i idx0, idx1;
        i4_permute_indices(&idx0, &idx1);
#endif
        _Pragma("omp parallel for num_threads(threads) schedule(static)")
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t* wb = w + b * k * (I4_BLOCK_N / 2);
#ifdef I4_VNNI
            if (generic) {
                i4_block_float(xf, xsum, wb, sz, out, m, n, k, group, b);
                continue;
            }
            /* Row by row: the dot products bound the time, so sharing the permutes between
             * rows measured no faster. */
            for (int64_t i = 0; i < m; i++)
                i4_block_vnni(digits + 2 * i * k, digits + (2 * i + 1) * k, gscale + i * groups,
                              xqsum + i * groups, wb, sz, out + i * n, n, k, group, b, idx0,
                              idx1);
#else
            (void)generic;
            i4_block_float(xf, xsum, wb, sz, out, m, n, k, group, b);
#endif
        }
        if (out != y) store_row(y, out, x_dtype, 0, m * n);
    }
    if (owned) free((void*)xf);
    free(xsum), free(gscale), free(digits);
    if (out != y) free(out);
    return failed;
}

/* Dequantizers, for a prefill's many rows, where a dense GEMM on the dequantized weight beats
 * the int kernels (compute-bound there). Each value is computed in float32 and rounded once to
 * the output dtype (float32 or bfloat16). */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define DEQUANT_AVX512 1
#include <immintrin.h>
/* 16 float32 -> bfloat16, rounded to nearest even (as f32_to_bf16, NaNs aside) */
static inline void store_f32(void* out, int out_dtype, int64_t at, __m512 a, __m512 b) {
    if (out_dtype == DTYPE_F32) {
        _mm512_storeu_ps((float*)out + at, a), _mm512_storeu_ps((float*)out + at + 16, b);
    } else {
        _mm512_storeu_si512((uint16_t*)out + at, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}
#endif

/* int8 [N, K] with one bfloat16 scale per row -> out [N, K]. */
void mm_dequantize_i8(const int8_t* w, const uint16_t* scales, void* out, int out_dtype,
                      int64_t n, int64_t k, int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t r = 0; r < n; r++) {
        const float scale = bf16_to_f32(scales[r]);
        const int8_t* wr = w + r * k;
        int64_t j = 0;
#ifdef DEQUANT_AVX512
        const __m512 sv = _mm512_set1_ps(scale);
        for (; j + 32 <= k; j += 32) {
            __m512 a, b;
            i8x32_to_f32(wr + j, &a, &b);
            store_f32(out, out_dtype, r * k + j, _mm512_mul_ps(a, sv), _mm512_mul_ps(b, sv));
        }
#endif
        for (; j < k; j++) store(out, out_dtype, r * k + j, (float)wr[j] * scale);
    }
}

#if defined(DEQUANT_AVX512) && defined(__AVX512VBMI__)
#define DEQUANT_I4_TABLES 1
/* The 32 k x 32 bytes of a block's k0 .. k0 + 31 (rows of the pack, 32 bytes apart), transposed:
 * v[i] = bytes of columns 2i and 2i + 1 (channels 2i, 2i + 1 in the low nibbles, + 32 in the
 * high ones), each for k0 .. k0 + 31. In three steps of permutes: per 8 k, qword j of each row
 * side by side (columns 8j .. 8j + 7); an 8 x 8 byte transpose within each register; the four
 * 8-k pieces of a column joined. */
static inline void i4_transpose_tile(const uint8_t* rows, __m512i v[16]) {
    const __m512i pair01 = _mm512_set_epi64(13, 9, 5, 1, 12, 8, 4, 0);
    const __m512i pair23 = _mm512_set_epi64(15, 11, 7, 3, 14, 10, 6, 2);
    static const uint8_t order[64] = {  /* byte 8c + r <- byte 8r + c */
        0, 8, 16, 24, 32, 40, 48, 56,
        1, 9, 17, 25, 33, 41, 49, 57,
        2, 10, 18, 26, 34, 42, 50, 58,
        3, 11, 19, 27, 35, 43, 51, 59,
        4, 12, 20, 28, 36, 44, 52, 60,
        5, 13, 21, 29, 37, 45, 53, 61,
        6, 14, 22, 30, 38, 46, 54, 62,
        7, 15, 23, 31, 39, 47, 55, 63};
    const __m512i bytes8x8 = _mm512_loadu_si512(order);
    __m512i t[4][4];  /* t[m][j]: columns 8j .. 8j + 7 (qword c: column 8j + c) at k 8m .. */
    for (int m = 0; m < 4; m++) {
        const uint8_t* at = rows + 256 * m;  /* 8 rows of 32 bytes */
        const __m512i r01 = _mm512_loadu_si512(at), r23 = _mm512_loadu_si512(at + 64);
        const __m512i r45 = _mm512_loadu_si512(at + 128), r67 = _mm512_loadu_si512(at + 192);
        const __m512i p01 = _mm512_permutex2var_epi64(r01, pair01, r23);
        const __m512i p23 = _mm512_permutex2var_epi64(r01, pair23, r23);
        const __m512i q01 = _mm512_permutex2var_epi64(r45, pair01, r67);
        const __m512i q23 = _mm512_permutex2var_epi64(r45, pair23, r67);
        t[m][0] = _mm512_permutexvar_epi8(bytes8x8, _mm512_shuffle_i64x2(p01, q01, 0x44));
        t[m][1] = _mm512_permutexvar_epi8(bytes8x8, _mm512_shuffle_i64x2(p01, q01, 0xEE));
        t[m][2] = _mm512_permutexvar_epi8(bytes8x8, _mm512_shuffle_i64x2(p23, q23, 0x44));
        t[m][3] = _mm512_permutexvar_epi8(bytes8x8, _mm512_shuffle_i64x2(p23, q23, 0xEE));
    }
    for (int j = 0; j < 4; j++)
        for (int c = 0; c < 8; c += 4) {
            const __m512i pick = _mm512_set_epi64(11 + c, 3 + c, 10 + c, 2 + c, 9 + c, 1 + c,
                                                  8 + c, c);
            const __m512i x = _mm512_permutex2var_epi64(t[0][j], pick, t[1][j]);
            const __m512i y = _mm512_permutex2var_epi64(t[2][j], pick, t[3][j]);
            v[4 * j + c / 2] = _mm512_permutex2var_epi64(
                x, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), y);
            v[4 * j + c / 2 + 1] = _mm512_permutex2var_epi64(
                x, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), y);
        }
}
#endif

/* int4 in our pack -> out [count * 64, K]: output channels 64 first .. 64 (first +
 * count) - 1 of the weight, row-major as a dense weight is (so a GEMM may take it as its plain
 * left operand). Each value is (q - 8) * scale + zero as fma(q, scale, zero - 8 * scale) in
 * float32, rounded once. With AVX-512 (VBMI), per group and channel the 16 values q can take
 * are computed once into a table, and each 32 k x 64 channels of the pack is transposed into
 * rows of nibbles that look their values up (a permute per 32 bfloat16 or 16 float32). */
void mm_dequantize_i4(const uint8_t* w, const uint16_t* sz, void* out, int out_dtype, int64_t n,
                      int64_t k, int64_t group, int64_t first, int64_t count, int threads) {
    const size_t size = out_dtype == DTYPE_F32 ? sizeof(float) : sizeof(uint16_t);
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t b = first; b < first + count; b++)
        mm_dequantize_i4_block(w, sz, (char*)out + (size_t)((b - first) * I4_BLOCK_N * k) * size,
                               out_dtype, k, n, k, group, b, 0, k / group);
}

/* Block b (output channels 64b .. 64b + 63) of the pack, groups g0 .. g1 - 1, into out's 64 rows
 * (ldo apart): column j of out is input g0 * group + j. */
void mm_dequantize_i4_block(const uint8_t* w, const uint16_t* sz, void* out, int out_dtype,
                            int64_t ldo, int64_t n, int64_t k, int64_t group, int64_t b,
                            int64_t g0, int64_t g1) {
    const uint8_t* wb = w + b * k * (I4_BLOCK_N / 2);
    const int64_t base = g0 * group;
    for (int64_t g = g0; g < g1; g++) {
        float scale[I4_BLOCK_N], offset[I4_BLOCK_N];
        const uint16_t* s = sz + (g * n + b * I4_BLOCK_N) * 2;
        for (int c = 0; c < I4_BLOCK_N; c++) {
            scale[c] = bf16_to_f32(s[2 * c]);
            offset[c] = bf16_to_f32(s[2 * c + 1]) - 8.0f * scale[c];
        }
#ifdef DEQUANT_I4_TABLES
        if (group % 32 == 0) {
            __m512 table[I4_BLOCK_N];  /* table[c] lane q: channel c's value of q */
            __m512i table16[I4_BLOCK_N];  /* the same in bfloat16, in the low 16 words */
            for (int c0 = 0; c0 < I4_BLOCK_N; c0 += 16) {
                const __m512 sv = _mm512_loadu_ps(scale + c0);
                const __m512 ov = _mm512_loadu_ps(offset + c0);
                for (int q = 0; q < 16; q++)
                    table[c0 + q] = _mm512_fmadd_ps(_mm512_set1_ps((float)q), sv, ov);
                transpose16(table + c0);
            }
            for (int c = 0; c < I4_BLOCK_N; c++)
                table16[c] = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(table[c]));
            for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {
                __m512i v[16];
                i4_transpose_tile(wb + k0 * 32, v);
                for (int i = 0; i < 32; i++) {  /* column i: channels i and 32 + i */
                    const __m256i col = i % 2 ? _mm512_extracti64x4_epi64(v[i / 2], 1)
                                              : _mm512_castsi512_si256(v[i / 2]);
                    const int64_t lo = i * ldo + k0 - base, hi = lo + 32 * ldo;
                    if (out_dtype == DTYPE_BF16) {
                        const __m512i q = _mm512_cvtepu8_epi16(col);
                        uint16_t* o = out;
                        _mm512_storeu_si512(o + lo, _mm512_permutexvar_epi16(
                            _mm512_and_si512(q, _mm512_set1_epi16(15)), table16[i]));
                        _mm512_storeu_si512(o + hi, _mm512_permutexvar_epi16(
                            _mm512_srli_epi16(q, 4), table16[32 + i]));
                    } else {
                        float* o = out;
                        for (int h = 0; h < 2; h++) {
                            const __m512i q = _mm512_cvtepu8_epi32(
                                h ? _mm256_extracti128_si256(col, 1)
                                  : _mm256_castsi256_si128(col));
                            _mm512_storeu_ps(o + lo + 16 * h, _mm512_permutexvar_ps(
                                _mm512_and_si512(q, _mm512_set1_epi32(15)), table[i]));
                            _mm512_storeu_ps(o + hi + 16 * h, _mm512_permutexvar_ps(
                                _mm512_srli_epi32(q, 4), table[32 + i]));
                        }
                    }
                }
            }
            continue;
        }
#endif
        for (int64_t kk = g * group; kk < (g + 1) * group; kk++) {
            const uint8_t* bytes = wb + kk * (I4_BLOCK_N / 2);
            for (int d = 0; d < I4_BLOCK_N / 2; d++) {
                store(out, out_dtype, d * ldo + kk - base,
                      fmaf((float)(bytes[d] & 15), scale[d], offset[d]));
                store(out, out_dtype, (d + 32) * ldo + kk - base,
                      fmaf((float)(bytes[d] >> 4), scale[d + 32], offset[d + 32]));
            }
        }
    }
}

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

/* exp(x) for x <= 0 (a softmax's shifted scores), within 2 ulp of expf: x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial, 2^n from the exponent bits. Plain
 * arithmetic, so loops over it vectorize (libm's expf is a call per element). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(x * 1.44269504f);  /* nearest (roundf would not vectorize) */
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
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
        if (mode == 0) {
            _Pragma("omp simd")
            for (int64_t j = 0; j < dim; j++) other[j] = h[j] * inv * weight[j];
        } else if (mode == 1) {
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

#define CHUNK_FLOATS 8192  /* keys (or values) converted to float32 at a time: 32 KiB, in L1 */

/* Rows [t0, t0 + n) of one head's keys or values (`base`: that head's first slot) as float32,
 * into `dst` [n, dim]: the slots come from the block table. */
static inline void gather_rows(const void* cache, int dt, int64_t base, const int64_t* blocks,
                               int64_t key0, int64_t block_size, int64_t t0, int64_t n,
                               int64_t dim, float* dst) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = t0 + t;
        const int64_t slot = blocks[(pos - key0) / block_size] * block_size + pos % block_size;
        load_row(dst + t * dim, cache, dt, base + slot * dim, dim);
    }
}

/* One sequence and one KV head: its `group` query heads qf [group, dim] (float32) over keys
 * [lo, lo + len) -> acc [group, dim]. Inlined per head size, so that the loops over `dim` are
 * unrolled and an accumulator row stays in registers. `scores` [group, len], `rows` CHUNK_FLOATS
 * floats. */
static inline __attribute__((always_inline)) void attend_head(
    const void* cache, int dt, int64_t key_base, int64_t value_base, const int64_t* blocks,
    int64_t key0, int64_t block_size, int64_t lo, int64_t len, int64_t group, const float* qf,
    float* acc, float* scores, float* rows, float scale, float softcap, const int64_t dim) {
    const int64_t chunk = CHUNK_FLOATS / dim;
    for (int64_t c = 0; c < len; c += chunk) {
        const int64_t n = len - c < chunk ? len - c : chunk;
        gather_rows(cache, dt, key_base, blocks, key0, block_size, lo + c, n, dim, rows);
        for (int64_t g = 0; g < group; g++) {
            const float* qg = qf + g * dim;
            float* sg = scores + g * len + c;
            int64_t t = 0;
            for (; t + 4 <= n; t += 4) {  /* four keys at once: four independent sums */
                const float *k0 = rows + t * dim, *k1 = k0 + dim, *k2 = k1 + dim, *k3 = k2 + dim;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
                _Pragma("omp simd reduction(+:s0, s1, s2, s3)")
                for (int64_t d = 0; d < dim; d++) {
                    s0 += qg[d] * k0[d];
                    s1 += qg[d] * k1[d];
                    s2 += qg[d] * k2[d];
                    s3 += qg[d] * k3[d];
                }
                sg[t] = s0, sg[t + 1] = s1, sg[t + 2] = s2, sg[t + 3] = s3;
            }
            for (; t < n; t++) {
                const float* kr = rows + t * dim;
                float s = 0.0f;
                _Pragma("omp simd reduction(+:s)")
                for (int64_t d = 0; d < dim; d++) s += qg[d] * kr[d];
                sg[t] = s;
            }
            for (t = 0; t < n; t++) {
                sg[t] *= scale;
                if (softcap > 0.0f) sg[t] = softcap * tanhf(sg[t] / softcap);
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float* sg = scores + g * len;
        float top = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) top = sg[t] > top ? sg[t] : top;
        _Pragma("omp simd reduction(+:sum)")
        for (int64_t t = 0; t < len; t++) {
            sg[t] = exp_nonpositive(sg[t] - top);
            sum += sg[t];
        }
        const float inverse = 1.0f / sum;
        _Pragma("omp simd")
        for (int64_t t = 0; t < len; t++) sg[t] *= inverse;
    }
    memset(acc, 0, sizeof(float) * (size_t)(group * dim));
    for (int64_t c = 0; c < len; c += chunk) {
        const int64_t n = len - c < chunk ? len - c : chunk;
        gather_rows(cache, dt, value_base, blocks, key0, block_size, lo + c, n, dim, rows);
        for (int64_t g = 0; g < group; g++) {
            const float* pg = scores + g * len + c;
            float a[dim];
            memcpy(a, acc + g * dim, sizeof(float) * (size_t)dim);
            for (int64_t t = 0; t < n; t++) {
                const float* vr = rows + t * dim;
                _Pragma("omp simd")
                for (int64_t d = 0; d < dim; d++) a[d] += pg[t] * vr[d];
            }
            memcpy(acc + g * dim, a, sizeof(float) * (size_t)dim);
        }
    }
}

/* q, out [B, Hq, D]; cache [2, Hkv, num_blocks, block_size, D] (keys, values); table [B, width]
 * of block ids, whose first entry holds key position key0[b] (a multiple of block_size);
 * context[b] keys precede and include the query, which sits at position context[b] - 1.
 * window > 0: the query sees keys within `window` positions; softcap > 0: scores become
 * softcap * tanh(scores / softcap). Returns nonzero when out of memory. */
int mm_decode_attention(const void* q, const void* cache, void* out, int dtype,
                        const int64_t* table, const int64_t* key0, const int64_t* context,
                        int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t width, int64_t num_blocks, int64_t block_size, int64_t window,
                        float scale, float softcap, int threads) {
    const int64_t group = heads / kv_heads;
    const int64_t head_stride = num_blocks * block_size * dim;  /* one KV head's slots */
    int failed = 0;
    if (dim > CHUNK_FLOATS) return 2;
    _Pragma("omp parallel for collapse(2) num_threads(threads) schedule(dynamic, 1)")
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t ctx = context[b];
            int64_t lo = window > 0 && ctx > window ? ctx - window : 0;
            if (lo < key0[b]) lo = key0[b];
            const int64_t len = ctx - lo;
            float* work = malloc(sizeof(float) * (size_t)(group * (len + 2 * dim) + CHUNK_FLOATS));
            if (work == NULL) {
                _Pragma("omp atomic write") failed = 1;
                continue;
            }
            float* scores = work;                 /* [group, len] */
            float* qf = work + group * len;       /* [group, dim] */
            float* acc = qf + group * dim;        /* [group, dim] */
            float* rows = acc + group * dim;      /* CHUNK_FLOATS */
            for (int64_t g = 0; g < group; g++)
                for (int64_t d = 0; d < dim; d++)
                    qf[g * dim + d] = load_x(q, dtype, (b * heads + h * group + g) * dim + d);
            const int64_t* blocks = table + b * width;
            const int64_t keys = h * head_stride, values = (kv_heads + h) * head_stride;
#define ATTEND(D) attend_head(cache, dtype, keys, values, blocks, key0[b], block_size, lo, len, \
                              group, qf, acc, scores, rows, scale, softcap, D)
            switch (dim) {
                case 64: ATTEND(64); break;
                case 128: ATTEND(128); break;
                case 256: ATTEND(256); break;
                default: ATTEND(dim);
            }
#undef ATTEND
            for (int64_t g = 0; g < group; g++)
                for (int64_t d = 0; d < dim; d++)
                    store(out, dtype, (b * heads + h * group + g) * dim + d, acc[g * dim + d]);
            free(work);
        }
    }
    return failed;
}
