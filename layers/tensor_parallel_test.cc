// Tensor parallelism inside a stage (issue 38, its first part: the split linear layers).
// A member's block of a split layer holds exactly that block of the unsplit layer's
// values; and a Megatron MLP (column-parallel linear, GELU on each member's block,
// row-parallel linear) run by T threads, each member with its own block and the group's
// sums between them, gives the unsplit MLP's output and input gradient on every member,
// and each member's weight gradients are exactly its blocks of the unsplit ones: float64,
// to 1e-12, for T = 1, 2, 4, with and without biases.
#include "layers/tensor_parallel.h"

#include <doctest/doctest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/backend.h"
#include "layers/activation.h"
#include "layers/attention.h"
#include "layers/embedding.h"
#include "layers/gqa_attention.h"
#include "layers/linear.h"
#include "layers/llama_block.h"
#include "layers/loss.h"
#include "layers/swiglu.h"
#include "layers/transformer.h"
#include "runtime/error.h"
#include "runtime/inprocess_replica_group.h"
#include "tests/tensor_group.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::layers;
using gpipe::testing::block_of;
using gpipe::testing::compare;
using gpipe::testing::random_tensor;
using gpipe::testing::run_members;
using gpipe::testing::to_doubles;

namespace {

void check_close(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  CAPTURE(what);
  REQUIRE(got.size() == want.size());
  const auto r = compare(got, want, 1e-12, 1e-12);
  CHECK_MESSAGE(r.ok, what << ": " << r.detail);
}

LinearOptions options(int64_t in, int64_t out, bool bias, uint64_t seed, TensorSplit split = {}) {
  LinearOptions o(in, out);
  o.leading = {2};  // (batch, 2, features): the rows are batch x 2
  o.bias = bias;
  o.dtype = DType::kF64;
  o.seed = seed;
  o.split = split;
  return o;
}

}  // namespace

TEST_CASE("a member's block of a split linear layer holds that block of the unsplit layer's values") {
  Linear whole(options(6, 8, true, 11));
  for (int T : {2, 4}) {
    for (int r = 0; r < T; ++r) {
      CAPTURE(T);
      CAPTURE(r);
      Linear column(options(6, 8, true, 11, {TensorSplitKind::kColumn, r, T}));
      CHECK(column.weight().value.shape() == Shape{8 / T, 6});
      check_close(to_doubles(column.weight().value), block_of(whole.weight().value, 0, r, T), "column weight");
      check_close(to_doubles(column.bias().value), block_of(whole.bias().value, 0, r, T), "column bias");
      CHECK(column.weight().shard_dim == 0);
      CHECK(column.weight().whole == Shape{8, 6});
      Linear row(options(8, 6, true, 11, {TensorSplitKind::kRow, r, T}));
      Linear row_whole(options(8, 6, true, 11));
      CHECK(row.weight().value.shape() == Shape{6, 8 / T});
      check_close(to_doubles(row.weight().value), block_of(row_whole.weight().value, 1, r, T), "row weight");
      check_close(to_doubles(row.bias().value), to_doubles(row_whole.bias().value), "row bias (whole)");
      CHECK(row.weight().shard_dim == 1);
      CHECK(row.bias().shard_dim == -1);
      CHECK(row.input_shape() == Shape{2, 8 / T});
      CHECK(row.output_shape() == Shape{2, 6});
      CHECK(row.describe() == "linear(8 -> 6, row " + std::to_string(r) + "/" + std::to_string(T) + ")");
    }
  }
}

