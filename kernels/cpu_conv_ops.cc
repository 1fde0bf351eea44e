// The CPU reference of the convolution ops (kernels/backend.h, "Convolution ops"):
// 2-D convolution as im2col + one BLAS product per image, per-channel bias, batch
// normalisation, max and average pooling. The CUDA backend implements the same
// semantics and is tested against this file, so clarity wins over speed here; the
// reductions accumulate in double so the reference is more accurate than its twin.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/conv_checks.h"
#include "kernels/cpu_backend.h"
#include "kernels/cpu_blas.h"
#include "kernels/op_checks.h"
#include "runtime/error.h"

namespace gpipe {

namespace {

using cpu_blas::gemm;
// The argument checks are kernels/conv_checks.h, shared with the CUDA backend.
using ops::channel_dims;
using ops::ChannelDims;
using ops::check_4d;
using ops::check_avgpool;
using ops::check_batchnorm;
using ops::check_conv;
using ops::check_maxpool;
using ops::check_per_channel;
using ops::check_shape;
using ops::check_window;
using ops::conv_because;
using ops::ConvDims;
using ops::dispatch_float;
using ops::out_extent;
using ops::pool_because;
using ops::PoolDims;
using ops::str;

// A 1x1 convolution with stride 1 and no padding is a plain matrix product on the
// image itself: (K, C) @ (C, H W). No im2col copy is needed.
bool is_pointwise(const ConvDims& d, int stride, int pad) { return d.R == 1 && d.S == 1 && stride == 1 && pad == 0; }

// col (C R S, P Q): row (c, r, s) holds, for every output position (p, q), the input
// value under kernel tap (r, s) of channel c; taps that fall in the padding are 0.
template <typename T>
void im2col(const T* x, const ConvDims& d, int stride, int pad, T* col) {  // x: (C, H, W)
  const int64_t PQ = d.P * d.Q;
  for (int64_t c = 0; c < d.C; ++c) {
    for (int64_t r = 0; r < d.R; ++r) {
      for (int64_t s = 0; s < d.S; ++s) {
        T* out = col + ((c * d.R + r) * d.S + s) * PQ;
        for (int64_t p = 0; p < d.P; ++p) {
          const int64_t ih = p * stride - pad + r;
          T* orow = out + p * d.Q;
          if (ih < 0 || ih >= d.H) {
            for (int64_t q = 0; q < d.Q; ++q) orow[q] = T(0);
            continue;
          }
          const T* irow = x + (c * d.H + ih) * d.W;
          for (int64_t q = 0; q < d.Q; ++q) {
            const int64_t iw = q * stride - pad + s;
            orow[q] = (iw >= 0 && iw < d.W) ? irow[iw] : T(0);
          }
        }
      }
    }
  }
}

// The adjoint of im2col: dx (C, H, W) += every column entry at the input position it
// was read from (overlapping windows add up); padding taps are dropped.
template <typename T>
void col2im_add(const T* col, const ConvDims& d, int stride, int pad, T* dx) {
  const int64_t PQ = d.P * d.Q;
  for (int64_t c = 0; c < d.C; ++c) {
    for (int64_t r = 0; r < d.R; ++r) {
      for (int64_t s = 0; s < d.S; ++s) {
        const T* in = col + ((c * d.R + r) * d.S + s) * PQ;
        for (int64_t p = 0; p < d.P; ++p) {
          const int64_t ih = p * stride - pad + r;
          if (ih < 0 || ih >= d.H) continue;
          T* xrow = dx + (c * d.H + ih) * d.W;
          const T* irow = in + p * d.Q;
          for (int64_t q = 0; q < d.Q; ++q) {
            const int64_t iw = q * stride - pad + s;
            if (iw >= 0 && iw < d.W) xrow[iw] += irow[q];
          }
        }
      }
    }
  }
}

}  // namespace

// ---- Convolution

void CpuBackend::conv2d(const Tensor& x, const Tensor& w, int stride, int pad, Tensor& y) {
  const ConvDims d = check_conv(x, w, stride, pad, "conv2d");
  check_shape(y, x, {d.N, d.K, d.P, d.Q}, "conv2d", "output", conv_because(x, w, stride, pad));
  if (d.N == 0) return;
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t CRS = d.C * d.R * d.S, PQ = d.P * d.Q, CHW = d.C * d.H * d.W;
    const bool pointwise = is_pointwise(d, stride, pad);
    std::vector<T> col(pointwise ? 0 : CRS * PQ);  // (C R S, P Q)
    for (int64_t n = 0; n < d.N; ++n) {
      const T* xn = x.data<T>() + n * CHW;  // (C, H, W)
      const T* b = xn;
      if (!pointwise) {
        im2col(xn, d, stride, pad, col.data());
        b = col.data();
      }
      // y_n (K, P Q) = w (K, C R S) @ col (C R S, P Q)
      gemm(false, false, d.K, PQ, CRS, 1.0, w.data<T>(), CRS, b, PQ, 0.0, y.data<T>() + n * d.K * PQ, PQ);
    }
  });
}

