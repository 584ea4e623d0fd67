/* KIVI decode attention on the packed int32 words, for the CPU: one query per sequence and query head over a layer's
 * KiviStorage (kvbench/kernels/kivi_attention.py: layout and the folding of scales and zeros, which this follows). The codes
 * are unpacked from the words straight into vector registers and used there by every query head of the KV head (the
 * fast path, below; unusual word counts go one word row at a time through a buffer of G' floats that stays in L1):
 * nothing of the cache's size is written, where the torch path writes every code out as a 4-byte float.
 *
 * Phases, each split into fixed work items (never by thread count), so a result does not depend on the number of
 * threads or their timing:
 *   1. key scores of the quantized keys, per (b, h, block of key groups):
 *        s[g, t] = sum_d (x_gd * ks_dn) * c_dt + sum_d x_gd * kz_dn        (n: t's group), in log2 units
 *   2. per query row (b, h, g): the residual keys' scores, dead slots -> -inf, softmax (in place: probabilities)
 *   3. value sums over the quantized values, per (b, h, block of tokens), into that block's partial (G_q, D):
 *        o[g, d] = sum_t (p_gt * vs_tm) * c_td + sum_t p_gt * vz_tm           (m: d's group)
 *   4. per query row: the blocks' partials added in block order, the residual values, written in the model dtype.
 * Bit planes: with P = 32 / bits codes per word, a group's W words unpack as codes[p * W + w] = field p of word w =
 * code w * P + p of the group (the same order as unpack_planes' on the torch side); only the small per-group results
 * are put back in time / channel order. x = query * scaling * log2(e): scores in log2 units, softmax by exp2.
 *
 * Tensors are contiguous; float tensors (query, scales, zeros, residuals, out) are all float32 or all bfloat16.
 * Returns 0, or 1 when scratch memory could not be allocated (nothing written; the caller runs the torch path).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvbench_math.h"

#pragma GCC optimize("fp-contract=fast") /* a * b + c as one FMA (-std=c11 turns contraction off) */

#define KEY_BLOCK_TOKENS 256   /* quantized key slots per work item of phase 1 (whole groups) */
#define VALUE_BLOCK_TOKENS 256 /* quantized value tokens per work item of phase 3 */
#define MIN_CODES_PER_THREAD (64 * 1024) /* ~5 us of work on one core: tiny layers stay on one thread */

/* The W words of one group as floats in bit-plane order: codes[p * W + w] = field p of word w (the generic path, any
 * W; `bits` is a literal at every call, the switch in `unpack`, so the plane loop unrolls). */
static inline __attribute__((always_inline)) void unpack_bits(const int32_t *words, int64_t W, int bits,
                                                              float *codes) {
    const uint32_t mask = (1u << bits) - 1u;
    for (int p = 0; p < 32 / bits; p++) {
#pragma omp simd
        for (int64_t w = 0; w < W; w++) codes[p * W + w] = (float)(((uint32_t)words[w] >> (p * bits)) & mask);
    }
}

static void unpack(const int32_t *words, int64_t W, int bits, float *codes) {
    switch (bits) {
    case 2: unpack_bits(words, W, 2, codes); break;
    case 4: unpack_bits(words, W, 4, codes); break;
    default: unpack_bits(words, W, 8, codes); break;
    }
}

/* acc[k] += m * codes[k] for k < n, for each of n_rows (m, acc) pairs (the generic path) */
static inline void fma_rows(float *acc, int64_t acc_stride, const float *m, int64_t m_stride, int64_t n_rows,
                            const float *codes, int64_t n) {
    for (int64_t g = 0; g < n_rows; g++) {
        float *a = acc + g * acc_stride;
        float mg = m[g * m_stride];
#pragma omp simd
        for (int64_t k = 0; k < n; k++) a[k] += mg * codes[k];
    }
}

/* ---- the fast path: codes unpacked straight into vector registers, accumulators held in registers ----------------
 * A group's G' = P * W codes in plane order are G'/8 vectors of 8 lanes; vector j holds plane-order positions
 * 8j .. 8j + 7, i.e. lane l is field (8j + l) / W of word (8j + l) % W. With W a multiple of 8 a vector is 8
 * consecutive words shifted alike (one load, one shift, one mask, one conversion); with W = 2 or 4 it is the W words
 * repeated 8 / W times, each repeat shifted to its own plane. Up to 3 query rows x 8 vectors are accumulated (24
 * registers), each code vector used by every row. Other W (odd word counts, W = 1) take the generic path. */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint64_t v4u64 __attribute__((vector_size(32)));