TEST_CASE("a column- then row-parallel MLP on T threads equals the unsplit MLP, output and every gradient") {
  const int64_t batch = 3, in = 6, hidden = 8, out = 5;
  Backend& be = backend_for(Device::cpu());
  const Tensor x = random_tensor({batch, 2, in}, DType::kF64, 1);
  const Tensor dy = random_tensor({batch, 2, out}, DType::kF64, 2);
  for (bool bias : {true, false}) {
    // The unsplit MLP.
    Linear up(options(in, hidden, bias, 21)), down(options(hidden, out, bias, 22));
    Gelu gelu({2, hidden}, DType::kF64);
    Context c1, c2, c3;
    const Tensor h = up.forward(be, x, &c1);
    const Tensor g = gelu.forward(be, h, &c2);
    const Tensor y = down.forward(be, g, &c3);
    const Tensor dg = down.backward(be, dy, c3);
    const Tensor dh = gelu.backward(be, dg, c2);
    const Tensor dx = up.backward(be, dh, c1);
    for (int T : {1, 2, 4}) {
      CAPTURE(bias);
      CAPTURE(T);
      struct Member {
        std::vector<double> y, dx, up_w, up_b, down_w, down_b;
      };
      std::vector<Member> got(static_cast<size_t>(T));
      const std::vector<std::string> errors = run_members(T, [&](int r, TensorCollectives& group) {
        Member& m = got[static_cast<size_t>(r)];
        Linear up_r(options(in, hidden, bias, 21, {TensorSplitKind::kColumn, r, T}));
        Linear down_r(options(hidden, out, bias, 22, {TensorSplitKind::kRow, r, T}));
        up_r.set_collectives(&group);
        down_r.set_collectives(&group);
        Gelu gelu_r({2, hidden / T}, DType::kF64);  // elementwise, on the member's block
        Context k1, k2, k3;
        const Tensor hr = up_r.forward(be, x, &k1);
        const Tensor gr = gelu_r.forward(be, hr, &k2);
        m.y = to_doubles(down_r.forward(be, gr, &k3));
        const Tensor dgr = down_r.backward(be, dy, k3);
        const Tensor dhr = gelu_r.backward(be, dgr, k2);
        m.dx = to_doubles(up_r.backward(be, dhr, k1));
        m.up_w = to_doubles(up_r.weight().grad);
        m.down_w = to_doubles(down_r.weight().grad);
        if (bias) {
          m.up_b = to_doubles(up_r.bias().grad);
          m.down_b = to_doubles(down_r.bias().grad);
        }
      });
      for (int r = 0; r < T; ++r) {
        CAPTURE(r);
        const Member& m = got[static_cast<size_t>(r)];
        REQUIRE_MESSAGE(errors[static_cast<size_t>(r)].empty(), errors[static_cast<size_t>(r)]);
        check_close(m.y, to_doubles(y), "output (every member: the row layer's sum)");
        check_close(m.dx, to_doubles(dx), "input gradient (every member: the column layer's sum)");
        check_close(m.up_w, block_of(up.weight().grad, 0, r, T), "column layer's weight gradient");
        check_close(m.down_w, block_of(down.weight().grad, 1, r, T), "row layer's weight gradient");
        if (bias) {
          check_close(m.up_b, block_of(up.bias().grad, 0, r, T), "column layer's bias gradient");
          check_close(m.down_b, to_doubles(down.bias().grad), "row layer's bias gradient (whole)");
        }
      }
    }
  }
}

