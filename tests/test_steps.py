"""``dml_optim.core.steps.StepCounter``: step counts as classes of parameters that step together.

The optimizer tests see the counter through results (``state_dict()`` steps,
``BufferInfo.step_counts``/``step_classes``); these tests pin its contract
directly: classes are contiguous runs with one count and one identity, a
split keeps one device counter per part, ``order()`` puts the active classes
first and leaves one inactive run at the end, equal counts merge.
"""

from __future__ import annotations

import pytest
import torch

import dml_optim
from dml_optim.core.opcount import count_ops
from dml_optim.core.steps import StepClass, StepCounter


def runs(counter: StepCounter):
    return [(c.first, c.stop, c.count) for c in counter.classes]


def test_a_new_counter_is_one_class():
    c = StepCounter(5, count=3)
    assert runs(c) == [(0, 5, 3)] and c.known and c.counts() == [3] * 5 and c.max_count() == 3


def test_set_counts_makes_one_class_per_run_of_equal_counts():
    c = StepCounter(4)
    c.set_counts([2, 2, 5, 2])
    assert runs(c) == [(0, 2, 2), (2, 3, 5), (3, 4, 2)]
    assert c.classes[0].key == c.classes[2].key != c.classes[1].key  # equal counts: equal identities
    assert c.counts() == [2, 2, 5, 2] and c.max_count() == 5
    assert all(k.tensor is None for k in c.classes)
    c.set_counts([])
    assert c.classes == [StepClass(0, 0, 0, ("n", 0))] and c.counts() == [] and c.max_count() == 0


def test_device_counters_are_int64_and_the_truth_once_the_host_forgets():
    c = StepCounter(3)
    c.set_counts([4, 4, 7], device=torch.device("cpu"))
    assert [k.tensor.dtype for k in c.classes] == [torch.int64, torch.int64]
    assert [int(k.tensor) for k in c.classes] == [4, 7]
    c.forget_host_counts()
    assert not c.known and [k.count for k in c.classes] == [None, None]
    assert len({k.key for k in c.classes}) == 2  # new identities, still distinct
    c.classes[1].tensor.add_(1)
    assert c.counts() == [4, 4, 8] and c.max_count() == 8


def test_split_gives_every_run_a_device_counter_of_its_own():
    """Runs left apart (the buffer keeps its order) are updated one at a time, each kernel advancing its
    run's counter: two runs sharing one counter would advance it twice in one step."""
    c = StepCounter(4, count=2)
    c.ensure_tensors(torch.device("cpu"))
    c.split([True, False, False, True])
    assert [(k.first, k.stop, k.active) for k in c.classes] == [(0, 1, True), (1, 3, False), (3, 4, True)]
    first, inactive, last = (k.tensor for k in c.classes)
    assert len({id(first), id(inactive), id(last)}) == 3
    first.add_(1)
    assert int(inactive) == 2 and int(last) == 2
    c.split(None)
    assert all(k.active for k in c.classes)


def test_advance_counts_on_the_host_and_merges_equal_counts():
    c = StepCounter(3)
    c.set_counts([1, 2, 2])
    c.split([True, False, False])
    c.advance(gated=False)
    assert runs(c) == [(0, 1, 2), (1, 3, 2)]  # equal counts, but one stepped and one did not
    assert c.classes[0].key == c.classes[1].key
    c.split(None)
    c.advance(gated=False)
    assert runs(c) == [(0, 3, 3)]  # stepped together: one class again
    c.set_counts([2, 2, 2])
    c.split([False, True, True])
    c.advance(gated=True)  # the device decided: the host keeps who stepped together, not the count
    assert [(k.first, k.stop, k.count) for k in c.classes] == [(0, 1, 2), (1, 3, None)]
    assert not c.known


def test_order_puts_active_classes_first_and_one_inactive_run_last():
    c = StepCounter(6)
    c.set_counts([1, 2, 1, 3, 2, 1])
    c.split([True, True, True, False, True, False])
    order = c.order()
    assert order == [0, 2, 1, 4, 3, 5]  # count 1 (active), count 2 (active), then the inactive ones
    c.permute(order)
    assert [(k.first, k.stop, k.count, k.active) for k in c.classes] == [
        (0, 2, 1, True), (2, 4, 2, True), (4, 5, 3, False), (5, 6, 1, False)]
    assert c.order() is None  # contiguous, one inactive run: nothing to re-pack


def test_order_is_none_when_classes_are_already_contiguous():
    c = StepCounter(4)
    c.set_counts([1, 1, 2, 2])
    assert c.order() is None
    c.split([True, True, False, False])
    assert c.order() is None
    c.split([False, True, False, True])  # two inactive runs: re-packed, inactive last
    assert c.order() == [1, 3, 0, 2]


def test_a_loaded_counter_merges_with_host_steps():
    """Counts loaded by ``load_state_dict`` and counts reached by stepping are the same identities:
    parameters that reach equal counts step as one class (the rule runs once per distinct count)."""
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    opt = dml_optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones(3)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["step"], sd["state"][1]["step"] = 2, 3
    opt.load_state_dict(sd)
    (info,) = opt.flat_buffers()
    assert info.step_counts == (2, 3) and info.step_classes == 2
    params[1].grad = None
    opt.step()  # only the first: 3 and 3
    assert opt.flat_buffers()[0].step_counts == (3, 3)
    params[1].grad = torch.ones(3)  # a new gradient: gathered into the flat buffer (one copy)
    ops = count_ops(opt.step)  # both, as one class: the rule runs once
    same = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]  # one class all along
    one = dml_optim.Adam(same, lr=0.1)
    for p in same:
        p.grad = torch.ones(3)
    one.step()
    same[1].grad = torch.ones(3)
    assert ops == count_ops(one.step)
    assert opt.flat_buffers()[0].step_classes == 1


