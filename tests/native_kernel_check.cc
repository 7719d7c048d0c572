// A standalone check of the native kernel's arithmetic on one build, against double
// precision: exp, the bfloat16 / float16 conversions, the forward (run_rows) and the
// backward (backward_item) on one item, float32 and half-precision inputs. It includes
// the kernel's source, so it runs where jaxlib cannot: tests/test_native.py builds it
// with an aarch64 cross compiler and runs it under qemu, where both are installed.
#include "attention_cpu.cc"

#include <cstdio>
#include <cstring>
#include <random>

namespace {
int failures = 0;
void check(bool ok, const char* what, double err) {
  std::printf("%-48s %s (%.2e)\n", what, ok ? "ok" : "FAIL", err);
  failures += !ok;
}
float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
uint16_t f16_bits(float x) {  // normal values that f16 holds exactly, or 0
  if (x == 0.0f) return 0;
  int e;
  const float m = std::frexp(std::fabs(x), &e);
  return (uint16_t)((x < 0) << 15 | (e - 1 + 15) << 10 | (int)std::lrint((m * 2 - 1) * 1024));
}

// values exactly representable in T, as float and as T
template <class T> void make(std::mt19937& g, int n, std::vector<float>& f, std::vector<T>& t);
template <> void make(std::mt19937& g, int n, std::vector<float>& f, std::vector<float>& t) {
  std::normal_distribution<float> nd;
  f.resize(n); for (auto& x : f) x = nd(g);
  t = f;
}
template <> void make(std::mt19937& g, int n, std::vector<float>& f, std::vector<bf16_t>& t) {
  std::normal_distribution<float> nd;
  f.resize(n); t.resize(n);
  for (int i = 0; i < n; i++) {
    const uint32_t u = float_bits(nd(g)) & 0xffff0000u;
    f[i] = bits_to_float(u);
    t[i].bits = (uint16_t)(u >> 16);
  }
}
template <> void make(std::mt19937& g, int n, std::vector<float>& f, std::vector<f16_t>& t) {
  std::uniform_int_distribution<int> ud(-700, 700);
  f.resize(n); t.resize(n);
  for (int i = 0; i < n; i++) {
    f[i] = ud(g) / 256.0f;
    t[i].bits = f16_bits(f[i]);
  }
}
template <class T> double to_double(T x);
template <> double to_double(float x) { return x; }
template <> double to_double(bf16_t x) { return bits_to_float((uint32_t)x.bits << 16); }
template <> double to_double(f16_t x) {  // normal or zero
  if ((x.bits & 0x7fff) == 0) return 0.0;
  const int e = (x.bits >> 10) & 31, f = x.bits & 1023;
  return (x.bits >> 15 ? -1 : 1) * std::ldexp(1.0 + f / 1024.0, e - 15);
}

template <class In, class Out>
void forward_case(const char* name, bool causal, double tol) {
  const int lq = 100, lk = 130, d = 64;
  std::mt19937 g(7);
  std::vector<float> qf, kf, vf;
  std::vector<In> q, k, v;
  make(g, lq * d, qf, q); make(g, lk * d, kf, k); make(g, lk * d, vf, v);
  std::vector<uint8_t> valid(lk);
  for (int t = 0; t < lk; t++) valid[t] = (t % 7) != 3 && t != 0;
  std::vector<Out> o(lq * d);
  std::vector<float> m(lq), l(lq);
  const float scale = 0.125f;
  Item<In, Out> it{q.data(), k.data(), v.data(), valid.data(), o.data(), m.data(), l.data(),
                   d, d, 1, 1, lq, lk};
  Scratch w(lk, d);
  const Config cf{d, scale, 1.0f, causal, false};
  run_rows(cf, it, w, 0, lq);
  double err = 0, errl = 0, big = 1;
  for (int i = 0; i < lq; i++) {
    std::vector<double> s(lk, -INFINITY);
    double mx = -INFINITY;
    for (int t = 0; t < lk; t++) {
      if (!valid[t] || (causal && t > i)) continue;
      double x = 0;
      for (int c = 0; c < d; c++) x += (double)qf[i * d + c] * kf[t * d + c];
      s[t] = x * scale; mx = std::max(mx, s[t]);
    }
    double sum = 0;
    std::vector<double> ov(d, 0.0);
    for (int t = 0; t < lk; t++) {
      if (s[t] == -INFINITY) continue;
      const double p = std::exp(s[t] - mx); sum += p;
      for (int c = 0; c < d; c++) ov[c] += p * vf[t * d + c];
    }
    for (int c = 0; c < d; c++) {
      const double want = sum > 0 ? ov[c] / sum : 0.0;
      big = std::max(big, std::fabs(want));
      err = std::max(err, std::fabs(to_double(o[i * d + c]) - want));
    }
    if (sum > 0) errl = std::max(errl, std::fabs(m[i] + std::log((double)l[i]) - (mx + std::log(sum))));
    else errl = std::max(errl, (double)(l[i] != 0.0f));
  }
  check(err / big <= tol, name, err / big);
  check(errl <= 1e-5, "  its log-sum-exp", errl);
}

template <class In>
void backward_case(const char* name, bool causal) {
  const int n = 150, d = 32;
  std::mt19937 g(11);
  std::vector<float> qf, kf, vf, dof;
  std::vector<In> q, k, v, dout;
  make(g, n * d, qf, q); make(g, n * d, kf, k); make(g, n * d, vf, v); make(g, n * d, dof, dout);
  std::vector<uint8_t> valid(n);
  for (int t = 0; t < n; t++) valid[t] = (t % 5) != 2;
  const double scale = 0.2;
  std::vector<double> P(n * n, 0.0), O(n * d, 0.0), delta(n, 0.0), lse(n, 0.0);
  for (int i = 0; i < n; i++) {
    double mx = -INFINITY;
    std::vector<double> s(n, -INFINITY);
    for (int t = 0; t < n; t++) {
      if (!valid[t] || (causal && t > i)) continue;
      double x = 0;
      for (int c = 0; c < d; c++) x += (double)qf[i * d + c] * kf[t * d + c];
      s[t] = x * scale; mx = std::max(mx, s[t]);
    }
    double sum = 0;
    for (int t = 0; t < n; t++) if (s[t] > -INFINITY) sum += std::exp(s[t] - mx);
    lse[i] = sum > 0 ? mx + std::log(sum) : 0.0;
    for (int t = 0; t < n; t++) if (s[t] > -INFINITY) P[i * n + t] = std::exp(s[t] - lse[i]);
    for (int t = 0; t < n; t++) for (int c = 0; c < d; c++) O[i * d + c] += P[i * n + t] * vf[t * d + c];
    for (int c = 0; c < d; c++) delta[i] += dof[i * d + c] * O[i * d + c];
  }
  std::vector<double> dq(n * d, 0.0), dk(n * d, 0.0), dv(n * d, 0.0);
  for (int i = 0; i < n; i++)
    for (int t = 0; t < n; t++) {
      if (P[i * n + t] == 0) continue;
      double dp = 0;
      for (int c = 0; c < d; c++) dp += dof[i * d + c] * vf[t * d + c];
      const double ds = P[i * n + t] * (dp - delta[i]);
      for (int c = 0; c < d; c++) {
        dq[i * d + c] += scale * ds * kf[t * d + c];
        dk[t * d + c] += scale * ds * qf[i * d + c];
        dv[t * d + c] += P[i * n + t] * dof[i * d + c];
      }
    }
  std::vector<float> lsef(n), deltaf(n), cf1(n, 1.0f), dqk(n * d, 0.f), dkk(n * d, 0.f), dvk(n * d, 0.f);
  for (int i = 0; i < n; i++) { lsef[i] = (float)lse[i]; deltaf[i] = (float)delta[i]; }
  BwdItem<In> it{{}, k.data(), v.data(), valid.data(), dkk.data(), dvk.data(), d, 1, d, 1, n, n, 0, 1};
  it.heads.push_back({q.data(), dout.data(), lsef.data(), deltaf.data(), cf1.data(), dqk.data(), nullptr});
  BwdScratch w(n, n, d);
  const Config cf{d, (float)scale, 1.0f, causal, false};
  backward_item(cf, it, w);
  auto rel = [&](const std::vector<float>& got, const std::vector<double>& want) {
    double err = 0, big = 1;
    for (size_t i = 0; i < got.size(); i++) {
      big = std::max(big, std::fabs(want[i]));
      err = std::max(err, std::fabs(got[i] - want[i]));
    }
    return err / big;
  };
  const double e = std::max({rel(dqk, dq), rel(dkk, dk), rel(dvk, dv)});
  check(e <= 1e-5, name, e);
}
}  // namespace

