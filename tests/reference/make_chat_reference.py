#!/usr/bin/env python3
"""Writes the reference renders of the chat templates in tests/data/chat_templates/.

Each *.jinja file there is rendered with Python's jinja2 exactly as Hugging Face transformers'
apply_chat_template(tokenize=False) renders it (ImmutableSandboxedEnvironment with trim_blocks,
lstrip_blocks and the loopcontrols extension; transformers' own tojson filter and
raise_exception, and strftime_now at a fixed instant; variables messages, add_generation_prompt, bos_token, eos_token, tools=None,
documents=None), over the message lists below, with and without add_generation_prompt. The
result, tests/data/chat_templates/reference.json, is what chat_template_test compares
tandem's interpreter against. Needs only jinja2 (Debian python3-jinja2 or pip jinja2):

    python3 tests/reference/make_chat_reference.py            # rewrite reference.json
    python3 tests/reference/make_chat_reference.py --check    # exit 1 if it would change
"""
import argparse
import datetime
import json
import pathlib
import sys

try:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    print("make_chat_reference: jinja2 is not installed (python3-jinja2 or pip jinja2); skipping", file=sys.stderr)
    sys.exit(77)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DIR = ROOT / "tests" / "data" / "chat_templates"
BOS, EOS = "<s>", "</s>"
FIXED_TIME = 1735787045  # 2025-01-02 03:04:05 UTC: what strftime_now formats (chat_template_test sets the same)


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


def S(text):
    return {"role": "system", "content": text}


MESSAGE_LISTS = [
    [U("Hi there!")],
    [S("You are a helpful assistant."), U("What is the capital of France?")],
    [U("Hello"), A("Hi! How can I help?"), U("Tell me a joke.")],
    [S("Be brief."), U("One"), A("Two"), U("Three"), A("Four")],
    [U("")],
    [S(""), U(""), A(""), U("")],
    [U("  padded with spaces and newlines \n\n"), A("\tTabbed answer\t"), U("ok")],
    [U("日本語のテキスト、中文，한국어 and English"), A("Ответ по-русски: Привет, мир!"), U("Ωμέγα and ÉCOLE élève Ça")],
    [U("emoji 👩‍👩‍👧‍👦 family, flags 🇫🇷🇯🇵, skin tone 👍🏽"), A("combining: e\u0301 a\u0308 and zero\u200bwidth")],
    [U("العربية نص من اليمين إلى اليسار"), A("हिन्दी पाठ"), U("Is this a question?")],
    [U("Code:\n```python\ndef f(x):\n    return x * 2\n```\nexplain"), A("<think>\nreasoning here\n</think>\n\nThe function doubles x.")],
    [S("System with {{ braces }} and {% tags %} inside"), U("Quotes ' \" and backslash \\ stay as they are")],
    [U("first"), U("second user turn in a row")],
    [A("assistant speaks first")],
    [S("sys"), U("question"), {"role": "tool", "content": "{\"temperature\": 21}"}, A("It is 21 degrees.")],
    [U("Hi there, how are you today? This is a longer message with several words in it."), A("Fine."), U("Good"), A("Great"), U("Bye")],
    [],
]


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override of jinja2's tojson (no HTML escaping, options exposed)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(format):
    # transformers formats datetime.now(); the references use a fixed instant instead
    return datetime.datetime.fromtimestamp(FIXED_TIME, tz=datetime.timezone.utc).strftime(format)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class Raised(Exception):
    pass


def render(env, source, messages, add_generation_prompt):
    template = env.from_string(source)
    try:
        return {"output": template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          bos_token=BOS, eos_token=EOS, tools=None, documents=None)}
    except jinja2.exceptions.TemplateError as e:
        kind = "raise" if type(e) is jinja2.exceptions.TemplateError else "error"
        return {"error": str(e), "error_kind": kind}
    except Exception as e:  # a Python error inside the template (e.g. an index on an empty list)
        return {"error": f"{type(e).__name__}: {e}", "error_kind": "error"}


def build():
    env = environment()
    cases = []
    for path in sorted(DIR.glob("*.jinja")):
        source = path.read_text(encoding="utf-8")
        for i, messages in enumerate(MESSAGE_LISTS):
            for gen in (False, True):
                case = {"template": path.name, "messages": messages, "add_generation_prompt": gen}
                case.update(render(env, source, messages, gen))
                cases.append(case)
    return {"bos_token": BOS, "eos_token": EOS, "fixed_time": FIXED_TIME, "jinja2_version": jinja2.__version__, "cases": cases}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing")
    args = parser.parse_args()
    text = json.dumps(build(), ensure_ascii=False, indent=1) + "\n"
    out = DIR / "reference.json"
    if args.check:
        old = json.loads(out.read_text(encoding="utf-8"))
        new = json.loads(text)
        old.pop("jinja2_version", None)
        new.pop("jinja2_version", None)
        if old != new:
            print(f"{out} differs from what jinja2 {jinja2.__version__} renders now", file=sys.stderr)
            return 1
        print(f"{out}: up to date ({len(new['cases'])} cases)")
        return 0
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
