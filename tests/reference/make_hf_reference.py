#!/usr/bin/env python3
"""Writes small random Llama checkpoints and Hugging Face transformers' greedy continuations.

For each model it writes <out>/<name>/ with config.json, model.safetensors (bf16) and
reference.json: for several prompts, the greedy tokens, the natural-log probability of each and
the gap between the top two logits at each position, all computed in fp32 by transformers from
the same bf16 weights (upcast). tests/reference/hf_reference_test.cc checks tandem against these.

Per position it also records what a bf16 implementation may be held to (bf16_fields): the fp32
distribution's TOP_K most probable tokens and their log-probabilities (top8_ids, top8_logprobs:
the near-ties a bf16 backend may legitimately pick instead), and transformers' own
log-probability of the reference token with the model run in bf16 on the CPU, teacher-forced
(prompt and reference tokens in one pass; bf16_logprobs). `--add-bf16` adds these fields to the
reference.json files already in --out without touching anything else in them, after checking that
the fp32 teacher-forced pass reproduces their tokens and log-probabilities (to 1e-4: other torch
versions sum in other orders).

Needs torch, transformers and safetensors (the GPU machines have them). Runs on the CPU.
Usage: python3 tests/reference/make_hf_reference.py --out tests/data/reference [--add-bf16]
"""
import argparse
import json
import os

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

MAJOR = int(transformers.__version__.split(".")[0])

MODELS = {
    # Llama-3 style: GQA, llama3 RoPE scaling, tied embeddings. original_max_position is small so
    # that all three frequency bands of the llama3 rule (kept, scaled, smoothed) occur.
    # head_dim 64 is given explicitly (q_dim 256 != hidden 128), as the CUDA kernels take 64 or 128.
    "llama3-gqa-tied": dict(
        vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=[2, 3],
        rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}),
    # Llama-2 style: MHA, default RoPE, untied LM head; head_dim derived (256 / 4 = 64).
    "llama2-mha": dict(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope={"rope_type": "default", "rope_theta": 10000.0}),
    # MQA with an explicit head_dim that is not hidden_size / heads (as in some Mistral shapes).
    "mqa-headdim": dict(
        vocab_size=512, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=128, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope={"rope_type": "default", "rope_theta": 100000.0}),
}

PROMPT_LENGTHS = [1, 7, 20, 33, 100]
NEW_TOKENS = 24


def make_config(spec):
    spec = dict(spec)
    rope = spec.pop("rope")
    if MAJOR >= 5:
        spec["rope_parameters"] = rope
    else:
        spec["rope_theta"] = rope["rope_theta"]
        if rope["rope_type"] != "default":
            spec["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return LlamaConfig(**spec, attn_implementation="eager")


@torch.no_grad()
def randomize(model, gen):
    # Larger-than-default weights so that next-token distributions are peaked: near-uniform
    # logits would make greedy choices ties that no implementation can be held to.
    for name, p in model.named_parameters():
        if p.dim() == 1:  # RMSNorm weights
            p.copy_(1.0 + 0.1 * (torch.rand(p.shape, generator=gen) * 2 - 1))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / p.shape[1] ** 0.5))


@torch.no_grad()
def greedy(model, prompt, n):
    ids = list(prompt)
    tokens, logprobs, gaps = [], [], []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        top2 = torch.topk(logits, 2)
        token = int(top2.indices[0])
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        gaps.append(float(top2.values[0] - top2.values[1]))
        ids.append(token)
    return tokens, logprobs, gaps


@torch.no_grad()
def teacher_forced(model, case):
    """Natural-log probabilities (float64, [positions, vocab]) of the next token after the prompt
    and each prefix of the reference continuation, from one pass over prompt + reference tokens."""
    n = len(case["prompt_ids"])
    ids = torch.tensor([case["prompt_ids"] + case["token_ids"]])
    logits = model(ids).logits[0, n - 1:n - 1 + len(case["token_ids"])].double()
    return torch.log_softmax(logits, dim=-1)


TOP_K = 8


