// Builds without CUDA have no NCCL: GPU worlds cannot be asked for (train.device=cuda is refused
// earlier), and `moe train --nproc` says what to build instead.
#include "comm_nccl.h"
#include "common/util.h"

Comm *comm_nccl_world(Comm *host, CommStreamFn stream) {
    moe_fatal("this moe was built without CUDA and NCCL (build with make CUDA=1)");
}

void comm_nccl_new_id(char *hex) {
    moe_fatal("moe train --nproc starts GPU ranks and needs a CUDA build (make CUDA=1); for CPU ranks use mpirun");
}

size_t comm_nccl_id_hex_len(void) { return 1; }

size_t comm_nccl_queued(void) { return 0; }
