/* Paged decode attention: one query token per sequence against its keys read in place from the
 * paged cache (no gather), with sliding windows, logit soft-capping and grouped-query heads;
 * scores, softmax and the weighted sum in float32. The cache holds keys and values in the model
 * dtype, or int8 rows each followed by its float32 scale (models/layers/kv_quant.py), whose
 * scale is applied to the row's dot product and to its softmax weight: no row is widened. With
 * AVX-512 VNNI an int8 cache's keys meet the query in integers (scores_i8_vnni) and its values
 * the weights (values_i8_vnni), with AVX-512 BF16 a bfloat16 cache's keys meet a bfloat16 query
 * by VDPBF16PS (scores_bf16), 16 keys an instruction. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define CHUNK_FLOATS 8192  /* keys (or values) converted to float32 at a time: 32 KiB, in L1 */

static inline void softmax_rows(float* scores, int64_t group, int64_t len);
#define TILE_MAX_DIM 256 /* the tiled scores' bounds (scores_i8_vnni, scores_bf16) */
#define TILE_MAX_GROUP 16
#ifdef MM_AVX512_BF16
static void scores_bf16(const uint16_t* cache, int64_t key_base, const int64_t* blocks,
                        int64_t key0, int64_t block_size, int64_t lo, int64_t len, int64_t group,
                        const float* qf, float* scores, float scale, float softcap, int64_t dim);
#endif

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

/* One query head's scores against n gathered float32 key rows ([n, dim]): each dot product
 * (times the row's scale where row_scales is given: an int8 cache's), times `scale`, soft-capped
 * where softcap > 0, into sg[0 .. n) */
static inline __attribute__((always_inline)) void float_scores(
        const float* qg, const float* rows, const float* row_scales, int64_t n, int64_t dim,
        float scale, float softcap, float* sg) {
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
        if (row_scales != NULL) sg[t] *= row_scales[t];
        sg[t] *= scale;
        if (softcap > 0.0f) sg[t] = softcap * tanhf(sg[t] / softcap);
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
#ifdef MM_AVX512_BF16
    const int tiled = dt == DTYPE_BF16 && dim % 32 == 0 && dim <= TILE_MAX_DIM &&
                      group <= TILE_MAX_GROUP;
    if (tiled)
        scores_bf16(cache, key_base, blocks, key0, block_size, lo, len, group, qf, scores, scale,
                    softcap, dim);
#else
    const int tiled = 0;
#endif
    for (int64_t c = 0; c < len && !tiled; c += chunk) {
        const int64_t n = len - c < chunk ? len - c : chunk;
        gather_rows(cache, dt, key_base, blocks, key0, block_size, lo + c, n, dim, rows);
        for (int64_t g = 0; g < group; g++)
            float_scores(qf + g * dim, rows, NULL, n, dim, scale, softcap,
                         scores + g * len + c);
    }
    softmax_rows(scores, group, len);
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

/* Softmax of each query head's scores [group, len], in place. */
static inline void softmax_rows(float* scores, int64_t group, int64_t len) {
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
}

/* Rows [t0, t0 + n) of one head of an int8 cache (`base`: that head's first byte): their int8
 * values as float32, unscaled, into `dst` [n, dim] (a chunk in L1, converted once for all the
 * query heads of the group), and their scales into `scales` [n]. */
static inline void gather_rows_i8(const int8_t* cache, int64_t base, const int64_t* blocks,
                                  int64_t key0, int64_t block_size, int64_t t0, int64_t n,
                                  int64_t dim, float* dst, float* scales) {
    const int64_t stride = dim + KV_SCALE_BYTES;
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = t0 + t;
        const int64_t slot = blocks[(pos - key0) / block_size] * block_size + pos % block_size;
        const int8_t* row = cache + base + slot * stride;
        float* out = dst + t * dim;
        _Pragma("omp simd")
        for (int64_t d = 0; d < dim; d++) out[d] = (float)row[d];
        memcpy(scales + t, row + dim, sizeof(float));
    }
}

