/* GGUF block types, plain round-to-nearest (no importance matrix): llama.cpp's searches as
 * quantkit/quantizers/ggml.py does them in torch, compiled, so that a GGUF export runs at
 * llama-quantize's speed. Every float32 operation is the torch code's, in its order (sums left to
 * right, a * b * c as (a * b) * c): the bytes equal the torch path's and llama-quantize's. Built
 * with -ffp-contract=off (no fused multiply-adds) and loaded through ctypes (quantkit/blocks.py),
 * which releases the GIL, so rows are quantized on several threads.
 *
 * quantize(type, x, half, rows, k, out): x [rows, k] float32 (float16 where half) row-major, out the
 * rows' blocks. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define EPS 1e-15f

/* llama.cpp's nearest_int, as a float: half to even through the bits of v + 1.5 * 2^23 (exact below
 * 2^22; beyond, the value it gives, so that a degenerate block comes out as llama.cpp's) */
static inline float rnd(float v) {
    float t = v + 12582912.0f;
    int32_t i;
    memcpy(&i, &t, 4);
    return (float)((i & 0x007fffff) - 0x00400000);
}

/* an integer code as the byte llama.cpp stores it holds it */
static inline float as_u8(float v) { return (float)(uint8_t)(int32_t)v; }

static inline float as_i8(float v) { return (float)(int8_t)(int32_t)v; }

static inline float minv(float a, float b) { return b < a ? b : a; }

static inline float maxv(float a, float b) { return b > a ? b : a; }

static inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

static inline float nonzero(float v) { return v == 0 ? 1.0f : v; }

/* float32 -> float16 bits, round to nearest even, and back */
static inline uint16_t half_bits(float f) {
    _Float16 h = (_Float16)f;
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}

static inline float half_value(uint16_t b) {
    _Float16 h;
    memcpy(&h, &b, 2);
    return (float)h;
}

static inline void put_half(uint8_t *p, uint16_t b) { p[0] = b & 255; p[1] = b >> 8; }

/* The value of largest magnitude of n (a multiple of 8) as llama.cpp's sequential loop finds it: the
 * magnitude in 8 running lanes (exact in any order), then the first value of it, so that a zero's
 * sign is the first one's; of all zeros +0 (llama.cpp's running maximum starts there). */
static float largest(const float *x, int n) {
    float p[8];
    for (int b = 0; b < 8; b++) p[b] = fabsf(x[b]);
    for (int j = 8; j < n; j += 8)
        for (int b = 0; b < 8; b++) p[b] = maxv(p[b], fabsf(x[j + b]));
    for (int b = 1; b < 8; b++) p[0] = maxv(p[0], p[b]);
    if (p[0] == 0) return 0.0f;
    for (int j = 0; j < n; j++)
        if (fabsf(x[j]) == p[0]) return x[j];
    return x[0];  /* NaNs */
}

/* The searches run on 8 sub-blocks at once, as the torch code runs on all blocks: x transposed,
 * x[j * S + b] value j of sub-block b (S sub-blocks in all), each lane of a vector one sub-block,
 * each sum one lane's, in llama.cpp's order. GCC's vector types: SSE, AVX or NEON as built (no FMA:
 * -ffp-contract=off; AVX2 has none, and the searches run their own multiply and add). */
typedef float v8 __attribute__((vector_size(32)));
#define INLINE static inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__linux__)  /* AVX2 and F16C where the CPU has them, chosen at load */
#define WIDE __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define WIDE
#endif
typedef int32_t m8 __attribute__((vector_size(32)));

