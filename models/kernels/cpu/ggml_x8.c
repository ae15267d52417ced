/* Weights of every ggml type we run repacked at load in groups of 8 output channels
 * (GGML_Q4_0_X8 .. GGML_Q6_K_X8; the 32-value types' layouts at b32_in, Q5_K's at q5k_in),
 * so that a decode step's matrix-vector product meets 8 channels in each vector
 * instruction (one channel per int32 lane) instead of one channel's 32 inputs, as llama.cpp's
 * repack does for its CPU kernels. Nothing is widened or rounded: the quants' bytes are the
 * file's, moved. Q4_K's 6-bit sub-block scales and minimums are written out as bytes (the 12
 * packed bytes and the 16 unpacked ones hold the same 96 bits: 148 bytes a channel's
 * super-block, the file's 144); Q6_K keeps its 210. The file's block comes back exactly
 * (mm_ggml_x8_block), which is how the dequantizer and the plain path read these layouts.
 *
 * A group's super-block b (of nb = K / 256), at (g * nb + b) * 8 * (148 or 210):
 *   Q4_K_X8  [0, 16)     d of channels 0 .. 7 (float16, as stored)
 *            [16, 32)    dmin of channels 0 .. 7
 *            [32, 96)    sc[j][c]: sub-block j's 6-bit scale of channel c, a byte
 *            [96, 160)   mn[j][c]: its minimum
 *            [160, 1184) per pair p of sub-blocks (0 .. 3) and step s (0 .. 7) 32 bytes: bytes
 *                        4c .. 4c + 3 are channel c's stored qs[32 p + 4 s .. + 3] (low
 *                        nibbles: inputs 64 p + 4 s .. + 3, of sub-block 2 p; high: + 32)
 *   Q6_K_X8  [0, 16)     d of channels 0 .. 7
 *            [16, 144)   sc[j][c]: sub-block j's (of 16) int8 scale of channel c
 *            [144, 1680) per half n (0 .. 1) and step s (0 .. 7) 96 bytes: P, Q, R (32 each),
 *                        bytes 4c .. 4c + 3 channel c's of inputs 4 s .. + 3 of each group of
 *                        32 (q6k_in: the quants' bits regrouped, none added)
 * so a weight [N, K] (N a multiple of 8) is still [N, row bytes] as the other block types, a
 * group's 8 rows together (channel slices at multiples of 8).
 *
 * mm_ggml_x8_rows: rows of x (written as ggml_blocks.c's integer path writes them: per
 * super-block int8 digits h (and l) with unit dx; xs, xs16 the sums per 32 and 16) against one
 * group. Per step, 4 inputs' digits broadcast meet the 8 channels' 4 quants: with AVX-512
 * VNNI, VPDPBUSD sums them into each channel's int32 lane over a sub-block, then VPMULLD by the
 * channels' sub-block scales; with AVX2, PMADDUBSW pairs them into int16 lanes, steps summed in
 * int16 while they cannot overflow (Q4_K: a sub-block's 8 steps, at most 16 * 15 * 127; Q5_K:
 * 4 steps, at most 8 * 31 * 127; Q6_K: 2 steps, at most 4 * 63 * 127), then PMADDWD by the
 * scales. Either way a super-block's
 * products sum exactly in int32 per channel (the same integers) and meet the float scales once:
 *   Q4_K  y_c += d_c dx sum_j sc_jc isum_jc - dmin_c sum_j mn_jc xs_j (Q5_K too)
 *   Q6_K  y_c += d_c dx sum_j sc_jc isum_jc - 32 d_c sum_j sc_jc xs16_j
 * Each row's arithmetic is the same whatever the count of rows: a verify's k + 1 rows get the
 * one-row call's results to the bit. mm_ggml_x8_rows_pair (AVX-512 VNNI, Q4_K and Q6_K): two
 * groups in one 512-bit register for a verify's rows, each lane's operations the same. The
 * integer sums are those of ggml_blocks.c's per-channel path; the float order differs, within
 * float32 rounding.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define X8_ROWS 16 /* rows of x at most (mm_ggml_linear's MAX_ROWS) */
#define Q4K_X8_SUPER (X8_CHANNELS * 148)
#define Q5K_X8_SUPER (X8_CHANNELS * 180)
#define Q6K_X8_SUPER (X8_CHANNELS * 210)
#define Q40_X8_BLOCK (X8_CHANNELS * 18)
#define Q41_X8_BLOCK (X8_CHANNELS * 20)
#define Q50_X8_BLOCK (X8_CHANNELS * 22)
#define Q51_X8_BLOCK (X8_CHANNELS * 24)
#define Q80_X8_BLOCK (X8_CHANNELS * 34)

/* one channel's super-block src (as stored) into its group's super-block dst, as channel c */
static void q4k_in(const uint8_t* src, int c, uint8_t* dst) {
    memcpy(dst + 2 * c, src, 2);
    memcpy(dst + 16 + 2 * c, src + 2, 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        ggml_scale_min(j, src + 4, &sc, &mn);
        dst[32 + 8 * j + c] = (uint8_t)sc;
        dst[96 + 8 * j + c] = (uint8_t)mn;
    }
    for (int t = 0; t < 32; t++) memcpy(dst + 160 + 32 * t + 4 * c, src + 16 + 4 * t, 4);
}