typedef uint64_t v2u64 __attribute__((vector_size(16)));

static inline __attribute__((always_inline)) v8f code_vector(const int32_t *words, int64_t j, int64_t W, int bits,
                                                             const int small) {
    const uint32_t mask = (1u << bits) - 1u;
    v8u v;
    if (small == 0) { /* W % 8 == 0 */
        memcpy(&v, words + (8 * j) % W, sizeof v);
        return __builtin_convertvector((v >> (uint32_t)((8 * j) / W * bits)) & mask, v8f);
    }
    v8u shift;
    if (small == 4) { /* the 4 words in both halves: one broadcast load, plain C (no shuffle builtins: gcc < 12) */
        v2u64 w;
        memcpy(&w, words, sizeof w);
        v = (v8u)(v4u64){w[0], w[1], w[0], w[1]};
    } else {
        uint64_t w;
        memcpy(&w, words, sizeof w);
        v = (v8u)(v4u64){w, w, w, w};
    }
#pragma GCC unroll 8
    for (int l = 0; l < 8; l++) shift[l] = (uint32_t)((8 * j + l) / small * bits);
    return __builtin_convertvector((v >> shift) & mask, v8f);
}

/* out[q * out_ld + 8j + l] = sum_s mult[q * mult_ld + s] * (code vector j of the words at words + s * stride)[l], for
 * rows q < NQ and vectors j0 <= j < j0 + J: NQ, J, `small` (0 or W) and, for small W, bits are literals at each
 * call. */
static inline __attribute__((always_inline)) void dot_codes(const int32_t *words, int64_t stride, int64_t n_steps,
                                                            const float *mult, int64_t mult_ld, float *out,
                                                            int64_t out_ld, int64_t W, int bits, int64_t j0,
                                                            const int NQ, const int J, const int small) {
    v8f acc[3][8];
    for (int q = 0; q < NQ; q++)
        for (int j = 0; j < J; j++) acc[q][j] = (v8f){0};
    for (int64_t s = 0; s < n_steps; s++) {
        const int32_t *w = words + s * stride;
#pragma GCC unroll 8 /* fully: the accumulators then live in registers */
        for (int j = 0; j < J; j++) {
            v8f c = code_vector(w, j0 + j, W, bits, small);
#pragma GCC unroll 3
            for (int q = 0; q < NQ; q++) acc[q][j] += c * mult[q * mult_ld + s];
        }
    }
    for (int q = 0; q < NQ; q++)
        for (int j = 0; j < J; j++) memcpy(out + q * out_ld + 8 * (j0 + j), &acc[q][j], sizeof(v8f));
}

static inline int fast_path(int64_t W) { return W % 8 == 0 || W == 2 || W == 4; }

#define DOT_ROWS(J, SMALL, BITS)                                                                                     \
    switch (nq) {                                                                                                    \
    case 1: dot_codes(words, stride, n_steps, mult, mult_ld, out, out_ld, W, BITS, j0, 1, J, SMALL); break;         \
    case 2: dot_codes(words, stride, n_steps, mult, mult_ld, out, out_ld, W, BITS, j0, 2, J, SMALL); break;         \
    default: dot_codes(words, stride, n_steps, mult, mult_ld, out, out_ld, W, BITS, j0, 3, J, SMALL); break;        \
    }

/* out (n_rows, out_ld) in plane order: the whole group's G' codes against n_rows multiplier rows (fast_path(W)) */
static void dot_group(const int32_t *words, int64_t stride, int64_t n_steps, const float *mult_rows, int64_t mult_ld,
                      int64_t n_rows, float *out_rows, int64_t out_ld, int64_t W, int bits) {
    const int64_t n_vectors = 32 / bits * W / 8;
    for (int64_t q0 = 0; q0 < n_rows; q0 += 3) {
        const int64_t nq = n_rows - q0 < 3 ? n_rows - q0 : 3;
        const float *mult = mult_rows + q0 * mult_ld;
        float *out = out_rows + q0 * out_ld;
        if (W % 8 == 0) {
            const int64_t J = n_vectors % 8 == 0 ? 8 : 4; /* n_vectors is a multiple of P >= 4 */
            for (int64_t j0 = 0; j0 < n_vectors; j0 += J) {
                if (J == 8) {
                    DOT_ROWS(8, 0, bits)
                } else {
                    DOT_ROWS(4, 0, bits)
                }
            }
            continue;
        }
        const int64_t j0 = 0;
        if (W == 4) {
            if (bits == 2) DOT_ROWS(8, 4, 2) else if (bits == 4) DOT_ROWS(4, 4, 4) else DOT_ROWS(2, 4, 8)
        } else {
            if (bits == 2) DOT_ROWS(4, 2, 2) else if (bits == 4) DOT_ROWS(2, 2, 4) else DOT_ROWS(1, 2, 8)
        }
    }
}

