/* GGUF blocks straight into packed.py's layout: what pack(to_quant_groups(...)) makes of a Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS or MXFP4 matrix, without the byte per weight and float scales per group
 * that the numpy path builds on the way. The codes move four bytes at a time and the sub-scale codes and super-block halves as they are,
 * so the result is the numpy path's to the bit (tests/test_packed.py checks it).
 *
 * Each call writes rows [row0, row0 + rows) of a matrix: a projection stacked from several tensors is
 * several calls, and the caller zeroes the arrays for the padding rows past the last. */
#include <string.h>

#include "kernels.h"
#include "transcode.h"

enum {
    Q4_0_BYTES = 18, Q4_1_BYTES = 20, Q5_0_BYTES = 22, Q5_1_BYTES = 24, Q8_0_BYTES = 34, Q4_K_BYTES = 144,
    Q5_K_BYTES = 176, Q6_K_BYTES = 210, IQ4_NL_BYTES = 18, IQ4_XS_BYTES = 136, MXFP4_BYTES = 17, SUPER = 256
};

/* A float16's bits are finite unless its exponent is all ones. */
static inline int half_finite(uint16_t bits) { return (bits & 0x7C00) != 0x7C00; }

static inline uint16_t half_at(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static inline uint32_t word_at(const uint8_t *p) {
    uint32_t word;
    memcpy(&word, p, 4);
    return word;
}

/* Where row r of a tile keeps its 4 bytes of 256-byte block `block` in packed.py's field layouts
 * [T, K * field / 32, 64, 4]: a block holds 32 / field columns (8 of nibbles, 16 of 2-bit fields). */
static inline uint8_t *block_row(uint8_t *tile_base, int64_t block, int r) {
    return tile_base + block * TILE_ROWS * 4 + 4 * r;
}

/* The 4 bytes of a nibble block from 8 columns' nibbles: columns 0-3 in the low nibbles, 4-7 in the high
 * ones, the columns' nibbles being the low (top = 0) or high (top = 1) ones of the bytes at p. */
static inline uint32_t nibble_block(const uint8_t *p, int top) {
    const uint32_t first = word_at(p), second = word_at(p + 4);
    return top ? ((first >> 4) & 0x0F0F0F0F) | (second & 0xF0F0F0F0)
               : (first & 0x0F0F0F0F) | ((second & 0x0F0F0F0F) << 4);
}

/* A group of 32 columns whose nibbles are in Q4_0's order (weight l < 16 the low nibble of qs[l], weight
 * 16 + l its high one) into the 4 blocks of 8 columns from `first_block` of row r. */
static inline void nibble_group(const uint8_t *qs, uint8_t *tile_base, int64_t first_block, int r) {
    for (int o = 0; o < 4; o++) { /* columns 8o .. 8o + 7 */
        const uint32_t nibbles = nibble_block(qs + 8 * (o % 2), o / 2);
        memcpy(block_row(tile_base, first_block + o, r), &nibbles, 4);
    }
}

/* The 4 bytes of a high plane's 32 columns from their fifth bits (bit c of `bits` is column c's): byte j
 * of the word holds column 4i + j's bit at bit i, as Q5_K's planes are laid out (k_row). */
static inline uint32_t high_block(uint32_t bits) {
    uint32_t word = 0;
    for (int i = 0; i < 8; i++) {
        const uint32_t quad = (bits >> (4 * i)) & 0xF; /* columns 4i .. 4i + 3 */
        word |= ((quad & 1) | (quad >> 1 & 1) << 8 | (quad >> 2 & 1) << 16 | (quad >> 3 & 1) << 24) << i;
    }
    return word;
}

/* Q4_0, Q4_1, Q5_0 and Q5_1 (and IQ4_NL, a Q4_0 block whose nibbles index the iq4nl codebook): codes are the file's nibbles (width 4, zero 8, or 0 under a min), weight l
 * (l < 16) the low nibble of qs[l] and weight 16 + l its high one; the five-bit types' fifth bits are
 * the 32-bit qh (weight c's at bit c), which becomes the high plane (width 5, zero 16, or 0 under a
 * min). The float16 d is the group's scale, and the float16 m of Q4_1 and Q5_1 its min. */
static int legacy_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out,
                      const int with_min, const int five) {
    const int64_t groups = cols / 32, data_base = tile * cols * TILE_ROWS / 2, high_base = tile * cols * TILE_ROWS / 8;
    const int64_t block_bytes = 18 + 2 * with_min + 4 * five, qs_at = 2 + 2 * with_min + 4 * five;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *block = blocks + g * block_bytes, *qs = block + qs_at;
        const uint16_t d = half_at(block), m = with_min ? half_at(block + 2) : 0;
        if (!half_finite(d) || !half_finite(m)) return 0;
        out->scales[(tile * groups + g) * TILE_ROWS + r] = d;
        if (with_min) out->mins[(tile * groups + g) * TILE_ROWS + r] = m;
        nibble_group(qs, out->data + data_base, 4 * g, r);
        if (five) {
            const uint32_t high = high_block(word_at(block + 2 + 2 * with_min));
            memcpy(block_row(out->high + high_base, g, r), &high, 4);
        }
    }
    return 1;
}

