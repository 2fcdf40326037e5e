/* Python bindings of the kernels: argument checks, run-time ISA choice, the GIL released.
 *
 * Every array arrives through the buffer protocol and is checked here (item size, format,
 * contiguity, exact length) before any pointer is used, so a wrong argument is a Python
 * exception and never a crash.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "ops.h"
#include "sub_codes.h"
#include "transcode.h"

#define TOKEN_CHUNK 32 /* tokens per work item in a many-token product */
#define INLINE_PREPARES 16 /* token rows the caller quantizes itself rather than wait for the threads once more */

static const char *ISA_NAMES[] = {"scalar", "avx2", "avx512"};
static isa_t best_isa = ISA_SCALAR, active_isa = ISA_SCALAR;

static isa_t detect_isa(void) {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma"))
        return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

typedef struct {
    Py_buffer view;
    int held;
} buffer_arg;

static void release(buffer_arg *args, int count) {
    for (int i = 0; i < count; i++) {
        if (args[i].held) PyBuffer_Release(&args[i].view);
    }
}

/* Takes obj's buffer, C-contiguous, with the given item size and one of the formats. */
static int get_buffer(PyObject *obj, buffer_arg *arg, const char *name, Py_ssize_t itemsize,
                      const char *formats, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &arg->view, flags) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s array", name,
                     writable ? ", writable" : "");
        return -1;
    }
    arg->held = 1;
    const char *format = arg->view.format ? arg->view.format : "B";
    if (format[0] == '<' || format[0] == '=' || format[0] == '@') format++;
    if (arg->view.itemsize != itemsize || strlen(format) != 1 || !strchr(formats, format[0])) {
        PyErr_Format(PyExc_TypeError, "%s has item format '%s'; expected one of '%s' (%zd bytes)",
                     name, arg->view.format, formats, itemsize);
        return -1;
    }
    return 0;
}

static int check_length(buffer_arg *arg, const char *name, Py_ssize_t items) {
    if (arg->view.len != items * arg->view.itemsize) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd items; the packed shape needs %zd", name,
                     arg->view.len / arg->view.itemsize, items);
        return -1;
    }
    return 0;
}

typedef struct {
    packed_matrix w;
    prepared_acts acts;
    tile_kernel kernel;
    isa_t isa;
    const float *x;
    float *y;
    int64_t rows, chunks;
    int accumulate; /* y += x @ W.T instead of y = */
} matmul_job;

static void prepare_item(void *ctx, int64_t token) {
    matmul_job *job = ctx;
    const int64_t groups = job->w.cols / job->w.group;
    const float *x = job->x + token * job->w.cols;
    int8_t *codes = job->acts.codes + token * job->acts.codes_per_token;
    float *scales = job->acts.scales + token * groups, *sums = job->acts.sums + token * groups;
    if (job->w.bits == 8) {
        int8_prepare_token(x, job->w.cols, job->w.group, act_block(&job->w), codes, scales, sums,
                           job->acts.code_sums + token * groups);
    } else {
        lut_prepare_token(x, job->w.cols, job->w.group, codes, scales, sums);
    }
}

static void tile_item(void *ctx, int64_t item) {
    matmul_job *job = ctx;
    const int64_t tile = item / job->chunks, first = (item % job->chunks) * TOKEN_CHUNK;
    const int64_t last = first + TOKEN_CHUNK < job->acts.tokens ? first + TOKEN_CHUNK : job->acts.tokens;
    const int64_t row0 = tile * TILE_ROWS;
    const int64_t valid = job->rows - row0 < TILE_ROWS ? job->rows - row0 : TILE_ROWS;
    float out[MAX_TOKEN_BLOCK * TILE_ROWS];
    /* Several blocks of tokens share the tile's scales, decoded once (a failed allocation: per block). */
    /* The two-level int8 kernel reads its integer sub-scales, never these. */
    const int shared = last - first > MAX_TOKEN_BLOCK && !int8_two_level(&job->w);
    float *params = shared ? malloc(job->w.cols / job->w.group * 2 * TILE_ROWS * sizeof(float)) : NULL;
    if (params) tile_params(&job->w, tile, job->isa, params);
    for (int64_t token = first; token < last; token += MAX_TOKEN_BLOCK) {
        int count = last - token < MAX_TOKEN_BLOCK ? (int)(last - token) : MAX_TOKEN_BLOCK;
        memset(out, 0, sizeof out);
        job->kernel(&job->w, &job->acts, tile, token, count, params, out);
        for (int c = 0; c < count; c++) {
            float *dst = job->y + (token + c) * job->rows + row0;
            if (job->accumulate) {
                for (int64_t r = 0; r < valid; r++) dst[r] += out[c * TILE_ROWS + r];
            } else {
                memcpy(dst, out + c * TILE_ROWS, valid * sizeof(float));
            }
        }
    }
    free(params);
}

PyDoc_STRVAR(matmul_doc,
"matmul(bits, group, rows, data, scales, mins, x, y, accumulate=False, codebook=0, width=8, zero=0,\n"
"       high=None, sub_codes=None, supers=None, sub_bits=0, sub_offset=0, sub_groups=0, sub_mins=False)\n--\n\n"
"y[M, rows] = x[M, K] @ W.T for a packed W (see tierflow.cpu_kernels.packed); y += with accumulate.\n"
"bits 1..4 uses the LUT kernel, 8 the int8 kernel. codebook (bits 8 only): 0 for int8 codes, else the\n"
"id of the codebook that data's 4-bit indices select (1 iq4nl, 2 mxfp4), K / 2 bytes per row. width\n"
"(bits 8): 8 for int8 codes, 2..6 for unsigned codes in 2- or 4-bit fields (and `high` bits) less zero.\n"
"zero (LUT): min = -zero * scale where mins is None. sub_codes and supers replace scales (None) with\n"
"two-level scales: sub_bits-bit codes less sub_offset times d, per super block of sub_groups groups,\n"
"and with sub_mins their mins, -(dmin * code).");

/* The byte length each array must have. */
typedef struct {
    int64_t data, high, params, sub_codes, supers;
} matmul_sizes;

/* Checks the arguments against each other, writing the problem into `problem` (empty: none). */
static void matmul_problem(const packed_matrix *w, int codebook, int has_high, int has_scales, int has_mins,
                           int has_sub, matmul_sizes *sizes, char *problem, size_t size) {
    const int64_t cols = w->cols, group = w->group, tiles = w->tiles;
    const int lut = w->bits >= 1 && w->bits <= 4;
    const int field = lut ? 8 : code_field_bits(w), h = !lut && w->width < 8 ? w->width - field : 0;
    const int64_t divisor = lut ? 8 : 32 / field; /* a 256-byte block of fields holds 8 / field quads */
    problem[0] = 0;
    if (!lut && w->bits != 8) {
        snprintf(problem, size, "bits must be 1, 2, 3, 4 or 8, not %d", w->bits);
    } else if (codebook < CODEBOOK_NONE || codebook >= CODEBOOK_COUNT || (codebook && (w->bits != 8 || w->width != 8))) {
        snprintf(problem, size, "codebook %d is not one of 0..%d for 8-bit weights", codebook, CODEBOOK_COUNT - 1);
    } else if (w->width != 8 && (w->bits != 8 || w->width < 2 || w->width > 6)) {
        snprintf(problem, size, "width %d is not 8, or 2..6 with 8-bit weights", w->width);
    } else if (w->zero < 0 || w->zero > 127) {
        snprintf(problem, size, "zero %d is not in 0..127", w->zero);
    } else if (group < divisor || group % divisor || (lut && group > lut_max_group(w->bits))) {
        snprintf(problem, size, "group %lld is not supported with %d-bit weights", (long long)group, w->bits);
    } else if (cols < 1 || cols % group) {
        snprintf(problem, size, "x has %lld columns, not a positive multiple of group %lld", (long long)cols,
                 (long long)group);
    } else if (h && cols % (32 / h)) {
        snprintf(problem, size, "%d-bit codes need a multiple of %d columns", w->width, 32 / h);
    } else if (has_high != (h > 0)) {
        snprintf(problem, size, "high must be given for widths 3, 5 and 6 only");
    } else if (has_sub == has_scales) {
        snprintf(problem, size, "give either scales or sub_codes and supers");
    } else if (has_sub && has_mins) {
        snprintf(problem, size, "two-level scales code their mins: mins must be None");
    } else if (lut && !has_mins && !has_sub && !w->zero) {
        snprintf(problem, size, "%d-bit weights need mins, a zero code or two-level scales", w->bits);
    }
    sizes->data = tiles * TILE_ROWS * cols / 8 * (lut ? w->bits : field);
    sizes->high = tiles * cols * h * 8;
    sizes->params = tiles * (cols / (group > 0 ? group : 1)) * TILE_ROWS;
    if (problem[0] || !has_sub) return;
    const int64_t groups = cols / group, values = w->sub_gps * (w->sub_mins ? 2 : 1);
    if (w->sub_bits != 4 && w->sub_bits != 6 && w->sub_bits != 8) {
        snprintf(problem, size, "sub_bits must be 4, 6 or 8, not %d", w->sub_bits);
    } else if (w->sub_gps < 1 || groups % w->sub_gps || values % 4 || w->sub_offset < 0 || w->sub_offset > 255) {
        snprintf(problem, size, "sub_groups must divide the groups, with a multiple of 4 codes, and sub_offset be 0..255");
    } else if (w->bits == 8 && w->sub_mins && group * 127 > INT16_MAX) {
        /* the two-level kernel pairs each group's activation code sum with its min code as int16 */
        snprintf(problem, size, "group %lld is over %d with two-level mins on 8-bit weights", (long long)group,
                 INT16_MAX / 127);
    }
    const int64_t bytes = sub_code_bytes(w->sub_bits, values);
    const int64_t supers = w->sub_gps > 0 ? groups / w->sub_gps : 0;
    sizes->sub_codes = tiles * supers * bytes * TILE_ROWS;
    sizes->supers = tiles * supers * (w->sub_mins ? 2 : 1) * TILE_ROWS;
}

