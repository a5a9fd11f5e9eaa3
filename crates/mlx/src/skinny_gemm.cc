// See skinny_gemm.h.
#include "skinny_gemm.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
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

// Output columns [n0, n1) for exactly M rows, two weight rows at a time.
template <int M>
__attribute__((target("avx2,fma"))) void kernel(int n0, int n1, int k, const float* a, int lda,
                                                const float* b, int ldb, float* c, int ldc) {
  const int k8 = k & ~7;
  auto finish = [&](const __m256* acc, const float* row, int j) {
    for (int i = 0; i < M; i++) {
      float s = hsum(acc[i]);
      for (int p = k8; p < k; p++) s += a[i * lda + p] * row[p];
      c[i * ldc + j] = s;
    }
  };
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
    finish(x0, r0, j);
    finish(x1, r1, j + 1);
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
    finish(x0, r0, j);
  }
}

using KernelFn = void (*)(int, int, int, const float*, int, const float*, int, float*, int);
constexpr KernelFn kKernels[9] = {nullptr,   kernel<1>, kernel<2>, kernel<3>, kernel<4>,
                                  kernel<5>, kernel<6>, kernel<7>, kernel<8>};

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

void skinny_sgemm(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c,
                  int ldc) {
#if defined(__x86_64__)
  const KernelFn fn = kKernels[m];
  Pool& p = pool();
  // Split the outputs in even-sized parts (of whole row pairs).
  const int parts = std::min(p.size(), std::max(1, n / 64));
  const int per = ((n + parts - 1) / parts + 1) & ~1;
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
