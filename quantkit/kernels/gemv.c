/* Products of a few rows of float32 input with a packed weight, on the CPU (quantkit/qlinear.py's
 * fused paths): each weight is decoded to the float32 value the torch fallback's dequantize gives
 * it, by the same operations (built with -ffp-contract=off), multiplied by x and summed. Only the
 * order of the sums differs from dequantize-then-matmul. The packed weight is read once for every
 * ROWS rows of x, so few rows (decoding) cost little more than one.
 *
 * gptq_gemv(x, m, k, qweight, bits, g_idx, scales, zeros, n, j0, j1, y): the GPTQ layout (bits 2, 3,
 * 4 or 8; k a multiple of 32), any g_idx; scales float32 [G, n], zeros int32 [G, n] (unpacked, v1's
 * +1 applied); n, j0 and j1 multiples of 8. y [m, n] (zeros) gets output columns j0:j1.
 *
 * nf4_gemv(x, m, k, packed, table, block, absmax, codes, nested, nested_map, nested_block, offset, r0,
 * r1, n, y): bitsandbytes' layout, blocks running over the whole weight (k and block multiples of 16);
 * each block's absmax float32 in absmax, or with double quantization (absmax NULL) codes[b]'s
 * nested_map entry times nested[b / nested_block], plus offset. y [m, n] gets output rows r0:r1. */
#include <stdint.h>
#include <string.h>

#define ROWS 4
#define INLINE static inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__linux__)  /* AVX-512 or AVX2 where the CPU has it, chosen at load */
#define WIDE __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define WIDE
#endif
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));

