"""The evaluation suite is held out: a document that shares content with the calibration data stops
planning (snakemake -n and mixquant plan) with one line naming the domain, the file and the document."""

from __future__ import annotations

import hashlib

from tests.workflow.conftest import REPO


def _leaky_config(workdir) -> str:
    corpus = (REPO / "data" / "corpus" / "python-stdlib-chat.jsonl").read_text(encoding="utf-8").splitlines()
    chat = (REPO / "data" / "eval" / "chat.jsonl").read_text(encoding="utf-8").splitlines()
    leaky = workdir.root / "leaky-chat.jsonl"
    leaky.write_text("\n".join([*chat[:5], corpus[17], *chat[5:]]) + "\n", encoding="utf-8")
    config = workdir.config()
    (domain,) = [d for d in config["kld"]["eval"]["domains"] if d["name"] == "chat"]
    domain["local"] = {"path": leaky.name, "sha256": hashlib.sha256(leaky.read_bytes()).hexdigest()}
    return workdir.write_config("config/leaky.yaml", config)


def test_a_window_shared_with_calibration_stops_planning_in_one_line(workdir):
    configfile = _leaky_config(workdir)
    expected = (
        "kld.eval domain 'chat': document 5 of leaky-chat.jsonl shares content with the calibration dataset "
        "data/corpus/python-stdlib-chat.jsonl"
    )
    result = workdir.snakemake("-n", "--configfile", configfile, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("mixquant:")]
    assert result.returncode != 0 and len(errors) == 1 and expected in errors[0], result.stderr
    assert "evaluation windows must be held out" in errors[0]
    cli = workdir.mixquant("plan", "--configfile", configfile, check=False)
    assert cli.returncode == 2 and expected in cli.stderr and len(cli.stderr.strip().splitlines()) == 1


def test_the_shipped_suite_plans(workdir):
    """The default config's three domains are disjoint from its calibration corpus: planning passes and
    plans sample_eval and the suite's reference."""
    plan = workdir.plan()
    assert plan["sample_eval"] == 1 and plan["reference_logits"] == 2
