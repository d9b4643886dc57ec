"""Random training-loop sequences of what happens to parameters and gradients between steps, checked
bit for bit against torch.optim's ``fused=True`` twin.

On the CPU our default backend (``"auto"`` -> ``"fused"``) calls torch's own fused kernels
(``torch._fused_adamw_``, ``_fused_adagrad_``, ``_fused_sgd_``) on views of our flat buffers
(dml_optim/backends/fused.py), so under every re-binding a training loop makes between steps the parameters must
stay *equal* to torch.optim's with ``fused=True`` (``torch.equal``), not merely close.  A hypothesis
``RuleBasedStateMachine`` drives three optimizers over three copies of the same parameters (float32, the
same seeded values):

* ``ours``: a dml_optim optimizer as a user builds it (it repeats a steady step without planning it
  again: the ``repeat`` option), with the binding checks a sequence draws: ``checks="full"`` (the
  default), ``"refs"`` or ``"fast"``;
* ``plain``: the same optimizer that never repeats (``repeat=False``: it plans
  every step from scratch), so a divergence says which of the fast path or the full path is wrong;
* ``torch``: the torch.optim twin with ``fused=True`` (:data:`CONFIGS`; for Momentum one
  ``torch.optim.SGD`` per parameter: :class:`PerParameter` says why).

Rules (each applied identically to the three parameter sets; random gradients are drawn once per rule
and cloned for each set): ``backward`` (autograd's accumulation for a random subset of the trainable
parameters: a fresh ``.grad`` where it is ``None``, else ``.grad.add_`` into whatever tensor ``.grad`` is,
for ours often a view of our flat gradient buffer), ``step``, ``iteration`` (``backward`` then ``step``),
``zero_grad`` (both modes; torch's semantics: ``set_to_none=False`` keeps ``None`` gradients ``None``),
``model_zero_grad`` (every ``.grad = None``, what ``model.zero_grad()`` does), ``drop_grad`` (one ``.grad =
None``: a parameter unused this iteration), ``replace_grad`` (``.grad = a new tensor`` for one parameter,
frozen or not; for ours sometimes a non-contiguous one), ``freeze`` / ``unfreeze`` (``requires_grad_``;
freezing also drops the gradient; frozen parameters get nothing from ``backward``), ``edit_param`` (an
in-place write into a parameter), ``rebind_param`` (``p.data = a copy``), ``clip`` (ours:
``dml_optim.clip_grad_norm_(opt, max_norm)``, torch: ``torch.nn.utils.clip_grad_norm_(params,
max_norm)``), ``set_lr`` (a scheduler's write into every group) and ``checkpoint`` (``state_dict()``, and
with ``reload``, ``load_state_dict(copy.deepcopy(state_dict))``) and, under ``checks="full"``,
``hold_and_rebind`` (references to the old gradients or weights kept while a parameter is re-bound:
``"refs"`` and ``"fast"`` are documented blind to that, README ``checks``).  Up to two parameters may be
frozen before the optimizers are built (ours then leaves them unpacked until they are unfrozen: a
re-pack); under ``"fast"`` none of those is given a gradient while still frozen (``"fast"`` does not look
for one: ``LayoutMixin._unfrozen``, where torch.optim steps every parameter with a gradient).

Invariants: after every rule the parameters and the gradients (``None`` or values) of the three sets
agree; after every step the per-parameter states agree too (``opt.state[p]``, which reads without
re-binding anything: the step counts where torch keeps one, SGD keeps none, and the state tensors), and
``checkpoint`` compares ``state_dict()["state"][i]["step"]``.

The parameters: 4-8 tensors, 2-4 of 16k-40k elements and 2-4 small ones, in random order, some 2-d, so
that a step reads fresh gradients where they are (the parameters with a gradient average
``dml_optim.backends.fused.LIST_MIN_ELEMENTS`` elements or more) or gathers them into the flat buffer (smaller
ones, non-contiguous ones, and every gradient something wrote into since the last step read it), as the
random subsets of ``backward`` make it.  The test asserts that the repeat and both paths ran.

Where "bit for bit" cannot hold, and what the comparison does there:

* **odd sizes**: torch's fused CPU kernels compute the last ``numel % vector width`` elements of each
  tensor they are given in a scalar tail whose rounding differs from the vector loop's (a contracted
  multiply-add: ``_fused_sgd_`` differs in most such elements from the second step on, ``_fused_adamw_``
  now and then; 1 ulp a step).  Ours calls the kernel over ranges of the flat buffer (gathered gradients)
  or per parameter (gradients read in place), torch per parameter, so an element of a parameter whose
  size is not a multiple of the vector width can be in the tail in one and in the vector loop in the
  other.  Which of the two paths ours takes can even differ between ``ours`` and ``plain``: whether a
  gradient was "written into since the last step read it" is told by ``id`` and version counter
  (``dml_optim.backends.fused.reads_in_place``), and a new tensor that gets a freed one's ``id`` can read as
  written into (gathered, where an identical optimizer whose tensors got other addresses reads it in
  place).  So a sequence draws either an *aligned* layout (every size a multiple of 16: the float32 width
  of AVX-512, twice AVX2's; no tail anywhere, whatever the calls) and then everything is compared bit for
  bit, or odd sizes (1, 7, 300, 20001, ...: what real models have, and what offset bugs need), compared
  within :data:`TOL`, ``plain`` included.
* **clipping**: the total norms are compared within :data:`NORM_TOL`, not bit for bit (torch takes a norm
  per tensor and the norm of those, ours norms of blocks of each flat buffer and the norm of those:
  float32 reductions in another order; this machine found the single reduction over a whole buffer that
  ``dml_optim.clip_grad_norm_`` took before, 5e-6 off torch's norm here and worse in larger models).
  A ``max_norm`` the gradients stay under scales by exactly 1.0 in both;
  when it clips, torch's clipped gradients are compared with ours within :data:`NORM_TOL` and then
  overwritten in place with ours', so the sequence goes on bit for bit.  Of the two choices (a tolerance
  from the first clip on, or comparing only until the first clip) this keeps both the clip rule in every
  sequence and the bit-for-bit check of everything after it: the clip is checked on its own, against
  torch's, and cannot hide a later divergence in a tolerance.
* **torch's own bugs**: ``torch.optim.SGD(fused=True)`` raises when a parameter's first gradient arrives
  after the others stepped (:class:`PerParameter`), and torch's fused CPU kernels read a non-contiguous
  gradient in memory order, not in index order (a wrong result: ``_fused_adamw_``, ``_fused_adagrad_`` and
  ``_fused_sgd_`` alike, torch 2.13), so torch's set gets the same values contiguous where ours gets a
  non-contiguous gradient.

What this machine found in the library is fixed now; the plain cases at the end keep the held-reference
re-bindings (the default was ``checks="refs"`` then, blind to them).

Example counts: half the hypothesis profile's ``max_examples`` per optimizer (``ci``: 30 sequences of up to
50 rules each, 1 to 2 s per optimizer on 2 cores; ``HYPOTHESIS_PROFILE=fuzz``: 2500, about 1.5 minutes per
optimizer).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)
from tolerances import assert_close

import dml_optim
from dml_optim.backends.fused import LIST_MIN_ELEMENTS

#: ours and torch's fused twin, every hyperparameter explicit (float32 parameters); the base learning rate
CONFIGS = {
    "AdamW": (lambda ps: dml_optim.AdamW(ps, lr=1e-3, betas=(0.85, 0.99), eps=1e-8, weight_decay=0.05),
              lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.85, 0.99), eps=1e-8, weight_decay=0.05, fused=True),
              1e-3),
    "Adagrad": (lambda ps: dml_optim.Adagrad(ps, lr=0.1, decay_factor=0.05, epsilon=1e-10, norm_coefficient=0.01),
                lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.05, eps=1e-10, weight_decay=0.01, fused=True),
                0.1),
    "Momentum": (lambda ps: dml_optim.Momentum(ps, lr=5e-2, alpha=0.9, beta=0.8),
                 lambda ps: PerParameter(ps, lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, dampening=0.2,
                                                                      fused=True)),
                 5e-2),
}


class PerParameter:
    """One torch.optim optimizer per parameter, used as one (what the machine calls of it).

    torch.optim.SGD(momentum=..., fused=True) raises ``TypeError: expected Tensor as element 0 in argument
    2, but got NoneType`` (torch 2.13, ``torch/optim/sgd.py`` ``_fused_sgd``) when the parameters with a
    gradient mix some with a momentum buffer and some without (a parameter's first gradient arriving
    after the others stepped: unfrozen, or unused until now): it passes ``is_first_step`` for the list as
    a whole and ``None`` for the missing buffers.  Stepping each parameter on its own gives every
    parameter torch's own first step when its turn comes; the kernel computes each tensor of a list on its
    own, so the results are those of one optimizer over the list, where that one runs.
    """

    def __init__(self, params, make):
        self.params = list(params)
        self.opts = [make([p]) for p in self.params]

    @property
    def param_groups(self) -> list:  # (load_state_dict replaces an optimizer's groups: read them anew)
        return [g for o in self.opts for g in o.param_groups]

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    @property
    def state(self) -> dict:
        return {p: o.state[p] for p, o in zip(self.params, self.opts)}

    def state_dict(self) -> dict:
        sds = [o.state_dict() for o in self.opts]
        return {"state": {i: sd["state"][0] for i, sd in enumerate(sds) if 0 in sd["state"]}, "each": sds}

    def load_state_dict(self, sd: dict):
        for o, each in zip(self.opts, sd["each"]):
            o.load_state_dict(each)


#: the float32 vector width of torch's CPU kernels on AVX-512 (AVX2: 8): sizes that are multiples of it leave
#: no element in a kernel's scalar tail, whatever the layout
VEC = 16
#: ours against torch (and plain) in a layout of odd sizes: an ulp a step where a kernel's scalar tail meets
#: its vector loop, compounding over a sequence (observed over 800 sequences of 120 rules per optimizer:
#: 2e-5 relative at most, Momentum)
TOL = dict(rtol=1e-4, atol=1e-5)
#: ``clip``: the total norms, and the clipped gradients (scaled by factors that differ as the norms do):
#: float32 reductions in another order (observed under the fuzz profile: 2e-6 relative at most, where the
#: elements after a buffer's last whole NORM_BLOCK of dml_optim/training/clip.py are small and the blocks' norms large)
NORM_TOL = dict(rtol=1e-5, atol=1e-12)
NAMES = ("ours", "plain", "torch")

FUZZ_SETTINGS = settings(
    max_examples=max(8, settings().max_examples // 2),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)

#: which paths the sequences took (per test): the repeat, fresh gradients read in place, gathered ones
PATHS: Counter = Counter()


@st.composite
def layouts(draw):
    """``(aligned, shapes, frozen at construction)``: 2-4 parameters of 16k-40k elements and 2-4 small ones."""
    aligned = draw(st.booleans())
    if aligned:
        large = st.integers((LIST_MIN_ELEMENTS - 512) // VEC, 40_000 // VEC).map(VEC.__mul__)
        small = st.integers(1, 40).map(VEC.__mul__)
    else:
        large = st.one_of(st.sampled_from([LIST_MIN_ELEMENTS + 1, 20_001, 40_000 - 3]),
                          st.integers(LIST_MIN_ELEMENTS - 500, 40_000))
        small = st.one_of(st.sampled_from([1, 7, 300]), st.integers(1, 700))
    sizes = draw(st.lists(large, min_size=2, max_size=4)) + draw(st.lists(small, min_size=2, max_size=4))
    sizes = draw(st.permutations(sizes))
    shapes = []
    for n in sizes:  # some parameters 2-d (a weight matrix), the others 1-d
        shapes.append((n // VEC, VEC) if n % VEC == 0 and n > VEC and draw(st.booleans()) else (n,))
    frozen = draw(st.sets(st.integers(0, len(sizes) - 1), max_size=2))
    return aligned, shapes, frozen


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.double() - b.double()).abs()
    return f"max |diff| {d.max().item():.3g} at {int((a != b).sum())} of {a.numel()} elements"


def _assert_close(a: torch.Tensor, b: torch.Tensor, tol: dict, what: str) -> None:
    """``torch.testing.assert_close(a, b, **tol)``, its message only when it fails (its check costs 3 ms)."""
    if not bool(((a - b).abs() <= tol["atol"] + tol["rtol"] * b.abs()).all()):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")


class TrainingLoopBindings(RuleBasedStateMachine):
    config: str = "AdamW"

    def __init__(self):
        super().__init__()
        self.make_ours, self.make_torch, self.base_lr = CONFIGS[self.config]
        self.ready = False

    # -- setup ----------------------------------------------------------------------------------------

    @initialize(layout=layouts(), seed=st.integers(0, 2**16), checks=st.sampled_from(["full", "refs", "fast"]))
    def setup(self, layout, seed, checks):
        self.aligned, shapes, frozen = layout
        self.checks = checks
        gen = torch.Generator().manual_seed(seed)
        values = [torch.randn(s, generator=gen) for s in shapes]
        self.sets = [[torch.nn.Parameter(v.clone()) for v in values] for _ in NAMES]
        for ps in self.sets:
            for i in frozen:
                ps[i].requires_grad_(False)
        ours, plain, theirs = self.sets
        self.opts = [self.make_ours(ours), self.make_ours(plain), self.make_torch(theirs)]
        self.opts[1].repeat = False  # (plans every step from scratch)
        for opt in self.opts[:2]:
            opt.checks = checks  # (the binding checks: "full", the default, or the cheaper "refs" and "fast")
        self.held = [[] for _ in NAMES]
        self.ready = True

    @property
    def n(self) -> int:
        return len(self.sets[0])

    def _grad(self, i: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(self.sets[0][i].shape, generator=gen)

    # -- rules: what a training loop does between steps ------------------------------------------------

    @rule(seed=st.integers(0, 2**16), mask=st.lists(st.booleans(), min_size=8, max_size=8))
    def backward(self, seed, mask):
        gen = torch.Generator().manual_seed(seed)
        for i in range(self.n):
            if not mask[i] or not self.sets[0][i].requires_grad:
                continue
            g = self._grad(i, gen)
            for ps in self.sets:  # what autograd does: a fresh tensor, or accumulate into .grad in place
                if ps[i].grad is None:
                    ps[i].grad = g.clone()
                else:
                    ps[i].grad.add_(g)

    @rule()
    def step(self):
        for opt in self.opts:
            opt.step()
        self._count_paths()
        self._check_params()
        self._check_states()

    @rule(seed=st.integers(0, 2**16), mask=st.lists(st.booleans(), min_size=8, max_size=8))
    def iteration(self, seed, mask):
        """``backward`` then ``step``: a training iteration (more steps per sequence)."""
        self.backward(seed, mask)
        self.step()

    @rule(set_to_none=st.booleans())
    def zero_grad(self, set_to_none):
        for opt in self.opts:
            opt.zero_grad(set_to_none=set_to_none)

    @rule()
    def model_zero_grad(self):
        for ps in self.sets:
            for p in ps:
                p.grad = None

    @rule(index=st.integers(0, 7))
    def drop_grad(self, index):
        for ps in self.sets:
            ps[index % self.n].grad = None

    @rule(index=st.integers(0, 7), seed=st.integers(0, 2**16), transposed=st.booleans())
    def replace_grad(self, index, seed, transposed):
        i = index % self.n
        if self.checks == "fast" and not self.sets[0][i].requires_grad:
            return  # (a frozen parameter given a gradient: "fast" does not look for one, LayoutMixin._unfrozen)
        g = self._grad(i, torch.Generator().manual_seed(seed))
        for ps in self.sets:
            # (a non-contiguous gradient for ours: not read in place, gathered.  Not for torch's twin: its fused
            # CPU kernels read a non-contiguous gradient in memory order, a wrong result: module docstring)
            ps[i].grad = g.t().contiguous().t() if transposed and g.dim() == 2 and ps is not self.sets[2] else g.clone()

    @rule(index=st.integers(0, 7), factor=st.sampled_from([0.5, -1.0]))
    def edit_param(self, index, factor):
        """An in-place write into a parameter (weight clipping, re-initializing a layer)."""
        with torch.no_grad():
            for ps in self.sets:
                ps[index % self.n].mul_(factor)

    @rule(index=st.integers(0, 7))
    def rebind_param(self, index):
        """``p.data = t``: the parameter re-bound to a tensor of its own (what ``model.to()`` and some weight
        loaders do); ours copies it back into its flat buffer at the next step (or zero_grad, state_dict)."""
        for ps in self.sets:
            p = ps[index % self.n]
            p.data = p.data.clone()

    @rule(index=st.integers(0, 7))
    def freeze(self, index):
        for ps in self.sets:
            ps[index % self.n].requires_grad_(False)
            ps[index % self.n].grad = None

    @rule(index=st.integers(0, 7))
    def unfreeze(self, index):
        for ps in self.sets:
            ps[index % self.n].requires_grad_(True)

    @precondition(lambda self: self.checks == "full")  # ("refs" and "fast" are blind to it, as documented)
    @rule(index=st.integers(0, 7), how=st.sampled_from(["drop", "replace", "rebind_data"]), seed=st.integers(0, 2**16))
    def hold_and_rebind(self, index, how, seed):
        """Keep references to every ``.grad`` (a logger, a gradient-noise monitor) while re-binding one
        (``grads = [p.grad for p in params]; p.grad = None``, or a new tensor), or the old weights of a
        parameter re-bound to new ones (``backup = p.detach(); p.data = t``).  The references stay until the
        next ``hold_and_rebind``."""
        i = index % self.n
        g = self._grad(i, torch.Generator().manual_seed(seed))
        for held, ps in zip(self.held, self.sets):
            held[:] = [p.grad for p in ps] if how != "rebind_data" else [ps[i].detach()]
            if how == "drop":
                ps[i].grad = None
            elif how == "replace":
                ps[i].grad = g.clone()
            else:
                ps[i].data = ps[i].data.clone()

    @rule(max_norm=st.sampled_from([0.5, 50.0, 1e9]))
    def clip(self, max_norm):
        norms = [dml_optim.clip_grad_norm_(opt, max_norm) for opt in self.opts[:2]]
        norms.append(torch.nn.utils.clip_grad_norm_(self.sets[2], max_norm))
        self._same(norms[0], norms[1], "plain", "clip: total norm")
        _assert_close(norms[0], norms[2], NORM_TOL, "clip: total norm, ours against torch")
        # both scale by max_norm / (norm + 1e-6) clamped to 1.0: exactly 1.0 (nothing changes) unless it clips
        for i, (p, q) in enumerate(zip(self.sets[0], self.sets[2])):
            if p.grad is not None and q.grad is not None and not torch.equal(p.grad, q.grad):
                _assert_close(p.grad, q.grad, NORM_TOL, f"clip: param {i} .grad, ours against torch")
                q.grad.copy_(p.grad)  # (torch steps on from ours' clipped gradients: in place, as a clip writes)

    @rule(factor=st.sampled_from([0.1, 0.5, 1.0, 2.0]))
    def set_lr(self, factor):
        for opt in self.opts:
            for group in opt.param_groups:
                group["lr"] = self.base_lr * factor

    @rule(reload=st.booleans())
    def checkpoint(self, reload):
        sds = [opt.state_dict() for opt in self.opts]
        self._check_state_dict_steps(sds)
        if reload:
            for opt, sd in zip(self.opts, sds):
                opt.load_state_dict(copy.deepcopy(sd))

    # -- checks ---------------------------------------------------------------------------------------

    def _same(self, a, b, other: str, what: str) -> None:
        """``ours`` against ``other``: bit for bit in an aligned layout, else within :data:`TOL`."""
        if torch.equal(a, b):
            return
        assert not self.aligned, f"{what}: ours != {other} ({_diff(a, b)}; aligned layout)"
        _assert_close(a, b, TOL, f"{what}: ours against {other}")

    @invariant()
    def parameters_and_gradients_agree(self):
        if not self.ready:
            return
        self._check_params()
        for i in range(self.n):
            grads = [ps[i].grad for ps in self.sets]
            assert [g is None for g in grads] == [grads[0] is None] * 3, \
                f"param {i}: .grad is None in {[n for n, g in zip(NAMES, grads) if g is None]} only"
            if grads[0] is not None:
                for other, g in zip(NAMES[1:], grads[1:]):
                    self._same(grads[0], g, other, f"param {i} .grad")

    def _check_params(self):
        for i in range(self.n):
            ours = self.sets[0][i].detach()
            for other, ps in zip(NAMES[1:], self.sets[1:]):
                self._same(ours, ps[i].detach(), other, f"param {i}")

    def _check_states(self):
        """Per parameter, the state as ``opt.state[p]`` shows it (read only: no re-binding, unlike
        ``state_dict()``, which follows moved parameters first): the step counts where torch keeps one
        (a parameter not stepped yet: 0, or no state) and the state tensors both have."""
        keeps_step = self.config != "Momentum"
        for i in range(self.n):
            states = [opt.state[ps[i]] for opt, ps in zip(self.opts, self.sets)]
            steps = [float(s.get("step", 0)) for s in states]
            assert steps[0] == steps[1], f"param {i}: step ours {steps[0]} != plain {steps[1]}"
            if keeps_step:
                assert steps[0] == steps[2], f"param {i}: step ours {steps[0]} != torch {steps[2]}"
            else:  # (torch.optim.SGD keeps no step: a parameter has a momentum buffer once it stepped)
                assert ("momentum_buffer" in states[0]) == ("momentum_buffer" in states[2]), \
                    f"param {i}: a momentum buffer in one of ours and torch's only"
            for name, t in states[0].items():
                if name == "step":
                    continue
                for other, s in zip(NAMES[1:], states[1:]):
                    if name in s:
                        self._same(t, s[name], other, f"param {i} state {name!r}")

    def _check_state_dict_steps(self, sds):
        steps = [{i: float(s["step"]) for i, s in sd["state"].items() if "step" in s} for sd in sds]
        for i in range(self.n):
            counts = [st_.get(i, 0.0) for st_ in steps]
            assert counts[0] == counts[1], f"state_dict step of param {i}: ours {counts[0]} != plain {counts[1]}"
            if self.config != "Momentum":
                assert counts[0] == counts[2], f"state_dict step of param {i}: ours {counts[0]} != torch {counts[2]}"

    def _count_paths(self):
        """After a step of ours: whether it repeated the last step's plan; a gradient that is not a view of its
        flat gradient buffer was read in place."""
        infos = self.opts[0].flat_buffers()
        PATHS["repeat"] += bool(infos) and all(b.repeated for b in infos)
        homes = {b.grad.untyped_storage().data_ptr() for b in infos if b.grad is not None}
        for p in self.sets[0]:
            if p.grad is not None:
                PATHS["gathered" if p.grad.untyped_storage().data_ptr() in homes else "in_place"] += 1


def _machine(name):
    return type(f"TrainingLoopBindings_{name}", (TrainingLoopBindings,), {"config": name})


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_training_loop_bindings_agree_with_torch_fused_bit_for_bit(name):
    PATHS.clear()
    run_state_machine_as_test(_machine(name), settings=FUZZ_SETTINGS)
    assert PATHS["repeat"] and PATHS["in_place"] and PATHS["gathered"], PATHS  # every path ran


# -- what the machine found in the library, as plain cases ---------------------------------------------

# Found by ``hold_and_rebind`` with the binding check that was the default then (``checks="refs"``: storage use
# counts alone): a reference the caller still holds to the old gradient view (``grads = [p.grad for p in
# params]``) or to the old weights (``backup = p.detach(); p.data = t``) kept the count where it was, so the
# re-binding went unseen: the step read the stale gradient view (``p.grad = None``: the parameter was stepped,
# which torch.optim does not do; ``p.grad = t``: ``t`` was ignored) or updated the old weights instead of the
# parameter's new ones.  ``checks="full"`` (the default now) compares every gradient's identity and data
# pointer too; ``"refs"`` and ``"fast"`` stay blind to it, as documented (FlatBuffer.check).


def _held_pair(**options):
    """Ours and torch's fused AdamW over the same two small parameters, after two training iterations that
    keep the gradients as ours' views (``zero_grad(set_to_none=False)`` and accumulation into ``.grad``)."""
    values = [torch.randn(16, generator=torch.Generator().manual_seed(1)), torch.randn(4, 8)]
    sets = [[torch.nn.Parameter(v.clone()) for v in values] for _ in range(2)]
    opts = [dml_optim.AdamW(sets[0], lr=1e-3, **options), torch.optim.AdamW(sets[1], lr=1e-3, fused=True)]
    _held_iteration(sets, opts)
    _held_iteration(sets, opts)
    return sets, opts


