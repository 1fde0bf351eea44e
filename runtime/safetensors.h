// The safetensors file format (Hugging Face), so that checkpoints open in PyTorch and any
// other tool that reads it. Layout: 8 bytes N (little-endian u64), N bytes of UTF-8 JSON
// (padded with spaces to a multiple of 8), then the byte buffer. The JSON object maps
// each tensor name to {"dtype", "shape", "data_offsets": [begin, end)} (offsets into the
// buffer), plus an optional "__metadata__" object of string values. Tensors are C-order,
// little-endian, packed.
//
// The reader treats the file as hostile and applies the format's rules: header at most
// 100,000,000 bytes (as the reference implementation), a JSON object with no duplicate
// key at any level, offsets that tile the buffer from 0 with no gap, overlap or trailing
// byte, byte counts that agree with dtype x shape, every product and sum checked for
// overflow. Every error is a UserError that names the file and the problem.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "runtime/atomic_file.h"
#include "runtime/tensor.h"

namespace gpipe {

using TensorMap = std::map<std::string, Tensor>;
using StringMap = std::map<std::string, std::string>;

constexpr uint64_t kSafetensorsMaxHeaderBytes = 100000000;

// One tensor as its header describes it; offsets are into the byte buffer.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in buffer order
  StringMap metadata;                     // "__metadata__"
  uint64_t buffer_start = 0;              // 8 + N: where the byte buffer begins in the file
  uint64_t buffer_bytes = 0;              // the whole buffer (sum of the tensors' bytes)
  const SafetensorsEntry* find(const std::string& name) const;
};

struct SafetensorsFile {
  TensorMap tensors;
  StringMap metadata;
};

// "F32" <-> DType. Throws UserError for "BF16"/"F16" (not supported yet) and for any
// other name; `what` prefixes the message (file and tensor).
DType safetensors_dtype(const std::string& name, const std::string& what);
const char* safetensors_dtype_name(DType dtype);

// The file's bytes (header and buffer) into `sink`. Tensors must be contiguous host
// tensors of F32, F64 or I32; they are laid out by decreasing element size, then name,
// so every tensor's data is aligned to its element size in the file.
void write_safetensors(FileSink& sink, const TensorMap& tensors, const StringMap& metadata = {});
// The same into `path`, atomically (runtime/atomic_file.h).
void save_safetensors(const std::string& path, const TensorMap& tensors, const StringMap& metadata = {});

// Reads and checks the header only (the buffer is not read, but its size is checked
// against the file's).
SafetensorsHeader read_safetensors_header(const std::string& path);
// Reads and checks the file; with `want`, only the tensors it accepts are read into
// memory (the whole header is checked either way). Tensors are on the CPU.
SafetensorsFile load_safetensors(const std::string& path,
                                 const std::function<bool(const std::string&)>& want = nullptr);

}  // namespace gpipe
