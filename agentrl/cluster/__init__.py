"""Cluster recipes for any model on any layout: the layout planner (`planner`), the model's shape (`model`), the
resolved plan of a recipe with every process's command line (`recipe`), checkpoint preparation
(`prepare`), the recipe CLI (`cli.make_app`). The recipes themselves (models, defaults, run
settings) live under `recipes/`. Pure Python; nothing here imports Ray, torch or SGLang at module level."""