void CpuBackend::conv2d_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int stride, int pad, Tensor& dx,
                                 Tensor& dw) {
  const ConvDims d = check_conv(x, w, stride, pad, "conv2d_backward");
  const std::string because = conv_because(x, w, stride, pad);
  check_shape(dy, x, {d.N, d.K, d.P, d.Q}, "conv2d_backward", "output gradient dy", because);
  const bool want_dw = dw.defined(), want_dx = dx.defined();
  if (want_dw) check_shape(dw, x, w.shape(), "conv2d_backward", "weight gradient dw", "(the weight's shape)");
  if (want_dx) check_shape(dx, x, x.shape(), "conv2d_backward", "input gradient dx", "(the input's shape)");
  if (d.N == 0) return;
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t CRS = d.C * d.R * d.S, PQ = d.P * d.Q, CHW = d.C * d.H * d.W;
    const bool pointwise = is_pointwise(d, stride, pad);
    std::vector<T> col(pointwise ? 0 : CRS * PQ);  // (C R S, P Q), im2col of x_n, then its gradient
    for (int64_t n = 0; n < d.N; ++n) {
      const T* xn = x.data<T>() + n * CHW;         // (C, H, W)
      const T* dyn = dy.data<T>() + n * d.K * PQ;  // (K, P Q)
      if (want_dw) {
        const T* b = xn;
        if (!pointwise) {
          im2col(xn, d, stride, pad, col.data());
          b = col.data();
        }
        // dw (K, C R S) += dy_n (K, P Q) @ col^T (P Q, C R S)
        gemm(false, true, d.K, CRS, PQ, 1.0, dyn, PQ, b, PQ, 1.0, dw.data<T>(), CRS);
      }
      if (!want_dx) continue;
      T* dxn = dx.data<T>() + n * CHW;
      if (pointwise) {
        // dx_n (C, H W) = w^T (C, K) @ dy_n (K, H W)
        gemm(true, false, CRS, PQ, d.K, 1.0, w.data<T>(), CRS, dyn, PQ, 0.0, dxn, PQ);
        continue;
      }
      // dcol (C R S, P Q) = w^T (C R S, K) @ dy_n (K, P Q), then scattered back.
      gemm(true, false, CRS, PQ, d.K, 1.0, w.data<T>(), CRS, dyn, PQ, 0.0, col.data(), PQ);
      std::fill(dxn, dxn + CHW, T(0));
      col2im_add(col.data(), d, stride, pad, dxn);
    }
  });
}

void CpuBackend::add_channel_bias(Tensor& y, const Tensor& bias) {
  ops::check_float(y, "add_channel_bias");
  if (y.dim() < 2) throw Error("add_channel_bias: output " + y.str() + " must be (N, K, ...)");
  check_per_channel(bias, y, "add_channel_bias", "bias");
  const ChannelDims d = channel_dims(y);
  dispatch_float(y, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* py = y.data<T>();
    const T* pb = bias.data<T>();
    for (int64_t n = 0; n < d.N; ++n) {
      for (int64_t c = 0; c < d.C; ++c) {
        T* plane = py + (n * d.C + c) * d.E;
        for (int64_t e = 0; e < d.E; ++e) plane[e] += pb[c];
      }
    }
  });
}

