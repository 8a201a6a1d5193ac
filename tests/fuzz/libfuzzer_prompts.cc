// libFuzzer target (scripts/fuzz.sh): fuzz_entries.h, FuzzPromptsJsonl.
#include <cstddef>
#include <cstdint>

#include "fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::FuzzPromptsJsonl(data, size);
  return 0;
}