// Linear::forward_add and backward_input_add where the product is not the last op before
// the sum: a row-parallel member's output and a column-parallel member's input gradient are
// summed over the group first (and a bias added), so each is the plain call and then the
// sum. Checked against the unsplit layer's output and input gradient plus the same tensor.
TEST_CASE("a split linear layer's forward_add and backward_input_add sum after the group's sum") {
  const int64_t batch = 3, in = 4, out = 8;
  Backend& be = backend_for(Device::cpu());
  const Tensor x = random_tensor({batch, 2, in}, DType::kF64, 31);
  const Tensor dy = random_tensor({batch, 2, out}, DType::kF64, 33), res = random_tensor({batch, 2, out}, DType::kF64, 34);
  const Tensor acc = random_tensor({batch, 2, in}, DType::kF64, 35);
  for (bool bias : {true, false}) {
    CAPTURE(bias);
    // Unsplit: the output plus the residual, and the input gradient plus what it is added into.
    Linear row_whole(options(in, out, bias, 41)), col_whole(options(in, out, bias, 42));
    Context c1, c2;
    std::vector<double> y_want = to_doubles(row_whole.forward(be, x, &c1));
    const std::vector<double> rv = to_doubles(res);
    for (size_t i = 0; i < y_want.size(); ++i) y_want[i] += rv[i];
    col_whole.forward(be, x, &c2);
    std::vector<double> dx_want = to_doubles(col_whole.backward_input(be, dy, c2));
    const std::vector<double> av = to_doubles(acc);
    for (size_t i = 0; i < dx_want.size(); ++i) dx_want[i] += av[i];
    for (int T : {2, 4}) {
      CAPTURE(T);
      std::vector<std::vector<double>> ys(static_cast<size_t>(T)), dxs(static_cast<size_t>(T));
      const std::vector<std::string> errors = run_members(T, [&](int r, TensorCollectives& group) {
        Linear row(options(in, out, bias, 41, {TensorSplitKind::kRow, r, T}));
        Linear col(options(in, out, bias, 42, {TensorSplitKind::kColumn, r, T}));
        row.set_collectives(&group);
        col.set_collectives(&group);
        Tensor xs = be.empty({batch, 2, in / T}, DType::kF64);  // the row member's input features
        const std::vector<double> xv = to_doubles(x);
        std::vector<double> part;
        for (int64_t i = 0; i < batch * 2; ++i) {
          for (int64_t j = 0; j < in / T; ++j) part.push_back(xv[static_cast<size_t>(i * in + r * (in / T) + j)]);
        }
        std::copy(part.begin(), part.end(), xs.data<double>());
        Context k1, k2;
        ys[static_cast<size_t>(r)] = to_doubles(row.forward_add(be, xs, res, &k1));
        col.forward(be, x, &k2);
        Tensor dy_block = be.empty({batch, 2, out / T}, DType::kF64);  // the column member's outputs
        const std::vector<double> dv = to_doubles(dy);
        double* d = dy_block.data<double>();
        for (int64_t i = 0; i < batch * 2; ++i) {
          for (int64_t j = 0; j < out / T; ++j) *d++ = dv[static_cast<size_t>(i * out + r * (out / T) + j)];
        }
        Tensor sum = be.empty(acc.shape(), DType::kF64);
        be.copy(acc, sum);
        col.backward_input_add(be, dy_block, k2, sum);
        dxs[static_cast<size_t>(r)] = to_doubles(sum);
      });
      for (int r = 0; r < T; ++r) {
        CAPTURE(r);
        REQUIRE_MESSAGE(errors[static_cast<size_t>(r)].empty(), errors[static_cast<size_t>(r)]);
        check_close(ys[static_cast<size_t>(r)], y_want, "row-parallel forward_add: the group's sum, then the residual");
        check_close(dxs[static_cast<size_t>(r)], dx_want, "column-parallel backward_input_add: the group's sum, added");
      }
    }
  }
}

TEST_CASE("a split that does not divide, and a split layer without its group, are refused by name") {
  CHECK_THROWS_WITH_AS(Linear(options(6, 7, true, 1, {TensorSplitKind::kColumn, 0, 2})),
                       doctest::Contains("linear(6 -> 7) split by output features (column-parallel): 7 does not "
                                         "split into 2 equal blocks"),
                       UserError);
  CHECK_THROWS_WITH_AS(Linear(options(6, 8, true, 1, {TensorSplitKind::kRow, 0, 4})),
                       doctest::Contains("6 does not split into 4 equal blocks"), UserError);
  Linear row(options(8, 6, true, 1, {TensorSplitKind::kRow, 1, 2}));
  Backend& be = backend_for(Device::cpu());
  const Tensor x = random_tensor({1, 2, 4}, DType::kF64, 3);
  CHECK_THROWS_WITH_AS(
      row.forward(be, x, nullptr),
      doctest::Contains("linear(8 -> 6, row 1/2) is split over a tensor group of 2 but was given none"), Error);
}

