/* The attention of one item (a token's query heads that share a key/value head), compiled once
 * per ISA: an attend_*.c file sets its target with #pragma GCC target, names the entry point
 * ATTEND and includes this file, so that the cache loads below can use the ISA's conversion
 * instructions (GCC does not inline intrinsics into target_clones functions).
 *
 * Every path does the same float32 arithmetic in the same order (mul then add, no FMA: the build
 * has -ffp-contract=off), so every ISA gives the same bits, alone, in a batch or in a tree. The
 * loads convert exactly: every stored value is a float32, a half, or d * q with an 11-bit d and a
 * small integer q, so a type's kernel computes what the float32 kernel would over the dequantized
 * cache.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ops.h"
#include "vec16.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))
#define MAX_GROUP 64 /* query heads per key/value head */
#define HEAD_BLOCK 4 /* query heads scored together (accumulators kept in registers) */

/* Sixteen lanes (a block of 16 positions' scores, or 16 features) as PARTS vectors of the ISA's
 * width: one v16f (AVX-512), two v8f (AVX2) or four v4f (SSE2). GCC keeps a vector the ISA has no
 * register for in memory and moves it through general registers (vec16.h), which made this
 * kernel's AVX2 build slower than its SSE2 one; every step here is lane by lane, so the split
 * changes no bits. */
#if defined(__AVX512F__)
typedef v16f part;
typedef v16i part_bits;
#define PARTS 1
static ALWAYS_INLINE part exp_part(part x) { return exp16(x); }
#elif defined(__AVX2__)
typedef v8f part;
typedef v8i part_bits;
#define PARTS 2
static ALWAYS_INLINE part exp_part(part x) { return exp8(x); }
#else
typedef v4f part;
typedef v4i part_bits;
#define PARTS 4
static ALWAYS_INLINE part exp_part(part x) { return exp4(x); }
#endif

/* b where b > a, else a, lane by lane */
static ALWAYS_INLINE part larger_part(part a, part b) {
    const part_bits mask = b > a;
    return (part)((mask & (part_bits)b) | (~mask & (part_bits)a));
}
#define PART_LANES (16 / PARTS)
typedef struct {
    part p[PARTS];
} lanes16;

static ALWAYS_INLINE lanes16 zero16(void) { return (lanes16){{{0}}}; }

static ALWAYS_INLINE lanes16 load_floats16(const float *x) {
    lanes16 v;
    for (int i = 0; i < PARTS; i++) v.p[i] = *(const part *)(x + PART_LANES * i);
    return v;
}

static ALWAYS_INLINE void store_floats16(float *x, lanes16 v) {
    for (int i = 0; i < PARTS; i++) *(part *)(x + PART_LANES * i) = v.p[i];
}

static ALWAYS_INLINE lanes16 times16(lanes16 a, lanes16 b) {
    for (int i = 0; i < PARTS; i++) a.p[i] *= b.p[i];
    return a;
}

/* The lanes' sum in sum16's order. */
static ALWAYS_INLINE float lane_total16(lanes16 v) {
    v16f all;
    memcpy(&all, &v, sizeof all);
    return sum16(all);
}
#define QBLOCK 32    /* values per q8_0 / q4_0 block */

/* -- cache items to floats, 16 lanes at a time ---------------------------------------------- */

#if defined(__AVX512F__) && defined(__F16C__)

static ALWAYS_INLINE lanes16 from_m512(__m512 v) { return (lanes16){{(v16f)v}}; }

static ALWAYS_INLINE lanes16 load16_halves(const uint16_t *p) {
    return from_m512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)));
}

/* The scales of the 16 positions of a transposed q8_0 / q4_0 block: their low bytes, then their
 * high bytes, interleaved back into halves. */
static ALWAYS_INLINE lanes16 load16_scales(const uint8_t *p) {
    const __m128i low = _mm_loadu_si128((const __m128i *)p), high = _mm_loadu_si128((const __m128i *)(p + 16));
    const __m256i halves = _mm256_set_m128i(_mm_unpackhi_epi8(low, high), _mm_unpacklo_epi8(low, high));
    return from_m512(_mm512_cvtph_ps(halves));
}