#if defined(MM_AVX512_VNNI) || defined(MM_AVX512_BF16)
/* Scores without a horizontal sum per key: 16 keys a tile, their rows transposed in 4-byte
 * columns (lane j of column c: key j's bytes 4c .. 4c + 3 of a 64-byte stretch), so that one
 * instruction with a query's 4 bytes broadcast adds to each of the 16 keys' sums:
 * - an int8 cache (VPDPBUSD): a query head in two int8 digits (as the ggml decode path writes
 *   activations: q' = unit (256 h + l), within max|q| / 32512 of q), each digit offset by 128 to
 *   be the instruction's unsigned operand (128 times a key's sum taken back out): integer sums;
 * - a bfloat16 cache (VDPBF16PS): the query's bfloat16 values in pairs (a bfloat16 model's q is
 *   bfloat16 already), float32 sums.
 * Head sizes up to TILE_MAX_DIM (rows a multiple of 64 bytes) and groups up to TILE_MAX_GROUP
 * query heads; the others take the float loop. */

/* The rows (`stride` bytes apart in the cache, from byte `base`) of keys [first, first + n),
 * n = min(left, 16), into row[16] (past n: the first again, computed and not kept) -> n */
static inline int tile_rows(const uint8_t* cache, int64_t base, const int64_t* blocks,
                            int64_t key0, int64_t block_size, int64_t first, int64_t left,
                            int64_t stride, const uint8_t** row) {
    const int n = left < 16 ? (int)left : 16;
    for (int j = 0; j < 16; j++) {
        const int64_t pos = first + (j < n ? j : 0);
        const int64_t slot = blocks[(pos - key0) / block_size] * block_size + pos % block_size;
        row[j] = cache + base + slot * stride;
    }
    return n;
}

/* bytes [at, at + 64) of the 16 rows as 16 columns of 4 bytes (kernels.h's transpose16 moves
 * the bits as floats) */
static inline void tile_columns(const uint8_t* const* row, int64_t at, __m512i* col) {
    __m512 moved[16];
    for (int j = 0; j < 16; j++) moved[j] = _mm512_castsi512_ps(_mm512_loadu_si512(row[j] + at));
    transpose16(moved);
    for (int c = 0; c < 16; c++) col[c] = _mm512_castps_si512(moved[c]);
}

/* a tile's scores `dot` (scaled) into sg [0, n), soft-capped where softcap > 0 */
static inline void keep_scores(__m512 dot, float softcap, float* sg, int n) {
    float out[16];
    _mm512_storeu_ps(out, dot);
    for (int j = 0; j < n; j++) sg[j] = softcap > 0.0f ? softcap * tanhf(out[j] / softcap) : out[j];
}
#endif

#ifdef MM_AVX512_VNNI
/* scores [group, len] (before the softmax) of keys [lo, lo + len) of one head of the int8 cache
 * against the group's query heads qf [group, dim] */
