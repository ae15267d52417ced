/* Weights held as a GGUF file's ggml blocks, run as stored: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32
 * values per block, a float16 scale and for _1 a float16 minimum) and Q4_K, Q5_K, Q6_K (256
 * values per super-block, float16 d / dmin and 6- or 8-bit sub-block scales). A weight [N, K]
 * is N rows of K / QK blocks each, byte for byte as in the file (row r at r * row_bytes).
 *
 * Dequantizing is ggml's definition of each block, in the same float32 operations in the same
 * order (the scale products first, then q * d - m), so that a value is bit for bit what ggml's
 * dequantize_row_* and gguf-py's gguf.quants.dequantize give (tests/test_gguf_blocks.py checks
 * every type, tests/native/harness.c Q4_K and Q8_0 on every variant). The dequantizers are
 * compiled with floating-point contraction off; for these formats it would change nothing (a
 * float16 scale times a 6- or 8-bit sub-scale times a 4- or 5-bit q is exact in float32, so a
 * fused q * d1 - m1 rounds as the separate operations do), but the order is then the C's.
 *
 * mm_ggml_linear: y [M, N] = x [M, K] . W^T for a decode step's few rows, through integer dot
 * products of the blocks' quants with the rows written in int8 digits (below). The weight is
 * read once per call, in its blocks' bytes (4.5 bits per weight for Q4_K).
 * mm_ggml_linear_float: the earlier float path (each span of up to 256 inputs dequantized into a
 * buffer in L1 and multiplied into every row's LANES partial sums), for bench/ggml_kernels.py.
 *
 * mm_ggml_dequantize: rows of the weight (consecutive, or picked by index: an embedding's
 * lookup) to float32, for a prefill's GEMM on a tile of rows (models/kernels/ggml_blocks.py)
 * and for tests.
 *
 * Both also take the layouts of ggml_x8.c (GGML_*_X8: each type repacked in groups of 8
 * output channels): the decode path runs a group at a time there (x8_linear), the
 * plain path and the dequantizer read each block back as the file held it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#define SPAN 256 /* values dequantized at once: one super-block, or eight 32-blocks */
#define ROW_CHUNK 8 /* rows of x per pass over the weight (their partial sums stay in cache) */
#define LANES 32    /* partial sums per row: independent lanes the compiler vectorizes */
#define MAX_ROWS 16 /* rows of x the integer path meets each unpacked block with */
/* rows from which two x8 groups at once (mm_ggml_x8_rows_pair) are the faster: below, the
 * one-group kernels (`python -m bench.kernel_ab --kernel ggml --rows 2,3,4,5`) */
#define PAIR_ROWS 4
#define X_CHUNK_BYTES (512 * 1024) /* a prefill's rows' digits met by the whole weight at once */

/* values per block and bytes per block of `type`; 0 for a type this file does not read */
static int block_values(int type) {
    switch (type) {
        case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_Q8_0: return 32;
        case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return 256;
        case GGML_Q4_K_X8: case GGML_Q5_K_X8: case GGML_Q6_K_X8: return 256;
        case GGML_Q4_0_X8: case GGML_Q4_1_X8: case GGML_Q5_0_X8: case GGML_Q5_1_X8:
        case GGML_Q8_0_X8: return 32;
        default: return 0;
    }
}

static int block_bytes(int type) {
    switch (type) {
        case GGML_Q4_0: return 18;
        case GGML_Q4_1: return 20;
        case GGML_Q5_0: return 22;
        case GGML_Q5_1: return 24;
        case GGML_Q8_0: return 34;
        case GGML_Q4_K: return 144;
        case GGML_Q5_K: return 176;
        case GGML_Q6_K: return 210;
        /* a channel's share of its group's super-block */
        case GGML_Q4_K_X8: return 148;
        case GGML_Q5_K_X8: return 180;
        case GGML_Q6_K_X8: return 210;
        case GGML_Q4_0_X8: return 18;
        case GGML_Q4_1_X8: return 20;
        case GGML_Q5_0_X8: return 22;
        case GGML_Q5_1_X8: return 24;
        case GGML_Q8_0_X8: return 34;
        default: return 0;
    }
}

