// A bf16 decode step's small ops on x86-64 CPUs with AVX-512 (the Xeons the bf16 kernel serves), one call each where
// torch takes several: the RMS norm, the attention of one new token per row (RoPE on its query and key, the key and
// value written to the KV pool, the row's columns attended) and the gated MLP's silu(gate) * up. They round to bf16
// where the lean forward's torch ops do (each elementwise op's result, round to nearest even), so the norm, RoPE, the
// pool's keys and the gate match torch's bit for bit up to the last bit of an exp or a sum; the attention sums in
// float32 and rounds once. Every row is computed alone, in one order whatever the call holds. Built with
// cpu_linear.cpp into one extension by citer/kernels/cpu_linear.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "cpu_bf16.h"
#include "cpu_step_args.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using namespace citer_bf16;

// e^x for x <= 88.38 (Cephes' expf: 2^n times a degree-6 polynomial on [-ln2/2, ln2/2]; ~1 ulp), 0 below -87.3.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.37626f)), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps((__mmask16)~under, y, _mm512_castsi512_ps(e));
}

// One key-value head's `group` query heads q (group, D) over columns 0..kv_len-1 where allowed (nullptr: all):
// softmax(q k^T * scale) v in float32, rounded once to bf16 into out (group, D). A head's sums run in one order
// whatever the group or call. DV16: D / 16 known at compile time (0: D's vectors counted at run time, D <= 512).
template <int DV16>
void attend_group(const uint16_t* q, const uint16_t* keys, const uint16_t* vals, const bool* allowed, int64_t kv_len,
                  int64_t group, int64_t D, float scale, uint16_t* out) {
  const int64_t DV = DV16 ? DV16 : (D + 15) / 16;
  const int64_t K16 = (kv_len + 15) & ~int64_t(15);
  std::vector<float> p(group * K16, -std::numeric_limits<float>::infinity());  // (group, K16) scores, then weights
  std::vector<__m512> qf(group * DV), o(group * DV, _mm512_setzero_ps());
  for (int64_t h = 0; h < group; ++h)
    for (int64_t j = 0; j < DV; ++j) qf[h * DV + j] = load16(q + h * D + 16 * j, lanes(D - 16 * j));
  std::vector<float> top(group, -std::numeric_limits<float>::infinity());
  __m512 kv[DV16 ? DV16 : 32];
  for (int64_t c = 0; c < kv_len; ++c) {
    if (allowed && !allowed[c]) continue;
    for (int64_t j = 0; j < DV; ++j) kv[j] = load16(keys + c * D + 16 * j, lanes(D - 16 * j));
    for (int64_t h = 0; h < group; ++h) {
      __m512 acc = _mm512_mul_ps(qf[h * DV], kv[0]);
      for (int64_t j = 1; j < DV; ++j) acc = _mm512_fmadd_ps(qf[h * DV + j], kv[j], acc);
      const float sc = _mm512_reduce_add_ps(acc) * scale;
      p[h * K16 + c] = sc;
      top[h] = std::max(top[h], sc);
    }
  }
  std::vector<float> inv(group);
  for (int64_t h = 0; h < group; ++h) {  // exp16 of -inf is 0: masked and padding columns weigh nothing
    float* ph = p.data() + h * K16;
    const __m512 topv = _mm512_set1_ps(top[h]);
    __m512 total = _mm512_setzero_ps();
    for (int64_t c = 0; c < K16; c += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(ph + c), topv));
      _mm512_storeu_ps(ph + c, e);
      total = _mm512_add_ps(total, e);
    }
    inv[h] = 1.0f / _mm512_reduce_add_ps(total);
  }
  for (int64_t c = 0; c < kv_len; ++c) {
    if (allowed && !allowed[c]) continue;
    for (int64_t j = 0; j < DV; ++j) kv[j] = load16(vals + c * D + 16 * j, lanes(D - 16 * j));
    for (int64_t h = 0; h < group; ++h) {
      const __m512 pc = _mm512_set1_ps(p[h * K16 + c]);
      for (int64_t j = 0; j < DV; ++j) o[h * DV + j] = _mm512_fmadd_ps(pc, kv[j], o[h * DV + j]);
    }
  }
  for (int64_t h = 0; h < group; ++h)
    for (int64_t j = 0; j < DV; ++j)
      store16(out + h * D + 16 * j, _mm512_mul_ps(o[h * DV + j], _mm512_set1_ps(inv[h])), lanes(D - 16 * j));
}

