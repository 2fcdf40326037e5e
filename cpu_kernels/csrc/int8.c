/* The int8 kernel: weights of up to 8 bits (Q8_0, Q2_K .. Q6_K) times activations quantized to
 * int8 per group, as in ggml's Q8 dot products; on two-level scales (Q4_K, Q5_K, Q6_K, IQ4_XS)
 * per super block, with integer sub-scales, as in ggml's K-quant dot products (int8_two_level);
 * Q2_K's and Q3_K's groups of 16 with their dots as int16 pairs (two_level_pairs).
 *
 * Packed layout (tile, quad q, row r, byte j) = weight (row, column 4q + j): every 4 columns of
 * the tile's 64 rows are 256 contiguous bytes, so a vector holds 4 columns of 16 (AVX-512) or
 * 8 (AVX2) rows and the 4 activations of the quad are one broadcast 32-bit value.
 * Signed times signed products use |w| * (x with w's sign), the form the unsigned-by-signed
 * byte dot product instructions take.
 *
 * Codebook weights (IQ4_NL, IQ4_XS, MXFP4) keep their 4-bit indices: a 256-byte block holds two
 * quads, quad 2o in the low nibbles and 2o + 1 in the high ones, each byte where the int8 layout
 * has the quad's byte. The indices become int8 codes in registers by a byte shuffle against the
 * 16-entry codebook, after which the arithmetic is exactly the int8 layout's.
 */
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "sub_codes.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HAVE_X86 1
#endif

/* Vectorizable (see lut_prepare_token): each block's peak in 16 lanes. A group's sum, which its min
 * multiplies, is the sum of its codes times the step, as ggml's Q8_1 keeps it (d * sum(q)), not the
 * exact sum of x: the whole product is then the weights times the activations as the codes give
 * them, not the codes' share of them times one x and the mins' times another. On the Q4_1 SmolLM2
 * the exact sums left the logits 0.177 from exact on average, these 0.158 (llama.cpp 0.161;
 * python -m benchmarks.kv_accuracy). Two-level types take the code sums themselves. */
TARGET_CLONES void int8_prepare_token(const float *x, int64_t cols, int64_t group, int64_t block, int8_t *codes,
                                      float *scales, float *sums, int32_t *code_sums) {
    for (int64_t b = 0; b < cols / block; b++) {
        const float *xb = x + b * block;
        const float maxabs = lane_peak(xb, block);
        const float inv = maxabs > 0.0f ? 127.0f / maxabs : 0.0f;
        for (int64_t i = 0; i < block; i++) codes[b * block + i] = (int8_t)round_even(xb[i] * inv);
        scales[b] = maxabs / 127.0f;
    }
    for (int64_t g = 0; g < cols / group; g++) {
        int32_t code_sum = 0;
        for (int64_t i = 0; i < group; i++) code_sum += codes[g * group + i];
        sums[g] = scales[g * group / block] * (float)code_sum;
        code_sums[g] = code_sum;
    }
}

static const int8_t CODEBOOKS[CODEBOOK_COUNT][16] = {
    [CODEBOOK_IQ4NL] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    [CODEBOOK_MXFP4] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}, /* E2M1 x 2 */
};

const int8_t *int8_codebook(codebook_t id) {
    return id > CODEBOOK_NONE && id < CODEBOOK_COUNT ? CODEBOOKS[id] : NULL;
}

/* How a tile's codes are stored (packed.py): int8 bytes, codebook indices, or unsigned codes in
 * nibbles (4 bits, or 5-6 with a high plane) or in 2-bit fields (2 bits, or 3 with a high plane). */
enum { CODES_INT8, CODES_CODEBOOK, CODES_NIBBLE, CODES_NIBBLE_HIGH, CODES_TWO_BIT, CODES_TWO_BIT_HIGH };

static inline int code_kind(const packed_matrix *w) {
    if (w->codebook) return CODES_CODEBOOK;
    if (w->width == 8) return CODES_INT8;
    if (w->width < 4) return w->high ? CODES_TWO_BIT_HIGH : CODES_TWO_BIT;
    return w->high ? CODES_NIBBLE_HIGH : CODES_NIBBLE;
}

/* The bits of a kind's code fields (code_field_bits), and the quads a 256-byte block of them holds. */
static inline int kind_field_bits(int kind) {
    return kind == CODES_INT8 ? 8 : kind == CODES_TWO_BIT || kind == CODES_TWO_BIT_HIGH ? 2 : 4;
}
static inline int kind_unsigned(int kind) {
    return kind != CODES_INT8 && kind != CODES_CODEBOOK;
}
static inline int kind_has_high(int kind) {
    return kind == CODES_NIBBLE_HIGH || kind == CODES_TWO_BIT_HIGH;
}

/* Where quad q's 256-byte block starts, and the shift of its field within the block's bytes: a block
 * holds 8 / field quads, so the bit offset q * field splits into the block (its eighth) and the shift.
 * Shifts, not divisions: these run once per quad in the kernels' inner loops. */
static inline const uint8_t *quad_block(const uint8_t *data, int64_t q, int field) {
    return data + ((uint64_t)q * field >> 3) * 4 * TILE_ROWS;
}
static inline int quad_shift(int64_t q, int field) {
    return (int)((uint64_t)q * field & 7);
}

/* The high bits of quad q (h of them, 1 or 2): their 256-byte block, and their shift within its bytes. */
static inline const uint8_t *high_block(const uint8_t *high, int64_t q, int h, int *shift) {
    *shift = (int)((uint64_t)q * h & 7);
    return high + ((uint64_t)q * h >> 3) * 4 * TILE_ROWS;
}

/* Prefetches, once per 256-byte block of codes (at quad q, the first of the block), what the kernel
 * reads PREFETCH_BYTES of codes later: those codes and the high bits of the same columns, a stream of
 * their own (32 h bytes a quad) that the hardware prefetcher alone keeps too few lines of in flight. */
