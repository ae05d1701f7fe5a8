// bf16 x bf16 -> bf16 linear for a few rows (decode steps) on x86-64 CPUs with AVX512-BF16: each row of the weight is
// read once per call whatever the number of input rows, and the products are summed in fp32. One row (and, where the
// CPU has no AMX, up to four) by vdpbf16ps; 2 to 96 rows, where the CPU has AMX, by its tiles (linear_bf16_amx),
// which read the weight in place as the tiles' left operand, so no copy of it is made. Built at first use by
// citer/kernels/cpu_linear.py (torch.utils.cpp_extension), which falls back to torch's linear where the build or the
// instruction set is missing.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "cpu_amx.h"
#include "cpu_bf16.h"
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

using namespace citer_bf16;

// MB input rows against 4 weight rows (nrows of them real); out[i][r] their dot products. Meanwhile the 4 rows from
// `next` (the thread's next block, or nullptr) are prefetched into L1 and the 4 from `far` (its block PREFETCH_FAR
// ahead, or nullptr) into L2, a cache line a row per step each, so their reads from memory overlap these products
// (docs/results.md).
template <int MB>
inline void block(const uint16_t* x, int64_t K, const uint16_t* w, int64_t nrows, int64_t ldw, float out[4][4],
                  const uint16_t* next, const uint16_t* far) {
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_setzero_ps();
  const uint16_t* rows[4];
  for (int r = 0; r < 4; ++r) rows[r] = w + (r < nrows ? r : 0) * ldw;
  const int64_t K32 = K & ~int64_t(31);
  for (int64_t k = 0; k < K32; k += 32) {
    if (next)
      for (int r = 0; r < 4; ++r) _mm_prefetch((const char*)(next + r * ldw + k), _MM_HINT_T0);
    if (far)
      for (int r = 0; r < 4; ++r) _mm_prefetch((const char*)(far + r * ldw + k), _MM_HINT_T1);
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


constexpr int64_t PREFETCH_FAR = 3;  // blocks ahead the L2 prefetch reads (docs/results.md)

// Blocks b0..b1-1 of 4 weight rows against all M input rows: y's columns 4 b0 .. 4 b1 (clipped to N).
void blocks(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t ldw, const uint16_t* bp,
            uint16_t* yp, int64_t N, int64_t b0, int64_t b1) {
  float out[4][4];
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t n = blk * 4, nrows = std::min<int64_t>(4, N - n);
    // the next block's rows and those PREFETCH_FAR blocks ahead, where this thread computes them and they are whole
    // (no pointer past the weight's end)
    const uint16_t* next = blk + 1 < b1 && n + 8 <= N ? wp + (n + 4) * ldw : nullptr;
    const int64_t nf = n + 4 * PREFETCH_FAR;
    const uint16_t* far = blk + PREFETCH_FAR < b1 && nf + 4 <= N ? wp + nf * ldw : nullptr;
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t mb = std::min<int64_t>(4, M - m);
      const uint16_t* xm = xp + m * K;
      const uint16_t* wn = wp + n * ldw;
      const uint16_t* ahead = m == 0 ? next : nullptr;  // later passes read this block from cache
      const uint16_t* ahead_far = m == 0 ? far : nullptr;
      switch (mb) {
        case 4: block<4>(xm, K, wn, nrows, ldw, out, ahead, ahead_far); break;
        case 3: block<3>(xm, K, wn, nrows, ldw, out, ahead, ahead_far); break;
        case 2: block<2>(xm, K, wn, nrows, ldw, out, ahead, ahead_far); break;
        default: block<1>(xm, K, wn, nrows, ldw, out, ahead, ahead_far);
      }
      for (int64_t i = 0; i < mb; ++i)
        for (int64_t r = 0; r < nrows; ++r) {
          float v = out[i][r];
          if (bp) v += from_bf16(bp[n + r]);
          yp[(m + i) * N + n + r] = to_bf16(v);
        }
    }
  }
}

// -- AMX ------------------------------------------------------------------------------------------------------------
using citer_amx::TileConfig;

// Input rows: a pass takes up to 64 (four C tiles of 16 input rows beside one weight tile); a group's later passes
// find its 16 weight rows in L2, so more rows cost their products, not another read of the weight from memory.
constexpr int64_t AMX_PASS_ROWS = 64, AMX_MAX_ROWS = 96;

