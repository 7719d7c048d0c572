// Blockwise online-softmax attention forward for x86-64 CPUs with AVX-512, float32,
// as an XLA FFI custom call (jax_dilated/backends/native/__init__.py builds and
// registers it). The mathematics is docs/semantics.md, section 1: for each query row
// p and the keys t it may attend to,
//     o_p = sum_t exp(s_pt - lse_p) v_t,   s_pt = scale q_p . k_t,
//     lse_p = log sum_t exp(s_pt),
// with o_p = 0 and lse_p = -inf for a row without keys. A key is allowed when
// kv_valid (if given) marks it and, for causal calls, when its index is at most the
// query's (positions are the indices 0..L-1 of the call, as the XLA kernel's default).
//
// Layouts: q [N, Lq, H, D], k and v [N, Lk, Hkv, D] (H % Hkv == 0, grouped-query
// heads read kv head h / (H / Hkv)), kv_valid [N, Lk] or [N, Lk, Hkv] (uint8, or an
// empty array for none), o [N, Lq, H, D], and per row [N, Lq, H] its maximum logit m
// and l = sum_t exp(s_pt - m), from which the caller forms lse = m + log l in two
// parts (core/softmax.py: extreme logits keep their precision); l = 0 for a row
// without keys. D is a multiple of 16 up to 256.
//
// Work: items of (n, h, a run of query rows), shared by an atomic counter among the
// calling thread and tasks on XLA's intra-op thread pool (so a call uses the threads
// XLA was given and no more). Each item packs k^T of its kv head once (key blocks of BK), then for every
// tile of BQ query rows runs, per key block, S = q k^T on MR x 32 register tiles,
// the online-softmax update on S in place (running max m, sum l; exp by a degree-6
// polynomial and AVX-512's scalef), and O += P v on MR x 64 register tiles.
#if !defined(__AVX512F__) || !defined(__linux__)
#error "the native CPU kernel needs Linux on an x86-64 CPU with AVX-512"
#endif
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int MR = 6;    // query rows per register tile
constexpr int BQ = 48;   // query rows per tile (a multiple of MR)
constexpr int BK = 512;  // keys per block (a multiple of 32; 256: 1-2.5% slower)
constexpr int MAX_D = 256;

inline __m512 exp512(__m512 x) {
  // exp(x) = 2^n e^r, n = round(x log2 e), |r| <= ln2 / 2; e^r by its Taylor
  // polynomial to degree 7 in Horner form (relative error below 2e-7).
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // exp underflows to 0 below
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2hi, x);
  r = _mm512_fnmadd_ps(n, ln2lo, r);
  __m512 p = _mm512_set1_ps(1.9841270e-4f);  // 1/7!
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3888889e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333333e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666667e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// s[MR][BK] = qs[MR][D] . kt[D][BK], for the first ncols (a multiple of 32) columns.
// Not inlined: its 12 accumulators get the registers to themselves.
__attribute__((noinline)) void qk_tile(const float* qs, const float* kt, float* s, int d_head,
                                       int ncols) {
  for (int c = 0; c < ncols; c += 32) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int d = 0; d < d_head; d++) {
      const __m512 b0 = _mm512_loadu_ps(kt + d * BK + c);
      const __m512 b1 = _mm512_loadu_ps(kt + d * BK + c + 16);
#pragma GCC unroll 6
      for (int r = 0; r < MR; r++) {
        const __m512 a = _mm512_set1_ps(qs[r * d_head + d]);
        acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; r++) {
      _mm512_storeu_ps(s + r * BK + c, acc[r][0]);
      _mm512_storeu_ps(s + r * BK + c + 16, acc[r][1]);
    }
  }
}

