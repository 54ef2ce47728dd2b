"""GLM-5.2 on DAPO-Math-17k with LoRA adapters: `python recipes/glm52_dapo_math_lora.py train --num-nodes 16 --dry-run`.

The math recipe's branches with rank-32 adapters on the attention and MLP projections; the plan
prints the memory per GPU with LoRA and with every weight trained, side by side. The Megatron
trainer trains the adapters alone (`agentrl/train/megatron/lora.py`) and the engines get the merged
weights. The recipe is `recipes/_glm52.py`.
"""

# `_glm52` sits next to this script: Python puts a script's own directory first on its path.
from _glm52 import DAPO_MATH_LORA as spec
from _glm52 import app as _app

app = _app(spec.name)

if __name__ == "__main__":
    app()
