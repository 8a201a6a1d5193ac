#!/usr/bin/env python3
"""Reference token ids for tokenizer_test, made by Hugging Face `tokenizers` (and `sentencepiece`
for tokenizer.model files) on the corpus below.

    pip install tokenizers sentencepiece
    python3 tests/tokenizer/tokenizer_files.py          # .cache/tokenizers/<name>/...
    python3 tests/tokenizer/make_tokenizer_reference.py # tests/data/tokenizer/<name>.json

Each output file holds the corpus and, per line, the ids with and without special tokens added
and the decoded text (with and without skipping special tokens). Invalid UTF-8 is not in the
corpus: the HF Python API only takes str, and tandem refuses such input with an error naming the
byte offset (tokenizer_test checks that separately).
"""
import argparse
import json
import os
import sys

CORPUS = [
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "  two leading spaces and trailing  ",
    "",
    " ",
    "\n",
    "line one\nline two\r\nline three\n\n\nafter blank lines",
    "\ttab\tseparated\tvalues\t",
    "def f(x):\n    return x * 2\n\n\tif x:\n\t\tpass\n",
    "int main() {\n        printf(\"%d\\n\", 42);          // long run of spaces\n}",
    "                                                                                end",
    "\n\n\n\n\n\n\n\n\n\n\n\n",
    "x = [1, 2, 3]; y = {'a': 1, \"b\": 2.5e-3}",
    "Numbers: 0 7 42 123 1234 12345 1234567890 3.14159 -2.5 1,000,000 0x1F 1e10",
    "Years 1999, 2024 and 20000 BC; phone +1 (555) 123-4567",
    "I'm sure you've heard they'll say it's what we'd do; DON'T SHOUT, I'M HERE",
    "Français: élève, garçon, œuvre, naïve, à bientôt",
    "Deutsch: Größe, Straße, Übermäßig, schön",
    "Español: ¿Dónde está la biblioteca? ¡Mañana!",
    "Português: não, coração, ações",
    "Polski: zażółć gęślą jaźń",
    "Čeština: příliš žluťoučký kůň úpěl ďábelské ódy",
    "Türkçe: İstanbul, ılık, şişe, çağ",
    "Tiếng Việt: Tôi yêu tiếng Việt nhiều lắm",
    "Русский: Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Українська: Гей, пане, ґава їсть є",
    "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία",
    "עברית: שלום עולם, מה שלומך?",
    "العربية: مرحبا بالعالم، كيف حالك؟ ١٢٣٤٥",
    "فارسی: سلام دنیا",
    "हिन्दी: नमस्ते दुनिया, आप कैसे हैं? १२३",
    "বাংলা: আমি বাংলায় গান গাই",
    "தமிழ்: வணக்கம் உலகம்",
    "తెలుగు: నమస్కారం",
    "ગુજરાતી: નમસ્તે",
    "ਪੰਜਾਬੀ: ਸਤ ਸ੍ਰੀ ਅਕਾਲ",
    "ไทย: สวัสดีครับ ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "ລາວ: ສະບາຍດີ",
    "ខ្មែរ: សួស្តី",
    "မြန်မာ: မင်္ဂလာပါ",
    "ქართული: გამარჯობა",
    "Հայերեն: Բարեւ",
    "አማርኛ: ሰላም ልዑል",
    "ᏣᎳᎩ: ᎣᏏᏲ",
    "ᚠᚢᚦᚨᚱᚲ runes and 𐌰𐌱𐌲 Gothic",
    "中文：你好，世界！我爱自然语言处理。",
    "繁體中文：臺灣的資訊科技產業",
    "日本語：こんにちは世界。カタカナとひらがなと漢字。",
    "한국어: 안녕하세요 세계, 한글은 과학적입니다",
    "ᠮᠣᠩᠭᠣᠯ mongolian, ꆈꌠ yi, ⵜⴰⵎⴰⵣⵉⵖⵜ tifinagh",
    "Emoji: 😀 😂 🤖 🚀 ❤️ 👍🏽 🇫🇷 🇯🇵",
    "ZWJ: 👨‍👩‍👧‍👦 👩🏽‍💻 🏳️‍🌈 🧑‍🤝‍🧑",
    "Combining: e\u0301 a\u0300 n\u0303 o\u0308\u0304 Z\u0351\u0353\u0345a\u0364\u0359l\u036bg\u0315o\u0321",
    "Math: ∀x∈ℝ, ∑ᵢ xᵢ² ≤ ∫₀^∞ e^{-t} dt ≈ 1 ± ε; α β γ → ∞",
    "Symbols: © ® ™ § ¶ † ‡ • … ‰ € £ ¥ ₹ ₿ °C",
    "Box: ┌─┬─┐ │ │ │ └─┴─┘ ░▒▓█",
    "Zero width: a\u200bb\u200cc\u200dd\ufeffe and nbsp\u00a0here, thin\u2009space, ideographic\u3000space",
    "Mixed scripts: Hello Мир 世界 مرحبا 🌍 नमस्ते",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.de",
    "<html><body class=\"x\">Text &amp; more</body></html>",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "Special tokens: <s> </s> <unk> <|endoftext|> <|im_start|> <|im_end|> [INST] [/INST]",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<s>[INST] What is 2+2? [/INST] 4</s>",
    "text<|endoftext|>more text</s>tail",
    "<<s>> <s<s>s> [[INST]]",
    "Repeated: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa !!!!!!!!!!!!!!!!!!!!?????",
    "A" * 300,
    "ab " * 100,
    "Ünïcödé ñàmé wïth ãccents — and dashes – and quotes “like” ‘this’ «ceci» „so“",
    "\u00a0\u2002\u2003\u2028\u2029\u0085",
    "Control chars: \x01\x02\x1b[0m\x7f",
    "Private use \ue000\uf8ff and astral plane 𝕳𝖊𝖑𝖑𝖔 𝟙𝟚𝟛 \U0010FFFD",
    "a",
    "1",
    "。",
]