def _held_iteration(sets, opts, between=None):
    for opt in opts:
        opt.zero_grad(set_to_none=False)
    for ps in sets:
        for k, p in enumerate(ps):
            g = torch.full_like(p, 1.0 + k)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
    held = [between(ps) for ps in sets] if between is not None else None
    for opt in opts:
        opt.step()
    return held


def _drop(ps):
    grads = [p.grad for p in ps]  # a logger keeps the gradients ...
    ps[1].grad = None  # ... and parameter 1 gets none this step: torch.optim does not step it
    return grads


def _replace(ps):
    grads = [p.grad for p in ps]  # the old gradients, still in scope ...
    ps[1].grad = grads[1] * 0.0  # ... while parameter 1's is replaced (masked, rescaled)
    return grads


def _rebind_data(ps):
    backup = ps[1].detach()  # the old weights kept (to roll back to, to compare with) ...
    ps[1].data = ps[1].data.clone()  # ... while parameter 1 is re-bound to a tensor of its own (a weight loader)
    return backup


@pytest.mark.parametrize("between", [_drop, _replace, _rebind_data], ids=lambda f: f.__name__.strip("_"))
def test_a_rebinding_is_seen_while_the_caller_holds_the_old_tensors(between):
    sets, opts = _held_pair()  # (the default checks)
    _held_iteration(sets, opts, between)
    for i, (p, q) in enumerate(zip(*sets)):
        assert torch.equal(p.detach(), q.detach()), f"{between.__name__}: param {i}: {_diff(p.detach(), q.detach())}"


