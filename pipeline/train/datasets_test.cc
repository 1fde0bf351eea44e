// Datasets read files the tests write themselves; malformed files are errors that
// name the file and what is wrong.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "pipeline/train/datasets.h"
#include "runtime/error.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {
std::string temp_path(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp ? tmp : "/tmp") + "/" + name;
}
std::string write_file(const std::string& name, const std::string& bytes) {
  const std::string path = temp_path(name);
  std::ofstream f(path, std::ios::binary);
  f << bytes;
  return path;
}
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}
}  // namespace

TEST_CASE("byte-level text: inputs are windows, targets the next bytes") {
  std::string text;
  for (int i = 0; i < 50; ++i) text += "hello world. ";
  const std::string path = write_file("text.txt", text);
  auto data = make_token_data(read_byte_tokens(path), 256, 8, 0.2, 3, path);
  CHECK(data->input_shape() == Shape{8});
  CHECK(data->input_dtype() == DType::kI32);
  CHECK(data->target_shape() == Shape{8});
  CHECK(data->classes() == 256);
  auto [x, y] = data->batch(0, 4);
  REQUIRE(x.shape() == Shape{4, 8});
  for (int r = 0; r < 4; ++r) {
    for (int t = 0; t + 1 < 8; ++t) CHECK(y.data<int32_t>()[r * 8 + t] == x.data<int32_t>()[r * 8 + t + 1]);
  }
  // Same step, same batch; another step, another batch.
  auto [x2, y2] = data->batch(0, 4);
  CHECK(x2.to_vector<int32_t>() == x.to_vector<int32_t>());
  CHECK(y2.to_vector<int32_t>() == y.to_vector<int32_t>());
  // The text repeats every 13 bytes, so compare where each window starts in the period.
  auto phases = [&](const Tensor& t) {
    std::vector<std::string> out;
    for (int r = 0; r < 4; ++r) out.push_back(std::string(t.data<int32_t>() + r * 8, t.data<int32_t>() + r * 8 + 8));
    return out;
  };
  CHECK(phases(data->batch(1, 4).first) != phases(x));
  CHECK(data->validation_size() == (static_cast<int64_t>(text.size() * 0.2 + 0.5) - 1) / 8);
  auto [vx, vy] = data->validation(0, 1);
  const int64_t split = static_cast<int64_t>(text.size()) - static_cast<int64_t>(0.2 * text.size());
  CHECK(vx.data<int32_t>()[0] == static_cast<unsigned char>(text[split]));
}

TEST_CASE("token files: uint16 little-endian ids below the vocabulary") {
  std::string bytes;
  for (int i = 0; i < 100; ++i) {
    bytes.push_back(static_cast<char>(i % 7));
    bytes.push_back(static_cast<char>(i % 2));  // ids i%7 + 256 * (i%2)
  }
  const std::string path = write_file("tokens.bin", bytes);
  const auto ids = read_uint16_tokens(path, 300);
  REQUIRE(ids.size() == 100);
  CHECK(ids[1] == 1 + 256);
  CHECK(error_of([&] { read_uint16_tokens(path, 200); }).find("token 1 (byte offset 2) is 257, not below data.vocab = 200") !=
        std::string::npos);
  const std::string odd = write_file("odd.bin", "abc");
  CHECK(error_of([&] { read_uint16_tokens(odd, 300); }).find("3 bytes") != std::string::npos);
}

TEST_CASE("CIFAR-10 binary records") {
  std::string bytes;
  for (int r = 0; r < 10; ++r) {
    bytes.push_back(static_cast<char>(r % 10));
    for (int p = 0; p < 3072; ++p) bytes.push_back(static_cast<char>((p + r) % 256));
  }
  const std::string path = write_file("cifar.bin", bytes);
  auto data = make_cifar_data(path, 0.2, 1);
  CHECK(data->input_shape() == Shape{3, 32, 32});
  CHECK(data->validation_size() == 2);
  auto [x, y] = data->validation(0, 2);
  CHECK(y.to_vector<int32_t>() == std::vector<int32_t>{8, 9});
  // Pixel 0 of record 8 is 8/255, normalised with the red channel's statistics.
  CHECK(x.data<float>()[0] == doctest::Approx((8 / 255.0 - 0.4914) / 0.2470).epsilon(1e-5));
  auto [bx, by] = data->batch(3, 5);
  for (int32_t label : by.to_vector<int32_t>()) CHECK(label < 8);  // training records only

  const std::string truncated = write_file("short.bin", bytes.substr(0, 3073 * 2 + 100));
  CHECK(error_of([&] { make_cifar_data(truncated, 0.1, 1); }).find("not a whole number of 3073-byte records") !=
        std::string::npos);
  std::string bad = bytes;
  bad[3073 * 4] = 12;
  const std::string badpath = write_file("badlabel.bin", bad);
  CHECK(error_of([&] { make_cifar_data(badpath, 0.1, 1); }).find("record 4 (byte offset 12292) has label 12") !=
        std::string::npos);
}

