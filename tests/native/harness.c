/* A test harness for the C kernels of models/kernels/cpu/, built with the kernels into one
 * executable per variant: natively for the x86 variants, and cross-compiled for the aarch64 ones
 * and run under qemu-aarch64 (tests/test_cpu_variants.py). Each kernel runs on fixed
 * pseudo-random inputs against a reference computed here in double precision from the same
 * inputs (the weights as the kernels see them: bfloat16 / int8 / int4 values); the tolerance of
 * each check is the rounding the kernel is allowed (bfloat16 outputs, activation digits of the
 * int kernels), stated beside it. Prints one line per check ("ok" or "FAIL ...") and exits with
 * the number of failures. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

const char* mm_variant(void);
void mm_dequantize_i8(const int8_t* w, const uint16_t* scales, int64_t group, void* out,
                      int out_dtype, int64_t n, int64_t k, int threads);
void mm_dequantize_i4(const uint8_t* w, const uint16_t* sz, void* out, int out_dtype, int64_t n,
                      int64_t k, int64_t group, int64_t first, int64_t count, int threads);
void mm_argmax(const float* x, int64_t rows, int64_t n, int64_t* out);
void mm_fit_int4(const float* x, int64_t groups, int64_t group, float* scale, float* low,
                 int threads);
int mm_gemm_quantized_takes(int64_t n, int64_t k, int w_format, int64_t group);
int mm_gemm_quantized(const void* x, int x_dtype, const void* w, int w_format,
                      const uint16_t* scales, int64_t group, void* y, int64_t ldy, int64_t m,
                      int64_t n, int64_t k, int threads);
int mm_moe_experts(const mm_linear_desc* gate_up, const mm_linear_desc* down,
                   int64_t num_experts, const void* x, int dt, int64_t m,
                   const int64_t* experts, const void* weights, int64_t k, void* out,
                   int threads);
int mm_linear_rows(const void* x, int x_dtype, const void* w, int w_dtype,
                   const uint16_t* scales, int64_t group, void* y, int64_t m, int64_t n,
                   int64_t k, int threads);
int mm_gemm_dense(const void* x, int x_dtype, const void* w, int w_dtype,
                  const uint16_t* scales, int64_t group, void* y, int64_t m, int64_t n,
                  int64_t k, int threads);
int mm_gemm_int4(const void* x, int x_dtype, const uint8_t* w, const uint16_t* sz,
                 int64_t group, void* y, int64_t m, int64_t n, int64_t k, int threads);
typedef int (*tiled_fn)(const void*, int, const void*, int, const uint16_t*, int64_t, void*,
                        int64_t, int64_t, int64_t, int);
int mm_delta_rule_step(const float* q, const float* k, const float* v, const float* g,
                       const float* beta, float* states, const int64_t* slots, float* out,
                       int64_t batch, int64_t heads, int64_t dk, int64_t dv, int threads);

int mm_ggml_dequantize(const uint8_t* w, int type, const int64_t* ids, int64_t first,
                       int64_t rows, int64_t k, float* out, int threads);
int mm_ggml_linear(const void* x, int x_dtype, const uint8_t* w, int type, void* y, int64_t ldy, int64_t m,
                   int64_t n, int64_t k, int digits, int generic, int threads);

static int failures = 0;
static uint64_t state = 0x9E3779B97F4A7C15ull;

static double uniform(void) {  /* xorshift64*, in [-1, 1) */
    state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
    return (double)((state * 0x2545F4914F6CDD1Dull) >> 11) / (double)(1ull << 52) - 1.0;
}

static void* alloc(size_t bytes) {
    void* p = calloc(1, bytes);
    if (p == NULL) {
        printf("FAIL out of memory\n");
        exit(99);
    }
    return p;
}

/* values of dtype dt: x as stored (float32 or bfloat16) and as float64 */
static void fill(void* x, int dt, double* ref, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) {
        const float v = (float)(uniform() * scale);
        if (dt == DTYPE_F32) ((float*)x)[i] = v, ref[i] = v;
        else ((uint16_t*)x)[i] = f32_to_bf16(v), ref[i] = bf16_to_f32(f32_to_bf16(v));
    }
}

static double get(const void* y, int dt, int64_t i) {
    return dt == DTYPE_F32 ? ((const float*)y)[i] : bf16_to_f32(((const uint16_t*)y)[i]);
}

/* |got - want| <= atol + rtol * |want| everywhere; reports the worst excess */
static void check(const char* name, const void* y, int dt, const double* want, int64_t n,
                  double atol, double rtol) {
    double worst = 0.0;
    int64_t at = -1;
    for (int64_t i = 0; i < n; i++) {
        const double err = fabs(get(y, dt, i) - want[i]) - (atol + rtol * fabs(want[i]));
        if (err > worst || isnan(get(y, dt, i))) worst = isnan(get(y, dt, i)) ? INFINITY : err,
                                                 at = i;
    }
    if (at < 0) {
        printf("ok   %s\n", name);
    } else {
        failures++;
        printf("FAIL %s: index %lld got %.6g want %.6g\n", name, (long long)at, get(y, dt, at),
               want[at]);
    }
}

static const char* dname(int dt) { return dt == DTYPE_F32 ? "f32" : "bf16"; }

/* ---- matrix-vector linears -------------------------------------------------------------- */

