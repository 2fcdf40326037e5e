/* The small per-layer operations of a decode step, fused so a layer is a handful of C calls.
 *
 * With the matmuls in the kernels, a decode step of a small model spent most of its time in
 * Python and in torch's per-operation overhead (about 40 tensor operations per layer). These
 * functions do the same arithmetic as runtime/model.py's torch code, in float32, in one call
 * each: RMSNorm, SiLU(gate) * up, a MoE layer's weighted sum of its experts' outputs, and rotary
 * embedding + KV-cache write + causal attention (the attention of one item is in attend.h,
 * compiled once per ISA).
 *
 * Every result row depends only on its own inputs, computed in a fixed order: a token gets
 * bit-identical results whether it is decoded alone or computed in a prefill batch, so greedy
 * output does not depend on how a prompt was split (KV-prefix reuse, speculative verification).
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "ops.h"
#include "vec16.h"

/* 1 / rms(x), the squares summed in double. */
static float rms_inverse(const float *x, int64_t size, float eps) {
    double squares = 0.0;
    for (int64_t i = 0; i < size; i++) squares += (double)x[i] * x[i];
    return 1.0f / sqrtf((float)(squares / size) + eps);
}

void rms_norm_rows(const float *x, const float *weight, int64_t rows, int64_t size, float eps,
                   float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * size;
        const float inv = rms_inverse(xr, size, eps);
        for (int64_t i = 0; i < size; i++) out[r * size + i] = xr[i] * inv * weight[i];
    }
}

/* Rows are computed 16 lanes at a time, a row's tail padded into the same vector code (load_part,
 * store_part), so that an element gets the same bits wherever it sits in a row. */
static inline v16f silu16(v16f g) { return g / (1.0f + exp16(-g)); }

TARGET_CLONES void silu_mul_rows(const float *gate_up, int64_t rows, int64_t size, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * size, *up = gate + size;
        int64_t i = 0;
        for (; i + 16 <= size; i += 16) store16(out + r * size + i, silu16(load16(gate + i)) * load16(up + i));
        if (i < size) {
            const int64_t n = size - i;
            store_part(out + r * size + i, silu16(load_part(gate + i, n)) * load_part(up + i, n), n);
        }
    }
}

TARGET_CLONES void swiglu_oai_rows(const float *gate_up, int64_t rows, int64_t size, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * size, *up = gate + size;
        for (int64_t i = 0; i < size; i += 16) {
            const int64_t n = size - i < 16 ? size - i : 16;
            v16f gv = load_part(gate + i, n), uv = load_part(up + i, n);
            gv = at_most16(gv, (v16f){0} + 7.0f);
            uv = at_most16(at_least16(uv, (v16f){0} - 7.0f), (v16f){0} + 7.0f);
            store_part(out + r * size + i, gv / (1.0f + exp16(1.702f * -gv)) * (uv + 1.0f), n);
        }
    }
}

TARGET_CLONES void weighted_rows(const float *rows, int64_t size, const int64_t *picks, const float *weights,
                                 int64_t tokens, int64_t k, float *out) {
    for (int64_t t = 0; t < tokens; t++) {
        float *o = out + t * size;
        for (int64_t j = 0; j < k; j++) {
            const float *row = rows + picks[t * k + j] * size, weight = weights[t * k + j];
            if (j == 0) {
                for (int64_t i = 0; i < size; i++) o[i] = weight * row[i];
            } else {
                for (int64_t i = 0; i < size; i++) o[i] += weight * row[i];
            }
        }
    }
}

#define DENSE_TOKENS 4 /* tokens that share a pass over a block's rows */
#define ROW_PREFETCH_BYTES 2048 /* per row: a block streams DENSE_ROWS rows at once */

