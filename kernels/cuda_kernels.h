// Raw-pointer launchers for the CUDA backend's elementwise, reduction, loss, optimizer
// and transformer kernels (kernels/cuda_kernels.cu). Plain C++: includable from files
// the host compiler builds. The matrix products of attention are cuBLAS calls in
// kernels/cuda_backend.cc; only the softmax between them lives here.
//
// Conventions:
//   * every pointer is device memory on the current device (the caller sets it), and
//     matrices are contiguous and row-major;
//   * every launcher enqueues on `stream` and returns without synchronising; it checks
//     the launch (GPIPE_CUDA_CHECK(cudaGetLastError())) and throws gpipe::Error if the
//     launch failed;
//   * n, rows, cols may be 0 (then nothing is launched, except where noted);
//   * scalar arguments arrive as the element type where the CPU reference converts
//     them before use, so both backends round the same way.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/deferred_checks.h"  // cuda::ErrorSlot
#include "runtime/bf16.h"
#include "runtime/dtype.h"
#include "runtime/fp16.h"

namespace gpipe {
namespace cuda {

// dst[i] = src[i] converted: float32, float64 and bfloat16 (runtime/bf16.h) in any pair
// of different types, with the CPU reference's rounding (Backend::cast).
void cast(const void* src, DType from, void* dst, DType to, int64_t n, cudaStream_t stream);

// The 16-bit overloads below (bfloat16, float16) load into float32, compute there and
// round once on store, to nearest even (Backend::computes_narrow).

// y: (rows, cols) += bias: (cols), broadcast over rows.
void add_bias(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream);
void add_bias(double* y, const double* bias, int64_t rows, int64_t cols, cudaStream_t stream);
void add_bias(BFloat16* y, const BFloat16* bias, int64_t rows, int64_t cols, cudaStream_t stream);
void add_bias(Half* y, const Half* bias, int64_t rows, int64_t cols, cudaStream_t stream);

// db: (cols) = (beta == 0 ? 0 : beta * db) + sum over rows of dy: (rows, cols).
// beta == 0 ignores db's old contents (NaN included). Deterministic (no atomics): the
// rows are cut into chunks (a function of rows alone) whose column sums, in double, go
// to workspace: (bias_grad_workspace(rows, cols)) doubles, then are added in order.
int64_t bias_grad_workspace(int64_t rows, int64_t cols);
void bias_grad(const float* dy, float* db, int64_t rows, int64_t cols, double beta, double* workspace,
               cudaStream_t stream);
void bias_grad(const double* dy, double* db, int64_t rows, int64_t cols, double beta, double* workspace,
               cudaStream_t stream);

// y = max(x, 0); x, y: (n). y may alias x.
void relu(const float* x, float* y, int64_t n, cudaStream_t stream);
void relu(const double* x, double* y, int64_t n, cudaStream_t stream);
void relu(const BFloat16* x, BFloat16* y, int64_t n, cudaStream_t stream);
void relu(const Half* x, Half* y, int64_t n, cudaStream_t stream);
// dx = y > 0 ? dy : 0; y, dy, dx: (n).
void relu_backward(const float* y, const float* dy, float* dx, int64_t n, cudaStream_t stream);
void relu_backward(const double* y, const double* dy, double* dx, int64_t n, cudaStream_t stream);
void relu_backward(const BFloat16* y, const BFloat16* dy, BFloat16* dx, int64_t n, cudaStream_t stream);
void relu_backward(const Half* y, const Half* dy, Half* dx, int64_t n, cudaStream_t stream);

// y = 0.5 x (1 + erf(x / sqrt 2)); x, y: (n).
void gelu(const float* x, float* y, int64_t n, cudaStream_t stream);
void gelu(const double* x, double* y, int64_t n, cudaStream_t stream);
void gelu(const BFloat16* x, BFloat16* y, int64_t n, cudaStream_t stream);
void gelu(const Half* x, Half* y, int64_t n, cudaStream_t stream);
// dx = dy * (Phi(x) + x phi(x)); x, dy, dx: (n).
void gelu_backward(const float* x, const float* dy, float* dx, int64_t n, cudaStream_t stream);
void gelu_backward(const double* x, const double* dy, double* dx, int64_t n, cudaStream_t stream);
void gelu_backward(const BFloat16* x, const BFloat16* dy, BFloat16* dx, int64_t n, cudaStream_t stream);
void gelu_backward(const Half* x, const Half* dy, Half* dx, int64_t n, cudaStream_t stream);

// ---- Deferred input errors. What a user can get wrong in the data (a label, a token
// id; in kernels/cuda_conv_kernels.h a max-pool argmax) is found by the kernel that uses
// the value, without stopping the host: the kernel skips the bad element (it never
// reads or writes out of bounds; what it would have computed is left as documented per
// launcher) and lowers an error slot, one device word per validating op call, to
//   (uint64(index) << 32) | uint32(value)
// with a 64-bit atomicMin. So the smallest bad index wins, and the low half is that
// element's value (an index always carries the same value). The slot must hold kNoError
// when the kernel starts; the backend owns the slots, resets them, and reads them back
// when it waits for its stream anyway (kernels/cuda_backend.cc). Indices must be at most
// kMaxErrorIndex, so that no flagged slot reads as kNoError.
// The slot's encoding (ErrorSlot, kNoError, error_index, error_value) is host code, in
// kernels/deferred_checks.h.
#ifdef __CUDACC__
__device__ __forceinline__ void flag_error(ErrorSlot* slot, int64_t index, int32_t value) {
  atomicMin(slot, (static_cast<ErrorSlot>(index) << 32) | static_cast<uint32_t>(value));
}
#endif

// The loss's factor as a kernel takes it (Backend's LossScale): `value`, or with `at` (the
// step's scalars on the device, kernels/step_scalars.h) *at, read when the kernel runs.
struct LossScaleArg {
  LossScaleArg(double value = 1.0, const double* at = nullptr) : value(value), at(at) {}  // NOLINT: a value converts
  double value;
  const double* at;
};

// Softmax cross-entropy forward over the rows of logits: (rows, cols).
//   probs:    (rows, cols)  softmax of each row
//   row_loss: (rows)        workspace: -log probs[r, labels[r]], 0 for ignored rows
//   loss:     (1)           scale * sum of row_loss, summed in double in a fixed order
//   labels:   (rows) int32
//   error:    (1) device    error slot (kNoError on entry): flags (row, label) for each
//                           label that is neither ignore_index nor in [0, cols); such
//                           rows add 0 to the loss
// Always writes loss (0 when rows == 0). rows must be < 2^31 - 1.
void softmax_xent(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, LossScaleArg scale,
                  int ignore_index, float* probs, float* row_loss, float* loss, ErrorSlot* error,
                  cudaStream_t stream);
void softmax_xent(const double* logits, const int32_t* labels, int64_t rows, int64_t cols, LossScaleArg scale,
                  int ignore_index, double* probs, double* row_loss, double* loss, ErrorSlot* error,
                  cudaStream_t stream);

// dlogits: (rows, cols) = scale * (probs - onehot(labels)); rows with ignore_index get 0.
// error as for softmax_xent (rows with a bad label get scale * probs).
void softmax_xent_backward(const float* probs, const int32_t* labels, int64_t rows, int64_t cols, LossScaleArg scale,
                           int ignore_index, float* dlogits, ErrorSlot* error, cudaStream_t stream);
void softmax_xent_backward(const double* probs, const int32_t* labels, int64_t rows, int64_t cols,
                           LossScaleArg scale, int ignore_index, double* dlogits, ErrorSlot* error,
                           cudaStream_t stream);

// *count (device, one unsigned 64-bit integer, zeroed by the caller) += the number of
// rows of logits: (rows, cols) whose first largest entry is at column labels[r], over
// rows with labels[r] != ignore_index; labels: (rows) int32. rows < 2^31 - 1.
void argmax_correct(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, int ignore_index,
                    unsigned long long* count, cudaStream_t stream);
void argmax_correct(const double* logits, const int32_t* labels, int64_t rows, int64_t cols, int ignore_index,
                    unsigned long long* count, cudaStream_t stream);

// x: (n) = value.
void fill(float* x, int64_t n, float value, cudaStream_t stream);
void fill(double* x, int64_t n, double value, cudaStream_t stream);
void fill(int32_t* x, int64_t n, int32_t value, cudaStream_t stream);

// x: (n) *= alpha; alpha == 0 writes zeros (clears NaN and Inf too).
void scale(float* x, int64_t n, double alpha, cudaStream_t stream);
void scale(double* x, int64_t n, double alpha, cudaStream_t stream);

// y: (n) += alpha * x: (n).
void axpy(double alpha, const float* x, float* y, int64_t n, cudaStream_t stream);
void axpy(double alpha, const double* x, double* y, int64_t n, cudaStream_t stream);

// One SGD step, PyTorch semantics (dampening 0), the same formula as the CPU backend:
//   g = grad + weight_decay * param
//   buf = first_step ? g : momentum * buf + g          (only when buf != nullptr)
//   param -= lr * (buf == nullptr ? g : nesterov ? g + momentum * buf : buf)
// param, grad, buf: (n). Pass buf == nullptr exactly when momentum == 0.
void sgd_step(float* param, const float* grad, float* buf, int64_t n, double lr, double momentum,
              double weight_decay, bool nesterov, bool first_step, cudaStream_t stream);
void sgd_step(double* param, const double* grad, double* buf, int64_t n, double lr, double momentum,
              double weight_decay, bool nesterov, bool first_step, cudaStream_t stream);

// One Adam / AdamW step, the formula of Backend::adam_step. param, grad, m, v: (n).
// decay = 1 - lr * weight_decay, bias_correction1 = 1 - beta1^step and bias_correction2 =
// 1 - beta2^step come from the host (computed in double: adam_step_scalars), so the
// kernel is purely elementwise.
void adam_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool decoupled, double decay, double bias_correction1,
               double bias_correction2, cudaStream_t stream);
void adam_step(double* param, const double* grad, double* m, double* v, int64_t n, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool decoupled, double decay, double bias_correction1,
               double bias_correction2, cudaStream_t stream);

// Sum of squares of x: (n), in double, in a fixed order (a fixed grid for a given n,
// per-block trees, then one block over the partial sums), so the result does not vary
// from run to run. workspace: (sum_squares_workspace(n)) doubles; *result (device)
// receives the sum (0 when n == 0).
int64_t sum_squares_workspace(int64_t n);
void sum_squares(const float* x, int64_t n, double* workspace, double* result, cudaStream_t stream);
void sum_squares(const double* x, int64_t n, double* workspace, double* result, cudaStream_t stream);

// ---- Multi-tensor launches (the Backend's *_all ops): one kernel over many tensors of
// one element type. A table in device memory describes them: for each tensor its
// element count and one pointer per list (params, grads, ...). Its content depends only
// on those pointers and counts, so a caller builds it once (multi_tensor_image, copied
// to the device as it is) and reuses it while the tensors live: no upload per step.
// Each block takes chunks of kMultiTensorChunk elements of one tensor, so a launch
// spreads over the GPU whatever the tensors' sizes. Element arithmetic: the
// single-tensor kernels' (bit for bit the same results); sums of squares in another
// fixed order (one partial sum per block, then one block over them).
constexpr int64_t kMultiTensorChunk = 65536;
struct MultiTensorTable {
  const int64_t* chunk_start = nullptr;  // (tensors + 1): tensor t's first chunk; [tensors] = chunks
  const int64_t* numel = nullptr;        // (tensors), each > 0
  void* const* ptrs = nullptr;           // (lists x tensors): list l's tensor t at [l * tensors + t]
  int64_t tensors = 0, chunks = 0;
  int lists = 0;
};
// The table's words, to be copied to the device as they are: chunk_start, numel, then
// each list's pointers. numel: every entry > 0 (leave empty tensors out).
std::vector<int64_t> multi_tensor_image(const std::vector<std::vector<const void*>>& lists,
                                        const std::vector<int64_t>& numel);
// The table over `image` (device memory holding host_image's words).
MultiTensorTable multi_tensor_view(const int64_t* image, const std::vector<int64_t>& host_image, int lists);
// `step`: the step's scalars on the device (kernels/step_scalars.h), read when the
// kernels run: the learning rate, the step's count and Adam's host-computed decay and
// bias corrections; nothing changes when its kStepSkip is set.
// Lists: params, grads, momentum buffers (nullptr entries without momentum); float32 or float64.
void multi_sgd_step(const MultiTensorTable& tab, DType t, double momentum, double weight_decay, bool nesterov,
                    const double* step, cudaStream_t stream);
// Lists: params, grads, m, v; float32 or float64.
void multi_adam_step(const MultiTensorTable& tab, DType t, double beta1, double beta2, double eps,
                     double weight_decay, bool decoupled, const double* step, cudaStream_t stream);
// One list: x *= alpha, or x = alpha when fill; float32 or float64.
void multi_scale(const MultiTensorTable& tab, DType t, double alpha, bool fill, cudaStream_t stream);
// One list: x *= step[kStepGradScale] (0 clears); nothing when it is 1 or kStepSkip is set.
void multi_scale_by(const MultiTensorTable& tab, DType t, const double* step, cudaStream_t stream);
// step[kStepGradScale] and step[kStepSkip] from step[kStepNormSquared] and step[kStepUnscale]
// (Backend::step_grad_scale); the step is skipped too when any of the `slot_count`
// error slots is flagged.
void step_grad_scale(double* step, double max_norm, bool skip_nonfinite,
                     const ErrorSlot* slots, int64_t slot_count, cudaStream_t stream);
// One list: *result (device) = the sum of every element's square, in double.
// workspace: multi_sum_squares_workspace(tab) doubles.
int64_t multi_sum_squares_workspace(const MultiTensorTable& tab);
void multi_sum_squares(const MultiTensorTable& tab, DType t, double* workspace, double* result,
                       cudaStream_t stream);
// Lists: sources, destinations; the pairs multi_cast_supported accepts (float32 into
// bfloat16 or float16: a narrow model's working copies), rounded as cast() rounds.
bool multi_cast_supported(DType from, DType to);
void multi_cast(const MultiTensorTable& tab, DType from, DType to, cudaStream_t stream);

// ---- Transformer ops. B batch, T positions, C channels, V vocabulary; P = B * T
// positions in all, counted p = b * T + t (P < 2^31 - 1).

// out: (B, T, C) = table[ids[b, t]] + pos[t], table: (V, C), pos: (>= T, C) or nullptr
// for none; ids: (B, T) int32. error: error slot (kNoError on entry) that flags (p, id)
// for each id outside [0, V); such positions get zeros.
void embedding(const int32_t* ids, const float* table, const float* pos, float* out, int64_t batch,
               int64_t seq, int64_t vocab, int64_t channels, ErrorSlot* error, cudaStream_t stream);
void embedding(const int32_t* ids, const double* table, const double* pos, double* out, int64_t batch,
               int64_t seq, int64_t vocab, int64_t channels, ErrorSlot* error, cudaStream_t stream);
// 16-bit tables (NarrowOp::kEmbedding): the row plus the position in float32, rounded once.
void embedding(const int32_t* ids, const BFloat16* table, const BFloat16* pos, BFloat16* out, int64_t batch,
               int64_t seq, int64_t vocab, int64_t channels, ErrorSlot* error, cudaStream_t stream);
void embedding(const int32_t* ids, const Half* table, const Half* pos, Half* out, int64_t batch, int64_t seq,
               int64_t vocab, int64_t channels, ErrorSlot* error, cudaStream_t stream);

// Bytes of device workspace embedding_backward needs for B * T = positions ids of a
// (vocab, channels) table with elements of element_bytes.
size_t embedding_backward_workspace_bytes(int64_t positions, int64_t vocab, int64_t channels, size_t element_bytes);
// dtable: (V, C) += dout: (B, T, C) scattered by ids: (B, T); dpos: (>= T, C), rows
// [0, T) += sum over b of dout[b] (skipped when dpos == nullptr). Deterministic, no
// floating-point atomics: the (id, position) pairs are sorted stably (CUB radix sort)
// and cut into segments of 32 entries, one block each. An id whose rows lie in one
// segment is added into dtable in position order, the CPU's order of additions; a more
// frequent id's rows are summed per segment and the segments' sums added in order (so
// one id of thousands of rows is spread over many blocks; not the CPU's rounding).
// dpos adds b = 0, 1, ... per element, as the CPU does.
// error as for embedding; a bad id's row of dout is skipped (dpos still receives it).
void embedding_backward(const int32_t* ids, const float* dout, float* dtable, float* dpos, int64_t batch,
                        int64_t seq, int64_t vocab, int64_t channels, void* workspace, size_t workspace_bytes,
                        ErrorSlot* error, cudaStream_t stream);
void embedding_backward(const int32_t* ids, const double* dout, double* dtable, double* dpos, int64_t batch,
                        int64_t seq, int64_t vocab, int64_t channels, void* workspace, size_t workspace_bytes,
                        ErrorSlot* error, cudaStream_t stream);

// A vocabulary-parallel softmax cross-entropy's three steps (Backend::softmax_xent_slice_*):
// logits (rows, cols) are columns [first, first + cols) of `vocab`. sums: (2 rows);
// the loss step needs a (rows) row_loss workspace; a bad label is flagged as (row, label).
#define GPIPE_XENT_SLICE(T)                                                                                     \
  void softmax_xent_slice_sums(const T* logits, const int32_t* labels, int64_t rows, int64_t cols, int64_t first, \
                               int64_t vocab, int ignore_index, const T* rowmax, T* sums, ErrorSlot* error,       \
                               cudaStream_t stream);                                                              \
  void softmax_xent_slice_loss(const T* sums, const T* rowmax, const int32_t* labels, int64_t rows,               \
                               int ignore_index, LossScaleArg scale, T* lse, T* row_loss, T* loss, cudaStream_t stream); \
  void softmax_xent_slice_backward(const T* logits, const int32_t* labels, int64_t rows, int64_t cols,            \
                                   int64_t first, int ignore_index, const T* lse, LossScaleArg scale, T* dlogits,       \
                                   cudaStream_t stream);                                                          \
  void first_column_equal(const T* logits, const T* value, int64_t rows, int64_t cols, int64_t first, int64_t none, \
                          T* index, cudaStream_t stream);
GPIPE_XENT_SLICE(float)
GPIPE_XENT_SLICE(double)
#undef GPIPE_XENT_SLICE

// A vocabulary-parallel embedding's share (Backend::embedding_slice): table (rows, C)
// holds ids [first, first + rows) of a vocabulary of `vocab`; out (B, T, C) gets their
// rows and zeros for the other ids; ids outside [0, vocab) are flagged as for embedding.
// The backward adds dout into those rows only, as embedding_backward does (the same
// workspace: embedding_backward_workspace_bytes(P, rows, C, element bytes)).
#define GPIPE_EMBEDDING_SLICE(T)                                                                            \
  void embedding_slice(const int32_t* ids, const T* table, T* out, int64_t batch, int64_t seq, int64_t rows,   \
                       int64_t channels, int64_t first, int64_t vocab, ErrorSlot* error, cudaStream_t stream);
GPIPE_EMBEDDING_SLICE(float)
GPIPE_EMBEDDING_SLICE(double)
GPIPE_EMBEDDING_SLICE(BFloat16)
GPIPE_EMBEDDING_SLICE(Half)
#undef GPIPE_EMBEDDING_SLICE
#define GPIPE_EMBEDDING_SLICE_BACKWARD(T)                                                                      \
  void embedding_slice_backward(const int32_t* ids, const T* dout, T* dtable, int64_t batch, int64_t seq,      \
                                int64_t rows, int64_t channels, int64_t first, int64_t vocab, void* workspace, \
                                size_t workspace_bytes, ErrorSlot* error, cudaStream_t stream);
GPIPE_EMBEDDING_SLICE_BACKWARD(float)
GPIPE_EMBEDDING_SLICE_BACKWARD(double)
#undef GPIPE_EMBEDDING_SLICE_BACKWARD

// Layer normalisation over the rows of x: (rows, cols); gamma, beta: (cols); y like x;
// mean, rstd: (rows). Statistics in double, two passes (mean, then the biased variance
// of x - mean) per row, stored rounded to the element type.
void layernorm(const float* x, const float* gamma, const float* beta, double eps, float* y, float* mean,
               float* rstd, int64_t rows, int64_t cols, cudaStream_t stream);
void layernorm(const double* x, const double* gamma, const double* beta, double eps, double* y, double* mean,
               double* rstd, int64_t rows, int64_t cols, cudaStream_t stream);

// Doubles of workspace layernorm_backward needs.
int64_t layernorm_backward_workspace(int64_t rows, int64_t cols);
// dx: (rows, cols) = the row formula of Backend::layernorm_backward; dgamma, dbeta:
// (cols) += column sums of dy * xhat and dy, in double and reduced deterministically:
// per (column tile, row chunk) partial sums into the workspace, then one pass over the
// chunks in order, rounded once. dx may alias dy or x (the parameter gradients are
// computed first).
void layernorm_backward(const float* dy, const float* x, const float* gamma, const float* mean, const float* rstd,
                        float* dx, float* dgamma, float* dbeta, int64_t rows, int64_t cols, double* workspace,
                        cudaStream_t stream);
void layernorm_backward(const double* dy, const double* x, const double* gamma, const double* mean,
                        const double* rstd, double* dx, double* dgamma, double* dbeta, int64_t rows, int64_t cols,
                        double* workspace, cudaStream_t stream);

// In place on scores: (rows, seq), row r being query position t = r % seq, scores
// already scaled by 1/sqrt(D) (the alpha of the q k^T product):
//   p[r, s] = softmax_s(scores[r, s]) over s <= t, 0 for s > t.
void causal_softmax(float* scores, int64_t rows, int64_t seq, cudaStream_t stream);
void causal_softmax(double* scores, int64_t rows, int64_t seq, cudaStream_t stream);
// In place on dprobs: (rows, seq), same row convention, probs from causal_softmax:
//   dscores[r, s] = probs[r, s] * (dprobs[r, s] - sum_s' dprobs[r, s'] probs[r, s'])
// for s <= t, 0 for s > t (the gradient with respect to the scaled scores).
void causal_softmax_backward(const float* probs, float* dprobs, int64_t rows, int64_t seq, cudaStream_t stream);
void causal_softmax_backward(const double* probs, double* dprobs, int64_t rows, int64_t seq,
                             cudaStream_t stream);

// A dropout mask's key as a kernel takes it (Backend's DropoutKey): `key`, or with
// `step` (the step's scalars on the device, kernels/step_scalars.h) mixed_key(base,
// multiplier, step[kStepIndex]), read when the kernel runs.
struct DropoutKeyArgs {
  uint64_t key = 0;
  uint64_t base = 0, multiplier = 0;
  const double* step = nullptr;
};
// Inverted dropout, the mask of Backend::dropout: x, y: (rows, per_row); element e of
// row i is kept iff double(philox_uniform(key, sample_offset + i, element_offset + e))
// >= p, and kept values are multiplied by T(1 / (1 - p)); p == 0 copies. Bit for bit
// the CPU reference's output. p in [0, 1), sample_offset, element_offset >= 0 (the
// caller checks). y may alias x.
void dropout(const float* x, float* y, int64_t rows, int64_t per_row, double p, const DropoutKeyArgs& key,
             int64_t sample_offset, int64_t element_offset, cudaStream_t stream);
void dropout(const double* x, double* y, int64_t rows, int64_t per_row, double p, const DropoutKeyArgs& key,
             int64_t sample_offset, int64_t element_offset, cudaStream_t stream);

}  // namespace cuda
}  // namespace gpipe
