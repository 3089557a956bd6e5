// The prepacked layers' product as a native torch op: angelspec_native::packed_linear.
//
// Built at run time by angelspec.models.few_rows (the machine's C++ compiler, against the headers of the torch that
// runs it). Why native: a layer's product over a few rows takes 10-30 us here, and an op implemented in Python costs
// about as much again per call in dispatch and interpreter time (19 such calls a forward on the embedded target).
// The same logic in Python (`models.linear._packed_linear`) is the fallback where this library cannot be built.
//
// packed_linear(x, weight, bias, key): y = x W^T (+ b). `key` (a 0-d int64 tensor the module carries) names the
// module's copies of its weight, kept here and checked against the weight at every call (data pointer, version
// counter, sizes, strides; the weight is held, so its memory cannot be reused while a copy lives): a stale copy is
// made again, a weight no copy can serve (another dtype, an inference tensor) is multiplied as it is. Products of up
// to `rows_per_thread` x threads rows go to the few-rows kernel (few_rows.c) on a row-major copy, larger ones to
// oneDNN's prepacked product on a copy reordered for `kPackRows` rows, or, in a torch without oneDNN, to the weight
// as it is.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

extern "C" {
#include "few_rows.c"
#include "cached_attention.c"  // (after few_rows.c: it uses its hsum)
}

namespace {

constexpr int64_t kPackRows = 8;  // the row count oneDNN's copy is laid out for (any count from 2 up uses it)

struct Pack {
  at::Tensor source;  // the weight the copies were made from (held: see above)
  const void* ptr = nullptr;
  int64_t version = 0;
  std::vector<int64_t> sizes, strides;
  at::Tensor rows;    // row-major copy for the kernel, made at its first product
  at::Tensor packed;  // oneDNN's copy, made at its first product
};

std::mutex registry_lock;
std::unordered_map<int64_t, Pack> registry;
int64_t rows_per_thread = 0;  // set by `configure`; 0: every product past one row goes to oneDNN

int kernel_threads() {
#ifdef _OPENMP
  return at::get_num_threads();
#else
  return 1;
#endif
}

bool is_transposed(const at::Tensor& w) {
  return w.dim() == 2 && w.size(0) > 1 && w.size(1) > 1 && w.stride(0) == 1 && w.stride(1) >= w.size(0);
}

// `models.linear.linear`: x @ W^T straight from a stored transpose, else F.linear.
at::Tensor plain_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (!is_transposed(w)) return at::linear(x, w, b);
  at::Tensor y = at::matmul(x, w.t());
  return b.has_value() && b->defined() ? y + *b : y;
}

const c10::OperatorHandle* onednn_op(const char* name) {
  auto op = c10::Dispatcher::singleton().findSchema({name, ""});
  return op.has_value() ? new c10::OperatorHandle(*op) : nullptr;  // (kept for the process's life)
}

at::Tensor call_boxed(const c10::OperatorHandle* op, std::vector<c10::IValue> stack) {
  op->callBoxed(&stack);
  return stack.at(0).toTensor();
}

at::Tensor kernel_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  const int64_t k = x.size(-1), n = w.size(0), m = x.numel() / k;
  at::Tensor x2 = x.reshape({m, k}).contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  at::Tensor bc = b.has_value() && b->defined() ? b->contiguous() : at::Tensor();
  few_rows_linear(x2.data_ptr<float>(), m, k, w.data_ptr<float>(), n, bc.defined() ? bc.data_ptr<float>() : nullptr,
                  y.data_ptr<float>(), kernel_threads());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return y.view(shape);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const at::Tensor& key) {
  static const c10::OperatorHandle* reorder = onednn_op("mkldnn::_reorder_linear_weight");
  static const c10::OperatorHandle* pointwise = onednn_op("mkldnn::_linear_pointwise");
  // (the key a module carries is a CPU int64 scalar: read it directly, not through a dispatched item())
  const int64_t id = key.scalar_type() == at::kLong && key.is_cpu() && key.numel() == 1
                         ? *key.const_data_ptr<int64_t>() : key.item<int64_t>();
  at::Tensor rows, packed;
  {
    std::lock_guard<std::mutex> guard(registry_lock);
    auto it = registry.find(id);
    const bool stale = it == registry.end() || weight.is_inference() || weight.data_ptr() != it->second.ptr ||
                       weight._version() != it->second.version || weight.sizes() != at::IntArrayRef(it->second.sizes) ||
                       weight.strides() != at::IntArrayRef(it->second.strides);
    if (stale) {
      const bool packable = weight.scalar_type() == at::kFloat && weight.is_cpu() && weight.dim() == 2 &&
                            !weight.is_inference();
      if (!packable) return plain_linear(x, weight, bias);  // swapped for a weight no copy can serve
      Pack pack;
      pack.source = weight.detach();  // shares the version counter
      pack.ptr = pack.source.data_ptr();
      pack.version = pack.source._version();
      pack.sizes = pack.source.sizes().vec();
      pack.strides = pack.source.strides().vec();
      it = registry.insert_or_assign(id, std::move(pack)).first;
    }
    // (the copies are fp32: an input of another dtype gets F.linear's own answer)
    if (x.scalar_type() != at::kFloat || x.dim() == 0) return plain_linear(x, weight, bias);
    Pack& pack = it->second;
    const int64_t m = x.numel() / std::max<int64_t>(x.size(-1), 1);
    if (m <= rows_per_thread * kernel_threads()) {
      if (!pack.rows.defined()) pack.rows = pack.source.contiguous();
      rows = pack.rows;
    } else if (m > 1 && reorder != nullptr && pointwise != nullptr) {  // (one row keeps the BLAS)
      if (!pack.packed.defined()) pack.packed = call_boxed(reorder, {pack.source.contiguous(), kPackRows});
      packed = pack.packed;
    }
  }
  if (rows.defined()) return kernel_linear(x, rows, bias);
  if (!packed.defined()) return plain_linear(x, weight, bias);
  c10::List<std::optional<at::Scalar>> scalars;
  return call_boxed(pointwise, {x, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), std::string("none"),
                                scalars, c10::IValue()});
}

