"""The generate CLI's constraint and penalty flags: valid output, and one `error:` line for bad input."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from typer.testing import CliRunner

from mlx_dspark.cli.generate import app

runner = CliRunner()
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}},
          "required": ["n", "s"], "additionalProperties": False}


def run(pair, *args):
    target, draft = pair
    return runner.invoke(app, ["--model", str(target), "--draft", str(draft), "--prompt", "Hello", "--json", *args])


def result(out):
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_json_schema_flag_gives_valid_json_and_speculative_equals_plain(tiny_spark_pair, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    spec = result(run(tiny_spark_pair, "--json-schema", str(path), "--max-tokens", "60"))
    plain = result(run(tiny_spark_pair, "--json-schema", str(path), "--max-tokens", "60", "--no-draft"))
    assert spec["tokens"] == plain["tokens"] and spec["finish_reason"] == "stop"
    jsonschema.validate(json.loads(spec["text"]), SCHEMA)


def test_regex_and_penalty_flags(tiny_spark_pair):
    out = result(run(tiny_spark_pair, "--regex", "[a-c]{4}", "--presence-penalty", "1.5", "--repetition-penalty", "1.2",
                     "--logit-bias", "40:2,41:-3", "--max-tokens", "10"))
    assert re.fullmatch("[a-c]{4}", out["text"])
    penalized = result(run(tiny_spark_pair, "--frequency-penalty", "2", "--max-tokens", "10", "--logit-bias", '{"40": 5}'))
    assert penalized["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    "args, words",
    [
        (["--regex", "[a-"], "--regex"),
        (["--json-schema", "/nonexistent/schema.json"], "--json-schema"),
        (["--presence-penalty", "5"], "--presence-penalty"),
        (["--logit-bias", "x:y"], "--logit-bias"),
        (["--regex", "a", "--grammar", "g.lark"], "at most one"),
    ],
)
def test_bad_flags_are_one_error_line(tiny_spark_pair, args, words):
    out = run(tiny_spark_pair, *args)
    assert out.exit_code == 2
    lines = [line for line in out.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], out.output
    assert "Traceback" not in out.output


def test_bad_schema_file_names_the_file(tiny_spark_pair, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"type": "object", "properties": {"x": {"type": "nonsense"}}}')
    out = run(tiny_spark_pair, "--json-schema", str(path))
    assert out.exit_code == 2 and "--json-schema" in out.output and "nonsense" in out.output