// T members of a split layer (make(shard)) on threads, each with its own block and the
// group's sums, against the unsplit layer (make({})) on the same input and output
// gradient: the output and the input gradient on every member, and each parameter's
// gradient as its block of the unsplit one (Parameter::shard_dim .. shard_groups: the
// block's place, which the tests of each layer pin down by name), float64 to 1e-12.
template <typename Make>
void check_split_equals_whole(Make make, const Tensor& x, const Tensor& dy, const ForwardArgs& args) {
  Backend& be = backend_for(Device::cpu());
  auto whole = make(TensorShard{});
  Context c;
  const Tensor y = whole->forward(be, x, &c, args);
  const Tensor dx = whole->backward(be, dy, c);  // undefined for token ids
  auto values = [](const Tensor& t) { return t.defined() ? to_doubles(t) : std::vector<double>{}; };
  const std::vector<Parameter*> wp = whole->parameters();
  for (int T : {1, 2, 4}) {
    CAPTURE(T);
    struct Member {
      std::vector<double> y, dx;
      std::vector<std::vector<double>> grads, want;
      std::vector<std::string> names;
    };
    std::vector<Member> got(static_cast<size_t>(T));
    const std::vector<std::string> errors = run_members(T, [&](int r, TensorCollectives& group) {
      Member& m = got[static_cast<size_t>(r)];
      auto mine = make(TensorShard{r, T});
      mine->set_collectives(&group);
      // Its costs are a member's, and consistent with what it computes (Layer::cost's checks).
      for (int64_t batch : {int64_t{1}, x.size(0)}) check_cost(*mine, batch, mine->cost(batch));
      Context k;
      m.y = to_doubles(mine->forward(be, x, &k, args));
      m.dx = values(mine->backward(be, dy, k));
      const std::vector<Parameter*> ps = mine->parameters();
      if (ps.size() != wp.size()) throw std::runtime_error("the split layer has other parameters");
      for (size_t i = 0; i < ps.size(); ++i) {
        const Parameter& p = *ps[i];
        m.names.push_back(p.name);
        m.grads.push_back(to_doubles(p.grad));
        m.want.push_back(p.shard_dim < 0
                             ? to_doubles(wp[i]->grad)
                             : block_of(wp[i]->grad, p.shard_dim, p.shard_rank, p.shard_count, p.shard_groups));
      }
    });
    for (int r = 0; r < T; ++r) {
      CAPTURE(r);
      const Member& m = got[static_cast<size_t>(r)];
      REQUIRE_MESSAGE(errors[static_cast<size_t>(r)].empty(), errors[static_cast<size_t>(r)]);
      check_close(m.y, to_doubles(y), "output");
      check_close(m.dx, values(dx), "input gradient");
      for (size_t i = 0; i < m.grads.size(); ++i) check_close(m.grads[i], m.want[i], m.names[i] + "'s gradient");
    }
  }
}

// Where each split parameter's block lies, by name: {name, dim, groups}; every other
// parameter whole.
void check_blocks(Layer& layer, const std::vector<std::tuple<std::string, int, int>>& split) {
  for (Parameter* p : layer.parameters()) {
    CAPTURE(p->name);
    int dim = -1, groups = 1;
    for (const auto& [name, d, g] : split) {
      if (name == p->name) dim = d, groups = g;
    }
    CHECK(p->shard_dim == dim);
    if (dim >= 0) CHECK(p->shard_groups == groups);
  }
}

// Attention split by heads (Megatron's ParallelAttention): dropout on, in training, so
// every member must draw the unsplit layer's mask on the whole output.
TEST_CASE("attention split by heads on T threads equals the unsplit attention, output and every gradient") {
  const int64_t batch = 2, seq = 3, dim = 8, heads = 4;
  ForwardArgs args;
  args.step = 7;
  args.sample_offset = 3;
  auto make = [&](TensorShard shard) {
    AttentionOptions o(dim, heads, seq);
    o.dropout = 0.25;
    o.dtype = DType::kF64;
    o.seed = 31;
    o.shard = shard;
    return std::make_unique<CausalSelfAttention>(o);
  };
  check_split_equals_whole(make, random_tensor({batch, seq, dim}, DType::kF64, 4),
                           random_tensor({batch, seq, dim}, DType::kF64, 5), args);
  // Its heads' rows of q, k and v; their columns of the output projection; its bias whole.
  check_blocks(*make({1, 2}), {{"qkv.weight", 0, 3}, {"qkv.bias", 0, 3}, {"proj.weight", 1, 1}});
  CHECK_THROWS_WITH_AS(make({0, 3}), doctest::Contains("4 heads do not split over a tensor group of 3"), UserError);
}

// GPT's block (transformer_block): attention by heads, the MLP by its hidden features,
// the layer norms whole; dropout on.
TEST_CASE("a transformer block split over T threads equals the unsplit block, output and every gradient") {
  const int64_t batch = 2, seq = 3, dim = 8, heads = 4;
  ForwardArgs args;
  args.step = 3;
  auto make = [&](TensorShard shard) {
    TransformerBlockOptions o(dim, heads, seq);
    o.dropout = 0.1;
    o.dtype = DType::kF64;
    o.seed = 41;
    o.shard = shard;
    return std::make_unique<TransformerBlock>(o);
  };
  check_split_equals_whole(make, random_tensor({batch, seq, dim}, DType::kF64, 6),
                           random_tensor({batch, seq, dim}, DType::kF64, 7), args);
  check_blocks(*make({0, 4}), {{"attn.qkv.weight", 0, 3},
                               {"attn.qkv.bias", 0, 3},
                               {"attn.proj.weight", 1, 1},
                               {"fc1.weight", 0, 1},
                               {"fc1.bias", 0, 1},
                               {"fc2.weight", 1, 1}});
}