static inline void prefetch_codes(const uint8_t *data, const uint8_t *high, int h, int64_t q, int kind) {
    const int field = kind_field_bits(kind), per_block = 8 / field;
    const uint8_t *codes = quad_block(data, q, field) + PREFETCH_BYTES;
    for (int line = 0; line < 4; line++) __builtin_prefetch(codes + 64 * line);
    if (!kind_has_high(kind)) return;
    /* A block is per_block quads, 32 h per_block bytes of high bits, PREFETCH_BYTES / 256 blocks on. */
    const uint8_t *ahead = high + 32 * h * (q + PREFETCH_BYTES / 256 * per_block);
    for (int line = 0; line < h * per_block / 2; line++) __builtin_prefetch(ahead + 64 * line);
}

/* Prefetches the float16 scales (and mins) of the group a one-level tile reads PREFETCH_BYTES of codes
 * after group g: a stream of 1/8 (Q4_0) to 1/16 (Q8_0) of the codes' bytes beside them. */
static inline void prefetch_group_params(const packed_matrix *w, int64_t tile, int64_t g, int field) {
    const int64_t ahead = PREFETCH_BYTES / (w->group * TILE_ROWS * field / 8);
    const int64_t at = (tile * (w->cols / w->group) + g + ahead) * TILE_ROWS;
    for (int line = 0; line < 2; line++) {
        __builtin_prefetch(w->scales + at + 32 * line);
        if (w->mins) __builtin_prefetch(w->mins + at + 32 * line);
    }
}

/* Where a tile's codes are, and the shape of its groups. */
#define CODE_SETUP                                                            \
    const int64_t groups = w->cols / w->group, quads = w->group / 4;         \
    const int field = code_field_bits(w);                                    \
    const int h = w->width < 8 ? w->width - field : 0;                        \
    const uint8_t *data = w->data + tile * w->cols * TILE_ROWS * field / 8;   \
    const uint8_t *high = h ? w->high + tile * w->cols * h * 8 : NULL;       \
    const int64_t code_stride = a->codes_per_token;                          \
    (void)quads, (void)code_stride;

#define TILE_SETUP                                                            \
    CODE_SETUP                                                               \
    float own_params[2 * TILE_ROWS];                                         \
    const float *scale = own_params, *min = own_params + TILE_ROWS;          \
    const int has_min = params_have_min(w);                                  \
    /* Unsigned codes with mins are centred (packed.py's centre); their mins hold it back. */ \
    const int centre = params_centre(w);                                     \
    const int32_t zero = w->zero + centre;                                   \
    (void)high;                                                              \
    (void)zero;

/* out[c][r] += acc * scale * step (+ min * sum), the epilogue every path shares per group. */
static void scalar_epilogue(const int32_t *acc, const float *scale, const float *min, int has_min,
                            float step, float sum, float *out) {
    for (int r = 0; r < TILE_ROWS; r++) {
        float total = (float)acc[r] * (scale[r] * step);
        if (has_min) total += min[r] * sum;
        out[r] += total;
    }
}

/* The code of row r, column 4q + j. */
static inline int scalar_code(const packed_matrix *w, const uint8_t *data, const uint8_t *high, int h, int64_t q,
                              int r, int j) {
    const int field = code_field_bits(w);
    if (field == 8) return (int8_t)quad_block(data, q, 8)[4 * r + j];
    const int index = (quad_block(data, q, field)[4 * r + j] >> quad_shift(q, field)) & ((1 << field) - 1);
    if (w->codebook) return w->codebook[index];
    int shift = 0, code = index;
    if (h) code |= ((high_block(high, q, h, &shift)[4 * r + j] >> shift) & ((1 << h) - 1)) << field;
    return code - w->zero;
}

static void int8_tile_scalar(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                             int64_t token, int count, const float *params, float *out) {
    TILE_SETUP
    int32_t acc[TILE_ROWS];
    for (int64_t g = 0; g < groups; g++) {
        GROUP_PARAMS(group_params_scalar)
        for (int c = 0; c < count; c++) {
            const int8_t *x = a->codes + (token + c) * code_stride;
            memset(acc, 0, sizeof acc);
            for (int64_t q = g * quads; q < (g + 1) * quads; q++) {
                for (int r = 0; r < TILE_ROWS; r++) {
                    for (int j = 0; j < 4; j++)
                        acc[r] += (scalar_code(w, data, high, h, q, r, j) - centre) * x[4 * q + j];
                }
            }
            scalar_epilogue(acc, scale, min, has_min, a->scales[(token + c) * groups + g],
                            a->sums[(token + c) * groups + g], out + c * TILE_ROWS);
        }
    }
}

/* The two-level kernel (int8_two_level): scalar_code has subtracted the zero code already. */
static void int8_two_level_scalar(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                  int64_t token, int count, float *out) {
    CODE_SETUP
    const int64_t gps = w->sub_gps;
    const int per_group = w->sub_mins ? 2 : 1;
    for (int64_t s = 0; s < groups / gps; s++) {
        int values;
        const uint8_t *codes = super_codes(w, tile, s, &values);
        const uint16_t *supers = super_values(w, tile, s);
        for (int c = 0; c < count; c++) {
            const int8_t *x = a->codes + (token + c) * code_stride;
            int32_t isum[TILE_ROWS] = {0}, imin[TILE_ROWS] = {0};
            for (int64_t gl = 0; gl < gps; gl++) {
                const int64_t g = s * gps + gl;
                for (int r = 0; r < TILE_ROWS; r++) {
                    int32_t dot = 0;
                    for (int64_t q = g * quads; q < (g + 1) * quads; q++) {
                        for (int j = 0; j < 4; j++) dot += scalar_code(w, data, high, h, q, r, j) * x[4 * q + j];
                    }
                    const int v = (int)gl * per_group;
                    isum[r] += dot * (sub_value(w, codes, values, v, r) - w->sub_offset);
                    if (w->sub_mins) imin[r] += sub_value(w, codes, values, v + 1, r) * a->code_sums[(token + c) * groups + g];
                }
            }
            const float step = a->scales[(token + c) * groups + s];
            for (int r = 0; r < TILE_ROWS; r++) {
                float total = out[c * TILE_ROWS + r] + (float)isum[r] * (half_to_float(supers[r]) * step);
                if (w->sub_mins) total -= (float)imin[r] * (half_to_float(supers[TILE_ROWS + r]) * step);
                out[c * TILE_ROWS + r] = total;
            }
        }
    }
}

