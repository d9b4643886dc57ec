"""Loss scaling on the device (placeholder until issue 6 lands)."""


def step_with_grad_scaler(opt, grad_scaler, closure=None):
    raise NotImplementedError("torch.amp.GradScaler support is not implemented yet")
