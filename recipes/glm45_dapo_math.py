"""GLM-4.5 (355B-A32B) on DAPO-Math-17k, the Miles Python launcher's recipe:
`python recipes/glm45_dapo_math.py train --num-nodes 8 --dry-run`.

GRPO (clip 1e-4 / 2e-4, TIS), colocated, CPU Adam, 32-GPU SGLang engines with MTP. Branches: <= 4
nodes, the debug layout TP4 PP1 CP1 EP4; 8 nodes, TP4 PP8 CP2 EP8. Blackwell only (B200, GB300), as
upstream: `--hardware H100` is refused with the reason. The recipe is `recipes/_glm45.py`; the
planner and launcher are agentrl.cluster's. Training on a cluster needs `glm4_moe` in agentrl's
Megatron backend (not there yet: `train` says so; `--dry-run` and `prepare --no-convert` work).
"""

# `_glm45` sits next to this script: Python puts a script's own directory first on its path.
from _glm45 import GRPO_SPEC as spec
from _glm45 import app as _app

app = _app(spec.name)

if __name__ == "__main__":
    app()
