// Implementation of the cxx shim over MLX. See include/shim.h.
#include "mlxcel-mlx/include/shim.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <variant>

namespace mx = mlx::core;

namespace mlxcel {
namespace {

mx::Shape to_shape(rust::Slice<const int32_t> s) { return mx::Shape(s.begin(), s.end()); }

ArrayPtr wrap(array a) { return std::make_unique<array>(std::move(a)); }

// Dtype codes shared with the Rust `Dtype` enum (crates/mlx/src/dtype.rs).
mx::Dtype dtype_from_code(int32_t c) {
  switch (c) {
    case 0: return mx::bool_;
    case 1: return mx::uint8;
    case 2: return mx::uint16;
    case 3: return mx::uint32;
    case 4: return mx::uint64;
    case 5: return mx::int8;
    case 6: return mx::int16;
    case 7: return mx::int32;
    case 8: return mx::int64;
    case 9: return mx::float16;
    case 10: return mx::float32;
    case 11: return mx::float64;
    case 12: return mx::bfloat16;
    case 13: return mx::complex64;
    default: throw std::invalid_argument("[mlxcel] unknown dtype code " + std::to_string(c));
  }
}

std::vector<int> to_ints(rust::Slice<const int32_t> s) { return std::vector<int>(s.begin(), s.end()); }

}  // namespace

ArrayPtr from_f32(rust::Slice<const float> data, rust::Slice<const int32_t> shape) {
  auto sh = to_shape(shape);
  return wrap(array(data.data(), sh, mx::float32));
}
ArrayPtr from_i32(rust::Slice<const int32_t> data, rust::Slice<const int32_t> shape) {
  auto sh = to_shape(shape);
  return wrap(array(data.data(), sh, mx::int32));
}
ArrayPtr from_u32(rust::Slice<const uint32_t> data, rust::Slice<const int32_t> shape) {
  auto sh = to_shape(shape);
  return wrap(array(data.data(), sh, mx::uint32));
}
// Raw bytes (the machine's byte order) as an array of `dtype` (a byte
// copy, then MLX's `view`: no conversion).
ArrayPtr from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, int32_t dtype) {
  auto dt = dtype_from_code(dtype);
  auto sh = to_shape(shape);
  size_t n = dt.size();
  for (auto d : sh) n *= static_cast<size_t>(d);
  if (n != data.size()) {
    throw std::invalid_argument("from_bytes: " + std::to_string(data.size()) + " bytes for " +
                                std::to_string(n));
  }
  // The bytes as uint8 of `shape` with its last axis widened by the
  // element size (every axis stays within int32), then viewed as `dtype`.
  if (sh.empty()) {
    array bytes(data.data(), mx::Shape{static_cast<int32_t>(n)}, mx::uint8);
    return wrap(mx::reshape(mx::view(bytes, dt), sh));
  }
  mx::Shape wide = sh;
  int64_t last = static_cast<int64_t>(wide.back()) * static_cast<int64_t>(dt.size());
  if (last > INT32_MAX) {
    throw std::invalid_argument("from_bytes: last axis of " + std::to_string(last) + " bytes");
  }
  wide.back() = static_cast<int32_t>(last);
  array bytes(data.data(), wide, mx::uint8);
  return wrap(mx::view(bytes, dt));
}
// The bytes of `a`, row-major, into `out` (exactly `a.nbytes()` long).
void copy_bytes(const array& a, rust::Slice<uint8_t> out) {
  array c = mx::contiguous(a);
  c.eval();
  if (c.nbytes() != out.size()) {
    throw std::invalid_argument("copy_bytes: " + std::to_string(c.nbytes()) + " bytes into " +
                                std::to_string(out.size()));
  }
  std::memcpy(out.data(), c.data<uint8_t>(), out.size());
}
ArrayPtr scalar_f32(float v) { return wrap(array(v)); }
ArrayPtr clone_array(const array& a) { return wrap(a); }

