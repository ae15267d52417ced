/* A linear for tens to thousands of rows (a prefill, a vision tower's patches), y[M, N] =
 * x[M, K] . W[N, K]^T, W float32, bfloat16, int8 (bfloat16 scales [N, K / group]) or int4
 * in our pack, x and y float32 or bfloat16 (y in x's dtype), float32 products and sums.
 *
 * Packed panels, in the order of the BLIS papers (Van Zee and van de Geijn): a register tile of
 * MR rows x NR channels holds its sums for a whole chunk of KC inputs; per input it loads NR
 * weights (two vectors) and broadcasts MR values of x, for 2 * MR multiply-adds, so the loop is
 * bound by the multiply-adds, not the loads. Both operands are copied into the order the tile
 * reads them, float32:
 *   W: a block of NC channels x KC inputs as [NC / NR][KC][NR] (widened from bfloat16, int8
 *      times its group's scale, exact in float32, int4 dequantized), once per call: one
 *      NR-wide strip (16 KiB with AVX2) stays in L1 while every tile of rows passes over it
 *      (with at most MC rows, each strip is packed just before its tiles, into one buffer);
 *   x: rows [i0, i0 + MC) x the same inputs as [MC / MR][KC][MR], about 240 KiB: in L2, read
 *      once per strip, packed again for each block of channels.
 * Each thread takes a contiguous share of the output channels in blocks of NC, as wide as a
 * buffer of float32 sums for every row of the block (SUMS_BYTES) allows, which keeps the sums
 * across the chunks of K.
 *
 * Written with GCC's vector extensions, so that one source builds for every variant (vectors of
 * 16 floats with AVX-512, 8 with AVX2, 4 on NEON / SSE2). Rows past M and channels past N are
 * zero in the packed copies; a block's last tile computes only its rows, every tile all NR
 * channels, and only the valid part of the sums is stored. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__) || defined(__AVX2__)
#define VL 8
#else
#define VL 4
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

#define MR 6                /* rows per register tile: 12 sums, 2 weights, 1 broadcast of x */
#define NR (2 * VL)         /* channels per register tile */
#define KC 256              /* inputs per chunk */
#define MC (40 * MR)        /* rows per packed block of x */
#define SUMS_BYTES (4 << 20) /* a thread's float32 sums of a block of y, at most */
#define I4_STEP 128         /* bytes of our int4 pack per 4 inputs of a block of 64 channels */

#define W_F32 0
#define W_BF16 1
#define W_I8 2
#define W_I4 3

/* The weight as stored: float32, bfloat16, int8 with a bfloat16 scale per `group` inputs of
 * each channel ([N, K / group]), or int4 in our pack with a bfloat16 (scale, zero) per `group`
 * inputs of each channel (models/kernels/quantization.py; sz [K / group, N, 2]). */
typedef struct {
    const void* w;
    int type;
    const uint16_t* scales;
    int64_t group;
} Weight;

static inline vf vload(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float* p, vf v) { memcpy(p, &v, sizeof v); }

/* *p in every lane, as one broadcast load: GCC writes (vf){0} + *p as an add and a shuffle, and
 * a vector filled lane by lane as inserts */
static inline vf vbroadcast(const float* p) {
#if VL == 16
    return (vf)_mm512_set1_ps(*p);
#elif VL == 8
    return (vf)_mm256_broadcast_ss(p);
#elif defined(__aarch64__)
    return (vf)vld1q_dup_f32(p);
#elif defined(__SSE2__)
    return (vf)_mm_load1_ps(p);
#else
    vf v;
    for (int l = 0; l < VL; l++) v[l] = *p;
    return v;
#endif
}

/* x rows [i0, i0 + mc), inputs [p0, p0 + kc) -> ap [ceil(mc / MR)][kc][MR], zero past m. */
static void pack_x(const void* x, int dt, int64_t k, int64_t m, int64_t i0, int64_t mc,
                   int64_t p0, int64_t kc, float* ap) {
    float row[KC];
    for (int64_t t = 0; t < mc; t += MR) {
        float* tile = ap + t * kc;
        for (int r = 0; r < MR; r++) {
            const int64_t i = i0 + t + r;
            if (i < m) load_row(row, x, dt, i * k + p0, kc);
            else memset(row, 0, sizeof(float) * (size_t)kc);
            for (int64_t p = 0; p < kc; p++) tile[p * MR + r] = row[p];
        }
    }
}

#if defined(__AVX__)
/* An 8 x 8 block in registers (r[i]: row i's 8 inputs) -> out [8][stride]: each input's 8
 * values contiguous. */
