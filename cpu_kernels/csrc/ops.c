/* The small per-layer operations of a decode step, fused so a layer is a handful of C calls.
 *
 * With the matmuls in the kernels, a decode step of a small model spent most of its time in
 * Python and in torch's per-operation overhead (about 40 tensor operations per layer). These
 * functions do the same arithmetic as runtime/model.py's torch code, in float32, in one call
 * each: RMSNorm, SiLU(gate) * up, and rotary embedding + KV-cache write + causal attention.
 *
 * Every result row depends only on its own inputs, computed in a fixed order: a token gets
 * bit-identical results whether it is decoded alone or computed in a prefill batch, so greedy
 * output does not depend on how a prompt was split (KV-prefix reuse, speculative verification).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "ops.h"

/* 16 floats as one value: GCC/Clang vector extensions, compiled to each clone's widest vectors. */
typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

static inline v16f load16(const float *p) { return *(const v16f *)p; }
static inline void store16(float *p, v16f v) { *(v16f *)p = v; }

/* e^x for x <= 88 (below -87, 0), to about 2 ulp: x = n ln2 + r, e^r by a degree-6 polynomial
 * (Cephes' coefficients), times 2^n built in the exponent bits. Plain + and * in a fixed order,
 * so every ISA clone gives the same bits. */
/* Lanes of a where mask is set (all ones), else of b. */
static inline v16f select16(v16i mask, v16f a, v16f b) {
    v16i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    v16i chosen = (mask & ai) | (~mask & bi);
    v16f result;
    memcpy(&result, &chosen, sizeof result);
    return result;
}

static inline v16f exp16(v16f x) {
    const v16i underflow = x < -87.0f;
    x = select16(underflow, (v16f){0} - 87.0f, x);
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
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16f scale;
    memcpy(&scale, &bits, sizeof scale);
    v16f result = p * scale;
    return select16(underflow, (v16f){0}, result);
}

static inline float sum16(v16f v) {
    float lanes[16];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = 8; width >= 1; width /= 2) {
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    }
    return lanes[0];
}


void rms_norm_rows(const float *x, const float *weight, int64_t rows, int64_t size, float eps,
                   float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * size;
        double squares = 0.0;
        for (int64_t i = 0; i < size; i++) squares += (double)xr[i] * xr[i];
        float inv = 1.0f / sqrtf((float)(squares / size) + eps);
        for (int64_t i = 0; i < size; i++) out[r * size + i] = xr[i] * inv * weight[i];
    }
}

TARGET_CLONES void silu_mul_rows(const float *gate_up, int64_t rows, int64_t size, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * size, *up = gate + size;
        int64_t i = 0;
        for (; i + 16 <= size; i += 16) {
            v16f g = load16(gate + i);
            store16(out + r * size + i, g / (1.0f + exp16(-g)) * load16(up + i));
        }
        for (; i < size; i++) { /* the tail, through the same vector code */
            float g[16] = {gate[i]}, u[16] = {up[i]}, o[16];
            store16(o, load16(g) / (1.0f + exp16(-load16(g))) * load16(u));
            out[r * size + i] = o[0];
        }
    }
}

/* Rotates the first rope_dim features of one head: adjacent pairs ("normal", llama) or the two
 * halves of the rotary part ("neox", qwen2). */
static void rotate(float *head, const float *cos, const float *sin, int64_t rope_dim, int neox) {
    const int64_t pairs = rope_dim / 2;
    for (int64_t i = 0; i < pairs; i++) {
        float *a = neox ? head + i : head + 2 * i, *b = neox ? head + i + pairs : head + 2 * i + 1;
        float first = *a, second = *b;
        *a = first * cos[i] - second * sin[i];
        *b = first * sin[i] + second * cos[i];
    }
}

/* llama.cpp's rotation of a quantized cache (cpu_kernels/hadamard.py): each block of n features of
 * x [dim] times the orthonormal Walsh-Hadamard matrix, butterfly stages (a + b, a - b), then times
 * float32 1/sqrt(n), the float32 steps of hadamard.py in its order, so the same bits. n = 0: none. */
static void hadamard(float *x, int64_t dim, int64_t n) {
    if (n == 0) return;
    const float scale = (float)(1.0 / sqrt((double)n));
    for (float *block = x; block < x + dim; block += n) {
        for (int64_t half = 1; half < n; half *= 2) {
            for (int64_t i = 0; i < n; i += 2 * half) { /* feature j meets j + half in each run of 2 half */
                for (int64_t j = i; j < i + half; j++) {
                    const float first = block[j], second = block[j + half];
                    block[j] = first + second, block[j + half] = first - second;
                }
            }
        }
        for (int64_t j = 0; j < n; j++) block[j] *= scale;
    }
}

