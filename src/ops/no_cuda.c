// Builds without CUDA (the default `make`) have no CUDA backend: train.device=cuda is refused.
#include "ops.h"

#ifndef MOE_CUDA
const Ops *ops_cuda(int device, bool deterministic) { return NULL; }
const OpsLimits *ops_cuda_limits(void) { return NULL; }
#endif
