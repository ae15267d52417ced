/* int4 weights in our pack: the matrix-vector linear of a decode's few rows, and the
 * dequantizer of a prefill's (where a dense GEMM on the dequantized weight beats the int
 * kernels).
 *
 * Our pack (models/kernels/quantization.py): output channels in blocks of 64, each block's inputs
 * in steps of 4, [N / 64, K / 4, 32, 4] bytes: byte (b, s, d, j) holds q of channel 64b + d for
 * input 4s + j in its low nibble and of channel 64b + 32 + d in its high one. So the four inputs
 * of one channel that a 32-bit lane of an integer dot product (VPDPBUSD, SDOT, PMADDUBSW +
 * PMADDWD) sums are adjacent, and one vector load covers consecutive channels: every instruction
 * set reads it as stored, nothing is permuted. sz [K / group, N, 2] bfloat16 (scale, zero), the
 * weight being (q - 8) * scale + zero. Per group and channel,
 *   sum_k w_k x_k = scale * sum_k q_k x_k + (zero - 8 * scale) * sum_k x_k,
 * where sum_k x_k is shared by all channels (computed once per call).
 *
 * The integer paths write each group's activations as s * (h + l / 256) with int8 digits h, l
 * (s = max|x| / 127 over the group): within max|x| / 32512 of x, finer than the bfloat16
 * activations PyTorch's int4 kernel takes; their offset term takes the sum of the values the
 * digits write, so that they compute exactly W . x' for that x'. Requires n % 64 == 0,
 * k % group == 0 and group % 4 == 0. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define I4_STEP 128 /* bytes of one block for 4 inputs: 32 columns x 4 */

