"""gpu-check.json from the outputs of scripts/gpu-check.sh's stages (standard library only).

Reads OUTPUT_DIR/stages.tsv (name, status, exit code, seconds[, note] per stage), each stage's
output (<stage>.txt), engine-bench.json, env.json and profile.json; checks what the stages' exit
codes cannot say (the resumed run ended where it should, the profile was taken on the GPU, the
bench met its target); writes OUTPUT_DIR/gpu-check.json and exits 1 unless every stage passed
(or was skipped with a note) and every check holds.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

RESUMED_STEPS = 150  # gpu-check.sh: 120 steps with a checkpoint every 60, then --resume to 150


def read_stages(out: Path) -> dict[str, dict]:
    stages = {}
    for line in (out / "stages.tsv").read_text().splitlines():
        name, status, rc, seconds, *note = line.split("\t")
        stages[name] = {"status": status, "rc": int(rc), "seconds": int(seconds)}
        if note:
            stages[name]["note"] = note[0]
    return stages


def last_json(path: Path):
    """The JSON document on the last line of `path` that starts one (None: none, or no file)."""
    for line in reversed(path.read_text().splitlines() if path.exists() else []):
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def checks(
    first: dict | None, resumed: dict | None, bench: dict | None, profile: dict | None, predict
) -> dict:
    def finite(x) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x)

    return {
        "train_past_step_100": bool(first and first.get("steps", 0) >= 120 and first.get("checkpoint")),
        "resume_from_checkpoint": bool(
            resumed
            and resumed.get("resumed_from_step") in (60, 120)
            and resumed.get("steps") == RESUMED_STEPS
            and finite(resumed.get("final_loss"))
        ),
        "bench_within_target": bool(bench and bench.get("within_target")),
        "predict_from_gpu_profile": bool(predict) and (profile or {}).get("device") == "cuda",
    }


def report(out: Path) -> dict:
    stages = read_stages(out)
    first, resumed = last_json(out / "train.txt"), last_json(out / "train-resume.txt")
    bench, profile = load(out / "engine-bench.json"), load(out / "profile.json")
    predict = last_json(out / "predict.txt")
    found = checks(first, resumed, bench, profile, predict)
    failed = [n for n, s in stages.items() if s["status"] not in ("pass", "skip")]
    failed += [n for n, ok in found.items() if not ok]
    return {
        "ok": not failed,
        "failed": failed,
        "environment": load(out / "env.json"),
        "stages": stages,
        "checks": found,
        "seconds": sum(s["seconds"] for s in stages.values()),
        "bench": bench,
        "train": {"first": first, "resumed": resumed},
        "profile": profile,
        "predict": predict,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: gpu_check_report.py OUTPUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    doc = report(out)
    (out / "gpu-check.json").write_text(json.dumps(doc, indent=2))
    print(json.dumps({k: doc[k] for k in ("ok", "failed", "checks", "seconds")}))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
