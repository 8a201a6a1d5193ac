"""Prunes a FlashInfer target install to what the bench needs. Usage: prune.py SITE USED_LIST
Keeps: every package but flashinfer whole (less tvm_ffi's C++ sources), flashinfer's top-level
modules, its jit/ and attention/ Python packages, every other file the recorded run used, and
flashinfer/data/aot (the prepared kernels). Drops __pycache__, bin/, CUDA/C++ headers."""
import os, shutil, sys
site, used_list = sys.argv[1], sys.argv[2]
used = set(open(used_list).read().split())
removed = 0
def rm(p):
    global removed
    if os.path.isdir(p) and not os.path.islink(p):
        for r, _, fs in os.walk(p):
            removed += sum(os.path.getsize(os.path.join(r, f)) for f in fs)
        shutil.rmtree(p)
    elif os.path.exists(p):
        removed += os.path.getsize(p)
        os.remove(p)
for r, ds, _ in os.walk(site):
    for d in list(ds):
        if d == "__pycache__":
            rm(os.path.join(r, d)); ds.remove(d)
rm(os.path.join(site, "bin"))
for d in ("3rdparty", "src", "cython"):
    rm(os.path.join(site, "tvm_ffi", d))
fi = os.path.join(site, "flashinfer")
for r, ds, fs in os.walk(fi):
    rel_dir = os.path.relpath(r, site)
    for f in fs:
        rel = os.path.join(rel_dir, f)
        parts = rel.split("/")
        keep = (rel in used
                or (len(parts) == 2 and f.endswith(".py"))
                or (parts[1] in ("jit", "attention") and f.endswith(".py"))
                or parts[1:3] == ["data", "aot"])
        if not keep:
            rm(os.path.join(r, f))
for r, ds, fs in sorted(os.walk(fi), key=lambda x: -len(x[0])):
    if not os.listdir(r):
        os.rmdir(r)
print(f"pruned {removed / 1e6:.1f} MB")
