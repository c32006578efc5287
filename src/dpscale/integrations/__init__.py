"""dpscale's engine inside the training frameworks people already use (each needs its package).

- `dpscale.integrations.lightning`: `DPScaleStrategy`, registered as `Trainer(strategy="dpscale")`.
- `dpscale.integrations.accelerate`: `Accelerator`, whose `prepare` wraps models in dpscale's engine.

Install with `pip install dpscale[integrations]`. Nothing here is imported by `import dpscale`.
"""
