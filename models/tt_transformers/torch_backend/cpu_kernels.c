// SPDX-License-Identifier: Apache-2.0
// bf16 CPU kernels for decode and verification steps, and a prefill's attention (the section "prefill attention"),
// built once per machine and path by cpu_kernels.py.
//
// Every output element is accumulated in one fixed order that does not depend on how many tokens share a call, so
// verifying n draft tokens reproduces n one-token decodes bit for bit (the lossless contract), and the weights
// stream from memory once per step for up to ~65 tokens.
//
// One source, one build per path (cpu_kernels.py picks the path from the CPU's flags, or TT_CPU_ISA):
//   TT_ISA_AVX512BF16  x86-64 AVX512-BF16: dot products of bf16 pairs with vdpbf16ps
//   TT_ISA_AVX512      x86-64 AVX-512 (F, BW, VL, DQ): bf16 widened to float in registers, float sums
//   TT_ISA_AVX2        x86-64 AVX2 + FMA + F16C: the same
//   TT_ISA_NEON        aarch64 Advanced SIMD: the same
//   (none)             portable C: the same
// The widened paths do the same float operations in the same order, so they give identical results to each other
// and to the Python reference (tests/cpu_kernels_reference.py), which also models vdpbf16ps. Everything but the two
// dot products (linear_tile and key_dots) is shared: one 16-lane vector type, v16, with one implementation per path
// below, each doing exactly the IEEE single-precision operation its name says. Built with -ffp-contract=off: no
// multiply-add is fused unless written so (only where the product is exact, which makes it the same number).
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef uint16_t bf16;

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bf16_to_f32(bf16 v) { return bits_to_f32((uint32_t)v << 16); }

static inline bf16 f32_to_bf16(float f) {  // round to nearest even, as torch does; NaN stays NaN
    const uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// ---- v16: 16 float lanes ---------------------------------------------------------------------------------------
// v_load_pairs splits 32 bf16 stored as 16 pairs (lane i: elements 2i, 2i + 1) into the even and odd elements.
// v_madd_exact(a, b, c) = a * b + c where a * b is exact in float (a product of two bf16, or of a bf16 and a float of
// 16 significant bits): fused or not, one rounding.
// v_reduce_add adds halves: lanes i and i + 8, then i and i + 4, i and i + 2, and the last two.
// v_where_greater(x, bar, a): a where x > bar, else 0 (NaN: 0).
#if defined(TT_ISA_AVX512BF16) || defined(TT_ISA_AVX512)
#include <immintrin.h>
#define TILE_M 4  // linear: rows per register tile (see linear_bf16)
#define TILE_N 4  // blocks of 16 outputs per register tile of several rows
#define ONE_ROW_N 4  // and of one row
#define PREFETCH_PAIRS 256  // how far ahead to prefetch the weights into L2 (0: the hardware's prefetchers alone)
#define WEIGH_CHUNKS 4  // attention: 16-lane chunks of a head's output per register tile
typedef __m512 v16;
typedef uint32_t lanes16;
static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_set1(float a) { return _mm512_set1_ps(a); }
static inline v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, v16 a) { _mm512_storeu_ps(p, a); }
static inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
static inline v16 v_min(v16 a, v16 b) { return _mm512_min_ps(a, b); }
static inline v16 v_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
static inline v16 v_madd_exact(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v_rint(v16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline v16 v_load_bf16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}
static inline void v_load_pairs(const bf16 *p, v16 *even, v16 *odd) {
    const __m512i raw = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline v16 v_bf16_round(v16 a) {  // f32_to_bf16, kept as float
    const __m512i u = _mm512_castps_si512(a);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    const __m512i out = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(_mm512_and_si512(out, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void v_store_bf16(bf16 *p, v16 a) {
    const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(v_bf16_round(a)), 16);
    _mm256_storeu_si256((void *)p, _mm512_cvtepi32_epi16(high));
}
static inline v16 v_pow2(__m512i k) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k, _mm512_set1_epi32(127)), 23)); }
static inline v16 v_ldexp(v16 y, v16 k) {  // y * 2^k for whole k in [-127, 127], rounded once: y * 2^(k/2) * 2^(k - k/2)
    const __m512i ki = _mm512_cvttps_epi32(k), k1 = _mm512_srai_epi32(ki, 1);
    return _mm512_mul_ps(_mm512_mul_ps(y, v_pow2(k1)), v_pow2(_mm512_sub_epi32(ki, k1)));
}
static inline float v_reduce_add(v16 a) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
static inline float v_reduce_max(v16 a) { return _mm512_reduce_max_ps(a); }
static inline lanes16 v_greater(v16 a, float b) { return _mm512_cmp_ps_mask(a, _mm512_set1_ps(b), _CMP_GT_OQ); }
static inline lanes16 v_nan(v16 a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
static inline v16 v_where_greater(v16 x, float bar, v16 a) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(bar), _CMP_GT_OQ), a);
}
// Lane j = v_reduce_add(v[j]) for 16 vectors at once: the same additions, transposed (3 shuffle levels instead of a
// horizontal sum for each).
static inline v16 v_sum_lanes16(const v16 *v) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  // lanes i and i + 8
        pairs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                 _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  // then i and i + 4
        quads[i] = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[2 * i], pairs[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(pairs[2 * i], pairs[2 * i + 1], 0xDD));
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(quads[0], quads[1]), _mm512_unpackhi_ps(quads[0], quads[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(quads[2], quads[3]), _mm512_unpackhi_ps(quads[2], quads[3]));
    const __m512 sums = _mm512_add_ps(  // lane 4c + m: the sum of v[4m + c]
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

#elif defined(TT_ISA_AVX2)
#include <immintrin.h>
#define TILE_M 5  // 5 rows x 2 halves: 10 accumulators of 16 registers
#define TILE_N 1
#define ONE_ROW_N 1
#define PREFETCH_PAIRS 192  // the rows' multiply-adds keep the core busy: ask for the weights well ahead
#define WEIGH_CHUNKS 1
typedef struct { __m256 lo, hi; } v16;
typedef uint32_t lanes16;
static inline v16 v_of(__m256 lo, __m256 hi) { v16 r = {lo, hi}; return r; }
#define V16_BINARY(name, op) \
    static inline v16 name(v16 a, v16 b) { return v_of(op(a.lo, b.lo), op(a.hi, b.hi)); }
V16_BINARY(v_add, _mm256_add_ps)
V16_BINARY(v_sub, _mm256_sub_ps)
V16_BINARY(v_mul, _mm256_mul_ps)
V16_BINARY(v_div, _mm256_div_ps)
V16_BINARY(v_min, _mm256_min_ps)
V16_BINARY(v_max, _mm256_max_ps)
static inline v16 v_zero(void) { return v_of(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline v16 v_set1(float a) { return v_of(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
static inline v16 v_load(const float *p) { return v_of(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void v_store(float *p, v16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline v16 v_madd_exact(v16 a, v16 b, v16 c) {
    return v_of(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline v16 v_rint(v16 a) {
    return v_of(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline __m256 widen8(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16));
}
static inline v16 v_load_bf16(const bf16 *p) { return v_of(widen8(p), widen8(p + 8)); }
static inline void v_load_pairs(const bf16 *p, v16 *even, v16 *odd) {
    const __m256i mask = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i a = _mm256_loadu_si256((const void *)p), b = _mm256_loadu_si256((const void *)(p + 16));
    *even = v_of(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)));
    *odd = v_of(_mm256_castsi256_ps(_mm256_and_si256(a, mask)), _mm256_castsi256_ps(_mm256_and_si256(b, mask)));
}
static inline __m256i bf16_round8(__m256 a) {  // f32_to_bf16 in the high half of each lane
    const __m256i u = _mm256_castps_si256(a);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    const __m256i out = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
    return _mm256_and_si256(out, _mm256_set1_epi32((int)0xffff0000u));
}
static inline v16 v_bf16_round(v16 a) {
    return v_of(_mm256_castsi256_ps(bf16_round8(a.lo)), _mm256_castsi256_ps(bf16_round8(a.hi)));
}
static inline void v_store_bf16(bf16 *p, v16 a) {
    const __m256i lo = _mm256_srli_epi32(bf16_round8(a.lo), 16), hi = _mm256_srli_epi32(bf16_round8(a.hi), 16);
    _mm256_storeu_si256((void *)p, _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
}
static inline __m256 pow2_8(__m256i k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); }
static inline __m256 ldexp8(__m256 y, __m256 k) {
    const __m256i ki = _mm256_cvttps_epi32(k), k1 = _mm256_srai_epi32(ki, 1);
    return _mm256_mul_ps(_mm256_mul_ps(y, pow2_8(k1)), pow2_8(_mm256_sub_epi32(ki, k1)));
}
static inline v16 v_ldexp(v16 y, v16 k) { return v_of(ldexp8(y.lo, k.lo), ldexp8(y.hi, k.hi)); }
static inline float v_reduce_add(v16 a) {
    const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
static inline float v_reduce_max(v16 a) {
    const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
static inline lanes16 v_greater(v16 a, float b) {
    const __m256 bv = _mm256_set1_ps(b);
    return (lanes16)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, bv, _CMP_GT_OQ)) |
           (lanes16)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, bv, _CMP_GT_OQ)) << 8;
}
static inline lanes16 v_nan(v16 a) {
    return (lanes16)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q)) |
           (lanes16)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)) << 8;
}
static inline v16 v_where_greater(v16 x, float bar, v16 a) {
    const __m256 b = _mm256_set1_ps(bar);
    return v_of(_mm256_and_ps(_mm256_cmp_ps(x.lo, b, _CMP_GT_OQ), a.lo),
                _mm256_and_ps(_mm256_cmp_ps(x.hi, b, _CMP_GT_OQ), a.hi));
}

#elif defined(TT_ISA_NEON)
#include <arm_neon.h>
#define TILE_M 4
#define TILE_N 1
#define ONE_ROW_N 4
#define PREFETCH_PAIRS 0
#define WEIGH_CHUNKS 1
typedef struct { float32x4_t q[4]; } v16;
typedef uint32_t lanes16;
#define V16_BINARY(name, op)                                   \
    static inline v16 name(v16 a, v16 b) {                     \
        v16 r;                                                 \
        for (int i = 0; i < 4; i++) r.q[i] = op(a.q[i], b.q[i]); \
        return r;                                              \
    }
V16_BINARY(v_add, vaddq_f32)
V16_BINARY(v_sub, vsubq_f32)
V16_BINARY(v_mul, vmulq_f32)
V16_BINARY(v_div, vdivq_f32)
V16_BINARY(v_min, vminq_f32)
V16_BINARY(v_max, vmaxq_f32)
static inline v16 v_set1(float a) {
    v16 r;
    for (int i = 0; i < 4; i++) r.q[i] = vdupq_n_f32(a);
    return r;
}
static inline v16 v_zero(void) { return v_set1(0.0f); }
static inline v16 v_load(const float *p) {
    v16 r;
    for (int i = 0; i < 4; i++) r.q[i] = vld1q_f32(p + 4 * i);
    return r;
}
static inline void v_store(float *p, v16 a) {
    for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, a.q[i]);
}
static inline v16 v_madd_exact(v16 a, v16 b, v16 c) {
    v16 r;
    for (int i = 0; i < 4; i++) r.q[i] = vfmaq_f32(c.q[i], a.q[i], b.q[i]);
    return r;
}
static inline v16 v_rint(v16 a) {
    v16 r;
    for (int i = 0; i < 4; i++) r.q[i] = vrndnq_f32(a.q[i]);
    return r;
}
static inline v16 v_load_bf16(const bf16 *p) {
    v16 r;
    for (int i = 0; i < 2; i++) {
        const uint16x8_t h = vld1q_u16(p + 8 * i);
        r.q[2 * i] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
        r.q[2 * i + 1] = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
    }
    return r;
}
static inline void v_load_pairs(const bf16 *p, v16 *even, v16 *odd) {
    for (int i = 0; i < 4; i++) {
        const uint32x4_t raw = vld1q_u32((const uint32_t *)(p + 8 * i));
        even->q[i] = vreinterpretq_f32_u32(vshlq_n_u32(raw, 16));
        odd->q[i] = vreinterpretq_f32_u32(vandq_u32(raw, vdupq_n_u32(0xffff0000u)));
    }
}
static inline uint32x4_t bf16_round4(float32x4_t a) {  // f32_to_bf16 in the high half of each lane
    const uint32x4_t u = vreinterpretq_u32_f32(a);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t rounded = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), odd);
    const uint32x4_t number = vceqq_f32(a, a);
    const uint32x4_t out = vbslq_u32(number, rounded, vorrq_u32(u, vdupq_n_u32(0x00400000)));
    return vandq_u32(out, vdupq_n_u32(0xffff0000u));
}
static inline v16 v_bf16_round(v16 a) {
    v16 r;
    for (int i = 0; i < 4; i++) r.q[i] = vreinterpretq_f32_u32(bf16_round4(a.q[i]));
    return r;
}
static inline void v_store_bf16(bf16 *p, v16 a) {
    for (int i = 0; i < 4; i++) vst1_u16(p + 4 * i, vshrn_n_u32(bf16_round4(a.q[i]), 16));
}
static inline float32x4_t pow2_4(int32x4_t k) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k, vdupq_n_s32(127)), 23));
}
static inline v16 v_ldexp(v16 y, v16 k) {
    v16 r;
    for (int i = 0; i < 4; i++) {
        const int32x4_t ki = vcvtq_s32_f32(k.q[i]), k1 = vshrq_n_s32(ki, 1);
        r.q[i] = vmulq_f32(vmulq_f32(y.q[i], pow2_4(k1)), pow2_4(vsubq_s32(ki, k1)));
    }
    return r;
}
static inline float v_reduce_add(v16 a) {
    const float32x4_t s4 = vaddq_f32(vaddq_f32(a.q[0], a.q[2]), vaddq_f32(a.q[1], a.q[3]));
    const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
    return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
}
static inline float v_reduce_max(v16 a) {
    return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.q[0], a.q[1]), vmaxq_f32(a.q[2], a.q[3])));
}
static inline lanes16 lane_bits(const uint32x4_t *m) {
    const uint32x4_t weights = {1, 2, 4, 8};
    lanes16 bits = 0;
    for (int i = 0; i < 4; i++) bits |= vaddvq_u32(vandq_u32(m[i], weights)) << (4 * i);
    return bits;
}
static inline lanes16 v_greater(v16 a, float b) {
    uint32x4_t m[4];
    for (int i = 0; i < 4; i++) m[i] = vcgtq_f32(a.q[i], vdupq_n_f32(b));
    return lane_bits(m);
}
static inline lanes16 v_nan(v16 a) {
    uint32x4_t m[4];
    for (int i = 0; i < 4; i++) m[i] = vmvnq_u32(vceqq_f32(a.q[i], a.q[i]));
    return lane_bits(m);
}
static inline v16 v_where_greater(v16 x, float bar, v16 a) {
    v16 r;
    for (int i = 0; i < 4; i++)
        r.q[i] = vreinterpretq_f32_u32(vandq_u32(vcgtq_f32(x.q[i], vdupq_n_f32(bar)), vreinterpretq_u32_f32(a.q[i])));
    return r;
}

