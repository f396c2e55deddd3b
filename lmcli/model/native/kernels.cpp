// lmcli's native CPU products: activations quantized to int8 per block x weights stored in GGUF's
// block layouts (formats.h: every format, byte for byte as ggml writes it), and a whole block's
// decoding step (layer.inc).
//
// A plain C ABI (abi.h; loaded with ctypes, see ops.py and abi.py). The instruction set is picked
// at run time: each SIMD version is the same code (simd_body.inc) compiled under a function target
// attribute, and lmcli_native_supported() asks the CPU; each instruction set has one table of
// kernels, a row a format (Kernels). The caller (ops.py) has checked every size: the kernels trust
// n, k, m and the buffers' lengths (rows * k / block * block_bytes).
//
// Integer sums are exact on every path, so the paths differ only in the order of float additions.
// The parts, by job: scalar.inc (block fields, activation rows, the portable products),
// dequant.inc (the portable dequantizers), simd_*.inc (x86), neon_body.inc (aarch64),
// threads.inc (the pool, scratch memory), layer.inc and layer_math.inc (the one-call step).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cfloat>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#include <unistd.h>

#include "abi.h"
#include "formats.h"

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

using namespace lmfmt;
using namespace lmabi;

#include "scalar.inc"
#include "dequant.inc"
#include "float_rows.inc"

// one weight row . R activation rows -> out[R]
using DotFn = void (*)(const uint8_t*, const ActRow*, int64_t, float*);
using QuantFn = void (*)(const float*, int64_t, int, int, int8_t*, float*, int32_t*);
// `count` consecutive blocks -> block * count bfloat16 values
using DequantFn = void (*)(const uint8_t*, int64_t, uint16_t*);
// a float format's weight row of k values . R float32 activation rows -> out[R]
using FloatDotFn = void (*)(const uint8_t*, const float* const*, int64_t, float*);

// the activation copies a product reads beyond q, d, s (ActRow), flags: the pair or quad layout of
// its 32-value groups or the halves layout of its 256-value blocks (scalar.inc), the sums over 32 values
enum Layout { PLAIN = 0, PAIRS = 1, QUADS = 2, SUMS32 = 4, HALVES = 8 };

// one instruction set's kernels for one format (all null: none). A block format has the first
// four (its activations rounded to int8 first); a float format (f32, f16, bf16) the last two.
struct Kernels {
  DotFn dot1 = nullptr, dot4 = nullptr;  // one activation row, four
  QuantFn quantize = nullptr;
  DequantFn dequantize = nullptr;
  int layout = PLAIN;
  FloatDotFn fdot1 = nullptr, fdot4 = nullptr;  // a float weight row . one float32 row, four

  bool multiplies() const { return dot1 != nullptr || fdot1 != nullptr; }
};

// a float format's kernels: its products of one and four activation rows
constexpr Kernels float_kernels(FloatDotFn one, FloatDotFn four) {
  Kernels k;
  k.fdot1 = one, k.fdot4 = four;
  return k;
}