void check_bf16(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, "citer step ops: ", what,
              " must be bfloat16 on the CPU");
}

// One head x (D) at a row's RoPE row c, s (D, s's first half negated) -> out: x * cos + roll(x, D/2) * sin, each of
// the three ops rounded to bf16 as torch's are (citer.decoding.layers.rotate), so the same bits. D <= 512.
inline void rotate_head(const uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t D, uint16_t* out) {
  const int64_t half = D / 2;
  alignas(64) uint16_t rolled[512];
  std::copy(x + half, x + D, rolled);
  std::copy(x, x + half, rolled + half);
  for (int64_t j = 0; j < D; j += 16) {
    const __mmask16 mj = lanes(D - j);
    const __m512 a = round16(_mm512_mul_ps(load16(x + j, mj), load16(c + j, mj)));
    const __m512 r = round16(_mm512_mul_ps(load16(rolled + j, mj), load16(s + j, mj)));
    store16(out + j, _mm512_add_ps(a, r), mj);
  }
}

// Rows [0, M) of width `width` through f(m0, m1), split among the threads only for a prompt-sized call: a decode
// step's rows (at most 32 x 8,192 elements) stay on one thread, where a fork costs more than it saves. Each row is
// computed alone either way, so the split changes no bit.
template <typename F>
void rows_parallel(int64_t M, int64_t width, const F& f) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 19) / std::max<int64_t>(width, 1));
  at::parallel_for(0, M, grain, f);
}

}  // namespace

// x (..., H) -> w * bf16(x * rsqrt(mean(x^2) + eps)): HF's RMSNorm on bf16 (statistics in float32), a row at a time.
torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor w, double eps) {
  check_bf16(x, "x");
  check_bf16(w, "w");
  const int64_t H = x.size(-1);
  TORCH_CHECK(H > 0 && w.dim() == 1 && w.numel() == H, "rms_norm_bf16: the weight must be (H,)");
  x = x.contiguous();
  w = w.contiguous();
  auto y = torch::empty_like(x);
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* wp = (const uint16_t*)w.data_ptr();
  uint16_t* yp = (uint16_t*)y.data_ptr();
  const int64_t M = x.numel() / H;
  rows_parallel(M, H, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const uint16_t* xr = xp + m * H;
      uint16_t* yr = yp + m * H;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < H; k += 16) {
        const __m512 v = load16(xr + k, lanes(H - k));
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / (float)H + (float)eps));
      for (int64_t k = 0; k < H; k += 16) {
        const __mmask16 mk = lanes(H - k);
        const __m512 n = round16(_mm512_mul_ps(load16(xr + k, mk), r));
        store16(yr + k, _mm512_mul_ps(n, load16(wp + k, mk)), mk);
      }
    }
  });
  return y;
}

// gu (..., 2I) -> bf16(bf16(silu(gu[..., :I])) * gu[..., I:]) (..., I): F.silu(g) * u on bf16.
torch::Tensor silu_mul_bf16(torch::Tensor gu) {
  check_bf16(gu, "gu");
  TORCH_CHECK(gu.size(-1) % 2 == 0, "silu_mul_bf16: an odd width");
  gu = gu.contiguous();
  const int64_t I = gu.size(-1) / 2, M = gu.numel() / std::max<int64_t>(2 * I, 1);
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, gu.options());
  const uint16_t* gp = (const uint16_t*)gu.data_ptr();
  uint16_t* yp = (uint16_t*)y.data_ptr();
  const __m512 one = _mm512_set1_ps(1.0f);
  rows_parallel(M, 2 * I, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const uint16_t* g = gp + m * 2 * I;
      const uint16_t* u = g + I;
      uint16_t* yr = yp + m * I;
      for (int64_t k = 0; k < I; k += 16) {
        const __mmask16 mk = lanes(I - k);
        const __m512 gv = load16(g + k, mk);
        const __m512 s = round16(_mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
        store16(yr + k, _mm512_mul_ps(s, load16(u + k, mk)), mk);
      }
    }
  });
  return y;
}

