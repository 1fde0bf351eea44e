#include "examples/cpp_model/tiny_gpt.h"

#include "layers/embedding.h"
#include "layers/layernorm.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/registry.h"
#include "layers/transformer.h"
#include "runtime/random.h"

namespace example {

using namespace gpipe::layers;
using gpipe::DType;
using gpipe::Shape;
using gpipe::mix_seed;

std::unique_ptr<Sequential> make_tiny_gpt(const TinyGptOptions& o) {
  const int64_t T = o.seq_len, C = o.dim;
  auto model = std::make_unique<Sequential>(Shape{T}, DType::kF32, /*input_dtype=*/DType::kI32);
  uint64_t layer = 0;
  EmbeddingOptions emb(o.vocab, C, T);  // (T) ids -> (T, C)
  emb.seed = mix_seed(o.seed, layer++);
  // Named as GPT-2's modules are, so that a checkpoint's tensors are "wte.token",
  // "h.0.attn.qkv.weight", ..., "ln_f.weight" in any partition.
  auto& embedding = static_cast<Embedding&>(model->add(std::make_unique<Embedding>(emb), "wte"));
  for (int64_t b = 0; b < o.blocks; ++b) {
    TransformerBlockOptions block(C, o.heads, T);  // (T, C) -> (T, C)
    block.dropout = o.dropout;
    block.seed = mix_seed(o.seed, layer++);
    model->add(std::make_unique<TransformerBlock>(block), "h." + std::to_string(b));
  }
  model->add(std::make_unique<LayerNorm>(LayerNormOptions({T, C})), "ln_f");
  ++layer;
  LinearOptions head(C, o.vocab);  // (T, C) -> (T, vocab) logits
  head.leading = {T};
  head.bias = false;
  head.seed = mix_seed(o.seed, layer++);
  auto& out = static_cast<Linear&>(model->add(std::make_unique<Linear>(head), "lm_head"));
  // The head's weight is the token table (GPT-2): each stage keeps a copy and both get
  // the sum of the two gradients before every step.
  model->tie(/*owner_layer=*/0, embedding.token(), /*copy_layer=*/model->size() - 1, out.weight());
  model->set_loss(std::make_unique<SoftmaxCrossEntropy>(Shape{T, o.vocab}));
  return model;
}

void register_tiny_gpt() {
  register_model("tiny_gpt", [](LayerArgs& a) {
    TinyGptOptions o;
    o.seq_len = a.get_int("seq_len", o.seq_len);
    o.dim = a.get_int("dim", o.dim);
    o.heads = a.get_int("heads", o.heads);
    o.blocks = a.get_int("blocks", o.blocks);
    o.dropout = a.get_double("dropout", o.dropout);
    o.seed = static_cast<uint64_t>(a.get_int("seed", 0));
    return make_tiny_gpt(o);
  });
}

}  // namespace example
