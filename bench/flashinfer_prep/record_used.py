"""Run with a full (unpruned) site on sys.path: records, relative to the site, every file that
importing flashinfer and generating the bench's module specs loads or opens. Usage:
record_used.py SITE OUT"""
import os, sys
site = os.path.realpath(sys.argv[1])
sys.path.insert(0, site)
used = set()
def note(path):
    p = os.path.realpath(path)
    if p.startswith(site + "/"):
        used.add(os.path.relpath(p, site))
def hook(ev, args):
    if ev == "open" and isinstance(args[0], str):
        note(args[0])
sys.addaudithook(hook)
import torch
import flashinfer, flashinfer.decode, flashinfer.prefill, flashinfer.cascade
from flashinfer.jit.attention import modules as M
from flashinfer.jit import cascade as C
bf = torch.bfloat16
a = (bf, bf, bf, torch.int32, 128, 128, 0, False, False)
specs = [M.gen_batch_decode_module(*a), C.gen_cascade_module(), M.gen_batch_prefill_module("fa3", *a, False),
         M._gen_batch_prefill_primary_module("fa2", *a, False),
         M._gen_batch_prefill_independent_paged_module("fa2", *a, False)]
for m in list(sys.modules.values()):
    f = getattr(m, "__file__", None)
    if f:
        note(f)
open(sys.argv[2], "w").write("\n".join(sorted(u for u in used if "__pycache__" not in u)) + "\n")
print(len(used), "files used")