static int q4_0_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out) {
    return legacy_row(blocks, cols, tile, r, out, 0, 0);
}

static int q4_1_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out) {
    return legacy_row(blocks, cols, tile, r, out, 1, 0);
}

static int q5_0_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out) {
    return legacy_row(blocks, cols, tile, r, out, 0, 1);
}

static int q5_1_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out) {
    return legacy_row(blocks, cols, tile, r, out, 1, 1);
}

/* IQ4_XS: per super block d, the 6-bit scale codes ls of its 8 groups of 32 (the weight is
 * d * (ls - 32) * iq4nl[index]), then each group's 16 bytes of nibbles in Q4_0's order. The file keeps the
 * codes as packed.py's sub codes do (sub bits 6, offset 32): the low nibbles paired in scales_l, then the top
 * bits four to a byte in scales_h, so they are copied as they are. */
static int iq4_xs_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out) {
    const int64_t supers_per_row = cols / SUPER, data_base = tile * cols * TILE_ROWS / 2;
    for (int64_t s = 0; s < supers_per_row; s++) {
        const uint8_t *block = blocks + s * IQ4_XS_BYTES, *qs = block + 8;
        const uint16_t d = half_at(block);
        if (!half_finite(d)) return 0;
        const int64_t at = tile * supers_per_row + s;
        out->supers[at * TILE_ROWS + r] = d;
        uint8_t *codes = out->sub_codes + at * 6 * TILE_ROWS + r;
        for (int i = 0; i < 4; i++) codes[i * TILE_ROWS] = block[4 + i];
        for (int i = 0; i < 2; i++) codes[(4 + i) * TILE_ROWS] = block[2 + i];
        for (int g = 0; g < SUPER / 32; g++) {
            nibble_group(qs + 16 * g, out->data + data_base, s * SUPER / 8 + 4 * g, r);
        }
    }
    return 1;
}

/* The float16 bits of 2^k, exact for k in -24 .. 15 (below -14 a subnormal). */
static inline uint16_t half_power_of_two(int k) {
    return k >= -14 ? (uint16_t)((k + 15) << 10) : (uint16_t)(1u << (k + 24));
}

/* MXFP4: the E8M0 exponent e, then the nibbles in Q4_0's order, indices into the mxfp4 codebook (E2M1
 * values doubled). The group's scale is 2^(e - 128), or 1 for a block of zeros (indices 0 and 8), as
 * quant_groups' split makes it; a scale float16 cannot hold exactly is refused (the numpy path folds
 * one above 2^15 into int8 codes, a form whose size the header does not tell). */
static int mxfp4_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out) {
    const int64_t groups = cols / 32, data_base = tile * cols * TILE_ROWS / 2;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *block = blocks + g * MXFP4_BYTES, *qs = block + 1;
        uint32_t magnitudes = 0;
        for (int i = 0; i < 4; i++) magnitudes |= word_at(qs + 4 * i) & 0x77777777;
        const int k = block[0] - 128;
        if (magnitudes && (k > 15 || k < -24)) return 0;
        out->scales[(tile * groups + g) * TILE_ROWS + r] = magnitudes ? half_power_of_two(k) : 0x3C00;
        nibble_group(qs, out->data + data_base, 4 * g, r);
    }
    return 1;
}

/* Q8_0: the int8 codes as they are, a quad of 4 columns to a row's 4 bytes; d is the group's scale. */
static int q8_0_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out) {
    const int64_t groups = cols / 32, data_base = tile * cols * TILE_ROWS;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *block = blocks + g * Q8_0_BYTES;
        const uint16_t d = half_at(block);
        if (!half_finite(d)) return 0;
        out->scales[(tile * groups + g) * TILE_ROWS + r] = d;
        for (int q = 0; q < 8; q++) memcpy(block_row(out->data + data_base, 8 * g + q, r), block + 2 + 4 * q, 4);
    }
    return 1;
}

