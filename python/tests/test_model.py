"""gdncp.Model: the whole Qwen3.5 model (the C library's hybrid decoder) from Python, on the
shared transformers checkpoint tests/data/qwen35_tiny (3 GatedDeltaNet layers + 1 gated
attention layer, vocab 256) and its references (tests/data/qwen35_tiny/README.md).

Tolerances: logits within 1e-5 relative (max-abs error / max-abs reference) of transformers'
fp32 logits (logits.io) and of the exact float64 ones (model_grads.io); generated ids exactly
equal. Every comparison has a negative control that the same check must reject: the logits of a
model with one layer's weights perturbed, or of shifted input ids; a shorter prompt or a
perturbed model for generation; another seed for sampling."""
import ctypes
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import gdncp
from gdncp import _lib as L
from conftest import TINY, read_safetensors, rel_err

CLI = os.environ.get("GDNCP_CLI")
TOL = 1e-5


@pytest.fixture(scope="module")
def tiny():
    m = gdncp.Model.from_pretrained(TINY, threads=1)
    yield m
    m.close()


def _copy_ckpt(tmp_path, config_edit=None, perturb=None, name="ckpt"):
    """A copy of the tiny checkpoint in tmp_path/name: config.json edited by config_edit(dict),
    the weights by perturb(dict of arrays) (else the same file, linked)."""
    d = tmp_path / name
    d.mkdir()
    cfg = json.load(open(os.path.join(TINY, "config.json")))
    if config_edit:
        config_edit(cfg)
    json.dump(cfg, open(d / "config.json", "w"))
    if perturb:
        from safetensors.numpy import save_file
        w = read_safetensors(os.path.join(TINY, "model.safetensors"))
        perturb(w)
        save_file(w, str(d / "model.safetensors"))
    else:
        os.symlink(os.path.join(TINY, "model.safetensors"), d / "model.safetensors")
    return d


def _perturb_layer1(w, factor=1.05):
    name = "model.layers.1.linear_attn.out_proj.weight"
    w[name] = (w[name] * factor).astype(w[name].dtype)


def _gen_io():
    g = read_safetensors(os.path.join(TINY, "generate.io.safetensors"))
    return g["prompt_ids"], g["generated_ids"]


# ----------------------------------------------------------------------------- loading, config

def test_config_is_the_checkpoints(tiny):
    j = json.load(open(os.path.join(TINY, "config.json")))
    c = tiny.config
    assert (c.vocab, c.vocab_size, c.layers, c.hidden_size, c.intermediate_size) == \
        (256, j["vocab_size"], j["num_hidden_layers"], j["hidden_size"], j["intermediate_size"])
    assert list(c.layer_types) == j["layer_types"]
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dims) == (4, 2, 24, 6)
    assert c.max_position_embeddings == 32768 and c.tie_word_embeddings is False
    # the parameter count is the checkpoint's: every tensor's elements
    w = read_safetensors(os.path.join(TINY, "model.safetensors"))
    assert c.num_parameters == sum(a.size for a in w.values())
    assert "GGGA" in repr(tiny) and tiny.path.rstrip("/") == TINY.rstrip("/")


# ----------------------------------------------------------------------------- logits

def test_logits_equal_transformers(tiny, tmp_path):
    """m.logits on logits.io's 135 bytes = transformers' logits (fp32, eager attention) within
    1e-5; on model_grads.io's two rows of 200 = the exact float64 logits. Controls through the
    same check: input ids shifted by one position, and a model whose layer 1 out_proj is scaled
    by 1.05."""
    ref = read_safetensors(os.path.join(TINY, "logits.io.safetensors"))
    ids, want = ref["input_ids"], ref["logits"]
    got = tiny.logits(ids)
    assert got.dtype == np.float32 and got.shape == want.shape == (1, ids.shape[1], 256)
    err = rel_err(got, want)
    assert err < TOL, err
    shifted = tiny.logits(np.roll(ids, 1, axis=1))
    assert rel_err(shifted, want) > 100 * TOL          # control: shifted ids
    with gdncp.Model.from_pretrained(_copy_ckpt(tmp_path, perturb=_perturb_layer1), threads=1) as bad:
        assert rel_err(bad.logits(ids), want) > 100 * TOL   # control: one layer perturbed

    exact = read_safetensors(os.path.join(TINY, "model_grads.io.safetensors"))
    ids2 = exact["input_ids"]
    got2 = tiny.logits(ids2)                            # B = 2 rows
    assert got2.shape == (2, 200, 256)
    err2 = rel_err(got2, exact["logits"])
    assert err2 < TOL, err2
    assert rel_err(tiny.logits(ids2[::-1].copy()), exact["logits"]) > 100 * TOL  # rows swapped
    print(f"logits vs transformers fp32: {err:.2e}; vs exact fp64 (B=2): {err2:.2e}")


def test_bf16_checkpoint(tmp_path, tiny):
    """A BF16 model.safetensors (the golden model.bf16 copy) gives exactly the logits of an F32
    file holding the same BF16-rounded values (1e-6: the conversion is exact, only the thread
    schedule could differ); control: the original F32 weights' logits differ by more than 1e-4."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import save_file
    from safetensors.torch import load_file
    b16 = tmp_path / "bf16"
    b16.mkdir()
    shutil.copy(os.path.join(TINY, "config.json"), b16 / "config.json")
    os.symlink(os.path.join(TINY, "model.bf16.safetensors"), b16 / "model.safetensors")
    rounded = _copy_ckpt(tmp_path, name="rounded", perturb=lambda w: w.update(
        {k: v.float().numpy() for k, v in load_file(os.path.join(TINY, "model.bf16.safetensors")).items()}))
    ids = read_safetensors(os.path.join(TINY, "logits.io.safetensors"))["input_ids"]
    with gdncp.Model.from_pretrained(b16, threads=1) as m, \
            gdncp.Model.from_pretrained(rounded, threads=1) as r:
        got, want = m.logits(ids), r.logits(ids)
    assert rel_err(got, want) < 1e-6, rel_err(got, want)
    assert rel_err(got, tiny.logits(ids)) > 1e-4      # control: the F32 weights


def _hf_random(tmp_path, name, **over):
    """A random transformers Qwen3_5ForCausalLM of a small shape (over: config fields), saved with
    save_pretrained into tmp_path/name: (model, directory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("this transformers has no Qwen3_5ForCausalLM")
    cfg = {k: v for k, v in json.load(open(os.path.join(TINY, "config.json"))).items()
           if k not in ("architectures", "transformers_version", "dtype")}
    cfg.update(over)
    torch.manual_seed(1)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg)).float().eval()
    d = tmp_path / name
    model.save_pretrained(str(d))
    return model, d