def _interleaved_counts(skip_first: bool, backend: str, twin: dict):
    """Three parameters stepped so that their counts end up interleaved in buffer order, ours and torch's
    Adam (``twin``: its implementation keywords) side by side; returns both optimizers and parameters."""
    init = [torch.full((2,), float(i + 1)) for i in range(3)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = dml_optim.Adam(ours, lr=0.1, epsilon=0.0, backend=backend)
    topt = torch.optim.Adam(ref, lr=0.1, eps=0.0, **twin)
    schedule = [(0, 1, 2), (1,), (0, 1, 2)] if not skip_first else [(1,), (0, 1, 2), (0, 1, 2)]
    for k, active in enumerate(schedule):
        for i, (p, q) in enumerate(zip(ours, ref)):
            g = torch.full((2,), 0.5 * (k + 1) * (i + 1)) if i in active else None
            p.grad, q.grad = (None, None) if g is None else (g.clone(), g.clone())
        opt.step()
        topt.step()
    return opt, topt, ours, ref


@pytest.mark.parametrize("skip_first", [False, True])
def test_interleaved_counts_are_repacked_into_one_class_per_count(skip_first):
    """Counts (1, 2, 1) in buffer order: the next full step re-packs the buffer so that each count is
    one contiguous class (two classes, not three), with the same result as torch.optim.Adam.  The eager
    backend (and the compiled one) re-pack; the fused backend does not (the next test)."""
    opt, _, ours, ref = _interleaved_counts(skip_first, "eager", dict(foreach=False))
    (info,) = opt.flat_buffers()
    assert info.backend == "eager"
    assert info.step_classes == 2 and len(set(info.step_counts)) == 2  # one contiguous run per count
    assert info.param_indices != (0, 1, 2) and sorted(info.param_indices) == [0, 1, 2]  # re-packed
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach())


@pytest.mark.skipif(not hasattr(torch, "_fused_adam_"),
                    reason=f"torch {torch.__version__} has no fused CPU Adam kernel (torch >= 2.4): no fused backend")
@pytest.mark.parametrize("skip_first", [False, True])
def test_interleaved_counts_are_stepped_in_place_by_the_fused_backend(skip_first):
    """The fused backend never re-packs for a new ``None`` pattern: the buffer keeps its order, one class per
    run (three), each run a range of the flat buffer in one kernel call with a step count per range; and the
    result is torch.optim.Adam(fused=True)'s, bit for bit: the same kernel with the same keywords (epsilon 0:
    0 / sqrt(1 - beta2**T) is torch's eps 0), and every element in the kernel's scalar loop in both (a run is
    2 elements, the buffer 6: below the vector width of torch's float32 kernels)."""
    opt, topt, ours, ref = _interleaved_counts(skip_first, "fused", dict(fused=True))
    (info,) = opt.flat_buffers()
    assert info.backend == "fused"
    assert info.param_indices == (0, 1, 2)  # the order the parameters were given: no re-pack
    assert info.step_counts == (2, 3, 2) and info.step_classes == 3
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    ours_state, ref_state = opt.state_dict()["state"], topt.state_dict()["state"]
    for k, entry in ref_state.items():
        for name, value in entry.items():
            if name == "step":
                assert float(ours_state[k][name]) == float(value)
            else:
                torch.testing.assert_close(ours_state[k][name], value, rtol=0, atol=0)


def test_per_parameter_counts_give_the_classes_a_split_would():
    """Under changing patterns the counts are kept per parameter (one assignment a split, one pass an
    advance); read as classes they are the maximal runs of equal count and activity, with the counts a
    plain tally gives, through splits, advances, all-active steps and reads at any point."""
    gen = torch.Generator().manual_seed(3)
    n = 9
    c = StepCounter(n)
    tally = [0] * n
    for step in range(40):
        active = None if step % 7 == 3 else [bool(b) for b in torch.rand(n, generator=gen).lt(0.6).tolist()]
        c.split(active)
        flags = [True] * n if active is None else active
        if step % 3 == 0:  # read as classes mid-way (converts the per-parameter form back)
            expected, first = [], 0
            for i in range(1, n + 1):
                if i == n or (tally[i], flags[i]) != (tally[first], flags[first]):
                    expected.append((first, i, tally[first], flags[first]))
                    first = i
            assert [(k.first, k.stop, k.count, k.active) for k in c.classes] == expected, step
        runs, counts = c.active_runs()
        assert [i for a, b in runs for i in range(a, b)] == [i for i in range(n) if flags[i]]
        assert all(tally[i] == k for (a, b), k in zip(runs, counts) for i in range(a, b))
        assert c.active_params() == ([i for i in range(n) if flags[i]], [tally[i] for i in range(n) if flags[i]])
        assert c.inactive() == [i for i in range(n) if not flags[i]]
        c.advance(gated=False)
        tally = [t + f for t, f in zip(tally, flags)]
        assert c.counts() == tally and c.known and c.max_count() == max(tally)
