// The one CPU feature check of the extension (isa.h).
#include "isa.h"

#include <sys/syscall.h>
#include <unistd.h>

namespace cpuserve {
namespace {

enum Feature : int {
  kFAvx2, kFFma, kFF16c, kFAvxVnni, kFAvx512f, kFAvx512bw, kFAvx512vl, kFAvx512dq, kFAvx512Vnni, kFAvx512Bf16,
  kFAmxTile, kFAmxBf16, kFAmxInt8, kNumFeatures
};
const char* const kFeatureNames[kNumFeatures] = {"avx2",        "fma",         "f16c",     "avx_vnni", "avx512f",
                                                 "avx512bw",    "avx512vl",    "avx512dq", "avx512_vnni",
                                                 "avx512_bf16", "amx_tile",    "amx_bf16", "amx_int8"};

constexpr uint32_t bit(Feature f) { return 1u << f; }

constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int XFEATURE_XTILEDATA = 18;

// CPUID leaf 7, subleaf 0, EDX: the AMX feature bits (22 bf16, 24 tile, 25 int8).
unsigned cpuid7_edx() {
  unsigned eax, ebx, ecx, edx;
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
  return edx;
}

uint32_t detect() {
  __builtin_cpu_init();
  uint32_t f = 0;
  auto set = [&](Feature x, bool on) { f |= on ? bit(x) : 0u; };
  set(kFAvx2, __builtin_cpu_supports("avx2"));
  set(kFFma, __builtin_cpu_supports("fma"));
  set(kFF16c, __builtin_cpu_supports("f16c"));
  set(kFAvxVnni, __builtin_cpu_supports("avxvnni"));
  set(kFAvx512f, __builtin_cpu_supports("avx512f"));
  set(kFAvx512bw, __builtin_cpu_supports("avx512bw"));
  set(kFAvx512vl, __builtin_cpu_supports("avx512vl"));
  set(kFAvx512dq, __builtin_cpu_supports("avx512dq"));
  set(kFAvx512Vnni, __builtin_cpu_supports("avx512vnni"));
  set(kFAvx512Bf16, __builtin_cpu_supports("avx512bf16"));
  // Linux hands out AMX tile state only after a process asks for it (as oneDNN does): the tiles
  // count as present once that permission is granted.
  const unsigned edx = (f & bit(kFAvx512f)) ? cpuid7_edx() : 0u;
  if (((edx >> 24) & 1) && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0) {
    f |= bit(kFAmxTile);
    set(kFAmxBf16, (edx >> 22) & 1);
    set(kFAmxInt8, (edx >> 25) & 1);
  }
  return f;
}

uint32_t features() {
  static const uint32_t f = detect();
  return f;
}

// The features each Isa needs (each includes the Isa it extends).
uint32_t needs(int isa) {
  constexpr uint32_t avx2 = bit(kFAvx2) | bit(kFFma) | bit(kFF16c);
  constexpr uint32_t avx512 = avx2 | bit(kFAvx512f) | bit(kFAvx512bw) | bit(kFAvx512vl) | bit(kFAvx512dq);
  switch (isa) {
    case kScalar: return 0;
    case kAvx2: return avx2;
    case kAvxVnni: return avx2 | bit(kFAvxVnni);
    case kAvx512: return avx512;
    case kAvx512Vnni: return avx512 | bit(kFAvx512Vnni);
    case kAmxInt8: return avx512 | bit(kFAvx512Vnni) | bit(kFAmxTile) | bit(kFAmxInt8);
    case kAvx512Bf16:
    case kAmxBf16Emu: return avx512 | bit(kFAvx512Bf16);
    case kAmxBf16: return avx512 | bit(kFAvx512Bf16) | bit(kFAmxTile) | bit(kFAmxBf16);
    default: return ~0u;
  }
}

}  // namespace

const char* isa_name(int isa) {
  static const char* const names[kNumIsas] = {"scalar", "avx2",        "avx-vnni", "avx512-vnni", "amx-int8",
                                              "avx512", "avx512-bf16", "amx-bf16", "amx-bf16-emu"};
  return isa >= 0 && isa < kNumIsas ? names[isa] : "";
}

bool cpu_supports(int isa) {
  if ((isa == kAmxInt8 || isa == kAmxBf16) && !CPUSERVE_HAVE_AMX) return false;
  const uint32_t n = needs(isa);
  return n != ~0u && (features() & n) == n;
}

std::vector<std::string> cpu_features() {
  std::vector<std::string> out;
  for (int i = 0; i < kNumFeatures; ++i)
    if (features() & bit(static_cast<Feature>(i))) out.push_back(kFeatureNames[i]);
  return out;
}

}  // namespace cpuserve
