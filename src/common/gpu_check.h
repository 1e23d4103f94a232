// Fail-fast checks of GPU library calls, built from one definition (MOE_STATUS_CHECK): a call whose
// status is not success ends the process (every rank) with the call, file, line and the library's
// own description of the status. Plain C (CUTLASS_CHECK aside), for host code of .c and .cu files alike (the CUDA
// backend, the NCCL communicator); each macro needs its library's header where it is used.
#pragma once
#include "util.h"

#define MOE_STATUS_CHECK(type, success, call, description, name)                                \
    do {                                                                                         \
        type st_ = (call);                                                                       \
        if (st_ != (success))                                                                    \
            moe_fatal("%s:%d: %s failed: %s (%s)", __FILE__, __LINE__, #call, description, name); \
    } while (0)

#define CUDA_CHECK(call)                                                                         \
    MOE_STATUS_CHECK(cudaError_t, cudaSuccess, call, cudaGetErrorString(st_), cudaGetErrorName(st_))
#define CUBLAS_CHECK(call)                                                                       \
    MOE_STATUS_CHECK(cublasStatus_t, CUBLAS_STATUS_SUCCESS, call, cublasGetStatusString(st_),     \
                     cublasGetStatusName(st_))
#define NCCL_CHECK(call)                                                                         \
    MOE_STATUS_CHECK(ncclResult_t, ncclSuccess, call, ncclGetErrorString(st_), ncclGetLastError(NULL))
#define CUDNN_CHECK(call)                                                                        \
    MOE_STATUS_CHECK(cudnnStatus_t, CUDNN_STATUS_SUCCESS, call, cudnnGetErrorString(st_), "cuDNN")
#define CUTLASS_CHECK(call)                                                                      \
    MOE_STATUS_CHECK(cutlass::Status, cutlass::Status::kSuccess, call, cutlassGetStatusString(st_), "CUTLASS")

// Kernel launches: launch errors surface at the launch; asynchronous faults at the next
// synchronising call.
#define CUDA_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())
