// AMX's tile configuration and Linux's permission to use the tiles, for the bf16 kernel (cpu_linear.cpp) and
// bench/amx_peak.py's tile steps.
#pragma once
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace citer_amx {

// A tile's shape, as _tile_loadconfig reads it (palette 1).
struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The CPU has AMX-TILE and AMX-BF16 and Linux lets this process use the tiles' state (asked once).
inline bool usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
}

}  // namespace citer_amx
