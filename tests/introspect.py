"""Small readers of an optimizer's public layout (``flat_buffers()``) shared by the tests."""


def buffers(opt, group: int | None = None):
    """The :class:`~dml_optim.optimizers.BufferInfo` of ``opt`` (of one group)."""
    return [i for i in opt.flat_buffers() if group is None or i.group == group]


def runs_in_chunks(opt, group: int = 0) -> bool:
    """The eager rule runs over bounded chunks (its scratch is smaller than the buffer)."""
    info = buffers(opt, group)[0]
    return bool(info.scratch) and all(s.numel() < info.numel for s in info.scratch)
