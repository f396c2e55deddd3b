// lmcli's quantizer: float rows -> GGUF blocks, byte for byte what ggml's reference quantizer
// (ggml_quantize_chunk, the one llama-quantize calls) writes, with or without an importance
// matrix (one weight a column: how much that input matters).
//
// Every block is the struct of formats.h. Exactness rests on doing each float operation in
// ggml's order and type: the library is built with -std=c++17 (no fused multiply-add contraction)
// and no -march, as ggml-base is built for the baseline instruction set, so every rounding, every
// comparison and every argmin decides as ggml's does. The searches (make_qx, the min/scale fit,
// make_qp, make_q3, the IQ4 scale search) are ggml's algorithms, written anew here.
//
// Rows are independent: a call splits its rows over `threads` threads (each row's bytes are the
// same whatever the split).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "formats.h"

namespace lmquant {

using namespace lmfmt;

constexpr float kGroupMaxEps = 1e-15f;  // a group whose largest magnitude is below is all zeros

// ---------------------------------------------------------------- halves and rounding

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half of `f`, rounded to nearest even (a NaN: the quiet NaN 0x7e00 with f's sign)
inline uint16_t half_of(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7fffffff;
  if (a > 0x7f800000) return sign | 0x7e00;
  if (a >= 0x477ff000) return sign | 0x7c00;  // 65520 and above: infinity
  if (a < 0x38800000) {                       // below 2^-14: a subnormal half (or zero)
    const int shift = 126 - (int)(a >> 23);   // |f| / 2^-24 = mantissa * 2^-shift
    if (shift > 24) return sign;
    const uint32_t m = (a & 0x7fffff) | (a >= 0x00800000 ? 0x800000 : 0);
    const uint32_t q = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    return sign | (uint16_t)(q + (rest > half || (rest == half && (q & 1))));
  }
  const uint32_t h = ((a >> 23) - 112) << 10 | ((a >> 13) & 0x3ff);
  const uint32_t rest = a & 0x1fff;
  return sign | (uint16_t)(h + (rest > 0x1000 || (rest == 0x1000 && (h & 1))));
}

inline float float_of_half(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0x1f) return float_of(sign | 0x7f800000 | m << 13);
  if (e != 0) return float_of(sign | (e + 112) << 23 | m << 13);
  const float v = (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact
  return sign ? -v : v;
}

// the nearest integer, halves to even: the float's own rounding when 1.5 * 2^23 is added (|v| < 2^22)
inline int nearest_int(float v) {
  const float shifted = v + 12582912.f;
  int32_t i;
  std::memcpy(&i, &shifted, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// the index of the value of `table` (ascending, n entries) nearest to x (ties: the upper)
inline int nearest_index(int n, const int8_t* table, float x) {
  if (x <= table[0]) return 0;
  if (x >= table[n - 1]) return n - 1;
  int lo = 0, hi = n - 1;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (x < table[mid])
      hi = mid;
    else
      lo = mid;
  }
  return x - table[hi - 1] < table[hi] - x ? hi - 1 : hi;
}

// ---------------------------------------------------------------- scale searches

// A symmetric scale for n values on the levels -nmax..nmax-1, chosen among 19 trial scales to
// maximise (sum w x l)^2 / sum w l^2; L gets the levels shifted by nmax. Weights: qw, or x^2.
float fit_symmetric(int n, int nmax, const float* x, int8_t* L, const float* qw) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    std::memset(L, 0, (size_t)n);
    return 0.f;
  }
  auto weight = [&](int i) { return qw ? qw[i] : x[i] * x[i]; };
  auto level = [&](float iscale, int i) { return std::max(-nmax, std::min(nmax - 1, nearest_int(iscale * x[i]))); };
  float iscale = -nmax / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = level(iscale, i);
    L[i] = (int8_t)(l + nmax);
    const float w = weight(i);
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  float scale = suml2 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(nmax + 0.1f * is) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = level(iscale, i);
      const float w = weight(i);
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) L[i] = (int8_t)(nmax + level(iscale, i));
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// q3_K's group search (weights x^2): the levels -nmax..nmax-1 of the first scale, then up to
// five passes moving one level at a time while the fit improves; L gets the levels + nmax
float fit_q3(int n, int nmax, const float* x, int8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    std::memset(L, 0, (size_t)n);
    return 0.f;
  }
  const float iscale = -nmax / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = std::max(-nmax, std::min(nmax - 1, nearest_int(iscale * x[i])));
    L[i] = (int8_t)l;
    const float w = x[i] * x[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      float slx = sumlx - w * x[i] * L[i];
      if (slx > 0) {
        float sl2 = suml2 - w * L[i] * L[i];
        const int l = std::max(-nmax, std::min(nmax - 1, nearest_int(x[i] * sl2 / slx)));
        if (l != L[i]) {
          slx += w * x[i] * l;
          sl2 += w * l * l;
          if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
            L[i] = (int8_t)l;
            sumlx = slx;
            suml2 = sl2;
            ++changed;
          }
        }
      }
    }
    if (!changed) break;
  }
  for (int i = 0; i < n; ++i) L[i] = (int8_t)(L[i] + nmax);
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// A scale and a minimum (v = scale l - the_min, l in 0..nmax) for n weighted values: the plain
// fit, then nstep + 1 trial scales (rmin + rdelta is + nmax over the range), each refit by weighted
// least squares, the one of least weighted error (|diff| with use_mad, else diff^2) kept.
float fit_scale_min(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* the_min,
                    uint8_t* Laux, float rmin, float rdelta, int nstep, bool use_mad) {
  float min = x[0], max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max <= min) {
    std::memset(L, 0, (size_t)n);
    *the_min = -min;
    return 0.f;
  }
  auto error = [&](float scale, float offset, const uint8_t* levels) {
    float total = 0;
    for (int i = 0; i < n; ++i) {
      float diff = scale * levels[i] + offset - x[i];
      diff = use_mad ? std::fabs(diff) : diff * diff;
      total += weights[i] * diff;
    }
    return total;
  };
  float iscale = nmax / (max - min);
  float scale = 1 / iscale;
  for (int i = 0; i < n; ++i) L[i] = (uint8_t)std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - min))));
  float best_error = error(scale, min, L);
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - min))));
      Laux[i] = (uint8_t)l;
      const float w = weights[i];
      sum_l += w * l;
      sum_l2 += w * l * l;
      sum_xl += w * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      const float cur_error = error(this_scale, this_min, Laux);
      if (cur_error < best_error) {
        std::memcpy(L, Laux, (size_t)n);
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

// A scale for n non-negative values (a super-block's scales or minimums) on the levels 0..nmax,
// weighted by `qw`: 9 trial scales by weighted squared error, then passes of one-level moves.
float fit_positive(int n, int nmax, const float* x, uint8_t* L, const float* qw) {
  float max = 0;
  for (int i = 0; i < n; ++i) max = std::max(max, x[i]);
  if (max < kGroupMaxEps) {
    std::memset(L, 0, (size_t)n);
    return 0.f;
  }
  float iscale = nmax / max;
  for (int i = 0; i < n; ++i) L[i] = (uint8_t)nearest_int(iscale * x[i]);
  const float scale = 1 / iscale;
  float best_mse = 0;
  for (int i = 0; i < n; ++i) {
    const float diff = x[i] - scale * L[i];
    best_mse += qw[i] * diff * diff;
  }
  for (int is = -4; is <= 4; ++is) {
    if (is == 0) continue;
    const float iscale_is = (0.1f * is + nmax) / max;
    const float scale_is = 1 / iscale_is;
    float mse = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::min(nmax, nearest_int(iscale_is * x[i]));
      const float diff = x[i] - scale_is * l;
      mse += qw[i] * diff * diff;
    }
    if (mse < best_mse) {
      best_mse = mse;
      iscale = iscale_is;
    }
  }
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = std::min(nmax, nearest_int(iscale * x[i]));
    L[i] = (uint8_t)l;
    const float w = qw[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = qw[i];
      float slx = sumlx - w * x[i] * L[i];
      float sl2 = suml2 - w * L[i] * L[i];
      if (slx > 0 && sl2 > 0) {
        const int l = std::min(nmax, nearest_int(x[i] * sl2 / slx));
        if (l != L[i]) {
          slx += w * x[i] * l;
          sl2 += w * l * l;
          if (slx * slx * suml2 > sumlx * sumlx * sl2) {
            L[i] = (uint8_t)l;
            sumlx = slx;
            suml2 = sl2;
            ++changed;
          }
        }
      }
    }
    if (!changed) break;
  }
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// the searches eight groups at a time (quantize_x8.inc) where the CPU has AVX2, else one by one
#if defined(__x86_64__) || defined(__i386__)
namespace avx2 {
#define LQ_TARGET __attribute__((target("avx2")))
#include "quantize_x8.inc"
#undef LQ_TARGET
}  // namespace avx2

