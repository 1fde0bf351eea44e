#include "runtime/message_header.h"

#include <limits>
#include <string>

#include "runtime/error.h"

namespace gpipe {

MessageHeader encode_header(const Tensor& t, const MessageTag& tag) {
  if (t.dim() > kMaxMessageDims) {
    throw Error("cannot send the " + tag_str(tag) + ": " + t.str() + " has more than " +
                std::to_string(kMaxMessageDims) + " dimensions");
  }
  MessageHeader header{};
  header[0] = static_cast<int64_t>(t.dtype());
  header[1] = t.dim();
  for (int d = 0; d < t.dim(); ++d) header[2 + d] = t.size(d);
  return header;
}

MessageLayout decode_header(const MessageHeader& header, const std::string& what) {
  auto malformed = [&](const std::string& why) {
    return Error("malformed message header for " + what + ": " + why +
                 " (are both ranks running the same gpipe build?)");
  };
  if (header[0] < 0 || header[0] > static_cast<int64_t>(DType::kI32)) {
    throw malformed("unknown element type " + std::to_string(header[0]));
  }
  if (header[1] < 0 || header[1] > kMaxMessageDims) {
    throw malformed(std::to_string(header[1]) + " dimensions");
  }
  MessageLayout out;
  out.dtype = static_cast<DType>(header[0]);
  // Bytes must fit in a size_t with room to spare: a corrupt size would otherwise
  // turn into a huge allocation or a wrapped-around small one.
  const int64_t limit = std::numeric_limits<int64_t>::max() / 16;
  int64_t numel = 1;
  for (int d = 0; d < header[1]; ++d) {
    const int64_t n = header[2 + d];
    if (n < 0) throw malformed("size " + std::to_string(n) + " in dimension " + std::to_string(d));
    if (n > 0 && numel > limit / n) throw malformed("more elements than fit in memory");
    numel *= n;
    out.shape.push_back(n);
  }
  return out;
}

}  // namespace gpipe
