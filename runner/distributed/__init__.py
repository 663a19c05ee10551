"""Tensor- and data-parallel execution of the embedded runner on ``torch.distributed``.

``comm`` owns the process groups (``torchrun`` launches the processes; ``init_comm`` joins
them), ``tp`` the vocabulary-parallel reductions the sharded model modules call, ``load`` the
shard-by-shard weight loading, ``engine`` the :class:`DistributedEngine`, ``dp`` the
round-boundary agreement of data-parallel ranks and ``failure`` how a rank's failure reaches
ranks blocked in a collective (notes in the rendezvous store). See docs/distributed.md.
"""
