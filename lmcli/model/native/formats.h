// GGUF's block formats, each declared once: the bytes of one block as a struct (its size asserted
// against ggml's), and one row of the traits table that the kernels, the quantizer, `pick` and
// Python (ops.py, through lmcli_native_format) read. Nothing else in the library writes a block's
// size or a field's offset: they come from these structs.
//
// Values per block: 32 for the small formats, QK_K = 256 for the K-quants and IQ4_XS; the float
// formats are "blocks" of one value. Scales are IEEE halves stored as their bits (uint16_t).
//
// Adding a format: its struct below (size asserted against ggml's), one row of LM_FORMAT_LIST,
// and its kernels (docs/native-kernels.md, "Adding a format"): a product and a dequantize for
// each instruction set, or the portable one; the build fails where one is missing.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lmfmt {

constexpr int QK = 32;     // values of a 32-value block (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, mxfp4)
constexpr int QK_K = 256;  // values of a K-quant super-block (and iq4_xs's)

struct BlockQ4_0 {  // v = d (q - 8); element i in the low nibble of qs[i], i + 16 in the high one
  uint16_t d;
  uint8_t qs[QK / 2];
};
struct BlockQ4_1 {  // v = d q + m
  uint16_t d, m;
  uint8_t qs[QK / 2];
};
struct BlockQ5_0 {  // v = d (q - 16); element i's fifth bit is bit i of qh (little-endian)
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[QK / 2];
};
struct BlockQ5_1 {  // v = d q + m
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[QK / 2];
};
struct BlockQ8_0 {  // v = d q
  uint16_t d;
  int8_t qs[QK];
};
struct BlockQ2_K {  // 16 groups of 16: v = d (scales & 15) q - dmin (scales >> 4), q 2 bits
  uint8_t scales[QK_K / 16];
  uint8_t qs[QK_K / 4];
  uint16_t d, dmin;
};
struct BlockQ3_K {  // 16 groups of 16: v = d (s - 32) (q - 4 h'), s 6 bits packed in 12 bytes
  uint8_t hmask[QK_K / 8];
  uint8_t qs[QK_K / 4];
  uint8_t scales[12];
  uint16_t d;
};
struct BlockQ4_K {  // 8 groups of 32: v = d sc q - dmin mn, sc and mn 6 bits packed in 12 bytes
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[QK_K / 2];
};
struct BlockQ5_K {  // as q4_K with a fifth bit a value in qh
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[QK_K / 8];
  uint8_t qs[QK_K / 2];
};
struct BlockQ6_K {  // 16 groups of 16: v = d scales (q - 32), q 4 bits in ql and 2 in qh
  uint8_t ql[QK_K / 2];
  uint8_t qh[QK_K / 4];
  int8_t scales[QK_K / 16];
  uint16_t d;
};
struct BlockIQ4_NL {  // v = d kvalues_iq4nl[q], the nibbles laid out as q4_0's
  uint16_t d;
  uint8_t qs[QK / 2];
};
struct BlockIQ4_XS {  // 8 groups of 32: v = d (ls - 32) kvalues_iq4nl[q], ls 6 bits (4 in scales_l, 2 in scales_h)
  uint16_t d;
  uint16_t scales_h;
  uint8_t scales_l[QK_K / 64];
  uint8_t qs[QK_K / 2];
};
struct BlockMXFP4 {  // v = 2^(e - 128) kvalues_mxfp4[q] (e8m0 scale of half-units), nibbles as q4_0's
  uint8_t e;
  uint8_t qs[QK / 2];
};

static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20, "ggml's q4_0/q4_1 blocks");
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24, "ggml's q5_0/q5_1 blocks");
static_assert(sizeof(BlockQ8_0) == 34, "ggml's q8_0 block");
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110, "ggml's q2_K/q3_K blocks");
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176, "ggml's q4_K/q5_K blocks");
static_assert(sizeof(BlockQ6_K) == 210, "ggml's q6_K block");
static_assert(sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136, "ggml's iq4_nl/iq4_xs blocks");
static_assert(sizeof(BlockMXFP4) == 17, "ggml's mxfp4 block");