static void scores_i8_vnni(const int8_t* cache, int64_t key_base, const int64_t* blocks,
                           int64_t key0, int64_t block_size, int64_t lo, int64_t len,
                           int64_t group, const float* qf, float* scores, float scale,
                           float softcap, int64_t dim) {
    /* each query head's digits h, l (one group of dim: mm_digits_row), then + 128 (the top bit
     * flipped: VPDPBUSD's unsigned operand), and their unit; a NaN or infinite query scores
     * NaN, as the float loop's does */
    int8_t qh[TILE_MAX_GROUP * TILE_MAX_DIM], ql[TILE_MAX_GROUP * TILE_MAX_DIM];
    float unit[TILE_MAX_GROUP], sums[TILE_MAX_DIM / 32 * 4];
    for (int64_t g = 0; g < group; g++) {
        const float* q = qf + g * dim;
        int finite = 1;
        for (int64_t d = 0; d < dim; d++) finite &= isfinite(q[d]) != 0;
        int8_t *h = qh + g * dim, *l = ql + g * dim;
        mm_digits_row(q, dim, (int)dim, h, l, sums);
        for (int64_t d = 0; d < dim; d++)
            h[d] = (int8_t)((uint8_t)h[d] ^ 0x80u), l[d] = (int8_t)((uint8_t)l[d] ^ 0x80u);
        unit[g] = finite ? sums[0] : NAN;
    }
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const uint8_t* row[16];
        const int n = tile_rows((const uint8_t*)cache, key_base, blocks, key0, block_size,
                                lo + t0, len - t0, dim + KV_SCALE_BYTES, row);
        float row_scale[16];
        for (int j = 0; j < 16; j++) memcpy(&row_scale[j], row[j] + dim, sizeof(float));
        __m512i ih[TILE_MAX_GROUP], il[TILE_MAX_GROUP], sum = _mm512_setzero_si512();
        for (int64_t g = 0; g < group; g++) ih[g] = il[g] = _mm512_setzero_si512();
        for (int64_t cb = 0; cb < dim; cb += 64) {
            __m512i col[16];
            tile_columns(row, cb, col);
            for (int c = 0; c < 16; c++) sum = _mm512_dpbusd_epi32(sum, ones, col[c]);
            for (int64_t g = 0; g < group; g++) {
                const int8_t *h = qh + g * dim + cb, *l = ql + g * dim + cb;
                __m512i a = ih[g], b = il[g];
                for (int c = 0; c < 16; c++) {
                    int32_t hw, lw;
                    memcpy(&hw, h + 4 * c, 4), memcpy(&lw, l + 4 * c, 4);
                    a = _mm512_dpbusd_epi32(a, _mm512_set1_epi32(hw), col[c]);
                    b = _mm512_dpbusd_epi32(b, _mm512_set1_epi32(lw), col[c]);
                }
                ih[g] = a, il[g] = b;
            }
        }
        const __m512i offset = _mm512_slli_epi32(sum, 7);  /* 128 times each key's sum */
        const __m512 scales = _mm512_loadu_ps(row_scale);
        for (int64_t g = 0; g < group; g++) {
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(ih[g], offset));
            const __m512 low = _mm512_cvtepi32_ps(_mm512_sub_epi32(il[g], offset));
            const __m512 dot = _mm512_add_ps(_mm512_mul_ps(hi, _mm512_set1_ps(256.0f * unit[g])),
                                             _mm512_mul_ps(low, _mm512_set1_ps(unit[g])));
            keep_scores(_mm512_mul_ps(_mm512_mul_ps(dot, scales), _mm512_set1_ps(scale)), softcap,
                        scores + g * len + t0, n);
        }
    }
}
#endif

#ifdef MM_AVX512_VNNI
/* acc [group, dim] = sum_t p[g][t] s_t v_t over values [lo, lo + len) of one head of the int8
 * cache (s_t a row's scale, p the softmax's weights `probs` [group, len]) without widening a
 * value: per tile of 16 keys, each query head's weights p s in two uint8 digits of a unit (the
 * tile's largest / 65535: each weight within half a unit, and a tile's error at most 16 half
 * units, so within 2^-13 of the tile's share of the sum), 4 keys' bytes of each value
 * interleaved into an int32 lane, and VPDPBUSD with the 4 keys' digits broadcast: integer sums
 * per tile, met by the unit once. An interleaved stretch of 64 values holds value
 * 16 L + 4 m + i at lane 4 L + i of its column m; `acc` takes them back in order at the end. */