// The LLaMA layers: grouped-query attention by heads (each member's key/value heads
// serve exactly its query heads), SwiGLU by its hidden features, and the block with
// its norms whole; rope on, the block's dropout on.
TEST_CASE("the LLaMA layers split over T threads equal the unsplit layers, output and every gradient") {
  const int64_t batch = 2, seq = 4, dim = 16, heads = 8, kv_heads = 4, hidden = 12;
  ForwardArgs args;
  args.step = 2;
  args.sample_offset = 1;
  const Tensor x = random_tensor({batch, seq, dim}, DType::kF64, 8);
  const Tensor dy = random_tensor({batch, seq, dim}, DType::kF64, 9);
  SUBCASE("gqa_attention") {
    auto make = [&](TensorShard shard) {
      GqaAttentionOptions o(dim, heads, seq);
      o.kv_heads = kv_heads;
      o.dtype = DType::kF64;
      o.seed = 51;
      o.shard = shard;
      return std::make_unique<GqaAttention>(o);
    };
    check_split_equals_whole(make, x, dy, args);
    check_blocks(*make({1, 4}), {{"q.weight", 0, 1}, {"k.weight", 0, 1}, {"v.weight", 0, 1}, {"o.weight", 1, 1}});
    CHECK_THROWS_WITH_AS(make({0, 3}),
                         doctest::Contains("8 heads and 4 kv heads do not both split over a tensor group of 3"),
                         UserError);
  }
  // Fewer key/value heads than members: each replicated over the members whose query
  // heads it serves (2 heads over 4 members: member r keeps head r / 2; one head, multi-
  // query: whole on every member), their weight gradients summed over those members.
  SUBCASE("gqa_attention with key/value heads replicated over a larger group") {
    for (int64_t kv : {int64_t{2}, int64_t{1}}) {
      CAPTURE(kv);
      auto make = [&](TensorShard shard) {
        GqaAttentionOptions o(dim, heads, seq);
        o.kv_heads = kv;
        o.dtype = DType::kF64;
        o.seed = 54;
        o.shard = shard;
        return std::make_unique<GqaAttention>(o);
      };
      check_split_equals_whole(make, x, dy, args);
      auto member = make({3, 4});
      for (Parameter* p : member->parameters()) {
        CAPTURE(p->name);
        const bool kv_weight = p->name == "k.weight" || p->name == "v.weight";
        CHECK(p->shard_replicas == (kv_weight ? 4 / kv : 1));
        if (kv_weight) {
          CHECK(p->shard_dim == (kv == 2 ? 0 : -1));  // one head: whole on every member
          if (kv == 2) CHECK(p->shard_rank == 1);     // member 3 of 4: head 3 / 2
          if (kv == 2) CHECK(p->shard_count == 2);
        }
      }
    }
  }
  SUBCASE("swiglu") {
    auto make = [&](TensorShard shard) {
      SwiGLUOptions o(dim, hidden);
      o.leading = {seq};
      o.dtype = DType::kF64;
      o.seed = 52;
      o.shard = shard;
      return std::make_unique<SwiGLU>(o);
    };
    check_split_equals_whole(make, x, dy, args);
    check_blocks(*make({0, 2}), {{"gate.weight", 0, 1}, {"up.weight", 0, 1}, {"down.weight", 1, 1}});
  }
  SUBCASE("llama_block") {
    auto make = [&](TensorShard shard) {
      LlamaBlockOptions o(dim, heads, hidden, seq);
      o.kv_heads = kv_heads;
      o.dropout = 0.1;
      o.dtype = DType::kF64;
      o.seed = 53;
      o.shard = shard;
      return std::make_unique<LlamaBlock>(o);
    };
    check_split_equals_whole(make, x, dy, args);
    check_blocks(*make({3, 4}), {{"attn.q.weight", 0, 1},
                                 {"attn.k.weight", 0, 1},
                                 {"attn.v.weight", 0, 1},
                                 {"attn.o.weight", 1, 1},
                                 {"ffn.gate.weight", 0, 1},
                                 {"ffn.up.weight", 0, 1},
                                 {"ffn.down.weight", 1, 1}});
  }
}

