"""The Megatron trainer backend for the GLM-5 family (`glm_moe_dsa`: MLA + MoE + DSA).

    plan.py      the parallel layout and the DSA pipeline-split rule (pure Python)
    settings.py  `MegatronSettings`: the backend's knobs in the run config (pure Python)
    model.py     the model on megatron-core's modules, from a Hugging Face config
    convert.py   HF <-> megatron names, shapes and shards (load, export)
    parallel.py  process groups (gloo on CPU, NCCL on GPU)
    trainer.py   `MegatronTrainer`, the `Trainer` protocol

Only `plan` and `settings` import without megatron-core (Python >= 3.12); see docs/megatron.md.
"""
