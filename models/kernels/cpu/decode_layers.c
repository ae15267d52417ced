/* A decoder's decode step through all of its layers in one call (models/layers/native_decode.py).
 *
 * At a decode's few rows a layer's work is a dozen small operations, and calling each from
 * Python (module call, dispatch, allocation, thread-pool wake-up) costs about as much as the
 * smaller ones compute. This runs the same kernels of this folder in the order the
 * modules run them, with the intermediate results in the model dtype as the modules keep them,
 * so that the result is the modules' to the bit (tests/test_native_decode.py). Only the layer
 * shape the modules' fused decode path takes is served: pre-norm residual layers, optionally
 * with norms of the attention's and the MLP's outputs too (sandwich norms: Gemma 3), a
 * gated MLP (SiLU or GELU), attention without soft-capping, over all keys or a sliding window
 * per layer, optional per-head q / k norms and biases.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* h [m, hidden] (the hidden states entering layer 0) becomes the states leaving the last layer.
 * cos / sin: per rope table, [m, head_dim / 2] in the dtype. slots [m]: where each token's key
 * and value go in the cache. table [m, width] (block ids), key0 [m] and context [m]: each
 * token's keys, as mm_decode_attention takes them. Returns nonzero on failure (1: out of memory,
 * else the failing kernel's status), with h partly updated. */
