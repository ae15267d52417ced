/* A bfloat16 x's few rows (a decode's, a verify's) through VDPBF16PS: y [M, N] = x [M, K] .
 * W [N, K]^T, W bfloat16 or int8 with a bfloat16 scale per `group` inputs of each channel
 * (group == K: one per channel), float32 sums; y float32 (mm_logits_bf16: the LM head, whose
 * logits are kept in float32) or bfloat16 (dot_bf16_rows: an int8 linear of a bfloat16 model,
 * from linear_int8.c).
 *
 * x is taken as the bfloat16 it is: each product exact (a bfloat16 times a bfloat16, or an int8
 * q, which bfloat16 holds exactly), float32 sums, one instruction per 32 weights and row where a
 * float32 loop over widened weights spends one multiply-add per 16. A verify's rows (up to
 * DOT_ROWS) share each weight vector loaded (and, int8, converted) once, and each row's sums are
 * the same whatever the rows beside it: a row's result is the one-row call's. */
#include <stdint.h>

#include "kernels.h"

#ifdef MM_AVX512_BF16
#define DOT_ROWS 5 /* rows of x per pass over a weight row: 2 R accumulators in registers */

/* 32 int8 at q as bfloat16 (exact: |q| <= 128) */
static inline __m512bh i8x32_to_bf16(const int8_t* q) {
    __m512 lo, hi;
    i8x32_to_f32(q, &lo, &hi);
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* Rows [i0, i0 + R) of x against weight row r. Per group (the whole row for a bfloat16
 * weight), two independent sums per row (even and odd vectors of 32), added and scaled once at
 * the group's end into the row's float32 total. */
static inline __attribute__((always_inline)) void dot_rows(
    const uint16_t* x, const void* w, int w_dtype, const uint16_t* scales, int64_t group,
    void* y, int y_dtype, int64_t n, int64_t k, int64_t r, int64_t i0, const int R) {
    const int64_t groups = k / group;
    __m512 total[DOT_ROWS];
    for (int i = 0; i < R; i++) total[i] = _mm512_setzero_ps();
    const uint16_t* xr = x + i0 * k;
    for (int64_t g = 0; g < groups; g++) {
        __m512 a0[DOT_ROWS], a1[DOT_ROWS];
        for (int i = 0; i < R; i++) a0[i] = a1[i] = _mm512_setzero_ps();
        int64_t j = g * group;
        const int64_t end = j + group;
        for (; j + 64 <= end; j += 64) {
            __m512bh w0, w1;
            if (w_dtype == DTYPE_BF16) {
                const uint16_t* wr = (const uint16_t*)w + r * k + j;
                prefetch_ahead(wr, 128);
                w0 = (__m512bh)_mm512_loadu_si512(wr);
                w1 = (__m512bh)_mm512_loadu_si512(wr + 32);
            } else {
                const int8_t* wr = (const int8_t*)w + r * k + j;
                prefetch_ahead(wr, 64);
                w0 = i8x32_to_bf16(wr);
                w1 = i8x32_to_bf16(wr + 32);
            }
            for (int i = 0; i < R; i++) {
                a0[i] = _mm512_dpbf16_ps(a0[i], (__m512bh)_mm512_loadu_si512(xr + i * k + j), w0);
                a1[i] = _mm512_dpbf16_ps(a1[i], (__m512bh)_mm512_loadu_si512(xr + i * k + j + 32),
                                         w1);
            }
        }
        if (j < end) {  /* the group's last 32 */
            const __m512bh w0 = w_dtype == DTYPE_BF16
                ? (__m512bh)_mm512_loadu_si512((const uint16_t*)w + r * k + j)
                : i8x32_to_bf16((const int8_t*)w + r * k + j);
            for (int i = 0; i < R; i++)
                a0[i] = _mm512_dpbf16_ps(a0[i], (__m512bh)_mm512_loadu_si512(xr + i * k + j), w0);
        }
        const __m512 scale = _mm512_set1_ps(
            scales == NULL ? 1.0f : bf16_to_f32(scales[r * groups + g]));
        for (int i = 0; i < R; i++)
            total[i] = _mm512_fmadd_ps(_mm512_add_ps(a0[i], a1[i]), scale, total[i]);
    }
    for (int i = 0; i < R; i++)
        store(y, y_dtype, (i0 + i) * n + r, _mm512_reduce_add_ps(total[i]));
}

int dot_bf16_rows(const uint16_t* x, const void* w, int w_dtype, const uint16_t* scales,
                  int64_t group, void* y, int y_dtype, int64_t m, int64_t n, int64_t k) {
    _Pragma("omp for schedule(static) nowait")
    for (int64_t r = 0; r < n; r++) {
        for (int64_t i0 = 0; i0 < m; i0 += DOT_ROWS) {
            switch (m - i0 < DOT_ROWS ? m - i0 : DOT_ROWS) {  /* each compiled unrolled */
                case 1: dot_rows(x, w, w_dtype, scales, group, y, y_dtype, n, k, r, i0, 1); break;
                case 2: dot_rows(x, w, w_dtype, scales, group, y, y_dtype, n, k, r, i0, 2); break;
                case 3: dot_rows(x, w, w_dtype, scales, group, y, y_dtype, n, k, r, i0, 3); break;
                case 4: dot_rows(x, w, w_dtype, scales, group, y, y_dtype, n, k, r, i0, 4); break;
                default: dot_rows(x, w, w_dtype, scales, group, y, y_dtype, n, k, r, i0, 5);
            }
        }
    }
    return 0;
}
#endif

/* w_dtype DTYPE_BF16 (scales NULL, group k) or DTYPE_I8 (bfloat16 scales [N, K / group]).
 * 0: done; 2: not taken here (no VDPBF16PS in this build, k or group not a multiple of 32, or
 * group not dividing k): the caller runs another formulation. */
int mm_logits_bf16(const uint16_t* x, const void* w, int w_dtype, const uint16_t* scales,
                   int64_t group, float* y, int64_t m, int64_t n, int64_t k, int threads) {
#ifdef MM_AVX512_BF16
    const int taken = (w_dtype == DTYPE_BF16 && scales == NULL && group == k) ||
                      (w_dtype == DTYPE_I8 && scales != NULL && group > 0 && k % group == 0);
    if (!taken || k % 32 || group % 32) return 2;
    if (m == 0 || n == 0) return 0;
    const int team = team_threads(threads, m, n * k * (w_dtype == DTYPE_BF16 ? 2 : 1));
    ON_TEAM(team, dot_bf16_rows(x, w, w_dtype, scales, group, y, DTYPE_F32, m, n, k));
#else
    (void)x, (void)w, (void)w_dtype, (void)scales, (void)group, (void)y, (void)m, (void)n,
        (void)k, (void)threads;
    return 2;
#endif
}