INLINE v8 ld(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
INLINE void st(float *p, v8 v) { memcpy(p, &v, sizeof v); }
INLINE v8 splat(float f) { return (v8){f, f, f, f, f, f, f, f}; }
INLINE v8 sel(m8 m, v8 a, v8 b) { return (v8)(((m8)a & m) | ((m8)b & ~m)); }
INLINE v8 vabs(v8 v) { return (v8)((m8)v & 0x7fffffff); }
INLINE v8 vnonzero(v8 v) { return sel(v == 0, splat(1.0f), v); }
INLINE v8 vclamp(v8 v, float lo, float hi) { v = sel(v < lo, splat(lo), v); return sel(v > hi, splat(hi), v); }
INLINE v8 vrnd(v8 v) {  /* rnd, lane by lane */
    return __builtin_convertvector(((m8)(v + 12582912.0f) & 0x007fffff) - 0x00400000, v8);
}

/* largest(), lane by lane */
INLINE v8 vlargest(const float *x, int n, int S) {
    v8 mx = ld(x), amx = vabs(mx);
    for (int j = 1; j < n; j++) {
        v8 v = ld(x + j * S);
        m8 m = vabs(v) > amx;
        mx = sel(m, v, mx);
        amx = sel(m, vabs(v), amx);
    }
    return sel(mx == 0, splat(0), mx);  /* all zeros: +0 */
}

/* make_qx_quants: weighted least squares over 19 scales around -nmax/max; scale, codes 0..2nmax-1 */
WIDE static void make_qx8(const float *x, const float *w, int n, int S, int nmax, float *scale, float *codes) {
    v8 mx = vlargest(x, n, S), l[32];
    m8 zero = vabs(mx) < EPS;
    mx = vnonzero(mx);
    v8 ic = -(float)nmax / mx, slx = splat(0), sl2 = splat(0);
    for (int j = 0; j < n; j++) {
        v8 xv = ld(x + j * S), wv = ld(w + j * S), c = vclamp(vrnd(ic * xv), -nmax, nmax - 1);
        st(codes + j * S, c);
        slx += wv * xv * c;
        sl2 += wv * c * c;
    }
    v8 sc = sel(sl2 > 0, slx / vnonzero(sl2), splat(0)), best = sc * slx;
    for (int i = -9; i <= 9; i++) {
        if (!i) continue;
        ic = -((float)nmax + 0.1f * (float)i) / mx;
        v8 a = splat(0), b = splat(0);
        for (int j = 0; j < n; j++) {
            v8 xv = ld(x + j * S), wv = ld(w + j * S), q = vclamp(vrnd(ic * xv), -nmax, nmax - 1);
            l[j] = q;
            a += wv * xv * q;
            b += wv * q * q;
        }
        m8 better = (b > 0) & (a * a > best * b);
        sc = sel(better, a / vnonzero(b), sc);
        best = sel(better, sc * a, best);
        for (int j = 0; j < n; j++) st(codes + j * S, sel(better, l[j], ld(codes + j * S)));
    }
    for (int j = 0; j < n; j++) st(codes + j * S, sel(zero, splat(0), ld(codes + j * S) + (float)nmax));
    st(scale, sel(zero, splat(0), sc));
}

/* make_q3_quants: weights x^2, codes refined one at a time (5 sweeps); scale, codes 0..2nmax-1.
 * The 16 sub-blocks of a superblock (S = 16) as two vectors, whose chains of refinements (a division
 * in each step) interleave. */
WIDE static void make_q3(const float *x, int n, int nmax, float *scale, float *codes) {
    enum { G = 2, S = 16 };
    v8 mx[G], is[G], slx[G], sl2[G], w[G][16];  /* n <= 16 */
    m8 zero[G];
    for (int g = 0; g < G; g++) {
        mx[g] = vlargest(x + 8 * g, n, S);
        zero[g] = vabs(mx[g]) < EPS;
        is[g] = -(float)nmax / vnonzero(mx[g]);
        slx[g] = sl2[g] = splat(0);
    }
    for (int j = 0; j < n; j++)
        for (int g = 0; g < G; g++) {
            v8 xv = ld(x + j * S + 8 * g), c = vclamp(vrnd(is[g] * xv), -nmax, nmax - 1);
            w[g][j] = xv * xv;
            st(codes + j * S + 8 * g, c);
            slx[g] += w[g][j] * xv * c;
            sl2[g] += w[g][j] * c * c;
        }
    for (int sweep = 0; sweep < 5; sweep++)
        for (int j = 0; j < n; j++)
            for (int g = 0; g < G; g++) {
                float *cj = codes + j * S + 8 * g;
                v8 xv = ld(x + j * S + 8 * g), li = ld(cj), wj = w[g][j];
                v8 a = slx[g] - wj * xv * li, c = sl2[g] - wj * li * li;
                v8 nl = vclamp(vrnd(xv * c / vnonzero(a)), -nmax, nmax - 1);
                v8 a2 = a + wj * xv * nl, c2 = c + wj * nl * nl;
                m8 take = (a > 0) & (nl != li) & (a2 * a2 * sl2[g] > slx[g] * slx[g] * c2) & (c2 > 0);
                st(cj, sel(take, nl, li));
                slx[g] = sel(take, a2, slx[g]);
                sl2[g] = sel(take, c2, sl2[g]);
            }
    for (int g = 0; g < G; g++) {
        for (int j = 0; j < n; j++)
            st(codes + j * S + 8 * g, sel(zero[g], splat(0), ld(codes + j * S + 8 * g) + (float)nmax));
        st(scale + 8 * g, sel(zero[g], splat(0), sel(sl2[g] > 0, slx[g] / vnonzero(sl2[g]), splat(0))));
    }
}

/* make_qkx2_quants: scale and min by weighted least squares over nstep + 1 scales, each from the
 * best min so far; mad: absolute rather than squared error. Scale, min (to subtract), codes 0..nmax. */
WIDE static void make_qkx8(const float *x, const float *w, int n, int S, int nmax, float rmin, float rdelta, int nstep,
                      int mad, float *scale, float *the_min, float *codes) {
    v8 lo = ld(x), hi = lo, sw = splat(0), sx = splat(0), err = splat(0), l[32];
    for (int j = 1; j < n; j++) {
        v8 v = ld(x + j * S);
        lo = sel(v < lo, v, lo);
        hi = sel(v > hi, v, hi);
    }
    lo = sel(lo > 0, splat(0), lo);
    m8 flat = hi <= lo;
    v8 isc = (float)nmax / vnonzero(hi - lo), sc = 1.0f / isc;
    for (int j = 0; j < n; j++) {
        v8 xv = ld(x + j * S), wv = ld(w + j * S), c = vclamp(vrnd(isc * (xv - lo)), 0, nmax);
        sw += wv;
        sx += wv * xv;
        st(codes + j * S, c);
        v8 d = sc * c + lo - xv;
        err += wv * (mad ? vabs(d) : d * d);
    }
    for (int i = 0; i <= nstep; i++) {
        isc = (rmin + rdelta * (float)i + (float)nmax) / vnonzero(hi - lo);
        v8 sl = splat(0), sl2 = splat(0), sxl = splat(0), cur = splat(0);
        for (int j = 0; j < n; j++) {
            v8 xv = ld(x + j * S), q = vclamp(vrnd(isc * (xv - lo)), 0, nmax), wl = ld(w + j * S) * q;
            l[j] = q;
            sl += wl;
            sl2 += wl * q;
            sxl += wl * xv;
        }
        v8 det = sw * sl2 - sl * sl;
        v8 ts = (sw * sxl - sx * sl) / vnonzero(det), tm = (sl2 * sx - sl * sxl) / vnonzero(det);
        m8 pos = tm > 0;
        tm = sel(pos, splat(0), tm);
        ts = sel(pos, sxl / vnonzero(sl2), ts);
        for (int j = 0; j < n; j++) {
            v8 d = ts * l[j] + tm - ld(x + j * S);
            cur += ld(w + j * S) * (mad ? vabs(d) : d * d);
        }
        m8 better = (det > 0) & (cur < err) & ~flat;
        err = sel(better, cur, err);
        sc = sel(better, ts, sc);
        lo = sel(better, tm, lo);
        for (int j = 0; j < n; j++) st(codes + j * S, sel(better, l[j], ld(codes + j * S)));
    }
    st(the_min, -lo);
    st(scale, sel(flat, splat(0), sc));
    for (int j = 0; j < n; j++) st(codes + j * S, sel(flat, splat(0), ld(codes + j * S)));
}

static void make_qx(const float *x, const float *w, int n, int S, int nmax, float *scale, float *codes) {
    for (int g = 0; g < S; g += 8) make_qx8(x + g, w + g, n, S, nmax, scale + g, codes + g);
}

static void make_qkx(const float *x, const float *w, int n, int S, int nmax, float rmin, float rdelta, int nstep,
                     int mad, float *scale, float *the_min, float *codes) {
    for (int g = 0; g < S; g += 8)
        make_qkx8(x + g, w + g, n, S, nmax, rmin, rdelta, nstep, mad, scale + g, the_min + g, codes + g);
}

/* a superblock's values as S sub-blocks of n (x[b * n + j]) and back */
static void transpose(const float *x, int S, int n, float *t) {
    for (int b = 0; b < S; b++)
        for (int j = 0; j < n; j++) t[j * S + b] = x[b * n + j];
}

static void untranspose(const float *t, int S, int n, float *x) {
    for (int b = 0; b < S; b++)
        for (int j = 0; j < n; j++) x[b * n + j] = t[j * S + b];
}

/* the K-quants' last step: codes again from the final float16-rounded scales (kept where one is 0) */
static void requantize(const float *x, int n, float s, float m, int has_min, int off, int nmax, float *codes) {
    if (s == 0) return;
    for (int j = 0; j < n; j++) {
        float q = has_min ? rnd((x[j] + m) / s) : rnd(x[j] / s) + off;
        codes[j] = clampf(q, 0, nmax);
    }
}

static inline uint8_t u8(float v) { return (uint8_t)(int64_t)v; }

/* ---- the 32-value types, as gguf-py and llama.cpp's reference rows ---- */

/* ggml's type numbers (gguf.GGMLQuantizationType) */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* truncf for |v| < 2^31 by integer conversion (no SSE4.1 needed), lane by lane */
INLINE v8 vtrunc(v8 v) { return __builtin_convertvector(__builtin_convertvector(v, m8), v8); }

/* roundf (half away from zero) as gguf-py's np_roundf: floor(a) + floor(2 (a - floor(a))) with the
 * sign of v, exact where a + 0.5 is not */
INLINE v8 vround(v8 v) {
    v8 a = vabs(v), f = vtrunc(a), r = f + vtrunc(2 * (a - f));
    return (v8)(((m8)r & 0x7fffffff) | ((m8)v & (int32_t)0x80000000));
}

/* the codes of a 32-value block: Q5's fifth bits as a little-endian uint32, then nibbles */
static void pack32(const uint8_t *q, int five, uint8_t *y) {
    if (five) {
        uint32_t qh = 0;
        for (int j = 0; j < 32; j++) qh |= (uint32_t)((q[j] >> 4) & 1) << j;
        for (int b = 0; b < 4; b++) y[b] = qh >> (8 * b);
        y += 4;
    }
    for (int j = 0; j < 16; j++) y[j] = (q[j] & 15) | ((q[j + 16] & 15) << 4);
}

/* 8 x 8 values: row r of a (a[r * stride + j]) into column r of t (t[j * tstride + r]), by shuffles of
 * whole rows where the compiler has them */
#ifndef __has_builtin
#define __has_builtin(x) 0
#endif
#if __has_builtin(__builtin_shufflevector)
#define SHUF __builtin_shufflevector
INLINE void transpose8(const float *a, int stride, float *t, int tstride) {
    v8 r[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = ld(a + i * stride);
    for (int i = 0; i < 8; i += 2) {  /* pairs of rows interleaved within each half */
        u[i] = SHUF(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        u[i + 1] = SHUF(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4)  /* then fours */
        for (int h = 0; h < 2; h++) {
            r[i + 2 * h] = SHUF(u[i + h], u[i + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            r[i + 2 * h + 1] = SHUF(u[i + h], u[i + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int j = 0; j < 4; j++) {  /* then the halves: columns j and j + 4 */
        st(t + j * tstride, SHUF(r[j], r[j + 4], 0, 1, 2, 3, 8, 9, 10, 11));
        st(t + (j + 4) * tstride, SHUF(r[j], r[j + 4], 4, 5, 6, 7, 12, 13, 14, 15));
    }
}
#else
INLINE void transpose8(const float *a, int stride, float *t, int tstride) {  /* memcpy: t may hold int32 */
    for (int r = 0; r < 8; r++)
        for (int j = 0; j < 8; j++) memcpy(t + j * tstride + r, a + r * stride + j, sizeof(float));
}
#endif

/* vlargest of 32 values: the largest magnitude in four running maxima (no chain through every
 * value), then the first value of it, found from the end */
INLINE v8 vlargest32(const float *t) {
    v8 m[4];
    for (int i = 0; i < 4; i++) m[i] = vabs(ld(t + 8 * i));
    for (int j = 4; j < 32; j += 4)
        for (int i = 0; i < 4; i++) {
            v8 a = vabs(ld(t + 8 * (j + i)));
            m[i] = sel(a > m[i], a, m[i]);
        }
    m[0] = sel(m[1] > m[0], m[1], m[0]);
    m[2] = sel(m[3] > m[2], m[3], m[2]);
    v8 amax = sel(m[2] > m[0], m[2], m[0]), mx = splat(0);
    for (int j = 31; j >= 0; j--) {
        v8 v = ld(t + 8 * j);
        mx = sel(vabs(v) == amax, v, mx);
    }
    return sel(mx == 0, splat(0), mx);  /* all zeros: +0 */
}

/* Eight blocks of 32 (x: 256 consecutive values), one per lane as the K-quants' sub-blocks, so that
 * no step reduces across a vector. Q8_0: d = max |x| / 127, codes roundf(x / d). Q4_0 (nmax 8) and Q5_0
 * (16): d = max / -nmax. Q4_1 (15) and Q5_1 (31): d = (max - min) / nmax, the min stored. Each
 * extreme as llama.cpp's sequential loop finds it (the first of equal ones; NaNs aside), codes as its
 * reference rows round them. */
WIDE static void blocks32(const float *x, uint8_t *y, int type, int nmax, int size) {
    float t[256], c[256];
    int32_t cb[256];  /* written through transpose8's memcpy */
    for (int j = 0; j < 32; j += 8) transpose8(x + j, 32, t + 8 * j, 8);
    v8 d, lo = splat(0);
    if (type == Q8_0) {
        d = vabs(vlargest32(t)) / 127;
        v8 id = sel(d > 0, 1.0f / vnonzero(d), splat(0));
        for (int j = 0; j < 32; j++)
            st(c + 8 * j, (v8)__builtin_convertvector(vround(ld(t + 8 * j) * id), m8));
    } else if (type == Q4_0 || type == Q5_0) {
        d = vlargest32(t) / -(float)nmax;
        v8 id = sel(d != 0, 1.0f / vnonzero(d), splat(0)), top = splat(2 * nmax - 1);
        for (int j = 0; j < 32; j++) {
            v8 q = vtrunc(ld(t + 8 * j) * id + ((float)nmax + 0.5f));
            st(c + 8 * j, (v8)__builtin_convertvector(sel(top < q, top, q), m8));
        }
    } else {
        v8 hi = lo = ld(t);
        for (int j = 1; j < 32; j++) {
            v8 v = ld(t + 8 * j);
            lo = sel(v < lo, v, lo);
            hi = sel(v > hi, v, hi);
        }
        d = (hi - lo) / (float)nmax;
        v8 id = sel(d != 0, 1.0f / vnonzero(d), splat(0)), top = splat(nmax);
        for (int j = 0; j < 32; j++) {
            v8 q = vtrunc((ld(t + 8 * j) - lo) * id + 0.5f);
            st(c + 8 * j, (v8)__builtin_convertvector(sel(top < q, top, q), m8));
        }
    }
    for (int j = 0; j < 32; j += 8) transpose8(c + 8 * j, 8, (float *)cb + j, 32);  /* block b's at cb[32 * b] */
    for (int b = 0; b < 8; b++) {
        uint8_t *yb = y + b * size, q[32];
        for (int j = 0; j < 32; j++) q[j] = (uint8_t)cb[32 * b + j];
        put_half(yb, half_bits(d[b]));
        if (type == Q8_0) {
            memcpy(yb + 2, q, 32);
        } else if (type == Q4_1 || type == Q5_1) {
            put_half(yb + 2, half_bits(lo[b]));
            pack32(q, type == Q5_1, yb + 4);
        } else {
            pack32(q, type == Q5_0, yb + 2);
        }
    }
}

/* ---- the K-quants: superblocks of 256 ---- */

/* Q2_K: 16 sub-blocks of 16, 4-bit scales and mins, 2-bit codes */
WIDE static void q2_k(const float *x, uint8_t *y) {
    float xt[256], wt[256], ct[256], codes[256], sc[16], mn[16];
    transpose(x, 16, 16, xt);
    for (int j = 0; j < 256; j++) wt[j] = fabsf(xt[j]);
    make_qkx(xt, wt, 16, 16, 3, -0.5f, 0.1f, 15, 1, sc, mn, ct);
    untranspose(ct, 16, 16, codes);
    float ms = 0, mm = 0;  /* as llama.cpp: a -0.0 min leaves +0 */
    for (int s = 0; s < 16; s++) {
        if (sc[s] > ms) ms = sc[s];
        if (mn[s] > mm) mm = mn[s];
    }
    float ls[16], lm[16];
    for (int s = 0; s < 16; s++) {  /* as stored: one byte, the scale below the min's nibble */
        int32_t byte = (uint8_t)((int32_t)(ms > 0 ? rnd(15.0f / nonzero(ms) * sc[s]) : 0.0f) |
                                 ((int32_t)(mm > 0 ? rnd(15.0f / nonzero(mm) * mn[s]) : 0.0f) << 4));
        ls[s] = byte & 15;
        lm[s] = byte >> 4;
    }
    uint16_t dh = half_bits(ms / 15), mh = half_bits(mm / 15);
    float df = half_value(dh), mf = half_value(mh);
    for (int s = 0; s < 16; s++) requantize(x + 16 * s, 16, df * ls[s], mf * lm[s], 1, 0, 3, codes + 16 * s);
    for (int s = 0; s < 16; s++) y[s] = u8(ls[s]) | (u8(lm[s]) << 4);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 32; j++) {
            uint8_t b = 0;
            for (int k = 0; k < 4; k++) b |= u8(codes[128 * h + 32 * k + j]) << (2 * k);
            y[16 + 32 * h + j] = b;
        }
    put_half(y + 80, dh);
    put_half(y + 82, mh);
}

/* Q3_K: 16 sub-blocks of 16, 6-bit signed scales, 3-bit codes (a low pair and a high bit) */
WIDE static void q3_k(const float *x, uint8_t *y) {
    float xt[256], ct[256], codes[256], sc[16], mx;
    transpose(x, 16, 16, xt);
    make_q3(xt, 16, 4, sc, ct);
    untranspose(ct, 16, 16, codes);
    mx = largest(sc, 16);
    float is = -32.0f / nonzero(mx);
    float ls[16];
    for (int s = 0; s < 16; s++) ls[s] = mx != 0 ? clampf(rnd(is * sc[s]), -32, 31) + 32 : 0.0f;
    uint16_t dh = half_bits(mx != 0 ? 1.0f / is : 0.0f);
    float df = half_value(dh);
    for (int s = 0; s < 16; s++) requantize(x + 16 * s, 16, df * (ls[s] - 32), 0, 0, 4, 7, codes + 16 * s);
    memset(y, 0, 32);
    for (int j = 0; j < 32; j++)
        for (int k = 0; k < 8; k++) y[j] |= ((u8(codes[32 * k + j]) >> 2) & 1) << k;
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 32; j++) {
            uint8_t b = 0;
            for (int k = 0; k < 4; k++) b |= (u8(codes[128 * h + 32 * k + j]) & 3) << (2 * k);
            y[32 + 32 * h + j] = b;
        }
    uint8_t *p = y + 96;
    for (int j = 0; j < 8; j++) p[j] = (u8(ls[j]) & 15) | ((u8(ls[j + 8]) & 15) << 4);
    for (int j = 0; j < 4; j++) {
        uint8_t b = 0;
        for (int k = 0; k < 4; k++) b |= (u8(ls[4 * k + j]) >> 4) << (2 * k);
        p[8 + j] = b;
    }
    put_half(y + 108, dh);
}

/* Q4_K (nmax 15) and Q5_K (31): 8 sub-blocks of 32, 6-bit scales and mins */
WIDE static void k32(const float *x, uint8_t *y, int nmax, float rmin, int nstep) {
    float xt[256], wt[256], ct[256], codes[256], sq[8], sc[8], mn[8];
    transpose(x, 8, 32, xt);
    for (int b = 0; b < 8; b++) sq[b] = 0;
    for (int j = 0; j < 32; j++)
        for (int b = 0; b < 8; b++) sq[b] += xt[j * 8 + b] * xt[j * 8 + b];
    for (int b = 0; b < 8; b++) sq[b] = sqrtf(sq[b] / 32);
    for (int j = 0; j < 32; j++)
        for (int b = 0; b < 8; b++) wt[j * 8 + b] = sq[b] + fabsf(xt[j * 8 + b]);
    make_qkx(xt, wt, 32, 8, nmax, rmin, 0.1f, nstep, 0, sc, mn, ct);
    untranspose(ct, 8, 32, codes);
    float ms = 0, mm = 0;  /* as llama.cpp: a -0.0 min leaves +0 */
    for (int s = 0; s < 8; s++) {
        if (sc[s] > ms) ms = sc[s];
        if (mn[s] > mm) mm = mn[s];
    }
    float is = ms > 0 ? 63.0f / nonzero(ms) : 0.0f, im = mm > 0 ? 63.0f / nonzero(mm) : 0.0f;
    uint8_t ls[8], lm[8];
    float lsf[8], lmf[8];
    for (int s = 0; s < 8; s++) {
        lsf[s] = minv(as_u8(rnd(is * sc[s])), 63);
        lmf[s] = minv(as_u8(rnd(im * mn[s])), 63);
        ls[s] = u8(lsf[s]);
        lm[s] = u8(lmf[s]);
    }
    uint16_t dh = half_bits(ms / 63), mh = half_bits(mm / 63);
    float df = half_value(dh), mf = half_value(mh);
    for (int s = 0; s < 8; s++) requantize(x + 32 * s, 32, df * lsf[s], mf * lmf[s], 1, 0, nmax, codes + 32 * s);
    put_half(y, dh);
    put_half(y + 2, mh);
    uint8_t *p = y + 4;
    for (int j = 0; j < 4; j++) {
        p[j] = ls[j] | ((ls[j + 4] >> 4) << 6);
        p[4 + j] = lm[j] | ((lm[j + 4] >> 4) << 6);
        p[8 + j] = (ls[j + 4] & 15) | ((lm[j + 4] & 15) << 4);
    }
    p = y + 16;
    if (nmax == 31) {
        memset(p, 0, 32);
        for (int j = 0; j < 32; j++)
            for (int k = 0; k < 8; k++) p[j] |= ((u8(codes[32 * k + j]) >> 4) & 1) << k;
        p += 32;
    }
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 32; j++)
            p[32 * c + j] = (u8(codes[64 * c + j]) & 15) | ((u8(codes[64 * c + 32 + j]) & 15) << 4);
}

/* Q6_K: 16 sub-blocks of 16, 8-bit signed scales, 6-bit codes (low nibbles and high pairs) */
WIDE static void q6_k(const float *x, uint8_t *y) {
    float xt[256], wt[256], ct[256], codes[256], sc[16], mx;
    transpose(x, 16, 16, xt);
    for (int j = 0; j < 256; j++) wt[j] = xt[j] * xt[j];
    make_qx(xt, wt, 16, 16, 32, sc, ct);
    untranspose(ct, 16, 16, codes);
    mx = largest(sc, 16);
    int zero = fabsf(mx) < EPS;
    float is = -128.0f / nonzero(mx);
    float ls[16];
    for (int s = 0; s < 16; s++) ls[s] = zero ? 0.0f : as_i8(minv(rnd(is * sc[s]), 127));
    uint16_t dh = half_bits(zero ? 0.0f : 1.0f / is);
    float df = half_value(dh);
    if (zero) memset(codes, 0, sizeof codes);
    for (int s = 0; s < 16; s++) requantize(x + 16 * s, 16, df * ls[s], 0, 0, 32, 63, codes + 16 * s);
    for (int h = 0; h < 2; h++) {
        const float *q = codes + 128 * h;
        uint8_t *ql = y + 64 * h, *qh = y + 128 + 32 * h;
        for (int j = 0; j < 32; j++) {
            ql[j] = (u8(q[j]) & 15) | ((u8(q[64 + j]) & 15) << 4);
            ql[32 + j] = (u8(q[32 + j]) & 15) | ((u8(q[96 + j]) & 15) << 4);
            uint8_t b = 0;
            for (int k = 0; k < 4; k++) b |= (u8(q[32 * k + j]) >> 4) << (2 * k);
            qh[j] = b;
        }
    }
    for (int s = 0; s < 16; s++) y[192 + s] = (uint8_t)(int8_t)(int64_t)ls[s];
    put_half(y + 208, dh);
}

/* a block of float16 values as float32 (F16C's conversion where the CPU has it) */
WIDE static void widen(const uint16_t *h, int n, float *x) {
    for (int j = 0; j < n; j++) x[j] = half_value(h[j]);
}

/* Quantize rows [rows, k] of x (float32, or float16 where half) into out; 0 on success, -1 for a type
 * this file does not hold. */
int quantize(int type, const void *x, int half, int64_t rows, int64_t k, uint8_t *out) {
    int block, size, nmax = 0;  /* nmax: a 32-value type's top code (Q8_0's magnitude) */
    switch (type) {
        case Q8_0: block = 32; size = 34; nmax = 127; break;
        case Q4_0: block = 32; size = 18; nmax = 8; break;
        case Q4_1: block = 32; size = 20; nmax = 15; break;
        case Q5_0: block = 32; size = 22; nmax = 16; break;
        case Q5_1: block = 32; size = 24; nmax = 31; break;
        case Q2_K: block = 256; size = 84; break;
        case Q3_K: block = 256; size = 110; break;
        case Q4_K: block = 256; size = 144; break;
        case Q5_K: block = 256; size = 176; break;
        case Q6_K: block = 256; size = 210; break;
        default: return -1;
    }
    int64_t n = rows * (k / block);
    float buf[256];
    if (block == 32) {  /* eight blocks at a time; the last few padded with zeros into a buffer */
        uint8_t tail[8 * 34];  /* eight blocks of the largest 32-value type, Q8_0 */
        for (int64_t b = 0; b < n; b += 8) {
            int m = n - b < 8 ? (int)(n - b) : 8;
            const float *xb = (const float *)x + b * 32;
            if (half || m < 8) {
                if (m < 8) memset(buf, 0, sizeof buf);
                if (half) widen((const uint16_t *)x + b * 32, 32 * m, buf);
                else memcpy(buf, xb, 32 * m * sizeof(float));
                xb = buf;
            }
            uint8_t *yb = m < 8 ? tail : out + b * size;
            blocks32(xb, yb, type, nmax, size);
            if (m < 8) memcpy(out + b * size, tail, (size_t)m * size);
        }
        return 0;
    }
    for (int64_t b = 0; b < n; b++) {
        const float *xb = (const float *)x + b * block;
        if (half) {
            widen((const uint16_t *)x + b * block, block, buf);
            xb = buf;
        }
        uint8_t *yb = out + b * size;
        switch (type) {
            case Q2_K: q2_k(xb, yb); break;
            case Q3_K: q3_k(xb, yb); break;
            case Q4_K: k32(xb, yb, 15, -1.0f, 20); break;
            case Q5_K: k32(xb, yb, 31, -0.5f, 15); break;
            case Q6_K: q6_k(xb, yb); break;
        }
    }
    return 0;
}

/* The index of the first of count values at x that is NaN or infinite (kind 0: float32, 1: float16,
 * 2: bfloat16), -1 where none: llama-quantize refuses a source that holds one. All exponent bits set
 * is NaN or infinity in each of the three. */
int64_t first_nonfinite(const void *x, int kind, int64_t count) {
    if (kind == 0) {
        const uint32_t *v = x;
        for (int64_t i = 0; i < count; i++)
            if ((v[i] & 0x7f800000u) == 0x7f800000u) return i;
    } else {
        const uint16_t *v = x;
        uint16_t mask = kind == 1 ? 0x7c00 : 0x7f80;
        for (int64_t i = 0; i < count; i++)
            if ((v[i] & mask) == mask) return i;
    }
    return -1;
}

/* The first of n blocks of type at y whose float16 scale (d, and the minimum's dmin or m where the
 * type has one) is NaN or infinite, -1 where none: the blocks llama.cpp's ggml_validate_row_data
 * refuses (values too large for the scale). */
int64_t first_bad_block(int type, const uint8_t *y, int64_t n) {
    int size, d, m = -1;  /* bytes per block; the byte offsets of d and of the minimum's scale */
    switch (type) {
        case Q8_0: size = 34; d = 0; break;
        case Q4_0: size = 18; d = 0; break;
        case Q4_1: size = 20; d = 0; m = 2; break;
        case Q5_0: size = 22; d = 0; break;
        case Q5_1: size = 24; d = 0; m = 2; break;
        case Q2_K: size = 84; d = 80; m = 82; break;
        case Q3_K: size = 110; d = 108; break;
        case Q4_K: size = 144; d = 0; m = 2; break;
        case Q5_K: size = 176; d = 0; m = 2; break;
        case Q6_K: size = 210; d = 208; break;
        default: return -1;
    }
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *p = y + b * size;
        if (((p[d] | p[d + 1] << 8) & 0x7c00) == 0x7c00) return b;
        if (m >= 0 && ((p[m] | p[m + 1] << 8) & 0x7c00) == 0x7c00) return b;
    }
    return -1;
}
