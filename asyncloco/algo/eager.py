"""The eager start (``schedule.eager_start``, docs/algorithm.md "The eager start").

With overlapped rounds a peer's next lease is granted while its last update is still on its way: the lease's θ does
not hold that update yet, and the peer — of all peers — trains as if it had never sent it. On a slow uplink that is a
whole lease of the peer's own work missing from where it starts (the simulator's floor at `home150`'s lease length:
1.07–1.10 × the loopback setting, docs/wan.md). The eager start moves the lease's start by the share ``s`` of that
update, the step the outer optimizer will take with it (Delayed Nesterov steps by its learning rate times the update;
``s`` defaults to the outer learning rate)::

    start = θ(base) − s · decode(C(Δ_k))

where ``decode(C(Δ_k))`` is the update of the peer's kept lease ``k`` exactly as the coordinator decodes it. The
coordinator decides it at the grant (``Lease.eager_of``: the peer's lease still out when the new one is issued, so
its update is not in the new lease's θ); the peer says in its submission whether it did shift (a peer that lost the
message, or saw ``k`` refused, trains from θ itself); the coordinator accepts a shifted submission only if it
accepted ``k``; and a re-run of a checked lease starts from the same point, computed by the same function
(coordinator/rerun.py ``start_theta``).

Bitwise on every device: the shift is two elementwise fp32 operations on the CPU (a product, then a difference —
each correctly rounded, so no fused multiply-add or vector width changes a bit), done before θ goes to the device.
"""

from __future__ import annotations

import torch

__all__ = ["eager_start"]


def eager_start(theta: torch.Tensor, update: torch.Tensor, share: float) -> torch.Tensor:
    """``θ − share · update`` in fp32 on the CPU, as a new tensor (``theta`` and ``update`` unchanged)."""
    if theta.shape != update.shape:
        raise ValueError(f"the eager start's update has shape {tuple(update.shape)}, θ has {tuple(theta.shape)}")
    step = update.detach().to("cpu", torch.float32).mul(float(share))
    return theta.detach().to("cpu", torch.float32).sub(step)