static void int8_tile_scalar_any(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                 int64_t token, int count, const float *params, float *out) {
    if (int8_two_level(w)) {
        int8_two_level_scalar(w, a, tile, token, count, out);
    } else {
        int8_tile_scalar(w, a, tile, token, count, params, out);
    }
}

#ifdef HAVE_X86

/* Whether the pairs kernels (int8_two_level_pairs_avx2_n and _avx512_n) run a matrix: unsigned 2-bit
 * codes (with or without Q3_K's third bit) in groups of 16, one 256-byte block each, whose dots with
 * int8 activations and zero times their code sums fit int16 (at most 7 * 16 * 127), and sub codes
 * that fit sub_pairs_64 (and, less offset, int16). */
static inline int two_level_pairs(const packed_matrix *w) {
    return int8_two_level(w) && !w->codebook && w->width <= 3 && w->group == 16 && w->sub_bits <= 6 &&
           w->sub_offset <= 64 && w->sub_gps % 2 == 0;
}

/* A 32-bit lane of two int16 halves: the pairs kernels' operand for two groups (or values) at once. */
static inline int32_t int16_pair(int32_t low, int32_t high) {
    return (int32_t)((uint32_t)(uint16_t)low | (uint32_t)high << 16);
}

/* One specialisation per token count and code kind, so both are constants in the inner loops; the
 * two-bit kernels see only the two kinds of 2-bit fields. */
#define DISPATCH_KIND(fn, n)                                                              \
    switch (code_kind(w)) {                                                               \
    case CODES_INT8: fn(w, a, tile, token, n, CODES_INT8, params, out); break;                    \
    case CODES_CODEBOOK: fn(w, a, tile, token, n, CODES_CODEBOOK, params, out); break;            \
    case CODES_NIBBLE: fn(w, a, tile, token, n, CODES_NIBBLE, params, out); break;                \
    case CODES_NIBBLE_HIGH: fn(w, a, tile, token, n, CODES_NIBBLE_HIGH, params, out); break;      \
    case CODES_TWO_BIT: fn(w, a, tile, token, n, CODES_TWO_BIT, params, out); break;              \
    default: fn(w, a, tile, token, n, CODES_TWO_BIT_HIGH, params, out); break;                    \
    }
#define DISPATCH_TWO_BIT_KIND(fn, n)                                                      \
    if (code_kind(w) == CODES_TWO_BIT) fn(w, a, tile, token, n, CODES_TWO_BIT, params, out);      \
    else fn(w, a, tile, token, n, CODES_TWO_BIT_HIGH, params, out);
#define DISPATCH_TOKEN_BLOCK(dispatch, fn)                                                \
    switch (count) {                                                                      \
    case 1: dispatch(fn, 1) break;                                                        \
    case 2: dispatch(fn, 2) break;                                                        \
    case 3: dispatch(fn, 3) break;                                                        \
    default: dispatch(fn, 4) break;                                                       \
    }

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* Field k of a 256-byte block's bytes (its quad k, rows 8v .. 8v+7) as int8 codes: as they are, masked into
 * place and looked up, or with their high bits (quad q's) added. */
AVX2_TARGET __m256i avx2_field(__m256i bytes, const int k, const uint8_t *high, int h, int64_t q, int v, const int kind,
                               __m256i table) {
    const int field = kind_field_bits(kind);
    if (kind == CODES_INT8) return bytes;
    __m256i code = _mm256_and_si256(_mm256_srli_epi16(bytes, field * k), _mm256_set1_epi8((char)((1 << field) - 1)));
    if (kind == CODES_CODEBOOK) return _mm256_shuffle_epi8(table, code);
    if (kind_has_high(kind)) {
        int shift;
        __m256i top = _mm256_loadu_si256((const __m256i *)(high_block(high, q, h, &shift) + 32 * v));
        top = _mm256_and_si256(_mm256_srl_epi16(top, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)((1 << h) - 1)));
        code = _mm256_or_si256(code, _mm256_slli_epi16(top, field));
    }
    return code; /* unsigned: the kernel subtracts zero times the activations' code sum */
}

/* acc[c][v] = rows 8v .. 8v+7 of group g times token c's codes: unsigned codes as they are, signed ones
 * as |w| times x with w's sign. A group is whole 256-byte blocks (matmul_problem), each loaded once and
 * split by constant shifts. Unsigned codes (below 64) times int8 activations make maddubs pairs of at
 * most 2 * 63 * 127, so a 4-bit block's two quads add up in int16 before the one vpmaddwd; a signed
 * pair can reach 2 * 127 * 127 and takes its own. */
