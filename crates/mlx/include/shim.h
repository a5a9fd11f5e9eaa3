// Thin C++ shim between cxx and MLX's C++ API (mlx/mlx.h).
// Every function may throw; the Rust side declares each as returning
// `Result`, so cxx turns a C++ exception into `cxx::Exception`.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

#include "mlx/mlx.h"
#include "rust/cxx.h"

namespace mlxcel {

using mlx::core::array;
using ArrayPtr = std::unique_ptr<array>;

// A list of arrays built from Rust (for eval, concatenate, save).
struct ArrayList {
  std::vector<array> items;
};

// A loaded safetensors file: name -> array (lazy until evaluated).
struct TensorMap {
  std::unordered_map<std::string, array> tensors;
  std::unordered_map<std::string, std::string> metadata;
};

// creation and inspection
ArrayPtr from_f32(rust::Slice<const float> data, rust::Slice<const int32_t> shape);
ArrayPtr from_i32(rust::Slice<const int32_t> data, rust::Slice<const int32_t> shape);
ArrayPtr from_u32(rust::Slice<const uint32_t> data, rust::Slice<const int32_t> shape);
ArrayPtr from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, int32_t dtype);
void copy_bytes(const array& a, rust::Slice<uint8_t> out);
ArrayPtr scalar_f32(float v);
ArrayPtr clone_array(const array& a);
rust::Vec<int32_t> shape(const array& a);
int32_t dtype_code(const array& a);
size_t nbytes(const array& a);
size_t buffer_bytes(const array& a);
rust::Vec<float> to_f32_vec(const array& a);
rust::Vec<int32_t> to_i32_vec(const array& a);
rust::Vec<uint32_t> to_u32_vec(const array& a);

std::unique_ptr<ArrayList> new_array_list();
void array_list_push(ArrayList& list, const array& a);
size_t array_list_len(const ArrayList& list);
ArrayPtr array_list_get(const ArrayList& list, size_t i);

// evaluation
void eval_one(const array& a);
void eval_many(const ArrayList& arrays);
void async_eval_many(const ArrayList& arrays);

// ops
ArrayPtr astype(const array& a, int32_t dtype);
ArrayPtr add(const array& a, const array& b);
ArrayPtr subtract(const array& a, const array& b);
ArrayPtr multiply(const array& a, const array& b);
ArrayPtr divide(const array& a, const array& b);
ArrayPtr minimum(const array& a, const array& b);
ArrayPtr swiglu(const array& gate, const array& up);
ArrayPtr geglu_tanh(const array& gate, const array& up);
ArrayPtr clamped_swiglu(const array& gate, const array& up, const array& gate_bias,
                        const array& up_bias, float alpha, float limit);
ArrayPtr maximum(const array& a, const array& b);
ArrayPtr sigmoid(const array& a);
ArrayPtr tanh(const array& a);
ArrayPtr matmul(const array& a, const array& b);
ArrayPtr reshape(const array& a, rust::Slice<const int32_t> shape);
ArrayPtr transpose(const array& a, rust::Slice<const int32_t> axes);
ArrayPtr contiguous(const array& a);
ArrayPtr softmax(const array& a, int32_t axis);
ArrayPtr argmax(const array& a, int32_t axis, bool keepdims);
ArrayPtr take(const array& a, const array& indices, int32_t axis);
ArrayPtr take_along_axis(const array& a, const array& indices, int32_t axis);
ArrayPtr argpartition(const array& a, int32_t kth, int32_t axis);
ArrayPtr argsort(const array& a, int32_t axis);
ArrayPtr sum_axis(const array& a, int32_t axis, bool keepdims);
ArrayPtr floor_divide(const array& a, const array& b);
ArrayPtr gather_mm(const array& a, const array& b, const array& rhs_indices, bool sorted);
ArrayPtr gather_qmm(const array& x, const array& w, const array& scales, const array& biases,
                    const array& rhs_indices, int32_t group_size, int32_t bits, bool sorted);
ArrayPtr put_along_axis(const array& a, const array& indices, const array& values, int32_t axis);
ArrayPtr concatenate(const ArrayList& arrays, int32_t axis);
ArrayPtr slice(const array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop);
ArrayPtr slice_update(const array& src, const array& update, rust::Slice<const int32_t> start,
                      rust::Slice<const int32_t> stop);
ArrayPtr zeros(rust::Slice<const int32_t> shape, int32_t dtype);
ArrayPtr quantized_matmul(const array& x, const array& w, const array& scales, const array& biases,
                          bool transpose, int32_t group_size, int32_t bits);
std::unique_ptr<ArrayList> quantize(const array& w, int32_t group_size, int32_t bits);
ArrayPtr dequantize(const array& w, const array& scales, const array& biases, int32_t group_size,
                    int32_t bits);

