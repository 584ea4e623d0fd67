/* Keeping some tokens of each head of a cache tensor, copied by runs: a run of consecutive kept positions is one
 * memmove, not a per-element index (torch's gather reads an int64 index per element: ~0.85 ms a prefill layer of the
 * bundled model in bf16, most of compressing it). The results are the gather's, byte for byte.
 *
 * compact_tokens — decode-time eviction in place: keep index[h][0..N) of each head, moved to slots [0, N) of the same
 * storage. A grid row's cache (kvbench/engine/grid_decode.py) lives in slots of one batch tensor; evicting one token per
 * step by gathering the kept ones into a new tensor and writing them back copies the whole cache twice per step and
 * layer. Here the kept tokens before the first evicted one stay where they are and each later run is one memmove —
 * one token evicted is one memmove of the tail. index must be strictly increasing (sources at or after targets).
 * base: head h token t at base + (h * head_stride + t * D) * elem_bytes.
 *
 * gather_tokens — compression: dst head r (r = b * H + h, contiguous N x D) = src head (b, h) tokens index[r][0..N)
 * in that order (any order), src head at src + (b * stride_b + h * stride_h) * elem_bytes, tokens D apart.
 *
 * Both: n_old tokens per head before, index int64. Return 0, or 2 (nothing written) when an index is out of range
 * (or, in place, not strictly increasing): the caller's torch gather then says why.
 */
#include <stdint.h>
#include <string.h>

static int out_of_range(const int64_t *index, int64_t rows, int64_t N, int64_t n_old, int increasing) {
    for (int64_t r = 0; r < rows; r++) /* checked for every head before anything moves */
        for (int64_t j = 0; j < N; j++) {
            const int64_t at = index[r * N + j];
            if (at < 0 || at >= n_old || (increasing && j > 0 && at <= index[r * N + j - 1])) return 1;
        }
    return 0;
}

/* dst token j ← src token keep[j] for j in [from, N), one memmove per run of consecutive positions */
static void copy_runs(char *dst, const char *src, const int64_t *keep, int64_t from, int64_t N, int64_t token) {
    int64_t j = from;
    while (j < N) {
        int64_t run = 1;
        while (j + run < N && keep[j + run] == keep[j] + run) run++;
        memmove(dst + j * token, src + keep[j] * token, (size_t)(run * token));
        j += run;
    }
}

int compact_tokens(void *base, int64_t elem_bytes, int64_t H, int64_t head_stride, int64_t D, int64_t n_old,
                   const int64_t *index, int64_t N) {
    if (out_of_range(index, H, N, n_old, 1)) return 2;
    for (int64_t h = 0; h < H; h++) {
        char *head = (char *)base + h * head_stride * elem_bytes;
        const int64_t *keep = index + h * N;
        int64_t j = 0;
        while (j < N && keep[j] == j) j++; /* already in place */
        copy_runs(head, head, keep, j, N, D * elem_bytes);
    }
    return 0;
}

int gather_tokens(const void *src, void *dst, int64_t elem_bytes, int64_t B, int64_t H, int64_t stride_b,
                  int64_t stride_h, int64_t D, int64_t n_old, const int64_t *index, int64_t N) {
    if (out_of_range(index, B * H, N, n_old, 0)) return 2;
    for (int64_t r = 0; r < B * H; r++) {
        const char *head = (const char *)src + ((r / H) * stride_b + (r % H) * stride_h) * elem_bytes;
        copy_runs((char *)dst + r * N * D * elem_bytes, head, index + r * N, 0, N, D * elem_bytes);
    }
    return 0;
}
