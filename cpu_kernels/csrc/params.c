/* Each row's scale and min of one group of a tile, from whichever form the matrix keeps them in
 * (see cpu_kernels/packed.py): float16 per group, or two-level (a float16 d, and dmin, per super
 * block of groups times each group's 4-, 6- or 8-bit code). Both kernels call this once per
 * group and tile, so the forms cost the inner loops nothing.
 *
 * Every path computes exactly packed.py's group_params: scale = d * (float)(code - offset),
 * min = -(dmin * (float)min_code), or -zero * scale (LUT codes with a zero code and no mins).
 */
#include "kernels.h"
#include "sub_codes.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HAVE_X86 1
#endif

/* Whether the form fills min itself: float16 mins, or two-level ones. */
static inline int explicit_mins(const packed_matrix *w) {
    return w->mins || (w->sub_codes && w->sub_mins);
}

/* Where no form stores mins, min = scale times this: the LUT zero code's -zero, or 0 (no mins). */
static inline float zero_code_factor(const packed_matrix *w) {
    return w->bits != 8 ? (float)-w->zero : 0.0f;
}

/* The mins no form stored (zero_code_factor), then the int8 kernel's centre folded in:
 * min + centre * scale. Inlined into each ISA's decoder, which vectorizes it. */
static inline void finish_mins(const packed_matrix *w, const float *scale, float *min) {
    if (!explicit_mins(w)) {
        const float zero = zero_code_factor(w);
        for (int r = 0; r < TILE_ROWS; r++) min[r] = zero != 0.0f ? scale[r] * zero : 0.0f;
    }
    const float centre = (float)params_centre(w);
    if (centre != 0.0f) {
        for (int r = 0; r < TILE_ROWS; r++) min[r] = min[r] + scale[r] * centre;
    }
}

void group_params_scalar(const packed_matrix *w, int64_t tile, int64_t g, float *scale, float *min) {
    if (w->sub_codes) {
        SUB_SETUP
        for (int r = 0; r < TILE_ROWS; r++) {
            scale[r] = half_to_float(supers[r]) * (float)(sub_value(w, codes, values, v_scale, r) - w->sub_offset);
            if (w->sub_mins)
                min[r] = -(half_to_float(supers[TILE_ROWS + r]) * (float)sub_value(w, codes, values, v_scale + 1, r));
        }
    } else {
        const int64_t at = (tile * (w->cols / w->group) + g) * TILE_ROWS;
        for (int r = 0; r < TILE_ROWS; r++) scale[r] = half_to_float(w->scales[at + r]);
        if (w->mins) {
            for (int r = 0; r < TILE_ROWS; r++) min[r] = half_to_float(w->mins[at + r]);
        }
    }
    finish_mins(w, scale, min);
}

int params_have_min(const packed_matrix *w) {
    return explicit_mins(w) || (w->bits != 8 && w->zero);
}

int params_centre(const packed_matrix *w) {
    return w->bits == 8 && !w->codebook && w->width < 8 && explicit_mins(w) ? 1 << (w->width - 1) : 0;
}

void tile_params(const packed_matrix *w, int64_t tile, isa_t isa, float *out) {
    for (int64_t g = 0; g < w->cols / w->group; g++) {
        float *scale = out + g * 2 * TILE_ROWS, *min = scale + TILE_ROWS;
#ifdef HAVE_X86
        if (isa == ISA_AVX512) { group_params_avx512(w, tile, g, scale, min); continue; }
        if (isa == ISA_AVX2) { group_params_avx2(w, tile, g, scale, min); continue; }
#endif
        (void)isa;
        group_params_scalar(w, tile, g, scale, min);
    }
}

#ifdef HAVE_X86

#define LOAD16(p) _mm_loadu_si128((const __m128i *)(p))

