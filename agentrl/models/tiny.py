"""A tiny random-init GLM-family model with a locally trained BPE tokenizer and a GLM-style chat template.

Architecture: `glm_moe_dsa` (transformers' GLM-5 family: MLA attention, the DSA indexer, a dense first
layer then shared+routed MoE layers). Measured on the 2-core CPU development machine (torch 2.13,
transformers 5.24), one forward+backward at 512 tokens: this 3.4M-parameter config ~0.2 s; decode
with the KV cache ~13 ms per token; a `glm4` model of the same width and depth decoded no faster
(~17 ms per token). So the GLM-5 architecture itself is used, not the older `glm4`.

`index_topk` is set to the context length: the DSA indexer still runs, but selects every earlier
token. With a smaller top-k, a random-init indexer scores many keys exactly 0 (ReLU), and ties are
broken differently by a full forward and by incremental decoding (measured max log-prob
difference 0.87 at 300 tokens, top-k 64). With every token selected, decoding with the KV cache
and a trainer's full forward agree to ~2e-6, which the engine-vs-trainer log-prob checks need.

Tokenizer: byte-level BPE (3072 entries) trained with `tokenizers` on the bundled task texts
(`envs/tbench2/tasks`, when the source tree is present) plus a built-in corpus of shell, JSON and
English. Each newline is its own pre-token, so the text after a role tag never merges with the
message: a conversation tokenized as a whole equals its turns tokenized one by one, which the agent's
token-in/token-out bookkeeping relies on. The chat template is GLM-style:

    [gMASK]<sop><|system|>\\n...<|user|>\\n...<|assistant|>\\n...<|endoftext|><|observation|>\\n...<|assistant|>\\n

`<|endoftext|>` ends each assistant turn and is the eos (and pad) token. Messages with role `tool` or
`observation` render as `<|observation|>` turns.

Everything is cached under `$AGENTRL_CACHE/tiny/<hash>` (default `~/.cache/agentrl`), keyed by the
config, the seed and the training corpus, and is deterministic given those.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from agentrl.errors import AgentRLError

# Bump when the recipe below changes in a way that changes the files produced.
_RECIPE_VERSION = 1

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)
EOS_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 3072
CONTEXT_LENGTH = 4096

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for m in messages %}"
    "{% if m.role in ['tool', 'observation'] %}{{ '<|observation|>\n' }}"
    "{% elif m.role in ['system', 'user', 'assistant'] %}{{ '<|' + m.role + '|>\n' }}"
    "{% else %}{{ raise_exception('unsupported role: ' + m.role) }}{% endif %}"
    "{{ m.content }}"
    "{% if m.role == 'assistant' %}{{ '<|endoftext|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

DEFAULT_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 64,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": CONTEXT_LENGTH,
    "max_position_embeddings": CONTEXT_LENGTH,
    "tie_word_embeddings": False,
}

_BUILTIN_CORPUS = r"""
ls -la /app
cd /app && ls
cat /app/config.json
pwd
echo "hello world" > /app/hello.txt
mkdir -p /app/output/logs
cp -r src/ dst/
mv old_name.txt new_name.txt
rm -rf /tmp/build
chmod +x /app/run.sh
chown -R user:user /home/user
find . -name "*.py" -type f | xargs grep -n "def main"
grep -rn "ERROR" /var/log/app.log | wc -l
sed -i 's/foo/bar/g' /app/input.txt
awk -F, '{ print $1, $3 }' data.csv | sort | uniq -c | sort -rn | head -n 10
head -n 20 /app/data.csv; tail -n 5 /app/data.csv
wc -l < /app/input.txt
tar -czf backup.tar.gz /app/data && tar -xzf backup.tar.gz -C /tmp
python3 -c "import json; print(json.load(open('/app/config.json'))['port'])"
python3 /app/main.py --input data.csv --output result.json
pip install --no-cache-dir requests numpy
apt-get update && apt-get install -y curl git make gcc
git status; git log --oneline -n 5; git diff HEAD~1
git checkout -- file.txt; git reset --hard HEAD~1; git revert --no-edit abc123
git add -A && git commit -m "fix bug"
make && ./build/app --help
gcc -O2 -Wall -o main main.c && ./main
sqlite3 /app/db.sqlite "SELECT name, COUNT(*) FROM users GROUP BY name;"
curl -s http://localhost:8080/health
cat <<'EOF' > /app/script.sh
#!/bin/bash
set -euo pipefail
for f in /app/logs/*.log; do
  if [ -s "$f" ]; then
    gzip "$f"
  fi
done
EOF
while read -r line; do echo "$line"; done < input.txt
export PATH="$HOME/.local/bin:$PATH"
test -f /app/out.txt && echo ok || echo missing
useradd -m -s /bin/bash alice && id alice
ps aux | grep python; kill -9 1234
df -h; du -sh /app; free -m
{"name": "example", "version": "1.0.0", "port": 8080, "debug": false, "tags": ["a", "b"]}
{"analysis": "The file is missing.", "plan": "Create it.", "commands": [{"keystrokes": "ls -la\n", "duration": 0.1}], "task_complete": false}
{"analysis": "Done.", "plan": "", "commands": [], "task_complete": true}
{"tool": "bash", "arguments": {"command": "cat /app/README.md"}}
```bash
ls /app
```
def main():
    with open("input.txt") as f:
        for line in f:
            print(line.strip())

if __name__ == "__main__":
    main()
You are an agent working in a Linux terminal. Run shell commands to complete the task.
The task is complete when the tests pass. Read the files, fix the bug and check the output.
Create a file named output.txt in /app containing the number of lines in the input.
The command exited with status 0. The command exited with status 1: No such file or directory.
Permission denied. command not found. Traceback (most recent call last):
Observation: the output of the command is shown below.
"""


class TinyModelError(AgentRLError):
    """The tiny model could not be built or loaded from its cache directory."""


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("AGENTRL_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "agentrl"
    return base / "tiny"


# The bundled tasks whose text the tiny tokenizer is trained on, pinned: the tokenizer (and so the
# random-init model built on it) would otherwise change with every task added to the bundle or
# every edit of its README, and the demo's result after SFT moves with it (docs/demo_log.md).
CORPUS_TASKS = (
    "c-build-fix", "count-lines", "csv-transform", "fix-python-bug", "git-recover-file",
    "git-remove-commit", "hello-file", "json-config-fix", "log-status-report", "make-dirs",
    "make-executable", "port-service", "replace-word", "rotate-logs-script", "setup-wizard",
    "sqlite-report", "uppercase-file", "user-permissions",
)  # fmt: skip


def _bundled_task_texts() -> list[str]:
    tasks = Path(__file__).resolve().parents[2] / "envs" / "tbench2" / "tasks"
    if not tasks.is_dir():
        return []
    texts = []
    for path in sorted(p for name in CORPUS_TASKS for p in (tasks / name).rglob("*")):
        if path.is_file() and path.suffix in {".md", ".sh", ".toml", ".py", ".json", ".txt", ".csv", ""}:
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
    return texts


def _corpus() -> list[str]:
    return [_BUILTIN_CORPUS, *_bundled_task_texts()]


def _resolved_config(config_overrides: dict[str, Any] | None) -> dict[str, Any]:
    config = dict(DEFAULT_CONFIG)
    if config_overrides:
        config.update(config_overrides)
    if config["vocab_size"] != VOCAB_SIZE:
        raise TinyModelError(
            f"config_overrides vocab_size={config['vocab_size']}: the tiny tokenizer has {VOCAB_SIZE} "
            "entries; leave vocab_size out of the overrides"
        )
    return config


def _digest(config: dict[str, Any], seed: int, corpus: list[str]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"v": _RECIPE_VERSION, "seed": seed, "config": config}, sort_keys=True).encode())
    for text in corpus:
        h.update(hashlib.sha256(text.encode()).digest())
    return h.hexdigest()[:16]


def build_tokenizer(corpus: list[str] | None = None) -> Any:
    """Train the byte-level BPE tokenizer and wrap it as a `PreTrainedTokenizerFast` with the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus if corpus is not None else _corpus(), trainer=trainer)
    if tok.get_vocab_size() < VOCAB_SIZE:
        # A short corpus yields fewer merges; the model's vocabulary stays fixed-size either way.
        tok.add_tokens([f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - tok.get_vocab_size())])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != EOS_TOKEN],
        model_max_length=CONTEXT_LENGTH,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build(target: Path, config: dict[str, Any], seed: int, corpus: list[str]) -> None:
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    tokenizer = build_tokenizer(corpus)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    hf_config = GlmMoeDsaConfig(**config, bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GlmMoeDsaForCausalLM(hf_config)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "agentrl_tiny.json").write_text(json.dumps({"seed": seed, "config": config}, indent=1))
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "agentrl_tiny.json").is_file():
                raise
            # Another process finished the same build first; its files are identical.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tiny_model_dir(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Build (once) and return a directory loadable with `AutoModelForCausalLM.from_pretrained` and
    `AutoTokenizer.from_pretrained`. `cache_dir` is the directory that holds the per-hash folders."""
    config = _resolved_config(config_overrides)
    corpus = _corpus()
    target = _cache_root(cache_dir) / _digest(config, seed, corpus)
    if not (target / "agentrl_tiny.json").is_file():
        try:
            _build(target, config, seed, corpus)
        except OSError as e:
            raise TinyModelError(
                f"cannot write the tiny model to {target}: {e} (set AGENTRL_CACHE to a writable directory)"
            ) from e
    return target


def load_tiny(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """Return `(model, tokenizer)`: the fp32 tiny model in eval mode and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir(cache_dir, seed=seed, config_overrides=config_overrides)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


# The math demo's tokenizer: digits are single tokens (so place value is visible to the model) and
# the DAPO prompt template is in the corpus (so it costs few tokens).
_MATH_CORPUS = r"""
Solve the following math problem step by step. The last line of your response should be of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.
Remember to put your answer on its own line after "Answer:".
What is 47 + 38? What is 6 * 73? 47 + 38 = 85
Answer: \boxed{85}
Answer: $\frac{1}{2}$ \sqrt{2} \pi x^2 + 1 = 0 (1, 2] [0, 1) \{1, 2\} 90^\circ 50\% \text{ cm}
Find the number of positive integers n such that n^2 < 100. Let a, b, c be real numbers. Compute the sum.
"""


def build_math_tokenizer() -> Any:
    """The tiny tokenizer for the math demo: the same vocabulary size, special tokens and chat
    template as `build_tokenizer`, each digit its own token, trained on the built-in corpus plus
    math text and the DAPO prompt template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_BUILTIN_CORPUS, _MATH_CORPUS * 20], trainer=trainer)
    if tok.get_vocab_size() < VOCAB_SIZE:
        tok.add_tokens([f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - tok.get_vocab_size())])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != EOS_TOKEN],
        model_max_length=CONTEXT_LENGTH,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_math_model_dir(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """`tiny_model_dir` with the math tokenizer (`build_math_tokenizer`): the same architecture and
    cache, under its own key."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    config = _resolved_config(config_overrides)
    target = _cache_root(cache_dir) / ("math-" + _digest(config, seed, [_BUILTIN_CORPUS, _MATH_CORPUS]))
    if (target / "agentrl_tiny.json").is_file():
        return target
    try:
        tokenizer = build_math_tokenizer()
        eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        hf_config = GlmMoeDsaConfig(**config, bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GlmMoeDsaForCausalLM(hf_config)
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = eos_id
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            meta = {"seed": seed, "config": config, "tokenizer": "math"}
            (tmp / "agentrl_tiny.json").write_text(json.dumps(meta, indent=1))
            try:
                tmp.rename(target)
            except OSError:
                if not (target / "agentrl_tiny.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        raise TinyModelError(
            f"cannot write the tiny math model to {target}: {e} (set AGENTRL_CACHE to a writable directory)"
        ) from e
    return target
