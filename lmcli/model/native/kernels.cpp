// lmcli's native CPU products: activations quantized to int8 per block x weights stored in GGUF's
// block layouts (q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K, byte for byte as ggml writes them).
//
// A plain C ABI (loaded with ctypes, see ops.py). The instruction set is picked at run time: each
// SIMD version is the same code (simd_body.inc) compiled under a function target attribute, and
// lmcli_native_supported() asks the CPU. The caller (ops.py) has checked every size: the kernels
// trust n, k, m and the buffers' lengths (rows * k / block * block_bytes).
//
// Integer sums are exact on every path, so the paths differ only in the order of float additions.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LM_X86 1
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#if defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#endif

namespace {

// weight types: GGML's numbers (gguf.GGMLQuantizationType)
enum WType { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
// instruction sets, best last
enum Isa { SCALAR = 0, AVX2 = 1, AVX_VNNI = 2, AVX512_VNNI = 3, NEON_DOT = 4 };

constexpr int QK = 32;    // elements of a 32-value block (q8_0, q4_0, q4_1, q5_0, q5_1; a q8 activation block)
constexpr int QK_K = 256; // elements of a K-quant super-block

// One activation row quantized to int8: per 32-block (d32, s32: scale, sum of the block's q) for
// the 32-value formats, per 256-block (d256, s16: scale, sums of 16-element groups) for the K-quants.
struct ActRow {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  // q4_0/q4_1/q5_0/q5_1 on x86, blocks 2p and 2p + 1 laid out for one register each (pair_layout):
  // the values 0-15 of both, then 16-31 of both (64 bytes); -8 sum(a) in 32-bit lanes 0 and 4; the
  // scales in lanes 0-3 and 4-7 (with AVX512: quad_layout, four blocks). Null for the other formats.
  const int8_t* qp = nullptr;
  const int32_t* ip = nullptr;
  const float* dp = nullptr;
  // q4_K/q5_K on x86: the sums of q over 32-value sub-blocks (8 a super-block). Null otherwise.
  const int32_t* s32 = nullptr;
};

// the 4- and 5-bit formats with AVX512: blocks 4t..4t + 3 laid out for one 512-bit register each
// (quad_layout): the values 0-15 of the four, then 16-31 of the four (128 bytes); -8 sum(a) in
// 32-bit lanes 4i; the scales in lanes 4i..4i + 3 (i: the block of the four). In qp, ip, dp (the
// pair layout's sizes).
void quad_layout(const int8_t* q, const float* d, const int32_t* s, int64_t nb, int8_t* qp, int32_t* ip, float* dp) {
  for (int64_t t = 0; t < nb / 4; ++t) {
    for (int i = 0; i < 4; ++i) {
      const int8_t* a = q + 32 * (4 * t + i);
      std::memcpy(qp + 128 * t + 16 * i, a, 16);       // values 0-15 of block 4t + i
      std::memcpy(qp + 128 * t + 64 + 16 * i, a + 16, 16);  // values 16-31
      for (int l = 0; l < 4; ++l) {
        ip[16 * t + 4 * i + l] = l == 0 ? -8 * s[4 * t + i] : 0;
        dp[16 * t + 4 * i + l] = d[4 * t + i];
      }
    }
  }
}

// the pair layout of one activation row (nb blocks of 32; pairs = nb / 2)
void pair_layout(const int8_t* q, const float* d, const int32_t* s, int64_t nb, int8_t* qp, int32_t* ip, float* dp) {
  for (int64_t p = 0; p < nb / 2; ++p) {
    const int8_t* a = q + 64 * p;  // blocks 2p (a[0:32]) and 2p + 1 (a[32:64])
    int8_t* o = qp + 64 * p;
    std::memcpy(o, a, 16);            // values 0-15 of block 2p
    std::memcpy(o + 16, a + 32, 16);  // values 0-15 of block 2p + 1
    std::memcpy(o + 32, a + 16, 16);  // values 16-31 of block 2p
    std::memcpy(o + 48, a + 48, 16);  // values 16-31 of block 2p + 1
    for (int l = 0; l < 8; ++l) {
      ip[8 * p + l] = l == 0 ? -8 * s[2 * p] : l == 4 ? -8 * s[2 * p + 1] : 0;
      dp[8 * p + l] = d[2 * p + l / 4];
    }
  }
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// IEEE half -> float, exact (every half is a float)
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    const float f = std::ldexp((float)man, -24);  // zero or subnormal
    return sign ? -f : f;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// the 6-bit scale and min of sub-block j (0..7) of a q4_K/q5_K super-block (ggml's get_scale_min_k4)
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// ---------------------------------------------------------------- activation quantization

inline int8_t round_q(float v) {
  if (!(v == v)) v = 0.0f;  // NaN
  v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
  return (int8_t)std::nearbyintf(v);  // nearest, ties to even
}

// x (k) -> q (k), d (k / block), and the sums of q over `sum_block`-element groups (k / sum_block)
void quantize_act(const float* x, int64_t k, int block, int sum_block, int8_t* q, float* d, int32_t* s) {
  for (int64_t b = 0; b < k / block; ++b) {
    const float* xb = x + b * block;
    float amax = 0.0f;
    for (int i = 0; i < block; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    d[b] = db;
    for (int i = 0; i < block; ++i) q[b * block + i] = round_q(xb[i] * id);
  }
  for (int64_t g = 0; g < k / sum_block; ++g) {
    int32_t acc = 0;
    for (int i = 0; i < sum_block; ++i) acc += q[g * sum_block + i];
    s[g] = acc;
  }
}

// ---------------------------------------------------------------- scalar dot products

// one weight row (nb blocks) . one activation row
float dot1_q8_0_scalar(const uint8_t* w, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 34;
    const int8_t* wq = (const int8_t*)(blk + 2);
    const int8_t* aq = a.q + b * QK;
    int32_t isum = 0;
    for (int i = 0; i < QK; ++i) isum += wq[i] * aq[i];
    acc += fp16_to_fp32(load_u16(blk)) * a.d[b] * (float)isum;
  }
  return acc;
}

float dot1_q4_0_scalar(const uint8_t* w, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 18;
    const uint8_t* qs = blk + 2;
    const int8_t* aq = a.q + b * QK;
    int32_t isum = 0;
    for (int i = 0; i < 16; ++i) isum += (qs[i] & 0xF) * aq[i] + (qs[i] >> 4) * aq[i + 16];
    isum -= 8 * a.s[b];  // (q - 8) . a
    acc += fp16_to_fp32(load_u16(blk)) * a.d[b] * (float)isum;
  }
  return acc;
}

// q4_1 (fp16 d, fp16 m, 16 bytes of nibbles): w = d q + m, so w . a = d (q . a) + m sum(a)
float dot1_q4_1_scalar(const uint8_t* w, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 20;
    const uint8_t* qs = blk + 4;
    const int8_t* aq = a.q + b * QK;
    int32_t isum = 0;
    for (int i = 0; i < 16; ++i) isum += (qs[i] & 0xF) * aq[i] + (qs[i] >> 4) * aq[i + 16];
    const float da = a.d[b];
    acc += da * fp16_to_fp32(load_u16(blk)) * (float)isum + da * fp16_to_fp32(load_u16(blk + 2)) * (float)a.s[b];
  }
  return acc;
}

// the 5-bit values of a q5_0/q5_1 block: element i's fifth bit is bit i of the 32-bit word qh
// (elements 0-15 in the low nibbles of qs, 16-31 in the high ones)
inline int32_t q5_dot(const uint8_t* qh4, const uint8_t* qs, const int8_t* aq) {
  const uint32_t qh = load_u32(qh4);
  int32_t isum = 0;
  for (int i = 0; i < 16; ++i) {
    const int lo = (qs[i] & 0xF) | (int)(((qh >> i) & 1) << 4);
    const int hi = (qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4);
    isum += lo * aq[i] + hi * aq[i + 16];
  }
  return isum;
}

// q5_0 (fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles): w = d (q - 16)
float dot1_q5_0_scalar(const uint8_t* w, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 22;
    const int32_t isum = q5_dot(blk + 2, blk + 6, a.q + b * QK) - 16 * a.s[b];
    acc += fp16_to_fp32(load_u16(blk)) * a.d[b] * (float)isum;
  }
  return acc;
}

