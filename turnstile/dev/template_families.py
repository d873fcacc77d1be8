"""Text-level vocabularies for the templates whose model's vocabulary is not vendored.

llama.cpp vendors about 70 chat templates but only a few vocabularies. A template whose
family has no vendored vocabulary (``turnstile.dev.template_corpus.PAIRINGS``) is audited at
*text level*: on Qwen2's byte-level vocabulary (any text tokenizes) with the family's markers
appended as added tokens and its published stop tokens as ``generation_config.json``'s
``eos_token_id``. What that checks exactly: every marker is one token, as in the real
vocabulary, so where the delta is cut, which token ends a turn and whether the text of a
re-render extends the context are the real model's answers. Token ids and how ordinary text
next to a marker merges are Qwen2's, not the model's, so a token-level break found here is
only indicative (``CorpusRow.level`` says ``text``).

``FAMILIES`` names each family by template-name prefix with its stop tokens (from each
model's published ``generation_config.json``/``tokenizer_config.json``) and BOS/EOS; the
markers are the template's own: the strings of the forms ``<|x|>``, the same with
fullwidth bars (DeepSeek), ``[X]`` and ``<x>``/``</x>`` its text uses (role headers, turn
ends, tool and reasoning tags), plus any a family lists that the template builds at
render time. Markers of the ``<x>`` form are added as ordinary (non-special) tokens, as
real vocabularies do for reasoning and tool tags.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from turnstile.dev.qwen3_tokenizer import QWEN3_ADDED_TOKENS
from turnstile.dev.vocab import VocabSpec

__all__ = ["FAMILIES", "TEXT_BASE_VOCAB", "Family", "family_of", "markers", "text_level_spec"]

# The base vocabulary of text-level audits: byte-level BPE, so any text tokenizes.
TEXT_BASE_VOCAB = "ggml-vocab-qwen2.gguf"
# Qwen2's own added tokens (those of Qwen2.5: Qwen3's first 22).
_BASE_ADDED = QWEN3_ADDED_TOKENS[:22]
_BASE_CONTENTS = frozenset(content for _id, content, _special in _BASE_ADDED)
# Marker forms found in template text: <|x|>, <\uff5cx\uff5c> (DeepSeek's fullwidth bars), [X] and
# [/X] (Mistral), and <x>/</x> tags (reasoning, tool calls).
_SPECIAL_FORMS = re.compile(
    r"<\|[^|<>\s'\"{}]{1,40}\|>|<\uff5c[^\uff5c<>\s'\"{}]{1,40}\uff5c>|\[/?[A-Z][A-Z_]{1,19}\]"
)
_TAG_FORM = re.compile(r"</?[a-z][a-z_:]{1,19}>")


@dataclass(frozen=True)
class Family:
    """A template family audited at text level: its stop tokens and BOS/EOS, and markers
    its templates build at render time (so their text does not spell them out)."""

    name: str
    prefixes: tuple[str, ...]
    stops: tuple[str, ...]
    eos: str
    bos: str | None = None
    extra_special: tuple[str, ...] = ()
    extra_tags: tuple[str, ...] = ()
    note: str = ""


_DEEPSEEK_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
_DEEPSEEK_BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"

FAMILIES: tuple[Family, ...] = (
    Family("Apertus", ("Apertus-",), ("<|assistant_end|>",), "<|assistant_end|>", "<s>"),
    Family("Apriel", ("Apriel-", "unsloth-Apriel-"), ("<|end|>",), "<|end|>", "<s>"),
    Family("Bielik", ("Bielik-",), ("<|im_end|>",), "<|im_end|>", "<s>"),
    Family(
        "Seed-OSS",
        ("ByteDance-Seed-OSS",),
        ("<seed:eos>",),
        "<seed:eos>",
        "<seed:bos>",
        extra_special=("<seed:eos>", "<seed:bos>", "<seed:pad>"),
        extra_tags=(
            "<seed:think>",
            "</seed:think>",
            "<seed:tool_call>",
            "</seed:tool_call>",
            "<seed:cot_budget_reflect>",
            "</seed:cot_budget_reflect>",
        ),
    ),
    Family(
        "Command R",
        ("Cohere2", "CohereForAI-"),
        ("<|END_OF_TURN_TOKEN|>",),
        "<|END_OF_TURN_TOKEN|>",
        "<BOS_TOKEN>",
        extra_special=("<BOS_TOKEN>",),
        note="the command-r vocabulary is vendored, but its pre-tokenizer is not one "
        "turnstile.dev.vocab rebuilds",
    ),
    Family(
        "GLM",
        ("GLM-",),
        ("<|endoftext|>", "<|user|>", "<|observation|>"),
        "<|endoftext|>",
        extra_special=("[gMASK]", "<sop>"),
    ),
    Family("GigaChat", ("GigaChat",), ("<|message_sep|>",), "</s>", "<s>"),
    Family("Kimi K2", ("Kimi-K2", "moonshotai-Kimi-K2"), ("<|im_end|>",), "<|im_end|>", "[BOS]"),
    Family("Kimi K3", ("Kimi-K3",), ("<|end_of_msg|>",), "<|end_of_msg|>", "[BOS]"),
    Family("LFM", ("LFM2",), ("<|im_end|>",), "<|im_end|>", "<|startoftext|>"),
    Family("MiMo", ("MiMo-",), ("<|im_end|>",), "<|im_end|>"),
    Family(
        "MiniMax M1",
        ("MiniMax-M1",),
        ("<end_of_sentence>",),
        "<end_of_sentence>",
        "<beginning_of_sentence>",
        extra_special=("<end_of_sentence>", "<beginning_of_sentence>", "<begin_of_document>"),
    ),
    Family(
        "MiniMax M2",
        ("MiniMax-M2", "MiniMax-M3"),
        ("[e~[",),
        "[e~[",
        "]~!b[",
        extra_special=("[e~[", "]~b]", "]~!b[", "]<]"),
        extra_tags=("<mm:think>", "</mm:think>", "<minimax:tool_call>", "</minimax:tool_call>"),
    ),
    Family(
        "Mistral",
        ("Mistral-", "mistralai-", "unsloth-mistral-"),
        ("</s>",),
        "</s>",
        "<s>",
        note="Mistral's Tekken (tiktoken-based) vocabulary is not vendored",
    ),
    Family("Nemotron 3", ("NVIDIA-Nemotron-3",), ("<|im_end|>",), "<|im_end|>"),
    Family(
        "Nemotron Nano 2",
        ("NVIDIA-Nemotron-Nano-v2",),
        ("<SPECIAL_12>",),
        "<SPECIAL_12>",
        extra_special=("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"),
        extra_tags=("<TOOLCALL>", "</TOOLCALL>", "<TOOL_RESPONSE>", "</TOOL_RESPONSE>"),
    ),
    Family("Reka", ("Reka-",), ("<sep>",), "<sep>", extra_special=("<sep>",)),
    Family(
        "Spark",
        ("Spark",),
        (_DEEPSEEK_EOS,),
        _DEEPSEEK_EOS,
        "<\uff5cstart\u2581of\u2581sentence\uff5c>",
    ),
    Family("Step", ("StepFun",), ("<|im_end|>",), "<|im_end|>"),
    Family(
        "DeepSeek V3",
        ("deepseek-ai-DeepSeek-V", "llama-cpp-deepseek-r1"),
        (_DEEPSEEK_EOS,),
        _DEEPSEEK_EOS,
        _DEEPSEEK_BOS,
        note="DeepSeek-V3's vocabulary is not vendored",
    ),
    Family(
        "Gemma 2",
        ("google-gemma-2",),
        ("<eos>", "<end_of_turn>"),
        "<eos>",
        "<bos>",
        extra_special=("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
    ),
    Family(
        "Gemma 4",
        ("google-gemma-4",),
        ("<eos>", "<turn|>"),
        "<eos>",
        "<bos>",
        extra_special=("<bos>", "<eos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>"),
        note="the gemma-4 vocabulary is vendored, but its GGUF tokenizer model is not one "
        "turnstile.dev.vocab rebuilds",
    ),
    Family("Granite", ("ibm-granite-",), ("<|end_of_text|>",), "<|end_of_text|>"),
    Family("Ling", ("inclusionai-ling",), ("<|role_end|>",), "<|role_end|>"),
    Family(
        "RWKV World",
        ("llama-cpp-rwkv-world",),
        (),
        "<|endoftext|>",
        note="RWKV's World vocabulary is not vendored; it has no end-of-turn token",
    ),
    Family(
        "Glimmer",
        ("muse-glimmer",),
        ("<|eot|>", "<|eom|>"),
        "<|eot|>",
    ),
    Family(
        "gpt-oss",
        ("openai-gpt-oss",),
        ("<|return|>", "<|call|>"),
        "<|return|>",
        extra_special=("<|constrain|>",),
    ),
    Family("MiniCPM", ("openbmb-MiniCPM",), ("<|im_end|>",), "<|im_end|>"),
    Family(
        "Laguna",
        ("poolside-Laguna",),
        ("</assistant>",),
        "</assistant>",
        "\u3008|EOS|\u3009",
        extra_special=("\u3008|EOS|\u3009",),
    ),
    Family(
        "Hunyuan 3",
        ("tencent-Hy3",),
        ("<\uff5chy_eos:opensource\uff5c>",),
        "<\uff5chy_eos:opensource\uff5c>",
        "<\uff5chy_begin_of_sentence:opensource\uff5c>",
        extra_special=tuple(
            f"<\uff5c{name}:opensource\uff5c>"
            for name in ("hy_eos", "hy_begin_of_sentence", "hy_User", "hy_Assistant", "hy_pad")
        ),
        extra_tags=tuple(
            f"<{slash}{name}:opensource>"
            for name in (
                "think",
                "tool_calls",
                "tool_call",
                "tool_sep",
                "arg_key",
                "arg_value",
                "tool_responses",
                "tool_response",
            )
            for slash in ("", "/")
        ),
    ),
    Family("Solar Open", ("upstage-Solar-Open",), ("<|end|>",), "<|end|>"),
)


def family_of(template_name: str) -> Family | None:
    for family in FAMILIES:
        if template_name.startswith(family.prefixes):
            return family
    return None


def markers(texts: Iterable[str]) -> tuple[list[str], list[str]]:
    """Special-form markers and tag markers the template texts spell out."""
    special: set[str] = set()
    tags: set[str] = set()
    for text in texts:
        special.update(_SPECIAL_FORMS.findall(text))
        tags.update(_TAG_FORM.findall(text))
    return sorted(special), sorted(tags - special)


def text_level_spec(family: Family, templates: Iterable[str]) -> VocabSpec:
    """The text-level vocabulary of ``family``, whose templates are ``templates``."""
    special, tags = markers(templates)
    wanted_special = dict.fromkeys(
        [
            *special,
            *family.extra_special,
            *family.stops,
            family.eos,
            *((family.bos,) if family.bos else ()),
        ]
    )
    appended: list[tuple[str, bool]] = []
    for content in wanted_special:
        if content and content not in _BASE_CONTENTS:
            appended.append((content, True))
    chosen = {content for content, _ in appended} | _BASE_CONTENTS
    for content in dict.fromkeys([*tags, *family.extra_tags]):
        if content not in chosen:
            appended.append((content, False))
            chosen.add(content)
    return VocabSpec(
        TEXT_BASE_VOCAB,
        _BASE_ADDED,
        appended_tokens=tuple(appended),
        eos_token=family.eos,
        bos_token=family.bos,
        stop_tokens=family.stops,
        promote_existing=True,
    )
