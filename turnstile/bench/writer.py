"""The recording cost of one turn, measured in-process: journal frame and Parquet row.

`turnstile bench` reports what recording costs off the request path: encoding a turn
into its journal frame, and building and publishing Parquet shards of turns, each
timed with the CPU clock of the thread doing it (`time.thread_time`), so other load on
the machine does not count. Turns have the bench's shape (default 2,000 prompt and 500
completion tokens with logprobs, chat messages of a realistic size).

    python -m turnstile.bench.writer --rows 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

import numpy as np

from turnstile.journal.codec import encode_event
from turnstile.output.shards import ParquetShardSink
from turnstile.records import Timings, TokenSource, TurnRecord, TurnStatus

# One shard of the default size: the writer's steady state publishes shards this big.
DEFAULT_ROWS: Final[int] = 4096
# Repeats of each measurement; the median is reported.
REPEATS: Final[int] = 3


@dataclass(frozen=True, slots=True)
class WriterResult:
    rows: int
    prompt_tokens: int
    completion_tokens: int
    journal_encode_us_per_turn: float
    shard_write_us_per_row: float
    shard_rows_per_s_per_core: float
    recording_core_ms_per_turn: float  # journal frame + shard row


def make_turns(rows: int, prompt_tokens: int, completion_tokens: int) -> list[TurnRecord]:
    rng = np.random.default_rng(0)
    message = json.dumps([{"role": "user", "content": "x" * (prompt_tokens * 4)}])
    reply = json.dumps({"role": "assistant", "content": "y" * (completion_tokens * 4)})
    return [
        TurnRecord(
            turn_id=f"turn-{i:08d}",
            rollout_id=f"rollout-{i // 4:06d}",
            turn_index=i % 4,
            choice_index=0,
            endpoint="chat.completions",
            model="bench-model",
            policy_version=1,
            status=TurnStatus.OK,
            token_source=TokenSource.BACKEND,
            prompt_token_ids=rng.integers(0, 151_000, prompt_tokens, dtype=np.int32),
            completion_token_ids=rng.integers(0, 151_000, completion_tokens, dtype=np.int32),
            behavior_logprobs=(-rng.random(completion_tokens) * 3).astype(np.float32),
            finish_reason="length",
            stop_reason=None,
            request_messages_json=message,
            request_tools_json=None,
            request_prompt_json=None,
            response_message_json=reply,
            response_text=None,
            sampling_params_json='{"temperature": 1.0}',
            timings=Timings(received_at=time.time(), queue_s=0.0, ttft_s=0.01, total_s=1.0),
            http_status=200,
        )
        for i in range(rows)
    ]


def measure(
    rows: int = DEFAULT_ROWS, prompt_tokens: int = 2000, completion_tokens: int = 500
) -> WriterResult:
    turns = make_turns(rows, prompt_tokens, completion_tokens)
    encode, write = [], []
    for _ in range(REPEATS):
        start = time.thread_time()
        for turn in turns:
            encode_event(turn)
        encode.append((time.thread_time() - start) / rows)
        with tempfile.TemporaryDirectory(prefix="turnstile-bench-writer-") as tmp:
            sink = ParquetShardSink(Path(tmp), writer_id="bench", identity={}, max_rows=rows)
            start = time.thread_time()
            sink.write_turns(turns)
            sink.close()
            write.append((time.thread_time() - start) / rows)
    enc, wr = float(np.median(encode)), float(np.median(write))
    return WriterResult(
        rows=rows,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        journal_encode_us_per_turn=round(enc * 1e6, 1),
        shard_write_us_per_row=round(wr * 1e6, 1),
        shard_rows_per_s_per_core=round(1.0 / wr) if wr > 0 else 0.0,
        recording_core_ms_per_turn=round((enc + wr) * 1e3, 3),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--completion-tokens", type=int, default=500)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = asdict(measure(args.rows, args.prompt_tokens, args.completion_tokens))
    text = json.dumps(result, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