AVX2_TARGET void avx2_group_dots(const packed_matrix *w, const prepared_acts *a, const uint8_t *data,
                                 const uint8_t *high, int h, int64_t g, int64_t token, const int count,
                                 const int kind, __m256i table, __m256i acc[MAX_TOKEN_BLOCK][8]) {
    const int field = kind_field_bits(kind), per_block = 8 / field;
    const int64_t quads = w->group / 4, code_stride = a->codes_per_token;
    const int unsigned_codes = kind_unsigned(kind), paired = unsigned_codes && per_block == 2;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int c = 0; c < count; c++) {
        for (int v = 0; v < 8; v++) acc[c][v] = _mm256_setzero_si256();
    }
    for (int64_t q = g * quads; q < (g + 1) * quads; q += per_block) {
        __m256i x[MAX_TOKEN_BLOCK][4];
        for (int c = 0; c < count; c++) {
            for (int k = 0; k < per_block; k++) {
                int32_t four;
                memcpy(&four, a->codes + (token + c) * code_stride + 4 * (q + k), 4);
                x[c][k] = _mm256_set1_epi32(four);
            }
        }
        prefetch_codes(data, high, h, q, kind);
        const uint8_t *block = quad_block(data, q, field);
        for (int v = 0; v < 8; v++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 32 * v));
            if (paired) {
                const __m256i low = avx2_field(bytes, 0, high, h, q, v, kind, table);
                const __m256i top = avx2_field(bytes, 1, high, h, q + 1, v, kind, table);
                for (int c = 0; c < count; c++) {
                    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, x[c][0]), _mm256_maddubs_epi16(top, x[c][1]));
                    acc[c][v] = _mm256_add_epi32(acc[c][v], _mm256_madd_epi16(pairs, ones));
                }
                continue;
            }
            for (int k = 0; k < per_block; k++) {
                const __m256i wv = avx2_field(bytes, k, high, h, q + k, v, kind, table);
                const __m256i magnitude = unsigned_codes ? wv : _mm256_sign_epi8(wv, wv);
                for (int c = 0; c < count; c++) {
                    __m256i pairs = _mm256_maddubs_epi16(magnitude, unsigned_codes ? x[c][k] : _mm256_sign_epi8(x[c][k], wv));
                    acc[c][v] = _mm256_add_epi32(acc[c][v], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
    }
}

/* One-level group g's scales, then its mins: as one_level_params_avx512, 8 rows to a register. */
AVX2_TARGET const float *one_level_params_avx2(const packed_matrix *w, int64_t tile, int64_t g, const float *params,
                                               int has_min, int centre, float own[2 * TILE_ROWS]) {
    if (params) return params + g * 2 * TILE_ROWS;
    const int64_t at = (tile * (w->cols / w->group) + g) * TILE_ROWS;
    for (int v = 0; v < 8; v++) {
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->scales + at + 8 * v)));
        _mm256_storeu_ps(own + 8 * v, scale);
        if (!has_min) continue;
        __m256 min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->mins + at + 8 * v)));
        if (centre) min = _mm256_add_ps(min, _mm256_mul_ps(scale, _mm256_set1_ps((float)centre)));
        _mm256_storeu_ps(own + TILE_ROWS + 8 * v, min);
    }
    return own;
}

AVX2_TARGET void int8_tile_avx2_n(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                  int64_t token, const int count, const int kind, const float *params,
                                  float *out) {
    CODE_SETUP
    const int has_min = params_have_min(w), centre = params_centre(w);
    const int32_t zero = w->zero + centre;
    const int unsigned_codes = kind_unsigned(kind);
    const __m256i table = kind == CODES_CODEBOOK ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w->codebook))
                                                 : _mm256_setzero_si256();
    float own_params[2 * TILE_ROWS];
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[MAX_TOKEN_BLOCK][8]; /* acc[c][v]: rows 8v .. 8v+7 */
        avx2_group_dots(w, a, data, high, h, g, token, count, kind, table, acc);
        if (!params) prefetch_group_params(w, tile, g, field);
        const float *scale = one_level_params_avx2(w, tile, g, params, has_min, centre, own_params);
        const float *min = scale + TILE_ROWS;
        for (int c = 0; c < count; c++) {
            __m256 step = _mm256_set1_ps(a->scales[(token + c) * groups + g]);
            __m256 sum = _mm256_set1_ps(a->sums[(token + c) * groups + g]);
            if (unsigned_codes && zero) {
                __m256i zero_sum = _mm256_set1_epi32(zero * a->code_sums[(token + c) * groups + g]);
                for (int v = 0; v < 8; v++) acc[c][v] = _mm256_sub_epi32(acc[c][v], zero_sum);
            }
            for (int v = 0; v < 8; v++) {
                float *dst = out + c * TILE_ROWS + 8 * v;
                __m256 total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[c][v]),
                                               _mm256_mul_ps(_mm256_loadu_ps(scale + 8 * v), step), _mm256_loadu_ps(dst));
                if (has_min) total = _mm256_fmadd_ps(_mm256_loadu_ps(min + 8 * v), sum, total);
                _mm256_storeu_ps(dst, total);
            }
        }
    }
}

/* out[c] rows 8v .. 8v+7 += super block s's integer sums times d (less the mins' times dmin) and token
 * c's step. */
AVX2_TARGET void two_level_store_avx2(const packed_matrix *w, const prepared_acts *a, const uint16_t *supers,
                                      int64_t s, int64_t token, int c, int v, __m256i isum, __m256i imin,
                                      float *out) {
    const __m256 step = _mm256_set1_ps(a->scales[(token + c) * (w->cols / w->group) + s]);
    float *dst = out + c * TILE_ROWS + 8 * v;
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(supers + 8 * v)));
    __m256 total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, step), _mm256_loadu_ps(dst));
    if (w->sub_mins) {
        __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(supers + TILE_ROWS + 8 * v)));
        total = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(dmin, step), total);
    }
    _mm256_storeu_ps(dst, total);
}