/* The plain path: one block of 64 channels for every row of x (float32 [m, k]). */
static void i4_block_float(const float* xf, const float* xsum, const uint8_t* wb,
                           const uint16_t* sz, float* out, int64_t m, int64_t n, int64_t k,
                           int64_t group, int64_t b) {
    const int64_t groups = k / group;
    for (int64_t i = 0; i < m; i++) {
        float acc[I4_BLOCK_N] = {0};
        for (int64_t g = 0; g < groups; g++) {
            float dot[I4_BLOCK_N] = {0};
            for (int64_t kk = g * group; kk < (g + 1) * group; kk += 4) {
                const uint8_t* p = wb + kk / 4 * I4_STEP;
                for (int j = 0; j < 4; j++) {
                    const float xv = xf[i * k + kk + j];
                    _Pragma("omp simd")
                    for (int d = 0; d < I4_BLOCK_N / 2; d++) {
                        dot[d] += (float)(p[4 * d + j] & 15) * xv;
                        dot[d + I4_BLOCK_N / 2] += (float)(p[4 * d + j] >> 4) * xv;
                    }
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

#ifdef MM_AVX512_VNNI
/* acc += dot(u8 lanes of a, s8 lanes of b), as _mm512_dpbusd_epi32, written as an instruction
 * whose accumulator the compiler keeps in place: with the intrinsic, GCC 12 copies every
 * accumulator through another register (and spills) around each dot product. */
#define DPBUSD(ACC, A, B) __asm__("vpdpbusd %2, %1, %0" : "+v"(ACC) : "v"(A), "v"(B))

/* Rows [0, R) of x and one block of 64 channels: per step of 4 inputs, two 64-byte loads of
 * 16 columns each; their low nibbles are channels 0 .. 15 and 16 .. 31, their high ones 32 .. 47
 * and 48 .. 63, each 32-bit lane the channel's four inputs: the unsigned operand of VPDPBUSD,
 * against each row's four digits broadcast. The nibbles are unpacked once per step for all R
 * rows (a verify's rows share them); each row keeps its own 8 integer accumulators per group
 * (in registers: R <= 3) and meets its group's scales in out's float sums, touched once per
 * group. A row's arithmetic is the same whatever R: each row's result is the one-row call's. */
static inline __attribute__((always_inline)) void i4_rows_vnni(
    const int8_t* digits, const float* gscale, const float* xsum, const uint8_t* wb,
    const uint16_t* sz, float* out, int64_t n, int64_t k, int64_t group, int64_t b, const int R) {
    const int64_t groups = k / group;
    const __m512i nibble = _mm512_set1_epi8(15);
    float* o = out + b * I4_BLOCK_N;
    for (int r = 0; r < R; r++) memset(o + r * n, 0, sizeof(float) * I4_BLOCK_N);
    for (int64_t g = 0; g < groups; g++) {
        __m512i h[3][4], l[3][4];
        for (int r = 0; r < R; r++)
            for (int q = 0; q < 4; q++) h[r][q] = l[r][q] = _mm512_setzero_si512();
        const uint8_t* p = wb + g * group / 4 * I4_STEP;
        for (int64_t kk = g * group; kk < (g + 1) * group; kk += 4, p += I4_STEP) {
            prefetch_ahead(p, I4_STEP);
            const __m512i a = _mm512_loadu_si512(p), c = _mm512_loadu_si512(p + 64);
            const __m512i w0 = _mm512_and_si512(a, nibble);
            const __m512i w1 = _mm512_and_si512(c, nibble);
            const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(a, 4), nibble);
            const __m512i w3 = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
            for (int r = 0; r < R; r++) {
                int32_t h4, l4;
                memcpy(&h4, digits + 2 * r * k + kk, 4);
                memcpy(&l4, digits + (2 * r + 1) * k + kk, 4);
                const __m512i hv = _mm512_set1_epi32(h4), lv = _mm512_set1_epi32(l4);
                DPBUSD(h[r][0], w0, hv); DPBUSD(l[r][0], w0, lv);
                DPBUSD(h[r][1], w1, hv); DPBUSD(l[r][1], w1, lv);
                DPBUSD(h[r][2], w2, hv); DPBUSD(l[r][2], w2, lv);
                DPBUSD(h[r][3], w3, hv); DPBUSD(l[r][3], w3, lv);
            }
        }
        /* (scale, zero) pairs of 16 channels per register, the scale in each lane's low half */
        const uint16_t* s = sz + (g * n + b * I4_BLOCK_N) * 2;
        for (int q = 0; q < 4; q++) {
            const __m512i pair = _mm512_loadu_si512(s + 32 * q);
            const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
            const __m512 zero = _mm512_castsi512_ps(
                _mm512_and_si512(pair, _mm512_set1_epi32((int)0xffff0000u)));
            const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);
            for (int r = 0; r < R; r++) {
                const __m512i both = _mm512_add_epi32(_mm512_slli_epi32(h[r][q], 8), l[r][q]);
                const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(both),
                                                 _mm512_set1_ps(gscale[r * groups + g]));
                float* at = o + r * n + 16 * q;
                _mm512_storeu_ps(at, _mm512_fmadd_ps(
                    offset, _mm512_set1_ps(xsum[r * groups + g]),
                    _mm512_fmadd_ps(dot, scale, _mm512_loadu_ps(at))));
            }
        }
    }
}

/* Every row of x against one block: tiles of up to 3 rows, each compiled with R fixed. */
static void i4_block_vnni(const int8_t* digits, const float* gscale, const float* xsum,
                          const uint8_t* wb, const uint16_t* sz, float* out, int64_t m, int64_t n,
                          int64_t k, int64_t group, int64_t b) {
    const int64_t groups = k / group;
    for (int64_t i = 0; i < m; i += 3) {
        const int64_t left = m - i;
        const int8_t* d = digits + 2 * i * k;
        const float *gs = gscale + i * groups, *xs = xsum + i * groups;
        float* oi = out + i * n;
        if (left >= 3) i4_rows_vnni(d, gs, xs, wb, sz, oi, n, k, group, b, 3);
        else if (left == 2) i4_rows_vnni(d, gs, xs, wb, sz, oi, n, k, group, b, 2);
        else i4_rows_vnni(d, gs, xs, wb, sz, oi, n, k, group, b, 1);
    }
}
#define I4_ROWS_PATH i4_block_vnni
#elif defined(MM_AVX2)
/* 8 channels' sums of 4 products, u8 nibbles (lanes of w) x s8 digits (d, broadcast): PMADDUBSW
 * pairs them into int16 (at most 2 * 15 * 127, no saturation), PMADDWD the pairs into int32. */
static inline __m256i i4_dot8(__m256i w, __m256i d) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, d), _mm256_set1_epi16(1));
}

/* The (scale, zero) of 8 channels (16 bfloat16 at s) -> acc += scale * dot + offset * xs. */
static inline __m256 i4_finish8(__m256 acc, __m256i both, const uint16_t* s, __m256 sr,
                                __m256 xs) {
    const __m256i pair = _mm256_loadu_si256((const __m256i*)s);
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
    const __m256 zero = _mm256_castsi256_ps(
        _mm256_and_si256(pair, _mm256_set1_epi32((int)0xffff0000u)));
    const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);
    const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(both), sr);
    return _mm256_fmadd_ps(offset, xs, _mm256_fmadd_ps(dot, scale, acc));
}