// y = x W^T (+ b) through the kernel alone: w [N, K] row-major fp32 (benchmarks and tests).
at::Tensor few_rows_op(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous() && x.size(-1) == weight.size(1),
              "few_rows_linear needs fp32 x [..., K] and a contiguous fp32 weight [N, K]");
  return kernel_linear(x, weight, bias);
}

// Attention of q's new positions over a KV cache (cached_attention.c): q [B, H, T, D], k / v [B, Hkv, S, D] (the
// cache's buffers, or their first S slots: the slots that may be read), start [B] int64 (each row's first new slot).
// Returns [B, H, T, D], a transposed view of a contiguous [B, T, H, D] (what the output projection reads as
// [B, T, H * D] without a copy).
at::Tensor cached_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& start,
                               double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat &&
                  k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "cached_attention needs fp32 q [B, H, T, D] and k, v [B, Hkv, S, D]");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "cached_attention: k and v must be [B, Hkv, S, D] with H a multiple of Hkv, got q ", q.sizes(), ", k ",
              k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(start.dim() == 1 && start.size(0) == B && start.scalar_type() == at::kLong,
              "cached_attention: start must be an int64 [B] tensor");
  const int64_t kv_len = k.size(2);
  TORCH_CHECK(kv_len >= 1, "cached_attention: no slots to attend over");
  at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  at::Tensor kc = k, vc = v;
  if (k.stride(3) != 1 || v.strides() != k.strides()) {
    kc = k.contiguous();
    vc = v.contiguous();
  }
  at::Tensor sc = start.contiguous();
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  const int failed = cached_attention(qc.const_data_ptr<float>(), B, H, T, D, qc.stride(0), qc.stride(1), qc.stride(2),
                                      kc.const_data_ptr<float>(), vc.const_data_ptr<float>(), Hkv, kc.stride(0),
                                      kc.stride(1), kc.stride(2), sc.const_data_ptr<int64_t>(), kv_len,
                                      static_cast<float>(scale), out.data_ptr<float>(), kernel_threads());
  TORCH_CHECK(failed == 0, "cached_attention: out of memory for its work buffers");
  return out.transpose(1, 2);
}

void configure(int64_t per_thread) { rows_per_thread = per_thread; }

void drop_pack(int64_t id) {
  std::lock_guard<std::mutex> guard(registry_lock);
  registry.erase(id);
}

// Which copies a key has: -1 no entry, else 1 for the row-major copy + 2 for oneDNN's.
int64_t pack_copies(int64_t id) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto it = registry.find(id);
  if (it == registry.end()) return -1;
  return (it->second.rows.defined() ? 1 : 0) + (it->second.packed.defined() ? 2 : 0);
}

int64_t threaded() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY(angelspec_native, m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, Tensor key) -> Tensor");
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("cached_attention(Tensor q, Tensor k, Tensor v, Tensor start, float scale) -> Tensor");
  m.def("configure(int rows_per_thread) -> ()", &configure);
  m.def("drop_pack(int key) -> ()", &drop_pack);
  m.def("pack_copies(int key) -> int", &pack_copies);
  m.def("threaded() -> int", &threaded);
}

TORCH_LIBRARY_IMPL(angelspec_native, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("few_rows_linear", &few_rows_op);
  m.impl("cached_attention", &cached_attention_op);
}