#else  // portable: GNU C vector extensions (gcc, clang), which the compiler maps onto whatever vector unit it targets
#define TILE_M 4
#define TILE_N 1
#define ONE_ROW_N 4
#define PREFETCH_PAIRS 0
#define WEIGH_CHUNKS 1
typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t lanes16;
static inline v16 v_add(v16 a, v16 b) { return a + b; }
static inline v16 v_sub(v16 a, v16 b) { return a - b; }
static inline v16 v_mul(v16 a, v16 b) { return a * b; }
static inline v16 v_div(v16 a, v16 b) { return a / b; }
static inline v16 v_select(i32x16 mask, v16 a, v16 b) { return (v16)((mask & (i32x16)a) | (~mask & (i32x16)b)); }
static inline v16 v_min(v16 a, v16 b) { return v_select(a < b, a, b); }
static inline v16 v_max(v16 a, v16 b) { return v_select(a > b, a, b); }
static inline v16 v_set1(float a) {
    v16 r;
    for (int i = 0; i < 16; i++) r[i] = a;
    return r;
}
static inline v16 v_zero(void) { return v_set1(0.0f); }
static inline v16 v_load(const float *p) {
    v16 r;
    memcpy(&r, p, sizeof r);
    return r;
}
static inline void v_store(float *p, v16 a) { memcpy(p, &a, sizeof a); }
static inline v16 v_madd_exact(v16 a, v16 b, v16 c) { return a * b + c; }
static inline v16 v_rint(v16 a) {
    for (int i = 0; i < 16; i++) a[i] = rintf(a[i]);
    return a;
}
static inline v16 v_load_bf16(const bf16 *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    return (v16)(__builtin_convertvector(h, u32x16) << 16);
}
static inline void v_load_pairs(const bf16 *p, v16 *even, v16 *odd) {
    u32x16 raw;
    memcpy(&raw, p, sizeof raw);
    *even = (v16)(raw << 16);
    *odd = (v16)(raw & 0xffff0000u);
}
static inline v16 v_bf16_round(v16 a) {  // f32_to_bf16, kept as float
    const u32x16 u = (u32x16)a;
    const v16 rounded = (v16)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
    return v_select(a != a, (v16)((u | 0x00400000u) & 0xffff0000u), rounded);
}
static inline void v_store_bf16(bf16 *p, v16 a) {
    const u16x16 h = __builtin_convertvector((u32x16)v_bf16_round(a) >> 16, u16x16);
    memcpy(p, &h, sizeof h);
}
static inline v16 v_pow2(i32x16 k) { return (v16)((u32x16)(k + 127) << 23); }
static inline v16 v_ldexp(v16 y, v16 k) {
    const i32x16 ki = __builtin_convertvector(k, i32x16), k1 = ki >> 1;
    return y * v_pow2(k1) * v_pow2(ki - k1);
}
static inline float v_reduce_add(v16 a) {
    float s[8];
    for (int n = 8; n >= 1; n /= 2)
        for (int i = 0; i < n; i++) s[i] = (n == 8 ? a[i] + a[i + 8] : s[i] + s[i + n]);
    return s[0];
}
static inline float v_reduce_max(v16 a) {
    float m = a[0];
    for (int i = 1; i < 16; i++) m = a[i] > m ? a[i] : m;
    return m;
}
static inline lanes16 v_greater(v16 a, float b) {
    const i32x16 above = a > v_set1(b);
    lanes16 bits = 0;
    for (int i = 0; i < 16; i++) bits |= (lanes16)(above[i] & 1) << i;
    return bits;
}
static inline lanes16 v_nan(v16 a) {
    const i32x16 nan = a != a;
    lanes16 bits = 0;
    for (int i = 0; i < 16; i++) bits |= (lanes16)(nan[i] & 1) << i;
    return bits;
}
static inline v16 v_where_greater(v16 x, float bar, v16 a) { return v_select(x > v_set1(bar), a, v_zero()); }
#endif