// o[MR][NV * 16] += p[MR][:nk] . v[:nk][NV * 16] (v rows vstride floats apart).
template <int NV>
__attribute__((noinline)) void pv_tile(const float* p, const float* v, int64_t vstride,
                                       float* o, int ostride, int nk) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NV; j++) acc[r][j] = _mm512_loadu_ps(o + r * ostride + 16 * j);
  for (int t = 0; t < nk; t++) {
    __m512 b[NV];
    for (int j = 0; j < NV; j++) b[j] = _mm512_loadu_ps(v + t * vstride + 16 * j);
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
      const __m512 a = _mm512_set1_ps(p[r * BK + t]);
      for (int j = 0; j < NV; j++) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NV; j++) _mm512_storeu_ps(o + r * ostride + 16 * j, acc[r][j]);
}

void pv_columns(const float* p, const float* v, int64_t vstride, float* o, int d_head, int nk) {
  int c = 0;
  for (; c + 64 <= d_head; c += 64) pv_tile<4>(p, v + c, vstride, o + c, d_head, nk);
  switch ((d_head - c) / 16) {
    case 3: pv_tile<3>(p, v + c, vstride, o + c, d_head, nk); break;
    case 2: pv_tile<2>(p, v + c, vstride, o + c, d_head, nk); break;
    case 1: pv_tile<1>(p, v + c, vstride, o + c, d_head, nk); break;
    default: break;
  }
}

struct Problem {
  const float *q, *k, *v;
  const uint8_t* valid;  // nullptr: every key valid
  int valid_heads;       // 1 ([N, Lk]) or Hkv ([N, Lk, Hkv])
  float *o, *m, *l;  // o normalised; m, l: each row's maximum and sum of exp(s - m)
  int64_t n, lq, lk, h, hkv, d;
  float scale;
  bool causal;
};

struct Scratch {
  std::vector<float> kt, s, qs, ot, mask;
  explicit Scratch(const Problem& pb)
      : kt(((pb.lk + BK - 1) / BK) * pb.d * BK), s(MR * BK), qs(BQ * pb.d), ot(BQ * pb.d),
        mask(BK) {}
};

