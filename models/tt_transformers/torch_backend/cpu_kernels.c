// SPDX-License-Identifier: Apache-2.0
// bf16 CPU kernels for decode and verification steps, built once per machine by cpu_kernels.py.
//
// Every output element is accumulated in one fixed order that does not depend on how many tokens share a
// call, so verifying n draft tokens reproduces n one-token decodes bit for bit (the lossless contract), and
// the weights stream from memory once per step for up to ~65 tokens.
#ifndef __AVX512BF16__
#error "these kernels need AVX512-BF16; without it the model runs on torch ops"
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);  // NaN stays NaN
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// ---- linear: y[M, N] = x[M, K] W[N, K]^T -------------------------------------------------------------------
// W is packed (by cpu_kernels.pack_weight) in blocks of 16 output rows: block b, k-pair p holds the 32 values
// W[16b + i][2p + j] at offset 2i + j, the operand layout of AVX512-BF16's dot-product instruction.
#define BLOCK 16
#define TILE_M 4
#define TILE_N 4  // blocks per tile: 4 x 4 accumulators of 16 lanes

static inline __attribute__((always_inline)) void store_row(const float *acc, void *y, int64_t n0, int64_t N,
                                                            int out_f32) {
    int64_t n = N - n0 < BLOCK ? N - n0 : BLOCK;
    for (int64_t i = 0; i < n; i++) {
        if (out_f32) ((float *)y)[n0 + i] = acc[i];
        else ((bf16 *)y)[n0 + i] = f32_to_bf16(acc[i]);
    }
}

// One tile: mt rows of x against nt weight blocks, over all of K. mt and nt are compile-time constants at every
// call site (see linear_tile_dispatch), so the accumulators live in registers.
static inline __attribute__((always_inline)) void linear_tile(const int mt, const int nt, const bf16 *x,
                                                              const bf16 *w, void *y, int64_t K, int64_t N,
                                                              int64_t m0, int64_t b0, int out_f32) {
    const int64_t pairs = K / 2, block_elems = (int64_t)BLOCK * K;
    float out[TILE_M][TILE_N][BLOCK] __attribute__((aligned(64)));
    __m512 acc[TILE_M][TILE_N];
    for (int m = 0; m < mt; m++)
        for (int n = 0; n < nt; n++) acc[m][n] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[TILE_N];
        for (int n = 0; n < nt; n++)
            wv[n] = (__m512bh)_mm512_loadu_si512((const void *)(w + (b0 + n) * block_elems + p * 2 * BLOCK));
        for (int m = 0; m < mt; m++) {
            int32_t pair;
            memcpy(&pair, x + (m0 + m) * K + 2 * p, 4);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int n = 0; n < nt; n++) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], wv[n], xv);
        }
    }
    for (int m = 0; m < mt; m++)
        for (int n = 0; n < nt; n++) _mm512_store_ps(out[m][n], acc[m][n]);
    const size_t elem = out_f32 ? 4 : 2;
    for (int m = 0; m < mt; m++)
        for (int n = 0; n < nt; n++)
            store_row(out[m][n], (char *)y + (m0 + m) * N * elem, (b0 + n) * BLOCK, N, out_f32);
}

#define TILE_CASE(MT, NT) \
    case (MT - 1) * TILE_N + NT - 1: linear_tile(MT, NT, x, w, y, K, N, m0, b0, out_f32); break;

static void linear_tile_dispatch(int mt, int nt, const bf16 *x, const bf16 *w, void *y, int64_t K, int64_t N,
                                 int64_t m0, int64_t b0, int out_f32) {
    switch ((mt - 1) * TILE_N + nt - 1) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
        TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(3, 4)
        TILE_CASE(4, 1) TILE_CASE(4, 2) TILE_CASE(4, 3) TILE_CASE(4, 4)
    }
}

// Each thread streams one contiguous range of weight blocks, and every row of x passes over a tile of blocks
// while it is still in cache.
void linear_bf16(const bf16 *x, const bf16 *w, void *y, int64_t M, int64_t K, int64_t N, int out_f32) {
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel
    {
        int64_t threads = 1, t = 0;
#ifdef _OPENMP
        threads = omp_get_num_threads();
        t = omp_get_thread_num();
#endif
        const int64_t begin = blocks * t / threads, end = blocks * (t + 1) / threads;
        for (int64_t b0 = begin; b0 < end; b0 += TILE_N) {
            const int nt = end - b0 < TILE_N ? (int)(end - b0) : TILE_N;
            for (int64_t m0 = 0; m0 < M; m0 += TILE_M)
                linear_tile_dispatch(M - m0 < TILE_M ? (int)(M - m0) : TILE_M, nt, x, w, y, K, N, m0, b0, out_f32);
        }
    }
}

