"""The tiny checkpoints' tokenizer: a real byte-level BPE (trained on a small embedded corpus) with
each family's special tokens and chat template, written in the Hugging Face files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILIES = ("spark2_5", "qwen3")

# Total tokenizer (and config) vocabulary; merges fill it up, reserved specials pad the rest.
VOCAB_SIZE = 384

SPARK_SPECIALS = [
    # (content, special): ids 0.. in this order, as the published Spark tokenizer starts
    ("<｜start▁of▁sentence｜>", True),
    ("<｜end▁of▁sentence｜>", True),
    ("<｜▁pad▁｜>", True),
    ("<think>", False),
    ("</think>", False),
    ("<|System|>", True),
    ("<|User|>", True),
    ("<|Bot|>", True),
    ("<|mask|>", True),
]
QWEN3_SPECIALS = [
    # (content, special): appended after the byte-level vocabulary, as Qwen's added tokens are
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|mask|>", True),
    ("<think>", False),
    ("</think>", False),
]

SPARK_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|System|>{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}<|User|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|Bot|>{{ message['content'] }}<｜end▁of▁sentence｜>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|Bot|>"
    "{%- if thinking_effort is defined and thinking_effort -%}<think>{%- endif -%}"
    "{%- endif -%}"
)
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

def tools_chat_template(*, thinking: bool = True) -> str:
    """A ChatML template with tools in the Qwen3 format (tools listed as JSON in the system turn, calls as
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, results as `<tool_response>` user turns), which
    mlx-lm reads with its `json_tools` parser; `thinking`: Qwen3's `enable_thinking` switch (False: an
    empty thinking block opens the answer)."""
    switch = (
        "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
        if thinking else ""
    )
    return (
        "{%- set first_system = messages and messages[0].role == 'system' %}"
        "{%- if tools or first_system %}{{- '<|im_start|>system\\n' }}"
        "{%- if first_system %}{{- messages[0].content }}{%- endif %}"
        "{%- if tools %}{{- '\\n# Tools\\n<tools>' }}"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- '\\n</tools>\\nCall a tool as <tool_call>\\n{\"name\": NAME, \"arguments\": ARGS}\\n</tool_call>' }}"
        "{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'system' and loop.first %}"
        "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
        "{%- for tool_call in message.tool_calls or [] %}"
        "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
        "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
        "{{- (tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson) + '}\\n</tool_call>' }}"
        "{%- endfor %}{{- '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}" + switch + "{%- endif %}"
    )


def write_chat_template(path: Path, template: str) -> None:
    """Replace the chat template of the tokenizer files in `path` (tokenizer_config.json and, when
    present, chat_template.jinja, which transformers prefers)."""
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    _write_json(config_path, config)
    jinja = Path(path) / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(template, encoding="utf-8")


# Small embedded corpus for the BPE merges: English prose, numbers and a little code.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A speculative decoder drafts several tokens at once and
the target model verifies them in a single forward pass. When the draft is right, the target accepts
the tokens and the decoder moves ahead by more than one token per step. When it is wrong, the target
keeps its own token, so the output is exactly what the target alone would have written.
Hello, world! How are you today? I am fine, thank you. What is the answer to this question?
Let us count: one, two, three, four, five, six, seven, eight, nine, ten. 1 2 3 4 5 6 7 8 9 10 100 2024.
The theorem states that the sum of the first n odd numbers is n squared, so 1 + 3 + 5 = 9.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
Once upon a time there was a small model that wanted to speak. It learned the words of the world one
byte at a time, then merged the bytes that appeared together most often into longer pieces.
"""


# --------------------------------------------------------------------------------------------------
# tokenizer


def _bytes_to_unicode() -> list[str]:
    """The byte-level alphabet: printable bytes map to themselves, the others to chars from 256 up."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = {}
    extra = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _train_merges(num_merges: int) -> list[tuple[str, str]]:
    """BPE merges learned on the embedded corpus by the tokenizers trainer (deterministic)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=256 + num_merges,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def build_tokenizer(family: str):
    """A byte-level BPE `tokenizers.Tokenizer` with the family's special tokens, VOCAB_SIZE in total.

    Returns (tokenizer, specials) where specials maps each special token's content to its id.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    _check_family(family)
    fixed = SPARK_SPECIALS if family == "spark2_5" else QWEN3_SPECIALS
    num_merges = VOCAB_SIZE - 256 - len(fixed)
    merges = _train_merges(num_merges)
    num_reserved = num_merges - len(merges)  # the corpus may yield fewer merges than asked
    added = list(fixed) + [(f"<|reserved_{i}|>", True) for i in range(num_reserved)]

    pieces = _bytes_to_unicode() + [a + b for a, b in merges]
    if family == "spark2_5":
        # specials first (ids 0..), then bytes and merges
        order = [content for content, _ in added] + pieces
    else:
        order = pieces + [content for content, _ in added]
    vocab = {piece: i for i, piece in enumerate(order)}
    if len(vocab) != VOCAB_SIZE:
        raise AssertionError(f"tiny tokenizer has {len(vocab)} entries, expected {VOCAB_SIZE}")

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(c, special=True, normalized=False) for c, special in added if special]
    )
    tokenizer.add_tokens([AddedToken(c, special=False, normalized=False) for c, special in added if not special])
    specials = {c: tokenizer.token_to_id(c) for c, _ in added}
    return tokenizer, specials


def _special_ids(family: str, specials: dict[str, int]) -> dict[str, Any]:
    if family == "spark2_5":
        return {
            "bos": specials["<｜start▁of▁sentence｜>"],
            "eos": specials["<｜end▁of▁sentence｜>"],
            "pad": specials["<｜▁pad▁｜>"],
            "mask": specials["<|mask|>"],
            "gen_eos": specials["<｜end▁of▁sentence｜>"],
        }
    return {
        "bos": specials["<|endoftext|>"],
        "eos": specials["<|im_end|>"],
        "pad": specials["<|endoftext|>"],
        "mask": specials["<|mask|>"],
        "gen_eos": [specials["<|im_end|>"], specials["<|endoftext|>"]],
    }


def write_tokenizer(path: Path, *, family: str) -> dict[str, Any]:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja (and spark's
    special_tokens_map.json) into `path`; returns the special ids (bos, eos, pad, mask, gen_eos)."""
    tokenizer, specials = build_tokenizer(family)
    ids = _special_ids(family, specials)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))

    added_decoder = {
        str(tid): {
            "content": c,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": c not in ("<think>", "</think>"),
        }
        for c, tid in sorted(specials.items(), key=lambda kv: kv[1])
    }
    id_to_content = {tid: c for c, tid in specials.items()}
    template = SPARK_CHAT_TEMPLATE if family == "spark2_5" else QWEN3_CHAT_TEMPLATE
    tok_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added_decoder,
        "bos_token": id_to_content[ids["bos"]] if family == "spark2_5" else None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": id_to_content[ids["eos"]],
        "mask_token": id_to_content[ids["mask"]],
        "model_max_length": 4096,
        "pad_token": id_to_content[ids["pad"]],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    _write_json(path / "tokenizer_config.json", tok_config)
    (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    if family == "spark2_5":
        _write_json(
            path / "special_tokens_map.json",
            {k: tok_config[k] for k in ("bos_token", "eos_token", "pad_token")},
        )
    return ids

def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not supported; expected one of {FAMILIES}")