/* The Hadamard size of a quantized cache's keys (and queries) or values, as llama.cpp chooses
 * them (hadamard.rotation_sizes); 0 for plain rows. */
static int64_t hadamard_size(const attention_shape *s, int keys) {
    if ((s->kv != KV_Q8_0 && s->kv != KV_Q4_0) || s->head_dim % 64) return 0;
    return keys ? s->head_dim & -s->head_dim : 64;
}

#define MAX_GROUP 64 /* query heads per key/value head */
#define HEAD_BLOCK 4 /* query heads scored together (accumulators kept in registers) */
#define QBLOCK 32    /* values per q8_0 / q4_0 block */

/* -- cache rows: each type's items, converted 16 lanes at a time ------------------------------
 *
 * Every stored value converts exactly to float32 (a half, or d * q with an 11-bit d and a small
 * integer q), so a type's kernel computes what the float32 kernel would over the dequantized
 * cache; only the writes round, as llama.cpp's reference quantizers do. */

typedef uint16_t v16h __attribute__((vector_size(32), aligned(1)));
typedef int16_t v16s16 __attribute__((vector_size(32), aligned(1)));
typedef int8_t v16s8 __attribute__((vector_size(16), aligned(1)));
typedef uint8_t v16u8 __attribute__((vector_size(16), aligned(1)));

/* 16 bytes widened to 32-bit lanes through 16 bits: GCC 12 vectorizes each step (vpmovsxbw,
 * vpmovsxwd), not the direct conversion (16 scalar moves). */
static inline v16i widen_signed(const int8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(*(const v16s8 *)p, v16s16), v16i);
}

static inline v16i widen_unsigned(const uint8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(*(const v16u8 *)p, v16s16), v16i);
}

static inline v16f bits_as_floats(v16i bits) {
    v16f f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Half bit patterns (low 16 bits of each lane) to floats, exactly: the magnitude's bits moved to
 * a float's place and scaled by 2^112 (the exponents' bias difference) covers normal and
 * subnormal halves; infinities and NaNs keep an all-ones exponent. */
static inline v16f floats_from_halves(v16i h) {
    const v16i magnitude = (h & 0x7fff) << 13;
    v16f scaled = bits_as_floats(magnitude) * 0x1p112f;
    v16i bits;
    memcpy(&bits, &scaled, sizeof bits);
    const v16i special = (h & 0x7c00) == 0x7c00;
    bits = (bits & ~special) | ((magnitude | 0x7f800000) & special);
    return bits_as_floats(bits | ((h & 0x8000) << 16));
}

static inline float float_from_half(uint16_t h) {
    const uint32_t magnitude = (uint32_t)(h & 0x7fff) << 13;
    float scaled;
    memcpy(&scaled, &magnitude, sizeof scaled);
    scaled *= 0x1p112f;
    uint32_t bits;
    memcpy(&bits, &scaled, sizeof bits);
    if ((h & 0x7c00) == 0x7c00) bits = magnitude | 0x7f800000u;
    bits |= (uint32_t)(h & 0x8000) << 16;
    memcpy(&scaled, &bits, sizeof scaled);
    return scaled;
}

/* float32 to half bits, rounded to nearest even (as F16C, numpy and torch round). */
static uint16_t half_from_float(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (x >> 16) & 0x8000;
    const uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00;  /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00; /* 65520 and up round to infinity */
    if (a < 0x38800000u) { /* a subnormal half: 0.5 + |f| rounds |f| to a multiple of 2^-24 */
        float t;
        memcpy(&t, &a, sizeof t);
        t += 0.5f;
        uint32_t tb;
        memcpy(&tb, &t, sizeof tb);
        return sign | (uint16_t)(tb - 0x3f000000u);
    }
    return sign | (uint16_t)((a + 0xfffu + ((a >> 13) & 1) - 0x38000000u) >> 13);
}

static inline v16f load16_halves(const uint16_t *p) {
    return floats_from_halves(__builtin_convertvector(*(const v16h *)p, v16i));
}

/* The scales of the 16 positions of a transposed q8_0 / q4_0 block: their low bytes, then their
 * high bytes. */
static inline v16f load16_scales(const uint8_t *p) {
    return floats_from_halves(widen_unsigned(p) | widen_unsigned(p + 16) << 8);
}

