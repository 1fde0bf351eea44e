// The small header that goes ahead of a tensor between processes: element type and
// shape, so shapes travel with the data and a receiver allocates exactly what arrives.
// Shared by the transports that cross process boundaries (MPI and NCCL).
#pragma once

#include <array>
#include <cstdint>

#include "runtime/tensor.h"
#include "runtime/transport.h"

namespace gpipe {

constexpr int kMaxMessageDims = 8;
// Element type, number of dimensions, then up to kMaxMessageDims sizes (unused ones 0).
constexpr int kMessageHeaderWords = 2 + kMaxMessageDims;
using MessageHeader = std::array<int64_t, kMessageHeaderWords>;

// The header of `t`, sent as the `tag` message; throws Error naming the message when
// `t` cannot be described (more than kMaxMessageDims dimensions).
MessageHeader encode_header(const Tensor& t, const MessageTag& tag);

struct MessageLayout {
  DType dtype = DType::kF32;
  Shape shape;
};

// What a received header announces. `what` names the message for errors (e.g. "the
// activation of micro-batch 3 from rank 0"); a header with an unknown element type, a
// bad number of dimensions, a negative size or a size that overflows is refused with
// an Error naming it, before anything is allocated or received.
MessageLayout decode_header(const MessageHeader& header, const std::string& what);

}  // namespace gpipe
