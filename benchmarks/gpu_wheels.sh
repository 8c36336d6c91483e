#!/usr/bin/env bash
# Wheels for benchmarks/gpu.sh: the packages a lent GPU machine lacks (its image has Python 3.12,
# a CUDA torch, numpy, accelerate, peft, pytest and friends, and no network), at the versions this
# checkout's venv has, downloaded into .whl/ (kept out of git through .git/info/exclude). ~31 MB;
# the device tool's carry takes it: run(command="bash benchmarks/gpu.sh", carry=[".whl"]).
#
#     bash benchmarks/gpu_wheels.sh
set -eu
py=${PY:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
pkgs="pydantic pydantic-core annotated-types typing-inspection typing-extensions blake3 python-ulid sqlalchemy
trl datasets dill multiprocess fsspec regex transformers tokenizers huggingface-hub click hf-xet kernels tomlkit fastapi starlette uvicorn opentelemetry-api
openai httpx2 httpcore2 jiter sniffio distro truststore idna anyio h11"
for p in $pkgs; do
    v=$($py -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$v" ] || { echo "$p is not installed in $py's environment (make install first)"; exit 1; }
    $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$p==$v" 2>&1 | grep -v "^WARNING: Location" || true
done
du -sh .whl