static inline v16f load16_q8(const int8_t *p, v16f scale) {
    return __builtin_convertvector(widen_signed(p), v16f) * scale;
}

/* Lanes of 16 packed q4_0 bytes: their low nibbles (high = 0) or high nibbles, as d * (q - 8). */
static inline v16f load16_q4(const uint8_t *p, int high, v16f scale) {
    const v16i bytes = widen_unsigned(p);
    return __builtin_convertvector(((high ? bytes >> 4 : bytes) & 15) - 8, v16f) * scale;
}

/* Writes row x [dim] in the type, item i at dst + i * stride items (1: a value row; 16: a key
 * row into its transposed block), quantized as llama.cpp's quantize_row_q8_0_ref and
 * quantize_row_q4_0_ref do: the same float32 steps, so the same bytes. */
static void store_row(const float *x, int64_t dim, kv_format kv, void *dst, int64_t stride) {
    if (kv == KV_F32 || kv == KV_F16) {
        for (int64_t i = 0; i < dim; i++) {
            if (kv == KV_F32) ((float *)dst)[i * stride] = x[i];
            else ((uint16_t *)dst)[i * stride] = half_from_float(x[i]);
        }
        return;
    }
    uint8_t *out = dst;
    const int64_t block_bytes = kv == KV_Q8_0 ? 34 : 18;
    for (int64_t b = 0; b < dim / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        uint8_t *ob = out + b * block_bytes * stride;
        float amax = 0.0f, max = 0.0f; /* the largest magnitude, and its value (the first one) */
        for (int j = 0; j < QBLOCK; j++) {
            if (amax < fabsf(xb[j])) amax = fabsf(xb[j]), max = xb[j];
        }
        const float d = kv == KV_Q8_0 ? amax / 127 : max / -8, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t h = half_from_float(d);
        ob[0] = h & 0xff, ob[stride] = h >> 8;
        for (int j = 0; kv == KV_Q8_0 && j < QBLOCK; j++) ob[(2 + j) * stride] = (uint8_t)(int8_t)roundf(xb[j] * inverse);
        for (int j = 0; kv == KV_Q4_0 && j < QBLOCK / 2; j++) {
            const int low = (int8_t)(xb[j] * inverse + 8.5f), high = (int8_t)(xb[j + 16] * inverse + 8.5f);
            ob[(2 + j) * stride] = (uint8_t)((low < 15 ? low : 15) | (high < 15 ? high : 15) << 4);
        }
    }
}

/* -- attention ---------------------------------------------------------------------------- */

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* Adds q[g] * k, k the keys of one block of 16 positions at feature d, to out[g]: each score one
 * lane, summed over d in order whatever the type. */
static ALWAYS_INLINE void add_feature(const float *q, const int count, int64_t dim, int64_t d, v16f k,
                                      v16f out[HEAD_BLOCK]) {
    for (int g = 0; g < count; g++) out[g] += q[g * dim + d] * k;
}

/* Scores of query heads q[0 .. count) (count <= HEAD_BLOCK) at the 16 positions of one block of
 * keys, stored [row][16]. */
static ALWAYS_INLINE void score16(const attention_shape *s, const float *q, const int count, const void *block,
                                  v16f out[HEAD_BLOCK]) {
    const int64_t dim = s->head_dim;
    for (int g = 0; g < count; g++) out[g] = (v16f){0};
    if (s->kv == KV_F32) {
        for (int64_t d = 0; d < dim; d++) add_feature(q, count, dim, d, load16((const float *)block + 16 * d), out);
    } else if (s->kv == KV_F16) {
        for (int64_t d = 0; d < dim; d++)
            add_feature(q, count, dim, d, load16_halves((const uint16_t *)block + 16 * d), out);
    } else {
        const int64_t block_bytes = s->kv == KV_Q8_0 ? 34 : 18;
        for (int64_t b = 0; b < dim / QBLOCK; b++) {
            const uint8_t *codes = (const uint8_t *)block + b * block_bytes * 16;
            const v16f scale = load16_scales(codes);
            codes += 32;
            if (s->kv == KV_Q8_0) {
                for (int j = 0; j < QBLOCK; j++)
                    add_feature(q, count, dim, b * QBLOCK + j, load16_q8((const int8_t *)codes + 16 * j, scale), out);
            } else {
                for (int j = 0; j < QBLOCK; j++)
                    add_feature(q, count, dim, b * QBLOCK + j, load16_q4(codes + 16 * (j % 16), j >= 16, scale), out);
            }
        }
    }
}

