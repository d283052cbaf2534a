"""The README's demo commands, run as a user types them (subprocess, the same interpreter as the venv's),
checked against what the README and docs/GENERATE.md (its section on the demo pair, where the README's
exact numbers moved) say they print.

The setup part of the first command (`python3 -m venv .venv && .venv/bin/pip install -e .`) is what
the test environment already did; the run part is taken from the README's text itself, so a README
edit that changes the command or its numbers is checked too.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
GENERATE_DOC = README.parent / "docs" / "GENERATE.md"
VENV_PYTHON = ".venv/bin/python"


def _section(path: Path, heading: str) -> str:
    text = path.read_text(encoding="utf-8")
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _quick_start() -> str:
    return _section(README, "## Quick start")


def _demo_pair_doc() -> str:
    """docs/GENERATE.md's section on the demo pair: the first command's numbers at the card's fixed length."""
    return _section(GENERATE_DOC, "## The demo pair")


def _first_command() -> list[str]:
    """The run part of the README's first command, with the venv's python replaced by this interpreter."""
    block = re.search(r"```bash\n(.*?)\n```", _quick_start(), re.S)
    assert block, "README: no ```bash block in the Quick start"
    command = block.group(1).strip()
    setup, _, run = command.rpartition(" && ")
    assert setup.startswith("python3 -m venv .venv") and "pip install -e ." in setup, command
    argv = shlex.split(run)
    assert argv[0] == VENV_PYTHON, f"README's first command runs {argv[0]!r}, expected {VENV_PYTHON}"
    return [sys.executable, *argv[1:]]


def _run(argv: list[str], *, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=300, cwd=README.parent,
    )  # fmt: skip


def _claimed(pattern: str, *, where: str = "README") -> re.Match:
    text = _quick_start() if where == "README" else _demo_pair_doc()
    match = re.search(pattern, " ".join(text.split()))
    assert match, f"{where} no longer states {pattern!r}"
    return match


@pytest.fixture(scope="module")
def first_command() -> subprocess.CompletedProcess:
    result = _run(_first_command())
    assert result.returncode == 0, result.stderr
    return result


def test_the_first_command_sends_the_demo_prompt_as_raw_text(first_command):
    assert "prompt (raw text): 'class Request:" in first_command.stderr
    claimed = int(_claimed(r"`prompt: (\d+) tokens")[1])
    seen = int(re.search(r"^prompt: (\d+) tokens", first_command.stderr, re.M)[1])
    assert seen == claimed  # the chat template would add its markers (35 tokens instead of 24)


def test_the_first_command_reports_its_draft_lengths_and_the_fixed_length_line_is_the_docs(first_command):
    """The first command runs `auto` (its lengths depend on this machine's measured costs, so only the
    report's form is checked); with the card's fixed length the numbers docs/GENERATE.md states are exact
    (greedy), and the command it shows is the README's."""
    seen = re.search(r"(\d+) target forwards for 256 tokens .*\| draft lengths \{[\d:, ]*\} \((\d+) rounds parked\)",
                     first_command.stderr)
    assert seen, first_command.stderr
    fixed = _run([*_first_command(), "--max-draft-tokens", "7"])
    assert fixed.returncode == 0, fixed.stderr
    pattern = r"(\d+) target forwards for 256 tokens \| mean acceptance length ([\d.]+) over (\d+) rounds"
    shown = re.search(r"```bash\n(.*?)\n```", _demo_pair_doc(), re.S)
    assert shown and _first_command()[1:] == shlex.split(shown[1].strip())[1:], "docs/GENERATE.md shows another command"
    forwards = _claimed(r"`(\d+) target forwards for 256 tokens` and `mean acceptance length ([\d.]+) over (\d+) rounds`", where="docs/GENERATE.md")
    line = re.search(pattern, fixed.stderr)
    assert line and line.groups() == forwards.groups(), (fixed.stderr, forwards[0])
    assert fixed.stdout == first_command.stdout  # lossless: the same text at any draft length
    no_lookup = _run([*_first_command(), "--max-draft-tokens", "7", "--lookup", "off"])
    claimed = _claimed(r"`--lookup off` as well: `(\d+) target forwards for 256 tokens`, `([\d.]+) over (\d+) rounds`",
                       where="docs/GENERATE.md")
    line = re.search(pattern, no_lookup.stderr)
    assert line and line.groups() == claimed.groups(), (no_lookup.stderr, claimed[0])
    assert no_lookup.stdout == first_command.stdout


def test_the_first_command_writes_the_python_like_text_the_readme_shows(first_command):
    shown = _claimed(r"\(`(self\.[^`]*?)(?:\.\.\.)?\)?`\)")[1].rstrip(", .")
    assert shown in first_command.stdout, (shown, first_command.stdout[:400])
    lines = [line for line in first_command.stdout.splitlines() if line.strip()]
    indented = sum(line.startswith("        ") for line in lines)
    assert indented >= 0.7 * len(lines)  # method-body lines, as the raw Python prompt continues


def test_the_chat_repl_on_the_demo_pair_answers_a_message():
    result = _run([sys.executable, "-m", "mlx_dspark.chat", "--max-tokens", "24"], stdin="def add(a, b):\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "no reply on stdout"
    assert re.search(r"\[prompt \d+ tokens, \d+ cached, .* \| reply \d+ tokens", result.stderr), result.stderr


def test_compare_on_the_demo_pair_prints_its_line():
    result = _run([sys.executable, "-m", "mlx_dspark.generate", "--compare", "--max-tokens", "48"])
    assert result.returncode == 0, result.stderr
    line = re.search(r"^compare: plain [\d.]+ tok/s \((\d+) target forwards\), this run [\d.]+ tok/s: [\d.]+x \| outputs identical: (\S+)", result.stderr, re.M)
    assert line, result.stderr
    assert int(line[1]) == 48 and line[2] == "yes"


def test_ci_runs_the_readmes_test_command_verbatim():
    blocks = re.findall(r"```bash\n(.*?)\n```", _quick_start(), re.S)
    test_command = next(block.strip() for block in blocks if "pytest" in block)
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command in ci.splitlines(), (test_command, "not a line of .ci/run")