INLINE v8 ld(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
INLINE i8 ldi(const int32_t *p) { i8 v; memcpy(&v, p, sizeof v); return v; }
INLINE void st(float *p, v8 v) { memcpy(p, &v, sizeof v); }
INLINE v8 splat(float f) { return (v8){f, f, f, f, f, f, f, f}; }
INLINE float total(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* columns j0:j1 of m rows (m and bits constants after inlining): W^T read a run of 32 inputs (bits
 * words, GPTQ's stream) at a time, 8 columns at a time, each value decoded as (q - z) * s of its
 * own group */
INLINE void gptq_rows(const int m, const float *x, int64_t k, const int32_t *qweight, const int bits,
                      const int32_t *g_idx, const float *scales, const int32_t *zeros, int64_t n, int64_t j0,
                      int64_t j1, float *y) {
    const u8 mask = (u8){0} + ((1u << bits) - 1);
    for (int64_t r = 0; r < k / 32; r++) {
        const float *s[32];
        const int32_t *z[32];
        v8 xs[32][ROWS];
        for (int e = 0; e < 32; e++) {
            s[e] = scales + g_idx[r * 32 + e] * n;
            z[e] = zeros + g_idx[r * 32 + e] * n;
            for (int i = 0; i < m; i++) xs[e][i] = splat(x[i * k + r * 32 + e]);
        }
        for (int64_t j = j0; j < j1; j += 8) {
            u8 words[8];
            for (int w = 0; w < bits; w++) words[w] = (u8)ldi(qweight + (r * bits + w) * n + j);
            v8 acc[ROWS];
            for (int i = 0; i < m; i++) acc[i] = ld(y + i * n + j);
#pragma GCC unroll 32
            for (int e = 0; e < 32; e++) {
                const int word = e * bits / 32, off = e * bits % 32;
                u8 q = words[word] >> off;
                if (off + bits > 32) q |= words[word + 1] << (32 - off);  /* 3 bits: a value across two words */
                v8 w = __builtin_convertvector((i8)(q & mask) - ldi(z[e] + j), v8) * ld(s[e] + j);
                for (int i = 0; i < m; i++) acc[i] += xs[e][i] * w;
            }
            for (int i = 0; i < m; i++) st(y + i * n + j, acc[i]);
        }
    }
}

/* CALL(M) for each pass over the weight, ROWS rows of x at a time (xi, yi the pass's first rows), M
 * the pass's rows as a constant in each case so that the loops over rows unroll */
#define PASSES(CALL)                                         \
    for (int64_t i = 0; i < m; i += ROWS) {                  \
        const float *xi = x + i * k;                         \
        float *yi = y + i * n;                               \
        switch (m - i < ROWS ? (int)(m - i) : ROWS) {        \
            case 1: CALL(1); break;                          \
            case 2: CALL(2); break;                          \
            case 3: CALL(3); break;                          \
            default: CALL(4);                                \
        }                                                    \
    }

WIDE void gptq_gemv(const float *x, int64_t m, int64_t k, const int32_t *qweight, int bits, const int32_t *g_idx,
                    const float *scales, const int32_t *zeros, int64_t n, int64_t j0, int64_t j1, float *y) {
#define GPTQ(M, B) gptq_rows(M, xi, k, qweight, B, g_idx, scales, zeros, n, j0, j1, yi)
#define BY_BITS(M) (bits == 4 ? GPTQ(M, 4) : bits == 8 ? GPTQ(M, 8) : bits == 3 ? GPTQ(M, 3) : GPTQ(M, 2))
    PASSES(BY_BITS)
}

/* the table's entries for 8 codes: two 8-entry halves, chosen by bit 3 */
INLINE v8 lookup(v8 lo, v8 hi, i8 codes) {
#if defined(__GNUC__) && !defined(__clang__)
    return __builtin_shuffle(lo, hi, codes);
#else
    float t[16], v[8];
    memcpy(t, &lo, sizeof lo);
    memcpy(t + 8, &hi, sizeof hi);
    for (int i = 0; i < 8; i++) v[i] = t[codes[i]];
    return ld(v);
#endif
}

/* 8 codes (4 bytes, a byte's first code in its high nibble) looked up in a table of 16 */
INLINE v8 decode(const uint8_t *q, v8 lo, v8 hi) {
    const i8 shift = {4, 0, 12, 8, 20, 16, 28, 24};
    int32_t word = (int32_t)(q[0] | q[1] << 8 | q[2] << 16 | (uint32_t)q[3] << 24);
    return lookup(lo, hi, (((i8){0} + word) >> shift) & 15);
}

/* output rows r0:r1 for m (a constant after inlining) rows of x: each output row's blocks 16 codes
 * at a time, into two sums per row of x (one sum would wait on each add's latency) */
INLINE void nf4_rows(const int m, const float *x, int64_t k, const uint8_t *packed, v8 lo, v8 hi, int64_t block,
                     const float *absmax, const uint8_t *codes, const float *nested, const float *nested_map,
                     int64_t nested_block, float offset, int64_t r0, int64_t r1, int64_t n, float *y) {
    for (int64_t r = r0; r < r1; r++) {
        v8 even[ROWS], odd[ROWS], lo_a = lo, hi_a = hi;
        for (int i = 0; i < m; i++) even[i] = odd[i] = splat(0);
        const uint8_t *q = packed + r * k / 2;
        const float *xr = x;
        int64_t edge = r * k;  /* where the next block starts, counted over the whole weight */
        for (int64_t c = 0; c < k; c += 16, q += 8, xr += 16) {
            if (r * k + c >= edge) {  /* a block may start in one row and end in the next */
                int64_t b = (r * k + c) / block;
                v8 a = splat(absmax ? absmax[b] : nested_map[codes[b]] * nested[b / nested_block] + offset);
                lo_a = lo * a, hi_a = hi * a;  /* table[code] * a for every code, once per block */
                edge = (b + 1) * block;
            }
            v8 w0 = decode(q, lo_a, hi_a), w1 = decode(q + 4, lo_a, hi_a);
            for (int i = 0; i < m; i++) {
                even[i] += ld(xr + i * k) * w0;
                odd[i] += ld(xr + i * k + 8) * w1;
            }
        }
        for (int i = 0; i < m; i++) y[i * n + r] = total(even[i] + odd[i]);
    }
}

WIDE void nf4_gemv(const float *x, int64_t m, int64_t k, const uint8_t *packed, const float *table, int64_t block,
                   const float *absmax, const uint8_t *codes, const float *nested, const float *nested_map,
                   int64_t nested_block, float offset, int64_t r0, int64_t r1, int64_t n, float *y) {
    v8 lo = ld(table), hi = ld(table + 8);
#define NF4(M) nf4_rows(M, xi, k, packed, lo, hi, block, absmax, codes, nested, nested_map, nested_block, offset, \
                        r0, r1, n, yi)
    PASSES(NF4)
}