# -- a gradient the caller keeps after its parameter's was released ------------------------------------------

# Found by a review: ``kept = p.grad`` (our view of the flat gradient buffer), then ``p.grad = None`` (any of
# the ways below) and another backward: torch.optim leaves ``kept`` as it was (autograd makes a fresh tensor),
# ours copied the new gradient into ``kept``'s slot (the post-accumulate-grad hook, or the step's gather) and
# handed ``kept`` back as ``p.grad``.  The buffer now gives its storage up to the tensors that hold it
# (copy-on-write, FlatBuffer.release_held).  References are torch.optim.AdamW twins with ``foreach=False``.

_RELEASES = {
    "opt_zero_grad": lambda model, opt: opt.zero_grad(set_to_none=True),
    "model_zero_grad": lambda model, opt: model.zero_grad(),
    "grad_none": lambda model, opt: [setattr(p, "grad", None) for p in model.parameters()],
}
_KEPT_BACKENDS = ["eager", "auto", "compiled"]


def _kept_twins(backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    return [(model, dml_optim.AdamW(model.parameters(), lr=1e-2, backend=backend)),
            (twin, torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False))]


def _kept_loss(model, i):
    g = torch.Generator().manual_seed(500 + i)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def _assert_kept(kept, before, model, what):
    for k, (g, b, p) in enumerate(zip(kept, before, model.parameters())):
        assert torch.equal(g, b), f"{what}: kept gradient {k} was written into: {_diff(g, b)}"
        assert g is not p.grad, f"{what}: kept gradient {k} was handed back as p.grad"