rust::Vec<int32_t> shape(const array& a) {
  rust::Vec<int32_t> out;
  for (auto d : a.shape()) out.push_back(d);
  return out;
}

int32_t dtype_code(const array& a) {
  return static_cast<int32_t>(a.dtype().val());
}

size_t nbytes(const array& a) { return a.nbytes(); }
size_t buffer_bytes(const array& a) {
  array b = a;
  mx::eval(b);
  return b.buffer_size();
}

template <typename T>
static rust::Vec<T> to_vec(const array& a, mx::Dtype dt) {
  array c = mx::contiguous(mx::astype(a, dt));
  c.eval();
  rust::Vec<T> out;
  out.reserve(c.size());
  const T* p = c.data<T>();
  for (size_t i = 0; i < c.size(); ++i) out.push_back(p[i]);
  return out;
}
rust::Vec<float> to_f32_vec(const array& a) { return to_vec<float>(a, mx::float32); }
rust::Vec<int32_t> to_i32_vec(const array& a) { return to_vec<int32_t>(a, mx::int32); }
rust::Vec<uint32_t> to_u32_vec(const array& a) { return to_vec<uint32_t>(a, mx::uint32); }

std::unique_ptr<ArrayList> new_array_list() { return std::make_unique<ArrayList>(); }
size_t array_list_len(const ArrayList& list) { return list.items.size(); }
ArrayPtr array_list_get(const ArrayList& list, size_t i) {
  if (i >= list.items.size()) {
    throw std::out_of_range("array list index " + std::to_string(i) + " of " +
                            std::to_string(list.items.size()));
  }
  return wrap(list.items[i]);
}
void array_list_push(ArrayList& list, const array& a) { list.items.push_back(a); }

void eval_one(const array& a) { mx::eval({a}); }
void eval_many(const ArrayList& arrays) { mx::eval(arrays.items); }
void async_eval_many(const ArrayList& arrays) { mx::async_eval(arrays.items); }

ArrayPtr astype(const array& a, int32_t dtype) { return wrap(mx::astype(a, dtype_from_code(dtype))); }
ArrayPtr add(const array& a, const array& b) { return wrap(mx::add(a, b)); }
ArrayPtr subtract(const array& a, const array& b) { return wrap(mx::subtract(a, b)); }
ArrayPtr multiply(const array& a, const array& b) { return wrap(mx::multiply(a, b)); }
ArrayPtr divide(const array& a, const array& b) { return wrap(mx::divide(a, b)); }
ArrayPtr minimum(const array& a, const array& b) { return wrap(mx::minimum(a, b)); }

namespace {
// gpt-oss's clamped SwiGLU; inputs: gate, up, their biases, alpha, limit, 1
// (the scalars in the compute dtype).
std::vector<array> clamped_swiglu_graph(const std::vector<array>& in) {
  const auto& limit = in[5];
  auto g = mx::minimum(mx::add(in[0], in[2]), limit);
  auto u = mx::clip(mx::add(in[1], in[3]), mx::negative(limit), limit);
  auto glu = mx::multiply(g, mx::sigmoid(mx::multiply(in[4], g)));
  return {mx::multiply(mx::add(u, in[6]), glu)};
}
}  // namespace

namespace {
// SwiGLU's gate times up: silu(g) * u; inputs: gate, up.
std::vector<array> swiglu_graph(const std::vector<array>& in) {
  return {mx::multiply(mx::multiply(in[0], mx::sigmoid(in[0])), in[1])};
}

// GeGLU (tanh GELU) gate times up; inputs: gate, up, then 0.044715,
// sqrt(2/pi), 1 and 0.5 in the compute dtype. The order of operations is
// the one `Array::gelu_tanh` had as separate ops.
std::vector<array> geglu_tanh_graph(const std::vector<array>& in) {
  const auto& x = in[0];
  auto cube = mx::multiply(mx::multiply(x, x), x);
  auto inner = mx::multiply(mx::add(x, mx::multiply(cube, in[2])), in[3]);
  auto gate = mx::add(mx::tanh(inner), in[4]);
  auto act = mx::multiply(mx::multiply(x, in[5]), gate);
  return {mx::multiply(act, in[1])};
}

// `graph` as one compiled (fused, shapeless) function on a GPU; the plain
// ops on the CPU, where MLX's compiled kernels need a compiler at run time.
ArrayPtr run_fused(std::vector<array> (*graph)(const std::vector<array>&),
                   const std::function<std::vector<array>(const std::vector<array>&)>& fused,
                   const std::vector<array>& in) {
  if (mx::default_device().type == mx::Device::gpu) {
    return wrap(fused(in)[0]);
  }
  return wrap(graph(in)[0]);
}
}  // namespace

