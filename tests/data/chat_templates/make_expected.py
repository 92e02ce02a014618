"""Writes expected.json: chat templates rendered by transformers' own jinja2 environment
(transformers.utils.chat_template_utils._compile_jinja_template, what apply_chat_template uses).

The .jinja files beside this script are the official Hub templates as copied into llama.cpp's
models/templates/ (Qwen/Qwen3-0.6B, meta-llama/Llama-3.1-8B-Instruct); SmolLM2's is read from the
GGUF's tokenizer.chat_template. Run: pip install transformers jinja2 gguf; python make_expected.py GGUF
"""
import json
import os
import sys

from gguf import GGUFReader
from transformers.utils.chat_template_utils import _compile_jinja_template

here = os.path.dirname(os.path.abspath(__file__))
field = GGUFReader(sys.argv[1]).fields["tokenizer.chat_template"]
smollm2 = bytes(field.parts[field.data[0]]).decode("utf-8")

cases = {
    "system_user": {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "add_generation_prompt": True,
    },
    "multi_turn_think": {
        "messages": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"},
            {"role": "user", "content": "  Tell me a joke.  "},
        ],
        "add_generation_prompt": True,
    },
    "single_no_prompt": {
        "messages": [{"role": "user", "content": "Héllo 👋"}],
        "add_generation_prompt": False,
    },
    "capital_of_france": {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "add_generation_prompt": True,
    },
    # Template variables passed as apply_chat_template's **kwargs (probespec's --chat-template-kwargs).
    "no_thinking": {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "add_generation_prompt": True,
        "template_kwargs": {"enable_thinking": False},
    },
    "multi_turn_no_thinking": {
        "messages": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        "add_generation_prompt": True,
        "template_kwargs": {"enable_thinking": False, "unused_by_the_template": [1, "two"]},
    },
    "thinking_explicitly_on": {
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "add_generation_prompt": True,
        "template_kwargs": {"enable_thinking": True},
    },
}
templates = {
    "smollm2": {"file": None, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
    "qwen3": {"file": "Qwen-Qwen3-0.6B.jinja", "bos_token": "", "eos_token": "<|im_end|>"},
    "llama31": {
        "file": "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
    },
}
expected = {}
for name, t in templates.items():
    src = smollm2 if t["file"] is None else open(os.path.join(here, t["file"]), encoding="utf-8").read()
    compiled = _compile_jinja_template(src)
    for case, c in cases.items():
        expected[f"{name}/{case}"] = compiled.render(
            messages=c["messages"],
            add_generation_prompt=c["add_generation_prompt"],
            bos_token=t["bos_token"],
            eos_token=t["eos_token"],
            tools=None,
            **c.get("template_kwargs", {}),
        )
with open(os.path.join(here, "expected.json"), "w", encoding="utf-8") as f:
    json.dump({"cases": cases, "templates": templates, "expected": expected}, f, ensure_ascii=False, indent=1)
    f.write("\n")