__attribute__((target("avx2,fma,f16c"))) void group_params_avx2(const packed_matrix *w, int64_t tile, int64_t g,
                                                                float *scale, float *min) {
    if (w->sub_codes) {
        SUB_SETUP
        const __m256 offset = _mm256_set1_ps((float)w->sub_offset);
        for (int i = 0; i < TILE_ROWS / 8; i++) {
            __m256 d = _mm256_cvtph_ps(LOAD16(supers + 8 * i));
            __m256 code = _mm256_cvtepi32_ps(sub_lanes_8(w, codes, values, v_scale, i));
            _mm256_storeu_ps(scale + 8 * i, _mm256_mul_ps(d, _mm256_sub_ps(code, offset)));
            if (w->sub_mins) {
                __m256 dmin = _mm256_cvtph_ps(LOAD16(supers + TILE_ROWS + 8 * i));
                __m256 m = _mm256_cvtepi32_ps(sub_lanes_8(w, codes, values, v_scale + 1, i));
                _mm256_storeu_ps(min + 8 * i, _mm256_xor_ps(_mm256_mul_ps(dmin, m), _mm256_set1_ps(-0.0f)));
            }
        }
    } else {
        const int64_t at = (tile * (w->cols / w->group) + g) * TILE_ROWS;
        for (int i = 0; i < TILE_ROWS / 8; i++) _mm256_storeu_ps(scale + 8 * i, _mm256_cvtph_ps(LOAD16(w->scales + at + 8 * i)));
        if (w->mins) {
            for (int i = 0; i < TILE_ROWS / 8; i++) _mm256_storeu_ps(min + 8 * i, _mm256_cvtph_ps(LOAD16(w->mins + at + 8 * i)));
        }
    }
    finish_mins(w, scale, min);
}

#define AVX512_PARAMS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define LOAD32(p) _mm256_loadu_si256((const __m256i *)(p))

/* Rows 16i .. 16i+15 of 64 code bytes as floats. */
AVX512_PARAMS_TARGET static inline __m512 bytes_to_floats(__m512i bytes, int i) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(bytes, i)));
}

/* Two-level scales decode in registers, finish_mins' steps included, so each value is stored once. */
AVX512_PARAMS_TARGET void group_params_avx512(const packed_matrix *w, int64_t tile, int64_t g, float *scale,
                                             float *min) {
    if (w->sub_codes) {
        SUB_SETUP
        const __m512 offset = _mm512_set1_ps((float)w->sub_offset);
        const __m512 centre = _mm512_set1_ps((float)params_centre(w));
        const float zero = zero_code_factor(w);
        const __m512i scale_codes = sub_bytes_64(w, codes, values, v_scale);
        const __m512i min_codes = w->sub_mins ? sub_bytes_64(w, codes, values, v_scale + 1) : scale_codes;
        for (int i = 0; i < TILE_ROWS / 16; i++) {
            __m512 d = _mm512_cvtph_ps(LOAD32(supers + 16 * i));
            __m512 row_scale = _mm512_mul_ps(d, _mm512_sub_ps(bytes_to_floats(scale_codes, i), offset));
            __m512 row_min;
            if (w->sub_mins) {
                __m512 dmin = _mm512_cvtph_ps(LOAD32(supers + TILE_ROWS + 16 * i));
                row_min = _mm512_xor_ps(_mm512_mul_ps(dmin, bytes_to_floats(min_codes, i)), _mm512_set1_ps(-0.0f));
                row_min = _mm512_add_ps(row_min, _mm512_mul_ps(row_scale, centre)); /* finish_mins' centre */
            } else {
                row_min = zero != 0.0f ? _mm512_mul_ps(row_scale, _mm512_set1_ps(zero)) : _mm512_setzero_ps();
            }
            _mm512_storeu_ps(scale + 16 * i, row_scale);
            _mm512_storeu_ps(min + 16 * i, row_min);
        }
        return;
    }
    const int64_t at = (tile * (w->cols / w->group) + g) * TILE_ROWS;
    for (int i = 0; i < TILE_ROWS / 16; i++) _mm512_storeu_ps(scale + 16 * i, _mm512_cvtph_ps(LOAD32(w->scales + at + 16 * i)));
    if (w->mins) {
        for (int i = 0; i < TILE_ROWS / 16; i++) _mm512_storeu_ps(min + 16 * i, _mm512_cvtph_ps(LOAD32(w->mins + at + 16 * i)));
    }
    finish_mins(w, scale, min);
}

#endif /* HAVE_X86 */