/* IEEE half -> float, exact (subnormals included) */
static inline float half(const uint8_t* p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        float f = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

NO_CONTRACT static void q4_0(const uint8_t* b, float* y) {
    const float d = half(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; j++) y[j] = (float)((qs[j] & 0xF) - 8) * d;
    for (int j = 0; j < 16; j++) y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
}

NO_CONTRACT static void q4_1(const uint8_t* b, float* y) {
    const float d = half(b), m = half(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; j++) y[j] = (float)(qs[j] & 0xF) * d + m;
    for (int j = 0; j < 16; j++) y[j + 16] = (float)(qs[j] >> 4) * d + m;
}

static inline uint32_t le32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

NO_CONTRACT static void q5_0(const uint8_t* b, float* y) {
    const float d = half(b);
    const uint32_t qh = le32(b + 2);
    const uint8_t* qs = b + 6;
    for (int j = 0; j < 16; j++)
        y[j] = (float)(((qs[j] & 0xF) | ((int)((qh >> j) << 4) & 0x10)) - 16) * d;
    for (int j = 0; j < 16; j++)
        y[j + 16] = (float)(((qs[j] >> 4) | ((int)(qh >> (j + 12)) & 0x10)) - 16) * d;
}

NO_CONTRACT static void q5_1(const uint8_t* b, float* y) {
    const float d = half(b), m = half(b + 2);
    const uint32_t qh = le32(b + 4);
    const uint8_t* qs = b + 8;
    for (int j = 0; j < 16; j++)
        y[j] = (float)((qs[j] & 0xF) | ((int)((qh >> j) << 4) & 0x10)) * d + m;
    for (int j = 0; j < 16; j++)
        y[j + 16] = (float)((qs[j] >> 4) | ((int)(qh >> (j + 12)) & 0x10)) * d + m;
}

NO_CONTRACT static void q8_0(const uint8_t* b, float* y) {
    const float d = half(b);
    const int8_t* qs = (const int8_t*)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

NO_CONTRACT static void q4_k(const uint8_t* b, float* y) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int j = 0; j < 8; j += 2) {
        int sc, mn;
        ggml_scale_min(j, scales, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        ggml_scale_min(j + 1, scales, &sc, &mn);
        const float d2 = d * (float)sc, m2 = dmin * (float)mn;
        for (int l = 0; l < 32; l++) y[l] = d1 * (float)(q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) y[32 + l] = d2 * (float)(q[l] >> 4) - m2;
        q += 32;
        y += 64;
    }
}

NO_CONTRACT static void q5_k(const uint8_t* b, float* y) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* ql = b + 48;
    for (int j = 0, shift = 0; j < 8; j += 2, shift += 2) {
        int sc, mn;
        ggml_scale_min(j, scales, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        ggml_scale_min(j + 1, scales, &sc, &mn);
        const float d2 = d * (float)sc, m2 = dmin * (float)mn;
        for (int l = 0; l < 32; l++)
            y[l] = d1 * (float)((ql[l] & 0xF) + (((qh[l] >> shift) & 1) << 4)) - m1;
        for (int l = 0; l < 32; l++)
            y[32 + l] = d2 * (float)((ql[l] >> 4) + (((qh[l] >> (shift + 1)) & 1) << 4)) - m2;
        ql += 32;
        y += 64;
    }
}

NO_CONTRACT static void q6_k(const uint8_t* b, float* y) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = (const int8_t*)(b + 192);
    const float d = half(b + 208);
    for (int n = 0; n < 2; n++) {
        float ds[8];
        for (int s = 0; s < 8; s++) ds[s] = d * (float)sc[s];
        /* group g of 32 values: low nibbles (g < 2) or high ones of ql[32 (g % 2) + l], two
         * bits of qh[l] at 2g; sub-scales 2g, 2g + 1 (ggml's q1 .. q4, in loops that vectorize) */
        for (int g = 0; g < 4; g++) {
            const uint8_t* lo = ql + 32 * (g & 1);
            const int shift = 4 * (g >> 1);
            for (int h = 0; h < 2; h++) {
                const float scale = ds[2 * g + h];
                for (int l = 16 * h; l < 16 * h + 16; l++)
                    y[32 * g + l] =
                        scale * (float)((((lo[l] >> shift) & 0xF) | (((qh[l] >> (2 * g)) & 3) << 4))
                                        - 32);
            }
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

/* `count` consecutive blocks of `type` from src -> count * QK floats */
NO_CONTRACT static void dequantize_blocks(int type, const uint8_t* src, int64_t count, float* y) {
    const int qk = block_values(type), nb = block_bytes(type);
#define EACH_BLOCK(FN) \
    for (int64_t i = 0; i < count; i++) FN(src + i * nb, y + i * qk); \
    break;
    switch (type) { /* one loop per type, the block's function inlined in it */
        case GGML_Q4_0: EACH_BLOCK(q4_0)
        case GGML_Q4_1: EACH_BLOCK(q4_1)
        case GGML_Q5_0: EACH_BLOCK(q5_0)
        case GGML_Q5_1: EACH_BLOCK(q5_1)
        case GGML_Q8_0: EACH_BLOCK(q8_0)
        case GGML_Q4_K: EACH_BLOCK(q4_k)
        case GGML_Q5_K: EACH_BLOCK(q5_k)
        case GGML_Q6_K: EACH_BLOCK(q6_k)
        default: break;
    }
#undef EACH_BLOCK
}

/* Whether a weight of `type` with rows of k values is one these kernels take */
int mm_ggml_takes(int type, int64_t k) {
    const int qk = block_values(type);
    return qk > 0 && k > 0 && k % qk == 0;
}

/* Rows of W [N, K] to float32 out [rows, K]: row ids[i] (or first + i where ids is NULL).
 * -> 0, or 2 for a type or K it does not take. */
int mm_ggml_dequantize(const uint8_t* w, int type, const int64_t* ids, int64_t first,
                       int64_t rows, int64_t k, float* out, int threads) {
    if (!mm_ggml_takes(type, k)) return 2;
    const int64_t per_row = k / block_values(type), row_bytes = per_row * block_bytes(type);
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(rows * k > 65536)")
    for (int64_t i = 0; i < rows; i++) {
        const int64_t r = ids ? ids[i] : first + i;
        const int stored = mm_ggml_x8_stored(type);
        if (stored) {  /* each block as the file held it */
            uint8_t block[256];
            for (int64_t b = 0; b < per_row; b++) {
                mm_ggml_x8_block(w, type, per_row, r, b, block);
                dequantize_blocks(stored, block, 1, out + i * k + block_values(type) * b);
            }
        } else {
            dequantize_blocks(type, w + r * row_bytes, per_row, out + i * k);
        }
    }
    return 0;
}

/* The float path (kept to measure against, bench/ggml_kernels.py): y [M, N] (x's dtype) =
 * x [M, K] . W^T, W of `type`. -> 0, 1 out of memory, 2 a type or K it
 * does not take. */
int mm_ggml_linear_float(const void* x, int x_dtype, const uint8_t* w, int type, void* y, int64_t m,
                   int64_t n, int64_t k, int threads) {
    if (!mm_ggml_takes(type, k) || mm_ggml_x8_stored(type)) return 2;
    int owned;
    const float* xf = as_f32(x, x_dtype, m * k, &owned);
    if (xf == NULL) return 1;
    const int qk = block_values(type), nb = block_bytes(type);
    const int64_t per_row = k / qk, row_bytes = per_row * nb;
    const int span_blocks = SPAN / qk;
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(n * k > 32768)")
    for (int64_t r = 0; r < n; r++) {
        float buf[SPAN];
        float part[ROW_CHUNK][LANES];
        const uint8_t* wr = w + r * row_bytes;
        for (int64_t i0 = 0; i0 < m; i0 += ROW_CHUNK) {
            const int rows = m - i0 < ROW_CHUNK ? (int)(m - i0) : ROW_CHUNK;
            memset(part, 0, sizeof(float) * LANES * (size_t)rows);
            for (int64_t b = 0; b < per_row; b += span_blocks) {
                const int count = per_row - b < span_blocks ? (int)(per_row - b) : span_blocks;
                const int values = count * qk; /* a multiple of 32, at most SPAN */
                dequantize_blocks(type, wr + b * nb, count, buf);
                for (int i = 0; i < rows; i++) {
                    const float* xr = xf + (i0 + i) * k + b * qk;
                    float* acc = part[i];
                    for (int j = 0; j < values; j += LANES) {
                        _Pragma("omp simd")
                        for (int l = 0; l < LANES; l++) acc[l] += xr[j + l] * buf[j + l];
                    }
                }
            }
            for (int i = 0; i < rows; i++) {
                float acc = 0.0f;
                for (int l = 0; l < LANES; l++) acc += part[i][l];
                store(y, x_dtype, (i0 + i) * n + r, acc);
            }
        }
    }
    if (owned) free((void*)xf);
    return 0;
}


/* ---- the integer decode path (mm_ggml_linear) ----
 *
 * Each row of x is quantized once per call, per group of inputs (a block of 32; for the K types
 * a super-block of 256, as llama.cpp's Q8_K), to int8 digits q with a float32 scale
 * dx = max|x| / 127 over the group (x' = dx * q, within max|x| / 254 of x; two digits:
 * within max|x| / 32512), and the sums xs = dx * sum q over each 32 (and xs16 over each 16,
 * for Q6_K's sub-blocks). A weight block
 * then meets the digits in integer dot products of its quants (unsigned, 0 .. 2^bits - 1, or
 * Q8_0's signed bytes), and the block's float16 scales join in float32 per 32 (or 16) inputs:
 *   Q4_0:  d * (dx * sum q_w q - 8 xs)          Q4_1: d * dx * sum q_w q + m * xs
 *   Q5_0:  d * (dx * sum q_w q - 16 xs)         Q5_1: as Q4_1
 *   Q8_0:  d * dx * sum q_w q
 *   Q4_K / Q5_K, sub-block j:  d sc_j dx_j sum q_w q - dmin m_j xs_j
 *   Q6_K, sub-block c of 16:   d sc_c (dx sum q_w q - 32 xs16_c)
 * so that the product is W . x' exactly, up to float32 rounding: per group the error against
 * W . x is at most sum |w| * max|x| / 254 (tests/test_gguf_blocks.py holds it to that).
 * The AVX2 path (also the AVX-512 variants': 256-bit lanes) forms the sums with PMADDUBSW
 * (u8 quants x s8 digits, pairs into int16: at most 2 * 63 * 127, never saturating; Q8_0
 * takes |w| and sign(x, w) as ggml does) and PMADDWD, which for the K types also weights each
 * 32 by its integer sub-block scale, so that a super-block's 256 products sum in int32 and
 * meet the float scales once; with AVX-512 VNNI, VPDPBUSD takes the unweighted sums in one
 * instruction and VPDPWSSD the weighted pairs' (the same integers); 8 float lanes per
 * row until the channel's end. A verify's rows (k + 1 tokens) meet each super-block's quants
 * unpacked once (dots_avx2); integer sums do not depend on their order, so each row's result is
 * the one-row call's, bit for bit. The plain path (the x86-64 and Arm variants) is the same
 * arithmetic in C loops (on Arm, NEON's dot products), a block unpacked once for all rows. */

/* digits_row (mm_digits_row, kernels.h): a row's digits, per group of 32, of 256 for the super-block types
 * (the unit dx the same for the 32s of one group). Every thread of a team writes its own copy
 * (a decode's few rows: cheaper than a barrier), so the loop is vectorized where AVX2 is; both
 * forms round alike (the same float operations, not contracted, per element; integer sums), so
 * the digits do not depend on the variant. */
static inline NO_CONTRACT void group_top(const float* x, int group, float* top_out) {
    float top = 0.0f;
    int j = 0;
#ifdef MM_AVX2
    /* MAXPS returns its second operand where either is NaN: a NaN input is skipped, as below */
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 t = _mm256_setzero_ps();
    for (; j + 8 <= group; j += 8)
        t = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), magnitude), t);
    float lanes[8];
    _mm256_storeu_ps(lanes, t);
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
#endif
    for (; j < group; j++) {
        const float v = fabsf(x[j]);
        top = v > top ? v : top;
    }
    *top_out = top;
}

