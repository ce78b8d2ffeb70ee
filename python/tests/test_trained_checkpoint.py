"""A checkpoint written by `gdncp train` loads into transformers' Qwen3_5ForCausalLM and gives
the same logits and loss as gdncp's own model on the same bytes.

gdncp's side is the trainer's model itself (include/gdncp/train.h: gdn_model_logits, gdn_model_forward),
called through ctypes from the same libgdncp.so with the checkpoint's model.safetensors read into
its flat parameter array by the trainer's tensor table. Those functions are not in the public
header: the declarations below mirror include/gdncp/train.h and are for this test only. Tolerance:
1e-4 relative (max-abs error / max-abs reference) for the logits, 1e-5 for the mean loss. Negative
control: the two layers' GatedDeltaNet weights swapped in transformers' model."""
import ctypes
import os
import subprocess

import numpy as np
import pytest
import torch

from gdncp import _lib
from conftest import read_safetensors, rel_err

TEXT = "/usr/share/games/fortunes/fortunes"
CLI = os.environ.get("GDNCP_CLI")
MPIEXEC = os.environ.get("GDN_MPIEXEC", "mpiexec.mpich")
T = 64


ModelConfig = _lib.ModelConfig             # gdn_model_config, gdn_model_run: the package's mirrors
ModelRun = _lib.ModelRun


TensorInfo = _lib.ModelTensorInfo         # gdn_model_tensor_info


def _c_model(cfg, weights, tokens):
    """(logits [T, 256], mean loss over T targets) of gdncp's trainer model."""
    lib = _lib.lib
    lib.gdn_model_tensor_count.argtypes = [_lib.P_mcfg]
    lib.gdn_model_tensor.argtypes = [_lib.P_mcfg, ctypes.c_int, ctypes.POINTER(TensorInfo)]
    P_token = _lib.P_token                    # const gdn_token * (int32 ids)
    lib.gdn_model_forward.argtypes = [ctypes.c_void_p, _lib.P_float, P_token, ctypes.c_double,
                                      ctypes.POINTER(ctypes.c_double), ctypes.c_int]
    _lib.check(lib.gdn_model_config_check(ctypes.byref(cfg)), "gdn_model_config_check")
    w = np.zeros(lib.gdn_model_param_floats(ctypes.byref(cfg)), np.float32)
    seen = set()
    for i in range(lib.gdn_model_tensor_count(ctypes.byref(cfg))):
        info = TensorInfo()
        _lib.check(lib.gdn_model_tensor(ctypes.byref(cfg), i, ctypes.byref(info)), "tensor")
        name = info.name.decode()
        a = weights[name]
        assert a.shape == tuple(info.shape[:info.ndim]), (name, a.shape)
        w[info.offset:info.offset + info.numel] = a.astype(np.float32).ravel()
        seen.add(name)
    assert seen == set(weights), set(weights) ^ seen   # every checkpoint tensor is the model's
    plan = ctypes.c_void_p()
    run = ModelRun(1, T, 1, 0, 1)
    _lib.check(lib.gdn_model_plan_create(ctypes.byref(plan), ctypes.byref(cfg), ctypes.byref(run),
                                         None), "gdn_model_plan_create")
    ids = np.frombuffer(bytes(tokens), np.uint8).astype(np.int32)
    tok = lambda n: ids[:n].ctypes.data_as(P_token)  # noqa: E731
    try:
        logits = np.empty((T, 256), np.float32)
        _lib.check(lib.gdn_model_logits(plan, _lib.f32p(w), tok(T), _lib.f32p(logits)),
                   "gdn_model_logits")
        loss = ctypes.c_double()
        _lib.check(lib.gdn_model_forward(plan, _lib.f32p(w), tok(T + 1), float(T),
                                         ctypes.byref(loss), 0), "gdn_model_forward")
    finally:
        lib.gdn_model_plan_destroy(plan)
    return logits, loss.value / T   # loss_sum is the sum over the T targets


