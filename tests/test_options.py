"""The generation options: validated once when built, one object from the keyword API to the round."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import mlx_dspark
from mlx_dspark.engine.options import (
    DEFAULT_OPTIONS,
    SEED_MAX,
    GenerationOptions,
    OptionError,
    SamplingOptions,
    SpeculationOptions,
)
from mlx_dspark.engine.logits.sample import Sampler

BAD_VALUES = [
    (SamplingOptions, "temperature", -1.0),
    (SamplingOptions, "temperature", float("nan")),
    (SamplingOptions, "temperature", float("inf")),
    (SamplingOptions, "top_p", 0.0),
    (SamplingOptions, "top_p", 1.5),
    (SamplingOptions, "top_k", -1),
    (SamplingOptions, "top_k", 2.5),
    (SamplingOptions, "min_p", 1.0),
    (SamplingOptions, "min_p", -0.1),
    (SamplingOptions, "seed", -1),
    (SamplingOptions, "seed", 2**64),
    (SamplingOptions, "seed", 1.5),
    (SamplingOptions, "seed", True),
    (SpeculationOptions, "draft_sampling", "beam"),
    (SpeculationOptions, "p_min", 1.5),
    (SpeculationOptions, "p_min", "0.1"),
    (SpeculationOptions, "confidence_threshold", -0.1),
    (SpeculationOptions, "max_draft_tokens", 0),
    (SpeculationOptions, "max_draft_tokens", 2.0),
    (SpeculationOptions, "speculative", "yes"),
    (GenerationOptions, "max_tokens", 0),
    (GenerationOptions, "max_tokens", "8"),
    (GenerationOptions, "stop", 5),
    (GenerationOptions, "stop", ["ok", 1]),
    (GenerationOptions, "stop_token_ids", [-1]),
    (GenerationOptions, "chat_template_kwargs", ["enable_thinking"]),
    (GenerationOptions, "sampling", Sampler()),
]


@pytest.mark.parametrize("cls, field, value", BAD_VALUES, ids=[f"{f}={v!r}" for _, f, v in BAD_VALUES])
def test_a_bad_value_is_refused_at_construction_naming_field_and_value(cls, field, value):
    with pytest.raises(OptionError) as info:
        cls(**{field: value})
    assert info.value.field == field
    assert str(info.value).startswith(f"{field} must be ") and str(info.value).endswith(f"got {value!r}")
    assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working


def test_the_seed_range_is_mlx_s_unsigned_64_bits():
    assert SamplingOptions(seed=0).seed == 0 and SamplingOptions(seed=SEED_MAX).seed == 2**64 - 1


def test_defaults_and_normalised_fields():
    assert DEFAULT_OPTIONS == GenerationOptions()
    options = GenerationOptions(stop="\n", stop_token_ids=[3, 4], chat_template_kwargs={"enable_thinking": False})
    assert options.stop == ("\n",) and options.stop_token_ids == (3, 4)
    assert GenerationOptions(stop=["", "END"]).stop == ("END",)  # an empty stop string would stop at once
    assert isinstance(options.sampling, Sampler)  # the sampling options are the loops' sampler
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_tokens = 3


def test_draft_length_is_the_block_size_unless_capped_below_it():
    assert SpeculationOptions().draft_length(7) == 7
    assert SpeculationOptions(max_draft_tokens=3).draft_length(7) == 3
    assert SpeculationOptions(max_draft_tokens=7).draft_length(7) == 7
    with pytest.raises(OptionError, match="at most the draft's block size 7, got 8"):
        SpeculationOptions(max_draft_tokens=8).draft_length(7)


def test_from_keywords_builds_what_the_nested_classes_build():
    keywords = dict(
        max_tokens=9, clamp_max_tokens=True, stop="END", stop_token_ids=None, temperature=0.7, seed=3,
        logit_bias={"5": 2.0}, lookup="off", max_draft_tokens=None, fast_forward=False, logprobs=2,
    )  # fmt: skip
    nested = GenerationOptions(
        max_tokens=9, clamp_max_tokens=True, stop=("END",), logprobs=2,
        sampling=SamplingOptions(temperature=0.7, seed=3, logit_bias=((5, 2.0),)),
        speculation=SpeculationOptions(lookup="off", max_draft_tokens=None, fast_forward=False),
    )  # fmt: skip
    assert GenerationOptions.from_keywords(**keywords) == nested
    assert GenerationOptions.from_keywords() == DEFAULT_OPTIONS
    assert GenerationOptions.from_keywords(stop=None, stop_token_ids=None, logit_bias=None) == DEFAULT_OPTIONS
    with pytest.raises(OptionError) as info:
        GenerationOptions.from_keywords(top_p=0.0)  # the classes still check the values
    assert info.value.field == "top_p"


def test_replace_changes_only_the_named_options_in_every_group():
    base = GenerationOptions.from_keywords(max_tokens=7, temperature=0.5, seed=1, lookup="only")
    changed = base.replace(seed=2, speculative=False)
    assert changed == GenerationOptions.from_keywords(max_tokens=7, temperature=0.5, seed=2, lookup="only", speculative=False)
    assert base.replace() == base
    with pytest.raises(TypeError, match="'max_token'"):
        base.replace(max_token=3)


# -- the API front ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tiny_spark_pair):
    return mlx_dspark.load(str(tiny_spark_pair[0]), draft=str(tiny_spark_pair[1]))


def _option_fields():
    """The fields of the three option classes, read off the dataclasses (not off the API's own list)."""
    groups = {"sampling": SamplingOptions, "speculation": SpeculationOptions}
    out = [f for f in dataclasses.fields(GenerationOptions) if f.name not in groups]
    return out + [f for cls in groups.values() for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("function", ["generate", "stream_generate"])
def test_every_option_field_is_a_keyword_only_parameter_with_its_default(function):
    parameters = inspect.signature(getattr(mlx_dspark, function)).parameters
    fields = _option_fields()
    assert len(fields) >= 29  # the three classes' fields today, groups opened
    for field in fields:
        assert field.name in parameters, field.name
        assert parameters[field.name].kind is inspect.Parameter.KEYWORD_ONLY, field.name
        assert parameters[field.name].default == field.default, field.name
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())  # nothing swallowed unseen


def test_generate_and_stream_generate_take_the_same_parameters():
    generate = inspect.signature(mlx_dspark.generate).parameters
    stream = inspect.signature(mlx_dspark.stream_generate).parameters
    assert list(generate) == list(stream)
    assert all(generate[name].default == stream[name].default for name in generate)
    for name in ("options", "proposer", "prompt_cache", "cancel", "tools", "tool_choice", "parallel_tool_calls"):
        assert stream[name].kind is inspect.Parameter.KEYWORD_ONLY, name


@pytest.mark.parametrize("function", ["generate", "stream_generate"])
def test_a_misspelt_keyword_is_a_type_error_naming_it(function):
    call = getattr(mlx_dspark, function)
    with pytest.raises(TypeError, match="'temprature'.*did you mean 'temperature'"):
        call(None, "hi", temprature=0.5)  # refused before the model is touched
    with pytest.raises(TypeError, match="'temprature'"):
        call(None, "hi", options=GenerationOptions(), temprature=0.5)
    with pytest.raises(TypeError, match="'sampling'"):
        call(None, "hi", sampling=SamplingOptions())  # the groups are opened, not keywords themselves


def test_the_keywords_and_options_reach_the_stream_as_equal_objects(pair, monkeypatch):
    seen = []
    monkeypatch.setattr(mlx_dspark.api, "_stream", lambda model, prompt, options, *rest: seen.append(options))
    keywords = dict(max_tokens=5, temperature=1.0, top_k=20, seed=5, stop=None, logit_bias={3: 1.0}, lookup="off")
    mlx_dspark.stream_generate(pair, "hi", **keywords)
    mlx_dspark.stream_generate(pair, "hi", options=GenerationOptions.from_keywords(**keywords))
    assert seen[0] == seen[1] and seen[0].sampling.logit_bias == ((3, 1.0),) and seen[0].speculation.lookup == "off"


def test_the_options_object_and_the_keywords_give_the_same_run(pair):
    keywords = mlx_dspark.generate(pair, "Once upon", max_tokens=12, temperature=1.0, top_k=20, seed=5, max_draft_tokens=2)
    options = GenerationOptions(
        max_tokens=12,
        sampling=SamplingOptions(temperature=1.0, top_k=20, seed=5),
        speculation=SpeculationOptions(max_draft_tokens=2),
    )
    whole = mlx_dspark.generate(pair, "Once upon", options=options)
    assert whole.tokens == keywords.tokens and whole.proposal_lengths == keywords.proposal_lengths
    assert max(whole.proposal_lengths) <= 2


def test_options_and_keywords_together_are_refused(pair):
    with pytest.raises(ValueError, match="either as `options=` or as keywords"):
        mlx_dspark.stream_generate(pair, "hi", options=GenerationOptions(), max_tokens=3)


@pytest.mark.parametrize("max_draft_tokens", [1, 3])
def test_max_draft_tokens_caps_the_rounds_of_the_real_draft_and_stays_lossless(pair, max_draft_tokens):
    plain = mlx_dspark.generate(pair, "The quick brown fox", max_tokens=30, speculative=False)
    capped = mlx_dspark.generate(pair, "The quick brown fox", max_tokens=30, max_draft_tokens=max_draft_tokens)
    assert capped.tokens == plain.tokens
    assert capped.rounds > 0 and max(capped.proposal_lengths) <= max_draft_tokens


def test_max_draft_tokens_above_the_drafts_block_size_is_a_clear_error(pair):
    with pytest.raises(OptionError, match="block size 7"):
        mlx_dspark.generate(pair, "hi", max_tokens=4, max_draft_tokens=8)
    assert mlx_dspark.generate(pair, "hi", max_tokens=4, max_draft_tokens=8, speculative=False).tokens  # no draft: unused


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_an_out_of_range_seed_is_a_value_error_not_a_crash_in_mlx(pair, seed):
    with pytest.raises(ValueError, match="seed must be an integer in \\[0, 2\\*\\*64 - 1\\]"):
        mlx_dspark.generate(pair, "hi", max_tokens=2, seed=seed)
