// Skinny GEMM for batched decode and speculative verification on x86-64
// CPUs: C[m, n] = A[m, :] · B[n, :] for 2 <= m <= skinny_max_rows() rows
// against a weight matrix B stored row-major [n, k] (a linear layer's
// `[out, in]`).
//
// Why: OpenBLAS (0.3.21) packs the whole weight matrix on every GEMM call,
// so a decode step of 4-8 rows cost ~3x a one-row GEMV although it reads
// the same weights (measured: perf shows half of decode in sgemm_itcopy),
// and a verification row of 1 + 10 draft tokens as much again. This kernel
// streams each weight row once, computing the dot products of up to 8 rows
// against it while it is in registers; more rows run 8 at a time over
// blocks of weight rows that stay in cache: memory traffic is that of one
// GEMV. Each output is a k-ordered sum of 8-lane partial sums, the same
// for any m in 2..skinny_max_rows() (a row's product does not depend on the
// rows beside it); one row (GEMV) and more rows (OpenBLAS) round
// differently, within float32 noise.
#pragma once

namespace mlxcel {

// Whether `skinny_sgemm` can run here (x86-64 with AVX2 and FMA).
bool skinny_sgemm_available();

// The most rows for which `skinny_sgemm` beats OpenBLAS here: 48 with
// AVX-512, 8 with AVX2 only (measured on 1 GB of [4608, 576] and [576,
// 1536] weights, 2 cores: AVX-512 48 rows 0.89-0.93x OpenBLAS's time, 11
// rows 0.45x; AVX2 8 rows 0.85x, 11 rows 1.0x), 0 without AVX2.
int skinny_max_rows();

// c[i * ldc + j] = sum_p a[i * lda + p] * b[j * ldb + p], for i < m, j < n;
// 1 <= m <= skinny_max_rows(). Splits the n outputs over a small persistent thread pool.
void skinny_sgemm(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c,
                  int ldc);

}  // namespace mlxcel
