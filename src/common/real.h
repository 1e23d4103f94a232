// The floating-point type of the CPU backend and of host-side math. The normal build uses float;
// the gradient-check build (-DMOE_F64) uses double everywhere so finite differences are exact enough.
#pragma once

#include <math.h>

#ifdef MOE_F64
typedef double real;
#define real_exp exp
#define real_sqrt sqrt
#else
typedef float real;
#define real_exp expf
#define real_sqrt sqrtf
#endif
