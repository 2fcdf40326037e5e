/* GGUF super blocks straight into the packed layout (transcode.c). */
#ifndef TIERFLOW_TRANSCODE_H
#define TIERFLOW_TRANSCODE_H

#include <stdint.h>

/* The GGUF types transcode_rows reads (ggml's type ids). */
enum { GGML_Q4_K = 12, GGML_Q6_K = 14 };

/* Rows [row0, row0 + rows) of a packed matrix from `rows` rows of GGUF blocks of `cols` columns (a
 * multiple of 256) (high: Q6_K's only; padding rows are the caller's to zero). Returns -1, or the first
 * row (counted from 0 in src) whose super-block scale is not a finite number. */
int64_t transcode_rows(int ggml_type, const uint8_t *src, int64_t rows, int64_t cols, int64_t row0, uint8_t *data,
                       uint8_t *high, uint8_t *sub_codes, uint16_t *supers);

#endif