TEST_CASE("missing and empty files name themselves") {
  CHECK(error_of([] { read_byte_tokens("/no/such/file.txt"); }).find("'/no/such/file.txt' cannot be read") !=
        std::string::npos);
  const std::string empty = write_file("empty.txt", "");
  CHECK(error_of([&] { read_byte_tokens(empty); }).find("is empty") != std::string::npos);
  const std::string tiny = write_file("tiny.txt", "abc");
  CHECK(error_of([&] { make_token_data(read_byte_tokens(tiny), 256, 8, 0.1, 1, tiny); }).find("too few") !=
        std::string::npos);
}

TEST_CASE("data.path that is a directory, or a file that cannot be opened, is the user's to fix") {
  const std::string dir = temp_path("a_directory");
  std::filesystem::create_directories(dir);
  for (const auto& read : std::vector<std::function<void()>>{
           [&] { read_byte_tokens(dir); }, [&] { read_uint16_tokens(dir, 256); }, [&] { make_cifar_data(dir, 0.1, 1); }}) {
    const std::string e = error_of(read);
    CAPTURE(e);
    CHECK(e.find("data.path '" + dir + "' is a directory, not a file; set data.path to the ") == 0);
    CHECK(e.find(" file itself, e.g. --set data.path=" + dir + "/FILE") != std::string::npos);
  }
  CHECK(error_of([] { read_byte_tokens("/no/such/file.txt"); })
            .find("text file '/no/such/file.txt' cannot be read (No such file or directory); check data.path") == 0);
  const std::string locked = write_file("locked.txt", "some text");
  std::filesystem::permissions(locked, std::filesystem::perms::none);
  if (std::ifstream(locked)) {
    MESSAGE("skipped the unreadable file: this user (root) reads it anyway");
  } else {
    CHECK(error_of([&] { read_byte_tokens(locked); })
              .find("text file '" + locked + "' cannot be read (Permission denied); check data.path") == 0);
  }
}

TEST_CASE("every dataset: the same step gives the same batch, another step another batch") {
  // Each kind of data, through its public batch(step, n): a dataset that ignored `step`
  // would train on one batch forever; one that was not a function of it would not be
  // reproducible (nor the same on every rank).
  std::string text;
  for (int i = 0; i < 400; ++i) text += "line " + std::to_string(i * 7919 % 1009) + "; ";
  const std::string text_path = write_file("varied.txt", text);
  std::string records;
  for (int r = 0; r < 40; ++r) {
    records.push_back(static_cast<char>(r % 10));
    for (int p = 0; p < 3072; ++p) records.push_back(static_cast<char>((p * (r + 3)) % 251));
  }
  const std::string cifar_path = write_file("cifar_steps.bin", records);
  std::vector<std::pair<std::string, std::unique_ptr<Dataset>>> all;
  all.emplace_back("teacher", make_teacher_data(6, 3, 8, 1.0, 5, DType::kF32, 16));
  all.emplace_back("text", make_token_data(read_byte_tokens(text_path), 256, 8, 0.1, 5, text_path));
  all.emplace_back("cifar10", make_cifar_data(cifar_path, 0.1, 5));
  auto bytes = [](const Tensor& t) {
    const auto* p = static_cast<const unsigned char*>(t.raw_data());
    return std::vector<unsigned char>(p, p + t.nbytes());
  };
  for (auto& [name, data] : all) {
    CAPTURE(name);
    const auto [x0, y0] = data->batch(0, 6);
    const auto [x0b, y0b] = data->batch(0, 6);
    CHECK(bytes(x0) == bytes(x0b));
    CHECK(bytes(y0) == bytes(y0b));
    for (uint64_t step : {1, 2, 1000003}) {
      CAPTURE(step);
      const auto [xs, ys] = data->batch(step, 6);
      CHECK(xs.shape() == x0.shape());
      CHECK(bytes(xs) != bytes(x0));
    }
  }
}
