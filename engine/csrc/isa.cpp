// Run-time CPU facts the Python dispatch cannot read from /proc/cpuinfo alone.
#include "ops.h"

#include <sys/syscall.h>
#include <unistd.h>

namespace {
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int XFEATURE_XTILEDATA = 18;

// CPUID leaf 7, subleaf 0, EDX: the AMX feature bits (22 bf16, 24 tile, 25 int8).
unsigned cpuid7_edx() {
  unsigned eax, ebx, ecx, edx;
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
  return edx;
}
}  // namespace

// Linux hands out AMX tile state only after a process asks for it; oneDNN does the
// same.  True when the CPU has AMX and the permission was granted.
bool cpu_has_amx() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("avx512f")) return false;
    const unsigned edx = cpuid7_edx();
    const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
    if (!(amx_bf16 && amx_tile)) return false;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

bool cpu_has_amx_int8() { return cpu_has_amx() && ((cpuid7_edx() >> 25) & 1); }
