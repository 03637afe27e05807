"""The CPU backend stays on through backward: the backward functions a `Tensor.backward()` or
`torch.autograd.backward()` runs, and a backward started inside a backward, as megatron's
activation recompute starts one (tensor_parallel.random.CheckpointFunction recomputes the
forward and calls torch.autograd.backward in its own backward), see the virtual CUDA device.

The reference is what a GPU does: there a backward function's `device=current_device()` tensor
and its dropout's draw are on the device. Before the fix the torch function mode was off while
those ran (a mode is off inside its own handler, and both backward calls dispatch to it): a
tensor made on `torch.cuda.current_device()` (megatron's MoE all-to-all backward does) asked
torch for CUDA, which a run under `--recompute-granularity full` with expert parallelism died
of on every rank, and a recomputed dropout drew from the host generator (not the forward's
masks). End to end: tests/moe_launcher/test_convert_hf.py trains under full recompute."""

import pytest
import torch


class _NamesTheDevice(torch.autograd.Function):
    """x * 3, whose backward makes a tensor on the current CUDA device and draws a dropout mask
    there, as megatron's backward functions do."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        host, device = torch.get_rng_state(), torch.cuda.get_rng_state()
        scale = torch.full(grad.shape, 3.0, device=torch.cuda.current_device())
        torch.nn.functional.dropout(torch.ones(4, device="cuda"), p=0.5)
        _NamesTheDevice.draws.append((torch.equal(host, torch.get_rng_state()),
                                      torch.equal(device, torch.cuda.get_rng_state())))
        return grad * scale


class _Recomputed(torch.autograd.Function):
    """_NamesTheDevice's forward, recomputed in backward and run backward there with
    torch.autograd.backward, as megatron's CheckpointFunction does."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        with torch.no_grad():
            return _NamesTheDevice.apply(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        inner = x.detach().requires_grad_()
        with torch.enable_grad():
            out = _NamesTheDevice.apply(inner)
        torch.autograd.backward(out, grad)
        return inner.grad


@pytest.mark.parametrize("how", ["Tensor.backward", "torch.autograd.backward"])
@pytest.mark.parametrize("recomputed", [False, True], ids=["direct", "recomputed"])
def test_backward_functions_see_the_virtual_device(how, recomputed):
    _NamesTheDevice.draws = []
    x = torch.ones(4, requires_grad=True)
    y = (_Recomputed if recomputed else _NamesTheDevice).apply(x) * 2
    gradient = torch.ones(4)
    if how == "Tensor.backward":
        y.backward(gradient=gradient)
    else:
        torch.autograd.backward([y], grad_tensors=[gradient])
    assert torch.equal(x.grad, torch.full((4,), 6.0))
    # the dropout drew on the device's generator, as on a GPU, not on the host's
    assert _NamesTheDevice.draws == [(True, False)]
