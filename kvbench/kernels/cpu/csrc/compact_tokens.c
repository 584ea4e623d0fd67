/* Keeping some tokens of each head of a cache tensor in place, copied by runs: a run of consecutive kept positions
 * is one memmove, not a per-element index. The results are torch's gather's, byte for byte.
 *
 * compact_tokens — decode-time eviction in place: keep index[h][0..N) of each head, moved to slots [0, N) of the same
 * storage. A grid row's cache (kvbench/native/grid_decode.py) lives in slots of one batch tensor; evicting one token per
 * step by gathering the kept ones into a new tensor and writing them back copies the whole cache twice per step and
 * layer. Here the kept tokens before the first evicted one stay where they are and each later run is one memmove —
 * one token evicted is one memmove of the tail. index must be strictly increasing (sources at or after targets).
 * base: head h token t at base + (h * head_stride + t * D) * elem_bytes.
 *
 * n_old tokens per head before, index int64. Return 0, or 2 (nothing written) when an index is out of range or not
 * strictly increasing: the caller's torch gather then says why.
 */
#include <stdint.h>
#include <string.h>

static int out_of_range(const int64_t *index, int64_t rows, int64_t N, int64_t n_old) {
    for (int64_t r = 0; r < rows; r++) /* checked for every head before anything moves */
        for (int64_t j = 0; j < N; j++) {
            const int64_t at = index[r * N + j];
            if (at < 0 || at >= n_old || (j > 0 && at <= index[r * N + j - 1])) return 1;
        }
    return 0;
}

/* token j ← token keep[j] for j in [from, N), one memmove per run of consecutive positions */
static void copy_runs(char *base, const int64_t *keep, int64_t from, int64_t N, int64_t token) {
    int64_t j = from;
    while (j < N) {
        int64_t run = 1;
        while (j + run < N && keep[j + run] == keep[j] + run) run++;
        memmove(base + j * token, base + keep[j] * token, (size_t)(run * token));
        j += run;
    }
}

int compact_tokens(void *base, int64_t elem_bytes, int64_t H, int64_t head_stride, int64_t D, int64_t n_old,
                   const int64_t *index, int64_t N) {
    if (out_of_range(index, H, N, n_old)) return 2;
    for (int64_t h = 0; h < H; h++) {
        char *head = (char *)base + h * head_stride * elem_bytes;
        const int64_t *keep = index + h * N;
        int64_t j = 0;
        while (j < N && keep[j] == j) j++; /* already in place */
        copy_runs(head, keep, j, N, D * elem_bytes);
    }
    return 0;
}
