// The CUDA backend's fused attention (Backend::fused_attention and its backward):
// cuDNN's fused scaled-dot-product attention (flash attention), causal, grouped-query
// without repeating keys and values, bfloat16 and float16 in and out with float32
// compute, through the graph API of NVIDIA's cuDNN frontend (header-only, MIT; ./gpipe
// fetches it from PyPI, build_defs/cudnn_frontend_configure.bzl). One graph per shape
// and direction, built on first use and kept; the backward asks for cuDNN's
// deterministic algorithm, as every other kernel of this backend is deterministic.
//
// The tensors are used where they lie: (B, T, heads, D) row-major is cuDNN's
// (b, h, s, d) with strides (T heads D, D, heads D, 1), so nothing is transposed. A
// build without the frontend compiles none of this: has_fused_attention is false and
// layers keep the exact attention (pack_qkv, attention).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <string>

#include "kernels/cuda_backend.h"
#include "runtime/cuda_device.h"
#include "runtime/error.h"

#ifdef GPIPE_WITH_CUDNN_FRONTEND
#include <cudnn.h>

#include <spdlog/spdlog.h>

#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <unordered_map>

#include <cudnn_frontend.h>
#endif

namespace gpipe {

bool cuda_fused_attention_available(DType t, int64_t head_dim) {
#ifdef GPIPE_WITH_CUDNN_FRONTEND
  return gpu_fused_attention_expected(t, head_dim) && cudnnGetVersion() >= 90000;
#else
  (void)t;
  (void)head_dim;
  return false;
#endif
}

#ifndef GPIPE_WITH_CUDNN_FRONTEND

bool CudaBackend::has_fused_attention(DType t, const AttentionSizes& dims) {
  return cuda_fused_attention_available(t, dims.head_dim);  // false: no frontend
}

void CudaBackend::fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& out,
                                  Tensor& stats) {
  Backend::fused_attention(q, k, v, heads, out, stats);  // says that there is none
}

void CudaBackend::fused_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& out, const Tensor& stats, int heads, Tensor& dq,
                                           Tensor& dk, Tensor& dv) {
  Backend::fused_attention_backward(dout, q, k, v, out, stats, heads, dq, dk, dv);
}

void CudaBackend::release_attention_graphs() noexcept {}

#else

namespace fe = cudnn_frontend;

namespace {

// The tensors' ids in the graphs' variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

struct AttentionShape {
  int64_t B, T, H, KV, D;
  DType t;
  bool backward;
  bool operator<(const AttentionShape& o) const {
    return std::tie(B, T, H, KV, D, t, backward) < std::tie(o.B, o.T, o.H, o.KV, o.D, o.t, o.backward);
  }
};

struct BuiltGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

struct AttentionGraphs {
  std::map<AttentionShape, BuiltGraph> built;
  std::set<AttentionShape> refused;  // forward shapes cuDNN could not build (either direction)
};

// (B, T, heads, D) row-major as cuDNN's (b, h, s, d).
std::shared_ptr<fe::graph::Tensor_attributes> bshd(fe::graph::Graph& g, const char* name, Uid uid, int64_t B,
                                                   int64_t T, int64_t heads, int64_t D) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({B, heads, T, D})
                      .set_stride({T * heads * D, D, heads * D, 1}));
}

void set_bshd(fe::graph::Tensor_attributes& t, Uid uid, int64_t B, int64_t T, int64_t heads, int64_t D) {
  t.set_output(true).set_uid(uid).set_dim({B, heads, T, D}).set_stride({T * heads * D, D, heads * D, 1});
}

std::string shape_text(const AttentionShape& s) {
  return std::string(s.backward ? "backward" : "forward") + " of B " + std::to_string(s.B) + ", T " +
         std::to_string(s.T) + ", " + std::to_string(s.H) + " heads, " + std::to_string(s.KV) +
         " key/value heads, head width " + std::to_string(s.D) + ", " + dtype_name(s.t);
}

void check_fe(fe::error_t status, const AttentionShape& s, const char* step) {
  if (!status.is_good()) {
    throw Error("cuDNN fused attention (" + shape_text(s) + "): " + step + " failed: " + status.get_message() +
                "; GPIPE_FUSED_ATTENTION=0 keeps the exact attention");
  }
}

