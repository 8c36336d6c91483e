#!/usr/bin/env bash
# Wheels for benchmarks/gpu.sh: the packages a lent GPU machine lacks or has at other versions (its
# image has Python 3.12, a CUDA torch, numpy, pandas, pyarrow, accelerate, peft, pytest and friends,
# and no network), downloaded into .whl/ (kept out of git through .git/info/exclude) at the versions
# this checkout's venv has: every package that rollout, TRL, transformers, datasets and the server
# need, found by walking their requirements in the venv (so a new requirement -- transformers 5.25's
# huggingface-hub >= 2.4 and `kernels`, say -- travels without editing this list), less the heavy
# ones the image provides (SKIP). ~40 MB; the device tool's carry takes it:
# run(command="bash benchmarks/gpu.sh", carry=[".whl"]).
#
#     bash benchmarks/gpu_wheels.sh
set -eu
py=${PY:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
SKIP="torch numpy pandas pyarrow triton sympy networkx mpmath jinja2 markupsafe setuptools psutil pyyaml packaging
requests urllib3 certifi charset-normalizer idna tqdm filelock fsspec python-dateutil six pytz tzdata safetensors
accelerate"
pkgs=$($py - "$SKIP" <<'PY'
import importlib.metadata as md
import re
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement

env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
skip = {norm(n) for n in sys.argv[1].split()}
found, todo = {}, ["rollout", "trl", "transformers", "datasets", "fastapi", "uvicorn", "openai"]
while todo:
    name = norm(todo.pop())
    if name in found or name in skip:
        continue
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        sys.exit(f"{name} is required but not installed in this venv (make install-bench first)")
    found[name] = dist.version
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            todo.append(req.name)
found.pop("rollout")  # the checkout itself travels as source
print(" ".join(f"{n}=={v}" for n, v in sorted(found.items())))
PY
)
rm -f .whl/*.whl
for p in $pkgs; do
    $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$p" 2>&1 | grep -v "^WARNING: Location" || true
done
echo "$(ls .whl | wc -l) wheels for $(echo $pkgs | wc -w) packages"
du -sh .whl