static void test_dense(int w_bf16, int dt, int64_t m, int64_t n, int64_t k) {
    void* x = alloc(4 * (size_t)(m * k));
    double* xr = alloc(8 * (size_t)(m * k));
    fill(x, dt, xr, m * k, 1.0);
    void* w = alloc(4 * (size_t)(n * k));
    double* wr = alloc(8 * (size_t)(n * k));
    fill(w, w_bf16 ? DTYPE_BF16 : DTYPE_F32, wr, n * k, 0.5);
    double* want = alloc(8 * (size_t)(m * n));
    for (int64_t i = 0; i < m; i++)
        for (int64_t r = 0; r < n; r++) {
            double s = 0;
            for (int64_t j = 0; j < k; j++) s += xr[i * k + j] * wr[r * k + j];
            want[i * n + r] = s;
        }
    void* y = alloc(4 * (size_t)(m * n));
    int status = w_bf16 ? mm_linear_bf16(x, dt, w, NULL, y, m, n, k, 1)
                        : mm_linear_f32(x, dt, w, NULL, y, m, n, k, 1);
    char name[96];
    snprintf(name, sizeof name, "linear %s weights, %s x, m=%lld k=%lld",
             w_bf16 ? "bf16" : "f32", dname(dt), (long long)m, (long long)k);
    if (status) printf("FAIL %s: status %d\n", name, status), failures++;
    /* float32 sums of k products: within k * 2^-24 of each term's size; bf16 output rounding */
    check(name, y, dt, want, m * n, 1e-5 * (double)k, dt == DTYPE_F32 ? 1e-5 : 8e-3);
    free(x), free(xr), free(w), free(wr), free(want), free(y);
}

/* The register-tiled linear (linear_rows.c) and the packed-panel GEMM (gemm_dense.c), weights
 * float32, bfloat16 or int8 (w_dt): shapes with partial row tiles, channel tiles and blocks, a
 * partial chunk and a padded vector tail. */
/* int8 [n, k] (uniform q) with bfloat16 scales [n, k / group] -> w, scales, and the values the
 * kernels compute with into wr (float64) */
static uint16_t* make_int8(int8_t* w, double* wr, int64_t n, int64_t k, int64_t group) {
    uint16_t* scales = alloc(2 * (size_t)(n * (k / group)));
    for (int64_t i = 0; i < n * (k / group); i++)
        scales[i] = f32_to_bf16((float)(0.01 + 0.01 * fabs(uniform())));
    for (int64_t i = 0; i < n * k; i++) {
        w[i] = (int8_t)(uniform() * 127.0);
        wr[i] = w[i] * (double)bf16_to_f32(scales[i / k * (k / group) + i % k / group]);
    }
    return scales;
}

/* group: int8's inputs per scale (k: one per channel); unused for the dense types */
static void test_rows(const char* kernel, tiled_fn fn, int w_dt, int dt, int64_t m, int64_t n,
                      int64_t k, int64_t group) {
    void* x = alloc(4 * (size_t)(m * k));
    double* xr = alloc(8 * (size_t)(m * k));
    fill(x, dt, xr, m * k, 1.0);
    void* w = alloc(4 * (size_t)(n * k));
    double* wr = alloc(8 * (size_t)(n * k));
    uint16_t* scales = NULL;
    if (w_dt == DTYPE_I8) {
        scales = make_int8(w, wr, n, k, group);
    } else {
        fill(w, w_dt, wr, n * k, 0.5);
    }
    double* want = alloc(8 * (size_t)(m * n));
    double top = 0.0;  /* the largest term: float32 sums are within k * 2^-24 of it per term */
    for (int64_t i = 0; i < m; i++)
        for (int64_t r = 0; r < n; r++) {
            double s = 0;
            for (int64_t j = 0; j < k; j++) {
                s += xr[i * k + j] * wr[r * k + j];
                top = fabs(xr[i * k + j] * wr[r * k + j]) > top ? fabs(xr[i * k + j] * wr[r * k + j])
                                                                : top;
            }
            want[i * n + r] = s;
        }
    void* y = alloc(4 * (size_t)(m * n));
    char name[96];
    snprintf(name, sizeof name, "%s %s weights, %s x, m=%lld n=%lld k=%lld g=%lld", kernel,
             w_dt == DTYPE_I8 ? "int8" : dname(w_dt), dname(dt), (long long)m, (long long)n,
             (long long)k, (long long)group);
    if (fn(x, dt, w, w_dt, scales, group, y, m, n, k, 2))
        printf("FAIL %s: status\n", name), failures++;
    check(name, y, dt, want, m * n, 1e-6 * top * (double)k, dt == DTYPE_F32 ? 1e-5 : 8e-3);
    free(x), free(xr), free(w), free(wr), free(scales), free(want), free(y);
}

/* group: inputs per scale (k: one per channel) */
static void test_int8(int dt, int64_t m, int64_t n, int64_t k, int64_t group) {
    void* x = alloc(4 * (size_t)(m * k));
    double* xr = alloc(8 * (size_t)(m * k));
    fill(x, dt, xr, m * k, 1.0);
    int8_t* w = alloc((size_t)(n * k));
    double* wr = alloc(8 * (size_t)(n * k));
    uint16_t* scales = make_int8(w, wr, n, k, group);
    double* want = alloc(8 * (size_t)(m * n));
    double bound = 0.0;  /* the activation digits: within max|x| / 32512 of x per element */
    for (int64_t i = 0; i < m; i++)
        for (int64_t r = 0; r < n; r++) {
            double s = 0, mag = 0;
            for (int64_t j = 0; j < k; j++) s += xr[i * k + j] * wr[r * k + j],
                                             mag += fabs(wr[r * k + j]);
            want[i * n + r] = s;
            bound = mag / 32512.0 > bound ? mag / 32512.0 : bound;
        }
    void* y = alloc(4 * (size_t)(m * n));
    char name[96];
    snprintf(name, sizeof name, "linear int8 g%lld, %s x, m=%lld k=%lld", (long long)group,
             dname(dt), (long long)m, (long long)k);
    if (mm_linear_i8(x, dt, w, scales, group, y, m, n, k, 1))
        printf("FAIL %s: status\n", name), failures++;
    check(name, y, dt, want, m * n, bound + 1e-5 * (double)k, dt == DTYPE_F32 ? 1e-5 : 8e-3);
    free(x), free(xr), free(w), free(wr), free(scales), free(want), free(y);
}

/* our int4 pack: byte (b, s, d, j) = q[64b + d][4s + j] | q[64b + 32 + d][4s + j] << 4 */
static void pack_int4(const uint8_t* q, uint8_t* packed, int64_t n, int64_t k) {
    for (int64_t b = 0; b < n / 64; b++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int d = 0; d < 32; d++)
                packed[b * k * 32 + (kk / 4) * 128 + 4 * d + kk % 4] = (uint8_t)(
                    q[(64 * b + d) * k + kk] | (q[(64 * b + 32 + d) * k + kk] << 4));
}