BuiltGraph build(const AttentionShape& s, cudnnHandle_t handle) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(s.t == DType::kBF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.D)));
  auto q = bshd(*g, "q", kQ, s.B, s.T, s.H, s.D);
  auto k = bshd(*g, "k", kK, s.B, s.T, s.KV, s.D);
  auto v = bshd(*g, "v", kV, s.B, s.T, s.KV, s.D);
  if (!s.backward) {
    auto options = fe::graph::SDPA_attributes()
                       .set_name("attention")
                       .set_generate_stats(true)
                       .set_attn_scale(scale)
                       .set_causal_mask(true);
    auto [o, stats] = g->sdpa(q, k, v, options);
    set_bshd(*o, kO, s.B, s.T, s.H, s.D);
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({s.B, s.H, s.T, 1})
        .set_stride({s.H * s.T, s.T, 1, 1});
  } else {
    auto o = bshd(*g, "o", kO, s.B, s.T, s.H, s.D);
    auto d_o = bshd(*g, "do", kDO, s.B, s.T, s.H, s.D);
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("stats")
                               .set_uid(kStats)
                               .set_dim({s.B, s.H, s.T, 1})
                               .set_stride({s.H * s.T, s.T, 1, 1})
                               .set_data_type(fe::DataType_t::FLOAT));
    auto options = fe::graph::SDPA_backward_attributes()
                       .set_name("attention_backward")
                       .set_attn_scale(scale)
                       .set_causal_mask(true)
                       .set_deterministic_algorithm(true);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, options);
    set_bshd(*dq, kDQ, s.B, s.T, s.H, s.D);
    set_bshd(*dk, kDK, s.B, s.T, s.KV, s.D);
    set_bshd(*dv, kDV, s.B, s.T, s.KV, s.D);
  }
  check_fe(g->validate(), s, "validate");
  check_fe(g->build_operation_graph(handle), s, "build_operation_graph");
  check_fe(g->create_execution_plans({fe::HeurMode_t::A}), s, "create_execution_plans");
  check_fe(g->check_support(handle), s, "check_support");
  check_fe(g->build_plans(handle), s, "build_plans");
  BuiltGraph built;
  built.graph = g;
  check_fe(g->get_workspace_size(built.workspace_bytes), s, "get_workspace_size");
  return built;
}

// The (B, T, H, KV, D) of q (B, T, H D), k and v (B, T, KV D) with `heads` = H, checked.
AttentionShape attention_shape(const Tensor& q, const Tensor& k, const Tensor& v, int heads, bool backward,
                               const char* op) {
  auto fail = [&](const std::string& why) {
    throw Error(std::string(op) + ": " + why + " (q " + q.str() + ", k " + k.str() + ", v " + v.str() + ", " +
                std::to_string(heads) + " heads)");
  };
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3) fail("q, k and v must be (B, T, heads x head width)");
  if (!is_narrow(q.dtype()) || k.dtype() != q.dtype() || v.dtype() != q.dtype()) fail("one 16-bit type throughout");
  if (!q.is_contiguous() || !k.is_contiguous() || !v.is_contiguous()) fail("contiguous operands only");
  if (k.shape() != v.shape() || k.size(0) != q.size(0) || k.size(1) != q.size(1)) {
    fail("k and v must match q's B and T");
  }
  if (heads <= 0 || q.size(2) % heads != 0) fail("the width is not a multiple of the heads");
  const int64_t D = q.size(2) / heads;
  if (k.size(2) == 0 || k.size(2) % D != 0 || heads % (k.size(2) / D) != 0) {
    fail("the key/value heads must divide the heads");
  }
  return {q.size(0), q.size(1), heads, k.size(2) / D, D, q.dtype(), backward};
}

void check_like(const Tensor& t, const Shape& shape, DType dtype, const char* what, const char* op) {
  if (t.shape() != shape || t.dtype() != dtype || !t.is_contiguous()) {
    throw Error(std::string(op) + ": " + what + " " + t.str() + " must be " + dtype_name(dtype) + shape_str(shape));
  }
}

}  // namespace

void CudaBackend::release_attention_graphs() noexcept {
  delete static_cast<AttentionGraphs*>(attention_graphs_);
  attention_graphs_ = nullptr;
}

namespace {

// The built graph of `s`, built now if it is not yet (throws Error where cuDNN cannot).
// The device must be current.
const BuiltGraph& graph_for(void*& slot, const AttentionShape& s, cudnnHandle_t handle) {
  if (slot == nullptr) slot = new AttentionGraphs;
  auto& built = static_cast<AttentionGraphs*>(slot)->built;
  auto found = built.find(s);
  if (found != built.end()) return found->second;
  AttentionShape forward = s;
  forward.backward = false;
  if (static_cast<AttentionGraphs*>(slot)->refused.count(forward) != 0) {
    throw Error("cuDNN fused attention (" + shape_text(s) + ") was refused for this shape; ask has_fused_attention");
  }
  try {
    return built.emplace(s, build(s, handle)).first->second;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // the frontend's own (std::runtime_error)
    throw Error("cuDNN fused attention (" + shape_text(s) + "): " + e.what() +
                "; GPIPE_FUSED_ATTENTION=0 keeps the exact attention");
  }
}

}  // namespace

