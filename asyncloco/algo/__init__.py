"""Pure algorithm core: outer optimizers, staleness transforms, DyLU, shard sampling, LR schedules,
grace decisions. Imports only torch / numpy / stdlib: no I/O, no clock, no hivemind, no global RNG."""
