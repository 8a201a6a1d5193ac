// Memory owned by a compute backend or attention executor: device memory (CUDA), pinned host
// memory (CUDA's staging buffers) or plain host memory (CPU). Frees itself with its deleter.
#pragma once

#include <memory>

namespace tandem {

using BackendBuffer = std::unique_ptr<void, void (*)(void*)>;

}  // namespace tandem
