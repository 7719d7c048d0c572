// Blockwise online-softmax attention for CPUs, as XLA FFI custom calls
// (jax_dilated/backends/native/build.py builds and registers them): the forward, and
// dilated attention's fused forward and backward. One source serves every vector
// width: the kernels below are written over `V`, a handful of operations on one
// vector register of floats, implemented for AVX-512 (16 lanes), AVX2 with FMA and
// F16C (8 lanes) and NEON on aarch64 (4 lanes); the build's instruction set (the
// compiler's target flags) picks one, with the register-tile shapes that fit its
// register file. Inputs are float32, bfloat16 or float16; they are converted to
// float32 where the kernel packs its tiles, and every product, exponential and
// statistic is float32 - except on CPUs with AVX512-BF16, where bfloat16 inputs are
// multiplied as stored (section "bfloat16 pairs").
//
// The mathematics is docs/semantics.md, section 1: for each query row p and the keys
// t it may attend to,
//     o_p = sum_t exp(s_pt - lse_p) v_t,   s_pt = scale q_p . k_t,
//     lse_p = log sum_t exp(s_pt),
// with o_p = 0 and lse_p = -inf for a row without keys. A key is allowed when
// kv_valid (if given) marks it and, for causal calls, when its index is at most the
// query's (positions are the indices 0..L-1 of the call, as the XLA kernel's default).
//
// Three calls. The plain one (Forward): q [N, Lq, H, D], k and v [N, Lk, Hkv, D]
// (H % Hkv == 0, grouped-query heads read kv head h / (H / Hkv)), kv_valid [N, Lk]
// or [N, Lk, Hkv] (uint8, or an empty array for none), o [N, Lq, H, D] in the
// inputs' dtype, and per row [N, Lq, H] its maximum logit m and l = sum_t exp(s_pt -
// m) (float32), from which the caller forms lse = m + log l in two parts
// (core/softmax.py: extreme logits keep their precision); l = 0 for a row without
// keys. The dilated one (DilatedForward): every branch of LongNet's dilated attention
// (docs/semantics.md, section 2) on q [B, T, H, D], k, v [B, T, Hkv, D], each dilated
// segment an item whose rows are r positions apart, read where they lie and written
// into o, m, l [B, T, H, ...] in place; longnet's branches continue each row's
// softmax (so o is float32 there: it is read back by the next branch), and nested
// branches compute each pair they share once (shared_pairs, Nesting below). Its
// backward (DilatedBackward) adds every branch's gradients into float32 dq, dk, dv.
// D is a multiple of 16 up to 256.
//
// Work: items of (n, h, a run of query rows), shared by an atomic counter among the
// calling thread and tasks on XLA's intra-op thread pool (so a call uses the threads
// XLA was given and no more). Each item packs k^T of its kv head once (key blocks of
// BK), then for every tile of BQ query rows runs, per key block, S = q k^T on MR x
// QK_COLS register tiles, the online-softmax update on S in place (running max m, sum
// l; exp by a degree-7 polynomial), and O += P v on MR x PV_COLS register tiles. The
// backward's items are (segment, kv head at one offset) and their query heads; it
// runs key blocks of BC against query tiles of BR (section "backward"). The dilated
// calls ask for huge pages on their results (prefer_huge_pages).
#if !defined(__linux__)
#error "the native CPU kernel is built for Linux"
#endif

#if defined(__AVX512F__)
#define JD_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JD_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define JD_NEON 1
#include <arm_neon.h>
#else
#error "the native CPU kernel needs x86-64 with AVX2, FMA and F16C (or AVX-512), or aarch64"
#endif

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_units.h"

namespace ffi = xla::ffi;