typedef struct {
    uint8_t* q;
    uint8_t* packed;
    uint16_t* sz;
    double* w; /* the dequantized values, float64 */
} Int4;

static Int4 make_int4(int64_t n, int64_t k, int64_t group) {
    Int4 t = {alloc((size_t)(n * k)), alloc((size_t)(n * k / 2)), alloc(4 * (size_t)(n * k)),
              alloc(8 * (size_t)(n * k))};
    for (int64_t i = 0; i < n * k; i++) t.q[i] = (uint8_t)((uniform() + 1.0) * 8.0) & 15;
    for (int64_t g = 0; g < k / group; g++)
        for (int64_t r = 0; r < n; r++) {
            t.sz[(g * n + r) * 2] = f32_to_bf16((float)(0.01 + 0.02 * fabs(uniform())));
            t.sz[(g * n + r) * 2 + 1] = f32_to_bf16((float)(0.05 * uniform()));
        }
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < k; j++) {
            const uint16_t* s = t.sz + ((j / group) * n + r) * 2;
            t.w[r * k + j] = fmaf((float)t.q[r * k + j], bf16_to_f32(s[0]),
                                  bf16_to_f32(s[1]) - 8.0f * bf16_to_f32(s[0]));
        }
    pack_int4(t.q, t.packed, n, k);
    return t;
}

static void free_int4(Int4 t) { free(t.q), free(t.packed), free(t.sz), free(t.w); }

/* generic: 0 the integer path, 1 its plain-C path, 2 the packed GEMM (float32 activations:
 * only summation order apart) */
static void test_int4(int dt, int64_t m, int64_t n, int64_t k, int64_t group, int generic) {
    Int4 t = make_int4(n, k, group);
    void* x = alloc(4 * (size_t)(m * k));
    double* xr = alloc(8 * (size_t)(m * k));
    fill(x, dt, xr, m * k, 1.0);
    double* want = alloc(8 * (size_t)(m * n));
    double bound = 0.0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t r = 0; r < n; r++) {
            double s = 0, mag = 0;
            for (int64_t j = 0; j < k; j++) s += xr[i * k + j] * t.w[r * k + j],
                                             mag += fabs(t.w[r * k + j]);
            want[i * n + r] = s;
            bound = mag / 32512.0 > bound ? mag / 32512.0 : bound;
        }
    void* y = alloc(4 * (size_t)(m * n));
    char name[112];
    snprintf(name, sizeof name, "%s int4 g%lld%s, %s x, m=%lld k=%lld",
             generic == 2 ? "packed GEMM" : "linear", (long long)group,
             generic == 1 ? " (plain path)" : "", dname(dt), (long long)m, (long long)k);
    const int status = generic == 2 ? mm_gemm_int4(x, dt, t.packed, t.sz, group, y, m, n, k, 2)
                                    : mm_linear_i4(x, dt, t.packed, t.sz, y, m, n, k, group,
                                                   generic, 1);
    if (status) printf("FAIL %s: status\n", name), failures++;
    if (generic == 2) bound = 0.0;
    check(name, y, dt, want, m * n, bound + 1e-5 * (double)k, dt == DTYPE_F32 ? 1e-5 : 8e-3);
    free_int4(t), free(x), free(xr), free(want), free(y);
}

static void test_dequantize(int dt) {
    const int64_t n = 128, k = 256, group = 64;
    int8_t* w8 = alloc((size_t)(n * k));
    double* want = alloc(8 * (size_t)(n * k));
    void* out = alloc(4 * (size_t)(n * k));
    char name[64];
    for (int64_t g8 = 32; g8 <= k; g8 = g8 == 128 ? k : 2 * g8) {  /* 32, 64, 128, per channel */
        uint16_t* scales = make_int8(w8, want, n, k, g8);
        mm_dequantize_i8(w8, scales, g8, out, dt, n, k, 1);
        snprintf(name, sizeof name, "dequantize int8 g%lld -> %s", (long long)g8, dname(dt));
        check(name, out, dt, want, n * k, 0.0, dt == DTYPE_F32 ? 0.0 : 4e-3);
        free(scales);
    }
    Int4 t = make_int4(n, k, group);
    mm_dequantize_i4(t.packed, t.sz, out, dt, n, k, group, 0, n / 64, 1);
    snprintf(name, sizeof name, "dequantize int4 -> %s", dname(dt));
    check(name, out, dt, t.w, n * k, 0.0, dt == DTYPE_F32 ? 0.0 : 4e-3);
    free_int4(t), free(w8), free(want), free(out);
}

/* ---- the quantized prefill GEMM ------------------------------------------------------------ */

/* format 0: int8 with `group` inputs per scale (k: per channel); 1: int4 at group 64 */
static void test_gemm_quantized(int format, int dt, int64_t group) {
    const int64_t m = 37, n = 192, k = 256;
    if (!mm_gemm_quantized_takes(n, k, format, group)) {
        printf("ok   gemm quantized %s g%lld: not built in this variant\n",
               format ? "int4" : "int8", (long long)group);
        return;
    }
    void* x = alloc(4 * (size_t)(m * k));
    double* xr = alloc(8 * (size_t)(m * k));
    fill(x, dt, xr, m * k, 1.0);
    double* wd = alloc(8 * (size_t)(n * k));
    int8_t* w8 = alloc((size_t)(n * k));
    uint16_t* scales = NULL;
    Int4 t = make_int4(n, k, 64);
    if (format == 0) scales = make_int8(w8, wd, n, k, group);
    else memcpy(wd, t.w, 8 * (size_t)(n * k));
    double* want = alloc(8 * (size_t)(m * n));
    double worst_term = 0.0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t r = 0; r < n; r++) {
            double s = 0, mag = 0;
            for (int64_t j = 0; j < k; j++) s += xr[i * k + j] * wd[r * k + j],
                                             mag += fabs(xr[i * k + j] * wd[r * k + j]);
            want[i * n + r] = s;
            worst_term = mag > worst_term ? mag : worst_term;
        }
    void* y = alloc(4 * (size_t)(m * n));
    char name[64];
    snprintf(name, sizeof name, "gemm quantized %s g%lld, %s x", format ? "int4" : "int8",
             (long long)group, dname(dt));
    if (mm_gemm_quantized(x, dt, format ? (const void*)t.packed : (const void*)w8, format,
                          format ? t.sz : scales, group, y, n, m, n, k, 1))
        printf("FAIL %s: status\n", name), failures++;
    /* the operands may be rounded to bfloat16 (2^-8 each) before exact products */
    check(name, y, dt, want, m * n, worst_term * 8e-3, 8e-3);
    free_int4(t), free(x), free(xr), free(wd), free(w8), free(scales), free(want), free(y);
}

