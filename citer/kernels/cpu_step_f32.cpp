// A float32 decode step's small ops on x86-64 CPUs with AVX2 and FMA, one call each where torch takes several: the
// RMS norm, the attention of one new token per row (RoPE on its query and key, the key and value written to the KV
// pool, the row's columns attended) and the gated MLP's silu(gate) * up. A step of a small model on a CPU is bound by
// its op count once its linears stream their weights (citer::linear_f32). Every row is computed alone, in one order
// whatever the call holds. Built with cpu_linear_f32.cpp into one extension by citer/kernels/cpu_linear.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "cpu_step_args.h"
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i tail_mask(int64_t n) {  // lanes 0..n-1 of 8
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// e^x for x <= 88.38 (Cephes' expf: 2^n times a degree-6 polynomial on [-ln2/2, ln2/2]; ~1 ulp), 0 below -87.3.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.37626f)), lo);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline float dot(const float* a, const float* b, int64_t n) {  // n % 8 == 0
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return hsum8(acc);
}

void check_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "citer step ops: ", what, " must be float32 on the CPU");
}

}  // namespace

// x (..., H) -> x * rsqrt(mean(x^2) + eps) * w: HF's RMSNorm in float32, a row at a time.
torch::Tensor rms_norm_f32(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  const int64_t H = x.size(-1);
  TORCH_CHECK(H > 0 && w.dim() == 1 && w.numel() == H, "rms_norm_f32: the weight must be (H,)");
  x = x.contiguous();
  w = w.contiguous();
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t H8 = H & ~int64_t(7), M = x.numel() / H;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * H;
    float* yr = yp + m * H;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < H8; k += 8) {
      const __m256 v = _mm256_loadu_ps(xr + k);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    if (H8 < H) {
      const __m256 v = _mm256_maskload_ps(xr + H8, tail_mask(H - H8));
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    const float r = 1.0f / std::sqrt(hsum8(acc) / (float)H + (float)eps);
    for (int64_t k = 0; k < H; ++k) yr[k] = (xr[k] * r) * wp[k];
  }
  return y;
}

// gu (..., 2I) -> silu(gu[..., :I]) * gu[..., I:] (..., I).
torch::Tensor silu_mul_f32(torch::Tensor gu) {
  check_f32(gu, "gu");
  TORCH_CHECK(gu.size(-1) % 2 == 0, "silu_mul_f32: an odd width");
  gu = gu.contiguous();
  const int64_t I = gu.size(-1) / 2, M = gu.numel() / std::max<int64_t>(2 * I, 1);
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t I8 = I & ~int64_t(7);
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gp + m * 2 * I;
    const float* u = g + I;
    float* yr = yp + m * I;
    for (int64_t k = 0; k < I8; k += 8) {
      const __m256 gv = _mm256_loadu_ps(g + k);
      const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
      _mm256_storeu_ps(yr + k, _mm256_mul_ps(s, _mm256_loadu_ps(u + k)));
    }
    for (int64_t k = I8; k < I; ++k) yr[k] = g[k] / (1.0f + std::exp(-g[k])) * u[k];
  }
  return y;
}

