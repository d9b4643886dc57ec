"""``torch.privateuseone``: the device module the stand-in registers with
``torch._register_device_module`` (what torch asks of a PrivateUse1 backend:
``torch.manual_seed`` calls ``manual_seed_all`` unless ``_is_in_bad_fork()``).

One device, index 0.  The random functions act on the device's default generator."""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1


_extension = None  # the loaded extension, set by dml_optim.standin before it registers this module


def _ext():
    if _extension is None:
        raise RuntimeError("dml_optim.standin is not loaded")
    return _extension


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device) -> None:
    index = torch.device(device).index if not isinstance(device, int) else device
    if index not in (None, 0):
        raise RuntimeError(f"the stand-in has one device, privateuseone:0; got index {index}")


def synchronize(device=None) -> None:
    pass


def manual_seed(seed: int) -> None:
    _ext()._manual_seed(int(seed) & _MASK)


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    _ext()._seed()


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return int(_ext()._initial_seed())


def get_rng_state(device="privateuseone") -> torch.Tensor:
    return _ext()._get_rng_state()


def set_rng_state(new_state: torch.Tensor, device="privateuseone") -> None:
    _ext()._set_rng_state(new_state)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16]


def is_bf16_supported() -> bool:
    return False
