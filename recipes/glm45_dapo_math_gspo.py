"""GLM-4.5 (355B-A32B) on DAPO-Math-17k, the Miles bash launcher's recipe:
`python recipes/glm45_dapo_math_gspo.py train --num-nodes 8 --dry-run`.

GSPO (sequence-level ratio, clip 1e-4 / 2e-4, TIS), colocated on 8 nodes x 8 GPUs with TP8 PP4 CP2
EP16, CPU Adam, 32-GPU SGLang engines with MTP; any GPU kind (H100 by default). The recipe is
`recipes/_glm45.py`. Training on a cluster needs `glm4_moe` in agentrl's Megatron backend (not there
yet: `train` says so; `--dry-run` and `prepare --no-convert` work).
"""

# `_glm45` sits next to this script: Python puts a script's own directory first on its path.
from _glm45 import GSPO_SPEC as spec
from _glm45 import app as _app

app = _app(spec.name)

if __name__ == "__main__":
    app()
