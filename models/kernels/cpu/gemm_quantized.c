/* A quantized weight's GEMM for a prefill's many rows, y = x . W^T, with W int8 (a bfloat16
 * scale per output channel; the plain version also per group of inputs) or int4 (our pack, a
 * scale and zero per group), never dequantized whole: each thread dequantizes a panel of its
 * output channels (64 channels x up to PANEL_K inputs) into its own cache and multiplies every
 * row of x by it: in bfloat16 through VDPBF16PS with AVX-512 BF16 (described here), else in
 * float32 (the plain version at the end, vectorized by the compiler for the variant). The weight
 * is read from memory once per call and the product runs from cache, as a dense GEMM on a
 * prepacked weight does; a dequantized copy written out and read back (what
 * dequantize-then-GEMM does) costs that GEMM a pass over the copy.
 *
 * Orientation: a vector lane is a row of x, so the weight panel stays row-major (a pair of
 * inputs of one channel is one 32-bit broadcast) and only x is rearranged, once per call, into
 * pairs of inputs [k / 2][rows][2] per block of 64 rows. The float32 sums are kept per channel
 * ([channel][rows], 16 consecutive rows per accumulator) and transposed 16 x 16 in registers
 * into y [M, N] (a transposed result would cost the operations after it: strided inputs).
 *
 * Work: x is packed whole; a work item is up to ROW_CHUNK rows x one block of 64 channels, the
 * items in chunk-major order split into equal contiguous runs per thread. While a panel is
 * multiplied, the bytes of the next one are read ahead into L2.
 *
 * Register tile: 64 rows (four vectors) x 6 channels, 24 accumulators; per pair of inputs, four
 * loads of x, six broadcasts of the weight and 24 dot products. Rows beyond M are zero-padded to
 * 16; smaller tiles take the edges.
 *
 * Values: int8 panels hold q exactly (|q| <= 127 fits bfloat16's significand) and the channel's
 * scale multiplies the float32 sum; int4 panels hold (q - 8) * scale + zero rounded to bfloat16
 * (mm_dequantize_i4_block: what the dequantized formulation multiplies by). x is rounded to
 * bfloat16 (as the int kernels take it); sums in float32, rounded once to x's dtype.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#ifdef MM_AVX512_BF16
#define GEMM_Q_BF16 1

#define PANEL_N I4_BLOCK_N /* output channels per panel: one block of the int4 pack */
#define PANEL_K 896        /* inputs per panel (a multiple of 128: of every int4 group size) */
#define ROW_CHUNK 256      /* rows per work item, at most: each dequantizes its panels once */
#define TILE_ROWS 64       /* rows per register tile (four vectors); x is packed per 64 rows */
#define TILE_N 6           /* channels per register tile */

/* acc[r][c] (+)= sum_p xp[p][r] . w[c][p] over kk inputs (kk / 2 pairs): MB vectors of 16 rows
 * (the block's rows are `width` apart per pair), NR channels (rows of w, ldw apart); c holds the
 * float32 sums as [channel][rows] (ldc apart). `first` starts from zero instead of c. */
static inline __attribute__((always_inline)) void tile(
    const uint16_t* xp, int64_t width, const uint16_t* w, int64_t ldw, int64_t kk, float* c,
    int64_t ldc, int MB, int NR, int first) {
    __m512 acc[4][TILE_N];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NR; j++)
            acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + j * ldc + 16 * i);
    for (int64_t p = 0; p < kk / 2; p++) {
        __m512 xv[4];
        for (int i = 0; i < MB; i++)
            xv[i] = _mm512_loadu_ps((const float*)(xp + 2 * (p * width + 16 * i)));
        for (int j = 0; j < NR; j++) {
            int32_t pair;
            memcpy(&pair, w + j * ldw + 2 * p, 4);
            const __m512bh wv = (__m512bh)_mm512_set1_epi32(pair);
            for (int i = 0; i < MB; i++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv[i], wv);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NR; j++) _mm512_storeu_ps(c + j * ldc + 16 * i, acc[i][j]);
}

