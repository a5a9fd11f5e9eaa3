// Decode attention over a paged KV pool: one query token per row attends to
// that row's live keys, read straight from the pool through the row's block
// table (no gather of K/V, no padding mask). The algorithm is vLLM's
// PagedAttention v1 decode kernel (Kwon et al. 2023, "Efficient Memory
// Management for Large Language Model Serving with PagedAttention") with an
// online softmax (Milakov & Gimelshein 2018); the code is our own.
//
// One kernel source per GPU backend, behind one function:
// - CUDA (MLX's CUDA build): `fast::cuda_kernel`, compiled once by NVRTC
//   and cached by MLX;
// - Metal (macOS): `fast::metal_kernel`. It is compiled only on a Mac; this
//   project's CI and GPU runs (Linux, NVIDIA) never build or run it.
// Shapes and sizes are runtime values (array shapes), so one compiled kernel
// serves every batch and context length of a model.
//
// Inputs:
//   q       [rows, heads, head_dim]              compute dtype
//   k_pool  [slots, kv_heads, head_dim]          compute dtype
//   v_pool  [slots, kv_heads, head_dim]          compute dtype
//   tables  int32 [rows, max_blocks]             block ids, in position order
//   meta    int32 [rows, 2]                      (offset of the first live key
//                                                 in the row's first block, live keys)
//   scale   float32 [1]                          softmax scale
// Quantized pools (the `_q` variants, MLX's affine quantization: element =
// q * scale + bias, BITS 8 or 4, `32 / BITS` elements per uint32 word, the
// first in the lowest bits, one scale and bias per G elements of a head):
//   k_pool, v_pool  uint32 [slots, kv_heads, head_dim * BITS / 32]
//   k_scales, k_biases, v_scales, v_biases  [slots, kv_heads, head_dim / G]
//                                                 compute dtype
//   sinks   float32 [heads]                      (the `_sinks` variant) a
//                                                 per-head logit in the
//                                                 softmax's denominator that
//                                                 carries no value (gpt-oss's
//                                                 attention sinks)
// Output:
//   o       [rows, heads, head_dim]
// Live key t of a row sits at slot tables[row][(offset + t) / BS] * BS +
// (offset + t) % BS. With a sliding window (template WINDOW > 0, in keys), a
// row attends to its last WINDOW live keys only (0: all).
#include "mlxcel-mlx/include/shim.h"

#if defined(__APPLE__)
#include "mlx/backend/metal/metal.h"
#else
#include "mlx/backend/cuda/cuda.h"
#endif

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>

namespace mx = mlx::core;