// q5_1 (fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes of nibbles): w = d q + m
float dot1_q5_1_scalar(const uint8_t* w, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 24;
    const int32_t isum = q5_dot(blk + 4, blk + 8, a.q + b * QK);
    const float da = a.d[b];
    acc += da * fp16_to_fp32(load_u16(blk)) * (float)isum + da * fp16_to_fp32(load_u16(blk + 2)) * (float)a.s[b];
  }
  return acc;
}

// q4_K and q5_K (`high`: each value's fifth bit in qh, 32 bytes before the nibbles)
template <bool high>
float dot1_k45_scalar(const uint8_t* w, const ActRow& a, int64_t nb) {
  constexpr int bytes = high ? 176 : 144;
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (high ? 48 : 16);
    const int8_t* aq = a.q + b * QK_K;
    const int32_t* bs = a.s + b * 16;
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(j, blk + 4, &sc, &mn);
      const uint8_t* q = qs + (j / 2) * 32;
      const int shift = (j % 2) * 4;
      int32_t s = 0;
      for (int l = 0; l < 32; ++l) {
        const int v = ((q[l] >> shift) & 0xF) | (high ? ((qh[l] >> j) & 1) << 4 : 0);
        s += v * aq[j * 32 + l];
      }
      isum += sc * s;
      msum += mn * (bs[2 * j] + bs[2 * j + 1]);
    }
    const float da = a.d[b];
    acc += da * fp16_to_fp32(load_u16(blk)) * (float)isum - da * fp16_to_fp32(load_u16(blk + 2)) * (float)msum;
  }
  return acc;
}