#if !(defined(TT_ISA_AVX512BF16) || defined(TT_ISA_AVX512))
static inline v16 v_sum_lanes16(const v16 *v) {
    float sums[16];
    for (int j = 0; j < 16; j++) sums[j] = v_reduce_add(v[j]);
    return v_load(sums);
}
#endif

// Cephes expf, 2^k e^r with |r| <= ln2 / 2 (about 1 ulp), in separate multiplies and adds so every path rounds alike.
static inline v16 v_exp(v16 x) {
    x = v_max(v_min(x, v_set1(88.0f)), v_set1(-88.0f));
    const v16 k = v_rint(v_mul(x, v_set1(1.44269504088896341f)));
    v16 r = v_sub(x, v_mul(k, v_set1(0.693359375f)));
    r = v_sub(r, v_mul(k, v_set1(-2.12194440e-4f)));
    v16 y = v_set1(1.9875691500e-4f);
    y = v_add(v_mul(y, r), v_set1(1.3981999507e-3f));
    y = v_add(v_mul(y, r), v_set1(8.3334519073e-3f));
    y = v_add(v_mul(y, r), v_set1(4.1665795894e-2f));
    y = v_add(v_mul(y, r), v_set1(1.6666665459e-1f));
    y = v_add(v_mul(y, r), v_set1(5.0000001201e-1f));
    y = v_add(v_mul(y, v_mul(r, r)), v_add(r, v_set1(1.0f)));
    return v_ldexp(y, k);
}

// ---- linear: y[M, N] = x[M, K] W[N, K]^T -------------------------------------------------------------------
// W is packed (by cpu_kernels.pack_weight) in blocks of 16 output rows: block b, k-pair p holds the 32 values
// W[16b + i][2p + j] at offset 2i + j, the operand layout of AVX512-BF16's dot-product instruction. Each output is
// summed over k in order, a pair at a time: even k then odd k on the widened paths, as vdpbf16ps does on AVX512-BF16.
#define BLOCK 16
#define GROUP 4  // blocks every row of x passes over while they are in cache
_Static_assert(TILE_M <= 6 && TILE_N <= GROUP && ONE_ROW_N <= GROUP, "linear_tile_dispatch covers up to 6 x GROUP");

static inline __attribute__((always_inline)) void store_row(const float *acc, void *y, int64_t n0, int64_t N,
                                                            int out_f32) {
    int64_t n = N - n0 < BLOCK ? N - n0 : BLOCK;
    for (int64_t i = 0; i < n; i++) {
        if (out_f32) ((float *)y)[n0 + i] = acc[i];
        else ((bf16 *)y)[n0 + i] = f32_to_bf16(acc[i]);
    }
}

// Weights a few KB ahead of the stream, into L2 (prefetcht2 on x86-64): a step's multiply-adds otherwise stall on
// the loads the hardware's prefetchers have not yet asked for (the model's linears on the 2-core Zen 4: 5-20 % faster,
// most on avx2). Past a block's end it reaches into the next block, which follows in memory.
static inline __attribute__((always_inline)) void prefetch_weights(const bf16 *p) {
    if (PREFETCH_PAIRS) __builtin_prefetch(p, 0, 1);
}

// One tile: mt rows of x against nt weight blocks, over all of K. mt and nt are compile-time constants at every
// call site (see linear_tile_dispatch), so the accumulators live in registers. The widened paths read x as floats
// (xf, widened once per call), AVX512-BF16 reads its bf16 pairs.
static inline __attribute__((always_inline)) void linear_tile(const int mt, const int nt, const bf16 *x,
                                                              const float *xf, const bf16 *w, void *y, int64_t K,
                                                              int64_t N, int64_t m0, int64_t b0, int out_f32) {
    const int64_t pairs = K / 2, block_elems = (int64_t)BLOCK * K;
    v16 acc[6][GROUP];
    for (int m = 0; m < mt; m++)
        for (int n = 0; n < nt; n++) acc[m][n] = v_zero();
#ifdef TT_ISA_AVX512BF16
    (void)xf;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[GROUP];
        for (int n = 0; n < nt; n++) {
            prefetch_weights(w + (b0 + n) * block_elems + (p + PREFETCH_PAIRS) * 2 * BLOCK);
            wv[n] = (__m512bh)_mm512_loadu_si512((const void *)(w + (b0 + n) * block_elems + p * 2 * BLOCK));
        }
        for (int m = 0; m < mt; m++) {
            int32_t pair;
            memcpy(&pair, x + (m0 + m) * K + 2 * p, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int n = 0; n < nt; n++) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], wv[n], xv);
        }
    }
#else
    (void)x;
    for (int64_t p = 0; p < pairs; p++)
        for (int n = 0; n < nt; n++) {
            v16 even, odd;
            prefetch_weights(w + (b0 + n) * block_elems + (p + PREFETCH_PAIRS) * 2 * BLOCK);
            v_load_pairs(w + (b0 + n) * block_elems + p * 2 * BLOCK, &even, &odd);
            for (int m = 0; m < mt; m++) {
                const float *xm = xf + (m0 + m) * K + 2 * p;
                acc[m][n] = v_madd_exact(odd, v_set1(xm[1]), v_madd_exact(even, v_set1(xm[0]), acc[m][n]));
            }
        }
#endif
    float out[BLOCK];
    for (int m = 0; m < mt; m++)
        for (int n = 0; n < nt; n++) {
            v_store(out, acc[m][n]);
            store_row(out, (char *)y + (m0 + m) * N * (out_f32 ? 4 : 2), (b0 + n) * BLOCK, N, out_f32);
        }
}

// Every tile shape linear_bf16 can ask for: one row over up to ONE_ROW_N blocks, 2 to TILE_M rows over up to TILE_N.
#define TILE_CASE(MT, NT)                                                                                   \
    case (MT) * 8 + (NT):                                                                                   \
        if ((MT) == 1 ? (NT) <= ONE_ROW_N : (MT) <= TILE_M && (NT) <= TILE_N) {                             \
            linear_tile(MT, NT, x, xf, w, y, K, N, m0, b0, out_f32);                                        \
            return;                                                                                         \
        }                                                                                                   \
        break;
#define TILE_ROW(MT) TILE_CASE(MT, 1) TILE_CASE(MT, 2) TILE_CASE(MT, 3) TILE_CASE(MT, 4)

static void linear_tile_dispatch(int mt, int nt, const bf16 *x, const float *xf, const bf16 *w, void *y, int64_t K,
                                 int64_t N, int64_t m0, int64_t b0, int out_f32) {
    switch (mt * 8 + nt) { TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4) TILE_ROW(5) TILE_ROW(6) }
    __builtin_trap();  // a shape no case computes: stop rather than leave outputs unwritten
}

// The float scratch linear_bf16 needs: x widened, on the widened paths.
int64_t linear_workspace_floats(int64_t M, int64_t K) {
#ifdef TT_ISA_AVX512BF16
    (void)M, (void)K;
    return 0;
#else
    return M * K;
#endif
}

// Each thread streams one contiguous range of weight blocks, and every row of x passes over a group of blocks
// while they are still in cache: a lone row ONE_ROW_N blocks at a time, more rows TILE_M at a time over TILE_N
// blocks: each path's register tiles (above), with enough independent sums to hide the adds' latency.
// xf: linear_workspace_floats(M, K) floats.
void linear_bf16(const bf16 *x, const bf16 *w, void *y, int64_t M, int64_t K, int64_t N, int out_f32, float *xf) {
    const int64_t blocks = (N + BLOCK - 1) / BLOCK, widened = linear_workspace_floats(M, K);
#pragma omp parallel
    {
        int64_t threads = 1, t = 0;
#ifdef _OPENMP
        threads = omp_get_num_threads();
        t = omp_get_thread_num();
#endif
        if (widened) {
            for (int64_t i = widened * t / threads; i < widened * (t + 1) / threads; i++) xf[i] = bf16_to_f32(x[i]);
#pragma omp barrier
        }
        const int64_t begin = blocks * t / threads, end = blocks * (t + 1) / threads;
        for (int64_t g0 = begin; g0 < end; g0 += GROUP) {
            const int group = end - g0 < GROUP ? (int)(end - g0) : GROUP;
            for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
                const int mt = M - m0 < TILE_M ? (int)(M - m0) : TILE_M, most = mt == 1 ? ONE_ROW_N : TILE_N;
                for (int n0 = 0; n0 < group; n0 += most)
                    linear_tile_dispatch(mt, group - n0 < most ? group - n0 : most, x, xf, w, y, K, N, m0, g0 + n0,
                                         out_f32);
            }
        }
    }
}

