/* Linears for tens to a few hundred rows (a short prefill chunk: a second turn's new text; many
 * requests' decodes): y[M, N] = x[M, K] . W[N, K]^T, W float32, bfloat16 or int8 (bfloat16
 * scales [N, K / group]), x and y float32 or bfloat16 (y in x's dtype), float32 sums.
 *
 * The matrix-vector kernel (linear_dense.c) streams each weight row past two rows of x: per
 * vector of inputs it loads as many vectors as it multiplies, and a long row of x leaves L1, so
 * it runs at the loads' speed. Here a register tile of TILE_N channels x TILE_M rows shares its
 * loads: per vector of inputs, TILE_N weight vectors and TILE_M vectors of x feed
 * TILE_N * TILE_M multiply-adds, so the loop is bound by the multiply-adds.
 *
 * Blocking: a thread takes blocks of BLOCK_N channels. For each chunk of KC inputs the block's
 * weights are widened to float32 once into the thread's buffer (in L1), and every tile of rows
 * passes over them (x is read from L2 / L3 once per block, the weight from memory once per call).
 * The sums are kept as vectors [row][channel] in the thread's buffer across chunks and reduced
 * across lanes once at the end.
 *
 * Written with GCC's vector extensions, so that one source builds for every variant: vectors of
 * 16 floats where AVX-512 is there (32 registers), else of 8 (AVX2's 16 registers: 12 sums, 3
 * weights and one row of x). x is copied to float32 with its rows padded to whole vectors
 * when it is bfloat16 or K is not a multiple of the vector; the weight buffer is zero-padded
 * alike. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));

#define TILE_M 4    /* rows of x per register tile */
#define TILE_N 3    /* output channels per register tile */
#define BLOCK_N 12  /* channels widened together: four tiles */
#define KC 256      /* inputs per chunk: the block's widened weights, 12 KiB, stay in L1 */

#define W_F32 0
#define W_BF16 1
#define W_I8 2

static inline vf vload(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Channels [c0, c0 + nb) of W, inputs [j0, j0 + len), as float32 rows of `ld` floats (the
 * columns past len, up to a whole vector, zero); int8 times its group's scale (exact). */
static void widen(const void* w, int w_type, const uint16_t* scales, int64_t group, int64_t k,
                  int64_t c0, int nb, int64_t j0, int64_t len, float* out, int64_t ld) {
    const int size = w_type == W_F32 ? 4 : w_type == W_BF16 ? 2 : 1;
    for (int c = 0; c < nb; c++) {
        float* o = out + c * ld;
        const int64_t at = (c0 + c) * k + j0;
        /* the next chunk of this channel (past its row's end: of the next block's): a block's
         * channels are separate streams, more than the hardware prefetchers run ahead on */
        const int64_t next = j0 + KC < k ? at + KC : (c0 + c + BLOCK_N) * k;
        const char* ahead = (const char*)w + next * size;
        for (int b = 0; b < KC * size; b += 64) __builtin_prefetch(ahead + b, 0, 3);
        if (w_type == W_F32) {
            memcpy(o, (const float*)w + at, sizeof(float) * (size_t)len);
        } else if (w_type == W_BF16) {
            const uint16_t* h = (const uint16_t*)w + at;
            _Pragma("omp simd")
            for (int64_t j = 0; j < len; j++) o[j] = bf16_to_f32(h[j]);
        } else {
            const int8_t* q = (const int8_t*)w + at;
            widen_i8_grouped(q, scales + (c0 + c) * (k / group), group, j0, len, o);
        }
        for (int64_t j = len; j < ld; j++) o[j] = 0.0f;
    }
}

/* sums[r][c] (+)= x[r] . wb[c] over `steps` vectors: MR rows of x (`ldx` apart), NR channels of
 * the widened block (`ldw` apart); sums are vectors [row][channel], `lds` channels per row. */
static inline __attribute__((always_inline)) void tile(
    const float* x, int64_t ldx, const float* wb, int64_t ldw, int64_t steps, vf* sums,
    int64_t lds, int MR, int NR, int first) {
    vf acc[TILE_M][TILE_N];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++)
            acc[r][c] = first ? (vf){0} : sums[r * lds + c];
    for (int64_t s = 0; s < steps; s++) {
        vf wv[TILE_N];
        for (int c = 0; c < NR; c++) wv[c] = vload(wb + c * ldw + s * VL);
        for (int r = 0; r < MR; r++) {
            vf xv = vload(x + r * ldx + s * VL);
#if defined(__AVX2__) /* a whole vector in one register */
            /* in a register, loaded once: GCC would otherwise fold the load into each of the
             * NR multiply-adds, and the loop would be bound by its loads */
            __asm__("" : "+x"(xv));
#endif
            for (int c = 0; c < NR; c++) acc[r][c] += xv * wv[c];
        }
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) sums[r * lds + c] = acc[r][c];
}

