// The safetensors reader and writer: round trips, a file written byte by byte from the
// format's description (so we are not only compatible with ourselves), and every rule
// of the reader broken once, each refused with a message naming the file and the fault.
#include "runtime/safetensors.h"

#include <doctest/doctest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/bf16.h"
#include "runtime/fp16.h"
#include "runtime/error.h"
#include "tests/temp_dir.h"

using namespace gpipe;
using gpipe::testing::TempDir;

namespace {

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i, n >>= 8) s[i] = static_cast<char>(n & 0xff);
  return s;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file with `header` (padded with spaces to 8 bytes) and `buffer` bytes after it.
std::string handmade(const std::string& header, const std::string& buffer) {
  std::string h = header;
  h.append((8 - h.size() % 8) % 8, ' ');
  return le64(h.size()) + h + buffer;
}

// Loads `bytes` as a file and returns the error message (empty when it loaded).
std::string load_error(const TempDir& dir, const std::string& bytes) {
  const std::string path = dir / "bad.safetensors";
  write_bytes(path, bytes);
  try {
    load_safetensors(path);
  } catch (const UserError& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.find(path) != std::string::npos, "the message names the file: " << msg);
    return msg;
  }
  return "";
}

#define CHECK_REFUSED(bytes, fragment)                                    \
  do {                                                                    \
    const std::string gpipe_msg_ = load_error(dir, (bytes));              \
    INFO("message: " << gpipe_msg_);                                      \
    CHECK(gpipe_msg_.find(fragment) != std::string::npos);                \
  } while (0)

std::string bytes_of(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

}  // namespace

TEST_CASE("safetensors: round trip of every supported dtype, a scalar, an empty tensor and metadata") {
  TempDir dir;
  TensorMap in;
  in["layers.0.weight"] = Tensor::from_vector<float>({1.5f, -2.f, 3.25f, 0.f, 1e-30f, -7.f}, {2, 3});
  in["layers.0.bias"] = Tensor::from_vector<double>({0.1, -0.2, 1e300, 4}, {4});
  in["ids"] = Tensor::from_vector<int32_t>({7, -8, 9, 2147483647}, {1, 2, 2});
  in["step"] = Tensor::from_vector<double>({12345}, {});
  in["empty"] = Tensor::zeros_cpu({0, 3}, DType::kF32);
  Tensor half = Tensor::empty({3}, DType::kBF16, Device::cpu());  // 1.0, -2.5, NaN
  half.data<BFloat16>()[0] = float_to_bf16(1.0f);
  half.data<BFloat16>()[1] = float_to_bf16(-2.5f);
  half.data<BFloat16>()[2] = {0x7fc1};
  in["half"] = half;
  const std::string path = dir / "m.safetensors";
  save_safetensors(path, in, {{"format", "pt"}, {"note", "héllo"}});

  const SafetensorsFile out = load_safetensors(path);
  CHECK(out.metadata == StringMap{{"format", "pt"}, {"note", "héllo"}});
  REQUIRE(out.tensors.size() == in.size());
  for (const auto& [name, t] : in) {
    const Tensor& u = out.tensors.at(name);
    CHECK_MESSAGE(u.dtype() == t.dtype(), name);
    CHECK_MESSAGE(u.shape() == t.shape(), name);
    CHECK_MESSAGE(std::memcmp(u.raw_data(), t.raw_data(), t.nbytes()) == 0, name);
  }
  // Every tensor's data is aligned to its element size within the file.
  const SafetensorsHeader h = read_safetensors_header(path);
  CHECK(h.buffer_start % 8 == 0);
  for (const auto& e : h.entries) CHECK_MESSAGE((h.buffer_start + e.begin) % dtype_size(e.dtype) == 0, e.name);
  CHECK(h.find("step")->shape.empty());

  // Only the wanted tensors are read.
  const SafetensorsFile part = load_safetensors(path, [](const std::string& n) { return n == "ids"; });
  CHECK(part.tensors.size() == 1);
  CHECK(part.tensors.at("ids").to_vector<int32_t>()[3] == 2147483647);
}