/* rows x tokens dot products of one block; with constant rows and tokens (the callers' switch) the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void dense_block(const dense_job *job, int64_t row, int64_t token,
                                                              const int rows, const int tokens) {
    const int64_t cols = job->cols;
    const float *w = job->weight + row * cols, *x = job->x + token * cols;
    v16f acc[DENSE_ROWS][DENSE_TOKENS];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < tokens; t++) acc[r][t] = (v16f){0};
    for (int64_t k = 0; k < cols; k += 16) {
        const int64_t n = cols - k < 16 ? cols - k : 16;
        v16f xs[DENSE_TOKENS];
        for (int t = 0; t < tokens; t++) xs[t] = n == 16 ? load16(x + t * cols + k) : load_part(x + t * cols + k, n);
        for (int r = 0; r < rows; r++) {
            __builtin_prefetch(w + r * cols + k + ROW_PREFETCH_BYTES / sizeof(float));
            const v16f wr = n == 16 ? load16(w + r * cols + k) : load_part(w + r * cols + k, n);
            for (int t = 0; t < tokens; t++) acc[r][t] += wr * xs[t];
        }
    }
    for (int t = 0; t < tokens; t++) {
        float *out = job->out + (token + t) * job->rows + row;
        for (int r = 0; r < rows; r++) out[r] = job->bias ? sum16(acc[r][t]) + job->bias[row + r] : sum16(acc[r][t]);
    }
}

TARGET_CLONES void dense_item(void *ctx, int64_t item) {
    const dense_job *job = ctx;
    const int64_t row = item * DENSE_ROWS;
    const int rows = job->rows - row < DENSE_ROWS ? (int)(job->rows - row) : DENSE_ROWS;
    for (int64_t token = 0; token < job->tokens; token += DENSE_TOKENS) {
        const int tokens = job->tokens - token < DENSE_TOKENS ? (int)(job->tokens - token) : DENSE_TOKENS;
        if (rows < DENSE_ROWS) {
            dense_block(job, row, token, rows, tokens); /* the last block's few rows */
            continue;
        }
        switch (tokens) {
        case 1: dense_block(job, row, token, DENSE_ROWS, 1); break;
        case 2: dense_block(job, row, token, DENSE_ROWS, 2); break;
        case 3: dense_block(job, row, token, DENSE_ROWS, 3); break;
        default: dense_block(job, row, token, DENSE_ROWS, DENSE_TOKENS); break;
        }
    }
}

/* silu of a row in place, 16 lanes at a time; the tail through the same vector code. */
static inline void silu_row(float *x, int64_t size) {
    int64_t i = 0;
    for (; i + 16 <= size; i += 16) store16(x + i, silu16(load16(x + i)));
    if (i < size) store_part(x + i, silu16(load_part(x + i, size - i)), size - i);
}

TARGET_CLONES void conv_silu_rows(const float *history, const float *x, const float *weight, const float *bias,
                                  int64_t tokens, int64_t channels, int64_t taps, float *out) {
    for (int64_t t = 0; t < tokens; t++) {
        float *o = out + t * channels;
        for (int64_t j = 0; j < taps; j++) { /* window row t + j: the history's K-1 rows, then x's */
            const int64_t row = t + j - (taps - 1);
            const float *in = row < 0 ? history + (row + taps - 1) * channels : x + row * channels;
            if (j == 0) {
                for (int64_t c = 0; c < channels; c++) o[c] = in[c] * weight[c * taps];
            } else {
                for (int64_t c = 0; c < channels; c++) o[c] += in[c] * weight[c * taps + j];
            }
        }
        if (bias) {
            for (int64_t c = 0; c < channels; c++) o[c] += bias[c];
        }
        silu_row(o, channels);
    }
}

void delta_split_rows(const float *conv_out, int64_t tokens, int64_t key_heads, int64_t value_heads, int64_t dk,
                      int interleaved, float eps, float *q, float *k) {
    const int64_t channels = 2 * key_heads * dk + value_heads * dk, shared = value_heads / key_heads;
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t part = 0; part < 2; part++) {
            float *dst = (part ? k : q) + t * value_heads * dk;
            for (int64_t kh = 0; kh < key_heads; kh++) {
                const float *src = conv_out + t * channels + (part * key_heads + kh) * dk;
                double squares = 0.0;
                for (int64_t i = 0; i < dk; i++) squares += (double)(src[i] * src[i]);
                const float inv = 1.0f / sqrtf((float)squares + eps);
                for (int64_t s = 0; s < shared; s++) { /* the value heads that read key head kh */
                    float *head = dst + (interleaved ? kh * shared + s : s * key_heads + kh) * dk;
                    for (int64_t i = 0; i < dk; i++) head[i] = src[i] * inv;
                }
            }
        }
    }
}