AVX2_TARGET void int8_two_level_avx2_n(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                       int64_t token, const int count, const int kind, const float *params,
                                       float *out) {
    CODE_SETUP
    (void)params;
    const int unsigned_codes = kind_unsigned(kind);
    const int64_t gps = w->sub_gps;
    const __m256i table = kind == CODES_CODEBOOK ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w->codebook))
                                                 : _mm256_setzero_si256();
    const int per_group = w->sub_mins ? 2 : 1;
    const __m256i offset = _mm256_set1_epi32(w->sub_offset);
    for (int64_t s = 0; s < groups / gps; s++) {
        int values;
        const uint8_t *codes = super_codes(w, tile, s, &values);
        prefetch_next_super(w, tile, s);
        __m256i isum[MAX_TOKEN_BLOCK][8], imin[MAX_TOKEN_BLOCK][8];
        for (int c = 0; c < count; c++) {
            for (int v = 0; v < 8; v++) isum[c][v] = imin[c][v] = _mm256_setzero_si256();
        }
        for (int64_t gl = 0; gl < gps; gl++) {
            const int64_t g = s * gps + gl;
            __m256i acc[MAX_TOKEN_BLOCK][8];
            avx2_group_dots(w, a, data, high, h, g, token, count, kind, table, acc);
            for (int c = 0; c < count; c++) {
                const int32_t code_sum = a->code_sums[(token + c) * groups + g];
                const __m256i zero_sum = _mm256_set1_epi32(w->zero * code_sum), sums = _mm256_set1_epi32(code_sum);
                for (int v = 0; v < 8; v++) {
                    __m256i dot = unsigned_codes ? _mm256_sub_epi32(acc[c][v], zero_sum) : acc[c][v];
                    __m256i scale = _mm256_sub_epi32(sub_lanes_8(w, codes, values, (int)gl * per_group, v), offset);
                    isum[c][v] = _mm256_add_epi32(isum[c][v], _mm256_mullo_epi32(dot, scale));
                    if (w->sub_mins) {
                        __m256i m = sub_lanes_8(w, codes, values, (int)gl * per_group + 1, v);
                        imin[c][v] = _mm256_add_epi32(imin[c][v], _mm256_mullo_epi32(m, sums));
                    }
                }
            }
        }
        const uint16_t *supers = super_values(w, tile, s);
        for (int c = 0; c < count; c++) {
            for (int v = 0; v < 8; v++) two_level_store_avx2(w, a, supers, s, token, c, v, isum[c][v], imin[c][v], out);
        }
    }
}

/* The pairs kernel (two_level_pairs) on AVX2: maddubs's int16 pair sums of a group's four quads add
 * up in int16 (at most 4 * 2 * 7 * 127), so one vpmaddwd by the row's sub-scale in both halves makes
 * the group's scaled dot; Q3_K's zero share comes off the low halves first. Rows 8v .. 8v+7 go
 * through the whole super block at a time, so the sums of one v are all the registers hold. */
AVX2_TARGET void int8_two_level_pairs_avx2_n(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                             int64_t token, const int count, const int kind, const float *params,
                                             float *out) {
    CODE_SETUP
    (void)params;
    const int64_t gps = w->sub_gps;
    const int per_group = w->sub_mins ? 2 : 1;
    const __m256i offset = _mm256_set1_epi32(w->sub_offset);
    for (int64_t s = 0; s < groups / gps; s++) {
        int values;
        const uint8_t *codes = super_codes(w, tile, s, &values);
        prefetch_next_super(w, tile, s);
        const uint16_t *supers = super_values(w, tile, s);
        for (int v = 0; v < 8; v++) {
            __m256i isum[MAX_TOKEN_BLOCK], imin[MAX_TOKEN_BLOCK];
            for (int c = 0; c < count; c++) isum[c] = imin[c] = _mm256_setzero_si256();
            for (int64_t gl = 0; gl < gps; gl += 2) {
                const int64_t g = s * gps + gl;
                if (v == 0) {
                    prefetch_codes(data, high, 1, 4 * g, kind);
                    prefetch_codes(data, high, 1, 4 * g + 4, kind);
                }
                const __m256i third = kind_has_high(kind)
                    ? _mm256_loadu_si256((const __m256i *)(high + g / 2 * 4 * TILE_ROWS + 32 * v)) : _mm256_setzero_si256();
                for (int half = 0; half < 2; half++) {
                    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(data + (g + half) * 4 * TILE_ROWS + 32 * v));
                    __m256i pairs[MAX_TOKEN_BLOCK];
                    for (int c = 0; c < count; c++) pairs[c] = _mm256_setzero_si256();
                    for (int k = 0; k < 4; k++) {
                        __m256i code = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * k), _mm256_set1_epi8(3));
                        if (kind_has_high(kind)) {
                            const int bit = 4 * half + k; /* to bit 2 of each byte */
                            __m256i top = bit >= 2 ? _mm256_srli_epi16(third, bit - 2) : _mm256_slli_epi16(third, 2 - bit);
                            code = _mm256_or_si256(code, _mm256_and_si256(top, _mm256_set1_epi8(4)));
                        }
                        for (int c = 0; c < count; c++) {
                            int32_t four;
                            memcpy(&four, a->codes + (token + c) * code_stride + 4 * (4 * (g + half) + k), 4);
                            pairs[c] = _mm256_add_epi16(pairs[c], _mm256_maddubs_epi16(code, _mm256_set1_epi32(four)));
                        }
                    }
                    const __m256i scale = _mm256_sub_epi32(sub_lanes_8(w, codes, values, (int)(gl + half) * per_group, v), offset);
                    const __m256i both = _mm256_blend_epi16(scale, _mm256_slli_epi32(scale, 16), 0xAA);
                    for (int c = 0; c < count; c++) {
                        const int32_t zero_share = w->zero * a->code_sums[(token + c) * groups + g + half];
                        const __m256i dot = _mm256_sub_epi16(pairs[c], _mm256_set1_epi32(int16_pair(zero_share, 0)));
                        isum[c] = _mm256_add_epi32(isum[c], _mm256_madd_epi16(dot, both));
                    }
                }
                if (w->sub_mins) {
                    const __m256i mins = _mm256_or_si256(sub_lanes_8(w, codes, values, (int)gl * 2 + 1, v),
                                                         _mm256_slli_epi32(sub_lanes_8(w, codes, values, (int)gl * 2 + 3, v), 16));
                    for (int c = 0; c < count; c++) {
                        const int32_t *sums = a->code_sums + (token + c) * groups + g;
                        imin[c] = _mm256_add_epi32(imin[c], _mm256_madd_epi16(mins, _mm256_set1_epi32(int16_pair(sums[0], sums[1]))));
                    }
                }
            }
            for (int c = 0; c < count; c++) two_level_store_avx2(w, a, supers, s, token, c, v, isum[c], imin[c], out);
        }
    }
}