void CpuBackend::channel_bias_grad(const Tensor& dy, Tensor& db) {
  ops::check_float(dy, "channel_bias_grad");
  if (dy.dim() < 2) throw Error("channel_bias_grad: output gradient " + dy.str() + " must be (N, K, ...)");
  check_per_channel(db, dy, "channel_bias_grad", "bias gradient");
  const ChannelDims d = channel_dims(dy);
  dispatch_float(dy, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* p = dy.data<T>();
    T* out = db.data<T>();
    for (int64_t c = 0; c < d.C; ++c) {
      double acc = 0;
      for (int64_t n = 0; n < d.N; ++n) {
        const T* plane = p + (n * d.C + c) * d.E;
        for (int64_t e = 0; e < d.E; ++e) acc += plane[e];
      }
      out[c] += static_cast<T>(acc);
    }
  });
}

// ---- Batch normalisation. Statistics are per channel over (N, H, W); `var` is the
// biased variance (divided by N H W), as the normalisation uses it.

void CpuBackend::batchnorm_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                                 Tensor& mean, Tensor& var) {
  check_batchnorm(x, gamma, &beta, eps, "batchnorm_train");
  check_shape(y, x, x.shape(), "batchnorm_train", "output", "(the input's shape)");
  check_per_channel(mean, x, "batchnorm_train", "mean");
  check_per_channel(var, x, "batchnorm_train", "var");
  const ChannelDims d = channel_dims(x);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
    const double m = static_cast<double>(d.N * d.E);
    for (int64_t c = 0; c < d.C; ++c) {
      // Two passes (mean, then squared deviations): no cancellation for large means.
      double sum = 0;
      for (int64_t n = 0; n < d.N; ++n) {
        const T* plane = px + (n * d.C + c) * d.E;
        for (int64_t e = 0; e < d.E; ++e) sum += plane[e];
      }
      const double mu = sum / m;
      double sq = 0;
      for (int64_t n = 0; n < d.N; ++n) {
        const T* plane = px + (n * d.C + c) * d.E;
        for (int64_t e = 0; e < d.E; ++e) sq += (plane[e] - mu) * (plane[e] - mu);
      }
      const double v = sq / m;
      mean.data<T>()[c] = static_cast<T>(mu);
      var.data<T>()[c] = static_cast<T>(v);
      // y = (x - mean) * (gamma rstd) + beta, with the statistics as stored, so that
      // backward (which only sees the stored ones) differentiates exactly this.
      const T mu_t = static_cast<T>(mu);
      const T scale = static_cast<T>(gamma.data<T>()[c] / std::sqrt(static_cast<double>(static_cast<T>(v)) + eps));
      const T shift = beta.data<T>()[c];
      for (int64_t n = 0; n < d.N; ++n) {
        const T* in = px + (n * d.C + c) * d.E;
        T* out = py + (n * d.C + c) * d.E;
        for (int64_t e = 0; e < d.E; ++e) out[e] = (in[e] - mu_t) * scale + shift;
      }
    }
  });
}

void CpuBackend::batchnorm_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                                const Tensor& var, double eps, Tensor& y) {
  check_batchnorm(x, gamma, &beta, eps, "batchnorm_eval");
  check_shape(y, x, x.shape(), "batchnorm_eval", "output", "(the input's shape)");
  check_per_channel(mean, x, "batchnorm_eval", "mean");
  check_per_channel(var, x, "batchnorm_eval", "var");
  const ChannelDims d = channel_dims(x);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
    for (int64_t c = 0; c < d.C; ++c) {
      const T mu = mean.data<T>()[c];
      const T scale = static_cast<T>(gamma.data<T>()[c] / std::sqrt(static_cast<double>(var.data<T>()[c]) + eps));
      const T shift = beta.data<T>()[c];
      for (int64_t n = 0; n < d.N; ++n) {
        const T* in = px + (n * d.C + c) * d.E;
        T* out = py + (n * d.C + c) * d.E;
        for (int64_t e = 0; e < d.E; ++e) out[e] = (in[e] - mu) * scale + shift;
      }
    }
  });
}