static void q4k_out(const uint8_t* src, int c, uint8_t* block) {
    memcpy(block, src + 2 * c, 2);
    memcpy(block + 2, src + 16 + 2 * c, 2);
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 8; j++) sc[j] = src[32 + 8 * j + c], mn[j] = src[96 + 8 * j + c];
    uint8_t* q = block + 4;  /* ggml_scale_min's inverse */
    for (int j = 0; j < 4; j++) {
        q[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        q[j + 4] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
        q[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
    }
    for (int t = 0; t < 32; t++) memcpy(block + 16 + 4 * t, src + 160 + 32 * t + 4 * c, 4);
}

/* Q5_K as stored: Q4_K's d, dmin and scales [0, 16), qh [16, 48) (byte i: bit 2p the fifth bit
 * of input 64p + i of the low nibbles' half, bit 2p + 1 of 64p + 32 + i), qs [48, 176). In the
 * group: Q4_K_X8's layout, then per step s (0 .. 7) channel c's qh[4s .. 4s + 3] at 1184 + 32s +
 * 4c (the fifth bits of every pair's step s). */
static void q5k_in(const uint8_t* src, int c, uint8_t* dst) {
    uint8_t as_q4k[144];
    memcpy(as_q4k, src, 16), memcpy(as_q4k + 16, src + 48, 128);
    q4k_in(as_q4k, c, dst);
    for (int s = 0; s < 8; s++) memcpy(dst + 1184 + 32 * s + 4 * c, src + 16 + 4 * s, 4);
}

static void q5k_out(const uint8_t* src, int c, uint8_t* block) {
    uint8_t as_q4k[144];
    q4k_out(src, c, as_q4k);
    memcpy(block, as_q4k, 16), memcpy(block + 48, as_q4k + 16, 128);
    for (int s = 0; s < 8; s++) memcpy(block + 16 + 4 * s, src + 1184 + 32 * s + 4 * c, 4);
}

/* Q6_K as stored: ql [0, 128), qh [128, 192), scales [192, 208), d [208, 210). In half n
 * (values 128 n ..), byte l of ql chunk 2n (ql[64 n + l]) holds the low nibbles of values
 * 128 n + l (group 0) and + 64 (group 2), of chunk 2n + 1 those of + 32 (group 1) and + 96
 * (group 3); qh[32 n + l] their top two bits at bits 0, 2, 4, 6 (groups 0, 1, 2, 3). In the
 * group, per half and step (l = 4 s + i) three bytes of channel c: P = group 0's six bits and
 * group 2's top two above them, Q = the same of groups 1 and 3, R = the low nibbles of groups
 * 2 and 3; so that groups 0 and 1 are a mask away, 2 and 3 a shift and a merge. */
static void q6k_in(const uint8_t* src, int c, uint8_t* dst) {
    memcpy(dst + 2 * c, src + 208, 2);
    for (int j = 0; j < 16; j++) dst[16 + 8 * j + c] = src[192 + j];
    for (int n = 0; n < 2; n++)
        for (int l = 0; l < 32; l++) {
            const uint8_t a = src[64 * n + l], b = src[64 * n + 32 + l], h = src[128 + 32 * n + l];
            uint8_t* at = dst + 144 + 96 * (8 * n + l / 4) + 4 * c + l % 4;
            at[0] = (uint8_t)((a & 0xF) | ((h & 3) << 4) | (((h >> 4) & 3) << 6));
            at[32] = (uint8_t)((b & 0xF) | (((h >> 2) & 3) << 4) | (((h >> 6) & 3) << 6));
            at[64] = (uint8_t)((a >> 4) | (b & 0xF0));
        }
}

static void q6k_out(const uint8_t* src, int c, uint8_t* block) {
    memcpy(block + 208, src + 2 * c, 2);
    for (int j = 0; j < 16; j++) block[192 + j] = src[16 + 8 * j + c];
    for (int n = 0; n < 2; n++)
        for (int l = 0; l < 32; l++) {
            const uint8_t* at = src + 144 + 96 * (8 * n + l / 4) + 4 * c + l % 4;
            const uint8_t p = at[0], q = at[32], r = at[64];
            block[64 * n + l] = (uint8_t)((p & 0xF) | ((r & 0xF) << 4));
            block[64 * n + 32 + l] = (uint8_t)((q & 0xF) | (r & 0xF0));
            block[128 + 32 * n + l] = (uint8_t)(((p >> 4) & 3) | (((q >> 4) & 3) << 2) |
                                                (((p >> 6) & 3) << 4) | (((q >> 6) & 3) << 6));
        }
}

/* The 32-value 4- and 5-bit types as stored: d [0, 2), for _1 the minimum m [2, 4), for Q5 qh
 * (4 bytes, bit j: input j's fifth bit), then qs (16 bytes: low nibble j input j, high j + 16).
 * In the group: d at 2c, m at 16 + 2c (_1), channel c's fifth bits at `gh` + 4c, byte s holding
 * those of inputs 4s .. 4s + 3 (bits 0 .. 3) and 16 + 4s .. (bits 4 .. 7) (Q5), then qs [s][c]
 * (4 bytes each) at `gq`: Q4_0 16, Q4_1 32, Q5_0 48, Q5_1 64. */
static void b32_in(const uint8_t* src, int c, uint8_t* dst, int min, int fifth) {
    const int gh = 16 + 16 * min, gq = gh + 32 * fifth, sq = 2 + 2 * min + 4 * fifth;
    memcpy(dst + 2 * c, src, 2);
    if (min) memcpy(dst + 16 + 2 * c, src + 2, 2);
    if (fifth) {
        const uint8_t* qh = src + 2 + 2 * min;
        const uint32_t h = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) |
                           ((uint32_t)qh[3] << 24);
        for (int s = 0; s < 4; s++)
            dst[gh + 4 * c + s] =
                (uint8_t)(((h >> (4 * s)) & 0xF) | (((h >> (16 + 4 * s)) & 0xF) << 4));
    }
    for (int s = 0; s < 4; s++) memcpy(dst + gq + 32 * s + 4 * c, src + sq + 4 * s, 4);
}

static void b32_out(const uint8_t* src, int c, uint8_t* block, int min, int fifth) {
    const int gh = 16 + 16 * min, gq = gh + 32 * fifth, sq = 2 + 2 * min + 4 * fifth;
    memcpy(block, src + 2 * c, 2);
    if (min) memcpy(block + 2, src + 16 + 2 * c, 2);
    if (fifth) {
        uint32_t h = 0;
        for (int s = 0; s < 4; s++) {
            const uint32_t byte = src[gh + 4 * c + s];
            h |= ((byte & 0xF) << (4 * s)) | ((byte >> 4) << (16 + 4 * s));
        }
        for (int i = 0; i < 4; i++) block[2 + 2 * min + i] = (uint8_t)(h >> (8 * i));
    }
    for (int s = 0; s < 4; s++) memcpy(block + sq + 4 * s, src + gq + 32 * s + 4 * c, 4);
}

#define B32_LAYOUT(T, MIN, FIFTH)                                                              \
    static void T##_in(const uint8_t* src, int c, uint8_t* dst) {                              \
        b32_in(src, c, dst, MIN, FIFTH);                                                       \
    }                                                                                          \
    static void T##_out(const uint8_t* src, int c, uint8_t* block) {                           \
        b32_out(src, c, block, MIN, FIFTH);                                                    \
    }
B32_LAYOUT(q40, 0, 0)
B32_LAYOUT(q41, 1, 0)
B32_LAYOUT(q50, 0, 1)
B32_LAYOUT(q51, 1, 1)
#undef B32_LAYOUT

/* Q8_0 as stored: d [0, 2), qs [2, 34). In the group: d at 2c, qs [s][c] (4 bytes) at 16. */
static void q80_in(const uint8_t* src, int c, uint8_t* dst) {
    memcpy(dst + 2 * c, src, 2);
    for (int s = 0; s < 8; s++) memcpy(dst + 16 + 32 * s + 4 * c, src + 2 + 4 * s, 4);
}

static void q80_out(const uint8_t* src, int c, uint8_t* block) {
    memcpy(block, src + 2 * c, 2);
    for (int s = 0; s < 8; s++) memcpy(block + 2 + 4 * s, src + 16 + 32 * s + 4 * c, 4);
}

/* The types repacked: as stored and ours, values per block, bytes of a block as stored and of
 * a group's block, a channel's block into its group and back */
typedef struct {
    int stored, x8, values, bytes, group_bytes;
    void (*in)(const uint8_t* src, int c, uint8_t* dst);
    void (*out)(const uint8_t* src, int c, uint8_t* block);
} x8_layout;

static const x8_layout LAYOUTS[] = {
    {GGML_Q4_K, GGML_Q4_K_X8, 256, 144, Q4K_X8_SUPER, q4k_in, q4k_out},
    {GGML_Q5_K, GGML_Q5_K_X8, 256, 176, Q5K_X8_SUPER, q5k_in, q5k_out},
    {GGML_Q6_K, GGML_Q6_K_X8, 256, 210, Q6K_X8_SUPER, q6k_in, q6k_out},
    {GGML_Q5_0, GGML_Q5_0_X8, 32, 22, Q50_X8_BLOCK, q50_in, q50_out},
    {GGML_Q8_0, GGML_Q8_0_X8, 32, 34, Q80_X8_BLOCK, q80_in, q80_out},
    {GGML_Q4_0, GGML_Q4_0_X8, 32, 18, Q40_X8_BLOCK, q40_in, q40_out},
    {GGML_Q4_1, GGML_Q4_1_X8, 32, 20, Q41_X8_BLOCK, q41_in, q41_out},
    {GGML_Q5_1, GGML_Q5_1_X8, 32, 24, Q51_X8_BLOCK, q51_in, q51_out},
};
#define N_LAYOUTS ((int)(sizeof(LAYOUTS) / sizeof(LAYOUTS[0])))

/* the layout repacking `stored` (a ggml type), or of the x8 type `x8`; NULL if none */
static const x8_layout* layout_of(int stored, int x8) {
    for (int i = 0; i < N_LAYOUTS; i++)
        if (LAYOUTS[i].stored == stored || LAYOUTS[i].x8 == x8) return &LAYOUTS[i];
    return NULL;
}

int mm_ggml_x8_stored(int type) {
    const x8_layout* l = layout_of(-1, type);
    return l ? l->stored : 0;
}

static int repackable(int type, int64_t n, int64_t k) {
    const x8_layout* l = layout_of(type, -1);
    return l != NULL && n > 0 && n % X8_CHANNELS == 0 && k > 0 && k % l->values == 0;
}

/* Whether a weight [n, k] of `type` is worth repacking in this build: a type of LAYOUTS in whole
 * groups of 8 channels, where a vector path runs the groups (the plain path is
 * faster on the file's layout) */
