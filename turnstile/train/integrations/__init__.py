"""Adapters that let well-known trainer libraries train from Turnstile's output.

``trl``: TRL's ``GRPOTrainer`` with a rollout function that drives a harness through
Turnstile and hands TRL the recorded token ids and behaviour logprobs, plus the fenced
weight push to a vLLM backend after each step. Each adapter imports its library, so
import the one you use (``from turnstile.train.integrations import trl as ts_trl``).
"""