def _train(out, steps, *extra):
    """`gdncp train` of the tests' small model on the fortunes for `steps` steps into out;
    returns out/checkpoint-<steps>."""
    if not CLI or not os.access(CLI, os.X_OK):
        pytest.fail("GDNCP_CLI must name the built gdncp command (scripts/test_python.sh sets it)")
    assert os.path.exists(TEXT), f"{TEXT} is missing (Debian's fortunes package: scripts/deps.sh)"
    cmd = [MPIEXEC, "-n", "1", CLI, "train", "--data", TEXT, "--hidden", "32", "--layers", "2",
           "--intermediate", "64", "--key-heads", "1", "--value-heads", "2", "--key-dim", "16",
           "--value-dim", "16", "--seq", str(T), "--steps", str(steps), "--eval-every", "0",
           "--threads", "1", "--out", str(out), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    ck = out / f"checkpoint-{steps:08d}"
    assert (ck / "config.json").exists() and (ck / "model.safetensors").exists(), os.listdir(out)
    return ck


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("train"), 3)


def test_bf16_checkpoint_loads_into_transformers_and_resumes_exactly(tmp_path):
    """`gdncp train --save-dtype bf16`: model.safetensors holds BF16 tensors (config.json dtype
    bfloat16), which transformers loads and on which its loss and logits equal gdncp.Model's
    within 1e-5;
    resuming that checkpoint for a 4th step gives fp32 master weights bit-identical to an
    uninterrupted 4-step run saved in F32. Controls: the BF16 tensors are not the fp32 weights
    (the rounding happened), and gdncp's logits on the fp32 master weights of the same save are
    not transformers' on the BF16 file (so that check sees the rounding)."""
    import json
    import gdncp
    from transformers import Qwen3_5ForCausalLM
    full = _train(tmp_path / "full", 4)
    half = _train(tmp_path / "half", 3, "--save-dtype", "bf16")
    assert json.load(open(half / "config.json"))["dtype"] == "bfloat16"
    with open(half / "model.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}

    with open(TEXT, "rb") as f:
        ids = np.frombuffer(f.read(T + 1), np.uint8).astype(np.int64)[None]
    with gdncp.Model.from_pretrained(half, threads=1) as m:
        ours, our_logits = m.loss(ids), m.logits(ids)
    hf = Qwen3_5ForCausalLM.from_pretrained(str(half), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids), labels=torch.tensor(ids), use_cache=False)
    theirs, their_logits = out.loss.item(), out.logits.numpy()
    assert abs(theirs - ours) / ours < 1e-5, (theirs, ours)
    assert rel_err(our_logits, their_logits) < 1e-5, rel_err(our_logits, their_logits)

    from safetensors.numpy import save_file
    from safetensors.torch import load_file as load_torch
    masters3 = {k[len("master."):]: v for k, v in
                read_safetensors(str(half / "optimizer.safetensors")).items() if k.startswith("master.")}
    fp32 = tmp_path / "masters"
    fp32.mkdir()
    conf = json.load(open(half / "config.json"))
    conf["dtype"] = "float32"
    json.dump(conf, open(fp32 / "config.json", "w"))
    save_file(masters3, str(fp32 / "model.safetensors"))
    with gdncp.Model.from_pretrained(fp32, threads=1) as m:                # control: unrounded
        assert rel_err(m.logits(ids), their_logits) > 1e-4, rel_err(m.logits(ids), their_logits)

    resumed = _train(tmp_path / "resumed", 4, "--resume", str(half), "--save-dtype", "bf16")
    want = read_safetensors(str(full / "model.safetensors"))
    masters = read_safetensors(str(resumed / "optimizer.safetensors"))
    bf = {k: v.float().numpy() for k, v in load_torch(str(resumed / "model.safetensors")).items()}
    for name, a in want.items():
        assert np.array_equal(masters["master." + name], a), name   # bit for bit
    assert sum(not np.array_equal(bf[n], a) for n, a in want.items()) > 0   # control: rounded


