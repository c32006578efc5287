"""Lightning's own BoringModel trained by `Trainer(strategy="ddp")` and by `strategy="dpscale"`,
2 CPU processes that Lightning launches itself; the weights after training must be equal.

    python scripts/dropin/lightning_boring.py        # runs both strategies, compares

(Each strategy runs as `lightning_boring.py STRATEGY OUT.pt`: Lightning starts rank 1 by running
the same command line again.) Gradient accumulation (Lightning's no_sync) and clipping are on.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import dpscale.integrations.lightning  # noqa: F401  registers strategy="dpscale"


def fit(strategy: str, out: str) -> None:
    L.seed_everything(7)
    model = BoringModel()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        limit_train_batches=8,
        limit_val_batches=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), out)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        weights = {}
        for strategy in ("ddp", "dpscale"):
            out = str(Path(tmp) / f"{strategy}.pt")
            subprocess.run([sys.executable, __file__, strategy, out], check=True)
            weights[strategy] = torch.load(out)
    L.seed_everything(7)
    initial = BoringModel().state_dict()
    equal = all(torch.equal(weights["ddp"][k], weights["dpscale"][k]) for k in initial)
    moved = max((weights["ddp"][k] - initial[k]).abs().max().item() for k in initial)
    print(f"BoringModel, Trainer(strategy='dpscale') vs 'ddp': weights equal: {equal} (moved {moved:.3f})")
    return 0 if equal else 1


if __name__ == "__main__":
    if len(sys.argv) == 3:
        fit(*sys.argv[1:])
    else:
        sys.exit(main())
