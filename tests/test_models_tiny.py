"""The tiny GLM-family model and its tokenizer: cached, deterministic, loadable, agent-ready."""

from __future__ import annotations

import concurrent.futures

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agentrl.models.tiny import (  # noqa: E402
    EOS_TOKEN,
    VOCAB_SIZE,
    TinyModelError,
    build_tokenizer,
    load_tiny,
    tiny_model_dir,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture(scope="module")
def tiny(cache):
    return load_tiny(cache)


def test_dir_loads_with_auto_classes_and_is_glm_moe_dsa(cache, tiny) -> None:
    path = tiny_model_dir(cache)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "glm_moe_dsa"
    assert 2_000_000 <= sum(p.numel() for p in model.parameters()) <= 4_000_000
    assert len(tok) == VOCAB_SIZE == model.config.vocab_size
    assert tok.eos_token == EOS_TOKEN and model.config.eos_token_id == tok.eos_token_id
    assert tok.chat_template == tiny[1].chat_template


def test_second_call_reuses_the_cache_and_env_var_sets_the_root(cache, tmp_path, monkeypatch) -> None:
    first = tiny_model_dir(cache)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir(cache) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    assert tiny_model_dir(seed=0).parent == tmp_path / "tiny"


def test_same_seed_same_weights_other_seed_other_weights(cache, tmp_path, tiny) -> None:
    model, _ = tiny
    again, _ = load_tiny(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert tiny_model_dir(cache, seed=1) != tiny_model_dir(cache, seed=0)
    other, _ = load_tiny(cache, seed=1)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_tokenizer_training_is_deterministic() -> None:
    a, b = build_tokenizer(), build_tokenizer()
    assert a.get_vocab() == b.get_vocab()


def test_overrides_change_the_model_and_bad_vocab_is_rejected(cache) -> None:
    path = tiny_model_dir(cache, config_overrides={"num_hidden_layers": 2})
    assert transformers.AutoConfig.from_pretrained(path).num_hidden_layers == 2
    with pytest.raises(TinyModelError, match="vocab_size"):
        tiny_model_dir(cache, config_overrides={"vocab_size": 100})


def test_shell_text_round_trips_and_compresses(tiny) -> None:
    _, tok = tiny
    text = 'cd /app && grep -rn "ERROR" logs/*.log | wc -l > /app/count.txt\n{"port": 8080}\n  ünïcode ✓'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "reply,observation",
    [
        ("ls -la /app", "total 0\n"),
        ('{"analysis": "x", "commands": [{"keystrokes": "cat f\\n"}]}', "\n\nleading newlines"),
        ("\n  indented\n", "   spaces   "),
        ("```bash\necho hi\n```", "hi"),
    ],
)
def test_next_prompt_extends_previous_tokens_exactly(tiny, reply: str, observation: str) -> None:
    _, tok = tiny
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Do it."}]
    prompt = _ids(tok, tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    generated = _ids(tok, reply)
    eos = tok.eos_token_id
    turn = _ids(
        tok,
        tok.apply_chat_template([{"role": "tool", "content": observation}], tokenize=False)[
            len("[gMASK]<sop>") :
        ]
        + "<|assistant|>\n",
    )
    extended = prompt + generated + [eos] + turn
    whole = msgs + [{"role": "assistant", "content": reply}, {"role": "tool", "content": observation}]
    rendered = _ids(tok, tok.apply_chat_template(whole, add_generation_prompt=True, tokenize=False))
    assert extended == rendered


def test_unknown_role_is_a_template_error(tiny) -> None:
    _, tok = tiny
    with pytest.raises(Exception, match="unsupported role"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_kv_cache_decoding_matches_full_forward(tiny) -> None:
    model, _ = tiny
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB_SIZE, (1, 120))

    def run() -> float:
        torch.set_num_threads(1)  # this worker thread only: keeps the decode loop fast under load
        with torch.no_grad():
            full = torch.log_softmax(model(x).logits, -1)
            out = model(x[:, :40], use_cache=True)
            cache, steps = out.cache, [out.logits]
            for i in range(40, 120):
                out = model(x[:, i : i + 1], cache=cache, use_cache=True)
                cache = out.cache
                steps.append(out.logits)
        incremental = torch.log_softmax(torch.cat(steps, 1), -1)
        return (full - incremental).abs().max().item()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(run).result() < 1e-4


def test_forward_backward_gives_finite_grads(tiny) -> None:
    model, _ = tiny
    x = torch.randint(0, VOCAB_SIZE, (2, 64))
    model.zero_grad()
    loss = model(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad()
