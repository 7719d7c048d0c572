// Blockwise online-softmax attention for x86-64 CPUs with AVX-512, float32: the
// forward, and dilated attention's fused forward and backward, as XLA FFI custom
// calls (jax_dilated/backends/native/build.py builds and registers them). The
// mathematics is docs/semantics.md, section 1: for each query row p and the keys t
// it may attend to,
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
// place; longnet's branches continue each row's softmax, so no merge is needed, and
// nested branches compute each pair they share once (shared_pairs, Nesting below).
// D is a multiple of 16 up to 256.
//
// Work: items of (n, h, a run of query rows), shared by an atomic counter among the
// calling thread and tasks on XLA's intra-op thread pool (so a call uses the threads
// XLA was given and no more). Each item packs k^T of its kv head once (key blocks of
// BK), then for every tile of BQ query rows runs, per key block, S = q k^T on MR x 32
// register tiles, the online-softmax update on S in place (running max m, sum l; exp
// by a degree-7 polynomial and AVX-512's scalef), and O += P v on MR x 64 register
// tiles. The backward's items are (segment, kv head at one offset) and their query
// heads; it runs key blocks of BC against query tiles of BR (section "backward").
// The dilated calls ask for huge pages on their results (prefer_huge_pages).
#if !defined(__AVX512F__) || !defined(__linux__)
#error "the native CPU kernel needs Linux on an x86-64 CPU with AVX-512"
#endif
#include <immintrin.h>
#include <sys/mman.h>

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
// floats between the rows of a packed k^T block: BK plus one cache line, so that the
// transposing stores of one key (one per row) fall in different L1 sets (2 KiB apart
// they shared two, and packing was a large share of the forward)
constexpr int KTS = BK + 16;
constexpr int MAX_D = 256;
constexpr int BR = 96;   // backward: query rows per tile (a multiple of 32 and of MR)
constexpr int BC = 48;   // backward: keys per block (a multiple of MR)

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

// s[MR][ncols] = a[MR][D] . b[D][ncols], for the first ncols (a multiple of 32)
// columns; b's rows are BS floats apart, s's SS. Not inlined: its 12 accumulators
// get the registers to themselves.
template <int BS, int SS = BS>
__attribute__((noinline)) void qk_tile(const float* a, const float* b, float* s, int d_head,
                                       int ncols) {
  for (int c = 0; c < ncols; c += 32) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int d = 0; d < d_head; d++) {
      const __m512 b0 = _mm512_loadu_ps(b + d * BS + c);
      const __m512 b1 = _mm512_loadu_ps(b + d * BS + c + 16);
#pragma GCC unroll 6
      for (int r = 0; r < MR; r++) {
        const __m512 x = _mm512_set1_ps(a[r * d_head + d]);
        acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; r++) {
      _mm512_storeu_ps(s + r * SS + c, acc[r][0]);
      _mm512_storeu_ps(s + r * SS + c + 16, acc[r][1]);
    }
  }
}

// o[MR][NV * 16] += p[MR][:nk] . v[:nk][NV * 16], p's entry (r, t) at p[r PR + t PT]
// (a tile or its transpose), v's rows vstride floats apart, o's ostride.
template <int NV, int PR, int PT>
__attribute__((noinline)) void pv_tile(const float* p, const float* v, int64_t vstride,
                                       float* o, int64_t ostride, int nk) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NV; j++) acc[r][j] = _mm512_loadu_ps(o + r * ostride + 16 * j);
  for (int t = 0; t < nk; t++) {
    __m512 b[NV];
    for (int j = 0; j < NV; j++) b[j] = _mm512_loadu_ps(v + t * vstride + 16 * j);
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
      const __m512 a = _mm512_set1_ps(p[r * PR + t * PT]);
      for (int j = 0; j < NV; j++) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NV; j++) _mm512_storeu_ps(o + r * ostride + 16 * j, acc[r][j]);
}

// o[MR][D] += p[MR][:nk] . v[:nk][D], D in 64-column tiles and a last one of 16-48.
template <int PR, int PT>
void pv_columns(const float* p, const float* v, int64_t vstride, float* o, int64_t ostride,
                int d_head, int nk) {
  int c = 0;
  for (; c + 64 <= d_head; c += 64) pv_tile<4, PR, PT>(p, v + c, vstride, o + c, ostride, nk);
  switch ((d_head - c) / 16) {
    case 3: pv_tile<3, PR, PT>(p, v + c, vstride, o + c, ostride, nk); break;
    case 2: pv_tile<2, PR, PT>(p, v + c, vstride, o + c, ostride, nk); break;
    case 1: pv_tile<1, PR, PT>(p, v + c, vstride, o + c, ostride, nk); break;
    default: break;
  }
}

// Longnet's nested branches (shared_pairs; docs/semantics.md, section 7): the
// branches, finest first, form a chain in which each one's segments lie inside the
// next one's, its rate divides the next one's and every head's offsets agree, so a
// pair (p, t) that two branches let attend is also let by every branch between them.
// Each pair is then computed once, by the finest branch that has it, with weight
// m(p, t) exp(s_pt), m the number of branches that have it (Eq. 10's dense form,
// logit s + log m; m multiplies the exponential rather than log m joining a logit,
// which float32 would round where logits are large): a branch skips the keys in its
// query's segment of the finer branch, and m(p, t) = 1 + min(depth(p), depth(t)),
// depth(x) the number of coarser branches that select x (a prefix of them, by the
// nesting). One per (branch, query head).
struct Nesting {
  static constexpr int MAX = 16;
  int64_t finer_w = 0;  // the finer branch's segment length (0: none)
  int nc = 0;           // coarser branches: their rates and this head's offsets
  int64_t rc[MAX], oc[MAX];
  // the coarser branches that select position x (of the batch row)
  int depth(int64_t x) const {
    int n = 0;
    for (int c = 0; c < nc; c++) n += x % rc[c] == oc[c];
    return n;
  }
};

