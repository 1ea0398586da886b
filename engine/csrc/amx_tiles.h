// What every AMX kernel of the extension shares: whether this compiler has the intrinsics, and the
// 64-byte tile configuration that `ldtilecfg` reads (palette 1: 8 tiles, each up to 16 rows of up
// to 64 bytes; the rest of the struct must be zero).
#pragma once
#include <cstdint>

// AMX intrinsics need GCC >= 11 (or clang >= 12); older compilers build without AMX.
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define CPUSERVE_HAVE_AMX 1
#else
#define CPUSERVE_HAVE_AMX 0
#endif

namespace cpuserve_amx {

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

}  // namespace cpuserve_amx
