"""One episode end to end: run, verify (tests/test.sh -> reward, outcome), record, replay; the oracle
sweep; `Episode` and `Sample`, the records that cross from rollout to training."""
