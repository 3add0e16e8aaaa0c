/* tensorwatch_otel's CPU statistics kernel: built on first use by cpu_kernel.py (see its
   docstring), tested on its own by tests/c/test_cpu_kernel.c. */
#include <stdint.h>
#include <stdlib.h>
/* the extremes of x[0..n) as sign-cleared bit patterns, into lo and hi */
#define TW_EXTREMES(T, MASK)                                                              \
    for (int64_t i = 0; i < n; i++) {                                                     \
        T m = x[i] & MASK;                                                                \
        lo = m < lo ? m : lo;                                                             \
        hi = m > hi ? m : hi;                                                             \
    }
/* on one thread the loop runs outside OpenMP: a parallel region, even one its if() clause
   turns off, costs about half a microsecond, which a small tensor's read does not */
#define KERNEL(NAME, T, MASK, INF)                                                        \
void NAME(const T* x, int64_t n, T* out, int nt) {                                        \
    T lo = (T)~(T)0, hi = 0;                                                              \
    if (nt > 1) {                                                                         \
        _Pragma("omp parallel for reduction(min:lo) reduction(max:hi) num_threads(nt)")   \
        TW_EXTREMES(T, MASK)                                                              \
    } else {                                                                              \
        TW_EXTREMES(T, MASK)                                                              \
    }                                                                                     \
    if (hi > INF) lo = hi; /* NaN anywhere: NaN in both */                                \
    out[0] = lo;                                                                          \
    out[1] = hi;                                                                          \
}
KERNEL(tw_abs_minmax_f64, uint64_t, 0x7FFFFFFFFFFFFFFFull, 0x7FF0000000000000ull)
KERNEL(tw_abs_minmax_f32, uint32_t, 0x7FFFFFFFu, 0x7F800000u)
KERNEL(tw_abs_minmax_f16, uint16_t, 0x7FFFu, 0x7C00u)
KERNEL(tw_abs_minmax_bf16, uint16_t, 0x7FFFu, 0x7F80u)

/* abs min/max and the magnitude histogram in the same read (target_dtypes). hist[0]: exact
   zeros; hist[s], 1 <= s <= NB: finite |x| in (2**(s-1+OFF), 2**(s+OFF)] (upper-inclusive, the
   scale-0 exponential histogram bucket s-1+OFF, OFF = -(bias + mantissa bits)); hist[NB+1]:
   inf/nan. With u = bits - 1, a normal value's bucket is u's exponent field (a power of two
   drops to the bucket below), a subnormal's is the bit length of u: no float math.
   Per block of TW_BLOCK elements: a first loop the compiler vectorises (extremes, and each
   element's counter, subnormals marked), then the counting, over four interleaved copies of the
   counters so that repeated buckets do not wait on one another. */
