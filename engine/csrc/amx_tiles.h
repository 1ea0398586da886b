// What every AMX kernel of the extension shares: the 64-byte tile configuration that `ldtilecfg`
// reads (palette 1: 8 tiles, each up to 16 rows of up to 64 bytes; the rest of the struct must be zero).
#pragma once
#include <cstdint>

#include "isa.h"  // CPUSERVE_HAVE_AMX: whether this compiler has the intrinsics

namespace cpuserve_amx {

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

}  // namespace cpuserve_amx
