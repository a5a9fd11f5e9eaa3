// Skinny GEMM for batched decode and speculative verification on x86-64
// CPUs: C[m, n] = A[m, :] · B[n, :] for 2 <= m <= skinny_max_rows() rows
// against a weight matrix B stored row-major [n, k] (a linear layer's
// `[out, in]`).
//
// Why: OpenBLAS (0.3.21) packs the whole weight matrix on every GEMM call,
// so a decode step of 4-8 rows cost ~3x a one-row GEMV although it reads
// the same weights (measured: perf shows half of decode in sgemm_itcopy),
// and a verification row of 1 + 10 draft tokens as much again. This kernel
// streams each weight row once, computing the dot products of a register
// tile of rows (8 with AVX2, 6 with AVX-512) against it while it is in
// registers; more rows run tile by tile over blocks of weight rows that
// stay in cache: memory traffic is that of one GEMV. Each output is a
// k-ordered sum of 8-lane (AVX2) or 16-lane (AVX-512) partial sums, the
// same for any m the kernel takes (a row's product does not depend on the
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

// Whether `skinny_sgemm` takes m rows of k inputs: 2 <= m <=
// skinny_max_rows(), and past one register tile the rows fit in 512 KiB
// (they are re-read from cache once per 4 weight rows; larger ones, e.g.
// 48 rows of a 8,960-input projection, would stream from L3 and lose to
// OpenBLAS).
bool skinny_sgemm_takes(int m, int k);

// c[i * ldc + j] = sum_p a[i * lda + p] * b[j * ldb + p], for i < m, j < n;
// 1 <= m <= skinny_max_rows(). Splits the n outputs over a small
// persistent thread pool.
void skinny_sgemm(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c,
                  int ldc);

}  // namespace mlxcel
