"""`rollout --help` and `rollout validate` start fast: what they import.

Start-up time is mostly import time, and timings on a shared machine are noise, so
these tests pin the modules instead. `--help` loads typer and rich and the CLI's own
modules: no config models (pydantic), no store, no entry-point scan, no asyncio, no
server and no ML library. `validate` and `train --dry-run` add the config models and
the dataset readers, and import only the CLI module of their own command.
`benchmarks/startup.py` times them (target: under 0.3 s each).

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/cli_e2e/test_cli_startup.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from cli_e2e_helpers import assert_ok, run_cli_side_by_side, run_python

from rollout.cli.main import SUBCOMMANDS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

HEAVY = (
    "torch", "transformers", "safetensors", "tokenizers", "numpy", "datasets",
    "sqlalchemy", "boto3", "fastapi", "uvicorn",
)  # fmt: skip
"""Never imported by `--help`, `validate` or `train --dry-run`."""

NOT_FOR_HELP = (
    *HEAVY, "pydantic", "asyncio", "importlib.metadata",
    "rollout.config", "rollout.algorithms", "rollout.plugins", "rollout.store", "rollout.inference",
    "rollout.eval", "rollout.rl", "rollout.data", "rollout.models", "rollout.tasks",
)  # fmt: skip
"""Not imported by `rollout --help`: the config models, the plugin scan, stores, harnesses, ML."""


def run_main(*argvs: list[str]) -> tuple[list[dict], set[str]]:
    """Call `rollout.cli.main.main(argv)` for each argv in one fresh interpreter; returns each call's
    exit code and stdout, and every module imported by the end."""
    code = f"""
import contextlib, io, json, sys
from rollout.cli.main import main
calls = []
for argv in {json.dumps(list(argvs))}:
    out, err = io.StringIO(), io.StringIO()
    exit_code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(argv)
    except SystemExit as exit:
        exit_code = exit.code
    calls.append({{"code": exit_code, "stdout": out.getvalue(), "stderr": err.getvalue()}})
print(json.dumps({{"calls": calls, "modules": sorted(sys.modules)}}))
"""
    result = run_python(code)
    assert_ok(result)
    found = json.loads(result.stdout.splitlines()[-1])
    return found["calls"], set(found["modules"])


def loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    """The `names` imported: a package counts if it or any of its submodules is."""
    return [n for n in names if any(m == n or m.startswith(f"{n}.") for m in modules)]


def example_config(name: str, tmp_path: Path, arith_data: dict[str, Path]) -> Path:
    """examples/NAME with its `../local/` paths under tmp_path and the arithmetic data of the
    session fixture. `validate` reads the config and the dataset, not the model folder."""
    text = (EXAMPLES / name).read_text(encoding="utf-8")
    text = text.replace("../local/data/arithmetic/", f"{arith_data['sft'].parent}/")
    config = tmp_path / name
    config.write_text(text.replace("../local/", f"{tmp_path}/"), encoding="utf-8")
    return config


@pytest.mark.parametrize("argv", [["--help"], []], ids=["--help", "no-args"])
def test_help_imports_typer_rich_and_the_cli_only(argv):
    [call], modules = run_main(argv)
    assert call["code"] == (0 if argv else 2)
    assert "Usage: rollout [OPTIONS] COMMAND [ARGS]..." in call["stdout"] + call["stderr"]
    assert loaded(modules, NOT_FOR_HELP) == []
    assert {"typer", "rich", "rollout.cli.main", "rollout.cli.config_cmds", "rollout.cli.eval"} <= modules


def test_help_lists_every_command_in_order():
    [call], _ = run_main(["--help"])
    positions = [call["stdout"].find(f"│ {name} ") for name in SUBCOMMANDS]
    assert -1 not in positions, call["stdout"]
    assert positions == sorted(positions)


def test_group_help_imports_no_store_or_ml_library():
    """A sub-command's help builds that command's click parameters only (typer itself loads
    pydantic to coerce them): still no config model, store, server or ML library."""
    argvs = [["snapshot", "--help"], ["runs", "list", "--help"], ["eval", "--help"], ["serve", "--help"],
             ["dashboard", "--help"], ["infer", "batch", "--help"], ["logs", "tail", "--help"]]  # fmt: skip
    calls, modules = run_main(*argvs)
    for argv, call in zip(argvs, calls, strict=True):
        assert call["code"] == 0, (argv, call)
        assert call["stdout"].lstrip().startswith(f"Usage: rollout {' '.join(argv[:-1])} "), call["stdout"]
    assert loaded(modules, (*HEAVY, "rollout.config", "rollout.store", "rollout.inference.batch")) == []


def test_validate_imports_the_config_models_but_no_store_or_ml_library(tmp_path, arith_data):
    config = example_config("sft-tiny.toml", tmp_path, arith_data)
    [call], modules = run_main(["validate", "--config", str(config)])
    assert call["code"] == 0, call
    assert call["stdout"] == (
        f"config OK: algorithm=sft model={tmp_path.resolve()}/models/tiny dataset={arith_data['sft']} lines=64\n"
    )
    assert loaded(modules, (*HEAVY, "asyncio", "rollout.store", "rollout.inference.batch")) == []
    assert "importlib.metadata" not in modules  # pydantic's plugin loader stays a stand-in: plugins are off
    assert {"pydantic", "rollout.config", "rollout.data.jsonl"} <= modules
    # The other commands' modules stay unimported.
    assert {m for m in modules if m.startswith("rollout.cli")} == {
        "rollout.cli", "rollout.cli.main", "rollout.cli.config_cmds"
    }


VALIDATE_PROBE = """
import atexit, gc, importlib.metadata, json, os, sys

