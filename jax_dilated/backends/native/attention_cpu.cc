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
// Two calls. The plain one (Forward): q [N, Lq, H, D], k and v [N, Lk, Hkv, D]
// (H % Hkv == 0, grouped-query heads read kv head h / (H / Hkv)), kv_valid [N, Lk]
// or [N, Lk, Hkv] (uint8, or an empty array for none), o [N, Lq, H, D], and per row
// [N, Lq, H] its maximum logit m and l = sum_t exp(s_pt - m), from which the caller
// forms lse = m + log l in two parts (core/softmax.py: extreme logits keep their
// precision); l = 0 for a row without keys. The dilated one (DilatedForward): every
// branch of LongNet's dilated attention (docs/semantics.md, section 2) on q [B, T,
// H, D], k, v [B, T, Hkv, D], each dilated segment an item whose rows are r
// positions apart, read where they lie and written into o, m, l [B, T, H, ...] in
// place; longnet's branches continue each row's softmax, so no merge is needed.
// D is a multiple of 16 up to 256.
//
// Work: items of (n, h, a run of query rows), shared by an atomic counter among the
// calling thread and tasks on XLA's intra-op thread pool (so a call uses the threads
// XLA was given and no more). Each item packs k^T of its kv head once (key blocks of
// BK), then for every tile of BQ query rows runs, per key block, S = q k^T on MR x 32
// register tiles, the online-softmax update on S in place (running max m, sum l; exp
// by a degree-7 polynomial and AVX-512's scalef), and O += P v on MR x 64 register
// tiles.
#if !defined(__AVX512F__) || !defined(__linux__)
#error "the native CPU kernel needs Linux on an x86-64 CPU with AVX-512"
#endif
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
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

// Where one (n, head) of a call has its rows: query row i is q + i q_stride (its
// output o + i q_stride, its statistics m, l + i stat_stride), key t is k, v +
// t kv_stride and its validity byte valid[t valid_stride] (valid nullptr: all valid).
// The plain call's items are the slices [n, :, h] of its arrays; a dilated branch's
// are the dilated segments of the whole sequence, rows r positions apart, read and
// written where they lie (no gather, no scatter).
struct Item {
  const float *q, *k, *v;
  const uint8_t* valid;
  float *o, *m, *l;
  int64_t q_stride, kv_stride, valid_stride, stat_stride, lq, lk;
};

struct Config {
  int64_t d;
  float scale, out_scale;  // the output written is out_scale times the normalised one
  bool causal;
  bool accumulate;  // continue each row's softmax from the (o, m, l) it holds
};

struct Scratch {
  std::vector<float> kt, s, qs, ot, mask;
  Scratch(int64_t max_lk, int64_t d)
      : kt(((max_lk + BK - 1) / BK) * d * BK), s(MR * BK), qs(BQ * d), ot(BQ * d), mask(BK) {}
};

