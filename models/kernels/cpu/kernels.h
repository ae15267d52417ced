/* What the sources of the native library share: dtype codes, element conversions, helpers, and
 * the library's interface (every exported function, with the structs and codes its callers
 * pass), which models/kernels/native_interface.py mirrors for Python. */
#ifndef MM_NATIVE_KERNELS_H
#define MM_NATIVE_KERNELS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* What the variant being compiled has (models/kernels/cpu_variants.py), named once. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define MM_AVX512_BF16 1 /* VDPBF16PS */
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MM_AVX512_VNNI 1 /* VPDPBUSD */
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define MM_AVX2 1
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
#define MM_NEON 1
#endif
#if defined(MM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define MM_NEON_DOT 1 /* SDOT / UDOT */
#endif
#if defined(MM_AVX512_BF16) || defined(MM_AVX512_VNNI) || defined(MM_AVX2)
#include <immintrin.h>
#endif
#ifdef MM_NEON
#include <arm_neon.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#define IN_TEAM() omp_in_parallel()
#define TEAM_SIZE() omp_get_num_threads()
#define TEAM_RANK() omp_get_thread_num()
#else
#define IN_TEAM() 0
#define TEAM_SIZE() 1
#define TEAM_RANK() 0
#endif

/* The row loop of a parallel kernel is an orphaned `omp for ... nowait`, run by whichever team
 * calls the kernel's body: the caller's, when the call comes from inside a parallel region (a
 * decode step runs all of its layers on one team, mm_decode_layers, which waits for the loop's
 * end at its own barrier, team_sync), else `threads` new threads (joined at the region's end).
 * A body keeps what it allocates per thread and reaches its loop on every thread even when an
 * allocation failed (skipping the work), so that the threads meet at every barrier. The last
 * statement of a kernel's entry point: -> the body's status (nonzero if it failed on any thread
 * of a new team). */
#define ON_TEAM(threads, CALL)                                                                 \
    if (IN_TEAM() || (threads) <= 1) return (CALL);                                            \
    int failed_ = 0;                                                                           \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        const int status_ = (CALL);                                                            \
        if (status_) {                                                                         \
            _Pragma("omp atomic write")                                                        \
            failed_ = status_;                                                                 \
        }                                                                                      \
    }                                                                                          \
    return failed_

/* The threads a kernel call that reads `weight_bytes` of weights for each of `rows` rows takes:
 * a new team's start and its end cost microseconds each, and far more when another thread of
 * the process holds a core for a moment (a front end's event loop), where the whole team waits
 * at the end for its slowest thread; a call whose work fits in a core's cache is done before a
 * second thread would pay for itself, so it runs on the calling thread alone. */
extern int64_t mm_solo_bytes; /* that fit: rows x weight bytes under it (mm_set_solo_bytes) */
static inline int team_threads(int threads, int64_t rows, int64_t weight_bytes) {
    return rows * weight_bytes < mm_solo_bytes ? 1 : threads;
}

/* A barrier on which the threads of a team spin. OpenMP's own barriers sleep in the kernel
 * under OMP_WAIT_POLICY=passive (the policy two libraries in one process need), and each
 * wake-up costs tens of microseconds, where a decode step meets a barrier after every kernel.
 * Zeroed before the parallel region; every thread of the team calls team_sync alike. */
typedef struct {
    int arrived, phase; /* read and written only through __atomic builtins */
} mm_team;

static inline void team_sync(mm_team* t) {
    const int size = TEAM_SIZE();
    const int phase = __atomic_load_n(&t->phase, __ATOMIC_ACQUIRE);
    if (__atomic_fetch_add(&t->arrived, 1, __ATOMIC_ACQ_REL) == size - 1) {
        __atomic_store_n(&t->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&t->phase, phase + 1, __ATOMIC_RELEASE);  /* after the reset */
        return;
    }
    while (__atomic_load_n(&t->phase, __ATOMIC_ACQUIRE) == phase) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ volatile("yield");
#endif
    }
}

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

/* rows [M, K] of dtype `dt` -> float32 (a copy when not float32 already; NULL if out of memory) */
static inline float* as_f32(const void* x, int dt, int64_t n, int* owned) {
    *owned = dt != DTYPE_F32;
    if (!*owned) return (float*)x;
    float* out = malloc(sizeof(float) * (size_t)n);
    if (out != NULL) load_row(out, x, dt, 0, n);
    return out;
}

