// The extension's instruction-set paths: one Isa enum (engine/platform.py mirrors it for Python),
// the GCC target strings each path's functions are compiled for, and the one CPU feature check
// (isa.cpp) that says which paths this process may run.  Every kernel function carries its own
// target, so one build runs on any x86-64 host and picks its paths at run time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

// AMX intrinsics need GCC >= 11 (or clang >= 12); older compilers build without AMX.
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define CPUSERVE_HAVE_AMX 1
#else
#define CPUSERVE_HAVE_AMX 0
#endif

// Target strings, one per Isa (each includes the paths it extends), for CPUSERVE_TARGET (a
// function) or CPUSERVE_TARGET_BEGIN / _END (a region).  The feature sets are the ones
// cpu_supports() checks for the same Isa.
#define CPUSERVE_ISA_AVX2 "avx2,fma,f16c"
#define CPUSERVE_ISA_AVX_VNNI "avx2,fma,f16c,avxvnni"
#define CPUSERVE_ISA_AVX512 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"
#define CPUSERVE_ISA_AVX512_VNNI "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
#define CPUSERVE_ISA_AVX512_BF16 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"
// AVX512-BF16 code that also uses VNNI int8 products where the CPU has them (checked per call).
#define CPUSERVE_ISA_AVX512_BF16_VNNI "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni"
#define CPUSERVE_ISA_AMX_BF16 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16"
#define CPUSERVE_ISA_AMX_INT8 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8"
// AVX2 without FMA: code whose float results must match an unfused reference bit for bit.
#define CPUSERVE_ISA_AVX2_NO_FMA "avx2"

#define CPUSERVE_TARGET(isa) __attribute__((target(isa)))
#define CPUSERVE_PRAGMA_(x) _Pragma(#x)
#define CPUSERVE_TARGET_BEGIN(isa) _Pragma("GCC push_options") CPUSERVE_PRAGMA_(GCC target(isa))
#define CPUSERVE_TARGET_END _Pragma("GCC pop_options")

namespace cpuserve {

// Every path a kernel may take.  The values are the `isa` arguments of the bindings (-1: the best
// this CPU runs) and engine/platform.py's Isa; add new ones at the end.
enum Isa : int {
  kScalar = 0,       // portable C++, the reference every other path matches
  kAvx2 = 1,         // AVX2 + FMA + F16C
  kAvxVnni = 2,      // kAvx2 + AVX-VNNI (int8 products in 256-bit registers)
  kAvx512Vnni = 3,   // kAvx512 + AVX512-VNNI
  kAmxInt8 = 4,      // kAvx512Vnni + AMX int8 tiles (and the OS's permission to use them)
  kAvx512 = 5,       // kAvx2 + AVX-512 F/BW/VL/DQ
  kAvx512Bf16 = 6,   // kAvx512 + AVX512-BF16
  kAmxBf16 = 7,      // kAvx512Bf16 + AMX bf16 tiles (and the OS's permission)
  kAmxBf16Emu = 8,   // kAmxBf16's kernels on a software model of the tiles (tests; runs where kAvx512Bf16 does)
};
constexpr int kNumIsas = 9;

// The name Python uses for `isa`: "scalar", "avx2", "avx-vnni", ... ("" past the end).
const char* isa_name(int isa);

// Whether this process can run `isa`'s kernels: the CPU has its features (for AMX, Linux granted
// the tile state) and this compiler built them.  The extension's one CPU feature check.
bool cpu_supports(int isa);

// The CPU features the extension's paths depend on that this CPU has, in /proc/cpuinfo's spelling
// (amx_* only when the tile state was granted to this process).
std::vector<std::string> cpu_features();

}  // namespace cpuserve
