#!/bin/bash
# MGSPO_PYTHON of the launcher test that uses the stand-in trainer: `-m launch.cli train` runs
# stub_train.py; everything else (the rollout servers, the router) the real interpreter.
real=${MGSPO_REAL_PYTHON:?set MGSPO_REAL_PYTHON to the Python that runs the project}
if [ "$1 $2 $3" = "-m launch.cli train" ]; then
    shift 3
    exec "$real" "$(dirname "$0")/stub_train.py" "$@"
fi
exec "$real" "$@"