/* One product's parsed arguments: its job and the buffers it holds until it is done. */
typedef struct {
    matmul_job job;
    buffer_arg buf[8]; /* data, scales, mins, x, y, high, sub codes, supers */
} matmul_call;

static void free_call(matmul_call *call) {
    free(call->job.acts.codes);
    free(call->job.acts.scales);
    release(call->buf, 8);
}

/* Parses and checks one product's arguments into `call` (its activations' scratch allocated);
 * -1 with a Python exception set. What it holds is freed by free_call either way. */
static int parse_matmul(PyObject *args, PyObject *kwargs, matmul_call *call) {
    static char *keywords[] = {"bits", "group", "rows", "data", "scales", "mins", "x", "y", "accumulate",
                               "codebook", "width", "zero", "high", "sub_codes", "supers", "sub_bits",
                               "sub_offset", "sub_groups", "sub_mins", NULL};
    int bits, codebook = CODEBOOK_NONE, width = 8, zero = 0, sub_bits = 0, sub_offset = 0, sub_mins = 0;
    Py_ssize_t group, rows, sub_groups = 0;
    PyObject *data_obj, *scales_obj, *mins_obj, *x_obj, *y_obj, *high_obj = Py_None, *codes_obj = Py_None,
             *supers_obj = Py_None;
    int accumulate = 0;
    buffer_arg *buf = call->buf;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "innOOOOO|piiiOOOiinp:matmul", keywords, &bits, &group, &rows,
                                     &data_obj, &scales_obj, &mins_obj, &x_obj, &y_obj, &accumulate, &codebook,
                                     &width, &zero, &high_obj, &codes_obj, &supers_obj, &sub_bits, &sub_offset,
                                     &sub_groups, &sub_mins))
        return -1;
    if (rows < 1) {
        PyErr_Format(PyExc_ValueError, "rows must be positive, not %zd", rows);
        return -1;
    }
    if (get_buffer(data_obj, &buf[0], "data", 1, "Bb", 0) ||
        (scales_obj != Py_None && get_buffer(scales_obj, &buf[1], "scales", 2, "He", 0)) ||
        (mins_obj != Py_None && get_buffer(mins_obj, &buf[2], "mins", 2, "He", 0)) ||
        get_buffer(x_obj, &buf[3], "x", 4, "f", 0) || get_buffer(y_obj, &buf[4], "y", 4, "f", 1) ||
        (high_obj != Py_None && get_buffer(high_obj, &buf[5], "high", 1, "B", 0)) ||
        (codes_obj != Py_None && get_buffer(codes_obj, &buf[6], "sub_codes", 1, "B", 0)) ||
        (supers_obj != Py_None && get_buffer(supers_obj, &buf[7], "supers", 2, "He", 0)))
        return -1;
    Py_buffer *x = &buf[3].view, *y = &buf[4].view;
    if (x->ndim != 2 || y->ndim != 2) {
        PyErr_Format(PyExc_ValueError, "x and y must be 2-D, not %d-D and %d-D", x->ndim, y->ndim);
        return -1;
    }
    const int64_t tokens = x->shape[0], cols = x->shape[1], tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    if (y->shape[0] != tokens || y->shape[1] != rows) {
        PyErr_Format(PyExc_ValueError, "y has shape [%zd, %zd]; expected [%zd, %zd]", y->shape[0], y->shape[1],
                     (Py_ssize_t)tokens, rows);
        return -1;
    }
    packed_matrix w = {
        .bits = bits, .group = group, .tiles = tiles, .cols = cols, .data = buf[0].view.buf,
        .scales = buf[1].held ? buf[1].view.buf : NULL, .mins = buf[2].held ? buf[2].view.buf : NULL,
        .codebook = int8_codebook(codebook), .width = width, .zero = zero,
        .high = buf[5].held ? buf[5].view.buf : NULL, .sub_codes = buf[6].held ? buf[6].view.buf : NULL,
        .supers = buf[7].held ? buf[7].view.buf : NULL, .sub_bits = sub_bits, .sub_offset = sub_offset,
        .sub_mins = sub_mins, .sub_gps = sub_groups,
    };
    matmul_sizes sizes = {0};
    char problem[200];
    matmul_problem(&w, codebook, buf[5].held, buf[1].held, buf[2].held, buf[6].held || buf[7].held, &sizes,
                   problem, sizeof problem);
    if (!problem[0] && buf[6].held != buf[7].held) snprintf(problem, sizeof problem, "sub_codes and supers go together");
    if (problem[0]) {
        PyErr_Format(PyExc_ValueError, "%s", problem);
        return -1;
    }
    if (check_length(&buf[0], "data", sizes.data) || (buf[1].held && check_length(&buf[1], "scales", sizes.params)) ||
        (buf[2].held && check_length(&buf[2], "mins", sizes.params)) ||
        (buf[5].held && check_length(&buf[5], "high", sizes.high)) ||
        (buf[6].held && check_length(&buf[6], "sub_codes", sizes.sub_codes)) ||
        (buf[7].held && check_length(&buf[7], "supers", sizes.supers)))
        return -1;
    matmul_job *job = &call->job;
    *job = (matmul_job){
        .w = w, .kernel = bits == 8 ? int8_tile_kernel(active_isa) : lut_tile_kernel(active_isa), .isa = active_isa,
        .x = x->buf, .y = y->buf, .rows = rows,
        .chunks = (tokens + TOKEN_CHUNK - 1) / TOKEN_CHUNK, .accumulate = accumulate,
    };
    job->acts.tokens = tokens;
    job->acts.codes_per_token = bits == 8 ? cols : cols / 4 * 16;
    if (tokens == 0) return 0;
    job->acts.codes = malloc((size_t)(tokens * job->acts.codes_per_token));
    job->acts.scales = malloc((size_t)(tokens * (cols / group) * 3) * sizeof(float));
    if (!job->acts.codes || !job->acts.scales) {
        PyErr_NoMemory();
        return -1;
    }
    job->acts.sums = job->acts.scales + tokens * (cols / group);
    job->acts.code_sums = (int32_t *)(job->acts.sums + tokens * (cols / group));
    return 0;
}

/* Several products as one job of the pool: item i is item i - starts[c] of call c, the last call whose
 * first item is at most i (calls without items are passed over). */
