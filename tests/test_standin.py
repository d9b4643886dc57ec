"""The stand-in DirectML device (dml_optim.standin): its fidelity to torch-directml 0.2.5.

Real behaviour, no mocks: the C++ extension is built (or taken from its cache) and loaded
once for the module.  Every test skips, with the reason ``standin.available()`` gives, when
the stand-in cannot be built here.  Loading it registers the PrivateUse1 backend for the
whole pytest process.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from dml_optim import standin
from dml_optim.dml.dispatch import dispatch_table

PLUGIN_WARNING = ("The operator '{}' is not currently supported on the DML backend and will fall back to run on "
                  "the CPU. This may have performance implications.")
NO_DOUBLE_RE = "^" + re.escape("The GPU device does not support Double (Float64) operations!") + "$"


@pytest.fixture(scope="module", autouse=True)
def dev():
    ok, why = standin.available(load=True)
    if not ok:
        pytest.skip(f"the stand-in DirectML device is unavailable: {why}")
    return standin.device()


@pytest.fixture(autouse=True)
def _fresh_settings():
    """Each test starts from the default settings and zero counts; its configure() is undone."""
    previous = standin.configure(strict=False, float64=True, generator=True)
    standin.reset()
    yield
    standin.configure(**dataclasses.asdict(previous))
    standin.reset()


def _plugin_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "not currently supported on the DML backend" in str(w.message)]


# -- loading ------------------------------------------------------------------------------------


def test_device_and_availability(dev):
    ok, why = standin.available()
    assert ok and why.startswith("loaded")
    assert dev == torch.device("privateuseone:0") and str(dev) == "privateuseone:0"
    x = torch.ones(2, device=dev)
    assert x.device == dev and x.device.type == "privateuseone"
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"
    assert torch.privateuseone.device_count() == 1
    with pytest.raises(RuntimeError, match="one device"):
        torch.ones(1, device="privateuseone:1")


def test_import_registers_nothing_and_cli_builds():
    env = dict(os.environ)
    code = ("import torch, dml_optim.standin as s; "
            "assert not hasattr(torch, 'privateuseone'); "
            "assert not torch._C._dispatch_has_kernel_for_dispatch_key('aten::empty.memory_format', 'PrivateUse1'); "
            "ok, why = s.available(); assert isinstance(ok, bool) and isinstance(why, str)")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    done = subprocess.run([sys.executable, "-m", "dml_optim.standin"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "device: privateuseone:0" in done.stdout
    assert f"cache: {standin.cache_dir()}" in done.stdout


def test_cli_says_why_when_unavailable(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), DML_OPTIM_STANDIN_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "dml_optim.standin"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 1
    assert done.stdout.splitlines() == [f"dml_optim.standin unavailable: no C++ compiler: "
                                        f"'{tmp_path / 'no-such-compiler'}' is not on PATH"]


# -- no storage, views --------------------------------------------------------------------------


def test_tensors_have_no_storage(dev):
    x = torch.arange(6.0).reshape(2, 3).to(dev)
    with pytest.raises(RuntimeError, match="^Cannot access data pointer of Tensor that doesn't have storage"):
        x.data_ptr()
    with pytest.raises(NotImplementedError, match="^Cannot access storage of OpaqueTensorImpl"):
        x.untyped_storage()
    assert torch._C._has_storage(x) is False
    assert x.storage_offset() == 0 and x.stride() == (3, 1) and x.is_contiguous()
    assert not x.t().is_contiguous() and x.t().stride() == (1, 3)
    version = x._version
    x.mul_(2)
    assert x._version == version + 1


def test_views_share_memory(dev):
    base = torch.zeros(4, 5, device=dev)
    row = base[1]
    assert row.storage_offset() == 5
    row.fill_(1.0)
    col = base[:, 2:4]
    assert col.storage_offset() == 2 and col.stride() == (5, 1)
    col.add_(10.0)
    strided = base.as_strided((2,), (7,), 3)
    assert strided.storage_offset() == 3
    strided.fill_(-1.0)
    flat = base.view(20)
    flat[19] = 7.0
    aten = torch.ops.aten
    aten.alias(base)[0, 0] = 3.0
    aten._reshape_alias(base, (5, 4), (4, 1))[4, 3] = 5.0  # element 19: overwrites 7
    aten._unsafe_view(base, (2, 10))[0, 1] = 4.0
    base.t()[4, 0] = 6.0  # a view from torch's composite transpose (as_strided)
    expected = torch.zeros(4, 5)
    expected[1] = 1.0
    expected[:, 2:4] += 10.0
    expected.as_strided((2,), (7,), 3).fill_(-1.0)
    expected.view(20)[19] = 5.0
    expected[0, 0], expected[0, 1], expected[0, 4] = 3.0, 4.0, 6.0
    assert torch.equal(base.cpu(), expected)
    assert row._version == base._version  # views share the version counter
    windows = base.view(20).unfold(0, 2, 2)  # a view made by the CPU fallback (unfold has no composite)
    windows[0, 1] = 8.0
    assert base[0, 1].item() == 8.0 and windows.storage_offset() == 0 and windows.stride() == (2, 1)


def test_in_place_and_out_ops_return_their_argument(dev):
    x = torch.zeros(2, 3, device=dev)
    assert x.add_(1.0) is x and x.t_() is x and x.shape == (3, 2)
    out = torch.empty(0, device=dev)
    assert torch.add(x, x, out=out) is out and out.shape == (3, 2)  # resized by the CPU kernel
    assert torch.equal(out.cpu(), torch.full((3, 2), 2.0))
    values, indices = torch.max(x, 1)  # tuple results
    assert values.device == dev and indices.device == dev and indices.dtype == torch.int64


# -- copies ---------------------------------------------------------------------------------------


def test_copies_both_ways(dev):
    a = torch.randn(3, 4)
    d = a.to(dev)
    assert d.device == dev and torch.equal(d.cpu(), a)
    assert torch.equal(d.to("cpu", torch.float16), a.half())
    e = torch.empty(3, 4, device=dev)
    e.copy_(d)
    e.add_(1.0)
    assert torch.equal(d.cpu(), a) and torch.equal(e.cpu(), a + 1.0)
    assert torch.equal(torch.empty(3, 4).copy_(e), a + 1.0)
    assert torch.equal(d.to(dev, torch.float16).cpu(), a.half())
    m = torch.nn.Linear(4, 2).to(dev)
    assert all(p.device == dev for p in m.parameters())
    assert m(d).device == dev
    assert d[0, 0].item() == a[0, 0].item()
    assert "device='privateuseone:0'" in repr(d)


def test_mixed_devices_refused_for_plugin_kernels(dev):
    x = torch.ones(3, device=dev)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x * torch.ones(3)
    assert torch.equal((x * torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))  # a CPU 0-dim tensor is fine
    assert torch.equal(x[torch.tensor([0, 2])].cpu(), torch.ones(2))  # so are CPU indices
    x[torch.tensor([1], device=dev)] = 5.0  # device indices (index_put_ with a Tensor?[] list)
    assert torch.equal(x[torch.tensor([1, 2], device=dev)].cpu(), torch.tensor([5.0, 1.0]))


# -- the dispatch table ---------------------------------------------------------------------------


def test_fallback_op_counted_and_warned_once(dev):
    x, y = torch.zeros(4, device=dev), torch.ones(4, device=dev)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = torch.lerp(x, y, 0.25)
        x.lerp_(y, 0.5)
        x.lerp_(y, 0.5)
    assert torch.equal(out.cpu(), torch.full((4,), 0.25)) and torch.equal(x.cpu(), torch.full((4,), 0.75))
    counts = standin.fallbacks()
    lerps = {op: n for op, n in counts.items() if op.startswith("aten::lerp")}
    assert sum(lerps.values()) == 3, counts
    table = dispatch_table()
    assert all(table[op].startswith("fallback") for op in lerps)
    warned = _plugin_warnings(record)
    assert len(warned) == 1, warned  # once per op
    assert warned[0].startswith(PLUGIN_WARNING.format("aten::lerp.Scalar_out"))
    assert any(issubclass(w.category, UserWarning) for w in record)
    standin.reset()
    assert standin.fallbacks() == {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        x.lerp_(y, 0.5)
    assert len(_plugin_warnings(record)) == 1  # reset() forgets the warned set
    assert sum(standin.fallbacks().values()) == 1


def test_fallback_op_raises_when_strict(dev):
    x, y = torch.zeros(4, device=dev), torch.ones(4, device=dev)
    with standin.configured(strict=True):
        with pytest.raises(RuntimeError, match=r"strict.*'aten::lerp"):
            x.lerp_(y, 0.5)
        x.mul_(2.0).add_(y)  # native ops still run
    assert torch.equal(x.cpu(), torch.ones(4))
    with pytest.warns(UserWarning, match="aten::lerp"):
        x.lerp_(y, 0.5)  # strict is off again


def test_native_ops_not_counted(dev):
    x, y = torch.rand(8, device=dev), torch.rand(8, device=dev)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        x.mul_(y).add_(y, alpha=0.5).addcmul_(x, y, value=0.1).addcdiv_(x, y + 1.0, value=0.2)
        z = torch.cat([x.sqrt(), x.sign()])
        z.uniform_()
        z.copy_(torch.zeros(16))
    assert standin.fallbacks() == {} and standin.unknown() == {}
    assert _plugin_warnings(record) == []


def test_op_absent_from_the_table_is_unknown(dev, capfd):
    lib = torch.library.Library("dml_optim_standin_test", "DEF")  # an op torch-directml never saw
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CPU")
    twice = torch.ops.dml_optim_standin_test.twice
    x = torch.ones(3, device=dev)
    # inference mode: torch 2.4.1 registers no autograd fallthrough for PrivateUse1 custom ops
    with warnings.catch_warnings(record=True) as record, torch.inference_mode():
        warnings.simplefilter("always")
        assert torch.equal(twice(x).cpu(), torch.full((3,), 2.0)) and twice(x).device == dev
    assert standin.unknown() == {"dml_optim_standin_test::twice": 2} and standin.fallbacks() == {}
    # torch.ops calls warn from C++ without Python's warning handler: on stderr
    warned = [str(w.message) for w in record] + capfd.readouterr().err.splitlines()
    expected = "dml_optim.standin: the operator 'dml_optim_standin_test::twice' is not in the recorded"
    assert sum(expected in line for line in warned) == 1, warned
    assert _plugin_warnings(record) == []
    with standin.configured(strict=True), torch.inference_mode(), pytest.raises(RuntimeError, match="strict.*twice"):
        twice(x)


# -- dtypes ---------------------------------------------------------------------------------------


def test_float64_allowed_by_default(dev):
    x = torch.ones(3, device=dev)
    assert x.double().dtype == torch.float64
    assert torch.zeros(2, dtype=torch.float64, device=dev).device == dev
    assert torch.equal((1.0 - x).cpu(), torch.zeros(3))


def test_float64_refused_without_fp64(dev):
    x = torch.full((3,), 4.0, device=dev)
    with standin.configured(float64=False):
        with pytest.raises(RuntimeError, match=NO_DOUBLE_RE):
            torch.zeros(2, dtype=torch.float64, device=dev)
        with pytest.raises(RuntimeError, match=NO_DOUBLE_RE):
            x.to(dev, torch.float64)
        with pytest.raises(RuntimeError, match=NO_DOUBLE_RE):
            torch.ones(2, dtype=torch.float64).to(dev)
        with pytest.raises(RuntimeError, match=NO_DOUBLE_RE):
            1.0 - x  # rsub: a CPU float64 wrapped number moved to the GPU
        assert torch.equal((1.0 + x).cpu(), torch.full((3,), 5.0))  # add: the scalar is read as a number
        assert torch.equal((x * 0.5 - 1.0).cpu(), torch.full((3,), 1.0))
        assert torch.equal((1 - x).cpu(), torch.full((3,), -3.0))  # an int is int64


def test_bfloat16_always_refused(dev):
    x = torch.ones(2, device=dev)
    for make in (lambda: torch.empty(2, dtype=torch.bfloat16, device=dev),
                 lambda: x.to(torch.bfloat16),
                 lambda: torch.ones(2, dtype=torch.bfloat16).to(dev)):
        with pytest.raises(RuntimeError, match="Invalid or unsupported data type BFloat16.*ends the process"):
            make()


# -- random numbers -------------------------------------------------------------------------------


def test_generator_present_or_refused_like_older_plugins(dev):
    g = torch.Generator(dev)
    assert g.device == dev
    with standin.configured(generator=False):
        with pytest.raises(RuntimeError,
                           match="^Device type PRIVATEUSEONE is not supported for torch.Generator\\(\\) api.$"):
            torch.Generator(dev)
        assert torch.rand(3, device=dev).device == dev  # the default generator still works
    assert torch.Generator("privateuseone").device == dev


@pytest.mark.parametrize("op", ["uniform_", "normal_", "bernoulli_", "random_"])
def test_manual_seed_reproduces_random_ops(dev, op):
    def draw():
        torch.manual_seed(1234)
        return getattr(torch.empty(64, device=dev), op)().cpu()

    a, b = draw(), draw()
    assert torch.equal(a, b)
    torch.manual_seed(1)
    assert not torch.equal(getattr(torch.empty(64, device=dev), op)().cpu(), a)  # another seed, other numbers


def test_device_generator_seed_and_state(dev):
    g = torch.Generator(dev).manual_seed(7)
    assert g.initial_seed() == 7
    state = g.get_state()
    a = torch.randn(16, device=dev, generator=g)
    g.set_state(state)
    b = torch.randn(16, device=dev, generator=g)
    assert torch.equal(a.cpu(), b.cpu())
    g.manual_seed(7)
    assert torch.equal(torch.randn(16, device=dev, generator=g).cpu(), a.cpu())
    torch.manual_seed(0)
    dropped = torch.nn.functional.dropout(torch.ones(64, device=dev), 0.5).cpu()
    torch.manual_seed(0)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64, device=dev), 0.5).cpu(), dropped)


# -- training -------------------------------------------------------------------------------------


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _train(model: torch.nn.Module, device, xs, ys) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=False)
        opt.step()
        losses.append(loss.detach().cpu())
    return losses


def test_adamw_training_matches_cpu_bit_for_bit(dev):
    torch.manual_seed(3)
    cpu_model = _mlp()
    dev_model = copy.deepcopy(cpu_model).to(dev)
    xs, ys = torch.randn(4, 8, 6), torch.randn(4, 8, 3)
    cpu_losses = _train(cpu_model, "cpu", xs, ys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lerp_ falls back (counted below)
        dev_losses = _train(dev_model, dev, xs, ys)
    assert all(torch.equal(a, b) for a, b in zip(cpu_losses, dev_losses))
    for (name, p), q in zip(cpu_model.named_parameters(), dev_model.parameters()):
        assert q.device == dev and torch.equal(p, q.cpu()), name
        assert torch.equal(p.grad, q.grad.cpu()), name
    assert any(op.startswith("aten::lerp") for op in standin.fallbacks())  # AdamW's exp_avg.lerp_


def test_save_load_and_deepcopy_round_trip(dev):
    x = torch.randn(3, 4).to(dev)
    model = torch.nn.Linear(4, 2).to(dev)
    buf = io.BytesIO()
    torch.save({"x": x, "state": model.state_dict()}, buf)
    buf.seek(0)
    # weights_only=False: torch 2.4.1's weights_only unpickler refuses _rebuild_device_tensor_from_numpy,
    # the function torch saves a storage-less PrivateUse1 tensor with (newer torch allows it)
    loaded = torch.load(buf, weights_only=False)
    assert loaded["x"].device == dev and torch.equal(loaded["x"].cpu(), x.cpu())
    assert all(v.device == dev for v in loaded["state"].values())
    clone = copy.deepcopy(x)
    clone.add_(1.0)
    assert clone.device == dev and torch.equal(clone.cpu(), x.cpu() + 1.0)
    twin = copy.deepcopy(model)
    assert torch.equal(twin.weight.cpu(), model.weight.cpu()) and twin.weight.device == dev


def test_set_data_between_devices(dev):
    p = torch.nn.Parameter(torch.zeros(3, device=dev))
    p.data = torch.ones(3, device=dev)
    assert isinstance(p, torch.nn.Parameter) and torch.equal(p.cpu(), torch.ones(3))
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        p.data = torch.ones(3)  # CPU -> device: torch refuses, as with the real plugin