def bf16_fields(d, cases, check_against_committed):
    """Adds top8_ids, top8_logprobs and bf16_logprobs to each case (see the module doc).
    With check_against_committed, the fp32 pass must reproduce the cases' tokens and logprobs."""
    fp32 = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    bf16 = LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="eager").eval()
    worst = 0.0
    for c in cases:
        lp32, lp16 = teacher_forced(fp32, c), teacher_forced(bf16, c)
        top = torch.topk(lp32, TOP_K, dim=-1)
        for t, tok in enumerate(c["token_ids"]):
            if int(top.indices[t, 0]) != tok:
                raise SystemExit(f"{d}: fp32 teacher-forced argmax at position {t} is "
                                 f"{int(top.indices[t, 0])}, the reference token is {tok}")
            if check_against_committed and abs(float(lp32[t, tok]) - c["logprobs"][t]) > 1e-4:
                raise SystemExit(f"{d}: fp32 teacher-forced logprob at position {t} is "
                                 f"{float(lp32[t, tok])}, the committed one {c['logprobs'][t]}")
        c["top8_ids"] = [[int(i) for i in row] for row in top.indices]
        c["top8_logprobs"] = [[float(v) for v in row] for row in top.values]
        c["bf16_logprobs"] = [float(lp16[t, tok]) for t, tok in enumerate(c["token_ids"])]
        worst = max([worst] + [abs(a - b) for a, b in zip(c["bf16_logprobs"], c["logprobs"])])
    return worst


BF16_NOTE = {"device": "cpu", "dtype": "bfloat16", "attention": "eager", "mode": "teacher-forced",
             "torch": torch.__version__, "transformers": transformers.__version__}


def add_bf16(out):
    for name in MODELS:
        path = os.path.join(out, name, "reference.json")
        ref = json.load(open(path))
        worst = bf16_fields(os.path.join(out, name), ref["cases"], check_against_committed=True)
        ref["bf16_reference"] = BF16_NOTE
        with open(path, "w") as f:
            json.dump(ref, f, indent=1)
        print(f"{name}: fp32 reproduced; transformers in bf16 on the CPU vs fp32: max |logprob error| {worst:.3g}")


@torch.no_grad()
def measure_bf16(out):
    """How far transformers itself moves in bf16: teacher-forced log-probabilities of the reference
    tokens with the model run in bf16 (on a GPU when present) against the fp32 reference. This is
    the scale of error a bf16 backend has to be allowed."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in MODELS:
        d = os.path.join(out, name)
        ref = json.load(open(os.path.join(d, "reference.json")))
        model = LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="eager").to(device).eval()
        worst = 0.0
        for c in ref["cases"]:
            ids = torch.tensor([c["prompt_ids"] + c["token_ids"]], device=device)
            logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            n = len(c["prompt_ids"])
            for t, (tok, lp) in enumerate(zip(c["token_ids"], c["logprobs"])):
                worst = max(worst, abs(float(logp[n - 1 + t, tok]) - lp))
        print(f"{name}: transformers in bf16 on {device} vs fp32: max |logprob error| {worst:.3g}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--measure-bf16", action="store_true",
                    help="only measure transformers' own bf16 error on the checkpoints in --out")
    ap.add_argument("--add-bf16", action="store_true",
                    help="only add the per-position bf16 fields to the reference.json files in --out")
    args = ap.parse_args()
    if args.measure_bf16:
        measure_bf16(args.out)
        return
    if args.add_bf16:
        add_bf16(args.out)
        return
    torch.manual_seed(args.seed)
    for i, (name, spec) in enumerate(MODELS.items()):
        gen = torch.Generator().manual_seed(args.seed + i)
        model = LlamaForCausalLM(make_config(spec)).eval()
        randomize(model, gen)
        model = model.to(torch.bfloat16)
        out = os.path.join(args.out, name)
        model.save_pretrained(out, safe_serialization=True)
        # The reference is what transformers computes from the saved checkpoint in fp32. Loading
        # it afresh matters: casting a model with .to(bfloat16) also rounds the RoPE inv_freq
        # buffer to bf16, and casting back does not undo that.
        model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
        prompts = [torch.randint(4, spec["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
        cases = []
        for prompt in prompts:
            tokens, logprobs, gaps = greedy(model, prompt, NEW_TOKENS)
            cases.append({"prompt_ids": prompt, "token_ids": tokens, "logprobs": logprobs, "top2_gaps": gaps})
        bf16_fields(out, cases, check_against_committed=False)
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump({"model": name, "transformers": transformers.__version__, "torch": torch.__version__,
                       "dtype_of_weights": "bfloat16", "compute_dtype": "float32",
                       "cases": cases, "bf16_reference": BF16_NOTE}, f, indent=1)
        for fname in ("generation_config.json",):
            path = os.path.join(out, fname)
            if os.path.exists(path):
                os.remove(path)
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, "
              f"{len(cases)} prompts x {NEW_TOKENS} tokens, min top-2 gap "
              f"{min(min(c['top2_gaps']) for c in cases):.2e}")


if __name__ == "__main__":
    main()