namespace mlxcel {
namespace {

constexpr int kWarps = 4;

#if defined(__APPLE__)
// One threadgroup of kWarps simdgroups per (row, head, part): a row's live
// keys are split into `parts` contiguous ranges (the grid's size over rows
// x heads); simdgroup w takes keys w, w + 4, ... of its range with an
// online softmax, lanes split head_dim; the simdgroups merge at the end
// (@FINISH@: the output, or the part's partial sums for the merge kernel).
const char* kMetalSource = R"(
  constexpr int WARPS = 4;
  constexpr int PER = D / 32;
  @QCONSTS@
  uint group = threadgroup_position_in_grid.x;
  uint tid = thread_position_in_threadgroup.x;
  int parts = threadgroups_per_grid.x / (tables_shape[0] * HEADS);
  int part = group % parts;
  int bid = group / parts;
  int row = bid / HEADS;
  int head = bid % HEADS;
  int kvh = head / (HEADS / KV_HEADS);
  int warp = tid / 32;
  int lane = tid % 32;
  int max_blocks = tables_shape[1];
  int first = meta[row * 2];
  int len = meta[row * 2 + 1];
  if (WINDOW > 0 && len > WINDOW) { first += len - WINDOW; len = WINDOW; }
  int chunk = (len + parts - 1) / parts;
  int lo = part * chunk;
  int hi = min(len, lo + chunk);
  float sc = scale[0];
  float qv[PER];
  size_t qbase = (size_t(row) * HEADS + head) * D + lane * PER;
  for (int i = 0; i < PER; ++i) {
    qv[i] = float(q[qbase + i]) * sc;
  }
  float m = -1e30f;
  float l = 0.0f;
  float acc[PER];
  for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
  for (int t = lo + warp; t < hi; t += WARPS) {
    int p = first + t;
    size_t slot = size_t(tables[row * max_blocks + p / BS]) * BS + p % BS;
    size_t hrow = slot * KV_HEADS + kvh;
    float s = 0.0f;
    for (int i = 0; i < PER; ++i) s += qv[i] * @K@;
    s = simd_sum(s);
    float m_new = max(m, s);
    float corr = fast::exp(m - m_new);
    float e = fast::exp(s - m_new);
    l = l * corr + e;
    for (int i = 0; i < PER; ++i) acc[i] = acc[i] * corr + e * @V@;
    m = m_new;
  }
  threadgroup float sm[WARPS];
  threadgroup float sl[WARPS];
  threadgroup float sacc[WARPS * D];
  if (lane == 0) { sm[warp] = m; sl[warp] = l; }
  for (int i = 0; i < PER; ++i) sacc[warp * D + lane * PER + i] = acc[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (warp == 0) {
    float mx_ = -1e30f;
    for (int w = 0; w < WARPS; ++w) mx_ = max(mx_, sm[w]);
    @SINK_MAX@
    float total = 0.0f;
    @SINK_ADD@
    float out[PER];
    for (int i = 0; i < PER; ++i) out[i] = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
      float c = fast::exp(sm[w] - mx_);
      total += sl[w] * c;
      for (int i = 0; i < PER; ++i) out[i] += sacc[w * D + lane * PER + i] * c;
    }
    @FINISH@
  }
)";

// One simdgroup per (row, head): merges the parts' partial sums (lanes
// split head_dim), with the head's sink logit when there is one.
const char* kMetalMerge = R"(
  constexpr int PER = D / 32;
  uint bid = threadgroup_position_in_grid.x;
  uint lane = thread_position_in_threadgroup.x;
  int parts = part_ml_shape[1];
  int head = bid % HEADS;
  float mx_ = -1e30f;
  for (int p = 0; p < parts; ++p) mx_ = max(mx_, part_ml[(size_t(bid) * parts + p) * 2]);
  @SINK_MAX@
  float total = 0.0f;
  @SINK_ADD@
  float out[PER];
  for (int i = 0; i < PER; ++i) out[i] = 0.0f;
  for (int p = 0; p < parts; ++p) {
    size_t at = size_t(bid) * parts + p;
    float c = fast::exp(part_ml[at * 2] - mx_);
    total += part_ml[at * 2 + 1] * c;
    for (int i = 0; i < PER; ++i) out[i] += part_o[at * D + lane * PER + i] * c;
  }
  for (int i = 0; i < PER; ++i) o[size_t(bid) * D + lane * PER + i] = T(out[i] / total);
)";
#else
// One block of kWarps warps per (row, head, part): a row's live keys are
// split into `parts` contiguous ranges (the grid's size over rows x heads);
// warp w takes keys w, w + 4, ... of its range with an online softmax,
// lanes split head_dim; the warps merge at the end (@FINISH@: the output,
// or the part's partial sums for the merge kernel).
const char* kCudaSource = R"(
  constexpr int WARPS = 4;
  constexpr int PER = D / 32;
  @QCONSTS@
  const int parts = gridDim.x / (tables_shape[0] * HEADS);
  const int part = blockIdx.x % parts;
  const int bid = blockIdx.x / parts;
  const int row = bid / HEADS;
  const int head = bid % HEADS;
  const int kvh = head / (HEADS / KV_HEADS);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int max_blocks = tables_shape[1];
  int first = meta[row * 2];
  int len = meta[row * 2 + 1];
  if (WINDOW > 0 && len > WINDOW) { first += len - WINDOW; len = WINDOW; }
  const int chunk = (len + parts - 1) / parts;
  const int lo = part * chunk;
  const int hi = min(len, lo + chunk);
  const float sc = scale[0];
  float qv[PER];
  const size_t qbase = ((size_t)row * HEADS + head) * D + lane * PER;
