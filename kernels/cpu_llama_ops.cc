// The CPU reference of the LLaMA ops (kernels/backend.h): rotary position embeddings and
// the packing of grouped-query attention's projections into attention()'s fused
// operand. The CUDA twins are in kernels/cuda_llama.cu; the rotation's formula is
// kernels/llama_math.h, compiled by both.
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/cpu_backend.h"
#include "kernels/llama_checks.h"
#include "kernels/llama_math.h"

namespace gpipe {

using ops::dispatch_float;

namespace {

// y = x rotated by sign * angle per pair, rows (b, t) of H heads of D. Each position's
// turns are computed once, for all its samples and heads.
void rope_rotate(const Tensor& x, int heads, double base, double sign, Tensor& y, const char* op) {
  const ops::RopeDims d = ops::check_rope(x, y, heads, base, op);
  const int64_t half = d.head_dim / 2, C = heads * d.head_dim;
  std::vector<ops::RopeTurn> turn(static_cast<size_t>(d.seq * half));  // (T, D/2)
  for (int64_t t = 0; t < d.seq; ++t) {
    for (int64_t i = 0; i < half; ++i) turn[t * half + i] = ops::rope_turn(t, i, d.head_dim, base, sign);
  }
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t t = 0; t < d.seq; ++t) {
        const ops::RopeTurn* row = turn.data() + t * half;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t off = (b * d.seq + t) * C + h * d.head_dim;
          for (int64_t i = 0; i < half; ++i) ops::rope_pair(px + off, py + off, i, half, row[i]);
        }
      }
    }
  });
}

}  // namespace

void CpuBackend::rope(const Tensor& x, int heads, double base, Tensor& y) {
  rope_rotate(x, heads, base, 1.0, y, "rope");
}

void CpuBackend::rope_backward(const Tensor& dy, int heads, double base, Tensor& dx) {
  rope_rotate(dy, heads, base, -1.0, dx, "rope_backward");
}

void CpuBackend::pack_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& qkv) {
  const ops::PackDims d = ops::check_pack_qkv(q, k, v, qkv, heads, "pack_qkv");
  const int64_t D = d.head_dim, C = d.heads * D, KC = d.kv_heads * D, group = d.heads / d.kv_heads;
  dispatch_float(q, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* pq = q.data<T>();
    const T* pk = k.data<T>();
    const T* pv = v.data<T>();
    T* out = qkv.data<T>();
    for (int64_t r = 0; r < d.batch * d.seq; ++r) {
      T* row = out + r * 3 * C;
      std::memcpy(row, pq + r * C, sizeof(T) * C);
      for (int64_t h = 0; h < d.heads; ++h) {
        const int64_t src = r * KC + (h / group) * D;
        std::memcpy(row + C + h * D, pk + src, sizeof(T) * D);
        std::memcpy(row + 2 * C + h * D, pv + src, sizeof(T) * D);
      }
    }
  });
}

void CpuBackend::pack_qkv_backward(const Tensor& dqkv, int heads, Tensor& dq, Tensor& dk, Tensor& dv) {
  const ops::PackDims d = ops::check_pack_qkv(dq, dk, dv, dqkv, heads, "pack_qkv_backward");
  const int64_t D = d.head_dim, C = d.heads * D, KC = d.kv_heads * D, group = d.heads / d.kv_heads;
  dispatch_float(dqkv, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* in = dqkv.data<T>();
    T* pq = dq.data<T>();
    T* pk = dk.data<T>();
    T* pv = dv.data<T>();
    for (int64_t r = 0; r < d.batch * d.seq; ++r) {
      const T* row = in + r * 3 * C;
      std::memcpy(pq + r * C, row, sizeof(T) * C);
      for (int64_t j = 0; j < d.kv_heads; ++j) {
        for (int64_t e = 0; e < D; ++e) {
          // Summed in double in head order, as the CUDA kernel does.
          double sk = 0, sv = 0;
          for (int64_t g = 0; g < group; ++g) {
            sk += static_cast<double>(row[C + (j * group + g) * D + e]);
            sv += static_cast<double>(row[2 * C + (j * group + g) * D + e]);
          }
          pk[r * KC + j * D + e] = static_cast<T>(sk);
          pv[r * KC + j * D + e] = static_cast<T>(sv);
        }
      }
    }
  });
}

}  // namespace gpipe