static void values_i8_vnni(const int8_t* cache, int64_t value_base, const int64_t* blocks,
                           int64_t key0, int64_t block_size, int64_t lo, int64_t len,
                           int64_t group, const float* probs, float* acc, int64_t dim) {
    float held[TILE_MAX_GROUP * TILE_MAX_DIM];  /* acc, values in the columns' order */
    memset(held, 0, sizeof(float) * (size_t)(group * dim));
    const __m512i byte = _mm512_set1_epi32(0xFF);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const uint8_t* row[16];
        const int n = tile_rows((const uint8_t*)cache, value_base, blocks, key0, block_size,
                                lo + t0, len - t0, dim + KV_SCALE_BYTES, row);
        const __mmask16 keep = (__mmask16)((1u << n) - 1u);
        float row_scale[16];
        for (int j = 0; j < 16; j++) memcpy(&row_scale[j], row[j] + dim, sizeof(float));
        const __m512 scales = _mm512_loadu_ps(row_scale);
        /* the digits of 4 keys in an int32 each: [head][key / 4] */
        int32_t dh[TILE_MAX_GROUP][4], dl[TILE_MAX_GROUP][4];
        float unit[TILE_MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, probs + g * len + t0),
                                           scales);
            const float top = _mm512_mask_reduce_max_ps(keep, w);
            const int nan = _mm512_mask_cmp_ps_mask(keep, w, w, _CMP_UNORD_Q) != 0;
            const float per_unit = top > 0.0f ? 65535.0f / top : 0.0f;
            const __m512i q = _mm512_maskz_cvtps_epi32(
                keep, _mm512_mul_ps(w, _mm512_set1_ps(per_unit)));
            _mm_storeu_si128((__m128i*)dh[g], _mm512_cvtepi32_epi8(_mm512_srli_epi32(q, 8)));
            _mm_storeu_si128((__m128i*)dl[g], _mm512_cvtepi32_epi8(_mm512_and_si512(q, byte)));
            unit[g] = nan ? NAN : top / 65535.0f;
        }
        for (int64_t cb = 0; cb < dim; cb += 64) {
            __m512i col[4][4];  /* [keys 4k .. 4k + 3][m] */
            for (int k = 0; k < 4; k++) {
                const __m512i r0 = _mm512_loadu_si512(row[4 * k] + cb);
                const __m512i r1 = _mm512_loadu_si512(row[4 * k + 1] + cb);
                const __m512i r2 = _mm512_loadu_si512(row[4 * k + 2] + cb);
                const __m512i r3 = _mm512_loadu_si512(row[4 * k + 3] + cb);
                const __m512i lo01 = _mm512_unpacklo_epi8(r0, r1);
                const __m512i hi01 = _mm512_unpackhi_epi8(r0, r1);
                const __m512i lo23 = _mm512_unpacklo_epi8(r2, r3);
                const __m512i hi23 = _mm512_unpackhi_epi8(r2, r3);
                col[k][0] = _mm512_unpacklo_epi16(lo01, lo23);
                col[k][1] = _mm512_unpackhi_epi16(lo01, lo23);
                col[k][2] = _mm512_unpacklo_epi16(hi01, hi23);
                col[k][3] = _mm512_unpackhi_epi16(hi01, hi23);
            }
            for (int64_t g = 0; g < group; g++) {
                __m512i ih[4], il[4];
                for (int m = 0; m < 4; m++) ih[m] = il[m] = _mm512_setzero_si512();
                for (int k = 0; k < 4; k++) {
                    const __m512i h = _mm512_set1_epi32(dh[g][k]);
                    const __m512i l = _mm512_set1_epi32(dl[g][k]);
                    for (int m = 0; m < 4; m++) {
                        ih[m] = _mm512_dpbusd_epi32(ih[m], h, col[k][m]);
                        il[m] = _mm512_dpbusd_epi32(il[m], l, col[k][m]);
                    }
                }
                float* out = held + g * dim + cb;
                for (int m = 0; m < 4; m++) {  /* 256 h + l: at most 16 * 65535 * 128 */
                    const __m512 sum = _mm512_cvtepi32_ps(
                        _mm512_add_epi32(_mm512_slli_epi32(ih[m], 8), il[m]));
                    _mm512_storeu_ps(out + 16 * m, _mm512_fmadd_ps(
                        sum, _mm512_set1_ps(unit[g]), _mm512_loadu_ps(out + 16 * m)));
                }
            }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) {  /* d = cb + 16 L + 4 m + i at cb + 16 m + 4 L + i */
            const int64_t r = d % 64, at = d - r + 16 * ((r % 16) / 4) + 4 * (r / 16) + r % 4;
            acc[g * dim + d] = held[g * dim + at];
        }
}
#endif

#ifdef MM_AVX512_BF16
/* scores [group, len] of keys [lo, lo + len) of one head of a bfloat16 cache (`key_base` in
 * elements) against qf [group, dim], bfloat16 values held as float32 */
