"""Cached development artefacts are keyed by a digest of everything that builds them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from turnstile.dev import cache, llama_cpp_assets, qwen3_tokenizer, tinyqwen, vllm_env
from turnstile.dev.cache import DevstackError, build_digest, is_current


def test_the_digest_covers_the_recipe_and_every_source_byte(tmp_path: Path) -> None:
    source = tmp_path / "builder.py"
    source.write_text("x = 1\n")
    first = build_digest({"seed": 0}, [source])
    assert build_digest({"seed": 0}, [source]) == first
    assert build_digest({"seed": 1}, [source]) != first
    source.write_text("x = 2\n")
    assert build_digest({"seed": 0}, [source]) != first


def test_a_change_to_the_model_builder_changes_the_model_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = tinyqwen.tiny_model_digest("env", "tokenizer")
    builder = tmp_path / tinyqwen.BUILDER_SCRIPT.name
    shutil.copy(tinyqwen.BUILDER_SCRIPT, builder)
    monkeypatch.setattr(tinyqwen, "BUILDER_SCRIPT", builder)
    assert tinyqwen.tiny_model_digest("env", "tokenizer") == before
    builder.write_text(builder.read_text() + "\n# changed\n")
    assert tinyqwen.tiny_model_digest("env", "tokenizer") != before


def test_the_model_digest_follows_its_inputs() -> None:
    base = tinyqwen.tiny_model_digest("env", "tokenizer")
    assert tinyqwen.tiny_model_digest("other env", "tokenizer") != base
    assert tinyqwen.tiny_model_digest("env", "other tokenizer") != base


def test_every_builder_module_is_part_of_its_artefacts_digest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each digest function hashes its own module's source: pointing __file__ elsewhere
    # (another module's source) must change it.
    other = Path(cache.__file__)
    for module, digest in [
        (vllm_env, vllm_env.vllm_env_digest),
        (llama_cpp_assets, llama_cpp_assets.assets_digest),
        (qwen3_tokenizer, qwen3_tokenizer.tokenizer_digest),
    ]:
        before = digest()
        with monkeypatch.context() as patch:
            patch.setattr(module, "__file__", str(other))
            assert digest() != before, module.__name__


def test_is_current_logs_why_it_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cache.NO_BUILD_ENV, raising=False)
    marker = tmp_path / ".turnstile-complete"
    lines: list[str] = []
    assert not is_current(marker, "a" * 64, "the thing", lines.append)
    assert lines == [f"cache: the thing not built yet (digest {'a' * 12}); building"]
    marker.write_text("b" * 64 + "\n")
    assert not is_current(marker, "a" * 64, "the thing", lines.append)
    assert "built from digest bbbbbbbbbbbb, now aaaaaaaaaaaa; rebuilding" in lines[-1]
    marker.write_text("a" * 64 + "\n")
    assert is_current(marker, "a" * 64, "the thing", lines.append)
    assert len(lines) == 2


def test_nothing_is_built_where_building_is_refused(tmp_path: Path) -> None:
    # tests/unit runs with TURNSTILE_NO_BUILD set (tests/unit/conftest.py).
    with pytest.raises(DevstackError, match="TURNSTILE_NO_BUILD is set"):
        llama_cpp_assets.ensure_llama_cpp_assets(tmp_path, log=lambda _: None)
    assert not (tmp_path / "downloads").exists()
