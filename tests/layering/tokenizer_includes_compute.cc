// Layering probe (never built with the project): tokenizer/ works on text and ids alone and must
// not see compute_node/ (nothing below the tokenizer sees text). tests/CMakeLists.txt builds this
// against tandem_tokenizer and expects the include to fail.
#include "compute_node/controller.h"