#pragma unroll
  for (int i = 0; i < PER; ++i) qv[i] = static_cast<float>(q[qbase + i]) * sc;
  float m = -1e30f;
  float l = 0.0f;
  float acc[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
  for (int t = lo + warp; t < hi; t += WARPS) {
    const int p = first + t;
    const size_t slot = (size_t)tables[row * max_blocks + p / BS] * BS + p % BS;
    const size_t hrow = slot * KV_HEADS + kvh;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) s += qv[i] * @K@;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
    const float m_new = fmaxf(m, s);
    const float corr = __expf(m - m_new);
    const float e = __expf(s - m_new);
    l = l * corr + e;
#pragma unroll
    for (int i = 0; i < PER; ++i) acc[i] = acc[i] * corr + e * @V@;
    m = m_new;
  }
  __shared__ float sm[WARPS];
  __shared__ float sl[WARPS];
  __shared__ float sacc[WARPS * D];
  if (lane == 0) { sm[warp] = m; sl[warp] = l; }
#pragma unroll
  for (int i = 0; i < PER; ++i) sacc[warp * D + lane * PER + i] = acc[i];
  __syncthreads();
  if (warp == 0) {
    float mx_ = -1e30f;
    for (int w = 0; w < WARPS; ++w) mx_ = fmaxf(mx_, sm[w]);
    @SINK_MAX@
    float total = 0.0f;
    @SINK_ADD@
    float out[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) out[i] = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
      const float c = __expf(sm[w] - mx_);
      total += sl[w] * c;
#pragma unroll
      for (int i = 0; i < PER; ++i) out[i] += sacc[w * D + lane * PER + i] * c;
    }
    @FINISH@
  }
)";

// One warp per (row, head): merges the parts' partial sums (lanes split
// head_dim), with the head's sink logit when there is one.
const char* kCudaMerge = R"(
  constexpr int PER = D / 32;
  const int bid = blockIdx.x;
  const int lane = threadIdx.x;
  const int parts = part_ml_shape[1];
  const int head = bid % HEADS;
  float mx_ = -1e30f;
  for (int p = 0; p < parts; ++p) mx_ = fmaxf(mx_, part_ml[((size_t)bid * parts + p) * 2]);
  @SINK_MAX@
  float total = 0.0f;
  @SINK_ADD@
  float out[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) out[i] = 0.0f;
  for (int p = 0; p < parts; ++p) {
    const size_t at = (size_t)bid * parts + p;
    const float c = __expf(part_ml[at * 2] - mx_);
    total += part_ml[at * 2 + 1] * c;
#pragma unroll
    for (int i = 0; i < PER; ++i) out[i] += part_o[at * D + lane * PER + i] * c;
  }
#pragma unroll
  for (int i = 0; i < PER; ++i) o[(size_t)bid * D + lane * PER + i] = static_cast<T>(out[i] / total);
)";
#endif

// The end of the main kernel: one part writes the output (normalized),
// several write their partial sums (unnormalized, with their max logit
// and denominator) for the merge kernel.
#if defined(__APPLE__)
const char* kFinishOne =
    "for (int i = 0; i < PER; ++i) o[qbase + i] = T(out[i] / total);";
#else
const char* kFinishOne =
    "for (int i = 0; i < PER; ++i) o[qbase + i] = static_cast<T>(out[i] / total);";
#endif
const char* kFinishPart =
    "const size_t at = (size_t)bid * parts + part;"
    "for (int i = 0; i < PER; ++i) part_o[at * D + lane * PER + i] = out[i];"
    "if (lane == 0) { part_ml[at * 2] = mx_; part_ml[at * 2 + 1] = total; }";

const std::vector<std::string> kInputs = {"q", "k_pool", "v_pool", "tables", "meta", "scale"};
const std::vector<std::string> kQuantInputs = {"q",        "k_pool",   "k_scales", "k_biases",
                                               "v_pool",   "v_scales", "v_biases", "tables",
                                               "meta",     "scale"};

void put(std::string& s, const std::string& mark, const std::string& code) {
  for (auto at = s.find(mark); at != std::string::npos; at = s.find(mark)) {
    s.replace(at, mark.size(), code);
  }
}

// Element `i` of this lane's slice of K (`x` = "k") or V ("v") at head row
// `hrow` (= slot * KV_HEADS + kvh), as float: read from a float pool, or
// unpacked from its word and dequantized.
std::string element(const std::string& x, bool quantized) {
  const std::string e = "(lane * PER + i)";
  if (!quantized) return "(float)" + x + "_pool[hrow * D + " + e + "]";
  const std::string g = "hrow * NG + " + e + " / G";
  return "((float)((" + x + "_pool[hrow * WPH + " + e + " / EPW] >> ((" + e +
         " % EPW) * BITS)) & MASK) * (float)" + x + "_scales[" + g + "] + (float)" + x +
         "_biases[" + g + "])";
}