// Rows [r0, r1) of one item.
void run_rows(const Config& cf, const Item& it, Scratch& w, int64_t r0, int64_t r1) {
  const int64_t d = cf.d;
  const int64_t kend_all = cf.causal ? std::min(it.lk, r1) : it.lk;
  // k^T of the keys this run can see, in blocks [block][d][BK], zero-padded
  for (int64_t b0 = 0; b0 < kend_all; b0 += BK) {
    float* kt = w.kt.data() + (b0 / BK) * d * BK;
    const int64_t nk = std::min<int64_t>(BK, kend_all - b0);
    for (int64_t t = 0; t < nk; t++) {
      const float* src = it.k + (b0 + t) * it.kv_stride;
      for (int64_t c = 0; c < d; c++) kt[c * BK + t] = src[c];
    }
    for (int64_t c = 0; c < d; c++)
      std::fill(kt + c * BK + nk, kt + c * BK + BK, 0.0f);
  }
  float m[BQ], l[BQ];
  for (int64_t q0 = r0; q0 < r1; q0 += BQ) {
    const int nq = (int)std::min<int64_t>(BQ, r1 - q0);
    const int nqp = (nq + MR - 1) / MR * MR;
    std::fill(w.ot.begin(), w.ot.begin() + nqp * d, 0.0f);
    for (int i = 0; i < nqp; i++) {
      m[i] = -INFINITY;
      l[i] = 0.0f;
      const float* src = it.q + (q0 + i) * it.q_stride;
      for (int64_t c = 0; c < d; c++) w.qs[i * d + c] = i < nq ? src[c] * cf.scale : 0.0f;
      const int64_t stat = (q0 + i) * it.stat_stride;
      if (cf.accumulate && i < nq && it.l[stat] > 0.0f) {
        // continue the row's softmax: unnormalise the output it holds
        m[i] = it.m[stat];
        l[i] = it.l[stat];
        const float* prev = it.o + (q0 + i) * it.q_stride;
        for (int64_t c = 0; c < d; c++) w.ot[i * d + c] = prev[c] * l[i];
      }
    }
    const int64_t kend = cf.causal ? std::min(it.lk, q0 + nq) : it.lk;
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
      const int nk = (int)std::min<int64_t>(BK, kend - k0);
      const int ncols = (nk + 31) / 32 * 32;
      // additive key mask of this block: padding columns and invalid keys (none: skip)
      const bool masked = ncols != nk || it.valid != nullptr;
      for (int j = 0; masked && j < ncols; j++) {
        bool ok = j < nk;
        if (ok && it.valid != nullptr) ok = it.valid[(k0 + j) * it.valid_stride] != 0;
        w.mask[j] = ok ? 0.0f : -INFINITY;
      }
      const bool diagonal = cf.causal && k0 + nk - 1 > q0;  // some key after some row
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
        pv_columns(w.s.data(), it.v + k0 * it.kv_stride, it.kv_stride, w.ot.data() + t0 * d,
                   (int)d, nk);
      }
    }
    for (int i = 0; i < nq; i++) {
      const float inv = l[i] > 0.0f ? cf.out_scale / l[i] : 0.0f;
      float* dst = it.o + (q0 + i) * it.q_stride;
      for (int64_t c = 0; c < d; c++) dst[c] = w.ot[i * d + c] * inv;
      const int64_t stat = (q0 + i) * it.stat_stride;
      it.m[stat] = m[i];
      it.l[stat] = l[i];
    }
  }
}

// units [0, count) of work shared by an atomic counter among the calling thread and
// tasks on XLA's intra-op thread pool (so a call uses the threads XLA was given and
// no more); each thread passes its own scratch (made by the first unit that needs
// it) to every unit it runs. Held by shared_ptr: a task that starts only after the
// caller has finished every unit (the pool was busy) finds none left and touches
// nothing else.
using Unit = std::function<void(int64_t, std::unique_ptr<Scratch>&)>;

struct Shared {
  Unit unit;
  int64_t count;
  std::atomic<int64_t> next{0}, done{0};
};

void drain(Shared& w) {
  std::unique_ptr<Scratch> scratch;
  for (;;) {
    const int64_t u = w.next.fetch_add(1);
    if (u >= w.count) return;
    w.unit(u, scratch);
    w.done.fetch_add(1, std::memory_order_release);
  }
}

void parallel_for(ffi::ThreadPool& pool, int64_t count, Unit unit) {
  if (count <= 0) return;
  auto w = std::make_shared<Shared>();
  w->unit = std::move(unit);
  w->count = count;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min<int64_t>(threads, count) - 1;
  for (int64_t i = 0; i < helpers; i++) pool.Schedule([w]() { drain(*w); });
  drain(*w);
  // every unit claimed; wait for those still running on other threads
  while (w->done.load(std::memory_order_acquire) < w->count) std::this_thread::yield();
}

