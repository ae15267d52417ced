/* What the sources of the native library share: dtype codes (models/kernels/native.py's DTYPES), element
 * conversions, and the kernels of kernels.c that others call (see that file for what each
 * computes). */
#ifndef MM_NATIVE_KERNELS_H
#define MM_NATIVE_KERNELS_H

#include <stdint.h>
#include <string.h>

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_I8 2
#define I4_BLOCK_N 64 /* our int4 pack interleaves output channels in blocks of 64 */

/* ---- element conversions shared by the sources ---- */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as PyTorch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : rounded;  /* NaN stays NaN (vectorizes) */
}

/* n values of dtype `dt` at src + at -> float32 dst (one loop per dtype, so that it vectorizes) */
static inline void load_row(float* dst, const void* src, int dt, int64_t at, int64_t n) {
    if (dt == DTYPE_F32) {
        memcpy(dst, (const float*)src + at, sizeof(float) * (size_t)n);
    } else {
        const uint16_t* h = (const uint16_t*)src + at;
        _Pragma("omp simd")
        for (int64_t j = 0; j < n; j++) dst[j] = bf16_to_f32(h[j]);
    }
}

/* float32 src -> n values of dtype `dt` at dst + at (rounded to nearest even) */
static inline void store_row(void* dst, const float* src, int dt, int64_t at, int64_t n) {
    if (dt == DTYPE_F32) {
        memcpy((float*)dst + at, src, sizeof(float) * (size_t)n);
    } else {
        uint16_t* h = (uint16_t*)dst + at;
        _Pragma("omp simd")
        for (int64_t j = 0; j < n; j++) h[j] = f32_to_bf16(src[j]);
    }
}

static inline float load_x(const void* x, int dt, int64_t i) {
    return dt == DTYPE_F32 ? ((const float*)x)[i] : bf16_to_f32(((const uint16_t*)x)[i]);
}

static inline void store(void* y, int dt, int64_t i, float v) {
    if (dt == DTYPE_F32) ((float*)y)[i] = v;
    else ((uint16_t*)y)[i] = f32_to_bf16(v);
}

/* ---- AVX-512 helpers shared by the sources ---- */

#if defined(__AVX512F__)
#include <immintrin.h>
#if defined(__AVX512BW__)
/* 32 int8 at q -> float32 (exact): lo = q[0 .. 15], hi = q[16 .. 31]. */
static inline void i8x32_to_f32(const int8_t* q, __m512* lo, __m512* hi) {
    const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void*)q));
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
}
#endif

/* Transposes 16 rows of 16 float32 in place (v[i] lane j <-> v[j] lane i). */
static inline void transpose16(__m512 v[16]) {
    __m512 a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        a[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    /* per 128-bit lane L, b[4i + j] holds rows 4i .. 4i + 3 at column 4L + j */
    for (int i = 0; i < 16; i += 4) {
        const __m512d a0 = _mm512_castps_pd(a[i]), a1 = _mm512_castps_pd(a[i + 1]);
        const __m512d a2 = _mm512_castps_pd(a[i + 2]), a3 = _mm512_castps_pd(a[i + 3]);
        b[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
        b[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
        b[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
        b[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
    }
    for (int j = 0; j < 4; j++) {  /* gather lane L of b[j], b[4 + j], b[8 + j], b[12 + j] */
        const __m512 s0 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0x88);
        const __m512 s1 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0xDD);
        const __m512 s2 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0x88);
        const __m512 s3 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0xDD);
        v[j] = _mm512_shuffle_f32x4(s0, s2, 0x88);
        v[4 + j] = _mm512_shuffle_f32x4(s1, s3, 0x88);
        v[8 + j] = _mm512_shuffle_f32x4(s0, s2, 0xDD);
        v[12 + j] = _mm512_shuffle_f32x4(s1, s3, 0xDD);
    }
}
#endif

/* ---- kernels ---- */

int mm_linear_f32(const void* x, int x_dtype, const float* w, const uint16_t* scales, void* y,
                  int64_t m, int64_t n, int64_t k, int threads);
int mm_linear_bf16(const void* x, int x_dtype, const uint16_t* w, const uint16_t* scales,
                   void* y, int64_t m, int64_t n, int64_t k, int threads);
int mm_linear_i8(const void* x, int x_dtype, const int8_t* w, const uint16_t* scales, void* y,
                 int64_t m, int64_t n, int64_t k, int threads);
int mm_linear_i4(const void* x, int x_dtype, const uint8_t* w, const uint16_t* sz, void* y,
                 int64_t m, int64_t n, int64_t k, int64_t group, int generic, int threads);
int mm_rms_norm(const void* x, const void* delta, void* sum, const void* w, void* out, int dt,
                int64_t rows, int64_t dim, float eps, int mode);
void mm_rotary(const void* x, const void* cos, const void* sin, void* out, int dt,
               int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride);
void mm_silu_mul(const void* gate_up, void* out, int dt, int64_t rows, int64_t inner);
int mm_decode_attention(const void* q, const void* cache, void* out, int dtype,
                        const int64_t* table, const int64_t* key0, const int64_t* context,
                        int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t width, int64_t num_blocks, int64_t block_size, int64_t window,
                        float scale, float softcap, int threads);
void mm_dequantize_i4_block(const uint8_t* w, const uint16_t* sz, void* out, int out_dtype,
                            int64_t ldo, int64_t n, int64_t k, int64_t group, int64_t b,
                            int64_t g0, int64_t g1);

#endif