// ---- elementwise ------------------------------------------------------------------------------------------------
static inline __m512 load16(const bf16 *p) {  // 16 bf16 -> 16 float
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}

static inline __m512 exp16(__m512 x) {  // Cephes expf: 2^k e^r with |r| <= ln2 / 2, about 1 ulp
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, k);
}

// out = weight * bf16(x * rsqrt(mean(x^2) + eps)) per row, with the bf16 roundings of the torch RMSNorm.
void rms_norm_bf16(const bf16 *x, const bf16 *weight, bf16 *out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *xr = x + r * dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) sum += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++)
            out[r * dim + i] = f32_to_bf16(bf16_to_f32(weight[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * inv)));
    }
}

// gate_up [rows, 2 hidden] (gate | up) -> out [rows, hidden] = bf16(bf16(silu(gate)) * up). hidden % 16 == 0.
void silu_mul_bf16(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t hidden) {
#pragma omp parallel for if (rows > 8)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < hidden; i += 16) {
            const __m512 g = load16(gate_up + r * 2 * hidden + i), u = load16(gate_up + r * 2 * hidden + hidden + i);
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            const __m512 rounded = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(silu));
            _mm256_storeu_si256((void *)(out + r * hidden + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(rounded, u)));
        }
}

// ---- the next tokens of each row of logits ---------------------------------------------------------------------
// The `want` largest values seen so far, descending, ties by earlier index (values arrive in index order); bar is the
// value a newcomer must beat once the list is full (its last entry).
typedef struct {
    float value[16];
    int64_t index[16];
    int have, want;
    float bar;
} TopList;

static inline void top_offer(TopList *top, float value, int64_t index) {
    if (top->have == top->want && !(value > top->bar)) return;
    int at = top->have < top->want ? top->have++ : top->want - 1;  // below every value >= this one
    while (at > 0 && top->value[at - 1] < value) {
        top->value[at] = top->value[at - 1];
        top->index[at] = top->index[at - 1];
        at--;
    }
    top->value[at] = value;
    top->index[at] = index;
    if (top->have == top->want) top->bar = top->value[top->want - 1];
}

// ids[r] = the index of row r's largest logit, the first one on ties (torch.argmax); top[r * k ..] = its k largest in
// descending order, ties by lower index (k <= 16, or 0: none). A row with a NaN gets ids[r] = -1 (the caller asks
// torch, whose argmax treats NaN as the largest). One pass over each row in 16-lane vectors: a vector with no
// lane above the current k-th best (or the running maximum) is skipped, so the top k cost about what argmax does.
void argmax_topk_f32(const float *logits, int64_t rows, int64_t V, int k, int64_t *ids, int64_t *top) {
#pragma omp parallel for if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * V;
        TopList best = {.have = 0, .want = k > 1 ? k : 1, .bar = -INFINITY};
        int nan = 0;
        int64_t i = 0;
        for (; i + 16 <= V && !nan; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
            __mmask16 above = best.have < best.want ? 0xffff
                                                    : _mm512_cmp_ps_mask(v, _mm512_set1_ps(best.bar), _CMP_GT_OQ);
            for (; above && !nan; above &= above - 1) {
                const int64_t at = i + __builtin_ctz(above);
                top_offer(&best, x[at], at);
            }
        }
        for (; i < V && !nan; i++) {
            nan = x[i] != x[i];
            if (!nan) top_offer(&best, x[i], i);
        }
        ids[r] = nan ? -1 : best.index[0];
        for (int j = 0; j < k; j++) top[r * k + j] = nan || j >= best.have ? -1 : best.index[j];
    }
}