namespace {

// Half-precision inputs as stored (the bits): only converted, never computed on.
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

// ------------------------------------------------------------ the vector type
//
// V::T is one register of V::N floats. The kernels use only what is below: loads
// (converting bfloat16 and float16 to float32) and stores (rounding float32 to
// them, to nearest even), lane-wise arithmetic, fused multiply-add, the two pieces
// of exp (rounding to an integer, scaling by 2^n), horizontal max and sum, and lane
// masks from comparisons. Tile shapes per instruction set: MR query (or key) rows
// per register tile, QK_VECS vectors of columns in the S = q k^T tiles and PV_VECS
// in the O += P v tiles; MR x VECS accumulators, VECS loaded rows and one broadcast
// must fit the register file (AVX-512 and NEON 32 registers, AVX2 16).

#if JD_AVX512
struct V {
  using T = __m512;
  using Mask = __mmask16;
  static constexpr int N = 16;
  static constexpr const char* isa = "avx512";
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T iota() {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const bf16_t* p) {  // bfloat16 is the top half of a float32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static T load(const f16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static void store(bf16_t* p, T x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7fc0));  // NaN stays a (quiet) NaN
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store(f16_t* p, T x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c
  static T fnma(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
  static T round(T x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static T pow2(T n) {  // 2^n for integral n in [-127, 127], built in the exponent field
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static float reduce_max(T x) { return _mm512_reduce_max_ps(x); }
  static float reduce_add(T x) { return _mm512_reduce_add_ps(x); }
  static Mask ge(T a, T b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static Mask lt(T a, T b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static Mask both(Mask a, Mask b) { return a & b; }
  static T keep(Mask m, T x) { return _mm512_maskz_mov_ps(m, x); }   // x where m, else 0
  static T drop(Mask m, T x) { return _mm512_maskz_mov_ps(~m, x); }  // 0 where m, else x
};
// 12 accumulators for S (6 x 32 columns) and 24 for O (6 x 64): 15 and 29 registers
constexpr int MR = 6, QK_VECS = 2, PV_VECS = 4;

#elif JD_AVX2
struct V {
  using T = __m256;
  using Mask = __m256;  // all-ones lanes where true
  static constexpr int N = 8;
  static constexpr const char* isa = "avx2";
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const bf16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static T load(const f16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static void store(bf16_t* p, T x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0),
                           _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    // (every lane is below 2^16, so the saturating pack is a plain narrowing)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  static void store(f16_t* p, T x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T fnma(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }
  static T round(T x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T pow2(T n) {  // 2^n for integral n in [-127, 127], built in the exponent field
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static float reduce_max(T x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static float reduce_add(T x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static Mask ge(T a, T b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
  static Mask lt(T a, T b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static Mask both(Mask a, Mask b) { return _mm256_and_ps(a, b); }
  static T keep(Mask m, T x) { return _mm256_and_ps(m, x); }
  static T drop(Mask m, T x) { return _mm256_andnot_ps(m, x); }
};
// 16 registers: S and O both on 6 x 16 tiles (12 accumulators, 2 rows, 1 broadcast),
// the shape of the classic AVX2 matrix-multiply micro-kernel
constexpr int MR = 6, QK_VECS = 2, PV_VECS = 2;

#elif JD_NEON
struct V {
  using T = float32x4_t;
  using Mask = uint32x4_t;
  static constexpr int N = 4;
  static constexpr const char* isa = "neon";
  static T zero() { return vdupq_n_f32(0.0f); }
  static T set1(float x) { return vdupq_n_f32(x); }
  static T iota() {
    static const float lanes[4] = {0, 1, 2, 3};
    return vld1q_f32(lanes);
  }
  static T load(const float* p) { return vld1q_f32(p); }
  static T load(const bf16_t* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  }
  static T load(const f16_t* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
  }
  static void store(float* p, T x) { vst1q_f32(p, x); }
  static void store(bf16_t* p, T x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), odd)), 16);
    r = vbslq_u32(vceqq_f32(x, x), r, vdupq_n_u32(0x7fc0));  // NaN stays a (quiet) NaN
    vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32(r));
  }
  static void store(f16_t* p, T x) {
    vst1_u16(reinterpret_cast<uint16_t*>(p), vreinterpret_u16_f16(vcvt_f16_f32(x)));
  }
  static T add(T a, T b) { return vaddq_f32(a, b); }
  static T sub(T a, T b) { return vsubq_f32(a, b); }
  static T mul(T a, T b) { return vmulq_f32(a, b); }
  static T max(T a, T b) { return vmaxq_f32(a, b); }
  static T fma(T a, T b, T c) { return vfmaq_f32(c, a, b); }
  static T fnma(T a, T b, T c) { return vfmsq_f32(c, a, b); }
  static T round(T x) { return vrndnq_f32(x); }
  static T pow2(T n) {  // 2^n for integral n in [-127, 127], built in the exponent field
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
  }
  static float reduce_max(T x) { return vmaxvq_f32(x); }
  static float reduce_add(T x) { return vaddvq_f32(x); }
  static Mask ge(T a, T b) { return vcgeq_f32(a, b); }
  static Mask lt(T a, T b) { return vcltq_f32(a, b); }
  static Mask both(Mask a, Mask b) { return vandq_u32(a, b); }
  static T keep(Mask m, T x) { return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x), m)); }
  static T drop(Mask m, T x) { return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(x), m)); }
};
// 32 registers of 4 lanes: S and O on 6 x 16 tiles (24 accumulators, 4 rows, 1 broadcast)
constexpr int MR = 6, QK_VECS = 4, PV_VECS = 4;
#endif

using VT = V::T;
constexpr int N = V::N;
constexpr int QK_COLS = QK_VECS * N;  // columns of one S register tile
constexpr int PV_COLS = PV_VECS * N;  // columns of one O register tile
// Block sizes follow the caches (a 32-48 KiB L1 and an L2 of 0.5-2 MiB per core on
// every CPU served), not the vector width, so they are the same for every build.
constexpr int BQ = 48;   // query rows per tile (a multiple of MR)
constexpr int BK = 512;  // keys per block (a multiple of QK_COLS; 256: 1-2.5% slower)
constexpr int MAX_D = 256;
constexpr int BR = 96;   // backward: query rows per tile (a multiple of QK_COLS and MR)
constexpr int BC = 48;   // backward: keys per block (a multiple of MR)
static_assert(BQ % MR == 0 && BC % MR == 0 && BR % MR == 0, "tiles of MR rows");
static_assert(BK % QK_COLS == 0 && BR % QK_COLS == 0, "blocks of whole S tiles");
static_assert(16 % N == 0, "a head_dim that is a multiple of 16 is whole vectors");

// ------------------------------------------------- bfloat16 pairs (dot products)
//
// Where the CPU multiplies bfloat16 itself (AVX512-BF16's vdpbf16ps), bfloat16 inputs
// are not converted: each 32-bit lane holds a pair of bfloat16 (the even element in
// the low half, as two adjacent elements lie in memory) and one instruction adds both
// products of a lane's pairs to a float32 accumulator, twice the products of a
// float32 FMA. S = q k^T pairs along the head dimension (q and k as they are stored);
// O += P v pairs along the keys, so P is rounded to bfloat16 (to nearest even), as
// every bfloat16 attention kernel on matrix units does; v is packed in pairs of rows.
// The backward likewise: S and dP from q, k, v and do as stored, and P c and scale dS
// rounded to bfloat16 for dv, dk and dq. Exponentials, statistics and accumulators
// stay float32. The emulated build
// (JD_BF16_DOT_EMULATED: the same pairs, each product a float32 FMA of the halves
// widened, exact as the instruction's products are) runs this data path on any
// x86-64 CPU, so its layout is tested where the instruction is missing.
#if (defined(__AVX512BF16__) || defined(JD_BF16_DOT_EMULATED)) && (JD_AVX512 || JD_AVX2)
#define JD_BF16_PAIRS 1
struct P {
#if JD_AVX512
  using T = __m512i;
  static T load(const bf16_t* p) { return _mm512_loadu_si512(p); }
  static T set1(uint32_t x) { return _mm512_set1_epi32((int)x); }
  static VT widen_even(T x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
  static VT widen_odd(T x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
  }
#else
  using T = __m256i;
  static T load(const bf16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static T set1(uint32_t x) { return _mm256_set1_epi32((int)x); }
  static VT widen_even(T x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
  static VT widen_odd(T x) {
    return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
  }
#endif
  // the 32-bit pair at p (two bfloat16), broadcast to every lane
  static T broadcast(const bf16_t* p) {
    uint32_t x;
    std::memcpy(&x, p, sizeof x);
    return set1(x);
  }
  // acc + a_odd b_odd + a_even b_even in each lane
  static VT dot(VT acc, T a, T b) {
#if defined(__AVX512BF16__) && JD_AVX512 && !defined(JD_BF16_DOT_EMULATED)
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    acc = V::fma(widen_odd(a), widen_odd(b), acc);
    return V::fma(widen_even(a), widen_even(b), acc);
#endif
  }
};
#if defined(JD_BF16_DOT_EMULATED) && JD_AVX512
#define BUILD_ISA "avx512_bf16emu"
#elif defined(JD_BF16_DOT_EMULATED)
#define BUILD_ISA "avx2_bf16emu"
#else
#define BUILD_ISA "avx512_bf16"
#endif

// s[MR][ncols] = scale a[MR][D] . b[D][ncols] in pairs: a's rows (bfloat16 as stored)
// a_stride elements apart; b in panels of QK_COLS columns, [D / 2][QK_COLS][2] each,
// panel after panel (QK_COLS D elements apart); s's rows SS floats apart. With
// col_scale, column j is also multiplied by col_scale[j].
template <int SS>
__attribute__((noinline)) void qk_tile_pairs(const bf16_t* a, int64_t a_stride, const bf16_t* b,
                                             float* s, int d_head, int ncols, float scale,
                                             const float* col_scale = nullptr) {
  for (int c = 0; c < ncols; c += QK_COLS, b += QK_COLS * d_head) {
    VT acc[MR][QK_VECS];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
      for (int j = 0; j < QK_VECS; j++) acc[r][j] = V::zero();
    for (int e = 0; e < d_head; e += 2) {
      P::T bv[QK_VECS];
#pragma GCC unroll 4
      for (int j = 0; j < QK_VECS; j++) bv[j] = P::load(b + e * QK_COLS + 2 * j * N);
#pragma GCC unroll 8
      for (int r = 0; r < MR; r++) {
        const P::T x = P::broadcast(a + r * a_stride + e);
#pragma GCC unroll 4
        for (int j = 0; j < QK_VECS; j++) acc[r][j] = P::dot(acc[r][j], x, bv[j]);
      }
    }
    VT sc[QK_VECS];
#pragma GCC unroll 4
    for (int j = 0; j < QK_VECS; j++)
      sc[j] = col_scale ? V::mul(V::set1(scale), V::load(col_scale + c + j * N)) : V::set1(scale);
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
      for (int j = 0; j < QK_VECS; j++) V::store(s + r * SS + c + j * N, V::mul(acc[r][j], sc[j]));
  }
}

// o[MR][NV N] += p[MR][:2 npairs] . v[:2 npairs][NV N] in pairs of keys: p's rows
// (bfloat16) PS elements apart, v's pair rows [NV N][2] vstride elements apart.
template <int NV, int PS>
__attribute__((noinline)) void pv_tile_pairs(const bf16_t* p, const bf16_t* v, int64_t vstride,
                                             float* o, int64_t ostride, int npairs) {
  VT acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
    for (int j = 0; j < NV; j++) acc[r][j] = V::load(o + r * ostride + N * j);
  for (int t = 0; t < npairs; t++) {
    P::T b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; j++) b[j] = P::load(v + t * vstride + 2 * N * j);
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
      const P::T a = P::broadcast(p + r * PS + 2 * t);
#pragma GCC unroll 4
      for (int j = 0; j < NV; j++) acc[r][j] = P::dot(acc[r][j], a, b[j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
    for (int j = 0; j < NV; j++) V::store(o + r * ostride + N * j, acc[r][j]);
}

template <int NV, int PS>
void pv_rest_pairs(const bf16_t* p, const bf16_t* v, int64_t vstride, float* o, int64_t ostride,
                   int npairs, int nv) {
  if constexpr (NV > 0) {
    if (nv == NV) pv_tile_pairs<NV, PS>(p, v, vstride, o, ostride, npairs);
    else pv_rest_pairs<NV - 1, PS>(p, v, vstride, o, ostride, npairs, nv);
  }
}

// o[MR][D] += p[MR][:2 npairs] . v[:2 npairs][D], v's pair rows [D][2] (not in panels)
template <int PS>
void pv_columns_pairs(const bf16_t* p, const bf16_t* v, float* o, int64_t ostride, int d_head,
                      int npairs) {
  int c = 0;
  for (; c + PV_COLS <= d_head; c += PV_COLS)
    pv_tile_pairs<PV_VECS, PS>(p, v + 2 * c, 2 * d_head, o + c, ostride, npairs);
  pv_rest_pairs<PV_VECS - 1, PS>(p, v + 2 * c, 2 * d_head, o + c, ostride, npairs,
                                 (d_head - c) / N);
}

// a row of zeros (the partner of an odd count's last row, padding rows)
constexpr bf16_t kZeroRow[MAX_D] = {};

// dst[2 j] = a[j], dst[2 j + 1] = b[j] for j < n: two rows as pairs (eight pairs per
// two unpacks, where element by element the packing cost a tenth of the forward)
inline void interleave_rows(const bf16_t* a, const bf16_t* b, bf16_t* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + j));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + j));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * j), _mm_unpacklo_epi16(x, y));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * j + 8), _mm_unpackhi_epi16(x, y));
  }
  for (; j < n; j++) {
    dst[2 * j] = a[j];
    dst[2 * j + 1] = b[j];
  }
}

// a row's values as pairs (d even, as every head width served): pair e / 2 (e even) at
// dst + e stride, two values copied at once; 0 from d to dp, and for a null row
inline void scatter_pairs(const bf16_t* row, int64_t d, int64_t dp, bf16_t* dst,
                          int64_t stride) {
  int64_t e = 0;
  if (row != nullptr)
    for (; e < d; e += 2) std::memcpy(dst + e * stride, row + e, 2 * sizeof(bf16_t));
  for (; e < dp; e += 2) dst[e * stride] = dst[e * stride + 1] = bf16_t{0};
}

// dst[j][i] = src[i][j] for an 8 x 8 block of bfloat16 (rows ss and ds apart): three
// rounds of unpacks, where element by element the transpose of the backward's ds took
// a third of its own time
inline void transpose_8x8(const bf16_t* src, int64_t ss, bf16_t* dst, int64_t ds) {
  __m128i r[8], t[8];
  for (int i = 0; i < 8; i++)
    r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ss));
  for (int i = 0; i < 8; i += 2) {  // t[i]: rows i, i + 1 interleaved by value (low, high half)
    t[i] = _mm_unpacklo_epi16(r[i], r[i + 1]);
    t[i + 1] = _mm_unpackhi_epi16(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)  // r: four rows interleaved, by pairs
    for (int h = 0; h < 2; h++) {
      r[i + 2 * h] = _mm_unpacklo_epi32(t[i + h], t[i + 2 + h]);
      r[i + 2 * h + 1] = _mm_unpackhi_epi32(t[i + h], t[i + 2 + h]);
    }
  for (int j = 0; j < 4; j++) {  // columns 2 j, 2 j + 1: the two halves of eight rows
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * j * ds),
                     _mm_unpacklo_epi64(r[j], r[j + 4]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * j + 1) * ds),
                     _mm_unpackhi_epi64(r[j], r[j + 4]));
  }
}

// rows [n][D] (bfloat16, row i at src + i stride) as pairs of rows [n / 2][D][2]
// (n even, or the last row's partner 0) at dst
inline void pack_row_pairs(const bf16_t* src, int64_t stride, int64_t n, int64_t d_head,
                           bf16_t* dst) {
  for (int64_t i = 0; i < n; i += 2)
    interleave_rows(src + i * stride, i + 1 < n ? src + (i + 1) * stride : kZeroRow,
                    dst + i * d_head, d_head);
}

// Values in column panels of pairs of rows: the panel of columns [c, c + wc) holds
// row t's column c + j at c rows2 + (t / 2) 2 wc + 2 j + t % 2 (rows2: the rows
// rounded up to even, the last odd one's partner 0). Rows t (even) and t + 1 at once.
inline void pack_value_row_pairs(const bf16_t* row, const bf16_t* next, bf16_t* panels,
                                 int64_t rows2, int64_t t, int64_t d_head) {
  for (int64_t c = 0; c < d_head; c += PV_COLS) {
    const int64_t wc = std::min<int64_t>(PV_COLS, d_head - c);
    interleave_rows(row + c, next + c, panels + c * rows2 + (t / 2) * 2 * wc, wc);
  }
}

// o[MR][D] += p[MR][:nk] . v[k0 : k0 + nk][D] (k0 even; p 0 past nk, to the even)
inline void pv_panels_pairs(const bf16_t* p, const bf16_t* panels, int64_t rows2, int64_t k0,
                            float* o, int d_head, int nk) {
  const int npairs = (nk + 1) / 2;
  int c = 0;
  for (; c + PV_COLS <= d_head; c += PV_COLS)
    pv_tile_pairs<PV_VECS, BK>(p, panels + c * rows2 + k0 * PV_COLS, 2 * PV_COLS, o + c, d_head,
                               npairs);
  const int wc = d_head - c;
  if (wc > 0)
    pv_rest_pairs<PV_VECS - 1, BK>(p, panels + c * rows2 + k0 * wc, 2 * wc, o + c, d_head,
                                   npairs, wc / N);
}
#else
#define JD_BF16_PAIRS 0
#define BUILD_ISA V::isa
#endif

