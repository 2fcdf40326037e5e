/* Reading two-level scale codes (packed.py's sub_codes: [tiles][supers][bytes][TILE_ROWS], a
 * row's values being each group's scale code, then its min code where the matrix has mins): the
 * float decoders of params.c and the int8 kernel's integer sub-scales share these. */
#ifndef TIERFLOW_SUB_CODES_H
#define TIERFLOW_SUB_CODES_H

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

/* The bytes a row's `values` sub codes of one super block take: a byte each, a nibble each, or a
 * nibble and two more bits each. */
static inline int64_t sub_code_bytes(int sub_bits, int64_t values) {
    return sub_bits == 8 ? values : values / 2 + (sub_bits == 6 ? values / 4 : 0);
}

/* The sub codes of super block s of a tile; *values: how many a row has there. */
static inline const uint8_t *super_codes(const packed_matrix *w, int64_t tile, int64_t s, int *values) {
    const int64_t supers_per_tile = w->cols / w->group / w->sub_gps;
    *values = (int)w->sub_gps * (w->sub_mins ? 2 : 1);
    return w->sub_codes + (tile * supers_per_tile + s) * sub_code_bytes(w->sub_bits, *values) * TILE_ROWS;
}

/* Where super block s of a tile keeps d (and dmin after it). */
static inline const uint16_t *super_values(const packed_matrix *w, int64_t tile, int64_t s) {
    return w->supers + (tile * (w->cols / w->group / w->sub_gps) + s) * (w->sub_mins ? 2 : 1) * TILE_ROWS;
}

/* In a per-group decoder: group g's super block's codes and d (dmin), and g's scale code's index. */
#define SUB_SETUP                                                             \
    const int64_t s = g / w->sub_gps, gl = g % w->sub_gps;                   \
    int values;                                                               \
    const uint8_t *codes = super_codes(w, tile, s, &values);                  \
    const uint16_t *supers = super_values(w, tile, s);                        \
    const int v_scale = (int)gl * (w->sub_mins ? 2 : 1);

/* Sub code value v of row r. */
static inline int sub_value(const packed_matrix *w, const uint8_t *codes, int values, int v, int r) {
    if (w->sub_bits == 8) return codes[v * TILE_ROWS + r];
    int code = (codes[(v >> 1) * TILE_ROWS + r] >> (4 * (v & 1))) & 15;
    if (w->sub_bits == 6) code |= ((codes[(values / 2 + (v >> 2)) * TILE_ROWS + r] >> (2 * (v & 3))) & 3) << 4;
    return code;
}

#if defined(__x86_64__) || defined(_M_X64)

#define LOAD8(p) _mm_loadl_epi64((const __m128i *)(p))
#define SUB_AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline
#define SUB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"), always_inline)) static inline

/* The sub codes of value v for rows 8i .. 8i+7 as int32 lanes. */
SUB_AVX2 __m256i sub_lanes_8(const packed_matrix *w, const uint8_t *codes, int values, int v, int i) {
    if (w->sub_bits == 8) return _mm256_cvtepu8_epi32(LOAD8(codes + v * TILE_ROWS + 8 * i));
    __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(LOAD8(codes + (v >> 1) * TILE_ROWS + 8 * i)),
                                                      _mm256_set1_epi32(4 * (v & 1))), _mm256_set1_epi32(15));
    if (w->sub_bits != 6) return code;
    __m256i top = _mm256_cvtepu8_epi32(LOAD8(codes + (values / 2 + (v >> 2)) * TILE_ROWS + 8 * i));
    top = _mm256_and_si256(_mm256_srlv_epi32(top, _mm256_set1_epi32(2 * (v & 3))), _mm256_set1_epi32(3));
    return _mm256_or_si256(code, _mm256_slli_epi32(top, 4));
}

/* Sub code value v of all 64 rows, one byte each: the nibble (and top two bits) picked in place. */
SUB_AVX512 __m512i sub_bytes_64(const packed_matrix *w, const uint8_t *codes, int values, int v) {
    if (w->sub_bits == 8) return _mm512_loadu_si512((const void *)(codes + v * TILE_ROWS));
    __m512i low = _mm512_loadu_si512((const void *)(codes + (v >> 1) * TILE_ROWS));
    low = _mm512_and_si512(_mm512_srl_epi16(low, _mm_cvtsi32_si128(4 * (v & 1))), _mm512_set1_epi8(0x0F));
    if (w->sub_bits != 6) return low;
    __m512i top = _mm512_loadu_si512((const void *)(codes + (values / 2 + (v >> 2)) * TILE_ROWS));
    top = _mm512_and_si512(_mm512_srl_epi16(top, _mm_cvtsi32_si128(2 * (v & 3))), _mm512_set1_epi8(3));
    return _mm512_or_si512(low, _mm512_slli_epi16(top, 4));
}

/* Sub code values `first` and `first + stride` of all 64 rows, less `offset`, as int16 pairs (the first
 * in the low half of a 32-bit lane, the second in the high half), rows 16v .. 16v+15 in pair[v]: two
 * groups' scales (or mins) side by side, the operand vpdpwssd multiplies two groups' values by.
 * The codes less offset must fit int8 (sub_bits at most 6 and offset at most 64). */
SUB_AVX512 void sub_pairs_64(const packed_matrix *w, const uint8_t *codes, int values, int first, int stride,
                             int offset, __m512i pair[4]) {
    const __m512i low_index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                               39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high_index = _mm512_add_epi16(low_index, _mm512_set1_epi16(16));
    const __m512i bias = _mm512_set1_epi8((char)offset);
    const __m512i a = _mm512_sub_epi8(sub_bytes_64(w, codes, values, first), bias);
    const __m512i b = _mm512_sub_epi8(sub_bytes_64(w, codes, values, first + stride), bias);
    const __m512i a_words[2] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(a)), _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(a, 1))};
    const __m512i b_words[2] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(b)), _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(b, 1))};
    for (int half = 0; half < 2; half++) { /* rows 32 half .. 32 half + 31 */
        pair[2 * half] = _mm512_permutex2var_epi16(a_words[half], low_index, b_words[half]);
        pair[2 * half + 1] = _mm512_permutex2var_epi16(a_words[half], high_index, b_words[half]);
    }
}

/* Fetches the sub codes and d (dmin) of the super block after super block s of a tile (the next
 * tile's first at the tile's end; nothing after the last tile) towards the cache. They are streams of
 * their own beside the codes' (1/10 of their bytes for Q4_K) that the hardware prefetcher follows
 * poorly; without this a Q4_K matrix of 1024 x 2048 took a third longer to read from RAM. Always
 * inlined: a call from a kernel's super block loop spills its vector accumulators. */
__attribute__((always_inline)) static inline void prefetch_next_super(const packed_matrix *w, int64_t tile, int64_t s) {
    const int64_t supers_per_tile = w->cols / w->group / w->sub_gps;
    if (++s == supers_per_tile) {
        s = 0;
        if (++tile == w->tiles) return;
    }
    int values;
    const char *codes = (const char *)super_codes(w, tile, s, &values);
    for (int64_t line = 0; line < sub_code_bytes(w->sub_bits, values) * TILE_ROWS; line += 64) _mm_prefetch(codes + line, _MM_HINT_T0);
    const char *supers = (const char *)super_values(w, tile, s);
    for (int64_t line = 0; line < (w->sub_mins ? 2 : 1) * TILE_ROWS * 2; line += 64) _mm_prefetch(supers + line, _MM_HINT_T0);
}

#endif /* x86 */

#endif
