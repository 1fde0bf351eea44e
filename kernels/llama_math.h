// Rotary position embeddings (Su et al., "RoFormer"; Backend::rope), one formula for
// both backends: the CPU reference (kernels/cpu_llama_ops.cc) and the CUDA kernels
// (kernels/cuda_llama.cu) compile these same lines. The angles and the rotation are in
// double whatever the element type, so float32 results differ between the backends only
// where the two math libraries' sin, cos and pow differ in the last bit of a double.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define GPIPE_ROPE_FN __host__ __device__ inline
#define GPIPE_ROPE_UNROLL _Pragma("unroll")
#else
#define GPIPE_ROPE_FN inline
#define GPIPE_ROPE_UNROLL
#endif

namespace gpipe {
namespace ops {

// The angle of pair i (0 <= i < D/2) at position t: t * base^(-2i/D), Hugging Face
// LLaMA's inv_freq, in double.
GPIPE_ROPE_FN double rope_angle(int64_t t, int64_t i, int64_t head_dim, double base) {
  return static_cast<double>(t) * pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
}

// The turn of pair i at position t: the cosine of its angle and `sign` times its sine,
// in double. The backward is the inverse rotation (the transpose): the same with -sin,
// which `sign` = -1 selects. A kernel computes it once for every head and sample that
// share the position, and turns each pair with rope_pair.
struct RopeTurn {
  double c, s;
};
GPIPE_ROPE_FN RopeTurn rope_turn(int64_t t, int64_t i, int64_t head_dim, double base, double sign) {
  const double angle = rope_angle(t, i, head_dim, base);
  return RopeTurn{cos(angle), sign * sin(angle)};
}

// HF's rotate_half convention: element i of a head pairs with element i + D/2,
//   y_i = x_i cos - x_{i+D/2} sin,   y_{i+D/2} = x_{i+D/2} cos + x_i sin.
// Reads both inputs before writing, so y may be x.
template <typename T>
GPIPE_ROPE_FN void rope_pair(const T* x, T* y, int64_t i, int64_t half, RopeTurn turn) {
  const double a = static_cast<double>(x[i]), b = static_cast<double>(x[i + half]);
  y[i] = static_cast<T>(a * turn.c - b * turn.s);
  y[i + half] = static_cast<T>(b * turn.c + a * turn.s);
}

// Turns pair i of each of `heads` heads of one position: x and y point at the position's
// first element, y may be x. kRopeGroup heads' pairs are read (load: an element into M) before
// any is written (store: M into an element), since in place a read after a write waits for
// it; each is turned by rope_pair on its two-element copy (element 0 pairs with 1). The CUDA
// kernels' loop over the heads of a thread's pair.
constexpr int kRopeGroup = 8;
template <typename M, typename S, typename Load, typename Store>
GPIPE_ROPE_FN void rope_heads(const S* x, S* y, int64_t heads, int64_t head_dim, int64_t i, RopeTurn turn, Load load,
                              Store store) {
  const int64_t half = head_dim / 2;
  for (int64_t h0 = 0; h0 < heads; h0 += kRopeGroup) {
    const int64_t group = heads - h0 < kRopeGroup ? heads - h0 : kRopeGroup;
    M in[kRopeGroup][2];
    GPIPE_ROPE_UNROLL
    for (int k = 0; k < kRopeGroup; ++k) {
      if (k >= group) break;
      const S* px = x + (h0 + k) * head_dim;
      in[k][0] = load(px[i]);
      in[k][1] = load(px[i + half]);
    }
    GPIPE_ROPE_UNROLL
    for (int k = 0; k < kRopeGroup; ++k) {
      if (k >= group) break;
      S* py = y + (h0 + k) * head_dim;
      M out[2];
      rope_pair(in[k], out, 0, 1, turn);
      store(out[0], py[i]);
      store(out[1], py[i + half]);
    }
  }
}

}  // namespace ops
}  // namespace gpipe
