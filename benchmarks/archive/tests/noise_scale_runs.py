"""Runs of benchmarks/archive/noise_scale_validation.py as its `_train_seed` returns them, for the tests
of its arithmetic and options (test_noise_scale_report.py, test_noise_scale_validation.py beside it)."""


def seed_runs(seed, steps, *, trace=400.0, grad_sq=10.0, adam=None, base=8):
    """One seed's runs as _train_seed returns them (sums over the run's steps)."""
    return [
        {
            "task": "t",
            "seed": seed,
            "multiplier": k,
            "global_batch": k * base,
            "steps_to_target": s,
            "coarse_hit": False,
            "trace_sum": trace,
            "grad_sq_sum": grad_sq,
            "late_noise_scale": trace / grad_sq,
            "adam_trace_sum": None if adam is None else adam[0],
            "adam_grad_sq_sum": None if adam is None else adam[1],
            "mean_gain": 1.0,
            "wall_s": 0.0,
        }
        for k, s in zip((1, 2, 4, 8, 16), steps, strict=True)
    ]