// `source` with its placeholders filled: with `sinks`, the head's sink
// logit (float32 `sinks[head]`, gpt-oss) joins the softmax's denominator and
// no value; without, the placeholders go. `quantized` reads the pools as
// words with scales and biases (template BITS and G); `finish` ends the
// main kernel (kFinishOne or kFinishPart).
std::string fill(const char* source, bool sinks, bool quantized, const char* finish) {
  std::string s(source);
#if defined(__APPLE__)
  put(s, "@SINK_MAX@", sinks ? "const float sink = sinks[head]; mx_ = max(mx_, sink);" : "");
  put(s, "@SINK_ADD@", sinks ? "total = fast::exp(sink - mx_);" : "");
#else
  put(s, "@SINK_MAX@", sinks ? "const float sink = sinks[head]; mx_ = fmaxf(mx_, sink);" : "");
  put(s, "@SINK_ADD@", sinks ? "total = __expf(sink - mx_);" : "");
#endif
  put(s, "@QCONSTS@",
      quantized ? "constexpr int EPW = 32 / BITS; constexpr int WPH = D / EPW; "
                  "constexpr int NG = D / G; constexpr unsigned MASK = (1u << BITS) - 1u;"
                : "");
  put(s, "@K@", element("k", quantized));
  put(s, "@V@", element("v", quantized));
  put(s, "@FINISH@", finish);
  return s;
}

// What one kernel object computes.
enum class Kind {
  // The whole attention of each (row, head) in one block.
  One,
  // One part of a split row's keys, to partial sums.
  Part,
  // The merge of the parts.
  Merge,
};

const mx::fast::CustomKernelFunction& make_kernel(const std::string& name, Kind kind, bool sinks,
                                                  bool quantized) {
#if defined(__APPLE__)
  const char* main = kMetalSource;
  const char* merge = kMetalMerge;
#else
  const char* main = kCudaSource;
  const char* merge = kCudaMerge;
#endif
  std::vector<std::string> inputs;
  std::vector<std::string> outputs = {"o"};
  std::string source;
  if (kind == Kind::Merge) {
    inputs = {"part_o", "part_ml"};
    source = fill(merge, sinks, false, "");
  } else {
    inputs = quantized ? kQuantInputs : kInputs;
    if (kind == Kind::Part) {
      outputs = {"part_o", "part_ml"};
      source = fill(main, false, quantized, kFinishPart);
    } else {
      source = fill(main, sinks, quantized, kFinishOne);
    }
  }
  if (sinks) inputs.push_back("sinks");
  auto* k = new mx::fast::CustomKernelFunction(gpu_custom_kernel(name, inputs, outputs, source));
  return *k;
}

// The kernels, each under its own name so that each is compiled and cached
// once, on its first call: the one-block kernel (float or quantized pools,
// with or without sinks), the part kernel (float or quantized; sinks join
// in the merge) and the merge (with or without sinks).
const mx::fast::CustomKernelFunction& kernel(Kind kind, bool sinks, bool quantized) {
  static const auto& one = make_kernel("mlxcel_paged_decode_attention", Kind::One, false, false);
  static const auto& one_s =
      make_kernel("mlxcel_paged_decode_attention_sinks", Kind::One, true, false);
  static const auto& one_q = make_kernel("mlxcel_paged_decode_attention_q", Kind::One, false, true);
  static const auto& one_sq =
      make_kernel("mlxcel_paged_decode_attention_sinks_q", Kind::One, true, true);
  static const auto& part = make_kernel("mlxcel_paged_decode_part", Kind::Part, false, false);
  static const auto& part_q = make_kernel("mlxcel_paged_decode_part_q", Kind::Part, false, true);
  static const auto& merge = make_kernel("mlxcel_paged_decode_merge", Kind::Merge, false, false);
  static const auto& merge_s = make_kernel("mlxcel_paged_decode_merge_sinks", Kind::Merge, true, false);
  switch (kind) {
    case Kind::Part:
      return quantized ? part_q : part;
    case Kind::Merge:
      return sinks ? merge_s : merge;
    case Kind::One:
    default:
      if (quantized) return sinks ? one_sq : one_q;
      return sinks ? one_s : one;
  }
}

