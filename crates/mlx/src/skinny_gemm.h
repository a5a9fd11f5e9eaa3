// Skinny GEMM for batched decode on x86-64 CPUs: C[m, n] = A[m, :] · B[n, :]
// for 2 <= m <= 8 rows against a weight matrix B stored row-major [n, k]
// (a linear layer's `[out, in]`).
//
// Why: OpenBLAS (0.3.21) packs the whole weight matrix on every GEMM call,
// so a decode step of 4-8 rows costs ~3x a one-row GEMV although it reads
// the same weights (measured: perf shows half of decode in sgemm_itcopy).
// This kernel streams each weight row once, computing all m dot products
// against it while it is in registers: memory traffic is that of one GEMV.
// Each output is a k-ordered sum of 8-lane partial sums, the same for any m
// in 2..8; one row (GEMV) and more than 8 rows (OpenBLAS) round differently,
// within float32 noise.
#pragma once

namespace mlxcel {

// Whether `skinny_sgemm` can run here (x86-64 with AVX2 and FMA).
bool skinny_sgemm_available();

// c[i * ldc + j] = sum_p a[i * lda + p] * b[j * ldb + p], for i < m, j < n;
// 1 <= m <= 8. Splits the n outputs over a small persistent thread pool.
void skinny_sgemm(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c,
                  int ldc);

}  // namespace mlxcel
