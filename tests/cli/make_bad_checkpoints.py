#!/usr/bin/env python3
"""Writes broken copies of a good checkpoint, one directory per defect, for cli_test.sh.

Usage: make_bad_checkpoints.py GOOD_DIR OUT_DIR
OUT_DIR/CASES lists "name|text the error must contain", one case a line. Standard library only.
"""
import json
import os
import shutil
import struct
import sys

good, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
config = open(os.path.join(good, "config.json")).read()
blob = open(os.path.join(good, "model.safetensors"), "rb").read()
(hlen,) = struct.unpack("<Q", blob[:8])
header = json.loads(blob[8:8 + hlen])
data = blob[8 + hlen:]
cases = []


def pack(h, d):
    text = json.dumps(h).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + d


def case(name, needle, st=None, cfg=None):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, "config.json"), "w").write(config if cfg is None else cfg)
    if st is not None:
        open(os.path.join(d, "model.safetensors"), "wb").write(st)
    cases.append(f"{name}|{needle}")


case("truncated", "model.safetensors", st=blob[: len(blob) // 2])
case("header_past_end", "header length", st=struct.pack("<Q", len(blob)) + blob[8:64])
h = dict(header)
del h["model.layers.1.mlp.up_proj.weight"]
case("missing_tensor", "model.layers.1.mlp.up_proj.weight", st=pack(h, data))
h = json.loads(json.dumps(header))
k = "model.layers.0.self_attn.k_proj.weight"
h[k]["shape"] = [h[k]["shape"][1], h[k]["shape"][0] + 0] if h[k]["shape"][0] != h[k]["shape"][1] else [1, h[k]["shape"][0] * h[k]["shape"][1]]
case("wrong_shape", k, st=pack(h, data))
h = json.loads(json.dumps(header))
k = "model.norm.weight"
h[k]["dtype"] = "I16"
case("bad_dtype", k, st=pack(h, data))
h = json.loads(json.dumps(header))
a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
h[b]["data_offsets"] = h[a]["data_offsets"]
case("overlapping", "overlap", st=pack(h, data))
h = json.loads(json.dumps(header))
k = "model.norm.weight"
size = h[k]["data_offsets"][1] - h[k]["data_offsets"][0]
h[k]["data_offsets"] = [len(data) - size + 2, len(data) + 2]
case("offsets_out_of_range", k, st=pack(h, data))
h = json.loads(json.dumps(header))
h["model.layers.0.self_attn.q_bias"] = {"dtype": "BF16", "shape": [0], "data_offsets": [0, 0]}
case("unexpected_tensor", "model.layers.0.self_attn.q_bias", st=pack(h, data))
case("config_not_json", "config.json", st=blob, cfg=config[: len(config) // 2])
c = json.loads(config)
del c["hidden_size"]
case("config_missing_key", "hidden_size", st=blob, cfg=json.dumps(c))
c = json.loads(config)
c["num_attention_heads"] = "four"
case("config_bad_value", "num_attention_heads", st=blob, cfg=json.dumps(c))
case("no_weights", "safetensors")
open(os.path.join(out, "CASES"), "w").write("\n".join(cases) + "\n")
