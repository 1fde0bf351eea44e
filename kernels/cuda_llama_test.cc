// The LLaMA ops (rope, rope_backward, pack_qkv, pack_qkv_backward) on cuda:0 against the
// CPU reference, float32 and float64, in place where the op allows it. Built only with
// --config=cuda; without a GPU it prints the skip marker and passes.
#include "tests/gpu_testing.h"

using namespace gpipe;
using namespace gpipe::gpu_testing;
using gpipe::testing::random_tensor;

TEST_CASE("rope and rope_backward match the CPU") {
  for (DType dt : kFloatTypes) {
    CAPTURE(dtype_name(dt));
    const Tensor x = random_tensor({3, 37, 4 * 16}, dt, 1, -3, 3);
    Tensor want = cpu().empty(x.shape(), dt), host = cpu().empty(x.shape(), dt);
    cpu().rope(x, 4, 10000.0, want);
    Tensor gx = to_gpu(x);
    gpu().rope(gx, 4, 10000.0, gx);  // in place
    gpu().copy(gx, host);
    EXPECT_CLOSE_TOL(host, want, elementwise_tol(dt));
    cpu().rope_backward(x, 4, 500.0, want);
    Tensor got = gpu().empty(x.shape(), dt);
    gpu().rope_backward(to_gpu(x), 4, 500.0, got);
    gpu().copy(got, host);
    EXPECT_CLOSE_TOL(host, want, elementwise_tol(dt));
  }
}

TEST_CASE("pack_qkv and its backward match the CPU") {
  for (DType dt : kFloatTypes) {
    for (int64_t kv : {1, 2, 4}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(kv);
      const int64_t B = 2, T = 9, H = 4, D = 6;
      const Tensor q = random_tensor({B, T, H * D}, dt, 2), k = random_tensor({B, T, kv * D}, dt, 3),
                   v = random_tensor({B, T, kv * D}, dt, 4), g = random_tensor({B, T, 3 * H * D}, dt, 5);
      Tensor want = cpu().empty(g.shape(), dt), got = gpu().empty(g.shape(), dt), host = cpu().empty(g.shape(), dt);
      cpu().pack_qkv(q, k, v, H, want);
      gpu().pack_qkv(to_gpu(q), to_gpu(k), to_gpu(v), H, got);
      gpu().copy(got, host);
      EXPECT_CLOSE_TOL(host, want, elementwise_tol(dt));
      Tensor wq = cpu().empty(q.shape(), dt), wk = cpu().empty(k.shape(), dt), wv = cpu().empty(v.shape(), dt);
      Tensor gq = gpu().empty(q.shape(), dt), gk = gpu().empty(k.shape(), dt), gv = gpu().empty(v.shape(), dt);
      cpu().pack_qkv_backward(g, H, wq, wk, wv);
      gpu().pack_qkv_backward(to_gpu(g), H, gq, gk, gv);
      for (auto [gdev, w] : {std::pair<Tensor*, Tensor*>{&gq, &wq}, {&gk, &wk}, {&gv, &wv}}) {
        Tensor h = cpu().empty(w->shape(), dt);
        gpu().copy(*gdev, h);
        EXPECT_CLOSE_TOL(h, *w, elementwise_tol(dt));
      }
    }
  }
}

TEST_CASE("the CUDA LLaMA ops reject what the CPU rejects") {
  Tensor x = to_gpu(random_tensor({2, 3, 12}, DType::kF32, 6)), y = gpu().empty({2, 3, 12}, DType::kF32);
  CHECK_THROWS_WITH_AS(gpu().rope(x, 4, 10000.0, y), doctest::Contains("head width 3 (12 / 4 heads) is odd"),
                       UserError);
  CHECK_THROWS_WITH(gpu().rope(random_tensor({2, 3, 12}, DType::kF32, 7), 2, 10000.0, y),
                    doctest::Contains("is not on cuda:0"));
}

int main(int argc, char** argv) { return run_gpu_tests(argc, argv); }
