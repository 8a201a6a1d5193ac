#!/usr/bin/env python3
"""Decode tokens/s of Hugging Face transformers `generate` with a static KV cache, for the same
model shapes, batches and contexts as bench/engine_decode_bench (random weights, bf16, one GPU).

Decode throughput = batch x (new tokens - 1) / (time of generate(new tokens) - time of
generate(1 token)), so the prefill is subtracted. Rows: "hf batch ctx tok/s".
Usage: python3 bench/hf_generate_bench.py --model llama3-8b [--batches 1,8,64] [--contexts 1024]
"""
import argparse
import json
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

MAJOR = int(transformers.__version__.split(".")[0])

SHAPES = {  # the same shapes as tandem's presets (common/model_spec.cc)
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5),
    "llama-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
                      rope_theta=10000.0, rms_norm_eps=1e-6),
}


def timed_generate(model, ids, new_tokens):
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   cache_implementation="static", pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    shape = dict(SHAPES[args.model])
    if MAJOR >= 5:  # transformers 5 takes RoPE settings as rope_parameters
        shape["rope_parameters"] = {"rope_type": "default", "rope_theta": shape.pop("rope_theta")}
    cfg = LlamaConfig(**shape)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    rows = []
    print(f"hf transformers generate (static cache), {args.model}, {torch.cuda.get_device_name()}")
    for ctx in map(int, args.contexts.split(",")):
        for b in map(int, args.batches.split(",")):
            # As in engine_decode_bench: the context ends at ctx tokens.
            ids = torch.randint(3, cfg.vocab_size, (b, ctx - args.decode_tokens), device="cuda")
            try:
                # Warm-up with the exact calls that are timed: with a static cache, transformers
                # compiles the forward pass per cache shape (prompt + new tokens), so each length
                # is run once untimed first.
                timed_generate(model, ids, 1)
                timed_generate(model, ids, args.decode_tokens)
                t1 = timed_generate(model, ids, 1)
                tn = timed_generate(model, ids, args.decode_tokens)
            except torch.cuda.OutOfMemoryError:
                print(f"hf {b} {ctx} out of memory")
                torch.cuda.empty_cache()
                continue
            tok_s = b * (args.decode_tokens - 1) / max(tn - t1, 1e-9)
            rows.append({"kind": "hf", "model": args.model, "batch": b, "context": ctx, "decode_tok_s": tok_s})
            print(f"hf {b} {ctx} {tok_s:.0f}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