void delta_gates_rows(const float *alpha, const float *beta_in, const float *dt, const float *a, int64_t tokens,
                      int64_t heads, float *g, float *beta) {
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = t * heads + h;
            const double b = beta_in[at], shifted = (float)(alpha[at] + dt[h]);
            beta[at] = (float)(1.0 / (1.0 + exp(-b)));
            g[at] = (float)(shifted > 20.0 ? shifted : log1p(exp(shifted))) * a[h];
        }
    }
}

TARGET_CLONES void gated_rms_norm_rows(const float *x, const float *weight, const float *gate, int64_t rows,
                                       int64_t size, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * size, *gr = gate + r * size;
        const float inv = rms_inverse(xr, size, eps);
        for (int64_t i = 0; i < size; i += 16) {
            const int64_t n = size - i < 16 ? size - i : 16;
            const v16f normed = load_part(xr + i, n) * inv * load_part(weight + i, n);
            store_part(out + r * size + i, normed * silu16(load_part(gr + i, n)), n);
        }
    }
}

TARGET_CLONES void gate_group_norm_rows(const float *y, const float *z, const float *weight, int64_t rows,
                                        int64_t size, int64_t groups, float eps, float *out) {
    const int64_t width = size / groups;
    for (int64_t r = 0; r < rows; r++) {
        const float *yr = y + r * size, *zr = z + r * size;
        float *o = out + r * size;
        for (int64_t i = 0; i < size; i += 16) {
            const int64_t n = size - i < 16 ? size - i : 16;
            store_part(o + i, load_part(yr + i, n) * silu16(load_part(zr + i, n)), n);
        }
        if (!weight) continue;
        for (int64_t g = 0; g < groups; g++) /* in place: each item is read before it is written */
            rms_norm_rows(o + g * width, weight + g * width, 1, width, eps, o + g * width);
    }
}

/* k^T S and q^T S of one token: for each row i of S in order, read_k += k[i] * row, read_q += q[i] * row.
 * The delta rule's vectors are v8f (vec16.h: GCC's avx2 code for v16f is several times slower), `lanes`
 * of them to a row of Dv = 8 lanes. */
static inline __attribute__((always_inline)) void delta_reads(const float *state, const float *q, const float *k,
                                                               int64_t dk, const int64_t lanes, v8f *read_k,
                                                               v8f *read_q) {
    for (int64_t j = 0; j < lanes; j++) read_k[j] = read_q[j] = (v8f){0};
    for (int64_t i = 0; i < dk; i++) {
        for (int64_t j = 0; j < lanes; j++) {
            const v8f row = load8(state + i * 8 * lanes + 8 * j);
            read_k[j] += k[i] * row;
            read_q[j] += q[i] * row;
        }
    }
}

/* One head's state through job->tokens tokens, in place in job->next (a copy of job->state). Each token
 * reads the state (k^T S, q^T S) before it updates it; the reads of token t + 1 are summed in the pass
 * that writes token t's update, row by row in the same order as a pass of their own, so a pass of T
 * tokens goes over the state T + 1 times, not 2T, and gives every token the bits T passes of one token
 * give. `lanes` (Dv / 8) is a constant where the caller makes it one, so that the reads stay in
 * registers. */