/* Rows [0, R) of x (R <= 2) and one block of 64 channels, as the VNNI path. Per group, two
 * halves of 32 channels (columns 0 .. 15, then 16 .. 31: their low and high nibbles), so that
 * the int32 accumulators of a half, 256 h + l per channel (at most 4 * 15 * 32639 per step of 4
 * inputs: int32 holds a group of over 4000 inputs), stay in registers; the second half reads
 * the group's bytes from L1, so memory is streamed once and in order (a half per pass over the
 * whole block reads every other cache line, which the hardware prefetchers follow poorly). The
 * nibbles are unpacked once per step for the R rows; each row's float sums live in out,
 * touched once per group and half. (Summing PMADDUBSW's pairs in int16 over several steps
 * before PMADDWD saves instructions but needs more accumulators than there are registers: it
 * measured slower, docs/performance.md.) A row's arithmetic is the same whatever R. */
static inline __attribute__((always_inline)) void i4_rows_avx2(
    const int8_t* digits, const float* gscale, const float* xsum, const uint8_t* wb,
    const uint16_t* sz, float* out, int64_t n, int64_t k, int64_t group, int64_t b, const int R) {
    const int64_t groups = k / group;
    const __m256i nibble = _mm256_set1_epi8(15);
    float* o = out + b * I4_BLOCK_N;
    for (int r = 0; r < R; r++) memset(o + r * n, 0, sizeof(float) * I4_BLOCK_N);
    for (int64_t g = 0; g < groups; g++) {
        for (int half = 0; half < 2; half++) {
            __m256i acc[2][4];
            for (int r = 0; r < R; r++)
                for (int q = 0; q < 4; q++) acc[r][q] = _mm256_setzero_si256();
            const uint8_t* p = wb + g * group / 4 * I4_STEP + 64 * half;
            for (int64_t kk = g * group; kk < (g + 1) * group; kk += 4, p += I4_STEP) {
                if (half == 0) prefetch_ahead(p, I4_STEP);
                const __m256i a = _mm256_loadu_si256((const __m256i*)p);
                const __m256i c = _mm256_loadu_si256((const __m256i*)(p + 32));
                const __m256i w[4] = {  /* 8 channels each */
                    _mm256_and_si256(a, nibble), _mm256_and_si256(c, nibble),
                    _mm256_and_si256(_mm256_srli_epi16(a, 4), nibble),
                    _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble)};
                for (int r = 0; r < R; r++) {
                    int32_t h4, l4;
                    memcpy(&h4, digits + 2 * r * k + kk, 4);
                    memcpy(&l4, digits + (2 * r + 1) * k + kk, 4);
                    const __m256i hv = _mm256_set1_epi32(h4), lv = _mm256_set1_epi32(l4);
                    for (int q = 0; q < 4; q++)
                        acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_add_epi32(
                            _mm256_slli_epi32(i4_dot8(w[q], hv), 8), i4_dot8(w[q], lv)));
                }
            }
            const uint16_t* s = sz + (g * n + b * I4_BLOCK_N + 16 * half) * 2;
            for (int r = 0; r < R; r++) {
                const __m256 sr = _mm256_set1_ps(gscale[r * groups + g]);
                const __m256 xs = _mm256_set1_ps(xsum[r * groups + g]);
                float* at = o + r * n + 16 * half;
                static const int col[4] = {0, 8, 32, 40};  /* channels of acc[r][q] - 16 half */
                for (int q = 0; q < 4; q++)
                    _mm256_storeu_ps(at + col[q], i4_finish8(_mm256_loadu_ps(at + col[q]),
                                                             acc[r][q], s + 2 * col[q], sr, xs));
            }
        }
    }
}

/* Every row of x against one block: tiles of up to 2 rows, each compiled with R fixed. */
static void i4_block_avx2(const int8_t* digits, const float* gscale, const float* xsum,
                          const uint8_t* wb, const uint16_t* sz, float* out, int64_t m, int64_t n,
                          int64_t k, int64_t group, int64_t b) {
    const int64_t groups = k / group;
    for (int64_t i = 0; i < m; i += 2) {
        const int8_t* d = digits + 2 * i * k;
        const float *gs = gscale + i * groups, *xs = xsum + i * groups;
        if (m - i >= 2) i4_rows_avx2(d, gs, xs, wb, sz, out + i * n, n, k, group, b, 2);
        else i4_rows_avx2(d, gs, xs, wb, sz, out + i * n, n, k, group, b, 1);
    }
}
#define I4_ROWS_PATH i4_block_avx2
#elif defined(MM_NEON_DOT)
/* One row of x and one block of 64 channels through SDOT: per step of 4 inputs, eight 16-byte
 * loads of 4 columns each; the nibbles less 8 are signed weights (-8 .. 7), so the offset term
 * is the zero's alone: sum_k w_k x_k = scale * sum_k (q_k - 8) x_k + zero * sum_k x_k. The
 * accumulators hold 256 h + l per channel (16 x 4 channels); per group, two halves of 32
 * channels, the second reading the group's bytes from L1 (memory streamed once, in order, as
 * the AVX2 path). */