// Both directions' graphs are built here, before the layer commits to keeping only the
// statistics, so that a shape cuDNN refuses takes the exact path from its forward on.
bool CudaBackend::has_fused_attention(DType t, const AttentionSizes& d) {
  if (!cuda_fused_attention_available(t, d.head_dim)) return false;
  if (d.heads <= 0 || d.kv_heads <= 0 || d.heads % d.kv_heads != 0) return false;
  if (d.batch == 0 || d.seq == 0) return true;  // nothing to compute: the ops return at once
  const AttentionShape forward{d.batch, d.seq, d.heads, d.kv_heads, d.head_dim, t, false};
  AttentionShape backward = forward;
  backward.backward = true;
  if (attention_graphs_ == nullptr) attention_graphs_ = new AttentionGraphs;
  std::set<AttentionShape>& refused = static_cast<AttentionGraphs*>(attention_graphs_)->refused;
  if (refused.count(forward) != 0) return false;
  DeviceGuard guard(device_.index);
  auto handle = static_cast<cudnnHandle_t>(cudnn_handle());
  try {
    graph_for(attention_graphs_, forward, handle);
    graph_for(attention_graphs_, backward, handle);
    return true;
  } catch (const std::exception& e) {
    refused.insert(forward);
    spdlog::warn("{}; this shape takes the exact attention (it keeps the probabilities)", e.what());
    return false;
  }
}

void CudaBackend::fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& out,
                                  Tensor& stats) {
  const AttentionShape s = attention_shape(q, k, v, heads, /*backward=*/false, "fused_attention");
  if (!cuda_fused_attention_available(s.t, s.D)) Backend::fused_attention(q, k, v, heads, out, stats);
  check_like(out, q.shape(), s.t, "out", "fused_attention");
  check_like(stats, {s.B, s.H, s.T}, DType::kF32, "stats", "fused_attention");
  for (const Tensor* t : {&q, &k, &v}) check_on_device(*t, "fused_attention");
  check_on_device(out, "fused_attention");
  check_on_device(stats, "fused_attention");
  if (s.B == 0 || s.T == 0) return;
  DeviceGuard guard(device_.index);
  auto handle = static_cast<cudnnHandle_t>(cudnn_handle());
  const BuiltGraph& graph = graph_for(attention_graphs_, s, handle);
  Tensor workspace = empty({std::max<int64_t>(1, (graph.workspace_bytes + 7) / 8)}, DType::kF64);
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(q.raw_data())},
                                             {kK, const_cast<void*>(k.raw_data())},
                                             {kV, const_cast<void*>(v.raw_data())},
                                             {kO, out.raw_data()},
                                             {kStats, stats.raw_data()}};
  check_fe(graph.graph->execute(handle, pack, workspace.raw_data()), s, "execute");
}

void CudaBackend::fused_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& out, const Tensor& stats, int heads, Tensor& dq,
                                           Tensor& dk, Tensor& dv) {
  const AttentionShape s = attention_shape(q, k, v, heads, /*backward=*/true, "fused_attention_backward");
  if (!cuda_fused_attention_available(s.t, s.D)) {
    Backend::fused_attention_backward(dout, q, k, v, out, stats, heads, dq, dk, dv);
  }
  const char* op = "fused_attention_backward";
  check_like(dout, q.shape(), s.t, "dout", op);
  check_like(out, q.shape(), s.t, "out", op);
  check_like(stats, {s.B, s.H, s.T}, DType::kF32, "stats", op);
  check_like(dq, q.shape(), s.t, "dq", op);
  check_like(dk, k.shape(), s.t, "dk", op);
  check_like(dv, v.shape(), s.t, "dv", op);
  for (const Tensor* t : {&dout, &q, &k, &v, &out, &stats}) check_on_device(*t, op);
  for (const Tensor* t : {&dq, &dk, &dv}) check_on_device(*t, op);
  if (s.B == 0 || s.T == 0) return;
  DeviceGuard guard(device_.index);
  auto handle = static_cast<cudnnHandle_t>(cudnn_handle());
  const BuiltGraph& graph = graph_for(attention_graphs_, s, handle);
  Tensor workspace = empty({std::max<int64_t>(1, (graph.workspace_bytes + 7) / 8)}, DType::kF64);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<void*>(q.raw_data())},     {kK, const_cast<void*>(k.raw_data())},
      {kV, const_cast<void*>(v.raw_data())},     {kO, const_cast<void*>(out.raw_data())},
      {kDO, const_cast<void*>(dout.raw_data())}, {kStats, const_cast<void*>(stats.raw_data())},
      {kDQ, dq.raw_data()},                      {kDK, dk.raw_data()},
      {kDV, dv.raw_data()}};
  check_fe(graph.graph->execute(handle, pack, workspace.raw_data()), s, "execute");
}

#endif  // GPIPE_WITH_CUDNN_FRONTEND

}  // namespace gpipe
