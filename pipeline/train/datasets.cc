#include "pipeline/train/datasets.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "pipeline/train/data.h"
#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace pipeline {

namespace {

// The whole of data.path. A directory, a missing file and one this process may not
// read are the user's to fix, so each is a UserError that says which (std::ifstream
// opens a directory and only fails when read, with an error of its own).
std::vector<uint8_t> read_file(const std::string& path, const char* what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    const std::string dir = path.back() == '/' ? path : path + "/";
    throw UserError("data.path '" + path + "' is a directory, not a file; set data.path to the " + what +
                    " file itself, e.g. --set data.path=" + dir + "FILE");
  }
  const std::string fix = "; check data.path (it can be set with --set data.path=FILE)";
  errno = 0;
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    const std::string why = errno != 0 ? std::strerror(errno) : "it cannot be opened";
    throw UserError(std::string(what) + " file '" + path + "' cannot be read (" + why + ")" + fix);
  }
  try {
    return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure&) {  // a read error after the open (a failing disk, a device)
    const std::string why = errno != 0 ? std::strerror(errno) : "a read error";
    throw UserError(std::string(what) + " file '" + path + "' could not be read to the end (" + why + ")" + fix);
  }
}

class TeacherDataset : public Dataset {
 public:
  TeacherDataset(int64_t input_dim, int64_t classes, int64_t hidden, double scale, uint64_t seed, DType dtype,
                 int64_t validation_samples)
      : teacher_(input_dim, classes, hidden, scale, seed, dtype), input_dim_(input_dim), dtype_(dtype),
        validation_(validation_samples) {
    if (validation_samples > 0) held_out_ = teacher_.eval_set(validation_samples);
  }
  std::pair<Tensor, Tensor> batch(uint64_t step, int64_t n) const override { return teacher_.batch(step, n); }
  std::pair<Tensor, Tensor> validation(int64_t first, int64_t n) const override {
    return {held_out_.first.narrow_rows(first, n), held_out_.second.narrow_rows(first, n)};
  }
  int64_t validation_size() const override { return validation_; }
  Shape input_shape() const override { return {input_dim_}; }
  DType input_dtype() const override { return dtype_; }
  Shape target_shape() const override { return {}; }
  int64_t classes() const override { return teacher_.classes(); }
  std::string describe() const override {
    return "teacher task: " + std::to_string(input_dim_) + " inputs, " + std::to_string(teacher_.classes()) +
           " classes";
  }

 private:
  TeacherData teacher_;
  int64_t input_dim_;
  DType dtype_;
  int64_t validation_;
  std::pair<Tensor, Tensor> held_out_;
};

class TokenDataset : public Dataset {
 public:
  TokenDataset(std::vector<int32_t> tokens, int64_t vocab, int64_t seq_len, double validation_fraction,
               uint64_t seed, std::string name)
      : tokens_(std::move(tokens)), vocab_(vocab), seq_len_(seq_len), seed_(seed), name_(std::move(name)) {
    if (seq_len < 1) throw UserError("data.seq_len must be at least 1, got " + std::to_string(seq_len));
    if (!(validation_fraction >= 0 && validation_fraction < 1)) {
      throw UserError("data.validation_fraction must be in [0, 1), got " + std::to_string(validation_fraction));
    }
    const int64_t n = static_cast<int64_t>(tokens_.size());
    split_ = n - static_cast<int64_t>(validation_fraction * n);
    if (split_ < seq_len + 1) {
      throw UserError(name_ + " has " + std::to_string(n) + " tokens: too few for training windows of " +
                      std::to_string(seq_len + 1) + " after holding out the validation part; use a larger file " +
                      "or lower data.seq_len");
    }
    const int64_t held = n - split_;
    validation_windows_ = held >= seq_len + 1 ? (held - 1) / seq_len : 0;
  }

  std::pair<Tensor, Tensor> batch(uint64_t step, int64_t n) const override {
    Tensor x = Tensor::empty({n, seq_len_}, DType::kI32, Device::cpu());
    Tensor y = Tensor::empty({n, seq_len_}, DType::kI32, Device::cpu());
    const uint64_t span = static_cast<uint64_t>(split_ - seq_len_);  // window starts in [0, span)
    for (int64_t i = 0; i < n; ++i) {
      Rng rng(mix_seed(seed_, step, static_cast<uint64_t>(i)));
      fill_window(static_cast<int64_t>(rng.next() % span), x, y, i);
    }
    return {x, y};
  }

