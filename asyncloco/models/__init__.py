"""What is trained: the workload seam and the language-model workload.

* ``workload``  — the :class:`Workload` seam (flat θ, shards in batches, leases → batches, evaluate);
* ``config``    — ``LMTaskConfig``, the ``task: {kind: lm}`` section (cheap to import);
* ``presets``   — paper 20m / 60m / 150m and CPU tiny / small ``LlamaForCausalLM`` models;
* ``tokenizer`` — the project byte-level BPE (``asyncloco/data/tokenizer``) and ``load_tokenizer``;
* ``corpus``    — the embedded public-domain English corpus;
* ``data``      — streaming through ``datasets``, packing, cache, held-out split, shards;
* ``prepared``  — prepared corpora: ``asyncloco data prepare``'s shard files + manifest, verified memory-mapped reads;
* ``lm``        — ``LMWorkload`` / ``build_lm_workload``;
* ``export``    — a trained model as a ``from_pretrained`` directory with its tokenizer.

Nothing is imported here, so ``import asyncloco.models.workload`` stays free of transformers.
"""