static ALWAYS_INLINE lanes16 codes16_q8(const int8_t *p) {
    return from_m512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
}

/* Lanes of 16 packed q4_0 bytes: their low nibbles (high = 0) or high nibbles, less 8. */
static ALWAYS_INLINE lanes16 codes16_q4(const uint8_t *p, int high) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    if (high) bytes = _mm_srli_epi16(bytes, 4);
    bytes = _mm_sub_epi8(_mm_and_si128(bytes, _mm_set1_epi8(15)), _mm_set1_epi8(8));
    return from_m512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
}

static ALWAYS_INLINE float float_from_half(uint16_t h) { return _cvtsh_ss(h); }

#elif defined(__AVX2__) && defined(__F16C__)

static ALWAYS_INLINE lanes16 from_m256(__m256 low, __m256 high) { return (lanes16){{(v8f)low, (v8f)high}}; }

static ALWAYS_INLINE lanes16 load16_halves(const uint16_t *p) {
    return from_m256(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                     _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}

static ALWAYS_INLINE lanes16 load16_scales(const uint8_t *p) {
    const __m128i low = _mm_loadu_si128((const __m128i *)p), high = _mm_loadu_si128((const __m128i *)(p + 16));
    return from_m256(_mm256_cvtph_ps(_mm_unpacklo_epi8(low, high)), _mm256_cvtph_ps(_mm_unpackhi_epi8(low, high)));
}

static ALWAYS_INLINE lanes16 floats_from_bytes(__m128i bytes) {
    return from_m256(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                     _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes))));
}

static ALWAYS_INLINE lanes16 codes16_q8(const int8_t *p) { return floats_from_bytes(_mm_loadu_si128((const __m128i *)p)); }

static ALWAYS_INLINE lanes16 codes16_q4(const uint8_t *p, int high) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    if (high) bytes = _mm_srli_epi16(bytes, 4);
    return floats_from_bytes(_mm_sub_epi8(_mm_and_si128(bytes, _mm_set1_epi8(15)), _mm_set1_epi8(8)));
}

static ALWAYS_INLINE float float_from_half(uint16_t h) { return _cvtsh_ss(h); }

#else /* portable: GCC vectorizes these without the conversion instructions, 4 lanes at a time */

typedef uint16_t v4h __attribute__((vector_size(8), aligned(1)));
typedef int16_t v4s16 __attribute__((vector_size(8), aligned(1)));
typedef int8_t v4s8 __attribute__((vector_size(4), aligned(1)));
typedef uint8_t v4u8 __attribute__((vector_size(4), aligned(1)));

/* 4 bytes widened to 32-bit lanes through 16 bits: GCC 12 vectorizes each step, not the direct
 * conversion. */
static inline v4i widen_signed(const int8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(*(const v4s8 *)p, v4s16), v4i);
}

static inline v4i widen_unsigned(const uint8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(*(const v4u8 *)p, v4s16), v4i);
}

/* Half bit patterns (low 16 bits of each lane) to floats, exactly: the magnitude's bits moved to
 * a float's place and scaled by 2^112 (the exponents' bias difference) covers normal and
 * subnormal halves; infinities and NaNs keep an all-ones exponent. */