typedef struct {
    matmul_call *calls;
    int64_t count;
    int64_t *starts; /* [count + 1] */
    pool_fn fn;      /* prepare_item or tile_item, on one call's job */
} matmul_calls;

static void calls_item(void *ctx, int64_t item) {
    matmul_calls *all = ctx;
    int64_t lo = 0, hi = all->count - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (all->starts[mid] <= item) lo = mid; else hi = mid - 1;
    }
    all->fn(&all->calls[lo].job, item - all->starts[lo]);
}

/* Runs the calls' products (the GIL released): every activation prepared, then every tile, each step one
 * job of the pool, so that small products keep every thread busy and wait for each other once. */
static void run_matmuls(matmul_call *calls, int64_t count, int64_t *starts) {
    matmul_calls all = {.calls = calls, .count = count, .starts = starts, .fn = prepare_item};
    Py_BEGIN_ALLOW_THREADS
    starts[0] = 0;
    for (int64_t c = 0; c < count; c++) starts[c + 1] = starts[c] + calls[c].job.acts.tokens;
    if (starts[count] > INLINE_PREPARES) {
        pool_run(calls_item, &all, starts[count]);
    } else {
        for (int64_t item = 0; item < starts[count]; item++) calls_item(&all, item);
    }
    all.fn = tile_item;
    for (int64_t c = 0; c < count; c++) {
        const matmul_job *job = &calls[c].job;
        starts[c + 1] = starts[c] + (job->acts.tokens ? job->w.tiles * job->chunks : 0);
    }
    if (starts[count]) pool_run(calls_item, &all, starts[count]);
    Py_END_ALLOW_THREADS
}

static PyObject *py_matmul(PyObject *self, PyObject *args, PyObject *kwargs) {
    matmul_call call = {0};
    int64_t starts[2];
    const int failed = parse_matmul(args, kwargs, &call) != 0;
    if (!failed) run_matmuls(&call, 1, starts);
    free_call(&call);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(matmul_many_doc,
"matmul_many(calls)\n--\n\n"
"Each (args, kwargs) of calls (kwargs a dict or None) as matmul(*args, **kwargs), in one pass of the\n"
"thread pool: what a MoE layer's experts, each a small product, take together.");

static PyObject *py_matmul_many(PyObject *self, PyObject *calls_obj) {
    PyObject *seq = PySequence_Fast(calls_obj, "calls must be a sequence of (args, kwargs)");
    if (!seq) return NULL;
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    matmul_call *calls = calloc(count ? count : 1, sizeof *calls);
    int64_t *starts = malloc((count + 1) * sizeof *starts);
    int failed = !calls || !starts;
    if (failed) PyErr_NoMemory();
    for (Py_ssize_t c = 0; !failed && c < count; c++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, c), *args, *kwargs;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 || !PyTuple_Check(args = PyTuple_GET_ITEM(item, 0)) ||
            ((kwargs = PyTuple_GET_ITEM(item, 1)) != Py_None && !PyDict_Check(kwargs))) {
            PyErr_Format(PyExc_TypeError, "calls[%zd] is not a tuple (args tuple, kwargs dict or None)", c);
            failed = 1;
        } else {
            failed = parse_matmul(args, kwargs == Py_None ? NULL : kwargs, &calls[c]) != 0;
        }
    }
    if (!failed) run_matmuls(calls, count, starts);
    for (Py_ssize_t c = 0; calls && c < count; c++) free_call(&calls[c]);
    free(calls);
    free(starts);
    Py_DECREF(seq);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* A float32 C-contiguous array of `ndim` dimensions (any shape). */
static int get_floats(PyObject *obj, buffer_arg *arg, const char *name, int ndim, int writable) {
    if (get_buffer(obj, arg, name, 4, "f", writable)) return -1;
    if (arg->view.ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must be %d-D, not %d-D", name, ndim, arg->view.ndim);
        return -1;
    }
    return 0;
}

