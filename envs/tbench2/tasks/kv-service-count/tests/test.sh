#!/bin/bash
# Verifier: run the hidden tests and turn pytest's exit status into the reward.
if [ "$PWD" = "/" ]; then
    echo "Error: no working directory set. Set a WORKDIR in the Dockerfile before running this script." >&2
    exit 1
fi

mkdir -p /logs/verifier
python3 -m pytest -p no:cacheprovider /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