# Control tokens of a SentencePiece model are matched in the text like HF's special added tokens.
def sp_encode(sp, text, add_bos):
    controls = sorted([sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) and sp.id_to_piece(i)],
                      key=len, reverse=True)
    ids = [sp.bos_id()] if add_bos else []
    seg = i = 0
    while i < len(text):
        hit = next((c for c in controls if text.startswith(c, i)), None)
        if hit is None:
            i += 1
            continue
        if i > seg:
            ids += sp.encode(text[seg:i])
        ids.append(sp.piece_to_id(hit))
        seg = i = i + len(hit)
    if seg < len(text):
        ids += sp.encode(text[seg:])
    return ids


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default=os.path.join(root, ".cache", "tokenizers"))
    ap.add_argument("--out", default=os.path.join(root, "tests", "data", "tokenizer"))
    a = ap.parse_args()
    import tokenizers
    os.makedirs(a.out, exist_ok=True)
    for name in sorted(os.listdir(a.files)):
        d = os.path.join(a.files, name)
        tj = os.path.join(d, "tokenizer.json")
        if os.path.exists(tj):
            tok = tokenizers.Tokenizer.from_file(tj)
            cases = []
            for text in CORPUS:
                ids = tok.encode(text, add_special_tokens=True).ids
                cases.append({"ids": ids, "ids_plain": tok.encode(text, add_special_tokens=False).ids,
                              "decoded": tok.decode(ids, skip_special_tokens=False),
                              "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
            write(a.out, f"{name}.hf", {"tokenizer": f"{name}/tokenizer.json", "library": f"tokenizers {tokenizers.__version__}",
                                        "texts": CORPUS, "cases": cases})
        sp_file = os.path.join(d, "tokenizer.model")
        if os.path.exists(sp_file):
            import sentencepiece
            sp = sentencepiece.SentencePieceProcessor(model_file=sp_file)
            cases = []
            for text in CORPUS:
                ids = sp_encode(sp, text, True)
                cases.append({"ids": ids, "ids_plain": sp_encode(sp, text, False),
                              "decoded_skip": sp.decode([i for i in ids if not sp.is_control(i)])})
            write(a.out, f"{name}.sp", {"tokenizer": f"{name}/tokenizer.model",
                                        "library": f"sentencepiece {sentencepiece.__version__}", "texts": CORPUS,
                                        "cases": cases})


def write(out, stem, obj):
    path = os.path.join(out, stem + ".json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
