"""The learning example, asynchronous: rollouts for step k+1 run while step k trains.

The same toy task, model and estimators as ``learn.py`` (GRPO, GDPO and MRTPO on the tiny
Qwen3 with an untied output layer; rewards ``low`` and ``even``), with the loop of a real
asynchronous RL system:

- a rollout thread generates round r+1 (``groups x group_size`` rollouts, ``group_size``
  declared on ``POST /rollouts``) as soon as the trainer has taken round r, so it samples
  with the weights the trainer is updating (``--ahead`` rounds may run ahead; 1 by
  default);
- the trainer reads each round with ``ShardReader.wait_for(group_ids=...)`` (a group is
  published when its last rollout finishes), computes the advantages, takes one step of
  the Proximal KL loss and pushes the new weights to vLLM, alternating the two fencing
  modes that lose no tokens: ``keep`` (vLLM reloads, then ``POST /admin/policy_version``;
  calls in flight go on, and the tokens they sample after the switch carry the new
  version) and ``pause``
  (``POST /admin/pause``: new calls wait at Turnstile's fence and the calls in flight
  finish; vLLM reloads; ``POST /admin/resume {"policy_version"}``);
- staleness: a round is trained one version after the one that sampled it (``ahead``
  versions at most). It is **corrected** with token TIS: each token's weight is
  ``min(pi_theta / mu, cap)`` with ``mu`` the behaviour logprob Turnstile recorded, so a
  stale token counts by how likely the current policy is to sample it; tokens more than
  ``--max-staleness`` versions old (per token, from the recorded
  ``policy_version_spans``) are **masked** out of the loss before the step, and a sample
  with no token left is dropped.

The reward of each round (mean ``low + even``, at most 2) is printed and written as JSON,
with the policy versions recorded in it, the staleness it was trained at, the number of
calls in flight at each push, and the mean TIS weight of the stale tokens.

    .venv/bin/python examples/train/learn_async.py --steps 6 --json reward-async.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import queue
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import learn
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from turnstile.dev import devstack
from turnstile.reader import open_output
from turnstile.train import batches, losses, policy
from turnstile.train.batches import samples_from_batch

MODES: Final[tuple[str, ...]] = ("keep", "pause")
# A round is published within the proxy's publish_delay_s (0.5 s) of its last finish; 120 s
# only bounds the wait on a badly overloaded machine.
ROUND_WAIT_S: Final[float] = 120.0
# A pause waits for the calls in flight (a few tokens each from the tiny model); the proxy
# gives up after its own FENCE_DRAIN_TIMEOUT_S (300 s) and says so, which this outlasts.
PAUSE_TIMEOUT_S: Final[float] = 360.0
# Rollout calls in flight at once: fewer than learn.py's 8, so that a round takes about as
# long as a training step and calls are in flight when the weights are pushed.
ASYNC_CONCURRENCY: Final[int] = 2


@dataclass
class AsyncConfig(learn.Config):
    ahead: int = 1  # rounds the rollout thread may run ahead of the trainer
    max_staleness: int = 1  # tokens older than this many versions leave the loss
    concurrency: int = ASYNC_CONCURRENCY


@dataclass
class Push:
    version: int
    mode: str
    in_flight: int  # rollout calls in flight when the switch happened
    seconds: float


@dataclass
class AsyncCurve(learn.Curve):
    trained_staleness: list[list[int]] = field(default_factory=list)  # per step, per sample
    dropped: list[int] = field(default_factory=list)  # per step: samples with no fresh token
    masked_tokens: list[int] = field(default_factory=list)  # per step: stale tokens masked
    stale_tis_weight: list[float | None] = field(default_factory=list)  # per step
    pushes: list[Push] = field(default_factory=list)
    reward_by_version: dict[int, float] = field(default_factory=dict)
    tokens_by_version: dict[int, int] = field(default_factory=dict)  # sampled, recorded
    turns_not_ok: int = 0  # turns recorded aborted or error
    tokens_lost: int = 0  # tokens asked for (min_tokens = max_tokens) but not recorded


@dataclass
class Round:
    index: int
    group_ids: list[str]
    rewards: list[dict[str, float]]


class Producer(threading.Thread):
    """Generates rounds of rollouts through the proxy, at most ``ahead`` rounds ahead of
    the trainer (``release`` once per round the trainer takes)."""

    def __init__(self, proxy: str, estimator: str, rounds: int, cfg: AsyncConfig) -> None:
        super().__init__(daemon=True)
        self.proxy, self.estimator, self.rounds, self.cfg = proxy, estimator, rounds, cfg
        self.allowed = threading.Semaphore(cfg.ahead)
        self.done: queue.Queue[Round | BaseException] = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self.stopped = threading.Event()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def release(self) -> None:
        self.allowed.release()

    def run(self) -> None:
        try:
            for r in range(self.rounds):
                while not self.allowed.acquire(timeout=0.1):
                    if self.stopped.is_set():
                        return
                groups = [f"{self.estimator}-r{r}-g{g}" for g in range(self.cfg.groups)]
                with concurrent.futures.ThreadPoolExecutor(self.cfg.concurrency) as pool:
                    jobs = [
                        pool.submit(self._rollout, r, g, i, groups[g])
                        for g in range(self.cfg.groups)
                        for i in range(self.cfg.group_size)
                    ]
                    rewards = [j.result() for j in jobs]
                self.done.put(Round(r, groups, rewards))
        except BaseException as exc:  # handed to the trainer, which raises it
            self.done.put(exc)

    def _rollout(self, r: int, group: int, index: int, group_id: str) -> dict[str, float]:
        cfg = self.cfg
        created = learn._http(
            "POST",
            f"{self.proxy}/rollouts",
            {"group_id": group_id, "group_size": cfg.group_size, "task_id": f"prompt-{group}"},
        )
        with self._lock:
            self._in_flight += 1
        try:
            reply = learn._http(
                "POST",
                f"{created['base_url']}/completions",
                {
                    "model": devstack.DEFAULT_SERVED_MODEL_NAME,
                    "prompt": list(learn.PROMPTS[group % len(learn.PROMPTS)]),
                    "max_tokens": cfg.max_tokens,
                    "min_tokens": cfg.max_tokens,
                    "temperature": 1.0,
                    "seed": cfg.seed * 1_000_003 + r * 10_007 + group * 101 + index,
                    "return_token_ids": True,
                },
            )
        finally:
            with self._lock:
                self._in_flight -= 1
        rewards, info = learn.score(reply["choices"][0]["token_ids"])
        rid = created["rollout_id"]
        learn._http(
            "POST", f"{self.proxy}/rollouts/{rid}/finish", {"rewards": rewards, "info": info}
        )
        return rewards

    def next_round(self) -> Round:
        got = self.done.get(timeout=ROUND_WAIT_S + learn.HTTP_TIMEOUT_S)
        if isinstance(got, BaseException):
            raise got
        return got


class AsyncTrainer(learn.Trainer):
    """``learn.Trainer`` that also reports the mean TIS weight of the stale tokens."""

    def step_with_stats(self, samples: Sequence[batches.TrainSample], version: int) -> float | None:
        batch = batches.to_torch(batches.pad_batch(samples))
        logp = policy.token_logprobs(self.model, batch["input_ids"], batch["attention_mask"])
        out = losses.proximal_kl_loss(
            logp,
            logp.detach(),
            batch["behavior_logprobs"],
            logp.detach(),
            batch["advantages"],
            batch["loss_mask"],
            losses.ProximalKLConfig(beta=0.0),
        )
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        torch.autograd.backward(out.loss)
        for optimizer in self.optimizers:
            optimizer.step()
        # Stale token by token (the recorded `policy_version_spans`): a stream that
        # straddled a `keep` push has fresh tokens after the switch.
        sampled_by = batch["behavior_versions"]
        tokens = (batch["loss_mask"] > 0) & (sampled_by >= 0) & (sampled_by < version)
        return float(out.weights[tokens].mean()) if bool(tokens.any()) else None


def push(proxy: str, backend: str, version: int, mode: str, producer: Producer) -> Push:
    started = time.monotonic()
    if mode == "keep":
        in_flight = producer.in_flight
        # Reload first: a token sampled between the reload and the switch is labelled
        # with the older version (counted staler, never fresher, than it is).
        learn.reload_backend(backend)
        learn._http("POST", f"{proxy}/admin/policy_version", {"policy_version": version})
    else:
        paused = _post(f"{proxy}/admin/pause", {"mode": "pause"}, PAUSE_TIMEOUT_S)
        in_flight = int(paused["in_flight_at_pause"])
        try:
            learn.reload_backend(backend)
        finally:
            learn._http("POST", f"{proxy}/admin/resume", {"policy_version": version})
    return Push(version, mode, in_flight, time.monotonic() - started)


def _post(url: str, body: Any, timeout_s: float) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def run_estimator(
    estimator: str,
    cfg: AsyncConfig,
    backend: str,
    model_dir: Path,
    pristine: Path,
    workdir: Path,
) -> AsyncCurve:
    started = time.monotonic()
    shutil.copyfile(pristine, model_dir / "model.safetensors")
    learn.reload_backend(backend)
    output = workdir / f"out-async-{estimator}"
    proxy = learn.start_proxy(backend, output, workdir / f"turnstile-async-{estimator}.log")
    curve = AsyncCurve(estimator)
    trainer = AsyncTrainer(model_dir, cfg)
    # Rounds 0..steps-1 are trained on; round `steps` was sampled during the last step,
    # and the last `ahead` rounds after the last push measure the final policy.
    producer = Producer(proxy.url, estimator, cfg.steps + 1 + cfg.ahead, cfg)
    producer.start()
    reader = open_output(output)
    version = 0
    rewards_by_version: dict[int, list[float]] = {}
    try:
        for k in range(cfg.steps + 1 + cfg.ahead):
            rnd = producer.next_round()
            producer.release()  # the next round starts now, while this one trains
            table = reader.wait_for(group_ids=rnd.group_ids, timeout_s=ROUND_WAIT_S)
            samples = list(samples_from_batch(table))
            low = float(np.mean([r["low"] for r in rnd.rewards]))
            even = float(np.mean([r["even"] for r in rnd.rewards]))
            curve.low.append(low)
            curve.even.append(even)
            curve.rewards.append(low + even)
            for s in samples:
                total = s.rewards["low"] + s.rewards["even"]
                rewards_by_version.setdefault(int(s.max_policy_version or 0), []).append(total)
            curve.policy_versions.append(
                sorted({int(v) for s in samples for v in s.policy_versions})
            )
            print(
                f"{estimator} round {k}: mean reward {curve.rewards[-1]:.3f} "
                f"(low {low:.3f}, even {even:.3f}), policy versions "
                f"{curve.policy_versions[-1]}",
                flush=True,
            )
            if k >= cfg.steps:
                continue  # measures the last policies only
            staleness = [s.staleness(version) for s in samples]
            # Tokens more than max_staleness versions old leave the loss one by one; a
            # sample with none left is dropped.
            curve.masked_tokens.append(
                batches.mask_stale_tokens(samples, version, cfg.max_staleness)
            )
            kept = [s for s in samples if s.num_loss_tokens]
            curve.trained_staleness.append(sorted(staleness))
            curve.staleness.append(max(staleness))
            curve.dropped.append(len(samples) - len(kept))
            if not kept:
                curve.stale_tis_weight.append(None)
                continue
            learn._advantages(estimator, kept, proxy, backend, cfg)
            curve.stale_tis_weight.append(trainer.step_with_stats(kept, version))
            trainer.save()
            version += 1
            mode = MODES[k % len(MODES)]
            curve.pushes.append(push(proxy.url, backend, version, mode, producer))
            p = curve.pushes[-1]
            print(
                f"{estimator} step {k}: trained at version {k} on staleness "
                f"{sorted(set(staleness))} ({curve.dropped[-1]} dropped), pushed version "
                f"{version} ({mode}, {p.in_flight} calls in flight)",
                flush=True,
            )
    finally:
        producer.stopped.set()
        producer.join(learn.HTTP_TIMEOUT_S)
        proxy.stop()
    # Every call asks for exactly max_tokens (min_tokens too): a turn cut by a push, or
    # lost, shows as fewer recorded tokens.
    turns = open_output(output).turns(columns=["policy_version", "status", "num_completion_tokens"])
    for t in turns.to_pylist():
        v, n = int(t["policy_version"]), int(t["num_completion_tokens"])
        curve.tokens_by_version[v] = curve.tokens_by_version.get(v, 0) + n
        curve.turns_not_ok += t["status"] != "ok"
        curve.tokens_lost += max(0, cfg.max_tokens - n)
    curve.reward_by_version = {v: float(np.mean(r)) for v, r in sorted(rewards_by_version.items())}
    curve.seconds = time.monotonic() - started
    return curve


def run(cfg: AsyncConfig) -> list[AsyncCurve]:
    """Start the backend once and train each estimator from the same initial weights."""
    with tempfile.TemporaryDirectory(prefix="turnstile-learn-async-") as tmp:
        workdir = cfg.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if cfg.backend and cfg.backend_model_dir:
            learn.untie_output_layer(cfg.backend_model_dir)
            pristine = workdir / "initial.safetensors"
            initial = load_file(str(devstack.ensure_tiny_qwen3() / "model.safetensors"))
            initial.setdefault("lm_head.weight", initial["model.embed_tokens.weight"].clone())
            save_file(initial, str(pristine), metadata={"format": "pt"})
            return [
                run_estimator(e, cfg, cfg.backend, cfg.backend_model_dir, pristine, workdir)
                for e in cfg.estimators
            ]
        model_dir = workdir / "model"
        if model_dir.exists():
            shutil.rmtree(model_dir)
        shutil.copytree(devstack.ensure_tiny_qwen3(), model_dir)
        learn.untie_output_layer(model_dir)
        pristine = workdir / "initial.safetensors"
        shutil.copyfile(model_dir / "model.safetensors", pristine)
        server = learn.start_backend(model_dir, workdir / "vllm.log")
        with server:
            return [
                run_estimator(e, cfg, server.base_url, model_dir, pristine, workdir)
                for e in cfg.estimators
            ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = AsyncConfig()
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--groups", type=int, default=defaults.groups)
    p.add_argument("--group-size", type=int, default=defaults.group_size)
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--ahead", type=int, default=defaults.ahead)
    p.add_argument("--max-staleness", type=int, default=defaults.max_staleness)
    p.add_argument("--concurrency", type=int, default=defaults.concurrency)
    p.add_argument("--estimators", default=",".join(learn.ESTIMATORS))
    p.add_argument("--workdir", type=Path, help="keep logs, shards and weights here")
    p.add_argument("--plot", type=Path, help="plot the reward curves here (PNG)")
    p.add_argument("--json", type=Path, help="write the reward curves here")
    p.add_argument(
        "--backend",
        metavar="URL",
        help="use this running vLLM (started with VLLM_SERVER_DEV_MODE=1) instead "
        "of starting one; never a shared server: its weights are replaced",
    )
    p.add_argument(
        "--backend-model-dir", type=Path, metavar="DIR", help="the model directory --backend serves"
    )
    args = p.parse_args(argv)
    cfg = AsyncConfig(
        steps=args.steps,
        groups=args.groups,
        group_size=args.group_size,
        max_tokens=args.max_tokens,
        lr=args.lr,
        seed=args.seed,
        estimators=tuple(e for e in args.estimators.split(",") if e),
        workdir=args.workdir,
        backend=args.backend,
        backend_model_dir=args.backend_model_dir,
        ahead=args.ahead,
        max_staleness=args.max_staleness,
        concurrency=args.concurrency,
    )
    unknown = set(cfg.estimators) - set(learn.ESTIMATORS)
    if unknown:
        p.error(f"unknown estimators {sorted(unknown)}; choose from {learn.ESTIMATORS}")
    if cfg.ahead < 1 or cfg.max_staleness < 0 or cfg.concurrency < 1:
        p.error("--ahead and --concurrency must be at least 1, --max-staleness at least 0")
    curves = run(cfg)
    if args.plot:
        learn.plot(curves, args.plot)
    result = {
        c.estimator: {
            "mean_reward": c.rewards,
            "low": c.low,
            "even": c.even,
            "policy_versions": c.policy_versions,
            "trained_staleness": c.trained_staleness,
            "max_staleness": c.staleness,
            "dropped": c.dropped,
            "masked_tokens": c.masked_tokens,
            "stale_tis_weight": c.stale_tis_weight,
            "pushes": [vars(p) for p in c.pushes],
            "reward_by_version": c.reward_by_version,
            "tokens_by_version": dict(sorted(c.tokens_by_version.items())),
            "turns_not_ok": c.turns_not_ok,
            "tokens_lost": c.tokens_lost,
            "seconds": round(c.seconds, 1),
        }
        for c in curves
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    for c in curves:
        print(f"{c.estimator}: " + " ".join(f"{r:.3f}" for r in c.rewards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