/* ---- fused small ops ----------------------------------------------------------------------- */

static void test_rms_norm(int dt, int mode, int with_delta) {
    const int64_t rows = 3, dim = 96;
    const float eps = 1e-6f;
    void *x = alloc(4 * rows * dim), *delta = alloc(4 * rows * dim), *w = alloc(4 * dim);
    double *xr = alloc(8 * rows * dim), *dr = alloc(8 * rows * dim), *wr = alloc(8 * dim);
    fill(x, dt, xr, rows * dim, 2.0);
    fill(delta, dt, dr, rows * dim, 1.0);
    fill(w, dt, wr, dim, 1.0);
    void *sum = alloc(4 * rows * dim), *out = alloc(4 * rows * dim);
    double* want = alloc(8 * rows * dim);
    for (int64_t r = 0; r < rows; r++) {
        double h[96], sq = 0;
        for (int64_t j = 0; j < dim; j++) {
            h[j] = xr[r * dim + j] + (with_delta ? dr[r * dim + j] : 0.0);
            if (dt == DTYPE_BF16) h[j] = bf16_to_f32(f32_to_bf16((float)h[j]));
            sq += h[j] * h[j];
        }
        const double inv = 1.0 / sqrt(sq / (double)dim + eps);
        for (int64_t j = 0; j < dim; j++)
            want[r * dim + j] = h[j] * inv * (mode == 2 ? 1.0 + wr[j] : wr[j]);
    }
    if (mm_rms_norm(x, with_delta ? delta : NULL, sum, w, out, dt, rows, dim, eps, mode))
        printf("FAIL rms_norm status\n"), failures++;
    char name[64];
    snprintf(name, sizeof name, "rms_norm mode %d%s, %s", mode, with_delta ? " + residual" : "",
             dname(dt));
    check(name, out, dt, want, rows * dim, 1e-5, dt == DTYPE_F32 ? 1e-5 : 1.6e-2);
    free(x), free(delta), free(w), free(xr), free(dr), free(wr), free(sum), free(out), free(want);
}

static void test_rotary_silu(int dt) {
    const int64_t tokens = 3, heads = 2, dim = 64, half = 32;
    void *x = alloc(4 * tokens * heads * dim), *c = alloc(4 * tokens * half),
         *s = alloc(4 * tokens * half), *out = alloc(4 * tokens * heads * dim);
    double *xr = alloc(8 * tokens * heads * dim), *cr = alloc(8 * tokens * half),
           *sr = alloc(8 * tokens * half), *want = alloc(8 * tokens * heads * dim);
    fill(x, dt, xr, tokens * heads * dim, 1.0);
    fill(c, dt, cr, tokens * half, 1.0);
    fill(s, dt, sr, tokens * half, 1.0);
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t j = 0; j < half; j++) {
                const int64_t at = (t * heads + h) * dim;
                const double x1 = xr[at + j], x2 = xr[at + half + j];
                want[at + j] = x1 * cr[t * half + j] - x2 * sr[t * half + j];
                want[at + half + j] = x2 * cr[t * half + j] + x1 * sr[t * half + j];
            }
    mm_rotary(x, c, s, out, dt, tokens, heads, dim, heads * dim);
    char name[64];
    snprintf(name, sizeof name, "rotary, %s", dname(dt));
    /* bfloat16: each product rounded before the sum (as PyTorch's ops), products <= 1 */
    check(name, out, dt, want, tokens * heads * dim, dt == DTYPE_F32 ? 1e-6 : 8e-3,
          dt == DTYPE_F32 ? 1e-5 : 8e-3);
    const int64_t inner = 80;
    void* gu = alloc(4 * 2 * inner * 2);
    double* gr = alloc(8 * 2 * inner * 2);
    fill(gu, dt, gr, 2 * inner * 2, 4.0);
    for (int64_t r = 0; r < 2; r++)
        for (int64_t j = 0; j < inner; j++) {
            const double g = gr[r * 2 * inner + j];
            want[r * inner + j] = g / (1.0 + exp(-g)) * gr[r * 2 * inner + inner + j];
        }
    mm_silu_mul(gu, out, dt, 2, inner);
    snprintf(name, sizeof name, "silu_mul, %s", dname(dt));
    check(name, out, dt, want, 2 * inner, 1e-6, dt == DTYPE_F32 ? 1e-5 : 1.6e-2);
    free(x), free(c), free(s), free(out), free(xr), free(cr), free(sr), free(want), free(gu),
        free(gr);
}

/* ---- paged decode attention ---------------------------------------------------------------- */

