"""GLM-4.5-Air (106B-A12B) on DAPO-Math-17k: `python recipes/glm45_air_dapo_math.py train --dry-run`.

8 nodes: 4 training (the planner's layout), 4 rollout (one TP-8 SGLang engine each), GSPO as the
GLM-4.5 bash launcher. The reference's P2P weight transfer is not implemented: the plan syncs over
the distributed transport and says so. The recipe is `recipes/_glm45.py`. Training on a cluster
needs `glm4_moe` in agentrl's Megatron backend (not there yet: `train` says so).
"""

# `_glm45` sits next to this script: Python puts a script's own directory first on its path.
from _glm45 import AIR_SPEC as spec
from _glm45 import app as _app

app = _app(spec.name)

if __name__ == "__main__":
    app()