// x (M, n, D), heads contiguous, rows at any stride (the queries' and keys' heads of a fused projection's output);
// cos, sin (M, D) each row's RoPE row (sin's first half negated) -> (M, n, D): every head rotated (rotate_head).
torch::Tensor rope_bf16(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_bf16(x, "x");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope_bf16: x must be (M, n, D), heads contiguous");
  const int64_t M = x.size(0), n = x.size(1), D = x.size(2), row = x.stride(0);
  TORCH_CHECK(D % 2 == 0 && D <= 512, "rope_bf16: head_dim must be even and at most 512");
  cos = cos.contiguous();
  sin = sin.contiguous();
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == M && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "rope_bf16: cos and sin must be (M, D)");
  auto y = torch::empty({M, n, D}, x.options());
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* cp = (const uint16_t*)cos.data_ptr();
  const uint16_t* sp = (const uint16_t*)sin.data_ptr();
  uint16_t* yp = (uint16_t*)y.data_ptr();
  rows_parallel(M, n * D, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t h = 0; h < n; ++h) rotate_head(xp + m * row + h * D, cp + m * D, sp + m * D, D, yp + (m * n + h) * D);
  });
  return y;
}

// One new token a row: qkv (b, (nh + 2 kv) D) the fused projection's output; cos, sin (b, D) the rows' RoPE rows
// (sin's first half negated, as citer.decoding.layers.rotate takes it). Rotates the queries and keys, writes each
// row's key and value to kbuf/vbuf (R, kv, C, D) at (rows[i], :, cols[i]), then attends the row's slot rows[i] over
// columns 0..kv_len-1 where mask[i] (b, kv_len) holds (no mask: all of them). -> (b, nh D), heads side by side.
torch::Tensor decode_attention_bf16(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kbuf,
                                    torch::Tensor vbuf, torch::Tensor rows, torch::Tensor cols,
                                    c10::optional<torch::Tensor> mask, int64_t kv_len, int64_t n_heads, int64_t n_kv,
                                    double scale) {
  const citer_step::AttentionCall a = citer_step::attention_call("decode_attention_bf16", at::kBFloat16, qkv, cos, sin,
                                                                  kbuf, vbuf, rows, cols, mask, kv_len, n_heads, n_kv,
                                                                  2, 512);
  const int64_t b = a.b, D = a.D, C = a.C;
  const int64_t* rp = a.rp;
  const int64_t* colp = a.colp;
  const bool* mp = a.mp;
  const uint16_t* in = (const uint16_t*)a.qkv.data_ptr();
  const uint16_t* cp = (const uint16_t*)a.cos.data_ptr();
  const uint16_t* sp = (const uint16_t*)a.sin.data_ptr();
  uint16_t* kp = (uint16_t*)kbuf.data_ptr();
  uint16_t* vp = (uint16_t*)vbuf.data_ptr();
  const int64_t width = (n_heads + 2 * n_kv) * D, group = n_heads / n_kv;
  auto rotate = [&](const uint16_t* x, int64_t i, uint16_t* out) { rotate_head(x, cp + i * D, sp + i * D, D, out); };
  std::vector<uint16_t> q_rot(b * n_heads * D);
  for (int64_t i = 0; i < b; ++i) {
    const uint16_t* x = in + i * width;
    for (int64_t h = 0; h < n_heads; ++h) rotate(x + h * D, i, q_rot.data() + (i * n_heads + h) * D);
    for (int64_t g = 0; g < n_kv; ++g) {
      const int64_t at = ((rp[i] * n_kv + g) * C + colp[i]) * D;
      rotate(x + (n_heads + g) * D, i, kp + at);
      std::copy(x + (n_heads + n_kv + g) * D, x + (n_heads + n_kv + g + 1) * D, vp + at);
    }
  }
  auto out = torch::empty({b, n_heads * D}, a.qkv.options());
  uint16_t* op = (uint16_t*)out.data_ptr();
  const int64_t DV = (D + 15) / 16;
  // a task: one row's key-value head with its `group` query heads, so each key and value is read and widened once
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (kv_len * D * group));
  at::parallel_for(0, b * n_kv, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / n_kv, g = t % n_kv;
      const uint16_t* q = q_rot.data() + (i * n_heads + g * group) * D;  // the group's queries, (group, D)
      const uint16_t* keys = kp + (rp[i] * n_kv + g) * C * D;
      const uint16_t* vals = vp + (rp[i] * n_kv + g) * C * D;
      const bool* allowed = mp ? mp + i * kv_len : nullptr;
      uint16_t* dst = op + i * n_heads * D + g * group * D;
      switch (DV) {
        case 4: attend_group<4>(q, keys, vals, allowed, kv_len, group, D, (float)scale, dst); break;
        case 8: attend_group<8>(q, keys, vals, allowed, kv_len, group, D, (float)scale, dst); break;
        default: attend_group<0>(q, keys, vals, allowed, kv_len, group, D, (float)scale, dst);
      }
    }
  });
  return out;
}