float dot1_q4_K_scalar(const uint8_t* w, const ActRow& a, int64_t nb) { return dot1_k45_scalar<false>(w, a, nb); }
float dot1_q5_K_scalar(const uint8_t* w, const ActRow& a, int64_t nb) { return dot1_k45_scalar<true>(w, a, nb); }

float dot1_q6_K_scalar(const uint8_t* w, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    const int8_t* sc = (const int8_t*)(blk + 192);
    const int8_t* aq = a.q + b * QK_K;
    const int32_t* bs = a.s + b * 16;
    int32_t isum = 0;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = blk + 64 * h;
      const uint8_t* qh = blk + 128 + 32 * h;
      for (int l = 0; l < 32; ++l) {
        const int e = 128 * h + l;
        const int q1 = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
        const int q2 = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
        const int q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        const int q4 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        isum += sc[e / 16] * q1 * aq[e] + sc[(e + 32) / 16] * q2 * aq[e + 32] +
                sc[(e + 64) / 16] * q3 * aq[e + 64] + sc[(e + 96) / 16] * q4 * aq[e + 96];
      }
    }
    int32_t corr = 0;  // the -32 offset: 32 * sum_g sc_g * sum(a_g)
    for (int g = 0; g < 16; ++g) corr += sc[g] * bs[g];
    acc += a.d[b] * fp16_to_fp32(load_u16(blk + 208)) * (float)(isum - 32 * corr);
  }
  return acc;
}

constexpr int64_t block_bytes(int wtype) {
  switch (wtype) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

// ---------------------------------------------------------------- dequantizing (a prompt's GEMM)
//
// A prompt's product is the weight dequantized to bfloat16, a slice of rows at a time, times the
// activations in one bfloat16 GEMM (torch's, ops.BoundProduct.gemm): the values are gguf's
// dequantize_blocks, float32 operation for operation (no FMA: -ffp-contract is off under
// -std=c++17), rounded to bfloat16 as torch rounds (nearest, ties to even; a NaN 0x7FC0). This is
// the scalar path (and NEON's: aarch64's baseline vectorizes these loops); the x86 paths unpack
// each format in registers (simd_body.inc: dequantize), with the same float operations.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : (uint16_t)r;
}

