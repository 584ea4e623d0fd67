/* Causal attention of a whole bfloat16 prompt (the prefill: Q = T queries over their own T keys), for CPUs with
 * AVX512-BF16 dot products. Why: torch's CPU flash attention runs bf16 at about the speed of its float32 path on
 * such a CPU (~110 GFLOP/s on 2 cores of the bundled model's shapes, where its bf16 GEMM gives ~400), and the prefill
 * attention is most of a long prompt's forward pass in bf16.
 *
 * The arithmetic is torch's flash attention's for bf16 (aten FlashAttentionKernel.cpp): Q·Kᵀ of bf16 inputs summed in
 * float32, scaled in float32; an online softmax over chunks of KC keys (running max, float32 exponentials and sums,
 * the partial output rescaled when the max grows); the exponentials rounded to bf16 for the P·V product, summed in
 * float32; the output divided by the float32 sum and rounded to bf16 once. This kernel's own: the order of additions
 * and the chunk sizes (vdpbf16ps pairs, 16-key blocks), the scale folded with log2(e) into one float32 constant and
 * 2^x (kvbench_math.h's polynomial, exactly 0 below 2^-126) for e^x, and vdpbf16ps / vcvtneps2bf16 treating denormals
 * as zero — so results differ from torch's in the last bits, and kvbench rows computed with it carry their own hash
 * key (kvbench/run/runner.py).
 *
 * q: (B, H_q, Q, D) at strides (q_b, q_h, q_t) in elements, D contiguous; k, v: (B, H_kv, T, D) at (k_b, k_h, k_t),
 * (v_b, v_h, v_t); out: (B, Q, H_q, D) contiguous — transformers' attention output layout. Q == T (query i sees keys
 * 0..i), H_q a multiple of H_kv (query head h reads KV head h / (H_q / H_kv)), D 64 or 128.
 * work: `prefill_attention_work_bytes` bytes: K and V repacked for the dot products, then each
 * thread's tiles. Returns 0; 2 when this build or these shapes are not supported (nothing written).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16_dot.h"
#include "kvbench_math.h"

#define QB 32  /* queries per work item */
#define KC 512 /* keys per online-softmax chunk */
#ifdef BF16_DOT
_Static_assert(QB % RQ == 0 && KC % 32 == 0, "S holds whole register tiles of rows and whole 16-key blocks of pairs");
#endif

static int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

static int64_t packed_elements(int64_t T, int64_t D) { return round_up(T, KC) * D; } /* per head, K or V */

static int64_t thread_floats(int64_t D) { return QB * KC + QB * KC / 2 + QB * D + 2 * QB; } /* S, P(bf16), acc, m, l */

/* *bytes = the work buffer `prefill_attention` needs for these shapes and threads */
int prefill_attention_work_bytes(int64_t B, int64_t H_kv, int64_t T, int64_t D, int n_threads, int64_t *bytes) {
    *bytes = 2 * B * H_kv * packed_elements(T, D) * 2 + (int64_t)n_threads * thread_floats(D) * 4;
    return 0;
}

int prefill_attention_supported(int64_t D) {
#ifdef BF16_DOT
    return D == 64 || D == 128;
#else
    (void)D;
    return 0;
#endif
}

#ifdef BF16_DOT
/* acc[r][·] += Σ_j P[r][j]·v_j for `rows` rows and `pairs` key pairs; Vp layout: per key pair, per dimension d,
 * (v_2j[d], v_2j+1[d]). nd = D / 16 vectors per row, rows · nd ≤ 24 registers. */