#define TW_BLOCK 512
#define TW_SUB 0xFFFF
static inline int tw_bitlen(uint64_t u) { return u ? 64 - __builtin_clzll(u) : 0; }
#define MAGNITUDE(NAME, T, MASK, INF, M, NB)                                              \
void NAME(const T* x, int64_t n, T* out, int64_t* hist, int nt) {                         \
    T lo = (T)~(T)0, hi = 0;                                                              \
    for (int b = 0; b < NB + 2; b++) hist[b] = 0;                                         \
    _Pragma("omp parallel reduction(min:lo) reduction(max:hi) num_threads(nt) if(nt > 1)") \
    {                                                                                     \
        int64_t h[4][NB + 2];                                                             \
        uint16_t slot[TW_BLOCK];                                                          \
        for (int c = 0; c < 4; c++) for (int b = 0; b < NB + 2; b++) h[c][b] = 0;         \
        _Pragma("omp for schedule(static) nowait")                                        \
        for (int64_t b0 = 0; b0 < n; b0 += TW_BLOCK) {                                    \
            const T* xb = x + b0;                                                         \
            int len = n - b0 < TW_BLOCK ? (int)(n - b0) : TW_BLOCK;                       \
            T l = lo, g = hi;                                                             \
            for (int i = 0; i < len; i++) {                                               \
                T m = xb[i] & MASK;                                                       \
                l = m < l ? m : l;                                                        \
                g = m > g ? m : g;                                                        \
                T e = (T)((T)(m - 1) >> M);                                               \
                uint16_t s = e ? (uint16_t)(e + M + 1) : (uint16_t)TW_SUB;                \
                s = m == 0 ? 0 : s;                                                       \
                s = m >= INF ? (uint16_t)(NB + 1) : s;                                    \
                slot[i] = s;                                                              \
            }                                                                             \
            lo = l;                                                                       \
            hi = g;                                                                       \
            for (int i = 0; i < len; i++) {                                               \
                int s = slot[i];                                                          \
                if (__builtin_expect(s == TW_SUB, 0))                                     \
                    s = tw_bitlen((uint64_t)(T)((xb[i] & MASK) - 1)) + 1;                 \
                h[i & 3][s]++;                                                            \
            }                                                                             \
        }                                                                                 \
        _Pragma("omp critical")                                                           \
        for (int b = 0; b < NB + 2; b++) hist[b] += h[0][b] + h[1][b] + h[2][b] + h[3][b]; \
    }                                                                                     \
    if (hi > INF) lo = hi;                                                                \
    out[0] = lo;                                                                          \
    out[1] = hi;                                                                          \
}
MAGNITUDE(tw_abs_minmax_mag_f64, uint64_t, 0x7FFFFFFFFFFFFFFFull, 0x7FF0000000000000ull, 52, 2099)
MAGNITUDE(tw_abs_minmax_mag_f32, uint32_t, 0x7FFFFFFFu, 0x7F800000u, 23, 278)
MAGNITUDE(tw_abs_minmax_mag_f16, uint16_t, 0x7FFFu, 0x7C00u, 10, 41)
MAGNITUDE(tw_abs_minmax_mag_bf16, uint16_t, 0x7FFFu, 0x7F80u, 7, 262)
/* The same extremes as doubles (exact: every value of these dtypes is one), for many tensors
   in one call: tensor i (ptrs[i], ns[i] elements, dtype codes[i]: 0 f64, 1 f32, 2 f16,
   3 bf16) writes out[2i] (abs min) and out[2i + 1] (abs max). */
static double d_f64(uint64_t b) { double d; __builtin_memcpy(&d, &b, 8); return d; }
static double d_f32(uint32_t b) { float f; __builtin_memcpy(&f, &b, 4); return (double)f; }
static double d_bf16(uint16_t b) { return d_f32((uint32_t)b << 16); }
static double d_f16(uint16_t b) {
    uint64_t e = (b >> 10) & 0x1F, m = b & 0x3FF;
    if (e == 0) return (double)m * 5.9604644775390625e-08; /* subnormal: m * 2^-24 */
    if (e == 31) return d_f64(m ? 0x7FF8000000000000ull : 0x7FF0000000000000ull);
    return d_f64(((e + 1008) << 52) | (m << 42)); /* exponent e - 15 + 1023 */
}
/* one dtype's branch: the kernel's two patterns into out[2i], out[2i + 1] as doubles */
#define TW_MANY_CASE(LABEL, T, KERNEL_FN, DEC) \
    LABEL: { T r[2]; KERNEL_FN(ptrs[i], n, r, t); out[2*i] = DEC(r[0]); out[2*i+1] = DEC(r[1]); break; }
void tw_abs_minmax_many(const void* const* ptrs, const int64_t* ns, const int8_t* codes, int64_t k,
                        double* out, int nt, int64_t parallel_min) {
    for (int64_t i = 0; i < k; i++) {
        int64_t n = ns[i];
        int t = n >= parallel_min ? nt : 1;
        switch (codes[i]) {
        TW_MANY_CASE(case 0, uint64_t, tw_abs_minmax_f64, d_f64)
        TW_MANY_CASE(case 1, uint32_t, tw_abs_minmax_f32, d_f32)
        TW_MANY_CASE(case 2, uint16_t, tw_abs_minmax_f16, d_f16)
        TW_MANY_CASE(default, uint16_t, tw_abs_minmax_bf16, d_bf16)
        }
    }
}

