// safetensors files (Hugging Face format, see docs/FORMATS.md): a validating reader that can read
// any slice of a tensor's leading dimension, and a streaming writer that fsyncs what it wrote.
// Checkpoints store global FP32 tensors; other dtypes are read (converted to float) for imports.
// The writer stores an XXH3-64 checksum of every tensor's bytes in "__metadata__" (key
// "xxh3_64:NAME", 16 hex digits); the reader checks it, and files without checksums still load.
#pragma once
#include <stdbool.h>
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
    uint64_t checksum;   // XXH3-64 of the data bytes (writer: computed; reader: from the header)
    bool has_checksum;   // reader: the header holds one
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
void st_format_shape(const size_t *shape, int ndim, char *buf, size_t len); // "[3, 4]"

// Opens and validates the whole header: length within the file, valid JSON, known dtypes,
// shapes matching byte counts, offsets inside the data buffer, no overlaps or holes, checksums
// of 16 hex digits that each belong to a tensor of the file.
// On failure returns -1 with a message naming the file and the offending key or value.
int st_open(SafeTensors *st, const char *path, MoeErr err);
void st_close(SafeTensors *st);

const StTensor *st_find(const SafeTensors *st, const char *name); // NULL if absent
const char *st_meta_get(const SafeTensors *st, const char *key);  // NULL if absent

// Reads `count` elements starting at element `offset` (row-major) of tensor t, converted to float
// (F32, F64, F16 and BF16 are accepted). Fails on short reads, naming file and tensor. A read of
// the whole tensor also checks its checksum (a slice cannot: see st_verify).
int st_read_f32(const SafeTensors *st, const StTensor *t, size_t offset, size_t count,
                float *dst, MoeErr err);
// x rounded to bfloat16 bits (to nearest, ties to even, as torch's .to(torch.bfloat16); NaN stays NaN).
uint16_t st_f32_to_bf16(float x);
// Reads the whole of t's data and compares it with its checksum; 0 when they match or t has none.
int st_verify(const SafeTensors *st, const StTensor *t, MoeErr err);

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
    size_t header_len;          // bytes of header JSON, rewritten with the checksums at close
    struct XXH3_state_s *hash;  // checksum of the tensor being written
    size_t hashed;              // tensors whose checksum is complete
} StWriter;

int st_writer_open(StWriter *w, const char *path, MoeErr err);
void st_writer_add(StWriter *w, const char *name, StDtype dtype, int ndim, const size_t *shape);
void st_writer_meta(StWriter *w, const char *key, const char *value);
int st_writer_write(StWriter *w, const void *data, size_t bytes, MoeErr err); // header on first call
// Writes the checksums into the header, then flushes and fsyncs; also frees. On error the file
// is incomplete.
int st_writer_close(StWriter *w, MoeErr err);
void st_writer_abort(StWriter *w);           // closes and removes the partial file