/* A layer's keys or values: float32, float16 or uint8 rows, C-contiguous, `ndim` dimensions. */
static int get_cache(PyObject *obj, buffer_arg *arg, const char *name, int ndim) {
    if (PyObject_GetBuffer(obj, &arg->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0) {
        PyErr_Clear();
        return PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous, writable array", name), -1;
    }
    arg->held = 1;
    const char *format = arg->view.format ? arg->view.format : "B";
    if (format[0] == '<' || format[0] == '=' || format[0] == '@') format++;
    const Py_ssize_t size = arg->view.itemsize;
    if (!((size == 4 && !strcmp(format, "f")) || (size == 2 && !strcmp(format, "e")) ||
          (size == 1 && !strcmp(format, "B")))) {
        PyErr_Format(PyExc_TypeError, "%s has item format '%s'; expected float32, float16 or uint8", name,
                     arg->view.format);
        return -1;
    }
    if (arg->view.ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must be %d-D, not %d-D", name, ndim, arg->view.ndim);
        return -1;
    }
    return 0;
}

/* Checks the cache's layout and qkv's width against each other and sets shape's head_dim, type
 * and row (items); returns the problem, or NULL. */
static const char *cache_problem(attention_shape *shape, const Py_buffer *keys, const Py_buffer *values,
                                 Py_ssize_t width) {
    const Py_ssize_t *ks = keys->shape, *vs = values->shape, heads = shape->heads, kv_heads = shape->kv_heads;
    if (ks[0] != vs[0] || ks[1] * 16 != vs[1] || ks[2] != vs[2] || ks[3] != 16)
        return "keys must be [kv_heads, capacity / 16, R, 16] and values [kv_heads, capacity, R]";
    if (keys->itemsize != values->itemsize) return "keys and values differ in type";
    if (heads < 1 || kv_heads < 1 || heads % kv_heads) return "heads is not a multiple of kv_heads";
    if (heads / kv_heads > 64) return "more than 64 query heads per key/value head";
    if (width % (heads + 2 * kv_heads)) return "qkv has the wrong width";
    const int64_t head_dim = width / (heads + 2 * kv_heads);
    shape->head_dim = head_dim, shape->row = vs[2];
    if (keys->itemsize > 1) {
        shape->kv = keys->itemsize == 4 ? KV_F32 : KV_F16;
        return shape->row == head_dim ? NULL : "float32 or float16 cache rows must hold head_dim values";
    }
    if (head_dim % 32 == 0 && shape->row == head_dim / 32 * 34) shape->kv = KV_Q8_0;
    else if (head_dim % 32 == 0 && shape->row == head_dim / 32 * 18) shape->kv = KV_Q4_0;
    else return "uint8 cache rows must be head_dim / 32 blocks of q8_0 (34 bytes) or q4_0 (18 bytes)";
    return NULL;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    PyObject *x_obj, *w_obj, *out_obj;
    float eps;
    if (!PyArg_ParseTuple(args, "OOfO:rms_norm", &x_obj, &w_obj, &eps, &out_obj)) return NULL;
    buffer_arg buf[3] = {{.held = 0}};
    if (get_floats(x_obj, &buf[0], "x", 2, 0) || get_floats(w_obj, &buf[1], "weight", 1, 0) ||
        get_floats(out_obj, &buf[2], "out", 2, 1)) {
        release(buf, 3);
        return NULL;
    }
    Py_ssize_t rows = buf[0].view.shape[0], size = buf[0].view.shape[1];
    if (buf[1].view.shape[0] != size || buf[2].view.shape[0] != rows || buf[2].view.shape[1] != size) {
        release(buf, 3);
        return PyErr_Format(PyExc_ValueError, "rms_norm: x [%zd, %zd] needs weight [%zd] and out of x's shape",
                            rows, size, size);
    }
    Py_BEGIN_ALLOW_THREADS
    rms_norm_rows(buf[0].view.buf, buf[1].view.buf, rows, size, eps, buf[2].view.buf);
    Py_END_ALLOW_THREADS
    release(buf, 3);
    Py_RETURN_NONE;
}

/* silu_mul(gate_up, out) and swiglu_oai(gate_up, out): an activation of [gate, up] rows into out. */
static PyObject *gated_activation(PyObject *args, const char *format,
                                  void (*rows_fn)(const float *, int64_t, int64_t, float *)) {
    PyObject *in_obj, *out_obj;
    if (!PyArg_ParseTuple(args, format, &in_obj, &out_obj)) return NULL;
    buffer_arg buf[2] = {{.held = 0}};
    if (get_floats(in_obj, &buf[0], "gate_up", 2, 0) || get_floats(out_obj, &buf[1], "out", 2, 1)) {
        release(buf, 2);
        return NULL;
    }
    Py_ssize_t rows = buf[0].view.shape[0], size = buf[1].view.shape[1];
    if (buf[1].view.shape[0] != rows || buf[0].view.shape[1] != 2 * size) {
        release(buf, 2);
        return PyErr_Format(PyExc_ValueError, "%s: gate_up [M, 2F] needs out [M, F]", format + 3);
    }
    Py_BEGIN_ALLOW_THREADS
    rows_fn(buf[0].view.buf, rows, size, buf[1].view.buf);
    Py_END_ALLOW_THREADS
    release(buf, 2);
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *args) {
    return gated_activation(args, "OO:silu_mul", silu_mul_rows);
}

static PyObject *py_swiglu_oai(PyObject *self, PyObject *args) {
    return gated_activation(args, "OO:swiglu_oai", swiglu_oai_rows);
}

/* Gets `count` float32 arrays of the given dimensions (the last `outputs` of them writable); on a
 * failure releases what it got and returns -1 with the exception set. */
static int get_all_floats(PyObject **objs, buffer_arg *buf, const char **names, const int *dims, int count,
                          int outputs) {
    for (int i = 0; i < count; i++) {
        if (get_floats(objs[i], &buf[i], names[i], dims[i], i >= count - outputs)) {
            release(buf, count);
            return -1;
        }
    }
    return 0;
}

/* A 1-D float32 array that may be None (then buf[at] stays unheld); on a failure releases buf[0 .. count)
 * and returns -1 with the exception set. */
static int get_optional_vector(PyObject *obj, buffer_arg *buf, int at, const char *name, int count) {
    if (obj == Py_None || !get_floats(obj, &buf[at], name, 1, 0)) return 0;
    release(buf, count);
    return -1;
}

static PyObject *shape_error(buffer_arg *buf, int count, const char *message) {
    release(buf, count);
    return PyErr_Format(PyExc_ValueError, "%s", message);
}

#define TEXT(x) #x
#define TEXT_OF(macro) TEXT(macro) /* a macro's value as a string literal */

static PyObject *py_delta_steps(PyObject *self, PyObject *args) {
    PyObject *objs[8];
    static const char *names[8] = {"state", "q", "k", "v", "g", "beta", "out", "next"};
    static const int dims[8] = {3, 3, 3, 3, 2, 2, 3, 3};
    buffer_arg buf[8] = {{.held = 0}};
    if (!PyArg_ParseTuple(args, "OOOOOOOO:delta_steps", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7]) ||
        get_all_floats(objs, buf, names, dims, 8, 2))
        return NULL;
    const Py_ssize_t heads = buf[0].view.shape[0], dk = buf[0].view.shape[1], dv = buf[0].view.shape[2];
    const Py_ssize_t tokens = buf[1].view.shape[0];
    /* each argument's expected shape: [H, dk, dv] for the states, [T, H, width] or [T, H] for the rest */
    const Py_ssize_t widths[8] = {dv, dk, dk, dv, 0, 0, dv, dv};
    int agree = dv % 16 == 0 && dv <= DELTA_MAX_DV;
    for (int i = 0; i < 8; i++) {
        const Py_ssize_t *shape = buf[i].view.shape;
        if (i == 0 || i == 7) agree = agree && shape[0] == heads && shape[1] == dk && shape[2] == dv;
        else agree = agree && shape[0] == tokens && shape[1] == heads && (dims[i] == 2 || shape[2] == widths[i]);
    }
    if (!agree)
        return shape_error(buf, 8, "delta_steps: state and next [H, Dk, Dv] (Dv a multiple of 16, at most "
                                   TEXT_OF(DELTA_MAX_DV) "), q, k [T, H, Dk], v, out [T, H, Dv] and g, beta [T, H] disagree");
    delta_step_job job = {
        .state = buf[0].view.buf, .q = buf[1].view.buf, .k = buf[2].view.buf, .v = buf[3].view.buf,
        .g = buf[4].view.buf, .beta = buf[5].view.buf, .out = buf[6].view.buf, .next = buf[7].view.buf,
        .tokens = tokens, .heads = heads, .dk = dk, .dv = dv,
    };
    Py_BEGIN_ALLOW_THREADS
    pool_run(delta_steps_head, &job, heads);
    Py_END_ALLOW_THREADS
    release(buf, 8);
    Py_RETURN_NONE;
}

static PyObject *py_scan_steps(PyObject *self, PyObject *args) {
    PyObject *objs[9];
    static const char *names[9] = {"state", "x", "dt", "a", "b", "c", "d", "out", "next"};
    static const int dims[9] = {3, 3, 2, 2, 3, 3, 1, 3, 3};
    buffer_arg buf[9] = {{.held = 0}};
    if (!PyArg_ParseTuple(args, "OOOOOOOOO:scan_steps", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &objs[6], &objs[7], &objs[8]) ||
        get_all_floats(objs, buf, names, dims, 9, 2))
        return NULL;
    const Py_ssize_t *state = buf[0].view.shape, *x = buf[1].view.shape, *dt = buf[2].view.shape,
                     *a = buf[3].view.shape, *b = buf[4].view.shape, *c = buf[5].view.shape,
                     *out = buf[7].view.shape, *next = buf[8].view.shape;
    const Py_ssize_t heads = state[0], head_dim = state[1], n = state[2], tokens = x[0], groups = b[1];
    int agree = n % 16 == 0 && n > 0 && n <= SCAN_MAX_N && groups > 0 && heads % groups == 0 &&
                x[1] == heads && x[2] == head_dim && dt[0] == tokens && dt[1] == heads &&
                a[0] == heads && (a[1] == 1 || a[1] == n) && b[0] == tokens && b[2] == n &&
                c[0] == tokens && c[1] == groups && c[2] == n && buf[6].view.shape[0] == heads;
    for (int i = 0; i < 3; i++) agree = agree && out[i] == x[i] && next[i] == state[i];
    if (!agree)
        return shape_error(buf, 9, "scan_steps: state and next [H, P, N] (N a multiple of 16, at most "
                                   TEXT_OF(SCAN_MAX_N) "), x and out [T, H, P], dt [T, H], a [H, 1 or N], "
                                   "b and c [T, G, N] (G dividing H) and d [H] disagree");
    /* about 2048 state elements an item: Mamba-2's heads one each, Mamba-1's channels in runs */
    const int64_t per_item = head_dim * n >= 2048 ? 1 : 2048 / (head_dim * n);
    scan_job job = {
        .state = buf[0].view.buf, .x = buf[1].view.buf, .dt = buf[2].view.buf, .a = buf[3].view.buf,
        .b = buf[4].view.buf, .c = buf[5].view.buf, .d = buf[6].view.buf, .out = buf[7].view.buf,
        .next = buf[8].view.buf, .tokens = tokens, .heads = heads, .head_dim = head_dim, .state_size = n,
        .groups = groups, .decays = a[1], .heads_per_item = per_item,
    };
    Py_BEGIN_ALLOW_THREADS
    pool_run(scan_steps_item, &job, (heads + per_item - 1) / per_item);
    Py_END_ALLOW_THREADS
    release(buf, 9);
    Py_RETURN_NONE;
}