/* One tensor on the calling thread, its pair returned by value (no buffer shared between
   threads): the per-frame call of the recorder's hot path, for tensors below the parallel size. */
typedef struct { double lo, hi; } tw_pair;
tw_pair tw_abs_minmax_one(const void* p, int64_t n, int code) {
    const void* ptrs[1] = {p};
    int8_t c = (int8_t)code;
    double out[2];
    tw_abs_minmax_many(ptrs, &n, &c, 1, out, 1, INT64_MAX);
    tw_pair r = {out[0], out[1]};
    return r;
}

/* abs min/max and exact threshold counts in one call (target_dtypes; core/measure/magnitude.py).
   rg: nr pairs (a, w) of sign-cleared patterns, a >= 1: cnt[r] = #{elements whose pattern m
   has a <= m < a + w}. Range 0 is always the non-zero finite elements (1, inf - 1).
   sc: ns pairs (Y, fmax) of scaled (8-bit) targets: once the abs max is known,
   cnt[nr + j] = #{1 <= m <= U}, U the largest pattern whose value v has
   (float)(v * (fmax / amax)) <= Y (the scaled value a cast flushes to zero), found by bisection.
   Per block of TW_CB elements one loop takes the largest pattern, the smallest non-zero one (as
   m - 1, zeros wrapping to the top) and the zeros; a range is counted in the block (still in
   L1, a branch-free compare-and-add) only when it overlaps the block's non-zero patterns
   [smallest, largest] - rarely, for thresholds at the ends of the range - and range 0 is the
   block's length less its zeros unless the block holds inf/nan. A scaled target's range is
   counted after the read, in the blocks whose smallest non-zero pattern (kept per block) is at
   or below U: a second read of those blocks only. */
