/* One decode step's attention — a single query per row and head — over each row's own tokens, float32 or bfloat16,
 * computed so that a row's output never depends on the other rows or the thread count: a grid of configurations
 * decoded as one batch (kvbench/native/grid_decode.py) then gets, bit for bit, what each configuration gets alone.
 * Why C: torch's CPU sdpa for one query costs ~1 ms per call in bf16 at 4K tokens (it reads K/V at a fraction of
 * the memory bandwidth), a grid step makes one such call per row and layer, and one call over the padded batch
 * rounds differently from the per-row calls.
 *
 * q: B x H_q x D contiguous; k, v: row b's kv head g token t at base + b * batch_stride + g * head_stride + t * D
 * (elements; a grid's rows are slices of a longer tensor); lengths[b] tokens per row; out: B x H_q x D contiguous.
 * Query head h reads kv head h / (H_q / H_kv) (transformers' repeat_kv). All arithmetic in float32 (bf16 widened,
 * exact), the output rounded once to bf16 to nearest even when is_bf16.
 * Each row's tokens are cut into chunks that depend only on its own length (≤ MAX_CHUNKS of ≥ MIN_CHUNK tokens);
 * per (row, kv head, chunk) item: scores s = q·k (fixed-order LANES partial sums over D, a fixed tree), in log2
 * units (× scale × log2 e), chunk max m_c, p = 2^(s - m_c), sum_c, acc_c = Σ p v in token order; then per row and
 * head, in chunk order: m = max m_c, out = Σ 2^(m_c - m) acc_c / Σ 2^(m_c - m) sum_c. Items are split among threads,
 * never a sum. A row with no tokens gets zeros; a NaN score makes its head's output NaN, as in torch.
 * Returns 0, or 1 when scratch memory could not be allocated (out untouched).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvbench_math.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MIN_CHUNK 256 /* tokens: below this a chunk's fixed costs show */
#define MAX_CHUNKS 16 /* per row: enough items for the threads at batch 1 */
#define MAX_GROUP 16  /* query heads per kv head held at once */
#define MAX_DIM 256

/* q·k over D in a fixed order (LANES partial sums, a fixed halving tree, then the tail), whatever the caller */
static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float sum;
#ifdef __AVX512F__
    __m512 partial = _mm512_setzero_ps();
    for (; i + LANES <= n; i += LANES) partial = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), partial);
    __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(partial), 1)); /* AVX512F only */
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(partial), high);
    __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    quarter = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    quarter = _mm_add_ss(quarter, _mm_movehdup_ps(quarter));
    sum = _mm_cvtss_f32(quarter);
#else
    float partial[LANES] = {0};
    for (; i + LANES <= n; i += LANES) {
#pragma omp simd
        for (int l = 0; l < LANES; l++) partial[l] = fmaf(a[i + l], b[i + l], partial[l]);
    }
    sum = halving_sum(partial, LANES);
#endif
    for (; i < n; i++) sum = fmaf(a[i], b[i], sum);
    return sum;
}

/* n elements of p from element i as float32: a pointer into p itself (float32), or widened into buf (bf16) */
static inline const float *as_float(const void *p, int is_bf16, int64_t i, int64_t n, float *buf) {
    if (!is_bf16) return (const float *)p + i;
    const uint16_t *h = (const uint16_t *)p + i;
#pragma omp simd
    for (int64_t d = 0; d < n; d++) buf[d] = bf16_to_float(h[d]);
    return buf;
}

#ifdef __AVX512F__
#define HB 4 /* query heads per block of value accumulators */
#define VB 4 /* vectors of LANES per block: HB x VB accumulators stay in registers across a chunk's tokens */

/* acc[h0 + i][d0 + d] += Σ_t p[h0 + i][t] · v_t[d0 + d] for i < hb, d < vb · LANES: one fma per token in token order,
 * as the scalar loop does it, the accumulators held in registers instead of memory. hb and vb are constants at each
 * call site (always_inline), so the loops unroll and the registers hold. */
