// The floating-point type of the CPU backend and of host-side math. The normal build uses float;
// the gradient-check build (-DMOE_F64) uses double everywhere so finite differences are exact enough.
#pragma once

#ifdef MOE_F64
typedef double real;
#define REAL_NAME "f64"
#else
typedef float real;
#define REAL_NAME "f32"
#endif