// Attention over `count` items (item(i) says where item i's rows are, at most max_lq
// query and max_lk key rows), their rows cut into runs.
void run_items(const Config& cf, int64_t count, int64_t max_lq, int64_t max_lk,
               const std::function<Item(int64_t)>& item, ffi::ThreadPool& pool) {
  if (count == 0 || max_lq == 0) return;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // runs of query rows: at least 2 units per thread, never below BQ rows
  int64_t run_len = max_lq;
  while (run_len > BQ && count * ((max_lq + run_len - 1) / run_len) < 2 * threads)
    run_len = (run_len / 2 + BQ - 1) / BQ * BQ;
  const int64_t runs = (max_lq + run_len - 1) / run_len;
  parallel_for(pool, count * runs, [&, run_len, runs](int64_t u, std::unique_ptr<Scratch>& s) {
    // causal: the longest runs (the last rows) first
    const int64_t j = cf.causal ? runs - 1 - u / count : u / count;
    const Item it = item(u % count);
    if (j * run_len >= it.lq) return;
    if (!s) s = std::make_unique<Scratch>(max_lk, cf.d);
    run_rows(cf, it, *s, j * run_len, std::min(it.lq, (j + 1) * run_len));
  });
}

// q [..., L, C, D] and k [..., Lk, Ck, D] of one rank: N (the product of the leading
// axes), L, C, D, Lk and Ck.
struct Shapes {
  int64_t n, lq, h, d, lk, hkv;
};

ffi::Error read_shapes(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, Shapes& sh) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() < 4 || kd.size() != qd.size())
    return ffi::Error::InvalidArgument("q and k must be [..., L, H, D] of one rank");
  const size_t r = qd.size();
  sh.n = 1;
  for (size_t i = 0; i + 3 < r; i++) sh.n *= qd[i];
  sh.lq = qd[r - 3]; sh.h = qd[r - 2]; sh.d = qd[r - 1];
  sh.lk = kd[r - 3]; sh.hkv = kd[r - 2];
  if (sh.d % 16 != 0 || sh.d > MAX_D || kd[r - 1] != sh.d)
    return ffi::Error::InvalidArgument("head_dim must be a multiple of 16 up to 256");
  if (sh.hkv <= 0 || sh.h % sh.hkv)
    return ffi::Error::InvalidArgument("the query heads must be a multiple of the kv heads");
  return ffi::Error::Success();
}

// The plain call: o [N, Lq, H, D], m, l [N, Lq, H] for q [N, Lq, H, D], k, v
// [N, Lk, Hkv, D] and kv_valid empty, [N, Lk] or [N, Lk, Hkv].
ffi::Error Forward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::U8> kv_valid, float scale, bool causal,
                   ffi::ThreadPool pool, ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m,
                   ffi::ResultBuffer<ffi::F32> l) {
  Shapes sh;
  if (auto err = read_shapes(q, k, sh); err.failure()) return err;
  const uint8_t* valid = kv_valid.element_count() == 0 ? nullptr : kv_valid.typed_data();
  const int64_t vc = valid == nullptr ? 1 : (int64_t)kv_valid.element_count() / (sh.n * sh.lk);
  if (valid != nullptr && ((vc != 1 && vc != sh.hkv) ||
                           (int64_t)kv_valid.element_count() != sh.n * sh.lk * vc))
    return ffi::Error::InvalidArgument("kv_valid must be [N, Lk] or [N, Lk, Hkv]");
  const Config cf{sh.d, scale, 1.0f, causal, false};
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = o->typed_data(), *mp = m->typed_data(), *lp = l->typed_data();
  auto item = [=](int64_t nh) {
    const int64_t n = nh / sh.h, h = nh % sh.h, hk = h / (sh.h / sh.hkv);
    const int64_t qrow = (n * sh.lq * sh.h + h), krow = n * sh.lk * sh.hkv + hk;
    return Item{qp + qrow * sh.d, kp + krow * sh.d, vp + krow * sh.d,
                valid == nullptr ? nullptr : valid + n * sh.lk * vc + (vc == 1 ? 0 : hk),
                op + qrow * sh.d, mp + qrow, lp + qrow,
                sh.h * sh.d, sh.hkv * sh.d, vc, sh.h, sh.lq, sh.lk};
  };
  run_items(cf, sh.n * sh.h, sh.lq, sh.lk, item, pool);
  return ffi::Error::Success();
}

