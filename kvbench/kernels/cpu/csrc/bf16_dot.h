/* Q·Kᵀ of bfloat16 rows with AVX512-BF16 dot products (vdpbf16ps: pairs of bf16 products, exact in float32, added
 * into float32 accumulators), shared by the kernels that score a prompt's queries against its keys in bf16
 * (softmax_column_sums.c). Only where the compiler targets AVX512-BF16 (-march=native on such a
 * CPU); callers check BF16_DOT. */
#ifndef KVBENCH_BF16_DOT_H
#define KVBENCH_BF16_DOT_H

#include <stdint.h>
#include <string.h>

#ifdef __AVX512BF16__
#include <immintrin.h>
#define BF16_DOT 1
#define RQ 8 /* query rows per register tile (× 32 keys) */

static inline int32_t pair_at(const uint16_t *row, int64_t p) { /* bf16 elements 2p, 2p + 1 as one 32-bit word */
    int32_t word;
    memcpy(&word, row + 2 * p, sizeof word);
    return word;
}

/* Kp (round_up(T, 16) x D) = K (T x D, rows k_t elements apart) by 16-key blocks: per block, per dimension pair p,
 * 16 keys × (d = 2p, 2p + 1) — one vdpbf16ps operand; zeros past T. */
static inline void pack_keys(const uint16_t *k, int64_t k_t, int64_t T, int64_t D, int64_t padded, uint16_t *Kp) {
    for (int64_t j = 0; j < padded; j++)
        for (int64_t d = 0; d < D; d++)
            Kp[((j / 16) * (D / 2) + d / 2) * 32 + (j % 16) * 2 + d % 2] = j < T ? k[j * k_t + d] : 0;
}

/* S[r][16·kb + ·] = scale · q_r·kᵀ for RQ rows and 16·nkb keys of the 16-key block kb */
static inline __attribute__((always_inline)) void qk_tile(const uint16_t *const *rows, const uint16_t *Kp, int64_t kb,
                                                          const int nkb, int64_t D, float scale, float *S,
                                                          int64_t s_stride) {
    __m512 acc[RQ][2];
    for (int r = 0; r < RQ; r++)
        for (int b = 0; b < nkb; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        __m512bh kv[2];
        for (int b = 0; b < nkb; b++) kv[b] = (__m512bh)_mm512_loadu_si512(Kp + ((kb + b) * (D / 2) + p) * 32);
        for (int r = 0; r < RQ; r++) {
            __m512bh qv = (__m512bh)_mm512_set1_epi32(pair_at(rows[r], p));
            for (int b = 0; b < nkb; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qv, kv[b]);
        }
    }
    for (int r = 0; r < RQ; r++)
        for (int b = 0; b < nkb; b++)
            _mm512_storeu_ps(S + r * s_stride + (kb + b) * 16, _mm512_mul_ps(acc[r][b], _mm512_set1_ps(scale)));
}

/* S (round_up(n_rows, RQ) x s_stride, s_stride ≥ 16·blocks) = scale · Q·Kᵀ for rows q + r·q_stride (D each) against the first
 * `blocks` 16-key blocks of Kp; every q_r·k_j is the same arithmetic whatever the other rows. */
static inline void qk_scores(const uint16_t *q, int64_t q_stride, int64_t n_rows, const uint16_t *Kp, int64_t blocks,
                             int64_t D, float scale, float *S, int64_t s_stride) {
    for (int64_t r0 = 0; r0 < n_rows; r0 += RQ) {
        const uint16_t *rows[RQ]; /* a last, partial group repeats its last row: S needs round_up(n_rows, RQ) rows */
        for (int r = 0; r < RQ; r++) rows[r] = q + (r0 + r < n_rows ? r0 + r : n_rows - 1) * q_stride;
        int64_t kb = 0;
        for (; kb + 2 <= blocks; kb += 2) qk_tile(rows, Kp, kb, 2, D, scale, S + r0 * s_stride, s_stride);
        if (kb < blocks) qk_tile(rows, Kp, kb, 1, D, scale, S + r0 * s_stride, s_stride);
    }
}
#endif

#endif
