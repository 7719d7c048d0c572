// Dense matrix products on the CPU through a BLAS library's GEMM, as XLA FFI calls.
//
// c [M, N] = a [M, K] . b [K, N], row-major, float32 result. A tuned BLAS computes
// the dense layers' products (10,000 x 768 x 3072) faster than XLA's own dot
// (docs/benchmarks.md, "CPU: the dense layers' products"): the layers' and models'
// projections and feed-forward call this instead (jax_dilated/backends/native/gemm.py).
// Three calls:
// - Gemm: float32 a and b, by a cblas_sgemm (OpenBLAS), threaded by the BLAS;
// - GemmGeluNorm: the same product with the encoder's bias, exact GELU and LayerNorm
//   applied to it in the same call (section "the feed-forward's first half");
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

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

// The GEMM in `slot` (set from Python before the first call, JaxDilatedSet...), or an
// error naming the one (`what`) that was not set
template <class Fn>
ffi::Error set_gemm(const std::atomic<Fn>& slot, const char* what, Fn& gemm) {
  gemm = slot.load(std::memory_order_acquire);
  if (gemm == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string("jax_dilated: no ") + what + " was set for the dense products");
  }
  return ffi::Error::Success();
}

ffi::Error Gemm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                ffi::ResultBuffer<ffi::F32> c) {
  Sgemm gemm;
  if (auto err = set_gemm(sgemm, "BLAS GEMM", gemm); err.failure()) return err;
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
  GemmBf16Fn gemm;
  if (auto err = set_gemm(gemm_bf16, "bfloat16 GEMM", gemm); err.failure()) return err;
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

// ------------------------------------------- the feed-forward's first half, fused
// GemmGeluNorm: c [M, N] = LayerNorm(gelu(a . b + bias)) * scale + shift, the
// LayerNorm over each row's N values (biased variance, eps inside the square root)
// and the exact GELU x (1 + erf(x / sqrt 2)) / 2: torchscale's fc1, GELU and Sub-LN
// ffn_layernorm in one call (jax_dilated/models/encoder.py). The product runs by the
// BLAS's GEMM on blocks of kEpilogueRows rows; each block's bias, GELU and
// normalisation follow while the block is still in the last-level cache, on the
// threads of XLA's pool, where XLA's fusion of the three steps reads the whole [M, N]
// result back from memory after the product has written it (123 MB at 10,000 tokens
// of a 3072-wide layer).

// rows of c per block: the block (12 MiB at N = 3072) stays in a 16-32 MiB L3 between
// the GEMM that writes it and the epilogue that reads it, and is large enough that
// the GEMM runs at its rate on the whole matrix
constexpr int64_t kEpilogueRows = 1024;
// rows per unit of the epilogue's work
constexpr int64_t kEpilogueUnit = 16;

// Eight float lanes as GCC's vector extension (one AVX register, two SSE or NEON
// ones, a half of an AVX-512 one): the epilogue's loops in vectors on every build,
// where the compiler would keep them scalar (its clamps and sums are not
// vectorised without relaxed floating-point flags).
typedef float F8 __attribute__((vector_size(32)));
constexpr int kF8 = 8;
inline F8 load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, F8 v) { std::memcpy(p, &v, sizeof v); }
inline F8 splat(float x) { return F8{} + x; }
inline float lane_sum(F8 v) {
  float s = 0.0f;
  for (int l = 0; l < kF8; l++) s += v[l];
  return s;
}

// a float, or one broadcast to every lane, and x clamped to [lo, hi]: the functions
// below serve a row's vectors and its last few floats alike (T: float or F8)
template <class T>
inline T bcast(float x) {
  if constexpr (std::is_same_v<T, F8>) return splat(x);
  else return x;
}
template <class T>
inline T clamp(T x, float lo, float hi) {
  const T l = bcast<T>(lo), h = bcast<T>(hi);
  return x < l ? l : (x > h ? h : x);
}