inline bool side_by_side() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}
#else
inline bool side_by_side() { return false; }
#endif

// groups 0 .. 7 of `per` values (group g at x + g * per) as (per, 8): lane g group g's
inline void transpose8(const float* x, int per, float* xt) {
  for (int g = 0; g < 8; ++g)
    for (int i = 0; i < per; ++i) xt[8 * i + g] = x[g * per + i];
}

// fit_scale_min of groups 0 .. 7 of `per` values at x (weights w, levels L, all at g * per)
inline void scale_min_8(int per, int nmax, const float* x, const float* w, uint8_t* L, float* the_min, float* scale,
                        float rmin, float rdelta, int nstep, bool use_mad) {
#if defined(__x86_64__) || defined(__i386__)
  if (side_by_side()) {
    float xt[32 * 8], wt[32 * 8];
    transpose8(x, per, xt);
    transpose8(w, per, wt);
    return avx2::fit_scale_min_x8(per, nmax, xt, wt, L, per, the_min, scale, rmin, rdelta, nstep, use_mad);
  }
#endif
  uint8_t Laux[32];
  for (int g = 0; g < 8; ++g)
    scale[g] = fit_scale_min(per, nmax, x + g * per, w + g * per, L + g * per, &the_min[g], Laux, rmin, rdelta,
                             nstep, use_mad);
}

