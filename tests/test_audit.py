"""The step audit (issue 4, item 3): ours within budget, torch.optim's fallbacks visible.

Budget, per optimizer, on 100+ parameter tensors of real shapes (the
resnet50 inventory's tensors of at most 2**14 elements: 115 tensors, 1-d and
4-d, kept small so the suite stays fast): after a first step, one ``step()``
dispatches at most 12 aten ops per flat buffer, every one native in the
shipped torch-directml dispatch table, with no host sync and no allocation.
The same audit must flag ``torch.optim.Adam`` (foreach: one ``lerp_.Scalar``
fallback per tensor; fused: ``_fused_adam_``), so it can fail.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import dml_optim
from dml_optim.audit import (
    AuditReport,
    audit_step,
    audit_torch_equivalent,
)
from dml_optim.cli import main
from dml_optim.inventory import models_dir, resolve_model
from dml_optim.optimizers.registry import build, torch_equivalent
from matrix import cases, classes

OPS_PER_FLAT_BUFFER = 12


def _shapes() -> list[tuple[int, ...]]:
    inv = resolve_model("resnet50")
    shapes = [shape for _, shape in inv.parameters if math.prod(shape) <= 2**14]
    assert len(shapes) >= 100
    return shapes


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).mul_(0.02)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def _budget_params():
    """Every variant of the test matrix (tests/matrix.py), with each of its two hyperparameter sets
    (the second has the norm coefficients / weight decay), in float32 on the CPU: the audit
    resolves the recorded aten ops against the DirectML dispatch table, whatever the device."""
    out = []
    for param in cases(variants="all", dtypes=(torch.float32,), devices=("cpu",)):
        c = param.values[0]
        out += [pytest.param(c.name, c.hyper, id=f"{c.variant.id}-first-set"),
                pytest.param(c.name, {**c.hyper, **c.second}, id=f"{c.variant.id}-second-set")]
    return out


def _assert_budget(report: AuditReport) -> None:
    assert report.total_ops <= OPS_PER_FLAT_BUFFER * report.flat_buffers, report.format()
    assert report.all_native, report.non_native()
    assert report.fallbacks == []
    assert report.host_syncs == 0
    assert report.cpu_step_reads == 0
    assert report.allocations == 0, report.format()


@pytest.mark.parametrize("name,hyper", _budget_params())
def test_our_step_is_within_the_budget(name, hyper):
    shapes = _shapes()
    opt = build(name, _params(shapes), backend="eager", **hyper)
    opt.step()  # the first step allocates states and scratch
    report = audit_step(opt)
    assert report.flat_buffers == 1 and report.num_tensors == len(shapes)
    _assert_budget(report)


@pytest.mark.parametrize("name", ["adam", "adamw", "adagrad", "momentum", "sgd", "dml-adam"])
def test_a_masked_step_is_native_and_syncs_nothing(name, monkeypatch):
    """Parameters at several step counts with ``None`` gradients (one masked update, DirectML's path, given
    to the CPU here): every op native in the DirectML table, no fallback, no host sync, and at most the
    op budget of two flat buffers."""
    from dml_optim.backends import eager as engine

    monkeypatch.setattr(engine, "MASKED_DEVICES", (*engine.MASKED_DEVICES, "cpu"))
    shapes = _shapes()
    params = _params(shapes)
    opt = build(name, params, backend="eager")
    grads = [p.grad for p in params]
    for k in range(3):  # every other parameter skips a step: two step counts, and a None pattern
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = g.clone() if (i + k) % 2 or k == 0 else None
        opt.step()
    for i, (p, g) in enumerate(zip(params, grads)):
        p.grad = g.clone() if i % 3 else None
    report = audit_step(opt)
    assert len({c for c, p in zip(opt.flat_buffers()[0].step_counts, params) if p.grad is not None}) >= 2
    assert report.all_native, report.non_native()
    assert report.fallbacks == [] and report.host_syncs == 0 and report.cpu_step_reads == 0
    assert report.total_ops <= 2 * OPS_PER_FLAT_BUFFER * report.flat_buffers, report.format()


@pytest.mark.parametrize("mode", [dict(compute_dtype=torch.float32), dict(compute_dtype=torch.float32,
                                  state_dtype=torch.float32), dict(master_weights=True),
                                  dict(kahan=True, state_dtype=torch.float32)],
                         ids=["fp16-fp32-compute", "fp16-fp32-states", "master-weights", "kahan"])
@pytest.mark.parametrize("case", classes(devices=("cpu",)))
def test_a_chunked_precision_step_allocates_nothing(case, mode):
    """float16 parameters with float32 arithmetic run the rule over bounded chunks through a fixed
    scratch: after the first step, a step allocates nothing and stays native."""
    params = [torch.nn.Parameter(p.detach().half()) for p in _params([(3, 4, 2), (17,), (5, 5)])]
    for p in params:
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(3)).half()
    opt = case.build(params, backend="eager", **case.epsilon_kwargs(1e-4), **mode)
    opt.step()
    report = audit_step(opt)
    assert report.allocations == 0, report.format()
    assert report.all_native and report.host_syncs == 0 and report.fallbacks == []


def test_budget_scales_with_flat_buffers_not_tensors():
    shapes = _shapes()
    params = _params(shapes)
    half = len(params) // 2
    opt = dml_optim.Adagrad([{"params": params[:half]}, {"params": params[half:], "lr": 0.1}], backend="eager")
    opt.step()
    report = audit_step(opt)
    assert report.flat_buffers == 2
    _assert_budget(report)


def test_first_step_allocations_are_counted():
    """The audit sees allocations: the first step creates states and scratch."""
    opt = build("adam", _params([(3, 4), (5,)]), backend="eager")
    report = audit_step(opt)
    assert report.allocations >= 3  # exp_avg, exp_avg_sq, scratch
    assert report.allocated_bytes >= 3 * 17 * 4


def test_torch_adam_foreach_falls_back_once_per_tensor():
    shapes = _shapes()
    report = audit_torch_equivalent("adam", _params(shapes), epsilon=1e-8)
    n = len(shapes)
    assert ("aten::lerp_.Scalar", n) in report.fallbacks
    assert report.fallback_ops == n
    assert not report.all_native
    assert report.total_ops >= 7 * n  # 7 foreach ops over n tensors (torch 2.4 and later)
    # bias corrections read each CPU step counter twice; those are not device syncs
    assert report.cpu_step_reads == 2 * n
    assert report.host_syncs == 0
    assert report.allocations == n  # one _foreach_sqrt result per tensor
    assert report.flat_buffers == n


@pytest.mark.slow  # torch.optim's fused path imports torch._dynamo on first use (seconds on a 2-core VM)
def test_torch_adam_fused_is_a_whole_op_fallback():
    shapes = _shapes()
    report = audit_torch_equivalent("adam", _params(shapes), foreach=False, fused=True)
    assert ("aten::_fused_adam_", 1) in report.fallbacks
    assert report.cpu_step_reads == 0  # fused keeps its step counters on the device


def test_step_counters_created_during_the_audited_step_are_recognised():
    """Auditing torch.optim.Adam's first step: its CPU step counters do not exist before
    the step, yet their reads are still reported apart from host syncs."""
    report = audit_torch_equivalent("adam", _params([(3, 2), (4,), (2, 2, 1, 1)]), warmup=0)
    assert report.cpu_step_reads == 6 and report.host_syncs == 0
    assert report.allocations >= 2 * 3  # exp_avg and exp_avg_sq of each parameter


def test_torch_sgd_and_adagrad_have_no_fallbacks_but_many_ops():
    shapes = _shapes()
    n = len(shapes)
    sgd = audit_torch_equivalent("momentum", _params(shapes), beta=0.9)
    assert sgd.fallbacks == [] and sgd.total_ops == 3 * n  # mul_, add_ (dampened grad), add_ (update)
    ada = audit_torch_equivalent("adagrad", _params(shapes))
    assert ada.fallbacks == [] and ada.total_ops >= 5 * n and ada.cpu_step_reads == n


def test_host_sync_is_detected():
    """``nonfinite="raise"`` checks the gradients with one host read: the audit must count it."""
    params = _params([(4, 4), (3,)])
    opt = dml_optim.Adam(params, nonfinite="raise", backend="eager")
    opt.step()
    report = audit_step(opt)
    assert report.host_syncs >= 1


class _ToyOptimizer(torch.optim.Optimizer):
    """Does known things: one foreach op over its params, one .item(), one clone."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        torch._foreach_mul_(params, 0.5)
        params[0].sum().item()
        self.kept = params[1].clone()


