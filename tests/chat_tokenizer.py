"""A byte-level tokenizer with a GLM-style chat template, built in memory for unit tests."""

from __future__ import annotations

import functools

GLM_STYLE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}{{ '<|observation|>\n' }}{% else %}{{ '<|' + m.role + '|>\n' }}{% endif %}"
    "{{ m.content }}{% if m.role == 'assistant' %}{{ '<|endoftext|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# A template that rewrites earlier assistant turns (drops text before '</think>'), like reasoning
# models' templates do: prefix extension breaks and the agent must split the episode.
THINK_STRIPPING_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m.role + '|>\n' }}"
    "{% if m.role == 'assistant' and '</think>' in m.content %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}"
    "{% if m.role == 'assistant' %}{{ '<|endoftext|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@functools.cache
def byte_tokenizer(template: str = GLM_STYLE_TEMPLATE):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = template
    return fast
