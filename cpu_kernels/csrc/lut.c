/* The LUT kernel (T-MAC's method): weights of 1..4 bits as bit planes, activations as tables.
 *
 * For every 4 consecutive activations x[4t .. 4t+3], a table holds the 16 partial sums
 * T[i] = sum of x[4t + j] over the bits j set in i (centred, see centred_entries), quantized to
 * int8 with one step per group.
 * A weight row's bit plane p over those 4 columns is a 4-bit index into that table, so one byte
 * shuffle performs 16 (SSE lane) table look-ups at once, and a product with b-bit weights costs
 * b look-ups per 4 weights: time linear in the number of bits.
 *
 * Packed byte (tile, octet o, plane p, row r): the low nibble holds plane p of the row's weights
 * in columns 8o .. 8o+3 (bit j = column 8o+j), the high nibble columns 8o+4 .. 8o+7. The two
 * look-ups of a byte use tables 2o and 2o+1; interleaving their results per row lets one
 * multiply-add (maddubs) weight them by 2^p and sum them into an int16 per row.
 */
#include <math.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HAVE_X86 1
#endif

int64_t lut_max_group(int bits) {
    /* (Also bounded by LUT_MAX_TABLES * 4, the prepare step's scratch.) */
    /* Per group each row's int16 accumulates (group / 8) octets * 254 * (2^bits - 1). */
    int64_t per_octet = 254 * ((1 << bits) - 1);
    return 8 * (32767 / per_octet);
}

/* SIGN[j][i] = (bit j of i) - 1/2: entry i of a table is the sum over j of SIGN[j][i] * x[j].
 * Centring (the -1/2) halves the range of tables whose activations share a sign, and so the
 * quantization step; the kernels add the half-sums back through each row's mid-range value. */
static const float SIGN[4][16] = {
    {-.5f, .5f, -.5f, .5f, -.5f, .5f, -.5f, .5f, -.5f, .5f, -.5f, .5f, -.5f, .5f, -.5f, .5f},
    {-.5f, -.5f, .5f, .5f, -.5f, -.5f, .5f, .5f, -.5f, -.5f, .5f, .5f, -.5f, -.5f, .5f, .5f},
    {-.5f, -.5f, -.5f, -.5f, .5f, .5f, .5f, .5f, -.5f, -.5f, -.5f, -.5f, .5f, .5f, .5f, .5f},
    {-.5f, -.5f, -.5f, -.5f, -.5f, -.5f, -.5f, -.5f, .5f, .5f, .5f, .5f, .5f, .5f, .5f, .5f},
};

/* Written for the auto-vectorizer (16 entries are one AVX-512 vector) and compiled once per ISA:
 * every product by +-1/2 is exact and the additions run in a fixed order, so each clone gives
 * the same bits, and reference.py reproduces them. */
TARGET_CLONES void lut_prepare_token(const float *x, int64_t cols, int64_t group, int8_t *tables,
                                     float *scales, float *sums) {
    float entries[LUT_MAX_TABLES][16], peak[16];
    for (int64_t g = 0; g < cols / group; g++) {
        const float *xg = x + g * group;
        const int64_t count = group / 4;
        const float sum = lane_sum(xg, group);
        for (int i = 0; i < 16; i++) peak[i] = 0.0f;
        for (int64_t t = 0; t < count; t++) {
            const float *x4 = xg + 4 * t;
            for (int i = 0; i < 16; i++) {
                float e = ((x4[0] * SIGN[0][i] + x4[1] * SIGN[1][i]) + x4[2] * SIGN[2][i]) + x4[3] * SIGN[3][i];
                float magnitude = e < 0.0f ? -e : e;
                entries[t][i] = e;
                peak[i] = magnitude > peak[i] ? magnitude : peak[i];
            }
        }
        float maxabs = 0.0f;
        for (int i = 0; i < 16; i++) maxabs = peak[i] > maxabs ? peak[i] : maxabs;
        float inv = maxabs > 0.0f ? 127.0f / maxabs : 0.0f;
        int8_t *out = tables + g * count * 16;
        for (int64_t t = 0; t < count; t++) {
            for (int i = 0; i < 16; i++) out[t * 16 + i] = (int8_t)round_even(entries[t][i] * inv);
        }
        scales[g] = maxabs / 127.0f;
        sums[g] = sum;
    }
}

