/* Paged decode attention: one query token per sequence against its keys read in place from the
 * paged cache (no gather), with sliding windows, logit soft-capping and grouped-query heads;
 * scores, softmax and the weighted sum in float32. The cache holds keys and values in the model
 * dtype, or int8 rows each followed by its float32 scale (models/layers/kv_quant.py), whose
 * scale is applied to the row's dot product and to its softmax weight: no row is widened. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define CHUNK_FLOATS 8192  /* keys (or values) converted to float32 at a time: 32 KiB, in L1 */

static inline void softmax_rows(float* scores, int64_t group, int64_t len);

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

/* One sequence and one KV head: its `group` query heads qf [group, dim] (float32) over keys
 * [lo, lo + len) -> acc [group, dim]. Inlined per head size, so that the loops over `dim` are
 * unrolled and an accumulator row stays in registers. `scores` [group, len], `rows` CHUNK_FLOATS
 * floats. */
static inline __attribute__((always_inline)) void attend_head(
    const void* cache, int dt, int64_t key_base, int64_t value_base, const int64_t* blocks,
    int64_t key0, int64_t block_size, int64_t lo, int64_t len, int64_t group, const float* qf,
    float* acc, float* scores, float* rows, float scale, float softcap, const int64_t dim) {
    const int64_t chunk = CHUNK_FLOATS / dim;
    for (int64_t c = 0; c < len; c += chunk) {
        const int64_t n = len - c < chunk ? len - c : chunk;
        gather_rows(cache, dt, key_base, blocks, key0, block_size, lo + c, n, dim, rows);
        for (int64_t g = 0; g < group; g++) {
            const float* qg = qf + g * dim;
            float* sg = scores + g * len + c;
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
                sg[t] *= scale;
                if (softcap > 0.0f) sg[t] = softcap * tanhf(sg[t] / softcap);
            }
        }
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

/* attend_head for an int8 cache: a key's score is its scale times q . row, a value row is added
 * with its softmax weight times its scale. `row_scales`: CHUNK_FLOATS / dim floats. */
static inline __attribute__((always_inline)) void attend_head_i8(
    const int8_t* cache, int64_t key_base, int64_t value_base, const int64_t* blocks,
    int64_t key0, int64_t block_size, int64_t lo, int64_t len, int64_t group, const float* qf,
    float* acc, float* scores, float* rows, float* row_scales, float scale, float softcap,
    const int64_t dim) {
    const int64_t chunk = CHUNK_FLOATS / dim;
    for (int64_t c = 0; c < len; c += chunk) {
        const int64_t n = len - c < chunk ? len - c : chunk;
        gather_rows_i8(cache, key_base, blocks, key0, block_size, lo + c, n, dim, rows,
                       row_scales);
        for (int64_t g = 0; g < group; g++) {
            const float* qg = qf + g * dim;
            float* sg = scores + g * len + c;
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
                sg[t] = s0 * row_scales[t], sg[t + 1] = s1 * row_scales[t + 1];
                sg[t + 2] = s2 * row_scales[t + 2], sg[t + 3] = s3 * row_scales[t + 3];
            }
            for (; t < n; t++) {
                const float* kr = rows + t * dim;
                float s = 0.0f;
                _Pragma("omp simd reduction(+:s)")
                for (int64_t d = 0; d < dim; d++) s += qg[d] * kr[d];
                sg[t] = s * row_scales[t];
            }
            for (t = 0; t < n; t++) {
                sg[t] *= scale;
                if (softcap > 0.0f) sg[t] = softcap * tanhf(sg[t] / softcap);
            }
        }
    }
    softmax_rows(scores, group, len);
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