int mm_ggml_repack_takes(int type, int64_t n, int64_t k) {
#ifdef MM_AVX2
    return repackable(type, n, k);
#else
    (void)type, (void)n, (void)k;
    return 0;
#endif
}

/* W [n, k] of `type` as the file holds it -> out [n, row bytes] in its x8 layout (in any
 * build: ggml_blocks.c's plain path and dequantizer read it too). -> 0, or 2 for a type not
 * repacked or n not a multiple of 8. */
int mm_ggml_repack(const uint8_t* w, int type, int64_t n, int64_t k, uint8_t* out, int threads) {
    if (!repackable(type, n, k)) return 2;
    const x8_layout* l = layout_of(type, -1);
    const int64_t nb = k / l->values, groups = n / X8_CHANNELS;
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(n * k > 65536)")
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int c = 0; c < X8_CHANNELS; c++)
                l->in(w + ((g * X8_CHANNELS + c) * nb + b) * l->bytes, c,
                      out + (g * nb + b) * l->group_bytes);
    return 0;
}

/* The file's block b of channel `channel` back from w, a weight of x8 `type` (nb blocks per
 * channel): the stored block's bytes into `block`, byte for byte as stored */
void mm_ggml_x8_block(const uint8_t* w, int type, int64_t nb, int64_t channel, int64_t b,
                      uint8_t* block) {
    const x8_layout* l = layout_of(-1, type);
    const int64_t g = channel / X8_CHANNELS;
    l->out(w + (g * nb + b) * l->group_bytes, (int)(channel % X8_CHANNELS), block);
}

#ifdef MM_AVX2
#define X8_AHEAD 4096
/* The cache lines of the block X8_AHEAD bytes on (the hardware's prefetch alone leaves these
 * loops waiting on memory) */
static inline void prefetch_x8(const uint8_t* p, int bytes) {
    for (int b = 0; b < bytes; b += 64) __builtin_prefetch(p + X8_AHEAD + b, 0, 3);
}

static inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* A run of steps of one sub-block: the 8 channels' products summed, then weighted by their
 * sub-block scales into int32 (the same integers either way):
 * - AVX-512 VNNI: VPDPBUSD sums each step's 4 products into the channel's int32 lane; VPMULLD
 *   by the scale (`scale_lanes`: one per int32 lane);
 * - AVX2: PMADDUBSW pairs each step's products into int16 lanes, summed in int16 over the run
 *   (RUN steps, within int16: see the file's comment); PMADDWD by the scale in both int16
 *   halves of each int32 lane. */
#ifdef MM_AVX512_VNNI
#define X8_TILE 3 /* rows side by side at most (q4k_tile), one digit: 32 vector registers */
#define X8_TILE_TWO 2 /* two digits: twice the chains a row */
#define Q6_RUN 4 /* Q6_K's steps per run: a whole sub-block of 16 */
#define Q5_RUN 8 /* Q5_K's: a whole sub-block */
/* Quants met where they lie in their byte, a power of two times their value: Q4_K's high
 * nibbles as 16 q (at most 240, a byte still), Q6_K's group 3 as 4 q (q6k_rows). A run's sum is
 * then that multiple of the quants' (exactly: every product is one; Q4_K's at most
 * 8 * 4 * 240 * 128 in int32), shifted down once a run where the quants would take a shift
 * each step. Not on AVX2, whose int16 pairs would pass 2 * 240 * 127. */
#define HIGH_IN_PLACE 1
static inline __m256i run_add(__m256i run, __m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(run, w, x);
}
static inline __m256i run_weighted(__m256i acc, __m256i run, __m256i scale) {
    return _mm256_add_epi32(acc, _mm256_mullo_epi32(run, scale));
}
static inline __m256i scale_lanes(__m256i s) {
    return s;
}
static inline __m256i run_sum(__m256i acc, __m256i run) {  /* unweighted */
    return _mm256_add_epi32(acc, run);
}
static inline __m256i add_step(__m256i acc, __m256i w, __m256i x) {  /* a run of one step */
    return _mm256_dpbusd_epi32(acc, w, x);
}
#else
#define X8_TILE 2 /* one digit: 16 vector registers */
#define X8_TILE_TWO 1 /* two: slower at 2 rows side by side (8 chains in 16 registers) */
#define Q6_RUN 2
#define Q5_RUN 4 /* 4 steps of 2 products each at most 2 * 31 * 127: within int16 */
#define HIGH_IN_PLACE 0
/* PADDSW, not PADDW: the same sums (a run stays within int16), but GCC does not reassociate
 * saturating adds, where it would turn a run's chain into a tree, every product live at once,
 * and spill them from 16 registers */
static inline __m256i run_add(__m256i run, __m256i w, __m256i x) {
    return _mm256_adds_epi16(run, _mm256_maddubs_epi16(w, x));
}
static inline __m256i run_weighted(__m256i acc, __m256i run, __m256i scale) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(run, scale));
}
static inline __m256i scale_lanes(__m256i s) {  /* int32 lanes of -128 .. 127 */
    return _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xFFFF)),
                           _mm256_slli_epi32(s, 16));
}
static inline __m256i run_sum(__m256i acc, __m256i run) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(run, _mm256_set1_epi16(1)));
}
static inline __m256i add_step(__m256i acc, __m256i w, __m256i x) {
    return run_sum(acc, _mm256_maddubs_epi16(w, x));
}
#endif

/* acc + d * a super-block's integer sums in the row's unit (256 h + l with two digits: in
 * float32, as 256 h + l can pass int32 over a super-block) */
static inline __m256 add_super(__m256 acc, __m256 d, __m256i ih, __m256i il, float unit,
                               const int TWO) {
    __m256 sum = _mm256_mul_ps(_mm256_cvtepi32_ps(ih),
                               _mm256_set1_ps(TWO ? 256.0f * unit : unit));
    if (TWO) sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il), _mm256_set1_ps(unit), sum);
    return _mm256_fmadd_ps(d, sum, acc);
}

/* A super-block's quants unpacked once for several rows are read back by each row: GCC would
 * otherwise redo the unpacking per row from the weight (the copy looks like a recomputable
 * expression of it) */
#define KEEP_UNPACKED(A, B) __asm__ volatile("" : : "r"(A), "r"(B) : "memory")

/* a value read once into a register for all the rows that meet it: GCC would read it again from
 * memory for each, where the loads, not the multiply-adds, then bound the loop */
static inline void in_register(__m256i* v) {
#ifdef __AVX512VL__
    __asm__("" : "+v"(*v));  /* any of the 32 */
#else
    __asm__("" : "+x"(*v));
#endif
}

/* sub-block j's scales (or minimums) of the 8 channels, one per int32 lane */
static inline __m256i bytes8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}

/* Q4_K's (and Q5_K's) high nibbles of v as the kernels meet them: in place (16 q) where
 * IN_PLACE (HIGH_IN_PLACE, not Q5_K: its fifth bit goes above them), else shifted down */
static inline __m256i high_nibbles(__m256i v, const int IN_PLACE) {
    return IN_PLACE ? _mm256_and_si256(v, _mm256_set1_epi8((char)0xF0))
                    : _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0xF));
}

/* Q5_K's fifth bits: bit `bit` of each byte of h as 0x10 */
static inline __m256i fifth_bits(__m256i h, int bit) {
    const __m256i m = _mm256_set1_epi8((char)(1 << bit));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, m), m),
                            _mm256_set1_epi8(0x10));
}

/* Rows a[0 .. T) (T a constant, at most X8_TILE) against one Q4_K_X8 (or, FIVE, Q5_K_X8)
 * super-block b, its quants unpacked (lo, hi per (pair, step)) or, with lo NULL (one row),
 * unpacked from qs (and qh) as the steps go: each row's acc[r] and off[r] take the super-block,
 * in the one-row call's operations.
 * A tile's rows share each step's quants in registers and interleave their chains: with one
 * digit a row has only 2 chains, which alone wait on VPDPBUSD's latency; with two its 4 already
 * run at the instruction's rate (X8_TILE_TWO). Integer sums: the same whatever the tile. */
