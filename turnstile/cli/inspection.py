"""`turnstile inspect DIR`: a terminal summary of an output directory (rich).

Without `--rollout` it prints totals (rollouts by status, samples, turns by status,
tokens), reward statistics per reward name, policy versions, stitching breaks by kind,
error and aborted turns, and the slowest turns. With `--rollout ID` it prints that
rollout's rewards and metadata, its turns, and each sample's tokens decoded (with
`--tokenizer DIR`, or the tokenizer the shards name if it exists here; else token ids)
with the loss mask and the behaviour logprob as colour, and each stitching break with
the mismatching tokens side by side. Only published shards are read, so it is safe on
a directory a running proxy is writing.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from turnstile.view.data import OutputData, TokenText, resolve_tokenizer

NAME = "inspect"
HELP = "summarise an output directory in the terminal"
DESCRIPTION = (
    "Summarise the published shards of an output directory: rollouts, "
    "samples, turns, tokens, rewards per name, policy versions, stitching breaks by "
    "kind, error and aborted turns and the slowest turns. --rollout ID prints one "
    "rollout's turns with tokens decoded and the loss mask shown."
)

# Rows of the "error and aborted" and "slowest" tables: enough to spot a pattern,
# short enough to fit a screen.
DEFAULT_TOP: Final[int] = 10
# Tokens printed per turn segment of a sample; the middle of longer segments is elided
# (a 32k-token system prompt would otherwise scroll everything else away).
DEFAULT_MAX_SEGMENT_TOKENS: Final[int] = 400
# Tokens of context on each side of a break in the side-by-side view.
BREAK_WINDOW_TOKENS: Final[int] = 6
# Behaviour probability thresholds of the token colours.
HIGH_PROB: Final[float] = 0.5
LOW_PROB: Final[float] = 0.1


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _bytes(n: int) -> str:
    """A byte count as people read it (exact below 1 KiB)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit} ({n} B)"
        value /= 1024
    raise AssertionError("unreachable")


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    return table


def summary(data: OutputData, console: Console, top: int = DEFAULT_TOP) -> None:
    """The whole directory at a glance."""
    rollouts, samples, turns = data.rollouts(), data.samples(), data.turns()
    shards = {t: len(data.reader.files(t)) for t in ("turns", "samples", "rollouts", "media")}
    media = data.media_summary()
    console.print(
        Panel.fit(
            f"[bold]{data.directory}[/]\n"
            + ", ".join(f"{n} {t} shards" for t, n in shards.items()),
            title="turnstile inspect",
        )
    )
    overview = _table("Overview", "what", "count")
    by_status = Counter(r["status"] for r in rollouts)
    overview.add_row("rollouts", str(len(rollouts)))
    for status, n in sorted(by_status.items()):
        overview.add_row(f"  {status}", str(n))
    overview.add_row("samples", str(len(samples)))
    overview.add_row("turns", str(len(turns)))
    for status, n in sorted(Counter(t["status"] for t in turns).items()):
        overview.add_row(f"  {status}", str(n))
    overview.add_row("prompt tokens", str(sum(t["num_prompt_tokens"] for t in turns)))
    overview.add_row("completion tokens", str(sum(t["num_completion_tokens"] for t in turns)))
    overview.add_row("sample tokens", str(sum(s["num_tokens"] for s in samples)))
    overview.add_row("  with loss", str(sum(s["num_loss_tokens"] for s in samples)))
    overview.add_row("images stored (media)", str(media["images"]))
    overview.add_row("  bytes", _bytes(media["bytes"]))
    console.print(overview)

    rewards = _table("Rewards", "name", "n", "mean", "std", "min", "max")
    values: dict[str, list[float]] = {}
    for r in rollouts:
        for name, v in r["rewards"].items():
            values.setdefault(name, []).append(v)
        if r["reward"] is not None:
            values.setdefault("(sum)", []).append(r["reward"])
    for name, vs in sorted(values.items()):
        std = statistics.pstdev(vs) if len(vs) > 1 else 0.0
        rewards.add_row(
            name, str(len(vs)), _fmt(statistics.fmean(vs)), _fmt(std), _fmt(min(vs)), _fmt(max(vs))
        )
    console.print(rewards if values else Text("No rewards recorded.", style="dim"))

    versions = _table("Policy versions", "version", "turns", "rollouts", "mean reward")
    turns_by_version = Counter(t["policy_version"] for t in turns)
    rollouts_by_version: dict[int, list[float | None]] = {}
    for r in rollouts:
        if r["max_policy_version"] is not None:
            rollouts_by_version.setdefault(r["max_policy_version"], []).append(r["reward"])
    for version in sorted(set(turns_by_version) | set(rollouts_by_version)):
        rs = [x for x in rollouts_by_version.get(version, []) if x is not None]
        versions.add_row(
            str(version),
            str(turns_by_version.get(version, 0)),
            str(len(rollouts_by_version.get(version, []))),
            _fmt(statistics.fmean(rs)) if rs else "-",
        )
    console.print(versions)

    breaks = Counter(s["break_kind"] for s in samples if s["parent_sample_index"] is not None)
    drift = _table("Stitching breaks (drift)", "kind", "samples")
    for kind, n in breaks.most_common():
        drift.add_row(kind, str(n))
    console.print(drift if breaks else Text("No stitching breaks.", style="green"))

    bad = [t for t in turns if t["status"] != "ok"]
    failed = _table(
        f"Error and aborted turns ({len(bad)})", "rollout", "turn", "status", "http", "error"
    )
    for t in bad[:top]:
        failed.add_row(
            t["rollout_id"],
            str(t["turn_index"]),
            t["status"],
            str(t["http_status"]),
            (t["error"] or "")[:80],
        )
    console.print(failed if bad else Text("No error or aborted turns.", style="green"))

    slow = _table(
        "Slowest turns", "rollout", "turn", "total s", "ttft s", "queue s", "completion tokens"
    )
    for t in sorted(turns, key=lambda t: t["total_s"], reverse=True)[:top]:
        slow.add_row(
            t["rollout_id"],
            str(t["turn_index"]),
            _fmt(t["total_s"]),
            _fmt(t["ttft_s"]),
            _fmt(t["queue_s"]),
            str(t["num_completion_tokens"]),
        )
    if turns:
        console.print(slow)


