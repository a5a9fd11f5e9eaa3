// See skinny_gemm.h.
#include "skinny_gemm.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mlxcel {
namespace {

#if defined(__x86_64__)

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Column j of M output rows: each row's accumulator summed, plus the
// products of the k % 8 trailing elements. A function of its own rather
// than a lambda, which would not carry the target attribute and would pass
// __m256 values across a non-AVX call boundary unless inlined.
template <int M>
__attribute__((target("avx2,fma"))) inline void finish(const __m256* acc, const float* a, int lda,
                                                const float* row, int k8, int k, float* c, int ldc,
                                                int j) {
  for (int i = 0; i < M; i++) {
    float s = hsum(acc[i]);
    for (int p = k8; p < k; p++) s += a[i * lda + p] * row[p];
    c[i * ldc + j] = s;
  }
}

// Output columns [n0, n1) for exactly M rows, two weight rows at a time.
template <int M>
__attribute__((target("avx2,fma"))) void kernel(int n0, int n1, int k, const float* a, int lda,
                                                const float* b, int ldb, float* c, int ldc) {
  const int k8 = k & ~7;
  int j = n0;
  for (; j + 2 <= n1; j += 2) {
    const float* r0 = b + static_cast<int64_t>(j) * ldb;
    const float* r1 = r0 + ldb;
    __m256 x0[M], x1[M];
    for (int i = 0; i < M; i++) x0[i] = x1[i] = _mm256_setzero_ps();
    for (int p = 0; p < k8; p += 8) {
      const __m256 b0 = _mm256_loadu_ps(r0 + p), b1 = _mm256_loadu_ps(r1 + p);
      for (int i = 0; i < M; i++) {
        const __m256 av = _mm256_loadu_ps(a + i * lda + p);
        x0[i] = _mm256_fmadd_ps(av, b0, x0[i]);
        x1[i] = _mm256_fmadd_ps(av, b1, x1[i]);
      }
    }
    finish<M>(x0, a, lda, r0, k8, k, c, ldc, j);
    finish<M>(x1, a, lda, r1, k8, k, c, ldc, j + 1);
  }
  if (j < n1) {
    const float* r0 = b + static_cast<int64_t>(j) * ldb;
    __m256 x0[M];
    for (int i = 0; i < M; i++) x0[i] = _mm256_setzero_ps();
    for (int p = 0; p < k8; p += 8) {
      const __m256 b0 = _mm256_loadu_ps(r0 + p);
      for (int i = 0; i < M; i++)
        x0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i * lda + p), b0, x0[i]);
    }
    finish<M>(x0, a, lda, r0, k8, k, c, ldc, j);
  }
}

using KernelFn = void (*)(int, int, int, const float*, int, const float*, int, float*, int);
constexpr KernelFn kKernels[9] = {nullptr,   kernel<1>, kernel<2>, kernel<3>, kernel<4>,
                                  kernel<5>, kernel<6>, kernel<7>, kernel<8>};

// Rows one register tile holds (the largest kernel<M>).
constexpr int kTileRows = 8;