static inline __attribute__((always_inline)) void q4k_tile(
        const uint8_t* qs, const uint8_t* qh, const __m256i* lo, const __m256i* hi,
        const __m256i* scale, const __m256* mins, __m256 d, __m256 dmin, const ggml_act_row* a,
        int64_t b, const int T, const int TWO, const int FIVE, __m256* acc, __m256* off) {
    const __m256i nibble = _mm256_set1_epi8(0xF);
    const int IN_PLACE = HIGH_IN_PLACE && !FIVE;
    for (int r = 0; r < T; r++) {  /* the minimums' part */
        const float* xs = a[r].xs + 8 * b;
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) m = _mm256_fmadd_ps(mins[j], _mm256_set1_ps(xs[j]), m);
        off[r] = _mm256_fmadd_ps(dmin, m, off[r]);
    }
    __m256i ih[X8_TILE], il[X8_TILE];
    const int8_t *xh[X8_TILE], *xl[X8_TILE];
    for (int r = 0; r < T; r++) {
        ih[r] = il[r] = _mm256_setzero_si256();
        xh[r] = a[r].q + 256 * b, xl[r] = TWO ? a[r].l + 256 * b : NULL;
    }
    for (int p = 0; p < 4; p++) {
        __m256i lo_h[X8_TILE], hi_h[X8_TILE], lo_l[X8_TILE], hi_l[X8_TILE];
        for (int r = 0; r < T; r++)
            lo_h[r] = hi_h[r] = lo_l[r] = hi_l[r] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            const int t = 8 * p + s, at = 64 * p + 4 * s;
            __m256i wl, wh;
            if (lo == NULL) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * t));
                wl = _mm256_and_si256(v, nibble);
                wh = high_nibbles(v, IN_PLACE);
                if (FIVE) {
                    const __m256i h = _mm256_loadu_si256((const __m256i*)(qh + 32 * s));
                    wl = _mm256_or_si256(wl, fifth_bits(h, 2 * p));
                    wh = _mm256_or_si256(wh, fifth_bits(h, 2 * p + 1));
                }
            } else {
                wl = lo[t], wh = hi[t];
                in_register(&wl), in_register(&wh);
            }
            for (int r = 0; r < T; r++) {
                lo_h[r] = run_add(lo_h[r], wl, bcast4(xh[r] + at));
                hi_h[r] = run_add(hi_h[r], wh, bcast4(xh[r] + at + 32));
                if (TWO) {
                    lo_l[r] = run_add(lo_l[r], wl, bcast4(xl[r] + at));
                    hi_l[r] = run_add(hi_l[r], wh, bcast4(xl[r] + at + 32));
                }
            }
            /* Q5_K on AVX2: the first half of the run weighted before its int16 sums could
             * overflow */
            if (FIVE && Q5_RUN < 8 && s == Q5_RUN - 1) {
                for (int r = 0; r < T; r++) {
                    ih[r] = run_weighted(run_weighted(ih[r], lo_h[r], scale[2 * p]), hi_h[r],
                                         scale[2 * p + 1]);
                    if (TWO)
                        il[r] = run_weighted(run_weighted(il[r], lo_l[r], scale[2 * p]),
                                             hi_l[r], scale[2 * p + 1]);
                    lo_h[r] = hi_h[r] = lo_l[r] = hi_l[r] = _mm256_setzero_si256();
                }
            }
        }
        for (int r = 0; r < T; r++) {
            if (IN_PLACE) {
                hi_h[r] = _mm256_srai_epi32(hi_h[r], 4);
                if (TWO) hi_l[r] = _mm256_srai_epi32(hi_l[r], 4);
            }
            ih[r] = run_weighted(run_weighted(ih[r], lo_h[r], scale[2 * p]), hi_h[r],
                                 scale[2 * p + 1]);
            if (TWO)
                il[r] = run_weighted(run_weighted(il[r], lo_l[r], scale[2 * p]), hi_l[r],
                                     scale[2 * p + 1]);
        }
    }
    for (int r = 0; r < T; r++) acc[r] = add_super(acc[r], d, ih[r], il[r], a[r].dx[8 * b], TWO);
}

/* One Q4_K_X8 (or, FIVE, Q5_K_X8) group of 8 channels against rows a[0 .. R): out[8 i + c].
 * R == 1 unpacks the quants as it goes; more rows take them from a super-block's unpacked copy
 * (2 KiB, in L1), in tiles of X8_TILE rows. */
static inline __attribute__((always_inline)) void qk_rows(
        const uint8_t* group, int64_t nb, const ggml_act_row* a, const int R, const int TWO,
        const int FIVE, float* out) {
    const int64_t super = FIVE ? Q5K_X8_SUPER : Q4K_X8_SUPER;
    const __m256i nibble = _mm256_set1_epi8(0xF);
    __m256 acc[X8_ROWS], off[X8_ROWS];
    __m256i lo[32], hi[32];  /* R > 1: a super-block's quants, per (pair, step) */
    for (int i = 0; i < R; i++) acc[i] = off[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* sb = group + b * super;
        prefetch_x8(sb, (int)super);
        const uint8_t* qs = sb + 160;
        const uint8_t* qh = FIVE ? sb + 1184 : NULL;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sb));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sb + 16)));
        __m256i scale[8];
        __m256 mins[8];
        for (int j = 0; j < 8; j++) {
            scale[j] = scale_lanes(bytes8(sb + 32 + 8 * j));
            mins[j] = _mm256_cvtepi32_ps(bytes8(sb + 96 + 8 * j));
        }
        if (R > 1) {
            for (int t = 0; t < 32; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * t));
                lo[t] = _mm256_and_si256(v, nibble);
                hi[t] = high_nibbles(v, HIGH_IN_PLACE && !FIVE);
                if (FIVE) {  /* pair t / 8, step t % 8 */
                    const __m256i h = _mm256_loadu_si256((const __m256i*)(qh + 32 * (t % 8)));
                    lo[t] = _mm256_or_si256(lo[t], fifth_bits(h, 2 * (t / 8)));
                    hi[t] = _mm256_or_si256(hi[t], fifth_bits(h, 2 * (t / 8) + 1));
                }
            }
            KEEP_UNPACKED(lo, hi);
        }
        const int tile = TWO ? X8_TILE_TWO : X8_TILE;
        for (int i = 0; i < R; i += tile) {
            const int n = R - i < tile ? R - i : tile;
            /* tile and R constants where they can be: no instance a build cannot reach */
#define Q4K_TILE(LO, HI, T) \
            q4k_tile(qs, qh, LO, HI, scale, mins, d, dmin, a + i, b, T, TWO, FIVE, acc + i,     \
                     off + i)
            if (R == 1) Q4K_TILE(NULL, NULL, 1);
            else if (tile == 1 || n == 1) Q4K_TILE(lo, hi, 1);
            else if (tile == 2 || n == 2) Q4K_TILE(lo, hi, 2);
            else Q4K_TILE(lo, hi, X8_TILE);
#undef Q4K_TILE
        }
    }
    for (int i = 0; i < R; i++) _mm256_storeu_ps(out + 8 * i, _mm256_sub_ps(acc[i], off[i]));
}

static inline __attribute__((always_inline)) void q4k_rows(
        const uint8_t* group, int64_t nb, const ggml_act_row* a, const int R, const int TWO,
        float* out) {
    qk_rows(group, nb, a, R, TWO, 0, out);
}

static inline __attribute__((always_inline)) void q5k_rows(
        const uint8_t* group, int64_t nb, const ggml_act_row* a, const int R, const int TWO,
        float* out) {
    qk_rows(group, nb, a, R, TWO, 1, out);
}

/* One Q6_K_X8 group against rows a[0 .. R): out[8 i + c], as qk_rows. A step's 4 inputs of
 * each of the 4 groups of 32 of a half (128 values) from its P, Q, R (q6k_in): groups 0 and 1
 * P's and Q's low six bits, 2 and 3 R's nibbles under P's and Q's top two bits. */
