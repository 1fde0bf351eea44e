// A training run without YAML: the config filled in C++, the model from a factory. The
// same trainer as `gpipe train` (data, validation, report, mpirun), through
// gpipe::cli::train, so that `mpirun -np 2 train_in_cpp TEXT OUT_DIR` runs one stage per
// process. It is the run tiny_gpt.yaml describes.
//
//   train_in_cpp TEXT_FILE OUTPUT_DIR [STEPS]
#include <cstdio>
#include <cstdlib>

#include "examples/cpp_model/tiny_gpt.h"
#include "pipeline/cli.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s TEXT_FILE OUTPUT_DIR [STEPS]\n", argv[0]);
    return 2;
  }
  example::TinyGptOptions model;  // dim 32, 2 heads, 2 blocks, sequences of 32 bytes

  gpipe::pipeline::Config c;
  c.name = "train_in_cpp";
  c.data.type = "text";  // byte-level: vocabulary 256
  c.data.path = argv[1];
  c.data.seq_len = model.seq_len;
  c.pipeline.partitions = 2;  // K: two stages (threads, or processes under mpirun -np 2)
  c.pipeline.micro_batches = 4;
  c.optimizer.optimizer.type = "adamw";
  c.optimizer.optimizer.lr = 0.003;
  c.optimizer.schedule = "cosine";
  c.optimizer.warmup_steps = 10;
  c.optimizer.clip_grad_norm = 1.0;
  c.train.steps = argc > 3 ? std::atoi(argv[3]) : 100;
  c.train.batch_size = 16;
  c.train.log_interval = 10;
  c.train.eval_interval = 50;
  c.train.eval_samples = 256;
  c.output.dir = argv[2];
  c.checkpoint.every = 10;  // saves under OUTPUT_DIR/checkpoints; `--resume` goes on from the newest
  c.checkpoint.keep = 2;

  return gpipe::cli::train(argc, argv, c, [&] { return example::make_tiny_gpt(model); });
}
