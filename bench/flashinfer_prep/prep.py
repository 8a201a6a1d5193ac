"""Builds (argv[1] == "build") or lists the FlashInfer JIT modules bench/flashinfer_baseline.py uses:
batch decode, cascade merge, fa3 and fa2 paged prefill; bf16, head_dim 128. Usage: prep.py build|list
[decode cascade fa3 fa2p fa2i]; FI_SITE is a full flashinfer install (prepare.sh sets it)."""
import os, sys, time, shutil
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0")
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fi/ws")
os.environ.setdefault("MAX_JOBS", "2")
sys.path.insert(0, os.environ.get("FI_SITE", "/tmp/fi/site"))
import torch
from flashinfer.jit.attention import modules as M
from flashinfer.jit import cascade as C
bf = torch.bfloat16
dec = (bf, bf, bf, torch.int32, 128, 128, 0, False, False)
pre = dec + (False,)
specs = {
    "decode": lambda: M.gen_batch_decode_module(*dec),
    "cascade": lambda: C.gen_cascade_module(),
    "fa3": lambda: M.gen_batch_prefill_module("fa3", *pre),
    "fa2p": lambda: M._gen_batch_prefill_primary_module("fa2", *pre),
    "fa2i": lambda: M._gen_batch_prefill_independent_paged_module("fa2", *pre),
}
which = sys.argv[2:] or list(specs)
for k in which:
    s = specs[k]()
    print(k, s.name, len(s.sources), [p.name for p in s.sources], flush=True)
    if sys.argv[1] == "build":
        t = time.time()
        s.build(verbose=False)
        print(k, "built in", round(time.time() - t), "s", s.jit_library_path, flush=True)