static inline void store_transposed8(__m256 r[8], float* out, int64_t stride) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            r[i + h] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0x44);
            r[i + h + 2] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0xee);
        }
    /* r[0..3] hold rows 0-3 of columns {0,4}, {2,6}, {1,5}, {3,7} per 128-bit half; r[4..7]
     * rows 4-7 alike */
    static const int column[4] = {0, 2, 1, 3};
    for (int q = 0; q < 4; q++) {
        _mm256_storeu_ps(out + column[q] * stride, _mm256_permute2f128_ps(r[q], r[q + 4], 0x20));
        _mm256_storeu_ps(out + (column[q] + 4) * stride,
                         _mm256_permute2f128_ps(r[q], r[q + 4], 0x31));
    }
}
#endif

/* rows [8][ld] (inputs 0 .. kc - 1) -> out [kc][stride]: each input's 8 values contiguous. */
static void transpose8(const float* rows, int64_t ld, int64_t kc, float* out, int64_t stride) {
    int64_t p = 0;
#if defined(__AVX__)
    for (; p + 8 <= kc; p += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(rows + i * ld + p);
        store_transposed8(r, out + p * stride, stride);
    }
#endif
    for (; p < kc; p++)
        for (int i = 0; i < 8; i++) out[p * stride + i] = rows[i * ld + p];
}

/* As transpose8 from bfloat16 rows, widened on the way (no float32 copy of the rows written and
 * read back: at a few tens of rows of x that copy was the packing's larger half). */