// block `blk` of format T -> its values v (32, or 256 for the K-quants)
// (A compiler may contract `d * q + m` into an FMA (GCC does on aarch64): no value changes, since
// every product here is exact in float32: an fp16 scale (11 significant bits) times a sub-scale
// (6 bits for q4_K/q5_K, 7 for q6_K) times a value (at most 6 bits) has at most 24 bits.)
template <int T>
void dequant_block(const uint8_t* blk, float* v) {
  const auto half = [](const uint8_t* p) { return fp16_to_fp32(load_u16(p)); };
  if (T == Q8_0) {
    const float d = half(blk);
    for (int i = 0; i < QK; ++i) v[i] = (float)(int8_t)blk[2 + i] * d;
  } else if (T == Q4_0 || T == Q4_1) {
    const uint8_t* qs = blk + (T == Q4_0 ? 2 : 4);
    const float d = half(blk), m = T == Q4_1 ? half(blk + 2) : 0.0f;
    for (int i = 0; i < 16; ++i) {
      const int lo = qs[i] & 0xF, hi = qs[i] >> 4;
      if (T == Q4_0) {
        v[i] = d * (float)(lo - 8), v[i + 16] = d * (float)(hi - 8);
      } else {
        v[i] = d * (float)lo + m, v[i + 16] = d * (float)hi + m;
      }
    }
  } else if (T == Q5_0 || T == Q5_1) {
    const uint8_t* qh4 = blk + (T == Q5_0 ? 2 : 4);
    const uint8_t* qs = qh4 + 4;
    const uint32_t qh = load_u32(qh4);
    const float d = half(blk), m = T == Q5_1 ? half(blk + 2) : 0.0f;
    for (int i = 0; i < 16; ++i) {
      const int lo = (qs[i] & 0xF) | (int)(((qh >> i) & 1) << 4);
      const int hi = (qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4);
      if (T == Q5_0) {
        v[i] = d * (float)(lo - 16), v[i + 16] = d * (float)(hi - 16);
      } else {
        v[i] = d * (float)lo + m, v[i + 16] = d * (float)hi + m;
      }
    }
  } else if (T == Q4_K || T == Q5_K) {
    const float d = half(blk), dmin = half(blk + 2);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (T == Q5_K ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(j, blk + 4, &sc, &mn);
      const float ds = d * (float)sc, dm = dmin * (float)mn;
      const uint8_t* q = qs + (j / 2) * 32;
      const int shift = (j % 2) * 4;
      for (int l = 0; l < 32; ++l) {
        int x = (q[l] >> shift) & 0xF;
        if (T == Q5_K) x |= ((qh[l] >> j) & 1) << 4;
        v[32 * j + l] = ds * (float)x - dm;
      }
    }
  } else {  // Q6_K: element 128 h + 32 s + l from ql[64 h + 32 (s % 2) + l] and qh[32 h + l]
    const int8_t* sc = (const int8_t*)(blk + 192);
    const float d = half(blk + 208);
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 4; ++s) {
        const uint8_t* ql = blk + 64 * h + 32 * (s % 2);
        const uint8_t* qh = blk + 128 + 32 * h;
        const float ds0 = d * (float)sc[8 * h + 2 * s], ds1 = d * (float)sc[8 * h + 2 * s + 1];
        for (int l = 0; l < 32; ++l) {
          const int x = (((ql[l] >> (4 * (s / 2))) & 0xF) | (((qh[l] >> (2 * s)) & 3) << 4)) - 32;
          v[128 * h + 32 * s + l] = (l < 16 ? ds0 : ds1) * (float)x;
        }
      }
    }
  }
}

// `count` consecutive blocks of format T -> count * block bfloat16 values
template <int T>
void dequant_blocks(const uint8_t* w, int64_t count, uint16_t* out) {
  constexpr int B = (T == Q4_K || T == Q5_K || T == Q6_K) ? QK_K : QK;
  constexpr int64_t bytes = block_bytes(T);
  alignas(64) float v[B];
  for (int64_t i = 0; i < count; ++i) {
    dequant_block<T>(w + i * bytes, v);
    for (int l = 0; l < B; ++l) out[i * B + l] = bf16_bits(v[l]);
  }
}