__attribute__((target("avx2,fma,f16c"))) static void int8_tile_avx2(
    const packed_matrix *w, const prepared_acts *a, int64_t tile, int64_t token, int count,
    const float *params, float *out) {
    if (two_level_pairs(w)) {
        DISPATCH_TOKEN_BLOCK(DISPATCH_TWO_BIT_KIND, int8_two_level_pairs_avx2_n)
    } else if (int8_two_level(w)) {
        DISPATCH_TOKEN_BLOCK(DISPATCH_KIND, int8_two_level_avx2_n)
    } else {
        DISPATCH_TOKEN_BLOCK(DISPATCH_KIND, int8_tile_avx2_n)
    }
}

#define AVX512_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"), always_inline)) static inline

/* On AVX-512 every kind's codes are unsigned in registers: int8 codes and codebook entries get 128
 * added (their sign bit flipped), which vpdpbusd multiplies by the int8 activations without the
 * saturation AVX2's maddubs would hit, and the kernels subtract 128 times the activations' code
 * sum as they subtract a nibble type's zero code. The same integer dot, with one instruction where
 * |w| times x with w's sign took three. This is the code each kind's kernels subtract. */
static inline int32_t avx512_zero(const packed_matrix *w, int kind) {
    return kind_unsigned(kind) ? w->zero : 128;
}

/* Codebook kinds' 16 entries plus 128 in each 128-bit lane (avx512_zero), for avx512_field's lookup. */
AVX512_TARGET __m512i avx512_table(const packed_matrix *w, int kind) {
    if (kind != CODES_CODEBOOK) return _mm512_setzero_si512();
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)w->codebook)), _mm512_set1_epi8((char)0x80));
}

/* Field k of a 256-byte block's bytes (its quad k, rows 16v .. 16v+15) as unsigned codes (avx512_zero):
 * as they are, masked into place and looked up, or with their high bits (quad q's) added. */
AVX512_TARGET __m512i avx512_field(__m512i bytes, const int k, const uint8_t *high, int h, int64_t q, int v,
                                   const int kind, __m512i table) {
    const int field = kind_field_bits(kind);
    if (kind == CODES_INT8) return _mm512_xor_si512(bytes, _mm512_set1_epi8((char)0x80));
    __m512i code = _mm512_and_si512(_mm512_srli_epi16(bytes, field * k), _mm512_set1_epi8((char)((1 << field) - 1)));
    if (kind == CODES_CODEBOOK) return _mm512_shuffle_epi8(table, code);
    if (kind_has_high(kind)) {
        int shift;
        __m512i top = _mm512_loadu_si512((const void *)(high_block(high, q, h, &shift) + 64 * v));
        top = _mm512_and_si512(_mm512_srl_epi16(top, _mm_cvtsi32_si128(shift)), _mm512_set1_epi8((char)((1 << h) - 1)));
        code = _mm512_or_si512(code, _mm512_slli_epi16(top, field));
    }
    return code;
}

/* acc[c][v] = rows 16v .. 16v+15 of group g, as unsigned codes (avx512_field) less `zero`, times token c's
 * codes: the sums start at -zero times the token's code sum, which costs no instruction of its own. A
 * group is whole 256-byte blocks of 8 / field quads (matmul_problem), each block loaded once and its
 * quads' fields taken apart by constant shifts. */
AVX512_TARGET void avx512_group_dots(const packed_matrix *w, const prepared_acts *a, const uint8_t *data,
                                     const uint8_t *high, int h, int64_t g, int64_t token, const int count,
                                     const int kind, __m512i table, int32_t zero, __m512i acc[MAX_TOKEN_BLOCK][4]) {
    const int field = kind_field_bits(kind), per_block = 8 / field;
    const int64_t quads = w->group / 4, code_stride = a->codes_per_token, groups = w->cols / w->group;
    for (int c = 0; c < count; c++) {
        for (int v = 0; v < 4; v++) acc[c][v] = _mm512_set1_epi32(-zero * a->code_sums[(token + c) * groups + g]);
    }
    for (int64_t q = g * quads; q < (g + 1) * quads; q += per_block) {
        __m512i x[MAX_TOKEN_BLOCK][4];
        for (int c = 0; c < count; c++) {
            for (int k = 0; k < per_block; k++) {
                int32_t four;
                memcpy(&four, a->codes + (token + c) * code_stride + 4 * (q + k), 4);
                x[c][k] = _mm512_set1_epi32(four);
            }
        }
        prefetch_codes(data, high, h, q, kind);
        const uint8_t *block = quad_block(data, q, field);
        for (int v = 0; v < 4; v++) {
            const __m512i bytes = _mm512_loadu_si512((const void *)(block + 64 * v));
            for (int k = 0; k < per_block; k++) {
                const __m512i wv = avx512_field(bytes, k, high, h, q + k, v, kind, table);
                for (int c = 0; c < count; c++) acc[c][v] = _mm512_dpbusd_epi32(acc[c][v], wv, x[c][k]);
            }
        }
    }
}

/* One-level group g's scales, then its mins (finish_mins' centre included, params.c): the tile's decoded
 * params when given, else the float16 ones decoded into `own` as group_params_avx512 would, without its
 * call, which cost a fifth of a 4-bit type's decode. */
AVX512_TARGET const float *one_level_params_avx512(const packed_matrix *w, int64_t tile, int64_t g, const float *params,
                                                   int has_min, int centre, float own[2 * TILE_ROWS]) {
    if (params) return params + g * 2 * TILE_ROWS;
    const int64_t at = (tile * (w->cols / w->group) + g) * TILE_ROWS;
    for (int v = 0; v < 4; v++) {
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + at + 16 * v)));
        _mm512_storeu_ps(own + 16 * v, scale);
        if (!has_min) continue;
        __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + at + 16 * v)));
        if (centre) min = _mm512_add_ps(min, _mm512_mul_ps(scale, _mm512_set1_ps((float)centre)));
        _mm512_storeu_ps(own + TILE_ROWS + 16 * v, min);
    }
    return own;
}

/* Token blocks up to this many keep the rows' sums over groups in registers; larger ones keep them in
 * memory, since 4 tokens' sums and dots together need more than the 32 vector registers. */
