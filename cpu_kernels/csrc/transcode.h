/* GGUF blocks straight into the packed layout (transcode.c). */
#ifndef TIERFLOW_TRANSCODE_H
#define TIERFLOW_TRANSCODE_H

#include <stdint.h>

/* The GGUF types transcode_rows reads (ggml's type ids). */
enum {
    GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13,
    GGML_Q6_K = 14, GGML_IQ4_NL = 20, GGML_IQ4_XS = 23, GGML_MXFP4 = 39
};

/* A packed matrix's arrays (packed.py's layout); those its form lacks are NULL. */
typedef struct {
    uint8_t *data, *high, *sub_codes;
    uint16_t *supers, *scales, *mins; /* float16 bits */
} packed_out;

/* The bytes of one block of a type transcode_rows reads; 0 for any other type. */
int64_t transcode_block_bytes(int ggml_type);
/* The weights of one such block: 32, or a 256-weight super block (the K-quants, IQ4_XS); 0 for any
 * other type. */
int64_t transcode_block_values(int ggml_type);

/* Rows [row0, row0 + rows) of a packed matrix from `rows` rows of GGUF blocks (of a type the two above
 * know) of `cols` columns (a multiple of the type's block) (padding rows are the caller's to zero). Returns -1, or the first row
 * (counted from 0 in src) with a block scale the layout cannot hold: not a finite number, or an MXFP4
 * scale outside float16's exact powers of two (2^-24 .. 2^15). */
int64_t transcode_rows(int ggml_type, const uint8_t *src, int64_t rows, int64_t cols, int64_t row0,
                       const packed_out *out);

#endif
