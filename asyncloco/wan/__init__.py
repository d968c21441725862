"""Emulating wide-area links: a userspace TCP fault proxy (:mod:`asyncloco.wan.proxy`: latency, bandwidth,
loss stalls, resets, partitions), a cluster whose coordinator is reachable only through it
(:mod:`asyncloco.wan.cluster`), and network namespaces with ``tc tbf`` bandwidth (:mod:`asyncloco.wan.netns`).
See docs/wan.md. (No imports here: ``python -m asyncloco.wan.proxy`` runs the module as a script.)"""
