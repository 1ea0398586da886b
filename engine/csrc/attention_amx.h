// AMX-BF16 paged-attention tile operations.  NO include guard: attention.cpp includes
// this body twice, inside namespace ...::amx with the real tile instructions and
// inside ...::amx_emu with a software model of the tiles (so the tile bookkeeping is
// tested on machines without AMX).  The includer defines:
//   AMX_CFG(cfg) AMX_LOAD(t, ptr, stride) AMX_STORE(t, ptr, stride) AMX_ZERO(t)
//   AMX_DP(c, a, b) AMX_RELEASE()
// with literal tile numbers.
//
// Shares v512::Bf16Ops' K/V tile layouts (transposed bf16 pairs for K, key-pair
// interleaved V: AMX's VNNI B layout), query rows, softmax and store.  Tiles:
//   QK:  tmm0, tmm1 = S for keys 0-15 / 16-31 (rows x 16 fp32), tmm2 = 32 d of Q,
//        tmm3, tmm4 = the matching 16 K pairs x 16 keys.
//   PV:  tmm6 = P (rows x 32 keys bf16), tmm3, tmm4 = V pairs for 16 + 16 outputs,
//        tmm0, tmm1 = 32 columns of O (loaded, accumulated, stored back).
// A unit of R query rows runs ceil(R / 16) row tiles of min(R, 16) rows; rows past
// R are zero (query) and never read back.

using cpuserve_amx::TileConfig;

struct Ops {
  static void begin(const AttnParams& p, Scratch& s, int R) {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    const int tr = std::min(R, 16);
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = cfg.rows[6] = static_cast<uint8_t>(tr);
    AMX_CFG(&cfg);
    // P rows past R feed the last row tile: keep them zero (softmax writes rows < R).
    const int rows_pad = (R + 15) / 16 * 16;
    std::memset(static_cast<uint16_t*>(s.P) + R * KT, 0, sizeof(uint16_t) * (rows_pad - R) * KT);
    (void)p;
  }
  static void end() { AMX_RELEASE(); }

  static void load_q(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    v512::Bf16Ops::load_q(p, s, tok, ntok, kvh, R);
  }
  static void prep_kv(const AttnParams& p, Scratch& s, const int32_t* bt_row, int kvh, int k0, int n) {
    v512::Bf16Ops::prep_kv(p, s, bt_row, kvh, k0, n);
  }
  static void softmax(const AttnParams& p, Scratch& s, int R, int k0, int n, bool masked) {
    v512::Bf16Ops::softmax(p, s, R, k0, n, masked);
  }
  static void store(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    v512::Bf16Ops::store(p, s, tok, ntok, kvh, R);
  }

  __attribute__((noinline)) static void qk(const AttnParams& p, Scratch& s, int R, int n) {
    (void)n;
    const int Dp = p.Dp;
    const uint16_t* q = static_cast<const uint16_t*>(s.q);
    const int32_t* kt = static_cast<const int32_t*>(s.kt);
    for (int rt = 0; rt * 16 < R; ++rt) {
      AMX_ZERO(0);
      AMX_ZERO(1);
      for (int c = 0; c < Dp / 32; ++c) {
        AMX_LOAD(2, q + static_cast<int64_t>(rt) * 16 * Dp + c * 32, Dp * 2);
        AMX_LOAD(3, kt + c * 16 * KT, KT * 4);
        AMX_LOAD(4, kt + c * 16 * KT + 16, KT * 4);
        AMX_DP(0, 2, 3);
        AMX_DP(1, 2, 4);
      }
      AMX_STORE(0, s.S + rt * 16 * KT, KT * 4);
      AMX_STORE(1, s.S + rt * 16 * KT + 16, KT * 4);
    }
  }

  __attribute__((noinline)) static void pv(const AttnParams& p, Scratch& s, int R, int n) {
    (void)n;
    const int Dp = p.Dp;
    for (int r = 0; r < R; ++r) {
      const float a = s.alpha[r];
      if (a == 1.f) continue;
      float* o = s.O + static_cast<int64_t>(r) * Dp;
      const __m512 av = _mm512_set1_ps(a);
      for (int d = 0; d < Dp; d += 16) _mm512_store_ps(o + d, _mm512_mul_ps(_mm512_load_ps(o + d), av));
    }
    const uint16_t* P = static_cast<const uint16_t*>(s.P);
    const int32_t* v = static_cast<const int32_t*>(s.v);
    for (int rt = 0; rt * 16 < R; ++rt) {
      AMX_LOAD(6, P + rt * 16 * KT, KT * 2);
      for (int d0 = 0; d0 < Dp; d0 += 32) {
        float* o = s.O + static_cast<int64_t>(rt) * 16 * Dp + d0;
        AMX_LOAD(0, o, Dp * 4);
        AMX_LOAD(1, o + 16, Dp * 4);
        AMX_LOAD(3, v + d0, Dp * 4);
        AMX_LOAD(4, v + d0 + 16, Dp * 4);
        AMX_DP(0, 6, 3);
        AMX_DP(1, 6, 4);
        AMX_STORE(0, o, Dp * 4);
        AMX_STORE(1, o + 16, Dp * 4);
      }
    }
  }
};