static PyObject *py_conv_silu(PyObject *self, PyObject *args) {
    PyObject *objs[4], *bias_obj;
    static const char *names[4] = {"history", "x", "weight", "out"};
    static const int dims[4] = {2, 2, 2, 2};
    buffer_arg buf[5] = {{.held = 0}};
    if (!PyArg_ParseTuple(args, "OOOOO:conv_silu", &objs[0], &objs[1], &objs[2], &bias_obj, &objs[3]) ||
        get_all_floats(objs, buf, names, dims, 4, 1) || get_optional_vector(bias_obj, buf, 4, "bias", 5))
        return NULL;
    const int has_bias = buf[4].held;
    const Py_ssize_t *history = buf[0].view.shape, *x = buf[1].view.shape, *weight = buf[2].view.shape;
    const Py_ssize_t channels = x[1], taps = weight[1];
    if (taps < 1 || taps > CONV_MAX_TAPS || history[0] != taps - 1 || history[1] != channels ||
        weight[0] != channels || buf[3].view.shape[0] != x[0] || buf[3].view.shape[1] != channels ||
        (has_bias && buf[4].view.shape[0] != channels))
        return shape_error(buf, 5, "conv_silu: history [K-1, C], x and out [T, C], weight [C, K] (K at most "
                                   "64) and bias [C] (or None) disagree");
    Py_BEGIN_ALLOW_THREADS
    conv_silu_rows(buf[0].view.buf, buf[1].view.buf, buf[2].view.buf, has_bias ? buf[4].view.buf : NULL, x[0],
                   channels, taps, buf[3].view.buf);
    Py_END_ALLOW_THREADS
    release(buf, 5);
    Py_RETURN_NONE;
}

static PyObject *py_delta_split(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    static const char *names[3] = {"conv_out", "q", "k"};
    static const int dims[3] = {2, 3, 3};
    Py_ssize_t key_heads;
    int interleaved;
    float eps;
    buffer_arg buf[3] = {{.held = 0}};
    if (!PyArg_ParseTuple(args, "OnpfOO:delta_split", &objs[0], &key_heads, &interleaved, &eps, &objs[1], &objs[2]) ||
        get_all_floats(objs, buf, names, dims, 3, 2))
        return NULL;
    const Py_ssize_t *conv = buf[0].view.shape, *q = buf[1].view.shape, *k = buf[2].view.shape;
    const Py_ssize_t tokens = conv[0], heads = q[1], dk = q[2];
    if (key_heads < 1 || heads % key_heads || conv[1] != (2 * key_heads + heads) * dk || q[0] != tokens ||
        k[0] != tokens || k[1] != heads || k[2] != dk)
        return shape_error(buf, 3, "delta_split: conv_out [T, (2 key_heads + H) Dk] and q, k [T, H, Dk] disagree "
                                   "(H a multiple of key_heads)");
    Py_BEGIN_ALLOW_THREADS
    delta_split_rows(buf[0].view.buf, tokens, key_heads, heads, dk, interleaved, eps, buf[1].view.buf, buf[2].view.buf);
    Py_END_ALLOW_THREADS
    release(buf, 3);
    Py_RETURN_NONE;
}

static PyObject *py_delta_gates(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    static const char *names[6] = {"alpha", "beta_in", "dt", "a", "g", "beta"};
    static const int dims[6] = {2, 2, 1, 1, 2, 2};
    buffer_arg buf[6] = {{.held = 0}};
    if (!PyArg_ParseTuple(args, "OOOOOO:delta_gates", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5]) ||
        get_all_floats(objs, buf, names, dims, 6, 2))
        return NULL;
    const Py_ssize_t tokens = buf[0].view.shape[0], heads = buf[0].view.shape[1];
    int agree = buf[2].view.shape[0] == heads && buf[3].view.shape[0] == heads;
    for (int i = 1; i < 6; i++)
        agree = agree && (dims[i] == 1 || (buf[i].view.shape[0] == tokens && buf[i].view.shape[1] == heads));
    if (!agree) return shape_error(buf, 6, "delta_gates: alpha, beta_in, g and beta [T, H] and dt, a [H] disagree");
    Py_BEGIN_ALLOW_THREADS
    delta_gates_rows(buf[0].view.buf, buf[1].view.buf, buf[2].view.buf, buf[3].view.buf, tokens, heads,
                     buf[4].view.buf, buf[5].view.buf);
    Py_END_ALLOW_THREADS
    release(buf, 6);
    Py_RETURN_NONE;
}

static PyObject *py_gate_group_norm(PyObject *self, PyObject *args) {
    PyObject *objs[3], *weight_obj;
    static const char *names[3] = {"y", "z", "out"};
    static const int dims[3] = {2, 2, 2};
    Py_ssize_t groups;
    float eps;
    buffer_arg buf[4] = {{.held = 0}};
    if (!PyArg_ParseTuple(args, "OOOnfO:gate_group_norm", &objs[0], &objs[1], &weight_obj, &groups, &eps,
                          &objs[2]) ||
        get_all_floats(objs, buf, names, dims, 3, 1) || get_optional_vector(weight_obj, buf, 3, "weight", 4))
        return NULL;
    const int has_weight = buf[3].held;
    const Py_ssize_t rows = buf[0].view.shape[0], size = buf[0].view.shape[1];
    int agree = groups > 0 && size % groups == 0 && (!has_weight || buf[3].view.shape[0] == size);
    for (int i = 1; i < 3; i++) agree = agree && buf[i].view.shape[0] == rows && buf[i].view.shape[1] == size;
    if (!agree)
        return shape_error(buf, 4, "gate_group_norm: y, z and out [R, N], weight [N] (or None) and groups "
                                   "(dividing N) disagree");
    Py_BEGIN_ALLOW_THREADS
    gate_group_norm_rows(buf[0].view.buf, buf[1].view.buf, has_weight ? buf[3].view.buf : NULL, rows, size, groups,
                         eps, buf[2].view.buf);
    Py_END_ALLOW_THREADS
    release(buf, 4);
    Py_RETURN_NONE;
}

static PyObject *py_gated_rms_norm(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    static const char *names[4] = {"x", "weight", "gate", "out"};
    static const int dims[4] = {2, 1, 2, 2};
    float eps;
    buffer_arg buf[4] = {{.held = 0}};
    if (!PyArg_ParseTuple(args, "OOOfO:gated_rms_norm", &objs[0], &objs[1], &objs[2], &eps, &objs[3]) ||
        get_all_floats(objs, buf, names, dims, 4, 1))
        return NULL;
    const Py_ssize_t rows = buf[0].view.shape[0], size = buf[0].view.shape[1];
    if (buf[1].view.shape[0] != size || buf[2].view.shape[0] != rows || buf[2].view.shape[1] != size ||
        buf[3].view.shape[0] != rows || buf[3].view.shape[1] != size)
        return shape_error(buf, 4, "gated_rms_norm: x, gate and out [R, N] and weight [N] disagree");
    Py_BEGIN_ALLOW_THREADS
    gated_rms_norm_rows(buf[0].view.buf, buf[1].view.buf, buf[2].view.buf, rows, size, eps, buf[3].view.buf);
    Py_END_ALLOW_THREADS
    release(buf, 4);
    Py_RETURN_NONE;
}