// ---- elementwise ------------------------------------------------------------------------------------------------
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
            const v16 g = v_load_bf16(gate_up + r * 2 * hidden + i), u = v_load_bf16(gate_up + r * 2 * hidden + hidden + i);
            const v16 silu = v_div(g, v_add(v_set1(1.0f), v_exp(v_sub(v_zero(), g))));
            v_store_bf16(out + r * hidden + i, v_mul(v_bf16_round(silu), u));
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
// torch, whose argmax treats NaN as the largest). One pass over each row 16 values at a time: a vector with no
// value above the current k-th best (or the running maximum) is skipped, so the top k cost about what argmax does.
void argmax_topk_f32(const float *logits, int64_t rows, int64_t V, int k, int64_t *ids, int64_t *top) {
#pragma omp parallel for if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * V;
        TopList best = {.have = 0, .want = k > 1 ? k : 1, .bar = -INFINITY};
        int nan = 0;
        int64_t i = 0;
        for (; i + 16 <= V && !nan; i += 16) {
            const v16 v = v_load(x + i);
            nan = v_nan(v) != 0;
            for (lanes16 above = best.have < best.want ? 0xffff : v_greater(v, best.bar); above && !nan;
                 above &= above - 1) {
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
// the tokens of each cache row (a user's 1 + K verification rows, or a tree's nodes) attend together in one pass over
// the cache (attend_rows). Caches are [users, Hk, slots, D]; q_rot is bf16 scratch [n, H, D]; D % 32 == 0, D <= 256.
enum { ROW, SLOT, POS, FIRST, RUN_END, ANC_START, ANC_COUNT, TABLE_COLUMNS };

static inline int64_t key_count(const int64_t *entry) { return entry[RUN_END] - entry[FIRST] + entry[ANC_COUNT]; }

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

static const bf16 NO_KEY[256];  // what a key outside a token's own reads as in key_dots (zeros; its lane is masked)

// q . k for 16 keys: each key's 16 lanes summed pairwise over D, a pair of elements per lane for every 32 (as the
// linear layer sums), then the lanes added by v_sum_lanes16. The 32 elements of q go against all 16 keys before the
// next 32, so the 16 sums stay in registers (AVX-512) and their chains overlap.
static inline v16 key_dots(const bf16 *const *keys, const bf16 *q, int64_t D) {
    v16 dots[16];
    for (int j = 0; j < 16; j++) dots[j] = v_zero();
    for (int64_t i = 0; i < D; i += 32) {
#ifdef TT_ISA_AVX512BF16
        const __m512bh qi = (__m512bh)_mm512_loadu_si512((const void *)(q + i));
        for (int j = 0; j < 16; j++)
            dots[j] = _mm512_dpbf16_ps(dots[j], (__m512bh)_mm512_loadu_si512((const void *)(keys[j] + i)), qi);
#else
        v16 q_even, q_odd;
        v_load_pairs(q + i, &q_even, &q_odd);
        for (int j = 0; j < 16; j++) {
            v16 k_even, k_odd;
            v_load_pairs(keys[j] + i, &k_even, &k_odd);
            dots[j] = v_madd_exact(k_odd, q_odd, v_madd_exact(k_even, q_even, dots[j]));
        }
#endif
    }
    return v_sum_lanes16(dots);
}

// The online-softmax state of one query head of one token over one split of the cache (STATE_FLOATS(D) floats): the
// weighted sum of values acc [D], 16 lanes of the sum of exp(score - max), and the running maximum score.
#define STATE_FLOATS(D) ((D) + 32)
#define STATE_SUMS(D) (D)
#define STATE_MAX(D) ((D) + 16)

// The cache splits (flash-decoding's split-K): positions [SPLIT s, SPLIT (s + 1)) for s < MAX_SPLITS - 1, and every
// position from SPLIT (MAX_SPLITS - 1) on in the last. Each split of a token's keys is its own online softmax, and
// the splits' states are merged in split order (merge_splits), so the work items of a long context are many and
// alike for any number of threads, while where a split starts depends on positions alone.
#define SPLIT 1024
#define MAX_SPLITS 32
_Static_assert(MAX_SPLITS % 16 == 0, "merge_splits takes the splits' maxima 16 at a time");
static inline int64_t split_of(int64_t pos) { return pos / SPLIT < MAX_SPLITS - 1 ? pos / SPLIT : MAX_SPLITS - 1; }
static inline int64_t split_end(int64_t split) { return split < MAX_SPLITS - 1 ? (split + 1) * SPLIT : INT64_MAX; }

// Token t's state for query head h and split `split` in `states` (MAX_SPLITS x n x H of them: a split's states of a
// token's heads side by side, not at a power-of-two stride that would put them in the same cache set).
static inline float *state_of(float *states, int64_t n, int64_t t, int64_t H, int64_t h, int64_t split, int64_t D) {
    return states + ((split * n + t) * H + h) * STATE_FLOATS(D);
}

// p rounded to 16 significant bits (Veltkamp's split: p * 257 - (p * 257 - p)), so that p times a bf16 value (8 bits)
// is exact in float and v_madd_exact weighs a value with one multiply-add on every path (the portable path has no FMA
// unit on x86-64 to round a float's product once). 2^-17 of p is far below the bf16 output's 2^-9.
static inline v16 v_weight16(v16 p) {
    const v16 big = v_mul(p, v_set1(257.0f));
    return v_sub(big, v_sub(big, p));
}

// acc[g] = acc[g] * alpha[g] + p[g][j] * v_j over keys j = 0 .. len - 1 of a block, in key order (each product exact:
// p has 16 significant bits, v_weight16), for up to 4 query heads g < NG and chunks c0 .. c0 + NC - 1 of 16
// lanes: each value is loaded and widened once for all heads. NG and NC are compile-time constants at every call site
// (see weigh_values), so the NG x NC accumulators live in registers.
static inline __attribute__((always_inline)) void weigh_values_tile(const int NG, const int NC, const bf16 *const *vals,
                                                                    const float *p, const float *alpha, int64_t len,
                                                                    int64_t c0, float *acc, int64_t stride) {
    v16 a[4][WEIGH_CHUNKS];
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < NC; c++) a[g][c] = v_mul(v_load(acc + g * stride + 16 * (c0 + c)), v_set1(alpha[g]));
    for (int64_t j = 0; j < len; j++) {
        v16 v[WEIGH_CHUNKS];
        for (int c = 0; c < NC; c++) v[c] = v_load_bf16(vals[j] + 16 * (c0 + c));
        for (int g = 0; g < NG; g++) {
            const v16 pj = v_set1(p[16 * g + j]);
            for (int c = 0; c < NC; c++) a[g][c] = v_madd_exact(pj, v[c], a[g][c]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < NC; c++) v_store(acc + g * stride + 16 * (c0 + c), a[g][c]);
}

#define WEIGH_CASE(NG, NC) \
    case (NG - 1) * WEIGH_CHUNKS + NC - 1: weigh_values_tile(NG, NC, vals, p, alpha, len, c0, acc, stride); break;

static void weigh_values(int ng, int64_t chunks, const bf16 *const *vals, const float *p, const float *alpha,
                         int64_t len, float *acc, int64_t stride) {
    for (int64_t c0 = 0; c0 < chunks; c0 += WEIGH_CHUNKS) {
        const int nc = chunks - c0 < WEIGH_CHUNKS ? (int)(chunks - c0) : WEIGH_CHUNKS;
        switch ((ng - 1) * WEIGH_CHUNKS + nc - 1) {
#if WEIGH_CHUNKS == 4
            WEIGH_CASE(1, 1) WEIGH_CASE(1, 2) WEIGH_CASE(1, 3) WEIGH_CASE(1, 4)
            WEIGH_CASE(2, 1) WEIGH_CASE(2, 2) WEIGH_CASE(2, 3) WEIGH_CASE(2, 4)
            WEIGH_CASE(3, 1) WEIGH_CASE(3, 2) WEIGH_CASE(3, 3) WEIGH_CASE(3, 4)
            WEIGH_CASE(4, 1) WEIGH_CASE(4, 2) WEIGH_CASE(4, 3) WEIGH_CASE(4, 4)
#else
            WEIGH_CASE(1, 1) WEIGH_CASE(2, 1) WEIGH_CASE(3, 1) WEIGH_CASE(4, 1)
#endif
        }
    }
}

static inline float exp1(float x) {  // v_exp of one number
    float lanes[16];
    v_store(lanes, v_exp(v_set1(x)));
    return lanes[0];
}

// Tokens t0 .. t1 - 1 of one cache row and up to 4 of their query heads h0 .. h0 + ng - 1 sharing key/value head
// `keys` / `values`, over the positions of one split of the cache in one pass: key j of a token sits at position
// first + j (a tree node's ancestors continue its run as the chain of its path would), and positions go in blocks of
// 16 aligned at multiples of 16. Each block's keys and values are read from memory once for every token and head that
// sees any of them (a verification step of 1 + K rows reads the cache once, not 1 + K times: at 5.8k cached keys, 30
// layers and 3 key/value heads of 64, about 133 MB a step instead of 133 MB a row), and each token-head's state for the
// split (state_of) takes the block as an online softmax does: the scores of its visible keys there (the others
// masked), the new maximum m' = max(m, scores), alpha = exp(m - m') (exactly 1 when m' = m), p = exp(score - m') (0
// where masked; then v_weight16), sums = sums * alpha + p, acc = acc * alpha + sum of p_j v_j. Which blocks a token
// takes and what it does in each depend on its own keys alone, never on the other tokens or heads in the pass or on
// the threads, so a row's result is the same alone (a one-token decode step) or beside any others: the lossless
// contract.
static void attend_rows(const bf16 *q_rot, int64_t t0, int64_t t1, int64_t H, int64_t h0, int ng, int64_t D,
                        const int64_t *table, const int64_t *ancestors, const bf16 *keys, const bf16 *values,
                        float scale, int64_t split, float *states, int64_t n) {
    const int64_t stride = STATE_FLOATS(D);  // from one head's state to the next's
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t *e = table + TABLE_COLUMNS * t, first = e[FIRST], end = first + key_count(e);
        lo = first < lo ? first : lo;
        hi = end > hi ? end : hi;
        for (int g = 0; g < ng; g++) {
            float *s = state_of(states, n, t, H, h0 + g, split, D);
            memset(s, 0, STATE_MAX(D) * sizeof(float));
            s[STATE_MAX(D)] = -INFINITY;
        }
    }
    lo = lo > split * SPLIT ? lo : split * SPLIT;
    hi = hi < split_end(split) ? hi : split_end(split);
    for (int64_t b0 = lo / 16 * 16; b0 < hi; b0 += 16) {
        for (int64_t t = t0; t < t1; t++) {
            const int64_t *e = table + TABLE_COLUMNS * t, first = e[FIRST], end = first + key_count(e);
            const int64_t a = (first > b0 ? first : b0) - b0, z = (end < b0 + 16 ? end : b0 + 16) - b0;
            if (a >= z) continue;  // this token sees no key of the block
            const bf16 *kp[16], *vp[16];
            const int in_run = b0 + z <= e[RUN_END];  // most blocks: the keys are at their positions' slots
            for (int64_t j = 0; j < 16; j++) kp[j] = NO_KEY;
            for (int64_t j = a; j < z; j++) {
                const int64_t at = (in_run ? b0 + j : key_slot(e, ancestors, b0 + j - first)) * D;
                kp[j] = keys + at;
                vp[j] = values + at;
            }
            float p[4][16], alpha[4];
            float *s0 = state_of(states, n, t, H, h0, split, D);
            const int whole = a == 0 && z == 16;  // most blocks: no lane masked, the maximum taken in vector
            v16 scaled[4];  // every head's scores first, so the heads' exponentials below overlap
            for (int g = 0; g < ng; g++)
                scaled[g] = v_mul(key_dots(kp, q_rot + (t * H + h0 + g) * D, D), v_set1(scale));
            for (int g = 0; g < ng; g++) {
                float *s = s0 + g * stride, scores[16];
                const v16 dots = scaled[g];
                const float old = s[STATE_MAX(D)];
                float m = old;
                if (whole) {
                    const float top = v_reduce_max(dots);
                    m = top > m ? top : m;
                } else {
                    v_store(scores, dots);
                    for (int64_t j = a; j < z; j++) m = scores[j] > m ? scores[j] : m;
                }
                alpha[g] = m == old ? 1.0f : exp1(old - m);
                s[STATE_MAX(D)] = m;
                v16 pg = v_exp(v_sub(dots, v_set1(m)));
                if (!whole) {
                    v_store(p[g], pg);
                    for (int64_t j = 0; j < 16; j++)
                        if (j < a || j >= z) p[g][j] = 0.0f;
                    pg = v_load(p[g]);
                }
                pg = v_weight16(pg);
                v_store(p[g], pg);
                float *sums = s + STATE_SUMS(D);
                v_store(sums, v_add(v_mul(v_load(sums), v_set1(alpha[g])), pg));
            }
            weigh_values(ng, D / 16, vp + a, &p[0][a], alpha, z - a, s0, stride);
        }
    }
}

// Token t's query head h from its splits' states, in split order: M = the largest maximum, f = exp(m - M) (exactly 1
// when m = M: v_exp(0) is 1), acc = acc + acc_s * f and sums = sums + sums_s * f from zeros, out = acc * (1 / sum
// of the sums' lanes). A token within one split keeps that split's acc and sums as they are.
static void merge_splits(float *states, int64_t n, const int64_t *table, int64_t t, int64_t H, int64_t h, int64_t D,
                         float *out) {
    const int64_t *e = table + TABLE_COLUMNS * t;
    const int64_t s0 = split_of(e[FIRST]), keys = key_count(e);
    const int64_t splits = keys ? split_of(e[FIRST] + keys - 1) - s0 + 1 : 0;  // no keys: 0 / 0, as the softmax gives
    float top = -INFINITY, f[MAX_SPLITS] = {0};
    for (int64_t i = 0; i < splits; i++) {
        f[i] = state_of(states, n, t, H, h, s0 + i, D)[STATE_MAX(D)];
        top = f[i] > top ? f[i] : top;
    }
    for (int64_t i = 0; i < splits; i += 16) v_store(f + i, v_exp(v_sub(v_load(f + i), v_set1(top))));
    v16 acc[256 / 16], sums = v_zero();
    for (int64_t c = 0; c < D / 16; c++) acc[c] = v_zero();
    for (int64_t i = 0; i < splits; i++) {
        const float *s = state_of(states, n, t, H, h, s0 + i, D);
        for (int64_t c = 0; c < D / 16; c++) acc[c] = v_add(acc[c], v_mul(v_load(s + 16 * c), v_set1(f[i])));
        sums = v_add(sums, v_mul(v_load(s + STATE_SUMS(D)), v_set1(f[i])));
    }
    const v16 inv = v_set1(1.0f / v_reduce_add(sums));
    for (int64_t c = 0; c < D / 16; c++) v_store(out + (t * H + h) * D + 16 * c, v_mul(acc[c], inv));
}

// Query heads per work item: the heads of one key/value head in groups of up to 4, each group's cache blocks read
// once for all of them, unless there are fewer work items of that size than threads (then single heads). row_splits:
// the splits of all the step's runs of tokens on one cache row.
static int64_t heads_per_item(int64_t row_splits, int64_t H, int64_t Hk, int threads) {
    const int64_t G = H / Hk, group = G < 4 ? G : 4;
    return row_splits * Hk * ((G + group - 1) / group) >= threads ? group : 1;
}

static int64_t round64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// The work items of a step, at most one per token, query head and split (ITEM_FIELDS int64 each).
enum { ITEM_T0, ITEM_T1, ITEM_H0, ITEM_HEADS, ITEM_SPLIT, ITEM_FIELDS };

static int64_t states_bytes(int64_t n, int64_t H, int64_t D) {
    return n * H * MAX_SPLITS * STATE_FLOATS(D) * (int64_t)sizeof(float);
}

// The scratch attention_f32 needs, in bytes: the rotated queries (bf16 [n, H, D]), every token-head's split states,
// then the work items. (The thread count no longer matters: kept for the callers' signature.)
int64_t attention_workspace_bytes(int64_t n, int64_t H, int64_t D, int threads) {
    (void)threads;
    return round64(n * H * D * (int64_t)sizeof(bf16)) + states_bytes(n, H, D) +
           n * H * MAX_SPLITS * ITEM_FIELDS * (int64_t)sizeof(int64_t);
}

// Whether token t starts a run of the step's tokens on one cache row (whose splits are work items of attention_f32).
static inline int starts_row_group(const int64_t *table, int64_t t) {
    return t == 0 || table[TABLE_COLUMNS * t + ROW] != table[TABLE_COLUMNS * (t - 1) + ROW];
}

// The run of tokens on one cache row that starts at t0: returns its end, and the first and last splits its keys reach.
static int64_t row_run(const int64_t *table, int64_t n, int64_t t0, int64_t *s0, int64_t *s1) {
    int64_t lo = INT64_MAX, hi = 0, t1 = t0;
    do {
        const int64_t *e = table + TABLE_COLUMNS * t1, end = e[FIRST] + key_count(e);
        lo = e[FIRST] < lo ? e[FIRST] : lo;
        hi = end > hi ? end : hi;
    } while (++t1 < n && !starts_row_group(table, t1));
    *s0 = split_of(lo), *s1 = split_of(hi - 1);
    return t1;
}

// The attention of a packed step: out [n, H, D] in float32, which decoder_layer rounds to bf16 (exported so the tests
// see its arithmetic bit for bit: a bf16 result hides almost every change of order). workspace: as
// attention_workspace_bytes says. Work items: each run of tokens on one cache row x key/value head x group of its
// query heads x split of the cache the run's keys reach; then each token-head merges its splits.
void attention_f32(const bf16 *qkv, int64_t n, int64_t H, int64_t Hk, int64_t D, const int64_t *table,
                   const int64_t *ancestors, const bf16 *cos, const bf16 *sin, bf16 *k_cache, bf16 *v_cache,
                   int64_t slots, float *out, void *workspace, int threads) {
    const int64_t width = (H + 2 * Hk) * D, G = H / Hk;
    bf16 *q_rot = workspace;
    float *states = (float *)((char *)workspace + round64(n * H * D * (int64_t)sizeof(bf16)));
    int64_t *items = (int64_t *)((char *)states + states_bytes(n, H, D)), count = 0, row_splits = 0, s0, s1;
    const float scale = 1.0f / sqrtf((float)D);
    for (int64_t t0 = 0, t1; t0 < n; t0 = t1) {
        t1 = row_run(table, n, t0, &s0, &s1);
        row_splits += s1 - s0 + 1;
    }
    const int64_t hp = heads_per_item(row_splits, H, Hk, threads), groups = (G + hp - 1) / hp;
    for (int64_t t0 = 0, t1; t0 < n; t0 = t1) {
        t1 = row_run(table, n, t0, &s0, &s1);
        for (int64_t kv = 0; kv < Hk; kv++)  // an item per key/value head, head group and split
            for (int64_t group = 0; group < groups; group++)
                for (int64_t split = s0; split <= s1; split++, count++) {
                    int64_t *item = items + ITEM_FIELDS * count;
                    item[ITEM_T0] = t0, item[ITEM_T1] = t1, item[ITEM_SPLIT] = split;
                    item[ITEM_H0] = kv * G + group * hp;
                    item[ITEM_HEADS] = G - group * hp < hp ? G - group * hp : hp;
                }
    }
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
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++) {
            const int64_t *item = items + ITEM_FIELDS * i, t0 = item[ITEM_T0], h0 = item[ITEM_H0];
            const int64_t at = (table[TABLE_COLUMNS * t0 + ROW] * Hk + h0 / G) * slots * D;
            attend_rows(q_rot, t0, item[ITEM_T1], H, h0, (int)item[ITEM_HEADS], D, table, ancestors, k_cache + at,
                        v_cache + at, scale, item[ITEM_SPLIT], states, n);
        }
#pragma omp for collapse(2)
        for (int64_t t = 0; t < n; t++)
            for (int64_t h = 0; h < H; h++) merge_splits(states, n, table, t, H, h, D, out);
    }
}

// ---- one decoder layer of a packed step: TransformerBlock.forward with the kernels above ----------------------
// x [n, dim] is the residual stream, updated in place; weights are packed as for linear_bf16.
static void add_bf16(bf16 *x, const bf16 *delta, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(delta[i]));
}