/* Q4_K's and Q5_K's super block s of one row: d, dmin, and the 8 groups' 6-bit scale and min codes
 * (packed.py's sub codes: low nibbles paired, then top bits four to a byte). */
static int k_sub_scales(const uint8_t *block, int64_t supers_per_row, int64_t tile, int64_t s, int r,
                        const packed_out *out) {
    const uint8_t *scales = block + 4;
    const uint16_t d = half_at(block), dmin = half_at(block + 2);
    if (!half_finite(d) || !half_finite(dmin)) return 0;
    const int64_t at = tile * supers_per_row + s;
    out->supers[(at * 2 + 0) * TILE_ROWS + r] = d;
    out->supers[(at * 2 + 1) * TILE_ROWS + r] = dmin;
    uint8_t values[16]; /* group g's scale code at 2g, its min code at 2g + 1 (ggml's get_scale_min_k4) */
    for (int g = 0; g < 8; g++) {
        values[2 * g] = g < 4 ? scales[g] & 63 : (scales[g + 4] & 0xF) | (scales[g - 4] >> 6) << 4;
        values[2 * g + 1] = g < 4 ? scales[g + 4] & 63 : (scales[g + 4] >> 4) | (scales[g] >> 6) << 4;
    }
    uint8_t *codes = out->sub_codes + at * 12 * TILE_ROWS + r;
    for (int i = 0; i < 8; i++) codes[i * TILE_ROWS] = (uint8_t)((values[2 * i] & 0xF) | (values[2 * i + 1] & 0xF) << 4);
    for (int i = 0; i < 4; i++) {
        uint8_t top = 0;
        for (int k = 0; k < 4; k++) top |= (uint8_t)((values[4 * i + k] >> 4) << (2 * k));
        codes[(8 + i) * TILE_ROWS] = top;
    }
    return 1;
}

/* Q4_K and Q5_K: codes are the file's nibbles (width 4 or 5, zero 0), per super block 8 groups of 32
 * (k_sub_scales). Weight 64c + l takes the low nibble of qs[32c + l] (l < 32), weight 64c + 32 + l its
 * high nibble; in Q5_K, weight 64c + 32h + l takes its fifth bit from bit 2c + h of qh[l], and a high
 * byte holds one bit of each of 8 quads (32 columns). */
static int k_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out, const int five) {
    const int64_t supers_per_row = cols / SUPER, data_base = tile * cols * TILE_ROWS / 2;
    const int64_t high_base = tile * cols * TILE_ROWS / 8;
    for (int64_t s = 0; s < supers_per_row; s++) {
        const uint8_t *block = blocks + s * (five ? Q5_K_BYTES : Q4_K_BYTES), *qh = block + 16;
        const uint8_t *qs = block + (five ? 48 : 16);
        if (!k_sub_scales(block, supers_per_row, tile, s, r, out)) return 0;
        for (int o = 0; o < SUPER / 8; o++) { /* columns 8o .. 8o + 7: chunk o / 8, its half (o / 4) & 1 */
            const uint32_t nibbles = nibble_block(qs + 32 * (o / 8) + 8 * (o % 4), (o / 4) & 1);
            memcpy(block_row(out->data + data_base, s * SUPER / 8 + o, r), &nibbles, 4);
        }
        for (int b = 0; five && b < SUPER / 32; b++) { /* columns 32b .. 32b + 31: bit b of qh[0 .. 31] */
            uint32_t bits = 0;
            for (int i = 0; i < 8; i++) bits |= ((word_at(qh + 4 * i) >> b) & 0x01010101) << i;
            memcpy(block_row(out->high + high_base, s * SUPER / 32 + b, r), &bits, 4);
        }
    }
    return 1;
}

static int q4_k_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out) {
    return k_row(blocks, cols, tile, r, out, 0);
}

static int q5_k_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out) {
    return k_row(blocks, cols, tile, r, out, 1);
}

/* Q6_K: the unsigned 6-bit code q6 (width 6, zero 32: the weight is q6 - 32) as a nibble in data and its
 * top 2 bits in high; per super block 16 groups of 16 with an int8 scale each, kept as its code
 * scale + 128 (sub bits 8, offset 128), and d per row. Within each half n of 128 weights, weight
 * 128n + 32k + l (k < 4, l < 32) takes the low (k < 2) or high nibble of ql[64n + l + 32 (k & 1)] and
 * bits 2k, 2k + 1 of qh[32n + l]. */