/* Every shape of tile, each compiled with its loops unrolled. */
static void tile_any(const float* x, int64_t ldx, const float* wb, int64_t ldw, int64_t steps,
                     vf* sums, int64_t lds, int mr, int nr, int first) {
#define TILE_CASE(MR, NR)                                                                      \
    case (MR) * 4 + (NR):                                                                      \
        tile(x, ldx, wb, ldw, steps, sums, lds, MR, NR, first);                                \
        return;
    switch (mr * 4 + nr) {
        TILE_CASE(4, 3) TILE_CASE(4, 2) TILE_CASE(4, 1)
        TILE_CASE(3, 3) TILE_CASE(3, 2) TILE_CASE(3, 1)
        TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
        TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
    }
#undef TILE_CASE
}

static inline float lanes_sum(vf v) {
    float s = 0.0f;
    for (int l = 0; l < VL; l++) s += v[l];
    return s;
}

/* 0: done; 1: out of memory. */
static int linear_rows(const void* x, int x_dtype, const void* w, int w_type,
                       const uint16_t* scales, int64_t group, void* y, int64_t m, int64_t n,
                       int64_t k, int threads) {
    const int64_t kp = (k + VL - 1) / VL * VL;  /* padded row length */
    const int copy = x_dtype != DTYPE_F32 || kp != k;
    float* xf = (float*)x;
    if (copy) {
        xf = malloc(sizeof(float) * (size_t)(m * kp));
        if (xf == NULL) return 1;
        for (int64_t i = 0; i < m; i++) {
            load_row(xf + i * kp, x, x_dtype, i * k, k);
            for (int64_t j = k; j < kp; j++) xf[i * kp + j] = 0.0f;
        }
    }
    const int64_t blocks = (n + BLOCK_N - 1) / BLOCK_N;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads)")
    {
        float* wb = aligned_alloc(64, sizeof(float) * BLOCK_N * KC);
        vf* sums = aligned_alloc(64, sizeof(vf) * (size_t)(m * BLOCK_N));
        if (wb == NULL || sums == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")  /* reached by every thread, as a worksharing
                                                loop must be */
        for (int64_t b = 0; b < blocks; b++) {
            if (wb == NULL || sums == NULL) continue;
            const int64_t c0 = b * BLOCK_N;
            const int nb = (int)(n - c0 < BLOCK_N ? n - c0 : BLOCK_N);
            for (int64_t j0 = 0; j0 < kp; j0 += KC) {
                const int64_t len = kp - j0 < KC ? kp - j0 : KC;
                widen(w, w_type, scales, group, k, c0, nb, j0, j0 + len > k ? k - j0 : len,
                      wb, KC);
                for (int64_t i = 0; i < m; i += TILE_M) {
                    const int mr = (int)(m - i < TILE_M ? m - i : TILE_M);
                    for (int c = 0; c < nb; c += TILE_N)
                        tile_any(xf + i * kp + j0, kp, wb + c * KC, KC, len / VL,
                                 sums + i * BLOCK_N + c, BLOCK_N, mr,
                                 nb - c < TILE_N ? nb - c : TILE_N, j0 == 0);
                }
            }
            for (int64_t i = 0; i < m; i++)
                for (int c = 0; c < nb; c++)
                    store(y, x_dtype, i * n + c0 + c, lanes_sum(sums[i * BLOCK_N + c]));
        }
        free(wb);
        free(sums);
    }
    if (copy) free(xf);
    return failed;
}

/* w_dtype: DTYPE_F32, DTYPE_BF16 or DTYPE_I8 (then bfloat16 `scales` [N, K / group], group
 * as mm_linear_i8 takes it). 0: done; 1: out of memory; 2: a group it does not take. */
int mm_linear_rows(const void* x, int x_dtype, const void* w, int w_dtype,
                   const uint16_t* scales, int64_t group, void* y, int64_t m, int64_t n,
                   int64_t k, int threads) {
    const int w_type = w_dtype == DTYPE_F32 ? W_F32 : w_dtype == DTYPE_BF16 ? W_BF16 : W_I8;
    if (w_type == W_I8 && !mm_int8_group_ok(k, group)) return 2;
    if (m == 0 || n == 0) return 0;
    if (k == 0) {  /* empty sums */
        for (int64_t i = 0; i < m * n; i++) store(y, x_dtype, i, 0.0f);
        return 0;
    }
    return linear_rows(x, x_dtype, w, w_type, scales, group, y, m, n, k, threads);
}
