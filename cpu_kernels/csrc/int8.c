/* The int8 kernel: weights of up to 8 bits (Q8_0, Q5_x, Q6_K) times activations quantized to
 * int8 per group, as in ggml's Q8 dot products.
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

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HAVE_X86 1
#endif

/* Vectorizable (see lut_prepare_token): the group's peak |x| is kept per lane, then reduced. */
TARGET_CLONES void int8_prepare_token(const float *x, int64_t cols, int64_t group, int8_t *codes,
                                      float *scales, float *sums) {
    float peak[16];
    for (int64_t g = 0; g < cols / group; g++) {
        const float *xg = x + g * group;
        float sum = 0.0f, maxabs = 0.0f;
        for (int i = 0; i < 16; i++) peak[i] = 0.0f;
        for (int64_t i = 0; i < group; i++) {
            float magnitude = xg[i] < 0.0f ? -xg[i] : xg[i];
            peak[i & 15] = magnitude > peak[i & 15] ? magnitude : peak[i & 15];
            sum += xg[i];
        }
        for (int i = 0; i < 16; i++) maxabs = peak[i] > maxabs ? peak[i] : maxabs;
        float inv = maxabs > 0.0f ? 127.0f / maxabs : 0.0f;
        for (int64_t i = 0; i < group; i++) codes[g * group + i] = (int8_t)round_even(xg[i] * inv);
        scales[g] = maxabs / 127.0f;
        sums[g] = sum;
    }
}

static const int8_t CODEBOOKS[CODEBOOK_COUNT][16] = {
    [CODEBOOK_IQ4NL] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    [CODEBOOK_MXFP4] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}, /* E2M1 x 2 */
};

const int8_t *int8_codebook(codebook_t id) {
    return id > CODEBOOK_NONE && id < CODEBOOK_COUNT ? CODEBOOKS[id] : NULL;
}

/* Where quad q's 256-byte block starts: its own block, or the one it shares with its pair. */
static inline const uint8_t *quad_block(const uint8_t *data, int64_t q, int nibbles) {
    return data + (nibbles ? q >> 1 : q) * 4 * TILE_ROWS;
}

#define TILE_SETUP                                                            \
    const int64_t groups = w->cols / w->group, quads = w->group / 4;         \
    const uint8_t *data = w->data + tile * w->cols * TILE_ROWS / (w->codebook ? 2 : 1); \
    const uint16_t *scales = w->scales + tile * groups * TILE_ROWS;          \
    const uint16_t *mins = w->mins ? w->mins + tile * groups * TILE_ROWS : NULL; \
    const int64_t code_stride = a->codes_per_token;

/* out[c][r] += acc * scale * step (+ min * sum), the epilogue every path shares per group. */
static void scalar_epilogue(const int32_t *acc, const uint16_t *scales, const uint16_t *mins,
                            float step, float sum, float *out) {
    for (int r = 0; r < TILE_ROWS; r++) {
        float total = (float)acc[r] * (half_to_float(scales[r]) * step);
        if (mins) total += half_to_float(mins[r]) * sum;
        out[r] += total;
    }
}

static void int8_tile_scalar(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                             int64_t token, int count, float *out) {
    TILE_SETUP
    int32_t acc[TILE_ROWS];
    for (int64_t g = 0; g < groups; g++) {
        for (int c = 0; c < count; c++) {
            const int8_t *x = a->codes + (token + c) * code_stride;
            memset(acc, 0, sizeof acc);
            for (int64_t q = g * quads; q < (g + 1) * quads; q++) {
                const uint8_t *block = quad_block(data, q, w->codebook != NULL);
                for (int r = 0; r < TILE_ROWS; r++) {
                    for (int j = 0; j < 4; j++) {
                        int8_t code = w->codebook ? w->codebook[(block[4 * r + j] >> (4 * (q & 1))) & 15]
                                                  : (int8_t)block[4 * r + j];
                        acc[r] += code * x[4 * q + j];
                    }
                }
            }
            scalar_epilogue(acc, scales + g * TILE_ROWS, mins ? mins + g * TILE_ROWS : NULL,
                            a->scales[(token + c) * groups + g], a->sums[(token + c) * groups + g],
                            out + c * TILE_ROWS);
        }
    }
}

#ifdef HAVE_X86

/* One specialisation per token count and layout, so both are constants in the inner loops. */
#define DISPATCH_TOKEN_BLOCK(fn)                                                            \
    const int nibbles = w->codebook != NULL;                                                \
    switch (count) {                                                                        \
    case 1: nibbles ? fn(w, a, tile, token, 1, 1, out) : fn(w, a, tile, token, 1, 0, out); break; \
    case 2: nibbles ? fn(w, a, tile, token, 2, 1, out) : fn(w, a, tile, token, 2, 0, out); break; \
    case 3: nibbles ? fn(w, a, tile, token, 3, 1, out) : fn(w, a, tile, token, 3, 0, out); break; \
    default: nibbles ? fn(w, a, tile, token, 4, 1, out) : fn(w, a, tile, token, 4, 0, out); break; \
    }

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* Rows 8v .. 8v+7 of quad q as int8 codes: loaded, or looked up from their nibbles. */
AVX2_TARGET __m256i avx2_quad(const uint8_t *data, int64_t q, int v, const int nibbles, __m256i table) {
    __m256i bytes = _mm256_loadu_si256((const __m256i *)(quad_block(data, q, nibbles) + 32 * v));
    if (!nibbles) return bytes;
    if (q & 1) bytes = _mm256_srli_epi16(bytes, 4);
    return _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F)));
}

