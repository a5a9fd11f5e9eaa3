// Quantized matrix-vector products through gathered experts on a CUDA GPU:
// the decode-time shape of a mixture-of-experts layer (a few tokens, each
// through its top-k experts' affine-quantized matrices). MLX's CUDA
// `gather_qmm` runs that shape far below the GPU's memory bandwidth
// (176 us for 8 experts' 6 MB on an H200, ~34 GB/s: see
// benches/results/2026-12-02-moe-h200.md); this kernel reads each chosen
// expert's rows once, at full width. On Metal, MLX's own gathered qmv is
// used; on the CPU experts are dequantized at load.
//
// One warp per (pair, output row): lanes stride over the row's packed
// words four at a time (16-byte loads), each word's values dequantized as
// MLX's affine format stores them (value i of a word is bits [i·BITS,
// (i+1)·BITS); w = scale · q + bias per group of GS values), multiplied by
// the pair's input row, accumulated in float32 and reduced across the
// warp. Eight warps (eight rows of one pair) per block share the input
// row through the cache.
//
// Inputs:  x [P, KDIM] compute dtype; wq uint32 [E, NROWS, KDIM·BITS/32];
//          scales, biases [E, NROWS, KDIM/GS]; inds uint32 [P].
// Output:  y [P, NROWS] compute dtype.
#include "mlxcel-mlx/include/shim.h"

#if !defined(__APPLE__)
#include "mlx/backend/cuda/cuda.h"
#endif

#include <cstdlib>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

namespace mx = mlx::core;

namespace mlxcel {
namespace {

constexpr int kRowsPerBlock = 8;

#if !defined(__APPLE__)
const char* kSource = R"(
  constexpr int VPW = 32 / BITS;            // values per word
  constexpr int WPR = KDIM / VPW;              // words per row
  constexpr int CHUNKS = WPR / 4;           // 16-byte chunks per row
  constexpr int GROUPS = KDIM / GS;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int blocks_per_pair = (NROWS + ROWS - 1) / ROWS;
  const int p = blockIdx.x / blocks_per_pair;
  const int n = (blockIdx.x % blocks_per_pair) * ROWS + warp;
  if (n >= NROWS) return;
  const size_t row = (size_t)inds[p] * NROWS + n;
  const uint4* w4 = reinterpret_cast<const uint4*>(wq + row * WPR);
  const InT* xr = x + (size_t)p * KDIM;
  float acc = 0.0f;
  for (int c = lane; c < CHUNKS; c += 32) {
    const uint4 q4 = w4[c];
    const unsigned qs[4] = {q4.x, q4.y, q4.z, q4.w};
    const int first = c * 4 * VPW;          // the chunk's first value
    const int g = first / GS;
    const float s = static_cast<float>(scales[row * GROUPS + g]);
    const float b = static_cast<float>(biases[row * GROUPS + g]);
    float dot = 0.0f, xsum = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int i = 0; i < VPW; ++i) {
        const float xv = static_cast<float>(xr[first + j * VPW + i]);
        dot += xv * static_cast<float>((qs[j] >> (BITS * i)) & MASK);
        xsum += xv;
      }
    }
    acc += s * dot + b * xsum;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if (lane == 0) y[(size_t)p * NROWS + n] = static_cast<InT>(acc);
)";

const mx::fast::CustomKernelFunction& kernel() {
  static const auto* k = new mx::fast::CustomKernelFunction(mx::fast::cuda_kernel(
      "mlxcel_gather_qmv", {"x", "wq", "scales", "biases", "inds"}, {"y"}, kSource));
  return *k;
}
#endif

// `MLXCEL_GATHER_QMV=0` turns the kernel off (MLX's gather_qmm then runs
// every shape): for A/B measurements.
bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MLXCEL_GATHER_QMV");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

}  // namespace

std::optional<array> gather_qmv(const array& x, const array& w, const array& scales,
                                const array& biases, const array& indices, int group_size,
                                int bits) {
#if defined(__APPLE__)
  (void)x, (void)w, (void)scales, (void)biases, (void)indices, (void)group_size, (void)bits;
  return std::nullopt;
#else
  if (!enabled() || mx::default_device().type != mx::Device::gpu || !mx::cu::is_available()) {
    return std::nullopt;
  }
  // x [..., 1, K] against w [E, N, K·bits/32]: one input row per pair.
  if ((bits != 4 && bits != 8) || (group_size != 32 && group_size != 64 && group_size != 128) ||
      x.ndim() < 2 || x.shape(-2) != 1 || w.ndim() != 3 || w.dtype() != mx::uint32 ||
      scales.ndim() != 3 || scales.dtype() != x.dtype() || biases.dtype() != x.dtype() ||
      (x.dtype() != mx::float32 && x.dtype() != mx::bfloat16 && x.dtype() != mx::float16)) {
    return std::nullopt;
  }
  const int k = x.shape(-1), n = w.shape(1), experts = w.shape(0);
  const int per_word = 32 / bits;
  if (k % (4 * per_word) != 0 || k % group_size != 0 || w.shape(2) * per_word != k ||
      scales.shape() != mx::Shape{experts, n, k / group_size} || biases.shape() != scales.shape()) {
    return std::nullopt;
  }
  mx::Shape batch(x.shape().begin(), x.shape().end() - 2);
  batch = mx::broadcast_shapes(batch, indices.shape());
  const int pairs = std::accumulate(batch.begin(), batch.end(), 1, std::multiplies<int>());
  if (pairs < 1 || pairs > 256) {
    return std::nullopt;
  }
  mx::Shape xb_shape = batch;
  xb_shape.push_back(1);
  xb_shape.push_back(k);
  auto xb = mx::reshape(mx::contiguous(mx::broadcast_to(x, xb_shape)), {pairs, k});
  auto inds = mx::reshape(mx::contiguous(mx::astype(mx::broadcast_to(indices, batch), mx::uint32)),
                          {pairs});
  const int blocks = pairs * ((n + kRowsPerBlock - 1) / kRowsPerBlock);
  auto out = kernel()({xb, mx::contiguous(w), mx::contiguous(scales), mx::contiguous(biases), inds},
                      {{pairs, n}}, {x.dtype()}, {blocks * 32 * kRowsPerBlock, 1, 1},
                      {32 * kRowsPerBlock, 1, 1},
                      {{"InT", x.dtype()},
                       {"KDIM", k},
                       {"NROWS", n},
                       {"BITS", bits},
                       {"GS", group_size},
                       {"ROWS", kRowsPerBlock}},
                      std::nullopt, false, {});
  mx::Shape out_shape = batch;
  out_shape.push_back(1);
  out_shape.push_back(n);
  return mx::reshape(out[0], out_shape);
#endif
}

}  // namespace mlxcel
