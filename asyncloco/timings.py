"""Timing policy derived from the config: how long a lease request may be held. The coordinator's logic, its RPC
handler and the peer's ``assign`` call all wait on the same request, so the three limits come from one derivation
here, beside the config, where both the peer and the coordinator read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncloco.config import BARRIER_METHODS, METHOD_NAMES

if TYPE_CHECKING:
    from asyncloco.config import RunConfig

__all__ = ["HoldTimings", "hold_timings"]


@dataclass(frozen=True)
class HoldTimings:
    """How long a lease request may be held, at each of the three places that wait on it (one derivation, so they
    stay in order): ``logic`` — the coordinator's logic answers a request held this long "ask again"
    (``CoordinatorPolicy.hold_limit``); ``service`` — the RPC handler waits a little longer for that answer;
    ``client`` — the peer's ``assign`` timeout, longer still, so a held request is answered, never timed out."""

    logic: float
    service: float
    client: float


def hold_timings(cfg: "RunConfig") -> HoldTimings:
    """The hold timings of ``cfg``'s method: a barrier (sync DiLoCo) holds a request until its round closes (at most
    600 s), the asynchronous methods for their grace period plus 30 s."""
    if cfg.schedule.method not in METHOD_NAMES:
        raise ValueError(f"unknown method {cfg.schedule.method!r}; choose one of {sorted(METHOD_NAMES)}")
    logic = 600.0 if cfg.schedule.method in BARRIER_METHODS else cfg.schedule.grace_period + 30.0
    return HoldTimings(logic=logic, service=logic + 5.0, client=logic + 30.0)