@pytest.mark.parametrize("kind", ["tied-attention-first", "vocab-1000"])
def test_other_checkpoints_equal_transformers(tmp_path, kind):
    """Other checkpoints transformers makes: tied embeddings with the layers in another order
    (attention, GatedDeltaNet, GatedDeltaNet), and a vocabulary of 1000 ids (skipped while the
    library reads byte vocabularies only). Logits within 1e-5 of transformers' and greedy ids
    equal to its generate(); controls: the ids shifted by one position, another prompt."""
    torch = pytest.importorskip("torch")
    over = dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "linear_attention"])
    if kind.startswith("tied"):
        over["tie_word_embeddings"] = True
    else:
        over["vocab_size"] = 1000
    hf, d = _hf_random(tmp_path, kind, **over)
    V = hf.config.vocab_size
    try:
        m = gdncp.Model.from_pretrained(d, threads=1)
    except Exception as e:   # the byte-only library (before gdn_token) refuses another vocab
        if V != 256 and "vocab" in str(e):
            pytest.skip(f"this libgdncp reads byte vocabularies only: {e}")
        raise
    with m:
        assert m.config.vocab == V and m.config.tie_word_embeddings == ("tied" in kind)
        assert list(m.config.layer_types) == over["layer_types"]
        ids = np.random.default_rng(2).integers(0, V, (2, 40))
        with torch.no_grad():
            want = hf(torch.tensor(ids)).logits.numpy()
            out = hf.generate(torch.tensor(ids[:, :10]), attention_mask=torch.ones((2, 10), dtype=torch.long),
                              max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
        got = m.logits(ids)
        assert rel_err(got, want) < TOL, rel_err(got, want)
        assert rel_err(m.logits(np.roll(ids, 1, axis=1)), want) > 100 * TOL   # control
        gen = m.generate(ids[:, :10], max_new_tokens=16)
        assert np.array_equal(gen, out[:, 10:].numpy())
        assert not np.array_equal(m.generate(ids[:, 1:11], max_new_tokens=16), out[:, 10:].numpy())
        with pytest.raises(ValueError, match=f"= {V} is not a token id"):
            m.logits([[0, V]])


def _tiny_fields(**over):
    cfg = {k: v for k, v in json.load(open(os.path.join(TINY, "config.json"))).items()
           if k not in ("architectures", "transformers_version", "dtype", "model_type")}
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("kind", ["qwen3-next-dense", "qwen3.5-multimodal", "sharded"])
def test_transformers_layouts_equal_transformers(tmp_path, kind):
    """The checkpoint layouts transformers writes besides Qwen3_5ForCausalLM's one file: a dense
    Qwen3NextForCausalLM (num_experts 0; fused in_proj_qkvz / in_proj_ba), the multimodal
    Qwen3_5ForConditionalGeneration (text weights under model.language_model., a vision tower
    gdncp skips), and Qwen3_5ForCausalLM saved in shards with an index. Each: gdncp's logits
    within 1e-5 of transformers' on text; control: the ids shifted by one position."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    d = tmp_path / kind
    if kind == "qwen3-next-dense":
        hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**_tiny_fields(num_experts=0)))
    elif kind == "qwen3.5-multimodal":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=96, patch_size=4,
                      num_position_embeddings=16)
        hf = transformers.Qwen3_5ForConditionalGeneration(
            transformers.Qwen3_5Config(text_config=_tiny_fields(), vision_config=vision))
    else:
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**_tiny_fields()))
    hf = hf.float().eval()
    hf.save_pretrained(str(d), **({"max_shard_size": "100KB"} if kind == "sharded" else {}))
    names = sorted(os.listdir(d))
    tensors = set()
    for n in names:
        if n.endswith(".safetensors"):
            tensors |= set(read_safetensors(str(d / n)))
    if kind == "sharded":     # the layout is what the test says it is
        assert "model.safetensors.index.json" in names and len([n for n in names if n.endswith(".safetensors")]) > 2
    elif kind == "qwen3-next-dense":
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in tensors
        assert "model.layers.0.linear_attn.in_proj_qkv.weight" not in tensors
    else:
        assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in tensors
        assert any(t.startswith("model.visual.") for t in tensors)
    ids = np.random.default_rng(4).integers(0, 256, (2, 33))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids)).logits.numpy()
    with gdncp.Model.from_pretrained(d, threads=1) as m:
        assert m.config.num_hidden_layers == 4 and list(m.config.layer_types)[3] == "full_attention"
        got = m.logits(ids)
        assert rel_err(got, want) < TOL, rel_err(got, want)
        assert rel_err(m.logits(np.roll(ids, 1, axis=1)), want) > 100 * TOL   # control


def test_logits_take_numpy_torch_and_lists(tiny):
    torch = pytest.importorskip("torch")
    ids = np.array([[1, 2, 3, 250, 7]], np.int64)
    a = tiny.logits(ids)
    b = tiny.logits(torch.tensor(ids))
    c = tiny.logits(ids.tolist())
    d = tiny.logits(ids.astype(np.int16))
    assert np.array_equal(a, b) and np.array_equal(a, c) and np.array_equal(a, d)
    assert not np.array_equal(a, tiny.logits([[1, 2, 3, 250, 8]]))   # control: the input is read


# ----------------------------------------------------------------------------- generation

def test_generate_greedy_equals_generate_io(tiny, tmp_path):
    """Greedy generation (prefill + one token at a time through both caches) = transformers'
    generate() ids of generate.io, exactly. Controls: the prompt without its first id, and the
    model with layer 1's GatedDeltaNet out_proj scaled by 3 (1.05 moves the logits by 1e-3 but
    keeps this random model's greedy ids), give other ids."""
    prompt, want = _gen_io()
    got = tiny.generate(prompt, max_new_tokens=want.shape[1])
    assert got.dtype == np.int64 and got.shape == want.shape
    assert np.array_equal(got, want), (got, want)
    assert not np.array_equal(tiny.generate(prompt[:, 1:], max_new_tokens=want.shape[1]), want)
    with gdncp.Model.from_pretrained(_copy_ckpt(tmp_path, perturb=lambda w: _perturb_layer1(w, 3.0)),
                                     threads=1) as bad:
        assert not np.array_equal(bad.generate(prompt, max_new_tokens=want.shape[1]), want)


def test_generate_with_a_bf16_kv_cache(tiny):
    """cache_dtype="bf16" (the attention layers' KV caches in BF16): greedy ids = generate.io's
    (this model's margins are wider than the rounding), and generate_text's text is the F32
    cache's; a bad dtype is refused before C. (The bitwise check of the BF16 cache against an F32 cache holding the
    rounded keys, and its control, are the C suite attn_decode's.)"""
    prompt, want = _gen_io()
    got = tiny.generate(prompt, max_new_tokens=want.shape[1], cache_dtype="bf16")
    assert np.array_equal(got, want), (got, want)
    text = tiny.generate_text("Hello", max_new_tokens=8, cache_dtype="bf16")
    assert text == tiny.generate_text("Hello", max_new_tokens=8)
    with pytest.raises(ValueError, match="cache_dtype must be"):
        tiny.generate(prompt, max_new_tokens=2, cache_dtype="fp8")
    with pytest.raises(ValueError, match="cache_dtype must be"):
        tiny.generate_text("Hi", max_new_tokens=2, cache_dtype="bfloat16")


def test_generate_with_a_bf16_prefill(tiny, monkeypatch):
    """compute="bf16" (the prompt's products on bf16 operands; gdn_model_decoder_set_compute):
    greedy ids = generate.io's (the C suite model_hybrid checks the logits within 3e-2 of
    transformers'); control: the decoder left in fp32 when bf16 is asked (the call dropped) is
    observed as the compute passed, and a bad compute is refused before C."""
    prompt, want = _gen_io()
    got = tiny.generate(prompt, max_new_tokens=want.shape[1], compute="bf16")
    assert np.array_equal(got, want), (got, want)
    assert not np.array_equal(tiny.generate(prompt[:, 1:], max_new_tokens=want.shape[1], compute="bf16"), want)
    real, seen = L.gdn_model_decoder_set_compute, []

    def spy(dec, compute):
        seen.append(compute)
        return real(dec, compute)
    monkeypatch.setattr(L, "gdn_model_decoder_set_compute", spy)
    tiny.generate(prompt, max_new_tokens=2, compute="bf16")
    tiny.generate(prompt, max_new_tokens=2)
    assert seen == [1, 0]
    with pytest.raises(ValueError, match="compute must be"):
        tiny.generate(prompt, max_new_tokens=2, compute="fp16")


def test_prompt_prefilled_in_pieces(tiny, monkeypatch):
    """A prompt longer than one prefill piece (pieces of 5 tokens here: 12 = 5 + 5 + 2) gives the
    same ids; control: the middle piece never fed to the decoder gives other ids."""
    prompt, want = _gen_io()
    monkeypatch.setattr(gdncp.Model, "_PREFILL_PIECE", 5)
    assert np.array_equal(tiny.generate(prompt, max_new_tokens=32), want)
    real = L.gdn_model_prefill_last
    calls = []

    def drop_middle(dec, w, tok, T, logits):
        calls.append(T)
        return real(dec, w, tok, T, logits) if len(calls) != 2 else 0
    monkeypatch.setattr(L, "gdn_model_prefill_last", drop_middle)
    assert not np.array_equal(tiny.generate(prompt, max_new_tokens=32), want)
    assert calls == [5, 5, 2]


def test_generate_equals_transformers_generate(tiny):
    """The same new tokens as transformers' Qwen3_5ForCausalLM.generate(do_sample=False) on a
    batch of two other prompts (torch, fp32); control: the rows' prompts swapped."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, "Qwen3_5ForCausalLM", None)
    if cls is None:
        pytest.skip("this transformers has no Qwen3_5ForCausalLM")
    hf = cls.from_pretrained(TINY, torch_dtype=torch.float32).eval()
    prompts = np.array([list(b"The quick brown fox "), list(b"jumps over the lazy ")], np.int64)
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompts), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                          max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    want = out[:, prompts.shape[1]:].numpy()
    got = tiny.generate(prompts, max_new_tokens=24)
    assert np.array_equal(got, want), (got, want)
    assert not np.array_equal(tiny.generate(prompts[::-1].copy(), max_new_tokens=24), want)


def test_rows_are_independent_and_seeded_per_row(tiny):
    """B = 3: greedy row b = that row alone; sampling, row b = the row alone with seed + b
    (control: the row alone with the batch's seed differs)."""
    rows = np.array([list(b"abcdefgh"), list(b"12345678"), list(b"hgfedcba")])
    g = tiny.generate(rows, max_new_tokens=16)
    for b in range(3):
        assert np.array_equal(g[b], tiny.generate(rows[b:b + 1], max_new_tokens=16)[0])
    kw = dict(max_new_tokens=16, do_sample=True, temperature=1.0)
    s = tiny.generate(rows, seed=11, **kw)
    for b in range(3):
        assert np.array_equal(s[b], tiny.generate(rows[b:b + 1], seed=11 + b, **kw)[0])
    assert not np.array_equal(s[2], tiny.generate(rows[2:3], seed=11, **kw)[0])   # control
    assert not np.array_equal(s, g)                                                # sampled


@pytest.mark.skipif(not CLI or not os.path.exists(CLI or ""), reason="GDNCP_CLI (the gdncp command) not set")
@pytest.mark.parametrize("opts", [dict(temperature=1.0, top_k=0, top_p=1.0),
                                  dict(temperature=0.8, top_k=40, top_p=1.0),
                                  dict(temperature=1.3, top_k=0, top_p=0.9),
                                  dict(temperature=0.7, top_k=100, top_p=0.95)])
def test_sampling_equals_gdncp_sample(tiny, opts):
    """Model.generate(do_sample=True, seed=S, ...) = `gdncp sample --seed S` with the same
    options, token for token (one sampler, gdn_sample_next, in the library); control: seed
    S + 1 differs."""
    prompt, _ = _gen_io()
    ids = ",".join(str(int(i)) for i in prompt[0])

    def cli(seed):
        r = subprocess.run([CLI, "sample", "--ckpt", TINY, "--prompt-ids", ids, "--tokens", "40",
                            "--threads", "1", "--print-ids", "--seed", str(seed),
                            "--temperature", str(opts["temperature"]), "--top-p", str(opts["top_p"])]
                           + (["--top-k", str(opts["top_k"])] if opts["top_k"] else []),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return [int(v) for v in r.stdout.strip().split(",")]
    got = tiny.generate(prompt, max_new_tokens=40, do_sample=True, seed=7, **opts)[0].tolist()
    assert got == cli(7)
    assert got != cli(8)   # control: another seed


def test_top_k_1_and_tiny_top_p_are_greedy(tiny):
    prompt, want = _gen_io()
    n = want.shape[1]
    for kw in (dict(top_k=1), dict(top_p=1e-9)):
        assert np.array_equal(tiny.generate(prompt, max_new_tokens=n, do_sample=True, seed=3, **kw), want)
    assert not np.array_equal(tiny.generate(prompt, max_new_tokens=n, do_sample=True, seed=3), want)


def test_eos_stops_rows(tiny):
    """eos_token_id: a row stops at its first eos and continues with the pad id; the result
    ends once every row has stopped."""
    prompt, want = _gen_io()
    eos = int(want[0, 4])
    assert eos not in want[0, :4].tolist()
    got = tiny.generate(prompt, max_new_tokens=32, eos_token_id=eos)
    assert got.tolist() == [want[0, :5].tolist()]
    two = np.concatenate([prompt, prompt[:, ::-1]])
    other = tiny.generate(two[1:], max_new_tokens=32)[0]
    got2 = tiny.generate(two, max_new_tokens=32, eos_token_id=[eos], pad_token_id=255)
    k = other.tolist().index(eos) + 1 if eos in other.tolist() else 32
    assert got2.shape[1] == max(5, k)
    assert got2[0, :5].tolist() == want[0, :5].tolist() and set(got2[0, 5:].tolist()) <= {255}
    assert tiny.generate(prompt, max_new_tokens=0).shape == (1, 0)


def test_generate_text_bytes(tiny):
    """A byte-level model (vocab 256, no tokenizer.json): the prompt's UTF-8 bytes in, the new
    bytes decoded out; equal to generate() on the bytes. Control: another prompt's text."""
    text = tiny.generate_text("Hello, wor", max_new_tokens=20)
    ids = tiny.generate([list(b"Hello, wor")], max_new_tokens=20)[0]
    assert text == bytes(ids.tolist()).decode("utf-8", errors="replace")
    assert tiny.generate_text("Goodbye, w", max_new_tokens=20) != text
    assert tiny.encode("é") == [0xC3, 0xA9]
    with pytest.raises(ValueError, match="empty"):
        tiny.generate_text("", max_new_tokens=3)


def test_generate_text_stops_at_the_pack_separator(tmp_path, tiny):
    """A checkpoint trained with --pack SEP (trainer_state.json's pack_separator_hex) stops once
    it writes SEP, as `gdncp sample --stop auto` does (same bytes); stop=None runs on (the
    control); a separator of two bytes matches across them."""
    new = tiny.generate([list(b"Hello, wor")], max_new_tokens=20)[0].tolist()
    j = next(i for i in range(2, 20) if new[i] not in new[:i] and (new[i - 1], new[i]) not in
             list(zip(new[:i - 1], new[1:i])))
    full = bytes(new).decode("utf-8", errors="replace")
    for sep in ((new[j],), (new[j - 1], new[j])):
        d = _copy_ckpt(tmp_path, name="pk" + "".join(f"{b:02x}" for b in sep))
        (d / "trainer_state.json").write_text(json.dumps({"pack_separator_hex": bytes(sep).hex()}))
        with gdncp.Model.from_pretrained(d, threads=1) as m:
            assert m.pack_separator() == sep
            text = m.generate_text("Hello, wor", max_new_tokens=20)
            assert text == bytes(new[:j + 1]).decode("utf-8", errors="replace")
            assert m.generate_text("Hello, wor", max_new_tokens=20, stop=None) == full != text
            if CLI and os.path.exists(CLI):
                r = subprocess.run([CLI, "sample", "--ckpt", str(d), "--prompt", "Hello, wor", "--tokens", "20",
                                    "--temperature", "0", "--threads", "1", "--print-ids"],
                                   capture_output=True, text=True, timeout=120)
                assert [int(v) for v in r.stdout.strip().split(",")] == new[:j + 1], r.stderr
    assert tiny.pack_separator() is None
    with pytest.raises(TypeError, match="prompt"):
        tiny.generate_text(b"bytes", max_new_tokens=2)
    with pytest.raises(TypeError, match="unexpected"):
        tiny.generate_text("a", max_new_tokens=2, temprature=1.0)


def test_generate_text_with_a_tokenizer(tmp_path, tiny):
    """tokenizer.json beside the weights: the prompt goes through the Hugging Face tokenizer
    (a word-level one made here: 256 words), and the text is its decode of generate()'s ids;
    control: the byte-level model gives other ids for the same prompt."""
    tokenizers = pytest.importorskip("tokenizers")
    d = _copy_ckpt(tmp_path)
    words = {f"w{i}": i for i in range(255)}
    words["[UNK]"] = 255
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.decoder = None
    tk.save(str(d / "tokenizer.json"))
    with gdncp.Model.from_pretrained(d, threads=1) as m:
        ids = m.encode("w5 w17 w200 w3")
        assert ids == [5, 17, 200, 3]
        new = m.generate([ids], max_new_tokens=12)[0]
        assert m.generate_text("w5 w17 w200 w3", max_new_tokens=12) == tk.decode(new.tolist())
        assert tiny.encode("w5 w17 w200 w3") != ids
    with gdncp.Model.from_pretrained(TINY, threads=1, tokenizer=d / "tokenizer.json") as m:
        assert m.encode("w5 w17") == [5, 17]        # tokenizer= given explicitly
    with gdncp.Model.from_pretrained(TINY, threads=1, tokenizer=tk) as m:
        assert m.decode([5, 17]) == tk.decode([5, 17])
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        gdncp.Model.from_pretrained(TINY, tokenizer=tmp_path / "none")


# ----------------------------------------------------------------------------- bad input

def test_bad_ids_are_refused_before_c(tiny):
    with pytest.raises(ValueError, match=r"input_ids\[0, 2\] = 256 .*vocab 256"):
        tiny.logits([[1, 2, 256]])
    with pytest.raises(ValueError, match=r"= -1 "):
        tiny.generate(np.array([[3, -1]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="2 dimensions"):
        tiny.logits([1, 2, 3])
    with pytest.raises(ValueError, match="2 dimensions"):
        tiny.logits(np.zeros((1, 2, 3), np.int64))
    with pytest.raises(TypeError, match="integer"):
        tiny.logits(np.array([[1.0, 2.0]]))
    with pytest.raises(TypeError, match="integer"):
        tiny.logits([[True, False]])
    with pytest.raises(ValueError):
        tiny.logits([[1, 2], [3]])                    # ragged
    with pytest.raises(ValueError, match="at least one"):
        tiny.logits(np.zeros((1, 0), np.int64))
    with pytest.raises(ValueError, match="eos_token_id"):
        tiny.generate([[1]], max_new_tokens=2, eos_token_id=300)
    # the model still works after every refusal
    prompt, want = _gen_io()
    assert np.array_equal(tiny.generate(prompt, max_new_tokens=want.shape[1]), want)


@pytest.mark.parametrize("kw,name", [(dict(temperature=0), "temperature"),
                                     (dict(temperature=-1.0), "temperature"),
                                     (dict(temperature=float("nan")), "temperature"),
                                     (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"),
                                     (dict(top_p=1.5), "top_p"), (dict(seed=-1), "seed"),
                                     (dict(max_new_tokens=-1), "max_new_tokens")])
def test_sampling_arguments_are_validated(tiny, kw, name):
    kw = dict(dict(max_new_tokens=2, do_sample=True), **kw)
    with pytest.raises(ValueError, match=name):
        tiny.generate([[1, 2]], **kw)


def test_sampling_argument_types(tiny):
    with pytest.raises(TypeError, match="top_k"):
        tiny.generate([[1]], max_new_tokens=2, do_sample=True, top_k=1.5)
    with pytest.raises(TypeError, match="max_new_tokens"):
        tiny.generate([[1]], max_new_tokens="3")
    with pytest.raises(TypeError, match="threads"):
        gdncp.Model.from_pretrained(TINY, threads=None)


def test_c_errors_surface_with_the_c_message(tiny, tmp_path, monkeypatch):
    """What the library refuses comes back as an exception carrying gdn_errmsg()'s text: a batch
    beyond the decoder's limit, a config the loader refuses, and (with Python's own length check
    switched off) a sequence beyond max_position."""
    with pytest.raises(ValueError, match=r"decoder B = 5000 is out of range"):
        tiny.generate(np.ones((5000, 1), np.int64), max_new_tokens=1)
    d = _copy_ckpt(tmp_path, config_edit=lambda c: c.update(num_experts=8), name="moe")
    with pytest.raises(Exception, match="num_experts|expert"):
        gdncp.Model.from_pretrained(d)
    short = _copy_ckpt(tmp_path, config_edit=lambda c: c.update(max_position_embeddings=40), name="short")
    with gdncp.Model.from_pretrained(short, threads=1) as m:
        prompt, want = _gen_io()                     # 12 tokens
        assert np.array_equal(m.generate(prompt, max_new_tokens=28), want[:, :28])
        with pytest.raises(ValueError, match="max_new_tokens = 41 .*max_position_embeddings = 40"):
            m.generate(prompt, max_new_tokens=29)
        with pytest.raises(ValueError, match="max_position"):
            m.logits(np.ones((1, 41), np.int64))
        monkeypatch.setattr(gdncp.Model, "_check_length", lambda self, total, what: None)
        with pytest.raises(ValueError, match=r"gdn.*max_len = 41 is beyond max_position = 40"):
            m.generate(prompt, max_new_tokens=29)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        gdncp.Model.from_pretrained(tmp_path / "nope")
    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(os.path.join(TINY, "config.json"), d / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors is missing"):
        gdncp.Model.from_pretrained(d)
    # not a regular file: said as what it is, never "missing"
    for name, make, what in (("fifo", os.mkfifo, "a FIFO"), ("dir", os.mkdir, "a directory"),
                             ("zero", lambda p: os.symlink("/dev/zero", p), "a character device")):
        k = tmp_path / name
        k.mkdir()
        shutil.copy(os.path.join(TINY, "config.json"), k / "config.json")
        make(k / "model.safetensors")
        with pytest.raises(FileNotFoundError, match=f"model.safetensors is {what}, not a regular file"):
            gdncp.Model.from_pretrained(k)
    (d / "model.safetensors.index.json").write_text("{}")     # a sharded checkpoint's index, empty
    with pytest.raises(gdncp.GdncpError, match="no 'weight_map' object"):
        gdncp.Model.from_pretrained(d)
    e = tmp_path / "empty"
    e.mkdir()
    with pytest.raises(Exception, match="config.json|checkpoint"):
        gdncp.Model.from_pretrained(e)


@pytest.mark.skipif(not CLI or not os.path.exists(CLI or ""), reason="GDNCP_CLI (the gdncp command) not set")
def test_a_gdncp_train_output(tmp_path):
    """A real `gdncp train --out` directory (GatedDeltaNet + attention, packed fortunes, checkpoints
    at steps 2 and 3): the model loads its newest checkpoint and generates what `gdncp sample`
    does on it, greedy (both with the checkpoint's separator as their stop; three steps of
    training rarely write it: test_generate_text_stops_at_the_pack_separator makes it happen) and
    seeded sampling; control: checkpoint 2's sampling differs."""
    text = "/usr/share/games/fortunes/fortunes"
    if not os.path.exists(text):
        pytest.skip(f"{text} is missing (Debian's fortunes package)")
    out = tmp_path / "run"
    cmd = [os.environ.get("GDN_MPIEXEC", "mpiexec.mpich"), "-n", "1", CLI, "train", "--data", text,
           "--hidden", "32", "--layers", "2", "--layer-types", "linear,full",
           "--attn-heads", "2", "--kv-heads", "1", "--head-dim", "16",
           "--intermediate", "64", "--key-heads", "1", "--value-heads", "2", "--key-dim", "16",
           "--value-dim", "16", "--seq", "64", "--steps", "3", "--save-every", "2", "--eval-every", "0",
           "--lr", "3e-3", "--threads", "1", "--pack", "\\n%\\n", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    def sample(ck, *opts):
        r = subprocess.run([CLI, "sample", "--ckpt", str(ck), "--prompt", "The ", "--tokens", "48",
                            "--threads", "1", "--print-ids", *opts], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        return [int(v) for v in r.stdout.strip().split(",")]
    with gdncp.Model.from_pretrained(out, threads=1) as m:
        assert m.path.endswith("checkpoint-00000003") and m.pack_separator() == tuple(b"\n%\n")
        assert m.config.layer_types == ("linear_attention", "full_attention")
        greedy = sample(out, "--temperature", "0")              # --stop auto: ends with the separator
        assert m.generate([list(b"The ")], max_new_tokens=48, stop=m.pack_separator())[0].tolist() == greedy
        assert m.generate_text("The ", max_new_tokens=48) == m.decode(greedy)
        ids = m.generate([list(b"The ")], max_new_tokens=48, do_sample=True, temperature=0.9,
                         top_k=20, seed=4)[0].tolist()
        sampled = sample(out, "--temperature", "0.9", "--top-k", "20", "--seed", "4", "--stop", "none")
        assert ids == sampled
    with gdncp.Model.from_pretrained(out / "checkpoint-00000002", threads=1) as m2:
        assert m2.generate([list(b"The ")], max_new_tokens=48, do_sample=True, temperature=0.9,
                           top_k=20, seed=4)[0].tolist() != sampled


def test_training_output_directory_and_close(tmp_path):
    """A `gdncp train --out` directory loads its newest complete checkpoint-N; close() (or a
    with block) frees the model, and a closed model refuses calls."""
    out = tmp_path / "run"
    out.mkdir()
    for step in (10, 20):
        d = out / f"checkpoint-{step:08d}"
        d.mkdir()
        shutil.copy(os.path.join(TINY, "config.json"), d / "config.json")
        os.symlink(os.path.join(TINY, "model.safetensors"), d / "model.safetensors")
    prompt, want = _gen_io()
    with gdncp.Model.from_pretrained(out, threads=1) as m:
        assert m.path.endswith("checkpoint-00000020")
        assert np.array_equal(m.generate(prompt, max_new_tokens=8), want[:, :8])
    with pytest.raises(RuntimeError, match="closed"):
        m.logits(prompt)
    m.close()   # idempotent


def test_threads_take_turns(tiny):
    """Two Python threads calling one model get what each gets alone (the model's lock)."""
    import threading
    prompt, want = _gen_io()
    ids = read_safetensors(os.path.join(TINY, "logits.io.safetensors"))["input_ids"]
    ref = tiny.logits(ids)
    res = {}

    def gen():
        res["g"] = [tiny.generate(prompt, max_new_tokens=32) for _ in range(3)]

    def lgt():
        res["l"] = [tiny.logits(ids) for _ in range(3)]
    th = [threading.Thread(target=gen), threading.Thread(target=lgt)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert all(np.array_equal(g, want) for g in res["g"])
    assert all(np.array_equal(x, ref) for x in res["l"])


def test_generate_speed(tiny, capsys):
    """Not a pass/fail benchmark: tokens/s of greedy decoding on the tiny model (one thread)."""
    import time
    prompt, _ = _gen_io()
    t = time.perf_counter()
    out = tiny.generate(np.repeat(prompt, 4, axis=0), max_new_tokens=128)
    dt = time.perf_counter() - t
    assert out.shape == (4, 128)
    with capsys.disabled():
        print(f"\n  gdncp.Model.generate: B=4 x 128 new tokens in {dt:.3f} s = "
              f"{4 * 128 / dt:.0f} tokens/s (tiny model, 1 thread, Python loop over the decoder)")


# ----------------------------------------------------------------------------- loss and gradients

def test_loss_and_grads_equal_the_exact_references(tiny):
    """m.loss_and_grads on model_grads.io's two rows of 200 ids: the loss within 1e-5 relative of
    the exact float64 mean cross-entropy over 2 x 199 targets, every parameter's gradient within
    1e-4 (max-abs error / max-abs reference, per tensor) of the exact float64 one, named and
    shaped as state_dict() (= the checkpoint's tensors). m.loss gives the same loss, and
    recompute=True the same loss and gradients. Control through the same checks: row 0's targets
    replaced by row 1's."""
    exact = read_safetensors(os.path.join(TINY, "model_grads.io.safetensors"))
    ids = exact["input_ids"]
    loss, grads = tiny.loss_and_grads(ids)
    ref_loss = float(np.asarray(exact["loss"]).reshape(-1)[0])
    assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5, (loss, ref_loss)
    sd = tiny.state_dict()
    w = read_safetensors(os.path.join(TINY, "model.safetensors"))
    assert set(grads) == set(sd) == set(w)
    worst = max((rel_err(grads[n], exact["grad." + n]), n) for n in grads)
    assert worst[0] < 1e-4, worst
    for n, g in grads.items():
        assert g.shape == sd[n].shape == w[n].shape and g.dtype == np.float32, n
        assert np.array_equal(sd[n], w[n]), n                    # the views are the weights
    assert abs(tiny.loss(ids) - loss) <= 1e-12 * abs(loss)
    loss_r, grads_r = tiny.loss_and_grads(ids, recompute=True)
    assert loss_r == loss and max(rel_err(grads_r[n], grads[n]) for n in grads) < 1e-6

    scrambled = ids.copy()
    scrambled[0, 1:] = ids[1, 1:]                                 # control: other targets
    bad_loss, bad_grads = tiny.loss_and_grads(scrambled)
    assert abs(bad_loss - ref_loss) / abs(ref_loss) > 1e-3
    assert min(rel_err(bad_grads[n], exact["grad." + n]) for n in grads) > 1e-4
    print(f"loss vs exact {abs(loss - ref_loss) / abs(ref_loss):.1e}; worst gradient {worst[0]:.1e} "
          f"({worst[1]})")


def test_loss_and_grads_equal_transformers_autograd(tiny, tmp_path):
    """The same step as transformers' own: Qwen3_5ForCausalLM (fp32, eager) on the shared
    checkpoint, loss = model(ids, labels=ids).loss, loss.backward(): loss within 1e-5, every
    .grad within 1e-4 of gdncp's (A_log and dt_bias within 2e-3: sums over the 128 tokens
    that cancel to a few % of their terms, where transformers' fp32 arithmetic is off by up to
    4e-4 here; gdncp's are within 1e-4 of the exact ones, the test above); under compute="bf16" within BF16's accuracy (loss 1e-3,
    gradients 5e-2; A_log and dt_bias, whose cancelling sums BF16 products shift by several %,
    0.5) and not equal to the fp32 ones (the bf16 products ran). Control: a model with
    layer 1's out_proj scaled by 1.05 against transformers' unscaled gradients."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(TINY, torch_dtype=torch.float32,
                                              attn_implementation="eager")
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 256, size=(2, 65))
    t = torch.tensor(ids)
    out = hf(input_ids=t, labels=t, use_cache=False)
    out.loss.backward()
    want = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    loss, grads = tiny.loss_and_grads(ids)
    assert abs(loss - out.loss.item()) / out.loss.item() < 1e-5
    assert set(grads) == set(want)
    errs = {n: rel_err(grads[n], want[n]) for n in grads}
    gates = {n for n in errs if n.endswith(("A_log", "dt_bias"))}
    worst = max(e for n, e in errs.items() if n not in gates)
    worst_gate = max(errs[n] for n in gates)
    assert worst < 1e-4, errs
    assert worst_gate < 2e-3, errs
    lb, gb = tiny.loss_and_grads(ids, compute="bf16")
    assert abs(lb - loss) / loss < 1e-3
    errs_bf = {n: rel_err(gb[n], want[n]) for n in grads}
    worst_bf = max(e for n, e in errs_bf.items() if n not in gates)
    assert 1e-5 < worst_bf < 5e-2, errs_bf
    assert max(errs_bf[n] for n in gates) < 0.5, errs_bf   # measured 5.5e-2 (design.md, BF16)
    with gdncp.Model.from_pretrained(_copy_ckpt(tmp_path, perturb=_perturb_layer1), threads=1) as bad:
        _, gbad = bad.loss_and_grads(ids)
        assert max(rel_err(gbad[n], want[n]) for n in grads) > 1e-3   # control
    print(f"vs transformers' autograd: loss {abs(loss - out.loss.item()) / out.loss.item():.1e}, "
          f"worst gradient {worst:.1e} (A_log / dt_bias {worst_gate:.1e}); bf16 {worst_bf:.1e}")


def test_loss_refuses_bad_input(tiny):
    with pytest.raises(ValueError, match="at least 2"):
        tiny.loss([[5]])
    with pytest.raises(ValueError, match="not a token id"):
        tiny.loss([[1, 256]])
    with pytest.raises(ValueError, match="compute must be"):
        tiny.loss([[1, 2]], compute="fp16")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        tiny.loss_and_grads([1, 2, 3])


# ----------------------------------------------------------------------------- gradient buffer, AdamW

def test_loss_and_grads_out_is_overwritten_with_each_calls_gradient(tiny):
    """loss_and_grads(out=buf): the gradient written into the caller's buffer (every returned
    array a view of it, nothing parameter-sized allocated), overwriting what it held: with buf
    full of stale values the result is still the exact float64 gradient (1e-4) and the fresh
    call's (out=None); a second call with other ids makes the same views that call's fresh
    gradient. Controls through the same checks: the first call's values (a stale buffer, as if
    the second call had not written) against the second fresh gradient, and the second call's
    result against the first call's exact gradient, both rejected."""
    exact = read_safetensors(os.path.join(TINY, "model_grads.io.safetensors"))
    ids = exact["input_ids"]
    other = ids.copy()
    other[0, 1:] = ids[1, 1:]
    buf = tiny.grad_buffer()
    assert buf.dtype == np.float32 and buf.shape == (tiny.grad_size,) and buf.ctypes.data % 64 == 0
    buf[:] = 7.0                                              # stale contents
    loss, g = tiny.loss_and_grads(ids, out=buf)
    assert all(np.shares_memory(a, buf) for a in g.values())
    fresh_loss, fresh = tiny.loss_and_grads(ids)
    assert loss == fresh_loss and not any(np.shares_memory(a, buf) for a in fresh.values())

    def same(x, y):   # the check every comparison below goes through
        return max(rel_err(x[n], y[n]) for n in y) <= 1e-6
    assert same(g, fresh)
    assert max(rel_err(g[n], exact["grad." + n]) for n in g) < 1e-4
    first = {n: a.copy() for n, a in g.items()}
    loss2, g2 = tiny.loss_and_grads(other, out=buf)
    _, fresh2 = tiny.loss_and_grads(other)
    assert loss2 != loss and all(np.shares_memory(a, buf) for a in g2.values())
    assert same(g2, fresh2) and same(g, fresh2)               # the old views show the new gradient
    assert not same(first, fresh2)                            # control: a stale buffer is rejected
    assert max(rel_err(g2[n], exact["grad." + n]) for n in g2) > 1e-4   # control: other ids


def test_loss_and_grads_out_refuses_what_is_not_a_gradient_buffer(tiny):
    n = tiny.grad_size
    ids = [[1, 2, 3, 4]]
    with pytest.raises(TypeError, match="grad_buffer"):
        tiny.loss_and_grads(ids, out=[0.0] * n)
    with pytest.raises(ValueError, match="grad_size"):
        tiny.loss_and_grads(ids, out=np.zeros(n - 1, np.float32))
    with pytest.raises(ValueError, match="grad_size"):
        tiny.loss_and_grads(ids, out=np.zeros(n, np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        tiny.loss_and_grads(ids, out=np.zeros(2 * n, np.float32)[::2])
    w = next(iter(tiny.state_dict().values())).base           # the weights themselves
    assert w is not None and w.size >= n
    with pytest.raises(ValueError, match="overlaps the model's weights"):
        tiny.loss_and_grads(ids, out=tiny._w)
    ok = tiny.grad_buffer()
    tiny.loss_and_grads(ids, out=ok)                          # control: a right buffer is taken


def _decay_flags(m):
    c = ctypes.byref(m._cfg)
    out = {}
    for i in range(L.gdn_model_tensor_count(c)):
        info = L.ModelTensorInfo()
        L.gdn_model_tensor(c, i, ctypes.byref(info))
        out[info.name.decode()] = bool(info.decay)
    return out


def _adamw_reference(sd, grads, state, t, lr, b1, b2, eps, wd, decay, scale=1.0, bias_correction=True):
    """torch.optim.AdamW's update in float64 on {name: array}, in place of sd."""
    for n, g in grads.items():
        g = g.astype(np.float64) * scale
        m, v = state.setdefault(n, (np.zeros(g.shape), np.zeros(g.shape)))
        m[...] = b1 * m + (1 - b1) * g
        v[...] = b2 * v + (1 - b2) * g * g
        c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if bias_correction else (1.0, 1.0)
        w = sd[n].astype(np.float64) * (1 - lr * wd if decay[n] else 1.0)
        sd[n][...] = w - lr * (m / c1) / (np.sqrt(v / c2) + eps)


def test_adamw_step_is_loss_and_grads_then_torchs_adamw():
    """model.adamw().step(ids): the loss and gradient of loss_and_grads at the current weights,
    then torch.optim.AdamW's update (decoupled decay on the decayed tensors only, bias-corrected
    moments, clipping by the global norm): three steps (the third clipped) against a float64
    reference driven by loss_and_grads on a second model from the same checkpoint; every
    weight within 1e-5 of it (max-abs / max-abs per tensor), the losses equal, grad_norm the
    float64 norm. Control: the reference without bias correction fails the same weight check."""
    ids = np.random.default_rng(11).integers(0, 256, size=(2, 33))
    lr, b1, b2, eps, wd = 3e-3, 0.9, 0.95, 1e-8, 0.1
    with gdncp.Model.from_pretrained(TINY, threads=1) as m, \
            gdncp.Model.from_pretrained(TINY, threads=1) as ref, \
            gdncp.Model.from_pretrained(TINY, threads=1) as ctl:
        decay = _decay_flags(m)
        assert any(decay.values()) and not all(decay.values())
        opt = m.adamw(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        state, state_c = {}, {}
        sd, sd_ref, sd_ctl = m.state_dict(), ref.state_dict(), ctl.state_dict()
        for t in (1, 2, 3):
            if t == 3:
                opt.clip = 0.5 * opt.grad_norm                 # the third step clipped
            loss = opt.step(ids)
            loss_ref, g = ref.loss_and_grads(ids)
            assert loss == loss_ref or t > 1 and abs(loss - loss_ref) < 1e-6 * loss_ref
            norm = float(np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in g.values())))
            assert abs(opt.grad_norm - norm) <= 1e-5 * norm, (opt.grad_norm, norm)
            scale = opt.clip / norm if opt.clip and norm > opt.clip else 1.0
            assert (scale < 1) == (t == 3)
            _adamw_reference(sd_ref, g, state, t, lr, b1, b2, eps, wd, decay, scale)
            _, gc = ctl.loss_and_grads(ids)
            _adamw_reference(sd_ctl, gc, state_c, t, lr, b1, b2, eps, wd, decay, scale, bias_correction=False)
        assert opt.steps == 3

        def close(x, y):
            return max(rel_err(x[n], y[n]) for n in y) < 1e-5
        assert close(sd, sd_ref)
        assert not close(sd, sd_ctl)                           # control: no bias correction
        assert not close(sd, gdncp.Model.from_pretrained(TINY, threads=1).state_dict())   # it moved
        assert set(opt.grads) == set(sd) and all(np.shares_memory(a, opt.grad) for a in opt.grads.values())


def test_adamw_refuses_bad_settings_and_a_diverged_step(tiny):
    with pytest.raises(ValueError, match="betas"):
        tiny.adamw(betas=0.9)
    with pytest.raises(ValueError, match="lr"):
        tiny.adamw(lr=float("nan"))
    with pytest.raises(TypeError):
        gdncp.model.AdamW(object())
    with gdncp.Model.from_pretrained(TINY, threads=1) as m:
        sd = m.state_dict()
        name = next(n for n in sd if n.endswith("embed_tokens.weight"))
        sd[name][3, 0] = np.inf                                # a non-finite weight: the loss diverges
        before = {n: a.copy() for n, a in sd.items()}
        opt = m.adamw()
        with pytest.raises((FloatingPointError, ValueError)):
            opt.step([[3, 4, 5]])
        assert opt.steps == 0
        assert all(np.array_equal(sd[n], before[n]) for n in sd)   # nothing applied
        sd[name][3, 0] = 0.0
        opt.step([[3, 4, 5]])                                   # control: a finite step applies
        assert opt.steps == 1 and not all(np.array_equal(sd[n], before[n]) for n in sd if n != name)
