"""A tiny policy that learns through Turnstile: GRPO, GDPO and MRTPO on a toy task.

The whole loop runs on CPUs in a few minutes:

1. a copy of the tiny random Qwen3 (``python -m turnstile.dev.devstack setup``) is served by
   the CPU vLLM, with ``VLLM_SERVER_DEV_MODE=1`` so that ``POST /collective_rpc
   {"method": "reload_weights"}`` reloads the weights from the model directory;
2. ``turnstile serve`` records everything in front of it;
3. every step, the current policy version is set through ``POST /admin/policy_version``;
   ``groups x group_size`` rollouts complete a fixed prompt (token IDs) through the proxy
   and get two verifiable rewards with their verifier information: ``low`` (the share of
   sampled tokens with an id below half the vocabulary) and ``even`` (the share of even
   ids);
4. the trainer follows the published shards (``ShardFollower`` with a staleness filter,
   ``iter_group_batches`` for complete groups), computes the advantages (GRPO, GDPO, or
   MRTPO with the relevance from ``turnstile rescore``'s backend path), and takes one step of
   the Proximal KL loss (token TIS against the recorded behaviour logprobs, beta 0);
5. the new weights are written to the model directory and vLLM reloads them.

Mean reward per step (``low + even``, at most 2) is printed, written as JSON and plotted.

    .venv/bin/python examples/train/learn.py --steps 6 --plot reward.png
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from turnstile.dev import devstack
from turnstile.train import batches, losses, policy, rescore
from turnstile.train.dataset import ShardFollower, iter_group_batches

ESTIMATORS: Final[tuple[str, ...]] = ("grpo", "gdpo", "mrtpo")
# The tiny model's embedding table has this many rows; `low` rewards ids below half.
VOCAB_SIZE: Final[int] = 151936
LOW_LIMIT: Final[int] = VOCAB_SIZE // 2
# Fixed prompts, as token IDs (one per group): the policy completes them.
PROMPTS: Final[tuple[tuple[int, ...], ...]] = (
    (785, 4226, 374),
    (3838, 374, 220, 17, 10, 17, 30),
    (9707, 11, 1879, 0),
    (40, 1075, 279),
)
# A step's rollouts are published by the proxy within `shard_max_age_s` (0.2 s here);
# 120 s only bounds the wait on a badly overloaded machine.
SHARD_WAIT_S: Final[float] = 120.0
# How often the trainer looks for new shards while it waits.
SHARD_POLL_S: Final[float] = 0.2
# The proxy publishes a shard at most this long after a row arrives.
PROXY_SHARD_MAX_AGE_S: Final[str] = "0.2"
# One completion of a few tokens from the tiny model takes well under a second; 120 s
# covers a CPU shared with other work.
HTTP_TIMEOUT_S: Final[float] = 120.0
# `turnstile serve` binds its port within a few seconds.
PROXY_START_TIMEOUT_S: Final[float] = 60.0
# The proxy drains in-flight calls (none here) and publishes on SIGTERM within seconds.
PROXY_STOP_TIMEOUT_S: Final[float] = 30.0
# Rollout calls in flight at once (vLLM batches them; the tiny model serves 8 at a time).
CONCURRENCY: Final[int] = 8


@dataclass
class Config:
    steps: int = 6
    groups: int = 4
    group_size: int = 4
    max_tokens: int = 8
    lr: float = 10.0  # SGD learning rate of the output layer
    lr_body: float = 0.0  # Adam learning rate of every other parameter (0: frozen)
    seed: int = 0
    estimators: tuple[str, ...] = ESTIMATORS
    workdir: Path | None = None
    top_k: int = 20
    # An already running vLLM (started with VLLM_SERVER_DEV_MODE=1) and the model
    # directory it serves, instead of starting one; its weights are overwritten.
    backend: str | None = None
    backend_model_dir: Path | None = None


@dataclass
class Curve:
    estimator: str
    rewards: list[float] = field(default_factory=list)  # mean total reward per version
    low: list[float] = field(default_factory=list)
    even: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # max staleness trained on, per step
    policy_versions: list[list[int]] = field(default_factory=list)  # recorded, per step
    seconds: float = 0.0


def _http(method: str, url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


def score(tokens: Sequence[int]) -> tuple[dict[str, float], dict[str, str]]:
    """The two verifiable rewards of a completion and what each verifier found."""
    ids = list(tokens)
    if not ids:
        return {"low": 0.0, "even": 0.0}, {"low": "empty", "even": "empty"}
    bad_low = [i for i, t in enumerate(ids) if t >= LOW_LIMIT]
    bad_even = [i for i, t in enumerate(ids) if t % 2]
    rewards = {"low": 1 - len(bad_low) / len(ids), "even": 1 - len(bad_even) / len(ids)}
    info = {
        "low": f"tokens at {bad_low} are not below {LOW_LIMIT}" if bad_low else "all below",
        "even": f"tokens at {bad_even} are odd" if bad_even else "all even",
    }
    return rewards, info


# ----------------------------------------------------------------- servers


def start_backend(model_dir: Path, log_path: Path) -> devstack.VLLMServer:
    """vLLM serving ``model_dir`` with the dev endpoints (weight reload) enabled."""
    python = devstack.ensure_vllm_env()
    port = devstack.free_port()
    command = devstack.vllm_command(python, model_dir, port)
    env = devstack.vllm_environment()
    env["VLLM_SERVER_DEV_MODE"] = "1"
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        command,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    server = devstack.VLLMServer(
        process, "127.0.0.1", port, devstack.DEFAULT_SERVED_MODEL_NAME, log_path, log_file
    )
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


@dataclass
class Proxy:
    process: subprocess.Popen[bytes]
    url: str
    output: Path
    log: IO[bytes]

    def stop(self) -> None:
        """SIGTERM (the proxy drains and publishes everything), then SIGKILL if it hangs."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=PROXY_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def start_proxy(backend: str, output: Path, log_path: Path) -> Proxy:
    port = devstack.free_port()
    env = dict(os.environ, TURNSTILE_SHARD_MAX_AGE_S=PROXY_SHARD_MAX_AGE_S)
    log = log_path.open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "turnstile",
            "serve",
            "--backend",
            backend,
            "--output",
            str(output),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    proxy = Proxy(process, f"http://127.0.0.1:{port}", output, log)
    deadline = time.monotonic() + PROXY_START_TIMEOUT_S
    while True:
        try:
            _http("GET", f"{proxy.url}/health")
            return proxy
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                proxy.stop()
                raise RuntimeError(f"turnstile serve did not start; see {log_path}") from None
            time.sleep(0.2)