TEST_CASE("safetensors: an F64 tensor after an odd number of F32 elements is still 8-byte aligned") {
  // Name order alone would put "a" (F32[3], 12 bytes) first and "b" (F64[2]) at buffer
  // offset 12, misaligned. Read back from the file's own bytes: the header length N,
  // the JSON, and each tensor's place, 8 + N + begin.
  TempDir dir;
  TensorMap in;
  in["a"] = Tensor::from_vector<float>({1.f, 2.f, 3.f}, {3});
  in["b"] = Tensor::from_vector<double>({0.25, -1e300}, {2});
  in["c"] = Tensor::from_vector<int32_t>({-5}, {1});
  const std::string path = dir / "odd.safetensors";
  save_safetensors(path, in);

  std::ifstream f(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  REQUIRE(bytes.size() >= 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  CHECK(n % 8 == 0);
  REQUIRE(8 + n <= bytes.size());
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  const std::map<std::string, uint64_t> element_size = {{"a", 4}, {"b", 8}, {"c", 4}};
  uint64_t total = 0;
  for (const auto& [name, size] : element_size) {
    CAPTURE(name);
    REQUIRE(header.contains(name));
    const uint64_t begin = header[name]["data_offsets"][0].get<uint64_t>();
    const uint64_t end = header[name]["data_offsets"][1].get<uint64_t>();
    CHECK((8 + n + begin) % size == 0);
    REQUIRE(end - begin == in.at(name).nbytes());
    REQUIRE(8 + n + end <= bytes.size());
    // The bytes at that place are the tensor's.
    CHECK(std::memcmp(bytes.data() + 8 + n + begin, in.at(name).raw_data(), end - begin) == 0);
    total += end - begin;
  }
  CHECK(bytes.size() == 8 + n + total);
}

TEST_CASE("safetensors: a file written byte by byte from the format description") {
  TempDir dir;
  // One F32 tensor "attn.0" of shape [1, 2, 3] holding 0..5: a 64-byte header (no
  // padding needed), then 24 little-endian float bytes.
  const std::string header = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  REQUIRE(header.size() == 64);
  const unsigned char data[24] = {0, 0, 0, 0, 0, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64, 0, 0, 128, 64, 0, 0, 160, 64};
  const std::string file = std::string("\x40\0\0\0\0\0\0\0", 8) + header + std::string(reinterpret_cast<const char*>(data), 24);
  write_bytes(dir / "hand.safetensors", file);
  const SafetensorsFile f = load_safetensors(dir / "hand.safetensors");
  REQUIRE(f.tensors.count("attn.0") == 1);
  CHECK(f.tensors.at("attn.0").shape() == Shape{1, 2, 3});
  CHECK(f.tensors.at("attn.0").to_vector<float>() == std::vector<float>{0, 1, 2, 3, 4, 5});

  // Our writer produces exactly these bytes for the same tensor.
  save_safetensors(dir / "ours.safetensors", {{"attn.0", Tensor::from_vector<float>({0, 1, 2, 3, 4, 5}, {1, 2, 3})}});
  CHECK(read_file(dir / "ours.safetensors") == file);

  // Header order need not be buffer order; metadata and padding are allowed; I32 and F64.
  const std::string h2 =
      R"({"b":{"dtype":"I32","shape":[2],"data_offsets":[8,16]},"__metadata__":{"format":"np"},)"
      R"("a":{"shape":[],"data_offsets":[0,8],"dtype":"F64"}})";
  std::string buf(16, '\0');
  const double a = -0.5;
  const int32_t b[2] = {3, -4};
  std::memcpy(buf.data(), &a, 8);
  std::memcpy(buf.data() + 8, b, 8);
  write_bytes(dir / "hand2.safetensors", handmade(h2, buf));
  const SafetensorsFile f2 = load_safetensors(dir / "hand2.safetensors");
  CHECK(f2.metadata.at("format") == "np");
  CHECK(f2.tensors.at("a").to_vector<double>() == std::vector<double>{-0.5});
  CHECK(f2.tensors.at("b").to_vector<int32_t>() == std::vector<int32_t>{3, -4});
}

TEST_CASE("safetensors: every rule broken once is refused with the file and the fault named") {
  TempDir dir;
  const std::string two = bytes_of({1, 2});
  const std::string ok = handmade(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", two);
  REQUIRE(load_error(dir, ok).empty());

  SUBCASE("shorter than the length field") { CHECK_REFUSED(std::string("\x08\0\0", 3), "shorter than the 8-byte"); }
  SUBCASE("truncated header") { CHECK_REFUSED(ok.substr(0, 30), "truncated"); }
  SUBCASE("truncated buffer") { CHECK_REFUSED(ok.substr(0, ok.size() - 4), "truncated"); }
  SUBCASE("trailing bytes") { CHECK_REFUSED(ok + "junkjunk", "8 trailing bytes"); }
  SUBCASE("gap between tensors") {
    CHECK_REFUSED(handmade(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                           bytes_of({1, 2, 3})),
                  "gap in the byte buffer: bytes [4, 8)");
  }
  SUBCASE("buffer not starting at 0") {
    CHECK_REFUSED(handmade(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", two), "gap");
  }
  SUBCASE("overlapping tensors") {
    CHECK_REFUSED(handmade(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           bytes_of({1, 2, 3})),
                  "overlap");
  }
  SUBCASE("offsets past the end of the file") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", two), "truncated file");
  }
  SUBCASE("shape and byte count disagree") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", two),
                  "need 12 bytes, but data_offsets [0,8] hold 8");
  }
  SUBCASE("end before begin") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", two), "end before");
  }
  SUBCASE("duplicate tensor name") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                           two),
                  "names 'w' twice");
  }
  SUBCASE("duplicate key inside an entry") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"F32","shape":[2],"shape":[2],"data_offsets":[0,8]}})", two),
                  "names 'shape' twice");
  }
  SUBCASE("huge header length") { CHECK_REFUSED(le64(uint64_t{1} << 40) + "{}", "over the format's limit"); }
  SUBCASE("header length that wraps around") { CHECK_REFUSED(le64(~uint64_t{0}) + "{}", "over the format's limit"); }
  SUBCASE("shape whose element count overflows") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})", two),
                  "overflows");
  }
  SUBCASE("shape whose byte count overflows") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", two),
                  "overflows");
  }
  SUBCASE("negative dimension") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", two), "non-negative integer");
  }
  SUBCASE("bf16 whose size does not fit its shape") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", two),
                  "need 6 bytes, but data_offsets [0,8] hold 8");
  }
  SUBCASE("f16 whose size does not fit its shape") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"F16","shape":[3],"data_offsets":[0,8]}})", two),
                  "need 6 bytes, but data_offsets [0,8] hold 8");
  }
  SUBCASE("unknown dtype") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", two), "unknown or unsupported dtype 'Q7'");
  }
  SUBCASE("header that is not an object") { CHECK_REFUSED(handmade("[1, 2, 3]", ""), "not a JSON object"); }
  SUBCASE("header that is not JSON") { CHECK_REFUSED(handmade("{\"w\": nope}", ""), "not valid UTF-8 JSON"); }
  SUBCASE("header that is not UTF-8") { CHECK_REFUSED(handmade("{\"\xff\xfe\": 1}", ""), "not valid UTF-8 JSON"); }
  SUBCASE("entry missing a field") {
    CHECK_REFUSED(handmade(R"({"w":{"dtype":"F32","shape":[2]}})", two), "has no \"data_offsets\"");
  }
  SUBCASE("metadata that is not a map of strings") {
    CHECK_REFUSED(handmade(R"({"__metadata__":{"n":3},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", two),
                  "is not a string");
  }
}