typedef struct {
    int64_t bsz, heads, n_group, dim, group, slots; /* B, H_kv, G_q, D, G, T = N_k * G + r_k */
    int is_bf16;
    float scale;                                     /* scaling * log2(e) */
    const void *query;                               /* (B, H_kv, G_q, D) */
    const int32_t *key_packed;                       /* (B, H_kv, D, N_k * W_k) */
    const void *key_scale, *key_zero;                /* (B, H_kv, D, N_k) */
    const void *key_residual;                        /* (B, H_kv, r_k, D) */
    int64_t n_key_groups, n_key_residual;
    int key_bits;
    const int32_t *value_packed;                     /* (B, H_kv, T_v, D/G * W_v) */
    const void *value_scale, *value_zero;            /* (B, H_kv, T_v, D/G) */
    const void *value_residual;                      /* (B, H_kv, r_v, D) */
    int64_t n_values, n_value_residual;
    int value_bits;
    const int32_t *dead;                             /* (B, H_kv, n_dead) */
    int64_t n_dead;
    float *scores;                                   /* (B, H_kv, G_q, T) scratch: scores, then probabilities */
    float *partial;                                  /* (B, H_kv, n_value_blocks, G_q, D) scratch */
    void *out;                                       /* (B, H_kv, G_q, D) */
} Problem;

static inline int64_t words_per_group(int bits, int64_t group) { return (group * bits + 31) / 32; }

/* out[i] = data[start + i * stride] as floats, i < n */
static void load_strided(const void *data, int64_t start, int64_t stride, int64_t n, int is_bf16, float *out) {
    if (is_bf16) {
        const uint16_t *h = (const uint16_t *)data + start;
        for (int64_t i = 0; i < n; i++) out[i] = bf16_to_float(h[i * stride]);
    } else {
        const float *f = (const float *)data + start;
        for (int64_t i = 0; i < n; i++) out[i] = f[i * stride];
    }
}

/* A group's scale and zero folded into n_rows rows (queries for keys, probabilities for values), vectorised along the
 * row: scaled[g][i] = rows[g][i] * scale[i] and offset[g * offset_ld] = sum_i rows[g][i] * zero[i], i < n. */
static void fold(const float *rows, int64_t rows_ld, int64_t n_rows, const float *scale, const float *zero, int64_t n,
                 float *scaled, int64_t scaled_ld, float *offset, int64_t offset_ld) {
    for (int64_t g = 0; g < n_rows; g++) {
        const float *r = rows + g * rows_ld;
        float *out = scaled + g * scaled_ld, sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            out[i] = r[i] * scale[i];
            sum += r[i] * zero[i];
        }
        offset[g * offset_ld] = sum;
    }
}

/* x = query * scaling * log2(e) of KV head bh: (G_q, D) floats */
static void scaled_query(const Problem *pr, int64_t bh, float *x) {
    int64_t n = pr->n_group * pr->dim;
    for (int64_t i = 0; i < n; i++) x[i] = load_float(pr->query, bh * n + i, pr->is_bf16) * pr->scale;
}

/* phase 1: scores of key groups [n0, n1) of KV head bh */
static void key_block(const Problem *pr, int64_t bh, int64_t n0, int64_t n1) {
    const int64_t G_q = pr->n_group, D = pr->dim, G = pr->group, N = pr->n_key_groups;
    const int bits = pr->key_bits, P = 32 / bits;
    const int64_t W = words_per_group(bits, G), Gp = P * W, row_words = N * W;
    float x[G_q * D], xs[G_q * D], scale[D], zero[D], offset[G_q], codes[Gp], acc[G_q * Gp];
    scaled_query(pr, bh, x);
    const int32_t *packed = pr->key_packed + bh * D * row_words;
    for (int64_t n = n0; n < n1; n++) {
        /* scale and zero folded into the query: x_gd * s_dn, and sum_d x_gd * z_dn */
        load_strided(pr->key_scale, bh * D * N + n, N, D, pr->is_bf16, scale);
        load_strided(pr->key_zero, bh * D * N + n, N, D, pr->is_bf16, zero);
        fold(x, D, G_q, scale, zero, D, xs, D, offset, 1);
        if (fast_path(W)) {
            dot_group(packed + n * W, row_words, D, xs, D, G_q, acc, Gp, W, bits);
        } else {
            memset(acc, 0, sizeof acc);
            for (int64_t d = 0; d < D; d++) {
                unpack(packed + d * row_words + n * W, W, bits, codes);
                fma_rows(acc, Gp, xs + d, D, G_q, codes, Gp);
            }
        }
        for (int64_t g = 0; g < G_q; g++) { /* plane order -> time order, padding dropped */
            float *dst = pr->scores + (bh * G_q + g) * pr->slots + n * G;
            for (int64_t p = 0; p < P; p++)
                for (int64_t w = 0; w < W && w * P + p < G; w++) dst[w * P + p] = acc[g * Gp + p * W + w] + offset[g];
        }
    }
}

