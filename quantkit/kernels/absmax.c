/* NF4 and FP4 codes (quantkit/quantizers/nf4.py), compiled: each block of a flat float32 array scaled
 * by its absolute maximum, each value given the code of the nearest table entry. The float32
 * operations are the torch path's (bitsandbytes' on the CPU): a full block is multiplied by the
 * reciprocal of its absmax clamped to TINY, a last shorter block is divided by it; the result is
 * clamped to [-1, 1] and ranked among the midpoints between the sorted entries as torch.searchsorted
 * ranks it (the midpoints not >= the value; a NaN passes them all). Built with -ffp-contract=off.
 *
 * absmax_codes(x, n, block, mids, order, codes, absmax): x [n]; mids the 15 midpoints; order the code
 * of each rank; codes [n]; absmax [ceil(n / block)].
 *
 * nested_codes(x, n, block, mids, count, codes, absmax): double quantization's second level
 * (nf4.double_quantize): every block divided by its absmax (unclamped), snapped to a grid of 65536
 * points, ranked among the count midpoints of the sorted 8-bit dynamic map. */
#include <math.h>
#include <stdint.h>

#define TINY 1e-38f
#define MIDS 15
#if defined(__x86_64__) && defined(__linux__)  /* AVX2 where the CPU has it, chosen at load */
#define WIDE __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define WIDE
#endif

/* the largest |x|, NaN if any value is NaN (as torch's amax) */
static float largest(const float *x, int64_t n) {
    float m = 0;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
        nan |= a != a;
    }
    return nan ? NAN : m;
}

/* an absmax clamped to TINY before it scales (torch's clamp keeps a NaN) */
static inline float above_tiny(float m) { return m != m ? m : (m < TINY ? TINY : m); }

/* each value's rank among the midpoints, scaled by scale (or divided by it) */
WIDE static void ranks(const float *x, int64_t n, float scale, int divide, const float *mids, uint8_t *codes) {
    for (int64_t i = 0; i < n; i++) {
        float s = divide ? x[i] / scale : x[i] * scale;
        s = s < -1.0f ? -1.0f : (s > 1.0f ? 1.0f : s);
        uint8_t rank = 0;
        for (int j = 0; j < MIDS; j++) rank += !(mids[j] >= s);
        codes[i] = rank;
    }
}

void absmax_codes(const float *x, int64_t n, int64_t block, const float *mids, const uint8_t *order,
                  uint8_t *codes, float *absmax) {
    int64_t full = n - n % block;
    for (int64_t b = 0; b < full; b += block) {
        float m = largest(x + b, block);
        absmax[b / block] = m;
        ranks(x + b, block, 1.0f / above_tiny(m), 0, mids, codes + b);
    }
    if (full < n) {
        float m = largest(x + full, n - full);
        absmax[full / block] = above_tiny(m);  /* stored clamped */
        ranks(x + full, n - full, absmax[full / block], 1, mids, codes + full);
    }
    int identity = 1;  /* NF4's entries are sorted: its ranks are its codes */
    for (int r = 0; r <= MIDS; r++) identity &= order[r] == r;
    if (!identity)
        for (int64_t i = 0; i < n; i++) codes[i] = order[codes[i]];
}

/* a value's rank among n sorted midpoints: how many are not >= it (torch.searchsorted, left) */
static int rank_of(const float *mids, int n, float x) {
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (!(mids[mid] >= x)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* nf4.snap: a NaN as -1, an infinity as the largest float of its sign (torch.nan_to_num), then the
 * nearest of 65536 evenly spaced points in [-1, 1] */
static float snap(float x) {
    x = x != x ? -1.0f : (isinf(x) ? copysignf(3.4028234663852886e38f, x) : x);
    x = x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x);
    float i = floorf(((x + 1.0f) * 0.5f) * 65535.0f + 0.5f);
    return -1.0f + (2.0f * i) / 65535.0f;
}

void nested_codes(const float *x, int64_t n, int64_t block, const float *mids, int count, uint8_t *codes,
                  float *absmax) {
    for (int64_t b = 0; b < n; b += block) {
        int64_t m = n - b < block ? n - b : block;
        float a = largest(x + b, m);
        absmax[b / block] = a;
        for (int64_t i = 0; i < m; i++) codes[b + i] = (uint8_t)rank_of(mids, count, snap(x[b + i] / a));
    }
}
