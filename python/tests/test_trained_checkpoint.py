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


class TensorInfo(ctypes.Structure):        # gdn_model_tensor_info
    _fields_ = [("name", ctypes.c_char * 96), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_int64 * 3), ("offset", ctypes.c_size_t),
                ("numel", ctypes.c_size_t), ("decay", ctypes.c_int)]


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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if not CLI or not os.access(CLI, os.X_OK):
        pytest.fail("GDNCP_CLI must name the built gdncp command (scripts/test_python.sh sets it)")
    assert os.path.exists(TEXT), f"{TEXT} is missing (Debian's fortunes package: scripts/deps.sh)"
    out = tmp_path_factory.mktemp("train")
    cmd = [MPIEXEC, "-n", "1", CLI, "train", "--data", TEXT, "--hidden", "32", "--layers", "2",
           "--intermediate", "64", "--key-heads", "1", "--value-heads", "2", "--key-dim", "16",
           "--value-dim", "16", "--seq", str(T), "--steps", "3", "--eval-every", "0",
           "--threads", "1", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    ck = out / "checkpoint-00000003"
    assert (ck / "config.json").exists() and (ck / "model.safetensors").exists(), os.listdir(out)
    return ck


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
