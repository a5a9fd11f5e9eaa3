// Mamba2's selective state-space recurrence (Dao and Gu 2024,
// "Transformers are SSMs", the SSD layer), token by token. mlx_lm computes
// the same function in chunks (`models/ssm.py`, `ssm_attn`) and decodes one
// token with a Metal kernel; the code here is our own.
//
// Per head h (group g = h / (H / G)) and token t, with
//   dt = clip(softplus(dt_raw + dt_bias), dt_min, dt_max),  A = -exp(a_log):
//   S[h] = exp(A[h] dt) S[h] + dt x[h] (outer) B[g]     S[h]: [Dh, Ds]
//   y[h] = S[h] C[g] + D[h] x[h]
// On a GPU (CUDA, or Metal on a Mac) every token of a step runs in one
// kernel: one thread per (row, head, head feature) keeps its state row,
// `[Ds]` floats, in registers and walks the tokens in order; elsewhere a
// graph of a few ops per token.
#include "mlxcel-mlx/include/shim.h"

#include <stdexcept>
#include <string>

namespace mx = mlx::core;

namespace mlxcel {
namespace {

// Inputs: x [B, T, H, DH] compute dtype; dt, decay float32 [B, T, H];
// bm, cm [B, T, G, DS] compute dtype; skip float32 [H]; state_in float32
// [B, H, DH, DS]. Outputs: y [B, T, H, DH]; state_out float32.
#if defined(__APPLE__)
const char* kSource = R"(
  uint n = threadgroup_position_in_grid.x;
  uint e = thread_position_in_threadgroup.x;
  int b = n / H;
  int h = n % H;
  int g = h / (H / G);
  int steps = x_shape[1];
  float s[DS];
  size_t sbase = (size_t(n) * DH + e) * DS;
  for (int i = 0; i < DS; ++i) s[i] = state_in[sbase + i];
  float dskip = skip[h];
  for (int t = 0; t < steps; ++t) {
    size_t at = (size_t(b) * steps + t) * H + h;
    size_t bc = ((size_t(b) * steps + t) * G + g) * DS;
    float a = decay[at];
    float xv = float(x[at * DH + e]);
    float dx = dt[at] * xv;
    float out = 0.0f;
    for (int i = 0; i < DS; ++i) {
      s[i] = a * s[i] + dx * float(bm[bc + i]);
      out += s[i] * float(cm[bc + i]);
    }
    y[at * DH + e] = InT(out + dskip * xv);
  }
  for (int i = 0; i < DS; ++i) state_out[sbase + i] = s[i];
)";
#else
const char* kSource = R"(
  const int n = blockIdx.x;
  const int e = threadIdx.x;
  const int b = n / H;
  const int h = n % H;
  const int g = h / (H / G);
  const int steps = x_shape[1];
  float s[DS];
  const size_t sbase = ((size_t)n * DH + e) * DS;
#pragma unroll
  for (int i = 0; i < DS; ++i) s[i] = state_in[sbase + i];
  const float dskip = skip[h];
  for (int t = 0; t < steps; ++t) {
    const size_t at = ((size_t)b * steps + t) * H + h;
    const size_t bc = (((size_t)b * steps + t) * G + g) * DS;
    const float a = decay[at];
    const float xv = static_cast<float>(x[at * DH + e]);
    const float dx = dt[at] * xv;
    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < DS; ++i) {
      s[i] = a * s[i] + dx * static_cast<float>(bm[bc + i]);
      out += s[i] * static_cast<float>(cm[bc + i]);
    }
    y[at * DH + e] = static_cast<InT>(out + dskip * xv);
  }
#pragma unroll
  for (int i = 0; i < DS; ++i) state_out[sbase + i] = s[i];
)";
#endif

const mx::fast::CustomKernelFunction& kernel() {
  static const auto* k = new mx::fast::CustomKernelFunction(
      gpu_custom_kernel("mlxcel_ssm_scan", {"x", "dt", "decay", "bm", "cm", "skip", "state_in"},
                        {"y", "state_out"}, kSource));
  return *k;
}