// ---- attention for packed decode and verification steps ------------------------------------------------------
// qkv [n, (H + 2 Hk) D]: this step's projections. table [n, 7]: each token's cache row, cache slot it writes, position
// (rotary), first visible key, end of its contiguous run of keys, and where its other keys start in `ancestors` and
// how many there are. A token of a chain sees slots [first, slot] (the run ends at slot + 1, no other keys); a node of
// a token tree sees the cache before the tree ([first, start)) and then its ancestors' slots and its own, in depth
// order, so the keys are the same values in the same order as the chain of its path would have: the results are
// bit-identical. First every token's q and k are rotated at its position and its k and v written to its slot; then
// every query head of every token attends over exactly its keys, whatever else shares the step. Caches are [users,
// Hk, slots, D]; q_rot is bf16 scratch [n, H, D]; D % 32 == 0 and D <= 256.
enum { ROW, SLOT, POS, FIRST, RUN_END, ANC_START, ANC_COUNT, TABLE_COLUMNS };

static inline int64_t key_slot(const int64_t *entry, const int64_t *ancestors, int64_t j) {
    const int64_t run = entry[RUN_END] - entry[FIRST];
    return j < run ? entry[FIRST] + j : ancestors[entry[ANC_START] + j - run];
}

static void rotate(const bf16 *x, const bf16 *cos, const bf16 *sin, int64_t D, bf16 *out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < D; i++) {
        const float other = i < half ? -bf16_to_f32(x[i + half]) : bf16_to_f32(x[i - half]);
        out[i] = f32_to_bf16(bf16_to_f32(x[i]) * bf16_to_f32(cos[i]) + other * bf16_to_f32(sin[i]));
    }
}

// Lane j of the result = the sum of the 16 lanes of v[j] (a transposing reduction: 3 shuffle levels for 16
// vectors instead of a horizontal sum for each).
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  // 128-bit chunks: v[2i] in 0-1, v[2i+1] in 2-3
        pairs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                 _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  // chunk c: the 4 partial sums of v[4i + c]
        quads[i] = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[2 * i], pairs[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(pairs[2 * i], pairs[2 * i + 1], 0xDD));
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(quads[0], quads[1]), _mm512_unpackhi_ps(quads[0], quads[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(quads[2], quads[3]), _mm512_unpackhi_ps(quads[2], quads[3]));
    const __m512 sums = _mm512_add_ps(  // lane 4c + m: the sum of v[4m + c]
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

// The weighted sum of values for up to 4 query heads (probabilities p + gh * stride, gh < NG) over chunks c0 ..
// c0 + NC - 1 of 16 lanes: each value is loaded and widened once for all heads, and every head's accumulator adds
// the keys in order j = 0, 1, ..., so the sums are those of one head at a time. NG and NC are compile-time constants
// at every call site (see weigh_values), so the NG x NC accumulators live in registers.
static inline __attribute__((always_inline)) void weigh_values_tile(const int NG, const int NC, const bf16 *const *vals,
                                                                    const float *p, int64_t stride, int64_t len,
                                                                    int64_t c0, __m512 (*acc)[16]) {
    __m512 a[4][4];
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < NC; c++) a[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j++) {
        __m512 v[4];
        for (int c = 0; c < NC; c++) v[c] = load16(vals[j] + 16 * (c0 + c));
        for (int g = 0; g < NG; g++) {
            const __m512 pj = _mm512_set1_ps(p[g * stride + j]);
            for (int c = 0; c < NC; c++) a[g][c] = _mm512_fmadd_ps(pj, v[c], a[g][c]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < NC; c++) acc[g][c0 + c] = a[g][c];
}

#define WEIGH_CASE(NG, NC) \
    case (NG - 1) * 4 + NC - 1: weigh_values_tile(NG, NC, vals, p, stride, len, c0, acc); break;

static void weigh_values(int ng, int64_t chunks, const bf16 *const *vals, const float *p, int64_t stride,
                         int64_t len, __m512 (*acc)[16]) {
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
        const int nc = chunks - c0 < 4 ? (int)(chunks - c0) : 4;
        switch ((ng - 1) * 4 + nc - 1) {
            WEIGH_CASE(1, 1) WEIGH_CASE(1, 2) WEIGH_CASE(1, 3) WEIGH_CASE(1, 4)
            WEIGH_CASE(2, 1) WEIGH_CASE(2, 2) WEIGH_CASE(2, 3) WEIGH_CASE(2, 4)
            WEIGH_CASE(3, 1) WEIGH_CASE(3, 2) WEIGH_CASE(3, 3) WEIGH_CASE(3, 4)
            WEIGH_CASE(4, 1) WEIGH_CASE(4, 2) WEIGH_CASE(4, 3) WEIGH_CASE(4, 4)
        }
    }
}

// Up to 4 query heads of one token that share a key/value head: each key and value is read from the cache once for
// all of them (the step's cost over a long context is reading the cache). Per head the arithmetic is the same
// whichever heads share the call: the dot products, the softmax and then the values added in key order.
// p: scratch of 4 x stride floats, vals: of stride pointers.
static void attend_heads(const bf16 *q_rot, int ng, int64_t D, const int64_t *e, const int64_t *ancestors,
                         const bf16 *keys, const bf16 *values, float scale, float *p, int64_t stride,
                         const bf16 **vals, bf16 *out) {
    const int64_t len = e[RUN_END] - e[FIRST] + e[ANC_COUNT];
    __m512 top[4];
    for (int g = 0; g < ng; g++) top[g] = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < len; j0 += 16) {  // scores of 16 keys at a time
        const int64_t count = len - j0 < 16 ? len - j0 : 16;
        const __mmask16 valid = count == 16 ? 0xffff : (__mmask16)((1u << count) - 1);
        const bf16 *block[16];
        for (int64_t j = 0; j < count; j++) block[j] = keys + key_slot(e, ancestors, j0 + j) * D;
        for (int g = 0; g < ng; g++) {
            const bf16 *q = q_rot + g * D;
            __m512 dots[16];
            for (int64_t j = 0; j < 16; j++) {
                dots[j] = _mm512_setzero_ps();
                if (j >= count) continue;
                for (int64_t i = 0; i < D; i += 32)
                    dots[j] = _mm512_dpbf16_ps(dots[j], (__m512bh)_mm512_loadu_si512((const void *)(block[j] + i)),
                                               (__m512bh)_mm512_loadu_si512((const void *)(q + i)));
            }
            const __m512 scores16 = _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(scale));
            top[g] = _mm512_mask_max_ps(top[g], valid, top[g], scores16);
            _mm512_storeu_ps(p + g * stride + j0, scores16);
        }
    }
    float inv[4];
    for (int g = 0; g < ng; g++) {
        float *pg = p + g * stride;
        const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top[g]));
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; j += 16) {
            const __mmask16 valid = len - j >= 16 ? 0xffff : (__mmask16)((1u << (len - j)) - 1);
            const __m512 e16 = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(pg + j), max)));
            total = _mm512_add_ps(total, e16);
            _mm512_storeu_ps(pg + j, e16);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(total);
    }
    for (int64_t j = 0; j < len; j++) vals[j] = values + key_slot(e, ancestors, j) * D;
    __m512 acc[4][16];
    weigh_values(ng, D / 16, vals, p, stride, len, acc);
    for (int g = 0; g < ng; g++)
        for (int64_t c = 0; c < D / 16; c++)
            _mm256_storeu_si256((void *)(out + g * D + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g]))));
}