static inline __attribute__((always_inline)) void value_block(const void *v, int is_bf16, int64_t vbase, int64_t t0,
                                                              int64_t n, int64_t D, const float *p, float *acc,
                                                              int64_t h0, int64_t d0, const int hb, const int vb) {
    __m512 a[HB][VB];
    for (int i = 0; i < hb; i++)
        for (int j = 0; j < vb; j++) a[i][j] = _mm512_loadu_ps(acc + (h0 + i) * D + d0 + j * LANES);
    for (int64_t t = 0; t < n; t++) {
        __m512 vv[VB];
        for (int j = 0; j < vb; j++) vv[j] = lanes_as_float(v, vbase + (t0 + t) * D + d0 + j * LANES, is_bf16);
        for (int i = 0; i < hb; i++) {
            const __m512 w = _mm512_set1_ps(p[(h0 + i) * n + t]);
            for (int j = 0; j < vb; j++) a[i][j] = _mm512_fmadd_ps(w, vv[j], a[i][j]);
        }
    }
    for (int i = 0; i < hb; i++)
        for (int j = 0; j < vb; j++) _mm512_storeu_ps(acc + (h0 + i) * D + d0 + j * LANES, a[i][j]);
}

/* scores[i * n + t] = (q_i · k_t) × log2_scale for the G ≤ 4 query heads of one kv head and n tokens from t0, D = dv ·
 * LANES (dv ≤ 4): dot()'s fmas in dot()'s order, then its halving tree, the G trees side by side — the lanes of four
 * accumulators shuffled into one vector per level, so each level's additions are dot()'s (the same operands, a + b
 * is b + a exactly) — with q and k in registers instead of a widened copy of k read back per head. dv is a constant
 * at each call site (always_inline). */
static inline __attribute__((always_inline)) void score_tokens(const float (*qf)[MAX_DIM], const void *k, int is_bf16,
                                                               int64_t kbase, int64_t t0, int64_t n, int64_t G,
                                                               const int dv, float log2_scale, float *scores) {
    const int64_t D = dv * LANES;
    __m512 q[4][4];
    for (int i = 0; i < 4; i++)
        for (int d = 0; d < dv; d++) q[i][d] = i < G ? _mm512_loadu_ps(qf[i] + d * LANES) : _mm512_setzero_ps();
    const __m512 scale = _mm512_set1_ps(log2_scale);
    for (int64_t t = 0; t < n; t++) {
        __m512 kv[4], acc[4];
        for (int d = 0; d < dv; d++) kv[d] = lanes_as_float(k, kbase + (t0 + t) * D + d * LANES, is_bf16);
        for (int i = 0; i < 4; i++) {
            acc[i] = _mm512_setzero_ps();
            for (int d = 0; d < dv; d++) acc[i] = _mm512_fmadd_ps(q[i][d], kv[d], acc[i]);
        }
        /* lanes l + 8: heads (0, 1) and (2, 3) side by side, 8 lanes each */
        const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], 0x44),
                                         _mm512_shuffle_f32x4(acc[0], acc[1], 0xEE)); /* 256-bit halves */
        const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], 0x44),
                                         _mm512_shuffle_f32x4(acc[2], acc[3], 0xEE));
        /* lanes l + 4: head i in 128-bit lane i */
        const __m512 s4 = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
        const __m512 s2 = _mm512_add_ps(s4, _mm512_permute_ps(s4, 0xEE));                         /* lanes l + 2 */
        const __m512 s1 = _mm512_mul_ps(_mm512_add_ps(s2, _mm512_permute_ps(s2, 0x55)), scale); /* l + 1, scaled */
        float out[LANES];
        _mm512_storeu_ps(out, s1);
        for (int64_t i = 0; i < G; i++) scores[i * n + t] = out[4 * i];
    }
}

#define VALUE_CASE(hb, vb)                                                                                     \
    case (hb) * 8 + (vb):                                                                                      \
        value_block(v, is_bf16, vbase, t0, n, D, p, acc, h0, d0, hb, vb);                                      \
        break;

/* acc (G x D, zeroed) = Σ_t p[i][t] · v_t over the chunk's n tokens from t0, whole vectors by value_block, the
 * D % LANES tail by the scalar loop's own fmas */
