"""`pagedllm serve --config file.yaml` as vLLM's: the file's keys are flag names (dashes or underscores), its values
become what those flags would have given, and a flag on the command line wins; a bad file is an error naming it."""
import argparse

import pytest

from pagedllm.entrypoints import cli
from pagedllm.entrypoints.openai.cli_args import engine_args_from
from pagedllm.models.resolve import DEFAULT_MODEL


@pytest.fixture
def served(monkeypatch):
    """What `serve` would have been called with, instead of serving."""
    calls: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "serve", calls.append)
    return calls


def _run(argv: list[str], served: list) -> argparse.Namespace:
    cli.main(argv)
    return served.pop()


CONFIG = """
model: my-model
port: 9001
max-model-len: 2048
max_num_seqs: 7
enable-prefix-caching: false
enforce-eager: true
served-model-name: [alpha, beta]
speculative-config: {method: ngram, num_speculative_tokens: 3}
dtype: float32
"""


def test_the_files_flags_apply_and_the_command_line_wins(tmp_path, served):
    path = tmp_path / "serve.yaml"
    path.write_text(CONFIG)
    args = _run(["serve", "--config", str(path), "--port", "9002", "--max-num-seqs", "9"], served)
    assert (args.model, args.port, args.max_model_len, args.max_num_seqs) == ("my-model", 9002, 2048, 9)
    assert args.served_model_name == ["alpha", "beta"]
    engine = engine_args_from(args)
    assert engine.enable_prefix_caching is False and engine.enforce_eager is True and engine.dtype == "float32"
    assert engine.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    args = _run(["serve", "other-model", "--config", str(path), "--enable-prefix-caching"], served)
    assert args.model == "other-model" and engine_args_from(args).enable_prefix_caching is True
    assert _run(["serve"], served).port == 8000  # a file read once changes nothing after it


def test_speculative_configs_dashed_keys(tmp_path, served):
    """vLLM's create_speculative_config reads a key's dashes as underscores, as a YAML file's nested keys may be."""
    path = tmp_path / "serve.yaml"
    path.write_text("speculative-config:\n  method: ngram\n  num-speculative-tokens: 3\n  prompt-lookup-max: 4\n")
    args = _run(["serve", DEFAULT_MODEL, "--config", str(path)], served)
    spec = engine_args_from(args).create_engine_config().speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 4)


def test_a_no_key_turns_its_flag_off(tmp_path, served):
    """vLLM's load_config_file: ``no-x: true`` is --no-x; ``no-x: false`` gives no flag (the default stands)."""
    path = tmp_path / "serve.yaml"
    path.write_text("model: m\nno-enable-prefix-caching: true\nno_enable_chunked_prefill: true\n"
                    "no-enforce-eager: false\nep: true\n")
    args = _run(["serve", "--config", str(path)], served)
    assert (args.enable_prefix_caching, args.enable_chunked_prefill, args.enforce_eager) == (False, False, False)
    assert args.enable_expert_parallel is True  # a short form is no --no- spelling
    assert _run(["serve", "--config", str(path), "--enable-prefix-caching"], served).enable_prefix_caching is True


@pytest.mark.parametrize("text, message", [
    ("no-such-flag: 1\n", "unknown flag 'no-such-flag'"),
    ("max-model-len: many\n", "max-model-len"),
    ("enforce-eager: 3\n", "expected true or false"),
    ("dtype: float64\n", "not one of"),
    ("- a list\n", "expected a mapping"),
    ("port: [1\n", "--config"),
])
def test_a_bad_file_is_an_error_naming_it(tmp_path, served, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit):
        cli.main(["serve", "--config", str(path)])
    assert message in capsys.readouterr().err and not served


def test_a_file_without_a_model_needs_one_on_the_command_line(tmp_path, served, capsys):
    """vLLM's rule: with --config, serve's model comes from the command line or the file, never the default."""
    path = tmp_path / "serve.yaml"
    path.write_text("port: 9001\n")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--config", str(path)])
    assert "no model specified" in capsys.readouterr().err and not served
    assert _run(["serve", "my-model", "--config", str(path)], served).model == "my-model"
    assert _run(["serve", "--config", str(path), "--model", "my-model"], served).model == "my-model"
    assert _run(["serve"], served).model == DEFAULT_MODEL  # without a file, the default model, as vLLM's
