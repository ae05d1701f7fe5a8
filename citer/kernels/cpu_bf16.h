// bf16 <-> float32 for the bf16 extension's kernels (cpu_linear.cpp, cpu_step_bf16.cpp): float32 rounded to bf16
// to nearest even, as torch rounds, and a NaN written as 0x7FC0 (c10::BFloat16's rule). One definition, so the one-row
// blocks, the AMX tiles and the step's ops write the same bits for the same float.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace citer_bf16 {

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) return 0x7FC0;
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

inline float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

inline __m512 load16(const uint16_t* p, __mmask16 m) {  // bf16 -> float32, lanes outside m zero
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// Each lane rounded to bf16 (to_bf16's rule), left in its high 16 bits.
inline __m512i rne(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                       _mm512_set1_epi32((int)0xFFFF0000u));
  return _mm512_mask_mov_epi32(u, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}

inline void store16(uint16_t* p, __m512 v, __mmask16 m) {  // float32 -> bf16, lanes in m stored
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rne(v), 16)));
}

inline __m512 round16(__m512 v) { return _mm512_castsi512_ps(rne(v)); }  // as a torch op's bf16 result read again

}  // namespace citer_bf16