// The vocabulary-parallel embedding: each member's rows, zeros for the others' ids, the
// group's sum, then the (whole) positions; a token id outside the vocabulary is refused
// on every member as by the unsplit layer.
TEST_CASE("a vocabulary-parallel embedding on T threads equals the unsplit embedding, output and every gradient") {
  const int64_t batch = 3, seq = 5, vocab = 12, dim = 6;
  const Tensor ids = gpipe::testing::random_labels(batch * seq, static_cast<int>(vocab), 10).reshape({batch, seq});
  const Tensor dy = random_tensor({batch, seq, dim}, DType::kF64, 11);
  for (int64_t positions : {seq, int64_t{0}}) {
    CAPTURE(positions);
    auto make = [&](TensorShard shard) {
      EmbeddingOptions o(vocab, dim, seq);
      o.max_positions = positions;
      o.dtype = DType::kF64;
      o.seed = 61;
      o.shard = shard;
      return std::make_unique<Embedding>(o);
    };
    check_split_equals_whole(make, ids, dy, ForwardArgs{});
    check_blocks(*make({2, 4}), {{"token", 0, 1}});
  }
  auto make = [&](TensorShard shard) {
    EmbeddingOptions o(vocab, dim, seq);
    o.dtype = DType::kF64;
    o.shard = shard;
    return std::make_unique<Embedding>(o);
  };
  CHECK_THROWS_WITH_AS(
      make({0, 5}), doctest::Contains("a vocabulary of 12 tokens does not split over a tensor group of 5"), UserError);
  // An id past the vocabulary: refused by a member whose rows it is not in, too.
  Tensor bad = Tensor::empty(ids.shape(), DType::kI32, Device::cpu());
  copy_tensor(ids, bad);
  bad.data<int32_t>()[4] = static_cast<int32_t>(vocab);
  auto member = make({0, 2});
  CHECK_THROWS_WITH_AS(member->forward(backend_for(Device::cpu()), bad, nullptr),
                       doctest::Contains("token id 12 at (b=0, t=4) is outside the vocabulary [0, 12)"), UserError);
}

// The vocabulary-parallel head: a column-parallel output projection (each member its
// block of the vocabulary) and the vocabulary-parallel cross-entropy on its logits, never
// gathered, against the unsplit projection and SoftmaxCrossEntropy: the loss on every
// member, the hidden state's gradient and each member's block of the projection's
// gradient; with ignored targets, and logits far apart (the group's max matters).
TEST_CASE("a vocabulary-parallel head on T threads equals the unsplit head: loss and every gradient") {
  const int64_t batch = 3, seq = 4, dim = 6, vocab = 8;
  Backend& be = backend_for(Device::cpu());
  const Tensor h = random_tensor({batch, seq, dim}, DType::kF64, 12, -3.0, 3.0);
  Tensor targets = gpipe::testing::random_labels(batch * seq, static_cast<int>(vocab), 13).reshape({batch, seq});
  targets.data<int32_t>()[2] = -100;  // ignored
  targets.data<int32_t>()[7] = -100;
  auto head = [&](TensorShard shard) {
    LinearOptions o(dim, vocab);
    o.leading = {seq};
    o.bias = false;
    o.dtype = DType::kF64;
    o.seed = 71;
    o.split = shard.as(TensorSplitKind::kColumn);
    return Linear(o);
  };
  Linear whole = head({});
  SoftmaxCrossEntropy xent(Shape{seq, vocab}, DType::kF64);
  const double scale = 1.0 / static_cast<double>(xent.counted_targets(targets));
  Context c1, c2;
  const Tensor logits = whole.forward(be, h, &c1);
  const double loss = to_doubles(xent.forward(be, logits, targets, scale, &c2))[0];
  const Tensor dh = whole.backward(be, xent.backward(be, c2), c1);
  for (int T : {1, 2, 4}) {
    CAPTURE(T);
    struct Member {
      double loss = 0;
      int64_t counted = 0;
      std::vector<double> dh, dw;
    };
    std::vector<Member> got(static_cast<size_t>(T));
    const std::vector<std::string> errors = run_members(T, [&](int r, TensorCollectives& group) {
      Member& m = got[static_cast<size_t>(r)];
      Linear mine = head({r, T});
      mine.set_collectives(&group);
      VocabParallelCrossEntropy loss_r(Shape{seq, vocab / T}, vocab, {r, T}, DType::kF64);
      loss_r.set_collectives(&group);
      Context k1, k2;
      const Tensor part = mine.forward(be, h, &k1);
      m.loss = to_doubles(loss_r.forward(be, part, targets, scale, &k2))[0];
      m.counted = loss_r.counted_targets(targets);
      m.dh = to_doubles(mine.backward(be, loss_r.backward(be, k2), k1));
      m.dw = to_doubles(mine.weight().grad);
    });
    for (int r = 0; r < T; ++r) {
      CAPTURE(r);
      const Member& m = got[static_cast<size_t>(r)];
      REQUIRE_MESSAGE(errors[static_cast<size_t>(r)].empty(), errors[static_cast<size_t>(r)]);
      CHECK(m.counted == 10);
      CHECK(m.loss == doctest::Approx(loss).epsilon(1e-12));
      check_close(m.dh, to_doubles(dh), "the hidden state's gradient");
      check_close(m.dw, block_of(whole.weight().grad, 0, r, T), "the projection's block of the gradient");
    }
  }
  // A label outside the vocabulary is refused by every member, whether or not its column is theirs.
  Tensor bad = Tensor::empty(targets.shape(), DType::kI32, Device::cpu());
  copy_tensor(targets, bad);
  bad.data<int32_t>()[5] = static_cast<int32_t>(vocab);
  const std::vector<std::string> errors = run_members(2, [&](int r, TensorCollectives& group) {
    VocabParallelCrossEntropy loss_r(Shape{seq, vocab / 2}, vocab, {r, 2}, DType::kF64);
    loss_r.set_collectives(&group);
    const Tensor part = random_tensor({batch, seq, vocab / 2}, DType::kF64, 14);
    loss_r.forward(be, part, bad, 1.0, nullptr);
  });
  for (const std::string& e : errors) CHECK(e.find("label 8 in row 5 is outside [0, 8)") != std::string::npos);
}

