// Row reductions of 16 rows at once with AVX-512, shared by the attention softmax
// (attention_vec512.h) and the activation quantizer (qlinear.cpp).
#pragma once

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq")

namespace cpuserve_vec512 {

// v[r] holds row r's 16 partial values; the result's lane r is row r's max (or sum).  A shuffle
// tree (16 -> 8 -> 4 -> 2 -> 1 vectors) costs ~3 ops a row where a horizontal reduction per row
// costs ~9, and its rows do not wait on each other.  Feed rows in pairs with pair(), then finish().
template <bool MAX>
struct RowReduce16 {
  static inline __m512 op(__m512 a, __m512 b) { return MAX ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b); }
  __m512 u[8];
  // Rows 2i and 2i + 1: each 128-bit lane of u[i] holds half a row's reduction.
  inline void pair(int i, __m512 a, __m512 b) {
    u[i] = op(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  inline __m512 finish() const {
    __m512 w[4];
    for (int i = 0; i < 4; ++i)  // lane L of w[i]: row 4i + L's four partials
      w[i] = op(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    const __m512 y0 = op(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const __m512 y1 = op(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    const __m512 z = op(_mm512_unpacklo_ps(y0, y1), _mm512_unpackhi_ps(y0, y1));
    // z's element 4L + j is row L + {0, 8, 4, 12}[j]
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 13, 9, 5, 1, 14, 10, 6, 2, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, z);
  }
};

}  // namespace cpuserve_vec512

#pragma GCC pop_options