// Dilated attention, every branch in one call (docs/semantics.md, section 2):
// q [B, T, H, D], k, v [B, T, Hkv, D], kv_mask empty or [B, T]; branch b cuts the
// sequence into segments of segments[b] tokens and takes every rates[b]-th; its
// served heads are q_heads (at q_offsets), branch_heads[b] of them, reading kv heads
// kv_heads (at kv_offsets), branch_kv_heads[b] of them (grouped as in the plain
// call). A segment's positions past T do not exist: the dilated rows end there.
// accumulate (longnet): every branch continues each row's softmax, so o, m and l
// are those of one softmax over all the branches' keys; else (head_groups) each row
// is written by its one branch, the output times out_scale. Rows no branch selects
// get o = 0, m = -inf, l = 0.
ffi::Error DilatedForward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::U8> kv_mask,
                          ffi::Span<const int64_t> segments, ffi::Span<const int64_t> rates,
                          ffi::Span<const int64_t> branch_heads,
                          ffi::Span<const int64_t> q_heads, ffi::Span<const int64_t> q_offsets,
                          ffi::Span<const int64_t> branch_kv_heads,
                          ffi::Span<const int64_t> kv_heads,
                          ffi::Span<const int64_t> kv_offsets, float scale, bool causal,
                          bool accumulate, float out_scale, ffi::ThreadPool pool,
                          ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m,
                          ffi::ResultBuffer<ffi::F32> l) {
  Shapes sh;
  if (auto err = read_shapes(q, k, sh); err.failure()) return err;
  const int64_t b = sh.n, t = sh.lq, h = sh.h, hkv = sh.hkv, d = sh.d;
  if (sh.lk != t) return ffi::Error::InvalidArgument("q and k must have one length");
  const uint8_t* valid = kv_mask.element_count() == 0 ? nullptr : kv_mask.typed_data();
  if (valid != nullptr && (int64_t)kv_mask.element_count() != b * t)
    return ffi::Error::InvalidArgument("kv_mask must be [B, T]");
  const size_t nb = segments.size();
  if (rates.size() != nb || branch_heads.size() != nb || branch_kv_heads.size() != nb)
    return ffi::Error::InvalidArgument("one segment length, rate and head count per branch");
  int64_t q_total = 0, kv_total = 0;
  for (size_t i = 0; i < nb; i++) {
    if (segments[i] <= 0 || rates[i] <= 0 || segments[i] % rates[i] ||
        branch_heads[i] <= 0 || branch_kv_heads[i] <= 0 ||
        branch_heads[i] % branch_kv_heads[i])
      return ffi::Error::InvalidArgument("bad branch geometry");
    if ((int64_t)q_heads.size() < q_total + branch_heads[i] ||
        (int64_t)kv_heads.size() < kv_total + branch_kv_heads[i])
      return ffi::Error::InvalidArgument("one head and offset per served head");
    for (int64_t j = q_total; j < q_total + branch_heads[i]; j++)
      if (q_heads[j] < 0 || q_heads[j] >= h || q_offsets[j] < 0 || q_offsets[j] >= rates[i])
        return ffi::Error::InvalidArgument("query head or offset out of range");
    for (int64_t j = kv_total; j < kv_total + branch_kv_heads[i]; j++)
      if (kv_heads[j] < 0 || kv_heads[j] >= hkv || kv_offsets[j] < 0 ||
          kv_offsets[j] >= rates[i])
        return ffi::Error::InvalidArgument("kv head or offset out of range");
    q_total += branch_heads[i];
    kv_total += branch_kv_heads[i];
  }
  if ((int64_t)q_heads.size() != q_total || (int64_t)q_offsets.size() != q_total ||
      (int64_t)kv_heads.size() != kv_total || (int64_t)kv_offsets.size() != kv_total)
    return ffi::Error::InvalidArgument("one head and offset per served head");
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = o->typed_data(), *mp = m->typed_data(), *lp = l->typed_data();
  const int64_t rows = b * t * h, per = 16384;  // rows of (m, l) or o per fill unit
  parallel_for(pool, (rows + per - 1) / per, [=](int64_t u, std::unique_ptr<Scratch>&) {
    std::fill(mp + u * per, mp + std::min(rows, (u + 1) * per), -INFINITY);
    std::fill(lp + u * per, lp + std::min(rows, (u + 1) * per), 0.0f);
  });
  const Config cf{d, scale, out_scale, causal, accumulate};
  int64_t q_first = 0, kv_first = 0;
  for (size_t i = 0; i < nb; i++) {
    const int64_t w = segments[i], r = rates[i];
    const int64_t segs = (t + w - 1) / w, hs = branch_heads[i], hk = branch_kv_heads[i];
    // the dilated rows of segment s at offset off that exist: positions < T
    auto length = [=](int64_t s, int64_t off) {
      return std::clamp<int64_t>((t - s * w - off + r - 1) / r, 0, w / r);
    };
    const int64_t* qh = q_heads.begin() + q_first;
    const int64_t* qo = q_offsets.begin() + q_first;
    const int64_t* kh = kv_heads.begin() + kv_first;
    const int64_t* ko = kv_offsets.begin() + kv_first;
    auto item = [=](int64_t u) {
      const int64_t n = u / hs, j = u % hs, g = j / (hs / hk), bi = n / segs, s = n % segs;
      const int64_t qpos = bi * t + s * w + qo[j], kpos = bi * t + s * w + ko[g];
      const int64_t qrow = qpos * h + qh[j], krow = kpos * hkv + kh[g];
      return Item{qp + qrow * d, kp + krow * d, vp + krow * d,
                  valid == nullptr ? nullptr : valid + kpos,
                  op + qrow * d, mp + qrow, lp + qrow,
                  r * h * d, r * hkv * d, r, r * h, length(s, qo[j]), length(s, ko[g])};
    };
    run_items(cf, b * segs * hs, w / r, w / r, item, pool);
    q_first += hs;
    kv_first += hk;
  }
  // rows no branch selected (l = 0) hold no output yet
  parallel_for(pool, (rows + per - 1) / per, [=](int64_t u, std::unique_ptr<Scratch>&) {
    for (int64_t row = u * per; row < std::min(rows, (u + 1) * per); row++)
      if (lp[row] == 0.0f) std::fill(op + row * d, op + (row + 1) * d, 0.0f);
  });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDilatedAttentionDilatedForwardCpu, DilatedForward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::U8>>()   // kv_mask
                                  .Attr<ffi::Span<const int64_t>>("segments")
                                  .Attr<ffi::Span<const int64_t>>("rates")
                                  .Attr<ffi::Span<const int64_t>>("branch_heads")
                                  .Attr<ffi::Span<const int64_t>>("q_heads")
                                  .Attr<ffi::Span<const int64_t>>("q_offsets")
                                  .Attr<ffi::Span<const int64_t>>("branch_kv_heads")
                                  .Attr<ffi::Span<const int64_t>>("kv_heads")
                                  .Attr<ffi::Span<const int64_t>>("kv_offsets")
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<bool>("accumulate")
                                  .Attr<float>("out_scale")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m
                                  .Ret<ffi::Buffer<ffi::F32>>());  // l