ArrayPtr swiglu(const array& gate, const array& up) {
  static const auto fused = mx::compile(swiglu_graph, /*shapeless=*/true);
  return run_fused(swiglu_graph, fused, {gate, up});
}

ArrayPtr geglu_tanh(const array& gate, const array& up) {
  static const auto fused = mx::compile(geglu_tanh_graph, /*shapeless=*/true);
  const auto t = gate.dtype();
  return run_fused(geglu_tanh_graph, fused,
                   {gate, up, mx::array(0.044715f, t),
                    mx::array(std::sqrt(2.0f / 3.14159265358979323846f), t), mx::array(1.0f, t),
                    mx::array(0.5f, t)});
}

ArrayPtr clamped_swiglu(const array& gate, const array& up, const array& gate_bias,
                        const array& up_bias, float alpha, float limit) {
  const auto t = gate.dtype();
  std::vector<array> in = {gate, up, gate_bias, up_bias, mx::array(alpha, t), mx::array(limit, t),
                           mx::array(1.0f, t)};
  // One fused kernel on a GPU (as mlx_lm compiles it); plain ops on the
  // CPU, where MLX's compiled kernels would need a compiler at run time.
  if (mx::default_device().type == mx::Device::gpu) {
    static const auto fused = mx::compile(clamped_swiglu_graph, /*shapeless=*/true);
    return wrap(fused(in)[0]);
  }
  return wrap(clamped_swiglu_graph(in)[0]);
}
ArrayPtr maximum(const array& a, const array& b) { return wrap(mx::maximum(a, b)); }
ArrayPtr sigmoid(const array& a) { return wrap(mx::sigmoid(a)); }
ArrayPtr tanh(const array& a) { return wrap(mx::tanh(a)); }
ArrayPtr matmul(const array& a, const array& b) { return wrap(mx::matmul(a, b)); }
ArrayPtr reshape(const array& a, rust::Slice<const int32_t> shape) {
  return wrap(mx::reshape(a, to_shape(shape)));
}
ArrayPtr transpose(const array& a, rust::Slice<const int32_t> axes) {
  return wrap(mx::transpose(a, to_ints(axes)));
}
ArrayPtr contiguous(const array& a) { return wrap(mx::contiguous(a)); }
ArrayPtr softmax(const array& a, int32_t axis) { return wrap(mx::softmax(a, axis, /*precise=*/true)); }
ArrayPtr argmax(const array& a, int32_t axis, bool keepdims) {
  return wrap(mx::argmax(a, axis, keepdims));
}
ArrayPtr take(const array& a, const array& indices, int32_t axis) {
  return wrap(mx::take(a, indices, axis));
}
ArrayPtr take_along_axis(const array& a, const array& indices, int32_t axis) {
  return wrap(mx::take_along_axis(a, indices, axis));
}
ArrayPtr argpartition(const array& a, int32_t kth, int32_t axis) {
  return wrap(mx::argpartition(a, kth, axis));
}
ArrayPtr argsort(const array& a, int32_t axis) { return wrap(mx::argsort(a, axis)); }
ArrayPtr sum_axis(const array& a, int32_t axis, bool keepdims) {
  return wrap(mx::sum(a, axis, keepdims));
}
ArrayPtr floor_divide(const array& a, const array& b) { return wrap(mx::floor_divide(a, b)); }
ArrayPtr gather_mm(const array& a, const array& b, const array& rhs_indices, bool sorted) {
  return wrap(mx::gather_mm(a, b, std::nullopt, rhs_indices, sorted));
}
ArrayPtr gather_qmm(const array& x, const array& w, const array& scales, const array& biases,
                    const array& rhs_indices, int32_t group_size, int32_t bits, bool sorted) {
  return wrap(mx::gather_qmm(x, w, scales, biases, std::nullopt, rhs_indices, /*transpose=*/true,
                             group_size, bits, "affine", std::nullopt, sorted));
}
ArrayPtr concatenate(const ArrayList& arrays, int32_t axis) {
  return wrap(mx::concatenate(arrays.items, axis));
}
ArrayPtr slice(const array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop) {
  return wrap(mx::slice(a, to_shape(start), to_shape(stop)));
}
ArrayPtr slice_update(const array& src, const array& update, rust::Slice<const int32_t> start,
                      rust::Slice<const int32_t> stop) {
  return wrap(mx::slice_update(src, update, to_shape(start), to_shape(stop)));
}
ArrayPtr zeros(rust::Slice<const int32_t> shape, int32_t dtype) {
  return wrap(mx::zeros(to_shape(shape), dtype_from_code(dtype)));
}
ArrayPtr quantized_matmul(const array& x, const array& w, const array& scales, const array& biases,
                          bool transpose, int32_t group_size, int32_t bits) {
  return wrap(mx::quantized_matmul(x, w, scales, biases, transpose, group_size, bits, "affine"));
}
std::unique_ptr<ArrayList> quantize(const array& w, int32_t group_size, int32_t bits) {
  auto out = std::make_unique<ArrayList>();
  out->items = mx::quantize(w, group_size, bits, "affine");
  return out;
}
ArrayPtr dequantize(const array& w, const array& scales, const array& biases, int32_t group_size,
                    int32_t bits) {
  return wrap(mx::dequantize(w, scales, biases, group_size, bits, "affine"));
}