static inline __attribute__((always_inline)) void q6k_rows(
        const uint8_t* group, int64_t nb, const ggml_act_row* a, const int R, const int TWO,
        float* out) {
    const __m256i nibble = _mm256_set1_epi8(0xF), top = _mm256_set1_epi8(0x30);
    const __m256i six = _mm256_set1_epi8(0x3F), top2 = _mm256_set1_epi8((char)0xC0);
    const __m256i above2 = _mm256_set1_epi8((char)0xFC);
    __m256 acc[X8_ROWS], off[X8_ROWS];
    __m256i wq[64];  /* R > 1: a super-block's quants (0 .. 63) per (half, group, step) */
    for (int i = 0; i < R; i++) acc[i] = off[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* sb = group + b * Q6K_X8_SUPER;
        prefetch_x8(sb, Q6K_X8_SUPER);
        const uint8_t* q = sb + 144;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sb));
        const __m256 d32 = _mm256_mul_ps(d, _mm256_set1_ps(32.0f));
        __m256i scale[16];
        __m256 scf[16];
        for (int j = 0; j < 16; j++) {
            const __m256i s =
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(sb + 16 + 8 * j)));
            scale[j] = scale_lanes(s);
            scf[j] = _mm256_cvtepi32_ps(s);
        }
#define Q6_UNPACK(N, S, W)                                                                     \
        {                                                                                      \
            const uint8_t* at_ = q + 96 * (8 * (N) + (S));                                     \
            const __m256i vp = _mm256_loadu_si256((const __m256i*)at_);                        \
            const __m256i vq = _mm256_loadu_si256((const __m256i*)(at_ + 32));                 \
            const __m256i vr = _mm256_loadu_si256((const __m256i*)(at_ + 64));                 \
            W[0] = _mm256_and_si256(vp, six);                                                  \
            W[1] = _mm256_and_si256(vq, six);                                                  \
            W[2] = _mm256_or_si256(_mm256_and_si256(vr, nibble),                               \
                                   _mm256_and_si256(_mm256_srli_epi16(vp, 2), top));           \
            W[3] = HIGH_IN_PLACE /* 4 q: Q's top bits in place, R's nibble under them */      \
                ? _mm256_and_si256(_mm256_or_si256(_mm256_and_si256(vq, top2),                 \
                                                   _mm256_andnot_si256(                        \
                                                       top2, _mm256_srli_epi16(vr, 2))),       \
                                   above2)                                                     \
                : _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(vr, 4), nibble),          \
                                  _mm256_and_si256(_mm256_srli_epi16(vq, 2), top));            \
        }
        if (R > 1)
            for (int n = 0; n < 2; n++)
                for (int s = 0; s < 8; s++) {
                    __m256i w[4];
                    Q6_UNPACK(n, s, w)
                    for (int g = 0; g < 4; g++) wq[32 * n + 8 * g + s] = w[g];
                }
        for (int i = 0; i < R; i++) {
            const int8_t* xh = a[i].q + 256 * b;
            const int8_t* xl = TWO ? a[i].l + 256 * b : NULL;
            const float* xs16 = a[i].xs16 + 16 * b;
            __m256 m = _mm256_setzero_ps();
            for (int j = 0; j < 16; j++) m = _mm256_fmadd_ps(scf[j], _mm256_set1_ps(xs16[j]), m);
            off[i] = _mm256_fmadd_ps(d32, m, off[i]);
            __m256i ih = _mm256_setzero_si256(), il = _mm256_setzero_si256();
            for (int n = 0; n < 2; n++)
                for (int s0 = 0; s0 < 8; s0 += Q6_RUN) {  /* a run, then weighted */
                    __m256i sh[4], sl[4];
                    for (int g = 0; g < 4; g++) sh[g] = sl[g] = _mm256_setzero_si256();
                    for (int s = s0; s < s0 + Q6_RUN; s++) {
                        __m256i w[4];
                        if (R == 1) {
                            Q6_UNPACK(n, s, w)
                        } else {
                            for (int g = 0; g < 4; g++) w[g] = wq[32 * n + 8 * g + s];
                        }
                        for (int g = 0; g < 4; g++) {
                            const int at = 128 * n + 32 * g + 4 * s;
                            sh[g] = run_add(sh[g], w[g], bcast4(xh + at));
                            if (TWO) sl[g] = run_add(sl[g], w[g], bcast4(xl + at));
                        }
                    }
                    if (HIGH_IN_PLACE) {  /* group 3's sums: 4 times its quants' */
                        sh[3] = _mm256_srai_epi32(sh[3], 2);
                        if (TWO) sl[3] = _mm256_srai_epi32(sl[3], 2);
                    }
                    for (int g = 0; g < 4; g++) {  /* sub-block 8 n + 2 g + (step >= 4) */
                        const __m256i sc = scale[8 * n + 2 * g + (s0 >= 4)];
                        ih = run_weighted(ih, sh[g], sc);
                        if (TWO) il = run_weighted(il, sl[g], sc);
                    }
                }
            acc[i] = add_super(acc[i], d, ih, il, a[i].dx[8 * b], TWO);
        }
#undef Q6_UNPACK
    }
    for (int i = 0; i < R; i++) _mm256_storeu_ps(out + 8 * i, _mm256_sub_ps(acc[i], off[i]));
}

enum { B32_Q4_0, B32_Q4_1, B32_Q5_0, B32_Q5_1, B32_Q8_0 }; /* b32_rows' KIND */

/* One group of a 32-value type's x8 layout (KIND: Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0) against
 * rows a[0 .. R): out[8 i + c]. A block's integer per channel (256 h + l with two digits: at
 * most 32 * 127 * 127 * 257, in int32) meets d_c dx once; Q4_0's and Q5_0's offsets (8, 16)
 * through 8 or 16 d_c xs, the _1 types' minimum through m_c xs.
 * 4- and 5-bit types, per step s (0 .. 3): the 32 bytes of qs give inputs 4s .. 4s + 3 (low
 * nibbles) and 16 + 4s .. (high) of the 8 channels; Q5's fifth bits come from byte s of each
 * channel's 4 (broadcast within the lane, one bit per byte tested). AVX2 sums each half's 4
 * steps in int16 (at most 8 * 31 * 127). Q8_0, per step s (0 .. 7): 4 signed quants per
 * channel, met as |w| against the digits with w's sign (as ggml does); AVX2 weights each step's
 * pairs at once. */
static inline __attribute__((always_inline)) void b32_rows(
        const uint8_t* group, int64_t nb, const ggml_act_row* a, const int R, const int TWO,
        const int KIND, float* out) {
    const int Q8 = KIND == B32_Q8_0, MIN = KIND == B32_Q4_1 || KIND == B32_Q5_1;
    const int FIFTH = KIND == B32_Q5_0 || KIND == B32_Q5_1;
    /* the offset of a type without a minimum (q - 8 or q - 16: Q8_0's is 0) */
    const float offset = KIND == B32_Q4_0 ? 8.0f : KIND == B32_Q5_0 ? 16.0f : 0.0f;
    const __m256i nibble = _mm256_set1_epi8(0xF), fifth = _mm256_set1_epi8(0x10);
    const __m256i low_bits = _mm256_set1_epi32(0x08040201), high_bits = _mm256_set1_epi32(
        (int)0x80402010u);
    const int block = X8_CHANNELS * (Q8 ? 34 : 2 + 2 * MIN + 4 * FIFTH + 16);
    const int bits_at = 16 + 16 * MIN, qs_at = Q8 ? 16 : bits_at + 32 * FIFTH;
    /* PSHUFB's index of each int32 lane's first byte (within its 128-bit half), in all 4 */
    const __m256i lane_bytes = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0,
                                                 0x04040404, 0x08080808, 0x0c0c0c0c);
    __m256 acc[X8_ROWS], off[X8_ROWS];
    __m256i wq[8], wx[8];  /* R > 1: a block's unsigned quants (and Q8_0's signs) per step */
    for (int i = 0; i < R; i++) acc[i] = off[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = group + b * block;
        prefetch_x8(blk, block);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
        __m256i bits = _mm256_setzero_si256();
        if (FIFTH) bits = _mm256_loadu_si256((const __m256i*)(blk + bits_at));
        const uint8_t* qs = blk + qs_at;
        /* the block's offset or minimum per channel, times xs (subtracted at the end) */
        __m256 off_scale = _mm256_setzero_ps();
        if (MIN)
            off_scale = _mm256_sub_ps(off_scale, _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i*)(blk + 16))));
        else if (!Q8)
            off_scale = _mm256_mul_ps(d, _mm256_set1_ps(offset));