scans, collections = [], []
distributions = importlib.metadata.distributions
def counted(**kwargs):
    scans.append(1)
    return distributions(**kwargs)
importlib.metadata.distributions = counted  # entry_points() and pydantic's plugin loader call it

import functools
from rollout.cli import config_cmds
inside = []
@functools.wraps(config_cmds.validate)
def watched(*args, **kwargs):  # the command itself, from its first import to its output
    inside.append(1)
    try:
        return watched.__wrapped__(*args, **kwargs)
    finally:
        inside.clear()
config_cmds.validate = watched  # what `register` hands to typer
gc.callbacks.append(lambda phase, info: phase == "start" and inside and collections.append(info))

def report():  # registered before validate's exit hook, so it runs after it
    print(json.dumps({"scans": len(scans), "collections": len(collections),
                      "frozen_at_exit": gc.get_freeze_count(), "gc_on": gc.isenabled(),
                      "plugins_env": os.environ.get("PYDANTIC_DISABLE_PLUGINS")}))
atexit.register(report)
from rollout.cli.main import main
main(["validate", "--config", sys.argv[1]])
"""


def test_validate_scans_no_entry_points_collects_nothing_and_freezes_at_exit(tmp_path, arith_data):
    """`validate` starts like the short command it is: no scan of the installed packages' entry
    points where none registers a rollout plugin (`plugins.may_register` reads the entry point
    files first; pydantic's own plugin scan is off while the config models build),
    no cyclic collection while it loads the models and scans the lines, and the heap frozen at exit
    so that the interpreter's teardown collections skip it (benchmarks/startup.py)."""
    config = example_config("sft-tiny.toml", tmp_path, arith_data)
    probe = tmp_path / "probe.py"
    probe.write_text(VALIDATE_PROBE)
    result = run_python(f"import runpy, sys; sys.argv = ['probe', {str(config)!r}]; runpy.run_path({str(probe)!r})")
    assert_ok(result)
    assert result.stdout.startswith("config OK: algorithm=sft "), result.stdout
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["scans"] == 0  # the test venv has no rollout plugin installed (tests/plugins install theirs aside)
    assert seen["collections"] <= 1  # the one due when the pause ends, if any (21 before the pause)
    assert seen["gc_on"] is True and seen["plugins_env"] is None  # both as they were once validate returned
    assert seen["frozen_at_exit"] > 10_000  # typer, pydantic and the config models


PLUGIN_PROBE = """
import json, os, sys
sys.path.insert(0, PLUGIN_DIR)
if LOADER == "stand-in":
    from rollout.cli.main import _defer_pydantic_plugin_loader
    _defer_pydantic_plugin_loader()
import pydantic
import probe_plugin

def build(name, disabled):
    if disabled is None:
        os.environ.pop("PYDANTIC_DISABLE_PLUGINS", None)
    else:
        os.environ["PYDANTIC_DISABLE_PLUGINS"] = disabled
    model = pydantic.create_model(name, x=(int, ...))
    model(x=1)
    return {"name": name, "metadata": "importlib.metadata" in sys.modules,
            "loader": type(sys.modules["pydantic.plugin._loader"]).__name__}

seen = [build("Off", "1"), build("OffAll", "__all__"), build("On", None), build("OffAgain", "true")]
print(json.dumps({"seen": seen, "validated": probe_plugin.validated}))
"""

PROBE_PLUGIN = """
validated = []

class OnValidatePython:
    def __init__(self, name):
        self.name = name

    def on_enter(self, input, **kwargs):
        validated.append(self.name)


class Plugin:
    def new_schema_validator(self, schema, schema_type, schema_type_path, schema_kind, config, settings):
        return OnValidatePython(schema_type_path.name), None, None


plugin = Plugin()
"""


@pytest.mark.parametrize("loader", ["stand-in", "pydantic's"])
def test_pydantic_plugins_load_as_they_would_without_the_stand_in(loader, tmp_path):
    """`rollout.cli.main` stands in for pydantic's plugin loader (it imports `importlib.metadata`)
    until plugins are on. A real plugin, registered the way pydantic finds them (an entry point of
    the `pydantic` group in an installed distribution's metadata): with PYDANTIC_DISABLE_PLUGINS
    set to "1" or "__all__" nothing is loaded and `importlib.metadata` is not imported; unset, the real loader
    loads it and it sees the validation; set again, the real loader returns none. The same
    observations without the stand-in, but for the import, which pydantic's own loader makes at once."""
    (tmp_path / "probe_plugin.py").write_text(PROBE_PLUGIN)
    dist = tmp_path / "probe_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: probe-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pydantic]\nprobe = probe_plugin:plugin\n")
    result = run_python(PLUGIN_PROBE.replace("PLUGIN_DIR", repr(str(tmp_path))).replace("LOADER", repr(loader)))
    assert_ok(result)
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["validated"] == ["On"]  # the plugin is loaded once plugins are on, and used only then
    off, off_all, on, off_again = found["seen"]
    real = "module"
    if loader == "stand-in":
        assert [off["loader"], off_all["loader"]] == ["_PydanticLoaderStandIn"] * 2
        assert [off["metadata"], off_all["metadata"]] == [False, False]
    else:
        assert [off["loader"], off_all["loader"], off["metadata"]] == [real, real, True]
    assert [on["loader"], off_again["loader"], on["metadata"]] == [real, real, True]