static void transpose8_bf16(const uint16_t* rows, int64_t ld, int64_t kc, float* out,
                            int64_t stride) {
    int64_t p = 0;
#if defined(__AVX2__)
    for (; p + 8 <= kc; p += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) {
            const __m128i h = _mm_loadu_si128((const __m128i*)(rows + i * ld + p));
            r[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        store_transposed8(r, out + p * stride, stride);
    }
#endif
    for (; p < kc; p++)
        for (int i = 0; i < 8; i++) out[p * stride + i] = bf16_to_f32(rows[i * ld + p]);
}

/* int4: channels [j, j + NR) of our pack, inputs [p0, p0 + kc) -> bp [kc][NR], dequantized
 * straight into the tile's order. Per 4 inputs the pack holds 4 consecutive bytes per channel of
 * a block of 64 (low nibbles: channels 0-31, high: 32-63), so a 32-bit lane is one channel's 4
 * inputs and a vector of lanes a vector of channels; a strip lies within one half of a block (32
 * is a multiple of NR). Values as mm_dequantize_i4_block makes them (the `dequantized`
 * formulations), q * scale + (zero - 8 * scale), one multiply-add (fused where the CPU has
 * FMA: GCC contracts it). p0, kc are whole groups. */
static void pack_strip_i4(const Weight* W, int64_t k, int64_t n, int64_t j, int64_t p0,
                          int64_t kc, float* bp) {
    const int64_t c = j % I4_BLOCK_N;
    const int shift = c < I4_BLOCK_N / 2 ? 0 : 4;
    const uint8_t* block = (const uint8_t*)W->w + j / I4_BLOCK_N * k * (I4_BLOCK_N / 2)
                           + 4 * (c % (I4_BLOCK_N / 2));
    for (int64_t g = p0 / W->group; g < (p0 + kc) / W->group; g++) {
        const uint16_t* sz = W->scales + (g * n + j) * 2;  /* [K / group, N, 2] */
        vf scale[2], offset[2];
        for (int v = 0; v < 2; v++)
            for (int l = 0; l < VL; l++) {
                const float s = bf16_to_f32(sz[2 * (v * VL + l)]);
                scale[v][l] = s;
                offset[v][l] = bf16_to_f32(sz[2 * (v * VL + l) + 1]) - 8.0f * s;
            }
        for (int64_t p = g * W->group; p < (g + 1) * W->group; p += 4) {
            float* out = bp + (p - p0) * NR;
            for (int v = 0; v < 2; v++) {
                vu q;
                memcpy(&q, block + p / 4 * I4_STEP + 4 * v * VL, sizeof q);
                q >>= shift;
                for (int i = 0; i < 4; i++) {
                    const vf value = __builtin_convertvector((vi)((q >> (8 * i)) & 15), vf);
                    vstore(out + i * NR + v * VL, value * scale[v] + offset[v]);
                }
            }
        }
    }
}

/* W channels [j, j + NR), inputs [p0, p0 + kc) -> bp [kc][NR], zero past n_end: the strip's
 * rows widened to float32 into `rows` ([NR][KC]), then transposed 8 channels at a time
 * (bfloat16 widened as it is transposed; int4 by pack_strip_i4). */
static void pack_strip(const Weight* W, int64_t k, int64_t n, int64_t n_end, int64_t j,
                       int64_t p0, int64_t kc, float* bp, float* rows) {
    if (W->type == W_I4) {
        pack_strip_i4(W, k, n, j, p0, kc, bp);
        return;
    }
    if (W->type == W_BF16 && j + NR <= n_end) {
        const uint16_t* w = (const uint16_t*)W->w + j * k + p0;
        for (int c = 0; c < NR; c += 8) transpose8_bf16(w + c * k, k, kc, bp + c, NR);
        return;
    }
    for (int c = 0; c < NR; c++) {
        float* row = rows + c * KC;
        if (j + c >= n_end) {
            memset(row, 0, sizeof(float) * (size_t)kc);
        } else if (W->type == W_F32) {
            memcpy(row, (const float*)W->w + (j + c) * k + p0, sizeof(float) * (size_t)kc);
        } else if (W->type == W_BF16) {
            load_row(row, W->w, DTYPE_BF16, (j + c) * k + p0, kc);
        } else {
            widen_i8_grouped((const int8_t*)W->w + (j + c) * k + p0,
                             W->scales + (j + c) * (k / W->group), W->group, p0, kc, row);
        }
    }
    for (int c = 0; c < NR; c += 8) transpose8(rows + c * KC, KC, kc, bp + c, NR);
}

/* The cache lines of a strip of W still to be read, asked for a few at a time from inside the
 * tiles before it (`tile`'s `ahead`). A dense strip is NR separate rows, a chunk of each read
 * between long runs of tiles: neither the hardware prefetchers nor the out-of-order window reach
 * it ahead of time, and asked for in one burst before the tiles, its lines outnumber the
 * line-fill buffers and stall them. int4's strip is contiguous (the prefetchers follow it). */
#define AHEAD_MAX (NR * (KC * 4 / 64 + 1))
typedef struct {
    const char* line[AHEAD_MAX];
    int64_t count;
} Ahead;

static void ahead_of(const Weight* W, int64_t k, int64_t n_end, int64_t j, int64_t p0,
                     int64_t kc, Ahead* a) {
    a->count = 0;
    if (W->type == W_I4) return;
    const int size = W->type == W_F32 ? 4 : W->type == W_BF16 ? 2 : 1;
    for (int64_t c = j; c < j + NR && c < n_end; c++) {
        const uintptr_t first = (uintptr_t)((const char*)W->w + (c * k + p0) * size);
        for (uintptr_t at = first & ~(uintptr_t)63; at < first + (uintptr_t)(kc * size); at += 64)
            a->line[a->count++] = (const char*)at;
    }
}

/* W channels [j0, j0 + nc), inputs [p0, p0 + kc) -> bp [ceil(nc / NR)][kc][NR], strip by
 * strip. */
static void pack_w(const Weight* W, int64_t k, int64_t n, int64_t n_end, int64_t j0, int64_t nc,
                   int64_t p0, int64_t kc, float* bp, float* rows) {
    for (int64_t s = 0; s < nc; s += NR)
        pack_strip(W, k, n, n_end, j0 + s, p0, kc, bp + s * kc, rows);
}

/* The register tile: c[ROWS][NR] (ldc apart; `first`: = instead of +=) over kc inputs of one
 * packed tile of x (ap [kc][MR], its first ROWS rows) and one strip of W (bp [kc][NR]); the
 * `n_ahead` cache lines at `ahead` are asked for evenly along the way. */
static inline __attribute__((always_inline)) void tile(const float* ap, const float* bp,
                                                       int64_t kc, float* c, int64_t ldc,
                                                       int first, const char* const* ahead,
                                                       int64_t n_ahead, const int ROWS) {
    vf acc[MR][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = (vf){0};
    int64_t asked = 0;
    for (int64_t p = 0; p < kc; p++) {
        if (asked < n_ahead && p * n_ahead >= asked * kc)
            __builtin_prefetch(ahead[asked++], 0, 3);
        const vf b0 = vload(bp + p * NR), b1 = vload(bp + p * NR + VL);
        for (int r = 0; r < ROWS; r++) {
            const vf a = vbroadcast(ap + p * MR + r);
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float* row = c + r * ldc;
        if (first) {
            vstore(row, acc[r][0]), vstore(row + VL, acc[r][1]);
        } else {
            vstore(row, vload(row) + acc[r][0]), vstore(row + VL, vload(row + VL) + acc[r][1]);
        }
    }
}

/* A tile of `rows` (1 .. MR) rows, each count compiled with its loops unrolled: the last tile of
 * a block computes only its real rows (33 rows: 6 tiles of 33 rows' work, not of 36). */
static void tile_rows(const float* ap, const float* bp, int64_t kc, float* c, int64_t ldc,
                      int first, const char* const* ahead, int64_t n_ahead, int64_t rows) {
    switch (rows) {
    case 1: tile(ap, bp, kc, c, ldc, first, ahead, n_ahead, 1); return;
    case 2: tile(ap, bp, kc, c, ldc, first, ahead, n_ahead, 2); return;
    case 3: tile(ap, bp, kc, c, ldc, first, ahead, n_ahead, 3); return;
    case 4: tile(ap, bp, kc, c, ldc, first, ahead, n_ahead, 4); return;
    case 5: tile(ap, bp, kc, c, ldc, first, ahead, n_ahead, 5); return;
    default: tile(ap, bp, kc, c, ldc, first, ahead, n_ahead, MR); return;
    }
}

/* Channels per block of y a thread keeps the sums of (every row): as wide as SUMS_BYTES lets,
 * so that x is packed again as few times as possible (once per block and chunk of K). */
static int64_t block_channels(int64_t m, int64_t share) {
    int64_t nc = SUMS_BYTES / 4 / m / NR * NR;
    nc = nc < NR ? NR : nc;
    return nc < share ? nc : (share + NR - 1) / NR * NR;
}

/* One thread's channels [n0, n1): every row of y, in blocks of MC rows. `sums` [m][nc]
 * float32, `ap` / `bp` its packed blocks: every strip of a chunk of W is packed first ([nc /
 * NR][kc][NR]) and read by each block of rows in turn. */
static void gemm_part(const void* x, int x_dtype, const Weight* W, void* y, int64_t m,
                      int64_t n, int64_t k,
                      int64_t n0, int64_t n1, int64_t nc_max, float* sums, float* ap,
                      float* bp, float* rows) {
    for (int64_t j0 = n0; j0 < n1; j0 += nc_max) {
        const int64_t nc = n1 - j0 < nc_max ? n1 - j0 : nc_max;
        const int64_t ncp = (nc + NR - 1) / NR * NR;
        for (int64_t p0 = 0; p0 < k; p0 += KC) {
            const int64_t kc = k - p0 < KC ? k - p0 : KC;
            pack_w(W, k, n, n1, j0, nc, p0, kc, bp, rows);  /* once per call */
            for (int64_t i0 = 0; i0 < m; i0 += MC) {
                const int64_t mc = m - i0 < MC ? m - i0 : MC;
                const int64_t mcp = (mc + MR - 1) / MR * MR;
                pack_x(x, x_dtype, k, m, i0, mc, p0, kc, ap);
                for (int64_t s = 0; s < ncp; s += NR)
                    for (int64_t t = 0; t < mcp; t += MR)
                        tile(ap + t * kc, bp + s * kc, kc, sums + (i0 + t) * ncp + s, ncp,
                             p0 == 0, NULL, 0, MR);
            }
        }
        for (int64_t i = 0; i < m; i++) {
            store_row(y, sums + i * ncp, x_dtype, i * n + j0, nc);
        }
    }
}

/* As gemm_part, for at most MC rows (one block of x, a short prefill chunk): each strip of W is
 * packed into one reused buffer (`bp`, [kc][NR]) just before the tiles read it, from L1, and the
 * last tile computes only its rows. Packing every strip first, as gemm_part does, and reading
 * each back from memory made 16-64 rows 1.2-1.5x slower; past MC rows this order measured
 * 5-10% slower than gemm_part's. */
static void gemm_part_short(const void* x, int x_dtype, const Weight* W, void* y, int64_t m,
                            int64_t n, int64_t k, int64_t n0, int64_t n1, int64_t nc_max,
                            float* sums, float* ap, float* bp, float* rows) {
    Ahead lines, *ahead = &lines;
    const int64_t tiles = (m + MR - 1) / MR;
    for (int64_t j0 = n0; j0 < n1; j0 += nc_max) {
        const int64_t nc = n1 - j0 < nc_max ? n1 - j0 : nc_max;
        const int64_t ncp = (nc + NR - 1) / NR * NR;
        for (int64_t p0 = 0; p0 < k; p0 += KC) {
            const int64_t kc = k - p0 < KC ? k - p0 : KC;
            pack_x(x, x_dtype, k, m, 0, m, p0, kc, ap);
            for (int64_t s = 0; s < ncp; s += NR) {
                pack_strip(W, k, n, n1, j0 + s, p0, kc, bp, rows);
                /* the next strip (or the next chunk's first), asked for while these tiles run */
                const int64_t next_kc = k - p0 - KC < KC ? k - p0 - KC : KC;
                if (s + NR < ncp) ahead_of(W, k, n1, j0 + s + NR, p0, kc, ahead);
                else if (p0 + KC < k) ahead_of(W, k, n1, j0, p0 + KC, next_kc, ahead);
                else ahead->count = 0;
                const int64_t share = (ahead->count + tiles - 1) / tiles;
                for (int64_t t = 0; t < m; t += MR) {
                    const int64_t from = t / MR * share < ahead->count ? t / MR * share
                                                                        : ahead->count;
                    const int64_t count = ahead->count - from < share ? ahead->count - from : share;
                    tile_rows(ap + t * kc, bp, kc, sums + t * ncp + s, ncp, p0 == 0,
                              ahead->line + from, count, m - t);
                }
            }
        }
        for (int64_t i = 0; i < m; i++) store_row(y, sums + i * ncp, x_dtype, i * n + j0, nc);
    }
}

/* 0: done; 1: out of memory. */
static int gemm(const void* x, int x_dtype, const Weight* W, void* y, int64_t m, int64_t n,
                int64_t k, int threads) {
    if (m == 0 || n == 0) return 0;
    if (k == 0) {  /* empty sums */
        for (int64_t i = 0; i < m * n; i++) store(y, x_dtype, i, 0.0f);
        return 0;
    }
    /* each thread a contiguous share of whole strips of channels */
    const int64_t strips = (n + NR - 1) / NR;
    if (threads > strips) threads = (int)strips;
    int failed = 0;
    /* one part per thread (a worksharing loop: without OpenMP the parts run one by one) */
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t part = 0; part < threads; part++) {
        const int64_t n0 = strips * part / threads * NR;
        int64_t n1 = strips * (part + 1) / threads * NR;
        n1 = n1 < n ? n1 : n;
        const int64_t nc = block_channels(m, n1 - n0), mp = (m + MR - 1) / MR * MR;
        float* sums = aligned_alloc(64, sizeof(float) * (size_t)(mp * nc));
        float* ap = aligned_alloc(64, sizeof(float) * MC * KC);
        float* bp = aligned_alloc(64, sizeof(float) * (size_t)((m > MC ? nc : NR) * KC));
        float* rows = aligned_alloc(64, sizeof(float) * NR * KC);
        if (sums == NULL || ap == NULL || bp == NULL || rows == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        } else if (n0 < n1) {
            (m > MC ? gemm_part : gemm_part_short)(x, x_dtype, W, y, m, n, k, n0, n1, nc, sums,
                                                   ap, bp, rows);
        }
        free(sums), free(ap), free(bp), free(rows);
    }
    return failed;
}

/* w_dtype: DTYPE_F32, DTYPE_BF16 or DTYPE_I8 (then bfloat16 `scales` [N, K / group], group
 * as mm_linear_i8 takes it). 0: done; 1: out of memory; 2: a group it does not take. */
int mm_gemm_dense(const void* x, int x_dtype, const void* w, int w_dtype,
                  const uint16_t* scales, int64_t group, void* y, int64_t m, int64_t n,
                  int64_t k, int threads) {
    const int type = w_dtype == DTYPE_F32 ? W_F32 : w_dtype == DTYPE_BF16 ? W_BF16 : W_I8;
    if (type == W_I8 && !mm_int8_group_ok(k, group)) return 2;
    const Weight W = {w, type, scales, group};
    return gemm(x, x_dtype, &W, y, m, n, k, threads);
}

/* int4 weights in our pack [N / 64, K / 4, 32, 4] bytes with sz [K / group, N, 2]: each
 * chunk of a block of the pack dequantized to float32 as it is packed. Requires n % 64 == 0 (so
 * that no strip straddles the end of a thread's share) and a group dividing k and KC (so that a
 * chunk holds whole groups), else 2. 0: done; 1: out of memory. */
int mm_gemm_int4(const void* x, int x_dtype, const uint8_t* w, const uint16_t* sz,
                 int64_t group, void* y, int64_t m, int64_t n, int64_t k, int threads) {
    if (n % I4_BLOCK_N || group <= 0 || k % group || KC % group) return 2;
    const Weight W = {w, W_I4, sz, group};
    return gemm(x, x_dtype, &W, y, m, n, k, threads);
}