ArrayPtr put_along_axis(const array& a, const array& indices, const array& values, int32_t axis) {
  return wrap(mx::put_along_axis(a, indices, values, axis));
}

ArrayPtr linalg_inv(const array& a) {
  return wrap(mx::linalg::inv(a, mx::Device(mx::Device::cpu)));
}

ArrayPtr rms_norm(const array& x, const array& weight, float eps) {
  return wrap(mx::fast::rms_norm(x, weight, eps));
}
ArrayPtr depthwise_conv1d(const array& x, const array& weight) {
  // x [batch, length, channels], weight [channels, kernel, 1]: one filter
  // per channel, no padding (the caller prepends the kernel - 1 inputs).
  return wrap(mx::conv1d(x, weight, 1, 0, 1, x.shape(-1)));
}

std::unique_ptr<ArrayList> gated_delta(const array& q, const array& k, const array& v, const array& a,
                                       const array& b, const array& a_log, const array& dt_bias,
                                       const array& state) {
  // Gated delta rule (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks"),
  // token by token: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; a, b [B, T, Hv];
  // a_log, dt_bias [Hv]; state [B, Hv, Dv, Dk] float32. Returns y [B, T, Hv,
  // Dv] in q's dtype and the state after the T tokens.
  const int T = q.shape(1), hk = q.shape(2), dk = q.shape(3), hv = v.shape(2);
  if (T < 1 || hk < 1 || hv % hk != 0 || state.ndim() != 4) {
    throw std::invalid_argument("[gated_delta] bad shapes");
  }
  // L2-normalize q and k; q also carries the Dk^-1/2 readout scale.
  const float inv = 1.0f / std::sqrt(static_cast<float>(dk));
  const float eps = 1e-6f * inv * inv;
  auto qn = mx::multiply(mx::array(inv * inv, q.dtype()), mx::fast::rms_norm(q, std::nullopt, eps));
  auto kn = mx::multiply(mx::array(inv, k.dtype()), mx::fast::rms_norm(k, std::nullopt, eps));
  auto beta = mx::sigmoid(b);
  auto decay = mx::exp(mx::multiply(mx::negative(mx::exp(mx::astype(a_log, mx::float32))),
                                    mx::logaddexp(mx::add(a, dt_bias), mx::array(0.0f, a.dtype()))));
  if (gated_delta_kernel_fits(dk, v.shape(3))) {
    // One kernel for every token (gated_delta.cc).
    auto out = gated_delta_kernel(qn, kn, v, decay, mx::astype(beta, mx::float32),
                                  mx::astype(state, mx::float32));
    auto list = std::make_unique<ArrayList>();
    list->items = std::move(out);
    return list;
  }
  if (hv > hk) {
    qn = mx::repeat(qn, hv / hk, 2);
    kn = mx::repeat(kn, hv / hk, 2);
  }
  auto s = state;
  std::vector<array> ys;
  ys.reserve(T);
  for (int t = 0; t < T; ++t) {
    auto at = [t](const array& x) { return mx::take(x, t, 1); };
    auto qt = at(qn), kt = at(kn), vt = at(v), gt = at(decay), bt = at(beta);
    s = mx::multiply(s, mx::expand_dims(gt, {-2, -1}));
    auto k_row = mx::expand_dims(kt, -2);  // [B, Hv, 1, Dk]
    auto kv_mem = mx::sum(mx::multiply(s, k_row), -1);  // [B, Hv, Dv]
    auto delta = mx::multiply(mx::subtract(vt, kv_mem), mx::expand_dims(bt, -1));
    s = mx::add(s, mx::multiply(k_row, mx::expand_dims(delta, -1)));
    auto y = mx::sum(mx::multiply(s, mx::expand_dims(qt, -2)), -1);
    ys.push_back(mx::astype(y, q.dtype()));
  }
  auto out = std::make_unique<ArrayList>();
  out->items.push_back(mx::stack(ys, 1));
  out->items.push_back(s);
  return out;
}

