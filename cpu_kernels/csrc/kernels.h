/* Shared declarations of tierflow's CPU matmul kernels.
 *
 * Both kernels multiply float activations x [M, K] by a packed weight matrix W [N, K] into
 * y [M, N]. The packed layouts are documented in cpu_kernels/packed.py; in short, rows come in
 * tiles of TILE_ROWS, and every group of `group` columns of a row has a float16 scale and
 * (optionally) a float16 min, so that w = scale * q + min.
 *
 * Activations are quantized per group before the integer work: into 16-entry int8 look-up
 * tables of partial sums (LUT kernel, weights of 1..4 bits as bit planes) or into int8 values
 * (int8 kernel). Each ISA path performs exactly the same integer arithmetic; only the order of
 * the float accumulation differs.
 */
#ifndef TIERFLOW_KERNELS_H
#define TIERFLOW_KERNELS_H

#include <stdint.h>

#define TILE_ROWS 64
#define LUT_MAX_TABLES 258 /* tables per group: lut_max_group(1) / 4 */

/* Plain C loops compiled once per x86 ISA and picked at load time (glibc ifunc). */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TARGET_CLONES
#endif

/* Round to nearest, ties to even (as rint in the default mode) for |v| < 2^22, in plain
 * arithmetic that vectorizes: adding 1.5 * 2^23 pushes the fraction out of the mantissa. */
static inline float round_even(float v) {
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

/* x[0 .. n) summed in 16 lanes (lane j: x[j], x[16 + j], ...), then the lanes in order: an order the
 * compiler vectorizes, where one running sum is a chain of n dependent adds (most of preparing a
 * token's activations), and the same in every clone. */
static inline float lane_sum(const float *x, int64_t n) {
    float lanes[16] = {0.0f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int j = 0; j < 16; j++) lanes[j] += x[i + j];
    }
    for (int j = 0; i + j < n; j++) lanes[j] += x[i + j];
    float sum = 0.0f;
    for (int j = 0; j < 16; j++) sum += lanes[j];
    return sum;
}

/* The largest |x| of x[0 .. n), 16 lanes at a time (max is exact: any order gives the same). */
static inline float lane_peak(const float *x, int64_t n) {
    float peak[16] = {0.0f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int j = 0; j < 16; j++) {
            const float magnitude = x[i + j] < 0.0f ? -x[i + j] : x[i + j];
            peak[j] = magnitude > peak[j] ? magnitude : peak[j];
        }
    }
    for (int j = 0; i + j < n; j++) {
        const float magnitude = x[i + j] < 0.0f ? -x[i + j] : x[i + j];
        peak[j] = magnitude > peak[j] ? magnitude : peak[j];
    }
    float maxabs = 0.0f;
    for (int j = 0; j < 16; j++) maxabs = peak[j] > maxabs ? peak[j] : maxabs;
    return maxabs;
}

#define MAX_TOKEN_BLOCK 4 /* tokens that share one pass over a weight tile */
/* How far ahead of a packed matrix's code stream the kernels prefetch, measured rather than derived:
 * one core read a cold Q4_K, Q6_K or Q8_0 matrix from DRAM at 3/4 of the rate numpy sums memory with
 * 2 KiB, at about that rate with 8 KiB, and slower again with 16 KiB (benchmarks/kernels.py's cases). */
#define PREFETCH_BYTES 8192

typedef enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 } isa_t;

typedef struct {
    int bits;               /* 1..4: LUT kernel; 8: int8 kernel */
    int64_t group;          /* columns per scale group */
    int64_t tiles;          /* row tiles; rows are padded to tiles * TILE_ROWS */
    int64_t cols;           /* K */
    const uint8_t *data;    /* bit planes, int8 quads or nibble pairs of quads, see packed.py */
    const uint16_t *scales; /* float16 [tiles][K / group][TILE_ROWS], or NULL with sub codes */
    const uint16_t *mins;   /* float16 [tiles][K / group][TILE_ROWS], or NULL (zero's, or none) */
    const int8_t *codebook; /* int8 kernel: NULL, or the 16 codes that data's 4-bit indices select */
    int width;              /* int8 kernel: 8 int8 codes, 2..6 unsigned codes in fields (and high bits) */
    int zero;               /* LUT: min = -zero * scale without mins; nibble codes: subtracted */
    const uint8_t *high;    /* width 3, 5, 6: [tiles][K * h / 32][TILE_ROWS][4] high bits (code_field_bits) */
    /* Two-level scales (scales NULL): [tiles][supers][bytes][TILE_ROWS] codes, [..][1 or 2][..] d, dmin. */
    const uint8_t *sub_codes;
    const uint16_t *supers;
    int sub_bits, sub_offset, sub_mins;
    int64_t sub_gps; /* groups per super block */
} packed_matrix;

/* The bits of each code's field in data: int8 codes whole, codes of 4..6 bits and codebook indices as
 * nibbles, codes of 2..3 bits in 2-bit fields; h = width - field high bits live in `high`. */