static inline void i4_block_neon(const int8_t* hd, const int8_t* ld, const float* gscale,
                                 const float* xsum, const uint8_t* wb, const uint16_t* sz,
                                 float* out, int64_t n, int64_t k, int64_t group, int64_t b) {
    const int64_t groups = k / group;
    const uint8x16_t nibble = vdupq_n_u8(15);
    const int8x16_t eight = vdupq_n_s8(8);
    float32x4_t acc[16];  /* [half][8]: channels 16 half + 4 (i % 4) (+ 32 for i >= 4) */
    for (int i = 0; i < 16; i++) acc[i] = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < groups; g++) {
        const float32x4_t sr = vdupq_n_f32(gscale[g]), xs = vdupq_n_f32(xsum[g]);
        for (int half = 0; half < 2; half++) {
            int32x4_t sum[8];
            for (int i = 0; i < 8; i++) sum[i] = vdupq_n_s32(0);
            const uint8_t* p = wb + g * group / 4 * I4_STEP + 64 * half;
            for (int64_t kk = g * group; kk < (g + 1) * group; kk += 4, p += I4_STEP) {
                if (half == 0) prefetch_ahead(p, I4_STEP);
                int32_t h4, l4;
                memcpy(&h4, hd + kk, 4);
                memcpy(&l4, ld + kk, 4);
                const int8x16_t hv = vreinterpretq_s8_s32(vdupq_n_s32(h4));
                const int8x16_t lv = vreinterpretq_s8_s32(vdupq_n_s32(l4));
                for (int q = 0; q < 4; q++) {  /* columns 4q .. 4q + 3 of this half */
                    const uint8x16_t v = vld1q_u8(p + 16 * q);
                    const int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, nibble)), eight);
                    const int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), eight);
                    const int32x4_t lo_h = vdotq_s32(vdupq_n_s32(0), lo, hv);
                    const int32x4_t hi_h = vdotq_s32(vdupq_n_s32(0), hi, hv);
                    sum[q] = vaddq_s32(sum[q], vaddq_s32(vshlq_n_s32(lo_h, 8),
                                                         vdotq_s32(vdupq_n_s32(0), lo, lv)));
                    sum[4 + q] = vaddq_s32(sum[4 + q], vaddq_s32(
                        vshlq_n_s32(hi_h, 8), vdotq_s32(vdupq_n_s32(0), hi, lv)));
                }
            }
            const uint16_t* s = sz + (g * n + b * I4_BLOCK_N + 16 * half) * 2;
            float32x4_t* at = acc + 8 * half;
            for (int i = 0; i < 8; i++) {
                const uint16x4x2_t pair = vld2_u16(s + 2 * (4 * (i % 4) + 32 * (i / 4)));
                const float32x4_t scale = vreinterpretq_f32_u32(vshll_n_u16(pair.val[0], 16));
                const float32x4_t zero = vreinterpretq_f32_u32(vshll_n_u16(pair.val[1], 16));
                const float32x4_t dot = vmulq_f32(vcvtq_f32_s32(sum[i]), sr);
                at[i] = vfmaq_f32(vfmaq_f32(at[i], dot, scale), zero, xs);
            }
        }
    }
    for (int half = 0; half < 2; half++) {
        float* o = out + b * I4_BLOCK_N + 16 * half;
        for (int i = 0; i < 8; i++) vst1q_f32(o + 4 * (i % 4) + 32 * (i / 4), acc[8 * half + i]);
    }
}

/* Every row of x against one block, a row at a time (the dot products bound the time). */
static void i4_block_neon_rows(const int8_t* digits, const float* gscale, const float* xsum,
                               const uint8_t* wb, const uint16_t* sz, float* out, int64_t m,
                               int64_t n, int64_t k, int64_t group, int64_t b) {
    const int64_t groups = k / group;
    for (int64_t i = 0; i < m; i++)
        i4_block_neon(digits + 2 * i * k, digits + (2 * i + 1) * k, gscale + i * groups,
                      xsum + i * groups, wb, sz, out + i * n, n, k, group, b);
}
#define I4_ROWS_PATH i4_block_neon_rows
#endif

/* The team's body of mm_linear_i4: x's sums and digits per thread (a decode's few rows), the
 * blocks of 64 channels shared; each block's outputs stored as soon as they are made. */
