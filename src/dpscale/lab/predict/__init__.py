"""Performance model: predict data-parallel step time and scaling efficiency from a one-worker profile.

- `costs`: alpha-beta cost of one all-reduce per algorithm (ring, tree, halving-doubling, hierarchical).
- `cluster`: the machines (links, workers per node), named presets, calibration from an all-reduce bench.
- `profile`: what one worker spends on forward, backward and the optimizer, and when buckets are ready.
- `timeline`: backward overlapped with bucket reductions; what stays exposed.
- `model`: the prediction per world size, with its bottleneck in words.
- `degrade`: what degrades large jobs (stragglers, achieved bandwidth, congestion, interference).

The checks against measurement (local runs, emulated clusters, published results) live in
benchmarks/predict_lab/, outside the installed package.

docs/performance-model.md gives the formulas and their sources.
"""

from dpscale.lab.predict.cluster import Cluster, Link
from dpscale.lab.predict.model import PredictConfig, Prediction, predict
from dpscale.lab.predict.profile import ModelProfile

__all__ = ["Cluster", "Link", "ModelProfile", "PredictConfig", "Prediction", "predict"]