ArrayPtr gated_rms_norm(const array& x, const array& gate, const array& weight, float eps) {
  // RMSNorm of x times SiLU(gate), computed in float32 (mlx_lm's
  // precise_swiglu), back to x's dtype.
  auto n = mx::astype(mx::fast::rms_norm(x, weight, eps), mx::float32);
  auto g = mx::astype(gate, mx::float32);
  return wrap(mx::astype(mx::multiply(mx::multiply(g, mx::sigmoid(g)), n), x.dtype()));
}

ArrayPtr rope(const array& x, int32_t dims, bool traditional, float base, float scale, int32_t offset) {
  return wrap(mx::fast::rope(x, dims, traditional, base, scale, offset));
}
ArrayPtr rope_positions(const array& x, int32_t dims, bool traditional, float base, float scale,
                        const array& offsets) {
  return wrap(mx::fast::rope(x, dims, traditional, base, scale, offsets));
}
ArrayPtr rope_freqs_positions(const array& x, int32_t dims, bool traditional, float scale,
                              const array& offsets, const array& freqs) {
  return wrap(mx::fast::rope(x, dims, traditional, std::nullopt, scale, offsets, freqs));
}
ArrayPtr rope_freqs(const array& x, int32_t dims, bool traditional, float scale, int32_t offset,
                    const array& freqs) {
  return wrap(mx::fast::rope(x, dims, traditional, std::nullopt, scale, offset, freqs));
}
ArrayPtr sdpa(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode) {
  return wrap(mx::fast::scaled_dot_product_attention(q, k, v, scale, std::string(mask_mode)));
}
ArrayPtr sdpa_masked(const array& q, const array& k, const array& v, float scale, const array& mask) {
  return wrap(mx::fast::scaled_dot_product_attention(q, k, v, scale, "array", mask));
}
ArrayPtr sdpa_sinks(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode,
                    const array& sinks) {
  return wrap(
      mx::fast::scaled_dot_product_attention(q, k, v, scale, std::string(mask_mode), {}, sinks));
}
ArrayPtr sdpa_masked_sinks(const array& q, const array& k, const array& v, float scale,
                           const array& mask, const array& sinks) {
  return wrap(mx::fast::scaled_dot_product_attention(q, k, v, scale, "array", mask, sinks));
}