// The scratch a decoder_layer call needs, in bytes: bf16 activations for n tokens, the widest linear input widened
// to float, the attention's float32 output and its workspace. The caller allocates it once and reuses it
// (cpu_kernels.py).
static int64_t activation_bytes(int64_t n, int64_t dim, int64_t hidden, int64_t H, int64_t Hk, int64_t D) {
    const int64_t elems = n * (dim + (H + 2 * Hk) * D + H * D + 3 * hidden + dim);
    return round64(elems * (int64_t)sizeof(bf16));  // the floats after it stay 64-byte aligned
}

static int64_t widest_input(int64_t dim, int64_t hidden, int64_t H, int64_t D) {
    const int64_t widest = dim > hidden ? dim : hidden;
    return widest > H * D ? widest : H * D;
}

static int64_t linear_floats(int64_t n, int64_t dim, int64_t hidden, int64_t H, int64_t D) {
    return (linear_workspace_floats(n, widest_input(dim, hidden, H, D)) + 15) / 16 * 16;
}

int64_t decoder_layer_workspace_bytes(int64_t n, int64_t dim, int64_t hidden, int64_t H, int64_t Hk, int64_t D,
                                      int threads) {
    return activation_bytes(n, dim, hidden, H, Hk, D) +
           (linear_floats(n, dim, hidden, H, D) + n * H * D) * (int64_t)sizeof(float) +
           attention_workspace_bytes(n, H, D, threads);
}

