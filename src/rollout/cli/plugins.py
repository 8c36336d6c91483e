"""`rollout plugins list`: the envs, reward functions, tools and algorithms a config can name.

    rollout plugins list              # a table on a terminal: name, kind, origin, reference
    rollout plugins list --json       # [{"name", "kind", "origin", "ref"}, ...] (also when piped)

Built-ins, then what installed packages register as entry points in the group
`rollout.plugins` (`rollout.plugins`); origin is "built-in" or the distribution as
"name==version". Listing imports no plugin module (algorithm plugins excepted: the
registry loads them for the config schema). A name clash (naming both origins) or an
algorithm plugin that can't be used is an error after the listing (exit 2); an entry
point whose name has no known kind is skipped with a warning.
"""

from __future__ import annotations

import typer

from rollout.cli.snapshot import JsonOption, new_table, plain, print_json, print_tables, wants_json
from rollout.errors import ConfigError

app = typer.Typer(help="Installed plugins: envs, reward functions, tools and algorithms.", no_args_is_help=True)


@app.command("list")
def list_command(as_json: JsonOption = False) -> None:
    """Every env, reward function, tool and algorithm by name, with its kind and origin."""
    from rollout.algorithms.registry import ALGORITHM_PLUGIN_PROBLEMS, BUILTIN_ALGORITHMS
    from rollout.plugins import clash_errors, entry_point_plugins, plugins_of

    plugins = [
        *plugins_of("reward"), *plugins_of("env"), *plugins_of("tool"),
        *plugins_of("algorithm", {kind: spec.train for kind, spec in BUILTIN_ALGORITHMS.items()}),
    ]
    problems = [str(err) for err in clash_errors(plugins).values()]
    problems += [str(err) for err in ALGORITHM_PLUGIN_PROBLEMS.values() if str(err) not in problems]
    rows = [{"name": p.name, "kind": p.kind, "origin": p.origin, "ref": p.ref} for p in plugins]
    if wants_json(as_json):
        print_json(rows)
    else:
        table = new_table("name", "kind", "origin", "reference")
        table.columns[3].overflow = "fold"
        for row in rows:
            table.add_row(plain(row["name"]), row["kind"], plain(row["origin"]), plain(row["ref"]))
        print_tables(table)
    # An entry point of a kind this version doesn't know (maybe a newer rollout's) is only a warning.
    warnings = [f"warning: {skipped}" for skipped in entry_point_plugins()[1]]
    if problems:
        raise ConfigError(problems[0], details=problems[1:] + warnings)
    for warning in warnings:
        typer.echo(warning, err=True)
