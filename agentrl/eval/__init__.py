"""Evaluation: pass@k over any engine and environment (`passk`), Harbor job directories with ATIF
trajectories (`harbor_job`)."""