// Whether this thread's launches may split rows into parts
// (`set_paged_attention_split`).
thread_local bool g_split = true;

// Keys one part takes at least, and the most parts a row is split into.
constexpr int kKeysPerPart = 256;
constexpr int kMaxParts = 32;
// Blocks a launch needs before splitting stops paying: (row, head) blocks
// at or above it keep one block each.
constexpr int kSplitBelowBlocks = 256;

// The scales and biases of quantized pools.
struct Quant {
  const array& k_scales;
  const array& k_biases;
  const array& v_scales;
  const array& v_biases;
  int group_size;
  int bits;
};

}  // namespace

namespace {
ArrayPtr paged(const array& q, const array& k_pool, const array& v_pool, const array& tables,
               const array& meta, const array& scale, int32_t block_size, int32_t window,
               const array* sinks, const Quant* quant) {
  if (q.ndim() != 3 || k_pool.ndim() != 3 || v_pool.ndim() != 3 || tables.ndim() != 2 ||
      meta.ndim() != 2) {
    throw std::invalid_argument("[paged_decode_attention] bad ranks");
  }
  const int rows = q.shape(0), heads = q.shape(1), dim = q.shape(2);
  const int kv_heads = k_pool.shape(1);
  // The pools' last dimension: head_dim floats, or its packed words.
  int stored = dim;
  if (quant != nullptr) {
    const int g = quant->group_size, bits = quant->bits;
    if ((bits != 8 && bits != 4) || (g != 32 && g != 64) || dim % g != 0) {
      throw std::invalid_argument("[paged_decode_attention] bad quantization");
    }
    stored = dim * bits / 32;
    for (const array* a : {&quant->k_scales, &quant->k_biases, &quant->v_scales, &quant->v_biases}) {
      if (a->ndim() != 3 || a->shape(0) != k_pool.shape(0) || a->shape(1) != kv_heads ||
          a->shape(2) != dim / g || a->dtype() != q.dtype()) {
        throw std::invalid_argument("[paged_decode_attention] scales or biases do not match");
      }
    }
  }
  const auto pool_dtype = quant != nullptr ? mx::uint32 : q.dtype();
  if (dim % 32 != 0 || dim > 256 || kv_heads == 0 || heads % kv_heads != 0 ||
      k_pool.shape(2) != stored || v_pool.shape(2) != stored || v_pool.shape(0) != k_pool.shape(0) ||
      v_pool.shape(1) != kv_heads || tables.shape(0) != rows || meta.shape(0) != rows ||
      meta.shape(1) != 2 || tables.dtype() != mx::int32 || meta.dtype() != mx::int32 ||
      scale.dtype() != mx::float32 || block_size < 1 || window < 0 ||
      k_pool.dtype() != pool_dtype || v_pool.dtype() != pool_dtype) {
    throw std::invalid_argument("[paged_decode_attention] inputs do not match");
  }
  if (sinks != nullptr &&
      (sinks->ndim() != 1 || sinks->shape(0) != heads || sinks->dtype() != mx::float32)) {
    throw std::invalid_argument("[paged_decode_attention] sinks must be float32 [heads]");
  }
  const int threads = 32 * kWarps;
  std::vector<array> inputs =
      quant == nullptr
          ? std::vector<array>{q, k_pool, v_pool, tables, meta, scale}
          : std::vector<array>{q,           k_pool,           quant->k_scales, quant->k_biases,
                               v_pool,      quant->v_scales,  quant->v_biases, tables,
                               meta,        scale};
  if (sinks != nullptr) inputs.push_back(*sinks);
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs = {
      {"T", q.dtype()},
      {"HEADS", heads},
      {"KV_HEADS", kv_heads},
      {"D", dim},
      {"BS", static_cast<int>(block_size)},
      {"WINDOW", static_cast<int>(window)}};
  if (quant != nullptr) {
    targs.push_back({"BITS", quant->bits});
    targs.push_back({"G", quant->group_size});
  }
  // Few (row, head) blocks over long rows leave most of the GPU idle and
  // each warp walking hundreds of keys one after the other: split each
  // row's keys into parts (flash-decoding; Dao et al. 2023), computed in
  // parallel and merged by a second kernel.
  int keys = tables.shape(1) * block_size;
  if (window > 0) keys = std::min(keys, static_cast<int>(window));
  int parts = 1;
  if (g_split && rows * heads < kSplitBelowBlocks) {
    parts = std::max(1, std::min(kMaxParts, keys / kKeysPerPart));
  }
  const bool quantized = quant != nullptr;
  if (parts == 1) {
    auto out = kernel(Kind::One, sinks != nullptr, quantized)(
        inputs, {q.shape()}, {q.dtype()}, {rows * heads * threads, 1, 1}, {threads, 1, 1}, targs,
        std::nullopt, false, {});
    return std::make_unique<array>(std::move(out[0]));
  }
  if (sinks != nullptr) inputs.pop_back();
  auto partial = kernel(Kind::Part, false, quantized)(
      inputs, {{rows * heads, parts, dim}, {rows * heads, parts, 2}}, {mx::float32, mx::float32},
      {rows * heads * parts * threads, 1, 1}, {threads, 1, 1}, targs, std::nullopt, false, {});
  std::vector<array> merge_inputs = {partial[0], partial[1]};
  if (sinks != nullptr) merge_inputs.push_back(*sinks);
  auto out = kernel(Kind::Merge, sinks != nullptr, false)(
      merge_inputs, {q.shape()}, {q.dtype()}, {rows * heads * 32, 1, 1}, {32, 1, 1},
      {{"T", q.dtype()}, {"HEADS", heads}, {"D", dim}}, std::nullopt, false, {});
  return std::make_unique<array>(std::move(out[0]));
}
}  // namespace

