"""What adapts during training: `noise_meter.py` measures the gradient noise scale (from the
engine's norms, see engine/noise_scale.py for the estimator), `auto_batch.py` grows the global
batch by it (--global-batch auto), `adascale.py` scales the learning rate by AdaScale's gain."""