int mm_decode_layers(const mm_decoder_desc* d, const mm_layer_desc* layers, int64_t num_layers,
                     void* h, int64_t m, const void* const* cos, const void* const* sin,
                     const int64_t* slots, const int64_t* table, int64_t width,
                     const int64_t* key0, const int64_t* context) {
    const int dt = d->dtype, threads = d->threads;
    const int64_t hidden = d->hidden, dim = d->head_dim, hq = d->heads, hkv = d->kv_heads;
    const int64_t qkv_n = (hq + 2 * hkv) * dim, rotated = (hq + hkv) * dim;
    const size_t elem = dt == DTYPE_F32 ? 4 : 2;
    /* one allocation for every intermediate, each [m, width] in the dtype */
    const int64_t sizes[] = {hidden, qkv_n, rotated, rotated, hq * dim, hq * dim, hidden,
                             2 * d->intermediate, d->intermediate, hidden};
    enum { NORMED, QKV, QK, ROT, Q, ATTN, O, GATE_UP, ACT, MLP, PARTS };
    char* parts[PARTS];
    int64_t total = 0;
    for (int64_t i = 0; i < PARTS; i++) total += sizes[i] * m;
    char* work = malloc(elem * (size_t)total);
    if (work == NULL) return 1;
    for (int64_t i = 0, at = 0; i < PARTS; at += sizes[i] * m, i++) parts[i] = work + at * elem;

    const int kv_int8 = d->kv_int8;
    const int64_t row = kv_int8 ? dim + KV_SCALE_BYTES : dim;         /* a slot's elements */
    const size_t row_elem = kv_int8 ? 1 : elem;                       /* bytes per element */
    const int64_t head_stride = d->num_blocks * d->block_size * row; /* one KV head's slots */
    int status = 0;
    /* One team for the whole step: every kernel's row loop is shared by its threads (kernels.h,
     * ON_TEAM), the small serial steps between them run on its first thread, and the threads
     * meet at a spinning barrier after each. No thread leaves early on a failure: each reaches
     * every barrier, and the first failure is returned at the end. */
    mm_team team = {0, 0};
    _Pragma("omp parallel num_threads(threads)")
    {
        const int lead = TEAM_RANK() == 0;
        int mine = 0;  /* this thread's first failure */
#define NOTE(CALL)                                                                             \
    do {                                                                                       \
        const int s_ = (CALL);                                                                 \
        if (s_ && !mine) mine = s_;                                                            \
    } while (0)
        for (int64_t l = 0; l < num_layers; l++) {
            const mm_layer_desc* L = &layers[l];
            /* the residual add of the previous layer's MLP fused into this layer's input norm */
            if (lead)
                NOTE(mm_rms_norm(h, l ? parts[MLP] : NULL, h, L->input_norm, parts[NORMED], dt,
                                 m, hidden, d->eps, d->norm_mode));
            team_sync(&team);
            NOTE(run_linear(&L->qkv, parts[NORMED], parts[QKV], m, dt, threads, &team));
            team_sync(&team);
            if (lead) {
                /* q and k are adjacent: one rotary call rotates both (normed per head first) */
                const void* unrotated = parts[QKV];
                int64_t stride = qkv_n;
                if (L->q_norm != NULL) {
                    for (int64_t t = 0; t < m; t++) {
                        const char* row = parts[QKV] + t * qkv_n * elem;
                        char* out = parts[QK] + t * rotated * elem;
                        NOTE(mm_rms_norm(row, NULL, NULL, L->q_norm, out, dt, hq, dim, d->eps,
                                         d->norm_mode));
                        NOTE(mm_rms_norm(row + hq * dim * elem, NULL, NULL, L->k_norm,
                                         out + hq * dim * elem, dt, hkv, dim, d->eps,
                                         d->norm_mode));
                    }
                    unrotated = parts[QK], stride = rotated;
                }
                mm_rotary(unrotated, cos[L->rope], sin[L->rope], parts[ROT], dt, m, hq + hkv,
                          dim, stride);
                /* keys (rotated) and values (as projected) into the cache; q contiguous */
                for (int64_t t = 0; t < m; t++) {
                    const char* rot = parts[ROT] + t * rotated * elem;
                    const char* value = parts[QKV] + (t * qkv_n + rotated) * elem;
                    for (int64_t kv = 0; kv < hkv; kv++) {
                        char* key_slot = (char*)L->kv_cache +
                                         (kv * head_stride + slots[t] * row) * row_elem;
                        char* value_slot = key_slot + hkv * head_stride * row_elem;
                        if (kv_int8) {  /* quantized as models/layers/kv_quant.py does */
                            mm_quantize_kv_row(rot, dt, (hq + kv) * dim, dim,
                                               (int8_t*)key_slot);
                            mm_quantize_kv_row(value, dt, kv * dim, dim, (int8_t*)value_slot);
                            continue;
                        }
                        memcpy(key_slot, rot + (hq + kv) * dim * elem, dim * elem);
                        memcpy(value_slot, value + kv * dim * elem, dim * elem);
                    }
                    memcpy(parts[Q] + t * hq * dim * elem, rot, hq * dim * elem);
                }
            }
            team_sync(&team);
            if (kv_int8)
                NOTE(mm_decode_attention_i8(parts[Q], L->kv_cache, parts[ATTN], dt, table,
                                            key0, context, m, hq, hkv, dim, width,
                                            d->num_blocks, d->block_size, L->window, d->scale,
                                            0.0f, threads));
            else
                NOTE(mm_decode_attention(parts[Q], L->kv_cache, parts[ATTN], dt, table, key0,
                                         context, m, hq, hkv, dim, width, d->num_blocks,
                                         d->block_size, L->window, d->scale, 0.0f, threads));
            team_sync(&team);
            NOTE(run_linear(&L->o, parts[ATTN], parts[O], m, dt, threads, &team));
            team_sync(&team);
            if (lead) {
                /* sandwich norms: the attention's output normed (in place) before its add */
                if (L->attn_out_norm != NULL)
                    NOTE(mm_rms_norm(parts[O], NULL, NULL, L->attn_out_norm, parts[O], dt, m,
                                     hidden, d->eps, d->norm_mode));
                NOTE(mm_rms_norm(h, parts[O], h, L->post_norm, parts[NORMED], dt, m, hidden,
                                 d->eps, d->norm_mode));
            }
            team_sync(&team);
            NOTE(run_linear(&L->gate_up, parts[NORMED], parts[GATE_UP], m, dt, threads, &team));
            team_sync(&team);
            if (lead) {
                if (d->act == ACT_SILU)
                    mm_silu_mul(parts[GATE_UP], parts[ACT], dt, m, d->intermediate);
                else
                    mm_act_mul(parts[GATE_UP], parts[ACT], dt, m, d->intermediate, d->act);
            }
            team_sync(&team);
            NOTE(run_linear(&L->down, parts[ACT], parts[MLP], m, dt, threads, &team));
            team_sync(&team);
            /* the MLP's output normed (sandwich norms) before the next input norm adds it */
            if (lead && L->mlp_out_norm != NULL)
                NOTE(mm_rms_norm(parts[MLP], NULL, NULL, L->mlp_out_norm, parts[MLP], dt, m,
                                 hidden, d->eps, d->norm_mode));
            team_sync(&team);
        }
#undef NOTE
        if (mine) {
            _Pragma("omp atomic write")
            status = mine;
        }
    }
    if (status == 0 && num_layers > 0) add_into(h, parts[MLP], dt, m * hidden, m * hidden);
    free(work);
    return status;
}
