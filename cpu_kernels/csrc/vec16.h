/* 16 floats as one value: GCC/Clang vector extensions, compiled to the including code's widest
 * vectors (each TARGET_CLONES clone, or each ISA's attention file). Plain + and * in a fixed
 * order, so every ISA gives the same bits.
 *
 * Where a v16f is wider than the ISA's vectors (AVX2's 8 floats, SSE's 4), GCC splits its
 * arithmetic well but not the rest: a store went through general registers, and a comparison
 * became sixteen scalar compares and branches (silu of a row took 3.6 ns an element, 1.65 once its
 * exp compared in halves). So stores, comparisons and the selects on them work on v8f halves
 * (low_half, high_half, join_halves), which give the same bits, and loops whose every operation is
 * a load, a store or a broadcast (Mamba's scan, the delta rule) are written in v8f throughout. */
#ifndef TIERFLOW_VEC16_H
#define TIERFLOW_VEC16_H

#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

static inline v8f low_half(v16f v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline v8f high_half(v16f v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline v16f join_halves(v8f low, v8f high) {
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

static inline v8f load8(const float *p) { return *(const v8f *)p; }
static inline void store8(float *p, v8f v) { *(v8f *)p = v; }
static inline v16f load16(const float *p) { return *(const v16f *)p; }
static inline void store16(float *p, v16f v) {
    store8(p, low_half(v));
    store8(p + 8, high_half(v));
}

/* The first n <= 16 items of p in the lanes, the rest 0: a row's tail, for the same vector code. */
static inline v16f load_part(const float *p, int64_t n) {
    float lanes[16] = {0};
    memcpy(lanes, p, (size_t)n * sizeof(float));
    return load16(lanes);
}

static inline void store_part(float *p, v16f v, int64_t n) { /* the first n <= 16 lanes */
    float lanes[16];
    store16(lanes, v);
    memcpy(p, lanes, (size_t)n * sizeof(float));
}

/* Lanes of a where mask is set (all ones), else of b. */
static inline v8f select8(v8i mask, v8f a, v8f b) { return (v8f)((mask & (v8i)a) | (~mask & (v8i)b)); }

/* x where x <= limit, else limit (a NaN stays), lane by lane: min(x, limit) */
static inline v16f at_most16(v16f x, v16f limit) {
    const v8f low = low_half(x), high = high_half(x), low_limit = low_half(limit), high_limit = high_half(limit);
    return join_halves(select8(low > low_limit, low_limit, low), select8(high > high_limit, high_limit, high));
}

/* x where x >= limit, else limit (a NaN stays), lane by lane: max(x, limit) */
static inline v16f at_least16(v16f x, v16f limit) {
    const v8f low = low_half(x), high = high_half(x), low_limit = low_half(limit), high_limit = high_half(limit);
    return join_halves(select8(low < low_limit, low_limit, low), select8(high < high_limit, high_limit, high));
}

/* e^x to about 2 ulp: x = n ln2 + r, e^r by a degree-6 polynomial (Cephes' coefficients), times 2^n
 * built in the exponent bits; 0 below -87 and infinity above 88.3 (where 2^n would no longer fit
 * the exponent bits: silu of a gate below -88.3 must be -0, not the gate). One body for each width
 * of vector (vf floats, vi their bits), the same steps in each. */
#define DEFINE_EXP(name, vf, vi)                                                                        \
    static inline vf name(vf x) {                                                                      \
        const vi underflow = x < -87.0f, overflow = x > 88.3f;                                         \
        x = (vf)((underflow & (vi)((vf){0} - 87.0f)) | (~underflow & (~overflow & (vi)x)));           \
        vf n = x * 1.44269504088896341f;                                                               \
        n = (n + 12582912.0f) - 12582912.0f; /* round to nearest (see round_even) */                   \
        vf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;                                           \
        vf p = (vf){0} + 1.9875691500e-4f;                                                             \
        p = p * r + 1.3981999507e-3f;                                                                  \
        p = p * r + 8.3334519073e-3f;                                                                  \
        p = p * r + 4.1665795894e-2f;                                                                  \
        p = p * r + 1.6666665459e-1f;                                                                  \
        p = p * r + 5.0000001201e-1f;                                                                  \
        p = (p * r) * r + r + 1.0f;                                                                    \
        const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;                                  \
        const vi finite = ~underflow & (vi)(p * (vf)bits);                                             \
        return (vf)((overflow & (vi)((vf){0} + __builtin_inff())) | (~overflow & finite));             \
    }

typedef float v4f __attribute__((vector_size(16), aligned(4)));
typedef int32_t v4i __attribute__((vector_size(16), aligned(4)));
DEFINE_EXP(exp8, v8f, v8i)
DEFINE_EXP(exp4, v4f, v4i)

static inline v16f exp16(v16f x) { return join_halves(exp8(low_half(x)), exp8(high_half(x))); }

static inline float sum16(v16f v) {
    float lanes[16];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = 8; width >= 1; width /= 2) {
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    }
    return lanes[0];
}

/* The lane sums of eight vectors s[i] = lanes 0-7 + lanes 8-15 of a v16f (sum16's first step), in
 * sum16's order: [sum16 of each], in 7 shuffled additions rather than 8 x 7 scalar ones. Each round
 * adds every partial sum's upper half to its lower half for two vectors at once, packing the two
 * results side by side. s is overwritten. */
static inline v8f sums8(v8f *s) {
    static const v8i lower[3] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 4, 5, 8, 9, 12, 13},
                                 {0, 2, 4, 6, 8, 10, 12, 14}};
    static const int width[3] = {4, 2, 1};
    for (int round = 0, count = 8; round < 3; round++, count /= 2) {
        const v8i upper = lower[round] + width[round];
        for (int i = 0; i < count / 2; i++)
            s[i] = __builtin_shuffle(s[2 * i], s[2 * i + 1], lower[round]) +
                   __builtin_shuffle(s[2 * i], s[2 * i + 1], upper);
    }
    return s[0];
}

#endif
