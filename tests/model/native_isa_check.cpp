// Every instruction set the CPU runs against the scalar loop, for each block format, in C++ alone:
// for a machine without Python on it, e.g. aarch64 under qemu-user (tests/model/test_native.py
// cross-compiles this with the kernels and runs it there when aarch64-linux-gnu-g++ and
// qemu-aarch64 are installed). Prints one line a format and instruction set; exit 1 on a mismatch.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "abi.h"  // (compiled with -I lmcli/model/native)
#include "formats.h"

extern "C" int lmcli_native_supported(int isa);
extern "C" int lmcli_native_matmul(int wtype, const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t m,
                                   float* y, int threads, int isa);
extern "C" int lmcli_native_dequantize(int wtype, const uint8_t* w, int64_t n, int64_t k, uint16_t* out, int threads,
                                       int isa);

namespace {
uint64_t state = 88172645463325252ull;
uint32_t next() {  // xorshift64
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return (uint32_t)(state >> 16);
}
float uniform() { return (float)(next() & 0xFFFFFF) / 16777216.0f; }

// a finite fp16 scale: 2^-12 .. 2^-9
uint16_t scale16() { return (uint16_t)(((3 + (next() % 3)) << 10) | (next() & 0x3FF)); }

template <class B, class = void>
struct HasMin : std::false_type {};  // q4_1/q5_1's m
template <class B>
struct HasMin<B, std::void_t<decltype(B::m)>> : std::true_type {};
template <class B, class = void>
struct HasDmin : std::false_type {};  // the K-quants' dmin
template <class B>
struct HasDmin<B, std::void_t<decltype(B::dmin)>> : std::true_type {};

// block b of format T given finite scales (its other bytes stay random)
template <int T>
void finite_scales(uint8_t* blk) {
  using B = typename lmfmt::BlockOf<T>::type;
  B x;
  std::memcpy(&x, blk, sizeof(B));
  if constexpr (std::is_same<B, lmfmt::BlockMXFP4>::value) {
    x.e = (uint8_t)(116 + next() % 4);  // 2^-12 .. 2^-9
  } else if constexpr (!std::is_arithmetic<B>::value) {
    x.d = scale16();
    if constexpr (HasMin<B>::value) x.m = scale16();
    if constexpr (HasDmin<B>::value) x.dmin = scale16();
  }
  std::memcpy(blk, &x, sizeof(B));
}

using Fill = void (*)(uint8_t*);
const Fill kFill[] = {
#define LM_FILL_ROW(e, t, n, s, b) finite_scales<t>,
    LM_FORMAT_LIST(LM_FILL_ROW)
#undef LM_FILL_ROW
};
}  // namespace

// `isa_check dequantize TYPE N K IN OUT`: the N x K weight of GGML type TYPE in file IN (its
// blocks) -> OUT, bfloat16 bits, by the best instruction set this CPU runs (the caller compares)
int dequantize(char** argv) {
  const int type = std::atoi(argv[2]);
  const int64_t n = std::atoll(argv[3]), k = std::atoll(argv[4]);
  FILE* in = std::fopen(argv[5], "rb");
  if (in == nullptr) return 2;
  std::vector<uint8_t> w;
  for (int c; (c = std::fgetc(in)) != EOF;) w.push_back((uint8_t)c);
  std::fclose(in);
  int isa = 0;
  for (int i = 1; i < lmabi::kIsaCount; ++i) isa = lmcli_native_supported(i) ? i : isa;
  std::vector<uint16_t> out((size_t)(n * k));
  if (lmcli_native_dequantize(type, w.data(), n, k, out.data(), 2, isa) != 0) return 1;
  FILE* o = std::fopen(argv[6], "wb");
  if (o == nullptr || std::fwrite(out.data(), 2, out.size(), o) != out.size()) return 2;
  std::fclose(o);
  std::printf("dequantized by isa %d\n", isa);
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 7 && std::strcmp(argv[1], "dequantize") == 0) return dequantize(argv);
#define LM_NAME_ROW(e, name) name,
  const char* isas[] = {LM_ISA_LIST(LM_NAME_ROW)};
#undef LM_NAME_ROW
  const int64_t n = 19, k = 512, m = 3;
  int failures = 0;
  for (int fi = 0; fi < lmfmt::kFormatCount; ++fi) {
    const lmfmt::Traits& f = lmfmt::kTraits[fi];
    if (f.block == 1) continue;  // the float formats: no product
    const int64_t nblocks = n * (k / f.block);
    std::vector<uint8_t> w((size_t)(nblocks * f.bytes));
    for (auto& b : w) b = (uint8_t)next();
    for (int64_t b = 0; b < nblocks; ++b) kFill[fi](&w[(size_t)(b * f.bytes)]);
    std::vector<float> x((size_t)(m * k)), ref((size_t)(m * n)), y((size_t)(m * n));
    for (auto& v : x) v = uniform() * 2.0f - 1.0f;
    lmcli_native_matmul(f.wtype, w.data(), n, k, x.data(), m, ref.data(), 1, 0);
    for (int isa = 1; isa < lmabi::kIsaCount; ++isa) {
      if (!lmcli_native_supported(isa)) continue;
      if (lmcli_native_matmul(f.wtype, w.data(), n, k, x.data(), m, y.data(), 2, isa) != 0) return 1;
      double worst = 0.0;
      for (size_t i = 0; i < y.size(); ++i) {
        const double err = std::fabs((double)y[i] - ref[i]) / (std::fabs((double)ref[i]) + 1e-3);
        worst = err > worst ? err : worst;
      }
      const bool ok = worst < 1e-4;
      failures += !ok;
      std::printf("%s %s %s (worst relative difference %.2g)\n", f.name, isas[isa], ok ? "ok" : "MISMATCH", worst);
    }
  }
  return failures ? 1 : 0;
}
