// Must NOT compile: colocated/ may not include deploy/ (see tests/CMakeLists.txt).
#include "colocated/engine.h"
#include "deploy/deployment.h"
int LayeringProbe() { return 0; }