def test_counting_rules_on_a_known_step():
    params = _params([(2, 3), (4,), (5, 1, 1, 1)])
    report = audit_step(_ToyOptimizer(params))
    ops = {op: n for op, n, _ in report.ops}
    assert ops["aten::mul_.Scalar"] == 3  # one foreach op = one op per tensor, as its per-tensor op
    assert ops["aten::sum"] == 1 and ops["aten::clone"] == 1 and ops["aten::_local_scalar_dense"] == 1
    assert report.total_ops == 6
    assert report.host_syncs == 1
    assert report.allocations == 1  # the clone; sum's 0-d result is a CPU scalar, not counted
    assert report.kinds["aten::mul_.Scalar"] == "native"  # composite, resolved through mul_.Tensor


def test_compiled_backend_is_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    opt = dml_optim.Adam([p], backend="compiled")

    if opt.resolved_backends() != [["compiled"]]:
        pytest.skip("torch.compile is unavailable here, so nothing compiles (the refusal cannot trigger)")
    with pytest.raises(ValueError, match="backend='eager'"):
        audit_step(opt)


def test_report_formats_and_serialises():
    opt = build("momentum", _params([(3, 3), (2,)]), backend="eager")
    opt.step()
    report = audit_step(opt)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["total_ops"] == report.total_ops and d["fallback_ops"] == 0 and d["all_native"] is True
    assert {"op", "count", "resolution", "kind"} <= set(d["ops"][0])
    text = report.format()
    assert "dml_optim.Momentum" in text and "CPU step-counter reads" in text and "not a device sync" in text