def _assert_twins(pairs, what):
    (ours, _), (theirs, _) = pairs
    for k, (p, q) in enumerate(zip(ours.parameters(), theirs.parameters())):
        try:
            assert_close(p.detach(), q.detach())
        except AssertionError as e:
            raise AssertionError(f"{what}: parameter {k}: {e}") from None


@pytest.mark.parametrize("release", sorted(_RELEASES))
@pytest.mark.parametrize("backend", _KEPT_BACKENDS)
def test_a_kept_gradient_is_never_written_into_after_its_parameter_released_it(backend, release):
    pairs = _kept_twins(backend)
    for i in range(4):
        for model, opt in pairs:
            opt.zero_grad(set_to_none=False)  # (ours: every p.grad its view of the flat gradient buffer)
            _kept_loss(model, i).backward()
            kept = [p.grad for p in model.parameters()]  # (no clone: a logger, a similarity metric)
            before = [g.clone() for g in kept]
            _RELEASES[release](model, opt)
            _kept_loss(model, 100 + i).backward()
            _assert_kept(kept, before, model, f"{backend}, {release}, iteration {i}")
            opt.step()
            _assert_kept(kept, before, model, f"{backend}, {release}, iteration {i}, after the step")
        _assert_twins(pairs, f"{backend}, {release}, iteration {i}")