/* tile() with MB and NR constant, so that its accumulators live in registers */
static void tile_any(const uint16_t* xp, int64_t width, const uint16_t* w, int64_t ldw,
                     int64_t kk, float* c, int64_t ldc, int mb, int nr, int first) {
#define TILE_CASE(MB, NR) \
    case (MB) * 8 + (NR): tile(xp, width, w, ldw, kk, c, ldc, MB, NR, first); break;
#define TILE_ROW(MB) \
    TILE_CASE(MB, 1) TILE_CASE(MB, 2) TILE_CASE(MB, 3) TILE_CASE(MB, 4) TILE_CASE(MB, 5) \
    TILE_CASE(MB, 6)
    switch (mb * 8 + nr) {
        TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4)
    }
#undef TILE_ROW
#undef TILE_CASE
}

/* x [rows, K] -> xp: per block of 64 rows (block i at i * 64 * k, of width
 * min(64, padded - 64 i)), pairs [k / 2][width][2] in bfloat16; padded rows are zero. One
 * (16 rows x 32 inputs) tile: t of (k / 32) * (padded / 16). */
static void pack_tile(const void* x, int dt, int64_t k, int64_t rows, int64_t padded,
                      uint16_t* xp, int64_t t) {
    const int64_t p0 = (t / (padded / 16)) * 16, r = (t % (padded / 16)) * 16;
    __m512 v[16];
    for (int i = 0; i < 16; i++) {
        if (r + i >= rows) {
            v[i] = _mm512_setzero_ps();
        } else if (dt == DTYPE_BF16) {
            v[i] = _mm512_loadu_ps((const uint16_t*)x + (r + i) * k + 2 * p0);
        } else {
            const float* row = (const float*)x + (r + i) * k + 2 * p0;
            v[i] = (__m512)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row));
        }
    }
    transpose16(v);  /* v[j]: pair p0 + j of the 16 rows */
    const int64_t block = r / TILE_ROWS, width = padded - block * TILE_ROWS;
    const int64_t w = width < TILE_ROWS ? width : TILE_ROWS;
    uint16_t* at = xp + block * TILE_ROWS * k + 2 * (r % TILE_ROWS);
    for (int j = 0; j < 16; j++) _mm512_storeu_ps(at + 2 * (p0 + j) * w, v[j]);
}

/* Panel inputs k0 .. k0 + kk - 1 of output channels c0 .. c0 + nc - 1 -> panel (rows PANEL_K
 * apart), bfloat16. */
