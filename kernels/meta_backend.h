// The backend of planning on shapes: every op of backend.h accepted and none computed.
// With the tensors of ShapesOnly (runtime/tensor.h), which have shapes and addresses but
// no data, a layer's forward and backward run as they do on a device: they allocate the
// same buffers, keep the same ones in their contexts and return the same shapes, in
// microseconds and without memory. The planner reads what a layer keeps for its
// backward this way (plan.h: probe_activations); a derived layer's tape is recorded on
// shapes alike. Its device is the one it stands for (a GPU's, where no GPU is present),
// so that the layers' device checks hold; nothing on that device is touched.
#pragma once

#include "kernels/backend.h"

namespace gpipe {

// The meta backend standing for `device`, alive for the process (thread-safe: it has
// no state). Use it with a ShapesOnly alive on the thread.
Backend& meta_backend(Device device);

}  // namespace gpipe
