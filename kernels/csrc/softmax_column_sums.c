/* H2O's prefill statistic, fused on the CPU: for every query head, the column sums of the causal softmax of Q·Kᵀ,
 * Σ_i softmax_i(j) — without a score tile that torch widens, exponentiates, sums and multiplies in separate passes.
 *
 * Work items are (query head, chunk of `chunk` queries); each computes its scores with one BLAS call (sgemm_ of
 * torch's own MKL, passed in as a function pointer) into a per-thread float32 tile that stays in cache, then one
 * loop per row: max, 2^(s - max) into a row buffer with the row's sum, and the row / sum added to that head's column
 * sums. Items in head-major order are cut into one contiguous range per thread of equal causal cost (rows × keys
 * seen): a thread adds the heads it covers whole straight into out, and the at most two heads its range shares with
 * a neighbour into two edge rows, added into out after a barrier in thread order — so scratch does not grow with
 * the heads, and a result depends on the thread count, never on timing. One parallel region per layer: torch's
 * per-chunk products and passes scaled badly on 2 threads. Inside the parallel region MKL runs one thread per call.
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

/* The causal cost (score elements) of chunk c: its rows times the keys its last query sees. */
static inline int64_t chunk_cost(int64_t c, int64_t chunk, int64_t n_queries, int64_t first_pos) {
    int64_t c0 = c * chunk, rows = n_queries - c0 < chunk ? n_queries - c0 : chunk;
    return rows * (first_pos + c0 + rows);
}

/* q: (n_kv, group, n_queries, dim) float32 contiguous, rows pre-scaled into log2 units;
 * kt: (n_kv, dim, n_keys) float32 contiguous (keys transposed); query i sits at key position n_keys - n_queries + i
 * (n_queries <= n_keys). out: (n_kv, group, n_keys) float32, += the column sums.
 * work: n_threads * ((chunk + 3) * n_keys + 4) + 2 floats (per thread: a score tile, a row, two edge rows; then
 * two int64 head ids per thread). Returns 0. */
int softmax_column_sums(const float *q, const float *kt, int64_t n_kv, int64_t group, int64_t n_queries,
                        int64_t n_keys, int64_t dim, int64_t chunk, sgemm_fortran sgemm, float *out, float *work,
                        int n_threads) {
    int64_t n_heads = n_kv * group, n_chunks = (n_queries + chunk - 1) / chunk, first_pos = n_keys - n_queries;
    int64_t per_thread = (chunk + 3) * n_keys, head_cost = 0;
    for (int64_t c = 0; c < n_chunks; c++) head_cost += chunk_cost(c, chunk, n_queries, first_pos);
    int64_t total_cost = head_cost * n_heads;
#pragma omp parallel num_threads(n_threads)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *tile = work + t * per_thread, *row = tile + chunk * n_keys, *edges = row + n_keys;
        int64_t edge_head[2] = {-1, -1}; /* the heads of this thread's first and last item, when shared */
        memset(edges, 0, 2 * n_keys * sizeof(float));
        /* this thread's items: those whose cost starts in [t, t + 1) * total / nt (a contiguous range) */
        int64_t lo = total_cost * t / nt, hi = total_cost * (t + 1) / nt, cost = 0, first = -1, last = -2;
        for (int64_t item = 0; item < n_heads * n_chunks; item++) {
            int64_t start = cost;
            cost += chunk_cost(item % n_chunks, chunk, n_queries, first_pos);
            if (start >= lo && start < hi) {
                first = first < 0 ? item : first;
                last = item;
            }
        }
        if (first >= 0 && first % n_chunks != 0) edge_head[0] = first / n_chunks;            /* head begun before */
        if (first >= 0 && last % n_chunks != n_chunks - 1) edge_head[1] = last / n_chunks;  /* head ended after */
        if (edge_head[0] >= 0 && edge_head[0] == edge_head[1]) edge_head[1] = -1;  /* one shared head: one edge row */
        for (int64_t item = first; item <= last && first >= 0; item++) {
            int64_t head = item / n_chunks, c0 = (item % n_chunks) * chunk, kv = head / group;
            int64_t rows = n_queries - c0 < chunk ? n_queries - c0 : chunk, visible = first_pos + c0 + rows;
            scores_gemm(sgemm, q + (head * n_queries + c0) * dim, kt + kv * dim * n_keys, (int)rows, (int)visible,
                        (int)dim, (int)n_keys, tile);
            float *acc = head == edge_head[0] ? edges : head == edge_head[1] ? edges + n_keys : out + head * n_keys;
            for (int64_t r = 0; r < rows; r++) {
                int64_t n = first_pos + c0 + r + 1; /* causal: keys up to the query's own position */
                float inv = 1.0f / exp2_shifted_row(tile + r * visible, row, n);
#pragma omp simd
                for (int64_t j = 0; j < n; j++) acc[j] += row[j] * inv;
            }
        }
        /* nt x 2 head ids after the threads' scratch, 8-byte aligned (work itself is) */
        int64_t *shared_heads = (int64_t *)(work + ((nt * per_thread + 1) & ~(int64_t)1));
        shared_heads[2 * t] = edge_head[0];
        shared_heads[2 * t + 1] = edge_head[1];
#pragma omp barrier
#pragma omp single
        for (int64_t u = 0; u < nt; u++) {
            for (int e = 0; e < 2; e++) {
                int64_t head = shared_heads[2 * u + e];
                if (head < 0) continue;
                const float *src = work + u * per_thread + (chunk + 1 + e) * n_keys;
                float *dst = out + head * n_keys;
#pragma omp simd
                for (int64_t j = 0; j < n_keys; j++) dst[j] += src[j];
            }
        }
    }
    return 0;
}
