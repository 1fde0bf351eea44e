// Which library does the CPU backend's float32 matrix products (issue 21): OpenBLAS,
// or oneDNN's matmul, whose per-shape primitives and packed copies of weights this file
// keeps. float64 always goes to OpenBLAS (oneDNN has no f64 matmul).
#pragma once

#include <string>

#include "runtime/tensor.h"

namespace gpipe {
namespace cpu_blas {

// GPIPE_GEMM=auto (the default): OpenBLAS, except the products with a layer's weight
// inside a FrozenWeights window at one thread a product (set_threads(1), as the trainer
// sets it at train.blas_threads' default; never set, the libraries use all cores and
// auto stays on OpenBLAS), which go to oneDNN when oneDNN's matmul prefers a
// blocked (packed) weight layout on this CPU (its AVX-512 kernels; issue 21 measured
// them at 1.2 to 2.1x OpenBLAS on the thin micro-batch products). Where oneDNN would
// only use a plain layout (AVX2 CPUs), it measured no faster, and auto stays on OpenBLAS;
// at more threads a product, oneDNN's OpenMP team and OpenBLAS's threads spin against
// each other, and auto stays on OpenBLAS too.
// GPIPE_GEMM=onednn: every float32 product through oneDNN. GPIPE_GEMM=openblas: none.
enum class Library { kAuto, kOpenblas, kOnednn };

// The library chosen: set_library's, else GPIPE_GEMM's at first use, else kAuto.
Library library();
void set_library(Library l);
// "auto", "openblas", "onednn"; anything else is a UserError that lists them.
Library parse_library(const std::string& name);
const char* library_name(Library l);

// Threads per product for OpenBLAS and for oneDNN's OpenMP team on each calling thread
// (each stage thread applies it before its first oneDNN call). 0: the libraries' own
// defaults (all cores).
void set_threads(int threads);

// Row-major float32 C (m x n) = alpha op(A) op(B) + beta C through oneDNN's matmul, with
// its primitive for this shape, strides, alpha and beta created once per thread.
void onednn_gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                 int ldb, float beta, float* c, int ldc);

// The same with B = op(w), w a layer's weight (contiguous (rows, cols) float32 on the
// CPU). Inside a FrozenWeights window on this thread, w may be served from a packed copy
// made by an earlier call in the window. Returns false, having done nothing, where the
// library choice says OpenBLAS should do this product.
bool gemm_weight(bool ta, int m, int n, int k, float alpha, const float* a, int lda, const Tensor& w, bool tw,
                 float beta, float* c, int ldc);

// Packed copies held on this thread (for tests).
int packed_weights_held();
// For tests: inside a window, gemm_weight copies every weight even where oneDNN reads it
// in place (AVX2 CPUs), into the other plain layout (transposed storage), so that the
// keeping and dropping of copies is exercised on any CPU.
void set_always_pack(bool on);

}  // namespace cpu_blas
}  // namespace gpipe
