"""Step counts of a flat buffer's parameters, kept as classes of parameters that step together.

A :class:`StepCounter` keeps the completed steps of a buffer's parameters as
*classes* (:class:`StepClass`): runs of parameters, in buffer order, that have
stepped together.  While every parameter steps every step there is one class
and one counter, so a step costs O(1) host work whatever the number of
parameters.  ``None`` gradients split classes (:meth:`StepCounter.split`);
when that leaves parameters with equal counts in pieces,
:meth:`StepCounter.order` proposes a parameter order that makes each class
contiguous again (the buffer is then re-packed), so a step runs the rule once
per distinct step count, not once per run of parameters.

Counts are known on the host (a Python ``int``) until a step's outcome is
decided on the device (a skipped step under ``nonfinite="skip"`` or loss
scaling) or replayed by a CUDA graph (``capturable=True``); then the device
counter (a 0-d int64 tensor) is the truth and the host only tracks which
parameters stepped together (a class keeps one identity).

Gradients that come and go at every step (``None`` patterns) would split and
re-merge the classes at every step: a buffer stepped by torch's fused kernels
(which take a step count per tensor) would pay for Python objects it does not
need.  So while every count is known on the host and no class has a device
counter, a split keeps the counts *per parameter* instead (a list of ints and
the step's activity): a split is one assignment, an advance one C-level pass
(:meth:`StepCounter.advance`), and the fused plan reads the runs of active
parameters at one count (:meth:`StepCounter.active_runs`) in one pass.  Reading
:attr:`StepCounter.classes`, or anything that needs identities or device
counters, turns the per-parameter counts back into classes (the same classes
the split would have made: host-known classes are identified by their count).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

__all__ = ["StepCounter", "StepClass"]


@dataclass
class StepClass:
    """Parameters ``[first, stop)`` of a buffer that have stepped together.

    ``count``: their completed steps, known on the host (None once a gated
    step may or may not have happened: only the device knows).  ``tensor``:
    the same count as a 0-d int64 on the buffer's device, when kernels read it
    there (compiled backend, gated steps, ``capturable``).  ``key``: identity
    for merging (equal keys mean equal counts).  ``active``: has a gradient in
    the step being planned.
    """

    first: int
    stop: int
    count: int | None
    key: Hashable
    tensor: torch.Tensor | None = None
    active: bool = True


class StepCounter:
    """Completed-step counts of one buffer's parameters, as :class:`StepClass` runs in buffer order.

    Two forms of the same counts: the classes, or (while every count is known on the host and no class has
    a device counter, after a :meth:`split`) one count and one activity flag per parameter; see the module
    docstring.  :attr:`classes` always answers in classes (it converts the per-parameter form)."""

    __slots__ = ("_classes", "_counts", "_active", "_next_id")

    def __init__(self, n: int, count: int = 0):
        self._classes: list[StepClass] | None = [StepClass(0, n, count, ("n", count))]
        self._counts: list[int] | None = None  # the per-parameter form (when _classes is None)
        self._active: list[bool] | None = None  # its activity (None: every parameter)
        self._next_id = 0

    @property
    def classes(self) -> list[StepClass]:
        if self._classes is None:  # the per-parameter form, as classes (from then on)
            active = self._active if self._active is not None else itertools.repeat(True)
            classes: list[StepClass] = []
            for i, (n, a) in enumerate(zip(self._counts, active)):
                last = classes[-1] if classes else None
                if last is not None and last.count == n and last.active == a:
                    last.stop = i + 1
                else:
                    classes.append(StepClass(i, i + 1, n, ("n", n), None, a))
            self._classes = classes or [StepClass(0, 0, 0, ("n", 0))]
            self._counts = self._active = None
        return self._classes

    @classes.setter
    def classes(self, value: list[StepClass]) -> None:
        self._classes, self._counts, self._active = value, None, None

    # -- reading -------------------------------------------------------------------

    @property
    def known(self) -> bool:
        """Every count is known on the host (no gated step happened since the last load)."""
        return self._classes is None or all(c.count is not None for c in self._classes)

    def counts(self) -> list[int]:
        """Per-parameter completed steps (reads device counters: a host sync if unknown on the host)."""
        if self._classes is None:
            return list(self._counts)
        out: list[int] = []
        for c in self._classes:
            n = c.count if c.count is not None else int(c.tensor.item())
            out.extend([n] * (c.stop - c.first))
        return out

    def max_count(self) -> int:
        if self._classes is None:
            return max(self._counts, default=0)
        return max((c.count if c.count is not None else int(c.tensor.item())) for c in self._classes)

    def active_runs(self) -> tuple[list[tuple[int, int]], list[int | None]]:
        """The maximal runs ``(first, stop)`` of parameters with a gradient at one count, in buffer order, and
        their counts (None: unknown on the host): what the fused kernels step, a range of the buffer each."""
        if self._classes is not None:
            if len(self._classes) == 1:  # (one class: the steady step)
                c = self._classes[0]
                return ([(c.first, c.stop)], [c.count]) if c.active else ([], [])
            active = [c for c in self._classes if c.active]
            return [(c.first, c.stop) for c in active], [c.count for c in active]
        runs: list[tuple[int, int]] = []
        counts: list[int | None] = []
        first, previous = 0, -1
        keys = self._counts if self._active is None else map(  # (an inactive parameter reads -1: no run crosses it)
            operator.sub, map(operator.mul, self._counts, self._active), map(operator.not_, self._active))
        for i, n in enumerate(keys):
            if n != previous:
                if previous >= 0:
                    runs.append((first, i))
                    counts.append(previous)
                first, previous = i, n
        if previous >= 0:
            runs.append((first, len(self._counts)))
            counts.append(previous)
        return runs, counts

    def active_params(self) -> tuple[list[int], list[int | None]]:
        """The parameters with a gradient, in buffer order, and their counts (None: unknown on the host)."""
        if self._classes is None:
            counts = self._counts
            index = range(len(counts))
            index = list(index) if self._active is None else list(itertools.compress(index, self._active))
            return index, list(map(counts.__getitem__, index))
        index: list[int] = []
        counts: list[int | None] = []
        for c in self._classes:
            if c.active:
                index.extend(range(c.first, c.stop))
                counts.extend([c.count] * (c.stop - c.first))
        return index, counts

    def inactive(self) -> list[int]:
        """The parameters without a gradient in the step being planned."""
        if self._classes is None:
            return [] if self._active is None else [i for i, a in enumerate(self._active) if not a]
        return [i for c in self._classes if not c.active for i in range(c.first, c.stop)]

    # -- writing -------------------------------------------------------------------

    def set_counts(self, counts: Sequence[int], device: torch.device | None = None) -> None:
        """Replace every count (a load); ``device``: also keep device counters there."""
        classes: list[StepClass] = []
        for i, n in enumerate(counts):
            if classes and classes[-1].count == n:
                classes[-1].stop = i + 1
            else:
                classes.append(StepClass(i, i + 1, int(n), ("n", int(n))))
        if not classes:
            classes = [StepClass(0, 0, 0, ("n", 0))]
        self.classes = classes
        if device is not None:
            self.ensure_tensors(device)

    def ensure_tensors(self, device: torch.device) -> None:
        """Give every class a device counter (one fill each, first time only)."""
        for c in self.classes:
            if c.tensor is None:
                c.tensor = torch.full((), c.count, dtype=torch.int64, device=device)

    def forget_host_counts(self) -> None:
        """Counts are the device's from now on (``capturable``: replays don't run the host)."""
        for c in self.classes:
            if c.count is not None:
                c.count = None
                c.key = self._new_key()

    def _new_key(self) -> tuple[str, int]:
        self._next_id += 1
        return ("h", self._next_id)

    def split(self, active: Sequence[bool] | None) -> None:
        """Refine the classes so that none mixes parameters with and without a gradient.

        Each run a class splits into gets a device counter of its own (the first
        keeps the class's, the others a copy: one op each), so they can diverge.
        While every count is known on the host and no class has a device counter, the counts are kept
        per parameter instead, with ``active`` beside them (one assignment a step).
        """
        if self._classes is None:
            if active is None and len(set(self._counts)) <= 1:  # all together at one count: one class again
                n = self._counts[0] if self._counts else 0
                self.classes = [StepClass(0, len(self._counts), n, ("n", n))]
            else:
                self._active = None if active is None else list(active)
            return
        if active is not None and all(c.count is not None and c.tensor is None for c in self._classes):
            self._counts, self._active = self.counts(), list(active)
            self._classes = None
            return
        if active is None:
            for c in self.classes:
                c.active = True
            self.merge()  # runs that stepped apart and are equal again are one class
            return
        # the runs of equal activity (C-level groupby), cut at the classes' bounds
        cuts, position = [], 0
        for flag, run in itertools.groupby(active):
            position += sum(1 for _ in run)
            cuts.append((position, bool(flag)))
        out: list[StepClass] = []
        k = 0
        for c in self.classes:
            first_run = True
            start = c.first
            while start < c.stop:
                while cuts[k][0] <= start:
                    k += 1
                stop = min(cuts[k][0], c.stop)
                # every run its own counter: a kernel advances the counter of the run it updates, and
                # runs left apart (no re-pack) are updated one at a time
                tensor = c.tensor if first_run or c.tensor is None else c.tensor.clone()
                first_run = False
                out.append(StepClass(start, stop, c.count, c.key, tensor, cuts[k][1]))
                start = stop
        self.classes = out
        self.merge()

    def order(self) -> list[int] | None:
        """A parameter order that makes each (active, key) one contiguous class, or None if it already is."""
        seen: dict[tuple, int] = {}
        contiguous = True
        previous = None
        for c in self.classes:
            k = (c.active, c.key)
            if k in seen and k != previous:
                contiguous = False
            seen.setdefault(k, len(seen))
            previous = k
        inactive_runs = sum(1 for a, b in zip(self.classes, self.classes[1:] + [None])
                            if not a.active and (b is None or b.active))
        if contiguous and inactive_runs <= 1:
            return None
        rank = {k: (not k[0], r) for k, r in seen.items()}  # active classes first, inactive ones last
        ordered = sorted(self.classes, key=lambda c: rank[(c.active, c.key)])
        return [i for c in ordered for i in range(c.first, c.stop)]

    def permute(self, order: Sequence[int]) -> None:
        """Re-number the classes after the buffer was re-packed in ``order``."""
        where = {i: pos for pos, i in enumerate(order)}
        pieces = sorted(((where[c.first], c) for c in self.classes), key=lambda t: t[0])
        out: list[StepClass] = []
        for start, c in pieces:
            size = c.stop - c.first
            out.append(StepClass(start, start + size, c.count, c.key, c.tensor, c.active))
        self.classes = out
        self.merge()

    def advance(self, gated: bool) -> None:
        """Host bookkeeping after the kernels of a step ran for every active class.

        ``gated``: the device decided whether the step happened (the active
        classes' counts become unknown on the host; classes that stepped
        together keep one identity).  Adjacent classes with equal keys merge.
        """
        if self._classes is None and not gated:  # per parameter: one C-level pass
            active = self._active
            counts = self._counts
            self._counts = [n + 1 for n in counts] if active is None else list(map(operator.add, counts, active))
            return
        if not gated and self._classes is not None and len(self._classes) == 1 and self._classes[0].count is not None:
            c = self._classes[0]  # (one class at a host count: the steady step; nothing to rename or merge)
            if c.active:
                c.count += 1
                c.key = ("n", c.count)
            return
        renamed: dict[Hashable, Hashable] = {}
        for c in self.classes:
            if not c.active:
                continue
            if gated or c.count is None:
                if c.key not in renamed:
                    renamed[c.key] = self._new_key()
                c.key = renamed[c.key]
                c.count = None
            else:
                c.count += 1
                c.key = ("n", c.count)
        self.merge()

    def merge(self) -> None:
        """Join adjacent classes with the same key and activity (equal counts: one counter)."""
        out: list[StepClass] = []
        for c in self.classes:
            if out and out[-1].key == c.key and out[-1].active == c.active and out[-1].stop == c.first:
                last = out[-1]
                last.stop = c.stop
                if last.tensor is None:
                    last.tensor = c.tensor
            else:
                out.append(c)
        self.classes = out
