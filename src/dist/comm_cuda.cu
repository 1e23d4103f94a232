// Device work of GPU communication (see comm_cuda.h): the stream-ordered fence through peer memory
// that the NCCL communicator's CommOps.fence queues once the ranks share peer memory.
#include "comm_cuda.h"

#include "common/gpu_check.h"

// Rank r stores the new epoch into word r of every rank's flags (release, system scope: the
// writes before it, e.g. a push kernel's, reach the peer first), then waits until each of its own
// n words holds it (acquire). The epoch is counted on the device, so a replayed graph counts on;
// comparisons are wrap-safe.
__global__ void peer_fence_kernel(unsigned *const *flags, int rank, int n, unsigned *epoch) {
    int j = threadIdx.x;
    unsigned e = *epoch + 1, v;
    __syncthreads();
    if (j == 0) *epoch = e;
    if (j >= n) return;
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flags[j] + rank), "r"(e) : "memory");
    const unsigned *mine = flags[rank] + j;
    do asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(mine) : "memory");
    while ((int)(v - e) < 0);
}

extern "C" void comm_cuda_fence(cudaStream_t stream, unsigned *const *flags, int rank, int n, unsigned *epoch) {
    peer_fence_kernel<<<1, (unsigned)((n + 31) / 32 * 32), 0, stream>>>(flags, rank, n, epoch);
    CUDA_LAUNCH_CHECK();
}
