// The C ABI of the library, declared once: the instruction sets, the gated MLP's nonlinearities and
// the key/value cache's element types (each an X-macro list: its numbers are the list's order, its
// names what Python calls it), and the structures a layer step reads. Python (abi.py) mirrors the
// structures with ctypes and, when it loads the library, checks its mirror against the library's
// own report (lmcli_native_name, lmcli_native_field): a mismatch refuses the library in one line.
#pragma once

#include <cstddef>
#include <cstdint>

// X(ENUM, name): instruction sets, in the library's numbering
#define LM_ISA_LIST(X)          \
  X(SCALAR, "scalar")           \
  X(AVX2, "avx2")               \
  X(AVX_VNNI, "avx_vnni")       \
  X(AVX512_VNNI, "avx512_vnni") \
  X(NEON_DOT, "neon_dotprod")

// the gated MLP's nonlinearities
#define LM_ACT_LIST(X) \
  X(ACT_SILU, "silu")  \
  X(ACT_GELU_TANH, "gelu_tanh")

// the key/value cache's element types, by torch's dtype names, and its block formats (a head's row
// of D values as D / 32 of ggml's q8_0 or q4_0 blocks, --kv-dtype's names)
#define LM_CACHE_LIST(X)        \
  X(CACHE_F32, "float32")       \
  X(CACHE_BF16, "bfloat16")     \
  X(CACHE_F16, "float16")       \
  X(CACHE_Q8_0, "q8_0")         \
  X(CACHE_Q4_0, "q4_0")

namespace lmabi {

#define LM_ENUM_ROW(e, name) e,
enum Isa { LM_ISA_LIST(LM_ENUM_ROW) kIsaCount };
enum Act { LM_ACT_LIST(LM_ENUM_ROW) kActCount };
enum CacheType { LM_CACHE_LIST(LM_ENUM_ROW) kCacheCount };
#undef LM_ENUM_ROW

// the lists Python reads by number (lmcli_native_name's `list`)
enum NameList { NAMES_ISA = 0, NAMES_ACT = 1, NAMES_CACHE = 2 };

// the instruction sets from best to worst: the library takes the first this CPU runs
constexpr Isa kIsaPreference[] = {AVX512_VNNI, AVX_VNNI, NEON_DOT, AVX2, SCALAR};

}  // namespace lmabi

extern "C" {

// a product y (m, n) = x (m, k) . W^T (+ bias): W as GGUF blocks of GGML type `wtype`
struct LmLinear {
  int64_t wtype;
  const uint8_t* w;
  int64_t n, k;
  const float* bias;  // (n) or null
};

// one block's weights and sizes (all float32; a null norm is absent)
struct LmLayer {
  int64_t C, H, KV, D, F;  // width, query heads, key/value heads, head size, MLP width
  int64_t act;             // lmabi::Act
  int64_t nqkv;            // parts of the query/key/value product (1-3): outputs side by side
  int64_t window;          // a sliding window's columns (a query sees the last `window`), or 0: all
  double eps, qk_eps, scale;
  double softcap;          // the scores capped softly, softcap tanh(s / softcap), or 0: not capped
  const float* norm1;
  const float* norm2;
  const float* post1;  // sandwich placement's norms of the sublayers' outputs, or null
  const float* post2;
  const float* q_norm;  // per-head norms of queries and keys (D), or null
  const float* k_norm;
  LmLinear qkv[3];
  LmLinear o, gate, up, down;
};

}  // extern "C"

// X(struct, field): every field of the structures above, for the library's report of their
// offsets and sizes (a field added above must be added here, and to abi.py's mirror)
#define LM_ABI_FIELDS(X)                                                                              \
  X(LmLinear, wtype) X(LmLinear, w) X(LmLinear, n) X(LmLinear, k) X(LmLinear, bias)                   \
  X(LmLayer, C) X(LmLayer, H) X(LmLayer, KV) X(LmLayer, D) X(LmLayer, F) X(LmLayer, act)              \
  X(LmLayer, nqkv) X(LmLayer, window) X(LmLayer, eps) X(LmLayer, qk_eps) X(LmLayer, scale)            \
  X(LmLayer, softcap) X(LmLayer, norm1)                                                               \
  X(LmLayer, norm2) X(LmLayer, post1) X(LmLayer, post2) X(LmLayer, q_norm) X(LmLayer, k_norm)         \
  X(LmLayer, qkv) X(LmLayer, o) X(LmLayer, gate) X(LmLayer, up) X(LmLayer, down)
#define LM_ABI_STRUCTS(X) X(LmLinear) X(LmLayer)