static void accumulate_values(const void *v, int is_bf16, int64_t vbase, int64_t t0, int64_t n, int64_t D, int64_t G,
                              const float *p, float *acc) {
    const int64_t whole = D / LANES * LANES;
    for (int64_t h0 = 0; h0 < G; h0 += HB) {
        const int hb = (int)(G - h0 < HB ? G - h0 : HB);
        for (int64_t d0 = 0; d0 < whole; d0 += VB * LANES) {
            const int vb = (int)((whole - d0) / LANES < VB ? (whole - d0) / LANES : VB);
            switch (hb * 8 + vb) {
                VALUE_CASE(1, 1) VALUE_CASE(1, 2) VALUE_CASE(1, 3) VALUE_CASE(1, 4)
                VALUE_CASE(2, 1) VALUE_CASE(2, 2) VALUE_CASE(2, 3) VALUE_CASE(2, 4)
                VALUE_CASE(3, 1) VALUE_CASE(3, 2) VALUE_CASE(3, 3) VALUE_CASE(3, 4)
                VALUE_CASE(4, 1) VALUE_CASE(4, 2) VALUE_CASE(4, 3) VALUE_CASE(4, 4)
            default: break;
            }
        }
    }
    for (int64_t t = 0; t < n && whole < D; t++)
        for (int64_t i = 0; i < G; i++)
            for (int64_t d = whole; d < D; d++)
                acc[i * D + d] = fmaf(p[i * n + t], load_float(v, vbase + (t0 + t) * D + d, is_bf16), acc[i * D + d]);
}
#endif

static inline int64_t chunks_of(int64_t n) { /* depends on the row's own length only */
    int64_t c = n / MIN_CHUNK;
    return c < 1 ? 1 : c > MAX_CHUNKS ? MAX_CHUNKS : c;
}

int decode_attention(const void *q, const void *k, const void *v, void *out, int is_bf16, int64_t B, int64_t H_q,
                     int64_t H_kv, int64_t D, const int64_t *lengths, int64_t k_batch_stride, int64_t k_head_stride,
                     int64_t v_batch_stride, int64_t v_head_stride, double scale, int n_threads) {
    const int64_t G = H_q / H_kv;
    if (G > MAX_GROUP || D > MAX_DIM || G * H_kv != H_q) return 2; /* the caller checks these first */
    int64_t *first = malloc((size_t)(B + 1) * sizeof(int64_t)); /* row b's items start at first[b] * H_kv */
    if (first == NULL) return 1;
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) first[b + 1] = first[b] + chunks_of(lengths[b]);
    const int64_t n_items = first[B] * H_kv;
    /* per item: G maxima, G sums, G x D accumulators */
    float *part = malloc((size_t)n_items * (size_t)(G * (D + 2)) * sizeof(float));
    if (part == NULL) {
        free(first);
        return 1;
    }
    const float log2_scale = (float)(scale * 1.4426950408889634);
    int failed = 0;