static PyObject *py_crc32(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I:crc32", &data, &crc)) return NULL;
    uint32_t result;
    Py_BEGIN_ALLOW_THREADS
    result = crc32_zlib(crc, data.buf, (int64_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(result);
}

static PyObject *py_crc32_folds(PyObject *self, PyObject *unused) { return PyBool_FromLong(crc32_folds()); }

static PyObject *py_weighted_rows(PyObject *self, PyObject *args) {
    PyObject *rows_obj, *picks_obj, *weights_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OOOO:weighted_rows", &rows_obj, &picks_obj, &weights_obj, &out_obj)) return NULL;
    buffer_arg buf[4] = {{.held = 0}};
    if (get_floats(rows_obj, &buf[0], "rows", 2, 0) || get_buffer(picks_obj, &buf[1], "picks", 8, "lq", 0) ||
        get_floats(weights_obj, &buf[2], "weights", 2, 0) || get_floats(out_obj, &buf[3], "out", 2, 1)) {
        release(buf, 4);
        return NULL;
    }
    const Py_ssize_t count = buf[0].view.shape[0], size = buf[0].view.shape[1];
    const Py_ssize_t *picks_shape = buf[1].view.shape, *weights_shape = buf[2].view.shape, *out_shape = buf[3].view.shape;
    const char *problem = NULL;
    if (buf[1].view.ndim != 2 || weights_shape[0] != picks_shape[0] || weights_shape[1] != picks_shape[1] ||
        out_shape[0] != picks_shape[0] || out_shape[1] != size) {
        problem = "weighted_rows: rows [N, E], picks and weights [T, k] and out [T, E] disagree";
    }
    const int64_t *picks = buf[1].view.buf;
    for (Py_ssize_t i = 0; !problem && i < picks_shape[0] * picks_shape[1]; i++) {
        if (picks[i] < 0 || picks[i] >= count) problem = "weighted_rows: a pick is not a row of rows";
    }
    if (problem) {
        release(buf, 4);
        return PyErr_Format(PyExc_ValueError, "%s", problem);
    }
    weighted_rows(buf[0].view.buf, size, picks, buf[2].view.buf, picks_shape[0], picks_shape[1], buf[3].view.buf);
    release(buf, 4);
    Py_RETURN_NONE;
}

static PyObject *py_dense_matmul(PyObject *self, PyObject *args) {
    PyObject *objs[3], *bias_obj;
    static const char *names[3] = {"x", "weight", "out"};
    static const int dims[3] = {2, 2, 2};
    buffer_arg buf[4] = {{.held = 0}};
    if (!PyArg_ParseTuple(args, "OOOO:dense_matmul", &objs[0], &objs[1], &bias_obj, &objs[2])) return NULL;
    if (get_all_floats(objs, buf, names, dims, 3, 1) || get_optional_vector(bias_obj, buf, 3, "bias", 4))
        return NULL;
    const int has_bias = buf[3].held;
    const Py_ssize_t tokens = buf[0].view.shape[0], cols = buf[0].view.shape[1], rows = buf[1].view.shape[0];
    if (buf[1].view.shape[1] != cols || buf[2].view.shape[0] != tokens || buf[2].view.shape[1] != rows ||
        (has_bias && buf[3].view.shape[0] != rows))
        return shape_error(buf, 4, "dense_matmul: x [T, K], weight [N, K], bias [N] (or None) and out [T, N] disagree");
    dense_job job = {.weight = buf[1].view.buf, .x = buf[0].view.buf, .bias = has_bias ? buf[3].view.buf : NULL,
                     .out = buf[2].view.buf, .rows = rows, .cols = cols, .tokens = tokens};
    Py_BEGIN_ALLOW_THREADS
    if (tokens && rows) pool_run(dense_item, &job, (rows + DENSE_ROWS - 1) / DENSE_ROWS);
    Py_END_ALLOW_THREADS
    release(buf, 4);
    Py_RETURN_NONE;
}

/* Whether the pass fits in the cache: the slots it scores, from the block of the first position its
 * first token sees to the last token rounded up to 16, are no more than the capacity (as
 * tierflow.kv_types.scored_slots counts them), so that no two of its positions share a slot of a
 * ring. A whole-context cache (no window) thus needs start + tokens <= capacity. */
static int pass_fits(const attention_shape *shape, Py_ssize_t tokens, Py_ssize_t start, Py_ssize_t tree_start,
                     Py_ssize_t window) {
    const Py_ssize_t first = window && tree_start + 1 > window ? tree_start + 1 - window : 0;
    return (start + tokens + 15) / 16 * 16 - first / 16 * 16 <= shape->capacity;
}

/* The other arguments of attention against the shape; the problem, or NULL. */
static const char *argument_problem(const attention_shape *shape, const buffer_arg *buf, Py_ssize_t tokens,
                                    Py_ssize_t start, Py_ssize_t tree_start, const int32_t *parents,
                                    Py_ssize_t window, Py_ssize_t held_from) {
    const Py_ssize_t rope_dim = shape->rope_dim, *cos = buf[3].view.shape, *sin = buf[4].view.shape;
    if (rope_dim < 0 || rope_dim % 2 || rope_dim > shape->head_dim) return "rope_dim must be even and <= head_dim";
    if (cos[0] != tokens || cos[1] != rope_dim / 2 || sin[0] != tokens || sin[1] != rope_dim / 2)
        return "cos and sin must be [T, rope_dim / 2]";
    if (window < 0) return "window must be >= 0 (0: none)";
    if (start < 0 || (parents && tree_start > start)) return "start must be >= 0 and tree_start <= start";
    if (!pass_fits(shape, tokens, start, parents ? tree_start : start, window))
        return window ? "the pass's tokens and the window before them do not fit in the cache's ring"
                      : "the tokens do not fit in the cache";
    if (held_from < 0 || held_from > (parents ? tree_start : start))
        return "held_from must be >= 0 and at most the first new token's position";
    if (buf[5].view.shape[0] != tokens || buf[5].view.shape[1] != shape->heads * shape->head_dim)
        return "out must be [T, heads * head_dim]";
    if (parents && buf[6].view.len != (start - tree_start + tokens) * 4)
        return "parents must hold one index per tree token (start - tree_start + T)";
    for (Py_ssize_t i = 0; parents && i < start - tree_start + tokens; i++) {
        if (parents[i] < -1 || parents[i] >= i) return "parents[i] must be -1 (a root) or an earlier token";
    }
    return NULL;
}

PyDoc_STRVAR(attention_doc,
"attention(qkv, keys, values, cos, sin, out, heads, start, rope_dim, neox, scale, parents=None,\n"
"          tree_start=start, window=0, softcap=0, held_from=0, sinks=None)\n--\n\n"
"Causal attention of T new tokens at positions start ..: rotates q and k in qkv\n"
"[T, (heads + 2 * kv_heads) * head_dim] in place, writes k and v into the layer's cache in its type\n"
"(rows of R items: float32 or float16 [head_dim], or uint8 q8_0 / q4_0 blocks; keys in blocks of 16\n"
"positions, [kv_heads, capacity / 16, R, 16]; values [kv_heads, capacity, R]), and writes out\n"
"[T, heads * head_dim]. With parents the tokens extend a tree begun at\n"
"slot tree_start: parents (int32 [start - tree_start + T]) gives each tree token's parent, -1 or\n"
"an earlier one, and a token sees the cache before tree_start and its ancestors. Scores are scaled by\n"
"scale, then with softcap > 0 capped to softcap * tanh(score / softcap); with window > 0 the token at\n"
"position p sees positions p - window + 1 .. p only (a tree token's position: tree_start + its depth).\n"
"Position p is in slot p % capacity: a ring, with a window, when the context is longer than the\n"
"capacity; a pass must fit (the window before its tokens and they, in whole blocks of 16, at most\n"
"the capacity). No position before held_from (the oldest the cache holds) is seen. sinks (float32\n"
"[heads], or None) gives each query head one more logit in its softmax, which takes probability\n"
"and adds no value (an attention sink).");

static PyObject *py_attention(PyObject *self, PyObject *args) {
    PyObject *objs[8] = {NULL};
    Py_ssize_t heads, start, rope_dim, tree_start = -1, window = 0, held_from = 0;
    int neox;
    float scale, softcap = 0.0f;
    if (!PyArg_ParseTuple(args, "OOOOOOnnnpf|OnnfnO:attention", &objs[0], &objs[1], &objs[2], &objs[3],
                          &objs[4], &objs[5], &heads, &start, &rope_dim, &neox, &scale, &objs[6],
                          &tree_start, &window, &softcap, &held_from, &objs[7]))
        return NULL;
    if (tree_start < 0) tree_start = start;
    buffer_arg buf[8] = {{.held = 0}};
    if (get_floats(objs[0], &buf[0], "qkv", 2, 1) || get_cache(objs[1], &buf[1], "keys", 4) ||
        get_cache(objs[2], &buf[2], "values", 3) || get_floats(objs[3], &buf[3], "cos", 2, 0) ||
        get_floats(objs[4], &buf[4], "sin", 2, 0) || get_floats(objs[5], &buf[5], "out", 2, 1) ||
        (objs[6] && objs[6] != Py_None && get_buffer(objs[6], &buf[6], "parents", 4, "i", 0)) ||
        (objs[7] && objs[7] != Py_None && get_floats(objs[7], &buf[7], "sinks", 1, 0))) {
        release(buf, 8);
        return NULL;
    }
    const int32_t *parents = buf[6].held ? buf[6].view.buf : NULL;
    const Py_ssize_t tokens = buf[0].view.shape[0];
    attention_shape shape = {heads, buf[2].view.shape[0], 0, rope_dim, buf[2].view.shape[1], neox, KV_F32, 0};
    const char *problem = cache_problem(&shape, &buf[1].view, &buf[2].view, buf[0].view.shape[1]);
    if (!problem) problem = argument_problem(&shape, buf, tokens, start, tree_start, parents, window, held_from);
    if (!problem && (!isfinite(scale) || !(softcap >= 0.0f) || !isfinite(softcap)))
        problem = "scale must be finite and softcap a finite number >= 0 (0: none)";
    if (!problem && buf[7].held && buf[7].view.shape[0] != heads) problem = "sinks must be [heads]";
    if (problem) {
        release(buf, 8);
        return PyErr_Format(PyExc_ValueError, "attention: %s", problem);
    }
    attention_job job = {shape, attend_kernel(active_isa), buf[0].view.buf, buf[1].view.buf, buf[2].view.buf,
                         buf[3].view.buf, buf[4].view.buf, tokens, start, scale, parents, tree_start,
                         buf[5].view.buf, window, softcap, held_from, buf[7].held ? buf[7].view.buf : NULL, 0};
    Py_BEGIN_ALLOW_THREADS
    attention_prepare(&job);
    /* Short contexts take microseconds: waking the pool would cost more than it saves. */
    if (tokens * heads * (start + tokens) * shape.head_dim >= (1 << 16)) {
        pool_run(attention_item, &job, tokens * shape.kv_heads);
    } else {
        for (Py_ssize_t item = 0; item < tokens * shape.kv_heads; item++) attention_item(&job, item);
    }
    Py_END_ALLOW_THREADS
    release(buf, 8);
    if (atomic_load(&job.failed)) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    long threads = PyLong_AsLong(arg);
    if (threads == -1 && PyErr_Occurred()) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = threads >= 1 && threads <= 256 ? pool_set_threads((int)threads) : -1;
    Py_END_ALLOW_THREADS
    if (status == -1) return PyErr_Format(PyExc_ValueError, "threads must be 1..256, not %ld", threads);
    if (status == -2) return PyErr_Format(PyExc_OSError, "could not start %ld kernel threads", threads);
    Py_RETURN_NONE;
}

static PyObject *py_threads(PyObject *self, PyObject *unused) { return PyLong_FromLong(pool_threads()); }

static PyObject *py_isa(PyObject *self, PyObject *unused) { return PyUnicode_FromString(ISA_NAMES[active_isa]); }

static PyObject *py_supported_isas(PyObject *self, PyObject *unused) {
    PyObject *names = PyTuple_New(best_isa + 1);
    for (int i = 0; names && i <= (int)best_isa; i++) {
        PyTuple_SET_ITEM(names, i, PyUnicode_FromString(ISA_NAMES[i]));
    }
    return names;
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    for (int i = 0; i <= (int)best_isa; i++) {
        if (strcmp(name, ISA_NAMES[i]) == 0) {
            active_isa = (isa_t)i;
            Py_RETURN_NONE;
        }
    }
    return PyErr_Format(PyExc_ValueError, "ISA '%s' is not one this CPU supports (best: %s)", name,
                        ISA_NAMES[best_isa]);
}

PyDoc_STRVAR(pack_fields_doc,
"pack_fields(q, zero, width, data, high)\n--\n\n"
"Lays out int8 codes q [N, K] as unsigned codes q + zero of `width` (2..6) bits in packed.py's layout of\n"
"fields: their low `field` bits (4 from width 4 on, else 2) into data (uint8 [T, K * field / 32, 64, 4]),\n"
"their h = width - field high bits into high (uint8 [T, K * h / 32, 64, 4], or None when h is 0); rows\n"
"past N are zeros. Returns False, having written part of the arrays, when a code plus zero does not fit.");

/* One row's codes into the field bytes (and high bits) of its tile row; 0 when a code does not fit. */
static int pack_row(const int8_t *q, int64_t cols, int zero, int width, uint8_t *data, uint8_t *high) {
    const int field = width_field_bits(width), h = width - field, per_block = 8 / field, per_byte = h ? 8 / h : 1;
    for (int64_t quad = 0; quad < cols / 4; quad++) {
        for (int j = 0; j < 4; j++) {
            const int code = q[4 * quad + j] + zero;
            if (code < 0 || code >= 1 << width) return 0;
            /* field byte (o, r, j): quad per_block * o + i at bits field * i */
            data[(quad / per_block) * TILE_ROWS * 4 + j] |= (uint8_t)((code & ((1 << field) - 1)) << (field * (quad % per_block)));
            if (h) high[(quad / per_byte) * TILE_ROWS * 4 + j] |= (uint8_t)((code >> field) << (h * (quad % per_byte)));
        }
    }
    return 1;
}

static PyObject *py_pack_fields(PyObject *self, PyObject *args) {
    PyObject *q_obj, *data_obj, *high_obj;
    int zero, width;
    if (!PyArg_ParseTuple(args, "OiiOO:pack_fields", &q_obj, &zero, &width, &data_obj, &high_obj)) return NULL;
    buffer_arg buf[3] = {{.held = 0}};
    if (get_buffer(q_obj, &buf[0], "q", 1, "b", 0) || get_buffer(data_obj, &buf[1], "data", 1, "B", 1) ||
        (high_obj != Py_None && get_buffer(high_obj, &buf[2], "high", 1, "B", 1))) {
        release(buf, 3);
        return NULL;
    }
    const Py_buffer *q = &buf[0].view;
    const int field = width_field_bits(width), h = width - field;
    if (q->ndim != 2 || width < 2 || width > 6 || zero < 0 || zero > 127 || (h > 0) != buf[2].held ||
        q->shape[1] % (h ? 32 / h : 32 / field)) {
        release(buf, 3);
        return PyErr_Format(PyExc_ValueError, "pack_fields: q must be 2-D with whole blocks of columns, width 2..6 "
                            "(high given for 3, 5 and 6), zero 0..127");
    }
    const int64_t rows = q->shape[0], cols = q->shape[1], tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    if (check_length(&buf[1], "data", tiles * TILE_ROWS * cols * field / 8) ||
        (buf[2].held && check_length(&buf[2], "high", tiles * cols * h * 8))) {
        release(buf, 3);
        return NULL;
    }
    int fits = 1;
    Py_BEGIN_ALLOW_THREADS
    memset(buf[1].view.buf, 0, buf[1].view.len);
    if (buf[2].held) memset(buf[2].view.buf, 0, buf[2].view.len);
    for (int64_t row = 0; fits && row < rows; row++) {
        const int64_t tile = row / TILE_ROWS, r = row % TILE_ROWS;
        uint8_t *data = (uint8_t *)buf[1].view.buf + tile * cols * TILE_ROWS * field / 8 + 4 * r;
        uint8_t *high = buf[2].held ? (uint8_t *)buf[2].view.buf + tile * cols * h * 8 + 4 * r : NULL;
        fits = pack_row((const int8_t *)q->buf + row * cols, cols, zero, width, data, high);
    }
    Py_END_ALLOW_THREADS
    release(buf, 3);
    return PyBool_FromLong(fits);
}

PyDoc_STRVAR(transcode_doc,
"transcode(ggml_type, src, cols, row0, data, high, sub_codes, supers, scales, mins)\n--\n\n"
"Writes a Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS or MXFP4 tensor's rows (src: its GGUF bytes,\n"
"whole rows of `cols` columns) into rows row0 .. of a packed matrix's arrays (packed.py's layout, whose\n"
"padding rows the caller zeroes; the arrays the type's form lacks are None), as pack(to_quant_groups(...))\n"
"would. Returns -1, or the first row with a block scale the layout cannot hold (not a finite number, or an MXFP4\n"
"scale outside float16's exact powers of two); the rows before it are written.");

enum { TRANSCODE_ARRAYS = 6 };

static PyObject *py_transcode(PyObject *self, PyObject *args) {
    PyObject *src_obj, *objs[TRANSCODE_ARRAYS];
    int ggml_type;
    Py_ssize_t cols, row0;
    if (!PyArg_ParseTuple(args, "iOnnOOOOOO:transcode", &ggml_type, &src_obj, &cols, &row0, &objs[0], &objs[1],
                          &objs[2], &objs[3], &objs[4], &objs[5]))
        return NULL;
    const int64_t block_bytes = transcode_block_bytes(ggml_type);
    if (!block_bytes)
        return PyErr_Format(PyExc_ValueError,
                            "transcode: ggml type %d is not Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS or MXFP4",
                            ggml_type);
    const int64_t block_values = transcode_block_values(ggml_type);
    const int super = block_values == 256;
    const int five = ggml_type == GGML_Q5_0 || ggml_type == GGML_Q5_1 || ggml_type == GGML_Q5_K;
    const int field = ggml_type == GGML_Q8_0 ? 8 : 4, h = five ? 1 : ggml_type == GGML_Q6_K ? 2 : 0;
    const int with_min = ggml_type == GGML_Q4_1 || ggml_type == GGML_Q5_1;
    /* data, high, sub_codes, supers, scales, mins */
    const int wanted[TRANSCODE_ARRAYS] = {1, h > 0, super, super, !super, with_min};
    static const char *names[TRANSCODE_ARRAYS] = {"data", "high", "sub_codes", "supers", "scales", "mins"};
    static const char *formats[TRANSCODE_ARRAYS] = {"bB", "B", "B", "He", "He", "He"};
    buffer_arg buf[TRANSCODE_ARRAYS + 1] = {{.held = 0}}; /* the arrays, then src */
    buffer_arg *src = &buf[TRANSCODE_ARRAYS];
    int failed = get_buffer(src_obj, src, "src", 1, "B", 0);
    for (int i = 0; i < TRANSCODE_ARRAYS && !failed; i++) {
        if (wanted[i] != (objs[i] != Py_None)) {
            release(buf, TRANSCODE_ARRAYS + 1);
            return PyErr_Format(PyExc_ValueError, "transcode: %s must %s for this type", names[i],
                                wanted[i] ? "be given" : "be None");
        }
        if (wanted[i]) failed = get_buffer(objs[i], &buf[i], names[i], i >= 3 ? 2 : 1, formats[i], 1);
    }
    if (failed) {
        release(buf, TRANSCODE_ARRAYS + 1);
        return NULL;
    }
    const int64_t blocks_per_row = cols > 0 && cols % block_values == 0 ? cols / block_values : 0;
    const int64_t rows = blocks_per_row ? src->view.len / (blocks_per_row * block_bytes) : 0;
    const int64_t tiles = (row0 + rows + TILE_ROWS - 1) / TILE_ROWS, blocks = tiles * blocks_per_row;
    const int64_t sub_bytes = ggml_type == GGML_Q6_K ? 16 : ggml_type == GGML_IQ4_XS ? 6 : 12;
    const int64_t halves = ggml_type == GGML_Q6_K || ggml_type == GGML_IQ4_XS ? 1 : 2;
    const int64_t needed[TRANSCODE_ARRAYS] = {
        tiles * TILE_ROWS * cols * field / 8, tiles * TILE_ROWS * cols * h / 8, blocks * sub_bytes * TILE_ROWS,
        blocks * halves * TILE_ROWS * 2, blocks * TILE_ROWS * 2, blocks * TILE_ROWS * 2};
    const char *problem = NULL;
    if (rows < 1 || src->view.len != rows * blocks_per_row * block_bytes || row0 < 0)
        problem = "src must be whole rows of the type's blocks, and row0 at least 0";
    for (int i = 0; i < TRANSCODE_ARRAYS && !problem; i++) {
        if (wanted[i] && buf[i].view.len < needed[i]) problem = "the packed arrays are too small for rows row0 .. of these blocks";
    }
    if (problem) {
        release(buf, TRANSCODE_ARRAYS + 1);
        return PyErr_Format(PyExc_ValueError, "transcode: %s", problem);
    }
    void *arrays[TRANSCODE_ARRAYS];
    for (int i = 0; i < TRANSCODE_ARRAYS; i++) arrays[i] = buf[i].held ? buf[i].view.buf : NULL;
    const packed_out out = {arrays[0], arrays[1], arrays[2], arrays[3], arrays[4], arrays[5]};
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = transcode_rows(ggml_type, src->view.buf, rows, cols, row0, &out);
    Py_END_ALLOW_THREADS
    release(buf, TRANSCODE_ARRAYS + 1);
    return PyLong_FromLongLong(bad);
}

static PyMethodDef methods[] = {
    {"transcode", py_transcode, METH_VARARGS, transcode_doc},
    {"pack_fields", py_pack_fields, METH_VARARGS, pack_fields_doc},
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_VARARGS | METH_KEYWORDS, matmul_doc},
    {"matmul_many", py_matmul_many, METH_O, matmul_many_doc},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x, weight, eps, out): out = x / rms(x) * weight, per row."},
    {"crc32", py_crc32, METH_VARARGS, "crc32(data, crc=0): zlib.crc32's value, at memory speed where the CPU has PCLMULQDQ."},
    {"crc32_folds", py_crc32_folds, METH_NOARGS, "crc32_folds(): whether crc32 folds with PCLMULQDQ on this CPU."},
    {"delta_steps", py_delta_steps, METH_VARARGS,
     "delta_steps(state, q, k, v, g, beta, out, next): the gated delta rule through T tokens for every value head."},
    {"scan_steps", py_scan_steps, METH_VARARGS,
     "scan_steps(state, x, dt, a, b, c, d, out, next): Mamba's selective scan through T tokens for every head."},
    {"conv_silu", py_conv_silu, METH_VARARGS,
     "conv_silu(history, x, weight, bias, out): out = silu of each channel's causal convolution of [history, x] "
     "(plus bias, or None)."},
    {"delta_split", py_delta_split, METH_VARARGS,
     "delta_split(conv_out, key_heads, interleaved, eps, q, k): L2-normed queries and keys per value head."},
    {"delta_gates", py_delta_gates, METH_VARARGS,
     "delta_gates(alpha, beta_in, dt, a, g, beta): g = softplus(alpha + dt) * a, beta = sigmoid(beta_in)."},
    {"gate_group_norm", py_gate_group_norm, METH_VARARGS,
     "gate_group_norm(y, z, weight, groups, eps, out): out = y * silu(z), then (weight not None) each group "
     "RMS-normed, times weight."},
    {"gated_rms_norm", py_gated_rms_norm, METH_VARARGS,
     "gated_rms_norm(x, weight, gate, eps, out): out = x / rms(x) * weight * silu(gate), per row."},
    {"dense_matmul", py_dense_matmul, METH_VARARGS,
     "dense_matmul(x, weight, bias, out): out = x @ weight.T (+ bias) in float32, each dot product summed alike."},
    {"weighted_rows", py_weighted_rows, METH_VARARGS,
     "weighted_rows(rows, picks, weights, out): out[t] = sum over j of weights[t, j] * rows[picks[t, j]], j ascending."},
    {"swiglu_oai", py_swiglu_oai, METH_VARARGS,
     "swiglu_oai(gate_up, out): out = g / (1 + exp(-1.702 g)) * (u + 1), g = min(gate, 7), u = clamp(up, -7, 7)."},
    {"silu_mul", py_silu_mul, METH_VARARGS, "silu_mul(gate_up, out): out = silu(gate) * up, gate_up = [gate, up] per row."},
    {"attention", py_attention, METH_VARARGS, attention_doc},
    {"set_threads", py_set_threads, METH_O, "Threads the kernels use, the caller included."},
    {"threads", py_threads, METH_NOARGS, "Threads the kernels use."},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels use now."},
    {"supported_isas", py_supported_isas, METH_NOARGS, "Instruction sets this CPU runs, slowest first."},
    {"set_isa", py_set_isa, METH_O, "Use a slower instruction set (for tests and benchmarks)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "tierflow's CPU matmul kernels.", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    best_isa = active_isa = detect_isa();
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "DELTA_MAX_DV", DELTA_MAX_DV) ||
              PyModule_AddIntConstant(m, "SCAN_MAX_N", SCAN_MAX_N))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
