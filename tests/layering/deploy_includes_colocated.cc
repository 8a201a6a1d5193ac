// Must NOT compile: deploy/ may not include colocated/ (see tests/CMakeLists.txt).
#include "colocated/engine.h"
#include "deploy/deployment.h"
int LayeringProbe() { return 0; }
