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

#include "ops.h"

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

void silu_mul_rows(const float *gate_up, int64_t rows, int64_t size, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * size, *up = gate + size;
        for (int64_t i = 0; i < size; i++) {
            out[r * size + i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
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

/* Dot product with 16 running sums in a fixed order (vectorizable without reassociation), so a
 * query's scores never depend on how many other queries share the call. */
static float dot(const float *a, const float *b, int64_t n) {
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int l = 0; l < 16; l++) lanes[l] += a[i + l] * b[i + l];
    }
    for (; i < n; i++) lanes[i & 15] += a[i] * b[i];
    float total = 0.0f;
    for (int l = 0; l < 16; l++) total += lanes[l];
    return total;
}

/* Query head `head` of token `token` over cache positions 0 .. start + token (causal). */
static void attend(const attention_job *job, int64_t token, int64_t head, float *scores) {
    const attention_shape *s = &job->shape;
    const int64_t kv_head = head / (s->heads / s->kv_heads), length = job->start + token + 1;
    const int64_t row = (s->heads + 2 * s->kv_heads) * s->head_dim;
    const float *q = job->qkv + token * row + head * s->head_dim;
    const float *keys = job->keys + kv_head * s->capacity * s->head_dim;
    const float *values = job->values + kv_head * s->capacity * s->head_dim;
    float best = -INFINITY;
    for (int64_t t = 0; t < length; t++) {
        scores[t] = dot(q, keys + t * s->head_dim, s->head_dim) * job->scale;
        best = fmaxf(best, scores[t]);
    }
    float total = 0.0f;
    for (int64_t t = 0; t < length; t++) {
        scores[t] = expf(scores[t] - best);
        total += scores[t];
    }
    float *out = job->out + (token * s->heads + head) * s->head_dim;
    memset(out, 0, s->head_dim * sizeof(float));
    for (int64_t t = 0; t < length; t++) {
        float p = scores[t] / total;
        for (int64_t d = 0; d < s->head_dim; d++) out[d] += p * values[t * s->head_dim + d];
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
            const int64_t slot = (h * s->capacity + job->start + token) * s->head_dim;
            memcpy(job->keys + slot, k + h * s->head_dim, s->head_dim * sizeof(float));
            memcpy(job->values + slot, v + h * s->head_dim, s->head_dim * sizeof(float));
        }
    }
}

void attention_item(void *ctx, int64_t item) {
    attention_job *job = ctx;
    const int64_t token = item / job->shape.heads, head = item % job->shape.heads;
    attend(job, token, head, job->scores + item * (job->start + job->tokens));
}
