/* One decode step of the gated delta rule (Gated DeltaNet linear attention) for a batch of
 * sequences, each state [dk, dv] float32 updated in place in the pool where it lives (no gather
 * and scatter of the states): with d = exp(g), for every head,
 *     S <- d S;   u = beta (v - S^T k);   S <- S + k u^T;   o = S^T q
 * in the reference's order of operations. The state is read twice: once for S^T k, once to
 * update it and read o in the same pass. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* q, k [batch, heads, dk] and v, out [batch, heads, dv] float32 (q L2-normalized and scaled,
 * k L2-normalized); g, beta [batch, heads]; states [slots, heads, dk, dv]; slots [batch].
 * Returns 0, or 1 when dv exceeds DELTA_MAX_DV. */
int mm_delta_rule_step(const float* q, const float* k, const float* v, const float* g,
                       const float* beta, float* states, const int64_t* slots, float* out,
                       int64_t batch, int64_t heads, int64_t dk, int64_t dv, int threads) {
    if (dv > DELTA_MAX_DV) return 1;
    _Pragma("omp parallel for collapse(2) num_threads(threads) schedule(static)")
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t bh = b * heads + h;
            float* s = states + (slots[b] * heads + h) * dk * dv;
            const float* kb = k + bh * dk;
            const float* qb = q + bh * dk;
            const float decay = expf(g[bh]), rate = beta[bh];
            float update[DELTA_MAX_DV], o[DELTA_MAX_DV];
            for (int64_t j = 0; j < dv; j++) update[j] = 0.0f, o[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {  /* S^T k, of the decayed state */
                const float* row = s + i * dv;
                const float ki = kb[i];
                _Pragma("omp simd")
                for (int64_t j = 0; j < dv; j++) update[j] += row[j] * decay * ki;
            }
            const float* vb = v + bh * dv;
            _Pragma("omp simd")
            for (int64_t j = 0; j < dv; j++) update[j] = (vb[j] - update[j]) * rate;
            for (int64_t i = 0; i < dk; i++) {  /* the update, and o from the new state */
                float* row = s + i * dv;
                const float ki = kb[i], qi = qb[i];
                _Pragma("omp simd")
                for (int64_t j = 0; j < dv; j++) {
                    const float next = row[j] * decay + ki * update[j];
                    row[j] = next;
                    o[j] += next * qi;
                }
            }
            float* ob = out + bh * dv;
            for (int64_t j = 0; j < dv; j++) ob[j] = o[j];
        }
    }
    return 0;
}
