/* The CPU kernel on its own: compiled with the package's source included, run by
   tests/test_cpu_kernel_source.py. Checks the exact abs min/max of edge values in every dtype,
   single- and multi-threaded, and the many-tensor entry point. Prints one line per failure and
   "ok N" at the end; exits 1 on any failure. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "../../tensorwatch_otel/core/measure/cpu_kernel.c"

static int failures = 0, checks = 0;

static void expect_bits(const char* what, uint64_t got, uint64_t want) {
    checks++;
    if (got != want) {
        failures++;
        printf("FAIL %s: got 0x%llx, want 0x%llx\n", what, (unsigned long long)got, (unsigned long long)want);
    }
}

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static uint64_t f64_bits(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }

/* values as bit patterns: the kernel reads bits, so every dtype's edge values are written as such */
static void f32_cases(int nt) {
    float plain[] = {-3.5f, 2.0f, 0.25f, -7.0f};
    uint32_t out[2];
    tw_abs_minmax_f32((const uint32_t*)plain, 4, out, nt);
    expect_bits("f32 plain min", out[0], f32_bits(0.25f));
    expect_bits("f32 plain max", out[1], f32_bits(7.0f));

    float zeros[] = {-0.0f, 1.0f, -2.0f};
    tw_abs_minmax_f32((const uint32_t*)zeros, 3, out, nt);
    expect_bits("f32 -0 min is +0", out[0], 0);

    uint32_t sub[] = {0x80000001u /* -smallest subnormal */, f32_bits(1.0f)};
    tw_abs_minmax_f32(sub, 2, out, nt);
    expect_bits("f32 subnormal min", out[0], 1);

    float inf[] = {1.0f, -INFINITY, 3.0f};
    tw_abs_minmax_f32((const uint32_t*)inf, 3, out, nt);
    expect_bits("f32 -inf max", out[1], 0x7F800000u);
    expect_bits("f32 -inf min", out[0], f32_bits(1.0f));

    uint32_t nan[] = {f32_bits(1.0f), 0xFFC00001u /* a negative NaN */, f32_bits(INFINITY)};
    tw_abs_minmax_f32(nan, 3, out, nt);
    checks++;
    if (!(out[0] > 0x7F800000u && out[1] > 0x7F800000u)) {
        failures++;
        printf("FAIL f32 NaN: both must be NaN, got 0x%x 0x%x\n", out[0], out[1]);
    }

    uint32_t one[] = {f32_bits(-3.0e38f)};
    tw_abs_minmax_f32(one, 1, out, nt);
    expect_bits("f32 one element min", out[0], f32_bits(3.0e38f));
    expect_bits("f32 one element max", out[1], f32_bits(3.0e38f));
}

static void half_cases(int nt) {
    /* fp16: 65504 is 0x7BFF, inf 0x7C00, smallest subnormal 0x0001, -0 0x8000 */
    uint16_t h[] = {0xFBFF /* -65504 */, 0x8000, 0x3C00 /* 1 */};
    uint16_t out[2];
    tw_abs_minmax_f16(h, 3, out, nt);
    expect_bits("f16 min", out[0], 0);
    expect_bits("f16 max", out[1], 0x7BFF);
    uint16_t hn[] = {0x3C00, 0xFE01 /* NaN */};
    tw_abs_minmax_f16(hn, 2, out, nt);
    expect_bits("f16 NaN max", out[1] > 0x7C00, 1);
    expect_bits("f16 NaN min", out[0] > 0x7C00, 1);
    /* bf16: inf 0x7F80, largest finite 0x7F7F */
    uint16_t b[] = {0xFF7F, 0x0001, 0x3F80};
    tw_abs_minmax_bf16(b, 3, out, nt);
    expect_bits("bf16 min", out[0], 1);
    expect_bits("bf16 max", out[1], 0x7F7F);
    uint16_t bi[] = {0x3F80, 0xFF80 /* -inf */};
    tw_abs_minmax_bf16(bi, 2, out, nt);
    expect_bits("bf16 -inf max", out[1], 0x7F80);
}

static void f64_cases(int nt) {
    double d[] = {-1e300, 1e-310 /* subnormal */, 2.0};
    uint64_t out[2];
    tw_abs_minmax_f64((const uint64_t*)d, 3, out, nt);
    expect_bits("f64 min", out[0], f64_bits(1e-310));
    expect_bits("f64 max", out[1], f64_bits(1e300));
}

static void large_case(int nt) {
    /* more elements than one thread's share, the extremes at both ends */
    enum { N = 1 << 18 };
    static float x[N];
    for (int i = 0; i < N; i++) x[i] = 1.0f + (float)(i % 7);
    x[0] = -0.5f;
    x[N - 1] = -1000.0f;
    uint32_t out[2];
    tw_abs_minmax_f32((const uint32_t*)x, N, out, nt);
    expect_bits("large min", out[0], f32_bits(0.5f));
    expect_bits("large max", out[1], f32_bits(1000.0f));
}

static void many_case(void) {
    float a[] = {-2.0f, 4.0f};
    uint16_t h[] = {0x3C00 /* 1 */, 0xC000 /* -2 */};
    double d[] = {-8.0, 0.5};
    const void* ptrs[] = {a, h, d};
    int64_t ns[] = {2, 2, 2};
    int8_t codes[] = {1, 2, 0};
    double out[6];
    tw_abs_minmax_many(ptrs, ns, codes, 3, out, 1, 1 << 16);
    double want[] = {2.0, 4.0, 1.0, 2.0, 0.5, 8.0};
    for (int i = 0; i < 6; i++) {
        checks++;
        if (out[i] != want[i]) {
            failures++;
            printf("FAIL many[%d]: got %g, want %g\n", i, out[i], want[i]);
        }
    }
}

int main(void) {
    for (int nt = 1; nt <= 2; nt++) {
        f32_cases(nt);
        half_cases(nt);
        f64_cases(nt);
        large_case(nt);
    }
    many_case();
    printf("ok %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
