"""Writes pretokenizer_reference.json: token ids from llama.cpp itself (llama-cpp-python,
`Llama(vocab_only=True).tokenize(text, add_bos=False, special=True)`), an implementation independent
of probespec's, for SmolLM2's vocabulary re-labelled with each supported `tokenizer.ggml.pre` and
a few tokens appended so that digit grouping and LLaMA 3's ignore_merges make a difference.

Run: pip install gguf llama-cpp-python; python make_reference.py SmolLM2-135M-Instruct.Q4_1.gguf
(transformers' GGUF conversion agrees on every case except the two where it departs from the
families' tokenizer.json: it has no ignore_merges for llama-bpe and no digit split for smollm.)
"""
import json
import os
import sys
import tempfile

from gguf import GGUFReader, GGUFValueType, GGUFWriter
from llama_cpp import Llama

EXTRA_TOKENS = ["12", "123", "45", "20", "202", "2024", "\u0120zzyzx"]
EXTRA_MERGES = ["1 2", "12 3", "4 5", "2 0", "20 2", "202 4"]
PRES = ["llama-bpe", "qwen2", "gpt-2", "smollm"]
TEXTS = [
    "Hello world",
    "Hello 12345 world, it's 2024-06-01.",
    "I can't, you'll, we've, they're, she'd, I'M, it'S",
    "  multiple   spaces\n\n\nand\r\nnewlines\t\ttabs  ",
    "Café naïve résumé é",
    "日本語のテキスト",
    "Emoji: 🦀🚀 👍🏽 family 👨\u200d👩\u200d👧",
    "<|im_start|>user\nHi<|im_end|>\n",
    "x=3.14159; y = 1,000,000 + 42",
    "(parenthesis) $100 #tag 'quoted' 12345678 2024 zzyzx",
    'fn main() {\n    println!("{}", 1 + 2);\n}\n',
    "   leading and trailing   ",
    "line one\n\n  indented line\n",
]


def write_variant(src, dst, pre):
    r = GGUFReader(src)
    arch_field = r.fields["general.architecture"]
    w = GGUFWriter(dst, bytes(arch_field.parts[arch_field.data[0]]).decode())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        t = f.types[0]
        if k == "tokenizer.ggml.pre":
            w.add_string(k, pre)
        elif t == GGUFValueType.ARRAY:
            if f.types[-1] == GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            vals += {
                "tokenizer.ggml.tokens": EXTRA_TOKENS,
                "tokenizer.ggml.merges": EXTRA_MERGES,
                "tokenizer.ggml.token_type": [1] * len(EXTRA_TOKENS),
            }.get(k, [])
            w.add_array(k, vals)
        elif t == GGUFValueType.STRING:
            w.add_string(k, bytes(f.parts[f.data[0]]).decode("utf-8"))
        else:
            w.add_key_value(k, f.parts[f.data[0]].tolist()[0], t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenize(path, texts):
    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    return [[t, llm.tokenize(t.encode("utf-8"), add_bos=False, special=True)] for t in texts]


out = {"extra_tokens": EXTRA_TOKENS, "extra_merges": EXTRA_MERGES, "variants": {}}
with tempfile.TemporaryDirectory() as tmp:
    for pre in PRES:
        path = os.path.join(tmp, f"{pre}.gguf")
        write_variant(sys.argv[1], path, pre)
        out["variants"][pre] = tokenize(path, TEXTS)
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "pretokenizer_reference.json"), "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False, indent=1)
    f.write("\n")