/* Pointers into a packed matrix of `bits` planes and the prepared activations for one tile. */
#define TILE_SETUP                                                                 \
    const int64_t groups = w->cols / w->group, octets = w->group / 8;             \
    const uint8_t *planes = w->data + tile * (w->cols / 8) * bits * TILE_ROWS;    \
    float own_params[2 * TILE_ROWS];                                              \
    const int64_t table_stride = a->codes_per_token;                              \
    const float half_range = 0.5f * (float)((1 << bits) - 1); /* centre of the codes */

/* The row scales and mins GROUP_PARAMS points at. */
#define PARAM_POINTERS const float *scale = own_params, *min = own_params + TILE_ROWS;

static void lut_tile_scalar(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                            int64_t token, int count, const float *params, float *out) {
    const int bits = w->bits;
    TILE_SETUP
    PARAM_POINTERS
    for (int64_t g = 0; g < groups; g++) {
        GROUP_PARAMS(group_params_scalar)
        for (int c = 0; c < count; c++) {
            const int8_t *tables = a->codes + (token + c) * table_stride;
            float step = a->scales[(token + c) * groups + g], sum = a->sums[(token + c) * groups + g];
            for (int r = 0; r < TILE_ROWS; r++) {
                int32_t acc = 0;
                for (int64_t o = g * octets; o < (g + 1) * octets; o++) {
                    const int8_t *lo_table = tables + 32 * o, *hi_table = lo_table + 16;
                    for (int p = 0; p < bits; p++) {
                        uint8_t byte = planes[(o * bits + p) * TILE_ROWS + r];
                        acc += (lo_table[byte & 15] + hi_table[byte >> 4]) * (1 << p);
                    }
                }
                float mid = min[r] + scale[r] * half_range;
                out[c * TILE_ROWS + r] += (float)acc * (scale[r] * step) + mid * sum;
            }
        }
    }
}

#ifdef HAVE_X86

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

AVX2_TARGET void lut_tile_avx2_n(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                 int64_t token, const int count, const float *params, float *out) {
    const int bits = w->bits;
    TILE_SETUP
    PARAM_POINTERS
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        /* acc[c][h][u]: token c, rows 32h .. 32h+31, u = unpacklo / unpackhi rows. */
        __m256i acc[MAX_TOKEN_BLOCK][2][2];
        for (int c = 0; c < count; c++) {
            acc[c][0][0] = acc[c][0][1] = acc[c][1][0] = acc[c][1][1] = _mm256_setzero_si256();
        }
        for (int64_t o = g * octets; o < (g + 1) * octets; o++) {
            __m256i lo_table[MAX_TOKEN_BLOCK], hi_table[MAX_TOKEN_BLOCK];
            for (int c = 0; c < count; c++) {
                const int8_t *t = a->codes + (token + c) * table_stride + 32 * o;
                lo_table[c] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
                hi_table[c] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t + 16)));
            }
            for (int p = 0; p < bits; p++) {
                const __m256i weight = _mm256_set1_epi8((char)(1 << p));
                _mm_prefetch((const char *)(planes + (o * bits + p) * TILE_ROWS + PREFETCH_BYTES), _MM_HINT_T0);
                for (int h = 0; h < 2; h++) {
                    __m256i v = _mm256_loadu_si256(
                        (const __m256i *)(planes + (o * bits + p) * TILE_ROWS + 32 * h));
                    __m256i lo = _mm256_and_si256(v, low4);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    for (int c = 0; c < count; c++) {
                        __m256i x = _mm256_shuffle_epi8(lo_table[c], lo);
                        __m256i y = _mm256_shuffle_epi8(hi_table[c], hi);
                        acc[c][h][0] = _mm256_add_epi16(
                            acc[c][h][0], _mm256_maddubs_epi16(weight, _mm256_unpacklo_epi8(x, y)));
                        acc[c][h][1] = _mm256_add_epi16(
                            acc[c][h][1], _mm256_maddubs_epi16(weight, _mm256_unpackhi_epi8(x, y)));
                    }
                }
            }
        }
        /* Lane l of acc[h][u] holds rows 32h + 16l + 8u .. +7. */
        GROUP_PARAMS(group_params_avx2)
        for (int c = 0; c < count; c++) {
            __m256 step = _mm256_set1_ps(a->scales[(token + c) * groups + g]);
            __m256 sum = _mm256_set1_ps(a->sums[(token + c) * groups + g]);
            for (int h = 0; h < 2; h++) {
                __m256i rows[2] = {_mm256_permute2x128_si256(acc[c][h][0], acc[c][h][1], 0x20),
                                   _mm256_permute2x128_si256(acc[c][h][0], acc[c][h][1], 0x31)};
                for (int i = 0; i < 4; i++) { /* rows 32h + 8i .. +7 */
                    int64_t r = 32 * h + 8 * i;
                    __m128i half16 = i & 1 ? _mm256_extracti128_si256(rows[i >> 1], 1)
                                           : _mm256_castsi256_si128(rows[i >> 1]);
                    __m256 value = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(half16));
                    __m256 row_scale = _mm256_loadu_ps(scale + r);
                    __m256 mid = _mm256_fmadd_ps(row_scale, _mm256_set1_ps(half_range), _mm256_loadu_ps(min + r));
                    float *dst = out + c * TILE_ROWS + r;
                    __m256 total = _mm256_fmadd_ps(value, _mm256_mul_ps(row_scale, step), _mm256_loadu_ps(dst));
                    _mm256_storeu_ps(dst, _mm256_fmadd_ps(mid, sum, total));
                }
            }
        }
    }
}