static inline NO_CONTRACT void write_sums(int64_t k, int64_t b, float unit, const int sum[2],
                                          float* sums) {
    sums[b] = unit;
    sums[k / 32 + b] = unit * (float)(sum[0] + sum[1]);
    sums[k / 16 + 2 * b] = unit * (float)sum[0];
    sums[k / 16 + 2 * b + 1] = unit * (float)sum[1];
}

#ifdef MM_AVX2
/* 8 inputs -> their first digits (int32 lanes) and, TWO, second ones; both clamped to 127 */
static inline NO_CONTRACT __m256i digits8(const float* v, __m256 inv, const int TWO,
                                          __m256i* second) {
    const __m256 u = _mm256_mul_ps(_mm256_loadu_ps(v), inv);
    const __m256 first = _mm256_round_ps(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i lim = _mm256_set1_epi32(127), neg = _mm256_set1_epi32(-127);
    const __m256i h = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(first), lim), neg);
    if (TWO) {
        const __m256 s = _mm256_round_ps(
            _mm256_mul_ps(_mm256_sub_ps(u, first), _mm256_set1_ps(256.0f)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        *second = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(s), lim), neg);
    }
    return h;
}

static inline NO_CONTRACT int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* 4 vectors of 8 int32 in -127 .. 127 -> 32 bytes in order */
static inline NO_CONTRACT void store_bytes32(int8_t* out, const __m256i v[4]) {
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                         _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i*)out, _mm256_permutevar8x32_epi32(
        b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

static inline NO_CONTRACT void quantize_32s(const float* x, int64_t k, int64_t b0, int64_t b1,
                                            float inv, float unit, int8_t* h, int8_t* l,
                                            float* sums, const int TWO) {
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t b = b0; b < b1; b++) {
        __m256i hv[4], lv[4];
        int sum[2];
        for (int q = 0; q < 4; q++) hv[q] = digits8(x + 32 * b + 8 * q, vinv, TWO, &lv[q]);
        for (int half = 0; half < 2; half++) {
            __m256i t = _mm256_add_epi32(hv[2 * half], hv[2 * half + 1]);
            if (TWO)  /* 256 h + l */
                t = _mm256_add_epi32(_mm256_slli_epi32(t, 8),
                                     _mm256_add_epi32(lv[2 * half], lv[2 * half + 1]));
            sum[half] = hsum_i32(t);
        }
        store_bytes32(h + 32 * b, hv);
        if (TWO) store_bytes32(l + 32 * b, lv);
        write_sums(k, b, unit, sum, sums);
    }
}
#endif

