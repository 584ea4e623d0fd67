/* Column sums of a causal softmax, fused: per row one loop instead of torch's widen / max / subtract / exp2 / sum
 * passes and a matrix-vector product, with the row's exponentials kept in a small buffer instead of a tile in memory.
 *
 * scores: n_heads * period rows x cols (row stride cols elements, contiguous), bfloat16 (as uint16) or float32, in
 * log2 units; row r is query c = r % period of head h = r / period. Causal (causal != 0): query c sees the first
 * n_c = min(cols, first_valid + c + 1) columns (its own position is first_valid + c); else all cols.
 *     out[h * out_ld + j] += sum_c 2^(s[r, j] - max_r) / sum_j' 2^(s[r, j'] - max_r)     for j < cols
 * work: n_threads * (n_heads + 1) * cols floats of scratch (per thread: partial sums of the heads it covers, one row).
 * Threads take contiguous blocks of rows; the partial sums are added into out after a barrier, in thread order,
 * so a result does not depend on timing.
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <string.h>

/* 2^x for x <= 0: x = n + f, n = rint(x), |f| <= 1/2; 2^f by its Taylor series to degree 7 (relative error < 1e-8,
 * below float32's rounding), 2^n built in the exponent bits. Clamped at -126 (2^-126 ~ 1e-38: nothing a column sum
 * of probabilities can see), which keeps 2^n a normal float. */
static inline float exp2_nonpositive(float x) {
    x = x < -126.0f ? -126.0f : x;
    float n = rintf(x);
    float f = x - n;
    float p = 1.5252733804059840e-05f;      /* ln2^7 / 7! */
    p = p * f + 1.5403530393381606e-04f;    /* ln2^6 / 6! */
    p = p * f + 1.3333558146428443e-03f;    /* ln2^5 / 5! */
    p = p * f + 9.6181291076284772e-03f;    /* ln2^4 / 4! */
    p = p * f + 5.5504108664821580e-02f;    /* ln2^3 / 3! */
    p = p * f + 2.4022650695910071e-01f;    /* ln2^2 / 2! */
    p = p * f + 6.9314718055994531e-01f;    /* ln2 */
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float row_max_widen(const void *scores, int is_bf16, int64_t offset, int64_t n, float *row,
                                   const float **source) {
    float m = -INFINITY;
    if (is_bf16) { /* widen into the row buffer: the exp loop then reads float32 either way */
        const uint16_t *h = (const uint16_t *)scores + offset;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < n; j++) {
            row[j] = bf16_to_float(h[j]);
            m = row[j] > m ? row[j] : m;
        }
        *source = row;
    } else {
        const float *s = (const float *)scores + offset;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
        *source = s;
    }
    return m;
}

static inline int covers(int64_t first_row, int64_t last_row, int64_t head, int64_t period) {
    return first_row < last_row && first_row / period <= head && head <= (last_row - 1) / period;
}

void softmax_column_sums(const void *scores, int is_bf16, int64_t n_heads, int64_t period, int64_t cols,
                         int64_t first_valid, int causal, float *out, int64_t out_ld, float *work, int n_threads) {
    int64_t rows = n_heads * period;
#pragma omp parallel num_threads(n_threads)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
        float *partial = work + t * (n_heads + 1) * cols;  /* (n_heads, cols) */
        float *row = partial + n_heads * cols;             /* (cols,) */
        if (r0 < r1) memset(partial + (r0 / period) * cols, 0, ((r1 - 1) / period - r0 / period + 1) * cols * 4);
        for (int64_t r = r0; r < r1; r++) {
            int64_t n = causal ? first_valid + r % period + 1 : cols;
            n = n < cols ? n : cols;
            const float *s;
            float m = row_max_widen(scores, is_bf16, r * cols, n, row, &s);
            if (n == 0 || m == -INFINITY) continue;  /* a fully masked row adds nothing */
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t j = 0; j < n; j++) {
                row[j] = exp2_nonpositive(s[j] - m);
                total += row[j];
            }
            float inv = 1.0f / total, *acc = partial + (r / period) * cols;
#pragma omp simd
            for (int64_t j = 0; j < n; j++) acc[j] += row[j] * inv;
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t h = 0; h < n_heads; h++) {
            float *dst = out + h * out_ld;
            for (int64_t u = 0; u < nt; u++) {
                if (!covers(rows * u / nt, rows * (u + 1) / nt, h, period)) continue;
                const float *src = work + u * (n_heads + 1) * cols + h * cols;
#pragma omp simd
                for (int64_t j = 0; j < cols; j++) dst[j] += src[j];
            }
        }
    }
}