__attribute__((target("avx2,fma,f16c"))) static void lut_tile_avx2(
    const packed_matrix *w, const prepared_acts *a, int64_t tile, int64_t token, int count,
    const float *params, float *out) {
    switch (count) {
    case 1: lut_tile_avx2_n(w, a, tile, token, 1, params, out); break;
    case 2: lut_tile_avx2_n(w, a, tile, token, 2, params, out); break;
    case 3: lut_tile_avx2_n(w, a, tile, token, 3, params, out); break;
    default: lut_tile_avx2_n(w, a, tile, token, 4, params, out); break;
    }
}

#define AVX512_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"), always_inline)) static inline

/* Group g's scales and mids, 16 rows to a register: the tile's decoded params when given, two-level
 * scales through group_params_avx512, and float16 ones decoded here, as it would (min = -zero * scale
 * where no mins are stored), without its call and stores: a tenth of a 2-bit type's decode in cache. */
AVX512_TARGET void lut_params_avx512(const packed_matrix *w, int64_t tile, int64_t g, const float *params,
                                     float half_range, float own[2 * TILE_ROWS], __m512 row_scale[4],
                                     __m512 mid[4]) {
    const __m512 half = _mm512_set1_ps(half_range);
    if (!params && !w->sub_codes) {
        const int64_t at = (tile * (w->cols / w->group) + g) * TILE_ROWS;
        const __m512 zero = _mm512_set1_ps(-(float)w->zero);
        for (int i = 0; i < 4; i++) {
            row_scale[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + at + 16 * i)));
            const __m512 min = w->mins ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + at + 16 * i)))
                               : w->zero ? _mm512_mul_ps(row_scale[i], zero) : _mm512_setzero_ps();
            mid[i] = _mm512_fmadd_ps(row_scale[i], half, min);
        }
        return;
    }
    const float *scale = params ? params + g * 2 * TILE_ROWS : own;
    if (!params) group_params_avx512(w, tile, g, own, own + TILE_ROWS);
    for (int i = 0; i < 4; i++) {
        row_scale[i] = _mm512_loadu_ps(scale + 16 * i);
        mid[i] = _mm512_fmadd_ps(row_scale[i], half, _mm512_loadu_ps(scale + TILE_ROWS + 16 * i));
    }
}

