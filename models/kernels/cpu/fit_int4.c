/* Fitting int4 groups (models/kernels/quantization.py, fit_int4): for each group of `group`
 * weights x, the step s and low end m of the grid m + q * s, q in [0, 15], nearest to x in
 * squared error that alternating rounding and least squares reach from two starting grids: the
 * min-max grid (s = range / 15, m = min) and one a step narrower (range / 16, its top clipped).
 * From each start, FIT_ROUNDS (kernels.h) times: round every weight to its nearest grid point (q), then
 * refit s and m to those q by least squares. Neither step raises the error, so the result is
 * never worse than the min-max grid; the best of that grid and the two ends is kept.
 *
 * quantization.py computes the same in PyTorch where this library is not loaded: the same steps
 * in float32, whose sums (and multiply-adds the compiler fuses) may round differently; the sums
 * of q and q * q are integers below 2^24 for groups up to 128, exact either way.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#define FIT_STARTS 2 /* steps range / 15 and range / 16 */

/* The grid point of x: q = rint((x - m) / s) clamped to [0, 15] (rint: ties to even, as
 * torch.round). */
static inline float grid_q(float x, float s, float m) {
    const float q = rintf((x - m) / s);
    return q < 0.0f ? 0.0f : (q > 15.0f ? 15.0f : q);
}

static float grid_error(const float* x, int64_t g, float s, float m) {
    float e = 0.0f;
    _Pragma("omp simd reduction(+ : e)")
    for (int64_t i = 0; i < g; i++) {
        const float d = grid_q(x[i], s, m) * s + m - x[i];
        e += d * d;
    }
    return e;
}

static void fit_group(const float* x, int64_t g, float* scale, float* low) {
    float lo = x[0], hi = x[0], sx = 0.0f;
    _Pragma("omp simd reduction(min : lo) reduction(max : hi) reduction(+ : sx)")
    for (int64_t i = 0; i < g; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
        sx += x[i];
    }
    const float range = hi - lo, n = (float)g;
    float best_s = range / 15.0f, best_m = lo;
    if (range > 0.0f) {  // else one value (or a NaN): the min-max grid
        float best_e = grid_error(x, g, best_s, best_m);
        for (int start = 0; start < FIT_STARTS; start++) {
            float s = range / (15.0f + (float)start), m = lo;
            for (int round = 0; round < FIT_ROUNDS; round++) {
                float sq = 0.0f, sqq = 0.0f, sqx = 0.0f;
                _Pragma("omp simd reduction(+ : sq, sqq, sqx)")
                for (int64_t i = 0; i < g; i++) {
                    const float q = grid_q(x[i], s, m);
                    sq += q;
                    sqq += q * q;
                    sqx += q * x[i];
                }
                const float det = n * sqq - sq * sq;  // 0 when every q is equal
                const float s1 = (n * sqx - sq * sx) / det;
                if (det > 0.0f && s1 > 0.0f) {  // else the grid stays (and would again)
                    s = s1;
                    m = (sx - s1 * sq) / n;
                }
            }
            const float e = grid_error(x, g, s, m);
            if (e < best_e) {
                best_e = e;
                best_s = s;
                best_m = m;
            }
        }
    }
    *scale = best_s;
    *low = best_m;
}

/* x [groups][group] float32 -> scale [groups], low [groups]. */
void mm_fit_int4(const float* x, int64_t groups, int64_t group, float* scale, float* low,
                 int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t i = 0; i < groups; i++) fit_group(x + i * group, group, scale + i, low + i);
}