void decoder_layer(bf16 *x, int64_t n, int64_t dim, int64_t hidden, int64_t H, int64_t Hk, int64_t D, float eps,
                   const bf16 *attention_norm, const bf16 *wqkv, const bf16 *wo, const bf16 *ffn_norm,
                   const bf16 *w_gate_up, const bf16 *w_down, const int64_t *table, const int64_t *ancestors,
                   const bf16 *cos, const bf16 *sin, bf16 *k_cache, bf16 *v_cache, int64_t slots, void *workspace,
                   int threads) {
    const int64_t width = (H + 2 * Hk) * D;
    bf16 *normed = workspace, *qkv = normed + n * dim, *attn = qkv + n * width;
    bf16 *gate_up = attn + n * H * D, *act = gate_up + n * 2 * hidden, *delta = act + n * hidden;
    float *xf = (float *)((char *)workspace + activation_bytes(n, dim, hidden, H, Hk, D));
    float *attn_f32 = xf + linear_floats(n, dim, hidden, H, D);
    rms_norm_bf16(x, attention_norm, normed, n, dim, eps);
    linear_bf16(normed, wqkv, qkv, n, dim, width, 0, xf);
    attention_f32(qkv, n, H, Hk, D, table, ancestors, cos, sin, k_cache, v_cache, slots, attn_f32,
                  attn_f32 + n * H * D, threads);
    for (int64_t i = 0; i < n * H * D; i += 16) v_store_bf16(attn + i, v_load(attn_f32 + i));
    linear_bf16(attn, wo, delta, n, H * D, dim, 0, xf);
    add_bf16(x, delta, n * dim);
    rms_norm_bf16(x, ffn_norm, normed, n, dim, eps);
    linear_bf16(normed, w_gate_up, gate_up, n, dim, 2 * hidden, 0, xf);
    silu_mul_bf16(gate_up, act, n, hidden);
    linear_bf16(act, w_down, delta, n, hidden, dim, 0, xf);
    add_bf16(x, delta, n * dim);
}

// ---- prefill attention: a prompt's many queries per user, flash-style ------------------------------------------
// The masked (prefill) path's attention: queries [B, T, H, D] (rotated, their K and V already in the caches), query b,
// t at position pos[b, t] sees the keys of cache row rows[b] at positions [max(0, pos + 1 - window), pos] (window 0: no
// window): causal, after a cached prefix (its keys all visible), and a ragged batch's padding (it attends like the last
// real token; nobody reads its result). Each work item takes up to PREFILL_ROWS query rows (a row: one query and one
// head of a key/value head's group, so the group's heads share every K/V block) and walks key positions in blocks of
// KEY_BLOCK aligned at multiples of it, as an online softmax: s = (q . k) * scale over the block's 32 keys (the
// invisible ones -inf), m' = max(m, s), alpha = v_exp(m - m') (exactly 1 when m' = m), p = v_exp_short(s - m') rounded
// to bf16 (0 where s - m' <= -87: never a subnormal, which vdpbf16ps would flush), sums = sums * alpha + p (16 lanes:
// the first 16 keys', then the last 16's), acc = acc * alpha + p . v; at the end out = acc * (1 / sum of the sums'
// lanes). The dot products take a pair of elements at a time in order, as the linear layer's (vdpbf16ps on AVX512-BF16,
// two float multiply-adds of exact products on the widened paths), and p is rounded to bf16 so that p . v is such a dot
// product too. Blocks where a row sees no key leave its state as it was (alpha 1, p 0), so its result depends on its
// own keys alone: not on the other rows of its item, the items or the threads (deterministic at any thread count). K
// and V are first packed per user and key/value head into the layouts the two products read: K block i, pair d/2, key j
// (the linear layer's weight layout, keys as outputs), V block i, key pair j/2, element d.
#define KEY_BLOCK 32  // (64 was no faster: the exponentials, not each block's bookkeeping, are the softmax's cost)
#define KEY_VECTORS (KEY_BLOCK / 16)
#define PREFILL_ROWS 48  // query rows per work item (16 queries of a group of 3 heads): its state stays in L1/L2
#if defined(TT_ISA_AVX512BF16)
#define QK_ROWS 12  // rows x 2 vectors of 16 keys in registers
#define PV_ROWS 6  // rows x WEIGH_CHUNKS chunks of 16 outputs in registers
#elif defined(TT_ISA_AVX512)
#define QK_ROWS 10
#define PV_ROWS 5
#else
#define QK_ROWS 2
#define PV_ROWS 4
#endif
#define NOT_SUBNORMAL -87.0f  // exp(x) for x above this is a normal float (2^-126 = exp(-87.34))

// exp(x) for p = bf16(exp(s - m')), x <= 0: v_exp's reduction with a degree-4 polynomial (relative error about 4e-5,
// 50 times below the bf16 rounding that follows), a fifth less work than v_exp's (the exponentials were most of a
// prefill's softmax). x is clamped at NOT_SUBNORMAL, whose results are zeroed after: no step makes a subnormal (which
// can cost a microcode assist each).
static inline v16 v_exp_short(v16 x) {
    x = v_max(x, v_set1(NOT_SUBNORMAL));
    const v16 k = v_rint(v_mul(x, v_set1(1.44269504088896341f)));
    v16 r = v_sub(x, v_mul(k, v_set1(0.693359375f)));
    r = v_sub(r, v_mul(k, v_set1(-2.12194440e-4f)));
    v16 y = v_set1(4.1666666667e-2f);
    y = v_add(v_mul(y, r), v_set1(1.6666666667e-1f));
    y = v_add(v_mul(y, r), v_set1(0.5f));
    y = v_add(v_mul(y, r), v_set1(1.0f));
    y = v_add(v_mul(y, r), v_set1(1.0f));
#if defined(TT_ISA_AVX512BF16) || defined(TT_ISA_AVX512)
    return _mm512_scalef_ps(y, k);  // v_ldexp's number (y * 2^k, rounded once) in one instruction: 5 % off the kernel
#else
    return v_ldexp(y, k);
#endif
}