static NO_CONTRACT void digits_row(const float* x, int64_t k, int group, int8_t* h, int8_t* l,
                                   float* sums) {
    for (int64_t g = 0; g < k / group; g++) {
        float top;
        group_top(x + g * group, group, &top);
        const float d = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
        const float unit = l != NULL ? d / 256.0f : d;
        const int64_t b0 = g * group / 32, b1 = (g + 1) * group / 32;
#ifdef MM_AVX2
        if (l != NULL) quantize_32s(x, k, b0, b1, inv, unit, h, l, sums, 1);
        else quantize_32s(x, k, b0, b1, inv, unit, h, NULL, sums, 0);
#else
        for (int64_t b = b0; b < b1; b++) {
            const float* v = x + 32 * b;
            int sum[2] = {0, 0};  /* per half: of h, or 256 h + l */
            for (int half = 0; half < 2; half++) {
                for (int j = 16 * half; j < 16 * half + 16; j++) {
                    const float u = v[j] * inv, first = rintf(u);
                    const int t = (int)first;
                    h[32 * b + j] = (int8_t)(t > 127 ? 127 : (t < -127 ? -127 : t));
                    sum[half] += h[32 * b + j];
                    if (l != NULL) {
                        float second = rintf((u - first) * 256.0f);
                        second = second > 127.0f ? 127.0f : (second < -127.0f ? -127.0f : second);
                        l[32 * b + j] = (int8_t)second;
                        sum[half] += 255 * h[32 * b + j] + (int)second;
                    }
                }
            }
            write_sums(k, b, unit, sum, sums);
        }
#endif
    }
}

void mm_digits_row(const float* x, int64_t k, int group, int8_t* h, int8_t* l, float* sums) {
    digits_row(x, k, group, h, l, sums);  /* the export (kernels.h), without the attribute */
}

/* ---- plain path: a block's quants unpacked to bytes once for every row, dot products in
 * int (NEON's SDOT, or SMULL / SMLAL pairs, where built: the same integers) ---- */

#ifdef MM_NEON
/* acc + the 4 lanes' sums of 4 products of w and x: SDOT, or two products per int16 lane
 * (at most 2 * 128 * 127: no overflow for any quant here), pairs added into int32 */
static inline int32x4_t dot16(int32x4_t acc, int8x16_t w, int8x16_t x) {
#ifdef MM_NEON_DOT
    return vdotq_s32(acc, w, x);
#else
    const int16x8_t lo = vmlal_s8(vmull_s8(vget_low_s8(w), vget_low_s8(x)), vget_high_s8(w),
                                  vget_high_s8(x));
    return vpadalq_s16(acc, lo);
#endif
}
#endif

/* the integer dot product of n (16 or 32) quants with n digits */
static inline int dot_n(const int8_t* w, const int8_t* x, int n) {
#ifdef MM_NEON
    int32x4_t acc = vdupq_n_s32(0);
    for (int j = 0; j < n; j += 16) acc = dot16(acc, vld1q_s8(w + j), vld1q_s8(x + j));
    return vaddvq_s32(acc);
#else
    int s = 0;
    for (int j = 0; j < n; j++) s += w[j] * x[j];
    return s;
#endif
}

/* the digits' integer of a span (at most 32 * 63 * 127 * 257: int holds it) */
static inline int dot_a(const int8_t* w, const ggml_act_row* a, int64_t at, int n) {
    const int s = dot_n(w, a->q + at, n);
    return a->l ? 256 * s + dot_n(w, a->l + at, n) : s;
}

/* the 32 quants of a Q4_* / Q5_* block (0 .. 15 or 0 .. 31; qh NULL for Q4) */
static inline void unpack32(const uint8_t* qs, const uint8_t* qh, int8_t* w) {
    const uint32_t h = qh ? le32(qh) : 0;
    for (int j = 0; j < 16; j++) {
        w[j] = (int8_t)((qs[j] & 0xF) | (((h >> j) & 1) << 4));
        w[j + 16] = (int8_t)((qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4));
    }
}

/* Rows a[0 .. count) (count <= MAX_ROWS) against one output channel's blocks wr (nb blocks):
 * out[i] = W . x'_i. Each block's quants are unpacked once for all the rows; each row's
 * float accumulator takes the same operations in the same order whatever the count, so a
 * row's result is its one-row call's, bit for bit (and, the integer sums being exact, the same
 * with NEON's dot products as without). */