// The first index i >= 0 whose position pos0 + i step is at least x.
inline int64_t first_index_at(int64_t x, int64_t pos0, int64_t step) {
  return x <= pos0 ? 0 : (x - pos0 + step - 1) / step;
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
  // shared pairs (nullptr: none): the item's nesting, and the positions in the batch
  // row of query row i and key i, qpos0 + i step and kpos0 + i step
  const Nesting* nest = nullptr;
  int64_t qpos0 = 0, kpos0 = 0, step = 1;
};

struct Config {
  int64_t d;
  float scale, out_scale;  // the output written is out_scale times the normalised one
  bool causal;
  bool accumulate;  // continue each row's softmax from the (o, m, l) it holds
};

struct Scratch {
  // per key block: kmask, each key's additive mask (-inf for a padding column or an
  // invalid key, else 0); kmul, for rows of depth v = 1..nc (shared pairs), each
  // key's multiplicity m = 1 + min(v, depth) (Nesting)
  std::vector<float> kt, s, qs, ot, kmask, kmul;
  std::vector<uint8_t> block_masked, block_shared;  // some key masked; some key of depth > 0
  Scratch(int64_t max_lk, int64_t d)
      : kt(((max_lk + BK - 1) / BK) * d * KTS), s(MR * BK), qs(BQ * d), ot(BQ * d) {}
};

