"""Tensor- and data-parallel execution of the embedded runner on ``torch.distributed``.

``comm`` owns the process groups (``torchrun`` launches the processes; ``init_comm`` joins
them), ``tp`` the vocabulary-parallel reductions the sharded model modules call, ``load`` the
shard-by-shard weight loading, ``engine`` the :class:`DistributedEngine` and ``dp`` the
round-boundary agreement of data-parallel ranks. See docs/distributed.md.
"""
