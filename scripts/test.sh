#!/usr/bin/env bash
# Runs the whole test suite; sets everything up on a fresh machine first.
source "$(dirname "$0")/_env.sh"
python -m pytest -q "$@"