def test_torch_equivalent_mapping_and_errors():
    p = [torch.nn.Parameter(torch.zeros(2))]
    sgd = torch_equivalent("momentum", p, lr=0.1, alpha=0.8, beta=0.75, norm_coefficient=0.01)
    g = sgd.param_groups[0]
    assert isinstance(sgd, torch.optim.SGD) and g["momentum"] == 0.8 and g["dampening"] == 0.25
    assert g["weight_decay"] == 0.01 and g["foreach"] is True
    adam = torch_equivalent("dml-adam", p, beta1=0.5, beta2=0.6, epsilon=0.0)
    assert adam.param_groups[0]["betas"] == (0.5, 0.6) and adam.param_groups[0]["eps"] == 0.0
    with pytest.raises(ValueError, match="nesterov"):
        torch_equivalent("momentum", p, mode="nesterov", beta=0.9)
    with pytest.raises(ValueError, match="norm_coefficient_post"):
        torch_equivalent("adam", p, norm_coefficient_post=0.1)
    with pytest.raises(TypeError, match="betas"):
        torch_equivalent("adam", p, betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="name"):
        build("sophia", p)
    with pytest.raises(ValueError, match="lion.*no torch.optim twin"):
        torch_equivalent("lion", p)


# --------------------------------------------------------------------------
# dml-optim audit
# --------------------------------------------------------------------------


def test_cli_audit_text(capsys):
    assert main(["audit", "--optimizer", "adam"]) == 0
    out = capsys.readouterr().out
    assert "dml_optim.Adam" in out and "torch.optim.Adam (foreach)" in out
    assert "aten::lerp_.Scalar" in out and "fallback" in out