// Heads per work item: the query heads of one key/value head, in groups of up to 4, or single heads when there
// are too few tokens x groups to keep every thread busy (a one-token decode step).
static int64_t heads_per_item(int64_t n, int64_t H, int64_t Hk, int threads) {
    const int64_t G = H / Hk, group = G < 4 ? G : 4;
    return n * Hk * ((G + group - 1) / group) >= 2 * threads ? group : 1;
}

// scratch: per-thread floats (4 x stride of probabilities, then stride key pointers) for `threads` threads.
static int64_t scratch_floats(int64_t stride) {
    return 4 * stride + stride * (int64_t)(sizeof(bf16 *) / sizeof(float));
}

static void attend_exact(const bf16 *qkv, int64_t n, int64_t H, int64_t Hk, int64_t D, const int64_t *table,
                         const int64_t *ancestors, const bf16 *cos, const bf16 *sin, bf16 *k_cache, bf16 *v_cache,
                         int64_t slots, bf16 *q_rot, bf16 *out, float *scratch, int64_t stride, int threads) {
    const int64_t width = (H + 2 * Hk) * D, G = H / Hk, hp = heads_per_item(n, H, Hk, threads);
    const int64_t groups = (G + hp - 1) / hp;
    const float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel for num_threads(threads) if (n > 1)
    for (int64_t t = 0; t < n; t++) {
        const int64_t *e = table + TABLE_COLUMNS * t;
        const bf16 *x = qkv + t * width, *c = cos + e[POS] * D, *s = sin + e[POS] * D;
        for (int64_t h = 0; h < H; h++) rotate(x + h * D, c, s, D, q_rot + (t * H + h) * D);
        for (int64_t h = 0; h < Hk; h++) {
            const int64_t at = ((e[ROW] * Hk + h) * slots + e[SLOT]) * D;
            rotate(x + (H + h) * D, c, s, D, k_cache + at);
            memcpy(v_cache + at, x + (H + Hk + h) * D, D * sizeof(bf16));
        }
    }
#pragma omp parallel num_threads(threads)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        float *p = scratch + thread * scratch_floats(stride);
        const bf16 **vals = (const bf16 **)(p + 4 * stride);
#pragma omp for collapse(3) schedule(dynamic, 1)
        for (int64_t t = 0; t < n; t++)
            for (int64_t kv = 0; kv < Hk; kv++)
                for (int64_t group = 0; group < groups; group++) {
                    const int64_t *e = table + TABLE_COLUMNS * t, h = kv * G + group * hp;
                    const int ng = (int)(G - group * hp < hp ? G - group * hp : hp);
                    const int64_t at = (e[ROW] * Hk + kv) * slots * D;
                    attend_heads(q_rot + (t * H + h) * D, ng, D, e, ancestors, k_cache + at, v_cache + at, scale, p,
                                 stride, vals, out + (t * H + h) * D);
                }
    }
}

