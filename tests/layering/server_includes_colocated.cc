// Must NOT compile: server/ may not include colocated/ (see tests/CMakeLists.txt).
#include "colocated/engine.h"
#include "server/engine_loop.h"
int LayeringProbe() { return 0; }
