#!/usr/bin/env bash
# Runs the demo (scripts/demo.py); sets everything up on a fresh machine first.
source "$(dirname "$0")/_env.sh"
python scripts/demo.py "$@"
