/* Declarations of the fused decode-step operations (ops.c). */
#ifndef TIERFLOW_OPS_H
#define TIERFLOW_OPS_H

#include <stdatomic.h>
#include <stdint.h>

#include "kernels.h"

void rms_norm_rows(const float *x, const float *weight, int64_t rows, int64_t size, float eps,
                   float *out);
void silu_mul_rows(const float *gate_up, int64_t rows, int64_t size, float *out);
/* gpt-oss's SwiGLU (ggml's swiglu_oai): g / (1 + e^(-1.702 g)) * (u + 1), g = min(gate, 7) and
 * u = up clamped to [-7, 7]. */
void swiglu_oai_rows(const float *gate_up, int64_t rows, int64_t size, float *out);
/* out[t] = the sum over j of weights[t][j] * rows[picks[t][j]], j ascending (k picks per token):
 * a token's experts' outputs, weighted, in the order its router ranked them. */
void weighted_rows(const float *rows, int64_t size, const int64_t *picks, const float *weights,
                   int64_t tokens, int64_t k, float *out);

/* A float32 matrix times a few tokens: out[t][r] = weight[r] . x[t] (+ bias[r]), for weight [N, K],
 * x [T, K], out [T, N]: the matmuls a model keeps in float32 (a MoE router, a shared expert's gate).
 * Each dot product is summed 16 lanes at a time in column order, its tail padded into the same
 * vectors, then across the lanes: the same bits whatever T is and wherever the token or the row sits
 * in its block. A pool item is DENSE_ROWS rows for every token. */
#define DENSE_ROWS 4
typedef struct {
    const float *weight, *x, *bias; /* bias: NULL, or [N] */
    float *out;
    int64_t rows, cols, tokens;
} dense_job;
void dense_item(void *ctx, int64_t item);

/* Gated DeltaNet's small steps around the delta rule (runtime/delta_rule.py), each element computed
 * alike in a pass of any length:
 * conv_silu_rows: silu of each channel's causal convolution, history [K-1, C] (the inputs before
 *   x [T, C]) and x through weight [C, K] (tap K-1 on the newest input), taps summed in order, plus
 *   bias [C] where it is not NULL (Mamba's) -> out [T, C];
 * delta_split_rows: conv_out [T, C] = [queries, keys (each key_heads x dk), values] -> q and k
 *   [T, value_heads, dk], each key head L2-normed (x / sqrt(|x|^2 + eps)) and copied to the value
 *   heads that read it: h reads h / (value_heads / key_heads) when interleaved, else h % key_heads;
 * delta_gates_rows: beta = sigmoid(beta_in), g = softplus(alpha + dt) * a, per token and head ([T, H],
 *   dt and a [H]), the functions computed in double;
 * gated_rms_norm_rows: out = rms_norm(x) * weight * silu(gate), rows of x, gate and out [R, size]. */
#define CONV_MAX_TAPS 64
void conv_silu_rows(const float *history, const float *x, const float *weight, const float *bias, int64_t tokens,
                    int64_t channels, int64_t taps, float *out);
void delta_split_rows(const float *conv_out, int64_t tokens, int64_t key_heads, int64_t value_heads, int64_t dk,
                      int interleaved, float eps, float *q, float *k);
void delta_gates_rows(const float *alpha, const float *beta_in, const float *dt, const float *a, int64_t tokens,
                      int64_t heads, float *g, float *beta);
void gated_rms_norm_rows(const float *x, const float *weight, const float *gate, int64_t rows, int64_t size,
                         float eps, float *out);

/* Mamba's gate after the scan: out = y * silu(z), rows of y, z and out [R, size]; with a weight
 * [size] (Mamba-2's), each group of size / groups channels of it then RMS-normed (its squares
 * summed in double) and times its weights. */
void gate_group_norm_rows(const float *y, const float *z, const float *weight, int64_t rows, int64_t size,
                          int64_t groups, float eps, float *out);

/* The gated delta rule (runtime/delta_rule.py's step) through `tokens` tokens for every value head h:
 * state and next [H, dk, dv], q and k [T, H, dk], v and out [T, H, dv], g and beta [T, H]. A pool
 * item is one head. */
