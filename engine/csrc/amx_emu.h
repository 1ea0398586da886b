// A software model of the 8 AMX tile registers and the bf16 tile instructions (ldtilecfg,
// tileloadd, tilestored, tilezero, tdpbf16ps): enough of the ISA's rules (shapes from the
// configuration, rows past the configured count read as zero) to catch layout and stride mistakes
// in attention_amx.h on hosts without AMX (attention.cpp's amx_emu path, which the tests run).
// Shape errors are counted in g_errors, not raised, so a kernel runs to its end.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace cpuserve_amx {
namespace emu {

struct Tiles {
  alignas(64) uint8_t data[8][16 * 64];
  int rows[8];
  int colsb[8];
};
inline Tiles& tiles() {
  static thread_local Tiles t;
  return t;
}
inline std::atomic<int> g_errors{0};

inline void cfg(const void* c) {
  const uint8_t* b = static_cast<const uint8_t*>(c);
  Tiles& t = tiles();
  if (b[0] != 1) g_errors++;
  for (int i = 0; i < 8; ++i) {
    uint16_t colsb;
    std::memcpy(&colsb, b + 16 + 2 * i, 2);
    t.colsb[i] = colsb;
    t.rows[i] = b[48 + i];
    if (colsb > 64 || t.rows[i] > 16) g_errors++;
  }
  std::memset(t.data, 0, sizeof(t.data));
}
inline void load(int i, const void* p, int64_t stride) {
  Tiles& t = tiles();
  std::memset(t.data[i], 0, sizeof(t.data[i]));
  for (int r = 0; r < t.rows[i]; ++r) std::memcpy(t.data[i] + r * 64, static_cast<const uint8_t*>(p) + r * stride, t.colsb[i]);
}
inline void store(int i, void* p, int64_t stride) {
  Tiles& t = tiles();
  for (int r = 0; r < t.rows[i]; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, t.data[i] + r * 64, t.colsb[i]);
}
inline void zero(int i) { std::memset(tiles().data[i], 0, sizeof(tiles().data[i])); }
inline float bf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return cpuserve::bf16_to_float(h);
}
// C[m][n] += sum_k A[m][2k] * B[k][2n] + A[m][2k+1] * B[k][2n+1]   (bf16 in, fp32 out)
inline void dp(int c, int a, int b) {
  Tiles& t = tiles();
  const int M = t.rows[a], K = t.colsb[a] / 4, N = t.colsb[c] / 4;
  if (t.rows[c] != M || t.rows[b] != K || t.colsb[b] != t.colsb[c]) {
    g_errors++;
    return;
  }
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      float acc;
      std::memcpy(&acc, t.data[c] + m * 64 + n * 4, 4);
      for (int k = 0; k < K; ++k) {
        acc += bf(t.data[a] + m * 64 + k * 4) * bf(t.data[b] + k * 64 + n * 4);
        acc += bf(t.data[a] + m * 64 + k * 4 + 2) * bf(t.data[b] + k * 64 + n * 4 + 2);
      }
      std::memcpy(t.data[c] + m * 64 + n * 4, &acc, 4);
    }
  }
}
}  // namespace emu
}  // namespace cpuserve_amx
