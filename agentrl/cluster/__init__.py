"""Cluster recipes for GLM-5.2: the layout planner (`planner`), the model's shape (`model`), the
resolved plan of a recipe with every process's command line (`recipe`), checkpoint preparation
(`prepare`). Pure Python; nothing here imports Ray, torch or SGLang at module level."""
