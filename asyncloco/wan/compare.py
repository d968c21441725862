"""A WAN run's quality against its twin's at equal tokens (docs/wan.md, the acceptance of ``home150``).

Both runs' evaluations come from their coordinators' journals (``<out>/coordinator/events.jsonl``, the ``eval``
records: perplexity at ``local_updates`` local steps, i.e. at equal tokens, every step being ``batch_size`` rows).
Between two evaluations a curve is interpolated log-linearly (perplexity is exp(loss): linear in the loss). Three
readings:

* ``last_third``: the geometric mean of run / twin at the run's evaluations in the last third of the local steps both
  reached (the rule docs/wan.md's tables use);
* ``at_end``: run / twin at the run's last evaluation within those steps;
* ``lag``: per evaluation of the run, how many local steps later it reached the perplexity that the twin reached
  first — a gap made once (a cold start) stays constant in steps while its ratio shrinks as the curves flatten; one
  made all along grows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["Curve", "read_curve", "perplexity_at", "steps_to", "compare"]

Curve = list[tuple[int, float]]  # (local steps, perplexity), in the order evaluated


def read_curve(run_dir: Path) -> Curve:
    """The ``eval`` records of ``run_dir``'s coordinator journal; a clear error where there is none."""
    journal = Path(run_dir) / "coordinator" / "events.jsonl"
    if not journal.is_file():
        raise ValueError(f"{journal} does not exist: pass the --out directory of a finished `scripts/wan.py run`")
    curve: Curve = []
    with journal.open() as lines:
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                if line.endswith("\n"):
                    raise ValueError(f"{journal}:{number}: not a JSON record ({error})") from None
                break  # a last line cut short by a stop: the records before it stand
            if record.get("type") == "eval":
                curve.append((int(record["local_updates"]), float(record["perplexity"])))
    if len(curve) < 2:
        raise ValueError(f"{journal} has {len(curve)} evaluation(s); a comparison needs at least two")
    return curve


def perplexity_at(curve: Curve, steps: float) -> float | None:
    """The curve's perplexity at ``steps`` local steps (log-linear between its evaluations); None outside them."""
    for (s0, p0), (s1, p1) in zip(curve, curve[1:]):
        if s0 <= steps <= s1:
            w = 0.0 if s1 == s0 else (steps - s0) / (s1 - s0)
            return math.exp((1 - w) * math.log(p0) + w * math.log(p1))
    return None


def steps_to(curve: Curve, perplexity: float) -> float | None:
    """The local steps at which the curve first reaches ``perplexity`` (log-linear between evaluations); None if never."""
    for (s0, p0), (s1, p1) in zip(curve, curve[1:]):
        if p0 >= perplexity >= p1 and p0 != p1:
            w = (math.log(p0) - math.log(perplexity)) / (math.log(p0) - math.log(p1))
            return s0 + w * (s1 - s0)
    return None


def compare(run: Curve, twin: Curve) -> dict[str, Any]:
    """``run`` against ``twin`` at equal local steps (the module's three readings)."""
    common = min(run[-1][0], twin[-1][0])
    logs: list[float] = []
    end: tuple[int, float] | None = None
    for steps, ppl in run:
        if steps > common:
            break
        theirs = perplexity_at(twin, steps)
        if theirs is None:
            continue
        end = (steps, ppl / theirs)
        if steps >= 2 * common / 3:
            logs.append(math.log(ppl / theirs))
    if not logs or end is None:
        raise ValueError(f"no evaluation of the run in the last third of the {common} local steps both reached")
    lag = []
    for steps, ppl in run:
        reached = steps_to(twin, ppl)
        if steps > 0 and reached is not None:
            lag.append({"local_steps": steps, "perplexity": round(ppl, 2), "twin_reached_it_at": round(reached),
                        "lag_steps": round(steps - reached)})
    return {
        "common_local_steps": common,
        "last_third": round(math.exp(sum(logs) / len(logs)), 4),
        "last_third_evaluations": len(logs),
        "at_end": {"local_steps": end[0], "ratio": round(end[1], 4)},
        "lag": lag,
    }