static void scores_bf16(const uint16_t* cache, int64_t key_base, const int64_t* blocks,
                        int64_t key0, int64_t block_size, int64_t lo, int64_t len, int64_t group,
                        const float* qf, float* scores, float scale, float softcap,
                        int64_t dim) {
    uint32_t pairs[TILE_MAX_GROUP * TILE_MAX_DIM / 2];  /* q's values 2i, 2i + 1 as bfloat16 */
    for (int64_t i = 0; i < group * dim; i += 2) {
        uint32_t a, b;
        memcpy(&a, qf + i, 4), memcpy(&b, qf + i + 1, 4);
        pairs[i / 2] = (a >> 16) | (b & 0xFFFF0000u);
    }
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const uint8_t* row[16];
        const int n = tile_rows((const uint8_t*)cache, 2 * key_base, blocks, key0, block_size,
                                lo + t0, len - t0, 2 * dim, row);
        __m512 acc[TILE_MAX_GROUP];
        for (int64_t g = 0; g < group; g++) acc[g] = _mm512_setzero_ps();
        for (int64_t cb = 0; cb < 2 * dim; cb += 64) {  /* 32 values a stretch */
            __m512i col[16];
            tile_columns(row, cb, col);
            for (int64_t g = 0; g < group; g++) {
                const uint32_t* qp = pairs + (g * dim + cb / 2) / 2;
                __m512 a = acc[g];
                for (int c = 0; c < 16; c++)
                    a = _mm512_dpbf16_ps(a, (__m512bh)col[c], (__m512bh)_mm512_set1_epi32(
                        (int)qp[c]));
                acc[g] = a;
            }
        }
        for (int64_t g = 0; g < group; g++)
            keep_scores(_mm512_mul_ps(acc[g], _mm512_set1_ps(scale)), softcap,
                        scores + g * len + t0, n);
    }
}
#endif

/* attend_head for an int8 cache: a key's score is its scale times q . row, a value row is added
 * with its softmax weight times its scale. `row_scales`: CHUNK_FLOATS / dim floats. */
static inline __attribute__((always_inline)) void attend_head_i8(
    const int8_t* cache, int64_t key_base, int64_t value_base, const int64_t* blocks,
    int64_t key0, int64_t block_size, int64_t lo, int64_t len, int64_t group, const float* qf,
    float* acc, float* scores, float* rows, float* row_scales, float scale, float softcap,
    const int64_t dim) {
    const int64_t chunk = CHUNK_FLOATS / dim;
#ifdef MM_AVX512_VNNI
    const int vnni = dim % 64 == 0 && dim <= TILE_MAX_DIM && group <= TILE_MAX_GROUP;
    if (vnni)
        scores_i8_vnni(cache, key_base, blocks, key0, block_size, lo, len, group, qf, scores,
                       scale, softcap, dim);
#else
    const int vnni = 0;
#endif
    for (int64_t c = 0; c < len && !vnni; c += chunk) {
        const int64_t n = len - c < chunk ? len - c : chunk;
        gather_rows_i8(cache, key_base, blocks, key0, block_size, lo + c, n, dim, rows,
                       row_scales);
        for (int64_t g = 0; g < group; g++)
            float_scores(qf + g * dim, rows, row_scales, n, dim, scale, softcap,
                         scores + g * len + c);
    }
    softmax_rows(scores, group, len);
#ifdef MM_AVX512_VNNI
    if (vnni) {
        values_i8_vnni(cache, value_base, blocks, key0, block_size, lo, len, group, scores, acc,
                       dim);
        return;
    }
#endif
    memset(acc, 0, sizeof(float) * (size_t)(group * dim));
    for (int64_t c = 0; c < len; c += chunk) {
        const int64_t n = len - c < chunk ? len - c : chunk;
        gather_rows_i8(cache, value_base, blocks, key0, block_size, lo + c, n, dim, rows,
                       row_scales);
        for (int64_t g = 0; g < group; g++) {
            const float* pg = scores + g * len + c;
            float a[dim];
            memcpy(a, acc + g * dim, sizeof(float) * (size_t)dim);
            for (int64_t t = 0; t < n; t++) {
                const float* vr = rows + t * dim;
                const float w = pg[t] * row_scales[t];
                _Pragma("omp simd")
                for (int64_t d = 0; d < dim; d++) a[d] += w * vr[d];
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
static int decode_attention(const void* q, const void* cache, void* out, int dtype, int kv_i8,
                            const int64_t* table, const int64_t* key0, const int64_t* context,
                            int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                            int64_t width, int64_t num_blocks, int64_t block_size,
                            int64_t window, float scale, float softcap) {
    const int64_t group = heads / kv_heads;
    /* one KV head's slots, in elements (int8 rows: bytes, each row followed by its scale) */
    const int64_t head_stride = num_blocks * block_size * (kv_i8 ? dim + KV_SCALE_BYTES : dim);
    int failed = 0;  /* on this thread */
    _Pragma("omp for collapse(2) schedule(dynamic, 1) nowait")
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t ctx = context[b];
            int64_t lo = window > 0 && ctx > window ? ctx - window : 0;
            if (lo < key0[b]) lo = key0[b];
            const int64_t len = ctx - lo;
            const int64_t extra = kv_i8 ? CHUNK_FLOATS / dim : 0;  /* int8: the rows' scales */
            float* work = malloc(sizeof(float) *
                                 (size_t)(group * (len + 2 * dim) + CHUNK_FLOATS + extra));
            if (work == NULL) {
                failed = 1;
                continue;
            }
            float* scores = work;                 /* [group, len] */
            float* qf = work + group * len;       /* [group, dim] */
            float* acc = qf + group * dim;        /* [group, dim] */
            float* rows = acc + group * dim;      /* CHUNK_FLOATS */
            float* row_scales = rows + CHUNK_FLOATS;
            for (int64_t g = 0; g < group; g++)
                for (int64_t d = 0; d < dim; d++)
                    qf[g * dim + d] = load_x(q, dtype, (b * heads + h * group + g) * dim + d);
            const int64_t* blocks = table + b * width;
            const int64_t keys = h * head_stride, values = (kv_heads + h) * head_stride;
#define ATTEND(D) attend_head(cache, dtype, keys, values, blocks, key0[b], block_size, lo, len, \
                              group, qf, acc, scores, rows, scale, softcap, D)
#define ATTEND_I8(D) attend_head_i8(cache, keys, values, blocks, key0[b], block_size, lo, len, \
                                    group, qf, acc, scores, rows, row_scales, scale, softcap, D)
            if (kv_i8) {
                switch (dim) {
                    case 64: ATTEND_I8(64); break;
                    case 128: ATTEND_I8(128); break;
                    case 256: ATTEND_I8(256); break;
                    default: ATTEND_I8(dim);
                }
            } else {
                switch (dim) {
                    case 64: ATTEND(64); break;
                    case 128: ATTEND(128); break;
                    case 256: ATTEND(256); break;
                    default: ATTEND(dim);
                }
            }
#undef ATTEND
#undef ATTEND_I8
            for (int64_t g = 0; g < group; g++)
                for (int64_t d = 0; d < dim; d++)
                    store(out, dtype, (b * heads + h * group + g) * dim + d, acc[g * dim + d]);
            free(work);
        }
    }
    return failed;
}

