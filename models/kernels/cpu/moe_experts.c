/* A decode step's routed experts in one call (models/kernels/native_experts.py, for
 * models/layers/moe.py at a decode's rows).
 *
 * Expert by expert in increasing index, as the modules run them: the rows of the tokens routed
 * to the expert (in token order) go through its gated MLP together (gate_up linear, silu(gate)
 * * up, down linear), each scaled by the token's routing weight and added into the token's
 * output. Every intermediate is rounded to the model dtype where the modules round it (linear
 * outputs, the activation, the scaled output, each sum) and each linear sees the rows the
 * module's would, so the result is the modules' to the bit. A step reads only its routed
 * experts' weights, each once, through the matrix-vector kernels of this folder; what the call
 * saves is the dozens of calls per layer from Python.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* gate_up / down: one descriptor per expert (num_experts). x [m, hidden]; experts [m, k]
 * (the router's: below num_experts) and weights [m, k] in the dtype ->
 * out [m, hidden]. Returns nonzero on failure (1: out of memory, else a kernel's status). */
int mm_moe_experts(const mm_linear_desc* gate_up, const mm_linear_desc* down,
                   int64_t num_experts, const void* x, int dt, int64_t m,
                   const int64_t* experts, const void* weights, int64_t k, void* out,
                   int threads) {
    const int64_t hidden = down[0].n, inter = down[0].k;
    const size_t el = dt == DTYPE_F32 ? 4 : 2;
    char* buffer = malloc(el * (size_t)(m * (2 * hidden + 3 * inter)));
    int64_t* rows = malloc(sizeof(int64_t) * (size_t)m);
    float* scale = malloc(sizeof(float) * (size_t)m);
    int status = buffer == NULL || rows == NULL || scale == NULL;
    char* xe = buffer;                                /* [r, hidden]: the expert's rows */
    char* gu = xe + el * (size_t)(m * hidden);        /* [r, 2 * inter] */
    char* act = gu + el * (size_t)(m * 2 * inter);    /* [r, inter] */
    char* y = act + el * (size_t)(m * inter);         /* [r, hidden] */
    if (status == 0) memset(out, 0, el * (size_t)(m * hidden));
    for (int64_t e = 0; e < num_experts && status == 0; e++) {
        int64_t r = 0;
        for (int64_t t = 0; t < m; t++)
            for (int64_t j = 0; j < k; j++)
                if (experts[t * k + j] == e) {
                    rows[r] = t;
                    scale[r++] = load_x(weights, dt, t * k + j);
                }
        if (r == 0) continue;
        for (int64_t i = 0; i < r; i++)
            memcpy(xe + el * (size_t)(i * hidden),
                   (const char*)x + el * (size_t)(rows[i] * hidden), el * (size_t)hidden);
        status = run_linear(&gate_up[e], xe, gu, r, dt, threads, NULL);
        if (status) break;
        mm_silu_mul(gu, act, dt, r, inter);
        status = run_linear(&down[e], act, y, r, dt, threads, NULL);
        if (status) break;
        for (int64_t i = 0; i < r; i++) {
            /* Scaled in place, then added: two passes through memory, so that the compiler
             * cannot contract the product and the sum into one multiply-add (the modules
             * round the product first, in float32 too). */
            char* yi = y + el * (size_t)(i * hidden);
            for (int64_t c = 0; c < hidden; c++) store(yi, dt, c, load_x(yi, dt, c) * scale[i]);
            add_into((char*)out + el * (size_t)(rows[i] * hidden), yi, dt, hidden, hidden);
        }
    }
    free(buffer);
    free(rows);
    free(scale);
    return status;
}