void dequantize_scalar(int wtype, const uint8_t* w, int64_t count, uint16_t* out) {
  switch (wtype) {
    case Q8_0: return dequant_blocks<Q8_0>(w, count, out);
    case Q4_0: return dequant_blocks<Q4_0>(w, count, out);
    case Q4_1: return dequant_blocks<Q4_1>(w, count, out);
    case Q5_0: return dequant_blocks<Q5_0>(w, count, out);
    case Q5_1: return dequant_blocks<Q5_1>(w, count, out);
    case Q4_K: return dequant_blocks<Q4_K>(w, count, out);
    case Q5_K: return dequant_blocks<Q5_K>(w, count, out);
    case Q6_K: return dequant_blocks<Q6_K>(w, count, out);
    default: return;
  }
}

// a product of R rows, `one` row at a time (the scalar and NEON versions)
using Dot1 = float (*)(const uint8_t*, const ActRow&, int64_t);
template <Dot1 one, int R>
void rows(const uint8_t* w, const ActRow* a, int64_t nb, float* out) {
  for (int r = 0; r < R; ++r) out[r] = one(w, a[r], nb);
}

// ---------------------------------------------------------------- SIMD versions

#if defined(LM_X86)
#define LM_AVX512 0
namespace avx2 {
#define LM_TARGET __attribute__((target("avx2,fma,f16c")))
#define LM_DOT(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define LM_VNNI 0
#include "simd_body.inc"
#undef LM_TARGET
#undef LM_DOT
#undef LM_VNNI
}  // namespace avx2
namespace avxvnni {
#define LM_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define LM_DOT(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#define LM_VNNI 1
#include "simd_body.inc"
#undef LM_TARGET
#undef LM_DOT
#undef LM_VNNI
}  // namespace avxvnni
#undef LM_AVX512
namespace avx512vnni {  // the EVEX (AVX512-VNNI + VL) vpdpbusd on 256-bit registers (q4_0: 512-bit)
#define LM_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define LM_DOT(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define LM_VNNI 1
#define LM_AVX512 1
#include "simd_body.inc"
#undef LM_TARGET
#undef LM_DOT
#undef LM_VNNI
#undef LM_AVX512
}  // namespace avx512vnni
#endif

#if defined(__aarch64__)
#include "neon_body.inc"
#endif