static void dots_plain(int type, const uint8_t* wr, int64_t nb, const ggml_act_row* a, int count,
                       float* out) {
    float acc[MAX_ROWS] = {0.0f};
    int8_t w[64];
    for (int64_t b = 0; b < nb; b++) {
        switch (type) {
            case GGML_Q4_0: case GGML_Q5_0: case GGML_Q4_1: case GGML_Q5_1: {
                const int five = type == GGML_Q5_0 || type == GGML_Q5_1;
                const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1;
                const uint8_t* blk = wr + b * block_bytes(type);
                const int at = has_min ? 4 : 2;
                unpack32(blk + at + (five ? 4 : 0), five ? blk + at : NULL, w);
                const float d = half(blk), m = has_min ? half(blk + 2) : 0.0f;
                for (int i = 0; i < count; i++) {
                    const float isum = (float)dot_a(w, a + i, 32 * b, 32);
                    if (has_min) acc[i] += d * a[i].dx[b] * isum + m * a[i].xs[b];
                    else acc[i] += d * (a[i].dx[b] * isum - (five ? 16.0f : 8.0f) * a[i].xs[b]);
                }
                break;
            }
            case GGML_Q8_0: {
                const uint8_t* blk = wr + b * 34;
                const float d = half(blk);
                for (int i = 0; i < count; i++)
                    acc[i] += d * a[i].dx[b] *
                              (float)dot_a((const int8_t*)(blk + 2), a + i, 32 * b, 32);
                break;
            }
            case GGML_Q4_K: case GGML_Q5_K: {
                const int five = type == GGML_Q5_K;
                const uint8_t* blk = wr + b * block_bytes(type);
                const float d = half(blk), dmin = half(blk + 2);
                const uint8_t* qh = blk + 16;
                const uint8_t* ql = blk + (five ? 48 : 16);
                for (int j = 0; j < 8; j += 2) {
                    for (int l = 0; l < 32; l++) {
                        const int lo = ql[32 * (j / 2) + l] & 0xF, hi = ql[32 * (j / 2) + l] >> 4;
                        w[l] = (int8_t)(lo | (five ? ((qh[l] >> j) & 1) << 4 : 0));
                        w[32 + l] = (int8_t)(hi | (five ? ((qh[l] >> (j + 1)) & 1) << 4 : 0));
                    }
                    for (int h = 0; h < 2; h++) {
                        int sc, mn;
                        ggml_scale_min(j + h, blk + 4, &sc, &mn);
                        const int64_t c = 8 * b + j + h;
                        for (int i = 0; i < count; i++) {
                            const float isum = (float)dot_a(w + 32 * h, a + i, 32 * c, 32);
                            acc[i] += d * (float)sc * a[i].dx[c] * isum -
                                      dmin * (float)mn * a[i].xs[c];
                        }
                    }
                }
                break;
            }
            case GGML_Q6_K: {
                const uint8_t* blk = wr + b * 210;
                const int8_t* sc = (const int8_t*)(blk + 192);
                const float d = half(blk + 208);
                for (int n = 0; n < 2; n++) {
                    const uint8_t* ql = blk + 64 * n;
                    const uint8_t* qh = blk + 128 + 32 * n;
                    for (int g = 0; g < 4; g++) {
                        const uint8_t* lo = ql + 32 * (g & 1);
                        const int shift = 4 * (g >> 1);
                        for (int l = 0; l < 32; l++)
                            w[l] = (int8_t)(((lo[l] >> shift) & 0xF) |
                                            (((qh[l] >> (2 * g)) & 3) << 4));
                        const int64_t c = 8 * b + 4 * n + g;  /* the block of 32 */
                        for (int h = 0; h < 2; h++)
                            for (int i = 0; i < count; i++) {
                                const float isum =
                                    (float)dot_a(w + 16 * h, a + i, 32 * c + 16 * h, 16);
                                acc[i] += d * (float)sc[8 * n + 2 * g + h] *
                                          (a[i].dx[c] * isum - 32.0f * a[i].xs16[2 * c + h]);
                            }
                    }
                }
                break;
            }
            default: break;
        }
    }
    for (int i = 0; i < count; i++) out[i] = acc[i];
}

#ifdef MM_AVX2
/* 8 int32 lanes: sums of 4 products of u8 u and s8 s (PMADDUBSW pairs them into int16 without
 * saturation for the quants read here), the pairs weighted by the int16 lanes of mul */
static inline __m256i dot_u8s8(__m256i u, __m256i s, __m256i mul) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), mul);
}

#ifdef MM_AVX512_VNNI
/* acc + the 8 lanes' sums of 4 products of u8 u and s8 s in one VPDPBUSD (no int16 step) */
static inline __m256i add_dot(__m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(acc, u, s);
}

/* acc + dot_u8s8(u, s, mul): PMADDUBSW, then VPDPWSSD weights the pairs and adds */
static inline __m256i add_dot_weighted(__m256i acc, __m256i u, __m256i s, __m256i mul) {
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, s), mul);
}
#else
static inline __m256i add_dot(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, dot_u8s8(u, s, _mm256_set1_epi16(1)));
}

static inline __m256i add_dot_weighted(__m256i acc, __m256i u, __m256i s, __m256i mul) {
    return _mm256_add_epi32(acc, dot_u8s8(u, s, mul));
}
#endif

static inline __m256i load32(const int8_t* p) {
    return _mm256_loadu_si256((const __m256i*)p);
}

/* the digits' integer (q, or 256 q + l) of quants u against inputs at .. at + 31: the first
 * digits' sums, times 256, are the second digits' accumulator (exact: each lane at most
 * 4 * 31 * 127 * 257) */
static inline __m256i dot_act(__m256i u, const ggml_act_row* a, int64_t at) {
    const __m256i p = add_dot(_mm256_setzero_si256(), u, load32(a->q + at));
    if (a->l == NULL) return p;
    return add_dot(_mm256_slli_epi32(p, 8), u, load32(a->l + at));
}

/* as dot_act for signed quants w (Q8_0): |w| against the inputs with w's sign */
static inline __m256i dot_act_signed(__m256i w, const ggml_act_row* a, int64_t at) {
    const __m256i u = _mm256_sign_epi8(w, w);
    const __m256i p = add_dot(_mm256_setzero_si256(), u, _mm256_sign_epi8(load32(a->q + at), w));
    if (a->l == NULL) return p;
    return add_dot(_mm256_slli_epi32(p, 8), u, _mm256_sign_epi8(load32(a->l + at), w));
}

/* byte j of the result 0x10 where bit j of the 32 at p is set, else 0 (Q5's fifth bits) */
static inline __m256i fifth_bits(const uint8_t* p) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)le32(p)),
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);  /* all but bit j % 8 */
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, bit), _mm256_set1_epi8(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

#ifdef __F16C__
#define HALF(p) _cvtsh_ss((unsigned short)((p)[0] | ((p)[1] << 8)))  /* exact, as half() */
#else
#define HALF(p) half(p)
#endif

/* the integer sums (first digits into *ih, second into *il where TWO) of `count` unpacked 32s
 * wq (u8 quants) against a row's digits at `at`, each 32's products paired and weighted by its
 * int16 scales ws (PMADDWD). Per lane, over a super-block, at most 8 * 2 * 2 * 63 * 127 * 128
 * (Q6_K; Q4_K / Q5_K less): int32 holds each digit's sum, and integer sums do not depend on
 * their order (one row at a time or several: the same result). */
static inline __attribute__((always_inline)) void add_sums(
        __m256i* ih, __m256i* il, const __m256i* wq, const __m256i* ws, int count,
        const ggml_act_row* a, int64_t at, const int TWO) {
    for (int s = 0; s < count; s++) {
        *ih = add_dot_weighted(*ih, wq[s], load32(a->q + at + 32 * s), ws[s]);
        if (TWO) *il = add_dot_weighted(*il, wq[s], load32(a->l + at + 32 * s), ws[s]);
    }
}

/* acc + the super-block's integer sums in the row's unit: first digits times 256 where TWO */
static inline __attribute__((always_inline)) __m256 add_super(__m256 acc, __m256i ih, __m256i il,
                                                               const int TWO, float unit) {
    if (!TWO) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih), _mm256_set1_ps(unit), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih), _mm256_set1_ps(256.0f * unit), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(il), _mm256_set1_ps(unit), acc);
}