// With xhat = (x - mean) rstd over the m = N H W values of a channel:
//   dbeta += sum dy;  dgamma += sum dy xhat;
//   dx = gamma rstd (dy - sum(dy) / m - xhat sum(dy xhat) / m)
// (the last two terms are the gradient through the batch mean and variance).
void CpuBackend::batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                    const Tensor& var, double eps, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  check_batchnorm(x, gamma, nullptr, eps, "batchnorm_backward");
  check_shape(dy, x, x.shape(), "batchnorm_backward", "output gradient dy", "(the input's shape)");
  check_shape(dx, x, x.shape(), "batchnorm_backward", "input gradient dx", "(the input's shape)");
  check_per_channel(mean, x, "batchnorm_backward", "mean");
  check_per_channel(var, x, "batchnorm_backward", "var");
  check_per_channel(dgamma, x, "batchnorm_backward", "dgamma");
  check_per_channel(dbeta, x, "batchnorm_backward", "dbeta");
  const ChannelDims d = channel_dims(x);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    const double m = static_cast<double>(d.N * d.E);
    for (int64_t c = 0; c < d.C; ++c) {
      const double mu = mean.data<T>()[c];
      const double rstd = 1.0 / std::sqrt(static_cast<double>(var.data<T>()[c]) + eps);
      double sum_dy = 0, sum_dy_xhat = 0;
      for (int64_t n = 0; n < d.N; ++n) {
        const T* in = px + (n * d.C + c) * d.E;
        const T* g = pdy + (n * d.C + c) * d.E;
        for (int64_t e = 0; e < d.E; ++e) {
          sum_dy += g[e];
          sum_dy_xhat += g[e] * ((in[e] - mu) * rstd);
        }
      }
      dbeta.data<T>()[c] += static_cast<T>(sum_dy);
      dgamma.data<T>()[c] += static_cast<T>(sum_dy_xhat);
      const double k = gamma.data<T>()[c] * rstd, a = sum_dy / m, b = sum_dy_xhat / m;
      for (int64_t n = 0; n < d.N; ++n) {
        const T* in = px + (n * d.C + c) * d.E;
        const T* g = pdy + (n * d.C + c) * d.E;
        T* out = pdx + (n * d.C + c) * d.E;
        for (int64_t e = 0; e < d.E; ++e) {
          const double xhat = (in[e] - mu) * rstd;
          out[e] = static_cast<T>(k * (g[e] - a - xhat * b));
        }
      }
    }
  });
}

// ---- Pooling

void CpuBackend::maxpool2d(const Tensor& x, int kernel, int stride, int pad, Tensor& y, Tensor& argmax) {
  const PoolDims d = check_maxpool(x, kernel, stride, pad, "maxpool2d");
  const Shape out{d.N, d.C, d.P, d.Q};
  check_shape(y, x, out, "maxpool2d", "output", pool_because(x, kernel, stride, pad));
  if (!argmax.defined() || argmax.dtype() != DType::kI32 || argmax.shape() != out || !argmax.is_contiguous()) {
    throw Error("maxpool2d: argmax is " + str(argmax) + ", expected contiguous int32" + shape_str(out) + " " +
                pool_because(x, kernel, stride, pad));
  }
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
    int32_t* pa = argmax.data<int32_t>();
    for (int64_t plane = 0; plane < d.N * d.C; ++plane) {
      const T* in = px + plane * d.H * d.W;
      for (int64_t p = 0; p < d.P; ++p) {
        // The window clipped to the image: padding is -infinity, so it never wins.
        const int64_t h0 = std::max<int64_t>(0, p * stride - pad),
                      h1 = std::min<int64_t>(d.H, p * stride - pad + kernel);
        for (int64_t q = 0; q < d.Q; ++q) {
          const int64_t w0 = std::max<int64_t>(0, q * stride - pad),
                        w1 = std::min<int64_t>(d.W, q * stride - pad + kernel);
          int64_t best = h0 * d.W + w0;
          T bv = in[best];
          for (int64_t h = h0; h < h1; ++h) {
            for (int64_t w = w0; w < w1; ++w) {
              const T v = in[h * d.W + w];
              // Strictly greater keeps the first maximum on ties; a NaN wins (and
              // propagates), as in PyTorch.
              if (v > bv || (std::isnan(v) && !std::isnan(bv))) {
                bv = v;
                best = h * d.W + w;
              }
            }
          }
          const int64_t o = (plane * d.P + p) * d.Q + q;
          py[o] = bv;
          pa[o] = static_cast<int32_t>(best);
        }
      }
    }
  });
}