bool isa_supported(int isa) {
  switch (isa) {
    case SCALAR:
      return true;
#if defined(LM_X86)
    case AVX2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case AVX_VNNI:
      return isa_supported(AVX2) && __builtin_cpu_supports("avxvnni");
    case AVX512_VNNI:
      return isa_supported(AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
#endif
#if defined(__aarch64__)
    case NEON_DOT:
      return neon::has_dotprod();
#endif
    default:
      return false;
  }
}

// one weight row . R activation rows -> out[R]
using DotFn = void (*)(const uint8_t*, const ActRow*, int64_t, float*);
using QuantFn = void (*)(const float*, int64_t, int, int, int8_t*, float*, int32_t*);

struct Kernels {
  DotFn dot1, dot4;  // one row, four rows
  QuantFn quantize;
};

Kernels pick(int wtype, int isa) {
#if defined(LM_X86)
  if (isa == AVX2 || isa == AVX_VNNI || isa == AVX512_VNNI) {
    switch (isa * 100 + wtype) {
#define LM_X86_ISA(ns, i)                            \
  case i * 100 + Q8_0: return {ns::dot_q8_0, ns::dot4_q8_0, ns::quantize}; \
  case i * 100 + Q4_0: return {ns::dot_q4_0, ns::dot4_q4_0, ns::quantize}; \
  case i * 100 + Q4_1: return {ns::dot_q4_1, ns::dot4_q4_1, ns::quantize}; \
  case i * 100 + Q5_0: return {ns::dot_q5_0, ns::dot4_q5_0, ns::quantize}; \
  case i * 100 + Q5_1: return {ns::dot_q5_1, ns::dot4_q5_1, ns::quantize}; \
  case i * 100 + Q4_K: return {ns::dot_q4_K, ns::dot4_q4_K, ns::quantize}; \
  case i * 100 + Q5_K: return {ns::dot_q5_K, ns::dot4_q5_K, ns::quantize}; \
  case i * 100 + Q6_K: return {ns::dot_q6_K, ns::dot4_q6_K, ns::quantize};
      LM_X86_ISA(avx2, AVX2)
      LM_X86_ISA(avxvnni, AVX_VNNI)
      LM_X86_ISA(avx512vnni, AVX512_VNNI)
#undef LM_X86_ISA
      default: return {nullptr, nullptr, nullptr};
    }
  }
#endif
#if defined(__aarch64__)
  if (isa == NEON_DOT) {
    switch (wtype) {
      case Q8_0: return {rows<neon::dot_q8_0, 1>, rows<neon::dot_q8_0, 4>, quantize_act};
      case Q4_0: return {rows<neon::dot_q4_0, 1>, rows<neon::dot_q4_0, 4>, quantize_act};
      case Q4_1: return {rows<neon::dot_q4_1, 1>, rows<neon::dot_q4_1, 4>, quantize_act};
      case Q5_0: return {rows<neon::dot_q5_0, 1>, rows<neon::dot_q5_0, 4>, quantize_act};
      case Q5_1: return {rows<neon::dot_q5_1, 1>, rows<neon::dot_q5_1, 4>, quantize_act};
      case Q4_K: return {rows<neon::dot_q4_K, 1>, rows<neon::dot_q4_K, 4>, quantize_act};
      case Q5_K: return {rows<neon::dot_q5_K, 1>, rows<neon::dot_q5_K, 4>, quantize_act};
      case Q6_K: return {rows<neon::dot_q6_K, 1>, rows<neon::dot_q6_K, 4>, quantize_act};
      default: return {nullptr, nullptr, nullptr};
    }
  }
#endif
  switch (wtype) {
    case Q8_0: return {rows<dot1_q8_0_scalar, 1>, rows<dot1_q8_0_scalar, 4>, quantize_act};
    case Q4_0: return {rows<dot1_q4_0_scalar, 1>, rows<dot1_q4_0_scalar, 4>, quantize_act};
    case Q4_1: return {rows<dot1_q4_1_scalar, 1>, rows<dot1_q4_1_scalar, 4>, quantize_act};
    case Q5_0: return {rows<dot1_q5_0_scalar, 1>, rows<dot1_q5_0_scalar, 4>, quantize_act};
    case Q5_1: return {rows<dot1_q5_1_scalar, 1>, rows<dot1_q5_1_scalar, 4>, quantize_act};
    case Q4_K: return {rows<dot1_q4_K_scalar, 1>, rows<dot1_q4_K_scalar, 4>, quantize_act};
    case Q5_K: return {rows<dot1_q5_K_scalar, 1>, rows<dot1_q5_K_scalar, 4>, quantize_act};
    case Q6_K: return {rows<dot1_q6_K_scalar, 1>, rows<dot1_q6_K_scalar, 4>, quantize_act};
    default: return {nullptr, nullptr, nullptr};
  }
}

// blocks -> bfloat16 values: `count` consecutive blocks of `wtype`, block * count values
using DequantFn = void (*)(int, const uint8_t*, int64_t, uint16_t*);

DequantFn pick_dequantize(int isa) {
#if defined(LM_X86)
  if (isa == AVX2) return avx2::dequantize;
  if (isa == AVX_VNNI) return avxvnni::dequantize;
  if (isa == AVX512_VNNI) return avx512vnni::dequantize;
#endif
  (void)isa;
  return dequantize_scalar;  // (and NEON's)
}

// ---------------------------------------------------------------- threads

// A small pool: the caller's thread runs part 0, n - 1 workers the rest. Workers spin a moment
// after a job (a decode step calls ~7 products a layer back to back), then sleep.
class Pool {
 public:
  void run(int n, const std::function<void(int, int)>& fn) {
    if (n <= 1) {
      fn(0, 1);
      return;
    }
    std::lock_guard<std::mutex> busy(run_mu_);  // one product at a time (two Python threads may call)
    while ((int)workers_.size() < n - 1) {
      const int idx = (int)workers_.size() + 1;
      workers_.emplace_back([this, idx] { loop(idx); });
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &fn;
      parts_ = n;
      pending_.store(n - 1);
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    fn(0, n);
    while (pending_.load(std::memory_order_acquire) > 0) std::this_thread::yield();
  }

 private:
  void loop(int idx) {
    uint64_t seen = 0;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spin = 0; gen_.load(std::memory_order_acquire) == seen; ++spin) {
        if ((spin & 255) == 255 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(300)) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return gen_.load() != seen; });
          break;
        }
        std::this_thread::yield();
      }
      const std::function<void(int, int)>* job;
      int parts;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = gen_.load();
        job = job_;
        parts = parts_;
      }
      if (idx < parts) {
        (*job)(idx, parts);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int, int)>* job_ = nullptr;
  int parts_ = 0;
};

