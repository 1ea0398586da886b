// The one Python module of the extension: plain pybind11 functions (no dispatcher
// hop), since several of these run on every layer of every step.
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_has_amx", &cpu_has_amx, "AMX tiles usable by this process");
}
