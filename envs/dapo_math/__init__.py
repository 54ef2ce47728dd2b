"""Single-turn math in the DAPO-Math-17k format: no sandbox, scored by answer equivalence
(math-verify, in killable worker processes), with the DAPO recipe's rewards.

    env.name=dapo_math  env.train_file=<rows .jsonl|.parquet>  env.eval_file=<rows>

`rows.py` the published row format; `answer.py` extraction; `verify.py` equivalence with a hard
time limit; `hub.py` the download; `synthetic.py` the embedded demo's arithmetic family.
"""

from envs.dapo_math import data
from envs.dapo_math.environment import MathConfig, MathEnvironment, MathRunner, plugin

# The cluster recipes' data hooks (prepare, run settings, local mode): `agentrl.cluster.recipe.env_data`.
plugin.data = data  # type: ignore[attr-defined]

__all__ = ["MathConfig", "MathEnvironment", "MathRunner", "data", "plugin"]