std::unique_ptr<TensorMap> load_safetensors(rust::Str path) {
  auto [tensors, metadata] = mx::load_safetensors(std::string(path));
  auto m = std::make_unique<TensorMap>();
  m->tensors = std::move(tensors);
  m->metadata = std::move(metadata);
  return m;
}
// The tensors of a GGUF file (MLX's reader; the metadata is read in Rust,
// crates/model/src/gguf). Q4_0, Q4_1, Q4_K and Q8_0 come back as MLX affine
// quantized triples (`name.weight`, `name.scales`, `name.biases`, group size
// 32); F32/F16 as they are; other types MLX dequantizes to float16.
std::unique_ptr<TensorMap> load_gguf_tensors(rust::Str path) {
  auto loaded = mx::load_gguf(std::string(path));
  auto m = std::make_unique<TensorMap>();
  m->tensors = std::move(loaded.first);
  return m;
}
rust::Vec<rust::String> tensor_names(const TensorMap& m) {
  rust::Vec<rust::String> out;
  for (auto& kv : m.tensors) out.push_back(rust::String(kv.first));
  return out;
}
ArrayPtr tensor_take(TensorMap& m, rust::Str name) {
  auto it = m.tensors.find(std::string(name));
  if (it == m.tensors.end()) throw std::out_of_range("no tensor named " + std::string(name));
  auto a = wrap(it->second);
  m.tensors.erase(it);
  return a;
}
void save_safetensors(rust::Str path, rust::Slice<const rust::String> names, const ArrayList& arrays) {
  if (names.size() != arrays.items.size()) throw std::invalid_argument("names/arrays length mismatch");
  std::unordered_map<std::string, array> m;
  for (size_t i = 0; i < names.size(); ++i) m.insert({std::string(names[i]), arrays.items[i]});
  mx::save_safetensors(std::string(path), m);
}

bool gpu_available() { return mx::is_available(mx::Device(mx::Device::gpu)); }
// MLX's CUDA backend reads MLX_CUDA_USE_CUDNN_SDPA once, at the first
// attention it evaluates; a value the user already set wins.
void set_cudnn_attention(bool enabled) { setenv("MLX_CUDA_USE_CUDNN_SDPA", enabled ? "1" : "0", 0); }
// MLX's CUDA backend reads MLX_PTX_CACHE_DIR once, at its first kernel
// compilation; a value the user already set wins.
void set_kernel_cache_dir(rust::Str dir) { setenv("MLX_PTX_CACHE_DIR", std::string(dir).c_str(), 0); }
void use_device(bool gpu) { mx::set_default_device(gpu ? mx::Device(mx::Device::gpu) : mx::Device(mx::Device::cpu)); }
bool default_device_is_gpu() { return mx::default_device().type == mx::Device::gpu; }
rust::String version() { return rust::String(mx::version()); }
// "<device_name> (<architecture>)" from MLX's device_info, the parts it has.
rust::String device_name(bool gpu) {
  // A CPU-only build describes its missing GPU with an empty map.
  if (gpu && !gpu_available()) throw std::runtime_error("this MLX build has no GPU backend here");
  const auto& info = mx::device_info(gpu ? mx::Device(mx::Device::gpu) : mx::Device(mx::Device::cpu));
  auto text = [&](const char* key) -> std::string {
    auto it = info.find(key);
    if (it == info.end()) return {};
    const auto* s = std::get_if<std::string>(&it->second);
    return s ? *s : std::string();
  };
  std::string name = text("device_name");
  std::string arch = text("architecture");
  if (name.empty()) return rust::String(arch);
  if (!arch.empty()) name += " (" + arch + ")";
  return rust::String(name);
}

}  // namespace mlxcel
