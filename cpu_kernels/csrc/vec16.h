/* 16 floats as one value: GCC/Clang vector extensions, compiled to the including code's widest
 * vectors (each TARGET_CLONES clone, or each ISA's attention file). Plain + and * in a fixed
 * order, so every ISA gives the same bits. */
#ifndef TIERFLOW_VEC16_H
#define TIERFLOW_VEC16_H

#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

static inline v16f load16(const float *p) { return *(const v16f *)p; }
static inline void store16(float *p, v16f v) { *(v16f *)p = v; }

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

static inline v16f bits_as_floats(v16i bits) {
    v16f f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Lanes of a where mask is set (all ones), else of b. */
static inline v16f select16(v16i mask, v16f a, v16f b) {
    v16i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    return bits_as_floats((mask & ai) | (~mask & bi));
}

/* e^x to about 2 ulp: x = n ln2 + r, e^r by a degree-6 polynomial (Cephes' coefficients), times 2^n
 * built in the exponent bits; 0 below -87 and infinity above 88.3 (where 2^n would no longer fit
 * the exponent bits: silu of a gate below -88.3 must be -0, not the gate). */
static inline v16f exp16(v16f x) {
    const v16i underflow = x < -87.0f, overflow = x > 88.3f;
    x = select16(underflow, (v16f){0} - 87.0f, select16(overflow, (v16f){0}, x));
    v16f n = x * 1.44269504088896341f;
    n = (n + 12582912.0f) - 12582912.0f; /* round to nearest (see round_even) */
    v16f r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    v16f p = (v16f){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * r) * r + r + 1.0f;
    const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return select16(overflow, (v16f){0} + __builtin_inff(), select16(underflow, (v16f){0}, p * bits_as_floats(bits)));
}

static inline float sum16(v16f v) {
    float lanes[16];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = 8; width >= 1; width /= 2) {
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    }
    return lanes[0];
}

/* Half a v16f: AVX2's native width. GCC's avx2 code stores a v16f through general registers and
 * builds its broadcasts on the stack, which made a loop of loads, stores and broadcasts (Mamba's
 * scan) five times slower than the same loop in v8f; lanes 0-7 and 8-15 of a v16f computation in
 * two v8f give the same bits. */
typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) { return *(const v8f *)p; }
static inline void store8(float *p, v8f v) { *(v8f *)p = v; }

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
