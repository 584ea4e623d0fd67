/* KIVI's quantize_pack on the CPU in one pass per group, bit for bit the torch reference (kernels/quantize.py: the
 * contract), for float32 and bfloat16 inputs. KIVI quantizes one value token per layer and decode step, where the
 * reference's ~20 torch ops cost ~45 us of fixed overhead for 64 numbers.
 *
 * x: rows x length (contiguous), groups of `group` consecutive elements per row. Per group, in float32:
 *   low, high = min, max;  exact = (high - low) / (2^bits - 1)
 *   scale = exact (float32) or exact rounded UP to bfloat16 (carry into the top half, then truncate);  zero = low
 *   q = clamp(floor((x - low) / max(scale, 2^-149) + 0.5), 0, 2^bits - 1)     (each step rounded as torch rounds it)
 * packed: words_per_group = ceil(group * bits / 32) int32 words per group, element j in bits [(j % P) * bits, ...)
 * of word j / P (P = 32 / bits, lowest bits first), padding zero. scale, zero: rows x n_groups in x's dtype.
 * No FMA contraction here (-std=c11 turns it off): x - low, the division and + 0.5 must each round as in torch.
 * Returns 0.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "kvbench_math.h"

static inline uint32_t float_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

static inline float bits_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

int kivi_quantize(const void *x, int is_bf16, int64_t rows, int64_t length, int bits, int64_t group, int32_t *packed,
                  void *scale_out, void *zero_out, int n_threads) {
    const int64_t n_groups = length / group, per_word = 32 / bits, words = (group + per_word - 1) / per_word;
    const uint32_t levels = (1u << bits) - 1u;
    const float smallest = bits_float(1u); /* 2^-149: the reference's clamp, a constant group then gets q = 0 */
    if (rows * length < 65536) n_threads = 1; /* one decode step's token: threads would cost more than they save */
#pragma omp parallel for schedule(static) num_threads(n_threads)
    for (int64_t item = 0; item < rows * n_groups; item++) {
        float v[group];
        int32_t q[words * per_word];
        if (is_bf16) {
            const uint16_t *h = (const uint16_t *)x + item * group; /* groups are consecutive along each row */
            for (int64_t j = 0; j < group; j++) v[j] = bf16_to_float(h[j]);
        } else {
            memcpy(v, (const float *)x + item * group, group * sizeof(float));
        }
        float low = v[0], high = v[0];
        for (int64_t j = 1; j < group; j++) {
            low = v[j] < low ? v[j] : low;
            high = v[j] > high ? v[j] : high;
        }
        float exact = (high - low) / (float)levels;
        float scale = is_bf16 ? bits_float((float_bits(exact) + 0xffffu) & 0xffff0000u) : exact;
        float safe = scale > smallest ? scale : smallest;
        for (int64_t j = 0; j < group; j++) {
            float d = floorf((v[j] - low) / safe + 0.5f);
            d = d < 0.0f ? 0.0f : d > (float)levels ? (float)levels : d;
            q[j] = (int32_t)d;
        }
        for (int64_t j = group; j < words * per_word; j++) q[j] = 0;
        int32_t *out = packed + item * words;
        for (int64_t w = 0; w < words; w++) {
            uint32_t word = 0;
            for (int64_t i = 0; i < per_word; i++) word |= (uint32_t)q[w * per_word + i] << (i * bits);
            out[w] = (int32_t)word;
        }
        if (is_bf16) {
            ((uint16_t *)scale_out)[item] = (uint16_t)(float_bits(scale) >> 16); /* exact: rounded above */
            ((uint16_t *)zero_out)[item] = (uint16_t)(float_bits(low) >> 16);    /* exact: one of x's elements */
        } else {
            ((float *)scale_out)[item] = scale;
            ((float *)zero_out)[item] = low;
        }
    }
    return 0;
}