/* A block of scores, scaled and, with a soft cap, capped in llama.cpp's order: x * (1 / cap), tanh, * cap. */
static inline v16f scaled16(v16f score, float scale, float softcap) {
    score *= scale;
    if (softcap == 0.0f) return score;
    float lanes[16];
    memcpy(lanes, &score, sizeof lanes);
    const float inverse = 1.0f / softcap;
    for (int l = 0; l < 16; l++) lanes[l] = tanhf(lanes[l] * inverse) * softcap;
    memcpy(&score, lanes, sizeof score);
    return score;
}

/* Scaled (and soft-capped) scores of `count` query heads over positions from .. padded (from a
 * multiple of 16): scores[g][t]. Position t's key is in slot t % capacity: a block of 16
 * positions is a block of 16 slots, as the capacity is a multiple of 16. */
static ALWAYS_INLINE void score_heads(const attention_shape *s, const float *q, const int count, const char *keys,
                                      int64_t row_bytes, int64_t from, int64_t padded, float scale, float softcap,
                                      float *scores) {
    for (int64_t t = from; t < padded; t += 16) {
        v16f block[HEAD_BLOCK];
        score16(s, q, count, keys + t % s->capacity * row_bytes, block);
        for (int g = 0; g < count; g++) store16(scores + g * padded + t, scaled16(block[g], scale, softcap));
    }
}

#define VALUE_CHUNKS 4 /* 16-feature chunks of a head's output kept in registers: 64 features */

/* Feature chunk c (16 features from d) of a value row, as floats. */
static ALWAYS_INLINE v16f value16(kv_format kv, const void *row, int64_t d) {
    if (kv == KV_F32) return load16((const float *)row + d);
    if (kv == KV_F16) return load16_halves((const uint16_t *)row + d);
    const uint8_t *block = (const uint8_t *)row + d / QBLOCK * (kv == KV_Q8_0 ? 34 : 18);
    const v16f scale = (v16f){0} + float_from_half((uint16_t)(block[0] | block[1] << 8));
    return kv == KV_Q8_0 ? load16_q8((const int8_t *)block + 2 + d % QBLOCK, scale)
                         : load16_q4(block + 2, d % QBLOCK >= 16, scale);
}

/* The cache slot of the value at sequence position t: a tree token's ancestors are at the slots
 * of the tree (root + path[j]); every slot wraps around the capacity (a sliding window's ring). */
static ALWAYS_INLINE int64_t value_slot(const attention_job *job, int64_t t, const int64_t *path) {
    const int64_t root = job->tree_start;
    return (path && t >= root ? root + path[t - root] : t) % job->shape.capacity;
}

/* The weighted values: every visible position's (first .. length) probs[g][t] * value, added in
 * position order into out[g][d0 .. d0 + 16 * chunks) of `count` heads, in registers (each row read
 * once for them). */
static ALWAYS_INLINE void add_values(const attention_job *job, const char *values, int64_t row_bytes,
                                     const float *probs, int64_t padded, int64_t first, int64_t length,
                                     const int64_t *path, const int count, int64_t d0, const int chunks, float *out) {
    const attention_shape *s = &job->shape;
    v16f acc[HEAD_BLOCK][VALUE_CHUNKS];
    for (int g = 0; g < count; g++) {
        for (int c = 0; c < VALUE_CHUNKS; c++) acc[g][c] = (v16f){0};
    }
    for (int64_t t = first; t < length; t++) {
        const char *row = values + value_slot(job, t, path) * row_bytes;
        v16f v[VALUE_CHUNKS];
        for (int c = 0; c < chunks; c++) v[c] = value16(s->kv, row, d0 + 16 * c);
        for (int g = 0; g < count; g++) {
            const float p = probs[g * padded + t];
            for (int c = 0; c < chunks; c++) acc[g][c] += p * v[c];
        }
    }
    for (int g = 0; g < count; g++) {
        for (int c = 0; c < chunks; c++) store16(out + g * s->head_dim + d0 + 16 * c, acc[g][c]);
    }
}

/* add_values over a head's features, in ranges of 64, 32 and 16 (so that the chunks in registers
 * are a constant number). */
