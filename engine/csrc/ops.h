// Declarations of every native op; bindings.cpp exposes them to Python.
#pragma once
#include <torch/extension.h>

// cpu_features.cpp
bool cpu_has_amx();  // also asks the kernel for AMX tile state permission
