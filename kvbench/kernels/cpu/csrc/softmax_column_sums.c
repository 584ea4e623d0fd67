/* H2O's prefill statistic, fused on the CPU: for every query head, the column sums of the causal softmax of Q·Kᵀ,
 * Σ_i softmax_i(j) — without a score tile that torch widens, exponentiates, sums and multiplies in separate passes.
 *
 * Work items are (query head, chunk of `chunk` queries); each computes its scores into a per-thread float32 tile that
 * stays in cache — float32 inputs with one BLAS call (sgemm_ of torch's own MKL, passed in as a function pointer),
 * bfloat16 inputs with AVX512-BF16 dot products where the CPU has them (bf16_dot.h: the same exact products, summed
 * in float32 in another order, ~2× the float32 path's speed) — then one
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

#include "bf16_dot.h"
#include "kvbench_math.h"

typedef void (*sgemm_fortran)(const char *, const char *, const int *, const int *, const int *, const float *,
                              const float *, const int *, const float *, const int *, const float *, float *,
                              const int *);

/* Where a chunk's scores come from: float32 rows and transposed keys through sgemm, or bf16 rows and packed keys */
typedef struct {
    sgemm_fortran sgemm;
    const float *q, *kt;    /* float32: q (n_kv, group, n_queries, dim), kt (n_kv, dim, n_keys) */
    const uint16_t *qb, *kp; /* bf16: q as above, kp (n_kv, padded keys, dim) packed by pack_keys */
    int64_t padded;          /* keys per head in kp: round_up(n_keys, 16) */
} scorer;

static int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

/* the tile: rows x ld floats, ld = visible (sgemm) or visible rounded up to 16 keys (bf16, whole blocks) */
static int64_t score_chunk(const scorer *s, int64_t head, int64_t kv, int64_t c0, int64_t rows, int64_t visible,
                           int64_t dim, int64_t n_queries, int64_t n_keys, float *tile) {
    if (s->sgemm != NULL) { /* the BLAS is column-major: scoresᵀ (visible x rows) = ktᵀ (visible x dim) . qᵀ */
        const float one = 1.0f, zero = 0.0f, *q = s->q + (head * n_queries + c0) * dim, *kt = s->kt + kv * dim * n_keys;
        const int m = (int)visible, n = (int)rows, k = (int)dim, ld_kt = (int)n_keys;
        s->sgemm("N", "N", &m, &n, &k, &one, kt, &ld_kt, q, &k, &zero, tile, &m);
        return visible;
    }
#ifdef BF16_DOT
    const int64_t ld = round16(visible);
    qk_scores(s->qb + (head * n_queries + c0) * dim, dim, rows, s->kp + kv * s->padded * dim, ld / 16, dim, 1.0f, tile,
              ld);
    return ld;
#else
    (void)kv, (void)c0, (void)rows, (void)dim, (void)n_queries, (void)n_keys, (void)tile;
    return 0; /* not reached: the bf16 entry point refuses first */
#endif
}

/* The causal cost (score elements) of chunk c: its rows times the keys its last query sees. */
static inline int64_t chunk_cost(int64_t c, int64_t chunk, int64_t n_queries, int64_t first_pos) {
    int64_t c0 = c * chunk, rows = n_queries - c0 < chunk ? n_queries - c0 : chunk;
    return rows * (first_pos + c0 + rows);
}

/* per thread: a score tile (chunk rounded up to whole register tiles × keys rounded up to 16), a row, two edge rows;
 * rounded up to 16 floats, so every thread's tile starts 64-byte aligned (work is): MKL's sgemm rounds a product
 * differently at other alignments, and a chunk's scores must not depend on which thread computes them */
static int64_t per_thread_floats(int64_t chunk, int64_t n_keys) {
    return round16(((chunk + 7) / 8 * 8) * round16(n_keys) + 3 * n_keys);
}

/* *floats = the work buffer (floats) for these shapes: bf16 packed keys first when is_bf16, then each thread's
 * scratch, then two int64 head ids per thread */
int softmax_column_sums_work(int64_t n_kv, int64_t n_keys, int64_t dim, int64_t chunk, int n_threads, int is_bf16,
                             int64_t *floats) {
    *floats = (is_bf16 ? n_kv * round16(n_keys) * dim / 2 : 0) + n_threads * (per_thread_floats(chunk, n_keys) + 4) + 2;
    return 0;
}

