/* int8 weights [N, K] with bfloat16 scales [N, K / group] (a scale per `group` inputs of each
 * output channel; group == K: one per channel): the matrix-vector linear of a decode's few rows,
 * and the dequantizer of a prefill's (where a dense GEMM on the dequantized weight beats the int
 * kernels). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef LINEAR_VEC
LINEAR_VEC(linear_i8_float, int8_t, LOAD8_I8)
#else
LINEAR_PLAIN(linear_i8_float, int8_t, LOAD_I8)
#endif

#ifdef MM_AVX512_VNNI
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
                          void* y, int64_t m, int64_t n, int64_t k) {
    const int64_t blocks = k / I8_BLOCK;
    /* per thread (x is a decode's few rows: writing its digits is cheap beside the weights) */
    int8_t* digits = malloc((size_t)(2 * m * k));  /* h, then l, per block of 64 */
    float* block_scale = malloc(sizeof(float) * (size_t)(m * blocks));  /* s / 256 */
    float* offset = malloc(sizeof(float) * (size_t)m);  /* what the weights' +128 adds */
    const int failed = digits == NULL || block_scale == NULL || offset == NULL;
    const __m512 zero_ps = _mm512_setzero_ps();
    for (int64_t i = 0; i < m && !failed; i++) {
        double added = 0.0;
        for (int64_t b = 0; b < blocks; b++) {  /* 16 lanes at a time */
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
    _Pragma("omp for schedule(static) nowait")
    for (int64_t r = 0; r < n; r++) {
        if (failed) continue;
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
                prefetch_ahead(wr + b * I8_BLOCK, 2 * I8_BLOCK);
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
    return failed;
}
#endif

#ifdef MM_AVX512_BF16
#define I8_ROWS 4 /* rows of x per pass over a weight row (accumulators in registers) */
/* Where VDPBF16PS is (the digit path's work grows with every row of a verify), each block of 32
 * weights is converted to bfloat16 once (exact: |q| <= 127) and multiplied with every row of x
 * by VDPBF16PS (exact products, float32 sums), the channel's scale applied at the end. A
 * bfloat16 x is taken as it is; a float32 x as two bfloat16 planes, hi = bf16(x) and
 * lo = bf16(x - hi), within |x| / 2^16 of x as the digits are. Requires k % 32 == 0. */
static int linear_i8_bf16_rows(const void* x, int x_dtype, const int8_t* w,
                               const uint16_t* scales, void* y, int64_t m, int64_t n, int64_t k) {
    const int split = x_dtype != DTYPE_BF16;
    uint16_t* xb = (uint16_t*)x;  /* [m, k], then with `split` the low plane [m, k] (per thread) */
    if (split) {
        xb = malloc(sizeof(uint16_t) * (size_t)(2 * m * k));
        for (int64_t j = 0; xb != NULL && j < m * k; j++) {
            const float v = ((const float*)x)[j];
            xb[j] = f32_to_bf16(v);
            xb[m * k + j] = f32_to_bf16(v - bf16_to_f32(xb[j]));
        }
    }
    _Pragma("omp for schedule(static) nowait")
    for (int64_t r = 0; r < n; r++) {
        if (xb == NULL) continue;
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
    return xb == NULL;
}
#endif

/* A scale per group (group < K, a multiple of 32): each widened weight is multiplied by its
 * group's scale, exact in float32 (an 8-bit q times a bfloat16 scale), so that the sums need no
 * fold per group and every row of x shares the product. Written with GCC's vector extensions, so
 * that one source builds for every variant (vectors of 16 floats with AVX-512, else of 8); up to
 * G_ROWS rows of x per pass over a weight row (a verify's rows share each widened weight). */
#if defined(__AVX512F__)
#define GV 16
#else
#define GV 8
#endif
#define G_STEP 32 /* inputs per step: a group holds whole steps */
typedef float gvf __attribute__((vector_size(GV * 4)));

static inline gvf gload_f32(const float* p) {
    gvf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* GV int8 at p as floats, through each instruction set's widening (GCC's
 * __builtin_convertvector from int8 vectors is element by element) */
static inline gvf gload_i8(const int8_t* p) {
#if defined(__AVX512F__)
    return (gvf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(MM_AVX2)
    return (gvf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#elif defined(MM_NEON)
    const int16x8_t h = vmovl_s8(vld1_s8(p));
    const float32x4_t lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
    const float32x4_t hi = vcvtq_f32_s32(vmovl_high_s16(h));
    gvf v;
    memcpy(&v, &lo, sizeof lo);
    memcpy((char*)&v + sizeof lo, &hi, sizeof hi);
    return v;
#else
    gvf v;
    for (int l = 0; l < GV; l++) v[l] = (float)p[l];
    return v;
#endif
}

#if defined(__AVX512F__)
#define G_ROWS 5 /* rows of x per pass over a weight row: 2 R accumulators in registers */
#else
#define G_ROWS 3 /* 4 R accumulators (vectors of 8): AVX2 has 16 registers */
#endif

/* Rows x[0 .. R) (`ldx` apart) against one weight row: s[i] = x_i . w. Each weight vector is
 * widened and scaled once for the R rows; each row's sums are the same whatever R (a row's
 * result is the one-row call's). (x in chunks shared by several channels, so that a down
 * projection's rows stay in L1, measured no faster.) */
static inline __attribute__((always_inline)) void grouped_rows(
    const float* x, int64_t ldx, const int8_t* wr, const uint16_t* sr, int64_t groups,
    int64_t group, float* s, const int R) {
    gvf a[G_ROWS][G_STEP / GV];
    for (int i = 0; i < R; i++)
        for (int q = 0; q < G_STEP / GV; q++) a[i][q] = (gvf){0};
    for (int64_t g = 0; g < groups; g++) {
        const float scale = bf16_to_f32(sr[g]);
        for (int64_t j = g * group; j < (g + 1) * group; j += G_STEP) {
            prefetch_ahead(wr + j, G_STEP);
            for (int q = 0; q < G_STEP / GV; q++) {
                const gvf wv = gload_i8(wr + j + GV * q) * scale;
                for (int i = 0; i < R; i++) a[i][q] += wv * gload_f32(x + i * ldx + j + GV * q);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        float t = 0.0f;
        for (int q = 0; q < G_STEP / GV; q++)
            for (int l = 0; l < GV; l++) t += a[i][q][l];
        s[i] = t;
    }
}

static int linear_i8_grouped(const void* x, int x_dtype, const int8_t* w,
                             const uint16_t* scales, int64_t group, void* y, int64_t m,
                             int64_t n, int64_t k) {
    int owned;
    const float* xf = as_f32(x, x_dtype, m * k, &owned);
    const int64_t groups = k / group;
    _Pragma("omp for schedule(static) nowait")
    for (int64_t r = 0; r < n; r++) {
        if (xf == NULL) continue;
        const int8_t* wr = w + r * k;
        const uint16_t* sr = scales + r * groups;
        for (int64_t i0 = 0; i0 < m; i0 += G_ROWS) {
            const float* x0 = xf + i0 * k;
            const int rows = (int)(m - i0 < G_ROWS ? m - i0 : G_ROWS);
            float s[G_ROWS];
            switch (rows) {  /* each row count compiled with its loops unrolled */
#define G_CASE(R)                                                                             \
                case R:                                                                       \
                    grouped_rows(x0, k, wr, sr, groups, group, s, R);                         \
                    break;
                G_CASE(1) G_CASE(2) G_CASE(3)
#if G_ROWS > 3
                G_CASE(4) G_CASE(5)
#endif
#undef G_CASE
            }
            for (int i = 0; i < rows; i++) store(y, x_dtype, (i0 + i) * n + r, s[i]);
        }
    }
    if (owned) free((void*)xf);
    return xf == NULL;
}

/* Whether mm_linear_i8 takes a group of `group` inputs for K = k: the whole row, or a multiple
 * of 32 dividing it. */
int mm_int8_group_ok(int64_t k, int64_t group) {
    return group == k || (group > 0 && group % G_STEP == 0 && k % group == 0);
}

static int linear_i8_any(const void* x, int x_dtype, const int8_t* w, const uint16_t* scales,
                         int64_t group, void* y, int64_t m, int64_t n, int64_t k) {
#ifdef MM_AVX512_BF16
    /* a bfloat16 x (a bfloat16 model's) as it is, through VDPBF16PS (dot_bf16.c): half the
     * float32 loop's instructions per row, which a verify's rows pay each */
    if (group < k && x_dtype == DTYPE_BF16 && group % 32 == 0)
        return dot_bf16_rows(x, w, DTYPE_I8, scales, group, y, DTYPE_BF16, m, n, k);
#endif
    if (group < k) return linear_i8_grouped(x, x_dtype, w, scales, group, y, m, n, k);
    /* chosen whatever m: a row's result must not depend on how many rows share its call (a
     * verify's rows sum as decodes of their tokens) */
#ifdef MM_AVX512_BF16
    if (k % 32 == 0) return linear_i8_bf16_rows(x, x_dtype, w, scales, y, m, n, k);
#endif
#ifdef MM_AVX512_VNNI
    if (k % I8_BLOCK == 0) return linear_i8_vnni(x, x_dtype, w, scales, y, m, n, k);
#endif
    return linear_i8_float(x, x_dtype, w, scales, y, m, n, k);
}

/* 0: done; 1: out of memory; 2: a group it does not take (mm_int8_group_ok). */
int mm_linear_i8(const void* x, int x_dtype, const int8_t* w, const uint16_t* scales,
                 int64_t group, void* y, int64_t m, int64_t n, int64_t k, int threads) {
    if (!mm_int8_group_ok(k, group)) return 2;
    const int team = team_threads(threads, m, n * k);
    ON_TEAM(team, linear_i8_any(x, x_dtype, w, scales, group, y, m, n, k));
}

/* Dequantizers, for a prefill's many rows, where a dense GEMM on the dequantized weight beats
 * the int kernels (compute-bound there). Each value is computed in float32 and rounded once to
 * the output dtype (float32 or bfloat16). */

/* int8 [N, K] with bfloat16 scales [N, K / group] -> out [N, K] (group: as mm_linear_i8). */
void mm_dequantize_i8(const int8_t* w, const uint16_t* scales, int64_t group, void* out,
                      int out_dtype, int64_t n, int64_t k, int threads) {
    const int64_t groups = k / group;
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t r = 0; r < n; r++) {
        const uint16_t* sr = scales + r * groups;
        const int8_t* wr = w + r * k;
        int64_t j = 0;
#ifdef MM_AVX512_BF16
        if (group == k || group % 32 == 0)  /* a step of 32 within one group */
            for (; j + 32 <= k; j += 32) {
                const __m512 sv = _mm512_set1_ps(bf16_to_f32(sr[j / group]));
                __m512 a, b;
                i8x32_to_f32(wr + j, &a, &b);
                store_f32x32(out, out_dtype, r * k + j, _mm512_mul_ps(a, sv),
                             _mm512_mul_ps(b, sv));
            }
#endif
        for (; j < k; j++)
            store(out, out_dtype, r * k + j, (float)wr[j] * bf16_to_f32(sr[j / group]));
    }
}
