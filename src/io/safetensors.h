// safetensors files (Hugging Face format, see docs/FORMATS.md): a validating reader that can read
// any slice of a tensor's leading dimension, and a streaming writer that fsyncs what it wrote.
// Checkpoints store global FP32 tensors; other dtypes are read (converted to float) for imports.
#pragma once
#include <stdint.h>
#include <stdio.h>

#include "common/util.h"

typedef enum {
    ST_F64, ST_F32, ST_F16, ST_BF16, ST_I64, ST_I32, ST_I16, ST_I8, ST_U8, ST_BOOL,
    ST_F8_E4M3, ST_F8_E5M2, ST_N_DTYPES
} StDtype;

#define ST_MAX_DIMS 8

typedef struct {
    char *name;
    StDtype dtype;
    int ndim;
    size_t shape[ST_MAX_DIMS];
    size_t numel;
    uint64_t begin, end; // byte offsets relative to the start of the data buffer
} StTensor;

typedef struct {
    char *key, *value;
} StMeta;

typedef struct {
    char *path;
    FILE *file;
    uint64_t data_start; // 8 + header length
    uint64_t file_size;
    StTensor *tensors; // in file order of data_offsets
    size_t n_tensors;
    StMeta *meta; // "__metadata__" entries
    size_t n_meta;
} SafeTensors;

const char *st_dtype_name(StDtype dtype);   // "F32", ...
size_t st_dtype_size(StDtype dtype);        // bytes per element

// Opens and validates the whole header: length within the file, valid JSON, known dtypes,
// shapes matching byte counts, offsets inside the data buffer, no overlaps or holes.
// On failure returns -1 with a message naming the file and the offending key or value.
int st_open(SafeTensors *st, const char *path, MoeErr err);
void st_close(SafeTensors *st);

const StTensor *st_find(const SafeTensors *st, const char *name); // NULL if absent
const char *st_meta_get(const SafeTensors *st, const char *key);  // NULL if absent

// Reads `count` elements starting at element `offset` (row-major) of tensor t, converted to float
// (F32, F64, F16 and BF16 are accepted). Fails on short reads, naming file and tensor.
int st_read_f32(const SafeTensors *st, const StTensor *t, size_t offset, size_t count,
                float *dst, MoeErr err);

// Streaming writer. Declare every tensor (and metadata), then write their data in declaration
// order; close checks that every declared byte arrived, flushes and fsyncs.
typedef struct {
    char *path;
    FILE *file;
    StTensor *tensors;
    size_t n_tensors, cap_tensors;
    StMeta *meta;
    size_t n_meta;
    uint64_t data_bytes;    // total declared
    uint64_t written_bytes; // written so far
    int header_written;
} StWriter;

int st_writer_open(StWriter *w, const char *path, MoeErr err);
void st_writer_add(StWriter *w, const char *name, StDtype dtype, int ndim, const size_t *shape);
void st_writer_meta(StWriter *w, const char *key, const char *value);
int st_writer_write(StWriter *w, const void *data, size_t bytes, MoeErr err); // header on first call
int st_writer_close(StWriter *w, MoeErr err); // also frees; on error the file is incomplete
void st_writer_abort(StWriter *w);           // closes and removes the partial file