/* exp(x) for x <= 0 (a softmax's shifted scores), within 2 ulp of expf: x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial, 2^n from the exponent bits. Plain
 * arithmetic, so loops over it vectorize (libm's expf is a call per element). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(x * 1.44269504f);  /* nearest (roundf would not vectorize) */
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* The portable matrix-vector linear, one instantiation per weight type (LOAD(w, j): element j
 * of a weight row as float; `scales`: one bfloat16 per output channel, or NULL). Each dot
 * product is kept as MV_LANES partial sums, which the compiler turns into several independent
 * vector accumulators whatever the vector width (a single sum would wait on each multiply-add's
 * latency). */
#define MV_LANES 64
#define LINEAR_PLAIN(NAME, WTYPE, LOAD)                                                        \
    static int NAME(const void* x, int x_dtype, const WTYPE* w, const uint16_t* scales,       \
                    void* y, int64_t m, int64_t n, int64_t k) {                                \
        int owned;                                                                             \
        const float* xf = as_f32(x, x_dtype, m * k, &owned);                                   \
        _Pragma("omp for schedule(static) nowait")                                             \
        for (int64_t r = 0; r < n; r++) {                                                      \
            if (xf == NULL) continue;                                                          \
            const WTYPE* wr = w + r * k;                                                       \
            const float scale = scales ? bf16_to_f32(scales[r]) : 1.0f;                        \
            for (int64_t i = 0; i < m; i++) {                                                  \
                const float* xr = xf + i * k;                                                  \
                float part[MV_LANES] = {0};                                                    \
                int64_t j = 0;                                                                 \
                for (; j + MV_LANES <= k; j += MV_LANES) {                                     \
                    prefetch_ahead(wr + j, MV_LANES * (int)sizeof(WTYPE));                     \
                    _Pragma("omp simd")                                                        \
                    for (int l = 0; l < MV_LANES; l++) part[l] += xr[j + l] * LOAD(wr, j + l); \
                }                                                                              \
                float acc = 0.0f;                                                              \
                for (; j < k; j++) acc += xr[j] * LOAD(wr, j);                                 \
                for (int l = 0; l < MV_LANES; l++) acc += part[l];                             \
                store(y, x_dtype, i * n + r, acc * scale);                                     \
            }                                                                                  \
        }                                                                                      \
        if (owned) free((void*)xf);                                                            \
        return xf == NULL;                                                                     \
    }
#define LOAD_F32(w, j) (w)[j]
#define LOAD_BF16(w, j) bf16_to_f32((w)[j])
#define LOAD_I8(w, j) ((float)(w)[j])

/* Weight bytes a streaming kernel asks for ahead of where it reads: from memory, the hardware
 * prefetchers alone left the AVX2 int8 loop (8-byte loads) at a third of the bandwidth. */
#define PREFETCH_AHEAD 2048
/* Prefetches the cache lines of `bytes` bytes at p + PREFETCH_AHEAD. */
static inline void prefetch_ahead(const void* p, int bytes) {
    for (int b = 0; b < bytes; b += 64)
        __builtin_prefetch((const char*)p + PREFETCH_AHEAD + b, 0, 3);
}

/* ---- the vector matrix-vector linear (AVX2 / NEON), per weight type ---- */

#if defined(MM_AVX2)
static inline float hsum8(__m256 v);
/* x [M, K] float32 . W[N, K]^T: per output channel, up to three rows of x at a time (a
 * verify's rows share each converted weight vector; 12 accumulators and the weights fill the
 * 16 registers), each dot product in four accumulators of 8 (latency-bound chains otherwise),
 * 32 weights per step converted in registers by LOAD8(w, j) (8 weights from element j as
 * __m256). Each row's sums are the same whatever the rows beside it. */
