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
 * mm_ggml_linear: y [M, N] = x [M, K] . W^T for a decode step's few rows. Per output channel,
 * each span of up to 256 inputs is dequantized into a buffer in L1 and multiplied into every
 * row's LANES partial sums (independent lanes: the compiler vectorizes both loops for the
 * variant). The weight is read once per call, in its blocks' bytes (4.5 bits per weight for
 * Q4_K). Sums in float32.
 *
 * mm_ggml_dequantize: rows of the weight (consecutive, or picked by index: an embedding's
 * lookup) to float32, for a prefill's GEMM on a tile of rows (models/kernels/ggml_blocks.py)
 * and for tests.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#define NO_CONTRACT
#elif defined(__GNUC__)
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define NO_CONTRACT
#endif

/* ggml's type codes (enum ggml_type), as GGUF stores them */
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q5_0 6
#define GGML_Q5_1 7
#define GGML_Q8_0 8
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14

#define SPAN 256 /* values dequantized at once: one super-block, or eight 32-blocks */
#define ROW_CHUNK 8 /* rows of x per pass over the weight (their partial sums stay in cache) */
#define LANES 32    /* partial sums per row: independent lanes the compiler vectorizes */

/* values per block and bytes per block of `type`; 0 for a type this file does not read */
static int block_values(int type) {
    switch (type) {
        case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_Q8_0: return 32;
        case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return 256;
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

/* Q4_K / Q5_K's sub-block j (of 8) 6-bit scale and minimum, packed in 12 bytes */
static inline void scale_min(int j, const uint8_t* q, int* sc, int* mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

NO_CONTRACT static void q4_k(const uint8_t* b, float* y) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int j = 0; j < 8; j += 2) {
        int sc, mn;
        scale_min(j, scales, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        scale_min(j + 1, scales, &sc, &mn);
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
        scale_min(j, scales, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        scale_min(j + 1, scales, &sc, &mn);
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
        dequantize_blocks(type, w + r * row_bytes, per_row, out + i * k);
    }
    return 0;
}

/* y [M, N] (x's dtype) = x [M, K] . W^T, W of `type`. -> 0, 1 out of memory, 2 a type or K it
 * does not take. */
int mm_ggml_linear(const void* x, int x_dtype, const uint8_t* w, int type, void* y, int64_t m,
                   int64_t n, int64_t k, int threads) {
    if (!mm_ggml_takes(type, k)) return 2;
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