static inline __attribute__((always_inline)) void pv_tile(const uint16_t *P, const uint16_t *Vp, int64_t pairs,
                                                          float *acc, const int rows, const int nd) {
    const int64_t D = nd * 16;
    __m512 c[6][8];
    for (int r = 0; r < rows; r++)
        for (int x = 0; x < nd; x++) c[r][x] = _mm512_loadu_ps(acc + r * D + x * 16);
    for (int64_t jp = 0; jp < pairs; jp++) {
        __m512bh vv[8];
        for (int x = 0; x < nd; x++) vv[x] = (__m512bh)_mm512_loadu_si512(Vp + (jp * D + x * 16) * 2);
        for (int r = 0; r < rows; r++) {
            __m512bh pv = (__m512bh)_mm512_set1_epi32(pair_at(P + r * KC, jp));
            for (int x = 0; x < nd; x++) c[r][x] = _mm512_dpbf16_ps(c[r][x], pv, vv[x]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int x = 0; x < nd; x++) _mm512_storeu_ps(acc + r * D + x * 16, c[r][x]);
}

/* all rows of a query block: P (QB × KC bf16) times the chunk's Vp, into acc (QB × D) */
static void pv_block(const uint16_t *P, const uint16_t *Vp, int64_t pairs, float *acc, int64_t nq, int64_t D) {
    if (D == 64) {
        int64_t r = 0;
        for (; r + 6 <= nq; r += 6) pv_tile(P + r * KC, Vp, pairs, acc + r * D, 6, 4);
        switch (nq - r) {
        case 5: pv_tile(P + r * KC, Vp, pairs, acc + r * D, 5, 4); break;
        case 4: pv_tile(P + r * KC, Vp, pairs, acc + r * D, 4, 4); break;
        case 3: pv_tile(P + r * KC, Vp, pairs, acc + r * D, 3, 4); break;
        case 2: pv_tile(P + r * KC, Vp, pairs, acc + r * D, 2, 4); break;
        case 1: pv_tile(P + r * KC, Vp, pairs, acc + r * D, 1, 4); break;
        default: break;
        }
    } else {
        int64_t r = 0;
        for (; r + 2 <= nq; r += 2) pv_tile(P + r * KC, Vp, pairs, acc + r * D, 2, 8);
        if (r < nq) pv_tile(P + r * KC, Vp, pairs, acc + r * D, 1, 8);
    }
}
#endif

int prefill_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t B,
                      int64_t H_q, int64_t H_kv, int64_t T, int64_t D, int64_t q_b, int64_t q_h, int64_t q_t,
                      int64_t k_b, int64_t k_h, int64_t k_t, int64_t v_b, int64_t v_h, int64_t v_t, double scale,
                      void *work, int n_threads) {
    if (!prefill_attention_supported(D) || H_kv <= 0 || H_q % H_kv != 0 || T <= 0) return 2;
#ifdef BF16_DOT
    const int64_t group = H_q / H_kv, per_head = packed_elements(T, D), Tp = round_up(T, KC);
    uint16_t *Kp = (uint16_t *)work, *Vp = Kp + B * H_kv * per_head;
    float *tiles = (float *)(Vp + B * H_kv * per_head);
    const float log2_scale = (float)(scale * 1.4426950408889634); /* exp2 of log2 units: e^s = 2^(s·log2 e) */

    /* repack each head's K by 16-key blocks of dimension pairs, V by key pairs; zeros past T */
#pragma omp parallel for schedule(static) num_threads(n_threads)
    for (int64_t bh = 0; bh < B * H_kv; bh++) {
        const int64_t b = bh / H_kv, h = bh % H_kv;
        uint16_t *vp = Vp + bh * per_head;
        pack_keys(k + b * k_b + h * k_h, k_t, T, D, Tp, Kp + bh * per_head);
        for (int64_t j = 0; j < Tp; j++) {
            const uint16_t *vr = j < T ? v + b * v_b + h * v_h + j * v_t : NULL;
            for (int64_t d = 0; d < D; d++) vp[((j / 2) * D + d) * 2 + j % 2] = vr != NULL ? vr[d] : 0;
        }
    }

    const int64_t n_blocks = (T + QB - 1) / QB, n_items = B * H_q * n_blocks;
#pragma omp parallel num_threads(n_threads)
    {
        float *S = tiles + (int64_t)omp_get_thread_num() * thread_floats(D);
        uint16_t *P = (uint16_t *)(S + QB * KC);
        float *acc = S + QB * KC + QB * KC / 2, *m = acc + QB * D, *l = m + QB;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n_items; item++) {
            const int64_t bh = item / n_blocks, block = n_blocks - 1 - item % n_blocks; /* long blocks first */
            const int64_t b = bh / H_q, hq = bh % H_q, h = hq / group, q0 = block * QB;
            const int64_t nq = T - q0 < QB ? T - q0 : QB, n_keys = q0 + nq; /* keys the block's last query sees */
            const uint16_t *kp = Kp + (b * H_kv + h) * per_head, *vp = Vp + (b * H_kv + h) * per_head;
            const uint16_t *q_block = q + b * q_b + hq * q_h + q0 * q_t;
            for (int64_t i = 0; i < nq; i++) m[i] = -INFINITY, l[i] = 0.0f;
            memset(acc, 0, (size_t)(QB * D) * sizeof(float));
            for (int64_t c0 = 0; c0 < n_keys; c0 += KC) {
                const int64_t cn = n_keys - c0 < KC ? n_keys - c0 : KC, blocks16 = (cn + 15) / 16;
                qk_scores(q_block, q_t, nq, kp + c0 * D, blocks16, D, log2_scale, S, KC); /* S = Q·Kᵀ, log2 */
                for (int64_t i = 0; i < nq; i++) { /* online softmax: this chunk's exponentials, in log2 units */
                    float *s = S + i * KC;
                    uint16_t *p = P + i * KC;
                    const int64_t seen = q0 + i - c0 + 1, valid = seen < 0 ? 0 : (seen < cn ? seen : cn);
                    float chunk_max = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : chunk_max)
                    for (int64_t j = 0; j < valid; j++) chunk_max = s[j] > chunk_max ? s[j] : chunk_max;
                    const float m_new = chunk_max > m[i] ? chunk_max : m[i];
                    if (m_new == -INFINITY) { /* no key seen yet: nothing to add */
                        memset(p, 0, (size_t)round_up(cn, 2) * sizeof(uint16_t));
                        continue;
                    }
                    const float alpha = exp2_nonpositive(m[i] - m_new); /* m[i] = -inf: 0 */
#pragma omp simd reduction(+ : total)
                    for (int64_t j = 0; j < valid; j++) {
                        float e = exp2_nonpositive(s[j] - m_new);
                        total += e;
                        s[j] = e;
                    }
                    int64_t j = 0; /* P in bf16, rounded to nearest even (vcvtneps2bf16), zeros past the row's keys */
                    for (; j + 16 <= valid; j += 16)
                        _mm256_storeu_si256((__m256i *)(p + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j)));
                    for (; j < valid; j++) p[j] = float_to_bf16(s[j]);
                    for (; j < round_up(cn, 2); j++) p[j] = 0;
                    l[i] = l[i] * alpha + total;
                    m[i] = m_new;
                    if (alpha != 1.0f)
                        for (int64_t d = 0; d < D; d++) acc[i * D + d] *= alpha;
                }
                pv_block(P, vp + c0 * D, round_up(cn, 2) / 2, acc, nq, D);
            }
            for (int64_t i = 0; i < nq; i++) { /* out (B, Q, H_q, D) */
                uint16_t *o = out + ((b * T + q0 + i) * H_q + hq) * D;
                const float inv = 1.0f / l[i];
                for (int64_t d = 0; d < D; d++) o[d] = float_to_bf16(acc[i * D + d] * inv);
            }
        }
    }
    return 0;
#else
    (void)q, (void)k, (void)v, (void)out, (void)B, (void)q_b, (void)q_h, (void)q_t, (void)k_b, (void)k_h, (void)k_t;
    (void)v_b, (void)v_h, (void)v_t, (void)scale, (void)work, (void)n_threads;
    return 2;
#endif
}