// fit_symmetric of groups 0 .. 7 of `per` values at x (qw: their weights, or null for x^2)
inline void symmetric_8(int per, int nmax, const float* x, const float* qw, int8_t* L, float* scale) {
#if defined(__x86_64__) || defined(__i386__)
  if (side_by_side()) {
    float xt[32 * 8], wt[32 * 8];
    transpose8(x, per, xt);
    if (qw) transpose8(qw, per, wt);
    return avx2::fit_symmetric_x8(per, nmax, xt, qw ? wt : nullptr, L, per, scale);
  }
#endif
  for (int g = 0; g < 8; ++g) scale[g] = fit_symmetric(per, nmax, x + g * per, L + g * per, qw ? qw + g * per : nullptr);
}

// the importance weights of one row's group: qw[j] sqrt(sigma2 + x[j]^2)
inline void importance(int n, const float* qw, const float* x, float sigma2, float* out) {
  for (int j = 0; j < n; ++j) out[j] = qw[j] * std::sqrt(sigma2 + x[j] * x[j]);
}

inline float sum_squares(int64_t n, const float* x) {
  float s = 0;
  for (int64_t j = 0; j < n; ++j) s += x[j] * x[j];
  return s;
}

// ---------------------------------------------------------------- the 32-value formats

// value i of a 32-block in the low nibble of qs[i], value i + 16 in the high one
inline void pack_nibbles(const uint8_t* L, uint8_t* qs) {
  for (int j = 0; j < QK / 2; ++j) qs[j] = (uint8_t)(L[j] | (L[j + QK / 2] << 4));
}

// q5's nibbles and fifth bits (bit i of qh: value i's)
template <class Block>
void pack_q5(const uint8_t* L, Block& b) {
  uint32_t qh = 0;
  for (int j = 0; j < QK / 2; ++j) {
    b.qs[j] = (uint8_t)((L[j] & 0x0F) | ((L[j + QK / 2] & 0x0F) << 4));
    qh |= ((L[j] & 0x10u) >> 4) << j;
    qh |= ((L[j + QK / 2] & 0x10u) >> 4) << (j + QK / 2);
  }
  std::memcpy(b.qh, &qh, 4);
}

// the value of largest magnitude (the first of ties)
inline float signed_peak(const float* x, int n) {
  float amax = 0, max = 0;
  for (int j = 0; j < n; ++j)
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

void q8_0_row(const float* x, BlockQ8_0* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float amax = 0;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    y[i].d = half_of(d);
    for (int j = 0; j < QK; ++j) y[i].qs[j] = (int8_t)std::round(x[j] * id);
  }
}

