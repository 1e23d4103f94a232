// libFuzzer harness of the safetensors reader (src/io/safetensors.c): any bytes either open with
// a header that tiles the data exactly, or fail with a message naming the file; every tensor of
// an opened file can then be checked against its checksum and read, whole and in part.
#include <stdlib.h>

#include "fuzz.h"
#include "io/safetensors.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_init();
    return 0;
}

static void fuzz_reads(const SafeTensors *st, const StTensor *t) {
    MoeErr err = "";
    if (st_verify(st, t, err)) fuzz_check_message(err, st->path);
    float *dst = malloc((t->numel ? t->numel : 1) * sizeof(float));
    if (st_read_f32(st, t, 0, t->numel, dst, err)) fuzz_check_message(err, st->path);
    if (st_read_f32(st, t, t->numel / 2, t->numel - t->numel / 2, dst, err))
        fuzz_check_message(err, st->path);
    if (!st_read_f32(st, t, t->numel, 1, dst, err)) abort(); // one past the end must fail
    free(dst);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file(data, size);
    SafeTensors st;
    MoeErr err = "";
    if (st_open(&st, path, err)) {
        fuzz_check_message(err, path);
        return 0;
    }
    uint64_t pos = 0; // the tensors, sorted by offset, tile the data buffer
    for (size_t i = 0; i < st.n_tensors; i++) {
        const StTensor *t = &st.tensors[i];
        if (t->begin != pos || st_find(&st, t->name) == NULL) abort();
        pos = t->end;
        fuzz_reads(&st, t);
    }
    if (st.data_start + pos != st.file_size) abort();
    st_meta_get(&st, "format");
    st_close(&st);
    return 0;
}
