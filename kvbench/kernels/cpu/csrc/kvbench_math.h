/* Small numeric pieces the C kernels share (build.py builds each kernel with this folder on the include
 * path and puts every header's text into its cache key, so a change here rebuilds them all). */
#ifndef KVBENCH_MATH_H
#define KVBENCH_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* 2^x for x <= 0: x = n + f, n = rint(x), |f| <= 1/2; 2^f by its Taylor series to degree 7 (relative error < 1e-8,
 * below float32's rounding), 2^n built in the exponent bits; exactly 0 below -126 (2^-126 ~ 1e-38: what a softmax
 * can see of it), so -inf scores (masked, dead slots) get 0 as torch's softmax gives them. Vectorises. */
static inline float exp2_nonpositive(float x) {
    int below = x < -126.0f;
    x = below ? -126.0f : x;
    float n = rintf(x);
    float f = x - n;
    float p = 1.5252733804059840e-05f;   /* ln2^7 / 7! */
    p = p * f + 1.5403530393381606e-04f; /* ln2^6 / 6! */
    p = p * f + 1.3333558146428443e-03f; /* ln2^5 / 5! */
    p = p * f + 9.6181291076284772e-03f; /* ln2^4 / 4! */
    p = p * f + 5.5504108664821580e-02f; /* ln2^3 / 3! */
    p = p * f + 2.4022650695910071e-01f; /* ln2^2 / 2! */
    p = p * f + 6.9314718055994531e-01f; /* ln2 */
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return below ? 0.0f : p * scale;
}

/* dst[j] = 2^(src[j] - max src) for j < n (dst may be src): a softmax row in log2 units, not yet divided by its
 * sum, which is returned (0, with dst zeroed, when n == 0 or every score is -inf). */
static inline float exp2_shifted_row(const float *src, float *dst, int64_t n) {
    float m = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; j++) m = src[j] > m ? src[j] : m;
    if (m == -INFINITY) {
        memset(dst, 0, n * sizeof(float));
        return 0.0f;
    }
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; j++) {
        dst[j] = exp2_nonpositive(src[j] - m);
        total += dst[j];
    }
    return total;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 lanes of one vector register (what the decode kernels' fixed-order partial sums use) */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif

/* Σ t[0..n) by halving — t[l] += t[l + n/2] for l < n/2, then n/4, ... — n a power of two: one fixed order,
 * whatever the caller (an OpenMP reduction's order is the compiler's). t is overwritten. */
static inline float halving_sum(float *t, int n) {
    for (int width = n / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) t[l] = t[l] + t[l + width];
    return t[0];
}

#ifdef __AVX512F__
#include <immintrin.h>
/* halving_sum of the 16 lanes of v without leaving registers: lanes l + 8, then l + 4, l + 2, l + 1 — the same
 * additions of the same operands as halving_sum (a + b is b + a exactly), so the same bits */
static inline float halving_sum16(__m512 v) {
    const __m256 lo = _mm512_castps512_ps256(v), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* LANES elements from element i of a float32 or bfloat16 array, as float32 (bf16: its bits shifted up, exact) */
static inline __m512 lanes_as_float(const void *data, int64_t i, int is_bf16) {
    if (is_bf16) {
        __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)data + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_loadu_ps((const float *)data + i);
}
#endif

/* element i of a float32 or bfloat16 array, as float32 */
static inline float load_float(const void *data, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)data)[i]) : ((const float *)data)[i];
}

/* float32 -> bfloat16 bits, rounded to nearest even as torch rounds its float32 results; NaN stays NaN */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#endif
