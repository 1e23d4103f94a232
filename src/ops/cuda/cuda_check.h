// CUDA_CHECK: a CUDA runtime call that fails ends the process (every rank) with the call, file,
// line and CUDA's message. Plain C, so host code outside the .cu files (the NCCL communicator) uses
// it too.
#pragma once
#include <cuda_runtime.h>

#include "common/util.h"

#define CUDA_CHECK(call)                                                                         \
    do {                                                                                         \
        cudaError_t err_ = (call);                                                               \
        if (err_ != cudaSuccess)                                                                 \
            moe_fatal("%s:%d: %s failed: %s (%s)", __FILE__, __LINE__, #call,                    \
                      cudaGetErrorString(err_), cudaGetErrorName(err_));                         \
    } while (0)