void CpuBackend::maxpool2d_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) {
  check_4d(dy, "maxpool2d_backward", "output gradient dy");
  check_4d(dx, "maxpool2d_backward", "input gradient dx");
  if (dx.dtype() != dy.dtype() || dx.size(0) != dy.size(0) || dx.size(1) != dy.size(1)) {
    throw Error("maxpool2d_backward: output gradient " + dy.str() + " and input gradient " + dx.str() +
                " do not fit: they need the same dtype, batch and channels");
  }
  if (!argmax.defined() || argmax.dtype() != DType::kI32 || argmax.shape() != dy.shape() || !argmax.is_contiguous()) {
    throw Error("maxpool2d_backward: argmax " + str(argmax) + " must be contiguous int32 of dy's shape " +
                shape_str(dy.shape()));
  }
  const int64_t planes = dy.size(0) * dy.size(1), PQ = dy.size(2) * dy.size(3), HW = dx.size(2) * dx.size(3);
  const int32_t* pa = argmax.data<int32_t>();
  // Every index is checked before dx is written, so a bad argmax leaves dx untouched.
  for (int64_t i = 0; i < planes * PQ; ++i) {
    if (pa[i] < 0 || pa[i] >= HW) {
      throw Error("maxpool2d_backward: argmax " + std::to_string(pa[i]) + " at " + std::to_string(i) +
                  " is outside the " + std::to_string(HW) + "-value planes of " + dx.str() +
                  "; pass the argmax that maxpool2d wrote for this input");
    }
  }
  dispatch_float(dy, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    std::fill(pdx, pdx + dx.numel(), T(0));
    for (int64_t plane = 0; plane < planes; ++plane) {
      for (int64_t o = 0; o < PQ; ++o) pdx[plane * HW + pa[plane * PQ + o]] += pdy[plane * PQ + o];
    }
  });
}

void CpuBackend::avgpool2d(const Tensor& x, int kernel, int stride, Tensor& y) {
  const PoolDims d = check_avgpool(x, kernel, stride, "avgpool2d");
  check_shape(y, x, {d.N, d.C, d.P, d.Q}, "avgpool2d", "output", pool_because(x, kernel, stride, 0));
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
    const double inv = 1.0 / (static_cast<double>(kernel) * kernel);
    for (int64_t plane = 0; plane < d.N * d.C; ++plane) {
      const T* in = px + plane * d.H * d.W;
      for (int64_t p = 0; p < d.P; ++p) {
        for (int64_t q = 0; q < d.Q; ++q) {
          double sum = 0;
          for (int64_t h = p * stride; h < p * stride + kernel; ++h) {
            for (int64_t w = q * stride; w < q * stride + kernel; ++w) sum += in[h * d.W + w];
          }
          py[(plane * d.P + p) * d.Q + q] = static_cast<T>(sum * inv);
        }
      }
    }
  });
}

// dx is overwritten, like maxpool2d_backward's: input positions that no window
// covers (when the stride skips them) get 0.
void CpuBackend::avgpool2d_backward(const Tensor& dy, int kernel, int stride, Tensor& dx) {
  const PoolDims d = check_avgpool(dx, kernel, stride, "avgpool2d_backward");
  check_shape(dy, dx, {d.N, d.C, d.P, d.Q}, "avgpool2d_backward", "output gradient dy",
              pool_because(dx, kernel, stride, 0));
  dispatch_float(dx, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    std::fill(pdx, pdx + dx.numel(), T(0));
    const T inv = static_cast<T>(1.0 / (static_cast<double>(kernel) * kernel));
    for (int64_t plane = 0; plane < d.N * d.C; ++plane) {
      T* out = pdx + plane * d.H * d.W;
      for (int64_t p = 0; p < d.P; ++p) {
        for (int64_t q = 0; q < d.Q; ++q) {
          const T g = pdy[(plane * d.P + p) * d.Q + q] * inv;
          for (int64_t h = p * stride; h < p * stride + kernel; ++h) {
            for (int64_t w = q * stride; w < q * stride + kernel; ++w) out[h * d.W + w] += g;
          }
        }
      }
    }
  });
}

}  // namespace gpipe