// Rows [r0, r1) of head h of item n.
void run_rows(const Problem& pb, Scratch& w, int64_t n, int64_t h, int64_t r0, int64_t r1) {
  const int64_t d = pb.d, g = pb.h / pb.hkv, hk = h / g;
  const int64_t qrow = pb.h * d, kvrow = pb.hkv * d;
  const float* k = pb.k + n * pb.lk * kvrow + hk * d;
  const float* v = pb.v + n * pb.lk * kvrow + hk * d;
  const int64_t kend_all = pb.causal ? std::min(pb.lk, r1) : pb.lk;
  // k^T of the keys this run can see, in blocks [block][d][BK], zero-padded
  for (int64_t b0 = 0; b0 < kend_all; b0 += BK) {
    float* kt = w.kt.data() + (b0 / BK) * d * BK;
    const int64_t nk = std::min<int64_t>(BK, kend_all - b0);
    for (int64_t t = 0; t < nk; t++)
      for (int64_t c = 0; c < d; c++) kt[c * BK + t] = k[(b0 + t) * kvrow + c];
    for (int64_t c = 0; c < d; c++)
      std::fill(kt + c * BK + nk, kt + c * BK + BK, 0.0f);
  }
  float m[BQ], l[BQ];
  for (int64_t q0 = r0; q0 < r1; q0 += BQ) {
    const int nq = (int)std::min<int64_t>(BQ, r1 - q0);
    const int nqp = (nq + MR - 1) / MR * MR;
    for (int i = 0; i < nqp; i++) {
      m[i] = -INFINITY;
      l[i] = 0.0f;
      const float* src = pb.q + ((n * pb.lq + q0 + i) * pb.h + h) * d;
      for (int64_t c = 0; c < d; c++) w.qs[i * d + c] = i < nq ? src[c] * pb.scale : 0.0f;
    }
    std::fill(w.ot.begin(), w.ot.begin() + nqp * d, 0.0f);
    const int64_t kend = pb.causal ? std::min(pb.lk, q0 + nq) : pb.lk;
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
      const int nk = (int)std::min<int64_t>(BK, kend - k0);
      const int ncols = (nk + 31) / 32 * 32;
      // additive key mask of this block: padding columns and invalid keys (none: skip)
      const bool masked = ncols != nk || pb.valid != nullptr;
      for (int j = 0; masked && j < ncols; j++) {
        bool ok = j < nk;
        if (ok && pb.valid != nullptr)
          ok = pb.valid[(n * pb.lk + k0 + j) * pb.valid_heads +
                        (pb.valid_heads == 1 ? 0 : hk)] != 0;
        w.mask[j] = ok ? 0.0f : -INFINITY;
      }
      const bool diagonal = pb.causal && k0 + nk - 1 > q0;  // some key after some row
      const float* kt = w.kt.data() + (k0 / BK) * d * BK;
      for (int t0 = 0; t0 < nqp; t0 += MR) {
        qk_tile(w.qs.data() + t0 * d, kt, w.s.data(), (int)d, ncols);
        for (int r = 0; r < MR; r++) {
          const int i = t0 + r;
          float* sr = w.s.data() + r * BK;
          __m512 mx = _mm512_set1_ps(-INFINITY);
          if (masked) {
            for (int j = 0; j < ncols; j += 16) {
              __m512 x = _mm512_add_ps(_mm512_loadu_ps(sr + j),
                                       _mm512_loadu_ps(w.mask.data() + j));
              _mm512_storeu_ps(sr + j, x);
              mx = _mm512_max_ps(mx, x);
            }
          } else {
            for (int j = 0; j < ncols; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
          }
          if (i >= nq) {  // padding row
            std::fill(sr, sr + ncols, 0.0f);
            continue;
          }
          if (diagonal) {  // keys after the row's own index
            const int64_t first = q0 + i - k0 + 1;
            if (first < ncols) {
              std::fill(sr + std::max<int64_t>(first, 0), sr + ncols, -INFINITY);
              mx = _mm512_set1_ps(-INFINITY);
              for (int j = 0; j < ncols; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
            }
          }
          const float block_max = _mm512_reduce_max_ps(mx);
          const float m_new = std::max(m[i], block_max);
          if (m_new == -INFINITY) {  // nothing allowed yet: p = 0
            std::fill(sr, sr + ncols, 0.0f);
            continue;
          }
          const float alpha = std::exp(m[i] - m_new);  // exp(-inf) = 0 on the first
          const __m512 shift = _mm512_set1_ps(m_new);
          __m512 sum = _mm512_setzero_ps();
          for (int j = 0; j < ncols; j += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + j), shift));
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(sr + j, e);
          }
          l[i] = l[i] * alpha + _mm512_reduce_add_ps(sum);
          m[i] = m_new;
          if (alpha != 1.0f) {
            float* orow = w.ot.data() + i * d;
            const __m512 a = _mm512_set1_ps(alpha);
            for (int64_t c = 0; c < d; c += 16)
              _mm512_storeu_ps(orow + c, _mm512_mul_ps(a, _mm512_loadu_ps(orow + c)));
          }
        }
        pv_columns(w.s.data(), v + k0 * kvrow, kvrow, w.ot.data() + t0 * d, (int)d, nk);
      }
    }
    for (int i = 0; i < nq; i++) {
      const int64_t row = (n * pb.lq + q0 + i) * pb.h + h;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      float* dst = pb.o + row * d;
      for (int64_t c = 0; c < d; c++) dst[c] = w.ot[i * d + c] * inv;
      pb.m[row] = m[i];
      pb.l[row] = l[i];
    }
  }
}

// The items of one call, shared by the calling thread and the tasks it schedules on
// XLA's intra-op thread pool. Held by shared_ptr: a task that starts only after the
// caller has finished every item (the pool was busy) finds none left and touches
// nothing else.
struct Work {
  Problem pb;
  int64_t run_len, runs, heads, items;
  std::atomic<int64_t> next{0}, done{0};
};

