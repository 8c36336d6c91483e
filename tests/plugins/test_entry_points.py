"""In-process plugins through entry points (SPEC section 11), with real installed packages:
`fixture_pkg/` (a reward, an env, a tool and an algorithm) and `fixture_clash_pkg/` (names that
clash) are pip-installed into temporary `--target` folders (never into the venv) and put on the
path, so `importlib.metadata` sees them as any installed distribution.

    OMP_NUM_THREADS=1 .venv/bin/pytest tests/plugins/test_entry_points.py -q
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from rollout.algorithms.config import EpisodeEnvConfig, RewardSpec
from rollout.errors import ConfigError
from rollout.plugins import entry_point_plugins
from rollout.rl.envs import resolve_env
from rollout.rl.rewards import resolve_reward
from rollout.rl.tools import resolve_tools

HERE = Path(__file__).resolve().parent
ORIGIN = "rollout-fixture-plugin==0.1.0"
CLASH_ORIGIN = "rollout-fixture-clash==0.2.0"


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> tuple[Path, Path]:
    """Both packages `pip install --target`ed (at once), each from a copy: setuptools builds in the source tree."""
    installs = []
    for package in ("fixture_pkg", "fixture_clash_pkg"):
        dest = tmp_path_factory.mktemp(package)
        shutil.copytree(HERE / package, dest / "src")
        command = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                   "--no-build-isolation", "--no-index", "--target", str(dest / "site"), str(dest / "src")]
        installs.append((dest / "site", subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    for _, pip in installs:
        output, _ = pip.communicate()
        assert pip.returncode == 0, output.decode()
    return installs[0][0], installs[1][0]


@pytest.fixture(scope="module")
def site(sites) -> Path:
    return sites[0]


@pytest.fixture(scope="module")
def clash_site(sites) -> Path:
    return sites[1]


def _on_path(*dirs: Path):
    sys.path[:0] = [str(d) for d in dirs]
    entry_point_plugins.cache_clear()
    yield
    del sys.path[: len(dirs)]
    entry_point_plugins.cache_clear()
    for name in [m for m in sys.modules if m.startswith("rollout_fixture_plugin")]:
        del sys.modules[name]


@pytest.fixture
def installed(site):
    yield from _on_path(site)


@pytest.fixture
def clashing(site, clash_site):
    yield from _on_path(site, clash_site)


def _run(code_or_args: list[str], *paths: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, env=env)


# --- rollout plugins list ----------------------------------------------------------------------


def test_plugins_list_shows_the_installed_plugins(site):
    out = _run(["-m", "rollout.cli.main", "plugins", "list", "--json"], site)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    mine = [r for r in rows if r["origin"] != "built-in"]
    assert mine == [
        {"name": "fixture_len", "kind": "reward", "origin": ORIGIN, "ref": "rollout_fixture_plugin.rewards:length_reward"},
        {"name": "fixture_echo", "kind": "env", "origin": ORIGIN, "ref": "rollout_fixture_plugin.envs:EchoEnv"},
        {"name": "fixture_upper", "kind": "tool", "origin": ORIGIN, "ref": "rollout_fixture_plugin.tools:upper"},
        {"name": "fixture_sft", "kind": "algorithm", "origin": ORIGIN, "ref": "rollout_fixture_plugin.algorithm:SPEC"},
    ]
    builtin = {(r["name"], r["kind"]) for r in rows if r["origin"] == "built-in"}
    assert {("arithmetic_correct", "reward"), ("calculator", "env"), ("calculator", "tool"), ("grpo", "algorithm")} <= builtin


def test_listing_imports_no_plugin_module_but_registers_the_algorithm(site):
    """Only the algorithm plugin is imported (its settings are part of the config schema)."""
    script = (
        "import json, sys\n"
        "from rollout.cli.main import main\n"
        "main(['plugins', 'list', '--json'])\n"
        "from rollout.algorithms.registry import ALGORITHMS\n"
        "print(json.dumps([sorted(m for m in sys.modules if m.startswith('rollout_fixture_plugin')),"
        " ALGORITHMS['fixture_sft'].data_kind]), file=sys.stderr)\n"
        "main(['train', '--help'])\n"
    )
    out = _run(["-c", script], site)
    assert out.returncode == 0, out.stderr
    modules, data_kind = json.loads(out.stderr.strip().splitlines()[-1])
    assert modules == ["rollout_fixture_plugin", "rollout_fixture_plugin.algorithm"]
    assert data_kind == "sft"
    assert "fixture_sft" in out.stdout and "SFT registered by a plugin package" in out.stdout  # rollout train --help


def test_plugins_list_reports_clashes_naming_both_origins(site, clash_site):
    out = _run(["-m", "rollout.cli.main", "plugins", "list", "--json"], site, clash_site)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == (
        f"error: plugin name clash: reward function 'fixture_len' is registered by {CLASH_ORIGIN}"
        f" (rollout_fixture_plugin.rewards:length_reward) and by {ORIGIN} (rollout_fixture_plugin.rewards:length_reward);"
        " uninstall one or refer to it by its 'module:attr'"
    )
    assert lines[1].startswith(
        "  plugin name clash: env 'arithmetic' is registered by the built-in (rollout.rl.envs:ArithmeticEnv)"
        f" and by {CLASH_ORIGIN} (rollout_fixture_plugin.envs:EchoEnv)"
    )
    assert lines[2].startswith("  warning: entry point 'model.nonsense' = 'rollout_fixture_plugin.envs:EchoEnv' of"
                               f" {CLASH_ORIGIN}: the name must be '<kind>.<name>'")
    assert "Traceback" not in out.stderr
    assert len(json.loads(out.stdout)) > 4  # the listing still came first


# --- resolution by name ------------------------------------------------------------------------


def test_plugin_names_resolve_like_built_ins(installed):
    assert asyncio.run(_maybe_await(resolve_reward("fixture_len")(["q"], ["abcd"]))) == [4.0]
    env = resolve_env("fixture_echo")()

    async def episode():
        await env.reset({"prompt": "echo me"})
        return await env.step({"role": "assistant", "content": "echo me"})

    assert asyncio.run(episode()).reward == 1.0
    (tool,) = resolve_tools(["fixture_upper"])
    assert tool.name == "fixture_upper" and tool.parameters["required"] == ["text"] and tool(text="ab") == "AB"
    assert RewardSpec(name="fixture_len").name == "fixture_len"  # the config accepts it (nothing imported)
    assert EpisodeEnvConfig(name="fixture_echo", tools=("fixture_upper",)).name == "fixture_echo"


async def _maybe_await(value):
    return await value if asyncio.iscoroutine(value) else value


def test_unknown_names_list_the_installed_plugins(installed):
    with pytest.raises(ConfigError, match=r"unknown reward function 'nope': expected a built-in \(.*\), an installed"
                                          r" plugin \(fixture_len\) or a 'module:attr' reference"):
        resolve_reward("nope")
    with pytest.raises(ValidationError, match=r"unknown env 'nope': use one of arithmetic, .*, fixture_echo or"):
        EpisodeEnvConfig(name="nope")


def test_a_clash_is_an_error_naming_both_origins(clashing):
    with pytest.raises(ConfigError, match=rf"reward function 'fixture_len' is registered by {CLASH_ORIGIN} .* and by {ORIGIN} "):
        resolve_reward("fixture_len")
    with pytest.raises(ConfigError, match=rf"env 'arithmetic' is registered by the built-in \(rollout\.rl\.envs:ArithmeticEnv\) and by {CLASH_ORIGIN}"):
        resolve_env("arithmetic")
    with pytest.raises(ValidationError, match="plugin name clash: env 'arithmetic' is registered by the built-in"):
        EpisodeEnvConfig(name="arithmetic")
    assert resolve_env("fixture_echo") is not None  # names without a clash still resolve


# --- the look before the scan (`may_register`) -------------------------------------------------


def _dist(root: Path, folder: str, entry_points: str | None) -> None:
    (root / folder).mkdir(parents=True)
    (root / folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {folder.partition('-')[0]}\nVersion: 1.0\n")
    if entry_points is not None:
        (root / folder / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def set_path(monkeypatch):
    """`set_path(*dirs)`: `sys.path` is those folders until the test ends (the scan's cache cleared
    each time and after)."""

    def set_to(*dirs: Path) -> None:
        monkeypatch.setattr(sys, "path", [str(d) for d in dirs])
        entry_point_plugins.cache_clear()

    yield set_to
    entry_point_plugins.cache_clear()


def test_may_register_answers_as_importlib_metadata_does(tmp_path, set_path, site):
    """Where it says no, `importlib.metadata` finds no entry point in the group; where a file names
    the group (a real install, an egg-info, an egg's EGG-INFO, brackets doubled) it says yes."""
    import importlib.metadata

    from rollout.plugins import GROUP, may_register

    def agrees(expected: bool) -> None:
        found = bool(importlib.metadata.entry_points(group=GROUP))
        assert (may_register(GROUP), found) == (expected, expected)

    plain = tmp_path / "plain"
    _dist(plain, "other-1.0.dist-info", "[console_scripts]\nother = other:main\n# rollout.plugins\n")
    _dist(plain, "bare-1.0.dist-info", None)
    (plain / "notes.egg-info").write_text("Metadata-Version: 1.0\nName: notes\n")  # an egg-info file: no entry points
    set_path(plain, tmp_path / "missing", tmp_path / "missing.zip")
    agrees(False)
    assert entry_point_plugins() == ((), ())

    set_path(plain, site)  # the fixture package, pip-installed
    agrees(True)
    assert len(entry_point_plugins()[0]) == 4

    legacy = tmp_path / "legacy"
    _dist(legacy, "old.egg-info", f"[[{GROUP}]]\nreward.old = old:reward\n")
    set_path(plain, legacy)
    agrees(True)

    egg = tmp_path / "eggs" / "hatched-1.0-py3.11.egg"
    (egg / "EGG-INFO").mkdir(parents=True)
    (egg / "EGG-INFO" / "PKG-INFO").write_text("Metadata-Version: 1.0\nName: hatched\nVersion: 1.0\n")
    (egg / "EGG-INFO" / "entry_points.txt").write_text(f"[{GROUP}]\nreward.hatched = hatched:reward\n")
    set_path(plain, egg)
    agrees(True)


def test_may_register_leaves_a_zip_or_another_finder_to_the_scan(tmp_path, monkeypatch, set_path):
    from rollout.plugins import GROUP, may_register

    empty = tmp_path / "empty"
    empty.mkdir()
    set_path(empty)
    assert may_register(GROUP) is False
    monkeypatch.setattr(sys, "path", [str(empty), str(empty).encode()])  # a bytes entry (some tools put one)
    assert may_register(GROUP) is True
    archive = tmp_path / "bundle.zip"
    archive.write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip archive
    set_path(empty, archive)
    assert may_register(GROUP) is True

    class Finder:
        @staticmethod
        def find_distributions(context=None):
            return iter(())

    set_path(empty)
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, Finder])
    assert may_register(GROUP) is True