  std::pair<Tensor, Tensor> validation(int64_t first, int64_t n) const override {
    GPIPE_CHECK(first >= 0 && first + n <= validation_windows_, "validation windows out of range");
    Tensor x = Tensor::empty({n, seq_len_}, DType::kI32, Device::cpu());
    Tensor y = Tensor::empty({n, seq_len_}, DType::kI32, Device::cpu());
    for (int64_t i = 0; i < n; ++i) fill_window(split_ + (first + i) * seq_len_, x, y, i);
    return {x, y};
  }

  int64_t validation_size() const override { return validation_windows_; }
  Shape input_shape() const override { return {seq_len_}; }
  DType input_dtype() const override { return DType::kI32; }
  Shape target_shape() const override { return {seq_len_}; }
  int64_t classes() const override { return vocab_; }
  std::string describe() const override {
    return name_ + ": " + std::to_string(split_) + " training and " + std::to_string(tokens_.size() - split_) +
           " validation tokens, vocabulary " + std::to_string(vocab_) + ", windows of " + std::to_string(seq_len_);
  }

 private:
  void fill_window(int64_t start, Tensor& x, Tensor& y, int64_t row) const {
    std::memcpy(x.data<int32_t>() + row * seq_len_, tokens_.data() + start, seq_len_ * sizeof(int32_t));
    std::memcpy(y.data<int32_t>() + row * seq_len_, tokens_.data() + start + 1, seq_len_ * sizeof(int32_t));
  }
  std::vector<int32_t> tokens_;
  int64_t vocab_, seq_len_;
  uint64_t seed_;
  std::string name_;
  int64_t split_ = 0, validation_windows_ = 0;
};

constexpr int64_t kCifarPixels = 3 * 32 * 32;
constexpr int64_t kCifarRecord = 1 + kCifarPixels;

class CifarDataset : public Dataset {
 public:
  CifarDataset(const std::string& path, double validation_fraction, uint64_t seed) : path_(path), seed_(seed) {
    const std::vector<uint8_t> bytes = read_file(path, "CIFAR-10");
    if (bytes.empty() || bytes.size() % kCifarRecord != 0) {
      throw UserError("CIFAR-10 file '" + path + "' has " + std::to_string(bytes.size()) +
                      " bytes, not a whole number of 3073-byte records (1 label byte + 3072 pixel bytes); is it a "
                      "CIFAR-10 binary batch (data_batch_N.bin)?");
    }
    const int64_t n = static_cast<int64_t>(bytes.size()) / kCifarRecord;
    images_.resize(n * kCifarPixels);
    labels_.resize(n);
    // Per-channel mean and standard deviation of CIFAR-10's training set.
    const float mean[3] = {0.4914f, 0.4822f, 0.4465f}, stdev[3] = {0.2470f, 0.2435f, 0.2616f};
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* rec = bytes.data() + r * kCifarRecord;
      if (rec[0] > 9) {
        throw UserError("CIFAR-10 file '" + path + "': record " + std::to_string(r) + " (byte offset " +
                        std::to_string(r * kCifarRecord) + ") has label " + std::to_string(rec[0]) +
                        "; labels are 0-9. Is it a CIFAR-10 (not CIFAR-100) binary batch?");
      }
      labels_[r] = rec[0];
      for (int64_t p = 0; p < kCifarPixels; ++p) {
        const int c = static_cast<int>(p / 1024);
        images_[r * kCifarPixels + p] = (rec[1 + p] / 255.0f - mean[c]) / stdev[c];
      }
    }
    if (!(validation_fraction >= 0 && validation_fraction < 1)) {
      throw UserError("data.validation_fraction must be in [0, 1), got " + std::to_string(validation_fraction));
    }
    split_ = n - static_cast<int64_t>(validation_fraction * n);
    if (split_ < 1) throw UserError("CIFAR-10 file '" + path + "' leaves no training records; lower data.validation_fraction");
  }

  std::pair<Tensor, Tensor> batch(uint64_t step, int64_t n) const override {
    std::vector<int64_t> rows(n);
    for (int64_t i = 0; i < n; ++i) {
      Rng rng(mix_seed(seed_, step, static_cast<uint64_t>(i)));
      rows[i] = static_cast<int64_t>(rng.next() % static_cast<uint64_t>(split_));
    }
    return gather(rows);
  }

  std::pair<Tensor, Tensor> validation(int64_t first, int64_t n) const override {
    std::vector<int64_t> rows(n);
    for (int64_t i = 0; i < n; ++i) rows[i] = split_ + first + i;
    return gather(rows);
  }

  int64_t validation_size() const override { return static_cast<int64_t>(labels_.size()) - split_; }
  Shape input_shape() const override { return {3, 32, 32}; }
  DType input_dtype() const override { return DType::kF32; }
  Shape target_shape() const override { return {}; }
  int64_t classes() const override { return 10; }
  std::string describe() const override {
    return "CIFAR-10 " + path_ + ": " + std::to_string(split_) + " training and " +
           std::to_string(validation_size()) + " validation images";
  }

 private:
  std::pair<Tensor, Tensor> gather(const std::vector<int64_t>& rows) const {
    const int64_t n = static_cast<int64_t>(rows.size());
    Tensor x = Tensor::empty({n, 3, 32, 32}, DType::kF32, Device::cpu());
    Tensor y = Tensor::empty({n}, DType::kI32, Device::cpu());
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(x.data<float>() + i * kCifarPixels, images_.data() + rows[i] * kCifarPixels,
                  kCifarPixels * sizeof(float));
      y.data<int32_t>()[i] = labels_[rows[i]];
    }
    return {x, y};
  }
  std::string path_;
  uint64_t seed_;
  std::vector<float> images_;
  std::vector<int32_t> labels_;
  int64_t split_ = 0;
};

}  // namespace