/* a super-block b's sums into each row's accumulator acc[i][0] (scale d): one row's already
 * taken (ih, il), more rows' taken here from the unpacked quants wq and scales ws */
static inline __attribute__((always_inline)) void super_rows(
        __m256 (*acc)[2], __m256i ih, __m256i il, const __m256i* wq, const __m256i* ws,
        const ggml_act_row* a, const int R, int64_t b, float d, const int TWO) {
    if (R == 1) {
        acc[0][0] = add_super(acc[0][0], ih, il, TWO, d * a->dx[8 * b]);
        return;
    }
    for (int i = 0; i < R; i++) {
        __m256i h = _mm256_setzero_si256(), l = _mm256_setzero_si256();
        add_sums(&h, &l, wq, ws, 8, a + i, 256 * b, TWO);
        acc[i][0] = add_super(acc[i][0], h, l, TWO, d * a[i].dx[8 * b]);
    }
}

/* Rows a[0 .. R) of x against one output channel's blocks wr (nb blocks): out[i] = W . x'_i.
 * Each block's quants are unpacked once and met by every row's digits. A row's float
 * accumulators are its own (for the 32-value types two, alternate blocks, so that two FMA
 * chains hide the latency one waits on; for the K types one, fed once per super-block), so a
 * row's arithmetic, and its result, is the same for any R: a verify's k + 1 rows sum each row
 * exactly as the one-row decode step does. */
static inline __attribute__((always_inline)) void dots_avx2(
        int type, const uint8_t* wr, int64_t nb, const ggml_act_row* a, const int R, const int TWO,
        float* out) {
    const __m256i nibble = _mm256_set1_epi8(0xF);
    __m256 acc[MAX_ROWS][2], off[MAX_ROWS];
    __m256i wq[8], ws[8];  /* a super-block's 32s unpacked (u8 quants) and their int16 scales */
    float offset[MAX_ROWS];
    for (int i = 0; i < R; i++) {
        acc[i][0] = acc[i][1] = off[i] = _mm256_setzero_ps();
        offset[i] = 0.0f;
    }
    switch (type) {
        case GGML_Q4_0: case GGML_Q5_0: case GGML_Q4_1: case GGML_Q5_1: {
            const int five = type == GGML_Q5_0 || type == GGML_Q5_1;
            const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1;
            const int nbytes = block_bytes(type), at = (has_min ? 4 : 2) + (five ? 4 : 0);
            const float shift = five ? 16.0f : 8.0f;
            for (int64_t b0 = 0; b0 < nb; b0 += 2) {
                for (int h = 0; h < 2 && b0 + h < nb; h++) {
                    const int64_t b = b0 + h;
                    const uint8_t* blk = wr + b * nbytes;
                    const __m128i qs = _mm_loadu_si128((const __m128i*)(blk + at));
                    __m256i w = _mm256_and_si256(
                        _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), nibble);
                    if (five) w = _mm256_or_si256(w, fifth_bits(blk + at - 4));
                    const float d = HALF(blk), m = has_min ? HALF(blk + 2) : -shift * d;
                    for (int i = 0; i < R; i++) {
                        acc[i][h] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(dot_act(w, a + i, 32 * b)),
                            _mm256_set1_ps(d * a[i].dx[b]), acc[i][h]);
                        offset[i] += m * a[i].xs[b];
                    }
                }
            }
            break;
        }
        case GGML_Q8_0:
            for (int64_t b0 = 0; b0 < nb; b0 += 2) {
                for (int h = 0; h < 2 && b0 + h < nb; h++) {
                    const int64_t b = b0 + h;
                    const uint8_t* blk = wr + b * 34;
                    const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + 2));
                    const float d = HALF(blk);
                    for (int i = 0; i < R; i++)
                        acc[i][h] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(dot_act_signed(w, a + i, 32 * b)),
                            _mm256_set1_ps(d * a[i].dx[b]), acc[i][h]);
                }
            }
            break;
        case GGML_Q4_K: case GGML_Q5_K: {
            const int five = type == GGML_Q5_K;
            const int nbytes = block_bytes(type);
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t* blk = wr + b * nbytes;
                /* ggml_scale_min's eight pairs at once: bytes 0 .. 7 the scales, 8 .. 15 the
                 * mins */
                uint32_t u[4];
                memcpy(u, blk + 4, 12);
                const uint32_t six = 0x3f3f3f3f, low = 0x0f0f0f0f, top2 = 0x03030303;
                u[3] = ((u[2] >> 4) & low) | (((u[1] >> 6) & top2) << 4);
                const uint32_t mins03 = u[1] & six;
                u[1] = (u[2] & low) | (((u[0] >> 6) & top2) << 4);
                u[2] = mins03;
                u[0] &= six;
                const uint8_t* sm = (const uint8_t*)u;
                const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(HALF(blk + 2)),
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(
                        sm + 8)))));
                __m256i ih = _mm256_setzero_si256(), il = _mm256_setzero_si256();  /* R == 1 */
                for (int i = 0; i < R; i++)
                    off[i] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(a[i].xs + 8 * b), off[i]);
                const uint8_t* ql = blk + (five ? 48 : 16);
                const __m256i hb = five ? _mm256_loadu_si256((const __m256i*)(blk + 16))
                                        : _mm256_setzero_si256();
                const __m256i one = _mm256_set1_epi8(1);
                for (int j = 0; j < 4; j++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(ql + 32 * j));
                    __m256i lo = _mm256_and_si256(v, nibble);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                    if (five) {
                        const __m256i h = _mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * j));
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                            _mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
                    }
                    /* one row: met at once, else kept for the rows below */
                    __m256i* q = R == 1 ? wq : wq + 2 * j;
                    __m256i* sc = R == 1 ? ws : ws + 2 * j;
                    q[0] = lo, q[1] = hi;
                    sc[0] = _mm256_set1_epi16(sm[2 * j]);
                    sc[1] = _mm256_set1_epi16(sm[2 * j + 1]);
                    if (R == 1) add_sums(&ih, &il, q, sc, 2, a, 256 * b + 64 * j, TWO);
                }
                super_rows(acc, ih, il, wq, ws, a, R, b, HALF(blk), TWO);
            }
            break;
        }
        case GGML_Q6_K:
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t* blk = wr + b * 210;
                const int8_t* sc = (const int8_t*)(blk + 192);
                const float d = HALF(blk + 208);
                const __m256 d32 = _mm256_set1_ps(32.0f * d);
                for (int h = 0; h < 2; h++) {
                    const __m256 s = _mm256_mul_ps(d32, _mm256_cvtepi32_ps(
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(sc + 8 * h)))));
                    for (int i = 0; i < R; i++)
                        off[i] = _mm256_fmadd_ps(s, _mm256_loadu_ps(a[i].xs16 + 16 * b + 8 * h),
                                                 off[i]);
                }
                __m256i ih = _mm256_setzero_si256(), il = _mm256_setzero_si256();  /* R == 1 */
                const __m256i three = _mm256_set1_epi8(3);
                for (int n = 0; n < 2; n++) {
                    const uint8_t* ql = blk + 64 * n;
                    const __m256i hb = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * n));
                    for (int g = 0; g < 4; g++) {
                        const __m256i src = _mm256_loadu_si256((const __m256i*)(ql + 32 * (g & 1)));
                        const __m256i nib = _mm256_and_si256(
                            g < 2 ? src : _mm256_srli_epi16(src, 4), nibble);
                        const __m256i bits = _mm256_slli_epi16(_mm256_and_si256(
                            _mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * g)), three), 4);
                        const int s = R == 1 ? 0 : 4 * n + g;
                        wq[s] = _mm256_or_si256(nib, bits);
                        ws[s] = _mm256_set_m128i(_mm_set1_epi16(sc[8 * n + 2 * g + 1]),
                                                 _mm_set1_epi16(sc[8 * n + 2 * g]));
                        if (R == 1)
                            add_sums(&ih, &il, wq, ws, 1, a, 256 * b + 32 * (4 * n + g), TWO);
                    }
                }
                super_rows(acc, ih, il, wq, ws, a, R, b, d, TWO);
            }
            break;
        default: break;
    }
    for (int i = 0; i < R; i++)
        out[i] = hsum8(_mm256_sub_ps(_mm256_add_ps(acc[i][0], acc[i][1]), off[i])) + offset[i];
}