// the 16 values a 4-bit index of iq4_nl/iq4_xs stands for (ggml's kvalues_iq4nl)
constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// mxfp4's E2M1 values, doubled to integers (ggml's kvalues_mxfp4): the e8m0 scale is 2^(e - 128)
constexpr int8_t kMXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// X(ENUM, ggml type, name as ggml spells it, block struct or value type, values per block)
#define LM_FORMAT_LIST(X)                            \
  X(F32, 0, "f32", float, 1)                         \
  X(F16, 1, "f16", uint16_t, 1)                      \
  X(Q4_0, 2, "q4_0", lmfmt::BlockQ4_0, lmfmt::QK)    \
  X(Q4_1, 3, "q4_1", lmfmt::BlockQ4_1, lmfmt::QK)    \
  X(Q5_0, 6, "q5_0", lmfmt::BlockQ5_0, lmfmt::QK)    \
  X(Q5_1, 7, "q5_1", lmfmt::BlockQ5_1, lmfmt::QK)    \
  X(Q8_0, 8, "q8_0", lmfmt::BlockQ8_0, lmfmt::QK)    \
  X(Q2_K, 10, "q2_K", lmfmt::BlockQ2_K, lmfmt::QK_K) \
  X(Q3_K, 11, "q3_K", lmfmt::BlockQ3_K, lmfmt::QK_K) \
  X(Q4_K, 12, "q4_K", lmfmt::BlockQ4_K, lmfmt::QK_K) \
  X(Q5_K, 13, "q5_K", lmfmt::BlockQ5_K, lmfmt::QK_K) \
  X(Q6_K, 14, "q6_K", lmfmt::BlockQ6_K, lmfmt::QK_K) \
  X(IQ4_NL, 20, "iq4_nl", lmfmt::BlockIQ4_NL, lmfmt::QK) \
  X(IQ4_XS, 23, "iq4_xs", lmfmt::BlockIQ4_XS, lmfmt::QK_K) \
  X(BF16, 30, "bf16", uint16_t, 1)                   \
  X(MXFP4, 39, "mxfp4", lmfmt::BlockMXFP4, lmfmt::QK)

// the formats by ggml's numbers (gguf.GGMLQuantizationType)
enum WType {
#define LM_ENUM(e, t, n, s, b) e = t,
  LM_FORMAT_LIST(LM_ENUM)
#undef LM_ENUM
};

// one row of the traits table
struct Traits {
  int wtype;         // ggml's number
  const char* name;  // ggml's name
  int block;         // values a block
  int bytes;         // bytes a block
  int align;         // the block's alignment (its fields' widest): blocks must start at a multiple
};

constexpr Traits kTraits[] = {
#define LM_ROW(e, t, n, s, b) {t, n, b, (int)sizeof(s), (int)alignof(s)},
    LM_FORMAT_LIST(LM_ROW)
#undef LM_ROW
};
constexpr int kFormatCount = (int)(sizeof(kTraits) / sizeof(kTraits[0]));

// the traits of ggml type `wtype`, or null for a type the library does not know
constexpr const Traits* traits(int wtype) {
  for (const Traits& t : kTraits)
    if (t.wtype == wtype) return &t;
  return nullptr;
}

// the row of `wtype` in kTraits, or -1 for a type the library does not know
constexpr int format_index(int wtype) {
  for (int i = 0; i < kFormatCount; ++i)
    if (kTraits[i].wtype == wtype) return i;
  return -1;
}

// values a block of `wtype` (0: unknown) and bytes a block (0: unknown)
constexpr int block_values(int wtype) { return traits(wtype) ? traits(wtype)->block : 0; }
constexpr int64_t block_bytes(int wtype) { return traits(wtype) ? traits(wtype)->bytes : 0; }

// the block struct of a format, for templates: BlockOf<Q4_K>::type is BlockQ4_K
template <int T>
struct BlockOf;
#define LM_BLOCK_OF(e, t, n, s, b) \
  template <>                      \
  struct BlockOf<t> {              \
    using type = s;                \
  };
LM_FORMAT_LIST(LM_BLOCK_OF)
#undef LM_BLOCK_OF

static_assert(block_bytes(Q4_K) == 144 && block_values(IQ4_XS) == 256 && block_bytes(F32) == 4, "the table");

}  // namespace lmfmt
