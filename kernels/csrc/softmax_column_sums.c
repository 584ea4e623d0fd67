/* H2O's prefill statistic, fused on the CPU: for every query head, the column sums of the causal softmax of Q·Kᵀ,
 * Σ_i softmax_i(j) — without a score tile that torch widens, exponentiates, sums and multiplies in separate passes.
 *
 * Work items are (query head, chunk of `chunk` queries); each computes its scores with one BLAS call (sgemm_ of
 * torch's own MKL, passed in as a function pointer) into a per-thread float32 tile that stays in cache, then one
 * loop per row: max, 2^(s - max) into a row buffer with the row's sum, and the row / sum added to the thread's
 * partial column sums of that head. Items go to threads round-robin in a fixed order and the partials are added up
 * in thread order after a barrier, so a result depends on the thread count, never on timing. Coarse items, one
 * parallel region per layer: torch's per-chunk products and passes scaled badly on 2 threads. Inside the parallel
 * region MKL runs one thread per call.
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <string.h>

#include "kvbench_math.h"

typedef void (*sgemm_fortran)(const char *, const char *, const int *, const int *, const int *, const float *,
                              const float *, const int *, const float *, const int *, const float *, float *,
                              const int *);

/* scores (rows x cols, row-major, ld cols) = q (rows x dim, ld dim) . kt (dim x cols, ld ld_kt); the BLAS is
 * column-major, so it computes scoresᵀ (cols x rows) = ktᵀ (cols x dim) . qᵀ (dim x rows) on the same memory */
static void scores_gemm(sgemm_fortran sgemm, const float *q, const float *kt, int rows, int cols, int dim, int ld_kt,
                        float *scores) {
    const float one = 1.0f, zero = 0.0f;
    sgemm("N", "N", &cols, &rows, &dim, &one, kt, &ld_kt, q, &dim, &zero, scores, &cols);
}

/* q: (n_kv, group, n_queries, dim) float32 contiguous, rows pre-scaled into log2 units;
 * kt: (n_kv, dim, n_keys) float32 contiguous (keys transposed); query i sits at key position n_keys - n_queries + i.
 * out: (n_kv, group, n_keys) float32, += the column sums. work: n_threads * (chunk + group * n_kv + 1) * n_keys. */
void causal_column_sums(const float *q, const float *kt, int64_t n_kv, int64_t group, int64_t n_queries,
                        int64_t n_keys, int64_t dim, int64_t chunk, sgemm_fortran sgemm, float *out, float *work,
                        int n_threads) {
    int64_t n_heads = n_kv * group, n_chunks = (n_queries + chunk - 1) / chunk, first_pos = n_keys - n_queries;
    int64_t per_thread = (chunk + n_heads + 1) * n_keys;
#pragma omp parallel num_threads(n_threads)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *tile = work + t * per_thread, *partial = tile + chunk * n_keys, *row = partial + n_heads * n_keys;
        memset(partial, 0, n_heads * n_keys * sizeof(float));
        for (int64_t item = t; item < n_heads * n_chunks; item += nt) { /* chunk-major: causal cost spreads evenly */
            int64_t c0 = (item / n_heads) * chunk, head = item % n_heads, kv = head / group;
            int64_t rows = n_queries - c0 < chunk ? n_queries - c0 : chunk, visible = first_pos + c0 + rows;
            scores_gemm(sgemm, q + (head * n_queries + c0) * dim, kt + kv * dim * n_keys, (int)rows, (int)visible,
                        (int)dim, (int)n_keys, tile);
            float *acc = partial + head * n_keys;
            for (int64_t r = 0; r < rows; r++) {
                int64_t n = first_pos + c0 + r + 1; /* causal: keys up to the query's own position */
                float total = exp2_shifted_row(tile + r * visible, row, n);
                float inv = 1.0f / total;
#pragma omp simd
                for (int64_t j = 0; j < n; j++) acc[j] += row[j] * inv;
            }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t h = 0; h < n_heads; h++) {
            for (int64_t u = 0; u < nt; u++) {
                const float *src = work + u * per_thread + chunk * n_keys + h * n_keys;
#pragma omp simd
                for (int64_t j = 0; j < n_keys; j++) out[h * n_keys + j] += src[j];
            }
        }
    }
}