namespace scalar {  // the portable kernels (scalar.inc, dequant.inc): the scalar instruction set's
template <int T>
constexpr Kernels kernels_of() {
  if constexpr (block_values(T) == 1)
    return float_kernels(float_dot<T, 1>, float_dot<T, 4>);
  else
    return Kernels{rows<scalar::dot1<T>, 1>, rows<scalar::dot1<T>, 4>, quantize_act, scalar::dequant<T>, PLAIN};
}

const Kernels kTable[] = {
#define LM_KERNELS_ROW(e, t, n, s, b) kernels_of<t>(),
    LM_FORMAT_LIST(LM_KERNELS_ROW)
#undef LM_KERNELS_ROW
};
}  // namespace scalar

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
namespace avx512vnni {  // the EVEX (AVX512-VNNI + VL) vpdpbusd on 256-bit registers (the nibble formats: 512-bit)
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

// the kernels table of an instruction set (one the CPU runs: the caller asked isa_supported)
const Kernels* table(int isa) {
  switch (isa) {
#if defined(LM_X86)
    case AVX2: return avx2::kTable;
    case AVX_VNNI: return avxvnni::kTable;
    case AVX512_VNNI: return avx512vnni::kTable;
#endif
#if defined(__aarch64__)
    case NEON_DOT: return neon::kTable;
#endif
    default: return scalar::kTable;
  }
}

// the kernels of format `wtype` on `isa`, or null for an unknown type or instruction set
const Kernels* pick(int wtype, int isa) {
  const int i = format_index(wtype);
  return i < 0 || !isa_supported(isa) ? nullptr : &table(isa)[i];
}

#include "threads.inc"

// the sums of an activation row: per 32 values for the 32-value formats, per 16 for the 256-value ones
constexpr int sum_block(int block) { return block == QK_K ? 16 : QK; }

// a product's activation copies for m rows of k values, as format `block`'s kernels read them
ActCopies act_copies(int64_t m, int64_t k, int block, int layout) {
  const int64_t np = layout & (PAIRS | QUADS) ? k / QK / 2 : 0;  // the pairs (quads' sizes too)
  const int64_t lanes = block == QK ? 8 * np : 0;                 // ip, dp: the 32-value formats'
  ActCopies c;
  c.q.per_row = k, c.d.per_row = k / block, c.s.per_row = k / sum_block(block);
  c.qp.per_row = layout & (PAIRS | QUADS | HALVES) ? k : 0;  // (each layout a permutation of q)
  c.ip.per_row = lanes, c.dp.per_row = lanes;
  c.s32.per_row = layout & SUMS32 ? k / QK : 0;
  c.place(thread_scratch(), m);
  return c;
}

// x (m, k) float32 -> the rounded rows and the layouts `kern` reads
void quantize_rows(const Kernels& kern, const float* x, int64_t m, int64_t k, int block, const ActCopies& c) {
  const int64_t nb = k / block, groups = k / QK;
  for (int64_t i = 0; i < m; ++i) {
    kern.quantize(x + i * k, k, block, sum_block(block), c.q.row(i), c.d.row(i), c.s.row(i));
    if (c.ip.per_row > 0)  // the 32-value formats: values, offsets and scales
      (kern.layout & QUADS ? quad_layout : pair_layout)(c.q.row(i), c.d.row(i), c.s.row(i), nb, c.qp.row(i),
                                                        c.ip.row(i), c.dp.row(i));
    else if (kern.layout & QUADS)
      quad_values(c.q.row(i), groups / 4, c.qp.row(i));
    else if (kern.layout & PAIRS)
      pair_values(c.q.row(i), groups / 2, c.qp.row(i));
    else if (kern.layout & HALVES)
      halves_values(c.q.row(i), k / QK_K, c.qp.row(i));
    for (int64_t g = 0; g < groups && c.s32.per_row > 0; ++g)
      c.s32.row(i)[g] = c.s.row(i)[2 * g] + c.s.row(i)[2 * g + 1];
  }
}

// y (m, n) = x (m, k) . w (n, k)^T for a float format's rows of `row_bytes`: each thread's weight
// rows in turn, four activation rows at a time (a weight row loaded once for the four), so a
// batched product equals its rows' one at a time exactly
int float_matmul(const Kernels& kern, const uint8_t* w, int64_t n, int64_t row_bytes, int64_t k, const float* x,
                 int64_t m, float* y, int threads) {
  run_parts(threads, n, [&](int t, int parts) {
    const int64_t lo = n * t / parts, hi = n * (t + 1) / parts;
    for (int64_t j = lo; j < hi; ++j) {
      const uint8_t* wr = w + j * row_bytes;
      for (int64_t i = 0; i < m;) {
        const int r = m - i >= 4 ? 4 : 1;
        const float* rows[4] = {x + i * k, x + std::min(i + 1, m - 1) * k, x + std::min(i + 2, m - 1) * k,
                                x + std::min(i + 3, m - 1) * k};
        float out[4];
        (r == 4 ? kern.fdot4 : kern.fdot1)(wr, rows, k, out);
        for (int s = 0; s < r; ++s) y[(i + s) * n + j] = out[s];
        i += r;
      }
    }
  });
  return 0;
}

// rows ids[0..n-1] of a weight of format T (rows of row_bytes, k values) -> out (n, k) float32:
// gguf's values, float32 operation for operation (dequant.inc)
template <int T>
void rows_f32(const uint8_t* w, int64_t row_bytes, int64_t k, const int64_t* ids, int64_t n, float* out) {
  constexpr int B = block_values(T);
  if constexpr (B > 1)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t b = 0; b < k / B; ++b)
        scalar::dequant_block<T>(w + ids[i] * row_bytes + b * block_bytes(T), out + i * k + b * B);
}
using RowsFn = void (*)(const uint8_t*, int64_t, int64_t, const int64_t*, int64_t, float*);
const RowsFn kRowsF32[] = {
#define LM_ROWS_ROW(e, t, n, s, b) block_values(t) > 1 ? rows_f32<t> : nullptr,
    LM_FORMAT_LIST(LM_ROWS_ROW)
#undef LM_ROWS_ROW
};

}  // namespace