// p rounded to bf16 and zeroed where x <= NOT_SUBNORMAL (or NaN), as bf16 values in floats; then stored as bf16 (its
// bits, no rounding left to do). AVX512-BF16 rounds with one instruction (vcvtneps2bf16, round to nearest even as
// f32_to_bf16 for the normal numbers kept).
static inline v16 softmax_weight(v16 x) {
#ifdef TT_ISA_AVX512BF16
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v_exp_short(x));
    const v16 p = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    return v_where_greater(x, NOT_SUBNORMAL, p);
#else
    return v_where_greater(x, NOT_SUBNORMAL, v_bf16_round(v_exp_short(x)));
#endif
}

static inline void store_bf16_exact(bf16 *p, v16 a) {
#if defined(TT_ISA_AVX512BF16) || defined(TT_ISA_AVX512)
    _mm256_storeu_si256((void *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(a), 16)));
#else
    v_store_bf16(p, a);
#endif
}

// Scores of RT rows (q: bf16 [RT, D], qf: the same widened on the widened paths) against a packed block of keys.
static inline __attribute__((always_inline)) void qk_tile(const int RT, const bf16 *q, const float *qf, int64_t D,
                                                          const bf16 *kp, float scale, float *s) {
    v16 acc[QK_ROWS][KEY_VECTORS];
    for (int r = 0; r < RT; r++)
        for (int i = 0; i < KEY_VECTORS; i++) acc[r][i] = v_zero();
    for (int64_t p = 0; p < D / 2; p++) {
        const bf16 *k = kp + p * 2 * KEY_BLOCK;
#ifdef TT_ISA_AVX512BF16
        (void)qf;
        __m512bh kv[KEY_VECTORS];
        for (int i = 0; i < KEY_VECTORS; i++) kv[i] = (__m512bh)_mm512_loadu_si512((const void *)(k + 32 * i));
        for (int r = 0; r < RT; r++) {
            int32_t pair;
            memcpy(&pair, q + r * D + 2 * p, 4);
            const __m512bh qv = (__m512bh)_mm512_set1_epi32(pair);
            for (int i = 0; i < KEY_VECTORS; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], kv[i], qv);
        }
#else
        (void)q;
        v16 e[KEY_VECTORS], o[KEY_VECTORS];
        for (int i = 0; i < KEY_VECTORS; i++) v_load_pairs(k + 32 * i, &e[i], &o[i]);
        for (int r = 0; r < RT; r++) {
            const v16 qe = v_set1(qf[r * D + 2 * p]), qo = v_set1(qf[r * D + 2 * p + 1]);
            for (int i = 0; i < KEY_VECTORS; i++) acc[r][i] = v_madd_exact(o[i], qo, v_madd_exact(e[i], qe, acc[r][i]));
        }
#endif
    }
    for (int r = 0; r < RT; r++)
        for (int i = 0; i < KEY_VECTORS; i++) v_store(s + r * KEY_BLOCK + 16 * i, v_mul(acc[r][i], v_set1(scale)));
}

#define QK_CASE(RT)                                                   \
    case RT:                                                          \
        if (RT <= QK_ROWS) {                                          \
            qk_tile(RT, q, qf, D, kp, scale, s);                      \
            return;                                                   \
        }                                                             \
        break;
static void qk_rows(int rt, const bf16 *q, const float *qf, int64_t D, const bf16 *kp, float scale, float *s) {
    switch (rt) { QK_CASE(1) QK_CASE(2) QK_CASE(3) QK_CASE(4) QK_CASE(5) QK_CASE(6) QK_CASE(7) QK_CASE(8) QK_CASE(9)
                  QK_CASE(10) QK_CASE(11) QK_CASE(12) }
    __builtin_trap();
}

// acc = acc * alpha + p . v for RT rows (p: bf16 [RT, KEY_BLOCK]) and chunks c0 .. c0 + NC - 1 of 16 outputs, over a
// packed block of 32 values, a key pair at a time.
static inline __attribute__((always_inline)) void pv_tile(const int RT, const int NC, const bf16 *p, const bf16 *vp,
                                                          const float *alpha, int64_t D, int64_t c0, float *acc) {
    v16 a[PV_ROWS][WEIGH_CHUNKS];
    for (int r = 0; r < RT; r++)
        for (int c = 0; c < NC; c++) a[r][c] = v_mul(v_load(acc + r * D + 16 * (c0 + c)), v_set1(alpha[r]));
    for (int64_t j = 0; j < KEY_BLOCK / 2; j++) {
        const bf16 *v = vp + (j * D + 16 * c0) * 2;
#ifdef TT_ISA_AVX512BF16
        __m512bh vv[WEIGH_CHUNKS];
        for (int c = 0; c < NC; c++) vv[c] = (__m512bh)_mm512_loadu_si512((const void *)(v + 32 * c));
        for (int r = 0; r < RT; r++) {
            int32_t pair;
            memcpy(&pair, p + r * KEY_BLOCK + 2 * j, 4);
            const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < NC; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], vv[c], pv);
        }
#else
        v16 e[WEIGH_CHUNKS], o[WEIGH_CHUNKS];
        for (int c = 0; c < NC; c++) v_load_pairs(v + 32 * c, &e[c], &o[c]);
        for (int r = 0; r < RT; r++) {
            const bf16 *pr = p + r * KEY_BLOCK + 2 * j;
            const v16 pe = v_set1(bf16_to_f32(pr[0])), po = v_set1(bf16_to_f32(pr[1]));
            for (int c = 0; c < NC; c++) a[r][c] = v_madd_exact(o[c], po, v_madd_exact(e[c], pe, a[r][c]));
        }
#endif
    }
    for (int r = 0; r < RT; r++)
        for (int c = 0; c < NC; c++) v_store(acc + r * D + 16 * (c0 + c), a[r][c]);
}

#define PV_CASE(RT, NC)                                                          \
    case (RT - 1) * WEIGH_CHUNKS + NC - 1:                                       \
        if (RT <= PV_ROWS && NC <= WEIGH_CHUNKS) {                               \
            pv_tile(RT, NC, p, vp, alpha, D, c0, acc);                           \
            return;                                                              \
        }                                                                        \
        break;
#if WEIGH_CHUNKS == 4
#define PV_ROW(RT) PV_CASE(RT, 1) PV_CASE(RT, 2) PV_CASE(RT, 3) PV_CASE(RT, 4)
#else
#define PV_ROW(RT) PV_CASE(RT, 1)
#endif
static void pv_rows(int rt, int nc, const bf16 *p, const bf16 *vp, const float *alpha, int64_t D, int64_t c0,
                    float *acc) {
    switch ((rt - 1) * WEIGH_CHUNKS + nc - 1) { PV_ROW(1) PV_ROW(2) PV_ROW(3) PV_ROW(4) PV_ROW(5) PV_ROW(6) }
    __builtin_trap();
}

// Queries per work item, so that an item has about PREFILL_ROWS rows (at least one query's G heads).
static int64_t prefill_queries(int64_t G) { return G < PREFILL_ROWS ? PREFILL_ROWS / G : 1; }

// Per thread: bf16 rows' q [rows, D] and p [rows, 32], then floats: q widened [rows, D], scores [rows, 32], acc
// [rows, D], sums [rows, 16], the running maximum and alpha [rows, padded to whole vectors].
static int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

static int64_t prefill_scratch_bytes(int64_t G, int64_t D) {
    const int64_t rows = prefill_queries(G) * G;
    return round64(rows * (D + KEY_BLOCK) * (int64_t)sizeof(bf16)) +
           round64((rows * (2 * D + KEY_BLOCK + 16) + 2 * round16(rows)) * (int64_t)sizeof(float));
}

// Key blocks packed per user and key/value head: enough for kv_len positions (every query's position is below it).
static int64_t prefill_blocks(int64_t kv_len) { return (kv_len + KEY_BLOCK - 1) / KEY_BLOCK; }

// The scratch prefill_attention needs, in bytes: the packed K and V, then each thread's rows.
int64_t prefill_attention_workspace_bytes(int64_t B, int64_t H, int64_t Hk, int64_t D, int64_t kv_len, int threads) {
    return round64(2 * B * Hk * prefill_blocks(kv_len) * KEY_BLOCK * D * (int64_t)sizeof(bf16)) +
           threads * prefill_scratch_bytes(H / Hk, D);
}

static inline int64_t first_visible(int64_t pos, int64_t window) {
    return window && pos + 1 - window > 0 ? pos + 1 - window : 0;
}

