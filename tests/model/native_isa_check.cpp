// Every instruction set the CPU runs against the scalar loop, for each block format, in C++ alone:
// for a machine without Python on it, e.g. aarch64 under qemu-user (tests/model/test_native.py
// cross-compiles this with the kernels and runs it there when aarch64-linux-gnu-g++ and
// qemu-aarch64 are installed). Prints one line a format and instruction set; exit 1 on a mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

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
  for (int i = 1; i < 5; ++i) isa = lmcli_native_supported(i) ? i : isa;
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
  struct Fmt { const char* name; int type, block, bytes, d_at; };
  const Fmt fmts[] = {{"q4_0", 2, 32, 18, 0},     {"q4_1", 3, 32, 20, 0},     {"q5_0", 6, 32, 22, 0},
                      {"q5_1", 7, 32, 24, 0},     {"q8_0", 8, 32, 34, 0},     {"q4_K", 12, 256, 144, 0},
                      {"q5_K", 13, 256, 176, 0}, {"q6_K", 14, 256, 210, 208}};
  const char* isas[] = {"scalar", "avx2", "avx_vnni", "avx512_vnni", "neon_dotprod"};
  const int64_t n = 19, k = 512, m = 3;
  int failures = 0;
  for (const Fmt& f : fmts) {
    const int64_t nblocks = n * (k / f.block);
    std::vector<uint8_t> w((size_t)(nblocks * f.bytes));
    for (auto& b : w) b = (uint8_t)next();
    // finite fp16 scales: 2^-12 .. 2^-9 (and the second one, at byte 2, of q4_1/q5_1's m and q4/5_K's dmin)
    const bool two = f.type == 3 || f.type == 7 || f.type == 12 || f.type == 13;
    for (int64_t b = 0; b < nblocks; ++b) {
      for (int at : {f.d_at, two ? 2 : f.d_at}) {
        const uint16_t h = (uint16_t)(((3 + (next() % 3)) << 10) | (next() & 0x3FF));
        std::memcpy(&w[(size_t)(b * f.bytes + at)], &h, 2);
      }
    }
    std::vector<float> x((size_t)(m * k)), ref((size_t)(m * n)), y((size_t)(m * n));
    for (auto& v : x) v = uniform() * 2.0f - 1.0f;
    lmcli_native_matmul(f.type, w.data(), n, k, x.data(), m, ref.data(), 1, 0);
    for (int isa = 1; isa < 5; ++isa) {
      if (!lmcli_native_supported(isa)) continue;
      if (lmcli_native_matmul(f.type, w.data(), n, k, x.data(), m, y.data(), 2, isa) != 0) return 1;
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