// q4_0 (levels 0..15 around 8) and q5_0 (0..31 around 16): the peak value is level 0
template <class Block, int Mid>
void q_0_row(const float* x, Block* y, int64_t nb) {
  uint8_t L[QK];
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    const float d = signed_peak(x, QK) / -Mid;
    const float id = d ? 1.0f / d : 0.0f;
    y[i].d = half_of(d);
    for (int j = 0; j < QK; ++j) L[j] = (uint8_t)std::min(2 * Mid - 1, (int)(int8_t)(x[j] * id + (Mid + 0.5f)));
    if constexpr (Mid == 8)
      pack_nibbles(L, y[i].qs);
    else
      pack_q5(L, y[i]);
  }
}

// q4_1 (levels 0..15) and q5_1 (0..31) from the block's minimum
template <class Block, int Levels>
void q_1_row(const float* x, Block* y, int64_t nb) {
  uint8_t L[QK];
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float min = x[0], max = x[0];
    for (int j = 0; j < QK; ++j) {
      if (x[j] < min) min = x[j];
      if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / (Levels - 1);
    const float id = d ? 1.0f / d : 0.0f;
    y[i].d = half_of(d);
    y[i].m = half_of(min);
    for (int j = 0; j < QK; ++j) {
      const float v = (x[j] - min) * id + 0.5f;
      L[j] = Levels == 16 ? (uint8_t)std::min(15, (int)(int8_t)v) : (uint8_t)v;
    }
    if constexpr (Levels == 16)
      pack_nibbles(L, y[i].qs);
    else
      pack_q5(L, y[i]);
  }
}

// with importance weights: q4_0/q5_0 by fit_symmetric, q4_1/q5_1 by fit_scale_min (sigma2 of the row)
template <class Block, int Mid>
void q_0_weighted(const float* x, Block* y, int64_t n_per_row, const float* qw) {
  const float sigma2 = sum_squares(n_per_row, x) / n_per_row;
  float weight[QK];
  int8_t L[QK];
  for (int64_t ib = 0; ib < n_per_row / QK; ++ib) {
    const float* xb = x + QK * ib;
    importance(QK, qw + QK * ib, xb, sigma2, weight);
    y[ib].d = half_of(fit_symmetric(QK, Mid, xb, L, weight));
    if constexpr (Mid == 8)
      pack_nibbles((const uint8_t*)L, y[ib].qs);
    else
      pack_q5((const uint8_t*)L, y[ib]);
  }
}

template <class Block, int Levels>
void q_1_weighted(const float* x, Block* y, int64_t n_per_row, const float* qw) {
  const float sigma2 = sum_squares(n_per_row, x) / n_per_row;
  float weight[QK];
  uint8_t L[QK], Laux[QK];
  for (int64_t ib = 0; ib < n_per_row / QK; ++ib) {
    const float* xb = x + QK * ib;
    importance(QK, qw + QK * ib, xb, sigma2, weight);
    float min;
    const float d = fit_scale_min(QK, Levels - 1, xb, weight, L, &min, Laux, -0.9f, 0.05f, 36, false);
    y[ib].d = half_of(d);
    y[ib].m = half_of(-min);
    if constexpr (Levels == 16)
      pack_nibbles(L, y[ib].qs);
    else
      pack_q5(L, y[ib]);
  }
}

}  // namespace lmquant

#include "quantize_k.inc"
#include "quantize_iq4.inc"