// erf(x) for the GELU: z P(z^2) / Q(z^2) with z = x clamped to [-4, 4] (beyond 4,
// erf is 1 in float32 to within 2e-8), P and Q of degree 5 a rational fit of erf on
// [0, 4] for least relative error (2.8e-8 in exact arithmetic; about 3e-7 as float32
// evaluates it, as for XLA's own erf).
template <class T>
inline T erf_approx(T x) {
  const T z = clamp(x, -4.0f, 4.0f), t = z * z;
  T p = 1.9809459e-06f * t + 2.8510057e-04f;
  p = p * t + 3.9108736e-03f;
  p = p * t + 5.3187918e-02f;
  p = p * t + 1.9419850e-01f;
  p = p * t + 1.1283791e+00f;
  T q = 3.7386995e-05f * t + 1.1920546e-03f;
  q = q * t + 1.5263002e-02f;
  q = q * t + 1.1561976e-01f;
  q = q * t + 5.0543640e-01f;
  q = q * t + 1.0f;
  return clamp(z * p / q, -1.0f, 1.0f);
}

// the exact GELU, x (1 + erf(x / sqrt 2)) / 2, as torch writes it
template <class T>
inline T gelu(T x) {
  return 0.5f * x * (1.0f + erf_approx(x * 0.70710678118654752f));
}

// One row of n values of the product, in place: bias, GELU, LayerNorm (two passes
// for the variance, as torch's; partial sums in lanes).
void gelu_norm_row(float* row, const float* bias, const float* scale, const float* shift,
                   int64_t n, float eps) {
  F8 acc = F8{};
  int64_t j = 0;
  for (; j + kF8 <= n; j += kF8) {
    const F8 g = gelu(load8(row + j) + load8(bias + j));
    store8(row + j, g);
    acc += g;
  }
  float sum = lane_sum(acc);
  for (; j < n; j++) sum += row[j] = gelu(row[j] + bias[j]);
  const float mean = sum / static_cast<float>(n);
  F8 sq = F8{};
  for (j = 0; j + kF8 <= n; j += kF8) {
    const F8 d = load8(row + j) - mean;
    sq += d * d;
  }
  float ss = lane_sum(sq);
  for (; j < n; j++) ss += (row[j] - mean) * (row[j] - mean);
  const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (j = 0; j + kF8 <= n; j += kF8)
    store8(row + j, (load8(row + j) - mean) * rstd * load8(scale + j) + load8(shift + j));
  for (; j < n; j++) row[j] = (row[j] - mean) * rstd * scale[j] + shift[j];
}

ffi::Error GemmGeluNorm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                        ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> scale,
                        ffi::Buffer<ffi::F32> shift, ffi::ResultBuffer<ffi::F32> c,
                        ffi::ThreadPool pool, float eps) {
  Sgemm gemm;
  if (auto err = set_gemm(sgemm, "BLAS GEMM", gemm); err.failure()) return err;
  int64_t m, k, n;
  if (auto err = product_shape(a, b, "jax_dilated gemm_gelu_norm", m, k, n); err.failure()) {
    return err;
  }
  for (const auto* v : {&bias, &scale, &shift}) {
    if (v->dimensions().size() != 1 || v->dimensions()[0] != n) {
      return ffi::Error::InvalidArgument(
          "jax_dilated gemm_gelu_norm: bias, scale and shift must be vectors of b's columns");
    }
  }
  const float *pa = a.typed_data(), *pb = b.typed_data(), *pbias = bias.typed_data(),
              *pscale = scale.typed_data(), *pshift = shift.typed_data();
  float* pc = c->typed_data();
  const int ni = static_cast<int>(n), ki = static_cast<int>(k);
  for (int64_t r0 = 0; r0 < m; r0 += kEpilogueRows) {
    const int64_t rows = std::min(kEpilogueRows, m - r0);
    gemm(kRowMajor, kNoTrans, kNoTrans, static_cast<int>(rows), ni, ki, 1.0f, pa + r0 * k, ki,
         pb, ni, 0.0f, pc + r0 * n, ni);
    const int64_t units = (rows + kEpilogueUnit - 1) / kEpilogueUnit;
    jax_dilated::parallel_for<NoState>(pool, units, [=](int64_t u, NoState&) {
      const int64_t e = std::min(rows, (u + 1) * kEpilogueUnit);
      for (int64_t r = u * kEpilogueUnit; r < e; r++)
        gelu_norm_row(pc + (r0 + r) * n, pbias, pscale, pshift, n, eps);
    });
  }
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDilatedGemmGeluNormCpu, GemmGeluNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDilatedGemmBf16Cpu, GemmBf16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ctx<ffi::ThreadPool>());
