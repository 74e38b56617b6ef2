#!/usr/bin/env python
"""Train the committed tiny instances of the MoE families beyond Laguna and pin them by content.

One instance per model type of :data:`mixquant.model.instances.INSTANCE_GEOMETRY` (Qwen3-MoE, DeepSeek-V3,
GLM-4 MoE, Mixtral, MiniMax-M2): transformers' own class with the family's shape, trained on the committed
corpus ``data/corpus/python-stdlib-chat.jsonl`` with the toy's tokenizer (``data/toy-laguna``) by the toy's
recipe (:func:`mixquant.model.instances.build_family_instance`), written to ``data/instances/<model_type>/``.
``data/instances/instances.json`` pins each directory's content SHA-256 (the identity ``model.local.sha256``
takes, :func:`mixquant.model.fetch.local_dir_identity`).

Training is deterministic for one machine and thread count, not across CPUs: a rebuild on another machine
gives other weights (and other pins). The committed files are the instances; ``--check`` verifies that
they match their pins without training.

Usage::

    .venv/bin/python tools/make_family_instances.py [--models qwen3_moe,...] [--threads 2] [--check]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from mixquant.calibration.disjoint import read_jsonl  # noqa: E402
from mixquant.model.fetch import identity_sha256, local_dir_identity  # noqa: E402
from mixquant.model.instances import INSTANCE_MODEL_TYPES, PINS_FILE, build_family_instance  # noqa: E402

CORPUS = REPO / "data" / "corpus" / "python-stdlib-chat.jsonl"
TOKENIZER = REPO / "data" / "toy-laguna"
OUT = REPO / "data" / "instances"


def content_pin(directory: Path) -> str:
    return identity_sha256(local_dir_identity(directory))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(INSTANCE_MODEL_TYPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="verify the committed instances' pins only")
    args = parser.parse_args(argv)
    pins_path = OUT / PINS_FILE
    pins = json.loads(pins_path.read_text()) if pins_path.exists() else {}
    models = args.models.split(",")
    if args.check:
        bad = [m for m in models if pins.get(m) != content_pin(OUT / m)]
        for model in bad:
            print(f"{OUT / model}: content differs from its pin in {pins_path}", file=sys.stderr)
        return 1 if bad else 0
    conversations = [row["messages"] for row in read_jsonl(CORPUS)]
    for model_type in models:
        with tempfile.TemporaryDirectory(dir=REPO) as scratch:
            built = Path(scratch) / model_type
            report = build_family_instance(
                model_type,
                built,
                conversations=conversations,
                tokenizer_dir=TOKENIZER,
                seed=args.seed,
                threads=args.threads,
            )
            target = OUT / model_type
            if target.exists():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            built.rename(target)
        pins[model_type] = content_pin(target)
        pins_path.write_text(json.dumps(dict(sorted(pins.items())), indent=2) + "\n")
        loss = report["loss"]
        print(
            f"{model_type}: held-out loss {loss['heldout']:.3f} (uniform {loss['uniform']:.3f}), "
            f"{report['timings_s']['total']:.0f} s, pin {pins[model_type][:12]}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
