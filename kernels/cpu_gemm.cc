// oneDNN behind cpu_blas::gemm and Backend::matmul_weight: primitives cached per shape
// and thread, packed weights cached per FrozenWeights window and thread.
#include "kernels/cpu_gemm.h"

#include <cblas.h>
#include <omp.h>

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/backend.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "runtime/error.h"

namespace gpipe {
namespace cpu_blas {

namespace {

using dnnl::memory;

constexpr int kUnset = -1;
std::atomic<int> g_library{kUnset};
std::atomic<int> g_threads{0};
std::atomic<bool> g_always_pack{false};

const dnnl::engine& engine() {
  static const dnnl::engine eng(dnnl::engine::kind::cpu, 0);  // thread-safe
  return eng;
}

// Per thread: the stream, the OpenMP team size last applied, the primitives, and the
// packed weights of the open window.
struct PrimitiveKey {
  int m, n, k, lda, ldb, ldc;
  bool ta, tb, any_b;
  float alpha, beta;
  bool always_pack = false;
  bool operator<(const PrimitiveKey& o) const {
    return std::tie(m, n, k, lda, ldb, ldc, ta, tb, any_b, alpha, beta, always_pack) <
           std::tie(o.m, o.n, o.k, o.lda, o.ldb, o.ldc, o.ta, o.tb, o.any_b, o.alpha, o.beta, o.always_pack);
  }
};

struct Primitive {
  dnnl::matmul prim;
  memory::desc a_md, b_md, c_md;  // b_md: the layout the primitive reads B in
  bool packed = false;            // b_md is not B's plain layout: B needs a reorder
};

// A packed copy of a weight. `w` shares the weight's storage, so that the block cannot
// be freed and reused for another tensor while the copy exists.
struct PackedWeight {
  Tensor w;
  bool tw;
  memory::desc md;
  memory mem;
};

struct ThreadState {
  dnnl::stream stream{engine()};
  int omp_threads = 0;
  std::map<PrimitiveKey, Primitive> primitives;
  int windows = 0;  // FrozenWeights alive on this thread
  std::vector<PackedWeight> packed;
};

ThreadState& state() {
  thread_local ThreadState s;
  return s;
}

// The operand (rows x cols) in row-major storage with leading dimension ld, or its
// transpose stored that way.
memory::desc plain(int rows, int cols, bool trans, int ld) {
  return memory::desc({rows, cols}, memory::data_type::f32, trans ? memory::dims{1, ld} : memory::dims{ld, 1});
}

// A layout with inner blocks (e.g. BA16a64b): oneDNN's packed weights.
bool blocked(const memory::desc& md) {
  return md.data.format_kind == dnnl_blocked && md.data.format_desc.blocking.inner_nblks > 0;
}

const Primitive& primitive(ThreadState& s, const PrimitiveKey& key) {
  auto it = s.primitives.find(key);
  if (it != s.primitives.end()) return it->second;
  Primitive p;
  p.a_md = plain(key.m, key.k, key.ta, key.lda);
  const memory::desc b_plain = plain(key.k, key.n, key.tb, key.ldb);
  p.c_md = plain(key.m, key.n, false, key.ldc);
  dnnl::primitive_attr attr;
  if (key.alpha != 1.f) attr.set_output_scales(0, {key.alpha});
  if (key.beta != 0.f) {
    dnnl::post_ops po;
    po.append_sum(key.beta);
    attr.set_post_ops(po);
  }
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p.a_md, b_plain, p.c_md), attr, engine());
  if (key.any_b) {
    // The weight layout oneDNN's kernels for this CPU prefer. Only a blocked one (its
    // AVX-512 kernels) is worth a copy: on AVX2 it asks for a plain row-major B, and
    // reading a transposed weight through such a copy measured slower than reading it
    // in place (bench/RESULTS.md, issue 21).
    const memory::desc any({key.k, key.n}, memory::data_type::f32, memory::format_tag::any);
    dnnl::matmul::primitive_desc pd_any(dnnl::matmul::desc(p.a_md, any, p.c_md), attr, engine());
    if (blocked(pd_any.weights_desc())) {
      pd = pd_any;
    } else if (key.always_pack) {
      // B (k x n) dense in the other order than the weight's own storage.
      const memory::desc other = memory::desc({key.k, key.n}, memory::data_type::f32,
                                              key.tb ? memory::dims{key.n, 1} : memory::dims{1, key.k});
      pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(p.a_md, other, p.c_md), attr, engine());
    }
  }
  p.b_md = pd.weights_desc();
  p.packed = p.b_md != b_plain;
  p.prim = dnnl::matmul(pd);
  return s.primitives.emplace(key, std::move(p)).first->second;
}

// oneDNN's OpenMP team on this thread: the size set_threads asked for. (An OpenMP
// setting is per thread: the main thread's does not reach the stage threads.)
void apply_threads(ThreadState& s) {
  const int want = g_threads.load(std::memory_order_relaxed);
  if (want > 0 && s.omp_threads != want) {
    omp_set_num_threads(want);
    s.omp_threads = want;
  }
}

void execute(ThreadState& s, const Primitive& p, const float* a, const memory& b, float* c) {
  apply_threads(s);
  memory am(p.a_md, engine(), const_cast<float*>(a)), cm(p.c_md, engine(), c);
  p.prim.execute(s.stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, cm}});
  s.stream.wait();
}