// AVX-512: 32 vector registers hold R <= 6 rows x 4 weight rows of 16-lane
// accumulators, so every weight vector loaded serves R rows and every row
// vector 4 weight rows (the AVX2 kernel above has registers for 2 weight
// rows and spills at 8 rows: past ~8 rows it is bound by its loads and
// FMAs, where this one is at 1.7x the memory's pace at 11 rows; 3 x 8, 5 x
// 5 and 4 x 6 tiles measured within 5 % of 6 x 4).
constexpr int kTileRows512 = 6;
// The sum of v's 16 lanes in _mm512_reduce_add_ps's order (halves, then
// quarters, then pairs), written with vector extensions
// (`__builtin_shufflevector`, GCC 12+ and Clang): GCC 12's AVX-512
// reduction and 512-to-256 casts pass an undefined register as the unused
// merge source of a masked builtin, which -Wuninitialized reports at every
// inlined use.
__attribute__((target("avx512f"))) inline float hsum512(__m512 v) {
  typedef float F16 __attribute__((vector_size(64)));
  const F16 x = reinterpret_cast<F16>(v);
  const F16 half =
      x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  const F16 quarter =
      half + __builtin_shufflevector(half, half, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
  const F16 pairs = quarter + __builtin_shufflevector(quarter, quarter, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                                      3, 2, 3, 2, 3, 2, 3);
  return pairs[0] + pairs[1];
}

// Output columns [n0, n1) for exactly R rows, W weight rows at a time,
// then one at a time.
template <int R, int W>
__attribute__((target("avx512f"))) void kernel512_cols(int j, int k, const float* a, int lda,
                                                       const float* b, int ldb, float* c, int ldc) {
  const int k16 = k & ~15;
  const float* r[W];
  for (int w = 0; w < W; w++) r[w] = b + static_cast<int64_t>(j + w) * ldb;
  __m512 acc[R][W];
  for (int i = 0; i < R; i++)
    for (int w = 0; w < W; w++) acc[i][w] = _mm512_setzero_ps();
  for (int p = 0; p < k16; p += 16) {
    __m512 bv[W];
    for (int w = 0; w < W; w++) bv[w] = _mm512_loadu_ps(r[w] + p);
    for (int i = 0; i < R; i++) {
      const __m512 av = _mm512_loadu_ps(a + i * lda + p);
      for (int w = 0; w < W; w++) acc[i][w] = _mm512_fmadd_ps(av, bv[w], acc[i][w]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int w = 0; w < W; w++) {
      float s = hsum512(acc[i][w]);
      for (int p = k16; p < k; p++) s += a[i * lda + p] * r[w][p];
      c[i * ldc + j + w] = s;
    }
}

template <int R>
__attribute__((target("avx512f"))) void kernel512(int n0, int n1, int k, const float* a, int lda,
                                                  const float* b, int ldb, float* c, int ldc) {
  int j = n0;
  for (; j + 4 <= n1; j += 4) kernel512_cols<R, 4>(j, k, a, lda, b, ldb, c, ldc);
  for (; j < n1; j++) kernel512_cols<R, 1>(j, k, a, lda, b, ldb, c, ldc);
}

constexpr KernelFn kKernels512[kTileRows512 + 1] = {
    nullptr, kernel512<1>, kernel512<2>, kernel512<3>, kernel512<4>, kernel512<5>, kernel512<6>};

// MLXCEL_SKINNY_AVX512=0 keeps an AVX-512 machine on the AVX2 kernels
// (read once per process; the tests run both sets this way).
bool avx512_available() {
  static const bool ok = [] {
    const char* off = std::getenv("MLXCEL_SKINNY_AVX512");
    return __builtin_cpu_supports("avx512f") && !(off && std::string(off) == "0");
  }();
  return ok;
}

// The kernels of this machine (indexed by rows, 1..tile_rows()) and the
// rows one of them holds.
const KernelFn* kernels() { return avx512_available() ? kKernels512 : kKernels; }
int tile_rows() { return avx512_available() ? kTileRows512 : kTileRows; }

// Most rows with AVX-512 (AVX2: one tile, kTileRows).
constexpr int kMaxRows512 = 48;

// Output columns [n0, n1) for any 1 <= m <= skinny_max_rows() rows. Up
// to a tile of rows (kTileRows; kTileRows512 with AVX-512) run as one
// tile. More rows run tile by tile over blocks of weight rows small enough
// to stay in the L1/L2 cache while every tile reads them, so the weights
// still come from memory once. Each output is the same k-ordered sum of
// 8-lane (16-lane with AVX-512) partial sums whatever the tile, the block
// or m.
__attribute__((target("avx2,fma"))) void rows_kernel(int m, int n0, int n1, int k, const float* a,
                                                     int lda, const float* b, int ldb, float* c,
                                                     int ldc) {
  const KernelFn* fns = kernels();
  const int tile = tile_rows();
  if (m <= tile) {
    fns[m](n0, n1, k, a, lda, b, ldb, c, ldc);
    return;
  }
  // About 64 KiB of weight rows per block, a multiple of 4 (the weight
  // rows the kernels take at a time).
  const int block = std::max(4, (65536 / std::max(1, k * 4)) & ~3);
  for (int j0 = n0; j0 < n1; j0 += block) {
    const int j1 = std::min(n1, j0 + block);
    for (int i0 = 0; i0 < m; i0 += tile) {
      const int rows = std::min(tile, m - i0);
      fns[rows](j0, j1, k, a + static_cast<int64_t>(i0) * lda, lda, b, ldb,
                c + static_cast<int64_t>(i0) * ldc, ldc);
    }
  }
}

// A fixed set of helper threads that run one task at a time, woken through
// an atomic generation counter (futex wait), spinning briefly first since
// decode calls this hundreds of times per step.
class Pool {
 public:
  Pool() {
    helpers_ = std::min(usable_cpus(), 8) - 1;
    for (int i = 0; i < helpers_; i++) threads_.emplace_back([this, i] { loop(i + 1); });
  }
  ~Pool() {
    stop_.store(true);
    generation_.fetch_add(1);
    generation_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return helpers_ + 1; }

  // CPUs this process may run on (affinity and cgroup cpusets), at least 1.
  static int usable_cpus() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }

  // Runs task(part) for part in [0, size()) and returns when all are done.
  // Callers that find the pool busy run every part themselves.
  void run(const std::function<void(int)>& task) {
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (!lock.owns_lock() || helpers_ == 0) {
      for (int p = 0; p < size(); p++) task(p);
      return;
    }
    task_ = &task;
    pending_.store(helpers_, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    task(0);
    // Helpers finish within microseconds of the caller unless descheduled:
    // spin briefly, then yield the CPU to them.
    for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; spin++) {
      if (spin < 4000) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
    task_ = nullptr;
  }

 private:
  void loop(int part) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t now = generation_.load(std::memory_order_acquire);
      for (int spin = 0; now == seen && spin < 4000; spin++) {
        _mm_pause();
        now = generation_.load(std::memory_order_acquire);
      }
      if (now == seen) {
        generation_.wait(seen, std::memory_order_acquire);
        continue;
      }
      seen = now;
      if (stop_.load()) return;
      (*task_)(part);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  int helpers_ = 0;
  std::vector<std::thread> threads_;
  std::mutex busy_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* task_ = nullptr;
};

Pool& pool() {
  static Pool p;
  return p;
}

#endif  // __x86_64__

}  // namespace

bool skinny_sgemm_available() {
#if defined(__x86_64__)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

bool skinny_sgemm_takes(int m, int k) {
#if defined(__x86_64__)
  if (m < 2 || m > skinny_max_rows()) return false;
  return m <= tile_rows() || static_cast<int64_t>(m) * k * 4 <= (512 << 10);
#else
  (void)m, (void)k;
  return false;
#endif
}

int skinny_max_rows() {
#if defined(__x86_64__)
  if (!skinny_sgemm_available()) return 0;
  return avx512_available() ? kMaxRows512 : kTileRows;
#else
  return 0;
#endif
}

void skinny_sgemm(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c,
                  int ldc) {
#if defined(__x86_64__)
  const auto fn = [m](int n0, int n1, int k, const float* a, int lda, const float* b, int ldb,
                      float* c, int ldc) { rows_kernel(m, n0, n1, k, a, lda, b, ldb, c, ldc); };
  Pool& p = pool();
  // Split the outputs in parts of a multiple of 4 columns (whole column
  // groups of both kernels), one per thread, when there is enough work to
  // pay for waking the helpers: at least 64 outputs and 128 Ki weights
  // (512 KiB) a part.
  const int64_t weights = static_cast<int64_t>(n) * k;
  const int parts = static_cast<int>(
      std::min<int64_t>(p.size(), std::max<int64_t>(1, std::min<int64_t>(n / 64, weights >> 17))));
  const int per = ((n + parts - 1) / parts + 3) & ~3;
  if (parts == 1) {
    fn(0, n, k, a, lda, b, ldb, c, ldc);
    return;
  }
  p.run([&](int part) {
    if (part >= parts) return;
    const int n0 = part * per, n1 = std::min(n, n0 + per);
    if (n0 < n1) fn(n0, n1, k, a, lda, b, ldb, c, ldc);
  });
#else
  (void)m, (void)n, (void)k, (void)a, (void)lda, (void)b, (void)ldb, (void)c, (void)ldc;
#endif
}

}  // namespace mlxcel
