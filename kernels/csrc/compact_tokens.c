/* Decode-time eviction in place: keep tokens index[h][0..N) of each head, moved to slots [0, N) of the same storage.
 * Why: a grid row's cache (kvbench/grid_decode.py) lives in slots of one batch tensor; evicting one token per step
 * by gathering the kept ones into a new tensor and writing them back copies the whole cache twice per step and
 * layer, with a per-element index. Here the kept tokens before the first evicted one stay where they are and each
 * run of consecutive kept tokens after it is one memmove — one token evicted is one memmove of the tail.
 * The result is the gather's, byte for byte: the same tokens in the same order (index is sorted ascending).
 *
 * base: head h token t at base + (h * head_stride + t * D) * elem_bytes; n_old tokens per head before; index: H x N
 * int64 positions, strictly increasing, in [0, n_old). Returns 0, or 2 (nothing moved) when index is not that.
 */
#include <stdint.h>
#include <string.h>

int compact_tokens(void *base, int64_t elem_bytes, int64_t H, int64_t head_stride, int64_t D, int64_t n_old,
                   const int64_t *index, int64_t N) {
    for (int64_t h = 0; h < H; h++) /* checked for every head before anything moves */
        for (int64_t j = 0; j < N; j++) {
            const int64_t at = index[h * N + j];
            if (at < 0 || at >= n_old || (j > 0 && at <= index[h * N + j - 1])) return 2;
        }
    const int64_t token = D * elem_bytes;
    for (int64_t h = 0; h < H; h++) {
        char *head = (char *)base + h * head_stride * elem_bytes;
        const int64_t *keep = index + h * N;
        int64_t j = 0;
        while (j < N && keep[j] == j) j++; /* already in place */
        while (j < N) {                    /* a run of consecutive kept tokens: one move (source at or after target) */
            int64_t run = 1;
            while (j + run < N && keep[j + run] == keep[j] + run) run++;
            memmove(head + j * token, head + keep[j] * token, (size_t)(run * token));
            j += run;
        }
    }
    return 0;
}