// one pool per process (a forked child gets a fresh one: the parent's threads are not in it);
// never destroyed, so no worker is joined while the interpreter exits
Pool& pool() {
  static std::mutex mu;
  static Pool* p = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (p == nullptr || owner != getpid()) {
    p = new Pool();
    owner = getpid();
  }
  return *p;
}

// A product's activation copies (int8 rows, scales, sums, q4_0's pair layout): one buffer a
// calling thread, grown as needed and kept, so a decode step's products neither allocate nor
// zero-fill. `reserve` lays out parts of the given byte sizes, each 64-byte aligned.
class Scratch {
 public:
  static constexpr int kParts = 7;
  void reserve(std::initializer_list<int64_t> bytes) {
    size_t total = 0, i = 0;
    for (const int64_t b : bytes) {
      offsets_[i++] = total;
      total += ((size_t)b + 63) / 64 * 64;
    }
    if (total > size_) {
      buf_.reset(new uint8_t[total + 64]);
      size_ = total;
    }
    base_ = buf_.get() + (64 - (uintptr_t)buf_.get() % 64) % 64;
  }
  template <class T>
  T* part(int i) const {
    return (T*)(base_ + offsets_[i]);
  }

 private:
  std::unique_ptr<uint8_t[]> buf_;
  size_t size_ = 0;
  uint8_t* base_ = nullptr;
  size_t offsets_[kParts] = {};
};

Scratch& thread_scratch() {
  static thread_local Scratch scratch;
  return scratch;
}

bool k_quant(int wtype) { return wtype == Q4_K || wtype == Q5_K || wtype == Q6_K; }


}  // namespace

