"""GLM-5.2 on terminal-bench-2, fully asynchronous: `python recipes/glm52_tbench2.py train --num-nodes 16`.

The reference run: 16 GB300 nodes of 4 GPUs, 8 training (TP2 / CP4 / PP4 / EP8, optimizer state
off the GPU) and 8 inference nodes (one 4-GPU dp-attention FP8 SGLang engine each), one Daytona
sandbox per task. `--dry-run` prints the whole resolved plan. The recipe is `recipes/_glm52.py`;
the planner and launcher are agentrl.cluster's.
"""

# `_glm52` sits next to this script: Python puts a script's own directory first on its path.
from _glm52 import TBENCH2 as spec
from _glm52 import app as _app

app = _app(spec.name)

if __name__ == "__main__":
    app()