// ------------------------------------------------------------- AMX tiles
//
// Where the CPU has AMX-BF16 (Intel Sapphire Rapids and later), the products on
// bfloat16 inputs run on its tile unit (the forward's two here, the backward's five
// through amx_gemm): eight tile registers of 16 rows of 64 bytes, and tdpbf16ps,
// C[16][16] (float32) += A[16][32] (bfloat16) . B[16][16] (bfloat16 pairs: B's row e
// holds the pairs (2e, 2e + 1) of 16 columns), the same pairs as above. A query
// tile's S = q k^T (all BQ rows against a key block) and its O += P v (after the
// rows' softmax) are each one pass of tiles; q and k are padded to a head dimension
// of a multiple of 32 (DP), and the values to a multiple of 32 rows, with zeros.
// Linux hands a process the tile registers only when it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM); where that is refused, the pair path above serves.
// JD_AMX_EMULATED (a test build) computes each tile instruction by loops on any CPU,
// so the tiles' layout and the driver are tested without the unit.
#if JD_BF16_PAIRS && ((defined(__AMX_BF16__) && defined(__AMX_TILE__) && JD_AVX512) || \
                      defined(JD_AMX_EMULATED))
#define JD_AMX 1
#if defined(JD_AMX_EMULATED)
#undef BUILD_ISA
#define BUILD_ISA "avx2_amxemu"
// the eight tile registers, 16 rows of 64 bytes, of the calling thread
struct alignas(64) EmulatedTiles {
  uint8_t t[8][16][64];
};
inline EmulatedTiles& emulated_tiles() {
  static thread_local EmulatedTiles tiles;
  return tiles;
}
inline bool amx_usable() { return true; }
inline void amx_configure() {}
inline void amx_release() {}
template <int T>
inline void tile_load(const void* p, int64_t stride_bytes) {
  for (int r = 0; r < 16; r++)
    std::memcpy(emulated_tiles().t[T][r], (const uint8_t*)p + r * stride_bytes, 64);
}
template <int T>
inline void tile_store(void* p, int64_t stride_bytes) {
  for (int r = 0; r < 16; r++)
    std::memcpy((uint8_t*)p + r * stride_bytes, emulated_tiles().t[T][r], 64);
}
template <int T>
inline void tile_zero() {
  std::memset(emulated_tiles().t[T], 0, sizeof emulated_tiles().t[T]);
}
template <int C, int A, int B>
inline void tile_dp() {  // C[16][16] += A[16][32] . B[16][16][2] (bfloat16 -> float32)
  auto value = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  EmulatedTiles& x = emulated_tiles();
  for (int m = 0; m < 16; m++)
    for (int n = 0; n < 16; n++) {
      float c;
      std::memcpy(&c, x.t[C][m] + 4 * n, 4);
      for (int e = 0; e < 16; e++) {
        c = std::fma(value(x.t[A][m] + 4 * e + 2), value(x.t[B][e] + 4 * n + 2), c);
        c = std::fma(value(x.t[A][m] + 4 * e), value(x.t[B][e] + 4 * n), c);
      }
      std::memcpy(x.t[C][m] + 4 * n, &c, 4);
    }
}
#else
#include <sys/syscall.h>
#include <unistd.h>
#undef BUILD_ISA
#define BUILD_ISA "amx"
// whether Linux lets this process use the tile registers (asked once)
inline bool amx_usable() {
  static const bool granted = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
// every tile register 16 rows of 64 bytes (per thread; released after each unit)
inline void amx_configure() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}
inline void amx_release() { _tile_release(); }
// (the compiler's tile intrinsics name their registers by literal numbers)
#define TILE_LOAD(T, p, stride) _tile_loadd(T, p, stride)
#define TILE_STORE(T, p, stride) _tile_stored(T, p, stride)
#define TILE_ZERO(T) _tile_zero(T)
#define TILE_DP(C, A, B) _tile_dpbf16ps(C, A, B)
#endif
#if defined(JD_AMX_EMULATED)
#define TILE_LOAD(T, p, stride) tile_load<T>(p, stride)
#define TILE_STORE(T, p, stride) tile_store<T>(p, stride)
#define TILE_ZERO(T) tile_zero<T>()
#define TILE_DP(C, A, B) tile_dp<C, A, B>()
#endif

// Tiles 0-2 += the three 16-row blocks of a (rows a_stride elements apart, 32 columns
// from a) . b (16 pair rows b_stride elements apart, 16 columns): tile 3 holds each
// block of a in turn, tile 4 b.
inline void amx_three_blocks(const bf16_t* a, int64_t a_stride, const bf16_t* b,
                             int64_t b_stride) {
  TILE_LOAD(4, b, 2 * b_stride);
  TILE_LOAD(3, a, 2 * a_stride);
  TILE_DP(0, 3, 4);
  TILE_LOAD(3, a + 16 * a_stride, 2 * a_stride);
  TILE_DP(1, 3, 4);
  TILE_LOAD(3, a + 32 * a_stride, 2 * a_stride);
  TILE_DP(2, 3, 4);
}

// s[BQ][ncols] = scale q[BQ][DP] . k^T (ncols a multiple of 16): q's rows DP apart,
// k^T in the pair panels of QK_COLS keys [DP / 2][QK_COLS][2]; s's rows BK apart.
// Tiles 0-2: the three 16-row blocks of S; 3: q; 4: k^T.
inline void amx_qk(const bf16_t* q, const bf16_t* kt, float* s, int64_t dp, int ncols,
                   float scale) {
  for (int n = 0; n < ncols; n += 16) {
    const bf16_t* panel = kt + (n / QK_COLS) * QK_COLS * dp + 2 * (n % QK_COLS);
    TILE_ZERO(0); TILE_ZERO(1); TILE_ZERO(2);
    for (int64_t e = 0; e < dp; e += 32)
      amx_three_blocks(q + e, dp, panel + e * QK_COLS, 2 * QK_COLS);
    TILE_STORE(0, s + n, 4 * BK);
    TILE_STORE(1, s + 16 * BK + n, 4 * BK);
    TILE_STORE(2, s + 32 * BK + n, 4 * BK);
  }
  const VT sc = V::set1(scale);
  for (int r = 0; r < BQ; r++)
    for (int j = 0; j < ncols; j += N)
      V::store(s + r * BK + j, V::mul(V::load(s + r * BK + j), sc));
}

// o[BQ][D] += p[BQ][nkeys] . v[k0 : k0 + nkeys][D] (nkeys a multiple of 32): p's rows
// (bfloat16) BK apart, the values in the pair panels of pack_value_row_pairs (rows2
// rows, a multiple of 32). Tiles 0-2: O's 16-row blocks of 16 columns; 3: p; 4: v.
inline void amx_pv(const bf16_t* p, const bf16_t* panels, int64_t rows2, int64_t k0, float* o,
                   int64_t d, int nkeys) {
  for (int64_t c = 0; c < d; c += 16) {
    const int64_t c0 = c / PV_COLS * PV_COLS, wc = std::min<int64_t>(PV_COLS, d - c0);
    const bf16_t* v = panels + c0 * rows2 + k0 * wc + 2 * (c - c0);
    TILE_LOAD(0, o + c, 4 * d);
    TILE_LOAD(1, o + 16 * d + c, 4 * d);
    TILE_LOAD(2, o + 32 * d + c, 4 * d);
    for (int t = 0; t < nkeys; t += 32) amx_three_blocks(p + t, BK, v + t * wc, 2 * wc);
    TILE_STORE(0, o + c, 4 * d);
    TILE_STORE(1, o + 16 * d + c, 4 * d);
    TILE_STORE(2, o + 32 * d + c, 4 * d);
  }
}

// c[M][N] (float32, rows ldc apart; zeroed first where `zero`) += a[M][K] . b: a's
// rows (bfloat16) lda apart; b as pairs of rows, pair row e (rows 2e and 2e + 1) at
// b + e ldb with column j's pair at 2j. M a multiple of 48, N of 16, K of 32: the
// backward's five products, 48 rows of c at a time (amx_three_blocks: tiles 0-2).
inline void amx_gemm(const bf16_t* a, int64_t lda, const bf16_t* b, int64_t ldb, float* c,
                     int64_t ldc, int64_t m, int64_t n, int64_t k, bool zero) {
  for (int64_t i = 0; i < m; i += 48)
    for (int64_t j = 0; j < n; j += 16) {
      float* cij = c + i * ldc + j;
      if (zero) {
        TILE_ZERO(0); TILE_ZERO(1); TILE_ZERO(2);
      } else {
        TILE_LOAD(0, cij, 4 * ldc);
        TILE_LOAD(1, cij + 16 * ldc, 4 * ldc);
        TILE_LOAD(2, cij + 32 * ldc, 4 * ldc);
      }
      for (int64_t e = 0; e < k; e += 32)
        amx_three_blocks(a + i * lda + e, lda, b + (e / 2) * ldb + 2 * j, ldb);
      TILE_STORE(0, cij, 4 * ldc);
      TILE_STORE(1, cij + 16 * ldc, 4 * ldc);
      TILE_STORE(2, cij + 32 * ldc, 4 * ldc);
    }
}
#else
#define JD_AMX 0
#endif

// The tile unit for one run over bfloat16 pairs: on (configured on entry, released on
// exit) where this build has AMX and Linux grants the tiles; else off, and the pair
// path serves.
struct AmxScope {
#if JD_AMX
  const bool on;
  explicit AmxScope(bool pairs) : on(pairs && amx_usable()) {
    if (on) amx_configure();
  }
  ~AmxScope() {
    if (on) amx_release();
  }
#else
  static constexpr bool on = false;
  explicit AmxScope(bool) {}
#endif
};

// exp(x) for the softmax, as 2^y with y = x log2 e: 2^y = 2^n 2^r, n = round(y),
// r = y - n in [-1/2, 1/2] (exact), 2^r by a polynomial of degree 5 with constant
// term 1 (a minimax fit of relative error 1.1e-7; exp(0) is exactly 1). The argument
// stays in natural units until here, so that s - max is formed exactly where logits
// are large; the rounding of y costs 2^y's relative precision in proportion to |y|,
// at most 3e-8 of 1 (a row's largest weight). As float32 evaluates it, the error is
// 1.5e-7 relative on [-1, 0.5] and 2.2e-7 of max(e^x, 1/8) below (measured on the
// AVX2 build; tests/native_kernel_check.cc checks 2e-7 and 3e-7). 7 multiplications
// and multiply-adds where a reduction by ln 2 in two parts and a degree-7 polynomial
// took 11: the exponentials are the forward's largest cost beside its two products
// at head dimensions up to 64 (2 d multiply-adds per logit). y is clamped at -127,
// whose 2^n has exponent bits 0: the result is exactly 0 there, so a masked key
// (-inf) weighs exactly 0 with no lane mask. Only softmax arguments come here (at
// most 0 up to rounding: 2^n has no upper clamp).
inline VT vexp(VT x) {
  const VT y = V::max(V::mul(x, V::set1(1.44269504088896341f)), V::set1(-127.0f));
  const VT n = V::round(y);
  const VT r = V::sub(y, n);
  VT p = V::set1(1.3264709e-3f);
  p = V::fma(p, r, V::set1(9.6715110e-3f));
  p = V::fma(p, r, V::set1(5.5507340e-2f));
  p = V::fma(p, r, V::set1(2.4022242e-1f));
  p = V::fma(p, r, V::set1(6.9314700e-1f));
  p = V::fma(p, r, V::set1(1.0f));
  return V::mul(p, V::pow2(n));
}