def test_trained_checkpoint_loads_into_transformers_with_gdncps_loss(checkpoint):
    import json
    from transformers import Qwen3_5ForCausalLM
    conf = json.load(open(checkpoint / "config.json"))
    cfg = ModelConfig(conf["vocab_size"], conf["hidden_size"], conf["num_hidden_layers"],
                      conf["intermediate_size"], conf["linear_num_key_heads"],
                      conf["linear_num_value_heads"], conf["linear_key_head_dim"],
                      conf["linear_value_head_dim"], conf["linear_conv_kernel_dim"],
                      conf["rms_norm_eps"], int(conf.get("tie_word_embeddings", False)))
    # bytes the trainer never saw in this order: the file's start, as byte tokens
    with open(TEXT, "rb") as f:
        tokens = f.read(T + 1)
    c_logits, c_loss = _c_model(cfg, read_safetensors(str(checkpoint / "model.safetensors")),
                                tokens)

    model = Qwen3_5ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ids = torch.tensor(list(tokens), dtype=torch.long)[None]
    with torch.no_grad():
        out = model(input_ids=ids[:, :T], labels=ids[:, :T], use_cache=False)
        logits = out.logits[0].numpy()
        # transformers' loss shifts inside one window (T-1 targets); gdncp's has T targets
        # (the window plus the next byte): compare the same T targets explicitly
        hf_loss = torch.nn.functional.cross_entropy(out.logits[0], ids[0, 1:T + 1]).item()
    print(f"transformers vs gdncp train's model: logits {rel_err(logits, c_logits):.1e}, "
          f"loss {hf_loss:.8f} vs {c_loss:.8f} (relative {abs(hf_loss - c_loss) / c_loss:.1e})")
    assert rel_err(logits, c_logits) < 1e-4, rel_err(logits, c_logits)
    assert abs(hf_loss - c_loss) / c_loss < 1e-5, (hf_loss, c_loss)

    # control: the two layers' GatedDeltaNet weights swapped
    a, b = model.model.layers[0].linear_attn, model.model.layers[1].linear_attn
    sa, sb = ({k: v.clone() for k, v in m.state_dict().items()} for m in (a, b))
    a.load_state_dict(sb)
    b.load_state_dict(sa)
    with torch.no_grad():
        bad = model(input_ids=ids[:, :T], use_cache=False).logits[0]
        bad_loss = torch.nn.functional.cross_entropy(bad, ids[0, 1:T + 1]).item()
    assert rel_err(bad.numpy(), c_logits) > 1e-2 and abs(bad_loss - c_loss) / c_loss > 1e-5


def test_trained_moe_checkpoint_loads_into_transformers_with_gdncps_loss(tmp_path):
    """`gdncp train --experts 4` (every MLP a mixture of 4 experts, 2 per token, a shared expert; the
    aux loss on): its checkpoint (config.json qwen3_5_moe_text, the experts fused as transformers
    holds them) loads into transformers' Qwen3_5MoeForCausalLM, whose loss and logits equal
    gdncp.Model's on the same bytes (1e-5), and back into gdncp bit for bit. Control: two experts
    of layer 0 swapped in transformers' model change its logits."""
    import json
    import gdncp
    from transformers import AutoModelForCausalLM
    ck = _train(tmp_path / "moe", 3, "--experts", "4", "--experts-per-tok", "2", "--moe-intermediate", "32",
                "--shared-intermediate", "16", "--router-aux-coef", "0.01")
    conf = json.load(open(ck / "config.json"))
    assert conf["model_type"] == "qwen3_5_moe_text" and conf["num_experts"] == 4 and conf["output_router_logits"]
    with open(TEXT, "rb") as f:
        ids = np.frombuffer(f.read(T + 1), np.uint8).astype(np.int64)[None]
    with gdncp.Model.from_pretrained(ck, threads=1) as m:
        ours, our_logits = m.loss(ids), m.logits(ids)
    hf = AutoModelForCausalLM.from_pretrained(str(ck), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM"
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids), labels=torch.tensor(ids), use_cache=False)
    assert abs(out.loss.item() - ours) / ours < 1e-5, (out.loss.item(), ours)
    assert rel_err(our_logits, out.logits.numpy()) < 1e-5, rel_err(our_logits, out.logits.numpy())
    gu = hf.model.layers[0].mlp.experts.gate_up_proj
    with torch.no_grad():
        gu[[0, 1]] = gu[[1, 0]].clone()
        bad = hf(input_ids=torch.tensor(ids), use_cache=False).logits.numpy()
    assert rel_err(bad, out.logits.numpy()) > 1e-4