@pytest.mark.parametrize("backend", _KEPT_BACKENDS)
def test_pcgrad_style_kept_task_gradients_equal_torch(backend):
    """Gradient surgery: task A's gradients kept as ``p.grad`` tensors across ``zero_grad(set_to_none=True)``
    and task B's backward, then combined into new ``.grad`` tensors (B's projected off A where they conflict)."""
    pairs = _kept_twins(backend)
    for i in range(5):
        for model, opt in pairs:
            opt.zero_grad(set_to_none=True)
            _kept_loss(model, i).backward()
            task_a = [p.grad for p in model.parameters()]
            before = [g.clone() for g in task_a]
            opt.zero_grad(set_to_none=True)
            _kept_loss(model, 50 + i).backward()
            task_b = [p.grad for p in model.parameters()]
            _assert_kept(task_a, before, model, f"{backend}, step {i}")
            for p, a, b in zip(model.parameters(), task_a, task_b):
                dot = (a * b).sum()
                p.grad = a + b - torch.clamp(dot, max=0.0) / (a * a).sum().clamp(min=1e-12) * a
            opt.step()
        _assert_twins(pairs, f"{backend}, step {i}")


# Gradient tensors the caller allocates once and keeps (``p.grad = buf``), zeroing them through its own
# references: torch.optim's ``p.grad`` stays ``buf``, so backward accumulates into it and the caller's zeroing
# reaches it.  Ours once adopted ``buf`` (copied it into the flat buffer and pointed ``p.grad`` at a view), so
# the caller's zeroing no longer reached ``p.grad`` and the gradients summed over the steps (off by 1e-2 at the
# second step).  A gradient the caller holds too now stays theirs, copied in at each step
# (dml_optim.core.grads.held_elsewhere).