#pragma omp parallel for schedule(static) num_threads(n_threads)
    for (int64_t item = 0; item < n_items; item++) {
        const int64_t row_chunk = item / H_kv, g = item % H_kv;
        int64_t b = 0;
        while (first[b + 1] <= row_chunk) b++;
        const int64_t c = row_chunk - first[b], n_chunks = first[b + 1] - first[b], n = lengths[b];
        const int64_t t0 = n * c / n_chunks, t1 = n * (c + 1) / n_chunks;
        float *maxima = part + item * G * (D + 2), *sums = maxima + G, *acc = sums + G;
        float qf[MAX_GROUP][MAX_DIM], kf[MAX_DIM];
        for (int64_t i = 0; i < G; i++)
            for (int64_t d = 0; d < D; d++) qf[i][d] = load_float(q, (b * H_q + g * G + i) * D + d, is_bf16);
        const int64_t kbase = b * k_batch_stride + g * k_head_stride, vbase = b * v_batch_stride + g * v_head_stride;
        float *scores = malloc((size_t)(G * (t1 - t0 > 0 ? t1 - t0 : 1)) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
#ifdef __AVX512F__
        /* vectors per head: up to four query heads per kv head and D of 32 or 64 (SmolLM2's 3 and 64), else 0 */
        const int64_t dv = G <= 4 && D % LANES == 0 ? D / LANES : 0;
        if (dv == 4)
            score_tokens(qf, k, is_bf16, kbase, t0, t1 - t0, G, 4, log2_scale, scores);
        else if (dv == 2)
            score_tokens(qf, k, is_bf16, kbase, t0, t1 - t0, G, 2, log2_scale, scores);
        else
#endif
            for (int64_t t = t0; t < t1; t++) {
                const float *kt = as_float(k, is_bf16, kbase + t * D, D, kf);
                for (int64_t i = 0; i < G; i++) scores[i * (t1 - t0) + t - t0] = dot(qf[i], kt, D) * log2_scale;
            }
        for (int64_t i = 0; i < G; i++) { /* p = 2^(s - max), summed in a fixed order (not omp's reduction) */
            float *p = scores + i * (t1 - t0);
            float top = -INFINITY;
            for (int64_t t = 0; t < t1 - t0; t++) top = p[t] > top ? p[t] : top;
            float partial[LANES] = {0}; /* lane l sums p[l], p[l + LANES], ... in order: whole vectors, then the tail */
            int64_t t = 0;
            for (; t + LANES <= t1 - t0; t += LANES) {
#pragma omp simd
                for (int l = 0; l < LANES; l++) {
                    p[t + l] = exp2_nonpositive(p[t + l] - top);
                    partial[l] += p[t + l];
                }
            }
            for (; t < t1 - t0; t++) {
                p[t] = exp2_nonpositive(p[t] - top);
                partial[t % LANES] += p[t];
            }
            maxima[i] = top;
            sums[i] = halving_sum(partial, LANES);
        }
        memset(acc, 0, (size_t)(G * D) * sizeof(float));
#ifdef __AVX512F__
        accumulate_values(v, is_bf16, vbase, t0, t1 - t0, D, G, scores, acc);
#else
        float vf[MAX_DIM];
        for (int64_t t = t0; t < t1; t++) {
            const float *vt = as_float(v, is_bf16, vbase + t * D, D, vf);
            for (int64_t i = 0; i < G; i++) {
                const float w = scores[i * (t1 - t0) + t - t0];
                float *a = acc + i * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] = fmaf(w, vt[d], a[d]);
            }
        }
#endif
        free(scores);
    }

    if (!failed) {
#pragma omp parallel for schedule(static) num_threads(n_threads)
        for (int64_t bg = 0; bg < B * H_kv; bg++) {
            const int64_t b = bg / H_kv, g = bg % H_kv, n_chunks = first[b + 1] - first[b];
            for (int64_t i = 0; i < G; i++) {
                float top = -INFINITY, total = 0.0f, o[MAX_DIM] = {0};
                for (int64_t c = 0; c < n_chunks; c++) {
                    const float m = part[((first[b] + c) * H_kv + g) * G * (D + 2) + i];
                    top = m > top ? m : top;
                }
                for (int64_t c = 0; c < n_chunks; c++) {
                    const float *maxima = part + ((first[b] + c) * H_kv + g) * G * (D + 2);
                    const float *acc = maxima + 2 * G + i * D;
                    const float w = maxima[i] == -INFINITY ? 0.0f : exp2_nonpositive(maxima[i] - top);
                    total = fmaf(w, maxima[G + i], total);
                    for (int64_t d = 0; d < D; d++) o[d] = fmaf(w, acc[d], o[d]);
                }
                const int64_t at = (b * H_q + g * G + i) * D;
                for (int64_t d = 0; d < D; d++) {
                    const float value = lengths[b] > 0 ? o[d] / total : 0.0f; /* NaN scores stay NaN */
                    if (is_bf16)
                        ((uint16_t *)out)[at + d] = float_to_bf16(value);
                    else
                        ((float *)out)[at + d] = value;
                }
            }
        }
    }
    free(part);
    free(first);
    return failed;
}