static void column_sums(const scorer *s, int64_t n_kv, int64_t group, int64_t n_queries, int64_t n_keys, int64_t dim,
                        int64_t chunk, float *out, float *work, int n_threads) {
    int64_t n_heads = n_kv * group, n_chunks = (n_queries + chunk - 1) / chunk, first_pos = n_keys - n_queries;
    int64_t per_thread = per_thread_floats(chunk, n_keys), head_cost = 0;
    for (int64_t c = 0; c < n_chunks; c++) head_cost += chunk_cost(c, chunk, n_queries, first_pos);
    int64_t total_cost = head_cost * n_heads;
#pragma omp parallel num_threads(n_threads)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *tile = work + t * per_thread, *edges = tile + per_thread - 2 * n_keys, *row = edges - n_keys;
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
            const int64_t ld = score_chunk(s, head, kv, c0, rows, visible, dim, n_queries, n_keys, tile);
            float *acc = head == edge_head[0] ? edges : head == edge_head[1] ? edges + n_keys : out + head * n_keys;
            for (int64_t r = 0; r < rows; r++) {
                int64_t n = first_pos + c0 + r + 1; /* causal: keys up to the query's own position */
                float inv = 1.0f / exp2_shifted_row(tile + r * ld, row, n);
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
                const float *src = work + (u + 1) * per_thread - (2 - e) * n_keys;
                float *dst = out + head * n_keys;
#pragma omp simd
                for (int64_t j = 0; j < n_keys; j++) dst[j] += src[j];
            }
        }
    }
}

/* q: (n_kv, group, n_queries, dim) float32 contiguous, rows pre-scaled into log2 units;
 * kt: (n_kv, dim, n_keys) float32 contiguous (keys transposed); query i sits at key position n_keys - n_queries + i
 * (n_queries <= n_keys). out: (n_kv, group, n_keys) float32, += the column sums.
 * work: `softmax_column_sums_work(..., is_bf16 = 0)` floats. Returns 0. */
int softmax_column_sums(const float *q, const float *kt, int64_t n_kv, int64_t group, int64_t n_queries,
                        int64_t n_keys, int64_t dim, int64_t chunk, sgemm_fortran sgemm, float *out, float *work,
                        int n_threads) {
    const scorer s = {sgemm, q, kt, NULL, NULL, 0};
    column_sums(&s, n_kv, group, n_queries, n_keys, dim, chunk, out, work, n_threads);
    return 0;
}

/* The same for bf16 rows q (n_kv, group, n_queries, dim) — pre-scaled into log2 units and rounded to bf16, as
 * eager attention rounds its scaled query — and keys k (n_kv, n_keys, dim) bf16, both contiguous; dim even.
 * work: `softmax_column_sums_work(..., is_bf16 = 1)` floats (the packed keys first). Returns 0; 2 where this build
 * has no AVX512-BF16 or dim is odd (nothing written). */
int softmax_column_sums_bf16(const uint16_t *q, const uint16_t *k, int64_t n_kv, int64_t group, int64_t n_queries,
                             int64_t n_keys, int64_t dim, int64_t chunk, float *out, float *work, int n_threads) {
#ifdef BF16_DOT
    if (dim % 2 != 0) return 2;
    /* a multiple of 16 floats (padded and dim even): the threads' tiles after it stay 64-byte aligned */
    const int64_t padded = round16(n_keys), packed_floats = n_kv * padded * dim / 2;
    uint16_t *kp = (uint16_t *)work;
#pragma omp parallel for schedule(static) num_threads(n_threads)
    for (int64_t kv = 0; kv < n_kv; kv++) pack_keys(k + kv * n_keys * dim, dim, n_keys, dim, padded, kp + kv * padded * dim);
    const scorer s = {NULL, NULL, NULL, q, kp, padded};
    column_sums(&s, n_kv, group, n_queries, n_keys, dim, chunk, out, work + packed_floats, n_threads);
    return 0;
#else
    (void)q, (void)k, (void)n_kv, (void)group, (void)n_queries, (void)n_keys, (void)dim, (void)chunk, (void)out;
    (void)work, (void)n_threads;
    return 2;
#endif
}

/* 1 where this build scores bf16 rows by AVX512-BF16 dot products (softmax_column_sums_bf16 runs), else 0 */
int softmax_column_sums_has_bf16_dot(void) {
#ifdef BF16_DOT
    return 1;
#else
    return 0;
#endif
}