namespace lmquant {

// one row of n_per_row values in `wtype` (qw: the row's importance weights, or null)
void quantize_row(int wtype, const float* x, uint8_t* out, int64_t n_per_row, const float* qw) {
  const int64_t nb = n_per_row / block_values(wtype);
  switch (wtype) {
    case Q8_0:
      return q8_0_row(x, (BlockQ8_0*)out, nb);
    case Q4_0:
      return qw ? q_0_weighted<BlockQ4_0, 8>(x, (BlockQ4_0*)out, n_per_row, qw)
                : q_0_row<BlockQ4_0, 8>(x, (BlockQ4_0*)out, nb);
    case Q5_0:
      return qw ? q_0_weighted<BlockQ5_0, 16>(x, (BlockQ5_0*)out, n_per_row, qw)
                : q_0_row<BlockQ5_0, 16>(x, (BlockQ5_0*)out, nb);
    case Q4_1:
      return qw ? q_1_weighted<BlockQ4_1, 16>(x, (BlockQ4_1*)out, n_per_row, qw)
                : q_1_row<BlockQ4_1, 16>(x, (BlockQ4_1*)out, nb);
    case Q5_1:
      return qw ? q_1_weighted<BlockQ5_1, 32>(x, (BlockQ5_1*)out, n_per_row, qw)
                : q_1_row<BlockQ5_1, 32>(x, (BlockQ5_1*)out, nb);
    case Q2_K:
      return q2_K_row(x, (BlockQ2_K*)out, nb, qw);
    case Q3_K:
      return q3_K_row(x, (BlockQ3_K*)out, nb, qw);
    case Q4_K:
      return q45_K_row<BlockQ4_K, 16>(x, (BlockQ4_K*)out, nb, qw);
    case Q5_K:
      return q45_K_row<BlockQ5_K, 32>(x, (BlockQ5_K*)out, nb, qw);
    case Q6_K:
      return q6_K_row(x, (BlockQ6_K*)out, nb, qw);
    case IQ4_NL:
      return iq4_nl_row(x, (BlockIQ4_NL*)out, nb, qw);
    case IQ4_XS:
      return iq4_xs_row(x, (BlockIQ4_XS*)out, nb, qw);
    default:
      return;
  }
}

bool quantizable(int wtype) {
  switch (wtype) {
    case Q8_0: case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q2_K: case Q3_K: case Q4_K: case Q5_K:
    case Q6_K: case IQ4_NL: case IQ4_XS:
      return true;
    default:
      return false;
  }
}

// x's rows as float32: a float32 row itself, an f16 or bf16 row converted into `buf` (exactly)
inline const float* row_floats(const void* x, int x_type, int64_t r, int64_t n, float* buf) {
  if (x_type == F32) return (const float*)x + r * n;
  const uint16_t* h = (const uint16_t*)x + r * n;
  if (x_type == F16)
    for (int64_t j = 0; j < n; ++j) buf[j] = float_of_half(h[j]);
  else
    for (int64_t j = 0; j < n; ++j) buf[j] = float_of((uint32_t)h[j] << 16);
  return buf;
}

}  // namespace lmquant

extern "C" {

// x (nrows, n_per_row) of ggml type x_type (F32, F16 or BF16) -> out (nrows, row bytes) in GGUF
// block layout `wtype`, as ggml's ggml_quantize_chunk writes it (from x's values as float32);
// imatrix: n_per_row importance weights (one a column) or null. Threads take chunks of rows in
// turn (about 16K values a chunk, as llama-quantize's), so a slow thread delays no other.
// Returns the bytes written, or -1 for a type it does not write or read, or a row not a whole
// number of blocks (every other size is the caller's to check).
int64_t lmcli_native_quantize(int wtype, const void* x, int x_type, int64_t nrows, int64_t n_per_row,
                              const float* imatrix, uint8_t* out, int threads) {
  using namespace lmquant;
  if (!quantizable(wtype) || nrows < 0 || n_per_row <= 0 || n_per_row % block_values(wtype) != 0) return -1;
  if (x_type != F32 && x_type != F16 && x_type != BF16) return -1;
  if (wtype == Q8_0) imatrix = nullptr;  // ggml's q8_0 ignores it
  const int64_t row_bytes = n_per_row / block_values(wtype) * block_bytes(wtype);
  const int64_t chunk = std::max<int64_t>(1, 16384 / n_per_row);
  std::atomic<int64_t> next{0};
  auto work = [&] {
    std::vector<float> buf(x_type == F32 ? 0 : (size_t)n_per_row);
    for (int64_t lo; (lo = next.fetch_add(chunk)) < nrows;)
      for (int64_t r = lo; r < std::min(nrows, lo + chunk); ++r)
        quantize_row(wtype, row_floats(x, x_type, r, n_per_row, buf.data()), out + r * row_bytes, n_per_row,
                     imatrix);
  };
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, (nrows + chunk - 1) / chunk));
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < parts; ++t) workers.emplace_back(work);
  work();
  for (std::thread& w : workers) w.join();
  return nrows * row_bytes;
}

}  // extern "C"
