/* A linear layer as the whole-step calls take it (mm_linear_desc): run through the kernel of its
 * weight's format (models/kernels/cpu/linear_*.c, ggml_blocks.c), the bias added once after.
 * Kept out of kernels.h, which only declares it, so that the header calls no kernel. */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* y [m, n] = x [m, k] . W^T (+ bias), through the kernel of the weight's format. `team`: called
 * by every thread of a team (mm_decode_layers), which syncs on it after the call; else NULL. */
int run_linear(const mm_linear_desc* l, const void* x, void* y, int64_t m, int dt, int threads,
               mm_team* team) {
    int status = 0;
    int64_t n = l->n;
    if (l->format == FORMAT_GGML) {  /* each part into its columns of y */
        n = 0;
        for (const mm_linear_desc* p = l; p != NULL; p = p->next) n += p->n;
        const size_t elem = dt == DTYPE_F32 ? 4 : 2;
        int64_t first = 0;
        /* every part called by every thread of a team, even after a failure (each meets the
         * part's barriers) */
        for (const mm_linear_desc* p = l; p != NULL; first += p->n, p = p->next) {
            const int s = mm_ggml_linear(x, dt, p->weight, p->group, (char*)y + first * elem, n,
                                         m, p->n, p->k, (int)p->digits, 0, threads);
            status = status ? status : s;
        }
    } else if (l->format == FORMAT_INT4)
        status = mm_linear_i4(x, dt, l->weight, l->scales, y, m, l->n, l->k, l->group, 0,
                              threads);
    else if (l->format == FORMAT_INT8)
        status = mm_linear_i8(x, dt, l->weight, l->scales, l->group, y, m, l->n, l->k,
                              threads);
    else if (dt == DTYPE_F32)
        status = mm_linear_f32(x, dt, l->weight, NULL, y, m, l->n, l->k, threads);
    else
        status = mm_linear_bf16(x, dt, l->weight, NULL, y, m, l->n, l->k, threads);
    if (l->bias != NULL && team != NULL) {
        team_sync(team);  /* every thread's rows written */
        if (TEAM_RANK() == 0) add_into(y, l->bias, dt, m * n, n);
    } else if (l->bias != NULL && status == 0) {
        add_into(y, l->bias, dt, m * n, n);
    }
    return status;
}