// cpu_linear.cpp's kernels (one extension)
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor linear_bf16_amx(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

// Every layer of a decode step, one new token a row (citer.decoding.cpu_step.decode_layer's ops in its order, so the
// same bits, without a Python call around each): x (b, 1, H); cos, sin (b, D); weights 10 a layer (ln1, wqkv, bqkv,
// wo, bo, ln2, wgu, bgu, wd, bd; biases may be None); kbufs/vbufs a layer's KV buffers each; the products on the
// AMX tiles' op where `tiles`, else the one-row blocks'. -> x after the last layer (b, 1, H).
torch::Tensor decode_layers_bf16(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                 c10::optional<torch::Tensor> mask,
                                 const c10::List<c10::optional<torch::Tensor>>& weights, at::TensorList kbufs,
                                 at::TensorList vbufs, torch::Tensor rows, torch::Tensor cols, int64_t kv_len,
                                 int64_t n_heads, int64_t n_kv, double scale, double eps, bool tiles) {
  const int64_t n_layers = (int64_t)kbufs.size(), b = x.size(0);
  TORCH_CHECK((int64_t)weights.size() == 10 * n_layers && (int64_t)vbufs.size() == n_layers,
              "decode_layers_bf16: 10 weights and a K and a V buffer a layer");
  auto linear = tiles ? &linear_bf16_amx : &linear_bf16;
  auto w = [&](int64_t i) -> c10::optional<torch::Tensor> { return weights.get(i); };
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t o = 10 * l;
    TORCH_CHECK(w(o) && w(o + 1) && w(o + 3) && w(o + 5) && w(o + 6) && w(o + 8), "decode_layers_bf16: layer ", l,
                " lacks a norm or a matrix");
    auto qkv = linear(rms_norm_bf16(x, *w(o), eps), *w(o + 1), w(o + 2));  // (b, 1, (nh + 2 kv) D)
    auto att = decode_attention_bf16(qkv.view({b, -1}), cos, sin, kbufs[l], vbufs[l], rows, cols, mask, kv_len,
                                     n_heads, n_kv, scale);  // (b, nh D)
    x = x + linear(att.view({b, 1, -1}), *w(o + 3), w(o + 4));
    auto gu = linear(rms_norm_bf16(x, *w(o + 5), eps), *w(o + 6), w(o + 7));  // (b, 1, 2 I)
    x = x + linear(silu_mul_bf16(gu), *w(o + 8), w(o + 9));
  }
  return x;
}

TORCH_LIBRARY_FRAGMENT(citer, m) {
  m.def(
      "decode_layers_bf16(Tensor x, Tensor cos, Tensor sin, Tensor? mask, Tensor?[] weights, Tensor(a!)[] kbufs, "
      "Tensor(b!)[] vbufs, Tensor rows, Tensor cols, int kv_len, int n_heads, int n_kv, float scale, float eps, "
      "bool tiles) -> Tensor");
  m.def("rms_norm_bf16(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul_bf16(Tensor gu) -> Tensor");
  m.def("rope_bf16(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def(
      "decode_attention_bf16(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kbuf, Tensor(b!) vbuf, Tensor rows, "
      "Tensor cols, Tensor? mask, int kv_len, int n_heads, int n_kv, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(citer, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16);
  m.impl("silu_mul_bf16", &silu_mul_bf16);
  m.impl("rope_bf16", &rope_bf16);
  m.impl("decode_attention_bf16", &decode_attention_bf16);
  m.impl("decode_layers_bf16", &decode_layers_bf16);
}