extern "C" {

// bumped whenever the ABI (abi.h, the functions below) changes; Python checks it (abi.VERSION)
int lmcli_native_version() { return 3; }

int lmcli_native_supported(int isa) { return isa_supported(isa) ? 1 : 0; }

// the best instruction set this CPU runs (abi.h's kIsaPreference)
int lmcli_native_best_isa() {
  for (const Isa isa : kIsaPreference)
    if (isa_supported(isa)) return isa;
  return SCALAR;
}

// name i of list `list` (lmabi::NameList: instruction sets, activations, cache types), or null past the end
const char* lmcli_native_name(int list, int i) {
#define LM_NAME_ROW(e, name) name,
  static const char* const isas[] = {LM_ISA_LIST(LM_NAME_ROW)};
  static const char* const acts[] = {LM_ACT_LIST(LM_NAME_ROW)};
  static const char* const caches[] = {LM_CACHE_LIST(LM_NAME_ROW)};
#undef LM_NAME_ROW
  if (i < 0) return nullptr;
  if (list == NAMES_ISA) return i < kIsaCount ? isas[i] : nullptr;
  if (list == NAMES_ACT) return i < kActCount ? acts[i] : nullptr;
  if (list == NAMES_CACHE) return i < kCacheCount ? caches[i] : nullptr;
  return nullptr;
}

// entry i of the ABI structures' layout: (struct, "", 0, sizeof struct) then (struct, field,
// offsetof, sizeof field) for each field of abi.h's LM_ABI_FIELDS. Returns 0, or -1 past the end.
int lmcli_native_field(int i, const char** type, const char** field, int64_t* offset, int64_t* size) {
  struct Row {
    const char *type, *field;
    int64_t offset, size;
  };
  static const Row rows[] = {
#define LM_STRUCT_ROW(s) {#s, "", 0, (int64_t)sizeof(s)},
      LM_ABI_STRUCTS(LM_STRUCT_ROW)
#undef LM_STRUCT_ROW
#define LM_FIELD_ROW(s, f) {#s, #f, (int64_t)offsetof(s, f), (int64_t)sizeof(s::f)},
      LM_ABI_FIELDS(LM_FIELD_ROW)
#undef LM_FIELD_ROW
  };
  if (i < 0 || i >= (int)(sizeof(rows) / sizeof(rows[0]))) return -1;
  *type = rows[i].type, *field = rows[i].field, *offset = rows[i].offset, *size = rows[i].size;
  return 0;
}

int lmcli_native_format_count() { return kFormatCount; }

// row i of formats.h's table: ggml's number and name, values and bytes a block, the block's
// alignment, and whether the library multiplies it (1) or not (0). Returns 0, or -1 past the end.
int lmcli_native_format(int i, int* ggml_type, const char** name, int* block, int* bytes, int* align,
                        int* products) {
  if (i < 0 || i >= kFormatCount) return -1;
  const Traits& t = kTraits[i];
  *ggml_type = t.wtype, *name = t.name, *block = t.block, *bytes = t.bytes, *align = t.align;
  *products = scalar::kTable[i].multiplies();
  return 0;
}

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
  const Kernels* kern = pick(wtype, isa);
  const int block = block_values(wtype);
  if (kern != nullptr && kern->fdot1 != nullptr && n >= 0 && m >= 0 && k > 0)
    return float_matmul(*kern, w, n, k * block_bytes(wtype), k, x, m, y, threads);
  if (kern == nullptr || kern->dot1 == nullptr || n < 0 || m < 0 || k <= 0 || k % block != 0) return -1;
  const int64_t nb = k / block, row_bytes = nb * block_bytes(wtype);
  const ActCopies acts = act_copies(m, k, block, kern->layout);
  quantize_rows(*kern, x, m, k, block, acts);

  // rows of activations taken together: their int8 copies stay in L2 while weight rows stream by
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(m, (256 * 1024) / k));
  run_parts(threads, n, [&](int t, int parts) {
    const int64_t lo = n * t / parts, hi = n * (t + 1) / parts;
    for (int64_t m0 = 0; m0 < m; m0 += tile) {
      const int64_t m1 = std::min(m, m0 + tile);
      for (int64_t j = lo; j < hi; ++j) {
        const uint8_t* wr = w + j * row_bytes;
        for (int64_t i = m0; i < m1;) {
          const int r = m1 - i >= 4 ? 4 : 1;
          ActRow a[4];
          float out[4];
          for (int t = 0; t < r; ++t) a[t] = acts.row(i + t);
          (r == 4 ? kern->dot4 : kern->dot1)(wr, a, nb, out);
          for (int t = 0; t < r; ++t) y[(i + t) * n + j] = out[t];
          i += r;
        }
      }
    }
  });
  return 0;
}

