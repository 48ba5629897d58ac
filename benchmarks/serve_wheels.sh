#!/usr/bin/env bash
# The `serve` extra's wheels for the GPU machine, which has no FastAPI and cannot download:
# run this here (it downloads into the git-ignored .whl/), then name .whl in the device call's
# carry and start its command with (the device tool's README):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:. || exit
# Then: bash benchmarks/h200_session.sh multi-user:qwen3-30b-a3b
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
  "fastapi>=0.115,<1" "uvicorn>=0.30,<1" "prometheus-client>=0.20,<1" "httpx>=0.27,<1"
ls .whl
du -sh .whl