std::unique_ptr<Dataset> make_teacher_data(int64_t input_dim, int64_t classes, int64_t hidden, double scale,
                                           uint64_t seed, DType dtype, int64_t validation_samples) {
  return std::make_unique<TeacherDataset>(input_dim, classes, hidden, scale, seed, dtype, validation_samples);
}

std::unique_ptr<Dataset> make_token_data(std::vector<int32_t> tokens, int64_t vocab, int64_t seq_len,
                                         double validation_fraction, uint64_t seed, std::string name) {
  return std::make_unique<TokenDataset>(std::move(tokens), vocab, seq_len, validation_fraction, seed,
                                        std::move(name));
}

std::vector<int32_t> read_byte_tokens(const std::string& path) {
  const std::vector<uint8_t> bytes = read_file(path, "text");
  if (bytes.empty()) throw UserError("text file '" + path + "' is empty; language modelling needs text to learn");
  return std::vector<int32_t>(bytes.begin(), bytes.end());
}

std::vector<int32_t> read_uint16_tokens(const std::string& path, int64_t vocab) {
  const std::vector<uint8_t> bytes = read_file(path, "token");
  if (bytes.empty() || bytes.size() % 2 != 0) {
    throw UserError("token file '" + path + "' has " + std::to_string(bytes.size()) +
                    " bytes; it must hold little-endian uint16 ids, an even and non-zero number of bytes");
  }
  std::vector<int32_t> out(bytes.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = bytes[2 * i] | (bytes[2 * i + 1] << 8);
    if (out[i] >= vocab) {
      throw UserError("token file '" + path + "': token " + std::to_string(i) + " (byte offset " +
                      std::to_string(2 * i) + ") is " + std::to_string(out[i]) + ", not below data.vocab = " +
                      std::to_string(vocab) + "; raise data.vocab or check the file");
    }
  }
  return out;
}

std::unique_ptr<Dataset> make_cifar_data(const std::string& path, double validation_fraction, uint64_t seed) {
  return std::make_unique<CifarDataset>(path, validation_fraction, seed);
}

std::unique_ptr<Dataset> make_dataset(const Config& c) {
  const DataConfig& d = c.data;
  if (d.type == "teacher") {
    if (c.model.input.size() != 1) {
      throw UserError("data.type teacher makes flat inputs: model.input must have one dimension, got " +
                      shape_str(c.model.input));
    }
    return make_teacher_data(c.model.input[0], d.classes, d.teacher_hidden, d.teacher_scale, d.seed, master_dtype(c.model.dtype),
                             d.eval_samples);
  }
  if (d.type == "text") {
    return make_token_data(read_byte_tokens(d.path), 256, d.seq_len, d.validation_fraction, d.seed, d.path);
  }
  if (d.type == "tokens") {
    return make_token_data(read_uint16_tokens(d.path, d.vocab), d.vocab, d.seq_len, d.validation_fraction, d.seed,
                           d.path);
  }
  if (d.type == "cifar10") return make_cifar_data(d.path, d.validation_fraction, d.seed);
  throw UserError("data.type: unknown data type '" + d.type + "'; valid: teacher, text, tokens, cifar10");
}

}  // namespace pipeline
}  // namespace gpipe