#define DELTA_MAX_DV 512
typedef struct {
    const float *state, *q, *k, *v, *g, *beta;
    float *out, *next;
    int64_t tokens, heads, dk, dv;
} delta_step_job;
void delta_steps_head(void *ctx, int64_t h);

/* Mamba's selective scan (runtime/compute/selective_scan.py's steps) through `tokens` tokens, for
 * every head h: state and next [H, P, N], x and out [T, H, P], dt [T, H] (after softplus), a [H, A]
 * (A = 1: one decay per head, Mamba-2's; A = N: one per state element, Mamba-1's, whose heads are
 * single channels), b and c [T, G, N] (head h reads group h / (H / G)), d [H]:
 *     S <- S * exp(dt a) + (x dt) b^T,  out = S c + d x
 * A pool item is `heads_per_item` heads, all of them token by token, so a head's state stays in the
 * core's cache across the tokens. N is a multiple of 16, at most SCAN_MAX_N. */
#define SCAN_MAX_N 256
typedef struct {
    const float *state, *x, *dt, *a, *b, *c, *d;
    float *out, *next;
    int64_t tokens, heads, head_dim, state_size, groups, decays, heads_per_item;
} scan_job;
void scan_steps_item(void *ctx, int64_t item);

/* The types a KV cache stores its rows in (tierflow.kv_types; layouts: cpu_kernels/kv_layout.py):
 * a head's key or value at one position is a row of `row` items, head_dim float32 or float16, or
 * head_dim / 32 blocks of llama.cpp's q8_0 (34 bytes) or q4_0 (18 bytes). */
typedef enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 2, KV_Q4_0 = 3 } kv_format;

typedef struct {
    /* capacity: cache slots; position p is in slot p % capacity (a ring when the context is longer) */
    int64_t heads, kv_heads, head_dim, rope_dim, capacity;
    int neox;
    kv_format kv;
    int64_t row; /* items of a cache row */
} attention_shape;

typedef struct attention_job attention_job;

/* The attention of one item (attend.h): the query heads of token `token` that share key/value head
 * kv_head, with the calling thread's scratch for their scores ([group][start + tokens, padded to
 * 16]) and, in a tree, the token's path. */
typedef void (*attend_fn)(const attention_job *job, int64_t token, int64_t kv_head, float *scores, int64_t *path);

struct attention_job {
    attention_shape shape;
    attend_fn attend;       /* the ISA's: attend_kernel */
    float *qkv;             /* [tokens, (heads + 2 * kv_heads) * head_dim], rotated in place */
    void *keys;             /* one layer's keys, rows transposed in blocks of 16 positions: [kv_heads, capacity / 16, row, 16] */
    void *values;           /* one layer's values [kv_heads, capacity, row] */
    const float *cos, *sin; /* [tokens, rope_dim / 2] */
    int64_t tokens, start;  /* the tokens sit at positions start .. start + tokens - 1 */
    float scale;
    /* NULL (causal), or a token tree begun at slot tree_start (<= start), maybe in earlier calls:
     * parents[i] is the parent of the token in slot tree_start + i, -1 for a root */
    const int32_t *parents;
    int64_t tree_start;
    float *out;             /* [tokens, heads * head_dim] */
    /* The token at position p sees positions p - window + 1 .. p only; 0: no window. */
    int64_t window;
    float softcap; /* scores become softcap * tanh(scores / softcap); 0: uncapped */
    int64_t held_from; /* the oldest position the cache holds (<= tree_start): none before it is seen */
    const float *sinks; /* [heads]: each query head's sink logit (attend.h's softmax); NULL: none */
    atomic_int failed; /* set when a thread's scratch could not be allocated */
};

/* Rotates q and k and writes k and v of every token into the cache, in its type. */
void attention_prepare(attention_job *job);

void attend_avx512(const attention_job *job, int64_t token, int64_t kv_head, float *scores, int64_t *path);
void attend_avx2(const attention_job *job, int64_t token, int64_t kv_head, float *scores, int64_t *path);
void attend_portable(const attention_job *job, int64_t token, int64_t kv_head, float *scores, int64_t *path);
/* The attention of the ISA (each gives the same bits). */
attend_fn attend_kernel(isa_t isa);
/* Attention of one token's query heads that share key/value head k, item = token * kv_heads + k:
 * a pool item. */
void attention_item(void *ctx, int64_t item);

#endif
