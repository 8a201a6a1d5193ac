// Layering probe (never built with the project): tokenizer/ must not see memory_node/.
#include "memory_node/kv_slot_allocator.h"
