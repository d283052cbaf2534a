"""`--draft auto`: the published draft of a known target, from a small table of pairs (data:
`known_drafts.json`), and its lazy download.

A target matches a pair by its repo (or directory / GGUF file) name with the owner and any
quantization or conversion suffixes dropped (`mlx-community/Qwen3-4B-4bit`, `Qwen3-4B-Q4_K_M.gguf`
and `Qwen/Qwen3-4B` are all `qwen3-4b`), else by its config's `model_type`, `hidden_size` and
`num_hidden_layers` where the table knows them (a renamed local copy). Nothing here touches the
network itself: the config reader and the downloader are passed in (tests pass fakes).

A target may have several published drafts (rows naming it): the first row is the one taken, the
others are named in the printed line so a user can pass one with `--draft`.
"""

from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from mlx_dspark.loading.heads.mtp import MTP_DRAFT, declares_mtp, has_mtp_tensors, mtp_layer_count, runs_mtp

AUTO = "auto"
HUB_CONNECT_TIMEOUT_S = 5.0
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what a draft needs: its config and weights (the tokenizer is the target's); a draft model its tokenizer too (compared)
DRAFT_PATTERNS = ["config.json", "*.safetensors", "*.safetensors.index.json"]
DRAFT_MODEL_PATTERNS = [*DRAFT_PATTERNS, "tokenizer.json", "tokenizer_config.json", "tokenizer.model"]
_SIGNATURE = ("model_type", "hidden_size", "num_hidden_layers")
# conversion / quantization suffixes of a repo or file name, stripped from its end one at a time
_SUFFIX = re.compile(
    r"[-_.](mlx|gguf|safetensors|\d+-?bits?|bf16|fp16|f16|f32|fp32|fp8|int4|int8|w4a16|w8a8|awq|gptq|dwq|optiq|ud"
    r"|mxfp4|nvfp4|q\d(_[a-z0-9]+)*|iq\d(_[a-z0-9]+)*)$"
)


# the heads a row may name (`kind`), as docs/DRAFT_HEADS.md names them
DRAFT_MODEL = "draft model"  # a family's small causal LM (the "lm" head): taken only where no trained head is known
KINDS = ("DSpark", "DFlash", "DFlash 2", "EAGLE-3", "Gemma 4 assistant", DRAFT_MODEL)
_FIELDS = ("targets", "model_type", "hidden_size", "num_hidden_layers", "draft", "file", "kind", "packaging", "source")


@dataclass(frozen=True)
class DraftChoice:
    draft: str  # Hugging Face repo of the draft
    file: Optional[str]  # one GGUF of it, or None: its safetensors checkpoint
    packaging: str
    reason: str  # why this pair was chosen, for the line we print
    kind: str  # one of KINDS
    others: tuple[str, ...] = ()  # the target's other published drafts, "repo (kind)", not taken

    @property
    def reference(self) -> str:
        """What `load(draft=...)` takes for it before download."""
        return self.draft if self.file is None else f"{self.draft}:{self.file}"


def normalize_name(name: str) -> str:
    """`owner/Qwen3-4B-MLX-4bit` -> `qwen3-4b`: the model a repo, directory or file name is a copy of."""
    base = str(name).rstrip("/").split(":")[-1]
    base = base.replace("\\", "/").split("/")[-1].lower()
    while True:
        stripped = _SUFFIX.sub("", base)
        if stripped == base or not stripped:
            return base
        base = stripped


def known_pairs() -> list[dict[str, Any]]:
    text = resources.files("mlx_dspark.loading").joinpath("known_drafts.json").read_text(encoding="utf-8")
    return check_pairs(json.loads(text)["pairs"], source="known_drafts.json")


def check_pairs(pairs: list[dict[str, Any]], *, source: str) -> list[dict[str, Any]]:
    """The rows as given; ValueError naming the row and field of one that is incomplete or malformed."""
    for i, pair in enumerate(pairs):
        where = f"{source}: pairs[{i}]"
        missing = [f for f in _FIELDS if f not in pair]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)} (every row has {', '.join(_FIELDS)})")
        if not pair["targets"] or not all(isinstance(t, str) and "/" in t for t in pair["targets"]):
            raise ValueError(f"{where}.targets must list owner/name repos, got {pair['targets']!r}")
        if not _REPO_ID.match(str(pair["draft"])):
            raise ValueError(f"{where}.draft must be an owner/name repo, got {pair['draft']!r}")
        if pair["kind"] not in KINDS:
            raise ValueError(f"{where}.kind is {pair['kind']!r}; expected one of {', '.join(KINDS)}")
        if pair["file"] is not None and not str(pair["file"]).endswith(".gguf"):
            raise ValueError(f"{where}.file must be a .gguf file or null, got {pair['file']!r}")
        for field in ("packaging", "source"):
            if not isinstance(pair[field], str) or not pair[field].strip():
                raise ValueError(f"{where}.{field} must be a non-empty string")
    return pairs


def _choice(matches: list[dict], reason: str) -> DraftChoice:
    """The first matching row, the others named."""
    first = matches[0]
    others = tuple(f"{m['draft']} ({m['kind']})" for m in matches[1:])
    return DraftChoice(first["draft"], first.get("file"), first["packaging"], reason, first["kind"], others)


def text_config(config: dict) -> dict:
    """The language model's fields of a config (multimodal configs nest them under `text_config`)."""
    inner = config.get("text_config")
    if isinstance(inner, dict) and "hidden_size" not in config:
        return {**inner, "model_type": config.get("model_type", inner.get("model_type"))}
    return config


