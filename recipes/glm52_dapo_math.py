"""GLM-5.2 on DAPO-Math-17k: `python recipes/glm52_dapo_math.py train --num-nodes 16 --dry-run`.

The Miles recipe's branches: 1 node with the pruned 5-layer model (TP4, EP = GPUs); >= 16 nodes of
4 GPUs (TP8 PP4 EP16, 18/20); >= 16 nodes of 8 GPUs (TP4 PP8 CP8 EP32, 14/16, which needs 32
nodes: on fewer the planner searches a layout and prints why). The recipe is `recipes/_glm52.py`;
the planner and launcher are agentrl.cluster's.
"""

# `_glm52` sits next to this script: Python puts a script's own directory first on its path.
from _glm52 import DAPO_MATH as spec
from _glm52 import app as _app

app = _app(spec.name)

if __name__ == "__main__":
    app()