_ZEROINGS = {
    "foreach_zero_own_refs": lambda model, opt, bufs: torch._foreach_zero_(bufs),
    "own_refs_one_by_one": lambda model, opt, bufs: [b.zero_() for b in bufs],
    "opt_zero_grad": lambda model, opt, bufs: opt.zero_grad(set_to_none=False),
    "model_zero_grad": lambda model, opt, bufs: model.zero_grad(set_to_none=False),
}


@pytest.mark.parametrize("clip", [False, True], ids=["no_clip", "clip"])
@pytest.mark.parametrize("zeroing", sorted(_ZEROINGS))
@pytest.mark.parametrize("backend", _KEPT_BACKENDS)
def test_gradients_the_caller_allocated_and_keeps_stay_theirs_and_equal_torch(backend, zeroing, clip):
    """With ``clip``, each side's clip between backward and step (ours: ``dml_optim.clip_grad_norm_``, which
    scales the flat buffer, and the caller's tensors with it)."""
    pairs = _kept_twins(backend)
    held = []
    for model, _ in pairs:
        bufs = [torch.zeros_like(p) for p in model.parameters()]
        for p, b in zip(model.parameters(), bufs):
            p.grad = b
        held.append(bufs)
    for i in range(4):
        for (model, opt), bufs in zip(pairs, held):
            _ZEROINGS[zeroing](model, opt, bufs)
            _kept_loss(model, i).backward()
            if clip and isinstance(opt, torch.optim.AdamW):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            elif clip:
                dml_optim.clip_grad_norm_(opt, 0.05)
            opt.step()
            for k, (p, b) in enumerate(zip(model.parameters(), bufs)):
                assert p.grad is b, f"{backend}, {zeroing}, step {i}: parameter {k}'s .grad is no longer the caller's"
        (ours, _), (theirs, _) = pairs
        for k, (p, q) in enumerate(zip(ours.parameters(), theirs.parameters())):
            try:  # (one step's gradient, not a sum over the steps)
                assert_close(p.grad, q.grad)
            except AssertionError as e:
                raise AssertionError(f"{backend}, {zeroing}, step {i}: gradient {k}: {e}") from None
        _assert_twins(pairs, f"{backend}, {zeroing}, step {i}")


