"""The gates on the evaluation suite and their verdict word: pass, fail or repeat-required.

Each check compares a number with its limit and says one word. Where the number is an estimate with a
window-level interval (the mean KLD, the reduction vs the baseline) the word comes from the interval
(:func:`mixquant.kld.windows.verdict`): ``pass`` when it clears the limit, ``fail`` when it misses it
entirely, ``repeat-required`` when it straddles it -- more windows would decide. Point checks say pass or
fail. The candidate's word is ``fail`` if any check fails, else ``repeat-required`` if any check says so,
else ``pass``; only ``pass`` passes.

Checks (a limit of None skips its check):

* ``max_mean_kld`` -- the mean KLD's interval at or under the limit.
* ``max_run_spread`` -- the spread of the runs' suite means (0 for a deterministic engine).
* ``min_improvement`` -- the reduction vs the baseline: its interval at or over the limit.
* ``above_noise_floor`` -- the point reduction in nats (baseline mean - candidate mean) above the runtime
  noise floor of repeated reference captures (kquant's rule: a gain inside the noise is no gain).
* ``max_domain_regression`` -- every domain's point reduction vs the baseline at least ``-limit`` (0.0: no
  domain may be worse than the baseline); the value is the worst domain's.
* ``max_engine_floor`` -- the engine floor (the BF16 model through the gated engine against the reference
  path), gated on, never subtracted.
* ``require_exact_zero`` (the BF16 self-check on an exact engine) and ``identical_runs`` (a deterministic
  engine): exact conditions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mixquant.kld.windows import verdict

WORDS = ("pass", "repeat-required", "fail")


def _check(name: str, value: Any, limit: Any, word: str) -> dict[str, Any]:
    return {"name": name, "value": value, "limit": limit, "word": word, "passed": word == "pass"}


def _point(name: str, value: float | None, limit: float, ok: bool) -> dict[str, Any]:
    bad = value is None or (isinstance(value, float) and math.isnan(value))
    return _check(name, value, limit, "pass" if ok and not bad else "fail")


def suite_checks(
    gates: Mapping[str, Any],
    *,
    mean: Mapping[str, Any],
    aggregate: Mapping[str, Any],
    improvement: Mapping[str, Any] | None,
    baseline_mean: float | None,
    noise_floor: float | None,
    engine_floor: float | None,
) -> list[dict[str, Any]]:
    """The suite's checks (see the module docstring). ``mean``: :func:`~mixquant.kld.windows.window_mean`
    of the candidate; ``improvement``: :func:`~mixquant.kld.windows.window_bootstrap` vs the baseline."""
    checks = []
    limit = gates.get("max_mean_kld")
    if limit is not None:
        word = verdict(mean["ci_low"], mean["ci_high"], float(limit), higher_is_better=False)
        checks.append(_check("max_mean_kld", mean["mean"], float(limit), word))
    limit = gates.get("max_run_spread")
    if limit is not None:
        spread = float(aggregate["run_spread"])
        checks.append(_point("max_run_spread", spread, float(limit), spread <= float(limit)))
    limit = gates.get("min_improvement")
    if limit is not None:
        if improvement is None:
            checks.append(_check("min_improvement", None, float(limit), "fail"))
        else:
            word = verdict(improvement["ci_low"], improvement["ci_high"], float(limit))
            checks.append(_check("min_improvement", improvement["reduction"], float(limit), word))
    if improvement is not None and baseline_mean is not None and noise_floor is not None:
        gain = float(baseline_mean) - float(mean["mean"])
        checks.append(_point("above_noise_floor", gain, float(noise_floor), gain > float(noise_floor)))
    limit = gates.get("max_domain_regression")
    if limit is not None and improvement is not None:
        worst = min(float(d["reduction"]) for d in improvement["domains"].values())
        checks.append(_point("max_domain_regression", worst, -float(limit), worst >= -float(limit)))
    limit = gates.get("max_engine_floor")
    if limit is not None:
        ok = engine_floor is not None and engine_floor <= float(limit)
        checks.append(_point("max_engine_floor", engine_floor, float(limit), ok))
    if gates.get("require_exact_zero"):
        means = [float(m) for m in aggregate["mean_kld_runs"]]
        worst = max(means, key=lambda m: (math.isnan(m), abs(m)))
        checks.append(_point("require_exact_zero", worst, 0.0, all(m == 0.0 for m in means)))
    return checks


def overall(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"word", "passed", "checks"}``: the worst word of the checks (no checks: pass)."""
    words = [c["word"] for c in checks]
    word = "fail" if "fail" in words else ("repeat-required" if "repeat-required" in words else "pass")
    return {"word": word, "passed": word == "pass", "checks": checks}