// Steps ahead (a step: 32 columns of a group's 16 weight rows, 1 KiB) whose weight lines the tiles prefetch: into L1
// near, so a tile load finds its lines there (a tile register is not renamed, so the next step's loads wait for this
// step's products and cannot run ahead to memory as vector loads do), and into L2 far, so more of the stream is in
// flight than L1's fill buffers hold; a group's last steps reach into the next group's first (docs/results.md).
constexpr int64_t TILE_PREFETCH_NEAR = 2, TILE_PREFETCH_FAR = 8;

// Prefetches the lines of step `t` (counted from group 0, K / 32 steps a group) where its group is below g1.
template <_mm_hint HINT>
inline void prefetch_step(const uint16_t* wp, int64_t ldw, int64_t steps, int64_t t, int64_t g1) {
  const int64_t g = t / steps;
  if (g >= g1) return;
  const uint16_t* w = wp + g * 16 * ldw + (t % steps) * 32;
  for (int r = 0; r < 16; ++r) _mm_prefetch((const char*)(w + r * ldw), HINT);
}

// 16 weight rows x M sums (c[r][m], a row 16 floats) -> y[m][n0 + r] (bf16, bias added): a column of c a vector.
inline void store_sums(const float (*c)[16], int64_t M, const uint16_t* bp, uint16_t* yp, int64_t N, int64_t n0) {
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const __m512 b = bp ? load16(bp + n0, 0xFFFF) : _mm512_setzero_ps();
  for (int64_t m = 0; m < M; ++m) {
    const __m512 v = _mm512_i32gather_ps(column, &c[0][m], 4);
    store16(yp + m * N + n0, bp ? _mm512_add_ps(v, b) : v, 0xFFFF);  // no bias: a -0.0 sum stays -0.0, as in blocks
  }
}

// Group g of 16 weight rows against CHUNKS chunks of 16 input rows: c[j][r][m] the sum of weight row 16 g + r and
// input row 16 j + m. The weight is the left operand (tile 5: 16 rows by 32 columns, read in place, ldw apart), loaded
// once a step for every chunk; xv is x in the right operand's layout, chunk by chunk (xv[chunk][k/2][16 rows][2], a
// chunk K * 16 apart), whose tiles alternate between 6 and 7 so a chunk's load overlaps the product before it; C tiles
// 0..3 hold the chunks' sums. Every sum runs over K in one order whatever the rows beside it, so a row's outputs do not
// depend on the other rows, nor on how many there are.
template <int CHUNKS>
void amx_group(const uint16_t* xv, int64_t K, const uint16_t* wp, int64_t ldw, int64_t g, int64_t g1, float (*c)[16][16]) {
  static_assert(CHUNKS >= 1 && CHUNKS <= 4);
  const int64_t steps = K / 32, chunk = K * 16;
  const uint16_t* w = wp + g * 16 * ldw;
  _tile_zero(0);
  if constexpr (CHUNKS > 1) _tile_zero(1);
  if constexpr (CHUNKS > 2) _tile_zero(2);
  if constexpr (CHUNKS > 3) _tile_zero(3);
  for (int64_t s = 0, t = g * steps; s < steps; ++s, ++t) {
    prefetch_step<_MM_HINT_T0>(wp, ldw, steps, t + TILE_PREFETCH_NEAR, g1);
    prefetch_step<_MM_HINT_T1>(wp, ldw, steps, t + TILE_PREFETCH_FAR, g1);
    const uint16_t* xs = xv + s * 512;  // chunk 0's 16 column pairs of this step
    _tile_loadd(5, w + s * 32, ldw * 2);
    _tile_loadd(6, xs, 64);
    _tile_dpbf16ps(0, 5, 6);
    if constexpr (CHUNKS > 1) {
      _tile_loadd(7, xs + chunk, 64);
      _tile_dpbf16ps(1, 5, 7);
    }
    if constexpr (CHUNKS > 2) {
      _tile_loadd(6, xs + 2 * chunk, 64);
      _tile_dpbf16ps(2, 5, 6);
    }
    if constexpr (CHUNKS > 3) {
      _tile_loadd(7, xs + 3 * chunk, 64);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  if constexpr (CHUNKS > 1) _tile_stored(1, c[1], 64);
  if constexpr (CHUNKS > 2) _tile_stored(2, c[2], 64);
  if constexpr (CHUNKS > 3) _tile_stored(3, c[3], 64);
}

// Groups g0..g1-1 of 16 weight rows against M <= AMX_MAX_ROWS input rows (xv as amx_group reads it), a group's rows in
// passes of up to AMX_PASS_ROWS.
void amx_groups(const uint16_t* xv, int64_t M, int64_t K, const uint16_t* wp, int64_t ldw, const uint16_t* bp,
                uint16_t* yp, int64_t N, int64_t g0, int64_t g1) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;  // C: 16 weight rows x 16 input rows (fp32); A: 16 x 32 columns; B: 16 column pairs x 16 rows
  }
  _tile_loadconfig(&cfg);
  alignas(64) float c[4][16][16];
  const int64_t chunks = (M + 15) / 16, per_pass = AMX_PASS_ROWS / 16;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t j0 = 0; j0 < chunks; j0 += per_pass) {
      const uint16_t* xp = xv + j0 * 16 * K;  // the pass's first chunk
      switch (std::min(chunks - j0, per_pass)) {
        case 1: amx_group<1>(xp, K, wp, ldw, g, g1, c); break;
        case 2: amx_group<2>(xp, K, wp, ldw, g, g1, c); break;
        case 3: amx_group<3>(xp, K, wp, ldw, g, g1, c); break;
        default: amx_group<4>(xp, K, wp, ldw, g, g1, c);
      }
      for (int64_t j = j0; j < std::min(chunks, j0 + per_pass); ++j)
        store_sums(c[j - j0], std::min<int64_t>(16, M - j * 16), bp, yp + j * 16 * N, N, g * 16);
    }
  }
  _tile_release();
}

}  // namespace