ArrayPtr paged_decode_attention(const array& q, const array& k_pool, const array& v_pool,
                                const array& tables, const array& meta, const array& scale,
                                int32_t block_size, int32_t window) {
  return paged(q, k_pool, v_pool, tables, meta, scale, block_size, window, nullptr, nullptr);
}

ArrayPtr paged_decode_attention_sinks(const array& q, const array& k_pool, const array& v_pool,
                                      const array& tables, const array& meta, const array& scale,
                                      int32_t block_size, int32_t window, const array& sinks) {
  return paged(q, k_pool, v_pool, tables, meta, scale, block_size, window, &sinks, nullptr);
}

ArrayPtr paged_decode_attention_quantized(const array& q, const array& k_pool,
                                          const array& k_scales, const array& k_biases,
                                          const array& v_pool, const array& v_scales,
                                          const array& v_biases, const array& tables,
                                          const array& meta, const array& scale,
                                          int32_t block_size, int32_t window, int32_t group_size,
                                          int32_t bits) {
  const Quant quant{k_scales, k_biases, v_scales, v_biases, group_size, bits};
  return paged(q, k_pool, v_pool, tables, meta, scale, block_size, window, nullptr, &quant);
}

ArrayPtr paged_decode_attention_quantized_sinks(
    const array& q, const array& k_pool, const array& k_scales, const array& k_biases,
    const array& v_pool, const array& v_scales, const array& v_biases, const array& tables,
    const array& meta, const array& scale, int32_t block_size, int32_t window,
    int32_t group_size, int32_t bits, const array& sinks) {
  const Quant quant{k_scales, k_biases, v_scales, v_biases, group_size, bits};
  return paged(q, k_pool, v_pool, tables, meta, scale, block_size, window, &sinks, &quant);
}

void set_paged_attention_split(bool split) { g_split = split; }

namespace {
// Whether MLX was built with the GPU backend our kernels are written for
// and it found a device.
bool gpu_backend_available() {
#if defined(__APPLE__)
  return mx::metal::is_available();
#else
  return mx::cu::is_available();
#endif
}
}  // namespace

// The kernels run on the default device's stream: a GPU backend is not
// enough when the default device is the CPU (`--device cpu` on a GPU host).
bool paged_attention_available() { return gpu_kernels_usable(); }

bool gpu_kernels_usable() {
  return mx::default_device().type == mx::Device::gpu && gpu_backend_available();
}

mx::fast::CustomKernelFunction gpu_custom_kernel(const std::string& name,
                                                 const std::vector<std::string>& inputs,
                                                 const std::vector<std::string>& outputs,
                                                 const std::string& source) {
#if defined(__APPLE__)
  return mx::fast::metal_kernel(name, inputs, outputs, source);
#else
  return mx::fast::cuda_kernel(name, inputs, outputs, source);
#endif
}

}  // namespace mlxcel