static int q6_k_row(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out) {
    const int64_t supers_per_row = cols / SUPER, data_base = tile * cols * TILE_ROWS / 2;
    const int64_t high_base = tile * cols * TILE_ROWS / 4;
    for (int64_t s = 0; s < supers_per_row; s++) {
        const uint8_t *block = blocks + s * Q6_K_BYTES, *ql = block, *qh = block + 128, *scales = block + 192;
        const uint16_t d = half_at(block + 208);
        if (!half_finite(d)) return 0;
        const int64_t at = tile * supers_per_row + s;
        out->supers[at * TILE_ROWS + r] = d;
        for (int g = 0; g < 16; g++) out->sub_codes[(at * 16 + g) * TILE_ROWS + r] = (uint8_t)(scales[g] ^ 0x80);
        for (int o = 0; o < SUPER / 8; o++) { /* columns 8o .. 8o + 7: half n = o / 16, k = o / 4 % 4 */
            const int n = o / 16, k = o / 4 % 4;
            const uint32_t nibbles = nibble_block(ql + 64 * n + 32 * (k & 1) + 8 * (o % 4), k >= 2);
            memcpy(block_row(out->data + data_base, s * SUPER / 8 + o, r), &nibbles, 4);
        }
        for (int b = 0; b < SUPER / 16; b++) { /* columns 16b .. 16b + 15, quad i's top bits at bits 2i */
            const int n = b / 8, k = b / 2 % 4;
            const uint8_t *bits = qh + 32 * n + 16 * (b % 2);
            uint32_t tops = 0;
            for (int i = 0; i < 4; i++) tops |= ((word_at(bits + 4 * i) >> (2 * k)) & 0x03030303) << (2 * i);
            memcpy(block_row(out->high + high_base, s * SUPER / 16 + b, r), &tops, 4);
        }
    }
    return 1;
}

typedef int (*row_fn)(const uint8_t *blocks, int64_t cols, int64_t tile, int r, const packed_out *out);

/* Each type transcode_rows reads: its block's bytes and weights, and the function for a row. */
static const struct {
    int ggml_type;
    int64_t block_bytes, block_values;
    row_fn row;
} TYPES[] = {
    {GGML_Q4_0, Q4_0_BYTES, 32, q4_0_row},      {GGML_Q4_1, Q4_1_BYTES, 32, q4_1_row},
    {GGML_Q5_0, Q5_0_BYTES, 32, q5_0_row},      {GGML_Q5_1, Q5_1_BYTES, 32, q5_1_row},
    {GGML_Q8_0, Q8_0_BYTES, 32, q8_0_row},      {GGML_Q4_K, Q4_K_BYTES, SUPER, q4_k_row},
    {GGML_Q5_K, Q5_K_BYTES, SUPER, q5_k_row},   {GGML_Q6_K, Q6_K_BYTES, SUPER, q6_k_row},
    {GGML_IQ4_NL, IQ4_NL_BYTES, 32, q4_0_row},  {GGML_IQ4_XS, IQ4_XS_BYTES, SUPER, iq4_xs_row},
    {GGML_MXFP4, MXFP4_BYTES, 32, mxfp4_row},
};

static int type_index(int ggml_type) {
    for (int i = 0; i < (int)(sizeof TYPES / sizeof TYPES[0]); i++) {
        if (TYPES[i].ggml_type == ggml_type) return i;
    }
    return -1;
}

int64_t transcode_block_bytes(int ggml_type) {
    const int i = type_index(ggml_type);
    return i < 0 ? 0 : TYPES[i].block_bytes;
}

int64_t transcode_block_values(int ggml_type) {
    const int i = type_index(ggml_type);
    return i < 0 ? 0 : TYPES[i].block_values;
}

int64_t transcode_rows(int ggml_type, const uint8_t *src, int64_t rows, int64_t cols, int64_t row0,
                       const packed_out *out) {
    const int type = type_index(ggml_type);
    const row_fn row_of = TYPES[type].row;
    const int64_t row_bytes = cols / TYPES[type].block_values * TYPES[type].block_bytes;
    for (int64_t row = 0; row < rows; row++) {
        const int64_t tile = (row0 + row) / TILE_ROWS;
        if (!row_of(src + row * row_bytes, cols, tile, (int)((row0 + row) % TILE_ROWS), out)) return row;
    }
    return -1;
}