extern "C" {

int lmcli_native_version() { return 1; }

int lmcli_native_supported(int isa) { return isa_supported(isa) ? 1 : 0; }

// how many distinct threads ran the parts of a `threads`-part job (the pool's own check)
int lmcli_native_pool_threads(int threads) {
  std::vector<std::thread::id> ids((size_t)std::max(threads, 1));
  pool().run(std::max(threads, 1), [&](int t, int) { ids[(size_t)t] = std::this_thread::get_id(); });
  std::sort(ids.begin(), ids.end());
  return (int)(std::unique(ids.begin(), ids.end()) - ids.begin());
}

// y (m, n) = x (m, k) . w (n, k)^T, w as n rows of k / block elements in GGUF block layout `wtype`.
// Returns 0, or -1 for an unknown type, instruction set or size (sizes are checked by the caller).
int lmcli_native_matmul(int wtype, const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t m, float* y,
                        int threads, int isa) {
  const int block = k_quant(wtype) ? QK_K : QK;
  const int sum_block = k_quant(wtype) ? 16 : QK;
  const int64_t bb = block_bytes(wtype);
  if (bb == 0 || !isa_supported(isa) || n < 0 || m < 0 || k <= 0 || k % block != 0) return -1;
  const Kernels kern = pick(wtype, isa);
  const int64_t nb = k / block;
  const int64_t row_bytes = nb * bb;

  const bool x86 = isa == AVX2 || isa == AVX_VNNI || isa == AVX512_VNNI;
  const bool paired = wtype == Q4_0 || wtype == Q4_1 || wtype == Q5_0 || wtype == Q5_1;
  const int64_t np = paired && x86 ? nb / 2 : 0;  // the 4- and 5-bit formats' pair layout
  const bool subs = (wtype == Q4_K || wtype == Q5_K) && x86;  // 32-value sums for q4_K/q5_K
  Scratch& scratch = thread_scratch();
  scratch.reserve({m * k, 4 * m * nb, 4 * m * (k / sum_block), m * np * 64, 4 * m * np * 8, 4 * m * np * 8,
                   subs ? 4 * m * (k / QK) : 0});
  int8_t* const q = scratch.part<int8_t>(0);
  float* const d = scratch.part<float>(1);
  int32_t* const s = scratch.part<int32_t>(2);
  int8_t* const qp = scratch.part<int8_t>(3);
  int32_t* const ip = scratch.part<int32_t>(4);
  float* const dp = scratch.part<float>(5);
  int32_t* const s32 = scratch.part<int32_t>(6);
  for (int64_t i = 0; i < m; ++i)
    kern.quantize(x + i * k, k, block, sum_block, q + i * k, d + i * nb, s + i * (k / sum_block));
  const bool quads = paired && isa == AVX512_VNNI;
  for (int64_t i = 0; i < m && np > 0; ++i)
    (quads ? quad_layout : pair_layout)(q + i * k, d + i * nb, s + i * nb, nb, qp + i * np * 64,
                ip + i * np * 8, dp + i * np * 8);
  for (int64_t g = 0; subs && g < m * (k / QK); ++g) s32[g] = s[2 * g] + s[2 * g + 1];

  // rows of activations taken together: their int8 copies stay in L2 while weight rows stream by
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(m, (256 * 1024) / k));
  if (threads < 1) threads = 1;
  if (threads > n) threads = (int)std::max<int64_t>(1, n);
  auto part = [&](int t, int parts) {
    const int64_t lo = n * t / parts, hi = n * (t + 1) / parts;
    for (int64_t m0 = 0; m0 < m; m0 += tile) {
      const int64_t m1 = std::min(m, m0 + tile);
      for (int64_t j = lo; j < hi; ++j) {
        const uint8_t* wr = w + j * row_bytes;
        for (int64_t i = m0; i < m1;) {
          const int r = m1 - i >= 4 ? 4 : 1;
          ActRow a[4];
          float out[4];
          for (int t = 0; t < r; ++t) {
            const int64_t row = i + t;
            a[t] = {q + row * k, d + row * nb, s + row * (k / sum_block)};
            if (np > 0) a[t].qp = qp + row * np * 64, a[t].ip = ip + row * np * 8, a[t].dp = dp + row * np * 8;
            if (subs) a[t].s32 = s32 + row * (k / QK);
          }
          (r == 4 ? kern.dot4 : kern.dot1)(wr, a, nb, out);
          for (int t = 0; t < r; ++t) y[(i + t) * n + j] = out[t];
          i += r;
        }
      }
    }
  };
  if (threads == 1)
    part(0, 1);  // (no pool: pool() asks getpid, a system call, to tell a forked child)
  else
    pool().run(threads, part);
  return 0;
}

// w (n, k) in GGUF block layout `wtype` -> out (n, k) bfloat16 (as uint16 bits), `threads`
// parts of the rows. Returns 0, or -1 for an unknown type, instruction set or size.
int lmcli_native_dequantize(int wtype, const uint8_t* w, int64_t n, int64_t k, uint16_t* out, int threads,
                            int isa) {
  const int block = k_quant(wtype) ? QK_K : QK;
  const int64_t bb = block_bytes(wtype);
  if (bb == 0 || !isa_supported(isa) || n < 0 || k <= 0 || k % block != 0) return -1;
  const DequantFn fn = pick_dequantize(isa);
  const int64_t nb = k / block;
  if (threads < 1) threads = 1;
  if (threads > n) threads = (int)std::max<int64_t>(1, n);
  auto part = [&](int t, int parts) {
    const int64_t lo = n * t / parts, hi = n * (t + 1) / parts;
    fn(wtype, w + lo * nb * bb, (hi - lo) * nb, out + lo * k);
  };
  if (threads == 1)
    part(0, 1);
  else
    pool().run(threads, part);
  return 0;
}

}  // extern "C"

#include "layer.inc"