static ALWAYS_INLINE void add_all_values(const attention_job *job, const char *values, int64_t row_bytes,
                                         const float *probs, int64_t padded, int64_t first, int64_t length,
                                         const int64_t *path, const int count, float *out) {
    const int64_t dim = job->shape.head_dim;
    int64_t d0 = 0;
#define ADD_CHUNKS(chunks) add_values(job, values, row_bytes, probs, padded, first, length, path, count, d0, chunks, out)
    for (; d0 + 64 <= dim; d0 += 64) ADD_CHUNKS(4);
    if (dim - d0 >= 32) {
        ADD_CHUNKS(2);
        d0 += 32;
    }
    if (dim - d0 >= 16) ADD_CHUNKS(1);
#undef ADD_CHUNKS
}

/* The features past the last whole chunk of 16 (float types only: quantized rows are blocks of 32). */
static void add_value_tail(const attention_job *job, const char *values, int64_t row_bytes, const float *probs,
                           int64_t padded, int64_t first, int64_t length, const int64_t *path, int64_t group,
                           float *out) {
    const attention_shape *s = &job->shape;
    const int64_t dim = s->head_dim;
    for (int64_t t = first; t < length; t++) {
        const char *row = values + value_slot(job, t, path) * row_bytes;
        for (int64_t d = dim / 16 * 16; d < dim; d++) {
            const float v = s->kv == KV_F32 ? ((const float *)row)[d] : float_from_half(((const uint16_t *)row)[d]);
            for (int64_t g = 0; g < group; g++) out[g * dim + d] += probs[g * padded + t] * v;
        }
    }
}


/* The cache slots a tree token sees, as the sequence it would have seen decoded alone: positions
 * 0 .. tree_start - 1, then its ancestors from the root down (slot tree_start + path[j] holds the
 * one at depth j). Returns the sequence's length. */
static int64_t visible_path(const attention_job *job, int64_t token, int64_t *path) {
    const int64_t node = job->start - job->tree_start + token;
    int64_t depth = 0;
    for (int64_t t = node; t >= 0; t = job->parents[t]) depth++;
    for (int64_t t = node, j = depth - 1; t >= 0; t = job->parents[t], j--) path[j] = t;
    return job->tree_start + depth;
}

/* Softmax of one head's scores over positions first .. length (a tree token's moved to the
 * positions its ancestors would hold in a sequence), turned into probabilities in place; scores
 * before first (a sliding window's) are not seen, whichever slots hold them. */
static ALWAYS_INLINE void softmax(float *sg, int64_t first, int64_t length, const int64_t *path, int64_t root) {
    /* path[j] >= j, and ascending j never overwrites a slot a later j still reads */
    for (int64_t j = first > root ? first - root : 0; path && root + j < length; j++) sg[root + j] = sg[root + path[j]];
    const int64_t first_block = first / 16 * 16, visible_padded = (length + 15) / 16 * 16;
    for (int64_t t = first_block; t < first; t++) sg[t] = -INFINITY;
    for (int64_t t = length; t < visible_padded; t++) sg[t] = -INFINITY;
    float best = -INFINITY;
    for (int64_t t = first; t < length; t++) best = sg[t] > best ? sg[t] : best;
    v16f total = {0};
    for (int64_t t = first_block; t < visible_padded; t += 16) {
        v16f e = exp16(load16(sg + t) - best);
        store16(sg + t, e);
        total += e;
    }
    const float inv_total = 1.0f / sum16(total);
    for (int64_t t = first; t < length; t++) sg[t] *= inv_total;
}

/* Calls f(..., count, ...) with count a constant 1 .. HEAD_BLOCK, so that its accumulators are
 * registers. */
#define WITH_COUNT(count, call) \
    switch (count) {            \
    case 1: call(1); break;     \
    case 2: call(2); break;     \
    case 3: call(3); break;     \
    default: call(4); break;    \
    }

/* The query heads of key/value head `kv_head` for token `token`, over cache positions
 * 0 .. start + token (causal; in a tree, path != NULL, the positions of its ancestors instead):
 * each key and value row is read once per block of HEAD_BLOCK query heads. A tree token's scores
 * are moved to the positions its ancestors would hold in a sequence before the softmax, so it
 * gets the same bits as the token decoded after exactly those ancestors. */