def token_style(mask: int, logprob: float | None, special: bool) -> str:
    """The colour of one token: grey off the loss mask, else by behaviour probability."""
    if special:
        return "bold magenta" if mask == 0 else "bold magenta on grey23"
    if mask == 0:
        return "grey62"
    if logprob is None:
        return "cyan"
    p = math.exp(logprob)
    return "green" if p >= HIGH_PROB else ("yellow" if p >= LOW_PROB else "bold red")


def _tokens_text(
    sample: dict[str, Any], start: int, end: int, tokens: TokenText, max_tokens: int
) -> Text:
    ids, mask, lps = sample["input_ids"], sample["loss_mask"], sample["behavior_logprobs"]
    positions: Sequence[int] = range(start, end)
    elided = 0
    if end - start > max_tokens:
        half = max_tokens // 2
        positions = [*range(start, start + half), -1, *range(end - half, end)]
        elided = end - start - 2 * half
    out = Text()
    for i in positions:
        if i < 0:
            out.append(f" … {elided} tokens … ", style="italic dim")
            continue
        tid = int(ids[i])
        out.append(tokens.piece(tid), style=token_style(mask[i], lps[i], tokens.is_special(tid)))
    return out


def _break_table(rollout: dict[str, Any], sample: dict[str, Any], tokens: TokenText) -> Table:
    parent = rollout["samples"][sample["parent_sample_index"]]
    pos = sample["break_position"] or 0
    lo = max(0, pos - BREAK_WINDOW_TOKENS)
    table = Table(title=f"break at token {pos}: {sample['break_kind']}", title_justify="left")
    table.add_column("position", justify="right")
    table.add_column(f"sample {parent['sample_index']} (context)")
    table.add_column(f"sample {sample['sample_index']} (prompt)")
    a, b = parent["input_ids"], sample["input_ids"]
    for i in range(lo, pos + BREAK_WINDOW_TOKENS):
        left = tokens.piece(int(a[i])) if i < len(a) else ""
        right = tokens.piece(int(b[i])) if i < len(b) else ""
        differs = i >= pos
        style = "bold red" if differs else ""
        table.add_row(str(i), Text(repr(left), style=style), Text(repr(right), style=style))
    return table


