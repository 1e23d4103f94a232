// NCCL communicators for GPU runs (CUDA builds; see comm_nccl.c), and what a process started by
// `moe train --nproc N` learns from its environment.
#pragma once
#include "comm.h"

// The stream NCCL calls and fences queue on: the compute backend's current one (Ops.stream).
typedef void *(*CommStreamFn)(void);

// The GPU world of every rank of `host` (MPI), or of the processes `moe train --nproc` started;
// it and the communicators split from it queue their work on stream().
Comm *comm_nccl_world(Comm *host, CommStreamFn stream);
// A new NCCL unique id as hex (comm_nccl_id_hex_len() bytes with the terminator).
void comm_nccl_new_id(char *hex);
size_t comm_nccl_id_hex_len(void);
// NCCL operations (collectives, sends, receives) this process has queued or recorded so far: the
// difference around a step is what the step asks of NCCL (0 without NCCL).
size_t comm_nccl_queued(void);
// This process's rank when `moe train --nproc` started it (world size into *world_size), else -1.
int comm_launch_rank(int *world_size);
// The rank of this process on its node (the GPU it takes), from the launcher's environment.
int comm_local_rank(int fallback);