/* one instance for a single row (R a constant: the one-row step keeps its sums in registers)
 * and one for any count of rows (R read at run time: each row's sums are taken one row at a
 * time over a super-block's unpacked quants), each for one and for two digits */
#define DOTS(NAME, R, TWO)                                                                     \
    static void NAME(int type, const uint8_t* wr, int64_t nb, const ggml_act_row* a,           \
                     int rows, float* out) {                                                   \
        (void)rows;                                                                            \
        dots_avx2(type, wr, nb, a, R, TWO, out);                                               \
    }
DOTS(dots_one_1, 1, 0)
DOTS(dots_one_2, 1, 1)
DOTS(dots_many_1, rows, 0)
DOTS(dots_many_2, rows, 1)
#undef DOTS

/* rows a[0 .. count) (count <= MAX_ROWS, all with the same number of digits) against one
 * channel */
static void dots_vector(int type, const uint8_t* wr, int64_t nb, const ggml_act_row* a, int count,
                        float* out) {
    const int two = a->l != NULL;
    if (count == 1) (two ? dots_one_2 : dots_one_1)(type, wr, nb, a, 1, out);
    else (two ? dots_many_2 : dots_many_1)(type, wr, nb, a, count, out);
}
#undef HALF
#define HAS_VECTOR 1
#else
#define HAS_VECTOR 0
#endif

/* ggml_linear's groups of 8 channels of an x8 weight (GGML_Q4_K_X8, GGML_Q6_K_X8) against
 * rows[0 .. m) (rows y0 .. of y), shared by the team: each group through the vector kernel,
 * MAX_ROWS rows at a time (a prefill's chunk of rows meets a group while it is in cache), or
 * (generic, or no vector path) each channel's blocks as the file held them through the plain
 * one */