def test_validate_of_an_rl_config_imports_no_ml_library(tmp_path, arith_data):
    """RL configs: reward and env names are checked against the built-ins and the plugins'
    metadata while parsing; no reward function or env is imported (that is `plan`'s)."""
    config = example_config("grpo-tiny.toml", tmp_path, arith_data)
    [call], modules = run_main(["validate", "--config", str(config)])
    assert call["code"] == 0, call
    assert call["stdout"].startswith("config OK: algorithm=grpo "), call["stdout"]
    assert loaded(modules, (*HEAVY, "rollout.store", "rollout.rl.rewards", "rollout.rl.envs")) == []


def test_dry_run_imports_only_its_own_cli_modules(tmp_path, arith_data):
    config = example_config("sft-tiny.toml", tmp_path, arith_data)
    [call], modules = run_main(["train", "sft", "--config", str(config), "--dry-run"])
    assert call["code"] == 0, call
    assert call["stdout"].startswith("dry-run OK: algorithm=sft "), call["stdout"]
    assert loaded(modules, (*HEAVY, "asyncio", "rollout.store")) == []
    assert {m for m in modules if m.startswith("rollout.cli")} == {
        "rollout.cli", "rollout.cli.main", "rollout.cli.train", "rollout.cli.config_cmds"
    }