/* phase 2: query row r = bh * G_q + g: residual keys' scores, dead slots, softmax in place */
static void softmax_row(const Problem *pr, int64_t r) {
    const int64_t D = pr->dim, T = pr->slots, bh = r / pr->n_group, g = r % pr->n_group;
    const int64_t first = pr->n_key_groups * pr->group; /* the residual's first slot */
    float x[pr->n_group * D];
    scaled_query(pr, bh, x);
    float *s = pr->scores + r * T;
    for (int64_t t = 0; t < pr->n_key_residual; t++) {
        int64_t base = (bh * pr->n_key_residual + t) * D;
        float sum = 0.0f;
        if (pr->is_bf16) {
            const uint16_t *k = (const uint16_t *)pr->key_residual + base;
#pragma omp simd reduction(+ : sum)
            for (int64_t d = 0; d < D; d++) sum += x[g * D + d] * bf16_to_float(k[d]);
        } else {
            const float *k = (const float *)pr->key_residual + base;
#pragma omp simd reduction(+ : sum)
            for (int64_t d = 0; d < D; d++) sum += x[g * D + d] * k[d];
        }
        s[first + t] = sum;
    }
    for (int64_t i = 0; i < pr->n_dead; i++) s[pr->dead[bh * pr->n_dead + i]] = -INFINITY;
    float inv = 1.0f / exp2_shifted_row(s, s, T);
#pragma omp simd
    for (int64_t t = 0; t < T; t++) s[t] *= inv;
}

/* phase 3: sums over quantized value tokens [t0, t1) of KV head bh into partial block `block` */
static void value_block(const Problem *pr, int64_t bh, int64_t block, int64_t t0, int64_t t1) {
    const int64_t G_q = pr->n_group, D = pr->dim, G = pr->group, M = D / G, T_v = pr->n_values;
    const int bits = pr->value_bits, P = 32 / bits;
    const int64_t W = words_per_group(bits, G), Gp = P * W, row_words = M * W;
    float codes[Gp], acc[G_q * M * Gp], offset[G_q * M], ps[G_q * VALUE_BLOCK_TOKENS];
    float scale[VALUE_BLOCK_TOKENS], zero[VALUE_BLOCK_TOKENS];
    memset(acc, 0, sizeof acc);
    const float *probs = pr->scores + bh * G_q * pr->slots;
    const int32_t *rows = pr->value_packed + (bh * T_v + t0) * row_words;
    for (int64_t m = 0; m < M; m++) {
        /* scale and zero folded into the probabilities: p_gt * s_tm, and sum_t p_gt * z_tm */
        load_strided(pr->value_scale, (bh * T_v + t0) * M + m, M, t1 - t0, pr->is_bf16, scale);
        load_strided(pr->value_zero, (bh * T_v + t0) * M + m, M, t1 - t0, pr->is_bf16, zero);
        fold(probs + t0, pr->slots, G_q, scale, zero, t1 - t0, ps, VALUE_BLOCK_TOKENS, offset + m, M);
        if (fast_path(W)) {
            dot_group(rows + m * W, row_words, t1 - t0, ps, VALUE_BLOCK_TOKENS, G_q, acc + m * Gp, M * Gp, W, bits);
            continue;
        }
        for (int64_t t = t0; t < t1; t++) {
            unpack(rows + (t - t0) * row_words + m * W, W, bits, codes);
            fma_rows(acc + m * Gp, M * Gp, ps + t - t0, VALUE_BLOCK_TOKENS, G_q, codes, Gp);
        }
    }
    float *dst = pr->partial + (bh * ((T_v + VALUE_BLOCK_TOKENS - 1) / VALUE_BLOCK_TOKENS) + block) * G_q * D;
    for (int64_t g = 0; g < G_q; g++)
        for (int64_t m = 0; m < M; m++) /* plane order -> channel order, padding dropped */
            for (int64_t p = 0; p < P; p++)
                for (int64_t w = 0; w < W && w * P + p < G; w++)
                    dst[g * D + m * G + w * P + p] = acc[(g * M + m) * Gp + p * W + w] + offset[g * M + m];
}