// The packed copy of w for layout md, made on first use in the window.
const memory& packed_weight(ThreadState& s, const Tensor& w, bool tw, const memory::desc& md, int k, int n) {
  for (const PackedWeight& e : s.packed) {
    if (e.w.storage_id() == w.storage_id() && e.w.raw_data() == w.raw_data() && e.w.shape() == w.shape() &&
        e.tw == tw && e.md == md) {
      return e.mem;
    }
  }
  const int ld = static_cast<int>(w.size(1));
  memory src(plain(k, n, tw, ld), engine(), w.raw_data());
  memory dst(md, engine());
  apply_threads(s);
  dnnl::reorder(src, dst).execute(s.stream, src, dst);
  s.stream.wait();
  s.packed.push_back({w, tw, md, dst});
  return s.packed.back().mem;
}

}  // namespace

Library parse_library(const std::string& name) {
  if (name == "auto") return Library::kAuto;
  if (name == "openblas") return Library::kOpenblas;
  if (name == "onednn") return Library::kOnednn;
  throw UserError("GPIPE_GEMM=" + name + " is not a matrix library; use auto, openblas or onednn");
}

const char* library_name(Library l) {
  switch (l) {
    case Library::kAuto:
      return "auto";
    case Library::kOpenblas:
      return "openblas";
    case Library::kOnednn:
      return "onednn";
  }
  return "?";
}

Library library() {
  int l = g_library.load(std::memory_order_relaxed);
  if (l == kUnset) {
    const char* env = std::getenv("GPIPE_GEMM");
    const Library chosen = env != nullptr && *env != '\0' ? parse_library(env) : Library::kAuto;
    int expected = kUnset;
    g_library.compare_exchange_strong(expected, static_cast<int>(chosen));
    l = g_library.load();
  }
  return static_cast<Library>(l);
}

void set_library(Library l) { g_library.store(static_cast<int>(l)); }

void set_threads(int threads) {
  {
    // OpenBLAS's setting is the process's, and changing it while another thread is inside
    // a product is not promised safe: set it only when it changes (a job's ranks as
    // threads each set the same value at their start).
    static std::mutex mu;
    static int applied = 0;
    static bool set = false;
    std::lock_guard<std::mutex> lock(mu);
    if (!set || applied != threads) openblas_set_num_threads(threads);
    applied = threads;
    set = true;
  }
  g_threads.store(threads);
  // GPIPE_GEMM=onednn at more than one thread: every product through oneDNN's OpenMP
  // team, which libgomp keeps spinning between products unless told to wait passively
  // (read when the library loads, so only the environment can say it).
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const bool passive = policy != nullptr && (std::string(policy) == "passive" || std::string(policy) == "PASSIVE");
  static std::atomic<bool> warned{false};
  if (library() == Library::kOnednn && threads != 1 && !passive && !warned.exchange(true)) {
    spdlog::warn("GPIPE_GEMM=onednn at {} BLAS threads a product: OpenMP's threads spin-wait between products and "
                 "can take the cores from the stage's other work (an MLP's step: 1.9 s at 2 threads on 2 cores, 29 ms "
                 "at one; bench/RESULTS.md); export OMP_WAIT_POLICY=passive, or leave GPIPE_GEMM at auto",
                 threads == 0 ? std::string("all cores'") : std::to_string(threads));
  }
  // Applies to the calling thread now; every other thread at its next oneDNN call.
  if (threads > 0) {
    omp_set_num_threads(threads);
    state().omp_threads = threads;
  }
}

void onednn_gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                 int ldb, float beta, float* c, int ldc) {
  ThreadState& s = state();
  const Primitive& p = primitive(s, {m, n, k, lda, ldb, ldc, ta, tb, false, alpha, beta});
  execute(s, p, a, memory(p.b_md, engine(), const_cast<float*>(b)), c);
}

bool gemm_weight(bool ta, int m, int n, int k, float alpha, const float* a, int lda, const Tensor& w, bool tw,
                 float beta, float* c, int ldc) {
  const Library lib = library();
  if (lib == Library::kOpenblas) return false;
  // auto: oneDNN only at one thread a product. With more, its OpenMP team and OpenBLAS's
  // threads each spin-wait for their next product on the cores the other needs (libgomp
  // spins unless OMP_WAIT_POLICY=passive): at 2 threads on 2 cores an MLP's step took
  // 53x as long as at one, and OpenBLAS alone at 2 threads was as fast as oneDNN there
  // (bench/RESULTS.md).
  if (lib == Library::kAuto && g_threads.load(std::memory_order_relaxed) != 1) return false;
  ThreadState& s = state();
  const int ldw = static_cast<int>(w.size(1));
  if (s.windows == 0) {  // no promise that w stays: read it where it is
    if (lib == Library::kAuto) return false;
    onednn_gemm(ta, tw, m, n, k, alpha, a, lda, w.data<float>(), ldw, beta, c, ldc);
    return true;
  }
  const Primitive& p =
      primitive(s, {m, n, k, lda, ldw, ldc, ta, tw, true, alpha, beta, g_always_pack.load(std::memory_order_relaxed)});
  if (!p.packed) {  // oneDNN reads w in place: no copy to keep
    if (lib == Library::kAuto) return false;
    onednn_gemm(ta, tw, m, n, k, alpha, a, lda, w.data<float>(), ldw, beta, c, ldc);
    return true;
  }
  execute(s, p, a, packed_weight(s, w, tw, p.b_md, k, n), c);
  return true;
}

int packed_weights_held() { return static_cast<int>(state().packed.size()); }

void set_always_pack(bool on) { g_always_pack.store(on); }

}  // namespace cpu_blas

FrozenWeights::FrozenWeights() { ++cpu_blas::state().windows; }

FrozenWeights::~FrozenWeights() {
  cpu_blas::ThreadState& s = cpu_blas::state();
  if (--s.windows == 0) s.packed.clear();
}

}  // namespace gpipe
