// Row kernels of fused.cpp, written once over a vector type and stamped out per instruction set:
// fused.cpp includes this file inside a `#pragma GCC target` region with FUSED_NS (namespace) and
// FUSED_VEC (a vector struct, see fused.cpp) defined.  Element types: float, or uint16_t holding
// bfloat16.  Each kernel rounds wherever the torch reference in engine/layers/fused.py rounds, so
// bf16 results match it (up to the order of the sum of squares and exp's last bit).

namespace fused {
namespace FUSED_NS {

using V = FUSED_VEC;
constexpr int W = V::kWidth;

inline V vload(const float* p) { return V::load(p); }
inline V vload(const uint16_t* p) { return V::load_bf16(p); }
inline void vstore(float* p, V v) { V::store(p, v); }
inline void vstore(uint16_t* p, V v) { V::store_bf16(p, v); }
// value rounded to the element type (a no-op for float)
inline V vround(V v, const float*) { return v; }
inline V vround(V v, const uint16_t*) { return V::round_bf16(v); }

inline float sload(const float* p) { return *p; }
inline float sload(const uint16_t* p) { return bf16_to_float(*p); }
inline void sstore(float* p, float v) { *p = v; }
inline void sstore(uint16_t* p, float v) { *p = float_to_bf16(v); }
inline float sround(float v, const float*) { return v; }
inline float sround(float v, const uint16_t*) { return bf16_to_float(float_to_bf16(v)); }

// out = weight * T(s * rsqrt(mean(s^2) + eps)) with s = T(x + residual) (or x); s goes to res_out
// when given.  Any of x/res_in/res_out/out may alias the same row (in-place use).
template <typename T>
void add_rms_norm_row(const T* x, const T* res_in, T* res_out, const T* w, T* out, int64_t h, float eps) {
  V acc = V::zero();
  float acc_s = 0.f;
  int64_t i = 0;
  for (; i + W <= h; i += W) {
    V s = vload(x + i);
    if (res_in) s = vround(V::add(s, vload(res_in + i)), x);
    if (res_out) vstore(res_out + i, s);
    acc = V::fmadd(s, s, acc);
  }
  for (; i < h; ++i) {
    float s = sload(x + i);
    if (res_in) s = sround(s + sload(res_in + i), x);
    if (res_out) sstore(res_out + i, s);
    acc_s += s * s;
  }
  const float r = 1.f / std::sqrt((V::reduce_add(acc) + acc_s) / static_cast<float>(h) + eps);
  const V vr = V::set1(r);
  // second pass over the (L1-resident) row: from res_out when written, else recompute
  const T* src = res_out ? res_out : x;
  const T* add = res_out ? nullptr : res_in;
  for (i = 0; i + W <= h; i += W) {
    V s = vload(src + i);
    if (add) s = vround(V::add(s, vload(add + i)), x);
    vstore(out + i, V::mul(vload(w + i), vround(V::mul(s, vr), x)));
  }
  for (; i < h; ++i) {
    float s = sload(src + i);
    if (add) s = sround(s + sload(add + i), x);
    sstore(out + i, sload(w + i) * sround(s * r, x));
  }
}

// out = T(silu(gate)) * up, silu(g) = g / (1 + exp(-g))
template <typename T>
void silu_and_mul_row(const T* gate, const T* up, T* out, int64_t d) {
  int64_t i = 0;
  const V one = V::set1(1.f);
  for (; i + W <= d; i += W) {
    const V g = vload(gate + i);
    const V s = vround(V::div(g, V::add(one, V::exp(V::neg(g)))), gate);
    vstore(out + i, V::mul(s, vload(up + i)));
  }
  for (; i < d; ++i) {
    const float g = sload(gate + i);
    sstore(out + i, sround(g / (1.f + std::exp(-g)), gate) * sload(up + i));
  }
}

// NeoX rotary embedding of `heads` heads of size 2 * half, from src to dst (may alias).
template <typename T>
void rope_row(const T* src, T* dst, int64_t heads, int64_t half, const float* cos, const float* sin) {
  for (int64_t hd = 0; hd < heads; ++hd) {
    const T* a = src + hd * 2 * half;
    T* o = dst + hd * 2 * half;
    int64_t i = 0;
    for (; i + W <= half; i += W) {
      const V x1 = vload(a + i), x2 = vload(a + half + i);
      const V c = V::load(cos + i), s = V::load(sin + i);
      const V o1 = V::sub(V::mul(x1, c), V::mul(x2, s));
      const V o2 = V::add(V::mul(x2, c), V::mul(x1, s));
      vstore(o + i, o1);
      vstore(o + half + i, o2);
    }
    for (; i < half; ++i) {
      const float x1 = sload(a + i), x2 = sload(a + half + i);
      const float o1 = x1 * cos[i] - x2 * sin[i];
      const float o2 = x2 * cos[i] + x1 * sin[i];
      sstore(o + i, o1);
      sstore(o + half + i, o2);
    }
  }
}

// ---- entry points: a range of rows each, called from the (possibly parallel) loops in fused.cpp

void add_rms_norm_rows(const NormArgs& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    if (a.bf16) {
      auto row = [&](const void* p, int64_t ld) { return p ? static_cast<const uint16_t*>(p) + r * ld : nullptr; };
      add_rms_norm_row<uint16_t>(row(a.x, a.ldx), row(a.res_in, a.ld_res_in), const_cast<uint16_t*>(row(a.res_out, a.ld_res_out)),
                                 static_cast<const uint16_t*>(a.w), const_cast<uint16_t*>(row(a.out, a.ld_out)), a.h, a.eps);
    } else {
      auto row = [&](const void* p, int64_t ld) { return p ? static_cast<const float*>(p) + r * ld : nullptr; };
      add_rms_norm_row<float>(row(a.x, a.ldx), row(a.res_in, a.ld_res_in), const_cast<float*>(row(a.res_out, a.ld_res_out)),
                              static_cast<const float*>(a.w), const_cast<float*>(row(a.out, a.ld_out)), a.h, a.eps);
    }
  }
}

void silu_and_mul_rows(const SiluArgs& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    if (a.bf16) {
      const uint16_t* in = static_cast<const uint16_t*>(a.in) + r * a.ld_in;
      silu_and_mul_row<uint16_t>(in, in + a.d, static_cast<uint16_t*>(a.out) + r * a.ld_out, a.d);
    } else {
      const float* in = static_cast<const float*>(a.in) + r * a.ld_in;
      silu_and_mul_row<float>(in, in + a.d, static_cast<float*>(a.out) + r * a.ld_out, a.d);
    }
  }
}

