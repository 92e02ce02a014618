"""The official `openai` Python client against `probespec serve` (run by tests/serve_openai.rs).

Usage: python3 openai_client.py BASE_URL API_KEY
Checks what the client itself can tell (the shapes parse, streaming adds up to the whole answer, the second
turn of a conversation comes partly from the cache, errors raise the client's exceptions) and prints one
JSON object with the answers, which the Rust test compares with the one-shot CLI's.
"""

import json
import sys

try:
    import openai
except ImportError:
    sys.exit("the `openai` package is missing: run `python3 -m pip install openai` (make test does)")

QUESTION = "What is the capital of France? Answer in one sentence."
FOLLOW_UP = "And of Germany?"
MAX_TOKENS = 24


def main():
    base, key = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)

    models = client.models.list().data
    assert len(models) == 1, models
    model = models[0].id

    first_messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=model, messages=first_messages, max_tokens=MAX_TOKENS)
    answer = first.choices[0].message.content
    assert first.object == "chat.completion", first
    assert first.choices[0].message.role == "assistant"
    assert answer, first
    assert first.usage.completion_tokens > 0 and first.usage.prompt_tokens > 0, first.usage

    chunks = list(
        client.chat.completions.create(
            model=model, messages=first_messages, max_tokens=MAX_TOKENS, stream=True
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer, (streamed, answer)
    assert len(chunks) > 2, chunks
    assert chunks[-1].choices[0].finish_reason == first.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens

    # Another method through the extra body field: greedy decoding is lossless, so the same answer.
    pld = client.chat.completions.create(
        model=model,
        messages=first_messages,
        max_tokens=MAX_TOKENS,
        extra_body={"probespec": {"method": "pld"}},
    )
    assert pld.choices[0].message.content == answer
    assert pld.model_extra["probespec"]["method"] == "pld", pld.model_extra

    # The usual multi-turn client: the whole conversation again, with the answer and a new question.
    second_messages = first_messages + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": FOLLOW_UP},
    ]
    second = client.chat.completions.create(model=model, messages=second_messages, max_tokens=MAX_TOKENS)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1, (cached, first.usage)

    completion = client.completions.create(model=model, prompt="The capital of Italy is", max_tokens=8)
    assert completion.choices[0].text, completion

    try:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
        raise AssertionError("an empty message list was accepted")
    except openai.BadRequestError as e:
        assert "messages" in str(e), e

    print(
        json.dumps(
            {
                "first": answer,
                "first_messages": first_messages,
                "second": second.choices[0].message.content,
                "second_messages": second_messages,
                "cached": cached,
                "completion": completion.choices[0].text,
            }
        )
    )


if __name__ == "__main__":
    main()
