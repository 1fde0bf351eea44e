#include "runtime/dtype.h"

#include "runtime/error.h"

namespace gpipe {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI32: return 4;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kF64: return "float64";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kI32: return "int32";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "float32" || name == "f32") return DType::kF32;
  if (name == "float64" || name == "f64") return DType::kF64;
  if (name == "bfloat16" || name == "bf16") return DType::kBF16;
  if (name == "float16" || name == "fp16" || name == "f16") return DType::kF16;
  if (name == "int32") return DType::kI32;
  throw UserError("unknown dtype '" + name + "'; use float32, float64, bfloat16 or float16");
}

}  // namespace gpipe