# ----------------------------------------------------------------- one rollout


def rollout(proxy: str, step: int, group: int, index: int, cfg: Config) -> dict[str, float]:
    created = _http(
        "POST",
        f"{proxy}/rollouts",
        {"group_id": f"step{step}-g{group}", "task_id": f"prompt-{group}"},
    )
    reply = _http(
        "POST",
        f"{created['base_url']}/completions",
        {
            "model": devstack.DEFAULT_SERVED_MODEL_NAME,
            "prompt": list(PROMPTS[group % len(PROMPTS)]),
            "max_tokens": cfg.max_tokens,
            "min_tokens": cfg.max_tokens,
            "temperature": 1.0,
            "seed": cfg.seed * 1_000_003 + step * 10_007 + group * 101 + index,
            "return_token_ids": True,
        },
    )
    tokens = reply["choices"][0]["token_ids"]
    rewards, info = score(tokens)
    rid = created["rollout_id"]
    _http("POST", f"{proxy}/rollouts/{rid}/rewards", {"rewards": rewards, "info": info})
    _http("POST", f"{proxy}/rollouts/{rid}/finish", {})
    return rewards


# ----------------------------------------------------------------- the trainer


class Trainer:
    def __init__(self, model_dir: Path, cfg: Config) -> None:
        torch.manual_seed(cfg.seed)
        self.model_dir = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, local_files_only=True
        )
        self.model.train()
        head = [p for n, p in self.model.named_parameters() if n.startswith("lm_head.")]
        body = [p for n, p in self.model.named_parameters() if not n.startswith("lm_head.")]
        # Plain SGD for the output layer: only the rows of sampled tokens get a gradient of
        # any size, so each moves in proportion to its advantage. Adam would give all
        # 151,936 rows a step of the same size and drown that signal.
        self.optimizers: list[torch.optim.Optimizer] = [torch.optim.SGD(head, lr=cfg.lr)]
        if cfg.lr_body > 0:
            self.optimizers.append(torch.optim.Adam(body, lr=cfg.lr_body))
        else:
            for p in body:
                p.requires_grad_(False)
        self.checkpoint_keys = list(load_file(str(model_dir / "model.safetensors")).keys())

    def step(self, samples: Sequence[batches.TrainSample]) -> float:
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
        return float(out.loss.detach())

    def save(self) -> None:
        state = self.model.state_dict()
        tensors = {
            k: state[k].detach().to(torch.bfloat16).contiguous() for k in self.checkpoint_keys
        }
        staged = self.model_dir / "model.safetensors.partial"
        save_file(tensors, str(staged), metadata={"format": "pt"})
        os.replace(staged, self.model_dir / "model.safetensors")


def untie_output_layer(model_dir: Path) -> None:
    """Give the tiny model its own output layer (a copy of the tied embedding table).

    With tied embeddings every update of a sampled token's output row also changes its
    input embedding, and with it the hidden states of every later position; an untied
    head learns this toy task in a handful of steps.
    """
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    if not config.get("tie_word_embeddings", False):
        return
    weights_path = model_dir / "model.safetensors"
    tensors = load_file(str(weights_path))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    config["tie_word_embeddings"] = False
    config_path.write_text(json.dumps(config, indent=2))


def reload_backend(backend: str) -> None:
    _http("POST", f"{backend}/collective_rpc", {"method": "reload_weights"})
    _http("POST", f"{backend}/reset_prefix_cache")


