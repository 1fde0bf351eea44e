#include "runtime/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "runtime/error.h"

// Tensors are written and read as they lie in memory; the format is little-endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

namespace gpipe {

namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw UserError("safetensors file '" + path + "': " + problem);
}

uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& path, const std::string& what) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) fail(path, what + " overflows 64 bits; the header is corrupt");
  return r;
}

uint64_t checked_add(uint64_t a, uint64_t b, const std::string& path, const std::string& what) {
  uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) fail(path, what + " overflows 64 bits; the header is corrupt");
  return r;
}

// Closes a descriptor at scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads exactly `bytes` at `offset`; a short read means the file shrank or is truncated.
void read_exactly(int fd, void* dst, uint64_t bytes, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(bytes, 1u << 30));
    const ssize_t n = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path, std::string("cannot read: ") + std::strerror(errno));
    if (n == 0) fail(path, "ends early at byte " + std::to_string(offset) + " (truncated, or changed while read)");
    p += n;
    bytes -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

// Parses the header JSON, refusing a duplicate key at any depth: nlohmann keeps the
// last of two equal keys silently, so the parser callback sees every key first.
json parse_header_json(const std::string& text, const std::string& path) {
  if (text.empty() || text[0] != '{') fail(path, "the header does not start with '{' (not a JSON object)");
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  const json::parser_callback_t cb = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) open_objects.emplace_back();
    if (event == json::parse_event_t::object_end && !open_objects.empty()) open_objects.pop_back();
    if (event == json::parse_event_t::key && !open_objects.empty() && duplicate.empty()) {
      const std::string key = parsed.get<std::string>();
      if (!open_objects.back().insert(key).second) duplicate = key;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text, cb, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const json::exception& e) {
    fail(path, std::string("the header is not valid UTF-8 JSON: ") + e.what());
  }
  if (!duplicate.empty()) fail(path, "the header names '" + duplicate + "' twice; duplicate keys are not allowed");
  if (!j.is_object()) fail(path, "the header is JSON but not an object");
  return j;
}

uint64_t unsigned_value(const json& v, const std::string& path, const std::string& what) {
  if (!v.is_number_unsigned()) fail(path, what + " must be a non-negative integer, got " + v.dump());
  return v.get<uint64_t>();
}

SafetensorsEntry decode_entry(const std::string& name, const json& info, const std::string& path) {
  const std::string what = "tensor '" + name + "'";
  if (!info.is_object()) fail(path, what + ": expected {\"dtype\", \"shape\", \"data_offsets\"}, got " + info.dump());
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!info.contains(key)) fail(path, what + " has no \"" + key + "\"");
  }
  SafetensorsEntry e;
  e.name = name;
  if (!info["dtype"].is_string()) fail(path, what + ": \"dtype\" must be a string");
  e.dtype = safetensors_dtype(info["dtype"].get<std::string>(), "safetensors file '" + path + "': " + what);
  const json& shape = info["shape"];
  if (!shape.is_array()) fail(path, what + ": \"shape\" must be a list of integers");
  uint64_t numel = 1;
  for (const json& d : shape) {
    const uint64_t v = unsigned_value(d, path, what + ": a dimension");
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(path, what + ": dimension " + std::to_string(v) + " overflows a signed 64-bit size");
    }
    numel = checked_mul(numel, v, path, what + ": the element count of shape " + shape.dump());
    e.shape.push_back(static_cast<int64_t>(v));
  }
  if (numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    fail(path, what + ": the element count of shape " + shape.dump() + " overflows a signed 64-bit size");
  }
  const json& off = info["data_offsets"];
  if (!off.is_array() || off.size() != 2) fail(path, what + ": \"data_offsets\" must be [begin, end]");
  e.begin = unsigned_value(off[0], path, what + ": data_offsets[0]");
  e.end = unsigned_value(off[1], path, what + ": data_offsets[1]");
  if (e.end < e.begin) fail(path, what + ": data_offsets " + off.dump() + " end before they begin");
  const uint64_t bytes = checked_mul(numel, dtype_size(e.dtype), path, what + ": the byte count of shape " + shape.dump());
  if (e.end - e.begin != bytes) {
    fail(path, what + ": dtype " + info["dtype"].get<std::string>() + " and shape " + shape_str(e.shape) + " need " +
                   std::to_string(bytes) + " bytes, but data_offsets " + off.dump() + " hold " +
                   std::to_string(e.end - e.begin));
  }
  return e;
}

// The tensors' byte ranges must tile [0, buffer_bytes) exactly.
void check_tiling(const std::vector<SafetensorsEntry>& entries, uint64_t buffer_bytes, const std::string& path) {
  uint64_t at = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry& e : entries) {
    if (e.begin > at) {
      fail(path, "gap in the byte buffer: bytes [" + std::to_string(at) + ", " + std::to_string(e.begin) +
                     ") belong to no tensor (the next, '" + e.name + "', starts at " + std::to_string(e.begin) + ")");
    }
    if (e.begin < at) {
      fail(path, "tensors '" + prev->name + "' and '" + e.name + "' overlap: '" + e.name + "' starts at byte " +
                     std::to_string(e.begin) + " before '" + prev->name + "' ends at " + std::to_string(at));
    }
    at = e.end;
    prev = &e;
  }
  if (at > buffer_bytes) {
    fail(path, "tensor '" + prev->name + "' ends at byte " + std::to_string(at) + " of the buffer, but the file holds " +
                   std::to_string(buffer_bytes) + " bytes after the header (truncated file?)");
  }
  if (at < buffer_bytes) {
    fail(path, std::to_string(buffer_bytes - at) + " trailing bytes after the last tensor's data (the tensors end at " +
                   "byte " + std::to_string(at) + " of a " + std::to_string(buffer_bytes) + "-byte buffer)");
  }
}