#define SUMS_IN_REGISTERS 2

AVX512_TARGET void int8_tile_avx512_n(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                      int64_t token, const int count, const int kind, const float *params,
                                      float *out) {
    CODE_SETUP
    const int has_min = params_have_min(w), centre = params_centre(w);
    const int32_t code_zero = avx512_zero(w, kind) + centre;
    const __m512i table = avx512_table(w, kind);
    float own_params[2 * TILE_ROWS];
    float total[MAX_TOKEN_BLOCK][TILE_ROWS]; /* the rows' sums over the groups so far */
    memcpy(total, out, sizeof(float) * TILE_ROWS * count);
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[MAX_TOKEN_BLOCK][4]; /* acc[c][v]: rows 16v .. 16v+15 */
        avx512_group_dots(w, a, data, high, h, g, token, count, kind, table, code_zero, acc);
        if (!params) prefetch_group_params(w, tile, g, field);
        const float *scale = one_level_params_avx512(w, tile, g, params, has_min, centre, own_params);
        const float *min = scale + TILE_ROWS;
        for (int c = 0; c < count; c++) {
            __m512 step = _mm512_set1_ps(a->scales[(token + c) * groups + g]);
            __m512 sum = _mm512_set1_ps(a->sums[(token + c) * groups + g]);
            for (int v = 0; v < 4; v++) {
                __m512 row = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[c][v]),
                                             _mm512_mul_ps(_mm512_loadu_ps(scale + 16 * v), step), _mm512_loadu_ps(total[c] + 16 * v));
                if (has_min) row = _mm512_fmadd_ps(_mm512_loadu_ps(min + 16 * v), sum, row);
                _mm512_storeu_ps(total[c] + 16 * v, row);
            }
        }
        /* Left to itself, the compiler holds the sums in registers and spills the dots' sums instead. */
        if (count > SUMS_IN_REGISTERS) __asm__ volatile("" : "+m"(total));
    }
    memcpy(out, total, sizeof(float) * TILE_ROWS * count);
}

/* imin[c][v] += each row's min codes of groups gl and gl + 1 times token c's code sums of the two. */
AVX512_TARGET void two_level_mins_avx512(const packed_matrix *w, const prepared_acts *a, const uint8_t *codes,
                                         int values, int64_t g, int64_t gl, int64_t token, const int count,
                                         __m512i imin[MAX_TOKEN_BLOCK][4]) {
    const int64_t groups = w->cols / w->group;
    __m512i mins[4];
    sub_pairs_64(w, codes, values, (int)gl * 2 + 1, 2, 0, mins);
    for (int c = 0; c < count; c++) {
        const int32_t *sums = a->code_sums + (token + c) * groups + g; /* a code sum, at most group * 127, fits int16 */
        const __m512i sum_pair = _mm512_set1_epi32(int16_pair(sums[0], sums[1]));
        for (int v = 0; v < 4; v++) imin[c][v] = _mm512_dpwssd_epi32(imin[c][v], mins[v], sum_pair);
    }
}

/* out += super block s's integer sums times d (less the mins' times dmin) and the activations' steps. */
AVX512_TARGET void two_level_store_avx512(const packed_matrix *w, const prepared_acts *a, int64_t tile, int64_t s,
                                          int64_t token, const int count, __m512i isum[MAX_TOKEN_BLOCK][4],
                                          __m512i imin[MAX_TOKEN_BLOCK][4], float *out) {
    const int64_t groups = w->cols / w->group;
    const uint16_t *supers = super_values(w, tile, s);
    for (int c = 0; c < count; c++) {
        const __m512 step = _mm512_set1_ps(a->scales[(token + c) * groups + s]);
        for (int v = 0; v < 4; v++) {
            float *dst = out + c * TILE_ROWS + 16 * v;
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(supers + 16 * v)));
            __m512 total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[c][v]), _mm512_mul_ps(d, step), _mm512_loadu_ps(dst));
            if (w->sub_mins) {
                __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(supers + TILE_ROWS + 16 * v)));
                total = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin[c][v]), _mm512_mul_ps(dmin, step), total);
            }
            _mm512_storeu_ps(dst, total);
        }
    }
}

AVX512_TARGET void int8_two_level_avx512_n(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                           int64_t token, const int count, const int kind, const float *params,
                                           float *out) {
    CODE_SETUP
    (void)params;
    const int32_t code_zero = avx512_zero(w, kind);
    const int64_t gps = w->sub_gps;
    const __m512i table = avx512_table(w, kind);
    const int per_group = w->sub_mins ? 2 : 1;
    const __m512i offset = _mm512_set1_epi32(w->sub_offset);
    for (int64_t s = 0; s < groups / gps; s++) {
        int values;
        const uint8_t *codes = super_codes(w, tile, s, &values);
        prefetch_next_super(w, tile, s);
        __m512i isum[MAX_TOKEN_BLOCK][4], imin[MAX_TOKEN_BLOCK][4];
        for (int c = 0; c < count; c++) {
            for (int v = 0; v < 4; v++) isum[c][v] = imin[c][v] = _mm512_setzero_si512();
        }
        for (int64_t gl = 0; gl < gps; gl++) {
            const int64_t g = s * gps + gl;
            __m512i acc[MAX_TOKEN_BLOCK][4];
            avx512_group_dots(w, a, data, high, h, g, token, count, kind, table, code_zero, acc);
            /* The group's sub-scales, rows 16v .. 16v+15 as int32 lanes. */
            const __m512i scale_bytes = sub_bytes_64(w, codes, values, (int)gl * per_group);
            __m512i scale[4];
            for (int v = 0; v < 4; v++)
                scale[v] = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(scale_bytes, v)), offset);
            for (int c = 0; c < count; c++) {
                for (int v = 0; v < 4; v++) isum[c][v] = _mm512_add_epi32(isum[c][v], _mm512_mullo_epi32(acc[c][v], scale[v]));
            }
        }
        for (int64_t gl = 0; w->sub_mins && gl < gps; gl += 2)
            two_level_mins_avx512(w, a, codes, values, s * gps + gl, gl, token, count, imin);
        two_level_store_avx512(w, a, tile, s, token, count, isum, imin, out);
    }
}

