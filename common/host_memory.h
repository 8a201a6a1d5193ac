// How much host memory this process can still allocate.
#pragma once

#include <cstdint>
#include <string>

namespace tandem {

// Bytes this process can still allocate: the kernel's MemAvailable (else physical memory),
// capped by a cgroup v2 memory.max limit when one is set. `from`, if not null, names the figure
// that decided ("MemAvailable", "physical memory", "cgroup memory.max").
int64_t AvailableHostBytes(std::string* from = nullptr);

}  // namespace tandem