ArrayPtr linalg_inv(const array& a);

// fast ops
ArrayPtr rms_norm(const array& x, const array& weight, float eps);
ArrayPtr depthwise_conv1d(const array& x, const array& weight);
std::unique_ptr<ArrayList> gated_delta(const array& q, const array& k, const array& v, const array& a,
                                       const array& b, const array& a_log, const array& dt_bias,
                                       const array& state);
ArrayPtr gated_rms_norm(const array& x, const array& gate, const array& weight, float eps);
// gated_delta.cc (C++ only): the recurrence in one GPU kernel.
bool gated_delta_kernel_fits(int k_dim, int v_dim);
std::vector<array> gated_delta_kernel(const array& q, const array& k, const array& v,
                                      const array& decay, const array& beta, const array& state);
// ssm.cc: Mamba2's selective state-space recurrence.
std::unique_ptr<ArrayList> ssm_scan(const array& x, const array& dt, const array& b, const array& c,
                                    const array& a_log, const array& d, const array& dt_bias,
                                    float dt_min, float dt_max, const array& state);
ArrayPtr rope(const array& x, int32_t dims, bool traditional, float base, float scale, int32_t offset);
ArrayPtr rope_positions(const array& x, int32_t dims, bool traditional, float base, float scale,
                        const array& offsets);
ArrayPtr rope_freqs_positions(const array& x, int32_t dims, bool traditional, float scale,
                              const array& offsets, const array& freqs);
ArrayPtr rope_freqs(const array& x, int32_t dims, bool traditional, float scale, int32_t offset,
                    const array& freqs);
ArrayPtr sdpa(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode);
ArrayPtr sdpa_masked(const array& q, const array& k, const array& v, float scale, const array& mask);
ArrayPtr sdpa_sinks(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode,
                    const array& sinks);
ArrayPtr sdpa_masked_sinks(const array& q, const array& k, const array& v, float scale,
                           const array& mask, const array& sinks);
// paged_attention.cc
ArrayPtr paged_decode_attention(const array& q, const array& k_pool, const array& v_pool,
                                const array& tables, const array& meta, const array& scale,
                                int32_t block_size, int32_t window);
ArrayPtr paged_decode_attention_sinks(const array& q, const array& k_pool, const array& v_pool,
                                      const array& tables, const array& meta, const array& scale,
                                      int32_t block_size, int32_t window, const array& sinks);
ArrayPtr paged_decode_attention_quantized(const array& q, const array& k_pool,
                                          const array& k_scales, const array& k_biases,
                                          const array& v_pool, const array& v_scales,
                                          const array& v_biases, const array& tables,
                                          const array& meta, const array& scale,
                                          int32_t block_size, int32_t window, int32_t group_size,
                                          int32_t bits);
ArrayPtr paged_decode_attention_quantized_sinks(
    const array& q, const array& k_pool, const array& k_scales, const array& k_biases,
    const array& v_pool, const array& v_scales, const array& v_biases, const array& tables,
    const array& meta, const array& scale, int32_t block_size, int32_t window,
    int32_t group_size, int32_t bits, const array& sinks);
bool paged_attention_available();
// Whether the paged kernels this thread launches may split a row's keys
// into parts (the default); off, every (row, head) is one block whatever
// the batch.
void set_paged_attention_split(bool split);
// paged_attention.cc (C++ only): custom GPU kernels. Whether the default
// device is a GPU whose backend runs them; a kernel of `source` for this
// build's backend (`fast::metal_kernel` on a Mac, `fast::cuda_kernel`
// elsewhere).
bool gpu_kernels_usable();
mlx::core::fast::CustomKernelFunction gpu_custom_kernel(const std::string& name,
                                                        const std::vector<std::string>& inputs,
                                                        const std::vector<std::string>& outputs,
                                                        const std::string& source);

// io
std::unique_ptr<TensorMap> load_safetensors(rust::Str path);
std::unique_ptr<TensorMap> load_gguf_tensors(rust::Str path);
rust::Vec<rust::String> tensor_names(const TensorMap& m);
ArrayPtr tensor_take(TensorMap& m, rust::Str name);
void save_safetensors(rust::Str path, rust::Slice<const rust::String> names,
                      const ArrayList& arrays);

// device
bool gemv_forwarding_active();
int skinny_max_rows();
bool gpu_available();
void set_cudnn_attention(bool enabled);
void set_kernel_cache_dir(rust::Str dir);
void use_device(bool gpu);
bool default_device_is_gpu();
rust::String version();
rust::String device_name(bool gpu);

}  // namespace mlxcel
