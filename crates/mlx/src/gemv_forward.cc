// GEMM -> GEMV forwarding for MLX's CPU matmul.
//
// MLX's CPU backend runs every float32 matmul through `cblas_sgemm`, also
// when one side is a single row (decode: one token times a weight matrix).
// BLAS libraries that do not special-case that shape (OpenBLAS before
// 0.3.27, i.e. Debian 12's 0.3.21) pack the whole weight matrix on every
// call, which costs more than the multiply itself (perf: ~40% of decode time
// in `sgemm_itcopy`). This definition of `cblas_sgemm`, linked into the
// executable, comes first in the dynamic linker's search order: it sends
// single-row and single-column products to `cblas_sgemv` (no packing, one
// pass over the matrix) and everything else to the next `cblas_sgemm` in
// the search order (OpenBLAS, or the wheel's reference BLAS). Newer OpenBLAS
// releases do the same forwarding internally (GEMM_GEMV_FORWARD).
#include <dlfcn.h>

#include "skinny_gemm.h"

#include <cstdio>
#include <cstdlib>

namespace {

// CBLAS enum values (cblas.h).
constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;

using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                          int, float, float*, int);
using sgemv_fn = void (*)(int, int, int, int, float, const float*, int, const float*, int, float,
                          float*, int);

template <typename F>
F next_symbol(const char* name) {
  void* p = dlsym(RTLD_NEXT, name);
  if (p == nullptr) {
    std::fprintf(stderr, "mlxcel: no BLAS provides %s\n", name);
    std::abort();
  }
  return reinterpret_cast<F>(p);
}

// Resolved once, on first use (function-local statics are thread-safe).
sgemm_fn real_sgemm() {
  static const sgemm_fn fn = next_symbol<sgemm_fn>("cblas_sgemm");
  return fn;
}

sgemv_fn real_sgemv() {
  static const sgemv_fn fn = next_symbol<sgemv_fn>("cblas_sgemv");
  return fn;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void cblas_sgemm(
    int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a, int lda,
    const float* b, int ldb, float beta, float* c, int ldc) {
  const bool plain = order == kRowMajor && (trans_a == kNoTrans || trans_a == kTrans) &&
                     (trans_b == kNoTrans || trans_b == kTrans) && k > 0;
  if (plain && m == 1 && n > 1) {
    // c[0, :] = alpha * op(a)[0, :] @ op(b) + beta * c: y = op(b)ᵀ x.
    // Row-major b is [k, n] (NoTrans) or [n, k] (Trans), leading dim ldb.
    const int incx = trans_a == kNoTrans ? 1 : lda;
    if (trans_b == kNoTrans) {
      real_sgemv()(kRowMajor, kTrans, k, n, alpha, b, ldb, a, incx, beta, c, 1);
    } else {
      real_sgemv()(kRowMajor, kNoTrans, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    }
    return;
  }
  if (plain && n == 1 && m > 1) {
    // c[:, 0] = alpha * op(a) @ op(b)[:, 0] + beta * c: y = op(a) x.
    // Row-major a is [m, k] (NoTrans) or [k, m] (Trans), leading dim lda.
    const int incx = trans_b == kNoTrans ? ldb : 1;
    if (trans_a == kNoTrans) {
      real_sgemv()(kRowMajor, kNoTrans, m, k, alpha, a, lda, b, incx, beta, c, ldc);
    } else {
      real_sgemv()(kRowMajor, kTrans, k, m, alpha, a, lda, b, incx, beta, c, ldc);
    }
    return;
  }
  if (plain && trans_a == kNoTrans && trans_b == kTrans && mlxcel::skinny_sgemm_takes(m, k) &&
      n >= 64 && k >= 8 && alpha == 1.0f && beta == 0.0f) {
    // A few rows against a [n, k] weight (batched decode, speculative
    // verification): stream the weight once.
    mlxcel::skinny_sgemm(m, n, k, a, lda, b, ldb, c, ldc);
    return;
  }
  real_sgemm()(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

namespace mlxcel {

// Whether MLX's `cblas_sgemm` calls resolve to the forwarder above (the
// executable exported it ahead of every BLAS library). Also pulls this
// object into every binary that uses the bridge.
bool gemv_forwarding_active() {
  void* resolved = dlsym(RTLD_DEFAULT, "cblas_sgemm");
  return resolved == reinterpret_cast<void*>(&cblas_sgemm);
}

}  // namespace mlxcel