AVX512_TARGET void lut_tile_avx512_n(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                     int64_t token, const int count, const int bits, const float *params,
                                     float *out) {
    TILE_SETUP
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    /* Lane l of unpacklo holds rows 16l .. 16l+7, of unpackhi rows 16l+8 .. 16l+15: these
     * qword indices gather rows 0..31 and 32..63 in order. */
    const __m512i first_rows = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    const __m512i last_rows = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[MAX_TOKEN_BLOCK][2];
        for (int c = 0; c < count; c++) {
            acc[c][0] = acc[c][1] = _mm512_setzero_si512();
        }
        for (int64_t o = g * octets; o < (g + 1) * octets; o++) {
            __m512i lo_table[MAX_TOKEN_BLOCK], hi_table[MAX_TOKEN_BLOCK];
            for (int c = 0; c < count; c++) {
                const int8_t *t = a->codes + (token + c) * table_stride + 32 * o;
                lo_table[c] = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t));
                hi_table[c] = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(t + 16)));
            }
            for (int p = 0; p < bits; p++) {
                const __m512i weight = _mm512_set1_epi8((char)(1 << p));
                _mm_prefetch((const char *)(planes + (o * bits + p) * TILE_ROWS + PREFETCH_BYTES), _MM_HINT_T0);
                __m512i v = _mm512_loadu_si512((const void *)(planes + (o * bits + p) * TILE_ROWS));
                __m512i lo = _mm512_and_si512(v, low4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                for (int c = 0; c < count; c++) {
                    __m512i x = _mm512_shuffle_epi8(lo_table[c], lo);
                    __m512i y = _mm512_shuffle_epi8(hi_table[c], hi);
                    acc[c][0] = _mm512_add_epi16(acc[c][0], _mm512_maddubs_epi16(weight, _mm512_unpacklo_epi8(x, y)));
                    acc[c][1] = _mm512_add_epi16(acc[c][1], _mm512_maddubs_epi16(weight, _mm512_unpackhi_epi8(x, y)));
                }
            }
        }
        __m512 row_scale[4], mid[4]; /* mid: the row's value at the centre code, min + scale * half_range */
        lut_params_avx512(w, tile, g, params, half_range, own_params, row_scale, mid);
        for (int c = 0; c < count; c++) {
            __m512 step = _mm512_set1_ps(a->scales[(token + c) * groups + g]);
            __m512 sum = _mm512_set1_ps(a->sums[(token + c) * groups + g]);
            __m512i rows[2] = {_mm512_permutex2var_epi64(acc[c][0], first_rows, acc[c][1]),
                               _mm512_permutex2var_epi64(acc[c][0], last_rows, acc[c][1])};
            for (int i = 0; i < 4; i++) { /* rows 16i .. 16i+15 */
                __m256i half16 = i & 1 ? _mm512_extracti64x4_epi64(rows[i >> 1], 1)
                                       : _mm512_castsi512_si256(rows[i >> 1]);
                __m512 value = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(half16));
                float *dst = out + c * TILE_ROWS + 16 * i;
                __m512 total = _mm512_fmadd_ps(value, _mm512_mul_ps(row_scale[i], step), _mm512_loadu_ps(dst));
                _mm512_storeu_ps(dst, _mm512_fmadd_ps(mid[i], sum, total));
            }
        }
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"))) static void
lut_tile_avx512(const packed_matrix *w, const prepared_acts *a, int64_t tile, int64_t token,
                int count, const float *params, float *out) {
    /* Decode (one token) gets a loop per bit count, unrolled over the planes. */
    if (count == 1) {
        switch (w->bits) {
        case 1: lut_tile_avx512_n(w, a, tile, token, 1, 1, params, out); return;
        case 2: lut_tile_avx512_n(w, a, tile, token, 1, 2, params, out); return;
        case 3: lut_tile_avx512_n(w, a, tile, token, 1, 3, params, out); return;
        default: lut_tile_avx512_n(w, a, tile, token, 1, w->bits, params, out); return;
        }
    }
    switch (count) {
    case 2: lut_tile_avx512_n(w, a, tile, token, 2, w->bits, params, out); break;
    case 3: lut_tile_avx512_n(w, a, tile, token, 3, w->bits, params, out); break;
    default: lut_tile_avx512_n(w, a, tile, token, 4, w->bits, params, out); break;
    }
}

#endif /* HAVE_X86 */

tile_kernel lut_tile_kernel(isa_t isa) {
#ifdef HAVE_X86
    if (isa == ISA_AVX512) return lut_tile_avx512;
    if (isa == ISA_AVX2) return lut_tile_avx2;
#endif
    (void)isa;
    return lut_tile_scalar;
}