// Packing reads each key's and value's row where it lies, r Hkv d elements after the
// previous one: rows so far apart that the hardware's prefetchers do not follow them,
// so each row is asked for kPackAhead rows before it is read.
constexpr int64_t kPackAhead = 8;
template <class In>
inline void prefetch_row(const In* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = d * (int64_t)sizeof(In);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
  __builtin_prefetch(p + bytes - 1);  // the last line, where the row starts mid-line
}

// A row of d inputs as float32: the row itself for float32 inputs, else converted
// into tmp (d floats).
inline const float* as_float(const float* src, int64_t, float*) { return src; }
template <class In>
const float* as_float(const In* src, int64_t d, float* tmp) {
  for (int64_t c = 0; c < d; c += N) V::store(tmp + c, V::load(src + c));
  return tmp;
}

// s[MR][ncols] = a[MR][D] . b[D][ncols], for the first ncols (a multiple of QK_COLS)
// columns; b's rows are BS floats apart, s's SS, and each QK_COLS columns of b start
// QK_COLS panel_stride floats after the previous ones (1: b is one row-major matrix;
// D with BS = QK_COLS: b is in panels of QK_COLS columns, each read as one contiguous
// run). Not inlined: its accumulators get the registers to themselves.
template <int BS, int SS = BS>
__attribute__((noinline)) void qk_tile(const float* a, const float* b, float* s, int d_head,
                                       int ncols, int64_t panel_stride = 1) {
  for (int c = 0; c < ncols; c += QK_COLS, b += QK_COLS * panel_stride) {
    VT acc[MR][QK_VECS];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
      for (int j = 0; j < QK_VECS; j++) acc[r][j] = V::zero();
    for (int d = 0; d < d_head; d++) {
      VT bv[QK_VECS];
#pragma GCC unroll 4
      for (int j = 0; j < QK_VECS; j++) bv[j] = V::load(b + d * BS + j * N);
#pragma GCC unroll 8
      for (int r = 0; r < MR; r++) {
        const VT x = V::set1(a[r * d_head + d]);
#pragma GCC unroll 4
        for (int j = 0; j < QK_VECS; j++) acc[r][j] = V::fma(x, bv[j], acc[r][j]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
      for (int j = 0; j < QK_VECS; j++) V::store(s + r * SS + c + j * N, acc[r][j]);
  }
}

// o[MR][NV N] += p[MR][:nk] . v[:nk][NV N], p's entry (r, t) at p[r PR + t PT] (a
// tile or its transpose), v's rows vstride floats apart, o's ostride.
template <int NV, int PR, int PT>
__attribute__((noinline)) void pv_tile(const float* p, const float* v, int64_t vstride,
                                       float* o, int64_t ostride, int nk) {
  VT acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
    for (int j = 0; j < NV; j++) acc[r][j] = V::load(o + r * ostride + N * j);
  for (int t = 0; t < nk; t++) {
    VT b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; j++) b[j] = V::load(v + t * vstride + N * j);
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
      const VT a = V::set1(p[r * PR + t * PT]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; j++) acc[r][j] = V::fma(a, b[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
    for (int j = 0; j < NV; j++) V::store(o + r * ostride + N * j, acc[r][j]);
}

// The last nv (< PV_VECS) vectors of columns, on a tile of that width.
template <int NV, int PR, int PT>
void pv_rest(const float* p, const float* v, int64_t vstride, float* o, int64_t ostride,
             int nk, int nv) {
  if constexpr (NV > 0) {
    if (nv == NV) pv_tile<NV, PR, PT>(p, v, vstride, o, ostride, nk);
    else pv_rest<NV - 1, PR, PT>(p, v, vstride, o, ostride, nk, nv);
  }
}

// o[MR][D] += p[MR][:nk] . v[:nk][D], D in tiles of PV_COLS columns and a narrower
// last one.
template <int PR, int PT>
void pv_columns(const float* p, const float* v, int64_t vstride, float* o, int64_t ostride,
                int d_head, int nk) {
  int c = 0;
  for (; c + PV_COLS <= d_head; c += PV_COLS)
    pv_tile<PV_VECS, PR, PT>(p, v + c, vstride, o + c, ostride, nk);
  pv_rest<PV_VECS - 1, PR, PT>(p, v + c, vstride, o + c, ostride, nk, (d_head - c) / N);
}

// Values packed in column panels (pack_value_panels): the panel of columns [c, c + wc),
// wc = min(PV_COLS, d - c), holds row t's columns at c rows + t wc, so each register
// tile of P V reads its values as one contiguous run. Read where they lie, a dilated
// item's value rows are r Hkv D floats apart (4 or 8 KiB at rates 2 and 4, 8 heads of
// 64), all in one L1 set.
inline void pack_value_row(const float* src, float* panels, int64_t rows, int64_t t,
                           int64_t d_head) {
  for (int64_t c = 0; c < d_head; c += PV_COLS) {
    const int64_t wc = std::min<int64_t>(PV_COLS, d_head - c);
    float* dst = panels + c * rows + t * wc;
    for (int64_t j = 0; j < wc; j += N) V::store(dst + j, V::load(src + c + j));
  }
}

// o[MR][D] += p[MR][:nk] . v[k0 : k0 + nk][D], v in column panels of `rows` rows.
inline void pv_panels(const float* p, const float* panels, int64_t rows, int64_t k0, float* o,
                      int d_head, int nk) {
  int c = 0;
  for (; c + PV_COLS <= d_head; c += PV_COLS)
    pv_tile<PV_VECS, BK, 1>(p, panels + c * rows + k0 * PV_COLS, PV_COLS, o + c, d_head, nk);
  const int wc = d_head - c;
  if (wc > 0)
    pv_rest<PV_VECS - 1, BK, 1>(p, panels + c * rows + k0 * wc, wc, o + c, d_head, nk, wc / N);
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
// written where they lie (no gather, no scatter). In: the inputs' element type; Out:
// the output's (float, or In where each row is written once).
template <class In, class Out>
struct Item {
  const In *q, *k, *v;
  const uint8_t* valid;
  Out* o;
  float *m, *l;
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
  // key's multiplicity m = 1 + min(v, depth) (Nesting); vp, the values as float32 in
  // column panels (pack_value_row); row, one converted row
  std::vector<float> kt, s, qs, ot, kmask, kmul, vp, row;
  std::vector<uint8_t> block_masked, block_shared;  // some key masked; some key of depth > 0
  // the bfloat16 pair path's k^T, q, values and P (JD_BF16_PAIRS; empty otherwise)
  std::vector<bf16_t> ktp, qp, vpp, sp;
  std::vector<float> sfull;  // AMX: S of a whole query tile [BQ][BK]
  Scratch(int64_t max_lk, int64_t d)
      : kt(((max_lk + BK - 1) / BK) * d * BK), s(MR * BK), qs(BQ * d), ot(BQ * d),
        row(MAX_D) {}
};

// Rows [r0, r1) of one item.
template <class In, class Out>
void run_rows(const Config& cf, const Item<In, Out>& it, Scratch& w, int64_t r0, int64_t r1) {
  const int64_t d = cf.d;
  const Nesting* ns = it.nest;
  const int nc = ns ? ns->nc : 0;
  const int64_t kend_all = cf.causal ? std::min(it.lk, r1) : it.lk;
  const int64_t nblocks = (kend_all + BK - 1) / BK;
  w.kmask.resize(nblocks * BK);
  if ((int64_t)w.kmul.size() < nblocks * nc * BK) w.kmul.resize(nblocks * nc * BK);
  if ((int64_t)w.vp.size() < kend_all * d) w.vp.resize(kend_all * d);
  w.block_masked.resize(nblocks);
  w.block_shared.resize(nblocks);
  // bfloat16 inputs on the bfloat16 dot products: k^T and the values packed as pairs
  constexpr bool pairs = JD_BF16_PAIRS && std::is_same_v<In, bf16_t>;
  const AmxScope tiles(pairs);
  const bool amx = tiles.on;
#if JD_BF16_PAIRS
  // the head dimension of q and k^T as packed, and the value rows (AMX: padded with
  // zeros to the tiles' multiples of 32; else pairs)
  const int64_t dp = JD_AMX ? (d + 31) / 32 * 32 : d;
  const int64_t rows2 = JD_AMX ? (kend_all + 31) / 32 * 32 : (kend_all + 1) / 2 * 2;
  if constexpr (pairs) {
    if ((int64_t)w.ktp.size() < nblocks * dp * BK) w.ktp.resize(nblocks * dp * BK);
    if ((int64_t)w.vpp.size() < rows2 * d) w.vpp.resize(rows2 * d);
    if ((int64_t)w.qp.size() < BQ * dp) w.qp.resize(BQ * dp);
    if ((int64_t)w.sp.size() < BQ * BK) w.sp.resize(BQ * BK);
    if (amx && (int64_t)w.sfull.size() < BQ * BK) w.sfull.resize(BQ * BK);
    for (int64_t t = (kend_all + 1) / 2 * 2; t < rows2; t += 2)  // value rows past the last: 0
      pack_value_row_pairs(kZeroRow, kZeroRow, w.vpp.data(), rows2, t, d);
  }
#endif
  // k^T of the keys this run can see, in blocks of BK keys, each in panels
  // [BK / QK_COLS][d][QK_COLS] (zero-padded to whole panels), their mask and
  // multiplicities, and the values in panels
  for (int64_t b0 = 0; b0 < kend_all; b0 += BK) {
    float* kt = w.kt.data() + (b0 / BK) * d * BK;
    const int64_t nk = std::min<int64_t>(BK, kend_all - b0);
#if JD_BF16_PAIRS
    if constexpr (pairs) {  // panels [D / 2][QK_COLS][2]: key t's pair e at 2 (e QK_COLS + t)
      bf16_t* ktp = w.ktp.data() + (b0 / BK) * dp * BK;
      const int64_t ncols = (nk + QK_COLS - 1) / QK_COLS * QK_COLS;
      for (int64_t t = 0; t < ncols; t++) {
        if (t + kPackAhead < nk) {
          prefetch_row(it.k + (b0 + t + kPackAhead) * it.kv_stride, d);
          prefetch_row(it.v + (b0 + t + kPackAhead) * it.kv_stride, d);
        }
        scatter_pairs(t < nk ? it.k + (b0 + t) * it.kv_stride : nullptr, d, dp,
                      ktp + (t / QK_COLS) * QK_COLS * dp + 2 * (t % QK_COLS), QK_COLS);
        if (t % 2 == 0 && t < nk)
          pack_value_row_pairs(it.v + (b0 + t) * it.kv_stride,
                               t + 1 < nk ? it.v + (b0 + t + 1) * it.kv_stride : kZeroRow,
                               w.vpp.data(), rows2, b0 + t, d);
      }
    }
#endif
    if constexpr (!pairs) {
      for (int64_t t = 0; t < nk; t++) {
        if (t + kPackAhead < nk) {
          prefetch_row(it.k + (b0 + t + kPackAhead) * it.kv_stride, d);
          prefetch_row(it.v + (b0 + t + kPackAhead) * it.kv_stride, d);
        }
        const float* src = as_float(it.k + (b0 + t) * it.kv_stride, d, w.row.data());
        float* panel = kt + (t / QK_COLS) * QK_COLS * d + t % QK_COLS;
        for (int64_t c = 0; c < d; c++) panel[c * QK_COLS] = src[c];
        pack_value_row(as_float(it.v + (b0 + t) * it.kv_stride, d, w.row.data()), w.vp.data(),
                       kend_all, b0 + t, d);
      }
      for (int64_t t = nk; t < (nk + QK_COLS - 1) / QK_COLS * QK_COLS; t++)
        for (int64_t c = 0; c < d; c++) kt[(t / QK_COLS) * QK_COLS * d + c * QK_COLS + t % QK_COLS] = 0.0f;
    }
    float* km = w.kmul.data() + (b0 / BK) * nc * BK;
    bool masked = false, shared = false;
    for (int64_t j = 0; j < BK; j++) {
      const bool ok = j < nk && (it.valid == nullptr || it.valid[(b0 + j) * it.valid_stride]);
      masked |= !ok && j < (nk + QK_COLS - 1) / QK_COLS * QK_COLS;
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
      const In* src = it.q + (q0 + i) * it.q_stride;
      if (i + kPackAhead < nq) prefetch_row(src + kPackAhead * it.q_stride, d);
#if JD_BF16_PAIRS
      if constexpr (pairs) {  // as stored (the scale multiplies S)
        bf16_t* qp = w.qp.data() + i * dp;
        if (i < nq) std::copy(src, src + d, qp);
        std::fill(qp + (i < nq ? d : 0), qp + dp, bf16_t{0});
      }
#endif
      if constexpr (!pairs) {
        const VT scale = V::set1(i < nq ? cf.scale : 0.0f);
        for (int64_t c = 0; c < d; c += N)
          V::store(w.qs.data() + i * d + c, i < nq ? V::mul(V::load(src + c), scale) : scale);
      }
      const int64_t stat = (q0 + i) * it.stat_stride;
      if constexpr (std::is_same_v<Out, float>) {
        if (cf.accumulate && i < nq && it.l[stat] > 0.0f) {
          // continue the row's softmax: unnormalise the output it holds
          m[i] = it.m[stat];
          l[i] = it.l[stat];
          const float* prev = it.o + (q0 + i) * it.q_stride;
          for (int64_t c = 0; c < d; c++) w.ot[i * d + c] = prev[c] * l[i];
        }
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
      const float* kt = w.kt.data() + (k0 / BK) * d * BK;
#if JD_AMX
      // AMX: S of every row of the tile against the keys any of them sees, at once;
      // P v after every group's softmax, over kpv keys (P's columns past a group's own
      // and the rows of skipped groups 0)
      int kpv = 0;
      if (amx) {
        const int64_t kmax = cf.causal ? std::min<int64_t>(nk, q1 - k0) : nk;
        amx_qk(w.qp.data(), w.ktp.data() + (k0 / BK) * dp * BK, w.sfull.data(), dp,
               (int)((kmax + QK_COLS - 1) / QK_COLS * QK_COLS), cf.scale);
        kpv = (int)((kmax + 31) / 32 * 32);
        for (int i = nqp; i < BQ; i++)
          std::fill(w.sp.data() + i * BK, w.sp.data() + i * BK + kpv, bf16_t{0});
      }
#endif
      for (int t0 = 0; t0 < nqp; t0 += MR) {
        // causal: the group's columns end at its last row's own index (the diagonal
        // block's keys after every row of the group are not computed)
        const int gk = cf.causal ? (int)std::min<int64_t>(nk, q0 + std::min(t0 + MR, nq) - k0)
                                 : nk;
        if (gk <= 0 || (x0 <= 0 && x1 >= gk)) {  // nothing of the block for it
#if JD_AMX
          if (amx)
            for (int i = t0; i < t0 + MR; i++)
              std::fill(w.sp.data() + i * BK, w.sp.data() + i * BK + kpv, bf16_t{0});
#endif
          continue;
        }
        const int gcols = (gk + QK_COLS - 1) / QK_COLS * QK_COLS;
        float* sg = w.s.data();  // the group's S rows, BK apart
#if JD_AMX
        if (amx) sg = w.sfull.data() + t0 * BK;
#endif
#if JD_BF16_PAIRS
        if constexpr (pairs)
          if (!amx)
            qk_tile_pairs<BK>(w.qp.data() + t0 * dp, dp, w.ktp.data() + (k0 / BK) * dp * BK,
                              sg, (int)dp, gcols, cf.scale);
#endif
        if constexpr (!pairs)
          qk_tile<QK_COLS, BK>(w.qs.data() + t0 * d, kt, sg, (int)d, gcols, d);
        for (int r = 0; r < MR; r++) {
          const int i = t0 + r;
          float* sr = sg + r * BK;
          VT mx = V::set1(-INFINITY);
          if (masked) {
            for (int j = 0; j < gcols; j += N) {
              const VT x = V::add(V::load(sr + j), V::load(kmask + j));
              V::store(sr + j, x);
              mx = V::max(mx, x);
            }
          } else {
            for (int j = 0; j < gcols; j += N) mx = V::max(mx, V::load(sr + j));
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
            mx = V::set1(-INFINITY);
            for (int j = 0; j < gcols; j += N) mx = V::max(mx, V::load(sr + j));
          }
          const float block_max = V::reduce_max(mx);
          const float m_new = std::max(m[i], block_max);
          if (m_new == -INFINITY) {  // nothing allowed yet: p = 0
            std::fill(sr, sr + gcols, 0.0f);
            continue;
          }
          const float alpha = std::exp(m[i] - m_new);  // exp(-inf) = 0 on the first
          const VT shift = V::set1(m_new);
          VT sum = V::zero();
          const int v = shared ? depth[i] : 0;  // p = m exp(s - max), m of the row's depth
          const float* mul = v > 0 ? kmul + (v - 1) * BK : nullptr;
          for (int j = 0; j < gcols; j += N) {
            VT e = vexp(V::sub(V::load(sr + j), shift));
            if (v > 0) e = V::mul(e, V::load(mul + j));
            sum = V::add(sum, e);
            V::store(sr + j, e);
          }
          l[i] = l[i] * alpha + V::reduce_add(sum);
          m[i] = m_new;
          if (alpha != 1.0f) {
            float* orow = w.ot.data() + i * d;
            const VT a = V::set1(alpha);
            for (int64_t c = 0; c < d; c += N) V::store(orow + c, V::mul(a, V::load(orow + c)));
          }
        }
#if JD_BF16_PAIRS
        if constexpr (pairs) {  // P rounded to bfloat16; its columns past gk are 0
          bf16_t* sp = w.sp.data() + (amx ? t0 * BK : 0);
          for (int r = 0; r < MR; r++) {
            for (int j = 0; j < gcols; j += N) V::store(sp + r * BK + j, V::load(sg + r * BK + j));
#if JD_AMX
            if (amx) std::fill(sp + r * BK + gcols, sp + r * BK + std::max(gcols, kpv), bf16_t{0});
#endif
          }
          if (!amx) pv_panels_pairs(sp, w.vpp.data(), rows2, k0, w.ot.data() + t0 * d, (int)d, gk);
        }
#endif
        if constexpr (!pairs)
          pv_panels(sg, w.vp.data(), kend_all, k0, w.ot.data() + t0 * d, (int)d, gk);
      }
#if JD_AMX
      if (amx && kpv > 0) amx_pv(w.sp.data(), w.vpp.data(), rows2, k0, w.ot.data(), d, kpv);
#endif
    }
    for (int i = 0; i < nq; i++) {
      const VT inv = V::set1(l[i] > 0.0f ? cf.out_scale / l[i] : 0.0f);
      Out* dst = it.o + (q0 + i) * it.q_stride;
      for (int64_t c = 0; c < d; c += N) V::store(dst + c, V::mul(V::load(w.ot.data() + i * d + c), inv));
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
// q, k, v and do are read in the inputs' type and packed as float32; the gradients
// are float32 (summed over the branches in place).

// One query head of a backward item: row i of q, do and dq at + i q_stride, its
// lse, delta and c at + i stat_stride.
template <class In>
struct BwdHead {
  const In *q, *dout;
  const float *lse, *delta, *c;
  float* dq;
  const Nesting* nest;  // shared pairs: this head's (nullptr: none)
};

// The query heads that read one kv head at one offset of one dilated segment, and
// that kv head's rows: their gradients are this item's alone (within a branch).
template <class In>
struct BwdItem {
  std::vector<BwdHead<In>> heads;
  const In *k, *v;
  const uint8_t* valid;
  float *dk, *dv;
  int64_t q_stride, stat_stride, kv_stride, valid_stride, lq, lk;
  int64_t pos0, step;  // row and key i lie at position pos0 + i step of the batch row
};

struct BwdScratch {
  // mult: for keys of depth v = 1..nc (shared pairs), each row's multiplicity m =
  // 1 + min(v, depth) (Nesting), rows padded; row, row2: one converted row each
  std::vector<float> qst, qs, dot, dos, lse, delta, dq, kb, ks, vb, dk, dv, st, dpt, mult,
      row, row2;
  std::vector<uint8_t> key_ok;
  std::vector<int> key_depth;
  std::vector<int64_t> key_cut0, key_cut1;  // the rows that share key t with the finer branch
  // the bfloat16 pair path (JD_BF16_PAIRS): q and do as pair panels [D / 2][QK_COLS][2]
  // per tile (qpp, dopp; S and dP; on AMX tiles [DP / 2][BR][2], the head dimension
  // padded to a multiple of 32) and as pairs of rows [rows / 2][D][2] (qrp, drp; dk
  // and dv), each row's c (cvec); the key block's k and v rows as stored (kraw, vraw;
  // on AMX padded to DP) and k as pairs of rows (kpp; dq); P c, ds scale and its
  // transpose in bfloat16 (pb, dsb, dst)
  std::vector<bf16_t> qpp, dopp, qrp, drp, kraw, vraw, kpp, pb, dsb, dst;
  std::vector<float> cvec;
  BwdScratch(int64_t max_lq, int64_t max_lk, int64_t d) {
    const int64_t lqp = (max_lq + BR - 1) / BR * BR, lkp = (max_lk + BC - 1) / BC * BC;
    for (auto* x : {&qst, &qs, &dot, &dos, &dq}) x->resize(lqp * d);
    lse.resize(lqp); delta.resize(lqp);
    for (auto* x : {&kb, &ks, &vb}) x->resize(BC * d);
    dk.resize(lkp * d); dv.resize(lkp * d);
    st.resize(BC * BR); dpt.resize(BC * BR);
    row.resize(MAX_D); row2.resize(MAX_D);
    key_ok.resize(BC);
    key_depth.resize(BC);
    key_cut0.resize(BC);
    key_cut1.resize(BC);
  }
};

template <class In>
void backward_item(const Config& cf, const BwdItem<In>& it, BwdScratch& w) {
  const int64_t d = cf.d, lq = it.lq, lk = it.lk;
  if (lq == 0 || lk == 0) return;
  const int64_t nqt = (lq + BR - 1) / BR, nkb = (lk + BC - 1) / BC, lqp = nqt * BR;
  // bfloat16 inputs on the bfloat16 dot products (the forward's pairs, section above)
  constexpr bool pairs = JD_BF16_PAIRS && std::is_same_v<In, bf16_t>;
  // AMX: the five products on tiles, S^T and dP^T over the head dimension padded to
  // kd, dq over the key block padded to kpad keys (k's pairs of rows and ds^T's columns
  // past the block's 0)
  const AmxScope tiles(pairs);
  const bool amx = tiles.on;
  static_assert(BC % 48 == 0 && BR % 48 == 0, "amx_gemm's rows: multiples of 48");
  const int64_t kd = amx ? (d + 31) / 32 * 32 : d, kpad = amx ? (BC + 31) / 32 * 32 : BC;
#if JD_BF16_PAIRS
  if constexpr (pairs) {
    for (auto* x : {&w.kraw, &w.vraw}) x->resize(BC * kd);
    for (auto* x : {&w.pb, &w.dsb}) x->resize(BC * BR);
    w.kpp.assign(kpad * d, bf16_t{0});
    w.dst.assign(BR * kpad, bf16_t{0});
  }
#endif
  std::fill(w.dk.begin(), w.dk.begin() + nkb * BC * d, 0.0f);
  std::fill(w.dv.begin(), w.dv.begin() + nkb * BC * d, 0.0f);
  const VT lane = V::iota();
  for (const BwdHead<In>& hd : it.heads) {
    const Nesting* ns = hd.nest;
    const int nc = ns ? ns->nc : 0;
    if ((int64_t)w.mult.size() < nc * lqp) w.mult.resize(nc * lqp);
    // the head's query side, packed once: scale q and c do as rows and as
    // transposed tiles [tile][D][BR]; padding rows hold 0 and lse = +inf (p = 0)
#if JD_BF16_PAIRS
    if constexpr (pairs) {
      for (auto* x : {&w.qpp, &w.dopp, &w.qrp, &w.drp})
        if ((int64_t)x->size() < lqp * kd) x->resize(lqp * kd);
      if ((int64_t)w.cvec.size() < lqp) w.cvec.resize(lqp);
      pack_row_pairs(hd.q, it.q_stride, lq, d, w.qrp.data());
      pack_row_pairs(hd.dout, it.q_stride, lq, d, w.drp.data());
      for (auto* x : {&w.qrp, &w.drp})  // the last tile's rows past the pairs: 0
        std::fill(x->begin() + (lq + 1) / 2 * 2 * d, x->begin() + lqp * d, bf16_t{0});
    }
#endif
    for (int64_t i = 0; i < lqp; i++) {
      const bool real = i < lq;
      const float ci = real ? hd.c[i * it.stat_stride] : 0.0f;
#if JD_BF16_PAIRS
      if constexpr (pairs) {  // row i's pairs in its tile's panels, as stored
        w.cvec[i] = ci;
        // (AMX: pairs along the head dimension, [kd / 2][BR][2] per tile)
        const int64_t at = amx ? (i / BR) * BR * kd + 2 * (i % BR)
                               : (i / BR) * BR * d + ((i % BR) / QK_COLS) * QK_COLS * d +
                                     2 * (i % QK_COLS);
        if (i + kPackAhead < lq) {
          prefetch_row(hd.q + (i + kPackAhead) * it.q_stride, d);
          prefetch_row(hd.dout + (i + kPackAhead) * it.q_stride, d);
        }
        for (auto [row, packed] :
             {std::pair{hd.q, w.qpp.data()}, std::pair{hd.dout, w.dopp.data()}})
          scatter_pairs(real ? row + i * it.q_stride : nullptr, d, amx ? kd : d, packed + at,
                        amx ? BR : QK_COLS);
      }
#endif
      if constexpr (!pairs) {
        const float* qrow = real ? as_float(hd.q + i * it.q_stride, d, w.row.data()) : nullptr;
        const float* drow = real ? as_float(hd.dout + i * it.q_stride, d, w.row2.data()) : nullptr;
        float* qt = w.qst.data() + (i / BR) * d * BR + i % BR;
        float* dt = w.dot.data() + (i / BR) * d * BR + i % BR;
        for (int64_t c = 0; c < d; c++) {
          const float qv = real ? qrow[c] * cf.scale : 0.0f, dv = real ? drow[c] * ci : 0.0f;
          w.qs[i * d + c] = qv; qt[c * BR] = qv;
          w.dos[i * d + c] = dv; dt[c * BR] = dv;
        }
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
        const In* krow = it.k + (k0 + t) * it.kv_stride;
        const In* vrow = it.v + (k0 + t) * it.kv_stride;
#if JD_BF16_PAIRS
        if constexpr (pairs) {  // rows kd apart, 0 past d
          if (t + kPackAhead < nk) {
            prefetch_row(krow + kPackAhead * it.kv_stride, d);
            prefetch_row(vrow + kPackAhead * it.kv_stride, d);
          }
          for (auto [row, raw] :
               {std::pair{krow, w.kraw.data()}, std::pair{vrow, w.vraw.data()}}) {
            if (real) std::copy(row, row + d, raw + t * kd);
            std::fill(raw + t * kd + (real ? d : 0), raw + (t + 1) * kd, bf16_t{0});
          }
        }
#endif
        if constexpr (!pairs) {
          const VT zero = V::zero(), scale = V::set1(cf.scale);
          for (int64_t c = 0; c < d; c += N) {
            const VT kx = real ? V::load(krow + c) : zero;
            V::store(w.kb.data() + t * d + c, kx);
            V::store(w.ks.data() + t * d + c, V::mul(kx, scale));
            V::store(w.vb.data() + t * d + c, real ? V::load(vrow + c) : zero);
          }
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
#if JD_BF16_PAIRS
      if constexpr (pairs) pack_row_pairs(w.kraw.data(), kd, BC, d, w.kpp.data());
#endif
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
#if JD_BF16_PAIRS
        if constexpr (pairs) {  // s^T = scale k q^T and dp^T = v do^T c from the pairs
#if JD_AMX
          if (amx) {
            amx_gemm(w.kraw.data(), kd, w.qpp.data() + qt * BR * kd, 2 * BR, w.st.data(), BR,
                     BC, BR, kd, true);
            amx_gemm(w.vraw.data(), kd, w.dopp.data() + qt * BR * kd, 2 * BR, w.dpt.data(), BR,
                     BC, BR, kd, true);
            const VT sc = V::set1(cf.scale);
            for (int t = 0; t < BC; t++)
              for (int c = 0; c < BR; c += N) {
                float* sr = w.st.data() + t * BR + c;
                float* dr = w.dpt.data() + t * BR + c;
                V::store(sr, V::mul(V::load(sr), sc));
                V::store(dr, V::mul(V::load(dr), V::load(w.cvec.data() + q0 + c)));
              }
          } else
#endif
          for (int t0 = 0; t0 < BC; t0 += MR) {
            qk_tile_pairs<BR>(w.kraw.data() + t0 * kd, kd, w.qpp.data() + qt * BR * d,
                              w.st.data() + t0 * BR, (int)d, BR, cf.scale);
            qk_tile_pairs<BR>(w.vraw.data() + t0 * kd, kd, w.dopp.data() + qt * BR * d,
                              w.dpt.data() + t0 * BR, (int)d, BR, 1.0f, w.cvec.data() + q0);
          }
        }
#endif
        if constexpr (!pairs) {
          for (int t0 = 0; t0 < BC; t0 += MR) {
            qk_tile<BR>(w.kb.data() + t0 * d, qst, w.st.data() + t0 * BR, (int)d, BR);
            qk_tile<BR>(w.vb.data() + t0 * d, dot, w.dpt.data() + t0 * BR, (int)d, BR);
          }
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
          const VT key = V::set1((float)(k0 + t - q0));
          const bool cut = w.key_cut0[t] < q1 && w.key_cut1[t] > q0;
          const VT cut0 = V::set1((float)(w.key_cut0[t] - q0));
          const VT cut1 = V::set1((float)(w.key_cut1[t] - q0));
          for (int c = 0; c < BR; c += N) {
            VT p = vexp(V::sub(V::load(sr + c), V::load(w.lse.data() + q0 + c)));
            if (v > 0) p = V::mul(p, V::load(mul + c));
            const VT row = V::add(lane, V::set1((float)c));
            if (cf.causal) p = V::keep(V::ge(row, key), p);  // rows before the key see nothing of it
            if (cut)  // rows that share the key with the finer branch: its pairs
              p = V::drop(V::both(V::ge(row, cut0), V::lt(row, cut1)), p);
            const VT ds = V::mul(
                p, V::sub(V::load(dr + c), V::load(w.delta.data() + q0 + c)));
            V::store(sr + c, p);
            V::store(dr + c, ds);
          }
        }
#if JD_BF16_PAIRS
        if constexpr (pairs) {
          // dv += (p c)^T do, dk += (scale ds)^T q, dq += (scale ds) k: p c and scale ds
          // rounded to bfloat16, and scale ds transposed (rows along the keys)
          const VT sc = V::set1(cf.scale);
          for (int t = 0; t < BC; t++)
            for (int c = 0; c < BR; c += N) {
              V::store(w.pb.data() + t * BR + c, V::mul(V::load(w.st.data() + t * BR + c),
                                                         V::load(w.cvec.data() + q0 + c)));
              V::store(w.dsb.data() + t * BR + c, V::mul(V::load(w.dpt.data() + t * BR + c), sc));
            }
          static_assert(BC % 8 == 0 && BR % 8 == 0, "ds^T in 8 x 8 blocks");
          for (int t = 0; t < BC; t += 8)
            for (int i = 0; i < BR; i += 8)
              transpose_8x8(w.dsb.data() + t * BR + i, BR, w.dst.data() + i * kpad + t, kpad);
#if JD_AMX
          if (amx) {
            amx_gemm(w.pb.data(), BR, w.drp.data() + q0 * d, 2 * d, w.dv.data() + k0 * d, d,
                     BC, d, BR, false);
            amx_gemm(w.dsb.data(), BR, w.qrp.data() + q0 * d, 2 * d, w.dk.data() + k0 * d, d,
                     BC, d, BR, false);
            amx_gemm(w.dst.data(), kpad, w.kpp.data(), 2 * d, w.dq.data() + q0 * d, d, BR, d,
                     kpad, false);
          } else
#endif
          {
            for (int t0 = 0; t0 < BC; t0 += MR) {
              pv_columns_pairs<BR>(w.pb.data() + t0 * BR, w.drp.data() + q0 * d,
                                   w.dv.data() + (k0 + t0) * d, d, (int)d, BR / 2);
              pv_columns_pairs<BR>(w.dsb.data() + t0 * BR, w.qrp.data() + q0 * d,
                                   w.dk.data() + (k0 + t0) * d, d, (int)d, BR / 2);
            }
            for (int r0 = 0; r0 < BR; r0 += MR)
              pv_columns_pairs<BC>(w.dst.data() + r0 * BC, w.kpp.data(),
                                   w.dq.data() + (q0 + r0) * d, d, (int)d, BC / 2);
          }
        }
#endif
        if constexpr (!pairs) {
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

// Each thread of a call (parallel_units.h) keeps its own scratch, made by the first
// unit that needs it, for every unit it runs.
struct ThreadScratch {
  std::unique_ptr<Scratch> fwd;
  std::unique_ptr<BwdScratch> bwd;
};
using Unit = std::function<void(int64_t, ThreadScratch&)>;

void parallel_for(ffi::ThreadPool& pool, int64_t count, Unit unit) {
  jax_dilated::parallel_for<ThreadScratch>(pool, count, std::move(unit));
}

// Attention over `count` items (item(i) gives item i's Item: where its rows are, at
// most max_lq query and max_lk key rows), their rows cut into runs.
template <class ItemFn>
void run_items(const Config& cf, int64_t count, int64_t max_lq, int64_t max_lk,
               const ItemFn& item, ffi::ThreadPool& pool) {
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
    const auto it = item(u % count);
    if (j * run_len >= it.lq) return;
    if (!ts.fwd) ts.fwd = std::make_unique<Scratch>(max_lk, cf.d);
    run_rows(cf, it, *ts.fwd, j * run_len, std::min(it.lq, (j + 1) * run_len));
  });
}

// f(tag) for the inputs' element type, tag a value of float, bf16_t or f16_t.
template <class F>
ffi::Error with_input_type(ffi::DataType type, F&& f) {
  switch (type) {
    case ffi::DataType::F32: return f(float{});
    case ffi::DataType::BF16: return f(bf16_t{});
    case ffi::DataType::F16: return f(f16_t{});
    default:
      return ffi::Error::InvalidArgument("q, k and v must be float32, bfloat16 or float16");
  }
}

template <class T>
const T* data_of(const ffi::AnyBuffer& b) {
  return static_cast<const T*>(b.untyped_data());
}

// q [..., L, C, D] and k, v [..., Lk, Ck, D] of one rank and dtype: N (the product
// of the leading axes), L, C, D, Lk and Ck.
struct Shapes {
  int64_t n, lq, h, d, lk, hkv;
};

ffi::Error read_shapes(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                       const ffi::AnyBuffer& v, Shapes& sh) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() < 4 || kd.size() != qd.size())
    return ffi::Error::InvalidArgument("q and k must be [..., L, H, D] of one rank");
  if (!std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument("k and v must have one shape");
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return ffi::Error::InvalidArgument("q, k and v must have one dtype");
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

// The plain call: o [N, Lq, H, D] (the inputs' dtype), m, l [N, Lq, H] for q [N, Lq,
// H, D], k, v [N, Lk, Hkv, D] and kv_valid empty, [N, Lk] or [N, Lk, Hkv].
ffi::Error Forward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::U8> kv_valid, float scale, bool causal,
                   ffi::ThreadPool pool, ffi::Result<ffi::AnyBuffer> o,
                   ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l) {
  Shapes sh;
  if (auto err = read_shapes(q, k, v, sh); err.failure()) return err;
  if (o->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("o must have the inputs' dtype");
  const uint8_t* valid = kv_valid.element_count() == 0 ? nullptr : kv_valid.typed_data();
  const int64_t vc = valid == nullptr ? 1 : (int64_t)kv_valid.element_count() / (sh.n * sh.lk);
  if (valid != nullptr && ((vc != 1 && vc != sh.hkv) ||
                           (int64_t)kv_valid.element_count() != sh.n * sh.lk * vc))
    return ffi::Error::InvalidArgument("kv_valid must be [N, Lk] or [N, Lk, Hkv]");
  const Config cf{sh.d, scale, 1.0f, causal, false};
  float *mp = m->typed_data(), *lp = l->typed_data();
  return with_input_type(q.element_type(), [&](auto tag) {
    using In = decltype(tag);
    const In *qp = data_of<In>(q), *kp = data_of<In>(k), *vp = data_of<In>(v);
    In* op = static_cast<In*>(o->untyped_data());
    auto item = [=](int64_t nh) {
      const int64_t n = nh / sh.h, h = nh % sh.h, hk = h / (sh.h / sh.hkv);
      const int64_t qrow = (n * sh.lq * sh.h + h), krow = n * sh.lk * sh.hkv + hk;
      return Item<In, In>{qp + qrow * sh.d, kp + krow * sh.d, vp + krow * sh.d,
                          valid == nullptr ? nullptr : valid + n * sh.lk * vc + (vc == 1 ? 0 : hk),
                          op + qrow * sh.d, mp + qrow, lp + qrow,
                          sh.h * sh.d, sh.hkv * sh.d, vc, sh.h, sh.lq, sh.lk};
    };
    run_items(cf, sh.n * sh.h, sh.lq, sh.lk, item, pool);
    return ffi::Error::Success();
  });
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

// q [B, T, H, D], k, v [B, T, Hkv, D] and kv_mask empty or [B, T]: their shapes.
ffi::Error read_dilated(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                        const ffi::AnyBuffer& v, ffi::Buffer<ffi::U8>& kv_mask, Shapes& sh,
                        const uint8_t*& valid) {
  if (auto err = read_shapes(q, k, v, sh); err.failure()) return err;
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

// DilatedForward's work for inputs of type In and an output of type Out.
template <class In, class Out>
void dilated_forward(const Config& cf, const Shapes& sh, const uint8_t* valid,
                     const std::vector<Branch>& branches, const std::vector<Nesting>& nests,
                     bool shared_pairs, const In* qp, const In* kp, const In* vp, Out* op,
                     float* mp, float* lp, ffi::ThreadPool& pool) {
  const int64_t b = sh.n, t = sh.lq, h = sh.h, hkv = sh.hkv, d = sh.d;
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
      return Item<In, Out>{qp + qrow * d, kp + krow * d, vp + krow * d,
                           valid == nullptr ? nullptr : valid + kpos,
                           op + qrow * d, mp + qrow, lp + qrow,
                           r * h * d, r * hkv * d, r, r * h, br.rows(t, s, br.qo[j]),
                           br.rows(t, s, br.ko[g]),
                           nest == nullptr ? nullptr : nest + br.qh[j], qpos - bi * t,
                           kpos - bi * t, r};
    };
    run_items(cf, b * segs * br.hs, br.max_rows(), br.max_rows(), item, pool);
  }
  // rows no branch selected (l = 0) hold no output yet
  const int64_t rows = b * t * h, per = 16384;
  parallel_for(pool, (rows + per - 1) / per, [=](int64_t u, ThreadScratch&) {
    for (int64_t row = u * per; row < std::min(rows, (u + 1) * per); row++)
      if (lp[row] == 0.0f) std::fill(op + row * d, op + (row + 1) * d, Out{});
  });
}

// Dilated attention's forward, every branch in one call: q [B, T, H, D], k, v
// [B, T, Hkv, D], kv_mask empty or [B, T], the branches' attributes (read_branches).
// Each dilated segment of each served head is an item whose rows are r positions
// apart, read where they lie and written into o, m, l in place. accumulate
// (longnet): every branch continues each row's softmax, so o, m and l are those of
// one softmax over all the branches' keys, and o must be float32 (each branch reads
// back what the ones before wrote); else (head_groups) each row is written by its one
// branch, the output times out_scale, in float32 or the inputs' dtype. Rows no branch
// selects get o = 0, m = -inf, l = 0.
ffi::Error DilatedForward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::U8> kv_mask, Ints segments, Ints rates,
                          Ints branch_heads, Ints q_heads, Ints q_offsets,
                          Ints branch_kv_heads, Ints kv_heads, Ints kv_offsets, float scale,
                          bool causal, bool accumulate, float out_scale, bool shared_pairs,
                          ffi::ThreadPool pool, ffi::Result<ffi::AnyBuffer> o,
                          ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l) {
  Shapes sh;
  const uint8_t* valid;
  if (auto err = read_dilated(q, k, v, kv_mask, sh, valid); err.failure()) return err;
  const bool f32_out = o->element_type() == ffi::DataType::F32;
  if (!f32_out && o->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("o must be float32 or have the inputs' dtype");
  if (accumulate && !f32_out)
    return ffi::Error::InvalidArgument("accumulate needs a float32 o");
  std::vector<Branch> branches;
  if (auto err = read_branches(segments, rates, branch_heads, q_heads, q_offsets,
                               branch_kv_heads, kv_heads, kv_offsets, sh.h, sh.hkv, branches);
      err.failure())
    return err;
  std::vector<Nesting> nests;
  if (shared_pairs) {
    if (!accumulate) return ffi::Error::InvalidArgument("shared pairs need accumulate");
    if (auto err = read_nestings(branches, sh.lq, sh.h, nests); err.failure()) return err;
  }
  float *mp = m->typed_data(), *lp = l->typed_data();
  prefer_huge_pages(o->untyped_data(), o->size_bytes());
  fill_rows(pool, sh.n * sh.lq * sh.h, {mp, lp}, {1, 1}, {-INFINITY, 0.0f});
  const Config cf{sh.d, scale, out_scale, causal, accumulate};
  return with_input_type(q.element_type(), [&](auto tag) {
    using In = decltype(tag);
    const In *qp = data_of<In>(q), *kp = data_of<In>(k), *vp = data_of<In>(v);
    if (f32_out)
      dilated_forward(cf, sh, valid, branches, nests, shared_pairs, qp, kp, vp,
                      static_cast<float*>(o->untyped_data()), mp, lp, pool);
    else
      dilated_forward(cf, sh, valid, branches, nests, shared_pairs, qp, kp, vp,
                      static_cast<In*>(o->untyped_data()), mp, lp, pool);
    return ffi::Error::Success();
  });
}

// DilatedBackward's work for inputs of type In.
template <class In>
void dilated_backward(const Config& cf, const Shapes& sh, const uint8_t* valid,
                      const std::vector<Branch>& branches, const std::vector<Nesting>& nests,
                      bool shared_pairs, const In* qp, const In* kp, const In* vp,
                      const In* dop, const float* cp, const float* lsep, const float* deltap,
                      float* dqp, float* dkp, float* dvp, ffi::ThreadPool& pool) {
  const int64_t b = sh.n, t = sh.lq, h = sh.h, hkv = sh.hkv, d = sh.d;
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
      BwdItem<In> it{{}, kp + krow * d, vp + krow * d,
                     valid == nullptr ? nullptr : valid + kpos,
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
}

// Dilated attention's backward, every branch in one call: q, k, v, kv_mask and the
// branches as for DilatedForward; dout [B, T, H, D] (the inputs' dtype) and per row
// [B, T, H] c, lse (the rounded log-sum-exp of the whole call, 0 for a row without
// keys) and delta (section "backward" above). dq, dk, dv (float32) are the sums over
// the branches; an item is one dilated segment of one kv head at one offset with the
// query heads that read it, so within a branch no two items write one row.
ffi::Error DilatedBackward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> c,
                           ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                           ffi::Buffer<ffi::U8> kv_mask, Ints segments, Ints rates,
                           Ints branch_heads, Ints q_heads, Ints q_offsets,
                           Ints branch_kv_heads, Ints kv_heads, Ints kv_offsets, float scale,
                           bool causal, bool shared_pairs, ffi::ThreadPool pool,
                           ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                           ffi::ResultBuffer<ffi::F32> dv) {
  Shapes sh;
  const uint8_t* valid;
  if (auto err = read_dilated(q, k, v, kv_mask, sh, valid); err.failure()) return err;
  if (dout.element_type() != q.element_type() || dout.element_count() != q.element_count() ||
      c.element_count() * sh.d != q.element_count() ||
      lse.element_count() != c.element_count() || delta.element_count() != c.element_count())
    return ffi::Error::InvalidArgument(
        "dout must be shaped and typed as q, c, lse and delta as its rows");
  std::vector<Branch> branches;
  if (auto err = read_branches(segments, rates, branch_heads, q_heads, q_offsets,
                               branch_kv_heads, kv_heads, kv_offsets, sh.h, sh.hkv, branches);
      err.failure())
    return err;
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  for (auto* buf : {&dq, &dk, &dv}) prefer_huge_pages((*buf)->untyped_data(), (*buf)->size_bytes());
  fill_rows(pool, sh.n * sh.lq, {dqp, dkp, dvp}, {sh.h * sh.d, sh.hkv * sh.d, sh.hkv * sh.d},
            {0.0f, 0.0f, 0.0f});
  std::vector<Nesting> nests;
  if (shared_pairs)
    if (auto err = read_nestings(branches, sh.lq, sh.h, nests); err.failure()) return err;
  const Config cf{sh.d, scale, 1.0f, causal, false};
  return with_input_type(q.element_type(), [&](auto tag) {
    using In = decltype(tag);
    dilated_backward(cf, sh, valid, branches, nests, shared_pairs, data_of<In>(q),
                     data_of<In>(k), data_of<In>(v), data_of<In>(dout), c.typed_data(),
                     lse.typed_data(), delta.typed_data(), dqp, dkp, dvp, pool);
    return ffi::Error::Success();
  });
}

// A small bfloat16 attention (one head, 45 queries, 61 keys, causal, D = 48) through
// run_rows and backward_item against float64 loops: 0 when the output and the
// gradients are within bfloat16's tolerance and the log-sum-exp within float32's,
// else 1. build.py runs it once per build that multiplies bfloat16 itself (in a child
// process, so that an instruction the CPU refuses cannot take the caller down) before
// it uses that build.
int self_test() {
  constexpr int64_t lq = 45, lk = 61, d = 48;
  auto bf16 = [](float x) {  // rounded to nearest even
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return bf16_t{(uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
  };
  auto value = [](bf16_t x) {
    const uint32_t u = (uint32_t)x.bits << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return (double)f;
  };
  std::vector<bf16_t> q(lq * d), k(lk * d), v(lk * d), o(lq * d);
  uint32_t state = 12345u;  // a fixed linear congruential draw in [-2, 2)
  auto draw = [&state]() {
    state = state * 1664525u + 1013904223u;
    return (float)((state >> 8) * (4.0 / 16777216.0) - 2.0);
  };
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = bf16(draw());
  std::vector<float> m(lq), l(lq);
  const float scale = 1.0f / std::sqrt((float)d);
  const Config cf{d, scale, 1.0f, true, false};
  const Item<bf16_t, bf16_t> it{q.data(), k.data(), v.data(), nullptr, o.data(), m.data(),
                                l.data(), d, d, 1, 1, lq, lk};
  Scratch w(lk, d);
  run_rows(cf, it, w, 0, lq);
  double worst_o = 0.0, worst_lse = 0.0, largest = 0.0;
  for (int64_t i = 0; i < lq; i++) {
    std::vector<double> s(i + 1);
    double mx = -INFINITY, sum = 0.0;
    for (int64_t t = 0; t <= i; t++) {
      double dot = 0.0;
      for (int64_t c = 0; c < d; c++) dot += value(q[i * d + c]) * value(k[t * d + c]);
      s[t] = dot * scale;
      mx = std::max(mx, s[t]);
    }
    for (int64_t t = 0; t <= i; t++) sum += std::exp(s[t] - mx);
    const double lse = mx + std::log(sum), got_lse = m[i] + std::log((double)l[i]);
    worst_lse = std::max(worst_lse, std::abs(got_lse - lse) / std::max(std::abs(lse), 1.0));
    for (int64_t c = 0; c < d; c++) {
      double want = 0.0;
      for (int64_t t = 0; t <= i; t++) want += std::exp(s[t] - lse) * value(v[t * d + c]);
      largest = std::max(largest, std::abs(want));
      worst_o = std::max(worst_o, std::abs(value(o[i * d + c]) - want));
    }
  }
  if (!(worst_o <= 2e-2 * std::max(largest, 1.0) && worst_lse <= 1e-5)) return 1;

  // the backward of the same attention for a drawn do and row factors c (the kernel
  // reads do c, and delta = c rowsum(do o) as given), against float64 gradients from
  // p = exp(s - lse) with the same delta
  std::vector<bf16_t> dout(lq * d);
  for (auto& e : dout) e = bf16(draw());
  std::vector<float> lse(lq), delta(lq), c(lq), dq(lq * d), dk(lk * d), dv(lk * d);
  for (int64_t i = 0; i < lq; i++) {
    lse[i] = m[i] + std::log(l[i]);
    c[i] = 1.0f + 0.25f * draw();
    double dot = 0.0;
    for (int64_t e = 0; e < d; e++) dot += value(dout[i * d + e]) * value(o[i * d + e]);
    delta[i] = (float)(c[i] * dot);
  }
  BwdItem<bf16_t> bi;
  bi.heads.push_back(
      {q.data(), dout.data(), lse.data(), delta.data(), c.data(), dq.data(), nullptr});
  bi.k = k.data(), bi.v = v.data(), bi.valid = nullptr, bi.dk = dk.data(), bi.dv = dv.data();
  bi.q_stride = d, bi.stat_stride = 1, bi.kv_stride = d, bi.valid_stride = 1;
  bi.lq = lq, bi.lk = lk, bi.pos0 = 0, bi.step = 1;
  BwdScratch bw(lq, lk, d);
  backward_item(cf, bi, bw);
  std::vector<double> wq(lq * d, 0.0), wk(lk * d, 0.0), wv(lk * d, 0.0);
  for (int64_t i = 0; i < lq; i++) {
    const double lse_i = m[i] + std::log((double)l[i]);
    for (int64_t t = 0; t <= i; t++) {
      double s = 0.0, dpt = 0.0;
      for (int64_t e = 0; e < d; e++) {
        s += value(q[i * d + e]) * value(k[t * d + e]);
        dpt += c[i] * value(dout[i * d + e]) * value(v[t * d + e]);
      }
      const double p = std::exp(s * scale - lse_i), ds = p * (dpt - delta[i]);
      for (int64_t e = 0; e < d; e++) {
        wv[t * d + e] += p * c[i] * value(dout[i * d + e]);
        wq[i * d + e] += scale * ds * value(k[t * d + e]);
        wk[t * d + e] += scale * ds * value(q[i * d + e]);
      }
    }
  }
  auto close = [](const std::vector<float>& got, const std::vector<double>& want) {
    double worst = 0.0, large = 0.0;
    for (size_t j = 0; j < want.size(); j++) {
      worst = std::max(worst, std::abs(got[j] - want[j]));
      large = std::max(large, std::abs(want[j]));
    }
    return worst <= 2e-2 * large;
  };
  return close(dq, wq) && close(dk, wk) && close(dv, wv) ? 0 : 1;
}

}  // namespace

// The instruction set this library was built for (one of build.py's ISAS or its
// EMULATED), which build.py reports (jd.backend_report).
extern "C" __attribute__((visibility("default"))) const char* JaxDilatedNativeIsa() {
  return BUILD_ISA;
}

// self_test(): 0 when this build's bfloat16 path computes attention and its gradients.
extern "C" __attribute__((visibility("default"))) int JaxDilatedSelfTest() { return self_test(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDilatedAttentionForwardCpu, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::Buffer<ffi::U8>>()   // kv_valid
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::AnyBuffer>()          // o
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m
                                  .Ret<ffi::Buffer<ffi::F32>>());  // l

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDilatedAttentionDilatedForwardCpu, DilatedForward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
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
                                  .Ret<ffi::AnyBuffer>()          // o
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m
                                  .Ret<ffi::Buffer<ffi::F32>>());  // l

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDilatedAttentionDilatedBackwardCpu, DilatedBackward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // dout
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
