/* y = x Wᵀ for the few rows of a decode step (nn.Linear without bias), float32 or bfloat16, computed so that a row's
 * result never depends on how many rows the call has or how many threads run it: a grid of configurations decoded
 * as one batch (kvbench/native/grid_decode.py) then gets, bit for bit, what each configuration gets decoded alone.
 * torch's CPU products do not promise that: MKL's float32 gemv (one row) and gemm (several) sum in different orders,
 * and oneDNN's bfloat16 kernels round a row differently at some row counts.
 *
 * x: M x K, w: N x K (nn.Linear's weight), y: M x N, all contiguous, one dtype (is_bf16: bfloat16, else float32).
 * Every y[m][n] is the same arithmetic whatever M and the thread count: LANES float32 partial sums, lane l holding
 * fma(x[m][k], w[n][k], ·) over k = l, l + LANES, ... in order, then a fixed halving tree over the lanes, then the
 * K % LANES tail in order by fma. bfloat16 inputs are widened to float32 (their products are exact in float32) and
 * the result rounded to bfloat16 once, to nearest even, as torch rounds its float32 accumulators.
 * Blocking (why it is fast): NB outputs x MB rows of accumulators stay in registers; each weight vector, the bytes a
 * decode step is bound by, is loaded once per MB rows. Threads split the outputs, never a dot product.
 * Returns 0, or 1 when bf16 scratch memory could not be allocated (then y is untouched).
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
#define NB 4 /* outputs per block */
#define MB 4 /* rows per block */

#ifdef __AVX512F__
/* v stays in a register: without this the compiler folds the load into each fma that reads it (a memory operand
 * per fma), and the k loop then waits on the loads — MB x NB of them a step instead of MB + NB */
static inline __attribute__((always_inline)) void in_register(__m512 *v) { __asm__("" : "+v"(*v)); }
#endif

/* out[m][n] = the lane sum, then the K % LANES tail from k on, in order by fma */
static inline void finish(const float *xf, const void *w, int is_bf16, float *out, int64_t m, int64_t n, int64_t k,
                          int64_t K, int64_t N, float sum) {
    for (int64_t t = k; t < K; t++) sum = fmaf(xf[m * K + t], load_float(w, n * K + t, is_bf16), sum);
    out[m * N + n] = sum;
}

/* out[m0 + i][rows[j]] for i < mb, j < NB: rows[] are the block's weight rows (a last, partial block repeats its
 * last row; `stored` says how many are real). mb and is_bf16 are constants at each call site (always_inline), so the
 * accumulators stay in registers and the k loop has no branch but its own; the arithmetic per output is the same for
 * every mb. Each k step also fetches fetch_step bytes of the next block into cache (four prefetches spread over
 * them; a prefetch past the weights' end is a hint that never faults). */
static inline __attribute__((always_inline)) void block(const float *xf, const void *w, const int is_bf16, float *out,
                                                        int64_t m0, const int mb, const int64_t *rows, int stored,
                                                        int64_t K, int64_t N, const char *fetch, int64_t fetch_step) {
    int64_t k = 0;
#ifdef __AVX512F__
    const int64_t quarter = fetch_step / 4;
    __m512 acc[MB][NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (; k + LANES <= K; k += LANES) {
        __m512 wv[NB];
        for (int j = 0; j < NB; j++) {
            wv[j] = lanes_as_float(w, rows[j] * K + k, is_bf16);
            in_register(&wv[j]);
        }
        for (int q = 0; q < 4; q++) _mm_prefetch(fetch + q * quarter, _MM_HINT_T0);
        fetch += fetch_step;
        for (int i = 0; i < mb; i++) {
            __m512 xv = _mm512_loadu_ps(xf + (m0 + i) * K + k);
            in_register(&xv);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++) /* the lane tree in registers: the same additions as halving_sum, in its order */
        for (int j = 0; j < stored; j++) finish(xf, w, is_bf16, out, m0 + i, rows[j], k, K, N, halving_sum16(acc[i][j]));
#else
    (void)fetch, (void)fetch_step;
    float partial[MB][NB][LANES];
    memset(partial, 0, sizeof partial);
    for (; k + LANES <= K; k += LANES) {
        float wv[NB][LANES];
        for (int j = 0; j < NB; j++)
            for (int l = 0; l < LANES; l++) wv[j][l] = load_float(w, rows[j] * K + k + l, is_bf16);
        for (int i = 0; i < mb; i++) {
            const float *xv = xf + (m0 + i) * K + k;
            for (int j = 0; j < NB; j++) {
#pragma omp simd
                for (int l = 0; l < LANES; l++) partial[i][j][l] = fmaf(xv[l], wv[j][l], partial[i][j][l]);
            }
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < stored; j++)
            finish(xf, w, is_bf16, out, m0 + i, rows[j], k, K, N, halving_sum(partial[i][j], LANES));
#endif
}

/* Every row of weight block b: MB rows at a time, then the last rows (a constant count each, so their accumulators
 * stay in registers too). The next block's weights are fetched into cache across all of these passes, an equal
 * share per k step: the stream from memory then overlaps every pass's arithmetic, not the first's. */
static inline __attribute__((always_inline)) void block_rows(const float *xf, const void *w, const int is_bf16,
                                                             float *out, int64_t b, int64_t M, int64_t N, int64_t K) {
    const int64_t elem = is_bf16 ? 2 : 4, steps = K / LANES, passes = (M + MB - 1) / MB;
    const int64_t fetch_step = steps ? (NB * K * elem + passes * steps - 1) / (passes * steps) : 0;
    const char *fetch = (const char *)w + (b + 1) * NB * K * elem;
    int64_t rows[NB];
    int stored = 0;
    for (int j = 0; j < NB; j++) {
        rows[j] = b * NB + j < N ? b * NB + j : N - 1;
        stored += b * NB + j < N;
    }
    int64_t m0 = 0;
    for (; m0 + MB <= M; m0 += MB, fetch += steps * fetch_step)
        block(xf, w, is_bf16, out, m0, MB, rows, stored, K, N, fetch, fetch_step);
    switch (M - m0) {
    case 3: block(xf, w, is_bf16, out, m0, 3, rows, stored, K, N, fetch, fetch_step); break;
    case 2: block(xf, w, is_bf16, out, m0, 2, rows, stored, K, N, fetch, fetch_step); break;
    case 1: block(xf, w, is_bf16, out, m0, 1, rows, stored, K, N, fetch, fetch_step); break;
    default: break;
    }
}

int decode_linear(const void *x, const void *w, void *y, int is_bf16, int64_t M, int64_t N, int64_t K,
                  int n_threads) {
    float *wide = is_bf16 ? malloc((size_t)(M * K + M * N) * sizeof(float)) : NULL; /* bf16: x widened, y in fp32 */
    if (is_bf16 && wide == NULL) return 1;
    const float *xf = is_bf16 ? wide : (const float *)x;
    float *yf = is_bf16 ? wide + M * K : (float *)y;
    if (is_bf16)
        for (int64_t e = 0; e < M * K; e++) wide[e] = bf16_to_float(((const uint16_t *)x)[e]);
    const int64_t n_blocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(n_threads)
    for (int64_t b = 0; b < n_blocks; b++) {
        if (is_bf16)
            block_rows(xf, w, 1, yf, b, M, N, K);
        else
            block_rows(xf, w, 0, yf, b, M, N, K);
    }
    if (is_bf16) {
        for (int64_t e = 0; e < M * N; e++) ((uint16_t *)y)[e] = float_to_bf16(yf[e]);
        free(wide);
    }
    return 0;
}
