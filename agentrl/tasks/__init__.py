"""Harbor / terminal-bench-2 tasks: the model (`task`, `config`), loading, linting, and the prompt
rows every environment's data comes in (`rows`)."""