TEST_CASE("safetensors: a missing file is a clear error") {
  TempDir dir;
  CHECK_THROWS_WITH_AS(load_safetensors(dir / "nope.safetensors"),
                       doctest::Contains("nope.safetensors': cannot open: No such file"), UserError);
}

TEST_CASE("safetensors: a BF16 tensor as the format writes it: 2 bytes each, little-endian, dtype \"BF16\"") {
  TempDir dir;
  // Two elements, 1.0 (0x3f80) and -2.0 (0xc000), written by hand from the format.
  const std::string header = R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})";
  std::string file(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  file += header + std::string("\x80\x3f\x00\xc0", 4);
  const std::string path = dir / "hand.safetensors";
  std::ofstream(path, std::ios::binary) << file;
  const Tensor w = load_safetensors(path).tensors.at("w");
  REQUIRE(w.dtype() == DType::kBF16);
  CHECK(bf16_to_float(w.data<BFloat16>()[0]) == 1.0f);
  CHECK(bf16_to_float(w.data<BFloat16>()[1]) == -2.0f);
  // Written back: the same bytes after the header.
  TensorMap out;
  out["w"] = w;
  save_safetensors(dir / "again.safetensors", out);
  const SafetensorsHeader h = read_safetensors_header(dir / "again.safetensors");
  CHECK(h.find("w")->dtype == DType::kBF16);
  std::ifstream in(dir / "again.safetensors", std::ios::binary);
  const std::string again((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(again.find("\"dtype\":\"BF16\"") != std::string::npos);
  CHECK(again.substr(again.size() - 4) == std::string("\x80\x3f\x00\xc0", 4));
}

TEST_CASE("safetensors: an F16 tensor as the format writes it: 2 bytes each, little-endian, dtype \"F16\"") {
  TempDir dir;
  // Two elements, 1.0 (0x3c00) and -2.0 (0xc000), written by hand from the format.
  const std::string header = R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})";
  std::string file(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  file += header + std::string("\x00\x3c\x00\xc0", 4);
  const std::string path = dir / "hand.safetensors";
  std::ofstream(path, std::ios::binary) << file;
  const Tensor w = load_safetensors(path).tensors.at("w");
  REQUIRE(w.dtype() == DType::kF16);
  CHECK(half_to_float(w.data<Half>()[0]) == 1.0f);
  CHECK(half_to_float(w.data<Half>()[1]) == -2.0f);
  // Written back: the same bytes after the header.
  TensorMap out;
  out["w"] = w;
  save_safetensors(dir / "again.safetensors", out);
  const SafetensorsHeader h = read_safetensors_header(dir / "again.safetensors");
  CHECK(h.find("w")->dtype == DType::kF16);
  std::ifstream in(dir / "again.safetensors", std::ios::binary);
  const std::string again((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(again.find("\"dtype\":\"F16\"") != std::string::npos);
  CHECK(again.substr(again.size() - 4) == std::string("\x00\x3c\x00\xc0", 4));
}
