"""What reading a whole answer's recorded fields costs, by each way of reading it.

Turnstile takes the prompt and completion token ids and the logprobs out of every
backend answer. This times the ways of doing it on the bench backend's answer (default
2,000 prompt and 500 completion tokens with logprobs, ~54 KB), in-process, median of
many runs:

- `scan`: the compiled scanner (`turnstile.proxy._tokenscan`, via `tokens.scan`);
- `msgspec`: msgspec types naming only the recorded fields, then numpy (`tokens.decode`,
  the fallback where the extension is not built);
- `pyarrow`: pyarrow's JSON reader with a fixed schema of the recorded fields;
- `orjson`: a full decode into Python objects (what a client that did not ask for the
  recorded fields costs without the scanner: decode, strip, encode);

and, for a client that did not ask for them, `strip-scan` (scan and splice) against
`strip-orjson` (decode, record, strip, encode).

    python -m turnstile.bench.decode [--prompt-tokens 2000] [--completion-tokens 500]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.json as pa_json

from turnstile.bench.backend import Corpus, Shape
from turnstile.proxy import tokens
from turnstile.proxy.capture import CHAT, ResponseCapture, plan_request

# Timed runs per way of reading (after as many warm-up runs as a tenth of them).
DEFAULT_RUNS: Final[int] = 300
_SCHEMA = pa.schema(
    [
        ("model", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        (
            "choices",
            pa.list_(
                pa.struct(
                    [
                        ("index", pa.int32()),
                        ("token_ids", pa.list_(pa.int32())),
                        ("finish_reason", pa.string()),
                        (
                            "logprobs",
                            pa.struct(
                                [("content", pa.list_(pa.struct([("logprob", pa.float32())])))]
                            ),
                        ),
                    ]
                )
            ),
        ),
    ]
)


def answer_body(prompt_tokens: int, completion_tokens: int) -> bytes:
    """The bench backend's non-streaming answer with token ids and logprobs."""
    raw = Corpus(prompt_tokens, completion_tokens).answer(Shape(False, True, True, 0, False))
    assert isinstance(raw, bytes)
    return raw[raw.index(b"\r\n\r\n") + 4 :]


def _pyarrow(body: bytes) -> tuple[Any, Any, Any]:
    table = pa_json.read_json(
        io.BytesIO(body),
        read_options=pa_json.ReadOptions(use_threads=False, block_size=max(len(body), 1 << 20)),
        parse_options=pa_json.ParseOptions(
            explicit_schema=_SCHEMA, unexpected_field_behavior="ignore"
        ),
    )
    choice = table.column("choices").combine_chunks().values
    prompt = table.column("prompt_token_ids").combine_chunks().values.to_numpy()
    ids = choice.field("token_ids").values.to_numpy()
    lps = choice.field("logprobs").field("content").values.field("logprob").to_numpy()
    return prompt, ids, lps


def ways(body: bytes) -> dict[str, Callable[[], object]]:
    """Each way of reading `body`'s recorded fields (the compiled ones only where built)."""
    plan = plan_request(CHAT, {"messages": [{"role": "user", "content": "x"}]}, 0)

    def strip_orjson() -> object:
        capture = ResponseCapture(plan)
        obj = orjson.loads(body)
        capture.add(obj, chunk=False)
        plan.strip(obj)
        capture.choices[0].completion_arrays()
        return orjson.dumps(obj)

    def strip_scan() -> object:
        capture = ResponseCapture(plan)
        found = tokens.scan(body, False, False)
        assert found is not None
        capture.add_answer(found)
        capture.choices[0].completion_arrays()
        return found.strip(body, False, False)

    out: dict[str, Callable[[], object]] = {}
    if tokens.COMPILED:
        out["scan"] = lambda: tokens.scan(body, False, False)
    out["msgspec"] = lambda: tokens.decode(body, False, False)
    out["pyarrow"] = lambda: _pyarrow(body)
    out["orjson"] = lambda: orjson.loads(body)
    if tokens.COMPILED:
        out["strip-scan"] = strip_scan
    out["strip-orjson"] = strip_orjson
    return out


def measure(
    prompt_tokens: int = 2000, completion_tokens: int = 500, runs: int = DEFAULT_RUNS
) -> dict[str, Any]:
    """Median and minimum microseconds per way, with the answer's size."""
    body = answer_body(prompt_tokens, completion_tokens)
    expected = np.asarray(Corpus(prompt_tokens, completion_tokens).ids, dtype=np.int32)
    prompt, ids, _ = _pyarrow(body)  # the schema reads the same ids as the others
    assert np.array_equal(ids, expected) and len(prompt) == prompt_tokens
    result: dict[str, Any] = {"body_bytes": len(body), "compiled": tokens.COMPILED, "us": {}}
    for name, fn in ways(body).items():
        for _ in range(max(1, runs // 10)):
            fn()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        result["us"][name] = {
            "median": round(statistics.median(times) * 1e6, 1),
            "min": round(min(times) * 1e6, 1),
        }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--completion-tokens", type=int, default=500)
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS)
    args = parser.parse_args(argv)
    if min(args.prompt_tokens, args.completion_tokens, args.runs) < 1:
        parser.error("token counts and runs must be at least 1")
    result = measure(args.prompt_tokens, args.completion_tokens, args.runs)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
