// libFuzzer harness of the checkpoint index reader (src/io/safetensors_index.c, used by
// src/train/ckpt.c): any text either parses into a map of tensors to plain shard file names, or
// fails with a message naming the index.
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "io/safetensors_index.h"

#define INDEX_PATH "fuzz/model.safetensors.index.json"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_init();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    StIndex ix;
    MoeErr err = "";
    if (st_index_parse(&ix, (const char *)data, size, INDEX_PATH, err)) {
        fuzz_check_message(err, INDEX_PATH);
        return 0;
    }
    const char *tensor;
    json_t *file;
    json_object_foreach(ix.map, tensor, file) {
        const char *name = st_index_file(&ix, tensor);
        if (!name || strchr(name, '/') || !strcmp(name, "..") || strlen(name) > 255) abort();
    }
    if (st_index_file(&ix, "no such tensor \x01") && !json_object_get(ix.map, "no such tensor \x01"))
        abort();
    st_index_free(&ix);
    return 0;
}
