// float32 linear for a few rows (decode steps) on x86-64 CPUs with AVX2 and FMA: each row of the weight is read from
// memory once per call whatever the number of input rows, and every output is one input row's dot product with one
// weight row, summed in one order whatever else the call holds (a row's outputs do not depend on the rows beside it).
// Built at first use by citer/kernels/cpu_linear.py (torch.utils.cpp_extension), which falls back to oneDNN's linear
// where the build or the instruction set is missing.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

// Weight rows a block reads together: eight streams from memory at once, one accumulator each (8 + the input and a
// load fit AVX2's 16 registers). Measured on a Zen 3 EPYC against 4 rows with two accumulators each: docs/results.md.
constexpr int NR = 8;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One input row x (K,) against NR weight rows from w (nrows of them real): out[r] their dot products, summed over
// 8-column chunks in order, the last K % 8 columns masked.
inline void block(const float* x, int64_t K, const float* w, int64_t nrows, int64_t ldw, float out[NR]) {
  __m256 acc[NR];
  const float* rows[NR];
  for (int r = 0; r < NR; ++r) {
    acc[r] = _mm256_setzero_ps();
    rows[r] = w + (r < nrows ? r : 0) * ldw;
  }
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(rows[r] + k), acc[r]);
  }
  if (K8 < K) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(K - K8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 xv = _mm256_maskload_ps(x + K8, mask);
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(xv, _mm256_maskload_ps(rows[r] + K8, mask), acc[r]);
  }
  for (int r = 0; r < NR; ++r) out[r] = hsum(acc[r]);
}

// MR input rows (x, ldx apart) against NW weight rows, all MR * NW accumulators in registers (12 of AVX2's 16 at
// 3 x 4): each weight vector loaded serves MR rows, so passes over a cached block load a quarter of the weight vectors
// the one-row block does. Every output's sum runs in block()'s order (8-column chunks in turn, the tail masked, then
// hsum), so a row's outputs are the same bits whichever path or rows beside it computed them. Meanwhile the n_next
// rows from `next` (a later block's) are prefetched into L2, a cache line at a time.
template <int MR, int NW>
inline void tile(const float* x, int64_t ldx, int64_t K, const float* w, int64_t nrows, int64_t ldw, float* y,
                 int64_t ldy, const float* bias, const float* next, int64_t n_next) {
  __m256 acc[MR][NW];
  const float* rows[NW];
  for (int j = 0; j < NW; ++j) rows[j] = w + (j < nrows ? j : 0) * ldw;
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NW; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    if (n_next && (k & 15) == 0)
      for (int64_t r = 0; r < n_next; ++r) _mm_prefetch((const char*)(next + r * ldw + k), _MM_HINT_T1);
    __m256 wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = _mm256_loadu_ps(rows[j] + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NW; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (K8 < K) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(K - K8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = _mm256_maskload_ps(rows[j] + K8, mask);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_maskload_ps(x + i * ldx + K8, mask);
      for (int j = 0; j < NW; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NW && j < nrows; ++j) {
      const float s = hsum(acc[i][j]);
      y[i * ldy + j] = bias ? s + bias[j] : s;
    }
}

constexpr int TILE_ROWS = 3, TILE_W = 4;

inline void tile_rows(int64_t mr, const float* x, int64_t ldx, int64_t K, const float* w, int64_t nrows, int64_t ldw,
                      float* y, int64_t ldy, const float* bias, const float* next, int64_t n_next) {
  if (mr == 1) tile<1, TILE_W>(x, ldx, K, w, nrows, ldw, y, ldy, bias, next, n_next);
  else if (mr == 2) tile<2, TILE_W>(x, ldx, K, w, nrows, ldw, y, ldy, bias, next, n_next);
  else tile<TILE_ROWS, TILE_W>(x, ldx, K, w, nrows, ldw, y, ldy, bias, next, n_next);
}

}  // namespace

// y (..., N) = x (..., K) @ w (N, K)^T (+ bias (N,)); w rows contiguous, all float32.
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_f32: float32 only");
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1 && x.size(-1) == w.size(1) && x.size(-1) > 0, "linear_f32: shapes");
  x = x.contiguous();
  const int64_t K = x.size(-1), N = w.size(0), M = x.numel() / K, ldw = w.stride(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->numel() == N, "linear_f32: bias");
    b = bias->contiguous();
    bp = b.data_ptr<float>();
  }
  float* yp = y.data_ptr<float>();
  const int64_t nblocks = (N + NR - 1) / NR;
  at::parallel_for(0, nblocks, 16, [&](int64_t b0, int64_t b1) {
    float out[NR];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * NR, nrows = std::min<int64_t>(NR, N - n);
      const int64_t next_rows = blk + 1 < b1 ? std::min<int64_t>(NR, N - n - NR) : 0;
      const float* next = next_rows ? wp + (n + NR) * ldw : nullptr;  // no pointer past the weight's end
      if (M == 1) {
        block(xp, K, wp + n * ldw, nrows, ldw, out);
        for (int64_t r = 0; r < nrows; ++r) yp[n + r] = bp ? out[r] + bp[n + r] : out[r];
        continue;
      }
      // Several rows: the block in tiles of TILE_W weight rows by up to TILE_ROWS input rows. The first tile of each
      // weight quarter reads it from memory (or L2), the others from cache; every tile prefetches a share of the next
      // block's rows into L2, so that read overlaps these products (docs/results.md).
      const int64_t groups = (M + TILE_ROWS - 1) / TILE_ROWS, parts = (nrows + TILE_W - 1) / TILE_W;
      const int64_t tiles = groups * parts;
      int64_t t = 0;
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t pn = n + p * TILE_W, prows = std::min<int64_t>(TILE_W, N - pn);
        for (int64_t m = 0; m < M; m += TILE_ROWS, ++t) {
          const int64_t r0 = t * next_rows / tiles, r1 = (t + 1) * next_rows / tiles;
          tile_rows(std::min<int64_t>(TILE_ROWS, M - m), xp + m * K, K, K, wp + pn * ldw, prows, ldw, yp + m * N + pn,
                    N, bp ? bp + pn : nullptr, r1 > r0 ? next + r0 * ldw : nullptr, r1 - r0);
        }
      }
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(citer, m) { m.def("linear_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(citer, CPU, m) { m.impl("linear_f32", &linear_f32); }