// Evaluation's accuracy under a vocabulary-parallel head: the group's argmax, the first
// column on ties as the unsplit argmax takes it, whichever member holds it.
TEST_CASE("a vocabulary-parallel loss counts correct rows as the unsplit loss does, ties across members included") {
  const int64_t rows = 6, vocab = 8;
  Backend& be = backend_for(Device::cpu());
  // Rows 0-2 random; row 3 ties columns 1 and 6 (members 0 and 1 of 2; 1 and 3 of 4), row 4
  // ties 5 and 7, row 5 is ignored.
  Tensor logits = random_tensor({rows, vocab}, DType::kF64, 20);
  double* p = logits.data<double>();
  p[3 * vocab + 1] = p[3 * vocab + 6] = 5.0;
  p[4 * vocab + 5] = p[4 * vocab + 7] = 7.0;
  for (const std::vector<int32_t>& labels : {std::vector<int32_t>{0, 1, 2, 1, 5, -100},
                                              std::vector<int32_t>{3, 4, 5, 6, 7, 2}}) {
    Tensor targets = Tensor::from_vector<int32_t>(labels, {rows});
    const bool first_set = labels[0] == 0;
    for (int r = 0; first_set && r < 3; ++r) {  // the first set: rows 0-2 labelled with their own argmax
      int best = 0;
      for (int j = 1; j < vocab; ++j) best = p[r * vocab + j] > p[r * vocab + best] ? j : best;
      targets.data<int32_t>()[r] = best;
    }
    SoftmaxCrossEntropy whole(Shape{vocab}, DType::kF64);
    const int64_t want = whole.correct(be, logits, targets);
    for (int T : {1, 2, 4}) {
      CAPTURE(T);
      std::vector<int64_t> got(static_cast<size_t>(T));
      const std::vector<std::string> errors = run_members(T, [&](int r, TensorCollectives& group) {
        VocabParallelCrossEntropy mine(Shape{vocab / T}, vocab, {r, T}, DType::kF64);
        mine.set_collectives(&group);
        Tensor part = Tensor::empty({rows, vocab / T}, DType::kF64, Device::cpu());
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t j = 0; j < vocab / T; ++j) part.data<double>()[i * (vocab / T) + j] = p[i * vocab + r * (vocab / T) + j];
        }
        got[static_cast<size_t>(r)] = mine.correct(be, part, targets);
      });
      for (int r = 0; r < T; ++r) {
        REQUIRE_MESSAGE(errors[static_cast<size_t>(r)].empty(), errors[static_cast<size_t>(r)]);
        CHECK(got[static_cast<size_t>(r)] == want);
      }
    }
    CHECK(want == (first_set ? 5 : 0));  // the first set: rows 0-2 and the first column of each tie
  }
}