static void dequantize_panel(const void* w, int format, const uint16_t* scales, int64_t group,
                             int64_t n, int64_t k, int64_t c0, int64_t nc, int64_t k0,
                             int64_t kk, uint16_t* panel) {
    if (format == QUANT_INT4) {
        mm_dequantize_i4_block(w, scales, panel, DTYPE_BF16, PANEL_K, n, k, group,
                               c0 / I4_BLOCK_N, k0 / group, (k0 + kk) / group);
        return;
    }
    for (int64_t c = 0; c < nc; c++) {
        const int8_t* q = (const int8_t*)w + (c0 + c) * k + k0;
        for (int64_t j = 0; j < kk; j += 32) {  /* exact: |q| <= 127 fits bfloat16 */
            __m512 a, b;
            i8x32_to_f32(q + j, &a, &b);
            _mm512_storeu_si512(panel + c * PANEL_K + j, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}

/* The bytes a panel is dequantized from, as rows of a strided region, read ahead into L2 a
 * share at a time while the panel before it is multiplied (a panel read only when it is reached
 * would stall on memory at each one: the weights stream from memory, not from cache). */
typedef struct {
    const char* base;
    int64_t rows, row_bytes, stride;  /* lines: rows x ceil(row_bytes / 64) */
    int64_t next, lines;
} Ahead;

static Ahead ahead_of(const void* w, int format, int64_t n, int64_t k, int64_t c0,
                      int64_t k0) {
    Ahead a = {0};
    if (c0 >= n) return a;
    const int64_t kk = k - k0 < PANEL_K ? k - k0 : PANEL_K;
    if (format == QUANT_INT4) {  /* block c0 / 64: [k][32 bytes], inputs k0 .. k0 + kk - 1 */
        a.base = (const char*)w + (c0 / I4_BLOCK_N * k + k0) * (I4_BLOCK_N / 2);
        a.rows = 1, a.row_bytes = kk * (I4_BLOCK_N / 2);
    } else {
        a.base = (const char*)w + c0 * k + k0;
        a.rows = n - c0 < PANEL_N ? n - c0 : PANEL_N, a.row_bytes = kk, a.stride = k;
    }
    a.lines = a.rows * ((a.row_bytes + 63) / 64);
    return a;
}

static void read_ahead(Ahead* a, int64_t count) {
    const int64_t per_row = (a->row_bytes + 63) / 64;
    for (; count > 0 && a->next < a->lines; count--, a->next++)
        _mm_prefetch(a->base + a->next / per_row * a->stride + a->next % per_row * 64,
                     _MM_HINT_T1);
}

/* Output channels c0 .. c0 + nc - 1 of rows r0 .. r0 + rows - 1 (r0 a multiple of 64; x packed
 * whole, `padded` rows), panel by panel, into y; acc holds PANEL_N x the chunk's rows. */
static void panel_product(const void* w, int format, const uint16_t* scales, int64_t group,
                          const uint16_t* xp, int64_t padded, void* y, int dt, int64_t ldy,
                          int64_t n, int64_t k, int64_t c0, int64_t r0, int64_t rows,
                          uint16_t* panel, float* acc) {
    const int64_t nc = n - c0 < PANEL_N ? n - c0 : PANEL_N;
    const int64_t span = (rows + 15) / 16 * 16;  /* the chunk's rows, padded */
    const int64_t calls = (nc + TILE_N - 1) / TILE_N * ((span + TILE_ROWS - 1) / TILE_ROWS);
    for (int64_t k0 = 0; k0 < k; k0 += PANEL_K) {
        const int64_t kk = k - k0 < PANEL_K ? k - k0 : PANEL_K;
        dequantize_panel(w, format, scales, group, n, k, c0, nc, k0, kk, panel);
        /* the next panel: this block's next inputs, else the next block's first (this
         * thread's next, under the static schedule) */
        Ahead next = k0 + PANEL_K < k ? ahead_of(w, format, n, k, c0, k0 + PANEL_K)
                                      : ahead_of(w, format, n, k, c0 + PANEL_N, 0);
        const int64_t share = (next.lines + calls - 1) / calls;
        for (int64_t j = 0; j < nc; j += TILE_N) {
            const int nr = nc - j < TILE_N ? (int)(nc - j) : TILE_N;
            for (int64_t r = r0; r < r0 + span; r += TILE_ROWS) {
                const int64_t width = padded - r < TILE_ROWS ? padded - r : TILE_ROWS;
                read_ahead(&next, share);
                tile_any(xp + r * k + k0 * width, width, panel + j * PANEL_K, PANEL_K, kk,
                         acc + j * span + (r - r0), span, (int)(width / 16), nr, k0 == 0);
            }
        }
    }
    /* acc [channel][row] -> y [row][channel], 16 x 16 at a time transposed in registers */
    for (int64_t c = 0; c < nc; c += 16) {
        const int64_t cn = nc - c < 16 ? nc - c : 16;
        const __mmask16 cols = (__mmask16)((1u << cn) - 1);
        __m512 s[16];  /* each channel's scale (int4: folded into the panel) */
        for (int i = 0; i < cn; i++)
            s[i] = _mm512_set1_ps(format == QUANT_INT8 ? bf16_to_f32(scales[c0 + c + i]) : 1.0f);
        for (int64_t r = 0; r < rows; r += 16) {
            __m512 v[16];
            for (int i = 0; i < 16; i++)
                v[i] = i < cn ? _mm512_mul_ps(_mm512_loadu_ps(acc + (c + i) * span + r), s[i])
                              : _mm512_setzero_ps();
            transpose16(v);  /* v[j]: row r + j, channels c .. c + 15 */
            for (int j = 0; j < 16 && r + j < rows; j++) {
                const int64_t at = (r0 + r + j) * ldy + c0 + c;
                if (dt == DTYPE_F32)
                    _mm512_mask_storeu_ps((float*)y + at, cols, v[j]);
                else
                    _mm256_mask_storeu_epi16((uint16_t*)y + at, cols,
                                             (__m256i)_mm512_cvtneps_pbh(v[j]));
            }
        }
    }
}

/* Rows per work item (a multiple of 64): ROW_CHUNK, or fewer where there are fewer channel
 * blocks than threads, so that every thread gets work. (Capping the chunk so that its packed
 * rows fit L2 measured slower: panels dequantized twice as often cost more.) */
static int64_t chunk_rows(int64_t m, int64_t blocks, int threads) {
    if (blocks >= threads) return ROW_CHUNK;
    const int64_t split = (threads + blocks - 1) / blocks;
    const int64_t even = ((m + split - 1) / split + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    return even < ROW_CHUNK ? even : ROW_CHUNK;
}
#else
/* The plain version, for every variant without AVX-512 BF16: float32 panels [PANEL_K][64]
 * (transposed: a row holds the 64 channels of one input) and a register tile of TILE_R rows x
 * TILE_C channels that the compiler vectorizes for the variant (AVX2, NEON, SSE2). Its operands
 * are rounded as the VDPBF16PS version's are (x and int4 values to bfloat16; int8 q times its
 * scale is exact in float32), so that every variant computes the same products up to the order
 * of the sums. It also takes int8 with a scale per group of inputs (the panel holds q times its
 * group's scale), which bfloat16 panels could not hold exactly. */
#define PANEL_N I4_BLOCK_N
#define PANEL_K 512        /* inputs per panel: 128 KiB of float32, in L2 */
#define ROW_CHUNK 256      /* rows per work item, at most */
#define TILE_R 6           /* rows of x per register tile */
#define TILE_C 16          /* channels per register tile */

/* Inputs k0 .. k0 + kk - 1 of channels c0 .. c0 + 63 -> pt [PANEL_N / TILE_C][kk][TILE_C] (a
 * register tile's channels of one input contiguous): int4 dequantized, int8 as q times its
 * group's scale (`group` inputs per scale, k: per channel); channels past n are zero. */
#define PT(pt, j, c, kk) (pt)[((c) / TILE_C * (kk) + (j)) * TILE_C + (c) % TILE_C]
static void panel_t(const void* w, int format, const uint16_t* sz, int64_t group, int64_t n,
                    int64_t k, int64_t c0, int64_t k0, int64_t kk, float* pt) {
    if (format == QUANT_INT4) {
        const uint8_t* wb = (const uint8_t*)w + c0 / I4_BLOCK_N * k * (I4_BLOCK_N / 2);
        for (int64_t g = k0 / group; g < (k0 + kk) / group; g++) {
            float scale[I4_BLOCK_N], offset[I4_BLOCK_N];
            const uint16_t* s = sz + (g * n + c0) * 2;
            for (int c = 0; c < I4_BLOCK_N; c++) {
                scale[c] = bf16_to_f32(s[2 * c]);
                offset[c] = bf16_to_f32(s[2 * c + 1]) - 8.0f * scale[c];
            }
            for (int64_t kq = g * group; kq < (g + 1) * group; kq += 4) {
                const uint8_t* p = wb + kq / 4 * 128;
                for (int j = 0; j < 4; j++)
                    for (int d = 0; d < I4_BLOCK_N / 2; d++) {
                        PT(pt, kq + j - k0, d, kk) = bf16_to_f32(f32_to_bf16(
                            fmaf((float)(p[4 * d + j] & 15), scale[d], offset[d])));
                        PT(pt, kq + j - k0, d + 32, kk) = bf16_to_f32(f32_to_bf16(
                            fmaf((float)(p[4 * d + j] >> 4), scale[d + 32], offset[d + 32])));
                    }
            }
        }
        return;
    }
    const int64_t nc = n - c0 < PANEL_N ? n - c0 : PANEL_N;
    for (int64_t c = 0; c < PANEL_N; c++) {
        const int8_t* q = (const int8_t*)w + (c0 + c) * k + k0;
        const uint16_t* s = sz + (c0 + c) * (k / group);
        for (int64_t j = 0; j < kk; j++)
            PT(pt, j, c, kk) = c < nc ? (float)q[j] * bf16_to_f32(s[(k0 + j) / group]) : 0.0f;
    }
}

/* acc [rows][PANEL_N] (+)= x rows r0 .. r0 + rows - 1 (float32, k apart) . pt over kk inputs
 * (x from input k0); `first` starts from zero. */
static void panel_tiles(const float* xf, int64_t k, int64_t k0, int64_t rows, const float* pt,
                        int64_t kk, float* acc, int first) {
    for (int64_t r = 0; r < rows; r += TILE_R) {  /* x has rows padded to TILE_R (zeros) */
        for (int c = 0; c < PANEL_N; c += TILE_C) {
            float t[TILE_R][TILE_C];
            for (int i = 0; i < TILE_R; i++)
                for (int cc = 0; cc < TILE_C; cc++)
                    t[i][cc] = first ? 0.0f : acc[(r + i) * PANEL_N + c + cc];
            const float* xr = xf + r * k + k0;
            const float* tile_pt = pt + c / TILE_C * kk * TILE_C;
            for (int64_t j = 0; j < kk; j++) {
                const float* pv = tile_pt + j * TILE_C;
                for (int i = 0; i < TILE_R; i++) {
                    const float xv = xr[i * k + j];
                    _Pragma("omp simd")
                    for (int cc = 0; cc < TILE_C; cc++) t[i][cc] += xv * pv[cc];
                }
            }
            for (int i = 0; i < TILE_R; i++)
                for (int cc = 0; cc < TILE_C; cc++) acc[(r + i) * PANEL_N + c + cc] = t[i][cc];
        }
    }
}

static int gemm_plain(const void* x, int x_dtype, const void* w, int w_format,
                      const uint16_t* scales, int64_t group, void* y, int64_t ldy, int64_t m,
                      int64_t n, int64_t k, int threads) {
    if (!mm_gemm_quantized_takes(n, k, w_format, group)) return 2;
    if (m == 0) return 0;
    const int64_t padded = (m + TILE_R - 1) / TILE_R * TILE_R;
    float* xf = calloc((size_t)(padded * k), sizeof(float));  /* x rounded to bfloat16 */
    if (xf == NULL) return 1;
    load_row(xf, x, x_dtype, 0, m * k);
    if (x_dtype == DTYPE_F32) {
        _Pragma("omp simd")
        for (int64_t j = 0; j < m * k; j++) xf[j] = bf16_to_f32(f32_to_bf16(xf[j]));
    }
    const int64_t blocks = (n + PANEL_N - 1) / PANEL_N, chunk = ROW_CHUNK;
    const int64_t items = (m + chunk - 1) / chunk * blocks;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads)")
    {
        float* pt = malloc(sizeof(float) * PANEL_K * PANEL_N);
        float* acc = malloc(sizeof(float) * (ROW_CHUNK + TILE_R) * PANEL_N);
        if (pt == NULL || acc == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t i = 0; i < items; i++) {
            if (pt == NULL || acc == NULL) continue;
            const int64_t r0 = i / blocks * chunk, c0 = i % blocks * PANEL_N;
            const int64_t rows = m - r0 < chunk ? m - r0 : chunk;
            for (int64_t k0 = 0; k0 < k; k0 += PANEL_K) {
                const int64_t kk = k - k0 < PANEL_K ? k - k0 : PANEL_K;
                panel_t(w, w_format, scales, group, n, k, c0, k0, kk, pt);
                panel_tiles(xf + r0 * k, k, k0, (rows + TILE_R - 1) / TILE_R * TILE_R, pt, kk,
                            acc, k0 == 0);
            }
            const int64_t nc = n - c0 < PANEL_N ? n - c0 : PANEL_N;
            for (int64_t r = 0; r < rows; r++)
                store_row(y, acc + r * PANEL_N, x_dtype, (r0 + r) * ldy + c0, nc);
        }
        free(pt);
        free(acc);
    }
    free(xf);
    return failed;
}
#endif

/* Whether it takes a weight [N, K] of this format and group: K % 32 == 0; int8 with one scale
 * per channel (group K), or in the plain version a group mm_linear_i8 takes; int4 with N a
 * multiple of 64 and a group of a multiple of 32 dividing the panel's inputs. */
int mm_gemm_quantized_takes(int64_t n, int64_t k, int w_format, int64_t group) {
    if (k % 32) return 0;
#ifdef GEMM_Q_BF16
    if (w_format == QUANT_INT8) return group == k;
#else
    if (w_format == QUANT_INT8) return mm_int8_group_ok(k, group);
#endif
    return n % I4_BLOCK_N == 0 && group > 0 && group % 32 == 0 && PANEL_K % group == 0;
}

/* y [M, ldy] (columns 0 .. N - 1 written, in x's dtype) = x [M, K] . W^T. w: int8 [N, K]
 * with scales [N, K / group] (format 0; group K: per channel), or our int4 pack [N, K / 2]
 * with scales_and_zeros [K / group, N, 2] (format 1). Returns 0; 1 out of memory; 2 a shape
 * or build it does not take (mm_gemm_quantized_takes). */
int mm_gemm_quantized(const void* x, int x_dtype, const void* w, int w_format,
                      const uint16_t* scales, int64_t group, void* y, int64_t ldy, int64_t m,
                      int64_t n, int64_t k, int threads) {
#ifdef GEMM_Q_BF16
    if (!mm_gemm_quantized_takes(n, k, w_format, group)) return 2;
    const int64_t padded = (m + 15) / 16 * 16, blocks = (n + PANEL_N - 1) / PANEL_N;
    const int64_t chunk = chunk_rows(m, blocks, threads);
    const int64_t items = (m + chunk - 1) / chunk * blocks;
    uint16_t* xp = aligned_alloc(64, (size_t)(k * padded * 2));
    if (xp == NULL) return 1;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads)")
    {
        uint16_t* panel = aligned_alloc(64, sizeof(uint16_t) * PANEL_N * PANEL_K);
        float* acc = aligned_alloc(64, sizeof(float) * PANEL_N * ((chunk + 15) / 16 * 16));
        if (panel == NULL || acc == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t t = 0; t < (k / 32) * (padded / 16); t++)
            pack_tile(x, x_dtype, k, m, padded, xp, t);
        /* chunk-major: each thread takes a contiguous run, its chunk's packed rows stay in
         * cache across the blocks it takes */
        _Pragma("omp for schedule(static)")
        for (int64_t i = 0; i < items; i++) {
            const int64_t r0 = i / blocks * chunk, b = i % blocks;
            if (panel != NULL && acc != NULL)
                panel_product(w, w_format, scales, group, xp, padded, y, x_dtype, ldy, n, k,
                              b * PANEL_N, r0, m - r0 < chunk ? m - r0 : chunk, panel, acc);
        }
        free(panel);
        free(acc);
    }
    free(xp);
    return failed;
#else
    return gemm_plain(x, x_dtype, w, w_format, scales, group, y, ldy, m, n, k, threads);
#endif
}