static int linear_i4(const void* x, int x_dtype, const uint8_t* w, const uint16_t* sz, void* y,
                     int64_t m, int64_t n, int64_t k, int64_t group, int generic) {
    const int64_t groups = k / group, blocks = n / I4_BLOCK_N;
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
                xqsum[i * groups + g] = digit_sum * (s / 256.0f);
                gscale[i * groups + g] = s / 256.0f;
            }
        }
    }
    _Pragma("omp for schedule(static) nowait")
    for (int64_t b = 0; b < blocks; b++) {
        if (failed) continue;
        const uint8_t* wb = w + b * k * (I4_BLOCK_N / 2);
#ifdef I4_ROWS_PATH
        if (!generic)
            I4_ROWS_PATH(digits, gscale, xqsum, wb, sz, out, m, n, k, group, b);
        else
#endif
            i4_block_float(xf, xsum, wb, sz, out, m, n, k, group, b);
        if (out != y)
            for (int64_t i = 0; i < m; i++)
                store_row(y, out + i * n + b * I4_BLOCK_N, x_dtype, i * n + b * I4_BLOCK_N,
                          I4_BLOCK_N);
    }
    (void)generic;
    if (owned) free((void*)xf);
    free(xsum), free(gscale), free(digits);
    if (out != y) free(out);
    return failed;
}

/* generic != 0: the plain path even where an integer one is built (for tests). */
int mm_linear_i4(const void* x, int x_dtype, const uint8_t* w, const uint16_t* sz, void* y,
                 int64_t m, int64_t n, int64_t k, int64_t group, int generic, int threads) {
    if (n % I4_BLOCK_N || k % group || group % 4) return 2;
    const int team = team_threads(threads, m, n * k / 2);
    ON_TEAM(team, linear_i4(x, x_dtype, w, sz, y, m, n, k, group, generic));
}

/* int4 in our pack -> out [count * 64, K]: output channels 64 first .. 64 (first + count) - 1 of
 * the weight, row-major as a dense weight is (so a GEMM may take it as its plain left operand).
 * Each value is (q - 8) * scale + zero as fma(q, scale, zero - 8 * scale) in float32, rounded
 * once to the output dtype. */
void mm_dequantize_i4(const uint8_t* w, const uint16_t* sz, void* out, int out_dtype, int64_t n,
                      int64_t k, int64_t group, int64_t first, int64_t count, int threads) {
    const size_t size = out_dtype == DTYPE_F32 ? sizeof(float) : sizeof(uint16_t);
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t b = first; b < first + count; b++)
        mm_dequantize_i4_block(w, sz, (char*)out + (size_t)((b - first) * I4_BLOCK_N * k) * size,
                               out_dtype, k, n, k, group, b, 0, k / group);
}

/* Block b (output channels 64b .. 64b + 63) of the pack, groups g0 .. g1 - 1, into out's 64 rows
 * (ldo apart): column j of out is input g0 * group + j. Per step of 4 inputs, each column's 4
 * bytes give 4 consecutive outputs of its two channels. */
void mm_dequantize_i4_block(const uint8_t* w, const uint16_t* sz, void* out, int out_dtype,
                            int64_t ldo, int64_t n, int64_t k, int64_t group, int64_t b,
                            int64_t g0, int64_t g1) {
    const uint8_t* wb = w + b * k * (I4_BLOCK_N / 2);
    const int64_t base = g0 * group;
    float values[I4_BLOCK_N][4];
    for (int64_t g = g0; g < g1; g++) {
        float scale[I4_BLOCK_N], offset[I4_BLOCK_N];
        const uint16_t* s = sz + (g * n + b * I4_BLOCK_N) * 2;
        for (int c = 0; c < I4_BLOCK_N; c++) {
            scale[c] = bf16_to_f32(s[2 * c]);
            offset[c] = bf16_to_f32(s[2 * c + 1]) - 8.0f * scale[c];
        }
        for (int64_t kk = g * group; kk < (g + 1) * group; kk += 4) {
            const uint8_t* p = wb + kk / 4 * I4_STEP;
            _Pragma("omp simd")
            for (int d = 0; d < I4_BLOCK_N / 2; d++)
                for (int j = 0; j < 4; j++) {
                    values[d][j] = fmaf((float)(p[4 * d + j] & 15), scale[d], offset[d]);
                    values[d + 32][j] = fmaf((float)(p[4 * d + j] >> 4), scale[d + 32],
                                             offset[d + 32]);
                }
            for (int c = 0; c < I4_BLOCK_N; c++)
                store_row(out, values[c], out_dtype, c * ldo + kk - base, 4);
        }
    }
}
