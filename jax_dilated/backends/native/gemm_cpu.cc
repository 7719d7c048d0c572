// Dense matrix products on the CPU through a BLAS library's GEMM, as an XLA FFI call.
//
// c [M, N] = a [M, K] . b [K, N], row-major, float32 in and out. A tuned BLAS computes
// the dense layers' products (10,000 x 768 x 3072) faster than XLA's own float32 dot
// (docs/benchmarks.md, "CPU: the dense layers' products"): the layers' and models'
// projections and feed-forward call this instead (jax_dilated/backends/native/gemm.py).
//
// The library is not linked: Python finds it (OpenBLAS from the scipy-openblas32
// wheel) and hands this library the address of its cblas_sgemm
// (JaxDilatedSetSgemm) before the first call, so the kernel builds without a BLAS and
// the choice of BLAS stays in one place. Compiled into the native kernel's library
// beside attention_cpu.cc (jax_dilated/backends/native/build.py).

#include <atomic>
#include <climits>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// CBLAS's enumerations (cblas.h): row-major storage, no transpose
constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;

// cblas_sgemm with 32-bit integers (LP64), as every CBLAS declares it
using Sgemm = void (*)(int layout, int trans_a, int trans_b, int m, int n, int k,
                       float alpha, const float* a, int lda, const float* b, int ldb,
                       float beta, float* c, int ldc);

std::atomic<Sgemm> sgemm{nullptr};

ffi::Error Gemm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                ffi::ResultBuffer<ffi::F32> c) {
  Sgemm gemm = sgemm.load(std::memory_order_acquire);
  if (gemm == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_dilated: no BLAS GEMM was set for the dense products");
  }
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 2) {
    return ffi::Error::InvalidArgument("jax_dilated gemm: a and b must be matrices");
  }
  const int64_t m = da[0], k = da[1], n = db[1];
  // (empty products never come here: gemm.py sends them to XLA's dot)
  if (db[0] != k || m < 1 || n < 1 || k < 1 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return ffi::Error::InvalidArgument(
        "jax_dilated gemm: shapes must multiply, non-empty and within 32-bit BLAS sizes");
  }
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  gemm(kRowMajor, kNoTrans, kNoTrans, mi, ni, ki, 1.0f, a.typed_data(), ki, b.typed_data(),
       ni, 0.0f, c->typed_data(), ni);
  return ffi::Error::Success();
}

}  // namespace

// The GEMM the handler calls (a cblas_sgemm's address); 0 on success.
extern "C" __attribute__((visibility("default"))) int JaxDilatedSetSgemm(void* function) {
  sgemm.store(reinterpret_cast<Sgemm>(function), std::memory_order_release);
  return 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDilatedGemmCpu, Gemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
