"""Imports flashinfer from SITE and loads the bench's kernel modules with JIT disabled."""
import sys
sys.path.insert(0, sys.argv[1])
import torch
import flashinfer, flashinfer.decode, flashinfer.prefill, flashinfer.cascade
bf = torch.bfloat16
a = (bf, bf, bf, torch.int32, 128, 128, 0, False, False)
mods = [flashinfer.decode.get_batch_decode_module(*a), flashinfer.cascade.get_cascade_module(),
        flashinfer.prefill.get_batch_prefill_module("fa3", *a, False),
        flashinfer.prefill.get_batch_prefill_module("fa2", *a, False)]
from flashinfer.jit.attention import modules as M
M._gen_batch_prefill_independent_paged_module("fa2", *a, False).build_and_load()
print("flashinfer", flashinfer.__version__, "from", flashinfer.__file__, ": all modules load without compiling")
