// Must NOT compile: compute_node/ may not include memory_node/ (see tests/CMakeLists.txt).
#include "compute_node/weights.h"
#include "memory_node/kv_slot_allocator.h"
int LayeringProbe() { return 0; }