def test_mistyped_commands_are_still_suggested():
    """Commands are made on demand; a typo still gets the closest name, at every level."""
    results = run_cli_side_by_side(["valdate"], ["train", "sfx"], ["snapshot", "lst"])
    expected = ["'valdate'. Did you mean 'validate'?", "'sfx'. Did you mean 'sft'?", "'lst'. Did you mean 'list'?"]
    for result, suggestion in zip(results, expected, strict=True):
        assert result.returncode == 2, result.stderr
        assert f"Error: No such command {suggestion}" in result.stderr


def test_subcommands_table_names_what_each_module_makes():
    """`SUBCOMMANDS` (what `rollout` lists and where it finds each command) agrees with the modules:
    a command a module registers but the table misses would never be found."""
    import importlib

    for module_name in sorted({module for module, _ in SUBCOMMANDS.values()}):
        module = importlib.import_module(f"rollout.cli.{module_name}")
        listed = {name: attr for name, (mod, attr) in SUBCOMMANDS.items() if mod == module_name}
        if "register" in listed.values():
            app = typer.Typer()
            module.register(app)
            registered = {info.name for info in app.registered_commands}
            assert registered == {name for name, attr in listed.items() if attr == "register"}, module_name
        for name, attr in listed.items():
            if attr != "register":
                assert isinstance(getattr(module, attr), typer.Typer), (name, attr)


GC_PROBE = r"""
import gc, json, sys
from rollout import setup_gc
from rollout.cli.main import main

seen = {"collections_while_paused": 0, "at_loop": None}
gc.callbacks.append(lambda phase, info: seen.__setitem__(
    "collections_while_paused", seen["collections_while_paused"] + (phase == "stop" and setup_gc._state["paused"])))
real = setup_gc.setup_done
def spy():
    paused = not gc.isenabled()
    real()
    seen["at_loop"] = {"paused_before": paused, "enabled_after": gc.isenabled(), "frozen": gc.get_freeze_count()}
setup_gc.setup_done = spy
code = 0
try:
    if sys.argv[2] == "cli":
        main(["train", "sft", "--config", sys.argv[1]])
    else:  # the recipe from Python
        from rollout.algorithms.sft import train_sft
        from rollout.config import load_config

        train_sft(load_config(sys.argv[1]))
except SystemExit as ex:
    code = ex.code
print(json.dumps({**seen, "code": code, "enabled_end": gc.isenabled(), "frozen_end": gc.get_freeze_count()}))
"""


@pytest.mark.parametrize("entry", ["cli", "python"])
def test_train_sets_up_without_gc_and_trains_with_it_on(entry, tmp_path, write_config):
    """`rollout train` -- and a recipe called from Python -- pauses the cyclic collector from its
    start to its loop (rollout.setup_gc: ~1 s of a tiny run's set-up went to generation-2
    collections), collects and freezes once when the loop starts, and leaves the collector on and
    nothing frozen when it returns (a caller running the CLI in-process keeps collecting)."""
    config = write_config(tmp_path / "sft.toml")
    probe = tmp_path / "probe.py"
    probe.write_text(GC_PROBE)
    result = run_python(f"import runpy, sys; sys.argv = ['probe', {str(config)!r}, {entry!r}]; runpy.run_path({str(probe)!r})")
    assert_ok(result)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["code"] in (0, None)
    assert seen["collections_while_paused"] == 0  # no automatic collection during set-up
    assert seen["at_loop"] == {"paused_before": True, "enabled_after": True, "frozen": seen["at_loop"]["frozen"]}
    assert seen["at_loop"]["frozen"] > 100_000  # torch, transformers, the model and data: frozen, not rescanned
    assert seen["enabled_end"] is True and seen["frozen_end"] == 0