def _advantages(
    estimator: str, samples: list[batches.TrainSample], proxy: Proxy, backend: str, cfg: Config
) -> None:
    names = ["low", "even"]
    if estimator == "grpo":
        batches.assign_grpo(samples, names)
    elif estimator == "gdpo":
        batches.assign_gdpo(samples, names)
    else:
        rescore.rescore_backend(
            proxy.output, backend, samples=samples, top_k=cfg.top_k, progress=False
        )
        relevance = rescore.relevance_for(samples, rescore.read_relevance(proxy.output))
        batches.assign_mrtpo(samples, relevance, names)


def run_estimator(
    estimator: str, cfg: Config, backend: str, model_dir: Path, pristine: Path, workdir: Path
) -> Curve:
    started = time.monotonic()
    shutil.copyfile(pristine, model_dir / "model.safetensors")
    reload_backend(backend)
    output = workdir / f"out-{estimator}"
    proxy = start_proxy(backend, output, workdir / f"turnstile-{estimator}.log")
    curve = Curve(estimator)
    trainer = Trainer(model_dir, cfg)
    version = 0
    follower = ShardFollower(
        output,
        follow=True,
        poll_interval_s=SHARD_POLL_S,
        idle_timeout_s=SHARD_WAIT_S,
        max_staleness=0,
        current_version=lambda: version,
    )
    groups: Iterator[list[batches.TrainSample]] = iter_group_batches(
        follower, cfg.group_size, cfg.groups
    )
    try:
        for step in range(cfg.steps + 1):  # the last round only measures the final policy
            version = step
            _http("POST", f"{proxy.url}/admin/policy_version", {"policy_version": version})
            with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
                jobs = [
                    pool.submit(rollout, proxy.url, step, g, i, cfg)
                    for g in range(cfg.groups)
                    for i in range(cfg.group_size)
                ]
                rewards = [j.result() for j in jobs]
            curve.low.append(float(np.mean([r["low"] for r in rewards])))
            curve.even.append(float(np.mean([r["even"] for r in rewards])))
            curve.rewards.append(curve.low[-1] + curve.even[-1])
            samples = next(groups)
            curve.policy_versions.append(
                sorted({int(v) for s in samples for v in s.policy_versions})
            )
            curve.staleness.append(max(s.staleness(version) for s in samples))
            print(
                f"{estimator} step {step}: mean reward {curve.rewards[-1]:.3f} "
                f"(low {curve.low[-1]:.3f}, even {curve.even[-1]:.3f}), "
                f"policy versions {curve.policy_versions[-1]}",
                flush=True,
            )
            if step == cfg.steps:
                break
            _advantages(estimator, samples, proxy, backend, cfg)
            trainer.step(samples)
            trainer.save()
            reload_backend(backend)
    finally:
        follower.stop()
        proxy.stop()
    curve.seconds = time.monotonic() - started
    return curve


def plot(curves: Sequence[Curve], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in curves:
        ax.plot(range(len(c.rewards)), c.rewards, marker="o", label=c.estimator.upper())
    ax.set_xlabel("policy version (training step)")
    ax.set_ylabel("mean reward (low + even, max 2)")
    ax.set_title("Tiny Qwen3 trained through Turnstile")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: Config) -> list[Curve]:
    """Start the backend once and train each estimator from the same initial weights."""
    with tempfile.TemporaryDirectory(prefix="turnstile-learn-") as tmp:
        workdir = cfg.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if cfg.backend and cfg.backend_model_dir:
            untie_output_layer(cfg.backend_model_dir)
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
        untie_output_layer(model_dir)
        pristine = workdir / "initial.safetensors"
        shutil.copyfile(model_dir / "model.safetensors", pristine)
        server = start_backend(model_dir, workdir / "vllm.log")
        with server:
            return [
                run_estimator(e, cfg, server.base_url, model_dir, pristine, workdir)
                for e in cfg.estimators
            ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Config()
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--groups", type=int, default=defaults.groups)
    p.add_argument("--group-size", type=int, default=defaults.group_size)
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--estimators", default=",".join(ESTIMATORS))
    p.add_argument("--workdir", type=Path, help="keep logs, shards and weights here")
    p.add_argument("--plot", type=Path, default=Path("reward.png"))
    p.add_argument("--json", type=Path, help="write the reward curves here")
    p.add_argument(
        "--backend",
        metavar="URL",
        help="use this running vLLM (started with VLLM_SERVER_DEV_MODE=1) instead "
        "of starting one; never a shared server: its weights are replaced",
    )
    p.add_argument(
        "--backend-model-dir",
        type=Path,
        metavar="DIR",
        help="the model directory that --backend serves",
    )
    args = p.parse_args(argv)
    cfg = Config(
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
    )
    unknown = set(cfg.estimators) - set(ESTIMATORS)
    if unknown:
        p.error(f"unknown estimators {sorted(unknown)}; choose from {ESTIMATORS}")
    curves = run(cfg)
    plot(curves, args.plot)
    result = {
        c.estimator: {
            "mean_reward": c.rewards,
            "low": c.low,
            "even": c.even,
            "policy_versions": c.policy_versions,
            "staleness": c.staleness,
            "seconds": round(c.seconds, 1),
        }
        for c in curves
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    for c in curves:
        print(f"{c.estimator}: " + " ".join(f"{r:.3f}" for r in c.rewards))
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