def choose_draft(target: str, config: Optional[dict] = None, *, pairs: Optional[list[dict]] = None) -> Optional[DraftChoice]:
    """The known draft of `target` (a repo id, directory or file name), or None. A family's small model (a
    `draft model` row) only where no trained head is known for it, and never named beside one."""
    pairs = known_pairs() if pairs is None else pairs
    trained = _match(target, config, [p for p in pairs if p["kind"] != DRAFT_MODEL])
    if trained is not None:
        return trained
    name = normalize_name(target)
    family = [p for p in pairs if p["kind"] == DRAFT_MODEL and normalize_name(p["draft"]) != name]
    found = _match(target, config, family)
    return None if found is None else replace(found, reason=f"the family's small model for {describe(target, config)}, no trained draft known")


def _match(target: str, config: Optional[dict], pairs: list[dict]) -> Optional[DraftChoice]:
    name = normalize_name(target)
    by_name = [pair for pair in pairs if name in {normalize_name(t) for t in pair["targets"]}]
    if by_name:
        return _choice(by_name, f"the published draft of {by_name[0]['targets'][0]}, by name")
    if config is None:
        return None
    fields = text_config(config)
    by_config = [pair for pair in pairs if all(pair.get(k) is not None and pair[k] == fields.get(k) for k in _SIGNATURE)]
    if by_config:
        what = ", ".join(f"{k} {fields[k]}" for k in _SIGNATURE)
        return _choice(by_config, f"the published draft of {by_config[0]['targets'][0]}, by its config ({what})")
    return None


def describe(target: str, config: Optional[dict]) -> str:
    fields = text_config(config or {})
    known = [f"{k} {fields[k]}" for k in _SIGNATURE if fields.get(k) is not None]
    return f"{target!r}" + (f" ({', '.join(known)})" if known else "")


def local_config(target: str, *, fetch_config: Optional[Callable[[str], Optional[Path]]] = None) -> Optional[dict]:
    """The target's config.json: from its directory, else `fetch_config(repo_id)` (one file from the Hub)."""
    path = Path(target).expanduser()
    if path.is_dir():
        file = path / "config.json"
    elif path.exists() or fetch_config is None or not _REPO_ID.match(target):
        return None  # a GGUF file (or `repo:FILE.gguf`), or nothing that exists: matched by its name only
    else:
        file = fetch_config(target)
    if file is None or not Path(file).is_file():
        return None
    try:
        return json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def resolve_auto_draft(
    target: str,
    *,
    fetch_config: Optional[Callable[[str], Optional[Path]]] = None,
    download: Optional[Callable[..., str]] = None,
) -> tuple[Optional[str], str]:
    """(what to pass as `draft=`, the line to print). None and a line saying how to pass `--draft`
    when the target is not known. `download(repo, allow_patterns=...)` fetches a safetensors draft's
    files only (`huggingface_hub.snapshot_download`); None leaves the reference for `load()`."""
    config = None
    choice = choose_draft(target)  # by name first: no file read, no network
    if choice is None:
        config = local_config(target, fetch_config=fetch_config)
        choice = choose_draft(target, config)
    local = Path(target).expanduser().is_dir()
    if choice is None and config is not None and runs_mtp(config) and (has_mtp_tensors(target, config) if local else declares_mtp(config)):
        # no published draft, but the target carries its own MTP layers (a Hub config is taken at its word:
        # load() says how to get the layers when the repo's files lack them)
        return MTP_DRAFT, f"draft auto: the target's own MTP layers ({mtp_layer_count(config)}), no published draft known for {describe(target, config)}"
    if choice is None:
        return None, (
            f"no known draft for {describe(target, config)}; pass --draft DIR, REPO, FILE.gguf or REPO:FILE.gguf "
            "(a DSpark, DFlash, DFlash 2, EAGLE-3 or Gemma 4 assistant draft for this target, or a small model of its "
            "vocabulary), or --no-draft"
        )
    reference = choice.reference
    if download is not None and choice.file is None:
        patterns = DRAFT_MODEL_PATTERNS if choice.kind == DRAFT_MODEL else DRAFT_PATTERNS
        reference = str(download(choice.draft, allow_patterns=patterns))
    return reference, auto_line(choice)


def auto_line(choice: DraftChoice) -> str:
    """The line `--draft auto` prints: the draft, its kind and packaging, why, and what else is published."""
    line = f"draft auto: {choice.reference} ({choice.kind}, {choice.packaging}), {choice.reason}"
    if choice.others:
        line += f"; also published: {', '.join(choice.others)} (pass it with --draft)"
    return line


class HubUnreachable(FileNotFoundError):
    """The Hub could not be asked at all (no network, DNS, a proxy): said as such, not as an unknown target."""


def _check_hub_reachable(repo_id: str) -> None:
    """One quick connection to the Hub's host before asking it: huggingface_hub retries a dead network
    five times (about 25 s) and its failure would then read as "no known draft"."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return  # the cache alone answers
    endpoint = urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise HubUnreachable(
            f"--draft auto: cannot reach the Hugging Face Hub at {endpoint.hostname}:{port} ({err}) to read {repo_id}'s "
            "config.json; check the network (or set HF_HUB_OFFLINE=1 to use the cache), or pass --draft"
        ) from None


def hub_config(repo_id: str) -> Optional[Path]:
    """config.json of a Hub repo (only that file), or None when the Hub has none; HubUnreachable without a network."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    _check_hub_reachable(repo_id)
    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError):
        return None


def hub_download(repo_id: str, *, allow_patterns: list[str]) -> str:
    """The draft's files only (`allow_patterns`), into the Hugging Face cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, allow_patterns=allow_patterns)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise FileNotFoundError(
            f"draft auto: {repo_id!r} could not be downloaded from the Hugging Face Hub ({type(e).__name__}); check your "
            "network and HF_HUB_OFFLINE / HF_TOKEN, or download it and pass --draft DIR"
        ) from e
