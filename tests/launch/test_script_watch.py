"""The steps of a model no DDP wraps, from its top-level forwards (launch/script_watch.py), in process."""

import torch
from torch import nn

from dpscale.engine.telemetry import StepTelemetry
from dpscale.launch.script_watch import BareEvaluations, Unwrapped


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x=None, *, features=None):
        return self.body(x if x is not None else features)


def test_top_level_training_forwards_make_the_steps_and_the_optimizer_ends_each():
    telemetry = StepTelemetry()
    watch = Unwrapped(telemetry)
    try:
        model, criterion = Net(), nn.MSELoss()
        for step in range(4):
            for micro in range(2):  # two micro-steps, the second passed by keyword
                out = model(torch.randn(6, 4)) if micro == 0 else model(features=torch.randn(6, 4))
                criterion(out, torch.zeros(6, 1)).backward()  # a loss module: no parameters, no step
            telemetry.end_step()  # what the optimizer's step hook does
            if step == 1:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(50, 4))
                model.train()
    finally:
        watch.remove()
    # 4 steps, the last one unfinished until the next forward: 3 records
    assert [(r.samples, r.micro_steps, r.evaluations) for r in telemetry.records] == [
        (12, 2, 0),
        (12, 2, 1),
        (12, 2, 0),
    ]
    assert watch.module is model
    model(torch.randn(3, 4))  # hooks removed: nothing more is counted
    assert len(telemetry.records) == 3


class Wrapper(nn.Module):
    """Stands for a DDP model: `.module` is what it wraps."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_evaluations_on_the_wrapped_module_past_the_wrapper_count_on_the_wrappers_telemetry():
    # Hugging Face's Trainer trains the DDP model and evaluates the module inside it
    telemetry, model = StepTelemetry(), Net()
    wrapper = Wrapper(model)
    watch = BareEvaluations(wrapper, telemetry)
    try:
        wrapper(torch.randn(2, 4))  # training, through the wrapper: not an evaluation
        model(torch.randn(2, 4))  # training on the bare module (not a step either way)
        with torch.no_grad():
            model(torch.randn(2, 4))
            wrapper(torch.randn(2, 4))  # through the wrapper: the wrapper counts its own
        model.eval()
        model(torch.randn(2, 4))
    finally:
        watch.remove()
    assert telemetry.marks.evaluations == 2
    with torch.no_grad():
        model(torch.randn(2, 4))  # hooks removed
    assert telemetry.marks.evaluations == 2