int main() {
  std::printf("build: %s (%d floats per vector)\n", V::isa, N);
  // exp serves softmax weights, s - max (or s - lse) <= 0 up to rounding, whose row sums
  // are at least 1: an error is measured relative to the larger of the weight and 1/8,
  // so weights near 1 are checked to their precision and small ones to 3e-8 of the sum
  double err = 0, err_rel = 0;
  for (int i = 0; i < 4000; i++) {
    float x[N], y[N];
    for (int j = 0; j < N; j++) x[j] = -90.0f + (i * N + j) * (90.5f / (4000 * N));
    V::store(y, vexp(V::load(x)));
    for (int j = 0; j < N; j++) {
      const double want = std::exp((double)x[j]), e = std::fabs(y[j] - want);
      err = std::max(err, e / std::max(want, 0.125));
      if (x[j] >= -1.0f) err_rel = std::max(err_rel, e / want);
    }
  }
  check(err < 3e-7, "exp on [-90, 0.5], error / max(e^x, 1/8)", err);
  check(err_rel < 2e-7, "exp on [-1, 0.5], relative error", err_rel);
  float minus_inf[N];
  for (int j = 0; j < N; j++) minus_inf[j] = -INFINITY;
  float z[N];
  V::store(z, vexp(V::load(minus_inf)));
  check(z[0] == 0.0f && z[N - 1] == 0.0f, "exp(-inf) = 0", z[0]);
  {  // conversions: bfloat16 rounds to nearest even, NaN stays NaN
    float x[N]; bf16_t b[N]; f16_t h[N]; float back[N];
    for (int j = 0; j < N; j++) x[j] = bits_to_float(0x3f808000u + (j % 2) * 0x10000u);  // ties
    x[N - 1] = NAN;
    V::store(b, V::load(x));
    bool ok = true;
    for (int j = 0; j + 1 < N; j++) ok &= b[j].bits == ((j % 2) ? 0x3f82 : 0x3f80);
    ok &= (b[N - 1].bits & 0x7f80) == 0x7f80 && (b[N - 1].bits & 0x7f) != 0;
    V::store(back, V::load(b));
    ok &= back[0] == bits_to_float(0x3f800000u);
    check(ok, "bfloat16 round to nearest even, NaN", 0);
    for (int j = 0; j < N; j++) x[j] = (j - 3) / 256.0f + 1.5f;
    V::store(h, V::load(x));
    V::store(back, V::load(h));
    ok = true;
    for (int j = 0; j < N; j++) ok &= back[j] == x[j] && h[j].bits == f16_bits(x[j]);
    check(ok, "float16 exact round trip", 0);
  }
  for (bool causal : {false, true}) {
    std::printf("causal=%d\n", causal);
    forward_case<float, float>("forward float32", causal, 1e-5);
    forward_case<bf16_t, float>("forward bfloat16 in, float32 out", causal, 1e-5);
    forward_case<bf16_t, bf16_t>("forward bfloat16 in and out", causal, 8e-3);
    forward_case<f16_t, float>("forward float16 in, float32 out", causal, 1e-5);
    forward_case<f16_t, f16_t>("forward float16 in and out", causal, 1e-3);
    backward_case<float>("backward float32", causal);
    backward_case<bf16_t>("backward bfloat16", causal);
    backward_case<f16_t>("backward float16", causal);
  }
  std::printf("%s\n", failures ? "FAILED" : "all passed");
  return failures != 0;
}