static inline __attribute__((always_inline)) void delta_head(const delta_step_job *job, int64_t h,
                                                              const int64_t lanes) {
    const int64_t heads = job->heads, dk = job->dk, dv = 8 * lanes;
    float *state = job->next + h * dk * dv;
    memcpy(state, job->state + h * dk * dv, (size_t)(dk * dv) * sizeof(float));
    const float scale = 1.0f / sqrtf((float)dk);
    v8f read_k[DELTA_MAX_DV / 8], read_q[DELTA_MAX_DV / 8], delta[DELTA_MAX_DV / 8];
    if (job->tokens) delta_reads(state, job->q + h * dk, job->k + h * dk, dk, lanes, read_k, read_q);
    for (int64_t t = 0; t < job->tokens; t++) {
        const int64_t at = t * heads + h; /* token t's head h in the [T, H, ...] inputs */
        const float *q = job->q + at * dk, *k = job->k + at * dk;
        const float decay = expf(job->g[at]), beta = job->beta[at];
        float qk = 0.0f;
        for (int64_t i = 0; i < dk; i++) qk += q[i] * k[i];
        for (int64_t j = 0; j < lanes; j++) {
            delta[j] = (load8(job->v + at * dv + 8 * j) - read_k[j] * decay) * beta;
            store8(job->out + at * dv + 8 * j, (read_q[j] * decay + qk * delta[j]) * scale);
        }
        const int more = t + 1 < job->tokens; /* then this pass also sums token t + 1's reads */
        const float *next_q = more ? q + heads * dk : NULL, *next_k = more ? k + heads * dk : NULL;
        for (int64_t j = 0; j < lanes; j++) read_k[j] = read_q[j] = (v8f){0};
        for (int64_t i = 0; i < dk; i++) {
            for (int64_t j = 0; j < lanes; j++) {
                float *row = state + i * dv + 8 * j;
                const v8f updated = load8(row) * decay + k[i] * delta[j];
                store8(row, updated);
                if (more) {
                    read_k[j] += next_k[i] * updated;
                    read_q[j] += next_q[i] * updated;
                }
            }
        }
    }
}

TARGET_CLONES void delta_steps_head(void *ctx, int64_t h) {
    const delta_step_job *job = ctx;
    switch (job->dv) {
    case 128: delta_head(job, h, 16); break; /* Qwen3.5's and Qwen3-Next's value heads */
    default: delta_head(job, h, job->dv / 8); break;
    }
}

/* Token t through the rows [first, last) of a scan_job (row r is head r / P's channel r % P, as x
 * and out order them), the state in place in `state` (read from `from`: the first token reads the
 * job's state, the rest their own writes). Each row of N decays and takes its write, 16 lanes at a
 * time (two v8f), and its output is the row read through c, summed across the vectors, then across
 * the lanes in sum16's order (sums8, eight rows at once). Mamba-2's per-head decay is exp in
 * double, as the torch form computes it; Mamba-1's N decays are exp16's. `vectors` (N / 16) is a
 * constant where the caller makes it one. */
static inline __attribute__((always_inline)) void scan_rows(const scan_job *job, const float *from, float *state,
                                                             int64_t first, int64_t last, int64_t t,
                                                             const int64_t vectors) {
    const int64_t heads = job->heads, p_size = job->head_dim, n = 16 * vectors, shared = heads / job->groups;
    const float *x = job->x + t * heads * p_size, *dt = job->dt + t * heads;
    float *out = job->out + t * heads * p_size;
    v8f decay[SCAN_MAX_N / 8], sums[8] = {{0}}; /* a last block of fewer rows leaves lanes unread */
    int64_t head = -1;
    for (int64_t r = first; r < last; r++) {
        if (r / p_size != head) {
            head = r / p_size;
            if (job->decays == 1) {
                const float scalar = (float)exp((double)(dt[head] * job->a[head]));
                for (int64_t j = 0; j < 2 * vectors; j++) decay[j] = (v8f){0} + scalar;
            } else {
                for (int64_t j = 0; j < vectors; j++) {
                    const v16f both = exp16(dt[head] * load16(job->a + head * n + 16 * j));
                    memcpy(&decay[2 * j], &both, sizeof both);
                }
            }
        }
        const int64_t group = (t * job->groups + head / shared) * n;
        const float *b = job->b + group, *c = job->c + group;
        const float written = x[r] * dt[head];
        v8f low = {0}, high = {0};
        for (int64_t j = 0; j < vectors; j++) {
            const v8f updated_low = load8(from + r * n + 16 * j) * decay[2 * j] + written * load8(b + 16 * j);
            const v8f updated_high = load8(from + r * n + 16 * j + 8) * decay[2 * j + 1] +
                                     written * load8(b + 16 * j + 8);
            store8(state + r * n + 16 * j, updated_low);
            store8(state + r * n + 16 * j + 8, updated_high);
            low += updated_low * load8(c + 16 * j);
            high += updated_high * load8(c + 16 * j + 8);
        }
        sums[(r - first) % 8] = low + high;
        if ((r - first) % 8 == 7 || r == last - 1) {
            const int64_t block = r - (r - first) % 8, count = r - block + 1;
            float lanes[8];
            store8(lanes, sums8(sums));
            for (int64_t i = 0; i < count; i++) out[block + i] = lanes[i] + job->d[(block + i) / p_size] * x[block + i];
        }
    }
}

