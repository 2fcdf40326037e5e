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

#define MAX_GROUP 64 /* query heads per key/value head */
#define HEAD_BLOCK 4 /* query heads scored together (accumulators kept in registers) */

/* Scores of query heads q[0 .. count) (count <= HEAD_BLOCK) at the 16 positions of one block
 * of keys, stored [head_dim][16]: each score is one lane, summed over d in order. */
static inline void score16(const float *q, int count, int64_t dim, const float *block, v16f out[HEAD_BLOCK]) {
    for (int g = 0; g < count; g++) out[g] = (v16f){0};
    for (int64_t d = 0; d < dim; d++) {
        v16f k = load16(block + 16 * d);
        for (int g = 0; g < count; g++) out[g] += q[g * dim + d] * k;
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

/* The query heads of key/value head `kv_head` for token `token`, over cache positions
 * 0 .. start + token (causal; in a tree, path != NULL, the positions of its ancestors instead):
 * each key and value is read once for the whole group. A tree token's scores are moved to the
 * positions its ancestors would hold in a sequence before the softmax, so it gets the same bits
 * as the token decoded after exactly those ancestors. With a window, the positions before
 * `first` are neither scored (whole blocks of them) nor seen: the mask is by position in that
 * sequence, whichever slots hold them. */
TARGET_CLONES static void attend(const attention_job *job, int64_t token, int64_t kv_head, float *scores,
                                 int64_t *path) {
    const attention_shape *s = &job->shape;
    const int64_t group = s->heads / s->kv_heads, slots = job->start + token + 1, dim = s->head_dim;
    const int64_t length = path ? visible_path(job, token, path) : slots, root = job->tree_start;
    /* the token's own position is length - 1 */
    const int64_t first = job->window && length > job->window ? length - job->window : 0;
    const int64_t first_block = first / 16 * 16;
    const int64_t padded = (slots + 15) / 16 * 16, row = (s->heads + 2 * s->kv_heads) * dim;
    const float *q = job->qkv + token * row + kv_head * group * dim;
    const float *keys = job->keys + kv_head * s->capacity * dim; /* [capacity / 16][dim][16] */
    const float *values = job->values + kv_head * s->capacity * dim;
    /* Scores, a block of 16 positions at a time; the last block's lanes past the token read
     * slots not yet written (zeros or an older sequence's) and are set to -inf below. */
    for (int64_t g0 = 0; g0 < group; g0 += HEAD_BLOCK) {
        const int count = group - g0 < HEAD_BLOCK ? (int)(group - g0) : HEAD_BLOCK;
        for (int64_t t = first_block; t < padded; t += 16) {
            v16f block[HEAD_BLOCK];
            score16(q + g0 * dim, count, dim, keys + t * dim, block);
            for (int g = 0; g < count; g++) {
                store16(scores + (g0 + g) * padded + t, scaled16(block[g], job->scale, job->softcap));
            }
        }
    }
    float *out = job->out + (token * s->heads + kv_head * group) * dim;
    memset(out, 0, group * dim * sizeof(float));
    const int64_t visible_padded = (length + 15) / 16 * 16; /* <= padded */
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * padded;
        /* path[j] >= j, and ascending j never overwrites a slot a later j still reads */
        for (int64_t j = first > root ? first - root : 0; path && root + j < length; j++) {
            sg[root + j] = sg[root + path[j]];
        }
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
        for (int64_t t = first; t < length; t++) {
            const float p = sg[t] * inv_total;
            const float *v = values + (path && t >= root ? root + path[t - root] : t) * dim;
            int64_t d = 0;
            for (; d + 16 <= dim; d += 16) store16(out + g * dim + d, load16(out + g * dim + d) + p * load16(v + d));
            for (; d < dim; d++) out[g * dim + d] += p * v[d];
        }
    }
}

void attention_prepare(attention_job *job) {
    const attention_shape *s = &job->shape;
    const int64_t row = (s->heads + 2 * s->kv_heads) * s->head_dim, half = s->rope_dim / 2;
    for (int64_t token = 0; token < job->tokens; token++) {
        float *q = job->qkv + token * row, *k = q + s->heads * s->head_dim, *v = k + s->kv_heads * s->head_dim;
        const float *cos = job->cos + token * half, *sin = job->sin + token * half;
        for (int64_t h = 0; h < s->heads; h++) rotate(q + h * s->head_dim, cos, sin, s->rope_dim, s->neox);
        for (int64_t h = 0; h < s->kv_heads; h++) {
            rotate(k + h * s->head_dim, cos, sin, s->rope_dim, s->neox);
            const int64_t position = job->start + token;
            float *block = job->keys + (h * s->capacity + position / 16 * 16) * s->head_dim;
            for (int64_t d = 0; d < s->head_dim; d++) block[16 * d + position % 16] = k[h * s->head_dim + d];
            memcpy(job->values + (h * s->capacity + position) * s->head_dim, v + h * s->head_dim,
                   s->head_dim * sizeof(float));
        }
    }
}

void attention_item(void *ctx, int64_t item) {
    attention_job *job = ctx;
    const int64_t kv_heads = job->shape.kv_heads, group = job->shape.heads / kv_heads;
    const int64_t padded = (job->start + job->tokens + 15) / 16 * 16;
    attend(job, item / kv_heads, item % kv_heads, job->scores + item * group * padded,
           job->paths ? job->paths + item * (job->start - job->tree_start + job->tokens) : NULL);
}