/* phase 4: query row r: the partials in block order, then the residual values; written in the model dtype */
static void output_row(const Problem *pr, int64_t r) {
    const int64_t D = pr->dim, G_q = pr->n_group, bh = r / G_q, g = r % G_q, T_v = pr->n_values;
    const int64_t n_blocks = (T_v + VALUE_BLOCK_TOKENS - 1) / VALUE_BLOCK_TOKENS;
    float o[D];
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t b = 0; b < n_blocks; b++) {
        const float *src = pr->partial + ((bh * n_blocks + b) * G_q + g) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] += src[d];
    }
    const float *probs = pr->scores + r * pr->slots + T_v;
    for (int64_t t = 0; t < pr->n_value_residual; t++) {
        int64_t base = (bh * pr->n_value_residual + t) * D;
        float p = probs[t];
        if (pr->is_bf16) {
            const uint16_t *v = (const uint16_t *)pr->value_residual + base;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += p * bf16_to_float(v[d]);
        } else {
            const float *v = (const float *)pr->value_residual + base;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
        }
    }
    if (pr->is_bf16) {
        uint16_t *dst = (uint16_t *)pr->out + r * D;
        for (int64_t d = 0; d < D; d++) dst[d] = float_to_bf16(o[d]);
    } else {
        memcpy((float *)pr->out + r * D, o, D * sizeof(float));
    }
}

int kivi_decode_attention(const void *query, void *out, int is_bf16, double scaling, int64_t bsz, int64_t heads,
                          int64_t n_group, int64_t dim, int64_t group, const int32_t *key_packed,
                          const void *key_scale, const void *key_zero, int64_t n_key_groups, int key_bits,
                          const void *key_residual, int64_t n_key_residual, const int32_t *value_packed,
                          const void *value_scale, const void *value_zero, int64_t n_values, int value_bits,
                          const void *value_residual, int64_t n_value_residual, const int32_t *dead, int64_t n_dead,
                          int n_threads) {
    Problem pr = {bsz, heads, n_group, dim, group, n_key_groups * group + n_key_residual, is_bf16,
                  (float)(scaling * 1.4426950408889634), query, key_packed, key_scale, key_zero, key_residual,
                  n_key_groups, n_key_residual, key_bits, value_packed, value_scale, value_zero, value_residual,
                  n_values, n_value_residual, value_bits, dead, n_dead, NULL, NULL, out};
    const int64_t n_heads = bsz * heads, rows = n_heads * n_group;
    const int64_t groups_per_block = group >= KEY_BLOCK_TOKENS ? 1 : KEY_BLOCK_TOKENS / group;
    const int64_t key_blocks = (n_key_groups + groups_per_block - 1) / groups_per_block;
    const int64_t value_blocks = (n_values + VALUE_BLOCK_TOKENS - 1) / VALUE_BLOCK_TOKENS;
    pr.scores = malloc((size_t)(rows * pr.slots + n_heads * value_blocks * n_group * dim + 1) * sizeof(float));
    if (pr.scores == NULL) return 1;
    pr.partial = pr.scores + rows * pr.slots;
    /* threads only where each gets enough codes to outweigh its start and the phases' barriers */
    const int64_t codes = n_heads * dim * (n_key_groups * group + n_values);
    const int64_t useful = codes / MIN_CODES_PER_THREAD > 1 ? codes / MIN_CODES_PER_THREAD : 1;
    n_threads = useful < n_threads ? (int)useful : n_threads;
#pragma omp parallel num_threads(n_threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < n_heads * key_blocks; item++) {
            int64_t bh = item / key_blocks, n0 = item % key_blocks * groups_per_block;
            int64_t n1 = n0 + groups_per_block < n_key_groups ? n0 + groups_per_block : n_key_groups;
            key_block(&pr, bh, n0, n1);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) softmax_row(&pr, r);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < n_heads * value_blocks; item++) {
            int64_t bh = item / value_blocks, block = item % value_blocks, t0 = block * VALUE_BLOCK_TOKENS;
            int64_t t1 = t0 + VALUE_BLOCK_TOKENS < n_values ? t0 + VALUE_BLOCK_TOKENS : n_values;
            value_block(&pr, bh, block, t0, t1);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) output_row(&pr, r);
    }
    free(pr.scores);
    return 0;
}