void rope_rows(const RopeArgs& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* cs = a.cos_sin + a.positions[r] * a.ld_cs;
    const float* cos = cs;
    const float* sin = cs + a.half;
    for (int j = 0; j < 2; ++j) {
      const RopeArgs::Part& p = a.part[j];
      if (p.heads == 0) continue;
      if (a.bf16)
        rope_row<uint16_t>(static_cast<const uint16_t*>(p.src) + r * p.ld_src, static_cast<uint16_t*>(p.dst) + r * p.ld_dst,
                           p.heads, a.half, cos, sin);
      else
        rope_row<float>(static_cast<const float*>(p.src) + r * p.ld_src, static_cast<float*>(p.dst) + r * p.ld_dst,
                        p.heads, a.half, cos, sin);
    }
  }
}

// out[i] = exp((x[i] - shift) * scale), returning their sum: the sampler's unnormalised
// probabilities of one row of logits (shift the row's max, scale 1 / temperature).
inline float exp_shifted_row(const float* x, float shift, float scale, float* out, int64_t n) {
  const V sh = V::set1(shift), sc = V::set1(scale);
  V acc = V::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const V e = V::exp(V::mul(V::sub(V::load(x + i), sh), sc));
    V::store(out + i, e);
    acc = V::add(acc, e);
  }
  float sum = V::reduce_add(acc);
  for (; i < n; ++i) sum += out[i] = std::exp((x[i] - shift) * scale);
  return sum;
}

}  // namespace FUSED_NS
}  // namespace fused