// Rows [r0, r1) of one item.
void run_rows(const Config& cf, const Item& it, Scratch& w, int64_t r0, int64_t r1) {
  const int64_t d = cf.d;
  const Nesting* ns = it.nest;
  const int nc = ns ? ns->nc : 0;
  const int64_t kend_all = cf.causal ? std::min(it.lk, r1) : it.lk;
  const int64_t nblocks = (kend_all + BK - 1) / BK;
  w.kmask.resize(nblocks * BK);
  if ((int64_t)w.kmul.size() < nblocks * nc * BK) w.kmul.resize(nblocks * nc * BK);
  w.block_masked.resize(nblocks);
  w.block_shared.resize(nblocks);
  // k^T of the keys this run can see, in blocks [block][d][KTS] (the first BK of each
  // row used), zero-padded, their mask and multiplicities
  for (int64_t b0 = 0; b0 < kend_all; b0 += BK) {
    float* kt = w.kt.data() + (b0 / BK) * d * KTS;
    const int64_t nk = std::min<int64_t>(BK, kend_all - b0);
    for (int64_t t = 0; t < nk; t++) {
      const float* src = it.k + (b0 + t) * it.kv_stride;
      for (int64_t c = 0; c < d; c++) kt[c * KTS + t] = src[c];
    }
    for (int64_t c = 0; c < d; c++)
      std::fill(kt + c * KTS + nk, kt + c * KTS + BK, 0.0f);
    float* km = w.kmul.data() + (b0 / BK) * nc * BK;
    bool masked = false, shared = false;
    for (int64_t j = 0; j < BK; j++) {
      const bool ok = j < nk && (it.valid == nullptr || it.valid[(b0 + j) * it.valid_stride]);
      masked |= !ok && j < (nk + 31) / 32 * 32;
      w.kmask[b0 + j] = ok ? 0.0f : -INFINITY;
      const int dt = ok && ns ? ns->depth(it.kpos0 + (b0 + j) * it.step) : 0;
      shared |= dt > 0;
      for (int v = 1; v <= nc; v++) km[(v - 1) * BK + j] = 1.0f + std::min(v, dt);
    }
    w.block_masked[b0 / BK] = masked;
    w.block_shared[b0 / BK] = shared;
  }
  float m[BQ], l[BQ];
  int depth[BQ];
  for (int64_t q0 = r0, q1; q0 < r1; q0 = q1) {
    // the tile: rows [q0, q1), with shared pairs all in one segment of the finer
    // branch, whose keys [e0, e1) the finer branch computes (skipped here)
    q1 = std::min(r1, q0 + BQ);
    int64_t e0 = 0, e1 = 0;
    if (ns && ns->finer_w) {
      const int64_t fw = ns->finer_w, seg = (it.qpos0 + q0 * it.step) / fw;
      q1 = std::min(q1, first_index_at((seg + 1) * fw, it.qpos0, it.step));
      e0 = std::min(it.lk, first_index_at(seg * fw, it.kpos0, it.step));
      e1 = std::min(it.lk, first_index_at((seg + 1) * fw, it.kpos0, it.step));
    }
    const int nq = (int)(q1 - q0);
    const int nqp = (nq + MR - 1) / MR * MR;
    const int64_t kend = cf.causal ? std::min(it.lk, q1) : it.lk;
    // shared pairs: a tile with no key of its own keeps the rows it continues as they are
    if (ns && (kend <= 0 || (e0 <= 0 && e1 >= kend))) continue;
    std::fill(w.ot.begin(), w.ot.begin() + nqp * d, 0.0f);
    for (int i = 0; i < nqp; i++) {
      m[i] = -INFINITY;
      l[i] = 0.0f;
      depth[i] = i < nq && ns ? ns->depth(it.qpos0 + (q0 + i) * it.step) : 0;
      const float* src = it.q + (q0 + i) * it.q_stride;
      const __m512 scale = _mm512_set1_ps(i < nq ? cf.scale : 0.0f);
      for (int64_t c = 0; c < d; c += 16)
        _mm512_storeu_ps(w.qs.data() + i * d + c,
                         i < nq ? _mm512_mul_ps(_mm512_loadu_ps(src + c), scale) : scale);
      const int64_t stat = (q0 + i) * it.stat_stride;
      if (cf.accumulate && i < nq && it.l[stat] > 0.0f) {
        // continue the row's softmax: unnormalise the output it holds
        m[i] = it.m[stat];
        l[i] = it.l[stat];
        const float* prev = it.o + (q0 + i) * it.q_stride;
        for (int64_t c = 0; c < d; c++) w.ot[i * d + c] = prev[c] * l[i];
      }
    }
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
      const int nk = (int)std::min<int64_t>(BK, kend - k0);
      // the block's columns [x0, x1) the finer branch computes
      const int64_t x0 = std::max(e0, k0) - k0, x1 = std::min(e1, k0 + nk) - k0;
      if (x0 <= 0 && x1 >= nk) continue;
      const bool cut = x1 > x0;
      const float* kmask = w.kmask.data() + k0;
      const float* kmul = w.kmul.data() + (k0 / BK) * nc * BK;
      const bool masked = w.block_masked[k0 / BK], shared = w.block_shared[k0 / BK];
      const float* kt = w.kt.data() + (k0 / BK) * d * KTS;
      for (int t0 = 0; t0 < nqp; t0 += MR) {
        // causal: the group's columns end at its last row's own index (the diagonal
        // block's keys after every row of the group are not computed)
        const int gk = cf.causal ? (int)std::min<int64_t>(nk, q0 + std::min(t0 + MR, nq) - k0)
                                 : nk;
        if (gk <= 0 || (x0 <= 0 && x1 >= gk)) continue;  // nothing of the block for it
        const int gcols = (gk + 31) / 32 * 32;
        qk_tile<KTS, BK>(w.qs.data() + t0 * d, kt, w.s.data(), (int)d, gcols);
        for (int r = 0; r < MR; r++) {
          const int i = t0 + r;
          float* sr = w.s.data() + r * BK;
          __m512 mx = _mm512_set1_ps(-INFINITY);
          if (masked) {
            for (int j = 0; j < gcols; j += 16) {
              __m512 x = _mm512_add_ps(_mm512_loadu_ps(sr + j), _mm512_loadu_ps(kmask + j));
              _mm512_storeu_ps(sr + j, x);
              mx = _mm512_max_ps(mx, x);
            }
          } else {
            for (int j = 0; j < gcols; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
          }
          if (i >= nq) {  // padding row
            std::fill(sr, sr + gcols, 0.0f);
            continue;
          }
          bool refill = false;
          if (cut && x0 < gk) {
            std::fill(sr + std::max<int64_t>(x0, 0), sr + std::min<int64_t>(x1, gk), -INFINITY);
            refill = true;
          }
          if (cf.causal) {  // keys after the row's own index (columns past gk included)
            const int64_t first = q0 + i - k0 + 1;
            if (first < gcols) {
              std::fill(sr + std::max<int64_t>(first, 0), sr + gcols, -INFINITY);
              refill = true;
            }
          }
          if (refill) {
            mx = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < gcols; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
          }
          const float block_max = _mm512_reduce_max_ps(mx);
          const float m_new = std::max(m[i], block_max);
          if (m_new == -INFINITY) {  // nothing allowed yet: p = 0
            std::fill(sr, sr + gcols, 0.0f);
            continue;
          }
          const float alpha = std::exp(m[i] - m_new);  // exp(-inf) = 0 on the first
          const __m512 shift = _mm512_set1_ps(m_new);
          __m512 sum = _mm512_setzero_ps();
          const int v = shared ? depth[i] : 0;  // p = m exp(s - max), m of the row's depth
          const float* mul = v > 0 ? kmul + (v - 1) * BK : nullptr;
          for (int j = 0; j < gcols; j += 16) {
            __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + j), shift));
            if (v > 0) e = _mm512_mul_ps(e, _mm512_loadu_ps(mul + j));
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
        pv_columns<BK, 1>(w.s.data(), it.v + k0 * it.kv_stride, it.kv_stride,
                          w.ot.data() + t0 * d, d, (int)d, gk);
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

// ------------------------------------------------------------------ backward
//
// Gradients from the forward's log-sum-exp (docs/semantics.md, section 1): with
// p = exp(s - lse) per row, dv = p^T do, dp = do v^T, ds = p (dp - delta),
// dq = scale ds k, dk = scale ds^T q, where the caller gives do' = c do and
// delta' = c delta with c = exp(-lse_lo) (core/softmax.py, backward_rows), so the
// rounded lse alone is read. Keys are the rows of the tiles (S^T = k q^T): the
// per-row statistics of the queries then run along the vector lanes, and every
// product is one of the two register tiles above with no transpose of p or ds.

// One query head of a backward item: row i of q, do and dq at + i q_stride, its
// lse, delta and c at + i stat_stride.
struct BwdHead {
  const float *q, *dout, *lse, *delta, *c;
  float* dq;
  const Nesting* nest;  // shared pairs: this head's (nullptr: none)
};

// The query heads that read one kv head at one offset of one dilated segment, and
// that kv head's rows: their gradients are this item's alone (within a branch).
struct BwdItem {
  std::vector<BwdHead> heads;
  const float *k, *v;
  const uint8_t* valid;
  float *dk, *dv;
  int64_t q_stride, stat_stride, kv_stride, valid_stride, lq, lk;
  int64_t pos0, step;  // row and key i lie at position pos0 + i step of the batch row
};

struct BwdScratch {
  // mult: for keys of depth v = 1..nc (shared pairs), each row's multiplicity m =
  // 1 + min(v, depth) (Nesting), rows padded
  std::vector<float> qst, qs, dot, dos, lse, delta, dq, kb, ks, vb, dk, dv, st, dpt, mult;
  std::vector<uint8_t> key_ok;
  std::vector<int> key_depth;
  std::vector<int64_t> key_cut0, key_cut1;  // the rows that share key t with the finer branch
  BwdScratch(int64_t max_lq, int64_t max_lk, int64_t d) {
    const int64_t lqp = (max_lq + BR - 1) / BR * BR, lkp = (max_lk + BC - 1) / BC * BC;
    for (auto* x : {&qst, &qs, &dot, &dos, &dq}) x->resize(lqp * d);
    lse.resize(lqp); delta.resize(lqp);
    for (auto* x : {&kb, &ks, &vb}) x->resize(BC * d);
    dk.resize(lkp * d); dv.resize(lkp * d);
    st.resize(BC * BR); dpt.resize(BC * BR);
    key_ok.resize(BC);
    key_depth.resize(BC);
    key_cut0.resize(BC);
    key_cut1.resize(BC);
  }
};

void backward_item(const Config& cf, const BwdItem& it, BwdScratch& w) {
  const int64_t d = cf.d, lq = it.lq, lk = it.lk;
  if (lq == 0 || lk == 0) return;
  const int64_t nqt = (lq + BR - 1) / BR, nkb = (lk + BC - 1) / BC, lqp = nqt * BR;
  std::fill(w.dk.begin(), w.dk.begin() + nkb * BC * d, 0.0f);
  std::fill(w.dv.begin(), w.dv.begin() + nkb * BC * d, 0.0f);
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (const BwdHead& hd : it.heads) {
    const Nesting* ns = hd.nest;
    const int nc = ns ? ns->nc : 0;
    if ((int64_t)w.mult.size() < nc * lqp) w.mult.resize(nc * lqp);
    // the head's query side, packed once: scale q and c do as rows and as
    // transposed tiles [tile][D][BR]; padding rows hold 0 and lse = +inf (p = 0)
    for (int64_t i = 0; i < lqp; i++) {
      const bool real = i < lq;
      const float ci = real ? hd.c[i * it.stat_stride] : 0.0f;
      const float* qrow = hd.q + i * it.q_stride;
      const float* drow = hd.dout + i * it.q_stride;
      float* qt = w.qst.data() + (i / BR) * d * BR + i % BR;
      float* dt = w.dot.data() + (i / BR) * d * BR + i % BR;
      for (int64_t c = 0; c < d; c++) {
        const float qv = real ? qrow[c] * cf.scale : 0.0f, dv = real ? drow[c] * ci : 0.0f;
        w.qs[i * d + c] = qv; qt[c * BR] = qv;
        w.dos[i * d + c] = dv; dt[c * BR] = dv;
      }
      w.lse[i] = real ? hd.lse[i * it.stat_stride] : INFINITY;
      const int dp = real && ns ? ns->depth(it.pos0 + i * it.step) : 0;
      for (int v = 1; v <= nc; v++) w.mult[(v - 1) * lqp + i] = 1.0f + std::min(v, dp);
      w.delta[i] = real ? hd.delta[i * it.stat_stride] : 0.0f;
    }
    std::fill(w.dq.begin(), w.dq.begin() + lqp * d, 0.0f);
    for (int64_t kb = 0; kb < nkb; kb++) {
      const int64_t k0 = kb * BC, nk = std::min<int64_t>(BC, lk - k0);
      for (int64_t t = 0; t < BC; t++) {
        const bool real = t < nk;
        const float* krow = it.k + (k0 + t) * it.kv_stride;
        const float* vrow = it.v + (k0 + t) * it.kv_stride;
        const __m512 zero = _mm512_setzero_ps(), scale = _mm512_set1_ps(cf.scale);
        for (int64_t c = 0; c < d; c += 16) {
          const __m512 kx = real ? _mm512_loadu_ps(krow + c) : zero;
          _mm512_storeu_ps(w.kb.data() + t * d + c, kx);
          _mm512_storeu_ps(w.ks.data() + t * d + c, _mm512_mul_ps(kx, scale));
          _mm512_storeu_ps(w.vb.data() + t * d + c, real ? _mm512_loadu_ps(vrow + c) : zero);
        }
        w.key_ok[t] = real && (it.valid == nullptr || it.valid[(k0 + t) * it.valid_stride]);
        const int64_t pos = it.pos0 + (k0 + t) * it.step;
        w.key_depth[t] = real && ns ? ns->depth(pos) : 0;
        w.key_cut0[t] = w.key_cut1[t] = 0;
        if (real && ns && ns->finer_w) {  // the rows in the key's segment of the finer branch
          const int64_t seg = pos / ns->finer_w;
          w.key_cut0[t] = first_index_at(seg * ns->finer_w, it.pos0, it.step);
          w.key_cut1[t] = std::min(lq, first_index_at((seg + 1) * ns->finer_w, it.pos0, it.step));
        }
      }
      // causal: the tiles whose last row reaches the block's first key
      for (int64_t qt = cf.causal ? k0 / BR : 0; qt < nqt; qt++) {
        const int64_t q0 = qt * BR, q1 = std::min(lq, q0 + BR);
        // shared pairs: skip a tile all of whose pairs with the block are the finer
        // branch's (the block's first and last keys cut it whole)
        if (w.key_cut0[0] <= q0 && w.key_cut1[0] >= q1 && w.key_cut0[nk - 1] <= q0 &&
            w.key_cut1[nk - 1] >= q1)
          continue;
        const float* qst = w.qst.data() + qt * d * BR;
        const float* dot = w.dot.data() + qt * d * BR;
        for (int t0 = 0; t0 < BC; t0 += MR) {
          qk_tile<BR>(w.kb.data() + t0 * d, qst, w.st.data() + t0 * BR, (int)d, BR);
          qk_tile<BR>(w.vb.data() + t0 * d, dot, w.dpt.data() + t0 * BR, (int)d, BR);
        }
        // p^T = exp(s^T - lse) (times m(p, t) with shared pairs) and
        // ds^T = p^T (dp^T - delta), in place
        for (int t = 0; t < BC; t++) {
          float* sr = w.st.data() + t * BR;
          float* dr = w.dpt.data() + t * BR;
          if (!w.key_ok[t]) {
            std::fill(sr, sr + BR, 0.0f);
            std::fill(dr, dr + BR, 0.0f);
            continue;
          }
          const int v = w.key_depth[t];  // p = m exp(s - lse), m of the key's depth
          const float* mul = v > 0 ? w.mult.data() + (v - 1) * lqp + q0 : nullptr;
          const __m512 key = _mm512_set1_ps((float)(k0 + t - q0));
          const bool cut = w.key_cut0[t] < q1 && w.key_cut1[t] > q0;
          const __m512 cut0 = _mm512_set1_ps((float)(w.key_cut0[t] - q0));
          const __m512 cut1 = _mm512_set1_ps((float)(w.key_cut1[t] - q0));
          for (int c = 0; c < BR; c += 16) {
            __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + c),
                                            _mm512_loadu_ps(w.lse.data() + q0 + c)));
            if (v > 0) p = _mm512_mul_ps(p, _mm512_loadu_ps(mul + c));
            const __m512 row = _mm512_add_ps(lane, _mm512_set1_ps((float)c));
            if (cf.causal) {  // rows before the key see nothing of it
              p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(row, key, _CMP_GE_OQ), p);
            }
            if (cut) {  // rows that share the key with the finer branch: its pairs
              const __mmask16 shared = _mm512_cmp_ps_mask(row, cut0, _CMP_GE_OQ) &
                                       _mm512_cmp_ps_mask(row, cut1, _CMP_LT_OQ);
              p = _mm512_maskz_mov_ps(~shared, p);
            }
            const __m512 ds = _mm512_mul_ps(
                p, _mm512_sub_ps(_mm512_loadu_ps(dr + c), _mm512_loadu_ps(w.delta.data() + q0 + c)));
            _mm512_storeu_ps(sr + c, p);
            _mm512_storeu_ps(dr + c, ds);
          }
        }
        for (int t0 = 0; t0 < BC; t0 += MR) {
          // dv += p^T do', dk += ds^T (scale q)
          pv_columns<BR, 1>(w.st.data() + t0 * BR, w.dos.data() + q0 * d, d,
                            w.dv.data() + (k0 + t0) * d, d, (int)d, BR);
          pv_columns<BR, 1>(w.dpt.data() + t0 * BR, w.qs.data() + q0 * d, d,
                            w.dk.data() + (k0 + t0) * d, d, (int)d, BR);
        }
        for (int r0 = 0; r0 < BR; r0 += MR)  // dq += ds (scale k): ds read transposed
          pv_columns<1, BR>(w.dpt.data() + r0, w.ks.data(), d, w.dq.data() + (q0 + r0) * d, d,
                            (int)d, BC);
      }
    }
    for (int64_t i = 0; i < lq; i++) {
      float* dst = hd.dq + i * it.q_stride;
      for (int64_t c = 0; c < d; c++) dst[c] += w.dq[i * d + c];
    }
  }
  for (int64_t t = 0; t < lk; t++) {
    float* dkr = it.dk + t * it.kv_stride;
    float* dvr = it.dv + t * it.kv_stride;
    for (int64_t c = 0; c < d; c++) {
      dkr[c] += w.dk[t * d + c];
      dvr[c] += w.dv[t * d + c];
    }
  }
}