TARGET_CLONES static void attend(const attention_job *job, int64_t token, int64_t kv_head, float *scores,
                                 int64_t *path) {
    const attention_shape *s = &job->shape;
    const int64_t group = s->heads / s->kv_heads, slots = job->start + token + 1, dim = s->head_dim;
    const int64_t length = path ? visible_path(job, token, path) : slots;
    /* the token's own position is length - 1; a window hides the positions before first, and so
     * does the cache, which no longer holds those before held_from (<= tree_start) */
    const int64_t windowed = job->window && length > job->window ? length - job->window : 0;
    const int64_t first = windowed > job->held_from ? windowed : job->held_from;
    const int64_t padded = (slots + 15) / 16 * 16, row = (s->heads + 2 * s->kv_heads) * dim;
    const int64_t item = s->kv == KV_F32 ? 4 : s->kv == KV_F16 ? 2 : 1, row_bytes = s->row * item;
    const float *q = job->qkv + token * row + kv_head * group * dim;
    const char *keys = (const char *)job->keys + kv_head * s->capacity * row_bytes; /* [capacity / 16][row][16] */
    const char *values = (const char *)job->values + kv_head * s->capacity * row_bytes;
    float *out = job->out + (token * s->heads + kv_head * group) * dim;
    /* Scores, a block of 16 positions at a time; the first block's lanes before `first` and the
     * last block's past the token read slots that hold other positions (zeros, an older sequence's,
     * or a ring's older or newer ones) and are set to -inf by softmax. */
    for (int64_t g0 = 0; g0 < group; g0 += HEAD_BLOCK) {
#define SCORE(count) \
    score_heads(s, q + g0 * dim, count, keys, row_bytes, first / 16 * 16, padded, job->scale, job->softcap, \
                scores + g0 * padded)
        WITH_COUNT(group - g0, SCORE)
#undef SCORE
    }
    for (int64_t g = 0; g < group; g++) softmax(scores + g * padded, first, length, path, job->tree_start);
    for (int64_t g0 = 0; g0 < group; g0 += HEAD_BLOCK) {
#define ADD(count) \
    add_all_values(job, values, row_bytes, scores + g0 * padded, padded, first, length, path, count, out + g0 * dim)
        WITH_COUNT(group - g0, ADD)
#undef ADD
    }
    if (dim % 16) {
        for (int64_t g = 0; g < group; g++) memset(out + g * dim + dim / 16 * 16, 0, dim % 16 * sizeof(float));
        add_value_tail(job, values, row_bytes, scores, padded, first, length, path, group, out);
    }
}

void attention_prepare(attention_job *job) {
    const attention_shape *s = &job->shape;
    const int64_t row = (s->heads + 2 * s->kv_heads) * s->head_dim, half = s->rope_dim / 2;
    const int64_t item = s->kv == KV_F32 ? 4 : s->kv == KV_F16 ? 2 : 1;
    const int64_t key_rotation = hadamard_size(s, 1), value_rotation = hadamard_size(s, 0);
    for (int64_t token = 0; token < job->tokens; token++) {
        float *q = job->qkv + token * row, *k = q + s->heads * s->head_dim, *v = k + s->kv_heads * s->head_dim;
        const float *cos = job->cos + token * half, *sin = job->sin + token * half;
        for (int64_t h = 0; h < s->heads; h++) rotate(q + h * s->head_dim, cos, sin, s->rope_dim, s->neox);
        hadamard(q, s->heads * s->head_dim, key_rotation); /* every head's blocks at once */
        for (int64_t h = 0; h < s->kv_heads; h++) {
            rotate(k + h * s->head_dim, cos, sin, s->rope_dim, s->neox);
            hadamard(k + h * s->head_dim, s->head_dim, key_rotation);
            hadamard(v + h * s->head_dim, s->head_dim, value_rotation);
            const int64_t slot = (job->start + token) % s->capacity;
            char *block = (char *)job->keys + (h * s->capacity + slot / 16 * 16) * s->row * item;
            store_row(k + h * s->head_dim, s->head_dim, s->kv, block + slot % 16 * item, 16);
            store_row(v + h * s->head_dim, s->head_dim, s->kv,
                      (char *)job->values + (h * s->capacity + slot) * s->row * item, 1);
        }
    }
}

void attention_item(void *ctx, int64_t item) {
    attention_job *job = ctx;
    const int64_t kv_heads = job->shape.kv_heads, group = job->shape.heads / kv_heads;
    const int64_t padded = (job->start + job->tokens + 15) / 16 * 16;
    attend(job, item / kv_heads, item % kv_heads, job->scores + item * group * padded,
           job->paths ? job->paths + item * (job->start - job->tree_start + job->tokens) : NULL);
    /* the values were stored rotated: so is their weighted sum, until rotated back */
    const int64_t dim = job->shape.head_dim;
    hadamard(job->out + (item / kv_heads * job->shape.heads + item % kv_heads * group) * dim, group * dim,
             hadamard_size(&job->shape, 0));
}