// One new token a row: qkv (b, (nh + 2 kv) D) the fused projection's output; cos, sin (b, D) the rows' RoPE rows
// (sin's first half negated, as citer.decoding.layers.rotate takes it). Rotates the queries and keys, writes each
// row's key and value to kbuf/vbuf (R, kv, C, D) at (rows[i], :, cols[i]), then attends the row's slot rows[i] over
// columns 0..kv_len-1 where mask[i] (b, kv_len) holds (no mask: all of them). -> (b, nh D), heads side by side.
torch::Tensor decode_attention_f32(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kbuf,
                                   torch::Tensor vbuf, torch::Tensor rows, torch::Tensor cols,
                                   c10::optional<torch::Tensor> mask, int64_t kv_len, int64_t n_heads, int64_t n_kv,
                                   double scale) {
  const citer_step::AttentionCall a = citer_step::attention_call("decode_attention_f32", at::kFloat, qkv, cos, sin,
                                                                  kbuf, vbuf, rows, cols, mask, kv_len, n_heads, n_kv,
                                                                  8, std::numeric_limits<int64_t>::max());
  const int64_t b = a.b, D = a.D, C = a.C;
  const int64_t* rp = a.rp;
  const int64_t* colp = a.colp;
  const bool* mp = a.mp;
  const float* in = a.qkv.data_ptr<float>();
  const float* cp = a.cos.data_ptr<float>();
  const float* sp = a.sin.data_ptr<float>();
  float* kp = kbuf.data_ptr<float>();
  float* vp = vbuf.data_ptr<float>();
  const int64_t width = (n_heads + 2 * n_kv) * D, half = D / 2, group = n_heads / n_kv;
  auto rotate = [&](const float* x, int64_t i, float* out) {  // x * cos + roll(x, D/2) * signed sin
    const float* c = cp + i * D;
    const float* s = sp + i * D;
    for (int64_t j = 0; j < D; ++j) out[j] = x[j] * c[j] + x[j < half ? j + half : j - half] * s[j];
  };
  std::vector<float> q_rot(b * n_heads * D);
  for (int64_t i = 0; i < b; ++i) {
    const float* x = in + i * width;
    for (int64_t h = 0; h < n_heads; ++h) rotate(x + h * D, i, q_rot.data() + (i * n_heads + h) * D);
    for (int64_t g = 0; g < n_kv; ++g) {
      const int64_t at = ((rp[i] * n_kv + g) * C + colp[i]) * D;
      rotate(x + (n_heads + g) * D, i, kp + at);
      std::copy(x + (n_heads + n_kv + g) * D, x + (n_heads + n_kv + g + 1) * D, vp + at);
    }
  }
  auto out = torch::empty({b, n_heads * D}, a.qkv.options());
  float* op = out.data_ptr<float>();
  const int64_t K8 = (kv_len + 7) & ~int64_t(7);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (kv_len * D));
  at::parallel_for(0, b * n_heads, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(K8);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / n_heads, h = t % n_heads, g = h / group;
      const float* q = q_rot.data() + t * D;
      const float* keys = kp + (rp[i] * n_kv + g) * C * D;
      const float* vals = vp + (rp[i] * n_kv + g) * C * D;
      const bool* allowed = mp ? mp + i * kv_len : nullptr;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < kv_len; ++c) {
        if (allowed && !allowed[c]) {
          p[c] = -std::numeric_limits<float>::infinity();
          continue;
        }
        p[c] = dot(q, keys + c * D, D) * (float)scale;
        top = std::max(top, p[c]);
      }
      for (int64_t c = kv_len; c < K8; ++c) p[c] = -std::numeric_limits<float>::infinity();
      const __m256 topv = _mm256_set1_ps(top);
      __m256 total = _mm256_setzero_ps();
      for (int64_t c = 0; c < K8; c += 8) {  // exp8 of -inf is 0: masked and padding columns weigh nothing
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.data() + c), topv));
        _mm256_storeu_ps(p.data() + c, e);
        total = _mm256_add_ps(total, e);
      }
      const float inv = 1.0f / hsum8(total);
      float* o = op + i * n_heads * D + h * D;
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
      for (int64_t c = 0; c < kv_len; ++c) {
        if (p[c] == 0.0f) continue;  // masked
        const __m256 pc = _mm256_set1_ps(p[c]);
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pc, _mm256_loadu_ps(vals + c * D + d), _mm256_loadu_ps(o + d)));
      }
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(inv)));
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(citer, m) {
  m.def("rms_norm_f32(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul_f32(Tensor gu) -> Tensor");
  m.def(
      "decode_attention_f32(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kbuf, Tensor(b!) vbuf, Tensor rows, "
      "Tensor cols, Tensor? mask, int kv_len, int n_heads, int n_kv, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(citer, CPU, m) {
  m.impl("rms_norm_f32", &rms_norm_f32);
  m.impl("silu_mul_f32", &silu_mul_f32);
  m.impl("decode_attention_f32", &decode_attention_f32);
}
