// Element types. float32 is the training type; float64 exists so that finite-difference
// checks and exact-equality tests can run in double precision on the reference backend;
// bfloat16 is a storage type (runtime/bf16.h: its element type and conversions; a
// backend's cast converts tensors); int32 holds labels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gpipe {

enum class DType : uint8_t { kF32, kF64, kBF16, kI32, kF16 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// "float32" / "float64" / "bfloat16" / "int32"; throws UserError otherwise.
DType parse_dtype(const std::string& name);

// A storage type narrower than float32 (bfloat16, float16): a model of it computes in
// float32 and keeps float32 master weights (docs/ARCHITECTURE.md, "Mixed precision").
inline bool is_narrow(DType t) { return t == DType::kBF16 || t == DType::kF16; }
// The type a model of storage type `t` computes, accumulates and keeps its master weights,
// gradients and optimizer state in: float32 for a narrow type, else `t` itself.
inline DType master_dtype(DType t) { return is_narrow(t) ? DType::kF32 : t; }

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct DTypeOf<double> {
  static constexpr DType value = DType::kF64;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::kI32;
};

}  // namespace gpipe
