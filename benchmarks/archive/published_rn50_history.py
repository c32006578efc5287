"""The ResNet-50 README's earlier training-performance tables: cases added by issue #33 (session 12).

NVIDIA DeepLearningExamples' PyTorch ResNet-50 v1.5 README published the same 1 -> 8 GPU tables on
the same systems in three versions before the one the study uses (pytorch-21.03, published_cases.py).
Two are kept here, each with its own input pipeline as the README's benchmark commands of that
version set it:

- pytorch-20.06 (commit 46ff3707, 2020-06-27): `main.py` run directly; its default data backend
  is `dali-cpu` (DALI decoding on the host's CPUs) with 5 loader threads (`-j` default), apex AMP,
  NCHW; per-GPU batch from the README's table (256, FP32 on DGX-1: 128).
- pytorch-20.12 (commit 097c7ff9, 2021-03-04): `launch.py` with `configs.yml`, `data_backend:
  pytorch` (the PyTorch DataLoader, 8 workers per GPU on DGX-1, 16 on DGX A100), native AMP, NHWC
  for AMP; batch 256 (FP32 on DGX-1: 112).

They were collected after the held-out results and the band rule were fixed, so they are in neither
half and not in the band; they are predicted with the training half's parameters and reported apart
(docs/performance-model.md, "Published results"). They were added to test the diagnosis of the
mixed-precision ResNet-50 misses: whether the shortfall follows mixed precision (fp16 compute and
its communication) or the input pipeline.
"""

from __future__ import annotations

from published import FITTED
from published_case import FitParams, PublishedCase, reproduce
from published_posthoc import PosthocStudy

_SOURCE = (
    "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md at commit "
    "{commit} ({container}), 'Training performance: {table}'"
)
_VERSIONS = {
    "pytorch-20.06": (
        "46ff3707",
        "data backend dali-cpu (main.py's default; the benchmark commands pass none), 5 loader threads",
    ),
    "pytorch-20.12": ("097c7ff9", "data_backend: pytorch (configs.yml), 8 / 16 loader workers per GPU"),
}
_TABLES = {
    ("pytorch-20.06", "DGX A100"): "NVIDIA DGX A100 (8x A100 40GB)",
    ("pytorch-20.12", "DGX A100"): "NVIDIA DGX A100 (8x A100 80GB)",
    ("pytorch-20.06", "DGX-1 16G"): "NVIDIA DGX-1 16GB (8x V100 16GB)",
    ("pytorch-20.12", "DGX-1 16G"): "NVIDIA DGX-1 16GB (8x V100 16GB)",
    ("pytorch-20.06", "DGX-1 32G"): "NVIDIA DGX-1 32GB (8x V100 32GB)",
    ("pytorch-20.12", "DGX-1 32G"): "NVIDIA DGX-1 32GB (8x V100 32GB)",
}
# (container, system, precision, per-GPU batch, img/s on 1 GPU, img/s on 8, strong scaling as printed)
_ROWS = (
    ("pytorch-20.06", "DGX A100", "TF32", 256, 680.15, 5379.82, 7.91),
    ("pytorch-20.06", "DGX A100", "mixed precision", 256, 1240.81, 9604.92, 7.74),
    ("pytorch-20.06", "DGX-1 16G", "FP32", 128, 373.21, 2899.62, 7.77),
    ("pytorch-20.06", "DGX-1 16G", "mixed precision", 256, 856.52, 6635.90, 7.75),
    ("pytorch-20.06", "DGX-1 32G", "FP32", 128, 359.76, 2813.23, 7.82),
    ("pytorch-20.06", "DGX-1 32G", "mixed precision", 256, 816.00, 6347.26, 7.78),
    ("pytorch-20.12", "DGX A100", "TF32", 256, 945, 7365, 7.78),
    ("pytorch-20.12", "DGX A100", "mixed precision", 256, 2461, 15977, 6.49),
    ("pytorch-20.12", "DGX-1 16G", "FP32", 112, 371, 2851, 7.66),
    ("pytorch-20.12", "DGX-1 16G", "mixed precision", 256, 1180, 7608, 6.44),
    ("pytorch-20.12", "DGX-1 32G", "FP32", 112, 365, 2811, 7.68),
    ("pytorch-20.12", "DGX-1 32G", "mixed precision", 256, 1115, 7375, 6.61),
)
_HOST_CORES = {"DGX A100": 128, "DGX-1 16G": 40, "DGX-1 32G": 40}


def history_cases() -> list[PublishedCase]:
    """Every row of the two versions' tables, in the README's order."""
    out = []
    for container, system, precision, batch, one, eight, strong in _ROWS:
        a100 = system == "DGX A100"
        gpu = "A100" if a100 else "V100"
        commit, pipeline = _VERSIONS[container]
        out.append(
            PublishedCase(
                name=f"NVIDIA ResNet-50 v1.5 ({container}), {precision}, 8 x {gpu} ({system})",
                family=f"dle-rn50-{container}-{system.lower().replace(' ', '-')}",
                source=_SOURCE.format(commit=commit, container=container, table=_TABLES[container, system]),
                model="ResNet-50 v1.5 (25.6 M)",
                params=25.6e6,
                bytes_per_param=4,  # fp32 gradients: apex AMP O1 and native AMP keep them
                per_gpu_batch=batch,
                single_gpu_step_ms=1000 * batch / one,
                step_source=f"the same table: {one} img/s on 1 GPU ({eight} on 8)",
                backward_fraction=2 / 3,
                interconnect=(
                    f"{system}: 8 {gpu}, "
                    + ("NVLink 3 (NVSwitch)" if a100 else "NVLink 2 (hybrid cube mesh)")
                ),
                intra="nvlink3" if a100 else "nvlink2",
                inter="8xib-hdr200" if a100 else "4xib-edr100",
                workers_per_node=8,
                algorithm="auto",
                bucket_mb=25.0,
                overlap=True,
                baseline_gpus=1,
                gpus=8,
                published_efficiency=strong / 8,
                how=f"strong scaling column ({strong}x) / 8: img/s on 8 GPUs / on 1, batch per GPU fixed",
                notes=f"Input pipeline: {pipeline}.",
                host_cores=_HOST_CORES[system],
            )
        )
    return out


def history_study(params: FitParams = FITTED) -> PosthocStudy:
    """Every case predicted with the training half's parameters."""
    return PosthocStudy(params, [reproduce(c, params) for c in history_cases()])