SafetensorsHeader read_header(int fd, uint64_t file_size, const std::string& path) {
  if (file_size < 8) fail(path, "is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length");
  unsigned char len_bytes[8];
  read_exactly(fd, len_bytes, 8, 0, path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];  // little-endian
  if (n > kSafetensorsMaxHeaderBytes) {
    fail(path, "declares a header of " + std::to_string(n) + " bytes, over the format's limit of " +
                   std::to_string(kSafetensorsMaxHeaderBytes) + " (corrupt, or not a safetensors file)");
  }
  const uint64_t start = checked_add(n, 8, path, "the header length");
  if (start > file_size) {
    fail(path, "declares a header of " + std::to_string(n) + " bytes, but the file has only " +
                   std::to_string(file_size - 8) + " after the length (truncated file?)");
  }
  std::string text(static_cast<size_t>(n), '\0');
  read_exactly(fd, text.data(), n, 8, path);
  const json j = parse_header_json(text, path);

  SafetensorsHeader h;
  h.buffer_start = start;
  h.buffer_bytes = file_size - start;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) fail(path, "\"__metadata__\" must be an object of strings");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) fail(path, "\"__metadata__\" value of '" + m.key() + "' is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    h.entries.push_back(decode_entry(it.key(), it.value(), path));
  }
  // Any header order is valid; the tiling is checked in buffer order.
  std::sort(h.entries.begin(), h.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  check_tiling(h.entries, h.buffer_bytes, path);
  return h;
}

uint64_t open_for_reading(const std::string& path, Fd& fd) {
  fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd.fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) fail(path, std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail(path, "is not a regular file");
  return static_cast<uint64_t>(st.st_size);
}

}  // namespace

const SafetensorsEntry* SafetensorsHeader::find(const std::string& name) const {
  for (const auto& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

DType safetensors_dtype(const std::string& name, const std::string& what) {
  if (name == "F32") return DType::kF32;
  if (name == "F64") return DType::kF64;
  if (name == "I32") return DType::kI32;
  if (name == "BF16") return DType::kBF16;
  if (name == "F16") return DType::kF16;
  throw UserError(what + ": unknown or unsupported dtype '" + name + "'; gpipe reads F32, F64, BF16, F16 and I32");
}

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kI32: return "I32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
  }
  throw Error("safetensors: no name for dtype " + std::to_string(static_cast<int>(dtype)));
}

void write_safetensors(FileSink& sink, const TensorMap& tensors, const StringMap& metadata) {
  std::vector<std::pair<const std::string*, const Tensor*>> order;
  for (const auto& kv : tensors) {
    const Tensor& t = kv.second;
    if (!t.defined()) throw Error("safetensors '" + sink.path() + "': tensor '" + kv.first + "' is undefined");
    if (!t.device().is_cpu() || !t.is_contiguous()) {
      throw Error("safetensors '" + sink.path() + "': tensor '" + kv.first + "' is " + t.str() +
                  "; copy it to a contiguous host tensor first");
    }
    order.emplace_back(&kv.first, &t);
  }
  // Largest elements first, then by name: every tensor's data starts at a multiple of
  // its element size (the header is padded to 8).
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return dtype_size(a.second->dtype()) > dtype_size(b.second->dtype());
  });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t at = 0;
  for (const auto& [name, t] : order) {
    const uint64_t end = at + t->nbytes();
    header[*name] = {{"dtype", safetensors_dtype_name(t->dtype())}, {"shape", t->shape()}, {"data_offsets", {at, end}}};
    at = end;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    throw UserError("safetensors '" + sink.path() + "': a tensor name or metadata string is not valid UTF-8 (" +
                    e.what() + ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len_bytes[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i, n >>= 8) len_bytes[i] = static_cast<unsigned char>(n & 0xff);
  sink.write(len_bytes, 8);
  sink.write(text);
  for (const auto& [name, t] : order) sink.write(t->raw_data(), t->nbytes());
}

void save_safetensors(const std::string& path, const TensorMap& tensors, const StringMap& metadata) {
  write_file_atomically(path, [&](FileSink& sink) { write_safetensors(sink, tensors, metadata); });
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  Fd fd;
  const uint64_t size = open_for_reading(path, fd);
  return read_header(fd.fd, size, path);
}

SafetensorsFile load_safetensors(const std::string& path, const std::function<bool(const std::string&)>& want) {
  Fd fd;
  const uint64_t size = open_for_reading(path, fd);
  SafetensorsHeader h = read_header(fd.fd, size, path);
  SafetensorsFile out;
  out.metadata = std::move(h.metadata);
  for (const SafetensorsEntry& e : h.entries) {
    if (want && !want(e.name)) continue;
    Tensor t = Tensor::empty(e.shape, e.dtype, Device::cpu());
    read_exactly(fd.fd, t.raw_data(), e.end - e.begin, h.buffer_start + e.begin, path);
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

}  // namespace gpipe
