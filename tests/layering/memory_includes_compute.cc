// Must NOT compile: memory_node/ may not include compute_node/ (see tests/CMakeLists.txt).
#include "compute_node/controller.h"
#include "memory_node/kv_table.h"
int LayeringProbe() { return 0; }