#define B32_QUANTS(S, W, X)                                                                    \
        if (Q8) {                                                                              \
            const __m256i raw_ = _mm256_loadu_si256((const __m256i*)(qs + 32 * (S)));          \
            W = _mm256_sign_epi8(raw_, raw_), X = raw_;                                        \
        } else if (!FIFTH) {                                                                   \
            const __m256i raw_ = _mm256_loadu_si256((const __m256i*)(qs + 32 * (S)));          \
            W = _mm256_and_si256(raw_, nibble);                                                \
            X = _mm256_and_si256(_mm256_srli_epi16(raw_, 4), nibble);                          \
        } else {                                                                               \
            const __m256i raw_ = _mm256_loadu_si256((const __m256i*)(qs + 32 * (S)));          \
            /* byte S of each lane in all 4 of its bytes */                                    \
            const __m256i spread = _mm256_shuffle_epi8(bits, _mm256_add_epi32(                  \
                _mm256_set1_epi32(0x01010101 * (S)), lane_bytes));                              \
            W = _mm256_or_si256(_mm256_and_si256(raw_, nibble), _mm256_and_si256(                 \
                _mm256_cmpeq_epi8(_mm256_and_si256(spread, low_bits), low_bits), fifth));     \
            X = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw_, 4), nibble),            \
                _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, high_bits),       \
                                                   high_bits), fifth));                        \
        }
        if (R > 1) {
            for (int t = 0; t < (Q8 ? 8 : 4); t++) {
                B32_QUANTS(t, wq[t], wx[t])
            }
        }
        for (int i = 0; i < R; i++) {
            const int8_t* xh = a[i].q + 32 * b;
            const int8_t* xl = TWO ? a[i].l + 32 * b : NULL;
            __m256i ih = _mm256_setzero_si256(), il = ih;
            if (Q8) {
                for (int t = 0; t < 8; t++) {
                    __m256i u, v;
                    if (R == 1) {
                        B32_QUANTS(t, u, v)
                    } else {
                        u = wq[t], v = wx[t];
                    }
                    /* a step at a time: its pairs may reach 2 * 127 * 127 in int16 */
                    ih = add_step(ih, u, _mm256_sign_epi8(bcast4(xh + 4 * t), v));
                    if (TWO) il = add_step(il, u, _mm256_sign_epi8(bcast4(xl + 4 * t), v));
                }
            } else {
                __m256i lo_h = _mm256_setzero_si256(), hi_h = lo_h, lo_l = lo_h, hi_l = lo_h;
                for (int t = 0; t < 4; t++) {
                    __m256i wl, wh;
                    if (R == 1) {
                        B32_QUANTS(t, wl, wh)
                    } else {
                        wl = wq[t], wh = wx[t];
                    }
                    lo_h = run_add(lo_h, wl, bcast4(xh + 4 * t));
                    hi_h = run_add(hi_h, wh, bcast4(xh + 16 + 4 * t));
                    if (TWO) {
                        lo_l = run_add(lo_l, wl, bcast4(xl + 4 * t));
                        hi_l = run_add(hi_l, wh, bcast4(xl + 16 + 4 * t));
                    }
                }
                ih = run_sum(run_sum(ih, lo_h), hi_h);
                if (TWO) il = run_sum(run_sum(il, lo_l), hi_l);
            }
            if (TWO) ih = _mm256_add_epi32(_mm256_slli_epi32(ih, 8), il);
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[i].dx[b])),
                                     _mm256_cvtepi32_ps(ih), acc[i]);
            if (!Q8) off[i] = _mm256_fmadd_ps(off_scale, _mm256_set1_ps(a[i].xs[b]), off[i]);
        }
#undef B32_QUANTS
    }
    for (int i = 0; i < R; i++) _mm256_storeu_ps(out + 8 * i, _mm256_sub_ps(acc[i], off[i]));
}

#define B32_ROWS(T, KIND)                                                                      \
    static inline __attribute__((always_inline)) void T##_rows(                                \
            const uint8_t* group, int64_t nb, const ggml_act_row* a, const int R,              \
            const int TWO, float* out) {                                                       \
        b32_rows(group, nb, a, R, TWO, KIND, out);                                             \
    }
B32_ROWS(q40, B32_Q4_0)
B32_ROWS(q41, B32_Q4_1)
B32_ROWS(q50, B32_Q5_0)
B32_ROWS(q51, B32_Q5_1)
B32_ROWS(q80, B32_Q8_0)
#undef B32_ROWS

/* instances for one row (R a constant: its sums stay in registers) and for any count, each
 * for one and two digits */
#define X8(NAME, FN, R, TWO)                                                                   \
    static void NAME(const uint8_t* group, int64_t nb, const ggml_act_row* a, int rows,       \
                     float* out) {                                                             \
        (void)rows;                                                                            \
        FN(group, nb, a, R, TWO, out);                                                         \
    }
/* the four of one layout's rows kernel */
#define X8_ALL(T)                                                                              \
    X8(T##_one_1, T##_rows, 1, 0)                                                              \
    X8(T##_one_2, T##_rows, 1, 1)                                                              \
    X8(T##_many_1, T##_rows, rows, 0)                                                          \
    X8(T##_many_2, T##_rows, rows, 1)
X8_ALL(q4k)
X8_ALL(q5k)
X8_ALL(q6k)
X8_ALL(q50)
X8_ALL(q80)
X8_ALL(q40)
X8_ALL(q41)
X8_ALL(q51)
#undef X8_ALL
#undef X8

typedef void (*x8_fn)(const uint8_t*, int64_t, const ggml_act_row*, int, float*);

/* One group of an x8 weight of `type` (nb super-blocks per channel) against rows a[0 .. rows)
 * (rows <= 16, all with the same number of digits): out [rows, 8]. */
void mm_ggml_x8_rows(int type, const uint8_t* group, int64_t nb, const ggml_act_row* a,
                     int rows, float* out) {
    static const x8_fn fns[N_LAYOUTS][2][2] = {  /* [LAYOUTS' order][many rows][two digits] */
        {{q4k_one_1, q4k_one_2}, {q4k_many_1, q4k_many_2}},
        {{q5k_one_1, q5k_one_2}, {q5k_many_1, q5k_many_2}},
        {{q6k_one_1, q6k_one_2}, {q6k_many_1, q6k_many_2}},
        {{q50_one_1, q50_one_2}, {q50_many_1, q50_many_2}},
        {{q80_one_1, q80_one_2}, {q80_many_1, q80_many_2}},
        {{q40_one_1, q40_one_2}, {q40_many_1, q40_many_2}},
        {{q41_one_1, q41_one_2}, {q41_many_1, q41_many_2}},
        {{q51_one_1, q51_one_2}, {q51_many_1, q51_many_2}}};
    const int at = (int)(layout_of(-1, type) - LAYOUTS);
    fns[at][rows > 1][a->l != NULL](group, nb, a, rows, out);
}

#ifdef MM_AVX512_VNNI
/* Two groups side by side for a verify's rows: 16 channels, the first group's in int32 lanes
 * 0 .. 7, the second's in 8 .. 15, so that one 512-bit VPDPBUSD meets both groups' quants where
 * the 256-bit one above meets one group's (a verify's rows are bound by their integer work,
 * which takes half the instructions). Each lane's operations are the one-group kernels' (the
 * same integer sums, then the same float operations in the same order), so every row's results
 * are the one-row call's, to the bit. Q4_K and Q6_K (a Q4_K_M file's types); rows in tiles of
 * X8_PAIR_TILE sharing each step's quants in registers. */
#define X8_PAIR_TILE 3
/* acc += dot(u8 lanes of A, s8 lanes of B), written as an instruction whose accumulator the
 * compiler keeps in place (as linear_int4.c's DPBUSD: GCC copies the intrinsic's) */
#define DPBUSD512(ACC, A, B) __asm__("vpdpbusd %2, %1, %0" : "+v"(ACC) : "v"(A), "v"(B))

static inline __m512i pair_vectors(const uint8_t* p0, const uint8_t* p1) {  /* 32 bytes each */
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p0)),
                              _mm256_loadu_si256((const __m256i*)p1), 1);
}

static inline __m512 pair_halves(const uint8_t* p0, const uint8_t* p1) {  /* 8 float16 each */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p0)),
        _mm_loadu_si128((const __m128i*)p1), 1));
}