static int x8_linear(int type, const uint8_t* w, void* y, int x_dtype, int64_t ldy, int64_t y0,
                     int64_t m, int64_t n, int64_t per_row, const ggml_act_row* rows,
                     int failed, int generic) {
    const int plain = generic || !HAS_VECTOR, stored = mm_ggml_x8_stored(type);
    const int64_t group_bytes = X8_CHANNELS * per_row * block_bytes(type);
    /* the plain path's: one channel's blocks as stored */
    uint8_t* file_row = plain ? malloc((size_t)(per_row * block_bytes(stored))) : NULL;
    failed |= plain && file_row == NULL;
    /* a verify's rows (from PAIR_ROWS) take two groups at a time where the build has it:
     * units of two groups, the last alone when their count is odd */
    const int64_t groups = n / X8_CHANNELS;
    const int pairs = !plain && m >= PAIR_ROWS && mm_ggml_x8_pairs(type);
    /* nowait: what a thread reads after is its own (file_row); a caller meets the team at its
     * own barrier (ON_TEAM's end, or mm_decode_layers' team_sync) before reading y */
    _Pragma("omp for schedule(static) nowait")
    for (int64_t u = 0; u < (pairs ? (groups + 1) / 2 : groups); u++) {
        if (failed) continue;
        const int64_t g = pairs ? 2 * u : u;
        const int width = (pairs && g + 1 < groups ? 2 : 1) * X8_CHANNELS;  /* the unit's */
        for (int64_t i0 = 0; i0 < m; i0 += MAX_ROWS) {
            const int count = m - i0 < MAX_ROWS ? (int)(m - i0) : MAX_ROWS;
            float out[MAX_ROWS * 2 * X8_CHANNELS];  /* [count, width] */
            if (plain) {
                for (int c = 0; c < X8_CHANNELS; c++) {
                    for (int64_t b = 0; b < per_row; b++)
                        mm_ggml_x8_block(w, type, per_row, g * X8_CHANNELS + c, b,
                                         file_row + block_bytes(stored) * b);
                    float dots[MAX_ROWS];
                    dots_plain(stored, file_row, per_row, rows + i0, count, dots);
                    for (int i = 0; i < count; i++) out[X8_CHANNELS * i + c] = dots[i];
                }
            } else if (width > X8_CHANNELS && count > 1) {
                mm_ggml_x8_rows_pair(type, w + g * group_bytes, w + (g + 1) * group_bytes,
                                     per_row, rows + i0, count, out);
            } else {  /* one group, or a pair's groups one by one for a last lone row */
                for (int h = 0; h < width / X8_CHANNELS; h++)
                    mm_ggml_x8_rows(type, w + (g + h) * group_bytes, per_row, rows + i0, count,
                                    out + h * X8_CHANNELS);
            }
            for (int i = 0; i < count; i++)
                for (int c = 0; c < width; c++)
                    store(y, x_dtype, (y0 + i0 + i) * ldy + g * X8_CHANNELS + c,
                          out[width * i + c]);
        }
    }
    free(file_row);
    return failed;
}

/* The team's body of mm_ggml_linear: x's rows in chunks (a decode's few rows are one), each
 * chunk's digits written by every thread for itself (O(rows k), small beside the product's
 * O(rows k n / threads)) into buffers of the chunk's size, then the output channels shared. A
 * prefill's chunk holds the rows whose digits fit in X_CHUNK_BYTES: they stay in a core's cache
 * while the whole weight meets them, which it is read once for. */
static int ggml_linear(const void* x, int x_dtype, const uint8_t* w, int type, void* y,
                       int64_t ldy, int64_t m, int64_t n, int64_t k, int digits, int generic) {
    int64_t chunk = X_CHUNK_BYTES / (digits * k) / MAX_ROWS * MAX_ROWS;
    chunk = chunk < MAX_ROWS ? MAX_ROWS : chunk;
    chunk = chunk < m ? chunk : m;  /* a decode's buffers: its rows only */
    const int64_t per = k / 32 * 4;  /* floats of one row's dx, xs, xs16 */
    float* xf = x_dtype == DTYPE_F32 ? NULL : malloc(sizeof(float) * (size_t)(chunk * k));
    int8_t* q = malloc((size_t)(2 * chunk * k));
    float* sums = malloc(sizeof(float) * (size_t)(chunk * per));
    ggml_act_row few[MAX_ROWS];  /* a decode's or a verify's rows: no allocation */
    ggml_act_row* rows = chunk <= MAX_ROWS ? few : malloc(sizeof(ggml_act_row) * (size_t)chunk);
    const int failed = (x_dtype != DTYPE_F32 && xf == NULL) || q == NULL || sums == NULL ||
                       rows == NULL;
    int status = 0;
    const int64_t per_row = k / block_values(type), row_bytes = per_row * block_bytes(type);
    for (int64_t c0 = 0; c0 < m; c0 += chunk) {
        const int64_t here = m - c0 < chunk ? m - c0 : chunk;
        const float* xc = (const float*)x + c0 * k;
        if (!failed && xf != NULL) load_row(xf, x, x_dtype, c0 * k, here * k), xc = xf;
        for (int64_t r = 0; r < here && !failed; r++) {
            int8_t* h = q + 2 * r * k;
            float* s = sums + r * per;
            digits_row(xc + r * k, k, block_values(type), h, digits == 2 ? h + k : NULL, s);
            rows[r] = (ggml_act_row){h, digits == 2 ? h + k : NULL, s, s + k / 32, s + k / 16};
        }
        if (mm_ggml_x8_stored(type)) {
            status |= x8_linear(type, w, y, x_dtype, ldy, c0, here, n, per_row, rows, failed,
                                generic);
            continue;
        }
        _Pragma("omp for schedule(static) nowait")  /* as x8_linear's */
        for (int64_t c = 0; c < n; c++) {
            if (failed) continue;
            const uint8_t* wr = w + c * row_bytes;
            for (int64_t i0 = 0; i0 < here; i0 += MAX_ROWS) {
                const int count = here - i0 < MAX_ROWS ? (int)(here - i0) : MAX_ROWS;
                float out[MAX_ROWS];
#if HAS_VECTOR
                if (!generic) dots_vector(type, wr, per_row, rows + i0, count, out);
                else
#endif
                    dots_plain(type, wr, per_row, rows + i0, count, out);
                for (int i = 0; i < count; i++)
                    store(y, x_dtype, (c0 + i0 + i) * ldy + c, out[i]);
            }
        }
    }
    free(xf), free(q), free(sums);
    if (rows != few) free(rows);
    return failed | status;
}

/* y [M, N] (x's dtype, rows ldy >= N apart: a part's columns of a wider output) = x [M, K] .
 * W^T, W of `type`, through the integer path (above), x in `digits` (1 or 2) int8 digits per
 * input; generic != 0: the plain path even where a vector one is built (for tests). -> 0, 1 out
 * of memory, 2 a type or K it does not take (or digits not 1 or 2, or ldy < N). */
int mm_ggml_linear(const void* x, int x_dtype, const uint8_t* w, int type, void* y, int64_t ldy,
                   int64_t m, int64_t n, int64_t k, int digits, int generic, int threads) {
    if (!mm_ggml_takes(type, k) || (digits != 1 && digits != 2) || ldy < n ||
        (mm_ggml_x8_stored(type) && n % X8_CHANNELS != 0))
        return 2;
    const int team = team_threads(threads, m, n * k / 2);
    ON_TEAM(team, ggml_linear(x, x_dtype, w, type, y, ldy, m, n, k, digits, generic));
}