static void test_attention(int dt, int64_t window, float softcap) {
    const int64_t batch = 2, heads = 4, kv_heads = 2, dim = 64, bs = 4, blocks = 12, width = 5;
    const int64_t context[2] = {7, 18}, key0[2] = {0, 4};
    const int64_t table[10] = {3, 1, 0, 0, 0, /* seq 1: keys from position 4 */ 5, 6, 7, 8, 9};
    const int64_t cache_n = 2 * kv_heads * blocks * bs * dim;
    void *cache = alloc(4 * cache_n), *q = alloc(4 * batch * heads * dim),
         *out = alloc(4 * batch * heads * dim);
    double *cr = alloc(8 * cache_n), *qr = alloc(8 * batch * heads * dim),
           *want = alloc(8 * batch * heads * dim);
    fill(cache, dt, cr, cache_n, 1.0);
    fill(q, dt, qr, batch * heads * dim, 1.0);
    const double scale = 0.125;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t kvh = h / (heads / kv_heads), ctx = context[b];
            int64_t lo = window > 0 && ctx > window ? ctx - window : 0;
            lo = lo < key0[b] ? key0[b] : lo;
            double scores[32], top = -INFINITY, total = 0;
            for (int64_t p = lo; p < ctx; p++) {
                const int64_t slot = table[b * width + (p - key0[b]) / bs] * bs + p % bs;
                double s = 0;
                for (int64_t d = 0; d < dim; d++)
                    s += qr[(b * heads + h) * dim + d] *
                         cr[(kvh * blocks * bs + slot) * dim + d];
                s *= scale;
                if (softcap > 0) s = softcap * tanh(s / softcap);
                scores[p - lo] = s, top = s > top ? s : top;
            }
            for (int64_t p = lo; p < ctx; p++) total += scores[p - lo] = exp(scores[p - lo] - top);
            for (int64_t d = 0; d < dim; d++) {
                double acc = 0;
                for (int64_t p = lo; p < ctx; p++) {
                    const int64_t slot = table[b * width + (p - key0[b]) / bs] * bs + p % bs;
                    acc += scores[p - lo] / total *
                           cr[((kv_heads + kvh) * blocks * bs + slot) * dim + d];
                }
                want[(b * heads + h) * dim + d] = acc;
            }
        }
    if (mm_decode_attention(q, cache, out, dt, table, key0, context, batch, heads, kv_heads, dim,
                            width, blocks, bs, window, (float)scale, softcap, 1))
        printf("FAIL attention status\n"), failures++;
    char name[80];
    snprintf(name, sizeof name, "decode attention window %lld softcap %g, %s", (long long)window,
             softcap, dname(dt));
    check(name, out, dt, want, batch * heads * dim, 1e-5, dt == DTYPE_F32 ? 1e-4 : 8e-3);
    free(cache), free(q), free(out), free(cr), free(qr), free(want);
}

/* ---- a mixture of experts' routed experts ---------------------------------------------- */

static void test_moe_experts(int dt) {
    enum { E = 5, TOP = 2, M = 3, H = 48, I = 32 };
    const int64_t experts[M * TOP] = {3, 0, 1, 3, 4, 2};  /* expert 3 serves two tokens */
    void *gu[E], *dn[E];
    double *gur[E], *dnr[E];
    mm_linear_desc gate_up[E], down[E];
    for (int e = 0; e < E; e++) {
        gu[e] = alloc(4 * 2 * I * H), gur[e] = alloc(8 * 2 * I * H);
        dn[e] = alloc(4 * H * I), dnr[e] = alloc(8 * H * I);
        fill(gu[e], dt, gur[e], 2 * I * H, 0.3);
        fill(dn[e], dt, dnr[e], H * I, 0.3);
        gate_up[e] = (mm_linear_desc){FORMAT_DENSE, 0, 2 * I, H, gu[e], NULL, NULL};
        down[e] = (mm_linear_desc){FORMAT_DENSE, 0, H, I, dn[e], NULL, NULL};
    }
    void *x = alloc(4 * M * H), *w = alloc(4 * M * TOP), *out = alloc(4 * M * H);
    double *xr = alloc(8 * M * H), *wr = alloc(8 * M * TOP), *want = alloc(8 * M * H);
    fill(x, dt, xr, M * H, 1.0);
    fill(w, dt, wr, M * TOP, 1.0);
    for (int64_t t = 0; t < M; t++)
        for (int64_t j = 0; j < TOP; j++) {
            const int64_t e = experts[t * TOP + j];
            double act[I];
            for (int64_t i = 0; i < I; i++) {
                double g = 0, u = 0;
                for (int64_t c = 0; c < H; c++)
                    g += gur[e][i * H + c] * xr[t * H + c], u += gur[e][(I + i) * H + c] * xr[t * H + c];
                act[i] = g / (1.0 + exp(-g)) * u;
            }
            for (int64_t c = 0; c < H; c++) {
                double y = 0;
                for (int64_t i = 0; i < I; i++) y += dnr[e][c * I + i] * act[i];
                want[t * H + c] += wr[t * TOP + j] * y;
            }
        }
    char name[64];
    snprintf(name, sizeof name, "moe experts, %s", dname(dt));
    if (mm_moe_experts(gate_up, down, E, x, dt, M, experts, w, TOP, out, 1))
        printf("FAIL %s: status\n", name), failures++;
    /* float32 sums; in bfloat16 every intermediate (gate_up, activation, down, scaled, sum) is
     * rounded, as the modules round them */
    check(name, out, dt, want, M * H, dt == DTYPE_F32 ? 1e-5 : 2e-2, dt == DTYPE_F32 ? 1e-4 : 4e-2);
    for (int e = 0; e < E; e++) free(gu[e]), free(gur[e]), free(dn[e]), free(dnr[e]);
    free(x), free(w), free(out), free(xr), free(wr), free(want);
}

/* ---- the gated delta rule's decode step ------------------------------------------------------ */