@pytest.mark.parametrize("model", ["tiny-mlp", str(models_dir() / "tiny-mlp.json")])
def test_cli_audit_json_on_a_model(capsys, model):
    # a built-in name and a path are the same model (issue item 2: `--model resnet50` said "no such file")
    assert main(["audit", "--optimizer", "dml-adam", "--model", model, "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # small model: no progress, and with --json nothing but the JSON
    d = json.loads(captured.out)
    assert d["model"] == "tiny-mlp"
    n = d["tensors"]
    assert d["ours"]["fallback_ops"] == 0 and d["ours"]["host_syncs"] == 0 and d["ours"]["all_native"]
    assert d["ours"]["total_ops"] <= OPS_PER_FLAT_BUFFER
    assert d["torch"]["fallback_ops"] == n and d["torch"]["cpu_step_reads"] == 2 * n


@pytest.mark.parametrize("bits", [8, 4])
def test_cli_audit_of_a_low_bit_step(capsys, tmp_path, bits):
    """``--state-bits``: a quantized step still has no fallback and no sync, and its op count does not depend
    on the number of parameters (one tensor of 64k elements, or 16 of 4,096: each quantized)."""
    many = tmp_path / "sixteen.json"
    many.write_text(json.dumps({"name": "sixteen", "source": "test", "total_parameters": 16 * 4096,
                                "parameters": [{"name": f"w{i}", "shape": [64, 64]} for i in range(16)]}))
    totals = []
    for model in ("one-64k", str(many)):
        assert main(["audit", "--optimizer", "adamw", "--state-bits", str(bits), "--model", model, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["state_bits"] == bits
        ours = d["ours"]
        assert ours["fallback_ops"] == 0 and ours["host_syncs"] == 0 and ours["all_native"], ours
        assert any(r["op"].startswith("aten::index_select") for r in ours["ops"]), ours["ops"]  # decoded: quantized
        totals.append(ours["total_ops"])
    assert totals[0] == totals[1]
    with pytest.raises(SystemExit):
        main(["audit", "--optimizer", "adamw", "--state-bits", "3"])


@pytest.mark.parametrize("argv,message", [
    (["--model", "no/such/model.json"], "--model: no such inventory file 'no/such/model.json'"),
    (["--model", "resnet"], "--model: unknown model 'resnet': give a built-in model (bert-base-uncased, gpt2,"),
    (["--top", "-1"], "--top"),
])
def test_cli_audit_usage_errors(capsys, argv, message):
    assert main(["audit", "--optimizer", "adagrad", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_audit_bad_model_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["audit", "--optimizer", "momentum", "--model", str(bad)]) == 2
    assert "--model" in capsys.readouterr().err


def test_cli_audit_of_a_large_model_prints_the_header_then_progress(capsys):
    # one tensor of 2M elements: above the progress threshold, and quick for momentum
    assert main(["audit", "--optimizer", "momentum", "--model", "one-2m", "--top", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("dml-optim audit: momentum on one-2m (1 tensors, 2,097,152 parameters")
    assert lines[1].startswith("audit: optimizer 1/2 (50%)  dml_optim.Momentum")
    assert lines[2].startswith("audit: optimizer 2/2 (100%)  torch.optim.SGD")


def test_cli_audit_json_progress_goes_to_stderr(capsys):
    assert main(["audit", "--optimizer", "momentum", "--model", "one-2m", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["parameters"] == 2**21
    assert captured.err.splitlines()[0].startswith("dml-optim audit: momentum on one-2m")
    assert "audit: optimizer 2/2 (100%)" in captured.err


def test_cli_audit_lays_the_step_out_as_directml_does(capsys):
    """The command audits DirectML's layout of the step, not the CPU's it records on.

    The bound of the eager scratch (docs/guide/memory.md, "Scratch"): 32 MiB or 0.5 bytes a parameter, whichever is
    larger.  On DirectML a buffer whose full-size scratch would pass it steps in chunks, each chunk the whole op
    chain; the CPU steps it in one call over a full-size scratch (chunks cost it time, and scratch is host memory).
    One tensor of 10,485,760 float32 elements: a full-size AdamW scratch is 40 MiB, over the 32 MiB bound, so the
    command must report a scratch within the bound and the op chain once per chunk, where a plain audit of the same
    step on the CPU reports one call over a full-size scratch."""
    assert main(["audit", "--optimizer", "adamw", "--model", "one-10m", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)["ours"]
    numel = ours["numel"]
    bound = max(32 << 20, numel // 2)
    assert numel == 10 << 20 and 0 < ours["scratch_bytes"] <= bound, ours["scratch_bytes"]
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = build("adamw", [p], backend="eager")
    opt.step()
    cpu = audit_step(opt)  # (recorded as the CPU lays it out: one call)
    assert cpu.scratch_bytes > bound, cpu.scratch_bytes
    assert ours["total_ops"] >= 2 * cpu.total_ops, (ours["total_ops"], cpu.total_ops)
    assert ours["all_native"] and ours["allocations"] == 0


def test_cli_audit_help_names_the_built_in_models(capsys):
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    out = capsys.readouterr().out
    assert "built-in shapes" not in out
    for name in ("resnet50", "gpt2", "bert-base-uncased", "vit-b-16", "tiny-mlp", "many-small"):
        assert name in out