static inline __m128i pair_bytes(const uint8_t* p0, const uint8_t* p1) {  /* 8 bytes each */
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)p0),
                              _mm_loadl_epi64((const __m128i*)p1));
}

static inline __m512i bcast4_512(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline void in_register512(__m512i* v) {
    __asm__("" : "+v"(*v));
}

/* add_super's operations on 16 lanes */
static inline __m512 add_super512(__m512 acc, __m512 d, __m512i ih, __m512i il, float unit,
                                  const int TWO) {
    __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(ih),
                               _mm512_set1_ps(TWO ? 256.0f * unit : unit));
    if (TWO) sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(il), _mm512_set1_ps(unit), sum);
    return _mm512_fmadd_ps(d, sum, acc);
}

/* q4k_tile's rows a[0 .. T) against a pair's super-block b, its quants unpacked (lo, hi) */
static inline __attribute__((always_inline)) void q4k_pair_tile(
        const __m512i* lo, const __m512i* hi, const __m512i* scale, const __m512* mins,
        __m512 d, __m512 dmin, const ggml_act_row* a, int64_t b, const int T, const int TWO,
        __m512* acc, __m512* off) {
    for (int r = 0; r < T; r++) {
        const float* xs = a[r].xs + 8 * b;
        __m512 m = _mm512_setzero_ps();
        for (int j = 0; j < 8; j++) m = _mm512_fmadd_ps(mins[j], _mm512_set1_ps(xs[j]), m);
        off[r] = _mm512_fmadd_ps(dmin, m, off[r]);
    }
    __m512i ih[X8_PAIR_TILE], il[X8_PAIR_TILE];
    const int8_t *xh[X8_PAIR_TILE], *xl[X8_PAIR_TILE];
    for (int r = 0; r < T; r++) {
        ih[r] = il[r] = _mm512_setzero_si512();
        xh[r] = a[r].q + 256 * b, xl[r] = TWO ? a[r].l + 256 * b : NULL;
    }
    for (int p = 0; p < 4; p++) {
        __m512i lo_h[X8_PAIR_TILE], hi_h[X8_PAIR_TILE], lo_l[X8_PAIR_TILE], hi_l[X8_PAIR_TILE];
        for (int r = 0; r < T; r++)
            lo_h[r] = hi_h[r] = lo_l[r] = hi_l[r] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            const int t = 8 * p + s, at = 64 * p + 4 * s;
            __m512i wl = lo[t], wh = hi[t];
            in_register512(&wl), in_register512(&wh);
            for (int r = 0; r < T; r++) {
                DPBUSD512(lo_h[r], wl, bcast4_512(xh[r] + at));
                DPBUSD512(hi_h[r], wh, bcast4_512(xh[r] + at + 32));
                if (TWO) {
                    DPBUSD512(lo_l[r], wl, bcast4_512(xl[r] + at));
                    DPBUSD512(hi_l[r], wh, bcast4_512(xl[r] + at + 32));
                }
            }
        }
        for (int r = 0; r < T; r++) {  /* the high nibbles met in place (16 q) */
            hi_h[r] = _mm512_srai_epi32(hi_h[r], 4);
            ih[r] = _mm512_add_epi32(_mm512_add_epi32(ih[r], _mm512_mullo_epi32(lo_h[r],
                                                                                 scale[2 * p])),
                                     _mm512_mullo_epi32(hi_h[r], scale[2 * p + 1]));
            if (TWO) {
                hi_l[r] = _mm512_srai_epi32(hi_l[r], 4);
                il[r] = _mm512_add_epi32(
                    _mm512_add_epi32(il[r], _mm512_mullo_epi32(lo_l[r], scale[2 * p])),
                    _mm512_mullo_epi32(hi_l[r], scale[2 * p + 1]));
            }
        }
    }
    for (int r = 0; r < T; r++)
        acc[r] = add_super512(acc[r], d, ih[r], il[r], a[r].dx[8 * b], TWO);
}