AVX2_TARGET void int8_tile_avx2_n(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                  int64_t token, const int count, const int nibbles, float *out) {
    TILE_SETUP
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i table = nibbles ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w->codebook))
                                  : _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[MAX_TOKEN_BLOCK][8]; /* acc[c][v]: rows 8v .. 8v+7 */
        for (int c = 0; c < count; c++) {
            for (int v = 0; v < 8; v++) acc[c][v] = _mm256_setzero_si256();
        }
        for (int64_t q = g * quads; q < (g + 1) * quads; q++) {
            __m256i x[MAX_TOKEN_BLOCK];
            for (int c = 0; c < count; c++) {
                int32_t four;
                memcpy(&four, a->codes + (token + c) * code_stride + 4 * q, 4);
                x[c] = _mm256_set1_epi32(four);
            }
            for (int v = 0; v < 8; v++) {
                __m256i wv = avx2_quad(data, q, v, nibbles, table);
                __m256i magnitude = _mm256_sign_epi8(wv, wv);
                for (int c = 0; c < count; c++) {
                    __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x[c], wv));
                    acc[c][v] = _mm256_add_epi32(acc[c][v], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for (int c = 0; c < count; c++) {
            __m256 step = _mm256_set1_ps(a->scales[(token + c) * groups + g]);
            __m256 sum = _mm256_set1_ps(a->sums[(token + c) * groups + g]);
            for (int v = 0; v < 8; v++) {
                const int64_t r = g * TILE_ROWS + 8 * v;
                float *dst = out + c * TILE_ROWS + 8 * v;
                __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + r)));
                __m256 total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[c][v]), _mm256_mul_ps(scale, step),
                                               _mm256_loadu_ps(dst));
                if (mins) {
                    __m256 min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + r)));
                    total = _mm256_fmadd_ps(min, sum, total);
                }
                _mm256_storeu_ps(dst, total);
            }
        }
    }
}

__attribute__((target("avx2,fma,f16c"))) static void int8_tile_avx2(
    const packed_matrix *w, const prepared_acts *a, int64_t tile, int64_t token, int count,
    float *out) {
    DISPATCH_TOKEN_BLOCK(int8_tile_avx2_n)
}

#define AVX512_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"), always_inline)) static inline

/* Rows 16v .. 16v+15 of quad q as int8 codes: loaded, or looked up from their nibbles. */
AVX512_TARGET __m512i avx512_quad(const uint8_t *data, int64_t q, int v, const int nibbles, __m512i table) {
    __m512i bytes = _mm512_loadu_si512((const void *)(quad_block(data, q, nibbles) + 64 * v));
    if (!nibbles) return bytes;
    if (q & 1) bytes = _mm512_srli_epi16(bytes, 4);
    return _mm512_shuffle_epi8(table, _mm512_and_si512(bytes, _mm512_set1_epi8(0x0F)));
}

AVX512_TARGET void int8_tile_avx512_n(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                                      int64_t token, const int count, const int nibbles, float *out) {
    TILE_SETUP
    const __m512i table = nibbles ? _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)w->codebook))
                                  : _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[MAX_TOKEN_BLOCK][4]; /* acc[c][v]: rows 16v .. 16v+15 */
        for (int c = 0; c < count; c++) {
            for (int v = 0; v < 4; v++) acc[c][v] = _mm512_setzero_si512();
        }
        for (int64_t q = g * quads; q < (g + 1) * quads; q++) {
            __m512i x[MAX_TOKEN_BLOCK];
            for (int c = 0; c < count; c++) {
                int32_t four;
                memcpy(&four, a->codes + (token + c) * code_stride + 4 * q, 4);
                x[c] = _mm512_set1_epi32(four);
            }
            const char *ahead = (const char *)quad_block(data, q, nibbles) + PREFETCH_BYTES;
            for (int line = 0; line < 4; line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
            for (int v = 0; v < 4; v++) {
                __m512i wv = avx512_quad(data, q, v, nibbles, table);
                __m512i magnitude = _mm512_abs_epi8(wv);
                __mmask64 negative = _mm512_movepi8_mask(wv);
                for (int c = 0; c < count; c++) {
                    __m512i signed_x = _mm512_mask_sub_epi8(x[c], negative, _mm512_setzero_si512(), x[c]);
                    acc[c][v] = _mm512_dpbusd_epi32(acc[c][v], magnitude, signed_x);
                }
            }
        }
        for (int c = 0; c < count; c++) {
            __m512 step = _mm512_set1_ps(a->scales[(token + c) * groups + g]);
            __m512 sum = _mm512_set1_ps(a->sums[(token + c) * groups + g]);
            for (int v = 0; v < 4; v++) {
                const int64_t r = g * TILE_ROWS + 16 * v;
                float *dst = out + c * TILE_ROWS + 16 * v;
                __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + r)));
                __m512 total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[c][v]), _mm512_mul_ps(scale, step),
                                               _mm512_loadu_ps(dst));
                if (mins) {
                    __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + r)));
                    total = _mm512_fmadd_ps(min, sum, total);
                }
                _mm512_storeu_ps(dst, total);
            }
        }
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"))) static void
int8_tile_avx512(const packed_matrix *w, const prepared_acts *a, int64_t tile, int64_t token,
                 int count, float *out) {
    DISPATCH_TOKEN_BLOCK(int8_tile_avx512_n)
}

#endif /* HAVE_X86 */

tile_kernel int8_tile_kernel(isa_t isa) {
#ifdef HAVE_X86
    if (isa == ISA_AVX512) return int8_tile_avx512;
    if (isa == ISA_AVX2) return int8_tile_avx2;
#endif
    (void)isa;
    return int8_tile_scalar;
}