@pytest.mark.parametrize("backend", _KEPT_BACKENDS)
def test_unscaling_reaches_gradients_the_caller_holds(backend):
    """``unscale_`` (what ``DynamicLossScaler.unscale_`` calls) multiplies the gradients where ``p.grad`` is: the
    caller's own tensors too, which stay ``p.grad``."""
    (model, opt), _ = _kept_twins(backend)
    bufs = [torch.zeros_like(p) for p in model.parameters()]
    for p, b in zip(model.parameters(), bufs):
        p.grad = b
    _kept_loss(model, 0).backward()
    expected = [b.clone() * 0.25 for b in bufs]
    found_inf = opt.unscale_(torch.tensor(0.25))
    assert float(found_inf) == 0.0
    for k, (p, b, e) in enumerate(zip(model.parameters(), bufs, expected)):
        assert p.grad is b, f"{backend}: parameter {k}'s .grad is no longer the caller's"
        assert torch.equal(b, e), f"{backend}: gradient {k} was not unscaled where the caller holds it: {_diff(b, e)}"


def test_a_gradient_reads_as_held_exactly_when_the_caller_keeps_a_reference():
    """The reference-count test itself, on the running torch (its Python-object bookkeeping decides the
    count): a fresh gradient of backward, one assigned and let go, and one whose reader let it go read as not
    held; one kept in a variable or a list, or shared by two parameters of the list, reads as held."""
    from dml_optim.core.grads import held_elsewhere

    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    (p * 2).sum().backward()
    assert held_elsewhere([p.grad]) == [False], "a fresh gradient of backward"
    read = p.grad
    del read
    assert held_elsewhere([p.grad]) == [False], "a gradient read once and let go"
    p.grad = torch.zeros(3)
    assert held_elsewhere([p.grad, None]) == [False, False], "an assigned temporary"
    kept = p.grad
    assert held_elsewhere([p.grad]) == [True], "kept in a variable"
    del kept
    logged = [p.grad]
    assert held_elsewhere([p.grad]) == [True], "kept in a list"
    del logged
    q.grad = p.grad  # (two parameters of one buffer sharing a gradient: its list names it twice)
    assert held_elsewhere([p.grad, q.grad]) == [True, True], "two parameters' gradient, listed twice"
