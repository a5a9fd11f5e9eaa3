// The gated delta rule's recurrence on a GPU, all tokens of a step in one
// kernel (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks"). The
// per-token ops graph (shim.cc) launches a dozen kernels per token and
// layer; this one launches one per layer and step. mlx_lm runs a Metal
// kernel of the same recurrence on Apple GPUs (`models/gated_delta.py`);
// the code here is our own.
//
// One thread per (row, value head, value feature): it keeps its row of the
// state, `[k_dim]` floats, in registers and walks the tokens in order. Rows
// of the state are independent, so no reduction crosses threads.
//
// Inputs:
//   q, k     [B, T, HK, DK]   normalized (q also scaled), compute dtype
//   v        [B, T, HV, DV]   compute dtype
//   decay    float32 [B, T, HV]
//   beta     float32 [B, T, HV]
//   state_in float32 [B, HV, DV, DK]
// Outputs:
//   y         [B, T, HV, DV]  compute dtype
//   state_out float32 [B, HV, DV, DK]
//
// As with the paged-attention kernel: CUDA through `fast::cuda_kernel`
// (compiled by NVRTC, cached by MLX); Metal through `fast::metal_kernel`,
// compiled on a Mac only.
#include "mlxcel-mlx/include/shim.h"

#include <stdexcept>
#include <string>

namespace mx = mlx::core;

namespace mlxcel {
namespace {

#if defined(__APPLE__)
const char* kSource = R"(
  uint n = threadgroup_position_in_grid.x;
  uint dv = thread_position_in_threadgroup.x;
  int b = n / HV;
  int hv = n % HV;
  int hk = hv / (HV / HK);
  int steps = q_shape[1];
  float s[DK];
  size_t sbase = (size_t(n) * DV + dv) * DK;
  for (int i = 0; i < DK; ++i) s[i] = state_in[sbase + i];
  for (int t = 0; t < steps; ++t) {
    size_t qk = ((size_t(b) * steps + t) * HK + hk) * DK;
    size_t at = (size_t(b) * steps + t) * HV + hv;
    float g = decay[at];
    float bt = beta[at];
    float kv = 0.0f;
    for (int i = 0; i < DK; ++i) {
      s[i] *= g;
      kv += s[i] * float(k[qk + i]);
    }
    float delta = (float(v[at * DV + dv]) - kv) * bt;
    float out = 0.0f;
    for (int i = 0; i < DK; ++i) {
      s[i] += float(k[qk + i]) * delta;
      out += s[i] * float(q[qk + i]);
    }
    y[at * DV + dv] = InT(out);
  }
  for (int i = 0; i < DK; ++i) state_out[sbase + i] = s[i];
)";
#else
const char* kSource = R"(
  const int n = blockIdx.x;
  const int dv = threadIdx.x;
  const int b = n / HV;
  const int hv = n % HV;
  const int hk = hv / (HV / HK);
  const int steps = q_shape[1];
  float s[DK];
  const size_t sbase = ((size_t)n * DV + dv) * DK;
#pragma unroll
  for (int i = 0; i < DK; ++i) s[i] = state_in[sbase + i];
  for (int t = 0; t < steps; ++t) {
    const size_t qk = (((size_t)b * steps + t) * HK + hk) * DK;
    const size_t at = ((size_t)b * steps + t) * HV + hv;
    const float g = decay[at];
    const float bt = beta[at];
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < DK; ++i) {
      s[i] *= g;
      kv += s[i] * static_cast<float>(k[qk + i]);
    }
    const float delta = (static_cast<float>(v[at * DV + dv]) - kv) * bt;
    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < DK; ++i) {
      s[i] += static_cast<float>(k[qk + i]) * delta;
      out += s[i] * static_cast<float>(q[qk + i]);
    }
    y[at * DV + dv] = static_cast<InT>(out);
  }
#pragma unroll
  for (int i = 0; i < DK; ++i) state_out[sbase + i] = s[i];
)";
#endif

const mx::fast::CustomKernelFunction& kernel() {
  static const auto* k = new mx::fast::CustomKernelFunction(
      gpu_custom_kernel("mlxcel_gated_delta", {"q", "k", "v", "decay", "beta", "state_in"},
                        {"y", "state_out"}, kSource));
  return *k;
}

}  // namespace

bool gated_delta_kernel_fits(int k_dim, int v_dim) {
  return k_dim >= 1 && k_dim <= 256 && v_dim >= 1 && v_dim <= 1024 && gpu_kernels_usable();
}

std::vector<array> gated_delta_kernel(const array& q, const array& k, const array& v,
                                      const array& decay, const array& beta,
                                      const array& state) {
  const int b = q.shape(0), hk = q.shape(2), dk = q.shape(3);
  const int hv = v.shape(2), dv = v.shape(3);
  if (state.dtype() != mx::float32 || decay.dtype() != mx::float32 ||
      beta.dtype() != mx::float32 || state.shape() != mx::Shape{b, hv, dv, dk}) {
    throw std::invalid_argument("[gated_delta_kernel] inputs do not match");
  }
  return kernel()({q, k, v, decay, beta, state}, {v.shape(), state.shape()},
                  {q.dtype(), mx::float32}, {b * hv * dv, 1, 1}, {dv, 1, 1},
                  {{"InT", q.dtype()}, {"DK", dk}, {"DV", dv}, {"HK", hk}, {"HV", hv}},
                  std::nullopt, false, {});
}

}  // namespace mlxcel
