/* Matrix-vector linears with dense weights (float32 or bfloat16) for a decode's few rows:
 * y[M, N] = x[M, K] . W[N, K]^T, a weight row streamed once per call and reused from L1 for every
 * row of x, so that the kernel runs at the memory bandwidth where a GEMM library's small-M path
 * does not. x and y float32 or bfloat16 (y in x's dtype), float32 accumulation. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef LINEAR_VEC
LINEAR_VEC(linear_f32, float, LOAD8_F32)
LINEAR_VEC(linear_bf16, uint16_t, LOAD8_BF16)
#else
LINEAR_PLAIN(linear_f32, float, LOAD_F32)
LINEAR_PLAIN(linear_bf16, uint16_t, LOAD_BF16)
#endif

int mm_linear_f32(const void* x, int x_dtype, const float* w, const uint16_t* scales, void* y,
                  int64_t m, int64_t n, int64_t k, int threads) {
    const int team = team_threads(threads, m, n * k * 4);
    ON_TEAM(team, linear_f32(x, x_dtype, w, scales, y, m, n, k));
}

#ifdef MM_AVX512_BF16
#define BF16_ROWS 5 /* rows of x per pass over a weight row: 2 R accumulators in registers */
/* bfloat16 activations and weights: VDPBF16PS multiplies pairs of bfloat16 exactly and adds
 * them into float32 lanes, one instruction per 32 weights, where the plain loop converts each
 * weight to float32 first. Per output channel, up to BF16_ROWS rows of x (a verify's rows) meet
 * each pair of weight vectors loaded once. Each (row, channel) sums its even and its odd 32s
 * apart and adds the two at the end, whatever the rows: a row's result is the one-row call's.
 * (Tiles of two channels, and x in chunks shared by several channels, measured no faster.) */
static inline __attribute__((always_inline)) void bf16_rows(
    const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t n, int64_t k, int64_t r,
    int64_t i0, const int R) {
    __m512 a0[BF16_ROWS], a1[BF16_ROWS];
    for (int i = 0; i < R; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    const uint16_t* wr = w + r * k;
    const uint16_t* xr = x + i0 * k;
    int64_t j = 0;
    for (; j + 64 <= k; j += 64) {  /* two independent sums per row */
        prefetch_ahead(wr + j, 128);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + j);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + j + 32);
        for (int i = 0; i < R; i++) {
            a0[i] = _mm512_dpbf16_ps(a0[i], (__m512bh)_mm512_loadu_si512(xr + i * k + j), w0);
            a1[i] = _mm512_dpbf16_ps(a1[i], (__m512bh)_mm512_loadu_si512(xr + i * k + j + 32),
                                     w1);
        }
    }
    if (j < k)
        for (int i = 0; i < R; i++)
            a0[i] = _mm512_dpbf16_ps(a0[i], (__m512bh)_mm512_loadu_si512(xr + i * k + j),
                                     (__m512bh)_mm512_loadu_si512(wr + j));
    for (int i = 0; i < R; i++)
        y[(i0 + i) * n + r] = f32_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i])));
}

/* Requires k % 32 == 0. */
static int linear_bf16_dot(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m,
                           int64_t n, int64_t k) {
    _Pragma("omp for schedule(static) nowait")
    for (int64_t r = 0; r < n; r++) {
        for (int64_t i0 = 0; i0 < m; i0 += BF16_ROWS) {
            switch (m - i0 < BF16_ROWS ? m - i0 : BF16_ROWS) {  /* each compiled unrolled */
                case 1: bf16_rows(x, w, y, n, k, r, i0, 1); break;
                case 2: bf16_rows(x, w, y, n, k, r, i0, 2); break;
                case 3: bf16_rows(x, w, y, n, k, r, i0, 3); break;
                case 4: bf16_rows(x, w, y, n, k, r, i0, 4); break;
                default: bf16_rows(x, w, y, n, k, r, i0, 5);
            }
        }
    }
    return 0;
}
#endif

static int linear_bf16_any(const void* x, int x_dtype, const uint16_t* w, const uint16_t* scales,
                           void* y, int64_t m, int64_t n, int64_t k) {
#ifdef MM_AVX512_BF16
    if (x_dtype == DTYPE_BF16 && scales == NULL && k % 32 == 0)
        return linear_bf16_dot(x, w, y, m, n, k);
#endif
    return linear_bf16(x, x_dtype, w, scales, y, m, n, k);
}

int mm_linear_bf16(const void* x, int x_dtype, const uint16_t* w, const uint16_t* scales,
                   void* y, int64_t m, int64_t n, int64_t k, int threads) {
    const int team = team_threads(threads, m, n * k * 2);
    ON_TEAM(team, linear_bf16_any(x, x_dtype, w, scales, y, m, n, k));
}
