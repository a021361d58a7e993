"""The peer tier's network service (docs/tiers.md): daemons hold each other's newest
shares in memory. The only place where daemons talk to each other: the wire, the
holder, the ``ckptd-peer-serve`` and ``ckptd-peer-send`` threads. The tier itself, as
the readers and the daemon see it, is ``ckptd.tiers.peer`` (``PeerReplica``) and
``ckptd.tiers.peer_reader`` (``PeerTier``).
"""
