// decode_attention's operands, checked once for both dtypes' ops (cpu_step_bf16.cpp, cpu_step_f32.cpp, each built
// into its own extension): a bad call fails with the op's name and the operand at fault, never reads out of bounds.
#pragma once
#include <torch/extension.h>

namespace citer_step {

// The checked operands: qkv, cos, sin, rows, cols and mask made contiguous (a call's views stay alive with them).
struct AttentionCall {
  torch::Tensor qkv, cos, sin, rows, cols, mask;
  int64_t b, D, C, R;
  const int64_t* rp;    // each row's slot in the pool (b,)
  const int64_t* colp;  // each row's new column (b,)
  const bool* mp;       // (b, kv_len), or nullptr: every column
};

// qkv (b, (nh + 2 kv) D), cos/sin (b, D), kbuf/vbuf (R, kv, C, D) contiguous, all `dtype` on the CPU; rows/cols b
// int64 indices inside the pool; mask (b, kv_len) bool; D a positive multiple of `d_multiple`, at most `d_max`.
inline AttentionCall attention_call(const char* op, at::ScalarType dtype, const torch::Tensor& qkv,
                                    const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& kbuf,
                                    const torch::Tensor& vbuf, const torch::Tensor& rows, const torch::Tensor& cols,
                                    const c10::optional<torch::Tensor>& mask, int64_t kv_len, int64_t n_heads,
                                    int64_t n_kv, int64_t d_multiple, int64_t d_max) {
  for (const torch::Tensor* t : {&qkv, &cos, &sin, &kbuf, &vbuf})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype, op, ": qkv, cos, sin and the KV buffers must be ",
                dtype, " on the CPU");
  TORCH_CHECK(kbuf.is_contiguous() && vbuf.is_contiguous() && kbuf.sizes() == vbuf.sizes() && kbuf.dim() == 4, op,
              ": the KV buffers must be contiguous (R, kv, C, D)");
  AttentionCall a;
  a.b = qkv.size(0);
  a.R = kbuf.size(0);
  a.C = kbuf.size(2);
  a.D = kbuf.size(3);
  TORCH_CHECK(n_kv > 0 && n_heads % n_kv == 0 && kbuf.size(1) == n_kv && a.D > 0 && a.D % d_multiple == 0 &&
                  a.D <= d_max,
              op, ": heads or head_dim");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (n_heads + 2 * n_kv) * a.D, op, ": qkv must be (b, (nh + 2 kv) D)");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == a.b && cos.size(1) == a.D, op,
              ": cos/sin must be (b, D)");
  TORCH_CHECK(rows.numel() == a.b && cols.numel() == a.b && rows.scalar_type() == at::kLong &&
                  cols.scalar_type() == at::kLong,
              op, ": rows and cols must be b int64 indices");
  TORCH_CHECK(kv_len > 0 && kv_len <= a.C, op, ": kv_len");
  a.mp = nullptr;
  if (mask.has_value()) {
    a.mask = mask->contiguous();
    TORCH_CHECK(a.mask.scalar_type() == at::kBool && a.mask.numel() == a.b * kv_len, op,
                ": mask must be (b, kv_len) bool");
    a.mp = a.mask.data_ptr<bool>();
  }
  a.qkv = qkv.contiguous();
  a.cos = cos.contiguous();
  a.sin = sin.contiguous();
  a.rows = rows.contiguous();
  a.cols = cols.contiguous();
  a.rp = a.rows.data_ptr<int64_t>();
  a.colp = a.cols.data_ptr<int64_t>();
  for (int64_t i = 0; i < a.b; ++i)
    TORCH_CHECK(a.rp[i] >= 0 && a.rp[i] < a.R && a.colp[i] >= 0 && a.colp[i] < a.C, op, ": row ", i,
                "'s slot or column");
  return a;
}

}  // namespace citer_step