#define LINEAR_VEC(NAME, WTYPE, LOAD8)                                                         \
    static inline __attribute__((always_inline)) void NAME##_rows(                            \
        const float* x, int64_t k, const WTYPE* wr, float scale, float* s, const int R) {     \
        const int64_t body = k / 32 * 32;                                                      \
        __m256 a[3][4];                                                                        \
        for (int i = 0; i < R; i++)                                                            \
            for (int q = 0; q < 4; q++) a[i][q] = _mm256_setzero_ps();                         \
        for (int64_t j = 0; j < body; j += 32) {                                               \
            prefetch_ahead(wr + j, 32 * (int)sizeof(WTYPE));                                   \
            for (int q = 0; q < 4; q++) {                                                      \
                const __m256 wv = LOAD8(wr, j + 8 * q);                                        \
                for (int i = 0; i < R; i++)                                                    \
                    a[i][q] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * k + j + 8 * q),      \
                                              a[i][q]);                                        \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < R; i++) {                                                          \
            float t = hsum8(_mm256_add_ps(_mm256_add_ps(a[i][0], a[i][1]),                     \
                                          _mm256_add_ps(a[i][2], a[i][3])));                   \
            for (int64_t j = body; j < k; j++) t += x[i * k + j] * (float)LOAD_SCALAR(wr, j);  \
            s[i] = t * scale;                                                                  \
        }                                                                                      \
    }                                                                                          \
    static int NAME(const void* x, int x_dtype, const WTYPE* w, const uint16_t* scales,       \
                    void* y, int64_t m, int64_t n, int64_t k) {                                \
        int owned;                                                                             \
        const float* xf = as_f32(x, x_dtype, m * k, &owned);                                   \
        _Pragma("omp for schedule(static) nowait")                                             \
        for (int64_t r = 0; r < n; r++) {                                                      \
            if (xf == NULL) continue;                                                          \
            const WTYPE* wr = w + r * k;                                                       \
            const float scale = scales ? bf16_to_f32(scales[r]) : 1.0f;                        \
            for (int64_t i0 = 0; i0 < m; i0 += 3) {                                            \
                const float* x0 = xf + i0 * k;                                                 \
                float s[3];                                                                    \
                const int rows = m - i0 < 3 ? (int)(m - i0) : 3;                               \
                if (rows == 3) NAME##_rows(x0, k, wr, scale, s, 3);                            \
                else if (rows == 2) NAME##_rows(x0, k, wr, scale, s, 2);                       \
                else NAME##_rows(x0, k, wr, scale, s, 1);                                      \
                for (int i = 0; i < rows; i++) store(y, x_dtype, (i0 + i) * n + r, s[i]);      \
            }                                                                                  \
        }                                                                                      \
        if (owned) free((void*)xf);                                                            \
        return xf == NULL;                                                                     \
    }

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#define LOAD8_F32(w, j) _mm256_loadu_ps((w) + (j))
#define LOAD8_BF16(w, j)                                                                       \
    _mm256_castsi256_ps(_mm256_slli_epi32(                                                     \
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((w) + (j)))), 16))
#define LOAD8_I8(w, j)                                                                         \
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)((w) + (j)))))
#elif defined(MM_NEON)
/* The same for NEON: 4 lanes, four accumulators per row of x, two rows at a time. */
#define LINEAR_VEC(NAME, WTYPE, LOAD4)                                                         \
    static int NAME(const void* x, int x_dtype, const WTYPE* w, const uint16_t* scales,       \
                    void* y, int64_t m, int64_t n, int64_t k) {                                \
        int owned;                                                                             \
        const float* xf = as_f32(x, x_dtype, m * k, &owned);                                   \
        const int64_t body = k / 16 * 16;                                                      \
        _Pragma("omp for schedule(static) nowait")                                             \
        for (int64_t r = 0; r < n; r++) {                                                      \
            if (xf == NULL) continue;                                                          \
            const WTYPE* wr = w + r * k;                                                       \
            const float scale = scales ? bf16_to_f32(scales[r]) : 1.0f;                        \
            for (int64_t i0 = 0; i0 < m; i0 += 2) {                                            \
                const int two = i0 + 1 < m;                                                    \
                const float* x0 = xf + i0 * k;                                                 \
                const float* x1 = two ? x0 + k : x0;                                           \
                float32x4_t a[4], b[4];                                                        \
                for (int q = 0; q < 4; q++) a[q] = b[q] = vdupq_n_f32(0.0f);                   \
                for (int64_t j = 0; j < body; j += 16) {                                       \
                    prefetch_ahead(wr + j, 16 * (int)sizeof(WTYPE));                           \
                    for (int q = 0; q < 4; q++) {                                              \
                        const float32x4_t wv = LOAD4(wr, j + 4 * q);                           \
                        a[q] = vfmaq_f32(a[q], wv, vld1q_f32(x0 + j + 4 * q));                 \
                        b[q] = vfmaq_f32(b[q], wv, vld1q_f32(x1 + j + 4 * q));                 \
                    }                                                                          \
                }                                                                              \
                float s0 = vaddvq_f32(vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3]))); \
                float s1 = vaddvq_f32(vaddq_f32(vaddq_f32(b[0], b[1]), vaddq_f32(b[2], b[3]))); \
                for (int64_t j = body; j < k; j++) {                                           \
                    const float wv = (float)LOAD_SCALAR(wr, j);                                \
                    s0 += x0[j] * wv, s1 += x1[j] * wv;                                        \
                }                                                                              \
                store(y, x_dtype, i0 * n + r, s0 * scale);                                     \
                if (two) store(y, x_dtype, (i0 + 1) * n + r, s1 * scale);                      \
            }                                                                                  \
        }                                                                                      \
        if (owned) free((void*)xf);                                                            \
        return xf == NULL;                                                                     \
    }
