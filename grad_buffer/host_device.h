// MESHDDP_HD marks a function for both the host and the device: `__host__ __device__` under nvcc,
// nothing for the host compiler. For the functors that one source builds for CUDA and for the CPU.
#pragma once

#if defined(__CUDACC__)
#define MESHDDP_HD __host__ __device__
#else
#define MESHDDP_HD
#endif