// Queries t0 .. t1 - 1 of batch entry b with the G query heads of key/value head kv: kp / vp are that user's and
// head's packed blocks from position `packed_from`.
static void prefill_item(const bf16 *q, int64_t token_stride, int64_t T, int64_t b, int64_t t0, int64_t t1, int64_t H,
                         int64_t G, int64_t kv, int64_t D, const int64_t *pos, int64_t window, const bf16 *kp,
                         const bf16 *vp, int64_t packed_from, float scale, char *scratch, void *out, int out_f32) {
    const int64_t rows = (t1 - t0) * G, most = prefill_queries(G) * G;
    bf16 *qb = (bf16 *)scratch, *pb = qb + most * D;
    float *qf = (float *)(scratch + round64(most * (D + KEY_BLOCK) * (int64_t)sizeof(bf16)));
    float *s = qf + most * D, *acc = s + most * KEY_BLOCK, *sums = acc + most * D, *m = sums + most * 16;
    float *alpha = m + round16(most);
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t p = pos[b * T + t], first = first_visible(p, window);
        lo = first < lo ? first : lo;
        hi = p + 1 > hi ? p + 1 : hi;
        memcpy(qb + (t - t0) * G * D, q + (b * T + t) * token_stride + kv * G * D, G * D * sizeof(bf16));
    }
    for (int64_t i = 0; i < rows * D; i++) qf[i] = bf16_to_f32(qb[i]);
    memset(acc, 0, rows * D * sizeof(float));
    memset(sums, 0, rows * 16 * sizeof(float));
    for (int64_t r = 0; r < rows; r++) m[r] = -INFINITY;
    for (int64_t k0 = lo / KEY_BLOCK * KEY_BLOCK; k0 < hi; k0 += KEY_BLOCK) {
        const int64_t block = (k0 - packed_from) / KEY_BLOCK;
        const bf16 *kblock = kp + block * KEY_BLOCK * D, *vblock = vp + block * KEY_BLOCK * D;
        for (int64_t r0 = 0; r0 < rows; r0 += QK_ROWS)
            qk_rows(rows - r0 < QK_ROWS ? (int)(rows - r0) : QK_ROWS, qb + r0 * D, qf + r0 * D, D, kblock, scale,
                    s + r0 * KEY_BLOCK);
        // masks and maxima row by row, then alpha and p in loops of independent vector work
        for (int64_t r = 0; r < rows; r++) {
            float *sr = s + r * KEY_BLOCK;
            const int64_t p = pos[b * T + t0 + r / G], a = first_visible(p, window) - k0, z = p + 1 - k0;
            for (int64_t j = 0; j < a && j < KEY_BLOCK; j++) sr[j] = -INFINITY;
            for (int64_t j = z > 0 ? z : 0; j < KEY_BLOCK; j++) sr[j] = -INFINITY;
            v16 highest = v_load(sr);
            for (int i = 1; i < KEY_VECTORS; i++) highest = v_max(highest, v_load(sr + 16 * i));
            const float top = v_reduce_max(highest), old = m[r];
            m[r] = top > old ? top : old;
            alpha[r] = m[r] == old ? 0.0f : old - m[r];  // exp(0) = 1 exactly: a maximum that stays keeps the state
        }
        for (int64_t r0 = 0; r0 < rows; r0 += 16) v_store(alpha + r0, v_exp(v_load(alpha + r0)));
        for (int64_t r = 0; r < rows; r++) {
            const float *sr = s + r * KEY_BLOCK;
            v16 sum = v_mul(v_load(sums + r * 16), v_set1(alpha[r]));
            for (int i = 0; i < KEY_VECTORS; i++) {
                const v16 x = v_sub(v_load(sr + 16 * i), v_set1(m[r]));
                const v16 p = softmax_weight(x);
                sum = v_add(sum, p);
                store_bf16_exact(pb + r * KEY_BLOCK + 16 * i, p);
            }
            v_store(sums + r * 16, sum);
        }
        for (int64_t r0 = 0; r0 < rows; r0 += PV_ROWS)
            for (int64_t c0 = 0; c0 < D / 16; c0 += WEIGH_CHUNKS)
                pv_rows(rows - r0 < PV_ROWS ? (int)(rows - r0) : PV_ROWS,
                        D / 16 - c0 < WEIGH_CHUNKS ? (int)(D / 16 - c0) : WEIGH_CHUNKS, pb + r0 * KEY_BLOCK, vblock,
                        alpha + r0, D, c0, acc + r0 * D);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = t0 + r / G, at = ((b * T + t) * H + kv * G + r % G) * D;
        const v16 inv = v_set1(1.0f / v_reduce_add(v_load(sums + r * 16)));
        for (int64_t c = 0; c < D; c += 16) {
            const v16 o = v_mul(v_load(acc + r * D + c), inv);
            if (out_f32) v_store((float *)out + at + c, o);
            else v_store_bf16((bf16 *)out + at + c, o);
        }
    }
}

// K and V of positions [k0, k0 + 32) of one cache row's key/value head (keys, values: [slots, D] of it) in the
// layouts qk_tile and pv_tile read; positions from kv_len on are zeros (no query sees them, and a zero value weighed
// by p = 0 stays 0 where a stale slot's could be anything).
static void pack_key_block(const bf16 *keys, const bf16 *values, int64_t kv_len, int64_t D, int64_t k0, bf16 *kp,
                           bf16 *vp) {
    for (int64_t j = 0; j < KEY_BLOCK; j++) {
        const int64_t at = k0 + j;
        for (int64_t d = 0; d < D; d++) {
            const bf16 k = at < kv_len ? keys[at * D + d] : 0, v = at < kv_len ? values[at * D + d] : 0;
            kp[((d / 2) * KEY_BLOCK + j) * 2 + d % 2] = k;
            vp[((j / 2) * D + d) * 2 + j % 2] = v;
        }
    }
}

// The attention of a prefill (see above): q [B, T, H, D] bf16 with `token_stride` elements between tokens (T of them
// between batch entries: a view of the projections), rows [B] the cache row of each batch entry, pos [B, T] each
// query's position (below kv_len), window 0 or the sliding window; caches [users, Hk, slots, D]; out [B, T, H, D]
// in float32 (out_f32, for the tests) or bf16. workspace: prefill_attention_workspace_bytes.
void prefill_attention(const bf16 *q, int64_t token_stride, int64_t B, int64_t T, int64_t H, int64_t Hk, int64_t D,
                       const int64_t *rows, const int64_t *pos, int64_t window, int64_t kv_len, const bf16 *k_cache,
                       const bf16 *v_cache, int64_t slots, void *out, int out_f32, void *workspace, int threads) {
    const int64_t G = H / Hk, per_item = prefill_queries(G), items_per_b = (T + per_item - 1) / per_item;
    const int64_t blocks = prefill_blocks(kv_len), head_elems = blocks * KEY_BLOCK * D;
    bf16 *kpack = workspace, *vpack = kpack + B * Hk * head_elems;
    char *scratch = (char *)workspace + round64(2 * B * Hk * head_elems * (int64_t)sizeof(bf16));
    const float scale = 1.0f / sqrtf((float)D);
    int64_t from[B > 0 ? B : 1];  // each batch entry's first packed position: its earliest query's first key's block
    for (int64_t b = 0; b < B; b++) {
        from[b] = INT64_MAX;
        for (int64_t t = 0; t < T; t++) {
            const int64_t first = first_visible(pos[b * T + t], window);
            from[b] = first < from[b] ? first : from[b];
        }
        from[b] = from[b] / KEY_BLOCK * KEY_BLOCK;
    }
#pragma omp parallel num_threads(threads)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
#pragma omp for collapse(3) schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t kv = 0; kv < Hk; kv++)
                for (int64_t i = 0; i < blocks; i++) {
                    const int64_t k0 = from[b] + i * KEY_BLOCK, cache = (rows[b] * Hk + kv) * slots * D;
                    if (k0 < kv_len)
                        pack_key_block(k_cache + cache, v_cache + cache, kv_len, D, k0,
                                       kpack + (b * Hk + kv) * head_elems + i * KEY_BLOCK * D,
                                       vpack + (b * Hk + kv) * head_elems + i * KEY_BLOCK * D);
                }
        // the latest queries (the most keys) first, so that the threads finish together
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items_per_b * B * Hk; item++) {
            const int64_t chunk = items_per_b - 1 - item / (B * Hk), b = item % (B * Hk) / Hk, kv = item % Hk;
            const int64_t t0 = chunk * per_item, t1 = t0 + per_item < T ? t0 + per_item : T;
            prefill_item(q, token_stride, T, b, t0, t1, H, G, kv, D, pos, window,
                         kpack + (b * Hk + kv) * head_elems, vpack + (b * Hk + kv) * head_elems, from[b], scale,
                         scratch + thread * prefill_scratch_bytes(G, D), out, out_f32);
        }
    }
}

// A prefill's rotary embedding and cache writes, as attention_f32 does a packed step's (rotate): qkv [B, T, (H + 2 Hk)
// D], token b, t rotated at slot[b, t] (its position; a padding token's is the scratch slot) and its K and V written
// there in cache row rows[b]; the rotated queries go to q_rot [B, T, H, D]. A row's padding tokens may write its
// scratch slot from several threads at once: nothing reads that slot (model.py KVCache), so no result depends on it.
void prefill_rotate(const bf16 *qkv, int64_t B, int64_t T, int64_t H, int64_t Hk, int64_t D, const int64_t *rows,
                    const int64_t *slot, const bf16 *cos, const bf16 *sin, bf16 *k_cache, bf16 *v_cache, int64_t slots,
                    bf16 *q_rot, int threads) {
    const int64_t width = (H + 2 * Hk) * D;
#pragma omp parallel for num_threads(threads)
    for (int64_t bt = 0; bt < B * T; bt++) {
        const bf16 *x = qkv + bt * width, *c = cos + slot[bt] * D, *s = sin + slot[bt] * D;
        for (int64_t h = 0; h < H; h++) rotate(x + h * D, c, s, D, q_rot + (bt * H + h) * D);
        for (int64_t h = 0; h < Hk; h++) {
            const int64_t at = ((rows[bt / T] * Hk + h) * slots + slot[bt]) * D;
            rotate(x + (H + h) * D, c, s, D, k_cache + at);
            memcpy(v_cache + at, x + (H + Hk + h) * D, D * sizeof(bf16));
        }
    }
}