#define LOAD8_F32(w, j) vld1q_f32((w) + (j))
#define LOAD8_BF16(w, j) vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((w) + (j)), 16))
#define LOAD8_I8(w, j)                                                                         \
    vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8((w) + (j))))))
#endif
/* One weight as float, whatever its type (the tails of LINEAR_VEC). */
#define LOAD_SCALAR(w, j) _Generic((w)[0], uint16_t: bf16_to_f32((w)[j]), default: (w)[j])

/* Inputs [first, first + len) of an int8 row q (q points at input `first`) whose bfloat16
 * scales, one per `group` inputs, start at sc: each widened to float32 times its group's scale
 * (exact: an 8-bit q times a bfloat16 scale), run by run within a group. */
static inline void widen_i8_grouped(const int8_t* q, const uint16_t* sc, int64_t group,
                                    int64_t first, int64_t len, float* out) {
    for (int64_t j = 0; j < len;) {
        const int64_t end = (first + j) / group * group + group - first;
        const int64_t stop = end < len ? end : len;
        const float s = bf16_to_f32(sc[(first + j) / group]);
        _Pragma("omp simd")
        for (int64_t p = j; p < stop; p++) out[p] = (float)q[p] * s;
        j = stop;
    }
}

/* ---- AVX-512 helpers shared by the sources ---- */

#if defined(__AVX512F__)
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

#ifdef MM_AVX512_BF16
/* 32 float32 (a, b: 16 each) stored at out + at as float32, or as bfloat16 rounded to nearest
 * even (as f32_to_bf16, NaNs aside) */