static inline v4f floats_from_halves(v4i h) {
    const v4i magnitude = (h & 0x7fff) << 13;
    v4i bits = (v4i)((v4f)magnitude * 0x1p112f);
    const v4i special = (h & 0x7c00) == 0x7c00;
    bits = (bits & ~special) | ((magnitude | 0x7f800000) & special);
    return (v4f)(bits | ((h & 0x8000) << 16));
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

static inline lanes16 load16_halves(const uint16_t *p) {
    lanes16 v;
    for (int i = 0; i < 4; i++) v.p[i] = floats_from_halves(__builtin_convertvector(*(const v4h *)(p + 4 * i), v4i));
    return v;
}

/* The 16 scales' low bytes are p[0 .. 16), their high bytes p[16 .. 32). */
static inline lanes16 load16_scales(const uint8_t *p) {
    lanes16 v;
    for (int i = 0; i < 4; i++) v.p[i] = floats_from_halves(widen_unsigned(p + 4 * i) | widen_unsigned(p + 16 + 4 * i) << 8);
    return v;
}

static inline lanes16 codes16_q8(const int8_t *p) {
    lanes16 v;
    for (int i = 0; i < 4; i++) v.p[i] = __builtin_convertvector(widen_signed(p + 4 * i), v4f);
    return v;
}

static inline lanes16 codes16_q4(const uint8_t *p, int high) {
    lanes16 v;
    for (int i = 0; i < 4; i++) {
        const v4i bytes = widen_unsigned(p + 4 * i);
        v.p[i] = __builtin_convertvector(((high ? bytes >> 4 : bytes) & 15) - 8, v4f);
    }
    return v;
}

#endif

/* A q8_0 / q4_0 block's scale (its first two bytes, a half). */
static ALWAYS_INLINE float block_scale(const uint8_t *block) {
    return float_from_half((uint16_t)(block[0] | block[1] << 8));
}

/* -- scores ------------------------------------------------------------------------------------ */

/* Adds q[g] * k, k the keys of one block of 16 positions at feature d, to out[g]: each score one
 * lane, summed over d in order whatever the type. */
static ALWAYS_INLINE void add_feature(const float *q, const int count, int64_t dim, int64_t d, lanes16 k,
                                      lanes16 out[HEAD_BLOCK]) {
    for (int g = 0; g < count; g++) {
        for (int i = 0; i < PARTS; i++) out[g].p[i] += q[g * dim + d] * k.p[i];
    }
}

/* Scores of query heads q[0 .. count) (count <= HEAD_BLOCK) at the 16 positions of one block of
 * keys, stored [row][16]. */
static ALWAYS_INLINE void score16(const attention_shape *s, const float *q, const int count, const void *block,
                                  lanes16 out[HEAD_BLOCK]) {
    const int64_t dim = s->head_dim;
    for (int g = 0; g < count; g++) out[g] = zero16();
    if (s->kv == KV_F32) {
        for (int64_t d = 0; d < dim; d++)
            add_feature(q, count, dim, d, load_floats16((const float *)block + 16 * d), out);
    } else if (s->kv == KV_F16) {
        for (int64_t d = 0; d < dim; d++)
            add_feature(q, count, dim, d, load16_halves((const uint16_t *)block + 16 * d), out);
    } else {
        const int64_t block_bytes = s->kv == KV_Q8_0 ? 34 : 18;
        for (int64_t b = 0; b < dim / QBLOCK; b++) {
            const uint8_t *codes = (const uint8_t *)block + b * block_bytes * 16;
            const lanes16 scale = load16_scales(codes);
            codes += 32;
            if (s->kv == KV_Q8_0) {
                for (int j = 0; j < QBLOCK; j++)
                    add_feature(q, count, dim, b * QBLOCK + j, times16(codes16_q8((const int8_t *)codes + 16 * j), scale),
                                out);
            } else {
                for (int j = 0; j < QBLOCK; j++)
                    add_feature(q, count, dim, b * QBLOCK + j, times16(codes16_q4(codes + 16 * (j % 16), j >= 16), scale),
                                out);
            }
        }
    }
}

/* A block of scores, scaled and, with a soft cap, capped in llama.cpp's order: x * (1 / cap), tanh, * cap. */
static ALWAYS_INLINE lanes16 scaled16(lanes16 score, float scale, float softcap) {
    for (int i = 0; i < PARTS; i++) score.p[i] *= scale;
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
    for (int64_t t = from, slot = from % s->capacity; t < padded; t += 16, slot = slot + 16 < s->capacity ? slot + 16 : 0) {
        lanes16 block[HEAD_BLOCK];
        score16(s, q, count, keys + slot * row_bytes, block);
        for (int g = 0; g < count; g++) store_floats16(scores + g * padded + t, scaled16(block[g], scale, softcap));
    }
}

/* -- weighted values --------------------------------------------------------------------------- */

/* 16-feature chunks of a head's output kept in registers for HEAD_BLOCK heads: 64 features in
 * AVX-512's 32 registers, 32 in AVX2's 16, 16 in SSE2's 16 */
#define VALUE_CHUNKS (PARTS == 4 ? 1 : 4 / PARTS)

/* Feature chunks d0 .. d0 + 16 * chunks of a value row, as floats; a q8_0 / q4_0 chunk is half a
 * block of 32 (rows are whole blocks), its codes times the block's scale. */
static ALWAYS_INLINE void values16(kv_format kv, const void *row, int64_t d0, const int chunks,
                                   lanes16 v[VALUE_CHUNKS]) {
    if (kv == KV_F32 || kv == KV_F16) {
        for (int c = 0; c < chunks; c++)
            v[c] = kv == KV_F32 ? load_floats16((const float *)row + d0 + 16 * c)
                                : load16_halves((const uint16_t *)row + d0 + 16 * c);
        return;
    }
    const int64_t block_bytes = kv == KV_Q8_0 ? 34 : 18;
    for (int c = 0; c < chunks; c++) {
        const int64_t feature = d0 + 16 * c;
        const uint8_t *block = (const uint8_t *)row + feature / QBLOCK * block_bytes;
        const int half = feature % QBLOCK / 16;
        const float scale = block_scale(block);
        v[c] = kv == KV_Q8_0 ? codes16_q8((const int8_t *)block + 2 + 16 * half) : codes16_q4(block + 2, half);
        for (int i = 0; i < PARTS; i++) v[c].p[i] *= scale;
    }
}

/* Where a pass's value rows are: position t >= first is in slot t % capacity, a tree token's
 * ancestors in the tree's slots (root + path[j]). Slots are counted from first's and the root's
 * rather than divided per position: no position a token sees is a whole capacity past them. */
typedef struct {
    int64_t first, first_slot, root, root_slot, capacity;
    const int64_t *path;
} slot_map;

static ALWAYS_INLINE slot_map slots_from(const attention_job *job, int64_t first, const int64_t *path) {
    const int64_t capacity = job->shape.capacity;
    return (slot_map){first, first % capacity, job->tree_start, job->tree_start % capacity, capacity, path};
}

static ALWAYS_INLINE int64_t value_slot(const slot_map *m, int64_t t) {
    const int64_t slot = m->path && t >= m->root ? m->root_slot + m->path[t - m->root] : m->first_slot + (t - m->first);
    return slot < m->capacity ? slot : slot - m->capacity;
}

/* The weighted values: every visible position's (first .. length) probs[g][t] * value, added in
 * position order into out[g][d0 .. d0 + 16 * chunks) of `count` heads, in registers (each row read
 * once for them). */
static ALWAYS_INLINE void add_values(const attention_job *job, const char *values, int64_t row_bytes,
                                     const float *probs, int64_t padded, int64_t first, int64_t length,
                                     const int64_t *path, const int count, int64_t d0, const int chunks, float *out) {
    const attention_shape *s = &job->shape;
    const slot_map slots = slots_from(job, first, path);
    lanes16 acc[HEAD_BLOCK][VALUE_CHUNKS];
    for (int g = 0; g < count; g++) {
        for (int c = 0; c < VALUE_CHUNKS; c++) acc[g][c] = zero16();
    }
    for (int64_t t = first; t < length; t++) {
        lanes16 v[VALUE_CHUNKS];
        values16(s->kv, values + value_slot(&slots, t) * row_bytes, d0, chunks, v);
        for (int g = 0; g < count; g++) {
            const float p = probs[g * padded + t];
            for (int c = 0; c < chunks; c++) {
                for (int i = 0; i < PARTS; i++) acc[g][c].p[i] += p * v[c].p[i];
            }
        }
    }
    for (int g = 0; g < count; g++) {
        for (int c = 0; c < chunks; c++) store_floats16(out + g * s->head_dim + d0 + 16 * c, acc[g][c]);
    }
}

/* add_values over a head's features, in ranges of 16 VALUE_CHUNKS, 32 and 16 (so that the chunks
 * in registers are a constant number). */
static ALWAYS_INLINE void add_all_values(const attention_job *job, const char *values, int64_t row_bytes,
                                         const float *probs, int64_t padded, int64_t first, int64_t length,
                                         const int64_t *path, const int count, float *out) {
    const int64_t dim = job->shape.head_dim;
    int64_t d0 = 0;
#define ADD_CHUNKS(chunks) add_values(job, values, row_bytes, probs, padded, first, length, path, count, d0, chunks, out)
    for (; d0 + 16 * VALUE_CHUNKS <= dim; d0 += 16 * VALUE_CHUNKS) ADD_CHUNKS(VALUE_CHUNKS);
    if (VALUE_CHUNKS > 2 && dim - d0 >= 32) {
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
    const slot_map slots = slots_from(job, first, path);
    for (int64_t t = first; t < length; t++) {
        const char *row = values + value_slot(&slots, t) * row_bytes;
        for (int64_t d = dim / 16 * 16; d < dim; d++) {
            const float v = s->kv == KV_F32 ? ((const float *)row)[d] : float_from_half(((const uint16_t *)row)[d]);
            for (int64_t g = 0; g < group; g++) out[g * dim + d] += probs[g * padded + t] * v;
        }
    }
}

/* -- one item ---------------------------------------------------------------------------------- */

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
 * before first (a sliding window's) are not seen, whichever slots hold them. A sink (NULL: none)
 * is one more logit in the softmax, llama.cpp's attention sink: it counts in the largest score and
 * the total, and takes its share of the probability to no value. */
static ALWAYS_INLINE void softmax(float *sg, int64_t first, int64_t length, const int64_t *path, int64_t root,
                                  const float *sink) {
    /* path[j] >= j, and ascending j never overwrites a slot a later j still reads */
    for (int64_t j = first > root ? first - root : 0; path && root + j < length; j++) sg[root + j] = sg[root + path[j]];
    const int64_t first_block = first / 16 * 16, visible_padded = (length + 15) / 16 * 16;
    for (int64_t t = first_block; t < first; t++) sg[t] = -INFINITY;
    for (int64_t t = length; t < visible_padded; t++) sg[t] = -INFINITY;
    /* the largest score, lane by lane over whole blocks (those outside first .. length are -inf
     * now): what a scan in order finds, but 16 at a time */
    part peaks[PARTS];
    for (int i = 0; i < PARTS; i++) peaks[i] = (part){0} - INFINITY;
    for (int64_t t = first_block; t < visible_padded; t += 16) {
        const lanes16 block = load_floats16(sg + t);
        for (int i = 0; i < PARTS; i++) peaks[i] = larger_part(peaks[i], block.p[i]);
    }
    float lanes[16], best = -INFINITY;
    memcpy(lanes, peaks, sizeof lanes);
    for (int l = 0; l < 16; l++) best = lanes[l] > best ? lanes[l] : best;
    if (sink && *sink > best) best = *sink;
    lanes16 total = zero16();
    for (int64_t t = first_block; t < visible_padded; t += 16) {
        lanes16 e = load_floats16(sg + t);
        for (int i = 0; i < PARTS; i++) {
            e.p[i] = exp_part(e.p[i] - best);
            total.p[i] += e.p[i];
        }
        store_floats16(sg + t, e);
    }
    float sum = lane_total16(total);
    if (sink) sum += exp_part((part){0} + (*sink - best))[0]; /* the exp of every score's */
    const float inv_total = 1.0f / sum;
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
 * gets the same bits as the token decoded after exactly those ancestors. scores: the item's
 * [group][padded] scratch. */
void ATTEND(const attention_job *job, int64_t token, int64_t kv_head, float *scores, int64_t *path) {
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
    const float *sinks = job->sinks ? job->sinks + kv_head * group : NULL;
    for (int64_t g = 0; g < group; g++)
        softmax(scores + g * padded, first, length, path, job->tree_start, sinks ? sinks + g : NULL);
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
