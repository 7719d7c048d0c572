// Dense matrix products on the CPU through a BLAS library's GEMM, as XLA FFI calls.
//
// c [M, N] = a [M, K] . b [K, N], row-major, float32 result. A tuned BLAS computes
// the dense layers' products (10,000 x 768 x 3072) faster than XLA's own dot
// (docs/benchmarks.md, "CPU: the dense layers' products"): the layers' and models'
// projections and feed-forward call this instead (jax_dilated/backends/native/gemm.py).
// Two calls:
// - Gemm: float32 a and b, by a cblas_sgemm (OpenBLAS), threaded by the BLAS;
// - GemmBf16: bfloat16 a and b, products and sums in float32, by oneMKL's
//   cblas_gemm_bf16bf16f32, which runs on the CPU's bfloat16 units where it has them
//   (AMX-BF16 tiles, AVX512-BF16's vdpbf16ps). MKL runs sequentially here: the rows are cut into
//   blocks shared among the threads of XLA's intra-op pool (parallel_units.h), as the
//   attention kernel's work is, so a call uses the threads XLA was given and no more.
//
// No BLAS is linked: Python finds the libraries (scipy-openblas32's OpenBLAS, the mkl
// wheel's libmkl_rt) and hands this library their functions' addresses
// (JaxDilatedSetSgemm, JaxDilatedSetGemmBf16) before the first call, so the kernel
// builds without a BLAS and the choice of BLAS stays in one place. Compiled into the
// native kernel's library beside attention_cpu.cc (jax_dilated/backends/native/build.py).

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "parallel_units.h"

namespace ffi = xla::ffi;

namespace {

// CBLAS's enumerations (cblas.h): row-major storage, no transpose
constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;

// cblas_sgemm with 32-bit integers (LP64), as every CBLAS declares it
using Sgemm = void (*)(int layout, int trans_a, int trans_b, int m, int n, int k,
                       float alpha, const float* a, int lda, const float* b, int ldb,
                       float beta, float* c, int ldc);

// oneMKL's cblas_gemm_bf16bf16f32 (mkl_cblas.h) in its LP64 interface: MKL_BF16 is
// an unsigned 16-bit integer holding the bfloat16's bits
using GemmBf16Fn = void (*)(int layout, int trans_a, int trans_b, int m, int n, int k,
                            float alpha, const uint16_t* a, int lda, const uint16_t* b,
                            int ldb, float beta, float* c, int ldc);

std::atomic<Sgemm> sgemm{nullptr};
std::atomic<GemmBf16Fn> gemm_bf16{nullptr};

// rows of a per unit of GemmBf16's work: enough that the GEMM packs b for a real
// share of the work, few enough that two threads find at least two units each at the
// layers' sizes (thousands of tokens)
constexpr int64_t kRowsPerUnit = 512;

// (m, k, n) of c = a . b where both are matrices that multiply, non-empty and within
// 32-bit BLAS sizes; else an error naming the call
template <class A, class B>
ffi::Error product_shape(const A& a, const B& b, const char* call, int64_t& m, int64_t& k,
                         int64_t& n) {
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 2) {
    return ffi::Error::InvalidArgument(std::string(call) + ": a and b must be matrices");
  }
  m = da[0], k = da[1], n = db[1];
  // (empty products never come here: gemm.py sends them to XLA's dot)
  if (db[0] != k || m < 1 || n < 1 || k < 1 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return ffi::Error::InvalidArgument(
        std::string(call) +
        ": shapes must multiply, non-empty and within 32-bit BLAS sizes");
  }
  return ffi::Error::Success();
}

ffi::Error Gemm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                ffi::ResultBuffer<ffi::F32> c) {
  Sgemm gemm = sgemm.load(std::memory_order_acquire);
  if (gemm == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_dilated: no BLAS GEMM was set for the dense products");
  }
  int64_t m, k, n;
  if (auto err = product_shape(a, b, "jax_dilated gemm", m, k, n); err.failure()) return err;
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  gemm(kRowMajor, kNoTrans, kNoTrans, mi, ni, ki, 1.0f, a.typed_data(), ki, b.typed_data(),
       ni, 0.0f, c->typed_data(), ni);
  return ffi::Error::Success();
}

struct NoState {};

ffi::Error GemmBf16(ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                    ffi::ResultBuffer<ffi::F32> c, ffi::ThreadPool pool) {
  GemmBf16Fn gemm = gemm_bf16.load(std::memory_order_acquire);
  if (gemm == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_dilated: no bfloat16 GEMM was set for the dense products");
  }
  int64_t m, k, n;
  if (auto err = product_shape(a, b, "jax_dilated bfloat16 gemm", m, k, n); err.failure()) {
    return err;
  }
  const auto* pa = reinterpret_cast<const uint16_t*>(a.typed_data());
  const auto* pb = reinterpret_cast<const uint16_t*>(b.typed_data());
  float* pc = c->typed_data();
  const int ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int64_t units = (m + kRowsPerUnit - 1) / kRowsPerUnit;
  jax_dilated::parallel_for<NoState>(pool, units, [=](int64_t u, NoState&) {
    const int64_t row = u * kRowsPerUnit, rows = std::min(kRowsPerUnit, m - row);
    gemm(kRowMajor, kNoTrans, kNoTrans, static_cast<int>(rows), ni, ki, 1.0f, pa + row * k,
         ki, pb, ni, 0.0f, pc + row * n, ni);
  });
  return ffi::Error::Success();
}

}  // namespace

// The GEMM the handler calls (a cblas_sgemm's address); 0 on success.
extern "C" __attribute__((visibility("default"))) int JaxDilatedSetSgemm(void* function) {
  sgemm.store(reinterpret_cast<Sgemm>(function), std::memory_order_release);
  return 0;
}

// The bfloat16 GEMM GemmBf16 calls (a cblas_gemm_bf16bf16f32's address, MKL set to
// run sequentially); 0 on success.
extern "C" __attribute__((visibility("default"))) int JaxDilatedSetGemmBf16(void* function) {
  gemm_bf16.store(reinterpret_cast<GemmBf16Fn>(function), std::memory_order_release);
  return 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDilatedGemmCpu, Gemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDilatedGemmBf16Cpu, GemmBf16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ctx<ffi::ThreadPool>());