bool kernel_fits(int head_dim, int state_dim) {
  return head_dim >= 1 && head_dim <= 1024 && state_dim >= 1 && state_dim <= 256 &&
         gpu_kernels_usable();
}

}  // namespace

std::unique_ptr<ArrayList> ssm_scan(const array& x, const array& dt, const array& b, const array& c,
                                    const array& a_log, const array& d, const array& dt_bias,
                                    float dt_min, float dt_max, const array& state) {
  // x [B, T, H, Dh]; dt [B, T, H] before softplus; b, c [B, T, G, Ds];
  // a_log, d, dt_bias [H]; state float32 [B, H, Dh, Ds].
  if (x.ndim() != 4 || b.ndim() != 4 || c.shape() != b.shape() || dt.ndim() != 3 ||
      state.ndim() != 4) {
    throw std::invalid_argument("[ssm_scan] bad ranks");
  }
  const int batch = x.shape(0), steps = x.shape(1), heads = x.shape(2), dh = x.shape(3);
  const int groups = b.shape(2), ds = b.shape(3);
  if (steps < 1 || groups < 1 || heads % groups != 0 ||
      dt.shape() != mx::Shape{batch, steps, heads} ||
      b.shape() != mx::Shape{batch, steps, groups, ds} ||
      state.shape() != mx::Shape{batch, heads, dh, ds}) {
    throw std::invalid_argument("[ssm_scan] shapes do not match");
  }
  auto step = mx::add(mx::astype(dt, mx::float32), mx::astype(dt_bias, mx::float32));
  step = mx::clip(mx::logaddexp(step, mx::array(0.0f)), mx::array(dt_min), mx::array(dt_max));
  auto a = mx::negative(mx::exp(mx::astype(a_log, mx::float32)));
  auto decay = mx::exp(mx::multiply(step, a));  // [B, T, H]
  auto skip = mx::astype(d, mx::float32);
  auto s = mx::astype(state, mx::float32);
  auto out = std::make_unique<ArrayList>();
  if (kernel_fits(dh, ds)) {
    out->items = kernel()({x, step, decay, b, c, skip, s}, {x.shape(), s.shape()},
                          {x.dtype(), mx::float32}, {batch * heads * dh, 1, 1}, {dh, 1, 1},
                          {{"InT", x.dtype()}, {"DH", dh}, {"DS", ds}, {"H", heads}, {"G", groups}},
                          std::nullopt, false, {});
    return out;
  }
  // Groups to heads: head h reads group h / (H / G).
  auto bh = heads == groups ? b : mx::repeat(b, heads / groups, 2);
  auto ch = heads == groups ? c : mx::repeat(c, heads / groups, 2);
  auto dx = mx::multiply(mx::expand_dims(step, -1), mx::astype(x, mx::float32));  // [B, T, H, Dh]
  auto skip_x = mx::multiply(mx::reshape(skip, {1, 1, heads, 1}), mx::astype(x, mx::float32));
  std::vector<array> ys;
  ys.reserve(steps);
  for (int t = 0; t < steps; ++t) {
    auto at = [t](const array& v) { return mx::take(v, t, 1); };
    auto input = mx::multiply(mx::expand_dims(at(dx), -1),
                              mx::expand_dims(mx::astype(at(bh), mx::float32), -2));
    s = mx::add(mx::multiply(s, mx::expand_dims(at(decay), {-2, -1})), input);
    auto y = mx::sum(mx::multiply(s, mx::expand_dims(mx::astype(at(ch), mx::float32), -2)), -1);
    ys.push_back(mx::astype(mx::add(y, at(skip_x)), x.dtype()));
  }
  out->items.push_back(mx::stack(ys, 1));
  out->items.push_back(s);
  return out;
}

}  // namespace mlxcel
