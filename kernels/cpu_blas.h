// Row-major float/double gemm for the CPU backend's files, so each one calls the same
// overload instead of carrying its own copy: float32 through OpenBLAS or oneDNN as
// cpu_gemm.h's library choice says, float64 through OpenBLAS.
#pragma once

#include <cblas.h>

#include <cstdint>

#include "kernels/cpu_gemm.h"

namespace gpipe {
namespace cpu_blas {

// Row-major: C (m x n) = alpha * op(A) (m x k) op(B) (k x n) + beta * C.
inline void gemm(bool ta, bool tb, int m, int n, int k, double alpha, const float* a, int lda, const float* b,
                 int ldb, double beta, float* c, int ldc) {
  if (library() == Library::kOnednn && m > 0 && n > 0 && k > 0) {
    onednn_gemm(ta, tb, m, n, k, static_cast<float>(alpha), a, lda, b, ldb, static_cast<float>(beta), c, ldc);
    return;
  }
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k,
              static_cast<float>(alpha), a, lda, b, ldb, static_cast<float>(beta), c, ldc);
}
inline void gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
                 int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a,
              lda, b, ldb, beta, c, ldc);
}

// The same with int64_t extents (the convolution ops' sizes), narrowed to cblas's int.
inline void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const float* a, int64_t lda,
                 const float* b, int64_t ldb, double beta, float* c, int64_t ldc) {
  gemm(ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
       static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}
inline void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
                 const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

}  // namespace cpu_blas
}  // namespace gpipe
