// The GPU side of the distributed layer (CUDA builds; comm_cuda.cu): device work that
// communication itself needs, queued on the stream the compute backend hands the communicator.
#pragma once
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// A barrier of n GPUs in stream order, through peer memory: flags (n) device table of every
// rank's n flag words (CUDA IPC), epoch one device word of this rank counting the fences passed.
void comm_cuda_fence(cudaStream_t stream, unsigned *const *flags, int rank, int n, unsigned *epoch);

#ifdef __cplusplus
}
#endif