// units [0, count) of work shared by an atomic counter among the calling thread and
// tasks on XLA's intra-op thread pool (so a call uses the threads XLA was given and
// no more); each thread passes its own scratch (made by the first unit that needs
// it) to every unit it runs. Held by shared_ptr: a task that starts only after the
// caller has finished every unit (the pool was busy) finds none left and touches
// nothing else.
struct ThreadScratch {
  std::unique_ptr<Scratch> fwd;
  std::unique_ptr<BwdScratch> bwd;
};
using Unit = std::function<void(int64_t, ThreadScratch&)>;

struct Shared {
  Unit unit;
  int64_t count;
  std::atomic<int64_t> next{0}, done{0};
};

void drain(Shared& w) {
  ThreadScratch scratch;
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
  parallel_for(pool, count * runs, [&, run_len, runs](int64_t u, ThreadScratch& ts) {
    // causal: the longest runs (the last rows) first
    const int64_t j = cf.causal ? runs - 1 - u / count : u / count;
    const Item it = item(u % count);
    if (j * run_len >= it.lq) return;
    if (!ts.fwd) ts.fwd = std::make_unique<Scratch>(max_lk, cf.d);
    run_rows(cf, it, *ts.fwd, j * run_len, std::min(it.lq, (j + 1) * run_len));
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

// The branches of a dilated call (docs/semantics.md, section 2), from the calls'
// attributes: branch b cuts the sequence into segments of segments[b] tokens and
// takes every rates[b]-th; its served query heads are the next branch_heads[b] of
// q_heads (at q_offsets), reading the next branch_kv_heads[b] of kv_heads (at
// kv_offsets), grouped as in the plain call. A segment's positions past T do not
// exist: its dilated rows end there.
struct Branch {
  int64_t w, r, hs, hk;
  const int64_t *qh, *qo, *kh, *ko;
  int64_t segments(int64_t t) const { return (t + w - 1) / w; }
  // the most dilated rows a segment has at any offset (r need not divide w)
  int64_t max_rows() const { return (w + r - 1) / r; }
  // the dilated rows of segment s at offset off that exist: ceil((w - off) / r) in a
  // whole segment, fewer where the segment ends at t
  int64_t rows(int64_t t, int64_t s, int64_t off) const {
    return std::clamp<int64_t>((t - s * w - off + r - 1) / r, 0, (w - off + r - 1) / r);
  }
};

using Ints = ffi::Span<const int64_t>;

ffi::Error read_branches(Ints segments, Ints rates, Ints branch_heads, Ints q_heads,
                         Ints q_offsets, Ints branch_kv_heads, Ints kv_heads, Ints kv_offsets,
                         int64_t h, int64_t hkv, std::vector<Branch>& out) {
  const size_t nb = segments.size();
  if (rates.size() != nb || branch_heads.size() != nb || branch_kv_heads.size() != nb)
    return ffi::Error::InvalidArgument("one segment length, rate and head count per branch");
  if (q_heads.size() != q_offsets.size() || kv_heads.size() != kv_offsets.size())
    return ffi::Error::InvalidArgument("one offset per served head");
  int64_t qf = 0, kf = 0;
  for (size_t i = 0; i < nb; i++) {
    const Branch br{segments[i], rates[i], branch_heads[i], branch_kv_heads[i],
                    q_heads.begin() + qf, q_offsets.begin() + qf,
                    kv_heads.begin() + kf, kv_offsets.begin() + kf};
    if (br.w <= 0 || br.r <= 0 || br.hs <= 0 || br.hk <= 0 || br.hs % br.hk ||
        qf + br.hs > (int64_t)q_heads.size() || kf + br.hk > (int64_t)kv_heads.size())
      return ffi::Error::InvalidArgument("bad branch geometry");
    for (int64_t j = 0; j < br.hs; j++)
      if (br.qh[j] < 0 || br.qh[j] >= h || br.qo[j] < 0 || br.qo[j] >= br.r)
        return ffi::Error::InvalidArgument("query head or offset out of range");
    for (int64_t g = 0; g < br.hk; g++)
      if (br.kh[g] < 0 || br.kh[g] >= hkv || br.ko[g] < 0 || br.ko[g] >= br.r)
        return ffi::Error::InvalidArgument("kv head or offset out of range");
    out.push_back(br);
    qf += br.hs;
    kf += br.hk;
  }
  if (qf != (int64_t)q_heads.size() || kf != (int64_t)kv_heads.size())
    return ffi::Error::InvalidArgument("one head and offset per served head");
  return ffi::Error::Success();
}

// q [B, T, H, D], k [B, T, Hkv, D] and kv_mask empty or [B, T]: their shapes.
ffi::Error read_dilated(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                        ffi::Buffer<ffi::U8>& kv_mask, Shapes& sh, const uint8_t*& valid) {
  if (auto err = read_shapes(q, k, sh); err.failure()) return err;
  if (sh.lk != sh.lq) return ffi::Error::InvalidArgument("q and k must have one length");
  valid = kv_mask.element_count() == 0 ? nullptr : kv_mask.typed_data();
  if (valid != nullptr && (int64_t)kv_mask.element_count() != sh.n * sh.lq)
    return ffi::Error::InvalidArgument("kv_mask must be [B, T]");
  return ffi::Error::Success();
}

// Transparent huge pages for a result buffer (where the system's mode is "madvise"):
// XLA hands out fresh pages for large buffers every call, and the first touch of each
// 4 KiB page faulted; the 2 MiB-aligned interior of the buffer is asked to fault 2 MiB
// at a time. Only a hint: nothing changes where the system says no.
void prefer_huge_pages(void* p, size_t bytes) {
  constexpr uintptr_t huge = uintptr_t(1) << 21;
  const uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1);
  const uintptr_t e = ((uintptr_t)p + bytes) & ~(huge - 1);
  if (e > a) madvise((void*)a, e - a, MADV_HUGEPAGE);
}

// Rows [0, rows) of `count` arrays of `widths[i]` floats per row set to `values[i]`,
// in parallel.
void fill_rows(ffi::ThreadPool& pool, int64_t rows, std::vector<float*> arrays,
               std::vector<int64_t> widths, std::vector<float> values) {
  const int64_t per = 4096;
  parallel_for(pool, (rows + per - 1) / per, [=](int64_t u, ThreadScratch&) {
    const int64_t r0 = u * per, r1 = std::min(rows, (u + 1) * per);
    for (size_t i = 0; i < arrays.size(); i++)
      std::fill(arrays[i] + r0 * widths[i], arrays[i] + r1 * widths[i], values[i]);
  });
}

// shared_pairs: the Nesting of every branch (in the order given, finest first) and
// query head, branch b's head j at [b H + j]; an error unless the branches form the
// chain Nesting describes (every branch serves every query head once; the next
// branch's segments are multiples of this one's, or one segment of the whole
// sequence; its rate a multiple of this one's; each head's offsets agree).
ffi::Error read_nestings(const std::vector<Branch>& brs, int64_t t, int64_t h,
                         std::vector<Nesting>& out) {
  const int64_t nb = (int64_t)brs.size();
  if (nb - 1 > Nesting::MAX) return ffi::Error::InvalidArgument("too many branches");
  std::vector<int64_t> off(nb * h, -1);
  for (int64_t b = 0; b < nb; b++) {
    for (int64_t j = 0; j < brs[b].hs; j++) off[b * h + brs[b].qh[j]] = brs[b].qo[j];
    for (int64_t j = 0; j < h; j++)
      if (brs[b].hs != h || off[b * h + j] < 0)
        return ffi::Error::InvalidArgument("shared pairs: every branch serves every head once");
  }
  for (int64_t b = 1; b < nb; b++) {
    const Branch &f = brs[b - 1], &c = brs[b];
    // (a rate that does not divide its segment shifts the next segment's columns)
    bool nested = (c.w % f.w == 0 || c.segments(t) == 1) && c.r % f.r == 0 &&
                  f.w % f.r == 0 && c.w % c.r == 0;
    for (int64_t j = 0; j < h; j++) nested &= off[b * h + j] % f.r == off[(b - 1) * h + j];
    if (!nested) return ffi::Error::InvalidArgument("shared pairs: the branches are not nested");
  }
  out.assign(nb * h, Nesting{});
  for (int64_t b = 0; b < nb; b++)
    for (int64_t j = 0; j < h; j++) {
      Nesting& n = out[b * h + j];
      n.finer_w = b > 0 ? brs[b - 1].w : 0;
      for (int64_t c = b + 1; c < nb; c++, n.nc++) {
        n.rc[n.nc] = brs[c].r;
        n.oc[n.nc] = off[c * h + j];
      }
    }
  return ffi::Error::Success();
}

// shared_pairs: whether branch b computes no pair (the finer branch is one segment
// of the whole sequence, so it has every pair of b)
bool all_pairs_finer(const std::vector<Branch>& brs, size_t b, int64_t t) {
  return b > 0 && brs[b - 1].segments(t) == 1;
}

// Dilated attention's forward, every branch in one call: q [B, T, H, D], k, v
// [B, T, Hkv, D], kv_mask empty or [B, T], the branches' attributes (read_branches).
// Each dilated segment of each served head is an item whose rows are r positions
// apart, read where they lie and written into o, m, l in place. accumulate
// (longnet): every branch continues each row's softmax, so o, m and l are those of
// one softmax over all the branches' keys; else (head_groups) each row is written by
// its one branch, the output times out_scale. Rows no branch selects get o = 0,
// m = -inf, l = 0.
ffi::Error DilatedForward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::U8> kv_mask, Ints segments,
                          Ints rates, Ints branch_heads, Ints q_heads, Ints q_offsets,
                          Ints branch_kv_heads, Ints kv_heads, Ints kv_offsets, float scale,
                          bool causal, bool accumulate, float out_scale, bool shared_pairs,
                          ffi::ThreadPool pool,
                          ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m,
                          ffi::ResultBuffer<ffi::F32> l) {
  Shapes sh;
  const uint8_t* valid;
  if (auto err = read_dilated(q, k, kv_mask, sh, valid); err.failure()) return err;
  std::vector<Branch> branches;
  if (auto err = read_branches(segments, rates, branch_heads, q_heads, q_offsets,
                               branch_kv_heads, kv_heads, kv_offsets, sh.h, sh.hkv, branches);
      err.failure())
    return err;
  const int64_t b = sh.n, t = sh.lq, h = sh.h, hkv = sh.hkv, d = sh.d;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = o->typed_data(), *mp = m->typed_data(), *lp = l->typed_data();
  std::vector<Nesting> nests;
  if (shared_pairs) {
    if (!accumulate) return ffi::Error::InvalidArgument("shared pairs need accumulate");
    if (auto err = read_nestings(branches, t, h, nests); err.failure()) return err;
  }
  prefer_huge_pages(op, o->size_bytes());
  fill_rows(pool, b * t * h, {mp, lp}, {1, 1}, {-INFINITY, 0.0f});
  const Config cf{d, scale, out_scale, causal, accumulate};
  for (size_t ib = 0; ib < branches.size(); ib++) {
    const Branch& br = branches[ib];
    if (shared_pairs && all_pairs_finer(branches, ib, t)) continue;
    const Nesting* nest = shared_pairs ? nests.data() + ib * h : nullptr;
    const int64_t segs = br.segments(t), r = br.r;
    auto item = [=](int64_t u) {
      const int64_t n = u / br.hs, j = u % br.hs, g = j / (br.hs / br.hk);
      const int64_t bi = n / segs, s = n % segs;
      const int64_t qpos = bi * t + s * br.w + br.qo[j], kpos = bi * t + s * br.w + br.ko[g];
      const int64_t qrow = qpos * h + br.qh[j], krow = kpos * hkv + br.kh[g];
      return Item{qp + qrow * d, kp + krow * d, vp + krow * d,
                  valid == nullptr ? nullptr : valid + kpos,
                  op + qrow * d, mp + qrow, lp + qrow,
                  r * h * d, r * hkv * d, r, r * h, br.rows(t, s, br.qo[j]), br.rows(t, s, br.ko[g]),
                  nest == nullptr ? nullptr : nest + br.qh[j], qpos - bi * t, kpos - bi * t, r};
    };
    run_items(cf, b * segs * br.hs, br.max_rows(), br.max_rows(), item, pool);
  }
  // rows no branch selected (l = 0) hold no output yet
  const int64_t rows = b * t * h, per = 16384;
  parallel_for(pool, (rows + per - 1) / per, [=](int64_t u, ThreadScratch&) {
    for (int64_t row = u * per; row < std::min(rows, (u + 1) * per); row++)
      if (lp[row] == 0.0f) std::fill(op + row * d, op + (row + 1) * d, 0.0f);
  });
  return ffi::Error::Success();
}

// Dilated attention's backward, every branch in one call: q, k, v, kv_mask and the
// branches as for DilatedForward; dout [B, T, H, D] and per row [B, T, H] c, lse
// (the rounded log-sum-exp of the whole call, 0 for a row without keys) and delta
// (section "backward" above). dq, dk, dv are the sums over the branches; an item is
// one dilated segment of one kv head at one offset with the query heads that read
// it, so within a branch no two items write one row.
ffi::Error DilatedBackward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> dout,
                           ffi::Buffer<ffi::F32> c, ffi::Buffer<ffi::F32> lse,
                           ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::U8> kv_mask,
                           Ints segments, Ints rates, Ints branch_heads, Ints q_heads,
                           Ints q_offsets, Ints branch_kv_heads, Ints kv_heads, Ints kv_offsets,
                           float scale, bool causal, bool shared_pairs, ffi::ThreadPool pool,
                           ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                           ffi::ResultBuffer<ffi::F32> dv) {
  Shapes sh;
  const uint8_t* valid;
  if (auto err = read_dilated(q, k, kv_mask, sh, valid); err.failure()) return err;
  if (dout.element_count() != q.element_count() ||
      c.element_count() * sh.d != q.element_count() ||
      lse.element_count() != c.element_count() || delta.element_count() != c.element_count())
    return ffi::Error::InvalidArgument("dout must be shaped as q, c, lse and delta as its rows");
  std::vector<Branch> branches;
  if (auto err = read_branches(segments, rates, branch_heads, q_heads, q_offsets,
                               branch_kv_heads, kv_heads, kv_offsets, sh.h, sh.hkv, branches);
      err.failure())
    return err;
  const int64_t b = sh.n, t = sh.lq, h = sh.h, hkv = sh.hkv, d = sh.d;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *dop = dout.typed_data(), *cp = c.typed_data(), *lsep = lse.typed_data(),
              *deltap = delta.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  for (auto* buf : {&dq, &dk, &dv}) prefer_huge_pages((*buf)->untyped_data(), (*buf)->size_bytes());
  fill_rows(pool, b * t, {dqp, dkp, dvp}, {h * d, hkv * d, hkv * d}, {0.0f, 0.0f, 0.0f});
  std::vector<Nesting> nests;
  if (shared_pairs)
    if (auto err = read_nestings(branches, t, h, nests); err.failure()) return err;
  const Config cf{d, scale, 1.0f, causal, false};
  int64_t max_l = 0;
  for (const Branch& br : branches) max_l = std::max(max_l, br.max_rows());
  for (size_t ib = 0; ib < branches.size(); ib++) {
    const Branch& br = branches[ib];
    if (shared_pairs && all_pairs_finer(branches, ib, t)) continue;
    const Nesting* nest = shared_pairs ? nests.data() + ib * h : nullptr;
    // the kv (offset, head) pairs of the branch and the query heads reading each
    std::vector<std::pair<int64_t, int64_t>> pairs;
    std::vector<std::vector<int64_t>> readers;
    for (int64_t j = 0; j < br.hs; j++) {
      const int64_t g = j / (br.hs / br.hk);
      const std::pair<int64_t, int64_t> key{br.ko[g], br.kh[g]};
      const size_t at = std::find(pairs.begin(), pairs.end(), key) - pairs.begin();
      if (at == pairs.size()) { pairs.push_back(key); readers.emplace_back(); }
      readers[at].push_back(j);
    }
    const int64_t segs = br.segments(t), r = br.r, np = (int64_t)pairs.size();
    parallel_for(pool, b * segs * np, [&, segs, r, np](int64_t u, ThreadScratch& ts) {
      const int64_t n = u / np, pi = u % np, bi = n / segs, s = n % segs;
      const int64_t kpos = bi * t + s * br.w + pairs[pi].first;
      const int64_t krow = kpos * hkv + pairs[pi].second;
      BwdItem it{{}, kp + krow * d, vp + krow * d, valid == nullptr ? nullptr : valid + kpos,
                 dkp + krow * d, dvp + krow * d, r * h * d, r * h, r * hkv * d, r, 0,
                 br.rows(t, s, pairs[pi].first), kpos - bi * t, r};
      for (int64_t j : readers[pi]) {
        const int64_t qrow = (bi * t + s * br.w + br.qo[j]) * h + br.qh[j];
        it.heads.push_back({qp + qrow * d, dop + qrow * d, lsep + qrow, deltap + qrow,
                            cp + qrow, dqp + qrow * d, nest == nullptr ? nullptr : nest + br.qh[j]});
        it.lq = br.rows(t, s, br.qo[j]);  // one offset: the pair's
      }
      if (!ts.bwd) ts.bwd = std::make_unique<BwdScratch>(max_l, max_l, d);
      backward_item(cf, it, *ts.bwd);
    });
  }
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
                                  .Attr<bool>("shared_pairs")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m
                                  .Ret<ffi::Buffer<ffi::F32>>());  // l

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDilatedAttentionDilatedBackwardCpu, DilatedBackward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dout
                                  .Arg<ffi::Buffer<ffi::F32>>()  // c
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // delta
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
                                  .Attr<bool>("shared_pairs")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dk
                                  .Ret<ffi::Buffer<ffi::F32>>());  // dv