static inline void store_f32x32(void* out, int out_dtype, int64_t at, __m512 a, __m512 b) {
    if (out_dtype == DTYPE_F32) {
        _mm512_storeu_ps((float*)out + at, a), _mm512_storeu_ps((float*)out + at + 16, b);
    } else {
        _mm512_storeu_si512((uint16_t*)out + at, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}
#endif

/* ---- the library's interface ----
 * Every function the library exports is declared here, with the structs and codes its callers
 * pass: models/kernels/native_interface.py mirrors this section (tests/test_native_bindings.py
 * compares the two), and each source's definition is checked against its prototype here. */

#define FORMAT_DENSE 0 /* the weight in the model dtype */
#define FORMAT_INT8 1  /* int8, bfloat16 scales [n, k / group] (group k: per channel) */
#define FORMAT_INT4 2  /* our int4 pack, bfloat16 scales and zeros [k / group, n, 2] */
#define FORMAT_GGML 3  /* a GGUF file's blocks [n, row bytes], group: ggml's type code */

typedef struct { /* a linear layer as the calls that run several take it */
    int32_t format, group;
    int64_t n, k;
    const void* weight;
    const void* scales;
    const void* bias; /* [n of the whole chain] in the model dtype, or NULL */
    const void* next; /* the mm_linear_desc of the next output channels (a weight stored in
                         parts of different ggml types: FORMAT_GGML only), or NULL */
    int64_t digits;   /* FORMAT_GGML: int8 digits per input of x (1 or 2: mm_ggml_linear) */
} mm_linear_desc;

const char* mm_variant(void); /* the variant this library was compiled as */
void mm_set_solo_bytes(int64_t bytes); /* team_threads' bound (0: every call on a team) */

/* small_ops.c */
void mm_argmax(const float* x, int64_t rows, int64_t n, int64_t* out);
double mm_read_sum(const float* x, int64_t n, int threads);
#define NORM_FLOAT32 0     /* mm_rms_norm's modes: normed * w in float32 */
#define NORM_REDUCED 1     /* w * dtype(normed) */
#define NORM_UNIT_OFFSET 2 /* dtype(normed * (1 + w)) */
int mm_rms_norm(const void* x, const void* delta, void* sum, const void* w, void* out, int dt,
                int64_t rows, int64_t dim, float eps, int mode);
void mm_rotary(const void* x, const void* cos, const void* sin, void* out, int dt,
               int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride);
void mm_silu_mul(const void* gate_up, void* out, int dt, int64_t rows, int64_t inner);
#define ACT_SIGMOID 0 /* mm_activation's kinds */
#define ACT_SILU 1
#define ACT_SOFTPLUS 2
#define ACT_EXP 3
#define ACT_TANH 4
#define ACT_GELU_TANH 5
#define ACT_GELU 6
void mm_activation(const void* x, void* out, int dt, int64_t n, int kind);
void mm_act_mul(const void* gate_up, void* out, int dt, int64_t rows, int64_t inner, int kind);

/* linear_dense.c, linear_int8.c, linear_int4.c: the matrix-vector linears */
int mm_linear_f32(const void* x, int x_dtype, const float* w, const uint16_t* scales, void* y,
                  int64_t m, int64_t n, int64_t k, int threads);
int mm_linear_bf16(const void* x, int x_dtype, const uint16_t* w, const uint16_t* scales,
                   void* y, int64_t m, int64_t n, int64_t k, int threads);
int mm_linear_i8(const void* x, int x_dtype, const int8_t* w, const uint16_t* scales,
                 int64_t group, void* y, int64_t m, int64_t n, int64_t k, int threads);
int mm_int8_group_ok(int64_t k, int64_t group);
void mm_dequantize_i8(const int8_t* w, const uint16_t* scales, int64_t group, void* out,
                      int out_dtype, int64_t n, int64_t k, int threads);
int mm_linear_i4(const void* x, int x_dtype, const uint8_t* w, const uint16_t* sz, void* y,
                 int64_t m, int64_t n, int64_t k, int64_t group, int generic, int threads);
void mm_dequantize_i4(const uint8_t* w, const uint16_t* sz, void* out, int out_dtype, int64_t n,
                      int64_t k, int64_t group, int64_t first, int64_t count, int threads);
void mm_dequantize_i4_block(const uint8_t* w, const uint16_t* sz, void* out, int out_dtype,
                            int64_t ldo, int64_t n, int64_t k, int64_t group, int64_t b,
                            int64_t g0, int64_t g1);

/* dot_bf16.c: the LM head of a bfloat16 x's few rows, float32 logits (2: not taken here) */
int mm_logits_bf16(const uint16_t* x, const void* w, int w_dtype, const uint16_t* scales,
                   int64_t group, float* y, int64_t m, int64_t n, int64_t k, int threads);

/* linear_rows.c, gemm_dense.c, gemm_quantized.c: the tiled products */
int mm_linear_rows(const void* x, int x_dtype, const void* w, int w_dtype,
                   const uint16_t* scales, int64_t group, void* y, int64_t m, int64_t n,
                   int64_t k, int threads);
int mm_gemm_dense(const void* x, int x_dtype, const void* w, int w_dtype,
                  const uint16_t* scales, int64_t group, void* y, int64_t m, int64_t n,
                  int64_t k, int threads);
int mm_gemm_int4(const void* x, int x_dtype, const uint8_t* w, const uint16_t* sz,
                 int64_t group, void* y, int64_t m, int64_t n, int64_t k, int threads);
#define QUANT_INT8 0 /* mm_gemm_quantized's weight formats */
#define QUANT_INT4 1
int mm_gemm_quantized_takes(int64_t n, int64_t k, int w_format, int64_t group);
int mm_gemm_quantized(const void* x, int x_dtype, const void* w, int w_format,
                      const uint16_t* scales, int64_t group, void* y, int64_t ldy, int64_t m,
                      int64_t n, int64_t k, int threads);

/* attention.c */
int mm_decode_attention(const void* q, const void* cache, void* out, int dtype,
                        const int64_t* table, const int64_t* key0, const int64_t* context,
                        int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t width, int64_t num_blocks, int64_t block_size, int64_t window,
                        float scale, float softcap, int threads);
/* A function whose float operations round as written, each on its own (no multiply-add fused
 * across statements, GCC's default): where its results must match another form's to the bit.
 * Clang fuses only within one expression (a file that needs none says so with its pragma). */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define NO_CONTRACT
#endif

#define KV_SCALE_BYTES 4 /* an int8 KV row's float32 scale, after its values */
int mm_decode_attention_i8(const void* q, const int8_t* cache, void* out, int dtype,
                           const int64_t* table, const int64_t* key0, const int64_t* context,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                           int64_t width, int64_t num_blocks, int64_t block_size, int64_t window,
                           float scale, float softcap, int threads);
void mm_quantize_kv_row(const void* x, int dt, int64_t offset, int64_t dim, int8_t* row);

/* delta_rule.c, fit_int4.c */
#define DELTA_MAX_DV 1024 /* mm_delta_rule_step's value heads, at most */
int mm_delta_rule_step(const float* q, const float* k, const float* v, const float* g,
                       const float* beta, float* states, const int64_t* slots, float* out,
                       int64_t batch, int64_t heads, int64_t dk, int64_t dv, int threads);
#define FIT_ROUNDS 3 /* mm_fit_int4's rounds from each start (also fit_int4_torch's) */
void mm_fit_int4(const float* x, int64_t groups, int64_t group, float* scale, float* low,
                 int threads);

/* ggml_blocks.c; ggml's type codes (enum ggml_type), as GGUF stores them */
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q5_0 6
#define GGML_Q5_1 7
#define GGML_Q8_0 8
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14
/* ours, not ggml's: each of the above in groups of 8 output channels (ggml_x8.c) */
#define GGML_Q4_0_X8 1002
#define GGML_Q4_1_X8 1003
#define GGML_Q5_0_X8 1006
#define GGML_Q5_1_X8 1007
#define GGML_Q8_0_X8 1008
#define GGML_Q4_K_X8 1012
#define GGML_Q5_K_X8 1013
#define GGML_Q6_K_X8 1014
int mm_ggml_takes(int type, int64_t k);
int mm_ggml_dequantize(const uint8_t* w, int type, const int64_t* ids, int64_t first,
                       int64_t rows, int64_t k, float* out, int threads);
int mm_ggml_linear_float(const void* x, int x_dtype, const uint8_t* w, int type, void* y,
                         int64_t m, int64_t n, int64_t k, int threads);
int mm_ggml_linear(const void* x, int x_dtype, const uint8_t* w, int type, void* y, int64_t ldy,
                   int64_t m, int64_t n, int64_t k, int digits, int generic, int threads);

/* Row x [k] (a multiple of `group`: 32 or more, a multiple of 32) in int8 digits per group,
 * step d = max|x| / 127: first digits h and, where l is not NULL, second ones (step d / 256),
 * x' = d (h + l / 256). sums [k / 32 * 4]: per 32 inputs the unit dx (d, or d / 256 with two
 * digits), xs, and per 16 xs16 (the sums of x'). The ggml decode path's activations and the
 * int8 KV cache's queries (ggml_blocks.c). */
void mm_digits_row(const float* x, int64_t k, int group, int8_t* h, int8_t* l, float* sums);

/* a row of x as the integer decode path writes it (mm_digits_row) */
typedef struct {
    const int8_t* q;    /* [k] first digits */
    const int8_t* l;    /* [k] second digits, or NULL (one digit) */
    const float* dx;    /* [k / 32] the unit of the digits' integer (q, or 256 q + l) */
    const float* xs;    /* [k / 32] */
    const float* xs16;  /* [k / 16] */
} ggml_act_row;

/* Q4_K / Q5_K's sub-block j (of 8) 6-bit scale and minimum, packed in 12 bytes */
static inline void ggml_scale_min(int j, const uint8_t* q, int* sc, int* mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* ggml_x8.c: each block type in groups of 8 output channels (GGML_*_X8) */
#define X8_CHANNELS 8
int mm_ggml_x8_stored(int type); /* an x8 type's type as stored (GGML_Q4_K ..), else 0 */
int mm_ggml_repack_takes(int type, int64_t n, int64_t k);
int mm_ggml_repack(const uint8_t* w, int type, int64_t n, int64_t k, uint8_t* out, int threads);
void mm_ggml_x8_block(const uint8_t* w, int type, int64_t nb, int64_t channel, int64_t b,
                      uint8_t* block);
void mm_ggml_x8_rows(int type, const uint8_t* group, int64_t nb, const ggml_act_row* a,
                     int rows, float* out);
/* two consecutive groups at once for 2 .. 16 rows, where this build has it (mm_ggml_x8_pairs):
 * out [rows, 16], each row's results those of mm_ggml_x8_rows */
int mm_ggml_x8_pairs(int type);
void mm_ggml_x8_rows_pair(int type, const uint8_t* g0, const uint8_t* g1, int64_t nb,
                          const ggml_act_row* a, int rows, float* out);

/* decode_layers.c, moe_experts.c: the whole-step calls */
typedef struct { /* one decoder layer */
    mm_linear_desc qkv, o, gate_up, down;
    const void* input_norm; /* [hidden] */
    const void* post_norm;  /* [hidden]: the norm before the MLP */
    const void* q_norm;     /* [head_dim], or NULL: no per-head q / k norms */
    const void* k_norm;
    void* kv_cache;         /* [2, kv_heads, num_blocks, block_size, head_dim] in the dtype, or
                               int8 rows [.., head_dim + KV_SCALE_BYTES] (kv_int8) */
    int64_t rope;           /* which of the step's cos / sin tables the layer rotates by */
    const void* attn_out_norm; /* [hidden], or NULL: the norm of the attention's output before
                                  its residual add (sandwich norms) */
    const void* mlp_out_norm;  /* [hidden], or NULL: the same for the MLP's output */
    int64_t window;            /* > 0: the layer attends to the last `window` keys only */
} mm_layer_desc;

typedef struct { /* what the layers share */
    int32_t dtype, norm_mode, threads, kv_int8; /* kv_int8: the caches hold int8 rows */
    int32_t act; /* the MLP's activation of its gate: ACT_SILU, ACT_GELU_TANH or ACT_GELU */
    float eps, scale;
    int64_t hidden, heads, kv_heads, head_dim, intermediate, num_blocks, block_size;
} mm_decoder_desc;

int mm_decode_layers(const mm_decoder_desc* d, const mm_layer_desc* layers, int64_t num_layers,
                     void* h, int64_t m, const void* const* cos, const void* const* sin,
                     const int64_t* slots, const int64_t* table, int64_t width,
                     const int64_t* key0, const int64_t* context);
int mm_moe_experts(const mm_linear_desc* gate_up, const mm_linear_desc* down,
                   int64_t num_experts, const void* x, int dt, int64_t m,
                   const int64_t* experts, const void* weights, int64_t k, void* out,
                   int threads);

/* ---- helpers of the sources that run a linear layer ---- */

/* a[i] = dtype(a[i] + b[i % period]): PyTorch's elementwise add in the dtype */
static inline void add_into(void* a, const void* b, int dt, int64_t n, int64_t period) {
    for (int64_t i = 0; i < n; i++)
        store(a, dt, i, load_x(a, dt, i) + load_x(b, dt, i % period));
}

/* linear_desc.c (internal to the whole-step calls, not part of the library's interface):
 * y [m, n] = x [m, k] . W^T (+ bias), through the kernel of the descriptor's weight format.
 * `team`: called by every thread of a team (mm_decode_layers), which syncs on it after the
 * call; else NULL. */
int run_linear(const mm_linear_desc* l, const void* x, void* y, int64_t m, int dt, int threads,
               mm_team* team);

#ifdef MM_AVX512_BF16
/* dot_bf16.c (internal, as run_linear): the body of a VDPBF16PS product of a bfloat16 x and
 * bfloat16 or int8 weights (mm_logits_bf16's arguments), y float32 or bfloat16 (y_dtype), run
 * by the calling team (an orphaned omp for); requires k and group multiples of 32. */
int dot_bf16_rows(const uint16_t* x, const void* w, int w_dtype, const uint16_t* scales,
                  int64_t group, void* y, int y_dtype, int64_t m, int64_t n, int64_t k);
#endif

#endif
