// bf16 x bf16 -> bf16 linear for a few rows (decode steps) on x86-64 CPUs with AVX512-BF16: each row of the weight is
// read once per call whatever the number of input rows, and the products are summed in fp32 by vdpbf16ps. Built at
// first use by citer/decoding/cpu_linear.py (torch.utils.cpp_extension), which falls back to torch's linear where the
// build or the instruction set is missing.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

namespace {

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's float -> bfloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

inline float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// MB input rows against 4 weight rows (nrows of them real); out[i][r] their dot products.
template <int MB>
inline void block(const uint16_t* x, int64_t K, const uint16_t* w, int64_t nrows, int64_t ldw, float out[4][4]) {
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_setzero_ps();
  const uint16_t* rows[4];
  for (int r = 0; r < 4; ++r) rows[r] = w + (r < nrows ? r : 0) * ldw;
  const int64_t K32 = K & ~int64_t(31);
  for (int64_t k = 0; k < K32; k += 32) {
    __m512bh wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = (__m512bh)_mm512_loadu_si512((const void*)(rows[r] + k));
    for (int i = 0; i < MB; ++i) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(x + i * K + k));
      for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
    }
  }
  if (K32 < K) {  // the last K % 32 columns, masked
    const __mmask32 m = (__mmask32)((1ull << (K - K32)) - 1);
    __m512bh wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(m, (const void*)(rows[r] + K32));
    for (int i = 0; i < MB; ++i) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, (const void*)(x + i * K + K32));
      for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < 4; ++r) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

}  // namespace

// y (..., N) = x (..., K) @ w (N, K)^T (+ bias (N,)); x contiguous, w rows contiguous, all bfloat16.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bfloat16 only");
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1 && x.size(-1) == w.size(1), "linear_bf16: shapes");
  x = x.contiguous();
  const int64_t K = x.size(-1), N = w.size(0), M = x.numel() / K, ldw = w.stride(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* wp = (const uint16_t*)w.data_ptr();
  const uint16_t* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    bp = (const uint16_t*)b.data_ptr();
  }
  uint16_t* yp = (uint16_t*)y.data_ptr();
  const int64_t nblocks = (N + 3) / 4;
  at::parallel_for(0, nblocks, 16, [&](int64_t b0, int64_t b1) {
    float out[4][4];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * 4, nrows = std::min<int64_t>(4, N - n);
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t mb = std::min<int64_t>(4, M - m);
        const uint16_t* xm = xp + m * K;
        const uint16_t* wn = wp + n * ldw;
        switch (mb) {
          case 4: block<4>(xm, K, wn, nrows, ldw, out); break;
          case 3: block<3>(xm, K, wn, nrows, ldw, out); break;
          case 2: block<2>(xm, K, wn, nrows, ldw, out); break;
          default: block<1>(xm, K, wn, nrows, ldw, out);
        }
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t r = 0; r < nrows; ++r) {
            float v = out[i][r];
            if (bp) v += from_bf16(bp[n + r]);
            yp[(m + i) * N + n + r] = to_bf16(v);
          }
      }
    }
  });
  return y;
}

TORCH_LIBRARY(citer, m) { m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(citer, CPU, m) { m.impl("linear_bf16", &linear_bf16); }
