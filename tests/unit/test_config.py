"""Config: schema, locators, path resolution, the committed JSON Schema."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.config import RunConfig, load_config, parse_config
from rollout.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.mark.parametrize("name", ["sft-tiny.toml", "rm-tiny.toml"])
def test_examples_validate_with_the_spec_block_shape(name):
    cfg = load_config(EXAMPLES / name)
    kind = name.split("-")[0]
    assert cfg.schema_version == 1 and cfg.algorithm.kind == kind
    s = cfg.algorithm.settings
    for block in ("base_model", "optimizer", "budget", "dataset", "packing", "loss_on"):
        assert getattr(s, block) is not None
    # relative paths resolve against the config's folder
    start = {"sft": "tiny", "rm": "sft-tiny"}[kind]  # the RM starts from the SFT model
    assert s.base_model.uri == str((ROOT / "local/models" / start).resolve())
    assert cfg.storage.embedded.path == (ROOT / "local/rollout.db").resolve()
    assert s.dataset.path.is_absolute()


def _bad(text: str, tmp_path: Path) -> ConfigError:
    p = tmp_path / "run.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    return info.value


BASE = (EXAMPLES / "sft-tiny.toml").read_text()


def test_unknown_key_has_a_deterministic_locator(tmp_path):
    err = _bad(BASE.replace("lr = 3e-3", "lr = 3e-3\nlrr = 1"), tmp_path)
    assert str(err).endswith("algorithm.sft.optimizer.lrr: unknown field")
    assert str(err).startswith(f"{tmp_path / 'run.toml'}:")


def test_all_violations_are_reported_at_once(tmp_path):
    text = BASE.replace("lr = 3e-3", "lr = -1").replace("minibatch_size = 32", 'minibatch_size = "x"')
    text = text.replace('kind = "off"', 'kind = "sideways"') + "\n[mystery]\nx = 1\n"
    err = _bad(text, tmp_path)
    lines = [str(err), *err.details]
    assert len(lines) == 4
    joined = "\n".join(lines)
    assert "algorithm.sft.optimizer.lr: must be greater than 0 (got -1)" in joined
    assert "algorithm.sft.minibatch_size: must be a valid integer" in joined
    assert "algorithm.sft.packing.kind: must be 'off', 'bfd' or 'wrapped' (got 'sideways')" in joined
    assert "mystery: unknown field" in joined
    # the same input gives the same messages in the same order
    err2 = _bad(text, tmp_path)
    assert [str(err2), *err2.details] == lines


def test_discriminated_union_errors_name_the_user_keys(tmp_path):
    err = _bad(BASE.replace('kind = "adamw"', 'kind = "adam"'), tmp_path)
    assert "algorithm.sft.optimizer: unknown kind 'adam'" in str(err)
    err = _bad(BASE.replace('kind = "adamw"\nlr = 3e-3', 'kind = "sgd"\nlr = 0.1\nbetas = [0.9, 0.99]'), tmp_path)
    assert str(err).endswith("algorithm.sft.optimizer.betas: unknown field")


def test_kind_must_match_block_and_budget_is_exactly_one(tmp_path):
    err = _bad(BASE.replace('kind = "sft"\n', 'kind = "rm"\n', 1), tmp_path)
    assert 'algorithm: kind = "rm" needs an [algorithm.rm] block' in str(err)
    err = _bad(BASE.replace("max_steps = 400", "max_steps = 400\nmax_epochs = 2"), tmp_path)
    assert "algorithm.sft.budget: set exactly one of max_steps, max_epochs, max_tokens (got 2)" in str(err)


def test_algorithm_kind_errors_are_located(tmp_path):
    err = _bad(BASE.replace('kind = "sft"\n', 'kind = "xyz"\n', 1), tmp_path)
    line = BASE.splitlines().index('kind = "sft"') + 1
    assert str(err) == (
        f"{tmp_path / 'run.toml'}:{line}: algorithm: unknown kind 'xyz'"
        " (expected one of 'sft', 'rm', 'dpo', 'kto', 'grpo', 'ppo')"
    )
    err = _bad(BASE + "\n[algorithm.rm]\nminibatch_size = 1\n", tmp_path)
    assert str(err).endswith('algorithm: [algorithm.rm] does not match kind = "sft"')


def test_the_union_is_the_registry():
    """One list of algorithms: the registry's kinds are the union's tags, each with its settings block."""
    from rollout.algorithms.registry import ALGORITHMS

    schema = RunConfig.model_json_schema()
    assert set(schema["properties"]["algorithm"]["discriminator"]["mapping"]) == set(ALGORITHMS)
    for kind, spec in ALGORITHMS.items():
        variant = schema["$defs"][schema["properties"]["algorithm"]["discriminator"]["mapping"][kind].split("/")[-1]]
        assert variant["properties"][kind] == {"$ref": f"#/$defs/{spec.settings.__name__}"}


def test_canonical_json_keeps_every_algorithm_block_key():
    """The union dumps the shape the run config always had (null for the other kinds), so the
    config digest of an unchanged config is unchanged, and the dump validates again."""
    cfg = parse_config(BASE, source=EXAMPLES / "x.toml")
    dumped = json.loads(cfg.canonical_json())["algorithm"]
    assert list(dumped) == ["dpo", "grpo", "kind", "kto", "ppo", "rm", "sft"]
    assert dumped["kind"] == "sft" and dumped["rm"] is None and dumped["sft"]["minibatch_size"] == 32
    assert RunConfig.model_validate(cfg.model_dump()) == cfg


def test_schema_version_and_toml_syntax(tmp_path):
    err = _bad(BASE.replace("schema_version = 1", "schema_version = 2"), tmp_path)
    assert "schema_version: must be 1 (got 2)" in str(err)
    err = _bad(BASE + "\n[oops\n", tmp_path)
    assert "invalid TOML" in str(err)
    with pytest.raises(ConfigError, match="config not found"):
        load_config(tmp_path / "missing.toml")


def test_rm_refuses_packing_and_partial_loss(tmp_path):
    rm = (EXAMPLES / "rm-tiny.toml").read_text()
    err = _bad(rm.replace('[algorithm.rm.packing]\nkind = "off"', '[algorithm.rm.packing]\nkind = "bfd"'), tmp_path)
    assert 'packing.kind must be "off" for rm' in str(err)


def test_hub_ids_are_not_turned_into_paths():
    cfg = parse_config(BASE.replace('uri = "../local/models/tiny"', 'uri = "Qwen/Qwen2.5-0.5B"'), source=EXAMPLES / "x.toml")
    assert cfg.algorithm.settings.base_model.uri == "Qwen/Qwen2.5-0.5B"


def test_digest_is_stable_and_sensitive():
    a = parse_config(BASE, source=EXAMPLES / "x.toml")
    b = parse_config(BASE, source=EXAMPLES / "x.toml")
    c = parse_config(BASE.replace("seed = 0", "seed = 1"), source=EXAMPLES / "x.toml")
    assert a.digest() == b.digest() != c.digest()


def test_committed_schema_matches_the_code():
    committed = json.loads((ROOT / "schema" / "run-config.schema.json").read_text())
    assert committed == RunConfig.model_json_schema(), "run `make schema` and commit schema/run-config.schema.json"


def test_rollout_schema_prints_the_same_schema():
    out = subprocess.run([sys.executable, "-m", "rollout.cli.main", "schema"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == RunConfig.model_json_schema()


@pytest.mark.parametrize("before", [None, "0"])
def test_pydantic_plugins_are_off_inside_the_block_and_as_they_were_after(before, monkeypatch):
    import os

    from rollout.config_base import pydantic_plugins_off

    if before is None:
        monkeypatch.delenv("PYDANTIC_DISABLE_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("PYDANTIC_DISABLE_PLUGINS", before)
    with pytest.raises(RuntimeError), pydantic_plugins_off():
        assert os.environ["PYDANTIC_DISABLE_PLUGINS"] == "1"
        raise RuntimeError("a config error")
    assert os.environ.get("PYDANTIC_DISABLE_PLUGINS") == before