def show_rollout(
    data: OutputData,
    rollout_id: str,
    tokens: TokenText,
    console: Console,
    max_tokens: int = DEFAULT_MAX_SEGMENT_TOKENS,
) -> bool:
    """One rollout in full; False if the directory has no such rollout."""
    rollout = data.rollout(rollout_id)
    if rollout is None:
        return False
    head = [f"[bold]rollout {rollout_id}[/]"]
    for key in ("status", "group_id", "task_id", "policy_versions"):
        if rollout.get(key) is not None:
            head.append(f"{key}: {rollout[key]}")
    if rollout.get("rewards"):
        head.append("rewards: " + ", ".join(f"{k}={v:g}" for k, v in rollout["rewards"].items()))
    for name, info in (rollout.get("rewards_info") or {}).items():
        head.append(f"  {name}: {info}")
    if rollout.get("metadata") is not None:
        head.append(f"metadata: {rollout['metadata']}")
    console.print(Panel.fit("\n".join(head)))
    turns = _table(
        "Turns",
        "turn",
        "choice",
        "status",
        "policy",
        "prompt",
        "completion",
        "finish",
        "ttft s",
        "total s",
        "error",
    )
    for t in rollout["turns"]:
        turns.add_row(
            str(t["turn_index"]),
            str(t["choice_index"]),
            t["status"],
            str(t["policy_version"]),
            str(t["num_prompt_tokens"]),
            str(t["num_completion_tokens"]),
            t["finish_reason"] or "-",
            _fmt(t["ttft_s"]),
            _fmt(t["total_s"]),
            (t["error"] or "")[:60],
        )
    console.print(turns)
    legend = Text("tokens: ")
    legend.append("prompt/tool (mask 0) ", style="grey62")
    legend.append(f"sampled p>={HIGH_PROB} ", style="green")
    legend.append(f"p>={LOW_PROB} ", style="yellow")
    legend.append("low p ", style="bold red")
    legend.append("special", style="bold magenta")
    if not tokens.available:
        legend.append("  (no tokenizer: ids shown; pass --tokenizer DIR)", style="italic")
    console.print(legend)
    for sample in rollout["samples"]:
        title = (
            f"sample {sample['sample_index']}: {sample['num_tokens']} tokens, "
            f"{sample['num_loss_tokens']} with loss, {sample['num_turns']} turns, "
            f"starts: {sample['break_kind']}"
        )
        console.rule(title, align="left")
        if sample["parent_sample_index"] is not None:
            console.print(
                f"[red]breaks from sample {sample['parent_sample_index']}[/]: "
                f"{sample['break_detail'] or ''}"
            )
            console.print(_break_table(rollout, sample, tokens))
        for span in sample["turn_spans"]:
            console.print(
                Text(
                    f"── turn {span['turn_index']} (choice "
                    f"{span['choice_index']}) prompt +"
                    f"{span['completion_start'] - span['prompt_start']} tokens",
                    style="bold blue",
                )
            )
            console.print(
                _tokens_text(
                    sample, span["prompt_start"], span["completion_start"], tokens, max_tokens
                )
            )
            console.print(
                Text(
                    f"── turn {span['turn_index']} completion "
                    f"{span['completion_end'] - span['completion_start']} tokens",
                    style="bold green",
                )
            )
            console.print(
                _tokens_text(
                    sample, span["completion_start"], span["completion_end"], tokens, max_tokens
                )
            )
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=Path, help="Turnstile output directory")
    p.add_argument("--rollout", metavar="ID", help="show one rollout's turns and tokens")
    p.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="local tokenizer directory to decode tokens (default: the one the "
        "shards were recorded with, if it exists here; else ids are shown)",
    )
    p.add_argument(
        "--top",
        type=int,
        default=DEFAULT_TOP,
        help=f"rows of the error and slowest tables (default {DEFAULT_TOP})",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_SEGMENT_TOKENS,
        help="tokens shown per turn segment before the middle is elided "
        f"(default {DEFAULT_MAX_SEGMENT_TOKENS})",
    )


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console()
    try:
        data = OutputData(args.directory)
    except FileNotFoundError as exc:
        console.print(f"[red]turnstile inspect: {exc}[/]")
        return 2
    if args.rollout is None:
        summary(data, console, args.top)
        return 0
    try:
        tokens = TokenText(resolve_tokenizer(args.tokenizer, data.reader))
    except (FileNotFoundError, OSError, ValueError) as exc:
        console.print(f"[red]turnstile inspect: cannot load the tokenizer: {exc}[/]")
        return 2
    if not show_rollout(data, args.rollout, tokens, console, args.max_tokens):
        console.print(f"[red]turnstile inspect: no rollout {args.rollout!r} in {args.directory}[/]")
        return 1
    return 0
