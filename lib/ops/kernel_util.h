// What imgtrain's own CPU kernels (norm_act, se_gate, optim_step) share: the SIMD clones of their
// hot loops and, in CUDA builds, the check of a device launch's result.
#pragma once

// The loops are plain C++ that the compiler vectorises; on x86-64 GCC builds each hot function
// also gets AVX-512 and AVX2+FMA clones picked at load time (the baseline build is SSE2 only).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define IMGTRAIN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define IMGTRAIN_CLONES
#endif
#define IMGTRAIN_AI inline __attribute__((always_inline))

#ifdef IMGTRAIN_WITH_CUDA
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace imgtrain::ops {
// err: the cudaError_t a .cu launcher returned; throws with `what` and CUDA's message.
inline void check_cuda(int err, const char* what) {
  if (err != 0) throw std::runtime_error(std::string(what) + ": CUDA error " + cudaGetErrorString(cudaError_t(err)));
}
}  // namespace imgtrain::ops
#endif