void drain(Work& w) {
  std::unique_ptr<Scratch> scratch;  // made with the first item (a late task has none)
  for (;;) {
    const int64_t it = w.next.fetch_add(1);
    if (it >= w.items) return;
    if (!scratch) scratch = std::make_unique<Scratch>(w.pb);
    // causal: the longest runs (the last rows) first
    const int64_t j = w.pb.causal ? w.runs - 1 - it / w.heads : it / w.heads;
    const int64_t nh = it % w.heads;
    run_rows(w.pb, *scratch, nh / w.pb.h, nh % w.pb.h, j * w.run_len,
             std::min(w.pb.lq, (j + 1) * w.run_len));
    w.done.fetch_add(1, std::memory_order_release);
  }
}

void run(const Problem& pb, ffi::ThreadPool& pool) {
  auto w = std::make_shared<Work>();
  w->pb = pb;
  const int threads = (int)std::max<int64_t>(1, pool.num_threads());
  // runs of query rows: at least 2 items per thread, never below BQ rows
  w->heads = pb.n * pb.h;
  w->run_len = pb.lq;
  while (w->run_len > BQ && w->heads * ((pb.lq + w->run_len - 1) / w->run_len) < 2 * threads)
    w->run_len = (w->run_len / 2 + BQ - 1) / BQ * BQ;
  w->runs = (pb.lq + w->run_len - 1) / w->run_len;
  w->items = w->heads * w->runs;
  const int64_t helpers = std::min<int64_t>(threads, w->items) - 1;
  for (int64_t i = 0; i < helpers; i++) pool.Schedule([w]() { drain(*w); });
  drain(*w);
  // every item claimed; wait for those still running on other threads
  while (w->done.load(std::memory_order_acquire) < w->items) std::this_thread::yield();
}

ffi::Error Forward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::U8> kv_valid, float scale, bool causal,
                   ffi::ThreadPool pool, ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m,
                   ffi::ResultBuffer<ffi::F32> l) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() < 4 || kd.size() != qd.size())
    return ffi::Error::InvalidArgument("q and k must be [..., L, H, D] of one rank");
  const size_t r = qd.size();
  Problem pb;
  pb.n = 1;
  for (size_t i = 0; i + 3 < r; i++) pb.n *= qd[i];
  pb.lq = qd[r - 3]; pb.h = qd[r - 2]; pb.d = qd[r - 1];
  pb.lk = kd[r - 3]; pb.hkv = kd[r - 2];
  if (pb.d % 16 != 0 || pb.d > MAX_D || kd[r - 1] != pb.d || pb.hkv <= 0 || pb.h % pb.hkv)
    return ffi::Error::InvalidArgument("head_dim must be a multiple of 16 up to 256 and "
                                       "the query heads a multiple of the kv heads");
  pb.q = q.typed_data(); pb.k = k.typed_data(); pb.v = v.typed_data();
  pb.o = o->typed_data(); pb.m = m->typed_data(); pb.l = l->typed_data();
  pb.valid = kv_valid.element_count() == 0 ? nullptr : kv_valid.typed_data();
  pb.valid_heads = pb.valid == nullptr ? 1
                   : (int)(kv_valid.element_count() / (pb.n * pb.lk));
  if (pb.valid != nullptr && pb.valid_heads != 1 && pb.valid_heads != pb.hkv)
    return ffi::Error::InvalidArgument("kv_valid must be [N, Lk] or [N, Lk, Hkv]");
  pb.scale = scale;
  pb.causal = causal;
  if (pb.lq == 0 || pb.h == 0 || pb.n == 0) return ffi::Error::Success();
  run(pb, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDilatedAttentionForwardCpu, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::U8>>()   // kv_valid
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m
                                  .Ret<ffi::Buffer<ffi::F32>>());  // l