/* Two Q4_K_X8 groups (g0's channels then g1's) against rows a[0 .. R): out[16 i + c] */
static inline __attribute__((always_inline)) void q4k_pair_rows(
        const uint8_t* g0, const uint8_t* g1, int64_t nb, const ggml_act_row* a, int R,
        const int TWO, float* out) {
    const __m512i nibble = _mm512_set1_epi8(0xF), high = _mm512_set1_epi8((char)0xF0);
    __m512 acc[X8_ROWS], off[X8_ROWS];
    __m512i lo[32], hi[32];  /* a super-block's quants, per (pair, step) */
    for (int i = 0; i < R; i++) acc[i] = off[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *s0 = g0 + b * Q4K_X8_SUPER, *s1 = g1 + b * Q4K_X8_SUPER;
        prefetch_x8(s0, Q4K_X8_SUPER), prefetch_x8(s1, Q4K_X8_SUPER);
        const __m512 d = pair_halves(s0, s1), dmin = pair_halves(s0 + 16, s1 + 16);
        __m512i scale[8];
        __m512 mins[8];
        for (int j = 0; j < 8; j++) {
            scale[j] = _mm512_cvtepu8_epi32(pair_bytes(s0 + 32 + 8 * j, s1 + 32 + 8 * j));
            mins[j] = _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(pair_bytes(s0 + 96 + 8 * j, s1 + 96 + 8 * j)));
        }
        for (int t = 0; t < 32; t++) {
            const __m512i v = pair_vectors(s0 + 160 + 32 * t, s1 + 160 + 32 * t);
            lo[t] = _mm512_and_si512(v, nibble);
            hi[t] = _mm512_and_si512(v, high);
        }
        KEEP_UNPACKED(lo, hi);
        for (int i = 0; i < R; i += X8_PAIR_TILE) {
            const int n = R - i < X8_PAIR_TILE ? R - i : X8_PAIR_TILE;
#define Q4K_PAIR_TILE(T) \
            q4k_pair_tile(lo, hi, scale, mins, d, dmin, a + i, b, T, TWO, acc + i, off + i)
            if (n == 1) Q4K_PAIR_TILE(1);
            else if (n == 2) Q4K_PAIR_TILE(2);
            else Q4K_PAIR_TILE(X8_PAIR_TILE);
#undef Q4K_PAIR_TILE
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(out + 16 * i, _mm512_sub_ps(acc[i], off[i]));
}

/* q6k_rows' rows a[0 .. T) against a pair's super-block b, its quants unpacked (wq) */
static inline __attribute__((always_inline)) void q6k_pair_tile(
        const __m512i* wq, const __m512i* scale, const __m512* scf, __m512 d, __m512 d32,
        const ggml_act_row* a, int64_t b, const int T, const int TWO, __m512* acc,
        __m512* off) {
    __m512i ih[X8_PAIR_TILE], il[X8_PAIR_TILE];
    const int8_t *xh[X8_PAIR_TILE], *xl[X8_PAIR_TILE];
    for (int r = 0; r < T; r++) {
        const float* xs16 = a[r].xs16 + 16 * b;
        __m512 m = _mm512_setzero_ps();
        for (int j = 0; j < 16; j++) m = _mm512_fmadd_ps(scf[j], _mm512_set1_ps(xs16[j]), m);
        off[r] = _mm512_fmadd_ps(d32, m, off[r]);
        ih[r] = il[r] = _mm512_setzero_si512();
        xh[r] = a[r].q + 256 * b, xl[r] = TWO ? a[r].l + 256 * b : NULL;
    }
    for (int n = 0; n < 2; n++)
        for (int s0 = 0; s0 < 8; s0 += Q6_RUN) {  /* a run (a sub-block), then weighted */
            __m512i sh[X8_PAIR_TILE][4], sl[X8_PAIR_TILE][4];
            for (int r = 0; r < T; r++)
                for (int g = 0; g < 4; g++) sh[r][g] = sl[r][g] = _mm512_setzero_si512();
            for (int s = s0; s < s0 + Q6_RUN; s++)
                for (int g = 0; g < 4; g++) {
                    __m512i w = wq[32 * n + 8 * g + s];
                    in_register512(&w);
                    const int at = 128 * n + 32 * g + 4 * s;
                    for (int r = 0; r < T; r++) {
                        DPBUSD512(sh[r][g], w, bcast4_512(xh[r] + at));
                        if (TWO) DPBUSD512(sl[r][g], w, bcast4_512(xl[r] + at));
                    }
                }
            for (int r = 0; r < T; r++) {
                sh[r][3] = _mm512_srai_epi32(sh[r][3], 2);  /* group 3's: 4 times its quants' */
                if (TWO) sl[r][3] = _mm512_srai_epi32(sl[r][3], 2);
                for (int g = 0; g < 4; g++) {  /* sub-block 8 n + 2 g + (step >= 4) */
                    const __m512i sc = scale[8 * n + 2 * g + (s0 >= 4)];
                    ih[r] = _mm512_add_epi32(ih[r], _mm512_mullo_epi32(sh[r][g], sc));
                    if (TWO) il[r] = _mm512_add_epi32(il[r], _mm512_mullo_epi32(sl[r][g], sc));
                }
            }
        }
    for (int r = 0; r < T; r++)
        acc[r] = add_super512(acc[r], d, ih[r], il[r], a[r].dx[8 * b], TWO);
}

/* Two Q6_K_X8 groups (g0's channels then g1's) against rows a[0 .. R): out[16 i + c] */
static inline __attribute__((always_inline)) void q6k_pair_rows(
        const uint8_t* g0, const uint8_t* g1, int64_t nb, const ggml_act_row* a, int R,
        const int TWO, float* out) {
    const __m512i nibble = _mm512_set1_epi8(0xF), top = _mm512_set1_epi8(0x30);
    const __m512i six = _mm512_set1_epi8(0x3F), top2 = _mm512_set1_epi8((char)0xC0);
    const __m512i above2 = _mm512_set1_epi8((char)0xFC);
    __m512 acc[X8_ROWS], off[X8_ROWS];
    __m512i wq[64];  /* a super-block's quants (0 .. 63) per (half, group, step) */
    for (int i = 0; i < R; i++) acc[i] = off[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *s0 = g0 + b * Q6K_X8_SUPER, *s1 = g1 + b * Q6K_X8_SUPER;
        prefetch_x8(s0, Q6K_X8_SUPER), prefetch_x8(s1, Q6K_X8_SUPER);
        const __m512 d = pair_halves(s0, s1);
        const __m512 d32 = _mm512_mul_ps(d, _mm512_set1_ps(32.0f));
        __m512i scale[16];
        __m512 scf[16];
        for (int j = 0; j < 16; j++) {
            scale[j] = _mm512_cvtepi8_epi32(pair_bytes(s0 + 16 + 8 * j, s1 + 16 + 8 * j));
            scf[j] = _mm512_cvtepi32_ps(scale[j]);
        }
        for (int n = 0; n < 2; n++)
            for (int s = 0; s < 8; s++) {  /* q6k_rows' unpacking, in place (HIGH_IN_PLACE) */
                const int at = 144 + 96 * (8 * n + s);
                const __m512i vp = pair_vectors(s0 + at, s1 + at);
                const __m512i vq = pair_vectors(s0 + at + 32, s1 + at + 32);
                const __m512i vr = pair_vectors(s0 + at + 64, s1 + at + 64);
                wq[32 * n + s] = _mm512_and_si512(vp, six);
                wq[32 * n + 8 + s] = _mm512_and_si512(vq, six);
                wq[32 * n + 16 + s] = _mm512_or_si512(
                    _mm512_and_si512(vr, nibble),
                    _mm512_and_si512(_mm512_srli_epi16(vp, 2), top));
                wq[32 * n + 24 + s] = _mm512_and_si512(
                    _mm512_or_si512(_mm512_and_si512(vq, top2),
                                    _mm512_andnot_si512(top2, _mm512_srli_epi16(vr, 2))),
                    above2);
            }
        KEEP_UNPACKED(wq, wq);
        for (int i = 0; i < R; i += X8_PAIR_TILE) {
            const int n = R - i < X8_PAIR_TILE ? R - i : X8_PAIR_TILE;
#define Q6K_PAIR_TILE(T) \
            q6k_pair_tile(wq, scale, scf, d, d32, a + i, b, T, TWO, acc + i, off + i)
            if (n == 1) Q6K_PAIR_TILE(1);
            else if (n == 2) Q6K_PAIR_TILE(2);
            else Q6K_PAIR_TILE(X8_PAIR_TILE);
#undef Q6K_PAIR_TILE
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(out + 16 * i, _mm512_sub_ps(acc[i], off[i]));
}

static void q4k_pair_1(const uint8_t* g0, const uint8_t* g1, int64_t nb, const ggml_act_row* a,
                       int rows, float* out) {
    q4k_pair_rows(g0, g1, nb, a, rows, 0, out);
}
static void q4k_pair_2(const uint8_t* g0, const uint8_t* g1, int64_t nb, const ggml_act_row* a,
                       int rows, float* out) {
    q4k_pair_rows(g0, g1, nb, a, rows, 1, out);
}
static void q6k_pair_1(const uint8_t* g0, const uint8_t* g1, int64_t nb, const ggml_act_row* a,
                       int rows, float* out) {
    q6k_pair_rows(g0, g1, nb, a, rows, 0, out);
}
static void q6k_pair_2(const uint8_t* g0, const uint8_t* g1, int64_t nb, const ggml_act_row* a,
                       int rows, float* out) {
    q6k_pair_rows(g0, g1, nb, a, rows, 1, out);
}

int mm_ggml_x8_pairs(int type) {
    return type == GGML_Q4_K_X8 || type == GGML_Q6_K_X8;
}

/* Two consecutive groups g0, g1 of an x8 weight of `type` (mm_ggml_x8_pairs) against rows
 * a[0 .. rows) (2 <= rows <= 16, one number of digits): out [rows, 16], g0's channels first. */
void mm_ggml_x8_rows_pair(int type, const uint8_t* g0, const uint8_t* g1, int64_t nb,
                          const ggml_act_row* a, int rows, float* out) {
    const int two = a->l != NULL;
    if (type == GGML_Q4_K_X8) (two ? q4k_pair_2 : q4k_pair_1)(g0, g1, nb, a, rows, out);
    else (two ? q6k_pair_2 : q6k_pair_1)(g0, g1, nb, a, rows, out);
}
#else
int mm_ggml_x8_pairs(int type) {
    (void)type;
    return 0;
}

void mm_ggml_x8_rows_pair(int type, const uint8_t* g0, const uint8_t* g1, int64_t nb,
                          const ggml_act_row* a, int rows, float* out) {
    (void)type, (void)g0, (void)g1, (void)nb, (void)a;  /* never called: no pairs here */
    memset(out, 0, sizeof(float) * 16 * (size_t)rows);
}
#endif

#else
void mm_ggml_x8_rows(int type, const uint8_t* group, int64_t nb, const ggml_act_row* a,
                     int rows, float* out) {  /* never called: mm_ggml_repack_takes says no */
    (void)type, (void)group, (void)nb, (void)a;
    memset(out, 0, sizeof(float) * 8 * (size_t)rows);
}

int mm_ggml_x8_pairs(int type) {
    (void)type;
    return 0;
}

void mm_ggml_x8_rows_pair(int type, const uint8_t* g0, const uint8_t* g1, int64_t nb,
                          const ggml_act_row* a, int rows, float* out) {
    (void)type, (void)g0, (void)g1, (void)nb, (void)a;  /* never called: no pairs here */
    memset(out, 0, sizeof(float) * 16 * (size_t)rows);
}
#endif