static inline int width_field_bits(int width) {
    return width == 8 ? 8 : width >= 4 ? 4 : 2;
}
static inline int code_field_bits(const packed_matrix *w) {
    return w->codebook ? 4 : width_field_bits(w->width);
}

/* Each row's float scale and min [TILE_ROWS] of group g of a tile (params.c); min is zero-filled
 * where the matrix has none (params_have_min). The mins of the int8 kernel's centred codes
 * (params_centre) include the centre's value: min + centre * scale. */
void group_params_scalar(const packed_matrix *w, int64_t tile, int64_t g, float *scale, float *min);
void group_params_avx2(const packed_matrix *w, int64_t tile, int64_t g, float *scale, float *min);
void group_params_avx512(const packed_matrix *w, int64_t tile, int64_t g, float *scale, float *min);
int params_have_min(const packed_matrix *w);
/* What the int8 kernel subtracts from unsigned nibble codes that have mins: their middle code. */
int params_centre(const packed_matrix *w);
/* Every group's scales and mins of a tile, [K / group][2][TILE_ROWS]: what a kernel reads instead of
 * decoding them again for each block of tokens. */
void tile_params(const packed_matrix *w, int64_t tile, isa_t isa, float *out);

/* In a tile kernel: point scale and min at group g's, the tile's precomputed `params` or decoded
 * now into own_params by `decode` (a group_params_* of the kernel's ISA). */
#define GROUP_PARAMS(decode)                                                  \
    if (params) {                                                             \
        scale = params + g * 2 * TILE_ROWS, min = scale + TILE_ROWS;          \
    } else {                                                                  \
        scale = own_params, min = own_params + TILE_ROWS;                     \
        decode(w, tile, g, own_params, own_params + TILE_ROWS);               \
    }

/* The named codebooks of 4-bit indices (packed.py's CODEBOOKS): NULL for CODEBOOK_NONE. */
typedef enum { CODEBOOK_NONE = 0, CODEBOOK_IQ4NL = 1, CODEBOOK_MXFP4 = 2, CODEBOOK_COUNT = 3 } codebook_t;
const int8_t *int8_codebook(codebook_t id);

typedef struct {
    int64_t tokens;
    int64_t codes_per_token; /* LUT: K / 4 * 16 table entries; int8: K values */
    int8_t *codes;           /* quantized tables or activations */
    float *scales;           /* [tokens][K / group]: the float value of one code step */
    float *sums;             /* [tokens][K / group]: LUT: the exact sum of x over the group; int8: step * code sum */
    int32_t *code_sums;      /* int8: [tokens][K / group], the sum of the group's int8 codes */
} prepared_acts;

/* One tile of TILE_ROWS rows times `count` tokens (count <= MAX_TOKEN_BLOCK) starting at
 * `token`, accumulated into out[count][TILE_ROWS] (which the caller zeroes). */
typedef void (*tile_kernel)(const packed_matrix *w, const prepared_acts *a, int64_t tile,
                            int64_t token, int count, const float *params, float *out);

void lut_prepare_token(const float *x, int64_t cols, int64_t group, int8_t *tables,
                       float *scales, float *sums);
/* int8 codes with one step per `block` columns (scales[K / block]) and, per group, the codes' sum and
 * it times the step (code_sums, sums [K / group]): what a min multiplies, as in ggml's Q8_1; block is
 * a multiple of group. */
void int8_prepare_token(const float *x, int64_t cols, int64_t group, int64_t block, int8_t *codes,
                        float *scales, float *sums, int32_t *code_sums);

/* The int8 kernel on two-level scales works as ggml's K-quant dot products: activations with one
 * step per super block, each group's integer sum times its integer sub-scale (and the mins' codes
 * times the groups' code sums) added up as integers over the super block, then one float product
 * by d and dmin per super block. */
static inline int int8_two_level(const packed_matrix *w) {
    return w->bits == 8 && w->sub_codes != 0;
}
/* Columns per activation step: a super block on two-level int8 matrices, else a group. */
static inline int64_t act_block(const packed_matrix *w) {
    return int8_two_level(w) ? w->group * w->sub_gps : w->group;
}

tile_kernel lut_tile_kernel(isa_t isa);
tile_kernel int8_tile_kernel(isa_t isa);

/* Largest group the LUT kernel accepts at `bits`: its int16 accumulators must not overflow. */
int64_t lut_max_group(int bits);

/* The thread pool: fn(ctx, item) for item in [0, items), spread over the pool's threads and the
 * caller. Calls from several threads are serialized. */
typedef void (*pool_fn)(void *ctx, int64_t item);
int pool_set_threads(int threads);
int pool_threads(void);
void pool_run(pool_fn fn, void *ctx, int64_t items);

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

/* zlib's crc32(crc, bytes): PCLMULQDQ folding where the CPU has it (crc32.c). */
uint32_t crc32_zlib(uint32_t crc, const uint8_t *bytes, int64_t count);
int crc32_folds(void); /* whether it folds (else the table alone: slower than zlib's own) */

#endif