static inline __attribute__((always_inline)) void scan_item(const scan_job *job, int64_t item,
                                                             const int64_t vectors) {
    const int64_t size = job->head_dim * 16 * vectors, first = item * job->heads_per_item;
    const int64_t last = first + job->heads_per_item < job->heads ? first + job->heads_per_item : job->heads;
    if (!job->tokens) {
        memcpy(job->next + first * size, job->state + first * size, (size_t)((last - first) * size) * sizeof(float));
        return;
    }
    for (int64_t t = 0; t < job->tokens; t++)
        scan_rows(job, t ? job->next : job->state, job->next, first * job->head_dim, last * job->head_dim, t,
                  vectors);
}

TARGET_CLONES void scan_steps_item(void *ctx, int64_t item) {
    const scan_job *job = ctx;
    switch (job->state_size) {
    case 16: scan_item(job, item, 1); break;   /* Mamba-1's */
    case 128: scan_item(job, item, 8); break;  /* Mamba-2's in Granite 4.0-H, Nemotron-H, Falcon-H1 */
    default: scan_item(job, item, job->state_size / 16); break;
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

#define QBLOCK 32 /* values per q8_0 / q4_0 block */

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

/* Each thread's scratch for one item (its scores, then a tree token's path), kept for the thread's
 * life and grown on demand: a pass needs threads x group x keys floats, whatever its tokens. */
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void create_scratch_key(void) { pthread_key_create(&scratch_key, free); }

#define SCRATCH_HEADER 64 /* its capacity in bytes, then the scratch (64-byte aligned) */

static void *thread_scratch(size_t bytes) {
    pthread_once(&scratch_once, create_scratch_key);
    size_t *held = pthread_getspecific(scratch_key);
    if (held && *held >= bytes) return (char *)held + SCRATCH_HEADER;
    size_t *grown = aligned_alloc(64, (bytes + SCRATCH_HEADER + 63) / 64 * 64);
    if (!grown || pthread_setspecific(scratch_key, grown) != 0) {
        free(grown);
        return NULL;
    }
    free(held);
    *grown = bytes;
    return (char *)grown + SCRATCH_HEADER;
}

attend_fn attend_kernel(isa_t isa) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (isa == ISA_AVX512) return attend_avx512;
    if (isa == ISA_AVX2) return attend_avx2;
#endif
    (void)isa;
    return attend_portable;
}

void attention_item(void *ctx, int64_t item) {
    attention_job *job = ctx;
    const int64_t kv_heads = job->shape.kv_heads, group = job->shape.heads / kv_heads;
    const int64_t padded = (job->start + job->tokens + 15) / 16 * 16;
    const int64_t path_items = job->parents ? job->start - job->tree_start + job->tokens : 0;
    float *scores = thread_scratch((size_t)(group * padded) * sizeof(float) + (size_t)path_items * sizeof(int64_t));
    if (!scores) {
        atomic_store(&job->failed, 1);
        return;
    }
    job->attend(job, item / kv_heads, item % kv_heads, scores, job->parents ? (int64_t *)(scores + group * padded) : NULL);
    /* the values were stored rotated: so is their weighted sum, until rotated back */
    const int64_t dim = job->shape.head_dim;
    hadamard(job->out + (item / kv_heads * job->shape.heads + item % kv_heads * group) * dim, group * dim,
             hadamard_size(&job->shape, 0));
}