/* decode_attention on a team (kernels.h, ON_TEAM); 2: a head dimension past CHUNK_FLOATS. */
int mm_decode_attention(const void* q, const void* cache, void* out, int dtype,
                        const int64_t* table, const int64_t* key0, const int64_t* context,
                        int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t width, int64_t num_blocks, int64_t block_size, int64_t window,
                        float scale, float softcap, int threads) {
    if (dim > CHUNK_FLOATS) return 2;
    ON_TEAM(threads, decode_attention(q, cache, out, dtype, 0, table, key0, context, batch,
                                      heads, kv_heads, dim, width, num_blocks, block_size, window,
                                      scale, softcap));
}

/* mm_decode_attention over an int8 cache [2, Hkv, num_blocks, block_size, D + KV_SCALE_BYTES]
 * (each row's D int8 values, then its float32 scale); q and out in `dtype`. */
int mm_decode_attention_i8(const void* q, const int8_t* cache, void* out, int dtype,
                           const int64_t* table, const int64_t* key0, const int64_t* context,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                           int64_t width, int64_t num_blocks, int64_t block_size, int64_t window,
                           float scale, float softcap, int threads) {
    if (dim > CHUNK_FLOATS) return 2;
    ON_TEAM(threads, decode_attention(q, cache, out, dtype, 1, table, key0, context, batch,
                                      heads, kv_heads, dim, width, num_blocks, block_size, window,
                                      scale, softcap));
}

/* A row x [dim] in `dt` as int8 and its float32 scale (models/layers/kv_quant.py's
 * quantize_rows, to the byte): s = max|x| / 127, q = rint(x / s). */
void mm_quantize_kv_row(const void* x, int dt, int64_t offset, int64_t dim, int8_t* row) {
    float top = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        const float a = fabsf(load_x(x, dt, offset + d));
        top = a > top ? a : top;
    }
    const float s = top / 127.0f, divisor = s > 0.0f ? s : 1.0f;
    for (int64_t d = 0; d < dim; d++) {
        float v = rintf(load_x(x, dt, offset + d) / divisor);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        row[d] = (int8_t)v;
    }
    memcpy(row + dim, &s, sizeof(float));
}