namespace {

// One call's operands as the kernels read them, checked, and its output y (..., N).
struct Operands {
  torch::Tensor x, b, y;
  int64_t K, N, M, ldw;
  const uint16_t* xp;
  const uint16_t* wp;
  const uint16_t* bp;
  uint16_t* yp;
};

Operands operands(const torch::Tensor& x_in, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                  const char* op) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, op, ": bfloat16 only");
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1 && x_in.size(-1) == w.size(1) && x_in.size(-1) > 0, op, ": shapes");
  Operands o;
  o.x = x_in.contiguous();
  o.K = o.x.size(-1);
  o.N = w.size(0);
  o.M = o.x.numel() / o.K;
  o.ldw = w.stride(0);
  auto sizes = o.x.sizes().vec();
  sizes.back() = o.N;
  o.y = torch::empty(sizes, o.x.options());
  o.xp = (const uint16_t*)o.x.data_ptr();
  o.wp = (const uint16_t*)w.data_ptr();
  o.bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->numel() == o.N, op, ": bias");
    o.b = bias->contiguous();
    o.bp = (const uint16_t*)o.b.data_ptr();
  }
  o.yp = (uint16_t*)o.y.data_ptr();
  return o;
}

}  // namespace

// y (..., N) = x (..., K) @ w (N, K)^T (+ bias (N,)); w rows contiguous, all bfloat16.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  const Operands o = operands(x, w, bias, "linear_bf16");
  at::parallel_for(0, (o.N + 3) / 4, 16, [&](int64_t b0, int64_t b1) {
    blocks(o.xp, o.M, o.K, o.wp, o.ldw, o.bp, o.yp, o.N, b0, b1);
  });
  return o.y;
}

bool bf16_amx() { return citer_amx::usable(); }

// linear_bf16 for 2..AMX_MAX_ROWS rows on AMX where the CPU has it (bf16_amx()) and K is a multiple of 32: the
// weight's rows in groups of 16 on the tiles, the last N % 16 rows (and every row where AMX cannot serve) as
// linear_bf16's blocks.
torch::Tensor linear_bf16_amx(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  const int64_t K = x.size(-1), M = x.numel() / std::max<int64_t>(K, 1);
  if (!citer_amx::usable() || M > AMX_MAX_ROWS || M == 0 || K % 32) return linear_bf16(x, w, bias);
  const Operands o = operands(x, w, bias, "linear_bf16_amx");
  std::vector<uint16_t> xv((M + 15) / 16 * 16 * K, 0);  // x's columns in pairs, 16 rows a chunk: xv[m/16][k/2][m%16][2]
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* xc = xv.data() + (m / 16) * 16 * K + (m % 16) * 2;
    for (int64_t k = 0; k < K; ++k) xc[(k / 2) * 32 + (k & 1)] = o.xp[m * K + k];
  }
  const int64_t groups = o.N / 16;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    amx_groups(xv.data(), M, K, o.wp, o.ldw, o.bp, o.yp, o.N, g0, g1);
  });
  blocks(o.xp, M, K, o.wp, o.ldw, o.bp, o.yp, o.N, groups * 4, (o.N + 3) / 4);  // the last N % 16 rows
  return o.y;
}

TORCH_LIBRARY(citer, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_bf16_amx(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("bf16_amx() -> bool", &bf16_amx);
}
TORCH_LIBRARY_IMPL(citer, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_bf16_amx", &linear_bf16_amx);
}