// w (n, k) in GGUF block layout `wtype` -> out (n, k) bfloat16 (as uint16 bits), `threads`
// parts of the rows. Returns 0, or -1 for an unknown type, instruction set or size.
int lmcli_native_dequantize(int wtype, const uint8_t* w, int64_t n, int64_t k, uint16_t* out, int threads,
                            int isa) {
  const Kernels* kern = pick(wtype, isa);
  const int block = block_values(wtype);
  if (kern == nullptr || kern->dequantize == nullptr || n < 0 || k <= 0 || k % block != 0) return -1;
  const int64_t nb = k / block, bb = block_bytes(wtype);
  run_parts(threads, n, [&](int t, int parts) {
    const int64_t lo = n * t / parts, hi = n * (t + 1) / parts;
    kern->dequantize(w + lo * nb * bb, (hi - lo) * nb, out + lo * k);
  });
  return 0;
}

// rows ids[0..n-1] of w (rows rows of k values in GGUF block layout `wtype`) -> out (n, k) float32,
// each value as gguf's dequantize gives it (a token embedding's lookups). Returns 0, or -1 for an
// unknown type or size or an id outside 0..rows-1.
int lmcli_native_weight_rows(int wtype, const uint8_t* w, int64_t rows, int64_t k, const int64_t* ids, int64_t n,
                             float* out) {
  const int i = format_index(wtype);
  const int block = block_values(wtype);
  if (i < 0 || kRowsF32[i] == nullptr || rows < 0 || n < 0 || k <= 0 || k % block != 0) return -1;
  for (int64_t j = 0; j < n; ++j)
    if (ids[j] < 0 || ids[j] >= rows) return -1;
  kRowsF32[i](w, k / block * block_bytes(wtype), k, ids, n, out);
  return 0;
}

}  // extern "C"

#include "layer.inc"