static void test_delta_rule(void) {
    const int64_t batch = 2, heads = 3, dk = 16, dv = 24, pool = 4;
    const int64_t slots[2] = {3, 1};
    const int64_t sn = pool * heads * dk * dv;
    float *q = alloc(4 * batch * heads * dk), *k = alloc(4 * batch * heads * dk),
          *v = alloc(4 * batch * heads * dv), *g = alloc(4 * batch * heads),
          *beta = alloc(4 * batch * heads), *s = alloc(4 * sn), *out = alloc(4 * batch * heads * dv);
    double *sr = alloc(8 * sn), *want = alloc(8 * batch * heads * dv), *scratch = alloc(8 * sn);
    for (int64_t i = 0; i < batch * heads * dk; i++) q[i] = (float)uniform(), k[i] = (float)uniform();
    for (int64_t i = 0; i < batch * heads * dv; i++) v[i] = (float)uniform();
    for (int64_t i = 0; i < batch * heads; i++)
        g[i] = (float)(-0.5 * (uniform() + 1.0)), beta[i] = (float)(0.5 * (uniform() + 1.0));
    for (int64_t i = 0; i < sn; i++) s[i] = (float)(0.1 * uniform()), sr[i] = s[i];
    memcpy(scratch, sr, 8 * (size_t)sn);
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t bh = b * heads + h;
            double* st = scratch + (slots[b] * heads + h) * dk * dv;
            const double d = exp((double)g[bh]);
            for (int64_t j = 0; j < dv; j++) {
                double mem = 0;
                for (int64_t i = 0; i < dk; i++) mem += st[i * dv + j] * d * k[bh * dk + i];
                const double u = beta[bh] * (v[bh * dv + j] - mem);
                double o = 0;
                for (int64_t i = 0; i < dk; i++) {
                    st[i * dv + j] = st[i * dv + j] * d + k[bh * dk + i] * u;
                    o += st[i * dv + j] * q[bh * dk + i];
                }
                want[bh * dv + j] = o;
            }
        }
    if (mm_delta_rule_step(q, k, v, g, beta, s, slots, out, batch, heads, dk, dv, 1))
        printf("FAIL delta rule status\n"), failures++;
    check("delta rule step: outputs", out, DTYPE_F32, want, batch * heads * dv, 1e-5, 1e-4);
    check("delta rule step: states in place", s, DTYPE_F32, scratch, sn, 1e-6, 1e-4);
    free(q), free(k), free(v), free(g), free(beta), free(s), free(out), free(sr), free(want),
        free(scratch);
}

static void test_argmax(void) {
    float x[2 * 1000];
    for (int i = 0; i < 2000; i++) x[i] = (float)uniform();
    x[517] = 3.0f, x[900] = 3.0f;  /* the first of equal maxima */
    x[1000 + 20] = NAN, x[1000 + 30] = 9.0f;  /* a NaN counts as the largest */
    int64_t out[2];
    mm_argmax(x, 2, 1000, out);
    if (out[0] == 517 && out[1] == 20) printf("ok   argmax\n");
    else printf("FAIL argmax: %lld %lld\n", (long long)out[0], (long long)out[1]), failures++;
}

/* ---- the int4 grid fit ------------------------------------------------------------------- */

/* Squared error, in double, of a group on the grid low + q * step (q nearest, in [0, 15]). */
static double grid_error(const float* x, int64_t g, double step, double low) {
    double e = 0.0;
    for (int64_t i = 0; i < g; i++) {
        double q = step > 0.0 ? nearbyint((x[i] - low) / step) : 0.0;
        q = q < 0.0 ? 0.0 : (q > 15.0 ? 15.0 : q);
        e += (q * step + low - x[i]) * (q * step + low - x[i]);
    }
    return e;
}

/* No group's fitted grid worse than its min-max grid, bell-shaped groups' clearly better in
 * all; a group of one value kept, a group of two values fitted exactly. */
static void test_fit_int4(int64_t g) {
    const int64_t groups = 200;
    float* x = alloc(sizeof(float) * groups * g);
    float *step = alloc(sizeof(float) * groups), *low = alloc(sizeof(float) * groups);
    for (int64_t r = 0; r < groups; r++) {
        const double spread = 0.1 + fabs(uniform());
        for (int64_t i = 0; i < g; i++)
            x[r * g + i] = (float)(spread * (uniform() + uniform() + uniform()));
    }
    for (int64_t i = 0; i < g; i++) x[i] = 0.25f, x[g + i] = i % 2 ? 1.5f : -0.5f;
    mm_fit_int4(x, groups, g, step, low, 2);
    double fitted = 0.0, min_max = 0.0;
    int worse = 0;
    for (int64_t r = 2; r < groups; r++) {
        const float* xr = x + r * g;
        float lo = xr[0], hi = xr[0];
        for (int64_t i = 0; i < g; i++) lo = xr[i] < lo ? xr[i] : lo, hi = xr[i] > hi ? xr[i] : hi;
        const double e = grid_error(xr, g, step[r], low[r]);
        const double e0 = grid_error(xr, g, ((double)hi - lo) / 15.0, lo);
        worse += e > e0 * (1.0 + 1e-5);
        fitted += e, min_max += e0;
    }
    const int kept = step[0] == 0.0f && low[0] == 0.25f;
    const int exact = grid_error(x + g, g, step[1], low[1]) < 1e-10;
    char name[96];
    snprintf(name, sizeof name, "int4 grid fit, group %lld", (long long)g);
    if (!worse && fitted < 0.95 * min_max && kept && exact) {
        printf("ok   %s\n", name);
    } else {
        failures++;
        printf("FAIL %s: %d groups worse than min-max, fitted / min-max %.3f, one value %d, "
               "two values %d\n", name, worse, fitted / min_max, kept, exact);
    }
    free(x), free(step), free(low);
}

/* ---- ggml blocks ------------------------------------------------------------------------ */

/* Q4_K blocks (the one type here whose q * d1 - m1 a fused multiply-add would round once) and
 * Q8_0 blocks: dequantized against each value rounded step by step through volatile floats
 * (ggml's order, no contraction: bit for bit), then the matrix-vector linear against a float64
 * product of those values. */