/* acc[i][c][v] = rows 16v .. 16v+15 of group g + i (even g) times token c's codes. A group is one
 * 256-byte block of 2-bit fields, its quad k at shift 2k; the two groups' third bits (Q3_K) share a
 * block of high bits, quad k's bit k in group g and bit 4 + k in group g + 1, added by a bit test and
 * a masked add. Every loop bound and shift is a constant, so the compiler unrolls the lot. */
AVX512_TARGET void two_bit_pair_dots(const prepared_acts *a, const uint8_t *data,
                                     const uint8_t *high, int64_t g, int64_t token, const int count,
                                     const int kind, __m512i acc[2][MAX_TOKEN_BLOCK][4]) {
    const uint8_t *codes = data + g * 4 * TILE_ROWS, *top = high ? high + g / 2 * 4 * TILE_ROWS : NULL;
    __m512i x[MAX_TOKEN_BLOCK][8];
    for (int c = 0; c < count; c++) {
        for (int k = 0; k < 8; k++) {
            int32_t four;
            memcpy(&four, a->codes + (token + c) * a->codes_per_token + 4 * (4 * g + k), 4);
            x[c][k] = _mm512_set1_epi32(four);
        }
    }
    prefetch_codes(data, high, 1, 4 * g, kind);
    prefetch_codes(data, high, 1, 4 * g + 4, kind);
    for (int v = 0; v < 4; v++) {
        const __m512i third = kind_has_high(kind) ? _mm512_loadu_si512((const void *)(top + 64 * v)) : _mm512_setzero_si512();
        for (int half = 0; half < 2; half++) {
            const __m512i bytes = _mm512_loadu_si512((const void *)(codes + half * 4 * TILE_ROWS + 64 * v));
            for (int c = 0; c < count; c++) acc[half][c][v] = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                __m512i code = _mm512_and_si512(_mm512_srli_epi16(bytes, 2 * k), _mm512_set1_epi8(3));
                if (kind_has_high(kind))
                    code = _mm512_mask_add_epi8(code, _mm512_test_epi8_mask(third, _mm512_set1_epi8((char)(1 << (4 * half + k)))),
                                                code, _mm512_set1_epi8(4));
                for (int c = 0; c < count; c++) acc[half][c][v] = _mm512_dpbusd_epi32(acc[half][c][v], code, x[c][4 * half + k]);
            }
        }
    }
}

/* The two-level kernel for 2- and 3-bit codes in groups of 16 (Q2_K, Q3_K), where the general one is
 * compute-bound on its per-group work: two groups' dots go into one register as int16 pairs, and one
 * vpdpwssd multiplies both by their sub-scales and adds them to the row sums (the general kernel's
 * mullo and add per group); the zero codes' share comes off the same way, the scales times zero times
 * the code sums. */
AVX512_TARGET void int8_two_level_pairs_avx512_n(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                                 int64_t token, const int count, const int kind, const float *params,
                                                 float *out) {
    CODE_SETUP
    (void)params;
    const int64_t gps = w->sub_gps;
    const int per_group = w->sub_mins ? 2 : 1;
    for (int64_t s = 0; s < groups / gps; s++) {
        int values;
        const uint8_t *codes = super_codes(w, tile, s, &values);
        prefetch_next_super(w, tile, s);
        __m512i isum[MAX_TOKEN_BLOCK][4], imin[MAX_TOKEN_BLOCK][4];
        for (int c = 0; c < count; c++) {
            for (int v = 0; v < 4; v++) isum[c][v] = imin[c][v] = _mm512_setzero_si512();
        }
        for (int64_t gl = 0; gl < gps; gl += 2) {
            const int64_t g = s * gps + gl;
            __m512i dots[2][MAX_TOKEN_BLOCK][4], scale[4];
            two_bit_pair_dots(a, data, high, g, token, count, kind, dots);
            sub_pairs_64(w, codes, values, (int)gl * per_group, per_group, w->sub_offset, scale);
            for (int c = 0; c < count; c++) {
                const int32_t *sums = a->code_sums + (token + c) * groups + g;
                const __m512i zero_pair = _mm512_set1_epi32(int16_pair(-w->zero * sums[0], -w->zero * sums[1]));
                for (int v = 0; v < 4; v++) {
                    const __m512i both = _mm512_mask_mov_epi16(dots[0][c][v], 0xAAAAAAAA, _mm512_slli_epi32(dots[1][c][v], 16));
                    isum[c][v] = _mm512_dpwssd_epi32(isum[c][v], both, scale[v]);
                    if (w->zero) isum[c][v] = _mm512_dpwssd_epi32(isum[c][v], zero_pair, scale[v]);
                }
            }
            if (w->sub_mins) two_level_mins_avx512(w, a, codes, values, g, gl, token, count, imin);
        }
        two_level_store_avx512(w, a, tile, s, token, count, isum, imin, out);
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"))) static void
int8_tile_avx512(const packed_matrix *w, const prepared_acts *a, int64_t tile, int64_t token,
                 int count, const float *params, float *out) {
    if (two_level_pairs(w)) {
        DISPATCH_TOKEN_BLOCK(DISPATCH_TWO_BIT_KIND, int8_two_level_pairs_avx512_n)
    } else if (int8_two_level(w)) {
        DISPATCH_TOKEN_BLOCK(DISPATCH_KIND, int8_two_level_avx512_n)
    } else {
        DISPATCH_TOKEN_BLOCK(DISPATCH_KIND, int8_tile_avx512_n)
    }
}

#endif /* HAVE_X86 */

tile_kernel int8_tile_kernel(isa_t isa) {
#ifdef HAVE_X86
    if (isa == ISA_AVX512) return int8_tile_avx512;
    if (isa == ISA_AVX2) return int8_tile_avx2;
#endif
    (void)isa;
    return int8_tile_scalar_any;
}
