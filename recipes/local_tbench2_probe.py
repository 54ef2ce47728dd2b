"""Tune the demo's learning setup in minutes: the same trainer and settings, no sandboxes.

    python recipes/local_tbench2_probe.py --set trainer.lr=1e-4 --eval-every 4

GRPO on the first turn only, rewarded by a proxy: the parsed commands equal the reference
solution's (read from the harvest records of `local_tbench2.py prepare`). On the demo tasks the
proxy's pass rate tracks the real one (0.255 against 0.292 after SFT). Rollouts are sampled with
`generate` at the run's temperature and are exactly on-policy, so what it shows is the optimisation
itself (docs/demo_log.md has the sweeps it ran).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import typer
from local_tbench2 import CONFIG, SET, configure, console

app = typer.Typer(add_completion=False)


@app.command()
def probe(
    set_: list[str] = SET,
    config: Path = CONFIG,
    eval_every: int = typer.Option(4, help="Evaluate the proxy pass rate every N steps."),
    eval_samples: int = typer.Option(32, help="Samples per task in each proxy evaluation."),
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.agent.actions import get_format
    from agentrl.episode.sample import Sample
    from agentrl.train.batch import with_advantages
    from agentrl.train.forward import model_logprobs
    from agentrl.train.torch_backend import TorchTrainer

    cfg = configure(config, set_, dry_run=False)
    assert cfg is not None
    out, temperature = cfg.out_dir, cfg.sampling.temperature
    if not (out / "sft").is_dir() or not (out / "harvest").is_dir():
        raise typer.BadParameter(f"{out}/sft or {out}/harvest is missing: run `prepare` first")
    tokenizer = AutoTokenizer.from_pretrained(str(out / "sft"))
    model = AutoModelForCausalLM.from_pretrained(str(out / "sft"), dtype=torch.float32)
    fmt = get_format(cfg.env["action_format"])
    eos = tokenizer.eos_token_id
    n_prompts = cfg.rollout.batch_size // cfg.rollout.n_samples_per_prompt
    n_samples = cfg.rollout.n_samples_per_prompt

    def commands(text: str) -> list[str]:
        return [c.keystrokes.strip() for c in fmt.parse(text).commands]

    problems = []  # (task id, first-turn prompt tokens, reference commands)
    for path in sorted((out / "harvest").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        first = next(r for r in rows if r["type"] == "turn")
        sample = next(r for r in rows if r["type"] == "result")["samples"][0]
        reference = commands(
            tokenizer.decode(tokenizer.encode(first["model_text"]), skip_special_tokens=True)
        )
        problems.append((rows[0]["task_id"], sample["tokens"][: sample["prompt_length"]], reference))

    @torch.no_grad()
    def sample_turns(prompt: list[int], n: int, seed: int) -> list[list[int]]:
        model.eval()
        torch.manual_seed(seed)
        ids = torch.tensor([prompt] * n)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=cfg.env["agent"]["max_new_tokens"],
            eos_token_id=eos,
            pad_token_id=eos,
        )
        return [row[: row.index(eos) + 1] if eos in row else row for row in gen[:, len(prompt) :].tolist()]

    def reward(turn: list[int], reference: list[str]) -> float:
        return float(commands(tokenizer.decode(turn, skip_special_tokens=True)) == reference)

    def proxy_eval(step: int) -> float:
        per_task = {
            tid: sum(reward(t, ref) for t in sample_turns(prompt, eval_samples, 12345)) / eval_samples
            for tid, prompt, ref in problems
        }
        mean = sum(per_task.values()) / len(per_task)
        console.print(
            f"[b]step {step:3d}  proxy pass@1 {mean:.3f}[/b]  "
            + "  ".join(f"{t}={v:.2f}" for t, v in per_task.items())
        )
        return mean

    trainer = TorchTrainer(model, cfg.trainer, device=cfg.engine.device)
    rng = random.Random(cfg.seed)
    order: list[int] = []
    start = last = proxy_eval(0)
    episodes = 0
    for step in range(1, cfg.steps + 1):
        batch, rewards = [], []
        for p in range(n_prompts):
            # With the dynamic filter a group whose rewards are all equal is dropped and another
            # prompt drawn, as the rollout manager does; each try costs a group of episodes.
            for attempt in range(4 * len(problems)):
                order = order or rng.sample(range(len(problems)), len(problems))
                tid, prompt, ref = problems[order.pop()]
                turns = sample_turns(prompt, n_samples, 1000 * step + p + 7919 * cfg.seed + 100 * attempt)
                group = [reward(turn, ref) for turn in turns]
                episodes += len(turns)
                if not cfg.rollout.dynamic_filter or len(set(group)) > 1:
                    break
            for j, (turn, r) in enumerate(zip(turns, group, strict=True)):
                rewards.append(r)
                with torch.no_grad():
                    logp, _ = model_logprobs(
                        model, torch.tensor([prompt + turn]), chunk_size=None, temperature=temperature
                    )
                batch.append(
                    Sample(
                        prompt_id=f"{step}:{p}",
                        tokens=prompt + turn,
                        prompt_length=len(prompt),
                        loss_mask=[1] * len(turn),
                        rollout_logprobs=logp[0, len(prompt) :].tolist(),
                        reward=r,
                        sample_index=j,
                        task_id=tid,
                    )
                )
        stats = trainer.train_step(with_advantages(batch))
        console.print(
            f"step {step:3d}  reward {sum(rewards) / len(rewards):.2f}  grad_norm {stats['grad_norm']:.3f}"
            f"  episodes so far {episodes}"
        )
        if step % eval_every == 0 or step == cfg.steps:
            last = proxy_eval(step)
    console.print(f"[b]proxy pass@1 {start:.3f} -> {last:.3f} ({last - start:+.3f})[/b]")


if __name__ == "__main__":
    app()