#define TW_CB 2048
#define TW_MAXR 64
static inline double tw_dec_f64(uint64_t u) { double d; __builtin_memcpy(&d, &u, 8); return d; }
static inline double tw_dec_f32(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
static inline double tw_dec_bf16(uint16_t u) { return tw_dec_f32((uint32_t)u << 16); }
static inline double tw_dec_f16(uint16_t u) {
    uint32_t e = (u >> 10) & 31, m = u & 1023;
    if (!e) return m * 0x1p-24;
    return tw_dec_f32(((e + 112) << 23) | (m << 13));
}
#define TW_RANGE(T, MASK, XB, LEN, A, W, C)                                               \
    do {                                                                                  \
        const T a_ = (A), w_ = (W);                                                       \
        T k_ = 0;                                                                         \
        for (int i = 0; i < LEN; i++) k_ += (T)((T)(XB[i] & MASK) - a_) < w_;             \
        C += k_;                                                                          \
    } while (0)
#define COUNTS(NAME, T, MASK, INF, DEC)                                                   \
void NAME(const T* x, int64_t n, T* out, const T* rg, int nr, const double* sc, int ns,   \
          int64_t* cnt, int nt) {                                                         \
    T lo1 = (T)~(T)0, hi = 0;                                                             \
    int64_t zeros = 0;                                                                    \
    int64_t nblocks = (n + TW_CB - 1) / TW_CB;                                            \
    T* bmin = ns > 0 ? (T*)malloc(nblocks * sizeof(T)) : 0; /* per block: min non-zero - 1 */ \
    for (int r = 0; r < nr + ns; r++) cnt[r] = 0;                                         \
    _Pragma("omp parallel reduction(min:lo1) reduction(max:hi) reduction(+:zeros) num_threads(nt) if(nt > 1)") \
    {                                                                                     \
        int64_t c[TW_MAXR];                                                               \
        for (int r = 0; r < nr; r++) c[r] = 0;                                            \
        _Pragma("omp for schedule(static) nowait")                                        \
        for (int64_t bi = 0; bi < nblocks; bi++) {                                        \
            const T* xb = x + bi * TW_CB;                                                 \
            int len = n - bi * TW_CB < TW_CB ? (int)(n - bi * TW_CB) : TW_CB;             \
            T l = (T)~(T)0, g = 0, z = 0;                                                 \
            for (int i = 0; i < len; i++) {                                               \
                T m = xb[i] & MASK;                                                       \
                T m1 = (T)(m - 1);                                                        \
                l = m1 < l ? m1 : l;                                                      \
                g = m > g ? m : g;                                                        \
                z += m == 0;                                                              \
            }                                                                             \
            if (bmin) bmin[bi] = l;                                                       \
            lo1 = l < lo1 ? l : lo1;                                                      \
            hi = g > hi ? g : hi;                                                         \
            zeros += z;                                                                   \
            if (g < INF) c[0] += len - z;                                                 \
            else TW_RANGE(T, MASK, xb, len, rg[0], rg[1], c[0]);                          \
            for (int r = 1; r < nr; r++) { /* the block's non-zero patterns: [l + 1, g] */ \
                T a = rg[2 * r], w = rg[2 * r + 1];                                       \
                if (w == 0 || g < a || (T)(l + 1) > (T)(a + (T)(w - 1)) || l == (T)~(T)0) continue; \
                TW_RANGE(T, MASK, xb, len, a, w, c[r]);                                   \
            }                                                                             \
        }                                                                                 \
        _Pragma("omp critical")                                                           \
        for (int r = 0; r < nr; r++) cnt[r] += c[r];                                      \
    }                                                                                     \
    T lo = zeros ? 0 : (T)(lo1 + 1);                                                      \
    if (hi > INF) lo = hi; /* NaN anywhere: NaN in both */                                \
    out[0] = lo;                                                                          \
    out[1] = hi;                                                                          \
    if (ns <= 0 || hi == 0 || hi >= INF) { free(bmin); return; } /* no scale: the host says NaN */ \
    T su[TW_MAXR];                                                                        \
    double amax = DEC(hi);                                                                \
    for (int j = 0; j < ns; j++) {                                                        \
        const double r = sc[2 * j + 1] / amax;                                            \
        const float y = (float)sc[2 * j];                                                 \
        T a = 0, b = hi; /* (float)(DEC(a) * r) <= y, and not at b (unless b is) */        \
        if ((float)(DEC(b) * r) <= y) a = b;                                              \
        else if (!((float)(DEC(a) * r) <= y)) b = a; /* r inf: nothing is flushed */      \
        while ((T)(b - a) > 1) {                                                          \
            T mid = a + (T)((T)(b - a) / 2);                                              \
            if ((float)(DEC(mid) * r) <= y) a = mid; else b = mid;                        \
        }                                                                                 \
        su[j] = a; /* 1 <= m <= a */                                                      \
    }                                                                                     \
    _Pragma("omp parallel num_threads(nt) if(nt > 1)")                                    \
    {                                                                                     \
        int64_t c[TW_MAXR];                                                               \
        for (int r = 0; r < ns; r++) c[r] = 0;                                            \
        _Pragma("omp for schedule(static) nowait")                                        \
        for (int64_t bi = 0; bi < nblocks; bi++) {                                        \
            const T* xb = x + bi * TW_CB;                                                 \
            int len = n - bi * TW_CB < TW_CB ? (int)(n - bi * TW_CB) : TW_CB;             \
            for (int r = 0; r < ns; r++)                                                  \
                if (!bmin || bmin[bi] < su[r]) /* smallest non-zero <= U */               \
                    TW_RANGE(T, MASK, xb, len, 1, su[r], c[r]);                           \
        }                                                                                 \
        _Pragma("omp critical")                                                           \
        for (int r = 0; r < ns; r++) cnt[nr + r] += c[r];                                 \
    }                                                                                     \
    free(bmin);                                                                           \
}
COUNTS(tw_abs_minmax_cnt_f64, uint64_t, 0x7FFFFFFFFFFFFFFFull, 0x7FF0000000000000ull, tw_dec_f64)
COUNTS(tw_abs_minmax_cnt_f32, uint32_t, 0x7FFFFFFFu, 0x7F800000u, tw_dec_f32)
COUNTS(tw_abs_minmax_cnt_f16, uint16_t, 0x7FFFu, 0x7C00u, tw_dec_f16)
COUNTS(tw_abs_minmax_cnt_bf16, uint16_t, 0x7FFFu, 0x7F80u, tw_dec_bf16)