static void put_half(uint8_t* p, float v) {  /* a normal float16 near v (truncated) */
    uint32_t u;
    memcpy(&u, &v, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, exp = ((u >> 23) & 0xff) - 112;
    const uint16_t h = (uint16_t)(sign | (exp << 10) | ((u >> 13) & 0x3ff));
    p[0] = h & 0xff, p[1] = h >> 8;
}

static float get_half(const uint8_t* p) {  /* a normal float16's value */
    const uint32_t h = p[0] | (p[1] << 8), exp = (h >> 10) & 31;
    const uint32_t u = ((h & 0x8000u) << 16) | ((exp + 112) << 23) | ((h & 0x3ff) << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void test_ggml_blocks(int dt) {
    const int64_t n = 24, k = 512, m = 3;
    for (int type = 0; type < 2; type++) {
        const int q4k = type == 0, code = q4k ? 12 : 8; /* ggml's codes */
        const int nb = q4k ? 144 : 34, qk = q4k ? 256 : 32;
        const int64_t row = k / qk * nb;
        uint8_t* w = alloc((size_t)(n * row));
        for (int64_t i = 0; i < n * row; i++) w[i] = (uint8_t)(uniform() * 128 + 128);
        double* want = alloc(sizeof(double) * (size_t)(n * k));
        for (int64_t b = 0; b < n * k / qk; b++) {
            uint8_t* blk = w + b * nb;
            put_half(blk, (float)(0.01 + 0.02 * fabs(uniform())));
            if (q4k) put_half(blk + 2, (float)(0.003 + 0.01 * fabs(uniform())));
            const float d = get_half(blk), dmin = q4k ? get_half(blk + 2) : 0.0f;
            for (int j = 0; j < qk; j++) {
                if (!q4k) {
                    volatile float v = (float)(int8_t)blk[2 + j] * d;
                    want[b * qk + j] = v;
                    continue;
                }
                const int sub = j / 32, chunk = j / 64, high = (j / 32) % 2, l = j % 32;
                const uint8_t* sc = blk + 4;
                int s, mn;
                if (sub < 4) s = sc[sub] & 63, mn = sc[sub + 4] & 63;
                else s = (sc[sub + 4] & 0xF) | ((sc[sub - 4] >> 6) << 4),
                     mn = (sc[sub + 4] >> 4) | ((sc[sub] >> 6) << 4);
                const uint8_t q = blk[16 + 32 * chunk + l];
                volatile float d1 = d * (float)s, m1 = dmin * (float)mn;
                volatile float t = d1 * (float)(high ? q >> 4 : q & 0xF);
                volatile float v = t - m1;
                want[b * qk + j] = v;
            }
        }
        float* got = alloc(sizeof(float) * (size_t)(n * k));
        char name[64];
        snprintf(name, sizeof name, "ggml %s dequantize", q4k ? "Q4_K" : "Q8_0");
        int exact = mm_ggml_dequantize(w, code, NULL, 0, n, k, got, 2) == 0;
        for (int64_t i = 0; exact && i < n * k; i++) exact = got[i] == (float)want[i];
        if (exact) printf("ok   %s\n", name);
        else failures++, printf("FAIL %s: not bit for bit\n", name);
        void* x = alloc(sizeof(float) * (size_t)(m * k));
        double* xr = alloc(sizeof(double) * (size_t)(m * k));
        fill(x, dt, xr, m * k, 1.0);
        double* ref = alloc(sizeof(double) * (size_t)(m * n));
        /* x in two int8 digits per group (32, or 256 for Q4_K): within max|x| / 32512 */
        double digit_bound = 0;
        const int64_t group = q4k ? 256 : 32;
        for (int64_t i = 0; i < m; i++)
            for (int64_t r = 0; r < n; r++) {
                double acc = 0, bound = 0;
                for (int64_t j0 = 0; j0 < k; j0 += group) {
                    double top = 0, mass = 0;
                    for (int64_t j = j0; j < j0 + group; j++) {
                        acc += xr[i * k + j] * want[r * k + j];
                        top = fmax(top, fabs(xr[i * k + j]));
                        mass += fabs(want[r * k + j]);
                    }
                    bound += top * mass / 32512;
                }
                ref[i * n + r] = acc;
                digit_bound = fmax(digit_bound, bound);
            }
        void* y = alloc(sizeof(float) * (size_t)(m * n));
        snprintf(name, sizeof name, "ggml %s linear %s", q4k ? "Q4_K" : "Q8_0", dname(dt));
        if (mm_ggml_linear(x, dt, w, code, y, n, m, n, k, 2, 0, 2) != 0)
            failures++, printf("FAIL %s\n", name);
        else check(name, y, dt, ref, m * n, 1e-3 + digit_bound, dt == DTYPE_F32 ? 1e-5 : 1e-2);
        free(w), free(want), free(got), free(x), free(xr), free(ref), free(y);
    }
}

/* Every block type, as stored and (where this build repacks: mm_ggml_repack) in groups of 8
 * channels, at one and two digits: rows of x against random blocks, each output within the
 * digits' bound of the float64 product of x with the dequantized weight; the vector path and
 * the plain one (generic); and each row of a many-row call equal, bit for bit, to its one-row
 * call (a verify's rows sum as the decode step does). */
static void test_ggml_types(int dt) {
    static const struct { int code, qk, bytes, d, m; const char* name; } T[] = {
        {GGML_Q4_0, 32, 18, 0, -1, "Q4_0"}, {GGML_Q4_1, 32, 20, 0, 2, "Q4_1"},
        {GGML_Q5_0, 32, 22, 0, -1, "Q5_0"}, {GGML_Q5_1, 32, 24, 0, 2, "Q5_1"},
        {GGML_Q8_0, 32, 34, 0, -1, "Q8_0"}, {GGML_Q4_K, 256, 144, 0, 2, "Q4_K"},
        {GGML_Q5_K, 256, 176, 0, 2, "Q5_K"}, {GGML_Q6_K, 256, 210, 208, -1, "Q6_K"},
    };
    const int64_t n = 16, k = 512, m = 5;
    for (size_t t = 0; t < sizeof T / sizeof T[0]; t++) {
        const int64_t row = k / T[t].qk * T[t].bytes;
        uint8_t* w = alloc((size_t)(n * row));
        uint8_t* x8 = alloc((size_t)(n * row + X8_CHANNELS * 4 * k));  /* Q4_K_X8: 148 / 144 */
        for (int64_t i = 0; i < n * row; i++) w[i] = (uint8_t)(uniform() * 128 + 128);
        for (int64_t b = 0; b < n * k / T[t].qk; b++) {
            put_half(w + b * T[t].bytes + T[t].d, (float)(0.01 + 0.02 * fabs(uniform())));
            if (T[t].m >= 0)
                put_half(w + b * T[t].bytes + T[t].m, (float)(0.003 + 0.01 * fabs(uniform())));
        }
        float* deq = alloc(sizeof(float) * (size_t)(n * k));
        void* x = alloc(sizeof(float) * (size_t)(m * k));
        double* xr = alloc(sizeof(double) * (size_t)(m * k));
        fill(x, dt, xr, m * k, 1.0);
        const size_t esize = dt == DTYPE_F32 ? 4 : 2;
        void* y = alloc(sizeof(float) * (size_t)(m * n));
        void* one = alloc(sizeof(float) * (size_t)n);
        double* ref = alloc(sizeof(double) * (size_t)(m * n));
        char name[96];
        if (mm_ggml_dequantize(w, T[t].code, NULL, 0, n, k, deq, 1) != 0) {
            failures++, printf("FAIL ggml %s dequantize\n", T[t].name);
            goto done;
        }
        const int repacked = mm_ggml_repack_takes(T[t].code, n, k) &&
                             mm_ggml_repack(w, T[t].code, n, k, x8, 1) == 0;
        for (int digits = 1; digits <= 2; digits++) {
            double bound = 0;  /* per output: sum over groups of max|x| * sum |w| / unit */
            for (int64_t i = 0; i < m; i++)
                for (int64_t r = 0; r < n; r++) {
                    double acc = 0, err = 0;
                    for (int64_t j0 = 0; j0 < k; j0 += T[t].qk) {
                        double top = 0, mass = 0;
                        for (int64_t j = j0; j < j0 + T[t].qk; j++) {
                            acc += xr[i * k + j] * deq[r * k + j];
                            top = fmax(top, fabs(xr[i * k + j]));
                            mass += fabs(deq[r * k + j]);
                        }
                        err += top * mass / (digits == 2 ? 32512 : 254);
                    }
                    ref[i * n + r] = acc;
                    bound = fmax(bound, err);
                }
            for (int layout = 0; layout < 1 + repacked; layout++)
                for (int generic = 0; generic < 2; generic++) {
                    const uint8_t* wl = layout ? x8 : w;
                    const int code = T[t].code + (layout ? 1000 : 0);
                    snprintf(name, sizeof name, "ggml %s%s linear %s, %d digit%s%s", T[t].name,
                             layout ? " x8" : "", dname(dt), digits, digits == 2 ? "s" : "",
                             generic ? ", plain" : "");
                    if (mm_ggml_linear(x, dt, wl, code, y, n, m, n, k, digits, generic, 2)) {
                        failures++, printf("FAIL %s\n", name);
                        continue;
                    }
                    check(name, y, dt, ref, m * n, 1e-4 + bound, dt == DTYPE_F32 ? 1e-5 : 1e-2);
                    int same = 1;
                    for (int64_t i = 0; i < m && same; i++) {
                        if (mm_ggml_linear((const char*)x + i * k * esize, dt, wl, code, one, n,
                                           1, n, k, digits, generic, 1)) {
                            same = 0;
                            break;
                        }
                        same = memcmp((const char*)y + i * n * esize, one, n * esize) == 0;
                    }
                    if (same) printf("ok   %s: rows as one-row calls\n", name);
                    else failures++, printf("FAIL %s: a row differs from its one-row call\n",
                                            name);
                }
        }
    done:
        free(w), free(x8), free(deq), free(x), free(xr), free(y), free(one), free(ref);
    }
}

int main(void) {
    printf("variant %s\n", mm_variant());
    for (int dt = 0; dt < 2; dt++) {
        for (int w = 0; w < 2; w++) {
            test_dense(w, dt, 1, 70, 200);
            test_dense(w, dt, 5, 33, 512);
        }
        for (int w = 0; w < 3; w++) {  /* DTYPE_F32, DTYPE_BF16, DTYPE_I8 (per channel) */
            test_rows("tiled linear", mm_linear_rows, w, dt, 9, 37, 77, 77);
            test_rows("tiled linear", mm_linear_rows, w, dt, 66, 26, 520, 520);
            test_rows("packed GEMM", mm_gemm_dense, w, dt, 9, 37, 77, 77);
            test_rows("packed GEMM", mm_gemm_dense, w, dt, 250, 70, 520, 520);
        }
        /* int8 a scale per group (a chunk of 256 inputs spans several, a group of 128 two
         * chunks' worth at k = 384) */
        test_rows("tiled linear", mm_linear_rows, DTYPE_I8, dt, 9, 37, 256, 32);
        test_rows("tiled linear", mm_linear_rows, DTYPE_I8, dt, 66, 26, 384, 128);
        test_rows("packed GEMM", mm_gemm_dense, DTYPE_I8, dt, 9, 37, 320, 64);
        test_rows("packed GEMM", mm_gemm_dense, DTYPE_I8, dt, 250, 70, 384, 128);
        test_int8(dt, 1, 64, 256, 256);
        test_int8(dt, 3, 40, 192, 192);
        test_int8(dt, 2, 16, 100, 100);
        test_int8(dt, 1, 64, 256, 32);
        test_int8(dt, 3, 40, 384, 128);
        test_int8(dt, 2, 16, 192, 64);
        for (int g = 32; g <= 128; g *= 2) test_int4(dt, 1, 128, 256, g, 0);
        test_int4(dt, 3, 64, 384, 64, 0);
        test_int4(dt, 2, 64, 256, 32, 1);
        test_int4(dt, 7, 128, 640, 128, 2);
        test_int4(dt, 70, 192, 384, 32, 2);
        test_dequantize(dt);
        test_gemm_quantized(0, dt, 256);  /* int8 per channel */
        test_gemm_quantized(0, dt, 32);
        test_gemm_quantized(0, dt, 128);
        test_gemm_quantized(1, dt, 64);
        if (dt == DTYPE_F32)
            for (int64_t g = 32; g <= 128; g *= 2) test_fit_int4(g);
        for (int mode = 0; mode < 3; mode++) {
            test_rms_norm(dt, mode, 0);
            test_rms_norm(dt, mode, 1);
        }
        test_rotary_silu(dt);
        test_attention(dt, 0, 0.0f);
        test_attention(dt, 5, 0.0f);
        test_attention(dt, 0, 30.0f);
        test_moe_experts(dt);
        test_ggml_blocks(dt);
        test_ggml_types(dt);
    }
    test_argmax();
    test_delta_rule();
    printf("%d failure(s)\n", failures);
    return failures;
}