// ---- one decoder layer of a packed step: TransformerBlock.forward with the kernels above ----------------------
// x [n, dim] is the residual stream, updated in place; weights are packed as for linear_bf16.
static void add_bf16(bf16 *x, const bf16 *delta, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(delta[i]));
}

// The scratch a decoder_layer call needs, in bytes: bf16 activations for n tokens, then each of `threads` threads'
// attention scratch (scratch_floats) over up to max_keys keys. The caller allocates it once and reuses it
// (cpu_kernels.py).
static int64_t score_stride(int64_t max_keys) { return (max_keys + 15) / 16 * 16; }

static int64_t activation_bytes(int64_t n, int64_t dim, int64_t hidden, int64_t H, int64_t Hk, int64_t D) {
    const int64_t elems = n * (dim + (H + 2 * Hk) * D + 2 * H * D + 3 * hidden + dim);
    return (elems * (int64_t)sizeof(bf16) + 63) / 64 * 64;  // the float scores after it stay 64-byte aligned
}

int64_t decoder_layer_workspace_bytes(int64_t n, int64_t dim, int64_t hidden, int64_t H, int64_t Hk, int64_t D,
                                      int64_t max_keys, int threads) {
    return activation_bytes(n, dim, hidden, H, Hk, D) +
           threads * scratch_floats(score_stride(max_keys)) * (int64_t)sizeof(float);
}

void decoder_layer(bf16 *x, int64_t n, int64_t dim, int64_t hidden, int64_t H, int64_t Hk, int64_t D, float eps,
                   const bf16 *attention_norm, const bf16 *wqkv, const bf16 *wo, const bf16 *ffn_norm,
                   const bf16 *w_gate_up, const bf16 *w_down, const int64_t *table, const int64_t *ancestors,
                   const bf16 *cos, const bf16 *sin, bf16 *k_cache, bf16 *v_cache, int64_t slots, void *workspace,
                   int64_t max_keys, int threads) {
    const int64_t width = (H + 2 * Hk) * D;
    bf16 *normed = workspace, *qkv = normed + n * dim, *attn = qkv + n * width, *q_rot = attn + n * H * D;
    bf16 *gate_up = q_rot + n * H * D, *act = gate_up + n * 2 * hidden, *delta = act + n * hidden;
    float *scores = (float *)((char *)workspace + activation_bytes(n, dim, hidden, H, Hk, D));
    rms_norm_bf16(x, attention_norm, normed, n, dim, eps);
    linear_bf16(normed, wqkv, qkv, n, dim, width, 0);
    attend_exact(qkv, n, H, Hk, D, table, ancestors, cos, sin, k_cache, v_cache, slots, q_rot, attn, scores,
                 score_stride(max_keys), threads);
    linear_bf16(attn, wo, delta, n, H * D, dim, 0);
    add_bf16(x, delta, n * dim);
    rms_norm_bf16(x, ffn_norm, normed, n, dim, eps);
    linear_bf16(normed, w_gate_up, gate_up, n, dim, 2 * hidden, 0);
    silu_mul_bf16(gate_up, act, n, hidden);
    linear_bf16(act, w_down, delta, n, hidden, dim, 0);
    add_bf16(x, delta, n * dim);
}
